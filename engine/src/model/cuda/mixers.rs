//! The token mixers on the device. Each reads and advances its sequences' state where
//! [`super::state_io`] says it lives (the device page arena when serving).
//!
//! MLA always runs the absorbed form (as the CPU path does under batch invariance). KDA runs the
//! recurrence token by token, or — for calls with a segment of at least [`ChunkedKda`]'s
//! threshold, outside the exact mode — the chunked form on the tensor cores (`kda.cu`: bf16
//! q/k/v/β, f32 decays and state). All are the same maths as the CPU path's chunked and
//! expanded forms, in a different summation order.

use tessera_kernels::cuda::{
    CudaDevice, CudaSlice, KdaKernels, KdaPacked, KdaPrefillWorkspace, KdaRecurrent,
    KdaSegmentedPrefill, MlaAbsorbed, NormRows,
};

use super::super::kda::{KdaLayer, OutGate};
use super::super::mla::{MlaLayer, QueryProj};
use super::inputs::Step;
use super::state_io::{KdaIo, MlaIo};
use super::weights::{DLinear, DVec};
use super::Gpu;
use crate::error::{EngineError, Result};

const QK_L2_EPS: f32 = 1e-6;

/// The chunked KDA prefill, where it applies: outside the exact mode, for a KDA head dim the
/// kernels are built for (128), unless `TESSERA_KDA_PREFILL=recurrent`. A call takes it when its
/// longest segment has at least `min_tokens` rows (`TESSERA_KDA_CHUNKED_MIN`, default
/// [`CHUNKED_MIN_TOKENS`]); decode steps (one row per segment) always take the recurrence.
pub(super) struct ChunkedKda {
    kernels: KdaKernels,
    min_tokens: usize,
}

/// Default shortest segment that takes the chunked prefill.
const CHUNKED_MIN_TOKENS: usize = 32;
/// Head dim of the chunked kernels (`kda_check_config`: dk = dv = 128 here).
const CHUNKED_HEAD_DIM: usize = 128;
/// Value columns per scan block: 32 puts the most blocks on the GPU when few sequences prefill.
const CHUNKED_V_TILE: usize = 32;

impl ChunkedKda {
    /// The kernels for a model whose KDA layers have `head_dim` (None: no KDA layer).
    pub fn load(dev: &CudaDevice, head_dim: Option<usize>, exact: bool) -> Result<Option<Self>> {
        let wanted = std::env::var("TESSERA_KDA_PREFILL").map_or(true, |v| v != "recurrent");
        if exact || !wanted || head_dim != Some(CHUNKED_HEAD_DIM) {
            return Ok(None);
        }
        let min_tokens = match std::env::var("TESSERA_KDA_CHUNKED_MIN") {
            Ok(v) => v.parse().map_err(|_| {
                EngineError::InvalidInput(format!(
                    "TESSERA_KDA_CHUNKED_MIN={v:?} is not a number of tokens"
                ))
            })?,
            Err(_) => CHUNKED_MIN_TOKENS,
        };
        let kernels = KdaKernels::load(dev, CHUNKED_HEAD_DIM, CHUNKED_HEAD_DIM, CHUNKED_V_TILE)?;
        Ok(Some(ChunkedKda {
            kernels,
            min_tokens: min_tokens.max(1),
        }))
    }
}

enum DOutGate {
    LowRank { a: DLinear, b: DLinear },
    Full(DLinear),
}

pub(super) struct DKda {
    heads: usize,
    head_dim: usize,
    kernel: usize,
    qkv: DLinear,
    conv: DVec,
    f_a: DLinear,
    f_b: DLinear,
    dt_bias: DVec,
    rate: DVec,
    b: DLinear,
    gate: DOutGate,
    lower_bound: Option<f32>,
    o_norm: DVec,
    o: DLinear,
}

