// KDA chunk scan for Hopper (sm_90a): the sequential half of the chunked prefill (see kda.cu for
// the contract and kda_chunk_prep, whose per-chunk products it reads) on warpgroup MMAs.
//
// The state is held transposed, Sᵀ [64 value columns][DK], as the f32 accumulators of one
// warpgroup (M = the block's 64 value columns in every product), so each product of a chunk takes
// its A operand straight from registers and its B operand from shared memory:
//   v_newᵀ = uᵀ − Sᵀ wᵀ                                   (K = DK)
//   oᵀ     = Sᵀ (q exp(gc))ᵀ + v_newᵀ Aqkᵀ                 (K = DK, then the chunk's tokens)
//   Sᵀ     = Sᵀ diag(exp(gc_last)) + v_newᵀ (k exp(gc_last − gc))   (K = tokens, N = DK, N-major)
// The state never leaves registers and the warps never exchange partial sums: a chunk needs one
// barrier (its staged operands have landed). Operands are staged by asynchronous copies into the
// no-swizzle core-matrix layout (wgmma.cuh), WG_SCAN_STAGES chunks deep.

// DK and DV come from the host (kda_defines), as for kda.cu.
#if DK != 128
#error "the warpgroup scan holds Sᵀ as one m64n128 accumulator: DK must be 128"
#endif
#define CH 64
#define WV 64
#ifndef WG_SCAN_STAGES
#define WG_SCAN_STAGES 2
#endif
#define ULD2 (WV + 8)
#define GRP_DK ((DK / 8) * 128)
#define GRP_CH ((CH / 8) * 128)
// One stage (bytes): w, q exp(gc) and k exp(gc_last − gc) [CH][DK], Aqk [CH][CH] in core
// matrices;
// u [CH][ULD2] (this block's columns) row-major; exp(gc_last) [DK] f32.
#define G_W 0
#define G_Q (G_W + CH * DK * 2)
#define G_K (G_Q + CH * DK * 2)
#define G_A (G_K + DK * CH * 2)
#define G_U (G_A + CH * CH * 2)
#define G_E (G_U + CH * ULD2 * 2)
#define G_STAGE (G_E + DK * 4)
#define G_O (WG_SCAN_STAGES * G_STAGE)

// d (64×N f32) += (SCALE_A·A)·B with A (64×16 bf16) from registers, in the mma.sync A-fragment
// layout of each warp's 16 rows, and B from shared memory, K-major (the _bt form: N-major).
template <int SCALE_A>
__device__ __forceinline__ void wgmma_ra_n64(float d[32], const unsigned a[4], unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "{%32,%33,%34,%35}, %36, 1, %37, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(SCALE_A));
}

__device__ __forceinline__ void wgmma_ra_n128_bt(float d[64], const unsigned a[4], unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// A operands of a 64×(16·KS) product from f32 accumulators of the same shape: k-step kk takes the
// accumulator columns 16kk..16kk+15 (the m16n8 tiles 2kk and 2kk+1).
template <int KS>
__device__ __forceinline__ void acc_to_a(unsigned a[KS][4], const float* d) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        a[kk][0] = pack_bf16x2(d[8 * kk], d[8 * kk + 1]);
        a[kk][1] = pack_bf16x2(d[8 * kk + 2], d[8 * kk + 3]);
        a[kk][2] = pack_bf16x2(d[8 * kk + 4], d[8 * kk + 5]);
        a[kk][3] = pack_bf16x2(d[8 * kk + 6], d[8 * kk + 7]);
    }
}

// Copies ROWS × (COLS/8) 16-byte pieces of a row-major bf16 matrix into the core-matrix layout:
// per warp instruction 8 rows × 4 pieces, so every 8 lanes fill one core matrix and read 64
// contiguous bytes of a row.
template <int ROWS, int COLS>
__device__ __forceinline__ void stage_cm(unsigned char* dst, const bf16_t* src, int warp, int lane) {
    constexpr int CGS = COLS / 32, UNITS = (ROWS / 8) * CGS;
    static_assert(UNITS % 4 == 0, "four warps share the units evenly");
    const int r8 = lane & 7, c4 = lane >> 3;
#pragma unroll
    for (int it = 0; it < UNITS / 4; ++it) {
        const int u = warp + 4 * it;
        const int row = (u / CGS) * 8 + r8, col = ((u % CGS) * 4 + c4) * 8;
        cp_async16(dst + cm_off(row, col, (COLS / 8) * 128), src + row * COLS + col);
    }
}

