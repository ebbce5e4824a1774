// KDA (Kimi Delta Attention) on the GPU: chunked prefill in two launches (the first here, the
// scan in kda_scan.cu) and a one-token decode step (kda_decode.cu); the three files compile in
// that order as one translation unit.
//
// Per head, with state S [DK, DV] (f32) and per-channel log decay g (<= 0):
//   S <- diag(exp(g_t)) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
// with q, k L2-normalised (optional) and q scaled. The prefill takes packed sequences of any
// lengths: token rows of every sequence one after another, sequence s at rows
// [seq_start[s], seq_start[s+1]) and its chunks at [chunk_start[s], chunk_start[s+1]) (see
// SeqSpan). Per token row: q, k at h·DK of a row of ld_qk elements, v at h·DV of ld_v, o at h·DV
// of ld_o; g [rows, H, DK]; beta [rows, H]. A sequence's state [H, DK, DV] lies at s0 + s0_off[s]
// before (zeros without s0 or when the offset is negative) and s_out + s_out_off[s] after. The
// decode step takes q, k, g [B, H, DK], v, o [B, H, DV], beta [B, H], state [B, H, DK, DV]. q, k,
// v, beta, o are bf16; g and the state are f32.
//
// Prefill (chunks of CH = 64 tokens, WY form):
//   kda_chunk_prep  — one block per (chunk of any sequence, head), fully parallel. Everything that does not
//                     depend on the incoming state: the 64x64 decayed products, the inverse
//                     T = (I + A)^-1, u = T (beta v), w = T (beta k exp(gc)), q exp(gc), and
//                     k exp(gc_last - gc).
//   kda_chunk_scan  — (kda_scan.cu) one block per (V tile, head, sequence), walking the chunks in
//                     order with its slice of the state resident in registers; all products on
//                     the tensor cores.
// Decay products exp(gc_i - gc_j) are factored per 16-token sub-chunk into two factors that are
// each <= 1 (or bounded by the sub-chunk's own decay span); chunks whose span is too large for
// that take an exact per-pair path for the diagonal blocks, so no input overflows.

#ifndef DK
#define DK 128
#endif
#ifndef DV
#define DV 128
#endif
#ifndef VT
#define VT 32
#endif
#define CH 64
#define SUB 16
#define NSUB (CH / SUB)
// Row padding of the prep's f32 decays: 8 puts the rows of a warp's 8 x (4 lanes x 2 floats)
// reads in the block products on distinct banks (4 left them two to a bank).
#ifndef KDA_GLD_PAD
#define KDA_GLD_PAD 8
#endif
#define GLD (DK + KDA_GLD_PAD)
#define OLD (DK + 8)
#define TLD (CH + 8)
// Leading dimensions of A (f32), of T (f32) and of each inverse warp's 16 x 16 scratch: with
// KDA_INV_PADS the tf32 fragment reads of the inverse fall on distinct banks (A as the left
// operand: rows 4 banks apart; T and the scratch as right operands: rows 8 apart); without, the
// rows are 1 bank apart (and the scratch 16).
#ifndef KDA_INV_PADS
#define KDA_INV_PADS 1
#endif
#define ALD (CH + (KDA_INV_PADS ? 4 : 1))
#define TFLD (CH + (KDA_INV_PADS ? 8 : 1))
#define XLD (SUB + (KDA_INV_PADS ? 8 : 0))
#define ULD (VT + 8)
#define SPAN_LIMIT 60.0f
// Timing aid: a bit mask of kda_chunk_prep stages to leave out (1: block products, 2: inverse,
// 4: q/k outputs, 8: w/u). Results are wrong unless 0.
#ifndef PREP_SKIP
#define PREP_SKIP 0
#endif

