//! MoE decode on CUDA (`moe.cu`) for batches of 1–64 tokens: sigmoid routing with the
//! correction bias, the per-step expert plan, gate+up+SiTU fused, the down projection and the
//! weighted combine; experts in bf16 or packed MXFP4 (dequantised in the kernels, w4a16).
//! Semantics: [`crate::cpu::route_sigmoid_grouped`] with one expert group, then per token
//! `Σ_slot w · W2 · situ(W1·x, W3·x)` — the routed part of the engine's (latent) MoE, whose `x`
//! is the latent after the down-projection.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::launch::RawLaunch;
use super::tensor_map::{self, TensorMapArg};
use super::{CudaDevice, CudaError, MOE_SOURCE};
use crate::cpu::MoeRouting;
use crate::gpu::define_value;

const WARPS: usize = 4;
const COLS_PER_WARP: usize = 2;
const COLS: usize = WARPS * COLS_PER_WARP;
/// Warps per block of the tensor-core projections; each owns 16 output rows of gate/up.
const TC_WARPS: usize = 4;
/// Row tiles of 16 a warp of the tensor-core down projection owns, bf16 and MXFP4
/// (`MOE_TC_DOWN_TILES_*` in moe_tc.cu): two tiles keep as many bytes in flight as gate/up.
/// MXFP4 expert pass with two down tiles: 106.8 against 114.5 µs at K3's batch 1, 658.7 against
/// 699.3 at batch 8 (same call); bf16 the same either way (benches/RESULTS.md).
const DOWN_TILES: [(&str, usize); 2] = [
    ("MOE_TC_DOWN_TILES_BF16", 1),
    ("MOE_TC_DOWN_TILES_MXFP4", 2),
];
/// Most dynamic shared memory a copy-engine MXFP4 projection block may take.
const TMA_MAX_SHARED: usize = 200 * 1024;
/// Most tokens one decode call takes (and so most tokens one expert serves).
pub const MOE_MAX_BATCH: usize = 64;
const MAX_EXPERTS: usize = 1024;
/// Threads of the routing kernel per token (`ROUTE_THREADS` in moe.cu).
const ROUTE_THREADS: usize = 256;

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(format!("moe: {msg}"))
}

fn expect_len(what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got < want {
        return Err(shape_err(format!(
            "{what} holds {got} values, needs {want}"
        )));
    }
    Ok(())
}

/// Expert count, experts per token and widths: `din` is the experts' input and output width
/// (K3: the latent `routed_expert_hidden_size`, 3584), `di` their intermediate width (3072).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub experts: usize,
    pub top_k: usize,
    pub din: usize,
    pub di: usize,
}

impl MoeDims {
    /// Whether the kernels take these dimensions for a batch of `batch` tokens (experts ≤ 1024,
    /// widths multiples of 32, batch ≤ 16); the reason when not.
    pub fn check(&self, batch: usize) -> Result<(), CudaError> {
        check_dims(self, batch)
    }
}

/// The activation between gate/up and down: SiTU with its two clip betas (K3), or SiLU-GLU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MoeActivation {
    Situ { gate_beta: f32, up_beta: f32 },
    Silu,
}

impl MoeActivation {
    fn betas(self) -> (f32, f32) {
        match self {
            MoeActivation::Situ { gate_beta, up_beta } => (gate_beta, up_beta),
            // b·tanh(x/b) is x to f32 precision for |x| ≪ b.
            MoeActivation::Silu => (1e15, 1e15),
        }
    }
}

/// The expert weights, stacked over experts in the checkpoint's `[out, in]` layout.
pub enum MoeExperts<'a> {
    /// `gate`, `up`: `[experts, di, din]`; `down`: `[experts, din, di]` (bf16 bits).
    Bf16 {
        gate: &'a CudaSlice<u16>,
        up: &'a CudaSlice<u16>,
        down: &'a CudaSlice<u16>,
    },
    /// The same shapes packed: codes `[.., in/2]` bytes, scales `[.., in/32]` bytes.
    Mxfp4 {
        gate: (&'a CudaSlice<u8>, &'a CudaSlice<u8>),
        up: (&'a CudaSlice<u8>, &'a CudaSlice<u8>),
        down: (&'a CudaSlice<u8>, &'a CudaSlice<u8>),
    },
}

impl MoeExperts<'_> {
    /// Weight bytes of one expert (gate, up and down).
    pub fn bytes_per_expert(&self, dims: &MoeDims) -> usize {
        let n = 3 * dims.din * dims.di;
        match self {
            MoeExperts::Bf16 { .. } => 2 * n,
            MoeExperts::Mxfp4 { .. } => n / 2 + n / 32,
        }
    }
}

