//! Multi-head latent attention as in Kimi Linear: NoPE (the `k_pe` part is shared across heads and
//! never rotated), latent history `[c_kv | k_pe]` per token. Prompts expand the latent into
//! per-head keys and values; single-token steps use the absorbed form, which folds `W_UK` into the
//! query and `W_UV` after the attention so the history is read once, compressed.

use tessera_kernels::cpu;

use super::linear::{Linear, Norm};
use super::Rows;
use crate::checkpoint::Checkpoint;
use crate::config::{MlaConfig, ModelConfig};
use crate::error::Result;
use crate::state::MlaState;

pub(super) enum QueryProj {
    Full(Linear),
    LowRank { a: Linear, norm: Norm, b: Linear },
}

pub struct MlaLayer {
    pub(super) c: MlaConfig,
    pub(super) q: QueryProj,
    pub(super) kv_a: Linear,
    pub(super) kv_norm: Norm,
    /// `[heads·(nope+v), rank]`: per head `nope` rows of `W_UK` then `v` rows of `W_UV`.
    pub(super) kv_b: Linear,
    /// Gated MLA (K3): `σ(g_proj(x))` multiplies the attention output before `o_proj`.
    pub(super) gate: Option<Linear>,
    pub(super) o: Linear,
}

impl MlaLayer {
    pub fn load(ck: &Checkpoint, prefix: &str, cfg: &ModelConfig) -> Result<Self> {
        let c = cfg.mla.clone();
        let d = cfg.hidden_size;
        let n = |s: &str| format!("{prefix}{s}");
        let qdim = c.num_heads * c.qk_head_dim();
        let q = match c.q_lora_rank {
            None => QueryProj::Full(Linear::load(ck, &n("q_proj.weight"), qdim, d)?),
            Some(r) => QueryProj::LowRank {
                a: Linear::load(ck, &n("q_a_proj.weight"), r, d)?,
                norm: Norm::load(ck, &n("q_a_layernorm.weight"), r, c.latent_norm_eps)?,
                b: Linear::load(ck, &n("q_b_proj.weight"), qdim, r)?,
            },
        };
        Ok(MlaLayer {
            q,
            kv_a: Linear::load(ck, &n("kv_a_proj_with_mqa.weight"), c.latent_dim(), d)?,
            kv_norm: Norm::load(
                ck,
                &n("kv_a_layernorm.weight"),
                c.kv_lora_rank,
                c.latent_norm_eps,
            )?,
            kv_b: Linear::load(
                ck,
                &n("kv_b_proj.weight"),
                c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            )?,
            gate: if cfg.switches.mla_output_gate {
                Some(Linear::load(
                    ck,
                    &n("g_proj.weight"),
                    c.num_heads * c.v_head_dim,
                    d,
                )?)
            } else {
                None
            },
            o: Linear::load(ck, &n("o_proj.weight"), d, c.num_heads * c.v_head_dim)?,
            c,
        })
    }

    pub fn parameter_count(&self) -> usize {
        let q = match &self.q {
            QueryProj::Full(l) => l.w.len(),
            QueryProj::LowRank { a, norm, b } => a.w.len() + norm.w.len() + b.w.len(),
        };
        q + self.kv_a.w.len()
            + self.kv_norm.w.len()
            + self.kv_b.w.len()
            + self.o.w.len()
            + self.gate.as_ref().map_or(0, |g| g.w.len())
    }

