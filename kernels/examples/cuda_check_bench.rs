//! Checks every CUDA kernel against the CPU backend on fresh random inputs, then times them.
//!
//!   cargo build --release -p tessera-kernels --features cuda --example cuda_check_bench
//!   target/release/examples/cuda_check_bench [--quick] [--prefill-only] [--plain-helpers]
//!     [--profile LABEL] [--variants LABEL,...] [--stages]
//!
//! `--variants` keeps only the named prefill variants; `--stages` times the prep's stages (each
//! left out in turn) also under `--prefill-only`.
//!
//! `--plain-helpers` builds the kernels with TESSERA_PLAIN_HELPERS=1 (the helpers the HIP backend
//! compiles: no tensor cores, no cp.async) and only checks them.
//!
//! Output: `check <name> rel_err=<e> <ok|FAIL>` lines, then `time <name> <shape> us=<median>
//! floor_us=<bytes / 4.8 TB/s> gbps=<achieved>` lines. Exits non-zero when a check fails.

use std::time::Instant;

#[path = "kda_check/checks.rs"]
mod checks;
#[path = "common/mod.rs"]
mod common;

use checks::{check_decode, check_packed, check_prefill, Problem, DECODE_VARIANTS};

use common::{time_us, Checks, Device, Rng, HBM_BYTES_PER_S};
use tessera_kernels::cuda::{
    default_cache_dir, CudaDevice, CudaError, CudaSlice, KdaKernels, KdaPrefillWorkspace,
    KdaScanKind, KdaSegmentedPrefill, KdaShape,
};

/// A prefill's final state and o for shape `s`, zeroed.
fn prefill_outputs(
    dev: &CudaDevice,
    s: KdaShape,
) -> Result<(CudaSlice<f32>, CudaSlice<u16>), CudaError> {
    let stream = dev.stream();
    Ok((
        stream.alloc_zeros::<f32>(s.batch * s.heads * s.dk * s.dv)?,
        stream.alloc_zeros::<u16>(s.batch * s.seq_len * s.heads * s.dv)?,
    ))
}

fn bench_prefill(
    dev: &CudaDevice,
    variants: &[(String, KdaKernels)],
    s: KdaShape,
) -> Result<(), CudaError> {
    let mut rng = Rng(0x5eed ^ s.seq_len as u64);
    let t0 = Instant::now();
    let p = Problem::random(s, &mut rng, 0.5, false);
    let d = p.upload(dev)?;
    drop(p);
    let setup = t0.elapsed().as_secs_f64();
    let (mut state, mut out) = prefill_outputs(dev, s)?;
    let mut ws = KdaPrefillWorkspace::new(dev, s)?;
    let x = d.inputs();
    let scale = 1.0 / (s.dk as f32).sqrt();
    let n = (s.batch * s.seq_len * s.heads) as f64;
    // q, k, v, o bf16 + g f32 + beta bf16 + final state f32: the floor FLA's harness uses.
    let bytes = n * (s.dk as f64 * 2.0 * 2.0 + s.dv as f64 * 2.0 * 2.0 + s.dk as f64 * 4.0 + 2.0)
        + (s.batch * s.heads * s.dk * s.dv) as f64 * 4.0;
    for (label, kernels) in variants {
        let us = time_us(dev, 3, 20, || {
            kernels.prefill(dev, s, &x, scale, true, None, &mut state, &mut out, &mut ws)
        })?;
        let prep_us = time_us(dev, 2, 10, || {
            kernels.prep(dev, s, &x, scale, true, &mut ws)
        })?;
        let scan_us = time_us(dev, 2, 10, || {
            kernels.scan(dev, s, None, &mut state, &mut out, &ws)
        })?;
        println!(
            "time kda_prefill.{label} B={} T={} H={} K={} us={us:.1} floor_us={:.1} gbps={:.0} tok_per_s={:.3e} prep_us={prep_us:.1} scan_us={scan_us:.1} (setup {setup:.1}s, workspace {} MB)",
            s.batch,
            s.seq_len,
            s.heads,
            s.dk,
            bytes / HBM_BYTES_PER_S * 1e6,
            bytes / us / 1e3,
            n / s.heads as f64 / us * 1e6,
            ws.bytes() >> 20
        );
    }
    Ok(())
}

