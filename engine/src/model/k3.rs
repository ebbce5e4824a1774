//! The Kimi K3 pieces that Kimi Linear lacks, used by the shared layers behind
//! [`ArchSwitches`](crate::config::ArchSwitches): AttnRes (K3-SPEC §3.1), SiTU (§3.4) and the
//! latent projections of the stable latent MoE.
//!
//! AttnRes numerics (K3-SPEC §7.1–§7.3): the partial sum `p` and the block array are kept in f32
//! on this CPU path (vLLM rounds `p` to bf16 after each add; a bf16 `p` is not reproducible across
//! implementations), the block restart is `p = a`, and the final mix is the hidden state that the
//! model's final norm reads. Nothing is carried across tokens: every operation is per row.

use super::linear::{Linear, Norm};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// `[β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]`, element-wise, in f32.
pub(crate) fn situ_mul(gate: &[f32], up: &[f32], b1: f32, b2: f32, out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let sig = 1.0 / (1.0 + (-g).exp());
        *o = (b1 * (g / b1).tanh() * sig) * (b2 * (u / b2).tanh());
    }
}

/// An AttnRes pseudo-query: `norm.weight ⊙ proj.weight`, folded at load.
pub(crate) struct ResQuery {
    pub(super) q: Vec<f32>,
    pub(super) eps: f32,
}

