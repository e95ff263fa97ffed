//! A chat request as the gateway takes it, after either API has read it and before any work
//! is done for it: its messages, sampling and budget ([`ChatRequest`]), the limits every request
//! is held to ([`RequestLimits`]) and the checks against them ([`validate_request`]). The
//! orchestrator serves it across the services; `vlm run` runs it in one process.

use crate::chat::{Message, Part, TemplateVars, RESERVED_TEMPLATE_VARS};
use crate::tools::ToolRequest;
use crate::{Error, Result};
use vlm_proto::sampling::SamplingParams;

/// Limits applied to every request, on top of the model's own.
#[derive(Clone, Debug)]
pub struct RequestLimits {
    /// Most images in one request.
    pub max_images: usize,
    /// Most new tokens one request may ask for.
    pub max_new_tokens: usize,
    /// Most messages in one request.
    pub max_messages: usize,
    /// Largest encoded image (PNG, JPEG, ... bytes) in a request.
    pub max_image_bytes: usize,
    /// Largest request: an HTTP body (larger gets 413) or a gRPC message (OUT_OF_RANGE).
    pub max_body_bytes: usize,
    /// What image URLs may reach, and how they are fetched ([`crate::media`]).
    pub media: crate::media::MediaRules,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_images: 8,
            max_new_tokens: 8192,
            max_messages: 1024,
            max_image_bytes: 32 * 1024 * 1024,
            max_body_bytes: vlm_proto::MAX_MESSAGE_BYTES,
            media: crate::media::MediaRules::default(),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// Generation stops before any of these strings; the text returned excludes it.
    pub stop: Vec<String>,
    /// Generate through eos tokens, up to `max_new_tokens` (for benchmarks and tests).
    pub ignore_eos: bool,
    /// Hand each step's logits to `on_token` (`vlm run --logits-out`); otherwise greedy
    /// requests keep them on the device.
    pub return_logits: bool,
    /// The grammar the answer keeps to (structured outputs), enforced by llm-svc. A tool
    /// choice that forces calls is a grammar the orchestrator builds from `tools`.
    pub constraint: Option<vlm_proto::pb::Constraint>,
    /// The tools offered, and what the model is to do with them.
    pub tools: ToolRequest,
    /// More variables for the chat template (`chat_template_kwargs`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl ChatRequest {
    /// What the chat template is given besides the messages.
    pub fn template_vars(&self) -> TemplateVars {
        TemplateVars {
            tools: self.tools.template_tools(),
            kwargs: self.template_kwargs.clone(),
        }
    }
}

/// Checks a chat request against `limits` before any work is done for it.
pub fn validate_request(req: &ChatRequest, limits: &RequestLimits) -> Result<()> {
    if req.messages.is_empty() {
        return Err(Error::InvalidRequest("`messages` is empty".into()));
    }
    if req.messages.len() > limits.max_messages {
        return Err(Error::InvalidRequest(format!(
            "a request may carry at most {} messages (--max-messages), got {}",
            limits.max_messages,
            req.messages.len()
        )));
    }
    // An assistant turn may be calls alone.
    if let Some(i) = req
        .messages
        .iter()
        .position(|m| m.parts.is_empty() && m.tool_calls.is_empty())
    {
        return Err(Error::InvalidRequest(format!("message {i} has no content")));
    }
    if req.constraint.is_some() && req.tools.forces_calls() {
        return Err(Error::InvalidRequest(
            "`tool_choice` asks for tool calls and `response_format` for another format: \
             both constrain the answer; send one"
                .into(),
        ));
    }
    if let Some(name) = RESERVED_TEMPLATE_VARS
        .iter()
        .find(|&&n| req.template_kwargs.contains_key(n))
    {
        return Err(Error::InvalidRequest(format!(
            "`chat_template_kwargs.{name}` is set by the server; leave it out"
        )));
    }
    let images = image_parts(&req.messages).count();
    if images > limits.max_images {
        return Err(Error::InvalidRequest(format!(
            "a request may carry at most {} images (--max-images), got {images}",
            limits.max_images
        )));
    }
    if let Some((i, bytes)) = image_parts(&req.messages)
        .enumerate()
        .find(|(_, b)| b.len() > limits.max_image_bytes)
    {
        return Err(Error::InvalidRequest(format!(
            "image {i} has {} bytes; an image may have at most {} (--max-image-bytes)",
            bytes.len(),
            limits.max_image_bytes
        )));
    }
    if req.max_new_tokens == 0 || req.max_new_tokens > limits.max_new_tokens {
        return Err(Error::InvalidRequest(format!(
            "`max_tokens` (tokens to generate; --max-new-tokens in the CLI) must be between 1 and {}, got {}",
            limits.max_new_tokens, req.max_new_tokens
        )));
    }
    req.sampling.validate()?;
    Ok(())
}

/// The image bytes of a chat, in order of appearance.
pub fn image_parts(messages: &[Message]) -> impl Iterator<Item = &Vec<u8>> {
    messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| match p {
            Part::Image(bytes) => Some(bytes),
            Part::Text(_) => None,
        })
}

/// The request limits and image-URL rules as flags, shared by `gateway` and `vlm serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct RequestLimitArgs {
    /// Most images in one request.
    #[arg(long, env = "VLM_MAX_IMAGES", default_value_t = RequestLimits::default().max_images)]
    pub max_images: usize,
    /// Most messages in one request.
    #[arg(long, env = "VLM_MAX_MESSAGES", default_value_t = RequestLimits::default().max_messages)]
    pub max_messages: usize,
    /// Largest image in a request, in bytes as encoded (PNG, JPEG, WebP, GIF); base64 data
    /// over it is refused before it is decoded, and an image URL's body is not read past it.
    #[arg(long, env = "VLM_MAX_IMAGE_BYTES", default_value_t = RequestLimits::default().max_image_bytes)]
    pub max_image_bytes: usize,
    /// Largest request in bytes: an HTTP body (more gets 413) or a gRPC message (more gets
    /// OUT_OF_RANGE).
    #[arg(long, env = "VLM_MAX_BODY_BYTES", default_value_t = RequestLimits::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Most tokens one request may ask to generate.
    #[arg(long, env = "VLM_MAX_TOKENS_LIMIT", default_value_t = RequestLimits::default().max_new_tokens)]
    pub max_tokens_limit: usize,
    #[command(flatten)]
    pub media: crate::media::MediaArgs,
}

impl RequestLimitArgs {
    /// The limits these flags set (the local media directory must exist).
    pub fn limits(&self) -> anyhow::Result<RequestLimits> {
        Ok(RequestLimits {
            max_images: self.max_images,
            max_new_tokens: self.max_tokens_limit,
            max_messages: self.max_messages,
            max_image_bytes: self.max_image_bytes,
            max_body_bytes: self.max_body_bytes,
            media: self.media.rules()?,
        })
    }
}
