//! Tool calls, reasoning and output formats through the real gateway (router, orchestrator)
//! from a stand-in llm-svc that answers a canned text one token a message: the grammar the
//! request asks for reaches llm-svc, llm-svc's refusal of it reaches the client as a 400 with
//! its reason, and the answer comes back split into `reasoning_content`, `content` and
//! `tool_calls`, its streamed deltas adding up to the unary answer.
//!
//! The checkpoint is the tiny fixture with `<think>`, `</think>`, `<tool_call>` and
//! `</tool_call>` added as single tokens (as in Qwen's vocabularies) and a template that opens
//! `<think>` unless `enable_thinking` is false, as a Thinking checkpoint's does.

use std::sync::Mutex;

use super::*;
use crate::chat::ChatTokenizer;

/// The tags added as single tokens, with their ids.
const ADDED: [(&str, u32); 4] = [
    ("<think>", 414),
    ("</think>", 415),
    ("<tool_call>", 416),
    ("</tool_call>", 417),
];

/// A copy of the tiny fixture whose vocabulary has [`ADDED`] and whose template opens
/// `<think>` unless `enable_thinking` is false.
pub(crate) fn thinking_fixture() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let from = crate::tiny_fixture();
        let dir = std::env::temp_dir().join(format!("vlm-thinking-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "tokenizer_config.json"] {
            std::fs::copy(from.join(f), dir.join(f)).unwrap();
        }
        let mut tok: Value =
            serde_json::from_str(&std::fs::read_to_string(from.join("tokenizer.json")).unwrap())
                .unwrap();
        for (content, id) in ADDED {
            tok["added_tokens"].as_array_mut().unwrap().push(json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": false,
            }));
        }
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let template = std::fs::read_to_string(from.join("chat_template.jinja")).unwrap();
        let template = template.replace(
            "{{- '<|im_start|>assistant\\n' }}",
            "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>\\n' }}{%- endif %}",
        );
        assert!(template.contains("<think>"), "the generation prompt was found");
        std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
        dir
    })
    .clone()
}

struct Harness {
    state: HttpState,
    seen: Arc<Mutex<Vec<pb::GenerateRequest>>>,
}

/// A gateway of the thinking fixture whose llm-svc answers `answer` (its text tokenized, one
/// token a message, then stop) or refuses with its status.
async fn harness(answer: Result<&str, tonic::Status>) -> Harness {
    let dir = thinking_fixture();
    let chat = ChatTokenizer::from_dir(&dir, Some(412)).unwrap();
    let steps = answer.map(|text| {
        let ids = chat.encode(text).unwrap();
        let count = ids.len() as u32;
        ids.into_iter()
            .map(|id| pb::GenerateResponse {
                token_ids: vec![id],
                ..Default::default()
            })
            .chain(std::iter::once(pb::GenerateResponse {
                finish_reason: pb::FinishReason::Stop as i32,
                usage: Some(pb::Usage {
                    prompt_tokens: 1,
                    completion_tokens: count,
                }),
                ..Default::default()
            }))
            .collect()
    });
    let (state, seen) = super::canned_llm::gateway_of_canned_llm(chat, None, steps, 64).await;
    Harness { state, seen }
}

impl Harness {
    async fn post(&self, body: &Value) -> (StatusCode, String) {
        super::canned_llm::post_chat(&self.state, body).await
    }

    /// The unary answer's first choice.
    async fn unary(&self, body: &Value) -> Value {
        let (status, text) = self.post(body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["choices"][0].clone()
    }

    /// The streamed answer's deltas gathered as a unary `message` reads, and its finish;
    /// each call's delta in OpenAI's shape is checked on the way: `index`, `id`, `type` and
    /// `function.name` on its first delta only, `function.arguments` on every one.
    /// Also returns how many deltas carried each call.
    async fn streamed(&self, body: &Value) -> (Value, Value, Vec<usize>) {
        let mut body = body.clone();
        body["stream"] = true.into();
        let (status, text) = self.post(&body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut calls: Vec<Value> = Vec::new();
        let mut pieces: Vec<usize> = Vec::new();
        let mut finish = Value::Null;
        for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(line).unwrap();
            let choice = &chunk["choices"][0];
            let delta = &choice["delta"];
            content += delta["content"].as_str().unwrap_or_default();
            reasoning += delta["reasoning_content"].as_str().unwrap_or_default();
            for c in delta["tool_calls"].as_array().into_iter().flatten() {
                let i = c["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    assert_eq!(c["type"], "function", "{c}");
                    assert!(
                        c["id"].is_string() && c["function"]["name"].is_string(),
                        "{c}"
                    );
                    calls.push(json!({"index": i, "id": c["id"], "type": c["type"],
                        "function": {"name": c["function"]["name"], "arguments": ""}}));
                    pieces.push(0);
                } else {
                    // A later delta of a call under way: its index and more arguments alone.
                    assert_eq!(i + 1, calls.len(), "calls stream one after another: {c}");
                    assert_eq!(c.as_object().unwrap().len(), 2, "{c}");
                    assert_eq!(c["function"].as_object().unwrap().len(), 1, "{c}");
                }
                pieces[i] += 1;
                assert!(c["function"]["arguments"].is_string(), "{c}");
                let args = calls[i]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_string()
                    + c["function"]["arguments"].as_str().unwrap_or_default();
                calls[i]["function"]["arguments"] = args.into();
            }
            if !choice["finish_reason"].is_null() {
                finish = choice["finish_reason"].clone();
            }
        }
        let mut message = json!({"role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { content.into() }});
        if !reasoning.is_empty() {
            message["reasoning_content"] = reasoning.into();
        }
        if !calls.is_empty() {
            message["tool_calls"] = calls.into();
        }
        (message, finish, pieces)
    }
}

/// Ids differ between two answers; everything else must not.
fn without_ids(mut message: Value) -> Value {
    for c in message["tool_calls"].as_array_mut().into_iter().flatten() {
        assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
        c["id"] = Value::Null;
    }
    message
}

fn chat_with(fields: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "weather in Paris?"}]});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

