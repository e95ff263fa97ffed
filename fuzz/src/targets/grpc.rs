//! Every request message of `proto/vlm/v1/vlm.proto` as its server receives it: protobuf
//! decoding (prost, as tonic does it), then the service's own checks. The first byte picks the
//! message, the rest is its encoding:
//!
//! - 0: `EncodeRequest` (vision-svc): dtype, then the image through [`super::image`]'s path
//!   and the embeddings packed in the dtype asked for;
//! - 1: `GenerateRequest` (llm-svc): tensors decoded, then the engine's `validate`;
//! - 2: `ChatRequest` (the gateway's gRPC API): roles and parts, then the gateway's steps.

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
    let packed = tensor::encode(out.embeds.shape(), out.embeds.data(), dtype);
    let (shape, values) = tensor::decode(&packed).expect("what encode packs, decode reads");
    assert_eq!(shape, out.embeds.shape());
    assert_eq!(values.len(), out.embeds.data().len());
    Ok(())
}

fn generate_request(body: &[u8]) -> Outcome {
    let req = pb::GenerateRequest::decode(body).map_err(text)?;
    let req = llm_svc::server::request_from_pb(req).map_err(|s| s.message().to_string())?;
    fixture().engine.validate(&req).map_err(text)
}

fn chat_request(body: &[u8]) -> Outcome {
    let req = pb::ChatRequest::decode(body).map_err(text)?;
    let req = ::gateway::grpc::request_from_pb(req, 256).map_err(text)?;
    super::gateway::gateway_steps(&req)
}
