// Where batch-1 decode's time between the weights goes: one decoding layer's four GEMVs at the
// 8B sizes (q/k/v 6144 x 4096, o 4096 x 4096, gate/up 24576 x 4096, down 4096 x 12288; f16,
// 36 layers of distinct weights, 13.9 GB) run as
//   R  a plain streaming read of the same bytes (the bandwidth a GEMV could reach),
//   A  four kernels a layer recorded in a CUDA graph (a decode step's structure),
//   B  one persistent cooperative kernel, a grid barrier between GEMVs,
//   C  B with each warp's first loads of the next GEMV held in registers across the barrier,
//   D  B with each lane's first chunks of the next GEMV copied into shared memory by cp.async
//      before the barrier (no registers held), read from there after it,
//   E  A with programmatic dependent launch, each GEMV at half an SM's warps staging its
//      first weights into shared memory before it waits for the one before,
// and A, D and E again with a 10 us stand-in for decode attention between q/k/v and o; then a
// decode layer's shape (q/k/v, a 2 us RoPE stand-in, an 8 us attention stand-in that lets its
// dependent start, o, gate/up, down) as
//   A' plain launches,
//   F  E with each kernel's trigger after its wait (only the next kernel resident early),
//   G  F with rows past a warp's first handed out by an atomic ticket,
//   P  G (two blocks an SM, stand-ins) with the o projection's weights asked of L2 (TMA bulk
//      prefetch from a stand-in, or the o GEMV's own lines before its wait) or its warps'
//      whole first rows staged, while the stand-ins run;
// and with `gemv_chain l2`, Q: the o projection alone, cold, after a read of o and after L2
// prefetches of it; and when a dependent's blocks enter SMs that run the kernel before; and with
// `gemv_chain df`, DF: all 144 GEMVs as one dataflow kernel (rows by one ticket, a GEMV's rows
// waiting on a counter of the one before's, no kernel boundary).
//
// Not part of the build: a research harness for the GPU machine, plain CUDA (nvcc):
//   nvcc -O3 -std=c++17 -arch=sm_90a cuda/bench/gemv_chain.cu -o /tmp/gemv_chain && /tmp/gemv_chain
//
// On an H100 80GB HBM3 (2026-11-26), us a layer (medians of 9): R 125.6-126.7 (3.05 TB/s); A
// 143.8-144.1; B 146.0; C 167.0 (registers: 3 blocks an SM); D with 8 chunks (4 KB a warp) 135.2
// -135.4, with 12 and 16 133.8-139.3 by occupancy; E at one block (8 warps) an SM 134.5, at two
// 142.2; with the attention stand-in A 155.0, D 150.2, E 152.0 (two blocks) and 175.8 (one).
// The decode layer's shape: A' 155.6; F 174.7 (trigger first, one block an SM), 180.3 (late,
// one), 153.3 (late, two); G 155.2 (one block an SM) and 149.5 (two), and without the
// stand-ins 137.4 / 138.0. At one block an SM the scheduler doubles blocks up on some SMs while
// others still run the kernel before (a static share of rows then waits on those SMs); rows
// handed out as asked for (G) undo that. G at two blocks an SM is the production streamed GEMV.
// So the gaps between a step's GEMVs cost ~18 us a layer (0.65 ms a token at 36 layers) over a
// plain read, a barrier alone recovers none of it, and weights staged ahead recover half: in
// one persistent kernel (D) or, as well, with four kernels under programmatic dependent launch
// when each leaves room on the SMs for the next (E); hiding attention too needs most of the o
// projection (33.5 MB) in flight while it runs. See docs/benchmarks.md, "Batch-1 decode's gaps
// between GEMVs, measured".
//
// P and Q (same GPU, 2026-11-26, fourteenth session; docs/benchmarks.md, "A decode step on the
// GPU's timeline"): P none 148.8 us a layer; o prefetched by 8 SMs' bulk copies 161.2-163.1
// (they outlast the stand-ins and then compete with gate/up), by 64 SMs' 147.7; by the o
// GEMV's own prefetches 148.1-148.9; whole first rows staged 147.8-148.1; o plus 8 / 16 MB of
// gate/up 165-172. Q: o alone 17.0-17.2 us cold, 14.7-14.9 with all of it in L2, 15.3-15.9
// after prefetches: a 33.5 MB GEMV is held by its start and end, not by DRAM. A dependent with
// 64 KB of dynamic shared memory enters an SM that runs an 8 us stand-in only when the
// stand-in ends (entries 0.4-8.3 us); with none, or with every kernel's carveout at 100%, all
// enter at 0.4 us: an SM changes its L1 / shared split only when empty. DF: 206-209 us a layer
// with each row counted done by a release (a fence a row), 149-151 with a warp's rows of a GEMV
// counted at once when it moves on; R 124.5-124.9 and G 138.2 in the same runs. The waits at
// each GEMV's end cost no less without kernel boundaries than with them.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
namespace cg = cooperative_groups;

constexpr int H = 4096, QKV = 6144, I = 12288, LAYERS = 36;
constexpr int THREADS = 256, WARPS = THREADS / 32;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    const half2* a = reinterpret_cast<const half2*>(&w);
    const half2* b = reinterpret_cast<const half2*>(&x);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 fa = __half22float2(a[i]), fb = __half22float2(b[i]);
        s += fa.x * fb.x + fa.y * fb.y;
    }
    return s;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Rows r = gw, gw + nw, ... of y = W x (K columns); `pre`: this warp's first row's first PF
// chunks a lane, already loaded (C), or nullptr.
template <int K, int PF>
__device__ __forceinline__ void gemv_rows(const half* __restrict__ W, const half* __restrict__ x,
                                          half* __restrict__ y, int M, int gw, int nw,
                                          const uint4* pre) {
    const int lane = threadIdx.x % 32;
    constexpr int CH = K / 8 / 32;  // 16-byte chunks a lane a row
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    bool first = true;
    for (int r = gw; r < M; r += nw) {
        const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)r * K);
        float acc = 0.f;
        constexpr int U = CH < 16 ? CH : 16;
