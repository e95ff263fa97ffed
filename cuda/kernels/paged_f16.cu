// The paged KV cache (f16, or FP8 e4m3) and the kernels of a batched engine step that read or
// write it, plus the step's per-row gathers. CPU twins in cuda/src/cpu.rs: write_kv,
// paged_attention, gather_rows.
//
// Cache layout, per layer: [slots, hkv, d] f16, slot = block * block_size + offset.
// With --kv-cache-dtype fp8 (cuda/src/kv.rs) the same layout holds e4m3fn bytes of x / scale, a
// scale per layer's keys and per layer's values; each kernel has an _f8 twin (the same template
// on F8Cache) that stores through the hardware's rounding (nearest even, saturating at ±448:
// never NaN) and reads through f8_pair (common.cuh), the scales folded into q and the output. A step's
// sequences are described by `seqs` ([num_seqs * 4] u32: first query row, query count n, keys
// in the cache counting this step's (kv_len), offset of its block list in `blocks`); query i
// of a sequence sits at position kv_len - n + i and sees keys 0..=that. Every index comes from
// device memory, so a recorded step (CUDA graph) replays with new tokens, slots and tables.

#include <cuda_fp16.h>
#include <cuda_fp8.h>

// The two cache formats, as the templates below take them: the element type, how a value is
// stored (f16: rounded to nearest; FP8: times inv = 1 / scale, which the host computes as the CPU
// does, then rounded by cvt.rn.satfinite, the CPU's f32_to_e4m3), and how E elements are loaded
// (RawHalves, RawF8 below).
__device__ __forceinline__ unsigned char f8_store(float x, float inv) {
    return (unsigned char)__nv_cvt_float_to_fp8(x * inv, __NV_SATFINITE, __NV_E4M3);
}
// One stored byte's value (before the scale): f8_pair's f16 times 2^8, exactly.
__device__ __forceinline__ float f8_value(unsigned char b) {
    return __low2float(f8_pair((unsigned)b << 8)) * 256.0f;
}

// PD_WARPS (warps per decode block), PD_KEYS (keys whose loads a decode warp keeps in flight)
// and PD_MIN_CHUNK (fewest keys a decode split takes: fewer, and merging costs more than it
// saves) are #defined by the host before this source (shared_defines in cuda/src/cuda/kernels.rs).

__device__ __forceinline__ unsigned key_slot(const unsigned* __restrict__ blocks, unsigned off,
                                             int j, int block_size) {
    return blocks[off + j / block_size] * (unsigned)block_size + (unsigned)(j % block_size);
}

// Four values into a cache as one store, at dst (4-aligned): f16 (8 bytes; inv unused) or e4m3
// bytes of x * inv (4 bytes), as F16Cache::store and F8Cache::store round each.
__device__ __forceinline__ void store4(__half* __restrict__ dst, float4 x, float) {
    const __half2 a = __floats2half2_rn(x.x, x.y), b = __floats2half2_rn(x.z, x.w);
    *reinterpret_cast<uint2*>(dst) = make_uint2(*reinterpret_cast<const unsigned*>(&a),
                                                *reinterpret_cast<const unsigned*>(&b));
}
__device__ __forceinline__ void store4(unsigned char* __restrict__ dst, float4 x, float inv) {
    *reinterpret_cast<unsigned*>(dst) =
        (unsigned)f8_store(x.x, inv) | (unsigned)f8_store(x.y, inv) << 8 |
        (unsigned)f8_store(x.z, inv) << 16 | (unsigned)f8_store(x.w, inv) << 24;
}

// cache[slots[r], :] = rows[r, :] as f16 (write_kv_f8: as e4m3 bytes of rows * inv). One block
// per row; width = hkv * d. A slot outside the cache writes nothing (the host never sends one).
extern "C" __global__ void write_kv_f16(__half* __restrict__ cache, const unsigned* __restrict__ slots,
                                        const float* __restrict__ rows, int width,
                                        unsigned num_slots) {
    unsigned slot = slots[blockIdx.x];
    if (slot >= num_slots) return;
    const float* src = rows + (size_t)blockIdx.x * width;
    __half* dst = cache + (size_t)slot * width;
    if (width % 4 == 0) {
        for (int c = threadIdx.x * 4; c < width; c += blockDim.x * 4) {
            float4 x = *reinterpret_cast<const float4*>(src + c);
            __half2* d2 = reinterpret_cast<__half2*>(dst + c);
            d2[0] = __floats2half2_rn(x.x, x.y);
            d2[1] = __floats2half2_rn(x.z, x.w);
        }
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = __float2half_rn(src[c]);
    }
}

extern "C" __global__ void write_kv_f8(unsigned char* __restrict__ cache,
                                       const unsigned* __restrict__ slots,
                                       const float* __restrict__ rows, int width,
                                       unsigned num_slots, float inv) {
    unsigned slot = slots[blockIdx.x];
    if (slot >= num_slots) return;
    const float* src = rows + (size_t)blockIdx.x * width;
    unsigned char* dst = cache + (size_t)slot * width;
    if (width % 4 == 0) {
        for (int c = threadIdx.x * 4; c < width; c += blockDim.x * 4)
            store4(dst + c, *reinterpret_cast<const float4*>(src + c), inv);
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = f8_store(src[c], inv);
    }
}

// QK_WARPS, the warps of a qkv_to_cache block, is #defined by the host (shared_defines).
#define QK_MAX_DIM 256

// A step's attention inputs from the fused projection qkv [n, (hq + 2 hkv) d] (q heads, k
// heads, v heads): q and k RMS-normed per head (q_norm, k_norm [d]; both null: not normed, as
// in Qwen2) and rotated (rotate-half,
// cos/sin [n, d]); q to q_out [n, hq, d]; k and v into the caches at slots[r]. Block (r, y)
// takes row r's heads y * QK_WARPS .. + QK_WARPS, one warp per head (a decode step has one
// row per sequence: one block per row left most of the GPU idle while a warp did 12 heads
// in turn). A head's normed values go through shared memory, since rotate-half pairs dims i
// and i + d/2. A slot outside the cache writes nothing. qkv_to_cache_f32 writes an f16 cache,
// qkv_to_cache_f8 an FP8 one (k and v times k_inv and v_inv, then rounded to e4m3).
struct F16Cache;
struct F8Cache;

