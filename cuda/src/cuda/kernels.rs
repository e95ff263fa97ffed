//! The kernels: which `.cu` file defines which kernel, the names and launch constants the
//! Rust side shares with them (`#define`d into every source), and the text NVRTC compiles.

use super::compile::compile_ptx;
use super::tensor::IntFormat;
use crate::sampling::{LOGPROB_COLS, MAX_TOP_LOGPROBS, SAMPLE_BINS, SAMPLE_LIST, SAMPLE_WORDS};
use crate::{Error, Result};

/// `common.cuh`, put in front of every kernel file (each file is its own NVRTC program).
const COMMON: &str = include_str!("../../kernels/common.cuh");

/// A kernel file's name and its text as embedded at build time.
macro_rules! kernel_file {
    ($file:literal) => {
        ($file, include_str!(concat!("../../kernels/", $file)))
    };
}

/// A `.cu` file and the kernels it defines.
pub(super) struct KernelSource {
    pub(super) file: &'static str,
    /// Files compiled in front of it, after `common.cuh` (their helpers it uses): name, text.
    prelude: &'static [(&'static str, &'static str)],
    /// The file's text.
    source: &'static str,
    /// Which GPUs compile it, and how.
    pub(super) arch: Arch,
    pub(super) kernels: &'static [&'static str],
    /// Tables of kernel names the host indexes, loaded whole (a table that grows cannot
    /// outgrow the load list).
    pub(super) tables: &'static [&'static [&'static str]],
    /// Tables of the kernels it defines only when compiled for sm_90a (under
    /// `__CUDA_ARCH_FEAT_SM90_ALL`), loaded on an H100/H200 only.
    pub(super) hopper_tables: &'static [&'static [&'static str]],
    /// Kernels compiled once per row count, 1..=GEMV_MAX_ROWS.
    pub(super) per_rows: &'static [[&'static str; GEMV_MAX_ROWS]],
}

/// Which GPUs compile a kernel file, and for what. sm_90a is Hopper's own architecture
/// (instructions such as wgmma that later GPUs need not have): code for it runs on sm_90 only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arch {
    /// Every GPU, for its own compute capability.
    Every,
    /// Every GPU; an H100/H200 compiles it for sm_90a, which adds its Hopper-only kernels.
    EveryHopperToo,
    /// Only sm_90 (H100, H200), for sm_90a: every kernel in it is Hopper's own. Where NVRTC or
    /// the driver cannot compile it, the GPU keeps the kernels every GPU has.
    HopperOnly,
}

impl KernelSource {
    /// Every kernel the source's module is to hold: the list, the tables, the per-row ones,
    /// and the Hopper tables where it is compiled for sm_90a (`hopper`).
    pub(super) fn all_kernels(&self, hopper: bool) -> impl Iterator<Item = &'static str> {
        let hopper = if hopper { self.hopper_tables } else { &[] };
        let tables = self.tables.iter().chain(hopper).flat_map(|t| t.iter());
        let per_rows = self.per_rows.iter().flatten();
        self.kernels.iter().chain(tables).chain(per_rows).copied()
    }

    /// Whether it is compiled for sm_90a (rather than for `cc` as is) on a GPU of `cc`.
    pub(super) fn arch_specific(&self, cc: (i32, i32)) -> bool {
        self.arch != Arch::Every && cc == (9, 0)
    }
}

pub(super) const SOURCES: [KernelSource; 6] = [
    KernelSource {
        file: "ops_f32.cu",
        prelude: &[],
        source: kernel_file!("ops_f32.cu").1,
        kernels: &OPS_KERNELS,
        tables: &[],
        per_rows: &[],
        arch: Arch::Every,
        hopper_tables: &[],
    },
    KernelSource {
        file: "weights_f16.cu",
        prelude: &[kernel_file!("wgmma.cuh")],
        source: kernel_file!("weights_f16.cu").1,
        kernels: &[
            "cast_f32_to_f16",
            "cast_f16_to_f32",
            "embedding_f16w",
            "fill_uniform_f16",
            "dequant_w4_f16",
            "dequant_w8_f16",
            "dequant_f8_f16",
            "fill_random_int",
        ],
        tables: &[&INT_GEMM_KERNELS],
        per_rows: &GEMV_KERNELS,
        arch: Arch::EveryHopperToo,
        hopper_tables: &[&INT_GEMM_WGMMA_KERNELS],
    },
    KernelSource {
        file: "paged_f16.cu",
        prelude: &[],
        source: kernel_file!("paged_f16.cu").1,
        kernels: &[
            "write_kv_f16",
            "write_kv_f8",
            "paged_attention_rows_f16",
            "paged_attention_rows_f8",
            "qkv_to_cache_f32",
            "qkv_to_cache_f8",
            "gather_rows_f32",
        ],
        tables: &[
            &DECODE_KERNELS,
            &DECODE_F8_KERNELS,
            &DECODE_MMA_KERNELS,
            &DECODE_MMA_F8_KERNELS,
        ],
        per_rows: &[],
        arch: Arch::Every,
        hopper_tables: &[],
    },
    KernelSource {
        file: "sampling_f32.cu",
        prelude: &[],
        source: kernel_file!("sampling_f32.cu").1,
        kernels: &[
            "sample_prepare_f32",
            "sample_histogram_f32",
            "sample_compact_f32",
            "sample_rows_f32",
        ],
        tables: &[],
        per_rows: &[],
        arch: Arch::Every,
        hopper_tables: &[],
    },
    KernelSource {
        file: "attention_f16.cu",
        prelude: &[],
        source: kernel_file!("attention_f16.cu").1,
        kernels: &["pack_kv_f16", ROPE_PACK_F32[0], ROPE_PACK_F16[0]],
        tables: &[
            &FLASH_KERNELS,
            &PAGED_FLASH_KERNELS,
            &PAGED_FLASH_F8_KERNELS,
            &FLASH_WIDE_KERNELS,
        ],
        per_rows: &[],
        arch: Arch::Every,
        hopper_tables: &[],
    },
    KernelSource {
        file: "attention_sm90.cu",
        prelude: &[kernel_file!("wgmma.cuh"), kernel_file!("attention_f16.cu")],
        source: kernel_file!("attention_sm90.cu").1,
        kernels: &[
            ROPE_PACK_F32[1],
            ROPE_PACK_F16[1],
            ROPE_PACK16_TILED_ROWS,
            PAGED_FLASH_WGMMA_KERNEL,
        ],
        tables: &[&FLASH_WGMMA_KERNELS],
        per_rows: &[],
        arch: Arch::HopperOnly,
        hopper_tables: &[],
    },
];

impl KernelSource {
    /// Whether a GPU of compute capability `cc` gets this file.
    pub(super) fn for_cc(&self, cc: (i32, i32)) -> bool {
        self.arch != Arch::HopperOnly || cc == (9, 0)
    }
}

