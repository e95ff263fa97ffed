//! OpenAI-compatible HTTP on the gateway: `POST /v1/chat/completions` (unary, or server-sent
//! events with `stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics`.
//!
//! Images come as `image_url` parts holding `data:` URLs (base64), or `http(s)://` and
//! `file://` URLs the gateway reads itself under the fetch rules ([`crate::media`]). Beyond OpenAI's fields it accepts vLLM's `top_k`, `min_p`,
//! `repetition_penalty`, `ignore_eos`, `return_token_ids`, `structured_outputs` (and the older
//! `guided_*`) and `chat_template_kwargs`; fields that would change the answer and are not
//! implemented, and unknown ones, are refused naming the field (`http/fields.rs`).
//! `response_format` and the like become the grammar llm-svc enforces ([`crate::structured`]),
//! `tools` reach the chat template ([`crate::tools`]), and each choice's `message` (or streamed
//! `delta`) carries `content`, `reasoning_content` and `tool_calls` as [`crate::output`] splits
//! the answer. `n` choices come in OpenAI's shape, each with its `index` (one
//! `finish_reason` each; streamed chunks interleaved). Sampling fields a request leaves out take the checkpoint's defaults
//! ([`crate::sampling`]). Logprobs come in OpenAI's shape, per token with its text and bytes.
//! Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status
//! from [`GatewayError::http_status`].
//!
//! Hostile input is refused before it costs much: a body over `--max-body-bytes` gets 413
//! without being read further; JSON nested past serde_json's depth limit (128) or not UTF-8
//! gets 400; images are counted, and their base64 sized, before any is decoded.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tracing::{field::Empty, info_span, Instrument};
use vlm_proto::pb;

use crate::chat::{Message, Part};
use crate::gateway_error::GatewayError;
use crate::media::{is_fetched, PendingImage};
use crate::orchestrator::{choices, ChatEvent, Logprob, Orchestrator, TokenLogprobs};
use crate::output::ToolCall;
use crate::request::{ChatRequest, RequestLimits};
use crate::sampling::{RequestedSampling, SamplingDefaults};
use crate::structured::{output_format, RequestedFormats};
use crate::tools::read_tools;

mod fields;
mod stream;

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    pub orchestrator: Arc<Orchestrator>,
    /// The id `/v1/models` lists and responses carry.
    pub model_name: String,
    pub default_max_tokens: usize,
    pub request_timeout: Duration,
    /// Upstream health, for `/health`.
    pub health: Arc<crate::serve::UpstreamHealth>,
}

/// The HTTP API; with `api_key`, `/v1/*` needs it (checked before the body is read), while
/// `/health` and `/metrics` stay open for probes and scrapers.
pub fn router(state: HttpState, api_key: Option<crate::auth::ApiKey>) -> Router {
    let max_body = state.orchestrator.limits.max_body_bytes;
    let mut api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models));
    if let Some(key) = api_key {
        api = api.route_layer(axum::middleware::from_fn_with_state(
            key,
            crate::auth::require_key,
        ));
    }
    api.route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

fn error_response(e: &GatewayError) -> Response {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body =
        json!({"error": {"message": e.to_string(), "type": e.kind(), "param": null, "code": null}});
    (status, Json(body)).into_response()
}

/// The fields read of a chat completion request ([`fields::READ`] names the same set; the
/// others are dropped or refused before this is read). Every field may be null, as absent.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenAiRequest {
    model: Option<String>,
    messages: Vec<OpenAiMessage>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not in OpenAI's API; accepted as vLLM does (-1 is off).
    top_k: Option<i64>,
    /// Not in OpenAI's API; accepted as vLLM does.
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    /// Not in OpenAI's API; accepted as vLLM does (HF's multiplicative penalty).
    repetition_penalty: Option<f32>,
    /// Token ids, as strings, to numbers added to their logits.
    logit_bias: Option<Map<String, Value>>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    seed: Option<u64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    /// Not in OpenAI's API; as vLLM: keep generating through eos.
    ignore_eos: Option<bool>,
    /// Not in OpenAI's API; as vLLM: each choice carries the generated token ids.
    return_token_ids: Option<bool>,
    /// Read by [`crate::tools::read_tools`].
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    /// Read by [`crate::structured::output_format`], with vLLM's `structured_outputs` and
    /// its older `guided_*` fields.
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
    /// Not in OpenAI's API; as vLLM: more variables for the chat template.
    chat_template_kwargs: Option<Map<String, Value>>,
}

