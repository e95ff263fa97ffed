//! The ops interface: everything the two model stages compute, and nothing more.
//!
//! The vision tower and the text decoder are written once, generically over [`Backend`]. A
//! backend owns its tensor type (host memory for the CPU, device memory for CUDA); models move
//! data across only through `upload`/`download`. Ops work on row-major tensors; "rows" means
//! the matrix view `[n, last_dim]`. Shapes are checked and reported as [`crate::Error::Shape`].

use crate::handoff::DeviceRows;
use crate::patches::PatchLayout;
use crate::{Embeddings, HostTensor, KvFormat, Result};

/// The tensor `rows` holds, if it is one of `B`'s (rows handed over by another kind of
/// backend, or a stale deposit, cannot be read here).
fn handed_over<B: Backend + ?Sized>(rows: &DeviceRows) -> Result<B::Tensor> {
    rows.get::<B::Tensor>().cloned().ok_or_else(|| {
        crate::Error::shape(
            "upload_embeddings",
            format!(
                "embeddings {:?} handed over on another kind of device than this {} backend",
                rows.shape(),
                std::any::type_name::<B>()
            ),
        )
    })
}

/// Which GELU: HF's `gelu_pytorch_tanh` (vision MLP) or the exact erf form (`nn.GELU()`, mergers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluKind {
    Tanh,
    Erf,
}

/// Which keys a query may attend to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMask {
    /// Every query sees every key (the vision tower, one image at a time).
    Full,
    /// Query `i` is the token in cache slot `first_query_slot + i` and sees slots `0..=` that.
    Causal { first_query_slot: usize },
}

/// Device memory a service keeps cached while it is idle, for the next request's first steps
/// ([`release_idle_memory`]). With 256 MiB, 8B W4 with an 8k-token cache held 9,581 MiB after
/// a 1344 px image and a 4,782-token prompt (H200): the cache's 256 MiB over the 9,325 after
/// start; with 128, 9,549.
pub const IDLE_CACHED_BYTES: usize = 128 << 20;

/// What a service's loop calls when it has nothing left to do: the device's allocator gives
/// back what it cached beyond [`IDLE_CACHED_BYTES`] ([`Backend::release_cached_memory`]).
/// After a large request (a 1344 px image, a long prompt) the process would otherwise hold
/// that request's peak until it stops, which a Jetson shares with its system.
pub fn release_idle_memory<B: Backend>(be: &B, service: &str) {
    match be.release_cached_memory(IDLE_CACHED_BYTES) {
        Ok(0) => {}
        Ok(bytes) => tracing::debug!(
            service,
            mib = bytes >> 20,
            "idle: gave cached device memory back to the driver"
        ),
        Err(e) => {
            tracing::warn!(service, error = %e, "idle: could not trim the device's memory pool")
        }
    }
}

/// Index of the largest value; the first one on ties, as `torch.argmax`.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// A LayerNorm's weight, bias and epsilon, as the fused ops take them.
pub struct LayerNormParams<'a, B: Backend + ?Sized> {
    pub w: &'a B::Tensor,
    pub b: &'a B::Tensor,
    pub eps: f32,
}

/// A projection `x · wᵀ (+ b)` (`w` `[out, in]`), as the fused ops take it.
pub struct Projection<'a, B: Backend + ?Sized> {
    pub w: &'a B::Weight,
    pub b: Option<&'a B::Tensor>,
}

// By hand: derives would ask for `B: Clone`, where only the references are copied.
impl<B: Backend + ?Sized> Clone for LayerNormParams<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for LayerNormParams<'_, B> {}
impl<B: Backend + ?Sized> Clone for Projection<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for Projection<'_, B> {}

/// A ViT attention's weights, as [`Backend::layer_norm_rope_attention`] takes them.
pub struct AttentionWeights<'a, B: Backend + ?Sized> {
    /// q, k and v stacked, `[3 * heads * d, hidden]`: each output row holds its q, k and v
    /// side by side.
    pub qkv: Projection<'a, B>,
    pub heads: usize,
    /// The output projection, `[hidden, heads * d]`.
    pub proj: Projection<'a, B>,
}

impl<B: Backend + ?Sized> Clone for AttentionWeights<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for AttentionWeights<'_, B> {}

/// [`Backend::layer_norm_linears`] op by op: the default, and a GPU's path for what its fused
/// version does not take.
pub(crate) fn layer_norm_linears_op_by_op<B: Backend + ?Sized>(
    be: &B,
    x: &B::Tensor,
    norm: LayerNormParams<B>,
    projections: &[Projection<B>],
) -> Result<Vec<B::Tensor>> {
    let h = be.layer_norm(x, norm.w, norm.b, norm.eps)?;
    projections
        .iter()
        .map(|p| be.linear(&h, p.w, p.b))
        .collect()
}

