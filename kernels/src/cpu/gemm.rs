//! `linear`: out[m, n] = x[m, k] · w[n, k]ᵀ (torch `nn.Linear` weight layout).
//!
//! Dot-product GEMM: both operands are read along `k`, the layout torch
//! weights arrive in. x is packed once per call (cheap); weights are read in
//! place for small batches (a GEMV streams each weight row once) and packed
//! per task and `k` block when more than 16 rows reuse them (see [`pack`]).
//! Register tiles of up to 4 rows × 3 columns run 12 FMA chains; tasks of
//! 128 rows × 48 columns go to rayon.
//!
//! Determinism contract: every output element is one dot product computed as
//! 8 lane accumulators, lane `l` accumulating `k ≡ l (mod 8)` in increasing
//! `k` with FMA, the ragged `k` tail zero-padded into one more step, then the
//! fixed tree of [`hsum8`](super::simd::hsum8). Tiles of any shape, edge
//! tiles, packing, `k` blocks (accumulators are spilled and reloaded exactly)
//! and thread splits only change *when* an element is computed, never *how*,
//! so a row's bits do not depend on the batch size, its position, or threads.

use rayon::prelude::*;

use super::simd::{hsum8, SyncPtr, LANES};

/// `k` block: the x tile (4 × KC) stays in L1 while the task's packed weight
/// slab (NB × KC) streams from L2.
const KC: usize = 512;
/// Output columns per task; a multiple of every main tile width (3, 4, 6, 8).
const NB: usize = 48;
/// Rows per task (a multiple of 4): weight slab and the MB × NB lane
/// accumulators (196 KiB) fit L2 together.
const MB: usize = 128;
/// Weights are packed only when more than this many rows reuse them; below,
/// streaming the unpacked rows is cheaper than copying them (measured).
const PACK_W_MIN_ROWS: usize = 16;
/// Below this many multiply-adds the rayon fork costs more than it saves.
const PAR_MIN_MACS: usize = 1 << 18;
/// Rows per register tile.
const MR: usize = 4;

/// out[rows, out_dim] = x[rows, in_dim] · w[out_dim, in_dim]ᵀ.
///
/// Panics if a slice length disagrees with the shape. Bitwise
/// reproducible per row (see module docs).
pub fn linear(x: &[f32], rows: usize, in_dim: usize, w: &[f32], out_dim: usize, out: &mut [f32]) {
    linear_with(Isa::detect(), x, rows, in_dim, w, out_dim, out);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if super::simd::has_avx2_fma() {
            return Isa::Avx2;
        }
        Isa::Portable
    }
}

pub(crate) fn linear_with(
    isa: Isa,
    x: &[f32],
    rows: usize,
    in_dim: usize,
    w: &[f32],
    out_dim: usize,
    out: &mut [f32],
) {
    assert_eq!(x.len(), rows * in_dim, "linear: x shape");
    assert_eq!(w.len(), out_dim * in_dim, "linear: w shape");
    assert_eq!(out.len(), rows * out_dim, "linear: out shape");
    let parallel = rows * in_dim * out_dim >= PAR_MIN_MACS;
    gemm(
        isa, x, in_dim, rows, in_dim, w, in_dim, out_dim, out, out_dim, parallel,
    );
}

/// Sequential `linear` on row-strided operands: out[r*ldo + c] =
/// Σ_k x[r*ldx + k] · w[c*ldw + k] for r < rows, c < n. Same per-element
/// arithmetic as [`linear`] (used inside already-parallel kernels).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_nt_seq(
    x: &[f32],
    ldx: usize,
    rows: usize,
    k: usize,
    w: &[f32],
    ldw: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    gemm(Isa::detect(), x, ldx, rows, k, w, ldw, n, out, ldo, false);
}

