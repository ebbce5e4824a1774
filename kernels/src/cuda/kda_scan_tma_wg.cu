// KDA chunk scan fed by the copy engine, on warpgroup MMAs (sm_90a): the contract and parameters
// of kda_chunk_scan_tma (V tiles of 32 columns, one warp issuing tensor copies CW_STAGES chunks
// ahead), with every product a wgmma whose operands both come from shared memory, and the work
// of a chunk split between two warpgroups by role so that the state's chain never waits for the
// outputs:
//   warpgroup 0 (the state, S [DK][32] as two m64n32 f32 accumulators): per chunk c it writes
//     S in bf16 (sb), X = w S, v_new = u - X in bf16 (vn), then S = diag(exp(gc_last)) S +
//     (k exp(gc_last - gc))^T v_new (A = k read M-major) — and goes on to chunk c + 1;
//   warpgroup 1 (the outputs): o = (q exp(gc)) S + Aqk v_new from chunk c's sb and vn, then the
//     stores, while warpgroup 0 is already on the next chunk.
// sb and vn are double-buffered; mbarriers say when a buffer is ready (warpgroup 0, after its
// writes) and free again (warpgroup 1, after its products), and when a stage is empty (all 256
// compute threads are done with it). A warpgroup reads each operand once for its 64 rows, where
// eight mma.sync warps read the chunk's w and q twice and S's bf16 copy four times: the
// mma.sync scan is bound by the bytes its warps move through shared memory.
//
// Layouts in shared memory: w, q, k and Aqk arrive as kda_chunk_scan_tma's (halves of 64
// columns, rows of 128 bytes in the 128-byte swizzle), which the wgmma descriptors read in
// that swizzle: K-major for w, q and Aqk, M-major for k (a half of k is one 64-row swizzle atom
// column of the state rows). sb (K = state rows) and vn (K = tokens) are written by stmatrix as
// planes without swizzle: column group j (8 elements, 16 bytes) of all 32 rows (the block's
// columns) is one plane of 512 bytes, so the core matrix of row group i and column group j lies
// at 512 j + 128 i. (Boxes landing as planes straight from the copy engine were slower: it moves
// 16 bytes per box row.)

#if DK != 128 || DV % 32 != 0
#error "the warpgroup copy-engine scan is built for DK = 128 and V tiles of 32 columns"
#endif
#define CH 64
#define CW_VT 32
#ifndef CW_STAGES
#define CW_STAGES 2
#endif
#define CW_SPLANE (CW_VT * 16)  // a column group of sb and vn
#define CW_SBB (DK * CW_VT * 2)  // one sb buffer
#define CW_VNB (CH * CW_VT * 2)  // one vn buffer
#define CW_SB (CW_STAGES * KS_STAGE)
#define CW_VN (CW_SB + 2 * CW_SBB)
#define CW_BAR (CW_VN + 2 * CW_VNB)  // full, empty [CW_STAGES]; ready, freed [2]
#define CW_THREADS (2 * 128 + 32)
// Blocks per cluster (1, 2 or 4; DV / 32 must be a multiple): the V tiles of a head in one
// cluster bring the chunk's w, q, k and Aqk once, by multicast copies, instead of each its own.
#ifndef CW_CLUSTER
#define CW_CLUSTER 1
#endif
#if CW_CLUSTER > 1
#define CW_CLUSTER_DIMS __cluster_dims__(CW_CLUSTER, 1, 1)
#else
#define CW_CLUSTER_DIMS
#endif

#ifdef TESSERA_TMA
// d = A S over the DK state rows: A (64 x DK, K-major) in swizzled halves from shared address
// a, S in bf16 planes from sb.
__device__ __forceinline__ void times_state(float d[16], unsigned a, unsigned sb) {
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
        wgmma_n32<0>(d, ks_swizzled_desc(a + (kk / 4) * KS_HALF + (kk % 4) * 32),
                  wg_desc_at(sb + kk * 2 * CW_SPLANE, CW_SPLANE, 128), kk > 0);
}

