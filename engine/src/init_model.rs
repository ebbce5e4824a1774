//! Random-weight Kimi Linear and Kimi K3 models in the published Hugging Face layout
//! (`config.json`, bf16 `model.safetensors`, a tokenizer, `generation_config.json`), deterministic
//! by seed. K3 models use the real K3 layout: a `kimi_k3` config wrapping the text config, tensors
//! under `language_model.`, every K3 switch on (AttnRes, SiTU, latent MoE, gated MLA with q LoRA,
//! bounded KDA gate, full-rank KDA output gate, `A_log` padded to `head_dim`).
//!
//! Their output is meaningless text: they exist so that every command, test and benchmark has a
//! real checkpoint to load without downloading one. The `tiny` preset is the embedded default
//! model that commands use when `--model` is not given.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::config::{AttnKind, FfnKind, ModelConfig};
use crate::error::{EngineError, Result};
use crate::model::mxfp4;
use crate::rng::Rng;
use crate::tokenizer::tiny as tiny_tokenizer;

/// Bumped whenever presets or initialisation change, so cached default models are rebuilt.
const DEFAULT_MODEL_VERSION: &str = "tiny-v1";

/// Which architecture `write_model_arch` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    KimiLinear,
    KimiK3,
    /// K3 with routed experts in compressed-tensors MXFP4, as the quantized release stores them.
    KimiK3Mxfp4,
}

impl std::str::FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "kimi_linear" => Ok(Arch::KimiLinear),
            "kimi_k3" => Ok(Arch::KimiK3),
            "kimi_k3_mxfp4" => Ok(Arch::KimiK3Mxfp4),
            other => Err(format!(
                "unknown arch `{other}` (expected kimi_linear, kimi_k3 or kimi_k3_mxfp4)"
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// About 1 M parameters: the embedded default, fast enough for every test.
    Tiny,
    /// About 50 M parameters: for CPU benchmarks.
    Small,
    /// About 1.6 B parameters as K3 (3.3 GB in bf16; 2.6 B as Kimi Linear): for GPU benchmarks
    /// on one device. Not written by any test (it takes minutes on a CPU).
    Medium,
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "medium" => Ok(Preset::Medium),
            other => Err(format!(
                "unknown preset `{other}` (expected tiny, small or medium)"
            )),
        }
    }
}

struct Dims {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    /// 1-based, as checkpoints list them.
    mla_layers: Vec<usize>,
    kda_heads: usize,
    kda_head_dim: usize,
    mla_heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    kv_rank: usize,
    experts: usize,
    top_k: usize,
    moe_inter: usize,
}

fn dims(p: Preset) -> Dims {
    match p {
        Preset::Tiny => Dims {
            vocab: 1024,
            hidden: 128,
            inter: 384,
            layers: 4,
            mla_layers: vec![4],
            kda_heads: 4,
            kda_head_dim: 32,
            mla_heads: 4,
            nope: 32,
            rope: 16,
            v: 32,
            kv_rank: 64,
            experts: 8,
            top_k: 2,
            moe_inter: 64,
        },
        Preset::Small => Dims {
            vocab: 4096,
            hidden: 512,
            inter: 1536,
            layers: 8,
            mla_layers: vec![4, 8],
            kda_heads: 8,
            kda_head_dim: 64,
            mla_heads: 8,
            nope: 64,
            rope: 32,
            v: 64,
            kv_rank: 128,
            experts: 16,
            top_k: 4,
            moe_inter: 256,
        },
        Preset::Medium => Dims {
            vocab: 32768,
            hidden: 2048,
            inter: 8192,
            layers: 12,
            mla_layers: vec![4, 8, 12],
            kda_heads: 16,
            kda_head_dim: 128,
            mla_heads: 16,
            nope: 128,
            rope: 64,
            v: 128,
            kv_rank: 512,
            experts: 64,
            top_k: 8,
            moe_inter: 512,
        },
    }
}

