//! The Kimi Linear forward pass, composed from one module per layer kind.
//!
//! One call runs a batch of *segments*: each is a run of new tokens of one sequence with that
//! sequence's state. Projections and MLPs run once over all rows of all segments; token mixers
//! (KDA, MLA) run per segment on its own state. A prompt is one segment of many tokens; a decode
//! step of N sequences is N segments of one token.
//!
//! Kimi K3 is the same model with [`ArchSwitches`](crate::config::ArchSwitches) on: AttnRes
//! replaces the residual adds, and each layer kind reads its own switches.

#[cfg(feature = "cuda")]
mod cuda;
mod k3;
mod kda;
mod linear;
mod mla;
mod mlp;
mod moe;
pub(crate) mod mxfp4;
mod paged;

use std::ops::Range;
use std::path::Path;

use tessera_kernels::cpu;
use tessera_kernels::Device;

use crate::checkpoint::Checkpoint;
use crate::config::{AttnKind, FfnKind, ModelConfig};
use crate::error::{EngineError, Result};
use crate::state::{KdaState, LayerState, MlaState, SequenceState};
use k3::{AttnResRun, ResQuery};
use kda::KdaLayer;
use linear::{Linear, Norm};
use mla::MlaLayer;
use mlp::Mlp;
use moe::Moe;
pub use paged::{PagedLayer, PagedState};

/// Which logits a segment wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    Last,
    All,
}

impl LogitsWanted {
    /// The rows, of a segment occupying `range` of the batch, whose logits are wanted.
    fn rows(self, range: Range<usize>) -> Range<usize> {
        match self {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => range.end - 1..range.end,
            LogitsWanted::All => range,
        }
    }
}

pub struct Segment<'a> {
    pub tokens: &'a [u32],
    pub state: &'a mut SequenceState,
    pub logits: LogitsWanted,
}

impl<'a> Segment<'a> {
    /// One segment per sequence: `tokens[i]` continues `states[i]`, every one wanting `logits`
    /// (pairs past the shorter of the two are left out).
    pub fn batch<T: AsRef<[u32]>>(
        tokens: &'a [T],
        states: &'a mut [SequenceState],
        logits: LogitsWanted,
    ) -> Vec<Segment<'a>> {
        tokens
            .iter()
            .zip(states.iter_mut())
            .map(|(t, state)| Segment {
                tokens: t.as_ref(),
                state,
                logits,
            })
            .collect()
    }
}

/// Input embeddings given for some rows of a segment instead of looked up from its tokens
/// (image embeddings over their placeholder tokens): `values` holds whole rows of
/// `hidden_size` floats, the first of which is the segment's row `row`.
#[derive(Clone, Copy, Debug)]
pub struct EmbedSplice<'a> {
    pub row: usize,
    pub values: &'a [f32],
}

/// Row offsets of the segments inside the stacked batch.
pub(crate) struct Rows {
    starts: Vec<usize>,
}

impl Rows {
    fn new(lens: impl Iterator<Item = usize>) -> Self {
        let mut starts = vec![0];
        for l in lens {
            starts.push(starts.last().unwrap() + l);
        }
        Rows { starts }
    }
    pub(crate) fn total(&self) -> usize {
        *self.starts.last().unwrap()
    }
    pub(crate) fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.starts.windows(2).map(|w| w[0]..w[1])
    }
}

