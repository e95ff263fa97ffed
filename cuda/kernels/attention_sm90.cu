// Flash attention on Hopper's warpgroup MMA (wgmma), for the ViT. sm_90a only: NVRTC compiles
// this file after common.cuh, wgmma.cuh (the wgmma primitives) and attention_f16.cu (whose
// helpers, tile_softmax and the RoPE pack it shares) for compute_90a on an H100/H200; every
// other GPU (Jetson Orin's sm_87 included) keeps attention_f16.cu's mma.sync kernels. Same
// computation as flash_attention there: Q pre-scaled by 1/sqrt(d) log2(e), an online softmax
// per row in f32 with exp2, P rounded to f16, f32 sums. CPU twin: `attention` in
// cuda/src/cpu.rs, through `rope_attention_segments` and `layer_norm_rope_attention`.
//
// Why: with mma.sync every K and V fragment passes through registers (ldmatrix) for each
// product; here a warpgroup (4 warps) takes 64 query rows and the tensor cores read Q and K
// (S = Q Kᵀ) and V (O += P V) straight from shared memory; P comes from S's registers.
//
// Keys and values come pre-tiled (TiledKvDst below, written by rope_qkv_pack_tiled_*): per KV
// head, tiles of FW_BK keys, each already in the shared-memory layout the tensor cores read, so
// one thread copies a tile with two bulk copies (TMA) instead of every thread computing ~100
// instructions of addresses a tile for 16-byte cp.async copies, as the kernel's first version
// did (ncu: a quarter of its issue slots). V carries a column of ones (dim FW_ONES), so P V
// also sums each row's weights in f32: no per-score additions for the softmax's sums. With
// tile_softmax's LAZY rescaling, H100, 16 heads of 72, one call (carry/fa harness):
// 7,056 queries (1344x1344) 0.77 -> 0.50 ms, 3,136 (896x896) 0.195 -> 0.13, 784 (448x448)
// 0.031 (flash_attention_d80, which it now replaces there too) -> 0.028.
//
// A block: FW_WARPGROUPS warpgroups (256 queries of one head), FW_STAGES buffers of FW_BK keys.
// Shared memory holds the operands in wgmma's no-swizzle layout: "core matrices" of 8 rows x 16
// bytes, 128 contiguous bytes each:
//   Q and K tiles, K-major (a row's dims contiguous): core (row block rb, dim chunk c) at
//     (rb * DP/8 + c) * 128 bytes; a k-step's 16 dims are two cores 128 bytes apart (leading
//     byte offset), row blocks DP * 16 bytes apart (stride byte offset).
//   V tiles, MN-major (read transposed): core (dim chunk c, key block kb) at
//     (c * FW_BK/8 + kb) * 128 bytes: key blocks 128 bytes apart (leading), dim chunks
//     FW_BK * 16 bytes apart (stride).
// No block-wide barrier in the loop: thread 0 starts a tile's copies on its `full` mbarrier
// (expecting their bytes), and each warp arrives on the tile's `empty` mbarrier when its
// products are done. Tile i + FW_STAGES - 2 refills the buffers of tile i - 2, so warpgroups
// drift up to two tiles apart and one's softmax runs while another's products hold the tensor
// cores (with one barrier a tile they ran in lockstep).

#define FW_WARPGROUPS 4
#define FW_STAGES 3
#define FW_BK 112  // keys a tile (on the H100 at 7,056 queries: 80 0.53 ms, 96 0.51, 112 0.50)
#define FW_DP 80   // Q Kᵀ's dims: head dims 65..72 padded to a k-step multiple
#define FW_DV 80   // P V's: the head dims, zeros, V's column of ones at FW_ONES, zeros
#define FW_ONES 72

template <int N>
struct WgmmaSS;

// D (64 x N, f32, the warpgroup's accumulators) = (accumulate ? D : 0) + A B, A (64 x 16) and
// B (16 x N) f16 in shared memory by descriptor, both K-major.
template <>
struct WgmmaSS<112> {
    static __device__ __forceinline__ void run(float (&d)[56], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n112k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, %56, %57, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
              "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
              "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
              "+f"(d[54]), "+f"(d[55])
            : "l"(a), "l"(b), "r"(accumulate));
    }
};

template <>
struct WgmmaSS<64> {
    static __device__ __forceinline__ void run(float (&d)[32], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
              "+f"(d[30]), "+f"(d[31])
            : "l"(a), "l"(b), "r"(accumulate));
    }
};


__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
// Arrives on b and adds `bytes` to the transaction count its current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect(unsigned long long* b, unsigned bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                 ::"r"(smem_addr(b)), "r"(bytes)
                 : "memory");
}
// `bytes` contiguous bytes global -> shared by the copy engine (TMA), counted on b.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, unsigned bytes,
                                          unsigned long long* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(smem_addr(b))
        : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(b))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(smem_addr(b)),
        "r"(parity)
        : "memory");
}

