//! OpenAI-compatible HTTP on the gateway: `POST /v1/chat/completions` (unary, or server-sent
//! events with `stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics`.
//!
//! Images come as `image_url` parts holding `data:` URLs (base64); the gateway fetches nothing
//! from the network. Beyond OpenAI's fields it accepts vLLM's `top_k`, `ignore_eos` and
//! `return_token_ids`. Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
//! with the status from [`GatewayError::http_status`].
//!
//! Hostile input is refused before it costs much: a body over `--max-body-bytes` gets 413
//! without being read further; JSON nested past serde_json's depth limit (128) or not UTF-8
//! gets 400; images are counted, and their base64 sized, before any is decoded.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use futures::StreamExt;
use llm_svc::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{field::Empty, info_span, Instrument};
use vlm_proto::pb;

use crate::chat::{Message, Part};
use crate::gateway_error::GatewayError;
use crate::orchestrator::{ChatEvent, Orchestrator};
use crate::pipeline::{ChatRequest, RequestLimits};

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

#[derive(Deserialize)]
struct OpenAiRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<OpenAiMessage>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    /// Not in OpenAI's API; accepted as vLLM does.
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    n: Option<u32>,
    /// Not in OpenAI's API; as vLLM: keep generating through eos.
    #[serde(default)]
    ignore_eos: bool,
    /// Not in OpenAI's API; as vLLM: each choice carries the generated token ids.
    #[serde(default)]
    return_token_ids: bool,
}

/// How the client asked to be answered, besides the chat itself.
#[derive(Debug, Default)]
struct ResponseOptions {
    /// Server-sent events, one chunk per step, instead of one JSON response.
    stream: bool,
    /// A last streamed chunk with the token counts (`stream_options.include_usage`).
    include_usage: bool,
    /// `token_ids` in each choice; when streaming, every step's tokens get a chunk, even
    /// those whose text is held back (an incomplete character), so a client can count and
    /// time each token (`vlm load` does).
    return_token_ids: bool,
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
}

