// Sampling on the GPU: per row of a [B, vocab] logits batch, greedy (temperature 0) or
// temperature + top-k + top-p with a uniform draw u ∈ [0, 1) supplied by the host, reproducing
// the engine's CPU sampler exactly given the same u:
//   candidates: the non-NaN logits, divided (in f32) by the temperature;
//   order: descending value (f32 total order, so +0 before -0), ties by lower id;
//   top-k keeps the first k; probabilities exp(f64(value - max)) normalised over the kept;
//   top-p keeps the shortest prefix whose cumulative probability reaches top_p;
//   the token is the first of the kept prefix whose cumulative probability exceeds u.
// Greedy rows give the CPU argmax (NaN never wins, ties to the lower id, an all-NaN row 0).
//
// Every kept set is a prefix of that order, so each step is one "select": the first element of
// the order (within a prefix bound) at which a running count or probability mass reaches a
// target. A select is a radix descent over a 32-bit key that sorts the order ascending, 11 bits
// per pass over the row (histograms of count and, for mass targets, f64 mass in shared memory: sums
// in f64 like the CPU's, so the two differ only where u is within ~1e-15 of a boundary), then one ordered pass to
// pick the tie (equal values carry equal mass) by id. One block per row; rows are independent.
//
// Prefix path (rows whose top-k truncates): one pass counts the row into the first-level bins.
// From the counts the scan picks the bins through the top-k bin; their elements are compacted into
// shared memory (at most SAMPLE_CAP), sorted by (key, id), and the rules run exactly on that
// sorted prefix with f64 running sums. Rows whose prefix is larger than SAMPLE_CAP take the radix
// path above.
//
// Bin path (rows without a top-k cut): one pass counts the row into the first-level bins with
// planning masses (a fast exponential in fixed point, see plan_histogram) and finds the largest
// value. The plan names the bin holding the top-p boundary; every bin before it is kept whole and
// enters only through its mass, so that bin alone is compacted, sorted and searched, its running
// sums starting from the exact (f64) mass of the candidates before it, summed in the same pass as
// the compaction along with the row's total. The kept mass then scales the draw, whose bin (the
// same one, or an earlier one planned on the same histogram) is taken the same way. Two or three
// passes over the row instead of the radix path's four per rule. The planning masses only choose
// bins: every answer is settled on exact sums, and when a chosen bin holds more than SAMPLE_CAP
// elements or does not hold the answer, the radix path decides the row.

// 0: rows without a top-k cut go straight to the radix path (checks the path the others fall
// back to).
#ifndef SAMPLE_BINS
#define SAMPLE_BINS 1
#endif

#ifndef SAMPLE_THREADS
#define SAMPLE_THREADS 1024
#endif
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Radix digits of the 32-bit key, most significant first: 11, 11 and 10 bits.
#define BINS 2048
#define LEVELS 3

__device__ __forceinline__ float logit_at(const float* row, int i) { return row[i]; }
__device__ __forceinline__ float logit_at(const bf16_t* row, int i) { return bf2f(row[i]); }

// Calls f(i, logit) for every index i of the row this thread visits (i ≥ vocab gives NaN, and
// f must ignore it). SAMPLE_UNROLL loads are issued before any is used: one block streams a whole
// row, so its bandwidth is the loads it keeps in flight. Every thread runs the same iterations,
// so f may use warp-collective operations.
#ifndef SAMPLE_UNROLL
#define SAMPLE_UNROLL 8
#endif
template <typename T, typename F>
__device__ __forceinline__ void for_row(const T* row, int vocab, F&& f) {
    for (int base = 0; base < vocab; base += SAMPLE_THREADS * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) {
            const int i = base + u * SAMPLE_THREADS + (int)threadIdx.x;
            v[u] = i < vocab ? logit_at(row, i) : __int_as_float(0x7fc00000);
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) f(base + u * SAMPLE_THREADS + (int)threadIdx.x, v[u]);
    }
}

// Ascending in this key is descending in f32 total order.
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned b = __float_as_uint(v);
    return ~(b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u));
}

// A position in the order: the element with this key and id (the last one kept by a bound).
struct Pos {
    unsigned key, id;
};
__device__ __forceinline__ bool within(unsigned key, unsigned id, Pos bound) {
    return key < bound.key || (key == bound.key && id <= bound.id);
}

