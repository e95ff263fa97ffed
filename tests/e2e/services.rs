//! The product end to end: the three real binaries on loopback, driven as clients drive them
//! (gRPC and OpenAI-style HTTP), answers compared with `vlm run` (whose equality with HF
//! transformers `cli/tests/cli.rs` proves), the error contract, cancellation, deadlines,
//! graceful shutdown, and one trace per request across the three processes.

use std::time::Duration;

use base64::Engine as _;
use e2e::{fixture, metric, metrics_page, OtlpReceiver, Stack, StackOptions};
use futures::StreamExt;
use serde_json::{json, Value};
use tonic::Code;
use vlm_compute::golden::Golden;
use vlm_proto::pb::gateway_client::GatewayClient;
use vlm_proto::pb::{self, content_part::Part};

async fn client(stack: &Stack) -> GatewayClient<tonic::transport::Channel> {
    GatewayClient::connect(stack.grpc.clone())
        .await
        .expect("gateway gRPC reachable")
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join("images").join(name)).expect("fixture image")
}

/// The system message and earlier turns of a golden case, as (role, text).
fn earlier_turns(case: &Value) -> Vec<(String, String)> {
    let mut turns = Vec::new();
    if let Some(system) = case["system"].as_str() {
        turns.push(("system".to_string(), system.to_string()));
    }
    for t in case["history"].as_array().unwrap() {
        turns.push((
            t["role"].as_str().unwrap().into(),
            t["text"].as_str().unwrap().into(),
        ));
    }
    turns
}

/// A gRPC request for a golden case: earlier turns, then its images and prompt.
fn grpc_request(case: &Value) -> pb::ChatRequest {
    let mut content: Vec<pb::ContentPart> = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| pb::ContentPart {
            part: Some(Part::Image(image(n.as_str().unwrap()))),
        })
        .collect();
    content.push(pb::ContentPart {
        part: Some(Part::Text(case["prompt"].as_str().unwrap().into())),
    });
    let mut messages: Vec<pb::ChatMessage> = earlier_turns(case)
        .into_iter()
        .map(|(role, text)| pb::ChatMessage {
            role,
            content: vec![pb::ContentPart {
                part: Some(Part::Text(text)),
            }],
            ..Default::default()
        })
        .collect();
    messages.push(pb::ChatMessage {
        role: "user".into(),
        content,
        ..Default::default()
    });
    pb::ChatRequest {
        messages,
        temperature: Some(0.0),
        max_tokens: Some(case["max_new_tokens"].as_u64().unwrap() as u32),
        ..Default::default()
    }
}

