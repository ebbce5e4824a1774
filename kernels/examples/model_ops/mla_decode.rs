//! MLA absorbed decode: checks of every split kernel against the CPU over shuffled pages, and
//! timings against the memory and compute floors.

use super::common::{rel_err, time_us, Checks, Device, Rng};
use super::{bf16_vec, report_time, values, BF16_PEAK_FLOPS, MLA_D};
use tessera_kernels::cpu;
use tessera_kernels::cuda::{
    CudaDevice, CudaError, MlaDecode, MlaDecodeShape, MlaDecodeWorkspace, MlaKernel, MlaPages,
    MlaTuning, MLA_RANK, MLA_ROPE,
};

// ---------------------------------------------------------------------------------------------
// MLA decode

/// A paged latent cache holding `lens` sequences in shuffled pages.
struct PagedCache {
    cache: Vec<u16>,
    table: Vec<i32>,
    max_pages: usize,
}

fn paged_cache(lens: &[usize], page_size: usize, rng: &mut Rng) -> PagedCache {
    let max_pages = lens
        .iter()
        .map(|l| l.div_ceil(page_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let total: usize = lens.iter().map(|l| l.div_ceil(page_size)).sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..total as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut table = vec![-1i32; lens.len() * max_pages];
    let mut next = ids.into_iter();
    for (b, l) in lens.iter().enumerate() {
        for p in 0..l.div_ceil(page_size) {
            table[b * max_pages + p] = next.next().expect("enough pages");
        }
    }
    PagedCache {
        cache: bf16_vec(total * page_size * MLA_D, rng, 1.0),
        table,
        max_pages,
    }
}

#[allow(clippy::too_many_arguments)]
fn check_mla(
    dev: &CudaDevice,
    mla: &MlaDecode,
    checks: &mut Checks,
    rng: &mut Rng,
    heads: usize,
    lens: &[usize],
    page_size: usize,
    splits: usize,
) -> Result<(), CudaError> {
    let batch = lens.len();
    let pc = paged_cache(lens, page_size, rng);
    let q = bf16_vec(batch * heads * MLA_D, rng, 1.0);
    let scale = 1.0 / (192.0f32).sqrt();
    let (cache_d, table_d, q_d) = (
        dev.upload(&pc.cache)?,
        dev.upload(&pc.table)?,
        dev.upload(&q)?,
    );
    let lens_d = dev.upload(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let pages = MlaPages {
        cache: &cache_d,
        page_table: &table_d,
        seq_lens: &lens_d,
        page_size,
        max_pages: pc.max_pages,
    };
    let shape = MlaDecodeShape {
        batch,
        heads,
        splits,
    };
    let mut ws = MlaDecodeWorkspace::new(dev, shape)?;
    let mut out = Device { dev }.poisoned_u16(batch * heads * MLA_RANK)?;
    mla.decode(dev, &q_d, &pages, scale, &mut ws, &mut out)?;
    let got = values(&dev.download(&out)?);
    let (qv, cv) = (values(&q), values(&pc.cache));
    let mut want = vec![0.0f32; batch * heads * MLA_RANK];
    for (b, &len) in lens.iter().enumerate() {
        let (mut ckv, mut kpe) = (
            Vec::with_capacity(len * MLA_RANK),
            Vec::with_capacity(len * MLA_ROPE),
        );
        for j in 0..len {
            let page = pc.table[b * pc.max_pages + j / page_size] as usize;
            let row = &cv[(page * page_size + j % page_size) * MLA_D..][..MLA_D];
            ckv.extend_from_slice(&row[..MLA_RANK]);
            kpe.extend_from_slice(&row[MLA_RANK..]);
        }
        let qb = &qv[b * heads * MLA_D..(b + 1) * heads * MLA_D];
        let q_lat: Vec<f32> = qb
            .chunks(MLA_D)
            .flat_map(|h| h[..MLA_RANK].to_vec())
            .collect();
        let q_pe: Vec<f32> = qb
            .chunks(MLA_D)
            .flat_map(|h| h[MLA_RANK..].to_vec())
            .collect();
        let dst = &mut want[b * heads * MLA_RANK..(b + 1) * heads * MLA_RANK];
        if len > 0 {
            cpu::mla_absorbed_attention(
                &q_lat,
                &q_pe,
                &ckv,
                &kpe,
                1,
                len,
                heads,
                MLA_RANK,
                MLA_ROPE,
                len - 1,
                scale,
                dst,
            );
        }
    }
    let label = match mla.kernel() {
        MlaKernel::Portable => "mla_decode",
        MlaKernel::Hopper => "mla_decode_hopper",
    };
    let pf = tuning_label(mla.tuning());
    checks.report(
        &format!("{label}{pf}.H{heads}.lens{lens:?}.page{page_size}.splits{splits}")
            .replace(' ', ""),
        rel_err(&got, &want),
        2e-2,
    );
    Ok(())
}

/// The MLA checks for one kernel configuration (`load` compiles it for a head count).
pub(crate) fn check_mla_kernel(
    dev: &CudaDevice,
    checks: &mut Checks,
    rng: &mut Rng,
    load: impl Fn(usize) -> Result<MlaDecode, CudaError>,
) -> Result<(), CudaError> {
    for heads in [16, 32, 96] {
        let mla = load(heads)?;
        check_mla(dev, &mla, checks, rng, heads, &[1, 700, 130], 64, 1)?;
        check_mla(dev, &mla, checks, rng, heads, &[3000, 65, 0, 1], 128, 5)?;
    }
    let mla = load(96)?;
    check_mla(dev, &mla, checks, rng, 96, &[5000, 4097], 64, 16)?;
    check_mla(dev, &mla, checks, rng, 96, &[777], 16, 3)?;
    check_mla(dev, &mla, checks, rng, 96, &[333, 32, 31, 1], 32, 2)
}

/// A check-name suffix for a kernel's build-time alternative ("" for the default).
pub(crate) fn tuning_label(t: MlaTuning) -> String {
    let mut label = String::new();
    if t.prefetch > 0 {
        label += &format!(".prefetch{}", t.prefetch);
    }
    if t.coalesced {
        label += ".coalesced";
    }
    if t.ws_tile != 0 {
        label += &format!(".ws{}", t.ws_tile);
    }
    if t.transposed {
        label += ".tr";
    }
    if t.unswizzled {
        label += ".nosw";
    }
    if t.q_regs > 0 {
        label += &format!(".qreg{}", t.q_regs);
    }
    if t.copies > 1 {
        label += &format!(".copies{}", t.copies);
    }
    if t.probe != 0 {
        label += &format!(".probe{}", t.probe);
    }
    label
}

/// The split kernels of MLA decode this device runs.
pub(crate) fn mla_kernels(dev: &CudaDevice) -> Vec<MlaKernel> {
    let mut v = vec![MlaKernel::Portable];
    if dev.arch() == "sm_90" {
        v.push(MlaKernel::Hopper);
    }
    v
}

/// The timed shapes (batch, context, pages in order): the last keeps the pages in order (the
/// others are shuffled), to show what scattered pages cost.
pub(crate) const MLA_BENCH_SHAPES: [(usize, usize, bool); 5] = [
    (64, 16384, false),
    (64, 4096, false),
    (8, 16384, false),
    (1, 16384, false),
    (64, 16384, true),
];

/// Times each kernel (with its label suffix) on the same inputs, shape by shape.
pub(crate) fn bench_mla(
    dev: &CudaDevice,
    rng: &mut Rng,
    iters: usize,
    kernels: &[(String, MlaDecode)],
    shapes: &[(usize, usize, bool)],
) -> Result<(), CudaError> {
    let heads = 96;
    let scale = 1.0 / (192.0f32).sqrt();
    let page_size = 64;
    for &(batch, ctx, in_order) in shapes {
        let lens = vec![ctx; batch];
        let mut pc = paged_cache(&lens, page_size, rng);
        if in_order {
            let per = pc.max_pages;
            pc.table = (0..(batch * per) as i32).collect();
        }
        let (cache_d, table_d) = (dev.upload(&pc.cache)?, dev.upload(&pc.table)?);
        let lens_d = dev.upload(&vec![ctx as i32; batch])?;
        let q = dev.upload(&bf16_vec(batch * heads * MLA_D, rng, 1.0))?;
        let pages = MlaPages {
            cache: &cache_d,
            page_table: &table_d,
            seq_lens: &lens_d,
            page_size,
            max_pages: pc.max_pages,
        };
        let mut out = dev.upload(&vec![0u16; batch * heads * MLA_RANK])?;
        for (suffix, mla) in kernels {
            let name = match mla.kernel() {
                MlaKernel::Portable => "mla_decode",
                MlaKernel::Hopper => "mla_decode_hopper",
            };
            let splits = mla.splits_for(batch, ctx);
            let shape = MlaDecodeShape {
                batch,
                heads,
                splits,
            };
            let mut ws = MlaDecodeWorkspace::new(dev, shape)?;
            let us = time_us(dev, 3, iters, || {
                mla.decode(dev, &q, &pages, scale, &mut ws, &mut out)
            })?;
            let bytes = (batch * ctx * MLA_D * 2) as f64;
            let flops = 2.0 * (batch * ctx * heads * (MLA_D + MLA_RANK)) as f64;
            // The compute floor: the two products at the dense bf16 peak.
            let tflops = flops / (us * 1e-6) / 1e12;
            let order = if in_order { ",pages_in_order" } else { "" };
            report_time(
                name,
                &format!("B={batch},ctx={ctx},H={heads}{order}"),
                us,
                bytes,
                &format!(
                    " splits={splits} tflops={tflops:.0} compute_floor_us={:.2} pct_peak={:.0}{suffix}",
                    flops / BF16_PEAK_FLOPS * 1e6,
                    100.0 * tflops * 1e12 / BF16_PEAK_FLOPS
                ),
            );
        }
    }
    Ok(())
}
