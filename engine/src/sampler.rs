//! Turning logits into the next token: greedy, or temperature with top-k and top-p, seeded;
//! optionally after penalties for tokens already in the completion and a bias per token.

use std::collections::HashMap;

use crate::error::{EngineError, Result};
use crate::rng::Rng;
use crate::serving::TokenLogprobs;

/// The largest presence or frequency penalty, either sign (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;
/// The largest logit bias, either sign (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Whether `v` is a number in [-max, max].
fn within(v: f32, max: f32) -> bool {
    v.is_finite() && v.abs() <= max
}

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    pub seed: u64,
    /// Subtracted from the logit of every token the completion already holds.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the completion already holds it.
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids (ids past the vocabulary are ignored).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Whether the logits are changed before sampling (penalties or a bias): such rows are
    /// sampled on the host, which knows the completion so far.
    pub fn adjusts_logits(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || !self.logit_bias.is_empty()
    }

    /// Applies the penalties for the tokens of `completion` and then the biases to `logits`:
    /// a token held `c` times loses `presence_penalty` (when `c > 0`) and `c ·
    /// frequency_penalty`.
    pub fn adjust(&self, logits: &mut [f32], completion: &[u32]) {
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in completion {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.presence_penalty + c as f32 * self.frequency_penalty;
                }
            }
        }
        for &(t, b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
    }

    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !within(v, MAX_PENALTY) {
                return Err(EngineError::InvalidInput(format!(
                    "{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}"
                )));
            }
        }
        if let Some(&(t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !within(*b, MAX_LOGIT_BIAS))
        {
            return Err(EngineError::InvalidInput(format!(
                "the logit bias of token {t} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {b}"
            )));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(EngineError::InvalidInput(format!(
                "temperature must be a finite number ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidInput(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler { params, rng })
    }

    /// Advances the random stream past `n` samples taken elsewhere (a prefill worker samples a
    /// request's first token; decode continues the same stream).
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature > 0.0 {
            for _ in 0..n {
                self.rng.uniform();
            }
        }
    }

    /// The next token for `logits`: [`tessera_kernels::cpu::sample_row`] with this sampler's
    /// parameters and its next draw (the logits as they are: see [`Self::sample_after`]).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let d = self.draw();
        tessera_kernels::cpu::sample_row(logits, d.temperature, d.top_k, d.top_p, d.uniform)
    }

    /// The next token of a completion that holds `completion` so far: [`Self::sample`] of the
    /// logits after [`SamplingParams::adjust`].
    pub fn sample_after(&mut self, logits: &[f32], completion: &[u32]) -> u32 {
        if !self.params.adjusts_logits() {
            return self.sample(logits);
        }
        let mut adjusted = logits.to_vec();
        self.params.adjust(&mut adjusted, completion);
        self.sample(&adjusted)
    }

    /// Whether this sampler changes the logits before sampling ([`SamplingParams::adjusts_logits`]).
    pub fn adjusts_logits(&self) -> bool {
        self.params.adjusts_logits()
    }

    /// What [`Self::sample`] would apply to the next logits, advancing the random stream the same
    /// way: for a sampler on the device, which applies the same rule.
    pub fn draw(&mut self) -> SampleDraw {
        let p = &self.params;
        SampleDraw {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            uniform: if p.temperature > 0.0 {
                self.rng.uniform()
            } else {
                0.0
            },
        }
    }
}

/// The log-probabilities of `token` and of the `top` most likely tokens under the softmax of
/// `logits` (in f64; a NaN logit counts as impossible).
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let value = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &l| m.max(value(l))) as f64;
    let sum: f64 = logits.iter().map(|&l| (value(l) as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |&l| (value(l) as f64 - lse) as f32)
    };
    let top = top.min(logits.len());
    let by_rank = |a: &u32, b: &u32| {
        value(logits[*b as usize])
            .total_cmp(&value(logits[*a as usize]))
            .then(a.cmp(b))
    };
    let mut order: Vec<u32> = if top == 0 {
        Vec::new()
    } else {
        (0..logits.len() as u32).collect()
    };
    if top > 0 && top < order.len() {
        order.select_nth_unstable_by(top - 1, by_rank);
    }
    order.truncate(top);
    order.sort_unstable_by(by_rank);
    TokenLogprobs {
        token,
        logprob: lp(token),
        top: order.into_iter().map(|t| (t, lp(t))).collect(),
    }
}

