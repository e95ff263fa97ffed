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

/// The device addresses of one GEMM's operands (the caller keeps them alive and ordered on
/// the stream). cuBLASLt's algorithms are picked for 256-byte aligned operands, as every
/// allocation of this backend is; `matmul` checks.
pub(super) struct LtOperands {
    pub x: CUdeviceptr,
    pub w: CUdeviceptr,
    pub bias: CUdeviceptr,
    pub out: CUdeviceptr,
}

/// The algorithm cuBLASLt's heuristic picked for a shape.
#[derive(Clone, Copy)]
pub(super) struct LtAlgo(sys::cublasLtMatmulAlgo_t);

/// A cuBLASLt handle and the algorithm its heuristic picked for each shape seen.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// `None`: cuBLASLt has no algorithm for that shape (the caller takes another path).
    /// Cached: a heuristic query costs more host time than many of the GEMMs.
    algos: Mutex<HashMap<LtShape, Option<LtAlgo>>>,
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

impl Lt {
    pub(super) fn new() -> Result<Self> {
        Ok(Self {
            handle: lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?,
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// The descriptors of `shape`'s GEMM.
    fn describe(&self, shape: &LtShape) -> Result<Descriptors> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        use sys::cudaDataType_t::{CUDA_R_16F, CUDA_R_32F};
        let out_type = match shape.out_kind {
            LtOut::F32 { .. } => CUDA_R_32F,
            LtOut::F16 => CUDA_R_16F,
        };
        let op = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(lt_err("cuBLASLt descriptor"))?;
        let mut d = Descriptors {
            op,
            layouts: Vec::with_capacity(3),
            pref: None,
        };
        let epilogue = match shape.epilogue {
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        // SAFETY: `op` is live; the values have the attributes' types.
        unsafe {
            // Column-major, as cuBLAS sees row-major data: outᵀ [m, n] = wᵀ · xᵀ, with w
            // [m, k] row-major read transposed.
            set_attr(
                op,
                A::CUBLASLT_MATMUL_DESC_TRANSA,
                &cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
            )?;
            set_attr(op, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        }
        for (ty, rows, cols) in [
            (CUDA_R_16F, shape.k, shape.m),
            (CUDA_R_16F, shape.k, shape.n),
            (out_type, shape.m, shape.n),
        ] {
            let l = lt::create_matrix_layout(ty, rows as u64, cols as u64, rows as i64)
                .map_err(lt_err("cuBLASLt layout"))?;
            d.layouts.push(l);
        }
        Ok(d)
    }

    /// The algorithm for `shape` (asked of cuBLASLt's heuristic once per shape, for a
    /// workspace of `workspace_bytes`); `None` where it has none.
    pub(super) fn algo(&self, shape: &LtShape, workspace_bytes: usize) -> Result<Option<LtAlgo>> {
        let mut algos = self.algos.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = algos.get(shape) {
            return Ok(*a);
        }
        let mut d = self.describe(shape)?;
        let pref = lt::create_matmul_pref().map_err(lt_err("cuBLASLt preference"))?;
        d.pref = Some(pref);
        let (wl, xl, ol) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        // SAFETY: every descriptor is live (in `d`); the attribute is a usize.
        let found = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes) as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(lt_err("cuBLASLt preference"))?;
            lt::get_matmul_algo_heuristic(self.handle, d.op, wl, xl, ol, ol, pref)
        };
        // "Not supported" is an answer (no algorithm), anything else an error.
        let algo = match found {
            Ok(h) => Some(LtAlgo(h.algo)),
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
            Err(e) => return Err(lt_err("cuBLASLt heuristic")(e)),
        };
        algos.insert(*shape, algo);
        Ok(algo)
    }

    /// Enqueues `shape`'s GEMM with `algo` (from [`Lt::algo`] for the same shape) on
    /// `stream`, using `workspace` (shared with cuBLAS: both only run on this one stream).
    ///
    /// # Safety
    /// The operands hold what `shape` says (x `n*k` and w `m*k` halves, out `n*m` of its kind,
    /// bias `m` of the output's type) and stay valid until the stream has run the GEMM.
    pub(super) unsafe fn matmul(
        &self,
        stream: CUstream,
        workspace: (CUdeviceptr, usize),
        shape: &LtShape,
        algo: LtAlgo,
        ops: &LtOperands,
    ) -> Result<()> {
        if [ops.x, ops.w, ops.bias, ops.out, workspace.0]
            .iter()
            .any(|p| p % 256 != 0)
        {
            return Err(Error::Cuda {
                what: "cuBLASLt GEMM: an operand is not 256-byte aligned".into(),
            });
        }
        let d = self.describe(shape)?;
        set_attr(
            d.op,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &ops.bias,
        )?;
        let (wl, xl, ol) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        let alpha = 1.0f32;
        let beta = match shape.out_kind {
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
