//! What a model takes on the GPU before it serves anything: the weights by format, the KV cache
//! for a given number of tokens, and the scratch a quantized model's GEMMs use, from the
//! checkpoint's config alone (`vlm doctor --model`). The same quantities `vlm bench` reports
//! measured, so the two can be set side by side; activations, workspaces and recorded graphs
//! come on top (llm-svc keeps 1 GiB and a step's activations for them when it sizes the cache).

use std::path::Path;

use vlm_compute::quant::{QuantConfig, QuantizeTo, QUANTIZE_GROUP};
use vlm_compute::CudaBackend;

/// Bytes, by kind.
#[derive(Clone, Debug, PartialEq)]
pub struct Footprint {
    /// The text decoder's projections, as stored, and what that format is.
    pub decoder_matrices: usize,
    pub decoder_format: String,
    /// Embedding table and `lm_head` (f16; a tied head once; the table alone under
    /// `--quantize-lm-head`).
    pub embeddings: usize,
    /// `lm_head` in 8 bits under `--quantize-lm-head`, else 0.
    pub lm_head_int8: usize,
    /// The vision tower and its mergers (f16); 0 for a text-only checkpoint.
    pub vision: usize,
    /// The KV cache for `kv_tokens` tokens (f16 keys and values, or FP8 ones: one byte each).
    pub kv_cache: usize,
    pub kv_tokens: usize,
    /// Where an integer matrix is dequantized for the GEMMs of prefill and batches: the
    /// largest chunk of rows any matrix is dequantized in, in f16 (at most 64 MiB; a matrix
    /// that fits is dequantized whole).
    pub dequant_scratch: usize,
}

impl Footprint {
    pub fn total(&self) -> usize {
        self.decoder_matrices
            + self.embeddings
            + self.lm_head_int8
            + self.vision
            + self.kv_cache
            + self.dequant_scratch
    }

    /// The checkpoint in `dir` (its own format, or quantized at load as `weights` says) with a
    /// cache of `kv_tokens` stored as `kv_dtype` says.
    pub fn of(
        dir: &Path,
        weights: llm_svc::WeightArgs,
        kv_tokens: usize,
        kv_dtype: llm_svc::KvCacheDtype,
    ) -> anyhow::Result<Self> {
        let quantize = weights.quantize;
        let cfg = llm_svc::ModelConfig::from_dir(dir)?;
        let t = &cfg.text;
        let h = t.hidden_size;
        let matrices = t.num_hidden_layers * decoder_layer_matrix_params(t);
        // The checkpoint's own format (config.json alone; no weights need be there), else
        // --quantize.
        let path = dir.join("config.json");
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        let checkpoint = QuantConfig::from_config(&path, &json)?;
        if let (Some(q), Some(to)) = (&checkpoint, quantize) {
            anyhow::bail!("--quantize {to} asked of a checkpoint that is quantized already ({q})");
        }
        let fp8 = matches!(checkpoint, Some(QuantConfig::Fp8 { .. }))
            || quantize == Some(QuantizeTo::Fp8);
        let (decoder_matrices, decoder_format, dequant_scratch) =
            match stored_int_bits(checkpoint.as_ref(), quantize) {
                Some(b) => {
                    let format = if fp8 {
                        "FP8 e4m3".into()
                    } else {
                        format!("{b}-bit")
                    };
                    (
                        int_bytes(matrices, b),
                        format,
                        2 * dequant_scratch_halves(t),
                    )
                }
                None => (matrices * 2, "f16".into(), 0),
            };
        if let Some(why) = cfg.lm_head_quantize_refusal() {
            if weights.quantize_lm_head {
                anyhow::bail!("{why}");
            }
        }
        let table = t.vocab_size * h;
        let (f16_head, lm_head_int8) = match (cfg.tie_word_embeddings, weights.quantize_lm_head) {
            (true, _) => (0, 0),
            (false, false) => (table * 2, 0),
            (false, true) => (0, int_bytes(table, 8)),
        };
        let vision = match vision_svc::VisionConfig::from_dir(dir) {
            Ok(v) if cfg.vision.is_some() => 2 * vision_params(&v),
            _ => 0,
        };
        Ok(Self {
            decoder_matrices,
            decoder_format,
            embeddings: table * 2 + f16_head,
            lm_head_int8,
            vision,
            kv_cache: kv_tokens * llm_svc::PagedKv::<CudaBackend>::bytes_per_token(t, kv_dtype),
            kv_tokens,
            dequant_scratch,
        })
    }
}

