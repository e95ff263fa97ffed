//! The projections' launches: our GEMVs for decode rows (one kernel per row count, with the
//! input's RMSNorm or SwiGLU fused), cuBLAS for more rows (cuBLASLt, lt.rs, where a bias,
//! GELU or f16 output goes into the GEMM's epilogue), and the bodies of the [`Backend`] ops
//! that use them (`linear`, `rms_norm_linear`, `add_linear`, `layer_norm_linears`,
//! `layer_norm_mlp`; `swiglu`, `rms_norm_swiglu` and `rms_norm_mlp` through `swiglu_with` and
//! `rms_norm_mlp_f16`), which the trait's impl in `mod.rs` calls, and the GEMMs of
//! `layer_norm_rope_attention` (attention.rs); kernels in `cuda/kernels/weights_f16.cu`.
//!
//! [`Backend`]: crate::Backend

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::error::cuda_err;
use super::int_weights::{chunked_int_gemm, int_gemm_max_passes};
use super::kernels::{
    Gemv, GEMV_MAX_ROWS, GEMV_SPLIT, GEMV_WARPS, INT_GEMM_MAX_ROWS, STREAM_STAGED,
};
use super::launch::{arg, width_of};
use super::lt::{Epilogue, LtGemm, LtOperands, LtOut, LtShape};
use super::tensor::WeightData;
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::backend::{layer_norm_linears_op_by_op, layer_norm_mlp_op_by_op};
use crate::{Backend, Error, GeluKind, LayerNormParams, Projection, Result};

/// What the batched text MLP stores its SwiGLU products at in f16 (and its down GEMM undoes):
/// a power of two, so both steps are exact, that moves f16's overflow from 65504 to ~1e6 (Qwen3
/// models' massive activations reach ~5e4 in a few channels) and costs precision only below
/// 1e-3, where the products are noise in the down projection's sums.
pub(super) const SWIGLU_F16_SCALE: f32 = 1.0 / 16.0;

/// Blocks of a streamed GEMV an SM: two, so that the next kernel's blocks find room beside
/// the running one's (cuda/bench/gemv_chain.cu measured one and two).
const STREAM_BLOCKS_PER_SM: usize = 2;
/// The streamed GEMVs' staged weights, bytes a block.
const STREAM_STAGE_BYTES: usize = GEMV_WARPS as usize * STREAM_STAGED * 32 * 16;

/// `shape` with its last dim (the columns) replaced by `cols`.
pub(super) fn with_cols(shape: &[usize], cols: usize) -> Vec<usize> {
    let mut out = shape[..shape.len().saturating_sub(1)].to_vec();
    out.push(cols);
    out
}

/// What a cuBLAS GEMM here writes: f32 (activations, a residual stream) or f16 (the operand of
/// the GEMM after it).
pub(super) trait GemmOut: DeviceRepr {
    const TYPE: cudarc::cublas::sys::cudaDataType_t;
    /// Whether it is f16 (the integer GEMM's kernel for it: `_f16` or `_f32`).
    const F16: bool;
}

impl GemmOut for f32 {
    const TYPE: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
    const F16: bool = false;
}

impl GemmOut for half::f16 {
    const TYPE: cudarc::cublas::sys::cudaDataType_t =
        cudarc::cublas::sys::cudaDataType_t::CUDA_R_16F;
    const F16: bool = true;
}

impl CudaBackend {
    /// Whether GEMV `kind` of `x`'s rows takes the streamed kernel: under programmatic
    /// dependent launch, where its shared memory fits one block (rows of 12,288 floats up to
    /// 3). The rest take the classic kernels.
    fn streamed(&self, kind: Gemv, x: &CudaTensor) -> bool {
        self.programmatic_launch() && Self::stream_smem(kind, x) <= self.inner.gemv_smem
    }

    /// A streamed GEMV's dynamic shared memory (weights_f16.cu's warp_stage): x's rows, the
    /// norm weights if normed, then the staged weights, each part 16-byte aligned.
    fn stream_smem(kind: Gemv, x: &CudaTensor) -> usize {
        let floats = |n: usize| (n * std::mem::size_of::<f32>()).next_multiple_of(16);
        floats(x.len()) + if kind.normed() { floats(x.cols()) } else { 0 } + STREAM_STAGE_BYTES
    }

