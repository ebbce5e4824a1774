// The whole-model forward's glue kernels, for any model width: f32 activations between ops, bf16
// weights (raw 16-bit words), f32 recurrent state. The GEMMs run in cuBLAS; these kernels are
// the row-wise and per-sequence pieces around them, each written for clarity over speed (one
// block per row or per (sequence, head)), so every fixture shape runs, not only the production
// ones the specialised kernels are tuned for.
//
// Row maps: where a kernel takes `in_rows` / `out_rows`, a null map means the identity.
//
// `exact` selects the f32 check mode: GEMM inputs ("act" buffers) and the weights these kernels
// read (embedding table, MLA kv_b) are f32 instead of bf16, so the whole forward is f32 and can
// be held to the f32 reference's tolerance.

#define MT 128

__device__ __forceinline__ void store_act(void* p, size_t i, float v, int exact) {
    if (exact) ((float*)p)[i] = v;
    else ((bf16_t*)p)[i] = f2bf(v);
}
__device__ __forceinline__ float load_w(const void* p, size_t i, int exact) {
    return exact ? ((const float*)p)[i] : bf2f(((const bf16_t*)p)[i]);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ float block_reduce(float v, float* sh, bool is_max) {
    for (int m = LANES / 2; m > 0; m >>= 1) {
        const float o = LANE_SHFL_XOR(v, m);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    const int warp = threadIdx.x / LANES, lane = threadIdx.x & LANE_MASK;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = sh[0];
    for (int i = 1; i < (int)(blockDim.x / LANES); ++i) t = is_max ? fmaxf(t, sh[i]) : t + sh[i];
    __syncthreads();
    return t;
}

// out[i, :] = f32(table[ids[i], :]).
extern "C" __global__ void __launch_bounds__(MT)
embed_rows(const int* __restrict__ ids, const void* __restrict__ table, float* __restrict__ out, int dim, int exact) {
    const size_t src = (size_t)ids[blockIdx.x] * dim, dst = (size_t)blockIdx.x * dim;
    for (int c = threadIdx.x; c < dim; c += MT) out[dst + c] = load_w(table, src + c, exact);
}

// An f32 buffer as a GEMM input (bf16, or f32 when exact).
extern "C" __global__ void to_act(const float* __restrict__ x, void* __restrict__ y, long long n, int exact) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        store_act(y, i, x[i], exact);
}

extern "C" __global__ void from_bf16(const bf16_t* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

extern "C" __global__ void add_inplace(float* __restrict__ acc, const float* __restrict__ x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc[i] += x[i];
}

// x *= σ(g), element-wise.
extern "C" __global__ void mul_sigmoid(float* __restrict__ x, const float* __restrict__ g, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= sigmoidf_(g[i]);
}

extern "C" __global__ void sigmoid_inplace(float* __restrict__ x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = sigmoidf_(x[i]);
}

// Per row r (one block each): v = x[in_row(r)·in_stride ..][0..dim], o = w ⊙ v / sqrt(mean(v²) + eps),
// times σ(gate[r·dim ..]) when a gate is given. Written as f32 to out_f[out_row(r)·out_stride ..]
// and/or as a GEMM input to out_act[r·dim ..] (either may be null).
extern "C" __global__ void __launch_bounds__(MT)
rmsnorm_rows(const float* __restrict__ x, const int* __restrict__ in_rows, int in_stride,
             const float* __restrict__ w, int dim, float eps, const float* __restrict__ gate,
             float* __restrict__ out_f, const int* __restrict__ out_rows, int out_stride,
             void* __restrict__ out_act, int exact) {
    __shared__ float sh[MT / LANES];
    const int r = blockIdx.x;
    const float* v = x + (size_t)(in_rows ? in_rows[r] : r) * in_stride;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += MT) ss += v[c] * v[c];
    const float inv = rsqrtf(block_reduce(ss, sh, false) / dim + eps);
    float* of = out_f ? out_f + (size_t)(out_rows ? out_rows[r] : r) * out_stride : nullptr;
    for (int c = threadIdx.x; c < dim; c += MT) {
        float o = w[c] * (v[c] * inv);
        if (gate) o *= sigmoidf_(gate[(size_t)r * dim + c]);
        if (of) of[c] = o;
        if (out_act) store_act(out_act, (size_t)r * dim + c, o, exact);
    }
}

// Per-sequence state in a pool (the page arena, or a scratch buffer): segment s reads its state at
// src + src_off[s] (all zeros when src_off[s] < 0) and leaves the advanced state at dst + dst_off[s]
// (the same place, or a fresh page: the copy-on-write). Offsets are in floats.

// Causal depthwise conv + SiLU per sequence: segment s owns rows seg_start[s]..seg_start[s+1] of
// x [N, C]; its state [C, K-1] holds each channel's previous K-1 inputs, oldest first. One thread
// per (channel, segment, tile of CONV_TILE tokens), so a long prompt spreads over the GPU; the
// advanced state is written afterwards by short_conv_state (the state may be read and written
// in place, and every tile of a segment reads the old one).
#define CONV_TILE 64
// Input `t` (an absolute row) of channel c of a segment starting at row a: x, or the old state
// for rows before the segment (zeros without one).
__device__ __forceinline__ float conv_input(const float* __restrict__ x, const float* src, long long so,
                                            int a, int t, int c, int C, int K) {
    if (t >= a) return x[(size_t)t * C + c];
    return so >= 0 ? src[so + (long long)c * (K - 1) + (K - 1) + (t - a)] : 0.0f;
}
extern "C" __global__ void __launch_bounds__(MT)
short_conv_silu_seg(const float* __restrict__ x, const float* __restrict__ w, const float* src,
                    const long long* __restrict__ src_off, const int* __restrict__ seg_start,
                    float* __restrict__ out, int C, int K) {
    const int c = blockIdx.x * MT + threadIdx.x, s = blockIdx.y;
    const int a = seg_start[s], e = seg_start[s + 1], t0 = a + blockIdx.z * CONV_TILE;
    if (c >= C || t0 >= e) return;
    float win[16], wk[17];  // the K-1 inputs before the current one, oldest first (K ≤ 17)
    const long long so = src_off[s];
    for (int j = 0; j < K; ++j) wk[j] = w[(size_t)c * K + j];
    for (int j = 0; j < K - 1; ++j) win[j] = conv_input(x, src, so, a, t0 - (K - 1) + j, c, C, K);
    const int t1 = min(e, t0 + CONV_TILE);
    for (int t = t0; t < t1; ++t) {
        const float xt = x[(size_t)t * C + c];
        float acc = 0.0f;
        for (int j = 0; j < K - 1; ++j) acc += wk[j] * win[j];
        acc += wk[K - 1] * xt;
        out[(size_t)t * C + c] = acc * sigmoidf_(acc);
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = xt;
    }
}
// The state after each segment: its channel's last K-1 inputs (old state included). One thread
// per (channel, segment) reads all of its values before writing any, so src may equal dst.
extern "C" __global__ void __launch_bounds__(MT)
short_conv_state(const float* __restrict__ x, const float* src, float* dst,
                 const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
                 const int* __restrict__ seg_start, int C, int K) {
    const int c = blockIdx.x * MT + threadIdx.x, s = blockIdx.y;
    if (c >= C) return;
    const int a = seg_start[s], e = seg_start[s + 1];
    float win[16];
    for (int j = 0; j < K - 1; ++j) win[j] = conv_input(x, src, src_off[s], a, e - (K - 1) + j, c, C, K);
    float* st = dst + dst_off[s] + (long long)c * (K - 1);
    for (int j = 0; j < K - 1; ++j) st[j] = win[j];
}

// KDA forget gate in place over g [n/P rows, P]: z = g + dt_bias[c]; bounded: lb·σ(rate_h·z),
// else −rate_h·softplus(z) (softplus is the identity above 20, as FLA's).
extern "C" __global__ void kda_gate(float* __restrict__ g, const float* __restrict__ dt_bias,
                                    const float* __restrict__ rate, int P, int dk, long long n,
                                    int bounded, float lb) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i % P);
        const float z = g[i] + dt_bias[c], a = rate[c / dk];
        g[i] = bounded ? lb / (1.0f + expf(-a * z)) : -a * (z > 20.0f ? z : log1pf(expf(z)));
    }
}

