//! What the GPU backends share: the kernel sources (one set for CUDA and HIP, made portable by
//! `port.cuh`), the host-side description of the KDA kernels, bf16 conversion and the kernel
//! cache location.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

/// The portability header: platform detection, the hardware warp width (`WARP_SIZE`: 32 on
/// NVIDIA, the wavefront size on AMD) and the logical warp the kernels map threads onto.
pub const PORT: &str = include_str!("port.cuh");
/// The shared device helpers every kernel source is compiled with (after [`PORT`]).
pub const COMMON: &str = include_str!("../cuda/common.cuh");
/// The KDA kernels, chunked prefill (its preparation, then its scan) and decode (`-D DK/DV/VT`
/// select the configuration).
pub const KDA_SOURCE: &str = concat!(
    include_str!("../cuda/kda.cu"),
    "\n",
    include_str!("../cuda/kda_scan.cu"),
    "\n",
    include_str!("../cuda/kda_decode.cu")
);
/// Row-wise ops: RMSNorm (+ residual), embedding gather, argmax.
pub const OPS_SOURCE: &str = include_str!("../cuda/ops.cu");
/// Threads per block of the row-wise ops, and bf16 vectors of 8 each thread holds of a row.
pub const OPS_THREADS: usize = 256;
pub const OPS_VECS: usize = 4;

/// Tokens per chunk of the KDA prefill kernels.
pub const CHUNK: usize = 64;

/// The full translation unit of one kernel source: [`PORT`], [`COMMON`], then `source`.
pub fn translation_unit(source: &str) -> String {
    format!("{PORT}\n{COMMON}\n{source}")
}

/// The file name a compiled kernel is cached under: the sources and every compiler option are
/// hashed into it, so a change to any of them compiles afresh.
pub(crate) fn cache_file_name(
    name: &str,
    arch: &str,
    source: &str,
    options: &[String],
    ext: &str,
) -> String {
    let mut hasher = DefaultHasher::new();
    PORT.hash(&mut hasher);
    COMMON.hash(&mut hasher);
    source.hash(&mut hasher);
    options.hash(&mut hasher);
    let arch: String = arch
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{name}-{arch}-{:016x}.{ext}", hasher.finish())
}

/// Writes a cache file atomically (temporary file, then rename).
pub(crate) fn write_cache_file(path: &Path, data: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(path.parent().expect("cache file has a parent"))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// Where a backend caches its compiled kernels: `$TESSERA_CACHE_DIR/<backend>`, else
/// `$XDG_CACHE_HOME/tessera/<backend>`, else `~/.cache/tessera/<backend>`.
pub(crate) fn cache_dir_for(backend: &str) -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("TESSERA_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("tessera")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("tessera")))
        .map(|p| p.join(backend))
}

/// Shapes of one KDA call: `batch` sequences of `seq_len` tokens, `heads` heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaShape {
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

impl KdaShape {
    pub(crate) fn chunks(&self) -> usize {
        self.seq_len.div_ceil(CHUNK)
    }
    pub(crate) fn qk_len(&self) -> usize {
        self.batch * self.seq_len * self.heads * self.dk
    }
    pub(crate) fn v_len(&self) -> usize {
        self.batch * self.seq_len * self.heads * self.dv
    }
    pub(crate) fn state_len(&self) -> usize {
        self.batch * self.heads * self.dk * self.dv
    }
    /// The sequence tables of this uniform batch (see [`KdaSequenceTables`]), each sequence's
    /// state at `b · heads · dk · dv` floats.
    pub(crate) fn tables(&self) -> KdaSequenceTables {
        let mut t = KdaSequenceTables::new(std::iter::repeat_n(self.seq_len, self.batch));
        let per = (self.heads * self.dk * self.dv) as i64;
        t.state_off = (0..self.batch as i64).map(|b| b * per).collect();
        t
    }
}

/// How the chunked KDA prefill finds packed sequences (`kda.cu`, `SeqSpan`): sequence `s` holds
/// token rows `seq_start[s]..seq_start[s+1]` and chunks `chunk_start[s]..chunk_start[s+1]` of
/// [`CHUNK`] tokens; `state_off[s]` is where its state lies in a buffer of states (floats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KdaSequenceTables {
    pub seq_start: Vec<i32>,
    pub chunk_start: Vec<i32>,
    pub state_off: Vec<i64>,
}

impl KdaSequenceTables {
    /// Tables of sequences of `lens` tokens packed in order (no state offsets).
    pub fn new(lens: impl IntoIterator<Item = usize>) -> Self {
        let (mut seq_start, mut chunk_start) = (vec![0i32], vec![0i32]);
        let (mut rows, mut chunks) = (0usize, 0usize);
        for len in lens {
            rows += len;
            chunks += len.div_ceil(CHUNK);
            seq_start.push(rows as i32);
            chunk_start.push(chunks as i32);
        }
        KdaSequenceTables {
            seq_start,
            chunk_start,
            state_off: Vec::new(),
        }
    }

    /// Chunks over every sequence.
    pub fn chunks(&self) -> usize {
        self.chunk_start.last().map_or(0, |&c| c as usize)
    }
}

