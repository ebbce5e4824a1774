//! The KDA chunk scans fed by the copy engine (Hopper): `kda_scan_tma.cu` (mma.sync products),
//! `kda_scan_tma_wg.cu` (warpgroup MMAs, operands in shared memory) and `kda_scan_tma_rs.cu`
//! (warpgroup MMAs, the state transposed and the left operands in registers); the prep's
//! products as tensor maps (the 128-byte swizzle), and the launch.

use cudarc::driver::sys::{CUtensorMapDataType, CUtensorMapSwizzle};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::kda::KdaPacked;
use super::kda_workspace::KdaPrefillWorkspace;
use super::launch::allow_dynamic_smem;
use super::model_ops::DevPtr;
use super::tensor_map::{self, TensorMapArg};
use super::{
    CudaDevice, CudaError, KDA_SCAN_TMA_RS_SOURCE, KDA_SCAN_TMA_SOURCE, KDA_SCAN_TMA_WG_SOURCE,
};
use crate::gpu::{define_value, CHUNK};

/// Chunks in flight per block and compute warps per block, unless the defines say otherwise.
const DEFAULT_STAGES: usize = 2;
const DEFAULT_WARPS: usize = 8;

/// The products of a copy-engine scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TmaProducts {
    /// mma.sync by 4 or 8 warps (`kda_chunk_scan_tma`).
    Warps,
    /// wgmma by two warpgroups (`kda_chunk_scan_tma_wg`).
    Warpgroups,
    /// wgmma with the left operands in registers, one or two warpgroups each on 64 value columns
    /// (`kda_chunk_scan_tma_rs`).
    Registers,
}

/// The compiled copy-engine scan for one configuration.
pub(super) struct KdaScanTma {
    f: CudaFunction,
    smem: u32,
    /// The compute warps and the copy warp.
    threads: u32,
    /// Value columns per block (the V tile; u is read in the 128-byte swizzle at 64).
    columns: usize,
}

/// Bytes of one chunk stage (`KS_STAGE` of `kda_stage.cuh`) with `cols` columns of u.
fn stage_bytes(dk: usize, cols: usize) -> usize {
    (3 * CHUNK * dk * 2 + CHUNK * CHUNK * 2 + CHUNK * cols * 2 + dk * 4).next_multiple_of(1024)
}

/// Dynamic shared memory of `kda_chunk_scan_tma`; mirrors the `CL_*` macros (stages rounded up
/// to 1024 bytes, plus 1024 bytes to align them).
fn smem_bytes(dk: usize, stages: usize) -> u32 {
    let stage = stage_bytes(dk, KdaScanTma::COLUMNS);
    let rest =
        KdaScanTma::COLUMNS * (dk + 8) * 2 + KdaScanTma::COLUMNS * (CHUNK + 8) * 2 + 2 * stages * 8;
    (stages * stage + rest + 1024) as u32
}

/// Dynamic shared memory of `kda_chunk_scan_tma_wg`; mirrors the `CW_*` macros (stages rounded
/// up to 1024 bytes, plus 1024 bytes to align them).
fn wg_smem_bytes(dk: usize, stages: usize) -> u32 {
    let cols = KdaScanTma::COLUMNS;
    let stage = stage_bytes(dk, cols);
    // Two buffers each of S and v_new in bf16; mbarriers full, empty per stage, ready, freed per
    // buffer.
    let rest = 2 * (dk * cols * 2 + CHUNK * cols * 2) + (2 * stages + 4) * 8;
    (stages * stage + rest + 1024) as u32
}

/// Dynamic shared memory of `kda_chunk_scan_tma_rs` with `warpgroups` of 64 columns; mirrors the
/// `CR_*` macros: the stages, each compute warp's o tile of 64 token rows of 48 bytes (none when
/// the tiles lie in the stages' u columns, `o_in_u`), the mbarriers, and 1024 bytes to align.
fn rs_smem_bytes(dk: usize, stages: usize, warpgroups: usize, o_in_u: bool) -> u32 {
    let tiles = if o_in_u {
        0
    } else {
        4 * warpgroups * CHUNK * 48
    };
    let stage = stage_bytes(dk, KdaScanTma::RS_COLUMNS * warpgroups);
    (stages * stage + tiles + 2 * stages * 8 + 1024) as u32
}

