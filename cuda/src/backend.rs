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

pub trait Backend: Send + Sync + 'static {
    type Tensor: Clone + Send + Sync;

    /// Short name for logs and errors ("cpu", "cuda").
    fn name(&self) -> &'static str;

    // ---- memory ----
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;
    fn zeros(&self, shape: &[usize]) -> Result<Self::Tensor>;
    /// `shape` filled with [`crate::random::uniform`]`(key, i, bound)` at element `i`: the
    /// matrices of a random-weight model. Built on the host unless the backend can do better.
    fn random_uniform(&self, shape: &[usize], key: u64, bound: f32) -> Result<Self::Tensor> {
        self.upload(&crate::random::uniform_tensor(shape, key, bound))
    }
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// Same data viewed with another shape of the same element count.
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor>;

    // ---- dense math ----
    /// `x [n, k] · wᵀ + b` with `w [m, k]` (PyTorch's `nn.Linear` layout) -> `[n, m]`.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
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
    /// Rows of `table [vocab, h]` picked by `ids` -> `[ids.len(), h]`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
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
