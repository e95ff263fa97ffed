// Each row's next token, on the device: cuda/src/sampling.rs states the rule and is the CPU
// twin. Every value that decides the pick (processed logits, weights, keys, masses, the draw)
// comes from the same correctly rounded operations as there (the __f*_rn intrinsics, which the
// compiler never fuses), or from integers, so the twin tests demand the same token.
//
// One block of S_THREADS a row. The row is read in passes; each warp owns a contiguous segment
// of it, so passes that need id order (the compaction, the draw) keep it, and each pass has 4
// loads a thread in flight. No pass sorts: thresholds come from radix selection over 8-bit
// digits of the keys (top-k by count, top-p by mass), and once few candidates remain they are
// compacted into shared memory and the remaining passes read only them.

// 512: at 1024 a thread has 64 registers, and ptxas spilled this kernel's state to local
// memory (the CI's ptxas check).
#define S_THREADS 512
#define S_WARPS (S_THREADS / WARP)
#define S_CUTOFF (-21.0f)
// S_LIST (candidates kept in shared memory once the filters leave at most this many) and
// S_BINS come from cuda/src/sampling.rs (SAMPLE_LIST, SAMPLE_BINS), which sizes the work buffer.
#define S_LIST SAMPLE_LIST
#define S_IN_PROMPT 0x80000000u
#define S_NO_SLOT 0xffffffffu
// The pick of a row with no finite largest logit (sampling.rs's NOT_FINITE).
#define S_NOT_FINITE 0xffffffffu

// Must stay the same operations as det_exp in sampling.rs.
__device__ __forceinline__ float s_exp(float d) {
    float t = __fmul_rn(d, 1.44269504088896340736f);
    float k = floorf(__fadd_rn(t, 0.5f));
    float f = __fsub_rn(t, k);
    float p = 1.5252734e-5f;
    p = fmaf(p, f, 1.5403531e-4f);
    p = fmaf(p, f, 1.3333558e-3f);
    p = fmaf(p, f, 9.618129e-3f);
    p = fmaf(p, f, 5.550411e-2f);
    p = fmaf(p, f, 2.402265e-1f);
    p = fmaf(p, f, 6.931472e-1f);
    p = fmaf(p, f, 1.0f);
    return __fmul_rn(p, __int_as_float(((int)k + 127) << 23));
}

__device__ __forceinline__ unsigned s_weight(float d) {
    return (unsigned)__fmul_rn(s_exp(d), 2147483648.0f);
}

