//! A device backend checked against its CPU twin, op by op, on the same inputs.
//!
//! One [`Case`] is one op at one size; [`compare`] runs it on the CPU reference and on the
//! device and measures the difference. Two users:
//! - `tests/cuda_twin.rs` runs cases at the real Qwen3-VL-8B and ViT sizes on the GPU machine;
//! - [`self_check`] runs [`self_check_cases`] (small sizes that still reach every kernel and
//!   every branch in them) each time a GPU is opened for serving, so `--device cuda` never
//!   serves from kernels that disagree with the reference on the hardware at hand.
//!
//! Tolerances ([`Case::tolerance`]) are relative to the largest |CPU output|. Both sides
//! compute in f32; the device differs in summation order (cuBLAS blocking, warp reductions,
//! online softmax) and, where it uses tensor cores, in rounding operands to f16. Inputs that
//! meet an f16 weight are f16-exact, so both sides multiply the same values.

use crate::quant::{fp8, QuantMatrix, QuantizeTo};
use crate::{AttnMask, Backend, CpuBackend, Error, GeluKind, HostTensor, KvFormat, Result};

/// The FP8 caches' scale in the twin cases: not a power of two (so the scale is multiplied, not
/// only shifted), and with the cases' values (mostly within ±20) well inside e4m3's range
/// after dividing by it.
pub const FP8_KV: KvFormat = KvFormat::Fp8 { scale: 0.05 };

/// " fp8 (scale s)" for an FP8 cache, nothing for a native one.
fn kv_name(kv: KvFormat) -> String {
    match kv {
        KvFormat::Native => String::new(),
        KvFormat::Fp8 { scale } => format!(" fp8 (scale {scale})"),
    }
}

/// A case's weight matrix `[m, k]` from `input(shape, key)`: f16-exact, or quantized `int`
/// (both backends then hold the same values: the CPU's dequantized, the device's packed).
fn weight<B: Backend>(
    be: &B,
    shape: &[usize],
    key: u64,
    int: Option<QuantizeTo>,
) -> Result<B::Weight> {
    match int {
        None => be.upload_weight(&f16_exact(input(shape, key))),
        Some(to) => be.upload_quantized(&to.quantize(&input(shape, key))),
    }
}

fn int_name(int: Option<QuantizeTo>) -> &'static str {
    match int {
        None => "",
        Some(QuantizeTo::Int4) => " w4",
        Some(QuantizeTo::Int8) => " w8",
        Some(QuantizeTo::Fp8) => " fp8",
    }
}

/// One op at one size, with inputs that are a pure function of the case (the counter-based
/// random values of [`crate::random`], so no RNG state is shared between the two runs).
#[derive(Clone, Debug)]
pub enum Case {
    Add {
        rows: usize,
        cols: usize,
    },
    SiluMul {
        rows: usize,
        cols: usize,
    },
    Gelu {
        rows: usize,
        cols: usize,
        kind: GeluKind,
    },
    LayerNorm {
        rows: usize,
        cols: usize,
    },
    RmsNorm {
        rows: usize,
        cols: usize,
    },
    /// `[n, k] · [m, k]ᵀ (+ bias)`: up to 4 rows run the device's GEMV (decode), more its GEMM;
    /// `fused`, with the RMSNorm before it or the residual add after it in the same op.
    /// `int`: the weight quantized ([`QuantizeTo::quantize`], group 128), which the CPU
    /// dequantizes and the device reads packed.
    Linear {
        n: usize,
        k: usize,
        m: usize,
        bias: bool,
        fused: Fused,
        int: Option<QuantizeTo>,
    },
    /// An integer or FP8 weight (`to`) quantized in groups of `group` columns (FP8: blocks of
    /// 128 rows by `group` columns), through op `op` at `n` rows (past 4: the tensor-core
    /// integer GEMM wherever its shapes allow, else the dequantization and cuBLAS;
    /// `VLM_INT_GEMM=dequant` forces the latter).
    IntGemm {
        n: usize,
        k: usize,
        m: usize,
        to: QuantizeTo,
        group: usize,
        op: IntOp,
        /// The integer GEMM's blocks forced to this many weight rows (one of its block
        /// shapes, [`crate::cuda::with_int_gemm_rows`]), so that every shape is checked
        /// whichever this GPU would pick; `None`: the device's own choice. The CPU ignores it.
        block_rows: Option<usize>,
    },
    /// An integer weight (`to`, groups of 128) through op `op` at `n` rows past the integer
    /// GEMM's (its passes of 64), so dequantized for cuBLAS, `chunk_rows` weight rows at a time
    /// ([`crate::cuda::with_dequant_chunk_rows`]): the chunks an 8B model's gate/up and down
    /// take, at a size the startup check can afford. The CPU ignores the chunks.
    DequantGemm {
        n: usize,
        k: usize,
        m: usize,
        to: QuantizeTo,
        op: IntOp,
        chunk_rows: usize,
    },
    /// An FP8 weight in 128 x 128 blocks through op `op` (`Linear` or `AddLinear`) at `n` rows,
    /// with FP8 on W8A8 (every other case runs FP8 weight-only): on an H100, past 4 rows the
    /// W8A8 GEMM (activations quantized to e4m3, cuBLASLt with block scales), at 1-4 the GEMVs
    /// with their rows rounded as that GEMM rounds its own; elsewhere the weight-only path. Its
    /// inputs and weights are e4m3 values times powers of two with each 128-column group's largest at 448 times its power, so
    /// quantizing them changes nothing: W8A8 must match the CPU's W8A16 up to the sums' order,
    /// and a scale read from the wrong row, group or block cannot pass.
    W8a8 {
        n: usize,
        k: usize,
        m: usize,
        op: IntOp,
    },
    /// The fused gate/up/SwiGLU of the text MLP (`normed`: of the input's RMSNorm).
    Swiglu {
        n: usize,
        k: usize,
        m: usize,
        normed: bool,
        int: Option<QuantizeTo>,
    },
    /// The ViT attention's q, k and v: three biased projections (`m` outputs each) of one
    /// input's LayerNorm.
    LayerNormLinears {
        n: usize,
        k: usize,
        m: usize,
    },
    /// The ViT's pre-norm MLP with its residual: `x += fc2(gelu_tanh(fc1(layer_norm(x))))`,
    /// biases on both.
    LayerNormMlp {
        n: usize,
        k: usize,
        hidden: usize,
    },
    /// The ViT block's attention half with its residual: `x += proj(attention(rope(q),
    /// rope(k), v))` of q, k and v from one biased projection of `x`'s LayerNorm (`[n,
    /// hidden]`, `heads` of `dim`), each run of `lens` rows (an image) attending to itself.
    LayerNormRopeAttention {
        lens: Vec<usize>,
        hidden: usize,
        heads: usize,
        dim: usize,
    },
    /// The text decoder's MLP with its residual: `x += down(silu(gate) ⊙ up)` of the input's
    /// RMSNorm (gate and up stacked in one weight).
    RmsNormMlp {
        n: usize,
        k: usize,
        hidden: usize,
    },
    /// [`Case::RmsNormMlp`] with a planted massive activation: SwiGLU products of ~2.6e5, past
    /// f16's 65504 (Qwen3 models reach ~5e4 in a few channels), for `n` rows (past 4: the
    /// batched path, whose products are stored in f16).
    SwigluOutlier {
        n: usize,
    },
    Rope {
        tokens: usize,
        heads: usize,
        dim: usize,
    },
    /// Prefill / ViT attention: 16 queries and up run flash attention on the GPU.
    Attention {
        queries: usize,
        q_heads: usize,
        kv_heads: usize,
        dim: usize,
        slots: usize,
        kv_len: usize,
        mask: AttnMask,
    },
    /// Full attention within each of several images of one ViT pass.
    AttentionSegments {
        lens: Vec<usize>,
        heads: usize,
        dim: usize,
    },
    /// The ViT's attention from its fused q/k/v projection, RoPE included.
    RopeAttentionSegments {
        lens: Vec<usize>,
        heads: usize,
        dim: usize,
    },
    /// An engine step's attention over the paged cache: sequences of `(queries, keys)`, the
    /// first `decode` of them with one query (the GPU's split-K decode kernel), the rest
    /// prefill chunks (flash attention from 16 queries, the per-row kernel below). Blocks are
    /// handed out shuffled, as a long-running cache hands them out. `kv`: how the caches store
    /// (FP8: every kernel's `_f8` twin).
    PagedAttention {
        seqs: Vec<(usize, usize)>,
        decode: usize,
        q_heads: usize,
        kv_heads: usize,
        dim: usize,
        block_size: usize,
        kv: KvFormat,
    },
    /// A fused q/k/v projection's rows normed (Qwen3; not `normed`: Qwen2), rotated and
    /// written into the caches (stored as `kv` says).
    QkvToCache {
        tokens: usize,
        q_heads: usize,
        kv_heads: usize,
        dim: usize,
        normed: bool,
        kv: KvFormat,
    },
    /// Rows written into a cache (stored as `kv` says) at scattered slots read from the device.
    WriteKv {
        slots: usize,
        heads: usize,
        dim: usize,
        rows: usize,
        kv: KvFormat,
    },
    /// Greedy picks ([`Backend::sample_rows`] at temperature 0) over `rows` rows of `n`
    /// logits; `tie` puts the same largest value at two places of the last row.
    ArgmaxRows {
        rows: usize,
        n: usize,
        tie: Option<(usize, usize)>,
    },
    /// A step's draws ([`Backend::sample_rows`]) over `rows` rows of `vocab` logits, each row
    /// with other settings (greedy, temperature, top-k, top-p, min-p, penalties, bias,
    /// logprobs; [`sample_settings`]), twice, so the second draw sees the counts the first
    /// updated. The picks, the best tokens' ids and the count table must be equal.
    SampleRows {
        rows: usize,
        vocab: usize,
    },
    /// The same draws' raw logprobs (values from a log-sum-exp in another order).
    SampleLogprobs {
        rows: usize,
        vocab: usize,
    },
    /// Rows picked from a matrix by device ids (the rows whose logits a step needs).
    GatherRows {
        rows: usize,
        cols: usize,
    },
    Embedding {
        vocab: usize,
        width: usize,
    },
    WeightedGather {
        rows: usize,
        width: usize,
        out: usize,
        taps: usize,
    },
    /// `slice_rows`, `scatter_rows`, `add_rows` together, and that a tensor cloned before an
    /// in-place update keeps its values.
    RowUpdates,
    /// Image embeddings leaving a stage (`download_embeddings`) and entering the next
    /// (`upload_embeddings` of f16 rows, and of rows handed over on the device, and those
    /// downloaded again): the four results stacked.
    Embeddings {
        rows: usize,
        cols: usize,
    },
    /// Random-weight generation: bit for bit on every backend.
    RandomUniform {
        shape: Vec<usize>,
    },
    /// The ViT's patches of a `height`×`width` image of random bytes through a random table
    /// (Qwen3-VL's layout: 16-pixel patches, 2×2 merge windows, 2 frames).
    Patchify {
        height: usize,
        width: usize,
    },
    /// A decode-like step (embeddings of tokens read from the device, a GEMM, rows written
    /// into a cache at slots read from the device, attention over it, greedy picks) recorded
    /// once ([`Backend::record`]: a CUDA graph) and replayed twice with other tokens, slots
    /// and block lists written in between: the replays must read the new values and write
    /// where they say, as every batched decode step does. A text MLP's GEMVs follow the
    /// attention, as in a decode layer.
    RecordReplay,
}

