//! Images by URL through the real stack (the tiny model on CPU, every port on loopback): an
//! image served over HTTP, read from a file under `--allowed-local-media-path`, or sent by URL
//! over gRPC answers exactly as the same image sent as a data: URL; a file outside the
//! directory and a loopback URL without `--allow-private-media-addresses` get 400 naming the
//! part and the reason.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vlm_cli::stack::{LocalStack, StackConfig};
use vlm_compute::CpuBackend;
use vlm_proto::pb::{content_part, gateway_client::GatewayClient, ChatMessage, ContentPart};

fn fixture() -> PathBuf {
    vlm_compute::golden::tiny_fixture(env!("CARGO_MANIFEST_DIR"))
}

/// A one-route HTTP server on loopback answering every request with `body`; its address and
/// how many requests it took.
async fn serve_bytes(body: Vec<u8>) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let count = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
                let _ = conn.write_all(&body).await;
            });
        }
    });
    (format!("http://{addr}"), hits)
}

async fn post(stack: &LocalStack, url: &str) -> (u16, Value) {
    let body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is this?"},
        ]}],
        "max_tokens": 4,
        "ignore_eos": true,
        "temperature": 0,
        "return_token_ids": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", stack.http_addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

fn token_ids(answer: &Value) -> Vec<u64> {
    answer["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token ids in {answer}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_by_url_or_file_answers_as_the_same_image_sent_inline() {
    let images = fixture().join("images");
    let png = std::fs::read(images.join("cat.png")).unwrap();
    let (base, hits) = serve_bytes(png.clone()).await;
    let mut cfg = StackConfig::loopback(fixture());
    cfg.limits.media.allow_private_addresses = true;
    cfg.limits.media.local_dir = Some(gateway::media::LocalDir::new(&images).unwrap());
    let mut stack = LocalStack::start(cfg, || Ok(CpuBackend::new()))
        .await
        .unwrap();
    stack.ready(Duration::from_secs(60)).await.unwrap();

    let inline = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&png)
    );
    let (status, answer) = post(&stack, &inline).await;
    assert_eq!(status, 200, "{answer}");
    let expected = token_ids(&answer);

    // Over HTTP twice: the second comes from the URL cache.
    for _ in 0..2 {
        let (status, answer) = post(&stack, &format!("{base}/cat.png?size=full")).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(token_ids(&answer), expected);
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    let file = format!(
        "file://{}",
        images.canonicalize().unwrap().join("cat.png").display()
    );
    let (status, answer) = post(&stack, &file).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(token_ids(&answer), expected);
    let outside = format!(
        "file://{}",
        fixture()
            .canonicalize()
            .unwrap()
            .join("config.json")
            .display()
    );
    let (status, answer) = post(&stack, &outside).await;
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("messages[0].content[0]")
            && message.contains("outside --allowed-local-media-path"),
        "{message}"
    );

    // The gRPC API's URL variant, by the same rules.
    let mut client = GatewayClient::connect(format!("http://{}", stack.grpc_addr))
        .await
        .unwrap();
    let request = |url: String| vlm_proto::pb::ChatRequest {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: vec![
                ContentPart {
                    part: Some(content_part::Part::ImageUrl(url)),
                },
                ContentPart {
                    part: Some(content_part::Part::Text("What is this?".into())),
                },
            ],
            ..Default::default()
        }],
        max_tokens: Some(4),
        ignore_eos: true,
        temperature: Some(0.0),
        ..Default::default()
    };
    let answer = client
        .chat(request(format!("{base}/cat.png?size=full")))
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<u64> = answer.token_ids.iter().map(|&t| t as u64).collect();
    assert_eq!(ids, expected);
    let refused = client
        .chat(request(
            format!("{base}/missing.png").replace("http:", "gopher:"),
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    stack.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loopback_image_url_is_refused_by_default() {
    let png = std::fs::read(fixture().join("images/cat.png")).unwrap();
    let (base, hits) = serve_bytes(png).await;
    let mut stack = LocalStack::start(StackConfig::loopback(fixture()), || Ok(CpuBackend::new()))
        .await
        .unwrap();
    stack.ready(Duration::from_secs(60)).await.unwrap();
    let (status, answer) = post(&stack, &format!("{base}/cat.png")).await;
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("messages[0].content[0]") && message.contains("refused address"),
        "{message}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 0);
    stack.stop().await.unwrap();
}
