// The chunk stage of the copy-engine KDA scans (kda_scan_tma.cu, kda_scan_tma_wg.cu,
// kda_scan_tma_rs.cu): w, q exp(gc), k exp(gc_last - gc) and Aqk as halves of 64 columns, each 64
// rows of 128 bytes in the copy engine's 128-byte swizzle; the block's KS_VT columns of u (32: plain
// rows of 64 bytes; 64: rows of 128 bytes in the swizzle, as the host's map says); exp(gc_last) in
// f32. One thread brings a chunk in 8 + KS_VT / KS_UBOX tensor copies and one bulk copy, all
// counted by `bar`.
#ifndef KS_VT
#define KS_VT 32
#endif
#define KS_UBOX (KS_VT < 64 ? KS_VT : 64)  // columns of u per box (the swizzle's 128 bytes at most)
#define KS_CH 64
#define KS_HALF (KS_CH * 128)  // bytes of a 64-column half of an operand
#define KS_W 0
#define KS_Q (KS_W + KS_CH * DK * 2)
#define KS_K (KS_Q + KS_CH * DK * 2)
#define KS_A (KS_K + KS_CH * DK * 2)
#define KS_U (KS_A + KS_CH * KS_CH * 2)
#define KS_E (KS_U + KS_CH * KS_VT * 2)
#define KS_TX (KS_E + DK * 4)              // bytes each chunk brings into each block
#define KS_STAGE ((KS_TX + 1023) & ~1023)  // swizzled boxes need 1024-byte alignment

#define KS_ATOM 1024                   // 8 rows of 128 bytes: the swizzle's repeat

#ifdef TESSERA_WGMMA  // the warpgroup scans, with wgmma.cuh before this
// A wgmma descriptor of a 64-row operand of the stage in the 128-byte swizzle from shared address
// a (rows of 128 bytes, 8-row atoms 1024 bytes apart; the stride between atoms along M or N, used
// by M- or N-major reads, is a half's 8 KB).
__device__ __forceinline__ unsigned long long ks_swizzled_desc(unsigned a) {
    static_assert(KS_ATOM == 1024, "the swizzle's repeat");
    return wg_desc_sw128_at(a, KS_HALF);
}
#endif

#ifdef TESSERA_TMA
// Columns [col0, col0 + KS_VT) of u, chunk rows [row0, row0 + 64), into the stage at shared
// address st: one box per KS_UBOX columns, each 64 rows.
__device__ __forceinline__ void kda_stage_copy_u(unsigned st, unsigned bar, const TensorMap* tm_u,
                                                 int row0, int col0) {
#pragma unroll
    for (int ub = 0; ub < KS_VT / KS_UBOX; ++ub)
        tensor_box_g2s(st + KS_U + ub * KS_CH * KS_UBOX * 2, tm_u, col0 + ub * KS_UBOX, row0, bar);
}

// Chunk rows [row0, row0 + 64) of the products, columns [col0, col0 + KS_VT) of u, into the stage
// at shared address st.
__device__ __forceinline__ void kda_stage_copy(unsigned st, unsigned bar, const TensorMap* tm_w,
                                               const TensorMap* tm_q, const TensorMap* tm_k,
                                               const TensorMap* tm_a, const TensorMap* tm_u,
                                               const float* egl, int row0, int col0) {
    mbar_expect_tx(bar, KS_TX);
#pragma unroll
    for (int hf = 0; hf < DK / 64; ++hf) {
        tensor_box_g2s(st + KS_W + hf * KS_HALF, tm_w, 64 * hf, row0, bar);
        tensor_box_g2s(st + KS_Q + hf * KS_HALF, tm_q, 64 * hf, row0, bar);
        tensor_box_g2s(st + KS_K + hf * KS_HALF, tm_k, 64 * hf, row0, bar);
    }
    tensor_box_g2s(st + KS_A, tm_a, 0, row0, bar);
    kda_stage_copy_u(st, bar, tm_u, row0, col0);
    bulk_g2s(st + KS_E, egl, DK * 4, bar);
}

// The same for a block of a cluster of `n` blocks (the V tiles of one head and sequence), which
// all bring the same chunk: block `rank` issues every n-th of the seven boxes of w, q, k and Aqk
// into the stages of all n (the barrier of each counts every byte), and its own u and exp(gc_last).
__device__ __forceinline__ void kda_stage_copy_shared(unsigned st, unsigned bar,
                                                      const TensorMap* tm_w, const TensorMap* tm_q,
                                                      const TensorMap* tm_k, const TensorMap* tm_a,
                                                      const TensorMap* tm_u, const float* egl,
                                                      int row0, int col0, unsigned rank, unsigned n) {
    const unsigned short all = (unsigned short)((1u << n) - 1);
    mbar_expect_tx(bar, KS_TX);
#pragma unroll
    for (int hf = 0; hf < DK / 64; ++hf) {
        if ((3 * hf) % n == rank)
            tensor_box_g2s_multicast(st + KS_W + hf * KS_HALF, tm_w, 64 * hf, row0, bar, all);
        if ((3 * hf + 1) % n == rank)
            tensor_box_g2s_multicast(st + KS_Q + hf * KS_HALF, tm_q, 64 * hf, row0, bar, all);
        if ((3 * hf + 2) % n == rank)
            tensor_box_g2s_multicast(st + KS_K + hf * KS_HALF, tm_k, 64 * hf, row0, bar, all);
    }
    if (6 % n == rank) tensor_box_g2s_multicast(st + KS_A, tm_a, 0, row0, bar, all);
    kda_stage_copy_u(st, bar, tm_u, row0, col0);
    bulk_g2s(st + KS_E, egl, DK * 4, bar);
}
#endif