const ANSWER: &str = "The user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call>";

#[tokio::test]
async fn reasoning_content_and_tool_calls_come_apart_unary_and_streamed_alike() {
    let h = harness(Ok(ANSWER)).await;
    let body = chat_with(json!({"tools": [weather_tool()]}));
    let choice = h.unary(&body).await;
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = without_ids(choice["message"].clone());
    assert_eq!(
        message,
        json!({"role": "assistant", "content": "Checking.\n",
        "reasoning_content": "The user wants weather.\n",
        "tool_calls": [
            {"index": 0, "id": null, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"index": 1, "id": null, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}},
        ]})
    );
    let (streamed, finish, pieces) = h.streamed(&body).await;
    assert_eq!(without_ids(streamed), message);
    assert_eq!(finish, "tool_calls");
    // One token a message: each call's arguments come in several fragments.
    assert_eq!(pieces.len(), 2);
    assert!(pieces.iter().all(|&n| n > 2), "{pieces:?}");

    // The tools reached the template, and the prompt ended by opening <think>.
    let prompt = h.seen.lock().unwrap()[0].prompt_token_ids.clone();
    let text = h.state.orchestrator.chat.decode(&prompt, false).unwrap();
    assert!(
        text.contains("# Tools") && text.contains("\"get_weather\""),
        "{text}"
    );
    assert!(text.ends_with("<|im_start|>assistant\n<think>\n"), "{text}");

    // tool_choice none: the blocks stay content, and the answer finishes with stop.
    let none = chat_with(json!({"tools": [weather_tool()], "tool_choice": "none"}));
    let choice = h.unary(&none).await;
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["message"]["tool_calls"].is_null());
    assert!(choice["message"]["content"]
        .as_str()
        .unwrap()
        .contains("<tool_call>"));
}

