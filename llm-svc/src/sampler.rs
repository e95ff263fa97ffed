//! What a request asks of its token choices (the contract's [`SamplingParams`], checked at the
//! door by `vlm_proto::sampling`), and how each step's row of the device's sampler
//! ([`vlm_compute::sampling`], the rule; the backend's `sample_rows`) is filled from it. The
//! logits never leave the device: only the picks, and the logprobs a request asked for, come
//! back.

use vlm_compute::sampling::{RowParams, MAX_TOP_LOGPROBS, NO_SLOT};

pub use vlm_proto::sampling::{SamplingParams, MAX_LOGIT_BIAS};

// The contract's limit on `top_logprobs` must fit the device sampler's columns.
const _: () = assert!(vlm_proto::sampling::MAX_TOP_LOGPROBS <= MAX_TOP_LOGPROBS);

/// A generated token's logprob and its alternatives', as a request with `logprobs` gets them.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Of the token that was picked.
    pub logprob: f32,
    /// The most likely tokens and their logprobs, best first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine makes of a request's sampling parameters (the contract's
/// [`SamplingParams`]): the device sampler's row for each step.
pub trait SamplerRow {
    /// Whether the draw needs the sequence's token counts on the device (a penalty is on).
    fn needs_counts(&self) -> bool;

    /// The device sampler's row for choosing token `position` of a sequence whose draws use
    /// `seed`, its counts in `slot` (or [`NO_SLOT`]) and its bias entries from `bias_start`.
    fn row(&self, seed: u64, position: usize, slot: Option<u32>, bias_start: usize) -> RowParams;
}

impl SamplerRow for SamplingParams {
    fn needs_counts(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    fn row(&self, seed: u64, position: usize, slot: Option<u32>, bias_start: usize) -> RowParams {
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
            // Set by the step once the sequence's grammar has given its mask.
            masked: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
