//! Checks the CUDA model kernels (sampling, KDA short conv, MLA absorbed decode) against the CPU
//! backend on fresh random inputs (outputs poisoned with NaN before each run, NaN never
//! passes), then times them against their memory floor (bytes moved / 4.8 TB/s).
//!
//!   cargo build --release -p tessera-kernels --features cuda --example cuda_model_ops_check
//!   target/release/examples/cuda_model_ops_check [--quick] [--only conv|sample|mla|mla-flash|moe]
//!       [--mla-prefetch N,M,..] [--mla-coalesced] [--mla-ws-tile 32,64] [--mla-probe 1,2,3,4]
//!       [--mla-transposed] [--mla-no-swizzle] [--mla-q-regs N,..] [--mla-copies N,..]
//!       [--moe-tunings] [--moe-variants L,..]
//!       [--moe-profile B,..] [--mla-profile]
//!
//! `mla-flash` is the whole-model forward's MLA attention over the paged f32 history (the flash
//! kernel and the generic one, prefill and decode rows). MLA decode is checked and timed with every
//! split kernel the device runs (the portable one, and on Hopper the warpgroup one);
//! `--mla-prefetch` also checks and times each kernel with those L2 prefetch distances (tiles
//! ahead), `--mla-coalesced` with its wider tile copies, `--mla-ws-tile 32,64` with the Hopper
//! split-role kernel on only 32- or 64-token tiles (the default takes 64 where pages allow),
//! `--mla-probe 1,2,3,4` times that kernel (at each tile size named, and the transposed one when
//! asked for) without its P·V products, its S products, or both, or (4, not the transposed one)
//! keeps its tile stream alone (never checked: wrong by design), `--mla-transposed` the Hopper
//! kernel with both products transposed (heads as wgmma's N, no padding; pages of 64 tokens and
//! more), `--mla-no-swizzle` the copy-engine kernels with their tiles copied without the 128-byte
//! swizzle (probes then run both ways), `--mla-q-regs 8,16` the split-role kernel with the first 8
//! or 16 K steps of S taking Q from registers (64-token tiles), `--mla-copies 3,9` the split-role
//! kernel with each tile in 3 or 9 tensor copies, S starting on the first; `--mla-profile` only
//! times the MLA decode kernels at B=64 and 16K context, unchecked (a profiler's target).
//! MoE projections are checked and timed on both paths, the tensor cores with each input split;
//! `--moe-tunings` adds build-time alternatives of the tensor-core kernels (`--moe-variants
//! tc,tc_tma8x3` keeps only the named ones, as printed without the format); `--moe-profile 1,16`
//! only times the default MoE kernels at those batch sizes, unchecked (a profiler's target).
//! `--moe-variants probe_nodown,probe_nogateup,probe_nowait,probe_nocombine` adds timing probes
//! (the layer without its down products, without its gate/up products, down not waiting for
//! gate/up, without the combine's sums), `probe_route1,2,3` the routing stopped after its
//! scores, its select, before its plan (`probe_route2wl,3wl` the same with the warp-list select,
//! variant `tc_wl1rt0`); never checked: their outputs are wrong by design.
//!
//! Output: `check <name> rel_err=<e> tol=<t> <ok|FAIL>` lines (for sampling the value is the
//! number of rows whose token differs), then `time <name> <shape> us=<median>
//! floor_us=<bytes / 4.8 TB/s> GBps=<achieved>` lines. Exits 1 when a check fails, 2 on an error.

#[path = "common/mod.rs"]
mod common;
#[path = "model_ops/mla_decode.rs"]
mod mla_decode;
#[path = "model_ops/mla_flash.rs"]
mod mla_flash;
#[path = "model_ops/moe.rs"]
mod moe;

use common::{fill, rel_err, time_us, Checks, Device, Rng, HBM_BYTES_PER_S};
use mla_decode::{bench_mla, check_mla_kernel, mla_kernels, tuning_label, MLA_BENCH_SHAPES};
use tessera_kernels::cpu;
use tessera_kernels::cuda::{
    bf16_bits, bf16_value, default_cache_dir, CudaDevice, CudaError, MlaDecode, MlaKernel,
    MlaTuning, ModelKernels, MoeDecode, MoeDims, Sampler, SamplingRows, ShortConv, MLA_RANK,
    MLA_ROPE,
};

