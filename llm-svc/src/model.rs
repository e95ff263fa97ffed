//! The Qwen3-VL text decoder, written once against [`Backend`].
//!
//! Reference: transformers `models/qwen3_vl/modeling_qwen3_vl.py` (`Qwen3VLTextModel`,
//! `Qwen3VLForConditionalGeneration`). Per layer:
//! ```text
//! h = RMSNorm(x);  q, k, v = h·Wq, h·Wk, h·Wv   (GQA: fewer k/v heads)
//! q, k = M-RoPE(RMSNorm_head(q)), M-RoPE(RMSNorm_head(k));  append k, v to the KV cache
//! x += Wo · attn(q, K, V)  (causal);  x += W_down · (silu(h·W_gate) ⊙ h·W_up) with h = RMSNorm(x)
//! after layer i < len(DeepStack): x[image positions] += DeepStack feature i
//! ```
//! and at the end `logits = lm_head(RMSNorm(x_last))`. Image embeddings replace the placeholder
//! tokens' embeddings before layer 0.

use vlm_compute::nn::Linear;
use vlm_compute::{AttnMask, Backend, HostTensor, WeightPrefix, Weights};

use crate::{ModelConfig, Result, TextConfig};

/// Keys and values of one sequence, for every layer: `[capacity, kv_heads, head_dim]` each,
/// allocated once for the whole request so that decoding never allocates cache memory.
pub struct KvCache<B: Backend> {
    k: Vec<B::Tensor>,
    v: Vec<B::Tensor>,
    len: usize,
    capacity: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(backend: &B, cfg: &TextConfig, capacity: usize) -> Result<Self> {
        let shape = [capacity, cfg.num_key_value_heads, cfg.head_dim];
        let layers = cfg.num_hidden_layers;
        Ok(Self {
            k: (0..layers)
                .map(|_| backend.zeros(&shape))
                .collect::<vlm_compute::Result<_>>()?,
            v: (0..layers)
                .map(|_| backend.zeros(&shape))
                .collect::<vlm_compute::Result<_>>()?,
            len: 0,
            capacity,
        })
    }

    /// Tokens already cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Device memory one cached token takes: keys and values of every layer, f32 on every
    /// backend today. What sizing `--max-context` x `--max-concurrent` against memory needs.
    pub fn bytes_per_token(cfg: &TextConfig) -> usize {
        2 * cfg.num_hidden_layers
            * cfg.num_key_value_heads
            * cfg.head_dim
            * std::mem::size_of::<f32>()
    }
}

/// The per-token inputs and the output of a decode step, in buffers allocated once per request
/// and rewritten before each step ([`DecodeInputs::set`]): the step's kernels then read the
/// token and the position from, and write the logits to, the same device addresses every time,
/// as a CUDA graph replay requires.
pub struct DecodeInputs<B: Backend> {
    /// `[1]`: the token id (as f32).
    token: B::Tensor,
    /// `[1]`: the cache slot this token goes to (as f32).
    slot: B::Tensor,
    /// `[1, head_dim]`: the rotary row for this token's position.
    cos: B::Tensor,
    sin: B::Tensor,
    /// `[1, vocab]`: what the step computes.
    logits: B::Tensor,
}

impl<B: Backend> DecodeInputs<B> {
    pub fn new(be: &B, cfg: &TextConfig) -> Result<Self> {
        Ok(Self {
            token: be.zeros(&[1])?,
            slot: be.zeros(&[1])?,
            cos: be.zeros(&[1, cfg.head_dim])?,
            sin: be.zeros(&[1, cfg.head_dim])?,
            logits: be.zeros(&[1, cfg.vocab_size])?,
        })
    }

    /// The logits of the last step. Borrow, do not clone: the next step writes into this
    /// buffer in place (a recorded step writes to its address), and a clone would split it.
    pub fn logits(&self) -> &B::Tensor {
        &self.logits
    }

    /// Token `token` at cache slot `slot` with the rotary row `cos`, `sin`.
    pub fn set(&mut self, be: &B, token: u32, slot: usize, cos: &[f32], sin: &[f32]) -> Result<()> {
        be.write(&mut self.token, &[token as f32])?;
        be.write(&mut self.slot, &[slot as f32])?;
        be.write(&mut self.cos, cos)?;
        be.write(&mut self.sin, sin)?;
        Ok(())
    }
}

/// Fewer decode steps than this left in the cache: run them op by op rather than record.
const RECORD_MIN_STEPS: usize = 4;

/// Where a request's decode step stands with respect to recording (see [`TextModel::decode`]).
pub enum DecodeGraph<B: Backend> {
    NotTried,
    /// Recorded on the first step; replayed since.
    Recorded(B::Graph),
    /// The backend does not record (or recording failed): ops run one by one.
    Direct,
}

