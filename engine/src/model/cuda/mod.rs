//! The forward pass on a CUDA GPU (`--device cuda[:N]`): the same model, layer by layer, with
//! bf16 weights, bf16 GEMM inputs (cuBLAS, f32 accumulation) and f32 activations, residual
//! stream and recurrent state between ops. The exact mode ([`Model::to_device_exact`]) keeps
//! weights and GEMM inputs in f32 too: the same code, held to the f32 reference's tolerance. Same contract as the CPU forward: a batch of
//! segments, each with its own `SequenceState`, updated in place.
//!
//! Sequence state: when serving, it lives in the page arena in device memory
//! ([`Model::forward_paged`](super::Model::forward_paged), [`arena::DeviceArena`]) and never
//! crosses to the host; `Model::forward` with caller-owned `SequenceState`s uploads and reads it
//! back per layer ([`state_io`]).

mod arena;
mod experts;
mod graphs;
mod inputs;
mod mixers;
mod moe;
mod state_io;
mod weights;

pub(crate) use arena::DeviceArena;

use tessera_kernels::cuda::{
    dptr, CudaDevice, CudaError, CudaSlice, DevPtr, DeviceRepr, DriverError, GemmType,
    Linear as Blas, ModelKernels, NormRows, ValidAsZeroBits,
};

use super::paged::StepOut;
use super::{EmbedSplice, Ffn, LogitsWanted, Mixer, Model, PagedState, Segment};
use crate::error::{EngineError, Result};
use crate::sampler::SampleDraw;
use graphs::Graphs;
use inputs::{DrawPlan, Draws, Packed, Step, StepPlan};
use mixers::{ChunkedKda, DKda, DMla};
use moe::DMoe;
use state_io::{PagedPlan, States};
use weights::{upload_weights, DLinear, DMlp, DVec};

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        EngineError::Device(e.to_string())
    }
}

impl From<DriverError> for EngineError {
    fn from(e: DriverError) -> Self {
        EngineError::Device(format!("CUDA driver call failed: {e}"))
    }
}

/// The device, its kernels and the cuBLAS handle.
pub(super) struct Gpu {
    dev: CudaDevice,
    k: ModelKernels,
    /// The chunked KDA prefill, where the model and mode allow it.
    kda: Option<ChunkedKda>,
    blas: Blas,
    profile: Option<Profile>,
}

/// Where the time of forward calls goes, by part of the model (`TESSERA_CUDA_PROFILE=1`): each
/// part is bracketed by stream synchronisations, so the profile slows the forward it measures.
/// A part named `outer:inner` is inside part `outer`, and counted in it too.
#[derive(Default)]
struct Profile {
    parts: std::sync::Mutex<std::collections::BTreeMap<&'static str, (u64, f64)>>,
}

impl Gpu {
    /// Runs `f` as part `name` of the profile (just runs it when profiling is off).
    fn timed<R>(&self, name: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let Some(p) = &self.profile else {
            return f();
        };
        self.dev.synchronize()?;
        let t = std::time::Instant::now();
        let r = f()?;
        self.dev.synchronize()?;
        let mut parts = p.parts.lock().unwrap_or_else(|e| e.into_inner());
        let e = parts.entry(name).or_default();
        e.0 += 1;
        e.1 += t.elapsed().as_secs_f64();
        Ok(r)
    }

