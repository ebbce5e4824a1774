//! MoE decode on CUDA (`moe.cu`) for batches of 1–64 tokens: sigmoid routing with the
//! correction bias, the per-step expert plan, gate+up+SiTU fused, the down projection and the
//! weighted combine; experts in bf16 or packed MXFP4 (dequantised in the kernels, w4a16).
//! Semantics: [`crate::cpu::route_sigmoid_grouped`] with one expert group, then per token
//! `Σ_slot w · W2 · situ(W1·x, W3·x)` — the routed part of the engine's (latent) MoE, whose `x`
//! is the latent after the down-projection.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use super::launch::{allow_dynamic_smem, RawLaunch};
use super::moe_policy::{
    dependent_launches, fine_waits, resident_whole_passes, stage_tokens, tc_down_rows, tc_ksplit,
    TmaRing, DOWN_TILES, STAGE_MAX, TC_WARPS,
};
use super::tensor_map::{self, TensorMapArg};
use super::{CudaDevice, CudaError, MOE_SOURCE};
use crate::cpu::MoeRouting;
use crate::gpu::define_value;

const WARPS: usize = 4;
const COLS_PER_WARP: usize = 2;
const COLS: usize = WARPS * COLS_PER_WARP;
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
    /// The down kernel's combine (`FusedCombine` in moe_tc_kernels.cu): (token, row tile)s
    /// done, then the slots done of each (token, row tile of 16 rows or more); zero between
    /// calls.
    combine_counts: CudaSlice<u32>,
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
            combine_counts: s.alloc_zeros(1 + batch.max(1) * dims.din / 16)?,
        })
    }

    /// The plan's arguments of the routing and projection kernels (`PLAN_OUT_ARGS`, `PLAN_ARGS`
    /// in moe.cu).
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
    /// Gate/up by resident blocks (tensor cores only; moe_tc_resident.cu).
    gate_up_resident: Option<CudaFunction>,
    down: CudaFunction,
    /// Warps of one kernel resident on the device at once (the tensor-core kernels' wave).
    wave_warps: [usize; 2],
    /// Output rows of one warp of the tensor-core down kernel (16 per row tile).
    down_rows: usize,
}

/// Warps of a tensor-core projection kernel resident on the device at once, with `smem` bytes of
/// dynamic shared memory per block.
fn tc_wave_warps(f: &CudaFunction, sms: usize, smem: usize) -> Result<usize, CudaError> {
    let threads = (TC_WARPS * 32) as u32;
    let blocks = f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?;
    Ok(sms * blocks as usize * TC_WARPS)
}

/// `TESSERA_MOE_TUNING=NAME=VALUE,…` adds build-time settings of moe.cu to every load (for
/// measurements of a whole model under a variant): names of `MOE_*` settings, whole-number
/// values; anything else is left out.
pub fn moe_tuning_from_env() -> Vec<(String, String)> {
    let Ok(list) = std::env::var("TESSERA_MOE_TUNING") else {
        return Vec::new();
    };
    parse_moe_tuning(&list)
}