/// How the client asked to be answered, besides the chat itself.
#[derive(Debug, Default)]
struct ResponseOptions {
    /// Choices to generate (`n`, checked).
    n: usize,
    /// Server-sent events, one chunk per step, instead of one JSON response.
    stream: bool,
    /// A last streamed chunk with the token counts (`stream_options.include_usage`).
    include_usage: bool,
    /// `token_ids` in each choice; when streaming, every step's tokens get a chunk, even
    /// those whose text is held back (an incomplete character), so a client can count and
    /// time each token (`vlm load` does).
    return_token_ids: bool,
    /// `logprobs` in each choice (each streamed chunk's, for its tokens); null otherwise.
    logprobs: bool,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct OpenAiMessage {
    role: String,
    #[serde(default)]
    content: Value,
    /// An assistant's earlier calls, passed to the template as sent.
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
    /// A tool message: the call it answers.
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// Bytes of a `data:[<mime>][;base64],<data>` URL, refused unread when its base64 alone
/// says the image is over `max_bytes`.
fn data_url_bytes(url: &str, at: &str, max_bytes: usize) -> Result<Vec<u8>, GatewayError> {
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or_default();
        return Err(GatewayError::Invalid(format!(
            "{at}: image URLs may be data:, http:, https: or file: URLs, got a {scheme}: URL"
        )));
    };
    let (meta, data) = rest
        .split_once(',')
        .ok_or_else(|| GatewayError::Invalid(format!("{at}: malformed data: URL (no comma)")))?;
    if !meta.ends_with(";base64") {
        return Err(GatewayError::Invalid(format!(
            "{at}: data: URL must be base64-encoded"
        )));
    }
    let data = data.trim();
    // Four base64 characters hold three bytes; padding takes off at most two.
    let at_least = (data.len() / 4 * 3).saturating_sub(2);
    if at_least > max_bytes {
        return Err(GatewayError::Invalid(format!(
            "{at}: the image has about {at_least} bytes; an image may have at most {max_bytes} (--max-image-bytes)"
        )));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| GatewayError::Invalid(format!("{at}: invalid base64: {e}")))
}

/// The request's sampling fields, checked for what only the HTTP API can get wrong (the
/// shapes of `top_k`, `logit_bias`, `top_logprobs`); the ranges are checked once the
/// defaults are in ([`vlm_proto::sampling::SamplingParams::validate`]).
fn requested_sampling(r: &OpenAiRequest) -> Result<RequestedSampling, GatewayError> {
    let bad = |m: String| Err(GatewayError::Invalid(m));
    let top_k = match r.top_k {
        None => None,
        Some(-1) => Some(0),
        Some(k) if k >= 0 => Some(k as usize),
        Some(k) => return bad(format!("`top_k` must be -1 (off) or at least 0, got {k}")),
    };
    let mut logit_bias = Vec::new();
    for (key, value) in r.logit_bias.iter().flatten() {
        let Ok(id) = key.parse::<u32>() else {
            return bad(format!(
                "`logit_bias` keys must be token ids (non-negative integers), got {key:?}"
            ));
        };
        let Some(bias) = value.as_f64() else {
            return bad(format!(
                "`logit_bias` values must be numbers, got {value} for token {id}"
            ));
        };
        logit_bias.push((id, bias as f32));
    }
    // Ordered by id, as the gRPC API's map is; duplicates ("7" and "07") stay for validate().
    logit_bias.sort_by_key(|b| b.0);
    let max = vlm_proto::sampling::MAX_TOP_LOGPROBS as i64;
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (_, Some(n)) if !(0..=max).contains(&n) => {
            return bad(format!(
                "`top_logprobs` must be between 0 and {max}, got {n}"
            ))
        }
        (false, Some(n)) => {
            return bad(format!("`top_logprobs` ({n}) needs `logprobs` set to true"))
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, None) => None,
    };
    Ok(RequestedSampling {
        temperature: r.temperature,
        top_k,
        top_p: r.top_p,
        min_p: r.min_p,
        presence_penalty: r.presence_penalty,
        frequency_penalty: r.frequency_penalty,
        repetition_penalty: r.repetition_penalty,
        logit_bias,
        logprobs,
        seed: r.seed,
    })
}