/// Extent a row-strided matrix needs: (rows-1)·ld + cols, or 0 when empty.
fn extent(rows: usize, ld: usize, cols: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm(
    isa: Isa,
    x: &[f32],
    ldx: usize,
    rows: usize,
    k: usize,
    w: &[f32],
    ldw: usize,
    n: usize,
    out: &mut [f32],
    ldo: usize,
    parallel: bool,
) {
    assert!(x.len() >= extent(rows, ldx, k) && ldx >= k, "gemm: x shape");
    assert!(w.len() >= extent(n, ldw, k) && ldw >= k, "gemm: w shape");
    assert!(
        out.len() >= extent(rows, ldo, n) && ldo >= n,
        "gemm: out shape"
    );
    if rows == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.chunks_mut(ldo)
            .take(rows)
            .for_each(|r| r[..n].fill(0.0));
        return;
    }
    let xp = pack_x(x, ldx, rows, k, parallel);
    let mb = rows.min(MB);
    let (m_blocks, n_blocks) = (rows.div_ceil(mb), n.div_ceil(NB));
    let tasks = m_blocks * n_blocks;
    let outp = SyncPtr::new(out);
    let task = |t: usize, scratch: &mut Scratch| {
        // Row block varies fastest so consecutive tasks share a weight block.
        let (mi, ni) = (t % m_blocks, t / m_blocks);
        let (m0, n0) = (mi * mb, ni * NB);
        let (m1, n1) = ((m0 + mb).min(rows), (n0 + NB).min(n));
        let g = Geom {
            xp: &xp,
            w,
            ldw,
            k,
            ldo,
            m0,
            m1,
            n0,
            n1,
        };
        // SAFETY: tasks cover disjoint [m0,m1)×[n0,n1) tiles of `out`, which
        // outlives this call; all indices stay inside the asserted extents.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => run_task::<Avx2>(&g, scratch, outp.get()),
                Isa::Portable => run_task::<Portable>(&g, scratch, outp.get()),
            }
        }
    };
    if tasks == 1 || !parallel {
        let mut scratch = Scratch::default();
        (0..tasks).for_each(|t| task(t, &mut scratch));
    } else {
        (0..tasks)
            .into_par_iter()
            .for_each_init(Scratch::default, |s, t| task(t, s));
    }
}

/// 32-byte aligned f32 buffer (aligned vector loads never split cache lines).
#[derive(Default)]
struct AlignedBuf {
    raw: Vec<f32>,
    off: usize,
}

impl AlignedBuf {
    fn with_len(n: usize) -> Self {
        let mut b = AlignedBuf::default();
        b.ensure(n);
        b
    }
    /// Grows to at least `n` elements; contents are unspecified afterwards.
    fn ensure(&mut self, n: usize) {
        if self.raw.len() < n + LANES {
            self.raw = vec![0.0; n + LANES];
            self.off = self.raw.as_ptr().align_offset(32).min(LANES);
        }
    }
    fn slice(&self) -> &[f32] {
        &self.raw[self.off..]
    }
    fn slice_mut(&mut self) -> &mut [f32] {
        &mut self.raw[self.off..]
    }
}

/// x packed per 4-row tile (see [`pack`]), every row padded to `kp` = k
/// rounded up to 8; tile `i` starts at `4·i·kp`.
fn pack_x(x: &[f32], ldx: usize, rows: usize, k: usize, parallel: bool) -> AlignedBuf {
    let kp = k.next_multiple_of(LANES);
    let mut xp = AlignedBuf::with_len(rows * kp);
    let tile = |(i, dst): (usize, &mut [f32])| {
        let r0 = i * MR;
        pack(x, ldx, r0, (rows - r0).min(MR), 0, k, dst);
    };
    let buf = &mut xp.slice_mut()[..rows * kp];
    if parallel && rows >= 64 {
        buf.par_chunks_mut(MR * kp).enumerate().for_each(tile);
    } else {
        buf.chunks_mut(MR * kp).enumerate().for_each(tile);
    }
    xp
}

/// One task's slice of the problem.
struct Geom<'a> {
    xp: &'a AlignedBuf,
    w: &'a [f32],
    ldw: usize,
    k: usize,
    ldo: usize,
    m0: usize,
    m1: usize,
    n0: usize,
    n1: usize,
}