// qkv_to_cache (below) for head dim 128, every Qwen3's and Qwen2.5's: lane l holds dims 4l ..
// 4l + 3 as one float4, so rotate-half's partner (dim i + 64 or i - 64) is lane l ^ 16's, one
// shuffle, where the general kernel loads and stores a float at a time and trades the normed
// values through shared memory. The same products in the same order; the norm's sum of
// squares adds in another order. (At 2048 tokens the general kernel moved ~1.3 TB/s.)
template <typename C>
__device__ __forceinline__ void qkv_to_cache_d128(
    const float* __restrict__ qkv, const float* __restrict__ q_norm,
    const float* __restrict__ k_norm, float eps, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const unsigned* __restrict__ slots,
    float* __restrict__ q_out, typename C::T* __restrict__ k_cache,
    typename C::T* __restrict__ v_cache, int hq, int hkv, unsigned num_slots, float k_inv,
    float v_inv) {
    constexpr int D = 4 * WARP;
    const int r = blockIdx.x, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float4* row = reinterpret_cast<const float4*>(qkv + (size_t)r * (hq + 2 * hkv) * D);
    const float4 c = reinterpret_cast<const float4*>(cos_t + (size_t)r * D)[lane];
    const float4 s = reinterpret_cast<const float4*>(sin_t + (size_t)r * D)[lane];
    const bool normed = q_norm != nullptr;
    const float4 one = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    const float4 qw = normed ? reinterpret_cast<const float4*>(q_norm)[lane] : one;
    const float4 kw = normed ? reinterpret_cast<const float4*>(k_norm)[lane] : one;
    const unsigned slot = slots[r];
    const bool cached = slot < num_slots;
    // Below dim 64: x cos - partner sin; from it: x cos + partner sin.
    const float sign = lane < WARP / 2 ? -1.0f : 1.0f;
    grid_wait();  // as qkv_to_cache's
    grid_launch_dependents();
    for (int h = blockIdx.y * QK_WARPS + warp; h < hq + 2 * hkv; h += gridDim.y * QK_WARPS) {
        const float4 x = row[(size_t)h * WARP + lane];
        if (h >= hq + hkv) {
            if (cached)
                store4(v_cache + ((size_t)slot * hkv + (h - hq - hkv)) * D + 4 * lane, x, v_inv);
            continue;
        }
        const bool is_q = h < hq;
        const float sum = warp_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w);
        const float inv = normed ? rsqrtf(sum / D + eps) : 1.0f;
        const float4 w = is_q ? qw : kw;
        const float4 n = make_float4(w.x * (x.x * inv), w.y * (x.y * inv), w.z * (x.z * inv),
                                     w.w * (x.w * inv));
        float4 p;
        p.x = __shfl_xor_sync(0xffffffffu, n.x, WARP / 2);
        p.y = __shfl_xor_sync(0xffffffffu, n.y, WARP / 2);
        p.z = __shfl_xor_sync(0xffffffffu, n.z, WARP / 2);
        p.w = __shfl_xor_sync(0xffffffffu, n.w, WARP / 2);
        const float4 o =
            make_float4(n.x * c.x + sign * (p.x * s.x), n.y * c.y + sign * (p.y * s.y),
                        n.z * c.z + sign * (p.z * s.z), n.w * c.w + sign * (p.w * s.w));
        if (is_q)
            reinterpret_cast<float4*>(q_out + ((size_t)r * hq + h) * D)[lane] = o;
        else if (cached)
            store4(k_cache + ((size_t)slot * hkv + (h - hq)) * D + 4 * lane, o, k_inv);
    }
}

template <typename C>
__device__ __forceinline__ void qkv_to_cache(const float* __restrict__ qkv,
                                             const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, float eps,
                                             const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t,
                                             const unsigned* __restrict__ slots,
                                             float* __restrict__ q_out,
                                             typename C::T* __restrict__ k_cache,
                                             typename C::T* __restrict__ v_cache, int hq, int hkv,
                                             int d, unsigned num_slots, float k_inv, float v_inv) {
    if (d == 4 * WARP) {
        qkv_to_cache_d128<C>(qkv, q_norm, k_norm, eps, cos_t, sin_t, slots, q_out, k_cache,
                             v_cache, hq, hkv, num_slots, k_inv, v_inv);
        return;
    }
    constexpr int PER = QK_MAX_DIM / WARP;  // dims a lane holds: i = lane + u * WARP
    __shared__ float buf[QK_WARPS][QK_MAX_DIM];
    const int r = blockIdx.x, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float* row = qkv + (size_t)r * (hq + 2 * hkv) * d;
    const float* c = cos_t + (size_t)r * d;
    const float* s = sin_t + (size_t)r * d;
    const unsigned slot = slots[r];
    const bool cached = slot < num_slots;
    const int half = d / 2;
    const bool normed = q_norm != nullptr;
    // What every head of the row needs besides its own values, loaded once and all at once:
    // the rotary tables and both norms' weights (read after each head's sum, they were two more
    // round trips a head, in a kernel that decode waits for at every layer).
    float cr[PER], sr[PER], qw[PER], kw[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int i = lane + u * WARP;
        const bool in = i < d;
        cr[u] = in ? c[i] : 0.0f;
        sr[u] = in ? s[i] : 0.0f;
        qw[u] = in ? (normed ? q_norm[i] : 1.0f) : 0.0f;
        kw[u] = in ? (normed ? k_norm[i] : 1.0f) : 0.0f;
    }
    // Under programmatic dependent launch this kernel starts while the q/k/v GEMV drains: what
    // it read above (the step's slots and rotary tables, written before the step, and the norm
    // weights) no kernel writes; the GEMV's output only after the wait.
    grid_wait();
    grid_launch_dependents();
    for (int h = blockIdx.y * QK_WARPS + warp; h < hq + 2 * hkv; h += gridDim.y * QK_WARPS) {
        const float* x = row + (size_t)h * d;
        float xv[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) xv[u] = lane + u * WARP < d ? x[lane + u * WARP] : 0.0f;
        if (h >= hq + hkv) {
            if (cached) {
                typename C::T* dst = v_cache + ((size_t)slot * hkv + (h - hq - hkv)) * d;
#pragma unroll
                for (int u = 0; u < PER; ++u)
                    if (lane + u * WARP < d) dst[lane + u * WARP] = C::store(xv[u], v_inv);
            }
            continue;
        }
        const bool is_q = h < hq;
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < PER; ++u) ss += xv[u] * xv[u];
        const float sum = warp_sum(ss);
        const float inv = normed ? rsqrtf(sum / d + eps) : 1.0f;
#pragma unroll
        for (int u = 0; u < PER; ++u)
            if (lane + u * WARP < d) buf[warp][lane + u * WARP] = (is_q ? qw[u] : kw[u]) * (xv[u] * inv);
        __syncwarp();
        // Rotate-half: out[i] = x[i] cos[i] - x[i + d/2] sin[i] below d/2, and
        // x[i] cos[i] + x[i - d/2] sin[i] from it.
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int i = lane + u * WARP;
            if (i >= d) continue;
            const float xi = buf[warp][i];
            const float o = i < half ? xi * cr[u] - buf[warp][i + half] * sr[u]
                                     : xi * cr[u] + buf[warp][i - half] * sr[u];
            if (is_q) {
                q_out[((size_t)r * hq + h) * d + i] = o;
            } else if (cached) {
                k_cache[((size_t)slot * hkv + (h - hq)) * d + i] = C::store(o, k_inv);
            }
        }
        __syncwarp();
    }
}

// E consecutive halves (E = 2, 4, 8 or 16) as loaded, before conversion: what a pipelined loop
// keeps in registers while the loads are in flight (half the registers of floats).
template <int E>
struct RawHalves {
    static_assert(E == 2 || E == 4 || E == 8 || E == 16, "2 to 16 halves");
    unsigned w[E / 2];

