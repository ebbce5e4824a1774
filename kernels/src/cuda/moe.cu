// MoE decode for small batches (1-64 tokens): routing, the expert plan, gate+up+SiTU fused, the
// down projection and the weighted combine. Experts in bf16 or MXFP4 (w4a16: packed E2M1 codes
// with one E8M0 scale per 32 inputs, dequantised in registers as the weights stream in).
//
// moe_route: one block per token. scores = sigmoid(logits), choice = scores + bias; the top_k
//   experts by choice (NaN as -inf, ties to the lower index), written in descending order and
//   weighted by their scores, renormalised by (sum + 1e-20) in slot order, times `scaling` — the
//   CPU backend's route_sigmoid_grouped with one group (K3's n_group = 1). The last block to
//   finish then makes the plan: the distinct experts of the batch in ascending order, each with
//   its (token, slot) pairs: every expert's weights are then read once per step.
// moe_gate_up_*: block (column tile, active expert); a warp per output column streams the gate
//   and up rows of that column (16-byte vectors over the input) against the inputs of the
//   expert's tokens, then h = situ(gate, up) in bf16 for each (token, slot) pair.
// moe_down_*: block (column tile, active expert); y[pair, n] = W2[n, :] · h[pair, :] in f32.
// moe_gate_up_tc_*, moe_down_tc_*: the same two projections on the tensor cores, a warp per 16
//   output rows and 8 tokens of the expert per pass (moe_tc.cu, compiled after this file; the
//   default path — the column kernels stay for measurements, TESSERA_MOE_PATH=columns).
// moe_combine: out[b, n] = Σ_slot w[b, slot] · y[b·k + slot, n] in slot order, bf16.
//
// Layouts: x [B, DIN] bf16; bf16 experts w_gate/w_up [E, DI, DIN], w_down [E, DIN, DI]; MXFP4
// experts the same shapes as packed u8 [.., in/2] (element j in byte j/2, low nibble first) and
// scales u8 [.., in/32] (2^(s-127); 0 is 2^-127, 255 NaN).

#ifndef MOE_WARPS
#define MOE_WARPS 4
#endif
#ifndef MOE_COLS_PER_WARP
#define MOE_COLS_PER_WARP 2
#endif
#define MOE_THREADS (MOE_WARPS * 32)
// Blocks per SM the register budget must allow: enough warps in flight to cover HBM latency.
#ifndef MOE_MIN_BLOCKS
#define MOE_MIN_BLOCKS 4
#endif
#define MOE_COLS (MOE_WARPS * MOE_COLS_PER_WARP)
// Most (token, slot) pairs one expert serves in a call: the batch bound (a token picks an expert
// at most once).
#ifndef MOE_MAXT
#define MOE_MAXT 64
#endif
// Routing: threads per token, and experts per thread (ceil(experts / 256), set per model from the
// host; at most 4).
#define ROUTE_THREADS 256
// Timing probes of the routing kernel, for `cuda_model_ops_check` variants `probe_route{1,2,3}`
// only (no plan is made): it stops after the scores (1), after the radix select (2), or before
// the plan (3).
#ifndef MOE_ROUTE_PROBE
#define MOE_ROUTE_PROBE 0
#endif
#ifndef ROUTE_PER_THREAD
#define ROUTE_PER_THREAD 4
#endif
// How a token's top_k experts are chosen: 0, a radix select over the block then a ranking of
// the taken; 1, warp lists (each warp pops its best top_k, then one warp pops the best top_k of
// those, already ranked), for top_k up to ROUTE_LIST_MAX (larger top_k take the radix select).
#ifndef MOE_ROUTE_SELECT
#define MOE_ROUTE_SELECT 0
#endif
#define ROUTE_LIST_MAX 32
// 1: the routing kernel lets its dependent (the gate/up projections) launch as soon as it has
// waited for its own input, so that their blocks are resident and waiting when the plan is out.
#ifndef MOE_ROUTE_TRIGGER
#define MOE_ROUTE_TRIGGER 0
#endif

// ---------------------------------------------------------------------------------------------
// Routing and plan