/// gRPC streams calls in the same pieces: a `ToolCall` per piece, `id` and `name` on a call's
/// first only, `arguments` to add; joined they are the unary `Chat`'s calls.
#[tokio::test]
async fn grpc_streams_each_call_as_its_name_then_fragments_of_its_arguments() {
    use futures::StreamExt;
    use vlm_proto::pb::gateway_server::Gateway;

    let h = harness(Ok(ANSWER)).await;
    let grpc = crate::grpc::GatewayService {
        orchestrator: h.state.orchestrator.clone(),
        default_max_tokens: 64,
        request_timeout: Duration::from_secs(10),
    };
    let request = || {
        tonic::Request::new(pb::ChatRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: vec![pb::ContentPart {
                    part: Some(pb::content_part::Part::Text("weather in Paris?".into())),
                }],
                ..Default::default()
            }],
            tools: vec![pb::Tool {
                name: "get_weather".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
    };
    let unary = grpc.chat(request()).await.unwrap().into_inner();
    assert_eq!(unary.finish_reason, pb::FinishReason::ToolCalls as i32);
    let args: Vec<&str> = unary
        .tool_calls
        .iter()
        .map(|c| c.arguments.as_str())
        .collect();
    assert_eq!(args, [r#"{"city": "Paris"}"#, r#"{"city": "Lyon"}"#]);

    let mut stream = grpc.chat_stream(request()).await.unwrap().into_inner();
    let mut calls: Vec<pb::ToolCall> = Vec::new();
    let mut pieces = vec![0; 2];
    let mut finish = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        finish = chunk.finish_reason.max(finish);
        for piece in chunk.tool_calls {
            let i = piece.index as usize;
            pieces[i] += 1;
            if i == calls.len() {
                assert!(
                    piece.id.starts_with("call_") && !piece.name.is_empty(),
                    "{piece:?}"
                );
                calls.push(piece);
            } else {
                assert!(piece.id.is_empty() && piece.name.is_empty(), "{piece:?}");
                calls[i].arguments += &piece.arguments;
            }
        }
    }
    assert_eq!(finish, pb::FinishReason::ToolCalls as i32);
    assert!(pieces.iter().all(|&n| n > 2), "{pieces:?}");
    let strip = |c: &pb::ToolCall| (c.index, c.name.clone(), c.arguments.clone());
    assert_eq!(
        calls.iter().map(strip).collect::<Vec<_>>(),
        unary.tool_calls.iter().map(strip).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn the_grammar_asked_for_reaches_llm_svc_after_the_reasoning() {
    use pb::constraint::Grammar;
    let h = harness(Ok("</think>{}")).await;
    let sent = |i: usize| h.seen.lock().unwrap()[i].constraint.clone();

    h.unary(&chat_with(
        json!({"response_format": {"type": "json_object"}}),
    ))
    .await;
    let c = sent(0).expect("a constraint");
    assert_eq!(
        c.grammar,
        Some(Grammar::JsonSchema(r#"{"type":"object"}"#.into()))
    );
    assert_eq!(c.after_token, Some(415), "after </think>");

    // Thinking off: the prompt opens no reasoning, and the grammar applies from the start.
    h.unary(&chat_with(json!({"guided_choice": ["a", "b"],
        "chat_template_kwargs": {"enable_thinking": false}})))
        .await;
    let c = sent(1).unwrap();
    assert_eq!(
        c.grammar,
        Some(Grammar::Lark("start: \"a\" | \"b\"\n".into()))
    );
    assert_eq!(c.after_token, None);

    // A forced call: the tags by their ids.
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    h.unary(&chat_with(
        json!({"tools": [weather_tool()], "tool_choice": named,
        "parallel_tool_calls": false}),
    ))
    .await;
    let Some(Grammar::Lark(lark)) = sent(2).unwrap().grammar else {
        panic!("a Lark grammar")
    };
    assert!(lark.starts_with("start: call\n"), "{lark}");
    assert!(
        lark.contains("tool_open: <[416]>\ntool_close: <[417]>\n"),
        "{lark}"
    );

    // No format: no constraint.
    h.unary(&chat_with(json!({"tools": [weather_tool()]})))
        .await;
    assert_eq!(sent(3), None);
}

#[tokio::test]
async fn refusals_reach_the_client_as_400s_with_the_reason() {
    let reason = "the JSON schema does not compile: unknown keyword";
    let h = harness(Err(tonic::Status::invalid_argument(reason))).await;
    let (status, body) = h
        .post(&chat_with(
            json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}),
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains(reason), "{body}");

    for (fields, says) in [
        (
            json!({"tools": [weather_tool()],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            "\\\"get_time\\\"",
        ),
        (
            json!({"tools": [weather_tool()], "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
            "both constrain",
        ),
        (
            json!({"chat_template_kwargs": {"messages": []}}),
            "`chat_template_kwargs.messages`",
        ),
        (
            json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
            "`guided_regex`",
        ),
    ] {
        let (status, body) = h.post(&chat_with(fields.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{fields}: {body}");
        assert!(body.contains(says), "{fields}: {body}");
    }
}

#[tokio::test]
async fn earlier_calls_and_tool_answers_are_rendered_as_the_template_has_them() {
    let h = harness(Ok("It is sunny.")).await;
    let body = json!({"tools": [weather_tool()],
        "chat_template_kwargs": {"enable_thinking": false}, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]});
    let choice = h.unary(&body).await;
    assert_eq!(choice["message"]["content"], "It is sunny.");
    assert_eq!(choice["finish_reason"], "stop");
    let prompt = h.seen.lock().unwrap()[0].prompt_token_ids.clone();
    let text = h.state.orchestrator.chat.decode(&prompt, false).unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\n"),
        "thinking off: {text}"
    );
    assert!(
        text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"),
        "{text}"
    );
}

/// The rule the in-process pipeline (`vlm run`'s library) shares with the gateway through
/// `constraint_for`: a format asked of a Thinking checkpoint applies after `</think>`, and
/// from the first token with thinking turned off.
#[test]
fn constraint_for_starts_the_format_after_the_reasoning_the_prompt_opens() {
    let chat = ChatTokenizer::from_dir(&thinking_fixture(), Some(412)).unwrap();
    let constraint = |fields: Value| {
        let body = chat_with(fields).to_string();
        let req = parse_chat_request(body.as_bytes(), 16, &RequestLimits::default()).unwrap();
        let prompt = chat
            .prompt_ids_with(&req.messages, &req.template_vars(), &[])
            .unwrap();
        crate::orchestrator::constraint_for(&chat, &req, &prompt)
            .unwrap()
            .expect("a constraint")
    };
    let format = json!({"response_format": {"type": "json_object"}});
    assert_eq!(constraint(format).after_token, Some(415));
    let off = json!({"response_format": {"type": "json_object"},
        "chat_template_kwargs": {"enable_thinking": false}});
    assert_eq!(constraint(off).after_token, None);
}