// Stores a warp's rows [16 w, 16 w + 16) of an m64n32 accumulator (d, rows from r0) in bf16,
// transposed into planes of 32 rows (the block's columns) at shared address `dst`: element
// (row, col) at (row / 8) 512 + col 16 + (row % 8) 2. Four 8x8 matrices per stmatrix.
__device__ __forceinline__ void store_planes(unsigned dst, int r0, const float d[16]) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, i = lane >> 3, r = lane & 7;
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
        // Matrix i of this stmatrix: row half i & 1 of the warp's 16 rows, column block 2 jp + i / 2.
        const unsigned at = dst + ((r0 + 16 * w + 8 * (i & 1)) >> 3) * CW_SPLANE + (8 * (2 * jp + (i >> 1)) + r) * 16;
        const int j0 = 4 * (2 * jp), j1 = 4 * (2 * jp + 1);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(at), "r"(pack_bf16x2(d[j0], d[j0 + 1])), "r"(pack_bf16x2(d[j0 + 2], d[j0 + 3])),
                     "r"(pack_bf16x2(d[j1], d[j1 + 1])), "r"(pack_bf16x2(d[j1 + 2], d[j1 + 3]))
                     : "memory");
    }
}

// Calls f(i, row, column) for each element d[i] of a thread's m64n32 accumulator (rows from r0).
template <typename F>
__device__ __forceinline__ void for_acc(int r0, F f) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            f(4 * j + e, r0 + 16 * w + (lane >> 2) + (e >= 2 ? 8 : 0), 8 * j + 2 * (lane & 3) + (e & 1));
}
#endif