// moe_route: one block per token, ROUTE_PER_THREAD consecutive experts per thread, each choice
// as an order-preserving integer key; the top_k keys are chosen and ranked by (choice
// descending, expert ascending) into the slots, by a radix select (four rounds of an 8-bit digit
// histogram in shared memory) or by warp lists (MOE_ROUTE_SELECT).
__device__ __forceinline__ unsigned order_key(float c) {
    const unsigned b = __float_as_uint(c == 0.0f ? 0.0f : c);  // -0 and +0 tie
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Inclusive prefix sum of v over the warp's lanes.
__device__ __forceinline__ unsigned warp_incl_scan(unsigned v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// Exclusive prefix sum of v over a block of THREADS threads in thread order; `total` gets the
// block's sum. s_warp holds THREADS / 32 values; every thread must call it.
template <int THREADS>
__device__ __forceinline__ unsigned block_excl_scan(unsigned v, unsigned* s_warp, unsigned& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned incl = warp_incl_scan(v);
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    unsigned before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) {
        const unsigned x = s_warp[w];
        before += w < warp ? x : 0u;
        total += x;
    }
    return before + incl - v;
}

// The plan, by the 256 threads of one block: n_active, then per active expert a: expert id,
// token count, and the pair ids (b·k+slot) of idx[0..pairs) (other blocks' writes: read from L2).
// Experts are numbered in ascending order by a block-wide scan (each thread owns a run of
// consecutive experts); pairs join their expert's list through shared-memory counters, so the
// order within a list is arbitrary — every pair's output is computed on its own, whatever its
// place in the list. s_slot and s_count hold `experts` ints each.
#define PLAN_THREADS ROUTE_THREADS
#define PLAN_OUT_ARGS                                                                          \
    int *__restrict__ n_active, int *__restrict__ act_expert, int *__restrict__ act_count,      \
        int *__restrict__ act_pairs
__device__ __forceinline__ void plan_block(const unsigned* idx, int pairs, int experts,
                                           int* __restrict__ n_active, int* __restrict__ act_expert,
                                           int* __restrict__ act_count, int* __restrict__ act_pairs,
                                           int* s_slot, int* s_count, unsigned* s_warp) {
    const int tid = threadIdx.x;
    for (int e = tid; e < experts; e += PLAN_THREADS) s_slot[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += PLAN_THREADS) s_slot[__ldcg(idx + p)] = 1;
    __syncthreads();
    const int per = (experts + PLAN_THREADS - 1) / PLAN_THREADS, e0 = tid * per;
    int mine = 0;
    for (int e = e0; e < min(e0 + per, experts); ++e) mine += s_slot[e];
    unsigned total;
    int n = (int)block_excl_scan<PLAN_THREADS>((unsigned)mine, s_warp, total);
    for (int e = e0; e < min(e0 + per, experts); ++e) {
        if (s_slot[e]) {
            act_expert[n] = e;
            s_count[n] = 0;
            s_slot[e] = n++;
        } else {
            s_slot[e] = -1;
        }
    }
    if (tid == PLAN_THREADS - 1) *n_active = n;
    __syncthreads();
    for (int p = tid; p < pairs; p += PLAN_THREADS) {
        const int a = s_slot[__ldcg(idx + p)];
        const int c = atomicAdd(&s_count[a], 1);
        if (c < MOE_MAXT) act_pairs[a * MOE_MAXT + c] = p;
    }
    __syncthreads();
    for (int a = tid; a < (int)total; a += PLAN_THREADS) act_count[a] = s_count[a];
}

// The ranked choice of one token by the ROUTE_THREADS threads of its block, each holding the
// keys and scores of experts e0 .. e0 + ROUTE_PER_THREAD (key 0 past the experts): the taken
// experts into s_idx[0..top_k) in slot order (choice descending, expert ascending), their
// scores into s_w. The caller puts a barrier after it.
//
// By a radix select: `prefix` holds the digits chosen so far and `need` the rank of the
// top_k-th largest key among the keys that share them (most significant digit first); the keys
// above it are taken with the lowest-numbered ones at it (a block-wide scan in expert order
// places each in a compact list), and the taken are ranked by (choice, expert).
__device__ __forceinline__ void route_rank_radix(const unsigned (&key)[ROUTE_PER_THREAD],
                                                 const float (&score)[ROUTE_PER_THREAD], int e0,
                                                 int top_k, unsigned* hist, unsigned* s_warp,
                                                 unsigned* s_sel, unsigned* s_key, int* s_exp,
                                                 float* s_score, unsigned* s_idx, float* s_w) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned prefix = 0u, need = (unsigned)top_k;
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[tid] = 0u;
        __syncthreads();
        const unsigned high = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
#pragma unroll
        for (int i = 0; i < ROUTE_PER_THREAD; ++i)
            if ((key[i] & high) == prefix) atomicAdd(&hist[(key[i] >> shift) & 255u], 1u);
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 - 8l .. 248 - 8l, so lanes run from the largest digit down.
            unsigned c[8], sum = 0u;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[255 - 8 * lane - j];
                sum += c[j];
            }
            const unsigned incl = warp_incl_scan(sum);
            unsigned acc = incl - sum;
            if (acc < need && need <= incl) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (acc + c[j] >= need) {
                        s_sel[0] = prefix | ((255u - 8u * lane - j) << shift);
                        s_sel[1] = need - acc;
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        prefix = s_sel[0];
        need = s_sel[1];
    }
    if (MOE_ROUTE_PROBE == 2) {
        if (tid == 0) s_idx[0] = prefix ^ need;
        return;
    }
    // prefix is the top_k-th largest key; `need` of the keys equal to it are taken.
    const unsigned t = prefix, ties = need;
    unsigned above = 0u, eq = 0u;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_THREAD; ++i) {
        above += key[i] > t;
        eq += key[i] == t;
    }
    unsigned total;
    const unsigned before = block_excl_scan<ROUTE_THREADS>((eq << 16) | above, s_warp, total);
    unsigned eq_seen = before >> 16, at = (before & 0xffffu) + min(before >> 16, ties);