/// K3 presets: the Kimi Linear shapes of the same size plus the K3 widths.
struct K3Dims {
    base: Dims,
    q_lora: usize,
    latent: usize,
    attn_res_block: usize,
}

fn k3_dims(p: Preset) -> K3Dims {
    match p {
        Preset::Tiny => K3Dims {
            base: Dims {
                layers: 7,
                mla_layers: vec![4, 7],
                ..dims(p)
            },
            q_lora: 96,
            latent: 64,
            attn_res_block: 3,
        },
        Preset::Small => K3Dims {
            base: Dims {
                layers: 12,
                mla_layers: vec![4, 8, 12],
                ..dims(p)
            },
            q_lora: 256,
            latent: 256,
            attn_res_block: 4,
        },
        // K3's head dims (128 / 64 / 128, KDA 128, latent 512) at a smaller width and depth.
        Preset::Medium => K3Dims {
            base: dims(p),
            q_lora: 768,
            latent: 1024,
            attn_res_block: 4,
        },
    }
}

/// A `kimi_k3` config.json (text only: no `vision_config`); with `mxfp4`, the quantized
/// release's `quantization_config` (routed experts only).
fn k3_config_json(k: &K3Dims, mxfp4: bool) -> serde_json::Value {
    let mut text = config_json(&k.base);
    let t = text.as_object_mut().expect("an object");
    for key in ["architectures", "tessera_note", "model_max_length"] {
        t.remove(key);
    }
    let extra = json!({
        "q_lora_rank": k.q_lora,
        "mla_use_output_gate": true,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": k.attn_res_block,
        "routed_expert_hidden_size": k.latent,
        "latent_moe_use_norm": true,
        "num_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 1048576,
    });
    for (key, v) in extra.as_object().expect("an object") {
        t.insert(key.clone(), v.clone());
    }
    let lin = t["linear_attn_config"].as_object_mut().expect("an object");
    lin.insert("gate_lower_bound".into(), json!(-5.0));
    lin.insert("use_full_rank_gate".into(), json!(true));
    if mxfp4 {
        t.insert(
            "quantization_config".into(),
            json!({
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                        "symmetric": true, "strategy": "group", "scale_dtype": "torch.uint8"}
                }},
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                    "re:.*routed_expert_.*", "re:.*block_sparse_moe\\.gate.*"]
            }),
        );
    }
    let specials = tiny_tokenizer::special_ids(k.base.vocab);
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": specials.bos,
        "eos_token_id": specials.eos,
        "pad_token_id": specials.pad,
        "tie_word_embeddings": false,
        "text_config": text,
        "tessera_note": "random weights written by `tessera init-model`; its output is meaningless"
    })
}

fn config_json(d: &Dims) -> serde_json::Value {
    let specials = tiny_tokenizer::special_ids(d.vocab);
    let kda: Vec<usize> = (1..=d.layers)
        .filter(|l| !d.mla_layers.contains(l))
        .collect();
    json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "dtype": "bfloat16",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.inter,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.mla_heads,
        "num_key_value_heads": d.mla_heads,
        "q_lora_rank": null,
        "kv_lora_rank": d.kv_rank,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v,
        "mla_use_nope": true,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": d.mla_layers,
            "num_heads": d.kda_heads,
            "head_dim": d.kda_head_dim,
            "short_conv_kernel_size": 4
        },
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "moe_intermediate_size": d.moe_inter,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": true,
        "routed_scaling_factor": 2.446,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "bos_token_id": specials.bos,
        "eos_token_id": specials.eos,
        "pad_token_id": specials.pad,
        "model_max_length": 1048576,
        "initializer_range": 0.02,
        "tessera_note": "random weights written by `tessera init-model`; its output is meaningless"
    })
}

/// How a tensor is initialised (mirrors the reference implementation's `_init_weights`).
#[derive(Clone, Copy)]
enum Init {
    Normal(f64),
    Ones,
    Zeros,
    Uniform(f64, f64),
    /// `log(U(1, 16))`.
    ALog,
    /// K3's `[head_dim]` A_log: `log(U(1, 16))` for the first `heads` entries, then zeros.
    ALogPadded(usize),
    /// Inverse softplus of `exp(U(log 1e-3, log 1e-1))`.
    DtBias,
}

