//! The W8A8 GEMM of FP8 weights on Hopper: every GEMM of more rows than decode's GEMVs take
//! (prefill chunks, batches of 5 and more) quantizes its activations to e4m3 too (a scale per
//! row and 128 columns: `Fp8Rows`, written by the RMSNorm or SwiGLU that computes them, else
//! by `quant_rows_f8`, all in ops_f32.cu) and multiplies on FP8 tensor cores through cuBLASLt,
//! with the weights' 128 x 128 block scales (lt.rs, [`Fp8Shape`]): twice f16's tensor-core
//! rate, and the weights read as stored. What Qwen's FP8 checkpoints ask for
//! (`activation_scheme: dynamic`) and what transformers and vLLM run on such a GPU. On an H200
//! (docs/benchmarks.md) it beat the weight-only integer GEMM at 8 to 64 rows (one layer's MLP
//! 73 against 85 us at 8 rows, 79 against 141 at 64) and f16 cuBLAS past that.
//!
//! Decode's GEMVs (1 to 4 rows) of the same weights read the e4m3 bytes with their input rows
//! rounded as the GEMM rounds its own (`w8a8_rounded`: to f16, to e4m3 with the group's scale,
//! back to f32), so a request computes the same whether its step had 4 rows or more, up to
//! summation order, as f16 weights do. Without that the two differed by the rounding itself
//! (3 mantissa bits: each value within 2^-4 of itself; one GEMM's outputs moved by up to 2.5%
//! of the largest at 8B shapes). Weight-only (W8A16: activations stay f16) are FP8 weights
//! without 128 x 128 blocks (per-channel scales), GPUs without these kernels (the Orin, sm_87,
//! has no FP8 tensor cores; a cuBLASLt older than 12.9) and `VLM_FP8_GEMM=w8a16`, GEMVs too.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::int_weights::{block_scales_ld, W8A8_BLOCK};
use super::kernels::{GEMV_MAX_ROWS, NORM_VEC, ROW_THREADS};
use super::launch::{arg, width_of};
use super::linear::{GemmOut, SWIGLU_F16_SCALE};
use super::lt::{Fp8Shape, LtAlgo, LtGemm, LtOperands, LtOut};
use super::tensor::{IntFormat, IntWeight, WeightData};
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::quant::fp8::ACT_GROUP;
use crate::{Error, Result};

/// Whether FP8 weights' GEMMs quantize their activations: `VLM_FP8_GEMM` at start,
/// [`CudaBackend::set_fp8_gemm`] after, [`with_fp8_gemm`] for one thread's GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Gemm {
    /// W8A8 past the GEMVs' rows where the GPU has it (the default).
    W8a8,
    /// Never: weight-only everywhere.
    W8a16,
}

impl Fp8Gemm {
    /// `VLM_FP8_GEMM`'s value: `w8a16`, else (unset, `w8a8`, or unknown, with a warning) W8A8.
    pub(super) fn from_env() -> Self {
        match std::env::var("VLM_FP8_GEMM").as_deref() {
            Ok("w8a16") => Fp8Gemm::W8a16,
            Ok("w8a8") | Err(_) => Fp8Gemm::W8a8,
            Ok(other) => {
                tracing::warn!("VLM_FP8_GEMM={other} is not w8a8 or w8a16: using w8a8");
                Fp8Gemm::W8a8
            }
        }
    }

    fn from_u8(v: u8) -> Self {
        if v == Fp8Gemm::W8a16 as u8 {
            Fp8Gemm::W8a16
        } else {
            Fp8Gemm::W8a8
        }
    }
}

thread_local! {
    /// The mode [`with_fp8_gemm`] forces on this thread's GEMMs (before the backend's).
    static FORCED: std::cell::Cell<Option<Fp8Gemm>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's FP8 GEMMs in `mode`, whatever the backend's: how the twin
/// cases check the weight-only GEMMs (which the CPU computes) and the W8A8 one each on one
/// GPU. Launches are queued on the calling thread, so no other thread's GEMMs change.
pub fn with_fp8_gemm<T>(mode: Fp8Gemm, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED, Some(mode), f)
}

