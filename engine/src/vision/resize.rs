//! Antialiased bicubic resampling as `transformers` does it for this processor: torchvision's
//! `resize(..., BICUBIC, antialias=True)` on a uint8 image, which runs PyTorch's native uint8
//! kernel. That kernel is PIL's `ImagingResample`: Keys' cubic with a = -0.5 whose support
//! widens by the scale factor when shrinking, f64 weights normalised per output pixel and then
//! rounded to fixed point, a horizontal pass into a uint8 image, then a vertical pass. PyTorch
//! picks the fixed-point precision per axis (the most bits that keep every weight inside i16)
//! where PIL always uses 22 bits; both are implemented here, PyTorch's is what the processor
//! runs. With the same precision the result is the same, bit for bit.

/// Keys' cubic convolution kernel with a = -0.5.
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// Which fixed-point precision the weights get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// PyTorch's uint8 kernel (what torchvision, and so transformers, runs).
    Torch,
    /// PIL's `ImagingResample` (22 bits).
    Pil,
}

/// Fixed-point taps of one axis: per output index its first input index and weights.
struct Taps {
    starts: Vec<usize>,
    weights: Vec<Vec<i32>>,
    bits: u32,
}

fn taps(in_size: usize, out_size: usize, precision: Precision) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let max_taps = support.ceil() as usize * 2 + 1;
    let mut starts = Vec::with_capacity(out_size);
    let mut float_w = Vec::with_capacity(out_size);
    let mut max_w = 0.0f64;
    for i in 0..out_size {
        let center = scale * (i as f64 + 0.5);
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin).min(max_taps);
        let mut w: Vec<f64> = (0..n)
            .map(|j| cubic(((j + xmin) as f64 - center + 0.5) * invscale))
            .collect();
        let total: f64 = w.iter().sum();
        if total != 0.0 {
            for v in &mut w {
                *v /= total;
                max_w = max_w.max(*v);
            }
        }
        starts.push(xmin);
        float_w.push(w);
    }
    let bits = match precision {
        Precision::Pil => 22,
        Precision::Torch => {
            let mut b = 0;
            while b < 22 {
                if (0.5 + max_w * (1u64 << (b + 1)) as f64) as i64 >= 1 << 15 {
                    break;
                }
                b += 1;
            }
            b
        }
    };
    let one = (1u64 << bits) as f64;
    let weights = float_w
        .into_iter()
        .map(|w| {
            w.into_iter()
                .map(|v| {
                    let v = v * one;
                    if v < 0.0 {
                        (v - 0.5) as i32
                    } else {
                        (v + 0.5) as i32
                    }
                })
                .collect()
        })
        .collect();
    Taps {
        starts,
        weights,
        bits,
    }
}

fn clip8(acc: i64, bits: u32) -> u8 {
    (acc >> bits).clamp(0, 255) as u8
}

/// Resizes an interleaved RGB8 image (`w × h`) to `out_w × out_h`.
pub fn resize_bicubic(
    src: &[u8],
    w: usize,
    h: usize,
    out_w: usize,
    out_h: usize,
    precision: Precision,
) -> Vec<u8> {
    assert_eq!(src.len(), w * h * 3);
    let mut cur = src.to_vec();
    let mut cur_w = w;
    if out_w != w {
        let t = taps(w, out_w, precision);
        let round = 1i64 << t.bits.saturating_sub(1);
        let mut out = vec![0u8; out_w * h * 3];
        for y in 0..h {
            let row = &cur[y * w * 3..(y + 1) * w * 3];
            for (x, (x0, wts)) in t.starts.iter().zip(&t.weights).enumerate() {
                for c in 0..3 {
                    let mut acc = round;
                    for (j, &k) in wts.iter().enumerate() {
                        acc += row[(x0 + j) * 3 + c] as i64 * k as i64;
                    }
                    out[(y * out_w + x) * 3 + c] = clip8(acc, t.bits);
                }
            }
        }
        cur = out;
        cur_w = out_w;
    }
    if out_h != h {
        let t = taps(h, out_h, precision);
        let round = 1i64 << t.bits.saturating_sub(1);
        let mut out = vec![0u8; cur_w * out_h * 3];
        for (y, (y0, wts)) in t.starts.iter().zip(&t.weights).enumerate() {
            for x in 0..cur_w {
                for c in 0..3 {
                    let mut acc = round;
                    for (j, &k) in wts.iter().enumerate() {
                        acc += cur[((y0 + j) * cur_w + x) * 3 + c] as i64 * k as i64;
                    }
                    out[(y * cur_w + x) * 3 + c] = clip8(acc, t.bits);
                }
            }
        }
        cur = out;
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_widen_when_shrinking() {
        for p in [Precision::Torch, Precision::Pil] {
            for (i, o) in [(300, 139), (200, 93), (10, 37), (7, 7)] {
                let t = taps(i, o, p);
                assert!(t.bits >= 14, "{i}->{o}: {} bits", t.bits);
                for w in &t.weights {
                    let s: i64 = w.iter().map(|&k| k as i64).sum();
                    assert!((s - (1i64 << t.bits)).abs() <= w.len() as i64);
                    let scale = (i as f64 / o as f64).max(1.0);
                    assert!(w.len() as f64 <= 4.0 * scale + 3.0);
                }
            }
        }
    }

    #[test]
    fn a_constant_image_stays_constant() {
        let src = vec![77u8; 31 * 17 * 3];
        for p in [Precision::Torch, Precision::Pil] {
            assert!(resize_bicubic(&src, 31, 17, 12, 40, p)
                .iter()
                .all(|&v| v == 77));
        }
    }
}
