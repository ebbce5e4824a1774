//! MLA attention of the whole-model forward, in absorbed form: `q_nope` absorbed into the latent
//! (`mla_absorb_q`), attention over the sequence's paged f32 latent history, the latent output
//! un-absorbed through `W_UV` (`mla_unabsorb`). The attention itself runs either
//! - **flash** (`mla_flash.cu`, the default outside the exact mode): tiles of the history
//!   streamed through shared memory as bf16, products on the tensor cores, an online softmax,
//!   a decode call's history split across blocks; no scratch but the splits' partials. Ranks
//!   up to [`FLASH_MAX_RANK`] and `rank + rope` up to [`FLASH_MAX_WIDTH`]; or
//! - **generic** (`mla_attend` in `model.cu`): a block per (row, head), f32 throughout, with a
//!   scores scratch of `[rows, heads, max_visible]` — the exact mode's path, the fallback for
//!   wider latents, and everywhere with `TESSERA_MLA_PATH=generic` in the environment.

use cudarc::driver::{CudaFunction, LaunchConfig};

use super::launch::allow_dynamic_smem;
use super::model_ops::{grid, grid3, i, launch_fn, Arg, DevPtr, PagedHistory, MT};
use super::{CudaDevice, CudaError, ModelKernels};

/// The flash kernel's source.
pub const MLA_FLASH_SOURCE: &str = include_str!("mla_flash.cu");
/// Widest latent (`kv_lora_rank`) the flash kernel takes (`FL_MAX_RP`).
pub const FLASH_MAX_RANK: usize = 512;
/// Widest latent row (`rank + rope`) the flash kernel takes.
pub const FLASH_MAX_WIDTH: usize = 640;
/// (row, head) items of the two flash block sizes (`FL_HB`; 8 threads each), and the history
/// tile (`FL_BN`). Wide blocks read each tile for twice the items but fit once per SM; narrow
/// ones fit twice. On an H200 wide blocks prefill 1.1-1.4x faster and decode K3's 96 heads
/// 1.3x faster, narrow ones decode 16 heads (one row per block) 1.3x faster.
const NARROW: usize = 32;
const WIDE: usize = 64;
const TILE: usize = 32;

/// Bytes of the flash kernel's fixed shared memory (`FlashTail`) for blocks of `items`.
fn tail_bytes(items: usize) -> usize {
    items * (TILE + 4) * 4 + items * (TILE + 8) * 2 + 4 * items * 4
}
/// History tiles per split of a decode call (16 × 32 = 512 tokens).
const DECODE_TILES_PER_SPLIT: usize = 16;

/// MLA in absorbed form for `rows` query rows in `segments` sequences (the rows of a sequence
/// consecutive): `q [rows, heads, nope+rope]` f32, `kv_b [heads·(nope+v_dim), rank]` bf16 (f32
/// when exact), a paged latent history of rows `[rank + rope]` f32 of which row `t` sees the
/// first `visible[t]` (i32 device array, at most `max_visible`), scratch `q_lat, lat [rows,
/// heads, rank]` and `scratch` of [`ModelKernels::mla_scratch_floats`] floats, output `out
/// [rows, heads·v_dim]`.
pub struct MlaAbsorbed {
    pub q: DevPtr,
    pub kv_b: DevPtr,
    pub hist: PagedHistory,
    pub visible: DevPtr,
    pub q_lat: DevPtr,
    pub lat: DevPtr,
    pub scratch: DevPtr,
    pub out: DevPtr,
    pub rows: usize,
    pub segments: usize,
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub rank: usize,
    pub max_visible: usize,
    pub scale: f32,
}

/// One compiled block size of the flash kernel.
struct FlashVariant {
    attend: CudaFunction,
    combine: CudaFunction,
}

/// The flash kernels, narrow and wide blocks.
pub(super) struct FlashKernels {
    narrow: FlashVariant,
    wide: FlashVariant,
}

