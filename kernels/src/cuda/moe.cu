// MoE decode for small batches (1-64 tokens): routing, the expert plan, gate+up+SiTU fused, the
// down projection and the weighted combine. Experts in bf16 or MXFP4 (w4a16: packed E2M1 codes
// with one E8M0 scale per 32 inputs, dequantised in registers as the weights stream in).
//
// moe_route_threshold: one warp per token. scores = sigmoid(logits), choice = scores + bias; the
//   top_k experts by choice (NaN as -inf, ties to the lower index), written in descending order
//   and weighted by their scores, renormalised by (sum + 1e-20) in slot order, times `scaling` —
//   the CPU backend's route_sigmoid_grouped with one group (K3's n_group = 1).
// moe_plan: one block. The distinct experts of the batch in ascending order, each with its
//   (token, slot) pairs in pair order: every expert's weights are then read once per step.
// moe_gate_up_*: block (column tile, active expert); a warp per output column streams the gate
//   and up rows of that column (16-byte vectors over the input) against the inputs of the
//   expert's tokens, then h = situ(gate, up) in bf16 for each (token, slot) pair.
// moe_down_*: block (column tile, active expert); y[pair, n] = W2[n, :] · h[pair, :] in f32.
// moe_gate_up_tc_*, moe_down_tc_*: the same two projections on the tensor cores, a warp per 16
//   output rows and 8 tokens of the expert per pass (the default path; the column kernels stay
//   for measurements, TESSERA_MOE_PATH=columns).
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
// Router scores one lane keeps: ceil(experts / 32), set per model from the host (at most 32).
#ifndef ROUTE_PER_LANE
#define ROUTE_PER_LANE 32
#endif

// ---------------------------------------------------------------------------------------------
// Routing and plan

// The top_k-th largest choice is found bit by bit over all the token's scores at once (a count
// per candidate by warp reduction), with no pass per slot; the experts above it are taken with
// the lowest-numbered ones at it, and the taken are ranked by (choice descending, expert
// ascending) into the slots.
__device__ __forceinline__ unsigned order_key(float c) {
    const unsigned b = __float_as_uint(c == 0.0f ? 0.0f : c);  // -0 and +0 tie
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
extern "C" __global__ void __launch_bounds__(32)
moe_route_threshold(const float* __restrict__ logits, const float* __restrict__ bias,
                    unsigned* __restrict__ idx, float* __restrict__ weight, int experts,
                    int top_k, int renormalize, float scaling) {
    const int b = blockIdx.x, lane = threadIdx.x;
    const unsigned all = 0xffffffffu, below = (1u << lane) - 1u;
    const float* lg = logits + (size_t)b * experts;
    const float ninf = -__int_as_float(0x7f800000);
    unsigned key[ROUTE_PER_LANE];  // 0: past the experts (below every choice, -inf included)
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = i * 32 + lane;
        key[i] = 0u;
        if (e < experts) {
            const float c = 1.0f / (1.0f + expf(-lg[e])) + bias[e];
            key[i] = order_key(c != c ? ninf : c);
        }
    }
    unsigned t = 0u;
    for (int bit = 31; bit >= 0; --bit) {
        const unsigned cand = t | (1u << bit);
        int n = 0;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) n += key[i] >= cand;
        if ((int)__reduce_add_sync(all, (unsigned)n) >= top_k) t = cand;
    }
    int above = 0;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) above += key[i] > t;
    const int ties = top_k - (int)__reduce_add_sync(all, (unsigned)above);
    __shared__ unsigned s_key[ROUTE_PER_LANE * 32];
    __shared__ int s_exp[ROUTE_PER_LANE * 32];
    __shared__ unsigned s_idx[ROUTE_PER_LANE * 32];
    __shared__ float s_w[ROUTE_PER_LANE * 32];
    // The taken, packed in expert order.
    int taken = 0, eq_seen = 0;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const bool eq = key[i] == t;
        const unsigned eqm = __ballot_sync(all, eq);
        const bool take = key[i] > t || (eq && eq_seen + __popc(eqm & below) < ties);
        eq_seen += __popc(eqm);
        const unsigned tm = __ballot_sync(all, take);
        if (take) {
            const int at = taken + __popc(tm & below);
            s_key[at] = key[i];
            s_exp[at] = i * 32 + lane;
        }
        taken += __popc(tm);
    }
    __syncwarp();
    for (int j = lane; j < top_k; j += 32) {
        const unsigned kj = s_key[j];
        const int ej = s_exp[j];
        int rank = 0;
        for (int m = 0; m < top_k; ++m) rank += s_key[m] > kj || (s_key[m] == kj && s_exp[m] < ej);
        s_idx[rank] = (unsigned)ej;
        s_w[rank] = 1.0f / (1.0f + expf(-lg[ej]));
    }
    __syncwarp();
    if (lane == 0) {
        float denom = 0.0f;
        for (int j = 0; j < top_k; ++j) denom += s_w[j];
        denom += 1e-20f;
        for (int j = 0; j < top_k; ++j) {
            const float w = renormalize ? s_w[j] / denom : s_w[j];
            idx[(size_t)b * top_k + j] = s_idx[j];
            weight[(size_t)b * top_k + j] = w * scaling;
        }
    }
}

