//! Shared SIMD plumbing for the CPU backend: runtime ISA detection, the
//! `multiversion!` helper, a vectorisable `exp`, fixed-order reductions and a
//! raw output pointer for disjoint parallel writes.
//!
//! Most kernels are written as plain Rust over 8-lane arrays (`[f32; 8]`
//! accumulators) so LLVM auto-vectorises them; `multiversion!` compiles that
//! body a second time with AVX2+FMA enabled and picks at run time. Every
//! reduction uses a fixed lane structure and a fixed final tree, so results
//! never depend on how work was split across threads.

/// Lane count of every fixed-order reduction in this backend (one AVX2 register).
pub(crate) const LANES: usize = 8;

/// True when the running CPU has AVX2 and FMA (detection is cached by std).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines `fn $name(args) -> ret` whose body is compiled twice: once for the
/// baseline target and once with AVX2+FMA (x86_64 only), chosen at run time.
/// The body must not spawn rayon work (closures would lose the features).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                if $crate::cpu::simd::has_avx2_fma() {
                    // SAFETY: the CPU supports the enabled features (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Fast `exp` for f32 (Cephes `expf` polynomial, ≤ 2 ulp on the normal range).
/// Written branch-free with integer bit tricks so it vectorises; results are
/// identical whether a lane is computed in a vector or in a scalar tail.
/// Returns 0 below ≈ -87.3 (no denormals) and +inf above ≈ 88.7; NaN → NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_83;
    const LO: f32 = -87.336_55;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2, high part (exact in few bits)
    const C2: f32 = -2.121_944_4e-4; // ln 2 - C1
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: float add rounds to integer
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = (xc - n * C1) - n * C2;
    let r2 = r * r;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let p = p * r2 + r + 1.0;
    // t's mantissa holds 0x400000 + n; rebuild 2^n directly in the exponent field.
    let scale_bits = t.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23;
    let y = p * f32::from_bits(scale_bits);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

/// Logistic sigmoid via the fast `exp`; saturates cleanly to 0 and 1.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SiLU `x·sigmoid(x)`, as torch computes it.
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Fixed reduction tree of 8 lanes: (i, i+4) then (i, i+2) then (0, 1).
/// Mirrors the AVX2 horizontal sum in the GEMM so both agree on structure.
#[inline(always)]
pub(crate) fn hsum8(a: [f32; LANES]) -> f32 {
    let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Dot product in a fixed order (so a given pair of slices always gives the
/// same bits). AVX2: 4 × 8-lane FMA accumulators over 32-element blocks,
/// 8-element blocks and a masked tail into the first, combined as
/// ((a0+a1)+(a2+a3)) then `hsum8`'s tree. Portable: 8 lanes + `hsum8`.
/// Explicit intrinsics: LLVM only SLP-vectorises the lane-array form 2-wide.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: features checked; both slices hold at least n elements.
        return unsafe { avx2::dot(a.as_ptr(), b.as_ptr(), n) };
    }
    dot_portable(&a[..n], &b[..n])
}

/// Portable [`dot`]: 8 lanes over increasing k, then `hsum8`.
#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let ac = a.chunks_exact(LANES);
    let bc = b.chunks_exact(LANES);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for l in 0..ar.len() {
        acc[l] += ar[l] * br[l];
    }
    hsum8(acc)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// 8 ones then 8 zeros: loading at offset `8 - tail` yields a `tail`-lane mask.
    pub(crate) static TAIL_MASK: [i32; 16] =
        [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, c) in acc.iter_mut().enumerate() {
                let o = i + u * 8;
                *c = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), *c);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
            i += 8;
        }
        if i < n {
            let m = _mm256_loadu_si256(TAIL_MASK.as_ptr().add(8 - (n - i)) as *const __m256i);
            acc[0] = _mm256_fmadd_ps(
                _mm256_maskload_ps(a.add(i), m),
                _mm256_maskload_ps(b.add(i), m),
                acc[0],
            );
        }
        hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ))
    }
}

/// Σ x² with the same fixed lane structure as [`dot`].
#[inline(always)]
pub(crate) fn sum_sq(x: &[f32]) -> f32 {
    dot(x, x)
}

/// Σ x with 8 lane accumulators and a fixed tree.
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let c = x.chunks_exact(LANES);
    let r = c.remainder();
    for v in c {
        for l in 0..LANES {
            acc[l] += v[l];
        }
    }
    for l in 0..r.len() {
        acc[l] += r[l];
    }
    hsum8(acc)
}

/// y += a·x (element order irrelevant: each element is one mul+add).
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * *xi;
    }
}

/// Max over a slice ignoring NaN (returns -inf for an empty or all-NaN slice).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let c = x.chunks_exact(LANES);
    let r = c.remainder();
    for v in c {
        for l in 0..LANES {
            m[l] = if v[l] > m[l] { v[l] } else { m[l] };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in m.iter().chain(r) {
        if v > best {
            best = v;
        }
    }
    best
}

/// Raw output pointer shared by parallel tasks that write provably disjoint
/// regions (rows or tiles) of one output buffer.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(*mut f32);

// SAFETY: users only write disjoint regions from different threads and the
// buffer outlives the parallel scope (documented at each use site).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    pub(crate) fn new(s: &mut [f32]) -> Self {
        SyncPtr(s.as_mut_ptr())
    }
    /// Method (not field) access so closures capture the whole `Send` wrapper.
    #[inline(always)]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst rel err {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn dot_both_paths() {
        for n in [0usize, 1, 7, 8, 31, 32, 33, 100, 203] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.7).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            for got in [dot(&a, &b), dot_portable(&a, &b)] {
                assert!((got as f64 - want).abs() < 1e-4, "n={n}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn reductions() {
        let x: Vec<f32> = (0..19).map(|i| i as f32).collect();
        assert_eq!(sum(&x), 171.0);
        assert_eq!(dot(&x, &x), (0..19).map(|i| (i * i) as f32).sum::<f32>());
        assert_eq!(max(&[1.0, f32::NAN, 3.0]), 3.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
