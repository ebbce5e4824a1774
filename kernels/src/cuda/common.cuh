// Shared device helpers for every Tessera GPU kernel, compiled after ../gpu/port.cuh. Header-free:
// NVRTC compiles this with no CUDA include directory, so bf16 is handled as raw 16-bit words and
// tensor-core and async-copy instructions are written as inline PTX. Under hiprtc (and on CUDA
// with TESSERA_PLAIN_HELPERS, see port.cuh) the same helpers are plain device code: bf16
// rounding in integer arithmetic, the m16n8k16 product assembled from cross-lane shuffles and
// scalar FMAs (exact operands, f32 accumulation), and the asynchronous copies done synchronously
// (their commit/wait become no-ops; every reader is behind a __syncthreads() already).

typedef unsigned short bf16_t;

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }

// Round-to-nearest-even f32 -> bf16 for two values packed into one 32-bit word (lo first).
#ifndef TESSERA_PLAIN_HELPERS
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
__device__ __forceinline__ unsigned bf16_rne(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;  // NaN stays NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return bf16_rne(lo) | (bf16_rne(hi) << 16);
}
#endif

__device__ __forceinline__ bf16_t f2bf(float x) { return (bf16_t)(pack_bf16x2(x, 0.0f) & 0xffffu); }

__device__ __forceinline__ float lo_bf(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// MXFP4 codes k and k + 4 (k = 0..3) of one word in the device's bit order (cuda/mxfp4.rs) as
// out[k], one bf16x2 each, at 2^-126 of their values: a code's sign on bit 15 (31), its three
// magnitude bits on bits 8..6 (24..22), the bf16's lowest exponent bits and first mantissa bit.
__device__ __forceinline__ void mxfp4_pairs(unsigned w, unsigned out[4]) {
    const unsigned m = 0x81c081c0u;
    out[0] = w & m;
    out[1] = (w << 3) & m;
    out[2] = (w << 6) & m;
    out[3] = ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u) | ((w >> 4) & 0x00c000c0u);
}
// What turns an `mxfp4_pairs` value into the code's own, exactly (2^126).
#define MXFP4_UNSCALE 0x1p126f
// An MXFP4 block's E8M0 scale 2^(s - 127) (s = 0 the subnormal 2^-127, s = 255 NaN).
__device__ __forceinline__ float e8m0(unsigned s) {
    return s == 0 ? __uint_as_float(0x00400000u) : (s == 255 ? __int_as_float(0x7fc00000) : __uint_as_float(s << 23));
}

// D += A·B on the tensor cores: m16n8k16, bf16 operands, f32 accumulators.
// Fragment layout (g = lane/4, t = lane%4):
//   a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
#ifndef TESSERA_PLAIN_HELPERS
__device__ __forceinline__ void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
// The same product without matrix instructions: lane (g, t) gathers rows g and g+8 of A from the
// four lanes of its group g and columns 2t, 2t+1 of B from the lanes of groups 2t and 2t+1.
__device__ __forceinline__ float dot_bf16x2(unsigned a, unsigned b, float acc) {
    acc = fmaf(lo_bf(a), lo_bf(b), acc);
    return fmaf(hi_bf(a), hi_bf(b), acc);
}
__device__ __forceinline__ void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    const int lane = threadIdx.x & LANE_MASK, t = lane & 3;
#pragma unroll 1
    for (int s = 0; s < 4; ++s) {
        const int la = (lane & ~3) | s, l0 = 8 * t + s, l1 = 8 * t + 4 + s;
        const unsigned a0 = LANE_SHFL(a[0], la), a1 = LANE_SHFL(a[1], la);
        const unsigned a2 = LANE_SHFL(a[2], la), a3 = LANE_SHFL(a[3], la);
        const unsigned b00 = LANE_SHFL(b[0], l0), b01 = LANE_SHFL(b[1], l0);
        const unsigned b10 = LANE_SHFL(b[0], l1), b11 = LANE_SHFL(b[1], l1);
        c[0] = dot_bf16x2(a2, b01, dot_bf16x2(a0, b00, c[0]));
        c[1] = dot_bf16x2(a2, b11, dot_bf16x2(a0, b10, c[1]));
        c[2] = dot_bf16x2(a3, b01, dot_bf16x2(a1, b00, c[2]));
        c[3] = dot_bf16x2(a3, b11, dot_bf16x2(a1, b10, c[3]));
    }
}
#endif

