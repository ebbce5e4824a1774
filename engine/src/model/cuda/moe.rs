//! MoE on the device for any batch: the router runs in f32 (so near-equal expert scores pick the
//! same experts as the CPU path), the top-k choice on the host with the CPU routing code, then
//! one gathered GEMM per active expert and a weighted scatter-add. Shared experts and K3's
//! latent projections as in [`super::super::moe`].

use tessera_kernels::cpu;
use tessera_kernels::cuda::{CudaSlice, GemmType, NormRows};

use super::super::moe::Moe;
use super::experts::DExperts;
use super::weights::{DLinear, DMlp, DVec};
use super::Gpu;
use crate::error::Result;

struct DLatent {
    down: DLinear,
    norm: Option<DVec>,
    up: DLinear,
}

pub(super) struct DMoe {
    router: CudaSlice<f32>,
    hidden: usize,
    correction_bias: Vec<f32>,
    routing: cpu::MoeRouting,
    experts: DExperts,
    shared: Option<DMlp>,
    latent: Option<DLatent>,
    /// Row multiple the per-expert GEMMs pad to ([`moe_pad_rows`]).
    pad_rows: usize,
}

impl DMoe {
    pub fn upload(gpu: &Gpu, m: &Moe) -> Result<Self> {
        Ok(DMoe {
            router: gpu.dev.upload(&m.router.w)?,
            hidden: m.router.in_dim,
            correction_bias: m.correction_bias.clone(),
            routing: m.routing,
            experts: DExperts::upload(gpu, &m.experts, &m.routing, &m.correction_bias)?,
            pad_rows: moe_pad_rows(),
            shared: match &m.shared {
                Some(s) => Some(DMlp::upload(gpu, s)?),
                None => None,
            },
            latent: match &m.latent {
                Some(l) => Some(DLatent {
                    down: DLinear::upload(gpu, &l.down)?,
                    norm: match &l.norm {
                        Some(n) => Some(DVec::norm(gpu, n)?),
                        None => None,
                    },
                    up: DLinear::upload(gpu, &l.up)?,
                }),
                None => None,
            },
        })
    }

    /// `x`: the normed input as f32 and as a GEMM input `[rows, hidden]`; returns f32
    /// `[rows, hidden]`.
    pub fn forward(&self, gpu: &Gpu, x_f32: u64, x_b: u64, rows: usize) -> Result<CudaSlice<f32>> {
        let (d, e) = (self.hidden, self.correction_bias.len());
        let dev = &gpu.dev;
        let logits = gpu.scratch::<f32>(rows * e)?;
        // SAFETY: `x_f32` holds `rows · d` f32, the router `[e, d]` f32, `logits` `rows · e`.
        unsafe {
            gpu.blas.gemm(
                rows,
                d,
                e,
                (x_f32, GemmType::F32),
                (gpu.p(&self.router), GemmType::F32),
                (gpu.p(&logits), GemmType::F32),
            )
        }?;
        let out = gpu.zeros::<f32>(rows * d)?;
        if let Some(s) = &self.shared {
            s.forward(gpu, x_b, rows, gpu.p(&out))?;
        }
        let z = match &self.latent {
            Some(l) => {
                let z = gpu.scratch::<f32>(rows * l.down.out_dim)?;
                l.down.forward(gpu, x_b, rows, gpu.p(&z))?;
                Some(z)
            }
            None => None,
        };
        let (src, ed) = match (&z, &self.latent) {
            (Some(z), Some(l)) => (gpu.p(z), l.down.out_dim),
            _ => (x_f32, d),
        };
        let routed = gpu.timed("moe:routed", || {
            if self.experts.takes_fast_path(rows) {
                self.experts
                    .forward_fast(gpu, &logits, &self.routing, src, rows)
            } else {
                self.routed_per_expert(gpu, &logits, src, ed, rows)
            }
        })?;
        match &self.latent {
            Some(l) => {
                let rb = gpu.act(rows * ed)?;
                match &l.norm {
                    Some(nw) => {
                        let mut nr = NormRows::plain(gpu.p(&routed), nw.ptr(gpu), rows, ed, nw.eps);
                        nr.out_act = gpu.p(&rb);
                        gpu.k.rms_norm(dev, &nr)?;
                    }
                    None => gpu.k.to_act(dev, gpu.p(&routed), gpu.p(&rb), rows * ed)?,
                }
                let up = gpu.scratch::<f32>(rows * d)?;
                l.up.forward(gpu, gpu.p(&rb), rows, gpu.p(&up))?;
                gpu.k.add(dev, gpu.p(&out), gpu.p(&up), rows * d)?;
            }
            None => gpu.k.add(dev, gpu.p(&out), gpu.p(&routed), rows * d)?,
        }
        Ok(out)
    }

