// Kernels that read the GPU's weight format: f16 matrices and embedding table, f32 activations,
// f32 accumulation. Their CPU twins are the f32 ops of cuda/src/cpu.rs given the same weights
// rounded to f16 (cuda/tests/cuda_twin.rs).
//
// Decoding one token reads every weight once, so it is bound by memory bandwidth, not FLOPs
// (seeds 000 and 002). The GEMVs below are written for that: GEMV_SPLIT warps per output row,
// 128-bit loads of 8 weights through the read-only path (__ldg), the few activation rows read as
// float4 (from L1/L2, or shared memory once normed), warp-shuffle reductions and the row's
// warps' sums added in shared memory. Larger batches of rows go to cuBLAS (f16 tensor cores, f32
// accumulation) after cast_f32_to_f16.

#include <cuda_fp16.h>
#include <cuda_fp8.h>

// GEMV_MAX_ROWS, the rows of x one GEMV launch handles (decode is 1; a few speculative or
// batched rows still fit in registers), GEMV_WARPS (a block's warps) and GEMV_SPLIT (the warps
// that share an output row) are #defined by the host before this source (shared_defines in
// cuda/src/cuda/kernels.rs), so the two sides cannot disagree.
//
// How the weights are read, measured on an H100 against a plain streaming read of the same bytes
// (36 distinct matrices a graph, like a decode step's layers): one warp per row with four loads
// in flight a lane reached 2.3-2.9 TB/s (o 13.7 us, q/k/v 22.5, down 39.5, gate/up 68.4) where
// the plain read reaches 2.7-3.0 (12.4, 17.8, 34.0, 66.3). Four warps a row with two loads in
// flight a lane: 13.1, 18.7, 35.3, 65.8. More bytes in flight a warp made every shape slower
// (eight loads: down 48 us): the row's warps together read 4 KB of it a round, enough to cover
// DRAM latency, and rows of 12288 columns (down) take a quarter of the rounds one after another.
#define GEMV_LOADS 2
#define GEMV_ROWS_PER_BLOCK (GEMV_WARPS / GEMV_SPLIT)
// Columns the row's warps take a load, together: warp s of a row, lane l, reads columns
// (s * WARP + l) * 8 + i * GEMV_STRIDE.
#define GEMV_STRIDE (GEMV_SPLIT * WARP * 8)

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

// acc[r] += x[r, c .. c + 8) . the eight weights in raw, for the ROWS rows of x [ROWS, k].
template <int ROWS>
__device__ __forceinline__ void dot8(const float* __restrict__ x, int k, int c, uint4 raw,
                                     float acc[ROWS]) {
    float wf[8];
    unpack8(raw, wf);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * k + c);
        float4 a = xr[0], b = xr[1];
        acc[r] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x +
                  wf[5] * b.y + wf[6] * b.z + wf[7] * b.w;
    }
}

// GEMV_LOADS 128-bit loads of weight row wr at columns c0, c0 + GEMV_STRIDE, ... (zeros from
// k_vec on), all issued before any is used: one at a time cannot cover DRAM latency (against the
// loads unrolled with the math between them: batch-1 decode 8.08 -> 7.94 ms a token on an H100,
// 8B shapes).
__device__ __forceinline__ void load_chunk(const __half* __restrict__ wr, int c0, int k_vec,
                                           uint4 raw[GEMV_LOADS]) {
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
        int c = c0 + u * GEMV_STRIDE;
        raw[u] = c < k_vec ? __ldg(reinterpret_cast<const uint4*>(wr + c)) : make_uint4(0, 0, 0, 0);
    }
}

// The columns the vector path takes: all when rows are 16-byte aligned (k % 8 == 0), else none
// (the scalar loop takes any k).
__device__ __forceinline__ int vec_cols(int k) { return k % 8 == 0 ? k : 0; }

// acc[r] = this warp's share of x[r, :] . wr for the ROWS rows of x (global or shared memory)
// and one weight row, summed over the warp (every lane returns the sums): the columns of the
// warp's `slice` of the row (0..GEMV_SPLIT), as the comment on GEMV_STRIDE says. raw holds the
// lane's first loads (load_chunk at first_col(slice)), which the caller issues before whatever
// it does first.
__device__ __forceinline__ int first_col(int slice) { return (slice * WARP + threadIdx.x % WARP) * 8; }

template <int ROWS>
__device__ __forceinline__ void row_dots(const float* __restrict__ x, const __half* __restrict__ wr,
                                         int k, int slice, uint4 raw[GEMV_LOADS],
                                         float acc[ROWS]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    const int k_vec = vec_cols(k), first = first_col(slice);
    for (int c0 = first; c0 < k_vec; c0 += GEMV_STRIDE * GEMV_LOADS) {
        if (c0 != first) load_chunk(wr, c0, k_vec, raw);
#pragma unroll
        for (int u = 0; u < GEMV_LOADS; ++u) {
            int c = c0 + u * GEMV_STRIDE;
            if (c < k_vec) dot8<ROWS>(x, k, c, raw[u], acc);
        }
    }
    for (int c = k_vec + slice * WARP + threadIdx.x % WARP; c < k; c += GEMV_SPLIT * WARP) {
        float wv = __half2float(wr[c]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] += wv * x[(size_t)r * k + c];
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// The totals of a row's GEMV_SPLIT warps, left in acc of the row's first warp (slice 0): every
// warp's lane 0 puts its sums in part, and after a barrier (every thread of the block must
// come here) the first warp adds them in slice order. The caller alternates between two part
// buffers, turn by turn, so that a turn's writes cannot meet the turn before's reads.
template <int N>
__device__ __forceinline__ void split_total(float acc[N], float (*part)[GEMV_WARPS]) {
    if (GEMV_SPLIT == 1) return;
    const int warp = threadIdx.x / WARP;
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int r = 0; r < N; ++r) part[r][warp] = acc[r];
    }
    __syncthreads();
    if (warp % GEMV_SPLIT == 0) {
#pragma unroll
        for (int r = 0; r < N; ++r) {
            float t = 0.0f;
#pragma unroll
            for (int s = 0; s < GEMV_SPLIT; ++s) t += part[r][warp + s];
            acc[r] = t;
        }
    }
}

// The normed kernels' input: xs [ROWS, k] = x * g in shared memory and inv[r] = 1 / rms(x[r])
// (the RMSNorm, its last scaling left for after the dot products), computed once per block for
// all its warps. Against each warp norming the rows it reads from L1 (the norm weight read
// beside x, the squares summed by every warp), the GEMVs of one 8B decode step, timed alone on
// an H100: 6.28 -> 5.79 ms, within 0.02 ms of the same GEMVs without the norm.
extern __shared__ __align__(16) float gemv_staged[];

// inv[r] = 1 / rms of row r (k values) from each thread's share of its sum of squares, ss[r],
// summed over the block. Every thread of the block must call it (it has a barrier).
template <int ROWS>
__device__ __forceinline__ void block_inv_rms(const float ss[ROWS], int k, float eps,
                                              float inv[ROWS]) {
    __shared__ float partial[ROWS][32];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float s = warp_sum(ss[r]);
        if (lane == 0) partial[r][warp] = s;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float t = 0.0f;
        for (int w = 0; w < warps; ++w) t += partial[r][w];
        inv[r] = rsqrtf(t / k + eps);
    }
}

template <int ROWS>
__device__ __forceinline__ void stage_normed(const float* __restrict__ x,
                                             const float* __restrict__ g, float eps, int k,
                                             float inv[ROWS]) {
    float ss[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float* xr = x + (size_t)r * k;
        float* o = gemv_staged + (size_t)r * k;
        float s = 0.0f;
        if (k % 4 == 0) {
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            const float4* g4 = reinterpret_cast<const float4*>(g);
            float4* o4 = reinterpret_cast<float4*>(o);
            for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
                float4 a = x4[i], w = g4[i];
                s += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                o4[i] = make_float4(a.x * w.x, a.y * w.y, a.z * w.z, a.w * w.w);
            }
        } else {
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                s += xr[i] * xr[i];
                o[i] = xr[i] * g[i];
            }
        }
        ss[r] = s;
    }
    block_inv_rms<ROWS>(ss, k, eps, inv);
}

// The rows the dot products read: x itself, or with NORM its normed copy staged in shared
// memory (and inv set). Every thread of the block must call it (the staging has a barrier).
template <bool NORM, int ROWS>
__device__ __forceinline__ const float* gemv_input(const float* __restrict__ x,
                                                   const float* __restrict__ norm_w, float eps,
                                                   int k, float inv[ROWS]) {
    if (!NORM) return x;
    stage_normed<ROWS>(x, norm_w, eps, k, inv);
    return gemv_staged;
}

// out[r, j] (+)= x[r, :] . w[j, :] (+ bias[j]) for the ROWS rows of x: x [ROWS, k] f32, w [m, k]
// f16, out [ROWS, m] f32; with NORM, x[r] is RMSNorm(x[r]) * norm_w (eps) first (dynamic
// shared memory ROWS * k floats). With accumulate, the product is added to what out holds (the
// residual stream's update, in place). GEMV_SPLIT warps per output column j; a block takes
// GEMV_ROWS_PER_BLOCK columns a turn, every (GEMV_ROWS_PER_BLOCK x blocks)-th from its first: a
// grid smaller than that stages its normed rows once per block, not once per turn (the
// lm_head's 152k columns read 600 MB of staging through L2 so). Every warp of a block takes the
// same turns (split_total's barrier); one past m reads row m - 1 again and writes nothing.
template <bool NORM, int ROWS>
__device__ __forceinline__ void gemv(const float* __restrict__ x, const float* __restrict__ norm_w,
                                     float eps, const __half* __restrict__ w,
                                     const float* __restrict__ bias, int has_bias,
                                     float* __restrict__ out, int accumulate, int m, int k) {
    __shared__ float part[2][ROWS][GEMV_WARPS];
    const int warp = threadIdx.x / WARP, slice = warp % GEMV_SPLIT;
    const bool writes = slice == 0 && threadIdx.x % WARP == 0;
    const int j0 = blockIdx.x * GEMV_ROWS_PER_BLOCK, step = gridDim.x * GEMV_ROWS_PER_BLOCK;
    uint4 raw[GEMV_LOADS];
    load_chunk(w + (size_t)min(j0 + warp / GEMV_SPLIT, m - 1) * k, first_col(slice), vec_cols(k),
               raw);
    float inv[ROWS];
    const float* xr = gemv_input<NORM, ROWS>(x, norm_w, eps, k, inv);
    for (int turn = 0, jb = j0; jb < m; jb += step, ++turn) {
        const int j = jb + warp / GEMV_SPLIT;
        float acc[ROWS];
        row_dots<ROWS>(xr, w + (size_t)min(j, m - 1) * k, k, slice, raw, acc);
        // The next turn's first loads go out before this turn's barrier and writes.
        if (jb + step < m)
            load_chunk(w + (size_t)min(j + step, m - 1) * k, first_col(slice), vec_cols(k), raw);
        split_total<ROWS>(acc, part[turn & 1]);
        if (writes && j < m) {
            float b = has_bias ? bias[j] : 0.0f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float* o = out + (size_t)r * m + j;
                *o = (accumulate ? *o : 0.0f) + (NORM ? acc[r] * inv[r] : acc[r]) + b;
            }
        }
    }
}

// The text MLP's first half in one pass over both matrices (seed 002), stacked in one weight
// gate_up [2m, k] (gate's rows first): out[r, j] = silu(x[r] . gate[j]) * (x[r] . up[j]), with
// silu(g) = g / (1 + exp(-g)); with NORM, of RMSNorm(x[r]) * norm_w. Columns as gemv's.
template <bool NORM, int ROWS>
__device__ __forceinline__ void swiglu_gemv(const float* __restrict__ x,
                                            const float* __restrict__ norm_w, float eps,
                                            const __half* __restrict__ gate_up,
                                            float* __restrict__ out, int m, int k) {
    __shared__ float part[2][2 * ROWS][GEMV_WARPS];
    const int warp = threadIdx.x / WARP, slice = warp % GEMV_SPLIT;
    const bool writes = slice == 0 && threadIdx.x % WARP == 0;
    const int j0 = blockIdx.x * GEMV_ROWS_PER_BLOCK, step = gridDim.x * GEMV_ROWS_PER_BLOCK;
    const int first = min(j0 + warp / GEMV_SPLIT, m - 1);
    uint4 graw[GEMV_LOADS], uraw[GEMV_LOADS];  // the lane's loads of the gate's and up's rows
    load_chunk(gate_up + (size_t)first * k, first_col(slice), vec_cols(k), graw);
    load_chunk(gate_up + (size_t)(m + first) * k, first_col(slice), vec_cols(k), uraw);
    float inv[ROWS];
    const float* xr = gemv_input<NORM, ROWS>(x, norm_w, eps, k, inv);
    for (int turn = 0, jb = j0; jb < m; jb += step, ++turn) {
        const int j = jb + warp / GEMV_SPLIT, jc = min(j, m - 1);
        float gu[2 * ROWS];  // the gate's sums, then the up's
        row_dots<ROWS>(xr, gate_up + (size_t)jc * k, k, slice, graw, gu);
        row_dots<ROWS>(xr, gate_up + (size_t)(m + jc) * k, k, slice, uraw, gu + ROWS);
        if (jb + step < m) {  // as in gemv
            const int next = min(j + step, m - 1);
            load_chunk(gate_up + (size_t)next * k, first_col(slice), vec_cols(k), graw);
            load_chunk(gate_up + (size_t)(m + next) * k, first_col(slice), vec_cols(k), uraw);
        }
        split_total<2 * ROWS>(gu, part[turn & 1]);
        if (writes && j < m) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float gv = NORM ? gu[r] * inv[r] : gu[r];
                float uv = NORM ? gu[ROWS + r] * inv[r] : gu[ROWS + r];
                out[(size_t)r * m + j] = gv / (1.0f + expf(-gv)) * uv;
            }
        }
    }
}