/// Flash attention instantiations: head dims padded up to one of these.
pub(super) const FLASH_DIMS: [usize; 4] = [64, 80, 96, 128];
pub(super) const FLASH_KERNELS: [&str; 4] = [
    "flash_attention_d64",
    "flash_attention_d80",
    "flash_attention_d96",
    "flash_attention_d128",
];
/// The same for the chunks of prefills in an engine step, reading the paged f16 cache.
pub(super) const PAGED_FLASH_KERNELS: [&str; 4] = [
    "paged_flash_attention_d64",
    "paged_flash_attention_d80",
    "paged_flash_attention_d96",
    "paged_flash_attention_d128",
];
/// The same over an FP8 cache (`--kv-cache-dtype fp8`).
pub(super) const PAGED_FLASH_F8_KERNELS: [&str; 4] = [
    "paged_flash_attention_f8_d64",
    "paged_flash_attention_f8_d80",
    "paged_flash_attention_f8_d96",
    "paged_flash_attention_f8_d128",
];
/// Below this many queries (decode-like), the one-warp-per-query kernel wastes less.
pub(super) const FLASH_MIN_QUERIES: usize = 16;
/// Warps per decode block (PD_WARPS), keys whose loads a decode warp keeps in flight (PD_KEYS)
/// and fewest keys per split (PD_MIN_CHUNK).
pub(super) const DECODE_WARPS: u32 = 4;
const DECODE_KEYS: usize = 4;
pub(super) const DECODE_MIN_CHUNK: usize = 32;
/// Warps of a qkv_to_cache block, one head each (QK_WARPS).
pub(super) const QKV_WARPS: u32 = 4;
/// At most this many splits of one sequence's keys (PD_MAX_SPLITS; the merge takes up to two
/// a lane).
pub(super) const DECODE_MAX_SPLITS: usize = 64;
/// Counters of finished decode splits (Inner::counters).
pub(super) const COUNTERS: usize = 1 << 16;
/// The (head dim, heads per KV head) paged_f16.cu instantiates its split-K decode kernel for:
/// head dims 32, 64, 128 and 256 with 1, 2, 4 and 8 heads, bar 256 with 8.
const DECODE_SHAPES: [(usize, usize); 15] = [
    (32, 1),
    (32, 2),
    (32, 4),
    (32, 8),
    (64, 1),
    (64, 2),
    (64, 4),
    (64, 8),
    (128, 1),
    (128, 2),
    (128, 4),
    (128, 8),
    (256, 1),
    (256, 2),
    (256, 4),
];
/// `paged_decode_d{d}_g{gp}` for each of [`DECODE_SHAPES`], over an f16 cache.
pub(super) const DECODE_KERNELS: [&str; 15] = [
    "paged_decode_d32_g1",
    "paged_decode_d32_g2",
    "paged_decode_d32_g4",
    "paged_decode_d32_g8",
    "paged_decode_d64_g1",
    "paged_decode_d64_g2",
    "paged_decode_d64_g4",
    "paged_decode_d64_g8",
    "paged_decode_d128_g1",
    "paged_decode_d128_g2",
    "paged_decode_d128_g4",
    "paged_decode_d128_g8",
    "paged_decode_d256_g1",
    "paged_decode_d256_g2",
    "paged_decode_d256_g4",
];
/// `paged_decode_f8_d{d}_g{gp}`: the same over an FP8 cache.
pub(super) const DECODE_F8_KERNELS: [&str; 15] = [
    "paged_decode_f8_d32_g1",
    "paged_decode_f8_d32_g2",
    "paged_decode_f8_d32_g4",
    "paged_decode_f8_d32_g8",
    "paged_decode_f8_d64_g1",
    "paged_decode_f8_d64_g2",
    "paged_decode_f8_d64_g4",
    "paged_decode_f8_d64_g8",
    "paged_decode_f8_d128_g1",
    "paged_decode_f8_d128_g2",
    "paged_decode_f8_d128_g4",
    "paged_decode_f8_d128_g8",
    "paged_decode_f8_d256_g1",
    "paged_decode_f8_d256_g2",
    "paged_decode_f8_d256_g4",
];
/// The (head dim, heads per KV head) paged_f16.cu instantiates its tensor-core decode kernel
/// (`paged_decode_mma`) for: the head dims of Qwen3-VL and Qwen2.5 (128) and smaller ones
/// (the test fixtures' 32), with 2 to 8 heads a KV head (mma's 8 columns). One head a KV head
/// would leave 7 of the 8 idle: the per-lane kernel takes it, and head dim 256.
const DECODE_MMA_SHAPES: [(usize, usize); 9] = [
    (32, 2),
    (32, 4),
    (32, 8),
    (64, 2),
    (64, 4),
    (64, 8),
    (128, 2),
    (128, 4),
    (128, 8),
];
/// `paged_decode_mma_d{d}_g{gp}` for each of [`DECODE_MMA_SHAPES`], over an f16 cache.
pub(super) const DECODE_MMA_KERNELS: [&str; 9] = [
    "paged_decode_mma_d32_g2",
    "paged_decode_mma_d32_g4",
    "paged_decode_mma_d32_g8",
    "paged_decode_mma_d64_g2",
    "paged_decode_mma_d64_g4",
    "paged_decode_mma_d64_g8",
    "paged_decode_mma_d128_g2",
    "paged_decode_mma_d128_g4",
    "paged_decode_mma_d128_g8",
];
/// `paged_decode_mma_f8_d{d}_g{gp}`: the same over an FP8 cache.
pub(super) const DECODE_MMA_F8_KERNELS: [&str; 9] = [
    "paged_decode_mma_f8_d32_g2",
    "paged_decode_mma_f8_d32_g4",
    "paged_decode_mma_f8_d32_g8",
    "paged_decode_mma_f8_d64_g2",
    "paged_decode_mma_f8_d64_g4",
    "paged_decode_mma_f8_d64_g8",
    "paged_decode_mma_f8_d128_g2",
    "paged_decode_mma_f8_d128_g4",
    "paged_decode_mma_f8_d128_g8",
];

/// What a decode block costs besides its keys, as a share of one sequence's keys: its start
/// (the sequence's row, the block table, then the first keys: round trips to memory before any
/// math) and its end (the merge of its warps, and of the splits). A share, not a count of keys,
/// because a recorded step's splits are chosen once for any length it replays (its `max_keys`
/// is the longest context) while each block's keys are its sequence's divided by the splits.
/// An eighth, about 64 keys at 512: at 512 keys, 128 sequences and 3 blocks an SM, 1% chose 5
/// splits (3 waves' blocks in 13 waves of a fifth of the keys) where the kernel had run one
/// split 13% faster at 2 blocks an SM (f16 cache, H200, 2026-11-28).
const DECODE_BLOCK_SHARE: f64 = 0.125;

/// How many splits decode attention cuts each (sequence, KV head)'s keys into, for `pairs` of
/// them, `slots` blocks the GPU runs at once (SMs times the kernel's blocks an SM) and at most
/// `max_keys` keys: no split shorter than DECODE_MIN_CHUNK keys, at most DECODE_MAX_SPLITS,
/// and otherwise the count that finishes soonest: ceil(pairs splits / slots) waves of blocks,
/// each taking 1 / splits of the keys plus DECODE_BLOCK_SHARE. At batch 1 that spreads a long
/// context over the whole GPU (attention at 4096 keys is latency, not bandwidth: short splits,
/// few round trips each); at 64 sequences of 8 KV heads, 512 blocks in 396 slots would take
/// two waves for 1.3 waves of work (3 blocks an SM: 3 splits, 4 waves of a third of the keys);
/// at 128 sequences, one split.
pub(super) fn decode_splits(pairs: usize, slots: usize, max_keys: usize) -> usize {
    let most = max_keys
        .div_ceil(DECODE_MIN_CHUNK)
        .clamp(1, DECODE_MAX_SPLITS);
    let cost = |splits: usize| {
        let waves = (pairs * splits).div_ceil(slots.max(1));
        waves as f64 * (1.0 / splits as f64 + DECODE_BLOCK_SHARE)
    };
    (1..=most)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
}

/// A count the variable `var` sets to time a rule's choices against the ones it did not make
/// (read at each call: callers keep it in a `OnceLock`), at least 1; `None` where unset or
/// not a number.
pub(super) fn count_from_env(var: &str) -> Option<usize> {
    let n: usize = std::env::var(var).ok()?.parse().ok()?;
    Some(n.max(1))
}

/// The most splits decode attention takes: `VLM_DECODE_SPLITS=n` (at least 1), to time the
/// split counts [`decode_splits`] did not choose; unset, no cap.
pub(super) fn decode_max_splits() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| count_from_env("VLM_DECODE_SPLITS").unwrap_or(usize::MAX))
}

