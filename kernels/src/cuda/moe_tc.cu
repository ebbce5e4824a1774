// MoE expert projections on the tensor cores (the default path of `moe.cu`'s decode; compiled
// after it, as one translation unit: it uses that file's weight formats, SiTU and plan arguments).
// ---------------------------------------------------------------------------------------------
// Expert projections on the tensor cores (m16n8k16, f32 accumulators): a warp owns 16 output
// rows of one expert and up to 8 of its tokens per pass. Lane (g, t) = (lane/4, lane%4) loads
// 16-byte vectors t, t+4, t+8, ... of rows g and g+8 and decodes each into bf16 pairs in input
// order; k-step s of a vector takes its pairs 2s and 2s+1 as the A fragment's columns 2t.. and
// 2t+8.. The product sums over every input whatever the order, so the B fragment (token g's
// inputs) takes the same pairs of the same vector: both are plain 32-bit words, no shuffles.
// Weights stream once per 8 tokens of an expert; the decode of MXFP4 codes (and not the
// multiply-adds) is what the CUDA cores still do.

#ifndef MOE_TC_WARPS
#define MOE_TC_WARPS 4
#endif
// Consecutive 16-byte vectors of a row one lane loads per pass, per format (MXFP4 vectors carry
// 4x the inputs and take their registers again once decoded).
#ifndef MOE_TC_SPAN_BF16
#define MOE_TC_SPAN_BF16 4
#endif
#ifndef MOE_TC_SPAN_MXFP4
#define MOE_TC_SPAN_MXFP4 2
#endif
// Row tiles of 16 a warp of the down projection takes at once, per format (1 or 2; the host
// passes its own choice, `DOWN_TILES` in moe.rs). Two tiles are the down projection's weights
// as two matrices sharing the inputs, the gate/up kernel's bytes in flight and registers: with
// one, a down warp has half of gate/up's bytes on their way.
#ifndef MOE_TC_DOWN_TILES_BF16
#define MOE_TC_DOWN_TILES_BF16 1
#endif
#ifndef MOE_TC_DOWN_TILES_MXFP4
#define MOE_TC_DOWN_TILES_MXFP4 2
#endif
// L1 policy (see ld_hinted) of the weight loads, MXFP4 codes and bf16, and whether the input
// loads are evicted last (MOE_TC_X_HINT 1). The weights stream through once while every warp of
// the token group reads the inputs again: MXFP4 codes evicted first leave the inputs in L1 (the
// warps' waits for their inputs were half of the MXFP4 pass's stalls).
#ifndef MOE_TC_CODE_HINT
#define MOE_TC_CODE_HINT 2
#endif
#ifndef MOE_TC_BF16_HINT
#define MOE_TC_BF16_HINT 0
#endif
#ifndef MOE_TC_X_HINT
#define MOE_TC_X_HINT 0
#endif
// Bytes L2 fetches around each weight load on a miss (0: its default; 64, 128 or 256: the
// load's `.L2::64B` / `.L2::128B` / `.L2::256B`). 128 (a row's whole pass of MXFP4 codes) timed
// the same as the default; 256 (the next pass along) lost 3-7%.
#ifndef MOE_TC_L2_FETCH
#define MOE_TC_L2_FETCH 0
#endif
#if MOE_TC_L2_FETCH == 256
#define MOE_L2_FETCH ".L2::256B"
#elif MOE_TC_L2_FETCH == 128
#define MOE_L2_FETCH ".L2::128B"
#elif MOE_TC_L2_FETCH == 64
#define MOE_L2_FETCH ".L2::64B"
#else
#define MOE_L2_FETCH ""
#endif
// Passes ahead of its loads whose weight lines a warp asks L2 for (0: none): those bytes are
// then on their way with no register or shared memory holding them. Measured slower at every
// depth (1 pass: MXFP4 45% of the floor at batch 1 against 50%): the requests only queue.
#ifndef MOE_TC_PF_PASSES
#define MOE_TC_PF_PASSES 0
#endif
// Gate/up, down and the combine as dependent launches (sm_90, see grid_dep_wait; the host reads
// this setting too): each kernel's blocks may start while the one before still runs and wait
// for it before they read its output — the down kernel's blocks in the slots gate/up's last
// wave frees; the launch gaps between the kernels go. Asking L2 for the first bytes of each
// weight row while waiting was slower (the same bytes requested twice by every later wave's
// warps).
#ifndef MOE_TC_DEPENDENT
#define MOE_TC_DEPENDENT 1
#endif
// 1: when the host passes counts (`ready`, not null), a down warp waits only for its own
// expert's gate/up blocks (each block adds one once its h rows are stored; the combine sets the
// counts back to zero) instead of for the whole gate/up kernel; it still waits for that kernel
// before it exits, so that the kernels after it find gate/up done. The host passes them where
// they were measured faster (see `fine_waits` in moe.rs): each gate/up block's fence before its
// count delays the next block in its slot.
#ifndef MOE_TC_FINE
#define MOE_TC_FINE 1
#endif