__device__ __forceinline__ unsigned s_key(float y) {
    unsigned b = __float_as_uint(__fadd_rn(y, 0.0f));
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint4 s_philox(uint4 c, unsigned k0, unsigned k1) {
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// One row's parameters (RowParams::to_words' layout).
struct SParams {
    float temperature, top_p, min_p, presence, frequency, repetition;
    unsigned top_k, seed_lo, seed_hi, position, stream, slot, logprobs, bias_start, bias_len;
    bool masked;
};

__device__ __forceinline__ SParams s_params(const unsigned* w) {
    SParams p;
    p.temperature = __uint_as_float(w[0]);
    p.top_k = w[1];
    p.top_p = __uint_as_float(w[2]);
    p.min_p = __uint_as_float(w[3]);
    p.presence = __uint_as_float(w[4]);
    p.frequency = __uint_as_float(w[5]);
    p.repetition = __uint_as_float(w[6]);
    p.seed_lo = w[7];
    p.seed_hi = w[8];
    p.position = w[9];
    p.stream = w[10];
    p.slot = w[11];
    p.logprobs = w[12];
    p.bias_start = w[13];
    p.bias_len = w[14];
    p.masked = w[15] != 0;
    return p;
}

// process() in sampling.rs, then the temperature.
__device__ __forceinline__ float s_process(float l, float bias, unsigned count, const SParams& p) {
    float x = __fadd_rn(l, bias);
    if (p.slot != S_NO_SLOT) {
        unsigned n = count & ~S_IN_PROMPT;
        if ((n > 0 || (count & S_IN_PROMPT)) && p.repetition != 1.0f)
            x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
        x = __fsub_rn(x, __fmul_rn(p.frequency, (float)n));
        if (n > 0) x = __fsub_rn(x, p.presence);
    }
    return p.temperature > 0.0f ? __fdiv_rn(x, p.temperature) : x;
}

struct SShared {
    unsigned cnt[256];
    unsigned long long mass[256];
    unsigned long long part[S_WARPS];
    float fpart[S_WARPS];
    unsigned ipart[S_WARPS];
    unsigned list_id[S_LIST], list_key[S_LIST], list_w[S_LIST];
    unsigned u[4];
    unsigned long long u64[2];
    float f[2];
};

// Where a pass's elements come from: the row in global memory (tempered logits, whose
// candidates are within S_CUTOFF of `max`; or the raw logits, every non-NaN one), or the
// candidates compacted into shared memory.
struct SElems {
    const float* y;
    int n;
    bool list, raw;
    float max;
};

// Which elements a pass counts: key at least `tau`, weight at least `wmin`.
struct SFilter {
    unsigned tau;
    double wmin;
    __device__ __forceinline__ bool operator()(unsigned key, unsigned w) const {
        return key >= tau && (double)w >= wmin;
    }
};

// One element of a pass: its id, key and weight, or off (past the end, not a candidate).
template <bool NEED_W, class F>
__device__ __forceinline__ void s_one(const SElems& e, const SShared& s, int j, bool on, float v, F& f) {
    unsigned id = j, key = 0, w = 0;
    if (e.list) {
        if (on) {
            id = s.list_id[j];
            key = s.list_key[j];
            w = s.list_w[j];
        }
    } else if (e.raw) {
        on = on && !isnan(v);
        key = s_key(v);
    } else {
        float d = __fsub_rn(v, e.max);
        on = on && d > S_CUTOFF;
        key = s_key(v);
        if (NEED_W && on) w = s_weight(d);
    }
    f(on, id, key, w);
}

// Calls f(on, id, key, w) for every element, warp by warp over each warp's segment in id
// order, all 32 lanes together (f may use warp intrinsics). Four loads a thread in flight,
// held in named registers: an array indexed in the loop that calls f went to local memory.
template <bool NEED_W, class F>
__device__ __forceinline__ void s_each(const SElems& e, const SShared& s, F f) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int step = WARP * 4;
    const int seg = (e.n + S_WARPS * step - 1) / (S_WARPS * step) * step;
    const int lo = min(e.n, warp * seg), hi = min(e.n, lo + seg);
    for (int j0 = lo; j0 < hi; j0 += step) {
        const int j = j0 + lane;
        float v0 = NEG_INF, v1 = NEG_INF, v2 = NEG_INF, v3 = NEG_INF;
        if (!e.list) {
            if (j < hi) v0 = e.y[j];
            if (j + WARP < hi) v1 = e.y[j + WARP];
            if (j + 2 * WARP < hi) v2 = e.y[j + 2 * WARP];
            if (j + 3 * WARP < hi) v3 = e.y[j + 3 * WARP];
        }
        s_one<NEED_W>(e, s, j, j < hi, v0, f);
        s_one<NEED_W>(e, s, j + WARP, j + WARP < hi, v1, f);
        s_one<NEED_W>(e, s, j + 2 * WARP, j + 2 * WARP < hi, v2, f);
        s_one<NEED_W>(e, s, j + 3 * WARP, j + 3 * WARP < hi, v3, f);
    }
}

// Adds each lane's element to bin `bin`: one atomic per distinct bin per warp (logits cluster
// in few bins, which one atomic per element would serialize).
__device__ __forceinline__ void s_hist_add(SShared& s, bool on, unsigned bin, unsigned w, bool with_mass) {
    unsigned act = __ballot_sync(0xffffffffu, on);
    if (!on) return;
    unsigned peers = __match_any_sync(act, bin);
    bool leader = (threadIdx.x % WARP) == (unsigned)(__ffs(peers) - 1);
    if (with_mass) {
        // Two 16-bit halves: 32 weights of up to 2^31 would overflow one u32 sum.
        unsigned lo = __reduce_add_sync(peers, w & 0xffffu);
        unsigned hi = __reduce_add_sync(peers, w >> 16);
        if (leader) atomicAdd(&s.mass[bin], ((unsigned long long)hi << 16) + lo);
    }
    if (leader) atomicAdd(&s.cnt[bin], (unsigned)__popc(peers));
}

// Histogram over the next 8-bit digit (at `shift`) of the keys that match `prefix` on `mask`.
template <bool MASS>
__device__ void s_histogram(const SElems& e, SFilter flt, unsigned prefix, unsigned mask, int shift, SShared& s) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        s.cnt[b] = 0;
        s.mass[b] = 0;
    }
    __syncthreads();
    s_each<MASS>(e, s, [&](bool on, unsigned, unsigned key, unsigned w) {
        on = on && flt(key, w) && (key & mask) == prefix;
        s_hist_add(s, on, (key >> shift) & 255u, w, MASS);
    });
    __syncthreads();
}

