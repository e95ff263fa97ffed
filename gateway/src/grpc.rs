//! The public gRPC API (`vlm.v1.Gateway`): `Chat` (unary) and `ChatStream` (server-streaming).
//! Requests are read as the HTTP API reads its own: the same sampling fields, the same
//! checkpoint defaults for those left out ([`crate::sampling`]), the same logprobs per token.
//! With `n` set, `ChatResponse.choices` lists every choice (the top-level fields stay choice
//! 0's, as for a client that predates `n`) and each `ChatChunk` names its choice in `index`.
//! Tools, tool choice and output formats are read as the HTTP API reads them (the tools are
//! put in OpenAI's shape and checked by [`crate::tools`]); reasoning and tool calls come back
//! split out of the text as [`crate::output`] splits them.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{field::Empty, info_span, Instrument};
use vlm_proto::pb::{self, content_part, gateway_server::Gateway, tool_choice};
use vlm_proto::telemetry;

use crate::chat::{Message, Part};
use crate::gateway_error::GatewayError;
use crate::media::{is_fetched, PendingImage};
use crate::orchestrator::{choices, ChatEvent, Logprob, Orchestrator, TokenLogprobs};
use crate::output::{ToolCall, ToolCallDelta};
use crate::request::ChatRequest;
use crate::sampling::{RequestedSampling, SamplingDefaults};
use crate::structured;
use crate::tools::{read_tools, ToolRequest};

pub struct GatewayService {
    pub orchestrator: Arc<Orchestrator>,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: usize,
    /// Longest a request may take when the client sets no deadline.
    pub request_timeout: Duration,
}

/// The request's sampling fields; the ranges are checked once the defaults are in.
fn requested_sampling(r: &pb::ChatRequest) -> Result<RequestedSampling, GatewayError> {
    let max = vlm_proto::sampling::MAX_TOP_LOGPROBS;
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (_, Some(n)) if n as usize > max => {
            return Err(GatewayError::Invalid(format!(
                "`top_logprobs` must be between 0 and {max}, got {n}"
            )))
        }
        (false, Some(n)) => {
            return Err(GatewayError::Invalid(format!(
                "`top_logprobs` ({n}) needs `logprobs` set to true"
            )))
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, None) => None,
    };
    Ok(RequestedSampling {
        temperature: r.temperature,
        top_k: r.top_k.map(|k| k as usize),
        top_p: r.top_p,
        min_p: r.min_p,
        presence_penalty: r.presence_penalty,
        frequency_penalty: r.frequency_penalty,
        repetition_penalty: r.repetition_penalty,
        logit_bias: r.logit_bias.iter().map(|(&id, &b)| (id, b)).collect(),
        logprobs,
        seed: r.seed,
    })
}

/// Checks roles, parts and sampling values, and applies the defaults: `default_max_tokens`,
/// and `defaults` for the sampling fields left out. Image URLs are left as empty images
/// (see [`read_request`]).
pub fn request_from_pb(
    r: pb::ChatRequest,
    default_max_tokens: usize,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, GatewayError> {
    read_request(r, default_max_tokens, defaults).map(|(req, _)| req)
}

/// [`request_from_pb`], with the image URLs to fetch into their (empty) parts.
pub fn read_request(
    r: pb::ChatRequest,
    default_max_tokens: usize,
    defaults: &SamplingDefaults,
) -> Result<(ChatRequest, Vec<PendingImage>), GatewayError> {
    let sampling = defaults.apply(requested_sampling(&r)?);
    sampling
        .validate()
        .map_err(|e| GatewayError::Invalid(e.to_string()))?;
    let mut messages = Vec::with_capacity(r.messages.len());
    let mut pending = Vec::new();
    for (i, m) in r.messages.into_iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(GatewayError::Invalid(format!(
                "messages[{i}].role must be system, user, assistant or tool, got {:?}",
                m.role
            )));
        }
        let parts = m
            .content
            .into_iter()
            .enumerate()
            .map(|(j, p)| match p.part {
                Some(content_part::Part::Text(t)) => Ok(Part::Text(t)),
                Some(content_part::Part::Image(b)) => Ok(Part::Image(b)),
                Some(content_part::Part::ImageUrl(url)) => {
                    let at = format!("messages[{i}].content[{j}]");
                    if !is_fetched(&url) {
                        let scheme = url.split(':').next().unwrap_or_default();
                        return Err(GatewayError::Invalid(format!(
                            "{at}: image_url may be an http:, https: or file: URL (send bytes as `image`), got a {scheme}: URL"
                        )));
                    }
                    pending.push(PendingImage {
                        message: i,
                        part: j,
                        url,
                        at,
                    });
                    Ok(Part::Image(Vec::new()))
                }
                None => Err(GatewayError::Invalid(format!(
                    "messages[{i}].content[{j}] is empty"
                ))),
            })
            .collect::<Result<_, _>>()?;
        messages.push(Message {
            role: m.role,
            parts,
            tool_calls: m.tool_calls.iter().map(sent_call_json).collect(),
            tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
        });
    }
    let tools = read_pb_tools(&r.tools, r.tool_choice.as_ref(), r.parallel_tool_calls)?;
    let format = structured::from_pb(r.output_format.as_ref())?;
    let template_kwargs = match r.chat_template_kwargs_json.trim() {
        "" => Default::default(),
        text => serde_json::from_str(text).map_err(|e| {
            GatewayError::Invalid(format!(
                "`chat_template_kwargs_json` must be the JSON text of an object: {e}"
            ))
        })?,
    };
    let req = ChatRequest {
        messages,
        sampling,
        max_new_tokens: r.max_tokens.map_or(default_max_tokens, |m| m as usize),
        stop: r.stop,
        ignore_eos: r.ignore_eos,
        return_logits: false,
        constraint: format.map(|f| f.constraint()),
        tools,
        template_kwargs,
    };
    Ok((req, pending))
}

