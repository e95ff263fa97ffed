// f32 twins of the CPU reference ops (cuda/src/cpu.rs), one kernel per op, written for
// obvious correctness: they are the first CUDA path and the baseline the fp16 / fused kernels
// of the seed reports (shared/seeds/) will be measured and checked against.
//
// Layout conventions follow the ops interface: row-major, "rows" are the leading dimension.

// WARP, NEG_INF, warp_sum and random_uniform come from common.cuh.

#include <cuda_fp16.h>
#include <cuda_fp8.h>

// Sum over a block of up to 1024 threads; every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float partial[WARP];
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + WARP - 1) / WARP;
    v = (threadIdx.x < warps) ? partial[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    float total = partial[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void gelu_tanh_f32(const float* __restrict__ x, float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        out[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}

extern "C" __global__ void gelu_erf_f32(const float* __restrict__ x, float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118f));
    }
}

extern "C" __global__ void silu_mul_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// SwiGLU after one GEMM over gate and up stacked: out[r, j] = silu(y[r, j]) * y[r, m + j] for
// y [n, 2m], out [n, m].
extern "C" __global__ void silu_mul_halves_f32(const float* __restrict__ y, float* __restrict__ out,
                                               int m, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * m) return;
    int r = i / m, j = i % m;
    float g = y[(size_t)r * 2 * m + j];
    out[i] = g / (1.0f + expf(-g)) * y[(size_t)r * 2 * m + m + j];
}

// silu(g) * u * scale for the SwiGLU kernels whose products are rounded to f16 (and maybe then to
// e4m3) at once: the exponential and the division approximate (ex2.approx and rcp.approx, a few
// ulp of f32, and up to ~1e-5 relative at |g| near 80, all below f16's 2^-11 rounding), since
// expf and the IEEE division were most of what those kernels issued, and they were issue-bound
// (81% of issue slots at 2 TB/s, ncu on an H200). Every such kernel computes it here, so the
// fused and unfused paths agree bit for bit. f32 outputs (the kernels above, the GEMVs) keep
// expf and the IEEE division.
__device__ __forceinline__ float silu_mul_f16_bound(float g, float u, float scale) {
    return __fdividef(g, 1.0f + __expf(-g)) * u * scale;
}

// The same in f16, for the GEMMs on either side: y is the gate/up GEMM's f16 output and out
// the down projection's operand, times `scale`; the math is f32. The host passes a power of two
// below 1 (SWIGLU_F16_SCALE) and multiplies the down GEMM by its inverse: Qwen3's massive
// activations put a few channels' products near 5e4, past which f16 (65504) would store inf. Eight columns a thread (16-byte loads and
// stores) where rows allow (m % 8 == 0, every Qwen3 size), else one. A grid-stride loop.
extern "C" __global__ void silu_mul_halves_f16(const __half* __restrict__ y,
                                               __half* __restrict__ out, int m, int n,
                                               float scale) {
    grid_start_next_then_wait();
    const int per = (m % 8 == 0) ? 8 : 1;
    const size_t groups_per_row = m / per, groups = (size_t)n * groups_per_row;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        size_t r = g / groups_per_row;
        size_t j = (g % groups_per_row) * per;
        const __half* gate = y + r * 2 * m + j;
        const __half* up = gate + m;
        __half* o = out + r * m + j;
        if (per == 8) {
            uint4 gv = *reinterpret_cast<const uint4*>(gate);
            uint4 uv = *reinterpret_cast<const uint4*>(up);
            const __half2* g2 = reinterpret_cast<const __half2*>(&gv);
            const __half2* u2 = reinterpret_cast<const __half2*>(&uv);
            uint4 ov;
            __half2* o2 = reinterpret_cast<__half2*>(&ov);
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                float2 a = __half22float2(g2[p]), b = __half22float2(u2[p]);
                o2[p] = __floats2half2_rn(silu_mul_f16_bound(a.x, b.x, scale),
                                          silu_mul_f16_bound(a.y, b.y, scale));
            }
            *reinterpret_cast<uint4*>(o) = ov;
        } else {
            float a = __half2float(gate[0]);
            o[0] = __float2half_rn(silu_mul_f16_bound(a, __half2float(up[0]), scale));
        }
    }
}