// ---- The streamed GEMVs: decode's GEMVs under programmatic dependent launch (sm_90) ----
//
// Each GEMV above fills its pipeline from empty and drains it: between a decode step's GEMVs
// that costs ~18 us a layer on an H100 (cuda/bench/gemv_chain.cu). These kernels are launched
// so that they start while the kernel before them still runs (common.cuh's grid_wait): each
// warp copies the first STREAM_STAGED 16-byte chunks a lane of its first weight row into shared
// memory by cp.async, and only then waits. The host launches two blocks an SM, so the next
// kernel's blocks find room beside the running one (every SM full, as above, leaves them none);
// with that few warps each lane keeps SG_LOADS chunks in flight (a whole row of 4,096 columns
// at once). One warp per output row. Rows past the first go to whichever warp asks next (an
// atomic ticket): the scheduler places a grid's blocks where there is room, not one an SM, and
// a static share would leave an SM with two blocks holding the kernel's end back. On an H100
// a batch-1 decode step went 6.06 -> 6.00 ms so, although each kernel alone is 2-14% slower
// than its classic twin (the early starts win that back; docs/benchmarks.md).
//
// STREAM_STAGED is #defined by the host (it sizes the shared memory). Rows of x: as above.
#define SG_LOADS(ROWS) ((ROWS) <= 2 ? 16 : 8)  // 3-4 rows: the registers of the sums and x
static_assert(SG_LOADS(GEMV_MAX_ROWS) >= STREAM_STAGED, "the staged chunks are one round's first");

// Eight weights, or zeros past k_vec; streamed past L1 (read once).
__device__ __forceinline__ uint4 load_or_zero(const __half* __restrict__ wr, int c, int k_vec) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (c < k_vec)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(wr + c));
    return v;
}

// A lane's chunk u of a row: columns lane * 8 + u * WARP * 8 (a warp reads 512 bytes a chunk).
// The first STREAM_STAGED of row wr, into this warp's `st`.
__device__ __forceinline__ void stage_first(const __half* __restrict__ wr, int k, uint4* st) {
    const int lane = threadIdx.x % WARP, k_vec = vec_cols(k);
#pragma unroll
    for (int u = 0; u < STREAM_STAGED; ++u) {
        int c = lane * 8 + u * WARP * 8;
        if (c < k_vec) cp_async16(st + u * WARP + lane, wr + c);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// acc[r] = x[r, :] . wr for the ROWS rows of x, summed over the warp (every lane returns the
// sums). `staged`: the lane's first STREAM_STAGED chunks of wr in shared memory, or null.
template <int ROWS>
__device__ __forceinline__ void stream_dots(const float* __restrict__ x,
                                            const __half* __restrict__ wr, int k,
                                            const uint4* staged, float acc[ROWS]) {
    constexpr int L = SG_LOADS(ROWS);
    const int lane = threadIdx.x % WARP, k_vec = vec_cols(k);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    for (int c0 = lane * 8; c0 < k_vec; c0 += L * WARP * 8) {
        uint4 raw[L];
        if (staged) {
#pragma unroll
            for (int u = 0; u < L; ++u)
                raw[u] = u < STREAM_STAGED ? staged[u * WARP + lane]
                                           : load_or_zero(wr, c0 + u * WARP * 8, k_vec);
            staged = nullptr;
        } else {
#pragma unroll
            for (int u = 0; u < L; ++u) raw[u] = load_or_zero(wr, c0 + u * WARP * 8, k_vec);
        }
#pragma unroll
        for (int u = 0; u < L; ++u) {
            const int c = c0 + u * WARP * 8;
            if (c < k_vec) dot8<ROWS>(x, k, c, raw[u], acc);
        }
    }
    for (int c = k_vec + lane; c < k; c += WARP) {
        float wv = __half2float(wr[c]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] += wv * x[(size_t)r * k + c];
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// The streamed GEMVs read x from shared memory, normed or not: read from L1 (the classic
// plain GEMVs do), a warp's x of each chunk waits on L1 after its weights arrive, and at two
// blocks an SM too few warps hide that (ncu, batch-1 decode on an H100: the o and down
// projections 24.1 and 56.4 us so, against 17.5 and 40.4 for the classic kernels). Copied by
// cp.async, every 16 bytes of a block's copy in flight at once: a plain loop of loads and
// stores waits once per round (12 rounds before the down projection's first row: o and down
// 20.6 and 46.3 us; by cp.async 19.4 and 42.2). The layout: x's rows (ROWS * k floats), with NORM the norm weights
// (k floats), then each warp's staged weight chunks, each part 16-byte aligned.
__device__ __forceinline__ size_t padded4(size_t n) { return (n + 3) / 4 * 4; }

template <bool NORM, int ROWS>
__device__ __forceinline__ uint4* warp_stage(int k) {
    const size_t floats = padded4((size_t)ROWS * k) + (NORM ? padded4(k) : 0);
    return reinterpret_cast<uint4*>(gemv_staged + floats) + (threadIdx.x / WARP) * STREAM_STAGED * WARP;
}

// n floats from src to shared dst: by cp.async where both are 16-byte aligned (the caller
// commits and waits), else a plain copy.
__device__ __forceinline__ void copy_floats(float* dst, const float* __restrict__ src, int n) {
    if (n % 4 == 0 && reinterpret_cast<size_t>(src) % 16 == 0) {
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) cp_async16(dst + 4 * i, src + 4 * i);
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}

// Before grid_wait: with NORM, the norm weights, which no kernel writes, into their place.
template <bool NORM, int ROWS>
__device__ __forceinline__ void stage_norm_weights(const float* __restrict__ norm_w, int k) {
    if (NORM) copy_floats(gemv_staged + padded4((size_t)ROWS * k), norm_w, k);
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// After grid_wait: x's rows into shared memory; with NORM, x * g there and inv[r] = 1 /
// rms(x[r]) (stage_normed's result, its last scaling left for after the dot products). Waits
// for every cp.async of the thread (the staged weights too). Every thread of the block calls it.
template <bool NORM, int ROWS>
__device__ __forceinline__ const float* stream_input(const float* __restrict__ x, float eps,
                                                     int k, float inv[ROWS]) {
    float* xs = gemv_staged;
    copy_floats(xs, x, ROWS * k);
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (NORM) {
        const float* g = gemv_staged + padded4((size_t)ROWS * k);
        float ss[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            ss[r] = 0.0f;
            for (int i = threadIdx.x; i < k; i += blockDim.x) ss[r] += xs[r * k + i] * xs[r * k + i];
        }
        block_inv_rms<ROWS>(ss, k, eps, inv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            for (int i = threadIdx.x; i < k; i += blockDim.x) xs[r * k + i] *= g[i];
        __syncthreads();
    }
    return xs;
}

// Rows past a warp's first: ticket[0] counts those handed out. ticket[1] counts finished blocks;
// the last block sets both to 0 again, which the next launch sees (it reads them only after
// grid_wait, and launches on the backend's one stream run one after another). A warp uses
// every ticket it asks for before it finishes, so none lands after the reset.
__device__ __forceinline__ unsigned take_ticket(unsigned* ticket) {
    return threadIdx.x % WARP == 0 ? atomicAdd(ticket, 1u) : 0u;
}
__device__ __forceinline__ void tickets_done(unsigned* ticket) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ticket + 1, 1u) == gridDim.x - 1) {
            ticket[0] = 0;
            ticket[1] = 0;
        }
    }
}

// gemv's product (same arguments and result) and, with SWIGLU, swiglu_gemv's (w = gate_up, m
// its half: a warp's row j is gate row j, then up row j), streamed.
template <bool NORM, bool SWIGLU, int ROWS>
__device__ __forceinline__ void gemv_streamed(const float* __restrict__ x,
                                              const float* __restrict__ norm_w, float eps,
                                              const __half* __restrict__ w,
                                              const float* __restrict__ bias, int has_bias,
                                              float* __restrict__ out, int accumulate, int m,
                                              int k, unsigned* __restrict__ ticket) {
    const int warps = gridDim.x * GEMV_WARPS;
    int j = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    uint4* st = warp_stage<NORM, ROWS>(k);
    if (j < m) stage_first(w + (size_t)j * k, k, st);
    stage_norm_weights<NORM, ROWS>(norm_w, k);
    grid_wait();
    grid_launch_dependents();
    float inv[ROWS];
    const float* xr = stream_input<NORM, ROWS>(x, eps, k, inv);
    const uint4* staged = st;
    while (j < m) {
        const unsigned next = take_ticket(ticket);  // asked for before the row is summed
        float acc[ROWS], up[ROWS];
        stream_dots<ROWS>(xr, w + (size_t)j * k, k, staged, acc);
        if (SWIGLU) stream_dots<ROWS>(xr, w + (size_t)(m + j) * k, k, nullptr, up);
        staged = nullptr;
        if (threadIdx.x % WARP == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float a = NORM ? acc[r] * inv[r] : acc[r];
                float* o = out + (size_t)r * m + j;
                if (SWIGLU)
                    *o = a / (1.0f + expf(-a)) * (NORM ? up[r] * inv[r] : up[r]);
                else
                    *o = (accumulate ? *o : 0.0f) + a + (has_bias ? bias[j] : 0.0f);
            }
        }
        j = warps + (int)__shfl_sync(0xffffffff, next, 0);
    }
    tickets_done(ticket);
}

// Each kernel is compiled for 1 to GEMV_MAX_ROWS rows of x, NAME_r1 .. NAME_r4: with the row
// count known, the loops over rows unroll with no tests and no registers for rows that are not
// there (the GEMVs of one 8B decode step, timed alone on an H100: 6.12 -> 5.77 ms against one
// kernel for up to 4 rows). A plain kernel and its normed twin share one signature (the plain
// one ignores norm_w and eps), so the host launches them the same way.
static_assert(GEMV_MAX_ROWS == 4, "instantiate the GEMVs below for every row count");
static_assert(GEMV_WARPS % GEMV_SPLIT == 0, "a block holds whole rows");

#define GEMV_KERNEL(NAME, NORM, ROWS)                                                             \
    extern "C" __global__ void NAME##_r##ROWS(                                                    \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const __half* __restrict__ w, const float* __restrict__ bias, int has_bias,               \
        float* __restrict__ out, int accumulate, int m, int k) {                                  \
        gemv<NORM, ROWS>(x, norm_w, eps, w, bias, has_bias, out, accumulate, m, k);               \
    }
#define SWIGLU_KERNEL(NAME, NORM, ROWS)                                                           \
    extern "C" __global__ void NAME##_r##ROWS(const float* __restrict__ x,                        \
                                              const float* __restrict__ norm_w, float eps,        \
                                              const __half* __restrict__ gate_up,                 \
                                              float* __restrict__ out, int m, int k) {            \
        swiglu_gemv<NORM, ROWS>(x, norm_w, eps, gate_up, out, m, k);                              \
    }
#define FOR_ROWS(KERNEL, NAME, NORM) \
    KERNEL(NAME, NORM, 1) KERNEL(NAME, NORM, 2) KERNEL(NAME, NORM, 3) KERNEL(NAME, NORM, 4)

FOR_ROWS(GEMV_KERNEL, gemv_f16w, false)
FOR_ROWS(GEMV_KERNEL, rms_norm_gemv_f16w, true)
FOR_ROWS(SWIGLU_KERNEL, swiglu_gemv_f16w, false)
FOR_ROWS(SWIGLU_KERNEL, rms_norm_swiglu_gemv_f16w, true)

// The streamed ones: the same signatures plus the ticket, at most 128 registers a thread so
// that two blocks fit an SM.
#define GEMV_STREAMED_KERNEL(NAME, NORM, ROWS)                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP, 2) NAME##_r##ROWS(            \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const __half* __restrict__ w, const float* __restrict__ bias, int has_bias,               \
        float* __restrict__ out, int accumulate, int m, int k, unsigned* __restrict__ ticket) {   \
        gemv_streamed<NORM, false, ROWS>(x, norm_w, eps, w, bias, has_bias, out, accumulate, m,   \
                                         k, ticket);                                              \
    }
#define SWIGLU_STREAMED_KERNEL(NAME, NORM, ROWS)                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP, 2) NAME##_r##ROWS(            \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const __half* __restrict__ gate_up, float* __restrict__ out, int m, int k,                \
        unsigned* __restrict__ ticket) {                                                          \
        gemv_streamed<NORM, true, ROWS>(x, norm_w, eps, gate_up, nullptr, 0, out, 0, m, k,       \
                                        ticket);                                                  \
    }

FOR_ROWS(GEMV_STREAMED_KERNEL, gemv_f16w_streamed, false)
FOR_ROWS(GEMV_STREAMED_KERNEL, rms_norm_gemv_f16w_streamed, true)
FOR_ROWS(SWIGLU_STREAMED_KERNEL, swiglu_gemv_f16w_streamed, false)
FOR_ROWS(SWIGLU_STREAMED_KERNEL, rms_norm_swiglu_gemv_f16w_streamed, true)

// Activations to f16 for the tensor-core GEMM. Round to nearest; values past f16's range
// become inf, which the GEMM then shows rather than hides.
extern "C" __global__ void cast_f32_to_f16(const float* __restrict__ x, __half* __restrict__ out,
                                           unsigned long long n) {
    grid_start_next_then_wait();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride)
        out[i] = __float2half_rn(x[i]);
}

// f16 rows from the host (an image's embeddings as the wire and shared memory carry them) to
// f32 activations: exact, and half the bytes of an f32 upload.
extern "C" __global__ void cast_f16_to_f32(const __half* __restrict__ x, float* __restrict__ out,
                                           unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride)
        out[i] = __half2float(x[i]);
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

// ---- Integer weights: W4 and W8 (quantized checkpoints, --quantize) ----
//
// w [m, k * BITS / 32] 32-bit words: row j's values along k, low bits first in each word (the
// host repacks every checkpoint format into this). sz [m, k / group] half2 (scale, zero):
// w[j, c] = (q - zero) * scale. group is a multiple of the columns one 16-byte load holds (32 at
// 4 bits, 16 at 8), so a load's columns share one (scale, zero), and zeros are whole numbers.
//
// Decode reads each weight once a token, so these GEMVs are about bytes, as the f16 ones are:
// a 4-bit row is a quarter of an f16 one. Each warp takes two weight rows at once (two output
// columns, or for SwiGLU a gate row and its up row), so each x value it reads (from shared
// memory when normed, else L1) serves two rows: at 4 bits a row's x reads outweigh its weight
// bytes eightfold, and L1 would bound the kernel before DRAM does. A lane keeps IW_LOADS 16-byte
// loads of each row in flight. The value q - zero is exact in f32 (2^23 + q as a float, less
// 2^23 + zero); the scale multiplies a load's sum once.
#define IW_LOADS 4

