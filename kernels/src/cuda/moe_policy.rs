//! Host-side rules of the MoE decode launches, each a measured choice (benches/RESULTS.md): the
//! tensor-core projections' input split and down row tiles, dependent launches, per-expert waits,
//! inputs staged in shared memory, and the copy-engine ring's shared memory.

use crate::gpu::define_value;

/// Warps per block of the tensor-core projections; each owns 16 output rows of gate/up.
pub(super) const TC_WARPS: usize = 4;
/// Row tiles of 16 a warp of the tensor-core down projection owns, bf16 and MXFP4
/// (`MOE_TC_DOWN_TILES_*` in moe_tc.cu): two tiles keep as many bytes in flight as gate/up.
/// MXFP4 expert pass with two down tiles: 106.8 against 114.5 µs at K3's batch 1, 658.7 against
/// 699.3 at batch 8 (same call); bf16 the same either way (benches/RESULTS.md).
pub(super) const DOWN_TILES: [(&str, usize); 2] = [
    ("MOE_TC_DOWN_TILES_BF16", 1),
    ("MOE_TC_DOWN_TILES_MXFP4", 2),
];

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
pub(super) fn tc_ksplit(tiles: usize, wave: usize, mxfp4: bool) -> usize {
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
pub(super) fn tc_down_rows(defines: &[(&str, String)], mxfp4: bool, copy_engine: bool) -> usize {
    let two = define_value(defines, DOWN_TILES[usize::from(mxfp4)].0) == Some(2);
    if two && !(mxfp4 && copy_engine) {
        32
    } else {
        16
    }
}

/// Whether the tensor-core projections and the combine go out as dependent launches: on
/// sm_90 and newer unless the build says `MOE_TC_DEPENDENT=0` (moe_tc.cu).
pub(super) fn dependent_launches(defines: &[(&str, String)], arch: &str) -> bool {
    define_value(defines, "MOE_TC_DEPENDENT") != Some(0) && super::sm90_or_newer(arch)
}

/// Whether the down warps wait for their own expert's gate/up blocks (counts raised by each
/// block after a fence) rather than for the whole gate/up kernel: for bf16 experts always, for
/// MXFP4 up to 128 active experts (8 tokens at K3's top-16). The fence at the end of every
/// gate/up block holds its slot a little longer, which MXFP4 pays at larger batches (K3 at batch
/// 16 / 32 / 64: 1209 / 2123 / 3379 µs with the counts against 1198 / 2092 / 3325 without; at
/// batch 1 / 4 / 8: 100.7 / 351.0 / 656.1 against 103.1 / 360.2 / 661.6; bf16 0.2–3% faster
/// with the counts at every batch).
pub(super) fn fine_waits(mxfp4: bool, max_active: usize) -> bool {
    !mxfp4 || max_active <= 128
}

/// Most tokens of inputs a tensor-core projection block copies into shared memory first
/// (`MOE_TC_STAGE_X`, default 4).
pub(super) const STAGE_MAX: usize = 4;

/// Most bytes of staged inputs per block: four blocks an SM still fit beside their other shared
/// memory, and no launch needs more than the 48 KB of dynamic shared memory a kernel gets
/// without asking (K3: 4 tokens of 3584 gate/up inputs, 28 KB).
pub(super) const STAGE_BYTES: usize = 32 * 1024;

/// Tokens of an expert one pass of the tensor-core projections takes (the staged inputs are read
/// in a single pass).
const TOKENS_PER_PASS: usize = 8;

/// Tokens of inputs a tensor-core projection block over `in_dim` bf16 inputs copies into shared
/// memory (0: none): the batch, up to `stage_max`, one pass and what [`STAGE_BYTES`] holds, on
/// the register path (the copy-engine ring has its own use of shared memory). Experts with more
/// tokens than that read their inputs from global memory as before.
pub(super) fn stage_tokens(batch: usize, stage_max: usize, ring: bool, in_dim: usize) -> usize {
    if ring {
        0
    } else {
        let fits = STAGE_BYTES / (2 * in_dim).max(1);
        batch.min(stage_max).min(TOKENS_PER_PASS).min(fits)
    }
}

/// Whether resident gate/up blocks (moe_tc_resident.cu) can take a call's inputs: `din` inputs
/// in vectors of 32 (MXFP4) or 8 (bf16), split `ksplit` ways, leave each warp whole passes of
/// `pass` vectors (4 lanes × the format's span); those blocks take no partial last pass.
pub(super) fn resident_whole_passes(din: usize, mxfp4: bool, ksplit: usize, pass: usize) -> bool {
    let vecs = din / if mxfp4 { 32 } else { 8 };
    ksplit > 0 && pass > 0 && vecs.is_multiple_of(ksplit) && (vecs / ksplit).is_multiple_of(pass)
}

/// The shared-memory ring of the copy-engine MXFP4 projections (`MOE_TMA_*` in moe_tc_tma.cu).
#[derive(Clone, Copy, Debug)]
pub(super) struct TmaRing {
    chunk: usize,
    stages: usize,
}

impl TmaRing {
    /// From the build settings: on when `MOE_TC_TMA` is 1 and the device is sm_90 or newer.
    pub(super) fn from_defines(defines: &[(&str, String)], arch: &str) -> Option<Self> {
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
    pub(super) fn block_bytes(&self, m: usize, in_dim: usize) -> usize {
        let ring = self.stages * m * (self.chunk / 8) * 2048;
        let scale_row = (in_dim / 32).next_multiple_of(16);
        let per_warp = (ring + m * 16 * scale_row + self.stages * 8).next_multiple_of(1024);
        TC_WARPS * per_warp + 1024
    }
}

#[cfg(test)]
mod tests {
    use super::{
        dependent_launches, fine_waits, resident_whole_passes, stage_tokens, tc_down_rows,
        tc_ksplit, TmaRing, DOWN_TILES,
    };

    #[test]
    fn mxfp4_down_warps_wait_per_expert_only_up_to_eight_tokens() {
        assert!(fine_waits(false, 896));
        assert!(fine_waits(true, 16));
        assert!(fine_waits(true, 128));
        assert!(!fine_waits(true, 256));
    }

    #[test]
    fn inputs_staged_in_shared_memory_up_to_the_cap_and_the_byte_budget_and_not_with_the_ring() {
        // K3's gate/up (3584 inputs) and down (3072).
        assert_eq!(stage_tokens(1, 4, false, 3584), 1);
        assert_eq!(stage_tokens(3, 4, false, 3584), 3);
        assert_eq!(stage_tokens(64, 4, false, 3584), 4);
        assert_eq!(stage_tokens(64, 4, false, 3072), 4);
        assert_eq!(stage_tokens(64, 2, false, 3584), 2);
        assert_eq!(stage_tokens(1, 0, false, 3584), 0);
        assert_eq!(stage_tokens(1, 4, true, 3584), 0);
        // Wider inputs take fewer tokens, and none past 16K inputs: 2 · tokens · in_dim bytes
        // stay within STAGE_BYTES.
        assert_eq!(stage_tokens(64, 4, false, 7168), 2);
        assert_eq!(stage_tokens(64, 4, false, 16384), 1);
        assert_eq!(stage_tokens(64, 4, false, 16416), 0);
        assert_eq!(stage_tokens(64, 8, false, 512), 8);
        // One pass of 8 tokens at most, whatever the cap.
        assert_eq!(stage_tokens(64, 16, false, 512), 8);
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
    fn resident_blocks_only_on_whole_passes() {
        // K3's gate/up at batch 1 (split in two): MXFP4 56 vectors a warp, 7 passes of 8; bf16
        // 224 vectors, 14 passes of 16.
        assert!(resident_whole_passes(3584, true, 2, 8));
        assert!(resident_whole_passes(3584, false, 2, 16));
        // 512 inputs: MXFP4 16 vectors, whole in two parts (one pass each), not in four.
        assert!(resident_whole_passes(512, true, 2, 8));
        assert!(!resident_whole_passes(512, true, 4, 8));
        // A split that does not divide the vectors (98 in four), and no split or pass at all.
        assert!(!resident_whole_passes(98 * 32, true, 4, 8));
        assert!(resident_whole_passes(96 * 32, true, 4, 8));
        assert!(!resident_whole_passes(3584, true, 0, 8));
        assert!(!resident_whole_passes(3584, true, 2, 0));
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