// plan: n_active, then per active expert a: expert id, token count, and the pair ids (b·k+slot).
// Experts are numbered in ascending order by a block-wide scan (each thread owns a run of
// consecutive experts); pairs join their expert's list through shared-memory counters, so the
// order within a list is arbitrary — every pair's output is computed on its own, whatever its
// place in the list.
#define PLAN_THREADS 256
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
moe_plan(const unsigned* __restrict__ idx, int pairs, int experts, int* __restrict__ n_active,
         int* __restrict__ act_expert, int* __restrict__ act_count, int* __restrict__ act_pairs) {
    extern __shared__ int s_slot[];  // [experts]: 1 if used, then its active index (or -1)
    __shared__ int s_warp[PLAN_THREADS / 32];
    __shared__ int s_count[1024];  // MAX_EXPERTS
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < experts; e += PLAN_THREADS) s_slot[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += PLAN_THREADS) s_slot[idx[p]] = 1;
    __syncthreads();
    const int per = (experts + PLAN_THREADS - 1) / PLAN_THREADS, e0 = tid * per;
    int mine = 0;
    for (int e = e0; e < min(e0 + per, experts); ++e) mine += s_slot[e];
    // Exclusive scan of `mine` over the block: within each warp, then over the warps.
    int incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += s_warp[w];
    int n = before + incl - mine;
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
        const int a = s_slot[idx[p]];
        const int c = atomicAdd(&s_count[a], 1);
        if (c < MOE_MAXT) act_pairs[a * MOE_MAXT + c] = p;
    }
    __syncthreads();
    int total = 0;
    for (int w = 0; w < PLAN_THREADS / 32; ++w) total += s_warp[w];
    for (int a = tid; a < total; a += PLAN_THREADS) act_count[a] = s_count[a];
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

// E2M1 codes (sign in bit 3; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}) to bf16 by byte lookups:
// every magnitude is a bf16 whose two bytes come from two 8-entry tables, which prmt indexes
// with the code's three magnitude bits; the sign bit is then moved onto the high byte.
#define E2M1_HI0 0x3f3f3f00u
#define E2M1_HI1 0x40404040u
#define E2M1_LO0 0xc0800000u
#define E2M1_LO1 0xc0804000u

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// The 8 codes of one 32-bit word (element k in bits 4k..4k+3) as four bf16x2 words, in order.
__device__ __forceinline__ void e2m1x8_to_bf16(unsigned w, unsigned out[4]) {
    const unsigned mag = w & 0x77777777u;
    const unsigned even = (w << 4) & 0x80808080u;  // signs of elements 0, 2, 4, 6 at bit 7
    const unsigned odd = w & 0x80808080u;          // signs of elements 1, 3, 5, 7 at bit 7
    const unsigned hi_a = prmt(E2M1_HI0, E2M1_HI1, mag) | prmt(even, odd, 0x5140u);
    const unsigned lo_a = prmt(E2M1_LO0, E2M1_LO1, mag);
    const unsigned hi_b = prmt(E2M1_HI0, E2M1_HI1, mag >> 16) | prmt(even, odd, 0x7362u);
    const unsigned lo_b = prmt(E2M1_LO0, E2M1_LO1, mag >> 16);
    out[0] = prmt(lo_a, hi_a, 0x5140u);
    out[1] = prmt(lo_a, hi_a, 0x7362u);
    out[2] = prmt(lo_b, hi_b, 0x5140u);
    out[3] = prmt(lo_b, hi_b, 0x7362u);
}