/// One row's sampling rule and uniform draw in [0, 1) (0 when greedy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleDraw {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub uniform: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draw_applied_elsewhere_picks_what_sample_picks() {
        // A device sampler gets `draw()` and applies `sample_row`: the same tokens as `sample`,
        // the random stream advanced the same way, greedy included (no draw taken).
        let logits: Vec<f32> = (0..300).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
        for p in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: 5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.3,
                seed: 9,
                ..Default::default()
            },
        ] {
            let (mut a, mut b) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p).unwrap());
            let mut distinct = std::collections::HashSet::new();
            for _ in 0..64 {
                let d = b.draw();
                let want = a.sample(&logits);
                let got = tessera_kernels::cpu::sample_row(
                    &logits,
                    d.temperature,
                    d.top_k,
                    d.top_p,
                    d.uniform,
                );
                assert_eq!(got, want);
                distinct.insert(got);
            }
            assert_eq!(distinct.len() == 1, a.params.temperature == 0.0);
        }
    }

    #[test]
    fn all_nan_logits_give_a_token_not_a_panic() {
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&x| x != a[0]),
            "sampling at temperature 1 should vary"
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~0.99 of the mass: top_p 0.5 must always pick it.
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let logits = [0.0, 10.0, 0.0, 0.0];
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..Default::default()
        };
        let mut s = Sampler::new(p).unwrap();
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 0.25 / 0.75
        let ones = (0..4000).filter(|_| s.sample(&logits) == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }

    #[test]
    fn penalties_and_biases_move_the_logits_of_the_tokens_they_name() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(3, 10.0), (9, -1.0), (99, 5.0)],
            ..Default::default()
        };
        assert!(p.adjusts_logits() && !SamplingParams::default().adjusts_logits());
        let mut logits = vec![0.0f32; 10];
        p.adjust(&mut logits, &[1, 1, 1, 2, 42]);
        // Token 1 three times: 0.5 + 3 · 0.25; token 2 once: 0.5 + 0.25; 42 and 99 are past the
        // vocabulary.
        assert_eq!(
            logits,
            vec![0.0, -1.25, -0.75, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
        );
        // Greedy: the bias makes token 3 the choice; without it, the repeated token 1 stays.
        let raw = [0.0, 5.0, 4.0, 1.0];
        let mut s = Sampler::new(p).unwrap();
        assert_eq!(s.sample_after(&raw, &[1, 1]), 3);
        let no_bias = SamplingParams {
            frequency_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(no_bias).unwrap();
        assert_eq!(s.sample_after(&raw, &[]), 1);
        assert_eq!(s.sample_after(&raw, &[1]), 2, "5 − 2 < 4");
    }

    #[test]
    fn log_probabilities_are_the_log_softmax_and_the_top_tokens_come_in_order() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let lp = token_logprobs(&logits, 4, 3);
        let lse = [1.0f64, 3.0, 3.0, -2.0]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert!((lp.logprob as f64 - (-2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, vec![1, 3, 0], "ties by lower id, the NaN never");
        assert!((lp.top[2].1 as f64 - (1.0 - lse)).abs() < 1e-6);
        let total: f64 = [0u32, 1, 3, 4]
            .iter()
            .map(|&t| (token_logprobs(&logits, t, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(token_logprobs(&logits, 2, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(token_logprobs(&logits, 1, 9).top.len(), 5);
    }

    #[test]
    fn rejects_bad_parameters() {
        for bad in [
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(bad).is_err());
        }
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        })
        .is_err());
    }
}