// The key of the `need`-th largest element that passes `flt`, or 0 (keep all) if no more
// than `need` pass.
__device__ unsigned s_select_by_count(const SElems& e, SFilter flt, unsigned need, SShared& s) {
    unsigned prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        s_histogram<false>(e, flt, prefix, mask, shift, s);
        if (threadIdx.x == 0) {
            unsigned total = 0;
            for (int b = 0; b < 256; ++b) total += s.cnt[b];
            unsigned left = need, found = 0, digit = 0;
            if (shift < 24 || total > need) {
                for (int b = 255; b >= 0; --b) {
                    if (s.cnt[b] < left) {
                        left -= s.cnt[b];
                    } else {
                        digit = b;
                        found = 1;
                        break;
                    }
                }
            }
            s.u[0] = found;
            s.u[1] = digit;
            s.u[2] = left;
        }
        __syncthreads();
        unsigned found = s.u[0], digit = s.u[1];
        need = s.u[2];
        __syncthreads();
        if (!found) return 0;
        prefix |= digit << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

// Top-p: the lowest key whose strictly better elements (of those passing `flt`) weigh less
// than top_p of their total, or 0 (keep all). `known_total`, if not 0, is that total (when the
// elements are a shared-memory list holding only the best of them: every element better than
// one in the list is in it, so the masses above are right, but the total is not theirs).
__device__ unsigned s_select_by_mass(const SElems& e, SFilter flt, float top_p,
                                     unsigned long long known_total, SShared& s) {
    unsigned prefix = 0, mask = 0;
    unsigned long long above = 0, bound = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        s_histogram<true>(e, flt, prefix, mask, shift, s);
        if (threadIdx.x == 0) {
            if (shift == 24) {
                unsigned long long total = known_total;
                if (total == 0)
                    for (int b = 0; b < 256; ++b) total += s.mass[b];
                bound = (unsigned long long)((double)top_p * (double)total);
                if (bound == 0) bound = 1;
            }
            unsigned found = 0, digit = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + s.mass[b] < bound) {
                    above += s.mass[b];
                } else {
                    digit = b;
                    found = 1;
                    break;
                }
            }
            s.u[0] = found;
            s.u[1] = digit;
        }
        __syncthreads();
        unsigned found = s.u[0], digit = s.u[1];
        __syncthreads();
        if (!found) return 0;
        prefix |= digit << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

// Writes the elements that pass `keep` (a functor of key and weight), in id order, to the list
// from index `at`, at most `limit` of them; returns how many pass (all of them, written or
// not). Every thread gets the count.
template <class K>
__device__ unsigned s_compact(const SElems& e, K keep, unsigned at, unsigned limit, SShared& s) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    unsigned mine = 0;
    s_each<true>(e, s, [&](bool on, unsigned, unsigned key, unsigned w) {
        mine += __popc(__ballot_sync(0xffffffffu, on && keep(key, w)));
    });
    if (lane == 0) s.ipart[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned run = 0;
        for (int g = 0; g < S_WARPS; ++g) {
            unsigned c = s.ipart[g];
            s.ipart[g] = run;
            run += c;
        }
        s.u[3] = run;
    }
    __syncthreads();
    unsigned total = s.u[3];
    unsigned rank = s.ipart[warp];
    s_each<true>(e, s, [&](bool on, unsigned id, unsigned key, unsigned w) {
        bool k = on && keep(key, w);
        unsigned ballot = __ballot_sync(0xffffffffu, k);
        unsigned r = rank + __popc(ballot & ((1u << lane) - 1));
        if (k && r < limit) {
            s.list_id[at + r] = id;
            s.list_key[at + r] = key;
            s.list_w[at + r] = w;
        }
        rank += __popc(ballot);
    });
    __syncthreads();
    return total;
}

__device__ __forceinline__ unsigned long long s_warp_sum64(unsigned long long v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The draw: the first element (id order) whose running weight passes bits x total / 2^64.
// Returns 0xffffffff if nothing passes `flt`.
__device__ unsigned s_draw(const SElems& e, SFilter flt, unsigned long long bits, SShared& s) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    unsigned long long mine = 0;
    s_each<true>(e, s, [&](bool on, unsigned, unsigned key, unsigned w) {
        if (on && flt(key, w)) mine += w;
    });
    mine = s_warp_sum64(mine);
    if (lane == 0) s.part[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        for (int g = 0; g < S_WARPS; ++g) total += s.part[g];
        unsigned long long target = __umul64hi(bits, total), before = 0;
        unsigned owner = S_WARPS;
        for (int g = 0; g < S_WARPS && total > 0; ++g) {
            if (before + s.part[g] > target) {
                owner = g;
                break;
            }
            before += s.part[g];
        }
        s.u[0] = owner;
        s.u64[0] = target;
        s.u64[1] = before;
        s.u[1] = 0xffffffffu;
    }
    __syncthreads();
    if (warp == (int)s.u[0]) {
        unsigned long long target = s.u64[0], before = s.u64[1];
        bool done = false;
        s_each<true>(e, s, [&](bool on, unsigned id, unsigned key, unsigned w) {
            if (done) return;  // warp-uniform
            unsigned long long x = (on && flt(key, w)) ? w : 0, run = x;
            for (int o = 1; o < WARP; o <<= 1) {
                unsigned long long t = __shfl_up_sync(0xffffffffu, run, o);
                if (lane >= o) run += t;
            }
            unsigned hit = __ballot_sync(0xffffffffu, x > 0 && before + run > target);
            if (hit) {
                if (lane == __ffs(hit) - 1) s.u[1] = id;
                done = true;
            }
            before += __shfl_sync(0xffffffffu, run, WARP - 1);
        });
    }
    __syncthreads();
    return s.u[1];
}