/// Routing results, the plan and the intermediates of one batch size.
pub struct MoeWorkspace {
    batch: usize,
    dims: MoeDims,
    pub idx: CudaSlice<u32>,
    pub weight: CudaSlice<f32>,
    /// Routing blocks finished in the current call (the last one plans; back to 0 after).
    route_done: CudaSlice<u32>,
    /// Per active expert, tensor-core gate/up blocks done in the current call (back to 0 after).
    ready: CudaSlice<u32>,
    n_active: CudaSlice<i32>,
    act_expert: CudaSlice<i32>,
    act_count: CudaSlice<i32>,
    act_pairs: CudaSlice<i32>,
    h: CudaSlice<u16>,
    y: CudaSlice<f32>,
}

impl MoeWorkspace {
    /// Checks `dims` (experts ≤ 1024, widths multiples of 32) and `batch` (≤ `MOE_MAX_BATCH`).
    pub fn new(dev: &CudaDevice, dims: MoeDims, batch: usize) -> Result<Self, CudaError> {
        dims.check(batch)?;
        let pairs = batch * dims.top_k;
        let s = dev.stream();
        Ok(MoeWorkspace {
            batch,
            dims,
            idx: s.alloc_zeros(pairs.max(1))?,
            weight: s.alloc_zeros(pairs.max(1))?,
            route_done: s.alloc_zeros(1)?,
            ready: s.alloc_zeros(pairs.max(1))?,
            n_active: s.alloc_zeros(1)?,
            act_expert: s.alloc_zeros(pairs.max(1))?,
            act_count: s.alloc_zeros(pairs.max(1))?,
            act_pairs: s.alloc_zeros(pairs.max(1) * MOE_MAX_BATCH)?,
            h: s.alloc_zeros(pairs.max(1) * dims.di)?,
            y: s.alloc_zeros(pairs.max(1) * dims.din)?,
        })
    }

    /// The plan's arguments of the projection kernels (`PLAN_ARGS` in moe.cu).
    fn push_plan(&self, launch: &mut RawLaunch<'_>, s: &CudaStream) {
        launch
            .slice(&self.n_active, s)
            .slice(&self.act_expert, s)
            .slice(&self.act_count, s)
            .slice(&self.act_pairs, s);
    }

    /// The number of distinct experts of the last planned step (waits for the stream).
    pub fn active_experts(&self, dev: &CudaDevice) -> Result<usize, CudaError> {
        Ok(dev.download(&self.n_active)?[0].max(0) as usize)
    }
}

/// How the expert projections run: one warp per output column on the CUDA cores, or 16 rows per
/// warp on the tensor cores (8 tokens of an expert per pass; the default for both formats: at
/// K3's shapes 75–95% of the weight floor in bf16 against 72–81%, and 41–53% against 22–33% in
/// MXFP4, see benches/RESULTS.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MoePath {
    Columns,
    #[default]
    TensorCores,
}

/// `TESSERA_MOE_PATH=columns|tensor-cores` fixes the path (for measurements); unset or anything
/// else leaves the default.
pub fn moe_path_from_env() -> Option<MoePath> {
    match std::env::var("TESSERA_MOE_PATH").ok()?.as_str() {
        "columns" => Some(MoePath::Columns),
        "tensor-cores" => Some(MoePath::TensorCores),
        _ => None,
    }
}

/// `TESSERA_MOE_KSPLIT=1|2|4` fixes the tensor-core projections' input split (for
/// measurements); unset or anything else leaves the choice per call to [`tc_ksplit`].
pub fn moe_ksplit_from_env() -> Option<usize> {
    match std::env::var("TESSERA_MOE_KSPLIT").ok()?.as_str() {
        "1" => Some(1),
        "2" => Some(2),
        "4" => Some(4),
        _ => None,
    }
}

struct Projections {
    gate_up: CudaFunction,
    down: CudaFunction,
    /// Warps of one kernel resident on the device at once (the tensor-core kernels' wave).
    wave_warps: [usize; 2],
    /// Output rows of one warp of the tensor-core down kernel (16 per row tile).
    down_rows: usize,
}

