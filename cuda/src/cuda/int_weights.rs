//! Integer-quantized weights on the GPU (W4A16, W8A16, and FP8 e4m3 in W8's layout): upload in
//! the layout the kernels read (`IntWeight`), random ones for `--random-weights --quantize`,
//! stacking (q/k/v, gate/up), the GEMV launches for decode rows, the tensor-core integer GEMM
//! for batches of up to 64 rows (the packed weights read once), and an f16 view for cuBLAS past
//! that or where the GEMM does not take the shape (dequantized into one scratch buffer of at most
//! 64 MiB, a chunk of a larger matrix's rows at a time).
//! Kernels in `cuda/kernels/weights_f16.cu` (`int_gemv`, `int_mma_gemv`, `int_mma_gemm`,
//! `dequant_int`, `fill_random_int`).
//!
//! A matrix the integer kernels cannot take stays f16 (dequantized at load, exactly the values
//! the checkpoint means): GPTQ act order (columns not grouped in order), groups that are not
//! whole loads (32 columns at 4 bits, 16 at 8), zero points that are not whole numbers.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::error::cuda_err;
use super::kernels::{
    count_from_env, int_gemm_kernel, int_gemm_tiles, Gemv, IntGemmBlock, GEMV_WARPS,
    INT_GEMM_BLOCKS, INT_GEMM_K, INT_GEMM_MAX_ROWS, INT_GEMM_STAGES, INT_GEMM_SZ_SLOTS,
    INT_GEMM_WGMMA_MIN_TILES,
};
use super::launch::arg;
use super::linear::GemmOut;
use super::tensor::{fp8_scale_fits_f16, IntFormat, IntWeight, WeightData};
use super::{CudaBackend, CudaTensor, CudaWeight};
use crate::quant::fp8::Fp8Matrix;
use crate::quant::{random_int_scale, IntMatrix, QuantizeTo, QUANTIZE_GROUP};
use crate::{Error, Result};

/// Shared memory the tensor-core integer GEMVs take past their staged rows: the warps' partial
/// sums, two turns of GEMV_WARPS x 32 lanes x 2 floats.
const MMA_PART_BYTES: usize = 2 * GEMV_WARPS as usize * 32 * 8;

/// Whether the integer GEMVs may take the tensor cores (int_mma_gemv) where their shapes allow;
/// `VLM_INT_GEMV=cuda` keeps every one on int_gemv (to compare, and to test that path).
fn tensor_core_gemv() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VLM_INT_GEMV").map_or(true, |v| v != "cuda"))
}

/// Whether batches of rows may take the tensor-core integer GEMM (int_mma_gemm: the packed
/// weights read once) where their shapes allow; `VLM_INT_GEMM=dequant` keeps every one on the
/// dequantization into the f16 scratch and cuBLAS (to compare, and to test that path).
fn tensor_core_gemm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VLM_INT_GEMM").map_or(true, |v| v != "dequant"))
}

/// Whether the integer GEMM may run on Hopper's wgmma (int_wgmma_gemm) where it is compiled
/// (sm_90); `VLM_INT_GEMM=mma` keeps it on mma.sync, the kernel every other GPU (Jetson Orin's
/// sm_87 included) runs, so that the H100 tests and times that one too.
pub(super) fn wgmma_gemm_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VLM_INT_GEMM").map_or(true, |v| v != "mma"))
}

/// The passes of INT_GEMM_MAX_ROWS rows a batch may take through the integer GEMM before it
/// goes to the dequantization and cuBLAS instead (a vocabulary-sized weight, which has no
/// scratch, takes as many as it needs): each pass reads the packed weights once, where the
/// dequantization writes and reads them in f16 every step. `VLM_INT_GEMM_PASSES=n` (at least
/// 1) to time it.
pub(super) fn int_gemm_max_passes() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| count_from_env("VLM_INT_GEMM_PASSES").unwrap_or(2))
}

/// The integer GEMM's locks (context.rs): one per m-block, so matrices up to 1024 blocks may
/// split k (larger ones do not).
pub(super) const INT_GEMM_LOCKS: usize = 1024;

/// The most k splits an integer GEMM launch takes: `VLM_INT_GEMM_SPLITS=n` (at least 1) to
/// tune; more splits fill more SMs but write and read more partial sums.
fn int_gemm_max_splits() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| count_from_env("VLM_INT_GEMM_SPLITS").unwrap_or(usize::MAX))
}

/// The block rows every integer GEMM of the process takes, where that shape's shared memory
/// fits: `VLM_INT_GEMM_ROWS=256`, `192` or `128` (one of [`INT_GEMM_BLOCKS`]; to time them
/// against each other); else each shape gets [`int_gemm_grid`]'s choice. The k splits are
/// chosen for the forced shape as for any.
fn int_gemm_forced_rows() -> Option<usize> {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        let rows = std::env::var("VLM_INT_GEMM_ROWS").ok()?.parse().ok()?;
        INT_GEMM_BLOCKS
            .iter()
            .any(|b| b.rows() == rows)
            .then_some(rows)
    })
}

thread_local! {
    /// Block rows forced on this thread's integer GEMMs by [`with_int_gemm_rows`] (before
    /// `VLM_INT_GEMM_ROWS`).
    static FORCED_ROWS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's integer GEMMs on blocks of `rows` weight rows (one of
/// [`INT_GEMM_BLOCKS`]' rows, where its shared memory fits; `None`: each shape's own choice),
/// as `VLM_INT_GEMM_ROWS` does for a whole process: how the twin cases
/// ([`crate::twin::Case::IntGemm`]'s `block_rows`) reach every block shape on any GPU, whichever
/// the GPU's SM count would pick. Launches are queued on the calling thread, so no other
/// thread's GEMMs change.
pub fn with_int_gemm_rows<T>(rows: Option<usize>, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED_ROWS, rows, f)
}

thread_local! {
    /// mma.sync forced on this thread's integer GEMMs by [`with_int_gemm_on_mma`].
    static FORCED_MMA: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's integer GEMMs on mma.sync (int_mma_gemm, the kernel every GPU
/// but an H100/H200 runs, Jetson Orin's included) where `mma`, even where wgmma's is loaded:
/// how the twin tests check both kernels on an H100 and the example times both.
pub fn with_int_gemm_on_mma<T>(mma: bool, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED_MMA, Some(mma), f)
}

thread_local! {
    /// Weight rows forced on this thread's chunks of dequantization by
    /// [`with_dequant_chunk_rows`].
    static FORCED_CHUNK_ROWS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's dequantizations for cuBLAS in chunks of at most `rows` weight
/// rows (never more than [`dequant_chunk_rows`] gives, which sized the scratch; `None`: that),
/// so that a twin case of a few hundred rows goes through several chunks as an 8B model's
/// gate/up does.
pub fn with_dequant_chunk_rows<T>(rows: Option<usize>, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED_CHUNK_ROWS, rows, f)
}

/// The rows of an `[m, k]` weight this thread dequantizes at a time.
fn chunk_rows(m: usize, k: usize) -> usize {
    let own = dequant_chunk_rows(m, k);
    FORCED_CHUNK_ROWS.get().map_or(own, |r| r.clamp(1, own))
}

/// Floats of one block's partial sums under split k (context.rs holds one per SM): x's rows
/// by the largest block's rows (the first of [`INT_GEMM_BLOCKS`]).
pub(super) const INT_GEMM_PARTIAL_TILE: usize = INT_GEMM_MAX_ROWS * INT_GEMM_BLOCKS[0].rows();

/// Stages of k each split of the integer GEMM takes at least (fewer and the pipeline's fill
/// and the ordered adds weigh more than the extra blocks give).
const INT_GEMM_MIN_SPLIT_STAGES: usize = 4;

