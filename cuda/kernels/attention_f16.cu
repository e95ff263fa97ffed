// Flash attention for prefill and the ViT (seeds 001 and 003): tiled, online softmax, tensor
// cores (WMMA, f16 inputs, f32 accumulation), causal or bidirectional, GQA. The score matrix
// never leaves shared memory. CPU twin: `attention` in cuda/src/cpu.rs (through the Backend op).
//
// A block takes 64 queries of one head; each of its 4 warps owns 16 query rows. Per tile of 64
// keys: S = Q Kᵀ on tensor cores into shared memory, the online softmax on S row by row (the
// running max and sum per row, the output rows rescaled), then O += P V on tensor cores. Head
// dims are padded with zeros to DP, a multiple of 16 (the ViT's 72 to 80).
//
// Layouts follow the ops interface: q [nq, hq, d], out [nq, hq * d]. Keys and values come
// through a loader: contiguous f32 [slots, hkv, d] (`attention`: the ViT), or the paged f16 KV
// cache through a sequence's block list (`paged_attention`: prefill chunks of an engine step;
// see paged_f16.cu for the layout). Query i sits at key position first_slot + i; causal: it
// sees keys up to that; otherwise keys < kv_len.

#include <mma.h>
#include <cuda_fp16.h>

using namespace nvcuda;

#define FA_WARPS 4
#define FA_BQ 64  // queries per block: 16 per warp
#define FA_BK 64  // keys per tile

// Shared memory for head dim padded to DP (dynamic; the host opts in above 48 KB). Must match
// flash_smem_bytes in cuda/src/cuda/mod.rs: 512 * DP + 25088 bytes.
template <int DP>
struct FaShared {
    static constexpr int kv = FA_BK * DP;              // halves, each of K and V
    static constexpr int s = FA_WARPS * 16 * FA_BK;    // floats: scores
    static constexpr int p = FA_WARPS * 16 * FA_BK;    // halves: probabilities
    static constexpr int o = FA_WARPS * 16 * DP;       // floats: output rows
    static constexpr int bytes = 2 * kv * 2 + s * 4 + p * 2 + o * 4 + 2 * FA_BQ * 4;
};

// Keys and values of contiguous f32 rows [slots, hkv, d], rounded to f16 as they are staged.
struct ContiguousF32Kv {
    const float* __restrict__ k;
    const float* __restrict__ v;
    int hkv, d;

    // K and V rows kt.. of head kvh into Ks, Vs [FA_BK, DP] (zeros past kv_end and d).
    template <int DP>
    __device__ void stage(half* Ks, half* Vs, int kt, int kv_end, int kvh) const {
        for (int idx = threadIdx.x; idx < FA_BK * DP; idx += blockDim.x) {
            int r = idx / DP, c = idx % DP, j = kt + r;
            bool in = j < kv_end && c < d;
            size_t at = ((size_t)j * hkv + kvh) * d + c;
            Ks[idx] = __float2half_rn(in ? __ldg(k + at) : 0.0f);
            Vs[idx] = __float2half_rn(in ? __ldg(v + at) : 0.0f);
        }
    }
};

// Keys and values of one sequence in the paged f16 cache (paged_f16.cu's layout): already
// f16, copied 16 bytes at a time when rows are a multiple of 8 halves.
struct PagedF16Kv {
    const half* __restrict__ k;
    const half* __restrict__ v;
    const unsigned* __restrict__ blocks;
    unsigned off;
    int block_size, hkv, d;

    __device__ size_t row(int j, int kvh) const {
        unsigned slot = blocks[off + j / block_size] * (unsigned)block_size + (unsigned)(j % block_size);
        return ((size_t)slot * hkv + kvh) * d;
    }