/// Per-worker buffers, reused across tasks.
#[derive(Default)]
struct Scratch {
    /// Lane accumulators carried across `k` blocks.
    acc: AlignedBuf,
    /// The task's weight rows for the current `k` block, packed (only when
    /// several row tiles reuse them).
    wp: AlignedBuf,
}

/// Arguments of one R×C micro-tile over one `k` block. Lane vector `s` of
/// x row `r` is at `x + r*ldx + s*sx`; of w row `c` at `w + c*ldw + s*sw`.
struct Tile {
    x: *const f32,
    ldx: usize,
    sx: usize,
    w: *const f32,
    ldw: usize,
    sw: usize,
    /// Number of k elements in this block (multiple of 8 except in the last block).
    klen: usize,
    /// R×C lane accumulators, element (r, c) at `acc + r*acc_ld + c*8`.
    acc: *mut f32,
    acc_ld: usize,
    first: bool,
    last: bool,
    out: *mut f32,
    ldo: usize,
}

/// A micro-kernel family; every (R, C) instance computes each element identically.
trait Micro {
    /// # Safety
    /// Pointers in `t` must be valid for R rows / C columns at the given strides.
    unsafe fn tile<const R: usize, const C: usize>(t: &Tile);
}

/// Main tile width for an R-row tile over unpacked weights: 12 (or 8)
/// accumulators + operands fit the 16 ymm registers.
fn main_cols(r: usize) -> usize {
    match r {
        4 => 3,
        3 => 4,
        2 => 6,
        _ => 8,
    }
}

/// Packs rows `[r0, r0+n)`, columns `[k0, k0+klen)` of a row-major matrix
/// (`ld` columns) as `[step][row][8 lanes]`, zero-padding the last step, so a
/// tile's loads for one step are adjacent and each tile is one sequential
/// stream (unpacked rows are `k·4` bytes apart, often a multiple of 4 KiB,
/// and fight over the same L1 sets). Values and their k order are
/// unchanged, hence so are the results.
fn pack(src: &[f32], ld: usize, r0: usize, n: usize, k0: usize, klen: usize, dst: &mut [f32]) {
    let full = klen / LANES;
    let steps = klen.div_ceil(LANES);
    debug_assert!(dst.len() >= steps * n * LANES);
    for r in 0..n {
        let row = &src[(r0 + r) * ld + k0..(r0 + r) * ld + k0 + klen];
        for (s, chunk) in row.chunks_exact(LANES).enumerate() {
            let d: &mut [f32; LANES] = (&mut dst[(s * n + r) * LANES..(s * n + r + 1) * LANES])
                .try_into()
                .unwrap();
            *d = chunk.try_into().unwrap();
        }
        if steps > full {
            let d = &mut dst[(full * n + r) * LANES..(full * n + r + 1) * LANES];
            let tail = &row[full * LANES..];
            d[..tail.len()].copy_from_slice(tail);
            d[tail.len()..].fill(0.0);
        }
    }
}

/// Column tile width whenever weights are packed (fixed so one packed layout
/// serves every row-tile height).
const PACKED_COLS: usize = 3;

