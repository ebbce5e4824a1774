//! Turning logits into the next token: greedy, or temperature with top-k and top-p, seeded.

use crate::error::{EngineError, Result};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
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

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return tessera_kernels::cpu::argmax(logits) as u32;
        }
        let t = self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l / t))
            .collect();
        // Descending by logit, ties by lower id, so filtering is deterministic.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 && cand.len() > self.params.top_k {
            cand.truncate(self.params.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let mut u = self.rng.uniform();
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return cand[i].0;
            }
            u -= p;
        }
        cand[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn rejects_bad_parameters() {
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
