//! KDA chunked prefill of one long sequence in segments, the scan of segment i running on a
//! stream of higher priority beside the prep of segment i + 1. The scan of one sequence fills
//! only (dv / 64) × heads blocks — 64 of an H200's 132 multiprocessors at 32 heads — for a third
//! of the prefill's time; in segments the prep of what follows takes the rest of the GPU. The
//! chunks and their arithmetic are those of the one-call prefill (segments end on chunk
//! boundaries and the state crosses them in f32), so the results are the same, bit for bit.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};

use super::kda::{shape_err, uniform_call, KdaInputs, KdaKernels, KdaPacked};
use super::kda_workspace::KdaPrefillWorkspace;
use super::model_ops::{base_ptr, DevPtr, SegState};
use super::{CudaDevice, CudaError};
use crate::gpu::{KdaShape, CHUNK};

/// Segments of a prefill of one sequence: one per this many chunks, at most
/// [`DEFAULT_MAX_SEGMENTS`] (see benches/RESULTS.md).
const CHUNKS_PER_SEGMENT: usize = 64;
const DEFAULT_MAX_SEGMENTS: usize = 4;

/// When [`KdaKernels`] split a prefill of one sequence, and the stream their scans then run on.
pub(super) struct Segmentation {
    max: usize,
    chunks_per_segment: usize,
    stream: OnceLock<Arc<CudaStream>>,
}

impl Segmentation {
    /// The defaults, or `TESSERA_KDA_SEGMENTS` and `TESSERA_KDA_CHUNKS_PER_SEGMENT`.
    pub(super) fn from_env() -> Self {
        let var = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
                .max(1)
        };
        Segmentation {
            max: var("TESSERA_KDA_SEGMENTS", DEFAULT_MAX_SEGMENTS),
            chunks_per_segment: var("TESSERA_KDA_CHUNKS_PER_SEGMENT", CHUNKS_PER_SEGMENT),
            stream: OnceLock::new(),
        }
    }
}

/// Workspaces, tables and the second stream of a segmented prefill of `tokens` tokens.
pub struct KdaSegmentedPrefill {
    stream: Arc<CudaStream>,
    segments: Vec<Segment>,
    /// The state after each segment but the last, [heads][dk][dv] f32.
    carried: Vec<CudaSlice<f32>>,
    /// A zero offset (i64): where the one sequence's state lies in a state buffer.
    zero_off: CudaSlice<i64>,
    /// One byte the scan stream clears just before each scan (see `head_start`).
    marker: CudaSlice<u8>,
    /// Whether the next segment's prep waits until the scan is about to start, so that the
    /// scan's blocks reach the emptied GPU first (otherwise the prep, next on its stream, takes
    /// every multiprocessor and the scan waits for them to drain).
    head_start: bool,
    tokens: usize,
    heads: usize,
    dk: usize,
    dv: usize,
}

/// One segment: its tokens from `tok0`, its own products and its tables (one sequence).
struct Segment {
    tok0: usize,
    chunks: usize,
    ws: KdaPrefillWorkspace,
    seq_start: CudaSlice<i32>,
    chunk_start: CudaSlice<i32>,
}

impl KdaSegmentedPrefill {
    /// A segmented prefill by `kernels` of one sequence of `tokens` tokens over `heads` heads in
    /// `segments` segments of whole chunks (fewer when there are fewer chunks;
    /// [`KdaKernels::segments_for`] says how many pay). The last is a third of the others: its
    /// scan has no prep beside it.
    pub fn new(
        dev: &CudaDevice,
        kernels: &KdaKernels,
        tokens: usize,
        heads: usize,
        segments: usize,
    ) -> Result<Self, CudaError> {
        let n = segments.max(1);
        let mut weights = vec![3; n];
        weights[n - 1] = 1;
        Self::with_weights(dev, kernels, tokens, heads, &weights)
    }

