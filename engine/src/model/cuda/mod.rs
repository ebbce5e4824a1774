//! The forward pass on a CUDA GPU (`--device cuda[:N]`): the same model, layer by layer, with
//! bf16 weights, bf16 GEMM inputs (cuBLAS, f32 accumulation) and f32 activations, residual
//! stream and recurrent state between ops. The exact mode ([`Model::to_device_exact`]) keeps
//! weights and GEMM inputs in f32 too: the same code, held to the f32 reference's tolerance. Same contract as the CPU forward: a batch of
//! segments, each with its own `SequenceState`, updated in place.
//!
//! Sequence state stays on the host between calls (see [`mixers`]), which is what lets the
//! scheduler, prefix cache and disaggregated handoff work unchanged on this device; the price is
//! a state upload and download per layer and call.

mod experts;
mod mixers;
mod moe;
mod weights;

use std::ops::Range;

use tessera_kernels::cuda::{
    dptr, CudaDevice, CudaError, CudaSlice, DevPtr, DeviceRepr, DriverError, GemmType,
    Linear as Blas, ModelKernels, NormRows, ValidAsZeroBits,
};

use super::{kda_states, mla_states, EmbedSplice, Ffn, Mixer, Model, Rows, Segment};
use crate::error::{EngineError, Result};
use mixers::{DKda, DMla};
use moe::DMoe;
use weights::{upload_i32, upload_weights, DLinear, DMlp, DVec};

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
    blas: Blas,
}

impl Gpu {
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.dev.stream().alloc_zeros::<T>(n.max(1))?)
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        dptr(&self.dev, s, 0)
    }

    fn p_at<T>(&self, s: &CudaSlice<T>, offset: usize) -> DevPtr {
        dptr(&self.dev, s, offset)
    }

    /// A GEMM-input buffer of `n` elements (bf16, or f32 in the exact mode; 16-bit words
    /// either way).
    fn act(&self, n: usize) -> Result<CudaSlice<u16>> {
        self.zeros::<u16>(n * self.k.act_bytes() / 2)
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

/// Row layout of one forward call, on the host and (segment starts) on the device.
pub(super) struct Step {
    rows: usize,
    layout: Rows,
    seg_start: CudaSlice<i32>,
}

impl Step {
    fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.layout.ranges()
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
}

impl CudaModel {
    /// Uploads the loaded model to GPU `ordinal`; `exact` for the f32 check mode.
    pub(crate) fn upload(model: &Model, ordinal: usize, exact: bool) -> Result<Self> {
        let dev = CudaDevice::open(ordinal, tessera_kernels::cuda::default_cache_dir())?;
        let k = ModelKernels::load(&dev, exact)?;
        let blas = Blas::new(&dev)?;
        let gpu = Gpu { dev, k, blas };
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
        })
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// GPU name and architecture, for logs.
    pub(crate) fn describe(&self) -> String {
        format!("{} ({})", self.gpu.dev.name(), self.gpu.dev.arch())
    }

    /// The forward pass; inputs already validated by [`Model::forward_spliced`].
    pub(crate) fn forward(
        &self,
        segments: &mut [Segment<'_>],
        splices: &[Vec<EmbedSplice<'_>>],
    ) -> Result<Vec<Vec<f32>>> {
        let gpu = &self.gpu;
        let (dev, d) = (&gpu.dev, self.hidden);
        let layout = Rows::new(segments.iter().map(|s| s.tokens.len()));
        let n = layout.total();
        let step = Step {
            rows: n,
            seg_start: upload_i32(dev, &layout.starts)?,
            layout,
        };
        let ids: Vec<usize> = segments
            .iter()
            .flat_map(|s| s.tokens.iter().map(|&t| t as usize))
            .collect();
        let ids = upload_i32(dev, &ids)?;
        let mut h = gpu.zeros::<f32>(n * d)?;
        gpu.k
            .embed_rows(dev, gpu.p(&ids), gpu.p(&self.embed), gpu.p(&h), n, d)?;
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
        let xn_f = gpu.zeros::<f32>(n * d)?;
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
                    m.forward(gpu, &step, gpu.p(&xn_b), &mut kda_states(segments, l))?
                }
                DMixer::Mla(m) => {
                    m.forward(gpu, &step, gpu.p(&xn_b), &mut mla_states(segments, l))?
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
                DFfn::Dense(m) => {
                    let f = gpu.zeros::<f32>(n * m.out_dim())?;
                    m.forward(gpu, gpu.p(&xn_b), n, gpu.p(&f))?;
                    f
                }
                DFfn::Moe(m) => {
                    debug_assert_eq!(m.out_dim(), d);
                    m.forward(gpu, gpu.p(&xn_f), gpu.p(&xn_b), n)?
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
        for seg in segments.iter_mut() {
            seg.state.len += seg.tokens.len();
        }
        self.logits(segments, &step, &h)
    }

    /// Final norm and LM head over the rows each segment asked for; one download.
    fn logits(
        &self,
        segments: &[Segment<'_>],
        step: &Step,
        h: &CudaSlice<f32>,
    ) -> Result<Vec<Vec<f32>>> {
        let gpu = &self.gpu;
        let (d, v) = (self.hidden, self.vocab);
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(segments.len());
        for (seg, range) in segments.iter().zip(step.ranges()) {
            let wanted = seg.logits.rows(range);
            counts.push(wanted.len());
            rows.extend(wanted);
        }
        if rows.is_empty() {
            return Ok(vec![Vec::new(); segments.len()]);
        }
        let m = rows.len();
        let map = upload_i32(&gpu.dev, &rows)?;
        let hb = gpu.act(m * d)?;
        let mut nr = NormRows::plain(gpu.p(h), self.norm.ptr(gpu), m, d, self.norm.eps);
        nr.in_rows = gpu.p(&map);
        nr.out_act = gpu.p(&hb);
        gpu.k.rms_norm(&gpu.dev, &nr)?;
        let logits = gpu.zeros::<f32>(m * v)?;
        self.lm_head.forward(gpu, gpu.p(&hb), m, gpu.p(&logits))?;
        let all = gpu.dev.download(&logits)?;
        let mut out = Vec::with_capacity(segments.len());
        let mut at = 0;
        for c in counts {
            out.push(all[at * v..(at + c) * v].to_vec());
            at += c;
        }
        Ok(out)
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