__device__ __forceinline__ float e8m0(unsigned s) {
    return s == 0 ? __uint_as_float(0x00400000u) : (s == 255 ? __int_as_float(0x7fc00000) : __uint_as_float(s << 23));
}

// 8 codes of one 32-bit word (low nibble first) against 8 bf16 inputs.
__device__ __forceinline__ float dot8_fp4(unsigned w, uint4 xv, float s) {
    unsigned b[4];
    e2m1x8_to_bf16(w, b);
    s = fmaf(lo_bf(b[0]), lo_bf(xv.x), s);
    s = fmaf(hi_bf(b[0]), hi_bf(xv.x), s);
    s = fmaf(lo_bf(b[1]), lo_bf(xv.y), s);
    s = fmaf(hi_bf(b[1]), hi_bf(xv.y), s);
    s = fmaf(lo_bf(b[2]), lo_bf(xv.z), s);
    s = fmaf(hi_bf(b[2]), hi_bf(xv.z), s);
    s = fmaf(lo_bf(b[3]), lo_bf(xv.w), s);
    return fmaf(hi_bf(b[3]), hi_bf(xv.w), s);
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

// ---------------------------------------------------------------------------------------------
// Expert projections on the tensor cores (m16n8k16, f32 accumulators): a warp owns 16 output
// rows of one expert and up to 8 of its tokens per pass. Lane (g, t) = (lane/4, lane%4) loads
// 16-byte vectors t, t+4, t+8, ... of rows g and g+8 and decodes each into bf16 pairs in input
// order; k-step s of a vector takes its pairs 2s and 2s+1 as the A fragment's columns 2t.. and
// 2t+8.. The product sums over every input whatever the order, so the B fragment (token g's
// inputs) takes the same pairs of the same vector: both are plain 32-bit words, no shuffles.
// Weights stream once per 8 tokens of an expert; the decode of MXFP4 codes (and not the
// multiply-adds) is what the CUDA cores still do.

#ifndef MOE_TC_WARPS
#define MOE_TC_WARPS 4
#endif
// Consecutive 16-byte vectors of a row one lane loads per pass, per format (MXFP4 vectors carry
// 4x the inputs and take their registers again once decoded).
#ifndef MOE_TC_SPAN_BF16
#define MOE_TC_SPAN_BF16 4
#endif
#ifndef MOE_TC_SPAN_MXFP4
#define MOE_TC_SPAN_MXFP4 2
#endif
// Blocks per SM the register budget must allow.
#ifndef MOE_TC_MIN_BLOCKS
#define MOE_TC_MIN_BLOCKS 4
#endif

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// A format of the tensor-core path: `row` makes a lane's cursor at a vector of a weight row,
// `load` reads the vector i places past it, `decode` turns a vector into REGS bf16 pairs in the
// order `arrange_x` puts the inputs (`wide`: some block of the warp's pass has a scale past the
// single-factor range, see Mxfp4Tc).
struct Bf16Tc {
    static constexpr int SPAN = MOE_TC_SPAN_BF16;
    static constexpr int PER_VEC = 8;  // inputs per 16-byte vector
    static constexpr int REGS = 4;     // bf16 pairs a vector decodes into
    static constexpr bool SCALED = false;
    struct Vec {
        uint4 w;
    };
    struct Row {
        const uint4* p;
    };
    const uint4* rows;
    __device__ __forceinline__ Row row(size_t r, int in_dim, int v) const {
        return Row{rows + r * (in_dim / PER_VEC) + v};
    }
    __device__ __forceinline__ static Vec load(const Row& r, int i) { return Vec{__ldg(r.p + i)}; }
    __device__ __forceinline__ static void advance(Row& r, int n) { r.p += n; }
    __device__ __forceinline__ static unsigned wide_bits(const Vec&) { return 0u; }
    __device__ __forceinline__ static void decode(const Vec& vec, unsigned out[REGS], bool) {
        out[0] = vec.w.x;
        out[1] = vec.w.y;
        out[2] = vec.w.z;
        out[3] = vec.w.w;
    }
    __device__ __forceinline__ static void arrange_x(unsigned[REGS]) {}
};

// Elements k and k+4 of one 32-bit word of codes as one bf16x2 (k = 0..3), each at 2^-126 of
// its value: a code's three magnitude bits become the bf16's two lowest exponent bits and its
// first mantissa bit (so code 1, 0.5, becomes the subnormal 2^-127), its sign bit the sign.
// Four masked shifts per pair, no lookups; the inputs are paired the same way (`spread_x`).
__device__ __forceinline__ void e2m1x8_spread(unsigned w, unsigned out[4]) {
    const unsigned mag = 0x01c001c0u, sign = 0x80008000u;
    out[0] = ((w << 6) & mag) | ((w << 12) & sign);
    out[1] = ((w << 2) & mag) | ((w << 8) & sign);
    out[2] = ((w >> 2) & mag) | ((w << 4) & sign);
    out[3] = ((w >> 6) & mag) | (w & sign);
}

// Eight inputs (four bf16x2 words, in order) paired as `e2m1x8_spread` pairs the codes.
__device__ __forceinline__ void spread_x(unsigned x[4]) {
    const unsigned x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    x[0] = prmt(x0, x2, 0x5410u);
    x[1] = prmt(x0, x2, 0x7632u);
    x[2] = prmt(x1, x3, 0x5410u);
    x[3] = prmt(x1, x3, 0x7632u);
}

struct Mxfp4Tc {
    static constexpr int SPAN = MOE_TC_SPAN_MXFP4;
    static constexpr int PER_VEC = 32;  // one scale group
    static constexpr int REGS = 16;
    static constexpr bool SCALED = true;
    struct Vec {
        uint4 w;
        unsigned scale;  // the block's E8M0 exponent s
    };
    struct Row {
        const uint4* p;
        const unsigned char* s;
    };
    const uint4* rows;
    const unsigned char* scales;
    __device__ __forceinline__ Row row(size_t r, int in_dim, int v) const {
        const size_t at = r * (in_dim / PER_VEC) + v;
        return Row{rows + at, scales + at};
    }
    __device__ __forceinline__ static Vec load(const Row& r, int i) {
        return Vec{__ldg(r.p + i), __ldg(r.s + i)};
    }
    __device__ __forceinline__ static void advance(Row& r, int n) {
        r.p += n;
        r.s += n;
    }
    // Bit 8 is set when s >= 129 (s + 127 < 512 always).
    __device__ __forceinline__ static unsigned wide_bits(const Vec& v) { return v.scale + 127u; }
    __device__ __forceinline__ static void decode(const Vec& vec, unsigned out[REGS], bool wide) {
        // Codes decode to 2^-126 of their values, so the factor is 2^(s-1): one bf16 pair
        // (s + 126) << 7 up to s = 128 (one multiply-add), beyond that 2^127 · 2^(s-128) (255
        // is NaN) — taken only when some lane of the warp needs it.
        e2m1x8_spread(vec.w.x, out);
        e2m1x8_spread(vec.w.y, out + 4);
        e2m1x8_spread(vec.w.z, out + 8);
        e2m1x8_spread(vec.w.w, out + 12);
        const unsigned s = vec.scale;
        if (!wide) {
            const unsigned f = s * 0x00800080u + 126u * 0x00800080u;
#pragma unroll
            for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], f);
            return;
        }
        const unsigned b = (min(s, 128u) + 126u) * 0x00800080u;
        const unsigned b2 = s <= 128 ? 0u : (s == 255 ? 0x7fc07fc0u : (s - 1u) * 0x00800080u);
#pragma unroll
        for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], b);
        if (b2) {
#pragma unroll
            for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], b2);
        }
    }
    // The inputs of one vector in the order `decode` pairs the codes.
    __device__ __forceinline__ static void arrange_x(unsigned x[REGS]) {
#pragma unroll
        for (int i = 0; i < REGS; i += 4) spread_x(x + i);
    }
};

