//! The image commands as a user runs them: `tessera encode` and `tessera generate --image`,
//! checked against the `transformers` fixture in `tests/fixtures/k25_tiny`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use tessera_engine::reference::rel_err;

fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env("TESSERA_LOG", "error");
    c
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k25_tiny")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture().join("mm_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn ok(out: &Output) -> &Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn encode_writes_the_reference_embeddings() {
    let rf = reference();
    let tmp = tempfile::tempdir().unwrap();
    for (name, r) in rf["images"].as_object().unwrap() {
        let out = tmp.path().join(format!("{name}.npy"));
        let file = r["file"].as_str().unwrap();
        ok(&tessera()
            .args(["encode", "--model"])
            .arg(fixture())
            .arg("--image")
            .arg(fixture().join(file))
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap());
        let (shape, got) = tessera_engine::npy::read_f32(&out).unwrap();
        let (want_shape, want) =
            tessera_engine::npy::read_f32(&fixture().join(r["embeds_file"].as_str().unwrap()))
                .unwrap();
        assert_eq!(shape, want_shape, "{name}");
        // JPEG decoders differ slightly (see engine/tests/vision_fixtures.rs); the others are exact.
        let tol = if file.ends_with(".jpg") { 1e-2 } else { 1e-4 };
        let err = rel_err(&got, &want);
        assert!(err <= tol, "{name}: relative error {err:e}");
    }
}

#[test]
fn encode_reads_its_flags_from_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("e.npy");
    ok(&tessera()
        .arg("encode")
        .env("TESSERA_MODEL", fixture())
        .env("TESSERA_IMAGE", fixture().join("images/rgb_84x56.png"))
        .env("TESSERA_OUT", &out)
        .output()
        .unwrap());
    let (shape, _) = tessera_engine::npy::read_f32(&out).unwrap();
    assert_eq!(shape, vec![6, 64]);
}

/// `tessera generate --json` with images; its token ids.
fn generate(prompt: &[u32], images: &[&str], n: usize) -> Vec<u32> {
    let mut c = tessera();
    c.args(["generate", "--model"])
        .arg(fixture())
        .args(["--prompt-ids", &ids_arg(prompt)])
        .args(["--max-new-tokens", &n.to_string(), "--ignore-eos", "--json"]);
    for i in images {
        c.arg("--image").arg(fixture().join("images").join(i));
    }
    let out = c.output().unwrap();
    let v: Value = serde_json::from_slice(&ok(&out).stdout).unwrap();
    ids(&v["token_ids"])
}

#[test]
fn generate_with_images_prints_the_reference_tokens() {
    let rf = reference();
    let ph = rf["placeholder_token_id"].as_u64().unwrap() as u32;
    for p in rf["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["greedy_ids"]);
        let files: Vec<&str> = p["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let f = rf["images"][n.as_str().unwrap()]["file"].as_str().unwrap();
                f.strip_prefix("images/").unwrap()
            })
            .collect();
        // Already expanded, as the reference prompt is.
        assert_eq!(generate(&prompt, &files, want.len()), want, "{}", p["name"]);
        // One placeholder per image, as a client writes it.
        let mut short = Vec::new();
        for (i, &t) in prompt.iter().enumerate() {
            if t != ph || i == 0 || prompt[i - 1] != ph {
                short.push(t);
            }
        }
        assert!(short.len() < prompt.len());
        assert_eq!(generate(&short, &files, want.len()), want, "{}", p["name"]);
    }
}

#[test]
fn image_errors_are_reported_not_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.png");
    let png = std::fs::read(fixture().join("images/rgb_84x56.png")).unwrap();
    std::fs::write(&bad, &png[..png.len() / 3]).unwrap();
    let out = tessera()
        .args(["encode", "--model"])
        .arg(fixture())
        .arg("--image")
        .arg(&bad)
        .arg("--out")
        .arg(tmp.path().join("x.npy"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot decode PNG"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Two images but one placeholder.
    let rf = reference();
    let prompt = ids(&rf["prompts"][0]["prompt_ids"]);
    let out = tessera()
        .args(["generate", "--model"])
        .arg(fixture())
        .args(["--prompt-ids", &ids_arg(&prompt), "--json"])
        .arg("--image")
        .arg(fixture().join("images/rgb_84x56.png"))
        .arg("--image")
        .arg(fixture().join("images/rgba_70x45.png"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("placeholder"), "{err}");

    // A text-only model has no vision tower.
    let kl = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kl_mixed");
    let out = tessera()
        .args(["generate", "--model"])
        .arg(&kl)
        .args(["--prompt-ids", "5,6,7", "--json"])
        .arg("--image")
        .arg(fixture().join("images/rgb_84x56.png"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("text-only"), "{err}");
}
