//! KDA on HIP: the kernels of `kda.cu` (shared with CUDA), with the entry points of
//! [`crate::cuda::KdaKernels`]: chunked prefill (`kda_chunk_prep` + `kda_chunk_scan`) and the
//! decode step. Semantics are those of [`crate::cpu::kda_recurrent`].
//!
//! The prefill kernels keep whole 64-token chunks in shared memory (LDS): for `dk = 128`,
//! 109.5 KiB (prep) and 146 KiB (scan, V tile 32, two stages; 167 KiB with V tile 64). That is
//! more than the 64 KiB per block of CDNA2/CDNA3 (gfx90a, gfx942) and fits the 160 KiB of CDNA4
//! (gfx950) with V tile 32. Where it does not fit, `prefill` returns an error naming the sizes;
//! decode needs 6 KiB and fits everywhere.

use super::{HipBuffer, HipDevice, HipError, HipFunction, KernelArgs, LaunchConfig};
use crate::gpu::{
    kda_check_config, kda_defines, kda_scan_stages, kda_smem_bytes, KdaShape, CHUNK, KDA_SOURCE,
};

/// The compiled KDA kernels for one (dk, dv, V-tile) configuration.
pub struct KdaKernels {
    prep: HipFunction,
    scan: HipFunction,
    decode: HipFunction,
    decode_occ3: HipFunction,
    use_occ3: bool,
    dk: usize,
    dv: usize,
    v_tile: usize,
    prep_smem: u32,
    scan_smem: u32,
    max_smem: usize,
    arch: String,
}

/// Scratch of the chunked prefill, sized for one shape (reuse it across calls of that shape).
pub struct KdaPrefillWorkspace {
    shape: KdaShape,
    w: HipBuffer<u16>,
    u: HipBuffer<u16>,
    qg: HipBuffer<u16>,
    kg: HipBuffer<u16>,
    aqk: HipBuffer<u16>,
    egl: HipBuffer<f32>,
    /// The batch's sequence tables (`kda.cu` takes packed sequences; a batch is one case).
    seq_start: HipBuffer<i32>,
    chunk_start: HipBuffer<i32>,
    state_off: HipBuffer<i64>,
}

impl KdaPrefillWorkspace {
    pub fn new(dev: &HipDevice, shape: KdaShape) -> Result<Self, HipError> {
        let n = shape.batch * shape.heads * shape.chunks();
        let tables = shape.tables();
        Ok(KdaPrefillWorkspace {
            shape,
            seq_start: dev.upload(&tables.seq_start)?,
            chunk_start: dev.upload(&tables.chunk_start)?,
            state_off: dev.upload(&tables.state_off)?,
            w: dev.alloc_zeros(n * CHUNK * shape.dk)?,
            u: dev.alloc_zeros(n * CHUNK * shape.dv)?,
            qg: dev.alloc_zeros(n * CHUNK * shape.dk)?,
            kg: dev.alloc_zeros(n * CHUNK * shape.dk)?,
            aqk: dev.alloc_zeros(n * CHUNK * CHUNK)?,
            egl: dev.alloc_zeros(n * shape.dk)?,
        })
    }

    /// Device bytes this workspace holds.
    pub fn bytes(&self) -> usize {
        self.w.bytes()
            + self.u.bytes()
            + self.qg.bytes()
            + self.kg.bytes()
            + self.aqk.bytes()
            + self.egl.bytes()
    }
}

/// Inputs of one KDA call (device buffers in the layouts of `kda.cu`).
pub struct KdaInputs<'a> {
    pub q: &'a HipBuffer<u16>,
    pub k: &'a HipBuffer<u16>,
    pub v: &'a HipBuffer<u16>,
    pub g: &'a HipBuffer<f32>,
    pub beta: &'a HipBuffer<u16>,
}

fn shape_err(msg: String) -> HipError {
    HipError::Shape(format!("kda: {msg}"))
}

impl KdaKernels {
    /// Compiles the kernels for head dims `dk`, `dv` and a V tile of `v_tile` columns (32 or 64)
    /// per scan block.
    pub fn load(dev: &HipDevice, dk: usize, dv: usize, v_tile: usize) -> Result<Self, HipError> {
        Self::load_with(dev, dk, dv, v_tile, &[])
    }

