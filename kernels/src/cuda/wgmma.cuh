// Warpgroup MMA (wgmma, sm_90a) helpers shared by the Hopper kernels: shared-memory matrix
// descriptors in the no-swizzle core-matrix layout (and in the copy engine's 128-byte swizzle),
// the fence/commit/wait protocol, and the
// byte offset of an element in that layout. A core matrix is 8 rows × 16 bytes (128 bytes,
// contiguous); the core matrices of a row group lie next to each other along K.
#define TESSERA_WGMMA 1

// A shared-memory matrix descriptor without swizzling: the leading byte offset is the step
// between core matrices along K, the stride byte offset the step along M or N (for the K-major
// operands and for the N-major V alike).
__device__ __forceinline__ unsigned long long wg_desc_at(unsigned a, unsigned along_k,
                                                         unsigned along_mn) {
    const unsigned lbo = along_k, sbo = along_mn;
    return (unsigned long long)((a & 0x3ffffu) >> 4) |
           ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32);
}
__device__ __forceinline__ unsigned long long wg_desc(const void* p, unsigned along_k,
                                                      unsigned along_mn) {
    return wg_desc_at(smem_addr(p), along_k, along_mn);
}
// A descriptor of an operand in the copy engine's 128-byte swizzle (rows of 128 bytes, 8-row
// atoms 1024 bytes apart; the atom must start 1024-byte aligned): the leading byte offset is the
// step between 64-element chunks along M or N, used by M- or N-major reads (K-major reads keep a
// K step of 16 elements within a row and ignore it).
__device__ __forceinline__ unsigned long long wg_desc_sw128_at(unsigned a, unsigned chunk) {
    return (unsigned long long)((a & 0x3ffffu) >> 4) | ((unsigned long long)(chunk >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Byte offset of element (row, col) of a core-matrix tiled operand with `group` bytes per row
// group.
__device__ __forceinline__ unsigned cm_off(int row, int col, unsigned group) {
    return (row >> 3) * group + (col >> 3) * 128 + (row & 7) * 16 + (col & 7) * 2;
}

__device__ __forceinline__ void wg_wait1() {
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
}

// d (64x32 f32) = (acc ? d : 0) + A B with A (64x16) and B (16x32) from shared memory: B K-major,
// A K-major (TA = 0) or M-major (TA = 1).
template <int TA = 0>
__device__ __forceinline__ void wgmma_n32(float d[16], unsigned long long a, unsigned long long b,
                                          int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(acc), "n"(TA));
}

// The 32 f32 accumulators of an m64n64 product as read-write asm operands %0..%31.
#define WG_ACC32(d)                                                                                \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),           \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),   \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),             \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),             \
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64x64 f32) = (acc ? d : 0) + A B with A (64x16) and B (16x64) from shared memory, both
// K-major.
__device__ __forceinline__ void wgmma_n64(float d[32], unsigned long long a, unsigned long long b,
                                          int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,"
        "%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32(d)
        : "l"(a), "l"(b), "r"(acc));
}

// d (64x64 f32) = (acc ? d : 0) + A B with A (64x16 bf16) from registers, in the accumulator
// layout's pairs (a[0]: rows g, columns 2t..2t+1; a[1]: rows g + 8; a[2], a[3]: the same 8
// columns on), and B (16x64) from shared memory, K-major (TB = 0) or N-major (TB = 1).
template <int TB = 0>
__device__ __forceinline__ void wgmma_rs_n64(float d[32], const unsigned a[4],
                                             unsigned long long b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,"
        "%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : WG_ACC32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TB));
}

// d (64xN f32, N = 16, 32 or 48) = (acc ? d : 0) + A B with A (64x16) and B (16xN) from shared
// memory: A K-major (TA = 0) or M-major (TA = 1), B K-major (TB = 0) or N-major (TB = 1).
template <int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a,
                                         unsigned long long b, int acc) {
    static_assert(N == 16 || N == 32 || N == 48, "n16, n32 or n48");
    if constexpr (N == 16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7}, "
            "%8, %9, p, 1, 1, %11, %12;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
              "+f"(d[7])
            : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB));
    }
    if constexpr (N == 32) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
            "%16, %17, p, 1, 1, %19, %20;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
              "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
              "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
            : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB));
    }
    if constexpr (N == 48) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
            "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,"
            "%22,%23}, "
            "%24, %25, p, 1, 1, %27, %28;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
              "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
              "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
              "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
            : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB));
    }
}

// Keeps the compiler from moving reads or writes of an in-flight accumulator across the wgmma
// wait before it (the wait orders the hardware, this orders the code).
template <int N>
__device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for packed left operands: keeps work on them before the wait that follows.
template <int N>
__device__ __forceinline__ void wg_hold(unsigned (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}
