//! How large the paged KV cache is: a number of tokens given, or what fits in a fraction of the
//! device's memory once the weights are in and room is kept for a step's activations, the
//! recorded steps' logits and the sampler's buffers.

use vlm_compute::Backend;

use crate::kv_cache::PagedKv;
use crate::step::StepRunner;
use crate::{Error, ModelConfig, Result};

/// How much memory the paged KV cache gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvCacheSize {
    /// This many tokens.
    Tokens(usize),
    /// This fraction of the device's memory for everything of this engine's (weights
    /// included), as vLLM's `--gpu-memory-utilization`; only for backends with their own
    /// memory (a GPU).
    DeviceFraction(f32),
    /// 0.9 of a GPU; on the CPU, 1 GiB (at most what `max_batch_seqs` full-length sequences
    /// need).
    Auto,
}

/// What the cache's size depends on, of the engine's configuration.
pub(crate) struct CacheBudget {
    pub kv_cache: KvCacheSize,
    pub kv_cache_dtype: vlm_compute::KvCacheDtype,
    /// Tokens per block.
    pub block_size: usize,
    /// Most sequences and tokens in one step (what a step's activations and logits take).
    pub max_batch_seqs: usize,
    pub max_batch_tokens: usize,
}

/// How many blocks (the null block included) the KV cache gets.
pub(crate) fn kv_blocks<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    ec: &CacheBudget,
    max_context: usize,
) -> Result<usize> {
    let text = &cfg.text;
    let per_token = PagedKv::<B>::bytes_per_token(text, ec.kv_cache_dtype);
    let bs = ec.block_size;
    // Never more than every sequence of a full batch at full length needs.
    let most = ec.max_batch_seqs.saturating_mul(max_context);
    let tokens = match (ec.kv_cache, be.device_memory()) {
        (KvCacheSize::Tokens(n), _) => n,
        (KvCacheSize::DeviceFraction(f), Some(mem)) => device_tokens(text, ec, per_token, f, mem)?,
        (KvCacheSize::Auto, Some(mem)) => device_tokens(text, ec, per_token, 0.9, mem)?,
        (KvCacheSize::DeviceFraction(_), None) => {
            return Err(Error::Config(format!(
                "the {} backend has no device memory to take a fraction of; give the KV cache in tokens",
                be.name()
            )))
        }
        (KvCacheSize::Auto, None) => ((1usize << 30) / per_token).min(most),
    };
    if tokens < bs {
        return Err(Error::Config(format!(
            "the KV cache would hold {tokens} tokens, less than one block of {bs}"
        )));
    }
    Ok(tokens.div_ceil(bs) + 1)
}

/// Tokens that fit in `fraction` of the device's memory, after what is in use now (the
/// weights) and room for a step's activations and the recorded steps' logits.
fn device_tokens(
    text: &crate::TextConfig,
    ec: &CacheBudget,
    per_token: usize,
    fraction: f32,
    (free, total): (usize, usize),
) -> Result<usize> {
    if !(0.05..=1.0).contains(&fraction) {
        return Err(Error::Config(format!(
            "the device memory fraction must be in [0.05, 1], got {fraction}"
        )));
    }
    let (h, i) = (text.hidden_size, text.intermediate_size);
    let q = text.num_attention_heads * text.head_dim;
    let kv = text.num_key_value_heads * text.head_dim;
    // f32 activations alive at once in a layer (x, norms, q/k/v and their rotations, the
    // attention output, gate, up and their product), with f16 copies for the GEMMs: twice
    // that for the allocator's slack.
    let activations = 2 * ec.max_batch_tokens * (8 * h + 3 * q + 6 * kv + 4 * i) * 4;
    // Logits of every recorded batch size up to the largest batch, and of an eager step.
    let logits = 3 * ec.max_batch_seqs.next_power_of_two() * text.vocab_size * 4;
    let sampler = StepRunner::<vlm_compute::CpuBackend>::sampler_bytes(text, ec.max_batch_seqs);
    let reserve = activations + logits + sampler + (1usize << 30);
    let budget = (fraction as f64 * total as f64) as usize;
    let used = total - free;
    let left = budget.saturating_sub(used).saturating_sub(reserve);
    if left < per_token * 1024 {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        return Err(Error::Config(format!(
            "no room for a KV cache: {:.1} GiB of {:.1} GiB allowed (--gpu-memory-utilization {fraction}) with {:.1} GiB in use and {:.1} GiB kept for activations; raise the fraction or size the cache with --kv-cache-tokens",
            gib(budget),
            gib(total),
            gib(used),
            gib(reserve),
        )));
    }
    Ok(left / per_token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vlm_compute::{CudaBackend, KvCacheDtype};

    /// On an 80 GB GPU with 17 GB in use (8B weights), the same fraction holds twice the
    /// tokens in an FP8 cache as in an f16 one: one byte an element instead of two.
    #[test]
    fn an_fp8_cache_fits_twice_the_tokens() {
        let dir = vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), "tiny-qwen3");
        let text = ModelConfig::from_dir(&dir).unwrap().text;
        let ec = CacheBudget {
            kv_cache: KvCacheSize::DeviceFraction(0.9),
            kv_cache_dtype: KvCacheDtype::Auto,
            block_size: 16,
            max_batch_seqs: 128,
            max_batch_tokens: 512,
        };
        let gb = 1usize << 30;
        let mem = (63 * gb, 80 * gb);
        let tokens = |dtype| {
            let per = PagedKv::<CudaBackend>::bytes_per_token(&text, dtype);
            device_tokens(&text, &ec, per, 0.9, mem).unwrap()
        };
        let (f16, fp8) = (tokens(KvCacheDtype::Auto), tokens(KvCacheDtype::Fp8));
        assert!(fp8 == 2 * f16 || fp8 == 2 * f16 + 1, "{f16} vs {fp8}");
    }
}