/// Prefill chunks' attention over the paged f16 cache on Hopper's wgmma, head dim
/// [`PAGED_FLASH_WGMMA_D`] (attention_sm90.cu): [`PAGED_FLASH_WGMMA_QUERIES`] queries of one
/// head a block of [`PAGED_FLASH_WGMMA_THREADS`] threads, the same arguments as
/// paged_flash_attention_d128. Taken only where [`PrefillAttention::current`] says so.
pub(super) const PAGED_FLASH_WGMMA_KERNEL: &str = "paged_flash_attention_wgmma_d128";
pub(super) const PAGED_FLASH_WGMMA_D: usize = 128;
/// Its block's warpgroups (PW_WG), 64 queries each; keys a tile (PW_BK); K/V tile buffers
/// (PW_STAGES). The kernel reads them from [`shared_defines`].
const PAGED_FLASH_WGMMA_WARPGROUPS: usize = 3;
const PAGED_FLASH_WGMMA_KEYS: usize = 64;
const PAGED_FLASH_WGMMA_STAGES: usize = 4;
pub(super) const PAGED_FLASH_WGMMA_QUERIES: usize = 64 * PAGED_FLASH_WGMMA_WARPGROUPS;
pub(super) const PAGED_FLASH_WGMMA_THREADS: u32 = 128 * PAGED_FLASH_WGMMA_WARPGROUPS as u32;

/// Dynamic shared memory of [`PAGED_FLASH_WGMMA_KERNEL`]: the block's queries and the stages
/// of a K and a V tile, all 128 dims of f16, and 1024 bytes to align them to the 128-byte
/// swizzle's 1024-byte atoms.
pub(super) fn paged_flash_wgmma_smem_bytes() -> usize {
    (PAGED_FLASH_WGMMA_QUERIES + 2 * PAGED_FLASH_WGMMA_STAGES * PAGED_FLASH_WGMMA_KEYS)
        * PAGED_FLASH_WGMMA_D
        * 2
        + 1024
}

/// Which kernel prefill chunks' attention takes on a GPU with both: `VLM_PREFILL_ATTENTION`
/// at start, [`with_prefill_attention`] for one thread's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttention {
    /// mma.sync (`paged_flash_attention_d*`), on every GPU: what every GPU but an H100/H200
    /// runs (Jetson Orin's sm_87 included), and an H100's FP8 caches and other head dims.
    MmaSync,
    /// wgmma ([`PAGED_FLASH_WGMMA_KERNEL`]) where it is compiled (sm_90) and takes the shape
    /// (head dim 128, an f16 cache); elsewhere mma.sync. The default: on an H200 it took a
    /// layer of the 8B's 4096-token prefill in 699 us against mma.sync's 743, before its
    /// swizzle and third warpgroup made that prefill 12% faster again (docs/benchmarks.md).
    Wgmma,
}

thread_local! {
    /// The kernel [`with_prefill_attention`] forces on this thread's launches.
    static FORCED_PREFILL: std::cell::Cell<Option<PrefillAttention>> = const { std::cell::Cell::new(None) };
}

impl PrefillAttention {
    /// This thread's choice: forced, else `VLM_PREFILL_ATTENTION` (`mma`; unset, `wgmma` or
    /// anything else, with a warning, wgmma where it applies).
    pub(super) fn current() -> Self {
        static FROM_ENV: std::sync::OnceLock<PrefillAttention> = std::sync::OnceLock::new();
        let parse = |v: &str| match v {
            "wgmma" => Some(PrefillAttention::Wgmma),
            "mma" => Some(PrefillAttention::MmaSync),
            _ => None,
        };
        super::launch::forced_or_env(
            &FORCED_PREFILL,
            &FROM_ENV,
            "VLM_PREFILL_ATTENTION",
            parse,
            PrefillAttention::Wgmma,
            "mma or wgmma",
        )
    }
}

/// Runs `f` with this thread's prefill attention on `kernel`: how the twin cases check both
/// kernels on one GPU.
pub fn with_prefill_attention<T>(kernel: PrefillAttention, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED_PREFILL, Some(kernel), f)
}

/// Which kernel decode attention takes where both are compiled: `VLM_DECODE_ATTENTION` at
/// start, [`with_decode_attention`] for one thread's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeAttention {
    /// The tensor cores (`paged_decode_mma`) where the shape has one (the default).
    TensorCores,
    /// The per-lane kernel (`paged_decode`) everywhere: to compare, and to test it.
    PerLane,
}

thread_local! {
    /// The kernel [`with_decode_attention`] forces on this thread's launches.
    static FORCED_DECODE: std::cell::Cell<Option<DecodeAttention>> = const { std::cell::Cell::new(None) };
}

impl DecodeAttention {
    /// This thread's choice: forced, else `VLM_DECODE_ATTENTION` (`lanes` for the per-lane
    /// kernel; unset, `mma` or anything else, with a warning, the tensor cores).
    pub(super) fn current() -> Self {
        static FROM_ENV: std::sync::OnceLock<DecodeAttention> = std::sync::OnceLock::new();
        let parse = |v: &str| match v {
            "lanes" => Some(DecodeAttention::PerLane),
            "mma" => Some(DecodeAttention::TensorCores),
            _ => None,
        };
        super::launch::forced_or_env(
            &FORCED_DECODE,
            &FROM_ENV,
            "VLM_DECODE_ATTENTION",
            parse,
            DecodeAttention::TensorCores,
            "mma or lanes",
        )
    }
}

/// Runs `f` with this thread's decode attention on `kernel`: how the twin cases check both
/// kernels on one GPU.
pub fn with_decode_attention<T>(kernel: DecodeAttention, f: impl FnOnce() -> T) -> T {
    super::launch::with_forced(&FORCED_DECODE, Some(kernel), f)
}

/// The paged split-K decode kernel for head dim `d` and `group` query heads per KV head, over
/// an f16 cache or (`fp8`) an FP8 one: the tensor-core one where `kernel` says so and one is
/// compiled for the shape ([`DECODE_MMA_SHAPES`]), else the per-lane one compiled for the
/// power of two at or above the group ([`DECODE_SHAPES`]); `None` where there is neither
/// (then paged_attention_rows_f16 or _f8 takes the decoding sequences too).
pub(super) fn decode_kernel(
    d: usize,
    group: usize,
    fp8: bool,
    kernel: DecodeAttention,
) -> Option<&'static str> {
    let shape = (d, group.next_power_of_two());
    if let (DecodeAttention::TensorCores, Some(at)) =
        (kernel, DECODE_MMA_SHAPES.iter().position(|&s| s == shape))
    {
        return Some(if fp8 {
            DECODE_MMA_F8_KERNELS[at]
        } else {
            DECODE_MMA_KERNELS[at]
        });
    }
    let at = DECODE_SHAPES.iter().position(|&s| s == shape)?;
    Some(if fp8 {
        DECODE_F8_KERNELS[at]
    } else {
        DECODE_KERNELS[at]
    })
}

/// The flash kernels whose warps take two m-tiles of 16 queries, 128 queries a block
/// (`flash_attention_wide_d{dp}`; FaShared in attention_f16.cu), and their head dims: for calls
/// of many query tiles (a large image's ViT pass), where the shared-memory reads they halve
/// bound the kernel. Each call of them is half the blocks at two an SM: fewer, they lose.
pub(super) const FLASH_WIDE_DIMS: [usize; 2] = [64, 80];
pub(super) const FLASH_WIDE_KERNELS: [&str; 2] =
    ["flash_attention_wide_d64", "flash_attention_wide_d80"];
/// Queries a block of a flash kernel takes, and of a wide one.
pub(super) const FLASH_QUERIES: usize = 64;
pub(super) const FLASH_WIDE_QUERIES: usize = 128;
/// A call takes the wide kernel from this many waves of its blocks at two an SM (on the H100,
/// a 1344x1344 image's 896 blocks: 51.4 -> 47.6 ms a pass; at 896x896, 392 blocks, 15.3 ->
/// 16.2, and at 448x448 3.7-3.9 -> 4.1-4.2).
pub(super) const FLASH_WIDE_MIN_WAVES: usize = 3;