    __device__ __forceinline__ void load(const __half* __restrict__ p) {
        if constexpr (E >= 8) {
#pragma unroll
            for (int i = 0; i < E / 8; ++i) {
                uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
                w[4 * i] = v.x;
                w[4 * i + 1] = v.y;
                w[4 * i + 2] = v.z;
                w[4 * i + 3] = v.w;
            }
        } else if constexpr (E == 4) {
            uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
            w[0] = v.x;
            w[1] = v.y;
        } else {
            w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
        }
    }

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < E / 2; ++i) w[i] = 0u;
    }

    // Halves 2i and 2i + 1 as floats.
    __device__ __forceinline__ float2 pair(int i) const {
        return __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }

    // The elements as halves: these already are.
    __device__ __forceinline__ RawHalves halves() const { return *this; }
};

// E consecutive e4m3 bytes (E = 2, 4, 8 or 16) as loaded: RawHalves' twin for an FP8 cache, half
// the bytes in flight for the same keys.
template <int E>
struct RawF8 {
    static_assert(E == 2 || E == 4 || E == 8 || E == 16, "2 to 16 bytes");
    unsigned w[(E + 3) / 4];

    __device__ __forceinline__ void load(const unsigned char* __restrict__ p) {
        if constexpr (E == 16) {
            uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
            w[0] = v.x;
            w[1] = v.y;
            w[2] = v.z;
            w[3] = v.w;
        } else if constexpr (E == 8) {
            uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
            w[0] = v.x;
            w[1] = v.y;
        } else if constexpr (E == 4) {
            w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
        } else {
            w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
        }
    }

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < (E + 3) / 4; ++i) w[i] = 0u;
    }

    // The bytes as halves times 2^-8 (f8_pair's; the host's scale carries the 2^8), each byte
    // moved into the high byte of a half: pair i of the result is bytes 2i and 2i + 1.
    __device__ __forceinline__ RawHalves<E> halves() const {
        RawHalves<E> h;
#pragma unroll
        for (int i = 0; i < E / 2; ++i) {
            const __half2 p = f8_pair(__byte_perm(w[i / 2], 0, i % 2 ? 0x3424 : 0x1404));
            h.w[i] = *reinterpret_cast<const unsigned*>(&p);
        }
        return h;
    }
};

// Two e4m3 bytes (bits 0-7 and 8-15 of t, or 16-23 and 24-31 with `upper`) as an f16 pair,
// exactly, times F8X2_UNIT: sm_89 and later convert a pair in one instruction, the tensor-core
// decode's busiest work over an FP8 cache; older GPUs (Orin) go through f8_pair (2^-8 times
// the value, three instructions).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define F8X2_UNIT 1.0f
__device__ __forceinline__ unsigned f8x2_halves(unsigned t, bool upper) {
    unsigned h;
    if (upper)
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(h) : "r"(t));
    else
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(h) : "r"(t));
    return h;
}
#else
#define F8X2_UNIT 256.0f
__device__ __forceinline__ unsigned f8x2_halves(unsigned t, bool upper) {
    const __half2 p = f8_pair(__byte_perm(t, 0, upper ? 0x3424 : 0x1404));
    return *reinterpret_cast<const unsigned*>(&p);
}
#endif

// The cache formats: element type, how a value is stored, E elements' loads, and what their
// halves() are to be multiplied by besides the cache's scale (RawF8's 2^-8 undone); for the
// tensor-core decode, E loaded elements as f16 pairs (mma_halves), element b of two rows as
// one pair (two_keys), and what those are to be multiplied by (MMA_UNIT).
struct F16Cache {
    using T = __half;
    static constexpr bool FP8 = false;
    static constexpr float UNIT = 1.0f;
    template <int E>
    using Raw = RawHalves<E>;
    static __device__ __forceinline__ __half store(float x, float) { return __float2half_rn(x); }
    static __device__ __forceinline__ float value(__half x) { return __half2float(x); }
    static constexpr float MMA_UNIT = 1.0f;
    template <int E>
    static __device__ __forceinline__ RawHalves<E> mma_halves(const RawHalves<E>& x) { return x; }
    // Element b of two loaded rows x and y as one f16 pair (x's low): the tensor-core decode's
    // value fragments.
    template <int E>
    static __device__ __forceinline__ unsigned two_keys(const RawHalves<E>& x, const RawHalves<E>& y, int b) {
        return __byte_perm(x.w[b / 2], y.w[b / 2], b % 2 ? 0x7632 : 0x5410);
    }
};
struct F8Cache {
    using T = unsigned char;
    static constexpr bool FP8 = true;
    static constexpr float UNIT = 256.0f;
    template <int E>
    using Raw = RawF8<E>;
    static __device__ __forceinline__ unsigned char store(float x, float inv) {
        return f8_store(x, inv);
    }
    static __device__ __forceinline__ float value(unsigned char b) { return f8_value(b); }
    static constexpr float MMA_UNIT = F8X2_UNIT;
    template <int E>
    static __device__ __forceinline__ RawHalves<E> mma_halves(const RawF8<E>& x) {
        RawHalves<E> h;
#pragma unroll
        for (int i = 0; i < E / 2; ++i) h.w[i] = f8x2_halves(x.w[i / 2], i % 2);
        return h;
    }
    // Byte b of each row side by side (x's first), then as a pair.
    template <int E>
    static __device__ __forceinline__ unsigned two_keys(const RawF8<E>& x, const RawF8<E>& y, int b) {
        const int c = b % 4;
        return f8x2_halves(__byte_perm(x.w[b / 4], y.w[b / 4], ((4 + c) << 4) | c), false);
    }
};

extern "C" __global__ void qkv_to_cache_f32(const float* __restrict__ qkv,
                                            const float* __restrict__ q_norm,
                                            const float* __restrict__ k_norm, float eps,
                                            const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t,
                                            const unsigned* __restrict__ slots,
                                            float* __restrict__ q_out, __half* __restrict__ k_cache,
                                            __half* __restrict__ v_cache, int hq, int hkv, int d,
                                            unsigned num_slots) {
    qkv_to_cache<F16Cache>(qkv, q_norm, k_norm, eps, cos_t, sin_t, slots, q_out, k_cache, v_cache,
                           hq, hkv, d, num_slots, 1.0f, 1.0f);
}
extern "C" __global__ void qkv_to_cache_f8(const float* __restrict__ qkv,
                                           const float* __restrict__ q_norm,
                                           const float* __restrict__ k_norm, float eps,
                                           const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t,
                                           const unsigned* __restrict__ slots,
                                           float* __restrict__ q_out,
                                           unsigned char* __restrict__ k_cache,
                                           unsigned char* __restrict__ v_cache, int hq, int hkv,
                                           int d, unsigned num_slots, float k_inv, float v_inv) {
    qkv_to_cache<F8Cache>(qkv, q_norm, k_norm, eps, cos_t, sin_t, slots, q_out, k_cache, v_cache,
                          hq, hkv, d, num_slots, k_inv, v_inv);
}

