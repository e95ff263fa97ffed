//! The compute layer shared by both model stages.
//!
//! - [`Backend`]: the narrow ops interface the vision tower and the text decoder are written
//!   against, once. Each op has a CPU reference ([`CpuBackend`]); the CUDA backend implements the
//!   same trait and is tested op by op against it.
//! - [`Device`]: the `--device` flag and the one dispatcher that picks the backend for it.
//! - [`HostTensor`]: a row-major f32 tensor in host memory, what goes in and out of a backend.
//! - [`Embeddings`]: an image's embeddings between the stages, f32 or f16 ([`HalfTensor`], over
//!   shared bytes), in the precision the backend that made them computes in, or on the device
//!   ([`handoff`]: from one stage to the other within one process).
//! - [`twin`]: a device backend compared with the CPU reference op by op: the GPU twin tests and
//!   the self-check every GPU passes before it serves.
//! - [`Weights`]: safetensors checkpoints (single file or sharded with an index), memory mapped,
//!   converted from f32/f16/bf16 to f32 by name with shape checks; quantized ones' packed
//!   tensors read through [`quant`].
//! - [`quant`]: quantized checkpoints (compressed-tensors int and FP8, AWQ, GPTQ,
//!   transformers' FineGrainedFP8) read into one form per number format (integer, FP8), and
//!   `--quantize` of an f16/bf16 one.
//! - [`sampling`]: the rule that picks each sequence's next token (greedy or a seeded draw
//!   after penalties, temperature, top-k, top-p and min-p), shared by the CPU and the GPU.
//! - [`kv`]: how the paged KV cache stores keys and values (`--kv-cache-dtype`: the backend's
//!   own width, or FP8 e4m3 with a scale).
//! - [`files`]: reading the JSON files of a checkpoint directory with errors that name the file
//!   and the key.

mod backend;
mod cpu;
pub mod cuda;
mod device;
mod embeddings;
mod error;
pub mod files;
pub mod golden;
pub mod handoff;
pub mod kv;
pub mod nn;
pub mod npy;
pub mod owner_thread;
pub mod patches;
pub mod quant;
pub mod random;
pub mod sampling;
pub mod skip;
mod tensor;
pub mod twin;
mod weights;

pub use backend::{
    argmax, release_idle_memory, AttentionWeights, AttnMask, Backend, GeluKind, LayerNormParams,
    OpTime, PagedBatch, Projection, QkNorm, QkvToCache, SampleIo,
};
pub use cpu::CpuBackend;
pub use cuda::{CudaBackend, CudaCache, CudaIds, CudaTensor, CudaWeight};
pub use device::{Device, OnDevice, OnDevices, MAX_GPUS};
pub use embeddings::{Embeddings, HalfTensor};
pub use error::{Error, Result};
pub use kv::{KvCacheDtype, KvFormat};
pub use tensor::HostTensor;
pub use weights::{WeightDtype, WeightPrefix, Weights};