const MLA_D: usize = MLA_RANK + MLA_ROPE;
/// Dense bf16 tensor-core peak of an H200 (SXM), for the compute floor of MLA decode.
const BF16_PEAK_FLOPS: f64 = 989.5e12;

pub(crate) fn bf16_vec(n: usize, rng: &mut Rng, scale: f32) -> Vec<u16> {
    fill(n, rng.next_u64(), |r| bf16_bits(r.normal() * scale))
}

pub(crate) fn values(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16_value(b)).collect()
}

pub(crate) fn report_time(name: &str, shape: &str, us: f64, bytes: f64, extra: &str) {
    let floor = bytes / HBM_BYTES_PER_S * 1e6;
    println!(
        "time {name} {shape} us={us:.2} floor_us={floor:.2} GBps={:.0} pct_floor={:.0}{extra}",
        bytes / (us * 1e-6) / 1e9,
        100.0 * floor / us
    );
}

// ---------------------------------------------------------------------------------------------
// KDA short conv

fn check_conv(
    dev: &CudaDevice,
    conv: &ShortConv,
    checks: &mut Checks,
    rng: &mut Rng,
    t: usize,
    channels: usize,
) -> Result<(), CudaError> {
    let k = conv.kernel();
    let pz = Device { dev };
    let (x, w, s0) = (
        bf16_vec(t * channels, rng, 1.0),
        bf16_vec(channels * k, rng, 0.5),
        bf16_vec(channels * (k - 1), rng, 1.0),
    );
    let (xd, wd, sd) = (dev.upload(&x)?, dev.upload(&w)?, dev.upload(&s0)?);
    let mut out = pz.poisoned_u16(t * channels)?;
    let mut s_out = pz.poisoned_u16(channels * (k - 1))?;
    conv.prefill(dev, &xd, &wd, &sd, &mut s_out, &mut out, t, channels)?;
    let mut want_state = values(&s0);
    let mut want = vec![0.0; t * channels];
    cpu::short_conv_silu(
        &values(&x),
        channels,
        &values(&w),
        k,
        &mut want_state,
        &mut want,
    );
    let name = format!("short_conv.prefill.T{t}.C{channels}");
    checks.report(&name, rel_err(&values(&dev.download(&out)?), &want), 1e-2);
    checks.report(
        &format!("{name}.state"),
        rel_err(&values(&dev.download(&s_out)?), &want_state),
        0.0,
    );
    Ok(())
}

