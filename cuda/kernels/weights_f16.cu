// Kernels that read the GPU's weight format: f16 matrices and embedding table, f32 activations,
// f32 accumulation. Their CPU twins are the f32 ops of cuda/src/cpu.rs given the same weights
// rounded to f16 (cuda/tests/cuda_twin.rs).
//
// Decoding one token reads every weight once, so it is bound by memory bandwidth, not FLOPs
// (seeds 000 and 002). The GEMVs below are written for that: one warp per output row, 128-bit
// loads of 8 weights through the read-only path (__ldg), the few activation rows read as float4
// (they stay in L1/L2), warp-shuffle reductions, nothing through shared memory. Larger batches
// of rows go to cuBLAS (f16 tensor cores, f32 accumulation) after cast_f32_to_f16.

#include <cuda_fp16.h>

// GEMV_MAX_ROWS, the rows of x one GEMV launch handles (decode is 1; a few speculative or
// batched rows still fit in registers), is #defined by the host before this source
// (shared_defines in cuda/src/cuda/mod.rs), so the two sides cannot disagree.

// Eight weights from one 128-bit load, as floats.
__device__ __forceinline__ void unpack8(uint4 raw, float f[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 v = __half22float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

// acc[r] += x[r, c..c+8] . wf for each row r < rows.
__device__ __forceinline__ void dot8(const float* __restrict__ x, int k, int rows, int c,
                                     const float wf[8], float acc[GEMV_MAX_ROWS]) {
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * k + c);
            float4 a = xr[0], b = xr[1];
            acc[r] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x +
                      wf[5] * b.y + wf[6] * b.z + wf[7] * b.w;
        }
    }
}

// acc[r] = x[r, :] . w[j, :] for one weight row, summed over the warp's lanes (every lane
// returns the totals). The vector path needs k % 8 == 0 (16-byte aligned rows); the scalar
// loop takes any k.
__device__ __forceinline__ void row_dots(const float* __restrict__ x, const __half* __restrict__ wr,
                                         int rows, int k, int lane, float acc[GEMV_MAX_ROWS]) {
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.0f;
    int k_vec = (k % 8 == 0) ? k : 0;
    // Four 128-bit loads issued back to back before any math (one at a time cannot cover DRAM
    // latency with one warp per row). Against the same loads unrolled with the math between
    // them: batch-1 decode 8.08 -> 7.94 ms a token on an H100 (8B shapes).
    for (int c0 = lane * 8; c0 < k_vec; c0 += WARP * 8 * 4) {
        uint4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int c = c0 + u * WARP * 8;
            raw[u] = c < k_vec ? __ldg(reinterpret_cast<const uint4*>(wr + c)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int c = c0 + u * WARP * 8;
            if (c < k_vec) {
                float wf[8];
                unpack8(raw[u], wf);
                dot8(x, k, rows, c, wf, acc);
            }
        }
    }
    for (int c = k_vec + lane; c < k; c += WARP) {
        float wv = __half2float(wr[c]);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r)
            if (r < rows) acc[r] += wv * x[(size_t)r * k + c];
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// out[r, j] = x[r, :] . w[j, :] (+ bias[j]): x [rows, k] f32, w [m, k] f16, out [rows, m] f32.
// One warp per output column j.
extern "C" __global__ void gemv_f16w(const float* __restrict__ x, const __half* __restrict__ w,
                                     const float* __restrict__ bias, int has_bias,
                                     float* __restrict__ out, int rows, int m, int k) {
    int j = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (j >= m) return;
    float acc[GEMV_MAX_ROWS];
    row_dots(x, w + (size_t)j * k, rows, k, lane, acc);
    if (lane == 0) {
        float b = has_bias ? bias[j] : 0.0f;
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r)
            if (r < rows) out[(size_t)r * m + j] = acc[r] + b;
    }
}

// The text MLP's first half in one pass over both matrices (seed 002), stacked in one weight
// gate_up [2m, k] (gate's rows first): out[r, j] = silu(x[r] . gate[j]) * (x[r] . up[j]), with
// silu(g) = g / (1 + exp(-g)).
extern "C" __global__ void swiglu_gemv_f16w(const float* __restrict__ x,
                                            const __half* __restrict__ gate_up,
                                            float* __restrict__ out, int rows, int m, int k) {
    int j = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (j >= m) return;
    float g[GEMV_MAX_ROWS], u[GEMV_MAX_ROWS];
    row_dots(x, gate_up + (size_t)j * k, rows, k, lane, g);
    row_dots(x, gate_up + (size_t)(m + j) * k, rows, k, lane, u);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r)
            if (r < rows) out[(size_t)r * m + j] = g[r] / (1.0f + expf(-g[r])) * u[r];
    }
}

// Activations to f16 for the tensor-core GEMM. Round to nearest; values past f16's range
// become inf, which the GEMM then shows rather than hides.
extern "C" __global__ void cast_f32_to_f16(const float* __restrict__ x, __half* __restrict__ out,
                                           unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride)
        out[i] = __float2half_rn(x[i]);
}

// Rows of the f16 table picked by ids, as f32: out[i, :] = table[ids[i], :]. The ids come from
// device memory (a recorded step reads its new tokens there). The host checks them; one
// outside the table anyway gives a row of NaN, which shows in the logits.
extern "C" __global__ void embedding_f16w(const __half* __restrict__ table,
                                          const unsigned* __restrict__ ids, float* __restrict__ out,
                                          int width, unsigned vocab) {
    unsigned id = ids[blockIdx.x];
    float* dst = out + (size_t)blockIdx.x * width;
    if (id >= vocab) {
        for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = __int_as_float(0x7fc00000);
        return;
    }
    const __half* src = table + (size_t)id * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = __half2float(__ldg(src + c));
}

// Random-weight matrices in f16: fill_uniform_f32's value (common.cuh's random_uniform),
// rounded to nearest, as the CPU's upload would round it.
extern "C" __global__ void fill_uniform_f16(__half* __restrict__ out, unsigned long long n,
                                            unsigned long long key, float bound) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        out[i] = __float2half_rn(random_uniform(key, i, bound));
    }
}
