//! `vision_config` of the multimodal wrappers (`kimi_k25`, `kimi_k3`): the MoonViT tower and
//! projector, in Moonshot's spelling or transformers', with the K2.5 or K3 defaults for absent
//! fields, checked for internal consistency.

use serde_json::Value;

use super::k3::{K25_MODEL_TYPE, MODEL_TYPE};
use super::Fields;
use crate::error::Result;

/// `vision_config` (MoonViT3d + patch-merger projector, K3-SPEC §1, §3.5).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub patch_size: usize,
    /// `init_pos_emb_{height,width,time}`.
    pub pos_emb: [usize; 3],
    pub pos_emb_type: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    /// Width of each of q, k, v (`heads · head_dim`).
    pub qkv_hidden_size: usize,
    pub intermediate_size: usize,
    pub norm_type: String,
    pub activation: String,
    pub merge_kernel: [usize; 2],
    pub merge_type: String,
    pub projector_type: String,
    pub projector_activation: String,
    pub projector_ln_eps: f32,
    /// Width of the projector's output: the text model's `hidden_size`.
    pub text_hidden_size: usize,
    /// `media_placeholder_token_id` or `image_token_id` (top level): the token whose embeddings
    /// images replace.
    pub placeholder_token_id: Option<u32>,
    /// Base of the tower's 2-D rotary embedding (`rope_parameters.rope_theta`, 10⁴ by default).
    pub rope_theta: f32,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.qkv_hidden_size / self.num_heads
    }
}

