//! The gateway's request path across processes:
//!
//! ```text
//! chat ─validate─▶ images ─▶ VisionService.Encode (concurrently, with failover) ─┐
//!      ─render + tokenize + expand placeholders (blocking pool, meanwhile) ◀─────┘
//!      ─▶ LlmService.Generate (stream) ─▶ detokenize + stop strings ─▶ ChatEvent stream
//! ```
//! The prompt is rendered and tokenized while the images are encoded, from each image's token
//! count as its header gives it (vision-svc's own counts decide; a disagreement builds it
//! again). Once llm-svc has named its shared-memory domain, vision-svc is offered it: on one
//! host the embeddings then come as the name of a segment, which the gateway passes on (and
//! removes if the request fails before llm-svc takes it). Backpressure fails fast
//! (RESOURCE_EXHAUSTED / 429) with the permit held for the whole stream. When the client goes away its receiver closes, the forwarding task ends, the
//! upstream stream is dropped, and the LLM service stops decoding. A client that stays but
//! stops reading is treated the same once it has taken nothing for `client_send_timeout`.
//! The caller's deadline is passed on to every upstream call.
//! Each call's replica is picked by [`crate::routing`]: an image by its bytes, the prompt by
//! its KV blocks (as llm-svc names them) against each replica's load. The Generate stream is
//! read up to its first message before the client sees anything, so a replica that fails
//! before then is ejected and the request goes once to another (when its embeddings travel
//! inside the messages; a segment or handoff is the first replica's); a failure after it ends
//! the stream with UNAVAILABLE naming the replica.
//! A request's sampling fields reach llm-svc whole ([`generate_request`]); the logprobs it
//! asked for come back per token and leave here with each token's text ([`TokenLogprobs`]).
//!
//! A request for `n` > 1 choices (at most [`MAX_CHOICES`]) is `n` generations on one llm-svc
//! replica, choice `i` with `SamplingParams.choice = i` (its own draws under the same seed):
//! the images are encoded once and their embeddings sent with each (inside the messages:
//! a shared-memory segment or a device handoff is taken by the first call that names it), the
//! prompt's blocks computed once and shared through the prefix cache (llm-svc's scheduler
//! holds the others back until the first has computed them). One task relays all of them,
//! each choice with its own detokenizer and stop strings, its events tagged with its index.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::try_join_all;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::StreamMap;
use tonic::Status;
use tracing::{info_span, Instrument};
use vlm_proto::image::{image_tokens, DecodeLimits, PreprocessConfig};
use vlm_proto::pb::llm_service_client::LlmServiceClient;
use vlm_proto::pb::vision_service_client::VisionServiceClient;
use vlm_proto::pb::{self, EncodeRequest, EncodeResponse};
use vlm_proto::{headers, telemetry};

use crate::chat::{ChatTokenizer, Message};
use crate::detok::{TextStream, TokenBytes};
use crate::gateway_error::upstream_gone;
pub use crate::gateway_error::GatewayError;
use crate::metrics::Metrics;
use crate::output::{OutputSplitter, ToolCallDelta, THINK_CLOSE, THINK_OPEN};
use crate::request::{image_parts, validate_request, ChatRequest, RequestLimits};
use crate::routing::RouteKey;
use crate::sampling::{check_logit_bias_ids, SamplingDefaults};
use crate::tools::{tool_call_grammar, Tag, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
use crate::upstream::{Load, Release, ReleaseOnHost, Routed, Upstreams};
use vlm_proto::prefix::{prompt_block_hashes, BlockHash, KV_BLOCK_SIZE};

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;

/// A request's `n` (unset: 1) checked against [`MAX_CHOICES`], as both APIs read it.
pub fn choices(n: Option<i64>) -> Result<usize, GatewayError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(GatewayError::Invalid(format!(
            "`n` (choices per request) must be between 1 and {MAX_CHOICES}, got {n}"
        ))),
    }
}

