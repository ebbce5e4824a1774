// Portability layer of the Tessera GPU kernels. The same sources (common.cuh, kda.cu) compile
// with NVRTC for NVIDIA GPUs and with hiprtc for AMD GPUs; this header comes first in both.
//
// Two widths are kept apart:
//   WARP_SIZE — the hardware warp: 32 on NVIDIA, the wavefront size on AMD (64 on CDNA).
//   LANES     — the lanes of one logical warp, the unit the kernels map threads onto and the
//               extent of every cross-lane operation (shuffles, the m16n8k16 fragments). It is 32
//               on both, so on CDNA one wavefront runs two logical warps; cross-lane operations
//               are confined to their 32-lane half (shuffle width LANES), which is exact because
//               each logical warp takes warp-uniform branches, as mma.sync requires on NVIDIA.
// LANE_BITS and LANE_MASK are log2(LANES) and LANES - 1, spelled out so that NVRTC sees the same
// expressions as before this header existed.

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#define TESSERA_HIP 1
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define WARP_SIZE 64
#endif
#else
#define WARP_SIZE 32
#endif

// TESSERA_PLAIN_HELPERS selects the helpers of common.cuh written without inline PTX: always on
// HIP; on CUDA only when asked for (-DTESSERA_PLAIN_HELPERS=1), which runs the HIP code paths on
// an NVIDIA GPU for checking.
#if defined(TESSERA_HIP) && !defined(TESSERA_PLAIN_HELPERS)
#define TESSERA_PLAIN_HELPERS 1
#endif

// Shuffles within a logical warp (source lane and mask relative to its first lane).
#ifdef TESSERA_HIP
#define LANE_SHFL(v, src) __shfl((v), (src), LANES)
#define LANE_SHFL_XOR(v, mask) __shfl_xor((v), (mask), LANES)
#else
#define LANE_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src), LANES)
#define LANE_SHFL_XOR(v, mask) __shfl_xor_sync(0xffffffffu, (v), (mask), LANES)
#endif

// Orders one logical warp's shared-memory writes before its reads. HIP has no portable warp
// barrier, so there it is a block barrier: callers must reach it with every thread of the block.
#ifdef TESSERA_HIP
#define LANE_SYNC() __syncthreads()
#else
#define LANE_SYNC() __syncwarp()
#endif

#define LANES 32
#define LANE_BITS 5
#define LANE_MASK 31

static_assert(LANES == (1 << LANE_BITS) && LANE_MASK == LANES - 1, "lane constants disagree");
static_assert(WARP_SIZE % LANES == 0, "a logical warp must not straddle hardware warps");
