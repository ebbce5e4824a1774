// The tensor-core MoE decode kernels: gate/up with SiTU and down, for bf16 and MXFP4 experts
// (compiled after moe_tc.cu and moe_tc_tma.cu, whose projections they run).

// tc_project, or for MXFP4 weights with MOE_TC_TMA on sm_90, tc_project_tma (which the host
// never launches as dependent).
template <typename W, int M, bool DEPENDENT = false, typename Input, typename Store>
__device__ __forceinline__ void tc_project_any(const W (&w)[M], const void* const (&tmaps)[M],
                                               const int* __restrict__ n_active,
                                               const int* __restrict__ act_expert,
                                               const int* __restrict__ act_count,
                                               const int* __restrict__ act_pairs, int out_rows,
                                               int in_dim, int ksplit, Input input, Store store,
                                               const unsigned* ready = nullptr,
                                               unsigned ready_target = 0, int stage = 0) {
#if MOE_TMA_ON
    if constexpr (W::SCALED) {
        tc_project_tma<M>(w, tmaps, n_active, act_expert, act_count, act_pairs, out_rows, in_dim,
                          ksplit, input, store);
        return;
    }
#endif
    tc_project<W, M, DEPENDENT>(w, n_active, act_expert, act_count, act_pairs, out_rows, in_dim,
                                ksplit, 16, input, store, ready, ready_target, stage);
}

// The end of a gate/up block (task): one more of active expert a's blocks has its h rows stored
// (counted when a < *n_active with CHECK, else always). Returns whether it held a block barrier
// (counts kept: MOE_TC_FINE and `ready`).
template <bool CHECK>
__device__ __forceinline__ bool gate_up_block_done(unsigned* ready, unsigned a,
                                                   const int* n_active) {
#if MOE_TC_FINE
    if (ready == nullptr) return false;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && (!CHECK || (int)a < *n_active)) atomicAdd(ready + a, 1u);
    return true;
#else
    return false;
#endif
}

// The end of a down block: as a dependent launch waiting on counts, it still waits for the
// gate/up kernel itself, so that this kernel ends after it.
__device__ __forceinline__ void down_block_done(const unsigned* ready) {
#if MOE_TC_FINE && MOE_TC_DEPENDENT
    if (ready != nullptr) grid_dep_wait();
#endif
}

// Gate/up's input rows (token pair / top_k of x) and stores (SiTU of the two sums into h), for
// the normal and the resident grids alike.
struct GateUpInput {
    const bf16_t* x;
    int din, top_k;
    __device__ __forceinline__ const bf16_t* operator()(int pair) const {
        return x + (size_t)(pair / top_k) * din;
    }
};
struct GateUpStore {
    bf16_t* h;
    int di;
    float b1, b2;
    __device__ __forceinline__ void operator()(int pair, int row, const float (&c)[2][4],
                                               int j) const {
        h[(size_t)pair * di + row] = f2bf(situ(c[0][j], c[1][j], b1, b2));
    }
};

template <typename W>
__device__ __forceinline__ void gate_up_tc(W wg, W wu, const bf16_t* __restrict__ x,
                                           const int* __restrict__ n_active,
                                           const int* __restrict__ act_expert,
                                           const int* __restrict__ act_count,
                                           const int* __restrict__ act_pairs,
                                           bf16_t* __restrict__ h, int din, int di, int top_k,
                                           float b1, float b2, int ksplit, unsigned* ready,
                                           int stage, const void* const (&tmaps)[2]) {
    // A dependent launch (of the routing kernel, or of what the stream ran after it): nothing
    // is read before the wait, and the down kernel, which reads the plan before its own wait,
    // may launch only once every block is past it.
    grid_dep_wait();
    grid_dep_launch();
    const W w[2] = {wg, wu};
    if (MOE_TC_PROBE != 2)
        tc_project_any<W, 2>(w, tmaps, n_active, act_expert, act_count, act_pairs, di, din,
                             ksplit, GateUpInput{x, din, top_k}, GateUpStore{h, di, b1, b2},
                             nullptr, 0, stage);
    gate_up_block_done<true>(ready, blockIdx.y, n_active);
}