/// A body that is not a chat completion request: the message names where it went wrong.
fn not_a_request(at: &str, e: impl std::fmt::Display) -> GatewayError {
    let at = if at.is_empty() || at == "." {
        String::new()
    } else {
        format!("`{at}`: ")
    };
    GatewayError::Invalid(format!(
        "request body is not a valid chat completion request: {at}{e}"
    ))
}

/// A request as read, with its image URLs still to fetch (their parts hold empty images).
type Parsed = (ChatRequest, ResponseOptions, Vec<PendingImage>);

fn parse_request(
    body: &[u8],
    default_max_tokens: usize,
    limits: &RequestLimits,
    defaults: &SamplingDefaults,
) -> Result<Parsed, GatewayError> {
    // Read as a map first, so that fields are refused by name before any is interpreted;
    // the values move into the request unchanged (no copy of an image's base64).
    let mut fields: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| not_a_request("", e))?;
    fields::check(&mut fields)?;
    let r: OpenAiRequest = serde_path_to_error::deserialize(Value::Object(fields))
        .map_err(|e| not_a_request(&e.path().to_string(), e.inner()))?;
    let _ = &r.model; // one model per gateway: any name is accepted
    let n = choices(r.n)?;
    let sampling = defaults.apply(requested_sampling(&r)?);
    sampling
        .validate()
        .map_err(|e| GatewayError::Invalid(e.to_string()))?;
    check_image_count(&r.messages, limits)?;
    let (messages, pending) = read_messages(r.messages, limits)?;
    let stop = read_stop(r.stop)?;
    let max_tokens = r
        .max_completion_tokens
        .or(r.max_tokens)
        .map_or(default_max_tokens, |m| m as usize);
    let tools = read_tools(
        r.tools.as_ref(),
        r.tool_choice.as_ref(),
        r.parallel_tool_calls,
    )?;
    let format = output_format(&RequestedFormats {
        response_format: r.response_format,
        structured_outputs: r.structured_outputs,
        guided_json: r.guided_json,
        guided_regex: r.guided_regex,
        guided_choice: r.guided_choice,
        guided_grammar: r.guided_grammar,
    })?;
    let options = ResponseOptions {
        n,
        stream: r.stream.unwrap_or(false),
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: r.return_token_ids.unwrap_or(false),
        logprobs: sampling.logprobs.is_some(),
    };
    Ok((
        ChatRequest {
            messages,
            // OpenAI's default temperature is 1; ours is the checkpoint's, else greedy, as
            // documented.
            sampling,
            max_new_tokens: max_tokens,
            stop,
            ignore_eos: r.ignore_eos.unwrap_or(false),
            return_logits: false,
            constraint: format.map(|f| f.constraint()),
            tools,
            template_kwargs: r.chat_template_kwargs.unwrap_or_default(),
        },
        options,
        pending,
    ))
}

/// Refuses a request of more images than `limits` allows, counted before any is decoded
/// (validate_request counts again, for gRPC too).
fn check_image_count(
    messages: &[OpenAiMessage],
    limits: &RequestLimits,
) -> Result<(), GatewayError> {
    let images = messages
        .iter()
        .filter_map(|m| m.content.as_array())
        .flatten()
        .filter(|item| item.get("type").and_then(Value::as_str) == Some("image_url"))
        .count();
    if images > limits.max_images {
        return Err(GatewayError::Invalid(format!(
            "a request may carry at most {} images (--max-images), got {images}",
            limits.max_images
        )));
    }
    Ok(())
}