/// What a chat stream yields: each choice's deltas, then its `Done`, the choices' events
/// interleaved as their tokens come; the stream ends after the last choice's `Done` (or an
/// error, which ends every choice).
#[derive(Debug, Clone)]
pub enum ChatEvent {
    /// New tokens of choice `choice` and the text they complete (possibly empty), split
    /// into content (`text`), reasoning and tool calls ([`crate::output`]); with logprobs
    /// asked for, one [`TokenLogprobs`] per token, else none.
    Delta {
        choice: u32,
        text: String,
        reasoning: String,
        tool_calls: Vec<ToolCallDelta>,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    /// The end of choice `choice`: why (`ToolCalls` for an answer that called tools), and
    /// its token counts (the prompt's is the request's, the same in every choice).
    Done {
        choice: u32,
        finish: pb::FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
}

/// A token with its logprob, as responses show it.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    pub id: u32,
    /// The token alone, decoded (U+FFFD where it holds part of a character).
    pub text: String,
    /// The token's own bytes, possibly an incomplete UTF-8 sequence.
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token's logprob and the most likely tokens' at its step, best first (raw:
/// from the model's logits before logit_bias, penalties and temperature).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: Logprob,
    pub top: Vec<Logprob>,
}

/// The logprobs llm-svc sent with `ids`, with each token's text; none when none were asked.
fn logprobs_with_text(
    ids: &[u32],
    wire: Vec<pb::TokenLogprobs>,
    tokens: &TokenBytes,
) -> Result<Vec<TokenLogprobs>, GatewayError> {
    if wire.is_empty() {
        return Ok(Vec::new());
    }
    if wire.len() != ids.len() {
        return Err(GatewayError::Internal(format!(
            "llm-svc sent {} logprobs for {} tokens",
            wire.len(),
            ids.len()
        )));
    }
    let logprob = |id: u32, logprob: f32| -> Result<Logprob, GatewayError> {
        let (text, bytes) = tokens.text_and_bytes(id)?;
        Ok(Logprob {
            id,
            text,
            bytes,
            logprob,
        })
    };
    ids.iter()
        .zip(wire)
        .map(|(&id, w)| {
            Ok(TokenLogprobs {
                token: logprob(id, w.logprob)?,
                top: w
                    .top_ids
                    .iter()
                    .zip(&w.top_logprobs)
                    .map(|(&id, &lp)| logprob(id, lp))
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect()
}

pub struct Orchestrator {
    pub chat: Arc<ChatTokenizer>,
    /// Element type asked of the vision service for embeddings: f32 is exact, f16/bf16 halve
    /// the bytes moved per image.
    pub embedding_dtype: pb::Dtype,
    /// `None` for a text-only checkpoint.
    pub vision: Option<Upstreams>,
    pub llm: Upstreams,
    pub limits: RequestLimits,
    /// Reads the image URLs of requests by `limits.media`, with its URL cache.
    pub media: Arc<crate::media::MediaFetcher>,
    /// The checkpoint's image preprocessing, to count an image's tokens from its header
    /// before it is encoded; `None`: the prompt waits for the embeddings.
    pub image_settings: Option<PreprocessConfig>,
    pub metrics: Metrics,
    /// Offer vision-svc shared memory for the embeddings when llm-svc shares it.
    pub shared_memory: bool,
    /// Lets go of what a failed request's images left upstream.
    pub release: Arc<dyn Release>,
    /// The shared-memory and device domains each llm-svc replica named in its last response
    /// headers ([`headers`]), by address.
    llm_domains: std::sync::Mutex<std::collections::HashMap<String, LlmDomains>>,
    /// Longest a stream waits for its client to take the next event; past it the generation
    /// is cancelled, so a client that stops reading holds no permit, KV cache or task.
    pub client_send_timeout: Duration,
    /// Values of the sampling fields a request leaves out (the checkpoint's
    /// generation_config.json, unless `--generation-config none`); both APIs resolve their
    /// requests with them.
    pub sampling_defaults: SamplingDefaults,
    /// The model's vocabulary, to refuse `logit_bias` ids outside it before any upstream
    /// call; `None`: llm-svc alone checks them.
    pub vocab_size: Option<usize>,
    permits: Arc<Semaphore>,
    /// The permits there are in all (`--max-concurrent`): a request of `n` choices takes `n`.
    max_concurrent: usize,
}

/// Default of [`Orchestrator::client_send_timeout`]: far longer than any pause of a client
/// that is reading (a GC, a slow network hop), far shorter than a request's timeout.
pub const DEFAULT_CLIENT_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Keeps the in-flight gauge and the outcome counter honest however a request ends: the
/// outcome is "client_gone" unless a path sets another.
struct RequestGuard {
    metrics: Metrics,
    api: &'static str,
    outcome: &'static str,
}

impl RequestGuard {
    fn new(metrics: &Metrics, api: &'static str) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics: metrics.clone(),
            api,
            outcome: "client_gone",
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
        self.metrics
            .requests
            .with_label_values(&[self.api, self.outcome])
            .inc();
    }
}

fn with_deadline<T>(msg: T, deadline: Option<Instant>) -> Result<tonic::Request<T>, GatewayError> {
    let mut req = tonic::Request::new(msg);
    if let Some(d) = deadline {
        let left = d.checked_duration_since(Instant::now()).ok_or_else(|| {
            GatewayError::DeadlineExceeded("deadline passed before the call".into())
        })?;
        req.set_timeout(left);
    }
    telemetry::inject(req.metadata_mut());
    Ok(req)
}

/// A request with images to a text-only checkpoint: the client's to fix.
fn text_only() -> GatewayError {
    GatewayError::Invalid(
        "this model is text-only (its config.json names no image token): it takes no images; \
         send the message's text parts only"
            .into(),
    )
}

impl Orchestrator {
    /// `vision`: `None` for a text-only checkpoint, whose requests take no images.
    pub fn new(
        chat: ChatTokenizer,
        vision: Option<Upstreams>,
        llm: Upstreams,
        limits: RequestLimits,
        max_concurrent: usize,
        metrics: Metrics,
    ) -> Self {
        Self {
            chat: Arc::new(chat),
            embedding_dtype: pb::Dtype::F32,
            vision,
            llm,
            media: Arc::new(crate::media::MediaFetcher::new(
                limits.media.clone(),
                metrics.clone(),
            )),
            limits,
            image_settings: None,
            metrics,
            shared_memory: true,
            release: Arc::new(ReleaseOnHost),
            llm_domains: Default::default(),
            client_send_timeout: DEFAULT_CLIENT_SEND_TIMEOUT,
            sampling_defaults: SamplingDefaults::default(),
            vocab_size: None,
            permits: Arc::new(Semaphore::new(max_concurrent.max(1))),
            max_concurrent: max_concurrent.max(1),
        }
    }

    /// The prompt's token ids for images of `per_image` tokens each, built on the blocking pool
    /// (rendering and tokenizing a long chat takes milliseconds).
    async fn prompt_ids(
        &self,
        req: &ChatRequest,
        per_image: Vec<usize>,
    ) -> Result<Vec<u32>, GatewayError> {
        let chat = self.chat.clone();
        // The template needs where the images are, not their bytes.
        let messages: Vec<Message> = req
            .messages
            .iter()
            .map(Message::without_image_bytes)
            .collect();
        let vars = req.template_vars();
        let ids =
            tokio::task::spawn_blocking(move || chat.prompt_ids_with(&messages, &vars, &per_image))
                .instrument(info_span!("tokenize"))
                .await
                .map_err(|e| GatewayError::Internal(format!("tokenizer task failed: {e}")))??;
        Ok(ids)
    }

    /// The KV blocks of `prompt` as llm-svc names them, each image (its placeholder run, in
    /// order) named by the identity of its bytes, to route the prompt by.
    fn prompt_blocks(&self, prompt: &[u32], images: &[BlockHash]) -> Vec<BlockHash> {
        let mut spans = Vec::with_capacity(images.len());
        if let Some(image_token) = self.chat.image_token_id() {
            let mut at = 0;
            while at < prompt.len() && spans.len() < images.len() {
                if prompt[at] != image_token {
                    at += 1;
                    continue;
                }
                let len = prompt[at..]
                    .iter()
                    .take_while(|&&t| t == image_token)
                    .count();
                spans.push((at, len, images[spans.len()]));
                at += len;
            }
        }
        prompt_block_hashes(prompt, &spans, KV_BLOCK_SIZE)
    }

    /// The domain every llm-svc replica shares, once each has named it: embeddings may then
    /// travel through shared memory if vision-svc sees the same one.
    fn llm_shm_domain(&self) -> Option<String> {
        if !self.shared_memory {
            return None;
        }
        self.common_llm_domain(|d| d.shm.as_ref())
    }

    /// The device domain every llm-svc replica shares (one replica, in this process, in
    /// practice): vision-svc keeps the embeddings on the device if it is its own.
    fn llm_device_domain(&self) -> Option<String> {
        self.common_llm_domain(|d| d.device.as_ref())
    }

    fn common_llm_domain(&self, pick: impl Fn(&LlmDomains) -> Option<&String>) -> Option<String> {
        let domains = self.llm_domains.lock().unwrap_or_else(|e| e.into_inner());
        let addrs = self.llm.addrs();
        let mut named = addrs.iter().map(|a| domains.get(a).and_then(&pick));
        let first = named.next()??;
        named.all(|d| d == Some(first)).then(|| first.clone())
    }

    /// Notes the domains llm-svc at `addr` named in `headers` (none: no shared memory or
    /// device handoff there).
    fn note_llm_domains(&self, addr: &str, headers: &tonic::metadata::MetadataMap) {
        let named = |header: &str| {
            headers
                .get(header)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let now = LlmDomains {
            shm: named(headers::SHM_DOMAIN),
            device: named(headers::DEVICE_DOMAIN),
        };
        let mut domains = self.llm_domains.lock().unwrap_or_else(|e| e.into_inner());
        if domains.get(addr) != Some(&now) {
            domains.insert(addr.to_string(), now);
        }
    }

    /// Encodes one image. Embeddings that come in a shared-memory segment come with its
    /// guard, which removes the segment unless llm-svc takes it. `inline`: the embeddings
    /// come inside the response whatever llm-svc could take (they go to several calls).
    async fn encode_image(
        &self,
        index: usize,
        image: bytes::Bytes,
        deadline: Option<Instant>,
        inline: bool,
    ) -> Result<(EncodeResponse, Held), GatewayError> {
        let span = info_span!(
            "vision.rpc",
            image = index,
            image_bytes = image.len(),
            embedding_bytes = tracing::field::Empty,
            shm = tracing::field::Empty,
            device = tracing::field::Empty
        );
        let started = Instant::now();
        let (shm_domain, device_domain) = if inline {
            Default::default()
        } else {
            (
                self.llm_shm_domain().unwrap_or_default(),
                self.llm_device_domain().unwrap_or_default(),
            )
        };
        let Some(vision) = &self.vision else {
            return Err(text_only());
        };
        let result = async {
            let key = RouteKey::Image(vlm_proto::prefix::image_identity(&image));
            vision
                .call(key, None, |ch| {
                    let msg = EncodeRequest {
                        image: image.clone(),
                        dtype: self.embedding_dtype as i32,
                        shm_domain: shm_domain.clone(),
                        device_domain: device_domain.clone(),
                    };
                    async move {
                        let req = with_deadline(msg, deadline)
                            .map_err(|e| Status::deadline_exceeded(e.to_string()))?;
                        let mut client = VisionServiceClient::new(ch)
                            .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
                            .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
                        client.encode(req).await.map(|r| r.into_inner())
                    }
                })
                .await
                .map(|r| r.value)
                .map_err(|e| match e {
                    GatewayError::Invalid(m) => {
                        GatewayError::Invalid(format!("image {index}: {m}"))
                    }
                    other => other,
                })
        }
        .instrument(span.clone())
        .await;
        let outcome = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .vision_seconds
            .with_label_values(&[outcome])
            .observe(started.elapsed().as_secs_f64());
        let r = result?;
        let held = Held::new(&r, self.release.clone());
        span.record("embedding_bytes", r.payload_bytes());
        span.record("shm", !r.shm_segment.is_empty());
        span.record("device", r.device_handle != 0);
        Ok((r, held))
    }

    /// Starts a chat of `n` choices (checked by [`choices`]): images encoded, prompt built,
    /// generations started. Errors before the first token come back here; later ones arrive
    /// in the stream. `api` labels the metrics.
    pub async fn chat(
        &self,
        req: ChatRequest,
        n: usize,
        api: &'static str,
        timeout: Option<Duration>,
    ) -> Result<mpsc::Receiver<Result<ChatEvent, GatewayError>>, GatewayError> {
        let mut guard = RequestGuard::new(&self.metrics, api);
        let started = match self.start(req, n, timeout).await {
            Ok(s) => s,
            Err(e) => {
                guard.outcome = e.kind();
                tracing::warn!(error = %e, kind = e.kind(), "request failed");
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::channel(32);
        let span = started.span.clone();
        tokio::spawn(
            forward(
                started,
                tx,
                guard,
                self.chat.clone(),
                self.metrics.clone(),
                self.client_send_timeout,
            )
            .instrument(span),
        );
        Ok(rx)
    }

    /// Admits the request, encodes its images and builds its prompt, and starts its `n`
    /// generations: the first on the replica routing picks (replaced once if it fails before
    /// its first message), the others beside it.
    async fn start(
        &self,
        req: ChatRequest,
        n: usize,
        timeout: Option<Duration>,
    ) -> Result<Started, GatewayError> {
        let arrived = Instant::now();
        let deadline = timeout.map(|t| arrived + t);
        let permit = self.admit(&req, n)?;
        let Prepared {
            prompt,
            images,
            image_ids,
            held,
        } = self.prepare(&req, n, deadline).await?;
        let reasoning = prompt_opens_reasoning(&self.chat, &prompt);
        let mut gen = generate_request(&req, prompt, images);
        gen.constraint = resolve_constraint(&self.chat, &req, reasoning)?;
        let prompt_tokens = gen.prompt_token_ids.len() as u32;
        let span = info_span!(
            "llm.rpc",
            prompt_tokens,
            choices = n,
            generated_tokens = tracing::field::Empty
        );
        let blocks = self.prompt_blocks(&gen.prompt_token_ids, &image_ids);
        let first = self
            .start_first_choice(&gen, &blocks, deadline, &span)
            .await?;
        // llm-svc has the request, and its segments and handoffs.
        held.into_iter().for_each(Held::keep);
        self.llm.record(&first.addr, &blocks);
        self.note_llm_domains(&first.addr, &first.meta);
        let mut upstreams = vec![(first.message, first.stream)];
        if n > 1 {
            let rest = self
                .start_other_choices(&gen, n, &first.addr, deadline, &span)
                .await?;
            upstreams.extend(rest.into_iter().map(|r| (None, r)));
        }
        Ok(Started {
            output: OutputKinds {
                stop: req.stop,
                reasoning,
                tool_calls: req.tools.parses_calls(),
            },
            upstreams,
            llm_addr: first.addr,
            load: first.load,
            permit,
            prompt_tokens,
            arrived,
            span,
        })
    }

    /// Checks the request and takes its `n` places (one a choice), or refuses it at once.
    fn admit(
        &self,
        req: &ChatRequest,
        n: usize,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, GatewayError> {
        // Checked before it takes a place: a bad request is a 400 even when the gateway is full.
        validate_request(req, &self.limits)?;
        if let Some(vocab) = self.vocab_size {
            check_logit_bias_ids(&req.sampling, vocab)?;
        }
        choices(Some(n as i64))?;
        if n > self.max_concurrent {
            return Err(GatewayError::Invalid(format!(
                "`n` must be at most {} on this gateway (--max-concurrent: each choice is a \
                 stream of its own), got {n}",
                self.max_concurrent
            )));
        }
        // Each choice is a stream upstream, and counts as one.
        self.permits
            .clone()
            .try_acquire_many_owned(n as u32)
            .map_err(|_| {
                GatewayError::Overloaded(
                    "the gateway is serving its limit of concurrent requests; retry later".into(),
                )
            })
    }

    /// Encodes the request's images and builds its prompt from their token counts.
    async fn prepare(
        &self,
        req: &ChatRequest,
        n: usize,
        deadline: Option<Instant>,
    ) -> Result<Prepared, GatewayError> {
        let images: Vec<bytes::Bytes> = image_parts(&req.messages)
            .map(|i| bytes::Bytes::copy_from_slice(i))
            .collect();
        let image_ids: Vec<BlockHash> = images
            .iter()
            .map(|i| vlm_proto::prefix::image_identity(i))
            .collect();
        if !images.is_empty() && self.vision.is_none() {
            return Err(text_only());
        }
        // Each image's token count from its header, so the prompt is rendered and tokenized
        // while the images are encoded; it is used if vision-svc's counts agree.
        let expected: Option<Vec<usize>> = self.image_settings.as_ref().and_then(|cfg| {
            let limits = DecodeLimits::default();
            images
                .iter()
                .map(|i| image_tokens(i, cfg, &limits).ok())
                .collect()
        });
        let encodes = try_join_all(
            images
                .into_iter()
                .enumerate()
                .map(|(i, bytes)| self.encode_image(i, bytes, deadline, n > 1)),
        );
        let early_prompt = async {
            match &expected {
                Some(counts) => Some(self.prompt_ids(req, counts.clone()).await),
                None => None,
            }
        };
        let (encoded, early_prompt) = tokio::join!(encodes, early_prompt);
        // Segments and device handoffs stay until llm-svc has taken them; any error before
        // removes them.
        let (encoded, held): (Vec<EncodeResponse>, Vec<Held>) = encoded?.into_iter().unzip();

        let per_image: Vec<usize> = encoded
            .iter()
            .map(|e| {
                e.embeddings
                    .as_ref()
                    .and_then(|t| t.shape.first())
                    .copied()
                    .unwrap_or(0) as usize
            })
            .collect();
        let prompt = match early_prompt {
            Some(prompt) if expected.as_ref() == Some(&per_image) => prompt?,
            _ => self.prompt_ids(req, per_image).await?,
        };

        let images = encoded
            .into_iter()
            .map(|e| pb::ImageEmbeddings {
                embeddings: e.embeddings,
                deepstack: e.deepstack,
                grid_thw: e.grid_thw,
                shm_segment: e.shm_segment,
                device_handle: e.device_handle,
            })
            .collect();
        Ok(Prepared {
            prompt,
            images,
            image_ids,
            held,
        })
    }

    /// Starts the first choice on the replica routing picks for `blocks`, and reads its
    /// stream up to the first message.
    async fn start_first_choice(
        &self,
        gen: &pb::GenerateRequest,
        blocks: &[BlockHash],
        deadline: Option<Instant>,
        span: &tracing::Span,
    ) -> Result<FirstChoice, GatewayError> {
        // Embeddings passed by name (a segment, a handoff) are taken by the first llm-svc that
        // gets them: only a request that carries them inside can go to a second replica.
        let inline = !gen.images.iter().any(pb::ImageEmbeddings::held_by_name);
        let mut tried: Option<String> = None;
        loop {
            let routed = self
                .llm
                .call(RouteKey::Prompt(blocks), tried.as_deref(), |ch| {
                    generate_choice(ch, gen.clone(), 0, deadline)
                })
                .instrument(span.clone())
                .await?;
            let Routed {
                value: response,
                addr,
                load,
            } = routed;
            let (meta, mut stream, _) = response.into_parts();
            // The stream is read up to its first message here: until then nothing has
            // reached the client, and a replica that fails is replaced (once).
            match stream.message().await {
                Ok(message) => {
                    return Ok(FirstChoice {
                        meta,
                        stream,
                        message,
                        addr,
                        load,
                    })
                }
                Err(st) if upstream_gone(&st) && tried.is_none() && inline => {
                    tracing::warn!(%addr, error = %st.message(), "llm-svc failed before the first token; retrying on another replica");
                    self.llm.eject(&addr);
                    tried = Some(addr);
                }
                Err(st) => return Err(GatewayError::upstream("llm-svc", &addr, &st)),
            }
        }
    }

    /// Starts choices 1..`n` where the first went (`llm_addr`), to share its prompt's blocks.
    async fn start_other_choices(
        &self,
        gen: &pb::GenerateRequest,
        n: usize,
        llm_addr: &str,
        deadline: Option<Instant>,
        span: &tracing::Span,
    ) -> Result<Vec<tonic::Streaming<pb::GenerateResponse>>, GatewayError> {
        let ch = self
            .llm
            .channel(llm_addr)
            .ok_or_else(|| GatewayError::Internal(format!("no llm-svc replica at {llm_addr}")))?;
        let rest =
            try_join_all((1..n).map(|i| generate_choice(ch.clone(), gen.clone(), i, deadline)))
                .instrument(span.clone())
                .await
                .map_err(|s| GatewayError::upstream("llm-svc", llm_addr, &s))?;
        Ok(rest.into_iter().map(|r| r.into_inner()).collect())
    }
}

/// A request's images encoded and its prompt built ([`Orchestrator::prepare`]).
struct Prepared {
    prompt: Vec<u32>,
    images: Vec<pb::ImageEmbeddings>,
    /// Each image named by the identity of its bytes, to route the prompt by.
    image_ids: Vec<BlockHash>,
    /// What the images left upstream, released unless llm-svc takes it.
    held: Vec<Held>,
}

/// The first choice's generation, read up to its first message.
struct FirstChoice {
    meta: tonic::metadata::MetadataMap,
    stream: tonic::Streaming<pb::GenerateResponse>,
    message: Option<pb::GenerateResponse>,
    addr: String,
    load: Load,
}

/// Choice `choice` of `msg` started on the llm-svc replica behind `ch`.
async fn generate_choice(
    ch: tonic::transport::Channel,
    mut msg: pb::GenerateRequest,
    choice: usize,
    deadline: Option<Instant>,
) -> Result<tonic::Response<tonic::Streaming<pb::GenerateResponse>>, Status> {
    if let Some(s) = &mut msg.sampling {
        s.choice = choice as u32;
    }
    let req = with_deadline(msg, deadline).map_err(|e| Status::deadline_exceeded(e.to_string()))?;
    let mut client = LlmServiceClient::new(ch)
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES);
    client.generate(req).await
}

/// Whether `prompt` ends by opening `<think>` (a Thinking checkpoint's generation prompt):
/// the answer then starts with reasoning.
fn prompt_opens_reasoning(chat: &ChatTokenizer, prompt: &[u32]) -> bool {
    let tail = &prompt[prompt.len().saturating_sub(4)..];
    chat.decode(tail, false)
        .is_ok_and(|t| t.trim_end().ends_with(THINK_OPEN))
}

/// The grammar llm-svc is sent for `req`, whose prompt rendered to `prompt`: what
/// [`resolve_constraint`] makes of it, after the reasoning where the prompt opens one.
pub fn constraint_for(
    chat: &ChatTokenizer,
    req: &ChatRequest,
    prompt: &[u32],
) -> Result<Option<pb::Constraint>, GatewayError> {
    resolve_constraint(chat, req, prompt_opens_reasoning(chat, prompt))
}

/// The grammar llm-svc is sent: the request's output format, or the calls its `tool_choice`
/// forces ([`tool_call_grammar`], the tags named by id where they are single tokens). When the
/// answer starts by reasoning, the grammar applies after `</think>`, which must then be one
/// token of the vocabulary; if it is not, the request is refused rather than its reasoning
/// forced into the format.
///
/// The in-process pipeline (`vlm run`, the CLI's library) sends the same through
/// [`constraint_for`].
fn resolve_constraint(
    chat: &ChatTokenizer,
    req: &ChatRequest,
    reasoning: bool,
) -> Result<Option<pb::Constraint>, GatewayError> {
    let tag = |text: &'static str| {
        chat.added_token_id(text)
            .map_or(Tag::Text(text), Tag::Token)
    };
    let mut constraint =
        match tool_call_grammar(&req.tools, &tag(TOOL_CALL_OPEN), &tag(TOOL_CALL_CLOSE)) {
            Some(lark) => Some(pb::Constraint {
                grammar: Some(pb::constraint::Grammar::Lark(lark)),
                after_token: None,
            }),
            None => req.constraint.clone(),
        };
    if let (Some(c), true) = (&mut constraint, reasoning) {
        let Some(id) = chat.added_token_id(THINK_CLOSE) else {
            return Err(GatewayError::Invalid(format!(
                "this model reasons before it answers (its prompt opens {THINK_OPEN}), and \
                 {THINK_CLOSE} is not one token of its vocabulary, so the requested format \
                 cannot start after the reasoning; leave out the format or turn reasoning off \
                 (`chat_template_kwargs`)"
            )));
        };
        c.after_token = Some(id);
    }
    Ok(constraint)
}

/// What llm-svc is sent for a chat: the prompt's ids, each image's embeddings, and the chat's
/// sampling, token budget and output format (see [`resolve_constraint`] for the grammar
/// the orchestrator sends).
pub fn generate_request(
    req: &ChatRequest,
    prompt: Vec<u32>,
    images: Vec<pb::ImageEmbeddings>,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_token_ids: prompt,
        images,
        sampling: Some(vlm_proto::sampling::to_pb(&req.sampling)),
        max_new_tokens: req.max_new_tokens as u32,
        ignore_eos: req.ignore_eos,
        constraint: req.constraint.clone(),
    }
}

#[cfg(test)]
impl Orchestrator {
    /// Takes every free place, as that many requests in flight would (for tests of a full
    /// gateway); the places come back when the permit is dropped.
    pub(crate) fn fill(&self) -> tokio::sync::OwnedSemaphorePermit {
        let free = self.permits.available_permits() as u32;
        self.permits.clone().try_acquire_many_owned(free).unwrap()
    }
}

/// How each choice's text is read: its stop strings, and what the splitter looks for.
struct OutputKinds {
    stop: Vec<String>,
    /// The prompt opened `<think>`: the answer starts with reasoning.
    reasoning: bool,
    /// The request's tools are read out of the answer.
    tool_calls: bool,
}

/// A request's generations under way upstream, one per choice.
struct Started {
    output: OutputKinds,
    /// Each choice's stream, with the message already read from it (the first choice's first).
    upstreams: Vec<(
        Option<pb::GenerateResponse>,
        tonic::Streaming<pb::GenerateResponse>,
    )>,
    llm_addr: String,
    /// The replica's load count, held until the stream ends.
    load: Load,
    /// Held until the stream ends: concurrency is counted per stream, not per call.
    permit: tokio::sync::OwnedSemaphorePermit,
    prompt_tokens: u32,
    arrived: Instant,
    span: tracing::Span,
}

/// One choice's tokens as they are relayed: its own text (detokenizer and stop strings) and
/// its split into content, reasoning and tool calls.
struct ChoiceText<'a> {
    text: TextStream<'a>,
    output: OutputSplitter,
    generated: u32,
    last_token: Option<Instant>,
}

/// A choice's upstream messages, then `None` once the stream has ended.
type ChoiceStream =
    std::pin::Pin<Box<dyn Stream<Item = Option<Result<pb::GenerateResponse, Status>>> + Send>>;

/// How relaying a request ended.
enum Relayed {
    /// Every choice finished: the last one's `Done`, still to send.
    Finished(ChatEvent),
    Failed(GatewayError),
    /// The client's receiver is gone.
    ClientGone,
    /// The client took nothing for the send timeout.
    ClientStalled,
}

/// Offers `ev` to the client for at most `timeout`.
async fn send_event(
    tx: &mpsc::Sender<Result<ChatEvent, GatewayError>>,
    ev: ChatEvent,
    timeout: Duration,
) -> Result<(), Relayed> {
    match tokio::time::timeout(timeout, tx.send(Ok(ev))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Relayed::ClientGone),
        Err(_) => Err(Relayed::ClientStalled),
    }
}

/// Relays the LLM streams (one per choice) to the client as text, each event tagged with its
/// choice; a choice that ends (its finish reason, a stop string) drops its stream, which
/// cancels its generation, and returning drops the rest (client gone, error).
async fn forward(
    s: Started,
    tx: mpsc::Sender<Result<ChatEvent, GatewayError>>,
    mut guard: RequestGuard,
    chat: Arc<ChatTokenizer>,
    metrics: Metrics,
    send_timeout: Duration,
) {
    let Started {
        output,
        upstreams,
        llm_addr,
        load: _load,
        permit,
        prompt_tokens,
        arrived,
        span,
    } = s;
    let n = upstreams.len();
    let mut relay = Relay {
        choices: (0..n)
            .map(|_| ChoiceText {
                text: TextStream::new(chat.tokenizer(), output.stop.clone()),
                output: OutputSplitter::new(output.reasoning, output.tool_calls),
                generated: 0,
                last_token: None,
            })
            .collect(),
        token_bytes: TokenBytes::new(chat.tokenizer()),
        tx: &tx,
        send_timeout,
        metrics: &metrics,
        llm_addr: &llm_addr,
        arrived,
        prompt_tokens,
        ttft: None,
        generated: 0,
        finishes: vec![""; n],
    };
    let mut streams = choice_streams(upstreams);
    let relayed = relay.run(&mut streams).await;
    let generated = relay.generated;
    match relayed {
        Relayed::Finished(last) => {
            metrics.prompt_tokens.inc_by(prompt_tokens as u64);
            span.record("generated_tokens", generated);
            guard.outcome = "ok";
            tracing::info!(
                prompt_tokens,
                generated,
                finish = relay.finishes.join(","),
                ttft_ms = relay.ttft.map_or(0.0, |t| t.as_secs_f64() * 1e3),
                "request done"
            );
            let _ = tokio::time::timeout(send_timeout, tx.send(Ok(last))).await;
        }
        Relayed::Failed(e) => {
            drop(streams);
            guard.outcome = e.kind();
            tracing::warn!(error = %e, kind = e.kind(), "request failed mid-stream");
            let _ = tokio::time::timeout(send_timeout, tx.send(Err(e))).await;
        }
        Relayed::ClientGone => {
            tracing::info!(
                generated,
                "client went away; cancelling the generation upstream"
            );
        }
        Relayed::ClientStalled => {
            // Cancel upstream and free the permit now; the error is offered to the client for
            // one more timeout, in case it resumes reading.
            drop(streams);
            drop(permit);
            let e = GatewayError::DeadlineExceeded(format!(
                "the client read nothing for {send_timeout:?}; the generation was cancelled"
            ));
            guard.outcome = "client_stalled";
            tracing::warn!(generated, error = %e, "client stopped reading");
            drop(guard);
            let _ = tokio::time::timeout(send_timeout, tx.send(Err(e))).await;
        }
    }
}

/// Each choice's stream, its message already read (the first choice's first) put back in
/// front, keyed by choice.
fn choice_streams(
    upstreams: Vec<(
        Option<pb::GenerateResponse>,
        tonic::Streaming<pb::GenerateResponse>,
    )>,
) -> StreamMap<usize, ChoiceStream> {
    let mut streams: StreamMap<usize, ChoiceStream> = StreamMap::new();
    for (i, (read, up)) in upstreams.into_iter().enumerate() {
        let ended = futures::stream::once(async { None });
        let read = futures::stream::iter(read.map(Ok));
        streams.insert(i, Box::pin(read.chain(up).map(Some).chain(ended)));
    }
    streams
}

/// One request's relay: each choice's text, where its events go, and the counts its metrics
/// and log line take.
struct Relay<'a> {
    choices: Vec<ChoiceText<'a>>,
    token_bytes: TokenBytes<'a>,
    tx: &'a mpsc::Sender<Result<ChatEvent, GatewayError>>,
    send_timeout: Duration,
    metrics: &'a Metrics,
    llm_addr: &'a str,
    arrived: Instant,
    prompt_tokens: u32,
    /// When the request's first token came, from its arrival.
    ttft: Option<Duration>,
    /// Tokens generated, all choices together.
    generated: u32,
    /// How each choice ended, for the log line.
    finishes: Vec<&'static str>,
}

impl Relay<'_> {
    /// Relays every message of `streams` until the last choice's `Done` (returned, still to
    /// send), an error or the client's going.
    async fn run(&mut self, streams: &mut StreamMap<usize, ChoiceStream>) -> Relayed {
        while let Some((i, item)) = streams.next().await {
            let msg = match item {
                Some(Ok(m)) => m,
                None => {
                    return Relayed::Failed(GatewayError::Internal(
                        "the LLM stream ended without a finish reason".into(),
                    ))
                }
                Some(Err(st)) => {
                    return Relayed::Failed(GatewayError::upstream("llm-svc", self.llm_addr, &st))
                }
            };
            if let ControlFlow::Break(end) = self.message(i, msg, streams).await {
                return end;
            }
        }
        Relayed::Failed(GatewayError::Internal(
            "the LLM streams ended without a finish reason".into(),
        ))
    }

    /// Relays one message of choice `i`: its delta, and its `Done` if it ends the choice.
    async fn message(
        &mut self,
        i: usize,
        mut msg: pb::GenerateResponse,
        streams: &mut StreamMap<usize, ChoiceStream>,
    ) -> ControlFlow<Relayed> {
        let (mut visible, stop_hit) = match self.take_tokens(i, &msg.token_ids) {
            Ok(v) => v,
            Err(e) => return ControlFlow::Break(Relayed::Failed(e)),
        };
        let logprobs = std::mem::take(&mut msg.logprobs);
        let logprobs = match logprobs_with_text(&msg.token_ids, logprobs, &self.token_bytes) {
            Ok(l) => l,
            Err(e) => return ControlFlow::Break(Relayed::Failed(e)),
        };
        let choice = &mut self.choices[i];
        let finish =
            pb::FinishReason::try_from(msg.finish_reason).unwrap_or(pb::FinishReason::Unspecified);
        let done = stop_hit || finish != pb::FinishReason::Unspecified;
        if done && !stop_hit {
            match choice.text.finish() {
                Ok(tail) => visible.push_str(&tail),
                Err(e) => return ControlFlow::Break(Relayed::Failed(e.into())),
            }
        }
        let mut split = choice.output.push(&visible);
        if done {
            split.extend(choice.output.finish());
        }
        if !split.is_empty() || !msg.token_ids.is_empty() {
            let delta = ChatEvent::Delta {
                choice: i as u32,
                text: split.content,
                reasoning: split.reasoning,
                tool_calls: split.tool_calls,
                token_ids: msg.token_ids,
                logprobs,
            };
            if let Err(end) = send_event(self.tx, delta, self.send_timeout).await {
                return ControlFlow::Break(end);
            }
        }
        if !done {
            return ControlFlow::Continue(());
        }
        // A stop string: this choice's generation is cancelled here.
        streams.remove(&i);
        let choice = &self.choices[i];
        self.finishes[i] = if stop_hit {
            "stop_string"
        } else {
            finish.as_str_name()
        };
        let finish = match (stop_hit, finish) {
            _ if choice.output.called_tools() && finish != pb::FinishReason::Length => {
                pb::FinishReason::ToolCalls
            }
            (true, _) => pb::FinishReason::Stop,
            (false, f) => f,
        };
        let done = ChatEvent::Done {
            choice: i as u32,
            finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: choice.generated,
        };
        if streams.is_empty() {
            return ControlFlow::Break(Relayed::Finished(done));
        }
        match send_event(self.tx, done, self.send_timeout).await {
            Ok(()) => ControlFlow::Continue(()),
            Err(end) => ControlFlow::Break(end),
        }
    }

    /// Counts choice `i`'s new tokens (time to first token, inter-token latency) and runs
    /// them through its detokenizer: the text they complete, and whether a stop string hit.
    fn take_tokens(&mut self, i: usize, ids: &[u32]) -> Result<(String, bool), GatewayError> {
        let choice = &mut self.choices[i];
        let now = Instant::now();
        let mut visible = String::new();
        let mut stop_hit = false;
        for &t in ids {
            match (self.ttft, choice.last_token) {
                (None, _) => {
                    self.ttft = Some(now - self.arrived);
                    self.metrics
                        .time_to_first_token
                        .observe((now - self.arrived).as_secs_f64());
                }
                (Some(_), Some(prev)) => self
                    .metrics
                    .inter_token_latency
                    .observe((now - prev).as_secs_f64()),
                // A later choice's first token: neither.
                (Some(_), None) => {}
            }
            choice.last_token = Some(now);
            choice.generated += 1;
            self.generated += 1;
            let (v, hit) = choice.text.push(t)?;
            visible.push_str(&v);
            stop_hit |= hit;
        }
        self.metrics.generated_tokens.inc_by(ids.len() as u64);
        Ok((visible, stop_hit))
    }
}

/// What an encoded image holds upstream until llm-svc takes it (a shared-memory segment, a
/// device handoff); dropped without [`Held::keep`] (the request failed on the way), it is let go
/// of at once through the orchestrator's [`Release`].
struct Held {
    /// The names only (no tensors); `None` once kept.
    image: Option<pb::ImageEmbeddings>,
    release: Arc<dyn Release>,
}

impl Held {
    fn new(r: &EncodeResponse, release: Arc<dyn Release>) -> Self {
        Self {
            image: Some(pb::ImageEmbeddings {
                shm_segment: r.shm_segment.clone(),
                device_handle: r.device_handle,
                ..Default::default()
            }),
            release,
        }
    }

    /// llm-svc has it: leave it to llm-svc.
    fn keep(mut self) {
        self.image = None;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(image) = self.image.take() {
            self.release.release(&image);
        }
    }
}

/// The domains an llm-svc replica named ([`Orchestrator::note_llm_domains`]).
#[derive(Clone, Debug, Default, PartialEq)]
struct LlmDomains {
    shm: Option<String>,
    device: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway of the tiny fixture with llm-svc replicas at `llm` (none is ever called).
    fn orchestrator(llm: &[&str]) -> Orchestrator {
        let dir = crate::tiny_fixture();
        let image_token = crate::checkpoint::ModelIds::read(&dir)
            .unwrap()
            .image_token_id;
        let chat = ChatTokenizer::from_dir(&dir, image_token).unwrap();
        let llm: Vec<String> = llm.iter().map(|a| a.to_string()).collect();
        Orchestrator::new(
            chat,
            Some(Upstreams::new("vision-svc", &["127.0.0.1:1".into()], None).unwrap()),
            Upstreams::new("llm-svc", &llm, None).unwrap(),
            RequestLimits::default(),
            1,
            Metrics::new(),
        )
    }

    fn headers(domain: Option<&str>) -> tonic::metadata::MetadataMap {
        let mut h = tonic::metadata::MetadataMap::new();
        if let Some(d) = domain {
            h.insert(headers::SHM_DOMAIN, d.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_handoff_not_passed_on_is_let_go_and_one_passed_on_is_left_to_llm_svc() {
        #[derive(Default)]
        struct Released(std::sync::Mutex<Vec<u64>>);
        impl Release for Released {
            fn release(&self, image: &pb::ImageEmbeddings) {
                self.0.lock().unwrap().push(image.device_handle);
            }
        }
        let released = Arc::new(Released::default());
        let held = |id| {
            let r = EncodeResponse {
                device_handle: id,
                ..Default::default()
            };
            Held::new(&r, released.clone())
        };
        drop(held(7));
        held(9).keep();
        assert_eq!(
            *released.0.lock().unwrap(),
            vec![7],
            "7 let go, 9 still there"
        );
    }

    #[tokio::test]
    async fn logprobs_come_one_per_token_or_not_at_all() {
        let o = orchestrator(&["a:1"]);
        let tokens = TokenBytes::new(o.chat.tokenizer());
        assert!(logprobs_with_text(&[1, 2], vec![], &tokens)
            .unwrap()
            .is_empty());
        let e = logprobs_with_text(&[1, 2], vec![Default::default()], &tokens).unwrap_err();
        assert!(e.to_string().contains("1 logprobs for 2 tokens"), "{e}");
    }

    #[tokio::test]
    async fn the_device_domain_is_offered_when_every_replica_names_the_same_one() {
        let o = orchestrator(&["a:1"]);
        assert_eq!(o.llm_device_domain(), None);
        let mut h = headers(Some("d1"));
        h.insert(headers::DEVICE_DOMAIN, "p/cuda".parse().unwrap());
        o.note_llm_domains("a:1", &h);
        assert_eq!(o.llm_device_domain().as_deref(), Some("p/cuda"));
        assert_eq!(o.llm_shm_domain().as_deref(), Some("d1"));
        o.note_llm_domains("a:1", &headers(Some("d1")));
        assert_eq!(o.llm_device_domain(), None, "no longer named");
    }

    #[tokio::test]
    async fn shared_memory_is_offered_once_every_llm_replica_has_named_one_domain() {
        let mut o = orchestrator(&["a:1", "b:1"]);
        assert_eq!(o.llm_shm_domain(), None, "nothing heard yet");
        o.note_llm_domains("a:1", &headers(Some("d1")));
        assert_eq!(o.llm_shm_domain(), None, "b has not named one");
        o.note_llm_domains("b:1", &headers(Some("d2")));
        assert_eq!(o.llm_shm_domain(), None, "they differ");
        o.note_llm_domains("b:1", &headers(Some("d1")));
        assert_eq!(o.llm_shm_domain().as_deref(), Some("d1"));
        // A replica that stops naming one (restarted elsewhere) ends the offer.
        o.note_llm_domains("a:1", &headers(None));
        assert_eq!(o.llm_shm_domain(), None);
        o.note_llm_domains("a:1", &headers(Some("d1")));
        o.shared_memory = false;
        assert_eq!(o.llm_shm_domain(), None, "--no-shared-memory");
    }
}