struct SampleShared {
    unsigned cnt[BINS];
    double mass[BINS];
    unsigned warp_cnt[SAMPLE_WARPS];
    float warp_max[SAMPLE_WARPS];
    unsigned prefix, found_id, tie_rank;
    unsigned long long before_cnt;
    double before_mass, target;
};

// Counts a lane's element (when `take`) into first-digit bin b and, with `by_mass`, adds its mass
// m. Counts alone go in by every lane's own atomic. With masses, lanes that fall in the same bin
// (a row's values crowd into a few exponent bins) add once, through the lowest of them, their
// masses meeting there by shuffles: f64 atomics of every lane cost more. Every lane of the warp
// calls it.
__device__ __forceinline__ void add_first_digit(SampleShared& sh, bool take, unsigned b,
                                                bool by_mass, double m) {
    const int lane = threadIdx.x & 31;
    if (!by_mass) {
        if (take) atomicAdd(&sh.cnt[b], 1u);
        return;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, b);
    const bool leader = take && lane == __ffs(peers) - 1;
    if (leader) atomicAdd(&sh.cnt[b], (unsigned)__popc(peers));
    double sum = 0.0;
    for (int j = 0; j < 32; ++j) {
        const double o = __shfl_sync(0xffffffffu, m, j);
        if ((peers >> j) & 1u) sum += o;
    }
    if (leader) atomicAdd(&sh.mass[b], sum);
}

// Sum of two counts and masses held by lanes; lane 31 ends with the totals (inclusive scan).
__device__ __forceinline__ void warp_scan(unsigned& c, double& m) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned oc = __shfl_up_sync(0xffffffffu, c, o);
        const double om = __shfl_up_sync(0xffffffffu, m, o);
        if (lane >= o) {
            c += oc;
            m += om;
        }
    }
}

