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

    /// The next token for `logits`: [`tessera_kernels::cpu::sample_row`] with this sampler's
    /// parameters and its next draw.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let d = self.draw();
        tessera_kernels::cpu::sample_row(logits, d.temperature, d.top_k, d.top_p, d.uniform)
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
