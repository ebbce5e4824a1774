//! Checks the CUDA row-wise ops and the cuBLAS linear layer against the CPU backend on fresh
//! random inputs (outputs poisoned with NaN before each run), then times them against their
//! memory floor (bytes moved / 4.8 TB/s).
//!
//!   cargo build --release -p tessera-kernels --features cuda --example cuda_ops_check
//!   target/release/examples/cuda_ops_check [--quick]
//!
//! Output: `check <name> rel_err=<e> tol=<t> <ok|FAIL>` lines, then `time op_<name> <shape>
//! us=<median> floor_us=<bytes / 4.8 TB/s> gbps=<achieved>` lines (`tflops=` for the linear
//! layer). Exits non-zero when a check fails.

#[path = "common/mod.rs"]
mod common;

use common::{fill, rel_err, time_us, Checks, Device, Rng, HBM_BYTES_PER_S};
use tessera_kernels::cpu;
use tessera_kernels::cuda::{
    bf16_bits, bf16_value, default_cache_dir, CudaDevice, CudaError, Linear, RowOps,
};

fn bf16_vec(n: usize, rng: &mut Rng, scale: f32) -> Vec<u16> {
    fill(n, rng.next_u64(), |r| bf16_bits(r.normal() * scale))
}

fn values(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16_value(b)).collect()
}

fn report_time(name: &str, shape: &str, us: f64, bytes: f64, extra: &str) {
    let floor = bytes / HBM_BYTES_PER_S * 1e6;
    println!(
        "time op_{name} {shape} us={us:.2} floor_us={floor:.2} gbps={:.0} pct_floor={:.0}{extra}",
        bytes / (us * 1e-6) / 1e9,
        100.0 * floor / us
    );
}

fn check_rms_norm(
    dev: &CudaDevice,
    ops: &RowOps,
    checks: &mut Checks,
    rng: &mut Rng,
    rows: usize,
    dim: usize,
) -> Result<(), CudaError> {
    let pz = Device { dev };
    let (x, res, w) = (
        bf16_vec(rows * dim, rng, 1.0),
        bf16_vec(rows * dim, rng, 1.0),
        bf16_vec(dim, rng, 0.5),
    );
    let eps = 1e-6;
    let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
    // With the residual stream: residual ← bf16(x + residual), out ← norm(residual).
    let mut rd = dev.upload(&res)?;
    let mut out = pz.poisoned_u16(rows * dim)?;
    ops.rms_norm(dev, &xd, Some(&mut rd), &wd, &mut out, rows, dim, eps)?;
    let want_r: Vec<f32> = values(&x)
        .iter()
        .zip(values(&res))
        .map(|(a, b)| bf16_value(bf16_bits(a + b)))
        .collect();
    let mut want = vec![0.0; rows * dim];
    cpu::rms_norm(&want_r, dim, &values(&w), eps, &mut want);
    let name = format!("rms_norm.residual.R{rows}.D{dim}");
    checks.report(
        &format!("{name}.residual"),
        rel_err(&values(&dev.download(&rd)?), &want_r),
        0.0,
    );
    checks.report(&name, rel_err(&values(&dev.download(&out)?), &want), 1e-2);
    // Without it.
    let mut out = pz.poisoned_u16(rows * dim)?;
    ops.rms_norm(dev, &xd, None, &wd, &mut out, rows, dim, eps)?;
    cpu::rms_norm(&values(&x), dim, &values(&w), eps, &mut want);
    checks.report(
        &format!("rms_norm.R{rows}.D{dim}"),
        rel_err(&values(&dev.download(&out)?), &want),
        1e-2,
    );
    Ok(())
}

