//! The forward pass over state that lives in the page arena (the serving path on a GPU).
//!
//! The scheduler owns the page IDs; the model only needs where each layer's bytes are. A page's
//! offset in plane `k` is `k`'s plane base plus the page's offset in plane 0, so a step is
//! described by a few byte offsets per layer (plane base plus field offset) and per page (its
//! plane-0 offset), whatever the family: [`PagedState`].

use super::{EmbedSplice, LogitsWanted, Model};
use crate::error::{EngineError, Result};
use crate::kv::{DynArena, HostArena, KvArena, KvLayout};
use crate::sampler::SampleDraw;

/// Byte offsets from the arena's start of one layer's fields in its plane; a page's plane-0
/// offset is added to address that page's copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagedLayer {
    /// `group`: index into [`PagedState::kda`].
    Kda {
        group: usize,
        conv: usize,
        recurrent: usize,
    },
    Mla {
        latent: usize,
    },
}

/// Where one step's state lives in the arena (all offsets in bytes, pages as plane-0 offsets).
#[derive(Clone, Debug, Default)]
pub struct PagedState {
    pub page_tokens: usize,
    /// Per model layer.
    pub layers: Vec<PagedLayer>,
    /// Per KDA group, per segment: the page holding the state before the step (`None`: the
    /// sequence starts here, zero state) and the page the advanced state goes to (the same page
    /// when the sequence may write it in place).
    pub kda: Vec<Vec<(Option<usize>, usize)>>,
    /// Per segment: tokens already in the pool.
    pub start: Vec<usize>,
    /// Per segment: its MLA pages in order, covering at least `start + tokens` rows.
    pub mla_pages: Vec<Vec<usize>>,
}