/// The halves of the GPU's dequantization scratch for `c`'s decoder: the largest chunk of rows
/// it dequantizes any of its matrices in (q/k/v and gate/up are stacked, as the GPU holds
/// them).
fn dequant_scratch_halves(c: &llm_svc::TextConfig) -> usize {
    let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d;
    [[qkv, h], [h, c.num_attention_heads * d], [2 * i, h], [h, i]]
        .iter()
        .map(|&[m, k]| vlm_compute::cuda::dequant_chunk_rows(m, k) * k)
        .max()
        .unwrap_or(0)
}

/// The projections' parameters in one decoder layer (q/k/v, o, gate/up, down): what
/// quantization makes integers.
pub fn decoder_layer_matrix_params(c: &llm_svc::TextConfig) -> usize {
    let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
    h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * h * i
}

/// Bits of the values the GPU holds the decoder's matrices as (integers, or FP8's e4m3 bytes
/// with a scale per row and 128 columns), for a checkpoint in `checkpoint`'s format or
/// quantized at load to `quantize`; `None` where it holds f16.
pub fn stored_int_bits(
    checkpoint: Option<&QuantConfig>,
    quantize: Option<QuantizeTo>,
) -> Option<u32> {
    match (checkpoint, quantize) {
        (Some(QuantConfig::Fp8 { .. }), _) | (None, Some(QuantizeTo::Fp8)) => Some(8),
        (Some(q), _) => Some(q.bits()),
        (None, q) => q.map(|q| q.bits()),
    }
}

/// Bytes `params` integer weights of `bits` take as the GPU stores them: the packed values and
/// an f16 scale and zero per [`QUANTIZE_GROUP`] (`--quantize`'s group, and the usual one of
/// checkpoints).
pub fn int_bytes(params: usize, bits: u32) -> usize {
    params * bits as usize / 8 + params / QUANTIZE_GROUP * 4
}