// Sixteen bytes of weights past L1 (read once).
__device__ __forceinline__ uint4 load_stream16(const unsigned* __restrict__ p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// (q - zero) of one 32-bit word's values, as f16 pairs (exact: whole numbers below 2048), and the
// column (from the word's first) of each pair's two halves. 4 bits: lop3 puts nibbles 0 and 4
// (then 1 and 5, scaled by 16) into the mantissas of 1024.0 halves, so one hsub2 (one hfma2 for
// the scaled ones) leaves q - zero; after a shift by 8, nibbles 2 and 6, 3 and 7 (Marlin's
// dequantization). 8 bits: a byte permute puts bytes 0 and 2, then 1 and 3, into 1024.0's.
//
// FP8: the same kernels read FP8 e4m3 weights (Qwen's and compressed-tensors' FP8 checkpoints)
// as 8-bit words, their format the template argument FMT (FMT_W4, FMT_W8 or FMT_F8; the layout
// is BITS = fmt_bits(FMT)'s). An e4m3 byte moved into an f16's bits (sign to the top, the other
// seven bits one place below the f16 exponent's top bit) is the value times 2^-8, exactly:
// e4m3's exponent bias is 7 and f16's 15, and f16 holds every e4m3 value, subnormals included.
// FP8 has no zero point; its scale is a whole f32 (the host folds the 2^8 in), stored in the
// (scale, zero) slot's four bytes, so block scales lose nothing to f16.
#define FMT_W4 4
#define FMT_W8 8
#define FMT_F8 9
__host__ __device__ constexpr int fmt_bits(int fmt) { return fmt == FMT_F8 ? 8 : fmt; }

// f8_pair (common.cuh) reads two e4m3 bytes as f16 values times 2^-8.

// A group's (scale, zero) as floats: the halves of its slot, or FP8's f32 scale and zero 0.
template <int FMT>
__device__ __forceinline__ float2 group_scale(__half2 slot) {
    if (FMT == FMT_F8) return make_float2(__uint_as_float(*reinterpret_cast<const unsigned*>(&slot)), 0.0f);
    return __half22float2(slot);
}

template <int FMT>
struct IntPairs {
    static constexpr int BITS = fmt_bits(FMT);
    static constexpr int N = 32 / BITS / 2;
    __half2 v[N];
    __device__ __forceinline__ IntPairs(unsigned w, __half2 base, __half2 base16) {
        if (FMT == FMT_F8) {
            // Bytes 0 and 2, then 1 and 3 (the columns W8's pairs hold); base is not used.
            v[0] = f8_pair(__byte_perm(w, 0, 0x2404));
            v[1] = f8_pair(__byte_perm(w, 0, 0x3414));
        } else if (BITS == 4) {
            const unsigned lo_mask = 0x000f000f, hi_mask = 0x00f000f0, ex = 0x64006400;
            const __half2 sixteenth = __float2half2_rn(0.0625f);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned q = w >> (8 * h);
                unsigned lo, hi;
                asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(lo) : "r"(q), "r"(lo_mask), "r"(ex));
                asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(hi) : "r"(q), "r"(hi_mask), "r"(ex));
                v[2 * h] = __hsub2(*reinterpret_cast<__half2*>(&lo), base);
                v[2 * h + 1] = __hfma2(*reinterpret_cast<__half2*>(&hi), sixteenth, base16);
            }
        } else {
            const unsigned a = __byte_perm(w, 0x64646464, 0x4240);
            const unsigned b = __byte_perm(w, 0x64646464, 0x4341);
            v[0] = __hsub2(*reinterpret_cast<const __half2*>(&a), base);
            v[1] = __hsub2(*reinterpret_cast<const __half2*>(&b), base);
        }
    }
    // Column offsets of pair p's low and high halves within the word.
    static __device__ __forceinline__ int lo_col(int p) { return BITS == 4 ? p : p; }
    static __device__ __forceinline__ int hi_col(int p) { return BITS == 4 ? p + 4 : p + 2; }
};

// pa[r] and pb[r] += sum over one load's 128 / BITS columns from c of (q - zero) * x[r, c + i],
// for the loads ra and rb of two weight rows that share x's reads.
template <int FMT, int ROWS>
__device__ __forceinline__ void int_dot2(const float* __restrict__ x, int k, int c, uint4 ra,
                                         uint4 rb, __half2 base_a, __half2 base16_a,
                                         __half2 base_b, __half2 base16_b, float pa[ROWS],
                                         float pb[ROWS]) {
    constexpr int PER = 32 / fmt_bits(FMT);
    const unsigned wa[4] = {ra.x, ra.y, ra.z, ra.w}, wb[4] = {rb.x, rb.y, rb.z, rb.w};
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
        const IntPairs<FMT> qa(wa[wi], base_a, base16_a), qb(wb[wi], base_b, base16_b);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float xs[PER];
            const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * k + c + wi * PER);
#pragma unroll
            for (int v = 0; v < PER / 4; ++v) {
                const float4 t = xr[v];
                xs[4 * v] = t.x;
                xs[4 * v + 1] = t.y;
                xs[4 * v + 2] = t.z;
                xs[4 * v + 3] = t.w;
            }
#pragma unroll
            for (int p = 0; p < IntPairs<FMT>::N; ++p) {
                const float2 fa = __half22float2(qa.v[p]), fb = __half22float2(qb.v[p]);
                const int lo = IntPairs<FMT>::lo_col(p), hi = IntPairs<FMT>::hi_col(p);
                pa[r] = fmaf(fa.x, xs[lo], pa[r]);
                pa[r] = fmaf(fa.y, xs[hi], pa[r]);
                pb[r] = fmaf(fb.x, xs[lo], pb[r]);
                pb[r] = fmaf(fb.y, xs[hi], pb[r]);
            }
        }
    }
}

// Lane's loads u0 .. u0 + IW_LOADS of weight row `row` (chunk lane + 32 u of its k / COLS).
template <int BITS>
__device__ __forceinline__ void int_loads(const unsigned* __restrict__ w, int row, int k, int u0,
                                          uint4 raw[IW_LOADS]) {
    constexpr int COLS = 128 / BITS;
    const int chunks = k / COLS, lane = threadIdx.x % WARP;
    const unsigned* wr = w + (size_t)row * (k / (32 / BITS));
#pragma unroll
    for (int u = 0; u < IW_LOADS; ++u) {
        const int ch = lane + (u0 + u) * WARP;
        raw[u] = ch < chunks ? load_stream16(wr + ch * 4) : make_uint4(0, 0, 0, 0);
    }
}

// The f16 constants that turn a load's raw values into q - zero: 1024 + zero, and for the
// 4-bit nibbles read 16 times too large, -(64 + zero).
__device__ __forceinline__ void int_bases(float zero, __half2& base, __half2& base16) {
    base = __float2half2_rn(1024.0f + zero);
    base16 = __float2half2_rn(-(64.0f + zero));
}

// acc_a[r] and acc_b[r] += this lane's share of x[r, :] . rows a and b over the chunks of loads
// u0 .. u0 + IW_LOADS held in ra and rb.
template <int FMT, int ROWS>
__device__ __forceinline__ void int_pair_part(const float* __restrict__ x,
                                              const __half2* __restrict__ sz, int groups,
                                              int group, int a, int b, int k, int u0,
                                              const uint4 ra[IW_LOADS], const uint4 rb[IW_LOADS],
                                              float acc_a[ROWS], float acc_b[ROWS]) {
    constexpr int COLS = 128 / fmt_bits(FMT);
    const int chunks = k / COLS, lane = threadIdx.x % WARP;
#pragma unroll
    for (int u = 0; u < IW_LOADS; ++u) {
        const int ch = lane + (u0 + u) * WARP;
        if (ch < chunks) {
            const int c = ch * COLS;
            const float2 sa = group_scale<FMT>(__ldg(sz + (size_t)a * groups + c / group));
            const float2 sb = group_scale<FMT>(__ldg(sz + (size_t)b * groups + c / group));
            __half2 base_a, base16_a, base_b, base16_b;
            int_bases(sa.y, base_a, base16_a);
            int_bases(sb.y, base_b, base16_b);
            float pa[ROWS], pb[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) pa[r] = pb[r] = 0.0f;
            int_dot2<FMT, ROWS>(x, k, c, ra[u], rb[u], base_a, base16_a, base_b, base16_b, pa,
                                 pb);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                acc_a[r] = fmaf(sa.x, pa[r], acc_a[r]);
                acc_b[r] = fmaf(sb.x, pb[r], acc_b[r]);
            }
        }
    }
}

// gemv's and swiglu_gemv's products (same results) for integer weights. Warp p of the grid
// takes pairs p, p + warps, ...: pair p is weight rows 2p and 2p + 1 (output columns), or with
// SWIGLU gate row p and up row m + p (output column p). Launched under programmatic dependent
// launch where the GPU has it: the first loads go out before grid_wait.
template <int FMT, bool NORM, bool SWIGLU, int ROWS>
__device__ __forceinline__ void int_gemv(const float* __restrict__ x,
                                         const float* __restrict__ norm_w, float eps,
                                         const unsigned* __restrict__ w,
                                         const float* __restrict__ bias, int has_bias,
                                         float* __restrict__ out, int accumulate, int m, int k,
                                         const __half2* __restrict__ sz, int group) {
    constexpr int BITS = fmt_bits(FMT), COLS = 128 / BITS;
    const int loads = (k / COLS + WARP - 1) / WARP, groups = k / group;
    const int pairs = SWIGLU ? m : (m + 1) / 2;
    const int warps = gridDim.x * (blockDim.x / WARP);
    int p = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const bool lane0 = threadIdx.x % WARP == 0;
    uint4 ra[IW_LOADS], rb[IW_LOADS];
    auto row_a = [&](int p) { return SWIGLU ? p : 2 * p; };
    auto row_b = [&](int p) { return SWIGLU ? m + p : min(2 * p + 1, m - 1); };
    if (p < pairs) {
        int_loads<BITS>(w, row_a(p), k, 0, ra);
        int_loads<BITS>(w, row_b(p), k, 0, rb);
    }
    grid_wait();
    grid_launch_dependents();
    float inv[ROWS];
    const float* xr = gemv_input<NORM, ROWS>(x, norm_w, eps, k, inv);
    for (; p < pairs; p += warps) {
        const int a = row_a(p), b = row_b(p);
        float acc_a[ROWS], acc_b[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc_a[r] = acc_b[r] = 0.0f;
        for (int u0 = 0; u0 < loads; u0 += IW_LOADS) {
            // The next loads (this pair's next chunks, or the next pair's first) go out before
            // these are summed: one batch in flight while another is used.
            uint4 na[IW_LOADS], nb[IW_LOADS];
            const bool more = u0 + IW_LOADS < loads, next_pair = !more && p + warps < pairs;
            if (more) {
                int_loads<BITS>(w, a, k, u0 + IW_LOADS, na);
                int_loads<BITS>(w, b, k, u0 + IW_LOADS, nb);
            } else if (next_pair) {
                int_loads<BITS>(w, row_a(p + warps), k, 0, na);
                int_loads<BITS>(w, row_b(p + warps), k, 0, nb);
            }
            int_pair_part<FMT, ROWS>(xr, sz, groups, group, a, b, k, u0, ra, rb, acc_a, acc_b);
            if (more || next_pair) {
#pragma unroll
                for (int u = 0; u < IW_LOADS; ++u) {
                    ra[u] = na[u];
                    rb[u] = nb[u];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc_a[r] = warp_sum(acc_a[r]);
            acc_b[r] = warp_sum(acc_b[r]);
            if (NORM) {
                acc_a[r] *= inv[r];
                acc_b[r] *= inv[r];
            }
        }
        if (!lane0) continue;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (SWIGLU) {
                out[(size_t)r * m + p] = acc_a[r] / (1.0f + expf(-acc_a[r])) * acc_b[r];
                continue;
            }
            float* o = out + (size_t)r * m;
            o[a] = (accumulate ? o[a] : 0.0f) + acc_a[r] + (has_bias ? bias[a] : 0.0f);
            if (2 * p + 1 < m)
                o[b] = (accumulate ? o[b] : 0.0f) + acc_b[r] + (has_bias ? bias[b] : 0.0f);
        }
    }
}

// The same signatures as GEMV_KERNEL's and SWIGLU_KERNEL's with the weights as words, and the
// scales and zeros and their group size last.
#define INT_GEMV_KERNEL(NAME, FMT, NORM, ROWS)                                                    \
    extern "C" __global__ void NAME##_r##ROWS(                                                    \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const unsigned* __restrict__ w, const float* __restrict__ bias, int has_bias,             \
        float* __restrict__ out, int accumulate, int m, int k, const __half2* __restrict__ sz,    \
        int group) {                                                                              \
        int_gemv<FMT, NORM, false, ROWS>(x, norm_w, eps, w, bias, has_bias, out, accumulate, m,   \
                                          k, sz, group);                                          \
    }
#define INT_SWIGLU_KERNEL(NAME, FMT, NORM, ROWS)                                                  \
    extern "C" __global__ void NAME##_r##ROWS(                                                    \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const unsigned* __restrict__ gate_up, float* __restrict__ out, int m, int k,              \
        const __half2* __restrict__ sz, int group) {                                              \
        int_gemv<FMT, NORM, true, ROWS>(x, norm_w, eps, gate_up, nullptr, 0, out, 0, m, k, sz,    \
                                         group);                                                  \
    }
#define FOR_INT_ROWS(KERNEL, NAME, FMT, NORM)                                                  \
    KERNEL(NAME, FMT, NORM, 1) KERNEL(NAME, FMT, NORM, 2) KERNEL(NAME, FMT, NORM, 3) \
    KERNEL(NAME, FMT, NORM, 4)