/// Bytes of a `data:[<mime>][;base64],<data>` URL, refused unread when its base64 alone
/// says the image is over `max_bytes`.
fn data_url_bytes(url: &str, at: &str, max_bytes: usize) -> Result<Vec<u8>, GatewayError> {
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or_default();
        return Err(GatewayError::Invalid(format!(
            "{at}: only data: URLs are supported (the gateway fetches nothing), got a {scheme}: URL"
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

fn parse_request(
    body: &[u8],
    default_max_tokens: usize,
    limits: &RequestLimits,
) -> Result<(ChatRequest, ResponseOptions), GatewayError> {
    let r: OpenAiRequest = serde_json::from_slice(body).map_err(|e| {
        GatewayError::Invalid(format!(
            "request body is not a valid chat completion request: {e}"
        ))
    })?;
    let _ = r.model; // one model per gateway: any name is accepted
    if r.n.is_some_and(|n| n != 1) {
        return Err(GatewayError::Invalid("`n` must be 1".into()));
    }
    // Counted before any image is decoded (validate_request counts again, for gRPC too).
    let images = r
        .messages
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
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.into_iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        ) {
            return Err(GatewayError::Invalid(format!(
                "messages[{i}].role must be system, user or assistant, got {:?}",
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
                .map(|(j, item)| {
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
                                .ok_or_else(|| {
                                    GatewayError::Invalid(format!("{at}.image_url.url is missing"))
                                })?;
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
                })
                .collect::<Result<_, _>>()?,
            Value::Null => Vec::new(),
            _ => {
                return Err(GatewayError::Invalid(format!(
                    "messages[{i}].content must be a string or a list"
                )))
            }
        };
        messages.push(Message { role, parts });
    }
    let stop = match r.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        Some(_) => {
            return Err(GatewayError::Invalid(
                "`stop` must be a string or a list of strings".into(),
            ))
        }
    };
    let top_k = match r.top_k {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => {
            return Err(GatewayError::Invalid(format!(
                "`top_k` must be -1 (off) or at least 0, got {k}"
            )))
        }
    };
    let max_tokens = r
        .max_completion_tokens
        .or(r.max_tokens)
        .map_or(default_max_tokens, |m| m as usize);
    let options = ResponseOptions {
        stream: r.stream,
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: r.return_token_ids,
    };
    Ok((
        ChatRequest {
            messages,
            sampling: SamplingParams {
                // OpenAI's default temperature is 1; ours is greedy unless asked, as documented.
                temperature: r.temperature.unwrap_or(0.0),
                top_k,
                top_p: r.top_p.unwrap_or(1.0),
                seed: r.seed,
            },
            max_new_tokens: max_tokens,
            stop,
            ignore_eos: r.ignore_eos,
            return_logits: false,
        },
        options,
    ))
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

/// `POST /v1/chat/completions`'s body as the handler reads it (the response options dropped),
/// for the fuzz targets in `fuzz/`.
pub fn parse_chat_request(
    body: &[u8],
    default_max_tokens: usize,
    limits: &RequestLimits,
) -> Result<ChatRequest, GatewayError> {
    parse_request(body, default_max_tokens, limits).map(|(req, _)| req)
}

fn finish_str(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Length => "length",
        _ => "stop",
    }
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
    let (req, options) = match parse_request(&body, st.default_max_tokens, &st.orchestrator.limits)
    {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    span.record("stream", options.stream);
    let started = st
        .orchestrator
        .chat(req, "http", Some(st.request_timeout))
        .instrument(span.clone())
        .await;
    let rx = match started {
        Ok(rx) => rx,
        Err(e) => return error_response(&e),
    };
    let created = now_secs();
    if !options.stream {
        let mut rx = rx;
        let (mut text, mut finish, mut usage) = (String::new(), "stop", (0, 0));
        let mut token_ids = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Ok(ChatEvent::Delta {
                    text: t,
                    token_ids: ids,
                }) => {
                    text.push_str(&t);
                    token_ids.extend(ids);
                }
                Ok(ChatEvent::Done {
                    finish: f,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    finish = finish_str(f);
                    usage = (prompt_tokens, completion_tokens);
                }
                Err(e) => return error_response(&e),
            }
        }
        let mut body = json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": st.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }],
            "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1},
        });
        if options.return_token_ids {
            body["choices"][0]["token_ids"] = json!(token_ids);
        }
        return Json(body).into_response();
    }

    let model = st.model_name.clone();
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    };
    let first = futures::stream::once({
        let c = chunk(json!({"role": "assistant", "content": ""}), None);
        async move { c }
    });
    let usage_chunk = chunk.clone();
    let (include_usage, return_token_ids) = (options.include_usage, options.return_token_ids);
    let events = ReceiverStream::new(rx).flat_map(move |ev| {
        let items: Vec<Value> = match ev {
            Ok(ChatEvent::Delta { text, token_ids }) if return_token_ids => {
                let mut c = chunk(json!({"content": text}), None);
                c["choices"][0]["token_ids"] = json!(token_ids);
                vec![c]
            }
            Ok(ChatEvent::Delta { text, .. }) if text.is_empty() => vec![],
            Ok(ChatEvent::Delta { text, .. }) => vec![chunk(json!({"content": text}), None)],
            Ok(ChatEvent::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                let mut v = vec![chunk(json!({}), Some(finish_str(finish)))];
                if include_usage {
                    let mut u = usage_chunk(json!({}), None);
                    u["choices"] = json!([]);
                    u["usage"] = json!({
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    });
                    v.push(u);
                }
                v
            }
            Err(e) => vec![json!({"error": {"message": e.to_string(), "type": e.kind(), "param": null, "code": null}})],
        };
        futures::stream::iter(items)
    });
    let sse = first
        .chain(events)
        .map(|v| Ok::<_, Infallible>(Event::default().data(v.to_string())))
        .chain(futures::stream::once(async {
            Ok(Event::default().data("[DONE]"))
        }));
    Sse::new(sse).into_response()
}

async fn models(State(st): State<HttpState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "vlm"}],
    }))
}

async fn health(State(st): State<HttpState>) -> Response {
    let (ok, detail) = st.health.check().await;
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
mod tests {
    use super::*;

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
        let (req, options) =
            parse_request(body.to_string().as_bytes(), 256, &RequestLimits::default()).unwrap();
        assert!(!options.stream && !options.include_usage && !options.return_token_ids);
        assert_eq!(req.max_new_tokens, 5);
        assert_eq!(req.stop, vec!["END".to_string()]);
        assert_eq!(req.sampling.temperature, 0.0);
        assert!(matches!(&req.messages[1].parts[0], Part::Image(b) if b == &[137, 80, 78, 71]));
    }

    #[test]
    fn rejects_remote_urls_bad_roles_and_bad_json_with_the_field() {
        let remote = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]});
        let e =
            parse_request(remote.to_string().as_bytes(), 1, &RequestLimits::default()).unwrap_err();
        assert!(
            e.to_string().contains("messages[0].content[0]") && e.to_string().contains("https"),
            "{e}"
        );
        let role = json!({"messages": [{"role": "robot", "content": "hi"}]});
        let e =
            parse_request(role.to_string().as_bytes(), 1, &RequestLimits::default()).unwrap_err();
        assert!(e.to_string().contains("messages[0].role"), "{e}");
        let e = parse_request(b"{not json", 1, &RequestLimits::default()).unwrap_err();
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
        let (req, options) =
            parse_request(body.to_string().as_bytes(), 7, &RequestLimits::default()).unwrap();
        assert!(options.stream && options.include_usage && options.return_token_ids);
        assert!(req.ignore_eos);
        assert_eq!((req.sampling.top_k, req.max_new_tokens), (0, 7));
    }
}