// Timing probes, for `cuda_model_ops_check --moe-profile` only (their outputs are wrong by
// design): 1 the down kernel skips its products, 2 the gate/up kernel skips its products (its
// counts still rise), 3 down warps start without waiting for their expert's gate/up blocks, 4
// the combine (moe.cu) skips its sums.
#ifndef MOE_TC_PROBE
#define MOE_TC_PROBE 0
#endif

// 1: a dependent projection's warp loads its first pass of weights (which the kernel before
// does not write) before it waits for its inputs, so that those bytes arrive during the wait;
// 0: it waits first.
#ifndef MOE_TC_LOAD_FIRST
#define MOE_TC_LOAD_FIRST 1
#endif

// 1: a projection block of MXFP4 experts reads its expert's plan entries (expert, token count)
// together with the count of active experts instead of after it, so that its first weights wait
// one L2 round trip less (every entry up to the grid's height exists: the grid is as tall as the
// plan). Off for bf16 experts, whose kernels spilled with it.
#ifndef MOE_TC_PLAN_EARLY
#define MOE_TC_PLAN_EARLY 0
#endif

// A 32-bit load that neither the compiler nor ptxas moves past a branch (volatile: ptxas sank the
// plain loads below the branch that needs only the first of them).
__device__ __forceinline__ int ld_volatile_s32(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Waits (one lane of the warp, then the warp) until *count reaches target; what was stored
// before the count was raised is then visible to the warp.
__device__ __forceinline__ void wait_count(const unsigned* count, unsigned target) {
    if ((threadIdx.x & 31) == 0) {
        for (;;) {
            unsigned v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
            if (v >= target) break;
            __nanosleep(128);
        }
    }
    __syncwarp();
}
// A read-only 16-byte load with an L1 policy: 0 the default (`__ldg`), 1 no allocation in L1,
// 2 evicted first, 3 evicted last (each with MOE_TC_L2_FETCH).
__device__ __forceinline__ uint4 ld_hinted(const uint4* p, int hint) {
    uint4 v;
    switch (hint) {
    case 1:
        asm("ld.global.nc.L1::no_allocate" MOE_L2_FETCH ".v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        break;
    case 2:
        asm("ld.global.nc.L1::evict_first" MOE_L2_FETCH ".v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        break;
    case 3:
        asm("ld.global.nc.L1::evict_last" MOE_L2_FETCH ".v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        break;
    default:
#if MOE_TC_L2_FETCH
        asm("ld.global.nc" MOE_L2_FETCH ".v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
        v = __ldg(p);
#endif
    }
    return v;
}
// Blocks per SM the register budget must allow.
#ifndef MOE_TC_MIN_BLOCKS
#define MOE_TC_MIN_BLOCKS 4
#endif

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// A format of the tensor-core path: `row` makes a lane's cursor at a vector of a weight row,
// `load` reads the vector i places past it, `decode` turns a vector into REGS bf16 pairs in the
// order `arrange_x` puts the inputs (`wide`: some block of the warp's pass has a scale past the
// single-factor range, see Mxfp4Tc).
struct Bf16Tc {
    static constexpr int SPAN = MOE_TC_SPAN_BF16;
    static constexpr int DOWN_TILES = MOE_TC_DOWN_TILES_BF16;
    static constexpr int PER_VEC = 8;  // inputs per 16-byte vector
    static constexpr int REGS = 4;     // bf16 pairs a vector decodes into
    static constexpr bool SCALED = false;
    struct Vec {
        uint4 w;
    };
    struct Row {
        const uint4* p;
    };
    const uint4* rows;
    __device__ __forceinline__ Row row(size_t r, int in_dim, int v) const {
        return Row{rows + r * (in_dim / PER_VEC) + v};
    }
    // The same weights from row n on.
    __device__ __forceinline__ Bf16Tc from_row(int n, int in_dim) const {
        return Bf16Tc{rows + (size_t)n * (in_dim / PER_VEC)};
    }
    __device__ __forceinline__ static Vec load(const Row& r, int i) {
        return Vec{ld_hinted(r.p + i, MOE_TC_BF16_HINT)};
    }
    __device__ __forceinline__ static void advance(Row& r, int n) { r.p += n; }
    __device__ __forceinline__ static unsigned wide_bits(const Vec&) { return 0u; }
    __device__ __forceinline__ static void decode(const Vec& vec, unsigned out[REGS], bool) {
        out[0] = vec.w.x;
        out[1] = vec.w.y;
        out[2] = vec.w.z;
        out[3] = vec.w.w;
    }
    __device__ __forceinline__ static void arrange_x(unsigned[REGS]) {}
};

// Eight inputs (four bf16x2 words, in order) paired as `mxfp4_pairs` pairs the codes (k, k + 4).
__device__ __forceinline__ void spread_x(unsigned x[4]) {
    const unsigned x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    x[0] = prmt(x0, x2, 0x5410u);
    x[1] = prmt(x0, x2, 0x7632u);
    x[2] = prmt(x1, x3, 0x5410u);
    x[3] = prmt(x1, x3, 0x7632u);
}

struct Mxfp4Tc {
    static constexpr int SPAN = MOE_TC_SPAN_MXFP4;
    static constexpr int DOWN_TILES = MOE_TC_DOWN_TILES_MXFP4;
    static constexpr int PER_VEC = 32;  // one scale group
    static constexpr int REGS = 16;
    static constexpr bool SCALED = true;
    struct Vec {
        uint4 w;
        unsigned scale;  // the block's E8M0 exponent s
    };
    struct Row {
        const uint4* p;
        const unsigned char* s;
    };
    const uint4* rows;
    const unsigned char* scales;
    __device__ __forceinline__ Row row(size_t r, int in_dim, int v) const {
        const size_t at = r * (in_dim / PER_VEC) + v;
        return Row{rows + at, scales + at};
    }
    __device__ __forceinline__ Mxfp4Tc from_row(int n, int in_dim) const {
        const size_t at = (size_t)n * (in_dim / PER_VEC);
        return Mxfp4Tc{rows + at, scales + at};
    }
    __device__ __forceinline__ static Vec load(const Row& r, int i) {
        return Vec{ld_hinted(r.p + i, MOE_TC_CODE_HINT), __ldg(r.s + i)};
    }
    __device__ __forceinline__ static void advance(Row& r, int n) {
        r.p += n;
        r.s += n;
    }
    // Bit 8 is set when s >= 129 (s + 127 < 512 always).
    __device__ __forceinline__ static unsigned wide_bits(const Vec& v) { return v.scale + 127u; }
    __device__ __forceinline__ static void decode(const Vec& vec, unsigned out[REGS], bool wide) {
        // Codes decode to 2^-126 of their values, so the factor is 2^(s-1): one bf16 pair
        // (s + 126) << 7 up to s = 128 (one multiply-add), beyond that 2^127 · 2^(s-128) (255
        // is NaN) — taken only when some lane of the warp needs it.
        mxfp4_pairs(vec.w.x, out);
        mxfp4_pairs(vec.w.y, out + 4);
        mxfp4_pairs(vec.w.z, out + 8);
        mxfp4_pairs(vec.w.w, out + 12);
        const unsigned s = vec.scale;
        if (!wide) {
            const unsigned f = s * 0x00800080u + 126u * 0x00800080u;
#pragma unroll
            for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], f);
            return;
        }
        const unsigned b = (min(s, 128u) + 126u) * 0x00800080u;
        const unsigned b2 = s <= 128 ? 0u : (s == 255 ? 0x7fc07fc0u : (s - 1u) * 0x00800080u);
#pragma unroll
        for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], b);
        if (b2) {
#pragma unroll
            for (int i = 0; i < REGS; ++i) out[i] = bf16x2_mul(out[i], b2);
        }
    }
    // The inputs of one vector in the order `decode` pairs the codes.
    __device__ __forceinline__ static void arrange_x(unsigned x[REGS]) {
#pragma unroll
        for (int i = 0; i < REGS; i += 4) spread_x(x + i);
    }
};

// Whether a warp loads each MXFP4 weight vector of its next pass as soon as it has decoded the
// vector that held those registers in this pass (the next pass's bytes are then in flight while
// this one's decode and products run, in no more registers), or only when the pass is over (as
// bf16 weights always are: their passes are short of instructions, not of bytes in flight).
#ifndef MOE_TC_ROLL
#define MOE_TC_ROLL 1
#endif

struct NoReload {
    __device__ __forceinline__ void operator()(int, int) const {}
};
struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};