struct TensorSpec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let d = cfg.hidden_size;
    let proj = Init::Normal(0.04);
    let sw = &cfg.switches;
    let (m0, head) = if cfg.model_type == "kimi_k3" {
        ("language_model.model.", "language_model.lm_head.weight")
    } else {
        ("model.", "lm_head.weight")
    };
    let mut v = Vec::new();
    let mut t =
        |name: String, shape: Vec<usize>, init: Init| v.push(TensorSpec { name, shape, init });
    t(
        format!("{m0}embed_tokens.weight"),
        vec![cfg.vocab_size, d],
        Init::Normal(1.0),
    );
    for l in 0..cfg.num_layers() {
        let p = format!("{m0}layers.{l}.");
        t(format!("{p}input_layernorm.weight"), vec![d], Init::Ones);
        t(
            format!("{p}post_attention_layernorm.weight"),
            vec![d],
            Init::Ones,
        );
        if sw.attn_res_block_size.is_some() {
            for r in ["self_attention_res", "mlp_res"] {
                t(format!("{p}{r}_norm.weight"), vec![d], Init::Ones);
                t(format!("{p}{r}_proj.weight"), vec![1, d], proj);
            }
        }
        let a = format!("{p}self_attn.");
        match cfg.attn[l] {
            AttnKind::Kda => {
                let (h, dk, k) = (cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel);
                let pd = h * dk;
                for n in ["q_proj", "k_proj", "v_proj"] {
                    t(format!("{a}{n}.weight"), vec![pd, d], proj);
                }
                let bound = 1.0 / (k as f64).sqrt();
                for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                    t(
                        format!("{a}{n}.weight"),
                        vec![pd, 1, k],
                        Init::Uniform(-bound, bound),
                    );
                }
                if sw.kda_gate_lower_bound.is_some() {
                    t(format!("{a}A_log"), vec![dk], Init::ALogPadded(h));
                } else {
                    t(format!("{a}A_log"), vec![1, 1, h, 1], Init::ALog);
                }
                t(format!("{a}dt_bias"), vec![pd], Init::DtBias);
                t(format!("{a}f_a_proj.weight"), vec![dk, d], proj);
                t(format!("{a}f_b_proj.weight"), vec![pd, dk], proj);
                t(format!("{a}b_proj.weight"), vec![h, d], proj);
                if sw.kda_full_rank_gate {
                    t(format!("{a}g_proj.weight"), vec![pd, d], proj);
                } else {
                    t(format!("{a}g_a_proj.weight"), vec![dk, d], proj);
                    t(format!("{a}g_b_proj.weight"), vec![pd, dk], proj);
                }
                t(format!("{a}o_norm.weight"), vec![dk], Init::Ones);
                t(format!("{a}o_proj.weight"), vec![d, pd], proj);
            }
            AttnKind::Mla => {
                let m = &cfg.mla;
                let qd = m.num_heads * m.qk_head_dim();
                match m.q_lora_rank {
                    None => t(format!("{a}q_proj.weight"), vec![qd, d], proj),
                    Some(r) => {
                        t(format!("{a}q_a_proj.weight"), vec![r, d], proj);
                        t(format!("{a}q_a_layernorm.weight"), vec![r], Init::Ones);
                        t(format!("{a}q_b_proj.weight"), vec![qd, r], proj);
                    }
                }
                t(
                    format!("{a}kv_a_proj_with_mqa.weight"),
                    vec![m.latent_dim(), d],
                    proj,
                );
                t(
                    format!("{a}kv_a_layernorm.weight"),
                    vec![m.kv_lora_rank],
                    Init::Ones,
                );
                t(
                    format!("{a}kv_b_proj.weight"),
                    vec![
                        m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank,
                    ],
                    proj,
                );
                if sw.mla_output_gate {
                    t(
                        format!("{a}g_proj.weight"),
                        vec![m.num_heads * m.v_head_dim, d],
                        proj,
                    );
                }
                t(
                    format!("{a}o_proj.weight"),
                    vec![d, m.num_heads * m.v_head_dim],
                    proj,
                );
            }
        }
        let f = format!("{p}block_sparse_moe.");
        match cfg.ffn[l] {
            FfnKind::Dense => {
                let i = cfg.intermediate_size;
                t(format!("{p}mlp.gate_proj.weight"), vec![i, d], proj);
                t(format!("{p}mlp.up_proj.weight"), vec![i, d], proj);
                t(format!("{p}mlp.down_proj.weight"), vec![d, i], proj);
            }
            FfnKind::Moe => {
                let m = &cfg.moe;
                t(format!("{f}gate.weight"), vec![m.num_experts, d], proj);
                t(
                    format!("{f}gate.e_score_correction_bias"),
                    vec![m.num_experts],
                    Init::Zeros,
                );
                let ed = match sw.latent_moe {
                    Some(lat) => {
                        t(
                            format!("{f}routed_expert_down_proj.weight"),
                            vec![lat.dim, d],
                            proj,
                        );
                        if lat.use_norm {
                            t(
                                format!("{f}routed_expert_norm.weight"),
                                vec![lat.dim],
                                Init::Ones,
                            );
                        }
                        t(
                            format!("{f}routed_expert_up_proj.weight"),
                            vec![d, lat.dim],
                            proj,
                        );
                        lat.dim
                    }
                    None => d,
                };
                for e in 0..m.num_experts {
                    t(
                        format!("{f}experts.{e}.w1.weight"),
                        vec![m.intermediate_size, ed],
                        proj,
                    );
                    t(
                        format!("{f}experts.{e}.w3.weight"),
                        vec![m.intermediate_size, ed],
                        proj,
                    );
                    t(
                        format!("{f}experts.{e}.w2.weight"),
                        vec![ed, m.intermediate_size],
                        proj,
                    );
                }
                let si = m.intermediate_size * m.num_shared_experts;
                t(
                    format!("{f}shared_experts.gate_proj.weight"),
                    vec![si, d],
                    proj,
                );
                t(
                    format!("{f}shared_experts.up_proj.weight"),
                    vec![si, d],
                    proj,
                );
                t(
                    format!("{f}shared_experts.down_proj.weight"),
                    vec![d, si],
                    proj,
                );
            }
        }
    }
    t(format!("{m0}norm.weight"), vec![d], Init::Ones);
    if sw.attn_res_block_size.is_some() {
        t(
            format!("{m0}output_attn_res_norm.weight"),
            vec![d],
            Init::Ones,
        );
        t(format!("{m0}output_attn_res_proj.weight"), vec![1, d], proj);
    }
    t(head.into(), vec![cfg.vocab_size, d], proj);
    v
}

