//! Tests for `gemm.rs`: accuracy vs f64 on odd shapes, bitwise row independence.

use super::*;
use crate::cpu::testutil::{assert_close, Rng};

fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    let mut o = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| x[i * k + p] as f64 * w[j * k + p] as f64)
                .sum();
            o[i * n + j] = s as f32;
        }
    }
    o
}

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    if Isa::detect() != Isa::Portable {
        v.push(Isa::detect());
    }
    v
}

#[test]
fn matches_naive_on_odd_shapes() {
    let mut rng = Rng::new(1);
    let shapes = [
        (1, 1, 1),
        (3, 17, 5),
        (37, 300, 129),
        (64, 1024, 1000),
        (5, 7, 2),
        (2, 513, 50),
        (20, 1100, 7),
        (150, 70, 50),
    ];
    for &(m, k, n) in &shapes {
        let x = rng.vec(m * k, 1.0);
        let w = rng.vec(n * k, 1.0);
        let want = naive(&x, m, k, &w, n);
        for isa in isas() {
            let mut out = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, k, &w, n, &mut out);
            assert_close(
                &out,
                &want,
                1e-5 * (k as f32).sqrt(),
                &format!("{isa:?} {m}x{k}->{n}"),
            );
        }
    }
}

#[test]
fn zero_k_gives_zeros() {
    let mut out = vec![1.0f32; 6];
    linear(&[], 2, 0, &[], 3, &mut out);
    assert_eq!(out, vec![0.0; 6]);
}

#[test]
fn rows_are_bitwise_independent_of_batch() {
    let mut rng = Rng::new(7);
    for &(k, n) in &[(300, 129), (2048, 100), (13, 50)] {
        let batch = rng.vec(7 * k, 1.0);
        let w = rng.vec(n * k, 1.0);
        for isa in isas() {
            let mut full = vec![0.0f32; 7 * n];
            linear_with(isa, &batch, 7, k, &w, n, &mut full);
            // Same row alone, and at other positions of a bigger batch.
            for r in [0usize, 3, 6] {
                let row = &batch[r * k..(r + 1) * k];
                let mut alone = vec![0.0f32; n];
                linear_with(isa, row, 1, k, &w, n, &mut alone);
                assert_eq!(
                    bits(&alone),
                    bits(&full[r * n..(r + 1) * n]),
                    "{isa:?} alone r={r}"
                );
                // 138 rows: block 0 (128 rows, packed weights) and
                // block 1 (10 rows, unpacked; rows 136-137 form a 2-row edge tile).
                let m = 138;
                for at in [65 + r % 4, 136 + r % 2] {
                    let mut big = rng.vec(m * k, 1.0);
                    big[at * k..(at + 1) * k].copy_from_slice(row);
                    let mut out = vec![0.0f32; m * n];
                    linear_with(isa, &big, m, k, &w, n, &mut out);
                    assert_eq!(
                        bits(&out[at * n..(at + 1) * n]),
                        bits(&alone),
                        "{isa:?} at={at}"
                    );
                }
            }
        }
    }
}

#[test]
fn independent_of_thread_count() {
    let mut rng = Rng::new(3);
    let (m, k, n) = (33, 700, 300);
    let x = rng.vec(m * k, 1.0);
    let w = rng.vec(n * k, 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut out = vec![0.0f32; m * n];
        pool.install(|| linear(&x, m, k, &w, n, &mut out));
        out
    };
    assert_eq!(bits(&run(1)), bits(&run(3)));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}
