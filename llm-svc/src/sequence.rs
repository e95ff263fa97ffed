//! One request inside the engine: its tokens (prompt, then what it has generated), where its
//! images sit, how far its keys and values are computed, the cache blocks holding them, its
//! sampling settings, and the channel its tokens go back through.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use vlm_compute::Embeddings;

use crate::grammar::SequenceGrammar;
use crate::kv_cache::{block_hash, BlockHash};
use crate::mrope::PromptPositions;
use crate::request::{Event, FinishReason};
use crate::sampler::{SamplingParams, TokenLogprob};

/// A step's pick for one sequence, as the step brought it back.
pub struct Pick {
    pub token: u32,
    /// The logits it was picked from, if the request asked for them.
    pub logits: Option<Vec<f32>>,
    /// Its logprob and the best alternatives', if the request asked for them.
    pub logprob: Option<TokenLogprob>,
}

/// An image's embeddings and where its tokens are in the prompt.
pub struct PlacedImage {
    /// First prompt index of its tokens, and how many.
    pub start: usize,
    pub len: usize,
    /// `[len, hidden]`, and one `[len, hidden]` per DeepStack layer.
    pub embeds: Embeddings,
    pub deepstack: Vec<Embeddings>,
    /// Identity of the embeddings (a hash of their bytes and grid), for the prefix cache.
    pub hash: BlockHash,
}

/// What a sequence asked for, fixed at submission.
pub struct SequenceLimits {
    pub max_new_tokens: usize,
    /// Most tokens (prompt + generated) the sequence may hold.
    pub max_len: usize,
    pub ignore_eos: bool,
    pub return_logits: bool,
    pub deadline: Option<Instant>,
}

pub struct Sequence {
    pub id: u64,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub positions: PromptPositions,
    pub images: Vec<PlacedImage>,
    /// How its tokens are chosen, and the seed of its draws (the request's, or one from the
    /// OS).
    pub sampling: SamplingParams,
    pub seed: u64,
    /// The grammar its tokens keep to, if it has one: a pool thread computes its mask
    /// (shared with it, hence the `Arc`) and each pick advances it.
    pub grammar: Option<std::sync::Arc<SequenceGrammar>>,
    pub limits: SequenceLimits,
    /// Cache blocks holding this sequence's keys and values, in order.
    pub blocks: Vec<u32>,
    /// Tokens whose keys and values are in `blocks`.
    pub computed: usize,
    /// Leading blocks registered in the prefix cache.
    pub registered: usize,
    /// Hashes of the full blocks so far (a chain: each covers the one before).
    pub hashes: Vec<BlockHash>,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    pub first_token: Option<Instant>,
    /// Prompt tokens found in the prefix cache when it was first admitted.
    pub cached_tokens: Option<usize>,
    /// Times it gave its blocks back to let others run (and recomputed them later).
    pub preemptions: usize,
    /// The request's span (`llm.generate`), and the phase under way in it: `prefill` until
    /// the first token, then `decode`.
    pub span: tracing::Span,
    pub phase: Option<tracing::Span>,
}

