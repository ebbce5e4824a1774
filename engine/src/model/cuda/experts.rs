//! The routed experts of one MoE layer on the device, stacked as the tuned MoE kernels read them
//! (`gate`, `up`: `[experts, inter, in]`; `down`: `[experts, in, inter]`; bf16, or packed MXFP4),
//! so one copy of the weights serves both paths: per-expert cuBLAS GEMMs for any batch (and the
//! exact mode), and the small-batch decode kernels (`MoeDecode`: routing, plan, gate+up+act,
//! down, combine on the GPU) for up to `MOE_MAX_BATCH` rows in one pass, in bf16.

use tessera_kernels::cpu::MoeRouting;
use tessera_kernels::cuda::{
    dptr, mxfp4_device_codes, CudaSlice, DevPtr, GemmType, MoeActivation, MoeDecode, MoeDims,
    MoeExperts, MoeWorkspace, MOE_MAX_BATCH,
};

use super::super::mlp::{Mlp, Proj};
use super::weights::upload_weights;
use super::Gpu;
use crate::config::Activation;
use crate::error::{EngineError, Result};

/// One projection of every expert, stacked.
enum Stack {
    Dense(CudaSlice<u16>),
    Mxfp4 {
        packed: CudaSlice<u8>,
        scale: CudaSlice<u8>,
    },
}

impl Stack {
    fn upload(gpu: &Gpu, projs: &[&Proj]) -> Result<Self> {
        let mut dense = Vec::new();
        let (mut packed, mut scale) = (Vec::new(), Vec::new());
        for p in projs {
            match p {
                Proj::Dense(l) => dense.extend_from_slice(&l.w),
                Proj::Mxfp4(l) => {
                    packed.extend_from_slice(&l.packed);
                    scale.extend_from_slice(&l.scale);
                }
            }
        }
        match (dense.is_empty(), packed.is_empty()) {
            (false, true) => Ok(Stack::Dense(upload_weights(gpu, &dense)?)),
            (true, false) => Ok(Stack::Mxfp4 {
                packed: gpu.dev.upload(&mxfp4_device_codes(&packed))?,
                scale: gpu.dev.upload(&scale)?,
            }),
            _ => Err(EngineError::InvalidInput(
                "the routed experts of one layer mix MXFP4 and dense weights".into(),
            )),
        }
    }

    /// Expert `e`'s `[out_dim, in_dim]` slice times the GEMM input `x [rows, in_dim]` into f32
    /// `out` (row `r` at `out + r·out_stride`).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        gpu: &Gpu,
        e: usize,
        (in_dim, out_dim): (usize, usize),
        x: DevPtr,
        rows: usize,
        out: DevPtr,
        out_stride: usize,
    ) -> Result<()> {
        let n = in_dim * out_dim;
        match self {
            Stack::Dense(w) => {
                let t = gpu.act_type();
                let words = gpu.k.act_bytes() / 2;
                let w = dptr(&gpu.dev, w, e * n * words);
                // SAFETY: expert `e`'s weight is the `n` elements at `w`; `x` holds `rows` rows
                // of `in_dim` and `out` `rows` rows of `out_stride ≥ out_dim` f32 (the callers'
                // scratch, sized from the same widths).
                unsafe {
                    gpu.blas.gemm_strided(
                        rows,
                        in_dim,
                        out_dim,
                        (x, t),
                        (w, t),
                        (out, GemmType::F32),
                        out_stride,
                    )
                }?;
            }
            Stack::Mxfp4 { packed, scale } => {
                let p = dptr(&gpu.dev, packed, e * n / 2);
                let s = dptr(&gpu.dev, scale, e * n / 32);
                gpu.k
                    .mxfp4_linear(&gpu.dev, x, p, s, out, rows, in_dim, out_dim, out_stride)?;
            }
        }
        Ok(())
    }
}

/// The small-batch kernels, where the layer's shapes and routing allow them.
struct Fast {
    kernels: MoeDecode,
    dims: MoeDims,
    bias: CudaSlice<f32>,
    /// One workspace per batch size seen, kept for later steps (every launch is on the one
    /// stream, so a step never reuses a workspace a previous step still reads).
    workspaces: std::sync::Mutex<std::collections::HashMap<usize, MoeWorkspace>>,
}

pub(super) struct DExperts {
    gate: Stack,
    up: Stack,
    down: Stack,
    /// Expert input/output width and intermediate width.
    din: usize,
    di: usize,
    act: MoeActivation,
    fast: Option<Fast>,
}

