//! Decode steps replayed as CUDA graphs.
//!
//! A decode step (one token per sequence, no input embeddings given) launches a few hundred
//! small kernels; issued one by one from the host, their launch work takes longer than the GPU
//! takes to run them. So a decode step over paged state is captured once per shape and replayed
//! with one launch. A shape ([`Key`]) is the batch size, the attention's history bound rounded
//! up to a power of two, and the page arena; its graph reads every per-step input (token ids,
//! page tables) from a buffer of its own at fixed addresses, rewritten with one copy before each
//! replay, and writes logits into a buffer of its own. Its scratch is the graph's memory.
//!
//! A shape is captured the second time it is seen: the first step runs as usual, so every
//! lazily made resource (MoE workspaces, cuBLAS's) exists before capture. A replay runs the
//! same kernels on the same values as the step it replaces, so its logits are the same bits.
//! A step that samples on the device captures the sampler too and reads back only token ids.
//! `TESSERA_CUDA_GRAPHS=0` turns replay off.

use std::collections::{HashMap, HashSet};

use tessera_kernels::cuda::{CudaSlice, Graph};

use super::super::paged::StepOut;
use super::super::{EmbedSplice, LogitsWanted, PagedLayer, PagedState};
use super::inputs::{DrawPlan, Packed, StepPlan};
use super::state_io::{PagedPlan, States, TableRoom};
use super::{CudaModel, DFfn};
use crate::error::Result;
use crate::sampler::SampleDraw;

/// Graphs kept at most; the least recently used goes first.
const MAX_GRAPHS: usize = 48;
/// The smallest history bound a graph is made for.
const MIN_VISIBLE: usize = 256;

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Key {
    rows: usize,
    max_visible: usize,
    arena: u64,
    page_tokens: usize,
    /// Whether the graph samples (returns token ids) or returns logits.
    sampled: bool,
}

struct Entry {
    graph: Graph,
    inputs: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    layers: Vec<PagedLayer>,
    used: u64,
}

pub(super) struct Graphs {
    enabled: bool,
    seen: HashSet<Key>,
    entries: HashMap<Key, Entry>,
    clock: u64,
    captured: u64,
    replayed: u64,
}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Graphs {
            enabled,
            seen: HashSet::new(),
            entries: HashMap::new(),
            clock: 0,
            captured: 0,
            replayed: 0,
        }
    }

    /// `(captured, replayed)` so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.captured, self.replayed)
    }

    /// Off also drops every graph (and its memory).
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.entries.clear();
            self.seen.clear();
        }
    }

    fn evict_if_full(&mut self) {
        if self.entries.len() < MAX_GRAPHS {
            return;
        }
        if let Some(oldest) = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| *k)
        {
            self.entries.remove(&oldest);
        }
    }
}

impl CudaModel {
    /// Whether a step of `rows` rows can be captured: every op of it only queues work (the MoE
    /// layers take the small-batch kernels, which route on the GPU), and no profile is taken.
    fn capturable(&self, rows: usize) -> bool {
        self.gpu.profile.is_none()
            && self.layers.iter().all(|l| match &l.ffn {
                DFfn::Dense(_) => true,
                DFfn::Moe(m) => m.routes_on_device(rows),
            })
    }

