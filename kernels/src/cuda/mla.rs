//! MLA decode in absorbed form on CUDA (`mla_decode.cu`): one query token per sequence against
//! the paged bf16 latent cache (512 latent + 64 rope-slot dims per token), the context split
//! across blocks and merged by log-sum-exp. Semantics of [`crate::cpu::mla_absorbed_attention`]
//! with `t = 1`: `q` is `[batch, heads, 576]` (absorbed q_nope ++ q_pe), the output the latent
//! `[batch, heads, 512]` in bf16.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaError, MLA_DECODE_SOURCE};

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
    combine: CudaFunction,
    heads: usize,
    heads_per_block: usize,
    smem: u32,
    sms: usize,
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
    /// Compiles the kernels for `heads` query heads (a multiple of 16): blocks of 48 heads when
    /// `heads / 16` is a multiple of 3 (K3's 96), else 32 or 16.
    pub fn load(dev: &CudaDevice, heads: usize) -> Result<Self, CudaError> {
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
            &[("MLA_MT", mt.to_string())],
        )?;
        let split = m.load_function("mla_decode_split")?;
        let combine = m.load_function("mla_decode_combine")?;
        let smem = smem_bytes(mt) as u32;
        split.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let sms = dev
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as usize;
        Ok(MlaDecode {
            split,
            combine,
            heads,
            heads_per_block: 16 * mt,
            smem,
            sms,
        })
    }

    /// A context split for `batch` sequences of up to `max_context` tokens: the fewest splits
    /// whose blocks fill the SMs in whole waves to within 10%, keeping ≥ 4 tiles per split.
    pub fn splits_for(&self, batch: usize, max_context: usize) -> usize {
        let blocks = batch * (self.heads / self.heads_per_block);
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
        let cfg = LaunchConfig {
            grid_dim: (
                sh.splits as u32,
                (sh.heads / self.heads_per_block) as u32,
                sh.batch as u32,
            ),
            block_dim: (8 * self.heads_per_block as u32, 1, 1),
            shared_mem_bytes: self.smem,
        };
        let (heads_i, ps_i, mp_i, np_i) = (
            sh.heads as i32,
            pages.page_size as i32,
            pages.max_pages as i32,
            num_pages as i32,
        );
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let mut launch = dev.stream().launch_builder(&self.split);
        launch
            .arg(q)
            .arg(pages.cache)
            .arg(pages.page_table)
            .arg(pages.seq_lens)
            .arg(&mut ws.o_part)
            .arg(&mut ws.lse_part)
            .arg(&heads_i)
            .arg(&ps_i)
            .arg(&mp_i)
            .arg(&np_i)
            .arg(&scale_log2);
        // SAFETY: the argument list matches `mla_decode_split`; q, the page table, the lengths
        // and the workspace hold `batch` sequences (checked above); the kernel clamps lengths to
        // the table's capacity and skips page ids outside the pool.
        unsafe { launch.launch(cfg) }?;
        let splits_i = sh.splits as i32;
        let cfg = LaunchConfig {
            grid_dim: (sh.heads as u32, sh.batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = dev.stream().launch_builder(&self.combine);
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