impl FlashVariant {
    fn load(dev: &CudaDevice, items: usize) -> Result<Self, CudaError> {
        let defines = [("FL_MT", (items / 16).to_string())];
        let m = dev.module("mla_flash", MLA_FLASH_SOURCE, &defines)?;
        let attend = m.load_function("mla_flash")?;
        allow_dynamic_smem(
            &attend,
            smem_bytes(items, FLASH_MAX_RANK, FLASH_MAX_WIDTH - FLASH_MAX_RANK),
        )?;
        Ok(FlashVariant {
            attend,
            combine: m.load_function("mla_flash_combine")?,
        })
    }
}

impl FlashKernels {
    pub(super) fn load(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(FlashKernels {
            narrow: FlashVariant::load(dev, NARROW)?,
            wide: FlashVariant::load(dev, WIDE)?,
        })
    }

    fn variant(&self, items: usize) -> &FlashVariant {
        if items == WIDE {
            &self.wide
        } else {
            &self.narrow
        }
    }
}

/// Shared memory of one flash block; mirrors the layout in `mla_flash.cu`.
fn smem_bytes(items: usize, rank: usize, rope: usize) -> usize {
    let dp = (rank + rope).div_ceil(32) * 32;
    let rp = rank.div_ceil(64) * 64;
    (items + TILE) * (dp.max(rp) + 8) * 2 + tail_bytes(items)
}

/// How one flash call covers its rows: blocks of `items` (row, head) items used as
/// `rows_per_block × heads_per_block`, head groups, history splits of `tiles_per_split` tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashPlan {
    pub items: usize,
    pub rows_per_block: usize,
    pub heads_per_block: usize,
    pub head_groups: usize,
    pub splits: usize,
    pub tiles_per_split: usize,
}

impl FlashPlan {
    /// Wide blocks for prefill and for rows of more than 32 heads, else narrow ones. Heads are
    /// spread evenly over the fewest groups that fit a block. Prefill (some sequence has
    /// several rows): a block takes as many rows of a sequence as its heads leave room for, and
    /// the whole history. Decode (one row per sequence): a block per row, the history split
    /// every 512 tokens so that one long sequence still spreads over the device. The split
    /// depends only on each row's own length, never on the call's bound, so a decode step
    /// replayed from a graph (captured for a bucketed bound) computes what the same step run
    /// directly does, bit for bit.
    fn new(m: &MlaAbsorbed) -> Self {
        let prefill = m.rows > m.segments;
        let items = if prefill || m.heads > NARROW {
            WIDE
        } else {
            NARROW
        };
        let head_groups = m.heads.div_ceil(items).max(1);
        let heads_per_block = m.heads.div_ceil(head_groups);
        if prefill {
            return FlashPlan {
                items,
                rows_per_block: (items / heads_per_block).max(1),
                heads_per_block,
                head_groups,
                splits: 1,
                tiles_per_split: i32::MAX as usize,
            };
        }
        FlashPlan {
            items,
            rows_per_block: 1,
            heads_per_block,
            head_groups,
            splits: m
                .max_visible
                .div_ceil(TILE)
                .div_ceil(DECODE_TILES_PER_SPLIT)
                .max(1),
            tiles_per_split: DECODE_TILES_PER_SPLIT,
        }
    }
}

impl ModelKernels {
    /// Whether calls of this shape take the flash kernel.
    fn takes_flash(&self, rank: usize, rope: usize) -> bool {
        self.flash.is_some()
            && self.mla_flash
            && rank <= FLASH_MAX_RANK
            && rank + rope <= FLASH_MAX_WIDTH
    }

    /// Routes later MLA calls to the flash kernel (`true`, the default where it applies) or the
    /// generic one; for comparing the two.
    #[doc(hidden)]
    pub fn set_mla_flash(&mut self, on: bool) {
        self.mla_flash = on;
    }

    /// The flash plan a call of this shape takes (`None`: the generic kernel).
    pub fn mla_flash_plan(&self, m: &MlaAbsorbed) -> Option<FlashPlan> {
        self.takes_flash(m.rank, m.rope).then(|| FlashPlan::new(m))
    }

