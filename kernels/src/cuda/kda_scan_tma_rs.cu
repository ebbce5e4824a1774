// KDA chunk scan fed by the copy engine, with the state transposed and every left operand in
// registers (sm_90a): the contract and parameters of kda_chunk_scan_tma; CR_WG warpgroups (1 or 2)
// of 64 value columns each and one copy warp per block, the warpgroups reading the same stages.
//
// The warpgroup holds S^T (the block's 64 value columns x the DK state rows, f32) as the
// accumulators of two m64n64 products, so that every product of a chunk has the value columns
// as its M and takes its left operand from registers, in bf16 pairs packed straight from an
// accumulator (the layouts agree):
//   X^T  = S^T w^T                          (B = w, K-major)
//   v^T  = u^T - X^T                        (u^T by ldmatrix.trans from the swizzled u tile)
//   O^T  = S^T (q exp(gc))^T + v^T Aqk^T    (B = q, Aqk, K-major)
//   S^T <- S^T diag(exp(gc_last)) + v^T (k exp(gc_last - gc))   (B = k, N-major)
// Only the right operands are read from shared memory, each once per chunk, straight from the
// stage the copy engine filled: nothing of the state or of v_new goes through shared memory,
// and no barrier is needed inside the warpgroup. o goes out through a small per-warp tile
// (stmatrix.trans: the accumulator holds o transposed).
//
// With two warpgroups (a build setting) a block covers 128 value columns, so a head's scan holds
// half as many multiprocessors (each block fills one with its stages), each about 1.5x as long
// per chunk: the two warpgroups' products share its tensor cores. That pays where the grid of
// one-warpgroup blocks needs more than one wave (benches/RESULTS.md).

#ifndef CR_WG
#define CR_WG 1
#endif
#define CH 64
#define CR_VT 64  // value columns per warpgroup
#if DK != 128 || DV % (CR_VT * CR_WG) != 0 || KS_VT != CR_VT * CR_WG || (CR_WG != 1 && CR_WG != 2)
#error "the register-operand copy-engine scan is built for DK = 128, 1 or 2 warpgroups of 64 columns"
#endif
#ifndef CR_STAGES
#define CR_STAGES 3
#endif
// Each warp's o tile in its warpgroup's u columns of the stage (1: 64 tokens x 16 columns, rows of
// 32 bytes with their halves swapped every 4 tokens; the stage goes back to the copy warp once
// the tile is read out), or in a region of its own (0: rows padded to 48 bytes).
#ifndef CR_O_IN_U
#define CR_O_IN_U 0
#endif
// Timing aid: a bit mask of the scan's work to leave out (1: the products, 2: the copies, 4:
// everything between the products). Results are wrong unless 0.
#ifndef CR_SKIP
#define CR_SKIP 0
#endif
#if CR_O_IN_U
#define CR_OROW 32                        // bytes per token row of a warp's o tile (16 columns)
#define CR_BAR (CR_STAGES * KS_STAGE)     // full, empty [CR_STAGES]
#else
#define CR_OROW 48                        // bytes per token row of a warp's o tile (16 columns, padded)
#define CR_OUT (CR_STAGES * KS_STAGE)     // the compute warps' o tiles
#define CR_BAR (CR_OUT + 4 * CR_WG * CH * CR_OROW)  // full, empty [CR_STAGES]
#endif
// One copy warp beside one warpgroup; beside two, a whole warpgroup of which one warp copies, so
// that registers can move from it to the compute warpgroups (setmaxnreg works by warpgroups).
#define CR_THREADS (CR_WG == 1 ? 128 + 32 : 3 * 128)

#ifdef TESSERA_TMA
// Calls f(i, row, column) for each element d[i] of a thread's m64n64 accumulator.
template <typename F>
__device__ __forceinline__ void for_acc64(F f) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            f(4 * j + e, 16 * w + (lane >> 2) + (e >= 2 ? 8 : 0), 8 * j + 2 * (lane & 3) + (e & 1));
}

