//! KDA short convolution on CUDA (`conv.cu`): causal depthwise conv over time + SiLU, for a
//! prefill of one sequence and the one-token update of a batch with the rolling conv state.
//! Semantics of [`crate::cpu::short_conv_silu`] in bf16 storage (weight `[C, K]`, state
//! `[C, K - 1]` oldest first, per sequence).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaError, CONV_SOURCE};

const THREADS: usize = 128;
const ROWS: usize = 16;

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(format!("short_conv: {msg}"))
}

fn expect_len(what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got < want {
        return Err(shape_err(format!(
            "{what} holds {got} values, needs {want}"
        )));
    }
    Ok(())
}

/// The compiled short-conv kernels for one kernel size.
pub struct ShortConv {
    prefill: CudaFunction,
    update: CudaFunction,
    kernel: usize,
}

impl ShortConv {
    /// Compiles the kernels for kernel size `kernel` (KDA uses 4).
    pub fn load(dev: &CudaDevice, kernel: usize) -> Result<Self, CudaError> {
        if !(2..=8).contains(&kernel) {
            return Err(shape_err(format!("kernel size {kernel} not in 2..=8")));
        }
        let defines = [
            ("CONV_K", kernel.to_string()),
            ("CONV_THREADS", THREADS.to_string()),
            ("CONV_ROWS", ROWS.to_string()),
        ];
        let m = dev.module("conv", CONV_SOURCE, &defines)?;
        Ok(ShortConv {
            prefill: m.load_function("conv_prefill_bf16")?,
            update: m.load_function("conv_update_bf16")?,
            kernel,
        })
    }

    pub fn kernel(&self) -> usize {
        self.kernel
    }

    /// One sequence: `x [t, channels]` → `out [t, channels]`, reading `state_in [channels, K-1]`
    /// and writing the state after the last token to `state_out`.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<u16>,
        weight: &CudaSlice<u16>,
        state_in: &CudaSlice<u16>,
        state_out: &mut CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        t: usize,
        channels: usize,
    ) -> Result<(), CudaError> {
        let k = self.kernel;
        self.check_common(weight, channels)?;
        expect_len("x", x.len(), t * channels)?;
        expect_len("out", out.len(), t * channels)?;
        expect_len("state_in", state_in.len(), channels * (k - 1))?;
        expect_len("state_out", state_out.len(), channels * (k - 1))?;
        if t == 0 || channels == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                channels.div_ceil(THREADS) as u32,
                t.div_ceil(ROWS) as u32,
                1,
            ),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t_i, c_i) = (t as i32, channels as i32);
        let mut launch = dev.stream().launch_builder(&self.prefill);
        launch
            .arg(x)
            .arg(weight)
            .arg(state_in)
            .arg(state_out)
            .arg(out)
            .arg(&t_i)
            .arg(&c_i);
        // SAFETY: the argument list matches `conv_prefill_bf16`; sizes checked above, and
        // `state_out` is a distinct buffer from `state_in` (Rust borrows guarantee it).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// One token for each of `batch` sequences: `x [batch, channels]` → `out`, with
    /// `state [batch, channels, K-1]` rolled in place.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<u16>,
        weight: &CudaSlice<u16>,
        state: &mut CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        batch: usize,
        channels: usize,
    ) -> Result<(), CudaError> {
        let k = self.kernel;
        self.check_common(weight, channels)?;
        expect_len("x", x.len(), batch * channels)?;
        expect_len("out", out.len(), batch * channels)?;
        expect_len("state", state.len(), batch * channels * (k - 1))?;
        if batch == 0 || channels == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (channels.div_ceil(THREADS) as u32, batch as u32, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let c_i = channels as i32;
        let mut launch = dev.stream().launch_builder(&self.update);
        launch.arg(x).arg(weight).arg(state).arg(out).arg(&c_i);
        // SAFETY: the argument list matches `conv_update_bf16`; sizes checked above.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    fn check_common(&self, weight: &CudaSlice<u16>, channels: usize) -> Result<(), CudaError> {
        if channels > i32::MAX as usize {
            return Err(shape_err(format!("{channels} channels")));
        }
        expect_len("weight", weight.len(), channels * self.kernel)
    }
}
