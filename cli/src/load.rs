//! `vlm load`: a closed-loop load generator for the gateway's public APIs.
//!
//! A level of concurrency C runs C clients; each sends a streamed chat, reads it to its end
//! and sends the next, until the level's requests are spent or its time is up. Requests mix
//! prompt lengths, carry an image every K-th time and go through the OpenAI-style HTTP API
//! (server-sent events) or gRPC `ChatStream`. For each level: requests answered, errors by
//! kind, output and prompt tokens/s and requests/s over the level's wall time, and the
//! percentiles of time to first token and inter-token latency; with both APIs, the same for
//! each (one run, one server state: the fair comparison of the two); and how much of the
//! prompts llm-svc found in its prefix cache, where the gateway's `/metrics` shows it. A
//! server that has seen a run's prompts before (the same `--seed` sent to it again) answers
//! them from that cache: prefill all but skipped, a different measurement, which the table
//! says.
//!
//! With `turns` > 1 (`--turns`), each client holds conversations instead: every turn resends
//! the conversation's history (its user messages, their images, and an assistant answer for
//! each) plus a new user message, as chat clients do, so the prefix cache (and routing to the
//! replica that holds it) shows in the hit rate and the time to first token.
//!
//! The binary (`vlm load`) starts the local stack or points at a running gateway; this module
//! makes the requests, sends them and counts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use base64::Engine as _;
use futures::StreamExt;
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use tokenizers::Tokenizer;
use vlm_proto::pb::{self, content_part, gateway_client::GatewayClient, ContentPart};

/// Longest one request may take before the client gives up on it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// Which public API a request goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions` with `stream: true` (server-sent events).
    Http,
    /// `vlm.v1.Gateway/ChatStream`.
    Grpc,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::Http => "http",
            Api::Grpc => "grpc",
        }
    }
}

/// Which APIs a run sends its requests through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiMix {
    /// Alternate between HTTP and gRPC, image and text requests each split evenly.
    Mixed,
    Http,
    Grpc,
}

impl ApiMix {
    pub fn name(self) -> &'static str {
        match self {
            ApiMix::Mixed => "mixed",
            ApiMix::Http => "http",
            ApiMix::Grpc => "grpc",
        }
    }
}

/// Where a running gateway listens.
#[derive(Clone, Debug)]
pub struct Target {
    /// Base URL of the HTTP API, e.g. `http://127.0.0.1:8080`.
    pub http: Option<String>,
    /// URL of the gRPC API, e.g. `http://127.0.0.1:50050`.
    pub grpc: Option<String>,
    /// Name sent in HTTP requests' `model` (the gateway serves one model and accepts any).
    pub model_name: String,
}

/// What the requests of a run look like.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Mean text tokens per prompt; each prompt draws its length uniformly from
    /// [0.5x, 1.5x] (the chat template's tokens and an image's come on top).
    pub prompt_tokens: usize,
    /// Tokens each request generates, exactly: requests are sent with `ignore_eos`.
    pub max_tokens: usize,
    /// Every `image_every`-th request (the 0th, the K-th, ...) carries one image; 0: none.
    pub image_every: usize,
    /// Side in pixels of those square PNG images.
    pub image_side: u32,
    pub api: ApiMix,
    /// The same seed gives the same requests, in the same order.
    pub seed: u64,
    /// How tokens are chosen: greedy by default, or sampled as real clients ask.
    pub sampling: LoadSampling,
    /// Every request answers to [`crate::bench::bench_schema`] (structured outputs).
    pub json_schema: bool,
    /// Turns per conversation: 1, every request a new chat; T > 1, requests `c*T .. c*T+T-1`
    /// are the turns of conversation `c`, each resending the ones before.
    pub turns: usize,
}

/// The sampling fields every request of a run sends (request `i` also sends seed `i`, so a
/// run is reproducible).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadSampling {
    pub temperature: f32,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub presence_penalty: Option<f32>,
}

/// One request of the run, ready to send.
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// Its index in the run (also its sampling seed).
    pub index: u64,
    pub api: Api,
    /// The conversation's earlier turns, oldest first (empty for a single-turn workload).
    pub history: Vec<PastTurn>,
    pub text: String,
    /// PNG bytes.
    pub image: Option<Vec<u8>>,
}

/// An earlier turn of a conversation, resent with every later one.
#[derive(Clone, Debug)]
pub struct PastTurn {
    pub user: String,
    /// PNG bytes.
    pub image: Option<Vec<u8>>,
    /// The assistant's answer as the history gives it: text drawn from the turn's seed, as long
    /// as `max_tokens`, not what the model said (as a client replaying a recorded chat). The
    /// prefix cache's hit is the earlier prompt's blocks either way.
    pub assistant: String,
}

/// Common English words, most of them one token (with the leading space) in Qwen's vocabulary.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "my", "new",
    "about", "out", "also", "two", "any", "up", "first", "could", "our", "then", "most", "see",
    "me", "should", "after", "said", "your", "very", "between", "many", "over", "like", "those",
    "did", "now", "even", "well", "where", "must", "people", "through", "how", "same", "work",
    "being", "because", "man", "life", "before", "each", "much", "under", "years", "way", "great",
    "state", "both", "use", "upon", "own", "used", "however", "us", "part", "good", "world",
    "make", "three", "while", "long", "day", "without", "just", "men", "general", "during",
    "another", "little", "found", "here", "system", "does", "de", "down", "number", "case",
    "against", "might", "still", "back", "right", "set", "know", "place", "made", "take", "every",
    "old", "water", "since", "table", "light", "river", "stone", "window", "garden", "music",
    "paper", "city", "horse", "market", "winter", "summer", "road", "green", "blue", "red",
    "small", "large", "open", "close", "north", "south", "east", "west", "house", "field", "train",
    "ship", "bird", "tree", "cloud", "morning", "evening", "night", "color", "square", "circle",
    "line", "point", "image", "picture", "camera", "street", "door", "bridge", "mountain",
    "forest", "island", "coffee", "bread", "apple", "orange", "glass", "metal", "wood", "fire",
    "snow", "rain", "wind", "sun", "moon", "star", "book", "letter",
];

