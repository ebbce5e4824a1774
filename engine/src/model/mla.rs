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

enum QueryProj {
    Full(Linear),
    LowRank { a: Linear, norm: Norm, b: Linear },
}

pub struct MlaLayer {
    c: MlaConfig,
    q: QueryProj,
    kv_a: Linear,
    kv_norm: Norm,
    /// `[heads·(nope+v), rank]`: per head `nope` rows of `W_UK` then `v` rows of `W_UV`.
    kv_b: Linear,
    o: Linear,
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
            kv_norm: Norm::load(ck, &n("kv_a_layernorm.weight"), c.kv_lora_rank, c.latent_norm_eps)?,
            kv_b: Linear::load(
                ck,
                &n("kv_b_proj.weight"),
                c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            )?,
            o: Linear::load(ck, &n("o_proj.weight"), d, c.num_heads * c.v_head_dim)?,
            c,
        })
    }

    pub fn parameter_count(&self) -> usize {
        let q = match &self.q {
            QueryProj::Full(l) => l.w.len(),
            QueryProj::LowRank { a, norm, b } => a.w.len() + norm.w.len() + b.w.len(),
        };
        q + self.kv_a.w.len() + self.kv_norm.w.len() + self.kv_b.w.len() + self.o.w.len()
    }

    pub fn forward(&self, x: &[f32], rows: &Rows, states: &mut [&mut MlaState]) -> Vec<f32> {
        let n = rows.total();
        let c = &self.c;
        let (h, dn, dr, dv, r) = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
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
            if range.len() == 1 {
                self.attend_absorbed(qs, st, o);
            } else {
                self.attend_expanded(qs, range.len(), st, o);
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
        let (h, dn, dr, dv) = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
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

    /// One query token against the compressed history.
    fn attend_absorbed(&self, q: &[f32], st: &MlaState, out: &mut [f32]) {
        let c = &self.c;
        let (h, dn, dr, dv, r) = (c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let s = st.ckv.len() / r;
        let per_head = dn + dv;
        let mut q_lat = vec![0.0; h * r];
        let mut q_pe = vec![0.0; h * dr];
        for hh in 0..h {
            let qh = &q[hh * (dn + dr)..(hh + 1) * (dn + dr)];
            let w_uk = &self.kv_b.w[hh * per_head * r..(hh * per_head + dn) * r];
            cpu::matmul(&qh[..dn], 1, dn, w_uk, r, &mut q_lat[hh * r..(hh + 1) * r]);
            q_pe[hh * dr..(hh + 1) * dr].copy_from_slice(&qh[dn..]);
        }
        let mut out_lat = vec![0.0; h * r];
        cpu::mla_absorbed_attention(&q_lat, &q_pe, &st.ckv, &st.kpe, 1, s, h, r, dr, s - 1, self.scale(), &mut out_lat);
        for hh in 0..h {
            let w_uv = &self.kv_b.w[(hh * per_head + dn) * r..(hh + 1) * per_head * r];
            cpu::linear(&out_lat[hh * r..(hh + 1) * r], 1, r, w_uv, dv, &mut out[hh * dv..(hh + 1) * dv]);
        }
    }
}