// RMSNorm, and LayerNorm's rows too wide for a warp (layer_norm_by_warp below), take one block
// per row. A row of up to NORM_VEC float4s per thread (cols % 4 == 0: every text and ViT width)
// is loaded once into registers, all of its loads in flight together: a decode step's rows are
// single and latency-bound, and the loop of dependent scalar loads this replaced took ~15 us a
// row on an H100. Other widths take the plain loops. NORM_VEC is kernels.rs's (the host picks
// rms_norm_f8 only for rows that fit).

__device__ __forceinline__ bool norm_in_registers(int cols) {
    return cols % 4 == 0 && cols <= NORM_VEC * 4 * (int)blockDim.x;
}

// Thread t's float4s of a row: indices t, t + blockDim, ... (zeros past the end).
__device__ __forceinline__ void load_row4(const float* __restrict__ row, int cols,
                                          float4 v[NORM_VEC]) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int u = 0; u < NORM_VEC; ++u) {
        int i = threadIdx.x + u * blockDim.x;
        v[u] = 4 * i < cols ? r4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

__device__ __forceinline__ float sum_squares4(const float4 v[NORM_VEC]) {
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < NORM_VEC; ++u) s += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
    return s;
}

// A norm's output element or four, as f32 or (for a GEMM's operand) rounded to f16.
__device__ __forceinline__ void store1(float* o, int i, float v) { o[i] = v; }
__device__ __forceinline__ void store1(__half* o, int i, float v) { o[i] = __float2half_rn(v); }
__device__ __forceinline__ void store4(float* o, int i, float4 v) {
    reinterpret_cast<float4*>(o)[i] = v;
}
__device__ __forceinline__ void store4(__half* o, int i, float4 v) {
    __half2* o2 = reinterpret_cast<__half2*>(o) + 2 * i;
    o2[0] = __floats2half2_rn(v.x, v.y);
    o2[1] = __floats2half2_rn(v.z, v.w);
}

// o = w * (v * inv), the RMSNorm's output from the row in registers.
template <typename Out>
__device__ __forceinline__ void store_rms4(const float4 v[NORM_VEC], const float* __restrict__ w,
                                           float inv, Out* __restrict__ o, int cols) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
    for (int u = 0; u < NORM_VEC; ++u) {
        int i = threadIdx.x + u * blockDim.x;
        if (4 * i < cols) {
            float4 g = w4[i];
            store4(o, i,
                   make_float4(g.x * (v[u].x * inv), g.y * (v[u].y * inv), g.z * (v[u].z * inv),
                               g.w * (v[u].w * inv)));
        }
    }
}

// LayerNorm of a row that fits one warp's registers (layer_norm_by_warp): LN_WARP_VEC float4s a
// lane at most (the ViT's 1152 columns: 9), lane l holding float4s l, l + 32, ... (each load a
// coalesced 512 bytes across the warp), all of them loaded before the first is used. Mean and
// variance (two passes over the registers, as the CPU's) by shuffles alone: no shared memory,
// no block barrier. A block takes one row per warp.
__device__ __forceinline__ bool layer_norm_by_warp(int cols) {
    return cols % 4 == 0 && cols <= LN_WARP_VEC * 4 * WARP;
}