// e^x with results below the normal range flushed to zero: on NVIDIA one multiply and one
// MUFU.EX2, where __expf adds three instructions (and their latency) to keep denormal results.
__device__ __forceinline__ float exp_ftz(float x) {
#if defined(__CUDA_ARCH__) && !defined(TESSERA_PLAIN_HELPERS)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
#else
    return __expf(x);
#endif
}

// A fragment of the 16x16 tile at (row0, k0) of a row-major bf16 matrix with leading dimension ld.
__device__ __forceinline__ void load_a_frag(unsigned a[4], const bf16_t* m, int ld, int row0, int k0) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
    const bf16_t* p = m + (row0 + g) * ld + k0 + 2 * t;
    a[0] = *(const unsigned*)(p);
    a[1] = *(const unsigned*)(p + 8 * ld);
    a[2] = *(const unsigned*)(p + 8);
    a[3] = *(const unsigned*)(p + 8 * ld + 8);
}

// Calls f(mt, nt, e, row, column) for each element acc[mt][nt][e] a lane holds of its warp's
// MTILES x NTILES grid of m16n8 accumulator tiles (mma_bf16_16816's c layout) whose first row is
// r0 and first column c0.
template <int MTILES, int NTILES, typename F>
__device__ __forceinline__ void for_mma_acc(int r0, int c0, F f) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                f(mt, nt, e, r0 + mt * 16 + g + (e >= 2 ? 8 : 0), c0 + nt * 8 + 2 * t + (e & 1));
}

// B fragment of the 16x8 tile at (k0, n0) of B, where B is stored transposed: bt[n][k], leading
// dimension ld (so the k pairs a thread needs are adjacent).
__device__ __forceinline__ void load_b_frag(unsigned b[2], const bf16_t* bt, int ld, int n0, int k0) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
    const bf16_t* p = bt + (n0 + g) * ld + k0 + 2 * t;
    b[0] = *(const unsigned*)(p);
    b[1] = *(const unsigned*)(p + 8);
}

// B fragment of the 16x8 tile at (k0, n0) of a row-major B in shared memory (b[k][n], leading
// dimension ld, rows 16-byte aligned): the k pairs a lane needs lie a row apart, so the two 8x8
// halves are read transposed (ldmatrix .trans; lanes 0-15 address rows k0..k0+15).
__device__ __forceinline__ void load_b_frag_kn(unsigned b[2], const bf16_t* m, int ld, int k0, int n0);
// A fragment of the 16x16 tile at (row0, k0) of an A stored transposed in shared memory
// (at[k][row], leading dimension ld, rows 16-byte aligned), read by ldmatrix .trans.
__device__ __forceinline__ void load_a_frag_t(unsigned a[4], const bf16_t* at, int ld, int row0, int k0);

#ifndef TESSERA_PLAIN_HELPERS
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy that bypasses registers (and L1).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
// Asks L2 for the 128-byte line holding p (a hint: nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// The same, writing zeros instead when `valid` is false (nothing is read then); `_at` takes the
// shared-memory address already converted.
__device__ __forceinline__ void cp_async16_zfill_at(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    cp_async16_zfill_at(smem_addr(dst), src, valid);
}
// Four 8x8 bf16 matrices from shared memory, transposed: lane l gives the row address of matrix
// l / 8, row l % 8; register i receives matrix i in the B-fragment layout of mma m16n8k16.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void load_b_frag_kn(unsigned b[2], const bf16_t* m, int ld, int k0, int n0) {
    const bf16_t* p = m + (k0 + (threadIdx.x & 15)) * ld + n0;
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(b[0]), "=r"(b[1])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void load_a_frag_t(unsigned a[4], const bf16_t* at, int ld, int row0, int k0) {
    // Lane l addresses row l % 8 of matrix l / 8: matrix m covers rows row0 + 8 (m & 1) and
    // k0 + 8 (m >> 1), which is fragment register m.
    const int l = threadIdx.x & 31, m = l >> 3;
    ldmatrix_x4_trans(a, at + (k0 + 8 * (m >> 1) + (l & 7)) * ld + row0 + 8 * (m & 1));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
#else
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    *(uint4*)dst = *(const uint4*)src;
}
__device__ __forceinline__ void prefetch_l2(const void*) {}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ void load_b_frag_kn(unsigned b[2], const bf16_t* m, int ld, int k0, int n0) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
    const bf16_t* p = m + (k0 + 2 * t) * ld + n0 + g;
    b[0] = (unsigned)p[0] | ((unsigned)p[ld] << 16);
    b[1] = (unsigned)p[8 * ld] | ((unsigned)p[9 * ld] << 16);
}
__device__ __forceinline__ void load_a_frag_t(unsigned a[4], const bf16_t* at, int ld, int row0, int k0) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const bf16_t* p = at + (k0 + 8 * (m >> 1) + 2 * t) * ld + row0 + 8 * (m & 1) + g;
        a[m] = (unsigned)p[0] | ((unsigned)p[ld] << 16);
    }
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = LANES / 2; o > 0; o >>= 1) x += LANE_SHFL_XOR(x, o);
    return x;
}
#endif

