//! The CLI contract: `tessera logits`, `tessera generate --json` and `tessera init-model`, run as
//! a user runs them, checked against the reference fixtures.

use std::process::Command;

use crate::common::*;

fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env("TESSERA_LOG", "error");
    c
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn logits_command_writes_reference_logits() {
    let dir = fixtures().into_iter().next().unwrap();
    let p = reference(&dir).prompts.into_iter().nth(1).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.npy");
    let st = tessera()
        .args(["logits", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", &ids_arg(&p.prompt_ids), "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    let (_, got) = tessera_engine::npy::read_f32(&out).unwrap();
    let (_, want) = tessera_engine::npy::read_f32(&dir.join(&p.logits_file)).unwrap();
    assert!(rel_err(&got, &want) <= LOGITS_REL_TOL);
}

/// `tessera generate --model <model> <args> --json`, which must succeed; its token ids.
fn generate_json(model: &std::path::Path, args: &[&str]) -> Vec<u32> {
    let out = tessera()
        .args(["generate", "--model"])
        .arg(model)
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        model.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::from_value(v["token_ids"].clone()).unwrap()
}

#[test]
fn generate_command_prints_reference_tokens_as_json() {
    let dir = fixtures().into_iter().next().unwrap();
    let p = reference(&dir).prompts.into_iter().nth(1).unwrap();
    let n = p.greedy_ids.len().to_string();
    let ids = ids_arg(&p.prompt_ids);
    let got = generate_json(
        &dir,
        &[
            "--prompt-ids",
            &ids,
            "--max-new-tokens",
            &n,
            "--temperature",
            "0",
            "--ignore-eos",
        ],
    );
    assert_eq!(got.len(), p.greedy_ids.len());
    assert_greedy_matches(&got, &p.greedy_ids, &p.greedy_margins, "cli generate");
}

#[test]
fn bad_input_gives_an_error_not_a_panic() {
    let dir = fixtures().into_iter().next().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--prompt-ids".into(), "1,x,3".into()],
            "not a token ID",
        ),
        (
            vec!["--prompt-ids".into(), "999999".into()],
            "outside the vocabulary",
        ),
        (
            vec![
                "--prompt-ids".into(),
                "1".into(),
                "--device".into(),
                "rocm".into(),
            ],
            "expected cpu, cuda[:N] or hip[:N]",
        ),
        // Without an AMD GPU (and, in a default build, without the hip backend) the reason is
        // given; whichever it is, it names the device.
        (
            vec![
                "--prompt-ids".into(),
                "1".into(),
                "--device".into(),
                "hip".into(),
            ],
            "--device hip:0: ",
        ),
        (
            vec![
                "--prompt-ids".into(),
                "1".into(),
                "--device".into(),
                "cuda:3".into(),
            ],
            "--device cuda:3: ",
        ),
    ];
    for (args, needle) in cases {
        let out = tessera()
            .args(["logits", "--model"])
            .arg(&dir)
            .args(&args)
            .arg("--out")
            .arg(tmp.path().join("x.npy"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            err.contains(needle),
            "{args:?}: stderr `{err}` should mention `{needle}`"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    let out = tessera()
        .args(["logits", "--model"])
        .arg(tmp.path().join("nope"))
        .args(["--prompt-ids", "1", "--out", "x.npy"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

#[test]
fn init_model_writes_a_loadable_model_with_a_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let st = tessera()
        .args(["init-model", "--preset", "tiny", "--out"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    let got = generate_json(
        &dir,
        &[
            "--prompt",
            "Hello, Tessera!",
            "--max-new-tokens",
            "5",
            "--ignore-eos",
        ],
    );
    assert_eq!(got.len(), 5);
    // Kimi K3, bf16 and MXFP4 experts: the real checkpoint layout, loadable and runnable.
    for arch in ["kimi_k3", "kimi_k3_mxfp4"] {
        let k3 = tmp.path().join(arch);
        let st = tessera()
            .args(["init-model", "--arch", arch, "--preset", "tiny", "--out"])
            .arg(&k3)
            .status()
            .unwrap();
        assert!(st.success(), "{arch}");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(k3.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["model_type"], "kimi_k3", "{arch}");
        let got = generate_json(
            &k3,
            &[
                "--prompt-ids",
                "5,6,7",
                "--max-new-tokens",
                "3",
                "--ignore-eos",
            ],
        );
        assert_eq!(got.len(), 3, "{arch}");
    }
    // Text mode decodes through the tokenizer.
    let out = tessera()
        .args(["generate", "--model"])
        .arg(&dir)
        .args(["--prompt", "Hello", "--max-new-tokens", "4", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn help_explains_the_default_model() {
    let out = tessera().args(["generate", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("meaningless"), "{text}");
}