unsafe fn run_task<M: Micro>(g: &Geom, sc: &mut Scratch, out: *mut f32) {
    let (mr, nc) = (g.m1 - g.m0, g.n1 - g.n0);
    let kp = g.k.next_multiple_of(LANES);
    let kc = KC.min(kp);
    sc.acc.ensure(mr * nc * LANES);
    // Weights are reused by every row tile; with few row tiles (GEMV, small
    // batches) packing would cost more than it saves.
    let pack_w = mr > PACK_W_MIN_ROWS;
    if pack_w {
        sc.wp.ensure(nc * kc);
    }
    let acc = sc.acc.slice_mut().as_mut_ptr();
    let xp = g.xp.slice().as_ptr();
    let nk = g.k.div_ceil(kc);
    for kb in 0..nk {
        let k0 = kb * kc;
        let klen = kc.min(g.k - k0);
        if pack_w {
            let wp = sc.wp.slice_mut();
            let mut c = 0;
            while c < nc {
                let cc = (nc - c).min(PACKED_COLS);
                pack(
                    g.w,
                    g.ldw,
                    g.n0 + c,
                    cc,
                    k0,
                    klen,
                    &mut wp[c * kc..(c + cc) * kc],
                );
                c += cc;
            }
        }
        let wp = sc.wp.slice().as_ptr();
        let mut r = 0;
        while r < mr {
            let rr = (mr - r).min(MR);
            let cw = if pack_w { PACKED_COLS } else { main_cols(rr) };
            // Row tile (g.m0 + r) / 4 of the packed x, at step k0 / 8.
            let x = xp.add((g.m0 + r) * kp + k0 * rr);
            let mut c = 0;
            while c < nc {
                let cc = (nc - c).min(cw);
                let (w, ldw, sw) = if pack_w {
                    (wp.add(c * kc), LANES, cc * LANES)
                } else {
                    (g.w.as_ptr().add((g.n0 + c) * g.ldw + k0), g.ldw, LANES)
                };
                let t = Tile {
                    x,
                    ldx: LANES,
                    sx: rr * LANES,
                    w,
                    ldw,
                    sw,
                    klen,
                    acc: acc.add((r * nc + c) * LANES),
                    acc_ld: nc * LANES,
                    first: kb == 0,
                    last: kb + 1 == nk,
                    out: out.add((g.m0 + r) * g.ldo + g.n0 + c),
                    ldo: g.ldo,
                };
                dispatch_tile::<M>(rr, cc, &t);
                c += cc;
            }
            r += rr;
        }
    }
}

#[inline(always)]
unsafe fn dispatch_tile<M: Micro>(r: usize, c: usize, t: &Tile) {
    match (r, c) {
        (4, 1) => M::tile::<4, 1>(t),
        (4, 2) => M::tile::<4, 2>(t),
        (4, 3) => M::tile::<4, 3>(t),
        (3, 1) => M::tile::<3, 1>(t),
        (3, 2) => M::tile::<3, 2>(t),
        (3, 3) => M::tile::<3, 3>(t),
        (3, 4) => M::tile::<3, 4>(t),
        (2, 1) => M::tile::<2, 1>(t),
        (2, 2) => M::tile::<2, 2>(t),
        (2, 3) => M::tile::<2, 3>(t),
        (2, 4) => M::tile::<2, 4>(t),
        (2, 5) => M::tile::<2, 5>(t),
        (2, 6) => M::tile::<2, 6>(t),
        (1, 1) => M::tile::<1, 1>(t),
        (1, 2) => M::tile::<1, 2>(t),
        (1, 3) => M::tile::<1, 3>(t),
        (1, 4) => M::tile::<1, 4>(t),
        (1, 5) => M::tile::<1, 5>(t),
        (1, 6) => M::tile::<1, 6>(t),
        (1, 7) => M::tile::<1, 7>(t),
        (1, 8) => M::tile::<1, 8>(t),
        _ => unreachable!("tile {r}x{c}"),
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Micro for Avx2 {
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(t: &Tile) {
        avx2_tile::<R, C>(t)
    }
}

/// 8 ones then 8 zeros: loading at offset `8 - tail` yields a `tail`-lane mask.
#[cfg(target_arch = "x86_64")]
static TAIL_MASK: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_tile<const R: usize, const C: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    if !t.first {
        for (r, row) in acc.iter_mut().enumerate() {
            for (c, a) in row.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(t.acc.add(r * t.acc_ld + c * LANES));
            }
        }
    }
    let steps = t.klen / LANES;
    let tail = t.klen % LANES;
    for s in 0..steps {
        avx2_step::<R, C>(
            &mut acc,
            |r| _mm256_loadu_ps(t.x.add(r * t.ldx + s * t.sx)),
            |c| _mm256_loadu_ps(t.w.add(c * t.ldw + s * t.sw)),
        );
    }
    if tail > 0 {
        // Zero-padded final step: masked loads never touch memory past `k`.
        let s = steps;
        let mask = _mm256_loadu_si256(TAIL_MASK.as_ptr().add(LANES - tail) as *const __m256i);
        avx2_step::<R, C>(
            &mut acc,
            |r| _mm256_maskload_ps(t.x.add(r * t.ldx + s * t.sx), mask),
            |c| _mm256_maskload_ps(t.w.add(c * t.ldw + s * t.sw), mask),
        );
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, a) in row.iter().enumerate() {
            if t.last {
                *t.out.add(r * t.ldo + c) = avx2_hsum(*a);
            } else {
                _mm256_storeu_ps(t.acc.add(r * t.acc_ld + c * LANES), *a);
            }
        }
    }
}