/// What a k stage of a block costs beyond its weight rows, in weight rows' time: the part of a
/// stage that does not shrink with the block (the barrier, the wait for the stage's loads,
/// the next stage's loads issued, latency that fewer rows a warp hide less). A stage of the
/// 256-row block (8 warps of whole stages) counts 320, of the 192-row one (12 warps of half
/// stages) 256 = 0.8 of it, of the 128-row one (8 warps of half stages) 192 = 0.6, where rows
/// alone said 0.75 and 0.5. Fitted to the H100 timings of each 8B shape on two grids, its
/// chosen one at ed7d3a8 (192 or 128 rows) and 256-row blocks (docs/results/
/// h100-2026-11-28-ed7d3a8-int-gemm.txt, `...-int-gemm-256-row-blocks.txt`): a least-squares
/// fit of time = u (stages a split x (rows + this) + split cost) + launch over the 8 grids of
/// each format and row count gives 35 (W4) and 30 (W8) at 64 rows, 112 and 70 at 8 rows.
/// With 64 and [`INT_GEMM_SPLIT_COST`] the fit is within 1.8 us at 8 rows and 3.8 at 64
/// (2.66 us a 256-row stage at W4 and 64 rows, 1.47 at 8). FP8 is left out: its 256-row
/// times in that run fit no stage count (o, 4 stages a split, within 4-9 us of down's 12) and
/// are up to twice the same grids' at e69708a, where W4's and W8's agree within 4% (the test
/// of the 8B grids below has the numbers).
const INT_GEMM_STAGE_ROWS: usize = 64;

/// What splitting k costs a block beyond its stages, in stages of the largest block (the first
/// of [`INT_GEMM_BLOCKS`]) whatever the block's own rows: its partial tile written, the wait
/// for the m-block's other splits, and its share of the tiles read back and added in order,
/// which take about as long on a 128-row block as on a 256-row one. The same fit as
/// [`INT_GEMM_STAGE_ROWS`]' gives 4.1 (W4) and 4.3 (W8) stages at 64 rows, 4.1 and 3.2 at 8.
/// (Counted in the block's own stages, as before, 128-row blocks split 4 ways looked 25%
/// cheaper than 256-row blocks split 8 ways on o and 12% on down, and were 3-12% slower.)
const INT_GEMM_SPLIT_COST: usize = 4;

/// What one k stage of `block` costs in [`int_gemm_grid`]'s count, in weight rows' time.
fn int_gemm_stage_cost(block: IntGemmBlock) -> usize {
    block.rows() + INT_GEMM_STAGE_ROWS
}

/// Shared memory of the integer GEMM at `bits` for `rows` rows of x on blocks of shape
/// `block`: int_mma_gemm's stages (weights_f16.cu, ig_stage_bytes), which also hold the
/// second halves' sums of a block of two warps a row group once k is done.
fn int_gemm_smem(bits: u32, rows: usize, block: IntGemmBlock) -> usize {
    let tiles = int_gemm_tiles(rows);
    let stage = block.rows() * INT_GEMM_K * bits as usize / 8
        + tiles * 8 * INT_GEMM_K * 2
        + block.rows() * INT_GEMM_SZ_SLOTS * 4;
    // A warp's accumulators: 2 m16 tiles x `tiles` n8 tiles x 4 floats a lane.
    let halves = (block.k_parts - 1) * block.row_groups * 2 * tiles * 4 * 32 * 4;
    (INT_GEMM_STAGES * stage).max(halves)
}

/// How an integer GEMM launch covers its weight: blocks of one shape of [`INT_GEMM_BLOCKS`],
/// enough of them for the weight's rows, and the ranges of k stages each is split into (one
/// block a range, adjacent in the grid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntGemmGrid {
    pub block: IntGemmBlock,
    /// Blocks of `block.rows()` weight rows (the last one's part empty where they do not
    /// divide the rows).
    pub blocks: usize,
    /// k splits of each block (1: unsplit).
    pub splits: usize,
}

impl IntGemmGrid {
    /// Blocks launched.
    pub fn grid(&self) -> usize {
        self.blocks * self.splits
    }
}

impl std::fmt::Display for IntGemmGrid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} blocks of {} rows ({} warps) x {} k splits = {}",
            self.blocks,
            self.block.rows(),
            self.block.warps(),
            self.splits,
            self.grid()
        )
    }
}

/// The integer GEMM's grid for `m` weight rows of `stages` k stages on `sms` SMs: of the
/// block shapes `fits` allows (their shared memory; a forced one) and their k splits, the one
/// whose busiest SM has the least work, counted as its blocks' stages times the block's stage
/// cost ([`int_gemm_stage_cost`]: its rows plus [`INT_GEMM_STAGE_ROWS`]), plus
/// [`INT_GEMM_SPLIT_COST`] stages of the largest block for a split block; larger blocks, then
/// fewer splits, on ties. k is split only up to one block an SM (the splits of an m-block wait
/// for each other, so all must be resident; the partial sums hold one tile an SM),
/// [`INT_GEMM_MIN_SPLIT_STAGES`] a split, `max_splits`, and m-blocks that have a lock. `None`
/// where no shape fits.
///
/// At the 8B model's shapes on an H100 (132 SMs), at every row count and format: gate/up's
/// 24,576 rows as 128 blocks of 192 (96 of 256 left 36 SMs idle), q/k/v's 6,144 as 32 of 192
/// split 4 ways, o's and down's 4,096 as 16 of 256 split 8 ways (32 of 128 split 4 ways: half
/// the stages' rows, but each stage 0.6 of a 256-row one's and the same split cost).
pub(super) fn int_gemm_grid(
    m: usize,
    stages: usize,
    sms: usize,
    max_splits: usize,
    fits: impl Fn(IntGemmBlock) -> bool,
) -> Option<IntGemmGrid> {
    let sms = sms.max(1);
    INT_GEMM_BLOCKS
        .into_iter()
        .enumerate()
        .filter(|&(_, block)| fits(block))
        .flat_map(|(rank, block)| {
            let blocks = m.div_ceil(block.rows()).max(1);
            let most = if blocks > INT_GEMM_LOCKS {
                1
            } else {
                (sms / blocks)
                    .min(stages / INT_GEMM_MIN_SPLIT_STAGES)
                    .min(max_splits)
                    .max(1)
            };
            (1..=most).map(move |splits| {
                let grid = IntGemmGrid {
                    block,
                    blocks,
                    splits,
                };
                let split_cost = if splits > 1 {
                    INT_GEMM_SPLIT_COST * int_gemm_stage_cost(INT_GEMM_BLOCKS[0])
                } else {
                    0
                };
                let per_block = stages.div_ceil(splits) * int_gemm_stage_cost(block) + split_cost;
                let busiest = grid.grid().div_ceil(sms) * per_block;
                ((busiest, rank, splits), grid)
            })
        })
        .min_by_key(|&(key, _)| key)
        .map(|(_, grid)| grid)
}

/// Rows and columns of the weight blocks the W8A8 GEMM takes a scale of (cuBLASLt's
/// `BLK128x128_32F`).
pub(super) const W8A8_BLOCK: usize = 128;

/// Floats a row of blocks takes in [`IntWeight::block_scales`]: its `blocks` scales, padded to
/// 4 (16 bytes, as cuBLASLt reads them).
pub(super) fn block_scales_ld(blocks: usize) -> usize {
    blocks.next_multiple_of(4)
}

