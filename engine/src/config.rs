//! `config.json` of Kimi-family checkpoints, read as published.
//!
//! Kimi Linear configs appear under two spellings: Moonshot's original fields (`num_experts`,
//! `num_experts_per_token`, `moe_renormalize`, `num_expert_group`, `linear_attn_config` with
//! 1-based layer lists) and the aliases `transformers` also accepts (`num_local_experts`,
//! `num_experts_per_tok`, `norm_topk_prob`, `n_group`, `layer_types`). Both are read; every
//! inconsistency is reported with the field named.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{EngineError, Result};

#[path = "config_k3.rs"]
mod k3;
#[path = "config_vision.rs"]
mod vision;
pub use k3::{Activation, ArchSwitches, LatentMoe, QuantizationConfig};
pub use vision::VisionConfig;

/// Most layers a config may declare: far above any published model, low enough that the
/// per-layer tables built at load are never a runaway allocation.
pub const MAX_LAYERS: usize = 1 << 16;

/// What a layer's token mixer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Kimi Delta Attention: linear attention with a recurrent state.
    Kda,
    /// Multi-head latent attention (NoPE in Kimi Linear).
    Mla,
}

/// What a layer's feed-forward block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
}

impl KdaConfig {
    /// Width of q, k and v each (`heads × head_dim`).
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

#[derive(Clone, Debug)]
pub struct MlaConfig {
    pub num_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Epsilon of `q_a_layernorm` and `kv_a_layernorm`: 1e-6 for `kimi_linear` (as its reference
    /// implementation has it), not `rms_norm_eps`.
    pub latent_norm_eps: f32,
}

impl MlaConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Floats of latent history per token: `[c_kv | k_pe]`.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    pub num_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub attn: Vec<AttnKind>,
    pub ffn: Vec<FfnKind>,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    /// Kimi K3 extensions; all off for Kimi Linear.
    pub switches: ArchSwitches,
    pub vision: Option<VisionConfig>,
    pub quantization: Option<QuantizationConfig>,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.attn.len()
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let mut cfg = Self::from_json_str(&text, &path)?;
        // `generation_config.json` often lists more end-of-sequence tokens (e.g. `<|im_end|>`
        // for chat) than `config.json`; generation stops at any of them.
        let gen_path = dir.join("generation_config.json");
        if let Ok(gen_text) = std::fs::read_to_string(&gen_path) {
            let gen: Value = serde_json::from_str(&gen_text).map_err(|e| EngineError::Config {
                path: gen_path.clone(),
                message: format!("not valid JSON: {e}"),
            })?;
            for id in (Fields {
                v: &gen,
                path: &gen_path,
            })
            .token_ids("eos_token_id")?
            {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
        }
        Ok(cfg)
    }

    /// The vision tower's config of `dir` (`None` for a text-only model), read without parsing
    /// the text model: the image path does not depend on the text family.
    pub fn vision_from_dir(dir: &Path) -> Result<Option<VisionConfig>> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| EngineError::Config {
            path: path.clone(),
            message: format!("not valid JSON: {e}"),
        })?;
        Fields {
            v: &root,
            path: &path,
        }
        .vision_only()
    }

    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| EngineError::Config {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {e}"),
        })?;
        Fields { v: &root, path }.parse()
    }
}