impl Fields<'_> {
    /// The `vision_config` of a `kimi_k25` / `kimi_k3` wrapper with the top-level fields it
    /// needs (placeholder id, projector epsilon).
    pub(super) fn wrapper_vision(
        &self,
        k25: bool,
        text_hidden: usize,
    ) -> Result<Option<VisionConfig>> {
        let mut placeholder = self.token_ids("media_placeholder_token_id")?;
        placeholder.extend(self.token_ids("image_token_id")?);
        let placeholder = placeholder.first().copied();
        let projector_ln_eps = self.f32_or(&["projection_layer_norm_eps"], 1e-5)?;
        match self.v.get("vision_config").filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => Ok(Some(Fields { v, path: self.path }.vision(
                text_hidden,
                placeholder,
                k25,
                projector_ln_eps,
            )?)),
        }
    }

    /// Only the vision part of a config (`None` for a text-only model): the text model is not
    /// parsed beyond its `hidden_size`, so the tower loads whatever the text family is.
    pub(super) fn vision_only(&self) -> Result<Option<VisionConfig>> {
        let model_type = self.str_or(&["model_type"], "")?;
        let k25 = model_type == K25_MODEL_TYPE;
        let has_vision = self.v.get("vision_config").is_some_and(|v| !v.is_null());
        if !(k25 || model_type == MODEL_TYPE) {
            return if has_vision {
                Err(self.err(format!(
                    "model_type `{model_type}` with a vision_config is not supported \
                     (supported: kimi_k25, kimi_k3)"
                )))
            } else {
                Ok(None)
            };
        }
        let text_v = self
            .v
            .get("text_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| {
                self.err(format!(
                    "{model_type}: missing required object `text_config`"
                ))
            })?;
        let text_hidden = Fields {
            v: text_v,
            path: self.path,
        }
        .usize_opt(&["hidden_size"])?
        .ok_or_else(|| self.err("text_config.hidden_size is missing"))?;
        self.wrapper_vision(k25, text_hidden)
    }

    /// `vision_config` in Moonshot's spelling (`vt_hidden_size`, `init_pos_emb_height`, …) or
    /// transformers' (`hidden_size`, `pos_emb_height`, …); absent fields take the K2.5 or the K3
    /// defaults.
    fn vision(
        &self,
        text_hidden: usize,
        placeholder: Option<u32>,
        k25: bool,
        projector_ln_eps: f32,
    ) -> Result<VisionConfig> {
        let (hidden, heads, inter, norm, projector) = if k25 {
            (1152, 16, 4304, "layernorm", "patchmerger")
        } else {
            (1024, 12, 4096, "rmsnorm", "patchmergerv2")
        };
        let hidden_size = self.usize_or(&["vt_hidden_size", "hidden_size"], hidden)?;
        let s = |name: &str, default: &str| -> Result<String> {
            Ok(self.str_or(&[name], default)?.to_string())
        };
        let pair = |name: &str, default: [usize; 2]| -> Result<[usize; 2]> {
            match self.v.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Array(a)) if a.len() == 2 => {
                    let get = |x: &Value| {
                        x.as_u64()
                            .filter(|&x| x > 0)
                            .map(|x| x as usize)
                            .ok_or_else(|| {
                                self.err(format!(
                                    "vision_config.{name} must hold positive integers"
                                ))
                            })
                    };
                    Ok([get(&a[0])?, get(&a[1])?])
                }
                Some(other) => Err(self.err(format!(
                    "vision_config.{name} must be a list of 2 integers, got {other}"
                ))),
            }
        };
        let v = VisionConfig {
            patch_size: self.usize_or(&["patch_size"], 14)?,
            pos_emb: [
                self.usize_or(&["init_pos_emb_height", "pos_emb_height"], 64)?,
                self.usize_or(&["init_pos_emb_width", "pos_emb_width"], 64)?,
                self.usize_or(&["init_pos_emb_time", "pos_emb_time"], 4)?,
            ],
            pos_emb_type: s("pos_emb_type", "divided_fixed")?,
            num_layers: self.usize_or(&["vt_num_hidden_layers", "num_hidden_layers"], 27)?,
            hidden_size,
            num_heads: self.usize_or(&["vt_num_attention_heads", "num_attention_heads"], heads)?,
            qkv_hidden_size: self
                .usize_or(&["qkv_hidden_size"], if k25 { hidden_size } else { 1536 })?,
            intermediate_size: self
                .usize_or(&["vt_intermediate_size", "intermediate_size"], inter)?,
            norm_type: s("norm_type", norm)?,
            activation: self
                .str_or(&["activation", "hidden_act"], "gelu_pytorch_tanh")?
                .to_string(),
            merge_kernel: pair("merge_kernel_size", [2, 2])?,
            merge_type: s("merge_type", "sd2_tpool")?,
            projector_type: s("mm_projector_type", projector)?,
            projector_activation: s("projector_hidden_act", "gelu")?,
            projector_ln_eps: self.f32_or(&["projector_ln_eps"], projector_ln_eps)?,
            text_hidden_size: self.usize_or(&["text_hidden_size"], text_hidden)?,
            placeholder_token_id: placeholder,
            rope_theta: match self.v.get("rope_parameters").filter(|v| v.is_object()) {
                Some(r) => Fields {
                    v: r,
                    path: self.path,
                }
                .f32_or(&["rope_theta"], 1e4)?,
                None => self.f32_or(&["rope_theta"], 1e4)?,
            },
        };
        for (name, x) in [
            ("patch_size", v.patch_size),
            ("vt_num_hidden_layers", v.num_layers),
            ("vt_hidden_size", v.hidden_size),
            ("vt_num_attention_heads", v.num_heads),
            ("qkv_hidden_size", v.qkv_hidden_size),
            ("vt_intermediate_size", v.intermediate_size),
        ] {
            if x == 0 {
                return Err(self.err(format!("vision_config.{name} must be positive")));
            }
        }
        if !v.qkv_hidden_size.is_multiple_of(v.num_heads) {
            return Err(self.err(format!(
                "vision_config.qkv_hidden_size {} is not divisible by vt_num_attention_heads {}",
                v.qkv_hidden_size, v.num_heads
            )));
        }
        if v.text_hidden_size != text_hidden {
            return Err(self.err(format!(
                "vision_config.text_hidden_size {} differs from text_config.hidden_size {text_hidden}",
                v.text_hidden_size
            )));
        }
        Ok(v)
    }
}