/// How one case came out.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub case: String,
    /// Largest |device - cpu| (infinite if the device produced NaN or ∞ where the CPU did not).
    pub max_diff: f32,
    /// The difference allowed: tolerance × max(|cpu|, 1e-3).
    pub limit: f32,
}

impl Outcome {
    /// Compares two outputs of the same case.
    pub fn of(case: String, cpu: &HostTensor, device: &HostTensor, tolerance: f32) -> Self {
        let scale = cpu.data().iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let max_diff = if cpu.shape() != device.shape() {
            f32::INFINITY
        } else {
            // Not HostTensor::max_abs_diff: f32::max ignores NaN, and a NaN from a kernel is
            // the first thing this must catch.
            cpu.data()
                .iter()
                .zip(device.data())
                .map(|(c, d)| {
                    let diff = (c - d).abs();
                    if diff.is_nan() {
                        f32::INFINITY
                    } else {
                        diff
                    }
                })
                .fold(0.0, f32::max)
        };
        Outcome {
            case,
            max_diff,
            limit: tolerance * scale,
        }
    }

    pub fn passed(&self) -> bool {
        self.max_diff <= self.limit
    }

    /// How much of the allowed difference was used: 1 is at the tolerance (infinite for any
    /// difference in an exact case), for reporting how close a passing run came.
    pub fn share_of_allowed(&self) -> f32 {
        if self.max_diff == 0.0 {
            0.0
        } else if self.limit == 0.0 {
            f32::INFINITY
        } else {
            self.max_diff / self.limit
        }
    }
}

/// The op a [`Case::IntGemm`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntOp {
    /// `linear` with a bias: f32 out, the bias added by the GEMM.
    Linear,
    /// `add_linear` with a bias: added into a residual (accumulating, split k in order).
    AddLinear,
    /// `rms_norm_mlp`, gate/up and down (`[k, m]`) quantized alike: the gate/up product
    /// written in f16 (the SwiGLU's operand), the down one scaled by alpha and accumulated.
    Mlp,
}

/// What a [`Case::Linear`] does around its product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// `linear`.
    No,
    /// `rms_norm_linear`: the input's RMSNorm first.
    RmsNorm,
    /// `add_linear`: the product added into a residual stream.
    AddInto,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: max diff {:.2e} (allowed {:.2e})",
            self.case, self.max_diff, self.limit
        )
    }
}

impl Case {
    /// Every projection op at one size: `linear` with and without a bias, with the norm before
    /// it and the residual add after it, and SwiGLU plain and normed.
    pub fn linears(n: usize, k: usize, m: usize) -> Vec<Case> {
        Self::linears_of(n, k, m, None)
    }

    /// [`Case::linears`] with the weights quantized `to`.
    pub fn int_linears(n: usize, k: usize, m: usize, to: QuantizeTo) -> Vec<Case> {
        Self::linears_of(n, k, m, Some(to))
    }

    fn linears_of(n: usize, k: usize, m: usize, int: Option<QuantizeTo>) -> Vec<Case> {
        let linear = |bias, fused| Case::Linear {
            n,
            k,
            m,
            bias,
            fused,
            int,
        };
        vec![
            linear(false, Fused::No),
            linear(true, Fused::No),
            linear(false, Fused::RmsNorm),
            linear(true, Fused::RmsNorm),
            linear(false, Fused::AddInto),
            linear(true, Fused::AddInto),
            Case::Swiglu {
                n,
                k,
                m,
                normed: false,
                int,
            },
            Case::Swiglu {
                n,
                k,
                m,
                normed: true,
                int,
            },
        ]
    }

    /// A name that says the op and the size, for logs and failures.
    pub fn name(&self) -> String {
        match self {
            Case::Add { rows, cols } => format!("add [{rows},{cols}]"),
            Case::SiluMul { rows, cols } => format!("silu_mul [{rows},{cols}]"),
            Case::Gelu { rows, cols, kind } => format!("gelu {kind:?} [{rows},{cols}]"),
            Case::LayerNorm { rows, cols } => format!("layer_norm [{rows},{cols}]"),
            Case::RmsNorm { rows, cols } => format!("rms_norm [{rows},{cols}]"),
            Case::Linear {
                n,
                k,
                m,
                bias,
                fused,
                int,
            } => format!(
                "{}linear{} {n}x{k}->{m}{}",
                match fused {
                    Fused::No => "",
                    Fused::RmsNorm => "rms_norm_",
                    Fused::AddInto => "add_",
                },
                if *bias { "+bias" } else { "" },
                int_name(*int)
            ),
            Case::Swiglu {
                n,
                k,
                m,
                normed,
                int,
            } => format!(
                "{}swiglu {n}x{k}->{m}{}",
                if *normed { "rms_norm_" } else { "" },
                int_name(*int)
            ),
            Case::W8a8 { n, k, m, op } => format!("w8a8 {op:?} {n}x{k}->{m}"),
            Case::IntGemm {
                n,
                k,
                m,
                to,
                group,
                op,
                block_rows,
            } => format!(
                "int_gemm {op:?} {n}x{k}->{m}{} group {group}{}",
                int_name(Some(*to)),
                block_rows.map_or(String::new(), |r| format!(", blocks of {r} rows"))
            ),
            Case::DequantGemm {
                n,
                k,
                m,
                to,
                op,
                chunk_rows,
            } => format!(
                "dequantized gemm {op:?} {n}x{k}->{m}{}, chunks of {chunk_rows} rows",
                int_name(Some(*to))
            ),
            Case::LayerNormLinears { n, k, m } => format!("layer_norm_linears {n}x{k}->3x{m}"),
            Case::LayerNormMlp { n, k, hidden } => {
                format!("layer_norm_mlp {n}x{k}->{hidden}->{k}")
            }
            Case::LayerNormRopeAttention {
                lens,
                hidden,
                heads,
                dim,
            } => format!("layer_norm_rope_attention {lens:?} x{hidden} h{heads} d{dim}"),
            Case::RmsNormMlp { n, k, hidden } => {
                format!("rms_norm_mlp {n}x{k}->{hidden}->{k}")
            }
            Case::SwigluOutlier { n } => format!("rms_norm_mlp {n} rows, products of 2.6e5"),
            Case::Rope { tokens, heads, dim } => format!("rope [{tokens},{heads},{dim}]"),
            Case::Attention {
                queries,
                q_heads,
                kv_heads,
                dim,
                kv_len,
                mask,
                ..
            } => format!("attention q{queries} h{q_heads}/{kv_heads} d{dim} kv{kv_len} {mask:?}"),
            Case::AttentionSegments { lens, heads, dim } => {
                format!("attention_segments {lens:?} h{heads} d{dim}")
            }
            Case::RopeAttentionSegments { lens, heads, dim } => {
                format!("rope_attention_segments {lens:?} h{heads} d{dim}")
            }
            Case::PagedAttention {
                seqs,
                decode,
                q_heads,
                kv_heads,
                dim,
                block_size,
                kv,
            } => format!(
                "paged_attention {seqs:?} ({decode} decoding) h{q_heads}/{kv_heads} d{dim} blocks of {block_size}{}",
                kv_name(*kv)
            ),
            Case::WriteKv {
                slots,
                heads,
                dim,
                rows,
                kv,
            } => format!(
                "write_kv {rows} rows into [{slots},{heads},{dim}]{}",
                kv_name(*kv)
            ),
            Case::QkvToCache {
                tokens,
                q_heads,
                kv_heads,
                dim,
                normed,
                kv,
            } => format!(
                "qkv_to_cache {tokens} tokens h{q_heads}/{kv_heads} d{dim}{}{}",
                if *normed { "" } else { " (no q/k norm)" },
                kv_name(*kv)
            ),
            Case::ArgmaxRows { rows, n, tie } => {
                format!("argmax_rows {rows} x {n} (tie {tie:?})")
            }
            Case::GatherRows { rows, cols } => format!("gather_rows [{rows},{cols}]"),
            Case::Embedding { vocab, width } => format!("embedding [{vocab},{width}]"),
            Case::WeightedGather {
                rows,
                width,
                out,
                taps,
            } => format!("weighted_gather [{rows},{width}] -> {out} x{taps}"),
            Case::RowUpdates => "slice/write/scatter/add rows".into(),
            Case::SampleRows { rows, vocab } => format!("sample_rows {rows} x {vocab}"),
            Case::SampleLogprobs { rows, vocab } => {
                format!("sample_rows' logprobs {rows} x {vocab}")
            }
            Case::RandomUniform { shape } => format!("random_uniform {shape:?}"),
            Case::Patchify { height, width } => format!("patchify a {width}x{height} image"),
            Case::Embeddings { rows, cols } => format!("embeddings down and up [{rows},{cols}]"),
            Case::RecordReplay => "record once, replay with new inputs".into(),
        }
    }

