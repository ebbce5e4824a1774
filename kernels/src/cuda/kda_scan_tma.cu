// KDA chunk scan fed by the copy engine (sm_90): the arithmetic of kda_scan.cu's kda_chunk_scan (V
// tiles of 32 columns, four or eight warps, the state slice in registers, mma.sync products, the same
// contract and parameters after the products) with each chunk's operands brought into shared
// memory by tensor copies instead of by the compute threads.
//
// A stage holds w, q exp(gc), k exp(gc_last - gc) and Aqk as halves of 64 columns, each 64 rows
// of 128 bytes in the copy engine's 128-byte swizzle (16-byte unit j of row r at unit j ^ (r % 8)),
// so that ldmatrix reads 8 rows at one unit from 8 distinct bank groups; u's 32 columns as rows
// of 64 bytes. One more warp issues the copies (one lane), up to CL_STAGES chunks ahead of the
// CL_WARPS that compute. Barriers per stage: `full` (the copies' bytes and the producer's arrival)
// and `empty` (the compute warps are done with the stage). Per chunk and block the copies move
// 61952 bytes in 9 copies; the threads of kda_chunk_scan issued 4352 16-byte copies for the same.

#if DK != 128 || DV % 32 != 0
#error "the copy-engine scan is built for DK = 128 and V tiles of 32 columns"
#endif
#define CH 64
#define CL_SLD (DK + 8)
#define CL_TLD (CH + 8)
// Compute warps: 4 (a chunk row tile and all 32 columns each) or 8 (half the columns each, and
// half the state rows: half the products per warp, two warps per scheduler).
#ifndef CL_WARPS
#define CL_WARPS 8
#endif
#if CL_WARPS != 4 && CL_WARPS != 8
#error "CL_WARPS must be 4 or 8"
#endif
#ifndef CL_STAGES
#define CL_STAGES 2
#endif
// Independent partial sums per product of the first phase (1 or 2).
#ifndef CL_CHAINS
#define CL_CHAINS 2
#endif
#define CL_SB (CL_STAGES * KS_STAGE)
#define CL_VN (CL_SB + 32 * CL_SLD * 2)
#define CL_BAR (CL_VN + 32 * CL_TLD * 2)

// Byte offset of element (row, col) of a swizzled operand (halves of 64 columns).
__device__ __forceinline__ unsigned sw_off(int row, int col) {
    return (col >> 6) * KS_HALF + row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
}

#ifdef TESSERA_TMA
// A fragment of the 16x16 tile at (row0, k0) of a swizzled operand at shared address `op`;
// TRANS: the operand is stored transposed (at[k][row]).
template <bool TRANS>
__device__ __forceinline__ void sw_a_frag(unsigned a[4], unsigned op, int row0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    const unsigned p = TRANS ? op + sw_off(k0 + 8 * (m >> 1) + (l & 7), row0 + 8 * (m & 1))
                             : op + sw_off(row0 + 8 * (m & 1) + (l & 7), k0 + 8 * (m >> 1));
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p));
}

// A barrier of the compute warps (the producer warp runs on its own).
__device__ __forceinline__ void compute_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(CL_WARPS * 32) : "memory");
}

// B fragments of the two 16x8 tiles at (k0, n0) and (k0, n0 + 8) of B stored transposed
// (bt[n][k], leading dimension ld, rows 16-byte aligned): b[j] is tile j.
__device__ __forceinline__ void ldsm_b_pair(unsigned b[2][2], const bf16_t* bt, int ld, int n0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    const bf16_t* p = bt + (n0 + 8 * (m >> 1) + (l & 7)) * ld + k0 + 8 * (m & 1);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
                 : "r"(smem_addr(p)));
}
#endif

