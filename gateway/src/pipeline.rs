//! The whole request path in one process: chat → images through the vision stage → prompt ids
//! → the language stage → streamed text. `vlm run` uses it directly; the services split the
//! same steps across processes.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use llm_svc::{
    Engine, EngineConfig, FinishReason, GenerateRequest, ImageInput, SamplingParams, TokenEvent,
};
use vision_svc::VisionEncoder;
use vlm_compute::{Backend, Weights};

use crate::chat::{ChatTokenizer, Message, Part};
use crate::detok::TextStream;
use crate::{Error, Result};

/// Limits applied to every request, on top of the model's own.
#[derive(Clone, Debug)]
pub struct RequestLimits {
    /// Most images in one request.
    pub max_images: usize,
    /// Most new tokens one request may ask for.
    pub max_new_tokens: usize,
    /// Most messages in one request.
    pub max_messages: usize,
    /// Largest encoded image (PNG, JPEG, ... bytes) in a request.
    pub max_image_bytes: usize,
    /// Largest request: an HTTP body (larger gets 413) or a gRPC message (OUT_OF_RANGE).
    pub max_body_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_images: 8,
            max_new_tokens: 8192,
            max_messages: 1024,
            max_image_bytes: 32 * 1024 * 1024,
            max_body_bytes: vlm_proto::MAX_MESSAGE_BYTES,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// Generation stops before any of these strings; the text returned excludes it.
    pub stop: Vec<String>,
    /// Generate through eos tokens, up to `max_new_tokens` (for benchmarks and tests).
    pub ignore_eos: bool,
    /// Hand each step's logits to `on_token` (`vlm run --logits-out`); otherwise greedy
    /// requests keep them on the device.
    pub return_logits: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// Until the image embeddings are at hand: on a GPU, once the tower's pass is queued (the
    /// language stage's first step waits for it on the device, and its time shows in
    /// `prefill`).
    pub vision: Duration,
    pub prefill: Duration,
    pub decode: Duration,
}

