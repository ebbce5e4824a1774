//! KDA on CUDA: chunked prefill (`kda_chunk_prep` + `kda_chunk_scan`) and the decode step.
//! Semantics are those of [`crate::cpu::kda_recurrent`], with the L2 normalisation of q and k
//! done in the kernel (`l2norm`), bf16 q/k/v/β/o, f32 g and f32 state; see `kda.cu`.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaError, KDA_SCAN_SM90_SOURCE};
use crate::gpu::{
    kda_check_config, kda_defines, kda_scan_stages, kda_smem_bytes, KdaShape, CHUNK, KDA_SOURCE,
};

/// The compiled KDA kernels for one (dk, dv, V-tile) configuration.
pub struct KdaKernels {
    prep: CudaFunction,
    scan: CudaFunction,
    /// The scan on warpgroup MMAs (`kda_scan_sm90.cu`), where the device and head dims allow it.
    scan_wg: Option<CudaFunction>,
    use_scan_wg: bool,
    decode: CudaFunction,
    decode_occ3: CudaFunction,
    decode_split2: CudaFunction,
    use_occ3: bool,
    use_split2: bool,
    dk: usize,
    dv: usize,
    v_tile: usize,
    prep_smem: u32,
    scan_smem: u32,
    scan_wg_smem: u32,
}

/// Value columns per block of the warpgroup scan (the M of its products).
const WG_SCAN_COLUMNS: usize = 64;

/// Dynamic shared memory of `kda_chunk_scan_wg`; mirrors the `G_*` macros of `kda_scan_sm90.cu`.
fn wg_scan_smem(dk: usize, stages: usize) -> u32 {
    let (ch, uld) = (CHUNK, WG_SCAN_COLUMNS + 8);
    let stage = 3 * ch * dk * 2 + ch * ch * 2 + ch * uld * 2 + dk * 4;
    (stages * stage + ch * uld * 2) as u32
}

/// Whether the warpgroup scan can be built: on Hopper (`sm_90`) with dk = 128.
fn wg_scan_available(arch: &str, dk: usize, dv: usize, extra: &[(&str, String)]) -> bool {
    let plain = extra.iter().any(|(k, _)| *k == "TESSERA_PLAIN_HELPERS");
    arch == "sm_90" && dk == 128 && dv.is_multiple_of(WG_SCAN_COLUMNS) && !plain
}

/// Whether the warpgroup scan is the default: only when `TESSERA_KDA_SCAN=wg` asks for it (it
/// matches the mma.sync scan at 64-column tiles when many sequences fill the GPU, and is slower
/// than 32-column tiles when few do; see benches/RESULTS.md).
fn wg_scan_requested() -> bool {
    std::env::var("TESSERA_KDA_SCAN").is_ok_and(|v| v == "wg")
}

/// Scratch of the chunked prefill, sized for one shape (reuse it across calls of that shape).
pub struct KdaPrefillWorkspace {
    shape: KdaShape,
    w: CudaSlice<u16>,
    u: CudaSlice<u16>,
    qg: CudaSlice<u16>,
    kg: CudaSlice<u16>,
    aqk: CudaSlice<u16>,
    egl: CudaSlice<f32>,
}

impl KdaPrefillWorkspace {
    pub fn new(dev: &CudaDevice, shape: KdaShape) -> Result<Self, CudaError> {
        let n = shape.batch * shape.heads * shape.chunks();
        let s = dev.stream();
        Ok(KdaPrefillWorkspace {
            shape,
            w: s.alloc_zeros(n * CHUNK * shape.dk)?,
            u: s.alloc_zeros(n * CHUNK * shape.dv)?,
            qg: s.alloc_zeros(n * CHUNK * shape.dk)?,
            kg: s.alloc_zeros(n * CHUNK * shape.dk)?,
            aqk: s.alloc_zeros(n * CHUNK * CHUNK)?,
            egl: s.alloc_zeros(n * shape.dk)?,
        })
    }

    /// Device bytes this workspace holds.
    pub fn bytes(&self) -> usize {
        2 * (self.w.len() + self.u.len() + self.qg.len() + self.kg.len() + self.aqk.len())
            + 4 * self.egl.len()
    }
}

