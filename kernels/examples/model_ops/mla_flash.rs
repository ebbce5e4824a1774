//! The whole-model forward's MLA attention (`ModelKernels::mla_attention`): the flash kernel and
//! the generic one against the CPU backend's `mla_absorbed_attention` over a paged f32 latent
//! history (pages shuffled in the pool, several sequences per call, prefill rows with causal
//! bounds and decode rows), then both timed at prefill and decode shapes.

use super::common::{fill, rel_err, time_us, Checks, Rng};
use tessera_kernels::cpu;
use tessera_kernels::cuda::{
    CudaDevice, CudaError, CudaSlice, DevPtr, MlaAbsorbed, ModelKernels, PagedHistory,
};

/// Head count and widths of one MLA layer.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub rank: usize,
}

/// One sequence of a call: rows already in its history, new rows.
pub type Seg = (usize, usize);

/// One call's sequences.
pub struct Batch<'a> {
    pub segs: &'a [Seg],
    pub page_tokens: usize,
}

/// Device buffers of one call, and the host copies the reference reads.
struct Call {
    _bufs: Vec<CudaSlice<f32>>,
    _ints: (CudaSlice<i64>, CudaSlice<i32>, CudaSlice<i32>),
    lat: CudaSlice<f32>,
    scratch: Option<CudaSlice<f32>>,
    m: MlaAbsorbed,
    q_lat: Vec<f32>,
    q: Vec<f32>,
    /// Per segment: its whole latent history, rows of `rank + rope`.
    hist: Vec<Vec<f32>>,
}

fn ptr(dev: &CudaDevice, s: &CudaSlice<impl tessera_kernels::cuda::DeviceRepr>) -> DevPtr {
    tessera_kernels::cuda::dptr(dev, s, 0)
}

fn build(dev: &CudaDevice, rng: &mut Rng, d: MlaDims, b: &Batch) -> Result<Call, CudaError> {
    let (h, w) = (d.heads, d.rank + d.rope);
    let pt = b.page_tokens;
    let rows: usize = b.segs.iter().map(|s| s.1).sum();
    let hist: Vec<Vec<f32>> = b
        .segs
        .iter()
        .map(|&(before, new)| fill((before + new) * w, rng.next_u64(), |r| r.normal()))
        .collect();
    // Pages of every segment, shuffled over the pool.
    let npages: usize = b.segs.iter().map(|s| (s.0 + s.1).div_ceil(pt)).sum();
    let mut slots: Vec<usize> = (0..npages).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut pool = vec![f32::NAN; npages.max(1) * pt * w];
    let (mut flat, mut first, mut vis) = (Vec::new(), Vec::new(), Vec::new());
    let mut next = 0;
    for (&(before, new), seg) in b.segs.iter().zip(&hist) {
        let at = flat.len() as i32;
        for p in 0..(before + new).div_ceil(pt) {
            let slot = slots[next];
            next += 1;
            flat.push((slot * pt * w) as i64);
            for j in p * pt..((p + 1) * pt).min(before + new) {
                let dst = slot * pt * w + (j % pt) * w;
                pool[dst..dst + w].copy_from_slice(&seg[j * w..(j + 1) * w]);
            }
        }
        for i in 0..new {
            first.push(at);
            vis.push((before + i + 1) as i32);
        }
    }
    let q_lat = fill(rows * h * d.rank, rng.next_u64(), |r| r.normal() * 0.3);
    let q = fill(rows * h * (d.nope + d.rope), rng.next_u64(), |r| {
        r.normal() * 0.3
    });
    let max_visible = vis.iter().copied().max().unwrap_or(1) as usize;
    let (pool_d, ql_d, q_d) = (dev.upload(&pool)?, dev.upload(&q_lat)?, dev.upload(&q)?);
    let lat = dev.upload(&vec![f32::NAN; rows * h * d.rank])?;
    let ints = (dev.upload(&flat)?, dev.upload(&first)?, dev.upload(&vis)?);
    let m = MlaAbsorbed {
        q: ptr(dev, &q_d),
        kv_b: 0,
        hist: PagedHistory {
            base: ptr(dev, &pool_d),
            pages: ptr(dev, &ints.0),
            first: ptr(dev, &ints.1),
            page_tokens: pt,
        },
        visible: ptr(dev, &ints.2),
        q_lat: ptr(dev, &ql_d),
        lat: ptr(dev, &lat),
        scratch: 0,
        out: 0,
        rows,
        segments: b.segs.len(),
        heads: h,
        nope: d.nope,
        rope: d.rope,
        v_dim: 0,
        rank: d.rank,
        max_visible,
        scale: 1.0 / ((d.nope + d.rope) as f32).sqrt(),
    };
    Ok(Call {
        _bufs: vec![pool_d, ql_d, q_d],
        _ints: ints,
        lat,
        scratch: None,
        m,
        q_lat,
        q,
        hist,
    })
}

