//! A request's sampling parameters, as both sides of the `LlmService.Generate` hop read them:
//! the gateway checks a request with [`SamplingParams::validate`] before any upstream call and
//! sends it with [`to_pb`]; llm-svc reads it back with [`from_pb`] and checks it again. The
//! limits ([`MAX_LOGIT_BIAS`], [`MAX_TOP_LOGPROBS`]) and the messages are defined here once.
//! What the engine makes of them (the device sampler's rows) is llm-svc's.

use crate::pb;

/// Most `logit_bias` entries a request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Most alternatives a request may ask to see per token (`top_logprobs`). llm-svc's device
/// sampler keeps this many columns (`vlm_compute::sampling::MAX_TOP_LOGPROBS`, asserted there).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampling field outside its rule; the message names the field, the rule and the value.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("invalid parameter: {0}")]
pub struct InvalidSampling(pub String);

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy; otherwise logits are divided by it. At most 100.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches this; 1 keeps all. In (0, 1].
    pub top_p: f32,
    /// Keep tokens with at least this fraction of the best token's probability; 0 keeps all.
    pub min_p: f32,
    /// OpenAI's: subtracted once from the logit of every token generated so far. In [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per time a token was generated. In [-2, 2].
    pub frequency_penalty: f32,
    /// HF's (as vLLM): a token seen in the prompt or the output has its positive logit divided
    /// by it, its negative logit multiplied. 1 is off; in (0, 10].
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens before the penalties; each in [-100, 100], ids
    /// distinct and in the vocabulary.
    pub logit_bias: Vec<(u32, f32)>,
    /// `Some(n)`: each token comes with its logprob and the `n` (at most 20) most likely
    /// tokens' (raw: before bias, penalties and temperature).
    pub logprobs: Option<usize>,
    /// Seed of the draws; `None` draws one from the OS. A seeded request gives the same tokens
    /// alone or in any batch.
    pub seed: Option<u64>,
    /// Which of a request's choices (`n` > 1) this sequence is: the draws' Philox stream, so
    /// choices with one seed draw differently. Choice 0 draws as a request of one choice.
    pub choice: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
            seed: None,
            choice: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every field; the message names the field, the rule and the value given. Token
    /// ids of `logit_bias` are checked against the vocabulary by whoever knows it (the gateway
    /// when it has read the checkpoint, the engine always).
    pub fn validate(&self) -> Result<(), InvalidSampling> {
        let bad = |msg: String| Err(InvalidSampling(msg));
        let within = |v: f32, lo: f32, hi: f32| v.is_finite() && (lo..=hi).contains(&v);
        if !within(self.temperature, 0.0, 100.0) {
            return bad(format!(
                "`temperature` must be between 0 and 100, got {}",
                self.temperature
            ));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad(format!("`top_p` must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k > u32::MAX as usize {
            return bad(format!("`top_k` must fit in 32 bits, got {}", self.top_k));
        }
        if !within(self.min_p, 0.0, 1.0) {
            return bad(format!("`min_p` must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !within(v, -2.0, 2.0) {
                return bad(format!("`{name}` must be in [-2, 2], got {v}"));
            }
        }
        if !within(self.repetition_penalty, 0.0, 10.0) || self.repetition_penalty == 0.0 {
            return bad(format!(
                "`repetition_penalty` must be in (0, 10], got {}",
                self.repetition_penalty
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad(format!(
                "`logit_bias` may have at most {MAX_LOGIT_BIAS} entries, got {}",
                self.logit_bias.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for &(id, b) in &self.logit_bias {
            if !within(b, -100.0, 100.0) {
                return bad(format!(
                    "`logit_bias` values must be in [-100, 100], got {b} for token {id}"
                ));
            }
            if !seen.insert(id) {
                return bad(format!("`logit_bias` names token {id} twice"));
            }
        }
        if let Some(n) = self.logprobs {
            if n > MAX_TOP_LOGPROBS {
                return bad(format!(
                    "`top_logprobs` must be at most {MAX_TOP_LOGPROBS}, got {n}"
                ));
            }
        }
        Ok(())
    }
}

/// The wire's sampling fields as llm-svc reads them; [`SamplingParams::validate`] checks them.
/// Zeros that proto3 cannot tell from unset mean off (`top_p` 0 is 1); `repetition_penalty`
/// is optional on the wire because its off value is 1.
pub fn from_pb(s: pb::SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        logit_bias: s.logit_bias.into_iter().collect(),
        logprobs: s.top_logprobs.map(|n| n as usize),
        seed: s.seed,
        choice: s.choice,
    }
}

/// The sampling fields as the wire carries them to llm-svc ([`from_pb`] reads them back).
pub fn to_pb(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        seed: s.seed,
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: Some(s.repetition_penalty),
        logit_bias: s.logit_bias.iter().copied().collect(),
        top_logprobs: s.logprobs.map(|n| n as u32),
        choice: s.choice,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_rejected_with_the_field_name() {
        let p = SamplingParams::default;
        for (params, field) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..p()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..p()
                },
                "temperature",
            ),
            (SamplingParams { top_p: 0.0, ..p() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..p() }, "top_p"),
            (SamplingParams { min_p: 1.5, ..p() }, "min_p"),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..p()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..p()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..p()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, 101.0)],
                    ..p()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    logit_bias: vec![(3, 1.0), (3, 2.0)],
                    ..p()
                },
                "logit_bias",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..p()
                },
                "top_logprobs",
            ),
        ] {
            let err = params.validate().err().unwrap().to_string();
            assert!(err.contains(field), "{err}");
        }
        assert!(p().validate().is_ok());
    }

    #[test]
    fn every_sampling_field_crosses_the_wire_and_unset_ones_are_off() {
        let wire = pb::SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            seed: Some(9),
            min_p: 0.05,
            presence_penalty: 1.5,
            frequency_penalty: -0.5,
            repetition_penalty: Some(1.1),
            logit_bias: [(7, -100.0), (3, 2.5)].into(),
            top_logprobs: Some(0),
            choice: 3,
        };
        let want = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.05,
            presence_penalty: 1.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.1,
            logit_bias: vec![(3, 2.5), (7, -100.0)],
            logprobs: Some(0),
            seed: Some(9),
            choice: 3,
        };
        assert_eq!(from_pb(wire), want);
        assert_eq!(
            from_pb(pb::SamplingParams::default()),
            SamplingParams::default()
        );
    }

    #[test]
    fn every_sampling_field_reaches_llm_svc_as_it_reads_them() {
        let s = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.05,
            presence_penalty: 1.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.1,
            logit_bias: vec![(3, 2.5), (7, -100.0)],
            logprobs: Some(5),
            seed: Some(9),
            choice: 2,
        };
        let greedy = SamplingParams::default();
        for p in [s, greedy] {
            assert_eq!(from_pb(to_pb(&p)), p);
        }
    }
}
