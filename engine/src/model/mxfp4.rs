//! MXFP4 projections as compressed-tensors stores them (`mxfp4-pack-quantized`, K3-SPEC §2): the
//! routed experts of the quantized K3 release. Weights stay packed in memory (4.25 bits per
//! weight); each output row is dequantised into a scratch row when it is used (w4a32 on CPU).
//!
//! Layout of a `[out, in]` weight: `weight_packed` u8 `[out, in/2]`, element `j` of a row in byte
//! `j/2`, low nibble for even `j`, high nibble for odd `j`; a nibble is E2M1 (bit 3 the sign, bits
//! 0–2 index `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`); `weight_scale` u8 `[out, in/32]` holds one E8M0
//! exponent per 32 consecutive inputs (value `2^(s − 127)`). The nibble order is pinned by the
//! reference's quantiser and by the unit test below (K3-SPEC §6.9 notes it is not yet verified
//! against a dequantised K3 shard).

use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::error::{EngineError, Result};

/// Inputs sharing one scale.
pub const GROUP: usize = 32;
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// Below this many multiply-adds the rayon fork costs more than it saves.
const PAR_MIN_MACS: usize = 1 << 18;

pub struct Mxfp4Linear {
    pub(super) packed: Vec<u8>,
    pub(super) scale: Vec<u8>,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl Mxfp4Linear {
    /// `base` is the module name, e.g. `…experts.3.w1` (`.weight_packed`, `.weight_scale`).
    pub fn load(ck: &Checkpoint, base: &str, out_dim: usize, in_dim: usize) -> Result<Self> {
        if !in_dim.is_multiple_of(GROUP) {
            return Err(EngineError::InvalidInput(format!(
                "`{base}`: MXFP4 needs an input width divisible by {GROUP}, got {in_dim}"
            )));
        }
        Ok(Mxfp4Linear {
            packed: ck.u8(&format!("{base}.weight_packed"), &[out_dim, in_dim / 2])?,
            scale: ck.u8(&format!("{base}.weight_scale"), &[out_dim, in_dim / GROUP])?,
            in_dim,
            out_dim,
        })
    }

    /// Weights represented (`out · in`).
    pub fn parameter_count(&self) -> usize {
        self.in_dim * self.out_dim
    }

    /// Output row `o` as f32 into `row` (`in_dim` long).
    pub fn dequant_row(&self, o: usize, row: &mut [f32]) {
        let half = self.in_dim / 2;
        let groups = self.in_dim / GROUP;
        let bytes = &self.packed[o * half..(o + 1) * half];
        let scales = &self.scale[o * groups..(o + 1) * groups];
        for (g, (out, codes)) in row
            .chunks_exact_mut(GROUP)
            .zip(bytes.chunks_exact(GROUP / 2))
            .enumerate()
        {
            let s = match scales[g] {
                0 => 2f32.powi(-127),
                255 => f32::NAN,
                e => f32::from_bits(u32::from(e) << 23),
            };
            for (pair, &b) in out.chunks_exact_mut(2).zip(codes) {
                pair[0] = decode(b & 0xF) * s;
                pair[1] = decode(b >> 4) * s;
            }
        }
    }

    /// `out[rows, out_dim] = x[rows, in_dim] · Wᵀ`. Every element is one dot product in increasing
    /// input order, so a row's result does not depend on the batch it is in.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (k, n) = (self.in_dim, self.out_dim);
        assert_eq!(x.len(), rows * k, "mxfp4 linear: input shape");
        // Output-major scratch: column `o` of the result for every row.
        let mut cols = vec![0.0f32; n * rows];
        let work = |(o, col): (usize, &mut [f32])| {
            let mut w = vec![0.0f32; k];
            self.dequant_row(o, &mut w);
            for (r, c) in col.iter_mut().enumerate() {
                *c = dot(&x[r * k..(r + 1) * k], &w);
            }
        };
        if rows * k * n >= PAR_MIN_MACS {
            cols.par_chunks_mut(rows.max(1)).enumerate().for_each(work);
        } else {
            cols.chunks_mut(rows.max(1)).enumerate().for_each(work);
        }
        let mut out = vec![0.0f32; rows * n];
        for (o, col) in cols.chunks(rows.max(1)).enumerate() {
            for (r, v) in col.iter().enumerate() {
                out[r * n + o] = *v;
            }
        }
        out
    }
}