/// Threads of a block of the kernels that quantize one group of 128 columns a warp
/// (`quant_rows_f8`, `silu_mul_halves_f8`, `qdq_rows_f8`): 8 warps.
const QUANT_THREADS: u32 = 256;

/// Activations as the W8A8 GEMM reads them: `n` rows of `k` e4m3 bytes (row-major) and a scale
/// per row and group of [`ACT_GROUP`] columns, group-major (`scales[g * ld + r]`, cuBLASLt's
/// VEC128_32F layout).
pub(super) struct Fp8Rows {
    /// `ld` rows of `k` bytes, the first `n` written.
    q: CudaSlice<u8>,
    /// `k / 128` groups of `ld` scales, the first `n` of each written.
    scales: CudaSlice<f32>,
    n: usize,
    k: usize,
    /// The rows the GEMM takes: `n` rounded up to [`W8A8_ROWS`].
    ld: usize,
}

/// The W8A8 GEMM runs on a multiple of this many rows: cuBLASLt has no block-scaled FP8
/// algorithm for other counts (on an H200 with CUDA 13: 100 and 640 rows ran W8A8, 639 found
/// none and took the weight-only path at 1.65x the time of 640 for the MLP; 100 suggests
/// 16-byte rows of scales, 4 floats; 16 is a margin). The rows past `n` are padding, their
/// products thrown away: a step of any size runs W8A8, so a request's numbers do not depend
/// on how many rows its step had.
pub(super) const W8A8_ROWS: usize = 16;

impl Fp8Rows {
    /// The bytes and the scales of the `n` rows, copied to the host (for the GPU tests).
    fn to_host(&self, be: &CudaBackend) -> Result<(Vec<u8>, Vec<f32>)> {
        let stream = &be.inner.stream;
        let err = |e: cudarc::driver::DriverError| super::error::cuda_err("Fp8Rows::to_host")(&e);
        let (n, k, ld) = (self.n, self.k, self.ld);
        let q = stream.clone_dtoh(&self.q.slice(..n * k)).map_err(err)?;
        let padded = stream.clone_dtoh(&self.scales).map_err(err)?;
        let scales = padded
            .chunks(ld)
            .flat_map(|group| &group[..n])
            .copied()
            .collect();
        Ok((q, scales))
    }
}

impl CudaBackend {
    /// Whether this GPU and cuBLASLt run FP8 GEMMs with block scales: sm_90 (H100, H200; the
    /// scale modes exist there only) and cuBLASLt 12.9 or later.
    pub fn has_w8a8(&self) -> bool {
        self.compute_capability() == (9, 0) && self.inner.lt.has_fp8_block_scales()
    }

    /// Whether FP8 GEMMs quantize their activations here: this thread's [`with_fp8_gemm`]
    /// mode, else the backend's.
    pub fn fp8_gemm(&self) -> Fp8Gemm {
        FORCED.get().unwrap_or_else(|| {
            Fp8Gemm::from_u8(
                self.inner
                    .fp8_gemm
                    .load(std::sync::atomic::Ordering::Relaxed),
            )
        })
    }