/// An FP8 matrix's block scales as [`IntWeight::block_scales`] holds them, where its blocks
/// are [`W8A8_BLOCK`] square (else the W8A8 GEMM cannot take it).
fn fp8_block_scales(m: &Fp8Matrix) -> Option<Vec<f32>> {
    if m.block != [W8A8_BLOCK, W8A8_BLOCK] {
        return None;
    }
    let [rows, cols] = m.grid();
    let ld = block_scales_ld(cols);
    let mut out = vec![0f32; rows * ld];
    for (r, row) in out.chunks_mut(ld).enumerate() {
        row[..cols].copy_from_slice(&m.scales[r * cols..(r + 1) * cols]);
    }
    Some(out)
}

/// Integer weights of this many rows or more (a vocabulary: `lm_head` under
/// `--quantize-lm-head`) are never dequantized for the GEMMs of more rows than the integer GEMM
/// takes: an f16 copy would take the memory the quantization saved (1.24 GB at 8B) and
/// dequantizing it every step more time than the integer GEMM [`INT_GEMM_MAX_ROWS`] rows of x
/// at a time. No decoder matrix of the models served has as many rows (the most, the 32B's
/// gate/up, 51,200).
pub(super) const CHUNKED_MIN_ROWS: usize = 65_536;

/// Whether `iw` (`shape` `[m, k]`) takes the integer GEMM in chunks of rows of x instead of
/// the dequantization scratch: [`CHUNKED_MIN_ROWS`] rows or more, in a shape the integer GEMM
/// takes.
pub(super) fn chunked_int_gemm(be: &CudaBackend, iw: &IntWeight, shape: &[usize]) -> bool {
    shape[0] >= CHUNKED_MIN_ROWS && be.int_gemm_takes(iw, INT_GEMM_MAX_ROWS, shape[1])
}

/// Columns one 16-byte load of the integer GEMVs holds at `bits`.
fn load_cols(bits: u32) -> usize {
    128 / bits as usize
}

/// The most halves of an integer weight dequantized at a time for cuBLAS (64 MiB of scratch):
/// a larger matrix is dequantized and multiplied a chunk of its rows at a time. The scratch is
/// held for as long as the model serves, so the whole of the largest matrix cost a 4-bit 8B
/// model 201 MB (gate/up, 24,576 x 4,096), 4% of all it holds; in chunks (gate/up in 3 of 8,192
/// rows, down in 2 of 2,048) the GEMMs are still thousands of rows on each side.
pub const DEQUANT_SCRATCH_HALVES: usize = 32 << 20;

/// The rows of an `[m, k]` integer weight dequantized at a time: as few chunks as fit
/// [`DEQUANT_SCRATCH_HALVES`] (one if the matrix does; a row at least), of equal size but for a
/// shorter last.
pub fn dequant_chunk_rows(m: usize, k: usize) -> usize {
    let most = (DEQUANT_SCRATCH_HALVES / k.max(1)).max(1);
    m.div_ceil(m.div_ceil(most).max(1)).max(1)
}