/// [`Backend::rope_attention_segments`] op by op: q, k and v taken apart by gathering rows of
/// `qkv` seen as `[3n, heads * d]`, rotated, then [`Backend::attention_segments`].
pub(crate) fn rope_attention_segments_op_by_op<B: Backend + ?Sized>(
    be: &B,
    qkv: &B::Tensor,
    heads: usize,
    rope: [&B::Tensor; 2],
    lens: &[usize],
) -> Result<B::Tensor> {
    let shape = be.shape(qkv).to_vec();
    let [n, cols] = shape[..] else {
        return Err(crate::Error::shape(
            "rope_attention_segments",
            format!("qkv must be [n, 3 * heads * d], got {shape:?}"),
        ));
    };
    if heads == 0 || cols % (3 * heads) != 0 {
        return Err(crate::Error::shape(
            "rope_attention_segments",
            format!("qkv {shape:?} is not [n, 3 * {heads} * d]"),
        ));
    }
    let d = cols / (3 * heads);
    let rows = be.reshape(qkv.clone(), &[3 * n, heads * d])?;
    let part = |i: usize| -> Result<B::Tensor> {
        let ids: Vec<u32> = (0..n).map(|r| (3 * r + i) as u32).collect();
        let t = be.gather_rows(&rows, &be.upload_ids(&ids)?)?;
        be.reshape(t, &[n, heads, d])
    };
    let [cos, sin] = rope;
    let q = be.rope(&part(0)?, cos, sin)?;
    let k = be.rope(&part(1)?, cos, sin)?;
    be.attention_segments(&q, &k, &part(2)?, lens)
}

/// [`Backend::layer_norm_mlp`] op by op, as [`layer_norm_linears_op_by_op`].
pub(crate) fn layer_norm_mlp_op_by_op<B: Backend + ?Sized>(
    be: &B,
    x: &mut B::Tensor,
    norm: LayerNormParams<B>,
    up: Projection<B>,
    act: GeluKind,
    down: Projection<B>,
) -> Result<()> {
    let h = be.layer_norm(x, norm.w, norm.b, norm.eps)?;
    let h = be.gelu(&be.linear(&h, up.w, up.b)?, act)?;
    be.add_linear(x, &h, down.w, down.b)
}

/// [`Backend::layer_norm_rope_attention`] op by op, as the ViT ran its attention before the
/// op existed: [`Backend::layer_norm_linears`], [`Backend::rope_attention_segments`], then
/// [`Backend::add_linear`]. The default, and a GPU's path for what its fused version does not
/// take (decode-sized inputs, shapes its kernels have no instance for).
pub(crate) fn layer_norm_rope_attention_op_by_op<B: Backend + ?Sized>(
    be: &B,
    x: &mut B::Tensor,
    norm: LayerNormParams<B>,
    attn: AttentionWeights<B>,
    rope: [&B::Tensor; 2],
    lens: &[usize],
) -> Result<()> {
    let Ok([qkv]) = <[B::Tensor; 1]>::try_from(be.layer_norm_linears(x, norm, &[attn.qkv])?) else {
        return Err(crate::Error::shape(
            "layer_norm_rope_attention",
            "layer_norm_linears gave not one output for its one projection",
        ));
    };
    let a = be.rope_attention_segments(&qkv, attn.heads, rope, lens)?;
    be.add_linear(x, &a, attn.proj.w, attn.proj.b)
}

/// [`Backend::rms_norm_mlp`] op by op: the default, and a GPU's path for decode rows (its fused
/// norm + SwiGLU GEMV, then the down projection added in its own).
pub(crate) fn rms_norm_mlp_op_by_op<B: Backend + ?Sized>(
    be: &B,
    x: &mut B::Tensor,
    norm: &B::Tensor,
    eps: f32,
    gate_up: &B::Weight,
    down: &B::Weight,
) -> Result<()> {
    let g = be.rms_norm_swiglu(x, norm, eps, gate_up)?;
    be.add_linear(x, &g, down, None)
}

/// How [`Backend::qkv_to_cache`] turns a fused q/k/v projection into attention inputs.
pub struct QkvToCache<'a, B: Backend + ?Sized> {
    /// Query heads; the cache's shape gives the KV heads and the head dim.
    pub q_heads: usize,
    /// Per-head RMSNorm of q and k (Qwen3); `None`: q and k are only rotated (Qwen2).
    pub qk_norm: Option<QkNorm<'a, B>>,
    /// Rotary tables `[n, d]` at each row's position (rotate-half form, both halves filled).
    pub cos: &'a B::Tensor,
    pub sin: &'a B::Tensor,
    /// `[n]` cache slot of each row.
    pub slots: &'a B::Ids,
}

