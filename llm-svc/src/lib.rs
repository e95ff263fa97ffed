//! The language stage: prompt token ids and image embeddings in, generated tokens out.
//!
//! ```text
//! GenerateRequest ─validate─▶ embeddings (images placed) + M-RoPE positions
//!   ─prefill (TextModel::forward over the prompt)─▶ logits ─Sampler─▶ token ─▶ caller
//!   ─decode (one token per forward, KV cache)────▶ ... until eos / budget / caller stops
//! ```

mod config;
mod engine;
mod error;
mod model;
pub mod mrope;
mod sampler;
pub mod server;

pub use config::{ModelConfig, TextConfig};
pub use engine::{Engine, FinishReason, GenerateRequest, Generation, ImageInput, TokenEvent};
pub use error::{Error, Result};
pub use model::{DecodeGraph, DecodeInputs, KvCache, StepInput, TextModel};
pub use sampler::{argmax, Sampler, SamplingParams};
