// MLA decode in absorbed form for Hopper with both products transposed (sm_90a, after
// mla_decode_sm90.cu; the same contract: split partials and base-2 log-sum-exps, merged by
// mla_decode_combine). A block serves TR_H heads (16, 32 or 48; K3's 96 heads are two blocks,
// none padded), where the 64-head kernels pad M to 64 heads:
//   Sᵀ = C·Qᵀ   the tile's 64 tokens are M and the heads N (m64nTR_Hk16, 36 K steps): the tile
//               is A (K-major, as the copy engine lays it down) and Q is B (K-major);
//   softmax     per head, i.e. per column of Sᵀ: a column's 64 tokens lie in one warpgroup (16
//               rows a warp), maxima exchanged between its four warps through shared memory;
//   Oᵀ += Vᵀ·Pᵀ the latent dims are M (eight m64 tiles), the heads N and the tokens K: Vᵀ is the
//               same tile read M-major (wgmma's transposed A), Pᵀ is B, N-major.
// Roles as in mla_decode_split_ws: warpgroup 0 computes Sᵀ and the softmax of tile i + 1 while
// warpgroups 1 and 2 (latent dims 0..255 and 256..511, four m64 tiles each) run tile i's
// products; tiles of 64 tokens in two stages by the copy engine (pages of whole tiles), Pᵀ and
// the rescale factors through two buffers.

#ifdef TESSERA_TMA
#ifndef MLA_TR_HEADS
#define MLA_TR_HEADS 48
#endif
#define TR_H MLA_TR_HEADS
#define TR_BN 64
#define TR_STAGES 2
#define TR_THREADS 384
#define TR_STAGE_BYTES (TR_BN * WG_D * 2)
// Bytes between 8-head groups of Q (all 72 chunks of 8 dims of a group) and of Pᵀ (its 8 token
// groups).
#define TR_QGROUP (WG_KC * 128)
#define TR_PGROUP ((TR_BN / 8) * 128)
// Accumulators a thread holds of one m64 x TR_H product, and its n8 blocks.
#define TR_NS (TR_H / 2)
#define TR_NJ (TR_H / 8)
static_assert(TR_H == 16 || TR_H == 32 || TR_H == 48, "16, 32 or 48 heads a block");

struct TrSmem {
    bf16_t q[TR_H * WG_D];
    bf16_t kv[TR_STAGES][TR_BN * WG_D];
    bf16_t p[2][TR_BN * TR_H];
    float alpha[2][TR_H];
    float red[2][4][TR_H];
    float l[TR_H], m[TR_H];
    unsigned long long full[TR_STAGES], kv_empty[TR_STAGES], p_full[2], p_empty[2];
    int rows[TR_STAGES];
};
// What the host allocates (mla.rs, `tr_smem`, besides the slack for aligning swizzled stages).
static_assert(sizeof(TrSmem) == TR_H * WG_D * 2 + TR_STAGES * TR_BN * WG_D * 2 +
                                    2 * TR_BN * TR_H * 2 + 2 * TR_H * 4 + 8 * TR_H * 4 +
                                    2 * TR_H * 4 + (2 * TR_STAGES + 4) * 8 + TR_STAGES * 4,
              "TrSmem as the host sizes it");