// Where rope_qkv_pack puts keys and values for the wgmma kernel: per KV head, tiles of FW_BK
// keys, a tile's K (FW_BK x FW_DP) then, in the V array, its V (FW_BK x FW_DV), each in the
// shared-memory layout above. Dims past d are zeros, but V's FW_ONES is one.
struct TiledKvDst {
    half* __restrict__ k;
    half* __restrict__ v;
    int tiles;  // per KV head
    __device__ size_t tile(int t, int h) const {
        return ((size_t)h * tiles + t / FW_BK) * (FW_BK * FW_DP);
    }
    __device__ size_t k_at(int t, int, int h, int i) const {
        const int j = t % FW_BK;
        return tile(t, h) + (((j / 8) * (FW_DP / 8) + i / 8) * 8 + j % 8) * 8 + i % 8;
    }
    __device__ size_t v_at(int t, int, int h, int i) const {
        const int j = t % FW_BK;
        return tile(t, h) + (((i / 8) * (FW_BK / 8) + j / 8) * 8 + j % 8) * 8 + i % 8;
    }
    // Row t's dims d..FW_DP of every head: zeros, but V's FW_ONES is one. Whole 16-byte chunks
    // where d is a multiple of 8 (the ViT's 72: one chunk a head each of K and V).
    __device__ void pad(int t, int heads, int d, int) const {
        if (d % 8 == 0) {
            const int chunks = (FW_DP - d) / 8;
            for (int p = threadIdx.x; p < heads * chunks; p += blockDim.x)
                pad_chunk(t, heads, p / chunks, d + (p % chunks) * 8, true);
            return;
        }
        const int n = FW_DP - d;
        for (int p = threadIdx.x; p < heads * n; p += blockDim.x) {
            const int h = p / n, i = d + p % n;
            k[k_at(t, heads, h, i)] = __float2half_rn(0.0f);
            v[v_at(t, heads, h, i)] = __float2half_rn(i == FW_ONES ? 1.0f : 0.0f);
        }
    }
    // Row t (a key past the image) of every head, K and V: zeros.
    __device__ void zero(int t, int heads) const {
        constexpr int chunks = FW_DP / 8;
        for (int p = threadIdx.x; p < heads * chunks; p += blockDim.x)
            pad_chunk(t, heads, p / chunks, (p % chunks) * 8, false);
    }
    // The 8 dims from i (a multiple of 8) of row t, head h, K and V: zeros, but V's FW_ONES is
    // one where `ones` (a row's padding dims; not a row past the image). FW_ONES % 8 == 0: it
    // is a chunk's first dim.
    __device__ void pad_chunk(int t, int heads, int h, int i, bool ones) const {
        *reinterpret_cast<uint4*>(k + k_at(t, heads, h, i)) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(v + v_at(t, heads, h, i)) =
            make_uint4(ones && i == FW_ONES ? pack_half2(1.0f, 0.0f) : 0u, 0, 0, 0);
    }
};
static_assert(FW_DP == FW_DV, "K and V tiles share TiledKvDst::tile");

// One image's rows (`len` of them, head dim d <= FW_ONES) of the fused projection, rotated and
// packed as rope_qkv_pack_f16 does, but q as f16 pre-scaled by q_scale (1/sqrt(d) log2 e: what
// the kernel's exp2 softmax wants) and K and V into TiledKvDst's `tiles` tiles a head. One
// block per row of the tiles: the rows past `len` (up to the last tile's end) are zeros, so
// that no NaN of uninitialized memory reaches P V where the weights are 0.
//
// Where d is a multiple of 8 (the ViT's 72) a thread takes one 16-byte chunk (8 dims) of a
// head's q, K and V, whose stores are then whole 16 bytes of the tiles: ncu on 896x896 put
// the pair-a-thread way (4-byte stores scattered over the tiles' 128-byte cores) at 39 us a
// layer.
// 8 values rounded to f16 at p, 16-byte aligned: one store.
__device__ __forceinline__ void store8(half* p, const float v[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]),
                                              pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
}

// 8 dims i0.. (a multiple of 8) of one head's q or k (src: its d values) rotated by RoPE
// (cos_t and sin_t at this row) and scaled: two groups of 4, each with its rotate-half
// partners 4 dims at i -+ d/2 (d/2 is a multiple of 4), the same side of the middle for all 4.
template <typename In>
__device__ __forceinline__ void rope8(const In* src, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, int i0, int hd,
                                      float scale, float out[8]) {
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const int i = i0 + 4 * g, j = i < hd ? i + hd : i - hd;
        const float sign = i < hd ? -1.0f : 1.0f;
        float c[4], s[4], xi[4], xj[4];
        load_n<4>(cos_t + i, c);
        load_n<4>(sin_t + i, s);
        load_n<4>(src + i, xi);
        load_n<4>(src + j, xj);
#pragma unroll
        for (int e = 0; e < 4; ++e) out[4 * g + e] = (xi[e] * c[e] + sign * xj[e] * s[e]) * scale;
    }
}

template <typename In>
__device__ __forceinline__ void rope_qkv_pack_tiled(const In* __restrict__ qkv,
                                                    const float* __restrict__ cos_t,
                                                    const float* __restrict__ sin_t,
                                                    half* __restrict__ q, float q_scale,
                                                    half* __restrict__ kt, half* __restrict__ vt,
                                                    int heads, int d, int len, int tiles) {
    const TiledKvDst kv{kt, vt, tiles};
    const int t = blockIdx.x;
    if (t >= len) {
        kv.zero(t, heads);
        return;
    }
    if (d % 8 != 0) {
        rope_qkv_pack(qkv, cos_t, sin_t, q, q_scale, kv, heads, d, FW_DP);
        return;
    }
    constexpr int CH = FW_DP / 8;  // chunks a head: the head dims', then padding
    const int hd = d / 2, w = heads * d;
    const In* row = qkv + (size_t)t * 3 * w;
    const float *cos_row = cos_t + (size_t)t * d, *sin_row = sin_t + (size_t)t * d;
    for (int p = threadIdx.x; p < heads * CH; p += blockDim.x) {
        const int h = p / CH, i0 = (p % CH) * 8;
        if (i0 >= d) {
            kv.pad_chunk(t, heads, h, i0, true);
            continue;
        }
        float qo[8], ko[8], vo[8];
        rope8(row + h * d, cos_row, sin_row, i0, hd, q_scale, qo);
        rope8(row + w + h * d, cos_row, sin_row, i0, hd, 1.0f, ko);
        load_n<4>(row + 2 * w + h * d + i0, vo);
        load_n<4>(row + 2 * w + h * d + i0 + 4, vo + 4);
        store8(q + (size_t)t * w + h * d + i0, qo);
        store8(kt + kv.k_at(t, heads, h, i0), ko);
        store8(vt + kv.v_at(t, heads, h, i0), vo);
    }
}

