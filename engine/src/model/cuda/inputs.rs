//! The integer inputs of one forward call (token ids, segment starts, the rows whose logits are
//! wanted, the paged tables), packed on the host into one byte buffer and uploaded with one copy.
//! A replayed decode graph ([`super::graphs`]) reads them from a buffer of its own at fixed
//! addresses, so every region has a capacity fixed by the graph's shape, not by the step.

use tessera_kernels::cuda::{CudaSlice, DevPtr, KdaSequenceTables};

use super::super::{LogitsWanted, Rows};
use super::Gpu;
use crate::error::Result;
use crate::sampler::SampleDraw;

/// Host side of the packed inputs: regions of i32 or i64 values, each 8-byte aligned.
#[derive(Default)]
pub(super) struct Packed {
    bytes: Vec<u8>,
}

/// A region's byte offset in [`Packed`], resolved to a device address by [`Packed::at`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Region(usize);

impl Packed {
    fn region(&mut self, bytes: usize) -> (Region, usize) {
        let at = self.bytes.len();
        // Room for at least one value (kernels may be handed an empty table), 8-byte aligned.
        let len = bytes.max(8).next_multiple_of(8);
        self.bytes.resize(at + len, 0);
        (Region(at), at)
    }

    /// `v` as i32, in a region of room for `cap ≥ v.len()` values.
    pub fn i32s(&mut self, v: &[usize], cap: usize) -> Region {
        let (r, mut at) = self.region(4 * cap.max(v.len()));
        for &x in v {
            self.bytes[at..at + 4].copy_from_slice(&(x as i32).to_le_bytes());
            at += 4;
        }
        r
    }

    /// `v` as i64, in a region of room for `cap ≥ v.len()` values.
    pub fn i64s(&mut self, v: &[i64], cap: usize) -> Region {
        let (r, mut at) = self.region(8 * cap.max(v.len()));
        for x in v {
            self.bytes[at..at + 8].copy_from_slice(&x.to_le_bytes());
            at += 8;
        }
        r
    }

