//! Causal softmax attention: standard multi-head, and MLA in absorbed form.
//!
//! Both run one core over blocks of query rows that share a key/value set:
//! the block's scores are a GEMM against the keys (the `linear` kernel, keys
//! as weight rows), each row is softmaxed over its own causal length, and
//! P·V is a matmul over the keys every row sees, plus per-row steps for the
//! rest of each row's range. Each element's arithmetic (GEMM dot order,
//! fixed-order softmax sums, one FMA chain over keys 0..len for the output)
//! is independent of the block it lands in, so decoding a token gives the
//! same bits as the same position inside a prefill.

use rayon::prelude::*;

use super::gemm::gemm_nt_seq;
use super::matmul::{axpy_chain, mm_strided};
use super::simd::{self, SyncPtr};

/// Query rows per block: large enough to amortise streaming the keys.
const QB: usize = 32;
/// From this many rows on, P·V over the shared key range is one matmul.
const SHARED_MM_MIN_ROWS: usize = 4;

/// A row-strided matrix view: row `i` is `data[i*ld..][..cols]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    ld: usize,
    cols: usize,
}

/// Keys/values of one attention problem. Score = scale·(q1·k1 + q2·k2)
/// (`k2.cols == 0` when there is no second part); values `v`.
struct Keys<'a> {
    k1: View<'a>,
    k2: View<'a>,
    v: View<'a>,
}

/// Per-worker scratch.
#[derive(Default)]
struct Work {
    scores: Vec<f32>,
    s2: Vec<f32>,
    out: Vec<f32>,
}

/// Attends `lens.len()` query rows (`q1`, `q2` views) over keys `0..lens[b]`
/// for row `b`; `lens` must be non-decreasing. Result in `w.out` [rows, dv].
fn attend_block(q1: View, q2: View, lens: &[usize], keys: &Keys, scale: f32, w: &mut Work) {
    let rows = lens.len();
    let (lmin, smax) = (lens[0], lens[rows - 1]);
    debug_assert!(lens.windows(2).all(|p| p[0] <= p[1]) && lmin > 0);
    let dv = keys.v.cols;
    w.scores.resize(rows * smax, 0.0);
    gemm_nt_seq(
        q1.data,
        q1.ld,
        rows,
        q1.cols,
        keys.k1.data,
        keys.k1.ld,
        smax,
        &mut w.scores,
        smax,
    );
    if keys.k2.cols > 0 {
        w.s2.resize(rows * smax, 0.0);
        gemm_nt_seq(
            q2.data,
            q2.ld,
            rows,
            q2.cols,
            keys.k2.data,
            keys.k2.ld,
            smax,
            &mut w.s2,
            smax,
        );
    }
    for (b, &len) in lens.iter().enumerate() {
        let p = &mut w.scores[b * smax..b * smax + len];
        if keys.k2.cols > 0 {
            combine(p, &w.s2[b * smax..b * smax + len], scale);
        } else {
            p.iter_mut().for_each(|x| *x *= scale);
        }
        softmax_row(p);
    }
    w.out.resize(rows * dv, 0.0);
    // Keys every row sees as one matmul, then each row's remaining keys in
    // order, continuing the same per-element FMA chain. With very few rows
    // (decode) value rows are streamed once each instead (same chain).
    let shared = if rows >= SHARED_MM_MIN_ROWS { lmin } else { 0 };
    if shared > 0 {
        mm_strided(
            &w.scores,
            smax,
            rows,
            shared,
            keys.v.data,
            keys.v.ld,
            dv,
            &mut w.out,
            dv,
            false,
        );
    } else {
        w.out.fill(0.0);
    }
    for (b, &len) in lens.iter().enumerate() {
        for j in shared..len {
            let v = &keys.v.data[j * keys.v.ld..j * keys.v.ld + dv];
            axpy_chain(&mut w.out[b * dv..(b + 1) * dv], w.scores[b * smax + j], v);
        }
    }
}

simd::multiversion! {
    fn combine(p: &mut [f32], s2: &[f32], scale: f32) {
        for (x, &y) in p.iter_mut().zip(s2) {
            *x = scale * (*x + y);
        }
    }
}