/// Input parts the tensor-core projections split each row tile's sum into (1, 2 or 4): the
/// fewest that fill the last wave of warps to within 5% of the best (`tiles` row tiles of 16
/// rows, `wave` warps resident at once). Batch 1 at K3's shapes: 3072 gate/up tiles over a
/// wave of 2112 warps leave the second wave 45% full; two parts make it 97%.
///
/// MXFP4 rows are split in two at most, and only when all tiles fit in a wave and a half: each
/// warp keeps its next pass in flight during the current one, which a split leaves fewer passes
/// to do, and the parts' sum through shared memory cost more than a fuller last wave gave back
/// (K3 at batch 2 and 4: 234 and 429 µs unsplit against 242 and 438 µs split). Fewer tiles than
/// a wave are split whatever the fill: whole, they leave warp slots (and their bytes in flight)
/// empty, and as a dependent launch the second wave of parts fills the slots the kernel before
/// frees (K3's down projection at batch 1, 1792 tiles of 32 rows: expert pass 103.1 µs split
/// against 107.1 whole).
pub fn tc_ksplit(tiles: usize, wave: usize, mxfp4: bool) -> usize {
    let fill = |ks: usize| {
        let waves = (tiles * ks) as f64 / wave.max(1) as f64;
        waves / waves.ceil().max(1.0)
    };
    if mxfp4 {
        let short = 2 * tiles < 3 * wave;
        return if tiles < wave || (short && fill(2) > fill(1) + 0.05) {
            2
        } else {
            1
        };
    }
    let mut best = 1;
    for ks in [2, 4] {
        if fill(ks) > fill(best) + 0.05 {
            best = ks;
        }
    }
    best
}

/// Output rows of one warp of the tensor-core down kernel for bf16 or MXFP4 experts, from the
/// build's `-D` macros: 32 when they ask for two row tiles, except for MXFP4 through the copy
/// engine (whose warps take one).
fn tc_down_rows(defines: &[(&str, String)], mxfp4: bool, copy_engine: bool) -> usize {
    let two = define_value(defines, DOWN_TILES[usize::from(mxfp4)].0) == Some(2);
    if two && !(mxfp4 && copy_engine) {
        32
    } else {
        16
    }
}

/// Whether the tensor-core projections and the combine go out as dependent launches: on
/// sm_90 and newer unless the build says `MOE_TC_DEPENDENT=0` (moe_tc.cu).
fn dependent_launches(defines: &[(&str, String)], arch: &str) -> bool {
    define_value(defines, "MOE_TC_DEPENDENT") != Some(0) && super::sm90_or_newer(arch)
}

/// Whether the down warps wait for their own expert's gate/up blocks (counts raised by each
/// block after a fence) rather than for the whole gate/up kernel: for bf16 experts always, for
/// MXFP4 up to 128 active experts (8 tokens at K3's top-16). The fence at the end of every
/// gate/up block holds its slot a little longer, which MXFP4 pays at larger batches (K3 at batch
/// 16 / 32 / 64: 1209 / 2123 / 3379 µs with the counts against 1198 / 2092 / 3325 without; at
/// batch 1 / 4 / 8: 100.7 / 351.0 / 656.1 against 103.1 / 360.2 / 661.6; bf16 0.2–3% faster
/// with the counts at every batch).
fn fine_waits(mxfp4: bool, max_active: usize) -> bool {
    !mxfp4 || max_active <= 128
}

/// Most tokens of inputs a tensor-core projection block copies into shared memory first
/// (`MOE_TC_STAGE_X`, default and cap 4: four blocks of K3's 3584 gate/up inputs, 28 KB each, still
/// fit an SM).
const STAGE_MAX: usize = 4;

/// Tokens of inputs each tensor-core projection block copies into shared memory (0: none): the
/// batch, up to `stage_max` (at most 4), on the register path (the copy-engine ring has its own
/// use of shared memory). Experts with more tokens than that read their inputs from global
/// memory as before.
fn stage_tokens(batch: usize, stage_max: usize, ring: bool) -> usize {
    if ring {
        0
    } else {
        batch.min(stage_max.min(4))
    }
}

/// Warps of a tensor-core projection kernel resident on the device at once, with `smem` bytes of
/// dynamic shared memory per block.
fn tc_wave_warps(f: &CudaFunction, sms: usize, smem: usize) -> Result<usize, CudaError> {
    let threads = (TC_WARPS * 32) as u32;
    let blocks = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
    Ok(sms * blocks as usize * TC_WARPS)
}

/// The compiled MoE decode kernels.
pub struct MoeDecode {
    /// Most experts `moe_route` was compiled for (256 threads of up to 4 each).
    route_experts: usize,
    /// Routing, and the plan by its last block.
    route: CudaFunction,
    /// [bf16, mxfp4] × [columns, tensor cores].
    projections: [[Projections; 2]; 2],
    /// A fixed path, or `None` for the default (from [`moe_path_from_env`] at load).
    path: Option<MoePath>,
    /// A fixed input split for the tensor-core projections (`None`: [`tc_ksplit`]; from
    /// [`moe_ksplit_from_env`] at load).
    ksplit: Option<usize>,
    /// MXFP4 tensor-core weights through shared memory by the copy engine (`MOE_TC_TMA`).
    tma: Option<TmaRing>,
    /// The tensor-core projections and the combine launched as dependents of the kernel before
    /// them (`MOE_TC_DEPENDENT`, sm_90 and newer; down and combine not with the copy-engine
    /// ring).
    dependent: bool,
    /// Most tokens of an expert whose inputs the tensor-core projections read from shared
    /// memory (`MOE_TC_STAGE_X`, see [`stage_tokens`]).
    stage_max: usize,
    combine: CudaFunction,
}

