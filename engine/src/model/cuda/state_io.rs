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

use super::super::{PagedLayer, PagedState, Rows, Segment};
use super::inputs::{Packed, Region, Step};
use super::Gpu;
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
    scratch: Option<(CudaSlice<f32>, CudaSlice<u8>)>,
}

/// An MLA layer's latent history, and where the call's new rows go.
pub(super) struct MlaIo {
    pub hist: PagedHistory,
    /// Per row: floats from `hist.base` where its latent row is stored.
    pub row_dst: DevPtr,
    /// Per row: history rows it attends to (its own included).
    pub visible: DevPtr,
    pub max_visible: usize,
    /// The host form's row destinations, tables and buffer (used by [`States::mla_done`]).
    host: Option<(Vec<i64>, CudaSlice<u8>, CudaSlice<f32>)>,
}

/// Room reserved in the packed tables, for a replayed graph whose tables sit at fixed
/// addresses: page list entries, and the attention's history bound (a row never sees more).
#[derive(Clone, Copy, Debug)]
pub(super) struct TableRoom {
    pub pages: usize,
    pub max_visible: usize,
}

/// Per-call device tables of the paged form.
pub(super) struct PagedTables {
    arena: u64,
    layers: Vec<PagedLayer>,
    /// Per KDA group: source and destination offsets (floats, plane-relative) per segment.
    kda: Vec<(DevPtr, DevPtr)>,
    mla: Option<HistTables>,
}

/// [`PagedTables`] before upload.
pub(super) struct PagedPlan {
    layers: Vec<PagedLayer>,
    kda: Vec<(Region, Region)>,
    mla: Option<HistPlan>,
}

/// Page list, per-row first page, stored-row offsets and visible counts of a latent history.
struct HistTables {
    pages: DevPtr,
    first: DevPtr,
    row_dst: DevPtr,
    visible: DevPtr,
    max_visible: usize,
    page_tokens: usize,
}

/// [`HistTables`] before upload, with the row destinations kept on the host.
struct HistPlan {
    pages: Region,
    first: Region,
    row_dst: Region,
    visible: Region,
    max_visible: usize,
    page_tokens: usize,
    row_dst_host: Vec<i64>,
}

impl HistPlan {
    /// `pages[s]`: segment `s`'s page offsets (floats); `start[s]`: rows it already holds.
    fn pack(
        pk: &mut Packed,
        layout: &Rows,
        pages: &[Vec<i64>],
        start: &[usize],
        (page_tokens, width): (usize, usize),
        room: Option<TableRoom>,
    ) -> Result<Self> {
        let mut flat = Vec::new();
        let (mut first, mut row_dst, mut visible) = (Vec::new(), Vec::new(), Vec::new());
        for ((range, seg_pages), &before) in layout.ranges().zip(pages).zip(start) {
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
        let mut max_visible = visible.iter().copied().max().unwrap_or(1);
        let mut pages_room = flat.len();
        if let Some(room) = room {
            if room.pages < flat.len() || room.max_visible < max_visible {
                return Err(EngineError::Device(format!(
                    "a step's tables ({} pages, {max_visible} rows) exceed the room made for them \
                     ({} pages, {} rows)",
                    flat.len(),
                    room.pages,
                    room.max_visible
                )));
            }
            (pages_room, max_visible) = (room.pages, room.max_visible);
        }
        let rows = first.len();
        Ok(HistPlan {
            pages: pk.i64s(&flat, pages_room),
            first: pk.i32s(&first, rows),
            row_dst: pk.i64s(&row_dst, rows),
            visible: pk.i32s(&visible, rows),
            max_visible,
            page_tokens,
            row_dst_host: row_dst,
        })
    }

    fn at(&self, base: DevPtr) -> HistTables {
        HistTables {
            pages: Packed::at(base, self.pages),
            first: Packed::at(base, self.first),
            row_dst: Packed::at(base, self.row_dst),
            visible: Packed::at(base, self.visible),
            max_visible: self.max_visible,
            page_tokens: self.page_tokens,
        }
    }
}

impl HistTables {
    fn io(&self, base: u64) -> MlaIo {
        MlaIo {
            hist: PagedHistory {
                base,
                pages: self.pages,
                first: self.first,
                page_tokens: self.page_tokens,
            },
            row_dst: self.row_dst,
            visible: self.visible,
            max_visible: self.max_visible,
            host: None,
        }
    }
}

fn floats(bytes: usize) -> i64 {
    (bytes / 4) as i64
}

impl PagedPlan {
    /// Packs the tables of a paged step; `width`: floats of a latent row; `room`: fixed room for
    /// a graph's tables.
    pub(super) fn pack(
        pk: &mut Packed,
        layout: &Rows,
        st: &PagedState,
        width: usize,
        room: Option<TableRoom>,
    ) -> Result<Self> {
        let segments = st.start.len();
        let mut kda = Vec::with_capacity(st.kda.len());
        for group in &st.kda {
            let src: Vec<i64> = group.iter().map(|(s, _)| s.map_or(-1, floats)).collect();
            let dst: Vec<i64> = group.iter().map(|&(_, d)| floats(d)).collect();
            kda.push((pk.i64s(&src, segments), pk.i64s(&dst, segments)));
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
            Some(HistPlan::pack(
                pk,
                layout,
                &pages,
                &st.start,
                (st.page_tokens, width),
                room,
            )?)
        } else {
            None
        };
        Ok(PagedPlan {
            layers: st.layers.clone(),
            kda,
            mla,
        })
    }

    /// The tables, uploaded to a buffer at `base`, over the arena at `arena`.
    pub(super) fn at(&self, base: DevPtr, arena: u64) -> PagedTables {
        PagedTables {
            arena,
            layers: self.layers.clone(),
            kda: self
                .kda
                .iter()
                .map(|&(s, d)| (Packed::at(base, s), Packed::at(base, d)))
                .collect(),
            mla: self.mla.as_ref().map(|m| m.at(base)),
        }
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
                let (src_off, dst_off) = t.kda[group];
                let at = |field: usize| SegState {
                    src: t.arena + field as u64,
                    dst: t.arena + field as u64,
                    src_off,
                    dst_off,
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
                let mut pk = Packed::default();
                pk.i64s(&offs, 0);
                let offs = pk.upload(gpu)?;
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
                Ok(tables.io(t.arena + latent as u64))
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
                let mut pk = Packed::default();
                let plan = HistPlan::pack(
                    &mut pk,
                    &step.layout,
                    &pages,
                    &start,
                    (WHOLE_SEQUENCE, width),
                    None,
                )?;
                let tables = pk.upload(gpu)?;
                let buf = gpu.dev.upload(&host)?;
                // The io keeps the host form's buffer and tables alive until `mla_done`.
                let mut io = plan.at(gpu.p(&tables)).io(gpu.p(&buf));
                io.host = Some((plan.row_dst_host, tables, buf));
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
        let (States::Host(segments), Some((row_dst, _tables, buf))) = (self, io.host) else {
            return Ok(());
        };
        let all = gpu.dev.download(&buf)?;
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
