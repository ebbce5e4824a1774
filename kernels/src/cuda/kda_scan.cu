// KDA chunked prefill, the sequential half (compiled after kda.cu, whose configuration macros,
// layout and helpers it uses, and before kda_decode.cu, as one translation unit).

// ---------------------------------------------------------------------------------------------
// kda_chunk_scan: the sequential pass. Block = (V tile of VT columns, head, sequence): one warp
// group (4 warps) per 32 columns, so the chunk data each block stages feeds VT/32 groups. Warp
// (group g, quarter w) owns state rows [w*DK/4, (w+1)*DK/4) and chunk rows [16w, 16w+16) of
// columns [32g, 32g+32).
#define MT (DK / 64)
#define NT 4
#define WG (VT / 32)
#ifndef SCAN_STAGES
#define SCAN_STAGES 2
#endif
#define SCAN_THREADS (128 * WG)
#define S_WS 0
#define S_QS (S_WS + CH * OLD * 2)
#define S_KT (S_QS + CH * OLD * 2)
#define S_AS (S_KT + CH * OLD * 2)
#define S_US (S_AS + CH * TLD * 2)
#define S_EG (S_US + CH * ULD * 2)
#define STAGE_BYTES (S_EG + DK * 4)
#define SLD (DK + 8)
#define S_SB (SCAN_STAGES * STAGE_BYTES)
#define S_VN (S_SB + VT * SLD * 2)
#define SCAN_SMEM (S_VN + VT * TLD * 2)

// Stages one chunk's products (w, q exp(gc), k exp(gc_last - gc), Aqk, this block's u columns, exp(gc_last))
// into shared memory with asynchronous copies, as one commit group.
__device__ __forceinline__ void scan_load_stage(unsigned char* base, size_t ch, int vt, int tid,
                                                int nthreads, const bf16_t* w_in,
                                                const bf16_t* u_in, const bf16_t* qg_in,
                                                const bf16_t* kg_in, const bf16_t* aqk_in,
                                                const float* egl_in) {
    bf16_t* ws = (bf16_t*)(base + S_WS);
    bf16_t* qs = (bf16_t*)(base + S_QS);
    bf16_t* kt = (bf16_t*)(base + S_KT);
    bf16_t* as = (bf16_t*)(base + S_AS);
    bf16_t* us = (bf16_t*)(base + S_US);
    float* eg = (float*)(base + S_EG);
    for (int e = tid; e < CH * DK / 8; e += nthreads) {
        const int i = e / (DK / 8), d = (e % (DK / 8)) * 8;
        cp_async16(ws + i * OLD + d, w_in + ch * CH * DK + i * DK + d);
        cp_async16(qs + i * OLD + d, qg_in + ch * CH * DK + i * DK + d);
    }
    for (int e = tid; e < CH * DK / 8; e += nthreads) {
        const int i = e / (DK / 8), d = (e % (DK / 8)) * 8;
        cp_async16(kt + i * OLD + d, kg_in + ch * CH * DK + i * DK + d);
    }
    for (int e = tid; e < CH * CH / 8; e += nthreads) {
        const int i = e / (CH / 8), j = (e % (CH / 8)) * 8;
        cp_async16(as + i * TLD + j, aqk_in + ch * CH * CH + i * CH + j);
    }
    for (int e = tid; e < CH * VT / 8; e += nthreads) {
        const int i = e / (VT / 8), n = (e % (VT / 8)) * 8;
        cp_async16(us + i * ULD + n, u_in + ch * CH * DV + i * DV + vt * VT + n);
    }
    for (int e = tid; e < DK / 4; e += nthreads) cp_async16(eg + 4 * e, egl_in + ch * DK + 4 * e);
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS) kda_chunk_scan(
    const bf16_t* __restrict__ w_in, const bf16_t* __restrict__ u_in,
    const bf16_t* __restrict__ qg_in, const bf16_t* __restrict__ kg_in,
    const bf16_t* __restrict__ aqk_in, const float* __restrict__ egl_in,
    KDA_SCAN_STATE_ARGS) {
    const int vt = blockIdx.x, h = blockIdx.y;
    const SeqSpan sp = seq_span(seq_start, chunk_start, blockIdx.z);
    const int NC = sp.chunks;
    const int tid = threadIdx.x, lane = tid & LANE_MASK, g8 = lane >> 2, t4 = lane & 3;
    const int warp = (tid >> LANE_BITS) & 3, cb = (tid >> 7) * 32;  // row quarter, column base
    const float* st0 = kda_seq_state_in(s0, s0_off, blockIdx.z, (size_t)h * DK * DV);
    float* st1 = s_out + s_out_off[blockIdx.z] + (size_t)h * DK * DV;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* sb = (bf16_t*)(smem + S_SB);
    bf16_t* vn = (bf16_t*)(smem + S_VN);

    auto load_stage = [&](int cidx, int st) {
        scan_load_stage(smem + st * STAGE_BYTES, (size_t)h * nchunks + sp.c0 + cidx, vt, tid, SCAN_THREADS, w_in, u_in,
                        qg_in, kg_in, aqk_in, egl_in);
    };

    // This warp's state rows and columns (within the V tile), as accumulator fragments.
    const int r0 = warp * (DK / 4);
    float S[MT][NT][4];
    for_mma_acc<MT, NT>(r0, cb, [&](int mt, int nt, int e, int row, int col) {
        S[mt][nt][e] = st0 ? st0[row * DV + vt * VT + col] : 0.f;
    });

    // SCAN_STAGES-deep pipeline: chunk c's copy group is group c (empty groups pad the tail).
    for (int c = 0; c < SCAN_STAGES - 1; ++c) {
        if (c < NC) load_stage(c, c);
        else cp_async_commit();
    }
    for (int c = 0; c < NC; ++c) {
        const int st = c % SCAN_STAGES, ahead = c + SCAN_STAGES - 1;
        if (ahead < NC) load_stage(ahead, ahead % SCAN_STAGES);
        else cp_async_commit();
        cp_async_wait<SCAN_STAGES - 1>();
        unsigned char* base = smem + st * STAGE_BYTES;
        const bf16_t* ws = (const bf16_t*)(base + S_WS);
        const bf16_t* qs = (const bf16_t*)(base + S_QS);
        const bf16_t* kt = (const bf16_t*)(base + S_KT);
        const bf16_t* as = (const bf16_t*)(base + S_AS);
        const bf16_t* us = (const bf16_t*)(base + S_US);
        const float* eg = (const float*)(base + S_EG);

        for_mma_acc<MT, NT>(r0, cb, [&](int mt, int nt, int e, int row, int col) {
            sb[col * SLD + row] = f2bf(S[mt][nt][e]);
        });
        __syncthreads();

        // v_new = u - w S and the inter-chunk part of o = (q exp(gc)) S.
        float vacc[NT][4], oacc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) vacc[nt][e] = oacc[nt][e] = 0.f;
#pragma unroll
        for (int k0 = 0; k0 < DK; k0 += 16) {
            unsigned aw[4], aq[4];
            load_a_frag(aw, ws, OLD, warp * 16, k0);
            load_a_frag(aq, qs, OLD, warp * 16, k0);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned bb[2];
                load_b_frag(bb, sb, SLD, cb + nt * 8, k0);
                mma_bf16_16816(vacc[nt], aw, bb);
                mma_bf16_16816(oacc[nt], aq, bb);
            }
        }
        for_mma_acc<1, NT>(warp * 16, cb, [&](int, int nt, int e, int i, int n) {
            vn[n * TLD + i] = f2bf(bf2f(us[i * ULD + n]) - vacc[nt][e]);
        });
        __syncthreads();

        // Intra-chunk part of o: Aqk v_new.
