//! The CUDA backend: every op of [`Backend`] on an NVIDIA GPU, each checked against its CPU
//! twin (`cuda/tests/cuda_twin.rs` at the real model sizes; [`CudaBackend::open_verified`] at
//! every start, on the GPU at hand).
//!
//! Weights (the matrices of `linear` and the embedding table) and the paged KV cache are f16 on
//! the device: decoding a token reads each weight once and its sequence's cache once, so half
//! the bytes is twice the tokens/s, and prefill GEMMs run on tensor cores. A checkpoint's
//! bf16/f32 values are rounded to f16 at load. Activations, norm weights and biases are f32,
//! and every sum accumulates in f32.
//!
//! Kernels are `cuda/kernels/*.cu`, embedded with `include_str!`, compiled at first use by
//! NVRTC for the GPU present (see [`compile`]) and loaded once per backend (with
//! `VLM_KERNEL_DIR=cuda/kernels` the files are read from that directory instead, so a kernel can
//! be edited and re-measured without rebuilding); large GEMMs go to
//! cuBLAS, decode GEMVs to our own kernels. The CUDA libraries are loaded dynamically, so the
//! binary builds and runs without CUDA, and [`CudaBackend::new`] answers "no GPU" with an error
//! instead of a crash.
//!
//! The files, bottom up (each uses only those above it; none uses this file's impl):
//! - `error.rs`: the one way a failed call becomes an [`Error`];
//! - [`compile`]: NVRTC and the PTX cache; `kernels.rs`: which kernel is in which `.cu` file,
//!   and every name and launch constant the Rust side shares with the kernels (the GEMVs'
//!   warps, splits and staged chunks, the flash tiles, ...);
//! - `pool.rs`: the memory pool of a recorded step; `tensor.rs`: the device types;
//! - `lt.rs` (cuBLASLt) and `staging.rs` (pinned host memory);
//! - `context.rs`: opens the GPU (libraries, stream, cuBLAS, kernels, the self-check);
//! - `launch.rs`: the helpers every op launches through, and per-op timing; `recording.rs`:
//!   graph capture;
//! - the ops by family, each body called from the one trait impl below: `linear.rs` (GEMVs
//!   and GEMMs), `int_weights.rs` (quantized weights: upload, their GEMVs, f16 for GEMMs), `w8a8.rs`
//!   (FP8 weights' W8A8 GEMM on Hopper), `norm.rs`, `attention.rs`, `gather.rs`, `memory.rs`, `sampling.rs` (each
//!   row's next token);
//! - [`doctor`]: `vlm doctor`'s checks.

mod attention;
pub mod compile;
mod context;
pub mod doctor;
mod error;
mod gather;
mod int_weights;
mod kernels;
mod launch;
mod linear;
mod lt;
mod memory;
mod norm;
mod pool;
mod recording;
mod sampling;
mod staging;
mod tensor;
mod w8a8;

use std::sync::Arc;

use crate::backend::{
    rms_norm_mlp_op_by_op, AttentionWeights, AttnMask, Backend, GeluKind, LayerNormParams,
    PagedBatch, Projection, QkvToCache, SampleIo,
};
use crate::{Embeddings, Error, HostTensor, Result};
use error::cuda_err;
use launch::{same_shape, width_of};

pub use context::{cuda_libraries, nvrtc_available, skip_test, test_gpu, CudaBackend, CudaLibrary};
pub use int_weights::{
    dequant_chunk_rows, with_dequant_chunk_rows, with_int_gemm_on_mma, with_int_gemm_rows,
    IntGemmGrid, DEQUANT_SCRATCH_HALVES,
};
pub use kernels::{
    compile_all_ptx, with_decode_attention, with_prefill_attention, DecodeAttention, IntGemmBlock,
    PrefillAttention,
};
pub use tensor::{CudaCache, CudaIds, CudaStepGraph, CudaTensor, CudaWeight};
pub use w8a8::{with_fp8_gemm, Fp8Gemm};

