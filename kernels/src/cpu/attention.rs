//! Causal softmax attention: standard multi-head, and MLA in absorbed form.
//!
//! Both run one core over blocks of query rows that share a key/value set:
//! scores for the block are computed key-major (each key row is loaded once
//! per block), softmaxed per row, then values are accumulated key-major.
//! Every per-row quantity uses a fixed order (8-lane dots, 8-lane sums, value
//! accumulation in increasing key index), so a query's output does not depend
//! on the block it lands in: decoding a token gives the same bits as the same
//! position inside a prefill.

use rayon::prelude::*;

use super::simd::{self, multiversion, SyncPtr};

/// Query rows per block (bounded so scores stay small and tasks plentiful).
const QB: usize = 8;

/// Row-strided key/value view: key `j` is `k1[j*ld1..][..d1]` (plus the
/// optional second part `k2`, for MLA's rotary key), value `j` is `v[j*ldv..][..dv]`.
struct Keys<'a> {
    k1: &'a [f32],
    ld1: usize,
    d1: usize,
    k2: &'a [f32],
    ld2: usize,
    d2: usize,
    v: &'a [f32],
    ldv: usize,
    dv: usize,
}

/// One query row: score_j = scale·(q1·k1_j + q2·k2_j) for keys `0..len`.
struct QRow<'a> {
    q1: &'a [f32],
    q2: &'a [f32],
    len: usize,
}

multiversion! {
    /// out [rows, dv] = softmax(scores) · V for each row of the block.
    fn attend_block(rows: &[QRow], keys: &Keys, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
        let smax = rows.iter().map(|r| r.len).max().unwrap_or(0);
        scores.clear();
        scores.resize(rows.len() * smax, 0.0);
        for j in 0..smax {
            let k1 = &keys.k1[j * keys.ld1..j * keys.ld1 + keys.d1];
            let k2 = &keys.k2[j * keys.ld2..j * keys.ld2 + keys.d2];
            for (b, r) in rows.iter().enumerate() {
                if j < r.len {
                    let mut s = simd::dot(r.q1, k1);
                    if keys.d2 > 0 {
                        s += simd::dot(r.q2, k2);
                    }
                    scores[b * smax + j] = scale * s;
                }
            }
        }
        for (b, r) in rows.iter().enumerate() {
            let p = &mut scores[b * smax..b * smax + r.len];
            let m = simd::max(p);
            for x in p.iter_mut() {
                *x = simd::exp(*x - m);
            }
            let inv = 1.0 / simd::sum(p);
            for x in p.iter_mut() {
                *x *= inv;
            }
        }
        out.fill(0.0);
        for j in 0..smax {
            let v = &keys.v[j * keys.ldv..j * keys.ldv + keys.dv];
            for (b, r) in rows.iter().enumerate() {
                if j < r.len {
                    simd::axpy(&mut out[b * keys.dv..(b + 1) * keys.dv], scores[b * smax + j], v);
                }
            }
        }
    }
}

/// Multi-head causal softmax attention.
///
/// q [t, heads, dqk], k [s, heads, dqk], v [s, heads, dv] → out [t, heads, dv].
/// Query `i` sits at absolute position `offset + i` and attends keys
/// `0..=offset+i`; requires `offset + t == s`. Softmax in f32 with max subtraction.
#[allow(clippy::too_many_arguments)]
pub fn attention_causal(
    q: &[f32], k: &[f32], v: &[f32], t: usize, s: usize, heads: usize, dqk: usize, dv: usize,
    offset: usize, scale: f32, out: &mut [f32],
) {
    assert_eq!(offset + t, s, "attention_causal: offset + t must equal s");
    assert_eq!(q.len(), t * heads * dqk, "attention_causal: q shape");
    assert_eq!(k.len(), s * heads * dqk, "attention_causal: k shape");
    assert_eq!(v.len(), s * heads * dv, "attention_causal: v shape");
    assert_eq!(out.len(), t * heads * dv, "attention_causal: out shape");
    if t == 0 || heads == 0 || dv == 0 {
        return;
    }
    let qblocks = t.div_ceil(QB);
    let outp = SyncPtr::new(out);
    (0..heads * qblocks).into_par_iter().for_each_init(
        || (Vec::new(), vec![0.0f32; QB * dv]),
        |(scores, ob), u| {
            let (h, i0) = (u / qblocks, (u % qblocks) * QB);
            let i1 = (i0 + QB).min(t);
            let rows: Vec<QRow> = (i0..i1)
                .map(|i| QRow { q1: &q[(i * heads + h) * dqk..][..dqk], q2: &[], len: offset + i + 1 })
                .collect();
            let keys = Keys {
                k1: &k[h * dqk..], ld1: heads * dqk, d1: dqk,
                k2: &[], ld2: 0, d2: 0,
                v: &v[h * dv..], ldv: heads * dv, dv,
            };
            let ob = &mut ob[..rows.len() * dv];
            attend_block(&rows, &keys, scale, scores, ob);
            for (b, i) in (i0..i1).enumerate() {
                // SAFETY: unit (h, block) writes only rows (i, h) for its own i; disjoint.
                unsafe {
                    let dst = outp.get().add((i * heads + h) * dv);
                    std::ptr::copy_nonoverlapping(ob.as_ptr().add(b * dv), dst, dv);
                }
            }
        },
    );
}