/// The shared-memory ring of the copy-engine MXFP4 projections (`MOE_TMA_*` in moe_tc.cu).
#[derive(Clone, Copy, Debug)]
struct TmaRing {
    chunk: usize,
    stages: usize,
}

impl TmaRing {
    /// From the build settings: on when `MOE_TC_TMA` is 1 and the device is sm_90 or newer.
    fn from_defines(defines: &[(&str, String)], arch: &str) -> Option<Self> {
        let hopper = super::sm90_or_newer(arch);
        let get = |k: &str, default: usize| {
            defines
                .iter()
                .rev()
                .find(|(name, _)| *name == k)
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(default)
        };
        (get("MOE_TC_TMA", 0) == 1 && hopper).then(|| TmaRing {
            chunk: get("MOE_TMA_CHUNK", 8),
            stages: get("MOE_TMA_STAGES", 3),
        })
    }

    /// Dynamic shared bytes of one block for `m` matrices over `in_dim` inputs (the kernel's
    /// per-warp layout: ring of 2048-byte boxes, scale rows padded to 16 bytes, barriers, rounded
    /// to 1024 bytes; plus 1024 bytes of slack to align the first ring).
    fn block_bytes(&self, m: usize, in_dim: usize) -> usize {
        let ring = self.stages * m * (self.chunk / 8) * 2048;
        let scale_row = (in_dim / 32).next_multiple_of(16);
        let per_warp = (ring + m * 16 * scale_row + self.stages * 8).next_multiple_of(1024);
        TC_WARPS * per_warp + 1024
    }
}

