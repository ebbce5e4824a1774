use std::time::Instant;
use tessera_kernels::cpu::*;
fn t<F: FnMut()>(name: &str, mut f: F) { f(); let mut best = 1e9f64; for _ in 0..3 { let s = Instant::now(); f(); best = best.min(s.elapsed().as_secs_f64()); } println!("{name}: {:.2} ms", best * 1e3); }
fn main() {
    let (tt, h, dk, dv) = (1024usize, 32usize, 128usize, 128usize);
    let mk = |n: usize, s: f32| (0..n).map(|i| (((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5) * s).collect::<Vec<f32>>();
    let mut q = mk(tt*h*dk, 1.0); let mut k = mk(tt*h*dk, 1.0); l2_normalize(&mut q, dk, 1e-6); l2_normalize(&mut k, dk, 1e-6);
    let v = mk(tt*h*dv, 1.0); let g: Vec<f32> = mk(tt*h*dk, 1.0).iter().map(|x| -x.abs() * 0.1).collect(); let beta: Vec<f32> = mk(tt*h, 1.0).iter().map(|x| x.abs()).collect();
    let mut st = vec![0.0; h*dk*dv]; let mut out = vec![0.0; tt*h*dv];
    t("kda_chunked T=1024 h=32", || kda_chunked(&q,&k,&v,&g,&beta,h,dk,dv,0.088,64,&mut st,&mut out));
    t("kda_recurrent T=1024 h=32", || kda_recurrent(&q,&k,&v,&g,&beta,h,dk,dv,0.088,&mut st,&mut out));
    t("kda_recurrent T=1 h=32", || kda_recurrent(&q[..h*dk],&k[..h*dk],&v[..h*dv],&g[..h*dk],&beta[..h],h,dk,dv,0.088,&mut st,&mut out[..h*dv]));
    let (dq, dvv) = (192usize, 128usize);
    let qa = mk(tt*h*dq, 1.0); let ka = mk(tt*h*dq, 1.0); let va = mk(tt*h*dvv, 1.0); let mut oa = vec![0.0; tt*h*dvv];
    t("attention_causal T=S=1024 h=32", || attention_causal(&qa,&ka,&va,tt,tt,h,dq,dvv,0,0.07,&mut oa));
    t("attention_causal decode S=1024", || attention_causal(&qa[..h*dq],&ka,&va,1,tt,h,dq,dvv,tt-1,0.07,&mut oa[..h*dvv]));
    let (rank, dpe) = (512usize, 64usize);
    let ql = mk(tt*h*rank, 1.0); let qp = mk(tt*h*dpe, 1.0); let ckv = mk(tt*rank, 1.0); let kpe = mk(tt*dpe, 1.0); let mut ol = vec![0.0; tt*h*rank];
    t("mla prefill T=S=1024 h=32", || mla_absorbed_attention(&ql,&qp,&ckv,&kpe,tt,tt,h,rank,dpe,0,0.07,&mut ol));
    t("mla decode S=1024", || mla_absorbed_attention(&ql[..h*rank],&qp[..h*dpe],&ckv,&kpe,1,tt,h,rank,dpe,tt-1,0.07,&mut ol[..h*rank]));
    let c = 3*4096; let x = mk(tt*c, 1.0); let w = mk(c*4, 1.0); let mut s = vec![0.0; c*3]; let mut o = vec![0.0; tt*c];
    t("short_conv T=1024 C=12288", || short_conv_silu(&x,c,&w,4,&mut s,&mut o));
    t("short_conv T=1 C=12288", || short_conv_silu(&x[..c],c,&w,4,&mut s,&mut o[..c]));
    let a = mk(64*128, 1.0); let b = mk(128*128, 1.0); let mut mo = vec![0.0; 64*128];
    t("matmul 64x128x128 x1000", || for _ in 0..1000 { matmul(&a,64,128,&b,128,&mut mo) });
    let mut xs = mk(tt*2304, 1.0); let wn = mk(2304, 1.0); let mut on = vec![0.0; tt*2304];
    t("rms_norm 1024x2304", || rms_norm(&xs,2304,&wn,1e-6,&mut on));
    t("silu 1024x2304", || silu_inplace(&mut xs));
    let mut sm = mk(4096, 1.0);
    t("sigmoid 4096 x10000", || for _ in 0..10000 { sigmoid_inplace(&mut sm) });
    let mut sm2 = mk(4096, 1.0);
    t("softmax 4096 x10000", || for _ in 0..10000 { softmax_inplace(&mut sm2) });
}
#[allow(dead_code)]
fn exp_check() {}
