//! MoonViT: patch embedding (a stride-`patch` convolution, run as one projection per patch), a
//! learned 2-D position table resampled bicubically to the image's grid, pre-norm blocks with
//! 2-D rotary full attention over the image's patches and a GELU MLP, and a final norm.
//!
//! `wqkv` is read in the original (Moonshot) layout, which is also what `save_pretrained` writes
//! back: q, k, v stacked; inside each head, rotary pairs are adjacent dimensions `(2j, 2j+1)`,
//! pair `2i` rotated by the column (x) position and pair `2i+1` by the row (y) position, both at
//! frequency `theta^(-4i/head_dim)`.

use tessera_kernels::cpu;

use super::ops::{Affine, Gelu, NormKind, VisionNorm};
use crate::checkpoint::Checkpoint;
use crate::config::VisionConfig;
use crate::error::{EngineError, Result};

/// LayerNorm / RMSNorm epsilon inside the tower (fixed in both reference implementations).
const NORM_EPS: f32 = 1e-5;
/// Query rows per attention block: bounds the score buffer to `QUERY_BLOCK × patches`.
const QUERY_BLOCK: usize = 256;

struct Block {
    norm0: VisionNorm,
    norm1: VisionNorm,
    wqkv: Affine,
    wo: Affine,
    fc0: Affine,
    fc1: Affine,
}

pub(crate) struct Tower {
    patch: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    /// `[rows, cols, hidden]` learned positions.
    pos_emb: Vec<f32>,
    pos_grid: [usize; 2],
    patch_embed: Affine,
    blocks: Vec<Block>,
    final_norm: VisionNorm,
    act: Gelu,
    rope_theta: f32,
}

impl Tower {
    pub fn load(ck: &Checkpoint, cfg: &VisionConfig) -> Result<Self> {
        let (d, q, inter, p) = (
            cfg.hidden_size,
            cfg.qkv_hidden_size,
            cfg.intermediate_size,
            cfg.patch_size,
        );
        let bad = |message: String| EngineError::Config {
            path: "config.json".into(),
            message,
        };
        let norm_kind = match cfg.norm_type.as_str() {
            "layernorm" | "layer_norm" => NormKind::Layer,
            "rmsnorm" | "rms_norm" => NormKind::Rms,
            other => {
                return Err(bad(format!(
                    "vision_config.norm_type `{other}` is not supported"
                )))
            }
        };
        let act = Gelu::from_name(&cfg.activation).ok_or_else(|| {
            bad(format!(
                "vision_config activation `{}` is not supported",
                cfg.activation
            ))
        })?;
        let head_dim = cfg.head_dim();
        if !head_dim.is_multiple_of(4) {
            return Err(bad(format!(
                "vision head_dim {head_dim} must be a multiple of 4 (2-D rotary pairs)"
            )));
        }
        let patch_names = [
            "vision_tower.patch_embed.proj.weight",
            "vision_tower.encoder.patch_embed.proj.weight",
        ];
        let patch_w = ck.resolve(&patch_names)?;
        let patch_base = patch_w.strip_suffix(".weight").unwrap();
        let patch_embed = Affine::load_shaped(ck, patch_base, &[d, 3, p, p], d, 3 * p * p)?;
        let [ph, pw, _] = cfg.pos_emb;
        let pos_emb = ck.f32("vision_tower.patch_embed.pos_emb.weight", &[ph, pw, d])?;
        let norm = |name: &str| VisionNorm::load(ck, &[name], norm_kind, d, NORM_EPS);
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let b = format!("vision_tower.encoder.blocks.{i}.");
            blocks.push(Block {
                norm0: norm(&format!("{b}norm0"))?,
                norm1: norm(&format!("{b}norm1"))?,
                wqkv: Affine::load(ck, &[&format!("{b}wqkv")], 3 * q, d)?,
                wo: Affine::load(ck, &[&format!("{b}wo")], d, q)?,
                fc0: Affine::load(ck, &[&format!("{b}mlp.fc0")], inter, d)?,
                fc1: Affine::load(ck, &[&format!("{b}mlp.fc1")], d, inter)?,
            });
        }
        Ok(Tower {
            patch: p,
            hidden: d,
            heads: cfg.num_heads,
            head_dim,
            pos_emb,
            pos_grid: [ph, pw],
            patch_embed,
            blocks,
            final_norm: norm("vision_tower.encoder.final_layernorm")?,
            act,
            rope_theta: cfg.rope_theta,
        })
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn parameter_count(&self) -> usize {
        self.pos_emb.len()
            + self.patch_embed.parameter_count()
            + self.final_norm.parameter_count()
            + self
                .blocks
                .iter()
                .map(|b| {
                    b.norm0.parameter_count()
                        + b.norm1.parameter_count()
                        + b.wqkv.parameter_count()
                        + b.wo.parameter_count()
                        + b.fc0.parameter_count()
                        + b.fc1.parameter_count()
                })
                .sum::<usize>()
    }

