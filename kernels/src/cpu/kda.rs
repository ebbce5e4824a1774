//! KDA (Kimi Delta Attention): gated delta rule with per-channel decay.
//!
//! Per head and step t, with state S [dk, dv]:
//! `S ← S ⊙ exp(g_t)[:,None]; δ = β_t (v_t − Sᵀk_t); S ← S + k_t δᵀ; o_t = Sᵀ(scale·q_t)`.
//!
//! `kda_recurrent` runs that loop directly (decode, short inputs).
//! `kda_chunked` computes the same math in the WY/UT-transform chunked form
//! of transformers' `chunk_kimi_delta_attention`, which turns the sequential
//! rank-1 updates into small matmuls (prefill). Heads are independent and run
//! in parallel. Decay factors are always formed as `exp` of (non-positive)
//! differences of cumulative log-decays, never as ratios, so nothing overflows.

use rayon::prelude::*;

use super::matmul::mm_seq;
use super::simd::{self, multiversion, SyncPtr};

/// Below this much state traffic (T·heads·dk·dv) heads run on the caller's thread.
const PAR_MIN_MACS: usize = 1 << 16;

/// Shapes shared by both entry points; `t` is the sequence length.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    heads: usize,
    dk: usize,
    dv: usize,
}

#[allow(clippy::too_many_arguments)]
fn check(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    heads: usize,
    dk: usize,
    dv: usize,
    state: &[f32],
    out: &[f32],
) -> Dims {
    assert!(heads > 0 && dk > 0 && dv > 0, "kda: zero dimension");
    let t = beta.len() / heads;
    assert_eq!(beta.len(), t * heads, "kda: beta shape");
    assert_eq!(q.len(), t * heads * dk, "kda: q shape");
    assert_eq!(k.len(), t * heads * dk, "kda: k shape");
    assert_eq!(g.len(), t * heads * dk, "kda: g shape");
    assert_eq!(v.len(), t * heads * dv, "kda: v shape");
    assert_eq!(out.len(), t * heads * dv, "kda: out shape");
    assert_eq!(state.len(), heads * dk * dv, "kda: state shape");
    Dims { t, heads, dk, dv }
}

/// Runs `f(head, state_h, out_h)` for every head in parallel, where `out_h`
/// is a [T, dv] scratch that is then scattered into `out` [T, heads, dv].
fn per_head(
    d: Dims,
    state: &mut [f32],
    out: &mut [f32],
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    let outp = SyncPtr::new(out);
    let head = |(h, s): (usize, &mut [f32])| {
        let mut oh = vec![0.0f32; d.t * d.dv];
        f(h, s, &mut oh);
        for t in 0..d.t {
            // SAFETY: head h writes only rows (t, h, ..) of `out`, disjoint across heads.
            unsafe {
                let dst = outp.get().add((t * d.heads + h) * d.dv);
                std::ptr::copy_nonoverlapping(oh.as_ptr().add(t * d.dv), dst, d.dv);
            }
        }
    };
    if d.heads == 1 || d.t * d.heads * d.dk * d.dv < PAR_MIN_MACS {
        state.chunks_mut(d.dk * d.dv).enumerate().for_each(head);
    } else {
        state.par_chunks_mut(d.dk * d.dv).enumerate().for_each(head);
    }
}

/// Token-by-token KDA. q, k, g: [T, heads, dk] (q, k L2-normalised; q is
/// multiplied by `scale` here); v: [T, heads, dv]; g: per-channel log decay
/// (≤ 0); beta: [T, heads]; state: [heads, dk, dv], read as the initial and
/// overwritten with the final state; out: [T, heads, dv].
#[allow(clippy::too_many_arguments)]
pub fn kda_recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    heads: usize,
    dk: usize,
    dv: usize,
    scale: f32,
    state: &mut [f32],
    out: &mut [f32],
) {
    let d = check(q, k, v, g, beta, heads, dk, dv, state, out);
    if d.t == 0 {
        return;
    }
    let inp = Inputs { q, k, v, g, beta };
    per_head(d, state, out, |h, s, oh| {
        recurrent_head(&inp, d.t, d.heads, d.dk, d.dv, h, scale, s, oh)
    });
}

/// Per-token inputs of one call, [T, heads, ·] layouts.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

