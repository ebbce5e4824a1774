//! Kimi K3 configs (`model_type: kimi_k3`, K3-SPEC §1): a multimodal wrapper whose `text_config`
//! is a Kimi Linear config plus the K3 extensions. The text model is read by the same parser as
//! Kimi Linear and the extensions become [`ArchSwitches`] on the one [`ModelConfig`]: K3 is Kimi
//! Linear with switches on, never a second model. Kimi K2.5's wrapper (`model_type: kimi_k25`)
//! takes the same path with a plain Kimi Linear text model; `vision_config` is read by
//! `config_vision.rs` for both.
//!
//! Resolved K3-SPEC §6 points that concern the config:
//! - §6.2 (vision width): nothing is assumed; `vision_config` is read as written, with vLLM's
//!   `KimiK3VisionConfig` defaults only for absent fields, and checked for internal consistency
//!   (`text_hidden_size` must equal the text model's `hidden_size`).
//! - §6.3 / §7.8 (latent-norm eps): `q_a_layernorm` / `kv_a_layernorm` use `rms_norm_eps` for
//!   `kimi_k3` (vLLM), 1e-6 for `kimi_linear` (transformers).
//! - §6.4 (grouping): `num_expert_group` is read as published and validated like Kimi Linear's; a
//!   grouped K3 config is accepted (the router supports groups), nothing forces 1.
//! - §6.9 (quantized set): `quantization_config` is parsed and validated (only compressed-tensors
//!   `mxfp4-pack-quantized`, 4-bit float, group 32, E8M0 scales); which tensors are quantized is
//!   read from the checkpoint's dtypes, not from the `ignore` patterns.
//!
//! A bare `kimi_linear` config that carries K3-only fields is refused with the field named: run
//! without the wrapper it would silently lose AttnRes, SiTU, the latent MoE or the gates.

use serde_json::Value;

use super::{Fields, ModelConfig};
use crate::error::Result;

pub const MODEL_TYPE: &str = "kimi_k3";
/// Kimi K2.5's wrapper (`Kimi_K25ForConditionalGeneration`): the same layout with a plain
/// Kimi Linear text model and the K2.5 vision defaults (LayerNorm, `patchmerger`).
pub const K25_MODEL_TYPE: &str = "kimi_k25";

/// Fields that only a K3 text model has (in `text_config` or in `linear_attn_config`).
const K3_TEXT_FIELDS: [&str; 6] = [
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "mla_use_output_gate",
    "activation_situ_beta",
    "activation_situ_linear_beta",
];
const K3_LINEAR_FIELDS: [&str; 2] = ["gate_lower_bound", "use_full_rank_gate"];

/// The MLP activation (dense, shared and routed experts alike).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `silu(g) · u` (Kimi Linear).
    Silu,
    /// SiTU (K3): `[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]`, `β1 = gate_beta`, `β2 = up_beta`.
    Situ { gate_beta: f32, up_beta: f32 },
}

/// Stable latent MoE: routed experts run in a `dim`-wide latent space between a down and an up
/// projection of the hidden state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentMoe {
    /// `routed_expert_hidden_size`: the experts' input/output width.
    pub dim: usize,
    /// `latent_moe_use_norm`: RMSNorm on the combined expert output before the up projection.
    pub use_norm: bool,
}

/// Architecture switches over the Kimi Linear forward pass. [`ArchSwitches::KIMI_LINEAR`] (the
/// default) turns every extension off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArchSwitches {
    /// AttnRes (K3-SPEC §3.1) with blocks of this many layers; `None`: plain residual adds.
    pub attn_res_block_size: Option<usize>,
    pub activation: Activation,
    /// `None`: routed experts take the hidden state directly.
    pub latent_moe: Option<LatentMoe>,
    /// Gated MLA: `o ⊙ σ(g_proj(x))` before `o_proj`.
    pub mla_output_gate: bool,
    /// Bounded KDA decay `g = lb·σ(exp(A_log)·(f + dt_bias))`; `None`: Kimi Linear's
    /// `−exp(A_log)·softplus(f + dt_bias)`.
    pub kda_gate_lower_bound: Option<f32>,
    /// KDA output gate is one full-rank `g_proj [P, D]` rather than `g_b_proj · g_a_proj`.
    pub kda_full_rank_gate: bool,
}