    template <int DP>
    __device__ void stage(half* Ks, half* Vs, int kt, int kv_end, int kvh) const {
        if (d == DP) {
            constexpr int V8 = DP / 8;
            for (int idx = threadIdx.x; idx < FA_BK * V8; idx += blockDim.x) {
                int r = idx / V8, c = (idx % V8) * 8, j = kt + r;
                uint4 kr = make_uint4(0, 0, 0, 0), vr = make_uint4(0, 0, 0, 0);
                if (j < kv_end) {
                    size_t at = row(j, kvh) + c;
                    kr = __ldg(reinterpret_cast<const uint4*>(k + at));
                    vr = __ldg(reinterpret_cast<const uint4*>(v + at));
                }
                *reinterpret_cast<uint4*>(Ks + r * DP + c) = kr;
                *reinterpret_cast<uint4*>(Vs + r * DP + c) = vr;
            }
            return;
        }
        for (int idx = threadIdx.x; idx < FA_BK * DP; idx += blockDim.x) {
            int r = idx / DP, c = idx % DP, j = kt + r;
            bool in = j < kv_end && c < d;
            size_t at = in ? row(j, kvh) + c : 0;
            Ks[idx] = in ? k[at] : __float2half_rn(0.0f);
            Vs[idx] = in ? v[at] : __float2half_rn(0.0f);
        }
    }
};