    /// The allowed difference relative to the largest |CPU output|, and why.
    pub fn tolerance(&self) -> f32 {
        match self {
            // Exact on every backend: gathers, copies, comparisons, integer hashing; FP8 cache
            // writes too (the same reciprocal scale, the same nearest-even rounding).
            Case::WriteKv { .. }
            | Case::ArgmaxRows { .. }
            | Case::SampleRows { .. }
            | Case::GatherRows { .. }
            | Case::Embedding { .. }
            | Case::RowUpdates
            | Case::RandomUniform { .. }
            | Case::Patchify { .. } => 0.0,
            // GEMMs, attention and copies: summation order only (f16-exact operands).
            Case::RecordReplay => 1e-4,
            // A log-sum-exp over the vocabulary in another order, and the device's expf/logf.
            Case::SampleLogprobs { .. } => 1e-5,
            // One rounding per element, or a short sum.
            Case::Add { .. } | Case::WeightedGather { .. } => 1e-6,
            // A GPU downloads embeddings rounded to f16 (2^-11 of each value at most), where
            // the CPU keeps f32; f16 rows upload exactly on both, handed-over rows are kept.
            Case::Embeddings { .. } => 1e-3,
            // Transcendentals: the device's expf/tanhf/erff are within a few ulp.
            Case::SiluMul { .. } | Case::Gelu { .. } | Case::Rope { .. } => 1e-5,
            // Reductions over a row, in another order.
            Case::LayerNorm { .. } | Case::RmsNorm { .. } => 1e-4,
            // The integer GEMM multiplies the same f16 weights the dequantization writes ((q -
            // zero) exact in f16, one rounding of the product by the f16 scale) by the same f16
            // activations, in f32 with the sums in another order (k split into ordered
            // partial sums): the dequantized path's bound, 2^-11 of each weight and of x. FP8's
            // f32 scale is rounded to f16 first: another 2^-11 at most, one factor per row and
            // group (weights_f16.cu, int_mma_gemm). The MLP rounds its gate/up product and
            // SwiGLU to f16 on the way as RmsNormMlp does.
            Case::IntGemm { .. } | Case::DequantGemm { .. } => 3e-3,
            // The same products on every path, the sums in another order: cuBLASLt's FP8
            // kernels scale each 128-column block's sum into f32, but within a block Hopper's
            // FP8 tensor cores keep fewer accumulator bits than f32 (about 14, DeepSeek-V3's
            // report), hence more than the f16 GEMMs' 1e-4.
            Case::W8a8 { .. } => 1e-3,
            // Past 4 rows an integer weight reaches the tensor cores as f16 (2^-11 of each
            // weight; FP8's through the integer GEMM 2^-10), and a normed input rounded to f16
            // too.
            Case::Linear {
                n, int: Some(_), ..
            }
            | Case::Swiglu {
                n, int: Some(_), ..
            } if *n > 4 => 3e-3,
            // Past the GEMV's 4 rows the normed input goes to the tensor cores rounded to f16
            // (2^-11 relative per element; an f16-exact input is not after the norm).
            Case::Linear {
                n,
                fused: Fused::RmsNorm,
                ..
            }
            | Case::Swiglu {
                n, normed: true, ..
            } if *n > 4 => 2e-3,
            // Past 4 rows the norm's output goes to the tensor cores rounded to f16, and the
            // MLP's hidden activations too (after the GELU, as the op-by-op path casts them).
            Case::LayerNormLinears { n, .. } | Case::LayerNormMlp { n, .. } if *n > 4 => 2e-3,
            // Past 4 rows the text MLP's norm, its gate/up product and the SwiGLU are each
            // rounded to f16 as the next GEMM's operand: three roundings of 2^-11 on the way.
            Case::RmsNormMlp { n, .. } if *n > 4 => 3e-3,
            // The same roundings, and the products stored scaled (exactly, by a power of two).
            Case::SwigluOutlier { .. } => 3e-3,
            // Up to 4 rows the GEMVs read the f32 norm: sums in another order, hidden of 4304.
            Case::LayerNormLinears { .. } => 1e-4,
            Case::LayerNormMlp { .. } | Case::RmsNormMlp { .. } => 2e-4,
            // Long dot products in another order; k >= 4096 sums are long enough to need more.
            Case::Linear { k, .. } | Case::Swiglu { k, .. } => {
                if *k >= 4096 {
                    2e-4
                } else {
                    1e-4
                }
            }
            // Flash attention rounds Q (scaled), K, V and the probabilities to f16 for the
            // tensor cores (2^-11 relative each) and accumulates in f32; fewer queries run the
            // f32 kernel, which differs in summation order only.
            Case::Attention { queries, .. } => {
                if *queries >= 16 {
                    2e-3
                } else {
                    1e-4
                }
            }
            Case::AttentionSegments { lens, .. } => {
                if lens.iter().any(|&l| l >= 16) {
                    2e-3
                } else {
                    1e-4
                }
            }
            // Flash attention for every run, however short (the GPU packs all rows at once).
            Case::RopeAttentionSegments { .. } => 2e-3,
            // Flash attention as above (Q, K, V and the probabilities rounded to f16); past 4
            // rows also the norm, the q/k/v GEMM's output (before RoPE, so q and k are rounded
            // twice) and the attention's output (the projection's operand): 2^-11 relative
            // each, a few more roundings on the way to every output than flash alone. Up to 4
            // rows the GEMVs read and write f32.
            Case::LayerNormRopeAttention { lens, .. } => {
                if lens.iter().sum::<usize>() > 4 {
                    3e-3
                } else {
                    2e-3
                }
            }
            // Normed, rotated keys rounded to f16 in the cache (2^-11 relative).
            Case::QkvToCache {
                kv: KvFormat::Native,
                ..
            } => 1e-3,
            // Rounded to e4m3: the two sides' f32 keys differ in their last bits (summation
            // order of the norm, FMA in the rotation), and one that lies that close to a
            // rounding boundary of e4m3 takes the neighbouring value, one e4m3 step away: 2^-3
            // of it at most (steps are 2^-3 of the binade's low end). At the 8B model's sizes
            // (a million keys a case) that happens.
            Case::QkvToCache { .. } => 0.125,
            // The cache holds f16-exact keys and values on both sides; prefill chunks of 16
            // queries and more also round Q and the probabilities to f16 (flash attention).
            Case::PagedAttention { seqs, decode, .. } => {
                if seqs[*decode..].iter().any(|&(q, _)| q >= 16) {
                    2e-3
                } else {
                    1e-4
                }
            }
        }
    }

    /// Runs the case on `be` and returns its output on the host.
    pub fn run<B: Backend>(&self, be: &B) -> Result<HostTensor> {
        // FP8 weights' GEMMs: weight-only, as the CPU computes them, in every case but W8a8's
        // (whose operands the activations' quantization leaves as they are).
        use crate::cuda::{with_fp8_gemm, Fp8Gemm};
        let mode = match self {
            Case::W8a8 { .. } => Fp8Gemm::W8a8,
            _ => Fp8Gemm::W8a16,
        };
        with_fp8_gemm(mode, || self.run_op(be))
    }