/// The segmented prefill of one sequence (the scan of a segment beside the prep of the next),
/// checked bit for bit against the one-call prefill (outputs poisoned first), then timed beside
/// it.
fn bench_segmented(
    dev: &CudaDevice,
    kernels: &mut KdaKernels,
    checks: &mut Checks,
    s: KdaShape,
) -> Result<(), CudaError> {
    let policy = kernels.set_segmentation(1, 1);
    let mut rng = Rng(0x5e9 ^ s.seq_len as u64);
    let p = Problem::random(s, &mut rng, 0.5, true);
    let d = p.upload(dev)?;
    let init = dev.upload(p.state0.as_ref().expect("a problem with a state"))?;
    drop(p);
    let x = d.inputs();
    let scale = 1.0 / (s.dk as f32).sqrt();
    let pois = Device { dev };
    let (state_len, out_len) = (s.heads * s.dk * s.dv, s.seq_len * s.heads * s.dv);
    let mut ws = KdaPrefillWorkspace::new(dev, s)?;
    let mut state = pois.poisoned_f32(state_len)?;
    let mut out = pois.poisoned_u16(out_len)?;
    let one = time_us(dev, 3, 20, || {
        kernels.prefill(
            dev,
            s,
            &x,
            scale,
            true,
            Some(&init),
            &mut state,
            &mut out,
            &mut ws,
        )
    })?;
    let (o_ref, s_ref) = (dev.download(&out)?, dev.download(&state)?);
    drop(ws);
    kernels.set_segmentation(policy.0, policy.1);
    let kernels = &*kernels;
    // Segment sizes in proportion to the weights; the head start off for one of them.
    let splits: [(&str, &[usize], bool); 9] = [
        ("2.no_head_start", &[1, 1], false),
        ("2", &[1, 1], true),
        ("2.short_last", &[3, 1], true),
        ("4.even", &[1, 1, 1, 1], true),
        ("3.short_last", &[2, 2, 1], true),
        ("4", &[3, 3, 3, 1], true),
        ("4.shortest_last", &[4, 4, 4, 1], true),
        ("5", &[3, 3, 3, 3, 1], true),
        ("8.even", &[1; 8], true),
    ];
    for (n, weights, head_start) in splits {
        let mut seg = KdaSegmentedPrefill::with_weights(dev, kernels, s.seq_len, s.heads, weights)?;
        seg.set_head_start(head_start);
        let mut state = pois.poisoned_f32(state_len)?;
        let mut out = pois.poisoned_u16(out_len)?;
        let run = |state: &mut CudaSlice<f32>, out: &mut CudaSlice<u16>| {
            kernels.prefill_segmented(dev, s, &x, scale, true, Some(&init), state, out, &seg)
        };
        run(&mut state, &mut out)?;
        let (o, st) = (dev.download(&out)?, dev.download(&state)?);
        let same_state = st
            .iter()
            .zip(&s_ref)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let differing = o.iter().zip(&o_ref).filter(|(a, b)| a != b).count();
        let name = format!("kda_prefill.segmented{n}.T{}.bitwise", s.seq_len);
        checks.report(&name, (differing + usize::from(!same_state)) as f64, 0.0);
        let us = time_us(dev, 3, 20, || run(&mut state, &mut out))?;
        println!(
            "time kda_prefill.segmented{n} B=1 T={} H={} K={} us={us:.1} one_call_us={one:.1} ({} segments)",
            s.seq_len,
            s.heads,
            s.dk,
            seg.segments()
        );
    }
    Ok(())
}

