//! One row of token sampling with an explicit uniform draw: the rule of the engine's sampler
//! (`engine/src/sampler.rs`), kept here as the reference the GPU sampler is checked against.

use super::argmax;

/// The token for `logits` at `temperature` (0 = greedy: [`argmax`]), `top_k` (0 = off) and
/// `top_p` (1 = off), given the uniform draw `u` ∈ [0, 1).
///
/// Candidates are the non-NaN logits divided by the temperature, sorted descending (f32 total
/// order) with ties to the lower id; top-k keeps the first `top_k`; probabilities are
/// `exp(f64(l - max))` normalised; top-p keeps the shortest prefix reaching `top_p`; the token is
/// the first whose cumulative probability exceeds `u`. A row without candidates gives 0.
pub fn sample_row(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, u: f64) -> u32 {
    if temperature == 0.0 {
        return argmax(logits) as u32;
    }
    let t = temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l / t))
        .collect();
    if cand.is_empty() {
        return 0;
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if top_k > 0 && cand.len() > top_k {
        cand.truncate(top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u = u;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i].0;
        }
        u -= p;
    }
    cand[probs.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_one_and_nucleus() {
        assert_eq!(sample_row(&[0.1, 3.0, -1.0, 2.9], 0.0, 0, 1.0, 0.7), 1);
        assert_eq!(sample_row(&[0.1, 3.0, -1.0, 2.9], 1.0, 1, 1.0, 0.99), 1);
        assert_eq!(sample_row(&[0.0, 10.0, 0.0, 0.0], 1.0, 0, 0.5, 0.999), 1);
        // Two equal halves: the draw picks the lower id below 0.5.
        assert_eq!(sample_row(&[1.0, 1.0], 1.0, 0, 1.0, 0.49), 0);
        assert_eq!(sample_row(&[1.0, 1.0], 1.0, 0, 1.0, 0.51), 1);
        assert_eq!(sample_row(&[f32::NAN, f32::NAN], 1.0, 0, 1.0, 0.5), 0);
    }
}