template <typename Out>
__device__ __forceinline__ void layer_norm_warp_row(const float* __restrict__ x,
                                                    const float* __restrict__ w,
                                                    const float* __restrict__ b,
                                                    Out* __restrict__ out, int rows, int cols,
                                                    float eps) {
    const int lane = threadIdx.x % WARP;
    const int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (r >= rows) return;
    const int n4 = cols / 4;
    const float4* r4 = reinterpret_cast<const float4*>(x + (size_t)r * cols);
    Out* o = out + (size_t)r * cols;
    float4 v[LN_WARP_VEC];
#pragma unroll
    for (int u = 0; u < LN_WARP_VEC; ++u) {
        int i = lane + u * WARP;
        v[u] = i < n4 ? r4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < LN_WARP_VEC; ++u) s += v[u].x + v[u].y + v[u].z + v[u].w;
    const float mean = warp_sum(s) / cols;
    float var = 0.0f;
#pragma unroll
    for (int u = 0; u < LN_WARP_VEC; ++u) {
        if (lane + u * WARP < n4) {
            float4 d = make_float4(v[u].x - mean, v[u].y - mean, v[u].z - mean, v[u].w - mean);
            var += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
        }
    }
    const float inv = rsqrtf(warp_sum(var) / cols + eps);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll
    for (int u = 0; u < LN_WARP_VEC; ++u) {
        int i = lane + u * WARP;
        if (i < n4) {
            float4 g = w4[i], c = b4[i];
            store4(o, i,
                   make_float4((v[u].x - mean) * inv * g.x + c.x, (v[u].y - mean) * inv * g.y + c.y,
                               (v[u].z - mean) * inv * g.z + c.z, (v[u].w - mean) * inv * g.w + c.w));
        }
    }
}

// Wider rows: one block per row, two block-wide reductions.
template <typename Out>
__device__ __forceinline__ void layer_norm_block_row(const float* __restrict__ x,
                                                     const float* __restrict__ w,
                                                     const float* __restrict__ b,
                                                     Out* __restrict__ out, int cols, float eps) {
    const float* row = x + (size_t)blockIdx.x * cols;
    Out* o = out + (size_t)blockIdx.x * cols;
    if (norm_in_registers(cols)) {
        float4 v[NORM_VEC];
        load_row4(row, cols, v);
        float s = 0.0f;
#pragma unroll
        for (int u = 0; u < NORM_VEC; ++u) s += v[u].x + v[u].y + v[u].z + v[u].w;
        float mean = block_sum(s) / cols;
        float var = 0.0f;
#pragma unroll
        for (int u = 0; u < NORM_VEC; ++u) {
            if (4 * (threadIdx.x + u * blockDim.x) < cols) {
                float4 d = make_float4(v[u].x - mean, v[u].y - mean, v[u].z - mean, v[u].w - mean);
                var += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
            }
        }
        float inv = rsqrtf(block_sum(var) / cols + eps);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll
        for (int u = 0; u < NORM_VEC; ++u) {
            int i = threadIdx.x + u * blockDim.x;
            if (4 * i < cols) {
                float4 g = w4[i], c = b4[i];
                store4(o, i,
                       make_float4((v[u].x - mean) * inv * g.x + c.x,
                                   (v[u].y - mean) * inv * g.y + c.y,
                                   (v[u].z - mean) * inv * g.z + c.z,
                                   (v[u].w - mean) * inv * g.w + c.w));
            }
        }
        return;
    }
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += row[i];
    float mean = block_sum(s) / cols;
    float v = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float d = row[i] - mean;
        v += d * d;
    }
    float inv = rsqrtf(block_sum(v) / cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        store1(o, i, (row[i] - mean) * inv * w[i] + b[i]);
}

// Rows as layer_norm_by_warp says: one warp each, blockDim / 32 a block (the host sizes the
// grid to match, cuda/src/cuda/norm.rs), or one block each.
template <typename Out>
__device__ __forceinline__ void layer_norm_rows(const float* __restrict__ x,
                                                const float* __restrict__ w,
                                                const float* __restrict__ b, Out* __restrict__ out,
                                                int rows, int cols, float eps) {
    if (layer_norm_by_warp(cols)) {
        layer_norm_warp_row(x, w, b, out, rows, cols, eps);
    } else {
        layer_norm_block_row(x, w, b, out, cols, eps);
    }
}

