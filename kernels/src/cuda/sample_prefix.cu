// Sampling on the GPU, part two (after sample.cu, as one translation unit): the compacted
// candidates of a row — compaction, the sort into the sampling order, running masses — and the
// prefix path of rows whose top-k truncates.

#ifndef SAMPLE_CAP
#define SAMPLE_CAP 8192
#endif
#define PER_THREAD (SAMPLE_CAP / SAMPLE_THREADS)
static_assert(SAMPLE_CAP % SAMPLE_THREADS == 0 && (SAMPLE_CAP & (SAMPLE_CAP - 1)) == 0,
              "the candidate capacity is a power of two and a multiple of the block");

// Compacted candidates: (key << 32 | id) ascending is the sampling order. Their running masses
// stay in registers (`Run`: PER_THREAD consecutive elements per thread).
struct PrefixShared {
    unsigned long long cand[SAMPLE_CAP];
    unsigned count;
    int hit;
    double val;
};
typedef double Run[PER_THREAD];

__device__ __forceinline__ float key_value(unsigned key) {
    const unsigned x = ~key;
    return __uint_as_float((x >> 31) ? (x ^ 0x80000000u) : (x ^ 0xffffffffu));
}

// Compacts the row's candidates for which `keep(key, value)` holds (it sees every candidate)
// into ps.cand, in any order, and returns how many there are (those past SAMPLE_CAP counted, not
// stored).
template <typename T, typename Keep>
__device__ unsigned compact(const T* row, int vocab, float temp, PrefixShared& ps, Keep keep) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) ps.count = 0;
    __syncthreads();
    for_row(row, vocab, [&](int i, float raw) {
        const float v = raw / temp;
        const unsigned key = order_key(v);
        const bool take = i < vocab && v == v && keep(key, v);
        const unsigned bal = __ballot_sync(0xffffffffu, take);
        if (bal == 0) return;
        unsigned base = 0;
        if (lane == __ffs(bal) - 1) base = atomicAdd(&ps.count, (unsigned)__popc(bal));
        base = __shfl_sync(0xffffffffu, base, __ffs(bal) - 1);
        if (take) {
            const unsigned slot = base + __popc(bal & ((1u << lane) - 1u));
            if (slot < SAMPLE_CAP) ps.cand[slot] = ((unsigned long long)key << 32) | (unsigned)i;
        }
    });
    __syncthreads();
    const unsigned count = ps.count;
    __syncthreads();
    return count;
}