FOR_INT_ROWS(INT_GEMV_KERNEL, gemv_w4, FMT_W4, false)
FOR_INT_ROWS(INT_GEMV_KERNEL, rms_norm_gemv_w4, FMT_W4, true)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, swiglu_gemv_w4, FMT_W4, false)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, rms_norm_swiglu_gemv_w4, FMT_W4, true)
FOR_INT_ROWS(INT_GEMV_KERNEL, gemv_w8, FMT_W8, false)
FOR_INT_ROWS(INT_GEMV_KERNEL, rms_norm_gemv_w8, FMT_W8, true)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, swiglu_gemv_w8, FMT_W8, false)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, rms_norm_swiglu_gemv_w8, FMT_W8, true)
FOR_INT_ROWS(INT_GEMV_KERNEL, gemv_f8, FMT_F8, false)
FOR_INT_ROWS(INT_GEMV_KERNEL, rms_norm_gemv_f8, FMT_F8, true)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, swiglu_gemv_f8, FMT_F8, false)
FOR_INT_ROWS(INT_SWIGLU_KERNEL, rms_norm_swiglu_gemv_f8, FMT_F8, true)

// ---- Integer GEMVs on the tensor cores (mma.sync m16n8k16) ----
//
// The GEMVs above spend ~3 instructions an element (dequantize, f16 -> f32, fma) and read x
// from shared memory or L1 at 128 bytes a lane apart (8-way bank conflicts): at 4 bits they
// reached 26% of the copy bandwidth on an H100. Here a warp multiplies a 16-row tile of the
// weights (A, dequantized in registers exactly as above: q - zero, whole numbers in f16) by
// x's rows (B: 8 columns, a real row's two halves in 2 of them, below) with mma.sync, so the
// products cost an instruction per 256 weights, and x is read once per 16 weight rows.
//
// A GEMV's dot products may sum k in any order so long as A and B agree. Lane (g, t) of a
// warp (g = lane / 4, t = lane % 4) loads chunk 4b + t (16 bytes, COLS columns) of A rows g
// and g + 8 for batch b (4 * COLS columns); the pairs its dequantization gives (IntPairs:
// columns p and p + 4 of a word at 4 bits, p and p + 2 at 8) are its A fragment's k slots,
// and B's lane (n = g, t) holds column n of x's at the same columns. A batch lies in one scale
// group (group a multiple of 4 * COLS), so the scale multiplies a batch's sums once.
//
// x enters the tensor cores as two f16 halves, hi = f16(x * 2^e) and lo = f16(x * 2^e - hi):
// 22 of f32's 24 bits, with 2^e a power of two per row that puts the row's largest |x| under
// 2^15 (no f16 overflow; the sums are scaled back by 2^-e, exactly). They are B's columns 2r
// and 2r + 1 for x row r (ROWS <= 4), so one mma multiplies both and C holds a row's two sums
// side by side, added once a batch. (Against the halves as two mma into two accumulators, B
// column r: H100, int_gemv 1, W4 2.145 -> 2.051 ms a step, gate/up 67% -> 74% of the copy
// bandwidth, q/k/v 45% -> 49%; W8 unchanged.) Each block stages its ROWS rows that way in
// shared memory once (ROWS * k * 4 bytes, as the normed kernels' f32 rows), in the order the
// B fragments are read, 16-byte units XOR-swizzled so that the lanes of a phase hit distinct
// banks.
//
// A block's IM_WARPS warps split one tile's batches (warp w takes w, w + IM_WARPS, ...) and sum
// through shared memory; blocks take tiles tile, tile + grid, ... With SWIGLU a tile is 8 gate
// rows (A rows g) and their 8 up rows (A rows g + 8), so a lane holds both halves of its
// outputs. Needs k and group multiples of 4 * COLS (128 at 4 bits, 64 at 8) and the staging's
// shared memory: the host falls back to int_gemv otherwise.
#define IM_WARPS GEMV_WARPS
// Batches a lane loads at once (two 16-byte loads each), the next step's prefetched. 4 was
// slower (H100, int_gemv rows 1: W4 1129 vs 1305 GB/s, W8 1561 vs 1869). So was 1 with
// __launch_bounds__ for 3 blocks an SM (80 registers, against 108 and 2 blocks): q/k/v gained
// (W4 49% -> 53% of copy) but down lost (58% -> 41%), W4's step 2.05 -> 2.36 ms (2026-11-28).
// With the leaner batch (im_lane_x, 2026-11-29, H200) 4 pays at 8 bits and one row: int_gemv 1,
// W8 2.784 -> 2.578 ms a step (W4 1.820 -> 1.838, so 4 bits keep 2); 118-123 registers, still
// two blocks an SM. More rows keep 2 (more registers a batch: past 128 at 4). W4 at 4 held to
// 128 registers by __launch_bounds__ (two blocks an SM, no spills) tied too (1.811 ms against
// 1.825), as did two accumulators a batch, halving the mma chain (1.816): W4's GEMVs are held
// by neither their chains nor the bytes in flight, but by ~4-5 us a kernel past its bytes.
// FP8's one-row kernels take 2: 4 never paid there (244.0 -> 244.8 tok/s at batch 1), and
// with int_mma_gemv's branch-free step their normed kernel spills at 4 within two blocks an
// SM; FP8 at batch 1 went 245.6 -> 264.7 tok/s with both changes (H200, 2026-11-30). So does
// everything on sm_87, where W8's one-row kernels spill at 4.
template <int FMT, int ROWS>
__host__ __device__ constexpr int im_step() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    return 2;
#else
    return FMT == FMT_W8 && ROWS == 1 ? 4 : 2;
#endif
}
// x's 16-byte loads a thread has in flight while staging.
#define IM_STAGE_LOADS 4

// Staged x's 16-byte unit j (columns 4j .. 4j + 3 of the chunk, as f32; after the split, hi
// and lo pairs) of row n, chunk ch, counted in units from the staging's start. The XOR key
// spreads a phase's reads over the banks: at 4 bits a phase is lanes g = 0, 1 (one row's hi
// and lo units 2w, 2w + 1) of chunks t = 0..3, 8 distinct units once XORed by 2t; at 8 bits a
// lane reads its half of a unit (8 bytes) and a phase is 16 lanes, rows 0 and 1 of chunks t =
// 0..3, 8 distinct units by the key's row and chunk bits.
template <int BITS>
__device__ __forceinline__ int im_unit(int n, int k, int ch, int j) {
    constexpr int U = 32 / BITS;  // units a chunk
    const int key = BITS == 4 ? ((ch & 3) << 1) : (((n & 1) << 1) | ((ch >> 1) & 1));
    return n * (k / 4) + ch * U + (j ^ key);
}

// Stages x (with NORM times norm_w) as above into st; scale[r] = 2^e of row r, back[r] what
// row r's sums are multiplied by at the end (2^-e, with NORM times 1 / rms). Every thread of
// the block must call it (barriers).
template <int BITS, bool NORM, int ROWS>
__device__ __forceinline__ void im_stage(const float* __restrict__ x,
                                         const float* __restrict__ norm_w, float eps, int k,
                                         float4* st, float back[ROWS]) {
    constexpr int U = 32 / BITS;
    __shared__ float red[2][ROWS][IM_WARPS];
    const int units = k / 4, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    float scale[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)r * k);
        float ss = 0.0f, mx = 0.0f;
        // IM_STAGE_LOADS loads a thread in flight before the first is used (one at a time, each
        // waited a full L2 latency: 12 in a row at k = 12288). Same units, same order.
        for (int e0 = threadIdx.x; e0 < units; e0 += IM_STAGE_LOADS * blockDim.x) {
            float4 a[IM_STAGE_LOADS], g[IM_STAGE_LOADS];
#pragma unroll
            for (int i = 0; i < IM_STAGE_LOADS; ++i) {
                const int e = e0 + i * blockDim.x;
                if (e < units) {
                    a[i] = x4[e];
                    if (NORM) g[i] = reinterpret_cast<const float4*>(norm_w)[e];
                }
            }
#pragma unroll
            for (int i = 0; i < IM_STAGE_LOADS; ++i) {
                const int e = e0 + i * blockDim.x;
                if (e >= units) break;
                if (NORM) {
                    ss += a[i].x * a[i].x + a[i].y * a[i].y + a[i].z * a[i].z + a[i].w * a[i].w;
                    a[i] = make_float4(a[i].x * g[i].x, a[i].y * g[i].y, a[i].z * g[i].z,
                                       a[i].w * g[i].w);
                }
                mx = fmaxf(mx, fmaxf(fmaxf(fabsf(a[i].x), fabsf(a[i].y)),
                                     fmaxf(fabsf(a[i].z), fabsf(a[i].w))));
                st[im_unit<BITS>(r, k, e / U, e % U)] = a[i];
            }
        }
        ss = warp_sum(ss);
        for (int o = WARP / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
        if (lane == 0) {
            red[0][r][warp] = ss;
            red[1][r][warp] = mx;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float ss = 0.0f, mx = 0.0f;
        for (int w = 0; w < IM_WARPS; ++w) {
            ss += red[0][r][w];
            mx = fmaxf(mx, red[1][r][w]);
        }
        int ex = 0;
        frexpf(mx, &ex);
        const int e = mx > 0.0f ? min(max(15 - ex, -126), 126) : 0;
        scale[r] = __int_as_float((127 + e) << 23);
        back[r] = __int_as_float((127 - e) << 23) * (NORM ? rsqrtf(ss / k + eps) : 1.0f);
    }
    // In place: each thread turns the f32 units of one word's columns into hi and lo pairs.
    constexpr int WORD_UNITS = BITS == 4 ? 2 : 1;
    const int words = k / (32 / BITS);
    for (int i = threadIdx.x; i < ROWS * words; i += blockDim.x) {
        const int n = i / words, wd = i % words, ch = wd / 4, wi = wd % 4;
        float s = scale[0];
#pragma unroll
        for (int r = 1; r < ROWS; ++r)
            if (n == r) s = scale[r];
        if (WORD_UNITS == 2) {
            const int u0 = im_unit<BITS>(n, k, ch, 2 * wi), u1 = im_unit<BITS>(n, k, ch, 2 * wi + 1);
            const float4 a = st[u0], b = st[u1];
            uint4 hi, lo;
            split_halves(a.x * s, b.x * s, hi.x, lo.x);
            split_halves(a.y * s, b.y * s, hi.y, lo.y);
            split_halves(a.z * s, b.z * s, hi.z, lo.z);
            split_halves(a.w * s, b.w * s, hi.w, lo.w);
            st[u0] = *reinterpret_cast<const float4*>(&hi);
            st[u1] = *reinterpret_cast<const float4*>(&lo);
        } else {
            const int u = im_unit<BITS>(n, k, ch, wi);
            const float4 a = st[u];
            uint4 v;
            split_halves(a.x * s, a.z * s, v.x, v.z);
            split_halves(a.y * s, a.w * s, v.y, v.w);
            st[u] = *reinterpret_cast<const float4*>(&v);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void mma_16816(float d[4], __half2 a0, __half2 a1, __half2 a2,
                                          __half2 a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(*reinterpret_cast<unsigned*>(&a0)), "r"(*reinterpret_cast<unsigned*>(&a1)),
          "r"(*reinterpret_cast<unsigned*>(&a2)), "r"(*reinterpret_cast<unsigned*>(&a3)),
          "r"(b0), "r"(b1));
}

// The f16 constants of int_bases straight from a (scale, zero) slot: the zero is a whole number
// below 256, so 1024 + zero and -(64 + zero) are exact in f16 and need no f32 round trip.
__device__ __forceinline__ void int_bases_of(__half2 slot, __half2& base, __half2& base16) {
    const __half2 zero = __high2half2(slot);
    base = __hadd2(zero, __float2half2_rn(1024.0f));
    base16 = __hneg2(__hadd2(zero, __float2half2_rn(64.0f)));
}

// 16 and 8 bytes of shared memory at a 32-bit shared address.
__device__ __forceinline__ uint4 lds16(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(a));
    return v;
}
__device__ __forceinline__ uint2 lds8(unsigned a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}

// Where this lane's B fragments of batch 0 start in the staging (a shared address; batch b's
// are im_batch_bytes further on), and the XOR key of its units. The lane reads x row
// r = min(g / 2, ROWS - 1), chunk 4b + t; by im_unit, unit j of it is at r k/4 + (4b + t) U
// + (j ^ key) with a key that does not depend on b. At W4 the lane's units are j = 2 wi + lo_half
// and key 2t, so (2 wi + lo_half) ^ 2t = 2 (wi ^ t) + lo_half; at W8 unit wi ^ key, of which the
// lane takes half lo_half. Lanes past ROWS read row ROWS - 1: their B columns feed C columns
// 2t, 2t + 1 with t >= ROWS, which no lane writes, so they need no zeros.
template <int BITS, int ROWS>
__device__ __forceinline__ unsigned im_lane_x(unsigned st, int k, int& key) {
    const int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int r = min(g >> 1, ROWS - 1), lo_half = g & 1;
    const unsigned chunk = 16u * (unsigned)(r * (k / 4) + t * (32 / BITS));  // its unit 0, no XOR
    if (BITS == 4) {
        key = t;
        return st + chunk + 16u * lo_half;
    }
    key = ((r & 1) << 1) | ((t >> 1) & 1);
    return st + chunk + 8u * lo_half;
}
template <int BITS>
__host__ __device__ constexpr unsigned im_batch_bytes() {
    return 4u * (32 / BITS) * 16u;  // 4 chunks of 32 / BITS units
}

// acc[0] and acc[1] (weight rows g and g + 8 of the tile, x row t) += batch b's products, the
// lane's chunk of A rows g and g + 8 in la and lb, their (scale, zero) za, zb; x's fragments
// from `xb` (im_lane_x's address, key). B's column n is x row n / 2's hi (n even) or lo (n odd)
// half, so one mma takes both halves and the lane's C fragment holds a row's hi and lo sums
// side by side (columns 2t, 2t + 1): half the mma and half the shared-memory reads of a column
// a half.
template <int FMT, int ROWS>
__device__ __forceinline__ void im_batch(unsigned xb, int key, int b, uint4 la, uint4 lb,
                                         __half2 za, __half2 zb, float acc[2]) {
    constexpr int BITS = fmt_bits(FMT);
    const float2 sa = group_scale<FMT>(za), sb = group_scale<FMT>(zb);
    __half2 base_a, base16_a, base_b, base16_b;
    int_bases_of(za, base_a, base16_a);
    int_bases_of(zb, base_b, base16_b);
    const unsigned wa[4] = {la.x, la.y, la.z, la.w}, wb[4] = {lb.x, lb.y, lb.z, lb.w};
    const unsigned xa = xb + (unsigned)b * im_batch_bytes<BITS>();
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
        const IntPairs<FMT> qa(wa[wi], base_a, base16_a), qb(wb[wi], base_b, base16_b);
        if (BITS == 4) {
            const uint4 v = lds16(xa + ((unsigned)(wi ^ key) << 5));
            mma_16816(d, qa.v[0], qb.v[0], qa.v[1], qb.v[1], v.x, v.y);
            mma_16816(d, qa.v[2], qb.v[2], qa.v[3], qb.v[3], v.z, v.w);
        } else {
            const uint2 v = lds8(xa + ((unsigned)(wi ^ key) << 4));
            mma_16816(d, qa.v[0], qb.v[0], qa.v[1], qb.v[1], v.x, v.y);
        }
    }
    acc[0] = fmaf(sa.x, d[0] + d[1], acc[0]);
    acc[1] = fmaf(sb.x, d[2] + d[3], acc[1]);
}