impl Model {
    /// Whether serving keeps sequence state in a device arena ([`Self::new_kv_arena`]) and
    /// runs steps with [`Self::forward_paged`].
    pub fn paged_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.cuda.is_some() {
            return true;
        }
        false
    }

    /// Where the GPU forward's time went since the last call, by part of the model, when the
    /// process runs with `TESSERA_CUDA_PROFILE=1` (which synchronises around every part).
    pub fn take_device_profile(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            return gpu.take_profile();
        }
        None
    }

    /// Decode steps captured into and replayed from CUDA graphs so far, `(captured, replayed)`;
    /// `None` off the GPU.
    pub fn device_graph_counts(&self) -> Option<(u64, u64)> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            return Some(gpu.graph_counts());
        }
        None
    }

    /// Turns replay of decode steps from CUDA graphs on or off (on by default, off with
    /// `TESSERA_CUDA_GRAPHS=0`); a no-op off the GPU.
    pub fn set_device_graphs(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            gpu.set_graphs(on);
        }
        let _ = on;
    }

    /// Storage for a page pool of `layout`, where this model's forward reads state: device
    /// memory beside the weights on a GPU, host memory on the CPU.
    pub fn new_kv_arena(&self, layout: &KvLayout) -> Result<DynArena> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            if !layout.dtypes.all_f32() {
                return Err(EngineError::Device(format!(
                    "the GPU forward keeps state in f32; the layout asks for {:?}",
                    layout.dtypes
                )));
            }
            let arena =
                super::cuda::DeviceArena::new(gpu.device(), gpu.ordinal(), layout.arena_bytes())?;
            return Ok(Box::new(arena));
        }
        Ok(Box::new(HostArena::new(layout)?))
    }

    /// Runs one step whose state lives in `arena` (a device arena from [`Self::new_kv_arena`]):
    /// segment `i` feeds `tokens[i]`, reading and writing state where `state` says, and returns
    /// the logits `wanted[i]` asks for. `splices[i]` replaces input embeddings of segment `i`.
    pub fn forward_paged(
        &self,
        tokens: &[&[u32]],
        wanted: &[LogitsWanted],
        splices: &[Vec<EmbedSplice<'_>>],
        state: &PagedState,
        arena: &dyn KvArena,
    ) -> Result<Vec<Vec<f32>>> {
        match self.paged_step(tokens, wanted, splices, state, arena, None)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Tokens(_) => unreachable!("no draws, no sampling"),
        }
    }

    /// [`Self::forward_paged`] that samples on the device: segment `i`, when `wanted[i]` asks for
    /// its last row, gets the token `draws[i]` picks from it (the rule of
    /// [`crate::sampler::Sampler::sample`]); only token ids come back from the device.
    pub fn forward_paged_sampled(
        &self,
        tokens: &[&[u32]],
        wanted: &[LogitsWanted],
        splices: &[Vec<EmbedSplice<'_>>],
        state: &PagedState,
        arena: &dyn KvArena,
        draws: &[Option<SampleDraw>],
    ) -> Result<Vec<Option<u32>>> {
        if draws.len() != tokens.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} draws for a step of {} segments",
                draws.len(),
                tokens.len()
            )));
        }
        let mut rows = Vec::new();
        for (i, (w, d)) in wanted.iter().zip(draws).enumerate() {
            match (w, d) {
                (LogitsWanted::None, _) => {}
                (LogitsWanted::Last, Some(d)) => {
                    check_draw(d)?;
                    rows.push(*d);
                }
                (LogitsWanted::Last, None) => {
                    return Err(EngineError::InvalidInput(format!(
                        "segment {i} wants a token but has no draw"
                    )))
                }
                (LogitsWanted::All, _) => {
                    return Err(EngineError::InvalidInput(format!(
                        "segment {i} wants every row's logits; sampling takes its last row only"
                    )))
                }
            }
        }
        match self.paged_step(tokens, wanted, splices, state, arena, Some(&rows))? {
            StepOut::Tokens(t) => Ok(t),
            StepOut::Logits(_) => unreachable!("draws given, tokens back"),
        }
    }

    fn paged_step(
        &self,
        tokens: &[&[u32]],
        wanted: &[LogitsWanted],
        splices: &[Vec<EmbedSplice<'_>>],
        state: &PagedState,
        arena: &dyn KvArena,
        draws: Option<&[SampleDraw]>,
    ) -> Result<StepOut> {
        let n = tokens.len();
        if wanted.len() != n
            || state.start.len() != n
            || state.mla_pages.len() != n
            || state.kda.iter().any(|g| g.len() != n)
            || state.layers.len() != self.layers.len()
        {
            return Err(EngineError::InvalidInput(format!(
                "a paged step of {n} segments over {} layers got tables for {} segments, {} layers",
                self.layers.len(),
                state.start.len(),
                state.layers.len()
            )));
        }
        self.check_batch(tokens, splices)?;
        let Some((ordinal, base)) = arena.device() else {
            return Err(EngineError::Device(
                "a paged forward needs the page arena in device memory".into(),
            ));
        };
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            if gpu.ordinal() != ordinal {
                return Err(EngineError::Device(format!(
                    "the page arena is on GPU {ordinal}, the model on GPU {}",
                    gpu.ordinal()
                )));
            }
            return gpu.forward_paged(tokens, wanted, splices, state, base, draws);
        }
        let _ = (ordinal, base, draws);
        Err(EngineError::Device(
            "a paged forward needs the model on a GPU".into(),
        ))
    }
}

/// What a paged step returns: the logits asked for, or (sampled on the device) per segment the
/// next token where one was asked for.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum StepOut {
    Logits(Vec<Vec<f32>>),
    Tokens(Vec<Option<u32>>),
}

fn check_draw(d: &SampleDraw) -> Result<()> {
    let ok = d.temperature.is_finite()
        && d.temperature >= 0.0
        && d.top_p > 0.0
        && d.top_p <= 1.0
        && (0.0..1.0).contains(&d.uniform);
    if !ok {
        return Err(EngineError::InvalidInput(format!(
            "a sampling draw out of range: {d:?} (temperature ≥ 0, top_p in (0, 1], draw in [0, 1))"
        )));
    }
    Ok(())
}
