//! A minimal gRPC client of the gateway: one image and a question, the answer streamed.
//!
//! ```sh
//! cargo run --release --bin vlm -- serve            # in one terminal
//! cargo run --release --example chat_client -- tests/fixtures/tiny-qwen3-vl/images/cat.png "Describe this image."
//! ```

use futures::StreamExt;
use vlm_proto::pb::gateway_client::GatewayClient;
use vlm_proto::pb::{content_part::Part, ChatMessage, ChatRequest, ContentPart};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let image = std::fs::read(
        args.next()
            .unwrap_or("tests/fixtures/tiny-qwen3-vl/images/cat.png".into()),
    )?;
    let prompt = args.next().unwrap_or("Describe this image.".into());
    let addr = std::env::var("VLM_GATEWAY").unwrap_or("http://127.0.0.1:50050".into());

    let mut client = GatewayClient::connect(addr).await?;
    let request = ChatRequest {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: vec![
                ContentPart {
                    part: Some(Part::Image(image)),
                },
                ContentPart {
                    part: Some(Part::Text(prompt)),
                },
            ],
            ..Default::default()
        }],
        max_tokens: Some(32),
        ..Default::default()
    };
    let mut stream = client.chat_stream(request).await?.into_inner();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        print!("{}", chunk.text);
        if let Some(u) = chunk.usage {
            println!(
                "\n[{} prompt tokens, {} generated]",
                u.prompt_tokens, u.completion_tokens
            );
        }
    }
    Ok(())
}