/// The ViT's and its mergers' parameters.
fn vision_params(v: &vision_svc::VisionConfig) -> usize {
    let (h, i) = (v.hidden_size, v.intermediate_size);
    let block = 4 * h * h + 2 * h * i;
    let merged = h * v.spatial_merge_size * v.spatial_merge_size;
    let merger = merged * merged + merged * v.out_hidden_size;
    let patch = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size * h;
    v.depth * block
        + (1 + v.deepstack_visual_indexes.len()) * merger
        + patch
        + v.num_position_embeddings * h
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_svc::KvCacheDtype::{Auto, Fp8};

    fn fixture(name: &str) -> std::path::PathBuf {
        vlm_compute::golden::fixture(env!("CARGO_MANIFEST_DIR"), name)
    }

    /// The checkpoint as stored.
    fn as_stored() -> llm_svc::WeightArgs {
        Default::default()
    }

    /// `--quantize to`.
    fn to(to: QuantizeTo) -> llm_svc::WeightArgs {
        llm_svc::WeightArgs {
            quantize: Some(to),
            ..Default::default()
        }
    }

    /// The estimate's decoder and embeddings equal what the loaded model holds, counted by the
    /// CPU backend (f32, so twice f16's bytes), for the f16 fixture.
    #[test]
    fn the_estimate_matches_the_loaded_model() {
        let dir = fixture("tiny-qwen3");
        let f = Footprint::of(&dir, as_stored(), 1024, Auto).unwrap();
        let engine = llm_svc::Engine::load(
            &dir,
            &vlm_compute::Weights::open(&dir).unwrap(),
            vlm_compute::CpuBackend::new(),
            llm_svc::EngineConfig::default(),
            &prometheus::Registry::new(),
        )
        .unwrap();
        assert_eq!(
            2 * (f.decoder_matrices + f.embeddings),
            engine.weight_bytes()
        );
        assert_eq!((f.vision, f.dequant_scratch), (0, 0), "text-only, f16");
        // 2 layers x 2 KV heads x 32 dims x K and V x f16.
        assert_eq!(f.kv_cache, 1024 * 2 * 2 * 32 * 2 * 2);
        // FP8: one byte an element, the rest the same.
        let fp8 = Footprint::of(&dir, as_stored(), 1024, Fp8).unwrap();
        assert_eq!(
            fp8,
            Footprint {
                kv_cache: f.kv_cache / 2,
                ..f
            }
        );
    }

    #[test]
    fn four_bits_take_about_a_quarter_and_the_format_comes_from_the_checkpoint() {
        let f16 = Footprint::of(&fixture("tiny-qwen3"), as_stored(), 0, Auto).unwrap();
        let w4 = Footprint::of(&fixture("tiny-qwen3"), to(QuantizeTo::Int4), 0, Auto).unwrap();
        let awq = Footprint::of(&fixture("tiny-qwen3-awq"), as_stored(), 0, Auto).unwrap();
        assert_eq!(w4, awq, "AWQ is 4-bit");
        assert_eq!(w4.decoder_format, "4-bit");
        // Half a byte a value and 4 bytes a 128 of them, against f16's 2 bytes: 0.2656.
        let ratio = w4.decoder_matrices as f64 / f16.decoder_matrices as f64;
        assert!((ratio - 0.265625).abs() < 1e-9, "{ratio}");
        // The tiny model's largest matrix, gate/up [2 x 384, 128], dequantized whole; at 8B
        // sizes gate/up [24576, 4096] in 3 chunks of 8,192 rows: 64 MiB, not 201 MB.
        assert_eq!(w4.dequant_scratch, 2 * 384 * 128 * 2);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/models/qwen3-vl-8b");
        let w4_8b = Footprint::of(&dir, to(QuantizeTo::Int4), 0, Auto).unwrap();
        assert_eq!(w4_8b.dequant_scratch, 64 << 20);
        let vl = Footprint::of(&fixture("tiny-qwen3-vl"), as_stored(), 0, Auto).unwrap();
        assert!(vl.vision > 0);
    }

    /// `--quantize-lm-head`: lm_head at 8 bits with a scale per 128 (the table stays f16 with
    /// the embeddings), with the decoder as stored; refused for a tied config, as the loader
    /// refuses it.
    #[test]
    fn an_8_bit_lm_head_is_counted_apart_and_refused_when_tied() {
        let dir = fixture("tiny-qwen3");
        let head8 = |quantize| llm_svc::WeightArgs {
            quantize,
            quantize_lm_head: true,
        };
        let f16 = Footprint::of(&dir, as_stored(), 0, Auto).unwrap();
        let f = Footprint::of(&dir, head8(None), 0, Auto).unwrap();
        let table = 414 * 128;
        assert_eq!((f16.embeddings, f16.lm_head_int8), (2 * table * 2, 0));
        assert_eq!(
            (f.embeddings, f.lm_head_int8),
            (table * 2, table + table / 128 * 4)
        );
        assert_eq!(f.decoder_matrices, f16.decoder_matrices);
        let w4 = Footprint::of(&dir, head8(Some(QuantizeTo::Int4)), 0, Auto).unwrap();
        assert_eq!(
            (w4.decoder_format.as_str(), w4.lm_head_int8),
            ("4-bit", f.lm_head_int8)
        );
        let tied = std::env::temp_dir().join(format!("vlm-footprint-tied-{}", std::process::id()));
        std::fs::create_dir_all(&tied).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        config["tie_word_embeddings"] = true.into();
        std::fs::write(tied.join("config.json"), config.to_string()).unwrap();
        let e = Footprint::of(&tied, head8(None), 0, Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tie_word_embeddings"), "{e}");
        std::fs::remove_dir_all(&tied).unwrap();
    }

    /// FP8 matrices are held as their e4m3 bytes and an f32 scale per row and 128 columns (8-bit
    /// integers' bytes), for an FP8 checkpoint and for --quantize fp8 alike.
    #[test]
    fn fp8_is_counted_as_the_bytes_it_is_held_as() {
        let w8 = Footprint::of(&fixture("tiny-qwen3"), to(QuantizeTo::Int8), 0, Auto).unwrap();
        for f in [
            Footprint::of(&fixture("tiny-qwen3-ct-fp8-dynamic"), as_stored(), 0, Auto).unwrap(),
            Footprint::of(&fixture("tiny-qwen3"), to(QuantizeTo::Fp8), 0, Auto).unwrap(),
        ] {
            assert_eq!(f.decoder_matrices, w8.decoder_matrices);
            assert_eq!(f.decoder_format, "FP8 e4m3");
            assert_eq!(f.dequant_scratch, w8.dequant_scratch);
        }
    }
}
