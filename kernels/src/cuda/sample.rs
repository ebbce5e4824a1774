//! Sampling on CUDA (`sample.cu`): greedy, temperature, top-k and top-p over a `[rows, vocab]`
//! logits batch with per-row parameters and a per-row uniform draw from the host, so a row gives
//! the token the engine's CPU sampler gives for the same draw (see [`crate::cpu::sample_row`]).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::launch::allow_dynamic_smem;
use super::{CudaDevice, CudaError, SAMPLE_SOURCE};

const THREADS: usize = 1024;
/// Candidates a row's compacted prefix or deciding bin may hold (`SAMPLE_CAP`; its buffer also
/// holds the bin path's planning histogram); larger sets take the radix path.
const CAP: usize = 8192;
/// Dynamic shared memory: `PrefixShared` (keys, a count, a hit index and one running sum); two
/// blocks of the kernel fit one multiprocessor.
const DYN_SMEM: usize = CAP * 8 + 16;

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(format!("sample: {msg}"))
}

/// Per-row sampling parameters on the device: `temperature` (0 = greedy), `top_k` (0 = off),
/// `top_p` (1 = off) and the uniform draw in [0, 1) of each row.
pub struct SamplingRows {
    pub temperature: CudaSlice<f32>,
    pub top_k: CudaSlice<u32>,
    pub top_p: CudaSlice<f32>,
    pub uniform: CudaSlice<f64>,
    rows: usize,
}

impl SamplingRows {
    /// Uploads the parameters of `temperature.len()` rows; every slice must have that length
    /// and the values the CPU sampler accepts (temperature finite ≥ 0, top_p in (0, 1],
    /// uniform in [0, 1)).
    pub fn upload(
        dev: &CudaDevice,
        temperature: &[f32],
        top_k: &[u32],
        top_p: &[f32],
        uniform: &[f64],
    ) -> Result<Self, CudaError> {
        let rows = temperature.len();
        if top_k.len() != rows || top_p.len() != rows || uniform.len() != rows {
            return Err(shape_err(format!(
                "parameter lengths differ: {rows} temperatures, {} top_k, {} top_p, {} draws",
                top_k.len(),
                top_p.len(),
                uniform.len()
            )));
        }
        if let Some(t) = temperature.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
            return Err(shape_err(format!("temperature {t} must be finite and ≥ 0")));
        }
        if let Some(p) = top_p.iter().find(|p| !(**p > 0.0 && **p <= 1.0)) {
            return Err(shape_err(format!("top_p {p} must be in (0, 1]")));
        }
        if let Some(u) = uniform.iter().find(|u| !(**u >= 0.0 && **u < 1.0)) {
            return Err(shape_err(format!("uniform draw {u} must be in [0, 1)")));
        }
        Ok(SamplingRows {
            temperature: dev.upload(temperature)?,
            top_k: dev.upload(top_k)?,
            top_p: dev.upload(top_p)?,
            uniform: dev.upload(uniform)?,
            rows,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The compiled sampling kernels.
pub struct Sampler {
    f32_rows: CudaFunction,
    bf16_rows: CudaFunction,
}

impl Sampler {
    pub fn load(dev: &CudaDevice) -> Result<Self, CudaError> {
        Self::load_variant(dev, &[])
    }

    /// The sampler built with extra `sample.cu` settings (`SAMPLE_BINS`): other ways to the same
    /// tokens, for checks and timings side by side.
    pub fn load_variant(dev: &CudaDevice, settings: &[(&str, String)]) -> Result<Self, CudaError> {
        let mut defines = vec![
            ("SAMPLE_THREADS", THREADS.to_string()),
            ("SAMPLE_CAP", CAP.to_string()),
        ];
        defines.extend(settings.iter().map(|(k, v)| (*k, v.clone())));
        let m = dev.module("sample", SAMPLE_SOURCE, &defines)?;
        let f32_rows = m.load_function("sample_f32")?;
        let bf16_rows = m.load_function("sample_bf16")?;
        for f in [&f32_rows, &bf16_rows] {
            allow_dynamic_smem(f, DYN_SMEM)?;
        }
        Ok(Sampler {
            f32_rows,
            bf16_rows,
        })
    }

    /// One token per row of f32 logits `[params.rows(), vocab]` into `out`.
    pub fn sample_f32(
        &self,
        dev: &CudaDevice,
        logits: &CudaSlice<f32>,
        vocab: usize,
        params: &SamplingRows,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        self.launch(dev, &self.f32_rows, logits, vocab, params, out)
    }

    /// The same over bf16 logits (raw bits).
    pub fn sample_bf16(
        &self,
        dev: &CudaDevice,
        logits: &CudaSlice<u16>,
        vocab: usize,
        params: &SamplingRows,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        self.launch(dev, &self.bf16_rows, logits, vocab, params, out)
    }

    /// [`Self::sample_f32`] on raw device addresses: `rows` rows of `vocab` f32 logits at
    /// `logits`, per row `temperature` f32, `top_k` u32, `top_p` f32 and `uniform` f64 (each
    /// `rows` long, in the ranges [`SamplingRows::upload`] checks), token ids u32 into `out`.
    /// Only queues the launch, so it can be captured into a graph.
    ///
    /// # Safety
    /// Every address must point at device memory of this device holding what is described.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sample_f32_at(
        &self,
        dev: &CudaDevice,
        logits: u64,
        rows: usize,
        vocab: usize,
        (temperature, top_k, top_p, uniform): (u64, u64, u64, u64),
        out: u64,
    ) -> Result<(), CudaError> {
        if vocab == 0 || vocab >= i32::MAX as usize {
            return Err(shape_err(format!("vocab {vocab} out of range")));
        }
        if rows == 0 {
            return Ok(());
        }
        let vocab_i = vocab as i32;
        let mut launch = dev.stream().launch_builder(&self.f32_rows);
        launch
            .arg(&logits)
            .arg(&temperature)
            .arg(&top_k)
            .arg(&top_p)
            .arg(&uniform)
            .arg(&out)
            .arg(&vocab_i);
        // SAFETY: the argument list matches `sample_f32`; the caller vouches for the buffers.
        unsafe { launch.launch(Self::config(rows)) }?;
        Ok(())
    }

    fn config(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: DYN_SMEM as u32,
        }
    }

    fn launch<T: cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaDevice,
        f: &CudaFunction,
        logits: &CudaSlice<T>,
        vocab: usize,
        params: &SamplingRows,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        let rows = params.rows;
        if vocab == 0 || vocab >= i32::MAX as usize {
            return Err(shape_err(format!("vocab {vocab} out of range")));
        }
        if logits.len() < rows * vocab || out.len() < rows {
            return Err(shape_err(format!(
                "{rows} rows of {vocab}: logits hold {}, out {}",
                logits.len(),
                out.len()
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let cfg = Self::config(rows);
        let vocab_i = vocab as i32;
        let mut launch = dev.stream().launch_builder(f);
        launch
            .arg(logits)
            .arg(&params.temperature)
            .arg(&params.top_k)
            .arg(&params.top_p)
            .arg(&params.uniform)
            .arg(out)
            .arg(&vocab_i);
        // SAFETY: the argument list matches `sample_f32`/`sample_bf16` (T is f32 or u16 by the
        // public entry points); every buffer holds `rows` rows, checked above.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
