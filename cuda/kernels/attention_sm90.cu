// Flash attention on Hopper's warpgroup MMA (wgmma), for the ViT's large images. sm_90a only:
// NVRTC compiles this file after common.cuh and attention_f16.cu (whose helpers, PackedF16Kv
// layout and stage conventions it shares) for compute_90a on an H100/H200; every other GPU
// (Jetson Orin's sm_87 included) keeps attention_f16.cu's mma.sync kernels. Same computation
// as flash_attention there: Q pre-scaled by 1/sqrt(d) log2(e), an online softmax per row in
// f32 with exp2, P rounded to f16, f32 sums. CPU twin: `attention` in cuda/src/cpu.rs.
//
// Why: with mma.sync every K and V fragment passes through registers (ldmatrix) for each
// product, and at 1344x1344 the kernel was bound by issuing those reads and its block-wide
// barriers. Here a warpgroup (4 warps) takes 64 query rows and the tensor cores read Q and K
// (S = Q Kᵀ) and V (O += P V) straight from shared memory; P comes from S's registers as in
// flash_attention. H100, 16 heads of 72, one pass of 27 layers' shapes (carry/wg harness):
// 7,056 queries (1344x1344) 0.98 -> 0.76 ms a call against the wide mma.sync kernel, 3,136
// (896x896) 0.220 -> 0.194 against flash_attention_d80; at 784 (448x448) mma.sync stays ahead
// (0.032 against 0.038), so the host takes this kernel only for calls of at least a wave of
// blocks.
//
// A block: FW_WARPGROUPS warpgroups (256 queries of one head), FW_STAGES buffers of FW_BK keys.
// Shared memory holds the operands in wgmma's no-swizzle layout: "core matrices" of 8 rows x 16
// bytes, 128 contiguous bytes each (8 threads' 16-byte copies fill the 32 banks):
//   Q and K tiles, K-major (a row's dims contiguous): core (row block rb, dim chunk c) at
//     (rb * DP/8 + c) * 128 bytes; a k-step's 16 dims are two cores 128 bytes apart (leading
//     byte offset), row blocks DP * 16 bytes apart (stride byte offset).
//   V tiles, MN-major (read transposed): core (dim chunk c, key block kb) at
//     (c * FW_BK/8 + kb) * 128 bytes: key blocks 128 bytes apart (leading), dim chunks
//     FW_BK * 16 bytes apart (stride).
// No block-wide barrier in the loop: every thread copies its share of a tile with cp.async and
// arrives on the tile's `full` mbarrier when its copies land; each warp arrives on the tile's
// `empty` mbarrier when its products are done. Tile i + FW_STAGES - 2 refills the buffers of
// tile i - 2, so warpgroups drift up to two tiles apart and one's softmax runs while another's
// products hold the tensor cores (with one barrier a tile they ran in lockstep: 0.85 ms).

#define FW_WARPGROUPS 4
#define FW_STAGES 3
#define FW_BK 80  // keys a tile (96: 2% slower, more spills; 64: 13% slower)

template <int N>
struct WgmmaSS;
template <int N>
struct WgmmaRS;

// D (64 x N, f32, the warpgroup's accumulators) = (accumulate ? D : 0) + A B, A (64 x 16) and
// B (16 x N) f16 in shared memory by descriptor, both K-major.
template <>
struct WgmmaSS<80> {
    static __device__ __forceinline__ void run(float (&d)[40], unsigned long long a,
                                               unsigned long long b, int accumulate) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n80k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
              "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
            : "l"(a), "l"(b), "r"(accumulate));
    }
};

// D (64 x N, f32) += A B: A (64 x 16, f16) in registers (mma.sync's m16n8k16 A fragment for
// each warp's 16 rows), B (16 x N, f16) in shared memory, MN-major.
template <>
struct WgmmaRS<72> {
    static __device__ __forceinline__ void run(float (&d)[36], const unsigned (&a)[4],
                                               unsigned long long b) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n72k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, {%36, %37, %38, %39}, %40, p, 1, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
};

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of accumulators across a wgmma fence or wait.
template <int N>
__device__ __forceinline__ void wg_hold(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Shared memory written through the generic proxy (cp.async, stores) made visible to wgmma's
// reads (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// A shared-memory matrix descriptor, no swizzle: start address, leading and stride byte offsets
// (each in 16-byte units).
__device__ __forceinline__ unsigned long long wg_desc(const void* p, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((smem_addr(p) & 0x3FFFF) >> 4) |
           ((unsigned long long)(lbo >> 4) << 16) | ((unsigned long long)(sbo >> 4) << 32);
}

__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
// Arrives on b once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void mbar_arrive_copies(unsigned long long* b) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(b)) : "memory");
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
// 16 bytes global -> shared, or 16 zero bytes (nothing read) when !in: every write of a tile
// goes through cp.async, which its mbarrier tracks.
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(in ? 16 : 0));
}

