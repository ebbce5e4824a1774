//! Where the mixers find each sequence's state for one forward call.
//!
//! Two homes, one kernel interface ([`SegState`], [`PagedHistory`]):
//! - **paged**: the serving path. The state lives in the page arena in device memory, addressed
//!   by the page IDs the scheduler holds; KDA layers read the state page of the sequence's
//!   current length and write the advanced state to the page the step writes (the same page, or
//!   a fresh one: the copy-on-write), and MLA layers append the new latent rows into the
//!   sequence's pages and attend over its page table. Nothing crosses to the host.
//! - **host**: `SequenceState` values owned by the caller (`Model::forward`), uploaded into a
//!   scratch buffer laid out like a pool of one page per sequence and read back after the layer.

use tessera_kernels::cuda::{CudaSlice, DevPtr, PagedHistory, SegState};

use super::super::{PagedLayer, PagedState, Segment};
use super::weights::upload_i32;
use super::{Gpu, Step};
use crate::error::{EngineError, Result};
use crate::state::LayerState;

/// A history "page" of the host form: the whole sequence.
const WHOLE_SEQUENCE: usize = i32::MAX as usize;

/// The state of every segment, for the whole call.
pub(super) enum States<'s, 'a> {
    Host(&'s mut [Segment<'a>]),
    Paged(Box<PagedTables>),
}

/// A KDA layer's state, as the kernels address it.
pub(super) struct KdaIo {
    pub conv: SegState,
    pub recurrent: SegState,
    /// The host form's scratch (read back by [`States::kda_done`]).
    scratch: Option<(CudaSlice<f32>, CudaSlice<i64>)>,
}

/// An MLA layer's latent history, and where the call's new rows go.
pub(super) struct MlaIo {
    pub hist: PagedHistory,
    /// Per row: floats from `hist.base` where its latent row is stored.
    pub row_dst: DevPtr,
    /// Per row: history rows it attends to (its own included).
    pub visible: DevPtr,
    pub max_visible: usize,
    /// The host form's per-layer tables and buffer (read back by [`States::mla_done`]).
    tables: Option<HistTables>,
    scratch: Option<CudaSlice<f32>>,
}

/// Per-call device tables of the paged form.
pub(super) struct PagedTables {
    arena: u64,
    layers: Vec<PagedLayer>,
    /// Per KDA group: source and destination offsets (floats, plane-relative) per segment.
    kda: Vec<(CudaSlice<i64>, CudaSlice<i64>)>,
    mla: Option<HistTables>,
}

/// Page list, per-row first page, stored-row offsets and visible counts of a latent history.
struct HistTables {
    pages: CudaSlice<i64>,
    first: CudaSlice<i32>,
    row_dst: CudaSlice<i64>,
    visible: CudaSlice<i32>,
    max_visible: usize,
    page_tokens: usize,
}

impl HistTables {
    /// `pages[s]`: segment `s`'s page offsets (floats); `start[s]`: rows it already holds.
    fn build(
        gpu: &Gpu,
        step: &Step,
        pages: &[Vec<i64>],
        start: &[usize],
        page_tokens: usize,
        width: usize,
    ) -> Result<Self> {
        let mut flat = Vec::new();
        let (mut first, mut row_dst, mut visible) = (Vec::new(), Vec::new(), Vec::new());
        for ((range, seg_pages), &before) in step.ranges().zip(pages).zip(start) {
            let at = flat.len();
            for i in 0..range.len() {
                let j = before + i;
                let page = seg_pages.get(j / page_tokens).ok_or_else(|| {
                    EngineError::InvalidInput(format!(
                        "row {j} of a sequence has no latent page ({} pages of {page_tokens})",
                        seg_pages.len()
                    ))
                })?;
                first.push(at);
                row_dst.push(page + ((j % page_tokens) * width) as i64);
                visible.push(j + 1);
            }
            flat.extend_from_slice(seg_pages);
        }
        let dev = &gpu.dev;
        Ok(HistTables {
            max_visible: visible.iter().copied().max().unwrap_or(1),
            pages: dev.upload(&pad(flat))?,
            first: upload_i32(dev, &first)?,
            row_dst: dev.upload(&pad(row_dst))?,
            visible: upload_i32(dev, &visible)?,
            page_tokens,
        })
    }