// One block, as a trait impl must be: an op longer than a few lines is a call of its body,
// `<op>_impl`, in its family's file.
impl Backend for CudaBackend {
    type Weight = CudaWeight;
    type Graph = CudaStepGraph;
    type Tensor = CudaTensor;
    type Ids = CudaIds;
    type Cache = CudaCache;
    const WEIGHT_BYTES: usize = 2;
    const CACHE_BYTES: usize = 2;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn time_copy(&self, bytes: usize) -> Result<std::time::Duration> {
        self.time_copy_impl(bytes)
    }

    fn upload(&self, t: &HostTensor) -> Result<CudaTensor> {
        self.upload_impl(t)
    }

    fn download(&self, t: &CudaTensor) -> Result<HostTensor> {
        self.download_impl(t)
    }

    fn download_embeddings(&self, t: &CudaTensor) -> Result<Embeddings> {
        self.download_embeddings_impl(t)
    }

    fn upload_embeddings(&self, e: &Embeddings) -> Result<CudaTensor> {
        self.upload_embeddings_impl(e)
    }

    fn embeddings_to_host(&self, e: &Embeddings) -> Result<Embeddings> {
        self.embeddings_to_host_impl(e)
    }

    fn hand_off(&self, t: CudaTensor, identity: Vec<u8>) -> Result<Embeddings> {
        self.hand_off_impl(t, identity)
    }

    fn zeros(&self, shape: &[usize]) -> Result<CudaTensor> {
        self.alloc_zeroed(shape.to_vec())
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.synchronize().ok()?;
        // Device-wide (other processes included).
        cudarc::driver::result::mem_get_info().ok()
    }

    fn release_cached_memory(&self, keep: usize) -> Result<usize> {
        self.synchronize()?;
        context::trim_device_pool(&self.inner.stream, keep)
    }

    fn copy(&self, dst: &mut CudaTensor, src: &CudaTensor) -> Result<()> {
        self.copy_impl(dst, src)
    }