// Sum over the 16 lanes of a half-warp (each half gets its own total).
__device__ __forceinline__ float half_warp_sum(float v) {
    for (int o = WARP / 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// What both decode kernels' blocks know of their share of the keys: sequence s's query row,
// keys (counting this step's) and block list, and split `split`'s keys [begin, end) of chunks
// rounded up to PD_MIN_CHUNK. Splits past the keys (the grid is sized for the longest sequence
// a recorded step may see) only count themselves in; the merge reads the first `active`.
struct DecodeSplit {
    const unsigned* __restrict__ blocks;
    unsigned row, kv_len, off;
    int begin, end, active, block_size, shift;
    bool pow2;

    __device__ DecodeSplit(const unsigned* __restrict__ seqs, const unsigned* __restrict__ blocks,
                           int s, int split, int splits, int block_size)
        : blocks(blocks), row(seqs[4 * s]), kv_len(seqs[4 * s + 2]), off(seqs[4 * s + 3]),
          block_size(block_size) {
        int chunk = ((int)kv_len + splits - 1) / splits;
        chunk = (chunk + PD_MIN_CHUNK - 1) / PD_MIN_CHUNK * PD_MIN_CHUNK;
        begin = split * chunk;
        end = min((int)kv_len, begin + chunk);
        active = min(splits, ((int)kv_len + chunk - 1) / chunk);
        // Block sizes are powers of two in practice: a shift, not a division, per key.
        pow2 = (block_size & (block_size - 1)) == 0;
        shift = __ffs(block_size) - 1;
    }

    // Key j's slot in the cache.
    __device__ __forceinline__ unsigned slot(int j) const {
        const int blk = pow2 ? (j >> shift) : j / block_size;
        return blocks[off + blk] * (unsigned)block_size + (unsigned)(j - blk * block_size);
    }
};

// The end of both decode kernels: each warp's softmax over its keys (max in natural log, sum,
// unnormalized output, per head, in shared memory) merged into the block's, then written out
// (one split) or as the split's partials, the last block of a (sequence, KV head) to finish
// merging the splits.
template <int D, int GP>
__device__ void paged_decode_finish(const float (&sm_m)[PD_WARPS][GP], const float (&sm_l)[PD_WARPS][GP],
                                    const float (&sm_o)[PD_WARPS][GP][D], int s, int kvh, int split,
                                    int splits, int active, int G, unsigned row, int hq, int hkv,
                                    float* __restrict__ part_o, float* __restrict__ part_ml,
                                    unsigned* __restrict__ done, float* __restrict__ out) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();
    // One thread per (head, dim) of the block's G heads.
    for (int t = threadIdx.x; t < (split < active ? G * D : 0); t += blockDim.x) {
        int g = t / D, c = t % D;
        float mb = NEG_INF;
        for (int w = 0; w < PD_WARPS; ++w) mb = fmaxf(mb, sm_m[w][g]);
        // A warp (or the whole split) that saw no key has max -inf and weighs nothing.
        float lb = 0.0f, o = 0.0f;
        for (int w = 0; w < PD_WARPS; ++w) {
            if (sm_m[w][g] == NEG_INF) continue;
            float f = expf(sm_m[w][g] - mb);
            lb += sm_l[w][g] * f;
            o += sm_o[w][g][c] * f;
        }
        if (splits == 1) {
            // The whole sequence in one block (batched decode): its output, no partials.
            out[((size_t)row * hq + kvh * G + g) * D + c] = lb > 0.0f ? o / lb : 0.0f;
            continue;
        }
        size_t part = ((size_t)s * hq + kvh * G + g) * splits + split;
        part_o[part * D + c] = o;
        if (c == 0) {
            part_ml[part * 2] = mb;
            part_ml[part * 2 + 1] = lb;
        }
    }
    if (splits == 1) return;

    // Make this block's partials visible, then count it in; the last one merges.
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) {
        unsigned* counter = done + (size_t)s * hkv + kvh;
        last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // out = Σ_i part_o_i w_i, w_i = e^(m_i - M) / Σ_i l_i e^(m_i - M), M = max_i m_i, per head
    // and dim. The partials are read through L2 (__ldcg): other blocks wrote them, so L1 may
    // hold stale lines. The weights first, a warp per head and a lane per split (two, past 32
    // splits); then each thread keeps its outputs' loads of several splits in flight (a thread
    // walking the splits one load after another took 33 us at 22 splits).
    static_assert(PD_MAX_SPLITS <= 2 * WARP, "at most two splits a lane");
    __shared__ float sm_w[GP][PD_MAX_SPLITS];
    for (int g = warp; g < G; g += PD_WARPS) {
        const size_t base = ((size_t)s * hq + kvh * G + g) * splits;
        float mi[2], li[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = lane + h * WARP;
            mi[h] = i < active ? __ldcg(part_ml + (base + i) * 2) : NEG_INF;
            li[h] = i < active ? __ldcg(part_ml + (base + i) * 2 + 1) : 0.0f;
        }
        float mx = fmaxf(mi[0], mi[1]);
        for (int o = WARP / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
        float w[2], sum = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            w[h] = mi[h] == NEG_INF ? 0.0f : expf(mi[h] - mx);
            sum += li[h] * w[h];
        }
        const float total = warp_sum(sum);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (lane + h * WARP < active) sm_w[g][lane + h * WARP] = w[h] / total;
    }
    __syncthreads();
    constexpr int OUTS = (GP * D + PD_WARPS * WARP - 1) / (PD_WARPS * WARP);
    float o[OUTS];
#pragma unroll
    for (int u = 0; u < OUTS; ++u) o[u] = 0.0f;
#pragma unroll 8
    for (int i = 0; i < active; ++i) {
#pragma unroll
        for (int u = 0; u < OUTS; ++u) {
            int t = threadIdx.x + u * PD_WARPS * WARP, g = t / D;
            size_t part = ((size_t)s * hq + kvh * G + g) * splits + i;
            if (g < G) o[u] += __ldcg(part_o + part * D + t % D) * sm_w[g][i];
        }
    }
#pragma unroll
    for (int u = 0; u < OUTS; ++u) {
        int t = threadIdx.x + u * PD_WARPS * WARP, g = t / D;
        if (g < G) out[((size_t)row * hq + kvh * G + g) * D + t % D] = o[u];
    }
}


// Split-K decode attention over the paged cache (seeds 000/001, flash-decoding). Block
// (s, kvh, split) takes sequence s's one query for the G = hq / hkv query heads that share KV
// head kvh, and the split-th chunk of its keys: each key row is read once for all G heads.
//
// Each half-warp takes a key (16 lanes of D / 16 consecutive dims: 16-byte loads at D = 128),
// so one shuffle tree reduces two keys' scores. A warp takes PD_KEYS consecutive keys at a
// time, every PD_WARPS-th such group, all their loads issued before any math, and the halves
// keep separate online softmaxes (base 2: q is scaled by log2 e) merged at the end. The loop is
// software-pipelined: the next group's loads are issued before this group's math, so a warp
// always has loads in flight (with the one-split path below, on an H100 at 512 keys: batch 64
// 9.94 -> 9.56 ms a step, batch 128 13.54 -> 12.84). Measured
// with ncu on an H100 (8B shapes, 64 sequences at 512 keys): the kernel this replaces, a whole
// warp per key, issued ~235 instructions a key (five-level shuffle trees, a division per key for
// the block table) and reached 23% of DRAM bandwidth. GP, the heads per KV head the kernel is
// compiled for, is the power of two at or above G (registers scale with it; heads g >= G are
// skipped). The warps merge through shared memory; the block writes its unnormalized output and
// (max, sum) per head, natural log: part_o [seqs, hq, splits, D], part_ml [seqs, hq, splits, 2].
// The last block of a (sequence, KV head) to finish, as counted in `done` (one counter each,
// zero between launches: that block sets it back), merges the splits into out [rows, hq, D]. A
// second kernel for the merge cost a launch per layer, longer than the merge itself at batch 1.
// With one split (large batches), the block writes out itself: no partials, fence or counter.
// An FP8 cache (C = F8Cache) loads E bytes a lane instead of E halves; its keys' scale is folded
// into q and its values' into the output (both linear), so the loop is the f16 one.
template <int D, int GP, typename C>
__device__ void paged_decode(const float* __restrict__ q, const typename C::T* __restrict__ kc,
                             const typename C::T* __restrict__ vc, const unsigned* __restrict__ seqs,
                             const unsigned* __restrict__ blocks, float* __restrict__ part_o,
                             float* __restrict__ part_ml, unsigned* __restrict__ done,
                             float* __restrict__ out, int hq, int hkv, int block_size,
                             float scale, float k_scale, float v_scale) {
    using Raw = typename C::template Raw<D / (WARP / 2)>;
    constexpr int H = WARP / 2;      // lanes per key
    constexpr int E = D / H;         // dims per lane
    constexpr int KH = PD_KEYS / 2;  // keys per half-warp per step
    const int s = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int half = lane / H, hl = lane % H;
    const int G = hq / hkv;
    const DecodeSplit sp(seqs, blocks, s, split, splits, block_size);
    const unsigned row = sp.row, kv_len = sp.kv_len;
    const int begin = sp.begin, end = sp.end, active = sp.active;
    // Issues the loads of the keys at j0 .. (this half-warp's KH of them) into kr, vr; keys past
    // the split are zeros (weight 0, and 0 * whatever the registers held could be NaN).
    auto issue = [&](int j0, Raw (&kr)[KH], Raw (&vr)[KH]) {
#pragma unroll
        for (int u = 0; u < KH; ++u) {
            int j = j0 + 2 * u + half;
            if (j < end) {
                size_t at = ((size_t)sp.slot(j) * hkv + kvh) * D + hl * E;
                kr[u].load(kc + at);
                vr[u].load(vc + at);
            } else {
                kr[u].zero();
                vr[u].zero();
            }
        }
    };
    // The loop below is software-pipelined; its first group's loads go out before q is read,
    // so that the two round trips overlap (H100, 8B, two rounds against the loads after q:
    // batch-1 decode at 512 keys 6.058 / 6.081 -> 6.032 / 6.032 ms a token, at 4096 6.475 /
    // 6.503 -> 6.430 / 6.417, batch 64 9.471 / 9.469 -> 9.273 / 9.297 ms a step).
    const int step = PD_WARPS * PD_KEYS;
    Raw ka[KH], va[KH], kb[KH], vb[KH];
    int j0 = begin + warp * PD_KEYS;
    // Under programmatic dependent launch this kernel starts while qkv_to_cache runs, which
    // writes q and each sequence's newest key (kv_len - 1): only a first group of older keys
    // goes out before the wait.
    const bool early = j0 + PD_KEYS < (int)kv_len;
    if (early) issue(j0, ka, va);
    grid_wait();
    if (!early) issue(j0, ka, va);

    float qr[GP][E], acc[GP][E], m[GP], l[GP];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[g][e] = 0.0f;
            qr[g][e] = g < G ? q[((size_t)row * hq + kvh * G + g) * D + hl * E + e] * scale *
                                   1.4426950408889634f
                             : 0.0f;
            if constexpr (C::FP8) qr[g][e] *= k_scale * C::UNIT;
        }
    }
    // The online softmax over the keys at j0 .., from their loaded rows.
    auto consume = [&](int j0, const Raw (&kr)[KH], const Raw (&vr)[KH]) {
        // Keys and values as f16 pairs, converted to floats where they are used, not held as
        // floats: registers for the next group's loads in flight instead. An FP8 cache's bytes
        // become those pairs here, once for all G heads: converted inside the head loop, each
        // pair was converted again for every head (a head past G is skipped at run time, so
        // the compiler did not share one head's conversion with the next), which made the FP8
        // loop 35% longer than the f16 one at d 128 with 4 heads (sm_90 SASS: 1866 against
        // 1383 instructions an iteration of 8 keys); now 1483, one conversion a pair more.
        RawHalves<E> kh[KH], vh[KH];
#pragma unroll
        for (int u = 0; u < KH; ++u) {
            kh[u] = kr[u].halves();
            vh[u] = vr[u].halves();
        }
#pragma unroll
        for (int g = 0; g < GP; ++g) {
            if (g >= G) continue;
            float score[KH], m_new = m[g];
#pragma unroll
            for (int u = 0; u < KH; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < E / 2; ++i) {
                    float2 k2 = kh[u].pair(i);
                    dot += qr[g][2 * i] * k2.x + qr[g][2 * i + 1] * k2.y;
                }
                dot = half_warp_sum(dot);
                score[u] = j0 + 2 * u + half < end ? dot : NEG_INF;
                m_new = fmaxf(m_new, score[u]);
            }
            // One rescale for the step's keys; a half that saw no key yet keeps its state.
            float corr = m_new == NEG_INF ? 1.0f : exp2f(m[g] - m_new);
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < KH; ++u) {
                float p = score[u] == NEG_INF ? 0.0f : exp2f(score[u] - m_new);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < E / 2; ++i) {
                    float2 v2 = vh[u].pair(i);
                    acc[g][2 * i] += p * v2.x;
                    acc[g][2 * i + 1] += p * v2.y;
                }
            }
            m[g] = m_new;
        }
    };
    // Software-pipelined: the next group's loads are in flight while this group's math runs
    // (two register buffers, alternated by unrolling twice so that neither is indexed at run
    // time), so a warp always has memory requests out.
    for (; j0 < end; j0 += 2 * step) {
        issue(j0 + step, kb, vb);
        consume(j0, ka, va);
        if (j0 + step >= end) break;
        issue(j0 + 2 * step, ka, va);
        consume(j0 + step, kb, vb);
    }

    // The two halves' softmaxes into one per warp (lanes hl of both halves then agree).
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        float mo = __shfl_xor_sync(0xffffffff, m[g], H);
        float lo = __shfl_xor_sync(0xffffffff, l[g], H);
        float mm = fmaxf(m[g], mo);
        float fa = m[g] == NEG_INF ? 0.0f : exp2f(m[g] - mm);
        float fb = mo == NEG_INF ? 0.0f : exp2f(mo - mm);
        l[g] = l[g] * fa + lo * fb;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            float ao = __shfl_xor_sync(0xffffffff, acc[g][e], H);
            acc[g][e] = acc[g][e] * fa + ao * fb;
        }
        m[g] = mm;
    }

    __shared__ float sm_m[PD_WARPS][GP], sm_l[PD_WARPS][GP];
    __shared__ float sm_o[PD_WARPS][GP][D];