// Programmatic dependent launch (sm_90; no-ops elsewhere, and when the kernel was launched
// plainly): `grid_dep_launch` lets the next kernel of the stream, if launched as dependent,
// start once every block of this one has called it; `grid_dep_wait` waits until the kernel this
// one depends on has finished and its writes are visible.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(TESSERA_PLAIN_HELPERS)
__device__ __forceinline__ void grid_dep_launch() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#else
__device__ __forceinline__ void grid_dep_launch() {}
__device__ __forceinline__ void grid_dep_wait() {}
#endif

// Online softmax (base 2) with 8 consecutive lanes per row, as the MLA attention kernels keep
// it: the row's max and sum over its 8 lanes, then lane 0 of the 8 folds the tile into the row's
// running max `m`, sum `l` and the factor `alpha` its accumulators are rescaled by. `at` is the
// offset the tile's exponentials subtracted (the new max, or 0 while the row has seen only -inf).
__device__ __forceinline__ float max_over_8_lanes(float x) {
    x = fmaxf(x, LANE_SHFL_XOR(x, 1));
    x = fmaxf(x, LANE_SHFL_XOR(x, 2));
    return fmaxf(x, LANE_SHFL_XOR(x, 4));
}
__device__ __forceinline__ float sum_over_8_lanes(float x) {
    x += LANE_SHFL_XOR(x, 1);
    x += LANE_SHFL_XOR(x, 2);
    return x + LANE_SHFL_XOR(x, 4);
}
__device__ __forceinline__ void online_softmax_fold(float* m, float* l, float* alpha, int row,
                                                    float m_old, float m_new, float at, float sum) {
    const float a = exp2f(m_old - at);
    alpha[row] = a;
    l[row] = l[row] * a + sum;
    m[row] = m_new;
}
// An m16n8 accumulator set's rows g (c[0..1]) and g+8 (c[2..3]) times a0 and a1.
template <int N>
__device__ __forceinline__ void scale_acc_rows(float (&o)[N][4], float a0, float a1) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        o[n][0] *= a0;
        o[n][1] *= a0;
        o[n][2] *= a1;
        o[n][3] *= a1;
    }
}

// Sequence tables of the chunked KDA kernels: sequence s holds token rows
// [seq_start[s], seq_start[s+1]) and chunks [chunk_start[s], chunk_start[s+1]) of CH tokens.
struct SeqSpan {
    int tok0, len, c0, chunks;
};
__device__ __forceinline__ SeqSpan seq_span(const int* seq_start, const int* chunk_start, int s) {
    SeqSpan r;
    r.tok0 = seq_start[s];
    r.len = seq_start[s + 1] - r.tok0;
    r.c0 = chunk_start[s];
    r.chunks = chunk_start[s + 1] - r.c0;
    return r;
}
// The sequence that chunk c belongs to (chunk_start ascending, nseq + 1 entries; a sequence with
// no chunks is never returned).
__device__ __forceinline__ int seq_of_chunk(const int* chunk_start, int nseq, int c) {
    int lo = 0, hi = nseq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (chunk_start[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
// A sequence's state in the chunked KDA scans: `base + off[s] + at` floats, or none (zeros) when
// there is no base or off[s] < 0.
__device__ __forceinline__ const float* kda_seq_state_in(const float* base, const long long* off,
                                                         int s, size_t at) {
    return base && off[s] >= 0 ? base + off[s] + at : nullptr;
}
// The parameters both chunked KDA scans take after the prep's products: the state before each
// sequence (`s0`, may be null) and after it, o [tokens][ld_o], the sequence tables, and the
// total chunk count (the products are laid out [head][chunk]).
#define KDA_SCAN_STATE_ARGS                                                                        \
    const float *__restrict__ s0, const long long *__restrict__ s0_off, float *__restrict__ s_out, \
        const long long *__restrict__ s_out_off, bf16_t *__restrict__ o, int ld_o,                 \
        const int *__restrict__ seq_start, const int *__restrict__ chunk_start, int nchunks