// Exponentials of the prep flush results below the normal range to zero (exp_ftz; 0: __expf),
// and the off-diagonal blocks of T = (I + A)^-1 are products on the tensor cores (tf32; 0: scalar
// f32 loops). Both need NVIDIA's instructions, so the portable helpers keep the plain forms.
#if defined(TESSERA_PLAIN_HELPERS) || !defined(__CUDA_ARCH__)
#undef KDA_EXP_FTZ
#define KDA_EXP_FTZ 0
#undef KDA_INV_TC
#define KDA_INV_TC 0
#endif
#ifndef KDA_EXP_FTZ
#define KDA_EXP_FTZ 1
#endif
#ifndef KDA_INV_TC
#define KDA_INV_TC 1
#endif
// Step 6 loads this block's v rows into registers before the inverse (2), before it builds
// beta k exp(gc) (1), or only when it stages beta v (0); and builds both right operands in one
// phase, the two products after one barrier (KDA_WU_ONE_PHASE 1), or each after its own (0).
#ifndef KDA_V_EARLY
#define KDA_V_EARLY 2
#endif
#ifndef KDA_WU_ONE_PHASE
#define KDA_WU_ONE_PHASE 1
#endif
// Steps 5 and 6 take a row's 8 columns of a thread as two runs of 4, [c, c + 4) and [c + DK/2,
// c + DK/2 + 4) (1), so that 8 neighbouring threads read 128 contiguous bytes of f32 decays (one
// shared-memory wavefront); or as one run [c, c + 8) (0: 256 bytes, two wavefronts).
#ifndef KDA_SPLIT_PIECES
#define KDA_SPLIT_PIECES 1
#endif
// Column blocks of 8 that each warp of the w/u products (t_times) keeps in flight at once: their
// chains of 4 dependent MMAs interleave (1, 2 or 4).
#ifndef KDA_TT_NB
#define KDA_TT_NB 4
#endif
// Step 5's outputs written by the warps that the inverse leaves idle (needs KDA_INV_TC).
#if !KDA_INV_TC
#undef KDA_OVERLAP_OUT
#define KDA_OVERLAP_OUT 0
#endif
#ifndef KDA_OVERLAP_OUT
#define KDA_OVERLAP_OUT 1
#endif

__device__ __forceinline__ float kda_exp(float x) {
#if KDA_EXP_FTZ
    return exp_ftz(x);
#else
    return __expf(x);
#endif
}

