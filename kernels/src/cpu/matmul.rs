//! `matmul`: out[m, n] = a[m, k] · b[k, n], both row-major (no transpose).
//!
//! Outer-product form: rows of `b` are contiguous, so each output element is
//! a single FMA chain over `k` in increasing order, starting from 0. That
//! chain is the same in full vectors, masked edge vectors and the portable
//! path, so a row's bits never depend on `m`, its position, or threads.
//! Also used sequentially (inside per-head tasks) by the KDA kernels.

use rayon::prelude::*;

use super::gemm::{fmadd, Isa};

/// Below this many multiply-adds the rayon fork costs more than it saves.
const PAR_MIN_MACS: usize = 1 << 18;

/// out[m, n] = a[m, k] · b[k, n]. Panics on shape/length mismatch.
pub fn matmul(a: &[f32], m: usize, k: usize, b: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(a.len(), m * k, "matmul: a shape");
    assert_eq!(b.len(), k * n, "matmul: b shape");
    assert_eq!(out.len(), m * n, "matmul: out shape");
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if m * n * k < PAR_MIN_MACS || m < 2 || threads < 2 {
        mm_seq(a, m, k, b, n, out, false);
        return;
    }
    // Row blocks in multiples of the 6-row tile, ~4 blocks per thread.
    let rows = m.div_ceil(threads * 4).next_multiple_of(6);
    out.par_chunks_mut(rows * n)
        .zip(a.par_chunks(rows * k))
        .for_each(|(o, a)| mm_seq(a, o.len() / n, k, b, n, o, false));
}

/// Sequential c[m, n] (+)= a[m, k] · b[k, n]; with `accumulate` the FMA chain
/// starts from the existing `c` instead of 0.
pub(crate) fn mm_seq(
    a: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n: usize,
    c: &mut [f32],
    accumulate: bool,
) {
    mm_strided(a, k, m, k, b, n, n, c, n, accumulate);
}

/// [`mm_seq`] on row-strided operands (row `i` of `a` at `a[i*lda..]`, etc.).
#[allow(clippy::too_many_arguments)]
pub(crate) fn mm_strided(
    a: &[f32],
    lda: usize,
    m: usize,
    k: usize,
    b: &[f32],
    ldb: usize,
    n: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let extent = |rows: usize, ld: usize, cols: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * ld + cols
        }
    };
    assert!(
        lda >= k && ldb >= n && ldc >= n,
        "mm: leading dimension too small"
    );
    assert!(
        a.len() >= extent(m, lda, k)
            && b.len() >= extent(k, ldb, n)
            && c.len() >= extent(m, ldc, n),
        "mm: shape"
    );
    if m == 0 || n == 0 {
        return;
    }
    let g = Strides { lda, ldb, ldc };
    match Isa::detect() {
        // SAFETY: feature checked by `detect`; extents asserted above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::mm(a, m, k, b, n, c, g, accumulate) },
        Isa::Portable => mm_portable(a, m, k, b, n, c, g, accumulate),
    }
}

/// y[i] = fma(a, x[i], y[i]): one more step of the same per-element chain
/// [`mm_strided`] computes (fused exactly when the matmul is).
pub(crate) fn axpy_chain(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len(), "axpy_chain: length");
    match Isa::detect() {
        // SAFETY: feature checked by `detect`; equal lengths asserted.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::axpy(y, a, x) },
        Isa::Portable => y.iter_mut().zip(x).for_each(|(y, &x)| *y = fmadd(a, x, *y)),
    }
}

#[derive(Clone, Copy)]
struct Strides {
    lda: usize,
    ldb: usize,
    ldc: usize,
}