#pragma unroll 1
        for (int c0 = 0; c0 < CH; c0 += U) {
            uint4 w[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                w[u] = (PF > 0 && first && c0 == 0 && u < PF && pre) ? pre[u] : ld_stream(wr + (c0 + u) * 32 + lane);
#pragma unroll
            for (int u = 0; u < U; ++u) acc += dot8(w[u], xr[(c0 + u) * 32 + lane]);
        }
        first = false;
        acc = warp_sum(acc);
        if (lane == 0) y[r] = __float2half_rn(acc * 0.01f);
    }
}

template <int K>
__global__ void __launch_bounds__(THREADS) gemv_kernel(const half* W, const half* x, half* y, int M) {
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    gemv_rows<K, 0>(W, x, y, M, gw, nw, nullptr);
}

struct Layer { const half *qkv, *o, *gu, *down; };

template <int K, int PF>
__device__ __forceinline__ void prefetch_first(const half* W, int M, int gw, uint4* pre) {
    const int lane = threadIdx.x % 32;
    if (gw < M) {
        const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)gw * K);
#pragma unroll
        for (int u = 0; u < PF; ++u) pre[u] = ld_stream(wr + u * 32 + lane);
    }
}

// D: each lane's first 16 chunks of its warp's first row of the next GEMV copied into shared
// memory by cp.async before the barrier (no registers held), read from there after it.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
}
template <int K, int PFC>
__device__ __forceinline__ void prefetch_smem(const half* W, int M, int gw, uint4* sm) {
    const int lane = threadIdx.x % 32;
    if (gw < M) {
        const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)gw * K);
#pragma unroll
        for (int u = 0; u < PFC; ++u) cp_async16(sm + u * 32 + lane, wr + u * 32 + lane);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int K, int PFC>
__device__ __forceinline__ void gemv_rows_sm(const half* __restrict__ W, const half* __restrict__ x,
                                             half* __restrict__ y, int M, int gw, int nw,
                                             const uint4* sm, bool have) {
    const int lane = threadIdx.x % 32;
    constexpr int CH = K / 8 / 32;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    if (have) asm volatile("cp.async.wait_all;" ::: "memory");
    bool first = have;
    for (int r = gw; r < M; r += nw) {
        const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)r * K);
        float acc = 0.f;
#pragma unroll 1
        for (int c0 = 0; c0 < CH; c0 += 16) {
            uint4 w[16];
            if (first && c0 == 0) {
#pragma unroll
                for (int u = 0; u < 16; ++u)
                    w[u] = u < PFC ? sm[u * 32 + lane] : ld_stream(wr + u * 32 + lane);
            } else {
#pragma unroll
                for (int u = 0; u < 16; ++u) w[u] = ld_stream(wr + (c0 + u) * 32 + lane);
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) acc += dot8(w[u], xr[(c0 + u) * 32 + lane]);
        }
        first = false;
        acc = warp_sum(acc);
        if (lane == 0) y[r] = __float2half_rn(acc * 0.01f);
    }
}
// A stand-in for decode attention between q/k/v and o: 64 blocks busy for `ns` nanoseconds.
__device__ __forceinline__ void spin_ns(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
}
__global__ void spin_kernel(long long ns) { if (threadIdx.x == 0) spin_ns(ns); }
// The same as a dependent launch that lets the next kernel be scheduled at once.
__global__ void spin_pdl(long long ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) spin_ns(ns);
}

template <int PFC, int ATT_NS = 0>
__global__ void __launch_bounds__(THREADS, 2) persistent_sm(const Layer* layers, half* x, half* a,
                                                         half* b, half* c) {
    cg::grid_group grid = cg::this_grid();
    extern __shared__ uint4 smem_all[];
    uint4* sm = smem_all + (threadIdx.x / 32) * PFC * 32;
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    for (int l = 0; l < LAYERS; ++l) {
        const Layer L = layers[l];
        gemv_rows_sm<H, PFC>(L.qkv, x, a, QKV, gw, nw, sm, l > 0);
        prefetch_smem<H, PFC>(L.o, H, gw, sm);
        if (ATT_NS) {
            grid.sync();  // attention reads q/k/v
            if (blockIdx.x < 64 && threadIdx.x == 0) spin_ns(ATT_NS);
        }
        grid.sync();
        gemv_rows_sm<H, PFC>(L.o, a, b, H, gw, nw, sm, true);
        prefetch_smem<H, PFC>(L.gu, 2 * I, gw, sm);
        grid.sync();
        gemv_rows_sm<H, PFC>(L.gu, b, c, 2 * I, gw, nw, sm, true);
        prefetch_smem<I, PFC>(L.down, H, gw, sm);
        grid.sync();
        gemv_rows_sm<I, PFC>(L.down, c, x, H, gw, nw, sm, true);
        if (l + 1 < LAYERS) prefetch_smem<H, PFC>(layers[l + 1].qkv, QKV, gw, sm);
        grid.sync();
    }
}

// E: four kernels a layer again, but launched with programmatic dependent launch: each kernel
// lets the next be scheduled at once (launch_dependents first thing), and the next, at half
// the SM's warps so that it finds room beside the running one, stages its first weights into
// shared memory by cp.async before griddepcontrol.wait (which returns once the previous grid
// has finished and its writes are visible).
template <int K, int PFC>
__global__ void __launch_bounds__(THREADS) gemv_pdl(const half* W, const half* x, half* y, int M) {
    extern __shared__ uint4 smem_pdl[];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    uint4* sm = smem_pdl + (threadIdx.x / 32) * PFC * 32;
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    prefetch_smem<K, PFC>(W, M, gw, sm);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    gemv_rows_sm<K, PFC>(W, x, y, M, gw, nw, sm, true);
}