#pragma unroll
    for (int i = 0; i < ROUTE_PER_THREAD; ++i) {
        const bool take = key[i] > t || (key[i] == t && eq_seen < ties);
        eq_seen += key[i] == t;
        if (take) {
            s_key[at] = key[i];
            s_exp[at] = e0 + i;
            s_score[at] = score[i];
            ++at;
        }
    }
    __syncthreads();
    for (int j = tid; j < top_k; j += ROUTE_THREADS) {
        const unsigned kj = s_key[j];
        const int ej = s_exp[j];
        int rank = 0;
        for (int m = 0; m < top_k; ++m) rank += s_key[m] > kj || (s_key[m] == kj && s_exp[m] < ej);
        s_idx[rank] = (unsigned)ej;
        s_w[rank] = s_score[j];
    }
}

// Pops a warp's best entry top_k times: each lane holds N entries best first (key descending,
// expert ascending), the lanes in expert order for equal keys, so the lowest lane holding the
// warp's largest key has the lowest expert of that key. Entry j goes to out_key/out_exp/
// out_score[j] (those null are skipped).
template <int N>
__device__ __forceinline__ void warp_pop_best(unsigned (&key)[N], int (&ex)[N], float (&sc)[N],
                                              int top_k, unsigned* out_key, int* out_exp,
                                              float* out_score) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int j = 0; j < top_k; ++j) {
        const unsigned best = __reduce_max_sync(0xffffffffu, key[0]);
        const int from = __ffs(__ballot_sync(0xffffffffu, key[0] == best)) - 1;
        if (lane == from) {
            if (out_key) out_key[j] = key[0];
            out_exp[j] = ex[0];
            out_score[j] = sc[0];
#pragma unroll
            for (int i = 0; i + 1 < N; ++i) {
                key[i] = key[i + 1];
                ex[i] = ex[i + 1];
                sc[i] = sc[i + 1];
            }
            key[N - 1] = 0u;
        }
    }
}

// The best top_k of the warps' lists (SPAN ≥ top_k entries of each read) in slot order, by
// warp 0: lane l reads LANE entries of list l / (SPAN / LANE) from (l · LANE) % SPAN on, best
// first; a lower lane holds lower experts for equal keys, as the warps' experts ascend with the
// warp.
template <int SPAN>
__device__ __forceinline__ void merge_lists(int top_k, const unsigned* s_key, const int* s_exp,
                                            const float* s_score, unsigned* s_idx, float* s_w) {
    constexpr int LANE = (ROUTE_THREADS / 32) * SPAN / 32;
    static_assert(LANE * 32 == (ROUTE_THREADS / 32) * SPAN, "list layout");
    const int lane = threadIdx.x & 31;
    const int list = lane * LANE / SPAN, first = lane * LANE % SPAN;
    unsigned k[LANE];
    int x[LANE];
    float c[LANE];
#pragma unroll
    for (int i = 0; i < LANE; ++i) {
        const int q = first + i, p = list * ROUTE_LIST_MAX + q;
        const bool listed = q < top_k;
        k[i] = listed ? s_key[p] : 0u;
        x[i] = listed ? s_exp[p] : 0;
        c[i] = listed ? s_score[p] : 0.0f;
    }
    warp_pop_best<LANE>(k, x, c, top_k, nullptr, reinterpret_cast<int*>(s_idx), s_w);
}