/// The map of a row-major bf16 matrix of `rows` × `cols` read in boxes of `box_rows` ×
/// `box_cols`, in the 128-byte swizzle when `swizzled` (boxes of 64 columns).
fn matrix_map(
    ptr: DevPtr,
    rows: usize,
    cols: usize,
    box_rows: usize,
    box_cols: usize,
    swizzled: bool,
) -> Result<TensorMapArg, CudaError> {
    let swizzle = if swizzled {
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
    } else {
        CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
    };
    tensor_map::tiled(
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        ptr,
        &[cols as u64, rows as u64],
        &[cols as u64 * 2],
        &[box_cols as u32, box_rows as u32],
        swizzle,
    )
}

impl KdaScanTma {
    /// Value columns per block (the scan's V tile).
    pub(super) const COLUMNS: usize = 32;
    /// The same for a warpgroup of [`TmaProducts::Registers`].
    pub(super) const RS_COLUMNS: usize = 64;

    /// Value columns per block of [`TmaProducts::Registers`] built with `defines` (`CR_WG`
    /// warpgroups, 1 when absent, of [`Self::RS_COLUMNS`]).
    pub(super) fn rs_block_columns(defines: &[(&str, String)]) -> usize {
        Self::RS_COLUMNS * define_value(defines, "CR_WG").unwrap_or(1)
    }