/// Inputs of one KDA call (device slices in the layouts of `kda.cu`).
pub struct KdaInputs<'a> {
    pub q: &'a CudaSlice<u16>,
    pub k: &'a CudaSlice<u16>,
    pub v: &'a CudaSlice<u16>,
    pub g: &'a CudaSlice<f32>,
    pub beta: &'a CudaSlice<u16>,
}

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(format!("kda: {msg}"))
}

impl KdaKernels {
    /// Compiles the kernels for head dims `dk`, `dv` and a V tile of `v_tile` columns (32 or 64)
    /// per scan block: one warp group per 32 columns, so 64 halves the chunk data each group
    /// stages, at half the blocks in flight.
    pub fn load(dev: &CudaDevice, dk: usize, dv: usize, v_tile: usize) -> Result<Self, CudaError> {
        Self::load_with(dev, dk, dv, v_tile, &[])
    }

    /// [`Self::load`] with extra `-D` macros (benchmarks use the timing aids of `kda.cu`).
    pub fn load_with(
        dev: &CudaDevice,
        dk: usize,
        dv: usize,
        v_tile: usize,
        extra: &[(&str, String)],
    ) -> Result<Self, CudaError> {
        kda_check_config(dk, dv, v_tile).map_err(CudaError::Shape)?;
        let mut defines = kda_defines(dk, dv, v_tile).to_vec();
        defines.extend(extra.iter().cloned());
        let module = dev.module("kda", KDA_SOURCE, &defines)?;
        let prep = module.load_function("kda_chunk_prep")?;
        let scan = module.load_function("kda_chunk_scan")?;
        let decode = module.load_function("kda_decode")?;
        let decode_occ3 = module.load_function("kda_decode_occ3")?;
        let decode_split2 = module.load_function("kda_decode_split2")?;
        let (prep_smem, scan_smem) =
            kda_smem_bytes(dk, dv, v_tile, kda_scan_stages(extra, "SCAN_STAGES"));
        let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        prep.set_attribute(attr, prep_smem as i32)?;
        scan.set_attribute(attr, scan_smem as i32)?;
        let scan_wg_smem = wg_scan_smem(dk, kda_scan_stages(extra, "WG_SCAN_STAGES"));
        let scan_wg = if wg_scan_available(dev.arch(), dk, dv, extra) {
            let f = dev
                .module_for("sm_90a", "kda_scan_sm90", KDA_SCAN_SM90_SOURCE, &defines)?
                .load_function("kda_chunk_scan_wg")?;
            f.set_attribute(attr, scan_wg_smem as i32)?;
            Some(f)
        } else {
            None
        };
        Ok(KdaKernels {
            prep,
            scan,
            use_scan_wg: scan_wg.is_some() && wg_scan_requested(),
            scan_wg,
            scan_wg_smem,
            decode,
            decode_occ3,
            decode_split2,
            use_occ3: false,
            use_split2: true,
            dk,
            dv,
            v_tile,
            prep_smem,
            scan_smem,
        })
    }

    fn check(&self, shape: &KdaShape, x: &KdaInputs) -> Result<(), CudaError> {
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
        dev: &CudaDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        initial: Option<&CudaSlice<f32>>,
        final_state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        ws: &mut KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
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
        if shape.seq_len == 0 {
            return Ok(());
        }
        self.prep(dev, shape, x, scale, l2norm, ws)?;
        self.scan(dev, shape, initial, final_state, out, ws)
    }

