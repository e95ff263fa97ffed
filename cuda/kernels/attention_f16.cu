// Flash attention for prefill and the ViT (seeds 001 and 003, in the FlashAttention-2 form):
// tiled, online softmax, tensor cores (mma.sync m16n8k16: f16 inputs, f32 accumulation), causal
// or bidirectional, GQA. Scores, probabilities and the output stay in registers; only Q, K and
// V tiles pass through shared memory. CPU twin: `attention` / `paged_attention` in
// cuda/src/cpu.rs (through the Backend ops). Runs on sm_80 and later (Jetson Orin's sm_87, H100).
//
// A block takes 64 queries of one head, each of its 4 warps 16 query rows (the wide kernels,
// for large ViT images: 128 and 32, see FaShared). Per tile of 64 keys: S = Q Kᵀ (16 x 64 scores per m-tile of
// 16 rows, 32 floats per thread), masked, the online softmax per row (each thread holds two
// rows' values; a row's max and sum are reduced over the four threads that share it), P
// rounded to f16 straight from S's registers into the A operand of O += P V. Q is pre-scaled by 1/sqrt(d) * log2(e) so the exponentials are exp2. Head dims are
// padded with zeros to DP, a multiple of 16 (the ViT's 72 to 80).
//
// Layouts follow the ops interface: q [nq, hq, d], out [nq, hq * d], both f32. Keys and values
// come through a loader: f16 [kv_len, hkv, DP] packed once per call from the f32 [slots, hkv,
// d] of `attention` (pack_kv_f16 below) or from the ViT's fused projection with RoPE
// (rope_qkv_pack_f16, `rope_attention_segments`), or the paged f16 KV cache through a
// sequence's block list (`paged_attention`: prefill chunks of an engine step; see paged_f16.cu
// for the layout). Either copies 16 bytes at a time with cp.async into one of two K/V buffers
// while the warps compute on the other. Query i sits at key position first_slot + i; causal: it
// sees keys up to that; otherwise keys < kv_len.

#include <cuda_fp16.h>

#define FA_WARPS 4
#define FA_BK 64  // keys per tile
// A warp takes MT m-tiles of 16 query rows (a block FA_WARPS * 16 * MT queries). With two
// (flash_attention_wide_d*), every K and V fragment a warp reads from shared memory serves both,
// halving those reads per product, which bound the ViT's attention at 1344x1344; but the
// scores and outputs take twice the registers (two blocks an SM, not three) and a call has
// half the blocks, so the host takes them only for calls of many query tiles.

// Shared memory, dynamic (the host opts in above 48 KB): a Q tile of the block's queries and two
// K and V tiles (double buffered) of 64 rows, each row DP + 8 halves (the 16-byte pad keeps
// ldmatrix's eight row reads in distinct banks). Must match flash_smem_bytes in
// cuda/src/cuda/kernels.rs: (64 MT + 256) * 2 * (DP + 8) bytes.
template <int DP, int MT = 1>
struct FaShared {
    static constexpr int row = DP + 8;                  // halves per row
    static constexpr int tile = 64 * row;               // halves per K or V tile
    static constexpr int q_rows = FA_WARPS * 16 * MT;   // queries per block
    static constexpr int bytes = (q_rows + 4 * 64) * row * 2;
};

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned r[2], const half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const half* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// 2^x with the hardware's approximation (2 ulp; flushes denormal results to 0): the softmax's
// exponents are <= 0 and its weights need no more. exp2f without fast math wraps the same
// instruction in range handling that the ALU pipe, the kernel's busiest, pays for every score.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// 16 bytes of a key's K and V from global k / v into shared ks / vs (asynchronously), or zeros
// for a key past the end (P is 0 there, and 0 times what an unwritten buffer holds could be
// NaN).
__device__ __forceinline__ void copy_kv16(half* ks, half* vs, const half* k, const half* v,
                                          bool in) {
    if (in) {
        cp_async16(ks, k);
        cp_async16(vs, v);
    } else {
        *reinterpret_cast<uint4*>(ks) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(vs) = make_uint4(0, 0, 0, 0);
    }
}

// Row r of a K/V tile (padded rows of FaShared<DP>::row halves), dims c..c + 7.
template <int DP>
__device__ __forceinline__ void stage_chunk(half* Ks, half* Vs, int r, int c, const half* k,
                                            const half* v, bool in) {
    constexpr int R = FaShared<DP>::row;
    copy_kv16(Ks + r * R + c, Vs + r * R + c, k, v, in);
}