/// Published Kimi checkpoints keep the small recurrence and routing tensors in F32.
fn stored_as_f32(name: &str) -> bool {
    [
        "A_log",
        "dt_bias",
        "conv1d.weight",
        "o_norm.weight",
        "e_score_correction_bias",
    ]
    .iter()
    .any(|suffix| name.ends_with(suffix))
}

/// Elements drawn from one generator: every run of a tensor has its own, seeded from the model
/// seed and the positions of the tensor and the run, so that runs fill in parallel and a model
/// is the same bytes whatever the thread count.
const RUN: usize = 1 << 18;

fn fill(init: Init, n: usize, seed: u64, tensor: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    out.par_chunks_mut(RUN).enumerate().for_each(|(run, xs)| {
        let stream = (tensor as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (run as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let mut rng = Rng::new(seed ^ stream);
        for (k, x) in xs.iter_mut().enumerate() {
            *x = draw(init, run * RUN + k, &mut rng);
        }
    });
    out
}

fn draw(init: Init, i: usize, rng: &mut Rng) -> f32 {
    match init {
        Init::Normal(std) => (rng.normal() * std) as f32,
        Init::Ones => 1.0,
        Init::Zeros => 0.0,
        Init::Uniform(lo, hi) => (lo + (hi - lo) * rng.uniform()) as f32,
        Init::ALog => (1.0 + 15.0 * rng.uniform()).ln() as f32,
        Init::ALogPadded(heads) if i < heads => (1.0 + 15.0 * rng.uniform()).ln() as f32,
        Init::ALogPadded(_) => 0.0,
        Init::DtBias => {
            let (lo, hi) = (1e-3f64.ln(), 1e-1f64.ln());
            let dt = (lo + (hi - lo) * rng.uniform()).exp().max(1e-4);
            (dt + (-(-dt).exp_m1()).ln()) as f32
        }
    }
}

/// Writes a random-weight Kimi Linear model of `preset` into `out` (created if missing).
pub fn write_model(out: &Path, preset: Preset, seed: u64) -> Result<()> {
    write_model_arch(out, Arch::KimiLinear, preset, seed)
}

/// Writes a random-weight model of `arch` and `preset` into `out` (created if missing).
pub fn write_model_arch(out: &Path, arch: Arch, preset: Preset, seed: u64) -> Result<()> {
    let (d, cfg_json) = match arch {
        Arch::KimiLinear => {
            let d = dims(preset);
            let j = config_json(&d);
            (d, j)
        }
        Arch::KimiK3 | Arch::KimiK3Mxfp4 => {
            let k = k3_dims(preset);
            let j = k3_config_json(&k, arch == Arch::KimiK3Mxfp4);
            (k.base, j)
        }
    };
    let mxfp4 = arch == Arch::KimiK3Mxfp4;
    std::fs::create_dir_all(out).map_err(|e| EngineError::io(out, e))?;
    let cfg_text = serde_json::to_string_pretty(&cfg_json).expect("config serialises");
    let cfg = ModelConfig::from_json_str(&cfg_text, &out.join("config.json"))?;

    let specs = tensor_specs(&cfg);
    // (name, dtype, shape, bytes) as stored; an MXFP4 expert becomes `weight_packed` + `weight_scale`.
    let mut stored: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let values = fill(s.init, s.shape.iter().product(), seed, i);
        if mxfp4 && s.name.contains(".experts.") {
            let (out_dim, in_dim) = (s.shape[0], s.shape[1]);
            let (packed, scale) = mxfp4::quantize(&values, out_dim, in_dim);
            let base = s.name.strip_suffix(".weight").expect("a weight");
            stored.push((
                format!("{base}.weight_packed"),
                Dtype::U8,
                vec![out_dim, in_dim / 2],
                packed,
            ));
            stored.push((
                format!("{base}.weight_scale"),
                Dtype::U8,
                vec![out_dim, in_dim / mxfp4::GROUP],
                scale,
            ));
        } else if stored_as_f32(&s.name) {
            let bytes = values.into_iter().flat_map(f32::to_le_bytes).collect();
            stored.push((s.name.clone(), Dtype::F32, s.shape.clone(), bytes));
        } else {
            let bytes = values
                .par_iter()
                .flat_map_iter(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
            stored.push((s.name.clone(), Dtype::BF16, s.shape.clone(), bytes));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let view =
                TensorView::new(*dtype, shape.clone(), bytes).expect("sizes match by construction");
            (name.clone(), view)
        })
        .collect();
    let st_path = out.join("model.safetensors");
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &st_path).map_err(|e| {
        EngineError::CorruptCheckpoint {
            path: st_path.clone(),
            message: e.to_string(),
        }
    })?;

    write_text(&out.join("config.json"), &cfg_text)?;
    let specials = tiny_tokenizer::special_ids(d.vocab);
    let gen = json!({
        "bos_token_id": specials.bos,
        "eos_token_id": [specials.eos, specials.im_end],
        "pad_token_id": specials.pad,
    });
    write_text(
        &out.join("generation_config.json"),
        &serde_json::to_string_pretty(&gen).unwrap(),
    )?;
    tiny_tokenizer::write_tiny_tokenizer(out, d.vocab)?;
    Ok(())
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

/// Where the embedded default model lives: `$TESSERA_CACHE_DIR`, else `$XDG_CACHE_HOME/tessera`,
/// else `~/.cache/tessera`, else the system temp dir.
pub fn default_model_dir() -> PathBuf {
    let base = std::env::var_os("TESSERA_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("tessera")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/tessera")))
        .unwrap_or_else(|| std::env::temp_dir().join("tessera"));
    base.join("models").join(DEFAULT_MODEL_VERSION)
}