    /// One image of `rows × cols` patches (`pixels`: `[rows·cols, 3, patch, patch]`) to its
    /// final hidden states `[rows·cols, hidden]`, raster order.
    pub fn forward(&self, pixels: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let n = rows * cols;
        let d = self.hidden;
        assert_eq!(pixels.len(), n * 3 * self.patch * self.patch);
        let mut h = self.patch_embed.forward(pixels, n);
        let pos = self.positions(rows, cols);
        for (x, p) in h.iter_mut().zip(&pos) {
            *x += p;
        }
        let (cos, sin) = self.rotary(rows, cols);
        for b in &self.blocks {
            let xn = b.norm0.forward(&h);
            let qkv = b.wqkv.forward(&xn, n);
            let attn = self.attention(&qkv, n, &cos, &sin);
            let o = b.wo.forward(&attn, n);
            add_into(&mut h, &o);
            let xn = b.norm1.forward(&h);
            let mut f = b.fc0.forward(&xn, n);
            self.act.apply(&mut f);
            let o = b.fc1.forward(&f, n);
            add_into(&mut h, &o);
        }
        debug_assert_eq!(h.len(), n * d);
        self.final_norm.forward(&h)
    }

    /// The position table resampled to `rows × cols` (PyTorch bicubic, a = -0.75,
    /// align_corners = false, edge taps clamped), `[rows·cols, hidden]`.
    fn positions(&self, rows: usize, cols: usize) -> Vec<f32> {
        let d = self.hidden;
        let [ph, pw] = self.pos_grid;
        let ty = axis_taps(rows, ph);
        let tx = axis_taps(cols, pw);
        let mut out = vec![0.0f32; rows * cols * d];
        for (r, (ys, wy)) in ty.iter().enumerate() {
            for (c, (xs, wx)) in tx.iter().enumerate() {
                let o = &mut out[(r * cols + c) * d..(r * cols + c + 1) * d];
                for (yi, wyi) in ys.iter().zip(wy) {
                    for (xi, wxi) in xs.iter().zip(wx) {
                        let w = wyi * wxi;
                        let src = &self.pos_emb[(yi * pw + xi) * d..(yi * pw + xi + 1) * d];
                        for (a, s) in o.iter_mut().zip(src) {
                            *a += w * s;
                        }
                    }
                }
            }
        }
        out
    }

