//! The W8A8 GEMM of FP8 weights on Hopper: every GEMM of more rows than decode's GEMVs take
//! (prefill chunks, batches of 5 and more) quantizes its activations to e4m3 too (a scale per
//! row and 128 columns, `quant_rows_f8` in weights_f16.cu) and multiplies on FP8 tensor cores
//! through cuBLASLt, with the weights' 128 x 128 block scales (lt.rs, [`Fp8Shape`]): twice
//! f16's tensor-core rate, and the weights read as stored. What Qwen's FP8 checkpoints ask for
//! (`activation_scheme: dynamic`) and what transformers and vLLM run on such a GPU. On an H200
//! (docs/benchmarks.md) it beat the weight-only integer GEMM at 8 to 64 rows (one layer's MLP
//! 73 against 85 us at 8 rows, 79 against 141 at 64) and f16 cuBLAS past that.
//!
//! Weight-only (W8A16: activations stay f16) are decode's GEMVs (1 to 4 rows), FP8 weights
//! without 128 x 128 blocks (per-channel scales), GPUs without these kernels (the Orin, sm_87,
//! has no FP8 tensor cores; a cuBLASLt older than 12.9) and `VLM_FP8_GEMM=w8a16`. The two
//! differ by the activations' rounding to e4m3 (3 mantissa bits: each value within 2^-4 of
//! itself; one GEMM's outputs moved by up to 2.5% of the largest at 8B shapes), so an FP8
//! request's numerics depend on whether its step had more than 4 rows.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::kernels::GEMV_MAX_ROWS;
use super::linear::GemmOut;
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
    struct Restore(Option<Fp8Gemm>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.set(self.0);
        }
    }
    let _restore = Restore(FORCED.replace(Some(mode)));
    f()
}