// One pass's products: c[m] += (vectors wl/wh of rows lo/hi) · (the inputs at xv[u]), u < SPAN;
// an input vector that is not `in` is zero (only the last pass of a range has such).
template <typename W, int M, bool FULL>
__device__ __forceinline__ void tc_mma_pass(const typename W::Vec (&wl)[M][W::SPAN],
                                            const typename W::Vec (&wh)[M][W::SPAN],
                                            const uint4* const (&xv)[W::SPAN],
                                            const bool (&in)[W::SPAN], float (&c)[M][4]) {
    bool wide = false;
    if (W::SCALED) {
        unsigned bits = 0u;
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int u = 0; u < W::SPAN; ++u) bits |= W::wide_bits(wl[m][u]) | W::wide_bits(wh[m][u]);
        wide = __any_sync(0xffffffffu, bits & 0x100u);
    }
#pragma unroll
    for (int u = 0; u < W::SPAN; ++u) {
        unsigned xb[W::REGS];
#pragma unroll
        for (int i = 0; i < W::REGS / 4; ++i) {
            uint4 q = xv[u][i];
            if (!FULL && !in[u]) q = make_uint4(0, 0, 0, 0);
            xb[4 * i] = q.x;
            xb[4 * i + 1] = q.y;
            xb[4 * i + 2] = q.z;
            xb[4 * i + 3] = q.w;
        }
        W::arrange_x(xb);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            unsigned al[W::REGS], ah[W::REGS];
            W::decode(wl[m][u], al, wide);
            W::decode(wh[m][u], ah, wide);
#pragma unroll
            for (int s = 0; s < W::REGS / 2; ++s) {
                const unsigned a[4] = {al[2 * s], ah[2 * s], al[2 * s + 1], ah[2 * s + 1]};
                const unsigned b[2] = {xb[2 * s], xb[2 * s + 1]};
                mma_bf16_16816(c[m], a, b);
            }
        }
    }
}

