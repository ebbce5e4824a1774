// Gate/up on the tensor cores with resident blocks (compiled after moe_tc.cu, whose formats,
// passes and stores it uses). Where the normal grid gives each block one block task (an active
// expert's `WARPS / ksplit` row tiles) and a warp's task starts with its first pass of weights
// exposed, a resident grid (one wave of blocks) walks the block tasks t = blockIdx.x,
// blockIdx.x + gridDim.x, ... and, during the last pass of a task, loads the first pass of the
// next one into the registers that pass frees: the weights stream without a gap between tasks.
// At batch 1 (K3: 16 experts × 96 block tasks of 7 passes a warp) the gaps are one pass in
// eight. Each block task counts itself done in `ready` (the down kernel's waits) as a block of
// the normal grid does. Inputs come from shared memory, staged again only when a task's tokens
// differ from the staged ones (never at batch 1: every expert has token 0).

// A block task: active expert `a` (plan entry), its expert id, tokens and this warp's rows.
struct TcTask {
    int a, e, nt, row0;
    const int* pairs;
    bool rows_in;
};

// Block task `task` (of `per_expert` a expert) for this warp: plan entries by volatile loads, so
// that they go out where this is called, long before the rows are needed.
__device__ __forceinline__ TcTask tc_task(int task, int per_expert, int ksplit, int out_rows,
                                          const int* act_expert, const int* act_count,
                                          const int* act_pairs) {
    TcTask k;
    k.a = task / per_expert;
    k.row0 = tc_tile_row0(task - k.a * per_expert, ksplit, 16);
    k.rows_in = k.row0 < out_rows;
    k.e = ld_volatile_s32(act_expert + k.a);
    k.nt = ld_volatile_s32(act_count + k.a);
    k.pairs = act_pairs + k.a * MOE_MAXT;
    return k;
}

// Gate/up (M = 2 matrices of 16 rows a warp) over the block tasks of `n_active · per_expert`
// with resident blocks; every expert has at most `stage` (≤ 8) tokens, the host's condition, and
// each warp's input range is whole passes (also the host's). `done(a)` ends a block task (all
// threads call it; it holds a block barrier).
template <typename W, typename Input, typename Store, typename Done>
__device__ __forceinline__ void tc_gate_up_resident(const W (&w)[2], const int* __restrict__ n_active,
                                                    const int* __restrict__ act_expert,
                                                    const int* __restrict__ act_count,
                                                    const int* __restrict__ act_pairs,
                                                    int out_rows, int in_dim, int ksplit,
                                                    int per_expert, Input input, Store store,
                                                    Done done) {
    constexpr int M = 2, STEP = 4 * W::SPAN, XV = W::PER_VEC / 8;
    int task = blockIdx.x;
    // The first task's plan entries go out with the count of active experts, not after it (the
    // grid is at most as long as the plan's block tasks: entry task / per_expert exists).
    const int tasks = ld_volatile_s32(n_active) * per_expert;
    TcTask cur = tc_task(task, per_expert, ksplit, out_rows, act_expert, act_count, act_pairs);
    if (task >= tasks) return;  // the whole block
    extern __shared__ __align__(128) unsigned char moe_dyn[];
    bf16_t* xs = reinterpret_cast<bf16_t*>(moe_dyn);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const TcSplit sp(ksplit, in_dim / W::PER_VEC);  // this warp's input range (any block)
    const int vbeg = sp.vbeg, vend = sp.vend;
    auto rows_of = [&](const TcTask& k, typename W::Row (&rl)[M], typename W::Row (&rh)[M]) {
        const size_t lo = (size_t)k.e * out_rows + k.row0 + g, hi = lo + 8;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            rl[m] = w[m].row(lo, in_dim, vbeg + t * W::SPAN);
            rh[m] = w[m].row(hi, in_dim, vbeg + t * W::SPAN);
        }
    };
    typename W::Vec wl[M][W::SPAN], wh[M][W::SPAN];
    typename W::Row rl[M], rh[M];
    rows_of(cur, rl, rh);
    if (cur.rows_in) tc_load_pass<W, M>(wl, wh, rl, rh);
    bool loaded = cur.rows_in;  // this task's first pass is in wl/wh
    // The input rows staged in xs (thread 0 writes the list; every thread reads it after the
    // block barrier that ends each task). The first task always stages.
    __shared__ const bf16_t* staged_rows[8];
    __shared__ int staged_nt;
    bool first = true;
    bool in[W::SPAN];
#pragma unroll
    for (int u = 0; u < W::SPAN; ++u) in[u] = true;
    for (;;) {
        const int next = task + gridDim.x;
        const bool has_next = next < tasks;
        TcTask nx = cur;
        if (has_next)
            nx = tc_task(next, per_expert, ksplit, out_rows, act_expert, act_count, act_pairs);
        const int nt = min(cur.nt, MOE_MAXT);
        // This task's input rows into xs, unless they are there already (every thread decides
        // the same: the plan and the list are the same for all).
        bool same = !first && nt == staged_nt;
        for (int j = 0; j < nt && same; ++j) same = staged_rows[j] == input(cur.pairs[j]);
        first = false;
        if (!same) {
            const int chunks = in_dim / 8;  // 16-byte copies per row
            for (int i = threadIdx.x; i < nt * chunks; i += MOE_TC_WARPS * 32) {
                const int j = i / chunks, kk = i - j * chunks;
                cp_async16(xs + (size_t)j * in_dim + kk * 8, input(cur.pairs[j]) + kk * 8);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int j = 0; j < nt; ++j) staged_rows[j] = input(cur.pairs[j]);
                staged_nt = nt;
            }
        }
        if (cur.rows_in && !loaded) tc_load_pass<W, M>(wl, wh, rl, rh);
        // The next task's first pass goes out during this task's last one, into the registers
        // that pass frees.
        const bool pre = has_next && nx.rows_in;
        float c[M][4] = {};
        if (cur.rows_in) {
            const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)min(g, nt - 1) * in_dim) +
                              (size_t)(vbeg + t * W::SPAN) * XV;
            const uint4* xv[W::SPAN];
            auto advance = [&]() {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    W::advance(rl[m], STEP);
                    W::advance(rh[m], STEP);
                }
            };
            // Every pass but the last loads the one after it (rl/rh one pass ahead).
            advance();
            int v0 = vbeg;
#pragma unroll 1
            for (; v0 + 2 * STEP <= vend; v0 += STEP) {
#pragma unroll
                for (int u = 0; u < W::SPAN; ++u) xv[u] = xp + u * XV;
                tc_pass_reload<W, M>(wl, wh, xv, in, c, rl, rh, true);
                advance();
                xp += STEP * XV;
            }
            // The last pass: rl/rh now the next task's first pass.
            rows_of(nx, rl, rh);
#pragma unroll
            for (int u = 0; u < W::SPAN; ++u) xv[u] = xp + u * XV;
            tc_pass_reload<W, M>(wl, wh, xv, in, c, rl, rh, pre);
        } else {
            rows_of(nx, rl, rh);
        }
        loaded = cur.rows_in && pre;
        tc_store_pass<M>(c, ksplit, sp.part, cur.rows_in, 0, nt, cur.row0, cur.pairs, store);
        done(cur.a);
        if (!has_next) return;
        task = next;
        cur = nx;
    }
}
