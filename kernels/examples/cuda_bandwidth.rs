//! What the memory system of this GPU gives a kernel that only moves bytes, as the ceiling the
//! bandwidth-bound kernels are measured against: an in-place read-modify-write of the bytes of
//! the KDA decode step's state (B=256, H=32, 128×128 f32: 512 MiB read and written) from
//! registers and, on sm_90, by bulk copies through shared memory, a copy, the driver's
//! device-to-device copy, and read-only passes over the bytes of the MoE expert pass
//! at batch 1 (K3 shapes, MXFP4: 16 experts), in one launch and as the pass's two launches.
//!
//!   cargo build --release -p tessera-kernels --features cuda --example cuda_bandwidth
//!   target/release/examples/cuda_bandwidth
//!
//! Output: `time <name> bytes=<moved> us=<median> TBps=<achieved> pct_4800=<% of 4.8 TB/s>`.

#[path = "common/mod.rs"]
mod common;

use common::{time_us, HBM_BYTES_PER_S};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tessera_kernels::cuda::{default_cache_dir, CudaDevice, CudaError, CudaSlice};

const SOURCE: &str = r#"
// Each thread moves U float4 of one block-contiguous span: float4 i*T + t of the block's
// U*T, loaded all before any is stored (as the decode step holds its state in registers).
template <int U>
__device__ __forceinline__ void rmw_body(float4* __restrict__ p, float a) {
    float4* q = p + (size_t)blockIdx.x * U * blockDim.x + threadIdx.x;
    float4 r[U];
#pragma unroll
    for (int i = 0; i < U; ++i) r[i] = q[i * blockDim.x];
#pragma unroll
    for (int i = 0; i < U; ++i) {
        r[i].x *= a; r[i].y *= a; r[i].z *= a; r[i].w *= a;
        q[i * blockDim.x] = r[i];
    }
}
extern "C" __global__ void rmw4(float4* p, float a) { rmw_body<4>(p, a); }
extern "C" __global__ void rmw8(float4* p, float a) { rmw_body<8>(p, a); }
extern "C" __global__ void rmw16(float4* p, float a) { rmw_body<16>(p, a); }

template <int U>
__device__ __forceinline__ void copy_body(const float4* __restrict__ s, float4* __restrict__ d) {
    const size_t at = (size_t)blockIdx.x * U * blockDim.x + threadIdx.x;
    float4 r[U];
#pragma unroll
    for (int i = 0; i < U; ++i) r[i] = s[at + i * blockDim.x];
#pragma unroll
    for (int i = 0; i < U; ++i) d[at + i * blockDim.x] = r[i];
}
extern "C" __global__ void copy4(const float4* s, float4* d) { copy_body<4>(s, d); }
extern "C" __global__ void copy16(const float4* s, float4* d) { copy_body<16>(s, d); }

// Read-only: each block sums its U*T uint4 into one word (written so the loads stay).
template <int U>
__device__ __forceinline__ void read_body(const uint4* __restrict__ s, unsigned* __restrict__ out) {
    const uint4* q = s + (size_t)blockIdx.x * U * blockDim.x + threadIdx.x;
    unsigned acc = 0u;
#pragma unroll
    for (int i = 0; i < U; ++i) {
        const uint4 v = __ldg(q + i * blockDim.x);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}
// In place through shared memory by the copy engine (sm_90): each block brings its TILE bytes in
// with one bulk copy, scales them there and writes them back with one bulk copy.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <int TILE>
__device__ __forceinline__ void rmw_bulk_body(float* __restrict__ p, float a) {
    extern __shared__ __align__(128) float tile[];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar);
    const unsigned stile = (unsigned)__cvta_generic_to_shared(tile);
    float* src = p + (size_t)blockIdx.x * (TILE / 4);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sbar), "r"(TILE) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(stile), "l"(src), "r"(TILE), "r"(sbar) : "memory");
    }
    __syncthreads();
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0; selp.u32 %0, 1, 0, q; }"
                     : "=r"(done) : "r"(sbar) : "memory");
    float4* t4 = reinterpret_cast<float4*>(tile);
    for (int i = threadIdx.x; i < TILE / 16; i += blockDim.x) {
        float4 r = t4[i];
        r.x *= a; r.y *= a; r.z *= a; r.w *= a;
        t4[i] = r;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(src), "r"(stile), "r"(TILE) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
}
extern "C" __global__ void rmw_bulk16k(float* p, float a) { rmw_bulk_body<16384>(p, a); }
extern "C" __global__ void rmw_bulk32k(float* p, float a) { rmw_bulk_body<32768>(p, a); }
extern "C" __global__ void rmw_bulk64k(float* p, float a) { rmw_bulk_body<65536>(p, a); }
#endif

extern "C" __global__ void read8(const uint4* s, unsigned* out) { read_body<8>(s, out); }
extern "C" __global__ void read16(const uint4* s, unsigned* out) { read_body<16>(s, out); }
"#;

fn report(name: &str, bytes: f64, us: f64) {
    let bps = bytes / (us * 1e-6);
    println!(
        "time {name} bytes={bytes:.0} us={us:.2} TBps={:.3} pct_4800={:.1}",
        bps / 1e12,
        100.0 * bps / HBM_BYTES_PER_S
    );
}