enum Mixer {
    Kda(KdaLayer),
    Mla(MlaLayer),
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

struct Layer {
    pub(super) input_norm: Norm,
    post_norm: Norm,
    mixer: Mixer,
    ffn: Ffn,
    /// AttnRes pseudo-queries before the mixer and before the FFN.
    res: Option<(ResQuery, ResQuery)>,
}

impl Layer {
    fn parameter_count(&self) -> usize {
        let mixer = match &self.mixer {
            Mixer::Kda(m) => m.parameter_count(),
            Mixer::Mla(m) => m.parameter_count(),
        };
        let ffn = match &self.ffn {
            Ffn::Dense(m) => m.parameter_count(),
            Ffn::Moe(m) => m.parameter_count(),
        };
        let res = self.res.as_ref().map_or(0, |(a, b)| a.len() + b.len());
        self.input_norm.w.len() + self.post_norm.w.len() + mixer + ffn + res
    }
}

pub struct Model {
    pub config: ModelConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Norm,
    lm_head: Linear,
    /// AttnRes output pseudo-query (K3).
    out_res: Option<ResQuery>,
    batch_invariant: bool,
    /// The model's copy on a CUDA GPU, when it runs there (see [`Model::to_device`]).
    #[cfg(feature = "cuda")]
    cuda: Option<Box<cuda::CudaModel>>,
}

impl Model {
    /// Loads a model directory (`config.json` + safetensors) as published.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        // K2.5 and K3 are multimodal wrappers: their text model lives under `language_model.`.
        let prefix = if config.model_type == "kimi_k3" || config.model_type == "kimi_k25" {
            "language_model.model."
        } else {
            "model."
        };
        let model = Self::from_checkpoint(config, &ck, prefix)?;
        let mut unused = ck.unused();
        // The vision tower and projector are loaded on their own (`vision::VisionModel`).
        unused.retain(|n| !n.starts_with("vision_tower.") && !n.contains("mm_projector."));
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "checkpoint tensors not used by the model");
        }
        Ok(model)
    }

    /// `prefix` is where the text model's tensors start (`model.`, `language_model.model.`); the
    /// LM head sits beside it (`lm_head.weight`, `language_model.lm_head.weight`).
    pub fn from_checkpoint(config: ModelConfig, ck: &Checkpoint, prefix: &str) -> Result<Self> {
        let (d, v, eps) = (config.hidden_size, config.vocab_size, config.rms_norm_eps);
        let attn_res = config.switches.attn_res_block_size.is_some();
        let embed_name = format!("{prefix}embed_tokens.weight");
        let embed = ck.f32(&embed_name, &[v, d])?;
        // Layers are `layers.N` as published; transformers' `kimi_k25` save writes `blocks.N`.
        let layers_key = if config.num_layers() > 0
            && !ck.contains(&format!("{prefix}layers.0.input_layernorm.weight"))
            && ck.contains(&format!("{prefix}blocks.0.input_layernorm.weight"))
        {
            "blocks"
        } else {
            "layers"
        };
        let mut layers = Vec::with_capacity(config.num_layers());
        for l in 0..config.num_layers() {
            let p = format!("{prefix}{layers_key}.{l}.");
            let attn_prefix = format!("{p}self_attn.");
            let mixer = match config.attn[l] {
                AttnKind::Kda => Mixer::Kda(KdaLayer::load(ck, &attn_prefix, &config)?),
                AttnKind::Mla => Mixer::Mla(MlaLayer::load(ck, &attn_prefix, &config)?),
            };
            let ffn = match config.ffn[l] {
                FfnKind::Dense => {
                    // Dense layers are `mlp.` in Moonshot's checkpoints and `block_sparse_moe.` in
                    // what `transformers` writes back.
                    let mlp_p = format!("{p}mlp.");
                    let moe_p = format!("{p}block_sparse_moe.");
                    let gate_mlp = format!("{mlp_p}gate_proj.weight");
                    let gate_moe = format!("{moe_p}gate_proj.weight");
                    let found = ck.resolve(&[gate_mlp.as_str(), gate_moe.as_str()])?;
                    let prefix = if found == gate_mlp { mlp_p } else { moe_p };
                    Ffn::Dense(
                        Mlp::load(ck, &prefix, d, config.intermediate_size)?
                            .with_activation(config.switches.activation),
                    )
                }
                FfnKind::Moe => Ffn::Moe(Moe::load(ck, &format!("{p}block_sparse_moe."), &config)?),
            };
            layers.push(Layer {
                input_norm: Norm::load(ck, &format!("{p}input_layernorm.weight"), d, eps)?,
                post_norm: Norm::load(ck, &format!("{p}post_attention_layernorm.weight"), d, eps)?,
                mixer,
                ffn,
                res: if attn_res {
                    Some((
                        ResQuery::load(ck, &format!("{p}self_attention_res"), d, eps)?,
                        ResQuery::load(ck, &format!("{p}mlp_res"), d, eps)?,
                    ))
                } else {
                    None
                },
            });
        }
        let norm = Norm::load(ck, &format!("{prefix}norm.weight"), d, eps)?;
        let out_res = if attn_res {
            Some(ResQuery::load(
                ck,
                &format!("{prefix}output_attn_res"),
                d,
                eps,
            )?)
        } else {
            None
        };
        let head_name = format!(
            "{}lm_head.weight",
            prefix.strip_suffix("model.").unwrap_or(prefix)
        );
        let lm_head = if config.tie_word_embeddings {
            Linear {
                w: embed.clone(),
                in_dim: d,
                out_dim: v,
            }
        } else {
            Linear::load(ck, &head_name, v, d)?
        };
        Ok(Model {
            config,
            embed,
            layers,
            norm,
            lm_head,
            out_res,
            batch_invariant: false,
            #[cfg(feature = "cuda")]
            cuda: None,
        })
    }

    /// Loads a model directory and places it on `device`.
    pub fn load_on(dir: &Path, device: Device) -> Result<Self> {
        let mut model = Self::load(dir)?;
        model.to_device(device)?;
        Ok(model)
    }

    /// Runs every later forward call on `device`: `cpu`, or a CUDA GPU (build feature `cuda`),
    /// where the weights are uploaded as bf16 (MXFP4 experts stay packed) and activations and
    /// recurrent state are f32. The host copy of the weights is kept. On a GPU, results are not
    /// batch invariant: the row count of a call picks the MoE kernels (the small-batch decode
    /// kernels up to 64 rows, per-expert GEMMs above), which round differently in bf16.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        self.place(device, false)
    }

    /// [`to_device`](Self::to_device) with f32 weights and GEMM inputs on a GPU: twice the
    /// weight memory and slower, but the GPU forward then agrees with the f32 reference to
    /// rounding, which is how its correctness is checked apart from bf16 effects.
    pub fn to_device_exact(&mut self, device: Device) -> Result<()> {
        self.place(device, true)
    }

    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn place(&mut self, device: Device, exact: bool) -> Result<()> {
        device
            .check_built()
            .map_err(|e| EngineError::Device(e.to_string()))?;
        match device {
            Device::Cpu => {
                #[cfg(feature = "cuda")]
                {
                    self.cuda = None;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let gpu = cuda::CudaModel::upload(self, n, exact)?;
                tracing::info!(device = %device, gpu = %gpu.describe(), "model uploaded");
                self.cuda = Some(Box::new(gpu));
                Ok(())
            }
            other => Err(EngineError::Device(format!(
                "whole-model execution on {other} is not available; use --device cpu or cuda"
            ))),
        }
    }

    /// Where forward calls run.
    pub fn device(&self) -> Device {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.cuda {
            return Device::Cuda(g.ordinal());
        }
        Device::Cpu
    }

    /// With batch invariance on, a token's logits are bitwise the same however its sequence is
    /// split into forward calls (chunked prefill, prefix-cache resume, decode steps, preemption
    /// and recompute) and whatever else shares the batch: KDA always runs the recurrent form and
    /// MLA the absorbed form, whose per-token arithmetic order is fixed. Serving turns it on; the
    /// chunked forms stay for prompt-only work, where they are faster.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.batch_invariant = on;
    }

    /// Parameters held in memory (f32 on CPU).
    pub fn parameter_count(&self) -> usize {
        let mut n =
            self.embed.len() + self.norm.w.len() + self.out_res.as_ref().map_or(0, ResQuery::len);
        if !self.config.tie_word_embeddings {
            n += self.lm_head.w.len();
        }
        n + self
            .layers
            .iter()
            .map(Layer::parameter_count)
            .sum::<usize>()
    }

    pub fn new_state(&self) -> SequenceState {
        SequenceState::new(&self.config)
    }

    /// Runs every segment's new tokens through the model, updating each state. Returns, per
    /// segment, the logits it asked for (`[rows, vocab]` flattened; empty for `None`).
    pub fn forward(&self, segments: &mut [Segment<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_spliced(segments, &[])
    }

    /// [`forward`](Self::forward) with, per segment (`splices[i]` for `segments[i]`; missing
    /// entries mean none), rows whose input embeddings replace the token embeddings.
    pub fn forward_spliced(
        &self,
        segments: &mut [Segment<'_>],
        splices: &[Vec<EmbedSplice<'_>>],
    ) -> Result<Vec<Vec<f32>>> {
        let d = self.config.hidden_size;
        for seg in segments.iter() {
            if seg.state.layers.len() != self.layers.len() {
                return Err(EngineError::InvalidInput(
                    "state does not belong to this model".into(),
                ));
            }
        }
        let tokens: Vec<&[u32]> = segments.iter().map(|s| s.tokens).collect();
        self.check_batch(&tokens, splices)?;
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.cuda {
            return gpu.forward(segments, splices);
        }
        let rows = Rows::new(segments.iter().map(|s| s.tokens.len()));
        let n = rows.total();
        let ids: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut h = vec![0.0; n * d];
        cpu::embedding(&self.embed, d, &ids, &mut h)?;
        for (range, seg_splices) in rows.ranges().zip(splices) {
            for sp in seg_splices {
                let at = (range.start + sp.row) * d;
                h[at..at + sp.values.len()].copy_from_slice(sp.values);
            }
        }
        let mut attn_res = self
            .config
            .switches
            .attn_res_block_size
            .map(|b| AttnResRun::new(std::mem::take(&mut h), n, b));

        for (l, layer) in self.layers.iter().enumerate() {
            let xn = match (&mut attn_res, &layer.res) {
                (Some(run), Some((q, _))) => layer.input_norm.forward(&run.before_attention(l, q)),
                _ => layer.input_norm.forward(&h),
            };
            let mixed = match &layer.mixer {
                Mixer::Kda(m) => m.forward(
                    &xn,
                    &rows,
                    &mut kda_states(segments, l),
                    self.batch_invariant,
                ),
                Mixer::Mla(m) => m.forward(
                    &xn,
                    &rows,
                    &mut mla_states(segments, l),
                    self.batch_invariant,
                ),
            };
            let xn = match (&mut attn_res, &layer.res) {
                (Some(run), Some((_, q))) => {
                    layer.post_norm.forward(&run.after_attention(l, mixed, q))
                }
                _ => {
                    add_into(&mut h, &mixed);
                    layer.post_norm.forward(&h)
                }
            };
            let f = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&xn, n),
                Ffn::Moe(m) => m.forward(&xn, n),
            };
            match &mut attn_res {
                Some(run) => run.after_mlp(f),
                None => add_into(&mut h, &f),
            }
        }
        if let (Some(run), Some(q)) = (attn_res, &self.out_res) {
            h = run.finish(q);
        }
        for seg in segments.iter_mut() {
            seg.state.len += seg.tokens.len();
        }

        let mut results = Vec::with_capacity(segments.len());
        for (seg, range) in segments.iter().zip(rows.ranges()) {
            let wanted = seg.logits.rows(range);
            if wanted.is_empty() {
                results.push(Vec::new());
                continue;
            }
            let hn = self.norm.forward(&h[wanted.start * d..wanted.end * d]);
            results.push(self.lm_head.forward(&hn, wanted.len()));
        }
        Ok(results)
    }

    /// Convenience for one sequence: feeds `tokens`, returns the requested logits.
    pub fn forward_one(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        logits: LogitsWanted,
    ) -> Result<Vec<f32>> {
        let mut segs = [Segment {
            tokens,
            state,
            logits,
        }];
        Ok(self.forward(&mut segs)?.pop().unwrap_or_default())
    }

    /// Refuses empty segments, token IDs outside the vocabulary and splices that do not fit.
    fn check_batch(&self, tokens: &[&[u32]], splices: &[Vec<EmbedSplice<'_>>]) -> Result<()> {
        let d = self.config.hidden_size;
        if splices.len() > tokens.len() {
            return Err(EngineError::InvalidInput(
                "more embedding splices than segments".into(),
            ));
        }
        if tokens.iter().any(|t| t.is_empty()) {
            return Err(EngineError::InvalidInput("a segment has no tokens".into()));
        }
        for (seg, seg_splices) in tokens.iter().zip(splices) {
            for sp in seg_splices {
                let k = sp.values.len() / d;
                if sp.values.len() % d != 0 || sp.row + k > seg.len() {
                    return Err(EngineError::InvalidInput(format!(
                        "an embedding splice of {} floats at row {} does not fit a segment of {} \
                         tokens with hidden size {d}",
                        sp.values.len(),
                        sp.row,
                        seg.len()
                    )));
                }
            }
        }
        let vocab = self.config.vocab_size;
        if let Some(&t) = tokens
            .iter()
            .flat_map(|s| s.iter())
            .find(|&&t| t as usize >= vocab)
        {
            return Err(EngineError::InvalidInput(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
        Ok(())
    }
}

/// Layer `l`'s KDA state of every segment (the layer is a KDA layer).
fn kda_states<'a>(segments: &'a mut [Segment<'_>], l: usize) -> Vec<&'a mut KdaState> {
    segments
        .iter_mut()
        .map(|s| match &mut s.state.layers[l] {
            LayerState::Kda(k) => k,
            LayerState::Mla(_) => unreachable!("state built from the same config"),
        })
        .collect()
}

/// Layer `l`'s MLA state of every segment (the layer is an MLA layer).
fn mla_states<'a>(segments: &'a mut [Segment<'_>], l: usize) -> Vec<&'a mut MlaState> {
    segments
        .iter_mut()
        .map(|s| match &mut s.state.layers[l] {
            LayerState::Mla(m) => m,
            LayerState::Kda(_) => unreachable!("state built from the same config"),
        })
        .collect()
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
