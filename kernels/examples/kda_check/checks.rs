//! The checks of `cuda_check_bench`: random KDA problems, their CPU reference, and every
//! prefill and decode path of the CUDA kernels against it (outputs poisoned before each run).

use crate::common::{fill, rel_err, Checks, Device, Rng};
use tessera_kernels::cpu;
use tessera_kernels::cuda::{
    base_ptr, bf16_bits, bf16_value, CudaDevice, CudaError, CudaSlice, KdaInputs, KdaKernels,
    KdaPacked, KdaPrefillWorkspace, KdaSequenceTables, KdaShape, SegState,
};

/// Host copies of one random KDA problem: bf16 bits and their exact f32 values.
pub(crate) struct Problem {
    pub(crate) shape: KdaShape,
    pub(crate) q: Vec<u16>,
    pub(crate) k: Vec<u16>,
    pub(crate) v: Vec<u16>,
    pub(crate) g: Vec<f32>,
    pub(crate) beta: Vec<u16>,
    pub(crate) state0: Option<Vec<f32>>,
}

impl Problem {
    pub(crate) fn random(shape: KdaShape, rng: &mut Rng, decay_max: f32, with_state: bool) -> Self {
        let n_qk = shape.batch * shape.seq_len * shape.heads * shape.dk;
        let n_v = shape.batch * shape.seq_len * shape.heads * shape.dv;
        let n_bth = shape.batch * shape.seq_len * shape.heads;
        let q = fill(n_qk, rng.next_u64(), |r| bf16_bits(r.normal()));
        let k = fill(n_qk, rng.next_u64(), |r| bf16_bits(r.normal()));
        let v = fill(n_v, rng.next_u64(), |r| bf16_bits(r.normal()));
        let g = fill(n_qk, rng.next_u64(), |r| -r.uniform() * decay_max);
        let beta = fill(n_bth, rng.next_u64(), |r| {
            bf16_bits(1.0 / (1.0 + (-r.normal()).exp()))
        });
        let state0 = with_state.then(|| {
            fill(
                shape.batch * shape.heads * shape.dk * shape.dv,
                rng.next_u64(),
                |r| r.normal() * 0.5,
            )
        });
        Problem {
            shape,
            q,
            k,
            v,
            g,
            beta,
            state0,
        }
    }

    pub(crate) fn upload(&self, dev: &CudaDevice) -> Result<DeviceProblem, CudaError> {
        Ok(DeviceProblem {
            q: dev.upload(&self.q)?,
            k: dev.upload(&self.k)?,
            v: dev.upload(&self.v)?,
            g: dev.upload(&self.g)?,
            beta: dev.upload(&self.beta)?,
        })
    }

    /// CPU reference: per sequence, normalise q and k, run the recurrent form.
    pub(crate) fn reference(&self, scale: f32) -> (Vec<f32>, Vec<f32>) {
        let s = self.shape;
        let per_qk = s.seq_len * s.heads * s.dk;
        let per_v = s.seq_len * s.heads * s.dv;
        let per_s = s.heads * s.dk * s.dv;
        let mut out = vec![0.0f32; s.batch * per_v];
        let mut state = self
            .state0
            .clone()
            .unwrap_or_else(|| vec![0.0; s.batch * per_s]);
        for b in 0..s.batch {
            let f = |x: &[u16]| x.iter().map(|&u| bf16_value(u)).collect::<Vec<f32>>();
            let mut q = f(&self.q[b * per_qk..(b + 1) * per_qk]);
            let mut k = f(&self.k[b * per_qk..(b + 1) * per_qk]);
            cpu::l2_normalize(&mut q, s.dk, 1e-6);
            cpu::l2_normalize(&mut k, s.dk, 1e-6);
            let v = f(&self.v[b * per_v..(b + 1) * per_v]);
            let beta = f(&self.beta[b * s.seq_len * s.heads..(b + 1) * s.seq_len * s.heads]);
            cpu::kda_recurrent(
                &q,
                &k,
                &v,
                &self.g[b * per_qk..(b + 1) * per_qk],
                &beta,
                s.heads,
                s.dk,
                s.dv,
                scale,
                &mut state[b * per_s..(b + 1) * per_s],
                &mut out[b * per_v..(b + 1) * per_v],
            );
        }
        (out, state)
    }
}

/// A problem's inputs on the device.
pub(crate) struct DeviceProblem {
    pub(crate) q: CudaSlice<u16>,
    pub(crate) k: CudaSlice<u16>,
    pub(crate) v: CudaSlice<u16>,
    pub(crate) g: CudaSlice<f32>,
    pub(crate) beta: CudaSlice<u16>,
}