    fn run_op<B: Backend>(&self, be: &B) -> Result<HostTensor> {
        let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
        let out = match *self {
            Case::Add { rows, cols } => be.add(&up(&[rows, cols], 1)?, &up(&[rows, cols], 2)?)?,
            Case::SiluMul { rows, cols } => {
                be.silu_mul(&up(&[rows, cols], 3)?, &up(&[rows, cols], 4)?)?
            }
            Case::Gelu { rows, cols, kind } => be.gelu(&up(&[rows, cols], 5)?, kind)?,
            Case::Embeddings { rows, cols } => return embeddings_down_and_up(be, rows, cols),
            Case::LayerNorm { rows, cols } => be.layer_norm(
                &up(&[rows, cols], 6)?,
                &up(&[cols], 7)?,
                &up(&[cols], 8)?,
                1e-6,
            )?,
            Case::RmsNorm { rows, cols } => {
                be.rms_norm(&up(&[rows, cols], 9)?, &up(&[cols], 10)?, 1e-6)?
            }
            Case::Linear {
                n,
                k,
                m,
                bias,
                fused,
                int,
            } => {
                let x = be.upload(&f16_exact(input(&[n, k], 11)))?;
                let w = weight(be, &[m, k], 12, int)?;
                let b = if bias { Some(up(&[m], 13)?) } else { None };
                match fused {
                    Fused::No => be.linear(&x, &w, b.as_ref())?,
                    Fused::RmsNorm => {
                        be.rms_norm_linear(&x, &up(&[k], 10)?, 1e-6, &w, b.as_ref())?
                    }
                    Fused::AddInto => {
                        let mut residual = up(&[n, m], 1)?;
                        be.add_linear(&mut residual, &x, &w, b.as_ref())?;
                        residual
                    }
                }
            }
            Case::Swiglu {
                n,
                k,
                m,
                normed,
                int,
            } => {
                let x = be.upload(&f16_exact(input(&[n, k], 14)))?;
                let gate = weight(be, &[m, k], 15, int)?;
                let upw = weight(be, &[m, k], 16, int)?;
                let gate_up = be.stack_weights(&[&gate, &upw])?;
                if normed {
                    be.rms_norm_swiglu(&x, &up(&[k], 10)?, 1e-6, &gate_up)?
                } else {
                    be.swiglu(&x, &gate_up)?
                }
            }
            Case::LayerNormLinears { n, k, m } => return layer_norm_linears(be, n, k, m),
            Case::LayerNormMlp { n, k, hidden } => layer_norm_mlp(be, n, k, hidden)?,
            Case::LayerNormRopeAttention {
                ref lens,
                hidden,
                heads,
                dim,
            } => layer_norm_rope_attention(be, lens, hidden, heads, dim)?,
            Case::RmsNormMlp { n, k, hidden } => rms_norm_mlp(be, n, k, hidden)?,
            Case::IntGemm {
                n,
                k,
                m,
                to,
                group,
                op,
                block_rows,
            } => crate::cuda::with_int_gemm_rows(block_rows, || {
                int_gemm(be, n, k, m, to, group, op)
            })?,
            Case::DequantGemm {
                n,
                k,
                m,
                to,
                op,
                chunk_rows,
            } => crate::cuda::with_dequant_chunk_rows(Some(chunk_rows), || {
                int_gemm(be, n, k, m, to, 128, op)
            })?,
            Case::W8a8 { n, k, m, op } => w8a8(be, n, k, m, op)?,
            Case::SwigluOutlier { n } => swiglu_outlier(be, n)?,
            Case::Rope { tokens, heads, dim } => be.rope(
                &up(&[tokens, heads, dim], 17)?,
                &up(&[tokens, dim], 18)?,
                &up(&[tokens, dim], 19)?,
            )?,
            Case::Attention {
                queries,
                q_heads,
                kv_heads,
                dim,
                slots,
                kv_len,
                mask,
            } => be.attention(
                &up(&[queries, q_heads, dim], 20)?,
                &up(&[slots, kv_heads, dim], 21)?,
                &up(&[slots, kv_heads, dim], 22)?,
                kv_len,
                mask,
            )?,
            Case::AttentionSegments {
                ref lens,
                heads,
                dim,
            } => {
                let n = lens.iter().sum();
                be.attention_segments(
                    &up(&[n, heads, dim], 23)?,
                    &up(&[n, heads, dim], 24)?,
                    &up(&[n, heads, dim], 25)?,
                    lens,
                )?
            }
            Case::RopeAttentionSegments {
                ref lens,
                heads,
                dim,
            } => {
                let n = lens.iter().sum();
                be.rope_attention_segments(
                    &up(&[n, 3 * heads * dim], 26)?,
                    heads,
                    [&up(&[n, dim], 27)?, &up(&[n, dim], 28)?],
                    lens,
                )?
            }
            Case::PagedAttention {
                ref seqs,
                decode,
                q_heads,
                kv_heads,
                dim,
                block_size,
                kv,
            } => {
                return paged_attention(be, seqs, decode, [q_heads, kv_heads, dim], block_size, kv)
            }
            Case::QkvToCache {
                tokens,
                q_heads,
                kv_heads,
                dim,
                normed,
                kv,
            } => return qkv_to_cache(be, [tokens, q_heads, kv_heads, dim], normed, kv),
            Case::WriteKv {
                slots,
                heads,
                dim,
                rows,
                kv,
            } => {
                let mut cache = be.zeros_cache(slots, heads, dim, kv)?;
                // Scattered, distinct slots.
                let at: Vec<u32> = (0..rows).map(|i| ((i * 7 + 3) % slots) as u32).collect();
                let values = be.upload(&f16_exact(input(&[rows, heads, dim], 26)))?;
                be.write_kv(&mut cache, &be.upload_ids(&at)?, &values)?;
                return be.download_cache(&cache);
            }
            Case::ArgmaxRows { rows, n, tie } => return argmax_rows(be, rows, n, tie),
            Case::SampleRows { rows, vocab } => return Ok(sample_case(be, rows, vocab)?.0),
            Case::SampleLogprobs { rows, vocab } => return Ok(sample_case(be, rows, vocab)?.1),
            Case::GatherRows { rows, cols } => {
                let x = up(&[rows, cols], 27)?;
                let pick: Vec<u32> = [rows - 1, 0, rows / 2, rows - 1].map(|r| r as u32).into();
                be.gather_rows(&x, &be.upload_ids(&pick)?)?
            }
            Case::Embedding { vocab, width } => {
                let table = be.upload_weight(&f16_exact(input(&[vocab, width], 29)))?;
                // Repeats, the first and the last row.
                let ids = [3, 0, vocab - 1, 3, vocab / 2].map(|i| i as u32);
                be.embedding(&table, &be.upload_ids(&ids)?)?
            }
            Case::WeightedGather {
                rows,
                width,
                out,
                taps,
            } => {
                let index: Vec<u32> = (0..out * taps).map(|i| (i * 37 % rows) as u32).collect();
                let weights: Vec<f32> = (0..out * taps).map(|i| (i % 7) as f32 / 7.0).collect();
                be.weighted_gather(&up(&[rows, width], 30)?, &index, &weights, taps)?
            }
            Case::RowUpdates => return row_updates(be),
            Case::RandomUniform { ref shape } => be.random_uniform(shape, 34, 0.027)?,
            Case::Patchify { height, width } => patchify(be, height, width)?,
            Case::RecordReplay => return record_and_replay(be),
        };
        be.download(&out)
    }
}

/// [`Case::Embeddings`]: the embeddings downloaded, uploaded as f16, handed over and
/// uploaded, and downloaded again, stacked.
fn embeddings_down_and_up<B: Backend>(be: &B, rows: usize, cols: usize) -> Result<HostTensor> {
    let x = input(&[rows, cols], 14);
    let down = be.download_embeddings(&be.upload(&x)?)?;
    let halves = crate::Embeddings::F16(crate::HalfTensor::from_f32(&x));
    let up = be.download(&be.upload_embeddings(&halves)?)?;
    let handed = be.hand_off(be.upload(&x)?, b"twin".to_vec())?;
    let kept = be.download(&be.upload_embeddings(&handed)?)?;
    let back = be.embeddings_to_host(&handed)?;
    HostTensor::concat_rows(&[
        down.to_f32()?.into_owned(),
        up,
        kept,
        back.to_f32()?.into_owned(),
    ])
}

/// [`Case::LayerNormLinears`]: the three projections' outputs, one after the other.
fn layer_norm_linears<B: Backend>(be: &B, n: usize, k: usize, m: usize) -> Result<HostTensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let x = up(&[n, k], 48)?;
    let (gamma, beta) = (up(&[k], 49)?, up(&[k], 50)?);
    let norm = crate::LayerNormParams {
        w: &gamma,
        b: &beta,
        eps: 1e-6,
    };
    let w = (51..54)
        .map(|key| be.upload_weight(&f16_exact(input(&[m, k], key))))
        .collect::<Result<Vec<_>>>()?;
    let b = (54..57)
        .map(|key| up(&[m], key))
        .collect::<Result<Vec<_>>>()?;
    let projections: Vec<_> = w
        .iter()
        .zip(&b)
        .map(|(w, b)| crate::Projection { w, b: Some(b) })
        .collect();
    let mut all = Vec::new();
    for t in be.layer_norm_linears(&x, norm, &projections)? {
        all.extend(be.download(&t)?.into_data());
    }
    HostTensor::new(vec![all.len()], all)
}

/// [`Case::LayerNormMlp`]: its input after the MLP and the residual.
fn layer_norm_mlp<B: Backend>(be: &B, n: usize, k: usize, hidden: usize) -> Result<B::Tensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let mut x = up(&[n, k], 57)?;
    let (gamma, beta) = (up(&[k], 58)?, up(&[k], 59)?);
    let norm = crate::LayerNormParams {
        w: &gamma,
        b: &beta,
        eps: 1e-6,
    };
    // Scaled as a trained layer's are: GELU's inputs stay within a few units.
    let fc1 = be.upload_weight(&f16_exact(scaled_input(&[hidden, k], 60)))?;
    let fc2 = be.upload_weight(&f16_exact(scaled_input(&[k, hidden], 61)))?;
    let (b1, b2) = (up(&[hidden], 62)?, up(&[k], 63)?);
    be.layer_norm_mlp(
        &mut x,
        norm,
        crate::Projection {
            w: &fc1,
            b: Some(&b1),
        },
        GeluKind::Tanh,
        crate::Projection {
            w: &fc2,
            b: Some(&b2),
        },
    )?;
    Ok(x)
}

/// [`Case::LayerNormRopeAttention`]: its input after the attention and the residual.
fn layer_norm_rope_attention<B: Backend>(
    be: &B,
    lens: &[usize],
    hidden: usize,
    heads: usize,
    dim: usize,
) -> Result<B::Tensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let (n, width) = (lens.iter().sum(), heads * dim);
    let mut x = up(&[n, hidden], 80)?;
    let (gamma, beta) = (up(&[hidden], 81)?, up(&[hidden], 82)?);
    let norm = crate::LayerNormParams {
        w: &gamma,
        b: &beta,
        eps: 1e-6,
    };
    // Scaled as a trained layer's are: q, k and v stay near unit size, and so do
    // the scores (a softmax of large scores would turn f16 roundings into big
    // changes of its weights).
    let qkv = be.upload_weight(&f16_exact(scaled_input(&[3 * width, hidden], 83)))?;
    let proj = be.upload_weight(&f16_exact(scaled_input(&[hidden, width], 84)))?;
    let (qkv_b, proj_b) = (up(&[3 * width], 85)?, up(&[hidden], 86)?);
    let (cos, sin) = (up(&[n, dim], 87)?, up(&[n, dim], 88)?);
    let attn = crate::AttentionWeights {
        qkv: crate::Projection {
            w: &qkv,
            b: Some(&qkv_b),
        },
        heads,
        proj: crate::Projection {
            w: &proj,
            b: Some(&proj_b),
        },
    };
    be.layer_norm_rope_attention(&mut x, norm, attn, [&cos, &sin], lens)?;
    Ok(x)
}

/// [`Case::RmsNormMlp`]: its input after the MLP and the residual.
fn rms_norm_mlp<B: Backend>(be: &B, n: usize, k: usize, hidden: usize) -> Result<B::Tensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let mut x = up(&[n, k], 64)?;
    // Scaled as a trained layer's are: the SwiGLU's inputs stay within a few units.
    let gate = be.upload_weight(&f16_exact(scaled_input(&[hidden, k], 65)))?;
    let upw = be.upload_weight(&f16_exact(scaled_input(&[hidden, k], 66)))?;
    let gate_up = be.stack_weights(&[&gate, &upw])?;
    let down = be.upload_weight(&f16_exact(scaled_input(&[k, hidden], 67)))?;
    be.rms_norm_mlp(&mut x, &up(&[k], 10)?, 1e-6, &gate_up, &down)?;
    Ok(x)
}