// In place: x / sqrt(Σx² + eps) over each head's dk values, for the heads in columns
// [col0, col0 + heads·dk) of rows of `stride`. Grid (rows, heads).
extern "C" __global__ void __launch_bounds__(MT)
l2norm_heads(float* __restrict__ x, int stride, int col0, int dk, float eps) {
    __shared__ float sh[MT / LANES];
    float* v = x + (size_t)blockIdx.x * stride + col0 + (size_t)blockIdx.y * dk;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dk; c += MT) ss += v[c] * v[c];
    const float inv = rsqrtf(block_reduce(ss, sh, false) + eps);
    for (int c = threadIdx.x; c < dk; c += MT) v[c] *= inv;
}

// The KDA delta rule, token by token, per (segment, head): S ← diag(e^g)·S; u = β(v − Sᵀk);
// S ← S + k·uᵀ; o = Sᵀ(scale·q). qkv [N, 3P] (q, k, v column blocks), g [N, P], beta [N, H],
// each segment's state [H, dk, dv = dk] f32 in a pool (see above), out [N, P]. The value columns
// of S evolve independently, so a block takes KDA_COLS of them (grid (segments, H,
// ceil(dk / KDA_COLS))) and splits each column's dk rows over KDA_PARTS threads, which keep their
// rows in registers for the whole segment: the state is read once and written once, by enough
// blocks to fill the GPU at batch 1. The per-column sums over the parts go through shared memory
// in a fixed order.
#define KDA_MAX_DK 128
#define KDA_COLS 16
#define KDA_PARTS 8
#define KDA_ROWS (KDA_MAX_DK / KDA_PARTS)
extern "C" __global__ void __launch_bounds__(KDA_COLS * KDA_PARTS)
kda_recurrent_seg(const float* __restrict__ qkv, const float* __restrict__ g,
                  const float* __restrict__ beta, const float* src, float* dst,
                  const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
                  const int* __restrict__ seg_start, float* __restrict__ out, int H, int dk,
                  float scale) {
    __shared__ float sq[KDA_MAX_DK], sk[KDA_MAX_DK], se[KDA_MAX_DK];
    __shared__ float red[KDA_PARTS][KDA_COLS];
    const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, P = H * dk;
    const int jl = tid % KDA_COLS, part = tid / KDA_COLS, j = blockIdx.z * KDA_COLS + jl;
    const int rows = (dk + KDA_PARTS - 1) / KDA_PARTS, i0 = part * rows;
    const bool live = j < dk;
    const float* S0 = src_off[s] >= 0 ? src + src_off[s] + (size_t)h * dk * dk : nullptr;
    float col[KDA_ROWS];
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = i0 + r;
        col[r] = (r < rows && i < dk && live && S0) ? S0[(size_t)i * dk + j] : 0.0f;
    }
    for (int t = seg_start[s]; t < seg_start[s + 1]; ++t) {
        const float* row = qkv + (size_t)t * 3 * P;
        for (int i = tid; i < dk; i += KDA_COLS * KDA_PARTS) {
            sq[i] = row[h * dk + i] * scale;
            sk[i] = row[P + h * dk + i];
            se[i] = expf(g[(size_t)t * P + h * dk + i]);
        }
        __syncthreads();
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = i0 + r;
            if (r < rows && i < dk) {
                col[r] *= se[i];
                kv += sk[i] * col[r];
            }
        }
        red[part][jl] = kv;
        __syncthreads();
        kv = 0.0f;