    /// `v` as f32, in a region of exactly its length.
    pub fn f32s(&mut self, v: &[f32]) -> Region {
        let (r, mut at) = self.region(4 * v.len());
        for x in v {
            self.bytes[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        r
    }

    /// `v` as f64, in a region of exactly its length.
    pub fn f64s(&mut self, v: &[f64]) -> Region {
        let (r, mut at) = self.region(8 * v.len());
        for x in v {
            self.bytes[at..at + 8].copy_from_slice(&x.to_le_bytes());
            at += 8;
        }
        r
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Uploads into a new device buffer.
    pub fn upload(&self, gpu: &Gpu) -> Result<CudaSlice<u8>> {
        Ok(gpu.dev.upload(&self.bytes)?)
    }

    /// Device address of `r` in a buffer at `base` holding these bytes.
    pub fn at(base: DevPtr, r: Region) -> DevPtr {
        base + r.0 as u64
    }
}

/// Row layout of one forward call: on the host, and (ids, segment starts, logit rows) on the
/// device.
pub(super) struct Step {
    pub rows: usize,
    pub layout: Rows,
    pub ids: DevPtr,
    pub seg_start: DevPtr,
    /// Per segment, its first chunk of the chunked KDA prefill (i32, `segments + 1`), and the
    /// chunks over all segments.
    pub chunk_start: DevPtr,
    pub chunks: usize,
    /// Rows of the longest segment.
    pub longest: usize,
    /// The rows whose logits the call returns, in order, and how many of them per segment.
    pub logit_rows: DevPtr,
    pub logit_counts: Vec<usize>,
}

/// A [`Step`] before upload.
pub(super) struct StepPlan {
    layout: Rows,
    ids: Region,
    seg_start: Region,
    chunk_start: Region,
    chunks: usize,
    logit_rows: Region,
    logit_counts: Vec<usize>,
}

impl StepPlan {
    pub fn pack(pk: &mut Packed, tokens: &[&[u32]], wanted: &[LogitsWanted]) -> Self {
        let layout = Rows::new(tokens.iter().map(|t| t.len()));
        let n = layout.total();
        let ids: Vec<usize> = tokens
            .iter()
            .flat_map(|t| t.iter().map(|&t| t as usize))
            .collect();
        let ids = pk.i32s(&ids, n);
        let seg_start = pk.i32s(&layout.starts, tokens.len() + 1);
        let tables = KdaSequenceTables::new(tokens.iter().map(|t| t.len()));
        let chunk_start: Vec<usize> = tables.chunk_start.iter().map(|&c| c as usize).collect();
        let chunk_start_region = pk.i32s(&chunk_start, tokens.len() + 1);
        let mut rows = Vec::new();
        let mut logit_counts = Vec::with_capacity(wanted.len());
        for (w, range) in wanted.iter().zip(layout.ranges()) {
            let r = w.rows(range);
            logit_counts.push(r.len());
            rows.extend(r);
        }
        let logit_rows = pk.i32s(&rows, 0);
        StepPlan {
            layout,
            ids,
            seg_start,
            chunk_start: chunk_start_region,
            chunks: tables.chunks(),
            logit_rows,
            logit_counts,
        }
    }

    pub fn layout(&self) -> &Rows {
        &self.layout
    }

    /// The step, its inputs uploaded to a buffer at `base`.
    pub fn at(self, base: DevPtr) -> Step {
        let longest = self.layout.ranges().map(|r| r.len()).max().unwrap_or(0);
        Step {
            rows: self.layout.total(),
            layout: self.layout,
            ids: Packed::at(base, self.ids),
            seg_start: Packed::at(base, self.seg_start),
            chunk_start: Packed::at(base, self.chunk_start),
            chunks: self.chunks,
            longest,
            logit_rows: Packed::at(base, self.logit_rows),
            logit_counts: self.logit_counts,
        }
    }
}

impl Step {
    pub fn ranges(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        self.layout.ranges()
    }

    pub fn segments(&self) -> usize {
        self.logit_counts.len()
    }

    /// Per segment, its sampled token (`ids` holds one per logits row, and a segment asking
    /// for one row of logits gets one token).
    pub fn tokens_per_segment(&self, ids: &[u32]) -> Vec<Option<u32>> {
        let mut next = ids.iter();
        self.logit_counts
            .iter()
            .map(|&c| if c == 0 { None } else { next.next().copied() })
            .collect()
    }

    /// Rows of logits the call returns.
    pub fn logit_total(&self) -> usize {
        self.logit_counts.iter().sum()
    }
}

/// Per logits row, the sampling rule and draw a step samples with on the device.
pub(super) struct DrawPlan {
    temperature: Region,
    top_k: Region,
    top_p: Region,
    uniform: Region,
}

/// [`DrawPlan`] uploaded: `(temperature, top_k, top_p, uniform)` addresses.
pub(super) type Draws = (DevPtr, DevPtr, DevPtr, DevPtr);

impl DrawPlan {
    pub fn pack(pk: &mut Packed, draws: &[SampleDraw]) -> Self {
        let t: Vec<f32> = draws.iter().map(|d| d.temperature).collect();
        let k: Vec<usize> = draws
            .iter()
            .map(|d| d.top_k.min(u32::MAX as usize))
            .collect();
        let p: Vec<f32> = draws.iter().map(|d| d.top_p).collect();
        let u: Vec<f64> = draws.iter().map(|d| d.uniform).collect();
        DrawPlan {
            temperature: pk.f32s(&t),
            top_k: pk.i32s(&k, 0),
            top_p: pk.f32s(&p),
            uniform: pk.f64s(&u),
        }
    }

    pub fn at(&self, base: DevPtr) -> Draws {
        (
            Packed::at(base, self.temperature),
            Packed::at(base, self.top_k),
            Packed::at(base, self.top_p),
            Packed::at(base, self.uniform),
        )
    }
}