// By warp lists (top_k ≤ ROUTE_LIST_MAX): each thread sorts its own experts, each warp pops
// its best top_k into its list (s_key/s_exp/s_score[warp · ROUTE_LIST_MAX ..]), then warp 0
// pops the best top_k of the lists, already in slot order (four entries a lane up to top_k 16,
// eight beyond).
__device__ __forceinline__ void route_rank_lists(unsigned (&key)[ROUTE_PER_THREAD],
                                                 float (&score)[ROUTE_PER_THREAD], int e0,
                                                 int top_k, unsigned* s_key, int* s_exp,
                                                 float* s_score, unsigned* s_idx, float* s_w) {
    constexpr int PER = ROUTE_PER_THREAD;
    const int warp = threadIdx.x >> 5;
    int ex[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) ex[i] = e0 + i;
    // A stable sort by key, descending: equal keys keep their experts ascending.
#pragma unroll
    for (int pass = 0; pass + 1 < PER; ++pass) {
#pragma unroll
        for (int i = 0; i + 1 < PER - pass; ++i) {
            if (key[i + 1] > key[i]) {
                const unsigned k = key[i];
                key[i] = key[i + 1];
                key[i + 1] = k;
                const int x = ex[i];
                ex[i] = ex[i + 1];
                ex[i + 1] = x;
                const float c = score[i];
                score[i] = score[i + 1];
                score[i + 1] = c;
            }
        }
    }
    const int list = warp * ROUTE_LIST_MAX;
    warp_pop_best<PER>(key, ex, score, top_k, s_key + list, s_exp + list, s_score + list);
    __syncthreads();
    if (warp != 0) return;
    if (top_k <= ROUTE_LIST_MAX / 2)
        merge_lists<ROUTE_LIST_MAX / 2>(top_k, s_key, s_exp, s_score, s_idx, s_w);
    else
        merge_lists<ROUTE_LIST_MAX>(top_k, s_key, s_exp, s_score, s_idx, s_w);
}