#pragma unroll
        for (int q = 0; q < KDA_PARTS; ++q) kv += red[q][jl];
        const float u = live ? beta[(size_t)t * H + h] * (row[2 * P + h * dk + j] - kv) : 0.0f;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            const int i = i0 + r;
            if (r < rows && i < dk) {
                col[r] += sk[i] * u;
                o += sq[i] * col[r];
            }
        }
        __syncthreads();  // every part has read red[] and the staged q, k, e^g
        red[part][jl] = o;
        __syncthreads();
        if (part == 0 && live) {
            o = 0.0f;
#pragma unroll
            for (int q = 0; q < KDA_PARTS; ++q) o += red[q][jl];
            out[(size_t)t * P + h * dk + j] = o;
        }
    }
    if (!live) return;
    float* S = dst + dst_off[s] + (size_t)h * dk * dk;
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        const int i = i0 + r;
        if (r < rows && i < dk) S[(size_t)i * dk + j] = col[r];
    }
}

// MLA, absorbed form. kv_b [H·(dn+dv), r] bf16: per head dn rows of W_UK then dv rows of W_UV.
// q [T, H, dn+dr]; q_lat[t, h, c] = Σ_n q_nope[t, h, n] · W_UK[h][n, c]. One thread per c.
// Grid (T, H, ceil(r / MT)).
extern "C" __global__ void __launch_bounds__(MT)
mla_absorb_q(const float* __restrict__ q, const void* __restrict__ kvb, float* __restrict__ qlat,
             int H, int dn, int dr, int dv, int r, int exact) {
    const int t = blockIdx.x, h = blockIdx.y, c = blockIdx.z * MT + threadIdx.x;
    if (c >= r) return;
    const float* qn = q + ((size_t)t * H + h) * (dn + dr);
    const size_t w = (size_t)h * (dn + dv) * r + c;
    float acc = 0.0f;
#pragma unroll 8
    for (int n = 0; n < dn; ++n) acc += qn[n] * load_w(kvb, w + (size_t)n * r, exact);
    qlat[((size_t)t * H + h) * r + c] = acc;
}

