// MoE expert projections with MXFP4 weights brought into shared memory by the copy engine (a
// build setting, off by default; compiled after moe_tc.cu, whose formats, passes, splits and
// stores it uses).
// ---------------------------------------------------------------------------------------------
// MXFP4 weights through shared memory by the copy engine (sm_90, MOE_TC_TMA=1). Each warp keeps a
// ring of MOE_TMA_STAGES stages, a stage holding the next MOE_TMA_CHUNK vectors of its 16 rows of
// each matrix as boxes of 16 rows x 128 bytes, each box one tensor copy (a 2-D tensor map per
// matrix, from the host) that reports its bytes to the stage's barrier. A warp so has up to
// STAGES - 1 stages in flight while it decodes one, and no registers hold bytes in flight. The
// copies store each 128-byte row with its 16-byte units permuted by the row (the 128-byte
// swizzle), so that lanes reading 8 rows at one vector hit distinct banks. The scales of the
// tile's rows are read once per tile. Elsewhere (sm_80, MOE_TC_TMA=0) the register path runs.
#ifndef MOE_TC_TMA
#define MOE_TC_TMA 0
#endif
#ifndef MOE_TMA_CHUNK
#define MOE_TMA_CHUNK 8
#endif
#ifndef MOE_TMA_STAGES
#define MOE_TMA_STAGES 3
#endif
#define MOE_TMA_BOXES (MOE_TMA_CHUNK / 8)  // boxes of 8 vectors per row, matrix and stage
#define MOE_TMA_BOX 2048                    // 16 rows x 128 bytes

#if MOE_TC_TMA
#define TMA_PARAMS_2 , const __grid_constant__ TensorMap tm0, const __grid_constant__ TensorMap tm1
#define TMA_PARAMS_1 , const __grid_constant__ TensorMap tm0
#define TMA_MAPS_2 const void* const tmaps[2] = {&tm0, &tm1};
#define TMA_MAPS_1 const void* const tmaps[1] = {&tm0};
#else
#define TMA_PARAMS_2
#define TMA_PARAMS_1
#define TMA_MAPS_2 const void* const tmaps[2] = {nullptr, nullptr};
#define TMA_MAPS_1 const void* const tmaps[1] = {nullptr};
#endif

#if MOE_TC_TMA && defined(TESSERA_TMA)
#define MOE_TMA_ON 1
#else
#define MOE_TMA_ON 0
#endif