/// What one forward pass adds to the sequence.
pub struct StepInput<'a, B: Backend> {
    /// Input embeddings `[n, hidden]` (token embeddings with image embeddings placed).
    pub embeds: B::Tensor,
    /// Rotary tables `[n, head_dim]` for these tokens' positions.
    pub cos: B::Tensor,
    pub sin: B::Tensor,
    /// Rows (within this step) holding image tokens, and the DeepStack features for them,
    /// one `[rows, hidden]` tensor per early layer.
    pub image_rows: &'a [usize],
    pub deepstack: &'a [B::Tensor],
}

struct Attention<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    fn new(be: &B, w: &WeightPrefix, c: &TextConfig) -> Result<Self> {
        let (h, d) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let bias = c.attention_bias;
        Ok(Self {
            q: Linear::load(be, &w.pp("q_proj"), nq * d, h, bias)?,
            k: Linear::load(be, &w.pp("k_proj"), nkv * d, h, bias)?,
            v: Linear::load(be, &w.pp("v_proj"), nkv * d, h, bias)?,
            o: Linear::load(be, &w.pp("o_proj"), h, nq * d, bias)?,
            q_norm: w.load(be, "q_norm.weight", &[d])?,
            k_norm: w.load(be, "k_norm.weight", &[d])?,
            heads: nq,
            kv_heads: nkv,
            head_dim: d,
            eps: c.rms_norm_eps,
        })
    }

    /// q, k, v of the tokens `x [n, hidden]`, q and k normed per head and rotated.
    fn project(
        &self,
        be: &B,
        x: &B::Tensor,
        cos: &B::Tensor,
        sin: &B::Tensor,
    ) -> vlm_compute::Result<[B::Tensor; 3]> {
        let n = be.shape(x)[0];
        let d = self.head_dim;
        let q = be.reshape(self.q.forward(be, x)?, &[n, self.heads, d])?;
        let k = be.reshape(self.k.forward(be, x)?, &[n, self.kv_heads, d])?;
        let v = be.reshape(self.v.forward(be, x)?, &[n, self.kv_heads, d])?;
        let q = be.rope(&be.rms_norm(&q, &self.q_norm, self.eps)?, cos, sin)?;
        let k = be.rope(&be.rms_norm(&k, &self.k_norm, self.eps)?, cos, sin)?;
        Ok([q, k, v])
    }

    fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        step: &StepInput<B>,
        k_cache: &mut B::Tensor,
        v_cache: &mut B::Tensor,
        start: usize,
    ) -> Result<B::Tensor> {
        let n = be.shape(x)[0];
        let [q, k, v] = self.project(be, x, &step.cos, &step.sin)?;
        be.write_rows(k_cache, start, &k)?;
        be.write_rows(v_cache, start, &v)?;
        let a = be.attention(
            &q,
            k_cache,
            v_cache,
            start + n,
            AttnMask::Causal {
                first_query_slot: start,
            },
        )?;
        Ok(self.o.forward(be, &a)?)
    }

    /// One decoded token: its slot and rotary row come from `inp`'s device buffers.
    fn decode(
        &self,
        be: &B,
        x: &B::Tensor,
        inp: &DecodeInputs<B>,
        k_cache: &mut B::Tensor,
        v_cache: &mut B::Tensor,
    ) -> vlm_compute::Result<B::Tensor> {
        let [q, k, v] = self.project(be, x, &inp.cos, &inp.sin)?;
        be.write_row_at(k_cache, &inp.slot, &k)?;
        be.write_row_at(v_cache, &inp.slot, &v)?;
        let a = be.decode_attention(&q, k_cache, v_cache, &inp.slot)?;
        self.o.forward(be, &a)
    }
}

struct DecoderLayer<B: Backend> {
    input_norm: B::Tensor,
    attn: Attention<B>,
    post_attn_norm: B::Tensor,
    gate: Linear<B>,
    up: Linear<B>,
    down: Linear<B>,
    eps: f32,
}

impl<B: Backend> DecoderLayer<B> {
    /// The residual stream after attention, `x`, through the MLP half of the layer.
    fn mlp(&self, be: &B, x: B::Tensor) -> vlm_compute::Result<B::Tensor> {
        let h = be.rms_norm(&x, &self.post_attn_norm, self.eps)?;
        let g = be.swiglu(&h, self.gate.weight(), self.up.weight())?;
        be.add(&x, &self.down.forward(be, &g)?)
    }

    fn new(be: &B, w: &WeightPrefix, c: &TextConfig) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            input_norm: w.load(be, "input_layernorm.weight", &[h])?,
            attn: Attention::new(be, &w.pp("self_attn"), c)?,
            post_attn_norm: w.load(be, "post_attention_layernorm.weight", &[h])?,
            gate: Linear::load(be, &w.pp("mlp.gate_proj"), i, h, false)?,
            up: Linear::load(be, &w.pp("mlp.up_proj"), i, h, false)?,
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
}