    /// Floats of [`MlaAbsorbed::scratch`] a call of this shape needs (`q`, `kv_b` and the
    /// pointers of `m` are not read).
    pub fn mla_scratch_floats(&self, m: &MlaAbsorbed) -> usize {
        match self.mla_flash_plan(m) {
            Some(p) if p.splits > 1 => p.splits * m.rows * m.heads * (m.rank + 1),
            Some(_) => 1,
            None => (m.rows * m.heads * m.max_visible).max(1),
        }
    }

    /// MLA absorbed attention; see [`MlaAbsorbed`].
    pub fn mla_absorbed(&self, dev: &CudaDevice, m: &MlaAbsorbed) -> Result<(), CudaError> {
        let (t, h) = (m.rows, m.heads);
        let a = [
            Arg::P(m.q),
            Arg::P(m.kv_b),
            Arg::P(m.q_lat),
            i(h),
            i(m.nope),
            i(m.rope),
            i(m.v_dim),
            i(m.rank),
            self.ex(),
        ];
        let cols = m.rank.div_ceil(MT as usize);
        self.launch(dev, "mla_absorb_q", grid3(t, h, cols, MT), &a)?;
        self.mla_attention(dev, m)?;
        let a = [
            Arg::P(m.lat),
            Arg::P(m.kv_b),
            Arg::P(m.out),
            i(h),
            i(m.nope),
            i(m.v_dim),
            i(m.rank),
            self.ex(),
        ];
        let warps = (MT / 32) as usize;
        self.launch(
            dev,
            "mla_unabsorb",
            grid3(t, h, m.v_dim.div_ceil(warps), MT),
            &a,
        )
    }

    /// The attention alone: `lat` from `q_lat`, `q`'s rope part and the history (the middle of
    /// [`ModelKernels::mla_absorbed`]).
    pub fn mla_attention(&self, dev: &CudaDevice, m: &MlaAbsorbed) -> Result<(), CudaError> {
        if m.rows == 0 {
            return Ok(());
        }
        if let (Some(plan), Some(f)) = (self.mla_flash_plan(m), &self.flash) {
            return self.flash_attend(dev, f, m, plan);
        }
        let a = [
            Arg::P(m.q_lat),
            Arg::P(m.q),
            Arg::P(m.hist.base),
            Arg::P(m.hist.pages),
            Arg::P(m.hist.first),
            i(m.hist.page_tokens),
            Arg::P(m.visible),
            Arg::P(m.scratch),
            Arg::P(m.lat),
            i(m.heads),
            i(m.nope),
            i(m.rope),
            i(m.rank),
            i(m.max_visible),
            Arg::F(m.scale),
        ];
        self.launch(dev, "mla_attend", grid(m.rows, m.heads, MT, 0), &a)
    }