#if MOE_TMA_ON
// tc_project for MXFP4 weights streamed by the copy engine (see above); the same plan, split,
// passes and stores. `tmaps[m]` maps matrix m's codes as [experts x out_rows, in_dim / 2] bytes.
// Dynamic shared memory: the host's TmaRing::block_bytes (moe.rs).
template <int M, typename Input, typename Store>
__device__ __forceinline__ void tc_project_tma(const Mxfp4Tc (&w)[M],
                                               const void* const (&tmaps)[M],
                                               const int* __restrict__ n_active,
                                               const int* __restrict__ act_expert,
                                               const int* __restrict__ act_count,
                                               const int* __restrict__ act_pairs, int out_rows,
                                               int in_dim, int ksplit, Input input, Store store) {
    static_assert(Mxfp4Tc::SPAN == 2 && MOE_TMA_CHUNK % 8 == 0, "a pass is 8 vectors");
    extern __shared__ __align__(128) unsigned char moe_dyn[];
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nsv = in_dim / Mxfp4Tc::PER_VEC, srow = (nsv + 15) & ~15;
    const TcSplit sp(ksplit, nsv);
    const int row0 = sp.tile_row0;
    if (ksplit == 1 && row0 >= out_rows) return;
    const bool rows_in = row0 < out_rows;
    const int e = act_expert[a], nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const size_t rbase = (size_t)e * out_rows + min(row0, out_rows - 16);
    constexpr int RING = MOE_TMA_STAGES * M * MOE_TMA_BOXES * MOE_TMA_BOX;
    const int per_warp = (RING + M * 16 * srow + MOE_TMA_STAGES * 8 + 1023) & ~1023;
    // The swizzled boxes need 1024-byte alignment (the host adds that much slack).
    const unsigned base = (smem_addr(moe_dyn) + 1023u) & ~1023u;
    unsigned char* ring = moe_dyn + (base - smem_addr(moe_dyn)) + warp * per_warp;
    unsigned char* sc = ring + RING;
    const unsigned ring_at = smem_addr(ring), bar0 = smem_addr(sc + M * 16 * srow);
    const int len = sp.vend - sp.vbeg, nchunks = (len + MOE_TMA_CHUNK - 1) / MOE_TMA_CHUNK;
    const int total = rows_in ? (nt + 7) / 8 * nchunks : 0;
    if (lane == 0) {
        for (int s = 0; s < MOE_TMA_STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
        mbar_init_fence();
    }
    __syncwarp();
    // Stage `it % STAGES` gets chunk `it % nchunks` (every token group walks the same chunks);
    // boxes past the row's end are zero-filled and still count their bytes.
    int fill_chunk = 0;
    auto fill = [&](int it) {
        const int s = it % MOE_TMA_STAGES, v0 = sp.vbeg + fill_chunk * MOE_TMA_CHUNK;
        fill_chunk = fill_chunk + 1 == nchunks ? 0 : fill_chunk + 1;
        if (lane == 0) {
            const unsigned bar = bar0 + 8 * s;
            mbar_expect_tx(bar, M * MOE_TMA_BOXES * MOE_TMA_BOX);
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int b = 0; b < MOE_TMA_BOXES; ++b)
                    tensor_box_g2s(ring_at + ((s * M + m) * MOE_TMA_BOXES + b) * MOE_TMA_BOX,
                                   tmaps[m], (v0 + 8 * b) * 16, (int)rbase, bar);
        }
    };
    for (int it = 0; it < min(total, MOE_TMA_STAGES); ++it) fill(it);
    if (rows_in) {
        if ((nsv & 3) == 0) {
            for (int rr = 0; rr < M * 16; ++rr) {
                const unsigned* src =
                    reinterpret_cast<const unsigned*>(w[rr >> 4].scales + (rbase + (rr & 15)) * nsv);
                unsigned* dst = reinterpret_cast<unsigned*>(sc + rr * srow);
                for (int j = lane; j < nsv / 4; j += 32) dst[j] = __ldg(src + j);
            }
        } else {
            for (int rr = 0; rr < M * 16; ++rr)
                for (int j = lane; j < nsv; j += 32)
                    sc[rr * srow + j] = w[rr >> 4].scales[(rbase + (rr & 15)) * nsv + j];
        }
    }
    __syncwarp();
    int it = 0;
    for (int t0 = 0; t0 < nt; t0 += 8) {
        const bf16_t* xt = input(pairs[min(t0 + g, nt - 1)]);
        float c[M][4] = {};
        for (int ch = 0; ch < (rows_in ? nchunks : 0); ++ch, ++it) {
            const int s = it % MOE_TMA_STAGES, v0 = sp.vbeg + ch * MOE_TMA_CHUNK;
            const int nv = min(MOE_TMA_CHUNK, sp.vend - v0);
            mbar_wait(bar0 + 8 * s, (it / MOE_TMA_STAGES) & 1);
            const unsigned char* st = ring + s * M * MOE_TMA_BOXES * MOE_TMA_BOX;
#pragma unroll
            for (int q = 0; q < MOE_TMA_BOXES; ++q) {
                if (q * 8 >= nv) break;
                Mxfp4Tc::Vec wl[M][2], wh[M][2];
                const uint4* xv[2];
                bool in[2];
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int j = 2 * t + u, vl = q * 8 + j, vc = min(vl, nv - 1);
                    // Row r's unit j sits at unit j ^ (r % 8); rows g and g + 8 share it.
                    const int at = g * 128 + (((vc & 7) ^ g) << 4);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const unsigned char* box = st + (m * MOE_TMA_BOXES + q) * MOE_TMA_BOX;
                        wl[m][u].w = *reinterpret_cast<const uint4*>(box + at);
                        wh[m][u].w = *reinterpret_cast<const uint4*>(box + at + 8 * 128);
                        wl[m][u].scale = sc[(m * 16 + g) * srow + v0 + vc];
                        wh[m][u].scale = sc[(m * 16 + g + 8) * srow + v0 + vc];
                    }
                    xv[u] = reinterpret_cast<const uint4*>(xt) + (size_t)(v0 + vc) * 4;
                    in[u] = vl < nv;
                }
                if (q * 8 + 8 <= nv)
                    tc_mma_pass<Mxfp4Tc, M, true>(wl, wh, xv, in, c);
                else
                    tc_mma_pass<Mxfp4Tc, M, false>(wl, wh, xv, in, c);
            }
            __syncwarp();
            if (it + MOE_TMA_STAGES < total) {
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                fill(it + MOE_TMA_STAGES);
            }
        }
        tc_store_pass<M>(c, ksplit, sp.part, rows_in, t0, nt, row0, pairs, store);
    }
}
#endif
