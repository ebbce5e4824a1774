//! From tower outputs to text embeddings: the `sd2_tpool` merge (mean over frames, then each
//! `kh × kw` block of patches concatenated into one token) and the projector.
//!
//! - `patchmerger` (K2.5): LayerNorm on every patch (`pre_norm`), then on the merged token
//!   `proj.0` → GELU → `proj.2`.
//! - `patchmergerv2` (K3-SPEC §3.5): `proj.0` → GELU → `proj.2` → RMSNorm on the output. The
//!   spec gives that norm's shape but not its name; `mm_projector.post_norm` and
//!   `mm_projector.norm` are accepted, and a missing one is reported with both names.

use super::ops::{Affine, Gelu, NormKind, VisionNorm};
use crate::checkpoint::Checkpoint;
use crate::config::VisionConfig;
use crate::error::{EngineError, Result};

pub(crate) struct Projector {
    kernel: [usize; 2],
    hidden: usize,
    pre_norm: Option<VisionNorm>,
    in_proj: Affine,
    act: Gelu,
    out_proj: Affine,
    post_norm: Option<VisionNorm>,
}

impl Projector {
    pub fn load(ck: &Checkpoint, cfg: &VisionConfig) -> Result<Self> {
        let bad = |message: String| EngineError::Config {
            path: "config.json".into(),
            message,
        };
        if cfg.merge_type != "sd2_tpool" {
            return Err(bad(format!(
                "vision_config.merge_type `{}` is not supported (expected sd2_tpool)",
                cfg.merge_type
            )));
        }
        let act = Gelu::from_name(&cfg.projector_activation).ok_or_else(|| {
            bad(format!(
                "vision_config.projector_hidden_act `{}` is not supported",
                cfg.projector_activation
            ))
        })?;
        let d = cfg.hidden_size;
        let merged = d * cfg.merge_kernel[0] * cfg.merge_kernel[1];
        let text = cfg.text_hidden_size;
        let eps = cfg.projector_ln_eps;
        let (pre_norm, post_norm) = match cfg.projector_type.as_str() {
            "patchmerger" => (
                Some(VisionNorm::load(
                    ck,
                    &["mm_projector.pre_norm", "model.mm_projector.pre_norm"],
                    NormKind::Layer,
                    d,
                    eps,
                )?),
                None,
            ),
            "patchmergerv2" => (
                None,
                Some(VisionNorm::load(
                    ck,
                    &["mm_projector.post_norm", "mm_projector.norm"],
                    NormKind::Rms,
                    text,
                    eps,
                )?),
            ),
            other => {
                return Err(bad(format!(
                    "vision_config.mm_projector_type `{other}` is not supported \
                     (expected patchmerger or patchmergerv2)"
                )))
            }
        };
        Ok(Projector {
            kernel: cfg.merge_kernel,
            hidden: d,
            pre_norm,
            in_proj: Affine::load(
                ck,
                &["mm_projector.proj.0", "model.mm_projector.in_proj"],
                merged,
                merged,
            )?,
            act,
            out_proj: Affine::load(
                ck,
                &["mm_projector.proj.2", "model.mm_projector.out_proj"],
                text,
                merged,
            )?,
            post_norm,
        })
    }

    pub fn parameter_count(&self) -> usize {
        self.pre_norm
            .as_ref()
            .map_or(0, VisionNorm::parameter_count)
            + self.in_proj.parameter_count()
            + self.out_proj.parameter_count()
            + self
                .post_norm
                .as_ref()
                .map_or(0, VisionNorm::parameter_count)
    }

    /// Tokens an image of `rows × cols` patches becomes.
    pub fn tokens(&self, rows: usize, cols: usize) -> usize {
        (rows / self.kernel[0]) * (cols / self.kernel[1])
    }

    /// `hidden`: the tower's output for one frame, `[rows·cols, d]` raster order. Returns
    /// `[tokens, text_hidden]`.
    pub fn forward(&self, hidden: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let d = self.hidden;
        let [kh, kw] = self.kernel;
        let (mr, mc) = (rows / kh, cols / kw);
        let hidden = match &self.pre_norm {
            Some(n) => n.forward(hidden),
            None => hidden.to_vec(),
        };
        let merged_dim = d * kh * kw;
        let mut merged = Vec::with_capacity(mr * mc * merged_dim);
        for br in 0..mr {
            for bc in 0..mc {
                for i in 0..kh {
                    for j in 0..kw {
                        let p = (br * kh + i) * cols + bc * kw + j;
                        merged.extend_from_slice(&hidden[p * d..(p + 1) * d]);
                    }
                }
            }
        }
        let mut x = self.in_proj.forward(&merged, mr * mc);
        self.act.apply(&mut x);
        let y = self.out_proj.forward(&x, mr * mc);
        match &self.post_norm {
            Some(n) => n.forward(&y),
            None => y,
        }
    }
}
