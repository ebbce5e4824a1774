//! MLA decode in absorbed form on CUDA (`mla_decode.cu`): one query token per sequence against
//! the paged bf16 latent cache (512 latent + 64 rope-slot dims per token), the context split
//! across blocks and merged by log-sum-exp. Semantics of [`crate::cpu::mla_absorbed_attention`]
//! with `t = 1`: `q` is `[batch, heads, 576]` (absorbed q_nope ++ q_pe), the output the latent
//! `[batch, heads, 512]` in bf16.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::launch::allow_dynamic_smem;
use super::tensor_map::{self, TensorMapArg};
use super::{CudaDevice, CudaError, MLA_DECODE_SM90_SOURCE, MLA_DECODE_SOURCE};

/// Latent width (kv_lora_rank) and the rope-slot width of one cached token.
pub const MLA_RANK: usize = 512;
pub const MLA_ROPE: usize = 64;
const D: usize = MLA_RANK + MLA_ROPE;
const BN: usize = 64;

fn shape_err(msg: String) -> CudaError {
    CudaError::Shape(format!("mla_decode: {msg}"))
}

/// The paged latent cache: `cache [num_pages, page_size, 576]`, `page_table [batch, max_pages]`
/// (page ids of each sequence's tokens in order) and `seq_lens [batch]` (tokens cached per
/// sequence, the query's own included). Lengths beyond `max_pages · page_size` are clamped and
/// page ids outside the pool read as zeros, so bad tables cannot read out of bounds.
pub struct MlaPages<'a> {
    pub cache: &'a CudaSlice<u16>,
    pub page_table: &'a CudaSlice<i32>,
    pub seq_lens: &'a CudaSlice<i32>,
    pub page_size: usize,
    pub max_pages: usize,
}

/// Batch, heads and the context split of one decode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDecodeShape {
    pub batch: usize,
    pub heads: usize,
    /// Blocks each sequence's context is split across (see [`MlaDecode::splits_for`]).
    pub splits: usize,
}

/// The compiled kernels for one head count, and the per-split scratch.
pub struct MlaDecode {
    split: CudaFunction,
    /// The Hopper split kernels with split roles by tile size, largest first, for pages of
    /// whole tiles.
    split_ws: Vec<(usize, CudaFunction)>,
    /// The Hopper kernel with transposed products (with [`MlaTuning::transposed`]), for pages of
    /// whole 64-token tiles, and its heads per block.
    split_tr: Option<(CudaFunction, usize)>,
    combine: CudaFunction,
    heads: usize,
    heads_per_block: usize,
    threads: u32,
    smem: u32,
    sms: usize,
    hopper: bool,
    tuning: MlaTuning,
}

/// The split kernels: `Portable` (mma.sync, every architecture from `sm_80`; what
/// [`MlaDecode::load`] picks) and `Hopper` (warpgroup MMAs, `sm_90` only: where pages hold whole
/// 32- or 64-token tiles, the copy engine feeds warpgroups with split roles; else the threads
/// copy the tiles). On an H200 at K3's 96 heads the Hopper kernel is as exact and, with pages
/// of 64 tokens, about 2.7× faster at batch 64 (2.2 TB/s at 16K) although it pads 96 heads to
/// 128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaKernel {
    Portable,
    Hopper,
}

