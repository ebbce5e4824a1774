//! Micro benchmark of `cpu::linear` (run with `--release`): prints GFLOP/s,
//! next to the machine's measured AVX2 FMA peak for scale.
//!
//! `cargo run -p tessera-kernels --release --example gemm_bench [MxKxN ...]`
use std::time::Instant;

use tessera_kernels::cpu::linear;

fn main() {
    let threads = rayon::current_num_threads();
    let mut shapes: Vec<(usize, usize, usize)> = std::env::args()
        .skip(1)
        .map(|s| {
            let v: Vec<usize> = s
                .split('x')
                .map(|t| t.parse().expect("shape MxKxN"))
                .collect();
            (v[0], v[1], v[2])
        })
        .collect();
    if shapes.is_empty() {
        shapes = vec![(1, 2048, 2048), (8, 2048, 2048), (128, 2048, 2048)];
    }
    if let Some(peak) = fma_peak_gflops() {
        println!(
            "rayon threads: {threads}; FMA peak ≈ {peak:.1} GFLOP/s per core, {:.1} all threads",
            peak * threads as f64
        );
    }
    for (m, k, n) in shapes {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let mut out = vec![0.0f32; m * n];
        linear(&x, m, k, &w, n, &mut out); // warm up (pool start, page faults)
        let flops = 2.0 * (m * k * n) as f64;
        let iters = ((1e9 / flops) as usize).clamp(2, 5000);
        // Best of many short repetitions: the machine may be shared.
        let mut best = f64::INFINITY;
        for _ in 0..30 {
            let t = Instant::now();
            for _ in 0..iters {
                linear(&x, m, k, &w, n, &mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / iters as f64);
        }
        println!(
            "linear {m:>4} x {k} -> {n}: {:8.3} ms  {:7.1} GFLOP/s",
            best * 1e3,
            flops / best / 1e9
        );
        std::hint::black_box(&out);
    }
}

/// Single-core throughput of independent 8-lane FMAs (12 chains).
#[cfg(target_arch = "x86_64")]
fn fma_peak_gflops() -> Option<f64> {
    if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
        return None;
    }
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chains(n: usize) -> f32 {
        use std::arch::x86_64::*;
        let mut a = [_mm256_setzero_ps(); 12];
        let (x, y) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..n {
            for v in a.iter_mut() {
                *v = _mm256_fmadd_ps(*v, x, y);
            }
        }
        let mut s = _mm256_setzero_ps();
        for v in a {
            s = _mm256_add_ps(s, v);
        }
        _mm256_cvtss_f32(s)
    }
    let n = 2_000_000;
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let t = Instant::now();
        // SAFETY: features checked above.
        std::hint::black_box(unsafe { chains(n) });
        best = best.min(t.elapsed().as_secs_f64());
    }
    Some((n * 12 * 16) as f64 / best / 1e9)
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_peak_gflops() -> Option<f64> {
    None
}