    /// The launch of GEMV kernel `name` for `m` output columns. The classic kernels: GEMV_SPLIT
    /// warps per column; the normed ones stage x in shared memory once per block, so they get
    /// no more blocks than the GPU runs at once, and each block loops over the columns. The
    /// streamed ones: a warp per column, STREAM_BLOCKS_PER_SM blocks an SM at most.
    fn gemv_config(
        &self,
        name: &str,
        m: usize,
        kind: Gemv,
        x: &CudaTensor,
        streamed: bool,
    ) -> LaunchConfig {
        let block = GEMV_WARPS * 32;
        if streamed {
            let blocks = m
                .div_ceil(GEMV_WARPS as usize)
                .clamp(1, STREAM_BLOCKS_PER_SM * self.inner.sm_count);
            return LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: Self::stream_smem(kind, x) as u32,
            };
        }
        let staged = if kind.normed() {
            x.len() * std::mem::size_of::<f32>()
        } else {
            0
        };
        let mut blocks = (m as u32).div_ceil(GEMV_WARPS / GEMV_SPLIT);
        if kind.normed() {
            let resident = self
                .kernel(name)
                .occupancy_max_active_blocks_per_multiprocessor(block, staged, None)
                .unwrap_or(1)
                .max(1);
            blocks = blocks.min(resident * self.inner.sm_count as u32);
        }
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: staged as u32,
        }
    }

    /// Launches GEMV `kind` for x's rows (1..=GEMV_MAX_ROWS) into `out`, `m` columns: with
    /// GEMV_KERNEL's arguments (weights_f16.cu) for the plain kinds, SWIGLU_KERNEL's (no bias,
    /// never accumulating) for the SwiGLU ones. The streamed kernels take the ticket too and
    /// go out under programmatic dependent launch.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        kind: Gemv,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
        w: &CudaWeight,
        bias: Option<&CudaTensor>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
        m: usize,
    ) -> Result<()> {
        if let Some(iw) = self.on_w8a8(w) {
            // An FP8 weight whose larger GEMMs quantize their activations: these rows are
            // rounded as those GEMMs round theirs (the norm taken on the way), so a request's
            // numbers do not depend on how many rows its step had.
            let rounded = self.w8a8_rounded(x, norm)?;
            let kind = kind.without_norm();
            return self.launch_int_gemv(kind, &rounded, None, iw, bias, out, accumulate, m);
        }
        let w = match &w.data {
            WeightData::F16(buf) => buf,
            WeightData::Int(iw) => {
                return self.launch_int_gemv(kind, x, norm, iw, bias, out, accumulate, m)
            }
        };
        let streamed = self.streamed(kind, x);
        let name = kind.kernel(x.rows(), streamed);
        let cfg = self.gemv_config(name, m, kind, x, streamed);
        let stream = &self.inner.stream;
        let (has_bias, acc) = (bias.is_some() as i32, accumulate as i32);
        let (mm, kk) = (m as i32, x.cols() as i32);
        let eps = norm.map_or(0.0f32, |(_, eps)| eps);
        // Pointers the kernel never reads (no bias, no norm) are given x.
        let (xp, _x) = x.buf.device_ptr(stream);
        let (np, _n) = norm.map_or(&*x.buf, |(n, _)| &*n.buf).device_ptr(stream);
        let (bp, _b) = bias.map_or(&*x.buf, |b| &*b.buf).device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (tp, _t) = self.inner.gemv_ticket.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut args = vec![arg(&xp), arg(&np), arg(&eps), arg(&wp)];
        match kind {
            Gemv::Plain | Gemv::Normed => {
                args.extend([arg(&bp), arg(&has_bias), arg(&op), arg(&acc)])
            }
            Gemv::Swiglu | Gemv::NormedSwiglu => args.push(arg(&op)),
        }
        args.extend([arg(&mm), arg(&kk)]);
        if streamed {
            args.push(arg(&tp));
        }
        // SAFETY: the arguments are the kernel's (above), in its order; shapes are checked by
        // the callers; a classic normed kernel's staged rows fit its shared memory
        // (normed_gemv_fits), and a streamed kernel is taken only where all it stages fits
        // (streamed); a streamed kernel reads what the kernel before it writes only after its
        // grid_wait.
        let launched = unsafe { self.launch_args(name, cfg, &mut args, streamed) };
        self.launched(name, launched)
    }

    /// `x [.., k]` against `w [m, k]` (and `b [m]`): returns `m`.
    pub(super) fn check_linear(
        &self,
        op: &'static str,
        x: &CudaTensor,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<usize> {
        match w.shape[..] {
            [m, k] if k == x.cols() && b.is_none_or(|b| b.len() == m) => Ok(m),
            _ => Err(Error::shape(
                op,
                format!(
                    "input {:?}, weight {:?}, bias {:?}",
                    x.shape,
                    w.shape,
                    b.map(|b| &b.shape)
                ),
            )),
        }
    }

    /// `x` rounded to f16, for the tensor-core GEMM.
    pub(super) fn to_f16(&self, x: &CudaTensor) -> Result<CudaSlice<half::f16>> {
        let n = x.len() as u64;
        let mut out = self.alloc_f16(x.len())?;
        let name = "cast_f32_to_f16";
        let launched = {
            let stream = &self.inner.stream;
            let (xp, _x) = x.buf.device_ptr(stream);
            let (op, _o) = out.device_ptr_mut(stream);
            let mut args = [arg(&xp), arg(&op), arg(&n)];
            let cfg = Self::fill_config(n);
            // SAFETY: matches cast_f32_to_f16; out holds n halves. The kernel reads nothing
            // before its grid_wait.
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) }
        };
        self.launched(name, launched)?;
        Ok(out)
    }

    /// `out (+)= x · wᵀ (+ b)` for up to GEMV_MAX_ROWS rows of `x`, with `norm` (Gemv::Normed)
    /// each row of `x` RMS-normed first. Shapes checked by the caller: `out` holds `rows x m`;
    /// [`Self::normed_gemv_fits`] for the normed kernel.
    pub(super) fn gemv(
        &self,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let kind = if norm.is_some() {
            Gemv::Normed
        } else {
            Gemv::Plain
        };
        self.launch_gemv(kind, x, norm, w, b, out, accumulate, w.shape[0])
    }

    /// Whether the normed GEMV kernels take `x`: up to GEMV_MAX_ROWS rows, all of which they
    /// stage in shared memory.
    pub(super) fn normed_gemv_fits(&self, x: &CudaTensor) -> bool {
        (1..=GEMV_MAX_ROWS).contains(&x.rows())
            && x.len() * std::mem::size_of::<f32>() <= self.inner.gemv_smem
    }

    /// `out = x · wᵀ (+ out when accumulate)` on the tensor cores: x rounded to f16, f32
    /// accumulation and output. `out` holds `rows x m`.
    pub(super) fn gemm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        // An FP8 weight on the W8A8 GEMM reads x quantized straight from f32.
        if let Some(taken) = self.w8a8_weight::<f32>(w, x.rows(), accumulate)? {
            let x8 = self.quantize_rows_f32(x)?;
            return self.w8a8_gemm_rows(&x8, w, taken, out, accumulate, 1.0);
        }
        self.gemm_f16_not_w8a8(&self.to_f16(x)?, x.rows(), w, out, accumulate, 1.0)
    }

    /// [`Self::gemm`] of `x16`, `n` rows already rounded to f16, into f32 or (the operand of
    /// another GEMM) f16; accumulation is f32 either way.
    pub(super) fn gemm_f16<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        out: &mut CudaSlice<O>,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_f16_alpha(x16, n, w, out, accumulate, 1.0)
    }

    /// [`Self::gemm_f16`] with the product times `alpha` (f32) before it is stored or added.
    pub(super) fn gemm_f16_alpha<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        if let Some(taken) = self.w8a8_weight::<O>(w, n, accumulate)? {
            return self.w8a8_gemm(x16, n, w, taken, out, accumulate, alpha);
        }
        self.gemm_f16_not_w8a8(x16, n, w, out, accumulate, alpha)
    }

    /// [`Self::gemm_f16_alpha`] of a weight [`Self::w8a8_weight`] has said no to: the integer
    /// GEMM, or cuBLAS on f16 (dequantized in chunks if `w` is packed).
    fn gemm_f16_not_w8a8<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        let (k, m) = (w.shape[1], w.shape[0]);
        if let Some(iw) = self.int_gemm_weight(w, n) {
            return self.launch_int_gemm(x16, 0..n, iw, m, k, None, out, accumulate, alpha);
        }
        // Row-major out[n, m] = x[n, k] · w[m, k]ᵀ is column-major outᵀ[m, n] = w · xᵀ, with w
        // read transposed from its row-major [m, k] storage. f16 in, f32 accumulation. A
        // chunk of w's rows is a block of outᵀ's rows: the same GEMM from out + rows.start,
        // leading dimension m.
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        let stream = &self.inner.stream;
        let (xp, _x_guard) = x16.device_ptr(stream);
        let (op, _o_guard) = out.device_ptr_mut(stream);
        self.with_dense_f16(w, |rows, dense| {
            let (wp, _w_guard) = dense.device_ptr(stream);
            let chunk_out = op + (rows.start * std::mem::size_of::<O>()) as u64;
            use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
            // SAFETY: dense holds rows.len() * k f16 (w's rows), x16 n*k f16, out n*m of O, as
            // the leading dimensions say (the chunk's output starts rows.start elements into
            // out's first row); the guards keep the buffers alive and ordered on this stream
            // until the call is queued. With f32 compute, alpha and beta are f32 whatever the
            // output type.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.inner.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    rows.len() as i32,
                    n as i32,
                    k as i32,
                    (&alpha) as *const f32 as *const _,
                    wp as *const _,
                    cudaDataType_t::CUDA_R_16F,
                    k as i32,
                    xp as *const _,
                    cudaDataType_t::CUDA_R_16F,
                    k as i32,
                    (&beta) as *const f32 as *const _,
                    chunk_out as *mut _,
                    O::TYPE,
                    m as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| cuda_err("cuBLAS GemmEx (f16 x f16, f32 accumulation)")(&e))
        })?;
        self.op_done("cublas_gemm_f16")
    }

    /// `w`'s integer weight where the tensor-core integer GEMM takes it for `n` rows (the
    /// packed weights read once, not dequantized for cuBLAS), INT_GEMM_MAX_ROWS rows of x a
    /// pass ([`Self::launch_int_gemm`]): up to [`int_gemm_max_passes`] passes, or any number
    /// for a vocabulary-sized weight, which has no dequantization scratch
    /// ([`chunked_int_gemm`]).
    pub(super) fn int_gemm_weight<'a>(
        &self,
        w: &'a CudaWeight,
        n: usize,
    ) -> Option<&'a super::tensor::IntWeight> {
        match &w.data {
            WeightData::Int(iw)
                if self.int_gemm_takes(iw, n.min(INT_GEMM_MAX_ROWS), w.shape[1])
                    && (n <= int_gemm_max_passes() * INT_GEMM_MAX_ROWS
                        || chunked_int_gemm(self, iw, &w.shape)) =>
            {
                Some(iw)
            }
            _ => None,
        }
    }

    /// Whether [`Self::lt_gemm`] takes `w` in `shape`: cuBLASLt has an algorithm for it (asked
    /// once per shape), and `w` is f16 in one piece (an integer weight dequantized in chunks
    /// takes a plain GEMM a chunk at a time instead, its bias added apart).
    pub(super) fn lt_takes(&self, shape: &LtShape, w: &CudaWeight) -> Result<bool> {
        Ok(self.dense_whole(w)
            && self
                .inner
                .lt
                .algo(LtGemm::F16(*shape), self.inner.workspace)?
                .is_some())
    }

    /// `out (+)= x16 · wᵀ`, `shape.n` rows, then `shape.epilogue` with `bias`, on cuBLASLt
    /// (where [`Self::lt_takes`] says so; others are an error). `O` and `Bias` are the
    /// output's element type (f32 or f16, as `shape.out_kind` says).
    pub(super) fn lt_gemm<O: DeviceRepr, Bias: DeviceRepr>(
        &self,
        shape: &LtShape,
        x16: &CudaSlice<half::f16>,
        w: &CudaWeight,
        bias: &CudaSlice<Bias>,
        out: &mut CudaSlice<O>,
    ) -> Result<()> {
        let out_bytes = match shape.out_kind {
            LtOut::F32 { .. } => 4,
            LtOut::F16 => 2,
        };
        let (n, k, m) = (shape.n, shape.k, shape.m);
        if w.shape != [m, k]
            || std::mem::size_of::<O>() != out_bytes
            || std::mem::size_of::<Bias>() != out_bytes
            || x16.len() < n * k
            || bias.len() < m
            || out.len() < n * m
        {
            return Err(Error::shape(
                "cuBLASLt GEMM",
                format!("{shape:?} with weight {:?}", w.shape),
            ));
        }
        let Some(algo) = self
            .inner
            .lt
            .algo(LtGemm::F16(*shape), self.inner.workspace)?
        else {
            return Err(Error::Cuda {
                what: format!("cuBLASLt has no algorithm for {shape:?}"),
            });
        };
        if !self.dense_whole(w) {
            return Err(Error::shape(
                "cuBLASLt GEMM",
                format!("{:?}: dequantized in chunks (lt_takes says no)", w.shape),
            ));
        }
        let stream = &self.inner.stream;
        let (x, _x_guard) = x16.device_ptr(stream);
        let (b, _b_guard) = bias.device_ptr(stream);
        let (o, _o_guard) = out.device_ptr_mut(stream);
        self.with_dense_f16(w, |_all_rows, dense| {
            let (wp, _w_guard) = dense.device_ptr(stream);
            let operands = LtOperands {
                x,
                w: wp,
                bias: b,
                out: o,
                w_scales: 0,
                x_scales: 0,
            };
            // SAFETY: sizes and element types checked above, w in one piece; the guards keep
            // the buffers alive and ordered on this stream until the GEMM is queued (and the
            // buffers' owners free them stream-ordered, after it).
            unsafe {
                self.inner.lt.matmul(
                    stream.cu_stream(),
                    self.inner.workspace,
                    &LtGemm::F16(*shape),
                    algo,
                    &operands,
                    1.0,
                )
            }
        })?;
        self.op_done("cublaslt_gemm")
    }

    /// `out = x16 · wᵀ (+ b)` for `n` rows already rounded to f16: the bias in cuBLASLt's
    /// epilogue where it can, else broadcast into `out` first and accumulated onto.
    pub(super) fn project_f16(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let Some(b) = b else {
            return self.gemm_f16(x16, n, w, out, false);
        };
        let (m, k) = (w.shape[0], w.shape[1]);
        if let Some(iw) = self.int_gemm_weight(w, n) {
            return self.launch_int_gemm(x16, 0..n, iw, m, k, Some(&*b.buf), out, false, 1.0);
        }
        let shape = LtShape {
            n,
            k,
            m,
            out_kind: LtOut::F32 { accumulate: false },
            epilogue: Epilogue::Bias,
        };
        // FP8 weights the W8A8 GEMM takes get the bias broadcast below, then that GEMM.
        if self.w8a8_weight::<f32>(w, n, true)?.is_none() && self.lt_takes(&shape, w)? {
            return self.lt_gemm(&shape, x16, w, &b.buf, out);
        }
        self.broadcast_bias(b, n, out)?;
        self.gemm_f16(x16, n, w, out, true)
    }

    /// `out [n, m]` filled with `b` in every row, for a GEMM to accumulate onto.
    fn broadcast_bias(&self, b: &CudaTensor, n: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        let m = b.len();
        if out.len() < n * m {
            return Err(Error::shape(
                "broadcast_bias",
                format!("{n} rows of a bias of {m} into {}", out.len()),
            ));
        }
        let (cols, rows) = (m as i32, n as i32);
        let mut l = self
            .inner
            .stream
            .launch_builder(self.kernel("broadcast_rows_f32"));
        l.arg(&*b.buf).arg(&mut *out).arg(&cols).arg(&rows);
        // SAFETY: matches broadcast_rows_f32: b holds m floats, out n * m (checked).
        self.launched(
            "broadcast_rows_f32",
            unsafe { l.launch(LaunchConfig::for_num_elems((n * m) as u32)) }.map(|_| ()),
        )
    }

    /// [`Backend::rms_norm_mlp`] past the GEMVs' rows: the norm, the gate/up product and the
    /// SwiGLU each written once as the next GEMM's operand (f16, or e4m3 with its scales for
    /// an FP8 weight on the W8A8 GEMM), and the down projection added into `x` by its GEMM
    /// (beta = 1).
    ///
    /// [`Backend::rms_norm_mlp`]: crate::Backend::rms_norm_mlp
    pub(super) fn rms_norm_mlp_f16(
        &self,
        x: &mut CudaTensor,
        norm: &CudaTensor,
        eps: f32,
        gate_up: &CudaWeight,
        down: &CudaWeight,
    ) -> Result<()> {
        let (n, k) = (x.rows(), x.cols());
        let m2 = self.check_linear("rms_norm_mlp", x, gate_up, None)?;
        let m = m2 / 2;
        if m2 % 2 != 0 || down.shape != [k, m] {
            return Err(Error::shape(
                "rms_norm_mlp",
                format!(
                    "x {:?}, gate_up {:?} (must be [2m, k]), down {:?} (must be [k, m])",
                    x.shape, gate_up.shape, down.shape
                ),
            ));
        }
        if n == 0 || m == 0 {
            return Ok(());
        }
        let mut y16 = self.alloc_f16(n * m2)?;
        // An FP8 gate/up on the W8A8 GEMM reads the norm quantized as it is computed.
        let fused_norm = match self.w8a8_weight::<half::f16>(gate_up, n, false)? {
            Some(taken) => self.rms_norm_fp8(x, norm, eps)?.map(|h8| (taken, h8)),
            None => None,
        };
        if let Some((taken, h8)) = fused_norm {
            self.w8a8_gemm_rows(&h8, gate_up, taken, &mut y16, false, 1.0)?;
        } else {
            let h16 = self.rms_norm_f16(x, norm, eps)?;
            self.gemm_f16(&h16, n, gate_up, &mut y16, false)?;
        }
        // The SwiGLU's products are stored times SWIGLU_F16_SCALE, f16 or e4m3 (an FP8 down
        // on the W8A8 GEMM): the GEMM's alpha undoes it exactly.
        let alpha = 1.0 / SWIGLU_F16_SCALE;
        if let Some(taken) = self.w8a8_weight::<f32>(down, n, true)? {
            let g8 = self.swiglu_fp8(&y16, n, m, SWIGLU_F16_SCALE)?;
            return self.w8a8_gemm_rows(&g8, down, taken, self.unshared(x)?, true, alpha);
        }
        let g16 = self.swiglu_f16(&y16, n, m)?;
        self.gemm_f16_alpha(&g16, n, down, self.unshared(x)?, true, alpha)
    }

    /// silu(gate) ⊙ up of the gate/up GEMM's `n` rows `y16` (`[n, 2m]`), times
    /// SWIGLU_F16_SCALE, in f16: the down GEMM's operand.
    pub(super) fn swiglu_f16(
        &self,
        y16: &CudaSlice<half::f16>,
        n: usize,
        m: usize,
    ) -> Result<CudaSlice<half::f16>> {
        if y16.len() < 2 * n * m {
            return Err(Error::shape(
                "swiglu_f16",
                format!("{} halves for {n} rows of 2 x {m}", y16.len()),
            ));
        }
        let mut g16 = self.alloc_f16(n * m)?;
        let name = "silu_mul_halves_f16";
        let (mm, nn) = (m as i32, n as i32);
        let per = if m % 8 == 0 { 8 } else { 1 };
        let launched = {
            let stream = &self.inner.stream;
            let (yp, _y) = y16.device_ptr(stream);
            let (gp, _g) = g16.device_ptr_mut(stream);
            let mut args = [
                arg(&yp),
                arg(&gp),
                arg(&mm),
                arg(&nn),
                arg(&SWIGLU_F16_SCALE),
            ];
            let cfg = Self::fill_config((n * m / per) as u64);
            // SAFETY: matches silu_mul_halves_f16: y16 is [n, 2m] (checked) and g16 [n, m]
            // halves; with m % 8 == 0 every row starts 16-byte aligned (allocations are
            // 256-byte aligned). The kernel reads nothing before its grid_wait.
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) }
        };
        self.launched(name, launched)?;
        Ok(g16)
    }

    /// Room for `len` halves, not initialized: every caller's kernel or GEMM writes all of it.
    pub(super) fn alloc_f16(&self, len: usize) -> Result<CudaSlice<half::f16>> {
        // f16 has no invalid bit patterns, and callers write every element first.
        self.alloc_slice::<half::f16>(len)
    }

    /// `swiglu` (and `rms_norm_swiglu`, with `norm`): the fused GEMV for up to
    /// GEMV_MAX_ROWS rows (normed ones while they fit its shared memory); past that the norm
    /// on its own, one GEMM over both halves, then silu(gate) * up.
    pub(super) fn swiglu_with(
        &self,
        op: &'static str,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
        gate_up: &CudaWeight,
    ) -> Result<CudaTensor> {
        if let Some((w, eps)) = norm.filter(|_| !self.normed_gemv_fits(x)) {
            // Rows the normed GEMV does not take: the norm on its own first.
            return self.swiglu_with(op, &self.rms_norm(x, w, eps)?, None, gate_up);
        }
        let m2 = self.check_linear(op, x, gate_up, None)?;
        if m2 % 2 != 0 {
            return Err(Error::shape(
                op,
                format!("gate_up must be [2m, k], got {:?}", gate_up.shape),
            ));
        }
        let (n, m) = (x.rows(), m2 / 2);
        let mut out = self.alloc(with_cols(&x.shape, m))?;
        if n == 0 || m == 0 {
            return Ok(out);
        }
        if n > GEMV_MAX_ROWS {
            let y = self.linear(x, gate_up, None)?;
            let name = "silu_mul_halves_f32";
            let (mm, nn) = (m as i32, n as i32);
            let mut l = self.inner.stream.launch_builder(self.kernel(name));
            l.arg(&*y.buf)
                .arg(Arc::get_mut(&mut out.buf).expect("fresh buffer"))
                .arg(&mm)
                .arg(&nn);
            let cfg = LaunchConfig::for_num_elems((n * m) as u32);
            // SAFETY: matches silu_mul_halves_f32; y is [n, 2m], out [n, m].
            self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))?;
            return Ok(out);
        }
        let kind = if norm.is_some() {
            Gemv::NormedSwiglu
        } else {
            Gemv::Swiglu
        };
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        self.launch_gemv(kind, x, norm, gate_up, None, out_buf, false, m)?;
        Ok(out)
    }
}