extern "C" __global__ void layer_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, float* __restrict__ out,
                                          int rows, int cols, float eps) {
    layer_norm_rows(x, w, b, out, rows, cols, eps);
}

// The same norm rounded to f16: the operand of the GEMMs that read it (the ViT's q/k/v and
// fc1), written once instead of as f32 and then cast.
extern "C" __global__ void layer_norm_f16(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, __half* __restrict__ out,
                                          int rows, int cols, float eps) {
    layer_norm_rows(x, w, b, out, rows, cols, eps);
}

// Launched under programmatic launch where the GPU has it (norm.rs).
template <typename Out>
__device__ __forceinline__ void rms_norm_row(const float* __restrict__ x,
                                             const float* __restrict__ w, Out* __restrict__ out,
                                             int cols, float eps) {
    grid_start_next_then_wait();
    const float* row = x + (size_t)blockIdx.x * cols;
    Out* o = out + (size_t)blockIdx.x * cols;
    if (norm_in_registers(cols)) {
        float4 v[NORM_VEC];
        load_row4(row, cols, v);
        float inv = rsqrtf(block_sum(sum_squares4(v)) / cols + eps);
        store_rms4(v, w, inv, o, cols);
        return;
    }
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += row[i] * row[i];
    float inv = rsqrtf(block_sum(s) / cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) store1(o, i, w[i] * (row[i] * inv));
}

extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, int cols, float eps) {
    rms_norm_row(x, w, out, cols, eps);
}

// The same norm rounded to f16: the operand of the GEMMs that read it (the text decoder's
// q/k/v, gate/up and lm_head past the GEMVs' rows), written once instead of as f32 and then
// cast.
extern "C" __global__ void rms_norm_f16(const float* __restrict__ x, const float* __restrict__ w,
                                        __half* __restrict__ out, int cols, float eps) {
    rms_norm_row(x, w, out, cols, eps);
}

// ---- the W8A8 GEMM's activations ----
// FP8 weights on sm_90 multiply on FP8 tensor cores (cuBLASLt with block scales, lt.rs and
// w8a8.rs), so their activations are quantized too, as `activation_scheme: dynamic` declares:
// per row and group of 128 columns, s = amax / 448 (1 for a group of zeros), each value rounded
// to e4m3 as x / s (to nearest even, saturating), from the f16 value the unfused path stores, as
// the CPU's quant::fp8::quantize_rows does bit for bit (the division and amax / 448 correctly
// rounded, as there; the division by div_by_scale below, from one reciprocal a group). The
// bytes go row-major; scales[g * ld + r] is row r's scale of group g: all rows' scales of a
// group together, as cuBLASLt's VEC128_32F reads them (ld: the rows padded to what the GEMM
// takes, w8a8.rs's W8A8_ROWS). A warp takes one group, four values a lane (lane l holds columns
// 4l..4l+3 of it): every kernel below hands its values to quant_group_e4m3 (the GEMM's operand)
// or qdq_group_e4m3 (decode's GEMVs of the same weights: each value as its byte times the
// scale, what the GEMM multiplies by, in f32) in that layout.

// The group's scale s and its reciprocal (for div_by_scale).
__device__ __forceinline__ float2 group_scale_e4m3(const float v[4]) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = WARP / 2; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
    return make_float2(s, __frcp_rn(s));
}

// v / s rounded to nearest, bit for bit as __fdiv_rn(v, s), from inv = 1 / s rounded to nearest:
// q = v * inv is within 2 ulp of v / s; one correction by the exact remainder (an FMA) makes it
// faithful, and a second rounds it correctly (Markstein's theorem: a faithful quotient, the
// correctly rounded reciprocal and an exact remainder). Five FMA-pipe instructions where
// __fdiv_rn takes about nine and a branch, which made these kernels issue-bound. It holds while
// nothing under- or overflows: v is an f16 value and s = amax / 448 of f16 values (so
// s >= 2^-24 / 448); quant::fp8's test the_gpus_division_by_a_scale_is_the_division checks it on
// the CPU (every pair of f16 value and group maximum passed it once). The sign is v's, so that
// -0 stays -0 as in the division.
__device__ __forceinline__ float div_by_scale(float v, float s, float inv) {
    float q = v * inv;
    q = fmaf(fmaf(-q, s, v), inv, q);
    return copysignf(fmaf(fmaf(-q, s, v), inv, q), v);
}

