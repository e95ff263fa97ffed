//! A streamed chat completion (`"stream": true`): the orchestrator's [`ChatEvent`]s in,
//! server-sent events out, one `chat.completion.chunk` per event in OpenAI's shape.
//!
//! Every token of every stream passes here, so each chunk is written straight to the bytes
//! of its event (`data: {...}\n\n`): serde structs that borrow the event's text and ids, one
//! buffer a chunk, no JSON value tree and no second copy into the event. The keys come
//! sorted; the tests hold the bytes beside `json!` chunks with their keys sorted.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{finish_str, ResponseOptions, NEG_INF_LOGPROB};
use crate::gateway_error::GatewayError;
use crate::orchestrator::{ChatEvent, Logprob, TokenLogprobs};
use crate::output::ToolCallDelta;

#[derive(Serialize)]
struct Chunk<'a> {
    choices: &'a [Choice<'a>],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct Choice<'a> {
    delta: Delta<'a>,
    finish_reason: Option<&'static str>,
    index: u32,
    logprobs: Option<Logprobs<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [CallChunk<'a>],
}

/// A piece of a call in a delta, in OpenAI's delta shape: `id`, `type` and `function.name`
/// on the call's first piece only, `function.arguments` on every piece (`""` on a first one
/// whose arguments have not begun).
#[derive(Serialize)]
struct CallChunk<'a> {
    function: FunctionDelta<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    index: u32,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    arguments: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

impl<'a> CallChunk<'a> {
    fn of(d: &'a ToolCallDelta) -> Self {
        Self {
            function: FunctionDelta {
                arguments: &d.arguments,
                name: d.head.as_ref().map(|h| h.name.as_str()),
            },
            id: d.head.as_ref().map(|h| h.id.as_str()),
            index: d.index,
            kind: d.head.as_ref().map(|_| "function"),
        }
    }
}

#[derive(Serialize)]
struct Usage {
    completion_tokens: u32,
    prompt_tokens: u32,
    total_tokens: u32,
}

/// A choice's `logprobs`: `{"content": [entry, ...]}`, one entry per token.
#[derive(Serialize)]
pub(super) struct Logprobs<'a> {
    content: Vec<Entry<'a>>,
}

/// A token's logprob entry; `top_logprobs` only on a generated token's, not on its
/// alternatives'.
#[derive(Serialize)]
struct Entry<'a> {
    bytes: &'a [u8],
    logprob: f64,
    token: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<Vec<Entry<'a>>>,
}

impl<'a> Entry<'a> {
    fn of(l: &'a Logprob, top_logprobs: Option<Vec<Entry<'a>>>) -> Self {
        // JSON has no minus infinity; f64 as serde_json writes an f32 it is given.
        let logprob = if l.logprob.is_finite() {
            l.logprob
        } else {
            NEG_INF_LOGPROB
        };
        Self {
            bytes: &l.bytes,
            logprob: logprob as f64,
            token: &l.text,
            top_logprobs,
        }
    }
}

impl<'a> Logprobs<'a> {
    pub(super) fn of(tokens: &'a [TokenLogprobs]) -> Self {
        Self {
            content: tokens
                .iter()
                .map(|t| {
                    Entry::of(
                        &t.token,
                        Some(t.top.iter().map(|l| Entry::of(l, None)).collect()),
                    )
                })
                .collect(),
        }
    }
}

/// The server-sent events of one streamed answer of `n` choices.
pub(super) struct ChunkWriter {
    id: String,
    created: u64,
    model: String,
    options: ResponseOptions,
    /// Choices finished, and their completion tokens: the usage chunk follows the last
    /// finish.
    finished: usize,
    completion_tokens: u32,
}

/// The last event of every stream.
const DONE: &[u8] = b"data: [DONE]\n\n";

impl ChunkWriter {
    pub(super) fn new(id: String, created: u64, model: String, options: ResponseOptions) -> Self {
        Self {
            id,
            created,
            model,
            options,
            finished: 0,
            completion_tokens: 0,
        }
    }

    /// Appends the event of a chunk with `choices` (and `usage`) to `out`.
    fn write(&self, out: &mut Vec<u8>, choices: &[Choice], usage: Option<Usage>) {
        out.extend_from_slice(b"data: ");
        let chunk = Chunk {
            choices,
            created: self.created,
            id: &self.id,
            model: &self.model,
            object: "chat.completion.chunk",
            usage,
        };
        serde_json::to_writer(&mut *out, &chunk).expect("a chunk serializes to a Vec");
        out.extend_from_slice(b"\n\n");
    }