impl ResQuery {
    /// `prefix` names the pair, e.g. `…layers.3.mlp_res` (`_norm.weight` and `_proj.weight`).
    pub(crate) fn load(ck: &Checkpoint, prefix: &str, d: usize, eps: f32) -> Result<Self> {
        let norm = ck.f32(&format!("{prefix}_norm.weight"), &[d])?;
        let proj = ck.f32(&format!("{prefix}_proj.weight"), &[1, d])?;
        Ok(ResQuery {
            q: norm.iter().zip(&proj).map(|(a, b)| a * b).collect(),
            eps,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.q.len()
    }

    /// Per row: softmax over the sources of `<v / rms(v), q>`, then `Σ α_v · v` (unnormalised).
    pub(crate) fn mix(&self, sources: &[&[f32]], rows: usize) -> Vec<f32> {
        let d = self.q.len();
        let mut out = vec![0.0f32; rows * d];
        let mut score = vec![0.0f32; sources.len()];
        for r in 0..rows {
            let span = r * d..(r + 1) * d;
            for (s, src) in score.iter_mut().zip(sources) {
                let v = &src[span.clone()];
                let ms = v.iter().map(|x| x * x).sum::<f32>() / d as f32;
                let inv = 1.0 / (ms + self.eps).sqrt();
                *s = v.iter().zip(&self.q).map(|(x, q)| x * q).sum::<f32>() * inv;
            }
            let max = score.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0;
            for s in score.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            let o = &mut out[span.clone()];
            for (s, src) in score.iter().zip(sources) {
                let a = s / total;
                for (o, x) in o.iter_mut().zip(&src[span.clone()]) {
                    *o += a * x;
                }
            }
        }
        out
    }
}

/// The per-forward AttnRes bookkeeping: block array `R`, partial sum `p`, last MLP output `δ`.
pub(crate) struct AttnResRun {
    block: usize,
    rows: usize,
    blocks: Vec<Vec<f32>>,
    p: Vec<f32>,
    delta: Option<Vec<f32>>,
}

impl AttnResRun {
    pub(crate) fn new(embedding: Vec<f32>, rows: usize, block: usize) -> Self {
        AttnResRun {
            block,
            rows,
            blocks: Vec::new(),
            p: embedding,
            delta: None,
        }
    }

    fn fold_delta(&mut self) {
        if let Some(delta) = self.delta.take() {
            for (p, x) in self.p.iter_mut().zip(&delta) {
                *p += x;
            }
        }
    }

    /// Step 1 of layer `l`: `p += δ`; at a block start store `R[l/B] = p` (then the sources are
    /// `R` alone), else the sources are `R ∪ {p}`. Returns the mix (before `input_layernorm`).
    pub(crate) fn before_attention(&mut self, l: usize, q: &ResQuery) -> Vec<f32> {
        self.fold_delta();
        if l.is_multiple_of(self.block) {
            self.blocks.push(self.p.clone());
            let sources: Vec<&[f32]> = self.blocks.iter().map(Vec::as_slice).collect();
            q.mix(&sources, self.rows)
        } else {
            self.mix_with_partial(q)
        }
    }

    /// Step 2 and 3: `p = a` at a block start, else `p += a`; returns the mix of `R ∪ {p}` (before
    /// `post_attention_layernorm`).
    pub(crate) fn after_attention(&mut self, l: usize, a: Vec<f32>, q: &ResQuery) -> Vec<f32> {
        if l.is_multiple_of(self.block) {
            self.p = a;
        } else {
            for (p, x) in self.p.iter_mut().zip(&a) {
                *p += x;
            }
        }
        self.mix_with_partial(q)
    }

    pub(crate) fn after_mlp(&mut self, delta: Vec<f32>) {
        self.delta = Some(delta);
    }

    /// The output mix over `R ∪ {p + δ_last}`: the hidden state the final norm reads.
    pub(crate) fn finish(mut self, q: &ResQuery) -> Vec<f32> {
        self.fold_delta();
        self.mix_with_partial(q)
    }

    fn mix_with_partial(&self, q: &ResQuery) -> Vec<f32> {
        let mut sources: Vec<&[f32]> = self.blocks.iter().map(Vec::as_slice).collect();
        sources.push(&self.p);
        q.mix(&sources, self.rows)
    }
}

/// The stable latent MoE's projections: routed experts see `down(y)`; their weighted sum goes
/// through the optional latent RMSNorm and `up` back to the hidden width.
pub(crate) struct LatentProj {
    pub(crate) down: Linear,
    pub(crate) norm: Option<Norm>,
    pub(crate) up: Linear,
}

impl LatentProj {
    pub(crate) fn load(
        ck: &Checkpoint,
        prefix: &str,
        hidden: usize,
        latent: usize,
        use_norm: bool,
        eps: f32,
    ) -> Result<Self> {
        Ok(LatentProj {
            down: Linear::load(
                ck,
                &format!("{prefix}routed_expert_down_proj.weight"),
                latent,
                hidden,
            )?,
            norm: if use_norm {
                Some(Norm::load(
                    ck,
                    &format!("{prefix}routed_expert_norm.weight"),
                    latent,
                    eps,
                )?)
            } else {
                None
            },
            up: Linear::load(
                ck,
                &format!("{prefix}routed_expert_up_proj.weight"),
                hidden,
                latent,
            )?,
        })
    }

    pub(crate) fn parameter_count(&self) -> usize {
        self.down.w.len() + self.up.w.len() + self.norm.as_ref().map_or(0, |n| n.w.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn situ_matches_its_formula_and_clips() {
        let (g, u) = ([0.5f32, -3.0, 100.0], [2.0f32, -40.0, 1000.0]);
        let mut out = [0.0; 3];
        situ_mul(&g, &u, 4.0, 25.0, &mut out);
        for i in 0..3 {
            let sig = 1.0 / (1.0 + (-g[i] as f64).exp());
            let want = 4.0 * (g[i] as f64 / 4.0).tanh() * sig * 25.0 * (u[i] as f64 / 25.0).tanh();
            assert!(
                (out[i] as f64 - want).abs() < 1e-4 * want.abs().max(1.0),
                "{i}"
            );
        }
        // silu(100)·1000 would be 1e5; SiTU saturates at β1·β2 = 100.
        assert!(out[2] <= 100.0, "both factors are clipped: {}", out[2]);
        // Large betas: SiLU-GLU.
        situ_mul(&g[..2], &u[..2], 1e6, 1e6, &mut out[..2]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        assert!((out[0] - silu(0.5) * 2.0).abs() < 1e-5);
    }

    #[test]
    fn mix_is_a_softmax_weighted_sum_of_the_raw_sources() {
        let q = ResQuery {
            q: vec![1.0, -1.0],
            eps: 0.0,
        };
        let (a, b) = ([3.0f32, 0.0], [0.0f32, 1.0]);
        // scores: a/rms(a) = [√2, 0] → √2; b/rms(b) = [0, √2] → −√2.
        let out = q.mix(&[&a, &b], 1);
        let (ea, eb) = (2f32.sqrt().exp(), (-(2f32.sqrt())).exp());
        let (wa, wb) = (ea / (ea + eb), eb / (ea + eb));
        assert!((out[0] - 3.0 * wa).abs() < 1e-6 && (out[1] - wb).abs() < 1e-6);
        // One source: the identity.
        assert_eq!(q.mix(&[&a], 1), a.to_vec());
    }
}
