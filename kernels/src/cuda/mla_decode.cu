// MLA decode in absorbed form: one query token per sequence against the bf16 latent cache
// (kv_lora_rank 512 latent + 64 rope-slot dims per token, one shared "head" for all heads),
// read from pages of the page pool through a per-sequence page table.
//   s[h, j] = scale · (q[h, :576] · kv[j, :576]),  p = softmax_j(s),  o[h, :512] = Σ_j p · kv[j, :512]
// (the 512 latent dims are both key and value; the output is the latent, before W_UV).
//
// Flash-decoding: the context of each sequence is split across MLA_SPLITS-many blocks (grid x);
// each block streams its tiles of MLA_BN tokens through shared memory (cp.async, two stages) and
// keeps a running max/sum per head, then mla_decode_combine merges the splits by their
// log-sum-exp. One block serves 16·MLA_MT heads, so every latent tile is read once for all of
// them: the QK product (M = heads, N = tokens, K = 576) and the PV product (M = heads, N = 512,
// K = tokens) run on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulation).
//
// Warps: 4 per 16-head tile. For QK, warp (mt, w) computes tokens 16w..16w+15 of its heads;
// scores go through shared memory, where 8 threads per head do the online softmax; for PV, warp
// (mt, w) owns latent dims 128w..128w+127 of its heads (64 f32 accumulators per lane).

#ifndef MLA_MT
#define MLA_MT 3
#endif
#define MLA_BN 64
#define MLA_D 576
#define MLA_DV 512
#define MLA_HB (16 * MLA_MT)
#define MLA_THREADS (128 * MLA_MT)
#define QLD (MLA_D + 8)
#define SLD (MLA_BN + 4)
#define PLD (MLA_BN + 8)
#define CHUNKS (MLA_D / 8)

static_assert(MLA_THREADS / MLA_HB == 8, "softmax maps 8 threads to a head");

// Tiles ahead whose cache lines are prefetched into L2 (0: none), so that more of the stream is
// in flight than the two shared-memory stages hold.
#ifndef MLA_PREFETCH
#define MLA_PREFETCH 0
#endif
// 1: tiles are copied chunk-major (a warp's lanes take consecutive 16-byte chunks); 0: row-major
// (TPR threads per token row, each taking every TPR-th chunk).
#ifndef MLA_COALESCED
#define MLA_COALESCED 0
#endif

struct MlaSmem {
    bf16_t q[MLA_HB * QLD];
    bf16_t kv[2][MLA_BN * QLD];
    float s[MLA_HB * SLD];
    bf16_t p[MLA_HB * PLD];
    float m[MLA_HB], l[MLA_HB], alpha[MLA_HB];
};

extern "C" __global__ void __launch_bounds__(MLA_THREADS, 1)
mla_decode_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ cache,
                 const int* __restrict__ page_table, const int* __restrict__ seq_lens,
                 float* __restrict__ o_part, float* __restrict__ lse_part, int heads,
                 int page_size, int max_pages, int num_pages, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    MlaSmem& sm = *reinterpret_cast<MlaSmem*>(smem_raw);
    const int split = blockIdx.x, splits = gridDim.x;
    const int h0 = blockIdx.y * MLA_HB;
    const int b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int mt = warp >> 2, wq = warp & 3;

    const int len = min(max(seq_lens[b], 0), max_pages * page_size);
    const int tiles = (len + MLA_BN - 1) / MLA_BN;
    const int per = (tiles + splits - 1) / splits;
    const int tile0 = split * per, tile1 = min(tiles, tile0 + per);
    const size_t part = (size_t)b * splits + split;

    if (tile0 >= tile1) {
        // An empty split: weight zero in the combine.
        for (int i = tid; i < MLA_HB * MLA_DV; i += MLA_THREADS)
            o_part[(part * heads + h0) * MLA_DV + i] = 0.0f;
        for (int i = tid; i < MLA_HB; i += MLA_THREADS)
            lse_part[part * heads + h0 + i] = -__int_as_float(0x7f800000);
        return;
    }

    const int* pages = page_table + (size_t)b * max_pages;
    // A tile: MLA_THREADS / MLA_BN threads per token row, so each thread looks up one page id
    // (one dependent load) and then issues its 16-byte copies back to back.
    constexpr int TPR = MLA_THREADS / MLA_BN;
    static_assert(MLA_THREADS % MLA_BN == 0 && CHUNKS % TPR == 0, "tile rows split evenly");