    fn record(&self, ops: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaStepGraph>> {
        self.record_impl(ops)
    }

    fn replay(&self, graph: &CudaStepGraph) -> Result<()> {
        graph
            .graph
            .launch()
            .map_err(|e| cuda_err("replaying a recording")(&e))
    }

    fn upload_weight(&self, t: &HostTensor) -> Result<CudaWeight> {
        self.upload_weight_impl(t)
    }

    fn random_weight(&self, shape: &[usize], key: u64, bound: f32) -> Result<CudaWeight> {
        self.random_weight_impl(shape, key, bound)
    }

    fn weight_bytes(&self, w: &CudaWeight) -> usize {
        match &w.data {
            tensor::WeightData::F16(b) => b.len() * 2,
            tensor::WeightData::Int(iw) => iw.words.len() * 4 + iw.sz.len() * 2,
        }
    }

    fn upload_int_weight(&self, m: &crate::quant::IntMatrix) -> Result<CudaWeight> {
        self.upload_int_weight_impl(m)
    }

    fn upload_fp8_weight(&self, m: &crate::quant::fp8::Fp8Matrix) -> Result<CudaWeight> {
        self.upload_fp8_weight_impl(m)
    }

    fn random_int_weight(
        &self,
        shape: &[usize],
        key: u64,
        bound: f32,
        to: crate::quant::QuantizeTo,
    ) -> Result<CudaWeight> {
        self.random_int_weight_impl(shape, key, bound, to)
    }

    fn random_uniform(&self, shape: &[usize], key: u64, bound: f32) -> Result<CudaTensor> {
        self.random_uniform_impl(shape, key, bound)
    }

    fn shape<'a>(&self, t: &'a CudaTensor) -> &'a [usize] {
        &t.shape
    }

    fn reshape(&self, mut t: CudaTensor, shape: &[usize]) -> Result<CudaTensor> {
        if shape.iter().product::<usize>() != t.len() {
            return Err(Error::shape(
                "reshape",
                format!("cannot view {:?} as {shape:?}", t.shape),
            ));
        }
        t.shape = shape.to_vec();
        Ok(t)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, b: Option<&CudaTensor>) -> Result<CudaTensor> {
        self.linear_impl(x, w, b)
    }

    fn rms_norm_linear(
        &self,
        x: &CudaTensor,
        norm: &CudaTensor,
        eps: f32,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        self.rms_norm_linear_impl(x, norm, eps, w, b)
    }

    fn add_linear(
        &self,
        x: &mut CudaTensor,
        a: &CudaTensor,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<()> {
        self.add_linear_impl(x, a, w, b)
    }

    fn layer_norm_linears(
        &self,
        x: &CudaTensor,
        norm: LayerNormParams<Self>,
        projections: &[Projection<Self>],
    ) -> Result<Vec<CudaTensor>> {
        self.layer_norm_linears_impl(x, norm, projections)
    }

    fn layer_norm_mlp(
        &self,
        x: &mut CudaTensor,
        norm: LayerNormParams<Self>,
        up: Projection<Self>,
        act: GeluKind,
        down: Projection<Self>,
    ) -> Result<()> {
        self.layer_norm_mlp_impl(x, norm, up, act, down)
    }

    fn layer_norm_rope_attention(
        &self,
        x: &mut CudaTensor,
        norm: LayerNormParams<Self>,
        attn: AttentionWeights<Self>,
        rope: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Result<()> {
        self.layer_norm_rope_attention_impl(x, norm, attn, rope, lens)
    }

    fn swiglu(&self, x: &CudaTensor, gate_up: &CudaWeight) -> Result<CudaTensor> {
        self.swiglu_with("swiglu", x, None, gate_up)
    }

    fn rms_norm_mlp(
        &self,
        x: &mut CudaTensor,
        norm: &CudaTensor,
        eps: f32,
        gate_up: &CudaWeight,
        down: &CudaWeight,
    ) -> Result<()> {
        if self.normed_gemv_fits(x) {
            // Decode rows: the fused norm + gate/up + SwiGLU GEMV, then down added in its GEMV.
            return rms_norm_mlp_op_by_op(self, x, norm, eps, gate_up, down);
        }
        self.rms_norm_mlp_f16(x, norm, eps, gate_up, down)
    }

    fn rms_norm_swiglu(
        &self,
        x: &CudaTensor,
        norm: &CudaTensor,
        eps: f32,
        gate_up: &CudaWeight,
    ) -> Result<CudaTensor> {
        width_of("rms_norm_swiglu", x, norm)?;
        self.swiglu_with("rms_norm_swiglu", x, Some((norm, eps)), gate_up)
    }

    fn stack_weights(&self, parts: &[&CudaWeight]) -> Result<CudaWeight> {
        self.stack_weights_impl(parts)
    }

    fn qkv_to_cache(
        &self,
        qkv: &CudaTensor,
        how: &QkvToCache<Self>,
        k_cache: &mut CudaCache,
        v_cache: &mut CudaCache,
    ) -> Result<CudaTensor> {
        self.qkv_to_cache_impl(qkv, how, k_cache, v_cache)
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        same_shape("add", a, b)?;
        self.elementwise("add_f32", a, Some(b))
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        self.layer_norm_impl(x, w, b, eps)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        width_of("rms_norm", x, w)?;
        let mut out = self.alloc(x.shape.clone())?;
        let buf = Arc::get_mut(&mut out.buf).expect("fresh");
        self.launch_rms_norm("rms_norm_f32", x, w, eps, buf)?;
        Ok(out)
    }

    fn gelu(&self, x: &CudaTensor, kind: GeluKind) -> Result<CudaTensor> {
        match kind {
            GeluKind::Tanh => self.elementwise("gelu_tanh_f32", x, None),
            GeluKind::Erf => self.elementwise("gelu_erf_f32", x, None),
        }
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        same_shape("silu_mul", gate, up)?;
        self.elementwise("silu_mul_f32", gate, Some(up))
    }

    fn rope(&self, x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor) -> Result<CudaTensor> {
        self.rope_impl(x, cos, sin)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        kv_len: usize,
        mask: AttnMask,
    ) -> Result<CudaTensor> {
        self.attention_impl(q, k, v, kv_len, mask)
    }

    fn rope_attention_segments(
        &self,
        qkv: &CudaTensor,
        heads: usize,
        rope: [&CudaTensor; 2],
        lens: &[usize],
    ) -> Result<CudaTensor> {
        self.rope_attention_segments_impl(qkv, heads, rope, lens)
    }

    fn embedding(&self, table: &CudaWeight, ids: &CudaIds) -> Result<CudaTensor> {
        self.embedding_impl(table, ids)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &CudaIds) -> Result<CudaTensor> {
        self.gather_rows_impl(x, rows)
    }

    fn patchify(
        &self,
        rgb: &[u8],
        height: usize,
        width: usize,
        table: &[f32],
        layout: crate::patches::PatchLayout,
    ) -> Result<CudaTensor> {
        self.patchify_impl(rgb, height, width, table, layout)
    }

    fn weighted_gather(
        &self,
        table: &CudaTensor,
        index: &[u32],
        weights: &[f32],
        taps: usize,
    ) -> Result<CudaTensor> {
        self.weighted_gather_impl(table, index, weights, taps)
    }

    fn slice_rows(&self, x: &CudaTensor, start: usize, end: usize) -> Result<CudaTensor> {
        self.slice_rows_impl(x, start, end)
    }

    fn write(&self, dst: &mut CudaTensor, values: &[f32]) -> Result<()> {
        self.write_impl(dst, values)
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)
    }

    fn time_ops(&self, on: bool) -> Result<bool> {
        self.time_ops_impl(on)
    }

    fn timing_ops(&self) -> bool {
        self.inner.op_events.lock().is_ok_and(|e| e.is_some())
    }

    fn op_times(&self) -> Result<Vec<crate::backend::OpTime>> {
        self.op_times_impl()
    }

    fn upload_ids(&self, values: &[u32]) -> Result<CudaIds> {
        self.upload_ids_impl(values)
    }

    fn write_ids_at(&self, dst: &mut CudaIds, at: usize, values: &[u32]) -> Result<()> {
        self.write_ids_impl(dst, at, values)
    }

    fn download_ids(&self, ids: &CudaIds, n: usize) -> Result<Vec<u32>> {
        self.download_ids_impl(ids, n)
    }

    fn zeros_cache(
        &self,
        slots: usize,
        heads: usize,
        dim: usize,
        format: crate::KvFormat,
    ) -> Result<CudaCache> {
        self.zeros_cache_impl(slots, heads, dim, format)
    }

    fn check_kv_format(&self, format: crate::KvFormat, heads: usize, dim: usize) -> Result<()> {
        self.check_kv_format_impl(format, heads, dim)
    }

    fn download_cache(&self, cache: &CudaCache) -> Result<HostTensor> {
        self.download_cache_impl(cache)
    }

    fn sample_rows(&self, logits: &CudaTensor, io: SampleIo<'_, Self>) -> Result<()> {
        self.sample_rows_impl(logits, io)
    }

    fn write_kv(&self, cache: &mut CudaCache, slots: &CudaIds, rows: &CudaTensor) -> Result<()> {
        self.write_kv_impl(cache, slots, rows)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k: &CudaCache,
        v: &CudaCache,
        batch: &PagedBatch<Self>,
    ) -> Result<CudaTensor> {
        self.paged_attention_impl(q, k, v, batch)
    }

    fn scatter_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        self.scatter(dst, rows, src, false)
    }

    fn add_rows(&self, dst: &mut CudaTensor, rows: &[usize], src: &CudaTensor) -> Result<()> {
        self.scatter(dst, rows, src, true)
    }
}
