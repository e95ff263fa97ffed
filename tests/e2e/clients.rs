//! Requests and clients the soak and fault tests share: gRPC and OpenAI-style HTTP chats
//! with and without images, and images of any size made on the spot.

use base64::Engine as _;
use serde_json::{json, Value};
use vlm_proto::pb::gateway_client::GatewayClient;
use vlm_proto::pb::{self, content_part::Part};

use crate::fixture;

/// A gRPC client of the gateway at `url`, with our message-size limits.
pub async fn grpc_client(url: &str) -> GatewayClient<tonic::transport::Channel> {
    GatewayClient::connect(url.to_string())
        .await
        .expect("gateway gRPC reachable")
        .max_decoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(vlm_proto::MAX_MESSAGE_BYTES)
}

/// Bytes of a bundled test image (`cat.png`, `photo.jpg`, `small.webp`, `wide.png`).
pub fn fixture_image(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join("images").join(name)).expect("fixture image")
}

/// A `side` x `side` PNG of smooth gradients: small to send (it compresses well), slow to
/// decode and resize (a 4000-pixel side keeps vision-svc busy for a while), so a test can
/// act while the image is in the service.
pub fn big_png(side: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([(x % 251) as u8, (y % 241) as u8, ((x + y) % 239) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)
        .expect("PNG encoding");
    out.into_inner()
}

/// One user turn over gRPC: `images`, then `text`.
pub fn grpc_chat(images: &[Vec<u8>], text: &str, max_tokens: u32) -> pb::ChatRequest {
    let mut content: Vec<pb::ContentPart> = images
        .iter()
        .map(|b| pb::ContentPart {
            part: Some(Part::Image(b.clone())),
        })
        .collect();
    content.push(pb::ContentPart {
        part: Some(Part::Text(text.into())),
    });
    pb::ChatRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content,
            ..Default::default()
        }],
        temperature: Some(0.0),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// A text chat that generates exactly `max_tokens` (eos ignored): long enough to act on
/// while it streams (the tiny model's context is 2048 tokens).
pub fn grpc_long(max_tokens: u32) -> pb::ChatRequest {
    pb::ChatRequest {
        ignore_eos: true,
        ..grpc_chat(
            &[],
            "Count the apples; then explain your answer.",
            max_tokens,
        )
    }
}

/// The same chat as [`grpc_chat`], as an OpenAI-style request body.
pub fn http_chat(images: &[Vec<u8>], text: &str, max_tokens: u32, stream: bool) -> Value {
    let mut content: Vec<Value> = images
        .iter()
        .map(|b| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(b);
            json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
        })
        .collect();
    content.push(json!({"type": "text", "text": text}));
    json!({
        "model": "tiny-qwen3-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

/// [`grpc_long`] as an OpenAI-style streamed request body.
pub fn http_long(max_tokens: u32) -> Value {
    let mut body = http_chat(
        &[],
        "Count the apples; then explain your answer.",
        max_tokens,
        true,
    );
    body["ignore_eos"] = json!(true);
    body
}
