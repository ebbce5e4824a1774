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
// Prefix path: one pass counts the row into the first-level bins (and, without a truncating
// top-k, sums the f64 mass of the whole row). From the counts, and each bin's smallest value as a
// lower bound on its elements' masses, the scan picks the bins that must hold the answer: through
// the top-k bin when k truncates, else through the first bin whose bounded running mass reaches
// the top-p target, or without top-p the draw's. Their elements are compacted into shared memory
// (at most SAMPLE_CAP), sorted by (key, id), and the three rules run exactly on that sorted
// prefix with f64 prefix sums, the row's total mass standing for the untruncated set. Rows whose
// prefix is larger than SAMPLE_CAP, or whose answer lies past it, take the radix path above.
// sample_row sends only rows whose top-k truncates this way: without one, the mass bound is too
// loose on flat logits (tens of thousands of candidates) and the fallback costs more than it saves.

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
        // At the first level, lanes that fall in the same bin add their count (and mass) once,
        // through the lowest of them: a row's values crowd into a few exponent bins.
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
            const unsigned peers = __match_any_sync(0xffffffffu, b);
            const bool leader = take && lane == __ffs(peers) - 1;
            if (leader) atomicAdd(&sh.cnt[b], (unsigned)__popc(peers));
            if (by_mass) {
                const double m = take ? exp((double)(v - vmax)) : 0.0;
                double sum = 0.0;
                for (int j = 0; j < 32; ++j) {
                    const double o = __shfl_sync(0xffffffffu, m, j);
                    if ((peers >> j) & 1u) sum += o;
                }
                if (leader) atomicAdd(&sh.mass[b], sum);
            }
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
#define SAMPLE_CAP 4096
#endif
#define PER_THREAD (SAMPLE_CAP / SAMPLE_THREADS)
static_assert(SAMPLE_CAP % SAMPLE_THREADS == 0 && (SAMPLE_CAP & (SAMPLE_CAP - 1)) == 0,
              "the candidate capacity is a power of two and a multiple of the block");

// The compacted prefix: (key << 32 | id) ascending is the sampling order, then the inclusive
// prefix sums of the masses in that order.
struct PrefixShared {
    unsigned long long cand[SAMPLE_CAP];
    double cum[SAMPLE_CAP];
    unsigned count;
    int hit;
};

__device__ __forceinline__ float key_value(unsigned key) {
    const unsigned x = ~key;
    return __uint_as_float((x >> 31) ? (x ^ 0x80000000u) : (x ^ 0xffffffffu));
}

// The first index i < len with cum[i] ≥ target (or > when strict), or -1.
__device__ int first_reaching(PrefixShared& ps, int len, double target, bool strict) {
    const int tid = threadIdx.x;
    int& hit = ps.hit;
    if (tid == 0) hit = 0x7fffffff;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid * PER_THREAD + j;
        if (i < len && (strict ? ps.cum[i] > target : ps.cum[i] >= target)) {
            atomicMin(&hit, i);
            break;
        }
    }
    __syncthreads();
    const int h = hit;
    __syncthreads();
    return h == 0x7fffffff ? -1 : h;
}

