//! Helpers shared by the CUDA check-and-bench examples: a deterministic generator, poisoned
//! outputs, relative errors, the check tally and event timing.
#![allow(dead_code)]

use tessera_kernels::cuda::{CudaDevice, CudaError, CudaSlice};

pub const HBM_BYTES_PER_S: f64 = 4.8e12;

/// Deterministic generator (splitmix64) with normal and uniform draws.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

/// `n` draws of `f`, generated in parallel blocks with seeds derived from `seed`.
pub fn fill<T: Send + Default + Clone>(
    n: usize,
    seed: u64,
    f: impl Fn(&mut Rng) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::default(); n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, block)| {
            let mut r = Rng(seed ^ (i as u64).wrapping_mul(0xa076_1d64_78bd_642f));
            for x in block {
                *x = f(&mut r);
            }
        });
    out
}

pub struct Device<'a> {
    pub dev: &'a CudaDevice,
}

impl Device<'_> {
    pub fn poisoned_u16(&self, n: usize) -> Result<CudaSlice<u16>, CudaError> {
        self.dev.upload(&vec![0x7fc0u16; n]) // bf16 NaN
    }
    pub fn poisoned_f32(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.dev.upload(&vec![f32::NAN; n])
    }
}

/// ‖a − b‖ / ‖b‖, infinite when anything is NaN.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() {
            return f64::INFINITY;
        }
        num += ((x - y) as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub struct Checks {
    pub failed: usize,
}

impl Checks {
    pub fn report(&mut self, name: &str, err: f64, tol: f64) {
        let ok = err <= tol;
        if !ok {
            self.failed += 1;
        }
        println!(
            "check {name} rel_err={err:.3e} tol={tol:.0e} {}",
            if ok { "ok" } else { "FAIL" }
        );
    }
}

/// Median of `iters` timed runs (device events around each) after `warmup` runs (at least one),
/// in µs.
pub fn time_us(
    dev: &CudaDevice,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    for _ in 1..warmup {
        f()?;
    }
    time_us_back_to_back(dev, iters, 1, f)
}

/// Median over `iters` samples of `reps` runs enqueued back to back between two device events,
/// per run, in µs: the device time of a sequence of launches without the host's launch gaps
/// before it (which a decode step replayed from a CUDA graph does not have either).
pub fn time_us_back_to_back(
    dev: &CudaDevice,
    iters: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    dev.synchronize()?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let a = dev.context().new_event(flags)?;
        let b = dev.context().new_event(flags)?;
        a.record(dev.stream())?;
        for _ in 0..reps {
            f()?;
        }
        b.record(dev.stream())?;
        b.synchronize()?;
        samples.push(a.elapsed_ms(&b)? as f64 * 1e3 / reps as f64);
    }
    samples.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(samples[samples.len() / 2])
}

/// Ends a check run: exit 0 when every check passed, 1 when some failed, 2 on an error.
pub fn exit_with(result: Result<usize, CudaError>) {
    match result {
        Ok(0) => println!("all checks passed"),
        Ok(n) => {
            println!("{n} check(s) failed");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