multiversion! {
    #[allow(clippy::too_many_arguments)]
    fn recurrent_head(x: &Inputs, t_len: usize, heads: usize, dk: usize, dv: usize, h: usize, scale: f32, s: &mut [f32], out: &mut [f32]) {
        let mut kv = vec![0.0f32; dv];
        let mut delta = vec![0.0f32; dv];
        for t in 0..t_len {
            let r = t * heads + h;
            let (qt, kt, gt) = (&x.q[r * dk..(r + 1) * dk], &x.k[r * dk..(r + 1) * dk], &x.g[r * dk..(r + 1) * dk]);
            let vt = &x.v[r * dv..(r + 1) * dv];
            let b = x.beta[r];
            // Decay and kv = Sᵀk in one pass over S.
            kv.fill(0.0);
            for ((row, &gi), &ki) in s.chunks_exact_mut(dv).zip(gt).zip(kt) {
                let e = simd::exp(gi);
                for (sv, kvj) in row.iter_mut().zip(kv.iter_mut()) {
                    *sv *= e;
                    *kvj += ki * *sv;
                }
            }
            for ((dj, &vj), &kvj) in delta.iter_mut().zip(vt).zip(&kv) {
                *dj = b * (vj - kvj);
            }
            // Rank-1 update and o = Sᵀ(scale·q) in a second pass.
            let o = &mut out[t * dv..(t + 1) * dv];
            o.fill(0.0);
            for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(kt).zip(qt) {
                let qs = qi * scale;
                for ((sv, &dj), oj) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                    *sv += ki * dj;
                    *oj += qs * *sv;
                }
            }
        }
    }
}

/// Chunked (WY / UT-transform) KDA with the same contract as
/// [`kda_recurrent`]; `chunk` tokens per chunk (64 is the usual choice), the
/// last chunk may be partial. Matches the recurrent form to f32 rounding.
#[allow(clippy::too_many_arguments)]
pub fn kda_chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    heads: usize,
    dk: usize,
    dv: usize,
    scale: f32,
    chunk: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(chunk > 0, "kda_chunked: chunk must be > 0");
    let d = check(q, k, v, g, beta, heads, dk, dv, state, out);
    if d.t == 0 {
        return;
    }
    let inp = Inputs { q, k, v, g, beta };
    per_head(d, state, out, |h, s, oh| {
        let mut ws = Workspace::new(chunk, dk, dv);
        let mut c0 = 0;
        while c0 < d.t {
            let len = chunk.min(d.t - c0);
            chunk_step(
                &inp,
                d.heads,
                dk,
                dv,
                h,
                scale,
                c0,
                len,
                &mut ws,
                s,
                &mut oh[c0 * dv..(c0 + len) * dv],
            );
            c0 += len;
        }
    });
}

/// Per-head scratch for one chunk of up to `c` tokens.
struct Workspace {
    qs: Vec<f32>,   // [c, dk] scale·q
    kc: Vec<f32>,   // [c, dk] k
    gc: Vec<f32>,   // [c, dk] cumulative log decay within the chunk
    beta: Vec<f32>, // [c]
    a: Vec<f32>,    // [c, c] strictly lower -β k kᵀ decay, then (I - that)⁻¹ via the solve
    qk: Vec<f32>,   // [c, c] lower (incl. diag) q kᵀ decay
    u: Vec<f32>,    // [c, dv] A·(β v), then v_new
    w: Vec<f32>,    // [c, dk] A·(β k ⊙ exp(gc)) (k_cumdecay)
    tmp: Vec<f32>,  // [c, max(dk, dv)] staging for matmul operands/results
    o: Vec<f32>,    // [c, dv]
    kdt: Vec<f32>,  // [dk, c] (k ⊙ exp(g_last − gc))ᵀ
    row: Vec<f32>,  // [c]
    kw: Vec<f32>,   // [dk] one decayed key row
}

impl Workspace {
    fn new(c: usize, dk: usize, dv: usize) -> Self {
        let z = |n: usize| vec![0.0f32; n];
        Workspace {
            qs: z(c * dk),
            kc: z(c * dk),
            gc: z(c * dk),
            beta: z(c),
            a: z(c * c),
            qk: z(c * c),
            u: z(c * dv),
            w: z(c * dk),
            tmp: z(c * dk.max(dv)),
            o: z(c * dv),
            kdt: z(dk * c),
            row: z(c),
            kw: z(dk),
        }
    }
}

/// Σ_d (k_j ⊙ e)·k_i and Σ_d (k_j ⊙ e)·q_i with e = exp(g_i − g_j): the
/// decayed key goes through `kw` once (a plain loop, so the exps vectorise)
/// and feeds both dot products.
#[inline(always)]
fn decay_dots(
    ki: &[f32],
    qi: &[f32],
    kj: &[f32],
    gi: &[f32],
    gj: &[f32],
    kw: &mut [f32],
) -> (f32, f32) {
    for ((w, &k), (&a, &b)) in kw.iter_mut().zip(kj).zip(gi.iter().zip(gj)) {
        *w = k * simd::exp(a - b);
    }
    (simd::dot(ki, kw), simd::dot(qi, kw))
}

