//! Row normalisations: RMSNorm, gated RMSNorm (KDA output norm), L2 norm.
//!
//! Per-row sums use the fixed 8-lane order of `simd::sum_sq`, so a row's
//! result is independent of how rows are split across threads.

use rayon::prelude::*;

use super::simd::{multiversion, sigmoid, sum_sq};

/// Rows per rayon task, sized to ~64K elements so small calls stay serial.
fn rows_per_task(dim: usize) -> usize {
    (65_536 / dim.max(1)).max(1)
}

/// Per row of `dim`: `weight ⊙ x / sqrt(mean(x²) + eps)` (torch order:
/// normalise first, then scale by the weight).
pub fn rms_norm(x: &[f32], dim: usize, weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "rms_norm: x/out length");
    assert_eq!(weight.len(), dim, "rms_norm: weight length");
    if dim == 0 {
        return;
    }
    assert_eq!(x.len() % dim, 0, "rms_norm: x not a multiple of dim");
    let chunk = rows_per_task(dim) * dim;
    if x.len() <= chunk {
        // One task's worth: skip the rayon round trip (decode-sized inputs).
        return rms_rows(x, dim, weight, eps, None, out);
    }
    out.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .for_each(|(o, x)| rms_rows(x, dim, weight, eps, None, o));
}

/// `rms_norm(x) · sigmoid(gate)`; `gate` has the shape of `x`.
pub fn rms_norm_gated(
    x: &[f32],
    dim: usize,
    weight: &[f32],
    gate: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    assert_eq!(x.len(), out.len(), "rms_norm_gated: x/out length");
    assert_eq!(gate.len(), x.len(), "rms_norm_gated: gate length");
    assert_eq!(weight.len(), dim, "rms_norm_gated: weight length");
    if dim == 0 {
        return;
    }
    assert_eq!(x.len() % dim, 0, "rms_norm_gated: x not a multiple of dim");
    let chunk = rows_per_task(dim) * dim;
    if x.len() <= chunk {
        return rms_rows(x, dim, weight, eps, Some(gate), out);
    }
    out.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .zip(gate.par_chunks(chunk))
        .for_each(|((o, x), g)| rms_rows(x, dim, weight, eps, Some(g), o));
}

multiversion! {
    fn rms_rows(x: &[f32], dim: usize, weight: &[f32], eps: f32, gate: Option<&[f32]>, out: &mut [f32]) {
        for (r, (xr, or)) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)).enumerate() {
            let inv = 1.0 / (sum_sq(xr) / dim as f32 + eps).sqrt();
            for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                *o = w * (v * inv);
            }
            if let Some(g) = gate {
                for (o, &gv) in or.iter_mut().zip(&g[r * dim..(r + 1) * dim]) {
                    *o *= sigmoid(gv);
                }
            }
        }
    }
}

/// In place, per row of `dim`: `x / sqrt(Σx² + eps)` (FLA's l2norm: eps is
/// added under the root, not used as a floor).
pub fn l2_normalize(x: &mut [f32], dim: usize, eps: f32) {
    if dim == 0 {
        return;
    }
    assert_eq!(x.len() % dim, 0, "l2_normalize: x not a multiple of dim");
    let chunk = rows_per_task(dim) * dim;
    if x.len() <= chunk {
        return l2_rows(x, dim, eps);
    }
    x.par_chunks_mut(chunk).for_each(|c| l2_rows(c, dim, eps));
}

multiversion! {
    fn l2_rows(x: &mut [f32], dim: usize, eps: f32) {
        for row in x.chunks_exact_mut(dim) {
            let norm = (sum_sq(row) + eps).sqrt();
            for v in row.iter_mut() {
                *v /= norm;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    #[test]
    fn rms_norm_matches_reference() {
        let mut rng = Rng::new(2);
        let (rows, dim) = (5, 37);
        let x = rng.vec(rows * dim, 2.0);
        let w = rng.vec(dim, 1.0);
        let g = rng.vec(rows * dim, 4.0);
        let mut out = vec![0.0; rows * dim];
        let mut gated = vec![0.0; rows * dim];
        rms_norm(&x, dim, &w, 1e-6, &mut out);
        rms_norm_gated(&x, dim, &w, &g, 1e-6, &mut gated);
        let mut want = vec![0.0; rows * dim];
        let mut want_g = vec![0.0; rows * dim];
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            for i in 0..dim {
                let n = w[i] as f64 * row[i] as f64 / (ms + 1e-6).sqrt();
                want[r * dim + i] = n as f32;
                let s = 1.0 / (1.0 + (-(g[r * dim + i] as f64)).exp());
                want_g[r * dim + i] = (n * s) as f32;
            }
        }
        assert_close(&out, &want, 1e-6, "rms_norm");
        assert_close(&gated, &want_g, 1e-6, "rms_norm_gated");
    }

    #[test]
    fn l2_uses_eps_under_root() {
        let mut y = vec![3.0f32, 4.0, 0.0, 0.0];
        l2_normalize(&mut y, 2, 1e-6);
        let n = (25.0f64 + 1e-6).sqrt();
        assert_close(
            &y,
            &[(3.0 / n) as f32, (4.0 / n) as f32, 0.0, 0.0],
            1e-7,
            "l2",
        );
        // eps=11 distinguishes "+eps" (norm 6) from "max(norm, eps)" (norm 11).
        let mut z = vec![3.0f32, 4.0];
        l2_normalize(&mut z, 2, 11.0);
        assert_close(&z, &[0.5, 4.0 / 6.0], 1e-7, "l2 eps");
    }
}
