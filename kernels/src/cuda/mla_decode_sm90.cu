// MLA decode in absorbed form for Hopper (sm_90a): the same contract as mla_decode_split in
// mla_decode.cu (split partials and base-2 log-sum-exps, merged by mla_decode_combine), with the
// two products on warpgroup MMAs (wgmma, operands read from shared memory by the tensor cores).
//
// A block serves 64 heads (rows past `heads` are zero and never stored). Two split kernels:
//   mla_decode_split_ws   pages of whole tiles (32 or 64 tokens): the copy engine brings tiles
//                         into four or two stages and the warpgroups split the roles (S and
//                         softmax; P·V of each half of the latent), so that one tile's P·V runs
//                         beside the next S;
//   mla_decode_split_wg   any page size: tiles copied by the threads (cp.async), two stages,
//                         two warpgroups and tiles of 64 tokens, per tile:
//   S = Q·Kᵀ   warpgroup w computes the 64 heads × tokens 32w..32w+31 (m64n32k16, K = 576);
//   softmax    in registers; the two warpgroups exchange their row maxima through shared memory,
//              write P (bf16) to shared memory and keep partial row sums to merge at the end;
//   O += P·V   warpgroup w owns latent dims 256w..256w+255 (one m64n256k16 per 16 tokens).
//
// Shared-memory operands copied by threads are kept in the no-swizzle core-matrix layout: 8 rows
// × 16 bytes per 128-byte core matrix, the core matrices of a row group adjacent along K; the
// copy engine's tiles by default in its 128-byte swizzle (TileLayout). Both the tile and Q are
// K-major for S; the same tile read as V is N-major (latent dims contiguous) for O.

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

// d (64×256 f32) += A·B, A K-major and B N-major from shared memory.
__device__ __forceinline__ void wgmma_n256_bt(float d[128], unsigned long long a,
                                              unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
        "%128, %129, 1, 1, 1, 0, 1;\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
          "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
          "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
          "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
          "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
          "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b));
}

// This block's sequence b, heads h0.. (nh of them, blocks of hb heads) and its split's range of
// tiles of bn tokens and place in the partials.
struct WgSplit {
    int b, h0, nh, len, tile0, tile1;
    size_t part;
    __device__ WgSplit(const int* seq_lens, int heads, int max_pages, int page_size, int bn,
                       int hb = WG_HB) {
        const int split = blockIdx.x, splits = gridDim.x;
        b = blockIdx.z;
        h0 = blockIdx.y * hb;
        nh = min(hb, heads - h0);
        len = min(max(seq_lens[b], 0), max_pages * page_size);
        const int tiles = (len + bn - 1) / bn;
        const int per = (tiles + splits - 1) / splits;
        tile0 = split * per;
        tile1 = min(tiles, tile0 + per);
        part = (size_t)b * splits + split;
    }
    // An empty split stores weight zero for the combine (threads 0..n-1 write) and is done.
    __device__ bool done_if_empty(float* o_part, float* lse_part, int heads, int t, int n) const {
        if (tile0 < tile1) return false;
        for (int i = t; i < nh * WG_DV; i += n) o_part[(part * heads + h0) * WG_DV + i] = 0.0f;
        for (int i = t; i < nh; i += n) lse_part[part * heads + h0 + i] = -__int_as_float(0x7f800000);
        return true;
    }
};

// Score helpers of one thread's NS values of an m64n(2·NS) accumulator (NS = 16 for 32 tokens,
// 32 for 64): s[4j + {0,1}] row r0, tokens tok0 + 8j + 2·t4 + {0,1}; s[4j + {2,3}] the same
// tokens of row r1.

// Scales by scale_log2 and masks tokens past len (-inf); returns the rows' maxima over the quad
// (the four lanes that hold a row's tokens).
template <int NS>
__device__ __forceinline__ void scores_mask_max(float (&s)[NS], int tok0, int t4, int len,
                                                float scale_log2, float& x0, float& x1) {
    const float ninf = -__int_as_float(0x7f800000);
    x0 = x1 = ninf;
#pragma unroll
    for (int j = 0; j < NS / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const bool ok = tok0 + 8 * j + 2 * t4 + e < len;
            s[4 * j + e] = ok ? s[4 * j + e] * scale_log2 : ninf;
            s[4 * j + 2 + e] = ok ? s[4 * j + 2 + e] * scale_log2 : ninf;
            x0 = fmaxf(x0, s[4 * j + e]);
            x1 = fmaxf(x1, s[4 * j + 2 + e]);
        }
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
}