// One pass's products: c[m] += (vectors wl/wh of rows lo/hi) · (the inputs at xv[u]), u < SPAN;
// an input vector that is not `in` is zero (only the last pass of a range has such). `reload(m,
// u)` runs once the vectors wl/wh[m][u] are decoded and may refill them.
template <typename W, int M, bool FULL, typename Reload = NoReload>
__device__ __forceinline__ void tc_mma_pass(typename W::Vec (&wl)[M][W::SPAN],
                                            typename W::Vec (&wh)[M][W::SPAN],
                                            const uint4* const (&xv)[W::SPAN],
                                            const bool (&in)[W::SPAN], float (&c)[M][4],
                                            Reload reload = Reload()) {
    bool wide = false;
    if (W::SCALED) {
        unsigned bits = 0u;
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int u = 0; u < W::SPAN; ++u) bits |= W::wide_bits(wl[m][u]) | W::wide_bits(wh[m][u]);
        wide = __any_sync(0xffffffffu, bits & 0x100u);
    }
#pragma unroll
    for (int u = 0; u < W::SPAN; ++u) {
        unsigned xb[W::REGS];
#pragma unroll
        for (int i = 0; i < W::REGS / 4; ++i) {
            uint4 q = MOE_TC_X_HINT ? ld_hinted(xv[u] + i, 3) : xv[u][i];
            if (!FULL && !in[u]) q = make_uint4(0, 0, 0, 0);
            xb[4 * i] = q.x;
            xb[4 * i + 1] = q.y;
            xb[4 * i + 2] = q.z;
            xb[4 * i + 3] = q.w;
        }
        W::arrange_x(xb);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            unsigned al[W::REGS], ah[W::REGS];
            W::decode(wl[m][u], al, wide);
            W::decode(wh[m][u], ah, wide);
            reload(m, u);
#pragma unroll
            for (int s = 0; s < W::REGS / 2; ++s) {
                const unsigned a[4] = {al[2 * s], ah[2 * s], al[2 * s + 1], ah[2 * s + 1]};
                const unsigned b[2] = {xb[2 * s], xb[2 * s + 1]};
                mma_bf16_16816(c[m], a, b);
            }
        }
    }
}

