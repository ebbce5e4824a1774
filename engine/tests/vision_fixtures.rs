//! The image path against `transformers`: preprocessing (`Kimi_K25ImageProcessor`), image
//! embeddings after the projector, and prompt logits / greedy tokens of
//! `Kimi_K25ForConditionalGeneration` with images, recorded by
//! `tests/reference/make_mm_fixtures.py` in `tests/fixtures/k25_tiny`. The checkpoint is also
//! loaded in the original Moonshot tensor spelling (a renamed copy).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tessera_engine::generate::{generate_with_images, prompt_logits_with_images, GenerateRequest};
use tessera_engine::reference::{rel_err, PromptRef};
use tessera_engine::vision::{
    expand_placeholders, ImageEmbedding, ImageError, ImageLimits, PlacedImage, VisionModel,
};
use tessera_engine::{Model, SamplingParams};

/// Relative tolerance of embeddings and logits (max |ours − ref| / max |ref|).
const REL_TOL: f32 = 1e-4;
/// Resized images: the reference runs PyTorch's uint8 antialiased bicubic (PIL's algorithm with
/// its own fixed-point precision), which `vision::resize_bicubic` implements exactly. Measured on
/// the 300x200 → 139x93 WebP: 0 steps of 255 on every value, so the bound is exact equality.
/// (PIL's own `Image.resize(BICUBIC)`, 22-bit weights, differs from it by 1 step on 0.3% of
/// the values of that image.)
const RESIZE_MAX_STEPS: f32 = 0.0;
const RESIZE_MAX_FRACTION: f64 = 0.0;
/// JPEG: PIL (libjpeg-turbo) and the `image` crate (zune-jpeg) use different IDCTs. Measured on
/// the 60x50 quality-90 4:4:4 fixture: at most 2 steps of 255, on 1.4% of the values; that moves
/// this tiny random model's embeddings by 3e-3 and the logits of a prompt holding the image by
/// 2e-3 (relative), hence the looser bounds for decoded JPEGs.
const JPEG_MAX_STEPS: f32 = 2.0;
const JPEG_REL_TOL: f32 = 1e-2;

#[derive(Deserialize)]
struct Reference {
    placeholder_token_id: u32,
    images: BTreeMap<String, ImageRef>,
    prompts: Vec<PromptRef>,
}

