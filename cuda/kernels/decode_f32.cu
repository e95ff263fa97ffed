// The decode step's own kernels: reading the token's cache slot from device memory (so the
// step's launches never change and can be replayed as a CUDA graph, seeds 000 and 001), and
// split-K ("flash-decoding") attention over the f32 KV cache. CPU twins: write_row_at and
// decode_attention in cuda/src/cpu.rs.

// Head dims up to 32 * DEC_MAX_PER_LANE (256) are held in registers.
#define DEC_MAX_PER_LANE 8
#define DEC_WARPS 4

// dst[slot, :] = src[0, :], slot = *slot_at (a whole number held as f32). A slot outside the
// cache writes nothing; the host keeps it inside.
extern "C" __global__ void write_row_at_f32(float* __restrict__ dst, const float* __restrict__ slot_at,
                                            const float* __restrict__ src, int width, int slots) {
    int slot = (int)slot_at[0];
    if (slot < 0 || slot >= slots) return;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x)
        dst[(size_t)slot * width + c] = src[c];
}

// Split-K decode attention, pass 1. Block (h, s) takes query head h and the s-th of `splits`
// equal chunks of the keys 0..=slot; each of its warps walks every DEC_WARPS-th key of the
// chunk with an online softmax, lanes holding dims lane, lane+32, ... (coalesced rows). The
// warps are merged through shared memory and the block writes its unnormalized output with
// its running max and sum: part_o [hq, splits, d], part_ml [hq, splits, 2].
extern "C" __global__ void decode_attention_partial_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ slot_at, float* __restrict__ part_o, float* __restrict__ part_ml,
    int hq, int hkv, int d, float scale) {
    int h = blockIdx.x, s = blockIdx.y, splits = gridDim.y;
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int kvh = h / (hq / hkv);
    int len = (int)slot_at[0] + 1;
    int chunk = (len + splits - 1) / splits;
    int begin = s * chunk, end = min(len, begin + chunk);

    float qr[DEC_MAX_PER_LANE], acc[DEC_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < DEC_MAX_PER_LANE; ++e) {
        int c = lane + e * WARP;
        qr[e] = c < d ? q[(size_t)h * d + c] * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = begin + warp; j < end; j += DEC_WARPS) {
        const float* kr = k + ((size_t)j * hkv + kvh) * d;
        const float* vr = v + ((size_t)j * hkv + kvh) * d;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < DEC_MAX_PER_LANE; ++e) {
            int c = lane + e * WARP;
            if (c < d) dot += qr[e] * __ldg(kr + c);
        }
        float score = warp_sum(dot);
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new), p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < DEC_MAX_PER_LANE; ++e) {
            int c = lane + e * WARP;
            if (c < d) acc[e] = acc[e] * corr + p * __ldg(vr + c);
        }
        m = m_new;
    }

    __shared__ float sm_m[DEC_WARPS], sm_l[DEC_WARPS];
    __shared__ float sm_o[DEC_WARPS][WARP * DEC_MAX_PER_LANE];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < DEC_MAX_PER_LANE; ++e) sm_o[warp][lane + e * WARP] = acc[e];
    __syncthreads();

    float mb = NEG_INF;
    for (int w = 0; w < DEC_WARPS; ++w) mb = fmaxf(mb, sm_m[w]);
    // A warp (or the whole block) that saw no key has m = -inf and weighs nothing.
    float lb = 0.0f;
    for (int w = 0; w < DEC_WARPS; ++w)
        if (sm_m[w] != NEG_INF) lb += sm_l[w] * expf(sm_m[w] - mb);
    size_t part = (size_t)h * splits + s;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < DEC_WARPS; ++w)
            if (sm_m[w] != NEG_INF) o += sm_o[w][c] * expf(sm_m[w] - mb);
        part_o[part * d + c] = o;
    }
    if (threadIdx.x == 0) {
        part_ml[part * 2] = mb;
        part_ml[part * 2 + 1] = lb;
    }
}

// Pass 2: out[h, :] = sum_s part_o[h, s, :] e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
// One block per head.
extern "C" __global__ void decode_attention_combine_f32(const float* __restrict__ part_o,
                                                        const float* __restrict__ part_ml,
                                                        float* __restrict__ out, int splits, int d) {
    int h = blockIdx.x;
    const float* ml = part_ml + (size_t)h * splits * 2;
    float mx = NEG_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2 * s]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s)
        if (ml[2 * s] != NEG_INF) total += ml[2 * s + 1] * expf(ml[2 * s] - mx);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; ++s)
            if (ml[2 * s] != NEG_INF)
                o += part_o[((size_t)h * splits + s) * d + c] * expf(ml[2 * s] - mx);
        out[(size_t)h * d + c] = o / total;
    }
}

// Greedy decoding on the device: the index of the largest logit, the lowest on ties (as
// torch.argmax), in two passes: blocks reduce stretches of the row, then one block the blocks.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Every thread of the block ends with the block's (max, index).
__device__ void block_argmax(float& v, int& i) {
    __shared__ float sv[WARP];
    __shared__ int si[WARP];
    for (int o = WARP / 2; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    int warps = (blockDim.x + WARP - 1) / WARP;
    v = lane < warps ? sv[lane] : NEG_INF;
    i = lane < warps ? si[lane] : 0x7fffffff;
    for (int o = WARP / 2; o > 0; o >>= 1)
        argmax_merge(v, i, __shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
}

extern "C" __global__ void argmax_partial_f32(const float* __restrict__ x, int n,
                                              float* __restrict__ part_v, int* __restrict__ part_i) {
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x)
        argmax_merge(v, i, x[j], j);
    block_argmax(v, i);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = v;
        part_i[blockIdx.x] = i;
    }
}

extern "C" __global__ void argmax_final_f32(const float* __restrict__ part_v,
                                            const int* __restrict__ part_i, int parts,
                                            unsigned int* __restrict__ out) {
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < parts; j += blockDim.x) argmax_merge(v, i, part_v[j], part_i[j]);
    block_argmax(v, i);
    if (threadIdx.x == 0) out[0] = (unsigned int)(i == 0x7fffffff ? 0 : i);
}