impl CudaBackend {
    /// Whether the integer kernels take `m` as it is (else it goes to the GPU as f16).
    fn int_kernels_take(m: &IntMatrix) -> std::result::Result<(), &'static str> {
        if m.perm.is_some() {
            Err("act order (columns not grouped in order)")
        } else if m.group % load_cols(m.bits) != 0 || m.inp % load_cols(m.bits) != 0 {
            Err("groups or rows that are not whole 16-byte loads")
        } else if m.zeros.iter().any(|z| z.fract() != 0.0) {
            Err("zero points that are not whole numbers")
        } else {
            Ok(())
        }
    }

    pub(super) fn upload_int_weight_impl(&self, m: &IntMatrix) -> Result<CudaWeight> {
        if let Err(why) = Self::int_kernels_take(m) {
            tracing::info!(
                shape = ?[m.out, m.inp],
                bits = m.bits,
                group = m.group,
                "a quantized matrix with {why} is kept as f16 on the GPU"
            );
            return self.upload_weight_impl(&m.dequantize());
        }
        use rayon::prelude::*;
        let per = 32 / m.bits as usize;
        let words: Vec<u32> =
            m.q.par_chunks(per)
                .map(|vals| {
                    vals.iter()
                        .enumerate()
                        .fold(0u32, |w, (i, &v)| w | (v as u32) << (i as u32 * m.bits))
                })
                .collect();
        let sz: Vec<half::f16> = m
            .scales
            .iter()
            .zip(&m.zeros)
            .flat_map(|(&s, &z)| [half::f16::from_f32(s), half::f16::from_f32(z)])
            .collect();
        let stream = &self.inner.stream;
        let words = stream
            .clone_htod(&words)
            .map_err(|e| cuda_err("uploading a quantized weight")(&e))?;
        let sz = stream
            .clone_htod(&sz)
            .map_err(|e| cuda_err("uploading a quantized weight's scales")(&e))?;
        self.int_weight(
            vec![m.out, m.inp],
            IntWeight {
                format: IntFormat::of_bits(m.bits),
                group: m.group,
                words,
                sz,
                scales_fit_f16: true,
                block_scales: None,
            },
        )
    }

    /// An FP8 matrix as the integer kernels read it in their FP8 form (FMT_F8): the e4m3
    /// bytes as 8-bit words and, per row and group of columns (a block's columns, or the whole
    /// row where one scale covers it), the block's scale times 2^8 as an f32 in the (scale,
    /// zero) slot. A block grid that does not split into whole 16-byte loads stays f16 (exact:
    /// dequantized at load).
    pub(super) fn upload_fp8_weight_impl(&self, m: &Fp8Matrix) -> Result<CudaWeight> {
        let [block_rows, block_cols] = m.block;
        let group = block_cols.min(m.inp);
        let cols = load_cols(8);
        if m.inp % group != 0 || group % cols != 0 || m.inp % cols != 0 {
            tracing::info!(
                shape = ?[m.out, m.inp],
                block = ?m.block,
                "an FP8 matrix whose scale blocks are not whole 16-byte loads is kept as f16 on \
                 the GPU"
            );
            return self.upload_weight_impl(&m.dequantize());
        }
        use rayon::prelude::*;
        let words: Vec<u32> =
            m.q.par_chunks(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
        let [_, grid_cols] = m.grid();
        let groups = m.inp / group;
        let scales_fit_f16 = m.scales.iter().all(|&s| fp8_scale_fits_f16(s * 256.0));
        if !scales_fit_f16 {
            tracing::info!(
                shape = ?[m.out, m.inp],
                "an FP8 matrix with scales that are no f16 normal numbers times 2^8 keeps the \
                 dequantization for batches (the integer GEMM rounds its scales to f16)"
            );
        }
        let sz: Vec<half::f16> = (0..m.out * groups)
            .flat_map(|i| {
                let (row, g) = (i / groups, i % groups);
                let scale = m.scales[(row / block_rows) * grid_cols + g * group / block_cols];
                // The kernels' e4m3 values are 2^-8 of the real ones: a power of two, exact.
                let bits = (scale * 256.0).to_bits();
                [
                    half::f16::from_bits(bits as u16),
                    half::f16::from_bits((bits >> 16) as u16),
                ]
            })
            .collect();
        let stream = &self.inner.stream;
        let words = stream
            .clone_htod(&words)
            .map_err(|e| cuda_err("uploading an FP8 weight")(&e))?;
        let sz = stream
            .clone_htod(&sz)
            .map_err(|e| cuda_err("uploading an FP8 weight's scales")(&e))?;
        let block_scales = match fp8_block_scales(m) {
            Some(scales) => Some(
                stream
                    .clone_htod(&scales)
                    .map_err(|e| cuda_err("uploading an FP8 weight's block scales")(&e))?,
            ),
            None => None,
        };
        self.int_weight(
            vec![m.out, m.inp],
            IntWeight {
                format: IntFormat::E4m3,
                group,
                words,
                sz,
                scales_fit_f16,
                block_scales,
            },
        )
    }

    /// The weight, and the dequantization scratch grown to hold a chunk of it (but for a weight
    /// whose GEMMs take the integer GEMM a chunk of rows of x at a time: [`chunked_int_gemm`]).
    fn int_weight(&self, shape: Vec<usize>, w: IntWeight) -> Result<CudaWeight> {
        let n = dequant_chunk_rows(shape[0], shape[1]) * shape[1];
        let mut scratch = self.inner.dequant_scratch.lock().expect("not poisoned");
        if !chunked_int_gemm(self, &w, &shape) && scratch.as_ref().is_none_or(|s| s.len() < n) {
            *scratch = None;
            *scratch = Some(self.alloc_f16(n)?);
        }
        Ok(CudaWeight {
            shape,
            data: WeightData::Int(Arc::new(w)),
        })
    }

    pub(super) fn random_int_weight_impl(
        &self,
        shape: &[usize],
        key: u64,
        bound: f32,
        to: QuantizeTo,
    ) -> Result<CudaWeight> {
        let (m, k) = (shape[0], shape[1]);
        let bits = to.bits();
        let group = QUANTIZE_GROUP.min(k);
        if k % group != 0 || group % load_cols(bits) != 0 {
            return self.upload_int_weight_impl(&crate::quant::random_int(m, k, key, bound, to));
        }
        let n = (m * k / (32 / bits as usize)) as u64;
        let mut words = self.alloc_slice::<u32>(n.max(1) as usize)?;
        let name = "fill_random_int";
        let bits_i = bits as i32;
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&mut words).arg(&n).arg(&key).arg(&bits_i);
        // SAFETY: argument types and count match fill_random_int; words holds n words.
        self.launched(name, unsafe { l.launch(Self::fill_config(n)) }.map(|_| ()))?;
        let (s, z) = (random_int_scale(bound, bits), (1u32 << (bits - 1)) as f32);
        let pair = [half::f16::from_f32(s), half::f16::from_f32(z)];
        let sz: Vec<half::f16> = pair.repeat(m * (k / group));
        let sz = self
            .inner
            .stream
            .clone_htod(&sz)
            .map_err(|e| cuda_err("uploading a quantized weight's scales")(&e))?;
        self.int_weight(
            shape.to_vec(),
            IntWeight {
                format: IntFormat::of_bits(bits),
                group,
                words,
                sz,
                scales_fit_f16: true,
                block_scales: None,
            },
        )
    }

    /// The weights' rows one after another: integer weights of one bit width and group stay
    /// integer; any other mix is stacked as f16.
    pub(super) fn stack_weights_impl(&self, parts: &[&CudaWeight]) -> Result<CudaWeight> {
        let Some(first) = parts.first() else {
            return Err(Error::shape("stack_weights", "nothing to stack"));
        };
        let cols = first.shape.last().copied().unwrap_or(0);
        if parts
            .iter()
            .any(|p| p.shape.len() != 2 || p.shape[1] != cols)
        {
            let shapes: Vec<_> = parts.iter().map(|p| &p.shape).collect();
            return Err(Error::shape(
                "stack_weights",
                format!("row widths differ: {shapes:?}"),
            ));
        }
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        let ints: Option<Vec<&IntWeight>> = parts.iter().map(|p| p.as_int()).collect();
        if let Some(ints) = ints.filter(|i| {
            i.iter()
                .all(|w| (w.format, w.group) == (i[0].format, i[0].group))
        }) {
            let (format, group) = (ints[0].format, ints[0].group);
            let words = self.concat(ints.iter().map(|w| &w.words))?;
            let sz = self.concat(ints.iter().map(|w| &w.sz))?;
            let fit = ints.iter().all(|w| w.scales_fit_f16);
            // Block scales stack where every part has them and ends on a block's last row
            // (each part's blocks start at its first row).
            let blocks: Option<Vec<&CudaSlice<f32>>> = ints
                .iter()
                .zip(parts)
                .map(|(w, p)| {
                    w.block_scales
                        .as_ref()
                        .filter(|_| p.shape[0] % W8A8_BLOCK == 0)
                })
                .collect();
            let block_scales = blocks.map(|b| self.concat(b.into_iter())).transpose()?;
            return self.int_weight(
                vec![rows, cols],
                IntWeight {
                    format,
                    group,
                    words,
                    sz,
                    scales_fit_f16: fit,
                    block_scales,
                },
            );
        }
        let dense: Vec<CudaSlice<half::f16>> = parts
            .iter()
            .map(|p| self.owned_f16(p))
            .collect::<Result<_>>()?;
        Ok(CudaWeight::f16(
            vec![rows, cols],
            self.concat(dense.iter())?,
        ))
    }

    /// The slices one after another in a new buffer.
    fn concat<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + 'a>(
        &self,
        parts: impl Iterator<Item = &'a CudaSlice<T>> + Clone,
    ) -> Result<CudaSlice<T>> {
        let n: usize = parts.clone().map(|p| p.len()).sum();
        let mut buf = self
            .inner
            .stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| cuda_err("allocating device memory")(&e))?;
        let mut at = 0;
        for p in parts {
            self.inner
                .stream
                .memcpy_dtod(p, &mut buf.slice_mut(at..at + p.len()))
                .map_err(|e| cuda_err("stack_weights")(&e))?;
            at += p.len();
        }
        Ok(buf)
    }

    /// `w` as an f16 matrix of its own (a copy of an f16 one; an integer one dequantized).
    fn owned_f16(&self, w: &CudaWeight) -> Result<CudaSlice<half::f16>> {
        let n = w.shape.iter().product::<usize>();
        let mut out = self.alloc_f16(n.max(1))?;
        match &w.data {
            WeightData::F16(b) => self
                .inner
                .stream
                .memcpy_dtod(&b.slice(..n), &mut out.slice_mut(..n))
                .map_err(|e| cuda_err("copying a weight")(&e))?,
            WeightData::Int(iw) => self.dequantize_into(iw, &w.shape, 0..w.shape[0], &mut out)?,
        }
        Ok(out)
    }

    /// Rows `rows` of `iw` (`shape` `[m, k]`, row-major) dequantized into the start of `out`.
    fn dequantize_into(
        &self,
        iw: &IntWeight,
        shape: &[usize],
        rows: Range<usize>,
        out: &mut CudaSlice<half::f16>,
    ) -> Result<()> {
        let k = shape[1];
        if rows.end > shape[0] || out.len() < rows.len() * k {
            return Err(Error::shape(
                "dequantizing an integer weight",
                format!(
                    "rows {rows:?} of {shape:?} into {} halves (the dequantization scratch)",
                    out.len()
                ),
            ));
        }
        let name = match iw.format {
            IntFormat::W4 => "dequant_w4_f16",
            IntFormat::W8 => "dequant_w8_f16",
            IntFormat::E4m3 => "dequant_f8_f16",
        };
        // A row is k / (32 / bits) words and k / group (scale, zero) pairs: a run of rows is a
        // run of each.
        let row_words = k * iw.format.bits() as usize / 32;
        let row_sz = 2 * (k / iw.group);
        let words = iw.words.slice(rows.start * row_words..rows.end * row_words);
        let sz = iw.sz.slice(rows.start * row_sz..rows.end * row_sz);
        let (m, k_i) = (rows.len() as i32, k as i32);
        // One thread a 16-byte load of words.
        let n = (rows.len() * k / load_cols(iw.format.bits())) as u64;
        let group = iw.group as i32;
        let mut l = self.inner.stream.launch_builder(self.kernel(name));
        l.arg(&words)
            .arg(&sz)
            .arg(&group)
            .arg(&mut *out)
            .arg(&m)
            .arg(&k_i);
        // SAFETY: matches dequant_{w4,w8,f8}_f16; words and sz are the rows' own, and out holds
        // their m * k halves (checked above).
        self.launched(name, unsafe { l.launch(Self::fill_config(n)) }.map(|_| ()))
    }

    /// Whether [`Self::with_dense_f16`] gives `w` in one piece: an f16 weight, or an integer
    /// one that fits the dequantization scratch whole (what a GEMM with a cuBLASLt epilogue
    /// over the whole output needs).
    pub(super) fn dense_whole(&self, w: &CudaWeight) -> bool {
        match &w.data {
            WeightData::F16(_) => true,
            WeightData::Int(_) => chunk_rows(w.shape[0], w.shape[1]) >= w.shape[0],
        }
    }

    /// `gemm(rows, matrix)` over `w` as f16, `matrix` being rows `rows` of it (`[rows.len(),
    /// k]`, row-major): an f16 weight's own buffer in one call, an integer weight dequantized
    /// into the scratch [`dequant_chunk_rows`] rows a call (or [`with_dequant_chunk_rows`]'s).
    /// The scratch stays locked until every chunk is queued; launches on the one stream run in
    /// order, so a chunk's dequantization cannot overwrite it before the previous chunk's GEMM
    /// has read it.
    pub(super) fn with_dense_f16(
        &self,
        w: &CudaWeight,
        mut gemm: impl FnMut(Range<usize>, &CudaView<'_, half::f16>) -> Result<()>,
    ) -> Result<()> {
        let (m, k) = (w.shape[0], w.shape[1]);
        let iw = match &w.data {
            WeightData::F16(b) => return gemm(0..m, &b.slice(..m * k)),
            WeightData::Int(iw) => iw,
        };
        let mut scratch = self.inner.dequant_scratch.lock().expect("not poisoned");
        // A weight that took no scratch at upload (chunked_int_gemm) never comes here; checked
        // all the same (and dequantize_into checks that a chunk fits).
        let Some(buf) = scratch.as_mut() else {
            return Err(Error::shape(
                "dequantizing an integer weight",
                format!("{:?}: no dequantization scratch was sized for it", w.shape),
            ));
        };
        let chunk = chunk_rows(m, k);
        for start in (0..m).step_by(chunk) {
            let rows = start..(start + chunk).min(m);
            self.dequantize_into(iw, &w.shape, rows.clone(), buf)?;
            gemm(rows.clone(), &buf.slice(..rows.len() * k))?;
        }
        Ok(())
    }

    /// The integer GEMV `kind` of x's rows (1..=GEMV_MAX_ROWS) against `iw` into `out`, `m`
    /// output columns; arguments as launch_gemv's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_int_gemv(
        &self,
        kind: Gemv,
        x: &CudaTensor,
        norm: Option<(&CudaTensor, f32)>,
        iw: &IntWeight,
        bias: Option<&CudaTensor>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
        m: usize,
    ) -> Result<()> {
        let swiglu = matches!(kind, Gemv::Swiglu | Gemv::NormedSwiglu);
        let batch = 4 * load_cols(iw.format.bits());
        let mma_staged = x.len() * std::mem::size_of::<f32>() + MMA_PART_BYTES;
        let mma = tensor_core_gemv()
            && x.cols() % batch == 0
            && iw.group % batch == 0
            && mma_staged <= self.inner.gemv_smem;
        let (name, staged, units) = if mma {
            // Tiles of 16 weight rows (8 outputs with SWIGLU), a block each.
            let tiles = if swiglu {
                m.div_ceil(8)
            } else {
                m.div_ceil(16)
            };
            (kind.int_mma_kernel(iw.format, x.rows()), mma_staged, tiles)
        } else {
            let pairs = if swiglu { m } else { m.div_ceil(2) };
            let staged = if kind.normed() {
                x.len() * std::mem::size_of::<f32>()
            } else {
                0
            };
            let name = kind.int_kernel(iw.format, x.rows());
            (name, staged, pairs.div_ceil(GEMV_WARPS as usize))
        };
        let block = GEMV_WARPS * 32;
        let resident = self
            .kernel(name)
            .occupancy_max_active_blocks_per_multiprocessor(block, staged, None)
            .unwrap_or(1)
            .max(1) as usize;
        let blocks = units.clamp(1, resident * self.inner.sm_count);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: staged as u32,
        };
        let stream = &self.inner.stream;
        let (has_bias, acc) = (bias.is_some() as i32, accumulate as i32);
        let (mm, kk, group) = (m as i32, x.cols() as i32, iw.group as i32);
        let eps = norm.map_or(0.0f32, |(_, eps)| eps);
        // Pointers the kernel never reads (no bias, no norm) are given x.
        let (xp, _x) = x.buf.device_ptr(stream);
        let (np, _n) = norm.map_or(&*x.buf, |(n, _)| &*n.buf).device_ptr(stream);
        let (bp, _b) = bias.map_or(&*x.buf, |b| &*b.buf).device_ptr(stream);
        let (wp, _w) = iw.words.device_ptr(stream);
        let (sp, _s) = iw.sz.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut args = vec![arg(&xp), arg(&np), arg(&eps), arg(&wp)];
        match kind {
            Gemv::Plain | Gemv::Normed => {
                args.extend([arg(&bp), arg(&has_bias), arg(&op), arg(&acc)])
            }
            Gemv::Swiglu | Gemv::NormedSwiglu => args.push(arg(&op)),
        }
        args.extend([arg(&mm), arg(&kk), arg(&sp), arg(&group)]);
        // SAFETY: the arguments are INT_GEMV_KERNEL's or INT_SWIGLU_KERNEL's (the INT_MMA_
        // kernels' are the same), in order; shapes are checked by the callers (k a whole number
        // of loads and groups: upload); a normed kernel's staged rows fit its shared memory
        // (normed_gemv_fits), a tensor-core one's are checked above (k and group whole batches).
        // Under programmatic launch the kernel reads only weights before its grid_wait.
        let launched =
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
        self.launched(name, launched)
    }

    /// Whether the tensor-core integer GEMM takes `n` rows of x against `iw` with `k` columns
    /// (else the dequantization and cuBLAS): 1..=64 rows, k whole stages, groups that divide
    /// a stage or are whole stages (at most INT_GEMM_SZ_SLOTS a stage), scales that hold in
    /// f16 (FP8's f32 ones are rounded to f16 there: [`IntWeight::scales_fit_f16`]), and the
    /// stages' shared memory.
    pub(super) fn int_gemm_takes(&self, iw: &IntWeight, n: usize, k: usize) -> bool {
        let group = iw.group;
        tensor_core_gemm()
            && iw.scales_fit_f16
            && (1..=INT_GEMM_MAX_ROWS).contains(&n)
            && k % INT_GEMM_K == 0
            && group > 0
            && (group % INT_GEMM_K == 0
                || (INT_GEMM_K % group == 0 && INT_GEMM_K / group <= INT_GEMM_SZ_SLOTS))
            && INT_GEMM_BLOCKS
                .into_iter()
                .any(|b| int_gemm_smem(iw.format.bits(), n, b) <= self.inner.gemv_smem)
    }

    /// The grid [`Self::launch_int_gemm`] takes for `n` rows of x against an `m` x `k` weight
    /// of `bits` ([`int_gemm_grid`] on this GPU's SMs; the block rows forced by
    /// [`with_int_gemm_rows`] or `VLM_INT_GEMM_ROWS` where that shape fits), for shapes
    /// [`Self::int_gemm_takes`] takes.
    fn int_gemm_launch_grid(&self, bits: u32, n: usize, m: usize, k: usize) -> Option<IntGemmGrid> {
        let forced = FORCED_ROWS.get().or_else(int_gemm_forced_rows);
        let grid = |only: Option<usize>| {
            int_gemm_grid(
                m,
                k / INT_GEMM_K,
                self.inner.sm_count,
                int_gemm_max_splits(),
                |b| {
                    only.is_none_or(|rows| rows == b.rows())
                        && int_gemm_smem(bits, n, b) <= self.inner.gemv_smem
                },
            )
        };
        grid(forced).or_else(|| grid(None))
    }

    /// Whether the integer GEMM runs on Hopper's wgmma here for `rows` rows of x
    /// (int_wgmma_gemm: an H100/H200 unless `VLM_INT_GEMM=mma`, 17..=64 rows a pass), else on
    /// mma.sync.
    pub fn int_gemm_on_wgmma(&self, rows: usize) -> bool {
        let tiles = int_gemm_tiles(rows.min(INT_GEMM_MAX_ROWS));
        self.inner.int_gemm_wgmma && tiles >= INT_GEMM_WGMMA_MIN_TILES
    }

    /// How the tensor-core integer GEMM launches for `n` rows of x against `w`, or `None`
    /// where it does not take them (an f16 weight, or a shape or row count it does not take:
    /// those go to the dequantization and cuBLAS). For examples and timing notes.
    pub fn int_gemm_grid_of(&self, w: &CudaWeight, n: usize) -> Option<IntGemmGrid> {
        let (m, k) = (w.shape[0], w.shape[1]);
        let iw = w.as_int().filter(|iw| self.int_gemm_takes(iw, n, k))?;
        self.int_gemm_launch_grid(iw.format.bits(), n, m, k)
    }

    /// `out (+)= alpha * x16 · iwᵀ (+ bias)` by the tensor-core integer GEMM, for x16's rows
    /// `rows` (already f16) into the same rows of `out`, `m` output columns, k = x16's
    /// columns: for shapes [`Self::int_gemm_takes`] takes. Past INT_GEMM_MAX_ROWS rows it runs
    /// that many at a time (how many passes a weight may take: `int_gemm_weight`). k may be
    /// split over several blocks of the same rows (their partial sums added in a fixed order:
    /// the result does not depend on timing).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_int_gemm<O: GemmOut>(
        &self,
        x16: &CudaSlice<half::f16>,
        rows: std::ops::Range<usize>,
        iw: &IntWeight,
        m: usize,
        k: usize,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<O>,
        accumulate: bool,
        alpha: f32,
    ) -> Result<()> {
        if rows.len() > INT_GEMM_MAX_ROWS {
            for r0 in rows.clone().step_by(INT_GEMM_MAX_ROWS) {
                let chunk = r0..rows.end.min(r0 + INT_GEMM_MAX_ROWS);
                self.launch_int_gemm(x16, chunk, iw, m, k, bias, out, accumulate, alpha)?;
            }
            return Ok(());
        }
        let (r0, n) = (rows.start, rows.len());
        if x16.len() < rows.end * k || out.len() < rows.end * m || bias.is_some_and(|b| b.len() < m)
        {
            return Err(Error::shape(
                "integer GEMM",
                format!("rows {rows:?} of {k} -> {m} columns"),
            ));
        }
        let bits = iw.format.bits();
        // The block shape and k splits that fill the SMs best (int_gemm_grid), at most one
        // block an SM where k is split.
        let Some(grid) = self.int_gemm_launch_grid(bits, n, m, k) else {
            return Err(Error::shape(
                "integer GEMM",
                format!("no block shape's shared memory fits {n} rows at {bits} bits"),
            ));
        };
        let IntGemmGrid { block, splits, .. } = grid;
        let wgmma = self.inner.int_gemm_wgmma && !FORCED_MMA.get().unwrap_or(false);
        let name = int_gemm_kernel(iw.format, block, n, O::F16, wgmma);
        let cfg = LaunchConfig {
            grid_dim: (grid.grid() as u32, 1, 1),
            block_dim: ((block.warps() * 32) as u32, 1, 1),
            shared_mem_bytes: int_gemm_smem(bits, n, block) as u32,
        };
        let stream = &self.inner.stream;
        let (nn, group, has_bias, acc) = (
            n as i32,
            iw.group as i32,
            bias.is_some() as i32,
            accumulate as i32,
        );
        let (mm, kk, ss) = (m as i32, k as i32, splits as i32);
        let (x0, _x) = x16.device_ptr(stream);
        let xp = x0 + (r0 * k * std::mem::size_of::<half::f16>()) as u64;
        let (wp, _w) = iw.words.device_ptr(stream);
        let (sp, _s) = iw.sz.device_ptr(stream);
        // No bias: the kernel never reads it; given the scales' address.
        let (bp, _b) = match bias {
            Some(b) => {
                let (p, g) = b.device_ptr(stream);
                (p, Some(g))
            }
            None => (sp, None),
        };
        let (o0, _o) = out.device_ptr_mut(stream);
        let op = o0 + (r0 * m * std::mem::size_of::<O>()) as u64;
        let (lp, _l) = self.inner.int_gemm_locks.device_ptr(stream);
        let (pp, _p) = self.inner.int_gemm_partials.device_ptr(stream);
        let mut args = [
            arg(&xp),
            arg(&nn),
            arg(&wp),
            arg(&sp),
            arg(&group),
            arg(&bp),
            arg(&has_bias),
            arg(&op),
            arg(&acc),
            arg(&alpha),
            arg(&mm),
            arg(&kk),
            arg(&ss),
            arg(&pp),
            arg(&lp),
        ];
        // SAFETY: the arguments are INT_GEMM_KERNEL's, in order, with O the kernel's output
        // type (the name picks f16 or f32) and the block's threads its shape's; x16 holds
        // rows.end * k halves and out rows.end * m of O, so n rows from row r0 of each, bias m
        // floats (checked above), the words and scales m rows of
        // k (upload); k and group are as int_mma_gemm needs (int_gemm_takes), and the shape's
        // shared memory is within what was opted into (int_gemm_grid's `fits`); the locks are
        // at least `blocks` where splits > 1 (int_gemm_grid), all 0 between launches; with
        // splits > 1 the grid is at most sm_count blocks, and the partials hold a tile of the
        // largest shape for each. Before its grid_wait the kernel reads only the weights and
        // their scales, which no kernel writes, so it may start while the kernel before it
        // (x's) still runs.
        let launched =
            unsafe { self.launch_args(name, cfg, &mut args, self.programmatic_launch()) };
        self.launched(name, launched)
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::{int_gemm_kernel, int_gemm_tiles, GEMV_STATIC_SMEM};
    use super::super::tensor::fp8_scale_fits_f16;
    use super::*;
    use crate::quant::fp8::{e4m3_is_nan, E4M3};
    use half::f16;

    /// Chunks fit the scratch, are as few as can, and cover every row once.
    #[test]
    fn dequantization_chunks_fit_the_scratch_and_cover_the_rows() {
        // 8B: q/k/v, o and head-sized ones whole; gate/up in 3, down in 2; 32B's gate/up in 8.
        for (m, k, chunks) in [
            (6144, 4096, 1),
            (4096, 4096, 1),
            (24576, 4096, 3),
            (4096, 12288, 2),
            (51200, 5120, 8),
            (1, 7, 1),
            (8193, 4096, 2),
        ] {
            let rows = dequant_chunk_rows(m, k);
            assert_eq!(m.div_ceil(rows), chunks, "[{m}, {k}]");
            assert!(rows * k <= DEQUANT_SCRATCH_HALVES, "[{m}, {k}]: {rows}");
            assert!((m * k).div_ceil(DEQUANT_SCRATCH_HALVES) >= chunks - 1);
        }
    }

    /// weights_f16.cu's f8_pair for one byte: the e4m3 bits moved into an f16's.
    fn f8_as_f16(b: u8) -> f16 {
        let t = (b as u16) << 8;
        f16::from_bits((t & 0x8000) | ((t >> 1) & 0x3f80))
    }

    /// The f16 weight int_mma_gemm forms for FP8 byte `b` and kernel scale `s` (f32): the scale
    /// rounded to f16, times the byte's f16 (hmul2, one rounding; the product of two f16 values
    /// is exact in f32, so f32 then f16 is that one rounding), and dequant_f8_f16's: the product
    /// in f32, then f16.
    fn gemm_and_dequant(b: u8, s: f32) -> (f16, f16) {
        let v = f8_as_f16(b).to_f32();
        let gemm = f16::from_f32(v * f16::from_f32(s).to_f32());
        (gemm, f16::from_f32(v * s))
    }

    /// f16 steps between two values of one sign (their bit patterns are ordered alike).
    fn steps(a: f16, b: f16) -> u16 {
        (a.to_bits() & 0x7fff).abs_diff(b.to_bits() & 0x7fff)
    }

    /// The kernel comment's claim (weights_f16.cu, int_mma_gemm, "FP8's weights"): for every
    /// byte and every kernel scale int_gemm_takes lets through, the GEMM's f16 weight is
    /// dequant_f8_f16's or one step from it; f8_pair is the byte's value times 2^-8 exactly.
    #[test]
    fn gemm_fp8_weights_within_one_step_of_dequant() {
        for b in 0..=255u8 {
            if !e4m3_is_nan(b) {
                assert_eq!(
                    f8_as_f16(b).to_f32(),
                    E4M3[b as usize] / 256.0,
                    "byte {b:#04x}"
                );
            }
        }
        // Scales across the whole range taken (f32 bit patterns stepped through it, so every
        // binade and many mantissas), its ends, and checkpoint-like ones (amax / 448 times 2^8).
        let (lo, hi) = (1.0f32 / 16384.0, f32::from(f16::MAX));
        let mut scales: Vec<f32> = (lo.to_bits()..=hi.to_bits())
            .step_by(997)
            .map(f32::from_bits)
            .collect();
        scales.extend([lo, hi, 0.0]);
        scales.extend((1..2000).map(|i| i as f32 * 1e-3 / 448.0 * 256.0));
        let (mut same, mut total) = (0usize, 0usize);
        for &s in &scales {
            assert!(fp8_scale_fits_f16(s), "{s:e}");
            for b in 0..=255u8 {
                if e4m3_is_nan(b) {
                    continue;
                }
                let (gemm, dequant) = gemm_and_dequant(b, s);
                assert!(
                    steps(gemm, dequant) <= 1,
                    "byte {b:#04x}, scale {s:e}: {gemm} vs {dequant}"
                );
                same += (gemm == dequant) as usize;
                total += 1;
            }
        }
        // Most agree exactly (a scale's rounding moves few products across a rounding edge).
        eprintln!("{same} of {total} FP8 weights as dequant_f8_f16's, the rest one step away");
        assert!(same * 4 > total * 3, "{same} of {total} agree");
        // Outside the range the f16 scale loses bits (subnormal) or is infinite: such weights
        // are kept off the GEMM, and there the two would differ by more than a step.
        for s in [1e-6f32, 1e5] {
            assert!(!fp8_scale_fits_f16(s), "{s:e}");
            assert!(
                (0..=255u8)
                    .filter(|&b| !e4m3_is_nan(b))
                    .any(|b| { gemm_and_dequant(b, s).0 != gemm_and_dequant(b, s).1 }),
                "{s:e}"
            );
        }
        assert!(!fp8_scale_fits_f16(f32::NAN));
    }

    /// Shared memory a block may opt into on an H100 (227 KB) and on Orin (163 KB), less the
    /// GEMVs' static part, as context.rs gives the integer GEMM (`gemv_smem`).
    const H100_SMEM: usize = (227 << 10) - GEMV_STATIC_SMEM;
    const ORIN_SMEM: usize = (163 << 10) - GEMV_STATIC_SMEM;

    /// The grid of an `m` x `k` weight at `bits` for `n` rows of x on `sms` SMs with `smem`
    /// bytes of shared memory a block, as launch_int_gemm picks it (no split cap), with block
    /// rows `only` where given.
    fn grid(
        m: usize,
        k: usize,
        n: usize,
        bits: u32,
        sms: usize,
        smem: usize,
        only: Option<usize>,
    ) -> Option<IntGemmGrid> {
        int_gemm_grid(m, k / INT_GEMM_K, sms, usize::MAX, |b| {
            only.is_none_or(|r| r == b.rows()) && int_gemm_smem(bits, n, b) <= smem
        })
    }

    /// Qwen3-VL-8B's text projections (hidden 4096, intermediate 12288): q/k/v, o, gate/up
    /// stacked, down, as (m, k).
    const SHAPES_8B: [(usize, usize); 4] =
        [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)];

    /// Every grid covers the weight's rows with a block shape whose kernel exists and whose
    /// shared memory fits, and splits k only where every split is resident (the grid at most
    /// the SMs), each split has its stages, and the m-blocks have locks: at the 8B shapes for
    /// 8 to 64 rows and at the twin tests' small ones, on an H100, an A100 and Orin.
    #[test]
    fn integer_gemm_grids_cover_the_rows_and_split_only_within_the_sms() {
        let small = [
            (301, 512),
            (256, 1024),
            (777, 2048),
            (1000, 1024),
            (300, 2048),
            (200, 512),
            (768, 512),
            (512, 384),
            (512, 2048),
            (2048, 256),
            (512, 4096),
            (777, 4096),
            (3072, 4096),
            (4096, 1536),
            (24576, 4096),
            (1, 128),
        ];
        for (sms, smem) in [(132, H100_SMEM), (108, H100_SMEM), (16, ORIN_SMEM)] {
            for &(m, k) in SHAPES_8B.iter().chain(&small) {
                for n in [5, 8, 16, 17, 32, 33, 64] {
                    for bits in [4, 8] {
                        let g = grid(m, k, n, bits, sms, smem, None)
                            .unwrap_or_else(|| panic!("{m}x{k}, {n} rows at {bits} bits"));
                        let at = format!("{m}x{k}, {n} rows at {bits} bits on {sms} SMs: {g}");
                        assert!(g.blocks * g.block.rows() >= m, "{at}");
                        assert!((g.blocks - 1) * g.block.rows() < m.max(1), "{at}");
                        assert!(int_gemm_smem(bits, n, g.block) <= smem, "{at}");
                        let name =
                            int_gemm_kernel(IntFormat::of_bits(bits), g.block, n, false, false);
                        assert!(name.contains(&format!("_r{}_", g.block.rows())), "{at}");
                        if g.splits > 1 {
                            assert!(g.grid() <= sms, "{at}");
                            assert!(g.blocks <= INT_GEMM_LOCKS, "{at}");
                            assert!(
                                k / INT_GEMM_K / g.splits >= INT_GEMM_MIN_SPLIT_STAGES,
                                "{at}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// On an H100 the 8B shapes fill the SMs (the issue: 96 blocks of 256 rows left 36 of 132
    /// SMs idle at gate/up) with the same grids at every row count and width (which grids,
    /// and the H100's timings that pick them: the next test); Orin (16 SMs) keeps 256-row
    /// blocks for gate/up (6 full waves of them).
    #[test]
    fn integer_gemm_grids_fill_an_h100_at_the_8b_shapes() {
        let r256 = INT_GEMM_BLOCKS[0];
        for n in [5, 8, 16, 17, 32, 33, 64] {
            for bits in [4, 8] {
                let at = |m, k| grid(m, k, n, bits, 132, H100_SMEM, None).unwrap();
                let gate_up = at(24576, 4096);
                assert!(
                    gate_up.grid() * 100 >= 95 * 132 && gate_up.grid() <= 132,
                    "{gate_up}"
                );
                for (m, k) in SHAPES_8B {
                    let at64 = grid(m, k, 64, 4, 132, H100_SMEM, None);
                    assert_eq!(Some(at(m, k)), at64, "{m}x{k}, {n} rows at {bits} bits");
                }
                let orin = grid(24576, 4096, n, bits, 16, ORIN_SMEM, None).unwrap();
                assert_eq!((orin.block, orin.blocks, orin.splits), (r256, 96, 1));
            }
        }
    }

    /// The 8B shapes' grids on an H100 at 8 and 64 rows are the faster of the two each was
    /// timed on at ed7d3a8 (`cuda/examples/int_gemm 8 64`, microseconds: docs/results/
    /// h100-2026-11-28-ed7d3a8-int-gemm.txt, that tree's choice: gate/up and q/k/v on 192-row
    /// blocks, o and down on 128; `...-int-gemm-256-row-blocks.txt`, `VLM_INT_GEMM_ROWS=256`:
    /// q/k/v 24 blocks split 5 ways, o and down 16 split 8 ways, gate/up 96 unsplit), for W4,
    /// W8 and FP8, except FP8's o at both row counts and down at 8 rows (below).
    #[test]
    fn integer_gemm_grids_pick_the_h100s_faster_grid_at_the_8b_shapes() {
        let (r256, r192) = (INT_GEMM_BLOCKS[0], INT_GEMM_BLOCKS[1]);
        // (m, k, the grid: block, blocks, splits)
        let expected = [
            // q/k/v, 192 x 4 against 256 x 5: W4 18.54 / 19.67 us at 8 rows, 31.15 / 36.67 at
            // 64; W8 20.20 / 22.28, 33.03 / 39.45; FP8 21.70 / 26.93, 34.33 / 41.51.
            (6144, 4096, (r192, 32, 4)),
            // o, 256 x 8 against 128 x 4: W4 14.82 / 16.61 at 8 rows, 25.44 / 26.25 at 64; W8
            // 16.27 / 17.43, 26.92 / 27.76. FP8 was timed the other way, 33.74 / 17.67 and
            // 49.43 / 28.82: the model's miss. That run's FP8 256-row times fit no stage
            // count (o, 4 stages a split, takes within 4-9 us of down's 12; W8's o is 14-24 us
            // under its down) and are up to twice the same grids' at e69708a (o 17.01 and
            // 27.10 us, docs/results/h100-2026-11-28-e69708a-int-gemm.txt, the kernel before
            // it took other block shapes), which beat 128 x 4 here; W4's and W8's 256-row
            // times agree with e69708a's within 4%. Timed again on an H200 at ca1a8ed
            // (docs/results/h200-2026-11-28-ca1a8ed-int-gemm-grid-*.txt), 256 x 8 won for FP8
            // too: o 15.94 / 17.28 at 8 rows, 26.36 / 28.09 at 64; down 31.91 / 34.57, 52.06 /
            // 56.19.
            (4096, 4096, (r256, 16, 8)),
            // gate/up, 192 x 1 (128 blocks) against 256 x 1 (96): W4 42.93 / 48.99, 71.84 /
            // 90.03; W8 48.84 / 58.50, 77.88 / 99.49; FP8 51.20 / 75.87, 81.03 / 106.22.
            (24576, 4096, (r192, 128, 1)),
            // down, 256 x 8 against 128 x 4: W4 28.42 / 31.65, 47.01 / 51.58; W8 30.73 /
            // 34.46, 50.53 / 55.91; FP8 at 64 rows 53.97 / 56.08. FP8 at 8 rows was timed the
            // other way, 42.63 / 34.66 (32.58 for 256 x 8 at e69708a): as o.
            (4096, 12288, (r256, 16, 8)),
        ];
        for format in IntFormat::ALL {
            for n in [8, 64] {
                for (m, k, want) in expected {
                    let g = grid(m, k, n, format.bits(), 132, H100_SMEM, None).unwrap();
                    let at = format!("{m}x{k}, {n} rows, {format:?}: {g}");
                    assert_eq!((g.block, g.blocks, g.splits), want, "{at}");
                }
            }
        }
    }

    /// Each block shape's shared memory (its stages, and its second halves' sums where two
    /// warps share a row group's stages) fits Orin's 163 KB a block at every row count and
    /// width; the halves' sums fit the stages' memory (the kernel asserts the same); the
    /// partial sums' tile holds every shape's; and a shape's warps are a multiple of 4 (each
    /// of the SM's 4 sub-partitions gets as many) and at most 12 (the kernels' registers at
    /// 64 rows, up to 168 a thread, allow no more).
    #[test]
    fn every_block_shape_fits_orin_and_the_partial_tile() {
        for block in INT_GEMM_BLOCKS {
            assert!(
                block.rows() * INT_GEMM_MAX_ROWS <= INT_GEMM_PARTIAL_TILE,
                "{block:?}"
            );
            assert!(block.warps() <= 12 && block.warps() % 4 == 0, "{block:?}");
            for bits in [4, 8] {
                for n in 1..=INT_GEMM_MAX_ROWS {
                    let smem = int_gemm_smem(bits, n, block);
                    assert!(smem <= ORIN_SMEM, "{block:?} {n}");
                    let tiles = int_gemm_tiles(n);
                    let halves = (block.k_parts - 1) * block.row_groups * tiles * 1024;
                    assert!(halves < smem, "{block:?} {n}");
                }
            }
        }
    }

    /// The startup self-check's integer GEMM cases split k and leave it whole on every block
    /// shape they force, and split it where the GPU picks the shape, on an H100 and on Orin:
    /// so every kernel shape and both ends of the kernel (the ordered adds of partial sums and
    /// the direct stores) are checked at every start.
    #[test]
    fn self_check_splits_k_on_every_block_shape() {
        use crate::twin::{Case, IntOp};
        for (sms, smem) in [(132, H100_SMEM), (16, ORIN_SMEM)] {
            // (forced rows, split) seen, and whether an unforced case split.
            let mut seen = std::collections::BTreeSet::new();
            for case in crate::twin::self_check_cases() {
                let Case::IntGemm {
                    n,
                    k,
                    m,
                    op,
                    block_rows,
                    ..
                } = case
                else {
                    continue;
                };
                let gemms = match op {
                    IntOp::Linear | IntOp::AddLinear => vec![(m, k)],
                    IntOp::Mlp => vec![(2 * m, k), (k, m)],
                };
                for (m, k) in gemms.into_iter().filter(|&(_, k)| k % INT_GEMM_K == 0) {
                    for bits in [4, 8] {
                        let g = grid(m, k, n, bits, sms, smem, block_rows).unwrap();
                        assert_eq!(block_rows.unwrap_or(g.block.rows()), g.block.rows());
                        seen.insert((block_rows, g.splits > 1));
                    }
                }
            }
            for rows in INT_GEMM_BLOCKS.map(|b| Some(b.rows())) {
                assert!(seen.contains(&(rows, true)), "{rows:?} split, {sms} SMs");
                assert!(seen.contains(&(rows, false)), "{rows:?} unsplit, {sms} SMs");
            }
            assert!(
                seen.contains(&(None, true)),
                "a split of the GPU's choice, {sms} SMs"
            );
        }
    }
}