/// One 8-wide k step of an R×C tile. Keeps the smaller operand set in
/// registers and streams the other, so R·C accumulators + min(R, C) + 1
/// operands fit the 16 ymm registers without spills.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // r/c index two arrays at once
unsafe fn avx2_step<const R: usize, const C: usize>(
    acc: &mut [[std::arch::x86_64::__m256; C]; R],
    x: impl Fn(usize) -> std::arch::x86_64::__m256,
    w: impl Fn(usize) -> std::arch::x86_64::__m256,
) {
    use std::arch::x86_64::*;
    if C <= R {
        let mut wv = [_mm256_setzero_ps(); C];
        for (c, v) in wv.iter_mut().enumerate() {
            *v = w(c);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = x(r);
            for (c, a) in row.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(xv, wv[c], *a);
            }
        }
    } else {
        let mut xv = [_mm256_setzero_ps(); R];
        for (r, v) in xv.iter_mut().enumerate() {
            *v = x(r);
        }
        for c in 0..C {
            let wv = w(c);
            for r in 0..R {
                acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
            }
        }
    }
}

/// Same tree as `hsum8`: (i, i+4), then (i, i+2), then (0, 1).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn avx2_hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// Baseline fallback with the same lane structure. Fused multiply-add only
/// where the target has it natively (aarch64, or x86 built with `+fma`), so it
/// then matches the AVX2 path bit for bit; otherwise mul+add.
struct Portable;

#[inline(always)]
pub(crate) fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(any(target_arch = "aarch64", target_feature = "fma")) {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

impl Micro for Portable {
    #[allow(clippy::needless_range_loop)] // r/c/l index several arrays at once
    unsafe fn tile<const R: usize, const C: usize>(t: &Tile) {
        let mut acc = [[[0.0f32; LANES]; C]; R];
        if !t.first {
            for (r, row) in acc.iter_mut().enumerate() {
                for (c, a) in row.iter_mut().enumerate() {
                    let p = t.acc.add(r * t.acc_ld + c * LANES);
                    a.copy_from_slice(std::slice::from_raw_parts(p, LANES));
                }
            }
        }
        let steps = t.klen.div_ceil(LANES);
        for s in 0..steps {
            let off = s * LANES;
            let n = LANES.min(t.klen - off);
            let mut xv = [[0.0f32; LANES]; R];
            for (r, v) in xv.iter_mut().enumerate() {
                v[..n]
                    .copy_from_slice(std::slice::from_raw_parts(t.x.add(r * t.ldx + s * t.sx), n));
            }
            for c in 0..C {
                let mut wv = [0.0f32; LANES];
                wv[..n]
                    .copy_from_slice(std::slice::from_raw_parts(t.w.add(c * t.ldw + s * t.sw), n));
                for r in 0..R {
                    for l in 0..LANES {
                        acc[r][c][l] = fmadd(xv[r][l], wv[l], acc[r][c][l]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, a) in row.iter().enumerate() {
                if t.last {
                    *t.out.add(r * t.ldo + c) = hsum8(*a);
                } else {
                    let p = t.acc.add(r * t.acc_ld + c * LANES);
                    std::slice::from_raw_parts_mut(p, LANES).copy_from_slice(a);
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "gemm_tests.rs"]
mod tests;