impl DKda {
    pub fn upload(gpu: &Gpu, m: &KdaLayer) -> Result<Self> {
        Ok(DKda {
            heads: m.heads,
            head_dim: m.head_dim,
            kernel: m.kernel,
            qkv: DLinear::upload(gpu, &m.qkv)?,
            conv: DVec::upload(gpu, &m.conv, 0.0)?,
            f_a: DLinear::upload(gpu, &m.f_a)?,
            f_b: DLinear::upload(gpu, &m.f_b)?,
            dt_bias: DVec::upload(gpu, &m.dt_bias, 0.0)?,
            rate: DVec::upload(gpu, &m.decay_rate, 0.0)?,
            b: DLinear::upload(gpu, &m.b)?,
            gate: match &m.out_gate {
                OutGate::LowRank { a, b } => DOutGate::LowRank {
                    a: DLinear::upload(gpu, a)?,
                    b: DLinear::upload(gpu, b)?,
                },
                OutGate::Full(g) => DOutGate::Full(DLinear::upload(gpu, g)?),
            },
            lower_bound: m.lower_bound,
            o_norm: DVec::norm(gpu, &m.o_norm)?,
            o: DLinear::upload(gpu, &m.o)?,
        })
    }

    /// Floats of one sequence's conv window and recurrent state.
    pub fn state_lens(&self) -> (usize, usize) {
        let p = self.heads * self.head_dim;
        (
            3 * p * (self.kernel - 1),
            self.heads * self.head_dim * self.head_dim,
        )
    }

    /// `x`: the normed input as a GEMM input `[n, hidden]`; returns the mixer output f32 `[n, hidden]`.
    pub fn forward(&self, gpu: &Gpu, step: &Step, x: u64, io: &KdaIo) -> Result<CudaSlice<f32>> {
        let (n, s) = (step.rows, step.segments());
        let (h, dk) = (self.heads, self.head_dim);
        let p = h * dk;
        let dev = &gpu.dev;
        let mixed = gpu.scratch::<f32>(n * 3 * p)?;
        self.qkv.forward(gpu, x, n, gpu.p(&mixed))?;
        let conv_out = gpu.scratch::<f32>(n * 3 * p)?;
        gpu.k.short_conv_silu(
            dev,
            gpu.p(&mixed),
            self.conv.ptr(gpu),
            &io.conv,
            step.seg_start,
            gpu.p(&conv_out),
            (s, step.longest),
            3 * p,
            self.kernel,
        )?;
        for col0 in [0, p] {
            gpu.k
                .l2norm_heads(dev, gpu.p(&conv_out), n, 3 * p, col0, h, dk, QK_L2_EPS)?;
        }
        let fa = gpu.scratch::<f32>(n * dk)?;
        self.f_a.forward(gpu, x, n, gpu.p(&fa))?;
        let fa_b = gpu.to_act(&fa)?;
        let g = gpu.scratch::<f32>(n * p)?;
        self.f_b.forward(gpu, gpu.p(&fa_b), n, gpu.p(&g))?;
        gpu.k.kda_gate(
            dev,
            gpu.p(&g),
            self.dt_bias.ptr(gpu),
            self.rate.ptr(gpu),
            p,
            dk,
            n * p,
            self.lower_bound,
        )?;
        let beta = gpu.scratch::<f32>(n * h)?;
        self.b.forward(gpu, x, n, gpu.p(&beta))?;
        gpu.k.sigmoid(dev, gpu.p(&beta), n * h)?;

        let core = gpu.scratch::<f32>(n * p)?;
        let scale = 1.0 / (dk as f32).sqrt();
        match gpu
            .kda
            .as_ref()
            .filter(|c| step.longest >= c.min_tokens && dk == CHUNKED_HEAD_DIM)
        {
            Some(chunked) => gpu.timed("kda:chunked", || {
                self.chunked(gpu, chunked, step, (&conv_out, &g, &beta), io, &core)
            })?,
            None => gpu.timed("kda:recurrence", || {
                Ok(gpu.k.kda_recurrent(
                    dev,
                    &KdaRecurrent {
                        qkv: gpu.p(&conv_out),
                        g: gpu.p(&g),
                        beta: gpu.p(&beta),
                        state: io.recurrent,
                        seg_start: step.seg_start,
                        out: gpu.p(&core),
                        segments: s,
                        heads: h,
                        head_dim: dk,
                        scale,
                    },
                )?)
            })?,
        }
        let gate = gpu.scratch::<f32>(n * p)?;
        match &self.gate {
            DOutGate::LowRank { a, b } => {
                let ga = gpu.scratch::<f32>(n * a.out_dim)?;
                a.forward(gpu, x, n, gpu.p(&ga))?;
                let ga_b = gpu.to_act(&ga)?;
                b.forward(gpu, gpu.p(&ga_b), n, gpu.p(&gate))?;
            }
            DOutGate::Full(g) => g.forward(gpu, x, n, gpu.p(&gate))?,
        }
        let normed = gpu.act(n * p)?;
        let mut norm = NormRows::plain(
            gpu.p(&core),
            self.o_norm.ptr(gpu),
            n * h,
            dk,
            self.o_norm.eps,
        );
        norm.gate = gpu.p(&gate);
        norm.out_act = gpu.p(&normed);
        gpu.k.rms_norm(dev, &norm)?;
        let out = gpu.scratch::<f32>(n * self.o.out_dim)?;
        self.o.forward(gpu, gpu.p(&normed), n, gpu.p(&out))?;
        Ok(out)
    }