    /// The parallel half of [`Self::prefill`]: per-chunk products into `ws` (arguments unchecked;
    /// public for timing the stages separately).
    pub fn prep(
        &self,
        dev: &CudaDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        ws: &mut KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        let (t, h) = (shape.seq_len as i32, shape.heads as i32);
        let prep_cfg = LaunchConfig {
            grid_dim: (
                shape.chunks() as u32,
                shape.heads as u32,
                shape.batch as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: self.prep_smem,
        };
        let l2 = l2norm as i32;
        // SAFETY: argument types and order match kda_chunk_prep; `prefill` checks the sizes.
        unsafe {
            dev.stream()
                .launch_builder(&self.prep)
                .arg(x.q)
                .arg(x.k)
                .arg(x.v)
                .arg(x.g)
                .arg(x.beta)
                .arg(&t)
                .arg(&h)
                .arg(&scale)
                .arg(&l2)
                .arg(&mut ws.w)
                .arg(&mut ws.u)
                .arg(&mut ws.qg)
                .arg(&mut ws.kg)
                .arg(&mut ws.aqk)
                .arg(&mut ws.egl)
                .launch(prep_cfg)?;
        }
        Ok(())
    }

    /// The sequential half of [`Self::prefill`]: the state walks the chunks prepared in `ws`.
    pub fn scan(
        &self,
        dev: &CudaDevice,
        shape: KdaShape,
        initial: Option<&CudaSlice<f32>>,
        final_state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        let (t, h) = (shape.seq_len as i32, shape.heads as i32);
        let (f, columns, threads, smem) = match (&self.scan_wg, self.use_scan_wg) {
            (Some(f), true) => (f, WG_SCAN_COLUMNS, 128, self.scan_wg_smem),
            _ => (
                &self.scan,
                self.v_tile,
                128 * (self.v_tile / 32) as u32,
                self.scan_smem,
            ),
        };
        let scan_cfg = LaunchConfig {
            grid_dim: (
                (shape.dv / columns) as u32,
                shape.heads as u32,
                shape.batch as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let null: u64 = 0;
        // SAFETY: argument types and order match kda_chunk_scan and kda_chunk_scan_wg (the
        // same parameters); `prefill` checks the sizes.
        unsafe {
            let mut launch = dev.stream().launch_builder(f);
            launch
                .arg(&ws.w)
                .arg(&ws.u)
                .arg(&ws.qg)
                .arg(&ws.kg)
                .arg(&ws.aqk)
                .arg(&ws.egl);
            match initial {
                Some(s) => launch.arg(s),
                None => launch.arg(&null),
            };
            launch
                .arg(final_state)
                .arg(out)
                .arg(&t)
                .arg(&h)
                .launch(scan_cfg)?;
        }
        Ok(())
    }

    /// Chooses the scan on warpgroup MMAs (when it was built: Hopper, dk = 128) or the
    /// mma.sync scan; returns whether the warpgroup scan is now in use.
    pub fn set_scan_warpgroup(&mut self, on: bool) -> bool {
        self.use_scan_wg = on && self.scan_wg.is_some();
        self.use_scan_wg
    }

    /// Chooses the decode kernel built for three resident blocks per multiprocessor (fewer
    /// registers) instead of two.
    pub fn set_decode_three_blocks_per_sm(&mut self, on: bool) {
        self.use_occ3 = on;
    }

    /// Chooses the decode kernel that splits each (sequence, head) state over two blocks of 64
    /// value columns (128 threads each; the default) instead of one block of 256 threads.
    pub fn set_decode_split_columns(&mut self, on: bool) {
        self.use_split2 = on;
    }

    /// One decode step for `shape.batch` sequences (seq_len 1): `state` [B, H, DK, DV] is read
    /// and updated in place, `out` receives o [B, H, DV].
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        dev: &CudaDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
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
        let (split, threads, f) = match (self.use_split2, self.use_occ3) {
            (true, _) => (2, 128, &self.decode_split2),
            (false, true) => (1, 256, &self.decode_occ3),
            (false, false) => (1, 256, &self.decode),
        };
        let cfg = LaunchConfig {
            grid_dim: ((shape.batch * shape.heads * split) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let l2 = l2norm as i32;
        // SAFETY: argument types and order match kda_decode*; sizes were checked above.
        unsafe {
            dev.stream()
                .launch_builder(f)
                .arg(x.q)
                .arg(x.k)
                .arg(x.v)
                .arg(x.g)
                .arg(x.beta)
                .arg(state)
                .arg(out)
                .arg(&scale)
                .arg(&l2)
                .launch(cfg)?;
        }
        Ok(())
    }
}