// Samples the row from its compacted prefix; false (nothing written) when the row needs the
// radix path. n > 0 non-NaN values, the largest vmax.
template <typename T>
__device__ bool sample_prefix(const T* row, int vocab, float temp, float vmax, unsigned n,
                              unsigned k, float p, double u, SampleShared& sh, unsigned* out) {
    extern __shared__ __align__(16) unsigned char sample_dyn[];
    PrefixShared& ps = *reinterpret_cast<PrefixShared*>(sample_dyn);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < BINS; i += SAMPLE_THREADS) sh.cnt[i] = 0;
    __syncthreads();
    // The row's total mass is needed only when top-k does not truncate.
    const bool truncate_k = k > 0 && k < n;
    double own = 0.0;
    for_row(row, vocab, [&](int i, float raw) {
        const float v = raw / temp;
        const bool take = i < vocab && v == v;
        const unsigned b = take ? order_key(v) >> 21 : BINS;
        if (__ballot_sync(0xffffffffu, take) == 0) return;
        const unsigned peers = __match_any_sync(0xffffffffu, b);
        if (take && lane == __ffs(peers) - 1) atomicAdd(&sh.cnt[b], (unsigned)__popc(peers));
        if (!truncate_k && take) own += exp((double)(v - vmax));
    });
    for (int o = 16; o > 0; o >>= 1) own += __shfl_xor_sync(0xffffffffu, own, o);
    __shared__ double warp_sum[SAMPLE_WARPS];
    if (lane == 0) warp_sum[warp] = own;
    __syncthreads();
    if (tid < 32) {
        // The last bin of the prefix: the top-k bin when k truncates (the top-k set is then all
        // there), else the first bin whose lower-bounded running mass reaches the top-p target,
        // or without top-p the draw's (each at most its value over the whole row). Only a speed
        // choice: the exact rules below fall back when their answer lies past the prefix.
        constexpr int PER = BINS / 32;
        double total = 0.0;
        for (int w = 0; w < SAMPLE_WARPS; ++w) total += warp_sum[w];
        unsigned c = 0;
        double m = 0.0;
        for (int j = 0; j < PER; ++j) {
            const unsigned b = lane * PER + j, nb = sh.cnt[b];
            c += nb;
            if (nb > 0 && !truncate_k) {
                // The bin's smallest value: its largest key (NaN patterns bound nothing).
                const float lo = key_value((b << 21) | 0x1fffffu);
                m += lo == lo ? nb * exp((double)(lo - vmax)) : 0.0;
            }
            sh.mass[b] = m;
        }
        __syncwarp();
        unsigned ci = c;
        double mi = m;
        warp_scan(ci, mi);
        // The first non-empty bin whose running count or bounded mass reaches the goal, and the
        // count through it; the last bin when none does.
        auto reach = [&](bool by_mass, double goal, unsigned& cnt_through) {
            const bool r = by_mass ? mi >= goal : (double)ci >= goal;
            const unsigned any = __ballot_sync(0xffffffffu, r && c > 0);
            int bin = BINS - 1;
            cnt_through = __shfl_sync(0xffffffffu, ci, 31);
            if (any) {
                const int l = __ffs(any) - 1;
                unsigned rc = __shfl_sync(0xffffffffu, ci - c, l);
                const double rm = __shfl_sync(0xffffffffu, mi - m, l);
                bin = l * PER + PER - 1;
                unsigned through = rc;
                for (int j = 0; j < PER; ++j) {
                    const int b = l * PER + j;
                    through += sh.cnt[b];
                    // sh.mass holds the lane's running bounded mass within its bins.
                    const bool r = by_mass ? rm + sh.mass[b] >= goal : (double)through >= goal;
                    if (sh.cnt[b] > 0 && r) {
                        bin = b;
                        break;
                    }
                }
                cnt_through = through;
            }
            return bin;
        };
        unsigned cnt_through = n;
        int last = BINS - 1;
        if (truncate_k) {
            last = reach(false, (double)k, cnt_through);
        } else {
            // A top-p set must lie within the prefix whole (its mass scales the draw).
            if (p < 1.0f)
                last = reach(true, (double)p * total * (1.0 + 1e-9), cnt_through);
            else
                last = reach(true, u * total * (1.0 + 1e-9), cnt_through);
        }
        if (lane == 0) {
            sh.prefix = (unsigned)last;
            sh.before_cnt = cnt_through;
            sh.before_mass = total;
            ps.count = 0;
        }
    }
    __syncthreads();
    const unsigned last = sh.prefix;
    const unsigned len = (unsigned)sh.before_cnt;
    const double row_mass = sh.before_mass;
    const bool more = len < n;
    __syncthreads();
    if (len > SAMPLE_CAP) return false;

    // Compact the prefix's elements, in any order.
    for_row(row, vocab, [&](int i, float raw) {
        const float v = raw / temp;
        const unsigned key = order_key(v);
        const bool take = i < vocab && v == v && (key >> 21) <= last;
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
    if (ps.count != len) return false;
    const int cnt = (int)len;
    int pow2 = 32;
    while (pow2 < cnt) pow2 <<= 1;
    for (int i = cnt + tid; i < pow2; i += SAMPLE_THREADS) ps.cand[i] = ~0ull;
    __syncthreads();
    // Bitonic sort of the first pow2 entries, ascending.
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
    // Inclusive prefix sums of exp(value - max) in order: PER_THREAD consecutive per thread.
    double run[PER_THREAD];
    double local = 0.0;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = tid * PER_THREAD + j;
        const double mj =
            i < cnt ? exp((double)(key_value((unsigned)(ps.cand[i] >> 32)) - vmax)) : 0.0;
        local += mj;
        run[j] = local;
    }
    double scan = local;
    for (int o = 1; o < 32; o <<= 1) {
        const double x = __shfl_up_sync(0xffffffffu, scan, o);
        if (lane >= o) scan += x;
    }
    __syncthreads();
    if (lane == 31) warp_sum[warp] = scan;
    __syncthreads();
    double offset = scan - local;
    for (int w = 0; w < warp; ++w) offset += warp_sum[w];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) ps.cum[tid * PER_THREAD + j] = offset + run[j];
    __syncthreads();

    // The kept prefix [0, keep) and its mass; `open` while elements past the compacted prefix
    // still belong to it.
    int keep = cnt;
    bool open = more;
    if (truncate_k) {
        if ((unsigned)cnt < k) return false;
        keep = (int)k;
        open = false;
    }
    double mass = open ? row_mass : ps.cum[keep - 1];
    if (p < 1.0f) {
        const int i = first_reaching(ps, keep, (double)p * mass, false);
        if (i < 0 && open) return false;
        keep = i < 0 ? keep : i + 1;
        open = false;
        mass = ps.cum[keep - 1];
    }
    const int i = first_reaching(ps, keep, u * mass, true);
    if (i < 0 && open) return false;
    if (tid == 0) out[0] = (unsigned)(ps.cand[i < 0 ? keep - 1 : i] & 0xffffffffu);
    return true;
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
    const bool greedy = !(t > 0.0f);
    const float temp = greedy ? 1.0f : t;
    // Values are logit / t, divided as the CPU does (a product with 1/t rounds differently).
    // Pass 1: the largest value and the number of non-NaN candidates.
    float vmax = -__int_as_float(0x7f800000);
    unsigned n = 0;
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
    Pos bound{0xffffffffu, 0xffffffffu};
    if (greedy) {
        // The lowest id holding the largest value: one pass (n > 0, so vmax is a value).
        unsigned best = 0xffffffffu;
        for_row(row, vocab, [&](int i, float v) {
            if (i < vocab && v == vmax) best = min(best, (unsigned)i);
        });
        for (int o = 16; o > 0; o >>= 1) best = min(best, __shfl_xor_sync(0xffffffffu, best, o));
        if (lane == 0) sh.warp_cnt[warp] = best;
        __syncthreads();
        if (tid == 0) {
            for (int w = 0; w < SAMPLE_WARPS; ++w) best = min(best, sh.warp_cnt[w]);
            out[r] = best;
        }
        return;
    } else {
        const unsigned k = top_k[r];
        const float p = top_p[r];
        // The prefix path for a truncating top-k (see the top of the file).
        if (k > 0 && k < n &&
            sample_prefix(row, vocab, temp, vmax, n, k, p, uniform[r], sh, out + r))
            return;
        if (k > 0 && k < n) bound = select(row, vocab, temp, vmax, bound, false, (double)k, sh);
        if (p < 1.0f) bound = select(row, vocab, temp, vmax, bound, true, (double)p, sh);
        bound = select(row, vocab, temp, vmax, bound, true, uniform[r], sh);
    }
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