    /// The routed sum by host routing (the CPU engine's code on the downloaded f32 scores) and
    /// one gathered GEMM chain per active expert: any batch, and the exact mode.
    fn routed_per_expert(
        &self,
        gpu: &Gpu,
        logits: &CudaSlice<f32>,
        src: u64,
        ed: usize,
        rows: usize,
    ) -> Result<CudaSlice<f32>> {
        let dev = &gpu.dev;
        let e = self.correction_bias.len();
        let k = self.routing.top_k;
        let (mut idx, mut weight) = (vec![0u32; rows * k], vec![0f32; rows * k]);
        gpu.timed("moe:host routing", || {
            let logits = dev.download(logits)?;
            cpu::route_sigmoid_grouped(
                &logits,
                e,
                &self.correction_bias,
                &self.routing,
                &mut idx,
                &mut weight,
            );
            Ok(())
        })?;
        // Rows grouped by expert, all experts' lists in one upload. Each expert's GEMMs run on
        // its rows padded with zero rows to a multiple of `pad` (fewer distinct GEMM shapes, so
        // cuBLAS picks each kernel once and not per call); only the real rows are added back.
        let pad = self.pad_rows;
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for r in 0..rows {
            for j in 0..k {
                by_expert[idx[r * k + j] as usize].push((r, weight[r * k + j]));
            }
        }
        // Expert e's rows sit at gather[gstarts[e]..], its real ones first (also the rows its
        // outputs are added back to), and their weights at all_w[starts[e]..].
        let (mut gather, mut all_w) = (Vec::new(), Vec::new());
        let (mut gstarts, mut starts) = (vec![0], vec![0]);
        for list in &by_expert {
            all_w.extend(list.iter().map(|&(_, w)| w));
            gather.extend(list.iter().map(|&(r, _)| r as i32));
            gather.resize(
                gather.len() + list.len().next_multiple_of(pad) - list.len(),
                -1,
            );
            starts.push(all_w.len());
            gstarts.push(gather.len());
        }
        let routed = gpu.zeros::<f32>(rows * ed)?;
        if all_w.is_empty() {
            return Ok(routed);
        }
        let gather_dev = dev.upload(&gather)?;
        let w_dev = dev.upload(&all_w)?;
        let most = gstarts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let xs = gpu.act(most * ed)?;
        let ys = gpu.scratch::<f32>(most * ed)?;
        let scratch = self.experts.scratch(gpu, most)?;
        for (ex, (w, g)) in starts.windows(2).zip(gstarts.windows(2)).enumerate() {
            let (a, m, mp) = (w[0], w[1] - w[0], g[1] - g[0]);
            if m == 0 {
                continue;
            }
            let (g_at, w_at) = (gpu.p_at(&gather_dev, g[0]), gpu.p_at(&w_dev, a));
            gpu.k.gather_act(dev, src, g_at, gpu.p(&xs), mp, ed)?;
            self.experts
                .forward_expert(gpu, ex, gpu.p(&xs), mp, gpu.p(&ys), &scratch)?;
            gpu.k
                .scatter_add_weighted(dev, gpu.p(&routed), gpu.p(&ys), g_at, w_at, m, ed)?;
        }
        Ok(routed)
    }

    pub fn out_dim(&self) -> usize {
        self.hidden
    }

    /// Whether a call of `rows` rows routes on the device (no read-back of the router's scores).
    pub fn routes_on_device(&self, rows: usize) -> bool {
        self.experts.takes_fast_path(rows)
    }
}

/// Row multiple the per-expert GEMMs pad to (`TESSERA_MOE_PAD_ROWS`, default 64; 1 pads nothing).
fn moe_pad_rows() -> usize {
    std::env::var("TESSERA_MOE_PAD_ROWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(64)
        .max(1)
}