#pragma unroll
    for (int g = 0; g < GP; ++g) {
        if (g < G && half == 0) {
            if (hl == 0) {
                // Back to natural log for the merges below.
                sm_m[warp][g] = m[g] == NEG_INF ? NEG_INF : m[g] * 0.6931471805599453f;
                sm_l[warp][g] = l[g];
            }
#pragma unroll
            for (int e = 0; e < E; ++e)
                sm_o[warp][g][hl * E + e] = C::FP8 ? acc[g][e] * (v_scale * C::UNIT) : acc[g][e];
        }
    }
    paged_decode_finish<D, GP>(sm_m, sm_l, sm_o, s, kvh, split, splits, active, G, row, hq, hkv,
                               part_o, part_ml, done, out);
}

// An 8 x 8 matrix of halves in mma's fragment layout (lane 4 r + c holds row r, columns 2c and
// 2c + 1), transposed across the warp: the lane then holds the transpose's row r.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Decode attention on the tensor cores (mma.sync m16n8k16, f16 operands, f32 sums): the
// per-lane kernel above issued ~170 instructions a key at 4 heads a KV head (the dot products
// and weighted sums as scalar FMAs, shuffle trees), which at batch 64 and 4096 keys made the
// step's attention issue-bound at well under the memory's bandwidth, and kept an FP8 cache
// (half the bytes) from being any faster. Same grid, splits and merge (paged_decode_finish).
//
// A warp takes 16 keys at a time, every PD_WARPS-th such tile of the split, and computes with
// the keys as mma's 16 rows and the G <= 8 query heads as its 8 columns:
// - scores S^T (16 keys x 8 heads) = K (16 x D) Q^T, in D / 16 steps. Any order of the dims
//   gives the same sums, so each lane loads one contiguous quarter of a key row (dims
//   [KE tig, KE tig + KE), KE = D / 4; rows gid and gid + 8 of the tile) and step kk takes
//   its words 2 kk and 2 kk + 1: the A fragment straight from the loads, q's B fragment
//   (head gid) the same dims of q. q goes in as two f16 parts (hi + lo: f32 to 2^-22).
// - the online softmax per head over the tile's 16 keys (a lane holds heads 2 tig, 2 tig + 1
//   of keys gid and gid + 8; the max across the 8 gids by 3 shuffles), base 2 as above.
// - output O^T (D x 8 heads) += V^T (D x 16 keys) P^T, D / 16 row tiles. The weights' C
//   fragment, transposed in registers (movmatrix), is the B fragment (keys gid, heads 2 tig
//   -> keys 2 tig, head gid), again as hi + lo halves. Row r of tile i stands for dim
//   VE gid + 2 i (r = gid) or + 2 i + 1 (r = gid + 8), VE = D / 8, so a lane loads one
//   contiguous eighth of its four keys' value rows (2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9)
//   and builds each A register from two of them with one byte permute (FP8: and a conversion,
//   f8x2_halves).
// The loads of the warp's next tile go out as soon as the current tile's registers are read
// (K after the scores, V after the output), so a warp keeps 8 KiB in flight (f16, D = 128).
template <int D, int GP, typename C>
__device__ void paged_decode_mma(const float* __restrict__ q, const typename C::T* __restrict__ kc,
                                 const typename C::T* __restrict__ vc, const unsigned* __restrict__ seqs,
                                 const unsigned* __restrict__ blocks, float* __restrict__ part_o,
                                 float* __restrict__ part_ml, unsigned* __restrict__ done,
                                 float* __restrict__ out, int hq, int hkv, int block_size,
                                 float scale, float k_scale, float v_scale) {
    static_assert(D % 16 == 0 && D <= 128 && GP <= 8, "d a multiple of 16 up to 128, <= 8 heads");
    constexpr int TILE = 16;
    constexpr int KS = D / 16;            // score steps, and output row tiles
    constexpr int KE = D / 4;             // dims of a key row a lane loads
    constexpr int KC = KE < 16 ? KE : 16; // ... in loads of KC elements
    constexpr int VE = D / 8;             // dims of a value row a lane loads
    using KRaw = typename C::template Raw<KC>;
    using VRaw = typename C::template Raw<VE>;
    const int s = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int gid = lane / 4, tig = lane % 4;
    const int G = hq / hkv;
    const DecodeSplit sp(seqs, blocks, s, split, splits, block_size);
    const unsigned row = sp.row, kv_len = sp.kv_len;
    const int begin = sp.begin, end = sp.end, active = sp.active;
    // A tile starts at a multiple of 16 keys (splits take multiples of PD_MIN_CHUNK), so where
    // the cache's blocks are multiples of 16 keys (16 by default) its keys lie in one block:
    // one block-table lookup a tile (tile_slot), its keys' slots that one plus 0-15. Other
    // block sizes look each key up.
    const bool one_block = block_size % TILE == 0;
    auto tile_slot = [&](int j0) -> unsigned { return one_block && j0 < end ? sp.slot(j0) : 0u; };
    // Key j0 + r's row in the cache (its KV head's), or null past the split.
    auto key_row = [&](const typename C::T* __restrict__ cache, unsigned base, int j0,
                       int r) -> const typename C::T* {
        const int j = j0 + r;
        if (j >= end) return nullptr;
        const unsigned slot = one_block ? base + (unsigned)r : sp.slot(j);
        return cache + ((size_t)slot * hkv + kvh) * D;
    };
    // Keys rows past the split load as zeros (their weight is 0, and 0 times what the
    // registers held could be NaN).
    auto issue_k = [&](int j0, KRaw (&kr)[2][KE / KC]) {
        const unsigned base = tile_slot(j0);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const typename C::T* p = key_row(kc, base, j0, gid + 8 * r);
#pragma unroll
            for (int c = 0; c < KE / KC; ++c) {
                if (p) kr[r][c].load(p + KE * tig + KC * c);
                else kr[r][c].zero();
            }
        }
    };
    auto issue_v = [&](int j0, VRaw (&vr)[4]) {
        const unsigned base = tile_slot(j0);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const typename C::T* p = key_row(vc, base, j0, 2 * tig + (u % 2) + 8 * (u / 2));
            if (p) vr[u].load(p + VE * gid);
            else vr[u].zero();
        }
    };
    const int step = PD_WARPS * TILE;
    KRaw kr[2][KE / KC];
    VRaw vr[4];
    int j0 = begin + warp * TILE;
    // Under programmatic dependent launch only tiles older than the step's newest key go out
    // before the wait (qkv_to_cache writes that key).
    const bool early = j0 + TILE < (int)kv_len;
    if (early) {
        issue_k(j0, kr);
        issue_v(j0, vr);
    }
    grid_wait();
    if (!early) {
        issue_k(j0, kr);
        issue_v(j0, vr);
    }
    // q's B fragments, the same for every warp of the block, in shared memory rather than 32
    // registers a lane (what lets 3 f16 blocks an SM fit): step kk, lane (gid, tig) holds head
    // gid's dims KE tig + 4 kk .. + 3 (zero past G) as hi, hi, lo, lo halves, scaled for base
    // 2, one 16-byte load. An FP8 cache's key scale (and MMA_UNIT) multiplies the scores
    // instead, to keep q's halves in f16's range whatever the scale.
    __shared__ uint4 sm_q[KS][WARP];
    {
        const float f = scale * 1.4426950408889634f;
        for (int t = threadIdx.x; t < KS * WARP; t += blockDim.x) {
            const int kk = t / WARP, ln = t % WARP, hg = ln / 4;
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (hg < G)
                x = *reinterpret_cast<const float4*>(q + ((size_t)row * hq + kvh * G + hg) * D +
                                                     KE * (ln % 4) + 4 * kk);
            uint4 b;
            split_halves(x.x * f, x.y * f, b.x, b.z);
            split_halves(x.z * f, x.w * f, b.y, b.w);
            sm_q[kk][ln] = b;
        }
    }
    __syncthreads();
    const float score_unit = C::FP8 ? k_scale * C::MMA_UNIT : 1.0f;
    float o[KS][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < KS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (; j0 < end; j0 += step) {
        // Scores: keys gid and gid + 8 (rows), heads 2 tig and 2 tig + 1 (columns).
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            RawHalves<KC> kh[2][KE / KC];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int c = 0; c < KE / KC; ++c) kh[r][c] = C::mma_halves(kr[r][c]);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                constexpr int PW = KC / 2;  // words a load holds
                const unsigned a[4] = {kh[0][(2 * kk) / PW].w[(2 * kk) % PW], kh[1][(2 * kk) / PW].w[(2 * kk) % PW],
                                       kh[0][(2 * kk + 1) / PW].w[(2 * kk + 1) % PW],
                                       kh[1][(2 * kk + 1) / PW].w[(2 * kk + 1) % PW]};
                const uint4 b = sm_q[kk][lane];
                mma_16816(sc, a, b.x, b.y);
                mma_16816(sc, a, b.z, b.w);
            }
        }
        issue_k(j0 + step, kr);
        const bool in0 = j0 + gid < end, in1 = j0 + gid + 8 < end;
        float p[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float s0 = in0 ? sc[e] * score_unit : NEG_INF;
            const float s1 = in1 ? sc[2 + e] * score_unit : NEG_INF;
            float mx = fmaxf(s0, s1);
#pragma unroll
            for (int x = 4; x < WARP; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, x));
            const float m_new = fmaxf(m[e], mx);
            // A head that saw no key yet keeps its state.
            const float corr = m_new == NEG_INF ? 1.0f : exp2f(m[e] - m_new);
            p[e] = s0 == NEG_INF ? 0.0f : exp2f(s0 - m_new);
            p[2 + e] = s1 == NEG_INF ? 0.0f : exp2f(s1 - m_new);
            l[e] = l[e] * corr + p[e] + p[2 + e];
            m[e] = m_new;