#if MLA_COALESCED
    // Chunk-major instead: the 32 lanes of a warp copy 32 consecutive chunks (512 contiguous
    // bytes, mostly of one row) per instruction, each lane looking up the page of its row.
    static_assert(MLA_BN * CHUNKS % MLA_THREADS == 0, "tile chunks split evenly");
    auto load_tile = [&](int stage, int tile) {
#pragma unroll
        for (int i = 0; i < MLA_BN * CHUNKS / MLA_THREADS; ++i) {
            const int idx = tid + i * MLA_THREADS;
            const int r = idx / CHUNKS, c = idx - r * CHUNKS;
            const int tok = tile * MLA_BN + r;
            const int page = tok < len ? pages[tok / page_size] : -1;
            const bool valid = page >= 0 && page < num_pages;
            const bf16_t* src =
                valid ? cache + ((size_t)page * page_size + tok % page_size) * MLA_D : cache;
            cp_async16_zfill(sm.kv[stage] + r * QLD + c * 8, valid ? src + c * 8 : src, valid);
        }
    };
#else
    auto load_tile = [&](int stage, int tile) {
        const int r = tid / TPR, c0 = tid - r * TPR;
        const int tok = tile * MLA_BN + r;
        const int page = tok < len ? pages[tok / page_size] : -1;
        const bool valid = page >= 0 && page < num_pages;
        const bf16_t* src =
            valid ? cache + ((size_t)page * page_size + tok % page_size) * MLA_D : cache;
        bf16_t* dst = sm.kv[stage] + r * QLD;
#pragma unroll
        for (int c = c0; c < CHUNKS; c += TPR) cp_async16_zfill(dst + c * 8, valid ? src + c * 8 : src, valid);
    };
#endif

#if MLA_PREFETCH > 0
    // The 128-byte lines of a tile's rows: TPR threads per row, nine lines per 1152-byte row.
    auto prefetch_tile = [&](int tile) {
        const int r = tid / TPR, c0 = tid - r * TPR;
        const int tok = tile * MLA_BN + r;
        const int page = tok < len ? pages[tok / page_size] : -1;
        if (page < 0 || page >= num_pages) return;
        const char* src = reinterpret_cast<const char*>(
            cache + ((size_t)page * page_size + tok % page_size) * MLA_D);
        for (int line = c0; line < MLA_D * 2 / 128; line += TPR) prefetch_l2(src + line * 128);
    };
    for (int t = tile0 + 1; t < min(tile1, tile0 + MLA_PREFETCH); ++t) prefetch_tile(t);