// Gate/up by resident blocks (moe_tc_resident.cu): a grid of one wave walks the block tasks,
// `per_expert` an active expert; each task counts itself done in `ready` as a block of the normal
// grid does. Its own kernels, so that the normal grid's keep their registers.
template <typename W>
__device__ __forceinline__ void gate_up_tc_resident(W wg, W wu, const bf16_t* __restrict__ x,
                                                    const int* __restrict__ n_active,
                                                    const int* __restrict__ act_expert,
                                                    const int* __restrict__ act_count,
                                                    const int* __restrict__ act_pairs,
                                                    bf16_t* __restrict__ h, int din, int di,
                                                    int top_k, float b1, float b2, int ksplit,
                                                    unsigned* ready, int per_expert) {
    grid_dep_wait();  // as gate_up_tc
    grid_dep_launch();
    const W w[2] = {wg, wu};
    // A task ends on a block barrier in any case (the next may stage its inputs again).
    auto done = [&](int a) {
        if (!gate_up_block_done<false>(ready, a, n_active)) __syncthreads();
    };
    tc_gate_up_resident<W>(w, n_active, act_expert, act_count, act_pairs, di, din, ksplit,
                           per_expert, GateUpInput{x, din, top_k}, GateUpStore{h, di, b1, b2},
                           done);
}

// The weighted combine inside the down kernel (small batches; the host passes `out` non-null
// instead of launching moe_combine). Each (token, row tile) of the output waits for top_k
// stores, one per slot: once its own y rows are out (a fence), a row tile's part-0 warp counts
// one more slot done for each of its expert's tokens, and the warp that completes a token sums
// the token's slots in slot order and stores the bf16 rows, the same sums as moe_combine's.
// The warp that completes the call's last (token, tile) sets the gate/up counts back to zero
// (every down warp is past its wait then), as moe_combine does; each (token, tile) count is set
// back by the warp that completed it. counts[0]: (token, tile)s done; counts[1 + token · tiles
// + tile]: the slots done there.
struct FusedCombine {
    const float* weight;  // [batch, top_k] routing weights, slot order
    bf16_t* out;          // [batch, din]; null: moe_combine runs after the kernel
    unsigned* counts;     // 1 + batch · tiles, zero between calls
    unsigned* ready;      // the gate/up counts to set back (null: none)
    int top_k, groups, n_ready;
};

__device__ __forceinline__ void down_combine_rows(const FusedCombine& fc, const float* y,
                                                  const int* __restrict__ n_active,
                                                  const int* __restrict__ act_count,
                                                  const int* __restrict__ act_pairs, int din,
                                                  int in_vecs, int ksplit, int tile_rows) {
    const int a = blockIdx.y;
    if (a >= *n_active) return;
    const TcSplit sp(ksplit, in_vecs, tile_rows);
    if (sp.part != 0 || sp.tile_row0 >= din) return;
    const int lane = threadIdx.x & 31, tiles = din / tile_rows, tile = sp.tile_row0 / tile_rows;
    const int nt = min(act_count[a], MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    __threadfence();  // this lane's y stores, before lane 0 counts them
    __syncwarp();
    for (int j = 0; j < nt; ++j) {
        const int tok = pairs[j] / fc.top_k;
        unsigned* slots = fc.counts + 1 + tok * tiles + tile;
        unsigned last = 0;
        if (lane == 0) {
            last = atomicAdd(slots, 1u) == (unsigned)fc.top_k - 1;
            if (last) __threadfence();  // the other slots' rows, stored before their counts
        }
        if (!__shfl_sync(0xffffffffu, last, 0)) continue;
        __syncwarp();  // and so before every lane's loads
        // A lane a row; its slots' values loaded 16 at a time before any is summed (one round
        // trip to L2 for K3's top-16, not one per slot), then summed in slot order.
        const float* wt = fc.weight + tok * fc.top_k;
        for (int r = lane; r < tile_rows; r += 32) {
            const float* col = y + (size_t)tok * fc.top_k * din + sp.tile_row0 + r;
            float s = 0.0f;
            for (int k0 = 0; k0 < fc.top_k; k0 += 16) {
                float v[16], w[16];
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    const bool in = k0 + u < fc.top_k;
                    v[u] = in ? __ldcg(col + (size_t)(k0 + u) * din) : 0.0f;
                    w[u] = in ? wt[k0 + u] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 16; ++u)
                    if (k0 + u < fc.top_k) s = fmaf(w[u], v[u], s);
            }
            fc.out[(size_t)tok * din + sp.tile_row0 + r] = f2bf(s);
        }
        unsigned done = 0;
        if (lane == 0) {
            *slots = 0u;
            done = atomicAdd(fc.counts, 1u);
        }
        done = __shfl_sync(0xffffffffu, done, 0);
        if (done == (unsigned)fc.groups - 1) {
            if (fc.ready != nullptr)
                for (int i = lane; i < fc.n_ready; i += 32) fc.ready[i] = 0u;
            if (lane == 0) fc.counts[0] = 0u;
        }
    }
}

