//! A dense projection in torch's `nn.Linear` layout (`[out, in]`), loaded by checkpoint name.

use tessera_kernels::cpu;

use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Linear {
    pub w: Vec<f32>,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl Linear {
    pub fn load(ck: &Checkpoint, name: &str, out_dim: usize, in_dim: usize) -> Result<Self> {
        Ok(Linear {
            w: ck.f32(name, &[out_dim, in_dim])?,
            in_dim,
            out_dim,
        })
    }

    /// Rows stacked along the output dimension, e.g. q, k and v projections as one GEMM.
    pub fn stack(parts: Vec<Linear>) -> Linear {
        let in_dim = parts[0].in_dim;
        debug_assert!(parts.iter().all(|p| p.in_dim == in_dim));
        let out_dim = parts.iter().map(|p| p.out_dim).sum();
        let mut w = Vec::with_capacity(out_dim * in_dim);
        for p in parts {
            w.extend_from_slice(&p.w);
        }
        Linear { w, in_dim, out_dim }
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows * self.out_dim];
        cpu::linear(x, rows, self.in_dim, &self.w, self.out_dim, &mut out);
        out
    }
}

/// An RMSNorm weight.
pub struct Norm {
    pub w: Vec<f32>,
    pub eps: f32,
}

impl Norm {
    pub fn load(ck: &Checkpoint, name: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(Norm {
            w: ck.f32(name, &[dim])?,
            eps,
        })
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        cpu::rms_norm(x, self.w.len(), &self.w, self.eps, &mut out);
        out
    }
}