/// Flash attention on wgmma (attention_sm90.cu, sm_90 only) for head dims 65..72 packed to 80
/// (the ViT's 72): blocks of 256 queries for four warpgroups, one CTA an SM, over keys and
/// values the RoPE pack wrote in its tiles of FLASH_WGMMA_KEYS keys; the blocks past the full
/// waves share CTAs by their key tiles (flash_wgmma_grid). The host takes it for every image
/// where it was compiled: on the H100 it beats the mma.sync kernels from a
/// 448x448 image's 784 queries a call (0.031 -> 0.028 ms) to 1344x1344's 7,056 (0.98 -> 0.50).
/// Its two builds: writing f32 (`rope_attention_segments`) and f16 (the operand of the GEMM
/// after it in `layer_norm_rope_attention`).
pub(super) const FLASH_WGMMA_KERNELS: [&str; 2] = [
    "flash_attention_wgmma_d80",
    "flash_attention_wgmma_d80_f16out",
];
pub(super) const FLASH_WGMMA_DP: usize = 80;
/// The kernel's V carries a column of ones at dim 72, so head dims stop there.
pub(super) const FLASH_WGMMA_MAX_D: usize = 72;
pub(super) const FLASH_WGMMA_QUERIES: usize = 256;
/// Keys a tile (FW_BK).
pub(super) const FLASH_WGMMA_KEYS: usize = 112;
pub(super) const FLASH_WGMMA_THREADS: u32 = 512;

/// The ViT's RoPE + K/V pack of its fused q/k/v rows, from f32 or f16 rows: into PackedF16Kv's
/// rows (attention_f16.cu, for the mma.sync kernels) and into the wgmma kernel's tiles
/// (attention_sm90.cu).
pub(super) const ROPE_PACK_F32: [&str; 2] = ["rope_qkv_pack_f16", "rope_qkv_pack_tiled_f16"];
pub(super) const ROPE_PACK_F16: [&str; 2] = ["rope_qkv16_pack_f16", "rope_qkv16_pack_tiled_f16"];
/// Shared memory any block may take without opting in (bytes), on every GPU CUDA supports.
pub(super) const DEFAULT_SMEM: usize = 48 << 10;
/// The tiled pack from f16 rows for head dims that are multiples of 8 (the ViT's 72):
/// PACK_ROWS rows a block, staged in shared memory (rope_qkv16_pack_tiled_rows_f16).
pub(super) const ROPE_PACK16_TILED_ROWS: &str = "rope_qkv16_pack_tiled_rows_f16";
/// Rows a block of ROPE_PACK16_TILED_ROWS (PACK_ROWS in the kernel): a tile of
/// FLASH_WGMMA_KEYS rows is whole blocks.
pub(super) const PACK_ROWS: usize = 4;
const _: () = assert!(FLASH_WGMMA_KEYS % PACK_ROWS == 0);
/// Dynamic shared memory of ROPE_PACK16_TILED_ROWS for rows of `width` (3 heads d) halves.
pub(super) fn pack_rows_smem_bytes(width: usize) -> usize {
    PACK_ROWS * (width + 8) * 2
}

/// Dynamic shared memory of flash_attention_wgmma_d80 (FwShared in attention_sm90.cu): the
/// block's 256 queries and three K and V tiles, all rows of 80 halves, six 8-byte mbarriers,
/// then 16 bytes for the merge's flag.
pub(super) fn flash_wgmma_smem_bytes() -> usize {
    const STAGES: usize = 3;
    (FLASH_WGMMA_QUERIES + 2 * STAGES * FLASH_WGMMA_KEYS) * FLASH_WGMMA_DP * 2 + 2 * STAGES * 8 + 16
}

/// f32s of flash_attention_wgmma_d80's partial results for `ctas` CTAs past its whole blocks
/// (FwPartials): two slots a CTA, each every thread's 80 / 2 accumulators and two running
/// maxima (11 float4).
pub(super) fn flash_wgmma_partial_floats(ctas: usize) -> usize {
    2 * ctas * (FLASH_WGMMA_DP / 8 + 1) * 4 * FLASH_WGMMA_THREADS as usize
}

/// The most CTAs past the full waves for each block left (each shares a block with up to this
/// many others, which its last one merges).
const FLASH_WGMMA_MAX_SHARES: usize = 4;
/// What a CTA's sharing costs beyond its key tiles, in tiles, from H100 timings at 448 to
/// 1344: storing its share and the merge, and, for a CTA whose tiles run into a second block,
/// that block's queries and the pipeline's restart.
const FLASH_WGMMA_SHARE_COST: usize = 2;
const FLASH_WGMMA_SECOND_BLOCK_COST: usize = 4;

/// How flash_attention_wgmma_d80 spreads `blocks` blocks of queries, `tiles` key tiles each,
/// over `sms` SMs (FwRest): (whole, ctas), the first `whole` blocks a CTA each (the full waves)
/// and the key tiles of the rest spread evenly over the other `ctas - whole` CTAs, where that
/// ends sooner than a CTA a block. A block a CTA left SMs idle in the last wave: 896x896's 208
/// blocks are two waves on an H100's 132 SMs, the second 58% full. The rest go either k CTAs a
/// block (each a k-th of its tiles) or over every SM (whose tiles then run into a second
/// block), whichever the costs above make shorter. On an H100 a call went 20.4 -> 19.2 us at
/// 448x448 (two CTAs a block), 116 -> 106 at 896x896 and 483 -> 422 at 1344x1344 (every SM).
pub(super) fn flash_wgmma_grid(blocks: usize, tiles: usize, sms: usize) -> (usize, usize) {
    let sms = sms.max(1);
    let whole = blocks / sms * sms;
    let rest = blocks - whole;
    // The kernel counts a CTA's first unit as r rest tiles / CTAs in 32 bits.
    if rest == 0 || sms * rest * tiles > i32::MAX as usize {
        return (blocks, blocks);
    }
    // The last wave's length in tiles with the rest over `ctas` CTAs.
    let wave = |ctas: usize| {
        let second_block = ctas % rest != 0;
        (rest * tiles).div_ceil(ctas)
            + FLASH_WGMMA_SHARE_COST
            + if second_block {
                FLASH_WGMMA_SECOND_BLOCK_COST
            } else {
                0
            }
    };
    let most = sms.min(rest * FLASH_WGMMA_MAX_SHARES);
    let best = (2..=most / rest)
        .map(|k| rest * k)
        .chain(std::iter::once(most))
        .filter(|&ctas| ctas > rest)
        .min_by_key(|&ctas| (wave(ctas), ctas));
    match best {
        Some(ctas) if wave(ctas) < tiles => (whole, whole + ctas),
        _ => (blocks, blocks),
    }
}

/// Dynamic shared memory of a flash kernel taking `queries` a block: a Q tile of them and two
/// K and V tiles (double buffered) of 64 rows, rows of dp + 8 halves (FaShared in
/// attention_f16.cu).
pub(super) fn flash_smem_bytes(dp: usize, queries: usize) -> usize {
    (queries + 4 * 64) * 2 * (dp + 8)
}

const OPS_KERNELS: [&str; 23] = [
    "add_f32",
    "gelu_tanh_f32",
    "gelu_erf_f32",
    "silu_mul_f32",
    "silu_mul_halves_f32",
    "silu_mul_halves_f16",
    "layer_norm_f32",
    "layer_norm_f16",
    "rms_norm_f32",
    "rms_norm_f16",
    "rope_f32",
    "attention_f32",
    "weighted_gather_f32",
    "patchify_rgb_f32",
    "scatter_rows_f32",
    "broadcast_rows_f32",
    "fill_uniform_f32",
    "quant_rows_f8",
    "quant_rows_f32_f8",
    "rms_norm_f8",
    "silu_mul_halves_f8",
    "qdq_rows_f8",
    "rms_norm_qdq_f8",
];
/// Threads per block for row-wise kernels.
pub(super) const ROW_THREADS: u32 = 256;
/// RMSNorm keeps a row of up to this many float4s a thread in registers (`norm_in_registers` in
/// ops_f32.cu; NORM_VEC there): up to 4 x ROW_THREADS x this columns.
pub(super) const NORM_VEC: usize = 8;
/// LayerNorm rows of up to this many float4s a lane (`cols % 4 == 0`, at most 4 x 32 x this
/// columns: the ViT's 1152, and 1024) are normed by one warp each, in registers, ROW_THREADS /
/// 32 rows a block; wider rows by a block each (LN_WARP_VEC, `layer_norm_by_warp` in
/// ops_f32.cu). At 9 the kernels take 64 registers (4 blocks an SM on an H100); at 12, 80.
pub(super) const LAYER_NORM_WARP_VEC: usize = 9;