// Loads the pass at cursors rl/rh (rows lo/hi of the M matrices) into wl/wh.
template <typename W, int M>
__device__ __forceinline__ void tc_load_pass(typename W::Vec (&wl)[M][W::SPAN],
                                             typename W::Vec (&wh)[M][W::SPAN],
                                             const typename W::Row (&rl)[M],
                                             const typename W::Row (&rh)[M]) {
#pragma unroll
    for (int u = 0; u < W::SPAN; ++u)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            wl[m][u] = W::load(rl[m], u);
            wh[m][u] = W::load(rh[m], u);
        }
}

// One whole pass's products, and (when `reload`) the pass at rl/rh loaded into the registers it
// frees: each MXFP4 vector as soon as it is decoded (MOE_TC_ROLL), bf16 once the pass is over.
template <typename W, int M>
__device__ __forceinline__ void tc_pass_reload(typename W::Vec (&wl)[M][W::SPAN],
                                               typename W::Vec (&wh)[M][W::SPAN],
                                               const uint4* const (&xv)[W::SPAN],
                                               const bool (&in)[W::SPAN], float (&c)[M][4],
                                               const typename W::Row (&rl)[M],
                                               const typename W::Row (&rh)[M], bool reload) {
    if constexpr (W::SCALED && MOE_TC_ROLL) {
        tc_mma_pass<W, M, true>(wl, wh, xv, in, c, [&](int m, int u) {
            if (reload) {
                wl[m][u] = W::load(rl[m], u);
                wh[m][u] = W::load(rh[m], u);
            }
        });
    } else {
        tc_mma_pass<W, M, true>(wl, wh, xv, in, c);
        if (reload) tc_load_pass<W, M>(wl, wh, rl, rh);
    }
}