// Sorts the first cnt ≤ SAMPLE_CAP candidates into the sampling order (bitonic, ascending).
__device__ void sort_candidates(PrefixShared& ps, int cnt) {
    const int tid = threadIdx.x;
    int pow2 = 32;
    while (pow2 < cnt) pow2 <<= 1;
    for (int i = cnt + tid; i < pow2; i += SAMPLE_THREADS) ps.cand[i] = ~0ull;
    __syncthreads();
    for (int size = 2; size <= pow2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < pow2; i += SAMPLE_THREADS) {
                const int j = i ^ stride;
                if (j > i) {
                    const unsigned long long a = ps.cand[i], b = ps.cand[j];
                    if ((a > b) == ((i & size) == 0)) {
                        ps.cand[i] = b;
                        ps.cand[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// run = base + the inclusive running sums of exp(value - max) over the first cnt sorted
// candidates (elements past cnt add nothing).
__device__ void cumulate(const PrefixShared& ps, int cnt, float vmax, double base, Run& run) {
    __shared__ double warp_sum[SAMPLE_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    double local = 0.0;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid * PER_THREAD + j;
        local += i < cnt ? exp((double)(key_value((unsigned)(ps.cand[i] >> 32)) - vmax)) : 0.0;
        run[j] = local;
    }
    double scan = local;
    for (int o = 1; o < 32; o <<= 1) {
        const double x = __shfl_up_sync(0xffffffffu, scan, o);
        if (lane >= o) scan += x;
    }
    if (lane == 31) warp_sum[warp] = scan;
    __syncthreads();
    double offset = base + (scan - local);
    for (int w = 0; w < warp; ++w) offset += warp_sum[w];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) run[j] += offset;
    __syncthreads();
}

// The first index i < len whose running sum is ≥ target (> when strict), or -1.
__device__ int first_reaching(PrefixShared& ps, const Run& run, int len, double target,
                              bool strict) {
    const int tid = threadIdx.x;
    if (tid == 0) ps.hit = 0x7fffffff;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid * PER_THREAD + j;
        if (i < len && (strict ? run[j] > target : run[j] >= target)) {
            atomicMin(&ps.hit, i);
            break;
        }
    }
    __syncthreads();
    const int h = ps.hit;
    __syncthreads();
    return h == 0x7fffffff ? -1 : h;
}

// The running sum at index i (every thread gets it).
__device__ double run_at(PrefixShared& ps, const Run& run, int i) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j)
        if (tid * PER_THREAD + j == i) ps.val = run[j];
    __syncthreads();
    const double v = ps.val;
    __syncthreads();
    return v;
}

// Samples a row whose top-k truncates (0 < k < n) from its compacted prefix; false (nothing
// written) when the row needs the radix path. n > 0 non-NaN values, the largest vmax.
template <typename T>
__device__ bool sample_prefix(const T* row, int vocab, float temp, float vmax, unsigned k, float p,
                              double u, SampleShared& sh, unsigned* out) {
    extern __shared__ __align__(16) unsigned char sample_dyn[];
    PrefixShared& ps = *reinterpret_cast<PrefixShared*>(sample_dyn);
    const int tid = threadIdx.x, lane = tid & 31;
    for (int i = tid; i < BINS; i += SAMPLE_THREADS) sh.cnt[i] = 0;
    __syncthreads();
    for_row(row, vocab, [&](int i, float raw) {
        const float v = raw / temp;
        const bool take = i < vocab && v == v;
        if (__ballot_sync(0xffffffffu, take) == 0) return;
        add_first_digit(sh, take, take ? order_key(v) >> 21 : BINS, false, 0.0);
    });
    __syncthreads();
    if (tid < 32) {
        // The top-k bin: the first whose running count reaches k; the count through it.
        constexpr int PER = BINS / 32;
        unsigned c = 0;
        for (int j = 0; j < PER; ++j) c += sh.cnt[lane * PER + j];
        unsigned ci = c;
        double unused = 0.0;
        warp_scan(ci, unused);
        const unsigned any = __ballot_sync(0xffffffffu, ci >= k && c > 0);
        const int l = __ffs(any) - 1;
        unsigned through = __shfl_sync(0xffffffffu, ci - c, l);
        int bin = l * PER + PER - 1;
        for (int j = 0; j < PER; ++j) {
            through += sh.cnt[l * PER + j];
            if (through >= k) {
                bin = l * PER + j;
                break;
            }
        }
        if (lane == 0) {
            sh.prefix = (unsigned)bin;
            sh.before_cnt = through;
        }
    }
    __syncthreads();
    const unsigned last = sh.prefix, len = (unsigned)sh.before_cnt;
    __syncthreads();
    if (len > SAMPLE_CAP) return false;
    if (compact(row, vocab, temp, ps, [&](unsigned key, float) { return (key >> 21) <= last; }) != len)
        return false;
    sort_candidates(ps, (int)len);
    Run run;
    cumulate(ps, (int)len, vmax, 0.0, run);
    // The kept prefix [0, keep) and its mass.
    int keep = (int)k;
    double mass = run_at(ps, run, keep - 1);
    if (p < 1.0f) {
        const int i = first_reaching(ps, run, keep, (double)p * mass, false);
        keep = i < 0 ? keep : i + 1;
        mass = run_at(ps, run, keep - 1);
    }
    const int i = first_reaching(ps, run, keep, u * mass, true);
    if (tid == 0) out[0] = (unsigned)(ps.cand[i < 0 ? keep - 1 : i] & 0xffffffffu);
    return true;
}
