//! Structured outputs and forced tool calls through the whole stack (`vlm serve`'s three
//! services in process, on the CPU) over the OpenAI HTTP API, on the bundled tiny model whose
//! random weights write garbage unless a grammar holds them: every `json_schema` answer that
//! ends with `stop` validates against its schema; one cut by `max_tokens` ends with `length`;
//! `tool_choice: required` gives calls whose arguments validate against their tool's
//! parameters; a stream's deltas add up to the unary answer; a schema llm-svc cannot compile
//! and a tool choice naming no offered tool are 400s that say why.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use vlm_cli::stack::{LocalStack, StackConfig};
use vlm_compute::CpuBackend;

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

async fn ready_on_cpu() -> LocalStack {
    let mut stack = LocalStack::start(StackConfig::loopback(fixture()), || Ok(CpuBackend::new()))
        .await
        .unwrap();
    stack.ready(Duration::from_secs(60)).await.unwrap();
    stack
}

/// The status and JSON body (or, streamed, the SSE text as a JSON string) of a chat.
async fn post(http: SocketAddr, body: &Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

/// A greedy chat of one user message with `fields` added.
fn chat(fields: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Answer in JSON."}],
        "temperature": 0, "max_tokens": 96});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The unary answer's first choice, checked to be a 200.
async fn unary(http: SocketAddr, body: &Value) -> Value {
    let (status, v) = post(http, body).await;
    assert_eq!(status, 200, "{v}");
    v["choices"][0].clone()
}

/// The streamed answer's content, tool calls (their arguments joined) and finish reason.
/// Each call's deltas are checked to be OpenAI's shape: `id`, `type` and `function.name` on
/// its first only, then its `index` and more `function.arguments`; `"pieces"` counts them.
async fn streamed(http: SocketAddr, body: &Value) -> (String, Vec<Value>, String) {
    let mut body = body.clone();
    body["stream"] = true.into();
    let (status, sse) = post(http, &body).await;
    assert_eq!(status, 200, "{sse}");
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<Value>::new(), String::new());
    for data in sse
        .as_str()
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
    {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        content += choice["delta"]["content"].as_str().unwrap_or_default();
        for c in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = c["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
                assert_eq!(c["type"], "function", "{c}");
                assert!(c["function"]["name"].is_string(), "{c}");
                calls.push(json!({"name": c["function"]["name"], "arguments": "", "pieces": 0}));
            } else {
                assert_eq!(i + 1, calls.len(), "{c}");
                assert_eq!(
                    c,
                    &json!({"index": i, "function": {"arguments": c["function"]["arguments"]}}),
                );
            }
            calls[i]["pieces"] = (calls[i]["pieces"].as_u64().unwrap() + 1).into();
            let joined = calls[i]["arguments"].as_str().unwrap().to_string()
                + c["function"]["arguments"].as_str().unwrap_or_default();
            calls[i]["arguments"] = joined.into();
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.into();
        }
    }
    (content, calls, finish)
}

