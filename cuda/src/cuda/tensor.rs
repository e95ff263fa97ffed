//! The device-side types of [`Backend`]: f32 tensors, f16 weights, ids, the paged KV cache's
//! layers and a recorded step.
//!
//! [`Backend`]: crate::Backend

use std::sync::Arc;

use cudarc::driver::CudaSlice;

/// A tensor in device memory. Clones share the buffer; the in-place row ops copy it first when
/// it is shared, so a clone never sees another's writes.
#[derive(Clone)]
pub struct CudaTensor {
    pub(super) shape: Vec<usize>,
    pub(super) buf: Arc<CudaSlice<f32>>,
}

/// A weight matrix or table in device memory: f16, or integer-quantized (a matrix of a
/// quantized checkpoint or of `--quantize`).
#[derive(Clone)]
pub struct CudaWeight {
    pub(super) shape: Vec<usize>,
    pub(super) data: WeightData,
}

#[derive(Clone)]
pub(super) enum WeightData {
    F16(Arc<CudaSlice<half::f16>>),
    Int(Arc<IntWeight>),
}

/// The values of an [`IntWeight`], as weights_f16.cu's FMT: 4- or 8-bit integers
/// ((q - zero) * scale), or FP8 e4m3 bytes times a scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IntFormat {
    W4,
    W8,
    E4m3,
}

impl IntFormat {
    pub(super) const ALL: [IntFormat; 3] = [IntFormat::W4, IntFormat::W8, IntFormat::E4m3];

    /// The integer format of `bits` (4 or 8).
    pub(super) fn of_bits(bits: u32) -> Self {
        if bits == 4 {
            IntFormat::W4
        } else {
            IntFormat::W8
        }
    }

    pub(super) fn bits(self) -> u32 {
        match self {
            IntFormat::W4 => 4,
            IntFormat::W8 | IntFormat::E4m3 => 8,
        }
    }
}

/// An integer (or FP8) matrix `[m, k]` as weights_f16.cu's integer kernels read it: row-major
/// words of `32 / bits` values along k, low bits first, and a (scale, zero) pair of f16 per
/// row and `group` columns.
pub(super) struct IntWeight {
    pub(super) format: IntFormat,
    pub(super) group: usize,
    pub(super) words: CudaSlice<u32>,
    /// `[m, k / group, 2]`: scale, zero. For [`IntFormat::E4m3`] each pair's four bytes are
    /// one f32, the scale times 2^8 (the kernels read e4m3 bytes as their value times 2^-8).
    pub(super) sz: CudaSlice<half::f16>,
    /// Whether every scale survives the tensor-core integer GEMM's rounding to f16 within
    /// 2^-11 (an f16 normal number, or 0): W4's and W8's always (they are f16), FP8's where
    /// each scale times 2^8 is ([`fp8_scale_fits_f16`]). Else batches keep the dequantization.
    pub(super) scales_fit_f16: bool,
    /// FP8 weights quantized in blocks of 128 x 128 (Qwen's FP8 checkpoints, `--quantize
    /// fp8`): the block scales as the W8A8 GEMM (cuBLASLt's `BLK128x128_32F`) reads them, f32
    /// `[ceil(m / 128), ld]`, a row's blocks along k together, `ld` = `ceil(k / 128)` rounded up
    /// to 4 (16 bytes). `None` for every other weight.
    pub(super) block_scales: Option<CudaSlice<f32>>,
}

/// Whether an FP8 weight's kernel scale (the checkpoint's times 2^8) rounds to an f16 normal
/// number within 2^-11 of it, or is 0, as weights_f16.cu's int_mma_gemm needs.
pub(super) fn fp8_scale_fits_f16(kernel_scale: f32) -> bool {
    const F16_MIN_NORMAL: f32 = 1.0 / 16384.0;
    kernel_scale == 0.0
        || (F16_MIN_NORMAL..=f32::from(half::f16::MAX)).contains(&kernel_scale.abs())
}

impl CudaWeight {
    pub(super) fn f16(shape: Vec<usize>, buf: CudaSlice<half::f16>) -> Self {
        Self {
            shape,
            data: WeightData::F16(Arc::new(buf)),
        }
    }

    /// The f16 matrix, where this weight is one.
    pub(super) fn as_f16(&self) -> Option<&Arc<CudaSlice<half::f16>>> {
        match &self.data {
            WeightData::F16(b) => Some(b),
            WeightData::Int(_) => None,
        }
    }

    pub(super) fn as_int(&self) -> Option<&IntWeight> {
        match &self.data {
            WeightData::Int(w) => Some(w),
            WeightData::F16(_) => None,
        }
    }
}

/// Ids in device memory (token ids, cache slots, block lists, picked tokens).
pub struct CudaIds {
    pub(super) len: usize,
    pub(super) buf: CudaSlice<u32>,
}

/// One layer's keys or values of the paged KV cache, `[slots, heads, dim]`: f16, or FP8 e4m3
/// bytes and a scale, as `format` says. The kernels take the buffer as a pointer to their
/// element type (`__half` or `unsigned char`), picked by the format.
pub struct CudaCache {
    pub(super) shape: [usize; 3],
    pub(super) format: crate::KvFormat,
    /// `shape`'s elements at `format`'s width.
    pub(super) buf: CudaSlice<u8>,
}

impl CudaCache {
    /// Whether the elements are FP8 bytes (the kernels' `_f8` variants read and write them).
    pub(super) fn fp8(&self) -> bool {
        matches!(self.format, crate::KvFormat::Fp8 { .. })
    }
}

impl CudaTensor {
    pub(super) fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub(super) fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub(super) fn rows(&self) -> usize {
        self.len().checked_div(self.cols()).unwrap_or(0)
    }
}

/// A recorded sequence of ops (a decode step, a ViT pass): a CUDA graph on the backend's
/// stream, and the memory of the buffers its ops made (recording.rs).
pub struct CudaStepGraph {
    pub(super) graph: cudarc::driver::CudaGraph,
    pub(super) _pool: std::sync::Arc<super::pool::RecordingPool>,
}

// SAFETY: the graph's handles are plain driver handles, usable from any thread: launching it
// binds the backend's context to the calling thread first (cudarc's CudaGraph::launch), and
// whoever holds it launches it through `&self` on the one stream it was recorded for, so two
// threads cannot run it at once without the holder's own lock (the models keep theirs behind
// a Mutex or on one thread).
unsafe impl Send for CudaStepGraph {}