#pragma unroll
        for (int k0 = 0; k0 < CH; k0 += 16) {
            unsigned a[4];
            load_a_frag(a, as, TLD, warp * 16, k0);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned bb[2];
                load_b_frag(bb, vn, TLD, cb + nt * 8, k0);
                mma_bf16_16816(oacc[nt], a, bb);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = warp * 16 + g8 + 8 * half, t = c * CH + i;
                if (t < sp.len) {
                    bf16_t* dst = o + (size_t)(sp.tok0 + t) * ld_o + h * DV + vt * VT + cb + nt * 8 + 2 * t4;
                    *(unsigned*)dst = pack_bf16x2(oacc[nt][2 * half], oacc[nt][2 * half + 1]);
                }
            }

        // S <- diag(exp(gc_last)) S + (k exp(gc_last - gc))^T v_new.
        for_mma_acc<MT, NT>(r0, cb, [&](int mt, int nt, int e, int row, int) {
            S[mt][nt][e] *= eg[row];
        });
#pragma unroll
        for (int k0 = 0; k0 < CH; k0 += 16) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                unsigned a[4];
                load_a_frag_t(a, kt, OLD, warp * (DK / 4) + mt * 16, k0);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    unsigned bb[2];
                    load_b_frag(bb, vn, TLD, cb + nt * 8, k0);
                    mma_bf16_16816(S[mt][nt], a, bb);
                }
            }
        }
        __syncthreads();
    }

    for_mma_acc<MT, NT>(r0, cb, [&](int mt, int nt, int e, int row, int col) {
        st1[row * DV + vt * VT + col] = S[mt][nt][e];
    });
}