#[derive(Deserialize)]
struct ImageRef {
    file: String,
    grid_thw: [usize; 3],
    n_tokens: usize,
    resized: bool,
    pixels_file: String,
    embeds_file: String,
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/k25_tiny")
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(dir().join("mm_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn npy(name: &str) -> (Vec<usize>, Vec<f32>) {
    tessera_engine::npy::read_f32(&dir().join(name)).unwrap()
}

/// Normalised pixels back to 0..255 steps (mean 0.5, std 0.5): `x · 127.5`.
fn steps(a: f32, b: f32) -> f32 {
    ((a - b) * 127.5).abs()
}

fn image_bytes(r: &ImageRef) -> Vec<u8> {
    std::fs::read(dir().join(&r.file)).unwrap()
}

fn vision(d: &Path) -> VisionModel {
    VisionModel::load(d)
        .unwrap()
        .expect("k25_tiny has a vision tower")
}

#[test]
fn preprocessing_matches_the_image_processor() {
    let v = vision(&dir());
    for (name, r) in reference().images {
        let p = v.preprocess_image(&image_bytes(&r)).unwrap();
        assert_eq!(p.grid, r.grid_thw, "{name}: grid");
        let (shape, want) = npy(&r.pixels_file);
        assert_eq!(shape, vec![p.count(), 3, 14, 14], "{name}: shape");
        let worst = p
            .values
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max(steps(*a, *b)));
        let off = p
            .values
            .iter()
            .zip(&want)
            .filter(|(a, b)| steps(**a, **b) > 1e-3)
            .count();
        let fraction = off as f64 / want.len() as f64;
        eprintln!("{name}: max {worst} steps of 255, {off} values differ ({fraction:.4})");
        if r.file.ends_with(".jpg") {
            assert!(worst <= JPEG_MAX_STEPS + 1e-3, "{name}: {worst} steps");
        } else if r.resized {
            assert!(worst <= RESIZE_MAX_STEPS + 1e-3, "{name}: {worst} steps");
            assert!(fraction <= RESIZE_MAX_FRACTION, "{name}: {fraction} differ");
        } else {
            // Lossless decode, no resampling: the same floats.
            assert!(worst < 1e-3, "{name}: {worst} steps");
        }
    }
}

#[test]
fn embeddings_match_transformers() {
    let v = vision(&dir());
    assert_eq!(v.hidden_size(), 64);
    assert_eq!(v.placeholder_token_id(), reference().placeholder_token_id);
    for (name, r) in reference().images {
        let (pshape, pixels) = npy(&r.pixels_file);
        let (eshape, want) = npy(&r.embeds_file);
        assert_eq!(eshape, vec![r.n_tokens, v.hidden_size()]);
        // The tower and projector alone, on the reference's own pixels.
        let patches = tessera_engine::vision::Patches {
            grid: r.grid_thw,
            values: pixels,
        };
        assert_eq!(pshape[0], patches.count());
        let got = v.encode_patches(&patches);
        let err = rel_err(&got, &want);
        eprintln!("{name}: tower+projector relative error {err:e}");
        assert!(err <= REL_TOL, "{name}: relative error {err:e}");
        // From the bytes: exact pixels (PNG, WebP, resized or not) give the same bound; JPEG
        // pixels move the embeddings by what their decoder differences cause.
        let e = v.encode_image(&image_bytes(&r)).unwrap();
        assert_eq!((e.n_tokens, e.hidden), (r.n_tokens, v.hidden_size()));
        let err = rel_err(&e.values, &want);
        eprintln!("{name}: from bytes relative error {err:e}");
        let tol = if r.file.ends_with(".jpg") {
            JPEG_REL_TOL
        } else {
            REL_TOL
        };
        assert!(err <= tol, "{name}: from bytes relative error {err:e}");
    }
}

fn reference_embedding(r: &ImageRef, hash_of: &[u8]) -> Arc<ImageEmbedding> {
    let (_, values) = npy(&r.embeds_file);
    Arc::new(ImageEmbedding {
        content_hash: sha(hash_of),
        n_tokens: r.n_tokens,
        hidden: values.len() / r.n_tokens,
        values,
    })
}

fn sha(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// The prompt's images placed at their placeholder runs (the reference prompts are expanded).
fn placed(
    rf: &Reference,
    p: &PromptRef,
    embeds: &dyn Fn(&ImageRef) -> Arc<ImageEmbedding>,
) -> Vec<PlacedImage> {
    let counts: Vec<usize> = p.images.iter().map(|n| rf.images[n].n_tokens).collect();
    let (prompt, positions) =
        expand_placeholders(&p.prompt_ids, rf.placeholder_token_id, &counts).unwrap();
    assert_eq!(prompt, p.prompt_ids, "an expanded prompt is kept as it is");
    p.images
        .iter()
        .zip(positions)
        .map(|(n, position)| PlacedImage {
            position,
            embedding: embeds(&rf.images[n]),
        })
        .collect()
}

fn check_logits_and_greedy(model_dir: &Path) {
    let rf = reference();
    let model = Model::load(model_dir).unwrap();
    let v = vision(model_dir);
    for p in &rf.prompts {
        let (shape, want) = npy(&p.logits_file);
        assert_eq!(shape, vec![p.prompt_ids.len(), model.config.vocab_size]);
        // Embeddings from the reference isolate the text model; ours from the image bytes
        // check the whole path.
        let from_ref = placed(&rf, p, &|r| reference_embedding(r, &image_bytes(r)));
        let from_bytes = placed(&rf, p, &|r| {
            Arc::new(v.encode_image(&image_bytes(r)).unwrap())
        });
        for (what, images) in [
            ("reference embeddings", &from_ref),
            ("encoded", &from_bytes),
        ] {
            let got = prompt_logits_with_images(&model, &p.prompt_ids, images).unwrap();
            let err = rel_err(&got, &want);
            eprintln!("{}: {what}: logits relative error {err:e}", p.name);
            let jpeg = p.images.iter().any(|n| rf.images[n].file.ends_with(".jpg"));
            let tol = if what == "encoded" && jpeg {
                JPEG_REL_TOL
            } else {
                REL_TOL
            };
            assert!(err <= tol, "{}: {what}: relative error {err:e}", p.name);
            // Greedy, whole prompt and in chunks that cut images in two.
            for chunk in [None, Some(5), Some(8)] {
                let req = GenerateRequest {
                    prompt: p.prompt_ids.clone(),
                    max_new_tokens: p.greedy_ids.len(),
                    sampling: SamplingParams::default(),
                    stop_ids: vec![],
                    prefill_chunk: chunk,
                };
                let out = generate_with_images(&model, &req, images).unwrap();
                assert_eq!(out, p.greedy_ids, "{}: {what}, chunk {chunk:?}", p.name);
            }
        }
    }
}

#[test]
fn logits_and_greedy_tokens_with_images_match_transformers() {
    check_logits_and_greedy(&dir());
}

/// The same checkpoint in Moonshot's original spelling: text layers under
/// `language_model.model.layers.N`, `vision_tower.patch_embed.proj`, `mm_projector.pre_norm`.
#[test]
fn the_original_moonshot_tensor_names_load_too() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(dir().join(f), tmp.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let rename = |n: &str| -> String {
        n.replace(
            "language_model.model.blocks.",
            "language_model.model.layers.",
        )
        .replace(
            "vision_tower.encoder.patch_embed.",
            "vision_tower.patch_embed.",
        )
        .replace("model.mm_projector.", "mm_projector.")
    };
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (rename(&n), t))
        .collect();
    assert!(tensors
        .iter()
        .any(|(n, _)| n.starts_with("language_model.model.layers.0.")));
    assert!(!tensors
        .iter()
        .any(|(n, _)| n.contains(".blocks.") && n.starts_with("language_model")));
    safetensors::serialize_to_file(tensors, None, &tmp.path().join("model.safetensors")).unwrap();
    check_logits_and_greedy(tmp.path());
}

#[test]
fn a_text_only_model_has_no_vision_tower() {
    let kl = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kl_mixed");
    assert!(VisionModel::load(&kl).unwrap().is_none());
}

#[test]
fn bad_images_are_client_errors_with_clear_messages() {
    let mut v = vision(&dir());
    let rf = reference();
    let png = image_bytes(&rf.images["rgb_84x56"]);
    let jpg = image_bytes(&rf.images["photo_60x50"]);
    let webp = image_bytes(&rf.images["big_300x200"]);
    assert!(matches!(v.encode_image(&[]), Err(ImageError::Empty)));
    assert!(matches!(
        v.encode_image(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"),
        Err(ImageError::UnsupportedFormat(_))
    ));
    assert!(matches!(
        v.encode_image(b"hello, this is not an image"),
        Err(ImageError::UnknownFormat)
    ));
    for (what, data) in [("png", &png), ("jpeg", &jpg), ("webp", &webp)] {
        let cut = &data[..data.len() / 2];
        let err = match v.encode_image(cut) {
            Ok(_) => panic!("truncated {what} decoded"),
            Err(e) => e,
        };
        assert!(
            matches!(err, ImageError::Decode { .. }),
            "truncated {what}: {err}"
        );
        assert!(err.to_string().contains("cannot decode"), "{err}");
    }
    // PNG headers (valid CRCs) that claim 0 x 5 and 100000 x 100000 pixels: refused from the
    // header, before anything is decoded.
    let err = v.encode_image(&png_header(0, 5)).unwrap_err();
    assert!(
        matches!(err, ImageError::ZeroSize { .. } | ImageError::Decode { .. }),
        "{err}"
    );
    let err = v.encode_image(&png_header(100_000, 100_000)).unwrap_err();
    assert!(matches!(err, ImageError::SideTooLong { .. }), "{err}");
    let err = v.encode_image(&png_header(16_000, 16_000)).unwrap_err();
    assert!(matches!(err, ImageError::TooManyPixels { .. }), "{err}");
    v.set_limits(ImageLimits {
        max_pixels: 1000,
        ..ImageLimits::default()
    });
    let err = v.encode_image(&png).unwrap_err();
    assert!(
        matches!(err, ImageError::TooManyPixels { pixels: 4704, .. }),
        "{err}"
    );
    v.set_limits(ImageLimits {
        max_bytes: 100,
        ..ImageLimits::default()
    });
    let err = v.encode_image(&png).unwrap_err();
    assert!(matches!(err, ImageError::TooManyBytes { .. }), "{err}");
    assert!(err.to_string().contains("limit is 100"), "{err}");
}

/// A PNG (8-bit RGB) whose header claims `width × height` and which holds no pixel data.
fn png_header(width: u32, height: u32) -> Vec<u8> {
    let mut chunk = b"IHDR".to_vec();
    chunk.extend_from_slice(&width.to_be_bytes());
    chunk.extend_from_slice(&height.to_be_bytes());
    chunk.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    for (len, body) in [(13u32, chunk), (0, b"IDAT".to_vec()), (0, b"IEND".to_vec())] {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    }
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// K3's tower and projector (K3-SPEC §3.5) are the same code with `norm_type: rmsnorm` and
/// `mm_projector_type: patchmergerv2`. No reference implementation exists to compare with, so
/// this checks what the switches must do: the tower's norms lose their bias and mean, and the
/// projector ends in an RMSNorm (unit weight here, so every output row has RMS 1).
#[test]
fn the_k3_vision_switches_change_the_norms_and_the_projector() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir().join("preprocessor_config.json"),
        tmp.path().join("preprocessor_config.json"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("config.json")).unwrap()).unwrap();
    cfg["vision_config"]["norm_type"] = "rmsnorm".into();
    cfg["vision_config"]["mm_projector_type"] = "patchmergerv2".into();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ones: Vec<u8> = (0..64).flat_map(|_| 1f32.to_le_bytes()).collect();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !n.contains("pre_norm"))
        .collect();
    tensors.push((
        "mm_projector.post_norm.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64], &ones).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &tmp.path().join("model.safetensors")).unwrap();

    let k3 = vision(tmp.path());
    let k25 = vision(&dir());
    let png = std::fs::read(dir().join("images/rgb_84x56.png")).unwrap();
    let a = k3.encode_image(&png).unwrap();
    let b = k25.encode_image(&png).unwrap();
    assert_eq!((a.n_tokens, a.hidden), (b.n_tokens, b.hidden));
    for r in 0..a.n_tokens {
        let row = a.row(r);
        let ms = row.iter().map(|x| x * x).sum::<f32>() / row.len() as f32;
        assert!((ms - 1.0).abs() < 1e-3, "row {r}: mean square {ms}");
    }
    assert!(
        rel_err(&a.values, &b.values) > 0.1,
        "the switches changed nothing"
    );
}

/// Real K2.5 checkpoints have a `deepseek_v3` text model, which the text engine does not run
/// yet: the vision tower still loads (the encoder needs nothing else), the text model is refused
/// with the reason.
#[test]
fn the_vision_tower_loads_whatever_the_text_family() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "preprocessor_config.json"] {
        std::fs::copy(dir().join(f), tmp.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["model_type"] = "deepseek_v3".into();
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    let v = vision(tmp.path());
    let png = std::fs::read(dir().join("images/rgb_84x56.png")).unwrap();
    let (_, want) = npy("embeds_rgb_84x56.npy");
    assert!(rel_err(&v.encode_image(&png).unwrap().values, &want) <= REL_TOL);
    let err = Model::load(tmp.path())
        .err()
        .expect("deepseek_v3 text is refused");
    assert!(err.to_string().contains("deepseek_v3"), "{err}");
}

/// An image smaller than one patch is padded to one merged token, as the processor does
/// (`navit_resize` never enlarges; padding fills the 2×2 patch block).
#[test]
fn a_one_pixel_image_is_one_token() {
    let v = vision(&dir());
    let mut png = std::io::Cursor::new(Vec::new());
    image::RgbImage::from_pixel(1, 1, image::Rgb([200, 10, 90]))
        .write_to(&mut png, image::ImageFormat::Png)
        .unwrap();
    let p = v.preprocess_image(png.get_ref()).unwrap();
    assert_eq!(p.grid, [1, 2, 2]);
    // The pixel, then zero padding: (x - 127.5) / 127.5.
    assert!((p.values[0] - (200.0 - 127.5) / 127.5).abs() < 1e-6);
    assert!((p.values[1] + 1.0).abs() < 1e-6);
    let e = v.encode_image(png.get_ref()).unwrap();
    assert_eq!((e.n_tokens, e.hidden), (1, 64));
    assert!(e.values.iter().all(|x| x.is_finite()));
}
