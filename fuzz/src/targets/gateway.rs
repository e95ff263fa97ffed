//! The gateway's work on a chat before any model runs: the OpenAI body parsed and checked as
//! `POST /v1/chat/completions` does, the chat rendered by the checkpoint's template and
//! tokenized, image placeholders expanded, and the `GenerateRequest` it would send checked by
//! llm-svc as llm-svc checks it off the wire.
//!
//! What must hold: the content of a message is data, never template code (user text comes out
//! of the template verbatim); nothing a client writes in a chat makes an internal error (500);
//! and a request the gateway accepts and builds is one llm-svc accepts (or refuses only as too
//! long for the context).

use ::gateway::chat::{Message, Part};
use ::gateway::request::{image_parts, validate_request, ChatRequest, RequestLimits};
use llm_svc::SamplingParams;
use vlm_proto::pb;
use vlm_proto::tensor;

use super::{fixture, text};
use crate::Outcome;

/// The gateway's steps after parsing; each image stands for a 2×2 grid of merged patches (4
/// tokens) as vision-svc would answer for a small image.
pub fn gateway_steps(req: &ChatRequest) -> Outcome {
    validate_request(req, &RequestLimits::default()).map_err(text)?;
    let f = fixture();
    // As the orchestrator checks `logit_bias` against the checkpoint's vocabulary.
    ::gateway::sampling::check_logit_bias_ids(&req.sampling, f.model.text.vocab_size)
        .map_err(text)?;
    let n_images = image_parts(&req.messages).count();
    let merge = f.model.vision.as_ref().map_or(2, |v| v.spatial_merge_size);
    let grid = [1u32, 2 * merge as u32, 2 * merge as u32];
    let tokens = 4;
    let ids = match f.chat.prompt_ids(&req.messages, &vec![tokens; n_images]) {
        Ok(ids) => ids,
        Err(e) => {
            assert!(
                e.is_invalid_input(),
                "the content of a chat made an internal error (HTTP 500, not 400): {e}"
            );
            return Err(text(e));
        }
    };
    // As the orchestrator builds it (`generate_request`), f16 embeddings as vision-svc
    // sends them.
    let hidden = f.model.text.hidden_size;
    let deepstack = f.vision.model.config().deepstack_visual_indexes.len();
    let zeros = vec![0f32; tokens * hidden];
    let embedding = || tensor::encode(&[tokens, hidden], &zeros, pb::Dtype::F16);
    let images = (0..n_images)
        .map(|_| pb::ImageEmbeddings {
            embeddings: Some(embedding()),
            deepstack: (0..deepstack).map(|_| embedding()).collect(),
            grid_thw: grid.to_vec(),
            ..Default::default()
        })
        .collect();
    let gen = ::gateway::orchestrator::generate_request(req, ids, images);
    let gen = llm_svc::server::request_from_pb(gen)
        .unwrap_or_else(|s| panic!("llm-svc cannot read what the gateway sent: {s:?}"));
    match f.engine.validate(&gen) {
        Ok(()) => Ok(()),
        Err(e @ llm_svc::Error::PromptTooLong { .. }) => Err(text(e)),
        Err(e) => panic!("llm-svc refuses a request the gateway accepted and built: {e}"),
    }
}

/// A `POST /v1/chat/completions` body.
pub fn openai_request(data: &[u8]) -> Outcome {
    let req = ::gateway::http::parse_chat_request(data, 256, &Default::default()).map_err(text)?;
    gateway_steps(&req)
}

const ROLES: [&str; 4] = ["system", "user", "assistant", "user"];

/// Chat messages straight to the template, text of any bytes. The input is segments split at
/// 0xFF bytes: a segment's first byte says what it is (bits 0-1: role; bit 2: start a new
/// message, else a part of the current one; bit 3: an image part), the rest is its text
/// (invalid UTF-8 replaced, as a JSON or protobuf string could not carry it).
pub fn chat_messages(data: &[u8]) -> Outcome {
    let mut messages: Vec<Message> = Vec::new();
    for seg in data.split(|&b| b == 0xff) {
        let Some((&ctrl, rest)) = seg.split_first() else {
            continue;
        };
        let part = if ctrl & 8 != 0 {
            Part::Image(Vec::new())
        } else {
            Part::Text(String::from_utf8_lossy(rest).into_owned())
        };
        match messages.last_mut() {
            Some(m) if ctrl & 4 == 0 => m.parts.push(part),
            _ => messages.push(Message::new(ROLES[(ctrl & 3) as usize], vec![part])),
        }
    }
    let req = ChatRequest {
        messages,
        sampling: SamplingParams::greedy(),
        max_new_tokens: 16,
        stop: Vec::new(),
        ignore_eos: false,
        return_logits: false,
        ..Default::default()
    };
    // The gateway checks the request (no messages, an empty one) before rendering it.
    validate_request(&req, &RequestLimits::default()).map_err(text)?;
    let rendered = fixture()
        .chat
        .render(&req.messages)
        .unwrap_or_else(|e| panic!("the template fails on chat content: {e}"));
    for m in req.messages.iter().filter(|m| m.role == "user") {
        for p in &m.parts {
            if let Part::Text(t) = p {
                assert!(
                    rendered.contains(t.as_str()),
                    "user text {t:?} is not in the rendered prompt verbatim"
                );
            }
        }
    }
    gateway_steps(&req)
}