extern "C" __global__ void rope_qkv_pack_tiled_f16(const float* __restrict__ qkv,
                                                   const float* __restrict__ cos_t,
                                                   const float* __restrict__ sin_t,
                                                   half* __restrict__ q, float q_scale,
                                                   half* __restrict__ kt, half* __restrict__ vt,
                                                   int heads, int d, int len, int tiles) {
    rope_qkv_pack_tiled(qkv, cos_t, sin_t, q, q_scale, kt, vt, heads, d, len, tiles);
}

extern "C" __global__ void rope_qkv16_pack_tiled_f16(const half* __restrict__ qkv,
                                                     const float* __restrict__ cos_t,
                                                     const float* __restrict__ sin_t,
                                                     half* __restrict__ q, float q_scale,
                                                     half* __restrict__ kt, half* __restrict__ vt,
                                                     int heads, int d, int len, int tiles) {
    rope_qkv_pack_tiled(qkv, cos_t, sin_t, q, q_scale, kt, vt, heads, d, len, tiles);
}

// The same pack from f16 rows with d a multiple of 8, PACK_ROWS rows a block: the rows are
// first staged in shared memory with whole 16-byte loads, then q is written row by row and K
// and V with the block's rows side by side, so that each 16-byte line of a tile's core is
// stored next to its neighbours' (two rows fill a 32-byte sector). ncu on the one-row-a-block
// kernel above at 896x896 (30.6 us a layer): 39% excess sectors from its 8-byte loads of a
// chunk and of its rotate-half partner and its lone 16-byte stores into the cores, and a third
// of the warps it could hold resident. The partner's 4 dims (d/2 away, not on a chunk's
// boundary for d = 72) now come from shared memory. PACK_ROWS is #defined by the host
// (shared_defines).

// As rope_qkv16_pack_tiled_f16 for d % 8 == 0, PACK_ROWS rows of the tiles a block (tiles *
// FW_BK / PACK_ROWS blocks), dynamic shared memory PACK_ROWS (3 heads d + 8) halves.
extern "C" __global__ void __launch_bounds__(256)
    rope_qkv16_pack_tiled_rows_f16(const half* __restrict__ qkv, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, half* __restrict__ q,
                                   float q_scale, half* __restrict__ kt, half* __restrict__ vt,
                                   int heads, int d, int len, int tiles) {
    extern __shared__ __align__(16) unsigned char pk_smem[];
    half* rows = reinterpret_cast<half*>(pk_smem);
    const int w = heads * d;
    const int stride = 3 * w + 8;  // halves a staged row: 16 bytes apart in banks row to row
    const int t0 = blockIdx.x * PACK_ROWS, hd = d / 2;
    const TiledKvDst kv{kt, vt, tiles};

    const int row_chunks = 3 * w / 8;
    for (int p = threadIdx.x; p < PACK_ROWS * row_chunks; p += blockDim.x) {
        const int r = p / row_chunks, c = p % row_chunks, t = t0 + r;
        if (t < len)
            *reinterpret_cast<uint4*>(rows + r * stride + c * 8) =
                *reinterpret_cast<const uint4*>(qkv + (size_t)t * 3 * w + c * 8);
    }
    __syncthreads();

    // q: a row's chunks side by side.
    const int qc = d / 8;
    for (int p = threadIdx.x; p < PACK_ROWS * heads * qc; p += blockDim.x) {
        const int r = p / (heads * qc), h = p % (heads * qc) / qc, i0 = p % qc * 8;
        const int t = t0 + r;
        if (t >= len) continue;
        float qo[8];
        rope8(rows + r * stride + h * d, cos_t + (size_t)t * d, sin_t + (size_t)t * d, i0, hd,
              q_scale, qo);
        store8(q + (size_t)t * w + h * d + i0, qo);
    }

    // K and V: the block's rows of one core side by side. Dims past d: zeros, but V's FW_ONES
    // is one; rows past the image: zeros.
    constexpr int CH = FW_DP / 8;
    for (int p = threadIdx.x; p < heads * CH * PACK_ROWS; p += blockDim.x) {
        const int r = p % PACK_ROWS, h = p / PACK_ROWS / CH, i0 = p / PACK_ROWS % CH * 8;
        const int t = t0 + r;
        if (t >= len || i0 >= d) {
            kv.pad_chunk(t, heads, h, i0, t < len);
            continue;
        }
        const half* row = rows + r * stride;
        float ko[8];
        rope8(row + w + h * d, cos_t + (size_t)t * d, sin_t + (size_t)t * d, i0, hd, 1.0f, ko);
        store8(kt + kv.k_at(t, heads, h, i0), ko);
        *reinterpret_cast<uint4*>(vt + kv.v_at(t, heads, h, i0)) =
            *reinterpret_cast<const uint4*>(row + 2 * w + h * d + i0);
    }
}

// Shared memory, dynamic: Q, FW_STAGES K tiles, FW_STAGES V tiles, the full and empty
// mbarriers, then fw_merge's flag (16 bytes; a static one would move the tiles off their 1 KB
// alignment). Must match flash_wgmma_smem_bytes in cuda/src/cuda/kernels.rs.
struct FwShared {
    static constexpr int q_rows = 64 * FW_WARPGROUPS;
    static constexpr int q_tile = q_rows * FW_DP;  // halves
    static constexpr int k_tile = FW_BK * FW_DP;
    static constexpr int v_tile = FW_BK * FW_DV;
    static constexpr int bars = (q_tile + FW_STAGES * (k_tile + v_tile)) * 2;  // byte offset
    static constexpr int flag = bars + 2 * FW_STAGES * 8;  // fw_merge's
    static constexpr int bytes = flag + 16;
};

