//! Faults, one test each, against the three real binaries on loopback: a service killed with
//! `kill -9` in the middle of a request, SIGTERM to each service while it serves a stream, a
//! client that stops reading, an upstream that accepts connections but never answers, a
//! shared-memory segment whose reader has died, and a burst of cancelled calls beside a stream.
//!
//! Every wait is bounded, so a hang fails the test instead of stalling CI. Bounds are many
//! times what the step needs on a 2-core CI machine (a kill is noticed in milliseconds on
//! loopback), and each test takes seconds.

use std::time::{Duration, Instant};

use e2e::clients::{
    big_png, fixture_image, grpc_chat, grpc_client, grpc_long, http_chat, http_long,
};
use e2e::{metric, metrics_page, Stack, StackOptions};
use futures::StreamExt;
use tonic::Code;
use vlm_proto::pb;

/// How long an error caused by a dead process may take to reach the client. A process killed
/// on loopback resets its connections at once; this allows for a loaded CI machine.
const FAST: Duration = Duration::from_secs(3);
/// Longest any single step of these tests may take before it counts as a hang.
const HANG: Duration = Duration::from_secs(30);

/// Polls the Prometheus page at `url` until `sample` satisfies `ok` (or `HANG` passes).
async fn wait_metric(url: &str, sample: &str, ok: impl Fn(f64) -> bool) -> String {
    let end = Instant::now() + HANG;
    loop {
        let page = metrics_page(url).await;
        if ok(metric(&page, sample)) {
            return page;
        }
        assert!(Instant::now() < end, "{sample} never as expected:\n{page}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An image request in flight in vision-svc: starts a gRPC chat with a large image and
/// returns once vision-svc counts it in flight (its decode and resize take a while).
async fn image_request_in_vision(
    stack: &Stack,
) -> tokio::task::JoinHandle<Result<pb::ChatResponse, tonic::Status>> {
    let mut c = grpc_client(&stack.grpc).await;
    let req = grpc_chat(&[big_png(4000)], "Describe this image.", 4);
    let call = tokio::spawn(async move { c.chat(req).await.map(|r| r.into_inner()) });
    let url = stack.vision_metrics.clone().unwrap();
    wait_metric(&url, "vlm_vision_images_in_flight", |v| v >= 1.0).await;
    call
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_vision_svc_fails_its_requests_fast_and_the_gateway_recovers_when_it_returns() {
    let mut stack = Stack::start(StackOptions {
        service_metrics: true,
        ..Default::default()
    })
    .await;
    let in_flight = image_request_in_vision(&stack).await;
    stack.vision.kill9();
    let killed = Instant::now();
    let err = tokio::time::timeout(HANG, in_flight)
        .await
        .expect("the request in flight hangs after vision-svc died")
        .unwrap()
        .expect_err("vision-svc died under it");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("vision-svc"), "{}", err.message());
    assert!(
        killed.elapsed() < FAST,
        "answered after {:?}",
        killed.elapsed()
    );

    // New image requests fail fast too, over both APIs; text-only chats need no vision.
    let mut c = grpc_client(&stack.grpc).await;
    let cat = fixture_image("cat.png");
    let t = Instant::now();
    let err = c
        .chat(grpc_chat(
            std::slice::from_ref(&cat),
            "Describe this image.",
            4,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(t.elapsed() < FAST, "answered after {:?}", t.elapsed());
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", stack.http);
    let t = Instant::now();
    let r = http
        .post(&url)
        .json(&http_chat(
            std::slice::from_ref(&cat),
            "Describe this image.",
            4,
            false,
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(t.elapsed() < FAST, "answered after {:?}", t.elapsed());
    c.chat(grpc_chat(&[], "hi", 4))
        .await
        .expect("a text-only chat needs no vision-svc");

    // Back on the same port: the gateway reconnects by itself.
    stack.restart_vision();
    let back = Instant::now();
    let r = loop {
        match c
            .chat(grpc_chat(
                std::slice::from_ref(&cat),
                "Describe this image.",
                4,
            ))
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                assert!(back.elapsed() < HANG, "no recovery: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(r.usage.unwrap().completion_tokens, 4);
    eprintln!(
        "vision-svc restarted; first image answered after {:?}",
        back.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_llm_svc_mid_stream_ends_the_stream_with_an_error() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let mut c = grpc_client(&stack.grpc).await;

    // gRPC: the stream ends with UNAVAILABLE, never hangs.
    let mut s = c.chat_stream(grpc_long(1900)).await.unwrap().into_inner();
    for _ in 0..3 {
        s.next().await.expect("chunk").unwrap();
    }
    stack.llm.as_mut().unwrap().kill9();
    let killed = Instant::now();
    let err = tokio::time::timeout(HANG, async {
        while let Some(chunk) = s.next().await {
            match chunk {
                Ok(c) => assert_eq!(c.finish_reason, 0, "a killed generation cannot finish"),
                Err(e) => return e,
            }
        }
        panic!("the stream ended without an error")
    })
    .await
    .expect("the stream hangs after llm-svc died");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("llm-svc"), "{}", err.message());
    assert!(
        killed.elapsed() < FAST,
        "error after {:?}",
        killed.elapsed()
    );

    // HTTP: the event stream carries an error event, then ends.
    stack.start_llm();
    stack.wait_healthy(HANG).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.http))
        .json(&http_long(1900))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while seen.matches("data: ").count() < 3 {
        let bytes = body.next().await.expect("SSE data").unwrap();
        seen.push_str(&String::from_utf8_lossy(&bytes));
    }
    stack.llm.as_mut().unwrap().kill9();
    tokio::time::timeout(HANG, async {
        while let Some(bytes) = body.next().await {
            match bytes {
                Ok(b) => seen.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => break,
            }
        }
    })
    .await
    .expect("the event stream hangs after llm-svc died");
    let error = seen
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| panic!("no error event in:\n{seen}"));
    assert_eq!(error["error"]["type"], "unavailable", "{error}");
    assert!(!seen.contains("\"finish_reason\":\"length\""), "{seen}");
    assert!(stack.gateway.alive(), "the gateway outlives its upstream");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_to_llm_svc_mid_stream_drains_it_then_exits_zero() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let mut c = grpc_client(&stack.grpc).await;
    let mut s = c.chat_stream(grpc_long(300)).await.unwrap().into_inner();
    s.next().await.expect("first chunk").unwrap();
    let llm = stack.llm.as_mut().unwrap();
    llm.signal("TERM");
    let (mut tokens, mut finish) = (1, 0);
    tokio::time::timeout(HANG, async {
        while let Some(chunk) = s.next().await {
            let chunk = chunk.expect("the stream in flight completes");
            tokens += chunk.token_ids.len();
            finish = chunk.finish_reason;
        }
    })
    .await
    .expect("the draining stream hangs");
    assert_eq!(finish, pb::FinishReason::Length as i32);
    assert!(tokens >= 300, "{tokens} tokens");
    let status = llm
        .wait_exit(HANG)
        .await
        .expect("llm-svc exits after draining");
    assert!(status.success(), "llm-svc exit: {status:?}\n{}", llm.log());
    assert!(llm.log().contains("shutdown signal received"));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_to_vision_svc_mid_request_drains_it_then_exits_zero() {
    let mut stack = Stack::start(StackOptions {
        service_metrics: true,
        ..Default::default()
    })
    .await;
    let in_flight = image_request_in_vision(&stack).await;
    stack.vision.signal("TERM");
    let r = tokio::time::timeout(HANG, in_flight)
        .await
        .expect("the request in vision-svc hangs after SIGTERM")
        .unwrap()
        .expect("the image in flight is still encoded");
    assert_eq!(r.usage.unwrap().completion_tokens, 4);
    let status = stack
        .vision
        .wait_exit(HANG)
        .await
        .expect("vision-svc exits after draining");
    assert!(
        status.success(),
        "vision-svc exit: {status:?}\n{}",
        stack.vision.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_is_cut_off_and_its_generation_cancelled() {
    let stack = Stack::start(StackOptions {
        gateway_args: vec!["--client-send-timeout-secs".into(), "1".into()],
        service_metrics: true,
        ..Default::default()
    })
    .await;
    // A 1 KiB HTTP/2 window: the gateway can send this client almost nothing it has not read,
    // so its stream backs up at once instead of after megabytes of buffering.
    let ch = tonic::transport::Endpoint::from_shared(stack.grpc.clone())
        .unwrap()
        .initial_stream_window_size(1024)
        .initial_connection_window_size(1024)
        .connect()
        .await
        .unwrap();
    let mut c = pb::gateway_client::GatewayClient::new(ch);
    let rss_before = stack.gateway.rss_kib().unwrap();
    let mut s = c.chat_stream(grpc_long(1900)).await.unwrap().into_inner();
    s.next().await.expect("first chunk").unwrap();
    // Stop reading. The gateway cancels the generation after its 1 s send timeout.
    let llm = stack.llm_metrics.clone().unwrap();
    let stalled = Instant::now();
    let page = wait_metric(&llm, "vlm_llm_requests_total{outcome=\"cancelled\"}", |v| {
        v == 1.0
    })
    .await;
    assert!(
        stalled.elapsed() < Duration::from_secs(10),
        "{:?}",
        stalled.elapsed()
    );
    assert_eq!(
        metric(&page, "vlm_llm_requests_total{outcome=\"length\"}"),
        0.0
    );
    wait_metric(&llm, "vlm_llm_kv_blocks_in_use", |v| v == 0.0).await;
    let gw = format!("{}/metrics", stack.http);
    let page = wait_metric(&gw, "vlm_requests_in_flight", |v| v == 0.0).await;
    assert_eq!(
        metric(
            &page,
            "vlm_requests_total{api=\"grpc\",outcome=\"client_stalled\"}"
        ),
        1.0,
        "{page}"
    );
    assert!(stack.gateway.log().contains("client stopped reading"));
    let growth = stack.gateway.rss_kib().unwrap() as i64 - rss_before as i64;
    assert!(
        growth < 32 * 1024,
        "gateway RSS grew {growth} KiB for one stalled client"
    );
    // Reading again drains what was buffered; the stream never claims to have finished, and
    // it ends (with the cancellation's DEADLINE_EXCEEDED if the client came back in time).
    tokio::time::timeout(HANG, async {
        while let Some(chunk) = s.next().await {
            match chunk {
                Ok(c) => assert_eq!(c.finish_reason, 0, "a cancelled generation cannot finish"),
                Err(e) => {
                    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
                    break;
                }
            }
        }
    })
    .await
    .expect("the cut-off stream hangs");
    // The permit came back: the gateway serves the next request.
    c.chat(grpc_chat(&[], "hi", 4)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_http_client_that_stops_reading_holds_bounded_memory_and_nothing_else() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start(StackOptions {
        gateway_args: vec!["--client-send-timeout-secs".into(), "1".into()],
        service_metrics: true,
        ..Default::default()
    })
    .await;
    let rss_before = stack.gateway.rss_kib().unwrap();
    // A raw HTTP/1.1 client with a 4 KiB receive buffer that reads the response head and
    // then nothing. The tiny model's longest stream (1900 events, ~420 KB) fits in hyper's
    // write buffer (~400 KiB per connection), so the gateway's sends never wait a whole second
    // and the generation runs to its end; what must hold is that it ends, and that the
    // request gives back its permit, its KV blocks and its memory. (The gRPC test above, with
    // a small HTTP/2 window, backs the stream up into the send timeout.)
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let addr = stack.http.trim_start_matches("http://").parse().unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    let mut body = http_long(1900);
    body["return_token_ids"] = serde_json::json!(true);
    let body = body.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut first = [0u8; 512];
    let n = conn.read(&mut first).await.unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    let llm = stack.llm_metrics.clone().unwrap();
    // Ends by running out of tokens (or, on a slower machine, by the send timeout).
    let end = Instant::now() + HANG;
    loop {
        let page = metrics_page(&llm).await;
        let ended = metric(&page, "vlm_llm_requests_total{outcome=\"cancelled\"}")
            + metric(&page, "vlm_llm_requests_total{outcome=\"length\"}");
        if ended == 1.0 {
            break;
        }
        assert!(Instant::now() < end, "the generation never ended:\n{page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_metric(&llm, "vlm_llm_kv_blocks_in_use", |v| v == 0.0).await;
    let gw = format!("{}/metrics", stack.http);
    wait_metric(&gw, "vlm_requests_in_flight", |v| v == 0.0).await;
    let growth = stack.gateway.rss_kib().unwrap() as i64 - rss_before as i64;
    assert!(
        growth < 32 * 1024,
        "gateway RSS grew {growth} KiB for one stalled client"
    );
    // The permit came back while the client still holds its connection.
    let mut c = grpc_client(&stack.grpc).await;
    c.chat(grpc_chat(&[], "hi", 4)).await.unwrap();
    drop(conn);
}

/// Accepts TCP connections on `port` and holds them open without reading or writing: a
/// process that is wedged, or a port that belongs to something else.
fn black_hole(port: u16) -> std::thread::JoinHandle<()> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind black hole");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_never_answers_gets_a_deadline_not_a_hang() {
    // The gateway's own request timeout is the bound here: 2 s.
    let timeout = Duration::from_secs(2);
    let mut stack = Stack::start(StackOptions {
        without_llm: true,
        gateway_args: vec!["--request-timeout-secs".into(), "2".into()],
        ..Default::default()
    })
    .await;
    let _llm = black_hole(stack.llm_port);
    let bound = timeout + FAST;
    let mut c = grpc_client(&stack.grpc).await;

    let t = Instant::now();
    let err = tokio::time::timeout(HANG, c.chat(grpc_chat(&[], "hi", 4)))
        .await
        .expect("the gateway hangs on a silent llm-svc")
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(t.elapsed() < bound, "answered after {:?}", t.elapsed());

    // A client's shorter deadline wins.
    let t = Instant::now();
    let mut req = tonic::Request::new(grpc_chat(&[], "hi", 4));
    req.set_timeout(Duration::from_millis(300));
    let err = tokio::time::timeout(HANG, c.chat(req))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    assert!(t.elapsed() < FAST, "answered after {:?}", t.elapsed());

    let http = reqwest::Client::new();
    let t = Instant::now();
    let r = tokio::time::timeout(
        HANG,
        http.post(format!("{}/v1/chat/completions", stack.http))
            .json(&http_chat(&[], "hi", 4, true))
            .send(),
    )
    .await
    .expect("the gateway hangs on a silent llm-svc")
    .unwrap();
    assert_eq!(r.status(), 504);
    assert!(t.elapsed() < bound, "answered after {:?}", t.elapsed());

    // Health says so, promptly, instead of waiting on the silent upstream.
    let t = Instant::now();
    let h = tokio::time::timeout(HANG, http.get(format!("{}/health", stack.http)).send())
        .await
        .expect("/health hangs on a silent upstream")
        .unwrap();
    assert_eq!(h.status(), 503);
    assert!(
        t.elapsed() < FAST,
        "/health answered after {:?}",
        t.elapsed()
    );

    // The same for a silent vision-svc: an image request gets the deadline.
    stack.vision.kill9();
    let _vision = black_hole(stack.vision_port);
    let t = Instant::now();
    let err = tokio::time::timeout(
        HANG,
        c.chat(grpc_chat(
            &[fixture_image("cat.png")],
            "Describe this image.",
            4,
        )),
    )
    .await
    .expect("the gateway hangs on a silent vision-svc")
    .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(t.elapsed() < bound, "answered after {:?}", t.elapsed());
    assert!(stack.gateway.alive());
}

/// On one host the embeddings go through shared memory once llm-svc has named its domain in a
/// response: the same tokens as when they travel inside the messages, no segment left after a
/// request, and none left when llm-svc has been killed and a request's segment has no reader.
#[tokio::test(flavor = "multi_thread")]
async fn shared_memory_embeddings_answer_the_same_and_leave_no_segment_behind() {
    if vlm_proto::shm::domain().is_none() {
        vlm_compute::skip::note(&"no /dev/shm here");
        return;
    }
    let mut stack = Stack::start(StackOptions {
        service_metrics: true,
        ..Default::default()
    })
    .await;
    let url = stack.vision_metrics.clone().unwrap();
    let path = |p: &str| format!("vlm_vision_embedding_bytes_total{{path=\"{p}\"}}");
    let mut c = grpc_client(&stack.grpc).await;
    let request = || grpc_chat(&[fixture_image("cat.png")], "Describe this image.", 6);

    // llm-svc has not named its domain yet: the first image travels inside the messages.
    let inline = c.chat(request()).await.unwrap().into_inner();
    let page = metrics_page(&url).await;
    assert!(metric(&page, &path("grpc")) > 0.0, "{page}");
    assert_eq!(metric(&page, &path("shm")), 0.0, "{page}");

    let shared = c.chat(request()).await.unwrap().into_inner();
    assert_eq!(
        shared.token_ids, inline.token_ids,
        "shared memory answers the same"
    );
    let page = metrics_page(&url).await;
    let shm_bytes = metric(&page, &path("shm"));
    assert!(shm_bytes > 0.0, "{page}");
    let vision_pid = stack.vision.pid();
    assert_eq!(
        vlm_proto::shm::segments_of(vision_pid),
        Vec::<String>::new(),
        "llm-svc removes a segment once it has mapped it"
    );

    // llm-svc dies: vision-svc still writes the next image's segment, the call to llm-svc
    // fails, and the gateway removes the segment.
    stack.llm.as_mut().unwrap().kill9();
    let err = tokio::time::timeout(
        HANG,
        c.chat(grpc_chat(&[big_png(64)], "Describe this image.", 6)),
    )
    .await
    .expect("no hang")
    .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let page = metrics_page(&url).await;
    assert!(
        metric(&page, &path("shm")) > shm_bytes,
        "it went through shared memory: {page}"
    );
    assert_eq!(
        vlm_proto::shm::segments_of(vision_pid),
        Vec::<String>::new(),
        "a segment without a reader is removed"
    );
}

/// A channel to the stack's llm-svc as the gateway makes them (`internal_hop`).
async fn gateway_like_channel(stack: &Stack) -> tonic::transport::Channel {
    let endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", stack.llm_port))
            .unwrap();
    vlm_proto::internal_hop::endpoint(endpoint)
        .connect()
        .await
        .expect("llm-svc answers")
}

/// A call generating `max_new_tokens` without stopping at eos.
fn tokens_request(max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_token_ids: vec![10, 11, 12, 13],
        max_new_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// A stream of `len` tokens on `ch`, its first token read: the bystander of a fault test.
async fn long_stream(
    ch: &tonic::transport::Channel,
    len: u32,
) -> tonic::Streaming<pb::GenerateResponse> {
    use vlm_proto::pb::llm_service_client::LlmServiceClient;
    let mut long = LlmServiceClient::new(ch.clone())
        .generate(tokens_request(len))
        .await
        .expect("the long stream starts")
        .into_inner();
    assert!(long.message().await.expect("a first token").is_some());
    long
}

/// Reads the rest of [`long_stream`]'s tokens; panics naming the error (and `stack`'s
/// llm-svc HTTP/2 log lines) if the stream fails.
async fn finish_long_stream(
    stack: &Stack,
    mut long: tonic::Streaming<pb::GenerateResponse>,
    len: usize,
) {
    let mut tokens = 1;
    loop {
        match tokio::time::timeout(HANG, long.message())
            .await
            .expect("no hang")
        {
            Ok(Some(m)) if m.finish_reason == 0 => tokens += m.token_ids.len(),
            Ok(Some(_)) | Ok(None) => break,
            Err(e) => {
                let log = stack.llm.as_ref().unwrap().log();
                let h2: Vec<&str> = log.lines().filter(|l| l.contains("h2")).collect();
                let h2 = h2.join("\n");
                panic!(
                    "the long stream failed after {tokens} tokens: {e:?}\n\
                     llm-svc's HTTP/2 lines:\n{h2}"
                )
            }
        }
    }
    assert_eq!(tokens, len);
}

/// Calls cancelled as soon as they start (a client's deadline, a client gone) reach llm-svc as
/// RST_STREAMs, often before its server has taken the stream. hyper's HTTP/2 server counts
/// such streams per connection and, past its limit (20 by default, a guard against "rapid
/// reset" floods), closes the connection with ENHANCE_YOUR_CALM: every other stream on it fails
/// with RESOURCE_EXHAUSTED. The gateway multiplexes all its calls over one connection per
/// replica, so a burst of cancellations must not cost the streams beside them.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_cancelled_calls_leaves_the_other_streams_on_the_connection_alone() {
    use vlm_proto::pb::llm_service_client::LlmServiceClient;
    let stack = Stack::start(StackOptions::default()).await;
    let ch = gateway_like_channel(&stack).await;
    let long = long_stream(&ch, 400).await;
    // Each call is given a few hundred microseconds: its HEADERS go out, then its RST_STREAM.
    for round in 0..20u64 {
        let calls = (0..50u64).map(|i| {
            let mut c = LlmServiceClient::new(ch.clone());
            let wait = Duration::from_micros((round * 50 + i) % 700);
            async move {
                let _ = tokio::time::timeout(wait, c.generate(tokens_request(4))).await;
            }
        });
        futures::future::join_all(calls).await;
    }
    finish_long_stream(&stack, long, 400).await;
}

/// A call the gateway cancels mid-stream still has frames on the wire: tokens llm-svc sent
/// before the RST_STREAM reached it. The client side of HTTP/2 ignores frames for streams it
/// reset lately, but by default remembers only 50 of them, for 1 s; a frame for one it forgot
/// is a stream error it answers with a reset of its own, and past 1024 of those (over the
/// connection's life) it closes the connection with ENHANCE_YOUR_CALM, failing every stream on
/// it. The soak saw it on a busy 2-core machine: three streamed answers cut off mid-answer.
/// Here a single-threaded client drops 100 streams at once and then sleeps, as a busy gateway
/// does, so that llm-svc's next tokens for them arrive after they were forgotten.
#[tokio::test(flavor = "current_thread")]
async fn streams_cancelled_while_tokens_are_in_flight_leave_the_connection_alone() {
    use vlm_proto::pb::llm_service_client::LlmServiceClient;
    let stack = Stack::start(StackOptions::default()).await;
    let ch = gateway_like_channel(&stack).await;
    let long = long_stream(&ch, 2000).await;
    for round in 0..30 {
        let calls = (0..100).map(|_| {
            let mut c = LlmServiceClient::new(ch.clone());
            async move {
                let mut answer = c.generate(tokens_request(200)).await?.into_inner();
                answer.message().await.map(|_| answer)
            }
        });
        let answers = futures::future::join_all(calls).await;
        let failed = answers.iter().filter(|a| a.is_err()).count();
        let first = answers.iter().find_map(|a| a.as_ref().err());
        assert_eq!(failed, 0, "round {round}: calls failed, as {first:?}");
        drop(answers);
        // Busy: the connection task cannot send the resets while llm-svc streams on.
        std::thread::sleep(Duration::from_millis(20));
    }
    finish_long_stream(&stack, long, 2000).await;
}