/// Whether the LayerNorm kernels take rows of `cols` one warp each (else one block each).
pub(super) fn layer_norm_by_warp(cols: usize) -> bool {
    cols % 4 == 0 && cols <= LAYER_NORM_WARP_VEC * 4 * 32
}
/// Largest head dim the attention kernel holds in registers (32 lanes x 8).
pub(super) const MAX_HEAD_DIM: usize = 256;
/// Up to this many rows, `linear` is our bandwidth-bound GEMV (decode); past it, cuBLAS.
pub(super) const GEMV_MAX_ROWS: usize = 4;

/// Warps per GEMV block.
pub(super) const GEMV_WARPS: u32 = 8;
/// Warps that share one output row of a GEMV (weights_f16.cu says why four).
pub(super) const GEMV_SPLIT: u32 = 4;
/// Shared memory the normed GEMVs declare statically (their per-warp sums), at most.
pub(super) const GEMV_STATIC_SMEM: usize = 1 << 10;
/// The streamed GEMVs (weights_f16.cu): 16-byte chunks a lane copies into shared memory
/// before it waits for the kernel before it (8: 4 KB a warp, 32 KB a block).
pub(super) const STREAM_STAGED: usize = 8;

/// The GEMV kernels of weights_f16.cu (its FOR_ROWS), one per count of input rows: the four
/// kinds below, then the same four streamed (run under programmatic dependent launch); in
/// [`GEMV_KERNELS`] after them the integer ones (int_gemv) and the tensor-core integer ones
/// (int_mma_gemv), the four kinds for each [`IntFormat`] in order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Gemv {
    Plain,
    /// The input's RMSNorm first (staged in shared memory).
    Normed,
    Swiglu,
    NormedSwiglu,
}

impl Gemv {
    /// The same product of an input already normed.
    pub(super) fn without_norm(self) -> Self {
        match self {
            Gemv::Normed => Gemv::Plain,
            Gemv::NormedSwiglu => Gemv::Swiglu,
            other => other,
        }
    }
}

pub(super) const GEMV_KERNELS: [[&str; GEMV_MAX_ROWS]; 32] = [
    [
        "gemv_f16w_r1",
        "gemv_f16w_r2",
        "gemv_f16w_r3",
        "gemv_f16w_r4",
    ],
    [
        "rms_norm_gemv_f16w_r1",
        "rms_norm_gemv_f16w_r2",
        "rms_norm_gemv_f16w_r3",
        "rms_norm_gemv_f16w_r4",
    ],
    [
        "swiglu_gemv_f16w_r1",
        "swiglu_gemv_f16w_r2",
        "swiglu_gemv_f16w_r3",
        "swiglu_gemv_f16w_r4",
    ],
    [
        "rms_norm_swiglu_gemv_f16w_r1",
        "rms_norm_swiglu_gemv_f16w_r2",
        "rms_norm_swiglu_gemv_f16w_r3",
        "rms_norm_swiglu_gemv_f16w_r4",
    ],
    [
        "gemv_f16w_streamed_r1",
        "gemv_f16w_streamed_r2",
        "gemv_f16w_streamed_r3",
        "gemv_f16w_streamed_r4",
    ],
    [
        "rms_norm_gemv_f16w_streamed_r1",
        "rms_norm_gemv_f16w_streamed_r2",
        "rms_norm_gemv_f16w_streamed_r3",
        "rms_norm_gemv_f16w_streamed_r4",
    ],
    [
        "swiglu_gemv_f16w_streamed_r1",
        "swiglu_gemv_f16w_streamed_r2",
        "swiglu_gemv_f16w_streamed_r3",
        "swiglu_gemv_f16w_streamed_r4",
    ],
    [
        "rms_norm_swiglu_gemv_f16w_streamed_r1",
        "rms_norm_swiglu_gemv_f16w_streamed_r2",
        "rms_norm_swiglu_gemv_f16w_streamed_r3",
        "rms_norm_swiglu_gemv_f16w_streamed_r4",
    ],
    // The integer GEMVs (int_gemv), 4 bits then 8, in Gemv's order.
    ["gemv_w4_r1", "gemv_w4_r2", "gemv_w4_r3", "gemv_w4_r4"],
    [
        "rms_norm_gemv_w4_r1",
        "rms_norm_gemv_w4_r2",
        "rms_norm_gemv_w4_r3",
        "rms_norm_gemv_w4_r4",
    ],
    [
        "swiglu_gemv_w4_r1",
        "swiglu_gemv_w4_r2",
        "swiglu_gemv_w4_r3",
        "swiglu_gemv_w4_r4",
    ],
    [
        "rms_norm_swiglu_gemv_w4_r1",
        "rms_norm_swiglu_gemv_w4_r2",
        "rms_norm_swiglu_gemv_w4_r3",
        "rms_norm_swiglu_gemv_w4_r4",
    ],
    ["gemv_w8_r1", "gemv_w8_r2", "gemv_w8_r3", "gemv_w8_r4"],
    [
        "rms_norm_gemv_w8_r1",
        "rms_norm_gemv_w8_r2",
        "rms_norm_gemv_w8_r3",
        "rms_norm_gemv_w8_r4",
    ],
    [
        "swiglu_gemv_w8_r1",
        "swiglu_gemv_w8_r2",
        "swiglu_gemv_w8_r3",
        "swiglu_gemv_w8_r4",
    ],
    [
        "rms_norm_swiglu_gemv_w8_r1",
        "rms_norm_swiglu_gemv_w8_r2",
        "rms_norm_swiglu_gemv_w8_r3",
        "rms_norm_swiglu_gemv_w8_r4",
    ],
    // FP8 e4m3 weights through the same kernels (FMT_F8).
    ["gemv_f8_r1", "gemv_f8_r2", "gemv_f8_r3", "gemv_f8_r4"],
    [
        "rms_norm_gemv_f8_r1",
        "rms_norm_gemv_f8_r2",
        "rms_norm_gemv_f8_r3",
        "rms_norm_gemv_f8_r4",
    ],
    [
        "swiglu_gemv_f8_r1",
        "swiglu_gemv_f8_r2",
        "swiglu_gemv_f8_r3",
        "swiglu_gemv_f8_r4",
    ],
    [
        "rms_norm_swiglu_gemv_f8_r1",
        "rms_norm_swiglu_gemv_f8_r2",
        "rms_norm_swiglu_gemv_f8_r3",
        "rms_norm_swiglu_gemv_f8_r4",
    ],
    // The integer GEMVs on the tensor cores (int_mma_gemv), in the same order.
    [
        "mma_gemv_w4_r1",
        "mma_gemv_w4_r2",
        "mma_gemv_w4_r3",
        "mma_gemv_w4_r4",
    ],
    [
        "mma_rms_norm_gemv_w4_r1",
        "mma_rms_norm_gemv_w4_r2",
        "mma_rms_norm_gemv_w4_r3",
        "mma_rms_norm_gemv_w4_r4",
    ],
    [
        "mma_swiglu_gemv_w4_r1",
        "mma_swiglu_gemv_w4_r2",
        "mma_swiglu_gemv_w4_r3",
        "mma_swiglu_gemv_w4_r4",
    ],
    [
        "mma_rms_norm_swiglu_gemv_w4_r1",
        "mma_rms_norm_swiglu_gemv_w4_r2",
        "mma_rms_norm_swiglu_gemv_w4_r3",
        "mma_rms_norm_swiglu_gemv_w4_r4",
    ],
    [
        "mma_gemv_w8_r1",
        "mma_gemv_w8_r2",
        "mma_gemv_w8_r3",
        "mma_gemv_w8_r4",
    ],
    [
        "mma_rms_norm_gemv_w8_r1",
        "mma_rms_norm_gemv_w8_r2",
        "mma_rms_norm_gemv_w8_r3",
        "mma_rms_norm_gemv_w8_r4",
    ],
    [
        "mma_swiglu_gemv_w8_r1",
        "mma_swiglu_gemv_w8_r2",
        "mma_swiglu_gemv_w8_r3",
        "mma_swiglu_gemv_w8_r4",
    ],
    [
        "mma_rms_norm_swiglu_gemv_w8_r1",
        "mma_rms_norm_swiglu_gemv_w8_r2",
        "mma_rms_norm_swiglu_gemv_w8_r3",
        "mma_rms_norm_swiglu_gemv_w8_r4",
    ],
    [
        "mma_gemv_f8_r1",
        "mma_gemv_f8_r2",
        "mma_gemv_f8_r3",
        "mma_gemv_f8_r4",
    ],
    [
        "mma_rms_norm_gemv_f8_r1",
        "mma_rms_norm_gemv_f8_r2",
        "mma_rms_norm_gemv_f8_r3",
        "mma_rms_norm_gemv_f8_r4",
    ],
    [
        "mma_swiglu_gemv_f8_r1",
        "mma_swiglu_gemv_f8_r2",
        "mma_swiglu_gemv_f8_r3",
        "mma_swiglu_gemv_f8_r4",
    ],
    [
        "mma_rms_norm_swiglu_gemv_f8_r1",
        "mma_rms_norm_swiglu_gemv_f8_r2",
        "mma_rms_norm_swiglu_gemv_f8_r3",
        "mma_rms_norm_swiglu_gemv_f8_r4",
    ],
];