// Shared memory, dynamic: Q, FW_STAGES K tiles, FW_STAGES V tiles, then the full and empty
// mbarriers. Must match flash_wgmma_smem_bytes in cuda/src/cuda/kernels.rs.
template <int DP, int DV>
struct FwShared {
    static constexpr int q_rows = 64 * FW_WARPGROUPS;
    static constexpr int q_tile = q_rows * DP;  // halves
    static constexpr int k_tile = FW_BK * DP;
    static constexpr int v_tile = FW_BK * DV;
    static constexpr int bars = (q_tile + FW_STAGES * (k_tile + v_tile)) * 2;  // byte offset
    static constexpr int bytes = bars + 2 * FW_STAGES * 8;
};

// Keys kt.. (zeros past kv_end) of KV head kvh into a K and a V tile. A thread's index runs over
// the 8 rows of a core first: 8 threads fill one core, and a warp reads 64 contiguous bytes of
// each of 8 rows.
template <int DP, int DV, int THREADS>
__device__ __forceinline__ void fw_stage(const PackedF16Kv& kv, half* Ks, half* Vs, int kt,
                                         int kv_end, int kvh) {
    constexpr int KC = DP / 8, VC = DV / 8;
#pragma unroll
    for (int idx = threadIdx.x; idx < FW_BK * KC; idx += THREADS) {
        const int r8 = idx % 8, c = (idx / 8) % KC, kb = idx / (8 * KC), j = kt + kb * 8 + r8;
        const bool in = j < kv_end;
        cp_async16_or_zero(Ks + (kb * KC + c) * 64 + r8 * 8,
                           kv.k + (in ? ((size_t)j * kv.hkv + kvh) * DP + c * 8 : 0), in);
    }
#pragma unroll
    for (int idx = threadIdx.x; idx < FW_BK * VC; idx += THREADS) {
        const int r8 = idx % 8, c = (idx / 8) % VC, kb = idx / (8 * VC), j = kt + kb * 8 + r8;
        const bool in = j < kv_end;
        cp_async16_or_zero(Vs + (c * (FW_BK / 8) + kb) * 64 + r8 * 8,
                           kv.v + (in ? ((size_t)j * kv.hkv + kvh) * DP + c * 8 : 0), in);
    }
}

// The block's queries (zeros past nq, dims past d zero), scaled, as f16 in the K tile's layout.
template <int DP, int BQ, int THREADS>
__device__ __forceinline__ void fw_stage_q(const float* __restrict__ q, half* Qs, int q0, int nq,
                                           int hq, int h, int d, float qscale) {
    constexpr int KC = DP / 8, C4 = DP / 4;
    for (int idx = threadIdx.x; idx < BQ * C4; idx += THREADS) {
        const int r = idx / C4, c = (idx % C4) * 4, i = q0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < nq && c < d) {
            const float* src = q + ((size_t)i * hq + h) * d;
            if (d % 4 == 0) {
                v = *reinterpret_cast<const float4*>(src + c);
            } else {
                v.x = src[c];
                v.y = c + 1 < d ? src[c + 1] : 0.0f;
                v.z = c + 2 < d ? src[c + 2] : 0.0f;
                v.w = c + 3 < d ? src[c + 3] : 0.0f;
            }
        }
        uint2 packed = make_uint2(pack_half2(v.x * qscale, v.y * qscale),
                                  pack_half2(v.z * qscale, v.w * qscale));
        *reinterpret_cast<uint2*>(Qs + ((r / 8) * KC + c / 8) * 64 + (r % 8) * 8 + c % 8) = packed;
    }
}