impl DExperts {
    pub fn upload(
        gpu: &Gpu,
        experts: &[Mlp],
        routing: &MoeRouting,
        correction_bias: &[f32],
    ) -> Result<Self> {
        let all = |f: fn(&Mlp) -> &Proj| experts.iter().map(f).collect::<Vec<_>>();
        let (din, di) = match &experts[0].gate {
            Proj::Dense(l) => (l.in_dim, l.out_dim),
            Proj::Mxfp4(l) => (l.in_dim, l.out_dim),
        };
        let act = match experts[0].act {
            Activation::Silu => MoeActivation::Silu,
            Activation::Situ { gate_beta, up_beta } => MoeActivation::Situ { gate_beta, up_beta },
        };
        let dims = MoeDims {
            experts: experts.len(),
            top_k: routing.top_k,
            din,
            di,
        };
        // The tuned kernels: bf16 (not the exact mode), one expert group (or every group
        // kept), widths in multiples of 32 and at most 1024 experts (`MoeDims::check`).
        let grouped = routing.n_group > 1 && routing.topk_group < routing.n_group;
        let fast = if !gpu.k.exact() && !grouped && dims.check(1).is_ok() {
            Some(Fast {
                kernels: MoeDecode::load_for(&gpu.dev, dims.experts)?,
                dims,
                bias: gpu.dev.upload(correction_bias)?,
                workspaces: Default::default(),
            })
        } else {
            None
        };
        Ok(DExperts {
            gate: Stack::upload(gpu, &all(|m| &m.gate))?,
            up: Stack::upload(gpu, &all(|m| &m.up))?,
            down: Stack::upload(gpu, &all(|m| &m.down))?,
            din,
            di,
            act,
            fast,
        })
    }

    /// Whether a call of `rows` rows takes the small-batch kernels: up to `MOE_MAX_BATCH` rows,
    /// one call reads each active expert's weights once; above it the per-expert GEMMs do (and
    /// their tiles use tensor cores).
    pub fn takes_fast_path(&self, rows: usize) -> bool {
        self.fast.is_some() && rows <= MOE_MAX_BATCH
    }

    /// Routing and the routed sum on the GPU in one pass (`rows ≤ MOE_MAX_BATCH`): `logits
    /// [rows, experts]` f32, `x [rows, din]` f32; returns the weighted expert sum f32 `[rows,
    /// din]`.
    pub fn forward_fast(
        &self,
        gpu: &Gpu,
        logits: &CudaSlice<f32>,
        routing: &MoeRouting,
        x: DevPtr,
        rows: usize,
    ) -> Result<CudaSlice<f32>> {
        let f = self.fast.as_ref().expect("checked by takes_fast_path");
        let din = self.din;
        let out = gpu.scratch::<f32>(rows * din)?;
        let experts = match (&self.gate, &self.up, &self.down) {
            (Stack::Dense(gate), Stack::Dense(up), Stack::Dense(down)) => {
                MoeExperts::Bf16 { gate, up, down }
            }
            (
                Stack::Mxfp4 {
                    packed: gp,
                    scale: gs,
                },
                Stack::Mxfp4 {
                    packed: up,
                    scale: us,
                },
                Stack::Mxfp4 {
                    packed: dp,
                    scale: ds,
                },
            ) => MoeExperts::Mxfp4 {
                gate: (gp, gs),
                up: (up, us),
                down: (dp, ds),
            },
            _ => unreachable!("Stack::upload refuses a mixed layer"),
        };
        let mut cache = f.workspaces.lock().unwrap_or_else(|e| e.into_inner());
        let ws = match cache.entry(rows) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(MoeWorkspace::new(&gpu.dev, f.dims, rows)?)
            }
        };
        f.kernels.route(&gpu.dev, logits, &f.bias, routing, ws)?;
        let xb = gpu.scratch::<u16>(rows * din)?;
        gpu.k.to_act(&gpu.dev, x, gpu.p(&xb), rows * din)?;
        let mut yb = gpu.scratch::<u16>(rows * din)?;
        f.kernels
            .experts(&gpu.dev, &xb, &experts, self.act, ws, &mut yb)?;
        gpu.k
            .from_bf16(&gpu.dev, gpu.p(&yb), gpu.p(&out), rows * din)?;
        Ok(out)
    }

    /// Expert `e` on the GEMM input `x [rows, din]` into f32 `out [rows, din]`, in `scratch`
    /// (`gate_up [rows, 2·di]` f32 and `act [rows, di]` GEMM input, for at least `rows` rows).
    pub fn forward_expert(
        &self,
        gpu: &Gpu,
        e: usize,
        x: DevPtr,
        rows: usize,
        out: DevPtr,
        scratch: &ExpertScratch,
    ) -> Result<()> {
        let (din, di) = (self.din, self.di);
        let gu = gpu.p(&scratch.gate_up);
        self.gate.forward(gpu, e, (din, di), x, rows, gu, 2 * di)?;
        self.up
            .forward(gpu, e, (din, di), x, rows, gu + (di * 4) as u64, 2 * di)?;
        let act = gpu.p(&scratch.act);
        let situ = match self.act {
            MoeActivation::Silu => None,
            MoeActivation::Situ { gate_beta, up_beta } => Some((gate_beta, up_beta)),
        };
        gpu.k.glu(&gpu.dev, gu, act, rows, di, situ)?;
        self.down.forward(gpu, e, (di, din), act, rows, out, din)
    }

    pub fn scratch(&self, gpu: &Gpu, rows: usize) -> Result<ExpertScratch> {
        Ok(ExpertScratch {
            gate_up: gpu.scratch::<f32>(rows * 2 * self.di)?,
            act: gpu.act(rows * self.di)?,
        })
    }
}

pub(super) struct ExpertScratch {
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
}