impl Call {
    /// Sizes the scratch for `k`'s path and runs the attention.
    fn run(&mut self, dev: &CudaDevice, k: &ModelKernels) -> Result<(), CudaError> {
        let need = k.mla_scratch_floats(&self.m);
        if self.scratch.as_ref().is_none_or(|s| s.len() < need) {
            let s = dev.upload(&vec![f32::NAN; need])?;
            self.m.scratch = ptr(dev, &s);
            self.scratch = Some(s);
        }
        k.mla_attention(dev, &self.m)
    }

    /// The CPU backend's latent output.
    fn reference(&self, d: MlaDims, b: &Batch) -> Vec<f32> {
        let (h, r, dr, w) = (d.heads, d.rank, d.rope, d.rank + d.rope);
        let mut out = vec![0.0; self.q_lat.len()];
        let mut row0 = 0;
        for (&(before, new), seg) in b.segs.iter().zip(&self.hist) {
            let s = before + new;
            let ckv: Vec<f32> = (0..s)
                .flat_map(|j| seg[j * w..j * w + r].to_vec())
                .collect();
            let kpe: Vec<f32> = (0..s)
                .flat_map(|j| seg[j * w + r..(j + 1) * w].to_vec())
                .collect();
            let q_pe: Vec<f32> = (row0 * h..(row0 + new) * h)
                .flat_map(|th| {
                    let at = th * (d.nope + dr) + d.nope;
                    self.q[at..at + dr].to_vec()
                })
                .collect();
            let lat = &self.q_lat[row0 * h * r..(row0 + new) * h * r];
            cpu::mla_absorbed_attention(
                lat,
                &q_pe,
                &ckv,
                &kpe,
                new,
                s,
                h,
                r,
                dr,
                before,
                self.m.scale,
                &mut out[row0 * h * r..(row0 + new) * h * r],
            );
            row0 += new;
        }
        out
    }
}

/// Both paths on one batch against the CPU: the generic kernel to f32 rounding, the flash
/// kernel to bf16's (its operands are rounded to bf16).
pub fn check(
    dev: &CudaDevice,
    kernels: &mut ModelKernels,
    checks: &mut Checks,
    rng: &mut Rng,
    d: MlaDims,
    b: &Batch,
) -> Result<(), CudaError> {
    let mut call = build(dev, rng, d, b)?;
    let want = call.reference(d, b);
    for flash in [true, false] {
        kernels.set_mla_flash(flash);
        dev.stream()
            .memcpy_htod(&vec![f32::NAN; want.len()], &mut call.lat)?;
        let plan = kernels.mla_flash_plan(&call.m);
        call.run(dev, kernels)?;
        let got = dev.download(&call.lat)?;
        let label = match plan {
            Some(p) => format!(
                "flash(items {}: rows/block {}, heads/block {}; splits {})",
                p.items, p.rows_per_block, p.heads_per_block, p.splits
            ),
            None => "generic".to_string(),
        };
        let name = format!(
            "mla_attention.{label}.H{}.r{}+{}.segs{:?}.page{}",
            d.heads, d.rank, d.rope, b.segs, b.page_tokens
        );
        checks.report(&name, rel_err(&got, &want), if flash { 1e-2 } else { 1e-5 });
    }
    kernels.set_mla_flash(true);
    Ok(())
}

/// Flash against generic at prefill and decode shapes; µs and the attention's TFLOP/s.
pub fn bench(dev: &CudaDevice, rng: &mut Rng, iters: usize) -> Result<(), CudaError> {
    let mut kernels = ModelKernels::load(dev, false)?;
    let medium = MlaDims {
        heads: 16,
        nope: 128,
        rope: 64,
        rank: 512,
    };
    let k3 = MlaDims {
        heads: 96,
        ..medium
    };
    let decode32: Vec<Seg> = vec![(4095, 1); 32];
    let cases: [(&str, MlaDims, &[Seg]); 5] = [
        ("prefill 4096", medium, &[(0, 4096)]),
        ("prefill 2048 after 6144", medium, &[(6144, 2048)]),
        ("prefill 1024 after 3072, 96 heads", k3, &[(3072, 1024)]),
        ("decode B=32 ctx 4096", medium, &decode32),
        ("decode B=1 ctx 16384, 96 heads", k3, &[(16383, 1)]),
    ];
    for (label, d, segs) in cases {
        let b = Batch {
            segs,
            page_tokens: 64,
        };
        let mut call = build(dev, rng, d, &b)?;
        let flops: f64 = segs
            .iter()
            .map(|&(before, new)| {
                (0..new).map(|i| (before + i + 1) as f64).sum::<f64>()
                    * d.heads as f64
                    * 2.0
                    * (2 * d.rank + d.rope) as f64
            })
            .sum();
        let mut line = format!("time mla_attention {label} H={}", d.heads);
        for flash in [true, false] {
            kernels.set_mla_flash(flash);
            if !flash && call.m.rows * d.heads * call.m.max_visible > 2_000_000_000 {
                continue;
            }
            call.run(dev, &kernels)?;
            let us = time_us(dev, 2, iters, || call.run(dev, &kernels))?;
            let name = if flash { "flash" } else { "generic" };
            line += &format!(" {name}_us={us:.1} {name}_tflops={:.1}", flops / us * 1e-6);
        }
        kernels.set_mla_flash(true);
        println!("{line}");
    }
    Ok(())
}
