//! The language stage: prompt token ids and image embeddings in, generated tokens out.
//!
//! It serves Qwen3-VL's text decoder and, as the same model configured without vision, the
//! text-only Qwen3 (`Qwen3ForCausalLM`) and Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`) checkpoints:
//! `config.json`'s `architectures` picks the [`Architecture`], and a text-only model's
//! [`ModelConfig::vision`] is `None` (it refuses requests with images).
//!
//! ```text
//! GenerateRequest ─validate─▶ Engine::submit ─▶ queue ─▶ engine loop (one per device):
//!   scheduler: running decodes + prefill chunks under a token budget, blocks of the paged
//!   KV cache ─▶ one forward over the batch (TextModel) ─▶ per-sequence sampling ─▶ tokens
//!   streamed back to each caller, until eos / budget / the caller stops
//! ```
//!
//! The modules, bottom up (each uses only those above it): `error`, `config`, `sampler`
//! (sampling settings), `grammar` (a request's constraint compiled), `request` (what a caller
//! sends and gets back), `mrope`, `kv_cache`, `kv_events` (the cache's changes published in
//! vLLM's format), `validation` (a request checked against the
//! model), `sequence` (one request inside the engine), `scheduler` (which sequences run, and
//! their state after each step), `model` (the forward pass), `step` (a step on the device),
//! `kv_sizing` (how large the cache is), `metrics`, `engine` (the loop), `cli` (the engine's
//! flags), `server` (the gRPC service).

mod cli;
mod config;
mod engine;
mod error;
pub mod grammar;
pub mod kv_cache;
pub mod kv_events;
mod kv_sizing;
pub mod metrics;
mod model;
pub mod mrope;
mod request;
mod sampler;
mod scheduler;
mod sequence;
pub mod server;
mod step;
mod validation;

pub use cli::{EngineArgs, WeightArgs};
pub use config::{Architecture, ModelConfig, TextConfig, VisionTokens};
pub use engine::{CheckedRequest, Engine, EngineConfig};
pub use error::{Error, Result};
pub use kv_cache::PagedKv;
pub use kv_sizing::KvCacheSize;
pub use model::TextModel;
pub use request::{
    Event, FinishReason, GenerateRequest, Generation, ImageInput, RequestStream, TokenEvent,
};
pub use sampler::{SamplerRow, SamplingParams, TokenLogprob, MAX_LOGIT_BIAS};
pub use vlm_compute::KvCacheDtype;