impl CudaBackend {
    pub(super) fn linear_impl(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let m = self.check_linear("linear", x, w, b)?;
        let mut out = self.alloc(with_cols(&x.shape, m))?;
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        let n = x.rows();
        if n == 0 || m == 0 {
            return Ok(out);
        }
        if n <= GEMV_MAX_ROWS {
            self.gemv(x, None, w, b, out_buf, false)?;
            return Ok(out);
        }
        self.project_f16(&self.to_f16(x)?, n, w, b, out_buf)?;
        Ok(out)
    }

    pub(super) fn rms_norm_linear_impl(
        &self,
        x: &CudaTensor,
        norm: &CudaTensor,
        eps: f32,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let m = self.check_linear("rms_norm_linear", x, w, b)?;
        width_of("rms_norm_linear", x, norm)?;
        let mut out = self.alloc(with_cols(&x.shape, m))?;
        let out_buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
        if self.normed_gemv_fits(x) {
            self.gemv(x, Some((norm, eps)), w, b, out_buf, false)?;
        } else if x.rows() > 0 && m > 0 {
            let n = x.rows();
            // Past the GEMV's rows: the norm written once as the GEMM's operand, quantized as
            // it is computed where an FP8 weight takes the W8A8 GEMM (onto the bias, if any),
            // else in f16.
            let fused = match self.w8a8_weight::<f32>(w, n, b.is_some())? {
                Some(taken) => self.rms_norm_fp8(x, norm, eps)?.map(|h8| (taken, h8)),
                None => None,
            };
            if let Some((taken, h8)) = fused {
                if let Some(b) = b {
                    self.broadcast_bias(b, n, out_buf)?;
                }
                self.w8a8_gemm_rows(&h8, w, taken, out_buf, b.is_some(), 1.0)?;
            } else {
                let h16 = self.rms_norm_f16(x, norm, eps)?;
                self.project_f16(&h16, n, w, b, out_buf)?;
            }
        }
        Ok(out)
    }