/// Makes request number `i` of a run from the workload and its seed alone, so reruns send the
/// same requests and every level gets prompts no earlier level sent.
pub struct RequestMaker {
    workload: Workload,
    /// The model's tokenizer, to cut each prompt to its drawn token count; without it each
    /// word is counted as one token.
    tokenizer: Option<Tokenizer>,
}

impl RequestMaker {
    pub fn new(workload: Workload, tokenizer: Option<Tokenizer>) -> Self {
        Self {
            workload,
            tokenizer,
        }
    }

    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// Request number `index` of the run: a new chat, or with `turns` > 1 turn `index % turns`
    /// of conversation `index / turns`, its earlier turns made again from their own indices.
    pub fn make(&self, index: u64) -> anyhow::Result<LoadRequest> {
        let turns = self.workload.turns.max(1) as u64;
        let first = index - index % turns;
        let mut history = Vec::new();
        for earlier in first..index {
            let turn = self.make_one(earlier)?;
            let mut rng = ChaCha8Rng::seed_from_u64(self.workload.seed ^ 0xa551_57a7);
            rng.set_stream(earlier);
            history.push(PastTurn {
                user: turn.text,
                image: turn.image,
                assistant: self.text(&mut rng, self.workload.max_tokens.max(1))?,
            });
        }
        let mut req = self.make_one(index)?;
        req.history = history;
        Ok(req)
    }

    /// The newest user message of request `index`, without history.
    fn make_one(&self, index: u64) -> anyhow::Result<LoadRequest> {
        let w = &self.workload;
        // Its own stream of the seed's generator: request i does not depend on how many
        // requests came before it, or on which level sends it.
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        rng.set_stream(index);
        let low = w.prompt_tokens.div_ceil(2).max(1);
        let high = (w.prompt_tokens * 3 / 2).max(low);
        let tokens = rng.random_range(low..=high);
        let text = self.text(&mut rng, tokens)?;
        let every = w.image_every as u64;
        let has_image = every > 0 && index % every == 0;
        let image = if has_image {
            Some(png(&mut rng, w.image_side)?)
        } else {
            None
        };
        // Mixed: even and odd places among the requests of the same kind, so HTTP and gRPC
        // each get half the image requests and half the text ones whatever K is.
        let place = match (has_image, every) {
            (_, 0) => index,
            (true, _) => index / every,
            (false, _) => index - index.div_ceil(every),
        };
        let api = match w.api {
            ApiMix::Http => Api::Http,
            ApiMix::Grpc => Api::Grpc,
            ApiMix::Mixed if place % 2 == 0 => Api::Http,
            ApiMix::Mixed => Api::Grpc,
        };
        Ok(LoadRequest {
            index,
            api,
            history: Vec::new(),
            text,
            image,
        })
    }

    /// Words drawn at random from [`WORDS`], about `tokens` tokens of them. Random words make
    /// every prompt differ from its first cache block on (the chat template's few tokens
    /// are all two prompts share), so the prefix cache saves nothing it would not save for
    /// real users' different prompts, and no request is free.
    fn text(&self, rng: &mut ChaCha8Rng, tokens: usize) -> anyhow::Result<String> {
        let mut text = String::new();
        let mut words = 0;
        let mut push = |text: &mut String, n: usize| {
            for _ in 0..n {
                if !text.is_empty() {
                    text.push(' ');
                }
                text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            }
        };
        let Some(tokenizer) = &self.tokenizer else {
            push(&mut text, tokens);
            return Ok(text);
        };
        loop {
            // Some words are several tokens for some tokenizers: add words until there are
            // enough tokens, then cut after the last one wanted.
            let more = tokens.saturating_sub(words).max(8);
            push(&mut text, more);
            words += more;
            let enc = tokenizer
                .encode(text.as_str(), false)
                .map_err(|e| anyhow::anyhow!("cannot tokenize a prompt: {e}"))?;
            if enc.len() >= tokens {
                let end = enc.get_offsets()[tokens - 1].1;
                text.truncate(end);
                return Ok(text);
            }
        }
    }
}

/// A PNG of `side` x `side` pixels, its colours drawn from `rng`: each image request sends
/// an image no other sent, so neither an embedding cache nor the prefix cache makes it
/// free. Gradients under a fine pattern, so the PNG is neither tiny nor incompressible.
fn png(rng: &mut ChaCha8Rng, side: u32) -> anyhow::Result<Vec<u8>> {
    let side = side.max(1);
    let (r, g, b): (u32, u32, u32) = (
        rng.random_range(0..256),
        rng.random_range(0..256),
        rng.random_range(0..256),
    );
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([
            ((x * 255 / side + r) % 256) as u8,
            ((y * 255 / side + g) % 256) as u8,
            (((x ^ y) & 31) + b) as u8,
        ])
    });
    let mut bytes = Vec::new();
    img.write_to(
        &mut std::io::Cursor::new(&mut bytes),
        image::ImageFormat::Png,
    )
    .context("cannot encode a generated PNG")?;
    Ok(bytes)
}

/// How one level of a run is bounded.
#[derive(Clone, Copy, Debug)]
pub struct LevelLimits {
    /// Requests the level sends (all clients together).
    pub requests: Option<usize>,
    /// No request is started after this long; those under way are finished and counted.
    pub duration: Option<Duration>,
}