#[allow(clippy::too_many_arguments)]
fn mm_portable(
    a: &[f32],
    m: usize,
    k: usize,
    b: &[f32],
    n: usize,
    c: &mut [f32],
    g: Strides,
    accumulate: bool,
) {
    for i in 0..m {
        let ci = &mut c[i * g.ldc..i * g.ldc + n];
        if !accumulate {
            ci.fill(0.0);
        }
        for p in 0..k {
            let aip = a[i * g.lda + p];
            for (cj, &bj) in ci.iter_mut().zip(&b[p * g.ldb..p * g.ldb + n]) {
                *cj = fmadd(aip, bj, *cj);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Register tile: 6 rows × 2 vectors = 12 accumulators, + 2 b vectors
    /// + 1 broadcast = 15 of the 16 ymm registers (4×3 would spill).
    const R_MAX: usize = 6;
    const V: usize = 2;

    static TAIL_MASK: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len();
        let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(
                yp.add(i),
                _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))),
            );
            i += 8;
        }
        for j in i..n {
            *yp.add(j) = a.mul_add(*xp.add(j), *yp.add(j)); // vfmadd (fma enabled here)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn mm(
        a: &[f32],
        m: usize,
        k: usize,
        b: &[f32],
        n: usize,
        c: &mut [f32],
        g: super::Strides,
        acc: bool,
    ) {
        let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        let mut i = 0;
        while i < m {
            let r = (m - i).min(R_MAX);
            let mut j = 0;
            while j < n {
                let cols = (n - j).min(V * 8);
                let nv = cols.div_ceil(8);
                let rem = cols % 8;
                let mask =
                    _mm256_loadu_si256(TAIL_MASK.as_ptr().add(if rem == 0 { 0 } else { 8 - rem })
                        as *const __m256i);
                let t = T {
                    a: ap.add(i * g.lda),
                    lda: g.lda,
                    b: bp.add(j),
                    ldb: g.ldb,
                    k,
                    c: cp.add(i * g.ldc + j),
                    ldc: g.ldc,
                    acc,
                    mask,
                };
                macro_rules! go {
                    ($($r:literal, $v:literal);*) => {
                        match (r, nv, rem != 0) {
                            $(($r, $v, false) => tile::<$r, $v, false>(&t),
                              ($r, $v, true) => tile::<$r, $v, true>(&t),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(6, 2; 6, 1; 5, 2; 5, 1; 4, 2; 4, 1; 3, 2; 3, 1; 2, 2; 2, 1; 1, 2; 1, 1);
                j += cols;
            }
            i += r;
        }
    }

    struct T {
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        k: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
        /// Lane mask of the last vector of the strip (all ones when full).
        mask: __m256i,
    }

    /// R rows × NV vectors; with MASKED the last vector is masked so ragged
    /// `n` never reads or writes past the row (a separate instance so full
    /// strips keep the mask out of the 16 registers).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // r/v index two arrays at once
    unsafe fn tile<const R: usize, const NV: usize, const MASKED: bool>(t: &T) {
        let mut acc = [[_mm256_setzero_ps(); NV]; R];
        if t.acc {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    let ptr = t.c.add(r * t.ldc + v * 8);
                    *x = if MASKED && v + 1 == NV {
                        _mm256_maskload_ps(ptr, t.mask)
                    } else {
                        _mm256_loadu_ps(ptr)
                    };
                }
            }
        }
        for p in 0..t.k {
            let mut bv = [_mm256_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                let ptr = t.b.add(p * t.ldb + v * 8);
                *x = if MASKED && v + 1 == NV {
                    _mm256_maskload_ps(ptr, t.mask)
                } else {
                    _mm256_loadu_ps(ptr)
                };
            }
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*t.a.add(r * t.lda + p));
                for v in 0..NV {
                    acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                let ptr = t.c.add(r * t.ldc + v * 8);
                if MASKED && v + 1 == NV {
                    _mm256_maskstore_ps(ptr, t.mask, *x);
                } else {
                    _mm256_storeu_ps(ptr, *x);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    fn naive(a: &[f32], m: usize, k: usize, b: &[f32], n: usize) -> Vec<f32> {
        let mut o = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum::<f64>() as f32;
            }
        }
        o
    }

    #[test]
    fn matches_naive() {
        let mut rng = Rng::new(11);
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 17, 5),
            (37, 64, 129),
            (64, 128, 128),
            (5, 3, 24),
            (9, 200, 23),
        ] {
            let a = rng.vec(m * k, 1.0);
            let b = rng.vec(k * n, 1.0);
            let want = naive(&a, m, k, &b, n);
            let mut out = vec![f32::NAN; m * n];
            matmul(&a, m, k, &b, n, &mut out);
            assert_close(
                &out,
                &want,
                1e-5 * (k as f32).sqrt(),
                &format!("{m}x{k}x{n}"),
            );
            let mut p = vec![f32::NAN; m * n];
            mm_portable(
                &a,
                m,
                k,
                &b,
                n,
                &mut p,
                Strides {
                    lda: k,
                    ldb: n,
                    ldc: n,
                },
                false,
            );
            assert_close(&p, &want, 1e-5 * (k as f32).sqrt(), "portable");
            // accumulate: c = want + a·b
            let mut c = want.clone();
            mm_seq(&a, m, k, &b, n, &mut c, true);
            let twice: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
            assert_close(&c, &twice, 2e-5 * (k as f32).sqrt(), "accumulate");
        }
    }

    #[test]
    fn rows_bitwise_independent() {
        let mut rng = Rng::new(5);
        let (m, k, n) = (150, 100, 37);
        let a = rng.vec(m * k, 1.0);
        let b = rng.vec(k * n, 1.0);
        let mut full = vec![0.0f32; m * n];
        matmul(&a, m, k, &b, n, &mut full);
        for r in [0, 5, 149] {
            let mut one = vec![0.0f32; n];
            matmul(&a[r * k..(r + 1) * k], 1, k, &b, n, &mut one);
            assert_eq!(one, full[r * n..(r + 1) * n].to_vec(), "row {r}");
        }
    }
}