    /// Compiles the scan with `defines` (the kda.cu ones; for [`TmaProducts::Warps`],
    /// `CL_STAGES` picks the depth, 2 or 3, and `CL_WARPS` the compute warps, 4 or 8; 2 and 8
    /// when absent; for [`TmaProducts::Warpgroups`], `CW_STAGES` the depth, 2 when absent; for
    /// [`TmaProducts::Registers`], `CR_STAGES`, 3 when absent, `CR_WG` the warpgroups, 1 or 2,
    /// and `CR_O_IN_U` whether the o tiles lie in the stages).
    pub(super) fn load(
        dev: &CudaDevice,
        defines: &[(&str, String)],
        products: TmaProducts,
    ) -> Result<Self, CudaError> {
        let mut defines = defines.to_vec();
        let mut setting =
            |name: &'static str, default: usize| match defines.iter().find(|(k, _)| *k == name) {
                Some((_, v)) => v.parse().unwrap_or(default),
                None => {
                    defines.push((name, default.to_string()));
                    default
                }
            };
        let (unit, source, function, smem, threads, columns) = match products {
            TmaProducts::Warps => {
                let stages = setting("CL_STAGES", DEFAULT_STAGES);
                let warps = setting("CL_WARPS", DEFAULT_WARPS);
                let threads = 32 * (warps as u32 + 1);
                let smem = smem_bytes(128, stages);
                (
                    "kda_scan_tma",
                    KDA_SCAN_TMA_SOURCE,
                    "kda_chunk_scan_tma",
                    smem,
                    threads,
                    Self::COLUMNS,
                )
            }
            TmaProducts::Warpgroups => {
                let stages = setting("CW_STAGES", DEFAULT_STAGES);
                let smem = wg_smem_bytes(128, stages);
                (
                    "kda_scan_tma_wg",
                    KDA_SCAN_TMA_WG_SOURCE,
                    "kda_chunk_scan_tma_wg",
                    smem,
                    2 * 128 + 32,
                    Self::COLUMNS,
                )
            }
            TmaProducts::Registers => {
                let stages = setting("CR_STAGES", 3);
                let warpgroups = setting("CR_WG", 1);
                let o_in_u = setting("CR_O_IN_U", 0) != 0;
                let columns = Self::RS_COLUMNS * warpgroups;
                defines.push(("KS_VT", columns.to_string()));
                (
                    "kda_scan_tma_rs",
                    KDA_SCAN_TMA_RS_SOURCE,
                    "kda_chunk_scan_tma_rs",
                    rs_smem_bytes(128, stages, warpgroups, o_in_u),
                    // one copy warp beside one warpgroup, a copy warpgroup beside two
                    if warpgroups == 1 { 160 } else { 384 },
                    columns,
                )
            }
        };
        let f = dev
            .module_for("sm_90a", unit, source, &defines)?
            .load_function(function)?;
        allow_dynamic_smem(&f, smem as usize)?;
        Ok(KdaScanTma {
            f,
            smem,
            threads,
            columns,
        })
    }

    /// The scan of a call whose products the prep wrote into `ws`, on `stream`.
    pub(super) fn launch(
        &self,
        dev: &CudaDevice,
        stream: &CudaStream,
        p: &KdaPacked,
        ws: &KdaPrefillWorkspace,
    ) -> Result<(), CudaError> {
        let (dk, dv) = (ws.dk(), ws.dv());
        let [w, u, qg, kg, aqk, egl] = ws.product_ptrs(dev);
        let rows = ws.rows();
        // Every scan reads the products in the 128-byte swizzle, u in plain rows of 32 columns
        // or swizzled rows of 64 (boxes of 64 columns for a block of more).
        let u_box = self.columns.min(64);
        let maps = [
            matrix_map(w, rows, dk, CHUNK, 64, true)?,
            matrix_map(qg, rows, dk, CHUNK, 64, true)?,
            matrix_map(kg, rows, dk, CHUNK, 64, true)?,
            matrix_map(aqk, rows, CHUNK, CHUNK, 64, true)?,
            matrix_map(u, rows, dv, CHUNK, u_box, u_box == 64)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (
                (dv / self.columns) as u32,
                p.heads as u32,
                p.sequences as u32,
            ),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: self.smem,
        };
        let (ld_o, nchunks) = (p.ld_o as i32, p.chunks as i32);
        let mut launch = stream.launch_builder(&self.f);
        for m in &maps {
            launch.arg(m);
        }
        launch
            .arg(&egl)
            .arg(&p.state.src)
            .arg(&p.state.src_off)
            .arg(&p.state.dst)
            .arg(&p.state.dst_off)
            .arg(&p.out)
            .arg(&ld_o)
            .arg(&p.seq_start)
            .arg(&p.chunk_start)
            .arg(&nchunks);
        // SAFETY: the parameters of kda_chunk_scan_tma (and of the other two, the same) in
        // order; the maps cover the workspace the prep of the same call filled (`rows` rows of
        // each product), and the state, output and tables are the caller's, as for
        // kda_chunk_scan.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{rs_smem_bytes, smem_bytes, wg_smem_bytes};

    #[test]
    fn three_stages_fit_one_block_per_multiprocessor() {
        assert_eq!(smem_bytes(128, 3), 3 * 62464 + 8704 + 4608 + 48 + 1024);
        assert!(smem_bytes(128, 3) <= 227 * 1024);
        assert!(smem_bytes(128, 4) > 227 * 1024);
    }

    #[test]
    fn the_warpgroup_scan_fits_three_stages() {
        assert_eq!(
            wg_smem_bytes(128, 2),
            2 * 62464 + 2 * (8192 + 4096) + 64 + 1024
        );
        assert!(wg_smem_bytes(128, 3) <= 227 * 1024);
    }

    #[test]
    fn the_register_operand_scan_fits_three_stages() {
        assert_eq!(
            rs_smem_bytes(128, 2, 1, false),
            2 * 66560 + 12288 + 32 + 1024
        );
        assert!(rs_smem_bytes(128, 3, 1, false) <= 227 * 1024);
    }

    #[test]
    fn two_warpgroups_fit_three_stages_only_with_the_o_tiles_in_them() {
        assert_eq!(
            rs_smem_bytes(128, 2, 2, false),
            2 * 74752 + 24576 + 32 + 1024
        );
        assert!(rs_smem_bytes(128, 2, 2, false) <= 227 * 1024);
        assert!(rs_smem_bytes(128, 3, 2, false) > 227 * 1024);
        assert_eq!(rs_smem_bytes(128, 3, 2, true), 3 * 74752 + 48 + 1024);
        assert!(rs_smem_bytes(128, 3, 2, true) <= 227 * 1024);
    }
}
