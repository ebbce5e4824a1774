//! Kimi Delta Attention layer: q/k/v projections through a causal short convolution (SiLU),
//! per-channel forget gate `g = −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias)`, input gate
//! `β = σ(b(x))`, L2-normalised q and k, the delta-rule recurrence (chunked for prompts,
//! recurrent for single tokens), a sigmoid-gated RMSNorm per head and the output projection.
//!
//! K3 switches: the bounded ("safe") gate `g = lb·σ(exp(A_log)·(f + dt_bias))` in `(lb, 0)`, and a
//! full-rank output gate `g_proj [P, D]` instead of `g_b_proj · g_a_proj`. K3 stores `A_log` as
//! `[head_dim]` with the per-head decays first and a zero tail, checked at load (K3-SPEC §6.1:
//! per head, as vLLM reads it; a per-channel reading is rejected by the tail check).

use tessera_kernels::cpu;

use super::linear::{Linear, Norm};
use super::Rows;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::state::KdaState;

/// FLA's chunk length for the chunked KDA form.
const CHUNK: usize = 64;
/// Softplus returns its input above this, as FLA and `transformers` do.
const SOFTPLUS_THRESHOLD: f32 = 20.0;
const QK_L2_EPS: f32 = 1e-6;

pub(super) enum OutGate {
    LowRank { a: Linear, b: Linear },
    Full(Linear),
}

pub struct KdaLayer {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) kernel: usize,
    /// q, k and v projections stacked: `[3P, D]`.
    pub(super) qkv: Linear,
    /// Depthwise conv weights for q, k, v stacked: `[3P, kernel]`.
    pub(super) conv: Vec<f32>,
    pub(super) f_a: Linear,
    pub(super) f_b: Linear,
    pub(super) dt_bias: Vec<f32>,
    /// `exp(A_log)` per head.
    pub(super) decay_rate: Vec<f32>,
    pub(super) b: Linear,
    pub(super) out_gate: OutGate,
    /// `Some(lb)`: the bounded decay gate.
    pub(super) lower_bound: Option<f32>,
    pub(super) o_norm: Norm,
    pub(super) o: Linear,
}

