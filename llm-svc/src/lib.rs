//! The language stage: prompt token ids and image embeddings in, generated tokens out.
//!
//! ```text
//! GenerateRequest ─validate─▶ Engine::submit ─▶ queue ─▶ engine loop (one per device):
//!   scheduler: running decodes + prefill chunks under a token budget, blocks of the paged
//!   KV cache ─▶ one forward over the batch (TextModel) ─▶ per-sequence sampling ─▶ tokens
//!   streamed back to each caller, until eos / budget / the caller stops
//! ```

mod cli;
mod config;
mod engine;
mod error;
pub mod kv_cache;
pub mod metrics;
mod model;
pub mod mrope;
mod sampler;
mod scheduler;
mod sequence;
pub mod server;
mod step;

pub use cli::EngineArgs;
pub use config::{ModelConfig, TextConfig};
pub use engine::{
    Engine, EngineConfig, Event, FinishReason, GenerateRequest, Generation, ImageInput,
    KvCacheSize, RequestStream, TokenEvent,
};
pub use error::{Error, Result};
pub use kv_cache::PagedKv;
pub use model::TextModel;
pub use sampler::{argmax, SamplingParams, TokenLogprob, MAX_LOGIT_BIAS};