// Asks L2 for the pass starting at vector v of the warp's rows lo/hi of the M matrices: a pass
// is 128-byte lines of 4 · W::SPAN vectors per row, which the 4 lanes of a row pair share.
template <typename W, int M>
__device__ __forceinline__ void tc_prefetch_pass(const W (&w)[M], size_t lo, size_t hi,
                                                 int in_dim, int v, int t) {
    constexpr int LINES = W::SPAN > 2 ? W::SPAN / 2 : 1, N = 2 * M * LINES;  // lines a row pass
#pragma unroll
    for (int j = 0; j < (N + 3) / 4; ++j) {
        const int i = t + 4 * j, m = i / (2 * LINES), line = i % LINES;
        const size_t r = (i / LINES) & 1 ? hi : lo;
#pragma unroll
        for (int mm = 0; mm < M; ++mm)
            if (i < N && m == mm) prefetch_l2(w[mm].row(r, in_dim, v).p + 8 * line);
    }
}

// c[m] += W_m[rows lo/hi] · x over input vectors [vbeg, vend), for M weight matrices sharing the
// inputs; `x_ready()` runs once the first pass's weights are on their way, before any input is
// read (it may run twice). Lane t takes W::SPAN consecutive vectors of each row per pass, so a
// row is read in runs of 4 · W::SPAN vectors (256 bytes at span 4) while the warp has 16 rows in
// flight. Whole passes walk cursors with no bounds; a last, partial pass clamps its loads and
// zeroes the inputs past the range (every lane runs every step: the matrix instructions take the
// whole warp).
template <typename W, int M, typename XReady = NoHook>
__device__ __forceinline__ void tc_rows(const W (&w)[M], size_t lo, size_t hi,
                                        const bf16_t* __restrict__ xt, int in_dim, int vbeg,
                                        int vend, int t, float (&c)[M][4],
                                        XReady x_ready = XReady()) {
    constexpr int STEP = 4 * W::SPAN, XV = W::PER_VEC / 8;  // uint4 of inputs per vector
    typename W::Vec wl[M][W::SPAN], wh[M][W::SPAN];
    const uint4* xv[W::SPAN];
    bool in[W::SPAN];
    int v0 = vbeg;
    if (v0 + STEP <= vend) {
        typename W::Row rl[M], rh[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            rl[m] = w[m].row(lo, in_dim, v0 + t * W::SPAN);
            rh[m] = w[m].row(hi, in_dim, v0 + t * W::SPAN);
        }
        const uint4* xp = reinterpret_cast<const uint4*>(xt) + (size_t)(v0 + t * W::SPAN) * XV;
        tc_load_pass<W, M>(wl, wh, rl, rh);
        x_ready();
        // Whole passes only: a pass past the range may be past the weights.
#pragma unroll
        for (int d = 1; d <= MOE_TC_PF_PASSES; ++d)
            if (v0 + (d + 1) * STEP <= vend)
                tc_prefetch_pass<W, M>(w, lo, hi, in_dim, v0 + d * STEP, t);
#pragma unroll
        for (int u = 0; u < W::SPAN; ++u) in[u] = true;
#pragma unroll 1
        for (;;) {
#pragma unroll
            for (int u = 0; u < W::SPAN; ++u) xv[u] = xp + u * XV;
            const bool more = v0 + 2 * STEP <= vend;
            if (MOE_TC_PF_PASSES > 0 && v0 + (MOE_TC_PF_PASSES + 2) * STEP <= vend)
                tc_prefetch_pass<W, M>(w, lo, hi, in_dim, v0 + (MOE_TC_PF_PASSES + 1) * STEP, t);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                W::advance(rl[m], STEP);
                W::advance(rh[m], STEP);
            }
            tc_pass_reload<W, M>(wl, wh, xv, in, c, rl, rh, more);
            xp += STEP * XV;
            v0 += STEP;
            if (!more) break;
        }
    }
    if (v0 < vend) {
#pragma unroll
        for (int u = 0; u < W::SPAN; ++u) {
            const int vu = v0 + t * W::SPAN + u, v = min(vu, vend - 1);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                wl[m][u] = W::load(w[m].row(lo, in_dim, v), 0);
                wh[m][u] = W::load(w[m].row(hi, in_dim, v), 0);
            }
            xv[u] = reinterpret_cast<const uint4*>(xt) + (size_t)v * XV;
            in[u] = vu < vend;
        }
        x_ready();
        tc_mma_pass<W, M, false>(wl, wh, xv, in, c);
    }
}