/// [`Case::IntGemm`]: weights scaled as a trained layer's (so the MLP's SwiGLU inputs stay
/// within a few units), quantized in groups of `group`.
fn int_gemm<B: Backend>(
    be: &B,
    n: usize,
    k: usize,
    m: usize,
    to: QuantizeTo,
    group: usize,
    op: IntOp,
) -> Result<B::Tensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let int = |shape: [usize; 2], key: u64| {
        let w = scaled_input(&shape, key);
        be.upload_quantized(&match to {
            QuantizeTo::Fp8 => QuantMatrix::Fp8(fp8::quantize_fp8_in_blocks(&w, [128, group])),
            _ => QuantMatrix::Int(to.quantize_int_grouped(&w, group)),
        })
    };
    let x = up(&[n, k], 80)?;
    match op {
        IntOp::Linear => be.linear(&x, &int([m, k], 81)?, Some(&up(&[m], 82)?)),
        IntOp::AddLinear => {
            let mut residual = up(&[n, m], 83)?;
            be.add_linear(&mut residual, &x, &int([m, k], 81)?, Some(&up(&[m], 82)?))?;
            Ok(residual)
        }
        IntOp::Mlp => {
            let gate_up = be.stack_weights(&[&int([m, k], 84)?, &int([m, k], 85)?])?;
            let down = int([k, m], 86)?;
            let mut x = x;
            be.rms_norm_mlp(&mut x, &up(&[k], 10)?, 1e-6, &gate_up, &down)?;
            Ok(x)
        }
    }
}

/// [`Case::W8a8`]'s operands: x `[n, k]` whose every group of 128 columns is e4m3 values
/// times 2^e with its largest 448 x 2^e (e from -9 to -6 by row and group: amax 0.9 to 7),
/// and FP8 weights `[m, k]` of random e4m3 bytes with a power-of-two scale per 128 x 128 block
/// (2^-10 to 2^-12): every value exact in f16 and unchanged by the activations' quantization.
fn w8a8<B: Backend>(be: &B, n: usize, k: usize, m: usize, op: IntOp) -> Result<B::Tensor> {
    let byte = |i: usize, key: u64| {
        let b = (crate::random::bits(key, i as u64) >> 56) as u8;
        if fp8::e4m3_is_nan(b) {
            0
        } else {
            b
        }
    };
    let x: Vec<f32> = (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let pow = 2f32.powi(-6 - ((r + 3 * (c / fp8::ACT_GROUP)) % 4) as i32);
            let v = if c % fp8::ACT_GROUP == r % fp8::ACT_GROUP {
                if r % 2 == 0 {
                    fp8::E4M3_MAX
                } else {
                    -fp8::E4M3_MAX
                }
            } else {
                fp8::E4M3[byte(i, 90) as usize]
            };
            v * pow
        })
        .collect();
    let grid = [m.div_ceil(128), k.div_ceil(128)];
    let w = fp8::Fp8Matrix {
        out: m,
        inp: k,
        block: [128, 128],
        q: (0..m * k).map(|i| byte(i, 91)).collect(),
        scales: (0..grid[0] * grid[1])
            .map(|b| 2f32.powi(-10 - (b % 3) as i32))
            .collect(),
    };
    let w = be.upload_quantized(&QuantMatrix::Fp8(w))?;
    let x = be.upload(&HostTensor::new(vec![n, k], x)?)?;
    let bias = be.upload(&input(&[m], 92))?;
    match op {
        IntOp::Linear => be.linear(&x, &w, Some(&bias)),
        IntOp::AddLinear => {
            let mut residual = be.upload(&input(&[n, m], 93))?;
            be.add_linear(&mut residual, &x, &w, Some(&bias))?;
            Ok(residual)
        }
        IntOp::Mlp => Err(Error::shape(
            "twin case w8a8",
            "the MLP's activations are computed, not e4m3-exact",
        )),
    }
}

/// [`Case::SwigluOutlier`]: positive inputs normed and scaled by 32, gate and up weights of
/// 0.25 over 64 columns (each ~512, so silu(gate) * up ~2.6e5), down weights of 2^-10 (outputs
/// ~4e3, well within f16 and f32). Every weight is f16-exact.
fn swiglu_outlier<B: Backend>(be: &B, n: usize) -> Result<B::Tensor> {
    let (k, hidden) = (64, 16);
    let x = input(&[n, k], 70);
    let positive: Vec<f32> = x.data().iter().map(|v| 1.0 + 0.5 * v.abs()).collect();
    let mut x = be.upload(&HostTensor::new(vec![n, k], positive)?)?;
    let filled =
        |shape: [usize; 2], v: f32| HostTensor::new(shape.to_vec(), vec![v; shape[0] * shape[1]]);
    let gate = be.upload_weight(&filled([hidden, k], 0.25)?)?;
    let upw = be.upload_weight(&filled([hidden, k], 0.25)?)?;
    let gate_up = be.stack_weights(&[&gate, &upw])?;
    let down = be.upload_weight(&filled([k, hidden], 1.0 / 1024.0)?)?;
    let norm = be.upload(&HostTensor::new(vec![k], vec![32.0; k])?)?;
    be.rms_norm_mlp(&mut x, &norm, 1e-6, &gate_up, &down)?;
    Ok(x)
}

/// [`Case::QkvToCache`]: the queries, then both caches.
fn qkv_to_cache<B: Backend>(
    be: &B,
    [tokens, q_heads, kv_heads, dim]: [usize; 4],
    normed: bool,
    kv: KvFormat,
) -> Result<HostTensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let slots = tokens * 3 + 5;
    let mut k = be.zeros_cache(slots, kv_heads, dim, kv)?;
    let mut v = be.zeros_cache(slots, kv_heads, dim, kv)?;
    let at: Vec<u32> = (0..tokens).map(|i| ((i * 3 + 2) % slots) as u32).collect();
    let (q_norm, k_norm) = (up(&[dim], 43)?, up(&[dim], 44)?);
    let qk_norm = normed.then_some(crate::QkNorm {
        q: &q_norm,
        k: &k_norm,
        eps: 1e-6,
    });
    let (cos, sin) = (up(&[tokens, dim], 45)?, up(&[tokens, dim], 46)?);
    let ids = be.upload_ids(&at)?;
    let how = crate::QkvToCache {
        q_heads,
        qk_norm,
        cos: &cos,
        sin: &sin,
        slots: &ids,
    };
    let qkv = up(&[tokens, (q_heads + 2 * kv_heads) * dim], 47)?;
    let q = be.qkv_to_cache(&qkv, &how, &mut k, &mut v)?;
    let mut all = be.download(&q)?.into_data();
    all.extend(be.download_cache(&k)?.into_data());
    all.extend(be.download_cache(&v)?.into_data());
    HostTensor::new(vec![all.len()], all)
}

/// [`Case::ArgmaxRows`]: each row's pick.
fn argmax_rows<B: Backend>(
    be: &B,
    rows: usize,
    n: usize,
    tie: Option<(usize, usize)>,
) -> Result<HostTensor> {
    let mut logits = input(&[rows, n], 28);
    if let Some((a, b)) = tie {
        let last = (rows - 1) * n;
        logits.data_mut()[last + a] = 5.0;
        logits.data_mut()[last + b] = 5.0;
    }
    let greedy = vec![crate::sampling::RowParams::default(); rows];
    let mut picks = crate::sampling::SampleBuffers::new(be, n, &greedy, &[], &[], &[])?;
    picks.sample(be, &be.upload(&logits)?)?;
    let ids = be.download_ids(&picks.picks, rows)?;
    HostTensor::new(vec![rows], ids.iter().map(|&i| i as f32).collect())
}

/// [`Case::RowUpdates`]: the updated tensor, the one it was cloned from, and a slice.
fn row_updates<B: Backend>(be: &B) -> Result<HostTensor> {
    let up = |shape: &[usize], key: u64| be.upload(&input(shape, key));
    let (rows, x0, extra) = (
        up(&[3, 1024], 31)?,
        up(&[6, 1024], 32)?,
        up(&[2, 1024], 33)?,
    );
    let mut x = x0.clone();
    be.scatter_rows(&mut x, &[5, 0], &extra)?;
    be.add_rows(&mut x, &[1, 5], &extra)?;
    be.scatter_rows(&mut x, &[2, 4, 3], &rows)?;
    let parts = [
        be.download(&x)?,
        // Untouched by the in-place updates of the tensor cloned from it.
        be.download(&x0)?,
        be.download(&be.slice_rows(&x, 2, 5)?)?,
    ];
    HostTensor::concat_rows(&parts)
}

/// [`Case::Patchify`]: the patches.
fn patchify<B: Backend>(be: &B, height: usize, width: usize) -> Result<B::Tensor> {
    // Bytes from a multiplicative hash: every value 0..=255 turns up.
    let bytes: Vec<u8> = (0..height * width * 3)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let layout = crate::patches::PatchLayout {
        patch: 16,
        merge: 2,
        temporal: 2,
    };
    let table = input(&[crate::patches::TABLE_LEN], 35);
    be.patchify(&bytes, height, width, table.data(), layout)
}

/// The inputs of [`Case::PagedAttention`]: a cache of shuffled blocks holding f16-exact keys
/// and values, queries for every sequence's last `queries` positions; returns the output.
fn paged_attention<B: Backend>(
    be: &B,
    seqs: &[(usize, usize)],
    decode: usize,
    [q_heads, kv_heads, dim]: [usize; 3],
    block_size: usize,
    kv: KvFormat,
) -> Result<HostTensor> {
    let blocks_each: Vec<usize> = seqs.iter().map(|&(_, k)| k.div_ceil(block_size)).collect();
    let total_blocks: usize = blocks_each.iter().sum::<usize>() + 3;
    let slots = total_blocks * block_size;
    // A fixed shuffle of the blocks (block 0 left unused, as the engine's null block).
    let mut order: Vec<u32> = (1..total_blocks as u32).collect();
    for i in (1..order.len()).rev() {
        let j =
            (crate::random::uniform(7, i as u64, 1.0).abs() * (i + 1) as f32) as usize % (i + 1);
        order.swap(i, j);
    }
    let all_slots: Vec<u32> = (0..slots as u32).collect();
    let slots_ids = be.upload_ids(&all_slots)?;
    let mut k = be.zeros_cache(slots, kv_heads, dim, kv)?;
    let mut v = be.zeros_cache(slots, kv_heads, dim, kv)?;
    let fill = |key| be.upload(&f16_exact(input(&[slots, kv_heads, dim], key)));
    be.write_kv(&mut k, &slots_ids, &fill(40)?)?;
    be.write_kv(&mut v, &slots_ids, &fill(41)?)?;
    let (mut meta, mut blocks, mut row) = (Vec::new(), Vec::new(), 0);
    let mut next = order.iter();
    for (&(queries, keys), &nb) in seqs.iter().zip(&blocks_each) {
        meta.extend([row, queries, keys, blocks.len()].map(|v| v as u32));
        blocks.extend(next.by_ref().take(nb));
        row += queries;
    }
    let q = be.upload(&input(&[row, q_heads, dim], 42))?;
    let (seqs_ids, block_ids) = (be.upload_ids(&meta)?, be.upload_ids(&blocks)?);
    let batch = crate::PagedBatch {
        seqs: &seqs_ids,
        blocks: &block_ids,
        num_seqs: seqs.len(),
        decode_seqs: decode,
        max_queries: seqs.iter().map(|s| s.0).max().unwrap_or(0),
        max_keys: seqs.iter().map(|s| s.1).max().unwrap_or(0),
        block_size,
    };
    be.download(&be.paged_attention(&q, &k, &v, &batch)?)
}