/// The schemas of `tests/fixtures/json_schemas.json` (what they cover is said there), which
/// llm-svc's engine test answers to as well.
fn schemas() -> Vec<Value> {
    let path = fixture().join("../json_schemas.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["schemas"].as_array().unwrap().clone()
}

fn validates(schema: &Value, value: &Value) -> bool {
    jsonschema::validator_for(schema).unwrap().is_valid(value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_answers_validate_and_streams_match_unary() {
    let stack = ready_on_cpu().await;
    let http = stack.http_addr;
    let mut stopped = 0;
    for schema in schemas() {
        let body = chat(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": true}}}));
        let choice = unary(http, &body).await;
        let content = choice["message"]["content"].as_str().unwrap().to_string();
        match choice["finish_reason"].as_str().unwrap() {
            "stop" => {
                stopped += 1;
                let value: Value = serde_json::from_str(&content)
                    .unwrap_or_else(|e| panic!("{content:?} for {schema}: {e}"));
                assert!(validates(&schema, &value), "{content} against {schema}");
            }
            other => assert_eq!(other, "length", "{content}"),
        }
        let (streamed, _, finish) = streamed(http, &body).await;
        assert_eq!(streamed, content, "{schema}");
        assert_eq!(finish, choice["finish_reason"].as_str().unwrap());
    }
    assert!(
        stopped >= schemas().len() / 2,
        "only {stopped} answers finished"
    );

    // json_object: any object.
    let choice = unary(
        http,
        &chat(json!({"response_format": {"type": "json_object"}})),
    )
    .await;
    if choice["finish_reason"] == "stop" {
        let value: Value =
            serde_json::from_str(choice["message"]["content"].as_str().unwrap()).unwrap();
        assert!(value.is_object(), "{value}");
    }

    // A string of at least 50 characters cannot end in 5 tokens.
    let cut = chat(
        json!({"max_tokens": 5, "response_format": {"type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 50}}}}),
    );
    let choice = unary(http, &cut).await;
    assert_eq!(choice["finish_reason"], "length", "{choice}");

    // A choice is one of its strings.
    let choice = unary(
        http,
        &chat(json!({"structured_outputs": {"choice": ["left", "right"]}})),
    )
    .await;
    assert_eq!(choice["finish_reason"], "stop", "{choice}");
    assert!(["left", "right"].contains(&choice["message"]["content"].as_str().unwrap()));
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_tool_calls_are_valid_calls_and_bad_requests_say_why() {
    let stack = ready_on_cpu().await;
    let http = stack.http_addr;
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "weather now",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "move_arm",
            "parameters": {"type": "object", "properties": {
                "x": {"type": "integer", "minimum": -10, "maximum": 10}},
              "required": ["x"], "additionalProperties": false}}},
        // Its own $defs, which its $ref must still find inside the call's grammar.
        {"type": "function", "function": {"name": "set_pose",
            "parameters": {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}},
              "required": ["at"], "additionalProperties": false,
              "$defs": {"point": {"type": "object", "properties": {
                  "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["y"], "additionalProperties": false}}}}},
    ]);
    let parameters = |name: &str| {
        tools
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["function"]["name"] == name)
            .map(|t| t["function"]["parameters"].clone())
            .unwrap_or_else(|| panic!("no tool {name}"))
    };
    let named = json!({"type": "function", "function": {"name": "move_arm"}});
    let with_defs = json!({"type": "function", "function": {"name": "set_pose"}});
    let mut finished = 0;
    for (choice, parallel) in [
        (json!("required"), true),
        (named, false),
        (with_defs.clone(), false),
    ] {
        let body = chat(json!({"tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel, "max_tokens": 160}));
        let answer = unary(http, &body).await;
        let finish = answer["finish_reason"].as_str().unwrap();
        // One call of a named tool always fits the budget; a random model allowed parallel
        // calls may go on calling until its budget ends (the calls may then be incomplete).
        if finish == "length" && parallel {
            continue;
        }
        assert_eq!(finish, "tool_calls", "{answer}");
        finished += 1;
        let calls = answer["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty());
        if !parallel {
            assert_eq!(calls.len(), 1, "{answer}");
            assert_eq!(calls[0]["function"]["name"], choice["function"]["name"]);
        }
        for (i, call) in calls.iter().enumerate() {
            assert_eq!(call["index"], i);
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().unwrap().starts_with("call_"));
            let name = call["function"]["name"].as_str().unwrap();
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(validates(&parameters(name), &args), "{call}");
        }
        // Streamed: the same calls, the same finish.
        let (content, mut streamed_calls, streamed_finish) = streamed(http, &body).await;
        assert_eq!(streamed_finish, "tool_calls");
        // Each call's arguments, several tokens long, came in several fragments.
        for c in &mut streamed_calls {
            let pieces = c.as_object_mut().unwrap().remove("pieces").unwrap();
            assert!(pieces.as_u64().unwrap() > 2, "{c}: {pieces} deltas");
        }
        assert_eq!(content, answer["message"]["content"].as_str().unwrap_or(""));
        let unary_calls: Vec<Value> = calls
            .iter()
            .map(
                |c| json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}),
            )
            .collect();
        assert_eq!(streamed_calls, unary_calls);
    }
    assert!(
        finished >= 2,
        "the named calls did not finish within their budget"
    );

    // A schema llguidance cannot compile: 400 with llm-svc's reason.
    let (status, v) = post(
        http,
        &chat(json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": 7}}}})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("constraint"), "{message}");

    // A tool choice naming no offered tool: 400 naming it.
    let (status, v) = post(
        http,
        &chat(json!({"tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "fly"}}})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("\"fly\""),
        "{v}"
    );
    stack.stop().await.unwrap();
}

/// The same over gRPC: `output_format` holds the answer to its schema, and a forced tool call
/// comes back as `tool_calls` with FINISH_REASON_TOOL_CALLS and arguments that validate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_carries_output_formats_and_tool_calls() {
    use vlm_proto::pb;
    let stack = ready_on_cpu().await;
    let mut client =
        pb::gateway_client::GatewayClient::connect(format!("http://{}", stack.grpc_addr))
            .await
            .unwrap();
    let user = pb::ChatMessage {
        role: "user".into(),
        content: vec![pb::ContentPart {
            part: Some(pb::content_part::Part::Text("Answer in JSON.".into())),
        }],
        ..Default::default()
    };
    let schema = json!({"type": "object", "properties": {
        "action": {"enum": ["grasp", "move", "stop"]},
        "speed": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["action", "speed"], "additionalProperties": false});
    let answer = client
        .chat(pb::ChatRequest {
            messages: vec![user.clone()],
            max_tokens: Some(64),
            output_format: Some(pb::OutputFormat {
                format: Some(pb::output_format::Format::JsonSchema(schema.to_string())),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.finish_reason,
        pb::FinishReason::Stop as i32,
        "{answer:?}"
    );
    let value: Value = serde_json::from_str(&answer.text).unwrap();
    assert!(validates(&schema, &value), "{}", answer.text);

    let parameters = json!({"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x"], "additionalProperties": false});
    let request = pb::ChatRequest {
        messages: vec![user],
        max_tokens: Some(64),
        temperature: Some(0.0),
        tools: vec![pb::Tool {
            name: "move_arm".into(),
            description: "move the arm".into(),
            parameters_json: parameters.to_string(),
        }],
        tool_choice: Some(pb::ToolChoice {
            choice: Some(pb::tool_choice::Choice::Mode("required".into())),
        }),
        parallel_tool_calls: Some(false),
        ..Default::default()
    };
    let answer = client.chat(request.clone()).await.unwrap().into_inner();
    assert_eq!(
        answer.finish_reason,
        pb::FinishReason::ToolCalls as i32,
        "{answer:?}"
    );
    let [call] = answer.tool_calls.as_slice() else {
        panic!("one call: {answer:?}");
    };
    assert_eq!(call.name, "move_arm");
    let args: Value = serde_json::from_str(&call.arguments).unwrap();
    assert!(validates(&parameters, &args), "{}", call.arguments);

    // Streamed: the call's first piece has its id and name, the later ones more arguments
    // alone; joined, the unary call.
    let mut stream = client.chat_stream(request).await.unwrap().into_inner();
    let (mut pieces, mut finish) = (Vec::new(), 0);
    while let Some(chunk) = stream.message().await.unwrap() {
        pieces.extend(chunk.tool_calls);
        finish = finish.max(chunk.finish_reason);
    }
    assert_eq!(finish, pb::FinishReason::ToolCalls as i32);
    let (first, rest) = pieces.split_first().expect("a call streamed");
    assert!(
        first.id.starts_with("call_") && first.name == "move_arm",
        "{first:?}"
    );
    assert!(!rest.is_empty(), "the arguments in fragments: {pieces:?}");
    assert!(
        rest.iter()
            .all(|p| p.index == 0 && p.id.is_empty() && p.name.is_empty()),
        "{pieces:?}"
    );
    let joined: String = pieces.iter().map(|p| p.arguments.as_str()).collect();
    assert_eq!(joined, call.arguments);
}

/// The offline pipeline (`vlm run`'s) renders a request's tools as the gateway does, and
/// refuses, naming `tools`, a request whose calls it would have to read or force, rather than
/// leave them in the text.
#[test]
fn the_offline_pipeline_renders_tools_and_refuses_to_read_calls() {
    use gateway::chat::{Message, Part};
    use gateway::tools::read_tools;
    use vlm_cli::pipeline::Pipeline;

    let engine = llm_svc::EngineConfig {
        kv_cache: llm_svc::KvCacheSize::Tokens(1024),
        ..llm_svc::EngineConfig::default()
    };
    let pipeline = Pipeline::load(&fixture(), CpuBackend::new(), engine).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let request = |choice: &str| gateway::request::ChatRequest {
        messages: vec![Message::user(vec![Part::Text("weather?".into())])],
        sampling: llm_svc::SamplingParams::greedy(),
        max_new_tokens: 2,
        tools: read_tools(Some(&tools), Some(&json!(choice)), None).unwrap(),
        ..Default::default()
    };
    let keep_going = |_: &llm_svc::TokenEvent, _: &str| std::ops::ControlFlow::Continue(());
    for choice in ["auto", "required"] {
        let err = pipeline.run(&request(choice), keep_going).unwrap_err();
        assert!(err.is_invalid_input(), "{err}");
        assert!(err.to_string().contains("`tools`"), "{err}");
    }
    let out = pipeline.run(&request("none"), keep_going).unwrap();
    let prompt = pipeline.chat.decode(&out.prompt_token_ids, false).unwrap();
    assert!(
        prompt.contains("# Tools") && prompt.contains("\"get_weather\""),
        "{prompt}"
    );
}