impl<B: Backend> TextModel<B> {
    pub fn new(cfg: ModelConfig, weights: &Weights, backend: B) -> Result<Self> {
        let be = &backend;
        let c = &cfg.text;
        let w = weights.pp("model.language_model");
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed_tokens = w.load_weight(be, "embed_tokens.weight", &[v, h])?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::new(be, &w.pp("layers").pp(i), c))
            .collect::<Result<Vec<_>>>()?;
        let norm = w.load(be, "norm.weight", &[h])?;
        // Tied checkpoints (the small Qwen3-VL sizes) store no lm_head.
        let lm_head = if cfg.tie_word_embeddings && !weights.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            weights.pp("lm_head").load_weight(be, "weight", &[v, h])?
        };
        Ok(Self {
            backend,
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Token embeddings `[ids.len(), hidden]`.
    pub fn embed(&self, ids: &[u32]) -> Result<B::Tensor> {
        let be = &self.backend;
        let ids = HostTensor::new(vec![ids.len()], ids.iter().map(|&t| t as f32).collect())?;
        Ok(be.embedding(&self.embed_tokens, &be.upload(&ids)?)?)
    }

    /// Runs the step's tokens through every layer, appending them to `cache`, and returns the
    /// logits of the last token `[1, vocab]`, on the device.
    pub fn forward(&self, cache: &mut KvCache<B>, step: &StepInput<B>) -> Result<B::Tensor> {
        let be = &self.backend;
        let n = be.shape(&step.embeds)[0];
        let start = cache.len;
        if start + n > cache.capacity {
            return Err(crate::Error::PromptTooLong {
                prompt_tokens: start + n,
                context: cache.capacity,
            });
        }
        let mut x = step.embeds.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.input_norm, layer.eps)?;
            let a = layer
                .attn
                .forward(be, &h, step, &mut cache.k[i], &mut cache.v[i], start)?;
            x = layer.mlp(be, be.add(&x, &a)?)?;
            if let Some(ds) = step.deepstack.get(i) {
                be.add_rows(&mut x, step.image_rows, ds)?;
            }
        }
        cache.len = start + n;
        let last = be.slice_rows(&x, n - 1, n)?;
        Ok(self.logits(&last)?)
    }

    /// One decode step: the token, its cache slot and rotary row are in `inp` (set by the
    /// caller), its keys and values go to that slot, its logits to `inp.logits()`.
    ///
    /// The first step is recorded if the backend can ([`Backend::record`], a CUDA graph) and
    /// every later one replays that recording: all the buffers the step touches stay put, and
    /// only their contents change. `graph` keeps the request's state between steps: start it
    /// at [`DecodeGraph::NotTried`].
    pub fn decode(
        &self,
        cache: &mut KvCache<B>,
        inp: &mut DecodeInputs<B>,
        graph: &mut DecodeGraph<B>,
    ) -> Result<()> {
        let be = &self.backend;
        if cache.len >= cache.capacity {
            return Err(crate::Error::PromptTooLong {
                prompt_tokens: cache.len + 1,
                context: cache.capacity,
            });
        }
        // Recording costs about what a few steps do: not worth it for the last few tokens.
        if matches!(graph, DecodeGraph::NotTried) && cache.capacity - cache.len < RECORD_MIN_STEPS {
            *graph = DecodeGraph::Direct;
        }
        if matches!(graph, DecodeGraph::NotTried) {
            *graph = match be.record(&mut || self.decode_ops(cache, inp)) {
                Ok(Some(g)) => DecodeGraph::Recorded(g),
                Ok(None) => DecodeGraph::Direct,
                Err(e) => {
                    // Slower, not wrong: the same ops run one by one.
                    tracing::warn!(error = %e, "decode step could not be recorded; running it op by op");
                    DecodeGraph::Direct
                }
            };
        }
        match graph {
            DecodeGraph::Recorded(g) => be.replay(g)?,
            _ => self.decode_ops(cache, inp)?,
        }
        cache.len += 1;
        Ok(())
    }

    /// The device work of a decode step (no host-side state changes, so it can be recorded).
    fn decode_ops(
        &self,
        cache: &mut KvCache<B>,
        inp: &mut DecodeInputs<B>,
    ) -> vlm_compute::Result<()> {
        let be = &self.backend;
        let mut x = be.embedding(&self.embed_tokens, &inp.token)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = be.rms_norm(&x, &layer.input_norm, layer.eps)?;
            let a = layer
                .attn
                .decode(be, &h, inp, &mut cache.k[i], &mut cache.v[i])?;
            x = layer.mlp(be, be.add(&x, &a)?)?;
        }
        be.copy(&mut inp.logits, &self.logits(&x)?)
    }

    /// `lm_head(RMSNorm(x))`.
    fn logits(&self, x: &B::Tensor) -> vlm_compute::Result<B::Tensor> {
        let be = &self.backend;
        let h = be.rms_norm(x, &self.norm, self.cfg.text.rms_norm_eps)?;
        be.linear(&h, &self.lm_head, None)
    }
}