// The first element within `bound` at which the running count (by_mass false) or mass (true)
// reaches `goal` (a count, or a fraction of the bound's total mass). Returns its position.
template <typename T>
__device__ Pos select(const T* row, int vocab, float temp, float vmax, Pos bound, bool by_mass,
                      double goal, SampleShared& sh) {
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        sh.prefix = 0;
        sh.before_cnt = 0;
        sh.before_mass = 0.0;
    }
    for (int level = 0; level < LEVELS; ++level) {
        const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
        const unsigned digit = level == 2 ? 1023u : 2047u;
        for (int i = tid; i < BINS; i += SAMPLE_THREADS) {
            sh.cnt[i] = 0;
            sh.mass[i] = 0.0;
        }
        __syncthreads();
        const unsigned prefix = sh.prefix;
        const unsigned high = level == 0 ? 0u : (0xffffffffu << (level == 1 ? 21 : 10));
        for_row(row, vocab, [&](int i, float raw) {
            const float v = raw / temp;
            const unsigned key = order_key(v);
            const bool take =
                i < vocab && v == v && ((key ^ prefix) & high) == 0 && within(key, (unsigned)i, bound);
            const unsigned b = take ? (key >> shift) & digit : BINS;
            if (level > 0) {
                // Deeper levels: few elements remain, spread over the bins of one prefix.
                if (take) {
                    atomicAdd(&sh.cnt[b], 1u);
                    if (by_mass) atomicAdd(&sh.mass[b], exp((double)(v - vmax)));
                }
                return;
            }
            if (__ballot_sync(0xffffffffu, take) == 0) return;
            add_first_digit(sh, take, b, by_mass, take && by_mass ? exp((double)(v - vmax)) : 0.0);
        });
        __syncthreads();
        if (tid < 32) {
            // Lane l scans bins 8l .. 8l + 7.
            unsigned c = 0;
            double m = 0.0;
#pragma unroll
            for (int j = 0; j < BINS / 32; ++j) {
                c += sh.cnt[lane * (BINS / 32) + j];
                m += sh.mass[lane * (BINS / 32) + j];
            }
            unsigned ci = c;
            double mi = m;
            warp_scan(ci, mi);
            if (level == 0) {
                const double total = __shfl_sync(0xffffffffu, mi, 31);
                if (lane == 0) sh.target = by_mass ? goal * total : goal;
            }
            __syncwarp();
            const double target = sh.target;
            const unsigned long long bc = sh.before_cnt;
            const double bm = sh.before_mass;
            // The first lane whose running total reaches the target (else the last non-empty).
            const bool reach = by_mass ? (bm + mi >= target) : ((double)(bc + ci) >= target);
            const unsigned any = __ballot_sync(0xffffffffu, reach && c > 0);
            const unsigned nonempty = __ballot_sync(0xffffffffu, c > 0);
            const int pick = any ? __ffs(any) - 1 : 31 - __clz(nonempty);
            if (lane == pick) {
                unsigned long long rc = bc + (ci - c);
                double rm = bm + (mi - m);
                int bin = -1, last = -1;
                for (int j = 0; j < BINS / 32; ++j) {
                    const int b = lane * (BINS / 32) + j;
                    const unsigned nb = sh.cnt[b];
                    if (nb == 0) continue;
                    const bool r = by_mass ? (rm + sh.mass[b] >= target) : ((double)(rc + nb) >= target);
                    if (any && r) {
                        bin = b;
                        break;
                    }
                    last = b;
                    rc += nb;
                    rm += sh.mass[b];
                }
                const bool reached = bin >= 0;
                if (!reached) {
                    // Rounding or a target past the total: the last element counts.
                    bin = last;
                    rc -= sh.cnt[bin];
                    rm -= sh.mass[bin];
                }
                sh.before_cnt = rc;
                sh.before_mass = rm;
                sh.prefix |= (unsigned)bin << shift;
                if (level == LEVELS - 1) {
                    // Rank within the tie group (equal keys carry equal mass), ordered by id.
                    const unsigned nb = sh.cnt[bin];
                    double r = nb - 1.0;
                    if (reached && by_mass) {
                        const double each = sh.mass[bin] / nb;
                        if (each > 0.0) r = ceil((target - rm) / each) - 1.0;
                    } else if (reached) {
                        r = target - (double)rc - 1.0;
                    }
                    sh.tie_rank = (unsigned)fmin(fmax(r, 0.0), nb - 1.0);
                }
            }
        }
        __syncthreads();
    }
    const unsigned key = sh.prefix, rank = sh.tie_rank;
    const int warp = tid >> 5;
    if (rank == 0) {
        // The lowest id holding the key: one pass, no ordering needed.
        unsigned best = 0xffffffffu;
        for_row(row, vocab, [&](int i, float raw) {
            const float v = raw / temp;
            if (i < vocab && v == v && order_key(v) == key && within(key, (unsigned)i, bound))
                best = min(best, (unsigned)i);
        });
        for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
        if (lane == 0) sh.warp_cnt[warp] = best;
        __syncthreads();
        for (int w = 0; w < SAMPLE_WARPS; ++w) best = min(best, sh.warp_cnt[w]);
        __syncthreads();
        return Pos{key, best};
    }
    // Ordered pass: the rank-th id (ascending) holding the selected key.
    unsigned seen = 0;
    for (int base = 0; base < vocab; base += SAMPLE_THREADS) {
        const int i = base + tid;
        bool hit = false;
        if (i < vocab) {
            const float v = logit_at(row, i) / temp;
            hit = v == v && order_key(v) == key && within(key, (unsigned)i, bound);
        }
        const unsigned bal = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) sh.warp_cnt[warp] = __popc(bal);
        __syncthreads();
        unsigned before = seen, total = 0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) {
            const unsigned n = sh.warp_cnt[w];
            if (w < warp) before += n;
            total += n;
        }
        before += __popc(bal & ((1u << lane) - 1u));
        if (hit && before == rank) sh.found_id = (unsigned)i;
        __syncthreads();
        seen += total;
        if (seen > rank) break;
    }
    return Pos{key, sh.found_id};
}

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

