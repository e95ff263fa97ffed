//! The Qwen3-VL text decoder, written once against [`Backend`]; with its differences as
//! configuration ([`TextConfig`]) it is also Qwen3's and Qwen2's.
//!
//! Reference: transformers `models/qwen3_vl/modeling_qwen3_vl.py` (`Qwen3VLTextModel`,
//! `Qwen3VLForConditionalGeneration`), `models/qwen3/modeling_qwen3.py` and
//! `models/qwen2/modeling_qwen2.py`. Per layer:
//! ```text
//! h = RMSNorm(x);  q, k, v = h·Wq, h·Wk, h·Wv   (GQA: fewer k/v heads; one GEMM, the three
//!                                               matrices stacked at load)
//! q, k = M-RoPE(RMSNorm_head(q)), M-RoPE(RMSNorm_head(k));  append k, v to the KV cache
//! x += Wo · attn(q, K, V)  (causal);  x += W_down · (silu(h·W_gate) ⊙ h·W_up) with h = RMSNorm(x)
//!                                               (gate and up stacked: one GEMM)
//! after layer i < len(DeepStack): x[image positions] += DeepStack feature i
//! ```
//! and at the end `logits = lm_head(RMSNorm(x_last))`. Image embeddings replace the placeholder
//! tokens' embeddings before layer 0.
//!
//! Qwen3 (`Qwen3ForCausalLM`) is this decoder without images, its weights under `model.*`
//! instead of `model.language_model.*`, and 1-D RoPE (M-RoPE whose three streams are equal).
//! Qwen2 (`Qwen2ForCausalLM`) is Qwen3 with biases on q, k and v and no q/k norm.

use vlm_compute::nn::Linear;
use vlm_compute::{Backend, PagedBatch, QkNorm, QkvToCache, WeightPrefix, Weights};

use crate::kv_cache::PagedKv;
use crate::{ModelConfig, Result, TextConfig};

/// A step's image tokens: their rows in the step, their embeddings (which replace the
/// placeholder tokens' before layer 0) and DeepStack features (one `[rows, hidden]` per early
/// layer, added after it).
pub struct ImageRows<'a, B: Backend> {
    pub rows: &'a [usize],
    pub embeds: &'a B::Tensor,
    pub deepstack: &'a [B::Tensor],
}

/// One forward pass over the tokens of several sequences at once (an engine step): every row
/// is one token of one sequence, each row's keys and values go to its cache slot, and each
/// sequence's queries attend to its own cached keys ([`PagedBatch`]).
pub struct StepInput<'a, B: Backend> {
    /// `[rows]` token ids.
    pub ids: &'a B::Ids,
    /// `[rows, head_dim]` rotary tables at each row's M-RoPE position.
    pub cos: &'a B::Tensor,
    pub sin: &'a B::Tensor,
    /// `[rows]` cache slot of each row.
    pub slots: &'a B::Ids,
    pub attn: PagedBatch<'a, B>,
    pub images: Option<ImageRows<'a, B>>,
    pub logits: LogitsOf<'a, B>,
}

/// Which rows' logits a step computes.
pub enum LogitsOf<'a, B: Backend> {
    /// None: every sequence in the step is mid-prompt.
    Nothing,
    /// Every row (a decode step: each row is a sequence's last).
    AllRows,
    /// These rows (each sampling sequence's last).
    Rows(&'a B::Ids),
}