/// The request's messages, each role checked (`developer` read as `system`) and its content
/// read into parts; image URLs to fetch come back beside them, their parts left empty.
fn read_messages(
    raw: Vec<OpenAiMessage>,
    limits: &RequestLimits,
) -> Result<(Vec<Message>, Vec<PendingImage>), GatewayError> {
    let mut messages = Vec::with_capacity(raw.len());
    let mut pending = Vec::new();
    for (i, m) in raw.into_iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(GatewayError::Invalid(format!(
                "messages[{i}].role must be system, user, assistant or tool, got {:?}",
                m.role
            )));
        }
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role
        };
        let parts = match m.content {
            Value::String(s) => vec![Part::Text(s)],
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(j, item)| read_part(item, i, j, limits, &mut pending))
                .collect::<Result<_, _>>()?,
            Value::Null => Vec::new(),
            _ => {
                return Err(GatewayError::Invalid(format!(
                    "messages[{i}].content must be a string or a list"
                )))
            }
        };
        messages.push(Message {
            role,
            parts,
            tool_calls: m.tool_calls.unwrap_or_default(),
            tool_call_id: m.tool_call_id,
        });
    }
    Ok((messages, pending))
}

/// Part `j` of message `i`'s content: text, an image inline (a data: URL), or an image to
/// fetch, noted in `pending` and left empty.
fn read_part(
    item: &Value,
    i: usize,
    j: usize,
    limits: &RequestLimits,
    pending: &mut Vec<PendingImage>,
) -> Result<Part, GatewayError> {
    let at = format!("messages[{i}].content[{j}]");
    match item.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Part::Text(
            item.get("text")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        )),
        Some("image_url") => {
            let url = item
                .get("image_url")
                .and_then(|u| u.get("url").or(Some(u)))
                .and_then(Value::as_str)
                .ok_or_else(|| GatewayError::Invalid(format!("{at}.image_url.url is missing")))?;
            if is_fetched(url) {
                pending.push(PendingImage {
                    message: i,
                    part: j,
                    url: url.to_string(),
                    at,
                });
                return Ok(Part::Image(Vec::new()));
            }
            Ok(Part::Image(data_url_bytes(
                url,
                &at,
                limits.max_image_bytes,
            )?))
        }
        other => Err(GatewayError::Invalid(format!(
            "{at}.type must be text or image_url, got {other:?}"
        ))),
    }
}

/// `stop` as sent: absent, one string or a list of strings.
fn read_stop(stop: Option<Value>) -> Result<Vec<String>, GatewayError> {
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(a)) => Ok(a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect()),
        Some(_) => Err(GatewayError::Invalid(
            "`stop` must be a string or a list of strings".into(),
        )),
    }
}

/// Why a body could not be read: over the limit (413, naming it), or cut off or unreadable.
fn body_rejected(e: &BytesRejection, limits: &RequestLimits) -> GatewayError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        GatewayError::TooLarge(format!(
            "the request body is over the limit of {} bytes (--max-body-bytes)",
            limits.max_body_bytes
        ))
    } else {
        GatewayError::Invalid(format!("cannot read the request body: {}", e.body_text()))
    }
}

/// `POST /v1/chat/completions`'s body as the handler reads it (the response options dropped,
/// no checkpoint defaults), for the fuzz targets in `fuzz/`.
pub fn parse_chat_request(
    body: &[u8],
    default_max_tokens: usize,
    limits: &RequestLimits,
) -> Result<ChatRequest, GatewayError> {
    parse_request(
        body,
        default_max_tokens,
        limits,
        &SamplingDefaults::default(),
    )
    .map(|(req, _, _)| req)
}

/// OpenAI's stand-in for a logprob of minus infinity, which JSON cannot carry.
const NEG_INF_LOGPROB: f32 = -9999.0;

fn logprob_json(l: &Logprob) -> Value {
    let logprob = if l.logprob.is_finite() {
        l.logprob
    } else {
        NEG_INF_LOGPROB
    };
    json!({"token": l.text, "logprob": logprob, "bytes": l.bytes})
}

/// A choice's `logprobs` in OpenAI's shape: `{"content": [{"token", "logprob", "bytes",
/// "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}`, one entry per token.
fn logprobs_json(tokens: &[TokenLogprobs]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut entry = logprob_json(&t.token);
            entry["top_logprobs"] = t.top.iter().map(logprob_json).collect();
            entry
        })
        .collect();
    json!({ "content": content })
}