/// MLA attention in absorbed (latent) form.
///
/// q_lat [t, heads, rank], q_pe [t, heads, dpe], ckv [s, rank] (shared latent
/// keys/values), kpe [s, dpe] (shared rotary key). For j ≤ offset+i:
/// `score = scale·(q_lat·ckv_j + q_pe·kpe_j)`, `p = softmax_j`,
/// `out_lat[i, h] = Σ_j p·ckv_j` → out_lat [t, heads, rank]. Requires `offset + t == s`.
#[allow(clippy::too_many_arguments)]
pub fn mla_absorbed_attention(
    q_lat: &[f32], q_pe: &[f32], ckv: &[f32], kpe: &[f32], t: usize, s: usize, heads: usize, rank: usize,
    dpe: usize, offset: usize, scale: f32, out_lat: &mut [f32],
) {
    assert_eq!(offset + t, s, "mla_absorbed_attention: offset + t must equal s");
    assert_eq!(q_lat.len(), t * heads * rank, "mla_absorbed_attention: q_lat shape");
    assert_eq!(q_pe.len(), t * heads * dpe, "mla_absorbed_attention: q_pe shape");
    assert_eq!(ckv.len(), s * rank, "mla_absorbed_attention: ckv shape");
    assert_eq!(kpe.len(), s * dpe, "mla_absorbed_attention: kpe shape");
    assert_eq!(out_lat.len(), t * heads * rank, "mla_absorbed_attention: out shape");
    if t == 0 || heads == 0 || rank == 0 {
        return;
    }
    let keys = Keys { k1: ckv, ld1: rank, d1: rank, k2: kpe, ld2: dpe, d2: dpe, v: ckv, ldv: rank, dv: rank };
    // All heads share the keys, so a block is QB consecutive (query, head) rows.
    out_lat.par_chunks_mut(QB * rank).enumerate().for_each_init(Vec::new, |scores, (blk, ob)| {
        let r0 = blk * QB;
        let rows: Vec<QRow> = (r0..r0 + ob.len() / rank)
            .map(|r| QRow { q1: &q_lat[r * rank..][..rank], q2: &q_pe[r * dpe..][..dpe], len: offset + r / heads + 1 })
            .collect();
        attend_block(&rows, &keys, scale, scores, ob);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    /// f64 naive causal attention over per-head key/query vectors given by closures.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        t: usize, heads: usize, dv: usize, offset: usize, scale: f32,
        score: impl Fn(usize, usize, usize) -> f64, val: impl Fn(usize, usize, usize) -> f64,
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; t * heads * dv];
        for i in 0..t {
            for h in 0..heads {
                let n = offset + i + 1;
                let sc: Vec<f64> = (0..n).map(|j| scale as f64 * score(i, h, j)).collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..dv {
                    out[(i * heads + h) * dv + d] = ((0..n).map(|j| e[j] * val(h, j, d)).sum::<f64>() / z) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn causal_matches_naive_and_decode_matches_prefill() {
        let mut rng = Rng::new(21);
        let (s, heads, dqk, dv) = (21, 3, 19, 10);
        let k = rng.vec(s * heads * dqk, 1.0);
        let v = rng.vec(s * heads * dv, 1.0);
        let qall = rng.vec(s * heads * dqk, 2.0);
        let scale = 1.0 / (dqk as f32).sqrt();
        let mut full = vec![0.0; s * heads * dv];
        for &offset in &[0usize, 5, 20] {
            let t = s - offset;
            let q = &qall[offset * heads * dqk..];
            let mut out = vec![f32::NAN; t * heads * dv];
            attention_causal(q, &k, &v, t, s, heads, dqk, dv, offset, scale, &mut out);
            let want = naive(t, heads, dv, offset, scale,
                |i, h, j| (0..dqk).map(|d| q[(i * heads + h) * dqk + d] as f64 * k[(j * heads + h) * dqk + d] as f64).sum(),
                |h, j, d| v[(j * heads + h) * dv + d] as f64);
            assert_close(&out, &want, 2e-6, &format!("offset {offset}"));
            if offset == 0 {
                full = out;
            } else {
                // Same queries inside the prefill → identical bits.
                assert_eq!(out, full[offset * heads * dv..], "offset {offset} vs prefill");
            }
        }
    }

    #[test]
    fn mla_matches_expanded_naive() {
        let mut rng = Rng::new(8);
        let (s, heads, rank, dpe) = (19, 4, 24, 8);
        let offset = 7;
        let t = s - offset;
        let q_lat = rng.vec(t * heads * rank, 1.0);
        let q_pe = rng.vec(t * heads * dpe, 1.0);
        let ckv = rng.vec(s * rank, 1.0);
        let kpe = rng.vec(s * dpe, 1.0);
        let scale = 0.2;
        let mut out = vec![f32::NAN; t * heads * rank];
        mla_absorbed_attention(&q_lat, &q_pe, &ckv, &kpe, t, s, heads, rank, dpe, offset, scale, &mut out);
        // Expanded: per head, key_j = [ckv_j, kpe_j], query = [q_lat, q_pe], value_j = ckv_j.
        let want = naive(t, heads, rank, offset, scale,
            |i, h, j| {
                let r = i * heads + h;
                (0..rank).map(|d| q_lat[r * rank + d] as f64 * ckv[j * rank + d] as f64).sum::<f64>()
                    + (0..dpe).map(|d| q_pe[r * dpe + d] as f64 * kpe[j * dpe + d] as f64).sum::<f64>()
            },
            |_, j, d| ckv[j * rank + d] as f64);
        assert_close(&out, &want, 2e-6, "mla");
    }
}