impl DeviceProblem {
    pub(crate) fn inputs(&self) -> KdaInputs<'_> {
        KdaInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

pub(crate) fn check_prefill(
    dev: &CudaDevice,
    kernels: &KdaKernels,
    checks: &mut Checks,
    name: &str,
    p: &Problem,
) -> Result<(), CudaError> {
    let s = p.shape;
    let scale = 1.0 / (s.dk as f32).sqrt();
    let pz = Device { dev };
    let d = p.upload(dev)?;
    let init = p.state0.as_ref().map(|s0| dev.upload(s0)).transpose()?;
    let mut state = pz.poisoned_f32(s.batch * s.heads * s.dk * s.dv)?;
    let mut out = pz.poisoned_u16(s.batch * s.seq_len * s.heads * s.dv)?;
    let mut ws = KdaPrefillWorkspace::new(dev, s)?;
    let x = d.inputs();
    kernels.prefill(
        dev,
        s,
        &x,
        scale,
        true,
        init.as_ref(),
        &mut state,
        &mut out,
        &mut ws,
    )?;
    let got_o: Vec<f32> = dev.download(&out)?.into_iter().map(bf16_value).collect();
    let got_s = dev.download(&state)?;
    let (want_o, want_s) = p.reference(scale);
    checks.report(&format!("{name}.o"), rel_err(&got_o, &want_o), 2e-2);
    checks.report(&format!("{name}.state"), rel_err(&got_s, &want_s), 2e-2);
    Ok(())
}

/// The packed form the model calls: sequences of unequal lengths (an empty one too) in one call,
/// q|k|v interleaved in rows of 3·H·K as the model's projection writes them (q and k already
/// L2-normalised, so the kernel's normalisation is off), o in rows padded past H·V, and the
/// states in a shared buffer at scattered offsets: some sequences start from zeros (offset -1),
/// one advances its state in place, the others copy on write.
pub(crate) fn check_packed(
    dev: &CudaDevice,
    kernels: &KdaKernels,
    checks: &mut Checks,
    name: &str,
    rng: &mut Rng,
) -> Result<(), CudaError> {
    const LENS: [usize; 7] = [1, 63, 64, 0, 65, 200, 130];
    let (heads, dk) = (3usize, 128usize);
    let p = heads * dk;
    let (ld, ld_o) = (3 * p, p + 8);
    let n: usize = LENS.iter().sum();
    let scale = 1.0 / (dk as f32).sqrt();
    let mut qkv: Vec<f32> = fill(n * ld, rng.next_u64(), |r| r.normal());
    for row in qkv.chunks_mut(ld) {
        cpu::l2_normalize(&mut row[..2 * p], dk, 1e-6);
    }
    let qkv: Vec<u16> = qkv.into_iter().map(bf16_bits).collect();
    let g = fill(n * p, rng.next_u64(), |r| -r.uniform() * 0.8);
    let beta: Vec<u16> = fill(n * heads, rng.next_u64(), |r| {
        bf16_bits(1.0 / (1.0 + (-r.normal()).exp()))
    });
    let per = heads * dk * dk;
    // State slots: sequence s reads slot src[s] (or zeros) and writes slot dst[s].
    let src: Vec<i64> = vec![2, -1, 0, 5, -1, 4, 6];
    let dst: Vec<i64> = vec![3, 1, 0, 7, 8, 9, 10];
    let slots = 11;
    let states = fill(slots * per, rng.next_u64(), |r| r.normal() * 0.5);
    let tables = KdaSequenceTables::new(LENS);
    let at = |v: &[i64]| -> Vec<i64> {
        v.iter()
            .map(|&i| if i < 0 { -1 } else { i * per as i64 })
            .collect()
    };

    // The reference: each sequence alone, from its slot, on the same bf16 values.
    let f = |x: u16| bf16_value(x);
    let mut want_o = vec![0.0f32; n * ld_o];
    let mut want_states = states.clone();
    for (s, w) in tables.seq_start.windows(2).enumerate() {
        let (t0, t1) = (w[0] as usize, w[1] as usize);
        let rows = t0..t1;
        let col = |c0: usize| -> Vec<f32> {
            rows.clone()
                .flat_map(|t| qkv[t * ld + c0..t * ld + c0 + p].iter().map(|&x| f(x)))
                .collect()
        };
        let (q, k, v) = (col(0), col(p), col(2 * p));
        let b: Vec<f32> = beta[t0 * heads..t1 * heads].iter().map(|&x| f(x)).collect();
        let mut st = if src[s] < 0 {
            vec![0.0; per]
        } else {
            states[src[s] as usize * per..][..per].to_vec()
        };
        let mut o = vec![0.0f32; (t1 - t0) * p];
        cpu::kda_recurrent(
            &q,
            &k,
            &v,
            &g[t0 * p..t1 * p],
            &b,
            heads,
            dk,
            dk,
            scale,
            &mut st,
            &mut o,
        );
        want_states[dst[s] as usize * per..][..per].copy_from_slice(&st);
        for (i, t) in rows.enumerate() {
            want_o[t * ld_o..t * ld_o + p].copy_from_slice(&o[i * p..(i + 1) * p]);
        }
    }

    let d_qkv = dev.upload(&qkv)?;
    let d_g = dev.upload(&g)?;
    let d_beta = dev.upload(&beta)?;
    let d_states = dev.upload(&states)?;
    let d_src = dev.upload(&at(&src))?;
    let d_dst = dev.upload(&at(&dst))?;
    let d_seq = dev.upload(&tables.seq_start)?;
    let d_chunks = dev.upload(&tables.chunk_start)?;
    let out = Device { dev }.poisoned_u16(n * ld_o)?;
    let ws = KdaPrefillWorkspace::packed(dev, tables.chunks(), heads, dk, dk)?;
    let st = dev.stream();
    let base = base_ptr(st, &d_qkv);
    let call = KdaPacked {
        q: base,
        k: base + 2 * p as u64,
        ld_qk: ld,
        v: base + 4 * p as u64,
        ld_v: ld,
        g: base_ptr(st, &d_g),
        beta: base_ptr(st, &d_beta),
        out: base_ptr(st, &out),
        ld_o,
        seq_start: base_ptr(st, &d_seq),
        chunk_start: base_ptr(st, &d_chunks),
        sequences: LENS.len(),
        chunks: tables.chunks(),
        heads,
        state: SegState {
            src: base_ptr(st, &d_states),
            dst: base_ptr(st, &d_states),
            src_off: base_ptr(st, &d_src),
            dst_off: base_ptr(st, &d_dst),
        },
        scale,
        l2norm: false,
    };
    kernels.prefill_packed(dev, &call, &ws)?;
    // Only the rows' first H·V columns are written; the padding keeps its poison.
    let got: Vec<f32> = dev.download(&out)?.into_iter().map(bf16_value).collect();
    let (mut got_o, mut ref_o) = (Vec::new(), Vec::new());
    for t in 0..n {
        got_o.extend_from_slice(&got[t * ld_o..t * ld_o + p]);
        ref_o.extend_from_slice(&want_o[t * ld_o..t * ld_o + p]);
    }
    let pad_poisoned = (0..n).all(|t| got[t * ld_o + p..(t + 1) * ld_o].iter().all(|x| x.is_nan()));
    checks.report(&format!("{name}.o"), rel_err(&got_o, &ref_o), 2e-2);
    checks.report(
        &format!("{name}.state"),
        rel_err(&dev.download(&d_states)?, &want_states),
        2e-2,
    );
    checks.report(
        &format!("{name}.row_padding_untouched"),
        if pad_poisoned { 0.0 } else { 1.0 },
        0.5,
    );
    Ok(())
}

/// Decode kernel variants: (label, three blocks per SM, column split); the last is the default.
pub(crate) const DECODE_VARIANTS: &[(&str, bool, bool)] = &[
    (".block", false, false),
    (".occ3", true, false),
    ("", false, true),
];

pub(crate) fn check_decode(
    dev: &CudaDevice,
    kernels: &mut KdaKernels,
    checks: &mut Checks,
    p: &Problem,
) -> Result<(), CudaError> {
    let s = p.shape;
    let scale = 1.0 / (s.dk as f32).sqrt();
    let d = p.upload(dev)?;
    let x = d.inputs();
    let (want_o, want_s) = p.reference(scale);
    // Every variant of the step, each from the same state, outputs poisoned first.
    for &(label, occ3, split) in DECODE_VARIANTS {
        kernels.set_decode_three_blocks_per_sm(occ3);
        kernels.set_decode_split_columns(split);
        let mut state = dev.upload(p.state0.as_ref().expect("decode starts from a state"))?;
        let mut out = Device { dev }.poisoned_u16(s.batch * s.heads * s.dv)?;
        kernels.decode(dev, s, &x, scale, true, &mut state, &mut out)?;
        let got_o: Vec<f32> = dev.download(&out)?.into_iter().map(bf16_value).collect();
        let got_s = dev.download(&state)?;
        checks.report(
            &format!("kda_decode{label}.B{}.o", s.batch),
            rel_err(&got_o, &want_o),
            1e-2,
        );
        checks.report(
            &format!("kda_decode{label}.B{}.state", s.batch),
            rel_err(&got_s, &want_s),
            1e-5,
        );
    }
    kernels.set_decode_three_blocks_per_sm(false);
    kernels.set_decode_split_columns(true);
    Ok(())
}