    /// The delta rule in chunks: `qkv [n, 3p]` (q, k normalised), `g [n, p]` and `beta [n, h]`
    /// (f32) go to bf16, o comes back into `core [n, p]` f32.
    fn chunked(
        &self,
        gpu: &Gpu,
        c: &ChunkedKda,
        step: &Step,
        (qkv, g, beta): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        io: &KdaIo,
        core: &CudaSlice<f32>,
    ) -> Result<()> {
        let (n, h, dk) = (step.rows, self.heads, self.head_dim);
        let p = h * dk;
        let qkv_b = gpu.to_act(qkv)?;
        let beta_b = gpu.to_act(beta)?;
        let o = gpu.scratch::<u16>(n * p)?;
        let base = gpu.p(&qkv_b);
        let call = KdaPacked {
            q: base,
            k: base + 2 * p as u64,
            ld_qk: 3 * p,
            v: base + 4 * p as u64,
            ld_v: 3 * p,
            g: gpu.p(g),
            beta: gpu.p(&beta_b),
            out: gpu.p(&o),
            ld_o: p,
            seq_start: step.seg_start,
            chunk_start: step.chunk_start,
            sequences: step.segments(),
            chunks: step.chunks,
            heads: h,
            state: io.recurrent,
            scale: 1.0 / (dk as f32).sqrt(),
            l2norm: false,
        };
        // One long sequence goes in segments, the scan of each beside the prep of the next.
        let segments = c.kernels.segments_for(step.segments(), step.chunks);
        if segments > 1 {
            let seg = KdaSegmentedPrefill::new(&gpu.dev, &c.kernels, n, h, segments)?;
            c.kernels.prefill_segmented_packed(&gpu.dev, &call, &seg)?;
        } else {
            let ws = KdaPrefillWorkspace::packed(&gpu.dev, step.chunks, h, dk, dk)?;
            c.kernels.prefill_packed(&gpu.dev, &call, &ws)?;
        }
        gpu.k.from_bf16(&gpu.dev, gpu.p(&o), gpu.p(core), n * p)?;
        Ok(())
    }
}

enum DQuery {
    Full(DLinear),
    LowRank { a: DLinear, norm: DVec, b: DLinear },
}

pub(super) struct DMla {
    heads: usize,
    nope: usize,
    rope: usize,
    v_dim: usize,
    rank: usize,
    q: DQuery,
    kv_a: DLinear,
    kv_norm: DVec,
    kv_b: DLinear,
    gate: Option<DLinear>,
    o: DLinear,
}

impl DMla {
    pub fn upload(gpu: &Gpu, m: &MlaLayer) -> Result<Self> {
        let c = &m.c;
        Ok(DMla {
            heads: c.num_heads,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v_dim: c.v_head_dim,
            rank: c.kv_lora_rank,
            q: match &m.q {
                QueryProj::Full(l) => DQuery::Full(DLinear::upload(gpu, l)?),
                QueryProj::LowRank { a, norm, b } => DQuery::LowRank {
                    a: DLinear::upload(gpu, a)?,
                    norm: DVec::norm(gpu, norm)?,
                    b: DLinear::upload(gpu, b)?,
                },
            },
            kv_a: DLinear::upload(gpu, &m.kv_a)?,
            kv_norm: DVec::norm(gpu, &m.kv_norm)?,
            kv_b: DLinear::upload(gpu, &m.kv_b)?,
            gate: match &m.gate {
                Some(g) => Some(DLinear::upload(gpu, g)?),
                None => None,
            },
            o: DLinear::upload(gpu, &m.o)?,
        })
    }