/// Threads of a `quant_rows_f8` block: 8 warps, a group of 128 columns each.
const QUANT_THREADS: u32 = 256;

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
    /// (`accumulate`: added to it): a weight with 128 x 128 block scales, shapes cuBLASLt's
    /// FP8 GEMM takes (k whole groups of 128, leading dims multiples of 16), more rows than the
    /// GEMVs take, W8A8 on ([`Self::fp8_gemm`]), and an algorithm for the shape.
    pub(super) fn w8a8_weight<'a, O: GemmOut>(
        &self,
        w: &'a CudaWeight,
        n: usize,
        accumulate: bool,
    ) -> Result<Option<(&'a IntWeight, LtAlgo)>> {
        let WeightData::Int(iw) = &w.data else {
            return Ok(None);
        };
        let (m, k) = (w.shape[0], w.shape[1]);
        if self.fp8_gemm() == Fp8Gemm::W8a16 {
            return Ok(None);
        }
        if iw.format != IntFormat::E4m3
            || iw.block_scales.is_none()
            || n <= GEMV_MAX_ROWS
            || k % ACT_GROUP != 0
            || m % 16 != 0
            || (O::F16 && accumulate)
            || !self.has_w8a8()
        {
            return Ok(None);
        }
        let gemm = LtGemm::Fp8(Self::fp8_shape::<O>(n, k, m, accumulate));
        Ok(self
            .inner
            .lt
            .algo(gemm, self.inner.workspace)?
            .map(|algo| (&**iw, algo)))
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
    /// [`Self::w8a8_weight`] gave:
    /// x16's `n` rows quantized ([`Self::quantize_rows_into`]), then cuBLASLt.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn w8a8_gemm<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        w: &CudaWeight,
        (iw, algo): (&IntWeight, LtAlgo),
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        let (m, k) = (w.shape[0], w.shape[1]);
        if x16.len() < n * k || out.len() < n * m {
            return Err(Error::shape(
                "W8A8 GEMM",
                format!(
                    "x {} halves, out {}, weight {:?}, {n} rows",
                    x16.len(),
                    out.len(),
                    w.shape
                ),
            ));
        }
        let Some(w_scales) = iw.block_scales.as_ref() else {
            return Err(Error::shape("W8A8 GEMM", "a weight without block scales"));
        };
        let mut x8 = self.alloc_slice::<u8>(n * k)?;
        let mut x_scales = self.alloc_slice::<f32>(n * k / ACT_GROUP)?;
        self.quantize_rows_into(x16, n, k, &mut x8, &mut x_scales)?;
        let gemm = LtGemm::Fp8(Self::fp8_shape::<O>(n, k, m, accumulate));
        let stream = &self.inner.stream;
        let (x, _x_guard) = x8.device_ptr(stream);
        let (xs, _xs_guard) = x_scales.device_ptr(stream);
        let (wp, _w_guard) = iw.words.device_ptr(stream);
        let (ws, _ws_guard) = w_scales.device_ptr(stream);
        let (o, _o_guard) = out.device_ptr_mut(stream);
        let operands = LtOperands {
            x,
            w: wp,
            bias: 0,
            out: o,
            w_scales: ws,
            x_scales: xs,
        };
        // SAFETY: x8 holds n*k e4m3 bytes and x_scales their n*k/128 scales (group-major),
        // the weight's words its m*k bytes row-major and block_scales its blocks' scales as
        // IntWeight says; out holds n*m of O (checked above). The guards keep them alive and
        // ordered on this stream until the GEMM is queued.
        unsafe {
            self.inner.lt.matmul(
                stream.cu_stream(),
                self.inner.workspace,
                &gemm,
                algo,
                &operands,
                alpha,
            )
        }?;
        self.op_done("cublaslt_gemm_fp8")
    }

    /// x16's `n` rows of `k` (a multiple of [`ACT_GROUP`]) as the W8A8 GEMM reads them: e4m3
    /// bytes into `q` and a scale per row and group into `scales`, group-major
    /// ([`crate::quant::fp8::quantize_rows`] is its CPU twin).
    fn quantize_rows_into(
        &self,
        x16: &CudaSlice<half::f16>,
        n: usize,
        k: usize,
        q: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let warps = (n * (k / ACT_GROUP)) as u64;
        let blocks = (warps * 32).div_ceil(QUANT_THREADS as u64);
        let (nn, kk) = (n as i32, k as i32);
        let name = "quant_rows_f8";
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(x16).arg(&mut *q).arg(&mut *scales).arg(&nn).arg(&kk);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (QUANT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches quant_rows_f8: x16 holds n*k halves, q n*k bytes, scales n*k/128
        // floats; k is a multiple of 128, so each warp's 8-byte loads stay in its row.
        self.launched(name, unsafe { l.launch(cfg) }.map(|_| ()))
    }

    /// `x` (f32 `[n, k]`, k a multiple of 128) rounded to f16 and quantized as the W8A8 GEMM
    /// quantizes its activations: the bytes row-major and the scales group-major. For the GPU
    /// test against [`crate::quant::fp8::quantize_rows`].
    #[doc(hidden)]
    pub fn quantize_rows_fp8(&self, x: &CudaTensor) -> Result<(Vec<u8>, Vec<f32>)> {
        let (n, k) = (x.rows(), x.cols());
        if k % ACT_GROUP != 0 {
            return Err(Error::shape(
                "quantize_rows_fp8",
                format!("{k} columns: not whole groups of {ACT_GROUP}"),
            ));
        }
        let x16 = self.to_f16(x)?;
        let mut q = self.alloc_slice::<u8>(n * k)?;
        let mut scales = self.alloc_slice::<f32>(n * k / ACT_GROUP)?;
        self.quantize_rows_into(&x16, n, k, &mut q, &mut scales)?;
        let stream = &self.inner.stream;
        let err = |e: cudarc::driver::DriverError| super::error::cuda_err("quantize_rows_fp8")(&e);
        Ok((
            stream.clone_dtoh(&q).map_err(err)?,
            stream.clone_dtoh(&scales).map_err(err)?,
        ))
    }
}