// New latent rows into their places: row t's [c_kv (r) | k_pe (dr)] (c_kv already normed, k_pe the
// tail of kv [T, r+dr]) goes to base + dst[t] (floats). Grid T.
extern "C" __global__ void __launch_bounds__(MT)
mla_store_rows(const float* __restrict__ kv, const float* __restrict__ ckv, float* base,
               const long long* __restrict__ dst, int r, int dr) {
    const int t = blockIdx.x;
    float* row = base + dst[t];
    for (int c = threadIdx.x; c < r; c += MT) row[c] = ckv[(size_t)t * r + c];
    for (int c = threadIdx.x; c < dr; c += MT) row[r + c] = kv[(size_t)t * (r + dr) + r + c];
}

// Row t attends to the first vis[t] rows of its sequence's latent history [c_kv (r) | k_pe (dr)],
// paged: history row j sits at base + pages[first[t] + j / page_tokens] + (j % page_tokens)·(r+dr)
// (floats). score = scale·(q_lat·c_kv + q_pe·k_pe), softmax, lat = Σ p·c_kv. scores: scratch of
// [T, H, max_s]. Grid (T, H).
__device__ __forceinline__ const float* hist_row(const float* base, const long long* pages, int first,
                                                 int page_tokens, int j, int width) {
    return base + pages[first + j / page_tokens] + (size_t)(j % page_tokens) * width;
}
extern "C" __global__ void __launch_bounds__(MT)
mla_attend(const float* __restrict__ qlat, const float* __restrict__ q, const float* base,
           const long long* __restrict__ pages, const int* __restrict__ first, int page_tokens,
           const int* __restrict__ vis, float* __restrict__ scores, float* __restrict__ lat, int H, int dn,
           int dr, int r, int max_s, float scale) {
    __shared__ float sh[MT / LANES];
    const int t = blockIdx.x, h = blockIdx.y, n = vis[t], f = first[t], w = r + dr;
    const int lane = threadIdx.x & LANE_MASK, warp = threadIdx.x / LANES;
    const float* ql = qlat + ((size_t)t * H + h) * r;
    const float* qp = q + ((size_t)t * H + h) * (dn + dr) + dn;
    float* sc = scores + ((size_t)t * H + h) * max_s;
    float mx = -__int_as_float(0x7f800000);
    // Scores: one warp per history row, its lanes across the row (coalesced).
    for (int j = warp; j < n; j += MT / LANES) {
        const float* row = hist_row(base, pages, f, page_tokens, j, w);
        float acc = 0.0f;
        for (int c = lane; c < r; c += LANES) acc += ql[c] * row[c];
        for (int c = lane; c < dr; c += LANES) acc += qp[c] * row[r + c];
        for (int m = LANES / 2; m > 0; m >>= 1) acc += LANE_SHFL_XOR(acc, m);
        if (lane == 0) sc[j] = acc * scale;
        mx = fmaxf(mx, acc * scale);
    }
    mx = block_reduce(mx, sh, true);  // its barrier also publishes sc[]
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += MT) {
        sc[j] = __expf(sc[j] - mx);
        sum += sc[j];
    }
    const float inv = 1.0f / block_reduce(sum, sh, false);
    __syncthreads();
    for (int c = threadIdx.x; c < r; c += MT) {
        float acc = 0.0f;
#pragma unroll 4
        for (int j = 0; j < n; ++j) acc += sc[j] * hist_row(base, pages, f, page_tokens, j, w)[c];
        lat[((size_t)t * H + h) * r + c] = acc * inv;
    }
}

