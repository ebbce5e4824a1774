//! Pointwise activations and whole-vector reductions (softmax, argmax).
//!
//! `exp` is the vectorisable polynomial from `simd`, so the AVX2 build of
//! these loops runs 8 lanes at a time; each element's result is the same
//! whichever lane or chunk computes it.

use rayon::prelude::*;

use super::simd::{self, multiversion};

/// Elements per rayon task; below this a call stays on the calling thread.
const CHUNK: usize = 16_384;

/// out = silu(gate) · up, elementwise.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate/up length");
    assert_eq!(gate.len(), out.len(), "silu_mul: out length");
    if out.len() <= CHUNK {
        // Small (decode-sized) inputs: a rayon round trip costs more than the work.
        return silu_mul_chunk(gate, up, out);
    }
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| silu_mul_chunk(g, u, o));
}

multiversion! {
    fn silu_mul_chunk(g: &[f32], u: &[f32], o: &mut [f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = simd::silu(g) * u;
        }
    }
}

/// x = silu(x) = x · sigmoid(x), in place.
pub fn silu_inplace(x: &mut [f32]) {
    if x.len() <= CHUNK {
        return silu_chunk(x);
    }
    x.par_chunks_mut(CHUNK).for_each(silu_chunk);
}

multiversion! {
    fn silu_chunk(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = simd::silu(*v);
        }
    }
}

/// x = 1 / (1 + exp(-x)), in place.
pub fn sigmoid_inplace(x: &mut [f32]) {
    if x.len() <= CHUNK {
        return sigmoid_chunk(x);
    }
    x.par_chunks_mut(CHUNK).for_each(sigmoid_chunk);
}

multiversion! {
    fn sigmoid_chunk(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = simd::sigmoid(*v);
        }
    }
}

multiversion! {
    /// Numerically stable softmax of one vector, in place (max subtracted;
    /// the sum uses the fixed 8-lane order). An all -inf input yields NaN, as in torch.
    pub fn softmax_inplace(x: &mut [f32]) {
        let m = simd::max(x);
        for v in x.iter_mut() {
            *v = simd::exp(*v - m);
        }
        let inv = 1.0 / simd::sum(x);
        for v in x.iter_mut() {
            *v *= inv;
        }
    }
}

/// Index of the first maximum; NaN never wins (all-NaN or empty → 0).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v || (!found && v == f32::NEG_INFINITY) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    #[test]
    fn pointwise_match_f64() {
        let mut rng = Rng::new(9);
        let n = 40_000; // spans several rayon chunks
        let g = rng.vec(n, 30.0);
        let u = rng.vec(n, 2.0);
        let sig = |v: f32| 1.0 / (1.0 + (-(v as f64)).exp());
        let mut out = vec![0.0; n];
        silu_mul(&g, &u, &mut out);
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| (g as f64 * sig(g) * u as f64) as f32)
            .collect();
        assert_close(&out, &want, 1e-6, "silu_mul");
        let mut s = g.clone();
        silu_inplace(&mut s);
        let want: Vec<f32> = g.iter().map(|&g| (g as f64 * sig(g)) as f32).collect();
        assert_close(&s, &want, 1e-6, "silu");
        let mut s = g.clone();
        sigmoid_inplace(&mut s);
        let want: Vec<f32> = g.iter().map(|&g| sig(g) as f32).collect();
        assert_close(&s, &want, 1e-6, "sigmoid");
        let mut e = vec![-100.0f32, 100.0, 0.0];
        sigmoid_inplace(&mut e);
        assert_eq!(e, vec![0.0, 1.0, 0.5]);
    }

    #[test]
    fn softmax_and_argmax() {
        let mut x = vec![1.0f32, 2.0, 3.0, 1000.0, -1000.0, 3.0, 2.0, 1.0, 0.5];
        let want = {
            let m = 1000.0f64;
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|v| (v / s) as f32).collect::<Vec<_>>()
        };
        softmax_inplace(&mut x);
        assert_close(&x, &want, 1e-7, "softmax");
        assert_eq!(argmax(&[1.0, 5.0, f32::NAN, 5.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[]), 0);
    }
}
