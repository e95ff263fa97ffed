//! GEMMs through cuBLASLt, whose epilogues add the bias, apply GELU and accumulate into the
//! output, and which can write f16. They let the ViT's projections run without bias, GELU, add
//! and cast passes of their own (each a read and a write of all the activations: at 896x896
//! those passes took longer than the GEMMs). Plain GEMMs stay on cuBLAS's `GemmEx`
//! (linear.rs).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::error::cuda_err;
use crate::{Error, Result};

/// What a cuBLASLt GEMM does after the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Epilogue {
    /// `+ bias`
    Bias,
    /// `gelu_tanh(· + bias)`: cuBLASLt's GELU is the tanh form (HF's `gelu_pytorch_tanh`).
    GeluBias,
}

/// Where a cuBLASLt GEMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum LtOut {
    /// f32; with `accumulate`, added to what the output holds (a residual stream).
    F32 { accumulate: bool },
    /// f16, the next GEMM's operand (its bias must then be f16 too: cuBLASLt takes no f32
    /// bias with an f16 output).
    F16,
}

/// A GEMM's shape and what it does around the product: `out [n, m] (+)= x [n, k] · w [m, k]ᵀ`
/// (row-major), then the epilogue with a bias `[m]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct LtShape {
    pub n: usize,
    pub k: usize,
    pub m: usize,
    pub out_kind: LtOut,
    pub epilogue: Epilogue,
}

/// An FP8 GEMM with block scales, the W8A8 path of FP8 weights on Hopper (sm_90, cuBLAS 12.9
/// and later): `out [n, m] (+)= x [n, k] · w [m, k]ᵀ` (row-major) with x e4m3 and a scale per
/// row and 128 columns (`VEC128_32F`), w e4m3 and a scale per 128 x 128 block
/// (`BLK128x128_32F`); f32 accumulation, no epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Fp8Shape {
    pub n: usize,
    pub k: usize,
    pub m: usize,
    pub out_kind: LtOut,
}

/// A GEMM cuBLASLt is asked about: the algorithm cache's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum LtGemm {
    F16(LtShape),
    Fp8(Fp8Shape),
}

impl LtGemm {
    fn out_kind(&self) -> LtOut {
        match self {
            LtGemm::F16(s) => s.out_kind,
            LtGemm::Fp8(s) => s.out_kind,
        }
    }
}

/// The device addresses of one GEMM's operands (the caller keeps them alive and ordered on
/// the stream). cuBLASLt's algorithms are picked for 256-byte aligned operands, as every
/// allocation of this backend is; `matmul` checks.
pub(super) struct LtOperands {
    pub x: CUdeviceptr,
    pub w: CUdeviceptr,
    /// The epilogue's bias (0 where there is none: FP8).
    pub bias: CUdeviceptr,
    pub out: CUdeviceptr,
    /// FP8's scales: w's block scales and x's row scales (0 for f16).
    pub w_scales: CUdeviceptr,
    pub x_scales: CUdeviceptr,
}

/// `CUBLASLT_MATMUL_DESC_A_SCALE_MODE` and `_B_SCALE_MODE` (cuBLAS 12.8) and the two scale
/// modes cuBLAS 12.9 added for Hopper, by number: the bindings this crate builds against
/// (cudarc's `cuda-12060`, so that Jetson's CUDA 12.6 loads them) predate them. The numbers are
/// cuBLASLt's ABI (cublasLt.h: `cublasLtMatmulDescAttributes_t`, `cublasLtMatmulMatrixScale_t`).
const A_SCALE_MODE: u32 = 31;
const B_SCALE_MODE: u32 = 32;
const SCALE_VEC128_32F: u32 = 4;
const SCALE_BLK128X128_32F: u32 = 5;

/// The first cuBLASLt with block-scaled FP8 (`cublasLtGetVersion`: 12.9.0).
const FP8_BLOCK_SCALES_VERSION: usize = 120_900;

/// The algorithm cuBLASLt's heuristic picked for a shape.
#[derive(Clone, Copy)]
pub(super) struct LtAlgo(sys::cublasLtMatmulAlgo_t);

/// A cuBLASLt handle and the algorithm its heuristic picked for each shape seen.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// `None`: cuBLASLt has no algorithm for that shape (the caller takes another path).
    /// Cached: a heuristic query costs more host time than many of the GEMMs.
    algos: Mutex<HashMap<LtGemm, Option<LtAlgo>>>,
    /// The loaded cuBLASLt's version (`cublasLtGetVersion`, e.g. 130000 for 13.0.0).
    version: usize,
}

// SAFETY: cuBLASLt handles may be used from several host threads at once (cuBLAS's thread
// safety section); the algorithm cache is behind a mutex.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Descriptors destroyed when the GEMM call returns (cuBLASLt copies what it needs at
/// enqueue time).
struct Descriptors {
    op: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once and is destroyed once, here.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.op);
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}

fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> Error + '_ {
    move |e| cuda_err(what)(&format!("{e:?}"))
}

/// Sets one attribute of a matmul descriptor from a value.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(lt_err("cuBLASLt descriptor"))
}

/// [`set_attr`] for an attribute the bindings do not name ([`A_SCALE_MODE`]), through the
/// library's own `cublasLtMatmulDescSetAttribute`, which takes the attribute as a 32-bit enum.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_attr_by_number<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: u32,
    value: &T,
) -> Result<()> {
    type SetAttribute = unsafe extern "C" fn(
        sys::cublasLtMatmulDesc_t,
        u32,
        *const c_void,
        usize,
    ) -> sys::cublasStatus_t;
    // Looked up once: every W8A8 GEMM's descriptor sets two such attributes.
    static SET: std::sync::OnceLock<std::result::Result<SetAttribute, String>> =
        std::sync::OnceLock::new();
    let set = SET
        .get_or_init(|| {
            sys::culib()
                .get::<SetAttribute>(b"cublasLtMatmulDescSetAttribute\0")
                .map(|f| *f)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| cuda_err("cuBLASLt descriptor")(e))?;
    set(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .result()
    .map_err(lt_err("cuBLASLt descriptor"))
}

impl Lt {
    pub(super) fn new() -> Result<Self> {
        Ok(Self {
            handle: lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?,
            algos: Mutex::new(HashMap::new()),
            // SAFETY: the library is loaded (the handle was created); takes no arguments.
            version: unsafe { sys::cublasLtGetVersion() },
        })
    }

    /// Whether this cuBLASLt has FP8 GEMMs with block scales (12.9 and later; they run on
    /// sm_90 only, which the caller checks).
    pub(super) fn has_fp8_block_scales(&self) -> bool {
        self.version >= FP8_BLOCK_SCALES_VERSION
    }

    /// The descriptors of `gemm`; FP8's with `scales` (w's, x's) as its scale pointers.
    fn describe(&self, gemm: &LtGemm, scales: (CUdeviceptr, CUdeviceptr)) -> Result<Descriptors> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        use sys::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F, CUDA_R_8F_E4M3};
        let out_type = match gemm.out_kind() {
            LtOut::F32 { .. } => CUDA_R_32F,
            LtOut::F16 => CUDA_R_16F,
        };
        let (n, k, m, in_type, epilogue) = match gemm {
            LtGemm::F16(s) => (s.n, s.k, s.m, CUDA_R_16F, Some(s.epilogue)),
            LtGemm::Fp8(s) => (s.n, s.k, s.m, CUDA_R_8F_E4M3, None),
        };
        let op = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(lt_err("cuBLASLt descriptor"))?;
        let mut d = Descriptors {
            op,
            layouts: Vec::with_capacity(3),
            pref: None,
        };
        // SAFETY: `op` is live; the values have the attributes' types.
        unsafe {
            // Column-major, as cuBLAS sees row-major data: outᵀ [m, n] = wᵀ · xᵀ, with w
            // [m, k] row-major read transposed (FP8 takes only this form, "TN").
            set_attr(
                op,
                A::CUBLASLT_MATMUL_DESC_TRANSA,
                &cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            )?;
            match epilogue {
                Some(e) => {
                    let e = match e {
                        Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                        Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
                    };
                    set_attr(op, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &e)?;
                }
                // cuBLAS's A is w: a scale per 128 x 128 block; its B is x: one per row
                // (x's, an output column of cuBLAS's) and 128 of k.
                None => {
                    set_attr_by_number(op, A_SCALE_MODE, &SCALE_BLK128X128_32F)?;
                    set_attr_by_number(op, B_SCALE_MODE, &SCALE_VEC128_32F)?;
                    set_attr(op, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales.0)?;
                    set_attr(op, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales.1)?;
                }
            }
        }
        for (ty, rows, cols) in [(in_type, k, m), (in_type, k, n), (out_type, m, n)] {
            let l = lt::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64)
                .map_err(lt_err("cuBLASLt layout"))?;
            d.layouts.push(l);
        }
        Ok(d)
    }

    /// The algorithm for `gemm` (asked of cuBLASLt's heuristic once per shape, for
    /// `workspace`: its address and bytes); `None` where it has none.
    pub(super) fn algo(
        &self,
        gemm: LtGemm,
        workspace: (CUdeviceptr, usize),
    ) -> Result<Option<LtAlgo>> {
        let mut algos = self.algos.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = algos.get(&gemm) {
            return Ok(*a);
        }
        let found = self.heuristic(&gemm, workspace, 1)?;
        // "Not supported" is an answer (no algorithm), anything else an error; for FP8 (a
        // path with a weight-only fallback, on a feature new in cuBLAS 12.9) any refusal is
        // an answer too, logged once a shape.
        let algo = match found {
            Ok(h) => Some(LtAlgo(h[0].algo)),
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
            Err(e) if matches!(gemm, LtGemm::Fp8(_)) => {
                tracing::warn!(
                    ?gemm,
                    version = self.version,
                    "cuBLASLt refused the W8A8 GEMM ({e:?}); this shape runs weight-only"
                );
                None
            }
            Err(e) => return Err(lt_err("cuBLASLt heuristic")(e)),
        };
        algos.insert(gemm, algo);
        Ok(algo)
    }

    /// Up to `count` algorithms cuBLASLt's heuristic offers for `gemm`, its choice first (for
    /// timing them against each other: w8a8.rs's `w8a8_algo_times`). Empty where it has none.
    pub(super) fn candidates(
        &self,
        gemm: &LtGemm,
        workspace: (CUdeviceptr, usize),
        count: usize,
    ) -> Result<Vec<LtAlgo>> {
        match self.heuristic(gemm, workspace, count)? {
            Ok(found) => Ok(found.iter().map(|h| LtAlgo(h.algo)).collect()),
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(vec![]),
            Err(e) => Err(lt_err("cuBLASLt heuristic")(e)),
        }
    }

    /// The heuristic's best `count` (at least one) for `gemm` with `workspace` (its address and
    /// bytes): the outer error a descriptor's, the inner the heuristic's answer
    /// (`NOT_SUPPORTED` where it found none).
    fn heuristic(
        &self,
        gemm: &LtGemm,
        workspace: (CUdeviceptr, usize),
        count: usize,
    ) -> Result<std::result::Result<Vec<sys::cublasLtMatmulHeuristicResult_t>, lt::CublasError>>
    {
        let (workspace_bytes, count) = (workspace.1, count.max(1));
        // The heuristic refuses block scale modes without scale pointers (INVALID_VALUE); it
        // reads nothing through them, so any device address serves until `matmul` gives the
        // real ones.
        let mut d = self.describe(gemm, (workspace.0, workspace.0))?;
        let pref = lt::create_matmul_pref().map_err(lt_err("cuBLASLt preference"))?;
        d.pref = Some(pref);
        let (wl, xl, ol) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> = Vec::with_capacity(count);
        let mut returned = 0i32;
        // SAFETY: every descriptor is live (in `d`); the attribute is a usize; `found` has room
        // for `count` results, of which cuBLASLt writes `returned`.
        let status = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes) as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(lt_err("cuBLASLt preference"))?;
            let status = sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                d.op,
                wl,
                xl,
                ol,
                ol,
                pref,
                count as i32,
                found.as_mut_ptr(),
                &mut returned,
            );
            found.set_len((returned.max(0) as usize).min(count));
            status
        };
        Ok(match status {
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS if !found.is_empty() => Ok(found),
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Err(lt::CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            )),
            e => Err(lt::CublasError(e)),
        })
    }

    /// Enqueues `gemm` with `algo` (from [`Lt::algo`] for the same GEMM) on `stream`, the
    /// product times `alpha`, using `workspace` (shared with cuBLAS: both only run on this one
    /// stream).
    ///
    /// # Safety
    /// The operands hold what `gemm` says (f16: x `n*k` and w `m*k` halves, bias `m` of the
    /// output's type; FP8: x `n*k` and w `m*k` bytes, their scales as [`Fp8Shape`] says; out
    /// `n*m` of its kind) and stay valid until the stream has run the GEMM.
    pub(super) unsafe fn matmul(
        &self,
        stream: CUstream,
        workspace: (CUdeviceptr, usize),
        gemm: &LtGemm,
        algo: LtAlgo,
        ops: &LtOperands,
        alpha: f32,
    ) -> Result<()> {
        let ptrs = [
            ops.x,
            ops.w,
            ops.bias,
            ops.out,
            ops.w_scales,
            ops.x_scales,
            workspace.0,
        ];
        if ptrs.iter().any(|p| p % 256 != 0) {
            return Err(Error::Cuda {
                what: "cuBLASLt GEMM: an operand is not 256-byte aligned".into(),
            });
        }
        let d = self.describe(gemm, (ops.w_scales, ops.x_scales))?;
        if let LtGemm::F16(_) = gemm {
            set_attr(
                d.op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &ops.bias,
            )?;
        }
        let (wl, xl, ol) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        let beta = match gemm.out_kind() {
            LtOut::F32 { accumulate: true } => 1.0f32,
            _ => 0.0,
        };
        lt::matmul(
            self.handle,
            d.op,
            (&alpha) as *const f32 as *const c_void,
            (&beta) as *const f32 as *const c_void,
            ops.w as *const c_void,
            wl,
            ops.x as *const c_void,
            xl,
            ops.out as *const c_void,
            ol,
            ops.out as *mut c_void,
            ol,
            &algo.0,
            workspace.0 as *mut c_void,
            workspace.1,
            stream as sys::cudaStream_t,
        )
        .map_err(lt_err("cuBLASLt matmul"))
    }
}