// out[t, h·dv + v] = Σ_c lat[t, h, c] · W_UV[h][v, c]: one warp per output value. Grid (T, H,
// ceil(dv / (MT / LANES))).
extern "C" __global__ void __launch_bounds__(MT)
mla_unabsorb(const float* __restrict__ lat, const void* __restrict__ kvb, float* __restrict__ out,
             int H, int dn, int dv, int r, int exact) {
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & LANE_MASK;
    const int v = blockIdx.z * (MT / LANES) + threadIdx.x / LANES;
    if (v >= dv) return;
    const float* l = lat + ((size_t)t * H + h) * r;
    const size_t w = ((size_t)h * (dn + dv) + dn + v) * r;
    float acc = 0.0f;
#pragma unroll 4
    for (int c = lane; c < r; c += LANES) acc += l[c] * load_w(kvb, w + c, exact);
    for (int m = LANES / 2; m > 0; m >>= 1) acc += LANE_SHFL_XOR(acc, m);
    if (lane == 0) out[((size_t)t * H + h) * dv + v] = acc;
}

// Gated activation of a stacked [rows, 2·inter] gate|up GEMM output into a GEMM input [rows, inter]:
// SiLU(g)·u, or SiTU [β1·tanh(g/β1)·σ(g)]·[β2·tanh(u/β2)] when situ is set.
extern "C" __global__ void glu_act(const float* __restrict__ gu, void* __restrict__ out, int inter,
                                   long long n, int situ, float b1, float b2, int exact) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter;
        const int c = (int)(i % inter);
        const float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
        const float o = situ ? (b1 * tanhf(g / b1) * sigmoidf_(g)) * (b2 * tanhf(u / b2)) : g * sigmoidf_(g) * u;
        store_act(out, i, o, exact);
    }
}

// out[i, :] = src[rows[i], :] as a GEMM input (zeros where rows[i] < 0).
extern "C" __global__ void __launch_bounds__(MT)
gather_act(const float* __restrict__ src, const int* __restrict__ rows, void* __restrict__ out, int dim, int exact) {
    const int r = rows[blockIdx.x];
    const float* s = src + (size_t)max(r, 0) * dim;
    for (int c = threadIdx.x; c < dim; c += MT)
        store_act(out, (size_t)blockIdx.x * dim + c, r >= 0 ? s[c] : 0.0f, exact);
}

// acc[rows[i], :] += w[i]·y[i, :] (rows distinct within one launch).
extern "C" __global__ void __launch_bounds__(MT)
scatter_add_weighted(float* __restrict__ acc, const float* __restrict__ y, const int* __restrict__ rows,
                     const float* __restrict__ w, int dim) {
    float* a = acc + (size_t)rows[blockIdx.x] * dim;
    const float wi = w[blockIdx.x];
    for (int c = threadIdx.x; c < dim; c += MT) a[c] += wi * y[(size_t)blockIdx.x * dim + c];
}