// Keys and values packed by pack_kv_f16 or rope_qkv_pack_f16: f16 [kv_len, hkv, DP], head
// dims past d zero (row-major like the rows they came from, so a run of rows is a sub-range).
struct PackedF16Kv {
    const half* __restrict__ k;
    const half* __restrict__ v;
    int hkv;

    template <int DP>
    __device__ void stage(half* Ks, half* Vs, int kt, int kv_end, int kvh) const {
        constexpr int V8 = DP / 8;
#pragma unroll
        for (int idx = threadIdx.x; idx < FA_BK * V8; idx += FA_WARPS * WARP) {
            int r = idx / V8, c = (idx % V8) * 8, j = kt + r;
            size_t at = j < kv_end ? ((size_t)j * hkv + kvh) * DP + c : 0;
            stage_chunk<DP>(Ks, Vs, r, c, k + at, v + at, j < kv_end);
        }
    }
};

// The ViT's keys and values, f32 [kv_len, hkv, d], as PackedF16Kv's layout: one block per key.
extern "C" __global__ void pack_kv_f16(const float* __restrict__ k, const float* __restrict__ v,
                                       half* __restrict__ kp, half* __restrict__ vp, int hkv,
                                       int d, int dp, int kv_len) {
    const int j = blockIdx.x;
    for (int t = threadIdx.x; t < hkv * dp; t += blockDim.x) {
        int h = t / dp, c = t % dp;
        size_t src = ((size_t)j * hkv + h) * d + c, dst = ((size_t)j * hkv + h) * dp + c;
        kp[dst] = __float2half_rn(c < d ? k[src] : 0.0f);
        vp[dst] = __float2half_rn(c < d ? v[src] : 0.0f);
    }
}

// The ViT's fused projection [n, 3, heads, d] (q, k, v side by side in a row, bias added) into
// what flash_attention reads, in one pass instead of two RoPE passes and a pack: q rotated,
// f32 [n, heads, d]; k rotated and v as PackedF16Kv (f16 [n, heads, dp], dims past d zero).
// Rotate-half RoPE with cos/sin [n, d], the expressions of rope_f32. One block per row. The
// rows come as f32 (rope_qkv_pack_f16: `rope_attention_segments`) or as the q/k/v GEMM's f16
// output (rope_qkv16_pack_f16: `layer_norm_rope_attention`, half the bytes to read).
//
// A thread takes V neighbouring pairs (i, i + d/2) of a head: V = 2 where d/2 is even (the
// ViT's 72), else 1, so that each value is read and written two at a time; elements stay aligned
// because rows, heads and i are even then. (V = 4 measured slower on the H100: the wgmma
// kernel's pack in attention_sm90.cu has a faster way for it.) load_n and store_n also move 4.
template <int V>
__device__ __forceinline__ void load_n(const float* p, float v[V]) {
    if constexpr (V == 4) {
        const float4 x = *reinterpret_cast<const float4*>(p);
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    } else if constexpr (V == 2) {
        const float2 x = *reinterpret_cast<const float2*>(p);
        v[0] = x.x;
        v[1] = x.y;
    } else {
        v[0] = *p;
    }
}
template <int V>
__device__ __forceinline__ void load_n(const half* p, float v[V]) {
    if constexpr (V == 4) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&x.x));
        const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&x.y));
        v[0] = lo.x;
        v[1] = lo.y;
        v[2] = hi.x;
        v[3] = hi.y;
    } else if constexpr (V == 2) {
        const float2 x = __half22float2(*reinterpret_cast<const __half2*>(p));
        v[0] = x.x;
        v[1] = x.y;
    } else {
        v[0] = __half2float(*p);
    }
}

template <int V>
__device__ __forceinline__ void store_n(float* p, const float v[V]) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (V == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    } else {
        *p = v[0];
    }
}
template <int V>
__device__ __forceinline__ void store_n(half* p, const float v[V]) {
    if constexpr (V == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]));
    } else if constexpr (V == 2) {
        *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v[0], v[1]);
    } else {
        *p = __float2half_rn(v[0]);
    }
}

