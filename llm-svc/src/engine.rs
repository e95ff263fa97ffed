//! The generation loop: validate a request, place image embeddings, prefill, then decode one
//! token at a time until an eos token, the token budget, the context, or the caller says stop.
//!
//! Callers see every token as it is chosen (with the logits it was chosen from), which is how
//! the CLI streams text, writes `--logits-out`, and checks stop strings, and how a server
//! streams to its client and notices the client has gone.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use vlm_compute::{Backend, HostTensor, Weights};

use crate::model::{DecodeGraph, DecodeInputs, KvCache, StepInput, TextModel};
use crate::mrope::{self, image_spans, prompt_positions, ImageSpan};
use crate::sampler::{Sampler, SamplingParams};
use crate::{Error, ModelConfig, Result};

/// One image as the vision stage produced it.
#[derive(Clone, Debug)]
pub struct ImageInput {
    /// `[tokens, hidden]`, placed at the image's placeholder tokens.
    pub embeds: HostTensor,
    /// DeepStack features, each `[tokens, hidden]`, added after layers 0, 1, ...
    pub deepstack: Vec<HostTensor>,
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
    /// Bring every step's logits to the host for [`TokenEvent::logits`]. Otherwise greedy
    /// requests pick their token on the device and only its id comes back.
    pub return_logits: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos token was generated (it is the last token).
    Eos,
    /// `max_new_tokens` or the context was reached.
    Length,
    /// The caller's callback asked to stop (a stop string matched, the client left).
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

/// A token as it is generated.
pub struct TokenEvent<'a> {
    pub token: u32,
    /// 0 for the first generated token.
    pub index: usize,
    /// The logits the token was chosen from, `[vocab]`, if the request asked for them.
    pub logits: Option<&'a [f32]>,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prefill time, until the first token's logits.
    pub prefill: Duration,
    /// Time spent in the decode steps after the first token.
    pub decode: Duration,
}

pub struct Engine<B: Backend> {
    model: TextModel<B>,
    inv_freq: Vec<f32>,
    /// Most tokens (prompt + generated) one sequence may hold.
    max_context: usize,
}