/// Typed access to the JSON object with errors that name the field.
struct Fields<'a> {
    v: &'a Value,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, message: impl Into<String>) -> EngineError {
        EngineError::Config {
            path: PathBuf::from(self.path),
            message: message.into(),
        }
    }

    /// The first of `names` that is present and not null.
    fn find(&self, names: &[&str]) -> Option<&Value> {
        names
            .iter()
            .filter_map(|n| self.v.get(*n))
            .find(|v| !v.is_null())
    }

    fn usize_opt(&self, names: &[&str]) -> Result<Option<usize>> {
        match self.find(names) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.err(format!(
                    "`{}` must be a non-negative integer, got {v}",
                    names[0]
                ))
            }),
        }
    }

    fn usize_req(&self, names: &[&str]) -> Result<usize> {
        self.usize_opt(names)?
            .ok_or_else(|| self.err(format!("missing required field `{}`", names[0])))
    }

    fn usize_or(&self, names: &[&str], default: usize) -> Result<usize> {
        Ok(self.usize_opt(names)?.unwrap_or(default))
    }

    fn f32_or(&self, names: &[&str], default: f32) -> Result<f32> {
        match self.find(names) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| self.err(format!("`{}` must be a number, got {v}", names[0]))),
        }
    }

    fn bool_or(&self, names: &[&str], default: bool) -> Result<bool> {
        match self.find(names) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("`{}` must be true or false, got {v}", names[0]))),
        }
    }

    fn str_or<'b>(&'b self, names: &[&str], default: &'b str) -> Result<&'b str> {
        match self.find(names) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(format!("`{}` must be a string, got {v}", names[0]))),
        }
    }

    fn token_ids(&self, name: &str) -> Result<Vec<u32>> {
        match self.v.get(name) {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(|x| vec![x as u32])
                .ok_or_else(|| self.err(format!("`{name}` must be a token id"))),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|x| x as u32)
                        .ok_or_else(|| self.err(format!("`{name}` must hold token ids")))
                })
                .collect(),
            Some(other) => Err(self.err(format!(
                "`{name}` must be a token id or a list, got {other}"
            ))),
        }
    }

    fn parse(&self) -> Result<ModelConfig> {
        let model_type = self.str_or(&["model_type"], "")?.to_string();
        if model_type == k3::MODEL_TYPE || model_type == k3::K25_MODEL_TYPE {
            return self.parse_k3(&model_type);
        }
        if model_type != "kimi_linear" {
            return Err(self.err(format!(
                "model_type `{model_type}` is not supported (supported: kimi_linear, kimi_k25, kimi_k3)"
            )));
        }
        self.reject_k3_fields()?;
        self.parse_text(model_type)
    }

    /// A Kimi Linear text model; `model_type` `kimi_k3` also reads the K3 switches.
    fn parse_text(&self, model_type: String) -> Result<ModelConfig> {
        let is_k3 = model_type == k3::MODEL_TYPE;
        let act = self.str_or(&["hidden_act"], "silu")?;
        if act != "silu" && !is_k3 {
            return Err(self.err(format!(
                "hidden_act `{act}` is not supported for kimi_linear (expected silu)"
            )));
        }
        let router_act = self.str_or(&["moe_router_activation_func"], "sigmoid")?;
        if router_act != "sigmoid" {
            return Err(self.err(format!(
                "moe_router_activation_func `{router_act}` is not supported (expected sigmoid)"
            )));
        }
        let num_layers = self.usize_req(&["num_hidden_layers"])?;
        let hidden_size = self.usize_req(&["hidden_size"])?;
        let vocab_size = self.usize_req(&["vocab_size"])?;
        if num_layers == 0 || hidden_size == 0 || vocab_size == 0 {
            return Err(self.err("num_hidden_layers, hidden_size and vocab_size must be positive"));
        }
        if num_layers > MAX_LAYERS {
            return Err(self.err(format!(
                "num_hidden_layers {num_layers} is more than the {MAX_LAYERS} supported"
            )));
        }

        let lin = self.v.get("linear_attn_config").filter(|v| !v.is_null());
        let lin_fields = lin.map(|v| Fields { v, path: self.path });
        let num_heads = self.usize_req(&["num_attention_heads"])?;
        let kda = KdaConfig {
            num_heads: match &lin_fields {
                Some(f) => f.usize_opt(&["num_heads"])?,
                None => None,
            }
            .map_or_else(|| self.usize_or(&["linear_num_heads"], num_heads), Ok)?,
            head_dim: match &lin_fields {
                Some(f) => f.usize_opt(&["head_dim"])?,
                None => None,
            }
            .map_or_else(|| self.usize_or(&["linear_head_dim"], 128), Ok)?,
            conv_kernel: match &lin_fields {
                Some(f) => f.usize_opt(&["short_conv_kernel_size"])?,
                None => None,
            }
            .map_or_else(|| self.usize_or(&["linear_conv_kernel_dim"], 4), Ok)?,
        };
        if kda.conv_kernel == 0 || kda.head_dim == 0 || kda.num_heads == 0 {
            return Err(self.err("linear_attn_config: num_heads, head_dim and short_conv_kernel_size must be positive"));
        }
        let attn = self.layer_kinds(num_layers, lin_fields.as_ref())?;

        let mla = MlaConfig {
            num_heads,
            q_lora_rank: self.usize_opt(&["q_lora_rank"])?,
            kv_lora_rank: self.usize_req(&["kv_lora_rank"])?,
            qk_nope_head_dim: self.usize_req(&["qk_nope_head_dim"])?,
            qk_rope_head_dim: self.usize_or(&["qk_rope_head_dim"], 0)?,
            v_head_dim: self.usize_req(&["v_head_dim"])?,
            latent_norm_eps: if is_k3 {
                self.f32_or(&["rms_norm_eps"], 1e-5)?
            } else {
                1e-6
            },
        };
        if !self.bool_or(&["mla_use_nope"], true)? {
            return Err(
                self.err("mla_use_nope=false (rotary MLA) is not supported for kimi_linear")
            );
        }

        let moe = MoeConfig {
            num_experts: self
                .usize_or(&["num_experts", "num_local_experts", "n_routed_experts"], 0)?,
            top_k: self.usize_or(&["num_experts_per_token", "num_experts_per_tok"], 0)?,
            intermediate_size: self.usize_or(&["moe_intermediate_size"], 0)?,
            num_shared_experts: self.usize_or(&["num_shared_experts", "n_shared_experts"], 0)?,
            n_group: self.usize_or(&["num_expert_group", "n_group"], 1)?,
            topk_group: self.usize_or(&["topk_group"], 1)?,
            renormalize: self.bool_or(&["moe_renormalize", "norm_topk_prob"], true)?,
            routed_scaling_factor: self.f32_or(&["routed_scaling_factor"], 1.0)?,
        };
        let ffn = self.ffn_kinds(num_layers)?;
        if ffn.contains(&FfnKind::Moe) {
            let m = &moe;
            if m.num_experts == 0 || m.top_k == 0 || m.intermediate_size == 0 {
                return Err(self.err("MoE layers need num_experts, num_experts_per_token and moe_intermediate_size > 0"));
            }
            if m.top_k > m.num_experts {
                return Err(self.err(format!(
                    "num_experts_per_token {} exceeds num_experts {}",
                    m.top_k, m.num_experts
                )));
            }
            if m.n_group == 0 || !m.num_experts.is_multiple_of(m.n_group) {
                return Err(self.err(format!(
                    "num_experts {} is not divisible by num_expert_group {}",
                    m.num_experts, m.n_group
                )));
            }
            if m.topk_group == 0 || m.topk_group > m.n_group {
                return Err(self.err(format!(
                    "topk_group {} must be in 1..={}",
                    m.topk_group, m.n_group
                )));
            }
            if m.n_group > 1 && m.num_experts / m.n_group < 2 {
                return Err(self.err("grouped routing needs at least 2 experts per group"));
            }
            if m.top_k > m.topk_group * (m.num_experts / m.n_group) {
                return Err(
                    self.err("num_experts_per_token exceeds the experts in the selected groups")
                );
            }
        }
        let intermediate_size = self.usize_or(&["intermediate_size"], 0)?;
        if ffn.contains(&FfnKind::Dense) && intermediate_size == 0 {
            return Err(self.err("dense MLP layers need intermediate_size > 0"));
        }
        let switches = if is_k3 {
            self.k3_switches(num_layers, ffn.contains(&FfnKind::Moe))?
        } else {
            ArchSwitches::KIMI_LINEAR
        };

        Ok(ModelConfig {
            model_type,
            vocab_size,
            hidden_size,
            intermediate_size,
            rms_norm_eps: self.f32_or(&["rms_norm_eps"], 1e-5)?,
            tie_word_embeddings: self.bool_or(&["tie_word_embeddings"], false)?,
            bos_token_id: self.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: self.token_ids("eos_token_id")?,
            pad_token_id: self.token_ids("pad_token_id")?.first().copied(),
            attn,
            ffn,
            switches,
            kda,
            mla,
            moe,
            vision: None,
            quantization: None,
        })
    }

    /// Layer kinds from `linear_attn_config` (1-based lists, as checkpoints store them), else
    /// from `layer_types`, else Kimi Linear's default pattern.
    fn layer_kinds(&self, n: usize, lin: Option<&Fields>) -> Result<Vec<AttnKind>> {
        let lists = match lin {
            Some(f) => match (f.v.get("kda_layers"), f.v.get("full_attn_layers")) {
                (Some(k), Some(m)) => Some((
                    f.one_based_list(k, "kda_layers", n)?,
                    f.one_based_list(m, "full_attn_layers", n)?,
                )),
                _ => None,
            },
            None => None,
        };
        if let Some((kda, mla)) = lists {
            let mut kinds = vec![None; n];
            for (list, kind) in [(kda, AttnKind::Kda), (mla, AttnKind::Mla)] {
                for l in list {
                    if kinds[l].replace(kind).is_some() {
                        return Err(self.err(format!(
                            "linear_attn_config: layer {} is listed twice",
                            l + 1
                        )));
                    }
                }
            }
            return kinds
                .into_iter()
                .enumerate()
                .map(|(i, k)| {
                    k.ok_or_else(|| {
                        self.err(format!(
                            "linear_attn_config: layer {} (1-based) is in neither kda_layers nor full_attn_layers",
                            i + 1
                        ))
                    })
                })
                .collect();
        }
        if let Some(Value::Array(types)) = self.v.get("layer_types") {
            if types.len() != n {
                return Err(self.err(format!(
                    "layer_types has {} entries for {n} layers",
                    types.len()
                )));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(AttnKind::Kda),
                    Some("full_attention") => Ok(AttnKind::Mla),
                    _ => Err(self.err(format!("layer_types: unknown entry {t}"))),
                })
                .collect();
        }
        Ok((0..n)
            .map(|i| {
                if i > 0 && i % 4 == 0 {
                    AttnKind::Mla
                } else {
                    AttnKind::Kda
                }
            })
            .collect())
    }

    fn one_based_list(&self, v: &Value, name: &str, n: usize) -> Result<Vec<usize>> {
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(format!("linear_attn_config.{name} must be a list")))?;
        arr.iter()
            .map(|x| match x.as_u64() {
                Some(l) if l >= 1 && (l as usize) <= n => Ok(l as usize - 1),
                _ => Err(self.err(format!(
                    "linear_attn_config.{name}: entry {x} is not a layer number in 1..={n}"
                ))),
            })
            .collect()
    }

    fn ffn_kinds(&self, n: usize) -> Result<Vec<FfnKind>> {
        if let Some(Value::Array(types)) = self.v.get("mlp_layer_types") {
            if types.len() != n {
                return Err(self.err(format!(
                    "mlp_layer_types has {} entries for {n} layers",
                    types.len()
                )));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    Some("dense") => Ok(FfnKind::Dense),
                    Some("sparse") => Ok(FfnKind::Moe),
                    _ => Err(self.err(format!("mlp_layer_types: unknown entry {t}"))),
                })
                .collect();
        }
        let first_dense = self.usize_or(&["first_k_dense_replace"], 1)?;
        let freq = self.usize_or(&["moe_layer_freq"], 1)?.max(1);
        let has_experts =
            self.usize_or(&["num_experts", "num_local_experts", "n_routed_experts"], 0)? > 0;
        Ok((0..n)
            .map(|i| {
                if has_experts && i >= first_dense && i % freq == 0 {
                    FfnKind::Moe
                } else {
                    FfnKind::Dense
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    const KIMI_LINEAR_48B: &str = r#"{
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2304,
        "intermediate_size": 9216, "kv_lora_rank": 512,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
            "kda_layers": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26],
            "num_heads": 32, "short_conv_kernel_size": 4},
        "mla_use_nope": true, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
        "moe_renormalize": true, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256,
        "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
        "num_shared_experts": 1, "q_lora_rank": null, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446,
        "tie_word_embeddings": false, "topk_group": 1, "use_grouped_topk": true,
        "v_head_dim": 128, "vocab_size": 163840}"#;

    #[test]
    fn reads_the_published_kimi_linear_config() {
        let c = parse(KIMI_LINEAR_48B).unwrap();
        assert_eq!(c.num_layers(), 27);
        assert_eq!(c.attn.iter().filter(|k| **k == AttnKind::Mla).count(), 7);
        assert_eq!(c.attn[3], AttnKind::Mla);
        assert_eq!(c.attn[26], AttnKind::Mla);
        assert_eq!(c.attn[0], AttnKind::Kda);
        assert_eq!(c.ffn[0], FfnKind::Dense);
        assert!(c.ffn[1..].iter().all(|k| *k == FfnKind::Moe));
        assert_eq!(c.moe.num_experts, 256);
        assert_eq!(c.moe.top_k, 8);
        assert_eq!(c.kda.proj_dim(), 4096);
        assert_eq!(c.mla.latent_dim(), 576);
        assert_eq!(c.eos_token_ids, vec![163585]);
    }

    #[test]
    fn reads_transformers_aliases() {
        let text = KIMI_LINEAR_48B
            .replace("\"num_experts\"", "\"num_local_experts\"")
            .replace("\"num_experts_per_token\"", "\"num_experts_per_tok\"")
            .replace("\"num_expert_group\"", "\"n_group\"");
        let c = parse(&text).unwrap();
        assert_eq!(c.moe.num_experts, 256);
        assert_eq!(c.moe.top_k, 8);
    }

    #[test]
    fn rejects_inconsistent_configs_naming_the_field() {
        let cases = [
            (
                KIMI_LINEAR_48B.replace("\"kimi_linear\"", "\"llama\""),
                "model_type",
            ),
            (
                KIMI_LINEAR_48B.replace("[4, 8, 12", "[3, 8, 12"),
                "listed twice",
            ),
            (
                KIMI_LINEAR_48B.replace("24, 27]", "24, 28]"),
                "full_attn_layers",
            ),
            (
                KIMI_LINEAR_48B.replace("\"num_expert_group\": 1", "\"num_expert_group\": 3"),
                "num_expert_group",
            ),
            (
                KIMI_LINEAR_48B.replace("\"hidden_size\": 2304,", ""),
                "hidden_size",
            ),
            (
                KIMI_LINEAR_48B.replace("\"silu\"", "\"gelu\""),
                "hidden_act",
            ),
            (
                KIMI_LINEAR_48B.replace("\"kv_lora_rank\": 512", "\"kv_lora_rank\": -1"),
                "kv_lora_rank",
            ),
            ("{not json".to_string(), "not valid JSON"),
            (
                KIMI_LINEAR_48B
                    .replace("\"num_hidden_layers\": 27", "\"num_hidden_layers\": 100000"),
                "num_hidden_layers",
            ),
        ];
        for (text, needle) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains(needle),
                "error `{err}` should mention `{needle}`"
            );
        }
    }
}