/// What one level measured.
#[derive(Clone, Debug, Default)]
pub struct LevelStats {
    pub concurrency: usize,
    /// From the first request sent to the last one finished.
    pub wall: Duration,
    /// Requests that streamed all `max_tokens` tokens and ended cleanly.
    pub requests_ok: usize,
    /// Failed requests by kind (`HTTP 429`, `gRPC RESOURCE_EXHAUSTED`, ...).
    pub errors: BTreeMap<String, usize>,
    /// One message of each kind of error, to show what went wrong.
    pub error_examples: BTreeMap<String, String>,
    /// Tokens streamed to the clients, failed requests' included.
    pub output_tokens: u64,
    /// Prompt tokens of the answered requests, as the gateway counted them (template and
    /// image tokens included).
    pub prompt_tokens: u64,
    /// Seconds from sending a request to its first token, answered requests, sorted.
    pub ttft: Vec<f64>,
    /// Seconds between consecutive tokens of a request, answered requests, sorted.
    pub itl: Vec<f64>,
    /// The same, counting only the requests that went through each API (`http`, `grpc`).
    pub by_api: BTreeMap<&'static str, ApiStats>,
    /// Prompt tokens llm-svc looked up in its prefix cache during the level, and found there
    /// (`None`: the gateway's `/metrics` does not show llm-svc's counters), all replicas
    /// together.
    pub prefix_cache: Option<PrefixCacheUse>,
    /// Turns per conversation the level sent ([`Workload::turns`]).
    pub turns: usize,
}

/// One API's share of a level.
#[derive(Clone, Debug, Default)]
pub struct ApiStats {
    pub requests_ok: usize,
    pub errors: usize,
    pub output_tokens: u64,
    /// Sorted, as [`LevelStats::ttft`] and [`LevelStats::itl`].
    pub ttft: Vec<f64>,
    pub itl: Vec<f64>,
}

/// What llm-svc's prefix cache counted over a level.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixCacheUse {
    pub queried_tokens: f64,
    pub hit_tokens: f64,
}

impl PrefixCacheUse {
    /// Percent of the prompt tokens found computed.
    pub fn hit_pct(&self) -> f64 {
        100.0 * self.hit_tokens / self.queried_tokens.max(1.0)
    }
}

/// Above this share of prompt tokens found in the prefix cache, a level is not what a fresh
/// server does with new prompts, and the table says so (new prompts share only the chat
/// template's first tokens: a few percent).
const CACHED_PROMPTS_WARN_PCT: f64 = 25.0;

impl LevelStats {
    pub fn error_count(&self) -> usize {
        self.errors.values().sum()
    }
    fn per_second(&self, n: f64) -> f64 {
        n / self.wall.as_secs_f64().max(1e-9)
    }
    pub fn output_tokens_per_s(&self) -> f64 {
        self.per_second(self.output_tokens as f64)
    }
    pub fn requests_per_s(&self) -> f64 {
        self.per_second(self.requests_ok as f64)
    }
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.per_second(self.prompt_tokens as f64)
    }

    fn add(&mut self, api: Api, seen: Observed, failure: Option<Failure>) {
        self.output_tokens += seen.output_tokens;
        let share = self.by_api.entry(api.name()).or_default();
        share.output_tokens += seen.output_tokens;
        match failure {
            None => {
                self.requests_ok += 1;
                self.prompt_tokens += seen.prompt_tokens;
                share.requests_ok += 1;
                share.ttft.extend(seen.ttft);
                share.itl.extend(&seen.gaps);
                self.ttft.extend(seen.ttft);
                self.itl.extend(seen.gaps);
            }
            Some(f) => {
                share.errors += 1;
                // Whether the client had seen a token: a failure before it is one a router
                // could have retried elsewhere, one after it is not.
                let kind = if seen.ttft.is_some() {
                    format!("{} after its first token", f.kind)
                } else {
                    f.kind
                };
                *self.errors.entry(kind.clone()).or_default() += 1;
                self.error_examples.entry(kind).or_insert(f.message);
            }
        }
    }

    fn merge(&mut self, other: LevelStats) {
        self.requests_ok += other.requests_ok;
        for (k, n) in other.errors {
            *self.errors.entry(k).or_default() += n;
        }
        for (k, m) in other.error_examples {
            self.error_examples.entry(k).or_insert(m);
        }
        self.output_tokens += other.output_tokens;
        self.prompt_tokens += other.prompt_tokens;
        self.ttft.extend(other.ttft);
        self.itl.extend(other.itl);
        for (api, share) in other.by_api {
            let mine = self.by_api.entry(api).or_default();
            mine.requests_ok += share.requests_ok;
            mine.errors += share.errors;
            mine.output_tokens += share.output_tokens;
            mine.ttft.extend(share.ttft);
            mine.itl.extend(share.itl);
        }
    }

    /// Sorts the latencies, for the percentiles.
    fn sort(&mut self) {
        self.ttft.sort_by(f64::total_cmp);
        self.itl.sort_by(f64::total_cmp);
        for share in self.by_api.values_mut() {
            share.ttft.sort_by(f64::total_cmp);
            share.itl.sort_by(f64::total_cmp);
        }
    }

    /// The measurements as JSON (milliseconds for latencies; null where nothing was seen).
    pub fn to_json(&self) -> Value {
        let ms = |v: &[f64], p: f64| percentile(v, p).map(|s| s * 1e3);
        let by_api: serde_json::Map<String, Value> = self
            .by_api
            .iter()
            .map(|(api, s)| {
                let v = json!({
                    "requests_ok": s.requests_ok,
                    "error_count": s.errors,
                    "output_tokens": s.output_tokens,
                    "output_tokens_per_s": self.per_second(s.output_tokens as f64),
                    "ttft_p50_ms": ms(&s.ttft, 50.0),
                    "ttft_p99_ms": ms(&s.ttft, 99.0),
                    "itl_p50_ms": ms(&s.itl, 50.0),
                    "itl_p99_ms": ms(&s.itl, 99.0),
                });
                (api.to_string(), v)
            })
            .collect();
        json!({
            "name": format!("load: concurrency {}", self.concurrency),
            "concurrency": self.concurrency,
            "requests_ok": self.requests_ok,
            "error_count": self.error_count(),
            "errors": self.errors,
            "wall_s": self.wall.as_secs_f64(),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens_per_s": self.output_tokens_per_s(),
            "requests_per_s": self.requests_per_s(),
            "prompt_tokens_per_s": self.prompt_tokens_per_s(),
            "ttft_p50_ms": ms(&self.ttft, 50.0),
            "ttft_p99_ms": ms(&self.ttft, 99.0),
            "itl_p50_ms": ms(&self.itl, 50.0),
            "itl_p99_ms": ms(&self.itl, 99.0),
            "by_api": by_api,
            "turns": self.turns,
            "prefix_cache_hit_pct": self.prefix_cache.map(|p| p.hit_pct()),
        })
    }
}