// Warp 0 over the first-digit histogram: the first non-empty bin whose running mass exceeds `goal`
// (strict) or reaches it, and the mass of the bins before it; when none does, the last non-empty
// bin. `bin` < 0: the lane totals and the walk through the bins disagree by rounding.
struct BinHit {
    int bin;
    double before;
};
__device__ BinHit first_bin(const SampleShared& sh, double goal, bool strict) {
    constexpr int PER = BINS / 32;
    const int lane = threadIdx.x & 31;
    unsigned c = 0;
    double m = 0.0;
    for (int j = 0; j < PER; ++j) {
        c += sh.cnt[lane * PER + j];
        m += sh.mass[lane * PER + j];
    }
    unsigned ci = c;
    double mi = m;
    warp_scan(ci, mi);
    const bool r = c > 0 && (strict ? mi > goal : mi >= goal);
    const unsigned any = __ballot_sync(0xffffffffu, r);
    const unsigned nonempty = __ballot_sync(0xffffffffu, c > 0);
    const int l = any ? __ffs(any) - 1 : 31 - __clz(nonempty);
    double run = __shfl_sync(0xffffffffu, mi - m, l);
    BinHit hit{-1, 0.0};
    for (int j = 0; j < PER; ++j) {
        const int b = l * PER + j;
        if (sh.cnt[b] == 0) continue;
        const double nb = sh.mass[b];
        if (any && (strict ? run + nb > goal : run + nb >= goal)) return BinHit{b, run};
        if (!any) hit = BinHit{b, run};
        run += nb;
    }
    return hit;
}

// Sums a and b over the block (every thread gets both).
__device__ void block_sum2(double& a, double& b) {
    __shared__ double part[2][SAMPLE_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane == 0) {
        part[0][warp] = a;
        part[1][warp] = b;
    }
    __syncthreads();
    a = 0.0;
    b = 0.0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        a += part[0][w];
        b += part[1][w];
    }
    __syncthreads();
}

// The largest value a first-digit bin can hold (NaN for the bins of NaN patterns and +inf).
__device__ __forceinline__ float bin_top(unsigned b) { return key_value(b << 21); }

// The bin path's first pass: counts, the smallest key (the largest value, returned) and planning
// masses — each candidate's exp(v - top of its bin) by a fast f32 exponential in fixed point,
// scaled by exp(top - vmax) into sh.mass at the end. Every lane adds its own by shared-memory
// atomics, into one of four copies of the histogram (by lane, in the compaction buffer) to spread
// the crowded bins; units of 1/unit with unit · vocab < 2^32, so no copy overflows. (Gathering a
// bin's lanes first, by a match and a reduction, was 8x slower.)
static_assert(SAMPLE_CAP * sizeof(unsigned long long) >= 8 * BINS * sizeof(unsigned),
              "the compaction buffer holds the planning histogram's four copies");
template <typename T>
__device__ float plan_histogram(const T* row, int vocab, float temp, SampleShared& sh) {
    extern __shared__ __align__(16) unsigned char sample_dyn[];
    __shared__ unsigned min_key;
    unsigned* cnt4 = reinterpret_cast<unsigned*>(sample_dyn);
    unsigned* mass4 = cnt4 + 4 * BINS;
    const int tid = threadIdx.x, lane = tid & 31;
    for (int i = tid; i < 8 * BINS; i += SAMPLE_THREADS) cnt4[i] = 0;
    if (tid == 0) min_key = 0xffffffffu;
    __syncthreads();
    const float unit = (float)(4294967295.0 / vocab * 0.999);
    unsigned own_min = 0xffffffffu;
    for_row(row, vocab, [&](int i, float raw) {
        const float v = raw / temp;
        if (!(i < vocab && v == v)) return;
        const unsigned key = order_key(v), b = key >> 21;
        own_min = min(own_min, key);
        atomicAdd(&cnt4[(lane & 3) * BINS + b], 1u);
        atomicAdd(&mass4[(lane & 3) * BINS + b], __float2uint_rz(__expf(v - bin_top(b)) * unit));
    });
    own_min = __reduce_min_sync(0xffffffffu, own_min);
    if (lane == 0) atomicMin(&min_key, own_min);
    __syncthreads();
    const float vmax = key_value(min_key);
    for (int i = tid; i < BINS; i += SAMPLE_THREADS) {
        unsigned c = 0;
        unsigned long long f = 0;
        for (int j = 0; j < 4; ++j) {
            c += cnt4[j * BINS + i];
            f += mass4[j * BINS + i];
        }
        const double m = (double)f / unit * exp((double)bin_top(i) - (double)vmax);
        sh.cnt[i] = c;
        sh.mass[i] = isfinite(m) ? m : 0.0;
    }
    __syncthreads();
    return vmax;
}

