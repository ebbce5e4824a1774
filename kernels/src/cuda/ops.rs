//! Row-wise ops on CUDA (`ops.cu`: RMSNorm with the residual add, embedding gather, argmax) and
//! the bf16 linear layer through cuBLAS (`cublasGemmEx`, f32 accumulation). Semantics are those
//! of the CPU backend's `rms_norm`, `embedding` and `argmax`, in bf16 storage.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{CudaDevice, CudaError};
use crate::gpu::{OPS_SOURCE, OPS_THREADS, OPS_VECS};

fn shape_err(op: &str, msg: String) -> CudaError {
    CudaError::Shape(format!("{op}: {msg}"))
}

fn expect_len(op: &str, what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got < want {
        return Err(shape_err(
            op,
            format!("{what} holds {got} values, needs {want}"),
        ));
    }
    Ok(())
}

fn rows_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (OPS_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The compiled row-wise kernels.
pub struct RowOps {
    rmsnorm: CudaFunction,
    embedding: CudaFunction,
    argmax: CudaFunction,
}

impl RowOps {
    pub fn load(dev: &CudaDevice) -> Result<Self, CudaError> {
        let defines = [
            ("OPS_THREADS", OPS_THREADS.to_string()),
            ("OPS_VECS", OPS_VECS.to_string()),
        ];
        let m = dev.module("ops", OPS_SOURCE, &defines)?;
        Ok(RowOps {
            rmsnorm: m.load_function("rmsnorm_bf16")?,
            embedding: m.load_function("embedding_bf16")?,
            argmax: m.load_function("argmax_f32")?,
        })
    }

    /// The widest row [`Self::rms_norm`] takes.
    pub const MAX_NORM_DIM: usize = OPS_THREADS * 8 * OPS_VECS;

    /// Per row of `dim` (`rows` rows): with `residual`, first `residual = bf16(x + residual)`,
    /// then `out = weight ⊙ rms_norm(residual)`; without, `out = weight ⊙ rms_norm(x)`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<u16>,
        residual: Option<&mut CudaSlice<u16>>,
        weight: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        if dim == 0 || !dim.is_multiple_of(8) || dim > Self::MAX_NORM_DIM {
            return Err(shape_err(
                OP,
                format!(
                    "dim {dim} must be a positive multiple of 8, at most {}",
                    Self::MAX_NORM_DIM
                ),
            ));
        }
        expect_len(OP, "x", x.len(), rows * dim)?;
        expect_len(OP, "out", out.len(), rows * dim)?;
        expect_len(OP, "weight", weight.len(), dim)?;
        if rows == 0 {
            return Ok(());
        }
        let (dim_i, s) = (dim as i32, dev.stream());
        let mut launch = s.launch_builder(&self.rmsnorm);
        launch.arg(x);
        let null: u64 = 0;
        match residual {
            Some(r) => {
                expect_len(OP, "residual", r.len(), rows * dim)?;
                launch.arg(r);
            }
            None => {
                launch.arg(&null);
            }
        }
        launch.arg(weight).arg(out).arg(&dim_i).arg(&eps);
        // SAFETY: the argument list matches `rmsnorm_bf16`; every buffer was checked to hold
        // `rows` rows of `dim` (the weight one row).
        unsafe { launch.launch(rows_config(rows)) }?;
        Ok(())
    }

    /// `out[i, :] = table[ids[i], :]` for a `[vocab, dim]` table. `ids` are given on the host
    /// (checked against `vocab`) and uploaded.
    pub fn embedding(
        &self,
        dev: &CudaDevice,
        table: &CudaSlice<u16>,
        vocab: usize,
        dim: usize,
        ids: &[u32],
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "embedding";
        if dim == 0 || !dim.is_multiple_of(8) {
            return Err(shape_err(
                OP,
                format!("dim {dim} must be a positive multiple of 8"),
            ));
        }
        expect_len(OP, "table", table.len(), vocab * dim)?;
        expect_len(OP, "out", out.len(), ids.len() * dim)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(shape_err(
                OP,
                format!("token id {id} is outside the vocabulary (size {vocab})"),
            ));
        }
        if ids.is_empty() {
            return Ok(());
        }
        let ids_dev = dev.upload(ids)?;
        let dim_i = dim as i32;
        let mut launch = dev.stream().launch_builder(&self.embedding);
        launch.arg(&ids_dev).arg(table).arg(out).arg(&dim_i);
        // SAFETY: the argument list matches `embedding_bf16`; ids < vocab, buffers sized above.
        unsafe { launch.launch(rows_config(ids.len())) }?;
        Ok(())
    }

    /// Greedy sampling: the index of each row's largest logit (`rows` rows of `vocab`).
    pub fn argmax(
        &self,
        dev: &CudaDevice,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "argmax";
        if vocab == 0 || vocab > i32::MAX as usize {
            return Err(shape_err(OP, format!("vocab {vocab} out of range")));
        }
        expect_len(OP, "logits", logits.len(), rows * vocab)?;
        expect_len(OP, "out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let vocab_i = vocab as i32;
        let mut launch = dev.stream().launch_builder(&self.argmax);
        launch.arg(logits).arg(out).arg(&vocab_i);
        // SAFETY: the argument list matches `argmax_f32`; buffers sized above.
        unsafe { launch.launch(rows_config(rows)) }?;
        Ok(())
    }
}