// Queries q0.. (up to 256, of nq) of head blockIdx.y over PackedF16Kv keys and values;
// arguments as flash_attention's. DP: Q Kᵀ's dims (d padded to 16, its k-step); DV: the
// output's (d rounded up to 8, wgmma's N step).
template <int DP, int DV>
__device__ void flash_attention_wgmma(const float* __restrict__ q, const PackedF16Kv& kvs,
                                      float* __restrict__ out, int q0, int nq, int hq, int hkv, int d,
                                      int kv_len, int causal, int first_slot, float scale) {
    using Sh = FwShared<DP, DV>;
    constexpr int THREADS = FW_WARPGROUPS * 128;
    constexpr int KD = DP / 16;   // k-steps of Q Kᵀ
    constexpr int NS = FW_BK / 8; // 8-key column groups of S
    constexpr int NO = DV / 8;    // 8-dim column groups of O
    extern __shared__ __align__(128) unsigned char fa_smem[];
    half* Qs = reinterpret_cast<half*>(fa_smem);
    half* kv0 = Qs + Sh::q_tile;
    unsigned long long* full = reinterpret_cast<unsigned long long*>(fa_smem + Sh::bars);
    unsigned long long* empty = full + FW_STAGES;
    auto k_buf = [&](int i) { return kv0 + (i % FW_STAGES) * Sh::k_tile; };
    auto v_buf = [&](int i) { return kv0 + FW_STAGES * Sh::k_tile + (i % FW_STAGES) * Sh::v_tile; };

    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int kvh = h / (hq / hkv);
    const float qscale = scale * 1.4426950408889634f;
    const int last_q = min(q0 + Sh::q_rows, nq) - 1;
    const int kv_end = causal ? min(kv_len, first_slot + last_q + 1) : kv_len;
    const int tiles = (kv_end + FW_BK - 1) / FW_BK;

    if (threadIdx.x == 0) {
        for (int i = 0; i < FW_STAGES; ++i) {
            mbar_init(full + i, THREADS);
            mbar_init(empty + i, FW_WARPGROUPS * 4);
        }
    }
    __syncthreads();
    auto issue = [&](int i) {
        fw_stage<DP, DV, THREADS>(kvs, k_buf(i), v_buf(i), i * FW_BK, kv_end, kvh);
        mbar_arrive_copies(full + i % FW_STAGES);
    };
    for (int i = 0; i < FW_STAGES - 2 && i < tiles; ++i) issue(i);
    fw_stage_q<DP, Sh::q_rows, THREADS>(q, Qs, q0, nq, hq, h, d, qscale);
    fence_proxy_async();
    __syncthreads();
    // This warpgroup's 64 rows of Q: row blocks 8 (warp / 4)...
    const half* q_wg = Qs + (warp / 4) * 8 * (DP / 8) * 64;

    float o[NO * 4];
#pragma unroll
    for (int i = 0; i < NO * 4; ++i) o[i] = 0.0f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    // This thread's first row, and the slot of the last key it sees when causal (the second
    // row, 8 on, sees 8 more).
    const int row0 = q0 + warp * 16 + g;
    const int row_last = first_slot + row0;
    for (int it = 0; it < tiles; ++it) {
        // Tile it + FW_STAGES - 2 into the buffers of tile it - 2, once every warp is done
        // with them.
        const int next = it + FW_STAGES - 2;
        if (next < tiles) {
            if (it >= 2) mbar_wait(empty + (it - 2) % FW_STAGES, ((it - 2) / FW_STAGES) & 1);
            issue(next);
        }
        mbar_wait(full + it % FW_STAGES, (it / FW_STAGES) & 1);
        fence_proxy_async();

        // S (64 x FW_BK a warpgroup) = Q Kᵀ.
        float s[NS * 4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
            WgmmaSS<FW_BK>::run(s, wg_desc(q_wg + kk * 128, 128, DP * 16),
                                wg_desc(k_buf(it) + kk * 128, 128, DP * 16), kk > 0);
        wg_commit();
        wg_wait_all();
        wg_hold(s);

        float corr[2];
        unsigned p[FW_BK / 16][4];
        // The keys this thread's two rows may see (the second row is 8 slots on).
        const int visible[2] = {causal ? min(kv_len, row_last + 1) : kv_len,
                                causal ? min(kv_len, row_last + 9) : kv_len};
        tile_softmax<NS>(s, it * FW_BK, visible, t, m_run, l_run, corr, p);
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[4 * n + 0] *= corr[0];
            o[4 * n + 1] *= corr[0];
            o[4 * n + 2] *= corr[1];
            o[4 * n + 3] *= corr[1];
        }

        // O (64 x DV a warpgroup) += P (64 x FW_BK) V (FW_BK x DV).
        wg_hold(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < FW_BK / 16; ++kk)
            WgmmaRS<DV>::run(o, p[kk], wg_desc(v_buf(it) + kk * 128, 128, FW_BK * 16));
        wg_commit();
        wg_wait_all();
        wg_hold(o);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + it % FW_STAGES);
    }

#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        int i = row0 + 8 * hrow;
        if (i >= nq) continue;
        // No key at all (kv_len 0): zeros.
        float inv = l_run[hrow] > 0.0f ? 1.0f / l_run[hrow] : 0.0f;
        float* dst = out + ((size_t)i * hq + h) * d;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            int c = n * 8 + 2 * t;
            if (c < d) dst[c] = o[4 * n + 2 * hrow] * inv;
            if (c + 1 < d) dst[c + 1] = o[4 * n + 2 * hrow + 1] * inv;
        }
    }
}

// Head dims 65..72 (the ViT's 72), packed to 80. At 128 registers (four warpgroups a block,
// one block an SM) ptxas spills ~20 bytes a thread; measured, it still beats three warpgroups
// at 166 registers and 64-key tiles at 126 (no spills).
extern "C" __global__ void __launch_bounds__(FW_WARPGROUPS * 128, 1) flash_attention_wgmma_d80(
    const float* __restrict__ q, const half* __restrict__ k, const half* __restrict__ v,
    float* __restrict__ out, int nq, int hq, int hkv, int d, int kv_len, int causal,
    int first_slot, float scale) {
    PackedF16Kv kvs{k, v, hkv};
    flash_attention_wgmma<80, 72>(q, kvs, out, blockIdx.x * FwShared<80, 72>::q_rows, nq, hq, hkv,
                                  d, kv_len, causal, first_slot, scale);
}