    pub(super) fn add_linear_impl(
        &self,
        x: &mut CudaTensor,
        a: &CudaTensor,
        w: &CudaWeight,
        b: Option<&CudaTensor>,
    ) -> Result<()> {
        let m = self.check_linear("add_linear", a, w, b)?;
        if x.shape != with_cols(&a.shape, m) {
            return Err(Error::shape(
                "add_linear",
                format!("{:?} -> {m} columns added into {:?}", a.shape, x.shape),
            ));
        }
        let n = a.rows();
        if n == 0 || m == 0 {
            return Ok(());
        }
        if n <= GEMV_MAX_ROWS {
            return self.gemv(a, None, w, b, self.unshared(x)?, true);
        }
        // The GEMM adds into its output (beta = 1), the bias in cuBLASLt's epilogue.
        let Some(b) = b else {
            return self.gemm(a, w, self.unshared(x)?, true);
        };
        if let Some(iw) = self.int_gemm_weight(w, n) {
            let a16 = self.to_f16(a)?;
            let out = self.unshared(x)?;
            return self.launch_int_gemm(
                &a16,
                0..n,
                iw,
                m,
                a.cols(),
                Some(&*b.buf),
                out,
                true,
                1.0,
            );
        }
        let shape = LtShape {
            n,
            k: a.cols(),
            m,
            out_kind: LtOut::F32 { accumulate: true },
            epilogue: Epilogue::Bias,
        };
        if !self.lt_takes(&shape, w)? {
            *x = self.add(x, &self.linear(a, w, Some(b))?)?;
            return Ok(());
        }
        let a16 = self.to_f16(a)?;
        self.lt_gemm(&shape, &a16, w, &b.buf, self.unshared(x)?)?;
        Ok(())
    }

