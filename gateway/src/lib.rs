//! The gateway: everything between a user's chat and the two model stages.
//!
//! - [`auth`]: the optional API key, and the access and TLS flags of the public ports.
//! - [`chat`]: the checkpoint's chat template and tokenizer; image placeholders expanded.
//! - [`structured`]: structured outputs (a JSON schema, a regex, a choice, a grammar) as the
//!   grammar llm-svc enforces; [`tools`]: the tools offered and the grammar that forces calls;
//!   [`output`]: an answer split into reasoning, content and tool calls as it streams.
//! - [`detok`]: streaming detokenization that never splits a character, and stop strings.
//! - [`sampling`]: a request's sampling fields, with the checkpoint's defaults for those it
//!   leaves out.
//! - [`request`]: a chat request as the gateway takes it, and its limits and checks;
//!   [`checkpoint`]: what the gateway reads from the model directory besides the tokenizer.
//! - [`orchestrator`]: a chat across the services; [`upstream`]: their replicas, their health
//!   checks and ejection; [`routing`]: which replica a call goes to (cache-aware);
//!   [`gateway_error`]: what a request can fail with, as gRPC and HTTP statuses.
//! - [`media`]: images by URL (http, https, file), fetched with the SSRF guards and cached.
//! - [`serve`]: the gateway's servers.
//!
//! The gateway talks to vision-svc and llm-svc over the contract (`vlm-proto`) only, and links
//! none of their code; the `vlm` CLI (crate `vlm-cli`) composes all three in one process.

pub mod auth;
pub mod chat;
pub mod checkpoint;
pub mod detok;
mod error;
pub mod gateway_error;
pub mod grpc;
pub mod http;
pub mod media;
pub mod metrics;
pub mod orchestrator;
pub mod output;
pub mod request;
pub mod routing;
pub mod sampling;
pub mod serve;
pub mod structured;
pub mod tools;
pub mod upstream;

#[cfg(test)]
mod failover_tests;

pub use error::{Error, Result};

/// The committed test checkpoint `tests/fixtures/<name>`.
#[cfg(test)]
pub(crate) fn fixture(name: &str) -> std::path::PathBuf {
    let rel = std::path::Path::new("../tests/fixtures").join(name);
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&rel);
    if built.is_dir() {
        built
    } else {
        rel
    }
}

/// The tiny Qwen3-VL checkpoint most tests read.
#[cfg(test)]
pub(crate) fn tiny_fixture() -> std::path::PathBuf {
    fixture("tiny-qwen3-vl")
}
