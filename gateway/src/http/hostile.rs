//! Hostile input at the gateway's doors, against the real router (tower's `oneshot`, no
//! sockets) and the real gRPC service: oversized and endless bodies, deep nesting, bytes that
//! are not UTF-8, base64 over the limit, thousands of images or messages, and bad requests
//! sent while every place is taken. Each gets its status and a message naming the limit,
//! before any costly work. The upstreams are addresses nobody listens on, so a request that
//! got past the checks would show as 503. About a second in all.

use std::path::PathBuf;

use axum::body::Body;
use tonic::Code;
use tower::ServiceExt;
use vlm_proto::pb::gateway_server::Gateway;

use super::*;
use crate::chat::ChatTokenizer;
use crate::grpc::GatewayService;
use crate::metrics::Metrics;
use crate::serve::UpstreamHealth;
use crate::upstream::Upstreams;

const NOWHERE: &str = "127.0.0.1:1";

fn fixture() -> PathBuf {
    crate::tiny_fixture()
}

/// The fixture's gateway with `limits`, two places, and no upstream.
fn state(limits: RequestLimits) -> HttpState {
    let dir = fixture();
    let image_token = crate::checkpoint::ModelIds::read(&dir)
        .unwrap()
        .image_token_id;
    let chat = ChatTokenizer::from_dir(&dir, image_token).unwrap();
    let nowhere = [NOWHERE.to_string()];
    let orchestrator = Orchestrator::new(
        chat,
        Some(Upstreams::new("vision-svc", &nowhere, None).unwrap()),
        Upstreams::new("llm-svc", &nowhere, None).unwrap(),
        limits,
        2,
        Metrics::new(),
    );
    HttpState {
        orchestrator: Arc::new(orchestrator),
        model_name: "tiny".into(),
        default_max_tokens: 4,
        request_timeout: Duration::from_secs(5),
        health: Arc::new(UpstreamHealth::new(&nowhere, &nowhere)),
    }
}

/// POSTs `body` to /v1/chat/completions; the status and the error message, if any.
async fn post(st: &HttpState, body: Body) -> (StatusCode, String) {
    let req = axum::http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let resp = router(st.clone(), None).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let message = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (status, message)
}

fn chat(messages: Value) -> Body {
    Body::from(json!({"messages": messages, "max_tokens": 2}).to_string())
}