// One step of the online softmax for rows r0 and r1, whose maxima over this tile are x0 and x1:
// the running maxima m (base 2) and this thread's running sums l move on, p = 2^(s - m) as bf16
// pairs (pk[2j] row r0, pk[2j + 1] row r1), and a0 / a1 are the factors that rescale what was
// accumulated before.
template <int NS>
__device__ __forceinline__ void softmax_step(const float (&s)[NS], float x0, float x1, float& m0,
                                             float& m1, float& l0, float& l1,
                                             unsigned (&pk)[NS / 2], float& a0, float& a1) {
    const float ninf = -__int_as_float(0x7f800000);
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
    const float b0 = n0 == ninf ? 0.0f : n0, b1 = n1 == ninf ? 0.0f : n1;
    a0 = exp2f(m0 - b0);
    a1 = exp2f(m1 - b1);
    m0 = n0;
    m1 = n1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int j = 0; j < NS / 4; ++j) {
        const float p00 = exp2f(s[4 * j] - b0), p01 = exp2f(s[4 * j + 1] - b0);
        const float p10 = exp2f(s[4 * j + 2] - b1), p11 = exp2f(s[4 * j + 3] - b1);
        sum0 += p00 + p01;
        sum1 += p10 + p11;
        pk[2 * j] = pack_bf16x2(p00, p01);
        pk[2 * j + 1] = pack_bf16x2(p10, p11);
    }
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
}

// O's rows r0 (o[4j + {0,1}]) and r1 (o[4j + {2,3}]) times a0 and a1.
__device__ __forceinline__ void rescale_rows(float (&o)[128], float a0, float a1) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        o[4 * j] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
    }
}