    /// The same with segment sizes in proportion to `weights` (each at least one chunk; a
    /// segment that would be empty is left out).
    pub fn with_weights(
        dev: &CudaDevice,
        kernels: &KdaKernels,
        tokens: usize,
        heads: usize,
        weights: &[usize],
    ) -> Result<Self, CudaError> {
        let (dk, dv) = (kernels.dk(), kernels.dv());
        let chunks = tokens.div_ceil(CHUNK);
        let total: usize = weights.iter().sum::<usize>().max(1);
        let mut list = Vec::with_capacity(weights.len());
        let (mut c0, mut cum) = (0, 0);
        for w in weights {
            cum += w;
            let c1 = chunks * cum / total;
            if c1 == c0 {
                continue;
            }
            let (tok0, tok1) = (c0 * CHUNK, (c1 * CHUNK).min(tokens));
            list.push(Segment {
                tok0,
                chunks: c1 - c0,
                ws: KdaPrefillWorkspace::packed(dev, c1 - c0, heads, dk, dv)?,
                seq_start: dev.upload(&[0i32, (tok1 - tok0) as i32])?,
                chunk_start: dev.upload(&[0i32, (c1 - c0) as i32])?,
            });
            c0 = c1;
        }
        if list.is_empty() {
            return Err(shape_err(format!(
                "a segmented prefill of {tokens} tokens has no chunk"
            )));
        }
        let n = list.len();
        let s = dev.stream();
        let carried = (1..n)
            .map(|_| s.alloc_zeros::<f32>(heads * dk * dv))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KdaSegmentedPrefill {
            stream: kernels.scan_stream(dev)?,
            segments: list,
            carried,
            zero_off: dev.upload(&[0i64])?,
            marker: s.alloc_zeros::<u8>(1)?,
            head_start: true,
            tokens,
            heads,
            dk,
            dv,
        })
    }

    /// Whether each scan gets a head start on the next segment's prep (the default).
    pub fn set_head_start(&mut self, on: bool) {
        self.head_start = on;
    }

    /// Segments in use.
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// Tokens of the sequence this prefill is for.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

impl KdaKernels {
    /// How many segments a prefill of `sequences` sequences over `chunks` chunks in all takes:
    /// one sequence of at least two segments' worth of chunks is split so that the scan of a
    /// segment, which fills only part of the GPU, runs beside the prep of the next
    /// ([`KdaSegmentedPrefill`]); anything else is one call. `TESSERA_KDA_SEGMENTS` (or
    /// [`Self::set_segmentation`]) caps the count, 1 turning it off.
    pub fn segments_for(&self, sequences: usize, chunks: usize) -> usize {
        let g = &self.segmentation;
        if sequences != 1 {
            return 1;
        }
        (chunks / g.chunks_per_segment).clamp(1, g.max)
    }

    /// Splits a prefill of one sequence into at most `max` segments (1: never), one per
    /// `chunks_per_segment` chunks; returns the previous pair. (Defaults: 4 and 64, or
    /// `TESSERA_KDA_SEGMENTS` and `TESSERA_KDA_CHUNKS_PER_SEGMENT`.)
    pub fn set_segmentation(&mut self, max: usize, chunks_per_segment: usize) -> (usize, usize) {
        let g = &mut self.segmentation;
        let was = (g.max, g.chunks_per_segment);
        g.max = max.max(1);
        g.chunks_per_segment = chunks_per_segment.max(1);
        was
    }

    /// The scans' stream of segmented prefills (made at first use, of the highest priority).
    fn scan_stream(&self, dev: &CudaDevice) -> Result<Arc<CudaStream>, CudaError> {
        let cell = &self.segmentation.stream;
        if let Some(s) = cell.get() {
            return Ok(s.clone());
        }
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()?;
        let s = dev.context().new_stream_with_priority(highest)?;
        Ok(cell.get_or_init(|| s).clone())
    }