template <int FMT, bool NORM, bool SWIGLU, int ROWS>
__device__ __forceinline__ void int_mma_gemv(const float* __restrict__ x,
                                             const float* __restrict__ norm_w, float eps,
                                             const unsigned* __restrict__ w,
                                             const float* __restrict__ bias, int has_bias,
                                             float* __restrict__ out, int accumulate, int m,
                                             int k, const __half2* __restrict__ sz, int group) {
    constexpr int BITS = fmt_bits(FMT), COLS = 128 / BITS, BATCH = 4 * COLS;
    constexpr int IM_STEP = im_step<FMT, ROWS>();
    float4* st = reinterpret_cast<float4*>(gemv_staged);
    float4* part = st + (size_t)ROWS * k / 4;  // float2 [2][IM_WARPS][WARP]
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int batches = k / BATCH, groups = k / group, row_words = k / (32 / BITS);
    const int steps = (batches + IM_WARPS - 1) / IM_WARPS;
    const int tiles = SWIGLU ? (m + 7) / 8 : (m + 15) / 16;
    // Batch b's scale group, b * BATCH / group, is umulhi(2b, gmul): group is a whole number d
    // of batches, and gmul = ceil(2^31 / d) is exact for b * d < 2^31 (d = 1 included, which
    // ceil(2^32 / d) would not fit). A division a load cost ~25 instructions.
    const unsigned per_group = (unsigned)(group / BATCH);
    const unsigned gmul = (0x80000000u + per_group - 1) / per_group;
    // A tile's rows for this lane: its chunk t of weight rows ra and rb (words), and their
    // (scale, zero) rows. Loads then add 32-bit offsets, one multiply-add an address.
    struct Rows {
        const unsigned* a;
        const unsigned* b;
        const __half2* za;
        const __half2* zb;
    };
    auto rows_of = [&](int tile) {
        int ra, rb;
        if (SWIGLU) {
            ra = min(tile * 8 + g, m - 1);
            rb = m + ra;
        } else {
            ra = min(tile * 16 + g, m - 1);
            rb = min(tile * 16 + 8 + g, m - 1);
        }
        return Rows{w + (size_t)ra * row_words + 4 * t, w + (size_t)rb * row_words + 4 * t,
                    sz + (size_t)ra * groups, sz + (size_t)rb * groups};
    };
    // A step's loads: the lane's chunks of batches warp + (s0 + u) IM_WARPS, and their
    // (scale, zero), which go out with the chunks. A batch past the row's last (k not a whole
    // number of steps) reads the last one and is multiplied with a zero slot, so it adds 0 to
    // the sums: no branch around each batch, and the compiler may interleave a step's batches.
    // The slot is zeroed where it is used: zeroed here, the write would wait for its load.
    auto loads = [&](const Rows& r, int s0, uint4 la[IM_STEP], uint4 lb[IM_STEP],
                     __half2 za[IM_STEP], __half2 zb[IM_STEP]) {
#pragma unroll
        for (int u = 0; u < IM_STEP; ++u) {
            const int b = warp + (s0 + u) * IM_WARPS;
            const unsigned bc = (unsigned)min(b, batches - 1), gi = __umulhi(bc << 1, gmul);
            la[u] = load_stream16(r.a + 16u * bc);
            lb[u] = load_stream16(r.b + 16u * bc);
            za[u] = __ldg(r.za + gi);
            zb[u] = __ldg(r.zb + gi);
        }
    };
    int tile = blockIdx.x;
    Rows rows = rows_of(tile);
    uint4 la[IM_STEP], lb[IM_STEP];
    __half2 za[IM_STEP], zb[IM_STEP];
    if (tile < tiles) loads(rows, 0, la, lb, za, zb);
    grid_wait();
    grid_launch_dependents();
    float back[ROWS];
    im_stage<BITS, NORM, ROWS>(x, norm_w, eps, k, st, back);
    int key;
    const unsigned xb = im_lane_x<BITS, ROWS>(smem_addr(st), k, key);
    for (int turn = 0; tile < tiles; tile += gridDim.x, ++turn) {
        float acc[2] = {0.0f, 0.0f};
        Rows next_rows = rows;
        for (int s0 = 0; s0 < steps; s0 += IM_STEP) {
            uint4 ma[IM_STEP], mb[IM_STEP];
            __half2 ya[IM_STEP], yb[IM_STEP];
            const bool more = s0 + IM_STEP < steps, next = !more && tile + gridDim.x < tiles;
            if (more) {
                loads(rows, s0 + IM_STEP, ma, mb, ya, yb);
            } else if (next) {
                next_rows = rows_of(tile + gridDim.x);
                loads(next_rows, 0, ma, mb, ya, yb);
            }
#pragma unroll
            for (int u = 0; u < IM_STEP; ++u) {
                const int b = warp + (s0 + u) * IM_WARPS;
                const __half2 none = __floats2half2_rn(0.0f, 0.0f);
                im_batch<FMT, ROWS>(xb, key, min(b, batches - 1), la[u], lb[u],
                                    b < batches ? za[u] : none, b < batches ? zb[u] : none, acc);
            }
            if (more || next) {
#pragma unroll
                for (int u = 0; u < IM_STEP; ++u) {
                    la[u] = ma[u];
                    lb[u] = mb[u];
                    za[u] = ya[u];
                    zb[u] = yb[u];
                }
            }
        }
        float2* pt = reinterpret_cast<float2*>(part) + (turn & 1) * IM_WARPS * WARP;
        pt[warp * WARP + lane] = make_float2(acc[0], acc[1]);
        __syncthreads();
        if (warp == 0 && t < ROWS) {
            float2 c = pt[lane];
#pragma unroll
            for (int v = 1; v < IM_WARPS; ++v) {
                const float2 o = pt[v * WARP + lane];
                c.x += o.x;
                c.y += o.y;
            }
            const int n = t;
            float f = back[0];
#pragma unroll
            for (int r = 1; r < ROWS; ++r)
                if (n == r) f = back[r];
            const float lo = c.x * f, hi = c.y * f;
            if (SWIGLU) {
                const int j = tile * 8 + g;
                if (j < m) out[(size_t)n * m + j] = lo / (1.0f + expf(-lo)) * hi;
            } else {
                float* o = out + (size_t)n * m;
                const int j0 = tile * 16 + g, j1 = j0 + 8;
                if (j0 < m)
                    o[j0] = (accumulate ? o[j0] : 0.0f) + lo + (has_bias ? bias[j0] : 0.0f);
                if (j1 < m)
                    o[j1] = (accumulate ? o[j1] : 0.0f) + hi + (has_bias ? bias[j1] : 0.0f);
            }
        }
        rows = next_rows;
    }
}

// Two blocks an SM (128 registers): without the bound the branch-free loop, whose batches
// ptxas may interleave, took up to 155 registers (one block an SM). Within it, the plain W4 and
// FP8 one-row kernels interleave a step's mma chains and the normed ones keep them in order.
#define INT_MMA_GEMV_KERNEL(NAME, FMT, NORM, ROWS)                                                \
    extern "C" __global__ void __launch_bounds__(IM_WARPS * WARP, 2) NAME##_r##ROWS(              \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const unsigned* __restrict__ w, const float* __restrict__ bias, int has_bias,             \
        float* __restrict__ out, int accumulate, int m, int k, const __half2* __restrict__ sz,    \
        int group) {                                                                              \
        int_mma_gemv<FMT, NORM, false, ROWS>(x, norm_w, eps, w, bias, has_bias, out, accumulate,  \
                                              m, k, sz, group);                                   \
    }
#define INT_MMA_SWIGLU_KERNEL(NAME, FMT, NORM, ROWS)                                              \
    extern "C" __global__ void __launch_bounds__(IM_WARPS * WARP, 2) NAME##_r##ROWS(              \
        const float* __restrict__ x, const float* __restrict__ norm_w, float eps,                 \
        const unsigned* __restrict__ gate_up, float* __restrict__ out, int m, int k,              \
        const __half2* __restrict__ sz, int group) {                                              \
        int_mma_gemv<FMT, NORM, true, ROWS>(x, norm_w, eps, gate_up, nullptr, 0, out, 0, m, k,    \
                                             sz, group);                                          \
    }

FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_gemv_w4, FMT_W4, false)
FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_rms_norm_gemv_w4, FMT_W4, true)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_swiglu_gemv_w4, FMT_W4, false)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_rms_norm_swiglu_gemv_w4, FMT_W4, true)
FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_gemv_w8, FMT_W8, false)
FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_rms_norm_gemv_w8, FMT_W8, true)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_swiglu_gemv_w8, FMT_W8, false)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_rms_norm_swiglu_gemv_w8, FMT_W8, true)
FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_gemv_f8, FMT_F8, false)
FOR_INT_ROWS(INT_MMA_GEMV_KERNEL, mma_rms_norm_gemv_f8, FMT_F8, true)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_swiglu_gemv_f8, FMT_F8, false)
FOR_INT_ROWS(INT_MMA_SWIGLU_KERNEL, mma_rms_norm_swiglu_gemv_f8, FMT_F8, true)