    fn io(&self, gpu: &Gpu, base: u64) -> MlaIo {
        MlaIo {
            hist: PagedHistory {
                base,
                pages: gpu.p(&self.pages),
                first: gpu.p(&self.first),
                page_tokens: self.page_tokens,
            },
            row_dst: gpu.p(&self.row_dst),
            visible: gpu.p(&self.visible),
            max_visible: self.max_visible,
            tables: None,
            scratch: None,
        }
    }
}

/// Device arrays may not be empty.
fn pad(mut v: Vec<i64>) -> Vec<i64> {
    if v.is_empty() {
        v.push(0);
    }
    v
}

fn floats(bytes: usize) -> i64 {
    (bytes / 4) as i64
}

impl PagedTables {
    pub(super) fn new(
        gpu: &Gpu,
        step: &Step,
        arena: u64,
        st: &PagedState,
        width: usize,
    ) -> Result<Self> {
        let dev = &gpu.dev;
        let mut kda = Vec::with_capacity(st.kda.len());
        for group in &st.kda {
            let src: Vec<i64> = group.iter().map(|(s, _)| s.map_or(-1, floats)).collect();
            let dst: Vec<i64> = group.iter().map(|&(_, d)| floats(d)).collect();
            kda.push((dev.upload(&pad(src))?, dev.upload(&pad(dst))?));
        }
        let has_mla = st
            .layers
            .iter()
            .any(|l| matches!(l, PagedLayer::Mla { .. }));
        let mla = if has_mla {
            let pages: Vec<Vec<i64>> = st
                .mla_pages
                .iter()
                .map(|p| p.iter().map(|&b| floats(b)).collect())
                .collect();
            Some(HistTables::build(
                gpu,
                step,
                &pages,
                &st.start,
                st.page_tokens,
                width,
            )?)
        } else {
            None
        };
        Ok(PagedTables {
            arena,
            layers: st.layers.clone(),
            kda,
            mla,
        })
    }
}

impl States<'_, '_> {
    /// Layer `l`'s KDA state: conv windows `conv_len` and recurrent states `rec_len` floats per
    /// segment.
    pub(super) fn kda_io(
        &mut self,
        gpu: &Gpu,
        l: usize,
        conv_len: usize,
        rec_len: usize,
    ) -> Result<KdaIo> {
        match self {
            States::Paged(t) => {
                let PagedLayer::Kda {
                    group,
                    conv,
                    recurrent,
                } = t.layers[l]
                else {
                    return Err(layer_mismatch(l));
                };
                let (src_off, dst_off) = &t.kda[group];
                let at = |field: usize| SegState {
                    src: t.arena + field as u64,
                    dst: t.arena + field as u64,
                    src_off: gpu.p(src_off),
                    dst_off: gpu.p(dst_off),
                };
                Ok(KdaIo {
                    conv: at(conv),
                    recurrent: at(recurrent),
                    scratch: None,
                })
            }
            States::Host(segments) => {
                // One "page" per segment: its conv window, then its recurrent state, uploaded
                // through the page-locked staging buffer.
                let stride = conv_len + rec_len;
                let mut parts: Vec<&[f32]> = Vec::with_capacity(2 * segments.len());
                for seg in segments.iter() {
                    let LayerState::Kda(k) = &seg.state.layers[l] else {
                        return Err(layer_mismatch(l));
                    };
                    parts.push(&k.conv);
                    parts.push(&k.recurrent);
                }
                let buf = gpu.dev.upload_parts(&parts)?;
                let offs: Vec<i64> = (0..segments.len()).map(|s| (s * stride) as i64).collect();
                let offs = gpu.dev.upload(&pad(offs))?;
                let at = |field: usize| SegState {
                    src: gpu.p_at(&buf, field),
                    dst: gpu.p_at(&buf, field),
                    src_off: gpu.p(&offs),
                    dst_off: gpu.p(&offs),
                };
                Ok(KdaIo {
                    conv: at(0),
                    recurrent: at(conv_len),
                    scratch: Some((buf, offs)),
                })
            }
        }
    }

