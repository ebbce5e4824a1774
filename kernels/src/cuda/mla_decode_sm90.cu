// MLA decode in absorbed form for Hopper (sm_90a): the same contract as mla_decode_split in
// mla_decode.cu (split partials and base-2 log-sum-exps, merged by mla_decode_combine), with the
// two products on warpgroup MMAs (wgmma, operands read from shared memory by the tensor cores).
//
// One block of two warpgroups serves 64 heads (rows past `heads` are zero and never stored) and
// streams tiles of 64 tokens (cp.async, two stages). Per tile:
//   S = Q·Kᵀ   warpgroup w computes the 64 heads × tokens 32w..32w+31 (m64n32k16, K = 576);
//   softmax    in registers; the two warpgroups exchange their row maxima through shared memory,
//              write P (bf16) to shared memory and keep partial row sums to merge at the end;
//   O += P·V   warpgroup w owns latent dims 256w..256w+255 (4 × m64n64k16 per 16 tokens).
//
// Shared-memory operands are kept in the no-swizzle core-matrix layout: 8 rows × 16 bytes per
// 128-byte core matrix, the core matrices of a row group adjacent along K. Both the tile and Q
// are K-major for S; the same tile read as V is N-major (latent dims contiguous) for O.

#define WG_BN 64
#define WG_D 576
#define WG_DV 512
#define WG_HB 64
#define WG_THREADS 256
#define WG_KC (WG_D / 8)
// Bytes between row groups (8 rows) of Q and of a tile, and of P.
#define WG_GROUP (WG_KC * 128)
#define WG_PGROUP ((WG_BN / 8) * 128)

// Tiles ahead whose rows are prefetched into L2 (0: none).
#ifndef MLA_PREFETCH
#define MLA_PREFETCH 0
#endif
// 1: a warp copies 8 rows × 64 bytes per instruction; 0: 32 rows × 16 bytes.
#ifndef MLA_COALESCED
#define MLA_COALESCED 0
#endif

struct WgSmem {
    bf16_t q[WG_HB * WG_D];
    bf16_t kv[2][WG_BN * WG_D];
    bf16_t p[WG_HB * WG_BN];
    float red[2][WG_HB];
};

// d (64×32 f32) = (acc ? d : 0) + A·B, A and B K-major from shared memory.
__device__ __forceinline__ void wgmma_n32(float d[16], unsigned long long a, unsigned long long b,
                                          int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(acc));
}