impl KdaLayer {
    /// `prefix` ends with a dot, e.g. `model.layers.0.self_attn.`.
    pub fn load(ck: &Checkpoint, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, dk, d) = (cfg.kda.num_heads, cfg.kda.head_dim, cfg.hidden_size);
        let p = h * dk;
        let kernel = cfg.kda.conv_kernel;
        let n = |s: &str| format!("{prefix}{s}");
        let qkv = Linear::stack(vec![
            Linear::load(ck, &n("q_proj.weight"), p, d)?,
            Linear::load(ck, &n("k_proj.weight"), p, d)?,
            Linear::load(ck, &n("v_proj.weight"), p, d)?,
        ]);
        let mut conv = Vec::with_capacity(3 * p * kernel);
        for which in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            conv.extend(ck.f32(&n(&format!("{which}.weight")), &[p, 1, kernel])?);
        }
        let a_log = load_a_log(ck, &n("A_log"), h, dk)?;
        let out_gate = if cfg.switches.kda_full_rank_gate {
            OutGate::Full(Linear::load(ck, &n("g_proj.weight"), p, d)?)
        } else {
            OutGate::LowRank {
                a: Linear::load(ck, &n("g_a_proj.weight"), dk, d)?,
                b: Linear::load(ck, &n("g_b_proj.weight"), p, dk)?,
            }
        };
        Ok(KdaLayer {
            heads: h,
            head_dim: dk,
            kernel,
            qkv,
            conv,
            f_a: Linear::load(ck, &n("f_a_proj.weight"), dk, d)?,
            f_b: Linear::load(ck, &n("f_b_proj.weight"), p, dk)?,
            dt_bias: ck.f32(&n("dt_bias"), &[p])?,
            decay_rate: a_log.iter().map(|a| a.exp()).collect(),
            b: Linear::load(ck, &n("b_proj.weight"), h, d)?,
            out_gate,
            lower_bound: cfg.switches.kda_gate_lower_bound,
            o_norm: Norm::load(ck, &n("o_norm.weight"), dk, cfg.rms_norm_eps)?,
            o: Linear::load(ck, &n("o_proj.weight"), d, p)?,
        })
    }

    pub fn parameter_count(&self) -> usize {
        let gate = match &self.out_gate {
            OutGate::LowRank { a, b } => a.w.len() + b.w.len(),
            OutGate::Full(g) => g.w.len(),
        };
        [&self.qkv, &self.f_a, &self.f_b, &self.b, &self.o]
            .iter()
            .map(|l| l.w.len())
            .sum::<usize>()
            + gate
            + self.conv.len()
            + self.dt_bias.len()
            + self.decay_rate.len()
            + self.o_norm.w.len()
    }

    /// `invariant`: use the recurrent form for every segment so results do not depend on how
    /// tokens are split into calls (see `Model::set_batch_invariant`).
    pub fn forward(
        &self,
        x: &[f32],
        rows: &Rows,
        states: &mut [&mut KdaState],
        invariant: bool,
    ) -> Vec<f32> {
        let n = rows.total();
        let (h, dk) = (self.heads, self.head_dim);
        let p = h * dk;
        let mixed = self.qkv.forward(x, n);
        let mut conv_out = vec![0.0; mixed.len()];
        for (s, range) in rows.ranges().enumerate() {
            let r = range.start * 3 * p..range.end * 3 * p;
            cpu::short_conv_silu(
                &mixed[r.clone()],
                3 * p,
                &self.conv,
                self.kernel,
                &mut states[s].conv,
                &mut conv_out[r],
            );
        }
        let (mut q, mut k, mut v) = (vec![0.0; n * p], vec![0.0; n * p], vec![0.0; n * p]);
        for t in 0..n {
            let row = &conv_out[t * 3 * p..(t + 1) * 3 * p];
            q[t * p..(t + 1) * p].copy_from_slice(&row[..p]);
            k[t * p..(t + 1) * p].copy_from_slice(&row[p..2 * p]);
            v[t * p..(t + 1) * p].copy_from_slice(&row[2 * p..]);
        }
        cpu::l2_normalize(&mut q, dk, QK_L2_EPS);
        cpu::l2_normalize(&mut k, dk, QK_L2_EPS);

        let mut g = self.f_b.forward(&self.f_a.forward(x, n), n);
        for t in 0..n {
            for (c, gv) in g[t * p..(t + 1) * p].iter_mut().enumerate() {
                let z = *gv + self.dt_bias[c];
                *gv = match self.lower_bound {
                    Some(lb) => lb / (1.0 + (-self.decay_rate[c / dk] * z).exp()),
                    None => {
                        let softplus = if z > SOFTPLUS_THRESHOLD {
                            z
                        } else {
                            (1.0 + z.exp()).ln()
                        };
                        -self.decay_rate[c / dk] * softplus
                    }
                };
            }
        }
        let mut beta = self.b.forward(x, n);
        cpu::sigmoid_inplace(&mut beta);

        let scale = 1.0 / (dk as f32).sqrt();
        let mut core = vec![0.0; n * p];
        for (s, range) in rows.ranges().enumerate() {
            let (a, b) = (range.start * p, range.end * p);
            let (bh_a, bh_b) = (range.start * h, range.end * h);
            let st = &mut states[s].recurrent;
            let (q, k, v, g) = (&q[a..b], &k[a..b], &v[a..b], &g[a..b]);
            let (beta, out) = (&beta[bh_a..bh_b], &mut core[a..b]);
            if range.len() == 1 || invariant {
                cpu::kda_recurrent(q, k, v, g, beta, h, dk, dk, scale, st, out);
            } else {
                cpu::kda_chunked(q, k, v, g, beta, h, dk, dk, scale, CHUNK, st, out);
            }
        }
        let gate = match &self.out_gate {
            OutGate::LowRank { a, b } => b.forward(&a.forward(x, n), n),
            OutGate::Full(g) => g.forward(x, n),
        };
        let mut normed = vec![0.0; n * p];
        cpu::rms_norm_gated(
            &core,
            dk,
            &self.o_norm.w,
            &gate,
            self.o_norm.eps,
            &mut normed,
        );
        self.o.forward(&normed, n)
    }
}

/// `A_log` as `[heads]` (any shape of that many elements, e.g. Kimi Linear's `[1, 1, H, 1]`) or,
/// as K3 stores it, `[head_dim]` whose first `heads` entries are the per-head decays and whose
/// tail must be zero.
fn load_a_log(ck: &Checkpoint, name: &str, heads: usize, head_dim: usize) -> Result<Vec<f32>> {
    let numel = ck.shape(name).map(|s| s.iter().product::<usize>());
    if numel == Some(head_dim) && head_dim > heads {
        let (v, _) = ck.f32_numel(name, head_dim)?;
        if let Some(i) = v[heads..].iter().position(|&x| x != 0.0) {
            return Err(EngineError::InvalidInput(format!(
                "tensor `{name}`: entry {} of the padded A_log is {} (the tail after the {heads} \
                 per-head values must be zero)",
                heads + i,
                v[heads + i]
            )));
        }
        return Ok(v[..heads].to_vec());
    }
    Ok(ck.f32_numel(name, heads)?.0)
}
