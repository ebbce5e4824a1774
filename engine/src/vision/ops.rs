//! The vision tower's building blocks that the text model does not have: projections with a
//! bias, LayerNorm beside RMSNorm, and both GELU forms.

use tessera_kernels::cpu;

use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// `nn.Linear` (`[out, in]` weight) with an optional bias.
pub(crate) struct Affine {
    pub w: Vec<f32>,
    pub b: Option<Vec<f32>>,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl Affine {
    /// Loads `{name}.weight` and, when present, `{name}.bias`. The first of `names` that exists
    /// in the checkpoint is used (tensors with several spellings).
    pub fn load(ck: &Checkpoint, names: &[&str], out_dim: usize, in_dim: usize) -> Result<Self> {
        let weights: Vec<String> = names.iter().map(|n| format!("{n}.weight")).collect();
        let refs: Vec<&str> = weights.iter().map(String::as_str).collect();
        let found = ck.resolve(&refs)?;
        let base = found.strip_suffix(".weight").unwrap_or(found);
        Self::load_shaped(ck, base, &[out_dim, in_dim], out_dim, in_dim)
    }

    /// Like [`load`](Self::load) for one name whose weight has another stored shape with the
    /// same element order (a conv kernel read as a projection).
    pub fn load_shaped(
        ck: &Checkpoint,
        base: &str,
        shape: &[usize],
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Self> {
        let w = ck.f32(&format!("{base}.weight"), shape)?;
        let bias = format!("{base}.bias");
        let b = if ck.contains(&bias) {
            Some(ck.f32(&bias, &[out_dim])?)
        } else {
            None
        };
        Ok(Affine {
            w,
            b,
            in_dim,
            out_dim,
        })
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows * self.out_dim];
        cpu::linear(x, rows, self.in_dim, &self.w, self.out_dim, &mut out);
        if let Some(b) = &self.b {
            for row in out.chunks_exact_mut(self.out_dim) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
        out
    }

    pub fn parameter_count(&self) -> usize {
        self.w.len() + self.b.as_ref().map_or(0, Vec::len)
    }
}

/// K2.5 uses LayerNorm (weight + bias), K3 RMSNorm (weight only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NormKind {
    Layer,
    Rms,
}

pub(crate) struct VisionNorm {
    kind: NormKind,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    eps: f32,
}

impl VisionNorm {
    pub fn load(
        ck: &Checkpoint,
        names: &[&str],
        kind: NormKind,
        dim: usize,
        eps: f32,
    ) -> Result<Self> {
        let weights: Vec<String> = names.iter().map(|n| format!("{n}.weight")).collect();
        let refs: Vec<&str> = weights.iter().map(String::as_str).collect();
        let found = ck.resolve(&refs)?;
        let base = found.strip_suffix(".weight").unwrap_or(found);
        let w = ck.f32(found, &[dim])?;
        let bias = format!("{base}.bias");
        let b = match kind {
            NormKind::Layer if ck.contains(&bias) => Some(ck.f32(&bias, &[dim])?),
            _ => None,
        };
        Ok(VisionNorm { kind, w, b, eps })
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let dim = self.w.len();
        let mut out = vec![0.0; x.len()];
        match self.kind {
            NormKind::Rms => cpu::rms_norm(x, dim, &self.w, self.eps, &mut out),
            NormKind::Layer => {
                for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                    let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
                    let var =
                        xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
                    let inv = 1.0 / (var + self.eps as f64).sqrt();
                    for (i, (o, &v)) in or.iter_mut().zip(xr).enumerate() {
                        let mut y = ((v as f64 - mean) * inv) as f32 * self.w[i];
                        if let Some(b) = &self.b {
                            y += b[i];
                        }
                        *o = y;
                    }
                }
            }
        }
        out
    }

    pub fn parameter_count(&self) -> usize {
        self.w.len() + self.b.as_ref().map_or(0, Vec::len)
    }
}

/// Which GELU a config names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gelu {
    /// `gelu_pytorch_tanh`, `gelu_new`: the tanh approximation.
    Tanh,
    /// `gelu`: the exact, erf form.
    Exact,
}

impl Gelu {
    pub fn from_name(name: &str) -> Option<Gelu> {
        match name {
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" | "gelu_tanh" => Some(Gelu::Tanh),
            "gelu" | "gelu_exact" => Some(Gelu::Exact),
            _ => None,
        }
    }

    pub fn apply(self, x: &mut [f32]) {
        match self {
            Gelu::Tanh => {
                let c = (2.0f64 / std::f64::consts::PI).sqrt();
                for v in x {
                    let z = *v as f64;
                    *v = (0.5 * z * (1.0 + (c * (z + 0.044715 * z * z * z)).tanh())) as f32;
                }
            }
            Gelu::Exact => {
                for v in x {
                    let z = *v as f64;
                    *v = (0.5 * z * (1.0 + erf(z / std::f64::consts::SQRT_2))) as f32;
                }
            }
        }
    }
}

/// erf to about 1e-15 relative: its Taylor series near 0, a continued fraction for erfc beyond.
fn erf(x: f64) -> f64 {
    let ax = x.abs();
    let r = if ax < 2.5 {
        // erf(x) = 2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1))
        let x2 = ax * ax;
        let mut term = ax;
        let mut sum = ax;
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -x2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else if ax < 27.0 {
        // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...)))), Lentz-free:
        // evaluated bottom-up with a fixed depth that converges for x >= 2.5.
        let mut f = ax;
        for k in (1..=60).rev() {
            f = ax + (k as f64 / 2.0) / f;
        }
        1.0 - (-ax * ax).exp() / (std::f64::consts::PI.sqrt() * f)
    } else {
        1.0
    };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // erf(0.5), erf(1), erf(2), erf(3) to 15 digits (tables of the error function).
        for (x, want) in [
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
        ] {
            assert!((erf(x) - want).abs() < 1e-13, "erf({x}) = {}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-13);
        }
    }
}
