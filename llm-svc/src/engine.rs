//! The engine: one loop per device that owns the model and the paged KV cache, and serves every
//! request by continuous batching (as vLLM, SGLang and llama.cpp's server do).
//!
//! ```text
//! Engine::submit ─validate─▶ queue ─▶ loop: admit, schedule (scheduler.rs: running decodes +
//!   prefill chunks under a token budget, blocks from kv_cache.rs), one forward over the batch
//!   (step.rs), sample per sequence, send each its token ─▶ RequestStream
//! ```
//! No request thread touches the device: callers hold an [`Engine`] (a cheap handle) and get
//! their tokens through a [`RequestStream`]. Dropping the stream cancels the request; its cache
//! blocks are freed at the next step. A step that fails ends the requests in it with an error
//! and the others go on.
//!
//! A sequence's tokens do not depend on what else is in the batch: on the CPU they are equal
//! bit for bit to the same request run alone (every op computes each row, and each sequence's
//! attention, independently of the others); on a GPU batched GEMMs may round differently from
//! the one-row kernels, within the stated tolerances.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tracing::Span;
use vlm_compute::owner_thread::OwnerThread;
use vlm_compute::{Backend, KvCacheDtype, Weights};

use crate::grammar::{Grammar, Grammars};
use crate::kv_cache::{kv_formats, BlockPool, PagedKv, PrefixStats};
use crate::kv_events::{KvEventPublisher, KvEventsConfig, PendingEvents};
use crate::kv_sizing::{kv_blocks, CacheBudget, KvCacheSize};
use crate::metrics::EngineMetrics;
use crate::model::TextModel;
use crate::mrope::{prompt_positions, ImageSpan};
use crate::request::{Event, FinishReason, GenerateRequest, Generation, RequestStream, TokenEvent};
use crate::scheduler::{Left, Planned, Scheduler, SchedulerConfig};
use crate::sequence::{image_hash, Pick, PlacedImage, Sequence, SequenceLimits};
use crate::step::{StepOutput, StepRunner};
use crate::validation;
use crate::{Error, ModelConfig, Result};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Cap on prompt + generated tokens per sequence (the model's own, and the cache's size,
    /// cap it too).
    pub max_context: Option<usize>,
    pub kv_cache: KvCacheSize,
    /// How the cache stores keys and values: the backend's own width, or FP8 e4m3 (one byte an
    /// element: twice f16's tokens in the same memory) with the checkpoint's scales or 1.0.
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Most sequences in one step.
    pub max_batch_seqs: usize,
    /// Most tokens in one step: prompts longer than this are prefilled in chunks between
    /// decode steps.
    pub max_batch_tokens: usize,
    /// Reuse computed blocks of earlier requests that began with the same tokens and images.
    pub prefix_caching: bool,
    /// Publish the prefix cache's changes as vLLM's KV events (off when `None`).
    pub kv_events: Option<KvEventsConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_context: None,
            kv_cache: KvCacheSize::Auto,
            kv_cache_dtype: KvCacheDtype::Auto,
            block_size: 16,
            max_batch_seqs: 128,
            max_batch_tokens: 512,
            prefix_caching: true,
            kv_events: None,
        }
    }
}

/// What the handles share with the loop.
struct Shared {
    cfg: ModelConfig,
    max_context: usize,
    kv_tokens: usize,
    /// What the model's weights and the KV cache take on the backend.
    weight_bytes: usize,
    kv_bytes: usize,
    kv_per_token: usize,
    metrics: EngineMetrics,
    next_id: AtomicU64,
    /// Compiles requests' constraints; or why this checkpoint's vocabulary cannot have them.
    grammars: std::result::Result<Grammars, String>,
    /// Where KV events go out, as bound or connected to.
    kv_events_endpoint: Option<String>,
}