/// Build-time choices of a split kernel, for measuring alternatives (`load_tuned`).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MlaTuning {
    /// Tiles prefetched into L2 ahead of the shared-memory stages (`MLA_PREFETCH`). The default
    /// is none: on an H200 prefetching 2 to 8 tiles ahead made both kernels up to 10% slower.
    pub prefetch: usize,
    /// Tile copies with wider contiguous runs per warp instruction (`MLA_COALESCED`).
    pub coalesced: bool,
    /// Tokens per tile of the Hopper split-role kernel (`MLA_WS_BN`): 32 (four stages) or 64
    /// (two stages, S as m64n64k16, pages of whole 64-token tiles); 0 (the default) compiles
    /// both and takes 64 where the pages hold whole 64-token tiles.
    pub ws_tile: usize,
    /// The Hopper kernel with both products transposed (`mla_decode_split_tr`: tokens and
    /// latent dims as wgmma's M, heads as N, blocks of 48, 32 or 16 heads with none padded)
    /// where pages hold whole 64-token tiles.
    pub transposed: bool,
    /// A timing probe of the split-role kernels, transposed or not (`MLA_WS_PROBE`; outputs
    /// wrong by design, never for use): 1 skips the P·V products, 2 the S products (P uniform),
    /// 3 both (the tile copies, barriers and softmax alone); 4 (not transposed) the tile
    /// stream alone (each tile waited for and released at once).
    pub probe: u8,
    /// The copy-engine kernels' tiles without the 128-byte swizzle (`MLA_SW128` 0): boxes of
    /// 16-byte columns into the core-matrix layout, where the default copies 128-byte rows (9
    /// chunks of 64 dims) in the swizzle that wgmma reads directly. On an H200 the swizzled
    /// copies stream 3.3× faster and the kernel runs twice as fast.
    pub unswizzled: bool,
    /// K steps of S (of 36) that take Q from registers in the split-role kernel's 64-token
    /// tiles (`MLA_WS_QREG`), each sparing shared memory 2 KB of reads per tile; 0: none.
    pub q_regs: usize,
    /// Tensor copies each tile of the split-role kernel comes in (`MLA_WS_COPIES`: 1, 3 or 9;
    /// 0 means 1), S starting on the first while the others stream; more than one needs the
    /// swizzled tiles.
    pub copies: usize,
}

impl MlaTuning {
    fn defines(&self) -> [(&'static str, String); 6] {
        [
            ("MLA_PREFETCH", self.prefetch.to_string()),
            ("MLA_COALESCED", u8::from(self.coalesced).to_string()),
            ("MLA_WS_PROBE", self.probe.to_string()),
            ("MLA_SW128", u8::from(!self.unswizzled).to_string()),
            ("MLA_WS_QREG", self.q_regs.to_string()),
            ("MLA_WS_COPIES", self.ws_copies().to_string()),
        ]
    }

    /// Whether these choices change `kernel` (tile, probe, transposition and swizzle concern
    /// the Hopper kernel only).
    pub fn applies_to(&self, kernel: MlaKernel) -> bool {
        kernel == MlaKernel::Hopper
            || (self.ws_tile == 0
                && self.probe == 0
                && !self.transposed
                && !self.unswizzled
                && self.q_regs == 0
                && self.copies <= 1)
    }

    /// Tensor copies a split-role tile comes in.
    fn ws_copies(&self) -> usize {
        self.copies.max(1)
    }

    /// Tokens per tile of the split-role kernels to compile, largest first.
    fn ws_tiles(&self) -> Vec<usize> {
        if self.ws_tile == 0 {
            vec![64, 32]
        } else {
            vec![self.ws_tile]
        }
    }
}
/// Shared memory of `mla_decode_split_wg`: Q, two tiles, P and the row exchange (`WgSmem`).
const HOPPER_SMEM: usize = 64 * D * 2 + 2 * BN * D * 2 + 64 * BN * 2 + 2 * 64 * 4;
/// Whether pages of `page_size` tokens hold whole tiles of `tile` (a copy never crosses a page).
fn holds_whole(page_size: usize, tile: usize) -> bool {
    page_size > 0 && page_size.is_multiple_of(tile)
}

/// Threads of `mla_decode_split_ws` (three warpgroups).
const WS_THREADS: u32 = 384;
/// Slack for aligning swizzled stages to 1 KiB.
fn swizzle_slack(swizzled: bool) -> usize {
    usize::from(swizzled) * 1024
}

/// Shared memory of `mla_decode_split_ws` (`WsSmem`) at `tile` tokens a tile: Q, the stages (four
/// of 32 tokens, two of 64), the P buffers with their rescale factors (two; one at 64), the row
/// sums and maxima, a barrier per stage and copy, one more per stage and two per P buffer, and
/// a row count per stage; with swizzled stages 1 KiB of slack to align them.
fn ws_smem(tile: usize, swizzled: bool, copies: usize) -> usize {
    let (stages, pbuf) = if tile == 64 { (2, 1) } else { (4, 2) };
    swizzle_slack(swizzled)
        + 64 * D * 2
        + stages * tile * D * 2
        + pbuf * 64 * tile * 2
        + pbuf * 64 * 4
        + 2 * 64 * 4
        + ((copies + 1) * stages + 2 * pbuf) * 8
        + stages * 4
}

/// Tokens per tile of `mla_decode_split_tr` and its threads (three warpgroups).
const TR_BN: usize = 64;
const TR_THREADS: u32 = 384;

/// Heads per block of `mla_decode_split_tr` (`MLA_TR_HEADS`) for `heads` (a multiple of 16): the
/// largest of 48, 32 and 16 that divides it.
fn tr_heads(heads: usize) -> usize {
    [48, 32, 16]
        .into_iter()
        .find(|h| heads.is_multiple_of(*h))
        .unwrap_or(16)
}

/// Shared memory of `mla_decode_split_tr` (`TrSmem`) for `h` heads a block: Q, two stages, two
/// Pᵀ buffers, their rescale factors, two buffers of four warps' column maxima, the sums and
/// maxima, eight barriers and two row counts; with swizzled stages 1 KiB of slack to align them.
fn tr_smem(h: usize, swizzled: bool) -> usize {
    swizzle_slack(swizzled)
        + h * D * 2
        + 2 * TR_BN * D * 2
        + 2 * TR_BN * h * 2
        + 2 * h * 4
        + 8 * h * 4
        + 2 * h * 4
        + 8 * 8
        + 2 * 4
}

/// The tensor map of the latent cache (`rows` tokens of 576 bf16) for the copy-engine split
/// kernels, read in 3-D boxes of `width` dims × `tile` tokens × 576 / `width` chunks: with 8
/// (no swizzle) a tile lands as 72 planes of `tile` tokens × 16 bytes, with 64 (the 128-byte
/// swizzle) as 9 chunks of `tile` rows × 128 bytes; a box holds 1 / `copies` of the chunks.
fn cache_map(
    ptr: u64,
    rows: usize,
    tile: usize,
    swizzled: bool,
    copies: usize,
) -> Result<TensorMapArg, CudaError> {
    use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};
    let (width, swizzle) = if swizzled {
        (64, CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
    } else {
        (8, CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE)
    };
    let chunks = (D / width) as u64;
    tensor_map::tiled(
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        ptr,
        &[width as u64, rows as u64, chunks],
        &[D as u64 * 2, width as u64 * 2],
        &[width as u32, tile as u32, (chunks as usize / copies) as u32],
        swizzle,
    )
}

/// A copy-engine split kernel chosen for a call: tokens per tile (the tensor map's box), threads,
/// shared memory, heads per block, whether tiles land swizzled and in how many copies.
struct Launchable<'a> {
    func: &'a CudaFunction,
    tile: usize,
    swizzled: bool,
    copies: usize,
    threads: u32,
    smem: u32,
    heads_per_block: usize,
}