// ---- Integer GEMMs on the tensor cores for batches of rows (mma.sync m16n8k16) ----
//
// Past GEMV_MAX_ROWS rows (batched decode, up to 64 sequences) the packed weights used to be
// dequantized into an f16 scratch matrix for cuBLAS: the weights read at 4 or 8 bits, written
// and read again at 16, and W4 at 64 rows ran 3.8x slower than f16. Here the packed weights are
// read once a batch (Marlin's design, IST-DASLab/marlin, in our own layout): dequantized in
// registers into A fragments as int_mma_gemv does, times their scale in f16 (exactly the f16
// values dequant_int writes: (q - zero) is exact in f16 and one rounding of the product), with
// x (f16 [n, k], as cuBLAS gets it) the B operand, f32 accumulation. FMT is FMT_W4, FMT_W8 or
// FMT_F8 (FP8 e4m3 in W8's layout: the same loads, fragments and x permutation as W8).
//
// FP8's weights. IntPairs<FMT_F8> gives each byte's value v times 2^-8, exact in f16; the
// group's scale s (the checkpoint's times 2^8) is an f32, rounded to f16 once a row and chunk
// where it is read from shared memory (no zero point: FP8's bases go unused). A fragment is
// then rn16(v * rn16(s)), where dequant_f8_f16 writes rn16(rn32(v * s)): for s an f16 normal
// number (2^-14 .. 65504; the host sends any other FP8 weight to the dequantization, see
// int_gemm_takes) rn16(s) is within 2^-11 of s, relative, so v * rn16(s) lies within 2^-11
// of the weight, less than one f16 step of it, and the two f16 weights differ by at most one
// step (2^-10 of the weight; checked over every byte and many scales by
// gemm_fp8_weights_within_one_step_of_dequant, int_weights.rs). The factor is common to a
// row's group, so a product's error is at most 2^-11 of the sum of |w x| over it, besides
// the dequantized path's own: within Case::IntGemm's 3e-3. Multiplying v by the f32 scale
// in f32 and rounding once (dequant's arithmetic exactly) would take 2 conversions and 2
// multiplies a pair where this takes one hmul2. W4's and W8's fragments are dequant_int's
// values bit for bit.
//
// Blocks. A block owns ROWS = 32 RG weight rows in RG row groups of 32, each taken by KS warps
// (RG * KS warps): warp w rows 32 (w % RG) .. + 31 of the block as two m16 tiles (MT = 2),
// against all n of x's rows as NT n8 tiles (NT = 1, 2, 4, 8: n up to 8, 16, 32, 64), so each
// dequantized A fragment feeds NT mma and each B fragment MT. With KS = 2 the two warps of a
// row group each take half of every stage's columns (of a stage's 4 (chunk, x unit) steps,
// warp w takes 2 (w / RG) and the one after), and the second's sums are added to the first's,
// in that order, through shared memory once k is done. The host instantiates the shapes it
// picks from (IG_BLOCKS, from INT_GEMM_BLOCKS in cuda/src/cuda/kernels.rs): 256 rows (RG 8,
// KS 1: 8 warps), 192 (6, 2: 12 warps) and 128 (4, 2: 8 warps). Why split k inside the block
// rather than take fewer warps: an SM's 4 sub-partitions each run the warps w % 4 of a block,
// so 6 warps of whole stages (192 rows) would give two of them 2 warps, and the block would
// take as long as one of 8; 12 warps of half stages put 3 on each, three quarters of the
// 8-warp block's work. Accumulators: MT * NT * 4 = 64 floats a lane at NT = 8. ptxas,
// registers at NT = 1, 2, 4, 8, f32 out (no spills, no stack; f16 out at most 176 on sm_90, at
// 256 rows, W4, NT = 8, and 234 on sm_87):
//   256 rows, sm_90: W4 88, 104, 122, 176; W8 95, 95, 143, 166; FP8 91, 95, 128, 164
//             sm_87: W4 80, 96, 120, 164; W8 80, 96, 133, 158; FP8 80, 89, 128, 162
//   192 rows, sm_90: W4 74, 94, 111, 149; W8 78, 106, 122, 160; FP8 72, 96, 111, 155
//             sm_87: W4 64, 90, 108, 151; W8 71, 93, 114, 168; FP8 64, 94, 104, 153
//   128 rows, sm_90: W4 76, 88, 110, 155; W8 86, 92, 124, 166; FP8 92, 96, 123, 159
//             sm_87: W4 74, 78, 109, 242; W8 85, 88, 117, 215; FP8 79, 82, 108, 242
// The 12-warp blocks are held to 168 registers by their launch bounds. At NT = 8 a block of 8
// or 12 warps takes more than half an SM's registers: one block an SM there, whatever its
// shared memory. A block's x stage is read from L2 once per block (at 64 rows, W4 and 256
// rows as many bytes as the weights' own; at 128 rows twice that); the B fragments are read
// from shared memory once per warp (per 32 rows and the warp's part of the columns).
//
// k goes by stages of IG_K = 128 columns, IG_STAGES deep in shared memory by cp.async (the
// weights' rows, their (scale, zero) and x's rows of the stage), the next stages in flight
// while one is multiplied. A stage's shared memory: weights ROWS x 128 columns (64 bytes a row
// at 4 bits, 128 at 8), x NT * 8 rows x 256 bytes (16 KB at NT = 8), (scale, zero) ROWS x 4
// groups x 4 bytes; at NT = 8 and 256 rows 36 KB at W4, 52 at W8 and FP8, times 3 stages: 108
// and 156 KB; at 192 rows 93 and 129 KB, at 128 rows 78 and 102 (Orin's 163 KB a block holds
// each). The KS = 2 blocks add their halves' sums through the same memory once the stages are
// done (ROWS * NT * 32 bytes: 48 KB at 192 rows and NT = 8).
//
// Fragments (as int_mma_gemv): lane (g, t) dequantizes its 16-byte chunk t (at 8 bits chunks
// t and 4 + t) of weight rows g and g + 8 of an m16 tile; IntPairs gives the pairs (c, c + 4)
// of a word's 8 columns at 4 bits ((c, c + 2) of 4 at 8), which become the lane's k slots 2t,
// 2t + 1 and 2t + 8, 2t + 9. B's lane (g, t) must hold x row g at the same columns: it reads
// x's 16 bytes of those columns in their natural order from shared memory (cp.async cannot
// reorder inside 16 bytes) and a byte permute a register pairs them as A's (two prmt a mma
// per n-tile, shared by the MT mma). Shared-memory units (16 bytes) are XOR-swizzled so that
// the 8 lanes of a phase (rows g, g + 1; t = 0..3) hit distinct banks.
//
// Split-k. At m = 4096 the 256-row blocks are 16; the host splits k into S contiguous ranges
// of stages (S blocks an m-block, adjacent block indices), so that the grid fills the SMs
// (int_gemm_grid in int_weights.rs picks the block shape and S together). Each split writes
// its sums to a partial tile of its own (f32 [n][ROWS], a workspace of at most one 256-row
// tile an SM), counts in on the m-block's lock and waits until all S have; then split s adds
// up the s-th part of the tile's elements over splits 0, 1, .. S - 1 in that order and writes
// them (times alpha, plus the output with accumulate, plus the bias): the result does not
// depend on which split finishes first, and the adds run on all S blocks at once. The grid is
// at most one block an SM, so every split waited on is resident or will be: under programmatic
// launch a block may wait for the kernel before to leave its SM, but that kernel never waits
// for this one, and the kernel after starts only once every block of this one has. Each split
// counts in again once past the wait; the last resets the lock to 0, so one zeroed lock buffer
// serves every launch of the stream. An f16 output (the next GEMM's operand) is written once as
// well, its sum in f32.
//
// Needs k a multiple of IG_K, group a multiple of the loads' columns and either a multiple of
// 128 or a divisor of it (at most 4 groups a stage), n <= 64, and FP8's scales f16 normal
// numbers: the host falls back to the dequantization otherwise.
//
// IG_K, IG_STAGES, IG_SZ_SLOTS (the (scale, zero) a row a stage) and IG_BLOCKS (the block
// shapes) are #defined by the host (cuda/src/cuda/kernels.rs), which sizes the shared memory
// from them.

// One stage's shared memory for blocks of ROWS rows, in order: the rows' weights
// (ig_w_units 16-byte units), x's NT * 8 rows (ig_x_units), and the rows' IG_SZ_SLOTS
// (scale, zero) slots of 4 bytes. The host computes the same bytes: int_gemm_smem in
// int_weights.rs. (Functions, not a struct's constants: NVRTC emits those as globals.)
template <int BITS, int ROWS>
__host__ __device__ constexpr int ig_w_units() {
    return ROWS * IG_K * BITS / 128;
}
template <int NT>
__host__ __device__ constexpr int ig_x_units() {
    return NT * 8 * IG_K * 2 / 16;
}
template <int BITS, int NT, int ROWS>
__host__ __device__ constexpr int ig_stage_bytes() {
    return 16 * (ig_w_units<BITS, ROWS>() + ig_x_units<NT>()) + 4 * ROWS * IG_SZ_SLOTS;
}

// 4 bytes global -> shared (cp.async's smallest copy, through L1).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

// Swizzled unit of x's logical unit u (of 16 in a stage row) in row r: the 8 lanes of a phase
// read rows of both parities and units 4t + s (4 bits) or 2(4c + t) + j (8 bits).
template <int BITS>
__device__ __forceinline__ int ig_xunit(int u, int r) {
    return u ^ (BITS == 4 ? ((((u >> 3) & 1) << 1) ^ (r & 1)) : (r & 1));
}
// Swizzled unit of the weights' logical unit u (chunk) in stage row r: at 8 bits a row is 8
// units, and rows r, r + 1 of a phase would share banks.
template <int BITS>
__device__ __forceinline__ int ig_wunit(int u, int r) {
    return BITS == 4 ? u : u ^ ((r & 1) << 2);
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ void store_out(float* o, float v) { *o = v; }
__device__ __forceinline__ void store_out(__half* o, float v) { *o = __float2half_rn(v); }
__device__ __forceinline__ float load_out(const float* o) { return __ldcg(o); }
__device__ __forceinline__ float load_out(const __half* o) { return __half2float(*o); }

// Where a block's stages read their (scale, zero) pairs: `slots` a row a stage (IG_K / group,
// or 1 for a group of IG_K columns or more), from group `first` of each row on for the stage
// being loaded. Stages are loaded in order, one after the other, so the next stage's first
// group is counted on (no division a stage: a runtime divisor costs some 20 instructions).
struct IgGroups {
    int slots, first, stages_a_group, stage_in_group;
    __device__ __forceinline__ IgGroups(int group, int stage) {
        if (group >= IG_K) {
            slots = 1;
            stages_a_group = group / IG_K;
            first = stage / stages_a_group;
            stage_in_group = stage % stages_a_group;
        } else {
            slots = IG_K / group;
            stages_a_group = 1;
            first = stage * slots;
            stage_in_group = 0;
        }
    }
    __device__ __forceinline__ void next() {
        if (slots > 1) {
            first += slots;
        } else if (++stage_in_group == stages_a_group) {
            stage_in_group = 0;
            ++first;
        }
    }
};

// Which parts of a stage ig_load_stage copies: the weights with their (scale, zero) slots,
// which no kernel writes, so that they may go out before grid_wait while the kernel before
// still runs, and x's rows, that kernel's output.
constexpr int IG_WZ = 1, IG_X = 2;

// Stage `st` (columns st * IG_K ..) of the block's ROWS weight rows r0 .., their (scale, zero)
// (groups as `zg` says) and x's rows into shared stage buffer `buf`, in the current cp.async
// group: the PARTS named (x's rows only where the stage holds them, X: the wgmma GEMM stages
// them itself). THREADS (the block's) is a constant, so each thread's share of the copies is
// known at compile time (the loops unroll, their indices are shifts), and each copy's address
// is an unsigned 32-bit element offset scaled onto its base in one instruction. With blockDim.x, a runtime group and 64-bit
// signed offsets this was ~300 of a warp's ~600 instructions a stage at W4 and 64 rows: as
// many as its 64 mma's own. The offsets fit: the largest matrix, a vocabulary's head, is
// 151,936 x 1,024 words at 8 bits.
template <int BITS, int NT, int ROWS, int THREADS, bool X = true, int PARTS = IG_WZ | IG_X>
__device__ __forceinline__ void ig_load_stage(uint4* buf, const unsigned* __restrict__ w,
                                              const __half2* __restrict__ sz,
                                              const __half* __restrict__ x, int n, int m, int k,
                                              int groups, const IgGroups& zg, int r0, int st) {
    constexpr int WU = IG_K * BITS / 128;  // 16-byte units of a weight row a stage
    constexpr int W_UNITS = ig_w_units<BITS, ROWS>(), X_UNITS = X ? ig_x_units<NT>() : 0;
    constexpr int Z_UNITS = ROWS * IG_SZ_SLOTS;
    uint4* ws = buf;
    uint4* xs = ws + W_UNITS;
    __half2* zs = reinterpret_cast<__half2*>(xs + X_UNITS);
    // The thread index passes through an empty asm, so that each copy's offsets are computed
    // here, a few instructions each, rather than kept in registers across the k loop: kept,
    // they took up to 20 more, and the 12-warp blocks (held to 168) needed a stack frame of
    // local memory at 8 bits.
    int tid = threadIdx.x;
    asm volatile("" : "+r"(tid));
    const unsigned row_words = k / (32 / BITS), k0 = st * IG_K;
    constexpr bool WZ = PARTS & IG_WZ, XR = X && (PARTS & IG_X);
#pragma unroll
    for (int j = 0; j < (WZ ? (W_UNITS + THREADS - 1) / THREADS : 0); ++j) {
        const int i = tid + j * THREADS;
        if (W_UNITS % THREADS == 0 || i < W_UNITS) {
            const int r = i / WU, u = i % WU;
            const unsigned row = min(r0 + r, m - 1);
            cp_async16(ws + r * WU + ig_wunit<BITS>(u, r),
                       w + (row * row_words + k0 / (32 / BITS) + u * 4));
        }
    }
#pragma unroll
    for (int j = 0; j < (XR ? (X_UNITS + THREADS - 1) / THREADS : 0); ++j) {
        const int i = tid + j * THREADS;
        if (X_UNITS % THREADS == 0 || i < X_UNITS) {
            const int r = i / 16, u = i % 16;
            const unsigned row = min(r, n - 1);
            cp_async16(xs + r * 16 + ig_xunit<BITS>(u, r), x + (row * (unsigned)k + k0 + u * 8));
        }
    }
#pragma unroll
    for (int j = 0; j < (WZ ? (Z_UNITS + THREADS - 1) / THREADS : 0); ++j) {
        const int i = tid + j * THREADS;
        const int r = i / IG_SZ_SLOTS, s = i % IG_SZ_SLOTS;
        const unsigned row = min(r0 + r, m - 1);
        if ((Z_UNITS % THREADS == 0 || i < Z_UNITS) && s < zg.slots)
            cp_async4(zs + r * IG_SZ_SLOTS + s, sz + (row * (unsigned)groups + zg.first + s));
    }
}

// A lane's part of one m16 tile of weight rows for one 16-byte chunk `ch` of a stage (lane
// (g, t): rows ra = g and g + 8 of the tile; its chunk t at 4 bits, 4c + t at 8) and the
// chunk's (scale, zero) slot, from the stage's shared memory, and the A fragments of its k16
// steps (8 at 4 bits, 4 at 8): the weights dequantized in registers, exactly dequant_int's
// f16 values at 4 and 8 bits ((q - zero) is exact in f16, then one rounding of the product).
template <int FMT>
struct IgChunk {
    static constexpr int BITS = fmt_bits(FMT), WU = IG_K * BITS / 128;
    uint4 la, lb;
    __half2 sa, sb, ba, b16a, bb, b16b;
    IgChunk() = default;
    __device__ __forceinline__ IgChunk(const uint4* ws, const __half2* zs, int ra, int ch,
                                       int slot) {
        const int rb = ra + 8;
        la = ws[ra * WU + ig_wunit<BITS>(ch, ra)];
        lb = ws[rb * WU + ig_wunit<BITS>(ch, rb)];
        // FP8's f32 scale becomes an f16 here, once a row a chunk (the kernel's comment: what
        // that rounds); W4's and W8's are f16 already, and their bases are taken in f16
        // (int_bases_of: the same values as int_bases' f32 round trip). FP8's bases go unused
        // (no zero point).
        const __half2 za = zs[ra * IG_SZ_SLOTS + slot], zb = zs[rb * IG_SZ_SLOTS + slot];
        sa = FMT == FMT_F8 ? __float2half2_rn(group_scale<FMT>(za).x) : __low2half2(za);
        sb = FMT == FMT_F8 ? __float2half2_rn(group_scale<FMT>(zb).x) : __low2half2(zb);
        int_bases_of(za, ba, b16a);
        int_bases_of(zb, bb, b16b);
    }
    // The A fragment (mma.sync m16n8k16: rows g, g + 8 at k slots 2t, 2t + 1 and 2t + 8,
    // 2t + 9) of the chunk's k16 step j: at 4 bits word j / 2's pairs 2h, 2h + 1 (h = j % 2),
    // at 8 bits word j's two pairs. Which columns those are: the comment on the fragments.
    __device__ __forceinline__ void fragment(int j, __half2 (&a)[4]) const {
        const unsigned wa[4] = {la.x, la.y, la.z, la.w}, wb[4] = {lb.x, lb.y, lb.z, lb.w};
        const int word = BITS == 4 ? j / 2 : j, p = BITS == 4 ? 2 * (j % 2) : 0;
        const IntPairs<FMT> qa(wa[word], ba, b16a), qb(wb[word], bb, b16b);
        a[0] = __hmul2(qa.v[p], sa);
        a[1] = __hmul2(qb.v[p], sb);
        a[2] = __hmul2(qa.v[p + 1], sa);
        a[3] = __hmul2(qb.v[p + 1], sb);
    }
};

// One stage's products for the warp's 32 weight rows (wr, wr + 1, .. of the stage buffers ws,
// xs, zs) and its part of the stage's columns: the (chunk c, x unit u) steps Q0 .. Q1 - 1 of
// the stage's 4, step c * 16 / WU + u (4 bits: one chunk of 4 units; 8 bits: two of 2).
template <int FMT, int NT, int Q0, int Q1>
__device__ __forceinline__ void ig_mma_stage(float (&acc)[2][NT][4], const uint4* ws,
                                             const uint4* xs, const __half2* zs, int wr, int g,
                                             int t, int gshift) {
    constexpr int BITS = fmt_bits(FMT), MT = 2, WU = IG_K * BITS / 128, COLS = 128 / BITS;
    constexpr int UN = 16 / WU;  // x units a chunk
#pragma unroll
    for (int c = 0; c < WU / 4; ++c) {  // the lane's chunks: 1 at 4 bits, 2 at 8
        if (c * UN + UN <= Q0 || c * UN >= Q1) continue;  // none of the part's steps
        const int ch = 4 * c + t, slot = (ch * COLS) >> gshift;
        const IgChunk<FMT> chunk[MT] = {IgChunk<FMT>(ws, zs, wr + g, ch, slot),
                                        IgChunk<FMT>(ws, zs, wr + 16 + g, ch, slot)};
        // x units of the chunk: 4 at 4 bits (a word each), 2 at 8 (two words each); each gives
        // two mma (halves h) per n-tile.
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            if (c * UN + u < Q0 || c * UN + u >= Q1) continue;
            __half2 af[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) chunk[mt].fragment(2 * u + h, af[mt][h]);
            const int xu = BITS == 4 ? 4 * t + u : 2 * ch + u;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int xr = nt * 8 + g;
                const uint4 v = xs[xr * 16 + ig_xunit<BITS>(xu, xr)];
                // 4 bits: columns (0, 4), (1, 5) then (2, 6), (3, 7) of the unit's 8;
                // 8 bits: (0, 2), (1, 3) of each word's 4.
                const unsigned p0 = BITS == 4 ? v.x : v.x, q0 = BITS == 4 ? v.z : v.y;
                const unsigned p1 = BITS == 4 ? v.y : v.z, q1 = BITS == 4 ? v.w : v.w;
                const unsigned b[2][2] = {{prmt(p0, q0, 0x5410), prmt(p0, q0, 0x7632)},
                                          {prmt(p1, q1, 0x5410), prmt(p1, q1, 0x7632)}};
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        mma_16816(acc[mt][nt], af[mt][h][0], af[mt][h][1], af[mt][h][2],
                                  af[mt][h][3], b[h][0], b[h][1]);
            }
        }
    }
}