/// A batch of sequences decoded token by token with the in-place state equals the CPU conv.
fn check_conv_update(
    dev: &CudaDevice,
    conv: &ShortConv,
    checks: &mut Checks,
    rng: &mut Rng,
    batch: usize,
    channels: usize,
    steps: usize,
) -> Result<(), CudaError> {
    let k = conv.kernel();
    let w = bf16_vec(channels * k, rng, 0.5);
    let s0 = bf16_vec(batch * channels * (k - 1), rng, 1.0);
    let wd = dev.upload(&w)?;
    let mut sd = dev.upload(&s0)?;
    let mut cpu_state = values(&s0);
    let (mut worst, mut worst_state) = (0.0f64, 0.0f64);
    for _ in 0..steps {
        let x = bf16_vec(batch * channels, rng, 1.0);
        let xd = dev.upload(&x)?;
        let mut out = Device { dev }.poisoned_u16(batch * channels)?;
        conv.update(dev, &xd, &wd, &mut sd, &mut out, batch, channels)?;
        let got = values(&dev.download(&out)?);
        let xv = values(&x);
        let mut want = vec![0.0; batch * channels];
        let per = channels * (k - 1);
        for b in 0..batch {
            cpu::short_conv_silu(
                &xv[b * channels..(b + 1) * channels],
                channels,
                &values(&w),
                k,
                &mut cpu_state[b * per..(b + 1) * per],
                &mut want[b * channels..(b + 1) * channels],
            );
        }
        worst = worst.max(rel_err(&got, &want));
        worst_state = worst_state.max(rel_err(&values(&dev.download(&sd)?), &cpu_state));
    }
    let name = format!("short_conv.update.B{batch}.C{channels}.steps{steps}");
    checks.report(&name, worst, 1e-2);
    checks.report(&format!("{name}.state"), worst_state, 0.0);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Sampling

struct RowParams {
    temperature: Vec<f32>,
    top_k: Vec<u32>,
    top_p: Vec<f32>,
    uniform: Vec<f64>,
}

fn random_params(rows: usize, rng: &mut Rng) -> RowParams {
    let mut p = RowParams {
        temperature: vec![],
        top_k: vec![],
        top_p: vec![],
        uniform: vec![],
    };
    for r in 0..rows {
        let (t, k, tp) = match r % 8 {
            0 => (0.0, 0, 1.0),
            1 => (1.0, 0, 1.0),
            2 => (0.7, 50, 1.0),
            3 => (0.9, 0, 0.9),
            4 => (1.3, 40, 0.8),
            5 => (0.6, 1, 1.0),
            6 => (1.0, 2000, 0.5),
            _ => (
                0.25 + rng.uniform() * 2.0,
                (rng.next_u64() % 300) as u32,
                0.05 + 0.95 * rng.uniform(),
            ),
        };
        p.temperature.push(t);
        p.top_k.push(k);
        p.top_p.push(tp);
        p.uniform
            .push((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64);
    }
    p
}

#[allow(clippy::too_many_arguments)]
fn check_sampling(
    dev: &CudaDevice,
    (variant, sampler): (&str, &Sampler),
    checks: &mut Checks,
    rng: &mut Rng,
    rows: usize,
    vocab: usize,
    levels: Option<usize>,
    bf16: bool,
) -> Result<(), CudaError> {
    // Logits: normals, or a few distinct levels (many exact ties), plus special rows.
    let mut logits: Vec<f32> = match levels {
        None => fill(rows * vocab, rng.next_u64(), |r| r.normal() * 3.0),
        Some(n) => fill(rows * vocab, rng.next_u64(), move |r| {
            (r.next_u64() % n as u64) as f32 * 0.5
        }),
    };
    if bf16 {
        logits
            .iter_mut()
            .for_each(|l| *l = bf16_value(bf16_bits(*l)));
    }
    let row = |r: usize| r * vocab..(r + 1) * vocab;
    if rows > 12 && vocab > 16 {
        logits[row(9)][3] = f32::NAN;
        logits[row(9)][vocab / 2] = f32::NAN;
        logits[row(10)][5] = f32::NEG_INFINITY;
        logits[row(11)].fill(f32::NAN); // no candidates: token 0
        logits[row(12)][vocab - 1] = 40.0; // one dominant token
        logits[row(8)][vocab / 3] = -0.0;
        logits[row(8)][vocab / 3 + 1] = 0.0;
    }
    let p = random_params(rows, rng);
    let params = SamplingRows::upload(dev, &p.temperature, &p.top_k, &p.top_p, &p.uniform)?;
    let mut out = dev.upload(&vec![u32::MAX; rows])?;
    if bf16 {
        let bits: Vec<u16> = logits.iter().map(|&l| bf16_bits(l)).collect();
        sampler.sample_bf16(dev, &dev.upload(&bits)?, vocab, &params, &mut out)?;
    } else {
        sampler.sample_f32(dev, &dev.upload(&logits)?, vocab, &params, &mut out)?;
    }
    let got = dev.download(&out)?;
    let wrong: Vec<usize> = (0..rows)
        .filter(|&r| {
            got[r]
                != cpu::sample_row(
                    &logits[row(r)],
                    p.temperature[r],
                    p.top_k[r] as usize,
                    p.top_p[r],
                    p.uniform[r],
                )
        })
        .collect();
    for &r in wrong.iter().take(3) {
        println!(
            "  row {r}: t={} k={} p={} u={}: gpu {} cpu {}",
            p.temperature[r],
            p.top_k[r],
            p.top_p[r],
            p.uniform[r],
            got[r],
            cpu::sample_row(
                &logits[row(r)],
                p.temperature[r],
                p.top_k[r] as usize,
                p.top_p[r],
                p.uniform[r]
            )
        );
    }
    let kind = if bf16 { "bf16" } else { "f32" };
    let lv = levels.map_or(String::new(), |n| format!(".levels{n}"));
    checks.report(
        &format!("sample{variant}.{kind}.R{rows}.V{vocab}{lv}.rows_wrong"),
        wrong.len() as f64,
        0.0,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Timing

/// Which parts of the run are wanted (`--only NAME`, else all).
struct Only(Option<String>);

impl Only {
    fn wants(&self, part: &str) -> bool {
        self.0.as_deref().is_none_or(|o| o == part)
    }
}

/// Which MoE projection variants to check and time (see `moe::variants`).
struct MoeSelect {
    tuned: bool,
    keep: Option<Vec<String>>,
}

fn bench(
    dev: &CudaDevice,
    quick: bool,
    only: &Only,
    tunings: &[MlaTuning],
    hopper_ok: bool,
    moe: &MoeSelect,
) -> Result<(), CudaError> {
    let mut rng = Rng(7);
    let iters = if quick { 10 } else { 50 };
    if only.wants("conv") {
        bench_conv(dev, &mut rng, iters)?;
    }
    if only.wants("sample") {
        bench_sample(dev, &mut rng, iters)?;
    }
    let mut kernels = Vec::new();
    for kernel in mla_kernels(dev) {
        let wanted = match kernel {
            MlaKernel::Portable => only.wants("mla"),
            MlaKernel::Hopper => hopper_ok && (only.wants("mla") || only.wants("mla-hopper")),
        };
        if wanted {
            kernels.push((String::new(), MlaDecode::load_kernel(dev, 96, kernel)?));
            for &t in tunings.iter().filter(|t| t.applies_to(kernel)) {
                let tuned = MlaDecode::load_tuned(dev, 96, kernel, t)?;
                kernels.push((format!(" {}", &tuning_label(t)[1..]), tuned));
            }
        }
    }
    if !kernels.is_empty() {
        bench_mla(dev, &mut rng, iters, &kernels, &MLA_BENCH_SHAPES)?;
    }
    if only.wants("mla-flash") {
        mla_flash::bench(dev, &mut rng, iters)?;
    }
    if only.wants("moe") {
        let batches = [1, 4, 8, 16, 32, 64];
        let variants = moe::variants(dev, moe.tuned, moe.keep.as_deref())?;
        moe::bench_moe(dev, &variants, &batches, iters)?;
    }
    Ok(())
}

fn bench_conv(dev: &CudaDevice, rng: &mut Rng, iters: usize) -> Result<(), CudaError> {
    let conv = ShortConv::load(dev, 4)?;
    let channels = 3 * 32 * 128; // q, k, v of 32 KDA heads of 128
    for t in [8192usize, 32768] {
        let x = dev.upload(&bf16_vec(t * channels, rng, 1.0))?;
        let w = dev.upload(&bf16_vec(channels * 4, rng, 0.5))?;
        let s0 = dev.upload(&bf16_vec(channels * 3, rng, 1.0))?;
        let mut s1 = dev.upload(&vec![0u16; channels * 3])?;
        let mut out = dev.upload(&vec![0u16; t * channels])?;
        let us = time_us(dev, 3, iters, || {
            conv.prefill(dev, &x, &w, &s0, &mut s1, &mut out, t, channels)
        })?;
        report_time(
            "short_conv_prefill",
            &format!("T={t},C={channels}"),
            us,
            4.0 * (t * channels) as f64,
            "",
        );
    }
    for batch in [64usize, 256] {
        let x = dev.upload(&bf16_vec(batch * channels, rng, 1.0))?;
        let w = dev.upload(&bf16_vec(channels * 4, rng, 0.5))?;
        let mut st = dev.upload(&bf16_vec(batch * channels * 3, rng, 1.0))?;
        let mut out = dev.upload(&vec![0u16; batch * channels])?;
        let us = time_us(dev, 3, iters, || {
            conv.update(dev, &x, &w, &mut st, &mut out, batch, channels)
        })?;
        // x read, out written, state (3 values) read and written.
        report_time(
            "short_conv_update",
            &format!("B={batch},C={channels}"),
            us,
            (4 + 12) as f64 * (batch * channels) as f64,
            "",
        );
    }
    Ok(())
}

/// The sampler as the engine loads it ("") and built with rows without a top-k cut sent straight
/// to the radix path, the one the others fall back to.
fn sampler_variants(dev: &CudaDevice) -> Result<Vec<(&'static str, Sampler)>, CudaError> {
    Ok(vec![
        ("", Sampler::load(dev)?),
        (
            "_radix",
            Sampler::load_variant(dev, &[("SAMPLE_BINS", "0".into())])?,
        ),
    ])
}

fn bench_sample(dev: &CudaDevice, rng: &mut Rng, iters: usize) -> Result<(), CudaError> {
    let samplers = sampler_variants(dev)?;
    let vocab = 163_840;
    for rows in [1usize, 64, 256] {
        let logits = dev.upload(&fill(rows * vocab, rng.next_u64(), |r| r.normal() * 3.0))?;
        for (label, t, k, p) in [
            ("greedy", 0.0, 0, 1.0),
            ("t1", 1.0, 0, 1.0),
            ("t0.7_k50_p0.9", 0.7, 50, 0.9),
            ("t1_p0.95", 1.0, 0, 0.95),
        ] {
            let params = SamplingRows::upload(
                dev,
                &vec![t; rows],
                &vec![k; rows],
                &vec![p; rows],
                &vec![0.37; rows],
            )?;
            let mut out = dev.upload(&vec![0u32; rows])?;
            for (variant, sampler) in &samplers {
                let us = time_us(dev, 3, iters, || {
                    sampler.sample_f32(dev, &logits, vocab, &params, &mut out)
                })?;
                report_time(
                    &format!("sample{variant}_{label}"),
                    &format!("B={rows},V={vocab}"),
                    us,
                    4.0 * (rows * vocab) as f64,
                    "",
                );
            }
        }
    }
    Ok(())
}

fn run() -> Result<usize, CudaError> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let only = Only(flag("--only"));
    // Build-time alternatives of the MoE tensor-core kernels, checked and timed besides them.
    let moe_tuned = args.iter().any(|a| a == "--moe-tunings");
    // Only these MoE projection variants (labels as printed, e.g. `tc,tc_tma8x3`).
    let moe_keep: Option<Vec<String>> =
        flag("--moe-variants").map(|l| l.split(',').map(str::to_string).collect());
    let moe_sel = MoeSelect {
        tuned: moe_tuned,
        keep: moe_keep,
    };
    // Build-time alternatives of the MLA split kernels to check and time besides the defaults.
    let numbers = |name: &str| -> Vec<usize> {
        flag(name)
            .iter()
            .flat_map(|l| l.split(','))
            .filter_map(|v| v.parse().ok())
            .collect()
    };
    let ws_tiles = numbers("--mla-ws-tile");
    let transposed = args.iter().any(|a| a == "--mla-transposed");
    let mut tunings: Vec<MlaTuning> = numbers("--mla-prefetch")
        .into_iter()
        .map(|prefetch| MlaTuning {
            prefetch,
            ..MlaTuning::default()
        })
        .collect();
    if args.iter().any(|a| a == "--mla-coalesced") {
        tunings.push(MlaTuning {
            coalesced: true,
            ..MlaTuning::default()
        });
    }
    for &ws_tile in &ws_tiles {
        tunings.push(MlaTuning {
            ws_tile,
            ..MlaTuning::default()
        });
    }
    if transposed {
        tunings.push(MlaTuning {
            transposed,
            ..MlaTuning::default()
        });
    }
    // The copy-engine kernels with unswizzled tiles at each tile size asked for and the default
    // (and transposed when asked for).
    let no_swizzle = args.iter().any(|a| a == "--mla-no-swizzle");
    let layouts: &[bool] = if no_swizzle {
        for &ws_tile in ws_tiles.iter().chain(&[0]) {
            tunings.push(MlaTuning {
                ws_tile,
                unswizzled: true,
                ..MlaTuning::default()
            });
        }
        if transposed {
            tunings.push(MlaTuning {
                transposed,
                unswizzled: true,
                ..MlaTuning::default()
            });
        }
        &[false, true]
    } else {
        &[false]
    };
    // The split-role kernel with the first K steps of S taking Q from registers (64-token tiles).
    for q_regs in numbers("--mla-q-regs") {
        tunings.push(MlaTuning {
            q_regs,
            ..MlaTuning::default()
        });
    }
    // The split-role kernel with each tile in several copies.
    for copies in numbers("--mla-copies") {
        tunings.push(MlaTuning {
            copies,
            ..MlaTuning::default()
        });
    }
    // Timing probes of the split-role kernel at each tile size asked for and the default, and
    // of the transposed kernel when it is asked for; unswizzled too with --mla-no-swizzle.
    for probe in numbers("--mla-probe")
        .into_iter()
        .filter_map(|p| u8::try_from(p).ok())
    {
        for &unswizzled in layouts {
            for &ws_tile in ws_tiles.iter().chain(&[0]) {
                tunings.push(MlaTuning {
                    ws_tile,
                    probe,
                    unswizzled,
                    ..MlaTuning::default()
                });
            }
            if transposed && probe < 4 {
                tunings.push(MlaTuning {
                    transposed,
                    probe,
                    unswizzled,
                    ..MlaTuning::default()
                });
            }
        }
    }
    let dev = CudaDevice::open(0, default_cache_dir())?;
    println!("device {} ({})", dev.name(), dev.arch());
    if let Some(batches) = flag("--moe-profile") {
        // Only the default MoE kernels (or those of --moe-variants) at these batch sizes,
        // unchecked: a target for a profiler (run the checks in the same session without this
        // flag).
        let batches: Vec<usize> = batches.split(',').filter_map(|b| b.parse().ok()).collect();
        let keep = moe_sel.keep.unwrap_or_else(|| vec!["tc".to_string()]);
        let variants = moe::variants(&dev, false, Some(&keep))?;
        moe::bench_moe(&dev, &variants, &batches, 10)?;
        return Ok(0);
    }
    if args.iter().any(|a| a == "--mla-profile") {
        // Every MLA decode split kernel of this device (and --mla-* alternatives) at B=64, 16K
        // context, unchecked and a few launches each: a target for a profiler.
        let mut kernels = Vec::new();
        for kernel in mla_kernels(&dev) {
            kernels.push((String::new(), MlaDecode::load_kernel(&dev, 96, kernel)?));
            for &t in tunings.iter().filter(|t| t.applies_to(kernel)) {
                let tuned = MlaDecode::load_tuned(&dev, 96, kernel, t)?;
                kernels.push((format!(" {}", &tuning_label(t)[1..]), tuned));
            }
        }
        bench_mla(&dev, &mut Rng(7), 2, &kernels, &MLA_BENCH_SHAPES[..1])?;
        return Ok(0);
    }
    let mut checks = Checks { failed: 0 };
    let mut rng = Rng(1234);

    if only.wants("conv") {
        let conv = ShortConv::load(&dev, 4)?;
        for (t, c) in [(1, 8), (2, 300), (5, 4096), (37, 12288), (1000, 1536)] {
            check_conv(&dev, &conv, &mut checks, &mut rng, t, c)?;
        }
        check_conv_update(&dev, &conv, &mut checks, &mut rng, 5, 4096, 6)?;
    }
    if only.wants("sample") {
        for (variant, sampler) in sampler_variants(&dev)? {
            for (rows, vocab, levels, bf16) in [
                (40, 1, None, false),
                (40, 37, Some(3), false),
                (64, 1000, None, false),
                (64, 5000, Some(7), false),
                (48, 163_840, None, false),
                (48, 163_840, None, true),
                (32, 32_000, Some(40), true),
                (96, 50_000, None, false),
            ] {
                check_sampling(
                    &dev,
                    (variant, &sampler),
                    &mut checks,
                    &mut rng,
                    rows,
                    vocab,
                    levels,
                    bf16,
                )?;
            }
        }
    }
    let mut mla_ok = None;
    for kernel in mla_kernels(&dev) {
        let part = match kernel {
            MlaKernel::Portable => "mla",
            MlaKernel::Hopper => "mla-hopper",
        };
        if !(only.wants("mla") || only.wants(part)) {
            continue;
        }
        let before = checks.failed;
        check_mla_kernel(&dev, &mut checks, &mut rng, |h| {
            MlaDecode::load_kernel(&dev, h, kernel)
        })?;
        // Timing probes are wrong by design: timed, never checked.
        for &t in tunings
            .iter()
            .filter(|t| t.applies_to(kernel) && t.probe == 0)
        {
            check_mla_kernel(&dev, &mut checks, &mut rng, |h| {
                MlaDecode::load_tuned(&dev, h, kernel, t)
            })?;
        }
        if kernel == MlaKernel::Hopper {
            mla_ok = Some(checks.failed == before);
        }
    }
    if only.wants("mla-flash") {
        check_mla_flash(&dev, &mut checks, &mut rng)?;
    }
    if only.wants("moe") {
        let moe_k = MoeDecode::load(&dev)?;
        let k3_routing = MoeDims {
            experts: 896,
            top_k: 16,
            din: 3584,
            di: 3072,
        };
        let medium_routing = MoeDims {
            experts: 64,
            top_k: 8,
            ..k3_routing
        };
        let shapes = [
            (medium_routing, [1, 7, 64].as_slice()),
            (k3_routing, [1, 7, 16, 64].as_slice()),
        ];
        for (dims, batches) in shapes {
            for &batch in batches {
                for ties in [false, true] {
                    let rng = &mut rng;
                    moe::check_routing(&dev, &moe_k, &mut checks, rng, dims, batch, ties)?;
                }
            }
        }
        let small = MoeDims {
            experts: 40,
            top_k: 6,
            din: 512,
            di: 384,
        };
        // Both projection paths: the column kernels and the tensor cores (each input split).
        for (label, moe_k) in &moe::variants(&dev, moe_sel.tuned, moe_sel.keep.as_deref())? {
            let label = label.trim_start_matches('_');
            if moe::is_probe(label) {
                continue;
            }
            for mxfp4 in [false, true] {
                // 40 experts top-6: at 33 and 64 tokens experts serve many tokens each.
                // Batch 1 with ties too (whole-number logits).
                let cases = [
                    (1, false),
                    (1, true),
                    (5, false),
                    (16, false),
                    (33, false),
                    (64, false),
                ];
                for (batch, ties) in cases {
                    let sel = (label, moe_k);
                    let rng = &mut rng;
                    moe::check_moe_experts(&dev, sel, &mut checks, rng, small, batch, mxfp4, ties)?;
                }
                let k3 = MoeDims {
                    experts: 24,
                    ..k3_routing
                };
                for batch in [1, 2] {
                    let sel = (label, moe_k);
                    let rng = &mut rng;
                    moe::check_moe_experts(&dev, sel, &mut checks, rng, k3, batch, mxfp4, false)?;
                }
            }
        }
    }

    // A Hopper kernel that failed its checks is not timed.
    bench(
        &dev,
        quick,
        &only,
        &tunings,
        mla_ok != Some(false),
        &moe_sel,
    )?;
    Ok(checks.failed)
}

/// The model path's MLA attention at fixture widths (ranks below, between and at multiples of
/// 64, odd head counts) and production ones, prefill and decode rows mixed with page edges.
fn check_mla_flash(dev: &CudaDevice, checks: &mut Checks, rng: &mut Rng) -> Result<(), CudaError> {
    use mla_flash::{Batch, MlaDims, Seg};
    let mut kernels = ModelKernels::load(dev, false)?;
    let dims = |heads, nope, rope, rank| MlaDims {
        heads,
        nope,
        rope,
        rank,
    };
    let medium = dims(16, 128, 64, 512);
    let cases: [(MlaDims, &[Seg], usize); 10] = [
        (dims(2, 32, 16, 64), &[(0, 7), (3, 1), (0, 40)], 16),
        (dims(4, 16, 8, 48), &[(5, 20), (0, 1), (100, 3)], 8),
        (dims(2, 8, 4, 16), &[(0, 33), (2, 2)], 4),
        (dims(12, 32, 16, 64), &[(0, 10), (50, 7)], 16),
        (medium, &[(0, 300), (1000, 50)], 64),
        (medium, &[(4999, 1), (0, 1), (77, 1), (2000, 1)], 16),
        (dims(4, 16, 8, 48), &[(33, 1), (0, 1), (600, 1)], 8),
        (dims(96, 128, 64, 512), &[(2999, 1), (10, 1)], 64),
        (dims(96, 128, 64, 512), &[(100, 20)], 64),
        (dims(40, 64, 32, 256), &[(0, 64), (640, 1)], 32),
    ];
    for (d, segs, page_tokens) in cases {
        let b = Batch { segs, page_tokens };
        mla_flash::check(dev, &mut kernels, checks, rng, d, &b)?;
    }
    Ok(())
}

fn main() {
    common::exit_with(run());
}