__device__ __forceinline__ void s_merge_max(float& v, unsigned& i, float ov, unsigned oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// The largest value of y[0..n) and its first index (NaN never wins; all NaN gives index 0).
__device__ void s_argmax(const float* y, int n, SShared& s, float& best, unsigned& at) {
    float v = NEG_INF;
    unsigned i = 0xffffffffu;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s_merge_max(v, i, y[j], j);
    for (int o = WARP / 2; o > 0; o >>= 1)
        s_merge_max(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) {
        s.fpart[warp] = v;
        s.ipart[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int g = 1; g < S_WARPS; ++g) s_merge_max(v, i, s.fpart[g], s.ipart[g]);
        s.f[0] = v;
        s.u[0] = i == 0xffffffffu ? 0 : i;
    }
    __syncthreads();
    best = s.f[0];
    at = s.u[0];
    __syncthreads();
}

// Raw logprobs: the log-sum-exp (returned) and the best n tokens, written to the row's
// outputs (ids best first, ties by lower id).
__device__ float s_top_logprobs(const float* l, int n_vocab, unsigned n, SShared& s,
                                float* lp_out, unsigned* id_out) {
    float best;
    unsigned at;
    s_argmax(l, n_vocab, s, best, at);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n_vocab; j += blockDim.x) {
        float x = l[j];
        if (!isnan(x)) sum += expf(x - best);
    }
    sum = warp_sum(sum);
    if (threadIdx.x % WARP == 0) s.fpart[threadIdx.x / WARP] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int g = 0; g < S_WARPS; ++g) t += s.fpart[g];
        s.f[1] = best + logf(t);
    }
    __syncthreads();
    float lse = s.f[1];
    if (n == 0) return lse;
    SElems raw = {l, n_vocab, false, true, 0.0f};
    SFilter all = {0u, 0.0};
    unsigned tau = s_select_by_count(raw, all, n, s);
    // Those above the n-th (fewer than n), then its ties by id, up to n in all.
    unsigned above = s_compact(raw, [&](unsigned key, unsigned) { return key > tau; }, 0, S_LIST, s);
    above = min(above, n);
    s_compact(raw, [&](unsigned key, unsigned) { return key == tau; }, above, n - above, s);
    if (threadIdx.x == 0) {
        unsigned m = min(n, (unsigned)n_vocab);
        // Best first: higher key, then lower id (insertion sort of at most 20).
        for (unsigned a = 1; a < m; ++a) {
            unsigned id = s.list_id[a], key = s.list_key[a];
            int b = a - 1;
            while (b >= 0 && (s.list_key[b] < key || (s.list_key[b] == key && s.list_id[b] > id))) {
                s.list_id[b + 1] = s.list_id[b];
                s.list_key[b + 1] = s.list_key[b];
                --b;
            }
            s.list_id[b + 1] = id;
            s.list_key[b + 1] = key;
        }
        for (unsigned a = 0; a < m; ++a) {
            id_out[a] = s.list_id[a];
            lp_out[a] = l[s.list_id[a]] - lse;
        }
    }
    __syncthreads();
    return lse;
}

// ---- The step's draws in four kernels ----
//
// A row's passes over the vocabulary would keep one SM busy for a quarter of a millisecond at
// batch 1, so the heavy passes are spread over `split` blocks a row (more when the batch is
// small), each over a slice of the row:
// 1. sample_prepare_f32: the processed, tempered logits into `scratch`, each slice's largest.
// 2. sample_histogram_f32: the candidates counted (and weighed, for top-p alone) in 2048 bins
//    by their distance from the row's largest (a bin order that follows the keys' order).
// 3. sample_compact_f32: the bin where top-k's (or top-p's) boundary lies, and each slice's
//    elements from that bin up, in id order, into the work buffer.
// 4. sample_rows_f32: one block a row; the exact rule over those few elements in shared memory
//    (or, where they are too many, over the whole row), the draw, the counts, the logprobs.
// The bins only choose which elements the exact rule looks at: every element that can be kept
// is in the bins from the boundary up, so the pick is the one the rule gives.

#define S_BINS SAMPLE_BINS
#define S_PREP_THREADS 512
#define S_OVERFLOW 0xffffffffu