// The end of an integer GEMM: the block's sums (acc: MT m-tiles x NT n8 tiles in mma.sync's C
// layout, a lane's element c at weight row wr + mt * MSTRIDE + g + 8 (c / 2) of the block and x
// row nt * 8 + 2t + c % 2) times alpha, plus the output with accumulate, plus the bias, into
// out [n, m]; `writer`: this warp's sums count (the second halves of a KS = 2 block are in
// the first's by now). Every thread of the block must come here.
//
// Split k: this split's sums into its partial tile [n][ROWS], then, once every split of the
// m-block has written its own (all are resident: the grid is at most one block an SM), split
// s adds up the s-th of the tile's elements over splits 0, 1, .. in that order.
template <int MT, int NT, int ROWS, typename O>
__device__ __forceinline__ void ig_store(const float (&acc)[MT][NT][4], bool writer, int wr,
                                         int mstride, int g, int t,
                                         const float* __restrict__ bias, int has_bias,
                                         O* __restrict__ out, int accumulate, float alpha, int n,
                                         int m, int r0, int mb, int split, int splits,
                                         float* __restrict__ partials, int* __restrict__ locks) {
    auto finish = [&](O* o, int j, float sum) {
        float v = alpha * sum;
        if (accumulate) v += load_out(o);
        if (has_bias) v += bias[j];
        store_out(o, v);
    };
    if (splits == 1) {
        if (!writer) return;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int row = nt * 8 + 2 * t + (c & 1);
                    const int j = r0 + wr + mt * mstride + g + 8 * (c >> 1);
                    if (row < n && j < m) finish(out + (size_t)row * m + j, j, acc[mt][nt][c]);
                }
        return;
    }
    const int tile = n * ROWS;
    float* mine = partials + (size_t)blockIdx.x * tile;
    if (writer) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int row = nt * 8 + 2 * t + (c & 1);
                    const int col = wr + mt * mstride + g + 8 * (c >> 1);
                    if (row < n) __stcg(mine + row * ROWS + col, acc[mt][nt][c]);
                }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(locks + mb, 1);
        while (atomicAdd(locks + mb, 0) < splits) {
        }
        __threadfence();
    }
    __syncthreads();
    const float* first = partials + (size_t)mb * splits * tile;
    const int e1 = (int)((long long)(split + 1) * tile / splits);
    for (int e = (int)((long long)split * tile / splits) + threadIdx.x; e < e1; e += blockDim.x) {
        const int row = e / ROWS, j = r0 + e % ROWS;
        if (j >= m) continue;
        float sum = 0.0f;
        for (int q = 0; q < splits; ++q) sum += __ldcg(first + (size_t)q * tile + e);
        finish(out + (size_t)row * m + j, j, sum);
    }
    // Every split counts in a second time once past the wait; the last sets the lock to 0
    // for the next launch (none of the m-block's splits is waiting any more).
    if (threadIdx.x == 0 && atomicAdd(locks + mb, 1) == 2 * splits - 1) atomicExch(locks + mb, 0);
}

template <int FMT, int NT, int RG, int KS, typename O>
__device__ __forceinline__ void int_mma_gemm(const __half* __restrict__ x, int n,
                                             const unsigned* __restrict__ w,
                                             const __half2* __restrict__ sz, int group,
                                             const float* __restrict__ bias, int has_bias,
                                             O* __restrict__ out, int accumulate, float alpha,
                                             int m, int k, int splits,
                                             float* __restrict__ partials,
                                             int* __restrict__ locks) {
    static_assert(KS == 1 || KS == 2, "a row group's warps take whole stages or halves");
    constexpr int BITS = fmt_bits(FMT), MT = 2, ROWS = RG * 32;
    constexpr int STAGE = ig_stage_bytes<BITS, NT, ROWS>() / 16;  // in uint4
    // The halves' sums (KS = 2) go through the stages' memory.
    static_assert(KS == 1 || (KS - 1) * RG * MT * NT * 4 * WARP * 4 <= IG_STAGES * STAGE * 16,
                  "the second halves' sums fit the stages' shared memory");
    uint4* smem = reinterpret_cast<uint4*>(gemv_staged);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    // The warp's row group (its rows wr .. wr + 31 of the block) and part of each stage (the
    // KS == 1 forms spare the 256-row block a division and 8 registers).
    const int wr = (KS == 1 ? warp : warp % RG) * 32, part = KS == 1 ? 0 : warp / RG;
    const int mb = blockIdx.x / splits, split = blockIdx.x % splits, r0 = mb * ROWS;
    const int stages = k / IG_K;
    const int s_begin = (int)((long long)split * stages / splits);
    const int s_end = (int)((long long)(split + 1) * stages / splits);
    constexpr int THREADS = RG * KS * WARP;
    const int count = s_end - s_begin, groups = k / group;
    // A stage's groups' scale slot of column c is c >> gshift: group is a power of two from
    // the loads' columns up when below IG_K (int_gemm_takes).
    const int gshift = __ffs(min(group, IG_K)) - 1;
    IgGroups zg(group, s_begin);
    // The first stages' weights and (scale, zero) slots go out before grid_wait: under
    // programmatic launch they stream while the kernel before (x's) still runs. x's rows follow
    // in cp.async groups of their own, after all of those, so the loop's wait for all but the
    // newest IG_STAGES - 2 groups still means every part of stage `it` has landed.
#pragma unroll
    for (int s = 0; s < IG_STAGES - 1; ++s) {
        if (s < count) {
            ig_load_stage<BITS, NT, ROWS, THREADS, true, IG_WZ>(smem + s * STAGE, w, sz, x, n, m,
                                                                k, groups, zg, r0, s_begin + s);
            zg.next();
        }
        cp_async_commit();
    }
    grid_wait();
    grid_launch_dependents();
#pragma unroll
    for (int s = 0; s < IG_STAGES - 1; ++s) {
        if (s < count)
            ig_load_stage<BITS, NT, ROWS, THREADS, true, IG_X>(smem + s * STAGE, w, sz, x, n, m, k,
                                                               groups, zg, r0, s_begin + s);
        cp_async_commit();
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;

    for (int it = 0; it < count; ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(IG_STAGES - 2) : "memory");
        __syncthreads();
        // The buffer read an iteration ago is free (every warp passed the barrier above).
        const int next = it + IG_STAGES - 1;
        if (next < count) {
            ig_load_stage<BITS, NT, ROWS, THREADS>(smem + (next % IG_STAGES) * STAGE, w, sz, x,
                                                   n, m, k, groups, zg, r0, s_begin + next);
            zg.next();
        }
        cp_async_commit();
        const uint4* ws = smem + (it % IG_STAGES) * STAGE;
        const uint4* xs = ws + ig_w_units<BITS, ROWS>();
        const __half2* zs = reinterpret_cast<const __half2*>(xs + ig_x_units<NT>());
        if (KS == 1)
            ig_mma_stage<FMT, NT, 0, 4>(acc, ws, xs, zs, wr, g, t, gshift);
        else if (part == 0)
            ig_mma_stage<FMT, NT, 0, 2>(acc, ws, xs, zs, wr, g, t, gshift);
        else
            ig_mma_stage<FMT, NT, 2, 4>(acc, ws, xs, zs, wr, g, t, gshift);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (KS > 1) {
        // The second half's sums added to the first's (in that order) through the stages'
        // memory, free once every warp is past its last stage; a lane's floats are 32 apart.
        float* second = gemv_staged + (warp % RG) * (MT * NT * 4 * WARP) + lane;
        __syncthreads();
        if (part == 1) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        second[((mt * NT + nt) * 4 + c) * WARP] = acc[mt][nt][c];
        }
        __syncthreads();
        if (part == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        acc[mt][nt][c] += second[((mt * NT + nt) * 4 + c) * WARP];
        }
    }

    ig_store<MT, NT, ROWS>(acc, part == 0, wr, 16, g, t, bias, has_bias, out, accumulate, alpha,
                           n, m, r0, mb, split, splits, partials, locks);
}

// <prefix><format>_r<rows>_n<NT>_<f32|f16>: one kernel per format, block shape (IG_BLOCKS:
// ROWS, RG, KS), n-tiles and output type, of the GEMM IMPL (int_mma_gemm, prefix int_gemm_;
// int_wgmma_gemm below, int_gemm_wg_).
#define INT_GEMM_KERNEL(IMPL, PREFIX, FMT, NAME, NT, ROWS, RG, KS, O, SUFFIX)                   \
    extern "C" __global__ void __launch_bounds__(RG * KS * WARP, 1)                              \
        PREFIX##NAME##_r##ROWS##_n##NT##_##SUFFIX(                                               \
            const __half* __restrict__ x, int n, const unsigned* __restrict__ w,                 \
            const __half2* __restrict__ sz, int group, const float* __restrict__ bias,           \
            int has_bias, O* __restrict__ out, int accumulate, float alpha, int m, int k,        \
            int splits, float* __restrict__ partials, int* __restrict__ locks) {                 \
        static_assert(ROWS == RG * 32, "32 rows a row group");                                  \
        IMPL<FMT, NT, RG, KS, O>(x, n, w, sz, group, bias, has_bias, out, accumulate, alpha, m,  \
                                 k, splits, partials, locks);                                    \
    }
#define INT_GEMM_BLOCK_KERNELS(IMPL, PREFIX, FMT, NAME, NT, ROWS, RG, KS)   \
    INT_GEMM_KERNEL(IMPL, PREFIX, FMT, NAME, NT, ROWS, RG, KS, float, f32)  \
    INT_GEMM_KERNEL(IMPL, PREFIX, FMT, NAME, NT, ROWS, RG, KS, __half, f16)
#define INT_GEMM_KERNELS(IMPL, PREFIX, FMT, NAME, NT) \
    IG_BLOCKS(INT_GEMM_BLOCK_KERNELS, IMPL, PREFIX, FMT, NAME, NT)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W4, w4, 1)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W4, w4, 2)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W4, w4, 4)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W4, w4, 8)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W8, w8, 1)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W8, w8, 2)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W8, w8, 4)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_W8, w8, 8)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_F8, f8, 1)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_F8, f8, 2)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_F8, f8, 4)
INT_GEMM_KERNELS(int_mma_gemm, int_gemm_, FMT_F8, f8, 8)