extern "C" __global__ void __launch_bounds__(CL_WARPS * 32 + 32, 1) kda_chunk_scan_tma(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_q,
                   const __grid_constant__ TensorMap tm_k, const __grid_constant__ TensorMap tm_a,
                   const __grid_constant__ TensorMap tm_u, const float* __restrict__ egl_in,
                   KDA_SCAN_STATE_ARGS) {
#ifdef TESSERA_TMA
    const int vt = blockIdx.x, h = blockIdx.y;
    const SeqSpan sp = seq_span(seq_start, chunk_start, blockIdx.z);
    const int NC = sp.chunks;
    const int tid = threadIdx.x, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3, warp = tid >> 5;
    const float* st0 = kda_seq_state_in(s0, s0_off, blockIdx.z, (size_t)h * DK * DV);
    float* st1 = s_out + s_out_off[blockIdx.z] + (size_t)h * DK * DV;
    // 1024-byte aligned (the host adds that much).
    extern __shared__ __align__(1024) unsigned char cl_raw[];
    unsigned char* smem = align_1k(cl_raw);
    bf16_t* sb = (bf16_t*)(smem + CL_SB);
    bf16_t* vn = (bf16_t*)(smem + CL_VN);
    const unsigned base = smem_addr(smem), full0 = base + CL_BAR, empty0 = full0 + CL_STAGES * 8;
    if (tid == 0) {
        for (int s = 0; s < CL_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 1);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // The producer warp: chunk c of this sequence into stage c % CL_STAGES.
    if (warp == CL_WARPS) {
        const size_t chunk0 = (size_t)h * nchunks + sp.c0;
        for (int c = 0; lane == 0 && c < NC; ++c) {
            const int s = c % CL_STAGES;
            if (c >= CL_STAGES) mbar_wait(empty0 + 8 * s, (c / CL_STAGES - 1) & 1);
            const unsigned st = base + s * KS_STAGE, bar = full0 + 8 * s;
            const int row0 = (int)((chunk0 + c) * CH);
            kda_stage_copy(st, bar, &tm_w, &tm_q, &tm_k, &tm_a, &tm_u, egl_in + (chunk0 + c) * DK, row0, vt * 32);
        }
        return;
    }

    // Compute warp w: chunk rows [16 rt, 16 rt + 16) and columns [c0, c0 + 8 NTW) of the chunk's
    // products, and state rows [SMT 16 w, SMT 16 (w + 1)) of all 32 columns.
    constexpr int NTW = 4 / (CL_WARPS / 4), SMT = 8 / CL_WARPS;
    const int rt = warp & 3, c0 = (warp >> 2) * 8 * NTW, r0 = warp * 16 * SMT;
    float S[SMT][4][4];
    for_mma_acc<SMT, 4>(r0, 0, [&](int mt, int nt, int e, int row, int col) {
        S[mt][nt][e] = st0 ? st0[row * DV + vt * 32 + col] : 0.f;
    });

    for (int c = 0; c < NC; ++c) {
        const int s = c % CL_STAGES;
        const unsigned st = base + s * KS_STAGE;
        const unsigned char* stp = smem + s * KS_STAGE;
        for_mma_acc<SMT, 4>(r0, 0, [&](int mt, int nt, int e, int row, int col) {
            sb[col * CL_SLD + row] = f2bf(S[mt][nt][e]);
        });
        mbar_wait(full0 + 8 * s, (c / CL_STAGES) & 1);
        compute_sync();

        // v_new = u - w S and the inter-chunk part of o = (q exp(gc)) S.
        // CL_CHAINS independent sums over alternate k steps shorten the chains of dependent mma.
        float vch[CL_CHAINS][NTW][4], och[CL_CHAINS][NTW][4];
#pragma unroll
        for (int ch = 0; ch < CL_CHAINS; ++ch)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) vch[ch][nt][e] = och[ch][nt][e] = 0.f;
#pragma unroll
        for (int k0 = 0; k0 < DK; k0 += 16) {
            const int ch = (k0 / 16) % CL_CHAINS;
            unsigned aw[4], aq[4], bb[NTW / 2][2][2];
            sw_a_frag<false>(aw, st + KS_W, rt * 16, k0);
            sw_a_frag<false>(aq, st + KS_Q, rt * 16, k0);
#pragma unroll
            for (int p = 0; p < NTW / 2; ++p) ldsm_b_pair(bb[p], sb, CL_SLD, c0 + 16 * p, k0);
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                mma_bf16_16816(vch[ch][nt], aw, bb[nt >> 1][nt & 1]);
                mma_bf16_16816(och[ch][nt], aq, bb[nt >> 1][nt & 1]);
            }
        }
        float (&vacc)[NTW][4] = vch[0];
        float (&oacc)[NTW][4] = och[0];
#pragma unroll
        for (int ch = 1; ch < CL_CHAINS; ++ch)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    vacc[nt][e] += vch[ch][nt][e];
                    oacc[nt][e] += och[ch][nt][e];
                }
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = rt * 16 + g8 + 8 * hf, n = c0 + nt * 8 + 2 * t4;
                const unsigned uw = *(const unsigned*)(stp + KS_U + i * 64 + n * 2);
                vn[n * CL_TLD + i] = f2bf(lo_bf(uw) - vacc[nt][2 * hf]);
                vn[(n + 1) * CL_TLD + i] = f2bf(hi_bf(uw) - vacc[nt][2 * hf + 1]);
            }
        compute_sync();

        // Intra-chunk part of o: Aqk v_new.
#pragma unroll
        for (int k0 = 0; k0 < CH; k0 += 16) {
            unsigned a[4], bb[NTW / 2][2][2];
            sw_a_frag<false>(a, st + KS_A, rt * 16, k0);
#pragma unroll
            for (int p = 0; p < NTW / 2; ++p) ldsm_b_pair(bb[p], vn, CL_TLD, c0 + 16 * p, k0);
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) mma_bf16_16816(oacc[nt], a, bb[nt >> 1][nt & 1]);
        }
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = rt * 16 + g8 + 8 * half, t = c * CH + i;
                if (t < sp.len) {
                    bf16_t* dst = o + (size_t)(sp.tok0 + t) * ld_o + h * DV + vt * 32 + c0 + nt * 8 + 2 * t4;
                    *(unsigned*)dst = pack_bf16x2(oacc[nt][2 * half], oacc[nt][2 * half + 1]);
                }
            }

        // S <- diag(exp(gc_last)) S + (k exp(gc_last - gc))^T v_new.
        const float* eg = (const float*)(stp + KS_E);
#pragma unroll
        for (int mt = 0; mt < SMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[mt][nt][e] *= eg[r0 + mt * 16 + g8 + (e >= 2 ? 8 : 0)];
#pragma unroll
        for (int k0 = 0; k0 < CH; k0 += 16) {
            unsigned bb[2][2][2];
            ldsm_b_pair(bb[0], vn, CL_TLD, 0, k0);
            ldsm_b_pair(bb[1], vn, CL_TLD, 16, k0);
#pragma unroll
            for (int mt = 0; mt < SMT; ++mt) {
                unsigned a[4];
                sw_a_frag<true>(a, st + KS_K, r0 + mt * 16, k0);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(S[mt][nt], a, bb[nt >> 1][nt & 1]);
            }
        }
        compute_sync();
        if (tid == 0) mbar_arrive(empty0 + 8 * s);
    }

    for_mma_acc<SMT, 4>(r0, 0, [&](int mt, int nt, int e, int row, int col) {
        st1[row * DV + vt * 32 + col] = S[mt][nt][e];
    });
#endif
}