#if KDA_INV_TC
__device__ __forceinline__ unsigned tf32_of(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// acc (16x16 f32, as two m16n8 accumulators) += a (16x16) b (16x16), both f32 in shared memory
// with leading dimensions lda and ldb, on m16n8k8 tf32 products.
__device__ __forceinline__ void tf32_block_product(float (&acc)[2][4], const float* a, int lda,
                                                   const float* b, int ldb) {
    const int lane = threadIdx.x & LANE_MASK, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 8) {
        const unsigned af[4] = {tf32_of(a[g * lda + k0 + t]), tf32_of(a[(g + 8) * lda + k0 + t]),
                                tf32_of(a[g * lda + k0 + t + 4]),
                                tf32_of(a[(g + 8) * lda + k0 + t + 4])};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const unsigned bf[2] = {tf32_of(b[(k0 + t) * ldb + nt * 8 + g]),
                                    tf32_of(b[(k0 + t + 4) * ldb + nt * 8 + g])};
            asm volatile(
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                "{%8,%9}, {%0,%1,%2,%3};"
                : "+f"(acc[nt][0]), "+f"(acc[nt][1]), "+f"(acc[nt][2]), "+f"(acc[nt][3])
                : "r"(af[0]), "r"(af[1]), "r"(af[2]), "r"(af[3]), "r"(bf[0]), "r"(bf[1]));
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Shared-memory layout of kda_chunk_prep (bytes). q/k rows are padded (OLD) so that walks down a
// column are free of bank conflicts. Phase scratch X holds, in turn: T in f32 with a per-warp
// 16x16 scratch; the beta k exp(gc) stage [CH][DK + 8]. Once T is known, af's space holds T in
// bf16 (tb); once q/k are consumed, theirs holds beta v [CH][DV + 8]; once the decays are, theirs
// stages the w and u tiles on their way out.
#define P_GCS 0
#define P_QS (P_GCS + CH * GLD * 4)
#define P_KS (P_QS + CH * OLD * 2)
#define P_RQ (P_KS + CH * OLD * 2)
#define P_RK (P_RQ + CH * 4)
#define P_BS (P_RK + CH * 4)
#define P_FLAG (P_BS + CH * 4)
#define P_AF (P_FLAG + 16)
#define P_X (P_AF + CH * ALD * 4)
#define X_TF 0
#define X_XS (X_TF + CH * TFLD * 4)
#define X_BK 0

// T (bf16, this block's) times rhs [CH][ncol] (row-major, leading dimension ncol + 8), written
// row-major to dst [CH][ncol]; 8 warps = 4 row tiles x 2 column halves, KDA_TT_NB column blocks
// of 8 at a time (ncol / 2 a multiple of 8 KDA_TT_NB). Each warp's 16 x ncol/2 tile goes through
// its own piece of `scratch` so that global stores are whole 16-byte pieces (every thread of the
// block calls this: LANE_SYNC is a block barrier under HIP).
__device__ __forceinline__ void t_times(const bf16_t* tb, const bf16_t* rhs, int ncol, bf16_t* dst,
                                        bf16_t* scratch) {
    const int warp = threadIdx.x >> LANE_BITS, lane = threadIdx.x & LANE_MASK, g8 = lane >> 2, t4 = lane & 3;
    const int mt = warp & 3, half = warp >> 2, wcols = ncol / 2, sld = wcols + 8;
    bf16_t* sc = scratch + warp * 16 * sld;
    unsigned a[CH / 16][4];
#pragma unroll
    for (int ks_ = 0; ks_ < CH / 16; ++ks_) load_a_frag(a[ks_], tb, TLD, mt * 16, ks_ * 16);
    for (int n0 = 0; n0 < wcols; n0 += 8 * KDA_TT_NB) {
        float acc[KDA_TT_NB][4] = {};
#pragma unroll
        for (int ks_ = 0; ks_ < CH / 16; ++ks_)
#pragma unroll
            for (int nb = 0; nb < KDA_TT_NB; ++nb) {
                unsigned bb[2];
                load_b_frag_kn(bb, rhs, ncol + 8, ks_ * 16, half * wcols + n0 + 8 * nb);
                mma_bf16_16816(acc[nb], a[ks_], bb);
            }
#pragma unroll
        for (int nb = 0; nb < KDA_TT_NB; ++nb) {
            *(unsigned*)(sc + g8 * sld + n0 + 8 * nb + 2 * t4) = pack_bf16x2(acc[nb][0], acc[nb][1]);
            *(unsigned*)(sc + (g8 + 8) * sld + n0 + 8 * nb + 2 * t4) = pack_bf16x2(acc[nb][2], acc[nb][3]);
        }
    }
    LANE_SYNC();
    for (int e = lane; e < 16 * (wcols / 8); e += LANES) {
        const int r = e / (wcols / 8), p = (e % (wcols / 8)) * 8;
        *(uint4*)(dst + (mt * 16 + r) * ncol + half * wcols + p) = *(const uint4*)(sc + r * sld + p);
    }
    LANE_SYNC();
}

// Piece e (of CH * DK / 8) of a [CH][DK] matrix: its row, and the first column of each of its two
// runs of 4 (see KDA_SPLIT_PIECES).
struct Piece {
    int row, c0, c1;
};
__device__ __forceinline__ Piece piece_of(int e) {
    const int row = e / (DK / 8), p = e % (DK / 8);
    return KDA_SPLIT_PIECES ? Piece{row, 4 * p, 4 * p + DK / 2} : Piece{row, 8 * p, 8 * p + 4};
}
// A piece's 8 bf16 values from (or to) a row of bf16 (its f32 values, where a caller needs them,
// are two float4 at c0 and c1).
__device__ __forceinline__ uint4 ld_piece(const bf16_t* row, Piece pc) {
#if KDA_SPLIT_PIECES
    const uint2 a = *(const uint2*)(row + pc.c0), b = *(const uint2*)(row + pc.c1);
    return make_uint4(a.x, a.y, b.x, b.y);
#else
    return *(const uint4*)(row + pc.c0);
#endif
}
__device__ __forceinline__ void st_piece(bf16_t* row, Piece pc, uint4 w) {
#if KDA_SPLIT_PIECES
    *(uint2*)(row + pc.c0) = make_uint2(w.x, w.y);
    *(uint2*)(row + pc.c1) = make_uint2(w.z, w.w);
#else
    *(uint4*)(row + pc.c0) = w;
#endif
}

// One piece of bf16 values times r·exp(e) elementwise (e: the piece's eight exponents as two
// float4), rounded back to bf16.
__device__ __forceinline__ uint4 scale_exp8(uint4 w, float r, float4 ea, float4 eb) {
    uint4 o;
    o.x = pack_bf16x2(lo_bf(w.x) * r * kda_exp(ea.x), hi_bf(w.x) * r * kda_exp(ea.y));
    o.y = pack_bf16x2(lo_bf(w.y) * r * kda_exp(ea.z), hi_bf(w.y) * r * kda_exp(ea.w));
    o.z = pack_bf16x2(lo_bf(w.z) * r * kda_exp(eb.x), hi_bf(w.z) * r * kda_exp(eb.y));
    o.w = pack_bf16x2(lo_bf(w.w) * r * kda_exp(eb.z), hi_bf(w.w) * r * kda_exp(eb.w));
    return o;
}

// Step 5 of kda_chunk_prep: the outputs that need no product (q exp(gc), k exp(gc_last - gc) and
// exp(gc_last)), row-major by pieces of 8 values (piece_of) straight from registers, by the n
// threads numbered t = 0..n-1.
__device__ __forceinline__ void prep_outputs(int t, int n, const bf16_t* qs, const bf16_t* ks,
                                             const float* gcs, const float* rq, const float* rk,
                                             bf16_t* qg, bf16_t* kg, float* egl) {
    for (int e = t; e < CH * DK / 8; e += n) {
        const Piece pc = piece_of(e);
        const int j = pc.row;
        const float4 ga = *(const float4*)(gcs + j * GLD + pc.c0), gb = *(const float4*)(gcs + j * GLD + pc.c1);
        st_piece(qg + j * DK, pc, scale_exp8(ld_piece(qs + j * OLD, pc), rq[j], ga, gb));
    }
    for (int e = t; e < CH * DK / 8; e += n) {
        const Piece pc = piece_of(e);
        const int j = pc.row;
        const float4 ga = *(const float4*)(gcs + j * GLD + pc.c0), gb = *(const float4*)(gcs + j * GLD + pc.c1);
        const float4 la = *(const float4*)(gcs + (CH - 1) * GLD + pc.c0);
        const float4 lb = *(const float4*)(gcs + (CH - 1) * GLD + pc.c1);
        st_piece(kg + j * DK, pc,
                 scale_exp8(ld_piece(ks + j * OLD, pc), rk[j],
                            make_float4(la.x - ga.x, la.y - ga.y, la.z - ga.z, la.w - ga.w),
                            make_float4(lb.x - gb.x, lb.y - gb.y, lb.z - gb.z, lb.w - gb.w)));
    }
    for (int d = t; d < DK; d += n) egl[d] = kda_exp(gcs[(CH - 1) * GLD + d]);
}

extern "C" __global__ void __launch_bounds__(256, 2) kda_chunk_prep(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    const float* __restrict__ g, const bf16_t* __restrict__ beta, int ld_qk, int ld_v,
    const int* __restrict__ seq_start, const int* __restrict__ chunk_start, int nseq, int H,
    float scale, int l2norm, bf16_t* __restrict__ w_out, bf16_t* __restrict__ u_out,
    bf16_t* __restrict__ qg_out, bf16_t* __restrict__ kg_out, bf16_t* __restrict__ aqk_out,
    float* __restrict__ egl_out) {
    const int c = blockIdx.x, h = blockIdx.y, NC = gridDim.x;
    const int tid = threadIdx.x, warp = tid >> LANE_BITS, lane = tid & LANE_MASK, g8 = lane >> 2, t4 = lane & 3;
    const SeqSpan sp = seq_span(seq_start, chunk_start, seq_of_chunk(chunk_start, nseq, c));
    const int t0 = sp.tok0 + (c - sp.c0) * CH, len = min(CH, sp.tok0 + sp.len - t0);
    const size_t chunk = (size_t)h * NC + c;

    extern __shared__ __align__(16) unsigned char smem[];
    float* gcs = (float*)(smem + P_GCS);
    bf16_t* qs = (bf16_t*)(smem + P_QS);
    bf16_t* ks = (bf16_t*)(smem + P_KS);
    float* rq = (float*)(smem + P_RQ);
    float* rk = (float*)(smem + P_RK);
    float* bs = (float*)(smem + P_BS);
    int* unsafe_span = (int*)(smem + P_FLAG);
    float* af = (float*)(smem + P_AF);
    unsigned char* x = smem + P_X;

    // 1. The chunk, copied asynchronously (all loads in flight at once); rows past the end of the
    //    sequence are zero, so they contribute nothing.
    for (int e = tid; e < CH * DK / 8; e += 256) {
        const int i = e / (DK / 8), d = (e % (DK / 8)) * 8;
        const bool ok = i < len;
        const size_t off = ok ? (size_t)(t0 + i) * ld_qk + h * DK + d : 0;
        cp_async16_zfill(qs + i * OLD + d, q + off, ok);
        cp_async16_zfill(ks + i * OLD + d, k + off, ok);
    }
    for (int e = tid; e < CH * DK / 4; e += 256) {
        const int i = e / (DK / 4), d = (e % (DK / 4)) * 4;
        const bool ok = i < len;
        cp_async16_zfill(gcs + i * GLD + d, g + (ok ? ((size_t)(t0 + i) * H + h) * DK + d : 0), ok);
    }
    cp_async_commit();
    if (tid < CH) bs[tid] = tid < len ? bf2f(beta[(size_t)(t0 + tid) * H + h]) : 0.f;
    if (tid == 0) unsafe_span[0] = 0;
    cp_async_wait<0>();
    __syncthreads();

    // 2. Norms (a quad of lanes per token, each lane four 16-byte pieces of q and of k) and the
    //    within-chunk cumulative decay (threads per channel).
    {
        const int i = tid >> 2, qd = tid & 3;
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int m = 0; m < DK / 32; ++m) {
            const int d = (4 * m + qd) * 8;
            const uint4 a = *(const uint4*)(qs + i * OLD + d), c = *(const uint4*)(ks + i * OLD + d);
            const unsigned aw[4] = {a.x, a.y, a.z, a.w}, cw[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                sq = fmaf(lo_bf(aw[p]), lo_bf(aw[p]), fmaf(hi_bf(aw[p]), hi_bf(aw[p]), sq));
                sk = fmaf(lo_bf(cw[p]), lo_bf(cw[p]), fmaf(hi_bf(cw[p]), hi_bf(cw[p]), sk));
            }
        }
        sq += LANE_SHFL_XOR(sq, 1);
        sq += LANE_SHFL_XOR(sq, 2);
        sk += LANE_SHFL_XOR(sk, 1);
        sk += LANE_SHFL_XOR(sk, 2);
        if (qd == 0) {
            rq[i] = l2norm ? scale / sqrtf(sq + 1e-6f) : scale;
            rk[i] = l2norm ? 1.f / sqrtf(sk + 1e-6f) : 1.f;
        }
    }
    {
        // Each thread sums one channel over one segment of tokens in registers; the segments'
        // totals (in af's space, unused yet) give each its offset.
        constexpr int SEGS = 256 / DK, SEG = CH / SEGS;
        const int d = tid % DK, sg = tid / DK;
        float* seg_total = af;
        float run[SEG];
#pragma unroll
        for (int i = 0; i < SEG; ++i) run[i] = gcs[(sg * SEG + i) * GLD + d];
#pragma unroll
        for (int i = 1; i < SEG; ++i) run[i] += run[i - 1];
        seg_total[sg * DK + d] = run[SEG - 1];
        __syncthreads();
        float off = 0.f;
        for (int s2 = 0; s2 < sg; ++s2) off += seg_total[s2 * DK + d];
#pragma unroll
        for (int i = 0; i < SEG; ++i) gcs[(sg * SEG + i) * GLD + d] = run[i] + off;
        __syncthreads();
        if (tid < DK) {
            for (int sc = 0; sc < NSUB; ++sc) {
                const float span = gcs[sc * SUB * GLD + tid] - gcs[(sc * SUB + SUB - 1) * GLD + tid];
                if (span > SPAN_LIMIT) atomicOr(unsafe_span, 1);
            }
        }
        __syncthreads();
    }
    const bool exact_diag = unsafe_span[0] != 0;

    // 3. A (beta-scaled k.k, strictly lower) into shared f32 and Aqk (q.k, lower with the
    //    diagonal) into global bf16, by 16-row blocks I. Decays are referenced to the first token
    //    f of block I: left factor exp(gc_i - gc_f) <= 1, right exp(gc_f - gc_j), which is <= 1
    //    for earlier blocks and at most exp(span) inside block I.
    bf16_t* aqk = aqk_out + chunk * CH * CH;
    if (!(PREP_SKIP & 1)) {
        // Operands built in registers, as mma fragments, straight from the staged chunk: a warp
        // owns one row block I (its left operands, k and q, built once) and a run of its tiles
        // of 16 rows x 8 columns, u = 2J + column half for the column blocks J <= I. The 20 tiles
        // are spread so that no warp has more than 3: warps 0..7 take row blocks 0 3 1 1 2 2 3 3
        // and tiles [0,2) [6,8) [0,2) [2,4) [0,3) [3,6) [0,3) [3,6). No shared-memory staging, no
        // barriers.
        const int I = (0xfa5cu >> (2 * warp)) & 3, f = I * SUB;
        const int u0 = (0x30302060u >> (4 * warp)) & 15, u1 = (0x63634282u >> (4 * warp)) & 15;
        unsigned lk[DK / 16][4], lq[DK / 16][4];
#pragma unroll
        for (int ks_ = 0; ks_ < DK / 16; ++ks_)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = f + g8 + 8 * (r & 1), d = 16 * ks_ + 2 * t4 + 8 * (r >> 1);
                const float2 gi = *(const float2*)(gcs + i * GLD + d);
                const float2 gf = *(const float2*)(gcs + f * GLD + d);
                const float e0 = kda_exp(gi.x - gf.x), e1 = kda_exp(gi.y - gf.y);
                const unsigned kw = *(const unsigned*)(ks + i * OLD + d);
                const unsigned qw = *(const unsigned*)(qs + i * OLD + d);
                lk[ks_][r] = pack_bf16x2(lo_bf(kw) * rk[i] * e0, hi_bf(kw) * rk[i] * e1);
                lq[ks_][r] = pack_bf16x2(lo_bf(qw) * rq[i] * e0, hi_bf(qw) * rq[i] * e1);
            }
        for (int u = u0; u < u1; ++u) {
            const int fj = (u >> 1) * SUB, c0 = fj + 8 * (u & 1);
            float ak[4] = {0.f, 0.f, 0.f, 0.f}, aq[4] = {0.f, 0.f, 0.f, 0.f};
            const int j = c0 + g8;
#pragma unroll
            for (int ks_ = 0; ks_ < DK / 16; ++ks_) {
                unsigned bb[2];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int d = 16 * ks_ + 2 * t4 + 8 * hh;
                    const float2 gf = *(const float2*)(gcs + f * GLD + d);
                    const float2 gj = *(const float2*)(gcs + j * GLD + d);
                    const unsigned kw = *(const unsigned*)(ks + j * OLD + d);
                    bb[hh] = pack_bf16x2(lo_bf(kw) * rk[j] * kda_exp(gf.x - gj.x),
                                         hi_bf(kw) * rk[j] * kda_exp(gf.y - gj.y));
                }
                mma_bf16_16816(ak, lk[ks_], bb);
                mma_bf16_16816(aq, lq[ks_], bb);
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = f + g8 + 8 * hf, jj = c0 + 2 * t4;
                af[i * ALD + jj] = jj < i ? ak[2 * hf] * bs[i] : 0.f;
                af[i * ALD + jj + 1] = jj + 1 < i ? ak[2 * hf + 1] * bs[i] : 0.f;
                *(unsigned*)(aqk + i * CH + jj) = pack_bf16x2(jj <= i ? aq[2 * hf] : 0.f,
                                                              jj + 1 <= i ? aq[2 * hf + 1] : 0.f);
            }
        }
        // Aqk is zero right of each row block's diagonal tile.
        for (int e = tid; e < CH * CH / 2; e += 256) {
            const int i = e / (CH / 2), j = (e % (CH / 2)) * 2;
            if (j >= (i / SUB + 1) * SUB) *(unsigned*)(aqk + i * CH + j) = 0u;
        }
        if (exact_diag) {
            // The diagonal blocks pair by pair in f32 (a chunk whose decay span could overflow
            // the factored form).
            __syncthreads();
            constexpr int PAIRS = SUB * (SUB + 1) / 2;
            for (int p = tid; p < NSUB * PAIRS; p += 256) {
                const int q = p % PAIRS, fd = (p / PAIRS) * SUB;
                int ii = 0;
                while ((ii + 1) * (ii + 2) / 2 <= q) ++ii;
                const int i = fd + ii, j = fd + q - ii * (ii + 1) / 2;
                float dk_ = 0.f, dq = 0.f;
                for (int d = 0; d < DK; ++d) {
                    const float e = kda_exp(gcs[i * GLD + d] - gcs[j * GLD + d]);
                    const float kj = bf2f(ks[j * OLD + d]) * rk[j] * e;
                    dk_ += bf2f(ks[i * OLD + d]) * rk[i] * kj;
                    dq += bf2f(qs[i * OLD + d]) * rq[i] * kj;
                }
                af[i * ALD + j] = j < i ? dk_ * bs[i] : 0.f;
                aqk[i * CH + j] = f2bf(dq);
            }
        }
        __syncthreads();
    }

    // This thread's v pieces (beta v's rows j = e / (DV / 8) for e = tid + 256 rep), loaded
    // early when KDA_V_EARLY says so.
    constexpr int VREP = CH * DV / 8 / 256;
    uint4 vr[VREP];
    auto load_v = [&]() {
#pragma unroll
        for (int rep = 0; rep < VREP; ++rep) {
            const int e = tid + rep * 256, j = e / (DV / 8), n = (e % (DV / 8)) * 8;
            vr[rep] = j < len ? *(const uint4*)(v + (size_t)(t0 + j) * ld_v + h * DV + n) : make_uint4(0, 0, 0, 0);
        }
    };
    if (KDA_V_EARLY == 2) load_v();

    // 4. T = (I + A)^-1 (unit lower triangular): 16x16 diagonal blocks by substitution (a lane per
    //    column), then off-diagonal blocks by distance: T_IJ = -T_II sum_{K=J..I-1} A_IK T_KJ.
    float* tf = (float*)(x + X_TF);
    if (!(PREP_SKIP & 2)) {
    for (int e = tid; e < CH * TFLD; e += 256) tf[e] = 0.f;
    __syncthreads();
    if (tid < NSUB * SUB) {
        // Diagonal block tid/16, column c = tid%16 held in registers. Entries above the diagonal
        // come out zero by themselves: t[j] = 0 for j < c.
        const int f = (tid / SUB) * SUB, c = tid % SUB;
        float t[SUB];
#pragma unroll
        for (int i = 0; i < SUB; ++i) {
            float s = i == c ? 1.f : 0.f;
#pragma unroll
            for (int j = 0; j < i; ++j) s -= af[(f + i) * ALD + f + j] * t[j];
            t[i] = s;
        }
#pragma unroll
        for (int i = 0; i < SUB; ++i) tf[(f + i) * TFLD + f + c] = t[i];
    }
    __syncthreads();
#if KDA_INV_TC
    {
        // Off-diagonal blocks by distance on the tensor cores (tf32 inputs rounded to nearest,
        // f32 sums): warp J takes block (J + dist, J); xs = sum_K A_IK T_KJ goes through the
        // warp's scratch into T_IJ = -T_II xs. Warps 0..NSUB-2 do it (a barrier of their own
        // between distances); with KDA_OVERLAP_OUT the others write step 5's outputs meanwhile.
        float* xs = (float*)(x + X_XS) + warp * SUB * XLD;
        for (int dist = 1; warp < NSUB - 1 && dist < NSUB; ++dist) {
            const int J = warp, I = J + dist;
            if (I < NSUB) {
                float acc[2][4] = {};
                for (int kb = J; kb < I; ++kb)
                    tf32_block_product(acc, af + I * SUB * ALD + kb * SUB, ALD, tf + kb * SUB * TFLD + J * SUB, TFLD);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        xs[(g8 + 8 * (e >> 1)) * XLD + nt * 8 + 2 * t4 + (e & 1)] = acc[nt][e];
                        acc[nt][e] = 0.f;
                    }
                __syncwarp();
                tf32_block_product(acc, tf + I * SUB * TFLD + I * SUB, TFLD, xs, XLD);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        tf[(I * SUB + g8 + 8 * (e >> 1)) * TFLD + J * SUB + nt * 8 + 2 * t4 + (e & 1)] = -acc[nt][e];
            }
            asm volatile("bar.sync 2, %0;" ::"n"((NSUB - 1) * LANES) : "memory");
        }
#if KDA_OVERLAP_OUT
        if (warp >= NSUB - 1 && !(PREP_SKIP & 4))
            prep_outputs(tid - (NSUB - 1) * LANES, 256 - (NSUB - 1) * LANES, qs, ks, gcs, rq, rk,
                         qg_out + chunk * CH * DK, kg_out + chunk * CH * DK, egl_out + chunk * DK);
#endif
        __syncthreads();
    }