/// The per-head RMSNorm [`QkvToCache`] applies to q and k before rotating them.
pub struct QkNorm<'a, B: Backend + ?Sized> {
    /// RMSNorm weights `[d]` of q and of k.
    pub q: &'a B::Tensor,
    pub k: &'a B::Tensor,
    pub eps: f32,
}

/// Where device time went, per op ([`Backend::op_times`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The kernel (or library call) name.
    pub op: &'static str,
    pub launches: usize,
    pub ms: f64,
}

/// How the query rows of a batched step map onto sequences, and which cached keys each
/// sequence's queries see: the paged attention of an engine step (vLLM's `PagedAttention`).
///
/// The cache holds keys and values in fixed-size blocks; slot `b * block_size + o` is offset
/// `o` of block `b`. A sequence's `i`-th key is in block `blocks[off + i / block_size]` at
/// offset `i % block_size`.
pub struct PagedBatch<'a, B: Backend + ?Sized> {
    /// `[num_seqs * 4]`: for each sequence its first query row, its query count `n`, its keys
    /// in the cache counting this step's (`kv_len`), and where its block list starts in
    /// `blocks`. Query `i` sits at position `kv_len - n + i` and sees keys `0..=` that.
    pub seqs: &'a B::Ids,
    /// The block lists of every sequence, back to back.
    pub blocks: &'a B::Ids,
    pub num_seqs: usize,
    /// The first `decode_seqs` sequences have exactly one query (a GPU runs them through its
    /// split-K decode kernel; the rest through flash attention).
    pub decode_seqs: usize,
    /// Upper bounds over the sequences: queries of one, and keys of one. Kernel grids are
    /// sized by them (a recorded step keeps its grid, so these bound every replay).
    pub max_queries: usize,
    pub max_keys: usize,
    pub block_size: usize,
}

/// The buffers of [`Backend::sample_rows`] for a step of `rows` rows and a vocabulary of
/// `vocab`. They stay put, so a recorded step reads each step's parameters from them.
pub struct SampleIo<'a, B: Backend + ?Sized> {
    /// `[rows × SAMPLE_WORDS]`: each row's [`crate::sampling::RowParams::to_words`].
    pub params: &'a B::Ids,
    /// The step's `logit_bias` entries ([`crate::sampling::bias_words`]), which rows index.
    pub bias: &'a B::Ids,
    /// At least `[rows × mask_words(vocab)]` ([`crate::sampling::mask_words`]): row `r`'s
    /// allowed tokens, read where its parameters say `masked`.
    pub masks: &'a B::Ids,
    /// `[slots × vocab]` token counts of the sequences with penalties (a row names its slot);
    /// each pick adds one to its token's.
    pub counts: &'a mut B::Ids,
    /// `[rows, vocab]`: the processed logits (room the draw works in).
    pub scratch: &'a mut B::Tensor,
    /// `[rows]`: the picks.
    pub picks: &'a mut B::Ids,
    /// `[rows, LOGPROB_COLS]`: the pick's raw logprob, then the best tokens' (rows that asked).
    pub logprobs: &'a mut B::Tensor,
    /// `[rows × MAX_TOP_LOGPROBS]`: the best tokens' ids, best first.
    pub top_ids: &'a mut B::Ids,
    /// At least [`crate::sampling::work_words`]`(rows)`: what the device's passes hand each
    /// other (the CPU needs none).
    pub work: &'a mut B::Ids,
}

