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
//
// This file holds the order, the keys and the radix select; sample_prefix.cu the compacted
// candidates and the prefix path; sample_bins.cu the bin path, greedy rows and the kernels
// (compiled as one translation unit, in that order).

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
