//! What a request asks of its token choices, checked at the door, and how each step's row of
//! the device's sampler ([`vlm_compute::sampling`], the rule; the backend's `sample_rows`)
//! is filled from it. The logits never leave the device: only the picks, and the logprobs a
//! request asked for, come back.

use vlm_compute::sampling::{RowParams, MAX_TOP_LOGPROBS, NO_SLOT};

use crate::{Error, Result};

/// Most `logit_bias` entries a request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

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

/// A generated token's logprob and its alternatives', as a request with `logprobs` gets them.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Of the token that was picked.
    pub logprob: f32,
    /// The most likely tokens and their logprobs, best first.
    pub top: Vec<(u32, f32)>,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every field; the message names the field, the rule and the value given. Token
    /// ids of `logit_bias` are checked against the vocabulary by the engine.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidParameter(msg));
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

    /// Whether the draw needs the sequence's token counts on the device (a penalty is on).
    pub fn needs_counts(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// The device sampler's row for choosing token `position` of a sequence whose draws use
    /// `seed`, its counts in `slot` (or [`NO_SLOT`]) and its bias entries from `bias_start`.
    pub fn row(
        &self,
        seed: u64,
        position: usize,
        slot: Option<u32>,
        bias_start: usize,
    ) -> RowParams {
        // Below vLLM's 1e-5 a temperature is greedy (dividing by it would overflow).
        let temperature = if self.temperature < 1e-5 {
            0.0
        } else {
            self.temperature
        };
        RowParams {
            temperature,
            top_k: self.top_k as u32,
            top_p: self.top_p,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed,
            position: position as u32,
            stream: self.choice,
            slot: slot.unwrap_or(NO_SLOT),
            logprobs: self.logprobs.map_or(0, |n| 1 + n as u32),
            bias_start: bias_start as u32,
            bias_len: self.logit_bias.len() as u32,
        }
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
    fn rows_carry_every_setting() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            presence_penalty: 1.5,
            logit_bias: vec![(5, 1.0), (9, -2.0)],
            logprobs: Some(3),
            choice: 2,
            ..Default::default()
        };
        let row = p.row(42, 17, Some(3), 6);
        assert_eq!((row.seed, row.position, row.slot), (42, 17, 3));
        assert_eq!(row.stream, 2);
        assert_eq!((row.bias_start, row.bias_len, row.logprobs), (6, 2, 4));
        assert!(p.needs_counts());
        let tiny = SamplingParams {
            temperature: 1e-7,
            ..Default::default()
        };
        assert!(tiny.row(0, 0, None, 0).is_plain_greedy());
    }
}
