//! Causal depthwise short convolution + SiLU (the q/k/v conv of KDA layers).
//!
//! Time is the slow axis of `x`, so the kernel runs over channels for each
//! step: one weight column and K source rows per output row, all contiguous.
//! Every output is `silu(Σ_j w[c,j]·xx[t+j,c])` summed in increasing `j`,
//! so decoding token by token gives the same bits as one prefill.

use rayon::prelude::*;

use super::simd::{multiversion, silu};

/// Output rows per rayon task (each row costs ~channels·kernel MACs).
const ROWS_PER_TASK: usize = 16;

/// Causal depthwise conv over time followed by SiLU.
///
/// * `x`: [T, channels]; `out`: [T, channels]
/// * `weight`: [channels, kernel] (torch Conv1d weight [C, 1, K] squeezed)
/// * `state`: [channels, kernel-1], the previous kernel-1 inputs of each
///   channel, oldest first (zeros at sequence start); updated to the last
///   kernel-1 inputs of `state ++ x`.
///
/// `out[t,c] = silu(Σ_j weight[c,j] · xx[t+j, c])` with `xx = state ++ x`.
pub fn short_conv_silu(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(kernel >= 1, "short_conv_silu: kernel must be >= 1");
    assert_eq!(
        weight.len(),
        channels * kernel,
        "short_conv_silu: weight shape"
    );
    assert_eq!(
        state.len(),
        channels * (kernel - 1),
        "short_conv_silu: state shape"
    );
    assert_eq!(x.len(), out.len(), "short_conv_silu: x/out length");
    if channels == 0 || x.is_empty() {
        return;
    }
    assert_eq!(
        x.len() % channels,
        0,
        "short_conv_silu: x not a multiple of channels"
    );
    let t_len = x.len() / channels;
    let hist_len = kernel - 1;
    // Time-major copies of the weight ([K, C]) and history ([K-1, C]) so every
    // inner loop runs over contiguous channels.
    let mut wt = vec![0.0f32; kernel * channels];
    transpose(weight, channels, kernel, &mut wt);
    let mut hist = vec![0.0f32; hist_len * channels];
    transpose(state, channels, hist_len, &mut hist);

    let rows = |t0: usize, o: &mut [f32]| conv_rows(x, &hist, &wt, channels, kernel, t0, o);
    if t_len <= ROWS_PER_TASK {
        rows(0, out);
    } else {
        out.par_chunks_mut(ROWS_PER_TASK * channels)
            .enumerate()
            .for_each(|(i, o)| rows(i * ROWS_PER_TASK, o));
    }

    // New state = last K-1 rows of xx = hist ++ x, transposed back to [C, K-1].
    for j in 0..hist_len {
        let row = xx_row(x, &hist, channels, hist_len, t_len + j);
        for (c, &v) in row.iter().enumerate() {
            state[c * hist_len + j] = v;
        }
    }
}

multiversion! {
    /// Output rows t0.. (as many as fit `out`); row t reads xx rows t..t+K-1.
    fn conv_rows(x: &[f32], hist: &[f32], wt: &[f32], channels: usize, kernel: usize, t0: usize, out: &mut [f32]) {
        let xx_row = |i: usize| xx_row(x, hist, channels, kernel - 1, i);
        for (dt, o) in out.chunks_exact_mut(channels).enumerate() {
            let t = t0 + dt;
            let src = xx_row(t);
            for ((o, &w), &v) in o.iter_mut().zip(&wt[..channels]).zip(src) {
                *o = w * v;
            }
            for j in 1..kernel {
                let src = xx_row(t + j);
                let w = &wt[j * channels..(j + 1) * channels];
                for ((o, &w), &v) in o.iter_mut().zip(w).zip(src) {
                    *o += w * v;
                }
            }
            for v in o.iter_mut() {
                *v = silu(*v);
            }
        }
    }
}

/// Row `i` of `xx = hist ++ x` (time-major, `channels` wide).
#[inline(always)]
fn xx_row<'a>(
    x: &'a [f32],
    hist: &'a [f32],
    channels: usize,
    hist_len: usize,
    i: usize,
) -> &'a [f32] {
    if i < hist_len {
        &hist[i * channels..(i + 1) * channels]
    } else {
        &x[(i - hist_len) * channels..(i - hist_len + 1) * channels]
    }
}

/// dst[c, r] = src[r, c] for src [rows, cols].
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    fn naive(x: &[f32], c: usize, w: &[f32], k: usize, state: &[f32]) -> Vec<f32> {
        let t = x.len() / c;
        let mut out = vec![0.0; x.len()];
        for ti in 0..t {
            for ch in 0..c {
                let mut s = 0.0f64;
                for j in 0..k {
                    let i = ti + j; // index into state ++ x
                    let v = if i < k - 1 {
                        state[ch * (k - 1) + i]
                    } else {
                        x[(i - (k - 1)) * c + ch]
                    };
                    s += w[ch * k + j] as f64 * v as f64;
                }
                out[ti * c + ch] = (s / (1.0 + (-s).exp())) as f32;
            }
        }
        out
    }

    #[test]
    fn matches_naive_and_pieces_equal_whole() {
        let mut rng = Rng::new(4);
        let (c, k, t) = (37, 4, 27);
        let x = rng.vec(t * c, 1.0);
        let w = rng.vec(c * k, 1.0);
        let init = rng.vec(c * (k - 1), 1.0);

        let mut state = init.clone();
        let mut whole = vec![0.0; t * c];
        short_conv_silu(&x, c, &w, k, &mut state, &mut whole);
        assert_close(&whole, &naive(&x, c, &w, k, &init), 1e-6, "naive");

        let mut st = init.clone();
        let mut pieces = vec![0.0; t * c];
        let mut t0 = 0;
        for len in [5, 1, 1, 20] {
            let r = t0 * c..(t0 + len) * c;
            short_conv_silu(&x[r.clone()], c, &w, k, &mut st, &mut pieces[r]);
            t0 += len;
        }
        assert_eq!(pieces, whole, "pieces vs whole (bitwise)");
        assert_eq!(st, state, "final state");
        // Final state = the last k-1 inputs per channel, oldest first.
        for ch in 0..c {
            for j in 0..k - 1 {
                assert_eq!(state[ch * (k - 1) + j], x[(t - (k - 1) + j) * c + ch]);
            }
        }
    }

    #[test]
    fn short_input_keeps_part_of_old_state() {
        // T=1 < K-1: new state = old state shifted by one plus the new input.
        let (c, k) = (2, 4);
        let w = vec![1.0; c * k];
        let mut state = vec![1.0, 2.0, 3.0, 10.0, 20.0, 30.0];
        let mut out = vec![0.0; c];
        short_conv_silu(&[4.0, 40.0], c, &w, k, &mut state, &mut out);
        assert_eq!(state, vec![2.0, 3.0, 4.0, 20.0, 30.0, 40.0]);
        assert!((out[0] - 10.0 * (1.0 / (1.0 + (-10.0f32).exp()))).abs() < 1e-5);
    }
}