/// Round-to-nearest MXFP4 of a `[out, in]` weight (`in % 32 == 0`), as `(weight_packed,
/// weight_scale)`: each group's scale is the power of two that puts its largest magnitude in
/// `(3, 6]`; ties go to the smaller magnitude. The same rule as `k3_reference.py`'s quantiser.
pub fn quantize(w: &[f32], out_dim: usize, in_dim: usize) -> (Vec<u8>, Vec<u8>) {
    assert!(in_dim.is_multiple_of(GROUP) && w.len() == out_dim * in_dim);
    let mut packed = Vec::with_capacity(w.len() / 2);
    let mut scale = Vec::with_capacity(w.len() / GROUP);
    for group in w.chunks_exact(GROUP) {
        let amax = group.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
        let e = (amax / 6.0).log2().ceil().clamp(-127.0, 127.0);
        scale.push((e + 127.0) as u8);
        let inv = (-e).exp2();
        let code = |x: f32| {
            let y = (x * inv).abs();
            let mut best = 0;
            for (i, v) in E2M1.iter().enumerate() {
                if (y - v).abs() < (y - E2M1[best]).abs() {
                    best = i;
                }
            }
            best as u8 | if x < 0.0 { 8 } else { 0 }
        };
        for pair in group.chunks_exact(2) {
            packed.push(code(pair[0]) | (code(pair[1]) << 4));
        }
    }
    (packed, scale)
}

fn decode(nibble: u8) -> f32 {
    let mag = E2M1[(nibble & 0x7) as usize];
    if nibble & 0x8 != 0 {
        -mag
    } else {
        mag
    }
}

/// 8 lane accumulators in a fixed order, then a fixed reduction tree.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(packed: Vec<u8>, scale: Vec<u8>, out_dim: usize, in_dim: usize) -> Mxfp4Linear {
        Mxfp4Linear {
            packed,
            scale,
            in_dim,
            out_dim,
        }
    }

    #[test]
    fn quantize_round_trips_and_bounds_the_error() {
        let (n, k) = (4, 64);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * if i % 5 == 0 { 8.0 } else { 1.0 })
            .collect();
        let (p, s) = quantize(&w, n, k);
        let l = layer(p, s, n, k);
        let mut back = vec![0.0; n * k];
        for (o, row) in back.chunks_exact_mut(k).enumerate() {
            l.dequant_row(o, row);
        }
        for (g, (a, b)) in w.chunks(GROUP).zip(back.chunks(GROUP)).enumerate() {
            let amax = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= amax / 3.0 + 1e-6, "group {g}: {x} -> {y}");
            }
        }
        // Dequantised values are representable: quantising them again keeps every value.
        let (p2, s2) = quantize(&back, n, k);
        let l2 = layer(p2, s2, n, k);
        let mut again = vec![0.0; k];
        for o in 0..n {
            l2.dequant_row(o, &mut again);
            assert_eq!(again, back[o * k..(o + 1) * k]);
        }
    }

    #[test]
    fn nibble_order_sign_and_scale() {
        // 0xA3: low nibble 3 (+1.5) is element 0, high nibble 0xA (−1.0) element 1; scale 128 = 2.
        // Second group: 0x7F → −6 (low nibble) then +6 (high nibble), scale 125 = 1/4.
        let mut packed = vec![0xA3u8; 16];
        packed.extend([0x7F; 16]);
        let l = layer(packed, vec![128, 125], 1, 64);
        let mut row = vec![0.0; 64];
        l.dequant_row(0, &mut row);
        assert_eq!(&row[..4], &[3.0, -2.0, 3.0, -2.0]);
        assert_eq!(&row[32..34], &[-1.5, 1.5]);
        // E8M0 extremes: 127 is 1, 0 is 2^-127.
        let l = layer(vec![0x22; 16], vec![0], 1, 32);
        l.dequant_row(0, &mut row[..32]);
        assert_eq!(row[0], 2f32.powi(-127));
    }

    #[test]
    fn forward_equals_the_dequantised_matmul_and_is_batch_invariant() {
        let (n, k, rows) = (5, 64, 7);
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scale: Vec<u8> = (0..n * k / 32).map(|i| 120 + (i % 9) as u8).collect();
        let l = layer(packed, scale, n, k);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 7.0)
            .collect();
        let y = l.forward(&x, rows);
        let mut w = vec![0.0; k];
        for o in 0..n {
            l.dequant_row(o, &mut w);
            for r in 0..rows {
                let want: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[i] as f64).sum();
                assert!((y[r * n + o] as f64 - want).abs() < 1e-4 * want.abs().max(1.0));
            }
        }
        for r in 0..rows {
            let one = l.forward(&x[r * k..(r + 1) * k], 1);
            assert_eq!(one, y[r * n..(r + 1) * n], "row {r} depends on its batch");
        }
    }
}