    /// The chunk each choice opens with: its role.
    fn roles(&self) -> Bytes {
        let mut out = Vec::new();
        for index in 0..self.options.n as u32 {
            let role = Delta {
                content: Some(""),
                role: Some("assistant"),
                ..Default::default()
            };
            self.write(&mut out, &[choice(index, role, None)], None);
        }
        out.into()
    }

    /// The events one [`ChatEvent`] (or a failure) makes; `None` for a step whose text is
    /// held back and that carries nothing else the client asked to see.
    fn event(&mut self, ev: Result<ChatEvent, GatewayError>) -> Option<Bytes> {
        let mut out = Vec::with_capacity(256);
        match ev {
            Ok(ChatEvent::Delta {
                choice: index,
                text,
                reasoning,
                tool_calls,
                token_ids,
                logprobs,
            }) => {
                let with_logprobs = self.options.logprobs && !logprobs.is_empty();
                let other_parts = !reasoning.is_empty() || !tool_calls.is_empty();
                if text.is_empty()
                    && !other_parts
                    && !self.options.return_token_ids
                    && !with_logprobs
                {
                    return None;
                }
                let calls: Vec<CallChunk> = tool_calls.iter().map(CallChunk::of).collect();
                let content = Delta {
                    // A delta of reasoning or calls alone carries no content key.
                    content: (!text.is_empty() || !other_parts).then_some(text.as_str()),
                    reasoning_content: (!reasoning.is_empty()).then_some(reasoning.as_str()),
                    role: None,
                    tool_calls: &calls,
                };
                let mut c = choice(index, content, None);
                if self.options.return_token_ids {
                    c.token_ids = Some(&token_ids);
                }
                if with_logprobs {
                    c.logprobs = Some(Logprobs::of(&logprobs));
                }
                self.write(&mut out, &[c], None);
            }
            Ok(ChatEvent::Done {
                choice: index,
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                self.finished += 1;
                self.completion_tokens += completion_tokens;
                let finish = Some(finish_str(finish));
                self.write(&mut out, &[choice(index, Delta::default(), finish)], None);
                if self.options.include_usage && self.finished == self.options.n {
                    let usage = Usage {
                        completion_tokens: self.completion_tokens,
                        prompt_tokens,
                        total_tokens: prompt_tokens + self.completion_tokens,
                    };
                    self.write(&mut out, &[], Some(usage));
                }
            }
            Err(e) => {
                let error = serde_json::json!({"error": {"message": e.to_string(), "type": e.kind(), "param": null, "code": null}});
                out.extend_from_slice(b"data: ");
                serde_json::to_writer(&mut out, &error).expect("JSON serializes to a Vec");
                out.extend_from_slice(b"\n\n");
            }
        }
        Some(out.into())
    }
}

fn choice<'a>(index: u32, delta: Delta<'a>, finish: Option<&'static str>) -> Choice<'a> {
    Choice {
        delta,
        finish_reason: finish,
        index,
        logprobs: None,
        token_ids: None,
    }
}

/// The response: every choice's role chunk, a chunk per event of `rx` as it comes, then
/// `[DONE]`; the headers axum's `Sse` sends.
pub(super) fn response(
    mut writer: ChunkWriter,
    rx: mpsc::Receiver<Result<ChatEvent, GatewayError>>,
) -> Response {
    let roles = writer.roles();
    let events = ReceiverStream::new(rx).filter_map(move |ev| std::future::ready(writer.event(ev)));
    let body = futures::stream::once(std::future::ready(roles))
        .chain(events)
        .chain(futures::stream::once(std::future::ready(
            Bytes::from_static(DONE),
        )))
        .map(Ok::<_, Infallible>);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use vlm_proto::pb;

    /// The chunks as the handler built them before, with `json!`: what the bytes must stay.
    fn oracle_chunk(choice: u32, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [{"index": choice, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    }

    fn event(v: &Value) -> String {
        format!("data: {}\n\n", sorted(v))
    }

    /// `v` with every object's keys in order: the writer's order (the workspace's serde_json
    /// keeps `json!`'s own order).
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(o) => {
                let mut keys: Vec<&String> = o.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&o[k])))
                        .collect(),
                )
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }

    fn options(n: usize, token_ids: bool, logprobs: bool, usage: bool) -> ResponseOptions {
        ResponseOptions {
            n,
            stream: true,
            include_usage: usage,
            return_token_ids: token_ids,
            logprobs,
        }
    }

    fn text(b: Option<Bytes>) -> String {
        String::from_utf8(b.map_or(Vec::new(), |b| b.to_vec())).unwrap()
    }

    #[test]
    fn chunks_are_byte_for_byte_what_json_values_gave() {
        let lp = |id, t: &str, bytes: &[u8], logprob| Logprob {
            id,
            text: t.into(),
            bytes: bytes.to_vec(),
            logprob,
        };
        let logprobs = vec![TokenLogprobs {
            token: lp(5, "\u{FFFD}", &[0xE2], -0.1),
            top: vec![
                lp(5, "\u{FFFD}", &[0xE2], -0.1),
                lp(9, " \"q\"\n", b" \"q\"\n", f32::NEG_INFINITY),
            ],
        }];
        for (token_ids, with_logprobs, usage) in [
            (false, false, false),
            (true, false, true),
            (true, true, true),
            (false, true, false),
        ] {
            let mut w = ChunkWriter::new(
                "chatcmpl-1".into(),
                7,
                "m".into(),
                options(2, token_ids, with_logprobs, usage),
            );
            let role = json!({"role": "assistant", "content": ""});
            assert_eq!(
                text(Some(w.roles())),
                event(&oracle_chunk(0, role.clone(), None)) + &event(&oracle_chunk(1, role, None))
            );
            for (t, ids) in [("héllo \"wörld\"\n\t\u{1}", vec![3, 4]), ("", vec![8])] {
                let got = text(w.event(Ok(ChatEvent::Delta {
                    choice: 1,
                    text: t.into(),
                    reasoning: String::new(),
                    tool_calls: Vec::new(),
                    token_ids: ids.clone(),
                    logprobs: if with_logprobs {
                        logprobs.clone()
                    } else {
                        Vec::new()
                    },
                })));
                if t.is_empty() && !token_ids && !with_logprobs {
                    assert_eq!(got, "");
                    continue;
                }
                let mut want = oracle_chunk(1, json!({ "content": t }), None);
                if token_ids {
                    want["choices"][0]["token_ids"] = json!(ids);
                }
                if with_logprobs {
                    want["choices"][0]["logprobs"] = super::super::logprobs_json(&logprobs);
                }
                assert_eq!(got, event(&want));
            }
            for (choice, completion) in [(1u32, 5u32), (0, 3)] {
                let got = text(w.event(Ok(ChatEvent::Done {
                    choice,
                    finish: pb::FinishReason::Length,
                    prompt_tokens: 11,
                    completion_tokens: completion,
                })));
                let mut want = event(&oracle_chunk(choice, json!({}), Some("length")));
                if usage && choice == 0 {
                    let mut u = oracle_chunk(0, json!({}), None);
                    u["choices"] = json!([]);
                    u["usage"] =
                        json!({"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19});
                    want += &event(&u);
                }
                assert_eq!(got, want);
            }
        }
        // A call's first delta has its id, type and name; a later one its arguments alone.
        let mut w = ChunkWriter::new(
            "chatcmpl-1".into(),
            7,
            "m".into(),
            options(1, false, false, false),
        );
        let head = |arguments: &str| ToolCallDelta {
            index: 0,
            head: Some(crate::output::CallHead {
                id: "call_x".into(),
                name: "f".into(),
            }),
            arguments: arguments.into(),
        };
        let more = |index, arguments: &str| ToolCallDelta {
            index,
            head: None,
            arguments: arguments.into(),
        };
        for (calls, want) in [
            (
                vec![head("")],
                json!([{"index": 0, "id": "call_x", "type": "function",
                    "function": {"name": "f", "arguments": ""}}]),
            ),
            (
                vec![more(0, "{\"a\": "), more(1, "[1")],
                json!([{"index": 0, "function": {"arguments": "{\"a\": "}},
                    {"index": 1, "function": {"arguments": "[1"}}]),
            ),
        ] {
            let got = text(w.event(Ok(ChatEvent::Delta {
                choice: 0,
                text: String::new(),
                reasoning: String::new(),
                tool_calls: calls,
                token_ids: vec![1],
                logprobs: Vec::new(),
            })));
            assert_eq!(
                got,
                event(&oracle_chunk(0, json!({ "tool_calls": want }), None))
            );
        }

        // An error is its JSON body as written (OpenAI's key order).
        let mut w = ChunkWriter::new("i".into(), 1, "m".into(), options(1, false, false, false));
        let e = GatewayError::Overloaded("busy".into());
        assert_eq!(
            text(w.event(Err(e))),
            "data: {\"error\":{\"message\":\"busy\",\"type\":\"overloaded\",\"param\":null,\"code\":null}}\n\n"
        );
    }
}