/// The tensor-core integer GEMM's tiles (weights_f16.cu's int_mma_gemm, `IG_*` there): columns
/// a k stage, stages in shared memory at once, (scale, zero) slots a weight row a stage (so
/// groups of at least IG_K / 4 columns), and x's rows.
pub(super) const INT_GEMM_K: usize = 128;
pub(super) const INT_GEMM_STAGES: usize = 3;
pub(super) const INT_GEMM_SZ_SLOTS: usize = 4;
pub(super) const INT_GEMM_MAX_ROWS: usize = 64;

/// A block shape of the tensor-core integer GEMM (int_mma_gemm's RG and KS): `row_groups` of
/// 32 weight rows, each taken by `k_parts` warps (1: a warp multiplies whole k stages; 2: each
/// of two multiplies half of every stage's columns, their sums added once k is done).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntGemmBlock {
    pub row_groups: usize,
    pub k_parts: usize,
}

impl IntGemmBlock {
    /// Weight rows a block owns.
    pub const fn rows(self) -> usize {
        32 * self.row_groups
    }

    /// Warps a block.
    pub const fn warps(self) -> usize {
        self.row_groups * self.k_parts
    }
}

/// The block shapes the host picks from for each GEMM (`int_gemm_grid`, int_weights.rs),
/// largest first, and weights_f16.cu instantiates (IG_BLOCKS): 256 rows of 8 warps, 192 of 12
/// and 128 of 8 (two warps a row group: the SM's 4 sub-partitions get equal work; the kernel's
/// comment says why that matters). 24,576 rows (the 8B MLP's gate/up) are 96 blocks of 256
/// on an H100's 132 SMs, 128 of 192.
pub(super) const INT_GEMM_BLOCKS: [IntGemmBlock; 3] = [
    IntGemmBlock {
        row_groups: 8,
        k_parts: 1,
    },
    IntGemmBlock {
        row_groups: 6,
        k_parts: 2,
    },
    IntGemmBlock {
        row_groups: 4,
        k_parts: 2,
    },
];

/// The tensor-core integer GEMMs for 5..=64 rows (weights_f16.cu's int_mma_gemm): W4, W8, then
/// FP8 (in [`IntFormat`]'s order); for each the block shapes of [`INT_GEMM_BLOCKS`] in order;
/// for each n-tiles 1, 2, 4, 8 (rows up to 8, 16, 32, 64); f32 then f16 output.
pub(super) const INT_GEMM_KERNELS: [&str; 72] = [
    "int_gemm_w4_r256_n1_f32",
    "int_gemm_w4_r256_n1_f16",
    "int_gemm_w4_r256_n2_f32",
    "int_gemm_w4_r256_n2_f16",
    "int_gemm_w4_r256_n4_f32",
    "int_gemm_w4_r256_n4_f16",
    "int_gemm_w4_r256_n8_f32",
    "int_gemm_w4_r256_n8_f16",
    "int_gemm_w4_r192_n1_f32",
    "int_gemm_w4_r192_n1_f16",
    "int_gemm_w4_r192_n2_f32",
    "int_gemm_w4_r192_n2_f16",
    "int_gemm_w4_r192_n4_f32",
    "int_gemm_w4_r192_n4_f16",
    "int_gemm_w4_r192_n8_f32",
    "int_gemm_w4_r192_n8_f16",
    "int_gemm_w4_r128_n1_f32",
    "int_gemm_w4_r128_n1_f16",
    "int_gemm_w4_r128_n2_f32",
    "int_gemm_w4_r128_n2_f16",
    "int_gemm_w4_r128_n4_f32",
    "int_gemm_w4_r128_n4_f16",
    "int_gemm_w4_r128_n8_f32",
    "int_gemm_w4_r128_n8_f16",
    "int_gemm_w8_r256_n1_f32",
    "int_gemm_w8_r256_n1_f16",
    "int_gemm_w8_r256_n2_f32",
    "int_gemm_w8_r256_n2_f16",
    "int_gemm_w8_r256_n4_f32",
    "int_gemm_w8_r256_n4_f16",
    "int_gemm_w8_r256_n8_f32",
    "int_gemm_w8_r256_n8_f16",
    "int_gemm_w8_r192_n1_f32",
    "int_gemm_w8_r192_n1_f16",
    "int_gemm_w8_r192_n2_f32",
    "int_gemm_w8_r192_n2_f16",
    "int_gemm_w8_r192_n4_f32",
    "int_gemm_w8_r192_n4_f16",
    "int_gemm_w8_r192_n8_f32",
    "int_gemm_w8_r192_n8_f16",
    "int_gemm_w8_r128_n1_f32",
    "int_gemm_w8_r128_n1_f16",
    "int_gemm_w8_r128_n2_f32",
    "int_gemm_w8_r128_n2_f16",
    "int_gemm_w8_r128_n4_f32",
    "int_gemm_w8_r128_n4_f16",
    "int_gemm_w8_r128_n8_f32",
    "int_gemm_w8_r128_n8_f16",
    "int_gemm_f8_r256_n1_f32",
    "int_gemm_f8_r256_n1_f16",
    "int_gemm_f8_r256_n2_f32",
    "int_gemm_f8_r256_n2_f16",
    "int_gemm_f8_r256_n4_f32",
    "int_gemm_f8_r256_n4_f16",
    "int_gemm_f8_r256_n8_f32",
    "int_gemm_f8_r256_n8_f16",
    "int_gemm_f8_r192_n1_f32",
    "int_gemm_f8_r192_n1_f16",
    "int_gemm_f8_r192_n2_f32",
    "int_gemm_f8_r192_n2_f16",
    "int_gemm_f8_r192_n4_f32",
    "int_gemm_f8_r192_n4_f16",
    "int_gemm_f8_r192_n8_f32",
    "int_gemm_f8_r192_n8_f16",
    "int_gemm_f8_r128_n1_f32",
    "int_gemm_f8_r128_n1_f16",
    "int_gemm_f8_r128_n2_f32",
    "int_gemm_f8_r128_n2_f16",
    "int_gemm_f8_r128_n4_f32",
    "int_gemm_f8_r128_n4_f16",
    "int_gemm_f8_r128_n8_f32",
    "int_gemm_f8_r128_n8_f16",
];