extern "C" __global__ void CW_CLUSTER_DIMS __launch_bounds__(CW_THREADS, 1) kda_chunk_scan_tma_wg(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_q,
                   const __grid_constant__ TensorMap tm_k, const __grid_constant__ TensorMap tm_a,
                   const __grid_constant__ TensorMap tm_u, const float* __restrict__ egl_in,
                   KDA_SCAN_STATE_ARGS) {
#ifdef TESSERA_TMA
    const int vt = blockIdx.x, h = blockIdx.y, col0 = vt * CW_VT;
    const SeqSpan sp = seq_span(seq_start, chunk_start, blockIdx.z);
    const int NC = sp.chunks;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* st0 = kda_seq_state_in(s0, s0_off, blockIdx.z, (size_t)h * DK * DV);
    float* st1 = s_out + s_out_off[blockIdx.z] + (size_t)h * DK * DV;
    // 1024-byte aligned (the host adds that much).
    extern __shared__ __align__(1024) unsigned char cw_raw[];
    unsigned char* smem = align_1k(cw_raw);
    const unsigned base = smem_addr(smem), sb0 = base + CW_SB, vn0 = base + CW_VN;
    const unsigned full0 = base + CW_BAR, empty0 = full0 + CW_STAGES * 8;
    const unsigned ready0 = empty0 + CW_STAGES * 8, freed0 = ready0 + 16;
    if (tid == 0) {
        for (int s = 0; s < CW_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            // Every compute thread; with a cluster, every compute warp of every block.
            mbar_init(empty0 + 8 * s, CW_CLUSTER > 1 ? 8 * CW_CLUSTER : 256);
        }
        for (int b = 0; b < 2; ++b) {
            mbar_init(ready0 + 8 * b, 1);
            mbar_init(freed0 + 8 * b, 128);
        }
        mbar_init_fence();
    }
#if CW_CLUSTER > 1
    cluster_sync();  // the peers' barriers exist before any copy or arrival reaches them
    const unsigned rank = cluster_rank();
#else
    __syncthreads();
#endif
    // A stage is done with in this block: tell its producer (and, in a cluster, every peer's).
    auto release = [&](int s) {
#if CW_CLUSTER > 1
        __syncwarp();
        if (lane == 0)
            for (unsigned r = 0; r < CW_CLUSTER; ++r) mbar_arrive_in(empty0 + 8 * s, r);
#else
        mbar_arrive(empty0 + 8 * s);
#endif
    };

    // The copy warp: chunk c of this sequence into stage c % CW_STAGES.
    if (warp == 8) {
        const size_t chunk0 = (size_t)h * nchunks + sp.c0;
        for (int c = 0; lane == 0 && c < NC; ++c) {
            const int s = c % CW_STAGES;
            if (c >= CW_STAGES) mbar_wait(empty0 + 8 * s, (c / CW_STAGES - 1) & 1);
            const unsigned st = base + s * KS_STAGE, bar = full0 + 8 * s;
            const int row0 = (int)((chunk0 + c) * CH);
#if CW_CLUSTER > 1
            kda_stage_copy_shared(st, bar, &tm_w, &tm_q, &tm_k, &tm_a, &tm_u, egl_in + (chunk0 + c) * DK,
                                  row0, col0, rank, CW_CLUSTER);
#else
            kda_stage_copy(st, bar, &tm_w, &tm_q, &tm_k, &tm_a, &tm_u, egl_in + (chunk0 + c) * DK, row0, col0);
#endif
        }
#if CW_CLUSTER > 1
        __syncwarp();
        cluster_sync();  // no block leaves while a peer may still write into it
#endif
        return;
    }

    if (warp < 4) {
        // Warpgroup 0: the state, rows [64 mt, 64 mt + 64) in S[mt].
        float S[2][16];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            for_acc(64 * mt, [&](int i, int row, int col) {
                S[mt][i] = st0 ? st0[row * DV + col0 + col] : 0.f;
            });
        for (int c = 0; c < NC; ++c) {
            const int s = c % CW_STAGES, b = c & 1;
            const unsigned st = base + s * KS_STAGE, sb = sb0 + b * CW_SBB, vn = vn0 + b * CW_VNB;
            const unsigned char* stp = smem + s * KS_STAGE;
            // S into sb once warpgroup 1 is done with this buffer's last chunk.
            if (c >= 2) mbar_wait(freed0 + 8 * b, ((c >> 1) - 1) & 1);
            store_planes(sb, 0, S[0]);
            store_planes(sb, 64, S[1]);
            fence_async_smem();
            asm volatile("bar.sync 2, 128;" ::: "memory");
            mbar_wait(full0 + 8 * s, (c / CW_STAGES) & 1);

            // X = w S.
            float X[16];
            wg_fence();
            times_state(X, st + KS_W, sb);
            wg_commit();
            wg_wait0();
            // v_new = u - X into vn; then warpgroup 1 may take this chunk.
            for_acc(0, [&](int i, int row, int col) {
                if ((i & 1) == 0) {
                    const unsigned uw = *(const unsigned*)(stp + KS_U + (row * CW_VT + col) * 2);
                    X[i] = lo_bf(uw) - X[i];
                    X[i + 1] = hi_bf(uw) - X[i + 1];
                }
            });
            store_planes(vn, 0, X);
            fence_async_smem();
            asm volatile("bar.sync 2, 128;" ::: "memory");
            if (tid == 0) mbar_arrive(ready0 + 8 * b);

            // S = diag(exp(gc_last)) S + k^T v_new.
            const float* eg = (const float*)(stp + KS_E);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                for_acc(64 * mt, [&](int i, int row, int) { S[mt][i] *= eg[row]; });
            wg_fence();
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int kk = 0; kk < CH / 16; ++kk)
                    wgmma_n32<1>(S[mt], ks_swizzled_desc(st + KS_K + mt * KS_HALF + kk * 2 * KS_ATOM),
                              wg_desc_at(vn + kk * 2 * CW_SPLANE, CW_SPLANE, 128), 1);
            wg_commit();
            wg_wait0();
            release(s);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            for_acc(64 * mt, [&](int i, int row, int col) { st1[row * DV + col0 + col] = S[mt][i]; });
    } else {
        // Warpgroup 1: o = (q exp(gc)) S + Aqk v_new from the chunk's sb and vn.
        for (int c = 0; c < NC; ++c) {
            const int s = c % CW_STAGES, b = c & 1;
            const unsigned st = base + s * KS_STAGE, sb = sb0 + b * CW_SBB, vn = vn0 + b * CW_VNB;
            mbar_wait(ready0 + 8 * b, (c >> 1) & 1);
            mbar_wait(full0 + 8 * s, (c / CW_STAGES) & 1);
            float O[16];
            wg_fence();
            times_state(O, st + KS_Q, sb);
#pragma unroll
            for (int kk = 0; kk < CH / 16; ++kk)
                wgmma_n32<0>(O, ks_swizzled_desc(st + KS_A + kk * 32),
                          wg_desc_at(vn + kk * 2 * CW_SPLANE, CW_SPLANE, 128), 1);
            wg_commit();
            wg_wait0();
            mbar_arrive(freed0 + 8 * b);
            for_acc(0, [&](int i, int row, int col) {
                const int t = c * CH + row;
                if ((i & 1) == 0 && t < sp.len)
                    *(unsigned*)(o + (size_t)(sp.tok0 + t) * ld_o + h * DV + col0 + col) =
                        pack_bf16x2(O[i], O[i + 1]);
            });
            release(s);
        }
    }
#if CW_CLUSTER > 1
    cluster_sync();
#endif
#endif
}