// The four values' e4m3 bytes, value i in byte i, each v[i] / s rounded to nearest even and
// saturating (two conversions of a pair each).
__device__ __forceinline__ unsigned e4m3x4(const float v[4], float2 s) {
    const float2 lo = make_float2(div_by_scale(v[0], s.x, s.y), div_by_scale(v[1], s.x, s.y));
    const float2 hi = make_float2(div_by_scale(v[2], s.x, s.y), div_by_scale(v[3], s.x, s.y));
    return (unsigned)__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3) |
           (unsigned)__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3) << 16;
}

__device__ __forceinline__ void quant_group_e4m3(const float v[4], unsigned char* __restrict__ q4,
                                                 float* __restrict__ scale) {
    const float2 s = group_scale_e4m3(v);
    *reinterpret_cast<unsigned*>(q4) = e4m3x4(v, s);
    if (threadIdx.x % WARP == 0) *scale = s.x;
}

__device__ __forceinline__ void qdq_group_e4m3(const float v[4], float* __restrict__ out4) {
    const float2 s = group_scale_e4m3(v);
    const unsigned bytes = e4m3x4(v, s);
    float r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const auto byte = (__nv_fp8_storage_t)((bytes >> (8 * i)) & 0xff);
        const __half h = __nv_cvt_fp8_to_halfraw(byte, __NV_E4M3);
        r[i] = __half2float(h) * s.x;
    }
    *reinterpret_cast<float4*>(out4) = make_float4(r[0], r[1], r[2], r[3]);
}

