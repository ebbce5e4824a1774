// KDA short convolution: causal depthwise conv over time followed by SiLU, the q/k/v conv of the
// KDA layers. out[t, c] = silu(Σ_j w[c, j] · xx[t + j, c]) with xx = state ++ x, where the state
// holds each channel's previous K - 1 inputs, oldest first. bf16 x/weight/state/out, f32 sums in
// increasing j (the order of the CPU backend's short_conv_silu).
//
// conv_prefill_bf16: one sequence [T, C]; a block covers CONV_THREADS channels × CONV_ROWS steps,
// so a long prefill fills the GPU. The new state goes to a separate buffer (blocks of the first
// rows read the old one while the last rows' blocks write).
// conv_update_bf16: one token per sequence [B, C] with the state [B, C, K - 1] rolled in place;
// each thread owns one (sequence, channel), so the in-place update is race-free.
// CONV_K (the kernel size, default 4) is fixed at compile time so the window stays in registers.

#ifndef CONV_THREADS
#define CONV_THREADS 128
#endif
#ifndef CONV_ROWS
#define CONV_ROWS 16
#endif
#ifndef CONV_K
#define CONV_K 4
#endif

__device__ __forceinline__ float silu_f(float s) { return s / (1.0f + __expf(-s)); }

extern "C" __global__ void __launch_bounds__(CONV_THREADS)
conv_prefill_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ weight,
                  const bf16_t* __restrict__ state_in, bf16_t* __restrict__ state_out,
                  bf16_t* __restrict__ out, int T, int C) {
    constexpr int K = CONV_K;
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= C) return;
    const int t0 = blockIdx.y * CONV_ROWS;
    constexpr int hist = K - 1;
    float w[K];
    for (int j = 0; j < K; ++j) w[j] = bf2f(weight[(size_t)c * K + j]);
    // Window of the K inputs row t reads: xx[t .. t + K - 1], i.e. x[t - hist .. t].
    float win[K];
    for (int j = 0; j < hist; ++j) {
        const int i = t0 + j;  // index into xx
        win[j] = i < hist ? bf2f(state_in[(size_t)c * hist + i]) : bf2f(x[(size_t)(i - hist) * C + c]);
    }
    const int t1 = min(T, t0 + CONV_ROWS);
    for (int t = t0; t < t1; ++t) {
        win[hist] = bf2f(x[(size_t)t * C + c]);
        float s = w[0] * win[0];
        for (int j = 1; j < K; ++j) s = fmaf(w[j], win[j], s);
        out[(size_t)t * C + c] = f2bf(silu_f(s));
        for (int j = 0; j < hist; ++j) win[j] = win[j + 1];
    }
    // The new state is xx[T .. T + hist - 1]; the block holding row T - 1 writes it.
    if (t1 == T) {
        for (int j = 0; j < hist; ++j) {
            const int i = T + j;
            state_out[(size_t)c * hist + j] =
                i < hist ? state_in[(size_t)c * hist + i] : x[(size_t)(i - hist) * C + c];
        }
    }
}

extern "C" __global__ void __launch_bounds__(CONV_THREADS)
conv_update_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ weight,
                 bf16_t* __restrict__ state, bf16_t* __restrict__ out, int C) {
    constexpr int K = CONV_K;
    const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
    if (c >= C) return;
    const size_t b = blockIdx.y;
    constexpr int hist = K - 1;
    bf16_t* st = state + (b * C + c) * hist;
    const bf16_t xn = x[b * C + c];
    float s = 0.0f;
    for (int j = 0; j < K; ++j) {
        const float v = bf2f(j < hist ? st[j] : xn);
        const float wj = bf2f(weight[(size_t)c * K + j]);
        s = j == 0 ? wj * v : fmaf(wj, v, s);
    }
    out[b * C + c] = f2bf(silu_f(s));
    for (int j = 0; j + 1 < hist; ++j) st[j] = st[j + 1];
    if constexpr (hist > 0) st[hist - 1] = xn;
}