// c[m] += W_m[rows lo/hi] · x over input vectors [vbeg, vend), for M weight matrices sharing the
// inputs. Lane t takes W::SPAN consecutive vectors of each row per pass, so a row is read in runs
// of 4 · W::SPAN vectors (256 bytes at span 4) while the warp has 16 rows in flight. Whole passes
// walk cursors with no bounds; a last, partial pass clamps its loads and zeroes the inputs past
// the range (every lane runs every step: the matrix instructions take the whole warp).
template <typename W, int M>
__device__ __forceinline__ void tc_rows(const W (&w)[M], size_t lo, size_t hi,
                                        const bf16_t* __restrict__ xt, int in_dim, int vbeg,
                                        int vend, int t, float (&c)[M][4]) {
    constexpr int STEP = 4 * W::SPAN, XV = W::PER_VEC / 8;  // uint4 of inputs per vector
    typename W::Vec wl[M][W::SPAN], wh[M][W::SPAN];
    const uint4* xv[W::SPAN];
    bool in[W::SPAN];
    int v0 = vbeg;
    if (v0 + STEP <= vend) {
        typename W::Row rl[M], rh[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            rl[m] = w[m].row(lo, in_dim, v0 + t * W::SPAN);
            rh[m] = w[m].row(hi, in_dim, v0 + t * W::SPAN);
        }
        const uint4* xp = reinterpret_cast<const uint4*>(xt) + (size_t)(v0 + t * W::SPAN) * XV;
#pragma unroll 1
        for (; v0 + STEP <= vend; v0 += STEP) {
#pragma unroll
            for (int u = 0; u < W::SPAN; ++u) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    wl[m][u] = W::load(rl[m], u);
                    wh[m][u] = W::load(rh[m], u);
                }
                xv[u] = xp + u * XV;
                in[u] = true;
            }
            tc_mma_pass<W, M, true>(wl, wh, xv, in, c);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                W::advance(rl[m], STEP);
                W::advance(rh[m], STEP);
            }
            xp += STEP * XV;
        }
    }
    if (v0 < vend) {
#pragma unroll
        for (int u = 0; u < W::SPAN; ++u) {
            const int vu = v0 + t * W::SPAN + u, v = min(vu, vend - 1);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                wl[m][u] = W::load(w[m].row(lo, in_dim, v), 0);
                wh[m][u] = W::load(w[m].row(hi, in_dim, v), 0);
            }
            xv[u] = reinterpret_cast<const uint4*>(xt) + (size_t)v * XV;
            in[u] = vu < vend;
        }
        tc_mma_pass<W, M, false>(wl, wh, xv, in, c);
    }
}