#pragma unroll
            for (int i = 0; i < KS; ++i) {
                o[i][e] *= corr;
                o[i][2 + e] *= corr;
            }
        }
        // The weights as B fragments: hi and lo halves, keys 0-7 (b0) and 8-15 (b1).
        unsigned ph[2], pl[2];
        split_halves(p[0], p[1], ph[0], pl[0]);
        split_halves(p[2], p[3], ph[1], pl[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            ph[h] = movmatrix_trans(ph[h]);
            pl[h] = movmatrix_trans(pl[h]);
        }
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            const unsigned a[4] = {C::two_keys(vr[0], vr[1], 2 * i), C::two_keys(vr[0], vr[1], 2 * i + 1),
                                   C::two_keys(vr[2], vr[3], 2 * i), C::two_keys(vr[2], vr[3], 2 * i + 1)};
            mma_16816(o[i], a, ph[0], ph[1]);
            mma_16816(o[i], a, pl[0], pl[1]);
        }
        issue_v(j0 + step, vr);
    }
    // Each lane summed its own keys' weights: the totals across the 8 gids.
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int x = 4; x < WARP; x <<= 1) l[e] += __shfl_xor_sync(0xffffffff, l[e], x);

    __shared__ float sm_m[PD_WARPS][GP], sm_l[PD_WARPS][GP];
    __shared__ float sm_o[PD_WARPS][GP][D];
    const float unit = C::FP8 ? v_scale * C::MMA_UNIT : 1.0f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * tig + e;
        if (h >= G) continue;
        if (gid == 0) {
            sm_m[warp][h] = m[e] == NEG_INF ? NEG_INF : m[e] * 0.6931471805599453f;
            sm_l[warp][h] = l[e];
        }
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            sm_o[warp][h][VE * gid + 2 * i] = o[i][e] * unit;
            sm_o[warp][h][VE * gid + 2 * i + 1] = o[i][2 + e] * unit;
        }
    }
    paged_decode_finish<D, GP>(sm_m, sm_l, sm_o, s, kvh, split, splits, active, G, row, hq, hkv,
                               part_o, part_ml, done, out);
}