// F: E with the trigger after the wait, so that only the next kernel (not every one after it)
// is resident and staging beside the running one.
template <int K, int PFC>
__global__ void __launch_bounds__(THREADS) gemv_pdl_late(const half* W, const half* x, half* y, int M) {
    extern __shared__ uint4 smem_pdl[];
    uint4* sm = smem_pdl + (threadIdx.x / 32) * PFC * 32;
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    prefetch_smem<K, PFC>(W, M, gw, sm);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    gemv_rows_sm<K, PFC>(W, x, y, M, gw, nw, sm, true);
}
// G: F with rows handed out as they are taken: each warp's first row is its own (staged before
// the wait), every later one comes from an atomic counter (zeroed at the step's start), asked
// for before the row in hand is summed. A block that shares its SM with another of the same
// grid (the scheduler places blocks where room is, not one an SM) then takes fewer rows
// instead of holding the kernel's end back.
// L2 (P): before the wait, the rest of the warp's rows gw, gw + nw, ... (all of W over the
// grid) asked of L2: 1 by each lane's prefetch.global.L2 of 128-byte lines, 2 by one bulk
// prefetch a row.
template <int K, int PFC, int L2 = 0>
__global__ void __launch_bounds__(THREADS) gemv_pdl_dyn(const half* W, const half* x, half* y, int M,
                                                     unsigned* counter) {
    extern __shared__ uint4 smem_pdl[];
    uint4* sm = smem_pdl + (threadIdx.x / 32) * PFC * 32;
    const int lane = threadIdx.x % 32;
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    prefetch_smem<K, PFC>(W, M, gw, sm);
    if (L2) {
        for (int r = gw; r < M; r += nw) {
            const char* row = reinterpret_cast<const char*>(W + (size_t)r * K);
            const int first = r == gw ? PFC * 32 * 16 : 0;
            if (L2 == 1) {
                for (int off = first + lane * 128; off < K * 2; off += 32 * 128)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
            } else if (lane == 0 && first < K * 2) {
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row + first), "r"(K * 2 - first) : "memory");
            }
        }
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("cp.async.wait_all;" ::: "memory");
    constexpr int CH = K / 8 / 32;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    int r = gw;
    bool first = true;
    while (r < M) {
        unsigned nxt = 0;
        if (lane == 0) nxt = atomicAdd(counter, 1u);
        const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)r * K);
        float acc = 0.f;
#pragma unroll 1
        for (int c0 = 0; c0 < CH; c0 += 16) {
            uint4 w[16];
            if (first && c0 == 0) {
#pragma unroll
                for (int u = 0; u < 16; ++u)
                    w[u] = u < PFC ? sm[u * 32 + lane] : ld_stream(wr + u * 32 + lane);
            } else {
#pragma unroll
                for (int u = 0; u < 16; ++u) w[u] = ld_stream(wr + (c0 + u) * 32 + lane);
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) acc += dot8(w[u], xr[(c0 + u) * 32 + lane]);
        }
        first = false;
        acc = warp_sum(acc);
        if (lane == 0) y[r] = __float2half_rn(acc * 0.01f);
        r = nw + (int)__shfl_sync(0xffffffff, nxt, 0);
    }
}

// Stand-ins for a decode layer's small kernels: the q/k norm + RoPE + cache write (launched
// plainly) and attention (plain launch, lets its dependent start at once).
__global__ void spin_trigger(long long ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) spin_ns(ns);
}

// P's stand-ins: the same spins, each block first asking L2 (TMA's bulk prefetch, sm_90) for
// its share of `bytes` from p in pieces of `piece` bytes, one piece a thread a round.
__global__ void spin_prefetch(long long ns, const char* p, size_t bytes, unsigned piece, int trigger) {
    if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const size_t share = (bytes / gridDim.x + 15) / 16 * 16;
    const size_t begin = blockIdx.x * share, end = begin + share < bytes ? begin + share : bytes;
    for (size_t off = begin + (size_t)threadIdx.x * piece; off < end; off += (size_t)blockDim.x * piece) {
        unsigned n = end - off < piece ? (unsigned)(end - off) : piece;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
    if (threadIdx.x == 0) spin_ns(ns);
}

// All layers in one cooperative kernel: qkv -> o -> gate/up -> down, a grid barrier between.
template <int PF>
__global__ void __launch_bounds__(THREADS) persistent(const Layer* layers, half* x, half* a,
                                                      half* b, half* c) {
    cg::grid_group grid = cg::this_grid();
    const int gw = blockIdx.x * WARPS + threadIdx.x / 32, nw = gridDim.x * WARPS;
    uint4 pre[PF > 0 ? PF : 1];
    for (int l = 0; l < LAYERS; ++l) {
        const Layer L = layers[l];
        gemv_rows<H, PF>(L.qkv, x, a, QKV, gw, nw, PF && l > 0 ? pre : nullptr);
        if (PF) prefetch_first<H, PF>(L.o, H, gw, pre);
        grid.sync();
        gemv_rows<H, PF>(L.o, a, b, H, gw, nw, PF ? pre : nullptr);
        if (PF) prefetch_first<H, PF>(L.gu, 2 * I, gw, pre);
        grid.sync();
        gemv_rows<H, PF>(L.gu, b, c, 2 * I, gw, nw, PF ? pre : nullptr);
        if (PF) prefetch_first<I, PF>(L.down, H, gw, pre);
        grid.sync();
        gemv_rows<I, PF>(L.down, c, x, H, gw, nw, PF ? pre : nullptr);
        if (PF && l + 1 < LAYERS) prefetch_first<H, PF>(layers[l + 1].qkv, QKV, gw, pre);
        grid.sync();
    }
}

__global__ void read_all(const uint4* p, size_t n, unsigned* sink) {
    unsigned s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = ld_stream(p + i);
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x12345678) *sink = s;
}