/// The `p`-th percentile (nearest rank) of sorted `values`.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// What a client saw of one request.
#[derive(Debug, Default)]
struct Observed {
    ttft: Option<f64>,
    gaps: Vec<f64>,
    output_tokens: u64,
    prompt_tokens: u64,
}

#[derive(Debug)]
struct Failure {
    /// What the table counts by: the HTTP status or gRPC code, or what broke.
    kind: String,
    message: String,
}

impl Failure {
    fn new(kind: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Self {
            kind: kind.into(),
            message: message.to_string(),
        }
    }
}

/// Times the tokens of one request as they reach the client.
struct TokenClock {
    sent: Instant,
    last: Option<Instant>,
    seen: Observed,
}

impl TokenClock {
    fn new() -> Self {
        Self {
            sent: Instant::now(),
            last: None,
            seen: Observed::default(),
        }
    }

    /// `count` tokens arrived together at `at`. Each token's latency is the time since the
    /// previous token reached the client; tokens of one chunk reached it together, so all
    /// but the first of them count 0 (llm-svc sends one token per step, so a chunk holds one
    /// unless the network coalesced two).
    fn tokens(&mut self, count: usize, at: Instant) {
        if count == 0 {
            return;
        }
        match self.last {
            None => self.seen.ttft = Some((at - self.sent).as_secs_f64()),
            Some(prev) => self.seen.gaps.push((at - prev).as_secs_f64()),
        }
        self.seen.gaps.extend(std::iter::repeat_n(0.0, count - 1));
        self.last = Some(at);
        self.seen.output_tokens += count as u64;
    }
}

/// One simulated user: its own connections (an HTTP/1.1 keep-alive connection and an HTTP/2
/// gRPC connection), reused for its requests one after another. Sharing one connection (or
/// one pool) among all clients would put a single HTTP/2 connection's flow control and task
/// in front of every stream, which real users on their own machines do not share.
struct Client {
    http: Option<(reqwest::Client, String)>,
    grpc: Option<GatewayClient<tonic::transport::Channel>>,
}

impl Client {
    async fn connect(target: &Target, mix: ApiMix) -> anyhow::Result<Self> {
        let mut client = Client {
            http: None,
            grpc: None,
        };
        if mix != ApiMix::Grpc {
            let base = target
                .http
                .as_deref()
                .context("HTTP requests need the gateway's HTTP URL")?;
            let http = reqwest::Client::builder()
                .tcp_nodelay(true)
                .timeout(REQUEST_TIMEOUT)
                .build()?;
            // Opens the connection now, so the level's clock does not time it.
            http.get(format!("{base}/v1/models"))
                .send()
                .await
                .and_then(|r| r.error_for_status())
                .with_context(|| format!("cannot reach the gateway's HTTP API at {base}"))?;
            client.http = Some((http, format!("{base}/v1/chat/completions")));
        }
        if mix != ApiMix::Http {
            let url = target
                .grpc
                .as_deref()
                .context("gRPC requests need the gateway's gRPC URL")?;
            let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
                .tcp_nodelay(true)
                .connect()
                .await
                .with_context(|| format!("cannot reach the gateway's gRPC API at {url}"))?;
            client.grpc = Some(
                GatewayClient::new(channel)
                    .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES),
            );
        }
        Ok(client)
    }

    async fn send(
        &mut self,
        req: LoadRequest,
        workload: &Workload,
        model_name: &str,
    ) -> (Observed, Option<Failure>) {
        let (seen, failure) = match req.api {
            Api::Http => {
                let (http, url) = self.http.as_ref().expect("connected for HTTP");
                send_http(http, url, http_body(&req, workload, model_name)).await
            }
            Api::Grpc => {
                let grpc = self.grpc.as_mut().expect("connected for gRPC");
                send_grpc(grpc, grpc_request(&req, workload)).await
            }
        };
        // ignore_eos: anything short of max_tokens is a request the server cut.
        let failure = failure.or_else(|| {
            (seen.output_tokens < workload.max_tokens as u64).then(|| {
                Failure::new(
                    "fewer tokens than max_tokens",
                    format!(
                        "{} of {} tokens streamed",
                        seen.output_tokens, workload.max_tokens
                    ),
                )
            })
        });
        (seen, failure)
    }
}

