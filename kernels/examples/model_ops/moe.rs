//! MoE decode checks (routing against `cpu::route_sigmoid_grouped`, the expert pass against a
//! CPU composition of `cpu::linear` and SiTU over bf16 or dequantised MXFP4 weights) and the K3
//! latent-shape benchmark, for `cuda_model_ops_check`.

use crate::common::{fill, rel_err, time_us_back_to_back, Checks, Device, Rng};
use crate::{bf16_vec, report_time, values};
use tessera_kernels::cpu::{self, MoeRouting};
use tessera_kernels::cuda::{
    mxfp4_device_codes, CudaDevice, CudaError, MoeActivation, MoeDecode, MoeDims, MoeExperts,
    MoePath, MoeWorkspace,
};

const SITU: MoeActivation = MoeActivation::Situ {
    gate_beta: 4.0,
    up_beta: 25.0,
};

fn situ(g: f32, u: f32) -> f32 {
    let sig = 1.0 / (1.0 + (-g).exp());
    (4.0 * (g / 4.0).tanh() * sig) * (25.0 * (u / 25.0).tanh())
}

/// The projection kernels to check and time: the column kernels, the tensor cores with the input
/// split chosen per call (the default), and with it fixed at 1, 2 and 4; with `tuned`, build-time
/// alternatives of the tensor-core kernels too (`MOE_TC_*` / `MOE_TMA_*` settings of moe_tc.cu
/// and moe_tc_tma.cu); timing probes only when `keep` names them (see [`is_probe`]). `keep`
/// names the labels to load (without the leading `_`; `None`: all).
pub(crate) fn variants(
    dev: &CudaDevice,
    tuned: bool,
    keep: Option<&[String]>,
) -> Result<Vec<(String, MoeDecode)>, CudaError> {
    type Spec = (String, MoePath, Option<usize>, Vec<(&'static str, String)>);
    let set = |pairs: &[(&'static str, u32)]| -> Vec<(&'static str, String)> {
        pairs.iter().map(|&(k, v)| (k, v.to_string())).collect()
    };
    let mut specs: Vec<Spec> = vec![
        ("_columns".into(), MoePath::Columns, None, vec![]),
        ("_tc".into(), MoePath::TensorCores, None, vec![]),
    ];
    for ks in [1, 2, 4] {
        specs.push((
            format!("_tc_ks{ks}"),
            MoePath::TensorCores,
            Some(ks),
            vec![],
        ));
    }
    if tuned || keep.is_some() {
        // Each pass's MXFP4 weight vectors loaded only once the previous pass is over.
        let whole = set(&[("MOE_TC_ROLL", 0)]);
        specs.push(("_tc_noroll".into(), MoePath::TensorCores, None, whole));
        // L1 policies of the weight loads (MXFP4 codes, bf16) and the input loads (moe_tc.cu).
        for (code, bf16, x) in [(0, 0, 0), (1, 0, 0), (2, 2, 0), (2, 0, 1), (2, 1, 0)] {
            let tuning = set(&[
                ("MOE_TC_CODE_HINT", code),
                ("MOE_TC_BF16_HINT", bf16),
                ("MOE_TC_X_HINT", x),
            ]);
            let label = format!("_tc_h{code}b{bf16}x{x}");
            specs.push((label, MoePath::TensorCores, None, tuning));
        }
        // Weight lines asked of L2 some passes ahead, and larger L2 fetches per load.
        for (passes, fetch) in [(1, 0), (4, 0), (0, 128), (0, 256)] {
            let tuning = set(&[("MOE_TC_PF_PASSES", passes), ("MOE_TC_L2_FETCH", fetch)]);
            let label = format!("_tc_pf{passes}l2f{fetch}");
            specs.push((label, MoePath::TensorCores, None, tuning));
        }
        // Down warps on one or two row tiles, both formats.
        for tiles in [1, 2] {
            let tuning = set(&[
                ("MOE_TC_DOWN_TILES_BF16", tiles),
                ("MOE_TC_DOWN_TILES_MXFP4", tiles),
            ]);
            specs.push((format!("_tc_dt{tiles}"), MoePath::TensorCores, None, tuning));
        }
        // The projections launched plainly, not as dependents; down warps waiting for the whole
        // gate/up kernel instead of their expert's blocks.
        specs.push((
            "_tc_dep0".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_TC_DEPENDENT", 0)]),
        ));
        specs.push((
            "_tc_fine0".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_TC_FINE", 0)]),
        ));
        // Down warps waiting for gate/up before they load their first pass of weights.
        specs.push((
            "_tc_lf0".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_TC_LOAD_FIRST", 0)]),
        ));
        // The routing kernel launched plainly, not as a dependent of the kernel before it.
        specs.push((
            "_tc_rd0".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_ROUTE_DEPENDENT", 0)]),
        ));
        // The routing's choice by warp lists instead of the radix select; its dependent (gate/up)
        // let launch once the routing has its input; both.
        for (select, trigger) in [(1, 0), (0, 1), (1, 1)] {
            let tuning = set(&[("MOE_ROUTE_SELECT", select), ("MOE_ROUTE_TRIGGER", trigger)]);
            let label = format!("_tc_wl{select}rt{trigger}");
            specs.push((label, MoePath::TensorCores, None, tuning));
        }
        // The weighted combine inside the down kernel at every batch (no combine kernel), alone
        // and with the routing by warp lists.
        for select in [0, 1] {
            let tuning = set(&[("MOE_TC_FUSED_COMBINE", 64), ("MOE_ROUTE_SELECT", select)]);
            let label = format!("_tc_fc{}", if select == 1 { "wl1" } else { "" });
            specs.push((label, MoePath::TensorCores, None, tuning));
        }
        // MXFP4 projection blocks reading their plan entries with the count of active experts;
        // and every change of batch 1's chain at once (routing by warp lists, gate/up let launch
        // once the routing has its input, the combine in the down kernel, the plan read early,
        // resident gate/up blocks).
        specs.push((
            "_tc_pe1".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_TC_PLAN_EARLY", 1)]),
        ));
        specs.push((
            "_tc_chain".into(),
            MoePath::TensorCores,
            None,
            set(&[
                ("MOE_ROUTE_SELECT", 1),
                ("MOE_ROUTE_TRIGGER", 1),
                ("MOE_TC_FUSED_COMBINE", 64),
                ("MOE_TC_PLAN_EARLY", 1),
                ("MOE_TC_RESIDENT", 1),
            ]),
        ));
        // Gate/up by resident blocks, the next task's first pass loaded during the last pass.
        specs.push((
            "_tc_res1".into(),
            MoePath::TensorCores,
            None,
            set(&[("MOE_TC_RESIDENT", 1)]),
        ));
        // Inputs through shared memory for experts of up to 0 (never), 1 or 2 tokens (the
        // default: 4).
        for max in [0, 1, 2] {
            let tuning = set(&[("MOE_TC_STAGE_X", max)]);
            specs.push((format!("_tc_sx{max}"), MoePath::TensorCores, None, tuning));
        }
        // The copy-engine ring for MXFP4: (vectors per row and stage, stages, blocks per SM).
        for (chunk, stages, blocks) in [(8, 2, 4), (8, 3, 3), (8, 4, 2), (16, 2, 2)] {
            let tuning = set(&[
                ("MOE_TC_TMA", 1),
                ("MOE_TMA_CHUNK", chunk),
                ("MOE_TMA_STAGES", stages),
                ("MOE_TC_MIN_BLOCKS", blocks),
            ]);
            let label = format!("_tc_tma{chunk}x{stages}");
            specs.push((label, MoePath::TensorCores, None, tuning));
        }
    }
    // Timing probes (`MOE_TC_PROBE` of moe_tc.cu, `MOE_ROUTE_PROBE` of moe.cu; wrong outputs by
    // design, so only when named and never checked): the layer without its down products,
    // without its gate/up products, with down warps not waiting for gate/up, without the
    // combine's sums; the routing stopped after its scores, its select, or before its plan.
    if let Some(keep) = keep {
        let probes: [(&str, &[(&'static str, u32)]); 9] = [
            ("probe_nodown", &[("MOE_TC_PROBE", 1)]),
            ("probe_nogateup", &[("MOE_TC_PROBE", 2)]),
            ("probe_nowait", &[("MOE_TC_PROBE", 3)]),
            ("probe_nocombine", &[("MOE_TC_PROBE", 4)]),
            ("probe_route1", &[("MOE_ROUTE_PROBE", 1)]),
            ("probe_route2", &[("MOE_ROUTE_PROBE", 2)]),
            ("probe_route3", &[("MOE_ROUTE_PROBE", 3)]),
            (
                "probe_route2wl",
                &[("MOE_ROUTE_PROBE", 2), ("MOE_ROUTE_SELECT", 1)],
            ),
            (
                "probe_route3wl",
                &[("MOE_ROUTE_PROBE", 3), ("MOE_ROUTE_SELECT", 1)],
            ),
        ];
        for (name, tuning) in probes {
            if keep.iter().any(|l| l == name) {
                specs.push((format!("_{name}"), MoePath::TensorCores, None, set(tuning)));
            }
        }
    }
    let mut out = Vec::new();
    for (label, path, ksplit, tuning) in specs {
        if keep.is_some_and(|k| !k.iter().any(|l| *l == label[1..])) {
            continue;
        }
        let mut moe = MoeDecode::load_tuned(dev, 1024, &tuning)?;
        moe.set_path(Some(path));
        moe.set_ksplit(ksplit);
        out.push((label, moe));
    }
    Ok(out)
}

/// Whether a variant label is a timing probe, whose outputs are wrong by design (not checked).
pub(crate) fn is_probe(label: &str) -> bool {
    label.trim_start_matches('_').starts_with("probe_")
}

/// MXFP4 dequantisation of one `[out, in]` matrix (the rule of engine/src/model/mxfp4.rs).
fn dequant_mxfp4(codes: &[u8], scales: &[u8], out: usize, inp: usize) -> Vec<f32> {
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let decode = |c: u8| {
        let m = E2M1[(c & 7) as usize];
        if c & 8 != 0 {
            -m
        } else {
            m
        }
    };
    let mut w = vec![0.0f32; out * inp];
    for o in 0..out {
        for j in 0..inp {
            let s = match scales[o * (inp / 32) + j / 32] {
                0 => 2f32.powi(-127),
                255 => f32::NAN,
                e => f32::from_bits(u32::from(e) << 23),
            };
            let b = codes[o * (inp / 2) + j / 2];
            w[o * inp + j] = decode(if j % 2 == 0 { b & 0xF } else { b >> 4 }) * s;
        }
    }
    w
}

/// Host copies of one set of expert weights, as f32 matrices per expert (gate, up, down).
struct HostExperts {
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
}

pub(crate) fn check_routing(
    dev: &CudaDevice,
    moe: &MoeDecode,
    checks: &mut Checks,
    rng: &mut Rng,
    dims: MoeDims,
    batch: usize,
    ties: bool,
) -> Result<(), CudaError> {
    let routing = MoeRouting {
        n_group: 1,
        topk_group: 1,
        top_k: dims.top_k,
        renormalize: true,
        scaling: 2.5,
    };
    let mut logits = fill(batch * dims.experts, rng.next_u64(), |r| r.normal() * 2.0);
    if batch > 1 {
        logits[dims.experts + 3] = f32::NAN; // never chosen
    }
    let mut bias = fill(dims.experts, rng.next_u64(), |r| r.normal() * 0.1);
    if ties {
        // Whole-number logits and no bias: many experts share each choice, so the last slots
        // are decided by the lowest expert number.
        logits.iter_mut().for_each(|l| *l = l.round());
        bias.iter_mut().for_each(|b| *b = 0.0);
    }
    let mut ws = MoeWorkspace::new(dev, dims, batch)?;
    moe.route(
        dev,
        &dev.upload(&logits)?,
        &dev.upload(&bias)?,
        &routing,
        &mut ws,
    )?;
    let (idx, w) = (dev.download(&ws.idx)?, dev.download(&ws.weight)?);
    let (mut want_i, mut want_w) = (
        vec![0u32; batch * dims.top_k],
        vec![0f32; batch * dims.top_k],
    );
    cpu::route_sigmoid_grouped(
        &logits,
        dims.experts,
        &bias,
        &routing,
        &mut want_i,
        &mut want_w,
    );
    let how = if ties { ".ties" } else { "" };
    let name = format!("moe_route{how}.E{}.k{}.B{batch}", dims.experts, dims.top_k);
    let wrong = idx.iter().zip(&want_i).filter(|(a, b)| a != b).count();
    checks.report(&format!("{name}.ids_wrong"), wrong as f64, 0.0);
    checks.report(&format!("{name}.weights"), rel_err(&w, &want_w), 1e-5);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn check_moe_experts(
    dev: &CudaDevice,
    (variant, moe): (&str, &MoeDecode),
    checks: &mut Checks,
    rng: &mut Rng,
    dims: MoeDims,
    batch: usize,
    mxfp4: bool,
    ties: bool,
) -> Result<(), CudaError> {
    let (e, din, di) = (dims.experts, dims.din, dims.di);
    let routing = MoeRouting {
        n_group: 1,
        topk_group: 1,
        top_k: dims.top_k,
        renormalize: true,
        scaling: 1.0,
    };
    let mut logits = fill(batch * e, rng.next_u64(), |r| r.normal() * 2.0);
    if ties {
        // Whole-number logits: the last slots are decided by the lowest expert number.
        logits.iter_mut().for_each(|l| *l = l.round());
    }
    let bias = vec![0.0f32; e];
    let x = bf16_vec(batch * din, rng, 1.0);
    let mut ws = MoeWorkspace::new(dev, dims, batch)?;
    moe.route(
        dev,
        &dev.upload(&logits)?,
        &dev.upload(&bias)?,
        &routing,
        &mut ws,
    )?;
    let mut out = Device { dev }.poisoned_u16(batch * din)?;
    // The same step twice on the same workspace, the second into its own poisoned output: every
    // count the first call raised must be back at zero, and the sums land in the same order (bit
    // for bit).
    let mut again = Device { dev }.poisoned_u16(batch * din)?;
    let xd = dev.upload(&x)?;
    let host = if mxfp4 {
        let mk = |rng: &mut Rng, rows: usize, cols: usize| {
            let codes: Vec<u8> = fill(e * rows * cols / 2, rng.next_u64(), |r| r.next_u64() as u8);
            // Mostly typical block scales, with the edges of the decoders' ranges mixed in:
            // 2^-127, and around 2^1, past which a bf16 factor of 2^(s-1) would overflow.
            let scales: Vec<u8> = fill(e * rows * cols / 32, rng.next_u64(), |r| {
                match r.next_u64() % 64 {
                    0 => 0,
                    1 => 128,
                    2 => 129,
                    3 => 131,
                    n => 118 + (n % 6) as u8,
                }
            });
            // Even experts keep every factor within one bf16 (s ≤ 128), so their warps take
            // the single-multiply decode; odd experts take the two-factor one.
            let per_expert = rows * cols / 32;
            let scales = scales
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    if (i / per_expert).is_multiple_of(2) && s > 128 {
                        120
                    } else {
                        s
                    }
                })
                .collect();
            (codes, scales)
        };
        let (g, u, d) = (mk(rng, di, din), mk(rng, di, din), mk(rng, din, di));
        let dq = |(c, s): &(Vec<u8>, Vec<u8>), rows: usize, cols: usize| -> Vec<Vec<f32>> {
            (0..e)
                .map(|x| {
                    let (cn, sn) = (rows * cols / 2, rows * cols / 32);
                    dequant_mxfp4(
                        &c[x * cn..(x + 1) * cn],
                        &s[x * sn..(x + 1) * sn],
                        rows,
                        cols,
                    )
                })
                .collect()
        };
        let host = HostExperts {
            gate: dq(&g, di, din),
            up: dq(&u, di, din),
            down: dq(&d, din, di),
        };
        let up_d = |(c, s): &(Vec<u8>, Vec<u8>)| -> Result<_, CudaError> {
            Ok((dev.upload(&mxfp4_device_codes(c))?, dev.upload(s)?))
        };
        let (gd, ud, dd) = (up_d(&g)?, up_d(&u)?, up_d(&d)?);
        let experts = MoeExperts::Mxfp4 {
            gate: (&gd.0, &gd.1),
            up: (&ud.0, &ud.1),
            down: (&dd.0, &dd.1),
        };
        moe.experts(dev, &xd, &experts, SITU, &mut ws, &mut out)?;
        moe.experts(dev, &xd, &experts, SITU, &mut ws, &mut again)?;
        host
    } else {
        let (g, u, d) = (
            bf16_vec(e * di * din, rng, 0.05),
            bf16_vec(e * di * din, rng, 0.05),
            bf16_vec(e * din * di, rng, 0.05),
        );
        let (gd, ud, dd) = (dev.upload(&g)?, dev.upload(&u)?, dev.upload(&d)?);
        let experts = MoeExperts::Bf16 {
            gate: &gd,
            up: &ud,
            down: &dd,
        };
        moe.experts(dev, &xd, &experts, SITU, &mut ws, &mut out)?;
        moe.experts(dev, &xd, &experts, SITU, &mut ws, &mut again)?;
        let split = |w: &[u16], n: usize| -> Vec<Vec<f32>> { w.chunks(n).map(values).collect() };
        HostExperts {
            gate: split(&g, di * din),
            up: split(&u, di * din),
            down: split(&d, din * di),
        }
    };
    let first = dev.download(&out)?;
    let differ = dev
        .download(&again)?
        .iter()
        .zip(&first)
        .filter(|(a, b)| a != b)
        .count();
    let got = values(&first);
    let (mut idx, mut w) = (
        vec![0u32; batch * dims.top_k],
        vec![0f32; batch * dims.top_k],
    );
    cpu::route_sigmoid_grouped(&logits, e, &bias, &routing, &mut idx, &mut w);
    let xv = values(&x);
    let mut want = vec![0.0f32; batch * din];
    for b in 0..batch {
        let xb = &xv[b * din..(b + 1) * din];
        for j in 0..dims.top_k {
            let ex = idx[b * dims.top_k + j] as usize;
            let (mut g, mut u) = (vec![0.0; di], vec![0.0; di]);
            cpu::linear(xb, 1, din, &host.gate[ex], di, &mut g);
            cpu::linear(xb, 1, din, &host.up[ex], di, &mut u);
            let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| situ(g, u)).collect();
            let mut y = vec![0.0; din];
            cpu::linear(&a, 1, di, &host.down[ex], din, &mut y);
            for (o, v) in want[b * din..(b + 1) * din].iter_mut().zip(&y) {
                *o += w[b * dims.top_k + j] * v;
            }
        }
    }
    let kind = if mxfp4 { "mxfp4" } else { "bf16" };
    let how = if ties { ".ties" } else { "" };
    let name = format!(
        "moe_experts{how}.{kind}.{variant}.E{e}.k{}.din{din}.di{di}.B{batch}",
        dims.top_k
    );
    checks.report(&name, rel_err(&got, &want), 1e-2);
    checks.report(&format!("{name}.again_differs"), differ as f64, 0.0);
    // The routing (the dependent routing kernel's) the step read.
    let (got_i, got_w) = (dev.download(&ws.idx)?, dev.download(&ws.weight)?);
    let wrong = got_i.iter().zip(&idx).filter(|(a, b)| a != b).count();
    checks.report(&format!("{name}.ids_wrong"), wrong as f64, 0.0);
    checks.report(&format!("{name}.weights"), rel_err(&got_w, &w), 1e-5);
    Ok(())
}

/// K3 latent MoE shapes, weights resident for all 896 experts (zeros: values do not change the
/// traffic), random routing; the floor is the active experts' weight bytes.
/// Times every variant (a label and kernels with their path fixed) on K3's expert shapes.
pub(crate) fn bench_moe(
    dev: &CudaDevice,
    variants: &[(String, MoeDecode)],
    batches: &[usize],
    iters: usize,
) -> Result<(), CudaError> {
    let dims = MoeDims {
        experts: 896,
        top_k: 16,
        din: 3584,
        di: 3072,
    };
    let routing = MoeRouting {
        n_group: 1,
        topk_group: 1,
        top_k: 16,
        renormalize: true,
        scaling: 1.0,
    };
    let n = dims.experts * dims.din * dims.di;
    let bias = dev.upload(&vec![0.0f32; dims.experts])?;
    for mxfp4 in [false, true] {
        let s = dev.stream();
        let bf = if mxfp4 {
            None
        } else {
            Some((
                s.alloc_zeros::<u16>(n)?,
                s.alloc_zeros::<u16>(n)?,
                s.alloc_zeros::<u16>(n)?,
            ))
        };
        let fp = if mxfp4 {
            let pair = || -> Result<_, CudaError> {
                Ok((s.alloc_zeros::<u8>(n / 2)?, s.alloc_zeros::<u8>(n / 32)?))
            };
            Some((pair()?, pair()?, pair()?))
        } else {
            None
        };
        let experts = match (&bf, &fp) {
            (Some((g, u, d)), _) => MoeExperts::Bf16 {
                gate: g,
                up: u,
                down: d,
            },
            (_, Some((g, u, d))) => MoeExperts::Mxfp4 {
                gate: (&g.0, &g.1),
                up: (&u.0, &u.1),
                down: (&d.0, &d.1),
            },
            _ => unreachable!(),
        };
        for (label, moe) in variants {
            if !mxfp4 && label.contains("tma") {
                continue; // the copy-engine ring is MXFP4's alone: bf16 is the `tc` row
            }
            let kind = format!("{}{label}", if mxfp4 { "mxfp4" } else { "bf16" });
            let [wave_gate_up, wave_down] = moe.tc_wave_warps(mxfp4);
            let [(regs_gu, local_gu), (regs_d, local_d)] = moe.tc_resources(mxfp4)?;
            println!(
                "moe_{kind}: tensor-core waves of {wave_gate_up} (gate/up) and {wave_down} (down) \
                 warps; registers {regs_gu} / {regs_d}, local bytes {local_gu} / {local_d}"
            );
            for &batch in batches {
                // The same routing and inputs for every variant at this batch.
                let mut rng = Rng(99 + batch as u64);
                let logits =
                    dev.upload(&fill(batch * dims.experts, rng.next_u64(), |r| r.normal()))?;
                let x = dev.upload(&bf16_vec(batch * dims.din, &mut rng, 1.0))?;
                let mut ws = MoeWorkspace::new(dev, dims, batch)?;
                let mut out = dev.upload(&vec![0u16; batch * dims.din])?;
                moe.route(dev, &logits, &bias, &routing, &mut ws)?;
                let active = ws.active_experts(dev)?;
                let bytes = (active * experts.bytes_per_expert(&dims)) as f64;
                let shape = format!("B={batch},E=896,k=16,din=3584,di=3072");
                // Each sequence enqueued back to back between two events: the device time
                // without host launch gaps, as in a decode step replayed from a CUDA graph.
                let (reps, samples) = (10, iters.div_ceil(10).max(5));
                let extra = format!(" active={active}");
                let us = time_us_back_to_back(dev, samples, reps, || {
                    moe.experts(dev, &x, &experts, SITU, &mut ws, &mut out)
                })?;
                report_time(&format!("moe_experts_{kind}"), &shape, us, bytes, &extra);
                let us = time_us_back_to_back(dev, samples, reps, || {
                    moe.route(dev, &logits, &bias, &routing, &mut ws)?;
                    moe.experts(dev, &x, &experts, SITU, &mut ws, &mut out)
                })?;
                report_time(&format!("moe_decode_{kind}"), &shape, us, bytes, &extra);
                // Routing and plan alone (the floor: reading the router logits once).
                let us = time_us_back_to_back(dev, samples, reps, || {
                    moe.route(dev, &logits, &bias, &routing, &mut ws)
                })?;
                let logit_bytes = (batch * dims.experts * 4) as f64;
                report_time(
                    &format!("moe_route_plan_{kind}"),
                    &shape,
                    us,
                    logit_bytes,
                    "",
                );
            }
        }
    }
    Ok(())
}
