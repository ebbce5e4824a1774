// Sampling on the GPU, part three (after sample_prefix.cu, as one translation unit): the bin path
// of rows without a top-k cut, greedy rows, and the kernels.

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