fn check_embedding(
    dev: &CudaDevice,
    ops: &RowOps,
    checks: &mut Checks,
    rng: &mut Rng,
) -> Result<(), CudaError> {
    let (vocab, dim) = (1000, 512);
    let table = bf16_vec(vocab * dim, rng, 1.0);
    let ids: Vec<u32> = (0..77)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    let td = dev.upload(&table)?;
    let mut out = Device { dev }.poisoned_u16(ids.len() * dim)?;
    ops.embedding(dev, &td, vocab, dim, &ids, &mut out)?;
    let mut want = vec![0.0; ids.len() * dim];
    cpu::embedding(&values(&table), dim, &ids, &mut want).expect("ids in range");
    checks.report(
        "embedding",
        rel_err(&values(&dev.download(&out)?), &want),
        0.0,
    );
    let refused = ops.embedding(dev, &td, vocab, dim, &[3, vocab as u32], &mut out);
    checks.report(
        "embedding.out_of_range_refused",
        if matches!(refused, Err(CudaError::Shape(_))) {
            0.0
        } else {
            1.0
        },
        0.0,
    );
    Ok(())
}

fn check_argmax(
    dev: &CudaDevice,
    ops: &RowOps,
    checks: &mut Checks,
    rng: &mut Rng,
    vocab: usize,
) -> Result<(), CudaError> {
    let rows = 70;
    let mut logits = fill(rows * vocab, rng.next_u64(), |r| r.normal() * 4.0);
    // Special rows: a tie (the lower index wins), NaNs (never win), all -inf, all NaN.
    let row = |r: usize| r * vocab..(r + 1) * vocab;
    if vocab < 16 {
        logits[row(1)].fill(f32::NAN);
        logits[row(2)].fill(f32::NEG_INFINITY);
        return compare_argmax(dev, ops, checks, &logits, rows, vocab);
    }
    logits[row(0)][vocab / 3] = 1e9;
    logits[row(0)][vocab - 5] = 1e9;
    logits[row(1)][7] = f32::NAN;
    logits[row(1)][vocab / 2] = f32::NAN;
    logits[row(2)].fill(f32::NEG_INFINITY);
    logits[row(3)].fill(f32::NAN);
    logits[row(4)][vocab - 1] = f32::INFINITY;
    compare_argmax(dev, ops, checks, &logits, rows, vocab)
}

fn compare_argmax(
    dev: &CudaDevice,
    ops: &RowOps,
    checks: &mut Checks,
    logits: &[f32],
    rows: usize,
    vocab: usize,
) -> Result<(), CudaError> {
    let row = |r: usize| r * vocab..(r + 1) * vocab;
    let ld = dev.upload(logits)?;
    let mut out = dev.upload(&vec![u32::MAX; rows])?;
    ops.argmax(dev, &ld, rows, vocab, &mut out)?;
    let got = dev.download(&out)?;
    let wrong = (0..rows)
        .filter(|&r| got[r] as usize != cpu::argmax(&logits[row(r)]))
        .count();
    checks.report(&format!("argmax.V{vocab}.rows_wrong"), wrong as f64, 0.0);
    Ok(())
}