// The left operand of k-step kk (columns [16 kk, 16 kk + 16) of an m64n64 accumulator d) in bf16.
__device__ __forceinline__ void acc_to_a(unsigned a[4], const float d[32], int kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = pack_bf16x2(d[8 * kk + 2 * r], d[8 * kk + 2 * r + 1]);
}

// u^T in the accumulator layout from the chunk's u tile (64 tokens x 64 columns, rows of 128
// bytes in the 128-byte swizzle at shared address u): pair p = 2 j + (row half) of the thread's
// accumulator pairs, as bf16x2 (tokens 8 j + 2 t and + 1 of its column).
__device__ __forceinline__ void load_u_t(unsigned uf[16], unsigned u) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, m = lane >> 3, r = lane & 7;
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
        // Matrix m: tokens 8 (2 jp + m / 2) + [0, 8), columns 16 w + 8 (m % 2) + [0, 8).
        const int t = 8 * (2 * jp + (m >> 1)) + r, piece = (2 * w + (m & 1)) ^ r;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(uf[4 * jp]), "=r"(uf[4 * jp + 1]), "=r"(uf[4 * jp + 2]), "=r"(uf[4 * jp + 3])
                     : "r"(u + t * 128 + piece * 16));
    }
}

// The 16-byte half `half` of token t's row in a warp's o tile, in bytes from the tile's start.
__device__ __forceinline__ int o_piece(int t, int half) {
    return t * CR_OROW + ((half ^ (CR_O_IN_U ? (t >> 2) & 1 : 0)) << 4);
}

// Writes O^T (an m64n64 accumulator: the warpgroup's columns x the chunk's tokens, as bf16 pairs
// `op`, pair p = elements 2 p and 2 p + 1) to o rows [tok, tok + n) through this warp's tile at
// shared address `tile` (64 tokens x its 16 columns).
__device__ __forceinline__ void store_o(const unsigned op[16], unsigned tile, const unsigned char* tile_p,
                                        bf16_t* o, int ld_o, int n) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, m = lane >> 3, r = lane & 7;
    __syncwarp();  // the last chunk's tile is read out
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
        // Matrix m: column half m % 2 of the warp's 16, tokens 8 (2 jp + m / 2) + [0, 8).
        const unsigned at = tile + o_piece(8 * (2 * jp + (m >> 1)) + r, m & 1);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(at), "r"(op[4 * jp]), "r"(op[4 * jp + 1]), "r"(op[4 * jp + 2]), "r"(op[4 * jp + 3])
                     : "memory");
    }
    __syncwarp();
    // Lane l moves 16-byte pieces l + 32 q: token (l + 32 q) / 2, column half l % 2.
    const int half = lane & 1;
    if (n == CH) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int t = (lane >> 1) + 16 * q;
            *(uint4*)(o + (size_t)t * ld_o + 16 * w + 8 * half) = *(const uint4*)(tile_p + o_piece(t, half));
        }
    } else {
        for (int t = lane >> 1; t < n; t += 16)
            *(uint4*)(o + (size_t)t * ld_o + 16 * w + 8 * half) = *(const uint4*)(tile_p + o_piece(t, half));
    }
}
#endif