template <int DP, typename Kv>
__device__ void flash_attention(const float* __restrict__ q, const Kv& kvs, float* __restrict__ out,
                                int q0, int nq, int hq, int hkv, int d, int kv_len, int causal,
                                int first_slot, float scale) {
    extern __shared__ __align__(128) unsigned char fa_smem[];  // WMMA wants 256-bit aligned tiles
    half* Ks = reinterpret_cast<half*>(fa_smem);
    half* Vs = Ks + FaShared<DP>::kv;
    float* S = reinterpret_cast<float*>(Vs + FaShared<DP>::kv);
    half* P = reinterpret_cast<half*>(S + FaShared<DP>::s);
    float* O = reinterpret_cast<float*>(P + FaShared<DP>::p);
    float* row_max = O + FaShared<DP>::o;
    float* row_sum = row_max + FA_BQ;

    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kvh = h / (hq / hkv);
    float* Sw = S + warp * 16 * FA_BK;
    half* Pw = P + warp * 16 * FA_BK;
    float* Ow = O + warp * 16 * DP;

    // Q, scaled, as f16 fragments held in registers for the whole block (staged through Ks).
    for (int idx = threadIdx.x; idx < FA_BQ * DP; idx += blockDim.x) {
        int r = idx / DP, c = idx % DP, i = q0 + r;
        float val = (i < nq && c < d) ? q[((size_t)i * hq + h) * d + c] * scale : 0.0f;
        Ks[idx] = __float2half_rn(val);
    }
    for (int idx = threadIdx.x; idx < FA_WARPS * 16 * DP; idx += blockDim.x) O[idx] = 0.0f;
    if (threadIdx.x < FA_BQ) {
        row_max[threadIdx.x] = NEG_INF;
        row_sum[threadIdx.x] = 0.0f;
    }
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> qf[DP / 16];
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) wmma::load_matrix_sync(qf[kk], Ks + warp * 16 * DP + kk * 16, DP);
    __syncthreads();

    // Keys any query of this block can see.
    int last_q = min(q0 + FA_BQ, nq) - 1;
    int kv_end = causal ? min(kv_len, first_slot + last_q + 1) : kv_len;

    for (int kt = 0; kt < kv_end; kt += FA_BK) {
        kvs.template stage<DP>(Ks, Vs, kt, kv_end, kvh);
        __syncthreads();

        // S (16 x 64 for this warp) = Q Kᵀ; Kᵀ read column-major straight from K's rows.
#pragma unroll
        for (int nb = 0; nb < FA_BK / 16; ++nb) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.0f);
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, Ks + nb * 16 * DP + kk * 16, DP);
                wmma::mma_sync(acc, qf[kk], kf, acc);
            }
            wmma::store_matrix_sync(Sw + nb * 16, acc, FA_BK, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax, one row at a time; each lane holds two of the row's 64 scores.
        for (int r = 0; r < 16; ++r) {
            int i = q0 + warp * 16 + r;
            int visible = causal ? min(kv_len, first_slot + i + 1) : kv_len;
            int j0 = kt + lane, j1 = kt + lane + 32;
            float s0 = j0 < visible ? Sw[r * FA_BK + lane] : NEG_INF;
            float s1 = j1 < visible ? Sw[r * FA_BK + lane + 32] : NEG_INF;
            float mx = fmaxf(s0, s1);
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
            float m_old = row_max[warp * 16 + r];
            float m_new = fmaxf(m_old, mx);
            // A row that has seen no key yet keeps max -inf: weigh nothing, rescale nothing.
            float corr = m_new == NEG_INF ? 1.0f : expf(m_old - m_new);
            float p0 = m_new == NEG_INF ? 0.0f : expf(s0 - m_new);
            float p1 = m_new == NEG_INF ? 0.0f : expf(s1 - m_new);
            float sum = p0 + p1;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
            Pw[r * FA_BK + lane] = __float2half_rn(p0);
            Pw[r * FA_BK + lane + 32] = __float2half_rn(p1);
            for (int c = lane; c < DP; c += 32) Ow[r * DP + c] *= corr;
            __syncwarp();
            if (lane == 0) {
                row_max[warp * 16 + r] = m_new;
                row_sum[warp * 16 + r] = row_sum[warp * 16 + r] * corr + sum;
            }
        }
        __syncwarp();

        // O (16 x DP) += P (16 x 64) V (64 x DP).
#pragma unroll
        for (int nb = 0; nb < DP / 16; ++nb) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, Ow + nb * 16, DP, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> pf;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> vf;
                wmma::load_matrix_sync(pf, Pw + kk * 16, FA_BK);
                wmma::load_matrix_sync(vf, Vs + kk * 16 * DP + nb * 16, DP);
                wmma::mma_sync(acc, pf, vf, acc);
            }
            wmma::store_matrix_sync(Ow + nb * 16, acc, DP, wmma::mem_row_major);
        }
        __syncthreads();  // before the next tile overwrites K and V
    }

    __syncwarp();
    for (int r = 0; r < 16; ++r) {
        int i = q0 + warp * 16 + r;
        if (i >= nq) break;
        float total = row_sum[warp * 16 + r];
        float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no key at all (kv_len 0): zeros
        for (int c = lane; c < d; c += 32) out[((size_t)i * hq + h) * d + c] = Ow[r * DP + c] * inv;
    }
}

#define FA_KERNEL(DP)                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 1) flash_attention_d##DP(            \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,  \
        float* __restrict__ out, int nq, int hq, int hkv, int d, int kv_len, int causal,        \
        int first_slot, float scale) {                                                          \
        ContiguousF32Kv kvs{k, v, hkv, d};                                                      \
        flash_attention<DP>(q, kvs, out, blockIdx.x * FA_BQ, nq, hq, hkv, d, kv_len, causal,    \
                            first_slot, scale);                                                 \
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
        if ((int)(blockIdx.x * FA_BQ) >= n) return;                                             \
        PagedF16Kv kvs{kc, vc, blocks, m[3], block_size, hkv, d};                               \
        flash_attention<DP>(q + (size_t)row0 * hq * d, kvs, out + (size_t)row0 * hq * d,        \
                            blockIdx.x * FA_BQ, n, hq, hkv, d, kv_len, 1, kv_len - n, scale);   \
    }

FA_KERNEL(64)
FA_KERNEL(80)
FA_KERNEL(96)
FA_KERNEL(128)
PAGED_FA_KERNEL(64)
PAGED_FA_KERNEL(80)
PAGED_FA_KERNEL(96)
PAGED_FA_KERNEL(128)