/// The embedded default (`tiny`, seed 0), written on first use. Written into a temporary
/// directory and renamed, so concurrent first uses never see a half-written model.
pub fn ensure_default_model() -> Result<PathBuf> {
    let dir = default_model_dir();
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let parent = dir.parent().expect("has a parent");
    std::fs::create_dir_all(parent).map_err(|e| EngineError::io(parent, e))?;
    let tmp = parent.join(format!(".{DEFAULT_MODEL_VERSION}.{}", std::process::id()));
    write_model(&tmp, Preset::Tiny, 0)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another process won the race: its copy is identical.
        Err(_) if dir.join("config.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => return Err(EngineError::io(&dir, e)),
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_model_is_deterministic_and_loads() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_model(a.path(), Preset::Tiny, 0).unwrap();
        write_model(b.path(), Preset::Tiny, 0).unwrap();
        let fa = std::fs::read(a.path().join("model.safetensors")).unwrap();
        let fb = std::fs::read(b.path().join("model.safetensors")).unwrap();
        assert!(fa == fb, "same seed must give the same bytes");
        let m = crate::model::Model::load(a.path()).unwrap();
        assert_eq!(m.config.vocab_size, 1024);
        let c = tempfile::tempdir().unwrap();
        write_model(c.path(), Preset::Tiny, 1).unwrap();
        assert!(std::fs::read(c.path().join("model.safetensors")).unwrap() != fa);
    }

    #[test]
    fn k3_presets_load_with_every_switch_and_every_tensor_used() {
        let cases = [
            (Arch::KimiK3, Preset::Tiny),
            (Arch::KimiK3, Preset::Small),
            (Arch::KimiK3Mxfp4, Preset::Tiny),
        ];
        for (arch, preset) in cases {
            let dir = tempfile::tempdir().unwrap();
            write_model_arch(dir.path(), arch, preset, 0).unwrap();
            let cfg = ModelConfig::from_dir(dir.path()).unwrap();
            assert_eq!(cfg.model_type, "kimi_k3");
            let s = cfg.switches;
            assert!(s.attn_res_block_size.is_some() && s.latent_moe.is_some());
            assert!(s.mla_output_gate && s.kda_full_rank_gate);
            assert!(s.kda_gate_lower_bound.is_some() && cfg.mla.q_lora_rank.is_some());
            assert_eq!(cfg.quantization.is_some(), arch == Arch::KimiK3Mxfp4);
            let ck = crate::checkpoint::Checkpoint::open(dir.path()).unwrap();
            let packed =
                "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed";
            assert_eq!(ck.contains(packed), arch == Arch::KimiK3Mxfp4);
            let model =
                crate::model::Model::from_checkpoint(cfg, &ck, "language_model.model.").unwrap();
            assert_eq!(ck.unused(), Vec::<String>::new(), "{arch:?} {preset:?}");
            if preset == Preset::Tiny {
                let mut st = model.new_state();
                let logits = model
                    .forward_one(&[5, 9, 14], &mut st, crate::model::LogitsWanted::All)
                    .unwrap();
                assert!(logits.iter().all(|x| x.is_finite()));
            }
        }
        assert_eq!("kimi_k3".parse::<Arch>(), Ok(Arch::KimiK3));
        assert!("llama".parse::<Arch>().is_err());
    }
}