// Where rope_qkv_pack puts keys and values: PackedF16Kv's rows (f16 [n, heads, dp]), dims past
// d zero. attention_sm90.cu has a second layout, the wgmma kernel's tiles.
struct RowsKvDst {
    half* __restrict__ k;
    half* __restrict__ v;
    int dp;
    __device__ size_t k_at(int t, int heads, int h, int i) const {
        return ((size_t)t * heads + h) * dp + i;
    }
    __device__ size_t v_at(int t, int heads, int h, int i) const { return k_at(t, heads, h, i); }
    // Row t's dims d..dp of every head: zeros.
    __device__ void pad(int t, int heads, int d, int dp) const {
        const int n = dp - d;
        for (int p = threadIdx.x; p < heads * n; p += blockDim.x) {
            const size_t at = k_at(t, heads, p / n, d + p % n);
            k[at] = v[at] = __float2half_rn(0.0f);
        }
    }
};

template <int V, typename In, typename Q, typename Dst>
__device__ __forceinline__ void rope_qkv_pack_row(const In* __restrict__ qkv,
                                                  const float* __restrict__ cos_t,
                                                  const float* __restrict__ sin_t,
                                                  Q* __restrict__ q, float q_scale, const Dst& kv,
                                                  int heads, int d, int dp) {
    const int t = blockIdx.x, hd = d / 2, w = heads * d, per_head = hd / V;
    const In* row = qkv + (size_t)t * 3 * w;
    const float* c = cos_t + (size_t)t * d;
    const float* s = sin_t + (size_t)t * d;
    for (int p = threadIdx.x; p < heads * per_head; p += blockDim.x) {
        const int h = p / per_head, i = (p % per_head) * V, a = h * d + i, b = a + hd;
        float c1[V], s1[V], c2[V], s2[V], q1[V], q2[V], k1[V], k2[V], v1[V], v2[V];
        load_n<V>(c + i, c1);
        load_n<V>(s + i, s1);
        load_n<V>(c + i + hd, c2);
        load_n<V>(s + i + hd, s2);
        load_n<V>(row + a, q1);
        load_n<V>(row + b, q2);
        load_n<V>(row + w + a, k1);
        load_n<V>(row + w + b, k2);
        load_n<V>(row + 2 * w + a, v1);
        load_n<V>(row + 2 * w + b, v2);
        float qa[V], qb[V], ka[V], kb[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            qa[j] = (q1[j] * c1[j] - q2[j] * s1[j]) * q_scale;
            qb[j] = (q2[j] * c2[j] + q1[j] * s2[j]) * q_scale;
            ka[j] = k1[j] * c1[j] - k2[j] * s1[j];
            kb[j] = k2[j] * c2[j] + k1[j] * s2[j];
        }
        store_n<V>(q + (size_t)t * w + a, qa);
        store_n<V>(q + (size_t)t * w + b, qb);
        // A pair's two dims are neighbours in either layout (i is even when V = 2).
        store_n<V>(kv.k + kv.k_at(t, heads, h, i), ka);
        store_n<V>(kv.k + kv.k_at(t, heads, h, i + hd), kb);
        store_n<V>(kv.v + kv.v_at(t, heads, h, i), v1);
        store_n<V>(kv.v + kv.v_at(t, heads, h, i + hd), v2);
    }
    kv.pad(t, heads, d, dp);
}

template <typename In, typename Q, typename Dst>
__device__ __forceinline__ void rope_qkv_pack(const In* __restrict__ qkv,
                                              const float* __restrict__ cos_t,
                                              const float* __restrict__ sin_t, Q* __restrict__ q,
                                              float q_scale, const Dst& kv, int heads, int d,
                                              int dp) {
    if ((d / 2) % 2 == 0) {
        rope_qkv_pack_row<2>(qkv, cos_t, sin_t, q, q_scale, kv, heads, d, dp);
    } else {
        rope_qkv_pack_row<1>(qkv, cos_t, sin_t, q, q_scale, kv, heads, d, dp);
    }
}

extern "C" __global__ void rope_qkv_pack_f16(const float* __restrict__ qkv,
                                             const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t,
                                             float* __restrict__ q, half* __restrict__ kp,
                                             half* __restrict__ vp, int heads, int d, int dp) {
    rope_qkv_pack(qkv, cos_t, sin_t, q, 1.0f, RowsKvDst{kp, vp, dp}, heads, d, dp);
}