    fn flash_attend(
        &self,
        dev: &CudaDevice,
        f: &FlashKernels,
        m: &MlaAbsorbed,
        p: FlashPlan,
    ) -> Result<(), CudaError> {
        let f = f.variant(p.items);
        let split = p.splits > 1;
        let o_part = if split { m.scratch } else { 0 };
        let lse_part = if split {
            m.scratch + (p.splits * m.rows * m.heads * m.rank * 4) as u64
        } else {
            0
        };
        let cfg = LaunchConfig {
            grid_dim: (
                m.rows.div_ceil(p.rows_per_block) as u32,
                p.head_groups as u32,
                p.splits as u32,
            ),
            block_dim: (8 * p.items as u32, 1, 1),
            shared_mem_bytes: smem_bytes(p.items, m.rank, m.rope) as u32,
        };
        let a = [
            Arg::P(m.q_lat),
            Arg::P(m.q),
            Arg::P(m.hist.base),
            Arg::P(m.hist.pages),
            Arg::P(m.hist.first),
            i(m.hist.page_tokens),
            Arg::P(m.visible),
            Arg::P(m.lat),
            Arg::P(o_part),
            Arg::P(lse_part),
            i(m.rows),
            i(m.heads),
            i(m.nope),
            i(m.rope),
            i(m.rank),
            i(p.heads_per_block),
            i(p.rows_per_block),
            i(p.tiles_per_split),
            Arg::F(m.scale * std::f32::consts::LOG2_E),
        ];
        // SAFETY: `mla_flash`'s arguments in order and type; the extents are the caller's
        // contract on `MlaAbsorbed` (the scratch sized by `mla_scratch_floats`).
        unsafe { launch_fn(dev, &f.attend, cfg, &a) }?;
        if split {
            let a = [
                Arg::P(o_part),
                Arg::P(lse_part),
                Arg::P(m.lat),
                i(m.rows),
                i(m.heads),
                i(m.rank),
                i(p.splits),
            ];
            // SAFETY: `mla_flash_combine`'s arguments in order and type; the partials were
            // written by the launch above over the same rows and heads.
            unsafe { launch_fn(dev, &f.combine, grid(m.rows * m.heads, 1, 128, 0), &a) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(rows: usize, segments: usize, heads: usize, max_visible: usize) -> MlaAbsorbed {
        MlaAbsorbed {
            q: 0,
            kv_b: 0,
            hist: PagedHistory {
                base: 0,
                pages: 0,
                first: 0,
                page_tokens: 16,
            },
            visible: 0,
            q_lat: 0,
            lat: 0,
            scratch: 0,
            out: 0,
            rows,
            segments,
            heads,
            nope: 128,
            rope: 64,
            v_dim: 128,
            rank: 512,
            max_visible,
            scale: 1.0,
        }
    }

    #[test]
    fn heads_spread_evenly_over_the_fewest_blocks() {
        // Decode: narrow blocks up to 32 heads, wide ones beyond.
        for (heads, items, per_block, groups) in [
            (1, 32, 1, 1),
            (16, 32, 16, 1),
            (32, 32, 32, 1),
            (40, 64, 40, 1),
            (96, 64, 48, 2),
            (200, 64, 50, 4),
        ] {
            let p = FlashPlan::new(&call(1, 1, heads, 1));
            let got = (p.items, p.heads_per_block, p.head_groups);
            assert_eq!(got, (items, per_block, groups), "{heads} heads");
        }
    }

    #[test]
    fn prefill_packs_rows_of_a_sequence_into_wide_blocks_over_the_whole_history() {
        let p = FlashPlan::new(&call(4096, 1, 16, 4096));
        assert_eq!((p.items, p.rows_per_block, p.splits), (64, 4, 1));
        let p = FlashPlan::new(&call(40, 3, 2, 100_000));
        assert_eq!((p.rows_per_block, p.splits), (32, 1));
        let p = FlashPlan::new(&call(10, 2, 96, 10));
        assert_eq!((p.heads_per_block, p.rows_per_block), (48, 1));
    }

    #[test]
    fn decode_splits_every_512_tokens_whatever_the_batch() {
        for rows in [1, 7, 64] {
            for (bound, splits) in [(1, 1), (512, 1), (513, 2), (4096, 8), (16384, 32)] {
                let p = FlashPlan::new(&call(rows, rows, 96, bound));
                assert_eq!(p.rows_per_block, 1);
                assert_eq!(p.splits, splits, "bound {bound}");
                // The tiles a split covers are fixed, so a row's partials do not depend on
                // the bound the call was planned for (a replayed graph's bucket).
                assert_eq!(p.tiles_per_split * TILE, 512);
            }
        }
    }

    #[test]
    fn shared_memory_of_the_widest_latent_fits_two_narrow_blocks_or_one_wide_per_sm() {
        let (rank, rope) = (FLASH_MAX_RANK, FLASH_MAX_WIDTH - FLASH_MAX_RANK);
        let narrow = smem_bytes(NARROW, rank, rope);
        assert!(2 * narrow <= 227 * 1024, "{narrow} bytes");
        assert!(smem_bytes(WIDE, rank, rope) <= 227 * 1024);
        // K3 / medium widths: 512 + 64.
        let tail = tail_bytes(NARROW);
        assert_eq!(
            smem_bytes(NARROW, 512, 64),
            (32 + 32) * (576 + 8) * 2 + tail
        );
        // Narrow fixtures: the reduction pads to 32, the latent output to 64.
        assert_eq!(smem_bytes(NARROW, 16, 4), (32 + 32) * (64 + 8) * 2 + tail);
    }
}
