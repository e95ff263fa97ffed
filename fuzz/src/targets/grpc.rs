//! Every request message of `proto/vlm/v1/vlm.proto` as its server receives it: protobuf
//! decoding (prost, as tonic does it), then the service's own checks. The first byte picks the
//! message, the rest is its encoding:
//!
//! - 0: `EncodeRequest` (vision-svc): dtype, then the image through [`super::image`]'s path
//!   and the embeddings packed in the dtype asked for;
//! - 1: `GenerateRequest` (llm-svc): tensors decoded, then the engine's `validate`;
//! - 2: `ChatRequest` (the gateway's gRPC API): roles and parts, then the gateway's steps.

use llm_svc::Event;
use prost::Message;
use vlm_proto::pb;
use vlm_proto::tensor;

use super::{fixture, text};
use crate::Outcome;

pub fn message(data: &[u8]) -> Outcome {
    let Some((&kind, body)) = data.split_first() else {
        return Err("empty input".into());
    };
    match kind % 3 {
        0 => encode_request(body),
        1 => generate_request(body),
        _ => chat_request(body),
    }
}

fn encode_request(body: &[u8]) -> Outcome {
    let req = pb::EncodeRequest::decode(body).map_err(text)?;
    // As vision-svc's handler: an unknown dtype is read as f32.
    let dtype = pb::Dtype::try_from(req.dtype).unwrap_or(pb::Dtype::F32);
    let out = fixture().vision.encode_image(&req.image).map_err(text)?;
    let packed = vision_svc::server::to_wire(&out, dtype).expect("host embeddings pack");
    let embeds = packed
        .embeddings
        .as_ref()
        .expect("embeddings are always sent");
    let (shape, values) = tensor::decode(embeds).expect("what vision-svc packs, decode reads");
    assert_eq!(shape, out.embeds.shape());
    assert_eq!(values.len(), out.embeds.to_f32().map_err(text)?.len());
    Ok(())
}

fn generate_request(body: &[u8]) -> Outcome {
    let req = pb::GenerateRequest::decode(body).map_err(text)?;
    let mut req = llm_svc::server::request_from_pb(req).map_err(text)?;
    let engine = &fixture().engine;
    engine.validate(&req).map_err(text)?;
    // What validate accepts, the engine runs: prefill (images placed, M-RoPE positions) and
    // two decode steps, to the end of the stream.
    req.max_new_tokens = req.max_new_tokens.min(2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(8);
    let mut stream = engine
        .submit(req, Some(deadline), tracing::Span::none())
        .unwrap_or_else(|e| panic!("submit refuses what validate accepted: {e}"));
    let mut tokens = 0;
    loop {
        match stream.blocking_recv() {
            Some(Event::Token { .. }) => tokens += 1,
            Some(Event::Finished(g)) => {
                assert!(
                    tokens <= 2 && g.tokens.len() == tokens,
                    "{tokens} tokens streamed, {} finished",
                    g.tokens.len()
                );
                return Ok(());
            }
            Some(Event::Failed(e)) => panic!("the engine failed a request validate accepted: {e}"),
            None => panic!("the engine's stream ended without a last event (its loop stopped?)"),
        }
    }
}

fn chat_request(body: &[u8]) -> Outcome {
    let req = pb::ChatRequest::decode(body).map_err(text)?;
    let req = ::gateway::grpc::request_from_pb(req, 256, &Default::default()).map_err(text)?;
    super::gateway::gateway_steps(&req)
}