/// A request the engine has checked, its grammar compiled ([`Engine::check_request`]).
pub struct CheckedRequest {
    req: GenerateRequest,
    spans: Vec<ImageSpan>,
    grammar: Option<Grammar>,
}

/// A handle on the engine loop: cheap to clone, safe to use from any thread. The loop ends
/// when the last clone drops, and that drop waits for it to free the model, the cache and the
/// recorded steps ([`OwnerThread`]).
#[derive(Clone)]
pub struct Engine {
    tx: Sender<Sequence>,
    shared: Arc<Shared>,
    /// After `tx`: fields drop in order, so the last clone's channel is closed before its
    /// drop waits for the loop.
    _thread: Arc<OwnerThread>,
}

impl Engine {
    /// Loads the text decoder of the checkpoint in `dir` onto `backend`, allocates the KV
    /// cache, and starts the loop on a thread of its own. Metrics go to `registry`.
    pub fn load<B: Backend>(
        dir: &Path,
        weights: &Weights,
        backend: B,
        cfg: EngineConfig,
        registry: &prometheus::Registry,
    ) -> Result<Self> {
        let model_cfg = ModelConfig::from_dir(dir)?;
        if cfg.block_size == 0 || cfg.max_batch_seqs == 0 || cfg.max_batch_tokens == 0 {
            return Err(Error::Config(format!(
                "block size, batch sequences and batch tokens must be at least 1, got {}, {}, {}",
                cfg.block_size, cfg.max_batch_seqs, cfg.max_batch_tokens
            )));
        }
        let text = &model_cfg.text;
        // The cache's format first: a format the backend's kernels lack, or scales that are no
        // scales, are refused before the weights are loaded.
        let layers = weights
            .pp(model_cfg.architecture.decoder_prefix())
            .pp("layers");
        let (formats, scales) = kv_formats(cfg.kv_cache_dtype, &layers, text)?;
        for f in &formats {
            for format in [f.k, f.v] {
                backend.check_kv_format(format, text.num_key_value_heads, text.head_dim)?;
            }
        }
        let model = TextModel::new(model_cfg.clone(), weights, backend)?;
        let model_max = cfg.max_context.map_or(text.max_position_embeddings, |m| {
            m.min(text.max_position_embeddings)
        });
        let budget = CacheBudget {
            kv_cache: cfg.kv_cache,
            kv_cache_dtype: cfg.kv_cache_dtype,
            block_size: cfg.block_size,
            max_batch_seqs: cfg.max_batch_seqs,
            max_batch_tokens: cfg.max_batch_tokens,
        };
        let blocks = kv_blocks(model.backend(), &model_cfg, &budget, model_max)?;
        let bs = cfg.block_size;
        let kv = PagedKv::new(model.backend(), text, blocks, bs, &formats)?;
        let kv_tokens = (blocks - 1) * bs;
        let max_context = model_max.min(kv_tokens);
        let per_token = PagedKv::<B>::bytes_per_token(text, cfg.kv_cache_dtype);
        tracing::info!(
            blocks = blocks - 1,
            block_size = bs,
            tokens = kv_tokens,
            gib = (kv_tokens * per_token) as f64 / (1u64 << 30) as f64,
            kib_per_token = per_token / 1024,
            dtype = %cfg.kv_cache_dtype,
            scales = ?scales,
            max_context,
            max_batch_seqs = cfg.max_batch_seqs,
            max_batch_tokens = cfg.max_batch_tokens,
            prefix_caching = cfg.prefix_caching,
            "KV cache allocated"
        );
        let metrics = EngineMetrics::new(registry);
        metrics.kv_blocks_total.set((blocks - 1) as i64);
        // Without grammar support the model still serves; constrained requests are refused.
        let grammars = Grammars::load(dir, text.vocab_size, &model_cfg.eos_token_ids)
            .map_err(|e| e.to_string())
            .inspect_err(|e| {
                tracing::warn!(error = %e, "structured outputs are off: the vocabulary could not be read for grammars")
            });
        let kv_events = cfg
            .kv_events
            .as_ref()
            .map(KvEventPublisher::start)
            .transpose()?;
        let kv_events_endpoint = kv_events.as_ref().map(|p| p.endpoint().to_string());
        let shared = Arc::new(Shared {
            cfg: model_cfg.clone(),
            max_context,
            kv_tokens,
            weight_bytes: model.weight_bytes(),
            kv_bytes: blocks * bs * per_token,
            kv_per_token: per_token,
            metrics,
            next_id: AtomicU64::new(0),
            grammars,
            kv_events_endpoint,
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let mut pool = BlockPool::new(blocks, bs);
        if kv_events.is_some() {
            pool.record_changes();
        }
        let sched = Scheduler::new(SchedulerConfig {
            max_seqs: cfg.max_batch_seqs,
            max_tokens: cfg.max_batch_tokens,
            prefix_caching: cfg.prefix_caching,
        });
        let text = text.clone();
        let loop_shared = shared.clone();
        let thread = OwnerThread::spawn("llm-engine", move || {
            // Built here: recorded steps (CUDA graphs) stay on the thread that made them.
            let steps = StepRunner::new(&text, bs, max_context, cfg.max_batch_seqs);
            EngineLoop {
                model,
                kv,
                pool,
                sched,
                steps,
                shared: loop_shared,
                reported: Reported::default(),
                kv_events: kv_events.map(|publisher| KvEventsOut {
                    publisher,
                    pending: PendingEvents::default(),
                }),
            }
            .run(rx)
        })
        .map_err(|e| Error::Engine(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            tx,
            shared,
            _thread: Arc::new(thread),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.shared.cfg
    }

    /// Most tokens (prompt + generated) one sequence may hold.
    pub fn max_context(&self) -> usize {
        self.shared.max_context
    }

    /// Tokens the KV cache holds, all sequences together.
    pub fn kv_cache_tokens(&self) -> usize {
        self.shared.kv_tokens
    }

    /// Bytes the text decoder's weights take on the backend, as stored.
    pub fn weight_bytes(&self) -> usize {
        self.shared.weight_bytes
    }

    /// Bytes the KV cache takes on the backend (every block, the spare one included).
    pub fn kv_cache_bytes(&self) -> usize {
        self.shared.kv_bytes
    }

    /// Bytes one cached token takes: keys and values of every layer, as the cache stores them.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.shared.kv_per_token
    }

    /// The grammar compiler of this model's vocabulary, or why there is none.
    pub fn grammars(&self) -> std::result::Result<&Grammars, &str> {
        self.shared.grammars.as_ref().map_err(String::as_str)
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// Where KV events are published (the port resolved if `:0` was bound), if they are.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.shared.kv_events_endpoint.as_deref()
    }

    /// Checks a request without running it (its grammar compiled, then dropped).
    pub fn validate(&self, req: &GenerateRequest) -> Result<()> {
        self.check(req)?;
        self.grammar(req).map(|_| ())
    }

    /// The request's constraint compiled, if it has one.
    fn grammar(&self, req: &GenerateRequest) -> Result<Option<Grammar>> {
        let Some(c) = &req.constraint else {
            return Ok(None);
        };
        match &self.shared.grammars {
            Ok(g) => g.compile(c).map(Some),
            Err(why) => Err(Error::InvalidParameter(format!(
                "constraint: this model's vocabulary does not support grammars ({why})"
            ))),
        }
    }

    /// Checks a request against the model ([`crate::validation`]) and returns where its
    /// images sit in the prompt.
    fn check(&self, req: &GenerateRequest) -> Result<Vec<ImageSpan>> {
        validation::check(req, self.config(), self.shared.max_context)
    }

    /// Checks a request and compiles its grammar, once, for [`Engine::submit_checked`]. (A
    /// large JSON schema can take milliseconds to compile: async callers run this on a
    /// blocking thread.)
    pub fn check_request(&self, req: GenerateRequest) -> Result<CheckedRequest> {
        let spans = self.check(&req)?;
        let grammar = self.grammar(&req)?;
        Ok(CheckedRequest {
            req,
            spans,
            grammar,
        })
    }

    /// Queues a request: its tokens arrive on the returned stream. `span` is the request's
    /// (the engine's prefill and decode spans and its log lines about the request go under
    /// it); past `deadline` the request ends with [`Error::DeadlineExceeded`].
    pub fn submit(
        &self,
        req: GenerateRequest,
        deadline: Option<Instant>,
        span: Span,
    ) -> Result<RequestStream> {
        self.submit_checked(self.check_request(req)?, deadline, span)
    }

    /// [`Engine::submit`] for a request [`Engine::check_request`] has checked.
    pub fn submit_checked(
        &self,
        checked: CheckedRequest,
        deadline: Option<Instant>,
        span: Span,
    ) -> Result<RequestStream> {
        let CheckedRequest {
            req,
            spans,
            grammar,
        } = checked;
        let seed = req.sampling.seed.unwrap_or_else(|| rand::rng().random());
        let positions = prompt_positions(req.prompt.len(), &spans);
        let images = spans
            .iter()
            .zip(req.images)
            .map(|(s, img)| PlacedImage {
                start: s.start,
                len: s.len(),
                hash: image_hash(&img.embeds, img.grid_thw),
                embeds: img.embeds,
                deepstack: img.deepstack,
            })
            .collect();
        let (tx, stream) = RequestStream::channel();
        let limits = SequenceLimits {
            max_new_tokens: req.max_new_tokens,
            max_len: self.shared.max_context,
            ignore_eos: req.ignore_eos,
            return_logits: req.return_logits,
            deadline,
        };
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let mut seq = Sequence::new(
            id,
            req.prompt,
            positions,
            images,
            (req.sampling, seed),
            limits,
            tx,
            span,
        );
        seq.grammar = grammar.map(crate::grammar::SequenceGrammar::new);
        self.tx
            .send(seq)
            .map_err(|_| Error::Engine("the engine has stopped".into()))?;
        Ok(stream)
    }

    /// Runs a request to completion from a thread outside any async runtime, calling
    /// `on_token` for every generated token; `Break` stops the request (finish `Stopped`).
    pub fn generate(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let started = Instant::now();
        let mut stream = self.submit(req.clone(), None, Span::current())?;
        let (mut tokens, mut first) = (Vec::new(), None);
        loop {
            match stream.blocking_recv() {
                Some(Event::Token {
                    id,
                    logits,
                    logprob,
                }) => {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    tokens.push(id);
                    let flow = on_token(&TokenEvent {
                        token: id,
                        index: tokens.len() - 1,
                        logits: logits.as_deref(),
                        logprob: logprob.as_ref(),
                    });
                    if flow.is_break() {
                        let first = first.unwrap_or(now);
                        return Ok(Generation {
                            tokens,
                            finish: FinishReason::Stopped,
                            prompt_tokens: req.prompt.len(),
                            cached_tokens: 0,
                            prefill: first - started,
                            decode: now - first,
                        });
                    }
                }
                Some(Event::Finished(g)) => return Ok(g),
                Some(Event::Failed(e)) => return Err(e),
                None => return Err(Error::Engine("the engine has stopped".into())),
            }
        }
    }
}

/// Counter values already reported (Prometheus counters only go up by deltas), and the steps
/// since the last summary line.
#[derive(Default)]
struct Reported {
    prefix: PrefixStats,
    preemptions: u64,
    last_log: Option<Instant>,
    tokens_since_log: u64,
    /// Decode-only and mixed steps.
    decode_steps: StepTotals,
    mixed_steps: StepTotals,
}

/// Steps of one kind since the last summary line.
#[derive(Default, Clone, Copy)]
struct StepTotals {
    count: u64,
    seconds: f64,
    /// Of `seconds`, host time until the step's work was queued ([`StepOutput::enqueue`]).
    enqueue_seconds: f64,
    tokens: u64,
}

impl std::fmt::Display for StepTotals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.count.max(1) as f64;
        write!(
            f,
            "{} x {:.1} ms ({:.1} ms to enqueue), {:.0} tokens",
            self.count,
            1e3 * self.seconds / n,
            1e3 * self.enqueue_seconds / n,
            self.tokens as f64 / n
        )
    }
}

/// The loop's state; lives on the engine thread.
struct EngineLoop<B: Backend> {
    model: TextModel<B>,
    kv: PagedKv<B>,
    pool: BlockPool,
    sched: Scheduler,
    steps: StepRunner<B>,
    shared: Arc<Shared>,
    reported: Reported,
    kv_events: Option<KvEventsOut>,
}

/// KV events on their way out: the publisher, and the cache's changes waiting for token ids.
struct KvEventsOut {
    publisher: KvEventPublisher,
    pending: PendingEvents,
}

/// How a sequence left the engine.
enum Exit {
    Finished(FinishReason),
    Cancelled,
    Failed(Error),
}

impl<B: Backend> EngineLoop<B> {
    fn run(mut self, rx: Receiver<Sequence>) {
        let mut open = true;
        loop {
            if self.sched.is_idle() {
                self.report();
                vlm_compute::release_idle_memory(self.model.backend(), "llm");
                if !open {
                    break;
                }
                match rx.recv() {
                    Ok(seq) => self.admit(seq),
                    Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(seq) => self.admit(seq),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.reap();
            let plan = self.sched.schedule(&mut self.pool);
            if plan.is_empty() {
                // Nothing can run: only possible if the queue's head can never fit (the
                // context is capped by the cache's size, so this is a guard, not a path).
                if let Some(seq) = self.sched.take_unschedulable() {
                    let e = Error::Engine("the request does not fit in the KV cache".into());
                    self.exit(seq, Exit::Failed(e));
                }
                continue;
            }
            self.step(&plan);
            self.publish_kv_events();
            self.report();
        }
        tracing::debug!("engine loop stopped");
    }

    fn admit(&mut self, seq: Sequence) {
        self.shared
            .metrics
            .prompt_tokens
            .inc_by(seq.prompt_len as u64);
        self.sched.add(seq);
    }

    /// Ends sequences whose client has gone, whose deadline has passed or whose grammar can
    /// go no further.
    fn reap(&mut self) {
        let now = Instant::now();
        let expired = |s: &Sequence| s.limits.deadline.is_some_and(|d| now > d);
        let stuck = |s: &Sequence| s.grammar_failure().is_some();
        for seq in self
            .sched
            .remove_where(|s| s.abandoned() || expired(s) || stuck(s))
        {
            let why = if seq.abandoned() {
                Exit::Cancelled
            } else if let Some(why) = seq.grammar_failure() {
                Exit::Failed(Error::Engine(format!(
                    "the request's grammar could not go on: {why}"
                )))
            } else {
                Exit::Failed(Error::DeadlineExceeded {
                    generated: seq.generated(),
                })
            };
            self.exit(seq, why);
        }
    }

    /// Runs one step and hands out its tokens.
    fn step(&mut self, plan: &[Planned]) {
        let started = Instant::now();
        let running = self.sched.running();
        let sampling = plan
            .iter()
            .filter(|p| running[p.index].computed + p.tokens == running[p.index].tokens.len())
            .count();
        let result = self.steps.run(&self.model, &mut self.kv, plan, running);
        let m = &self.shared.metrics;
        let seconds = started.elapsed().as_secs_f64();
        let tokens = plan.iter().map(|p| p.tokens).sum::<usize>();
        let decode_only = tokens == plan.len() && sampling == plan.len();
        let kind = if decode_only { "decode" } else { "mixed" };
        m.step_seconds.with_label_values(&[kind]).observe(seconds);
        m.step_tokens.observe(tokens as f64);
        let totals = if decode_only {
            &mut self.reported.decode_steps
        } else {
            &mut self.reported.mixed_steps
        };
        totals.count += 1;
        totals.seconds += seconds;
        totals.tokens += tokens as u64;
        if let Ok(out) = &result {
            totals.enqueue_seconds += out.enqueue.as_secs_f64();
            if !out.masks.is_zero() {
                m.grammar_mask_seconds.observe(out.masks.as_secs_f64());
            }
        }
        match result {
            Ok(out) => self.advance(plan, out),
            Err(e) => {
                tracing::error!(error = %e, sequences = plan.len(), "engine step failed; ending its requests");
                for seq in self.sched.remove_planned(plan) {
                    let err =
                        Error::Engine(format!("the engine step running this request failed: {e}"));
                    self.exit(seq, Exit::Failed(err));
                }
            }
        }
    }

    /// Hands a step's results to the scheduler and ends the sequences that finished.
    fn advance(&mut self, plan: &[Planned], out: StepOutput) {
        let picks: Vec<Option<Pick>> = out
            .picks
            .into_iter()
            .zip(out.logits)
            .zip(out.logprobs)
            .map(|((token, logits), logprob)| {
                token.map(|token| Pick {
                    token,
                    logits,
                    logprob,
                })
            })
            .collect();
        let sampled = picks.iter().flatten().count() as u64;
        self.reported.tokens_since_log += sampled;
        self.shared.metrics.generated_tokens.inc_by(sampled);
        let eos = &self.shared.cfg.eos_token_ids;
        for (seq, left) in self
            .sched
            .update_from_output(plan, picks, &mut self.pool, eos)
        {
            let why = match left {
                Left::Finished(f) => Exit::Finished(f),
                Left::NoFiniteLogits => Exit::Failed(Error::Engine(format!(
                    "the model's logits for output token {} are not finite (NaN or infinite): \
                     an activation overflowed or the weights are damaged, so the request was \
                     ended rather than answered with an arbitrary token",
                    seq.generated() + 1
                ))),
            };
            self.exit(seq, why);
        }
    }

    /// Frees a sequence's blocks and sends (or logs) how it ended.
    fn exit(&mut self, mut seq: Sequence, why: Exit) {
        self.note_stored_blocks(&seq);
        self.pool.release(seq.blocks.drain(..).rev());
        let generated = seq.generated();
        let _guard = seq.span.enter();
        let id = seq.id;
        let now = Instant::now();
        let first = seq.first_token.unwrap_or(now);
        let decode = now - first;
        if let Some(phase) = seq.phase.take() {
            if seq.first_token.is_some() {
                phase.record("tokens", generated);
                if generated > 1 {
                    let rate = (generated - 1) as f64 / decode.as_secs_f64().max(1e-9);
                    phase.record("tokens_per_s", format!("{rate:.1}"));
                }
            }
        }
        let requests = &self.shared.metrics.requests;
        match why {
            Exit::Finished(finish) => {
                let g = Generation {
                    tokens: seq.tokens[seq.prompt_len..].to_vec(),
                    finish,
                    prompt_tokens: seq.prompt_len,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    prefill: first - seq.arrived,
                    decode,
                };
                tracing::info!(
                    seq = id,
                    generated,
                    cached_tokens = g.cached_tokens,
                    preemptions = seq.preemptions,
                    prefill_ms = g.prefill.as_secs_f64() * 1e3,
                    decode_ms = g.decode.as_secs_f64() * 1e3,
                    finish = finish.as_str(),
                    "generation finished"
                );
                requests.with_label_values(&[finish.as_str()]).inc();
                let _ = seq.events.send(Event::Finished(g));
            }
            Exit::Cancelled => {
                tracing::info!(
                    seq = id,
                    generated,
                    "client went away; generation cancelled"
                );
                requests.with_label_values(&["cancelled"]).inc();
            }
            Exit::Failed(e) => {
                let label = match e {
                    Error::DeadlineExceeded { .. } => {
                        tracing::warn!(
                            seq = id,
                            generated,
                            "deadline exceeded; generation stopped"
                        );
                        "deadline"
                    }
                    _ => {
                        tracing::error!(seq = id, generated, error = %e, "generation failed");
                        "error"
                    }
                };
                requests.with_label_values(&[label]).inc();
                let _ = seq.events.send(Event::Failed(e));
            }
        }
    }

    /// Gives the KV events waiting for their token ids those `seq` holds (it is leaving: later
    /// it cannot tell).
    fn note_stored_blocks(&mut self, seq: &Sequence) {
        if let Some(out) = &mut self.kv_events {
            out.pending.extend(self.pool.take_changes());
            let bs = self.pool.block_size();
            out.pending
                .fill(&seq.hashes, seq.registered, &seq.tokens, bs);
        }
    }

    /// Publishes the step's changes to the prefix cache, their token ids read from the running
    /// sequences (those that left gave theirs in [`EngineLoop::exit`]).
    fn publish_kv_events(&mut self) {
        let Some(out) = &mut self.kv_events else {
            return;
        };
        out.pending.extend(self.pool.take_changes());
        let bs = self.pool.block_size();
        for seq in self.sched.running() {
            out.pending
                .fill(&seq.hashes, seq.registered, &seq.tokens, bs);
        }
        let events = out.pending.take(bs);
        out.publisher.publish(events);
    }

    /// Gauges to the present, counters up to date, and a summary line every 10 s of work.
    fn report(&mut self) {
        let m = &self.shared.metrics;
        m.kv_blocks_in_use.set(self.pool.num_in_use() as i64);
        m.sequences
            .with_label_values(&["running"])
            .set(self.sched.num_running() as i64);
        m.sequences
            .with_label_values(&["waiting"])
            .set(self.sched.num_waiting() as i64);
        let stats = self.pool.stats();
        let r = &mut self.reported;
        m.prefix_queried_tokens
            .inc_by(stats.queried_tokens - r.prefix.queried_tokens);
        m.prefix_hit_tokens
            .inc_by(stats.hit_tokens - r.prefix.hit_tokens);
        m.preemptions.inc_by(self.sched.preemptions - r.preemptions);
        r.prefix = stats;
        r.preemptions = self.sched.preemptions;
        let now = Instant::now();
        let since = *r.last_log.get_or_insert(now);
        if now - since >= Duration::from_secs(10) && r.tokens_since_log > 0 {
            tracing::info!(
                decode_steps = %r.decode_steps,
                mixed_steps = %r.mixed_steps,
                running = self.sched.num_running(),
                waiting = self.sched.num_waiting(),
                kv_blocks_in_use = self.pool.num_in_use(),
                kv_use_pct = format!("{:.1}", 100.0 * self.pool.num_in_use() as f64 / self.pool.capacity() as f64),
                generated_tok_per_s = format!("{:.1}", r.tokens_since_log as f64 / (now - since).as_secs_f64()),
                prefix_hit_pct = format!("{:.1}", 100.0 * stats.hit_tokens as f64 / stats.queried_tokens.max(1) as f64),
                preemptions = self.sched.preemptions,
                recorded_batch_sizes = ?self.steps.recorded_buckets(),
                "engine"
            );
            r.last_log = Some(now);
            r.tokens_since_log = 0;
            r.decode_steps = Default::default();
            r.mixed_steps = Default::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_caches_blocks_of_the_size_the_gateway_routes_by() {
        assert_eq!(
            EngineConfig::default().block_size,
            vlm_proto::prefix::KV_BLOCK_SIZE
        );
    }
}