impl Sequence {
    /// A request as it enters the engine: nothing computed, no blocks, its prefill phase
    /// opened under `span`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        prompt: Vec<u32>,
        positions: PromptPositions,
        images: Vec<PlacedImage>,
        (sampling, seed): (SamplingParams, u64),
        limits: SequenceLimits,
        events: UnboundedSender<Event>,
        span: tracing::Span,
    ) -> Self {
        let prompt_len = prompt.len();
        let prefill = tracing::info_span!(
            parent: &span,
            "prefill",
            tokens = prompt_len,
            cached_tokens = tracing::field::Empty
        );
        Self {
            id,
            tokens: prompt,
            prompt_len,
            positions,
            images,
            sampling,
            seed,
            grammar: None,
            limits,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            hashes: Vec::new(),
            events,
            arrived: Instant::now(),
            first_token: None,
            cached_tokens: None,
            preemptions: 0,
            span,
            phase: Some(prefill),
        }
    }

    /// M-RoPE position of token `i`: the prompt's own, then `i + delta` on all three streams.
    pub fn position(&self, i: usize) -> [u32; 3] {
        if i < self.prompt_len {
            self.positions.positions[i]
        } else {
            [(i as i64 + self.positions.delta) as u32; 3]
        }
    }

    /// Appends a generated token and sends it to the caller (unless it broke the sequence's
    /// grammar: the request then fails without it). The first one ends the prefill phase of
    /// the request's trace and opens its decode phase.
    pub fn push_token(&mut self, pick: Pick) {
        if self.first_token.is_none() {
            self.first_token = Some(std::time::Instant::now());
            if let Some(prefill) = self.phase.take() {
                prefill.record("cached_tokens", self.cached_tokens.unwrap_or(0));
            }
            self.phase = Some(tracing::info_span!(
                parent: &self.span,
                "decode",
                tokens = tracing::field::Empty,
                tokens_per_s = tracing::field::Empty
            ));
        }
        self.tokens.push(pick.token);
        if let Some(g) = &self.grammar {
            let mut g = g.lock();
            g.accept(pick.token);
            if g.failure().is_some() {
                return;
            }
        }
        let _ = self.events.send(Event::Token {
            id: pick.token,
            logits: pick.logits,
            logprob: pick.logprob,
        });
    }

    /// Why the sequence ends after its last token, if it does: an eos token (unless it
    /// generates through them), a grammar that is complete, its token budget, or the context.
    pub fn finish_reason(&mut self, eos: &[u32]) -> Option<FinishReason> {
        let last = *self.tokens.last()?;
        let complete = self
            .grammar
            .as_ref()
            .is_some_and(|g| g.lock().is_complete());
        if (!self.limits.ignore_eos && eos.contains(&last)) || complete {
            Some(FinishReason::Eos)
        } else if self.generated() >= self.limits.max_new_tokens
            || self.tokens.len() > self.limits.max_len
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose keys and values are still to compute (1 while decoding).
    pub fn uncomputed(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Why its grammar cannot go on, if it has one that cannot (the request then fails); not
    /// known yet while its mask is being computed.
    pub fn grammar_failure(&self) -> Option<String> {
        self.grammar.as_ref()?.failure()
    }

    /// Whether the client has gone (its stream dropped).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// Identities of the images with tokens in `range` (prompt indices).
    fn images_in(&self, range: std::ops::Range<usize>) -> Vec<BlockHash> {
        self.images
            .iter()
            .filter(|img| img.start < range.end && range.start < img.start + img.len)
            .map(|img| img.hash)
            .collect()
    }

    /// Extends `hashes` over every full block of the known tokens.
    pub fn hash_full_blocks(&mut self, block_size: usize) {
        let full = self.tokens.len() / block_size;
        while self.hashes.len() < full {
            let b = self.hashes.len();
            let range = b * block_size..(b + 1) * block_size;
            let images = self.images_in(range.clone());
            let prev = self.hashes.last().copied();
            self.hashes
                .push(block_hash(prev, &self.tokens[range], &images));
        }
    }

    /// The images with tokens in `range` (token indices), each with the rows of it there
    /// (rows of the image; its token `start + r` is row `r`).
    pub fn image_parts(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (&PlacedImage, std::ops::Range<usize>)> {
        self.images.iter().filter_map(move |img| {
            let from = range.start.max(img.start);
            let to = range.end.min(img.start + img.len);
            (from < to).then(|| (img, from - img.start..to - img.start))
        })
    }
}

/// An image's identity for the prefix cache: its embeddings' bytes (as held: f32 and f16
/// embeddings of one image are two identities, as their keys and values differ), or for
/// embeddings kept on the device the identity vision-svc gave them; and its grid.
pub fn image_hash(embeds: &Embeddings, grid: [usize; 3]) -> BlockHash {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for g in grid {
        h.update(&(g as u64).to_le_bytes());
    }
    let kind: u8 = match embeds {
        Embeddings::F32(_) => 0,
        Embeddings::F16(_) => 1,
        Embeddings::Device(_) => 2,
    };
    h.update(&[kind]);
    h.update(embeds.content());
    h.digest128()
}