    /// Per patch and rotary pair: `cos` and `sin` of its angle, `[n, head_dim/2]`.
    fn rotary(&self, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
        let pairs = self.head_dim / 2;
        let spatial = (self.head_dim / 2) as f32;
        let inv: Vec<f32> = (0..pairs / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / spatial))
            .collect();
        let n = rows * cols;
        let (mut cos, mut sin) = (vec![0.0; n * pairs], vec![0.0; n * pairs]);
        for r in 0..rows {
            for c in 0..cols {
                let idx = r * cols + c;
                for j in 0..pairs {
                    let pos = if j % 2 == 0 { c } else { r } as f32;
                    let a = pos * inv[j / 2];
                    cos[idx * pairs + j] = a.cos();
                    sin[idx * pairs + j] = a.sin();
                }
            }
        }
        (cos, sin)
    }

    /// Full (non-causal) multi-head attention over one image's patches; `qkv` is `[n, 3·q]`.
    fn attention(&self, qkv: &[f32], n: usize, cos: &[f32], sin: &[f32]) -> Vec<f32> {
        let (hd, heads) = (self.head_dim, self.heads);
        let qw = hd * heads;
        let pairs = hd / 2;
        let scale = (hd as f32).powf(-0.5);
        let rotate = |src: &[f32], idx: usize, dst: &mut [f32]| {
            for j in 0..pairs {
                let (a, b) = (src[2 * j], src[2 * j + 1]);
                let (c, s) = (cos[idx * pairs + j], sin[idx * pairs + j]);
                dst[2 * j] = a * c - b * s;
                dst[2 * j + 1] = b * c + a * s;
            }
        };
        let mut out = vec![0.0f32; n * qw];
        let mut q = vec![0.0f32; n * hd];
        let mut kt = vec![0.0f32; hd * n];
        let mut v = vec![0.0f32; n * hd];
        let mut krow = vec![0.0f32; hd];
        for h in 0..heads {
            for i in 0..n {
                let row = &qkv[i * 3 * qw..(i + 1) * 3 * qw];
                rotate(&row[h * hd..(h + 1) * hd], i, &mut q[i * hd..(i + 1) * hd]);
                rotate(&row[qw + h * hd..qw + (h + 1) * hd], i, &mut krow);
                for (e, &kv) in krow.iter().enumerate() {
                    kt[e * n + i] = kv;
                }
                v[i * hd..(i + 1) * hd]
                    .copy_from_slice(&row[2 * qw + h * hd..2 * qw + (h + 1) * hd]);
            }
            for start in (0..n).step_by(QUERY_BLOCK) {
                let m = QUERY_BLOCK.min(n - start);
                let mut scores = vec![0.0f32; m * n];
                cpu::matmul(&q[start * hd..(start + m) * hd], m, hd, &kt, n, &mut scores);
                for row in scores.chunks_exact_mut(n) {
                    let mut max = f32::NEG_INFINITY;
                    for s in row.iter_mut() {
                        *s *= scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0.0f32;
                    for s in row.iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    for s in row.iter_mut() {
                        *s /= sum;
                    }
                }
                let mut o = vec![0.0f32; m * hd];
                cpu::matmul(&scores, m, n, &v, hd, &mut o);
                for (i, orow) in o.chunks_exact(hd).enumerate() {
                    let dst = (start + i) * qw + h * hd;
                    out[dst..dst + hd].copy_from_slice(orow);
                }
            }
        }
        out
    }
}

/// Source taps and weights of each output index on one axis: PyTorch's bicubic
/// `F.interpolate(align_corners=False)` (Keys kernel, a = -0.75, taps clamped to the edge).
fn axis_taps(out: usize, side: usize) -> Vec<([usize; 4], [f32; 4])> {
    const A: f32 = -0.75;
    (0..out)
        .map(|i| {
            let src = (i as f32 + 0.5) * side as f32 / out as f32 - 0.5;
            let fl = src.floor();
            let mut idx = [0usize; 4];
            let mut w = [0.0f32; 4];
            for (k, off) in (-1i64..3).enumerate() {
                idx[k] = (fl as i64 + off).clamp(0, side as i64 - 1) as usize;
                let t = (src - fl - off as f32).abs();
                w[k] = if t <= 1.0 {
                    ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0
                } else {
                    ((A * t - 5.0 * A) * t + 8.0 * A) * t - 4.0 * A
                };
            }
            (idx, w)
        })
        .collect()
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