struct Attention<B: Backend> {
    /// q, k and v stacked: `[(heads + 2 kv_heads) head_dim, hidden]`.
    qkv: Linear<B>,
    o: Linear<B>,
    /// Per-head RMSNorm weights of q and k; `None` where the model has none (Qwen2).
    qk_norm: Option<(B::Tensor, B::Tensor)>,
    heads: usize,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    fn new(be: &B, w: &WeightPrefix, c: &TextConfig) -> Result<Self> {
        let (h, d) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (q, k, v) = (w.pp("q_proj"), w.pp("k_proj"), w.pp("v_proj"));
        let qkv_parts = [(&q, nq * d), (&k, nkv * d), (&v, nkv * d)];
        let qk_norm = if c.qk_norm {
            Some((
                w.load(be, "q_norm.weight", &[d])?,
                w.load(be, "k_norm.weight", &[d])?,
            ))
        } else {
            None
        };
        Ok(Self {
            qkv: Linear::load_stacked(be, &qkv_parts, h, c.qkv_bias)?,
            o: Linear::load(be, &w.pp("o_proj"), h, nq * d, c.o_bias)?,
            qk_norm,
            heads: nq,
            eps: c.rms_norm_eps,
        })
    }

    /// The step's rows through attention, added to the residual stream `x`: q, k, v in one
    /// GEMM of the normed rows (`input_norm`); k and v into the cache (at their slots) with q
    /// and k normed and rotated on the way; then each sequence's queries over its cached keys,
    /// whose projection is added to `x`.
    fn forward(
        &self,
        be: &B,
        x: &mut B::Tensor,
        input_norm: &B::Tensor,
        step: &StepInput<B>,
        k_cache: &mut B::Cache,
        v_cache: &mut B::Cache,
    ) -> vlm_compute::Result<()> {
        let qkv = self.qkv.forward_normed(be, x, input_norm, self.eps)?;
        let how = QkvToCache {
            q_heads: self.heads,
            qk_norm: self.qk_norm.as_ref().map(|(q, k)| QkNorm {
                q,
                k,
                eps: self.eps,
            }),
            cos: step.cos,
            sin: step.sin,
            slots: step.slots,
        };
        let q = be.qkv_to_cache(&qkv, &how, k_cache, v_cache)?;
        let a = be.paged_attention(&q, k_cache, v_cache, &step.attn)?;
        self.o.forward_add(be, &a, x)
    }
}

struct DecoderLayer<B: Backend> {
    input_norm: B::Tensor,
    attn: Attention<B>,
    post_attn_norm: B::Tensor,
    /// gate and up stacked: `[2 intermediate, hidden]`.
    gate_up: Linear<B>,
    down: Linear<B>,
    eps: f32,
}

impl<B: Backend> DecoderLayer<B> {
    /// The layer on the residual stream `x`: each half's norm is taken inside the projection
    /// that reads it, and its output added to `x` by the projection that makes it
    /// ([`Backend::rms_norm_linear`], [`Backend::add_linear`], [`Backend::rms_norm_mlp`]): on
    /// a GPU a decoding layer is six launches (q/k/v, their norms and cache write, attention,
    /// o, gate/up, down).
    fn forward(
        &self,
        be: &B,
        x: &mut B::Tensor,
        step: &StepInput<B>,
        kv: (&mut B::Cache, &mut B::Cache),
    ) -> vlm_compute::Result<()> {
        self.attn
            .forward(be, x, &self.input_norm, step, kv.0, kv.1)?;
        let (gate_up, down) = (self.gate_up.weight(), self.down.weight());
        be.rms_norm_mlp(x, &self.post_attn_norm, self.eps, gate_up, down)
    }

    fn new(be: &B, w: &WeightPrefix, c: &TextConfig) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            input_norm: w.load(be, "input_layernorm.weight", &[h])?,
            attn: Attention::new(be, &w.pp("self_attn"), c)?,
            post_attn_norm: w.load(be, "post_attention_layernorm.weight", &[h])?,
            gate_up: Linear::load_stacked(
                be,
                &[(&w.pp("mlp.gate_proj"), i), (&w.pp("mlp.up_proj"), i)],
                h,
                false,
            )?,
            down: Linear::load(be, &w.pp("mlp.down_proj"), h, i, false)?,
            eps: c.rms_norm_eps,
        })
    }
}

pub struct TextModel<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Tensor,
    lm_head: B::Weight,
    /// `lm_head` is `embed_tokens` (a tied checkpoint that stores none).
    tied_head: bool,
}