fn check_linear(
    dev: &CudaDevice,
    lin: &Linear,
    checks: &mut Checks,
    rng: &mut Rng,
    rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<(), CudaError> {
    let (x, w) = (
        bf16_vec(rows * in_dim, rng, 1.0),
        bf16_vec(out_dim * in_dim, rng, 0.05),
    );
    let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
    let mut out = Device { dev }.poisoned_u16(rows * out_dim)?;
    lin.forward(dev, &xd, rows, in_dim, &wd, out_dim, &mut out)?;
    let mut want = vec![0.0; rows * out_dim];
    cpu::linear(&values(&x), rows, in_dim, &values(&w), out_dim, &mut want);
    checks.report(
        &format!("linear.R{rows}.I{in_dim}.O{out_dim}"),
        rel_err(&values(&dev.download(&out)?), &want),
        1e-2,
    );
    Ok(())
}

fn bench(dev: &CudaDevice, ops: &RowOps, lin: &Linear, quick: bool) -> Result<(), CudaError> {
    let mut rng = Rng(7);
    let iters = if quick { 20 } else { 100 };
    for (rows, dim) in [(1, 7168), (64, 7168), (4096, 7168), (16384, 2304)] {
        let (x, w) = (
            dev.upload(&bf16_vec(rows * dim, &mut rng, 1.0))?,
            dev.upload(&bf16_vec(dim, &mut rng, 1.0))?,
        );
        let mut r = dev.upload(&bf16_vec(rows * dim, &mut rng, 1.0))?;
        let mut out = dev.upload(&vec![0u16; rows * dim])?;
        let us = time_us(dev, 5, iters, || {
            ops.rms_norm(dev, &x, Some(&mut r), &w, &mut out, rows, dim, 1e-6)
        })?;
        // x read, residual read and written, out written: 4 bf16 per element.
        report_time(
            "rms_norm_residual",
            &format!("rows={rows} dim={dim}"),
            us,
            8.0 * (rows * dim) as f64,
            "",
        );
    }
    for vocab in [163_840, 32_000] {
        for rows in [1, 64, 256] {
            let l = dev.upload(&fill(rows * vocab, rng.next_u64(), |r| r.normal()))?;
            let mut out = dev.upload(&vec![0u32; rows])?;
            let us = time_us(dev, 5, iters, || ops.argmax(dev, &l, rows, vocab, &mut out))?;
            report_time(
                "argmax",
                &format!("rows={rows} vocab={vocab}"),
                us,
                4.0 * (rows * vocab) as f64,
                "",
            );
        }
    }
    for (rows, in_dim, out_dim) in [
        (1, 7168, 2048),
        (64, 7168, 2048),
        (256, 7168, 7168),
        (4096, 7168, 7168),
    ] {
        let x = dev.upload(&bf16_vec(rows * in_dim, &mut rng, 1.0))?;
        let w = dev.upload(&bf16_vec(out_dim * in_dim, &mut rng, 0.05))?;
        let mut out = dev.upload(&vec![0u16; rows * out_dim])?;
        let us = time_us(dev, 5, iters, || {
            lin.forward(dev, &x, rows, in_dim, &w, out_dim, &mut out)
        })?;
        let bytes = 2.0 * (rows * in_dim + out_dim * in_dim + rows * out_dim) as f64;
        let tflops = 2.0 * (rows * in_dim * out_dim) as f64 / (us * 1e-6) / 1e12;
        report_time(
            "linear",
            &format!("rows={rows} in={in_dim} out={out_dim}"),
            us,
            bytes,
            &format!(" tflops={tflops:.0}"),
        );
    }
    Ok(())
}

fn run() -> Result<usize, CudaError> {
    let quick = std::env::args().any(|a| a == "--quick");
    let dev = CudaDevice::open(0, default_cache_dir())?;
    println!("device {} ({})", dev.name(), dev.arch());
    let ops = RowOps::load(&dev)?;
    let lin = Linear::new(&dev)?;
    let mut checks = Checks { failed: 0 };
    let mut rng = Rng(42);
    for (rows, dim) in [
        (1, 8),
        (3, 2048),
        (7, 7168),
        (300, 4096),
        (2, RowOps::MAX_NORM_DIM),
    ] {
        check_rms_norm(&dev, &ops, &mut checks, &mut rng, rows, dim)?;
    }
    check_embedding(&dev, &ops, &mut checks, &mut rng)?;
    for vocab in [1, 300, 163_840] {
        check_argmax(&dev, &ops, &mut checks, &mut rng, vocab)?;
    }
    for (rows, in_dim, out_dim) in [(1, 512, 384), (37, 2048, 1536), (256, 1024, 4096)] {
        check_linear(&dev, &lin, &mut checks, &mut rng, rows, in_dim, out_dim)?;
    }
    bench(&dev, &ops, &lin, quick)?;
    Ok(checks.failed)
}

fn main() {
    common::exit_with(run());
}