// ---- The integer GEMM on Hopper's warpgroup MMA (wgmma, sm_90a only) ----
//
// The same products as int_mma_gemm (the same blocks, grid, stages of weights and (scale,
// zero), A fragments and epilogue), with a warpgroup's wgmma in place of its warps' mma.sync,
// for 17..=64 rows of x (the host's INT_GEMM_WGMMA_MIN_TILES; at 8 and 16 rows int_mma_gemm
// was 1-7% faster). int_mma_gemm at 64 rows issues ~12 instructions a mma (x's B fragments
// loaded and paired for every mma, besides the dequantization) at 3 warps a scheduler. Here the
// tensor cores read x from shared memory by descriptor, and one wgmma of a warpgroup multiplies
// 64 weight rows by all of x's rows (m64nNk16, N = 8 NT) while its warps dequantize the next
// step's A fragments in registers (Machete's design on Hopper, in our layout). H200, 64 rows,
// W4 (int_gemm example): the MLP (gate/up, SwiGLU, down) 92 us, int_mma_gemm's 117, cuBLAS's
// f16 one 95; gate/up 53 us against 68.
//
// x's tile. The A fragments hold a word's columns in IntPairs' order (lane t's k slots 2t,
// 2t + 1 are columns c and c + 4 of its chunk's word at 4 bits, c and c + 2 at 8), so B's k
// rows must come in the same order, and wgmma takes them from shared memory as they lie. Each
// stage's x is therefore read into registers (L2) and written permuted: four threads take an x
// row, thread t its units for lane column t (igw_unit), so that the four read the row's 256
// bytes whole, and pair each unit's columns with a prmt as int_mma_gemm's B fragments do. (A
// first form had a thread take one quarter of the steps for all four lane columns: its 16-byte
// loads were 64 bytes apart, a warp's touched 32 rows, and the MLP took 116 us at 64 rows, no
// faster than int_mma_gemm; without x's loads at all, 81. Holding x two stages ahead instead
// of one measured the same.) The tile is in wgmma's no-swizzle K-major layout: core matrices
// of 8 x rows by 8 k slots (128 contiguous bytes), step s's two cores 128 bytes apart (leading
// byte offset), its n-blocks of 8 rows 256 apart (stride); a store's 32 lanes fill one core.
// Three tiles rotate: the next stage's is written once this stage's wgmma are issued, into the
// tile of the stage before last, whose wgmma every warpgroup has waited for before the block's
// last barrier.
//
// Shared memory: IG_STAGES stages of weights and (scale, zero) (ig_load_stage without x) and
// three x tiles: int_mma_gemm's stages hold the same x bytes, so the same bytes (int_gemm_smem)
// serve both. Blocks: ROWS = 64 MT WG rows, WG warpgroups (the warps of int_mma_gemm's
// shape: 256 rows as 2 warpgroups of 2 m64 tiles, 192 as 3 of one, 128 as 2 of one); warp w's
// rows of m-tile mt are 64 (MT (w / 4) + mt) + 16 (w % 4) .. + 15. Forcing another shape on
// every projection (VLM_INT_GEMM_ROWS) was slower at 32 and 64 rows: int_gemm_grid's choice
// stands. At 112-180 registers a thread, no spills (sm_90a).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The x unit (16 bytes, 8 columns of the stage's 128) from which lane column t takes its k
// slots of k16 steps 2q and 2q + 1 (int_mma_gemm's xu for the same steps).
template <int BITS>
__device__ __forceinline__ int igw_unit(int q, int t) {
    return BITS == 4 ? 4 * t + q : 8 * (q >> 1) + 2 * t + (q & 1);
}

// This thread's four units of x for stage columns k0 .. : thread i < 4N takes x row i / 4 and
// lane column t = i % 4, its units for q = 0..3 (at 4 bits 64 contiguous bytes, at 8 two runs
// of 32), so that a row's four threads read its 256 bytes whole. Rows past n read row n - 1
// (their sums are never written).
template <int BITS, int NT>
__device__ __forceinline__ void igw_load_x(uint4 (&v)[4], const __half* __restrict__ x, int n,
                                           int k, int k0) {
    constexpr int N = NT * 8;
    const int i = threadIdx.x;
    if (i < 4 * N) {
        const unsigned row = min(i / 4, n - 1);
        const __half* xr = x + (row * (unsigned)k + k0);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            v[q] = __ldcg(reinterpret_cast<const uint4*>(xr + igw_unit<BITS>(q, i % 4) * 8));
    }
}

// The units igw_load_x read, paired and written into tile bt: for each step 2q + h, the
// thread's word (lane column t) of its x row in core 0 (k slots 0..7) and in core 1 (8..15).
// A store's 32 lanes (8 rows x 4 columns) fill one core's 128 bytes.
template <int BITS, int NT>
__device__ __forceinline__ void igw_store_x(uint4* bt, const uint4 (&v)[4]) {
    constexpr int N = NT * 8;
    const int i = threadIdx.x;
    if (i < 4 * N) {
        const int r = i / 4, t = i % 4;
        unsigned* row = reinterpret_cast<unsigned*>(bt) + (r / 8) * 64 + (r % 8) * 4 + t;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned w[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // 4 bits: columns (2h, 2h + 4) and (2h + 1, 2h + 5) of a unit; 8 bits:
                // (4h, 4h + 2) and (4h + 1, 4h + 3).
                const unsigned lo = w[BITS == 4 ? h : 2 * h];
                const unsigned hi = w[BITS == 4 ? h + 2 : 2 * h + 1];
                unsigned* core = row + (2 * q + h) * NT * 64;
                core[0] = prmt(lo, hi, 0x5410);
                core[32] = prmt(lo, hi, 0x7632);
            }
        }
    }
}

template <int FMT, int NT, int RG, int KS, typename O>
__device__ __forceinline__ void int_wgmma_gemm(const __half* __restrict__ x, int n,
                                               const unsigned* __restrict__ w,
                                               const __half2* __restrict__ sz, int group,
                                               const float* __restrict__ bias, int has_bias,
                                               O* __restrict__ out, int accumulate, float alpha,
                                               int m, int k, int splits,
                                               float* __restrict__ partials,
                                               int* __restrict__ locks) {
    // int_mma_gemm's shape (RG row groups of 32 rows, KS warps each) as WG warpgroups of MT
    // m64 tiles.
    constexpr int ROWS = RG * 32, WG = RG * KS / 4, MT = ROWS / (64 * WG);
    static_assert(ROWS == 64 * MT * WG, "whole m64 tiles a warpgroup");
    constexpr int BITS = fmt_bits(FMT), THREADS = WG * 128, N = NT * 8;
    constexpr int WU = IG_K * BITS / 128, COLS = 128 / BITS, CHUNKS = WU / 4;
    constexpr int STEPS = 8 / CHUNKS;  // k16 steps a chunk
    constexpr int W_STAGE = ig_w_units<BITS, ROWS>() + ROWS * IG_SZ_SLOTS / 4;  // in uint4
    constexpr int B_TILE = ig_x_units<NT>();
    static_assert(4 * N <= THREADS, "four threads an x row");
    static_assert(IG_STAGES >= 3, "three x tiles in the bytes of int_mma_gemm's stages' x");
    uint4* smem = reinterpret_cast<uint4*>(gemv_staged);
    uint4* tiles = smem + IG_STAGES * W_STAGE;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int wr = 64 * MT * (warp / 4) + 16 * (warp % 4);
    const int mb = blockIdx.x / splits, split = blockIdx.x % splits, r0 = mb * ROWS;
    const int stages = k / IG_K;
    const int s_begin = (int)((long long)split * stages / splits);
    const int s_end = (int)((long long)(split + 1) * stages / splits);
    const int count = s_end - s_begin, groups = k / group;
    const int gshift = __ffs(min(group, IG_K)) - 1;
    IgGroups zg(group, s_begin);
    // The first stages' weights and (scale, zero) slots before grid_wait (int_mma_gemm's
    // comment), x after it.
#pragma unroll
    for (int s = 0; s < IG_STAGES - 1; ++s) {
        if (s < count) {
            ig_load_stage<BITS, NT, ROWS, THREADS, false>(smem + s * W_STAGE, w, sz, x, n, m, k,
                                                          groups, zg, r0, s_begin + s);
            zg.next();
        }
        cp_async_commit();
    }
    grid_wait();
    grid_launch_dependents();
    // The first stage's x tile; the next stage's x in registers.
    uint4 xv[4];
    if (count > 0) {
        igw_load_x<BITS, NT>(xv, x, n, k, s_begin * IG_K);
        igw_store_x<BITS, NT>(tiles, xv);
    }
    if (count > 1) igw_load_x<BITS, NT>(xv, x, n, k, (s_begin + 1) * IG_K);
    fence_proxy_async();

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;
    // A fragments of two steps: a step's registers are free once the wait after the next
    // step's wgmma returns.
    unsigned af[2][MT][4];

    for (int it = 0; it < count; ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(IG_STAGES - 2) : "memory");
        // Also: the last stage's x tile written and fenced by every thread, and every
        // warpgroup's wgmma of the stage before it done.
        __syncthreads();
        const int next = it + IG_STAGES - 1;
        if (next < count) {
            ig_load_stage<BITS, NT, ROWS, THREADS, false>(smem + (next % IG_STAGES) * W_STAGE,
                                                          w, sz, x, n, m, k, groups, zg, r0,
                                                          s_begin + next);
            zg.next();
        }
        cp_async_commit();
        const uint4* ws = smem + (it % IG_STAGES) * W_STAGE;
        const __half2* zs = reinterpret_cast<const __half2*>(ws + ig_w_units<BITS, ROWS>());
        const uint4* bt = tiles + (it % 3) * B_TILE;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int ch = 4 * c + t, slot = (ch * COLS) >> gshift;
            IgChunk<FMT> chunk[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                chunk[mt] = IgChunk<FMT>(ws, zs, wr + 64 * mt + g, ch, slot);
#pragma unroll
            for (int j = 0; j < STEPS; ++j) {
                const int step = c * STEPS + j, buf = step & 1;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    chunk[mt].fragment(j, reinterpret_cast<__half2(&)[4]>(af[buf][mt]));
                const unsigned long long b = wg_desc(bt + step * NT * 16, 128, 256);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    wg_hold(reinterpret_cast<float(&)[NT * 4]>(acc[mt]));
                wg_fence();
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    WgmmaRS<N>::template run<false>(reinterpret_cast<float(&)[NT * 4]>(acc[mt]),
                                                   af[buf][mt], b);
                wg_commit();
                wg_wait<1>();
                wg_hold_u(af[buf ^ 1]);
            }
        }
        // The next stage's x into its tile, and the one after's loads (holding them two
        // stages ahead measured no faster).
        if (it + 1 < count) {
            igw_store_x<BITS, NT>(tiles + ((it + 1) % 3) * B_TILE, xv);
            fence_proxy_async();
            if (it + 2 < count) igw_load_x<BITS, NT>(xv, x, n, k, (s_begin + it + 2) * IG_K);
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) wg_hold(reinterpret_cast<float(&)[NT * 4]>(acc[mt]));
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    ig_store<MT, NT, ROWS>(acc, true, wr, 64, g, t, bias, has_bias, out, accumulate, alpha, n,
                           m, r0, mb, split, splits, partials, locks);
}

// int_gemm_wg_<format>_r<rows>_n<NT>_<f32|f16>: int_gemm_<format>_..'s shapes and arguments,
// for n-tiles 4 and 8 (17..64 rows).
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_W4, w4, 4)
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_W4, w4, 8)
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_W8, w8, 4)
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_W8, w8, 8)
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_F8, f8, 4)
INT_GEMM_KERNELS(int_wgmma_gemm, int_gemm_wg_, FMT_F8, f8, 8)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// An integer matrix as f16 [m, k], for the tensor-core GEMMs of prefill and batches (into a
// scratch buffer the GEMM then reads). A batch of 64 rows dequantizes every matrix each step,
// so this is about bytes: a thread takes one 16-byte load (128 / BITS columns, one scale group)
// and writes its halves in 16-byte stores, one row division per load. One value at a time (a
// 2-byte store and a 64-bit division each) it ran at about a quarter of the copy bandwidth.
// Same f32 arithmetic and rounding as before, value for value.
template <int FMT>
__device__ __forceinline__ void dequant_int(const unsigned* __restrict__ w,
                                            const __half2* __restrict__ sz, int group,
                                            __half* __restrict__ out, int m, int k) {
    constexpr int BITS = fmt_bits(FMT), COLS = 128 / BITS, PER = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1;
    const size_t row_loads = k / COLS, n = (size_t)m * row_loads;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t row = i / row_loads;
        const int c0 = (int)(i - row * row_loads) * COLS;
        const float2 s = group_scale<FMT>(sz[row * (k / group) + c0 / group]);
        const uint4 raw = load_stream16(w + i * 4);
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint4* o = reinterpret_cast<uint4*>(out + row * k + c0);
#pragma unroll
        for (int q = 0; q < COLS / 8; ++q) {
            unsigned packed[4];
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const int e = q * 8 + 2 * h;
                float a, b;
                if (FMT == FMT_F8) {
                    // Bytes e and e + 1 (one word: e is even) into the halves' high bytes.
                    const unsigned two = words[e / PER] >> (8 * (e % PER));
                    const float2 f =
                        __half22float2(f8_pair(((two & 0xffu) << 8) | ((two & 0xff00u) << 16)));
                    a = f.x * s.x;
                    b = f.y * s.x;
                } else {
                    const unsigned qa = (words[e / PER] >> (BITS * (e % PER))) & MASK;
                    const unsigned qb = (words[(e + 1) / PER] >> (BITS * ((e + 1) % PER))) & MASK;
                    a = ((float)qa - s.y) * s.x;
                    b = ((float)qb - s.y) * s.x;
                }
                const __half2 v = __floats2half2_rn(a, b);
                packed[h] = *reinterpret_cast<const unsigned*>(&v);
            }
            o[q] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
    }
}
extern "C" __global__ void dequant_w4_f16(const unsigned* __restrict__ w,
                                          const __half2* __restrict__ sz, int group,
                                          __half* __restrict__ out, int m, int k) {
    dequant_int<FMT_W4>(w, sz, group, out, m, k);
}
extern "C" __global__ void dequant_w8_f16(const unsigned* __restrict__ w,
                                          const __half2* __restrict__ sz, int group,
                                          __half* __restrict__ out, int m, int k) {
    dequant_int<FMT_W8>(w, sz, group, out, m, k);
}
extern "C" __global__ void dequant_f8_f16(const unsigned* __restrict__ w,
                                          const __half2* __restrict__ sz, int group,
                                          __half* __restrict__ out, int m, int k) {
    dequant_int<FMT_F8>(w, sz, group, out, m, k);
}

// A random-weight model's integer matrix (cuda/src/quant.rs's random_int): value e (row-major)
// is the top BITS bits of random_bits(key, e); n words of 32 / bits values.
extern "C" __global__ void fill_random_int(unsigned* __restrict__ w, unsigned long long n,
                                           unsigned long long key, int bits) {
    const int per = 32 / bits;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned word = 0;
        for (int j = 0; j < per; ++j)
            word |= (unsigned)(random_bits(key, i * per + j) >> (64 - bits)) << (bits * j);
        w[i] = word;
    }
}
