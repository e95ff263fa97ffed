//! Errors of the compute layer: each variant carries what a user needs to fix the problem
//! (the file, the key, the tensor name, the shapes).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    BadJson { path: PathBuf, message: String },
    #[error("{path}: key `{key}` {problem}")]
    BadKey {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("{path} is not a valid safetensors file: {message}")]
    BadSafetensors { path: PathBuf, message: String },
    #[error(
        "no model weights in {dir}: expected model.safetensors or model.safetensors.index.json"
    )]
    NoWeights { dir: PathBuf },
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error(
        "tensor `{name}` has shape {got:?} in the checkpoint, the config implies {expected:?}"
    )]
    WeightShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error(
        "tensor `{name}` has dtype {dtype}; supported are F32, F16 and BF16, and I8, I32 and I64 \
         for quantized checkpoints' packed tensors"
    )]
    UnsupportedDtype { name: String, dtype: String },
    /// A weight f16 (the GPU's weight format) cannot hold, or not a number at all.
    #[error(
        "tensor `{name}` holds {value}, which f16 (the GPU's weight format, largest finite \
         value 65504) cannot hold: the checkpoint is damaged, or this weight needs a wider format"
    )]
    NotF16 { name: String, value: f32 },
    /// A quantized module that cannot be read as its format says.
    #[error("quantized weight `{name}`: {problem}")]
    Quantized { name: String, problem: String },
    #[error("{op}: {message}")]
    Shape { op: &'static str, message: String },
    /// A KV cache format (`--kv-cache-dtype`) the backend, its kernels or the model's shapes
    /// do not support, or a scale that cannot be one.
    #[error("--kv-cache-dtype {dtype}: {problem}")]
    KvCacheDtype {
        dtype: &'static str,
        problem: String,
    },
    /// The GPU, its driver or a CUDA library failed or is missing.
    #[error("CUDA: {what}")]
    Cuda { what: String },
    /// A device backend disagreed with the CPU reference (or failed) in its startup self-check
    /// ([`crate::twin::self_check`]): it must not serve.
    #[error("{backend} self-check against the CPU reference failed: {what}; refusing to serve from this device (use --device cpu, and please report the GPU and driver)")]
    SelfCheck { backend: &'static str, what: String },
    /// NVRTC refused a kernel (or the driver could not load it); `log` is the compiler's.
    #[error("kernel {kernel} failed to compile or load:\n{log}")]
    KernelCompile { kernel: String, log: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn shape(op: &'static str, message: impl Into<String>) -> Self {
        Error::Shape {
            op,
            message: message.into(),
        }
    }
}