/// Storage type of a GEMM operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    Bf16,
    F32,
}

impl GemmType {
    fn cuda(self) -> blas_sys::cudaDataType_t {
        match self {
            GemmType::Bf16 => blas_sys::cudaDataType_t::CUDA_R_16BF,
            GemmType::F32 => blas_sys::cudaDataType_t::CUDA_R_32F,
        }
    }
}

/// The bf16 linear layer through cuBLAS.
pub struct Linear {
    blas: CudaBlas,
}

impl Linear {
    /// A cuBLAS handle on the device's stream; a clear error when libcublas cannot be loaded.
    pub fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        Ok(Linear {
            blas: CudaBlas::new(dev.stream().clone())?,
        })
    }

    /// `out[rows, out_dim] = x[rows, in_dim] · wᵀ` for a weight `w[out_dim, in_dim]` (the
    /// checkpoint layout), bf16 in and out, f32 accumulation — the CPU backend's `linear`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<u16>,
        rows: usize,
        in_dim: usize,
        w: &CudaSlice<u16>,
        out_dim: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "linear";
        expect_len(OP, "x", x.len(), rows * in_dim)?;
        expect_len(OP, "w", w.len(), out_dim * in_dim)?;
        expect_len(OP, "out", out.len(), rows * out_dim)?;
        let fits = |n: usize| n <= i32::MAX as usize;
        if !(fits(rows) && fits(in_dim) && fits(out_dim)) {
            return Err(shape_err(OP, "a dimension exceeds i32".into()));
        }
        if rows == 0 || out_dim == 0 {
            return Ok(());
        }
        let s = dev.stream();
        let (xp, _rx) = x.device_ptr(s);
        let (wp, _rw) = w.device_ptr(s);
        let (op, _ro) = out.device_ptr_mut(s);
        // SAFETY: the pointers are live device buffers of the sizes checked above.
        unsafe {
            self.gemm(
                rows,
                in_dim,
                out_dim,
                (xp, GemmType::Bf16),
                (wp, GemmType::Bf16),
                (op, GemmType::Bf16),
            )
        }
    }

    /// `out[rows, out_dim] = x[rows, in_dim] · wᵀ` (weight `[out_dim, in_dim]`) on device
    /// addresses with the given storage types, f32 accumulation. cuBLAS takes bf16 inputs with a
    /// bf16 or f32 output, or f32 throughout.
    ///
    /// # Safety
    /// Each address must point at a live device buffer on this handle's stream holding the
    /// extent above in its type, and the dimensions must fit `i32`.
    pub unsafe fn gemm(
        &self,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        x: (u64, GemmType),
        w: (u64, GemmType),
        out: (u64, GemmType),
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded; rows of `out_dim` are the contiguous layout.
        unsafe { self.gemm_strided(rows, in_dim, out_dim, x, w, out, out_dim) }
    }

    /// [`Self::gemm`] writing output row `r` at `out + r · out_stride` elements (e.g. into one
    /// half of a wider buffer).
    ///
    /// # Safety
    /// As for [`Self::gemm`], with `out` holding `rows` rows of `out_stride ≥ out_dim`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_strided(
        &self,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        x: (u64, GemmType),
        w: (u64, GemmType),
        out: (u64, GemmType),
        out_stride: usize,
    ) -> Result<(), CudaError> {
        if out_stride < out_dim || out_stride > i32::MAX as usize {
            return Err(shape_err(
                "gemm",
                format!("output stride {out_stride} below the width {out_dim}"),
            ));
        }
        if rows == 0 || out_dim == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: outᵀ[out_dim, rows] = w[out_dim, in_dim] (stored as wᵀ, so op T)
        // · xᵀ[in_dim, rows].
        // SAFETY: the caller guarantees the buffers; alpha/beta are f32 as the compute type asks.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out_dim as i32,
                rows as i32,
                in_dim as i32,
                &alpha as *const f32 as *const c_void,
                w.0 as *const c_void,
                w.1.cuda(),
                in_dim as i32,
                x.0 as *const c_void,
                x.1.cuda(),
                in_dim as i32,
                &beta as *const f32 as *const c_void,
                out.0 as *mut c_void,
                out.1.cuda(),
                out_stride as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