/// The integer GEMMs on Hopper's wgmma (weights_f16.cu's int_wgmma_gemm, sm_90a only) for
/// 17..=64 rows, where they beat int_mma_gemm (at 8 and 16 rows they were 1-7% slower a
/// projection on an H200): the same formats and block shapes in the same order, n-tiles 4 and
/// 8, f32 then f16 output; the same arguments, threads and shared memory as int_mma_gemm's.
pub(super) const INT_GEMM_WGMMA_KERNELS: [&str; 36] = [
    "int_gemm_wg_w4_r256_n4_f32",
    "int_gemm_wg_w4_r256_n4_f16",
    "int_gemm_wg_w4_r256_n8_f32",
    "int_gemm_wg_w4_r256_n8_f16",
    "int_gemm_wg_w4_r192_n4_f32",
    "int_gemm_wg_w4_r192_n4_f16",
    "int_gemm_wg_w4_r192_n8_f32",
    "int_gemm_wg_w4_r192_n8_f16",
    "int_gemm_wg_w4_r128_n4_f32",
    "int_gemm_wg_w4_r128_n4_f16",
    "int_gemm_wg_w4_r128_n8_f32",
    "int_gemm_wg_w4_r128_n8_f16",
    "int_gemm_wg_w8_r256_n4_f32",
    "int_gemm_wg_w8_r256_n4_f16",
    "int_gemm_wg_w8_r256_n8_f32",
    "int_gemm_wg_w8_r256_n8_f16",
    "int_gemm_wg_w8_r192_n4_f32",
    "int_gemm_wg_w8_r192_n4_f16",
    "int_gemm_wg_w8_r192_n8_f32",
    "int_gemm_wg_w8_r192_n8_f16",
    "int_gemm_wg_w8_r128_n4_f32",
    "int_gemm_wg_w8_r128_n4_f16",
    "int_gemm_wg_w8_r128_n8_f32",
    "int_gemm_wg_w8_r128_n8_f16",
    "int_gemm_wg_f8_r256_n4_f32",
    "int_gemm_wg_f8_r256_n4_f16",
    "int_gemm_wg_f8_r256_n8_f32",
    "int_gemm_wg_f8_r256_n8_f16",
    "int_gemm_wg_f8_r192_n4_f32",
    "int_gemm_wg_f8_r192_n4_f16",
    "int_gemm_wg_f8_r192_n8_f32",
    "int_gemm_wg_f8_r192_n8_f16",
    "int_gemm_wg_f8_r128_n4_f32",
    "int_gemm_wg_f8_r128_n4_f16",
    "int_gemm_wg_f8_r128_n8_f32",
    "int_gemm_wg_f8_r128_n8_f16",
];

/// The integer GEMM's n8 tiles for `rows` (1..=64) rows of x: 1, 2, 4 or 8.
pub(super) fn int_gemm_tiles(rows: usize) -> usize {
    rows.div_ceil(8).next_power_of_two()
}

/// Fewest n8 tiles (x's rows by 8, rounded up to a power of two) that take the wgmma integer
/// GEMM where it is loaded: 17 rows and more.
pub(super) const INT_GEMM_WGMMA_MIN_TILES: usize = 4;

/// The integer GEMM kernel of `format` with blocks of shape `block` (one of
/// [`INT_GEMM_BLOCKS`]) for `rows` (1..=64) rows, f16 output or f32: on wgmma
/// ([`INT_GEMM_WGMMA_KERNELS`]) where `hopper` (it is loaded) and the rows are enough, else
/// on mma.sync.
pub(super) fn int_gemm_kernel(
    format: IntFormat,
    block: IntGemmBlock,
    rows: usize,
    f16_out: bool,
    hopper: bool,
) -> &'static str {
    let shape = INT_GEMM_BLOCKS
        .iter()
        .position(|&b| b == block)
        .expect("one of INT_GEMM_BLOCKS");
    let tiles = int_gemm_tiles(rows).trailing_zeros() as usize;
    let out = f16_out as usize;
    if hopper && int_gemm_tiles(rows) >= INT_GEMM_WGMMA_MIN_TILES {
        let wide = tiles - INT_GEMM_WGMMA_MIN_TILES.trailing_zeros() as usize;
        return INT_GEMM_WGMMA_KERNELS[12 * format as usize + 4 * shape + 2 * wide + out];
    }
    INT_GEMM_KERNELS[24 * format as usize + 8 * shape + 2 * tiles + out]
}

/// weights_f16.cu's IG_BLOCKS(X, ...): X(..., rows, row groups, k parts) for each of
/// [`INT_GEMM_BLOCKS`], the kernels instantiated for each format and n-tiles.
fn int_gemm_blocks_define() -> String {
    let shapes: Vec<String> = INT_GEMM_BLOCKS
        .iter()
        .map(|b| {
            format!(
                "X(__VA_ARGS__, {}, {}, {})",
                b.rows(),
                b.row_groups,
                b.k_parts
            )
        })
        .collect();
    format!("#define IG_BLOCKS(X, ...) {}\n", shapes.join(" "))
}

impl Gemv {
    /// The kernel for `rows` (1..=GEMV_MAX_ROWS) input rows, streamed or not.
    pub(super) fn kernel(self, rows: usize, streamed: bool) -> &'static str {
        GEMV_KERNELS[self as usize + if streamed { 4 } else { 0 }][rows - 1]
    }

    /// The integer-weight kernel of `format` for `rows` input rows.
    pub(super) fn int_kernel(self, format: IntFormat, rows: usize) -> &'static str {
        GEMV_KERNELS[8 + 4 * format as usize + self as usize][rows - 1]
    }

    /// The tensor-core integer-weight kernel of `format` for `rows` input rows.
    pub(super) fn int_mma_kernel(self, format: IntFormat, rows: usize) -> &'static str {
        GEMV_KERNELS[20 + 4 * format as usize + self as usize][rows - 1]
    }

    pub(super) fn normed(self) -> bool {
        matches!(self, Gemv::Normed | Gemv::NormedSwiglu)
    }
}

/// The constants the kernels share with this file, as `#define` lines put before every kernel
/// source: one definition, so the two sides cannot disagree (and the kernel cache key, a hash
/// of the source, changes with them).
fn shared_defines() -> String {
    format!(
        "#define GEMV_MAX_ROWS {GEMV_MAX_ROWS}\n#define GEMV_WARPS {GEMV_WARPS}\n\
         #define GEMV_SPLIT {GEMV_SPLIT}\n#define PD_WARPS {DECODE_WARPS}\n\
         #define PD_KEYS {DECODE_KEYS}\n#define PD_MIN_CHUNK {DECODE_MIN_CHUNK}\n\
         #define QK_WARPS {QKV_WARPS}\n#define PD_MAX_SPLITS {DECODE_MAX_SPLITS}\n\
         #define LN_WARP_VEC {LAYER_NORM_WARP_VEC}\n#define NORM_VEC {NORM_VEC}\n\
         #define PACK_ROWS {PACK_ROWS}\n\
         #define STREAM_STAGED {STREAM_STAGED}\n#define SAMPLE_WORDS {SAMPLE_WORDS}\n\
         #define LOGPROB_COLS {LOGPROB_COLS}\n#define MAX_TOP_LOGPROBS {MAX_TOP_LOGPROBS}\n\
         #define SAMPLE_LIST {SAMPLE_LIST}\n#define SAMPLE_BINS {SAMPLE_BINS}\n\
         #define IG_K {INT_GEMM_K}\n#define IG_STAGES {INT_GEMM_STAGES}\n\
         #define IG_SZ_SLOTS {INT_GEMM_SZ_SLOTS}\n\
         #define PW_WG {PAGED_FLASH_WGMMA_WARPGROUPS}\n#define PW_BK {PAGED_FLASH_WGMMA_KEYS}\n\
         #define PW_STAGES {PAGED_FLASH_WGMMA_STAGES}\n{}",
        int_gemm_blocks_define()
    )
}

/// A kernel file's text as compiled: the shared defines, then `common.cuh`, the file's prelude
/// and the file, either the copies embedded at build time or, when `VLM_KERNEL_DIR` names a
/// directory, the files there (so a kernel can be edited and re-measured on a GPU machine with
/// the same binary).
pub(super) fn kernel_source(src: &KernelSource) -> Result<String> {
    let mut files = std::iter::once(("common.cuh", COMMON))
        .chain(src.prelude.iter().copied())
        .chain(std::iter::once((src.file, src.source)));
    // Empty counts as unset (`VLM_KERNEL_DIR= vlm ...`).
    let Some(dir) = std::env::var_os("VLM_KERNEL_DIR").filter(|d| !d.is_empty()) else {
        return Ok(files.fold(shared_defines(), |text, (_, embedded)| text + embedded));
    };
    let dir = std::path::PathBuf::from(dir);
    files.try_fold(shared_defines(), |text, (name, _)| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .map(|file| text + &file)
            .map_err(|e| Error::Cuda {
                what: format!(
                    "VLM_KERNEL_DIR is set: reading {}: {e} (unset it to use the kernels built in)",
                    path.display()
                ),
            })
    })
}

