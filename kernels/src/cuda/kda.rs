//! KDA on CUDA: chunked prefill (`kda_chunk_prep` + `kda_chunk_scan`) and the decode step.
//! Semantics are those of [`crate::cpu::kda_recurrent`], with the L2 normalisation of q and k
//! done in the kernel (`l2norm`), bf16 q/k/v/β/o, f32 g and f32 state; see `kda.cu`.
//!
//! The prefill takes packed sequences of any lengths ([`KdaPacked`], the model's form: device
//! addresses, row strides and [`KdaSequenceTables`] on the device); [`KdaKernels::prefill`] is
//! the same call for a uniform batch in slices.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::kda_segmented::{KdaSegmentedPrefill, Segmentation};
use super::kda_tma::{KdaScanTma, TmaProducts};
use super::kda_workspace::KdaPrefillWorkspace;
use super::launch::allow_dynamic_smem;
use super::model_ops::{base_ptr, launch_fn_on, Arg, DevPtr, SegState};
use super::{CudaDevice, CudaError, KDA_SCAN_SM90_SOURCE};
use crate::gpu::{
    kda_check_config, kda_defines, kda_scan_stages, kda_smem_bytes, KdaShape, CHUNK, KDA_SOURCE,
};

/// The compiled KDA kernels for one (dk, dv, V-tile) configuration.
pub struct KdaKernels {
    prep: CudaFunction,
    scan: CudaFunction,
    /// The scan on warpgroup MMAs (`kda_scan_sm90.cu`), compiled when first chosen.
    scan_wg: Option<CudaFunction>,
    /// The scan fed by the copy engine (`kda_scan_tma.cu`), compiled when first chosen.
    scan_tma: Option<KdaScanTma>,
    /// The same on warpgroup MMAs (`kda_scan_tma_wg.cu`), compiled when first chosen.
    scan_tma_wg: Option<KdaScanTma>,
    /// The same with the left operands in registers (`kda_scan_tma_rs.cu`), compiled when first
    /// chosen.
    scan_tma_rs: Option<KdaScanTma>,
    scan_kind: KdaScanKind,
    /// The `-D` macros the kernels were built with (the warpgroup scan takes the same).
    defines: Vec<(String, String)>,
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
    /// When a prefill of one sequence goes in segments, and their scans' stream.
    pub(super) segmentation: Segmentation,
}

/// Which kernel walks the chunks of a prefill (all compute the same; see benches/RESULTS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaScanKind {
    /// mma.sync products, operands copied by the threads (`kda_chunk_scan`; every device).
    Threads,
    /// Warpgroup MMAs (`kda_scan_sm90.cu`; Hopper, dk = 128).
    Warpgroup,
    /// mma.sync products, operands brought by the copy engine (Hopper, dk = 128, V tiles of 32).
    CopyEngine,
    /// Warpgroup MMAs with both operands in shared memory, brought by the copy engine, a
    /// warpgroup for the state and one for the outputs (Hopper, dk = 128, V tiles of 32; the
    /// default where it can be built).
    CopyEngineWarpgroup,
    /// Warpgroup MMAs with the state held transposed so that every left operand comes from
    /// registers, one warpgroup per 64 value columns (two a block with `CR_WG=2`), brought by the
    /// copy engine (Hopper, dk = 128).
    CopyEngineRegisters,
}

impl KdaScanKind {
    /// The kind `TESSERA_KDA_SCAN` names (`threads`, `wg`, `tma`, `tma_wg`, `tma_rs`), if any.
    fn from_env() -> Option<Self> {
        match std::env::var("TESSERA_KDA_SCAN").ok()?.as_str() {
            "threads" => Some(Self::Threads),
            "wg" => Some(Self::Warpgroup),
            "tma" => Some(Self::CopyEngine),
            "tma_wg" => Some(Self::CopyEngineWarpgroup),
            "tma_rs" => Some(Self::CopyEngineRegisters),
            _ => None,
        }
    }
}