    /// The profile so far, one line per part, and resets it.
    fn take_profile(&self) -> Option<String> {
        let p = self.profile.as_ref()?;
        let mut parts = p.parts.lock().unwrap_or_else(|e| e.into_inner());
        let total: f64 = parts
            .iter()
            .filter(|(k, _)| !k.contains(':'))
            .map(|(_, v)| v.1)
            .sum();
        let mut out = format!("forward profile: {:.1} ms in all", total * 1e3);
        for (name, (n, secs)) in parts.iter() {
            out.push_str(&format!(
                "\n  {name:<10} {:>9.2} ms {:>5.1}%  ({n} calls)",
                secs * 1e3,
                100.0 * secs / total.max(1e-12)
            ));
        }
        parts.clear();
        Some(out)
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.dev.stream().alloc_zeros::<T>(n.max(1))?)
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        dptr(&self.dev, s, 0)
    }

    fn p_at<T>(&self, s: &CudaSlice<T>, offset: usize) -> DevPtr {
        dptr(&self.dev, s, offset)
    }

    /// An uninitialised buffer of `n` elements (at least one), for an output whose every
    /// element the next op writes before anything reads it: one allocation call, no clearing.
    fn scratch<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: callers use it only for outputs written in full before they are read (GEMM
        // outputs with beta = 0, row kernels that write every element of every row).
        Ok(unsafe { self.dev.stream().alloc::<T>(n.max(1)) }?)
    }

    /// A GEMM-input buffer of `n` elements (bf16, or f32 in the exact mode; 16-bit words
    /// either way), written in full by the op that fills it.
    fn act(&self, n: usize) -> Result<CudaSlice<u16>> {
        self.scratch::<u16>(n * self.k.act_bytes() / 2)
    }

    /// The storage type of GEMM inputs and projection weights.
    fn act_type(&self) -> GemmType {
        if self.k.exact() {
            GemmType::F32
        } else {
            GemmType::Bf16
        }
    }

    /// An f32 buffer as a GEMM input.
    fn to_act(&self, x: &CudaSlice<f32>) -> Result<CudaSlice<u16>> {
        let out = self.act(x.len())?;
        self.k.to_act(&self.dev, self.p(x), self.p(&out), x.len())?;
        Ok(out)
    }
}

enum DMixer {
    Kda(DKda),
    Mla(DMla),
}

enum DFfn {
    Dense(Box<DMlp>),
    Moe(Box<DMoe>),
}

struct DLayer {
    input_norm: DVec,
    post_norm: DVec,
    mixer: DMixer,
    ffn: DFfn,
    res: Option<(DVec, DVec)>,
}

pub(crate) struct CudaModel {
    gpu: Gpu,
    ordinal: usize,
    hidden: usize,
    vocab: usize,
    embed: CudaSlice<u16>,
    layers: Vec<DLayer>,
    norm: DVec,
    lm_head: DLinear,
    out_res: Option<DVec>,
    attn_res_block: Option<usize>,
    graphs: std::sync::Mutex<Graphs>,
    sampler: tessera_kernels::cuda::Sampler,
}