// MXFP4 weight [out, in] (E2M1 codes, eight to a 32-bit word in the device's bit order of
// cuda/mxfp4.rs; one E8M0 scale per 32 inputs) times x [rows, in]ᵀ (a GEMM input) into f32 out
// (row r at out + r·ldo): w4a16, dequantised in registers, each term (code · scale) · x exactly as
// from the checkpoint's codes. One warp per (row, output), a word of 8 inputs per lane and step.
// Grid (ceil(out / warps), rows).
extern "C" __global__ void __launch_bounds__(MT)
mxfp4_linear(const void* __restrict__ x, const unsigned char* __restrict__ packed,
             const unsigned char* __restrict__ scale, float* __restrict__ out, int in_dim, int out_dim, int ldo,
             int exact) {
    const int o = blockIdx.x * (MT / LANES) + threadIdx.x / LANES, row = blockIdx.y;
    const int lane = threadIdx.x & LANE_MASK;
    if (o >= out_dim) return;
    const unsigned* pw = reinterpret_cast<const unsigned*>(packed + (size_t)o * (in_dim / 2));
    const unsigned char* sb = scale + (size_t)o * (in_dim / 32);
    const size_t xr = (size_t)row * in_dim;
    float acc = 0.0f;
    for (int wi = lane; wi < in_dim / 8; wi += LANES) {
        unsigned b[4];
        mxfp4_pairs(pw[wi], b);
        const float s = e8m0(sb[wi / 4]);
        const size_t x0 = xr + 8 * (size_t)wi;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            acc += (lo_bf(b[k]) * MXFP4_UNSCALE) * s * load_w(x, x0 + k, exact);
            acc += (hi_bf(b[k]) * MXFP4_UNSCALE) * s * load_w(x, x0 + k + 4, exact);
        }
    }
    for (int m = LANES / 2; m > 0; m >>= 1) acc += LANE_SHFL_XOR(acc, m);
    if (lane == 0) out[(size_t)row * ldo + o] = acc;
}

// AttnRes mix per row: sources are blocks [nb, N, d] plus, when given, p [N, d]; score_v =
// <v / rms(v), q>, softmax over the sources, out = Σ α_v·v. Grid N; nb + 1 ≤ 64.
extern "C" __global__ void __launch_bounds__(MT)
attnres_mix(const float* __restrict__ blocks, int nb, const float* __restrict__ p, const float* __restrict__ q,
            float eps, float* __restrict__ out, int N, int d) {
    __shared__ float sh[MT / LANES];
    __shared__ float score[64];
    const int r = blockIdx.x, ns = nb + (p ? 1 : 0);
    for (int s = 0; s < ns; ++s) {
        const float* v = (s < nb ? blocks + ((size_t)s * N + r) * d : p + (size_t)r * d);
        float ss = 0.0f, dot = 0.0f;
        for (int c = threadIdx.x; c < d; c += MT) {
            ss += v[c] * v[c];
            dot += v[c] * q[c];
        }
        ss = block_reduce(ss, sh, false);
        dot = block_reduce(dot, sh, false);
        if (threadIdx.x == 0) score[s] = dot * rsqrtf(ss / d + eps);
    }
    __syncthreads();
    float mx = -__int_as_float(0x7f800000);
    for (int s = 0; s < ns; ++s) mx = fmaxf(mx, score[s]);
    float total = 0.0f;
    for (int s = 0; s < ns; ++s) total += expf(score[s] - mx);
    for (int c = threadIdx.x; c < d; c += MT) {
        float acc = 0.0f;
        for (int s = 0; s < ns; ++s) {
            const float* v = (s < nb ? blocks + ((size_t)s * N + r) * d : p + (size_t)r * d);
            acc += expf(score[s] - mx) / total * v[c];
        }
        out[(size_t)r * d + c] = acc;
    }
}