/// Every kernel file a GPU of capability `cc` loads, compiled for it, as (file, PTX).
pub fn compile_all_ptx(cc: (i32, i32)) -> Result<Vec<(&'static str, String)>> {
    SOURCES
        .iter()
        .filter(|s| s.for_cc(cc))
        .map(|s| {
            Ok((
                s.file,
                compile_ptx(s.file, &kernel_source(s)?, cc, s.arch_specific(cc))?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ViT's attention on an H100 (132 SMs), 16 heads: the blocks of the full waves whole,
    /// the rest as measured best (2026-11-26): 448x448 two CTAs a block, 896x896 and 1344x1344
    /// over every SM; a small image, or blocks that fill whole waves, a CTA a block.
    #[test]
    fn the_vits_attention_grid_ends_its_last_wave_early() {
        let grid = |patches: usize| {
            let tiles = patches.div_ceil(FLASH_WGMMA_KEYS);
            flash_wgmma_grid(patches.div_ceil(FLASH_WGMMA_QUERIES) * 16, tiles, 132)
        };
        assert_eq!(grid(784), (0, 128));
        assert_eq!(grid(3136), (132, 264));
        assert_eq!(grid(7056), (396, 528));
        assert_eq!(grid(196), (16, 16));
        assert_eq!(flash_wgmma_grid(264, 28, 132), (264, 264));
        // Every block past `whole` gets a CTA at least, and a CTA's tiles span two blocks at
        // most (the kernel's FwRest), whatever the sizes.
        for blocks in 1..600 {
            for tiles in [1, 2, 7, 28, 63, 200] {
                let (whole, ctas) = flash_wgmma_grid(blocks, tiles, 132);
                assert!(whole <= blocks && ctas >= blocks, "{blocks} x {tiles}");
                assert!(ctas - whole <= 132, "{blocks} x {tiles}");
            }
        }
    }

    /// Every kernel a source defines by its plain name is on that source's load list: a kernel
    /// missing from it compiles, passes every CPU test and fails only at its first launch on a
    /// GPU (as `dequant_f8_f16` once did). Names built by macros (`NAME##_r##ROWS`) are checked
    /// the other way, by `load_function` at start.
    #[test]
    fn every_plain_kernel_a_source_defines_is_loaded() {
        for src in SOURCES {
            let listed: Vec<&str> = src.all_kernels(true).collect();
            for piece in src.source.split("extern \"C\" __global__ void").skip(1) {
                let mut rest = piece.trim_start();
                if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
                    rest = &bounds[bounds.find(')').map_or(0, |i| i + 1)..];
                }
                let name = rest.split('(').next().unwrap_or_default().trim();
                // A macro's parameter (`NAME`, `NAME##_r##ROWS`), not a kernel's name.
                if name.contains("##") || name.chars().all(|c| c.is_ascii_uppercase()) {
                    continue;
                }
                assert!(
                    listed.contains(&name),
                    "{}: kernel {name} is defined but not on the source's load list",
                    src.file
                );
            }
        }
    }

    /// The decode kernel over an FP8 cache is the f16 one's `_f8` twin, for every shape either
    /// is instantiated for.
    #[test]
    fn each_decode_kernel_has_an_fp8_twin() {
        use DecodeAttention::{PerLane, TensorCores};
        for kernel in [TensorCores, PerLane] {
            for (d, group) in [(32, 1), (64, 3), (128, 4), (128, 8), (256, 4)] {
                let f16 = decode_kernel(d, group, false, kernel).unwrap();
                let f8 = decode_kernel(d, group, true, kernel).unwrap();
                let twin = if f16.starts_with("paged_decode_mma_") {
                    f16.replace("paged_decode_mma_", "paged_decode_mma_f8_")
                } else {
                    f16.replace("paged_decode_", "paged_decode_f8_")
                };
                assert_eq!(f8, twin);
            }
            assert_eq!(decode_kernel(256, 8, true, kernel), None);
            assert_eq!(decode_kernel(80, 1, true, kernel), None);
        }
        // The tensor cores where a shape has their kernel and it is asked for, else the
        // per-lane kernel.
        assert_eq!(
            decode_kernel(128, 4, false, TensorCores),
            Some("paged_decode_mma_d128_g4")
        );
        assert_eq!(
            decode_kernel(64, 3, true, TensorCores),
            Some("paged_decode_mma_f8_d64_g4")
        );
        assert_eq!(
            decode_kernel(128, 4, false, PerLane),
            Some("paged_decode_d128_g4")
        );
        assert_eq!(
            decode_kernel(128, 1, false, TensorCores),
            Some("paged_decode_d128_g1")
        );
        assert_eq!(
            decode_kernel(256, 4, false, TensorCores),
            Some("paged_decode_d256_g4")
        );
    }

    /// Decode's splits: at batch 1 as many as fill one wave, at 64 sequences one split where
    /// whole waves allow it and fewer waves' worth of imbalance where they do not, at 128 one.
    #[test]
    fn decode_splits_fill_the_gpu_in_whole_waves() {
        // An H200's 132 SMs; 8 KV heads (the 8B model).
        let (h200, heads) = (132, 8);
        // Batch 1 at 4096 keys: 4 blocks an SM, 64 splits; 2 blocks an SM, one wave of 33
        // instead of two of 64.
        assert_eq!(decode_splits(heads, 4 * h200, 4096), 64);
        assert_eq!(decode_splits(heads, 2 * h200, 4096), 33);
        // Batch 1 at 512 keys: no split under 32 keys.
        assert_eq!(decode_splits(heads, 4 * h200, 512), 16);
        // Batch 64 at 4096 keys: one split where 512 blocks fill whole waves (4 an SM: one
        // wave; 2 an SM: two), three at 3 an SM.
        assert_eq!(decode_splits(64 * heads, 4 * h200, 4096), 1);
        assert_eq!(decode_splits(64 * heads, 2 * h200, 4096), 1);
        assert_eq!(decode_splits(64 * heads, 3 * h200, 4096), 3);
        // Batch 128: one split at 2, 3 or 4 blocks an SM (at 3, 3 waves of all the keys, not 13
        // of a fifth), whatever the longest context a recorded step allows.
        for per_sm in 2..=4 {
            for max_keys in [512, 4096, 262_144] {
                assert_eq!(decode_splits(128 * heads, per_sm * h200, max_keys), 1);
            }
        }
        // A single key: one.
        assert_eq!(decode_splits(heads, 4 * h200, 1), 1);
    }

    /// The integer GEMM's table is indexed by format, block shape, n-tiles and output: each
    /// choice names the kernel of its own format and block rows (FP8's are the last 24, after
    /// W4's and W8's), and the shapes the kernels are instantiated for are the host's.
    #[test]
    fn each_format_picks_its_own_integer_gemm() {
        for (format, tag) in IntFormat::ALL.into_iter().zip(["w4", "w8", "f8"]) {
            for block in INT_GEMM_BLOCKS {
                for (rows, tiles) in [
                    (1, 1),
                    (5, 1),
                    (8, 1),
                    (9, 2),
                    (16, 2),
                    (17, 4),
                    (33, 8),
                    (64, 8),
                ] {
                    for (f16_out, out) in [(false, "f32"), (true, "f16")] {
                        for hopper in [false, true] {
                            let kind = if hopper && rows > 16 { "wg_" } else { "" };
                            assert_eq!(
                                int_gemm_kernel(format, block, rows, f16_out, hopper),
                                format!("int_gemm_{kind}{tag}_r{}_n{tiles}_{out}", block.rows()),
                                "{format:?}, {block:?}, {rows} rows"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(
            int_gemm_blocks_define(),
            "#define IG_BLOCKS(X, ...) X(__VA_ARGS__, 256, 8, 1) X(__VA_ARGS__, 192, 6, 2) \
             X(__VA_ARGS__, 128, 4, 2)\n"
        );
    }
}