    /// Runs a decode step over paged state as a graph replay when it is one and its shape was
    /// seen before; `None` when the caller should run it as usual.
    pub(super) fn forward_graphed(&self, call: &Call<'_, '_>) -> Result<Option<StepOut>> {
        let (tokens, state) = (call.tokens, call.state);
        let rows = tokens.len();
        let decode = tokens.iter().all(|t| t.len() == 1)
            && call.splices.iter().all(Vec::is_empty)
            && call.wanted.iter().all(|w| !matches!(w, LogitsWanted::None));
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if !graphs.enabled || !decode || rows == 0 || !self.capturable(rows) {
            return Ok(None);
        }
        let seen = state.start.iter().max().map_or(1, |&s| s + 1);
        let max_visible = seen.next_power_of_two().max(MIN_VISIBLE);
        let key = Key {
            rows,
            max_visible,
            arena: call.arena,
            page_tokens: state.page_tokens,
            sampled: call.draws.is_some(),
        };
        if !graphs.entries.contains_key(&key) && graphs.seen.insert(key) {
            return Ok(None);
        }
        let room = TableRoom {
            pages: rows * max_visible.div_ceil(state.page_tokens.max(1)),
            max_visible,
        };
        if state.mla_pages.iter().map(Vec::len).sum::<usize>() > room.pages {
            // More pages than the rows can reach (none are reserved ahead today): run it as usual.
            return Ok(None);
        }
        let mut pk = Packed::default();
        let plan = StepPlan::pack(&mut pk, tokens, call.wanted);
        let tables = PagedPlan::pack(&mut pk, plan.layout(), state, call.width, Some(room))?;
        let draws = call.draws.map(|d| DrawPlan::pack(&mut pk, d));
        let fits = graphs
            .entries
            .get(&key)
            .is_some_and(|e| e.layers == state.layers && e.inputs.len() == pk.len());
        if !fits {
            graphs.entries.remove(&key);
            graphs.evict_if_full();
            let gpu = &self.gpu;
            let inputs = pk.upload(gpu)?;
            let base = gpu.p(&inputs);
            let logits = gpu.scratch::<f32>(rows * self.vocab)?;
            let ids = gpu.scratch::<u32>(rows)?;
            let step = plan.at(base);
            let draws = draws.map(|d| d.at(base));
            let mut states = States::Paged(Box::new(tables.at(base, call.arena)));
            let captured = gpu.dev.capture(|| {
                self.run(&step, call.splices, &mut states, gpu.p(&logits))?;
                match draws {
                    Some(d) => self.sample(rows, gpu.p(&logits), d, gpu.p(&ids)),
                    None => Ok(()),
                }
            });
            let graph = match captured {
                Ok((graph, ())) => graph,
                Err(e) => {
                    tracing::warn!(error = %e, rows, "decode step capture failed; graphs off");
                    graphs.enabled = false;
                    return Ok(None);
                }
            };
            graphs.captured += 1;
            tracing::debug!(rows, max_visible, "captured a decode step graph");
            graphs.entries.insert(
                key,
                Entry {
                    graph,
                    inputs,
                    logits,
                    ids,
                    layers: state.layers.clone(),
                    used: 0,
                },
            );
        }
        graphs.clock += 1;
        graphs.replayed += 1;
        let clock = graphs.clock;
        let e = graphs.entries.get_mut(&key).expect("inserted above");
        e.used = clock;
        let dev = &self.gpu.dev;
        dev.stream().memcpy_htod(pk.bytes(), &mut e.inputs)?;
        e.graph.launch()?;
        if key.sampled {
            let ids = dev.download(&e.ids)?;
            return Ok(Some(StepOut::Tokens(ids.into_iter().map(Some).collect())));
        }
        let mut out: Vec<Vec<f32>> = (0..rows).map(|_| vec![0.0; self.vocab]).collect();
        let mut parts: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
        dev.download_parts(&e.logits, &mut parts)?;
        Ok(Some(StepOut::Logits(out)))
    }
}

/// One paged step's inputs, as [`CudaModel::forward_paged`] takes them.
pub(super) struct Call<'c, 's> {
    pub tokens: &'c [&'c [u32]],
    pub wanted: &'c [LogitsWanted],
    pub splices: &'c [Vec<EmbedSplice<'s>>],
    pub state: &'c PagedState,
    pub arena: u64,
    /// Floats of an MLA latent row.
    pub width: usize,
    /// Sample on the device with these, one per logits row.
    pub draws: Option<&'c [SampleDraw]>,
}