template <typename W>
__device__ __forceinline__ void down_tc(W wd, const bf16_t* __restrict__ h,
                                        const int* __restrict__ n_active,
                                        const int* __restrict__ act_expert,
                                        const int* __restrict__ act_count,
                                        const int* __restrict__ act_pairs, float* __restrict__ y,
                                        int din, int di, int ksplit, const unsigned* ready,
                                        unsigned ready_target, int stage,
                                        const void* const (&tmaps)[1], const FusedCombine& fc) {
    grid_dep_launch();
    constexpr bool DEP = MOE_TC_DEPENDENT;
    if (MOE_TC_PROBE == 1) {
        down_block_done(ready);
        return;
    }
    auto input = [&](int pair) { return h + (size_t)pair * di; };
    if constexpr (W::DOWN_TILES == 2 && !(MOE_TMA_ON && W::SCALED)) {
        const W w[2] = {wd, wd.from_row(16, di)};
        tc_project<W, 2, DEP>(w, n_active, act_expert, act_count, act_pairs, din, di, ksplit, 32,
                              input,
                              [&](int pair, int row, const float (&c)[2][4], int j) {
                                  y[(size_t)pair * din + row] = c[0][j];
                                  y[(size_t)pair * din + row + 16] = c[1][j];
                              },
                              ready, ready_target, stage);
    } else {
        const W w[1] = {wd};
        tc_project_any<W, 1, DEP>(w, tmaps, n_active, act_expert, act_count, act_pairs, din, di,
                                  ksplit, input,
                                  [&](int pair, int row, const float (&c)[1][4], int j) {
                                      y[(size_t)pair * din + row] = c[0][j];
                                  },
                                  ready, ready_target, stage);
    }
    if constexpr (!(MOE_TMA_ON && W::SCALED)) {
        constexpr int TILE_ROWS = W::DOWN_TILES == 2 ? 32 : 16;
        if (fc.out != nullptr)
            down_combine_rows(fc, y, n_active, act_count, act_pairs, din, di / W::PER_VEC, ksplit,
                              TILE_ROWS);
    }
    down_block_done(ready);
}

// The fused combine's arguments of the down kernels (see FusedCombine; `fc_out` null: off).
#define FUSED_COMBINE_PARAMS                                                                      \
    const float* __restrict__ fc_weight, bf16_t* __restrict__ fc_out,                             \
        unsigned* __restrict__ fc_counts, int fc_top_k, int fc_groups, int fc_n_ready
#define FUSED_COMBINE(ready)                                                                      \
    FusedCombine { fc_weight, fc_out, fc_counts, ready, fc_top_k, fc_groups, fc_n_ready }

