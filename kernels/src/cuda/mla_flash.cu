// MLA attention in absorbed form, flash-style over the paged f32 latent history of the whole-model
// forward (prefill and decode alike): no scores scratch, the history streamed once per block in
// tiles of FL_BN tokens, converted to bf16 in shared memory, both products on the tensor cores
// (mma.sync m16n8k16, f32 accumulation) and an online softmax in between.
//
//   s[t, h, j] = scale · (q_lat[t, h] · c_kv[j] + q_pe[t, h] · k_pe[j])   for j < vis[t]
//   lat[t, h, :] = Σ_j softmax_j(s) · c_kv[j]
//
// Items: a block serves FL_HB (row, head) items — `rpb` consecutive query rows × `hpb` heads
// (grid x over row groups, y over head groups) — so one history tile feeds every head of a row
// and, in prefill, several rows of one sequence. Rows of a group that belong to different
// sequences (their `first` page-list entries differ) are served in turn, one pass each; a row's
// causal bound is its own `vis`. Grid z splits each pass's history across blocks, `per_split`
// tiles each (a fixed count, so a row's result does not depend on the longest row of the call):
// with more than one split every block writes its normalised partial and base-2 log-sum-exp per
// item and mla_flash_combine merges them; with one split the block writes `lat` directly.
//
// Warps: 4 per 16-item tile (FL_MT tiles). For Q·Kᵀ warp (mt, w) computes tokens 8w..8w+7 of
// its 16 items; scores go through shared memory, where 8 threads per item run the softmax; for
// P·V warp (mt, w) owns latent dims w·RP/4 .. (w+1)·RP/4 of its items (RP = rank rounded up to
// 64, at most FL_MAX_RP).
//
// Widths are runtime values: DP = rank + rope rounded up to 32 (Q·Kᵀ's reduction), RP as above;
// shared rows are LD = max(DP, RP) + 8 bf16 wide (zeros past rank + rope).

#ifndef FL_MT
#define FL_MT 2
#endif
// Blocks of 32 items fit twice per SM (shared memory and registers), 64 once.
#define FL_MIN_BLOCKS (FL_MT <= 2 ? 2 : 1)
#define FL_HB (16 * FL_MT)
#define FL_THREADS (128 * FL_MT)
#define FL_BN 32
#define FL_SLD (FL_BN + 4)
#define FL_PLD (FL_BN + 8)
#define FL_MAX_RP 512
// n8 tiles of P·V a warp keeps at the widest latent (a quarter of FL_MAX_RP each).
#define FL_MAX_NT (FL_MAX_RP / 32)

static_assert(FL_THREADS / FL_HB == 8, "softmax maps 8 threads to an item");

// Shared memory: q [FL_HB][LD], kv [FL_BN][LD] (bf16), then the fixed-size part.
struct FlashTail {
    float s[FL_HB * FL_SLD];
    bf16_t p[FL_HB * FL_PLD];
    float m[FL_HB], l[FL_HB], alpha[FL_HB];
    int vis[FL_HB];
};