fn http_body(req: &LoadRequest, w: &Workload, model_name: &str) -> Value {
    let user = |text: &str, image: &Option<Vec<u8>>| {
        let mut content = Vec::new();
        if let Some(png) = image {
            let b64 = base64::engine::general_purpose::STANDARD.encode(png);
            content.push(json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}));
        }
        content.push(json!({"type": "text", "text": text}));
        json!({"role": "user", "content": content})
    };
    let mut messages = Vec::new();
    for turn in &req.history {
        messages.push(user(&turn.user, &turn.image));
        messages.push(json!({"role": "assistant", "content": turn.assistant}));
    }
    messages.push(user(&req.text, &req.image));
    let mut body = json!({
        "model": model_name,
        "messages": messages,
        "max_tokens": w.max_tokens,
        "temperature": w.sampling.temperature,
        "seed": req.index,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
        "return_token_ids": true,
    });
    let o = body.as_object_mut().expect("an object");
    if let Some(p) = w.sampling.top_p {
        o.insert("top_p".into(), p.into());
    }
    if let Some(k) = w.sampling.top_k {
        o.insert("top_k".into(), k.into());
    }
    if let Some(p) = w.sampling.presence_penalty {
        o.insert("presence_penalty".into(), p.into());
    }
    if w.json_schema {
        o.insert(
            "response_format".into(),
            json!({"type": "json_schema",
                   "json_schema": {"name": "detections", "schema": crate::bench::bench_schema()}}),
        );
    }
    body
}

fn grpc_request(req: &LoadRequest, w: &Workload) -> pb::ChatRequest {
    let message = |role: &str, text: &str, image: &Option<Vec<u8>>| {
        let mut content = Vec::new();
        if let Some(png) = image {
            content.push(ContentPart {
                part: Some(content_part::Part::Image(png.clone())),
            });
        }
        content.push(ContentPart {
            part: Some(content_part::Part::Text(text.to_string())),
        });
        pb::ChatMessage {
            role: role.into(),
            content,
            ..Default::default()
        }
    };
    let mut messages = Vec::new();
    for turn in &req.history {
        messages.push(message("user", &turn.user, &turn.image));
        messages.push(message("assistant", &turn.assistant, &None));
    }
    messages.push(message("user", &req.text, &req.image));
    pb::ChatRequest {
        messages,
        max_tokens: Some(w.max_tokens as u32),
        temperature: Some(w.sampling.temperature),
        top_p: w.sampling.top_p,
        top_k: w.sampling.top_k,
        presence_penalty: w.sampling.presence_penalty,
        seed: Some(req.index),
        ignore_eos: true,
        output_format: w.json_schema.then(|| pb::OutputFormat {
            format: Some(pb::output_format::Format::JsonSchema(
                crate::bench::bench_schema().to_string(),
            )),
        }),
        ..Default::default()
    }
}

/// One streamed chat over HTTP. Tokens are counted from each chunk's `token_ids` (the
/// gateway's `return_token_ids`: one chunk per generated step, even while the text of a
/// step is held back as an incomplete character). From a server without it, each chunk
/// with text counts as one token and `usage` gives the total.
async fn send_http(http: &reqwest::Client, url: &str, body: Value) -> (Observed, Option<Failure>) {
    let mut clock = TokenClock::new();
    let response = match http.post(url).json(&body).send().await {
        Ok(r) => r,
        Err(e) => return (clock.seen, Some(Failure::new("HTTP connection error", e))),
    };
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return (
            clock.seen,
            Some(Failure::new(format!("HTTP {}", status.as_u16()), text)),
        );
    }
    let mut stream = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let (mut done, mut usage_total) = (false, None);
    while let Some(bytes) = stream.next().await {
        let at = Instant::now();
        match bytes {
            Ok(b) => pending.extend_from_slice(&b),
            Err(e) => return (clock.seen, Some(Failure::new("HTTP stream broken", e))),
        }
        // Events end with a blank line; a read may hold several, or part of one.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let chunk: Value = match serde_json::from_str(data) {
                    Ok(v) => v,
                    Err(e) => {
                        return (
                            clock.seen,
                            Some(Failure::new("HTTP bad event", format!("{e}: {data}"))),
                        )
                    }
                };
                if let Some(err) = chunk.get("error") {
                    let kind = err["type"].as_str().unwrap_or("unknown");
                    return (
                        clock.seen,
                        Some(Failure::new(format!("HTTP stream error: {kind}"), err)),
                    );
                }
                if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                    clock.seen.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                    usage_total = usage["completion_tokens"].as_u64();
                }
                let choice = &chunk["choices"][0];
                let count = match choice["token_ids"].as_array() {
                    Some(ids) => ids.len(),
                    None => choice["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty()) as usize,
                };
                clock.tokens(count, at);
            }
        }
    }
    if !done {
        let f = Failure::new("HTTP stream ended early", "no [DONE] event");
        return (clock.seen, Some(f));
    }
    if let Some(total) = usage_total {
        clock.seen.output_tokens = clock.seen.output_tokens.max(total);
    }
    (clock.seen, None)
}

/// One streamed chat over gRPC; tokens are counted from each chunk's `token_ids`.
async fn send_grpc(
    grpc: &mut GatewayClient<tonic::transport::Channel>,
    msg: pb::ChatRequest,
) -> (Observed, Option<Failure>) {
    let mut clock = TokenClock::new();
    let mut request = tonic::Request::new(msg);
    request.set_timeout(REQUEST_TIMEOUT);
    let mut stream = match grpc.chat_stream(request).await {
        Ok(r) => r.into_inner(),
        Err(s) => return (clock.seen, Some(grpc_failure(&s))),
    };
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                clock.tokens(chunk.token_ids.len(), Instant::now());
                if let Some(u) = chunk.usage {
                    clock.seen.prompt_tokens = u.prompt_tokens as u64;
                }
            }
            Ok(None) => return (clock.seen, None),
            Err(s) => return (clock.seen, Some(grpc_failure(&s))),
        }
    }
}