// Rows without a top-k cut (see the top of the file). The first pass also finds vmax and n, for
// the radix path should this one return false (nothing written); a row without candidates gets
// token 0 here.
template <typename T>
__device__ bool sample_bins(const T* row, int vocab, float temp, float p, double u,
                            SampleShared& sh, unsigned* out, float& vmax, unsigned& n) {
    extern __shared__ __align__(16) unsigned char sample_dyn[];
    PrefixShared& ps = *reinterpret_cast<PrefixShared*>(sample_dyn);
    __shared__ BinHit plan;
    __shared__ double plan_total;
    __shared__ int last_bin;
    __shared__ unsigned row_n;
    const int tid = threadIdx.x;
    vmax = plan_histogram(row, vocab, temp, sh);
    if (tid < 32) {
        double total = 0.0;
        unsigned count = 0;
        for (int b = tid; b < BINS; b += 32) {
            total += sh.mass[b];
            count += sh.cnt[b];
        }
        for (int o = 16; o > 0; o >>= 1) {
            total += __shfl_xor_sync(0xffffffffu, total, o);
            count += __shfl_xor_sync(0xffffffffu, count, o);
        }
        const int last = count ? first_bin(sh, __longlong_as_double(0x7ff0000000000000ll), true).bin : -1;
        if (tid == 0) {
            plan_total = total;
            row_n = count;
            last_bin = last;
        }
    }
    __syncthreads();
    n = row_n;
    if (n == 0) {
        if (tid == 0) out[0] = 0;
        return true;
    }
    // The planning total until the first bin's pass sums the exact one.
    double total = plan_total;
    // The top-p boundary first (the running mass through it scales the draw), then the draw.
    bool top_p = p < 1.0f;
    double kept = -1.0;
    int p_bin = BINS;
    for (;;) {
        double goal = top_p ? (double)p * total : u * (kept < 0.0 ? total : kept);
        if (tid < 32) {
            const BinHit h = first_bin(sh, goal, !top_p);
            if (tid == 0) plan = h;
        }
        __syncthreads();
        const BinHit h = plan;
        __syncthreads();
        // Unsettled by rounding, or a draw's bin past the top-p one.
        if (h.bin < 0 || h.bin > p_bin) return false;
        const unsigned bin = (unsigned)h.bin, cnt = sh.cnt[bin];
        if (cnt > SAMPLE_CAP) return false;
        // The bin's elements, and the exact masses of the candidates before it and (first time)
        // of all.
        const bool need_all = kept < 0.0;
        double below = 0.0, all = 0.0;
        const unsigned got = compact(row, vocab, temp, ps, [&](unsigned key, float v) {
            const bool before = (key >> 21) < bin;
            if (need_all || before) {
                const double m = exp((double)(v - vmax));
                all += m;
                below += before ? m : 0.0;
            }
            return (key >> 21) == bin;
        });
        if (got != cnt) return false;
        block_sum2(below, all);
        if (kept < 0.0) {
            total = all;
            goal = top_p ? (double)p * total : u * total;
        }
        // The bins before this one must neither reach the top-p goal nor pass the draw's.
        if (top_p ? below >= goal : below > goal) return false;
        sort_candidates(ps, (int)cnt);
        Run run;
        cumulate(ps, (int)cnt, vmax, below, run);
        int pick;
        if (top_p) {
            const int i = first_reaching(ps, run, (int)cnt, goal, false);
            if (i < 0) return false;
            kept = run_at(ps, run, i);
            top_p = false;
            p_bin = h.bin;
            // The draw lies in an earlier bin: plan again.
            if (below > u * kept) continue;
            const int j = first_reaching(ps, run, i + 1, u * kept, true);
            pick = j < 0 ? i : j;
        } else {
            pick = first_reaching(ps, run, (int)cnt, goal, true);
            if (pick < 0) {
                // Past every running sum: the row's last candidate, if this is its bin.
                if (p_bin < BINS || h.bin != last_bin) return false;
                pick = (int)cnt - 1;
            }
        }
        if (tid == 0) out[0] = (unsigned)(ps.cand[pick] & 0xffffffffu);
        return true;
    }
}