// Where each kernel's shared results are in the work buffer (RowParams' work_words).
struct SWork {
    unsigned* part;                 // [rows x split] x (largest's bits, its id)
    unsigned* hist_cnt;             // [rows x S_BINS]
    unsigned long long* hist_mass;  // [rows x S_BINS]
    unsigned* reg_cnt;              // [rows x split]: elements each slice compacted (or S_OVERFLOW)
    unsigned* reg;                  // [rows x split x S_LIST]: their ids
    unsigned long long* slice_mass; // [rows x split]: each slice's weight (no top-k or top-p)
};

__device__ __forceinline__ SWork s_work(unsigned* work, int rows, int split) {
    SWork w;
    size_t o = 0;
    w.part = work;
    o += (size_t)rows * split * 2;
    w.hist_cnt = work + o;
    o += (size_t)rows * S_BINS;
    w.hist_mass = reinterpret_cast<unsigned long long*>(work + o);
    o += (size_t)rows * S_BINS * 2;
    w.reg_cnt = work + o;
    o += (size_t)rows * split;
    w.reg = work + o;
    o += (size_t)rows * split * S_LIST;
    o += o & 1;  // 8-byte aligned
    w.slice_mass = reinterpret_cast<unsigned long long*>(work + o);
    return w;
}

// The bin of a candidate `d` below the largest (d in (S_CUTOFF, 0]); larger d, higher bin.
__device__ __forceinline__ int s_bin(float d) {
    int b = (int)__fmul_rn(__fsub_rn(d, S_CUTOFF), (float)S_BINS / -S_CUTOFF);
    return min(max(b, 0), S_BINS - 1);
}

// The row's largest and its first id, from the slices' (the same on every block).
__device__ __forceinline__ void s_row_best(const SWork& w, int row, int split, float& best, unsigned& at) {
    best = NEG_INF;
    at = 0xffffffffu;
    for (int k = 0; k < split; ++k) {
        const unsigned* q = w.part + ((size_t)row * split + k) * 2;
        s_merge_max(best, at, __uint_as_float(q[0]), q[1]);
    }
    if (at == 0xffffffffu) at = 0;
}

__device__ __forceinline__ void s_slice(int vocab, int split, int k, int& lo, int& hi) {
    int chunk = (vocab + split - 1) / split;
    lo = min(vocab, k * chunk);
    hi = min(vocab, lo + chunk);
}

__device__ __forceinline__ bool s_draws(const SParams& p, float best) {
    return p.temperature > 0.0f && isfinite(best);
}

// Block-wide argmax of (v, i) pairs, lowest id on ties; thread 0 gets the result.
__device__ __forceinline__ void s_block_best(float& v, unsigned& i) {
    __shared__ float sv[WARP];
    __shared__ unsigned si[WARP];
    for (int o = WARP / 2; o > 0; o >>= 1)
        s_merge_max(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int g = 1; g < warps; ++g) s_merge_max(v, i, sv[g], si[g]);
}

extern "C" __global__ void __launch_bounds__(S_PREP_THREADS)
    sample_prepare_f32(const float* __restrict__ logits, int vocab, const unsigned* __restrict__ params,
                       const unsigned* __restrict__ bias, const unsigned* __restrict__ masks,
                       const unsigned* __restrict__ counts, float* __restrict__ scratch,
                       unsigned* __restrict__ work, int rows, int split) {
    const int row = blockIdx.x / split, k = blockIdx.x % split;
    const SParams p = s_params(params + (size_t)row * SAMPLE_WORDS);
    const SWork w = s_work(work, rows, split);
    const float* l = logits + (size_t)row * vocab;
    const unsigned* cnt = p.slot == S_NO_SLOT ? nullptr : counts + (size_t)p.slot * vocab;
    // A masked row's disallowed tokens are -inf (mask_allows in sampling.rs).
    const unsigned* m = p.masked ? masks + (size_t)row * ((vocab + 31) / 32) : nullptr;
    const bool plain = p.temperature == 0.0f && !cnt && p.bias_len == 0 && !m;
    float* y = scratch + (size_t)row * vocab;
    int lo, hi;
    s_slice(vocab, split, k, lo, hi);
    if (k == 0)
        for (int b = threadIdx.x; b < S_BINS; b += blockDim.x) {
            w.hist_cnt[(size_t)row * S_BINS + b] = 0;
            w.hist_mass[(size_t)row * S_BINS + b] = 0;
        }
    if (!plain) {
        for (int j = lo + threadIdx.x; j < hi; j += blockDim.x)
            y[j] = m && !((m[j >> 5] >> (j & 31)) & 1u) ? NEG_INF : s_process(l[j], 0.0f, cnt ? cnt[j] : 0u, p);
        __syncthreads();
        for (unsigned e = threadIdx.x; e < p.bias_len; e += blockDim.x) {
            unsigned t = bias[2 * (p.bias_start + e)];
            if ((int)t < lo || (int)t >= hi) continue;
            if (m && !((m[t >> 5] >> (t & 31)) & 1u)) continue;
            float b = __uint_as_float(bias[2 * (p.bias_start + e) + 1]);
            y[t] = s_process(l[t], b, cnt ? cnt[t] : 0u, p);
        }
        __syncthreads();
    }
    const float* src = plain ? l : y;
    float v = NEG_INF;
    unsigned i = 0xffffffffu;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) s_merge_max(v, i, src[j], j);
    s_block_best(v, i);
    if (threadIdx.x == 0) {
        unsigned* q = w.part + ((size_t)row * split + k) * 2;
        q[0] = __float_as_uint(v);
        q[1] = i;
    }
}