extern "C" __global__ void rope_qkv16_pack_f16(const half* __restrict__ qkv,
                                               const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t,
                                               float* __restrict__ q, half* __restrict__ kp,
                                               half* __restrict__ vp, int heads, int d, int dp) {
    rope_qkv_pack(qkv, cos_t, sin_t, q, 1.0f, RowsKvDst{kp, vp, dp}, heads, d, dp);
}

// Where key j of one sequence sits in a paged cache (paged_f16.cu's layout): its block table
// from `off`, blocks of block_size slots, rows [slot, hkv, d].
struct PagedRows {
    const unsigned* __restrict__ blocks;
    unsigned off;
    int block_size, hkv, d;

    // Offset of key j's row of KV head kvh. BS: the block size if known when compiled, else 0
    // (block_size, divided at run time).
    template <int BS = 0>
    __device__ __forceinline__ size_t row(int j, int kvh) const {
        const unsigned bs = BS > 0 ? BS : block_size;
        unsigned slot = __ldg(blocks + off + j / bs) * bs + (unsigned)j % bs;
        return ((size_t)slot * hkv + kvh) * d;
    }
};

// A tile's rows of DP elements (d == DP), eight (c .. c + 7 of tile row r) a call of
// stage_row(r, c, in, at): `at` is key kt + r's offset, or 0 for a key past the end (in
// false). Unrolled, so that every block-table read of the tile is out at once (one after
// another, each copy waited for its row's entry). The engine's block size is compiled in: a
// tile's 8 rows a thread, each divided by a run-time block size, cost the 8B model's prefill
// of 4096 tokens 5% (H200: 134.5 -> 127.8 ms with it).
template <int DP, int BS, typename F>
__device__ __forceinline__ void stage_paged_rows_bs(const PagedRows& p, int kt, int kv_end,
                                                    int kvh, F& stage_row) {
    constexpr int V8 = DP / 8;
#pragma unroll
    for (int idx = threadIdx.x; idx < FA_BK * V8; idx += FA_WARPS * WARP) {
        int r = idx / V8, c = (idx % V8) * 8, j = kt + r;
        stage_row(r, c, j < kv_end, j < kv_end ? p.row<BS>(j, kvh) + c : 0);
    }
}
template <int DP, typename F>
__device__ __forceinline__ void stage_paged_rows(const PagedRows& p, int kt, int kv_end, int kvh,
                                                 F stage_row) {
    if (p.block_size == 16)
        stage_paged_rows_bs<DP, 16>(p, kt, kv_end, kvh, stage_row);
    else
        stage_paged_rows_bs<DP, 0>(p, kt, kv_end, kvh, stage_row);
}

// Keys and values of one sequence in an FP8 paged cache (--kv-cache-dtype fp8, paged_f16.cu's
// layout of e4m3 bytes): each row's bytes loaded (8 at a time when rows are DP bytes, else one
// by one) and written to the f16 tiles as their e4m3 values, exactly (f8_pair, times 2^8: at
// most 448); the caller folds the scales into q and the output. Loaded through registers, not
// cp.async: the copy into the next tile's buffers waits for its loads before this tile's math.
struct PagedF8Kv {
    const unsigned char* __restrict__ k;
    const unsigned char* __restrict__ v;
    PagedRows rows;

    // Eight e4m3 bytes as eight halves (their values).
    static __device__ __forceinline__ uint4 halves8(uint2 b) {
        const __half2 unit = __float2half2_rn(256.0f);
        unsigned h[4];
        const unsigned w[2] = {b.x, b.y};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __half2 p = __hmul2(f8_pair(__byte_perm(w[i / 2], 0, i % 2 ? 0x3424 : 0x1404)), unit);
            h[i] = *reinterpret_cast<unsigned*>(&p);
        }
        return make_uint4(h[0], h[1], h[2], h[3]);
    }

    template <int DP>
    __device__ void stage(half* Ks, half* Vs, int kt, int kv_end, int kvh) const {
        constexpr int R = FaShared<DP>::row;
        if (rows.d == DP) {
            stage_paged_rows<DP>(rows, kt, kv_end, kvh, [&](int r, int c, bool in, size_t at) {
                uint4 kh = make_uint4(0, 0, 0, 0), vh = kh;
                if (in) {
                    kh = halves8(__ldg(reinterpret_cast<const uint2*>(k + at)));
                    vh = halves8(__ldg(reinterpret_cast<const uint2*>(v + at)));
                }
                *reinterpret_cast<uint4*>(Ks + r * R + c) = kh;
                *reinterpret_cast<uint4*>(Vs + r * R + c) = vh;
            });
            return;
        }
        const __half unit = __float2half_rn(256.0f);
        for (int idx = threadIdx.x; idx < FA_BK * DP; idx += blockDim.x) {
            int r = idx / DP, c = idx % DP, j = kt + r;
            bool in = j < kv_end && c < rows.d;
            size_t at = in ? rows.row(j, kvh) + c : 0;
            Ks[r * R + c] = in ? __hmul(__low2half(f8_pair((unsigned)k[at] << 8)), unit) : __float2half_rn(0.0f);
            Vs[r * R + c] = in ? __hmul(__low2half(f8_pair((unsigned)v[at] << 8)), unit) : __float2half_rn(0.0f);
        }
    }
};

