//! MoE routing: sigmoid scores + grouped top-k with a score-correction bias
//! (DeepSeek-V3 / Kimi style), exactly transformers' `KimiLinearTopkRouter`.

use rayon::prelude::*;

use super::simd::sigmoid;

/// Router configuration (from the model config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRouting {
    /// Number of equal expert groups (`n_group`); 1 disables grouping.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`).
    pub topk_group: usize,
    /// Experts chosen per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Divide the chosen weights by their sum (`norm_topk_prob`).
    pub renormalize: bool,
    /// Final multiplier (`routed_scaling_factor`).
    pub scaling: f32,
}

/// Descending by value, NaN last, ties to the lower index: a total order, so
/// the selection is deterministic (torch leaves tie order unspecified).
fn desc(vals: &[f32]) -> impl Fn(&usize, &usize) -> std::cmp::Ordering + '_ {
    move |&a, &b| {
        let (x, y) = (vals[a], vals[b]);
        let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        key(y)
            .partial_cmp(&key(x))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    }
}

/// Routes each token. `logits` [T, experts] are router logits (x·Wgᵀ, f32).
///
/// scores = sigmoid(logits); choice = scores + bias; a group's score is the sum
/// of its top-2 `choice` values; only the `topk_group` best groups stay
/// eligible; the `top_k` experts by `choice` are picked (written in descending
/// `choice` order) and weighted by their `scores` (not `choice`), optionally
/// renormalised by `sum + 1e-20`, then multiplied by `scaling`.
/// `idx`, `weight`: [T, top_k].
pub fn route_sigmoid_grouped(
    logits: &[f32],
    experts: usize,
    bias: &[f32],
    cfg: &MoeRouting,
    idx: &mut [u32],
    weight: &mut [f32],
) {
    assert!(experts > 0, "route: experts must be > 0");
    assert_eq!(logits.len() % experts, 0, "route: logits shape");
    assert_eq!(bias.len(), experts, "route: bias length");
    let n_group = cfg.n_group.max(1);
    assert_eq!(
        experts % n_group,
        0,
        "route: experts not divisible by n_group"
    );
    assert!(cfg.top_k <= experts, "route: top_k > experts");
    let t = logits.len() / experts;
    assert_eq!(idx.len(), t * cfg.top_k, "route: idx shape");
    assert_eq!(weight.len(), t * cfg.top_k, "route: weight shape");
    let k = cfg.top_k;
    if t <= ROUTE_ROWS_PER_TASK {
        route_rows(logits, experts, bias, cfg, idx, weight);
    } else {
        // Rows are independent: spread them over the thread pool (the same per-row code, so
        // the same choices and weights as one thread).
        logits
            .par_chunks(ROUTE_ROWS_PER_TASK * experts)
            .zip(idx.par_chunks_mut(ROUTE_ROWS_PER_TASK * k))
            .zip(weight.par_chunks_mut(ROUTE_ROWS_PER_TASK * k))
            .for_each(|((lg, oi), ow)| route_rows(lg, experts, bias, cfg, oi, ow));
    }
}

/// Rows per task when routing spreads over threads.
const ROUTE_ROWS_PER_TASK: usize = 256;