// A block's warps split over row tiles (of `tile_rows`) and input ranges: with `ksplit` parts,
// warp w takes row tile w / ksplit of the block and input part w % ksplit, and the parts' sums
// meet in shared memory. Few active experts (batch 1) make few row tiles, too few to fill every
// multiprocessor evenly: splitting the input multiplies the warps without changing the bytes.
// The first row of this warp's tile in block (task) bx of an expert.
__device__ __forceinline__ int tc_tile_row0(unsigned bx, int ksplit, int tile_rows) {
    const int warp = threadIdx.x >> 5;
    return (bx * (MOE_TC_WARPS / ksplit) + warp / ksplit) * tile_rows;
}
struct TcSplit {
    int part, tile_row0, vbeg, vend;
    __device__ __forceinline__ TcSplit(int ksplit, int vecs, int tile_rows = 16) {
        const int warp = threadIdx.x >> 5, per = (vecs + ksplit - 1) / ksplit;
        part = warp % ksplit;
        tile_row0 = tc_tile_row0(blockIdx.x, ksplit, tile_rows);
        vbeg = min(part * per, vecs);
        vend = min(vbeg + per, vecs);
    }
};

// Sums c over the ksplit warps of each row tile into the part-0 warp's c (a barrier before and
// after: every warp of the block calls it the same number of times).
template <int M>
__device__ __forceinline__ void tc_sum_parts(float (&c)[M][4], int ksplit, int part) {
    __shared__ float red[MOE_TC_WARPS][M][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][m][j][lane] = c[m][j];
    __syncthreads();
    if (part == 0) {
        for (int p = 1; p < ksplit; ++p)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j) c[m][j] += red[warp + p][m][j][lane];
    }
}

// The end of one pass of 8 tokens: the ksplit parts' sums meet in the part-0 warp, which
// stores element j of each of its rows for the pass's tokens present.
template <int M, typename Store>
__device__ __forceinline__ void tc_store_pass(float (&c)[M][4], int ksplit, int part,
                                              bool rows_in, int t0, int nt, int row0,
                                              const int* __restrict__ pairs, Store store) {
    if (ksplit > 1) tc_sum_parts<M>(c, ksplit, part);
    if (part != 0 || !rows_in) return;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int tok = t0 + 2 * t + (j & 1), row = row0 + g + 8 * (j >> 1);
        if (tok < nt) store(pairs[tok], row, c, j);
    }
}