// A block's warps split over row tiles and input ranges: with `ksplit` parts, warp w takes row
// tile w / ksplit of the block and input part w % ksplit, and the parts' sums meet in shared
// memory. Few active experts (batch 1) make few row tiles, too few to fill every multiprocessor
// evenly: splitting the input multiplies the warps without changing the bytes.
struct TcSplit {
    int part, tile_row0, vbeg, vend;
    __device__ __forceinline__ TcSplit(int ksplit, int vecs) {
        const int warp = threadIdx.x >> 5, per = (vecs + ksplit - 1) / ksplit;
        part = warp % ksplit;
        tile_row0 = (blockIdx.x * (MOE_TC_WARPS / ksplit) + warp / ksplit) * 16;
        vbeg = min(part * per, vecs);
        vend = min(vbeg + per, vecs);
    }
};

// Sums c over the ksplit warps of each row tile into the part-0 warp's c (a barrier before and
// after: every warp of the block calls it the same number of times).
template <int M>
__device__ __forceinline__ void tc_sum_parts(float (&c)[M][4], int ksplit, int part) {
    __shared__ float red[MOE_TC_WARPS][M][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][m][j][lane] = c[m][j];
    __syncthreads();
    if (part == 0) {
        for (int p = 1; p < ksplit; ++p)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) c[m][j] += red[warp + p][m][j][lane];
    }
}

template <typename W>
__device__ __forceinline__ void gate_up_tc(W wg, W wu, const bf16_t* __restrict__ x,
                                           const int* __restrict__ n_active,
                                           const int* __restrict__ act_expert,
                                           const int* __restrict__ act_count,
                                           const int* __restrict__ act_pairs,
                                           bf16_t* __restrict__ h, int din, int di, int top_k,
                                           float b1, float b2, int ksplit) {
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const TcSplit sp(ksplit, din / W::PER_VEC);
    const int row0 = sp.tile_row0;
    if (ksplit == 1 && row0 >= di) return;
    const bool rows_in = row0 < di;
    const int e = act_expert[a], nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const W w[2] = {wg, wu};
    const size_t lo = (size_t)e * di + min(row0, di - 16) + g, hi = lo + 8;
    for (int t0 = 0; t0 < nt; t0 += 8) {
        // Token g of this pass (a missing one reads a present token's inputs: its column of
        // the product is never written).
        const bf16_t* xt = x + (size_t)(pairs[min(t0 + g, nt - 1)] / top_k) * din;
        float c[2][4] = {};
        if (rows_in) tc_rows<W, 2>(w, lo, hi, xt, din, sp.vbeg, sp.vend, t, c);
        if (ksplit > 1) tc_sum_parts<2>(c, ksplit, sp.part);
        if (sp.part != 0 || !rows_in) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tok = t0 + 2 * t + (j & 1), row = row0 + g + 8 * (j >> 1);
            if (tok < nt) h[(size_t)pairs[tok] * di + row] = f2bf(situ(c[0][j], c[1][j], b1, b2));
        }
    }
}