fn bench_decode(dev: &CudaDevice, kernels: &mut KdaKernels, batch: usize) -> Result<(), CudaError> {
    let s = KdaShape {
        batch,
        seq_len: 1,
        heads: 32,
        dk: 128,
        dv: 128,
    };
    let mut rng = Rng(0xdec0de ^ batch as u64);
    let p = Problem::random(s, &mut rng, 0.5, true);
    let d = p.upload(dev)?;
    let mut state = dev.upload(p.state0.as_ref().unwrap())?;
    let mut out = dev.stream().alloc_zeros::<u16>(batch * s.heads * s.dv)?;
    let x = d.inputs();
    let scale = 1.0 / (s.dk as f32).sqrt();
    let bytes = (batch * s.heads * s.dk * s.dv) as f64 * 4.0 * 2.0;
    for &(label, occ3, split) in DECODE_VARIANTS {
        kernels.set_decode_three_blocks_per_sm(occ3);
        kernels.set_decode_split_columns(split);
        let us = time_us(dev, 20, 200, || {
            kernels.decode(dev, s, &x, scale, true, &mut state, &mut out)
        })?;
        println!(
            "time kda_decode{label} B={batch} H=32 K=128 us={us:.1} floor_us={:.1} gbps={:.0}",
            bytes / HBM_BYTES_PER_S * 1e6,
            bytes / us / 1e3
        );
    }
    kernels.set_decode_three_blocks_per_sm(false);
    kernels.set_decode_split_columns(true);
    Ok(())
}

/// Time of the prep kernel with each stage left out in turn (the differences are the stages'
/// costs; outputs are wrong in these variants, so nothing is checked).
fn stage_costs(dev: &CudaDevice, s: KdaShape) -> Result<(), CudaError> {
    let mut rng = Rng(7);
    let p = Problem::random(s, &mut rng, 0.5, false);
    let d = p.upload(dev)?;
    let x = d.inputs();
    let mut ws = KdaPrefillWorkspace::new(dev, s)?;
    for (skip, what) in [
        (0, "all"),
        (1, "-products"),
        (2, "-inverse"),
        (4, "-qk_out"),
        (8, "-wu"),
        (15, "load+norm only"),
    ] {
        let kv = KdaKernels::load_with(dev, 128, 128, 32, &[("PREP_SKIP", skip.to_string())])?;
        let us = time_us(dev, 2, 10, || kv.prep(dev, s, &x, 0.088, true, &mut ws))?;
        println!("stage prep T={} skip={skip} ({what}) us={us:.1}", s.seq_len);
    }
    // The register-operand scan with its products or its copies left out.
    let (mut state, mut out) = prefill_outputs(dev, s)?;
    for (skip, what) in [
        (0, "all"),
        (1, "copies only"),
        (2, "products only"),
        (6, "the products' MMAs only"),
        (4, "copies and MMAs only"),
    ] {
        let mut kv = KdaKernels::load_with(dev, 128, 128, 32, &[("CR_SKIP", skip.to_string())])?;
        if kv.set_scan(dev, KdaScanKind::CopyEngineRegisters)? != KdaScanKind::CopyEngineRegisters {
            break;
        }
        kv.prep(dev, s, &x, 0.088, true, &mut ws)?;
        let us = time_us(dev, 2, 10, || {
            kv.scan(dev, s, None, &mut state, &mut out, &ws)
        })?;
        println!(
            "stage scan_rs T={} skip={skip} ({what}) us={us:.1}",
            s.seq_len
        );
    }
    Ok(())
}

/// A prefill variant of the bench: label, V tile, scan kernel, extra `-D` macros.
type ScanVariant = (
    &'static str,
    usize,
    KdaScanKind,
    &'static [(&'static str, &'static str)],
);