/// One choice of a unary answer, as its events build it.
struct ChoiceOut {
    text: String,
    reasoning: String,
    tool_calls: Vec<ToolCall>,
    finish: &'static str,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
}

impl Default for ChoiceOut {
    fn default() -> Self {
        Self {
            text: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            finish: "stop",
            token_ids: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

fn finish_str(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Length => "length",
        pb::FinishReason::ToolCalls => "tool_calls",
        _ => "stop",
    }
}

/// A call as OpenAI's `tool_calls` entries (unary and streamed alike) show it.
fn tool_call_json(c: &ToolCall) -> Value {
    json!({"index": c.index, "id": c.id, "type": "function",
        "function": {"name": c.name, "arguments": c.arguments}})
}

/// A unary choice's `message`: `content` null when the answer is calls alone, and
/// `reasoning_content` and `tool_calls` only when there are some.
fn message_json(c: &ChoiceOut) -> Value {
    let content = if c.text.is_empty() && !c.tool_calls.is_empty() {
        Value::Null
    } else {
        c.text.clone().into()
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = c.reasoning.clone().into();
    }
    if !c.tool_calls.is_empty() {
        message["tool_calls"] = c.tool_calls.iter().map(tool_call_json).collect();
    }
    message
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn chat_completions(
    State(st): State<HttpState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = info_span!(
        "gateway.chat",
        otel.kind = "server",
        api = "http",
        stream = Empty,
        trace_id = Empty
    );
    vlm_proto::telemetry::adopt_http_parent(&span, &headers);
    let id = format!("chatcmpl-{}", vlm_proto::telemetry::trace_id(&span));
    let body = match body {
        Ok(b) => b,
        Err(e) => return error_response(&body_rejected(&e, &st.orchestrator.limits)),
    };
    let parsed = parse_request(
        &body,
        st.default_max_tokens,
        &st.orchestrator.limits,
        &st.orchestrator.sampling_defaults,
    );
    let (mut req, options, pending) = match parsed {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let fetched = st
        .orchestrator
        .media
        .resolve(
            &mut req.messages,
            pending,
            st.orchestrator.limits.max_image_bytes,
        )
        .instrument(span.clone())
        .await;
    if let Err(e) = fetched {
        return error_response(&e);
    }
    span.record("stream", options.stream);
    let started = st
        .orchestrator
        .chat(req, options.n, "http", Some(st.request_timeout))
        .instrument(span.clone())
        .await;
    let rx = match started {
        Ok(rx) => rx,
        Err(e) => return error_response(&e),
    };
    let created = now_secs();
    let n = options.n;
    if !options.stream {
        let mut rx = rx;
        let mut choices: Vec<ChoiceOut> = (0..n).map(|_| ChoiceOut::default()).collect();
        let (mut prompt_tokens, mut completion_tokens) = (0, 0);
        while let Some(ev) = rx.recv().await {
            match ev {
                Ok(ChatEvent::Delta {
                    choice,
                    text,
                    reasoning,
                    tool_calls,
                    token_ids,
                    logprobs,
                }) => {
                    let c = &mut choices[choice as usize];
                    c.text.push_str(&text);
                    c.reasoning.push_str(&reasoning);
                    for d in tool_calls {
                        ToolCall::gather(&mut c.tool_calls, d);
                    }
                    c.token_ids.extend(token_ids);
                    c.logprobs.extend(logprobs);
                }
                Ok(ChatEvent::Done {
                    choice,
                    finish,
                    prompt_tokens: p,
                    completion_tokens: c,
                }) => {
                    choices[choice as usize].finish = finish_str(finish);
                    prompt_tokens = p;
                    completion_tokens += c;
                }
                Err(e) => return error_response(&e),
            }
        }
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let mut choice = json!({
                    "index": index,
                    "message": message_json(&c),
                    "logprobs": null,
                    "finish_reason": c.finish,
                });
                if options.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                }
                if options.logprobs {
                    choice["logprobs"] = logprobs_json(&c.logprobs);
                }
                choice
            })
            .collect();
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": st.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
        });
        return Json(body).into_response();
    }

    let writer = stream::ChunkWriter::new(id, created, st.model_name.clone(), options);
    stream::response(writer, rx)
}