/// Value columns per block of the warpgroup scan (the M of its products).
const WG_SCAN_COLUMNS: usize = 64;

/// Dynamic shared memory of `kda_chunk_scan_wg`; mirrors the `G_*` macros of `kda_scan_sm90.cu`.
fn wg_scan_smem(dk: usize, stages: usize) -> u32 {
    let (ch, uld) = (CHUNK, WG_SCAN_COLUMNS + 8);
    let stage = 3 * ch * dk * 2 + ch * ch * 2 + ch * uld * 2 + dk * 4;
    (stages * stage + ch * uld * 2) as u32
}

/// Whether a Hopper scan of `columns` value columns per block can be built: on `sm_90`, with
/// dk = 128, dv a multiple of `columns`, and not with the portable helpers.
pub(super) fn hopper_scan_available(
    arch: &str,
    dk: usize,
    dv: usize,
    columns: usize,
    defines: &[(&str, String)],
) -> bool {
    let plain = defines.iter().any(|(k, _)| *k == "TESSERA_PLAIN_HELPERS");
    arch == "sm_90" && dk == 128 && dv.is_multiple_of(columns) && !plain
}

/// One chunked prefill over packed sequences, by device address (the caller owns the extents).
/// Token row `t` of the call holds q at `q + t·ld_qk + h·dk`, k at `k + t·ld_qk + h·dk`, v at
/// `v + t·ld_v + h·dv` (bf16; rows of ld elements, multiples of 8), g at `g + (t·heads + h)·dk`
/// (f32), β at `beta + t·heads + h` (bf16), and receives o at `out + t·ld_o + h·dv` (bf16).
/// `seq_start` and `chunk_start` are the [`crate::gpu::KdaSequenceTables`] (i32, `sequences + 1`
/// each); sequence `s`'s state is read from and written to where `state` says (its `src` may
/// be 0: zeros).
#[derive(Clone, Copy, Debug)]
pub struct KdaPacked {
    pub q: DevPtr,
    pub k: DevPtr,
    pub ld_qk: usize,
    pub v: DevPtr,
    pub ld_v: usize,
    pub g: DevPtr,
    pub beta: DevPtr,
    pub out: DevPtr,
    pub ld_o: usize,
    pub seq_start: DevPtr,
    pub chunk_start: DevPtr,
    pub sequences: usize,
    pub chunks: usize,
    pub heads: usize,
    pub state: SegState,
    pub scale: f32,
    pub l2norm: bool,
}

/// Inputs of one KDA call (device slices in the layouts of `kda.cu`).
pub struct KdaInputs<'a> {
    pub q: &'a CudaSlice<u16>,
    pub k: &'a CudaSlice<u16>,
    pub v: &'a CudaSlice<u16>,
    pub g: &'a CudaSlice<f32>,
    pub beta: &'a CudaSlice<u16>,
}

/// A uniform batch of `shape` as a packed call of `chunks` chunks: inputs `x` (none: zero
/// addresses, for a scan alone), `(scale, l2norm)`, `(src, dst, out)` the initial state (0:
/// zeros), the final state and o, and `(seq_start, chunk_start, state_off)` the device tables.
pub(super) fn uniform_call(
    dev: &CudaDevice,
    shape: KdaShape,
    x: Option<&KdaInputs>,
    (scale, l2norm): (f32, bool),
    (src, dst, out): (DevPtr, DevPtr, DevPtr),
    (seq_start, chunk_start, state_off): (DevPtr, DevPtr, DevPtr),
    chunks: usize,
) -> KdaPacked {
    let s = dev.stream();
    let p = |b: Option<DevPtr>| b.unwrap_or(0);
    KdaPacked {
        q: p(x.map(|x| base_ptr(s, x.q))),
        k: p(x.map(|x| base_ptr(s, x.k))),
        ld_qk: shape.heads * shape.dk,
        v: p(x.map(|x| base_ptr(s, x.v))),
        ld_v: shape.heads * shape.dv,
        g: p(x.map(|x| base_ptr(s, x.g))),
        beta: p(x.map(|x| base_ptr(s, x.beta))),
        out,
        ld_o: shape.heads * shape.dv,
        seq_start,
        chunk_start,
        sequences: shape.batch,
        chunks,
        heads: shape.heads,
        state: SegState {
            src,
            dst,
            src_off: state_off,
            dst_off: state_off,
        },
        scale,
        l2norm,
    }
}