/// The 2-D tensor map of `rows` rows of `row_bytes` bytes at `ptr`, read in boxes of 16 rows x
/// 128 bytes with the 128-byte swizzle (what `tc_project_tma` reads back).
fn codes_map(ptr: u64, row_bytes: usize, rows: usize) -> Result<TensorMapArg, CudaError> {
    use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};
    tensor_map::tiled(
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        ptr,
        &[row_bytes as u64, rows as u64],
        &[row_bytes as u64],
        &[128, 16],
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

impl MoeDecode {
    /// The kernels for any expert count up to 1024.
    pub fn load(dev: &CudaDevice) -> Result<Self, CudaError> {
        Self::load_for(dev, MAX_EXPERTS)
    }

    /// The kernels for layers of at most `experts` experts (routing keeps that many scores per
    /// warp in registers, so a small count routes faster).
    pub fn load_for(dev: &CudaDevice, experts: usize) -> Result<Self, CudaError> {
        Self::load_tuned(dev, experts, &[])
    }

    /// [`Self::load_for`] with extra compile-time settings of `moe.cu` (measurements).
    pub fn load_tuned(
        dev: &CudaDevice,
        experts: usize,
        tuning: &[(&str, String)],
    ) -> Result<Self, CudaError> {
        let per_thread = experts.clamp(1, MAX_EXPERTS).div_ceil(ROUTE_THREADS);
        let mut defines = vec![
            ("MOE_WARPS", WARPS.to_string()),
            ("MOE_COLS_PER_WARP", COLS_PER_WARP.to_string()),
            ("MOE_TC_WARPS", TC_WARPS.to_string()),
            ("MOE_MAXT", MOE_MAX_BATCH.to_string()),
            ("ROUTE_PER_THREAD", per_thread.to_string()),
        ];
        for (name, tiles) in DOWN_TILES {
            if define_value(tuning, name).is_none() {
                defines.push((name, tiles.to_string()));
            }
        }
        defines.extend(tuning.iter().cloned());
        let tma = TmaRing::from_defines(&defines, dev.arch());
        let dependent = dependent_launches(&defines, dev.arch());
        let m = dev.module("moe", MOE_SOURCE, &defines)?;
        let sms = dev.sm_count()?;
        let proj = |path: &str, format: &str| -> Result<Projections, CudaError> {
            let gate_up = m.load_function(&format!("moe_gate_up_{path}{format}"))?;
            let down = m.load_function(&format!("moe_down_{path}{format}"))?;
            let wave = |f: &CudaFunction| tc_wave_warps(f, sms, 0);
            if tma.is_some() && path == "tc_" && format == "mxfp4" {
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                gate_up.set_attribute(attr, TMA_MAX_SHARED as i32)?;
                down.set_attribute(attr, TMA_MAX_SHARED as i32)?;
            }
            let down_rows = if path == "tc_" {
                tc_down_rows(&defines, format == "mxfp4", tma.is_some())
            } else {
                16
            };
            Ok(Projections {
                wave_warps: [wave(&gate_up)?, wave(&down)?],
                gate_up,
                down,
                down_rows,
            })
        };
        Ok(MoeDecode {
            route_experts: per_thread * ROUTE_THREADS,
            route: m.load_function("moe_route")?,
            projections: [
                [proj("", "bf16")?, proj("tc_", "bf16")?],
                [proj("", "mxfp4")?, proj("tc_", "mxfp4")?],
            ],
            path: moe_path_from_env(),
            ksplit: moe_ksplit_from_env(),
            tma,
            dependent,
            stage_max: define_value(&defines, "MOE_TC_STAGE_X").unwrap_or(STAGE_MAX),
            combine: m.load_function("moe_combine")?,
        })
    }

    /// Runs every later call's projections on `path` (`None`: the default).
    pub fn set_path(&mut self, path: Option<MoePath>) {
        self.path = path;
    }

    /// Fixes the tensor-core projections' input split (1, 2 or 4; `None`: chosen per call by
    /// [`tc_ksplit`]).
    pub fn set_ksplit(&mut self, ksplit: Option<usize>) {
        self.ksplit = ksplit.map(|k| k.clamp(1, TC_WARPS).next_power_of_two());
    }

    /// Warps of the tensor-core gate/up and down kernels resident on the device at once, for
    /// bf16 or MXFP4 experts (what the input split is chosen from).
    pub fn tc_wave_warps(&self, mxfp4: bool) -> [usize; 2] {
        self.projections[usize::from(mxfp4)][1].wave_warps
    }

    /// Registers per thread and local-memory bytes per thread (spills) of the tensor-core gate/up
    /// and down kernels, for bf16 or MXFP4 experts.
    pub fn tc_resources(&self, mxfp4: bool) -> Result<[(i32, i32); 2], CudaError> {
        let p = &self.projections[usize::from(mxfp4)][1];
        let res = |f: &CudaFunction| -> Result<(i32, i32), CudaError> {
            Ok((f.num_regs()?, f.local_size_bytes()?))
        };
        Ok([res(&p.gate_up)?, res(&p.down)?])
    }

    /// The path the projections take.
    pub fn path(&self) -> MoePath {
        self.path.unwrap_or_default()
    }

    /// Routes `logits [batch, experts]` (f32 router outputs) with the correction `bias
    /// [experts]` into `ws.idx`/`ws.weight` `[batch, top_k]`, and plans the expert pass.
    pub fn route(
        &self,
        dev: &CudaDevice,
        logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        routing: &MoeRouting,
        ws: &mut MoeWorkspace,
    ) -> Result<(), CudaError> {
        let (dims, batch) = (ws.dims, ws.batch);
        if routing.n_group > 1 && routing.topk_group < routing.n_group {
            return Err(shape_err(
                "grouped top-k (n_group > 1) is not implemented on CUDA".to_string(),
            ));
        }
        if routing.top_k != dims.top_k {
            return Err(shape_err(format!(
                "routing top_k {} but workspace top_k {}",
                routing.top_k, dims.top_k
            )));
        }
        expect_len("logits", logits.len(), batch * dims.experts)?;
        expect_len("bias", bias.len(), dims.experts)?;
        if dims.experts > self.route_experts {
            return Err(shape_err(format!(
                "{} experts, but the routing kernel was loaded for at most {}",
                dims.experts, self.route_experts
            )));
        }
        if batch == 0 {
            return Ok(());
        }
        let (e_i, k_i) = (dims.experts as i32, dims.top_k as i32);
        let renorm = routing.renormalize as i32;
        let mut launch = dev.stream().launch_builder(&self.route);
        launch
            .arg(logits)
            .arg(bias)
            .arg(&mut ws.idx)
            .arg(&mut ws.weight)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&renorm)
            .arg(&routing.scaling)
            .arg(&mut ws.route_done)
            .arg(&mut ws.n_active)
            .arg(&mut ws.act_expert)
            .arg(&mut ws.act_count)
            .arg(&mut ws.act_pairs);
        let cfg = LaunchConfig {
            grid_dim: (batch as u32, 1, 1),
            block_dim: (ROUTE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list matches `moe_route`; logits hold `batch` rows of
        // `experts` (≤ 1024, checked by `check_dims`), idx/weight `batch · top_k` values, the
        // plan arrays `batch · top_k` entries (× 64 pairs), route_done one counter at zero.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// `out [batch, din] (bf16) = Σ_slot w · down(act(gate(x), up(x)))` over the experts routed
    /// by the last [`Self::route`] into `ws`, for `x [batch, din]` (bf16).
    pub fn experts(
        &self,
        dev: &CudaDevice,
        x: &CudaSlice<u16>,
        experts: &MoeExperts,
        act: MoeActivation,
        ws: &mut MoeWorkspace,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let (d, batch) = (ws.dims, ws.batch);
        expect_len("x", x.len(), batch * d.din)?;
        expect_len("out", out.len(), batch * d.din)?;
        check_weights(experts, &d)?;
        if batch == 0 {
            return Ok(());
        }
        let pairs = batch * d.top_k;
        let max_active = pairs.min(d.experts) as u32;
        let (din_i, di_i, k_i) = (d.din as i32, d.di as i32, d.top_k as i32);
        let (b1, b2) = act.betas();
        let s = dev.stream();
        let mxfp4 = matches!(experts, MoeExperts::Mxfp4 { .. });
        let path = self.path();
        let tc = path == MoePath::TensorCores;
        let kernels = &self.projections[usize::from(mxfp4)][usize::from(tc)];
        // Dynamic shared memory of [gate/up, down] and the waves it leaves.
        let ring = self.tma.filter(|_| tc && mxfp4);
        let stage = if tc {
            stage_tokens(batch, self.stage_max, ring.is_some())
        } else {
            0
        };
        let smem = ring.map_or([2 * stage * d.din, 2 * stage * d.di], |r| {
            [r.block_bytes(2, d.din), r.block_bytes(1, d.di)]
        });
        let mut waves = kernels.wave_warps;
        if ring.is_some() {
            let sms = dev.sm_count()?;
            for (which, f) in [&kernels.gate_up, &kernels.down].into_iter().enumerate() {
                waves[which] = tc_wave_warps(f, sms, smem[which])?;
            }
        }
        // Input parts per row tile (tensor cores; the column kernels take no such argument).
        let tile_rows = [16, kernels.down_rows];
        let ksplit = |rows: usize, which: usize| -> i32 {
            let tiles = rows.div_ceil(tile_rows[which]) * max_active as usize;
            self.ksplit
                .unwrap_or_else(|| tc_ksplit(tiles, waves[which], mxfp4)) as i32
        };
        let (ks_gate_up, ks_down) = (ksplit(d.di, 0), ksplit(d.din, 1));
        let cfg = |rows: usize, which: usize, ks: i32, smem: usize| {
            let (per_block, warps) = match path {
                MoePath::Columns => (COLS, WARPS),
                MoePath::TensorCores => (tile_rows[which] * TC_WARPS / ks as usize, TC_WARPS),
            };
            LaunchConfig {
                grid_dim: (rows.div_ceil(per_block) as u32, max_active, 1),
                block_dim: ((warps * 32) as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            }
        };
        let mut launch = RawLaunch::new();
        match experts {
            MoeExperts::Bf16 { gate, up, .. } => launch.slice(gate, s).slice(up, s),
            MoeExperts::Mxfp4 { gate, up, .. } => launch
                .slice(gate.0, s)
                .slice(gate.1, s)
                .slice(up.0, s)
                .slice(up.1, s),
        };
        launch.slice(x, s);
        ws.push_plan(&mut launch, s);
        launch
            .slice_mut(&mut ws.h, s)
            .value(din_i)
            .value(di_i)
            .value(k_i)
            .value(b1)
            .value(b2);
        // Down warps wait for their expert's gate/up blocks, counted in ws.ready, or (null) for
        // the whole gate/up kernel.
        let ready_ptr = ws.ready.device_ptr_mut(s).0;
        let ready = if fine_waits(mxfp4, max_active as usize) {
            ready_ptr
        } else {
            0
        };
        if tc {
            launch.value(ks_gate_up).value(ready).value(stage as i32);
        }
        let maps = match (ring, experts) {
            (Some(_), MoeExperts::Mxfp4 { gate, up, down }) => {
                let s = dev.stream();
                let (pg, _g) = gate.0.device_ptr(s);
                let (pu, _u) = up.0.device_ptr(s);
                let (pd, _d) = down.0.device_ptr(s);
                Some([
                    codes_map(pg, d.din / 2, d.experts * d.di)?,
                    codes_map(pu, d.din / 2, d.experts * d.di)?,
                    codes_map(pd, d.di / 2, d.experts * d.din)?,
                ])
            }
            _ => None,
        };
        if let Some(m) = &maps {
            launch.by_ref(&m[0]).by_ref(&m[1]);
        }
        // SAFETY: the argument list matches `moe_gate_up_{,tc_}{bf16,mxfp4}` (ksplit in 1, 2, 4
        // for the tensor-core ones); weights hold `experts` experts (checked), the plan names at
        // most `max_active` experts, h holds `pairs` rows, ready `pairs` ≥ `max_active` counts.
        // The tensor-core kernels wait for the kernel before them before they read anything, so
        // they may go out as dependents.
        let cfg_gate_up = cfg(d.di, 0, ks_gate_up, smem[0]);
        unsafe { launch.launch(s, &kernels.gate_up, cfg_gate_up, tc && self.dependent) }?;
        // Down and combine may start while the kernel before them runs (see `dependent`).
        let overlap = tc && self.dependent && ring.is_none();
        let mut launch = RawLaunch::new();
        match experts {
            MoeExperts::Bf16 { down, .. } => launch.slice(down, s),
            MoeExperts::Mxfp4 { down, .. } => launch.slice(down.0, s).slice(down.1, s),
        };
        launch.slice(&ws.h, s);
        ws.push_plan(&mut launch, s);
        launch.slice_mut(&mut ws.y, s).value(din_i).value(di_i);
        if tc {
            // A down warp waits for all gate/up blocks of its expert: the gate/up grid's width.
            let gate_up_blocks = cfg_gate_up.grid_dim.0 as i32;
            launch
                .value(ks_down)
                .value(ready)
                .value(gate_up_blocks)
                .value(stage as i32);
        }
        if let Some(m) = &maps {
            launch.by_ref(&m[2]);
        }
        // SAFETY: as above for `moe_down_{,tc_}{bf16,mxfp4}`; y holds `pairs` rows of `din`.
        // Launched as dependent only on the tensor-core path, whose kernels wait for gate/up
        // before they read h.
        unsafe { launch.launch(s, &kernels.down, cfg(d.din, 1, ks_down, smem[1]), overlap) }?;
        let mut launch = RawLaunch::new();
        launch
            .slice(&ws.y, s)
            .slice(&ws.weight, s)
            .slice_mut(out, s)
            .value(din_i)
            .value(k_i)
            .value(ready)
            .value(max_active as i32);
        let ccfg = LaunchConfig {
            grid_dim: (d.din.div_ceil(256) as u32, batch as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list matches `moe_combine` (which waits for the down kernel
        // before it reads y); y and weight hold `pairs` rows, ready `max_active` counts or more.
        unsafe { launch.launch(s, &self.combine, ccfg, overlap) }?;
        Ok(())
    }
}

/// Checks the dimensions a workspace is made for.
fn check_dims(dims: &MoeDims, batch: usize) -> Result<(), CudaError> {
    if batch > MOE_MAX_BATCH {
        return Err(shape_err(format!(
            "batch {batch} above the small-batch path's {MOE_MAX_BATCH}"
        )));
    }
    if dims.experts == 0
        || dims.experts > MAX_EXPERTS
        || dims.top_k == 0
        || dims.top_k > dims.experts
    {
        return Err(shape_err(format!(
            "{dims:?}: experts in 1..=1024, top_k in 1..=experts"
        )));
    }
    if dims.din == 0 || dims.di == 0 || !dims.din.is_multiple_of(32) || !dims.di.is_multiple_of(32)
    {
        return Err(shape_err(format!(
            "{dims:?}: widths must be positive multiples of 32"
        )));
    }
    Ok(())
}

fn check_weights(experts: &MoeExperts, d: &MoeDims) -> Result<(), CudaError> {
    let n = d.experts * d.din * d.di;
    match experts {
        MoeExperts::Bf16 { gate, up, down } => {
            expect_len("gate", gate.len(), n)?;
            expect_len("up", up.len(), n)?;
            expect_len("down", down.len(), n)
        }
        MoeExperts::Mxfp4 { gate, up, down } => {
            for (what, (codes, scales)) in [("gate", gate), ("up", up), ("down", down)] {
                expect_len(what, codes.len(), n / 2)?;
                expect_len(what, scales.len(), n / 32)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        dependent_launches, fine_waits, stage_tokens, tc_down_rows, tc_ksplit, TmaRing, DOWN_TILES,
    };

    #[test]
    fn mxfp4_down_warps_wait_per_expert_only_up_to_eight_tokens() {
        assert!(fine_waits(false, 896));
        assert!(fine_waits(true, 16));
        assert!(fine_waits(true, 128));
        assert!(!fine_waits(true, 256));
    }

    #[test]
    fn inputs_staged_in_shared_memory_up_to_the_cap_and_not_with_the_ring() {
        assert_eq!(stage_tokens(1, 4, false), 1);
        assert_eq!(stage_tokens(3, 4, false), 3);
        assert_eq!(stage_tokens(64, 4, false), 4);
        assert_eq!(stage_tokens(64, 2, false), 2);
        assert_eq!(stage_tokens(1, 0, false), 0);
        assert_eq!(stage_tokens(1, 4, true), 0);
        // Four tokens at most whatever the cap: more would cost blocks per SM.
        assert_eq!(stage_tokens(8, 8, false), 4);
    }

    #[test]
    fn dependent_launches_on_hopper_unless_switched_off() {
        let set = |v: &str| vec![("MOE_TC_DEPENDENT", v.to_string())];
        assert!(dependent_launches(&[], "sm_90"));
        assert!(dependent_launches(&set("1"), "sm_100"));
        assert!(!dependent_launches(&set("0"), "sm_90"));
        assert!(!dependent_launches(&[], "sm_80"));
        assert!(!dependent_launches(&set("1"), "sm_89"));
    }

    #[test]
    fn down_warps_take_two_tiles_when_asked_and_not_through_the_copy_engine() {
        let defaults: Vec<(&str, String)> = DOWN_TILES
            .iter()
            .map(|&(k, v)| (k, v.to_string()))
            .collect();
        assert_eq!(tc_down_rows(&defaults, false, false), 16);
        assert_eq!(tc_down_rows(&defaults, true, false), 32);
        assert_eq!(tc_down_rows(&defaults, true, true), 16);
        let both = vec![
            ("MOE_TC_DOWN_TILES_BF16", "2".to_string()),
            ("MOE_TC_DOWN_TILES_MXFP4", "1".to_string()),
        ];
        assert_eq!(tc_down_rows(&both, false, true), 32);
        assert_eq!(tc_down_rows(&both, true, false), 16);
        assert_eq!(tc_down_rows(&[], true, false), 16);
    }

    #[test]
    fn copy_engine_ring_only_on_request_and_hopper() {
        let on = |v: &str| vec![("MOE_TC_TMA", v.to_string())];
        assert!(TmaRing::from_defines(&on("1"), "sm_90").is_some());
        assert!(TmaRing::from_defines(&on("1"), "sm_100").is_some());
        assert!(TmaRing::from_defines(&on("1"), "sm_80").is_none());
        assert!(TmaRing::from_defines(&on("0"), "sm_90").is_none());
        assert!(TmaRing::from_defines(&[], "sm_90").is_none());
        // The last setting wins, as on the compiler's command line.
        let mut twice = on("1");
        twice.push(("MOE_TC_TMA", "0".to_string()));
        assert!(TmaRing::from_defines(&twice, "sm_90").is_none());
    }

    #[test]
    fn copy_engine_ring_bytes_follow_the_kernel_layout() {
        let ring = TmaRing {
            chunk: 8,
            stages: 3,
        };
        // K3 gate/up: 3 stages x 2 matrices x one 2048-byte box, 32 scale rows of 112 bytes,
        // 3 barriers -> 15,896 bytes, 16 KiB a warp; four warps and the alignment slack.
        assert_eq!(ring.block_bytes(2, 3584), 4 * 16384 + 1024);
        // Scale rows are padded to 16 bytes: 384 inputs are 12 blocks, 16 bytes a row.
        assert_eq!(ring.block_bytes(1, 384), 4 * 7168 + 1024);
    }

    #[test]
    fn input_split_fills_the_last_wave() {
        // K3 at batch 1 on 132 multiprocessors × 16 warps: gate/up 16 experts × 192 tiles,
        // down 16 × 224 tiles.
        assert_eq!(tc_ksplit(3072, 2112, false), 2);
        assert_eq!(tc_ksplit(3584, 2112, false), 4);
        // Many experts (batch 16): the waves are full enough without a split.
        assert_eq!(tc_ksplit(230 * 192, 2112, false), 1);
        // Exactly one wave, and an empty one, stay whole.
        assert_eq!(tc_ksplit(2112, 2112, false), 1);
        assert_eq!(tc_ksplit(0, 2112, false), 1);
    }

    #[test]
    fn mxfp4_rows_split_in_two_at_most_and_only_under_a_wave_and_a_half() {
        // Batch 1: gate/up (1.45 waves) in two parts; down on 32-row tiles (0.85 of a wave) in
        // two; down on 16-row tiles (1.7 waves) whole, not in four.
        assert_eq!(tc_ksplit(3072, 2112, true), 2);
        assert_eq!(tc_ksplit(1792, 2112, true), 2);
        assert_eq!(tc_ksplit(3584, 2112, true), 1);
        // Batch 2: 2.9 and 3.4 waves stay whole.
        assert_eq!(tc_ksplit(6144, 2112, true), 1);
        assert_eq!(tc_ksplit(7168, 2112, true), 1);
        // A whole wave, which the split would not fill better; a few tiles, split.
        assert_eq!(tc_ksplit(2112, 2112, true), 1);
        assert_eq!(tc_ksplit(10, 2112, true), 2);
    }
}