fn image_part(base64: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{base64}")}})
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_naming_it_sent_whole_or_streamed() {
    let st = state(RequestLimits {
        max_body_bytes: 1000,
        ..Default::default()
    });
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string();
    let (status, msg) = post(&st, Body::from(big.clone())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{msg}");
    assert!(
        msg.contains("1000") && msg.contains("--max-body-bytes"),
        "{msg}"
    );
    // Without a content-length the limit still holds, counted as the chunks come.
    let chunks: Vec<Result<Bytes, std::io::Error>> = big
        .into_bytes()
        .chunks(100)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    let (status, msg) = post(&st, Body::from_stream(futures::stream::iter(chunks))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{msg}");
    // Under the limit the same route reads the body (and, past the checks, finds no upstream).
    let (status, msg) = post(&st, chat(json!([{"role": "user", "content": "hi"}]))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{msg}");
}

#[tokio::test]
async fn deeply_nested_json_is_a_400_not_a_stack_overflow() {
    let st = state(RequestLimits::default());
    let open = "[".repeat(100_000);
    // Where the schema wants a message, the first nested list is already the wrong type.
    let (status, msg) = post(&st, Body::from(format!("{{\"messages\": {open}"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    // Fields that take any JSON (content, stop) stop at serde_json's depth limit.
    for body in [
        format!("{{\"messages\": [{{\"role\": \"user\", \"content\": {open}"),
        format!(
            "{{\"messages\": [], \"stop\": {}",
            "{\"a\":".repeat(100_000)
        ),
    ] {
        let (status, msg) = post(&st, Body::from(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
        assert!(msg.contains("recursion limit"), "{msg}");
    }
}

#[tokio::test]
async fn a_body_that_is_not_utf8_is_a_400() {
    let st = state(RequestLimits::default());
    for body in [
        &b"{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}"[..],
        b"\xff\xfe{\"messages\": []}",
    ] {
        let (status, msg) = post(&st, Body::from(body.to_vec())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
        assert!(msg.contains("not a valid chat completion request"), "{msg}");
    }
}

#[tokio::test]
async fn base64_over_the_image_limit_is_refused_before_it_is_decoded() {
    let st = state(RequestLimits {
        max_image_bytes: 1000,
        ..Default::default()
    });
    // Invalid base64 at the end: decoding it would fail with another message.
    let data = format!("{}!!!!", "A".repeat(40_000));
    let content = json!([image_part(&data), {"type": "text", "text": "hi"}]);
    let (status, msg) = post(&st, chat(json!([{"role": "user", "content": content}]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(
        msg.contains("messages[0].content[0]")
            && msg.contains("at most 1000")
            && msg.contains("--max-image-bytes"),
        "{msg}"
    );
}

#[tokio::test]
async fn thousands_of_images_or_messages_get_a_400_naming_the_limit() {
    let st = state(RequestLimits::default());
    // Invalid base64 in each: counting comes before any decoding.
    let images: Vec<Value> = (0..5000).map(|_| image_part("!!!!")).collect();
    let (status, msg) = post(&st, chat(json!([{"role": "user", "content": images}]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(
        msg.contains("at most 8 images (--max-images), got 5000"),
        "{msg}"
    );
    let messages: Vec<Value> = (0..5000)
        .map(|_| json!({"role": "user", "content": "hi"}))
        .collect();
    let (status, msg) = post(&st, chat(json!(messages))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(
        msg.contains("at most 1024 messages (--max-messages), got 5000"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_bad_request_gets_400_even_when_every_place_is_taken() {
    let st = state(RequestLimits::default());
    let good = || chat(json!([{"role": "user", "content": "hi"}]));
    let full = st.orchestrator.fill();
    let bad = Body::from(
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
    );
    let (status, msg) = post(&st, bad).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    let (status, msg) = post(&st, chat(json!([]))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    let (status, msg) = post(&st, good()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{msg}");

    // The same on gRPC.
    let grpc = GatewayService {
        orchestrator: st.orchestrator.clone(),
        default_max_tokens: 4,
        request_timeout: Duration::from_secs(5),
    };
    let request = |images: usize, max_tokens: u32| {
        let mut content = vec![pb::ContentPart {
            part: Some(pb::content_part::Part::Text("hi".into())),
        }];
        content.extend((0..images).map(|_| pb::ContentPart {
            part: Some(pb::content_part::Part::Image(vec![0; 4])),
        }));
        tonic::Request::new(pb::ChatRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content,
                ..Default::default()
            }],
            max_tokens: Some(max_tokens),
            ..Default::default()
        })
    };
    let code = |r: Result<tonic::Response<pb::ChatResponse>, tonic::Status>| {
        let s = r.unwrap_err();
        (s.code(), s.message().to_string())
    };
    let (c, msg) = code(grpc.chat(request(3000, 2)).await);
    assert_eq!(c, Code::InvalidArgument, "{msg}");
    assert!(msg.contains("at most 8 images"), "{msg}");
    let (c, msg) = code(grpc.chat(request(0, 0)).await);
    assert_eq!(c, Code::InvalidArgument, "{msg}");
    let (c, msg) = code(grpc.chat(request(0, 2)).await);
    assert_eq!(c, Code::ResourceExhausted, "{msg}");

    // With the places back, the good request goes on (to find no upstream).
    drop(full);
    let (status, msg) = post(&st, good()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{msg}");
}

/// The served gateway, over real sockets: a gRPC message over `--max-body-bytes` is refused
/// by the transport with the limit named.
#[tokio::test]
async fn a_grpc_message_over_the_limit_is_refused_naming_it() {
    let limits = RequestLimits {
        max_body_bytes: 1000,
        ..Default::default()
    };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let cfg = crate::serve::GatewayConfig {
        model: fixture(),
        release: std::sync::Arc::new(crate::upstream::ReleaseOnHost),
        model_name: "tiny".into(),
        vision_addrs: vec![NOWHERE.into()],
        llm_addrs: vec![NOWHERE.into()],
        max_concurrent: 2,
        limits,
        default_max_tokens: 4,
        request_timeout: Duration::from_secs(5),
        embedding_dtype: pb::Dtype::F32,
        shared_memory: true,
        also_metrics: Vec::new(),
        api_key: None,
        tls: None,
        upstream_tls: None,
        client_send_timeout: crate::orchestrator::DEFAULT_CLIENT_SEND_TIMEOUT,
        generation_config: Default::default(),
        routing: Default::default(),
    };
    let server = tokio::spawn(crate::serve::serve(cfg, grpc, http, stop.clone()));
    let mut client = None;
    for _ in 0..100 {
        match pb::gateway_client::GatewayClient::connect(format!("http://{addr}")).await {
            Ok(c) => {
                client = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let mut client = client.expect("the gateway listens within 2 s");
    let text = |n: usize| pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: vec![pb::ContentPart {
                part: Some(pb::content_part::Part::Text("x".repeat(n))),
            }],
            ..Default::default()
        }],
        max_tokens: Some(0),
        ..Default::default()
    };
    let s = client.chat(text(5000)).await.unwrap_err();
    assert_eq!(s.code(), Code::OutOfRange, "{s:?}");
    assert!(s.message().contains("1000"), "{s:?}");
    // Under the limit the message is read and checked.
    let s = client.chat(text(10)).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    stop.cancel();
    server.await.unwrap().unwrap();
}