// One projection of the active expert blockIdx.y on the tensor cores: this warp's `tile_rows` of
// its `out_rows` output rows (or its input part of them) over `in_dim` inputs, for the expert's
// tokens 8 at a time. `input(pair)` is a (token, slot) pair's input row; `store(pair, row, c, j)`
// writes element j of the sums c of the M matrices for that pair and row. The M matrices are
// either M projections of the same 16 rows (tile_rows 16) or M stacked tiles of 16 rows of one
// projection (tile_rows 16 M, matrix m the weights from row 16 m on). A `dependent` projection
// (the down kernel as a dependent launch) reads its inputs only once its expert's `ready` count
// reaches `ready_target` (with counts) or past grid_dep_wait (without); with MOE_TC_LOAD_FIRST
// its first pass of weights is already on its way then.
//
// With `stage` > 0 and an expert of at most `stage` tokens, the block copies its tokens' input
// rows into dynamic shared memory (`stage` rows of `in_dim`, by cp.async) and the passes read
// them there: the inputs, which every warp of the block reads again, then never queue in L1
// behind the streamed weights. The copies go out, and are waited for (a block barrier), once
// each warp's first pass of weights is on its way.
template <typename W, int M, bool DEPENDENT = false, typename Input, typename Store>
__device__ __forceinline__ void tc_project(const W (&w)[M], const int* __restrict__ n_active,
                                           const int* __restrict__ act_expert,
                                           const int* __restrict__ act_count,
                                           const int* __restrict__ act_pairs, int out_rows,
                                           int in_dim, int ksplit, int tile_rows, Input input,
                                           Store store, const unsigned* ready = nullptr,
                                           unsigned ready_target = 0, int stage = 0) {
    const int a = blockIdx.y;
    int e, count;
    if constexpr (MOE_TC_PLAN_EARLY && W::SCALED) {
        // Three independent loads issued before the branch (volatile: kept in this order).
        const int n = ld_volatile_s32(n_active);
        e = ld_volatile_s32(act_expert + a);
        count = ld_volatile_s32(act_count + a);
        if (a >= n) return;
    } else {
        if (a >= *n_active) return;
        e = act_expert[a];
        count = act_count[a];
    }
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const TcSplit sp(ksplit, in_dim / W::PER_VEC, tile_rows);
    const int row0 = sp.tile_row0;
    const bool rows_in = row0 < out_rows;
    const int nt = min(count, MOE_MAXT);
    const int* pairs = act_pairs + a * MOE_MAXT;
    const size_t lo = (size_t)e * out_rows + min(row0, out_rows - tile_rows) + g, hi = lo + 8;
    // What a dependent projection's inputs wait for. Blocks that returned above write nothing:
    // the combine waits only for those that do.
    auto wait_inputs = [&]() {
        if constexpr (DEPENDENT && MOE_TC_PROBE != 3) {
            if (MOE_TC_FINE && ready != nullptr)
                wait_count(ready + a, ready_target);
            else
                grid_dep_wait();
        }
    };
    // The wait runs once per warp: here, or (MOE_TC_LOAD_FIRST) once its first pass of weights
    // is on its way.
    bool waited = !MOE_TC_LOAD_FIRST;
    if (waited) wait_inputs();
    auto wait_once = [&]() {
        if (waited) return;
        waited = true;
        wait_inputs();
    };
    if (stage > 0 && nt <= min(stage, 8)) {  // one pass of 8 tokens
        extern __shared__ __align__(128) unsigned char moe_dyn[];
        bf16_t* xs = reinterpret_cast<bf16_t*>(moe_dyn);
        // Once per warp, whatever path its rows take (the barrier counts every warp).
        bool staged = false;
        auto x_ready = [&]() {
            if (staged) return;
            staged = true;
            wait_once();
            const int chunks = in_dim / 8;  // 16-byte copies per row
            for (int i = threadIdx.x; i < nt * chunks; i += MOE_TC_WARPS * 32) {
                const int j = i / chunks, k = i - j * chunks;
                cp_async16(xs + (size_t)j * in_dim + k * 8, input(pairs[j]) + k * 8);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
        };
        float c[M][4] = {};
        if (rows_in)
            tc_rows<W, M>(w, lo, hi, xs + (size_t)min(g, nt - 1) * in_dim, in_dim, sp.vbeg,
                          sp.vend, t, c, x_ready);
        x_ready();
        tc_store_pass<M>(c, ksplit, sp.part, rows_in, 0, nt, row0, pairs, store);
        return;
    }
    if (ksplit == 1 && !rows_in) return;
    for (int t0 = 0; t0 < nt; t0 += 8) {
        // Token g of this pass (a missing one reads a present token's inputs: its column of
        // the product is never written).
        const bf16_t* xt = input(pairs[min(t0 + g, nt - 1)]);
        float c[M][4] = {};
        if (rows_in) tc_rows<W, M>(w, lo, hi, xt, in_dim, sp.vbeg, sp.vend, t, c, wait_once);
        tc_store_pass<M>(c, ksplit, sp.part, rows_in, t0, nt, row0, pairs, store);
    }
}