#else
    {
        // Off-diagonal blocks by distance, every thread on one (block, row, column) at a time.
        float* xs = (float*)(x + X_XS);
        for (int dist = 1; dist < NSUB; ++dist) {
            const int nblk = NSUB - dist;
            for (int o = tid; o < nblk * SUB * SUB; o += 256) {
                const int J = o / (SUB * SUB), I = J + dist, r = (o / SUB) % SUB, cc = o % SUB;
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
                for (int kb = J; kb < I; ++kb) {
#pragma unroll
                    for (int m = 0; m < SUB; ++m)
                        acc[m & 3] += af[(I * SUB + r) * ALD + kb * SUB + m] * tf[(kb * SUB + m) * TFLD + J * SUB + cc];
                }
                xs[o] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            }
            __syncthreads();
            for (int o = tid; o < nblk * SUB * SUB; o += 256) {
                const int J = o / (SUB * SUB), I = J + dist, r = (o / SUB) % SUB, cc = o % SUB;
                const float* xb = xs + J * SUB * SUB;
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int m = 0; m < SUB; ++m) acc[m & 3] += tf[(I * SUB + r) * TFLD + I * SUB + m] * xb[m * SUB + cc];
                tf[(I * SUB + r) * TFLD + J * SUB + cc] = -((acc[0] + acc[1]) + (acc[2] + acc[3]));
            }
            __syncthreads();
        }
    }