pub(super) fn shape_err(msg: String) -> CudaError {
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
        allow_dynamic_smem(&prep, prep_smem as usize)?;
        allow_dynamic_smem(&scan, scan_smem as usize)?;
        let mut k = KdaKernels {
            prep,
            scan,
            scan_wg: None,
            scan_tma: None,
            scan_tma_wg: None,
            scan_tma_rs: None,
            scan_kind: KdaScanKind::Threads,
            scan_wg_smem: wg_scan_smem(dk, kda_scan_stages(extra, "WG_SCAN_STAGES")),
            defines: defines
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
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
            segmentation: Segmentation::from_env(),
        };
        // The copy-engine scan with register operands where it can be built, else the one on
        // warpgroup MMAs (both Hopper; see benches/RESULTS.md), else the mma.sync scan.
        match KdaScanKind::from_env() {
            Some(kind) => {
                k.set_scan(dev, kind)?;
            }
            None => {
                for kind in [
                    KdaScanKind::CopyEngineRegisters,
                    KdaScanKind::CopyEngineWarpgroup,
                ] {
                    if k.set_scan(dev, kind)? == kind {
                        break;
                    }
                }
            }
        }
        Ok(k)
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

    /// The inputs and outputs of a uniform prefill against its shape.
    pub(super) fn check_call(
        &self,
        shape: &KdaShape,
        x: &KdaInputs,
        initial: Option<&CudaSlice<f32>>,
        final_state: &CudaSlice<f32>,
        out: &CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.check(shape, x)?;
        if final_state.len() != shape.state_len() || out.len() != shape.v_len() {
            return Err(shape_err("output sizes do not match the shape".into()));
        }
        if initial.is_some_and(|s| s.len() != shape.state_len()) {
            return Err(shape_err(
                "initial state size does not match the shape".into(),
            ));
        }
        Ok(())
    }

    /// Head dims the kernels were built for (k, v).
    pub(super) fn dk(&self) -> usize {
        self.dk
    }

    pub(super) fn dv(&self) -> usize {
        self.dv
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
        self.check_call(&shape, x, initial, final_state, out)?;
        ws.batch_for(&shape)?;
        if shape.seq_len == 0 {
            return Ok(());
        }
        let segments = self.segments_for(shape.batch, shape.chunks());
        if segments > 1 {
            if ws.segmented.as_ref().map(|g| g.segments()) != Some(segments) {
                ws.segmented = Some(KdaSegmentedPrefill::new(
                    dev,
                    self,
                    shape.seq_len,
                    shape.heads,
                    segments,
                )?);
            }
            let seg = ws.segmented.as_ref().expect("made above");
            return self.prefill_segmented(
                dev,
                shape,
                x,
                scale,
                l2norm,
                initial,
                final_state,
                out,
                seg,
            );
        }
        let s = dev.stream();
        let src = initial.map_or(0, |i| base_ptr(s, i));
        let (dst, o) = (base_ptr(s, final_state), base_ptr(s, out));
        let p = self.batch_call(dev, shape, Some(x), scale, l2norm, (src, dst, o), ws)?;
        self.launch_prep_on(dev, dev.stream(), &p, ws)?;
        self.launch_scan_on(dev, dev.stream(), &p, ws)
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
        let p = self.batch_call(dev, shape, Some(x), scale, l2norm, (0, 0, 0), ws)?;
        self.launch_prep_on(dev, dev.stream(), &p, ws)
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
        let s = dev.stream();
        let src = initial.map_or(0, |i| base_ptr(s, i));
        let (dst, o) = (base_ptr(s, final_state), base_ptr(s, out));
        let p = self.batch_call(dev, shape, None, 0.0, false, (src, dst, o), ws)?;
        self.launch_scan_on(dev, dev.stream(), &p, ws)
    }

    /// A uniform batch as a packed call (the workspace holds its tables); `(src, dst, out)`:
    /// the initial state (0: zeros), the final state and o.
    #[allow(clippy::too_many_arguments)]
    fn batch_call(
        &self,
        dev: &CudaDevice,
        shape: KdaShape,
        x: Option<&KdaInputs>,
        scale: f32,
        l2norm: bool,
        (src, dst, out): (DevPtr, DevPtr, DevPtr),
        ws: &KdaPrefillWorkspace,
    ) -> Result<KdaPacked, CudaError> {
        let t = ws.batch_for(&shape)?;
        let s = dev.stream();
        let tables = (
            base_ptr(s, &t.seq_start),
            base_ptr(s, &t.chunk_start),
            base_ptr(s, &t.state_off),
        );
        Ok(uniform_call(
            dev,
            shape,
            x,
            (scale, l2norm),
            (src, dst, out),
            tables,
            ws.chunks,
        ))
    }

    /// Chunked prefill over packed sequences (see [`KdaPacked`]); `ws` must hold at least
    /// `p.chunks` chunks of `p.heads` heads.
    pub fn prefill_packed(
        &self,
        dev: &CudaDevice,
        p: &KdaPacked,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        if p.chunks > ws.chunks || p.heads != ws.heads || ws.dk != self.dk || ws.dv != self.dv {
            return Err(shape_err(format!(
                "workspace of {} chunks x {} heads (dk {}, dv {}) for a call of {} x {} (dk {}, dv {})",
                ws.chunks, ws.heads, ws.dk, ws.dv, p.chunks, p.heads, self.dk, self.dv
            )));
        }
        if [p.ld_qk, p.ld_v, p.ld_o].iter().any(|l| l % 8 != 0) {
            return Err(shape_err(format!(
                "row strides {} / {} / {} are not multiples of 8 elements",
                p.ld_qk, p.ld_v, p.ld_o
            )));
        }
        if p.sequences == 0 || p.chunks == 0 {
            return Ok(());
        }
        self.launch_prep_on(dev, dev.stream(), p, ws)?;
        self.launch_scan_on(dev, dev.stream(), p, ws)
    }

    /// The prep of a call on `stream` (arguments unchecked).
    pub(super) fn launch_prep_on(
        &self,
        dev: &CudaDevice,
        stream: &CudaStream,
        p: &KdaPacked,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (p.chunks as u32, p.heads as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: self.prep_smem,
        };
        let mut args = vec![
            Arg::P(p.q),
            Arg::P(p.k),
            Arg::P(p.v),
            Arg::P(p.g),
            Arg::P(p.beta),
            Arg::I(p.ld_qk as i32),
            Arg::I(p.ld_v as i32),
            Arg::P(p.seq_start),
            Arg::P(p.chunk_start),
            Arg::I(p.sequences as i32),
            Arg::I(p.heads as i32),
            Arg::F(p.scale),
            Arg::I(p.l2norm as i32),
        ];
        args.extend(ws.products(dev));
        // SAFETY: kda_chunk_prep's parameters in order; the workspace holds p.chunks x p.heads
        // chunks (checked by the callers) and the caller owns the input extents.
        unsafe { launch_fn_on(stream, &self.prep, cfg, &args) }
    }

    /// The scan of a call on `stream`, after the prep that filled `ws` (arguments unchecked).
    pub(super) fn launch_scan_on(
        &self,
        dev: &CudaDevice,
        stream: &CudaStream,
        p: &KdaPacked,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        let copy_engine = match self.scan_kind {
            KdaScanKind::CopyEngine => self.scan_tma.as_ref(),
            KdaScanKind::CopyEngineWarpgroup => self.scan_tma_wg.as_ref(),
            KdaScanKind::CopyEngineRegisters => self.scan_tma_rs.as_ref(),
            _ => None,
        };
        if let Some(k) = copy_engine {
            return k.launch(dev, stream, p, ws);
        }
        let (f, columns, threads, smem) = match (&self.scan_wg, self.scan_kind) {
            (Some(f), KdaScanKind::Warpgroup) => (f, WG_SCAN_COLUMNS, 128, self.scan_wg_smem),
            _ => (
                &self.scan,
                self.v_tile,
                128 * (self.v_tile / 32) as u32,
                self.scan_smem,
            ),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                (self.dv / columns) as u32,
                p.heads as u32,
                p.sequences as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut args = Vec::from(ws.products(dev));
        args.extend([
            Arg::P(p.state.src),
            Arg::P(p.state.src_off),
            Arg::P(p.state.dst),
            Arg::P(p.state.dst_off),
            Arg::P(p.out),
            Arg::I(p.ld_o as i32),
            Arg::P(p.seq_start),
            Arg::P(p.chunk_start),
            Arg::I(p.chunks as i32),
        ]);
        // SAFETY: the parameters of kda_chunk_scan and kda_chunk_scan_wg (the same) in order;
        // the workspace was filled by the prep of the same call.
        unsafe { launch_fn_on(stream, f, cfg, &args) }
    }

    /// Chooses the kernel that walks the chunks, compiling it on first use where it can be built;
    /// returns the kind now in use ([`KdaScanKind::Threads`] where the one asked for cannot be).
    pub fn set_scan(
        &mut self,
        dev: &CudaDevice,
        kind: KdaScanKind,
    ) -> Result<KdaScanKind, CudaError> {
        let defines: Vec<(&str, String)> = self
            .defines
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let ok = match kind {
            KdaScanKind::Threads => true,
            KdaScanKind::Warpgroup => {
                if self.scan_wg.is_none()
                    && hopper_scan_available(
                        dev.arch(),
                        self.dk,
                        self.dv,
                        WG_SCAN_COLUMNS,
                        &defines,
                    )
                {
                    let f = dev
                        .module_for("sm_90a", "kda_scan_sm90", KDA_SCAN_SM90_SOURCE, &defines)?
                        .load_function("kda_chunk_scan_wg")?;
                    allow_dynamic_smem(&f, self.scan_wg_smem as usize)?;
                    self.scan_wg = Some(f);
                }
                self.scan_wg.is_some()
            }
            KdaScanKind::CopyEngine
            | KdaScanKind::CopyEngineWarpgroup
            | KdaScanKind::CopyEngineRegisters => {
                let (slot, products, columns) = match kind {
                    KdaScanKind::CopyEngine => {
                        (&mut self.scan_tma, TmaProducts::Warps, KdaScanTma::COLUMNS)
                    }
                    KdaScanKind::CopyEngineWarpgroup => (
                        &mut self.scan_tma_wg,
                        TmaProducts::Warpgroups,
                        KdaScanTma::COLUMNS,
                    ),
                    _ => (
                        &mut self.scan_tma_rs,
                        TmaProducts::Registers,
                        KdaScanTma::rs_block_columns(&defines),
                    ),
                };
                if slot.is_none()
                    && hopper_scan_available(dev.arch(), self.dk, self.dv, columns, &defines)
                {
                    *slot = Some(KdaScanTma::load(dev, &defines, products)?);
                }
                slot.is_some()
            }
        };
        self.scan_kind = if ok { kind } else { KdaScanKind::Threads };
        Ok(self.scan_kind)
    }

    /// Chooses the scan on warpgroup MMAs (where it can be built: Hopper, dk = 128; compiled on
    /// first use) or the mma.sync scan; returns whether the warpgroup scan is now in use.
    pub fn set_scan_warpgroup(&mut self, dev: &CudaDevice, on: bool) -> Result<bool, CudaError> {
        let want = if on {
            KdaScanKind::Warpgroup
        } else {
            KdaScanKind::Threads
        };
        Ok(self.set_scan(dev, want)? == KdaScanKind::Warpgroup)
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
