// Row-wise ops of the model around the attention and MoE kernels: RMSNorm fused with the
// residual add, the embedding gather and greedy sampling (argmax). bf16 values as raw 16-bit
// words (see common.cuh), f32 arithmetic. Every kernel takes one row per block.
//
// OPS_THREADS threads per block (a multiple of LANES); a row of RMSNorm is held in registers,
// OPS_VECS vectors of 8 bf16 per thread, so dim ≤ OPS_THREADS · 8 · OPS_VECS.

#ifndef OPS_THREADS
#define OPS_THREADS 256
#endif
#ifndef OPS_VECS
#define OPS_VECS 4
#endif

struct bf16x8 {
    unsigned w[4];
};

__device__ __forceinline__ bf16x8 load8(const bf16_t* p) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    bf16x8 r;
    r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
    return r;
}

__device__ __forceinline__ void store8(bf16_t* p, const bf16x8& r) {
    *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
}

// Sum over the block; every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int m = LANES / 2; m > 0; m >>= 1) v += LANE_SHFL_XOR(v, m);
    const int warp = threadIdx.x / LANES, lane = threadIdx.x & LANE_MASK;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < OPS_THREADS / LANES; ++i) t += scratch[i];
    __syncthreads();
    return t;
}

// out = weight ⊙ bf16(r / sqrt(mean(r²) + eps)), with r = x, or with a residual stream
// r = bf16(x + residual), written back to `residual` (the next layer's input).
// torch order: normalise in f32, round to bf16, then scale by the weight and round again.
extern "C" __global__ void __launch_bounds__(OPS_THREADS)
rmsnorm_bf16(const bf16_t* __restrict__ x, bf16_t* __restrict__ residual,
             const bf16_t* __restrict__ weight, bf16_t* __restrict__ out, int dim, float eps) {
    __shared__ float scratch[OPS_THREADS / LANES];
    const size_t row = (size_t)blockIdx.x * dim;
    bf16x8 r[OPS_VECS];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < OPS_VECS; ++i) {
        const int c = (i * OPS_THREADS + threadIdx.x) * 8;
        if (c < dim) {
            r[i] = load8(x + row + c);
            if (residual != nullptr) {
                const bf16x8 h = load8(residual + row + c);
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    r[i].w[j] = pack_bf16x2(lo_bf(r[i].w[j]) + lo_bf(h.w[j]),
                                            hi_bf(r[i].w[j]) + hi_bf(h.w[j]));
                store8(residual + row + c, r[i]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float a = lo_bf(r[i].w[j]), b = hi_bf(r[i].w[j]);
                ss = fmaf(a, a, fmaf(b, b, ss));
            }
        }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
#pragma unroll
    for (int i = 0; i < OPS_VECS; ++i) {
        const int c = (i * OPS_THREADS + threadIdx.x) * 8;
        if (c < dim) {
            const bf16x8 w = load8(weight + c);
            bf16x8 o;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned n = pack_bf16x2(lo_bf(r[i].w[j]) * inv, hi_bf(r[i].w[j]) * inv);
                o.w[j] = pack_bf16x2(lo_bf(w.w[j]) * lo_bf(n), hi_bf(w.w[j]) * hi_bf(n));
            }
            store8(out + row + c, o);
        }
    }
}

// out[i, :] = table[ids[i], :]; ids were checked against the vocabulary on the host.
extern "C" __global__ void __launch_bounds__(OPS_THREADS)
embedding_bf16(const unsigned* __restrict__ ids, const bf16_t* __restrict__ table,
               bf16_t* __restrict__ out, int dim) {
    const bf16_t* src = table + (size_t)ids[blockIdx.x] * dim;
    bf16_t* dst = out + (size_t)blockIdx.x * dim;
    for (int c = threadIdx.x * 8; c < dim; c += OPS_THREADS * 8) store8(dst + c, load8(src + c));
}

// Keeps the better of (bv, bi) and (v, i): NaN never wins, ties go to the lower index, so a row
// answers what the CPU backend's `argmax` does (a row of -inf its first index, all NaN 0).
__device__ __forceinline__ void arg_better(float v, unsigned i, float& bv, unsigned& bi) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

extern "C" __global__ void __launch_bounds__(OPS_THREADS)
argmax_f32(const float* __restrict__ logits, unsigned* __restrict__ out, int vocab) {
    __shared__ float sv[OPS_THREADS / LANES];
    __shared__ unsigned si[OPS_THREADS / LANES];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float bv = -__int_as_float(0x7f800000);
    unsigned bi = 0xffffffffu;
    for (int c = threadIdx.x; c < vocab; c += OPS_THREADS) arg_better(row[c], (unsigned)c, bv, bi);
    for (int m = LANES / 2; m > 0; m >>= 1) {
        const float ov = LANE_SHFL_XOR(bv, m);
        const unsigned oi = LANE_SHFL_XOR(bi, m);
        arg_better(ov, oi, bv, bi);
    }
    const int warp = threadIdx.x / LANES, lane = threadIdx.x & LANE_MASK;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < OPS_THREADS / LANES; ++i) arg_better(sv[i], si[i], bv, bi);
        out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
    }
}