fn openai_body(case: &Value, stream: bool) -> Value {
    let mut content: Vec<Value> = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(image(n.as_str().unwrap()));
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
        })
        .collect();
    content.push(json!({"type": "text", "text": case["prompt"]}));
    let mut messages: Vec<Value> = earlier_turns(case)
        .into_iter()
        .map(|(role, text)| json!({"role": role, "content": text}))
        .collect();
    messages.push(json!({"role": "user", "content": content}));
    json!({
        "model": "tiny-qwen3-vl",
        "messages": messages,
        "max_tokens": case["max_new_tokens"],
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

fn cases() -> Vec<Value> {
    let g = Golden::open(&fixture()).unwrap();
    g.manifest()["cases"].as_array().unwrap().clone()
}

/// A request that generates for a long time (eos ignored), for cancellation and limits.
fn long_request(max_tokens: u32) -> pb::ChatRequest {
    let mut r = grpc_request(&cases()[0]);
    r.max_tokens = Some(max_tokens);
    r.ignore_eos = true;
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_unary_and_stream_equal_vlm_run() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut c = client(&stack).await;
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let unary = c.chat(grpc_request(&case)).await.unwrap().into_inner();
        let want_ids: Vec<u32> = case["generated_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(unary.token_ids, want_ids, "{name}: tokens");
        assert_eq!(unary.text, case["text"].as_str().unwrap(), "{name}: text");
        let usage = unary.usage.unwrap();
        assert_eq!(
            usage.prompt_tokens as usize,
            case["prompt_token_ids"].as_array().unwrap().len()
        );
        assert_eq!(usage.completion_tokens as usize, want_ids.len());

        let mut stream = c
            .chat_stream(grpc_request(&case))
            .await
            .unwrap()
            .into_inner();
        let (mut text, mut ids, mut finish) = (String::new(), Vec::new(), 0);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            text.push_str(&chunk.text);
            ids.extend(chunk.token_ids);
            finish = chunk.finish_reason;
        }
        assert_eq!(
            (text, ids),
            (unary.text.clone(), unary.token_ids.clone()),
            "{name}: stream vs unary"
        );
        assert_eq!(finish, unary.finish_reason);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_http_unary_and_sse_equal_vlm_run() {
    let stack = Stack::start(StackOptions::default()).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.http);
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let r: Value = http
            .post(&url)
            .json(&openai_body(&case, false))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["object"], "chat.completion");
        assert_eq!(
            r["choices"][0]["message"]["content"], case["text"],
            "{name}"
        );
        assert_eq!(r["choices"][0]["message"]["role"], "assistant");
        assert_eq!(
            r["usage"]["completion_tokens"], case["max_new_tokens"],
            "{name}"
        );

        let body = http
            .post(&url)
            .json(&openai_body(&case, true))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let events: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        assert_eq!(
            events.last(),
            Some(&"[DONE]"),
            "{name}: SSE ends with [DONE]"
        );
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"));
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name}: streamed text"
        );
        let finish = chunks
            .iter()
            .rev()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, r["choices"][0]["finish_reason"].as_str());
        assert!(
            chunks.last().unwrap()["usage"]["total_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    let models: Value = http
        .get(format!("{}/v1/models", stack.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-qwen3-vl");
    let metrics = http
        .get(format!("{}/metrics", stack.http))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for m in [
        "vlm_requests_total{api=\"http\",outcome=\"ok\"}",
        "vlm_time_to_first_token_seconds_count",
        "vlm_inter_token_latency_seconds_count",
        "vlm_vision_seconds_count",
        "vlm_requests_in_flight 0",
        "vlm_generated_tokens_total",
    ] {
        assert!(metrics.contains(m), "metric {m} missing:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_python_client_works_unchanged() {
    let has_openai = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        vlm_compute::skip::note(
            &"the `openai` Python package is not installed (pip install openai); the Rust HTTP tests cover the same API",
        );
        return;
    }
    let stack = Stack::start(StackOptions::default()).await;
    let case = &cases()[0];
    let script = r#"
import base64, sys, openai
base, path, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
c = openai.OpenAI(base_url=base + "/v1", api_key="unused")
url = "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()
msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]}]
r = c.chat.completions.create(model="tiny-qwen3-vl", messages=msgs, max_tokens=n, temperature=0)
s = "".join((ch.choices[0].delta.content or "") for ch in c.chat.completions.create(model="tiny-qwen3-vl", messages=msgs, max_tokens=n, temperature=0, stream=True) if ch.choices)
assert r.choices[0].message.content == s, (r, s)
sys.stdout.write(r.choices[0].message.content)
"#;
    let img = fixture()
        .join("images")
        .join(case["images"][0].as_str().unwrap());
    let out = tokio::process::Command::new("python3")
        .args([
            "-c",
            script,
            &stack.http,
            img.to_str().unwrap(),
            case["prompt"].as_str().unwrap(),
        ])
        .arg(case["max_new_tokens"].to_string())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        case["text"].as_str().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_invalid_argument_and_400_naming_the_problem() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut c = client(&stack).await;
    let user = |content: Vec<Part>| pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: content
                .into_iter()
                .map(|p| pb::ContentPart { part: Some(p) })
                .collect(),
            ..Default::default()
        }],
        max_tokens: Some(4),
        ..Default::default()
    };
    let truncated = image("cat.png")[..200].to_vec();
    let long_prompt = "apples and oranges ".repeat(800);
    let cases: Vec<(pb::ChatRequest, &str)> = vec![
        (pb::ChatRequest::default(), "messages"),
        (
            user(vec![Part::Image(truncated), Part::Text("hi".into())]),
            "image 0",
        ),
        (
            user(vec![Part::Image(b"GIF89a nonsense".to_vec())]),
            "image 0",
        ),
        (
            (0..9).fold(user(vec![]), |mut r, _| {
                r.messages[0].content.push(pb::ContentPart {
                    part: Some(Part::Image(image("cat.png"))),
                });
                r
            }),
            "at most 8 images",
        ),
        (
            user(vec![Part::Text(long_prompt.clone())]),
            "context holds at most",
        ),
        (
            pb::ChatRequest {
                temperature: Some(-1.0),
                ..user(vec![Part::Text("hi".into())])
            },
            "temperature",
        ),
        (
            pb::ChatRequest {
                top_p: Some(1.5),
                ..user(vec![Part::Text("hi".into())])
            },
            "top_p",
        ),
        (
            pb::ChatRequest {
                max_tokens: Some(0),
                ..user(vec![Part::Text("hi".into())])
            },
            "max_tokens",
        ),
    ];
    for (req, needle) in cases {
        let err = c.chat(req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{needle}: {err:?}");
        assert!(
            err.message().contains(needle),
            "expected {needle:?} in {:?}",
            err.message()
        );
    }

    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.http);
    for (body, needle) in [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": long_prompt}]}),
            "context",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
            "image 0",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 500}),
            "temperature",
        ),
    ] {
        let r = http.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "{needle}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{needle}: {v}"
        );
    }
    let r = http.post(&url).body("{ not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    // Nothing above took a process down.
    stack.wait_healthy(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn over_the_concurrency_limit_fails_fast_with_resource_exhausted_and_429() {
    let stack = Stack::start(StackOptions {
        gateway_args: vec!["--max-concurrent".into(), "1".into()],
        ..Default::default()
    })
    .await;
    let mut c = client(&stack).await;
    let mut long = c
        .chat_stream(long_request(1900))
        .await
        .unwrap()
        .into_inner();
    long.next().await.expect("first chunk").unwrap();
    let err = c.chat(grpc_request(&cases()[2])).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.http))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    drop(long);
    // The permit is released with the stream: the next request gets through.
    let mut ok = false;
    for _ in 0..50 {
        if c.chat(grpc_request(&cases()[2])).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok, "the gateway did not recover its permit");
}