/// An earlier call as the chat template takes it (OpenAI's shape).
fn sent_call_json(c: &pb::ToolCall) -> Value {
    json!({"id": c.id, "type": "function",
        "function": {"name": c.name, "arguments": c.arguments}})
}

/// The tools as the HTTP API reads them, from their OpenAI shape, so both APIs check them
/// one way.
fn read_pb_tools(
    tools: &[pb::Tool],
    choice: Option<&pb::ToolChoice>,
    parallel: Option<bool>,
) -> Result<ToolRequest, GatewayError> {
    let specs = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut function = json!({"name": t.name, "description": t.description});
            if !t.parameters_json.trim().is_empty() {
                let parameters: Value = serde_json::from_str(&t.parameters_json).map_err(|e| {
                    GatewayError::Invalid(format!("`tools[{i}].parameters_json` is not JSON: {e}"))
                })?;
                function["parameters"] = parameters;
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<Value>, GatewayError>>()?;
    let choice = choice.and_then(|c| c.choice.as_ref()).map(|c| match c {
        tool_choice::Choice::Mode(mode) => Value::String(mode.clone()),
        tool_choice::Choice::Function(name) => {
            json!({"type": "function", "function": {"name": name}})
        }
    });
    read_tools(Some(&Value::Array(specs)), choice.as_ref(), parallel)
}

fn tool_call_to_pb(c: ToolCall) -> pb::ToolCall {
    pb::ToolCall {
        index: c.index,
        id: c.id,
        name: c.name,
        arguments: c.arguments,
    }
}

/// A streamed piece of a call as a `ChatChunk` carries it: `id` and `name` on the call's
/// first piece only (empty on the others), `arguments` the text to add.
fn tool_call_delta_to_pb(d: ToolCallDelta) -> pb::ToolCall {
    let (id, name) = d.head.map_or_else(Default::default, |h| (h.id, h.name));
    pb::ToolCall {
        index: d.index,
        id,
        name,
        arguments: d.arguments,
    }
}

fn top_logprob_to_pb(l: Logprob) -> pb::ChatTopLogprob {
    pb::ChatTopLogprob {
        token: l.text,
        logprob: l.logprob,
        bytes: l.bytes,
        token_id: l.id,
    }
}

/// A token's logprobs as the public API carries them.
fn logprobs_to_pb(t: TokenLogprobs) -> pb::ChatTokenLogprob {
    pb::ChatTokenLogprob {
        token: t.token.text,
        logprob: t.token.logprob,
        bytes: t.token.bytes,
        top: t.top.into_iter().map(top_logprob_to_pb).collect(),
        token_id: t.token.id,
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::ChatChunk, Status>> + Send>>;

impl GatewayService {
    /// The request read, its image URLs fetched (concurrently) into their parts.
    async fn read_and_fetch(&self, r: pb::ChatRequest) -> Result<ChatRequest, GatewayError> {
        let (mut req, pending) = read_request(
            r,
            self.default_max_tokens,
            &self.orchestrator.sampling_defaults,
        )?;
        // Counted before anything is fetched (validate_request counts again).
        let images = crate::request::image_parts(&req.messages).count();
        let max_images = self.orchestrator.limits.max_images;
        if images > max_images {
            return Err(GatewayError::Invalid(format!(
                "a request may carry at most {max_images} images (--max-images), got {images}"
            )));
        }
        self.orchestrator
            .media
            .resolve(
                &mut req.messages,
                pending,
                self.orchestrator.limits.max_image_bytes,
            )
            .await?;
        Ok(req)
    }

    fn timeout(&self, metadata: &tonic::metadata::MetadataMap) -> Duration {
        vlm_proto::grpc_timeout(metadata)
            .map_or(self.request_timeout, |t| t.min(self.request_timeout))
    }
}

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn chat(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<pb::ChatResponse>, Status> {
        let span = info_span!(
            "gateway.chat",
            otel.kind = "server",
            api = "grpc",
            stream = false,
            trace_id = Empty
        );
        telemetry::adopt_remote_parent(&span, request.metadata());
        let timeout = self.timeout(request.metadata());
        async move {
            let r = request.into_inner();
            let n_set = r.n.is_some();
            let n = choices(r.n.map(i64::from))?;
            let req = self.read_and_fetch(r).await?;
            let mut rx = self
                .orchestrator
                .chat(req, n, "grpc", Some(timeout))
                .await?;
            let mut choices: Vec<pb::ChatChoice> = (0..n)
                .map(|i| pb::ChatChoice {
                    index: i as u32,
                    ..Default::default()
                })
                .collect();
            let mut calls: Vec<Vec<ToolCall>> = vec![Vec::new(); n];
            let mut usage = pb::Usage::default();
            while let Some(ev) = rx.recv().await {
                match ev? {
                    ChatEvent::Delta {
                        choice,
                        text,
                        reasoning,
                        tool_calls,
                        token_ids,
                        logprobs,
                    } => {
                        let c = &mut choices[choice as usize];
                        c.text.push_str(&text);
                        c.reasoning.push_str(&reasoning);
                        for d in tool_calls {
                            ToolCall::gather(&mut calls[choice as usize], d);
                        }
                        c.token_ids.extend(token_ids);
                        c.logprobs.extend(logprobs.into_iter().map(logprobs_to_pb));
                    }
                    ChatEvent::Done {
                        choice,
                        finish,
                        prompt_tokens,
                        completion_tokens,
                    } => {
                        choices[choice as usize].finish_reason = finish as i32;
                        usage.prompt_tokens = prompt_tokens;
                        usage.completion_tokens += completion_tokens;
                    }
                }
            }
            for (c, calls) in choices.iter_mut().zip(calls) {
                c.tool_calls = calls.into_iter().map(tool_call_to_pb).collect();
            }
            // The top-level fields are choice 0's; `choices` has them all when n was asked.
            let first = if n_set {
                choices[0].clone()
            } else {
                std::mem::take(&mut choices[0])
            };
            Ok(Response::new(pb::ChatResponse {
                text: first.text,
                token_ids: first.token_ids,
                finish_reason: first.finish_reason,
                usage: Some(usage),
                logprobs: first.logprobs,
                tool_calls: first.tool_calls,
                reasoning: first.reasoning,
                choices: if n_set { choices } else { Vec::new() },
            }))
        }
        .instrument(span)
        .await
    }

    type ChatStreamStream = ChunkStream;

    async fn chat_stream(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let span = info_span!(
            "gateway.chat",
            otel.kind = "server",
            api = "grpc",
            stream = true,
            trace_id = Empty
        );
        telemetry::adopt_remote_parent(&span, request.metadata());
        let timeout = self.timeout(request.metadata());
        let rx = async {
            let r = request.into_inner();
            let n = choices(r.n.map(i64::from))?;
            let req = self.read_and_fetch(r).await?;
            self.orchestrator.chat(req, n, "grpc", Some(timeout)).await
        }
        .instrument(span)
        .await?;
        let chunks = ReceiverStream::new(rx).map(|ev| {
            Ok(match ev? {
                ChatEvent::Delta {
                    choice,
                    text,
                    reasoning,
                    tool_calls,
                    token_ids,
                    logprobs,
                } => pb::ChatChunk {
                    index: choice,
                    text,
                    reasoning,
                    tool_calls: tool_calls.into_iter().map(tool_call_delta_to_pb).collect(),
                    token_ids,
                    logprobs: logprobs.into_iter().map(logprobs_to_pb).collect(),
                    ..Default::default()
                },
                ChatEvent::Done {
                    choice,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                } => pb::ChatChunk {
                    index: choice,
                    finish_reason: finish as i32,
                    usage: Some(pb::Usage {
                        prompt_tokens,
                        completion_tokens,
                    }),
                    ..Default::default()
                },
            })
        });
        Ok(Response::new(Box::pin(chunks)))
    }
}