// Keys and values of one sequence in the paged f16 cache (paged_f16.cu's layout): already
// f16, copied 16 bytes at a time when rows are DP halves (other head dims: element by element).
struct PagedF16Kv {
    const half* __restrict__ k;
    const half* __restrict__ v;
    PagedRows rows;

    template <int DP>
    __device__ void stage(half* Ks, half* Vs, int kt, int kv_end, int kvh) const {
        constexpr int R = FaShared<DP>::row;
        if (rows.d == DP) {
            stage_paged_rows<DP>(rows, kt, kv_end, kvh, [&](int r, int c, bool in, size_t at) {
                stage_chunk<DP>(Ks, Vs, r, c, k + at, v + at, in);
            });
            return;
        }
        for (int idx = threadIdx.x; idx < FA_BK * DP; idx += blockDim.x) {
            int r = idx / DP, c = idx % DP, j = kt + r;
            bool in = j < kv_end && c < rows.d;
            size_t at = in ? rows.row(j, kvh) + c : 0;
            Ks[r * R + c] = in ? k[at] : __float2half_rn(0.0f);
            Vs[r * R + c] = in ? v[at] : __float2half_rn(0.0f);
        }
    }
};

// The block's query tile into shared memory as f16, scaled: rows q0.. (zeros past nq) of head
// h, dims past d zero. With d % 4 == 0 (every model's) each thread's float4 loads are all
// issued before the first is used, where a scalar loop waited for one load at a time (64 round
// trips a thread for d 128). A short prompt's attention is latency: ncu on a 256-token prefill
// found 50 us a layer with one warp a scheduler and none eligible 91% of cycles. With this and
// the unrolled K/V staging, the H100's 8B prefill of 256 tokens went 10.1-10.2 -> 9.7-9.8 ms,
// of 2048 65.0 -> 62.5-64.0 ms. (Splitting each key tile over the warps instead, 16 queries a
// block, gave four times the blocks but each walked every tile: slower, not kept.)
template <int DP, int BQ, int THREADS = FA_WARPS * WARP>
__device__ __forceinline__ void stage_q(const float* __restrict__ q, half* Qs, int q0, int nq,
                                        int hq, int h, int d, float qscale) {
    constexpr int R = FaShared<DP>::row;
    constexpr int C4 = DP / 4;                        // float4s of a padded row
    constexpr int PER = BQ * C4 / THREADS;  // float4s a thread
    static_assert(BQ * C4 % THREADS == 0, "whole float4s a thread");
    if (d % 4 != 0) {
        for (int idx = threadIdx.x; idx < BQ * DP; idx += THREADS) {
            int r = idx / DP, c = idx % DP, i = q0 + r;
            float val = (i < nq && c < d) ? q[((size_t)i * hq + h) * d + c] * qscale : 0.0f;
            Qs[r * R + c] = __float2half_rn(val);
        }
        return;
    }
    float4 v[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        int idx = threadIdx.x + u * THREADS, r = idx / C4, c = (idx % C4) * 4;
        int i = q0 + r;
        v[u] = (i < nq && c < d)
                   ? *reinterpret_cast<const float4*>(q + ((size_t)i * hq + h) * d + c)
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        int idx = threadIdx.x + u * THREADS, r = idx / C4, c = (idx % C4) * 4;
        uint2 packed = make_uint2(pack_half2(v[u].x * qscale, v[u].y * qscale),
                                  pack_half2(v[u].z * qscale, v[u].w * qscale));
        *reinterpret_cast<uint2*>(Qs + r * R + c) = packed;  // 8-byte aligned: R, c even x4
    }
}