template <typename W>
__device__ __forceinline__ void down_tc(W wd, const bf16_t* __restrict__ h,
                                        const int* __restrict__ n_active,
                                        const int* __restrict__ act_expert,
                                        const int* __restrict__ act_count,
                                        const int* __restrict__ act_pairs, float* __restrict__ y,
                                        int din, int di, int ksplit) {
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const TcSplit sp(ksplit, di / W::PER_VEC);
    const int row0 = sp.tile_row0;
    if (ksplit == 1 && row0 >= din) return;
    const bool rows_in = row0 < din;
    const int e = act_expert[a], nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const W w[1] = {wd};
    const size_t lo = (size_t)e * din + min(row0, din - 16) + g, hi = lo + 8;
    for (int t0 = 0; t0 < nt; t0 += 8) {
        const bf16_t* ht = h + (size_t)pairs[min(t0 + g, nt - 1)] * di;
        float c[1][4] = {};
        if (rows_in) tc_rows<W, 1>(w, lo, hi, ht, di, sp.vbeg, sp.vend, t, c);
        if (ksplit > 1) tc_sum_parts<1>(c, ksplit, sp.part);
        if (sp.part != 0 || !rows_in) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tok = t0 + 2 * t + (j & 1), row = row0 + g + 8 * (j >> 1);
            if (tok < nt) y[(size_t)pairs[tok] * din + row] = c[0][j];
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
            bf16_t* __restrict__ out, int din, int top_k) {
    const int b = blockIdx.y, n = blockIdx.x * 256 + threadIdx.x;
    if (n >= din) return;
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j)
        s = fmaf(weight[b * top_k + j], y[((size_t)b * top_k + j) * din + n], s);
    out[(size_t)b * din + n] = f2bf(s);
}

// The same four projections on the tensor cores (block: MOE_TC_WARPS warps of 16 rows each).
extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_bf16(const bf16_t* __restrict__ w_gate, const bf16_t* __restrict__ w_up,
                    const bf16_t* __restrict__ x, PLAN_ARGS, bf16_t* __restrict__ h, int din,
                    int di, int top_k, float b1, float b2, int ksplit) {
    gate_up_tc(Bf16Tc{reinterpret_cast<const uint4*>(w_gate)},
               Bf16Tc{reinterpret_cast<const uint4*>(w_up)}, x, n_active, act_expert, act_count,
               act_pairs, h, din, di, top_k, b1, b2, ksplit);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_mxfp4(const unsigned char* __restrict__ gate_packed,
                     const unsigned char* __restrict__ gate_scale,
                     const unsigned char* __restrict__ up_packed,
                     const unsigned char* __restrict__ up_scale, const bf16_t* __restrict__ x,
                     PLAN_ARGS, bf16_t* __restrict__ h, int din, int di, int top_k, float b1,
                     float b2, int ksplit) {
    gate_up_tc(Mxfp4Tc{reinterpret_cast<const uint4*>(gate_packed), gate_scale},
               Mxfp4Tc{reinterpret_cast<const uint4*>(up_packed), up_scale}, x, n_active,
               act_expert, act_count, act_pairs, h, din, di, top_k, b1, b2, ksplit);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_down_tc_bf16(const bf16_t* __restrict__ w_down, const bf16_t* __restrict__ h, PLAN_ARGS,
                 float* __restrict__ y, int din, int di, int ksplit) {
    down_tc(Bf16Tc{reinterpret_cast<const uint4*>(w_down)}, h, n_active, act_expert, act_count,
            act_pairs, y, din, di, ksplit);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_down_tc_mxfp4(const unsigned char* __restrict__ down_packed,
                  const unsigned char* __restrict__ down_scale, const bf16_t* __restrict__ h,
                  PLAN_ARGS, float* __restrict__ y, int din, int di, int ksplit) {
    down_tc(Mxfp4Tc{reinterpret_cast<const uint4*>(down_packed), down_scale}, h, n_active,
            act_expert, act_count, act_pairs, y, din, di, ksplit);
}
