//! Tests for `kda.rs`: recurrent vs an f64 reference, chunked vs recurrent.

use super::*;
use crate::cpu::testutil::{rel_err, Rng};

struct Case {
    t: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn l2(x: &mut [f32], dim: usize) {
    for r in x.chunks_exact_mut(dim) {
        let n = r.iter().map(|v| v * v).sum::<f32>().sqrt() + 1e-6;
        r.iter_mut().for_each(|v| *v /= n);
    }
}

fn case(seed: u64, t: usize, heads: usize, dk: usize, dv: usize) -> Case {
    let mut rng = Rng::new(seed);
    let mut q = rng.vec(t * heads * dk, 1.0);
    let mut k = rng.vec(t * heads * dk, 1.0);
    l2(&mut q, dk);
    l2(&mut k, dk);
    // Log decays in [-1.5, 0): a mix of slow and fast channels, so a 64-token
    // chunk spans cumulative decays far below exp's range (-87).
    let g = (0..t * heads * dk)
        .map(|_| -1.5 * rng.unit().powi(3) - 1e-3)
        .collect();
    let beta = (0..t * heads).map(|_| rng.unit()).collect();
    Case {
        t,
        heads,
        dk,
        dv,
        q,
        k,
        v: rng.vec(t * heads * dv, 1.0),
        g,
        beta,
        state: rng.vec(heads * dk * dv, 0.5),
    }
}

/// Direct f64 transcription of the recurrence (transformers' recurrent_kimi_delta_attention).
fn reference(c: &Case, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let (hh, dk, dv) = (c.heads, c.dk, c.dv);
    let mut s: Vec<f64> = c.state.iter().map(|&v| v as f64).collect();
    let mut out = vec![0.0f32; c.t * hh * dv];
    for t in 0..c.t {
        for h in 0..hh {
            let r = t * hh + h;
            let s = &mut s[h * dk * dv..(h + 1) * dk * dv];
            for i in 0..dk {
                let e = (c.g[r * dk + i] as f64).exp();
                s[i * dv..(i + 1) * dv].iter_mut().for_each(|v| *v *= e);
            }
            for j in 0..dv {
                let kv: f64 = (0..dk)
                    .map(|i| s[i * dv + j] * c.k[r * dk + i] as f64)
                    .sum();
                let delta = c.beta[r] as f64 * (c.v[r * dv + j] as f64 - kv);
                for i in 0..dk {
                    s[i * dv + j] += c.k[r * dk + i] as f64 * delta;
                }
                out[r * dv + j] = (0..dk)
                    .map(|i| s[i * dv + j] * c.q[r * dk + i] as f64 * scale as f64)
                    .sum::<f64>() as f32;
            }
        }
    }
    (out, s.iter().map(|&v| v as f32).collect())
}

fn run_recurrent(c: &Case, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let mut st = c.state.clone();
    let mut out = vec![f32::NAN; c.t * c.heads * c.dv];
    kda_recurrent(
        &c.q, &c.k, &c.v, &c.g, &c.beta, c.heads, c.dk, c.dv, scale, &mut st, &mut out,
    );
    (out, st)
}

fn run_chunked(c: &Case, scale: f32, chunk: usize) -> (Vec<f32>, Vec<f32>) {
    let mut st = c.state.clone();
    let mut out = vec![f32::NAN; c.t * c.heads * c.dv];
    kda_chunked(
        &c.q, &c.k, &c.v, &c.g, &c.beta, c.heads, c.dk, c.dv, scale, chunk, &mut st, &mut out,
    );
    (out, st)
}

#[test]
fn recurrent_matches_f64_reference() {
    let c = case(1, 23, 3, 16, 12);
    let scale = 1.0 / (16f32).sqrt();
    let (o, s) = run_recurrent(&c, scale);
    let (ro, rs) = reference(&c, scale);
    assert!(rel_err(&o, &ro) < 1e-5, "out {}", rel_err(&o, &ro));
    assert!(rel_err(&s, &rs) < 1e-5, "state {}", rel_err(&s, &rs));
}

#[test]
fn chunked_matches_recurrent() {
    for &t in &[1usize, 63, 64, 65, 200] {
        for &chunk in &[64usize, 16] {
            for &(dk, dv) in &[(32usize, 24usize), (13, 7)] {
                let c = case(t as u64 * 31 + chunk as u64 + dk as u64, t, 2, dk, dv);
                let scale = 1.0 / (dk as f32).sqrt();
                let (ro, rs) = run_recurrent(&c, scale);
                let (co, cs) = run_chunked(&c, scale, chunk);
                let (eo, es) = (rel_err(&co, &ro), rel_err(&cs, &rs));
                assert!(
                    eo < 1e-5 && es < 1e-5,
                    "T={t} chunk={chunk} dk={dk}: out err {eo}, state err {es}"
                );
            }
        }
    }
}

#[test]
fn chunked_split_calls_continue_state() {
    // Prefill in two calls (state carried) equals one call.
    let c = case(77, 90, 2, 16, 8);
    let scale = 0.25;
    let (whole, ws) = run_chunked(&c, scale, 32);
    let split = 37;
    let (hk, hv) = (c.heads * c.dk, c.heads * c.dv);
    let mut st = c.state.clone();
    let mut out = vec![0.0; c.t * hv];
    for (a, b) in [(0, split), (split, c.t)] {
        kda_chunked(
            &c.q[a * hk..b * hk],
            &c.k[a * hk..b * hk],
            &c.v[a * hv..b * hv],
            &c.g[a * hk..b * hk],
            &c.beta[a * c.heads..b * c.heads],
            c.heads,
            c.dk,
            c.dv,
            scale,
            32,
            &mut st,
            &mut out[a * hv..b * hv],
        );
    }
    assert!(rel_err(&out, &whole) < 1e-5 && rel_err(&st, &ws) < 1e-5);
}

#[test]
fn strong_decay_stays_finite() {
    // Cumulative decay of ~-20 per token overflows any exp(+gc) factorisation.
    let mut c = case(5, 130, 1, 16, 16);
    c.g.iter_mut().for_each(|g| *g = -20.0);
    let (ro, rs) = run_recurrent(&c, 0.25);
    let (co, cs) = run_chunked(&c, 0.25, 64);
    assert!(rel_err(&co, &ro) < 1e-5 && rel_err(&cs, &rs) < 1e-5);
}