extern "C" __global__ void __launch_bounds__(FL_THREADS, FL_MIN_BLOCKS)
mla_flash(const float* __restrict__ qlat, const float* __restrict__ q, const float* base,
          const long long* __restrict__ pages, const int* __restrict__ first, int page_tokens,
          const int* __restrict__ vis, float* __restrict__ lat, float* __restrict__ o_part,
          float* __restrict__ lse_part, int rows, int H, int dn, int dr, int r, int hpb, int rpb,
          int per_split, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int W = r + dr;
    const int DP = (W + 31) / 32 * 32, RP = (r + 63) / 64 * 64;
    const int LD = max(DP, RP) + 8;
    bf16_t* sq = reinterpret_cast<bf16_t*>(smem_raw);
    bf16_t* skv = sq + FL_HB * LD;
    FlashTail& sm = *reinterpret_cast<FlashTail*>(skv + FL_BN * LD);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3, mt = warp >> 2, wq = warp & 3;
    const int split = blockIdx.z, splits = gridDim.z;
    const int t0 = blockIdx.x * rpb, t1 = min(rows, t0 + rpb);
    const int h0 = blockIdx.y * hpb;
    const int NT = RP / 32;  // n8 tiles of P·V per warp
    const float ninf = -__int_as_float(0x7f800000);

    // Items: i → row t0 + i / hpb, head h0 + i % hpb.
    auto item_row = [&](int i) { return t0 + i / hpb; };
    auto item_head = [&](int i) { return h0 + i % hpb; };
    auto item_live = [&](int i, int s0, int s1) {
        const int t = item_row(i), h = item_head(i);
        return i < rpb * hpb && t >= s0 && t < s1 && h < H;
    };

    for (int s0 = t0; s0 < t1;) {
        // This pass: the rows of the group that share row s0's sequence.
        int s1 = s0 + 1;
        while (s1 < t1 && first[s1] == first[s0]) ++s1;
        int kv_len = 0;
        for (int t = s0; t < s1; ++t) kv_len = max(kv_len, vis[t]);
        const int seg = first[s0];
        const int tiles = (kv_len + FL_BN - 1) / FL_BN;
        const int tile0 = (int)min((long long)tiles, (long long)split * per_split);
        const int tile1 = (int)min((long long)tiles, (long long)tile0 + per_split);

        __syncthreads();  // the previous pass is done with q and the tail
        for (int i = tid; i < FL_HB; i += FL_THREADS) {
            sm.vis[i] = item_live(i, s0, s1) ? vis[item_row(i)] : 0;
            sm.m[i] = ninf;
            sm.l[i] = 0.0f;
        }
        for (int idx = tid; idx < FL_HB * (LD / 2); idx += FL_THREADS) {
            const int i = idx / (LD / 2), c = 2 * (idx - i * (LD / 2));
            float v0 = 0.0f, v1 = 0.0f;
            if (item_live(i, s0, s1)) {
                const size_t th = (size_t)item_row(i) * H + item_head(i);
                // Columns [0, r) from q_lat, [r, r + dr) from q's rope part.
                const float* ql = qlat + th * r;
                const float* qp = q + th * (dn + dr) + dn;
                if (c < r) v0 = ql[c];
                else if (c < W) v0 = qp[c - r];
                if (c + 1 < r) v1 = ql[c + 1];
                else if (c + 1 < W) v1 = qp[c + 1 - r];
            }
            *reinterpret_cast<unsigned*>(sq + i * LD + c) = pack_bf16x2(v0, v1);
        }

        float o[FL_MAX_NT][4];
#pragma unroll
        for (int n = 0; n < FL_MAX_NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

        for (int tile = tile0; tile < tile1; ++tile) {
            const int j0 = tile * FL_BN;
            __syncthreads();  // the last tile's P·V is done with kv
            // Four columns per thread and step: one 16-byte load where the row allows it.
            for (int idx = tid; idx < FL_BN * (LD / 4); idx += FL_THREADS) {
                const int row = idx / (LD / 4), c = 4 * (idx - row * (LD / 4));
                const int j = j0 + row;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (j < kv_len && c < W) {
                    const float* src =
                        base + pages[seg + j / page_tokens] + (size_t)(j % page_tokens) * W + c;
                    if (c + 3 < W && (reinterpret_cast<size_t>(src) & 15) == 0) {
                        v = *reinterpret_cast<const float4*>(src);
                    } else {
                        v.x = src[0];
                        if (c + 1 < W) v.y = src[1];
                        if (c + 2 < W) v.z = src[2];
                        if (c + 3 < W) v.w = src[3];
                    }
                }
                *reinterpret_cast<uint2*>(skv + row * LD + c) =
                    make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
            }
            __syncthreads();

            // Scores: items mt·16.., tokens wq·8.. (one n8 tile), two chains over k.
            {
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int k0 = 0; k0 < DP; k0 += 32) {
                    unsigned a[4], b[2], a2[4], b2[2];
                    load_a_frag(a, sq, LD, mt * 16, k0);
                    load_b_frag(b, skv, LD, wq * 8, k0);
                    load_a_frag(a2, sq, LD, mt * 16, k0 + 16);
                    load_b_frag(b2, skv, LD, wq * 8, k0 + 16);
                    mma_bf16_16816(acc, a, b);
                    mma_bf16_16816(acc2, a2, b2);
                }
                const int col = wq * 8 + 2 * t4, j = j0 + col;
                const int i0 = mt * 16 + g, i1 = i0 + 8;
                const int v0 = sm.vis[i0], v1 = sm.vis[i1];
                float* r0 = sm.s + i0 * FL_SLD + col;
                float* r1 = sm.s + i1 * FL_SLD + col;
                r0[0] = j < v0 ? (acc[0] + acc2[0]) * scale_log2 : ninf;
                r0[1] = j + 1 < v0 ? (acc[1] + acc2[1]) * scale_log2 : ninf;
                r1[0] = j < v1 ? (acc[2] + acc2[2]) * scale_log2 : ninf;
                r1[1] = j + 1 < v1 ? (acc[3] + acc2[3]) * scale_log2 : ninf;
            }
            __syncthreads();

            // Online softmax (base 2): 8 threads per item, 4 scores each.
            {
                const int i = tid >> 3, part = tid & 7;
                const float* sr = sm.s + i * FL_SLD + part * 4;
                float v[4], mx = ninf;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    v[k] = sr[k];
                    mx = fmaxf(mx, v[k]);
                }
                mx = max_over_8_lanes(mx);
                const float m_old = sm.m[i], m_new = fmaxf(m_old, mx);
                const float at = m_new == ninf ? 0.0f : m_new;
                const float p0 = exp2f(v[0] - at), p1 = exp2f(v[1] - at);
                const float p2 = exp2f(v[2] - at), p3 = exp2f(v[3] - at);
                *reinterpret_cast<uint2*>(sm.p + i * FL_PLD + part * 4) =
                    make_uint2(pack_bf16x2(p0, p1), pack_bf16x2(p2, p3));
                const float sum = sum_over_8_lanes((p0 + p1) + (p2 + p3));
                __syncwarp();
                if (part == 0) online_softmax_fold(sm.m, sm.l, sm.alpha, i, m_old, m_new, at, sum);
            }
            __syncthreads();

            // o = alpha · o + P · V over this warp's latent dims.
            {
                scale_acc_rows(o, sm.alpha[mt * 16 + g], sm.alpha[mt * 16 + g + 8]);
                const int mi = lane >> 3, mr = lane & 7;
                const int d0 = wq * (RP / 4);
#pragma unroll
                for (int k0 = 0; k0 < FL_BN; k0 += 16) {
                    unsigned a[4];
                    load_a_frag(a, sm.p, FL_PLD, mt * 16, k0);
                    const bf16_t* vrow = skv + (k0 + (mi & 1) * 8 + mr) * LD + d0 + (mi >> 1) * 8;
#pragma unroll
                    for (int n = 0; n < FL_MAX_NT; n += 2) {
                        if (n < NT) {
                            unsigned bb[4];
                            ldmatrix_x4_trans(bb, vrow + n * 8);
                            mma_bf16_16816(o[n], a, bb);
                            mma_bf16_16816(o[n + 1], a, bb + 2);
                        }
                    }
                }
            }
        }
        __syncthreads();  // the tail's m and l are final

        // This pass's normalised output (and log-sum-exp when the history is split).
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = mt * 16 + g + 8 * half;
            if (!item_live(i, s0, s1)) continue;
            const size_t th = (size_t)item_row(i) * H + item_head(i);
            const float l = sm.l[i], inv = l > 0.0f ? 1.0f / l : 0.0f;
            float* dst = splits == 1 ? lat + th * r : o_part + ((size_t)split * rows * H + th) * r;
            const int d0 = wq * (RP / 4) + 2 * t4;
#pragma unroll
            for (int n = 0; n < FL_MAX_NT; ++n) {
                const int c = d0 + n * 8;
                if (n < NT && c < r) dst[c] = o[n][2 * half] * inv;
                if (n < NT && c + 1 < r) dst[c + 1] = o[n][2 * half + 1] * inv;
            }
            if (splits > 1 && t4 == 0 && wq == 0)
                lse_part[(size_t)split * rows * H + th] = l > 0.0f ? sm.m[i] + __log2f(l) : ninf;
        }
        s0 = s1;
    }
}

// lat[t, h, :] = Σ_z w_z · o_part[z, t, h, :], w = softmax over the splits' log-sum-exps.
// One block per (row, head).
extern "C" __global__ void __launch_bounds__(128)
mla_flash_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                  float* __restrict__ lat, int rows, int H, int r, int splits) {
    const size_t th = blockIdx.x, stride = (size_t)rows * H;
    float mx = -__int_as_float(0x7f800000);
    for (int z = 0; z < splits; ++z) mx = fmaxf(mx, lse_part[z * stride + th]);
    float wsum = 0.0f;
    for (int z = 0; z < splits; ++z)
        if (mx != -__int_as_float(0x7f800000)) wsum += exp2f(lse_part[z * stride + th] - mx);
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    for (int c = threadIdx.x; c < r; c += 128) {
        float acc = 0.0f;
        for (int z = 0; z < splits; ++z) {
            const float w = mx == -__int_as_float(0x7f800000)
                                ? 0.0f
                                : exp2f(lse_part[z * stride + th] - mx);
            if (w != 0.0f) acc = fmaf(w, o_part[(z * stride + th) * r + c], acc);
        }
        lat[th * r + c] = acc * inv;
    }
}