/// Polls `service`'s grpc.health.v1 status at `addr` until it is `want` (or 10 s pass).
async fn grpc_health_becomes(addr: &str, service: &str, want: i32) -> bool {
    let ch = tonic::transport::Endpoint::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(ch);
    for _ in 0..100 {
        let status = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .map(|r| r.into_inner().status);
        if status.ok() == Some(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_upstream_is_unavailable_503_and_the_gateway_recovers() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut stack = Stack::start(StackOptions {
        without_llm: true,
        ..Default::default()
    })
    .await;
    let mut c = client(&stack).await;
    let err = c.chat(grpc_request(&cases()[2])).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("llm-svc"), "{}", err.message());
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.http))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let h = reqwest::get(format!("{}/health", stack.http))
        .await
        .unwrap();
    assert_eq!(h.status(), 503, "health reports the missing upstream");
    // Over gRPC too: the gateway's own service is not ready, the process is alive.
    let not_serving = ServingStatus::NotServing as i32;
    assert!(grpc_health_becomes(&stack.grpc, "vlm.v1.Gateway", not_serving).await);
    assert!(grpc_health_becomes(&stack.grpc, "", ServingStatus::Serving as i32).await);

    stack.start_llm();
    stack.wait_healthy(Duration::from_secs(30)).await;
    assert!(
        grpc_health_becomes(&stack.grpc, "vlm.v1.Gateway", ServingStatus::Serving as i32).await,
        "gRPC readiness follows the upstream back"
    );
    let mut ok = None;
    for _ in 0..50 {
        match c.chat(grpc_request(&cases()[2])).await {
            Ok(r) => {
                ok = Some(r.into_inner());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let r = ok.expect("the gateway recovers once llm-svc is back");
    assert_eq!(r.text, cases()[2]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_leaving_mid_stream_stops_decoding_upstream() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut c = client(&stack).await;
    let mut s = c
        .chat_stream(long_request(1900))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        s.next().await.expect("chunk").unwrap();
    }
    drop(s);
    let llm = stack.llm.as_ref().unwrap();
    assert!(
        llm.wait_for_log(
            "client went away; generation cancelled",
            Duration::from_secs(20)
        )
        .await,
        "llm-svc kept decoding:\n{}",
        llm.log()
    );
    let line = llm
        .log()
        .lines()
        .find(|l| l.contains("generation cancelled"))
        .unwrap()
        .to_string();
    let generated: usize = line
        .split("generated=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .expect("generated=N in the log line");
    assert!(
        generated < 1900,
        "cancelled after {generated} of 1900 tokens"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn deadlines_are_honoured_end_to_end() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut c = client(&stack).await;
    let mut req = tonic::Request::new(long_request(1900));
    req.set_timeout(Duration::from_millis(400));
    let started = std::time::Instant::now();
    let result = c.chat(req).await.err();
    let err = result.expect("a 1900-token generation does not fit in 400 ms");
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_request_is_one_trace_across_the_three_services() {
    let (recv, endpoint) = OtlpReceiver::start().await;
    let stack = Stack::start(StackOptions {
        otlp: Some(endpoint),
        ..Default::default()
    })
    .await;
    let mut c = client(&stack).await;
    c.chat(grpc_request(&cases()[1])).await.unwrap();

    let wanted = [
        "gateway.chat",
        "vision.rpc",
        "llm.rpc",
        "vision.encode",
        "preprocess",
        "vision_encode",
        "pack",
        "llm.generate",
        "unpack",
        "prefill",
        "decode",
    ];
    let mut spans = Vec::new();
    for _ in 0..100 {
        spans = recv.spans.lock().unwrap().clone();
        if wanted.iter().all(|w| spans.iter().any(|s| &s.name == w))
            && spans.iter().filter(|s| s.name == "vision.encode").count() >= 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let by_name =
        |n: &str| -> Vec<&e2e::ReceivedSpan> { spans.iter().filter(|s| s.name == n).collect() };
    for w in wanted {
        assert!(
            !by_name(w).is_empty(),
            "no span {w}; got {:?}",
            spans
                .iter()
                .map(|s| (&s.service, &s.name))
                .collect::<Vec<_>>()
        );
    }
    let root = by_name("gateway.chat")[0];
    assert!(root.parent_span_id.is_empty(), "gateway.chat is the root");
    let trace: Vec<_> = spans
        .iter()
        .filter(|s| s.trace_id == root.trace_id)
        .collect();
    let services: std::collections::BTreeSet<_> =
        trace.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        ["gateway", "llm-svc", "vision-svc"].into_iter().collect()
    );

    let parent_of = |child: &e2e::ReceivedSpan| {
        spans
            .iter()
            .find(|s| s.span_id == child.parent_span_id)
            .map(|s| s.name.as_str())
    };
    // Two images: two vision calls from the gateway, each continued in vision-svc.
    assert_eq!(by_name("vision.rpc").len(), 2);
    for s in by_name("vision.rpc").into_iter().chain(by_name("llm.rpc")) {
        assert_eq!(parent_of(s), Some("gateway.chat"));
    }
    for s in by_name("vision.encode") {
        assert_eq!(
            (s.service.as_str(), parent_of(s)),
            ("vision-svc", Some("vision.rpc"))
        );
        // Two different images, new to vision-svc's embedding cache.
        assert_eq!(s.string("cache"), Some("miss"), "{s:?}");
    }
    for n in ["preprocess", "vision_encode", "pack"] {
        assert_eq!(parent_of(by_name(n)[0]), Some("vision.encode"));
    }
    assert_eq!(parent_of(by_name("unpack")[0]), Some("llm.generate"));
    let gen = by_name("llm.generate")[0];
    assert_eq!(
        (gen.service.as_str(), parent_of(gen)),
        ("llm-svc", Some("llm.rpc"))
    );
    for n in ["prefill", "decode"] {
        assert_eq!(
            by_name(n).len(),
            1,
            "one {n} span per request, not one per token"
        );
        assert_eq!(parent_of(by_name(n)[0]), Some("llm.generate"));
    }
    // Logs carry the same trace id.
    let id: String = root.trace_id.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        stack.gateway.log().contains(&id),
        "gateway log lacks trace id {id}"
    );
    assert!(
        stack.llm.as_ref().unwrap().log().contains(&id),
        "llm-svc log lacks trace id {id}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_and_exits_zero() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let mut c = client(&stack).await;
    // A request in flight when the gateway is told to stop still completes.
    let mut s = c.chat_stream(long_request(300)).await.unwrap().into_inner();
    s.next().await.expect("first chunk").unwrap();
    let gateway_exit = tokio::spawn(async move {
        let status = stack.gateway.terminate().await;
        (status, stack)
    });
    let mut last = 0;
    while let Some(chunk) = s.next().await {
        last = chunk.expect("in-flight stream completes").finish_reason;
    }
    assert_eq!(last, pb::FinishReason::Length as i32);
    let (status, mut stack) = gateway_exit.await.unwrap();
    assert!(status.success(), "gateway exit: {status:?}");
    assert!(stack.vision.terminate().await.success());
    assert!(stack.llm.as_mut().unwrap().terminate().await.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_client_leaving_mid_stream_stops_decoding_upstream() {
    let stack = Stack::start(StackOptions::default()).await;
    let body = json!({
        "messages": [{"role": "user", "content": "Count the apples; then explain your answer."}],
        "max_tokens": 1900, "ignore_eos": true, "stream": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut bytes = resp.bytes_stream();
    for _ in 0..3 {
        bytes.next().await.expect("SSE data").unwrap();
    }
    drop(bytes);
    let llm = stack.llm.as_ref().unwrap();
    assert!(
        llm.wait_for_log(
            "client went away; generation cancelled",
            Duration::from_secs(20)
        )
        .await,
        "llm-svc kept decoding after the HTTP client left:\n{}",
        llm.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_rotate_and_a_dead_one_is_skipped() {
    // Two llm-svc addresses, the second one dead: every request still succeeds.
    let dead = e2e::free_port();
    let stack = Stack::start(StackOptions {
        gateway_args: vec!["--llm-addr".into(), format!("127.0.0.1:{dead}")],
        ..Default::default()
    })
    .await;
    let mut c = client(&stack).await;
    for _ in 0..4 {
        let r = c
            .chat(grpc_request(&cases()[2]))
            .await
            .expect("served by the live replica");
        assert_eq!(r.into_inner().text, cases()[2]["text"].as_str().unwrap());
    }
    // It never answered, so the gateway says it waits for it (at info) rather than warning
    // of a lost replica; either way it is out of rotation.
    let log = stack.gateway.log();
    assert!(
        log.lines()
            .any(|l| l.contains("not serving yet") && l.contains(&format!("127.0.0.1:{dead}"))),
        "the dead replica was ejected (by its health check or by the call that found it gone):\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_service_serves_health_and_reflection() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let stack = Stack::start(StackOptions::default()).await;
    let vision = stack.vision_addr();
    let llm = format!("http://127.0.0.1:{}", stack.llm_port);
    for (addr, service) in [
        (stack.grpc.clone(), "vlm.v1.Gateway"),
        (vision, "vlm.v1.VisionService"),
        (llm, "vlm.v1.LlmService"),
    ] {
        let ch = tonic::transport::Endpoint::from_shared(addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        // The gateway's readiness follows its upstreams, re-checked every 2 s: it may lag
        // the /health answer the stack waited for by one check.
        assert!(
            grpc_health_becomes(
                &addr,
                service,
                tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            )
            .await,
            "{service} never said SERVING"
        );
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new(ch)
            .server_reflection_info(tokio_stream::once(req))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            resp.next().await.unwrap().unwrap().message_response
        else {
            panic!("{addr}: no service list");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(
            names.contains(&service.to_string())
                && names.contains(&"grpc.health.v1.Health".to_string()),
            "{addr}: {names:?}"
        );
    }
}

/// f16 embeddings on the hop, and vision-svc's embedding cache: the same request again gets
/// its image from the cache (no ViT pass) and the same tokens.
#[tokio::test(flavor = "multi_thread")]
async fn half_precision_embeddings_on_the_wire_and_a_cached_image_still_answer() {
    let stack = Stack::start(StackOptions {
        gateway_args: vec!["--embedding-dtype".into(), "f16".into()],
        service_metrics: true,
        ..Default::default()
    })
    .await;
    let mut c = client(&stack).await;
    let case = cases()
        .into_iter()
        .find(|c| !c["images"].as_array().unwrap().is_empty())
        .expect("a golden case with an image");
    let images = case["images"].as_array().unwrap().len() as f64;
    let first = c.chat(grpc_request(&case)).await.unwrap().into_inner();
    // f16 rounds the embeddings (relative error ~5e-4), so only the shape of the answer is fixed.
    assert_eq!(
        first.usage.unwrap().completion_tokens as u64,
        case["max_new_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        first.token_ids.len(),
        first.usage.unwrap().completion_tokens as usize
    );
    let url = stack.vision_metrics.clone().expect("vision-svc metrics");
    let page = metrics_page(&url).await;
    assert_eq!(
        metric(&page, "vlm_vision_embedding_cache_hits_total"),
        0.0,
        "{page}"
    );
    assert_eq!(
        metric(&page, "vlm_vision_embedding_cache_misses_total"),
        images
    );
    assert!(metric(&page, "vlm_vision_embedding_cache_bytes") > 0.0);

    let again = c.chat(grpc_request(&case)).await.unwrap().into_inner();
    assert_eq!(
        again.token_ids, first.token_ids,
        "the cached image answers the same"
    );
    let page = metrics_page(&url).await;
    assert_eq!(
        metric(&page, "vlm_vision_embedding_cache_hits_total"),
        images,
        "{page}"
    );
    assert_eq!(
        metric(&page, "vlm_vision_images_total{outcome=\"cached\"}"),
        images
    );
    assert_eq!(
        metric(&page, "vlm_vision_images_total{outcome=\"ok\"}"),
        images
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn llm_svc_serves_its_own_metrics_and_frees_the_cache_of_a_cancelled_stream() {
    let port = e2e::free_port();
    let stack = Stack::start(StackOptions {
        llm_args: vec!["--metrics-listen".into(), format!("127.0.0.1:{port}")],
        ..Default::default()
    })
    .await;
    let url = format!("http://127.0.0.1:{port}/metrics");
    let page = || metrics_page(&url);
    let mut c = client(&stack).await;
    c.chat(grpc_request(&cases()[0])).await.unwrap();
    let mut s = c
        .chat_stream(long_request(1900))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        s.next().await.expect("chunk").unwrap();
    }
    let during = page().await;
    assert!(
        metric(&during, "vlm_llm_kv_blocks_in_use") > 0.0,
        "{during}"
    );
    assert_eq!(metric(&during, "vlm_llm_sequences{state=\"running\"}"), 1.0);
    assert!(metric(&during, "vlm_llm_kv_blocks_total") > 0.0);
    drop(s);
    // The engine frees the blocks at its next step once the client has gone.
    let mut after = String::new();
    for _ in 0..100 {
        after = page().await;
        if metric(&after, "vlm_llm_kv_blocks_in_use") == 0.0
            && metric(&after, "vlm_llm_requests_total{outcome=\"cancelled\"}") == 1.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&after, "vlm_llm_kv_blocks_in_use"), 0.0, "{after}");
    assert_eq!(metric(&after, "vlm_llm_sequences{state=\"running\"}"), 0.0);
    assert_eq!(
        metric(&after, "vlm_llm_requests_total{outcome=\"cancelled\"}"),
        1.0
    );
    assert!(metric(&after, "vlm_llm_requests_total{outcome=\"length\"}") >= 1.0);
    assert!(metric(&after, "vlm_llm_prefix_cache_queried_tokens_total") > 0.0);
}