/// [`route_sigmoid_grouped`] for the rows of `logits`, one after another (shapes checked).
fn route_rows(
    logits: &[f32],
    experts: usize,
    bias: &[f32],
    cfg: &MoeRouting,
    idx: &mut [u32],
    weight: &mut [f32],
) {
    let n_group = cfg.n_group.max(1);
    let gsize = experts / n_group;
    let grouped = n_group > 1 && cfg.topk_group < n_group;

    let mut scores = vec![0.0f32; experts];
    let mut choice = vec![0.0f32; experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    let mut group_score = vec![0.0f32; n_group];
    let mut group_order: Vec<usize> = Vec::with_capacity(n_group);
    for (tok, lg) in logits.chunks_exact(experts).enumerate() {
        for e in 0..experts {
            scores[e] = sigmoid(lg[e]);
            choice[e] = scores[e] + bias[e];
        }
        if grouped {
            for (gi, gs) in group_score.iter_mut().enumerate() {
                let grp = &choice[gi * gsize..(gi + 1) * gsize];
                order.clear();
                order.extend(0..gsize);
                order.sort_by(desc(grp));
                *gs = order.iter().take(2).map(|&e| grp[e]).sum();
            }
            group_order.clear();
            group_order.extend(0..n_group);
            group_order.sort_by(desc(&group_score));
            for &gi in &group_order[cfg.topk_group..] {
                choice[gi * gsize..(gi + 1) * gsize].fill(f32::NEG_INFINITY);
            }
        }
        order.clear();
        order.extend(0..experts);
        order.sort_by(desc(&choice));
        let (oi, ow) = (
            &mut idx[tok * cfg.top_k..(tok + 1) * cfg.top_k],
            &mut weight[tok * cfg.top_k..(tok + 1) * cfg.top_k],
        );
        for (slot, &e) in order[..cfg.top_k].iter().enumerate() {
            oi[slot] = e as u32;
            ow[slot] = scores[e];
        }
        if cfg.renormalize {
            let denom = ow.iter().sum::<f32>() + 1e-20;
            ow.iter_mut().for_each(|w| *w /= denom);
        }
        ow.iter_mut().for_each(|w| *w *= cfg.scaling);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn group_mask_changes_the_answer() {
        // Groups of 2: sums g0=0.96, g1=1.2, g2=1.1, g3=0.95 → keep g1, g2.
        let p = [0.95, 0.01, 0.6, 0.59, 0.55, 0.54, 0.9, 0.05];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let bias = [0.0; 8];
        let mut idx = [0u32; 2];
        let mut w = [0.0f32; 2];
        let grouped = MoeRouting {
            n_group: 4,
            topk_group: 2,
            top_k: 2,
            renormalize: false,
            scaling: 1.0,
        };
        route_sigmoid_grouped(&logits, 8, &bias, &grouped, &mut idx, &mut w);
        assert_eq!(idx, [2, 3]);
        assert!((w[0] - 0.6).abs() < 1e-6 && (w[1] - 0.59).abs() < 1e-6);
        // Without grouping the two best experts win.
        let flat = MoeRouting {
            n_group: 1,
            topk_group: 1,
            ..grouped
        };
        route_sigmoid_grouped(&logits, 8, &bias, &flat, &mut idx, &mut w);
        assert_eq!(idx, [0, 6]);
    }

    #[test]
    fn many_rows_route_as_each_row_alone() {
        // Enough rows to take the threaded path; whole-number logits so many experts tie.
        let (experts, rows) = (16, 3 * ROUTE_ROWS_PER_TASK + 7);
        let logits: Vec<f32> = (0..rows * experts)
            .map(|i| ((i * 7919 + i / 13) % 5) as f32 - 2.0)
            .collect();
        let bias: Vec<f32> = (0..experts).map(|e| (e % 3) as f32 * 0.25).collect();
        let cfg = MoeRouting {
            n_group: 4,
            topk_group: 2,
            top_k: 3,
            renormalize: true,
            scaling: 1.5,
        };
        let (mut idx, mut w) = (vec![0u32; rows * 3], vec![0f32; rows * 3]);
        route_sigmoid_grouped(&logits, experts, &bias, &cfg, &mut idx, &mut w);
        for r in 0..rows {
            let (mut i1, mut w1) = ([0u32; 3], [0f32; 3]);
            let row = &logits[r * experts..(r + 1) * experts];
            route_sigmoid_grouped(row, experts, &bias, &cfg, &mut i1, &mut w1);
            assert_eq!(idx[r * 3..r * 3 + 3], i1, "row {r}");
            assert_eq!(w[r * 3..r * 3 + 3], w1, "row {r}");
        }
    }

    #[test]
    fn bias_steers_choice_but_weights_use_scores() {
        let p = [0.9f32, 0.8, 0.3, 0.2];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let bias = [0.0, 0.0, 1.0, 0.0]; // expert 2's choice = 1.3 (best)
        let cfg = MoeRouting {
            n_group: 1,
            topk_group: 1,
            top_k: 2,
            renormalize: true,
            scaling: 2.5,
        };
        let (mut idx, mut w) = ([0u32; 4], [0.0f32; 4]);
        // Two tokens: the second has bias-free-equivalent logits reversed.
        let mut two = logits.clone();
        two.extend(logits.iter().rev());
        route_sigmoid_grouped(&two, 4, &bias, &cfg, &mut idx, &mut w);
        assert_eq!(idx[..2], [2, 0]);
        let s = 0.3 + 0.9 + 1e-20;
        assert!((w[0] - 2.5 * 0.3 / s).abs() < 1e-6 && (w[1] - 2.5 * 0.9 / s).abs() < 1e-6);
        // Token 2 scores: [0.2, 0.3, 0.8, 0.9]; choice: [0.2, 0.3, 1.8, 0.9].
        assert_eq!(idx[2..], [2, 3]);
        assert!((w[2] + w[3] - 2.5).abs() < 1e-6);
    }

    #[test]
    fn group_score_is_top2_sum_not_max() {
        // g0 = {0.9, 0.1} (sum 1.0), g1 = {0.6, 0.55} (sum 1.15): g1 wins
        // though g0 holds the single best expert.
        let p = [0.9f32, 0.1, 0.6, 0.55];
        let logits: Vec<f32> = p.iter().map(|&p| logit(p)).collect();
        let cfg = MoeRouting {
            n_group: 2,
            topk_group: 1,
            top_k: 1,
            renormalize: false,
            scaling: 1.0,
        };
        let (mut idx, mut w) = ([0u32; 1], [0.0f32; 1]);
        route_sigmoid_grouped(&logits, 4, &[0.0; 4], &cfg, &mut idx, &mut w);
        assert_eq!(idx, [2]);
    }
}