// One tile of scores' online softmax, for the two rows of each 16-row m-tile this thread holds
// (mma.sync's C layout: s[4n + e] is row e / 2 (+8), key 8n + 2t + e % 2; wgmma's accumulators
// repeat it along N). Masks keys at or past each row's `visible` (only in a tile that reaches
// past them: the last one, or the diagonal ones when causal), updates the running max and sum,
// writes P rounded to f16 as the A fragments of P V (the C layout of key groups 2j and 2j + 1
// is the A layout of k-step j) and the factor `corr` the output must be scaled by.
// LAZY: the running max moves only when a tile's passes it by more than 8 (weights up to 2^8,
// exact after the final division), so most tiles leave corr at 1 and the output unscaled.
// !SUMS: the caller gets the row sums elsewhere (the wgmma kernel, from V's column of ones).
template <int NS, bool LAZY = false, bool SUMS = true>
__device__ __forceinline__ void tile_softmax(float (&s)[NS * 4], int kt, const int (&visible)[2],
                                             int t, float (&m_run)[2], float (&l_run)[2],
                                             float (&corr)[2], unsigned (&p)[NS / 2][4]) {
    if (kt + NS * 8 > min(visible[0], visible[1])) {
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (kt + n * 8 + 2 * t + (e % 2) >= visible[e / 2]) s[4 * n + e] = NEG_INF;
            }
        }
    }
    float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[4 * n + e]);
    }
    float m_use[2];
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
        float mx = tile_max[hrow];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        float m_new = fmaxf(m_run[hrow], mx);
        if (LAZY && m_new <= m_run[hrow] + 8.0f) m_new = m_run[hrow];
        // A row that has seen no key yet keeps max -inf: weigh nothing, rescale nothing.
        m_use[hrow] = m_new == NEG_INF ? 0.0f : m_new;
        corr[hrow] = m_new == NEG_INF || (LAZY && m_new == m_run[hrow])
                         ? 1.0f
                         : fast_exp2(m_run[hrow] - m_new);
        m_run[hrow] = m_new;
    }
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        float e4[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            e4[e] = fast_exp2(s[4 * n + e] - m_use[e / 2]);  // 2^-inf = 0 for masked keys
            if (SUMS) tile_sum[e / 2] += e4[e];
        }
        p[n / 2][(n % 2) * 2 + 0] = pack_half2(e4[0], e4[1]);
        p[n / 2][(n % 2) * 2 + 1] = pack_half2(e4[2], e4[3]);
    }
    if (SUMS) {
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            float sum = tile_sum[hrow];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            l_run[hrow] = l_run[hrow] * corr[hrow] + sum;
        }
    }
}