pub trait Backend: Send + Sync + 'static {
    /// A recorded sequence of ops ([`Backend::record`]), e.g. a CUDA graph; `()` where there
    /// is none. Sent with the model that keeps it to the thread that runs the model.
    type Graph: Send;
    /// Activations, norm weights, biases, caches.
    type Tensor: Clone + Send + Sync + 'static;
    /// The matrices of `linear` and the embedding table, stored as the backend reads them best:
    /// f32 on the CPU (the reference), f16 on the GPU (half the bytes each decoded token reads,
    /// tensor-core GEMMs).
    type Weight: Clone + Send + Sync;
    /// Whole numbers in device memory: token ids, KV cache slots, block tables, picked tokens.
    /// Steps read them from buffers that stay put, which is what lets a step be recorded once
    /// and replayed.
    type Ids: Send + Sync;
    /// One layer's keys (or values) in the paged KV cache, `[slots, kv_heads, head_dim]`, in
    /// the [`KvFormat`] it was made with: natively f32 on the CPU, f16 on the GPU (half the
    /// bytes that attention reads per token); or FP8 e4m3 bytes and a scale on either.
    type Cache: Send + Sync;

    /// Bytes per element of a [`Backend::Weight`]: what decoding reads per parameter.
    const WEIGHT_BYTES: usize;
    /// Bytes per element of a [`Backend::Cache`] of [`KvFormat::Native`] (an FP8 one takes 1).
    const CACHE_BYTES: usize;

    /// Short name for logs and errors ("cpu", "cuda").
    fn name(&self) -> &'static str;
    /// Device memory in use now, in bytes, where the backend has its own memory (a GPU; for the
    /// benchmark's memory rows). With CUDA's pool allocator, memory freed stays reserved, so
    /// after a stage has run this is its peak.
    fn memory_in_use(&self) -> Option<usize> {
        self.device_memory().map(|(free, total)| total - free)
    }
    /// Free and total bytes of the device's own memory, where it has one (a GPU): what the
    /// KV cache is sized from.
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }
    /// Gives the device memory that freed buffers left cached back to the driver, keeping at
    /// least `keep` bytes cached, and returns the bytes given back. A GPU's allocator keeps
    /// what the largest step so far freed (so that the next step maps nothing); the engine
    /// calls this when it goes idle, so that one large request (a big image, a long prompt)
    /// does not hold its peak for the life of the server. Host memory is given back as it is
    /// freed: nothing to do by default.
    fn release_cached_memory(&self, keep: usize) -> Result<usize> {
        let _ = keep;
        Ok(0)
    }
    /// Times one copy of `bytes` bytes within the backend's own memory (the bandwidth limit
    /// `vlm bench` measures decode against; it moves 2 x `bytes`, read and write). Host
    /// memory here; a GPU times a device-to-device copy.
    fn time_copy(&self, bytes: usize) -> Result<std::time::Duration> {
        // Both buffers written first, so page faults are not timed as copying.
        let src = vec![1u8; bytes];
        let mut dst = vec![2u8; bytes];
        let t = std::time::Instant::now();
        dst.copy_from_slice(&src);
        let d = t.elapsed();
        std::hint::black_box(&dst);
        Ok(d)
    }

    // ---- memory ----
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;
    /// Rows that leave this stage for the other (an image's embeddings), in the precision the
    /// backend computes them in: f32 here, f16 on a GPU (rounded on the device, half the
    /// bytes to download and to send on).
    fn download_embeddings(&self, t: &Self::Tensor) -> Result<Embeddings> {
        Ok(Embeddings::F32(self.download(t)?))
    }
    /// Embeddings from the other stage as an f32 activation tensor. A GPU uploads f16 rows
    /// as they are (from a message's buffer or a shared-memory mapping) and widens them on
    /// the device. Rows handed over on the device ([`Backend::hand_off`]) are used as they
    /// are, if they are this backend's kind of tensor.
    fn upload_embeddings(&self, e: &Embeddings) -> Result<Self::Tensor> {
        match e {
            Embeddings::Device(rows) => handed_over::<Self>(rows),
            host => self.upload(&*host.to_f32()?),
        }
    }
    /// `e` on the host: host embeddings as they are, rows this backend handed over
    /// downloaded as [`Backend::download_embeddings`] does (vision-svc's cache keeps a host
    /// copy of what it handed over).
    fn embeddings_to_host(&self, e: &Embeddings) -> Result<Embeddings> {
        match e {
            Embeddings::Device(rows) => self.download_embeddings(&handed_over::<Self>(rows)?),
            host => Ok(host.clone()),
        }
    }
    /// `t` as embeddings that stay where they are, for the other stage in this process to
    /// read ([`crate::handoff`]): no copy. The reader runs on a stream of its own: a GPU marks
    /// where the work that computes `t` ends, and the reader's stream waits for that mark on
    /// the device (the host does not wait). `identity` stands for the values in the reader's
    /// prefix cache.
    fn hand_off(&self, t: Self::Tensor, identity: Vec<u8>) -> Result<Embeddings> {
        let shape = self.shape(&t).to_vec();
        Ok(Embeddings::Device(DeviceRows::new(shape, t, identity)))
    }
    fn zeros(&self, shape: &[usize]) -> Result<Self::Tensor>;
    /// `dst = src` in place (same element count); `dst` keeps its buffer.
    fn copy(&self, dst: &mut Self::Tensor, src: &Self::Tensor) -> Result<()>;
    /// `shape` filled with [`crate::random::uniform`]`(key, i, bound)` at element `i`: the
    /// matrices of a random-weight model. Built on the host unless the backend can do better.
    fn random_uniform(&self, shape: &[usize], key: u64, bound: f32) -> Result<Self::Tensor> {
        self.upload(&crate::random::uniform_tensor(shape, key, bound))
    }
    /// Bytes `w` takes as this backend stores it (packed values and scales for an integer
    /// matrix): what memory reports count, by kind.
    fn weight_bytes(&self, w: &Self::Weight) -> usize;
    /// A weight matrix `[out, in]` (or table `[rows, width]`) from f32 host values.
    fn upload_weight(&self, t: &HostTensor) -> Result<Self::Weight>;
    /// A weight matrix from integer-quantized values ([`crate::quant`]). By default (the CPU
    /// reference) dequantized to f32 at load, which is exact.
    fn upload_int_weight(&self, m: &crate::quant::IntMatrix) -> Result<Self::Weight> {
        self.upload_weight(&m.dequantize())
    }
    /// A weight matrix from FP8 values and block scales ([`crate::quant::fp8`]). By default
    /// (the CPU reference) dequantized at load, to f32 exactly; the GPU keeps the e4m3 bytes.
    fn upload_fp8_weight(&self, m: &crate::quant::fp8::Fp8Matrix) -> Result<Self::Weight> {
        self.upload_weight(&m.dequantize())
    }
    /// A quantized matrix of either number format.
    fn upload_quantized(&self, m: &crate::quant::QuantMatrix) -> Result<Self::Weight> {
        match m {
            crate::quant::QuantMatrix::Int(m) => self.upload_int_weight(m),
            crate::quant::QuantMatrix::Fp8(m) => self.upload_fp8_weight(m),
        }
    }
    /// A random-weight model's quantized matrix ([`crate::quant::random_int`]), generated by
    /// the backend where it can (on the GPU for CUDA).
    fn random_int_weight(
        &self,
        shape: &[usize],
        key: u64,
        bound: f32,
        to: crate::quant::QuantizeTo,
    ) -> Result<Self::Weight> {
        self.upload_int_weight(&crate::quant::random_int(
            shape[0], shape[1], key, bound, to,
        ))
    }
    /// A weight filled like [`Backend::random_uniform`].
    fn random_weight(&self, shape: &[usize], key: u64, bound: f32) -> Result<Self::Weight> {
        self.upload_weight(&crate::random::uniform_tensor(shape, key, bound))
    }
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// Same data viewed with another shape of the same element count.
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    /// `values` as device ids.
    fn upload_ids(&self, values: &[u32]) -> Result<Self::Ids>;
    /// Overwrites the first `values.len()` ids of `dst` (a step's input buffer that stays put).
    fn write_ids(&self, dst: &mut Self::Ids, values: &[u32]) -> Result<()> {
        self.write_ids_at(dst, 0, values)
    }
    /// Overwrites `values.len()` ids of `dst` from index `at` (one sequence's row of the token
    /// counts, say).
    fn write_ids_at(&self, dst: &mut Self::Ids, at: usize, values: &[u32]) -> Result<()>;
    /// The first `n` ids of `ids`.
    fn download_ids(&self, ids: &Self::Ids, n: usize) -> Result<Vec<u32>>;
    /// A zeroed cache for one layer's keys or values: `[slots, heads, dim]`, stored as `format`
    /// says. A format [`Backend::check_kv_format`] refuses is an error.
    fn zeros_cache(
        &self,
        slots: usize,
        heads: usize,
        dim: usize,
        format: KvFormat,
    ) -> Result<Self::Cache>;
    /// Whether every op that writes or reads the cache ([`Backend::qkv_to_cache`],
    /// [`Backend::write_kv`], [`Backend::paged_attention`]) can take caches of `format` with
    /// `heads` heads of `dim`: the engine asks before it allocates, so that a format the
    /// kernels lack is refused at start, not met at the first step. By default only the
    /// native format.
    fn check_kv_format(&self, format: KvFormat, heads: usize, dim: usize) -> Result<()> {
        let _ = (heads, dim);
        match format {
            KvFormat::Native => Ok(()),
            KvFormat::Fp8 { .. } => Err(crate::Error::KvCacheDtype {
                dtype: "fp8",
                problem: format!("the {} backend has no FP8 KV cache", self.name()),
            }),
        }
    }
    /// A cache's contents as f32 (an FP8 cache's bytes times its scale). Only the twin tests call it (`twin.rs`: the start-up
    /// self-check and `cuda/tests/cuda_twin.rs`), to compare the caches `write_kv` fills;
    /// kept for them.
    fn download_cache(&self, cache: &Self::Cache) -> Result<HostTensor>;

    /// Each row's next token from its logits (`[rows, vocab]`) by the rule of
    /// [`crate::sampling`]: greedy, or drawn after bias, penalties, temperature, top-k, top-p
    /// and min-p, per row's parameters; the picks' token counts updated. Only `io`'s outputs
    /// leave the device.
    fn sample_rows(&self, logits: &Self::Tensor, io: SampleIo<'_, Self>) -> Result<()>;

    // ---- profiling ----
    /// Returns once the device has run every op queued so far (for timing: a GPU's ops return
    /// when queued). The CPU runs each op as it is called: nothing to wait for.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Starts (`on`) or stops timing every op on the device (`vlm bench --profile`); `false`
    /// where the backend cannot. While ops are timed, [`Backend::record`] records nothing, so
    /// steps run op by op and each op is timed on its own.
    fn time_ops(&self, on: bool) -> Result<bool> {
        let _ = on;
        Ok(false)
    }
    /// Whether ops are being timed now (then steps are not replayed from recordings either).
    fn timing_ops(&self) -> bool {
        false
    }
    /// Device time per op (kernel name) since timing started or was last read, slowest first.
    fn op_times(&self) -> Result<Vec<OpTime>> {
        Ok(Vec::new())
    }

    // ---- recording ----
    /// Records what `ops` enqueues, without running it, for [`Backend::replay`]: one launch
    /// instead of hundreds per decoded token. Only ops whose every input and output buffer
    /// stays put (refreshed with [`Backend::write`]) may be recorded. `Ok(None)`: this backend
    /// does not record (the default); the caller runs `ops` itself.
    fn record(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>> {
        let _ = ops;
        Ok(None)
    }
    /// Runs a recording again, reading whatever its buffers hold now.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;

    // ---- dense math ----
    /// `x [n, k] · wᵀ + b` with `w [m, k]` (PyTorch's `nn.Linear` layout) -> `[n, m]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, the text MLP's SwiGLU before `down_proj`, with `gate`
    /// and `up` stacked in one weight `gate_up [2m, k]` (gate's rows first): one GEMM over both
    /// (one pass over both matrices when decoding, seed 002). Returns `[n, m]`.
    fn swiglu(&self, x: &Self::Tensor, gate_up: &Self::Weight) -> Result<Self::Tensor>;
    /// The weights `parts` (same row width) stacked into one, rows of the first first: the
    /// fused projections the text model loads (q/k/v, gate/up).
    fn stack_weights(&self, parts: &[&Self::Weight]) -> Result<Self::Weight>;
    /// Elementwise `a + b`, same shapes.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// LayerNorm over the last dim with weight and bias.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// RMSNorm over the last dim (`x / sqrt(mean(x²) + eps) * w`); per-head q/k norm is this op
    /// on a `[tokens, heads, head_dim]` view.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// [`Backend::linear`] of `rms_norm(x, norm, eps)`. A GEMV reads all of its input row
    /// anyway, so a GPU takes the norm on the way (a decode step has two per layer, and on a
    /// GPU each op is a launch).
    fn rms_norm_linear(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor> {
        self.linear(&self.rms_norm(x, norm, eps)?, w, b)
    }
    /// [`Backend::swiglu`] of `rms_norm(x, norm, eps)`, fused as [`Backend::rms_norm_linear`].
    fn rms_norm_swiglu(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        gate_up: &Self::Weight,
    ) -> Result<Self::Tensor> {
        self.swiglu(&self.rms_norm(x, norm, eps)?, gate_up)
    }
    /// `x += a · wᵀ (+ b)`: a residual update folded into the projection that produces it
    /// (its output goes straight into `x`, with no buffer or launch of its own).
    fn add_linear(
        &self,
        x: &mut Self::Tensor,
        a: &Self::Tensor,
        w: &Self::Weight,
        b: Option<&Self::Tensor>,
    ) -> Result<()> {
        *x = self.add(x, &self.linear(a, w, b)?)?;
        Ok(())
    }
    /// The projections of one input's LayerNorm: `layer_norm(x) · wᵀ + b` for each of
    /// `projections` (the ViT's q, k and v). A GPU normalizes once, straight into the f16
    /// operand its GEMMs read, and adds each bias in the GEMM's epilogue.
    fn layer_norm_linears(
        &self,
        x: &Self::Tensor,
        norm: LayerNormParams<Self>,
        projections: &[Projection<Self>],
    ) -> Result<Vec<Self::Tensor>> {
        layer_norm_linears_op_by_op(self, x, norm, projections)
    }
    /// A pre-norm MLP with its residual: `x += down(gelu(up(layer_norm(x))))` (the ViT
    /// block's second half). A GPU keeps the hidden activations in f16 and does the bias,
    /// GELU and residual add in the GEMMs' epilogues: two GEMMs and one norm, no other pass.
    fn layer_norm_mlp(
        &self,
        x: &mut Self::Tensor,
        norm: LayerNormParams<Self>,
        up: Projection<Self>,
        act: GeluKind,
        down: Projection<Self>,
    ) -> Result<()> {
        layer_norm_mlp_op_by_op(self, x, norm, up, act, down)
    }
    /// A pre-norm attention with its residual: `x += proj(attention_segments(rope(q), rope(k),
    /// v))`, where `[q | k | v] = layer_norm(x) · qkvᵀ + b` (`attn`'s weights, `heads` heads
    /// of `d`), rotated by `rope` = `[cos, sin]` (`[n, d]`, as [`Backend::rope`]), attending
    /// within each run of `lens` rows (as [`Backend::attention_segments`]): the ViT block's
    /// first half. A GPU past its GEMVs' rows writes the norm and the q/k/v product in f16
    /// (the bias in the GEMM's epilogue), rotates and packs them for its flash attention in one
    /// pass, and adds the output projection into `x` in its GEMM (on an H100 the attention is
    /// written in f16, that GEMM's operand): no f32 copy of q/k/v.
    fn layer_norm_rope_attention(
        &self,
        x: &mut Self::Tensor,
        norm: LayerNormParams<Self>,
        attn: AttentionWeights<Self>,
        rope: [&Self::Tensor; 2],
        lens: &[usize],
    ) -> Result<()> {
        layer_norm_rope_attention_op_by_op(self, x, norm, attn, rope, lens)
    }
    /// The text decoder's MLP with its residual: `x += (silu(g) ⊙ u) · downᵀ`, where
    /// `[g | u] = rms_norm(x, norm, eps) · gate_upᵀ` (gate and up stacked as in
    /// [`Backend::swiglu`]). A GPU past its GEMVs' rows writes the norm, the gate/up product
    /// and the SwiGLU in f16, each the operand of the GEMM after it (f32 accumulation
    /// throughout), and adds the down projection into `x` in its GEMM: no casts, no f32
    /// copies of the hidden activations.
    fn rms_norm_mlp(
        &self,
        x: &mut Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        gate_up: &Self::Weight,
        down: &Self::Weight,
    ) -> Result<()> {
        rms_norm_mlp_op_by_op(self, x, norm, eps, gate_up, down)
    }
    fn gelu(&self, x: &Self::Tensor, kind: GeluKind) -> Result<Self::Tensor>;
    /// `silu(gate) * up`, the SwiGLU of the text MLP. The model runs the SwiGLU fused
    /// ([`Backend::swiglu`], [`Backend::rms_norm_mlp`]); only the twin tests call it alone
    /// (`twin.rs`: the start-up self-check and `cuda/tests/cuda_twin.rs`), so the kernel stays
    /// checked; kept for them.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;

    // ---- attention ----
    /// Rotary embedding in HF's rotate-half form on `x [tokens, heads, head_dim]`, with
    /// `cos`/`sin` of shape `[tokens, head_dim]` (both halves filled).
    fn rope(
        &self,
        x: &Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
    ) -> Result<Self::Tensor>;
    /// Scaled dot-product attention with grouped KV heads.
    /// `q [nq, hq, d]`; `k`, `v` `[slots, hkv, d]` of which the first `kv_len` rows are valid;
    /// `hq` a multiple of `hkv`. Returns `[nq, hq * d]`, ready for the output projection.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        kv_len: usize,
        mask: AttnMask,
    ) -> Result<Self::Tensor>;

    /// Full attention within each run of `lens` consecutive rows (several images in one ViT
    /// pass, each seeing only itself): `q`, `k`, `v` `[n, heads, d]` with `n = Σ lens`.
    /// Returns `[n, heads * d]`. The default runs [`Backend::attention`] per run.
    fn attention_segments(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        lens: &[usize],
    ) -> Result<Self::Tensor> {
        let shape = self.shape(q).to_vec();
        let [n, heads, d] = shape[..] else {
            return Err(crate::Error::shape(
                "attention_segments",
                format!("q must be [n, heads, d], got {shape:?}"),
            ));
        };
        if lens.iter().sum::<usize>() != n {
            return Err(crate::Error::shape(
                "attention_segments",
                format!("segments {lens:?} do not cover {n} rows"),
            ));
        }
        if let [_] = lens {
            return self.attention(q, k, v, n, AttnMask::Full);
        }
        let flat = |t: &Self::Tensor| self.reshape(t.clone(), &[n, heads * d]);
        let (qf, kf, vf) = (flat(q)?, flat(k)?, flat(v)?);
        let mut out = self.zeros(&[n, heads * d])?;
        let mut start = 0;
        for &len in lens.iter().filter(|&&l| l > 0) {
            let part = |t: &Self::Tensor| {
                self.reshape(self.slice_rows(t, start, start + len)?, &[len, heads, d])
            };
            let a = self.attention(&part(&qf)?, &part(&kf)?, &part(&vf)?, len, AttnMask::Full)?;
            let rows: Vec<usize> = (start..start + len).collect();
            self.scatter_rows(&mut out, &rows, &a)?;
            start += len;
        }
        Ok(out)
    }

    /// The ViT's attention from its fused projection: `qkv [n, 3 * heads * d]` holds each row's
    /// q, k and v side by side; q and k are rotated by `rope` = `[cos, sin]` (`[n, d]`, as
    /// [`Backend::rope`]), then attention runs within each run of `lens` rows (as
    /// [`Backend::attention_segments`]). Returns `[n, heads * d]`. One op, so that a GPU can
    /// split, rotate and pack for its attention kernel in one pass over the rows.
    fn rope_attention_segments(
        &self,
        qkv: &Self::Tensor,
        heads: usize,
        rope: [&Self::Tensor; 2],
        lens: &[usize],
    ) -> Result<Self::Tensor> {
        rope_attention_segments_op_by_op(self, qkv, heads, rope, lens)
    }

    // ---- gathers and row updates ----
    /// Rows of `table [vocab, h]` picked by the token ids in `ids [n]` -> `[n, h]`. Ids come
    /// from device memory so that a recorded step reads new tokens; callers check them
    /// against the vocabulary first.
    fn embedding(&self, table: &Self::Weight, ids: &Self::Ids) -> Result<Self::Tensor>;
    /// Rows of `x [n, c]` picked by `rows` -> `[rows, c]` (the rows whose logits a step needs).
    fn gather_rows(&self, x: &Self::Tensor, rows: &Self::Ids) -> Result<Self::Tensor>;
    /// `out[i] = Σ_t weights[i*taps + t] · table[index[i*taps + t]]`: interpolating a learned
    /// position table onto an image grid.
    fn weighted_gather(
        &self,
        table: &Self::Tensor,
        index: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<Self::Tensor>;
    /// Rows `start..end` as a new tensor.
    fn slice_rows(&self, x: &Self::Tensor, start: usize, end: usize) -> Result<Self::Tensor>;
    /// Overwrites all of `dst` with `values` from the host. The per-token inputs of a decode
    /// step (token id, cache slot, rotary row) are written this way into buffers that stay put,
    /// so the step's kernels read the same addresses every time (what a CUDA graph replays).
    fn write(&self, dst: &mut Self::Tensor, values: &[f32]) -> Result<()>;
    /// `cache[slots[i]] = rows[i]` for every row of `rows [n, heads * dim]` (or `[n, heads,
    /// dim]`): a step's keys or values into the paged cache, at slots read from the device.
    /// The model writes its cache through [`Backend::qkv_to_cache`]; the CPU reference's is
    /// built on this, and only the twin tests (`twin.rs`, `cuda/tests/cuda_twin.rs`) call the
    /// CUDA kernel alone, so it stays checked; kept for them.
    fn write_kv(
        &self,
        cache: &mut Self::Cache,
        slots: &Self::Ids,
        rows: &Self::Tensor,
    ) -> Result<()>;
    /// The attention inputs of a step, from the fused projection `qkv [n, (hq + 2 hkv) d]`
    /// (q heads, then k, then v): q and k RMS-normed per head (where `how.qk_norm` is given)
    /// and rotated as `how` says, k and
    /// v written into `k_cache`, `v_cache` at its slots (as [`Backend::write_kv`]). Returns q
    /// `[n, hq, d]`. One pass instead of a split, two norms, two rotations and two writes.
    fn qkv_to_cache(
        &self,
        qkv: &Self::Tensor,
        how: &QkvToCache<Self>,
        k_cache: &mut Self::Cache,
        v_cache: &mut Self::Cache,
    ) -> Result<Self::Tensor>;
    /// Attention of every sequence's queries `q [rows, hq, d]` over its cached keys and
    /// values (GQA: `hq` a multiple of the cache's heads), laid out by `batch`. Returns
    /// `[rows, hq * d]`; rows that belong to no sequence are zero.
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Cache,
        v: &Self::Cache,
        batch: &PagedBatch<Self>,
    ) -> Result<Self::Tensor>;
    /// `dst[rows[i]] = src[i]` (placing image embeddings at the image-token positions).
    fn scatter_rows(
        &self,
        dst: &mut Self::Tensor,
        rows: &[usize],
        src: &Self::Tensor,
    ) -> Result<()>;
    /// `dst[rows[i]] += src[i]` (DeepStack injection).
    fn add_rows(&self, dst: &mut Self::Tensor, rows: &[usize], src: &Self::Tensor) -> Result<()>;
    /// The ViT's input from an image's bytes: `rgb` is its `height`×`width`×3 bytes, each of
    /// which becomes its channel's entry of `table` (`[3 · 256]`, channel-major), laid out as
    /// [`crate::patches::patchify`] does: `[patches, layout.patch_dim()]` on the device. A GPU
    /// uploads the bytes, a quarter of the values' size, and computes the values there.
    fn patchify(
        &self,
        rgb: &[u8],
        height: usize,
        width: usize,
        table: &[f32],
        layout: PatchLayout,
    ) -> Result<Self::Tensor> {
        self.upload(&crate::patches::patchify(
            rgb, height, width, table, layout,
        )?)
    }
}
