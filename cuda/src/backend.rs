//! The ops interface: everything the two model stages compute, and nothing more.
//!
//! The vision tower and the text decoder are written once, generically over [`Backend`]. A
//! backend owns its tensor type (host memory for the CPU, device memory for CUDA); models move
//! data across only through `upload`/`download`. Ops work on row-major tensors; "rows" means
//! the matrix view `[n, last_dim]`. Shapes are checked and reported as [`crate::Error::Shape`].

use crate::{HostTensor, Result};

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

pub trait Backend: Send + Sync + 'static {
    /// A recorded sequence of ops ([`Backend::record`]), e.g. a CUDA graph; `()` where there
    /// is none.
    type Graph;
    /// Activations, norm weights, biases, caches.
    type Tensor: Clone + Send + Sync;
    /// The matrices of `linear` and the embedding table, stored as the backend reads them best:
    /// f32 on the CPU (the reference), f16 on the GPU (half the bytes each decoded token reads,
    /// tensor-core GEMMs).
    type Weight: Clone + Send + Sync;

    /// Bytes per element of a [`Backend::Weight`]: what decoding reads per parameter.
    const WEIGHT_BYTES: usize;

    /// Short name for logs and errors ("cpu", "cuda").
    fn name(&self) -> &'static str;
    /// Device memory in use now, in bytes, where the backend has its own memory (a GPU; for the
    /// benchmark's memory rows). With CUDA's pool allocator, memory freed stays reserved, so
    /// after a stage has run this is its peak.
    fn memory_in_use(&self) -> Option<usize> {
        None
    }

    // ---- memory ----
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;
    fn zeros(&self, shape: &[usize]) -> Result<Self::Tensor>;
    /// `dst = src` in place (same element count); `dst` keeps its buffer.
    fn copy(&self, dst: &mut Self::Tensor, src: &Self::Tensor) -> Result<()>;
    /// `shape` filled with [`crate::random::uniform`]`(key, i, bound)` at element `i`: the
    /// matrices of a random-weight model. Built on the host unless the backend can do better.
    fn random_uniform(&self, shape: &[usize], key: u64, bound: f32) -> Result<Self::Tensor> {
        self.upload(&crate::random::uniform_tensor(shape, key, bound))
    }
    /// A weight matrix `[out, in]` (or table `[rows, width]`) from f32 host values.
    fn upload_weight(&self, t: &HostTensor) -> Result<Self::Weight>;
    /// A weight filled like [`Backend::random_uniform`].
    fn random_weight(&self, shape: &[usize], key: u64, bound: f32) -> Result<Self::Weight> {
        self.upload_weight(&crate::random::uniform_tensor(shape, key, bound))
    }
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// Same data viewed with another shape of the same element count.
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    /// Index of the largest value of `x` (one row of logits), the first on ties, as
    /// `torch.argmax`: greedy decoding on the device, so only the token id comes back.
    fn argmax(&self, x: &Self::Tensor) -> Result<u32> {
        Ok(argmax(self.download(x)?.data()))
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
    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, the text MLP's SwiGLU before `down_proj`. Backends may
    /// fuse it (one pass over both matrices when decoding, seed 002); this is the reference.
    fn swiglu(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
    ) -> Result<Self::Tensor> {
        self.silu_mul(&self.linear(x, gate, None)?, &self.linear(x, up, None)?)
    }
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
    fn gelu(&self, x: &Self::Tensor, kind: GeluKind) -> Result<Self::Tensor>;
    /// `silu(gate) * up`, the SwiGLU of the text MLP.
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

    // ---- gathers and row updates ----
    /// Rows of `table [vocab, h]` picked by the token ids in `ids [n]` -> `[n, h]`. Ids are
    /// held as f32 (exact below 2^24, far above any vocabulary) so that a decode step can read
    /// its token from device memory; callers check them against the vocabulary first.
    fn embedding(&self, table: &Self::Weight, ids: &Self::Tensor) -> Result<Self::Tensor>;
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
    /// `dst[slot] = src` for the one row of `src`, `slot` read from `slot [1]` (decode's KV
    /// cache write; the caller keeps the slot within `dst`).
    fn write_row_at(
        &self,
        dst: &mut Self::Tensor,
        slot: &Self::Tensor,
        src: &Self::Tensor,
    ) -> Result<()>;
    /// Decode attention: `q [1, hq, d]`, the token in cache slot `slot` (read from `slot [1]`),
    /// attends to slots `0..=slot` of `k`, `v` `[slots, hkv, d]`. Same result as
    /// [`Backend::attention`] with `Causal { first_query_slot: slot }`; GPUs split the keys
    /// across blocks for long contexts (seeds 000, 001). Returns `[1, hq * d]`.
    fn decode_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        slot: &Self::Tensor,
    ) -> Result<Self::Tensor>;
    /// `dst[start + i] = src[i]` for every row of `src` (writing the KV cache).
    fn write_rows(&self, dst: &mut Self::Tensor, start: usize, src: &Self::Tensor) -> Result<()>;
    /// `dst[rows[i]] = src[i]` (placing image embeddings at the image-token positions).
    fn scatter_rows(
        &self,
        dst: &mut Self::Tensor,
        rows: &[usize],
        src: &Self::Tensor,
    ) -> Result<()>;
    /// `dst[rows[i]] += src[i]` (DeepStack injection).
    fn add_rows(&self, dst: &mut Self::Tensor, rows: &[usize], src: &Self::Tensor) -> Result<()>;
}