// The block's queries (zeros past nq, dims past d zero, already scaled) in the K tile's layout:
// 16 bytes a thread at a time where d is a multiple of 8.
template <int BQ, int THREADS>
__device__ __forceinline__ void fw_stage_q(const half* __restrict__ q, half* Qs, int q0, int nq,
                                           int hq, int h, int d) {
    constexpr int KC = FW_DP / 8;
    for (int idx = threadIdx.x; idx < BQ * KC; idx += THREADS) {
        const int r = idx / KC, c = (idx % KC) * 8, i = q0 + r;
        const half* src = q + ((size_t)i * hq + h) * d + c;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (i < nq && c < d) {
            if (d % 8 == 0) {
                v = *reinterpret_cast<const uint4*>(src);
            } else {
                __align__(16) half e[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) e[j] = c + j < d ? src[j] : __float2half_rn(0.0f);
                v = *reinterpret_cast<const uint4*>(e);
            }
        }
        *reinterpret_cast<uint4*>(Qs + ((r / 8) * KC + c / 8) * 64 + (r % 8) * 8) = v;
    }
}

// float4s a thread of one partial result (FwPartials): O's FW_DV / 2 accumulators, then its two
// rows' running maxima.
#define FW_PART_VEC (FW_DV / 8 + 1)

// Partial results of the blocks whose keys several CTAs share (see flash_attention_wgmma): two
// slots a CTA of the rest, for the block its keys start in (0) and the one they end in (1); a
// slot holds each thread's unnormalized O and running maxima, thread-minor so that the stores
// and loads are whole lines.
struct FwPartials {
    float4* __restrict__ slots;
    __device__ float4* at(int slot) const {
        return slots + (size_t)slot * FW_PART_VEC * (FW_WARPGROUPS * 128) + threadIdx.x;
    }
};

// How the blocks past the full waves share the rest of the grid (see flash_attention_wgmma):
// their key tiles, block by block, are units; rest CTA r takes units [r U / R, (r + 1) U / R)
// of the U = blocks x tiles, R CTAs.
struct FwRest {
    int ctas, units, tiles;
    __device__ int first_unit(int r) const { return r * units / ctas; }
    __device__ int cta_of(int u) const { return ((u + 1) * ctas - 1) / units; }
    // Rest CTA r's slot for its share of block b (counted from the first one past the whole).
    __device__ int slot(int r, int b) const {
        return 2 * r + (first_unit(r) / tiles == b ? 0 : 1);
    }
};

// A block's 256 queries of one head (zeros past nq) as this thread holds them in O's
// accumulators, divided by each row's sum of weights (column FW_ONES, held by the quad's thread
// t = 0), into out [nq, hq * d].
template <typename Out>
__device__ __forceinline__ void fw_store(const float (&o)[FW_DV / 2], Out* __restrict__ out,
                                         int row0, int nq, int hq, int h, int d) {
    const int lane = threadIdx.x % 32, t = lane % 4;
    static_assert(FW_ONES % 8 == 0, "column FW_ONES is o[4 (FW_ONES / 8) + 2 hrow] of t = 0");
    float l[2];
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow)
        l[hrow] = __shfl_sync(0xffffffff, o[4 * (FW_ONES / 8) + 2 * hrow], lane & ~3);
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int i = row0 + 8 * hrow;
        if (i >= nq) continue;
        // No key at all (kv_len 0): zeros.
        float inv = l[hrow] > 0.0f ? 1.0f / l[hrow] : 0.0f;
        Out* dst = out + ((size_t)i * hq + h) * d;
#pragma unroll
        for (int n = 0; n < FW_DV / 8; ++n) {
            const int c = n * 8 + 2 * t;
            const float v2[2] = {o[4 * n + 2 * hrow] * inv, o[4 * n + 2 * hrow + 1] * inv};
            if (c + 1 < d && d % 2 == 0) {
                store_n<2>(dst + c, v2);  // c and the row's start even: aligned
            } else {
                if (c < d) store_n<1>(dst + c, v2);
                if (c + 1 < d) store_n<1>(dst + c + 1, v2 + 1);
            }
        }
    }
}

// Split block b's share of rest CTA r, in o and m_run, where rest CTAs r_lo..r_hi (two or
// more) share the block: stored in r's slot and counted; the CTA that counts last merges the
// other shares into o and m_run, by their running maxima as the online softmax merges tiles,
// and answers true (o is then the block's whole result, to store). `flag`: a shared int.
__device__ __forceinline__ bool fw_merge(float (&o)[FW_DV / 2], float (&m_run)[2],
                                         const FwRest& rest, int r, int b, int r_lo, int r_hi,
                                         unsigned* __restrict__ counters, FwPartials partials,
                                         int* flag) {
    constexpr int THREADS = FW_WARPGROUPS * 128, NO = FW_DV / 8;
    float4* mine = partials.at(rest.slot(r, b));
#pragma unroll
    for (int c = 0; c < NO; ++c)
        mine[c * THREADS] = make_float4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
    mine[NO * THREADS] = make_float4(m_run[0], m_run[1], 0.0f, 0.0f);
    __threadfence();  // the share visible before the count that says it is there
    __syncthreads();
    if (threadIdx.x == 0) {
        *flag = atomicAdd(counters + b, 1u) == (unsigned)(r_hi - r_lo);
        if (*flag) counters[b] = 0;  // every share has counted: 0 for the next kernel
    }
    __syncthreads();
    if (!*flag) return false;
    __threadfence();
    for (int other_r = r_lo; other_r <= r_hi; ++other_r) {
        if (other_r == r) continue;
        const float4* other = partials.at(rest.slot(other_r, b));
        const float4 mo = __ldcg(other + NO * THREADS);
        const float m_other[2] = {mo.x, mo.y};
        float mine_w[2], other_w[2];
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            const float m_new = fmaxf(m_run[hrow], m_other[hrow]);
            // Every share has seen a key of the image, so its maximum is finite.
            mine_w[hrow] = fast_exp2(m_run[hrow] - m_new);
            other_w[hrow] = fast_exp2(m_other[hrow] - m_new);
            m_run[hrow] = m_new;
        }
#pragma unroll
        for (int c4 = 0; c4 < NO; ++c4) {
            const float4 v = __ldcg(other + c4 * THREADS);
            o[4 * c4 + 0] = o[4 * c4 + 0] * mine_w[0] + v.x * other_w[0];
            o[4 * c4 + 1] = o[4 * c4 + 1] * mine_w[0] + v.y * other_w[0];
            o[4 * c4 + 2] = o[4 * c4 + 2] * mine_w[1] + v.z * other_w[1];
            o[4 * c4 + 3] = o[4 * c4 + 3] * mine_w[1] + v.w * other_w[1];
        }
    }
    return true;
}