// The same four projections on the tensor cores (block: MOE_TC_WARPS warps of 16 rows each).
extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_bf16(const bf16_t* __restrict__ w_gate, const bf16_t* __restrict__ w_up,
                    const bf16_t* __restrict__ x, PLAN_ARGS, bf16_t* __restrict__ h, int din,
                    int di, int top_k, float b1, float b2, int ksplit,
                    unsigned* __restrict__ ready, int stage) {
    const void* const tmaps[2] = {nullptr, nullptr};
    gate_up_tc(Bf16Tc{reinterpret_cast<const uint4*>(w_gate)},
               Bf16Tc{reinterpret_cast<const uint4*>(w_up)}, x, n_active, act_expert, act_count,
               act_pairs, h, din, di, top_k, b1, b2, ksplit, ready, stage, tmaps);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_mxfp4(const unsigned char* __restrict__ gate_packed,
                     const unsigned char* __restrict__ gate_scale,
                     const unsigned char* __restrict__ up_packed,
                     const unsigned char* __restrict__ up_scale, const bf16_t* __restrict__ x,
                     PLAN_ARGS, bf16_t* __restrict__ h, int din, int di, int top_k, float b1,
                     float b2, int ksplit, unsigned* __restrict__ ready,
                     int stage TMA_PARAMS_2) {
    TMA_MAPS_2
    gate_up_tc(Mxfp4Tc{reinterpret_cast<const uint4*>(gate_packed), gate_scale},
               Mxfp4Tc{reinterpret_cast<const uint4*>(up_packed), up_scale}, x, n_active,
               act_expert, act_count, act_pairs, h, din, di, top_k, b1, b2, ksplit, ready,
               stage, tmaps);
}

// Gate/up by resident blocks, both formats (the arguments of the normal kernels, `per_expert`
// in place of `stage`; never the copy-engine ring).
extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_res_bf16(const bf16_t* __restrict__ w_gate, const bf16_t* __restrict__ w_up,
                        const bf16_t* __restrict__ x, PLAN_ARGS, bf16_t* __restrict__ h, int din,
                        int di, int top_k, float b1, float b2, int ksplit,
                        unsigned* __restrict__ ready, int per_expert) {
    gate_up_tc_resident(Bf16Tc{reinterpret_cast<const uint4*>(w_gate)},
                        Bf16Tc{reinterpret_cast<const uint4*>(w_up)}, x, n_active, act_expert,
                        act_count, act_pairs, h, din, di, top_k, b1, b2, ksplit, ready,
                        per_expert);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_gate_up_tc_res_mxfp4(const unsigned char* __restrict__ gate_packed,
                         const unsigned char* __restrict__ gate_scale,
                         const unsigned char* __restrict__ up_packed,
                         const unsigned char* __restrict__ up_scale,
                         const bf16_t* __restrict__ x, PLAN_ARGS, bf16_t* __restrict__ h,
                         int din, int di, int top_k, float b1, float b2, int ksplit,
                         unsigned* __restrict__ ready, int per_expert) {
    gate_up_tc_resident(Mxfp4Tc{reinterpret_cast<const uint4*>(gate_packed), gate_scale},
                        Mxfp4Tc{reinterpret_cast<const uint4*>(up_packed), up_scale}, x,
                        n_active, act_expert, act_count, act_pairs, h, din, di, top_k, b1, b2,
                        ksplit, ready, per_expert);
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_down_tc_bf16(const bf16_t* __restrict__ w_down, const bf16_t* __restrict__ h, PLAN_ARGS,
                 float* __restrict__ y, int din, int di, int ksplit, unsigned* ready,
                 int ready_target, int stage, FUSED_COMBINE_PARAMS) {
    const void* const tmaps[1] = {nullptr};
    down_tc(Bf16Tc{reinterpret_cast<const uint4*>(w_down)}, h, n_active, act_expert, act_count,
            act_pairs, y, din, di, ksplit, ready, (unsigned)ready_target, stage, tmaps,
            FUSED_COMBINE(ready));
}

extern "C" __global__ void __launch_bounds__(MOE_TC_WARPS * 32, MOE_TC_MIN_BLOCKS)
moe_down_tc_mxfp4(const unsigned char* __restrict__ down_packed,
                  const unsigned char* __restrict__ down_scale, const bf16_t* __restrict__ h,
                  PLAN_ARGS, float* __restrict__ y, int din, int di, int ksplit,
                  unsigned* ready, int ready_target, int stage,
                  FUSED_COMBINE_PARAMS TMA_PARAMS_1) {
    TMA_MAPS_1
    down_tc(Mxfp4Tc{reinterpret_cast<const uint4*>(down_packed), down_scale}, h, n_active,
            act_expert, act_count, act_pairs, y, din, di, ksplit, ready, (unsigned)ready_target,
            stage, tmaps, FUSED_COMBINE(ready));
}