// paged_decode_d{D}_g{GP}, with at most 65536 / (128 MINB) registers a thread so that
// MINB blocks fit on an SM (occupancy is what hides the latency the loads in flight do not):
// 4 where the registers allow, 2 for the larger q and output tiles. None for D = 256 with 8
// heads per KV head (q and the output alone take 256 registers): the host uses
// paged_attention_rows_f16 there. cuda/tests/cuda_twin.rs fails on any spill.
// The 8B model's kernel (d 128, 4 heads a KV head) fits 128 registers on sm_90 and needs one
// more on sm_87 (Orin), whose ptxas then spills: 3 blocks an SM there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define PD_MINB_D128_G4 3
#else
#define PD_MINB_D128_G4 4
#endif
// FN##_d{D}_g{GP} over an f16 cache and FN##_f8_d{D}_g{GP} over an FP8 one (with its keys' and
// values' scales), MINB and MINB_F8 blocks an SM, for FN = paged_decode (PD_KERNEL, the same
// bound for both) and paged_decode_mma (PD_MMA_KERNEL, below).
#define PD_KERNELS(FN, D, GP, MINB, MINB_F8)                                                      \
    extern "C" __global__ void __launch_bounds__(PD_WARPS * WARP, MINB)                           \
        FN##_d##D##_g##GP(                                                                        \
            const float* __restrict__ q, const __half* __restrict__ kc,                           \
            const __half* __restrict__ vc, const unsigned* __restrict__ seqs,                     \
            const unsigned* __restrict__ blocks, float* __restrict__ part_o,                      \
            float* __restrict__ part_ml, unsigned* __restrict__ done, float* __restrict__ out,    \
            int hq, int hkv, int block_size, float scale) {                                       \
        grid_launch_dependents(); /* the o projection's GEMV may stage its weights meanwhile */   \
        FN<D, GP, F16Cache>(q, kc, vc, seqs, blocks, part_o, part_ml, done, out, hq, hkv,         \
                            block_size, scale, 1.0f, 1.0f);                                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(PD_WARPS * WARP, MINB_F8)                        \
        FN##_f8_d##D##_g##GP(                                                                     \
            const float* __restrict__ q, const unsigned char* __restrict__ kc,                    \
            const unsigned char* __restrict__ vc, const unsigned* __restrict__ seqs,              \
            const unsigned* __restrict__ blocks, float* __restrict__ part_o,                      \
            float* __restrict__ part_ml, unsigned* __restrict__ done, float* __restrict__ out,    \
            int hq, int hkv, int block_size, float scale, float k_scale, float v_scale) {         \
        grid_launch_dependents();                                                                 \
        FN<D, GP, F8Cache>(q, kc, vc, seqs, blocks, part_o, part_ml, done, out, hq, hkv,          \
                           block_size, scale, k_scale, v_scale);                                  \
    }