__global__ void fill(half* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2half_rn(((i * 2654435761u) % 1000) * 1e-4f);
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Q (`gemv_chain l2`): is a GEMV faster when its weights are in L2, and do L2 prefetches get
// them there? The o projection (4096 x 4096, 33.5 MB) timed alone after L2 is flushed (a 400 MB
// read), then after a read of o itself, after prefetches of o and a 10 us wait.
__global__ void l2_lines(const char* p, size_t bytes) {
    for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 128; off < bytes;
         off += (size_t)gridDim.x * blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}
__global__ void l2_bulk(const char* p, size_t bytes, unsigned piece) {
    for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * piece; off < bytes;
         off += (size_t)gridDim.x * blockDim.x * piece) {
        unsigned n = bytes - off < piece ? (unsigned)(bytes - off) : piece;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
}
// When do a dependent's blocks start? t[0]: the stand-in's start; t[1 + b]: block b's entry,
// t[1 + gridDim + b]: after its wait.
__global__ void spin_trigger_t(long long ns, unsigned long long* t) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
        unsigned long long t0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        if (blockIdx.x == 0) t[0] = t0;
        spin_ns(ns);
    }
}
__global__ void __launch_bounds__(THREADS) probe_pdl(unsigned long long* t) {
    unsigned long long a, b;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(a));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(b));
    if (threadIdx.x == 0) { t[1 + blockIdx.x] = a; t[1 + gridDim.x + blockIdx.x] = b; }
}
static int l2_experiments(const half* w, size_t per_layer, const std::vector<Layer>& hl, half* a, half* b,
                          unsigned* sink, int sms, cudaStream_t s) {
    unsigned* ctr;
    CK(cudaMalloc(&ctr, 4));
    constexpr int PFC = 8;
    const int smem = WARPS * PFC * 32 * 16;
    cudaFuncSetAttribute(gemv_pdl_dyn<H, PFC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const char* o = (const char*)hl[0].o;
    const size_t ob = (size_t)H * H * 2;
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    auto run = [&](const char* name, auto&& before) {
        std::vector<float> ts;
        for (int i = 0; i < 15; ++i) {
            read_all<<<sms * 8, 512, 0, s>>>((const uint4*)(w + per_layer * 10), per_layer * 2 / 16, sink);
            cudaMemsetAsync(ctr, 0, 4, s);
            before();
            cudaEventRecord(e0, s);
            gemv_pdl_dyn<H, PFC><<<sms * 2, THREADS, smem, s>>>(hl[0].o, a, b, H, ctr);
            cudaEventRecord(e1, s);
            cudaEventSynchronize(e1);
            float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms * 1000);
        }
        std::sort(ts.begin(), ts.end());
        printf("Q %-48s o GEMV %.1f us (min %.1f)  err=%s\n", name, ts[7], ts[0], cudaGetErrorString(cudaGetLastError()));
    };
    {
        unsigned long long* t;
        const int blocks = sms * 2;
        CK(cudaMalloc(&t, (1 + 2 * blocks) * 8));
        for (int smemb : {0, 64 * 1024, -64 * 1024}) {
            const bool carve = smemb < 0;
            smemb = carve ? -smemb : smemb;
            // With every kernel asking for the most shared memory, an SM never waits to drain
            // before it changes its L1/shared split for the next kernel.
            cudaFuncSetAttribute(spin_trigger_t, cudaFuncAttributePreferredSharedMemoryCarveout, carve ? 100 : -1);
            cudaFuncSetAttribute(probe_pdl, cudaFuncAttributePreferredSharedMemoryCarveout, carve ? 100 : -1);
            cudaFuncSetAttribute(probe_pdl, cudaFuncAttributeMaxDynamicSharedMemorySize, smemb);
            for (int graph : {0, 1}) {
                cudaGraph_t g; cudaGraphExec_t ge;
                if (graph) CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
                spin_trigger_t<<<64, 32, 0, s>>>(8000, t);
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(blocks); cfg.blockDim = dim3(THREADS); cfg.dynamicSmemBytes = smemb; cfg.stream = s;
                cudaLaunchAttribute attr[1];
                attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                attr[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.attrs = attr; cfg.numAttrs = 1;
                CK(cudaLaunchKernelEx(&cfg, probe_pdl, t));
                if (graph) { CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ge, g, 0)); CK(cudaGraphLaunch(ge, s)); CK(cudaGraphLaunch(ge, s)); }
                CK(cudaStreamSynchronize(s));
                std::vector<unsigned long long> h(1 + 2 * blocks);
                CK(cudaMemcpy(h.data(), t, h.size() * 8, cudaMemcpyDeviceToHost));
                long long e0 = 1LL << 62, e1 = 0, w0 = 1LL << 62, w1 = 0;
                for (int b2 = 0; b2 < blocks; ++b2) {
                    long long e = h[1 + b2] - h[0], w = h[1 + blocks + b2] - h[0];
                    e0 = std::min(e0, e); e1 = std::max(e1, e); w0 = std::min(w0, w); w1 = std::max(w1, w);
                }
                printf("Q probe after an 8 us trigger-first stand-in (%s, %d KB smem%s): entries %.1f..%.1f us, waits end %.1f..%.1f us\n",
                       graph ? "graph" : "stream", smemb / 1024, carve ? ", carveout 100" : "", e0 / 1e3, e1 / 1e3, w0 / 1e3, w1 / 1e3);
            }
        }
    }
    run("cold", [&] {});
    run("after a 10 us wait", [&] { spin_kernel<<<1, 32, 0, s>>>(10000); });
    run("after reading o", [&] { read_all<<<sms * 8, 512, 0, s>>>((const uint4*)o, ob / 16, sink); });
    for (int wait : {0, 10000, 20000}) {
        char n[96];
        snprintf(n, 96, "lines prefetched, %d us wait", wait / 1000);
        run(n, [&] { l2_lines<<<sms * 2, 256, 0, s>>>(o, ob); spin_kernel<<<1, 32, 0, s>>>(wait); });
        for (unsigned piece : {4096u, 65536u}) {
            snprintf(n, 96, "bulk %u KB pieces, %d us wait", piece / 1024, wait / 1000);
            run(n, [&] { l2_bulk<<<sms * 2, 32, 0, s>>>(o, ob, piece); spin_kernel<<<1, 32, 0, s>>>(wait); });
        }
    }
    return 0;
}