// P of rows r0 and r1 (pairs from softmax_step) into a core-matrix tile with `group` bytes per
// row group, at columns col0 + 8j + 2·t4.
template <int NP>
__device__ __forceinline__ void store_p(unsigned char* p, const unsigned (&pk)[NP], int r0,
                                        int col0, int t4, unsigned group) {
#pragma unroll
    for (int j = 0; j < NP / 2; ++j) {
        const int col = col0 + 8 * j + 2 * t4;
        *reinterpret_cast<unsigned*>(p + cm_off(r0, col, group)) = pk[2 * j];
        *reinterpret_cast<unsigned*>(p + cm_off(r0 + 8, col, group)) = pk[2 * j + 1];
    }
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A split's normalised O for rows r0 and r1 (row sums s0, s1) over latent dims d0..d0+255, and
// the rows' log-sum-exps (maxima m0, m1; stored only when lse is true); rows past nh are not
// stored.
__device__ __forceinline__ void store_rows(const float (&o)[128], float* o_part, float* lse_part,
                                           size_t part, int heads, int h0, int nh, int r0, int d0,
                                           int t4, float s0, float s1, float m0, float m1,
                                           bool lse) {
    const int r1 = r0 + 8;
    const float i0 = s0 > 0.0f ? 1.0f / s0 : 0.0f, i1 = s1 > 0.0f ? 1.0f / s1 : 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int d = d0 + 8 * j + 2 * t4;
        if (r0 < nh)
            *reinterpret_cast<float2*>(o_part + (part * heads + h0 + r0) * WG_DV + d) =
                make_float2(o[4 * j] * i0, o[4 * j + 1] * i0);
        if (r1 < nh)
            *reinterpret_cast<float2*>(o_part + (part * heads + h0 + r1) * WG_DV + d) =
                make_float2(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
    }
    if (lse && t4 == 0) {
        const float ninf = -__int_as_float(0x7f800000);
        if (r0 < nh) lse_part[part * heads + h0 + r0] = s0 > 0.0f ? m0 + __log2f(s0) : ninf;
        if (r1 < nh) lse_part[part * heads + h0 + r1] = s1 > 0.0f ? m1 + __log2f(s1) : ninf;
    }
}

// One consumer thread's two accumulator rows (r0 = 16·warp + g and r0 + 8 of its warpgroup's
// 64 heads): running max and sum (base 2) and O over the warpgroup's 256 latent dims, o[4j +
// {0,1}] row r0, dims 8j + 2·t4 + {0,1}; o[4j + {2,3}] the same dims of row r1.
struct WgRows {
    int wg, r0, r1, t4;
    float m0, m1, l0, l1;
    float o[128];

    __device__ WgRows(int tid) {
        const int lane = tid & 31;
        wg = tid >> 7;
        r0 = 16 * ((tid >> 5) & 3) + (lane >> 2);
        r1 = r0 + 8;
        t4 = lane & 3;
        m0 = m1 = -__int_as_float(0x7f800000);
        l0 = l1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    }

    // Scores (this warpgroup's 32 tokens of the tile) to P: scale and mask, the block's row
    // maxima through `red` (sync: a barrier over both warpgroups), P in bf16 into `p` (the
    // core-matrix layout), running sums; O is rescaled for the new maxima.
    template <typename Sync>
    __device__ __forceinline__ void softmax(float (&s)[16], int tile, int len, float scale_log2,
                                            float (*red)[WG_HB], unsigned char* p, Sync sync) {
        float x0, x1;
        scores_mask_max(s, tile * WG_BN + 32 * wg, t4, len, scale_log2, x0, x1);
        if (t4 == 0) {
            red[wg][r0] = x0;
            red[wg][r1] = x1;
        }
        sync();
        unsigned pk[8];
        float a0, a1;
        softmax_step(s, fmaxf(red[0][r0], red[1][r0]), fmaxf(red[0][r1], red[1][r1]), m0, m1, l0,
                     l1, pk, a0, a1);
        store_p(p, pk, r0, 32 * wg, t4, WG_PGROUP);
        rescale_rows(o, a0, a1);
    }

    // Issues O += P·V: P's descriptor `dp`, V's (this warpgroup's dims, K step `v_step` in 16
    // bytes); the caller fences, commits and waits.
    __device__ __forceinline__ void pv_issue(unsigned long long dp, unsigned long long dv,
                                             unsigned long long v_step) {
#pragma unroll
        for (int kk = 0; kk < WG_BN / 16; ++kk) wgmma_n256_bt(o, dp + kk * 16, dv + kk * v_step);
    }

    // The split's normalised O and log-sum-exp per head (rows past nh not stored).
    template <typename Sync>
    __device__ __forceinline__ void store(float (*red)[WG_HB], float* o_part, float* lse_part,
                                          size_t part, int heads, int h0, int nh, Sync sync) {
        l0 = quad_sum(l0);
        l1 = quad_sum(l1);
        if (t4 == 0) {
            red[wg][r0] = l0;
            red[wg][r1] = l1;
        }
        sync();
        const float s0 = red[0][r0] + red[1][r0], s1 = red[0][r1] + red[1][r1];
        store_rows(o, o_part, lse_part, part, heads, h0, nh, r0, 256 * wg, t4, s0, s1, m0, m1,
                   wg == 0);
    }
};

// Issues S for 32 or 64 tokens (NS = 16 or 32 values a thread): 36 K steps of m64n32k16 or
// m64n64k16 (Q and the tile K-major), Q's each `q_step` (in 16 bytes) on, the tile's descriptor
// of step kk from `k_at(kk)`; the first QREG steps (64 tokens only) take Q from the registers
// `qa` instead (A's fragments, as wgmma_rs_n64 reads them); `before(kk)` runs before step kk is
// issued (waits for the tile's part that the step reads). The caller fences, commits and waits.
struct NoWait {
    __device__ void operator()(int) const {}
};
template <int NS, int QREG = 0, typename KAt, typename Before = NoWait>
__device__ __forceinline__ void wg_scores_issue(float (&s)[NS], unsigned long long dq,
                                                unsigned long long q_step, KAt k_at,
                                                const unsigned (*qa)[4] = nullptr,
                                                Before before = {}) {
    static_assert(NS == 16 || NS == 32, "32 or 64 tokens");
    static_assert(QREG == 0 || NS == 32, "Q from registers at 64 tokens");
#pragma unroll
    for (int kk = 0; kk < WG_D / 16; ++kk) {
        before(kk);
        if constexpr (QREG > 0) {
            if (kk < QREG) {
                wgmma_rs_n64(s, qa[kk], k_at(kk), kk > 0);
                continue;
            }
        }
        if constexpr (NS == 16)
            wgmma_n32(s, dq + kk * q_step, k_at(kk), kk > 0);
        else
            wgmma_n64(s, dq + kk * q_step, k_at(kk), kk > 0);
    }
}

// Q of this block's heads into shared memory (core-matrix layout) by `n` threads with cp.async
// (rows past nh zero); the caller commits and waits.
template <int N>
__device__ __forceinline__ void wg_load_q(const bf16_t* q, bf16_t* sq, int b, int heads, int h0,
                                          int nh, int t) {
    constexpr int STEP = N / 64;  // chunks apart per copy of one thread
    const int lr = t & 63, lc0 = t >> 6;
    const bool valid = lr < nh;
    const bf16_t* src = q + ((size_t)b * heads + h0 + (valid ? lr : 0)) * WG_D + lc0 * 8;
    const unsigned dst = smem_addr(sq) + (lr >> 3) * WG_GROUP + (lr & 7) * 16 + lc0 * 128;
#pragma unroll
    for (int i = 0; i < WG_KC / STEP; ++i)
        cp_async16_zfill_at(dst + i * STEP * 128, src + i * STEP * 8, valid);
}

// Tiles by cp.async from the consumer threads, any page size: tiles in the core-matrix layout.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
mla_decode_split_wg(const bf16_t* __restrict__ q, const bf16_t* __restrict__ cache,
                    const int* __restrict__ page_table, const int* __restrict__ seq_lens,
                    float* __restrict__ o_part, float* __restrict__ lse_part, int heads,
                    int page_size, int max_pages, int num_pages, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    WgSmem& sm = *reinterpret_cast<WgSmem*>(smem_raw);
    const int tid = threadIdx.x, lane = tid & 31;
    const WgSplit sp(seq_lens, heads, max_pages, page_size, WG_BN);
    if (sp.done_if_empty(o_part, lse_part, heads, tid, WG_THREADS)) return;
    const int b = sp.b, h0 = sp.h0, nh = sp.nh, len = sp.len, tile0 = sp.tile0, tile1 = sp.tile1;

    // Loads: thread tid copies row lr of each tile (one page lookup, made a tile ahead), chunks
    // lc0 + 4i; eight consecutive threads fill one core matrix.
#if MLA_COALESCED
    // Row group 8·warp + lane % 8, chunks 4i + lane / 8: per instruction a warp reads 64
    // contiguous bytes of each of 8 rows and fills 4 adjacent core matrices (512 bytes).
    const int lr = 8 * (tid >> 5) + (lane & 7), lc0 = lane >> 3;
#else
    const int lr = tid & 63, lc0 = tid >> 6;
#endif
    const int* pages = page_table + (size_t)b * max_pages;
    // The page holding row lr of a tile; -1 past the context or outside the pool (zeros).
    auto page_of = [&](int tile) {
        const int tok = tile * WG_BN + lr;
        const int page = tok < len ? pages[tok / page_size] : -1;
        return page >= 0 && page < num_pages ? page : -1;
    };
    // This thread's first chunk in a tile (core-matrix layout); chunk lc0 + 4i is 512 bytes on.
    const unsigned row_dst = (lr >> 3) * WG_GROUP + (lr & 7) * 16 + lc0 * 128;
    const unsigned kv_smem = smem_addr(sm.kv[0]);
    constexpr unsigned STAGE_BYTES = WG_BN * WG_D * 2;
    auto load_tile = [&](int stage, int tile, int page) {
        const int tok = tile * WG_BN + lr;
        const bool valid = page >= 0;
        const bf16_t* src =
            valid ? cache + ((size_t)page * page_size + tok % page_size) * WG_D + lc0 * 8 : cache;
        const unsigned dst = kv_smem + stage * STAGE_BYTES + row_dst;
#pragma unroll
        for (int i = 0; i < WG_KC / 4; ++i)
            cp_async16_zfill_at(dst + i * 512, valid ? src + i * 32 : src, valid);
    };
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
    wg_load_q<WG_THREADS>(q, sm.q, b, heads, h0, nh, tid);
    load_tile(0, tile0, page_of(tile0));
    cp_async_commit();
    int next_page = tile0 + 1 < tile1 ? page_of(tile0 + 1) : -1;

    // Matrix descriptors of stage 0 and of Q and P; a step along K or to stage 1 only adds to
    // the start-address field (bytes / 16), which stays below 2^14 in 227 KiB.
    WgRows rows(tid);
    const unsigned char* kv0 = reinterpret_cast<const unsigned char*>(sm.kv[0]);
    const unsigned long long dq = wg_desc(sm.q, 128, WG_GROUP);
    const unsigned long long dk = wg_desc(kv0 + (32 * rows.wg / 8) * WG_GROUP, 128, WG_GROUP);
    const unsigned long long dv = wg_desc(kv0 + (256 * rows.wg / 8) * 128, WG_GROUP, 128);
    const unsigned long long dp = wg_desc(sm.p, 128, WG_PGROUP);
    auto sync = [] { __syncthreads(); };

    for (int tile = tile0; tile < tile1; ++tile) {
        const int st = (tile - tile0) & 1;
        if (tile + 1 < tile1) load_tile(st ^ 1, tile + 1, next_page);
        cp_async_commit();
        if (tile + 2 < tile1) next_page = page_of(tile + 2);
#if MLA_PREFETCH > 0
        if (tile + MLA_PREFETCH < tile1) prefetch_tile(tile + MLA_PREFETCH);
#endif
        cp_async_wait<1>();
        fence_async_smem();
        __syncthreads();
        const unsigned long long stage = st * (STAGE_BYTES >> 4);
        // A K step of S is 2 core matrices (256 bytes) in both; of O, 2 token groups.
        float s[16];
        wg_fence();
        wg_scores_issue(s, dq, 16, [&](int kk) { return dk + stage + kk * 16; });
        wg_commit();
        wg_wait0();
        rows.softmax(s, tile, len, scale_log2, sm.red, reinterpret_cast<unsigned char*>(sm.p), sync);
        fence_async_smem();
        __syncthreads();
        wg_fence();
        rows.pv_issue(dp, dv + stage, 2 * WG_GROUP >> 4);
        wg_commit();
        wg_wait0();
        __syncthreads();
    }
    cp_async_wait<0>();
    rows.store(sm.red, o_part, lse_part, sp.part, heads, h0, nh, sync);
}

#ifdef TESSERA_TMA
// How the copy engine lays a tile of BN tokens down (the host's tensor map agrees), as
// MLA_SW128 says: 1 (default) in its 128-byte swizzle, 9 chunks of 64 dims, each BN rows × 128
// bytes (8-row atoms of 1024 bytes); 0 as 72 planes of BN tokens × 16 bytes, the no-swizzle
// core-matrix layout. Descriptors from a stage's shared address `a`: the tile read K-major
// (tokens × dims: S, and Sᵀ as A) with K step kk (16 dims) `k_step(kk)` on, and read dims-major
// (V as P·V's N-major B, Vᵀ as M-major A) from 64-dim chunk c on, a K step (16 tokens)
// TOKEN_STEP on; offsets in 16 bytes.
#ifndef MLA_SW128
#define MLA_SW128 1
#endif
template <int BN>
struct TileLayout {
#if MLA_SW128
    static constexpr unsigned CHUNK = BN * 128;
    __device__ static unsigned long long k_major(unsigned a) { return wg_desc_sw128_at(a, CHUNK); }
    __device__ static unsigned long long dims_major(unsigned a, int c) {
        return wg_desc_sw128_at(a + c * CHUNK, CHUNK);
    }
    // 32 bytes within a row, 4 steps a chunk.
    __device__ static unsigned k_step(int kk) { return ((kk / 4) * CHUNK + (kk % 4) * 32) >> 4; }
    static constexpr unsigned TOKEN_STEP = 2048 >> 4;
    static constexpr unsigned DIMS64 = CHUNK >> 4;
#else
    static constexpr unsigned PLANE = BN * 16;
    __device__ static unsigned long long k_major(unsigned a) { return wg_desc_at(a, PLANE, 128); }
    // Planes 8c.. with the leading and stride offsets swapped.
    __device__ static unsigned long long dims_major(unsigned a, int c) {
        return wg_desc_at(a + c * 8 * PLANE, 128, PLANE);
    }
    __device__ static unsigned k_step(int kk) { return kk * (2 * PLANE >> 4); }
    static constexpr unsigned TOKEN_STEP = 16;
    static constexpr unsigned DIMS64 = 8 * PLANE >> 4;
#endif
};

// The dynamic shared memory of a copy-engine kernel: swizzled stages need 1024-byte alignment
// (the host adds that much slack; Q before the stages is a multiple of 1 KiB).
template <typename Smem>
__device__ __forceinline__ Smem& tile_smem(unsigned char* raw) {
    return *reinterpret_cast<Smem*>(MLA_SW128 ? align_1k(raw) : raw);
}

// The copy-engine pipeline of the split-role kernels (mla_decode_split_ws and _tr): tile i of a
// split (BN tokens of one page) lands in stage i % STAGES by one tensor copy issued by the
// block's thread 128; per stage a `full` barrier (the copy's bytes) and a `kv_empty` one (the
// three warpgroups done with it); per P buffer (PBUF of them) a `p_full` barrier (128 arrivals
// of the softmax warpgroup) and a `p_empty` one (one per product warpgroup). Tiles in the
// TileLayout. With NG > 1 (swizzled tiles) a tile comes in NG copies of 9 / NG chunks, each with
// its own `full` barrier, so that S can start on the first chunks while the rest still stream.
template <int BN, int STAGES, int PBUF, int NG = 1>
struct TilePipe {
    static constexpr unsigned STAGE_BYTES = BN * WG_D * 2;
    static constexpr unsigned GROUP_BYTES = STAGE_BYTES / NG;
    static constexpr int PLANE = BN * 16;
    static_assert(NG == 1 || (MLA_SW128 && (WG_KC / 8) % NG == 0), "copies of whole chunks");
    bf16_t* kv;
    unsigned long long *full, *kv_empty, *p_full, *p_empty;
    int* rows;
    const TensorMap* map;
    const int* pages;
    int tile0, ntiles, len, page_size, num_pages;

    __device__ static unsigned at(unsigned long long* bars, int i) { return smem_addr(bars + i); }
    __device__ bool producer() const { return threadIdx.x == 128; }

    // The barriers by thread 0, then the first tiles on their way; every thread calls it.
    __device__ void start() const {
        if (threadIdx.x == 0) {
            for (int st = 0; st < STAGES; ++st) {
                for (int g = 0; g < NG; ++g) mbar_init(at(full, st * NG + g), 1);
                mbar_init(at(kv_empty, st), 3);
            }
            for (int pb = 0; pb < PBUF; ++pb) {
                mbar_init(at(p_full, pb), 128);
                mbar_init(at(p_empty, pb), 2);
            }
            mbar_init_fence();
        }
        __syncthreads();
        if (producer())
            for (int i = 0; i < min(ntiles, STAGES); ++i) produce(i);
    }
    // Tile i into stage i % STAGES, with its count of rows inside the context.
    __device__ void produce(int i) const {
        const int st = i % STAGES, tok = (tile0 + i) * BN;
        const int page = pages[tok / page_size];
        const bool valid = page >= 0 && page < num_pages;
        rows[st] = valid ? min(BN, len - tok) : 0;
        for (int g = 0; g < NG; ++g) {
            mbar_expect_tx(at(full, st * NG + g), valid ? GROUP_BYTES : 0);
            if (valid)
                tensor_box3_g2s(smem_addr(kv) + st * STAGE_BYTES + g * GROUP_BYTES, map, 0,
                                page * page_size + tok % page_size, g * (WG_KC / 8 / NG),
                                at(full, st * NG + g));
        }
    }
    // Copy g of tile i is in.
    __device__ void wait_group(int i, int g) const {
        mbar_wait(at(full, (i % STAGES) * NG + g), (i / STAGES) & 1);
    }
    // Tile i is in.
    __device__ void wait_tile(int i) const {
        for (int g = 0; g < NG; ++g) wait_group(i, g);
    }
    // Waits for tile i; by the softmax warpgroup (thread wt of 128), rows past the context (or
    // of a page outside the pool) are then zeroed: the products read the tile as V only after
    // this tile's P, which is zero there, and 0·NaN would not be.
    __device__ void wait_tile_zeroed(int i, int wt) const {
        for (int g = 0; g < NG; ++g) wait_group_zeroed(i, g, wt);
    }
    // The same for copy g of tile i alone.
    __device__ void wait_group_zeroed(int i, int g, int wt) const {
        const int st = i % STAGES;
        wait_group(i, g);
        const int valid_rows = rows[st];
        if (valid_rows < BN) {
            const int gap = BN - valid_rows;
            uint4* t = reinterpret_cast<uint4*>(kv + st * BN * WG_D);
            if (MLA_SW128) {
                // A row's 8 units in each of the copy's chunks, in whatever order the swizzle put
                // them.
                const int per = 8 * gap, c0 = g * (WG_KC / 8 / NG);
                for (int k = wt; k < (WG_KC / 8 / NG) * per; k += 128)
                    t[(c0 + k / per) * BN * 8 + valid_rows * 8 + k % per] = make_uint4(0, 0, 0, 0);
            } else {
                for (int k = wt; k < WG_KC * gap; k += 128)
                    t[(k / gap) * (PLANE / 16) + valid_rows + k % gap] = make_uint4(0, 0, 0, 0);
            }
            fence_async_smem();
            asm volatile("bar.sync 2, 128;" ::: "memory");
        }
    }
    // The softmax warpgroup is done with tile i's stage (thread wt of 128).
    __device__ void scores_done(int i, int wt) const {
        if (wt == 0) mbar_arrive(at(kv_empty, i % STAGES));
    }
    // Before P of tile i is written: its buffer's products of tile i - PBUF are over.
    __device__ void wait_p_free(int i) const {
        if (i >= PBUF) mbar_wait(at(p_empty, i % PBUF), (i / PBUF - 1) & 1);
    }
    // P of tile i written (each of the softmax warpgroup's threads after its own stores).
    __device__ void p_written(int i) const {
        fence_async_smem();
        mbar_arrive(at(p_full, i % PBUF));
    }
    // Before tile i's products: the tile and its P.
    __device__ void wait_products(int i) const {
        wait_tile(i);
        mbar_wait(at(p_full, i % PBUF), (i / PBUF) & 1);
    }
    // A product warpgroup is done with tile i (thread wt of 128); the producer then refills the
    // stage with tile i + STAGES once the other roles are done with it too.
    __device__ void products_done(int i, int wt) const {
        const int st = i % STAGES;
        if (wt == 0) {
            mbar_arrive(at(kv_empty, st));
            mbar_arrive(at(p_empty, i % PBUF));
        }
        if (producer() && i + STAGES < ntiles) {
            mbar_wait(at(kv_empty, st), (i / STAGES) & 1);
            produce(i + STAGES);
        }
    }
};

// Warp-specialised, tiles of 32 tokens in four stages (MLA_WS_BN 64: 64 tokens in two stages),
// for pages of whole tiles: warpgroup 0 computes S and the softmax of tile i + 1 while
// warpgroups 1 and 2 (latent dims 0..255 and 256..511) run tile i's P·V. Stage barriers: `full`
// (the copy engine's bytes), `kv_empty` (S and both P·V done with the stage); P and the rescale
// factors go between the roles through WS_PBUF buffers (two; one at 64 tokens, where two would
// not fit beside Q and the stages) (`p_full`: 128 arrivals of warpgroup 0; `p_empty`: one per
// P·V warpgroup). The first thread of warpgroup 1 brings tiles in: the first WS_STAGES at the
// start, tile i + WS_STAGES once tile i is done.
#ifndef MLA_WS_BN
#define MLA_WS_BN 32
#endif
#define WS_BN MLA_WS_BN
// Timing probes of the split-role kernels, this one and the transposed one (outputs wrong by
// design): bit 0 skips the P·V products, bit 1 the S products; bit 2 (this one only) keeps the
// tile stream alone: every warpgroup waits for each tile and releases it at once (no Q, no
// softmax, no P).
#ifndef MLA_WS_PROBE
#define MLA_WS_PROBE 0
#endif
#define WS_STAGES (WS_BN == 64 ? 2 : 4)
#define WS_PBUF (WS_BN == 64 ? 1 : 2)
#define WS_NS (WS_BN / 2)
#define WS_THREADS 384
#define WS_STAGE_BYTES (WS_BN * WG_D * 2)
#define WS_PGROUP ((WS_BN / 8) * 128)
// The first MLA_WS_QREG K steps (of 36) of S take Q from the S warpgroup's registers instead of
// shared memory (64-token tiles only: m64n64k16 with A in registers), each saving the 2 KB a step
// reads of Q per tile; 0 (the default): all from shared memory.
#ifndef MLA_WS_QREG
#define MLA_WS_QREG 0
#endif
#define WS_QREG (WS_BN == 64 ? MLA_WS_QREG : 0)
static_assert(MLA_WS_QREG >= 0 && MLA_WS_QREG <= WG_D / 16, "K steps of S");
// Tensor copies a tile comes in (1, 3 or 9; more than one with swizzled tiles only), S waiting for
// each before its K steps (TilePipe).
#ifndef MLA_WS_COPIES
#define MLA_WS_COPIES 1
#endif
#define WS_NG MLA_WS_COPIES
struct WsSmem {
    bf16_t q[WG_HB * WG_D];
    bf16_t kv[WS_STAGES][WS_BN * WG_D];
    bf16_t p[WS_PBUF][WG_HB * WS_BN];
    float alpha[WS_PBUF][WG_HB];
    float l[WG_HB], m[WG_HB];
    unsigned long long full[WS_STAGES * WS_NG], kv_empty[WS_STAGES], p_full[WS_PBUF],
        p_empty[WS_PBUF];
    int rows[WS_STAGES];
};
static_assert(WS_BN == 32 || WS_BN == 64, "tiles of 32 or 64 tokens");
// What the host allocates (mla.rs, `ws_smem`, besides the slack for aligning swizzled stages).
static_assert(sizeof(WsSmem) == WG_HB * WG_D * 2 + WS_STAGES * WS_STAGE_BYTES +
                                    WS_PBUF * WG_HB * WS_BN * 2 + WS_PBUF * WG_HB * 4 +
                                    2 * WG_HB * 4 + ((WS_NG + 1) * WS_STAGES + 2 * WS_PBUF) * 8 +
                                    WS_STAGES * 4,
              "WsSmem as the host sizes it");

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
mla_decode_split_ws(const bf16_t* __restrict__ q, const __grid_constant__ TensorMap cache_map,
                    const int* __restrict__ page_table, const int* __restrict__ seq_lens,
                    float* __restrict__ o_part, float* __restrict__ lse_part, int heads,
                    int page_size, int max_pages, int num_pages, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    WsSmem& sm = tile_smem<WsSmem>(smem_raw);
    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31;
    const WgSplit sp(seq_lens, heads, max_pages, page_size, WS_BN);
    if (sp.done_if_empty(o_part, lse_part, heads, tid, WS_THREADS)) return;
    const int b = sp.b, h0 = sp.h0, nh = sp.nh, len = sp.len, tile0 = sp.tile0;
    const TilePipe<WS_BN, WS_STAGES, WS_PBUF, WS_NG> pipe{sm.kv[0], sm.full, sm.kv_empty, sm.p_full,
                                                   sm.p_empty, sm.rows, &cache_map,
                                                   page_table + (size_t)b * max_pages, tile0,
                                                   sp.tile1 - sp.tile0, len, page_size,
                                                   num_pages};
    const int ntiles = pipe.ntiles;
    pipe.start();
    if (MLA_WS_PROBE & 4) {
        for (int i = 0; i < ntiles; ++i) {
            pipe.wait_tile(i);
            if (wg == 0)
                pipe.scores_done(i, wt);
            else
                pipe.products_done(i, wt);
        }
        return;
    }

    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = 16 * (wt >> 5) + g, r1 = r0 + 8;
    constexpr unsigned long long STAGE = WS_STAGE_BYTES >> 4;
    const float ninf = -__int_as_float(0x7f800000);
    auto all_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(WS_THREADS) : "memory"); };

    if (wg == 0) {
        // S and softmax. Q first (this warpgroup only).
        wg_load_q<128>(q, sm.q, b, heads, h0, nh, wt);
        cp_async_commit();
        cp_async_wait<0>();
        fence_async_smem();
        asm volatile("bar.sync 2, 128;" ::: "memory");
        float m0 = ninf, m1 = ninf, l0 = 0.0f, l1 = 0.0f;
        const unsigned long long dq = wg_desc(sm.q, 128, WG_GROUP);
        const unsigned long long dk = TileLayout<WS_BN>::k_major(smem_addr(sm.kv[0]));
        // A's fragments of S's first WS_QREG K steps: rows r0 and r0 + 8, columns 2·t4 (+1) and
        // 8 on.
        unsigned qa[WS_QREG > 0 ? WS_QREG : 1][4];
        const unsigned char* sq = reinterpret_cast<const unsigned char*>(sm.q);
#pragma unroll
        for (int kk = 0; kk < WS_QREG; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                qa[kk][e] = *reinterpret_cast<const unsigned*>(
                    sq + cm_off(r0 + 8 * (e & 1), 16 * kk + 2 * t4 + 8 * (e >> 1), WG_GROUP));
        for (int i = 0; i < ntiles; ++i) {
            const int st = i % WS_STAGES, pb = i % WS_PBUF;
            // With one copy a tile, all of it before S; with more, each copy before its steps.
            constexpr int STEPS = WG_D / 16 / WS_NG;
            if (WS_NG == 1 || (MLA_WS_PROBE & 2)) pipe.wait_tile_zeroed(i, wt);
            float s[WS_NS];
            if (MLA_WS_PROBE & 2) {
#pragma unroll
                for (int k = 0; k < WS_NS; ++k) s[k] = 0.0f;
            } else {
                wg_fence();
                wg_scores_issue<WS_NS, WS_QREG>(
                    s, dq, 16,
                    [&](int kk) { return dk + st * STAGE + TileLayout<WS_BN>::k_step(kk); }, qa,
                    [&](int kk) {
                        if (WS_NG > 1 && kk % STEPS == 0) pipe.wait_group_zeroed(i, kk / STEPS, wt);
                    });
                wg_commit();
                wg_wait0();
            }
            pipe.scores_done(i, wt);
            float x0, x1;
            scores_mask_max(s, (tile0 + i) * WS_BN, t4, len, scale_log2, x0, x1);
            unsigned pk[WS_NS / 2];
            float a0, a1;
            softmax_step(s, x0, x1, m0, m1, l0, l1, pk, a0, a1);
            pipe.wait_p_free(i);
            store_p(reinterpret_cast<unsigned char*>(sm.p[pb]), pk, r0, 0, t4, WS_PGROUP);
            if (t4 == 0) {
                sm.alpha[pb][r0] = a0;
                sm.alpha[pb][r1] = a1;
            }
            pipe.p_written(i);
        }
        l0 = quad_sum(l0);
        l1 = quad_sum(l1);
        if (t4 == 0) {
            sm.l[r0] = l0;
            sm.l[r1] = l1;
            sm.m[r0] = m0;
            sm.m[r1] = m1;
        }
        all_sync();
        return;
    }

    // P·V over latent dims 256·pw...
    const int pw = wg - 1;
    float o[128];
#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.0f;
    const unsigned long long dv = TileLayout<WS_BN>::dims_major(smem_addr(sm.kv[0]), 4 * pw);
    const unsigned long long dp = wg_desc(sm.p[0], 128, WS_PGROUP);
    constexpr unsigned long long P_BUF = (WG_HB * WS_BN * 2) >> 4;
    for (int i = 0; i < ntiles; ++i) {
        const int st = i % WS_STAGES, pb = i % WS_PBUF;
        pipe.wait_products(i);
        rescale_rows(o, sm.alpha[pb][r0], sm.alpha[pb][r1]);
        if (!(MLA_WS_PROBE & 1)) {
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < WS_BN / 16; ++kk)
                wgmma_n256_bt(o, dp + pb * P_BUF + kk * 16,
                              dv + st * STAGE + kk * TileLayout<WS_BN>::TOKEN_STEP);
            wg_commit();
            wg_wait0();
        }
        pipe.products_done(i, wt);
    }
    all_sync();
    store_rows(o, o_part, lse_part, sp.part, heads, h0, nh, r0, 256 * pw, t4, sm.l[r0], sm.l[r1],
               sm.m[r0], sm.m[r1], pw == 0);
}
#endif
