//! What a caller hands the engine and gets back: a [`GenerateRequest`], then, on its
//! [`RequestStream`], each token ([`Event::Token`]) and how it ended ([`Generation`] or an
//! error). The bottom of the crate: the engine, the scheduler and the sequences all use these
//! types, and this module uses none of theirs.

use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use vlm_compute::Embeddings;

use crate::sampler::{SamplingParams, TokenLogprob};
use crate::Error;

/// One image as the vision stage produced it (f16 from a GPU or off the wire, uploaded as it
/// is; f32 from the CPU reference).
#[derive(Clone, Debug)]
pub struct ImageInput {
    /// `[tokens, hidden]`, placed at the image's placeholder tokens.
    pub embeds: Embeddings,
    /// DeepStack features, each `[tokens, hidden]`, added after layers 0, 1, ...
    pub deepstack: Vec<Embeddings>,
    /// Patch grid (t, h, w) before the 2×2 merge.
    pub grid_thw: [usize; 3],
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Prompt token ids with each image's placeholder token repeated once per image token.
    pub prompt: Vec<u32>,
    pub images: Vec<ImageInput>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// Keep generating through eos tokens (benchmarks that need a fixed length).
    pub ignore_eos: bool,
    /// Send every step's logits with its token ([`Event::Token`]). Otherwise greedy requests
    /// pick their token on the device and only its id comes back.
    pub return_logits: bool,
    /// The grammar every generated token keeps to ([`crate::grammar`]).
    pub constraint: Option<vlm_proto::pb::Constraint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos token was generated (it is the last token).
    Eos,
    /// `max_new_tokens` or the context was reached.
    Length,
    /// The caller stopped reading (a stop string matched, the client left).
    Stopped,
}

impl FinishReason {
    /// OpenAI's names: "stop" for eos and stop strings, "length" for the budget.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Eos | FinishReason::Stopped => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A token as [`crate::Engine::generate`] hands it to its callback.
pub struct TokenEvent<'a> {
    pub token: u32,
    /// 0 for the first generated token.
    pub index: usize,
    /// The logits the token was chosen from, `[vocab]`, if the request asked for them.
    pub logits: Option<&'a [f32]>,
    /// Its logprob and the best alternatives', if the request asked for them.
    pub logprob: Option<&'a TokenLogprob>,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens found in the prefix cache (not computed again).
    pub cached_tokens: usize,
    /// From submission to the first token (queueing included).
    pub prefill: Duration,
    /// From the first token to the last.
    pub decode: Duration,
}

/// What a request's stream carries, in order: its tokens, then one `Finished` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Token {
        id: u32,
        logits: Option<Vec<f32>>,
        logprob: Option<TokenLogprob>,
    },
    Finished(Generation),
    Failed(Error),
}

/// A request's tokens as they are generated. Dropping it cancels the request.
pub struct RequestStream {
    rx: UnboundedReceiver<Event>,
}

impl RequestStream {
    /// A stream and the sender the engine sends its events through.
    pub(crate) fn channel() -> (UnboundedSender<Event>, Self) {
        let (tx, rx) = unbounded_channel();
        (tx, Self { rx })
    }

    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// For callers outside an async runtime (the CLI, tests).
    pub fn blocking_recv(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}