// DF (`gemv_chain df`): every GEMV of every layer in one persistent kernel as a dataflow: rows
// of all 144 GEMVs are handed out in order by one ticket; a warp issues its row's first 16
// loads a lane and asks for its next ticket, then waits (lane 0 polling with acquire) for the
// previous GEMV's rows all to be done, then reads its input through L1 (each GEMV writes
// its own buffer, never rewritten, so no line can be stale) and sums; lane 0 writes the output,
// and the warp counts its rows of a GEMV done (with release, one fence) when it moves on. No
// kernel boundary or grid barrier: a warp that finishes its rows of one GEMV starts streaming
// the next one's weights at once, and the next GEMV's first rows start as soon as the last
// row of the one before is done.
struct DfGemv { const half* W; const half* x; half* y; int M, K; };
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
template <int SLEEP>
__global__ void __launch_bounds__(THREADS, 2) dataflow(const DfGemv* gs, int ng, unsigned* done, unsigned* ticket) {
    const int lane = threadIdx.x % 32;
    int g = 0, ready = 0;    // ready: the last GEMV whose input this warp has seen complete
    unsigned g_start = 0, pending = 0;  // pending: rows of GEMV g summed, not yet counted done
    DfGemv G = gs[0];
    unsigned t = 0;
    if (lane == 0) t = atomicAdd(ticket, 1u);
    t = __shfl_sync(0xffffffff, t, 0);
    while (true) {
        const int g_prev = g;
        while (g < ng && t >= g_start + (unsigned)G.M) {
            g_start += G.M;
            if (++g < ng) G = gs[g];
        }
        // Rows are counted done (with release: one fence) once a GEMV, when the warp moves on.
        if (g != g_prev && pending) {
            if (lane == 0)
                asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(done + g_prev), "r"(pending) : "memory");
            pending = 0;
        }
        if (g >= ng) break;
        const int r = (int)(t - g_start), CH = G.K / 256;
        const uint4* wr = reinterpret_cast<const uint4*>(G.W + (size_t)r * G.K);
        // The row's first 16 chunks a lane go out before the wait, the next ticket too.
        uint4 w[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) w[u] = ld_stream(wr + u * 32 + lane);
        unsigned next = 0;
        if (lane == 0) next = atomicAdd(ticket, 1u);
        if (g > ready) {  // polled once a GEMV
            if (lane == 0) {
                const unsigned need = gs[g - 1].M;
                while (ld_acquire(done + g - 1) < need)
                    if (SLEEP) __nanosleep(SLEEP);
            }
            ready = g;
        }
        __syncwarp();
        const uint4* xr = reinterpret_cast<const uint4*>(G.x);
        float acc = 0.f;
        for (int c0 = 0; c0 < CH; c0 += 16) {
            if (c0 > 0) {
#pragma unroll
                for (int u = 0; u < 16; ++u) w[u] = ld_stream(wr + (c0 + u) * 32 + lane);
            }
#pragma unroll
            for (int u = 0; u < 16; ++u) acc += dot8(w[u], xr[(c0 + u) * 32 + lane]);
        }
        acc = warp_sum(acc);
        if (lane == 0) G.y[r] = __float2half_rn(acc * 0.01f);
        ++pending;
        t = __shfl_sync(0xffffffff, next, 0);
    }
}
static int df_experiments(const std::vector<Layer>& hl, const half* x0, int sms, cudaStream_t s, size_t bytes) {
    // Each GEMV's own output buffer: q/k/v 6144, o 4096, gate/up 24576 (down reads its first
    // 12288), down 4096.
    std::vector<DfGemv> gs;
    const half* in = x0;
    for (int l = 0; l < LAYERS; ++l) {
        half *a, *b, *c, *d;
        CK(cudaMalloc(&a, QKV * 2)); CK(cudaMalloc(&b, H * 2)); CK(cudaMalloc(&c, 2 * I * 2)); CK(cudaMalloc(&d, H * 2));
        gs.push_back({hl[l].qkv, in, a, QKV, H});
        gs.push_back({hl[l].o, a, b, H, H});
        gs.push_back({hl[l].gu, b, c, 2 * I, H});
        gs.push_back({hl[l].down, c, d, H, I});
        in = d;
    }
    DfGemv* dgs;
    CK(cudaMalloc(&dgs, gs.size() * sizeof(DfGemv)));
    CK(cudaMemcpy(dgs, gs.data(), gs.size() * sizeof(DfGemv), cudaMemcpyHostToDevice));
    unsigned* cnt;  // [0]: the ticket, [1 ..]: each GEMV's rows done
    CK(cudaMalloc(&cnt, (1 + gs.size()) * sizeof(unsigned)));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    auto go = [&](auto kern, const char* name) {
        const int smem = 0;
        std::vector<float> ts;
        for (int i = 0; i < 10; ++i) {
            cudaMemsetAsync(cnt, 0, (1 + gs.size()) * sizeof(unsigned), s);
            cudaEventRecord(e0, s);
            kern<<<sms * 2, THREADS, smem, s>>>(dgs, (int)gs.size(), cnt + 1, cnt);
            cudaEventRecord(e1, s);
            cudaEventSynchronize(e1);
            float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
        }
        std::sort(ts.begin() + 1, ts.end());
        const float med = ts[5];
        printf("DF %-40s median %.3f ms  %.1f us/layer  %.2f TB/s  err=%s\n", name, med, med * 1000 / LAYERS,
               bytes / (med * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
    };
    for (int rep = 0; rep < 2; ++rep) {
        go(dataflow<0>, "dataflow, busy poll");
        go(dataflow<100>, "dataflow, 100 ns sleeps");
        go(dataflow<500>, "dataflow, 500 ns sleeps");
    }
    return 0;
}

int main(int argc, char** argv) {
    const size_t per_layer = (size_t)QKV * H + (size_t)H * H + (size_t)2 * I * H + (size_t)H * I;
    half* w;
    CK(cudaMalloc(&w, per_layer * LAYERS * 2));
    fill<<<4096, 256>>>(w, per_layer * LAYERS);
    std::vector<Layer> hl(LAYERS);
    for (int l = 0; l < LAYERS; ++l) {
        half* p = w + per_layer * l;
        hl[l].qkv = p; p += (size_t)QKV * H;
        hl[l].o = p; p += (size_t)H * H;
        hl[l].gu = p; p += (size_t)2 * I * H;
        hl[l].down = p;
    }
    Layer* dl;
    CK(cudaMalloc(&dl, sizeof(Layer) * LAYERS));
    CK(cudaMemcpy(dl, hl.data(), sizeof(Layer) * LAYERS, cudaMemcpyHostToDevice));
    half *x, *a, *b, *c;
    CK(cudaMalloc(&x, H * 2)); CK(cudaMalloc(&a, QKV * 2)); CK(cudaMalloc(&b, H * 2)); CK(cudaMalloc(&c, 2 * I * 2));
    fill<<<16, 256>>>(x, H); fill<<<16, 256>>>(a, QKV); fill<<<16, 256>>>(b, H); fill<<<64, 256>>>(c, 2 * I);
    unsigned* sink; CK(cudaMalloc(&sink, 4));
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaStream_t s; cudaStreamCreate(&s);
    if (argc > 1 && std::string(argv[1]) == "l2") return l2_experiments(w, per_layer, hl, a, b, sink, sms, s);
    if (argc > 1 && std::string(argv[1]) == "df") {
        // R (a plain read of the same bytes) and G without stand-ins for comparison are in the
        // full run; here the same read first.
        for (int rep = 0; rep < 2; ++rep) {
            cudaEvent_t r0, r1; cudaEventCreate(&r0); cudaEventCreate(&r1);
            std::vector<float> ts;
            for (int i = 0; i < 9; ++i) {
                cudaEventRecord(r0, s);
                read_all<<<sms * 8, 512, 0, s>>>((const uint4*)w, per_layer * LAYERS / 8, sink);
                cudaEventRecord(r1, s); cudaEventSynchronize(r1);
                float ms; cudaEventElapsedTime(&ms, r0, r1); ts.push_back(ms);
            }
            std::sort(ts.begin(), ts.end());
            printf("R  plain read                               median %.3f ms  %.1f us/layer\n", ts[4], ts[4] * 1000 / LAYERS);
        }
        return df_experiments(hl, x, sms, s, per_layer * LAYERS * 2.0);
    }
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    auto timeit = [&](auto&& f, const char* name, int reps) {
        f(); cudaStreamSynchronize(s);
        std::vector<float> ts;
        for (int i = 0; i < reps; ++i) {
            cudaEventRecord(e0, s); f(); cudaEventRecord(e1, s); cudaEventSynchronize(e1);
            float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        double bytes = per_layer * LAYERS * 2.0;
        printf("%-44s median %.3f ms (min %.3f)  %.1f us/layer  %.2f TB/s  err=%s\n", name, ts[reps / 2], ts[0],
               ts[reps / 2] * 1000 / LAYERS, bytes / (ts[reps / 2] * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
    };
    // R: plain read
    for (int g : {sms * 4, sms * 8, sms * 16})
        timeit([&] { read_all<<<g, 512, 0, s>>>((const uint4*)w, per_layer * LAYERS / 8, sink); }, g == sms * 8 ? "R read, 8 blocks/SM" : (g == sms * 4 ? "R read, 4 blocks/SM" : "R read, 16 blocks/SM"), 9);
    // A: separate kernels in a graph
    for (int bps : {4, 8}) {
        cudaGraph_t graph; cudaGraphExec_t ge;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        for (int l = 0; l < LAYERS; ++l) {
            gemv_kernel<H><<<sms * bps, THREADS, 0, s>>>(hl[l].qkv, x, a, QKV);
            gemv_kernel<H><<<sms * bps, THREADS, 0, s>>>(hl[l].o, a, b, H);
            gemv_kernel<H><<<sms * bps, THREADS, 0, s>>>(hl[l].gu, b, c, 2 * I);
            gemv_kernel<I><<<sms * bps, THREADS, 0, s>>>(hl[l].down, c, x, H);
        }
        cudaStreamEndCapture(s, &graph);
        CK(cudaGraphInstantiate(&ge, graph, 0));
        char name[64]; snprintf(name, 64, "A 4 kernels a layer, graph, %d blocks/SM", bps);
        timeit([&] { cudaGraphLaunch(ge, s); }, name, 9);
    }
    // B / C: persistent
    auto coop = [&](auto kern, int bps, const char* name) {
        int occ; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, THREADS, 0);
        int g = sms * (bps < occ ? bps : occ);
        void* args[] = {(void*)&dl, (void*)&x, (void*)&a, (void*)&b, (void*)&c};
        char n2[128]; snprintf(n2, 128, "%s, %d blocks/SM (occ %d)", name, g / sms, occ);
        timeit([&] { cudaLaunchCooperativeKernel((void*)kern, g, THREADS, args, 0, s); }, n2, 9);
    };
    coop(persistent<0>, 4, "B persistent, grid barrier");
    coop(persistent<4>, 4, "C persistent + 4 chunks prefetched");
    auto coop_sm = [&](auto kern, int pfc, int bps, const char* tag = "") {
        const int smem = WARPS * pfc * 32 * 16;
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        int occ; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, THREADS, smem);
        int g = sms * (bps < occ ? bps : occ);
        void* args[] = {(void*)&dl, (void*)&x, (void*)&a, (void*)&b, (void*)&c};
        char n2[128]; snprintf(n2, 128, "D%s persistent + %d chunks via cp.async, %d blocks/SM (occ %d)", tag, pfc, g / sms, occ);
        timeit([&] { cudaLaunchCooperativeKernel((void*)kern, g, THREADS, args, smem, s); }, n2, 9);
    };
    coop_sm(persistent_sm<8>, 8, 4);
    coop_sm(persistent_sm<12>, 12, 4);
    coop_sm(persistent_sm<16>, 16, 4);
    // With a 10 us stand-in for attention between q/k/v and o, against four kernels and a
    // spin kernel a layer.
    {
        cudaGraph_t graph; cudaGraphExec_t ge;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        for (int l = 0; l < LAYERS; ++l) {
            gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].qkv, x, a, QKV);
            spin_kernel<<<64, 32, 0, s>>>(10000);
            gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].o, a, b, H);
            gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].gu, b, c, 2 * I);
            gemv_kernel<I><<<sms * 4, THREADS, 0, s>>>(hl[l].down, c, x, H);
        }
        cudaStreamEndCapture(s, &graph);
        CK(cudaGraphInstantiate(&ge, graph, 0));
        timeit([&] { cudaGraphLaunch(ge, s); }, "A + 10 us attention stand-in, graph", 9);
    }
    coop_sm(persistent_sm<12, 10000>, 12, 4, " + 10 us attention stand-in,");
    coop_sm(persistent_sm<16, 10000>, 16, 4, " + 10 us attention stand-in,");
    // E: programmatic dependent launch, recorded.
    auto pdl_cfg = [&](int blocks, int threads, int smem, cudaLaunchAttribute* attr) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cfg;
    };
    auto pdl = [&](auto kern, int blocks, int smem, const half* W, const half* in, half* out, int M) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cudaLaunchKernelEx(&cfg, kern, W, in, out, M);
    };
    for (int bps : {1, 2}) {
        constexpr int PFC = 8;
        const int smem = WARPS * PFC * 32 * 16;
        cudaFuncSetAttribute(gemv_pdl<H, PFC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaFuncSetAttribute(gemv_pdl<I, PFC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        for (int att : {0, 1}) {
            cudaGraph_t graph; cudaGraphExec_t ge;
            cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
            for (int l = 0; l < LAYERS; ++l) {
                CK(pdl(gemv_pdl<H, PFC>, sms * bps, smem, hl[l].qkv, x, a, QKV));
                if (att) {
                    cudaLaunchAttribute at[1];
                    cudaLaunchConfig_t sc = pdl_cfg(64, 32, 0, at);
                    CK(cudaLaunchKernelEx(&sc, spin_pdl, (long long)10000));
                }
                CK(pdl(gemv_pdl<H, PFC>, sms * bps, smem, hl[l].o, a, b, H));
                CK(pdl(gemv_pdl<H, PFC>, sms * bps, smem, hl[l].gu, b, c, 2 * I));
                CK(pdl(gemv_pdl<I, PFC>, sms * bps, smem, hl[l].down, c, x, H));
            }
            CK(cudaStreamEndCapture(s, &graph));
            CK(cudaGraphInstantiate(&ge, graph, 0));
            char name[128];
            snprintf(name, 128, "E PDL + 8 chunks via cp.async, %d blocks/SM%s", bps, att ? " + 10 us stand-in" : "");
            timeit([&] { cudaGraphLaunch(ge, s); }, name, 9);
        }
    }
    // F: a decode layer's shape: q/k/v GEMV, a 2 us RoPE stand-in (8 blocks), an 8 us
    // attention stand-in (64 blocks), o, gate/up, down. A': all plain launches; F: the GEMVs
    // under programmatic dependent launch, trigger after the wait (late) or first (E's).
    for (int mode = 0; mode < 4; ++mode) {
        constexpr int PFC = 8;
        const int smem = WARPS * PFC * 32 * 16;
        const int bps = mode == 3 ? 2 : 1;
        auto kH = mode == 1 ? gemv_pdl<H, PFC> : gemv_pdl_late<H, PFC>;
        auto kI = mode == 1 ? gemv_pdl<I, PFC> : gemv_pdl_late<I, PFC>;
        cudaFuncSetAttribute(kH, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaFuncSetAttribute(kI, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaGraph_t graph; cudaGraphExec_t ge;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        for (int l = 0; l < LAYERS; ++l) {
            if (mode == 0) {
                gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].qkv, x, a, QKV);
                spin_kernel<<<8, 32, 0, s>>>(2000);
                spin_kernel<<<64, 32, 0, s>>>(8000);
                gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].o, a, b, H);
                gemv_kernel<H><<<sms * 4, THREADS, 0, s>>>(hl[l].gu, b, c, 2 * I);
                gemv_kernel<I><<<sms * 4, THREADS, 0, s>>>(hl[l].down, c, x, H);
            } else {
                CK(pdl(kH, sms * bps, smem, hl[l].qkv, x, a, QKV));
                spin_kernel<<<8, 32, 0, s>>>(2000);
                spin_trigger<<<64, 32, 0, s>>>(8000);
                CK(pdl(kH, sms * bps, smem, hl[l].o, a, b, H));
                CK(pdl(kH, sms * bps, smem, hl[l].gu, b, c, 2 * I));
                CK(pdl(kI, sms * bps, smem, hl[l].down, c, x, H));
            }
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&ge, graph, 0));
        const char* names[] = {"A' plain, 2+8 us stand-ins", "F trigger first, 1 block/SM, stand-ins",
                               "F trigger late, 1 block/SM, stand-ins", "F trigger late, 2 blocks/SM, stand-ins"};
        timeit([&] { cudaGraphLaunch(ge, s); }, names[mode], 9);
    }
    // G: F late with rows handed out by a counter, at 1 and 2 blocks an SM.
    unsigned* counters;
    CK(cudaMalloc(&counters, LAYERS * 4 * sizeof(unsigned)));
    auto pdl_dyn = [&](auto kern, int blocks, int smem, const half* W, const half* in, half* out, int M,
                       unsigned* ctr) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        return cudaLaunchKernelEx(&cfg, kern, W, in, out, M, ctr);
    };
    for (int mode = 0; mode < 4; ++mode) {
        constexpr int PFC = 8;
        const int smem = WARPS * PFC * 32 * 16;
        const int bps = mode % 2 ? 2 : 1;
        const bool stand = mode >= 2;
        cudaFuncSetAttribute(gemv_pdl_dyn<H, PFC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaFuncSetAttribute(gemv_pdl_dyn<I, PFC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        cudaGraph_t graph; cudaGraphExec_t ge;
        cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
        CK(cudaMemsetAsync(counters, 0, LAYERS * 4 * sizeof(unsigned), s));
        for (int l = 0; l < LAYERS; ++l) {
            unsigned* ctr = counters + 4 * l;
            CK(pdl_dyn(gemv_pdl_dyn<H, PFC>, sms * bps, smem, hl[l].qkv, x, a, QKV, ctr));
            if (stand) {
                spin_kernel<<<8, 32, 0, s>>>(2000);
                spin_trigger<<<64, 32, 0, s>>>(8000);
            }
            CK(pdl_dyn(gemv_pdl_dyn<H, PFC>, sms * bps, smem, hl[l].o, a, b, H, ctr + 1));
            CK(pdl_dyn(gemv_pdl_dyn<H, PFC>, sms * bps, smem, hl[l].gu, b, c, 2 * I, ctr + 2));
            CK(pdl_dyn(gemv_pdl_dyn<I, PFC>, sms * bps, smem, hl[l].down, c, x, H, ctr + 3));
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&ge, graph, 0));
        char name[128];
        snprintf(name, 128, "G dynamic rows, %d blocks/SM%s", bps, stand ? ", stand-ins" : "");
        timeit([&] { cudaGraphLaunch(ge, s); }, name, 9);
    }
    // P: G at two blocks an SM with the stand-ins, the o projection's weights (and some of
    // gate/up's) asked of L2 while the stand-ins run, when DRAM is otherwise idle. `where`:
    // -1 nowhere; 0 the RoPE stand-in's bulk prefetch (o_frac of o, gu_bytes of gate/up, in
    // `piece`s); 1 the attention stand-in's; 2 / 3 the o GEMV's own rows before its wait, by
    // lines / in bulk; 4 as 2, plus a quarter of o by the attention stand-in; 5 / 6 the o GEMV
    // staging 16 / 12 chunks a lane (whole first rows / three quarters). Then again with every
    // kernel's shared-memory carveout at 100% (no reconfiguring SMs between kernels).
    struct PMode { const char* name; int where; double o_frac; size_t gu_bytes; unsigned piece; };
    const PMode pmodes[] = {
        {"P none (G again)", -1, 0, 0, 65536},
        {"P RoPE stand-in prefetches o, 64 KB pieces", 0, 1.0, 0, 65536},
        {"P RoPE stand-in prefetches o, 16 KB pieces", 0, 1.0, 0, 16384},
        {"P attention stand-in prefetches o", 1, 1.0, 0, 65536},
        {"P RoPE stand-in prefetches half of o", 0, 0.5, 0, 65536},
        {"P RoPE stand-in prefetches o + 8 MB gate/up", 0, 1.0, 8u << 20, 65536},
        {"P RoPE stand-in prefetches o + 16 MB gate/up", 0, 1.0, 16u << 20, 65536},
        {"P o GEMV prefetches its rows by lines", 2, 0, 0, 0},
        {"P o GEMV prefetches its rows in bulk", 3, 0, 0, 0},
        {"P o GEMV by lines + attention stand-in bulk", 4, 0, 0, 65536},
        {"P o GEMV stages whole first rows (16 chunks)", 5, 0, 0, 0},
        {"P o GEMV stages 12 chunks", 6, 0, 0, 0},
    };
    for (int carve : {0, 1})
    for (const PMode& pm : pmodes) {
        if (carve && pm.where != -1 && pm.where != 1 && pm.where != 5) continue;
        for (const void* f : {(const void*)spin_kernel, (const void*)spin_trigger, (const void*)spin_prefetch,
                              (const void*)gemv_pdl_dyn<H, 8, 0>, (const void*)gemv_pdl_dyn<I, 8, 0>,
                              (const void*)gemv_pdl_dyn<H, 16, 0>})
            cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, carve ? 100 : -1);
        constexpr int PFC = 8;
        const int smem = WARPS * PFC * 32 * 16;
        cudaGraph_t graph; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        CK(cudaMemsetAsync(counters, 0, LAYERS * 4 * sizeof(unsigned), s));
        for (int l = 0; l < LAYERS; ++l) {
            unsigned* ctr = counters + 4 * l;
            CK(pdl_dyn(gemv_pdl_dyn<H, PFC>, sms * 2, smem, hl[l].qkv, x, a, QKV, ctr));
            const size_t ob = (size_t)(pm.o_frac * H * H * 2) / 16 * 16;
            // o and gate/up are adjacent in the harness's layout, so one range covers both.
            const size_t bytes = pm.gu_bytes ? (size_t)H * H * 2 + pm.gu_bytes : ob;
            if (pm.where == 0) spin_prefetch<<<8, 32, 0, s>>>(2000, (const char*)hl[l].o, bytes, pm.piece, 0);
            else spin_kernel<<<8, 32, 0, s>>>(2000);
            if (pm.where == 4) spin_prefetch<<<64, 32, 0, s>>>(8000, (const char*)hl[l].o, (size_t)H * H / 2, pm.piece, 1);
            else if (pm.where == 1) spin_prefetch<<<64, 32, 0, s>>>(8000, (const char*)hl[l].o, bytes, pm.piece, 1);
            else spin_trigger<<<64, 32, 0, s>>>(8000);
            auto ko = pm.where == 2 || pm.where == 4 ? gemv_pdl_dyn<H, PFC, 1>
                      : pm.where == 3                ? gemv_pdl_dyn<H, PFC, 2>
                                                     : gemv_pdl_dyn<H, PFC, 0>;
            int osmem = smem;
            if (pm.where == 5) { ko = gemv_pdl_dyn<H, 16, 0>; osmem = WARPS * 16 * 32 * 16; }
            if (pm.where == 6) { ko = gemv_pdl_dyn<H, 12, 0>; osmem = WARPS * 12 * 32 * 16; }
            cudaFuncSetAttribute(ko, cudaFuncAttributeMaxDynamicSharedMemorySize, osmem);
            CK(pdl_dyn(ko, sms * 2, osmem, hl[l].o, a, b, H, ctr + 1));
            CK(pdl_dyn(gemv_pdl_dyn<H, PFC>, sms * 2, smem, hl[l].gu, b, c, 2 * I, ctr + 2));
            CK(pdl_dyn(gemv_pdl_dyn<I, PFC>, sms * 2, smem, hl[l].down, c, x, H, ctr + 3));
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&ge, graph, 0));
        char pn[128];
        snprintf(pn, 128, "%s%s", pm.name, carve ? ", carveout 100" : "");
        timeit([&] { cudaGraphLaunch(ge, s); }, pn, 9);
    }
    return 0;
}