// Greedy: the lowest id holding the largest logit (NaN never wins; 0 when every logit is NaN).
template <typename T>
__device__ void argmax_row(const T* row, int vocab, SampleShared& sh, unsigned* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best = -__int_as_float(0x7f800000);
    unsigned at = 0xffffffffu;
    auto better = [](float v, unsigned i, float bv, unsigned bi) {
        return v > bv || (v == bv && i < bi);
    };
    for_row(row, vocab, [&](int i, float v) {
        if (i < vocab && better(v, (unsigned)i, best, at)) {
            best = v;
            at = (unsigned)i;
        }
    });
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, at, o);
        if (better(ov, oi, best, at)) {
            best = ov;
            at = oi;
        }
    }
    if (lane == 0) {
        sh.warp_max[warp] = best;
        sh.warp_cnt[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 0; w < SAMPLE_WARPS; ++w)
            if (better(sh.warp_max[w], sh.warp_cnt[w], best, at)) {
                best = sh.warp_max[w];
                at = sh.warp_cnt[w];
            }
        out[0] = at == 0xffffffffu ? 0u : at;
    }
}

template <typename T>
__device__ void sample_row(const T* __restrict__ logits, const float* __restrict__ temperature,
                           const unsigned* __restrict__ top_k, const float* __restrict__ top_p,
                           const double* __restrict__ uniform, unsigned* __restrict__ out,
                           int vocab) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const T* row = logits + (size_t)r * vocab;
    const float t = temperature[r];
    if (!(t > 0.0f)) {
        argmax_row(row, vocab, sh, out + r);
        return;
    }
    // Values are logit / t, divided as the CPU does (a product with 1/t rounds differently).
    const float temp = t;
    const unsigned k = top_k[r];
    const float p = top_p[r];
    float vmax;
    unsigned n;
    if (SAMPLE_BINS && (k == 0 || k >= (unsigned)vocab)) {
        // No top-k cut: the bin path, whose first pass finds vmax and n itself.
        if (sample_bins(row, vocab, temp, p, uniform[r], sh, out + r, vmax, n)) return;
    } else {
        // The largest value and the number of non-NaN candidates.
        vmax = -__int_as_float(0x7f800000);
        n = 0;
        for_row(row, vocab, [&](int i, float raw) {
            const float v = raw / temp;
            if (i < vocab && v == v) {
                vmax = fmaxf(vmax, v);
                ++n;
            }
        });
        for (int o = 16; o > 0; o >>= 1) {
            vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o));
            n += __shfl_xor_sync(0xffffffffu, n, o);
        }
        if (lane == 0) {
            sh.warp_max[warp] = vmax;
            sh.warp_cnt[warp] = n;
        }
        __syncthreads();
        vmax = sh.warp_max[0];
        n = 0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) {
            vmax = fmaxf(vmax, sh.warp_max[w]);
            n += sh.warp_cnt[w];
        }
        __syncthreads();
        if (n == 0) {
            if (tid == 0) out[r] = 0;
            return;
        }
        // The prefix path for a truncating top-k (see the top of the file).
        if (k > 0 && k < n && sample_prefix(row, vocab, temp, vmax, k, p, uniform[r], sh, out + r))
            return;
    }
    Pos bound{0xffffffffu, 0xffffffffu};
    if (k > 0 && k < n) bound = select(row, vocab, temp, vmax, bound, false, (double)k, sh);
    if (p < 1.0f) bound = select(row, vocab, temp, vmax, bound, true, (double)p, sh);
    bound = select(row, vocab, temp, vmax, bound, true, uniform[r], sh);
    if (tid == 0) out[r] = bound.id;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32(const float* __restrict__ logits, const float* __restrict__ temperature,
           const unsigned* __restrict__ top_k, const float* __restrict__ top_p,
           const double* __restrict__ uniform, unsigned* __restrict__ out, int vocab) {
    sample_row(logits, temperature, top_k, top_p, uniform, out, vocab);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_bf16(const bf16_t* __restrict__ logits, const float* __restrict__ temperature,
            const unsigned* __restrict__ top_k, const float* __restrict__ top_p,
            const double* __restrict__ uniform, unsigned* __restrict__ out, int vocab) {
    sample_row(logits, temperature, top_k, top_p, uniform, out, vocab);
}