// Queries q0.. (up to FaShared<DP, MT>::q_rows, of nq) of head blockIdx.y; `kvs` stages their
// keys and values.
// `scale` multiplies Q K^T (an FP8 cache's key scale folded in), `v_scale` the output (an FP8
// cache's value scale; 1 otherwise).
template <int DP, int MT, typename Kv>
__device__ void flash_attention(const float* __restrict__ q, const Kv& kvs, float* __restrict__ out,
                                int q0, int nq, int hq, int hkv, int d, int kv_len, int causal,
                                int first_slot, float scale, float v_scale = 1.0f) {
    constexpr int R = FaShared<DP>::row;
    constexpr int BQ = FaShared<DP, MT>::q_rows;
    constexpr int KD = DP / 16;      // k-steps of Q Kᵀ
    constexpr int ND = DP / 8;       // n-tiles of the output
    constexpr int NK = FA_BK / 8;    // n-tiles of the scores
    extern __shared__ __align__(128) unsigned char fa_smem[];
    half* Qs = reinterpret_cast<half*>(fa_smem);
    // Then K and V of even key tiles, K and V of odd ones: tile i + 1 is copied in while tile i
    // is used.
    auto k_buf = [&](int i) { return Qs + BQ * R + 2 * (i % 2) * FaShared<DP>::tile; };
    auto v_buf = [&](int i) { return k_buf(i) + FaShared<DP>::tile; };

    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // the fragment row and column pair of this thread
    const int kvh = h / (hq / hkv);
    // exp(x) = exp2(x log2 e): fold log2 e into Q's scale.
    const float qscale = scale * 1.4426950408889634f;

    // Keys any query of this block can see.
    int last_q = min(q0 + BQ, nq) - 1;
    int kv_end = causal ? min(kv_len, first_slot + last_q + 1) : kv_len;
    const int tiles = (kv_end + FA_BK - 1) / FA_BK;
    // The first K/V tile is on its way while Q is staged.
    if (tiles > 0) kvs.template stage<DP>(k_buf(0), v_buf(0), 0, kv_end, kvh);
    cp_async_commit();

    stage_q<DP, BQ>(q, Qs, q0, nq, hq, h, d, qscale);
    __syncthreads();
    // The A fragment of m-tile mt, dims 16 kk..: one m-tile's fragments stay in registers; with
    // two (whose scores and outputs take those registers) they are read again at each key tile.
    const half* q_frag = Qs + (warp * 16 * MT + lane % 16) * R + 8 * (lane / 16);
    unsigned qf[KD][4];
    if constexpr (MT == 1) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) ldmatrix_x4(qf[kk], q_frag + kk * 16);
    }

    float o[MT][ND][4];
    float m_run[MT][2], l_run[MT][2];
    // The two query rows this thread holds in each m-tile, and the keys each may see.
    int qi[MT][2], visible[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < ND; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            m_run[mt][hrow] = NEG_INF;
            l_run[mt][hrow] = 0.0f;
            qi[mt][hrow] = q0 + (warp * MT + mt) * 16 + g + 8 * hrow;
            visible[mt][hrow] = causal ? min(kv_len, first_slot + qi[mt][hrow] + 1) : kv_len;
        }
    }

    for (int it = 0; it < tiles; ++it) {
        const int kt = it * FA_BK;
        const half* Ks = k_buf(it);
        const half* Vs = v_buf(it);
        if (it + 1 < tiles) {
            kvs.template stage<DP>(k_buf(it + 1), v_buf(it + 1), kt + FA_BK, kv_end, kvh);
            cp_async_commit();
            cp_async_wait<1>();  // this tile's copies are done; the next one's may still run
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // S (16 x 64 per m-tile) = Q Kᵀ.
        float s[MT][NK][4];
        if constexpr (MT == 1) {
#pragma unroll
            for (int n = 0; n < NK; ++n) {
                s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KD; ++kk) {
                    unsigned b[2];
                    ldmatrix_x2(b, Ks + (n * 8 + lane % 8) * R + kk * 16 + 8 * ((lane / 8) % 2));
                    mma_16816(s[0][n], qf[kk], b[0], b[1]);
                }
            }
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NK; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
            // Each K fragment read once for all m-tiles.
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], q_frag + mt * 16 * R + kk * 16);
#pragma unroll
                for (int n = 0; n < NK; ++n) {
                    unsigned b[2];
                    ldmatrix_x2(b, Ks + (n * 8 + lane % 8) * R + kk * 16 + 8 * ((lane / 8) % 2));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma_16816(s[mt][n], a[mt], b[0], b[1]);
                }
            }
        }

        unsigned pf[MT][FA_BK / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float corr[2];
            tile_softmax<NK>(reinterpret_cast<float(&)[NK * 4]>(s[mt]), kt, visible[mt], t,
                             m_run[mt], l_run[mt], corr, pf[mt]);
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                o[mt][n][0] *= corr[0];
                o[mt][n][1] *= corr[0];
                o[mt][n][2] *= corr[1];
                o[mt][n][3] *= corr[1];
            }
        }
        // O (16 x DP per m-tile) += P (16 x 64) V (64 x DP); V read transposed, two dim tiles
        // at a time, once for all m-tiles.
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < ND; n += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, Vs + (kk * 16 + lane % 16) * R + (n + lane / 16) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(o[mt][n], pf[mt][kk], b[0], b[1]);
                    mma_16816(o[mt][n + 1], pf[mt][kk], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // before the next iteration copies tile + 2 into these buffers
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            int i = qi[mt][hrow];
            if (i >= nq) continue;
            // No key at all (kv_len 0): zeros.
            float inv = l_run[mt][hrow] > 0.0f ? v_scale / l_run[mt][hrow] : 0.0f;
            float* dst = out + ((size_t)i * hq + h) * d;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                int c = n * 8 + 2 * t;
                if (c < d) dst[c] = o[mt][n][2 * hrow] * inv;
                if (c + 1 < d) dst[c + 1] = o[mt][n][2 * hrow + 1] * inv;
            }
        }
    }
}