async fn models(State(st): State<HttpState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "vlm"}],
    }))
}

async fn health(State(st): State<HttpState>) -> Response {
    let (ok, mut detail) = st.health.check().await;
    with_routing(&mut detail, &st.orchestrator);
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"status": if ok { "ok" } else { "unavailable" }, "upstreams": detail})),
    )
        .into_response()
}

/// Marks each upstream of `/health`'s report with whether the router sends it calls now
/// (`"routed"`): a replica answers its health check up to a check interval before the router
/// admits it again, and one the router ejected for a failed call may still answer.
fn with_routing(detail: &mut Value, o: &Orchestrator) {
    for entry in detail.as_array_mut().into_iter().flatten() {
        let addr = entry["addr"].as_str().unwrap_or_default();
        let upstreams = match entry["service"].as_str() {
            Some("llm-svc") => Some(&o.llm),
            Some("vision-svc") => o.vision.as_ref(),
            _ => None,
        };
        if let Some(routed) = upstreams.and_then(|u| u.routed(addr)) {
            entry["routed"] = Value::Bool(routed);
        }
    }
}

async fn metrics(State(st): State<HttpState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        st.orchestrator.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod hostile;

#[cfg(test)]
mod canned_llm;

#[cfg(test)]
mod canned_answers;

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_proto::sampling::SamplingParams;

    /// `body` as the handler reads it, with no checkpoint defaults.
    fn parse(
        body: &Value,
        default_max_tokens: usize,
    ) -> Result<(ChatRequest, ResponseOptions), GatewayError> {
        parse_request(
            body.to_string().as_bytes(),
            default_max_tokens,
            &RequestLimits::default(),
            &SamplingDefaults::default(),
        )
        .map(|(req, options, _)| (req, options))
    }

    /// A one-message chat with `fields` added.
    fn chat_with(fields: Value) -> Value {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn field(name: &str, value: Value) -> Value {
        Value::Object(Map::from_iter([(name.to_string(), value)]))
    }

    #[test]
    fn reads_every_sampling_control() {
        let (req, options) = parse(
            &chat_with(json!({
                "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                "logit_bias": {"7": -100, "3": 2.5}, "logprobs": true, "top_logprobs": 4,
                "seed": 11, "n": 1,
            })),
            8,
        )
        .unwrap();
        let want = SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            presence_penalty: 1.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.1,
            logit_bias: vec![(3, 2.5), (7, -100.0)],
            logprobs: Some(4),
            seed: Some(11),
            choice: 0,
        };
        assert_eq!(req.sampling, want);
        assert!(options.logprobs);
        // logprobs alone: the pick's logprob, no alternatives; false or absent: none.
        let (req, options) = parse(&chat_with(json!({"logprobs": true})), 8).unwrap();
        assert_eq!((req.sampling.logprobs, options.logprobs), (Some(0), true));
        let (req, options) = parse(&chat_with(json!({"logprobs": false})), 8).unwrap();
        assert_eq!((req.sampling.logprobs, options.logprobs), (None, false));
        // Absent fields are off: greedy, no penalties.
        let (req, _) = parse(&chat_with(json!({})), 8).unwrap();
        assert_eq!(req.sampling, SamplingParams::default());
    }

    #[test]
    fn bad_sampling_values_are_a_400_naming_the_field() {
        for (fields, name) in [
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "`top_logprobs`",
            ),
            (
                json!({"logprobs": true, "top_logprobs": -1}),
                "`top_logprobs`",
            ),
            (json!({"top_logprobs": 2}), "`top_logprobs`"),
            (json!({"logprobs": false, "top_logprobs": 2}), "`logprobs`"),
            (json!({"n": 0}), "`n`"),
            (json!({"n": -1}), "`n`"),
            (json!({"n": 17}), "`n`"),
            (json!({"n": 2.5}), "`n`"),
            (json!({"presence_penalty": 2.5}), "`presence_penalty`"),
            (json!({"presence_penalty": -2.01}), "`presence_penalty`"),
            (json!({"frequency_penalty": -3}), "`frequency_penalty`"),
            (json!({"frequency_penalty": 2.1}), "`frequency_penalty`"),
            (json!({"repetition_penalty": 0}), "`repetition_penalty`"),
            (json!({"repetition_penalty": 11}), "`repetition_penalty`"),
            (json!({"logit_bias": {"5": 101}}), "`logit_bias`"),
            (json!({"logit_bias": {"5": -100.5}}), "`logit_bias`"),
            (json!({"logit_bias": {"abc": 1}}), "`logit_bias`"),
            (json!({"logit_bias": {"-1": 1}}), "`logit_bias`"),
            (json!({"logit_bias": {"5": "up"}}), "`logit_bias`"),
            (json!({"logit_bias": {"5": 1, "05": 2}}), "`logit_bias`"),
            (json!({"logit_bias": [1, 2]}), "`logit_bias`"),
            (json!({"min_p": 1.5}), "`min_p`"),
            (json!({"min_p": -0.1}), "`min_p`"),
            (json!({"top_k": -2}), "`top_k`"),
            (json!({"temperature": "hot"}), "`temperature`"),
            (json!({"logprobs": "yes"}), "`logprobs`"),
        ] {
            let e = parse(&chat_with(fields.clone()), 8).unwrap_err();
            assert_eq!(e.http_status(), 400, "{fields}: {e}");
            assert!(e.to_string().contains(name), "{fields}: {e}");
        }
        // At the edges of the ranges, accepted.
        for fields in [
            json!({"logprobs": true, "top_logprobs": 20}),
            json!({"logprobs": true, "top_logprobs": 0}),
            json!({"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 10}),
            json!({"logit_bias": {"5": 100, "6": -100}, "min_p": 1}),
            json!({"n": null, "logprobs": null, "top_logprobs": null, "logit_bias": null}),
            json!({"n": 16}),
        ] {
            assert!(parse(&chat_with(fields.clone()), 8).is_ok(), "{fields}");
        }
    }

    #[test]
    fn unimplemented_fields_are_refused_inert_ones_accepted_and_unknown_ones_named() {
        let e = parse(&chat_with(json!({"best_of": 2})), 8).unwrap_err();
        assert_eq!(e.http_status(), 400);
        assert!(e.to_string().contains("`best_of` is not supported"), "{e}");
        for (name, _) in fields::REFUSED {
            let e = parse(&chat_with(field(name, json!("something"))), 8).unwrap_err();
            assert!(e.to_string().contains(&format!("`{name}`")), "{name}: {e}");
        }
        // The same fields sent as null or as their off value ask for nothing.
        for off in [
            json!({"tools": [], "tool_choice": "none", "functions": null}),
            json!({"response_format": {"type": "text"}, "modalities": ["text"]}),
            json!({"best_of": 1, "use_beam_search": false, "skip_special_tokens": true}),
        ] {
            assert!(parse(&chat_with(off.clone()), 8).is_ok(), "{off}");
        }
        for name in fields::IGNORED {
            let (req, _) = parse(&chat_with(field(name, json!({"any": "thing"}))), 8)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(req.sampling, SamplingParams::default(), "{name}");
        }
        let e = parse(&chat_with(json!({"user": "u1", "frobnicate": 1})), 8).unwrap_err();
        assert_eq!(e.http_status(), 400);
        assert!(e.to_string().contains("unknown field `frobnicate`"), "{e}");
        // Every field the list says is read, the request struct reads (null is absent).
        for name in fields::READ.iter().filter(|&&n| n != "messages") {
            parse(&chat_with(field(name, Value::Null)), 8)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn checkpoint_defaults_fill_only_what_the_body_leaves_out() {
        let defaults = SamplingDefaults {
            temperature: Some(0.7),
            top_k: Some(20),
            top_p: Some(0.8),
            presence_penalty: Some(1.5),
            ..Default::default()
        };
        let body = chat_with(json!({"temperature": 0, "presence_penalty": 0}));
        let (req, _, _) = parse_request(
            body.to_string().as_bytes(),
            8,
            &RequestLimits::default(),
            &defaults,
        )
        .unwrap();
        let s = req.sampling;
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.presence_penalty),
            (0.0, 20, 0.8, 0.0)
        );
    }

    #[test]
    fn logprobs_take_openai_shape_with_each_tokens_text_and_bytes() {
        let lp = |id, text: &str, bytes: &[u8], logprob| Logprob {
            id,
            text: text.into(),
            bytes: bytes.to_vec(),
            logprob,
        };
        let tokens = vec![
            TokenLogprobs {
                token: lp(5, " the", b" the", -0.5),
                top: vec![
                    lp(5, " the", b" the", -0.5),
                    lp(9, "\u{FFFD}", &[0xE2], f32::NEG_INFINITY),
                ],
            },
            TokenLogprobs {
                token: lp(7, "\u{FFFD}", &[0xE2, 0x80], -1.25),
                top: vec![],
            },
        ];
        assert_eq!(
            logprobs_json(&tokens),
            json!({"content": [
                {"token": " the", "logprob": -0.5, "bytes": [32, 116, 104, 101], "top_logprobs": [
                    {"token": " the", "logprob": -0.5, "bytes": [32, 116, 104, 101]},
                    {"token": "\u{FFFD}", "logprob": -9999.0, "bytes": [226]},
                ]},
                {"token": "\u{FFFD}", "logprob": -1.25, "bytes": [226, 128], "top_logprobs": []},
            ]})
        );
    }

    #[test]
    fn parses_openai_messages_with_data_urls_and_defaults() {
        let png = base64::engine::general_purpose::STANDARD.encode([137u8, 80, 78, 71]);
        let body = json!({
            "model": "x",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
                    {"type": "text", "text": "what is it?"}
                ]}
            ],
            "stop": "END",
            "max_tokens": 5,
        });
        let (req, options) = parse(&body, 256).unwrap();
        assert!(!options.stream && !options.include_usage && !options.return_token_ids);
        assert_eq!(req.max_new_tokens, 5);
        assert_eq!(req.stop, vec!["END".to_string()]);
        assert_eq!(req.sampling.temperature, 0.0);
        assert!(matches!(&req.messages[1].parts[0], Part::Image(b) if b == &[137, 80, 78, 71]));
    }

    #[test]
    fn rejects_other_url_schemes_bad_roles_and_bad_json_with_the_field() {
        let remote = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}]}]});
        let e = parse(&remote, 1).unwrap_err();
        assert!(
            e.to_string().contains("messages[0].content[0]") && e.to_string().contains("ftp:"),
            "{e}"
        );
        // An https URL is left for the fetcher, its part a placeholder.
        let https = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]});
        let (req, _, pending) = parse_request(
            https.to_string().as_bytes(),
            1,
            &RequestLimits::default(),
            &SamplingDefaults::default(),
        )
        .unwrap();
        assert_eq!(pending.len(), 1);
        assert_eq!((pending[0].message, pending[0].part), (0, 1));
        assert_eq!(pending[0].at, "messages[0].content[1]");
        assert!(matches!(&req.messages[0].parts[1], Part::Image(b) if b.is_empty()));
        let role = json!({"messages": [{"role": "robot", "content": "hi"}]});
        let e = parse(&role, 1).unwrap_err();
        assert!(e.to_string().contains("messages[0].role"), "{e}");
        let e = parse_request(
            b"{not json",
            1,
            &RequestLimits::default(),
            &SamplingDefaults::default(),
        )
        .unwrap_err();
        assert_eq!(e.http_status(), 400);
    }

    #[test]
    fn reads_the_streaming_options_and_the_vllm_extensions() {
        let body = json!({
            "messages": [{"role": "user", "content": "hi"}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "return_token_ids": true,
            "ignore_eos": true,
            "top_k": -1,
        });
        let (req, options) = parse(&body, 7).unwrap();
        assert!(options.stream && options.include_usage && options.return_token_ids);
        assert!(req.ignore_eos);
        assert_eq!((req.sampling.top_k, req.max_new_tokens), (0, 7));
    }
}