// d (64×64 f32) += A·B, A K-major and B N-major from shared memory.
__device__ __forceinline__ void wgmma_n64_bt(float d[32], unsigned long long a,
                                             unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "%32, %33, 1, 1, 1, 0, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31])
        : "l"(a), "l"(b));
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
mla_decode_split_wg(const bf16_t* __restrict__ q, const bf16_t* __restrict__ cache,
                    const int* __restrict__ page_table, const int* __restrict__ seq_lens,
                    float* __restrict__ o_part, float* __restrict__ lse_part, int heads,
                    int page_size, int max_pages, int num_pages, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    WgSmem& sm = *reinterpret_cast<WgSmem*>(smem_raw);
    const int split = blockIdx.x, splits = gridDim.x;
    const int h0 = blockIdx.y * WG_HB;
    const int b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wi = (tid >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int nh = min(WG_HB, heads - h0);

    const int len = min(max(seq_lens[b], 0), max_pages * page_size);
    const int tiles = (len + WG_BN - 1) / WG_BN;
    const int per = (tiles + splits - 1) / splits;
    const int tile0 = split * per, tile1 = min(tiles, tile0 + per);
    const size_t part = (size_t)b * splits + split;

    if (tile0 >= tile1) {
        for (int i = tid; i < nh * WG_DV; i += WG_THREADS)
            o_part[(part * heads + h0) * WG_DV + i] = 0.0f;
        for (int i = tid; i < nh; i += WG_THREADS)
            lse_part[part * heads + h0 + i] = -__int_as_float(0x7f800000);
        return;
    }

    // Loads: thread tid copies row tid % 64 (one page lookup), chunks tid / 64 + 4i; eight
    // consecutive threads fill one core matrix.
    const int lr = tid & 63, lc0 = tid >> 6;
    const int* pages = page_table + (size_t)b * max_pages;
#if MLA_COALESCED
    // Row group 8·warp + lane % 8, chunks 4i + lane / 8: per instruction a warp reads 64
    // contiguous bytes of each of 8 rows and fills 4 adjacent core matrices (512 bytes).
    const int cr = 8 * (tid >> 5) + (lane & 7), cc = lane >> 3;
    auto load_tile = [&](int stage, int tile) {
        const int tok = tile * WG_BN + cr;
        const int page = tok < len ? pages[tok / page_size] : -1;
        const bool valid = page >= 0 && page < num_pages;
        const bf16_t* src =
            valid ? cache + ((size_t)page * page_size + tok % page_size) * WG_D : cache;
        unsigned char* dst = reinterpret_cast<unsigned char*>(sm.kv[stage]);
#pragma unroll
        for (int c = cc; c < WG_KC; c += 4)
            cp_async16_zfill(dst + cm_off(cr, c * 8, WG_GROUP), valid ? src + c * 8 : src, valid);
    };
#else
    auto load_tile = [&](int stage, int tile) {
        const int tok = tile * WG_BN + lr;
        const int page = tok < len ? pages[tok / page_size] : -1;
        const bool valid = page >= 0 && page < num_pages;
        const bf16_t* src =
            valid ? cache + ((size_t)page * page_size + tok % page_size) * WG_D : cache;
        unsigned char* dst = reinterpret_cast<unsigned char*>(sm.kv[stage]);
#pragma unroll
        for (int c = lc0; c < WG_KC; c += 4)
            cp_async16_zfill(dst + cm_off(lr, c * 8, WG_GROUP), valid ? src + c * 8 : src, valid);
    };
#endif
#if MLA_PREFETCH > 0
    // One bulk L2 prefetch per token row of a tile, by the first 64 threads.
    auto prefetch_tile = [&](int tile) {
        const int tok = tile * WG_BN + tid;
        if (tid >= WG_BN || tok >= len) return;
        const int page = pages[tok / page_size];
        if (page < 0 || page >= num_pages) return;
        const bf16_t* src = cache + ((size_t)page * page_size + tok % page_size) * WG_D;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "n"(WG_D * 2));
    };
    for (int t = tile0 + 1; t < min(tile1, tile0 + MLA_PREFETCH); ++t) prefetch_tile(t);
#endif
    {
        const bool valid = lr < nh;
        const bf16_t* src = q + ((size_t)b * heads + h0 + (valid ? lr : 0)) * WG_D;
        unsigned char* dst = reinterpret_cast<unsigned char*>(sm.q);
#pragma unroll
        for (int c = lc0; c < WG_KC; c += 4)
            cp_async16_zfill(dst + cm_off(lr, c * 8, WG_GROUP), src + c * 8, valid);
    }
    load_tile(0, tile0);
    cp_async_commit();

    // Rows of this thread's accumulators: r0 = 16·wi + g and r0 + 8.
    const int r0 = 16 * wi + g, r1 = r0 + 8;
    float m0 = -__int_as_float(0x7f800000), m1 = m0;
    float l0 = 0.0f, l1 = 0.0f;
    float o[4][32];
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[c][i] = 0.0f;

    const unsigned char* pbase = reinterpret_cast<const unsigned char*>(sm.p);
    for (int tile = tile0; tile < tile1; ++tile) {
        const int st = (tile - tile0) & 1;
        if (tile + 1 < tile1) load_tile(st ^ 1, tile + 1);
        cp_async_commit();
#if MLA_PREFETCH > 0
        if (tile + MLA_PREFETCH < tile1) prefetch_tile(tile + MLA_PREFETCH);
#endif
        cp_async_wait<1>();
        fence_async_smem();
        __syncthreads();
        const unsigned char* kv = reinterpret_cast<const unsigned char*>(sm.kv[st]);

        // S for tokens 32·wg .. 32·wg + 31.
        float s[16];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_D / 16; ++kk) {
            const unsigned long long da =
                wg_desc(reinterpret_cast<const unsigned char*>(sm.q) + kk * 256, 128, WG_GROUP);
            const unsigned long long db =
                wg_desc(kv + (32 * wg / 8) * WG_GROUP + kk * 256, 128, WG_GROUP);
            wgmma_n32(s, da, db, kk > 0);
        }
        wg_commit();
        wg_wait0();

        // Scale, mask and this warpgroup's row maxima. s[4j + {0,1}] is row r0, tokens
        // 32·wg + 8j + 2·t4 + {0,1}; s[4j + {2,3}] the same tokens of row r1.
        const float ninf = -__int_as_float(0x7f800000);
        float x0 = ninf, x1 = ninf;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tok = tile * WG_BN + 32 * wg + 8 * j + 2 * t4;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = tok + e < len;
                s[4 * j + e] = ok ? s[4 * j + e] * scale_log2 : ninf;
                s[4 * j + 2 + e] = ok ? s[4 * j + 2 + e] * scale_log2 : ninf;
                x0 = fmaxf(x0, s[4 * j + e]);
                x1 = fmaxf(x1, s[4 * j + 2 + e]);
            }
        }
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
        if (t4 == 0) {
            sm.red[wg][r0] = x0;
            sm.red[wg][r1] = x1;
        }
        __syncthreads();
        const float n0 = fmaxf(m0, fmaxf(sm.red[0][r0], sm.red[1][r0]));
        const float n1 = fmaxf(m1, fmaxf(sm.red[0][r1], sm.red[1][r1]));
        const float b0 = n0 == ninf ? 0.0f : n0, b1 = n1 == ninf ? 0.0f : n1;
        const float a0 = exp2f(m0 - b0), a1 = exp2f(m1 - b1);
        m0 = n0;
        m1 = n1;
        float sum0 = 0.0f, sum1 = 0.0f;
        unsigned char* pw = reinterpret_cast<unsigned char*>(sm.p);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p00 = exp2f(s[4 * j] - b0), p01 = exp2f(s[4 * j + 1] - b0);
            const float p10 = exp2f(s[4 * j + 2] - b1), p11 = exp2f(s[4 * j + 3] - b1);
            sum0 += p00 + p01;
            sum1 += p10 + p11;
            const int col = 32 * wg + 8 * j + 2 * t4;
            *reinterpret_cast<unsigned*>(pw + cm_off(r0, col, WG_PGROUP)) = pack_bf16x2(p00, p01);
            *reinterpret_cast<unsigned*>(pw + cm_off(r1, col, WG_PGROUP)) = pack_bf16x2(p10, p11);
        }
        l0 = l0 * a0 + sum0;
        l1 = l1 * a1 + sum1;
        fence_async_smem();
        __syncthreads();

        // O = alpha·O + P·V over this warpgroup's 256 latent dims.
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                o[c][4 * j] *= a0;
                o[c][4 * j + 1] *= a0;
                o[c][4 * j + 2] *= a1;
                o[c][4 * j + 3] *= a1;
            }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; ++kk) {
            const unsigned long long da = wg_desc(pbase + kk * 256, 128, WG_PGROUP);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                // V rows (tokens) 16kk.., dims 256·wg + 64c..: 128 bytes between dim groups,
                // WG_GROUP between token groups.
                const unsigned long long db =
                    wg_desc(kv + (2 * kk) * WG_GROUP + ((256 * wg + 64 * c) / 8) * 128, WG_GROUP,
                            128);
                wgmma_n64_bt(o[c], da, db);
            }
        }
        wg_commit();
        wg_wait0();
        __syncthreads();
    }
    cp_async_wait<0>();

    // Row sums: the quad's lanes, then the two warpgroups.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (t4 == 0) {
        sm.red[wg][r0] = l0;
        sm.red[wg][r1] = l1;
    }
    __syncthreads();
    l0 = sm.red[0][r0] + sm.red[1][r0];
    l1 = sm.red[0][r1] + sm.red[1][r1];
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d = 256 * wg + 64 * c + 8 * j + 2 * t4;
            if (r0 < nh)
                *reinterpret_cast<float2*>(o_part + (part * heads + h0 + r0) * WG_DV + d) =
                    make_float2(o[c][4 * j] * i0, o[c][4 * j + 1] * i0);
            if (r1 < nh)
                *reinterpret_cast<float2*>(o_part + (part * heads + h0 + r1) * WG_DV + d) =
                    make_float2(o[c][4 * j + 2] * i1, o[c][4 * j + 3] * i1);
        }
    if (wg == 0 && t4 == 0) {
        const float ninf = -__int_as_float(0x7f800000);
        if (r0 < nh)
            lse_part[part * heads + h0 + r0] = l0 > 0.0f ? m0 + __log2f(l0) : ninf;
        if (r1 < nh)
            lse_part[part * heads + h0 + r1] = l1 > 0.0f ? m1 + __log2f(l1) : ninf;
    }
}