impl CudaModel {
    /// Uploads the loaded model to GPU `ordinal`; `exact` for the f32 check mode.
    pub(crate) fn upload(model: &Model, ordinal: usize, exact: bool) -> Result<Self> {
        let dev = CudaDevice::open(ordinal, tessera_kernels::cuda::default_cache_dir())?;
        let k = ModelKernels::load(&dev, exact)?;
        let kda_head_dim = model.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Kda(m) => Some(m.head_dim),
            Mixer::Mla(_) => None,
        });
        let kda = ChunkedKda::load(&dev, kda_head_dim, exact)?;
        let blas = Blas::new(&dev)?;
        let profile = std::env::var("TESSERA_CUDA_PROFILE")
            .is_ok_and(|v| v == "1")
            .then(Profile::default);
        let gpu = Gpu {
            dev,
            k,
            kda,
            blas,
            profile,
        };
        let d = model.config.hidden_size;
        let res_q = |q: &super::k3::ResQuery| DVec::upload(&gpu, &q.q, q.eps);
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            layers.push(DLayer {
                input_norm: DVec::norm(&gpu, &layer.input_norm)?,
                post_norm: DVec::norm(&gpu, &layer.post_norm)?,
                mixer: match &layer.mixer {
                    Mixer::Kda(m) => DMixer::Kda(DKda::upload(&gpu, m)?),
                    Mixer::Mla(m) => DMixer::Mla(DMla::upload(&gpu, m)?),
                },
                ffn: match &layer.ffn {
                    Ffn::Dense(m) => DFfn::Dense(Box::new(DMlp::upload(&gpu, m)?)),
                    Ffn::Moe(m) => DFfn::Moe(Box::new(DMoe::upload(&gpu, m)?)),
                },
                res: match &layer.res {
                    Some((a, b)) => Some((res_q(a)?, res_q(b)?)),
                    None => None,
                },
            });
        }
        let attn_res_block = model.config.switches.attn_res_block_size;
        if let Some(b) = attn_res_block {
            let sources = model.layers.len().div_ceil(b.max(1)) + 1;
            if sources > tessera_kernels::cuda::MAX_ATTN_RES_SOURCES {
                return Err(EngineError::Device(format!(
                    "AttnRes with {sources} sources exceeds the GPU kernel's {}",
                    tessera_kernels::cuda::MAX_ATTN_RES_SOURCES
                )));
            }
        }
        let sampler = tessera_kernels::cuda::Sampler::load(&gpu.dev)?;
        Ok(CudaModel {
            embed: upload_weights(&gpu, &model.embed)?,
            norm: DVec::norm(&gpu, &model.norm)?,
            lm_head: DLinear::upload(&gpu, &model.lm_head)?,
            out_res: match &model.out_res {
                Some(q) => Some(res_q(q)?),
                None => None,
            },
            layers,
            gpu,
            ordinal,
            hidden: d,
            vocab: model.config.vocab_size,
            attn_res_block,
            sampler,
            graphs: std::sync::Mutex::new(Graphs::new(
                std::env::var("TESSERA_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            )),
        })
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// GPU name and architecture, for logs.
    pub(crate) fn describe(&self) -> String {
        format!("{} ({})", self.gpu.dev.name(), self.gpu.dev.arch())
    }

    /// The forward profile so far, when `TESSERA_CUDA_PROFILE=1` (see [`Profile`]); resets it.
    pub(crate) fn take_profile(&self) -> Option<String> {
        self.gpu.take_profile()
    }

    /// The device this model runs on, for a page arena to be allocated beside it.
    pub(crate) fn device(&self) -> &CudaDevice {
        &self.gpu.dev
    }

    /// Decode-step graphs `(captured, replayed)` so far.
    pub(crate) fn graph_counts(&self) -> (u64, u64) {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .counts()
    }

    pub(crate) fn set_graphs(&self, on: bool) {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_enabled(on);
    }

    /// The forward pass over caller-owned states; inputs already validated by
    /// [`Model::forward_spliced`].
    pub(crate) fn forward(
        &self,
        segments: &mut [Segment<'_>],
        splices: &[Vec<EmbedSplice<'_>>],
    ) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<&[u32]> = segments.iter().map(|s| s.tokens).collect();
        let wanted: Vec<LogitsWanted> = segments.iter().map(|s| s.logits).collect();
        let mut pk = Packed::default();
        let plan = StepPlan::pack(&mut pk, &tokens, &wanted);
        let inputs = pk.upload(&self.gpu)?;
        let step = plan.at(self.gpu.p(&inputs));
        let logits = self.run_eager(&step, splices, &mut States::Host(segments))?;
        for seg in segments.iter_mut() {
            seg.state.len += seg.tokens.len();
        }
        Ok(logits)
    }

    /// The forward pass over states in a device page arena at `arena` (an address on this
    /// model's GPU); inputs already validated by [`Model::forward_paged`]. A decode step is
    /// replayed from a graph where it can be ([`graphs`]).
    pub(crate) fn forward_paged(
        &self,
        tokens: &[&[u32]],
        wanted: &[LogitsWanted],
        splices: &[Vec<EmbedSplice<'_>>],
        state: &PagedState,
        arena: u64,
        draws: Option<&[SampleDraw]>,
    ) -> Result<StepOut> {
        let width = self
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                DMixer::Mla(m) => Some(m.latent().0 + m.latent().1),
                DMixer::Kda(_) => None,
            })
            .unwrap_or(0);
        let call = graphs::Call {
            tokens,
            wanted,
            splices,
            state,
            arena,
            width,
            draws,
        };
        if let Some(out) = self.forward_graphed(&call)? {
            return Ok(out);
        }
        let mut pk = Packed::default();
        let plan = StepPlan::pack(&mut pk, tokens, wanted);
        let tables = PagedPlan::pack(&mut pk, plan.layout(), state, width, None)?;
        let draws = draws.map(|d| DrawPlan::pack(&mut pk, d));
        let inputs = self.gpu.timed("tables", || pk.upload(&self.gpu))?;
        let base = self.gpu.p(&inputs);
        let step = plan.at(base);
        let tables = tables.at(base, arena);
        let draws = draws.map(|d| d.at(base));
        let mut states = States::Paged(Box::new(tables));
        match draws {
            Some(d) => self.run_sampled(&step, splices, &mut states, d),
            None => Ok(StepOut::Logits(self.run_eager(
                &step,
                splices,
                &mut states,
            )?)),
        }
    }

    /// [`Self::run`] into a fresh logits buffer, read back per segment.
    fn run_eager(
        &self,
        step: &Step,
        splices: &[Vec<EmbedSplice<'_>>],
        states: &mut States<'_, '_>,
    ) -> Result<Vec<Vec<f32>>> {
        let v = self.vocab;
        if step.logit_total() == 0 {
            self.run(step, splices, states, 0)?;
            return Ok(vec![Vec::new(); step.segments()]);
        }
        let logits = self.gpu.scratch::<f32>(step.logit_total() * v)?;
        self.run(step, splices, states, self.gpu.p(&logits))?;
        self.gpu.timed("logits", || {
            // Straight into each segment's vector, through the page-locked staging buffer.
            let mut out: Vec<Vec<f32>> = step
                .logit_counts
                .iter()
                .map(|&c| vec![0.0; c * v])
                .collect();
            let mut parts: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            self.gpu.dev.download_parts(&logits, &mut parts)?;
            Ok(out)
        })
    }

    /// [`Self::run`] and the sampler on the device: only the token ids come back.
    fn run_sampled(
        &self,
        step: &Step,
        splices: &[Vec<EmbedSplice<'_>>],
        states: &mut States<'_, '_>,
        draws: Draws,
    ) -> Result<StepOut> {
        let m = step.logit_total();
        let logits = self.gpu.scratch::<f32>((m * self.vocab).max(1))?;
        let ids = self.gpu.scratch::<u32>(m.max(1))?;
        self.run(step, splices, states, self.gpu.p(&logits))?;
        self.sample(m, self.gpu.p(&logits), draws, self.gpu.p(&ids))?;
        let ids = self
            .gpu
            .timed("logits", || Ok(self.gpu.dev.download(&ids)?))?;
        Ok(StepOut::Tokens(step.tokens_per_segment(&ids)))
    }

    /// Queues the sampler over `rows` rows of logits at `logits`, token ids into `out`.
    fn sample(&self, rows: usize, logits: DevPtr, draws: Draws, out: DevPtr) -> Result<()> {
        // SAFETY: `logits` holds `rows · vocab` f32, `draws` `rows` values of each parameter
        // (packed by `DrawPlan` from validated sampling parameters and draws in [0, 1)), and
        // `out` `rows` u32 — all on this model's device.
        unsafe {
            self.sampler
                .sample_f32_at(&self.gpu.dev, logits, rows, self.vocab, draws, out)
        }?;
        Ok(())
    }

    /// Queues the whole forward of `step`, its logits (rows `step.logit_rows`, `[m, vocab]`
    /// f32) into `logits`. Only queues work on the stream, so a decode step can be captured.
    fn run(
        &self,
        step: &Step,
        splices: &[Vec<EmbedSplice<'_>>],
        states: &mut States<'_, '_>,
        logits: DevPtr,
    ) -> Result<()> {
        let gpu = &self.gpu;
        let (dev, d) = (&gpu.dev, self.hidden);
        let n = step.rows;
        let mut h = gpu.scratch::<f32>(n * d)?;
        gpu.k
            .embed_rows(dev, step.ids, gpu.p(&self.embed), gpu.p(&h), n, d)?;
        for (range, seg_splices) in step.ranges().zip(splices) {
            for sp in seg_splices {
                let at = (range.start + sp.row) * d;
                dev.stream()
                    .memcpy_htod(sp.values, &mut h.slice_mut(at..at + sp.values.len()))?;
            }
        }
        // Under AttnRes the embedding is the first partial sum and `h` is only the final mix.
        let mut res = None;
        if let Some(b) = self.attn_res_block {
            let emb = std::mem::replace(&mut h, gpu.zeros::<f32>(n * d)?);
            res = Some(AttnRes::new(gpu, emb, n, d, b, self.layers.len())?);
        }
        let xn_b = gpu.act(n * d)?;
        let xn_f = gpu.scratch::<f32>(n * d)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let mixed_in = match (&mut res, &layer.res) {
                (Some(run), Some((q, _))) => run.before_attention(gpu, l, q)?,
                _ => gpu.p(&h),
            };
            let mut nr = NormRows::plain(
                mixed_in,
                layer.input_norm.ptr(gpu),
                n,
                d,
                layer.input_norm.eps,
            );
            nr.out_act = gpu.p(&xn_b);
            gpu.k.rms_norm(dev, &nr)?;
            let mixed = match &layer.mixer {
                DMixer::Kda(m) => {
                    let (conv, rec) = m.state_lens();
                    let io = gpu.timed("state io", || states.kda_io(gpu, l, conv, rec))?;
                    let out = gpu.timed("kda", || m.forward(gpu, step, gpu.p(&xn_b), &io))?;
                    gpu.timed("state io", || states.kda_done(gpu, l, io))?;
                    out
                }
                DMixer::Mla(m) => {
                    let (rank, rope) = m.latent();
                    let io = gpu.timed("state io", || states.mla_io(gpu, step, l, rank, rope))?;
                    let out = gpu.timed("mla", || m.forward(gpu, step, gpu.p(&xn_b), &io))?;
                    gpu.timed("state io", || states.mla_done(gpu, step, l, io, rank, rope))?;
                    out
                }
            };
            let ffn_in = match (&mut res, &layer.res) {
                (Some(run), Some((_, q))) => run.after_attention(gpu, l, &mixed, q)?,
                _ => {
                    gpu.k.add(dev, gpu.p(&h), gpu.p(&mixed), n * d)?;
                    gpu.p(&h)
                }
            };
            let mut nr =
                NormRows::plain(ffn_in, layer.post_norm.ptr(gpu), n, d, layer.post_norm.eps);
            nr.out_act = gpu.p(&xn_b);
            nr.out_f32 = gpu.p(&xn_f);
            gpu.k.rms_norm(dev, &nr)?;
            let f = match &layer.ffn {
                DFfn::Dense(m) => gpu.timed("mlp", || {
                    let f = gpu.scratch::<f32>(n * m.out_dim())?;
                    m.forward(gpu, gpu.p(&xn_b), n, gpu.p(&f))?;
                    Ok(f)
                })?,
                DFfn::Moe(m) => {
                    debug_assert_eq!(m.out_dim(), d);
                    gpu.timed("moe", || m.forward(gpu, gpu.p(&xn_f), gpu.p(&xn_b), n))?
                }
            };
            match &mut res {
                Some(run) => run.delta = Some(f),
                None => gpu.k.add(dev, gpu.p(&h), gpu.p(&f), n * d)?,
            }
        }
        if let (Some(mut run), Some(q)) = (res, &self.out_res) {
            run.fold_delta(gpu)?;
            run.mix(gpu, true, q, gpu.p(&h))?;
        }
        let m = step.logit_total();
        if m == 0 {
            return Ok(());
        }
        gpu.timed("logits", || {
            let hb = gpu.act(m * d)?;
            let mut nr = NormRows::plain(gpu.p(&h), self.norm.ptr(gpu), m, d, self.norm.eps);
            nr.in_rows = step.logit_rows;
            nr.out_act = gpu.p(&hb);
            gpu.k.rms_norm(dev, &nr)?;
            self.lm_head.forward(gpu, gpu.p(&hb), m, logits)
        })
    }
}

/// AttnRes bookkeeping on the device, step for step the CPU path's `AttnResRun`: block array
/// `R` (one slot per block), partial sum `p`, last MLP output `δ`.
struct AttnRes {
    block: usize,
    rows: usize,
    dim: usize,
    blocks: CudaSlice<f32>,
    n_blocks: usize,
    p: CudaSlice<f32>,
    delta: Option<CudaSlice<f32>>,
    out: CudaSlice<f32>,
}

impl AttnRes {
    fn new(
        gpu: &Gpu,
        embedding: CudaSlice<f32>,
        rows: usize,
        dim: usize,
        block: usize,
        layers: usize,
    ) -> Result<Self> {
        Ok(AttnRes {
            block,
            rows,
            dim,
            blocks: gpu.zeros::<f32>(layers.div_ceil(block.max(1)) * rows * dim)?,
            n_blocks: 0,
            p: embedding,
            delta: None,
            out: gpu.zeros::<f32>(rows * dim)?,
        })
    }

    fn fold_delta(&mut self, gpu: &Gpu) -> Result<()> {
        if let Some(delta) = self.delta.take() {
            gpu.k.add(
                &gpu.dev,
                gpu.p(&self.p),
                gpu.p(&delta),
                self.rows * self.dim,
            )?;
        }
        Ok(())
    }

    /// Mix of `R` (and `p` with `with_partial`) into `out`.
    fn mix(&self, gpu: &Gpu, with_partial: bool, q: &DVec, out: DevPtr) -> Result<()> {
        let p = if with_partial { gpu.p(&self.p) } else { 0 };
        gpu.k.attn_res_mix(
            &gpu.dev,
            gpu.p(&self.blocks),
            self.n_blocks,
            p,
            q.ptr(gpu),
            q.eps,
            out,
            self.rows,
            self.dim,
        )?;
        Ok(())
    }

    fn before_attention(&mut self, gpu: &Gpu, l: usize, q: &DVec) -> Result<DevPtr> {
        self.fold_delta(gpu)?;
        let n = self.rows * self.dim;
        let at_start = l.is_multiple_of(self.block);
        if at_start {
            let dst = self.n_blocks * n;
            gpu.dev
                .stream()
                .memcpy_dtod(&self.p, &mut self.blocks.slice_mut(dst..dst + n))?;
            self.n_blocks += 1;
        }
        self.mix(gpu, !at_start, q, gpu.p(&self.out))?;
        Ok(gpu.p(&self.out))
    }

    fn after_attention(
        &mut self,
        gpu: &Gpu,
        l: usize,
        a: &CudaSlice<f32>,
        q: &DVec,
    ) -> Result<DevPtr> {
        if l.is_multiple_of(self.block) {
            gpu.dev.stream().memcpy_dtod(a, &mut self.p)?;
        } else {
            gpu.k
                .add(&gpu.dev, gpu.p(&self.p), gpu.p(a), self.rows * self.dim)?;
        }
        self.mix(gpu, true, q, gpu.p(&self.out))?;
        Ok(gpu.p(&self.out))
    }
}