    /// [`Self::load`] with extra `-D` macros (benchmarks use the timing aids of `kda.cu`).
    pub fn load_with(
        dev: &HipDevice,
        dk: usize,
        dv: usize,
        v_tile: usize,
        extra: &[(&str, String)],
    ) -> Result<Self, HipError> {
        kda_check_config(dk, dv, v_tile).map_err(HipError::Shape)?;
        let mut defines = kda_defines(dk, dv, v_tile).to_vec();
        defines.extend(extra.iter().cloned());
        let module = dev.module("kda", KDA_SOURCE, &defines)?;
        let (prep_smem, scan_smem) =
            kda_smem_bytes(dk, dv, v_tile, kda_scan_stages(extra, "SCAN_STAGES"));
        Ok(KdaKernels {
            prep: module.function("kda_chunk_prep")?,
            scan: module.function("kda_chunk_scan")?,
            decode: module.function("kda_decode")?,
            decode_occ3: module.function("kda_decode_occ3")?,
            use_occ3: false,
            dk,
            dv,
            v_tile,
            prep_smem,
            scan_smem,
            max_smem: dev.max_shared_per_block(),
            arch: dev.arch().to_string(),
        })
    }

    /// Whether the prefill kernels fit this device's shared memory (LDS) per block.
    pub fn prefill_fits(&self) -> bool {
        self.prep_smem.max(self.scan_smem) as usize <= self.max_smem
    }

    fn check_prefill_fits(&self) -> Result<(), HipError> {
        if self.prefill_fits() {
            return Ok(());
        }
        Err(shape_err(format!(
            "the prefill kernels for dk={}, V tile {} need {} and {} bytes of shared memory per \
             block; {} allows {}",
            self.dk, self.v_tile, self.prep_smem, self.scan_smem, self.arch, self.max_smem
        )))
    }

    fn check(&self, shape: &KdaShape, x: &KdaInputs) -> Result<(), HipError> {
        if shape.dk != self.dk || shape.dv != self.dv {
            return Err(shape_err(format!(
                "kernels built for dk={}, dv={} called with {shape:?}",
                self.dk, self.dv
            )));
        }
        let bth = shape.batch * shape.seq_len * shape.heads;
        for (name, len, want) in [
            ("q", x.q.len(), shape.qk_len()),
            ("k", x.k.len(), shape.qk_len()),
            ("g", x.g.len(), shape.qk_len()),
            ("v", x.v.len(), shape.v_len()),
            ("beta", x.beta.len(), bth),
        ] {
            if len != want {
                return Err(shape_err(format!(
                    "{name} has {len} elements, {shape:?} needs {want}"
                )));
            }
        }
        Ok(())
    }

