//! The engine's command-line flags, shared by the `llm-svc` binary and `vlm serve`, and the
//! weights' (`--quantize`), shared by every command that loads the model.

use crate::kv_events::KvEventsConfig;
use crate::{EngineConfig, KvCacheSize};

/// The engine's knobs as command-line flags, for `llm-svc` and `vlm serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// Fraction of the GPU's memory this service may use, weights included; the KV cache
    /// gets what is left after the weights and room for a step's activations.
    #[arg(long, env = "VLM_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// Size the KV cache in tokens instead (any device; default on the CPU: 1 GiB).
    #[arg(long, env = "VLM_KV_CACHE_TOKENS")]
    pub kv_cache_tokens: Option<usize>,
    /// How the KV cache stores keys and values: auto (f16 on a GPU, f32 on the CPU) or fp8
    /// (e4m3, one byte an element: twice the tokens in the same memory), scaled by the
    /// checkpoint's k_scale/v_scale where it has them, else by 1.0, and saturated at ±448 times
    /// the scale. See docs/serving.md for the drift measured and where FP8 is unsafe.
    #[arg(
        long,
        env = "VLM_KV_CACHE_DTYPE",
        default_value = "auto",
        value_name = "auto|fp8"
    )]
    pub kv_cache_dtype: vlm_compute::KvCacheDtype,
    /// Most sequences in one engine step.
    #[arg(long, env = "VLM_MAX_BATCH_SEQS", default_value_t = 128)]
    pub max_batch_seqs: usize,
    /// Most tokens in one engine step; longer prompts are prefilled in chunks between decode
    /// steps, so running streams keep a steady pace. A step's time grows with it: 512 keeps
    /// an 8B model's inter-token latency near 40 ms under load on an H100/H200 class GPU,
    /// 2048 prefills faster at about twice the latency.
    #[arg(long, env = "VLM_MAX_BATCH_TOKENS", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Do not reuse cache blocks of earlier prompts that began the same way.
    #[arg(long, env = "VLM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// Publish the prefix cache's changes as KV events in vLLM's format (msgpack
    /// `KVEventBatch`es of BlockStored / BlockRemoved / AllBlocksCleared on a ZeroMQ PUB
    /// socket), for llm-d's endpoint picker or Dynamo's KV router: `tcp://*:5557` binds,
    /// `tcp://HOST:PORT` connects to a subscriber that binds. Off unless given.
    #[arg(long, env = "VLM_KV_EVENTS_ENDPOINT", value_name = "ZMQ_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// The topic (first frame) of every KV event message, e.g. `kv@POD_IP@MODEL` for llm-d.
    #[arg(long, env = "VLM_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
}

impl EngineArgs {
    /// The engine configuration these flags give, on a GPU (`on_gpu`) or the CPU.
    pub fn config(&self, max_context: Option<usize>, on_gpu: bool) -> EngineConfig {
        let kv_cache = match self.kv_cache_tokens {
            Some(n) => KvCacheSize::Tokens(n),
            None if on_gpu => KvCacheSize::DeviceFraction(self.gpu_memory_utilization),
            None => KvCacheSize::Auto,
        };
        EngineConfig {
            max_context,
            kv_cache,
            kv_cache_dtype: self.kv_cache_dtype,
            max_batch_seqs: self.max_batch_seqs,
            max_batch_tokens: self.max_batch_tokens,
            prefix_caching: !self.no_prefix_caching,
            kv_events: self
                .kv_events_endpoint
                .clone()
                .map(|endpoint| KvEventsConfig {
                    endpoint,
                    topic: self.kv_events_topic.clone(),
                }),
            ..EngineConfig::default()
        }
    }
}

/// How the text decoder's weights are loaded: `llm-svc` and every `vlm` command that loads the
/// model.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct WeightArgs {
    /// Quantize the text decoder's f16/bf16 matrices at load: int8 (symmetric) or int4
    /// (asymmetric), round-to-nearest in groups of 128 columns, so decoding reads a half or a
    /// quarter of the bytes; or fp8 (e4m3 with a scale per 128x128 block, the layout of Qwen's
    /// FP8 checkpoints). Lower quality
    /// than an AWQ or GPTQ checkpoint (which are served as they are, without this flag); the
    /// vision tower, the embeddings and lm_head stay f16. Refused for a checkpoint that is
    /// quantized already.
    #[arg(long, env = "VLM_QUANTIZE", value_name = "int8|int4|fp8")]
    pub quantize: Option<vlm_compute::quant::QuantizeTo>,
    /// Quantize lm_head to 8 bits at load (symmetric, round-to-nearest in groups of 128), for
    /// any checkpoint whose lm_head is f16/bf16, quantized ones included (AWQ, GPTQ and
    /// compressed-tensors checkpoints leave it so). Decoding reads all of lm_head every token:
    /// at Qwen3-VL-8B sizes 1.24 GB of the ~4.9 GB a 4-bit model reads, so this reads an eighth
    /// fewer bytes a token and holds 0.6 GB less, for logits that move by a fraction of a unit
    /// (llama.cpp's quantized GGUFs keep theirs at 6 bits). Refused for a checkpoint that ties
    /// lm_head to its embedding table (the 2B and 4B sizes)
    #[arg(long, env = "VLM_QUANTIZE_LM_HEAD")]
    pub quantize_lm_head: bool,
}

impl WeightArgs {
    /// The checkpoint in `dir` (or, with `random_seed`, random weights of its config) loaded as
    /// these options say.
    pub fn open(
        &self,
        dir: &std::path::Path,
        random_seed: Option<u64>,
    ) -> vlm_compute::Result<vlm_compute::Weights> {
        Ok(vlm_compute::Weights::open_or_random(dir, random_seed)?
            .quantize(self.quantize)?
            .quantize_lm_head(self.quantize_lm_head))
    }
}
