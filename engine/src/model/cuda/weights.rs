//! The model's weights in device memory: projections as bf16 (`[out, in]`, the checkpoint
//! layout; f32 in the exact check mode), norms and small vectors as f32 (routed experts, MXFP4
//! ones still packed, are in [`super::experts`]). Built from the loaded CPU model, so both
//! backends read the same checkpoint through one loader.

use tessera_kernels::cuda::{bf16_bits, dptr, CudaSlice, DevPtr};

use super::super::linear::{Linear, Norm};
use super::super::mlp::{Mlp, Proj};
use super::Gpu;
use crate::config::Activation;
use crate::error::{EngineError, Result};

pub(super) struct DLinear {
    pub w: CudaSlice<u16>,
    pub in_dim: usize,
    pub out_dim: usize,
}

impl DLinear {
    pub fn upload(gpu: &Gpu, l: &Linear) -> Result<Self> {
        Self::from_parts(gpu, &[l])
    }

    /// Several projections of one input stacked along the output dimension.
    pub fn from_parts(gpu: &Gpu, parts: &[&Linear]) -> Result<Self> {
        let w: Vec<f32> = parts.iter().flat_map(|l| l.w.iter().copied()).collect();
        Ok(DLinear {
            w: upload_weights(gpu, &w)?,
            in_dim: parts[0].in_dim,
            out_dim: parts.iter().map(|l| l.out_dim).sum(),
        })
    }

    /// `out [rows, out_dim]` f32 ← the GEMM input `x [rows, in_dim]`.
    pub fn forward(&self, gpu: &Gpu, x: DevPtr, rows: usize, out: DevPtr) -> Result<()> {
        let w = dptr(&gpu.dev, &self.w, 0);
        let t = gpu.act_type();
        // SAFETY: `x` holds `rows · in_dim` GEMM-input elements and `out` `rows · out_dim` f32
        // (the callers' buffers are sized from the same dimensions); `w` is this layer's weight
        // in the same type as `x`.
        unsafe {
            gpu.blas.gemm(
                rows,
                self.in_dim,
                self.out_dim,
                (x, t),
                (w, t),
                (out, tessera_kernels::cuda::GemmType::F32),
            )
        }?;
        Ok(())
    }
}

/// An f32 weight vector (norm weights, biases, pseudo-queries) with its epsilon where it has one.
pub(super) struct DVec {
    pub v: CudaSlice<f32>,
    pub eps: f32,
}

impl DVec {
    pub fn upload(gpu: &Gpu, v: &[f32], eps: f32) -> Result<Self> {
        Ok(DVec {
            v: gpu.dev.upload(v)?,
            eps,
        })
    }

    pub fn norm(gpu: &Gpu, n: &Norm) -> Result<Self> {
        Self::upload(gpu, &n.w, n.eps)
    }

    pub fn ptr(&self, gpu: &Gpu) -> DevPtr {
        dptr(&gpu.dev, &self.v, 0)
    }
}

/// A dense gated MLP (the dense layers and the shared experts; routed experts are
/// [`super::experts::DExperts`]) with gate and up stacked into one projection.
pub(super) struct DMlp {
    gate_up: DLinear,
    down: DLinear,
    inter: usize,
    situ: Option<(f32, f32)>,
}

impl DMlp {
    pub fn upload(gpu: &Gpu, m: &Mlp) -> Result<Self> {
        let gate_up = DLinear::from_parts(gpu, &[dense(&m.gate)?, dense(&m.up)?])?;
        Ok(DMlp {
            inter: gate_up.out_dim / 2,
            gate_up,
            down: DLinear::upload(gpu, dense(&m.down)?)?,
            situ: match m.act {
                Activation::Silu => None,
                Activation::Situ { gate_beta, up_beta } => Some((gate_beta, up_beta)),
            },
        })
    }

    pub fn out_dim(&self) -> usize {
        self.down.out_dim
    }

    /// `out [rows, out_dim]` f32 ← the GEMM input `x [rows, in]`.
    pub fn forward(&self, gpu: &Gpu, x: DevPtr, rows: usize, out: DevPtr) -> Result<()> {
        let gu = gpu.scratch::<f32>(rows * 2 * self.inter)?;
        let act = gpu.act(rows * self.inter)?;
        self.gate_up.forward(gpu, x, rows, gpu.p(&gu))?;
        gpu.k.glu(
            &gpu.dev,
            gpu.p(&gu),
            gpu.p(&act),
            rows,
            self.inter,
            self.situ,
        )?;
        self.down.forward(gpu, gpu.p(&act), rows, out)
    }
}

/// Weights as the GEMMs and kernels read them: bf16 bits, or in the exact mode the f32 values
/// (two 16-bit words each, little-endian, so one buffer type serves both).
pub(super) fn upload_weights(gpu: &Gpu, w: &[f32]) -> Result<CudaSlice<u16>> {
    let words: Vec<u16> = if gpu.k.exact() {
        w.iter()
            .flat_map(|x| {
                let b = x.to_bits();
                [b as u16, (b >> 16) as u16]
            })
            .collect()
    } else {
        w.iter().map(|&x| bf16_bits(x)).collect()
    };
    Ok(gpu.dev.upload(&words)?)
}

/// A dense projection of an MLP; MXFP4 is only loaded for routed experts.
fn dense(p: &Proj) -> Result<&Linear> {
    match p {
        Proj::Dense(l) => Ok(l),
        Proj::Mxfp4(_) => Err(EngineError::InvalidInput(
            "MXFP4 weights outside the routed experts are not supported".into(),
        )),
    }
}