    /// Chunked prefill over `batch` sequences of `seq_len` tokens. `initial` (or zeros) is the
    /// state before the first token; `final_state` receives the state after the last; `out`
    /// receives o [B, T, H, DV].
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        dev: &HipDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        initial: Option<&HipBuffer<f32>>,
        final_state: &mut HipBuffer<f32>,
        out: &mut HipBuffer<u16>,
        ws: &mut KdaPrefillWorkspace,
    ) -> Result<(), HipError> {
        self.check(&shape, x)?;
        if ws.shape != shape {
            return Err(shape_err(format!(
                "workspace is for {:?}, call is {shape:?}",
                ws.shape
            )));
        }
        if final_state.len() != shape.state_len() || out.len() != shape.v_len() {
            return Err(shape_err("output sizes do not match the shape".into()));
        }
        if let Some(s) = initial {
            if s.len() != shape.state_len() {
                return Err(shape_err(
                    "initial state size does not match the shape".into(),
                ));
            }
        }
        self.check_prefill_fits()?;
        if shape.seq_len == 0 {
            return Ok(());
        }
        self.prep(dev, shape, x, scale, l2norm, ws)?;
        self.scan(dev, shape, initial, final_state, out, ws)
    }

    /// The parallel half of [`Self::prefill`]: per-chunk products into `ws` (arguments unchecked
    /// apart from the shared-memory limit; public for timing the stages separately).
    pub fn prep(
        &self,
        dev: &HipDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        ws: &mut KdaPrefillWorkspace,
    ) -> Result<(), HipError> {
        self.check_prefill_fits()?;
        let cfg = LaunchConfig {
            grid_dim: ((shape.batch * shape.chunks()) as u32, shape.heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: self.prep_smem,
        };
        let mut args = KernelArgs::new();
        args.buffer(x.q)
            .buffer(x.k)
            .buffer(x.v)
            .buffer(x.g)
            .buffer(x.beta)
            .i32((shape.heads * shape.dk) as i32)
            .i32((shape.heads * shape.dv) as i32)
            .buffer(&ws.seq_start)
            .buffer(&ws.chunk_start)
            .i32(shape.batch as i32)
            .i32(shape.heads as i32)
            .f32(scale)
            .i32(l2norm as i32)
            .buffer(&ws.w)
            .buffer(&ws.u)
            .buffer(&ws.qg)
            .buffer(&ws.kg)
            .buffer(&ws.aqk)
            .buffer(&ws.egl);
        // SAFETY: argument types and order match kda_chunk_prep; `prefill` checks the sizes.
        unsafe { dev.stream().launch(&self.prep, cfg, &args) }
    }

    /// The sequential half of [`Self::prefill`]: the state walks the chunks prepared in `ws`.
    pub fn scan(
        &self,
        dev: &HipDevice,
        shape: KdaShape,
        initial: Option<&HipBuffer<f32>>,
        final_state: &mut HipBuffer<f32>,
        out: &mut HipBuffer<u16>,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), HipError> {
        self.check_prefill_fits()?;
        let cfg = LaunchConfig {
            grid_dim: (
                (shape.dv / self.v_tile) as u32,
                shape.heads as u32,
                shape.batch as u32,
            ),
            block_dim: (128 * (self.v_tile / 32) as u32, 1, 1),
            shared_mem_bytes: self.scan_smem,
        };
        let mut args = KernelArgs::new();
        args.buffer(&ws.w)
            .buffer(&ws.u)
            .buffer(&ws.qg)
            .buffer(&ws.kg)
            .buffer(&ws.aqk)
            .buffer(&ws.egl)
            .buffer_or_null(initial)
            .buffer(&ws.state_off)
            .buffer(final_state)
            .buffer(&ws.state_off)
            .buffer(out)
            .i32((shape.heads * shape.dv) as i32)
            .buffer(&ws.seq_start)
            .buffer(&ws.chunk_start)
            .i32((shape.batch * shape.chunks()) as i32);
        // SAFETY: argument types and order match kda_chunk_scan; `prefill` checks the sizes.
        unsafe { dev.stream().launch(&self.scan, cfg, &args) }
    }

    /// Chooses the decode kernel built for three resident blocks per multiprocessor instead of
    /// two.
    pub fn set_decode_three_blocks_per_sm(&mut self, on: bool) {
        self.use_occ3 = on;
    }

    /// One decode step for `shape.batch` sequences (seq_len 1): `state` [B, H, DK, DV] is read
    /// and updated in place, `out` receives o [B, H, DV].
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        dev: &HipDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        state: &mut HipBuffer<f32>,
        out: &mut HipBuffer<u16>,
    ) -> Result<(), HipError> {
        if shape.seq_len != 1 {
            return Err(shape_err(format!(
                "decode takes one token per sequence, got {shape:?}"
            )));
        }
        self.check(&shape, x)?;
        if state.len() != shape.state_len() || out.len() != shape.v_len() {
            return Err(shape_err(
                "state or output size does not match the shape".into(),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: ((shape.batch * shape.heads) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = KernelArgs::new();
        args.buffer(x.q)
            .buffer(x.k)
            .buffer(x.v)
            .buffer(x.g)
            .buffer(x.beta)
            .buffer(state)
            .buffer(out)
            .f32(scale)
            .i32(l2norm as i32);
        let f = if self.use_occ3 {
            &self.decode_occ3
        } else {
            &self.decode
        };
        // SAFETY: argument types and order match kda_decode; sizes were checked above.
        unsafe { dev.stream().launch(f, cfg, &args) }
    }
}