impl<B: Backend> Engine<B> {
    /// Loads the text decoder of the checkpoint in `dir`. `max_context` caps the model's own
    /// `max_position_embeddings` (memory for the KV cache is sized from it).
    pub fn load(
        dir: &Path,
        weights: &Weights,
        backend: B,
        max_context: Option<usize>,
    ) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let model_max = cfg.text.max_position_embeddings;
        let max_context = max_context.map_or(model_max, |m| m.min(model_max));
        let inv_freq = mrope::inv_freq(&cfg.text);
        let model = TextModel::new(cfg, weights, backend)?;
        Ok(Self {
            model,
            inv_freq,
            max_context,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Checks a request without running it.
    pub fn validate(&self, req: &GenerateRequest) -> Result<()> {
        self.check(req).map(|_| ())
    }

    /// Checks a request and returns where its images sit in the prompt.
    fn check(&self, req: &GenerateRequest) -> Result<Vec<ImageSpan>> {
        let cfg = self.config();
        if req.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if req.prompt.len() >= self.max_context {
            return Err(Error::PromptTooLong {
                prompt_tokens: req.prompt.len(),
                context: self.max_context,
            });
        }
        let vocab = cfg.text.vocab_size;
        if let Some((position, &id)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(Error::TokenOutOfRange {
                id,
                position,
                vocab,
            });
        }
        req.sampling.validate()?;
        if req.max_new_tokens == 0 {
            return Err(Error::InvalidParameter(
                "`max_new_tokens` must be at least 1, got 0".into(),
            ));
        }
        let hidden = cfg.text.hidden_size;
        let m = cfg.spatial_merge_size;
        for (k, img) in req.images.iter().enumerate() {
            let [t, h, w] = img.grid_thw;
            let tokens = t * (h / m) * (w / m);
            if img.embeds.shape() != [tokens, hidden] {
                return Err(Error::ImageMismatch(format!(
                    "image {k}: embeddings {:?}, grid {:?} implies [{tokens}, {hidden}]",
                    img.embeds.shape(),
                    img.grid_thw
                )));
            }
            if img.deepstack.len() != req.images[0].deepstack.len()
                || img
                    .deepstack
                    .iter()
                    .any(|d| d.shape() != img.embeds.shape())
            {
                return Err(Error::ImageMismatch(format!(
                    "image {k}: DeepStack features must all be {:?}, one set per image",
                    img.embeds.shape()
                )));
            }
            if t != 1 {
                return Err(Error::ImageMismatch(format!(
                    "image {k}: temporal grid {t}; images have 1 (video is not supported)"
                )));
            }
        }
        let grids: Vec<(usize, usize)> = req
            .images
            .iter()
            .map(|i| (i.grid_thw[1] / m, i.grid_thw[2] / m))
            .collect();
        image_spans(&req.prompt, cfg.image_token_id, &grids)
    }

    /// The next token from `logits` on the device: greedy requests that do not want the
    /// logits take the argmax there; the others bring the logits to the host and sample.
    fn pick(
        &self,
        logits: &B::Tensor,
        sampler: &mut Sampler,
        keep_logits: bool,
    ) -> Result<(u32, Option<HostTensor>)> {
        let be = self.model.backend();
        if sampler.is_greedy() && !keep_logits {
            return Ok((be.argmax(logits)?, None));
        }
        let host = be.download(logits)?;
        Ok((sampler.sample(host.data()), keep_logits.then_some(host)))
    }

    /// Runs a request to completion, calling `on_token` for every generated token.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let spans = self.check(req)?;
        let be = self.model.backend();
        let cfg = self.config();
        let pos = prompt_positions(req.prompt.len(), &spans);
        let mut sampler = Sampler::new(req.sampling.clone())?;
        let capacity = (req.prompt.len() + req.max_new_tokens).min(self.max_context);
        let mut cache = KvCache::new(be, &cfg.text, capacity)?;

        // Prefill: token embeddings with the images' embeddings in place of the placeholders.
        let prefill_span = tracing::info_span!(
            "prefill",
            tokens = req.prompt.len(),
            images = req.images.len()
        );
        let prefill_guard = prefill_span.enter();
        let started = Instant::now();
        let mut embeds = self.model.embed(&req.prompt)?;
        let image_rows: Vec<usize> = spans
            .iter()
            .flat_map(|s| s.start..s.start + s.len())
            .collect();
        let mut deepstack = Vec::new();
        if !req.images.is_empty() {
            let all: Vec<HostTensor> = req.images.iter().map(|i| i.embeds.clone()).collect();
            be.scatter_rows(
                &mut embeds,
                &image_rows,
                &be.upload(&HostTensor::concat_rows(&all)?)?,
            )?;
            for j in 0..req.images[0].deepstack.len() {
                let layer: Vec<HostTensor> =
                    req.images.iter().map(|i| i.deepstack[j].clone()).collect();
                deepstack.push(be.upload(&HostTensor::concat_rows(&layer)?)?);
            }
        }
        let (cos, sin) = mrope::rope_tables(&cfg.text, &self.inv_freq, &pos.positions)?;
        let logits = self.model.forward(
            &mut cache,
            &StepInput {
                embeds,
                cos: be.upload(&cos)?,
                sin: be.upload(&sin)?,
                image_rows: &image_rows,
                deepstack: &deepstack,
            },
        )?;
        // The first token ends the prefill (and waits for the device to finish it).
        let mut picked = self.pick(&logits, &mut sampler, req.return_logits)?;
        drop(logits);
        let prefill = started.elapsed();
        drop(prefill_guard);
        let decode_span = tracing::info_span!(
            "decode",
            tokens = tracing::field::Empty,
            tokens_per_s = tracing::field::Empty
        );
        let decode_guard = decode_span.enter();
        let decode_started = Instant::now();

        let mut inputs = DecodeInputs::new(be, &cfg.text)?;
        let mut graph = DecodeGraph::NotTried;
        let mut tokens = Vec::new();
        let finish = loop {
            let (token, logits) = picked;
            tokens.push(token);
            let flow = on_token(&TokenEvent {
                token,
                index: tokens.len() - 1,
                logits: logits.as_ref().map(|l| l.data()),
            });
            if !req.ignore_eos && cfg.eos_token_ids.contains(&token) {
                break FinishReason::Eos;
            }
            if flow.is_break() {
                break FinishReason::Stopped;
            }
            if tokens.len() >= req.max_new_tokens || cache.len() >= cache.capacity() {
                break FinishReason::Length;
            }
            // Decode: all three M-RoPE streams are slot + delta.
            let p = (cache.len() as i64 + pos.delta) as u32;
            let (cos, sin) = mrope::rope_tables(&cfg.text, &self.inv_freq, &[[p; 3]])?;
            inputs.set(be, token, cache.len(), cos.data(), sin.data())?;
            self.model.decode(&mut cache, &mut inputs, &mut graph)?;
            picked = self.pick(inputs.logits(), &mut sampler, req.return_logits)?;
        };
        let decode = decode_started.elapsed();
        decode_span.record("tokens", tokens.len());
        if tokens.len() > 1 {
            let rate = (tokens.len() - 1) as f64 / decode.as_secs_f64().max(1e-9);
            decode_span.record("tokens_per_s", format!("{rate:.1}"));
        }
        drop(decode_guard);
        Ok(Generation {
            tokens,
            finish,
            prompt_tokens: req.prompt.len(),
            prefill,
            decode,
        })
    }
}