    /// `invariant`: use the absorbed form for every query so results do not depend on how
    /// tokens are split into calls (see `Model::set_batch_invariant`).
    pub fn forward(
        &self,
        x: &[f32],
        rows: &Rows,
        states: &mut [&mut MlaState],
        invariant: bool,
    ) -> Vec<f32> {
        let n = rows.total();
        let c = &self.c;
        let (h, dn, dr, dv, r) = (
            c.num_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let q = match &self.q {
            QueryProj::Full(l) => l.forward(x, n),
            QueryProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x, n)), n),
        };
        let kv = self.kv_a.forward(x, n);
        let mut out = vec![0.0; n * h * dv];
        for (s, range) in rows.ranges().enumerate() {
            let st = &mut *states[s];
            for t in range.clone() {
                let row = &kv[t * (r + dr)..(t + 1) * (r + dr)];
                st.ckv.extend(self.kv_norm.forward(&row[..r]));
                st.kpe.extend_from_slice(&row[r..]);
            }
            let qs = &q[range.start * h * (dn + dr)..range.end * h * (dn + dr)];
            let o = &mut out[range.start * h * dv..range.end * h * dv];
            if range.len() == 1 || invariant {
                self.attend_absorbed(qs, range.len(), st, o);
            } else {
                self.attend_expanded(qs, range.len(), st, o);
            }
        }
        if let Some(gate) = &self.gate {
            // The gate reads the layer input `x`, not the attention output (K3-SPEC §3.3).
            let mut g = gate.forward(x, n);
            cpu::sigmoid_inplace(&mut g);
            for (o, g) in out.iter_mut().zip(&g) {
                *o *= g;
            }
        }
        self.o.forward(&out, n)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.c.qk_head_dim() as f32).sqrt()
    }

    /// Keys and values expanded from the whole latent history; standard causal attention.
    fn attend_expanded(&self, q: &[f32], t: usize, st: &MlaState, out: &mut [f32]) {
        let c = &self.c;
        let (h, dn, dr, dv) = (
            c.num_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        );
        let s = st.ckv.len() / c.kv_lora_rank;
        let kvb = self.kv_b.forward(&st.ckv, s);
        let (dqk, per_head) = (dn + dr, dn + dv);
        let mut k = vec![0.0; s * h * dqk];
        let mut v = vec![0.0; s * h * dv];
        for j in 0..s {
            for hh in 0..h {
                let src = &kvb[(j * h + hh) * per_head..(j * h + hh + 1) * per_head];
                let kd = &mut k[(j * h + hh) * dqk..(j * h + hh + 1) * dqk];
                kd[..dn].copy_from_slice(&src[..dn]);
                kd[dn..].copy_from_slice(&st.kpe[j * dr..(j + 1) * dr]);
                v[(j * h + hh) * dv..(j * h + hh + 1) * dv].copy_from_slice(&src[dn..]);
            }
        }
        cpu::attention_causal(q, &k, &v, t, s, h, dqk, dv, s - t, self.scale(), out);
    }

    /// Queries against the compressed history (absorbed form): `q_lat = q_nope·W_UK` per head,
    /// attention over `[c_kv | k_pe]`, then `W_UV` applied to the attended latent. Every query is
    /// computed on its own, so a token gets the same bits in a decode step and inside a prompt.
    fn attend_absorbed(&self, q: &[f32], t: usize, st: &MlaState, out: &mut [f32]) {
        let c = &self.c;
        let (h, dn, dr, dv, r) = (
            c.num_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let s = st.ckv.len() / r;
        let per_head = dn + dv;
        let mut q_lat = vec![0.0; t * h * r];
        let mut q_pe = vec![0.0; t * h * dr];
        let mut q_nope = vec![0.0; t * dn];
        let mut lat_h = vec![0.0; t * r];
        for hh in 0..h {
            for i in 0..t {
                let qh = &q[(i * h + hh) * (dn + dr)..(i * h + hh + 1) * (dn + dr)];
                q_nope[i * dn..(i + 1) * dn].copy_from_slice(&qh[..dn]);
                q_pe[(i * h + hh) * dr..(i * h + hh + 1) * dr].copy_from_slice(&qh[dn..]);
            }
            let w_uk = &self.kv_b.w[hh * per_head * r..(hh * per_head + dn) * r];
            cpu::matmul(&q_nope, t, dn, w_uk, r, &mut lat_h);
            for i in 0..t {
                q_lat[(i * h + hh) * r..(i * h + hh + 1) * r]
                    .copy_from_slice(&lat_h[i * r..(i + 1) * r]);
            }
        }
        let mut out_lat = vec![0.0; t * h * r];
        cpu::mla_absorbed_attention(
            &q_lat,
            &q_pe,
            &st.ckv,
            &st.kpe,
            t,
            s,
            h,
            r,
            dr,
            s - t,
            self.scale(),
            &mut out_lat,
        );
        let mut o_h = vec![0.0; t * dv];
        for hh in 0..h {
            for i in 0..t {
                lat_h[i * r..(i + 1) * r]
                    .copy_from_slice(&out_lat[(i * h + hh) * r..(i * h + hh + 1) * r]);
            }
            let w_uv = &self.kv_b.w[(hh * per_head + dn) * r..(hh + 1) * per_head * r];
            cpu::linear(&lat_h, t, r, w_uv, dv, &mut o_h);
            for i in 0..t {
                out[(i * h + hh) * dv..(i * h + hh + 1) * dv]
                    .copy_from_slice(&o_h[i * dv..(i + 1) * dv]);
            }
        }
    }
}