simd::multiversion! {
    /// In-place softmax (max subtracted, fixed-order sum).
    fn softmax_row(p: &mut [f32]) {
        let m = simd::max(p);
        for x in p.iter_mut() {
            *x = simd::exp(*x - m);
        }
        let inv = 1.0 / simd::sum(p);
        for x in p.iter_mut() {
            *x *= inv;
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
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    s: usize,
    heads: usize,
    dqk: usize,
    dv: usize,
    offset: usize,
    scale: f32,
    out: &mut [f32],
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
    let unit = |u: usize, w: &mut Work| {
        let (h, i0) = (u / qblocks, (u % qblocks) * QB);
        let i1 = (i0 + QB).min(t);
        let lens: Vec<usize> = (i0..i1).map(|i| offset + i + 1).collect();
        let ld = heads * dqk;
        let q1 = View {
            data: &q[i0 * ld + h * dqk..],
            ld,
            cols: dqk,
        };
        let keys = Keys {
            k1: View {
                data: &k[h * dqk..],
                ld,
                cols: dqk,
            },
            k2: View {
                data: &[],
                ld: 0,
                cols: 0,
            },
            v: View {
                data: &v[h * dv..],
                ld: heads * dv,
                cols: dv,
            },
        };
        attend_block(q1, keys.k2, &lens, &keys, scale, w);
        for (b, i) in (i0..i1).enumerate() {
            // SAFETY: unit (h, block) writes only rows (i, h) for its own i; disjoint.
            unsafe {
                let dst = outp.get().add((i * heads + h) * dv);
                std::ptr::copy_nonoverlapping(w.out.as_ptr().add(b * dv), dst, dv);
            }
        }
    };
    let units = heads * qblocks;
    if units == 1 {
        unit(0, &mut Work::default());
    } else {
        (0..units)
            .into_par_iter()
            .for_each_init(Work::default, |w, u| unit(u, w));
    }
}

/// MLA attention in absorbed (latent) form.
///
/// q_lat [t, heads, rank], q_pe [t, heads, dpe], ckv [s, rank] (shared latent
/// keys/values), kpe [s, dpe] (shared rotary key). For j ≤ offset+i:
/// `score = scale·(q_lat·ckv_j + q_pe·kpe_j)`, `p = softmax_j`,
/// `out_lat[i, h] = Σ_j p·ckv_j` → out_lat [t, heads, rank]. Requires `offset + t == s`.
#[allow(clippy::too_many_arguments)]
pub fn mla_absorbed_attention(
    q_lat: &[f32],
    q_pe: &[f32],
    ckv: &[f32],
    kpe: &[f32],
    t: usize,
    s: usize,
    heads: usize,
    rank: usize,
    dpe: usize,
    offset: usize,
    scale: f32,
    out_lat: &mut [f32],
) {
    assert_eq!(
        offset + t,
        s,
        "mla_absorbed_attention: offset + t must equal s"
    );
    assert_eq!(
        q_lat.len(),
        t * heads * rank,
        "mla_absorbed_attention: q_lat shape"
    );
    assert_eq!(
        q_pe.len(),
        t * heads * dpe,
        "mla_absorbed_attention: q_pe shape"
    );
    assert_eq!(ckv.len(), s * rank, "mla_absorbed_attention: ckv shape");
    assert_eq!(kpe.len(), s * dpe, "mla_absorbed_attention: kpe shape");
    assert_eq!(
        out_lat.len(),
        t * heads * rank,
        "mla_absorbed_attention: out shape"
    );
    if t == 0 || heads == 0 || rank == 0 {
        return;
    }
    let keys = Keys {
        k1: View {
            data: ckv,
            ld: rank,
            cols: rank,
        },
        k2: View {
            data: kpe,
            ld: dpe,
            cols: dpe,
        },
        v: View {
            data: ckv,
            ld: rank,
            cols: rank,
        },
    };
    // All heads share the keys, so a block is consecutive (query, head) rows;
    // smaller blocks when there are few rows, so decode still splits.
    let total = t * heads;
    let qb = total
        .div_ceil(2 * rayon::current_num_threads())
        .clamp(1, QB);
    let unit = |(blk, ob): (usize, &mut [f32]), w: &mut Work| {
        let r0 = blk * qb;
        let n = ob.len() / rank;
        let lens: Vec<usize> = (r0..r0 + n).map(|r| offset + r / heads + 1).collect();
        let q1 = View {
            data: &q_lat[r0 * rank..],
            ld: rank,
            cols: rank,
        };
        let q2 = View {
            data: &q_pe[r0 * dpe..],
            ld: dpe,
            cols: dpe,
        };
        attend_block(q1, q2, &lens, &keys, scale, w);
        ob.copy_from_slice(&w.out[..n * rank]);
    };
    if total <= qb {
        unit((0, out_lat), &mut Work::default());
    } else {
        out_lat
            .par_chunks_mut(qb * rank)
            .enumerate()
            .for_each_init(Work::default, |w, x| unit(x, w));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    /// f64 naive causal attention over per-head key/query vectors given by closures.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        t: usize,
        heads: usize,
        dv: usize,
        offset: usize,
        scale: f32,
        score: impl Fn(usize, usize, usize) -> f64,
        val: impl Fn(usize, usize, usize) -> f64,
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
                    out[(i * heads + h) * dv + d] =
                        ((0..n).map(|j| e[j] * val(h, j, d)).sum::<f64>() / z) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn causal_matches_naive_and_decode_matches_prefill() {
        let mut rng = Rng::new(21);
        // s > QB: a prefill spans two blocks; offsets give 1-row (decode),
        // small and large blocks, all of which must agree bitwise.
        let (s, heads, dqk, dv) = (45, 3, 19, 10);
        let k = rng.vec(s * heads * dqk, 1.0);
        let v = rng.vec(s * heads * dv, 1.0);
        let qall = rng.vec(s * heads * dqk, 2.0);
        let scale = 1.0 / (dqk as f32).sqrt();
        let mut full = vec![0.0; s * heads * dv];
        for &offset in &[0usize, 5, 44, 40, 13] {
            let t = s - offset;
            let q = &qall[offset * heads * dqk..];
            let mut out = vec![f32::NAN; t * heads * dv];
            attention_causal(q, &k, &v, t, s, heads, dqk, dv, offset, scale, &mut out);
            let want = naive(
                t,
                heads,
                dv,
                offset,
                scale,
                |i, h, j| {
                    (0..dqk)
                        .map(|d| {
                            q[(i * heads + h) * dqk + d] as f64
                                * k[(j * heads + h) * dqk + d] as f64
                        })
                        .sum()
                },
                |h, j, d| v[(j * heads + h) * dv + d] as f64,
            );
            assert_close(&out, &want, 2e-6, &format!("offset {offset}"));
            if offset == 0 {
                full = out;
            } else {
                // Same queries inside the prefill → identical bits.
                assert_eq!(
                    out,
                    full[offset * heads * dv..],
                    "offset {offset} vs prefill"
                );
            }
        }
    }

    #[test]
    fn mla_matches_expanded_naive_and_decode_matches_prefill() {
        let mut rng = Rng::new(8);
        let (s, heads, rank, dpe) = (19, 4, 24, 8);
        let q_lat_all = rng.vec(s * heads * rank, 1.0);
        let q_pe_all = rng.vec(s * heads * dpe, 1.0);
        let ckv = rng.vec(s * rank, 1.0);
        let kpe = rng.vec(s * dpe, 1.0);
        let scale = 0.2;
        let mut full = vec![0.0; s * heads * rank];
        for &offset in &[0usize, 7, 18] {
            let t = s - offset;
            let q_lat = &q_lat_all[offset * heads * rank..];
            let q_pe = &q_pe_all[offset * heads * dpe..];
            let mut out = vec![f32::NAN; t * heads * rank];
            mla_absorbed_attention(
                q_lat, q_pe, &ckv, &kpe, t, s, heads, rank, dpe, offset, scale, &mut out,
            );
            // Expanded: per head, key_j = [ckv_j, kpe_j], query = [q_lat, q_pe], value_j = ckv_j.
            let want = naive(
                t,
                heads,
                rank,
                offset,
                scale,
                |i, h, j| {
                    let r = i * heads + h;
                    (0..rank)
                        .map(|d| q_lat[r * rank + d] as f64 * ckv[j * rank + d] as f64)
                        .sum::<f64>()
                        + (0..dpe)
                            .map(|d| q_pe[r * dpe + d] as f64 * kpe[j * dpe + d] as f64)
                            .sum::<f64>()
                },
                |_, j, d| ckv[j * rank + d] as f64,
            );
            assert_close(&out, &want, 2e-6, &format!("mla offset {offset}"));
            if offset == 0 {
                full = out;
            } else {
                assert_eq!(
                    out,
                    full[offset * heads * rank..],
                    "mla offset {offset} vs prefill"
                );
            }
        }
    }
}