#endif
    }
    bf16_t* tb = (bf16_t*)(smem + P_AF);  // af is dead now
    for (int e = tid; e < CH * CH / 2; e += 256) {
        const int i = e / (CH / 2), j = (e % (CH / 2)) * 2;
        *(unsigned*)(tb + i * TLD + j) = pack_bf16x2(tf[i * TFLD + j], tf[i * TFLD + j + 1]);
    }
    __syncthreads();

    // 5. Outputs that need no product (written during the inverse when KDA_OVERLAP_OUT).
    if (!(PREP_SKIP & 4) && (!KDA_OVERLAP_OUT || (PREP_SKIP & 2)))
        prep_outputs(tid, 256, qs, ks, gcs, rq, rk, qg_out + chunk * CH * DK,
                     kg_out + chunk * CH * DK, egl_out + chunk * DK);
    if (PREP_SKIP & 8) return;

    // 6. w = T (beta k exp(gc)) and u = T (beta v) on the tensor cores, their right operands
    //    staged row-major (16-byte pieces, read back transposed by the fragment loads). beta v
    //    goes where q/k were (they are consumed once the beta k stage is built).
    bf16_t* bk = (bf16_t*)(x + X_BK);
    bf16_t* bv = (bf16_t*)(smem + P_QS);
    bf16_t* out_scratch = (bf16_t*)(smem + P_GCS);  // the decays are consumed
    if (KDA_V_EARLY == 1) load_v();
    if (KDA_V_EARLY == 0 && KDA_WU_ONE_PHASE) load_v();
    // beta v overwrites q, which step 5 may still be reading in this phase.
    if (KDA_WU_ONE_PHASE && (!KDA_OVERLAP_OUT || (PREP_SKIP & 2))) __syncthreads();
    for (int e = tid; e < CH * DK / 8; e += 256) {
        const Piece pc = piece_of(e);
        const int j = pc.row;
        const float4 ga = *(const float4*)(gcs + j * GLD + pc.c0), gb = *(const float4*)(gcs + j * GLD + pc.c1);
        st_piece(bk + j * (DK + 8), pc, scale_exp8(ld_piece(ks + j * OLD, pc), rk[j] * bs[j], ga, gb));
    }
    auto stage_bv = [&]() {
        if (KDA_V_EARLY == 0 && !KDA_WU_ONE_PHASE) load_v();
#pragma unroll
        for (int rep = 0; rep < VREP; ++rep) {
            const int e = tid + rep * 256, j = e / (DV / 8), n = (e % (DV / 8)) * 8;
            const float r = bs[j];
            const uint4 vw = vr[rep];
            uint4 o4;
            o4.x = pack_bf16x2(lo_bf(vw.x) * r, hi_bf(vw.x) * r);
            o4.y = pack_bf16x2(lo_bf(vw.y) * r, hi_bf(vw.y) * r);
            o4.z = pack_bf16x2(lo_bf(vw.z) * r, hi_bf(vw.z) * r);
            o4.w = pack_bf16x2(lo_bf(vw.w) * r, hi_bf(vw.w) * r);
            *(uint4*)(bv + j * (DV + 8) + n) = o4;
        }
    };
    if (KDA_WU_ONE_PHASE) stage_bv();
    __syncthreads();
    t_times(tb, bk, DK, w_out + chunk * CH * DK, out_scratch);
    if (!KDA_WU_ONE_PHASE) {
        stage_bv();
        __syncthreads();
    }
    t_times(tb, bv, DV, u_out + chunk * CH * DV, out_scratch);
}
