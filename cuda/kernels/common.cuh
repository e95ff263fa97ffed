// Shared by every kernel file. Each .cu is its own NVRTC program, so cuda/src/cuda/kernels.rs
// puts this text in front of each one (compile errors' line numbers count it).

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)  // -inf without math headers

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Programmatic dependent launch (sm_90 and later; nothing before). A kernel launched with the
// programmatic attribute may start while the kernel before it still runs: grid_wait() returns
// once that kernel has finished and its writes are visible, so everything before it may read
// only what no kernel of the stream writes (weights). grid_launch_dependents() lets the kernel
// after this one start early the same way; without it, that one starts when this one ends.
__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Both, in that order, for a kernel with nothing to load before its input (the norms, casts
// and activation rounding between a step's GEMMs and GEMVs): the kernel after it (one that
// loads its weights before its own grid_wait) may start at once, and this one waits for x.
__device__ __forceinline__ void grid_start_next_then_wait() {
    grid_launch_dependents();
    grid_wait();
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers (sm_80+), in the current group.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// mma.sync's fragment layouts (PTX ISA, m16n8k16), lane = 4 gid + tig: A row gid and gid + 8,
// columns 2 tig, 2 tig + 1 and those + 8; B column gid, rows 2 tig, 2 tig + 1 and those + 8;
// C row gid and gid + 8, columns 2 tig, 2 tig + 1.
// d (16x8, f32) += a (16x16, f16, row-major) * b (16x8, f16, column-major).
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element i of a random-weight matrix with `key`: cuda/src/random.rs's SplitMix64 hash, so the
// values equal the CPU's bit for bit.
__device__ __forceinline__ unsigned long long random_bits(unsigned long long key,
                                                          unsigned long long i) {
    unsigned long long z = key ^ (i * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float random_uniform(unsigned long long key, unsigned long long i,
                                                float bound) {
    const unsigned long long z = random_bits(key, i);
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    return __fmul_rn(__fsub_rn(__fmul_rn(2.0f, u), 1.0f), bound);  // no FMA: match the CPU
}

// Two e4m3fn bytes, in the high byte of each half of t, as f16 values times 2^-8, exactly: the
// byte moved into an f16's bits (sign to the top, the other seven bits one place below the f16
// exponent's top bit); e4m3's exponent bias is 7 and f16's 15, and f16 holds every e4m3 value,
// subnormals included. FP8 weights (weights_f16.cu) and the FP8 KV cache (paged_f16.cu,
// attention_f16.cu) read their bytes through it.
#include <cuda_fp16.h>
__device__ __forceinline__ __half2 f8_pair(unsigned t) {
    const unsigned h = (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
    return *reinterpret_cast<const __half2*>(&h);
}

// f32 pairs as the f16 pair nearest them (hi) and the f16 pair nearest what that leaves (lo;
// together they carry 22 of the 24 bits): how an f32 operand enters an f16 mma.sync and stays
// near f32, the integer GEMVs' x (weights_f16.cu) and decode attention's q and softmax weights
// (paged_f16.cu).
__device__ __forceinline__ void split_halves(float a, float b, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 back = __half22float2(h);
    const __half2 l = __floats2half2_rn(a - back.x, b - back.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
}