/// [`Case::RecordReplay`]: what a batched decode step (`TextModel::decode`) relies on, in
/// miniature: two sequences, blocks of 4 slots.
fn record_and_replay<B: Backend>(be: &B) -> Result<HostTensor> {
    let (vocab, width, heads, dim, bs, hidden) = (64, 256, 2, 64, 4, 192);
    let table = be.upload_weight(&f16_exact(input(&[vocab, width], 35)))?;
    let w = be.upload_weight(&f16_exact(input(&[heads * dim, width], 36)))?;
    let norm = be.upload(&input(&[heads * dim], 37))?;
    let gate_up = be.upload_weight(&f16_exact(scaled_input(&[2 * hidden, heads * dim], 38)))?;
    let down = be.upload_weight(&f16_exact(scaled_input(&[heads * dim, hidden], 39)))?;
    let mut tokens = be.upload_ids(&[0, 0])?;
    let mut slots = be.upload_ids(&[0, 0])?;
    let mut seqs = be.upload_ids(&[0; 8])?;
    let mut blocks = be.upload_ids(&[0; 8])?;
    let mut cache = be.zeros_cache(8 * bs, heads, dim, KvFormat::Native)?;
    let mut out = be.zeros(&[2, heads * dim])?;
    let greedy = [crate::sampling::RowParams::default(); 2];
    let mut picks = crate::sampling::SampleBuffers::new(be, heads * dim, &greedy, &[], &[], &[])?;
    let step = |tokens: &B::Ids,
                slots: &B::Ids,
                seqs: &B::Ids,
                blocks: &B::Ids,
                cache: &mut B::Cache,
                out: &mut B::Tensor,
                picks: &mut crate::sampling::SampleBuffers<B>| {
        let y = be.linear(&be.embedding(&table, tokens)?, &w, None)?;
        be.write_kv(cache, slots, &y)?;
        let batch = crate::PagedBatch {
            seqs,
            blocks,
            num_seqs: 2,
            decode_seqs: 2,
            max_queries: 1,
            max_keys: 8,
            block_size: bs,
        };
        let q = be.reshape(y, &[2, heads, dim])?;
        let a = be.paged_attention(&q, cache, cache, &batch)?;
        // A text MLP on the attention's rows: GEMVs one after another, as in a decode layer
        // (on sm_90 under programmatic dependent launch, each replay handing rows out anew).
        let mut a = be.reshape(a, &[2, heads * dim])?;
        let h = be.rms_norm_swiglu(&a, &norm, 1e-6, &gate_up)?;
        be.add_linear(&mut a, &h, &down, None)?;
        picks.sample(be, &a)?;
        be.copy(out, &a)
    };
    // Backends that do not record (the CPU) run the step directly each time instead.
    let graph = be.record(&mut || {
        step(
            &tokens, &slots, &seqs, &blocks, &mut cache, &mut out, &mut picks,
        )
    })?;
    let mut parts = Vec::new();
    // Step 1: sequence A's first token at block 5 slot 0; B's third token at block 2 slot 2
    // (its first two keys were never written: zeros). Step 2: each one key further on.
    // (tokens, slots, sequences, block lists)
    let steps: [(_, _, _, [u32; 3]); 2] = [
        ([5, 63], [20, 10], [0, 1, 1, 0, 1, 1, 3, 1], [5, 2, 0]),
        ([17, 1], [21, 11], [0, 1, 2, 0, 1, 1, 4, 1], [5, 2, 0]),
    ];
    for (t, s, m, b) in steps {
        be.write_ids(&mut tokens, &t)?;
        be.write_ids(&mut slots, &s)?;
        be.write_ids(&mut seqs, &m)?;
        be.write_ids(&mut blocks, &b)?;
        match &graph {
            Some(g) => be.replay(g)?,
            None => step(
                &tokens, &slots, &seqs, &blocks, &mut cache, &mut out, &mut picks,
            )?,
        }
        parts.push(be.download(&out)?);
        let p = be.download_ids(&picks.picks, 2)?;
        parts.push(HostTensor::new(
            vec![1, heads * dim],
            (0..heads * dim)
                .map(|i| p.get(i).map_or(0.0, |&v| v as f32))
                .collect(),
        )?);
    }
    HostTensor::concat_rows(&parts)
}

/// The settings of row `r` of a [`Case::SampleRows`]: every path of the rule in turn.
pub fn sample_settings(r: usize) -> crate::sampling::RowParams {
    use crate::sampling::RowParams;
    let t = |temperature| RowParams {
        temperature,
        ..Default::default()
    };
    let mut p = match r % 11 {
        0 => t(0.0),
        1 => t(1.0),
        // Qwen3-VL's recommended settings.
        2 => RowParams {
            top_k: 20,
            top_p: 0.8,
            presence_penalty: 1.5,
            slot: 0,
            ..t(0.7)
        },
        // top-p over the whole vocabulary (no top-k to shrink it first).
        3 => RowParams {
            top_p: 0.9,
            ..t(0.7)
        },
        4 => RowParams {
            min_p: 0.1,
            ..t(1.0)
        },
        // Few enough left after top-k for shared memory, and too many.
        5 => RowParams {
            top_k: 1000,
            ..t(0.6)
        },
        6 => RowParams {
            top_k: 4000,
            top_p: 0.95,
            ..t(0.8)
        },
        // Greedy with penalties (prompt tokens too).
        7 => RowParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            slot: 0,
            ..t(0.0)
        },
        8 => RowParams {
            logprobs: 1 + 5,
            bias_len: 2,
            ..t(1.0)
        },
        9 => RowParams {
            top_k: 50,
            logprobs: 1 + 20,
            ..t(1.2)
        },
        _ => RowParams {
            top_p: 0.5,
            logprobs: 1,
            ..t(0.05)
        },
    };
    p.seed = 1234 + r as u64;
    p.position = 100 + r as u32;
    p
}

/// [`Case::SampleRows`] and [`Case::SampleLogprobs`]: the exact outputs (both draws' picks,
/// the best tokens' ids, the count table) and the logprobs.
fn sample_case<B: Backend>(be: &B, rows: usize, vocab: usize) -> Result<(HostTensor, HostTensor)> {
    use crate::sampling::{IN_PROMPT, MAX_TOP_LOGPROBS, NO_SLOT};
    // Logits spread as a model's are (a few units), with peaks every 997 tokens.
    let mut logits = input(&[rows, vocab], 40);
    for (i, v) in logits.data_mut().iter_mut().enumerate() {
        *v *= 4.0;
        if i % 997 == 5 {
            *v += 6.0;
        }
    }
    // The last two rows (past the 11 of sample_settings' paths, where the cases have 13) have
    // no finite largest logit: NaN everywhere (what an overflowed activation leaves) and an
    // infinity. Both must give NOT_FINITE and count nothing. Their logprobs are not compared
    // (the device writes them, the CPU does not).
    let mut params: Vec<_> = (0..rows).map(sample_settings).collect();
    let lost = rows.saturating_sub(2)..rows;
    for r in lost.clone() {
        let row = &mut logits.data_mut()[r * vocab..(r + 1) * vocab];
        if r + 1 == rows {
            row.fill(f32::NAN);
        } else {
            row[3 % vocab] = f32::INFINITY;
        }
        params[r].logprobs = 0;
    }
    let mut slots = 0;
    let mut bias = Vec::new();
    // Every third row keeps to a grammar's mask: about a fifth of the tokens, never the best.
    let words = crate::sampling::mask_words(vocab);
    let mut masks = vec![0u32; rows * words];
    for (r, p) in params.iter_mut().enumerate() {
        if r % 3 == 2 && !lost.contains(&r) {
            p.masked = true;
            let best = crate::argmax(logits.row(r)) as usize;
            for t in (0..vocab).filter(|&t| t != best) {
                if (t as u32).wrapping_mul(2_654_435_761) >> 29 < 2 {
                    masks[r * words + t / 32] |= 1 << (t % 32);
                }
            }
        }
        if p.slot != NO_SLOT {
            p.slot = slots;
            slots += 1;
        }
        if p.bias_len > 0 {
            // Ban the best token, favour token 7.
            let best = crate::argmax(logits.row(r));
            p.bias_start = (bias.len()) as u32;
            bias.extend([(best, -100.0), (7 % vocab as u32, 5.0)]);
        }
    }
    // Some tokens in the prompt, some generated before.
    let counts: Vec<u32> = (0..slots as usize * vocab)
        .map(|i| match i % 101 {
            0 => IN_PROMPT,
            1 => 2,
            2 => IN_PROMPT | 1,
            _ => 0,
        })
        .collect();
    let x = be.upload(&logits)?;
    let mut bufs = crate::sampling::SampleBuffers::new(be, vocab, &params, &bias, &masks, &counts)?;
    let (mut exact, mut values) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let words: Vec<u32> = params.iter().flat_map(|p| p.to_words()).collect();
        be.write_ids(&mut bufs.params, &words)?;
        bufs.sample(be, &x)?;
        exact.extend(be.download_ids(&bufs.picks, rows)?);
        let ids = be.download_ids(&bufs.top_ids, rows * MAX_TOP_LOGPROBS)?;
        let lp = be.download(&bufs.logprobs)?;
        for (r, p) in params.iter_mut().enumerate() {
            if p.logprobs > 0 {
                let n = p.logprobs as usize;
                exact.extend(&ids[r * MAX_TOP_LOGPROBS..][..n - 1]);
                values.extend(&lp.row(r)[..n]);
            }
            p.position += 1;
        }
    }
    // Counts with the prompt bit moved to bit 20 (f32 holds every such value exactly).
    let table = be.download_ids(&bufs.counts, slots as usize * vocab)?;
    exact.extend(
        table
            .iter()
            .map(|&c| (c & !IN_PROMPT) | if c & IN_PROMPT != 0 { 1 << 20 } else { 0 }),
    );
    let exact = HostTensor::new(vec![exact.len()], exact.iter().map(|&v| v as f32).collect())?;
    let values = HostTensor::new(vec![values.len()], values)?;
    Ok((exact, values))
}