#endif

    for (int i = tid; i < MLA_HB * CHUNKS; i += MLA_THREADS) {
        const int r = i / CHUNKS, c = i - r * CHUNKS;
        cp_async16(sm.q + r * QLD + c * 8, q + ((size_t)b * heads + h0 + r) * MLA_D + c * 8);
    }
    load_tile(0, tile0);
    cp_async_commit();
    for (int i = tid; i < MLA_HB; i += MLA_THREADS) {
        sm.m[i] = -__int_as_float(0x7f800000);
        sm.l[i] = 0.0f;
    }

    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int tile = tile0; tile < tile1; ++tile) {
        const int st = (tile - tile0) & 1;
        if (tile + 1 < tile1) load_tile(st ^ 1, tile + 1);
        cp_async_commit();
#if MLA_PREFETCH > 0
        if (tile + MLA_PREFETCH < tile1) prefetch_tile(tile + MLA_PREFETCH);
#endif
        cp_async_wait<1>();
        __syncthreads();
        const bf16_t* kv = sm.kv[st];

        // Scores of this warp: heads mt·16.., tokens wq·16.. (two n8 tiles).
        {
            // Two accumulator sets (even and odd k-steps) halve the dependent mma chains.
            float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            float acc2[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            // ldmatrix: lane l addresses row l % 8 of matrix l / 8. A (heads × k): matrices
            // (rows 0-7 | 8-15) × (k 0-7 | 8-15); B from the [token][k] tile: (tokens 0-7 | 8-15)
            // × (k 0-7 | 8-15), giving b0 = {m0, m1}, b1 = {m2, m3}.
            const int mi = lane >> 3, mr = lane & 7;
            const bf16_t* qa = sm.q + (mt * 16 + (mi & 1) * 8 + mr) * QLD + (mi >> 1) * 8;
            const bf16_t* kb = kv + (wq * 16 + (mi >> 1) * 8 + mr) * QLD + (mi & 1) * 8;
#pragma unroll 2
            for (int k0 = 0; k0 < MLA_D; k0 += 32) {
                unsigned a[4], b[4], a2[4], b2[4];
                ldmatrix_x4(a, qa + k0);
                ldmatrix_x4(b, kb + k0);
                ldmatrix_x4(a2, qa + k0 + 16);
                ldmatrix_x4(b2, kb + k0 + 16);
                mma_bf16_16816(acc[0], a, b);
                mma_bf16_16816(acc[1], a, b + 2);
                mma_bf16_16816(acc2[0], a2, b2);
                mma_bf16_16816(acc2[1], a2, b2 + 2);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][i] += acc2[j][i];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = wq * 16 + j * 8 + 2 * t4;
                const int tok = tile * MLA_BN + col;
                const float ninf = -__int_as_float(0x7f800000);
                float* r0 = sm.s + (mt * 16 + g) * SLD + col;
                float* r1 = r0 + 8 * SLD;
                r0[0] = tok < len ? acc[j][0] * scale_log2 : ninf;
                r0[1] = tok + 1 < len ? acc[j][1] * scale_log2 : ninf;
                r1[0] = tok < len ? acc[j][2] * scale_log2 : ninf;
                r1[1] = tok + 1 < len ? acc[j][3] * scale_log2 : ninf;
            }
        }
        __syncthreads();

        // Online softmax (base 2): 8 threads per head, 8 scores each.
        {
            const int row = tid >> 3, part8 = tid & 7;
            const float* sr = sm.s + row * SLD + part8 * 8;
            float v[8], mx = -__int_as_float(0x7f800000);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                v[j] = sr[j];
                mx = fmaxf(mx, v[j]);
            }
            mx = max_over_8_lanes(mx);
            const float m_old = sm.m[row];
            const float m_new = fmaxf(m_old, mx);
            const float base = m_new == -__int_as_float(0x7f800000) ? 0.0f : m_new;
            float sum = 0.0f;
            unsigned packed[4];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                const float p0 = exp2f(v[j] - base), p1 = exp2f(v[j + 1] - base);
                sum += p0 + p1;
                packed[j / 2] = pack_bf16x2(p0, p1);
            }
            *reinterpret_cast<uint4*>(sm.p + row * PLD + part8 * 8) =
                make_uint4(packed[0], packed[1], packed[2], packed[3]);
            sum = sum_over_8_lanes(sum);
            __syncwarp();
            if (part8 == 0) online_softmax_fold(sm.m, sm.l, sm.alpha, row, m_old, m_new, base, sum);
        }
        __syncthreads();

        // o = alpha · o + P · V for this warp's heads and 128 latent dims.
        {
            scale_acc_rows(o, sm.alpha[mt * 16 + g], sm.alpha[mt * 16 + g + 8]);
            const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
            for (int k0 = 0; k0 < MLA_BN; k0 += 16) {
                unsigned a[4];
                load_a_frag(a, sm.p, PLD, mt * 16, k0);
                const bf16_t* vrow = kv + (k0 + (mi & 1) * 8 + mr) * QLD + wq * 128 + (mi >> 1) * 8;
#pragma unroll
                for (int n = 0; n < 16; n += 2) {
                    unsigned bb[4];
                    ldmatrix_x4_trans(bb, vrow + n * 8);
                    mma_bf16_16816(o[n], a, bb);
                    mma_bf16_16816(o[n + 1], a, bb + 2);
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    // This split's normalised output and log-sum-exp (base 2) per head.
    const int r0 = mt * 16 + g, r1 = r0 + 8;
    const float l0 = sm.l[r0], l1 = sm.l[r1];
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    float* out0 = o_part + (part * heads + h0 + r0) * MLA_DV + wq * 128 + 2 * t4;
    float* out1 = out0 + 8 * MLA_DV;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(out0 + n * 8) = make_float2(o[n][0] * i0, o[n][1] * i0);
        *reinterpret_cast<float2*>(out1 + n * 8) = make_float2(o[n][2] * i1, o[n][3] * i1);
    }
    if (tid < MLA_HB) {
        const float l = sm.l[tid];
        lse_part[part * heads + h0 + tid] =
            l > 0.0f ? sm.m[tid] + __log2f(l) : -__int_as_float(0x7f800000);
    }
}

// out[b, h, :] = Σ_s w_s · o_part[b, s, h, :], w = softmax over the splits' log-sum-exps.
// One block of 128 threads per (head, sequence), 4 latent dims per thread.
extern "C" __global__ void __launch_bounds__(128)
mla_decode_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                   bf16_t* __restrict__ out, int heads, int splits) {
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x * 4;
    float mx = -__int_as_float(0x7f800000);
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse_part[((size_t)b * splits + s) * heads + h]);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, wsum = 0.0f;
    if (mx != -__int_as_float(0x7f800000)) {
        for (int s = 0; s < splits; ++s) {
            const size_t part = (size_t)b * splits + s;
            const float w = exp2f(lse_part[part * heads + h] - mx);
            if (w == 0.0f) continue;
            const float4 v = *reinterpret_cast<const float4*>(o_part + (part * heads + h) * MLA_DV + d);
            acc[0] = fmaf(w, v.x, acc[0]);
            acc[1] = fmaf(w, v.y, acc[1]);
            acc[2] = fmaf(w, v.z, acc[2]);
            acc[3] = fmaf(w, v.w, acc[3]);
            wsum += w;
        }
    }
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    bf16_t* dst = out + ((size_t)b * heads + h) * MLA_DV + d;
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(pack_bf16x2(acc[0] * inv, acc[1] * inv), pack_bf16x2(acc[2] * inv, acc[3] * inv));
}