impl ArchSwitches {
    pub const KIMI_LINEAR: ArchSwitches = ArchSwitches {
        attn_res_block_size: None,
        activation: Activation::Silu,
        latent_moe: None,
        mla_output_gate: false,
        kda_gate_lower_bound: None,
        kda_full_rank_gate: false,
    };

    /// AttnRes blocks stored for `layers` layers: `ceil(layers / B)` (8 for K3), 0 without AttnRes.
    pub fn attn_res_blocks(&self, layers: usize) -> usize {
        self.attn_res_block_size.map_or(0, |b| layers.div_ceil(b))
    }
}

impl Default for ArchSwitches {
    fn default() -> Self {
        Self::KIMI_LINEAR
    }
}

/// `quantization_config` of the quantized release: compressed-tensors MXFP4 (K3-SPEC §2).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizationConfig {
    pub quant_method: String,
    pub format: String,
    pub num_bits: usize,
    /// Input columns sharing one E8M0 scale.
    pub group_size: usize,
    /// Module patterns left unquantized, as published (informative: the checkpoint's dtypes
    /// decide, K3-SPEC §6.9).
    pub ignore: Vec<String>,
    pub targets: Vec<String>,
}

impl Fields<'_> {
    /// The `kimi_k3` wrapper: `text_config` through the Kimi Linear parser with the K3 switches,
    /// then `vision_config`, `quantization_config` and the top-level token ids.
    pub(super) fn parse_k3(&self, wrapper: &str) -> Result<ModelConfig> {
        let k25 = wrapper == K25_MODEL_TYPE;
        let text_v = self
            .v
            .get("text_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| self.err(format!("{wrapper}: missing required object `text_config`")))?;
        let text = Fields {
            v: text_v,
            path: self.path,
        };
        let inner = text.str_or(&["model_type"], "kimi_linear")?;
        if inner != "kimi_linear" {
            return Err(self.err(format!(
                "text_config.model_type `{inner}` is not supported for {wrapper} (expected kimi_linear)"
            )));
        }
        let mut cfg = if k25 {
            text.reject_k3_fields()?;
            text.parse_text("kimi_linear".to_string())?
        } else {
            text.parse_text(MODEL_TYPE.to_string())?
        };
        cfg.model_type = wrapper.to_string();

        // Top-level ids and tying win over the text config's copies.
        if let Some(id) = self.token_ids("bos_token_id")?.first() {
            cfg.bos_token_id = Some(*id);
        }
        let eos = self.token_ids("eos_token_id")?;
        if !eos.is_empty() {
            cfg.eos_token_ids = eos;
        }
        if let Some(id) = self.token_ids("pad_token_id")?.first() {
            cfg.pad_token_id = Some(*id);
        }
        if self.find(&["tie_word_embeddings"]).is_some() {
            cfg.tie_word_embeddings = self.bool_or(&["tie_word_embeddings"], false)?;
        }

        cfg.quantization = match (
            self.v.get("quantization_config").filter(|v| !v.is_null()),
            text_v.get("quantization_config").filter(|v| !v.is_null()),
        ) {
            (Some(a), Some(b)) if a != b => {
                return Err(
                    self.err("quantization_config differs between the top level and text_config")
                )
            }
            (Some(q), _) | (None, Some(q)) => Some(self.quantization(q)?),
            (None, None) => None,
        };

        cfg.vision = self.wrapper_vision(k25, cfg.hidden_size)?;
        Ok(cfg)
    }

    /// Refuses K3-only fields in a bare `kimi_linear` config.
    pub(super) fn reject_k3_fields(&self) -> Result<()> {
        let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
        let lin = self.v.get("linear_attn_config");
        let top = K3_TEXT_FIELDS.iter().find(|f| present(self.v.get(**f)));
        let nested = K3_LINEAR_FIELDS
            .iter()
            .find(|f| present(lin.and_then(|l| l.get(**f))));
        let act = self.str_or(&["hidden_act"], "silu")?;
        let field = match (top, nested) {
            (Some(f), _) => f.to_string(),
            (None, Some(f)) => format!("linear_attn_config.{f}"),
            (None, None) if act == "situ" => "hidden_act".to_string(),
            (None, None) => return Ok(()),
        };
        Err(self.err(format!(
            "`{field}` is a Kimi K3 field: a K3 text model must be loaded through its \
             `model_type: kimi_k3` config.json (text_config inside), not as bare kimi_linear"
        )))
    }

    /// The K3 switches of a text config (called by `parse_text` for the kimi_k3 family), with
    /// every inconsistency named.
    pub(super) fn k3_switches(&self, num_layers: usize, has_moe: bool) -> Result<ArchSwitches> {
        let lin = self.v.get("linear_attn_config").filter(|v| !v.is_null());
        let lin = lin.map(|v| Fields { v, path: self.path });

        let attn_res_block_size = self.usize_opt(&["attn_res_block_size"])?;
        if attn_res_block_size == Some(0) {
            return Err(self.err("attn_res_block_size must be at least 1"));
        }
        if let Some(b) = attn_res_block_size {
            if b > num_layers {
                return Err(self.err(format!(
                    "attn_res_block_size {b} exceeds num_hidden_layers {num_layers}"
                )));
            }
        }

        let activation = match self.str_or(&["hidden_act"], "silu")? {
            "silu" => {
                for beta in ["activation_situ_beta", "activation_situ_linear_beta"] {
                    if self.find(&[beta]).is_some() {
                        return Err(self.err(format!("`{beta}` is set but hidden_act is silu")));
                    }
                }
                Activation::Silu
            }
            "situ" => {
                let beta = |name: &str, default: f32| -> Result<f32> {
                    let b = self.f32_or(&[name], default)?;
                    if !(b.is_finite() && b > 0.0) {
                        return Err(
                            self.err(format!("`{name}` must be a positive number, got {b}"))
                        );
                    }
                    Ok(b)
                };
                Activation::Situ {
                    gate_beta: beta("activation_situ_beta", 4.0)?,
                    up_beta: beta("activation_situ_linear_beta", 25.0)?,
                }
            }
            other => {
                return Err(self.err(format!(
                    "hidden_act `{other}` is not supported for kimi_k3 (expected situ or silu)"
                )))
            }
        };

        let latent_dim = self.usize_opt(&["routed_expert_hidden_size"])?;
        let use_norm = self.bool_or(&["latent_moe_use_norm"], false)?;
        let latent_moe = match latent_dim {
            Some(0) => return Err(self.err("routed_expert_hidden_size must be positive")),
            Some(dim) => Some(LatentMoe { dim, use_norm }),
            None if use_norm => {
                return Err(self
                    .err("latent_moe_use_norm is true but routed_expert_hidden_size is not set"))
            }
            None => None,
        };
        if latent_moe.is_some() && !has_moe {
            return Err(self.err("routed_expert_hidden_size is set but no layer is MoE"));
        }

        let kda_gate_lower_bound = match &lin {
            Some(f) if f.find(&["gate_lower_bound"]).is_some() => {
                let lb = f.f32_or(&["gate_lower_bound"], 0.0)?;
                // vLLM's bounded-gate kernel assumes −5 ≤ lb < 0.
                if !(-5.0..0.0).contains(&lb) {
                    return Err(self.err(format!(
                        "linear_attn_config.gate_lower_bound must be in [-5, 0), got {lb}"
                    )));
                }
                Some(lb)
            }
            _ => None,
        };
        let kda_full_rank_gate = match &lin {
            Some(f) => f.bool_or(&["use_full_rank_gate"], false)?,
            None => false,
        };

        if let (Some(kv), Some(q)) = (
            self.usize_opt(&["num_key_value_heads"])?,
            self.usize_opt(&["num_attention_heads"])?,
        ) {
            if kv != q {
                return Err(self.err(format!(
                    "num_key_value_heads {kv} must equal num_attention_heads {q} (MLA)"
                )));
            }
        }
        if self.usize_or(&["num_nextn_predict_layers"], 0)? != 0 {
            return Err(self.err("num_nextn_predict_layers > 0 (MTP layers) is not supported"));
        }
        Ok(ArchSwitches {
            attn_res_block_size,
            activation,
            latent_moe,
            mla_output_gate: self.bool_or(&["mla_use_output_gate"], false)?,
            kda_gate_lower_bound,
            kda_full_rank_gate,
        })
    }

    fn quantization(&self, q: &Value) -> Result<QuantizationConfig> {
        let f = Fields {
            v: q,
            path: self.path,
        };
        let method = f.str_or(&["quant_method"], "")?.to_string();
        if method != "compressed-tensors" {
            return Err(self.err(format!(
                "quantization_config.quant_method `{method}` is not supported (expected compressed-tensors)"
            )));
        }
        let strings = |v: Option<&Value>, name: &str| -> Result<Vec<String>> {
            match v {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| {
                        x.as_str().map(String::from).ok_or_else(|| {
                            self.err(format!("quantization_config.{name} must hold strings"))
                        })
                    })
                    .collect(),
                Some(other) => Err(self.err(format!(
                    "quantization_config.{name} must be a list, got {other}"
                ))),
            }
        };
        let mut format = f.str_or(&["format"], "")?.to_string();
        let (mut num_bits, mut group_size, mut targets) = (4, 32, Vec::new());
        if let Some(groups) = q.get("config_groups").filter(|v| !v.is_null()) {
            let groups = groups
                .as_object()
                .ok_or_else(|| self.err("quantization_config.config_groups must be an object"))?;
            if groups.len() != 1 {
                return Err(self.err(format!(
                    "quantization_config.config_groups has {} groups (one MXFP4 group supported)",
                    groups.len()
                )));
            }
            let (gname, g) = groups.iter().next().expect("one group");
            let gf = Fields {
                v: g,
                path: self.path,
            };
            let gformat = gf.str_or(&["format"], &format)?.to_string();
            if !format.is_empty() && gformat != format {
                return Err(self.err(format!(
                    "quantization_config.config_groups.{gname}.format `{gformat}` differs from format `{format}`"
                )));
            }
            format = gformat;
            targets = strings(g.get("targets"), "config_groups.targets")?;
            if let Some(w) = g.get("weights").filter(|v| !v.is_null()) {
                let wf = Fields {
                    v: w,
                    path: self.path,
                };
                num_bits = wf.usize_or(&["num_bits"], 4)?;
                group_size = wf.usize_or(&["group_size"], 32)?;
                let kind = wf.str_or(&["type"], "float")?;
                if kind != "float" {
                    return Err(self.err(format!(
                        "quantization_config weights.type `{kind}` is not supported (expected float)"
                    )));
                }
                if !wf.bool_or(&["symmetric"], true)? {
                    return Err(self.err("quantization_config weights.symmetric must be true"));
                }
                let scale = wf.str_or(&["scale_dtype"], "uint8")?;
                if !matches!(scale, "uint8" | "torch.uint8") {
                    return Err(self.err(format!(
                        "quantization_config weights.scale_dtype `{scale}` is not supported (expected uint8, E8M0)"
                    )));
                }
            }
        }
        if format != "mxfp4-pack-quantized" {
            return Err(self.err(format!(
                "quantization_config.format `{format}` is not supported (expected mxfp4-pack-quantized)"
            )));
        }
        if num_bits != 4 || group_size != 32 {
            return Err(self.err(format!(
                "quantization_config weights: num_bits {num_bits} / group_size {group_size} \
                 (MXFP4 is 4 bits in groups of 32)"
            )));
        }
        Ok(QuantizationConfig {
            quant_method: method,
            format,
            num_bits,
            group_size,
            ignore: strings(q.get("ignore"), "ignore")?,
            targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{AttnKind, FfnKind};

    /// The published `moonshotai/Kimi-K3` config.json as K3-SPEC §1 records it.
    const K3: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/k3_published/config.json"
    ));

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    #[test]
    fn reads_the_published_k3_config() {
        let c = parse(K3).unwrap();
        assert_eq!(c.model_type, "kimi_k3");
        assert_eq!(
            (c.num_layers(), c.hidden_size, c.vocab_size),
            (93, 7168, 163_840)
        );
        let mla: Vec<usize> = (0..93).filter(|&l| c.attn[l] == AttnKind::Mla).collect();
        let mut want: Vec<usize> = (0..23).map(|i| 4 * i + 3).collect();
        want.push(92);
        assert_eq!(mla, want, "0-based MLA layers 3, 7, …, 91, 92");
        assert_eq!(c.ffn[0], FfnKind::Dense);
        assert!(c.ffn[1..].iter().all(|k| *k == FfnKind::Moe));
        assert_eq!(
            (c.kda.num_heads, c.kda.head_dim, c.kda.proj_dim()),
            (96, 128, 12_288)
        );
        assert_eq!(c.mla.q_lora_rank, Some(1536));
        assert_eq!(c.mla.latent_dim(), 576);
        assert_eq!(c.mla.qk_head_dim(), 192);
        assert_eq!(
            c.mla.latent_norm_eps, 1e-5,
            "kimi_k3 uses rms_norm_eps (§7.8)"
        );
        assert_eq!(
            (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size),
            (896, 16, 3072)
        );
        assert_eq!(
            (c.moe.num_shared_experts, c.moe.n_group, c.moe.topk_group),
            (2, 1, 1)
        );
        assert_eq!(c.moe.routed_scaling_factor, 1.0);
        assert_eq!(c.intermediate_size, 33_792);
        assert_eq!(
            (c.bos_token_id, c.eos_token_ids.clone(), c.pad_token_id),
            (Some(163_584), vec![163_586], Some(163_839))
        );
        assert!(!c.tie_word_embeddings);

        let s = c.switches;
        assert_eq!(s.attn_res_block_size, Some(12));
        assert_eq!(s.attn_res_blocks(c.num_layers()), 8);
        assert_eq!(
            s.activation,
            Activation::Situ {
                gate_beta: 4.0,
                up_beta: 25.0
            }
        );
        assert_eq!(
            s.latent_moe,
            Some(LatentMoe {
                dim: 3584,
                use_norm: true
            })
        );
        assert!(s.mla_output_gate && s.kda_full_rank_gate);
        assert_eq!(s.kda_gate_lower_bound, Some(-5.0));

        let v = c.vision.as_ref().unwrap();
        assert_eq!((v.hidden_size, v.num_heads, v.head_dim()), (1024, 12, 128));
        assert_eq!(
            (v.num_layers, v.intermediate_size, v.patch_size),
            (27, 4096, 14)
        );
        assert_eq!(v.merge_kernel, [2, 2]);
        assert_eq!(v.text_hidden_size, 7168);
        assert_eq!(v.placeholder_token_id, Some(163_605));

        let q = c.quantization.as_ref().unwrap();
        assert_eq!(
            (q.format.as_str(), q.num_bits, q.group_size),
            ("mxfp4-pack-quantized", 4, 32)
        );
        assert!(q.ignore.iter().any(|p| p.contains("shared_experts")));
        assert_eq!(q.targets, vec!["Linear".to_string()]);
    }

    #[test]
    fn kimi_linear_configs_keep_every_switch_off() {
        let text = r#"{"model_type": "kimi_linear", "num_hidden_layers": 2, "hidden_size": 8,
            "vocab_size": 16, "num_attention_heads": 2, "kv_lora_rank": 4,
            "qk_nope_head_dim": 4, "v_head_dim": 4, "intermediate_size": 8}"#;
        let c = parse(text).unwrap();
        assert_eq!(c.switches, ArchSwitches::KIMI_LINEAR);
        assert_eq!(c.mla.latent_norm_eps, 1e-6);
        assert!(c.vision.is_none() && c.quantization.is_none());
    }

    #[test]
    fn the_trimmed_vision_config_reads_as_written() {
        // §6.2: a transcription with only two vision fields (vt_hidden_size 1152) still parses,
        // with that width and vLLM's defaults for the rest.
        let v: Value = serde_json::from_str(K3).unwrap();
        let mut v = v;
        v["vision_config"] = serde_json::json!({"patch_size": 14, "vt_hidden_size": 1152});
        let c = parse(&v.to_string()).unwrap();
        assert_eq!(c.vision.unwrap().hidden_size, 1152);
    }

    #[test]
    fn quantization_config_may_sit_at_the_top_level() {
        let mut v: Value = serde_json::from_str(K3).unwrap();
        let q = v["text_config"]["quantization_config"].take();
        v["quantization_config"] = q;
        let c = parse(&v.to_string()).unwrap();
        assert_eq!(c.quantization.unwrap().group_size, 32);
        let c = parse(&{
            let mut v = v.clone();
            v["quantization_config"] = Value::Null;
            v.to_string()
        })
        .unwrap();
        assert!(c.quantization.is_none(), "the bf16 release has none");
    }

    #[test]
    fn rejects_inconsistent_k3_configs_naming_the_field() {
        let base: Value = serde_json::from_str(K3).unwrap();
        type Edit = fn(&mut Value);
        let cases: Vec<(Edit, &str)> = vec![
            (
                |v| v["text_config"]["attn_res_block_size"] = 0.into(),
                "attn_res_block_size",
            ),
            (
                |v| v["text_config"]["attn_res_block_size"] = 94.into(),
                "attn_res_block_size",
            ),
            (
                |v| v["text_config"]["hidden_act"] = "gelu".into(),
                "hidden_act",
            ),
            (
                |v| v["text_config"]["activation_situ_beta"] = (-1.0).into(),
                "activation_situ_beta",
            ),
            (
                |v| v["text_config"]["activation_situ_linear_beta"] = "x".into(),
                "activation_situ_linear_beta",
            ),
            (
                |v| {
                    v["text_config"]["hidden_act"] = "silu".into();
                },
                "activation_situ_beta",
            ),
            (
                |v| v["text_config"]["routed_expert_hidden_size"] = 0.into(),
                "routed_expert_hidden_size",
            ),
            (
                |v| {
                    v["text_config"]
                        .as_object_mut()
                        .unwrap()
                        .remove("routed_expert_hidden_size");
                },
                "latent_moe_use_norm",
            ),
            (
                |v| v["text_config"]["latent_moe_use_norm"] = 1.into(),
                "latent_moe_use_norm",
            ),
            (
                |v| v["text_config"]["mla_use_output_gate"] = "yes".into(),
                "mla_use_output_gate",
            ),
            (
                |v| v["text_config"]["linear_attn_config"]["gate_lower_bound"] = 0.5.into(),
                "gate_lower_bound",
            ),
            (
                |v| v["text_config"]["linear_attn_config"]["gate_lower_bound"] = (-6.0).into(),
                "gate_lower_bound",
            ),
            (
                |v| v["text_config"]["linear_attn_config"]["use_full_rank_gate"] = 1.into(),
                "use_full_rank_gate",
            ),
            (
                |v| v["text_config"]["num_key_value_heads"] = 8.into(),
                "num_key_value_heads",
            ),
            (
                |v| v["text_config"]["num_nextn_predict_layers"] = 1.into(),
                "num_nextn_predict_layers",
            ),
            (
                |v| v["text_config"]["model_type"] = "deepseek_v3".into(),
                "text_config.model_type",
            ),
            (
                |v| {
                    v.as_object_mut().unwrap().remove("text_config");
                },
                "text_config",
            ),
            (
                |v| v["vision_config"]["text_hidden_size"] = 4096.into(),
                "text_hidden_size",
            ),
            (
                |v| v["vision_config"]["vt_num_attention_heads"] = 7.into(),
                "qkv_hidden_size",
            ),
            (
                |v| v["vision_config"]["merge_kernel_size"] = serde_json::json!([2]),
                "merge_kernel_size",
            ),
            (
                |v| {
                    v["text_config"]["quantization_config"]["format"] =
                        "nvfp4-pack-quantized".into()
                },
                "format",
            ),
            (
                |v| v["text_config"]["quantization_config"]["quant_method"] = "fp8".into(),
                "quant_method",
            ),
            (
                |v| {
                    v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
                        ["group_size"] = 16.into()
                },
                "group_size",
            ),
            (
                |v| {
                    v["quantization_config"] =
                        serde_json::json!({"quant_method": "compressed-tensors"})
                },
                "quantization_config differs",
            ),
            // Fields of the shared Kimi Linear parser still apply inside text_config.
            (
                |v| v["text_config"]["linear_attn_config"]["full_attn_layers"][0] = 3.into(),
                "listed twice",
            ),
            (
                |v| v["text_config"]["num_expert_group"] = 3.into(),
                "num_expert_group",
            ),
        ];
        for (i, (edit, needle)) in cases.into_iter().enumerate() {
            let mut v = base.clone();
            edit(&mut v);
            let err = match parse(&v.to_string()) {
                Ok(_) => panic!("case {i} (`{needle}`) parsed"),
                Err(e) => e.to_string(),
            };
            assert!(
                err.contains(needle),
                "case {i}: error `{err}` should mention `{needle}`"
            );
        }
    }

    #[test]
    fn a_bare_kimi_linear_config_with_k3_fields_is_refused() {
        let v: Value = serde_json::from_str(K3).unwrap();
        let text = v["text_config"].to_string();
        let err = parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("attn_res_block_size") && err.contains("kimi_k3"),
            "{err}"
        );
        let mut t = v["text_config"].clone();
        for f in K3_TEXT_FIELDS {
            t.as_object_mut().unwrap().remove(f);
        }
        let err = parse(&t.to_string()).unwrap_err().to_string();
        assert!(err.contains("linear_attn_config.gate_lower_bound"), "{err}");
        for f in K3_LINEAR_FIELDS {
            t["linear_attn_config"].as_object_mut().unwrap().remove(f);
        }
        let err = parse(&t.to_string()).unwrap_err().to_string();
        assert!(err.contains("hidden_act"), "{err}");
        t["hidden_act"] = "silu".into();
        parse(&t.to_string()).unwrap();
    }
}
