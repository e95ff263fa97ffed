//! Choosing the next token from logits: greedy at temperature 0, otherwise temperature, then
//! top-k, then top-p (nucleus), then a draw from a seeded ChaCha8 stream, so a request with a
//! seed is reproducible. The order and the nucleus rule follow HF's logits warpers.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy; otherwise logits are divided by it. At most 100.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches this; 1 keeps all. In (0, 1].
    pub top_p: f32,
    /// Seed of the sampling stream; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every field; the message names the field, the rule and the value given.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || !(0.0..=100.0).contains(&self.temperature) {
            return Err(Error::InvalidParameter(format!(
                "`temperature` must be between 0 and 100, got {}",
                self.temperature
            )));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(Error::InvalidParameter(format!(
                "`top_p` must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// Index of the largest value; the first one on ties, as `torch.argmax`.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    /// Whether this always picks the most likely token (then the backend can, on the device).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if self.is_greedy() {
            return argmax(logits);
        }
        // Candidates sorted by logit, best first (stable: ties keep the lower id first).
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            // Keep tokens until the mass *before* them reaches top_p (at least one).
            let mut mass = 0.0;
            let keep = probs
                .iter()
                .take_while(|&&x| {
                    let before = mass;
                    mass += x;
                    before < p.top_p
                })
                .count()
                .max(1);
            probs.truncate(keep);
            let total: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= total);
        }
        let mut r: f32 = self.rng.random();
        for (i, &x) in probs.iter().enumerate() {
            if r < x {
                return cand[i].0;
            }
            r -= x;
        }
        cand[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let mut s = Sampler::new(params(1.0, 2, 1.0, 7)).unwrap();
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits), 0 | 1));
        }
        // Token 0 alone holds > 30% of the mass, so top_p = 0.3 keeps only it.
        let mut s = Sampler::new(params(1.0, 0, 0.3, 7)).unwrap();
        for _ in 0..200 {
            assert_eq!(s.sample(&logits), 0);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_temperature_spreads_choices() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
        let distinct: std::collections::HashSet<_> = run(3).into_iter().collect();
        assert!(
            distinct.len() > 10,
            "temperature 1 over flat logits picks many tokens"
        );
    }

    #[test]
    fn bad_values_are_rejected_with_the_field_name() {
        for (p, field) in [
            (params(-1.0, 0, 1.0, 0), "temperature"),
            (params(f32::NAN, 0, 1.0, 0), "temperature"),
            (params(1.0, 0, 0.0, 0), "top_p"),
            (params(1.0, 0, 1.5, 0), "top_p"),
        ] {
            let err = Sampler::new(p).err().unwrap().to_string();
            assert!(err.contains(field), "{err}");
        }
    }
}