fn run() -> Result<usize, CudaError> {
    let quick = std::env::args().any(|a| a == "--quick");
    let prefill_only = std::env::args().any(|a| a == "--prefill-only");
    let plain = std::env::args().any(|a| a == "--plain-helpers");
    let mut base: Vec<(&str, String)> = if plain {
        vec![("TESSERA_PLAIN_HELPERS", "1".to_string())]
    } else {
        Vec::new()
    };
    // `--defines K=V,...`: macros for the default kernels too (the segmented bench uses those).
    let defines = arg_after("--defines").unwrap_or_default();
    base.extend(
        defines
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.to_string())),
    );
    let dev = CudaDevice::open(0, default_cache_dir())?;
    println!("device {} ({})", dev.name(), dev.arch());
    let t = Instant::now();
    let mut kernels = KdaKernels::load_with(&dev, 128, 128, 32, &base)?;
    println!("compiled kda kernels in {:.2}s", t.elapsed().as_secs_f64());
    let mut checks = Checks { failed: 0 };
    let mut rng = Rng(42);
    let shape = |batch, seq_len, heads| KdaShape {
        batch,
        seq_len,
        heads,
        dk: 128,
        dv: 128,
    };
    // (Not when profiling: the profiler should see the profiled launches only.)
    if profile_label().is_none() {
        for (name, s, decay, st) in [
            ("kda_prefill.B2.T300.H4", shape(2, 300, 4), 0.5, false),
            ("kda_prefill.B1.T64.H2.state", shape(1, 64, 2), 0.5, true),
            ("kda_prefill.B1.T1.H2.state", shape(1, 1, 2), 0.5, true),
            ("kda_prefill.B1.T777.H3.state", shape(1, 777, 3), 1.0, true),
            (
                "kda_prefill.B1.T200.H2.strong_decay",
                shape(1, 200, 2),
                10.0,
                true,
            ),
        ] {
            let p = Problem::random(s, &mut rng, decay, st);
            check_prefill(&dev, &kernels, &mut checks, name, &p)?;
        }
        check_packed(&dev, &kernels, &mut checks, "kda_prefill.packed", &mut rng)?;
        // One sequence in segments (three of 4-5 chunks), from a state, against the CPU.
        let policy = kernels.set_segmentation(3, 4);
        for (name, s) in [
            ("kda_prefill.segmented3.B1.T777.H3.state", shape(1, 777, 3)),
            ("kda_prefill.segmented3.B1.T832.H2.state", shape(1, 832, 2)),
        ] {
            let p = Problem::random(s, &mut rng, 1.0, true);
            check_prefill(&dev, &kernels, &mut checks, name, &p)?;
        }
        kernels.set_segmentation(policy.0, policy.1);
        for batch in [1, 5, 64] {
            let p = Problem::random(shape(batch, 1, 4), &mut rng, 0.5, true);
            check_decode(&dev, &mut kernels, &mut checks, &p)?;
        }
    }
    if checks.failed > 0 {
        return Ok(checks.failed);
    }
    let mut variants = Vec::new();
    // The mma.sync scan at two V tiles, the warpgroup scan (Hopper), the scan fed by the copy
    // engine (Hopper) at two depths with 4 or 8 compute warps, the same on warpgroup MMAs (the
    // default there) at two depths, and with the left operands in registers at two depths; and the default with the prep's NVIDIA-only forms or its
    // step-6 ordering changed.
    use KdaScanKind::{CopyEngine, CopyEngineRegisters, CopyEngineWarpgroup, Threads, Warpgroup};
    let w4s2: &[(&str, &str)] = &[("CL_STAGES", "2"), ("CL_WARPS", "4")];
    let w8s2: &[(&str, &str)] = &[("CL_STAGES", "2"), ("CL_WARPS", "8")];
    let w8s3: &[(&str, &str)] = &[("CL_STAGES", "3"), ("CL_WARPS", "8")];
    let table: [ScanVariant; 27] = [
        ("vt32.s2", 32, Threads, &[("SCAN_STAGES", "2")]),
        ("vt64.s2", 64, Threads, &[("SCAN_STAGES", "2")]),
        ("wg.s2", 32, Warpgroup, &[("WG_SCAN_STAGES", "2")]),
        ("tma.w4.s2", 32, CopyEngine, w4s2),
        ("tma.w8.s2", 32, CopyEngine, w8s2),
        ("tma.w8.s3", 32, CopyEngine, w8s3),
        ("tma.chains1", 32, CopyEngine, &[("CL_CHAINS", "1")]),
        ("tma_wg.s2", 32, CopyEngineWarpgroup, &[("CW_STAGES", "2")]),
        ("tma_wg.s3", 32, CopyEngineWarpgroup, &[("CW_STAGES", "3")]),
        ("tma_wg.c2", 32, CopyEngineWarpgroup, &[("CW_CLUSTER", "2")]),
        ("tma_rs.s2", 32, CopyEngineRegisters, &[("CR_STAGES", "2")]),
        ("tma_rs.s3", 32, CopyEngineRegisters, &[("CR_STAGES", "3")]),
        (
            "tma_rs.s3u",
            32,
            CopyEngineRegisters,
            &[("CR_STAGES", "3"), ("CR_O_IN_U", "1")],
        ),
        // Two warpgroups a block (128 value columns), the o tiles apart or in the stages.
        (
            "tma_rs2.s2",
            32,
            CopyEngineRegisters,
            &[("CR_WG", "2"), ("CR_STAGES", "2")],
        ),
        (
            "tma_rs2.s2u",
            32,
            CopyEngineRegisters,
            &[("CR_WG", "2"), ("CR_STAGES", "2"), ("CR_O_IN_U", "1")],
        ),
        (
            "tma_rs2.s3u",
            32,
            CopyEngineRegisters,
            &[("CR_WG", "2"), ("CR_STAGES", "3"), ("CR_O_IN_U", "1")],
        ),
        ("tma_wg.c4", 32, CopyEngineWarpgroup, &[("CW_CLUSTER", "4")]),
        (
            "tma_wg.c4.s3",
            32,
            CopyEngineWarpgroup,
            &[("CW_CLUSTER", "4"), ("CW_STAGES", "3")],
        ),
        // The w/u products with 1 or 2 column blocks in flight per warp (default 4).
        ("prep.tt1", 32, CopyEngineRegisters, &[("KDA_TT_NB", "1")]),
        ("prep.tt2", 32, CopyEngineRegisters, &[("KDA_TT_NB", "2")]),
        // Shared-memory layouts of the prep (defaults: steps 5 and 6 on pieces of two runs of 4
        // columns, the decays' rows padded by 8, the inverse's operands padded for
        // conflict-free fragment reads): one run of 8 columns, rows padded by 4, the inverse
        // as before.
        (
            "prep.pieces8",
            32,
            CopyEngineRegisters,
            &[("KDA_SPLIT_PIECES", "0")],
        ),
        (
            "prep.gld4",
            32,
            CopyEngineRegisters,
            &[("KDA_GLD_PAD", "4")],
        ),
        (
            "prep.inv_pads0",
            32,
            CopyEngineRegisters,
            &[("KDA_INV_PADS", "0")],
        ),
        // The prep without one of its NVIDIA-only forms or orderings each.
        (
            "prep.scalar_inv",
            32,
            CopyEngineWarpgroup,
            &[("KDA_INV_TC", "0")],
        ),
        (
            "prep.no_overlap",
            32,
            CopyEngineWarpgroup,
            &[("KDA_OVERLAP_OUT", "0")],
        ),
        // Where step 6 loads v, and whether w and u are one phase (default: before the
        // inverse, one phase).
        (
            "prep.v_late",
            32,
            CopyEngineWarpgroup,
            &[("KDA_V_EARLY", "0"), ("KDA_WU_ONE_PHASE", "0")],
        ),
        (
            "prep.v1.two",
            32,
            CopyEngineWarpgroup,
            &[("KDA_V_EARLY", "1"), ("KDA_WU_ONE_PHASE", "0")],
        ),
    ];
    // `--variants a,b,...`: only the variants with those labels.
    let wanted =
        arg_after("--variants").map(|l| l.split(',').map(str::to_string).collect::<Vec<_>>());
    let table = table
        .into_iter()
        .filter(|(label, ..)| wanted.as_ref().is_none_or(|w| w.iter().any(|x| x == label)));
    for (label, vt, kind, extra) in table {
        let mut defines = base.clone();
        defines.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        match KdaKernels::load_with(&dev, 128, 128, vt, &defines) {
            Ok(mut k) => {
                if k.set_scan(&dev, kind)? == kind {
                    variants.push((label.to_string(), k));
                } else {
                    println!("variant {label} unavailable: no {kind:?} scan on this device");
                }
            }
            Err(e) => println!("variant {label} unavailable: {e}"),
        }
    }
    // `--profile LABEL`: two unchecked prefills of that variant at B=1, T=8192 (for a profiler).
    if let Some(label) = profile_label() {
        let s = shape(1, 8192, 32);
        let Some((_, kv)) = variants.iter().find(|(l, _)| *l == label) else {
            println!("no variant {label}");
            return Ok(1);
        };
        let p = Problem::random(s, &mut rng, 0.5, false);
        let d = p.upload(&dev)?;
        let (mut state, mut out) = prefill_outputs(&dev, s)?;
        let mut ws = KdaPrefillWorkspace::new(&dev, s)?;
        for _ in 0..2 {
            kv.prefill(
                &dev,
                s,
                &d.inputs(),
                0.088,
                true,
                None,
                &mut state,
                &mut out,
                &mut ws,
            )?;
        }
        dev.stream().synchronize()?;
        println!("profiled {label}");
        return Ok(0);
    }
    // A variant that fails its checks is reported and left out of the timings.
    let mut variant_failures = 0;
    let mut checked = Vec::new();
    for (label, kv) in variants {
        let before = checks.failed;
        for (name, s, decay, st) in [
            ("B2.T300.H4", shape(2, 300, 4), 0.5, true),
            ("B1.T777.H3", shape(1, 777, 3), 1.0, true),
            ("B1.T200.H2.strong_decay", shape(1, 200, 2), 10.0, true),
        ] {
            let p = Problem::random(s, &mut rng, decay, st);
            check_prefill(
                &dev,
                &kv,
                &mut checks,
                &format!("kda_prefill.{label}.{name}"),
                &p,
            )?;
        }
        check_packed(
            &dev,
            &kv,
            &mut checks,
            &format!("kda_prefill.{label}.packed"),
            &mut rng,
        )?;
        if checks.failed == before {
            checked.push((label, kv));
        } else {
            variant_failures += checks.failed - before;
            checks.failed = before;
        }
    }
    let variants = checked;
    if plain {
        return Ok(variant_failures);
    }
    if !prefill_only || std::env::args().any(|a| a == "--stages") {
        stage_costs(&dev, shape(1, if quick { 8192 } else { 32768 }, 32))?;
    }
    let shapes: &[(usize, usize)] = if quick {
        &[(1, 8192)]
    } else {
        &[(1, 32768), (8, 4096), (1, 8192)]
    };
    for &(b, t) in shapes {
        bench_prefill(&dev, &variants, shape(b, t, 32))?;
    }
    for &(_, t) in shapes.iter().filter(|(b, _)| *b == 1) {
        bench_segmented(&dev, &mut kernels, &mut checks, shape(1, t, 32))?;
    }
    for batch in [1, 64, 256].into_iter().filter(|_| !prefill_only) {
        bench_decode(&dev, &mut kernels, batch)?;
    }
    Ok(variant_failures)
}

/// The argument after `flag`, if any.
fn arg_after(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1).cloned()
}

/// The variant named by `--profile LABEL`, if any.
fn profile_label() -> Option<String> {
    arg_after("--profile")
}

fn main() {
    common::exit_with(run());
}