#[derive(Clone, Debug)]
pub struct ChatOutput {
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

pub struct Pipeline<B: Backend> {
    pub chat: ChatTokenizer,
    pub vision: VisionEncoder<B>,
    /// The language stage's engine (its loop runs on a thread of its own).
    pub engine: Engine,
    pub limits: RequestLimits,
}

/// Checks that `dir` looks like a checkpoint before anything else reads from it.
pub fn check_model_dir(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        return Err(Error::ModelDir(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    if !dir.join("config.json").is_file() {
        return Err(Error::ModelDir(format!(
            "{} has no config.json; point --model at a Hugging Face Qwen3-VL checkpoint directory",
            dir.display()
        )));
    }
    Ok(())
}

/// Checks a chat request against `limits` before any work is done for it.
pub fn validate_request(req: &ChatRequest, limits: &RequestLimits) -> Result<()> {
    if req.messages.is_empty() {
        return Err(Error::InvalidRequest("`messages` is empty".into()));
    }
    if req.messages.len() > limits.max_messages {
        return Err(Error::InvalidRequest(format!(
            "a request may carry at most {} messages (--max-messages), got {}",
            limits.max_messages,
            req.messages.len()
        )));
    }
    if let Some(i) = req.messages.iter().position(|m| m.parts.is_empty()) {
        return Err(Error::InvalidRequest(format!("message {i} has no content")));
    }
    let images = image_parts(&req.messages).count();
    if images > limits.max_images {
        return Err(Error::InvalidRequest(format!(
            "a request may carry at most {} images (--max-images), got {images}",
            limits.max_images
        )));
    }
    if let Some((i, bytes)) = image_parts(&req.messages)
        .enumerate()
        .find(|(_, b)| b.len() > limits.max_image_bytes)
    {
        return Err(Error::InvalidRequest(format!(
            "image {i} has {} bytes; an image may have at most {} (--max-image-bytes)",
            bytes.len(),
            limits.max_image_bytes
        )));
    }
    if req.max_new_tokens == 0 || req.max_new_tokens > limits.max_new_tokens {
        return Err(Error::InvalidRequest(format!(
            "`max_tokens` (tokens to generate; --max-new-tokens in the CLI) must be between 1 and {}, got {}",
            limits.max_new_tokens, req.max_new_tokens
        )));
    }
    req.sampling.validate()?;
    Ok(())
}

/// The image bytes of a chat, in order of appearance.
pub fn image_parts(messages: &[Message]) -> impl Iterator<Item = &Vec<u8>> {
    messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| match p {
            Part::Image(bytes) => Some(bytes),
            Part::Text(_) => None,
        })
}

impl<B: Backend + Clone> Pipeline<B> {
    /// Loads tokenizer, template, vision tower and text decoder from one checkpoint directory.
    pub fn load(dir: &Path, backend: B, engine: EngineConfig) -> Result<Self> {
        check_model_dir(dir)?;
        Self::with_weights(dir, &Weights::open(dir)?, backend, engine)
    }

    /// As [`Pipeline::load`], with the weights given (e.g. [`Weights::random`]): only the
    /// directory's config, tokenizer, template and image-processor files are read.
    pub fn with_weights(
        dir: &Path,
        weights: &Weights,
        backend: B,
        engine: EngineConfig,
    ) -> Result<Self> {
        check_model_dir(dir)?;
        let vision = VisionEncoder::load(dir, weights, backend.clone())?;
        let engine = Engine::load(dir, weights, backend, engine, &prometheus::Registry::new())?;
        weights.finish();
        let chat = ChatTokenizer::from_dir(dir, engine.config().image_token_id())?;
        Ok(Self {
            chat,
            vision,
            engine,
            limits: RequestLimits::default(),
        })
    }

    /// Runs one chat request. `on_token` sees each generated token with the text it completes
    /// (empty while a character or a possible stop string is incomplete) and may stop early.
    pub fn run(
        &self,
        req: &ChatRequest,
        mut on_token: impl FnMut(&TokenEvent, &str) -> ControlFlow<()>,
    ) -> Result<ChatOutput> {
        validate_request(req, &self.limits)?;
        let mut timings = Timings::default();

        let started = Instant::now();
        let images = image_parts(&req.messages)
            .enumerate()
            .map(|(index, bytes)| {
                let out = self
                    .vision
                    .encode_image_for_this_process(bytes)
                    .map_err(|error| Error::Image { index, error })?;
                Ok(ImageInput {
                    embeds: out.embeds,
                    deepstack: out.deepstack,
                    grid_thw: out.grid_thw,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        timings.vision = started.elapsed();

        let per_image: Vec<usize> = images.iter().map(|i| i.embeds.shape()[0]).collect();
        let prompt = self.chat.prompt_ids(&req.messages, &per_image)?;
        let gen_req = GenerateRequest {
            prompt: prompt.clone(),
            images,
            sampling: req.sampling.clone(),
            max_new_tokens: req.max_new_tokens,
            ignore_eos: req.ignore_eos,
            return_logits: req.return_logits,
        };
        let mut stream = TextStream::new(self.chat.tokenizer(), req.stop.clone());
        let mut out_text = String::new();
        let mut failure = None;
        let generation = self
            .engine
            .generate(&gen_req, |ev| match stream.push(ev.token) {
                Ok((visible, hit)) => {
                    out_text.push_str(&visible);
                    let flow = on_token(ev, &visible);
                    if hit {
                        ControlFlow::Break(())
                    } else {
                        flow
                    }
                }
                Err(e) => {
                    failure = Some(e);
                    ControlFlow::Break(())
                }
            })?;
        if let Some(e) = failure {
            return Err(e);
        }
        out_text.push_str(&stream.finish()?);
        timings.prefill = generation.prefill;
        timings.decode = generation.decode;
        Ok(ChatOutput {
            prompt_token_ids: prompt,
            generated_token_ids: generation.tokens,
            text: out_text,
            finish_reason: generation.finish,
            timings,
        })
    }
}
