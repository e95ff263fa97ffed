//! The whole request path in one process: chat → images through the vision stage → prompt ids
//! → the language stage → streamed text. `vlm run` uses it directly; the services split the
//! same steps across processes. A text-only checkpoint (Qwen3ForCausalLM, Qwen2ForCausalLM)
//! has no vision stage, and a chat with images is refused.
//!
//! The request's tools and template variables reach the chat template as the gateway renders
//! them, and its grammar (`constraint`) reaches the engine as the gateway sends it (after
//! `</think>` for a Thinking checkpoint); the answer comes back as text, unsplit. A request
//! whose tools are to be read out of the answer (`tool_choice` other than `none`) is refused
//! rather than answered with its calls left in the text: the gateway (`vlm serve`) reads and
//! forces calls.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::{Duration, Instant};

use gateway::chat::ChatTokenizer;
use gateway::checkpoint::{check_model_dir, ModelIds};
use gateway::detok::TextStream;
use gateway::request::{image_parts, validate_request, ChatRequest, RequestLimits};
use llm_svc::{Engine, EngineConfig, FinishReason, GenerateRequest, ImageInput, TokenEvent};
use vision_svc::VisionEncoder;
use vlm_compute::{Backend, Weights};

use crate::{Error, Result};

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
    /// The vision tower; `None` for a text-only checkpoint.
    pub vision: Option<VisionEncoder<B>>,
    /// The language stage's engine (its loop runs on a thread of its own).
    pub engine: Engine,
    pub limits: RequestLimits,
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
        // The language stage's reading of config.json says whether there is a vision tower
        // (and names an unsupported `architectures` before anything else is read).
        let vision = match llm_svc::ModelConfig::from_dir(dir)?.vision {
            Some(_) => Some(VisionEncoder::load(dir, weights, backend.clone())?),
            None => None,
        };
        let engine = Engine::load(dir, weights, backend, engine, &prometheus::Registry::new())?;
        weights.finish();
        let chat = ChatTokenizer::from_dir(dir, ModelIds::read(dir)?.image_token_id)?;
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
        if req.tools.parses_calls() {
            return Err(gateway::Error::InvalidRequest(
                "`tools` with a `tool_choice` other than none: the offline pipeline (`vlm run`) \
                 neither forces tool calls nor reads them out of the answer; serve the model \
                 (`vlm serve`) for tool calls"
                    .into(),
            )
            .into());
        }
        let mut timings = Timings::default();

        let started = Instant::now();
        let images = match &self.vision {
            Some(vision) => encode_images(vision, req)?,
            None => match image_parts(&req.messages).count() {
                0 => Vec::new(),
                images => {
                    return Err(llm_svc::Error::ImagesNotSupported {
                        architecture: self.engine.config().architecture.name(),
                        images,
                    }
                    .into())
                }
            },
        };
        timings.vision = started.elapsed();

        let per_image: Vec<usize> = images.iter().map(|i| i.embeds.shape()[0]).collect();
        let prompt = self
            .chat
            .prompt_ids_with(&req.messages, &req.template_vars(), &per_image)?;
        let gen_req = GenerateRequest {
            prompt: prompt.clone(),
            images,
            sampling: req.sampling.clone(),
            max_new_tokens: req.max_new_tokens,
            ignore_eos: req.ignore_eos,
            return_logits: req.return_logits,
            // As the gateway sends it: for a Thinking checkpoint, after `</think>` (refused,
            // the request's fault, where that is no single token).
            constraint: gateway::orchestrator::constraint_for(&self.chat, req, &prompt)
                .map_err(|e| gateway::Error::InvalidRequest(e.to_string()))?,
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
            return Err(e.into());
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

/// The chat's images through the vision tower, in order, as the language stage takes them.
fn encode_images<B: Backend + Clone>(
    vision: &VisionEncoder<B>,
    req: &ChatRequest,
) -> Result<Vec<ImageInput>> {
    image_parts(&req.messages)
        .enumerate()
        .map(|(index, bytes)| {
            let out = vision
                .encode_image_for_this_process(bytes)
                .map_err(|error| Error::Image { index, error })?;
            Ok(ImageInput {
                embeds: out.embeds,
                deepstack: out.deepstack,
                grid_thw: out.grid_thw,
            })
        })
        .collect()
}