/// The inputs of a case: uniform in [-1, 1), a pure function of (shape, key).
fn input(shape: &[usize], key: u64) -> HostTensor {
    crate::random::uniform_tensor(shape, crate::random::tensor_key(key, "twin"), 1.0)
}

/// A weight matrix `[out, in]` of [`input`]'s values over sqrt(in), as a trained layer's are
/// scaled: its products with unit-sized inputs stay within a few units.
fn scaled_input(shape: &[usize], key: u64) -> HostTensor {
    let mut t = input(shape, key);
    let s = 1.0 / (shape[1] as f32).sqrt();
    t.data_mut().iter_mut().for_each(|v| *v *= s);
    t
}

/// `t` with every value rounded to the nearest f16: the weights the GPU stores (and the
/// activations its tensor-core GEMMs multiply them with), so the CPU sees the same operands.
pub fn f16_exact(t: HostTensor) -> HostTensor {
    let shape = t.shape().to_vec();
    let data = t
        .into_data()
        .into_iter()
        .map(|v| half::f16::from_f32(v).to_f32())
        .collect();
    HostTensor::new(shape, data).expect("same length")
}

/// Runs `case` on the CPU reference and on `device` and compares them.
pub fn compare<B: Backend>(device: &B, case: &Case) -> Result<Outcome> {
    let cpu = case.run(&CpuBackend::new())?;
    let dev = case.run(device)?;
    Ok(Outcome::of(case.name(), &cpu, &dev, case.tolerance()))
}

/// Small sizes that reach every device kernel and the branches inside them: LayerNorm a warp a
/// row (1152 columns) and a block a row (4096, and 7), both GEMV paths (k a multiple of 8 or
/// not) and the GEMM, the ViT's attention half fused and op by op, flash attention at every padded head dim (64, 80,
/// 96, 128) with full, causal and cached-prefix masks and the f32 attention below 16 queries,
/// paged attention over shuffled blocks (split-K decode with one and many splits, flash and
/// per-row prefill chunks, mixed batches), cache writes, the vocabulary-sized argmax with a
/// tie, and a batched decode step recorded once and replayed with new inputs.
/// Sized to run in about a second on the CPU side.
pub fn self_check_cases() -> Vec<Case> {
    use Case::*;
    let causal = |first_query_slot| AttnMask::Causal { first_query_slot };
    let mut cases = Vec::new();
    for (rows, cols) in [(3, 1152), (1, 4096), (2, 7)] {
        cases.extend([
            Add { rows, cols },
            SiluMul { rows, cols },
            Gelu {
                rows,
                cols,
                kind: GeluKind::Tanh,
            },
            Gelu {
                rows,
                cols,
                kind: GeluKind::Erf,
            },
            LayerNorm { rows, cols },
            RmsNorm { rows, cols },
        ]);
    }
    // Small transfers go directly, large ones (past 256 KiB) through page-locked memory.
    cases.extend([
        Embeddings { rows: 2, cols: 7 },
        Embeddings {
            rows: 64,
            cols: 4096,
        },
    ]);
    for (n, k, m) in [
        (1, 4096, 512),
        (4, 1024, 300),
        (2, 4100, 9),
        (3, 7, 5),
        (33, 1152, 200),
    ] {
        cases.extend(Case::linears(n, k, m));
    }
    // Integer and FP8 weights: each GEMV (odd output counts: a warp's second row missing), and
    // past 4 rows the integer GEMM (k = 256: two stages).
    for to in [QuantizeTo::Int4, QuantizeTo::Int8, QuantizeTo::Fp8] {
        // k = 96 is no whole batch of the tensor-core GEMVs (128 columns at 4 bits, 64 at 8):
        // the CUDA-core ones take it.
        for (n, k, m) in [
            (1, 1024, 301),
            (4, 512, 64),
            (2, 384, 7),
            (3, 96, 9),
            (9, 256, 40),
        ] {
            cases.extend(Case::int_linears(n, k, m, to));
        }
    }
    // The tensor-core integer GEMM past 4 rows, small enough for the startup check: n-tiles 1, 2,
    // 8 (5, 16, 40 and 64 rows: tiles part empty; 80 in two passes), odd m (a block's last rows
    // missing), k of 16 stages (split: their ordered adds), groups of 32 (4 a stage), 64, 128,
    // 256 and a whole row, the MLP's f16 gate/up output; the group-128 ops of int_linears at 16
    // rows too. FP8 as W4 and W8 (blocks of 128 rows by the group's columns). First with the
    // block shape and k splits this GPU picks, then on each block shape (forced), split and
    // not. Which split is `self_check_splits_k_on_every_block_shape` in int_weights.rs. Real
    // sizes in cuda/tests/cuda_twin.rs (int_gemm_at_real_sizes).
    for to in [QuantizeTo::Int4, QuantizeTo::Int8, QuantizeTo::Fp8] {
        cases.extend(Case::int_linears(16, 1024, 256, to));
        let int_gemm = |n, k, m, group, op, block_rows| IntGemm {
            n,
            k,
            m,
            to,
            group,
            op,
            block_rows,
        };
        // 80 rows: two passes of the GEMM (64, then 16).
        for (n, k, m, group) in [
            (5, 512, 301, 32),
            (16, 1024, 256, 128),
            (40, 2048, 777, 32),
            (64, 1024, 1000, 64),
            (80, 512, 301, 32),
            // Groups of two stages and of a whole row (channel-wise), k split: a split's first
            // group is counted from its first stage, and on from there.
            (24, 1024, 300, 256),
            (12, 1536, 200, 1536),
        ] {
            for op in [IntOp::Linear, IntOp::AddLinear] {
                cases.push(int_gemm(n, k, m, group, op, None));
            }
        }
        // The MLP: gate/up in f16 out (k of 16 stages: split), down (k = 256, unsplit) scaled
        // by alpha and accumulating.
        cases.push(int_gemm(24, 2048, 256, 32, IntOp::Mlp, None));
        // Each block shape: k split (16 stages) with accumulate and the bias, at 64 rows; then
        // unsplit (4 stages and fewer) with the bias, at 33 rows, and the MLP at 9.
        for rows in [256, 192, 128] {
            cases.extend([
                int_gemm(64, 2048, 300, 32, IntOp::AddLinear, Some(rows)),
                int_gemm(33, 512, 200, 64, IntOp::Linear, Some(rows)),
                int_gemm(9, 512, 384, 128, IntOp::Mlp, Some(rows)),
            ]);
        }
    }
    // Past the integer GEMM's 128 rows (two passes of 64) W4 and W8 weights are dequantized
    // for cuBLAS a chunk of rows at a time: here 160 rows of 384 (two whole, a short last), the
    // bias added apart; the MLP's gate/up [768, 256] in 5 and down [256, 384] in 2.
    for to in [QuantizeTo::Int4, QuantizeTo::Int8] {
        for op in [IntOp::Linear, IntOp::AddLinear, IntOp::Mlp] {
            cases.push(DequantGemm {
                n: 136,
                k: 256,
                m: 384,
                to,
                op,
                chunk_rows: 160,
            });
        }
    }
    // FP8 weights' W8A8 GEMM (an H100's, past 4 rows): k of 2 groups, of 5 (the block
    // scales' rows padded to 8) and of 1; output columns a whole block, a partial last block
    // (208 = 128 + 80) and two; the bias broadcast first, a residual accumulated; then 3 rows
    // and 1 (the GEMVs).
    cases.extend([
        W8a8 {
            n: 80,
            k: 256,
            m: 384,
            op: IntOp::Linear,
        },
        W8a8 {
            n: 96,
            k: 640,
            m: 208,
            op: IntOp::AddLinear,
        },
        W8a8 {
            n: 130,
            k: 128,
            m: 256,
            op: IntOp::Linear,
        },
        W8a8 {
            n: 5,
            k: 384,
            m: 128,
            op: IntOp::AddLinear,
        },
        // Decode's GEMVs of the same weights, their rows rounded as the GEMM rounds its own
        // (an identity on these e4m3-exact rows, unless a scale or group is misplaced).
        W8a8 {
            n: 3,
            k: 384,
            m: 128,
            op: IntOp::AddLinear,
        },
        W8a8 {
            n: 1,
            k: 256,
            m: 384,
            op: IntOp::Linear,
        },
    ]);
    // The ViT block's fused halves: cuBLASLt epilogues past 4 rows, the GEMVs below.
    for (n, k, m) in [(33, 1152, 200), (3, 64, 40)] {
        cases.extend([
            LayerNormLinears { n, k, m },
            LayerNormMlp { n, k, hidden: m },
        ]);
    }
    // The ViT block's attention half: fused past 4 rows (two images, one shorter than a query
    // tile; a head dim whose halves are odd, 70, takes the pack's one-pair-a-thread path), op by
    // op below.
    for (lens, hidden, heads, dim) in [
        (vec![20, 13], 288, 4, 72),
        (vec![9, 30], 140, 2, 70),
        (vec![3], 64, 2, 32),
    ] {
        cases.push(LayerNormRopeAttention {
            lens,
            hidden,
            heads,
            dim,
        });
    }
    // The text MLP: f16 operands past 4 rows (8 columns a thread of the SwiGLU, and 1 where the
    // hidden size is not a multiple of 8), the GEMVs below.
    for (n, k, hidden) in [(33, 1024, 200), (9, 64, 36), (3, 64, 40)] {
        cases.push(RmsNormMlp { n, k, hidden });
    }
    // Products past f16's range, through the batched path (stored scaled) and the GEMVs (f32).
    cases.extend([SwigluOutlier { n: 9 }, SwigluOutlier { n: 2 }]);
    cases.extend([
        Rope {
            tokens: 3,
            heads: 8,
            dim: 128,
        },
        Rope {
            tokens: 5,
            heads: 4,
            dim: 72,
        },
    ]);
    for (queries, q_heads, kv_heads, dim, slots, kv_len, mask) in [
        (48, 8, 2, 128, 64, 48, causal(0)),
        (20, 8, 2, 128, 64, 50, causal(30)),
        (40, 4, 4, 72, 40, 40, AttnMask::Full),
        (17, 4, 2, 96, 17, 17, AttnMask::Full),
        (33, 4, 2, 16, 33, 33, AttnMask::Full),
        (7, 4, 2, 32, 9, 9, causal(2)),
        (1, 8, 2, 128, 40, 31, causal(30)),
    ] {
        cases.push(Attention {
            queries,
            q_heads,
            kv_heads,
            dim,
            slots,
            kv_len,
            mask,
        });
    }
    cases.extend([
        AttentionSegments {
            lens: vec![20, 36, 4],
            heads: 4,
            dim: 72,
        },
        AttentionSegments {
            lens: vec![5, 3],
            heads: 2,
            dim: 32,
        },
        // The ViT's fused path: several images of one pass (runs shorter than a query tile
        // included), a head dim with no padding, ones to pad (70, whose halves are odd, takes
        // the pack's one pair a thread; the others two).
        RopeAttentionSegments {
            lens: vec![20, 36, 4, 70],
            heads: 4,
            dim: 72,
        },
        RopeAttentionSegments {
            lens: vec![65],
            heads: 2,
            dim: 80,
        },
        RopeAttentionSegments {
            lens: vec![5, 3],
            heads: 2,
            dim: 32,
        },
        RopeAttentionSegments {
            lens: vec![9, 30],
            heads: 2,
            dim: 70,
        },
    ]);
    // Paged attention: decode-only batches with long contexts (split-K with many splits, one
    // split, a key count off the block grid), mixed batches whose prefill chunks take flash
    // attention (16+ queries, every padded head dim) or the per-row kernel, GQA groups of
    // 1, 2, 4 and 8, the 8B shapes (32/8 heads of 128), blocks of 16; each over f16 caches and
    // over FP8 ones (every kernel's `_f8` twin), as are the cache writes below.
    for (seqs, decode, q_heads, kv_heads, dim, block_size) in [
        (vec![(1, 4096), (1, 600)], 2, 32, 8, 128, 16),
        (vec![(1, 1); 6], 6, 32, 8, 128, 16),
        (vec![(1, 70), (1, 3), (40, 90), (17, 17)], 2, 32, 8, 128, 16),
        (vec![(1, 33), (5, 20), (3, 3)], 1, 8, 2, 64, 16),
        (vec![(1, 300), (20, 50)], 1, 16, 2, 32, 8),
        (vec![(30, 30), (64, 100)], 0, 4, 4, 80, 16),
        (vec![(1, 200), (18, 40)], 1, 4, 2, 96, 16),
        (vec![(2, 9)], 0, 6, 3, 40, 4),
        // Decode kernels compiled for 1 and for 4 heads per KV head, the latter given 3 (the
        // fourth head skipped); keys that end mid-way through a warp's group of loads.
        (vec![(1, 90), (1, 5)], 2, 4, 4, 128, 16),
        (vec![(1, 150), (1, 7), (1, 66)], 3, 12, 4, 64, 16),
        // The kernel for 8 heads a KV head given 7 (Qwen2.5-7B's 28 of 4), over f16 and FP8.
        (vec![(1, 45), (1, 6)], 2, 28, 4, 128, 16),
    ] {
        for kv in [KvFormat::Native, FP8_KV] {
            cases.push(PagedAttention {
                seqs: seqs.clone(),
                decode,
                q_heads,
                kv_heads,
                dim,
                block_size,
                kv,
            });
        }
    }
    for kv in [KvFormat::Native, FP8_KV] {
        cases.extend([
            QkvToCache {
                tokens: 3,
                q_heads: 32,
                kv_heads: 8,
                dim: 128,
                normed: true,
                kv,
            },
            QkvToCache {
                tokens: 5,
                q_heads: 4,
                kv_heads: 2,
                dim: 40,
                normed: true,
                kv,
            },
            // Qwen2.5-7B's heads: 28 q, 4 kv, 128 wide, no q/k norm.
            QkvToCache {
                tokens: 3,
                q_heads: 28,
                kv_heads: 4,
                dim: 128,
                normed: false,
                kv,
            },
            WriteKv {
                slots: 600,
                heads: 8,
                dim: 128,
                rows: 37,
                kv,
            },
            // An odd head dim on the native cache; FP8's kernels take even ones (refused
            // otherwise: check_kv_format), so its case is the next even one.
            WriteKv {
                slots: 50,
                heads: 3,
                dim: if kv == KvFormat::Native { 5 } else { 6 },
                rows: 7,
                kv,
            },
        ]);
    }
    cases.extend([
        ArgmaxRows {
            rows: 1,
            n: 151_936,
            tie: None,
        },
        ArgmaxRows {
            rows: 3,
            n: 151_936,
            tie: Some((70_000, 90_000)),
        },
        ArgmaxRows {
            rows: 5,
            n: 7,
            tie: None,
        },
        SampleRows {
            rows: 13,
            vocab: 5000,
        },
        SampleLogprobs {
            rows: 13,
            vocab: 5000,
        },
        GatherRows { rows: 9, cols: 700 },
        Embedding {
            vocab: 1000,
            width: 512,
        },
        WeightedGather {
            rows: 576,
            width: 64,
            out: 50,
            taps: 4,
        },
        RowUpdates,
        RandomUniform {
            shape: vec![1000, 513],
        },
        Patchify {
            height: 64,
            width: 96,
        },
        RecordReplay,
    ]);
    cases
}