    /// After a KDA layer: the host form reads the advanced state back.
    pub(super) fn kda_done(&mut self, gpu: &Gpu, l: usize, io: KdaIo) -> Result<()> {
        let (States::Host(segments), Some((buf, _))) = (self, io.scratch) else {
            return Ok(());
        };
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(2 * segments.len());
        for seg in segments.iter_mut() {
            let LayerState::Kda(k) = &mut seg.state.layers[l] else {
                return Err(layer_mismatch(l));
            };
            parts.push(&mut k.conv);
            parts.push(&mut k.recurrent);
        }
        gpu.dev.download_parts(&buf, &mut parts)?;
        Ok(())
    }

    /// Layer `l`'s latent history (rows of `rank + rope` floats) with room for the call's rows.
    pub(super) fn mla_io(
        &mut self,
        gpu: &Gpu,
        step: &Step,
        l: usize,
        rank: usize,
        rope: usize,
    ) -> Result<MlaIo> {
        let width = rank + rope;
        match self {
            States::Paged(t) => {
                let PagedLayer::Mla { latent } = t.layers[l] else {
                    return Err(layer_mismatch(l));
                };
                let tables = t.mla.as_ref().ok_or_else(|| layer_mismatch(l))?;
                Ok(tables.io(gpu, t.arena + latent as u64))
            }
            States::Host(segments) => {
                // One "page" per segment holding its whole history plus the new rows.
                let mut host = Vec::new();
                let (mut pages, mut start) = (Vec::new(), Vec::new());
                for (seg, range) in segments.iter().zip(step.ranges()) {
                    let LayerState::Mla(m) = &seg.state.layers[l] else {
                        return Err(layer_mismatch(l));
                    };
                    let before = m.ckv.len() / rank;
                    pages.push(vec![(host.len()) as i64]);
                    start.push(before);
                    for j in 0..before {
                        host.extend_from_slice(&m.ckv[j * rank..(j + 1) * rank]);
                        host.extend_from_slice(&m.kpe[j * rope..(j + 1) * rope]);
                    }
                    host.resize(host.len() + range.len() * width, 0.0);
                }
                let tables = HistTables::build(gpu, step, &pages, &start, WHOLE_SEQUENCE, width)?;
                let buf = gpu.dev.upload(&host)?;
                // The io keeps the host form's buffer and tables alive until `mla_done`.
                let mut io = tables.io(gpu, gpu.p(&buf));
                io.scratch = Some(buf);
                io.tables = Some(tables);
                Ok(io)
            }
        }
    }

    /// After an MLA layer: the host form appends the new latent rows to each sequence.
    pub(super) fn mla_done(
        &mut self,
        gpu: &Gpu,
        step: &Step,
        l: usize,
        io: MlaIo,
        rank: usize,
        rope: usize,
    ) -> Result<()> {
        let (States::Host(segments), Some(buf), Some(tables)) = (self, io.scratch, io.tables)
        else {
            return Ok(());
        };
        let all = gpu.dev.download(&buf)?;
        let row_dst = gpu.dev.download(&tables.row_dst)?;
        for (seg, range) in segments.iter_mut().zip(step.ranges()) {
            let LayerState::Mla(m) = &mut seg.state.layers[l] else {
                return Err(layer_mismatch(l));
            };
            for t in range {
                let at = row_dst[t] as usize;
                m.ckv.extend_from_slice(&all[at..at + rank]);
                m.kpe.extend_from_slice(&all[at + rank..at + rank + rope]);
            }
        }
        Ok(())
    }
}

fn layer_mismatch(l: usize) -> EngineError {
    EngineError::InvalidInput(format!(
        "the state given for layer {l} is not of that layer's kind"
    ))
}
