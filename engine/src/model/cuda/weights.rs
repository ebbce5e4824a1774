//! The model's weights in device memory: projections as bf16 (`[out, in]`, the checkpoint
//! layout; f32 in the exact check mode), MXFP4 experts still packed, norms and small vectors as
//! f32. Built from the loaded CPU model, so both backends read the same checkpoint through one
//! loader.

use tessera_kernels::cuda::{bf16_bits, dptr, CudaDevice, CudaSlice, DevPtr};

use super::super::linear::{Linear, Norm};
use super::super::mlp::{Mlp, Proj};
use super::super::mxfp4::Mxfp4Linear;
use super::Gpu;
use crate::config::Activation;
use crate::error::Result;

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

/// A projection on the device: bf16, or MXFP4 dequantised inside the kernel.
pub(super) enum DProj {
    Dense(DLinear),
    Mxfp4 {
        packed: CudaSlice<u8>,
        scale: CudaSlice<u8>,
        in_dim: usize,
        out_dim: usize,
    },
}

impl DProj {
    /// `parts` stacked along the output dimension (all dense or all MXFP4: one expert).
    fn upload(gpu: &Gpu, parts: &[&Proj]) -> Result<Self> {
        let dense: Vec<&Linear> = parts
            .iter()
            .filter_map(|p| match p {
                Proj::Dense(l) => Some(l),
                Proj::Mxfp4(_) => None,
            })
            .collect();
        if dense.len() == parts.len() {
            return Ok(DProj::Dense(DLinear::from_parts(gpu, &dense)?));
        }
        let packed: Vec<&Mxfp4Linear> = parts
            .iter()
            .filter_map(|p| match p {
                Proj::Mxfp4(l) => Some(l),
                Proj::Dense(_) => None,
            })
            .collect();
        assert_eq!(
            packed.len(),
            parts.len(),
            "one expert mixes MXFP4 and dense"
        );
        let bytes: Vec<u8> = packed
            .iter()
            .flat_map(|l| l.packed.iter().copied())
            .collect();
        let scales: Vec<u8> = packed
            .iter()
            .flat_map(|l| l.scale.iter().copied())
            .collect();
        Ok(DProj::Mxfp4 {
            packed: gpu.dev.upload(&bytes)?,
            scale: gpu.dev.upload(&scales)?,
            in_dim: packed[0].in_dim,
            out_dim: packed.iter().map(|l| l.out_dim).sum(),
        })
    }

    /// `out [rows, out_dim]` f32 ← the GEMM input `x [rows, in_dim]`.
    fn forward(&self, gpu: &Gpu, x: DevPtr, rows: usize, out: DevPtr) -> Result<()> {
        match self {
            DProj::Dense(l) => l.forward(gpu, x, rows, out),
            DProj::Mxfp4 {
                packed,
                scale,
                in_dim,
                out_dim,
            } => {
                let (p, s) = (dptr(&gpu.dev, packed, 0), dptr(&gpu.dev, scale, 0));
                gpu.k
                    .mxfp4_linear(&gpu.dev, x, p, s, out, rows, *in_dim, *out_dim, *out_dim)?;
                Ok(())
            }
        }
    }

    fn out_dim(&self) -> usize {
        match self {
            DProj::Dense(l) => l.out_dim,
            DProj::Mxfp4 { out_dim, .. } => *out_dim,
        }
    }
}

/// A gated MLP with gate and up stacked into one projection.
pub(super) struct DMlp {
    gate_up: DProj,
    down: DProj,
    inter: usize,
    situ: Option<(f32, f32)>,
}

impl DMlp {
    pub fn upload(gpu: &Gpu, m: &Mlp) -> Result<Self> {
        let gate_up = DProj::upload(gpu, &[&m.gate, &m.up])?;
        Ok(DMlp {
            inter: gate_up.out_dim() / 2,
            gate_up,
            down: DProj::upload(gpu, &[&m.down])?,
            situ: match m.act {
                Activation::Silu => None,
                Activation::Situ { gate_beta, up_beta } => Some((gate_beta, up_beta)),
            },
        })
    }

    pub fn out_dim(&self) -> usize {
        self.down.out_dim()
    }

    /// `out [rows, out_dim]` f32 ← the GEMM input `x [rows, in]`.
    pub fn forward(&self, gpu: &Gpu, x: DevPtr, rows: usize, out: DevPtr) -> Result<()> {
        let scratch = self.scratch(gpu, rows)?;
        self.forward_in(gpu, x, rows, out, &scratch)
    }

    /// Working buffers for calls of up to `rows` rows (reused across the experts of a layer).
    pub fn scratch(&self, gpu: &Gpu, rows: usize) -> Result<MlpScratch> {
        Ok(MlpScratch {
            gate_up: gpu.zeros::<f32>(rows * 2 * self.inter)?,
            act: gpu.act(rows * self.inter)?,
        })
    }

    /// [`forward`](Self::forward) in `scratch` (from [`scratch`](Self::scratch) of an MLP of the
    /// same intermediate width, for at least `rows` rows).
    pub fn forward_in(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        rows: usize,
        out: DevPtr,
        scratch: &MlpScratch,
    ) -> Result<()> {
        let (gu, act) = (gpu.p(&scratch.gate_up), gpu.p(&scratch.act));
        self.gate_up.forward(gpu, x, rows, gu)?;
        gpu.k.glu(&gpu.dev, gu, act, rows, self.inter, self.situ)?;
        self.down.forward(gpu, act, rows, out)
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

pub(super) struct MlpScratch {
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
}

/// Uploads host data that is only needed for one forward call (indices, offsets).
pub(super) fn upload_i32(dev: &CudaDevice, v: &[usize]) -> Result<CudaSlice<i32>> {
    let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
    Ok(dev.upload(&v)?)
}
