//! The CPU engine against `tests/reference/k3_reference.py` on the tiny random Kimi K3 models in
//! `tests/fixtures/k3_tiny*` (real checkpoint layout: `kimi_k3` config, `language_model.` names,
//! F32 A_log / dt_bias / conv / o_norm / correction bias, A_log padded to head_dim with a zero
//! tail). The reference is checked against transformers' Kimi Linear with the K3 switches off.

use std::path::{Path, PathBuf};

use tessera_engine::config::Activation;
use tessera_engine::generate::{generate, prefill, prompt_logits, GenerateRequest};
use tessera_engine::model::LogitsWanted;
use tessera_engine::reference::{greedy_agreement, rel_err, Reference, NEAR_TIE};
use tessera_engine::{Model, ModelConfig, SamplingParams};

/// Prompt logits: max |ours − reference| / max |reference| (as for the Kimi Linear fixtures).
const LOGITS_REL_TOL: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn reference(dir: &Path) -> Reference {
    Reference::load(&dir.join("k3_reference.json")).unwrap()
}

fn greedy(n: usize, prompt: &[u32], chunk: Option<usize>) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        prefill_chunk: chunk,
    }
}

#[test]
fn k3_tiny_config_turns_every_switch_on() {
    let c = ModelConfig::from_dir(&fixture("k3_tiny")).unwrap();
    let s = c.switches;
    assert_eq!(c.model_type, "kimi_k3");
    assert_eq!(s.attn_res_block_size, Some(3));
    assert!(matches!(s.activation, Activation::Situ { .. }));
    assert!(s.latent_moe.is_some_and(|l| l.use_norm && l.dim == 32));
    assert!(s.mla_output_gate && s.kda_full_rank_gate);
    assert_eq!(s.kda_gate_lower_bound, Some(-5.0));
    assert!(c.quantization.is_none());
    let q = ModelConfig::from_dir(&fixture("k3_tiny_mxfp4")).unwrap();
    assert_eq!(q.quantization.unwrap().format, "mxfp4-pack-quantized");
}

/// bf16 experts, and MXFP4 experts kept packed and dequantised row by row.
const FIXTURES: [&str; 2] = ["k3_tiny", "k3_tiny_mxfp4"];

#[test]
fn k3_prompt_logits_match_the_reference() {
    for name in FIXTURES {
        let dir = fixture(name);
        let model = Model::load(&dir).unwrap();
        for p in reference(&dir).prompts {
            let (shape, want) = tessera_engine::npy::read_f32(&dir.join(&p.logits_file)).unwrap();
            assert_eq!(shape, vec![p.prompt_ids.len(), model.config.vocab_size]);
            let got = prompt_logits(&model, &p.prompt_ids).unwrap();
            let err = rel_err(&got, &want);
            println!("{name}/{}: relative error {err:e}", p.name);
            assert!(
                err <= LOGITS_REL_TOL,
                "{name}/{}: relative error {err:e}",
                p.name
            );
        }
    }
}

#[test]
fn k3_greedy_tokens_match_the_reference() {
    for name in FIXTURES {
        let dir = fixture(name);
        let model = Model::load(&dir).unwrap();
        let mut compared = 0;
        for p in reference(&dir).prompts {
            let req = greedy(p.greedy_ids.len(), &p.prompt_ids, None);
            let got = generate(&model, &req).unwrap();
            let a = greedy_agreement(&got, &p.greedy_ids, &p.greedy_margins, NEAR_TIE);
            assert_eq!(
                a.first_difference, None,
                "{name}/{}: greedy tokens differ ({got:?})",
                p.name
            );
            compared += a.equal;
        }
        assert!(
            compared >= 24,
            "{name}: only {compared} greedy steps compared"
        );
    }
}

/// AttnRes keeps no state across tokens: decoding one token at a time, or prefilling in chunks,
/// gives the logits of one whole prefill; with batch invariance on, bit for bit.
#[test]
fn k3_decode_and_chunked_prefill_equal_whole_prefill() {
    let dir = fixture("k3_tiny");
    let mut model = Model::load(&dir).unwrap();
    let p = reference(&dir).prompts.pop().unwrap();
    let mut seq = p.prompt_ids.clone();
    seq.extend(&p.greedy_ids);
    let whole = prompt_logits(&model, &seq).unwrap();
    let mut state = model.new_state();
    let mut stepped = prefill(&model, &p.prompt_ids, &mut state, None, true).unwrap();
    for &t in &p.greedy_ids {
        stepped.extend(
            model
                .forward_one(&[t], &mut state, LogitsWanted::Last)
                .unwrap(),
        );
    }
    let err = rel_err(&stepped, &whole);
    assert!(
        err <= LOGITS_REL_TOL,
        "decode vs prefill: relative error {err:e}"
    );
    for chunk in [1, 4, 32] {
        let mut state = model.new_state();
        let got = prefill(&model, &seq, &mut state, Some(chunk), true).unwrap();
        let err = rel_err(&got, &whole);
        assert!(
            err <= LOGITS_REL_TOL,
            "chunk {chunk}: relative error {err:e}"
        );
    }
    model.set_batch_invariant(true);
    let whole = prompt_logits(&model, &seq).unwrap();
    for chunk in [1, 5] {
        let mut state = model.new_state();
        let got = prefill(&model, &seq, &mut state, Some(chunk), true).unwrap();
        assert!(
            got == whole,
            "batch-invariant chunk {chunk} differs from whole prefill"
        );
    }
}

/// The padded `A_log` tail is checked at load (K3-SPEC §6.1): a non-zero tail is refused.
#[test]
fn k3_nonzero_a_log_tail_is_refused() {
    use safetensors::tensor::{serialize, TensorView};
    let src = fixture("k3_tiny");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "language_model.model.layers.0.self_attn.A_log";
    let mut a_log = st.tensor(name).unwrap().data().to_vec();
    let n = a_log.len();
    a_log[n - 4..].copy_from_slice(&0.5f32.to_le_bytes());
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for (k, v) in st.tensors() {
        let data: &[u8] = if k == name { &a_log } else { v.data() };
        views.push((
            k.clone(),
            TensorView::new(v.dtype(), v.shape().to_vec(), data).unwrap(),
        ));
    }
    let out = serialize(views, None).unwrap();
    std::fs::write(tmp.path().join("model.safetensors"), out).unwrap();
    let err = match Model::load(tmp.path()) {
        Ok(_) => panic!("a non-zero A_log tail loaded"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("A_log") && err.contains("zero"), "{err}");
}