    /// [`Self::prefill_packed`] for one sequence of `seg.tokens()` tokens (p's tables are not
    /// read: the segments have their own), in segments whose scans overlap the next segment's
    /// prep. Ordered on the device's stream like any call: later work there sees the results.
    pub fn prefill_segmented_packed(
        &self,
        dev: &CudaDevice,
        p: &KdaPacked,
        seg: &KdaSegmentedPrefill,
    ) -> Result<(), CudaError> {
        if p.sequences != 1 || p.heads != seg.heads || (self.dk(), self.dv()) != (seg.dk, seg.dv) {
            return Err(shape_err(format!(
                "a segmented prefill for one sequence of {} heads (dk {}, dv {}) called with {} \
                 sequences of {} heads (dk {}, dv {})",
                seg.heads,
                seg.dk,
                seg.dv,
                p.sequences,
                p.heads,
                self.dk(),
                self.dv()
            )));
        }
        let main = dev.stream();
        let no_timing = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let zero = base_ptr(main, &seg.zero_off);
        let last = seg.segments.len() - 1;
        // With a head start: the event after the marker that precedes the previous segment's scan.
        let mut started = None;
        for (i, sg) in seg.segments.iter().enumerate() {
            let t = sg.tok0;
            let state = SegState {
                src: if i == 0 {
                    p.state.src
                } else {
                    base_ptr(main, &seg.carried[i - 1])
                },
                src_off: if i == 0 { p.state.src_off } else { zero },
                dst: if i == last {
                    p.state.dst
                } else {
                    base_ptr(main, &seg.carried[i])
                },
                dst_off: if i == last { p.state.dst_off } else { zero },
            };
            let at = |base: DevPtr, row_bytes: usize| base + (t * row_bytes) as DevPtr;
            let pi = KdaPacked {
                q: at(p.q, p.ld_qk * 2),
                k: at(p.k, p.ld_qk * 2),
                v: at(p.v, p.ld_v * 2),
                g: at(p.g, p.heads * seg.dk * 4),
                beta: at(p.beta, p.heads * 2),
                out: at(p.out, p.ld_o * 2),
                seq_start: base_ptr(main, &sg.seq_start),
                chunk_start: base_ptr(main, &sg.chunk_start),
                chunks: sg.chunks,
                state,
                ..*p
            };
            if let Some(marked) = started.take() {
                // The previous segment's scan is next on its stream: it reaches the GPU first.
                main.wait(&marked)?;
            }
            self.launch_prep_on(dev, main, &pi, &sg.ws)?;
            seg.stream.wait(&main.record_event(no_timing)?)?;
            if seg.head_start && i < last {
                // SAFETY: one byte of this prefill's own buffer, cleared on its stream.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        base_ptr(&seg.stream, &seg.marker),
                        0,
                        1,
                        seg.stream.cu_stream(),
                    )
                }?;
                started = Some(seg.stream.record_event(no_timing)?);
            }
            self.launch_scan_on(dev, &seg.stream, &pi, &sg.ws)?;
        }
        main.join(&seg.stream)?;
        Ok(())
    }

    /// [`Self::prefill`] for one sequence (`shape.batch` = 1, `shape.seq_len` = `seg.tokens()`),
    /// segmented as [`Self::prefill_segmented_packed`].
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_segmented(
        &self,
        dev: &CudaDevice,
        shape: KdaShape,
        x: &KdaInputs,
        scale: f32,
        l2norm: bool,
        initial: Option<&CudaSlice<f32>>,
        final_state: &mut CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        seg: &KdaSegmentedPrefill,
    ) -> Result<(), CudaError> {
        if shape.batch != 1 || shape.seq_len != seg.tokens {
            return Err(shape_err(format!(
                "a segmented prefill of one sequence of {} tokens called with {shape:?}",
                seg.tokens
            )));
        }
        self.check_call(&shape, x, initial, final_state, out)?;
        let s = dev.stream();
        let src = initial.map_or(0, |i| base_ptr(s, i));
        let (dst, o) = (base_ptr(s, final_state), base_ptr(s, out));
        let zero = base_ptr(s, &seg.zero_off);
        // The segments bring their own sequence tables.
        let p = uniform_call(
            dev,
            shape,
            Some(x),
            (scale, l2norm),
            (src, dst, o),
            (0, 0, zero),
            shape.chunks(),
        );
        self.prefill_segmented_packed(dev, &p, seg)
    }
}
