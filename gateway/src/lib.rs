//! The gateway: everything between a user's chat and the two model stages.
//!
//! - [`auth`]: the optional API key, and the access and TLS flags of the public ports.
//! - [`chat`]: the checkpoint's chat template and tokenizer; image placeholders expanded.
//! - [`detok`]: streaming detokenization that never splits a character, and stop strings.
//! - [`sampling`]: a request's sampling fields, with the checkpoint's defaults for those it
//!   leaves out.
//! - [`pipeline`]: the whole request in one process (`vlm run`).
//! - [`orchestrator`]: a chat across the services; [`upstream`]: their replicas;
//!   [`gateway_error`]: what a request can fail with, as gRPC and HTTP statuses.
//! - [`serve`]: the gateway's servers; [`stack`]: all three services in one process.
//! - [`bench`] and [`load`]: the measurements of `vlm bench` and `vlm load`; [`stand_in`]: an
//!   llm-svc without a model, to measure the gateway alone.

pub mod auth;
pub mod bench;
pub mod chat;
pub mod detok;
mod error;
pub mod gateway_error;
pub mod grpc;
pub mod http;
pub mod load;
pub mod metrics;
pub mod orchestrator;
pub mod pipeline;
pub mod sampling;
pub mod serve;
pub mod stack;
pub mod stand_in;
pub mod upstream;

pub use error::{Error, Result};