extern "C" __global__ void __launch_bounds__(TR_THREADS, 1)
mla_decode_split_tr(const bf16_t* __restrict__ q, const __grid_constant__ TensorMap cache_map,
                    const int* __restrict__ page_table, const int* __restrict__ seq_lens,
                    float* __restrict__ o_part, float* __restrict__ lse_part, int heads,
                    int page_size, int max_pages, int num_pages, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    TrSmem& sm = tile_smem<TrSmem>(smem_raw);
    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31;
    const int warp = wt >> 5, g = lane >> 2, t4 = lane & 3;
    const WgSplit sp(seq_lens, heads, max_pages, page_size, TR_BN, TR_H);
    if (sp.done_if_empty(o_part, lse_part, heads, tid, TR_THREADS)) return;
    const int b = sp.b, h0 = sp.h0, nh = sp.nh, len = sp.len, tile0 = sp.tile0;
    const TilePipe<TR_BN, TR_STAGES, 2> pipe{sm.kv[0], sm.full, sm.kv_empty, sm.p_full,
                                             sm.p_empty, sm.rows, &cache_map,
                                             page_table + (size_t)b * max_pages, tile0,
                                             sp.tile1 - sp.tile0, len, page_size, num_pages};
    const int ntiles = pipe.ntiles;
    pipe.start();

    constexpr unsigned long long STAGE = TR_STAGE_BYTES >> 4;
    const float ninf = -__int_as_float(0x7f800000);
    auto all_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(TR_THREADS) : "memory"); };
    auto wg0_sync = [] { asm volatile("bar.sync 2, 128;" ::: "memory"); };

    if (wg == 0) {
        // Q of this block's heads (rows past nh zero), 16 bytes a copy, rows of Q contiguous in
        // global memory: consecutive threads take consecutive chunks of a row.
        for (int i = wt; i < TR_H * WG_KC; i += 128) {
            const int r = i / WG_KC, c = i % WG_KC;
            const bool valid = r < nh;
            const bf16_t* src = q + ((size_t)b * heads + h0 + (valid ? r : 0)) * WG_D + c * 8;
            cp_async16_zfill_at(smem_addr(sm.q) + (r >> 3) * TR_QGROUP + c * 128 + (r & 7) * 16,
                                src, valid);
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_async_smem();
        wg0_sync();
        // Sᵀ: the tile as A (K-major), Q as B (K-major; a K step of 16 dims is two chunks).
        const unsigned long long da = TileLayout<TR_BN>::k_major(smem_addr(sm.kv[0]));
        const unsigned long long dq = wg_desc(sm.q, 128, TR_QGROUP);
        // This thread's tokens (rows) r0 and r1 of a tile; its heads (columns) 8j + 2·t4 + e.
        const int r0 = 16 * warp + g, r1 = r0 + 8;
        float m[TR_NJ][2], lsum[TR_NJ][2];
#pragma unroll
        for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                m[j][e] = ninf;
                lsum[j][e] = 0.0f;
            }
        for (int i = 0; i < ntiles; ++i) {
            const int st = i % TR_STAGES, pb = i & 1;
            pipe.wait_tile_zeroed(i, wt);
            float s[TR_NS];
            if (MLA_WS_PROBE & 2) {
#pragma unroll
                for (int k = 0; k < TR_NS; ++k) s[k] = 0.0f;
            } else {
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < WG_D / 16; ++kk)
                    wgmma_ss<TR_H, 0, 0>(s, da + st * STAGE + TileLayout<TR_BN>::k_step(kk),
                                         dq + kk * 16, kk > 0);
                wg_commit();
                wg_wait0();
            }
            pipe.scores_done(i, wt);
            // Scale, mask the tokens past the context, and each column's maximum over this
            // warp's 16 tokens (the 8 lanes of one t4), then over the four warps.
            const int tok0 = (tile0 + i) * TR_BN;
            const bool ok0 = tok0 + r0 < len, ok1 = tok0 + r1 < len;
            float x[TR_NJ][2];
#pragma unroll
            for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    s[4 * j + e] = ok0 ? s[4 * j + e] * scale_log2 : ninf;
                    s[4 * j + 2 + e] = ok1 ? s[4 * j + 2 + e] * scale_log2 : ninf;
                    float v = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
                    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
                    x[j][e] = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
                }
            float(*red)[TR_H] = sm.red[i & 1];
            if (g == 0)
#pragma unroll
                for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) red[warp][8 * j + 2 * t4 + e] = x[j][e];
            wg0_sync();
            float a[TR_NJ][2];
            unsigned pk0[TR_NJ], pk1[TR_NJ];
#pragma unroll
            for (int j = 0; j < TR_NJ; ++j) {
                float p0[2], p1[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * j + 2 * t4 + e;
                    const float tmax =
                        fmaxf(fmaxf(red[0][col], red[1][col]), fmaxf(red[2][col], red[3][col]));
                    const float n = fmaxf(m[j][e], tmax), base = n == ninf ? 0.0f : n;
                    a[j][e] = exp2f(m[j][e] - base);
                    m[j][e] = n;
                    p0[e] = exp2f(s[4 * j + e] - base);
                    p1[e] = exp2f(s[4 * j + 2 + e] - base);
                    lsum[j][e] = lsum[j][e] * a[j][e] + p0[e] + p1[e];
                }
                pk0[j] = pack_bf16x2(p0[0], p0[1]);
                pk1[j] = pack_bf16x2(p1[0], p1[1]);
            }
            pipe.wait_p_free(i);
            // Pᵀ (tokens × heads) N-major: core matrices of 8 tokens × 8 heads (16 bytes).
            unsigned char* pt = reinterpret_cast<unsigned char*>(sm.p[pb]);
