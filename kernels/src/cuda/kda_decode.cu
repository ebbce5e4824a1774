// KDA decode (compiled after kda.cu and kda_scan.cu, whose configuration macros and helpers it
// uses).
//
// kda_decode: one token per sequence. A (batch x head) pair's state is split by value columns
// over SPLIT blocks (columns evolve independently); a block has 8 row groups of RPW state rows,
// each row group LPR threads wide with 4 columns per thread, so the state is read and written
// once, in 16-byte vectors, by every thread at once. SPLIT = 1: 256 threads, a warp per row
// group; SPLIT = 2: 128 threads, smaller blocks that overlap one another's read, compute and
// write phases more finely.
#define RPW (DK / 8)

template <int SPLIT>
__device__ __forceinline__ void kda_decode_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    const float* __restrict__ g, const bf16_t* __restrict__ beta, float* __restrict__ state,
    bf16_t* __restrict__ o, float scale, int l2norm) {
    constexpr int CB = DV / SPLIT, LPR = CB / 4;
    const size_t bh = blockIdx.x / SPLIT;
    const int col0 = (blockIdx.x % SPLIT) * CB;
    const int tid = threadIdx.x, warp = tid >> LANE_BITS, lane = tid & LANE_MASK;
    const int cq = tid % LPR, rg = tid / LPR;
    float* st = state + bh * DK * DV + col0 + 4 * cq;
    float4 s[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) s[i] = *(const float4*)(st + (size_t)(rg * RPW + i) * DV);

    __shared__ float qs[DK], ks[DK], es[DK], dl[CB], nrm[2];
    __shared__ __align__(16) float red[8][CB];
    if (tid < DK) {
        qs[tid] = bf2f(q[bh * DK + tid]);
        ks[tid] = bf2f(k[bh * DK + tid]);
        es[tid] = __expf(g[bh * DK + tid]);
    }
    __syncthreads();
    if (warp < 2) {
        const float* xv = warp ? ks : qs;
        float ss = 0.f;
        for (int d = lane; d < DK; d += LANES) ss += xv[d] * xv[d];
        ss = warp_sum(ss);
        if (lane == 0) nrm[warp] = l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f;
    }
    __syncthreads();
    const float rq = nrm[0] * scale, rk = nrm[1];
    float4 kv = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = rg * RPW + i;
        const float e = es[r], kr = ks[r] * rk;
        s[i].x *= e; s[i].y *= e; s[i].z *= e; s[i].w *= e;
        kv.x += s[i].x * kr; kv.y += s[i].y * kr; kv.z += s[i].z * kr; kv.w += s[i].w * kr;
    }
    *(float4*)&red[rg][4 * cq] = kv;
    __syncthreads();
    if (tid < CB) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) t += red[w][tid];
        dl[tid] = bf2f(beta[bh]) * (bf2f(v[bh * DV + col0 + tid]) - t);
    }
    __syncthreads();
    const float4 d4 = *(const float4*)&dl[4 * cq];
    float4 op = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = rg * RPW + i;
        const float kr = ks[r] * rk, qr = qs[r] * rq;
        s[i].x += kr * d4.x; s[i].y += kr * d4.y; s[i].z += kr * d4.z; s[i].w += kr * d4.w;
        op.x += qr * s[i].x; op.y += qr * s[i].y; op.z += qr * s[i].z; op.w += qr * s[i].w;
        *(float4*)(st + (size_t)r * DV) = s[i];
    }
    *(float4*)&red[rg][4 * cq] = op;
    __syncthreads();
    if (tid < CB) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) t += red[w][tid];
        o[bh * DV + col0 + tid] = f2bf(t);
    }
}

#define KDA_DECODE_ARGS                                                                          \
    const bf16_t *__restrict__ q, const bf16_t *__restrict__ k, const bf16_t *__restrict__ v,    \
        const float *__restrict__ g, const bf16_t *__restrict__ beta, float *__restrict__ state, \
        bf16_t *__restrict__ o, float scale, int l2norm

// Occupancy targets and splits of the same step; the host picks one (see KdaKernels::decode;
// the column split by default: as fast at batch 256, faster at batch 1 and 64).
extern "C" __global__ void __launch_bounds__(256, 2) kda_decode(KDA_DECODE_ARGS) {
    kda_decode_body<1>(q, k, v, g, beta, state, o, scale, l2norm);
}
extern "C" __global__ void __launch_bounds__(256, 3) kda_decode_occ3(KDA_DECODE_ARGS) {
    kda_decode_body<1>(q, k, v, g, beta, state, o, scale, l2norm);
}
#ifndef TESSERA_HIP
// CUDA only: on CDNA this occupancy target spills registers (the HIP backend runs the two above).
extern "C" __global__ void __launch_bounds__(128, 4) kda_decode_split2(KDA_DECODE_ARGS) {
    kda_decode_body<2>(q, k, v, g, beta, state, o, scale, l2norm);
}
#endif