    /// `(rank, rope)`: a latent row is `[c_kv (rank) | k_pe (rope)]`.
    pub fn latent(&self) -> (usize, usize) {
        (self.rank, self.rope)
    }

    /// `x`: the normed input as a GEMM input `[n, hidden]`; returns the mixer output f32 `[n, hidden]`.
    pub fn forward(&self, gpu: &Gpu, step: &Step, x: u64, io: &MlaIo) -> Result<CudaSlice<f32>> {
        let n = step.rows;
        let (h, dn, dr, dv, r) = (self.heads, self.nope, self.rope, self.v_dim, self.rank);
        let dev = &gpu.dev;
        let q = gpu.scratch::<f32>(n * h * (dn + dr))?;
        match &self.q {
            DQuery::Full(l) => l.forward(gpu, x, n, gpu.p(&q))?,
            DQuery::LowRank { a, norm, b } => {
                let qa = gpu.scratch::<f32>(n * a.out_dim)?;
                a.forward(gpu, x, n, gpu.p(&qa))?;
                let qa_b = gpu.act(n * a.out_dim)?;
                let mut nr = NormRows::plain(gpu.p(&qa), norm.ptr(gpu), n, a.out_dim, norm.eps);
                nr.out_act = gpu.p(&qa_b);
                gpu.k.rms_norm(dev, &nr)?;
                b.forward(gpu, gpu.p(&qa_b), n, gpu.p(&q))?;
            }
        }
        // New latent rows: c_kv normed on the device, then stored into each sequence's history.
        let kv = gpu.scratch::<f32>(n * (r + dr))?;
        self.kv_a.forward(gpu, x, n, gpu.p(&kv))?;
        let ckv = gpu.scratch::<f32>(n * r)?;
        let mut nr = NormRows::plain(gpu.p(&kv), self.kv_norm.ptr(gpu), n, r, self.kv_norm.eps);
        nr.in_stride = r + dr;
        nr.out_f32 = gpu.p(&ckv);
        gpu.k.rms_norm(dev, &nr)?;
        gpu.k.mla_store_rows(
            dev,
            gpu.p(&kv),
            gpu.p(&ckv),
            io.hist.base,
            io.row_dst,
            n,
            r,
            dr,
        )?;
        let max_visible = io.max_visible;
        let q_lat = gpu.scratch::<f32>(n * h * r)?;
        let lat = gpu.scratch::<f32>(n * h * r)?;
        let att = gpu.scratch::<f32>(n * h * dv)?;
        gpu.timed("mla:attention", || {
            let mut call = MlaAbsorbed {
                q: gpu.p(&q),
                kv_b: gpu.p(&self.kv_b.w),
                hist: io.hist,
                visible: io.visible,
                q_lat: gpu.p(&q_lat),
                lat: gpu.p(&lat),
                scratch: 0,
                out: gpu.p(&att),
                rows: n,
                segments: step.layout.ranges().count(),
                heads: h,
                nope: dn,
                rope: dr,
                v_dim: dv,
                rank: r,
                max_visible,
                scale: 1.0 / ((dn + dr) as f32).sqrt(),
            };
            let scratch = gpu.scratch::<f32>(gpu.k.mla_scratch_floats(&call))?;
            call.scratch = gpu.p(&scratch);
            Ok(gpu.k.mla_absorbed(dev, &call)?)
        })?;
        if let Some(g) = &self.gate {
            // The gate reads the layer input, not the attention output (K3-SPEC §3.3).
            let gv = gpu.scratch::<f32>(n * h * dv)?;
            g.forward(gpu, x, n, gpu.p(&gv))?;
            gpu.k
                .mul_sigmoid(dev, gpu.p(&att), gpu.p(&gv), n * h * dv)?;
        }
        let att_b = gpu.to_act(&att)?;
        let out = gpu.scratch::<f32>(n * self.o.out_dim)?;
        self.o.forward(gpu, gpu.p(&att_b), n, gpu.p(&out))?;
        Ok(out)
    }
}