#pragma unroll
            for (int j = 0; j < TR_NJ; ++j) {
                const int col = 8 * j + 2 * t4;
                unsigned char* at = pt + (col >> 3) * TR_PGROUP + (col & 7) * 2;
                *reinterpret_cast<unsigned*>(at + (r0 >> 3) * 128 + (r0 & 7) * 16) = pk0[j];
                *reinterpret_cast<unsigned*>(at + (r1 >> 3) * 128 + (r1 & 7) * 16) = pk1[j];
            }
            if (warp == 0 && g == 0)
#pragma unroll
                for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) sm.alpha[pb][8 * j + 2 * t4 + e] = a[j][e];
            pipe.p_written(i);
        }
        // Each column's sum over its 64 rows: the 8 lanes of one t4, then the four warps.
        wg0_sync();
#pragma unroll
        for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float v = lsum[j][e];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (g == 0) sm.red[0][warp][8 * j + 2 * t4 + e] = v;
            }
        wg0_sync();
        if (warp == 0 && g == 0)
#pragma unroll
            for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * j + 2 * t4 + e;
                    sm.l[col] = sm.red[0][0][col] + sm.red[0][1][col] + sm.red[0][2][col] +
                                sm.red[0][3][col];
                    sm.m[col] = m[j][e];
                }
        all_sync();
        return;
    }

    // Oᵀ over latent dims 256·pw + 64·mt ..: Vᵀ as A, M-major (the tile read dims-major), Pᵀ as
    // B, N-major (a K step of 16 tokens is 256 bytes).
    const int pw = wg - 1;
    float o[4][TR_NS];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int k = 0; k < TR_NS; ++k) o[mt][k] = 0.0f;
    const unsigned long long dv = TileLayout<TR_BN>::dims_major(smem_addr(sm.kv[0]), 4 * pw);
    const unsigned long long dp = wg_desc(sm.p[0], 128, TR_PGROUP);
    constexpr unsigned long long P_BUF = (TR_BN * TR_H * 2) >> 4;
    constexpr unsigned long long M_TILE = TileLayout<TR_BN>::DIMS64;
    for (int i = 0; i < ntiles; ++i) {
        const int st = i % TR_STAGES, pb = i & 1;
        pipe.wait_products(i);
#pragma unroll
        for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float a = sm.alpha[pb][8 * j + 2 * t4 + e];
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    o[mt][4 * j + e] *= a;
                    o[mt][4 * j + 2 + e] *= a;
                }
            }
        if (!(MLA_WS_PROBE & 1)) {
            wg_fence();
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int kk = 0; kk < TR_BN / 16; ++kk)
                    wgmma_ss<TR_H, 1, 1>(o[mt],
                                         dv + st * STAGE + mt * M_TILE +
                                             kk * TileLayout<TR_BN>::TOKEN_STEP,
                                         dp + pb * P_BUF + kk * 16, 1);
            wg_commit();
            wg_wait0();
        }
        pipe.products_done(i, wt);
    }
    all_sync();
    // This split's normalised Oᵀ: dims 256·pw + 64·mt + 16·warp + g (+ 8), heads 8j + 2·t4 + e
    // (those past nh not stored), and each head's log-sum-exp (by warpgroup 1).
#pragma unroll
    for (int j = 0; j < TR_NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int h = 8 * j + 2 * t4 + e;
            if (h >= nh) continue;
            const float l = sm.l[h], inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* row = o_part + (sp.part * heads + h0 + h) * WG_DV + 256 * pw + 16 * warp + g;
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                row[64 * mt] = o[mt][4 * j + e] * inv;
                row[64 * mt + 8] = o[mt][4 * j + 2 + e] * inv;
            }
        }
    if (pw == 0 && wt < nh) {
        const float l = sm.l[wt];
        lse_part[sp.part * heads + h0 + wt] = l > 0.0f ? sm.m[wt] + __log2f(l) : ninf;
    }
}
#endif