fn run() -> Result<(), CudaError> {
    let dev = CudaDevice::open(0, default_cache_dir())?;
    println!("device {} ({})", dev.name(), dev.arch());
    let module = dev.module("bandwidth_probe", SOURCE, &[])?;
    let stream = dev.stream().clone();

    // The KDA decode state at B=256, H=32, 128×128 f32.
    let state_floats = 256usize * 32 * 128 * 128;
    let mut state: CudaSlice<f32> = stream.alloc_zeros(state_floats)?;
    let mut other: CudaSlice<f32> = stream.alloc_zeros(state_floats)?;
    let moved = 2.0 * (state_floats * 4) as f64;
    let n4 = state_floats / 4;
    // Times one in-place kernel (p, a) over the whole state with `cfg`.
    let mut in_place = |f: &cudarc::driver::CudaFunction,
                        cfg: LaunchConfig,
                        label: String|
     -> Result<(), CudaError> {
        let a = 1.0f32;
        let us = time_us(&dev, 3, 20, || {
            // SAFETY: every caller's grid covers exactly the state's bytes.
            unsafe {
                stream
                    .launch_builder(f)
                    .arg(&mut state)
                    .arg(&a)
                    .launch(cfg)?
            };
            Ok(())
        })?;
        report(&label, moved, us);
        Ok(())
    };
    for (name, u) in [("rmw4", 4usize), ("rmw8", 8), ("rmw16", 16)] {
        let f = module.load_function(name)?;
        for threads in [128usize, 256, 512] {
            let cfg = LaunchConfig {
                grid_dim: ((n4 / (u * threads)) as u32, 1, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            in_place(
                &f,
                cfg,
                format!("{name}_t{threads} (in-place, state of B=256)"),
            )?;
        }
    }
    if dev.is_sm90_or_newer() {
        for (name, tile) in [
            ("rmw_bulk16k", 16384usize),
            ("rmw_bulk32k", 32768),
            ("rmw_bulk64k", 65536),
        ] {
            let f = module.load_function(name)?;
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, tile as i32)?;
            let cfg = LaunchConfig {
                grid_dim: ((state_floats * 4 / tile) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: tile as u32,
            };
            in_place(
                &f,
                cfg,
                format!("{name} (in-place by bulk copies, state of B=256)"),
            )?;
        }
    }
    for (name, u) in [("copy4", 4usize), ("copy16", 16)] {
        let f = module.load_function(name)?;
        for threads in [128usize, 256] {
            let cfg = LaunchConfig {
                grid_dim: ((n4 / (u * threads)) as u32, 1, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let us = time_us(&dev, 3, 20, || {
                // SAFETY: the grid covers exactly n4 float4 of both buffers.
                unsafe {
                    stream
                        .launch_builder(&f)
                        .arg(&state)
                        .arg(&mut other)
                        .launch(cfg)?
                };
                Ok(())
            })?;
            report(&format!("{name}_t{threads} (copy, same bytes)"), moved, us);
        }
    }
    let us = time_us(&dev, 3, 20, || {
        stream.memcpy_dtod(&state, &mut other)?;
        Ok(())
    })?;
    report("driver_dtod (copy, same bytes)", moved, us);
    drop(other);

    // Read-only passes over the MXFP4 expert bytes of batch 1 at K3 shapes: 16 experts of
    // gate and up (2 × 3072 × 3584 codes) and down (3584 × 3072), 4.25 bits a weight.
    let per_matrix = 3072usize * 3584 / 2 + 3072 * 3584 / 32;
    let gate_up = 16 * 2 * per_matrix;
    let down = 16 * per_matrix;
    // u32 words of `bytes` rounded up to whole 64 KiB blocks (the widest read's block).
    let words = |bytes: usize| bytes.div_ceil(1 << 16) * (1 << 14);
    let buf: CudaSlice<u32> = stream.alloc_zeros(words(gate_up) + words(down))?;
    let mut sink: CudaSlice<u32> = stream.alloc_zeros(1 << 20)?;
    let read16 = module.load_function("read16")?;
    let read8 = module.load_function("read8")?;
    let cfg_for = |bytes: usize, u: usize| LaunchConfig {
        grid_dim: ((bytes.div_ceil(16 * u * 256)) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // One read pass of `f` over `src` with `cfg`.
    let mut read = |f: &cudarc::driver::CudaFunction,
                    src: &cudarc::driver::CudaView<u32>,
                    cfg: LaunchConfig|
     -> Result<(), CudaError> {
        // SAFETY: every caller's grid reads whole blocks inside `src` (sized in whole blocks).
        unsafe {
            stream
                .launch_builder(f)
                .arg(src)
                .arg(&mut sink)
                .launch(cfg)?
        };
        Ok(())
    };
    let (head, tail) = (buf.slice(..words(gate_up)), buf.slice(words(gate_up)..));
    let whole = buf.slice(..);
    for (label, f, u) in [("read16", &read16, 16usize), ("read8", &read8, 8)] {
        let all = cfg_for(gate_up + down, u);
        let us = time_us(&dev, 3, 20, || read(f, &whole, all))?;
        report(
            &format!("{label} one launch (MXFP4 experts of B=1)"),
            (gate_up + down) as f64,
            us,
        );
        let (first, second) = (cfg_for(gate_up, u), cfg_for(down, u));
        let us = time_us(&dev, 3, 20, || {
            read(f, &head, first)?;
            read(f, &tail, second)
        })?;
        report(
            &format!("{label} two launches (gate/up, down of B=1)"),
            (gate_up + down) as f64,
            us,
        );
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bandwidth: {e}");
        std::process::exit(2);
    }
}