/// `gRPC RESOURCE_EXHAUSTED` and the like: the code as the gRPC spec spells it.
fn grpc_failure(s: &tonic::Status) -> Failure {
    let mut name = String::new();
    for (i, c) in format!("{:?}", s.code()).chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    Failure::new(format!("gRPC {name}"), s.message())
}

/// Sends `count` requests one at a time, unmeasured, from index `first` on: connections,
/// kernels and caches warm before the first level. Any failure ends the run: the gateway is
/// not in a state worth measuring.
pub async fn warm_up(
    target: &Target,
    maker: &Arc<RequestMaker>,
    first: u64,
    count: usize,
) -> anyhow::Result<()> {
    if count == 0 {
        return Ok(());
    }
    let mut client = Client::connect(target, maker.workload().api).await?;
    for i in 0..count as u64 {
        let req = make_off_thread(maker, first + i).await?;
        let (_, failure) = client.send(req, maker.workload(), &target.model_name).await;
        if let Some(f) = failure {
            anyhow::bail!("warm-up request {i} failed ({}): {}", f.kind, f.message);
        }
    }
    Ok(())
}

/// Tokenizing a prompt and encoding a PNG take milliseconds: off the runtime's workers, so
/// they do not delay the timestamps of other clients' tokens.
async fn make_off_thread(maker: &Arc<RequestMaker>, index: u64) -> anyhow::Result<LoadRequest> {
    let maker = maker.clone();
    tokio::task::spawn_blocking(move || maker.make(index)).await?
}

/// Runs one level: `concurrency` clients, each connected before the clock starts, sending
/// requests `first`, `first + 1`, ... as they finish the previous one; with several turns per
/// conversation, each client takes the next conversation and sends its turns in order (a
/// level's request limit and deadline are checked before each turn). Returns the level's
/// stats and how many request numbers it used.
pub async fn run_level(
    target: &Target,
    maker: &Arc<RequestMaker>,
    concurrency: usize,
    limits: LevelLimits,
    first: u64,
    bar: &ProgressBar,
) -> anyhow::Result<(LevelStats, u64)> {
    let clients = futures::future::try_join_all(
        (0..concurrency).map(|_| Client::connect(target, maker.workload().api)),
    )
    .await?;
    let next = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let turns = maker.workload().turns.max(1);
    // Conversations start at a multiple of `turns`, so `make` finds each one's first turn.
    let first_conversation = first.next_multiple_of(turns as u64);
    let cache_before = prefix_cache_counters(target).await;
    let started = Instant::now();
    let deadline = limits.duration.map(|d| started + d);
    let mut tasks = tokio::task::JoinSet::new();
    for mut client in clients {
        let (next, sent, maker, bar) = (next.clone(), sent.clone(), maker.clone(), bar.clone());
        let model_name = target.model_name.clone();
        tasks.spawn(async move {
            let mut stats = LevelStats::default();
            loop {
                // A conversation (one request when `turns` is 1).
                let k = next.fetch_add(1, Ordering::Relaxed);
                let start = if turns == 1 {
                    first + k as u64
                } else {
                    first_conversation + (k * turns) as u64
                };
                for turn in 0..turns as u64 {
                    let spent = limits
                        .requests
                        .is_some_and(|n| sent.fetch_add(1, Ordering::Relaxed) >= n);
                    let late = deadline.is_some_and(|d| Instant::now() >= d);
                    if spent || late {
                        return anyhow::Ok(stats);
                    }
                    let req = make_off_thread(&maker, start + turn).await?;
                    let api = req.api;
                    let (seen, failure) = client.send(req, maker.workload(), &model_name).await;
                    stats.add(api, seen, failure);
                    bar.inc(1);
                }
            }
        });
    }
    let mut level = LevelStats {
        concurrency,
        turns,
        ..LevelStats::default()
    };
    while let Some(done) = tasks.join_next().await {
        level.merge(done??);
    }
    level.wall = started.elapsed();
    level.sort();
    if let (Some(before), Some(after)) = (cache_before, prefix_cache_counters(target).await) {
        level.prefix_cache = Some(PrefixCacheUse {
            queried_tokens: after.queried_tokens - before.queried_tokens,
            hit_tokens: after.hit_tokens - before.hit_tokens,
        });
    }
    let used = match turns {
        1 => next.load(Ordering::Relaxed) as u64,
        t => first_conversation - first + (next.load(Ordering::Relaxed) * t) as u64,
    };
    Ok((level, used))
}

/// llm-svc's prefix-cache counters as the gateway's `/metrics` shows them (`vlm serve` and the
/// local stack show their model services' metrics there); `None` where it does not.
async fn prefix_cache_counters(target: &Target) -> Option<PrefixCacheUse> {
    let base = target.http.as_deref()?;
    let page = reqwest::get(format!("{base}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    // Summed over the series: several llm-svc replicas show one each (`replica` label).
    let counter = |name: &str| -> Option<f64> {
        let values: Vec<f64> = page
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.trim().parse().ok()
            })
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    };
    Some(PrefixCacheUse {
        queried_tokens: counter("vlm_llm_prefix_cache_queried_tokens_total")?,
        hit_tokens: counter("vlm_llm_prefix_cache_hit_tokens_total")?,
    })
}