// Whether a row's draw can look at a short list: top-k, or top-p alone, bound it.
__device__ __forceinline__ bool s_listable(const SParams& p) {
    return p.top_k > 0 || p.top_p < 1.0f;
}

extern "C" __global__ void __launch_bounds__(S_PREP_THREADS)
    sample_histogram_f32(int vocab, const unsigned* __restrict__ params, const float* __restrict__ scratch,
                         unsigned* __restrict__ work, int rows, int split) {
    __shared__ unsigned cnt[S_BINS];
    __shared__ unsigned long long mass[S_BINS];
    const int row = blockIdx.x / split, k = blockIdx.x % split;
    const SParams p = s_params(params + (size_t)row * SAMPLE_WORDS);
    const SWork w = s_work(work, rows, split);
    float best;
    unsigned at;
    s_row_best(w, row, split, best, at);
    if (!s_draws(p, best)) return;
    if (!s_listable(p)) {
        // Nothing bounds the candidates: the draw picks a slice by the slices' weights, then a
        // token in it, so each slice's weight (min-p applied) is all it needs from here.
        const float* y = scratch + (size_t)row * vocab;
        const double wmin = (double)p.min_p * 2147483648.0;
        int lo, hi;
        s_slice(vocab, split, k, lo, hi);
        unsigned long long mine = 0;
        for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
            float d = __fsub_rn(y[j], best);
            if (!(d > S_CUTOFF)) continue;
            unsigned wt = s_weight(d);
            if ((double)wt >= wmin) mine += wt;
        }
        __shared__ unsigned long long part[S_PREP_THREADS / WARP];
        mine = s_warp_sum64(mine);
        if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = mine;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long t = 0;
            for (int g = 0; g < (int)(blockDim.x / WARP); ++g) t += part[g];
            w.slice_mass[(size_t)row * split + k] = t;
        }
        return;
    }
    const bool weigh = p.top_k == 0;
    for (int b = threadIdx.x; b < S_BINS; b += blockDim.x) {
        cnt[b] = 0;
        mass[b] = 0;
    }
    __syncthreads();
    const float* y = scratch + (size_t)row * vocab;
    int lo, hi;
    s_slice(vocab, split, k, lo, hi);
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        float d = __fsub_rn(y[j], best);
        if (!(d > S_CUTOFF)) continue;
        int b = s_bin(d);
        atomicAdd(&cnt[b], 1u);
        if (weigh) atomicAdd(&mass[b], (unsigned long long)s_weight(d));
    }
    __syncthreads();
    for (int b = threadIdx.x; b < S_BINS; b += blockDim.x) {
        if (cnt[b]) atomicAdd(&w.hist_cnt[(size_t)row * S_BINS + b], cnt[b]);
        if (mass[b]) atomicAdd(&w.hist_mass[(size_t)row * S_BINS + b], mass[b]);
    }
}