// Four values rounded to f16 and read back: what the unfused path stores and then quantizes.
__device__ __forceinline__ void round_to_f16(float2 lo, float2 hi, float v[4]) {
    const float2 a = __half22float2(__floats2half2_rn(lo.x, lo.y));
    const float2 b = __half22float2(__floats2half2_rn(hi.x, hi.y));
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

// Where a group's values go: the GEMM's operand (bytes and scales) or, for a GEMV, the values
// rounded as the GEMM sees them ([rows, cols] f32). `c` is the group's first column.
struct QuantStore {
    unsigned char* q;
    float* scales;
    int ld, cols;
    __device__ void operator()(const float f[4], int r, int c) const {
        quant_group_e4m3(f, q + (size_t)r * cols + c, scales + (size_t)(c / 128) * ld + r);
    }
};
struct QdqStore {
    float* out;
    int cols;
    __device__ void operator()(const float f[4], int r, int c) const {
        qdq_group_e4m3(f, out + (size_t)r * cols + c);
    }
};

// The row and group of 128 columns this warp takes (one warp a group, `groups` groups a row), or
// false for a warp past the last (whole warps: blockDim is a multiple of WARP). In 32 bits where
// the grid allows (under 2^31 groups: any real step): the 64-bit division was 5% of the SwiGLU
// kernel's instructions (ncu, H200).
__device__ __forceinline__ bool group_of_warp(int n, int groups, int& r, int& g) {
    const long long total = (long long)n * groups;
    if (total < (1ll << 31)) {
        const unsigned warp = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
        if (warp >= (unsigned)total) return false;
        r = (int)(warp / (unsigned)groups);
        g = (int)(warp - (unsigned)r * groups);
        return true;
    }
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    if (warp >= total) return false;
    r = (int)(warp / groups);
    g = (int)(warp - (long long)r * groups);
    return true;
}

// x [n, k] f16 (k a multiple of 128) quantized: the input of a W8A8 GEMM no kernel before it
// quantizes (the attention's output, before o_proj). One warp a group.
extern "C" __global__ void quant_rows_f8(const __half* __restrict__ x, unsigned char* __restrict__ q,
                                         float* __restrict__ scales, int n, int k, int ld) {
    grid_start_next_then_wait();
    int r, g;
    if (!group_of_warp(n, k / 128, r, g)) return;
    const int lane = threadIdx.x % WARP;
    const size_t at = (size_t)r * k + g * 128 + lane * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(x + at);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    const float v[4] = {a.x, a.y, b.x, b.y};
    QuantStore{q, scales, ld, k}(v, r, g * 128 + lane * 4);
}

// Row r's group g of x [n, k] f32 (k a multiple of 128) rounded to f16 as cast_f32_to_f16 rounds
// it, handed to `store`; one warp a group.
template <typename Store>
__device__ __forceinline__ void f32_rows_groups(const float* __restrict__ x, int n, int k,
                                                Store store) {
    int r, g;
    if (!group_of_warp(n, k / 128, r, g)) return;
    const int lane = threadIdx.x % WARP;
    const int c = g * 128 + lane * 4;
    const float4 v4 = *reinterpret_cast<const float4*>(x + (size_t)r * k + c);
    float v[4];
    round_to_f16(make_float2(v4.x, v4.y), make_float2(v4.z, v4.w), v);
    store(v, r, c);
}

// quant_rows_f8 of x [n, k] f32 rounded to f16, in one pass: o_proj's input (the attention's f32
// output), which cast_f32_to_f16 and then quant_rows_f8 took two passes over (at 4096 tokens
// ~100 MB a layer read and written for nothing). The same bytes and scales.
extern "C" __global__ void quant_rows_f32_f8(const float* __restrict__ x, unsigned char* __restrict__ q,
                                             float* __restrict__ scales, int n, int k, int ld) {
    grid_start_next_then_wait();
    f32_rows_groups(x, n, k, QuantStore{q, scales, ld, k});
}

// x [n, k] f32 rounded to f16 and then as quant_rows_f8 rounds it, back in f32: the rows of a
// decode GEMV (1-4 rows) of an FP8 weight whose larger GEMMs run W8A8, so a request computes the
// same whatever its step's row count (up to summation order).
extern "C" __global__ void qdq_rows_f8(const float* __restrict__ x, float* __restrict__ out, int n,
                                       int k) {
    // Under programmatic launch (as the GEMVs around it): x is the kernel before's output; the
    // GEMV after may start streaming its weights at once, even before that kernel has ended
    // (its blocks take the slots the GEMV before frees as it drains).
    grid_start_next_then_wait();
    f32_rows_groups(x, n, k, QdqStore{out, k});
}

// rms_norm_f16's norm from the row in registers, bit for bit, each group of 128 columns handed to
// `store` rounded to f16 (never stored so). The host launches it as rms_norm_f16 (one ROW_THREADS
// block a row) only where that kernel keeps the row in registers and cols is whole groups of
// 128; then a warp's float4s of one chunk are one group.
template <typename Store>
__device__ __forceinline__ void rms_norm_groups(const float* __restrict__ x,
                                                const float* __restrict__ w, int cols, float eps,
                                                Store store) {
    if (!norm_in_registers(cols) || cols % 128 != 0) __trap();
    const int r = blockIdx.x;
    float4 v[NORM_VEC];
    load_row4(x + (size_t)r * cols, cols, v);
    const float inv = rsqrtf(block_sum(sum_squares4(v)) / cols + eps);
    const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
    for (int u = 0; u < NORM_VEC; ++u) {
        const int i = threadIdx.x + u * blockDim.x;
        if (4 * i < cols) {  // the same for a whole warp: cols is whole groups
            const float4 g = w4[i];
            float f[4];
            round_to_f16(make_float2(g.x * (v[u].x * inv), g.y * (v[u].y * inv)),
                         make_float2(g.z * (v[u].z * inv), g.w * (v[u].w * inv)), f);
            store(f, r, 4 * i);
        }
    }
}

// rms_norm_f16 and quant_rows_f8 in one pass, for a W8A8 GEMM's operand (q/k/v, gate/up).
extern "C" __global__ void rms_norm_f8(const float* __restrict__ x, const float* __restrict__ w,
                                       unsigned char* __restrict__ q, float* __restrict__ scales,
                                       int ld, int cols, float eps) {
    grid_start_next_then_wait();
    rms_norm_groups(x, w, cols, eps, QuantStore{q, scales, ld, cols});
}

// rms_norm_f16 and qdq_rows_f8 in one pass, for a decode GEMV of such a weight.
extern "C" __global__ void rms_norm_qdq_f8(const float* __restrict__ x, const float* __restrict__ w,
                                           float* __restrict__ out, int cols, float eps) {
    grid_start_next_then_wait();
    rms_norm_groups(x, w, cols, eps, QdqStore{out, cols});
}

// silu_mul_halves_f16 and quant_rows_f8 in one pass, for the down projection's W8A8 GEMM: y
// [n, 2m] the gate/up GEMM's f16 output, m a multiple of 128; each product is
// silu_mul_halves_f16's (times `scale`, rounded to f16), bit for bit, and never stored in f16.
// One warp a group.
extern "C" __global__ void silu_mul_halves_f8(const __half* __restrict__ y,
                                              unsigned char* __restrict__ q,
                                              float* __restrict__ scales, int m, int n,
                                              float scale, int ld) {
    grid_start_next_then_wait();
    int r, g;
    if (!group_of_warp(n, m / 128, r, g)) return;
    const int lane = threadIdx.x % WARP;
    const size_t j = (size_t)g * 128 + lane * 4;
    const uint2 gv = *reinterpret_cast<const uint2*>(y + (size_t)r * 2 * m + j);
    const uint2 uv = *reinterpret_cast<const uint2*>(y + (size_t)r * 2 * m + m + j);
    float2 p[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(h ? &gv.y : &gv.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(h ? &uv.y : &uv.x));
        p[h] = make_float2(silu_mul_f16_bound(a.x, b.x, scale), silu_mul_f16_bound(a.y, b.y, scale));
    }
    float f[4];
    round_to_f16(p[0], p[1], f);
    QuantStore{q, scales, ld, m}(f, r, (int)j);
}

// Rotate-half RoPE. Grid: one block per token; threads cover heads x d/2 pairs.
extern "C" __global__ void rope_f32(const float* __restrict__ x, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, float* __restrict__ out,
                                    int heads, int d) {
    int t = blockIdx.x, half = d / 2;
    const float* c = cos_t + (size_t)t * d;
    const float* s = sin_t + (size_t)t * d;
    for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
        int h = p / half, i = p % half;
        size_t base = ((size_t)t * heads + h) * d;
        float x1 = x[base + i], x2 = x[base + i + half];
        out[base + i] = x1 * c[i] - x2 * s[i];
        out[base + i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

// Attention with grouped KV heads, one warp per (query, head), online softmax over the keys.
// q [nq, hq, d]; k, v [slots, hkv, d]; out [nq, hq * d]. causal != 0: query i sees slots
// 0..=first_slot + i; else slots 0..kv_len. d <= 32 * 8.
extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out,
                                         int hq, int hkv, int d, int kv_len, int causal,
                                         int first_slot, float scale) {
    int task = blockIdx.x, lane = threadIdx.x;
    int i = task / hq, h = task % hq, kvh = h / (hq / hkv);
    int visible = causal ? first_slot + i + 1 : kv_len;
    const float* qv = q + ((size_t)i * hq + h) * d;
    float qr[8], acc[8];
    int per = (d + WARP - 1) / WARP;
    for (int r = 0; r < per; r++) {
        int idx = lane + r * WARP;
        qr[r] = idx < d ? qv[idx] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, denom = 0.0f;
    for (int j = 0; j < visible; j++) {
        const float* kr = k + ((size_t)j * hkv + kvh) * d;
        float dot = 0.0f;
        for (int r = 0; r < per; r++) {
            int idx = lane + r * WARP;
            if (idx < d) dot += qr[r] * kr[idx];
        }
        float s = warp_sum(dot) * scale;
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new);
        float p = expf(s - m_new);
        denom = denom * correction + p;
        const float* vr = v + ((size_t)j * hkv + kvh) * d;
        for (int r = 0; r < per; r++) {
            int idx = lane + r * WARP;
            acc[r] = acc[r] * correction + (idx < d ? p * vr[idx] : 0.0f);
        }
        m = m_new;
    }
    float* o = out + ((size_t)i * hq + h) * d;
    for (int r = 0; r < per; r++) {
        int idx = lane + r * WARP;
        if (idx < d) o[idx] = acc[r] / denom;
    }
}

// out[i] = sum_t w[i*taps+t] * table[idx[i*taps+t]]; one block per output row.
extern "C" __global__ void weighted_gather_f32(const float* __restrict__ table, const unsigned* __restrict__ idx,
                                               const float* __restrict__ w, float* __restrict__ out,
                                               int taps, int h) {
    int i = blockIdx.x;
    float* o = out + (size_t)i * h;
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        float s = 0.0f;
        for (int t = 0; t < taps; t++) s += w[i * taps + t] * table[(size_t)idx[i * taps + t] * h + c];
        o[c] = s;
    }
}

// The ViT's input from an image's bytes (cuda/src/patches.rs's patchify is its CPU twin):
// out[i, (c, f, y, x)] = table[c * 256 + channel c of pixel (py * p + y, px * p + x)], where patch
// i sits at (py, px) of the grid in merge-window order, and every frame f is the same. rgb holds
// the image's bytes, 3 a pixel, row-major. One block per patch: each thread's writes coalesce.
extern "C" __global__ void patchify_rgb_f32(const unsigned char* __restrict__ rgb,
                                            const float* __restrict__ table, float* __restrict__ out,
                                            int width, int grid_w, int p, int m, int t) {
    const int i = blockIdx.x, frame = p * p, dim = 3 * t * frame, windows_w = grid_w / m;
    const int inner = i % (m * m), window = i / (m * m);
    const int py = window / windows_w * m + inner / m, px = window % windows_w * m + inner % m;
    float* o = out + (size_t)i * dim;
    for (int r = threadIdx.x; r < dim; r += blockDim.x) {
        const int c = r / (t * frame), yx = r % frame, y = yx / p, x = yx % p;
        o[r] = table[c * 256 + rgb[((size_t)(py * p + y) * width + px * p + x) * 3 + c]];
    }
}

// dst[rows[i]] = src[i] (accumulate == 0) or += src[i]; one block per row.
extern "C" __global__ void scatter_rows_f32(float* __restrict__ dst, const unsigned* __restrict__ rows,
                                            const float* __restrict__ src, int width, int accumulate) {
    float* d = dst + (size_t)rows[blockIdx.x] * width;
    const float* s = src + (size_t)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = accumulate ? d[c] + s[c] : s[c];
}

// Every row of out [n, cols] = bias [cols] (the start of a GEMM with bias and beta = 1).
extern "C" __global__ void broadcast_rows_f32(const float* __restrict__ bias, float* __restrict__ out,
                                              int cols, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * cols) out[i] = bias[i % cols];
}

// Random-weight matrices generated on the GPU: element i is random_uniform(key, i, bound).
extern "C" __global__ void fill_uniform_f32(float* __restrict__ out, unsigned long long n,
                                            unsigned long long key, float bound) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        out[i] = random_uniform(key, i, bound);
    }
}
