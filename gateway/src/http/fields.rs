//! Which top-level fields of a chat completion request the HTTP API reads, which it accepts
//! and ignores, and which it refuses. A field that would change the answer and that this
//! server does not implement (beam search, audio, ...) is refused with a 400 naming it, so a
//! client never takes an answer that silently left its request out; so is a field nobody
//! defines (a typo). docs/api.md has one table of every field and what is done with it.

use serde_json::{Map, Value};

use crate::gateway_error::GatewayError;

/// Fields the request struct reads (`OpenAiRequest` in `http.rs`).
pub(super) const READ: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "ignore_eos",
    "return_token_ids",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "chat_template_kwargs",
];

/// Fields that change nothing about the answer: accepted, and dropped unread. (`model` and
/// `stream_options` are read, and so are in [`READ`].)
pub(super) const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
];

/// Fields of OpenAI's API or vLLM's extensions that would change the answer and that this
/// server does not implement, with what they ask for.
pub(super) const REFUSED: &[(&str, &str)] = &[
    (
        "functions",
        "the deprecated functions API is not read; send `tools`",
    ),
    (
        "function_call",
        "the deprecated functions API is not read; send `tool_choice`",
    ),
    ("audio", "this server answers in text only"),
    ("modalities", "this server answers in text only"),
    ("prediction", "this server has no predicted outputs"),
    ("web_search_options", "this server does not search the web"),
    (
        "reasoning_effort",
        "this server has no reasoning-effort control",
    ),
    ("verbosity", "this server has no verbosity control"),
    ("best_of", "this server generates one sequence per choice"),
    ("use_beam_search", "this server has no beam search"),
    ("length_penalty", "this server has no beam search"),
    ("min_tokens", "this server has no minimum length"),
    (
        "stop_token_ids",
        "stop at token ids is not implemented; use `stop` strings",
    ),
    ("bad_words", "this server bans no words"),
    (
        "allowed_token_ids",
        "this server does not restrict the vocabulary",
    ),
    (
        "prompt_logprobs",
        "this server returns logprobs of generated tokens only",
    ),
    ("echo", "this server does not echo the prompt"),
    (
        "add_generation_prompt",
        "the chat template always ends with the generation prompt",
    ),
    (
        "continue_final_message",
        "the chat template always starts a new assistant turn",
    ),
    (
        "chat_template",
        "the checkpoint's chat template is the only one",
    ),
    (
        "skip_special_tokens",
        "special tokens are always left out of the text",
    ),
    (
        "include_stop_str_in_output",
        "stop strings are always left out of the text",
    ),
    (
        "truncate_prompt_tokens",
        "this server does not truncate prompts",
    ),
];

/// Whether `value` of refused field `name` asks for what this server does anyway: null, or the
/// field's off value (some clients send those in every request).
fn asks_for_nothing(name: &str, value: &Value) -> bool {
    match (name, value) {
        (_, Value::Null) => true,
        ("functions" | "stop_token_ids" | "bad_words", Value::Array(a)) => a.is_empty(),
        ("function_call", Value::String(s)) => s == "none",
        ("modalities", Value::Array(a)) => a.len() == 1 && a[0] == "text",
        ("best_of", v) => v.as_u64() == Some(1),
        ("min_tokens", v) => v.as_u64() == Some(0),
        (
            "use_beam_search" | "echo" | "continue_final_message" | "include_stop_str_in_output",
            Value::Bool(b),
        ) => !b,
        ("add_generation_prompt" | "skip_special_tokens", Value::Bool(b)) => *b,
        _ => false,
    }
}

/// Drops the ignored fields of `body` and refuses a refused or unknown one, naming it; what is
/// left is for the request struct.
pub(super) fn check(body: &mut Map<String, Value>) -> Result<(), GatewayError> {
    body.retain(|name, _| !IGNORED.contains(&name.as_str()));
    for (name, value) in body.iter() {
        if READ.contains(&name.as_str()) {
            continue;
        }
        if let Some((_, why)) = REFUSED.iter().find(|(n, _)| n == name) {
            if asks_for_nothing(name, value) {
                continue;
            }
            return Err(GatewayError::Invalid(format!(
                "`{name}` is not supported: {why}"
            )));
        }
        return Err(GatewayError::Invalid(format!(
            "unknown field `{name}` (docs/api.md lists the fields this server reads)"
        )));
    }
    // Refused fields that ask for nothing are dropped with the rest.
    body.retain(|name, _| READ.contains(&name.as_str()));
    Ok(())
}