impl<B: Backend> TextModel<B> {
    pub fn new(cfg: ModelConfig, weights: &Weights, backend: B) -> Result<Self> {
        let be = &backend;
        let c = &cfg.text;
        let w = weights.pp(cfg.architecture.decoder_prefix());
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed_tokens = w.load_weight(be, "embed_tokens.weight", &[v, h])?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::new(be, &w.pp("layers").pp(i), c))
            .collect::<Result<Vec<_>>>()?;
        let norm = w.load(be, "norm.weight", &[h])?;
        // Tied checkpoints (the small Qwen3-VL, Qwen3 and Qwen2.5 sizes) store no lm_head.
        let head = weights.pp("lm_head");
        // Random weights answer for every name: they stand for a checkpoint that stores
        // lm_head exactly when its config does not tie it (so a tied size benched with them
        // holds and reads one table, as it would served).
        let stored = if weights.is_random() {
            !cfg.tie_word_embeddings
        } else {
            head.contains("weight") || weights.quant_config().is_some_and(|q| q.holds(&head))
        };
        let tied_head = cfg.tie_word_embeddings && !stored;
        // By the config, as `vlm doctor` tells (a tied checkpoint's head is the table).
        if let Some(why) = cfg.lm_head_quantize_refusal() {
            if weights.quantizing_lm_head() {
                return Err(vlm_compute::Error::Quantized {
                    name: head.name("weight"),
                    problem: why.into(),
                }
                .into());
            }
        }
        let lm_head = if tied_head {
            embed_tokens.clone()
        } else {
            // In whatever format the checkpoint stores it, or 8-bit under --quantize-lm-head.
            head.load_matrix(be, v, h)?
        };
        Ok(Self {
            backend,
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            tied_head,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Bytes the matrices and the embedding table take on the backend, as stored (a tied
    /// `lm_head` counted once): what serving holds for weights, norms aside.
    pub fn weight_bytes(&self) -> usize {
        let be = &self.backend;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn.qkv.bytes(be) + l.attn.o.bytes(be) + l.gate_up.bytes(be) + l.down.bytes(be)
            })
            .sum();
        let head = if self.tied_head {
            0
        } else {
            be.weight_bytes(&self.lm_head)
        };
        layers + be.weight_bytes(&self.embed_tokens) + head
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Runs a step's rows through every layer, writing their keys and values into `kv`, and
    /// returns the logits of the rows asked for, `[rows, vocab]`, on the device.
    ///
    /// Every buffer it reads is named by `step`, and with fixed buffers and no images the
    /// whole pass can be recorded once ([`Backend::record`]) and replayed for new tokens: the
    /// engine does so for decode steps, one recording per batch size.
    pub fn forward(
        &self,
        kv: &mut PagedKv<B>,
        step: &StepInput<B>,
    ) -> vlm_compute::Result<Option<B::Tensor>> {
        let be = &self.backend;
        let mut x = be.embedding(&self.embed_tokens, step.ids)?;
        if let Some(img) = &step.images {
            be.scatter_rows(&mut x, img.rows, img.embeds)?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            layer.forward(be, &mut x, step, (&mut kv.k[i], &mut kv.v[i]))?;
            // DeepStack adds to the stream after the MLP's output, as HF does.
            if let Some((rows, ds)) = step
                .images
                .as_ref()
                .and_then(|img| Some((img.rows, img.deepstack.get(i)?)))
            {
                be.add_rows(&mut x, rows, ds)?;
            }
        }
        let eps = self.cfg.text.rms_norm_eps;
        let last = match &step.logits {
            LogitsOf::Nothing => return Ok(None),
            LogitsOf::AllRows => x,
            LogitsOf::Rows(rows) => be.gather_rows(&x, rows)?,
        };
        be.rms_norm_linear(&last, &self.norm, eps, &self.lm_head, None)
            .map(Some)
    }
}