/// The `-D` macros of one KDA configuration.
pub fn kda_defines(dk: usize, dv: usize, v_tile: usize) -> [(&'static str, String); 3] {
    [
        ("DK", dk.to_string()),
        ("DV", dv.to_string()),
        ("VT", v_tile.to_string()),
    ]
}

/// Checks the head dims and V tile a KDA configuration is built for.
pub(crate) fn kda_check_config(dk: usize, dv: usize, v_tile: usize) -> Result<(), String> {
    if !matches!(dk, 64 | 128) || dv != 128 {
        return Err(format!(
            "kda: head dims dk={dk}, dv={dv} are not supported (dk 64 or 128, dv 128)"
        ));
    }
    if !matches!(v_tile, 32 | 64) || !dv.is_multiple_of(v_tile) {
        return Err(format!("kda: V tile {v_tile} must be 32 or 64"));
    }
    Ok(())
}

/// Dynamic shared memory of the two KDA prefill kernels; mirrors the layout macros of `kda.cu`.
pub(crate) fn kda_smem_bytes(dk: usize, dv: usize, vt: usize, stages: usize) -> (u32, u32) {
    let (ch, sub) = (CHUNK, 16);
    // (The padding `KDA_GLD_PAD` and `KDA_INV_PADS` give by default; with less the prep uses
    // less than this.)
    let (gld, old, tld, ald, uld) = (dk + 8, dk + 8, ch + 8, ch + 4, vt + 8);
    let (tfld, xld) = (ch + 8, sub + 8);
    let p_x = ch * gld * 4 + 2 * ch * old * 2 + 3 * ch * 4 + 16 + ch * ald * 4;
    let inverse = ch * tfld * 4 + (ch / sub - 1) * sub * xld * 4;
    let staged = ch * old * 2;
    debug_assert!(
        ch * (dv + 8) * 2 <= 2 * ch * old * 2,
        "beta v must fit where q/k were"
    );
    debug_assert!(
        8 * 16 * (dk.max(dv) / 2 + 8) * 2 <= ch * gld * 4,
        "the w/u output tiles must fit where the decays were"
    );
    let prep = p_x + inverse.max(staged);
    let stage = 3 * ch * old * 2 + ch * tld * 2 + ch * uld * 2 + dk * 4;
    let scan = stages * stage + vt * (dk + 8) * 2 + vt * tld * 2;
    (prep as u32, scan as u32)
}

/// The value of the `-D` macro `name` in `extra`, if it is there and a number.
pub(crate) fn define_value(extra: &[(&str, String)], name: &str) -> Option<usize> {
    extra
        .iter()
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.parse().ok())
}

/// A scan pipeline depth from a set of extra `-D` macros: the value of `name` (`SCAN_STAGES` for
/// kda.cu's scan, `WG_SCAN_STAGES` for the warpgroup scan), 2 when absent.
pub(crate) fn kda_scan_stages(extra: &[(&str, String)], name: &str) -> usize {
    define_value(extra, name).unwrap_or(2)
}

/// f32 → bf16 bits, round to nearest even (NaN stays NaN).
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((u >> 16) & 1);
    (u.wrapping_add(round) >> 16) as u16
}

/// bf16 bits → f32 (exact).
pub fn bf16_value(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_prep_blocks_fit_a_hopper_multiprocessor() {
        // 228 KB a multiprocessor, 1 KB of it reserved for each resident block.
        let (prep, _) = kda_smem_bytes(128, 128, 32, 2);
        assert_eq!(prep, 87824 + 23040);
        assert!(2 * (prep + 1024) <= 228 * 1024);
    }

    #[test]
    fn sequence_tables_count_tokens_and_chunks() {
        let t = KdaSequenceTables::new([1, 63, 64, 0, 65, 200]);
        assert_eq!(t.seq_start, [0, 1, 64, 128, 128, 193, 393]);
        assert_eq!(t.chunk_start, [0, 1, 2, 3, 3, 5, 9]);
        assert_eq!(t.chunks(), 9);
        assert!(t.state_off.is_empty());
        assert_eq!(KdaSequenceTables::new([]).chunks(), 0);
        let shape = KdaShape {
            batch: 3,
            seq_len: 130,
            heads: 2,
            dk: 64,
            dv: 128,
        };
        let b = shape.tables();
        assert_eq!(b.seq_start, [0, 130, 260, 390]);
        assert_eq!(b.chunk_start, [0, 3, 6, 9]);
        assert_eq!(b.state_off, [0, 2 * 64 * 128, 2 * 2 * 64 * 128]);
        assert_eq!(b.chunks(), 3 * shape.chunks());
    }

    #[test]
    fn bf16_round_trip_and_rounding() {
        for x in [0.0f32, 1.0, -2.5, 3.0e38, 1.0e-38, 0.1] {
            let r = bf16_value(bf16_bits(x));
            assert!((r - x).abs() <= x.abs() * (1.0 / 256.0), "{x} -> {r}");
        }
        // Ties go to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
        assert_eq!(bf16_value(bf16_bits(1.0 + 1.0 / 256.0)), 1.0);
        assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn the_portability_header_comes_first_and_no_literal_warp_width_is_shared() {
        let unit = translation_unit("// body");
        assert!(unit.starts_with(PORT));
        assert!(unit.find(COMMON).unwrap() < unit.find("// body").unwrap());
        // The shared kernel code names the lane constants of port.cuh instead of 31, 32 or >> 5.
        for pat in ["& 31", "+= 32", ">> 5"] {
            assert!(
                !KDA_SOURCE.contains(pat),
                "the KDA sources still have `{pat}`"
            );
        }
    }

    #[test]
    fn cache_names_depend_on_every_input() {
        let opts = vec!["-DDK=128".to_string()];
        let a = cache_file_name("kda", "gfx90a", "x", &opts, "co");
        assert_eq!(a, cache_file_name("kda", "gfx90a", "x", &opts, "co"));
        assert_ne!(a, cache_file_name("kda", "gfx90a", "y", &opts, "co"));
        assert_ne!(a, cache_file_name("kda", "gfx90a", "x", &[], "co"));
        assert!(cache_file_name("kda", "gfx90a:xnack-", "x", &opts, "co")
            .starts_with("kda-gfx90a_xnack_-"));
    }
}