#define FA_KERNEL(NAME, DP, MT)                                                                    \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) NAME(                          \
        const float* __restrict__ q, const half* __restrict__ k, const half* __restrict__ v,    \
        float* __restrict__ out, int nq, int hq, int hkv, int d, int kv_len, int causal,        \
        int first_slot, float scale) {                                                          \
        PackedF16Kv kvs{k, v, hkv};                                                             \
        flash_attention<DP, MT>(q, kvs, out, blockIdx.x * FaShared<DP, MT>::q_rows, nq, hq, hkv, \
                                d, kv_len, causal, first_slot, scale);                          \
    }

// The prefill chunks of an engine step: sequence seq0 + blockIdx.z, its queries from row
// seqs[4s] on (see paged_f16.cu), causal over its cached keys.
#define PAGED_FA_KERNEL(DP)                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) paged_flash_attention_d##DP(      \
        const float* __restrict__ q, const half* __restrict__ kc, const half* __restrict__ vc,  \
        const unsigned* __restrict__ seqs, const unsigned* __restrict__ blocks,                 \
        float* __restrict__ out, int seq0, int hq, int hkv, int d, int block_size, float scale) { \
        const unsigned* m = seqs + 4 * (seq0 + blockIdx.z);                                     \
        const int row0 = m[0], n = m[1], kv_len = m[2];                                         \
        if ((int)(blockIdx.x * FaShared<DP>::q_rows) >= n) return;                              \
        PagedF16Kv kvs{kc, vc, {blocks, m[3], block_size, hkv, d}};                                \
        flash_attention<DP, 1>(q + (size_t)row0 * hq * d, kvs, out + (size_t)row0 * hq * d,     \
                            blockIdx.x * FaShared<DP>::q_rows, n, hq, hkv, d, kv_len, 1,       \
                            kv_len - n, scale);                                                 \
    }

// paged_flash_attention_f8_d{DP}: the same over an FP8 cache (PagedF8Kv), its keys' scale in
// Q's and its values' in the output's.
#define PAGED_FA_F8_KERNEL(DP)                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) paged_flash_attention_f8_d##DP(   \
        const float* __restrict__ q, const unsigned char* __restrict__ kc,                       \
        const unsigned char* __restrict__ vc, const unsigned* __restrict__ seqs,                \
        const unsigned* __restrict__ blocks, float* __restrict__ out, int seq0, int hq, int hkv, \
        int d, int block_size, float scale, float k_scale, float v_scale) {                     \
        const unsigned* m = seqs + 4 * (seq0 + blockIdx.z);                                     \
        const int row0 = m[0], n = m[1], kv_len = m[2];                                         \
        if ((int)(blockIdx.x * FaShared<DP>::q_rows) >= n) return;                              \
        PagedF8Kv kvs{kc, vc, {blocks, m[3], block_size, hkv, d}};                                 \
        flash_attention<DP, 1>(q + (size_t)row0 * hq * d, kvs, out + (size_t)row0 * hq * d,     \
                               blockIdx.x * FaShared<DP>::q_rows, n, hq, hkv, d, kv_len, 1,    \
                               kv_len - n, scale * k_scale, v_scale);                          \
    }

FA_KERNEL(flash_attention_d64, 64, 1)
FA_KERNEL(flash_attention_d80, 80, 1)
FA_KERNEL(flash_attention_d96, 96, 1)
FA_KERNEL(flash_attention_d128, 128, 1)
FA_KERNEL(flash_attention_wide_d64, 64, 2)
FA_KERNEL(flash_attention_wide_d80, 80, 2)
PAGED_FA_KERNEL(64)
PAGED_FA_KERNEL(80)
PAGED_FA_KERNEL(96)
PAGED_FA_KERNEL(128)
PAGED_FA_F8_KERNEL(64)
PAGED_FA_F8_KERNEL(80)
PAGED_FA_F8_KERNEL(96)
PAGED_FA_F8_KERNEL(128)