extern "C" __global__ void __launch_bounds__(S_PREP_THREADS)
    sample_compact_f32(int vocab, const unsigned* __restrict__ params, const float* __restrict__ scratch,
                       unsigned* __restrict__ work, int rows, int split) {
    __shared__ unsigned bin_floor, warp_base[S_PREP_THREADS / WARP], run;
    const int row = blockIdx.x / split, k = blockIdx.x % split;
    const SParams p = s_params(params + (size_t)row * SAMPLE_WORDS);
    const SWork w = s_work(work, rows, split);
    unsigned* reg_cnt = w.reg_cnt + (size_t)row * split + k;
    float best;
    unsigned at;
    s_row_best(w, row, split, best, at);
    if (!s_draws(p, best) || !s_listable(p)) {
        if (threadIdx.x == 0) *reg_cnt = S_OVERFLOW;
        return;
    }
    if (threadIdx.x == 0) {
        // From the top bin down to the one where the boundary lies; past S_LIST, too many.
        const unsigned* hc = w.hist_cnt + (size_t)row * S_BINS;
        const unsigned long long* hm = w.hist_mass + (size_t)row * S_BINS;
        unsigned long long bound = 0, mass = 0;
        if (p.top_k == 0) {
            unsigned long long total = 0;
            for (int b = 0; b < S_BINS; ++b) total += hm[b];
            bound = (unsigned long long)((double)p.top_p * (double)total);
            if (bound == 0) bound = 1;
        }
        unsigned taken = 0;
        int b = S_BINS - 1;
        for (; b > 0; --b) {
            taken += hc[b];
            mass += hm[b];
            if (p.top_k > 0 ? taken >= p.top_k : mass >= bound) break;
        }
        if (b == 0) taken += hc[0];
        bin_floor = taken > S_LIST ? S_OVERFLOW : (unsigned)b;
        run = 0;
    }
    __syncthreads();
    if (bin_floor == S_OVERFLOW) {
        if (threadIdx.x == 0) *reg_cnt = S_OVERFLOW;
        return;
    }
    // The slice's elements from that bin up, in id order (a tile of the block at a time).
    const float* y = scratch + (size_t)row * vocab;
    unsigned* out = w.reg + ((size_t)row * split + k) * S_LIST;
    int lo, hi;
    s_slice(vocab, split, k, lo, hi);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    for (int t0 = lo; t0 < hi; t0 += blockDim.x) {
        int j = t0 + threadIdx.x;
        bool keep = false;
        if (j < hi) {
            float d = __fsub_rn(y[j], best);
            keep = d > S_CUTOFF && s_bin(d) >= (int)bin_floor;
        }
        unsigned ballot = __ballot_sync(0xffffffffu, keep);
        if (lane == 0) warp_base[warp] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned r = run;
            for (int g = 0; g < warps; ++g) {
                unsigned c = warp_base[g];
                warp_base[g] = r;
                r += c;
            }
            run = r;
        }
        __syncthreads();
        if (keep) out[warp_base[warp] + __popc(ballot & ((1u << lane) - 1))] = j;
        __syncthreads();
    }
    if (threadIdx.x == 0) *reg_cnt = run;
}

// The draw of a row that nothing bounds but min-p: the slice where bits x total / 2^64 falls
// (from the slices' weights), then the token within it, walked in id order a tile at a time.
// Returns 0xffffffff if nothing weighs anything.
__device__ unsigned s_draw_spread(const float* y, int vocab, float best, const SParams& p,
                                  const SWork& w, int row, int split, SShared& s) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (threadIdx.x == 0) {
        const unsigned long long* m = w.slice_mass + (size_t)row * split;
        unsigned long long total = 0, before = 0;
        for (int k = 0; k < split; ++k) total += m[k];
        uint4 x = s_philox(make_uint4(p.position, p.stream, 0x73616d70u, 0u), p.seed_lo, p.seed_hi);
        unsigned long long target = __umul64hi(((unsigned long long)x.x << 32) | x.y, total);
        int owner = -1;
        for (int k = 0; k < split && total > 0; ++k) {
            if (before + m[k] > target) {
                owner = k;
                break;
            }
            before += m[k];
        }
        s.u[0] = (unsigned)owner;
        s.u64[0] = target;
        s.u64[1] = before;
        s.u[1] = 0xffffffffu;
    }
    __syncthreads();
    const int owner = (int)s.u[0];
    if (owner < 0) return 0xffffffffu;
    const double wmin = (double)p.min_p * 2147483648.0;
    const unsigned long long target = s.u64[0];
    int lo, hi;
    s_slice(vocab, split, owner, lo, hi);
    for (int t0 = lo; t0 < hi; t0 += blockDim.x) {
        int j = t0 + threadIdx.x;
        unsigned long long x = 0;
        if (j < hi) {
            float d = __fsub_rn(y[j], best);
            if (d > S_CUTOFF) {
                unsigned wt = s_weight(d);
                if ((double)wt >= wmin) x = wt;
            }
        }
        // Inclusive scan over the block: within each warp, then the warps' totals.
        unsigned long long run = x;
        for (int o = 1; o < WARP; o <<= 1) {
            unsigned long long t = __shfl_up_sync(0xffffffffu, run, o);
            if (lane >= o) run += t;
        }
        if (lane == WARP - 1) s.part[warp] = run;
        __syncthreads();
        unsigned long long base = s.u64[1];
        for (int g = 0; g < warp; ++g) base += s.part[g];
        bool hit = x > 0 && base + run > target && base + run - x <= target;
        if (hit) s.u[1] = j;
        __syncthreads();
        if (threadIdx.x == 0)
            for (int g = 0; g < S_WARPS; ++g) s.u64[1] += s.part[g];
        __syncthreads();
        if (s.u[1] != 0xffffffffu) break;
    }
    return s.u[1];
}