extern "C" __global__ void __launch_bounds__(CR_THREADS, 1) kda_chunk_scan_tma_rs(const __grid_constant__ TensorMap tm_w, const __grid_constant__ TensorMap tm_q,
                   const __grid_constant__ TensorMap tm_k, const __grid_constant__ TensorMap tm_a,
                   const __grid_constant__ TensorMap tm_u, const float* __restrict__ egl_in,
                   KDA_SCAN_STATE_ARGS) {
#ifdef TESSERA_TMA
    const int vt = blockIdx.x, h = blockIdx.y, blk_col0 = vt * CR_VT * CR_WG;
    const SeqSpan sp = seq_span(seq_start, chunk_start, blockIdx.z);
    const int NC = sp.chunks;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // This warp's warpgroup and its value columns [col0, col0 + 64).
    const int wg = warp >> 2, col0 = blk_col0 + CR_VT * wg;
    const float* st0 = kda_seq_state_in(s0, s0_off, blockIdx.z, (size_t)h * DK * DV);
    float* st1 = s_out + s_out_off[blockIdx.z] + (size_t)h * DK * DV;
    // 1024-byte aligned (the host adds that much).
    extern __shared__ __align__(1024) unsigned char cr_raw[];
    unsigned char* smem = align_1k(cr_raw);
    const unsigned base = smem_addr(smem);
    const unsigned full0 = base + CR_BAR, empty0 = full0 + CR_STAGES * 8;
    if (tid == 0) {
        for (int s = 0; s < CR_STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 4 * CR_WG);  // a lane of each compute warp
        }
        mbar_init_fence();
    }
    __syncthreads();

    // The copy warp: chunk c of this sequence into stage c % CR_STAGES. (With two compute
    // warpgroups the copy warp's warpgroup gives registers up to them: 24 a thread for it, 240
    // for each of them, 64512 of 65536.)
    if (warp >= 4 * CR_WG) {
#if CR_WG == 2
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
#endif
        const size_t chunk0 = (size_t)h * nchunks + sp.c0;
        for (int c = 0; warp == 4 * CR_WG && lane == 0 && c < NC; ++c) {
            const int s = c % CR_STAGES;
            if (c >= CR_STAGES) mbar_wait(empty0 + 8 * s, (c / CR_STAGES - 1) & 1);
            if (CR_SKIP & 2)
                mbar_arrive(full0 + 8 * s);
            else
                kda_stage_copy(base + s * KS_STAGE, full0 + 8 * s, &tm_w, &tm_q, &tm_k, &tm_a, &tm_u,
                               egl_in + (chunk0 + c) * DK, (int)((chunk0 + c) * CH), blk_col0);
        }
        return;
    }
#if CR_WG == 2
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
#endif

    // S^T: ST[mt] holds state rows [64 mt, 64 mt + 64) as the accumulator's columns.
    float ST[2][32];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
        for_acc64([&](int i, int c, int d) {
            ST[mt][i] = st0 ? st0[(64 * mt + d) * DV + col0 + c] : 0.f;
        });
    // The state in bf16 as the left operand of the K = DK products, k-step kk.
    unsigned sf[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) acc_to_a(sf[kk], ST[kk >> 2], kk & 3);
    // This warpgroup's u columns of a stage, and this warp's o tile (in stage s's u columns with
    // CR_O_IN_U).
    const int u_off = KS_U + wg * CH * CR_VT * 2;
    auto tile_at = [&](int s) {
#if CR_O_IN_U
        return s * KS_STAGE + u_off + (warp & 3) * CH * CR_OROW;
#else
        return CR_OUT + warp * CH * CR_OROW;
#endif
    };
    // Chunk c's products are all in: its stage goes back to the copy warp and o goes out. (o is
    // read only once nothing is in flight: read while X^T ran, ptxas serialized every wgmma,
    // C7514; the state's decay waits for X^T for the same reason, C7518.)
    float O[32];
    auto finish = [&](int c, int s) {
        wg_wait0();
        wg_hold(O);
        unsigned op[16];
#pragma unroll
        for (int p = 0; p < 16; ++p) op[p] = pack_bf16x2(O[2 * p], O[2 * p + 1]);
        if (CR_O_IN_U) {  // every warp of the warpgroup has read its u^T from the stage
            if (wg == 0)
                asm volatile("bar.sync 1, 128;" ::: "memory");
            else
                asm volatile("bar.sync 2, 128;" ::: "memory");
        }
        __syncwarp();
        if (!CR_O_IN_U && lane == 0) mbar_arrive(empty0 + 8 * s);
        store_o(op, base + tile_at(s), smem + tile_at(s),
                o + (size_t)(sp.tok0 + c * CH) * ld_o + h * DV + col0, ld_o, min(CH, sp.len - c * CH));
        if (CR_O_IN_U) {
            // The tile is read out: the copy engine may write the stage again.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * s);
        }
    };

    // Unrolled by the stage count, so that each stage's addresses and descriptors are fixed.
    for (int c0 = 0; c0 < NC; c0 += CR_STAGES)