    pub(super) fn layer_norm_linears_impl(
        &self,
        x: &CudaTensor,
        norm: LayerNormParams<Self>,
        projections: &[Projection<Self>],
    ) -> Result<Vec<CudaTensor>> {
        let n = x.rows();
        if n <= GEMV_MAX_ROWS {
            // The GEMVs read f32 rows.
            return layer_norm_linears_op_by_op(self, x, norm, projections);
        }
        let h16 = self.layer_norm_f16(x, norm)?;
        projections
            .iter()
            .map(|p| {
                let m = self.check_linear("layer_norm_linears", x, p.w, p.b)?;
                let mut out = self.alloc(with_cols(&x.shape, m))?;
                let buf = Arc::get_mut(&mut out.buf).expect("fresh buffer");
                self.project_f16(&h16, n, p.w, p.b, buf)?;
                Ok(out)
            })
            .collect()
    }

    pub(super) fn layer_norm_mlp_impl(
        &self,
        x: &mut CudaTensor,
        norm: LayerNormParams<Self>,
        up: Projection<Self>,
        act: GeluKind,
        down: Projection<Self>,
    ) -> Result<()> {
        let (n, cols) = (x.rows(), x.cols());
        let hidden = self.check_linear("layer_norm_mlp", x, up.w, up.b)?;
        if down.w.shape != [cols, hidden] || down.b.is_some_and(|b| b.len() != cols) {
            return Err(Error::shape(
                "layer_norm_mlp",
                format!(
                    "x {:?}, up {:?}, down {:?}",
                    x.shape, up.w.shape, down.w.shape
                ),
            ));
        }
        let up_shape = LtShape {
            n,
            k: cols,
            m: hidden,
            out_kind: LtOut::F16,
            epilogue: Epilogue::GeluBias,
        };
        let down_shape = LtShape {
            n,
            k: hidden,
            m: cols,
            out_kind: LtOut::F32 { accumulate: true },
            epilogue: Epilogue::Bias,
        };
        // cuBLASLt's GELU is the tanh form; decode-sized inputs go to the GEMVs.
        if let (true, Some(b_up), Some(b_down)) =
            (n > GEMV_MAX_ROWS && act == GeluKind::Tanh, up.b, down.b)
        {
            if self.lt_takes(&up_shape, up.w)? && self.lt_takes(&down_shape, down.w)? {
                let h16 = self.layer_norm_f16(x, norm)?;
                // An f16 output takes an f16 bias.
                let b_up16 = self.to_f16(b_up)?;
                let mut hidden16 = self.alloc_f16(n * hidden)?;
                self.lt_gemm(&up_shape, &h16, up.w, &b_up16, &mut hidden16)?;
                let out = self.unshared(x)?;
                self.lt_gemm(&down_shape, &hidden16, down.w, &b_down.buf, out)?;
                return Ok(());
            }
        }
        layer_norm_mlp_op_by_op(self, x, norm, up, act, down)
    }
}