#define PD_KERNEL(D, GP, MINB) PD_KERNELS(paged_decode, D, GP, MINB, MINB)

PD_KERNEL(32, 1, 4)
PD_KERNEL(32, 2, 4)
PD_KERNEL(32, 4, 4)
PD_KERNEL(32, 8, 4)
PD_KERNEL(64, 1, 4)
PD_KERNEL(64, 2, 4)
PD_KERNEL(64, 4, 4)
PD_KERNEL(64, 8, 4)
PD_KERNEL(128, 1, 4)
PD_KERNEL(128, 2, 4)
PD_KERNEL(128, 4, PD_MINB_D128_G4)
PD_KERNEL(128, 8, 2)
PD_KERNEL(256, 1, 4)
PD_KERNEL(256, 2, 2)
PD_KERNEL(256, 4, 2)

// paged_decode_mma_d{D}_g{GP} and paged_decode_mma_f8_d{D}_g{GP}: the tensor-core decode,
// where the host picks it (head dims 32, 64 and 128, 2 to 8 heads a KV head), MINB and MINB_F8
// blocks an SM. At d 128, with q's fragments in shared memory, the f16 kernel fits 3 blocks'
// registers (153 on sm_90; at 4 blocks it spills) and the FP8 one, its loads half the bytes, 4
// (127). From 2 and 3 blocks (q in 32 registers a lane): at 64 sequences and 4096 keys an FP8
// cache decoded 4,981 -> 5,987 tok/s, at 128 sequences and 512 keys f16 13,510 -> 14,424 (H200).
#define PD_MMA_KERNEL(D, GP, MINB, MINB_F8) PD_KERNELS(paged_decode_mma, D, GP, MINB, MINB_F8)

PD_MMA_KERNEL(32, 2, 4, 4)
PD_MMA_KERNEL(32, 4, 4, 4)
PD_MMA_KERNEL(32, 8, 4, 4)
PD_MMA_KERNEL(64, 2, 4, 4)
PD_MMA_KERNEL(64, 4, 4, 4)
PD_MMA_KERNEL(64, 8, 4, 4)
PD_MMA_KERNEL(128, 2, 3, 4)
PD_MMA_KERNEL(128, 4, 3, 4)
PD_MMA_KERNEL(128, 8, 3, 4)

// Any head dim up to 256, any number of queries: one warp per (sequence, query, head), online
// softmax over the sequence's keys; lanes hold dims lane, lane + 32, ... Sequence seq0 + z of
// the grid (x: query, y: head). What runs where the tensor-core and split-K kernels do not
// (few queries of a prefill chunk, odd head dims). paged_attention_rows_f8: the same over an
// FP8 cache, its keys' scale folded into q and its values' into the output.
template <typename C>
__device__ __forceinline__ void paged_attention_rows(
    const float* __restrict__ q, const typename C::T* __restrict__ kc,
    const typename C::T* __restrict__ vc, const unsigned* __restrict__ seqs,
    const unsigned* __restrict__ blocks, float* __restrict__ out, int seq0, int hq, int hkv, int d,
    int block_size, float scale, float k_scale, float v_scale) {
    const int s = seq0 + blockIdx.z, i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const unsigned row0 = seqs[4 * s], n = seqs[4 * s + 1], kv_len = seqs[4 * s + 2],
                   off = seqs[4 * s + 3];
    if (i >= (int)n) return;
    const int visible = (int)(kv_len - n) + i + 1, kvh = h / (hq / hkv);
    const size_t row = row0 + i;
    const float* qv = q + (row * hq + h) * d;
    float qr[8], acc[8];
    const int per = (d + WARP - 1) / WARP;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        int c = lane + r * WARP;
        qr[r] = (r < per && c < d) ? qv[c] * scale : 0.0f;
        if constexpr (C::FP8) qr[r] *= k_scale;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, denom = 0.0f;
    for (int j = 0; j < visible; ++j) {
        size_t at = ((size_t)key_slot(blocks, off, j, block_size) * hkv + kvh) * d;
        float dot = 0.0f;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int c = lane + r * WARP;
            if (r < per && c < d) dot += qr[r] * C::value(kc[at + c]);
        }
        float score = warp_sum(dot);
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new), p = expf(score - m_new);
        denom = denom * corr + p;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int c = lane + r * WARP;
            if (r < per && c < d) acc[r] = acc[r] * corr + p * C::value(vc[at + c]);
        }
        m = m_new;
    }
    float* o = out + (row * hq + h) * d;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        int c = lane + r * WARP;
        if (r < per && c < d) o[c] = C::FP8 ? acc[r] / denom * v_scale : acc[r] / denom;
    }
}

extern "C" __global__ void paged_attention_rows_f16(const float* __restrict__ q,
                                                    const __half* __restrict__ kc,
                                                    const __half* __restrict__ vc,
                                                    const unsigned* __restrict__ seqs,
                                                    const unsigned* __restrict__ blocks,
                                                    float* __restrict__ out, int seq0, int hq,
                                                    int hkv, int d, int block_size, float scale) {
    paged_attention_rows<F16Cache>(q, kc, vc, seqs, blocks, out, seq0, hq, hkv, d, block_size,
                                   scale, 1.0f, 1.0f);
}
extern "C" __global__ void paged_attention_rows_f8(const float* __restrict__ q,
                                                   const unsigned char* __restrict__ kc,
                                                   const unsigned char* __restrict__ vc,
                                                   const unsigned* __restrict__ seqs,
                                                   const unsigned* __restrict__ blocks,
                                                   float* __restrict__ out, int seq0, int hq,
                                                   int hkv, int d, int block_size, float scale,
                                                   float k_scale, float v_scale) {
    paged_attention_rows<F8Cache>(q, kc, vc, seqs, blocks, out, seq0, hq, hkv, d, block_size,
                                  scale, k_scale, v_scale);
}

// out[i, :] = x[rows[i], :]: the rows whose logits a step needs. One block per output row.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x,
                                           const unsigned* __restrict__ rows,
                                           float* __restrict__ out, int cols, unsigned num_rows) {
    unsigned r = rows[blockIdx.x];
    float* dst = out + (size_t)blockIdx.x * cols;
    if (r >= num_rows) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = __int_as_float(0x7fc00000);
        return;
    }
    const float* src = x + (size_t)r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
}