#pragma unroll
    for (int s = 0; s < CR_STAGES; ++s) {
        const int c = c0 + s;
        if (c >= NC) break;
        const unsigned st = base + s * KS_STAGE;
        const unsigned char* stp = smem + s * KS_STAGE;
        mbar_wait(full0 + 8 * s, (c / CR_STAGES) & 1);
        if (CR_SKIP & 1) {
            finish(c, s);
            continue;
        }
        // The stage's descriptor; an operand's is this one plus its offset in 16-byte units (the
        // stage is 1024-byte aligned and shared addresses stay below 2^18).
        const unsigned long long d0 = ks_swizzled_desc(st);
        auto w_step = [&](float (&X)[32], int kk) {
            wgmma_rs_n64<0>(X, sf[kk], d0 + ((KS_W + (kk >> 2) * KS_HALF + (kk & 3) * 32) >> 4), kk > 0);
        };
        auto q_step = [&](int kk) {
            wgmma_rs_n64<0>(O, sf[kk], d0 + ((KS_Q + (kk >> 2) * KS_HALF + (kk & 3) * 32) >> 4), kk > 0);
        };
        // S^T += v^T k (per half mt), O^T += v^T Aqk^T, k-step kk.
        auto k_step = [&](const unsigned (&v)[4], int mt, int kk) {
            wgmma_rs_n64<1>(ST[mt], v, d0 + ((KS_K + mt * KS_HALF + kk * 2 * KS_ATOM) >> 4), 1);
        };
        auto a_step = [&](const unsigned (&v)[4], int kk) {
            wgmma_rs_n64<0>(O, v, d0 + ((KS_A + kk * 32) >> 4), 1);
        };
        float X[32];
        wg_fence();
        if (CR_SKIP & 4) {
            // Timing aid: the chunk's 28 products back to back, nothing between them.
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) w_step(X, kk);
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) q_step(kk);
#pragma unroll
            for (int i = 0; i < 8; ++i) k_step(sf[i], i >> 2, i & 3);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) a_step(sf[kk], kk);
            wg_commit();
            finish(c, s);
            continue;
        }
        // X^T = S^T w^T, then O^T = S^T q^T: both wait only for the state.
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) w_step(X, kk);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) q_step(kk);
        wg_commit();
        // Meanwhile u^T.
        unsigned uf[16];
        load_u_t(uf, st + u_off);
        wg_wait1();
        wg_hold(X);
        // S^T diag(exp(gc_last)): the decay of the state's rows, the accumulator's columns.
        const float* eg = (const float*)(stp + KS_E);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            for_acc64([&](int i, int, int d) { ST[mt][i] *= eg[64 * mt + d]; });
        // v^T = u^T - X^T, in bf16 as the left operand of the K = CH products.
        unsigned vf[4][4];
#pragma unroll
        for (int p = 0; p < 16; ++p) {
            // Pair p: accumulator elements 2 p and 2 p + 1 (j = p / 2, row half p % 2).
            X[2 * p] = lo_bf(uf[p]) - X[2 * p];
            X[2 * p + 1] = hi_bf(uf[p]) - X[2 * p + 1];
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) acc_to_a(vf[kk], X, kk);
        wg_fence();
#pragma unroll
        for (int i = 0; i < 8; ++i) k_step(vf[i & 3], i >> 2, i & 3);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) a_step(vf[kk], kk);
        wg_commit();
        // The next chunk's left operand while O^T finishes.
        wg_wait1();
        wg_hold(ST[0]);
        wg_hold(ST[1]);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) acc_to_a(sf[kk], ST[kk >> 2], kk & 3);
        wg_hold(sf);
        finish(c, s);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
        for_acc64([&](int i, int c, int d) { st1[(64 * mt + d) * DV + col0 + c] = ST[mt][i]; });
#endif
}