// moe_route (see above) may go out as a dependent launch: nothing is read before it waits for
// the kernel before it (the logits' writer), and the logits and bias are read through L2.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
          unsigned* __restrict__ idx, float* __restrict__ weight, int experts, int top_k,
          int renormalize, float scaling, unsigned* __restrict__ done, PLAN_OUT_ARGS) {
    grid_dep_wait();
    if (MOE_ROUTE_TRIGGER) grid_dep_launch();
    constexpr int CAP = ROUTE_THREADS * ROUTE_PER_THREAD;
    static_assert(CAP >= (ROUTE_THREADS / 32) * ROUTE_LIST_MAX, "the warp lists fit the arrays");
    __shared__ unsigned hist[256];
    __shared__ unsigned s_warp[ROUTE_THREADS / 32];
    __shared__ unsigned s_sel[2];
    __shared__ unsigned s_key[CAP];
    __shared__ int s_exp[CAP];
    __shared__ float s_score[CAP];
    __shared__ unsigned s_idx[CAP];
    __shared__ float s_w[CAP];
    __shared__ bool s_last;
    const int b = blockIdx.x, tid = threadIdx.x;
    const float* lg = logits + (size_t)b * experts;
    const float ninf = -__int_as_float(0x7f800000);
    const int e0 = tid * ROUTE_PER_THREAD;
    unsigned key[ROUTE_PER_THREAD];  // 0: past the experts (below every choice, -inf included)
    float score[ROUTE_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_THREAD; ++i) {
        const int e = e0 + i;
        key[i] = 0u;
        score[i] = 0.0f;
        if (e < experts) {
            score[i] = 1.0f / (1.0f + expf(-__ldcg(lg + e)));
            const float c = score[i] + __ldcg(bias + e);
            key[i] = order_key(c != c ? ninf : c);
        }
    }
    if (MOE_ROUTE_PROBE == 1) {
        if (key[0] == 0x12345678u) idx[0] = __float_as_uint(score[0]);  // keeps the loads
        return;
    }
    if (MOE_ROUTE_SELECT == 1 && top_k <= ROUTE_LIST_MAX)
        route_rank_lists(key, score, e0, top_k, s_key, s_exp, s_score, s_idx, s_w);
    else
        route_rank_radix(key, score, e0, top_k, hist, s_warp, s_sel, s_key, s_exp, s_score, s_idx,
                         s_w);
    if (MOE_ROUTE_PROBE == 2) {
        if (tid == 0 && s_idx[0] == 0x12345678u) idx[0] = 0u;  // keeps the choice
        return;
    }
    __syncthreads();
    if (tid < top_k) {
        // Every writer sums the weights in slot order, as the CPU router does.
        float denom = 0.0f;
        for (int j = 0; j < top_k; ++j) denom += s_w[j];
        denom += 1e-20f;
        for (int j = tid; j < top_k; j += ROUTE_THREADS) {
            const float w = renormalize ? s_w[j] / denom : s_w[j];
            idx[(size_t)b * top_k + j] = s_idx[j];
            weight[(size_t)b * top_k + j] = w * scaling;
        }
    }
    if (MOE_ROUTE_PROBE == 3) return;
    // The last block to finish plans the pass over every token's choices (`done` counts the
    // finished blocks and is back at zero for the next call), in the route's shared arrays. A
    // single block (batch 1) plans straight from its own choices: its top_k experts are
    // distinct, each serving the one pair of its slot (the plan's order of experts is free).
    if (gridDim.x == 1) {
        for (int j = tid; j < top_k; j += ROUTE_THREADS) {
            act_expert[j] = (int)s_idx[j];
            act_count[j] = 1;
            act_pairs[j * MOE_MAXT] = j;
        }
        if (tid == 0) *n_active = top_k;
        return;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    plan_block(idx, (int)gridDim.x * top_k, experts, n_active, act_expert, act_count, act_pairs,
               s_exp, reinterpret_cast<int*>(s_key), s_warp);
    if (tid == 0) *done = 0u;
}

// ---------------------------------------------------------------------------------------------
// Weight formats: a 16-byte vector of a weight row and its dot product with bf16 inputs.

struct Bf16Weights {
    static constexpr int PER_VEC = 8;  // weights per 16-byte vector
    static constexpr int TG = 4;       // tokens per register group
    struct Vec {
        uint4 w;
    };
    const uint4* rows;  // [E · out, in / 8]
    __device__ __forceinline__ Vec load(size_t row, int v, int in_dim) const {
        return Vec{__ldg(rows + row * (in_dim / 8) + v)};
    }
    __device__ __forceinline__ float dot(const Vec& vec, int v, const bf16_t* x) const {
        const uint4 w = vec.w;
        const uint4 xv = *reinterpret_cast<const uint4*>(x + v * 8);
        float s = lo_bf(w.x) * lo_bf(xv.x);
        s = fmaf(hi_bf(w.x), hi_bf(xv.x), s);
        s = fmaf(lo_bf(w.y), lo_bf(xv.y), s);
        s = fmaf(hi_bf(w.y), hi_bf(xv.y), s);
        s = fmaf(lo_bf(w.z), lo_bf(xv.z), s);
        s = fmaf(hi_bf(w.z), hi_bf(xv.z), s);
        s = fmaf(lo_bf(w.w), lo_bf(xv.w), s);
        return fmaf(hi_bf(w.w), hi_bf(xv.w), s);
    }
};

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// 8 codes of one device word (cuda/mxfp4.rs) against 8 bf16 inputs in order: pair k of
// `mxfp4_pairs` holds elements k and k + 4, each brought back to its own value before its product.
__device__ __forceinline__ float dot8_fp4(unsigned w, uint4 xv, float s) {
    unsigned b[4];
    mxfp4_pairs(w, b);
    const float u = MXFP4_UNSCALE;
    s = fmaf(lo_bf(b[0]) * u, lo_bf(xv.x), s);
    s = fmaf(hi_bf(b[0]) * u, lo_bf(xv.z), s);
    s = fmaf(lo_bf(b[1]) * u, hi_bf(xv.x), s);
    s = fmaf(hi_bf(b[1]) * u, hi_bf(xv.z), s);
    s = fmaf(lo_bf(b[2]) * u, lo_bf(xv.y), s);
    s = fmaf(hi_bf(b[2]) * u, lo_bf(xv.w), s);
    s = fmaf(lo_bf(b[3]) * u, hi_bf(xv.y), s);
    return fmaf(hi_bf(b[3]) * u, hi_bf(xv.w), s);
}

struct Mxfp4Weights {
    static constexpr int PER_VEC = 32;  // one scale group per 16-byte vector
    static constexpr int TG = 1;        // decoded codes take registers too
    struct Vec {
        uint4 w;
        float scale;
    };
    const uint4* rows;            // [E · out, in / 32] vectors of packed codes
    const unsigned char* scales;  // [E · out, in / 32]
    __device__ __forceinline__ Vec load(size_t row, int v, int in_dim) const {
        const size_t at = row * (in_dim / 32) + v;
        return Vec{__ldg(rows + at), e8m0(__ldg(scales + at))};
    }
    __device__ __forceinline__ float dot(const Vec& vec, int v, const bf16_t* x) const {
        const uint4* xv = reinterpret_cast<const uint4*>(x + v * 32);
        float s = dot8_fp4(vec.w.x, xv[0], 0.0f);
        s = dot8_fp4(vec.w.y, xv[1], s);
        s = dot8_fp4(vec.w.z, xv[2], s);
        s = dot8_fp4(vec.w.w, xv[3], s);
        return s * vec.scale;
    }
};

__device__ __forceinline__ float situ(float g, float u, float b1, float b2) {
    const float sig = 1.0f / (1.0f + expf(-g));
    return (b1 * tanhf(g / b1) * sig) * (b2 * tanhf(u / b2));
}

// ---------------------------------------------------------------------------------------------
// Expert projections, organised by output column.

template <typename W>
__device__ __forceinline__ void gate_up(W wg, W wu, const bf16_t* __restrict__ x,
                                        const int* __restrict__ n_active,
                                        const int* __restrict__ act_expert,
                                        const int* __restrict__ act_count,
                                        const int* __restrict__ act_pairs, bf16_t* __restrict__ h,
                                        int din, int di, int top_k, float b1, float b2) {
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = act_expert[a], nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const int vecs = din / W::PER_VEC;
    for (int cw = 0; cw < MOE_COLS_PER_WARP; ++cw) {
        const int c = blockIdx.x * MOE_COLS + warp * MOE_COLS_PER_WARP + cw;
        if (c >= di) return;
        const size_t row = (size_t)e * di + c;
        // Tokens in groups of W::TG (accumulators in registers); a later group re-reads the
        // column's weights from L1/L2, and an expert rarely has more than one group per step.
        for (int t0 = 0; t0 < nt; t0 += W::TG) {
            float g[W::TG], u[W::TG];
#pragma unroll
            for (int t = 0; t < W::TG; ++t) g[t] = u[t] = 0.0f;
#pragma unroll 1
            for (int v = lane; v < vecs; v += 32) {
                const typename W::Vec gv = wg.load(row, v, din), uv = wu.load(row, v, din);
#pragma unroll
                for (int t = 0; t < W::TG; ++t) {
                    if (t0 + t < nt) {
                        const bf16_t* xt = x + (size_t)(pairs[t0 + t] / top_k) * din;
                        g[t] += wg.dot(gv, v, xt);
                        u[t] += wu.dot(uv, v, xt);
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < W::TG; ++t) {
                if (t0 + t < nt) {
                    const float gs = warp_sum(g[t]), us = warp_sum(u[t]);
                    if (lane == 0) h[(size_t)pairs[t0 + t] * di + c] = f2bf(situ(gs, us, b1, b2));
                }
            }
        }
    }
}

template <typename W>
__device__ __forceinline__ void down(W wd, const bf16_t* __restrict__ h,
                                     const int* __restrict__ n_active,
                                     const int* __restrict__ act_expert,
                                     const int* __restrict__ act_count,
                                     const int* __restrict__ act_pairs, float* __restrict__ y,
                                     int din, int di) {
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = act_expert[a], nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const int vecs = di / W::PER_VEC;
    for (int cw = 0; cw < MOE_COLS_PER_WARP; ++cw) {
        const int n = blockIdx.x * MOE_COLS + warp * MOE_COLS_PER_WARP + cw;
        if (n >= din) return;
        const size_t row = (size_t)e * din + n;
        for (int t0 = 0; t0 < nt; t0 += W::TG) {
            float acc[W::TG];
#pragma unroll
            for (int t = 0; t < W::TG; ++t) acc[t] = 0.0f;
#pragma unroll 1
            for (int v = lane; v < vecs; v += 32) {
                const typename W::Vec wv = wd.load(row, v, di);
#pragma unroll
                for (int t = 0; t < W::TG; ++t)
                    if (t0 + t < nt) acc[t] += wd.dot(wv, v, h + (size_t)pairs[t0 + t] * di);
            }
#pragma unroll
            for (int t = 0; t < W::TG; ++t) {
                if (t0 + t < nt) {
                    const float s = warp_sum(acc[t]);
                    if (lane == 0) y[(size_t)pairs[t0 + t] * din + n] = s;
                }
            }
        }
    }
}

#define PLAN_ARGS                                                                              \
    const int *__restrict__ n_active, const int *__restrict__ act_expert,                      \
        const int *__restrict__ act_count, const int *__restrict__ act_pairs

extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_MIN_BLOCKS)
moe_gate_up_bf16(const bf16_t* __restrict__ w_gate, const bf16_t* __restrict__ w_up,
                 const bf16_t* __restrict__ x, PLAN_ARGS, bf16_t* __restrict__ h, int din, int di,
                 int top_k, float b1, float b2) {
    gate_up(Bf16Weights{reinterpret_cast<const uint4*>(w_gate)},
            Bf16Weights{reinterpret_cast<const uint4*>(w_up)}, x, n_active, act_expert, act_count,
            act_pairs, h, din, di, top_k, b1, b2);
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_MIN_BLOCKS)
moe_gate_up_mxfp4(const unsigned char* __restrict__ gate_packed,
                  const unsigned char* __restrict__ gate_scale,
                  const unsigned char* __restrict__ up_packed,
                  const unsigned char* __restrict__ up_scale, const bf16_t* __restrict__ x,
                  PLAN_ARGS, bf16_t* __restrict__ h, int din, int di, int top_k, float b1,
                  float b2) {
    gate_up(Mxfp4Weights{reinterpret_cast<const uint4*>(gate_packed), gate_scale},
            Mxfp4Weights{reinterpret_cast<const uint4*>(up_packed), up_scale}, x, n_active,
            act_expert, act_count, act_pairs, h, din, di, top_k, b1, b2);
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_MIN_BLOCKS)
moe_down_bf16(const bf16_t* __restrict__ w_down, const bf16_t* __restrict__ h, PLAN_ARGS,
              float* __restrict__ y, int din, int di) {
    down(Bf16Weights{reinterpret_cast<const uint4*>(w_down)}, h, n_active, act_expert, act_count,
         act_pairs, y, din, di);
}

extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_MIN_BLOCKS)
moe_down_mxfp4(const unsigned char* __restrict__ down_packed,
               const unsigned char* __restrict__ down_scale, const bf16_t* __restrict__ h,
               PLAN_ARGS, float* __restrict__ y, int din, int di) {
    down(Mxfp4Weights{reinterpret_cast<const uint4*>(down_packed), down_scale}, h, n_active,
         act_expert, act_count, act_pairs, y, din, di);
}

extern "C" __global__ void __launch_bounds__(256)
moe_combine(const float* __restrict__ y, const float* __restrict__ weight,
            bf16_t* __restrict__ out, int din, int top_k, unsigned* __restrict__ ready,
            int n_ready) {
    // Launched as dependent of the down projection on the tensor-core path: y is its output.
    grid_dep_wait();
    grid_dep_launch();
#if defined(MOE_TC_PROBE) && MOE_TC_PROBE == 4
    const bool probe_skip = true;  // timing probe (moe_tc.cu): no sums
#else
    const bool probe_skip = false;
#endif
    // The tensor-core gate/up blocks' counts (moe_tc.cu's MOE_TC_FINE), back to zero for the
    // next call: gate/up and down are over.
    if (ready != nullptr && blockIdx.x == 0 && blockIdx.y == 0)
        for (int i = threadIdx.x; i < n_ready; i += 256) ready[i] = 0u;
    const int b = blockIdx.y, n = blockIdx.x * 256 + threadIdx.x;
    if (n >= din || probe_skip) return;
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j)
        s = fmaf(weight[b * top_k + j], y[((size_t)b * top_k + j) * din + n], s);
    out[(size_t)b * din + n] = f2bf(s);
}