/// Per-split partial outputs and log-sum-exps for one shape (reuse across calls).
pub struct MlaDecodeWorkspace {
    shape: MlaDecodeShape,
    o_part: CudaSlice<f32>,
    lse_part: CudaSlice<f32>,
}

impl MlaDecodeWorkspace {
    pub fn new(dev: &CudaDevice, shape: MlaDecodeShape) -> Result<Self, CudaError> {
        let n = shape.batch * shape.splits * shape.heads;
        Ok(MlaDecodeWorkspace {
            shape,
            o_part: dev.stream().alloc_zeros(n * MLA_RANK)?,
            lse_part: dev.stream().alloc_zeros(n)?,
        })
    }
}

/// Shared memory of `mla_decode_split` for `mt` 16-head tiles; mirrors `MlaSmem`.
fn smem_bytes(mt: usize) -> usize {
    let hb = 16 * mt;
    let (qld, sld, pld) = (D + 8, BN + 4, BN + 8);
    hb * qld * 2 + 2 * BN * qld * 2 + hb * sld * 4 + hb * pld * 2 + 3 * hb * 4
}

impl MlaDecode {
    /// Compiles the kernels for `heads` query heads (a multiple of 16): the portable split
    /// kernel (see [`MlaKernel`]).
    pub fn load(dev: &CudaDevice, heads: usize) -> Result<Self, CudaError> {
        Self::load_kernel(dev, heads, MlaKernel::Portable)
    }

    /// [`MlaDecode::load`] with the split kernel chosen by the caller (Hopper needs `sm_90`).
    pub fn load_kernel(
        dev: &CudaDevice,
        heads: usize,
        kernel: MlaKernel,
    ) -> Result<Self, CudaError> {
        Self::load_tuned(dev, heads, kernel, MlaTuning::default())
    }