/// A table for the terminal, one line per level, then one line per kind of error with an
/// example message.
pub fn table(levels: &[LevelStats]) -> String {
    let mut s = format!(
        "{:>11} {:>7} {:>7} {:>13} {:>8} {:>13} {:>13} {:>13} {:>12} {:>12} {:>12}\n",
        "concurrency",
        "ok",
        "errors",
        "output tok/s",
        "req/s",
        "prompt tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "cache hit %"
    );
    let ms = |v: &[f64], p: f64| percentile(v, p).map_or("-".into(), |x| format!("{:.1}", x * 1e3));
    for l in levels {
        s.push_str(&format!(
            "{:>11} {:>7} {:>7} {:>13.1} {:>8.2} {:>13.1} {:>13} {:>13} {:>12} {:>12} {:>12}\n",
            l.concurrency,
            l.requests_ok,
            l.error_count(),
            l.output_tokens_per_s(),
            l.requests_per_s(),
            l.prompt_tokens_per_s(),
            ms(&l.ttft, 50.0),
            ms(&l.ttft, 99.0),
            ms(&l.itl, 50.0),
            ms(&l.itl, 99.0),
            l.prefix_cache
                .map_or("-".into(), |c| format!("{:.1}", c.hit_pct())),
        ));
    }
    for l in levels {
        if l.by_api.len() > 1 {
            let shares: Vec<String> = l
                .by_api
                .iter()
                .map(|(api, a)| {
                    format!(
                        "{api} {:.1} output tok/s, TTFT p50 {} ms, ITL p50 {} ms, p99 {} ms",
                        l.per_second(a.output_tokens as f64),
                        ms(&a.ttft, 50.0),
                        ms(&a.itl, 50.0),
                        ms(&a.itl, 99.0)
                    )
                })
                .collect();
            s.push_str(&format!(
                "concurrency {} by API: {}\n",
                l.concurrency,
                shares.join("; ")
            ));
        }
        // Conversations hit by design: their turns resend their history.
        if let Some(cache) = l
            .prefix_cache
            .filter(|c| l.turns <= 1 && c.hit_pct() > CACHED_PROMPTS_WARN_PCT)
        {
            s.push_str(&format!(
                "concurrency {}: {:.0}% of the prompt tokens were in llm-svc's prefix cache \
                 already: the server had these prompts from an earlier run (the same --seed), \
                 and skipped most of their prefill; pass another --seed to measure new prompts\n",
                l.concurrency,
                cache.hit_pct()
            ));
        }
        for (kind, n) in &l.errors {
            let example = l.error_examples.get(kind).map_or("", String::as_str);
            let example: String = example.chars().take(160).collect();
            s.push_str(&format!(
                "concurrency {}: {n} x {kind} (e.g. {example})\n",
                l.concurrency
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(api: ApiMix, image_every: usize) -> Workload {
        Workload {
            prompt_tokens: 40,
            max_tokens: 8,
            image_every,
            image_side: 32,
            api,
            seed: 7,
            sampling: LoadSampling::default(),
            json_schema: false,
            turns: 1,
        }
    }

    #[test]
    fn a_conversations_turn_resends_the_turns_before_it() {
        let maker = RequestMaker::new(
            Workload {
                turns: 3,
                ..workload(ApiMix::Http, 2)
            },
            None,
        );
        let single = RequestMaker::new(workload(ApiMix::Http, 2), None);
        // Conversation 1 is requests 3, 4 and 5.
        let third = maker.make(5).unwrap();
        assert_eq!(third.history.len(), 2);
        for (turn, index) in third.history.iter().zip([3, 4]) {
            let alone = single.make(index).unwrap();
            assert_eq!(turn.user, alone.text, "the earlier turn's message, resent");
            assert_eq!(turn.image, alone.image, "with its image");
            assert_eq!(
                turn.assistant.split(' ').count(),
                8,
                "an answer of max_tokens"
            );
        }
        assert_eq!(third.text, single.make(5).unwrap().text);
        assert_eq!(
            maker.make(4).unwrap().history[0].assistant,
            third.history[0].assistant,
            "each turn resends the same history"
        );
        assert!(maker.make(3).unwrap().history.is_empty(), "a first turn");
        let body = http_body(&third, maker.workload(), "m");
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user"]);
        let grpc = grpc_request(&third, maker.workload());
        assert_eq!(grpc.messages.len(), 5);
    }

    #[test]
    fn a_json_schema_run_asks_both_apis_for_the_same_schema() {
        let w = Workload {
            json_schema: true,
            ..workload(ApiMix::Mixed, 0)
        };
        let maker = RequestMaker::new(w.clone(), None);
        let req = maker.make(0).unwrap();
        let http = http_body(&req, &w, "m");
        assert_eq!(http["response_format"]["type"], "json_schema");
        assert_eq!(
            http["response_format"]["json_schema"]["schema"],
            crate::bench::bench_schema()
        );
        let grpc = grpc_request(&req, &w);
        let Some(pb::output_format::Format::JsonSchema(text)) =
            grpc.output_format.and_then(|f| f.format)
        else {
            panic!("no json_schema over gRPC");
        };
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            crate::bench::bench_schema()
        );
        let plain = workload(ApiMix::Mixed, 0);
        assert!(http_body(&req, &plain, "m")
            .get("response_format")
            .is_none());
        assert!(grpc_request(&req, &plain).output_format.is_none());
    }

    #[test]
    fn requests_follow_the_seed_and_differ_from_each_other() {
        let maker = RequestMaker::new(workload(ApiMix::Mixed, 0), None);
        let a = maker.make(3).unwrap();
        assert_eq!(a.text, maker.make(3).unwrap().text);
        assert_ne!(a.text, maker.make(4).unwrap().text);
        // Without a tokenizer a word stands for a token: lengths within [0.5x, 1.5x].
        for i in 0..50 {
            let words = maker.make(i).unwrap().text.split(' ').count();
            assert!((20..=60).contains(&words), "{words}");
        }
        let other = RequestMaker::new(
            Workload {
                seed: 8,
                ..workload(ApiMix::Mixed, 0)
            },
            None,
        );
        assert_ne!(a.text, other.make(3).unwrap().text);
    }

    #[test]
    fn mixed_splits_image_and_text_requests_evenly_between_the_apis() {
        for every in [0, 1, 2, 3, 4] {
            let maker = RequestMaker::new(workload(ApiMix::Mixed, every), None);
            let reqs: Vec<LoadRequest> = (0..24).map(|i| maker.make(i).unwrap()).collect();
            for with_image in [true, false] {
                let of_kind: Vec<&LoadRequest> = reqs
                    .iter()
                    .filter(|r| r.image.is_some() == with_image)
                    .collect();
                let http = of_kind.iter().filter(|r| r.api == Api::Http).count();
                assert!(
                    http * 2 == of_kind.len() || http * 2 == of_kind.len() + 1,
                    "every {every}, image {with_image}: {http} of {}",
                    of_kind.len()
                );
            }
            let images = reqs.iter().filter(|r| r.image.is_some()).count();
            assert_eq!(
                images,
                if every == 0 {
                    0
                } else {
                    24usize.div_ceil(every)
                }
            );
        }
        let http_only = RequestMaker::new(workload(ApiMix::Http, 2), None);
        assert!((0..8).all(|i| http_only.make(i).unwrap().api == Api::Http));
    }

    #[test]
    fn images_are_pngs_of_the_side_asked_and_differ() {
        let maker = RequestMaker::new(workload(ApiMix::Grpc, 1), None);
        let (a, b) = (maker.make(0).unwrap(), maker.make(1).unwrap());
        let (a, b) = (a.image.unwrap(), b.image.unwrap());
        assert_ne!(a, b);
        let img = image::load_from_memory(&a).unwrap();
        assert_eq!((img.width(), img.height()), (32, 32));
    }

    #[test]
    fn a_tokenizer_cuts_prompts_to_the_drawn_token_count() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/tiny-qwen3-vl/tokenizer.json");
        let tokenizer = Tokenizer::from_file(&dir).unwrap();
        let maker = RequestMaker::new(workload(ApiMix::Http, 0), Some(tokenizer.clone()));
        for i in 0..20 {
            let text = maker.make(i).unwrap().text;
            let n = tokenizer.encode(text.as_str(), false).unwrap().len();
            assert!((20..=60).contains(&n), "{n} tokens: {text}");
        }
    }

    #[test]
    fn tokens_of_one_chunk_count_zero_latency_after_the_first() {
        let mut clock = TokenClock::new();
        let t0 = clock.sent;
        clock.tokens(0, t0 + Duration::from_millis(5));
        clock.tokens(1, t0 + Duration::from_millis(100));
        clock.tokens(2, t0 + Duration::from_millis(130));
        clock.tokens(1, t0 + Duration::from_millis(150));
        let seen = clock.seen;
        assert_eq!(seen.output_tokens, 4);
        assert!((seen.ttft.unwrap() - 0.1).abs() < 1e-9);
        let gaps: Vec<i64> = seen.gaps.iter().map(|g| (g * 1e3).round() as i64).collect();
        assert_eq!(gaps, [30, 0, 20]);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn grpc_codes_are_spelled_as_in_the_spec() {
        let f = grpc_failure(&tonic::Status::resource_exhausted("busy"));
        assert_eq!(
            (f.kind.as_str(), f.message.as_str()),
            ("gRPC RESOURCE_EXHAUSTED", "busy")
        );
    }

    #[test]
    fn the_table_shows_each_apis_share_and_says_when_prompts_came_from_the_cache() {
        let mut level = LevelStats {
            concurrency: 64,
            wall: Duration::from_secs(2),
            ..LevelStats::default()
        };
        let seen = |tokens| Observed {
            ttft: Some(0.05),
            gaps: vec![0.01; tokens as usize - 1],
            output_tokens: tokens,
            prompt_tokens: 500,
        };
        level.add(Api::Http, seen(100), None);
        level.add(Api::Grpc, seen(120), None);
        level.add(
            Api::Grpc,
            seen(3),
            Some(Failure::new("gRPC UNAVAILABLE", "gone")),
        );
        level.add(
            Api::Grpc,
            Observed {
                ttft: None,
                gaps: Vec::new(),
                output_tokens: 0,
                prompt_tokens: 0,
            },
            Some(Failure::new("gRPC UNAVAILABLE", "gone")),
        );
        level.sort();
        assert_eq!(level.by_api["grpc"].output_tokens, 123);
        assert_eq!(level.by_api["grpc"].errors, 2);
        // A failure after the first token is told apart from one before it.
        assert_eq!(level.errors["gRPC UNAVAILABLE after its first token"], 1);
        assert_eq!(level.errors["gRPC UNAVAILABLE"], 1);
        let t = table(std::slice::from_ref(&level));
        assert!(
            t.contains("concurrency 64 by API: grpc 61.5 output tok/s")
                && t.contains("http 50.0 output tok/s, TTFT p50 50.0 ms, ITL p50 10.0 ms"),
            "{t}"
        );
        assert!(!t.contains("prefix cache"), "{t}");
        level.prefix_cache = Some(PrefixCacheUse {
            queried_tokens: 1000.0,
            hit_tokens: 900.0,
        });
        let t = table(std::slice::from_ref(&level));
        assert!(
            t.contains("concurrency 64: 90% of the prompt tokens were in"),
            "{t}"
        );
        let j = level.to_json();
        assert_eq!(j["prefix_cache_hit_pct"], 90.0);
        assert_eq!(j["by_api"]["http"]["output_tokens_per_s"], 50.0);
    }
}
