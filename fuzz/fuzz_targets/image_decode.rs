//! Arbitrary bytes as an image a client sent: decoded (PNG, JPEG or WebP, sniffed), checked
//! against the size limits, preprocessed and encoded by the tiny `kimi_k25` fixture's vision tower
//! ([`VisionModel::encode_image`]). A hostile file must be an [`ImageError`] (a 400 at the edge),
//! never a panic, an allocation past the limits or non-finite embeddings.

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_engine::vision::{decode_rgb, ImageLimits, VisionModel};

/// Tight limits keep every accepted input small enough to encode within the fuzzer's budget.
const LIMITS: ImageLimits = ImageLimits {
    max_bytes: 1 << 20,
    max_pixels: 1 << 20,
    max_side: 2048,
};

fn model() -> &'static VisionModel {
    static MODEL: OnceLock<VisionModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/k25_tiny");
        let mut m = VisionModel::load(&dir)
            .expect("the k25_tiny fixture loads")
            .expect("the fixture has a vision tower");
        m.set_limits(LIMITS);
        m
    })
}

fuzz_target!(|data: &[u8]| {
    let model = model();
    let decoded = decode_rgb(data, &LIMITS);
    let encoded = model.encode_image(data);
    match (decoded, encoded) {
        (Ok(img), Ok(emb)) => {
            assert!(img.width > 0 && img.height > 0);
            assert!(img.width as u64 * img.height as u64 <= LIMITS.max_pixels);
            assert_eq!(img.pixels.len(), img.width * img.height * 3);
            assert_eq!(emb.n_tokens, model.tokens_for_size(img.width, img.height));
            assert_eq!(emb.hidden, model.hidden_size());
            assert_eq!(emb.values.len(), emb.n_tokens * emb.hidden);
            assert!(emb.values.iter().all(|v| v.is_finite()));
        }
        (Err(_), Err(_)) => {}
        (d, e) => panic!(
            "decoding and encoding disagree: decode ok={} encode ok={}",
            d.is_ok(),
            e.is_ok()
        ),
    }
});