/// Runs [`self_check_cases`] on `device` (reporting each outcome to `progress`) and fails on
/// the first case outside its tolerance, naming it.
pub fn self_check<B: Backend>(device: &B, mut progress: impl FnMut(&Outcome)) -> Result<()> {
    for case in self_check_cases() {
        let outcome = compare(device, &case).map_err(|e| Error::SelfCheck {
            backend: device.name(),
            what: format!("{} failed to run: {e}", case.name()),
        })?;
        progress(&outcome);
        if !outcome.passed() {
            return Err(Error::SelfCheck {
                backend: device.name(),
                what: format!("{outcome}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A case the CUDA backend refuses to run fails the whole startup self-check ("failed to
    /// run"), so every FP8 cache case has a head dim the FP8 kernels take: even, at most 256
    /// (CudaBackend::check_kv_format). One with head dim 5 once stopped every `--device cuda`
    /// start; the CPU, which takes any dim, cannot catch that by running the cases.
    #[test]
    fn every_fp8_cache_case_of_the_self_check_has_a_head_dim_the_gpu_takes() {
        let mut fp8 = 0;
        for case in self_check_cases() {
            let (dim, kv) = match case {
                Case::WriteKv { dim, kv, .. }
                | Case::QkvToCache { dim, kv, .. }
                | Case::PagedAttention { dim, kv, .. } => (dim, kv),
                _ => continue,
            };
            if let KvFormat::Fp8 { .. } = kv {
                fp8 += 1;
                assert!(dim % 2 == 0 && dim <= 256, "{}", case.name());
            }
        }
        assert!(fp8 > 0, "the self-check has FP8 cache cases");
    }

    #[test]
    fn the_cpu_passes_its_own_self_check_exactly() {
        // The same inputs on the same backend: every case reproduces bit for bit, which is
        // what makes a nonzero difference on a device mean something.
        let mut n = 0;
        self_check(&CpuBackend::new(), |o| {
            assert_eq!(o.max_diff, 0.0, "{o}");
            n += 1;
        })
        .unwrap();
        assert_eq!(n, self_check_cases().len());
    }

    #[test]
    fn a_difference_past_the_tolerance_or_a_nan_fails() {
        let cpu = HostTensor::new(vec![4], vec![1.0, -2.0, 0.5, 0.0]).unwrap();
        let with = |i: usize, v: f32| {
            let mut t = cpu.clone();
            t.data_mut()[i] = v;
            t
        };
        // Allowed: 1e-4 of the largest |value| (2.0).
        assert!(Outcome::of("ok".into(), &cpu, &with(2, 0.5 + 1.9e-4), 1e-4).passed());
        assert!(!Outcome::of("off".into(), &cpu, &with(2, 0.5 + 2.1e-4), 1e-4).passed());
        assert!(!Outcome::of("nan".into(), &cpu, &with(3, f32::NAN), 1e-4).passed());
        assert!(!Outcome::of("inf".into(), &cpu, &with(0, f32::INFINITY), 1e-4).passed());
        let short = HostTensor::new(vec![3], vec![1.0, -2.0, 0.5]).unwrap();
        assert!(!Outcome::of("shape".into(), &cpu, &short, 1.0).passed());
        // Exact cases allow nothing.
        assert!(!Outcome::of("exact".into(), &cpu, &with(0, 1.0 + 1e-7), 0.0).passed());
        // How close a run came, for the logs and vlm doctor.
        let near = Outcome::of("near".into(), &cpu, &with(2, 0.5 + 1.5e-4), 1e-4);
        assert!((near.share_of_allowed() - 0.75).abs() < 0.01, "{near}");
        assert_eq!(
            Outcome::of("same".into(), &cpu, &cpu, 0.0).share_of_allowed(),
            0.0
        );
        let off = Outcome::of("off".into(), &cpu, &with(0, 1.0 + 1e-7), 0.0);
        assert_eq!(off.share_of_allowed(), f32::INFINITY);
    }

    #[test]
    fn every_case_has_a_distinct_name() {
        let names: std::collections::BTreeSet<String> =
            self_check_cases().iter().map(Case::name).collect();
        assert_eq!(names.len(), self_check_cases().len());
    }
}