fn parse_moe_tuning(list: &str) -> Vec<(String, String)> {
    let setting = |item: &str| {
        let (name, value) = item.trim().split_once('=')?;
        let name_ok = name.starts_with("MOE_")
            && name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        (name_ok && value.parse::<u32>().is_ok()).then(|| (name.to_string(), value.to_string()))
    };
    list.split(',').filter_map(setting).collect()
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
    /// The routing kernel launched as a dependent of the kernel before it (sm_90;
    /// `MOE_ROUTE_DEPENDENT`, on unless 0).
    route_dependent: bool,
    /// Most tokens of a call whose combine the down kernel does itself (`MOE_TC_FUSED_COMBINE`,
    /// 0: never; tensor cores as dependent launches without the copy-engine ring).
    fused_combine_max: usize,
    /// Gate/up by resident blocks walking the block tasks (`MOE_TC_RESIDENT`, see
    /// moe_tc_resident.cu), where every expert's inputs fit in shared memory and each warp's
    /// input range is whole passes; [bf16, MXFP4] input vectors a warp's pass covers.
    resident: Option<[usize; 2]>,
    combine: CudaFunction,
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
    /// warp in registers, so a small count routes faster), with the settings of
    /// [`moe_tuning_from_env`].
    pub fn load_for(dev: &CudaDevice, experts: usize) -> Result<Self, CudaError> {
        let env = moe_tuning_from_env();
        let tuning: Vec<(&str, String)> =
            env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        Self::load_tuned(dev, experts, &tuning)
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
                allow_dynamic_smem(&gate_up, TMA_MAX_SHARED)?;
                allow_dynamic_smem(&down, TMA_MAX_SHARED)?;
            }
            let down_rows = if path == "tc_" {
                tc_down_rows(&defines, format == "mxfp4", tma.is_some())
            } else {
                16
            };
            let gate_up_resident = if path == "tc_" {
                Some(m.load_function(&format!("moe_gate_up_tc_res_{format}"))?)
            } else {
                None
            };
            Ok(Projections {
                wave_warps: [wave(&gate_up)?, wave(&down)?],
                gate_up,
                gate_up_resident,
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
            route_dependent: dependent && define_value(&defines, "MOE_ROUTE_DEPENDENT") != Some(0),
            // The down-kernel probe skips the stores the fused combine counts.
            fused_combine_max: match define_value(&defines, "MOE_TC_PROBE") {
                Some(1) => 0,
                _ => define_value(&defines, "MOE_TC_FUSED_COMBINE").unwrap_or(0),
            },
            resident: (define_value(&defines, "MOE_TC_RESIDENT").unwrap_or(0) > 0).then(|| {
                // A pass: 4 lanes × span vectors of a row (moe_tc.cu's defaults).
                let span = |name, default| 4 * define_value(&defines, name).unwrap_or(default);
                [span("MOE_TC_SPAN_BF16", 4), span("MOE_TC_SPAN_MXFP4", 2)]
            }),
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
        let s = dev.stream();
        let mut launch = RawLaunch::new();
        launch
            .slice(logits, s)
            .slice(bias, s)
            .slice_mut(&mut ws.idx, s)
            .slice_mut(&mut ws.weight, s)
            .value(dims.experts as i32)
            .value(dims.top_k as i32)
            .value(i32::from(routing.renormalize))
            .value(routing.scaling)
            .slice_mut(&mut ws.route_done, s);
        ws.push_plan(&mut launch, s);
        let cfg = LaunchConfig {
            grid_dim: (batch as u32, 1, 1),
            block_dim: (ROUTE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list matches `moe_route` (which waits for the kernel before it
        // before it reads anything, so it may go out as a dependent); logits hold `batch` rows
        // of `experts` (≤ 1024, checked by `check_dims`), idx/weight `batch · top_k` values, the
        // plan arrays `batch · top_k` entries (× 64 pairs), route_done one counter at zero.
        unsafe { launch.launch(s, &self.route, cfg, self.route_dependent) }?;
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
        // Tokens of inputs staged in shared memory by [gate/up, down] (their inputs: din, di).
        let stage = [d.din, d.di].map(|in_dim| {
            if tc {
                stage_tokens(batch, self.stage_max, ring.is_some(), in_dim)
            } else {
                0
            }
        });
        let smem = ring.map_or([2 * stage[0] * d.din, 2 * stage[1] * d.di], |r| {
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
        // Resident gate/up blocks: the block tasks an expert has, and the grid one wave of them.
        let mut cfg_gate_up = cfg(d.di, 0, ks_gate_up, smem[0]);
        let per_expert = cfg_gate_up.grid_dim.0;
        let resident_fn = kernels.gate_up_resident.as_ref();
        let resident = match (self.resident, resident_fn) {
            (Some(pass), Some(_)) if ring.is_none() && batch <= stage[0] => {
                let pass = pass[usize::from(mxfp4)];
                resident_whole_passes(d.din, mxfp4, ks_gate_up as usize, pass)
            }
            _ => false,
        };
        let gate_up_fn = match resident_fn {
            Some(f) if resident => {
                let sms = dev.sm_count()?;
                let wave = tc_wave_warps(f, sms, smem[0])? / TC_WARPS;
                let tasks = per_expert as usize * max_active as usize;
                cfg_gate_up.grid_dim = (tasks.min(wave).max(1) as u32, 1, 1);
                f
            }
            _ => &kernels.gate_up,
        };
        if tc {
            // The resident kernel takes the block tasks an expert has where the other takes
            // the staged tokens (it stages as many as the call has: batch ≤ stage).
            let last = if resident {
                per_expert as i32
            } else {
                stage[0] as i32
            };
            launch.value(ks_gate_up).value(ready).value(last);
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
        // most `max_active` experts, h holds `pairs` rows, ready `pairs` ≥ `max_active` counts;
        // resident blocks only where every expert's tokens fit the staged rows (batch ≤ stage)
        // and each warp's input range is whole passes (checked above).
        // The tensor-core kernels wait for the kernel before them before they read anything, so
        // they may go out as dependents.
        unsafe { launch.launch(s, gate_up_fn, cfg_gate_up, tc && self.dependent) }?;
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
        // The combine in the down kernel: its (token, row tile)s, or none (null `out`).
        let fused = overlap && batch <= self.fused_combine_max;
        if tc {
            // A down warp waits for all gate/up block tasks of its expert (the normal grid's
            // width; resident blocks count each task as such a block).
            let gate_up_blocks = per_expert as i32;
            launch
                .value(ks_down)
                .value(ready)
                .value(gate_up_blocks)
                .value(stage[1] as i32)
                .slice(&ws.weight, s);
            if fused {
                launch.slice_mut(out, s);
            } else {
                launch.value(0u64);
            }
            let groups = batch * d.din / kernels.down_rows;
            launch
                .slice_mut(&mut ws.combine_counts, s)
                .value(k_i)
                .value(groups as i32)
                .value(max_active as i32);
        }
        if let Some(m) = &maps {
            launch.by_ref(&m[2]);
        }
        // SAFETY: as above for `moe_down_{,tc_}{bf16,mxfp4}`; y holds `pairs` rows of `din`,
        // weight `pairs` values, out (when not null) `batch` rows of `din`, combine_counts 1 +
        // `batch · din / 16` counts at zero (down_rows ≥ 16). Launched as dependent only on the
        // tensor-core path, whose kernels wait for gate/up before they read h.
        unsafe { launch.launch(s, &kernels.down, cfg(d.din, 1, ks_down, smem[1]), overlap) }?;
        if fused {
            return Ok(());
        }
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
    use super::parse_moe_tuning;

    #[test]
    fn tuning_from_env_keeps_only_moe_settings() {
        let got = parse_moe_tuning("MOE_TC_RESIDENT=1, MOE_ROUTE_TRIGGER=1,X=1,MOE_A=-1,MOE_b=2");
        let want = [("MOE_TC_RESIDENT", "1"), ("MOE_ROUTE_TRIGGER", "1")];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        assert!(parse_moe_tuning("").is_empty());
        assert!(parse_moe_tuning("MOE_TC_PROBE=1 -DX").is_empty());
    }
}