multiversion! {
    /// One chunk of `n` tokens starting at `c0` for head `h`: writes o [n, dv], updates `s`.
    #[allow(clippy::too_many_arguments)]
    fn chunk_step(x: &Inputs, heads: usize, dk: usize, dv: usize, h: usize, scale: f32, c0: usize, n: usize,
                  ws: &mut Workspace, s: &mut [f32], out: &mut [f32]) {
        // Gather the chunk (scaled q, k, cumulative g, β).
        for t in 0..n {
            let r = (c0 + t) * heads + h;
            let (src_q, src_k, src_g) = (&x.q[r * dk..(r + 1) * dk], &x.k[r * dk..(r + 1) * dk], &x.g[r * dk..(r + 1) * dk]);
            for (d, &qv) in ws.qs[t * dk..(t + 1) * dk].iter_mut().zip(src_q) {
                *d = qv * scale;
            }
            ws.kc[t * dk..(t + 1) * dk].copy_from_slice(src_k);
            let (prev, cur) = ws.gc.split_at_mut(t * dk);
            let cur = &mut cur[..dk];
            if t == 0 {
                cur.copy_from_slice(src_g);
            } else {
                for ((c, &p), &gv) in cur.iter_mut().zip(&prev[(t - 1) * dk..]).zip(src_g) {
                    *c = p + gv;
                }
            }
            ws.beta[t] = x.beta[r];
        }
        let (kc, qs, gc) = (&ws.kc, &ws.qs, &ws.gc);
        let rowk = |i: usize| &kc[i * dk..(i + 1) * dk];
        let rowg = |i: usize| &gc[i * dk..(i + 1) * dk];

        // A[i,j] = -β_i Σ_d k_i k_j exp(gc_i − gc_j) (j < i); QK[i,j] likewise with q_i (j ≤ i).
        let (a, qk) = (&mut ws.a[..n * n], &mut ws.qk[..n * n]);
        a.fill(0.0);
        qk.fill(0.0);
        for i in 0..n {
            for j in 0..=i {
                let (da, dq) = decay_dots(rowk(i), &qs[i * dk..(i + 1) * dk], rowk(j), rowg(i), rowg(j), &mut ws.kw);
                if j < i {
                    a[i * n + j] = -ws.beta[i] * da;
                }
                qk[i * n + j] = dq;
            }
        }
        // Forward substitution, as in the reference loop:
        // A[i,:i] += Σ_m A[i,m]·A[m,:i] using the already-updated rows m < i.
        for i in 1..n {
            let (done, rest) = a.split_at_mut(i * n);
            let cur = &mut rest[..i];
            ws.row[..i].copy_from_slice(cur);
            for m in 1..i {
                let r = ws.row[m];
                if r != 0.0 {
                    simd::axpy(&mut cur[..m], r, &done[m * n..m * n + m]);
                }
            }
        }
        for i in 0..n {
            a[i * n + i] = 1.0;
        }

        // U = A·(β v);  W = A·(β k ⊙ exp(gc)).
        let tmp = &mut ws.tmp[..n * dk.max(dv)];
        for t in 0..n {
            let r = (c0 + t) * heads + h;
            let b = ws.beta[t];
            for (d, &vv) in tmp[t * dv..(t + 1) * dv].iter_mut().zip(&x.v[r * dv..(r + 1) * dv]) {
                *d = vv * b;
            }
        }
        mm_seq(a, n, n, &tmp[..n * dv], dv, &mut ws.u[..n * dv], false);
        for t in 0..n {
            let b = ws.beta[t];
            for ((d, &kv), &gv) in tmp[t * dk..(t + 1) * dk].iter_mut().zip(rowk(t)).zip(rowg(t)) {
                *d = (kv * b) * simd::exp(gv);
            }
        }
        mm_seq(a, n, n, &tmp[..n * dk], dk, &mut ws.w[..n * dk], false);

        // v_new = U − W·S;  o = (q ⊙ exp(gc))·S + QK·v_new.
        let u = &mut ws.u[..n * dv];
        mm_seq(&ws.w[..n * dk], n, dk, s, dv, &mut tmp[..n * dv], false);
        for (uv, &t) in u.iter_mut().zip(tmp.iter()) {
            *uv -= t;
        }
        for t in 0..n {
            for ((d, &qv), &gv) in tmp[t * dk..(t + 1) * dk].iter_mut().zip(&qs[t * dk..]).zip(rowg(t)) {
                *d = qv * simd::exp(gv);
            }
        }
        let o = &mut ws.o[..n * dv];
        mm_seq(&tmp[..n * dk], n, dk, s, dv, o, false);
        mm_seq(qk, n, n, u, dv, o, true);
        out.copy_from_slice(o);

        // S ← S ⊙ exp(g_last) + (k ⊙ exp(g_last − gc))ᵀ · v_new.
        let glast = rowg(n - 1);
        for (row, &gl) in s.chunks_exact_mut(dv).zip(glast) {
            let e = simd::exp(gl);
            for sv in row.iter_mut() {
                *sv *= e;
            }
        }
        let kdt = &mut ws.kdt[..dk * n];
        for t in 0..n {
            // Contiguous row first (vectorised exps), then the transposed scatter.
            for ((w, &kv), (&gl, &gv)) in ws.kw.iter_mut().zip(rowk(t)).zip(glast.iter().zip(rowg(t))) {
                *w = kv * simd::exp(gl - gv);
            }
            for (d, &w) in ws.kw.iter().enumerate() {
                kdt[d * n + t] = w;
            }
        }
        mm_seq(kdt, dk, n, u, dv, s, true);
    }
}

#[cfg(test)]
#[path = "kda_tests.rs"]
mod tests;