    /// Sets whether FP8 GEMMs quantize their activations on this backend (for tests that check
    /// both paths on one GPU; the default is `VLM_FP8_GEMM`'s). Weights already uploaded are unaffected: the
    /// choice is made at each GEMM.
    pub fn set_fp8_gemm(&self, mode: Fp8Gemm) {
        self.inner
            .fp8_gemm
            .store(mode as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// `w`'s FP8 weight where `n` rows of activations take the W8A8 GEMM into an `O` output
    /// (`accumulate`: added to it): a weight [`Self::on_w8a8`] says is, more rows than the
    /// GEMVs take, and an algorithm for the shape.
    pub(super) fn w8a8_weight<'a, O: GemmOut>(
        &self,
        w: &'a CudaWeight,
        n: usize,
        accumulate: bool,
    ) -> Result<Option<(&'a IntWeight, LtAlgo)>> {
        let Some(iw) = self.on_w8a8(w) else {
            return Ok(None);
        };
        if n <= GEMV_MAX_ROWS || (O::F16 && accumulate) {
            return Ok(None);
        }
        let (m, k) = (w.shape[0], w.shape[1]);
        let rows = n.next_multiple_of(W8A8_ROWS);
        let gemm = LtGemm::Fp8(Self::fp8_shape::<O>(rows, k, m, accumulate));
        Ok(self
            .inner
            .lt
            .algo(gemm, self.inner.workspace)?
            .map(|algo| (iw, algo)))
    }

    /// `w`'s FP8 weight if its GEMMs past the GEMVs' rows run W8A8 here: 128 x 128 block scales,
    /// shapes cuBLASLt's FP8 GEMM takes (k whole groups of 128, leading dims multiples of 16),
    /// W8A8 on ([`Self::fp8_gemm`]) and a GPU that has it. Decode's GEMVs of such a weight read
    /// their input rounded as the GEMM's ([`Self::w8a8_rounded`]).
    pub(super) fn on_w8a8<'a>(&self, w: &'a CudaWeight) -> Option<&'a IntWeight> {
        let WeightData::Int(iw) = &w.data else {
            return None;
        };
        let (m, k) = (w.shape[0], w.shape[1]);
        let on = iw.format == IntFormat::E4m3
            && iw.block_scales.is_some()
            && k % ACT_GROUP == 0
            && m % 16 == 0
            && self.fp8_gemm() == Fp8Gemm::W8a8
            && self.has_w8a8();
        on.then_some(&**iw)
    }

    /// `x`'s rows (after `norm`'s RMSNorm, if given) as the W8A8 GEMM sees them, in f32: each
    /// value rounded to f16, then to e4m3 with its row's and group's scale, times that scale
    /// (`qdq_rows_f8`, `rms_norm_qdq_f8`). What a decode GEMV of a weight [`Self::on_w8a8`]
    /// takes reads, so that a request's numbers do not depend on whether its step had more
    /// rows than the GEMVs take (up to summation order, as for f16 weights).
    pub(super) fn w8a8_rounded(
        &self,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
    ) -> Result<CudaTensor> {
        let (n, k) = (x.rows(), x.cols());
        if k % ACT_GROUP != 0 {
            return Err(Error::shape(
                "w8a8_rounded",
                format!("{k} columns: not whole groups of {ACT_GROUP}"),
            ));
        }
        let mut out = self.alloc(x.shape.clone())?;
        if n == 0 {
            return Ok(out);
        }
        let out_buf = std::sync::Arc::get_mut(&mut out.buf).expect("fresh buffer");
        let stream = &self.inner.stream;
        let (nn, kk) = (n as i32, k as i32);
        let (name, launched) = match norm {
            Some((w, eps)) if k <= 4 * NORM_VEC * ROW_THREADS as usize => {
                width_of("rms_norm", x, w)?;
                let name = "rms_norm_qdq_f8";
                let cfg = Self::row_config(n);
                let (xp, _x) = x.buf.device_ptr(stream);
                let (wp, _w) = w.buf.device_ptr(stream);
                let (op, _o) = out_buf.device_ptr_mut(stream);
                let mut args = [arg(&xp), arg(&wp), arg(&op), arg(&kk), arg(&eps)];
                // SAFETY: rms_norm_qdq_f8's arguments in order (one ROW_THREADS block a row,
                // as rms_norm_f16): x and out hold n*k floats, w k (checked); k is whole groups
                // and at most NORM_VEC float4s a thread, which the kernel requires. It reads
                // nothing before its grid_wait.
                let launched =
                    unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
                (name, launched)
            }
            Some((w, eps)) => {
                return self.w8a8_rounded(&crate::Backend::rms_norm(self, x, w, eps)?, None)
            }
            None => {
                let name = "qdq_rows_f8";
                let cfg = Self::by_group_config(n * k / ACT_GROUP);
                let (xp, _x) = x.buf.device_ptr(stream);
                let (op, _o) = out_buf.device_ptr_mut(stream);
                let mut args = [arg(&xp), arg(&op), arg(&nn), arg(&kk)];
                // SAFETY: qdq_rows_f8's arguments in order: x and out hold n*k floats; k is
                // whole groups, so each warp's 16-byte loads stay in its row. It reads nothing
                // before its grid_wait.
                let launched =
                    unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
                (name, launched)
            }
        };
        self.launched(name, launched)?;
        Ok(out)
    }

    /// Whether `linear` of `n` rows by `w` takes the W8A8 GEMM here (for tests that must not
    /// pass on the weight-only fallback).
    #[doc(hidden)]
    pub fn w8a8_takes(&self, w: &CudaWeight, n: usize) -> Result<bool> {
        Ok(self.w8a8_weight::<f32>(w, n, false)?.is_some())
    }

    fn fp8_shape<O: GemmOut>(n: usize, k: usize, m: usize, accumulate: bool) -> Fp8Shape {
        let out_kind = if O::F16 {
            LtOut::F16
        } else {
            LtOut::F32 { accumulate }
        };
        Fp8Shape { n, k, m, out_kind }
    }

    /// `out (+)= alpha · x16 · wᵀ` on the W8A8 GEMM, for a weight and algorithm
    /// [`Self::w8a8_weight`] gave: x16's `n` rows quantized ([`Self::quantize_rows`]), then
    /// [`Self::w8a8_gemm_rows`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn w8a8_gemm<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        taken: (&IntWeight, LtAlgo),
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        let x = self.quantize_rows(x16, n, w.shape[1])?;
        self.w8a8_gemm_rows(&x, w, taken, out, accumulate, alpha)
    }

    /// `out (+)= alpha · x · wᵀ` on cuBLASLt's block-scaled FP8 GEMM, `x` already quantized
    /// (by [`Self::quantize_rows`], or by the norm or SwiGLU that wrote it:
    /// [`Self::rms_norm_fp8`], [`Self::swiglu_fp8`]). The GEMM runs on x's padded rows; where
    /// they are more than `out`'s, into a scratch of as many rows, `out`'s copied in first if
    /// it accumulates and the real rows copied back after (a few microseconds a GEMM, against
    /// the weight-only path's 1.65x).
    pub(super) fn w8a8_gemm_rows<O: GemmOut>(
        &self,
        x: &Fp8Rows,
        w: &CudaWeight,
        (iw, algo): (&IntWeight, LtAlgo),
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        let (m, k, n, rows) = (w.shape[0], w.shape[1], x.n, x.ld);
        if x.k != k || out.len() < n * m {
            return Err(Error::shape(
                "W8A8 GEMM",
                format!("x {n} x {}, out {}, weight {:?}", x.k, out.len(), w.shape),
            ));
        }
        let stream = &self.inner.stream;
        let copy_err =
            |e: cudarc::driver::DriverError| super::error::cuda_err("W8A8 GEMM's padded rows")(&e);
        if rows > n {
            let mut padded = self.alloc_slice::<O>(rows * m)?;
            if accumulate {
                stream
                    .memcpy_dtod(&out.slice(..n * m), &mut padded.slice_mut(..n * m))
                    .map_err(copy_err)?;
            }
            self.w8a8_gemm_all_rows(x, w, (iw, algo), &mut padded, accumulate, alpha)?;
            return stream
                .memcpy_dtod(&padded.slice(..n * m), &mut out.slice_mut(..n * m))
                .map_err(copy_err);
        }
        self.w8a8_gemm_all_rows(x, w, (iw, algo), out, accumulate, alpha)
    }

    /// [`Self::w8a8_gemm_rows`] into an `out` of x's padded rows.
    fn w8a8_gemm_all_rows<O: GemmOut>(
        &self,
        x: &Fp8Rows,
        w: &CudaWeight,
        (iw, algo): (&IntWeight, LtAlgo),
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        let (m, k, rows) = (w.shape[0], w.shape[1], x.ld);
        let Some(w_scales) = iw.block_scales.as_ref() else {
            return Err(Error::shape("W8A8 GEMM", "a weight without block scales"));
        };
        let gemm = LtGemm::Fp8(Self::fp8_shape::<O>(rows, k, m, accumulate));
        // SAFETY: x.q holds rows*k e4m3 bytes and x.scales their rows*k/128 scales (group-major,
        // as Fp8Rows is made; past x.n whatever the pool held, which only padding outputs
        // read), the weight's words its m*k bytes row-major and block_scales its blocks'
        // scales as IntWeight says; out holds rows*m of O (w8a8_gemm_rows's scratch where the
        // caller's is shorter).
        unsafe {
            self.enqueue_w8a8(
                &gemm,
                algo,
                (&x.q, &x.scales),
                (&iw.words, w_scales),
                out,
                alpha,
            )
        }?;
        self.op_done("cublaslt_gemm_fp8")
    }

    /// Enqueues the W8A8 GEMM `gemm` with `algo` (from [`super::lt::Lt::algo`] or
    /// [`super::lt::Lt::candidates`] for it), the product times `alpha`: x's e4m3 bytes and
    /// their scales, the weight's e4m3 bytes (in words of any type) and its block scales, into
    /// `out`.
    ///
    /// # Safety
    /// The buffers hold what `gemm`'s shape (n, k, m) says: x n*k bytes and n*k/128 scales
    /// group-major, the weight m*k bytes row-major and its block scales as
    /// [`IntWeight::block_scales`] lays them out, out n*m of O.
    unsafe fn enqueue_w8a8<W: cudarc::driver::DeviceRepr, O: cudarc::driver::DeviceRepr>(
        &self,
        gemm: &LtGemm,
        algo: LtAlgo,
        (x, x_scales): (&CudaSlice<u8>, &CudaSlice<f32>),
        (w, w_scales): (&CudaSlice<W>, &CudaSlice<f32>),
        out: &mut CudaSlice<O>,
        alpha: f32,
    ) -> Result<()> {
        let stream = &self.inner.stream;
        let (xp, _x_guard) = x.device_ptr(stream);
        let (xs, _xs_guard) = x_scales.device_ptr(stream);
        let (wp, _w_guard) = w.device_ptr(stream);
        let (ws, _ws_guard) = w_scales.device_ptr(stream);
        let (o, _o_guard) = out.device_ptr_mut(stream);
        let operands = LtOperands {
            x: xp,
            w: wp,
            bias: 0,
            out: o,
            w_scales: ws,
            x_scales: xs,
        };
        // SAFETY: the buffers are as the caller promises; the guards keep them alive and ordered
        // on this stream until the GEMM is queued.
        unsafe {
            self.inner.lt.matmul(
                stream.cu_stream(),
                self.inner.workspace,
                gemm,
                algo,
                &operands,
                alpha,
            )
        }
    }

    /// Microseconds a call of each algorithm cuBLASLt's heuristic offers (up to `count`, its
    /// choice first) for the W8A8 GEMM of `n` rows (a multiple of [`W8A8_ROWS`]) by an
    /// `m x k` FP8 weight into f16 (`out_f16`) or f32 (added to, with `accumulate`): `reps`
    /// calls each on zeroed operands, after two. For the example `lt_fp8_algos`, which asks
    /// whether the heuristic's choice is the fastest for prefill's shapes.
    #[doc(hidden)]
    pub fn w8a8_algo_times(
        &self,
        (n, k, m): (usize, usize, usize),
        out_f16: bool,
        accumulate: bool,
        count: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        if out_f16 {
            self.w8a8_algo_times_into::<half::f16>((n, k, m), false, count, reps)
        } else {
            self.w8a8_algo_times_into::<f32>((n, k, m), accumulate, count, reps)
        }
    }

    fn w8a8_algo_times_into<O: GemmOut + cudarc::driver::ValidAsZeroBits>(
        &self,
        (n, k, m): (usize, usize, usize),
        accumulate: bool,
        count: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        if n % W8A8_ROWS != 0 || k % ACT_GROUP != 0 || m % 16 != 0 || !self.has_w8a8() {
            return Err(Error::shape(
                "w8a8_algo_times",
                format!("{n} x {k} by {m} rows on this GPU"),
            ));
        }
        let gemm = LtGemm::Fp8(Self::fp8_shape::<O>(n, k, m, accumulate));
        let algos = self
            .inner
            .lt
            .candidates(&gemm, self.inner.workspace, count)?;
        let stream = &self.inner.stream;
        let err = |e: cudarc::driver::DriverError| super::error::cuda_err("w8a8_algo_times")(&e);
        let x = stream.alloc_zeros::<u8>(n * k).map_err(err)?;
        let xs = stream.alloc_zeros::<f32>(n * k / ACT_GROUP).map_err(err)?;
        let w = stream.alloc_zeros::<u8>(m * k).map_err(err)?;
        let ws = stream
            .alloc_zeros::<f32>(m.div_ceil(W8A8_BLOCK) * block_scales_ld(k / W8A8_BLOCK))
            .map_err(err)?;
        let mut out = stream.alloc_zeros::<O>(n * m).map_err(err)?;
        let mut times = Vec::with_capacity(algos.len());
        for algo in algos {
            let mut run = || {
                // SAFETY: each buffer is allocated above at the size the shape says, the
                // weight's block scales at IntWeight's padded row length.
                unsafe { self.enqueue_w8a8(&gemm, algo, (&x, &xs), (&w, &ws), &mut out, 1.0) }
            };
            run()?;
            run()?;
            self.synchronize()?;
            let start = std::time::Instant::now();
            for _ in 0..reps {
                run()?;
            }
            self.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e6 / reps.max(1) as f64);
        }
        Ok(times)
    }

    /// Room for `n` rows of `k` quantized activations, padded to [`W8A8_ROWS`].
    fn alloc_fp8_rows(&self, n: usize, k: usize) -> Result<Fp8Rows> {
        let ld = n.next_multiple_of(W8A8_ROWS);
        Ok(Fp8Rows {
            q: self.alloc_slice::<u8>(ld * k)?,
            scales: self.alloc_slice::<f32>(ld * k / ACT_GROUP)?,
            n,
            k,
            ld,
        })
    }

    /// One warp a group of [`ACT_GROUP`] columns, `groups` in all.
    fn by_group_config(groups: usize) -> LaunchConfig {
        let blocks = (groups as u64 * 32).div_ceil(QUANT_THREADS as u64);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (QUANT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// x16's `n` rows of `k` (a multiple of [`ACT_GROUP`]) as the W8A8 GEMM reads them
    /// (`quant_rows_f8`; [`crate::quant::fp8::quantize_rows`] is its CPU twin).
    pub(super) fn quantize_rows(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        k: usize,
    ) -> Result<Fp8Rows> {
        if k % ACT_GROUP != 0 || x16.len() < n * k {
            return Err(Error::shape(
                "quantize_rows",
                format!("{} halves for {n} rows of {k}", x16.len()),
            ));
        }
        self.quant_rows_by("quant_rows_f8", x16, n, k)
    }

    /// `n` rows of `k` (whole groups) of `x` quantized by `name`: `quant_rows_f8` (x f16) or
    /// `quant_rows_f32_f8` (x f32, rounded to f16 first), one warp a group.
    fn quant_rows_by<T: cudarc::driver::DeviceRepr>(
        &self,
        name: &'static str,
        x: &CudaSlice<T>,
        n: usize,
        k: usize,
    ) -> Result<Fp8Rows> {
        let mut out = self.alloc_fp8_rows(n, k)?;
        let (nn, kk, ld) = (n as i32, k as i32, out.ld as i32);
        let launched = {
            let stream = &self.inner.stream;
            let (xp, _x) = x.device_ptr(stream);
            let (qp, _q) = out.q.device_ptr_mut(stream);
            let (sp, _s) = out.scales.device_ptr_mut(stream);
            let mut args = [arg(&xp), arg(&qp), arg(&sp), arg(&nn), arg(&kk), arg(&ld)];
            let cfg = Self::by_group_config(n * k / ACT_GROUP);
            // SAFETY: matches quant_rows_f8 and quant_rows_f32_f8 (the callers pass each its
            // input type): x holds n*k values (the callers check), q ld*k bytes, scales
            // ld*k/128 floats (ld >= n); k is whole groups, so each warp's loads stay in its
            // row. The kernels read nothing before their grid_wait.
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) }
        };
        self.launched(name, launched)?;
        Ok(out)
    }

    /// x's f32 rows rounded to f16 and quantized as [`Self::quantize_rows`] quantizes them, in
    /// one pass (`quant_rows_f32_f8`): what a GEMM of f32 rows (o_proj's, the attention's
    /// output) on the W8A8 GEMM reads, without the f16 copy (`cast_f32_to_f16`) in between.
    pub(super) fn quantize_rows_f32(&self, x: &CudaTensor) -> Result<Fp8Rows> {
        let (n, k) = (x.rows(), x.cols());
        if k % ACT_GROUP != 0 {
            return Err(Error::shape(
                "quantize_rows_f32",
                format!("{k} columns: not whole groups of {ACT_GROUP}"),
            ));
        }
        self.quant_rows_by("quant_rows_f32_f8", &*x.buf, n, k)
    }

    /// `rms_norm(x, w, eps)` as the W8A8 GEMM reads it, without the f16 copy in between
    /// (`rms_norm_f8`: rms_norm_f16 then quant_rows_f8, bit for bit), for rows that
    /// rms_norm_f16 keeps in registers; `None` for others, which take the two kernels.
    pub(super) fn rms_norm_fp8(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<Option<Fp8Rows>> {
        let (n, k) = (x.rows(), x.cols());
        if k % ACT_GROUP != 0 || k > 4 * NORM_VEC * ROW_THREADS as usize {
            return Ok(None);
        }
        width_of("rms_norm", x, w)?;
        let mut out = self.alloc_fp8_rows(n, k)?;
        let (ld, kk) = (out.ld as i32, k as i32);
        let name = "rms_norm_f8";
        let launched = {
            let stream = &self.inner.stream;
            let (xp, _x) = x.buf.device_ptr(stream);
            let (wp, _w) = w.buf.device_ptr(stream);
            let (qp, _q) = out.q.device_ptr_mut(stream);
            let (sp, _s) = out.scales.device_ptr_mut(stream);
            let mut args = [
                arg(&xp),
                arg(&wp),
                arg(&qp),
                arg(&sp),
                arg(&ld),
                arg(&kk),
                arg(&eps),
            ];
            // SAFETY: matches rms_norm_f8 (one ROW_THREADS block a row, as rms_norm_f16, n of
            // them): x holds n*k floats and w k (checked), q ld*k bytes and scales ld*k/128 (ld
            // >= n); k is whole groups and at most NORM_VEC float4s a thread, which the kernel
            // requires. It reads nothing before its grid_wait.
            unsafe {
                self.launch_args(
                    name,
                    Self::row_config(n),
                    &mut args,
                    self.programmatic_launch(),
                )
            }
        };
        self.launched(name, launched)?;
        Ok(Some(out))
    }

    /// silu(gate) ⊙ up (times `scale`) of the gate/up GEMM's `n` rows `y16` (`[n, 2m]`, m
    /// whole groups) as the W8A8 GEMM reads it, without the f16 copy in between
    /// (`silu_mul_halves_f8`: silu_mul_halves_f16 then quant_rows_f8, bit for bit).
    pub(super) fn swiglu_fp8(
        &self,
        y16: &CudaSlice<half::f16>,
        n: usize,
        m: usize,
        scale: f32,
    ) -> Result<Fp8Rows> {
        if m % ACT_GROUP != 0 || y16.len() < 2 * n * m {
            return Err(Error::shape(
                "swiglu_fp8",
                format!("{} halves for {n} rows of 2 x {m}", y16.len()),
            ));
        }
        let mut out = self.alloc_fp8_rows(n, m)?;
        let (mm, nn, ld) = (m as i32, n as i32, out.ld as i32);
        let name = "silu_mul_halves_f8";
        let launched = {
            let stream = &self.inner.stream;
            let (yp, _y) = y16.device_ptr(stream);
            let (qp, _q) = out.q.device_ptr_mut(stream);
            let (sp, _s) = out.scales.device_ptr_mut(stream);
            let mut args = [
                arg(&yp),
                arg(&qp),
                arg(&sp),
                arg(&mm),
                arg(&nn),
                arg(&scale),
                arg(&ld),
            ];
            let cfg = Self::by_group_config(n * m / ACT_GROUP);
            // SAFETY: matches silu_mul_halves_f8: y16 holds n*2m halves (checked), q ld*m
            // bytes, scales ld*m/128 floats (ld >= n); m is whole groups, so each warp's loads
            // stay in its row. It reads nothing before its grid_wait.
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) }
        };
        self.launched(name, launched)?;
        Ok(out)
    }

    /// `x` (f32 `[n, k]`, k a multiple of 128) rounded to f16 and quantized as the W8A8 GEMM
    /// quantizes its activations: the bytes row-major and the scales group-major. For the GPU
    /// test against [`crate::quant::fp8::quantize_rows`].
    #[doc(hidden)]
    pub fn quantize_rows_fp8(&self, x: &CudaTensor) -> Result<(Vec<u8>, Vec<f32>)> {
        let x16 = self.to_f16(x)?;
        self.quantize_rows(&x16, x.rows(), x.cols())?.to_host(self)
    }

    /// `rms_norm(x, w, eps)` quantized for the W8A8 GEMM in one kernel (`rms_norm_f8`) and
    /// in two (`rms_norm_f16`, then `quant_rows_f8`): the bytes and scales of each. For the
    /// GPU test that the fused kernel changes nothing.
    #[doc(hidden)]
    pub fn rms_norm_fp8_fused_and_not(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<[(Vec<u8>, Vec<f32>); 2]> {
        let Some(fused) = self.rms_norm_fp8(x, w, eps)? else {
            return Err(Error::shape(
                "rms_norm_fp8",
                format!("{} columns: not whole groups a block keeps", x.cols()),
            ));
        };
        let h16 = self.rms_norm_f16(x, w, eps)?;
        let two = self.quantize_rows(&h16, x.rows(), x.cols())?;
        Ok([fused.to_host(self)?, two.to_host(self)?])
    }

    /// x's rows quantized from f32 in one kernel (`quant_rows_f32_f8`) and in two
    /// (`cast_f32_to_f16`, then `quant_rows_f8`): the bytes and scales of each.
    #[doc(hidden)]
    pub fn quantize_rows_f32_fused_and_not(
        &self,
        x: &CudaTensor,
    ) -> Result<[(Vec<u8>, Vec<f32>); 2]> {
        let fused = self.quantize_rows_f32(x)?;
        let two = self.quantize_rows(&self.to_f16(x)?, x.rows(), x.cols())?;
        Ok([fused.to_host(self)?, two.to_host(self)?])
    }

    /// The same for the SwiGLU of `y` (`[n, 2m]`, gate then up, rounded to f16 first as the
    /// gate/up GEMM writes it): `silu_mul_halves_f8` against `silu_mul_halves_f16` then
    /// `quant_rows_f8`.
    #[doc(hidden)]
    pub fn swiglu_fp8_fused_and_not(&self, y: &CudaTensor) -> Result<[(Vec<u8>, Vec<f32>); 2]> {
        let (n, m) = (y.rows(), y.cols() / 2);
        let y16 = self.to_f16(y)?;
        let fused = self.swiglu_fp8(&y16, n, m, SWIGLU_F16_SCALE)?;
        let g16 = self.swiglu_f16(&y16, n, m)?;
        let two = self.quantize_rows(&g16, n, m)?;
        Ok([fused.to_host(self)?, two.to_host(self)?])
    }

    /// [`Self::w8a8_rounded`] of `x` (after `norm`, if given), for the GPU tests against the
    /// CPU's [`crate::quant::fp8::quantize_rows`] and against the W8A8 GEMM's operand.
    #[doc(hidden)]
    pub fn w8a8_rounded_rows(
        &self,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
    ) -> Result<CudaTensor> {
        self.w8a8_rounded(x, norm)
    }
}