    /// [`MlaDecode::load_kernel`] built with `tuning` (for measuring alternatives).
    #[doc(hidden)]
    pub fn load_tuned(
        dev: &CudaDevice,
        heads: usize,
        kernel: MlaKernel,
        tuning: MlaTuning,
    ) -> Result<Self, CudaError> {
        match kernel {
            MlaKernel::Portable => Self::load_portable(dev, heads, tuning),
            MlaKernel::Hopper => Self::load_hopper(dev, heads, tuning),
        }
    }

    /// The warpgroup kernel: blocks of 64 heads (the last block's rows past `heads` idle).
    fn load_hopper(dev: &CudaDevice, heads: usize, tuning: MlaTuning) -> Result<Self, CudaError> {
        if heads == 0 || !heads.is_multiple_of(16) {
            return Err(shape_err(format!(
                "{heads} heads: must be a positive multiple of 16"
            )));
        }
        if !matches!(tuning.ws_tile, 0 | 32 | 64) {
            return Err(shape_err(format!(
                "split-role tiles of {} tokens: 32 or 64",
                tuning.ws_tile
            )));
        }
        if !matches!(tuning.ws_copies(), 1 | 3 | 9) || (tuning.unswizzled && tuning.ws_copies() > 1)
        {
            return Err(shape_err(format!(
                "a tile in {} copies: 1, 3 or 9, more than one with swizzled tiles",
                tuning.copies
            )));
        }
        let combine = dev
            .module(
                "mla_decode",
                MLA_DECODE_SOURCE,
                &[("MLA_MT", "1".to_string())],
            )?
            .load_function("mla_decode_combine")?;
        let tr_h = tr_heads(heads);
        let swizzled = !tuning.unswizzled;
        let with_smem = |f: CudaFunction, bytes: usize| -> Result<CudaFunction, CudaError> {
            allow_dynamic_smem(&f, bytes)?;
            Ok(f)
        };
        // One module per split-role tile size; the first also gives the other kernels.
        let mut modules = Vec::new();
        for tile in tuning.ws_tiles() {
            let mut defines = tuning.defines().to_vec();
            defines.push(("MLA_WS_BN", tile.to_string()));
            defines.push(("MLA_TR_HEADS", tr_h.to_string()));
            let m = dev.module_for(
                "sm_90a",
                "mla_decode_sm90",
                MLA_DECODE_SM90_SOURCE,
                &defines,
            )?;
            modules.push((tile, m));
        }
        let split_ws = modules
            .iter()
            .map(|(tile, m)| {
                let f = m.load_function("mla_decode_split_ws")?;
                Ok((
                    *tile,
                    with_smem(f, ws_smem(*tile, swizzled, tuning.ws_copies()))?,
                ))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let m = &modules[0].1;
        let split = with_smem(m.load_function("mla_decode_split_wg")?, HOPPER_SMEM)?;
        let split_tr = if tuning.transposed {
            let f = m.load_function("mla_decode_split_tr")?;
            Some((with_smem(f, tr_smem(tr_h, swizzled))?, tr_h))
        } else {
            None
        };
        Ok(MlaDecode {
            split,
            split_ws,
            split_tr,
            combine,
            heads,
            heads_per_block: 64,
            threads: 256,
            smem: HOPPER_SMEM as u32,
            sms: dev.sm_count()?,
            hopper: true,
            tuning,
        })
    }

    /// The portable kernel: blocks of 48 heads when `heads / 16` is a multiple of 3 (K3's 96),
    /// else 32 or 16.
    fn load_portable(dev: &CudaDevice, heads: usize, tuning: MlaTuning) -> Result<Self, CudaError> {
        if heads == 0 || !heads.is_multiple_of(16) {
            return Err(shape_err(format!(
                "{heads} heads: must be a positive multiple of 16"
            )));
        }
        let tiles = heads / 16;
        let mt = [3, 2, 1]
            .into_iter()
            .find(|m| tiles.is_multiple_of(*m))
            .unwrap_or(1);
        let m = dev.module(
            "mla_decode",
            MLA_DECODE_SOURCE,
            &[[("MLA_MT", mt.to_string())].as_slice(), &tuning.defines()].concat(),
        )?;
        let split = m.load_function("mla_decode_split")?;
        let combine = m.load_function("mla_decode_combine")?;
        let smem = smem_bytes(mt);
        allow_dynamic_smem(&split, smem)?;
        Ok(MlaDecode {
            split,
            split_ws: Vec::new(),
            split_tr: None,
            combine,
            heads,
            heads_per_block: 16 * mt,
            threads: 128 * mt as u32,
            smem: smem as u32,
            sms: dev.sm_count()?,
            hopper: false,
            tuning,
        })
    }

    /// The copy-engine split kernel where pages hold whole tiles: the transposed one if loaded
    /// and the pages hold whole 64-token tiles, else the split-role one of the largest tile
    /// that the pages hold whole.
    fn copy_engine_kernel(&self, page_size: usize) -> Option<Launchable<'_>> {
        let swizzled = !self.tuning.unswizzled;
        if let Some((func, h)) = self
            .split_tr
            .as_ref()
            .filter(|_| holds_whole(page_size, TR_BN))
        {
            return Some(Launchable {
                func,
                tile: TR_BN,
                swizzled,
                copies: 1,
                threads: TR_THREADS,
                smem: tr_smem(*h, swizzled) as u32,
                heads_per_block: *h,
            });
        }
        let (tile, func) = self
            .split_ws
            .iter()
            .find(|(tile, _)| holds_whole(page_size, *tile))?;
        Some(Launchable {
            func,
            tile: *tile,
            swizzled,
            copies: self.tuning.ws_copies(),
            threads: WS_THREADS,
            smem: ws_smem(*tile, swizzled, self.tuning.ws_copies()) as u32,
            heads_per_block: self.heads_per_block,
        })
    }

    /// The split kernel in use.
    pub fn kernel(&self) -> MlaKernel {
        if self.hopper {
            MlaKernel::Hopper
        } else {
            MlaKernel::Portable
        }
    }

    /// The build-time choices of the split kernel.
    #[doc(hidden)]
    pub fn tuning(&self) -> MlaTuning {
        self.tuning
    }

    /// Blocks per sequence and split: the transposed kernel's when it is loaded (it serves the
    /// usual pages of 64 tokens and more).
    fn head_blocks(&self) -> usize {
        let per_block = self
            .split_tr
            .as_ref()
            .map_or(self.heads_per_block, |(_, h)| *h);
        self.heads.div_ceil(per_block)
    }

    /// A context split for `batch` sequences of up to `max_context` tokens: the fewest splits
    /// whose blocks fill the SMs in whole waves to within 10%, keeping ≥ 4 tiles per split.
    pub fn splits_for(&self, batch: usize, max_context: usize) -> usize {
        let blocks = batch * self.head_blocks();
        let max_splits = (max_context.div_ceil(BN) / 4).clamp(1, 64);
        (1..=max_splits)
            .find(|&s| {
                let n = blocks * s;
                n >= self.sms && (n as f64) / ((n.div_ceil(self.sms) * self.sms) as f64) >= 0.9
            })
            .unwrap_or(max_splits)
    }

    /// `out [batch, heads, 512] (bf16)` = absorbed attention of `q [batch, heads, 576]` over
    /// the paged latent cache, with softmax scale `scale` (1/√(qk_nope + qk_rope) in K3).
    pub fn decode(
        &self,
        dev: &CudaDevice,
        q: &CudaSlice<u16>,
        pages: &MlaPages,
        scale: f32,
        ws: &mut MlaDecodeWorkspace,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let sh = ws.shape;
        if sh.heads != self.heads {
            return Err(shape_err(format!(
                "kernels built for {} heads, workspace for {}",
                self.heads, sh.heads
            )));
        }
        if sh.splits == 0 || sh.splits > 65535 || sh.batch > 65535 {
            return Err(shape_err(format!("{sh:?} out of range")));
        }
        if pages.page_size == 0 || pages.max_pages == 0 {
            return Err(shape_err("empty page geometry".to_string()));
        }
        let num_pages = pages.cache.len() / (pages.page_size * D);
        let checks = [
            ("q", q.len(), sh.batch * sh.heads * D),
            ("out", out.len(), sh.batch * sh.heads * MLA_RANK),
            (
                "page_table",
                pages.page_table.len(),
                sh.batch * pages.max_pages,
            ),
            ("seq_lens", pages.seq_lens.len(), sh.batch),
        ];
        for (what, got, want) in checks {
            if got < want {
                return Err(shape_err(format!(
                    "{what} holds {got} values, needs {want}"
                )));
            }
        }
        if sh.batch == 0 {
            return Ok(());
        }
        let capacity = pages.max_pages * pages.page_size;
        if capacity > i32::MAX as usize || num_pages > i32::MAX as usize {
            return Err(shape_err(format!("{capacity} tokens per sequence")));
        }
        let (heads_i, ps_i, mp_i, np_i) = (
            sh.heads as i32,
            pages.page_size as i32,
            pages.max_pages as i32,
            num_pages as i32,
        );
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let s = dev.stream();
        // The copy-engine kernel where pages hold whole tiles: the cache goes in as its tensor
        // map.
        let (cache_ptr, _keep) = pages.cache.device_ptr(s);
        let engine = self.copy_engine_kernel(pages.page_size);
        let map = match &engine {
            Some(k) => Some(cache_map(
                cache_ptr,
                num_pages * pages.page_size,
                k.tile,
                k.swizzled,
                k.copies,
            )?),
            None => None,
        };
        let (func, threads, smem, per_block) = match engine {
            Some(k) => (k.func, k.threads, k.smem, k.heads_per_block),
            None => (&self.split, self.threads, self.smem, self.heads_per_block),
        };
        let cfg = LaunchConfig {
            grid_dim: (
                sh.splits as u32,
                sh.heads.div_ceil(per_block) as u32,
                sh.batch as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut launch = s.launch_builder(func);
        launch.arg(q);
        match &map {
            Some(map) => launch.arg(map),
            None => launch.arg(pages.cache),
        };
        launch
            .arg(pages.page_table)
            .arg(pages.seq_lens)
            .arg(&mut ws.o_part)
            .arg(&mut ws.lse_part)
            .arg(&heads_i)
            .arg(&ps_i)
            .arg(&mp_i)
            .arg(&np_i)
            .arg(&scale_log2);
        // SAFETY: the argument list matches `mla_decode_split` (or `mla_decode_split_ws` /
        // `_tr`, whose map covers the whole pool and whose tiles never cross a page); q, the page table, the
        // lengths and the workspace hold `batch` sequences (checked above); the kernels clamp
        // lengths to the table's capacity and skip page ids outside the pool.
        unsafe { launch.launch(cfg) }?;
        let splits_i = sh.splits as i32;
        let cfg = LaunchConfig {
            grid_dim: (sh.heads as u32, sh.batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = s.launch_builder(&self.combine);
        launch
            .arg(&ws.o_part)
            .arg(&ws.lse_part)
            .arg(out)
            .arg(&heads_i)
            .arg(&splits_i);
        // SAFETY: the argument list matches `mla_decode_combine`; sizes checked above.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{holds_whole, tr_heads, tr_smem, ws_smem, MlaTuning};

    /// What one block may ask for on sm_90 (227 KiB).
    const SMEM_MAX: usize = 227 * 1024;

    #[test]
    fn every_copy_engine_kernel_fits_in_shared_memory_with_the_swizzle_slack() {
        for swizzled in [false, true] {
            for (tile, copies) in [(32, 1), (64, 1), (32, 9), (64, 9)] {
                let bytes = ws_smem(tile, swizzled, copies);
                assert!(
                    bytes <= SMEM_MAX,
                    "split roles, {tile} tokens, {copies}: {bytes}"
                );
            }
            for heads in [16, 32, 48] {
                let bytes = tr_smem(heads, swizzled);
                assert!(bytes <= SMEM_MAX, "transposed, {heads} heads: {bytes}");
            }
        }
        assert_eq!(ws_smem(64, true, 1), ws_smem(64, false, 1) + 1024);
        // A barrier per copy and stage (two stages of 64 tokens).
        assert_eq!(ws_smem(64, true, 3), ws_smem(64, true, 1) + 2 * 2 * 8);
    }

    #[test]
    fn split_role_tiles_are_the_largest_the_pages_hold_whole() {
        let tiles = MlaTuning::default().ws_tiles();
        let pick = |page: usize| tiles.iter().copied().find(|t| holds_whole(page, *t));
        assert_eq!(pick(64), Some(64));
        assert_eq!(pick(128), Some(64));
        assert_eq!(pick(32), Some(32));
        assert_eq!(pick(96), Some(32));
        assert_eq!(pick(16), None);
        assert_eq!(pick(0), None);
        let only32 = MlaTuning {
            ws_tile: 32,
            ..MlaTuning::default()
        };
        assert_eq!(only32.ws_tiles(), vec![32]);
    }

    #[test]
    fn transposed_blocks_take_the_largest_head_count_that_divides() {
        assert_eq!(tr_heads(96), 48);
        assert_eq!(tr_heads(64), 32);
        assert_eq!(tr_heads(16), 16);
        assert_eq!(tr_heads(80), 16);
    }
}
