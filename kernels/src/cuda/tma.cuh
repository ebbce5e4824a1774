// The copy engine (Tensor Memory Accelerator, sm_90): tensor maps passed by value, shared-memory
// transaction barriers and tiled copies into shared memory. Everything here is defined only when
// compiling for sm_90 or newer with the inline-PTX helpers, as TESSERA_TMA (the map's type
// everywhere, so that kernel signatures stay the same).

// A CUtensorMap, passed by value to a kernel (`const __grid_constant__ TensorMap`).
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(TESSERA_PLAIN_HELPERS)
#define TESSERA_TMA 1

// The first 1024-byte aligned byte of dynamic shared memory at or after `raw`, where boxes in the
// 128-byte swizzle may land (the host allocates 1 KiB of slack for it).
__device__ __forceinline__ unsigned char* align_1k(unsigned char* raw) {
    return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barriers just initialised visible to the copy engine and the other threads.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of copies completing on the barrier.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// The 2-D box at (x, y) (innermost first, in elements) of the tensor map into shared memory at
// dst, completing on `bar`.
__device__ __forceinline__ void tensor_box_g2s(unsigned dst, const void* map, int x, int y,
                                               unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// The same box into the shared memory of every block of the cluster named in `mask`, at the same
// offset, completing on each one's barrier at `bar`'s offset.
__device__ __forceinline__ void tensor_box_g2s_multicast(unsigned dst, const void* map, int x,
                                                         int y, unsigned bar,
                                                         unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
        "cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
        : "memory");
}
// An arrival on the barrier at `bar`'s offset in the shared memory of block `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_in(unsigned bar, unsigned rank) {
    asm volatile(
        "{ .reg .b32 r; mapa.shared::cluster.u32 r, %0, %1; "
        "mbarrier.arrive.shared::cluster.b64 _, [r]; }" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// A barrier of every thread of every block of the cluster.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// The same for a 3-D box at (x, y, z).
__device__ __forceinline__ void tensor_box3_g2s(unsigned dst, const void* map, int x, int y, int z,
                                                unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
        "{%2, %3, %4}], [%5];" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}
// `bytes` (a multiple of 16) contiguous bytes from global src into shared memory at dst,
// completing on `bar`.
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes,
                                         unsigned bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
#endif
