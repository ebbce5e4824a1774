//! Mixture of experts with sigmoid routing, score-correction bias, grouped top-k,
//! renormalisation, routed scaling and shared experts (Kimi Linear / DeepSeek-V3 style).
//!
//! K3's stable latent MoE (switch `latent_moe`): routing reads the hidden state, the routed
//! experts run on `routed_expert_down_proj(y)`, their weighted sum goes through the latent RMSNorm
//! and `routed_expert_up_proj`; the shared experts stay on the un-projected `y` (K3-SPEC §3.4).

use tessera_kernels::cpu::{self, MoeRouting};

use super::k3::LatentProj;
use super::linear::Linear;
use super::mlp::Mlp;
use super::mxfp4::Mxfp4Linear;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;

pub struct Moe {
    pub(super) router: Linear,
    pub(super) correction_bias: Vec<f32>,
    pub(super) routing: MoeRouting,
    pub(super) experts: Vec<Mlp>,
    pub(super) shared: Option<Mlp>,
    pub(super) latent: Option<Box<LatentProj>>,
    pub(super) top_k: usize,
}

impl Moe {
    /// `prefix` ends with a dot, e.g. `model.layers.3.block_sparse_moe.`.
    pub fn load(ck: &Checkpoint, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let m = &cfg.moe;
        let d = cfg.hidden_size;
        let router = Linear::load(ck, &format!("{prefix}gate.weight"), m.num_experts, d)?;
        let bias_name = format!("{prefix}gate.e_score_correction_bias");
        let correction_bias = if ck.contains(&bias_name) {
            ck.f32(&bias_name, &[m.num_experts])?
        } else {
            vec![0.0; m.num_experts]
        };
        let act = cfg.switches.activation;
        let latent = match cfg.switches.latent_moe {
            Some(l) => Some(Box::new(LatentProj::load(
                ck,
                prefix,
                d,
                l.dim,
                l.use_norm,
                cfg.rms_norm_eps,
            )?)),
            None => None,
        };
        let expert_dim = latent.as_ref().map_or(d, |l| l.down.out_dim);
        let experts = (0..m.num_experts)
            .map(|e| {
                ExpertNames::new(prefix, e)
                    .load(ck, expert_dim, m.intermediate_size)
                    .map(|x| x.with_activation(act))
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = if m.num_shared_experts > 0 {
            Some(
                Mlp::load(
                    ck,
                    &format!("{prefix}shared_experts."),
                    d,
                    m.intermediate_size * m.num_shared_experts,
                )?
                .with_activation(act),
            )
        } else {
            None
        };
        Ok(Moe {
            router,
            correction_bias,
            routing: MoeRouting {
                n_group: m.n_group,
                topk_group: m.topk_group,
                top_k: m.top_k,
                renormalize: m.renormalize,
                scaling: m.routed_scaling_factor,
            },
            experts,
            shared,
            latent,
            top_k: m.top_k,
        })
    }

    pub fn parameter_count(&self) -> usize {
        self.router.w.len()
            + self.correction_bias.len()
            + self.experts.iter().map(Mlp::parameter_count).sum::<usize>()
            + self.shared.as_ref().map_or(0, Mlp::parameter_count)
            + self
                .latent
                .as_deref()
                .map_or(0, LatentProj::parameter_count)
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let d = self.router.in_dim;
        let logits = self.router.forward(x, rows);
        let mut idx = vec![0u32; rows * self.top_k];
        let mut weight = vec![0f32; rows * self.top_k];
        cpu::route_sigmoid_grouped(
            &logits,
            self.experts.len(),
            &self.correction_bias,
            &self.routing,
            &mut idx,
            &mut weight,
        );
        // Tokens grouped by expert so each expert runs one GEMM over its rows.
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for r in 0..rows {
            for j in 0..self.top_k {
                assigned[idx[r * self.top_k + j] as usize].push((r, weight[r * self.top_k + j]));
            }
        }
        let mut out = match &self.shared {
            Some(s) => s.forward(x, rows),
            None => vec![0.0; rows * d],
        };
        // Routed experts see the latent `z` (width `ed`) under latent MoE, else `x` itself.
        let z = self.latent.as_ref().map(|l| l.down.forward(x, rows));
        let (src, ed) = match (&z, &self.latent) {
            (Some(z), Some(l)) => (z.as_slice(), l.down.out_dim),
            _ => (x, d),
        };
        let mut routed = vec![0.0f32; rows * ed];
        for (e, toks) in assigned.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let mut xs = Vec::with_capacity(toks.len() * ed);
            for &(r, _) in toks {
                xs.extend_from_slice(&src[r * ed..(r + 1) * ed]);
            }
            let y = self.experts[e].forward(&xs, toks.len());
            for (i, &(r, w)) in toks.iter().enumerate() {
                for (o, v) in routed[r * ed..(r + 1) * ed]
                    .iter_mut()
                    .zip(&y[i * ed..(i + 1) * ed])
                {
                    *o += w * v;
                }
            }
        }
        if let Some(l) = &self.latent {
            if let Some(norm) = &l.norm {
                routed = norm.forward(&routed);
            }
            routed = l.up.forward(&routed, rows);
        }
        for (o, r) in out.iter_mut().zip(&routed) {
            *o += r;
        }
        out
    }
}

/// Expert weights are published as `experts.E.w1` (gate), `w3` (up) and `w2` (down), each either
/// `.weight` (bf16/f32) or packed MXFP4 `.weight_packed` + `.weight_scale`: the checkpoint decides,
/// not the config's `ignore` patterns (K3-SPEC §6.9).
struct ExpertNames {
    prefix: String,
}

impl ExpertNames {
    fn new(prefix: &str, e: usize) -> Self {
        ExpertNames {
            prefix: format!("{prefix}experts.{e}."),
        }
    }

    fn load(&self, ck: &Checkpoint, hidden: usize, inter: usize) -> Result<Mlp> {
        let p = &self.prefix;
        if ck.contains(&format!("{p}w1.weight_packed")) {
            return Ok(Mlp::from_mxfp4(
                Mxfp4Linear::load(ck, &format!("{p}w1"), inter, hidden)?,
                Mxfp4Linear::load(ck, &format!("{p}w3"), inter, hidden)?,
                Mxfp4Linear::load(ck, &format!("{p}w2"), hidden, inter)?,
            ));
        }
        Mlp::from_parts(
            Linear::load(ck, &format!("{p}w1.weight"), inter, hidden)?,
            Linear::load(ck, &format!("{p}w3.weight"), inter, hidden)?,
            Linear::load(ck, &format!("{p}w2.weight"), hidden, inter)?,
        )
    }
}