extern "C" __global__ void __launch_bounds__(S_THREADS)
    sample_rows_f32(const float* __restrict__ logits, int vocab, const unsigned* __restrict__ params,
                    const unsigned* __restrict__ bias, unsigned* __restrict__ counts,
                    float* __restrict__ scratch, unsigned* __restrict__ picks,
                    float* __restrict__ logprobs, unsigned* __restrict__ top_ids,
                    unsigned* __restrict__ work, int rows, int split) {
    __shared__ SShared s;
    const int row = blockIdx.x;
    const SParams p = s_params(params + (size_t)row * SAMPLE_WORDS);
    const SWork w = s_work(work, rows, split);
    const float* l = logits + (size_t)row * vocab;
    float* lp_row = logprobs + (size_t)row * LOGPROB_COLS;
    float lse = 0.0f;
    if (p.logprobs > 0)
        lse = s_top_logprobs(l, vocab, p.logprobs - 1, s, lp_row + 1,
                             top_ids + (size_t)row * MAX_TOP_LOGPROBS);
    float best;
    unsigned pick;
    s_row_best(w, row, split, best, pick);
    if (s_draws(p, best) && !s_listable(p)) {
        unsigned drawn = s_draw_spread(scratch + (size_t)row * vocab, vocab, best, p, w, row, split, s);
        if (drawn != 0xffffffffu) pick = drawn;
    } else if (s_draws(p, best)) {
        const float* y = scratch + (size_t)row * vocab;
        SElems e = {y, vocab, false, false, best};
        SFilter flt = {0u, 0.0};
        unsigned long long known_total = 0;
        const unsigned* reg_cnt = w.reg_cnt + (size_t)row * split;
        if (reg_cnt[0] != S_OVERFLOW) {
            // The slices' lists, one after the other: the row's best elements in id order.
            if (threadIdx.x == 0) {
                unsigned at = 0;
                for (int k = 0; k < split; ++k) {
                    s.part[k] = at;
                    at += reg_cnt[k];
                }
                s.u[0] = at;
            }
            __syncthreads();
            unsigned n = s.u[0];
            for (int k = 0; k < split; ++k) {
                const unsigned* ids = w.reg + ((size_t)row * split + k) * S_LIST;
                unsigned c = reg_cnt[k], at = (unsigned)s.part[k];
                for (unsigned i = threadIdx.x; i < c; i += blockDim.x) {
                    unsigned id = ids[i];
                    float d = __fsub_rn(y[id], best);
                    s.list_id[at + i] = id;
                    s.list_key[at + i] = s_key(y[id]);
                    s.list_w[at + i] = s_weight(d);
                }
            }
            __syncthreads();
            e.list = true;
            e.n = n;
            if (p.top_k == 0) {
                // Top-p alone: the list holds only the best candidates; their total is all of
                // the candidates', from the histogram.
                if (threadIdx.x == 0) {
                    unsigned long long t = 0;
                    for (int b = 0; b < S_BINS; ++b) t += w.hist_mass[(size_t)row * S_BINS + b];
                    s.u64[0] = t;
                }
                __syncthreads();
                known_total = s.u64[0];
                __syncthreads();
            }
        }
        if (p.top_k > 0) flt.tau = s_select_by_count(e, flt, p.top_k, s);
        if (!e.list) {
            // Few enough left after top-k: the rest of the passes read them from shared memory.
            unsigned left = s_compact(e, flt, 0, S_LIST, s);
            if (left <= S_LIST) {
                e.list = true;
                e.n = left;
            }
        }
        if (p.top_p < 1.0f)
            flt.tau = max(flt.tau, s_select_by_mass(e, flt, p.top_p, known_total, s));
        if (p.min_p > 0.0f) flt.wmin = (double)p.min_p * 2147483648.0;
        uint4 x = s_philox(make_uint4(p.position, p.stream, 0x73616d70u, 0u), p.seed_lo, p.seed_hi);
        unsigned long long bits = ((unsigned long long)x.x << 32) | x.y;
        unsigned drawn = s_draw(e, flt, bits, s);
        if (drawn != 0xffffffffu) pick = drawn;
    }
    if (threadIdx.x == 0) {
        // No finite largest logit (NaN everywhere, as an activation that overflowed upstream
        // leaves it; an infinity; every token masked): no token, nothing counted, and the
        // engine ends the request with an error instead of sending token 0.
        const bool lost = !isfinite(best);
        picks[row] = lost ? S_NOT_FINITE : pick;
        if (p.slot != S_NO_SLOT && !lost) counts[(size_t)p.slot * vocab + pick] += 1;
        lp_row[0] = p.logprobs > 0 && !lost ? l[pick] - lse : __int_as_float(0x7fc00000);
    }
}