// Key tiles first..first + count of one block (queries q0.. of head h, KV head kvh) into o and
// m_run (zeroed here), this CTA's tiles n0.. of its pipeline (buffers and mbarrier phases):
// the block's queries into shared memory, then the tiles, thread 0 loading them.
__device__ __forceinline__ void fw_attend(const half* __restrict__ q, const half* __restrict__ kt,
                                          const half* __restrict__ vt, int nq, int hq, int d,
                                          int kv_len, int q0, int h, int kvh, int first,
                                          int count, int n0, float (&o)[FW_DV / 2],
                                          float (&m_run)[2]) {
    using Sh = FwShared;
    constexpr int THREADS = FW_WARPGROUPS * 128;
    constexpr int KD = FW_DP / 16;  // k-steps of Q Kᵀ
    constexpr int NS = FW_BK / 8;   // 8-key column groups of S
    constexpr int NO = FW_DV / 8;   // 8-dim column groups of O
    extern __shared__ __align__(128) unsigned char fw_smem[];
    half* Qs = reinterpret_cast<half*>(fw_smem);
    half* kv0 = Qs + Sh::q_tile;
    unsigned long long* full = reinterpret_cast<unsigned long long*>(fw_smem + Sh::bars);
    unsigned long long* empty = full + FW_STAGES;
    auto k_buf = [&](int i) { return kv0 + (i % FW_STAGES) * Sh::k_tile; };
    auto v_buf = [&](int i) { return kv0 + FW_STAGES * Sh::k_tile + (i % FW_STAGES) * Sh::v_tile; };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int tiles = (kv_len + FW_BK - 1) / FW_BK;

    // Thread 0 only: tile first + i's K and V, one bulk copy each, on pipeline slot n0 + i's
    // full mbarrier.
    auto issue = [&](int i) {
        constexpr unsigned KB = Sh::k_tile * 2, VB = Sh::v_tile * 2;
        const int n = n0 + i;
        mbar_arrive_expect(full + n % FW_STAGES, KB + VB);
        const size_t tile = (size_t)kvh * tiles + first + i;
        bulk_copy(k_buf(n), kt + tile * Sh::k_tile, KB, full + n % FW_STAGES);
        bulk_copy(v_buf(n), vt + tile * Sh::v_tile, VB, full + n % FW_STAGES);
    };
    if (threadIdx.x == 0)
        for (int i = 0; i < FW_STAGES - 2 && i < count; ++i) {
            // Slot n0 + i's buffers were slot n0 + i - FW_STAGES's: done with once every warp
            // has arrived for it.
            const int n = n0 + i;
            if (n >= FW_STAGES)
                mbar_wait(empty + n % FW_STAGES, ((n - FW_STAGES) / FW_STAGES) & 1);
            issue(i);
        }
    fw_stage_q<Sh::q_rows, THREADS>(q, Qs, q0, nq, hq, h, d);
    fence_proxy_async();  // Q was written by the threads; wgmma reads it through the async proxy
    __syncthreads();
    // This warpgroup's 64 rows of Q: row blocks 8 (warp / 4)...
    const half* q_wg = Qs + (warp / 4) * 8 * (FW_DP / 8) * 64;

#pragma unroll
    for (int i = 0; i < NO * 4; ++i) o[i] = 0.0f;
    m_run[0] = m_run[1] = NEG_INF;
    float l_unused[2];
    const int visible[2] = {kv_len, kv_len};
    for (int it = 0; it < count; ++it) {
        const int n = n0 + it;
        // Tile it + FW_STAGES - 2 into the buffers of slot n - 2, once every warp is done with
        // them.
        const int next = it + FW_STAGES - 2;
        if (threadIdx.x == 0 && next < count) {
            if (n >= 2) mbar_wait(empty + (n - 2) % FW_STAGES, ((n - 2) / FW_STAGES) & 1);
            issue(next);
        }
        mbar_wait(full + n % FW_STAGES, (n / FW_STAGES) & 1);

        // S (64 x FW_BK a warpgroup) = Q Kᵀ.
        float s[NS * 4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
            WgmmaSS<FW_BK>::run(s, wg_desc(q_wg + kk * 128, 128, FW_DP * 16),
                                wg_desc(k_buf(n) + kk * 128, 128, FW_DP * 16), kk > 0);
        wg_commit();
        wg_wait<0>();
        wg_hold(s);

        float corr[2];
        unsigned p[FW_BK / 16][4];
        tile_softmax<NS, true, false>(s, (first + it) * FW_BK, visible, t, m_run, l_unused, corr,
                                      p);
        // Lazy rescaling leaves corr at 1 in most tiles: skip the multiplies where a warp's are.
        if (__any_sync(0xffffffff, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
            for (int c = 0; c < NO; ++c) {
                o[4 * c + 0] *= corr[0];
                o[4 * c + 1] *= corr[0];
                o[4 * c + 2] *= corr[1];
                o[4 * c + 3] *= corr[1];
            }
        }

        // O (64 x FW_DV a warpgroup) += P (64 x FW_BK) V (FW_BK x FW_DV).
        wg_hold(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < FW_BK / 16; ++kk)
            WgmmaRS<FW_DV>::run<true>(o, p[kk], wg_desc(v_buf(n) + kk * 128, 128, FW_BK * 16));
        wg_commit();
        wg_wait<0>();
        wg_hold(o);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + n % FW_STAGES);
    }
}

// Queries (of nq; q f16 [nq, hq, d] as rope_qkv_pack_tiled scaled it, d <= FW_ONES) over all
// kv_len keys of their KV head, tiled (TiledKvDst); out [nq, hq * d], f32 or (rounded, for the
// GEMM after it) f16. Bidirectional (the ViT's attention).
//
// Blocks are 256 queries of a head (block b: head b / qblocks, queries (b % qblocks) * 256..),
// one CTA an SM. A block a CTA leaves SMs idle in the last wave: 896x896 is 16 heads x 13
// blocks = 208 blocks on 132 SMs, two waves of which the second is 58% full (1344x1344: 448
// blocks, the fourth wave 39%; 448x448's 64 blocks fill half the SMs). So the first `whole`
// blocks (the full waves) take a CTA each, and the key tiles of the rest, block by block, are
// spread evenly over the other CTAs (FwRest), at most two blocks' tiles each as the host sizes
// it. A block whose tiles one CTA runs is written as it ends; one shared by several is merged
// by the last of them to finish (a counter a split block, `counters`, left at 0 again) from the
// others' shares (`partials`).
template <typename Out>
__device__ __forceinline__ void flash_attention_wgmma(const half* __restrict__ q,
                                                      const half* __restrict__ kt,
                                                      const half* __restrict__ vt,
                                                      Out* __restrict__ out, int nq, int hq,
                                                      int hkv, int d, int kv_len, int whole,
                                                      unsigned* __restrict__ counters,
                                                      FwPartials partials) {
    using Sh = FwShared;
    extern __shared__ __align__(128) unsigned char fw_smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(fw_smem + Sh::bars);
    unsigned long long* empty = full + FW_STAGES;
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    const int tiles = (kv_len + FW_BK - 1) / FW_BK;
    const int qblocks = (nq + Sh::q_rows - 1) / Sh::q_rows;
    const int group = hq / hkv;

    if (threadIdx.x == 0) {
        for (int i = 0; i < FW_STAGES; ++i) {
            mbar_init(full + i, 1);
            mbar_init(empty + i, FW_WARPGROUPS * 4);
        }
    }
    __syncthreads();
    float o[FW_DV / 2], m_run[2];
    if ((int)blockIdx.x < whole) {
        const int b = blockIdx.x, h = b / qblocks, q0 = b % qblocks * Sh::q_rows;
        fw_attend(q, kt, vt, nq, hq, d, kv_len, q0, h, h / group, 0, tiles, 0, o, m_run);
        fw_store(o, out, q0 + warp * 16 + g, nq, hq, h, d);
        return;
    }

    // The rest: this CTA's units, in the first split block's tiles and maybe the next one's.
    const FwRest rest{(int)gridDim.x - whole, (qblocks * hq - whole) * tiles, tiles};
    const int r = blockIdx.x - whole, u0 = rest.first_unit(r), u1 = rest.first_unit(r + 1);
    int* merges = reinterpret_cast<int*>(fw_smem + Sh::flag);
    for (int b = u0 / tiles, n0 = 0; b * tiles < u1; ++b) {
        const int first = max(u0 - b * tiles, 0), end = min(u1 - b * tiles, tiles);
        const int h = (whole + b) / qblocks, q0 = (whole + b) % qblocks * Sh::q_rows;
        if (n0 > 0) __syncthreads();  // every warpgroup done with the last block's queries
        fw_attend(q, kt, vt, nq, hq, d, kv_len, q0, h, h / group, first, end - first, n0, o,
                  m_run);
        n0 += end - first;
        const int r_lo = rest.cta_of(b * tiles), r_hi = rest.cta_of((b + 1) * tiles - 1);
        if (r_lo == r_hi || fw_merge(o, m_run, rest, r, b, r_lo, r_hi, counters, partials, merges))
            fw_store(o, out, q0 + warp * 16 + g, nq, hq, h, d);
    }
}

extern "C" __global__ void __launch_bounds__(FW_WARPGROUPS * 128, 1) flash_attention_wgmma_d80(
    const half* __restrict__ q, const half* __restrict__ kt, const half* __restrict__ vt,
    float* __restrict__ out, int nq, int hq, int hkv, int d, int kv_len, int whole,
    unsigned* __restrict__ counters, float4* __restrict__ partials) {
    flash_attention_wgmma(q, kt, vt, out, nq, hq, hkv, d, kv_len, whole, counters,
                          FwPartials{partials});
}

extern "C" __global__ void __launch_bounds__(FW_WARPGROUPS * 128, 1)
    flash_attention_wgmma_d80_f16out(const half* __restrict__ q, const half* __restrict__ kt,
                                     const half* __restrict__ vt, half* __restrict__ out, int nq,
                                     int hq, int hkv, int d, int kv_len, int whole,
                                     unsigned* __restrict__ counters,
                                     float4* __restrict__ partials) {
    flash_attention_wgmma(q, kt, vt, out, nq, hq, hkv, d, kv_len, whole, counters,
                          FwPartials{partials});
}

// ---------------------------------------------------------------------------------------------
// Prefill chunks over the paged f16 cache on wgmma, head dim 128 (every Qwen3 text decoder's):
// paged_flash_attention_d128 (attention_f16.cu, mma.sync) with the same arguments and result,
// for sm_90a. Why: ncu put that kernel at 184 TFLOP/s (747 us a layer at 4096 tokens, 28% of
// FP8 prefill), latency-bound, with every K and V fragment passing through registers; here the
// tensor cores read Q and K (S = Q Kᵀ) and V (O += P V) from shared memory, P from S's registers.
//
// A block: PW_WG warpgroups of 64 query rows of one head (the block's queries the heaviest first:
// causal blocks late in the chunk see the most keys), tiles of PW_BK keys in PW_STAGES buffers.
// Keys come through the block table, so they cannot be bulk-copied as whole tiles (TiledKvDst):
// each thread of the first PW_BK / 8 warps copies its one key row of a tile, four 16-byte
// chunks of K and of V, with cp.async into wgmma's 128-byte swizzled layout (pw_sw_at). A
// warp's 8 lanes of one chunk write 8 rows' chunks at 8 different bank groups (no conflict)
// and its lanes 8 apart read neighbouring chunks of a row (whole 32-byte sectors). One
// block-wide barrier a tile: the tile's copies are complete and visible to wgmma, and the
// buffers the next copy reuses are done with. Softmax as flash_attention's (tile_softmax, lazy
// rescaling, sums in registers).
//
// Measured (ncu, H200, the 8B's 4096-token prefill, a layer): 699 us against mma.sync's 743
// (757 before a tile's copies were issued after its wgmmas rather than before them), with Q, K
// and V in wgmma's no-swizzle core layout: the tensor pipe ~22% busy, two warps a scheduler,
// the most cycles stalled on long scoreboards, and 63% of shared-memory wavefronts excess
// (wgmma reading 16-byte rows of cores 128 bytes apart). The 128-byte swizzle, where a core
// matrix's 8 rows are one 1024-byte atom, took the whole 4096-token f16 prefill from 32.7k
// to 34.5k tok/s (2026-11-29, same call). Three warpgroups, 192 queries a block (three warps a
// scheduler, and each K/V tile copied serves 1.5x the rows; the first 8 warps copy a tile):
// FP8-weight prefill 45.8k -> 47.2k tok/s (same call, 2026-11-29), f16 ~1%.
// PW_WG, PW_BK and PW_STAGES are #defined by the host (kernels.rs, PAGED_FLASH_WGMMA_*), which
// sizes the block and its shared memory from them.
#define PW_D 128

struct PwShared {
    static constexpr int threads = PW_WG * 128;
    static constexpr int q_rows = 64 * PW_WG;
    static constexpr int q_tile = q_rows * PW_D;  // halves
    static constexpr int kv_tile = PW_BK * PW_D;  // halves, K or V
};
static_assert(PW_BK <= 8 * PwShared::threads / 32, "a warp's lanes stage one 8-key row block");

// Half offset of (row r, dims c8 * 8..) in a tile of ROWS rows of PW_D dims in wgmma's 128-byte
// swizzle (every tile 1024-byte aligned): two regions of 64 dims, each ROWS rows of 128 bytes,
// the 16-byte chunk c of row r at c ^ (r % 8). Q and K are read K-major (descriptor LBO 16,
// SBO 1024: 8-row atoms), V, the same layout as K, MN-major (LBO the 64-dim region, SBO 1024).
template <int ROWS>
__device__ __forceinline__ int pw_sw_at(int r, int c8) {
    return (c8 / 8) * (ROWS * 64) + r * 64 + ((c8 % 8) ^ (r % 8)) * 8;
}
__device__ __forceinline__ unsigned long long wg_desc_sw128(const void* p, unsigned lbo,
                                                            unsigned sbo) {
    return wg_desc(p, lbo, sbo) | (1ull << 62);
}

extern "C" __global__ void __launch_bounds__(PW_WG * 128, 1) paged_flash_attention_wgmma_d128(
    const float* __restrict__ q, const half* __restrict__ kc, const half* __restrict__ vc,
    const unsigned* __restrict__ seqs, const unsigned* __restrict__ blocks,
    float* __restrict__ out, int seq0, int hq, int hkv, int d, int block_size, float scale) {
    using Sh = PwShared;
    constexpr int NS = PW_BK / 8;  // 8-key column groups of S
    constexpr int NO = PW_D / 8;   // 8-dim column groups of O
    const unsigned* m = seqs + 4 * (seq0 + blockIdx.z);
    const int row0 = m[0], n = m[1], kv_len = m[2];
    const int q0 = (gridDim.x - 1 - blockIdx.x) * Sh::q_rows;
    if (q0 >= n) return;
    const PagedRows rows{blocks, m[3], block_size, hkv, PW_D};
    const int h = blockIdx.y, kvh = h / (hq / hkv), first_slot = kv_len - n;
    q += (size_t)row0 * hq * PW_D;
    out += (size_t)row0 * hq * PW_D;
    const int kv_end = min(kv_len, first_slot + min(q0 + Sh::q_rows, n));
    const int tiles = (kv_end + PW_BK - 1) / PW_BK;

    // The swizzle's 8-row atoms must start 1024-byte aligned, and dynamic shared memory is
    // promised only 16: the host asks for 1024 bytes more (paged_flash_wgmma_smem_bytes) to
    // round up into.
    extern __shared__ __align__(128) unsigned char pw_smem[];
    half* Qs = reinterpret_cast<half*>(pw_smem + ((0u - smem_addr(pw_smem)) & 1023u));
    auto k_buf = [&](int i) { return Qs + Sh::q_tile + (i % PW_STAGES) * 2 * Sh::kv_tile; };
    auto v_buf = [&](int i) { return k_buf(i) + Sh::kv_tile; };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    // Tile `it`'s key row 8 warp + lane % 8 (this thread's), chunks lane / 8 + 4u; zeros past
    // the keys. One block-table lookup a tile a thread: its run-time division costs nothing
    // beside the tile's eight copies.
    auto stage = [&](int it) {
        if (warp >= PW_BK / 8) return;  // the first PW_BK / 8 warps stage a tile
        const int r = 8 * warp + lane % 8, j = it * PW_BK + r;
        const bool in = j < kv_end;
        const size_t at = in ? rows.row(j, kvh) : 0;
#pragma unroll
        for (int u = 0; u < PW_D / 32; ++u) {
            const int c8 = lane / 8 + 4 * u;
            const int at_tile = pw_sw_at<PW_BK>(r, c8);
            copy_kv16(k_buf(it) + at_tile, v_buf(it) + at_tile, kc + at + c8 * 8, vc + at + c8 * 8,
                      in);
        }
    };
    for (int i = 0; i < PW_STAGES - 2; ++i) {
        if (i < tiles) stage(i);
        cp_async_commit();
    }

    // The block's queries as f16, scaled by 1/sqrt(d) log2 e (the softmax is exp2), zeros past
    // n: 8 dims a thread at a time, the 8 rows of a core from 8 neighbouring lanes.
    const float qscale = scale * 1.4426950408889634f;
    for (int idx = threadIdx.x; idx < Sh::q_rows * (PW_D / 8); idx += Sh::threads) {
        const int r = idx % 8 + 8 * (idx / (8 * (PW_D / 8))), c8 = idx / 8 % (PW_D / 8);
        const int i = q0 + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (i < n) {
            const float4* src = reinterpret_cast<const float4*>(q + ((size_t)i * hq + h) * PW_D + c8 * 8);
            const float4 a = src[0], b = src[1];
            v = make_uint4(pack_half2(a.x * qscale, a.y * qscale), pack_half2(a.z * qscale, a.w * qscale),
                           pack_half2(b.x * qscale, b.y * qscale), pack_half2(b.z * qscale, b.w * qscale));
        }
        *reinterpret_cast<uint4*>(Qs + pw_sw_at<Sh::q_rows>(r, c8)) = v;
    }
    // This warpgroup's 64 rows of Q.
    const half* q_wg = Qs + (warp / 4) * 64 * 64;

    float o[NO * 4], m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < NO * 4; ++i) o[i] = 0.0f;
    // The two query rows this thread holds (wgmma's accumulators: warp % 4 takes 16 of the
    // warpgroup's rows) and the keys each may see.
    const int qrow = q0 + (warp / 4) * 64 + (warp % 4) * 16 + g;
    const int visible[2] = {min(kv_len, first_slot + qrow + 1), min(kv_len, first_slot + qrow + 9)};

    // The tensor cores multiply while the softmax runs (FlashAttention-3's intra-warpgroup
    // overlap): tile it's S = Q Kᵀ and the previous tile's O += P V are issued together, and the
    // softmax of S waits only for S, running beside P V. So a tile's buffers stay in use until
    // the next tile's wait: tiles it - 1 (V) and it (K, V) are read while tile it + PW_STAGES - 2
    // is copied into tile it - 2's buffers.
    unsigned p[PW_BK / 16][4] = {};  // the previous tile's P, read by its P V while in flight
    for (int it = 0; it < tiles; ++it) {
        cp_async_wait<PW_STAGES - 3>();  // this thread's copies of tile it are done
        fence_proxy_async();               // ... and, with Q's stores, visible to wgmma
        __syncthreads();                   // everyone's; and tile it - 2's buffers are free

        // S (64 x PW_BK a warpgroup) = Q Kᵀ; then O (64 x PW_D) += P (64 x PW_BK) V (PW_BK x
        // PW_D) of tile it - 1.
        float s[NS * 4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < PW_D / 16; ++kk)
            WgmmaSS<PW_BK>::run(
                s, wg_desc_sw128(q_wg + (kk / 4) * Sh::q_rows * 64 + (kk % 4) * 16, 16, 1024),
                wg_desc_sw128(k_buf(it) + (kk / 4) * PW_BK * 64 + (kk % 4) * 16, 16, 1024), kk > 0);
        wg_commit();
        if (it > 0) {
#pragma unroll
            for (int kk = 0; kk < PW_BK / 16; ++kk)
                WgmmaRS<PW_D>::run<true>(
                    o, p[kk], wg_desc_sw128(v_buf(it - 1) + kk * 16 * 64, PW_BK * 128, 1024));
        }
        wg_commit();   // (empty for the first tile: the wait below still waits for S)
        if (it + PW_STAGES - 2 < tiles) stage(it + PW_STAGES - 2);
        cp_async_commit();
        wg_wait<1>();  // S (the older group; P V may still run)
        wg_hold(s);

        float corr[2];
        unsigned p_next[PW_BK / 16][4];
        tile_softmax<NS, true>(s, it * PW_BK, visible, t, m_run, l_run, corr, p_next);
        wg_wait<0>();  // P V: O and the P it read are free again
        wg_hold(o);
        wg_hold_u(p);
        if (__any_sync(0xffffffff, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
            for (int c = 0; c < NO; ++c) {
                o[4 * c + 0] *= corr[0];
                o[4 * c + 1] *= corr[0];
                o[4 * c + 2] *= corr[1];
                o[4 * c + 3] *= corr[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < PW_BK / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[kk][e] = p_next[kk][e];
    }
    // The last tile's P V (its buffers were kept: no copy targets them).
    if (tiles > 0) {
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < PW_BK / 16; ++kk)
            WgmmaRS<PW_D>::run<true>(
                o, p[kk], wg_desc_sw128(v_buf(tiles - 1) + kk * 16 * 64, PW_BK * 128, 1024));
        wg_commit();
        wg_wait<0>();
        wg_hold(o);
    }
    cp_async_wait<0>();  // no copy left in flight at exit (none is issued past the last tile)

#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        const int i = qrow + 8 * hrow;
        if (i >= n) continue;
        // No key at all: zeros.
        const float inv = l_run[hrow] > 0.0f ? 1.0f / l_run[hrow] : 0.0f;
        float* dst = out + ((size_t)i * hq + h) * PW_D;
#pragma unroll
        for (int c = 0; c < NO; ++c)
            *reinterpret_cast<float2*>(dst + c * 8 + 2 * t) =
                make_float2(o[4 * c + 2 * hrow] * inv, o[4 * c + 2 * hrow + 1] * inv);
    }
}