__device__ __forceinline__ void wg_scan_load(unsigned char* st, size_t ch, int v0, int tid,
                                             const bf16_t* w_in, const bf16_t* u_in,
                                             const bf16_t* qg_in, const bf16_t* kg_in,
                                             const bf16_t* aqk_in, const float* egl_in) {
    const int warp = tid >> 5, lane = tid & 31;
    stage_cm<CH, DK>(st + G_W, w_in + ch * CH * DK, warp, lane);
    stage_cm<CH, DK>(st + G_Q, qg_in + ch * CH * DK, warp, lane);
    stage_cm<CH, DK>(st + G_K, kg_in + ch * CH * DK, warp, lane);
    stage_cm<CH, CH>(st + G_A, aqk_in + ch * CH * CH, warp, lane);
#pragma unroll
    for (int it = 0; it < CH * WV / 8 / 128; ++it) {
        const int e = tid + 128 * it, i = e / (WV / 8), n = (e % (WV / 8)) * 8;
        cp_async16(st + G_U + (i * ULD2 + n) * 2, u_in + ch * CH * DV + i * DV + v0 + n);
    }
    if (tid < DK / 4) cp_async16(st + G_E + 16 * tid, egl_in + ch * DK + 4 * tid);
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(128, 1) kda_chunk_scan_wg(
    const bf16_t* __restrict__ w_in, const bf16_t* __restrict__ u_in,
    const bf16_t* __restrict__ qg_in, const bf16_t* __restrict__ kg_in,
    const bf16_t* __restrict__ aqk_in, const float* __restrict__ egl_in,
    KDA_SCAN_STATE_ARGS) {
    const int v0 = blockIdx.x * WV, h = blockIdx.y;
    const SeqSpan sp = seq_span(seq_start, chunk_start, blockIdx.z);
    const int NC = sp.chunks;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const float* st0 = kda_seq_state_in(s0, s0_off, blockIdx.z, (size_t)h * DK * DV);
    float* st1 = s_out + s_out_off[blockIdx.z] + (size_t)h * DK * DV;
    extern __shared__ __align__(128) unsigned char smem[];
    // This thread's accumulator rows: value columns v0 + ra and v0 + rb.
    const int ra = 16 * warp + g, rb = ra + 8;

    // Sᵀ: S[4j + {0,1}] = (ra, state rows 8j + 2t4 + {0,1}), S[4j + {2,3}] the same of rb.
    float S[DK / 2];
#pragma unroll
    for (int j = 0; j < DK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = 8 * j + 2 * t4 + (e & 1), v = e >= 2 ? rb : ra;
            S[4 * j + e] = st0 ? st0[d * DV + v0 + v] : 0.f;
        }

    auto load = [&](int cidx, int stg) {
        wg_scan_load(smem + stg * G_STAGE, (size_t)h * nchunks + sp.c0 + cidx, v0, tid, w_in, u_in, qg_in, kg_in,
                     aqk_in, egl_in);
    };
    for (int c = 0; c < WG_SCAN_STAGES - 1; ++c) {
        if (c < NC) load(c, c);
        else cp_async_commit();
    }
    bf16_t* os = (bf16_t*)(smem + G_O);
    for (int c = 0; c < NC; ++c) {
        const int ahead = c + WG_SCAN_STAGES - 1;
        if (ahead < NC) load(ahead, ahead % WG_SCAN_STAGES);
        else cp_async_commit();
        cp_async_wait<WG_SCAN_STAGES - 1>();
        fence_async_smem();
        __syncthreads();
        const unsigned char* base = smem + (c % WG_SCAN_STAGES) * G_STAGE;
        const bf16_t* us = (const bf16_t*)(base + G_U);

        unsigned sa[DK / 16][4];
        acc_to_a<DK / 16>(sa, S);
        float X[32], O[32];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = 8 * j + 2 * t4 + (e & 1), v = e >= 2 ? rb : ra;
                X[4 * j + e] = bf2f(us[tok * ULD2 + v]);
                O[4 * j + e] = 0.f;
            }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk)
            wgmma_ra_n64<-1>(X, sa[kk], wg_desc(base + G_W + kk * 256, 128, GRP_DK));
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk)
            wgmma_ra_n64<1>(O, sa[kk], wg_desc(base + G_Q + kk * 256, 128, GRP_DK));
        wg_commit();
        wg_wait1();

        unsigned va[CH / 16][4];
        acc_to_a<CH / 16>(va, X);
        const float* eg = (const float*)(base + G_E);
#pragma unroll
        for (int j = 0; j < DK / 8; ++j) {
            const float2 e2 = *(const float2*)(eg + 8 * j + 2 * t4);
            S[4 * j] *= e2.x;
            S[4 * j + 1] *= e2.y;
            S[4 * j + 2] *= e2.x;
            S[4 * j + 3] *= e2.y;
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < CH / 16; ++kk)
            wgmma_ra_n64<1>(O, va[kk], wg_desc(base + G_A + kk * 256, 128, GRP_CH));
#pragma unroll
        for (int kk = 0; kk < CH / 16; ++kk)
            wgmma_ra_n128_bt(S, va[kk], wg_desc(base + G_K + kk * 2 * GRP_DK, GRP_DK, 128));
        wg_commit();
        wg_wait0();

        // o: through shared memory, then 16-byte pieces of each token's row.
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = 8 * j + 2 * t4 + (e & 1), v = e >= 2 ? rb : ra;
                os[tok * ULD2 + v] = f2bf(O[4 * j + e]);
            }
        __syncthreads();
#pragma unroll
        for (int it = 0; it < CH * WV / 8 / 128; ++it) {
            const int e = tid + 128 * it, i = e / (WV / 8), n = (e % (WV / 8)) * 8, t = c * CH + i;
            if (t < sp.len)
                *(uint4*)(o + (size_t)(sp.tok0 + t) * ld_o + h * DV + v0 + n) =
                    *(const uint4*)(os + i * ULD2 + n);
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int j = 0; j < DK / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = 8 * j + 2 * t4 + (e & 1), v = e >= 2 ? rb : ra;
            st1[d * DV + v0 + v] = S[4 * j + e];
        }
}
