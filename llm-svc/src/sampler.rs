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

/// Greedy decoding's pick, shared with the backends' on-device argmax reference.
pub use vlm_compute::argmax;

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

    /// Picks a token: temperature, then the `top_k` best, then the smallest best-first set
    /// holding `top_p` of their probability (HF's order of warpers), then a draw. At the 8B
    /// vocabulary (151,936) this must not sort everything: a full sort per token costs
    /// milliseconds, as much as a decode step on a GPU. It drops what can never be drawn,
    /// selects (O(n)) and sorts only the front that the cut needs.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if self.is_greedy() {
            return argmax(logits);
        }
        // Best first: higher logit, then lower id. A total order, so selecting the best k is
        // exactly what a stable sort would put first.
        fn better(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
            b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
        }
        // Tokens more than 30 temperatures below the best weigh under e^-30 (1e-13) of it:
        // even all 151,936 of them together stay below f32's resolution of the total, so they
        // can never be drawn. Leaving them out makes the rest small enough to select and sort.
        let best = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let floor = best - 30.0 * p.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, &l)| l >= floor)
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, better);
            cand.truncate(p.top_k);
        }
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let weight = |c: &(u32, f32)| (c.1 - max).exp();
        if p.top_p < 1.0 {
            let total: f32 = cand.iter().map(weight).sum();
            // Keep tokens while the mass before them is below top_p (at least one). Sort a
            // front of the candidates; if the cut is not inside it, take a larger front.
            let mut front = cand.len().min(64);
            loop {
                if front < cand.len() {
                    cand.select_nth_unstable_by(front - 1, better);
                }
                cand[..front].sort_by(better);
                let mut before = 0.0;
                let cut = cand[..front].iter().position(|c| {
                    let reached = before >= p.top_p;
                    before += weight(c) / total;
                    reached
                });
                if let Some(keep) = cut {
                    cand.truncate(keep.max(1));
                    break;
                }
                if front == cand.len() {
                    break;
                }
                front = (front * 8).min(cand.len());
            }
        } else if p.top_k > 0 {
            cand.sort_by(better);
        }
        // The draw walks the kept tokens best first when they were cut, in id order when all
        // of them were kept (the same distribution, without sorting the whole vocabulary).
        let kept: f32 = cand.iter().map(weight).sum();
        let r = self.rng.random::<f32>() * kept;
        let mut acc = 0.0;
        for c in &cand {
            acc += weight(c);
            if r < acc {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
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

    /// The tokens the reference (sort everything, cut, renormalize) keeps for `p`.
    fn kept_by_full_sort(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
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
        let probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .take_while(|&&x| {
                let before = mass;
                mass += x / total;
                before < p.top_p
            })
            .count()
            .max(1);
        let mut kept: Vec<u32> = cand[..keep].iter().map(|c| c.0).collect();
        kept.sort();
        kept
    }

    #[test]
    fn selection_keeps_what_a_full_sort_keeps_at_the_8b_vocabulary() {
        // Which tokens can come out, seen over many draws, against the reference's set.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let vocab = 151_936;
        // (temperature, top_k, top_p, a peak every n tokens): few peaks (the cut in the first
        // sorted front), ~500 peaks (the front grows), top-k alone, top-k then top-p.
        for (t, k, top_p, every) in [
            (0.7, 0, 0.8, 9973),
            (1.0, 0, 0.5, 300),
            (0.5, 40, 1.0, 9973),
            (1.0, 30, 0.9, 300),
        ] {
            // Peaks over a long flat tail, as real logits are.
            let logits: Vec<f32> = (0..vocab)
                .map(|i| {
                    let noise: f32 = rng.random_range(-1.0..1.0);
                    if i % every == 0 {
                        14.0 + noise
                    } else {
                        noise
                    }
                })
                .collect();
            let p = params(t, k, top_p, 1);
            let allowed: std::collections::HashSet<u32> =
                kept_by_full_sort(&logits, &p).into_iter().collect();
            let mut s = Sampler::new(p.clone()).unwrap();
            let drawn: std::collections::HashSet<u32> =
                (0..100).map(|_| s.sample(&logits)).collect();
            let tag = format!("t {t} k {k} p {top_p} every {every}");
            assert!(
                drawn.is_subset(&allowed),
                "{tag}: drew outside the kept set"
            );
            if allowed.len() <= 12 {
                assert_eq!(drawn, allowed, "{tag}: 100 draws reach every kept token");
            } else {
                assert!(drawn.len() > 12, "{tag}: draws spread over the kept set");
            }
        }
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
