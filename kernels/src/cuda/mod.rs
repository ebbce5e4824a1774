//! The CUDA backend: kernels written as `.cu` sources (shared with the HIP backend, see
//! [`crate::gpu`]), compiled by NVRTC for the device's architecture at start-up and cached on
//! disk as PTX.
//!
//! The CUDA driver (`libcuda.so.1`) and NVRTC are loaded dynamically, so building this module
//! needs no CUDA installation; [`CudaDevice::open`] reports a clear [`CudaError`] when either
//! library or the device is missing. Tensors cross the API as device slices: bf16 values as raw
//! `u16` bit patterns ([`bf16_bits`], [`bf16_value`] convert on the host), f32 as `f32`.

mod conv;
mod kda;
mod kda_segmented;
mod kda_tma;
mod kda_workspace;
mod launch;
mod mla;
mod model_mla;
mod model_ops;
mod moe;
mod moe_policy;
mod mxfp4;
mod ops;
mod sample;
mod staging;
mod tensor_map;

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaModule};
pub use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use cudarc::nvrtc::{CompileOptions, Ptx};

pub use crate::gpu::{
    bf16_bits, bf16_value, kda_defines, KdaSequenceTables, KdaShape, CHUNK as KDA_CHUNK,
    KDA_SOURCE, OPS_SOURCE,
};
pub use conv::ShortConv;
pub use kda::{KdaInputs, KdaKernels, KdaPacked, KdaScanKind};
pub use kda_segmented::KdaSegmentedPrefill;
pub use kda_workspace::KdaPrefillWorkspace;
pub use mla::{
    MlaDecode, MlaDecodeShape, MlaDecodeWorkspace, MlaKernel, MlaPages, MlaTuning, MLA_RANK,
    MLA_ROPE,
};
pub use model_mla::{FlashPlan, MlaAbsorbed, FLASH_MAX_RANK, FLASH_MAX_WIDTH, MLA_FLASH_SOURCE};
pub use model_ops::{
    base_ptr, dptr, DevPtr, KdaRecurrent, ModelKernels, NormRows, PagedHistory, SegState,
    MAX_ATTN_RES_SOURCES, MAX_CONV_KERNEL, MODEL_KERNELS, MODEL_SOURCE,
};
pub use moe::{
    MoeActivation, MoeDecode, MoeDims, MoeExperts, MoePath, MoeWorkspace, MOE_MAX_BATCH,
};
pub use mxfp4::mxfp4_device_codes;
pub use ops::{GemmType, Linear, RowOps};
pub use sample::{Sampler, SamplingRows};
pub use staging::copy_within;

/// KDA short convolution (prefill and the one-token update). CUDA only: the kernels of the
/// model families below use PTX-only instructions (ballots, ldmatrix) without HIP fallbacks.
pub const CONV_SOURCE: &str = include_str!("conv.cu");
/// Sampling: greedy, temperature, top-k, top-p (the radix select, the compacted candidates and
/// prefix path, then the bin path and the kernels).
pub const SAMPLE_SOURCE: &str = concat!(
    include_str!("sample.cu"),
    "\n",
    include_str!("sample_prefix.cu"),
    "\n",
    include_str!("sample_bins.cu")
);
/// MLA decode in absorbed form over the paged latent cache (split context + combine).
pub const MLA_DECODE_SOURCE: &str = include_str!("mla_decode.cu");
/// The split kernels of MLA decode on warpgroup MMAs; Hopper only (compiled for `sm_90a`).
pub const MLA_DECODE_SM90_SOURCE: &str = concat!(
    include_str!("wgmma.cuh"),
    "\n",
    include_str!("tma.cuh"),
    "\n",
    include_str!("mla_decode_sm90.cu"),
    "\n",
    include_str!("mla_decode_tr.cu")
);
/// The KDA chunk scan on warpgroup MMAs; Hopper only (compiled for `sm_90a`, with the
/// `kda.cu` defines).
pub const KDA_SCAN_SM90_SOURCE: &str = concat!(
    include_str!("wgmma.cuh"),
    "\n",
    include_str!("kda_scan_sm90.cu")
);
/// The KDA chunk scan fed by the copy engine; Hopper only (compiled for `sm_90a`, with the
/// `kda.cu` defines).
pub const KDA_SCAN_TMA_SOURCE: &str = concat!(
    include_str!("tma.cuh"),
    "\n",
    include_str!("kda_stage.cuh"),
    "\n",
    include_str!("kda_scan_tma.cu")
);

/// A KDA chunk scan on warpgroup MMAs fed by the copy engine: the copies, the wgmma helpers,
/// the stage and the scan's own source.
macro_rules! kda_warpgroup_scan_source {
    ($scan:literal) => {
        concat!(
            include_str!("tma.cuh"),
            "\n",
            include_str!("wgmma.cuh"),
            "\n",
            include_str!("kda_stage.cuh"),
            "\n",
            include_str!($scan)
        )
    };
}

/// The KDA chunk scan fed by the copy engine, on warpgroup MMAs; Hopper only (as above).
pub const KDA_SCAN_TMA_WG_SOURCE: &str = kda_warpgroup_scan_source!("kda_scan_tma_wg.cu");

/// The KDA chunk scan fed by the copy engine with the state transposed and the left operands in
/// registers; Hopper only (as above, with `KS_VT` the block's value columns, 64 a warpgroup).
pub const KDA_SCAN_TMA_RS_SOURCE: &str = kda_warpgroup_scan_source!("kda_scan_tma_rs.cu");

/// MoE decode for small batches: routing, plan, gate+up+SiTU, down, combine (bf16 and MXFP4).
pub const MOE_SOURCE: &str = concat!(
    include_str!("moe.cu"),
    "\n",
    include_str!("tma.cuh"),
    "\n",
    include_str!("moe_tc.cu"),
    "\n",
    include_str!("moe_tc_tma.cu"),
    "\n",
    include_str!("moe_tc_resident.cu"),
    "\n",
    include_str!("moe_tc_kernels.cu")
);

/// Everything that can go wrong in the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda.so.1 could not be loaded (is the NVIDIA driver installed and visible to this process?)")]
    NoDriver,
    #[error("no NVRTC: libnvrtc could not be loaded (install the CUDA runtime compiler, e.g. the cuda-nvrtc package)")]
    NoNvrtc,
    #[error("CUDA device {ordinal} does not exist: {count} device(s) visible")]
    NoDevice { ordinal: usize, count: usize },
    #[error("no cuBLAS: libcublas could not be loaded (install the CUDA cuBLAS library, e.g. the nvidia-cublas package)")]
    NoCublas,
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS call failed: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC could not compile {name} for {arch}:\n{log}")]
    Compile {
        name: String,
        arch: String,
        log: String,
    },
    #[error("{0}")]
    Shape(String),
    #[error("{0}")]
    Setting(String),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One GPU: its context, the stream every launch goes to, and the module compiler.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    name: String,
    cache_dir: Option<PathBuf>,
    staging: staging::Staging,
}

impl CudaDevice {
    /// Opens device `ordinal`. Kernels compiled by this device are cached under `cache_dir`
    /// (no caching when `None`).
    pub fn open(ordinal: usize, cache_dir: Option<PathBuf>) -> Result<Self, CudaError> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name()?;
        // One stream, ordered launches: the per-argument event tracking is not needed.
        // SAFETY: every launch of this device goes to `stream`, so ordering is by the stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own rather than the legacy default stream, which cannot be captured
        // into a graph ([`CudaDevice::capture`]).
        let stream = ctx.new_stream()?;
        let dev = CudaDevice {
            ctx,
            stream,
            arch: format!("sm_{major}{minor}"),
            name,
            cache_dir,
            staging: Default::default(),
        };
        dev.keep_freed_memory(pool_keep_bytes()?)?;
        Ok(dev)
    }

    /// How much freed memory the device's stream-ordered allocator keeps for reuse instead of
    /// handing it back to the driver at the next synchronisation (the driver's default keeps
    /// none, so every step's workspaces are mapped anew). No-op without memory pools.
    pub fn keep_freed_memory(&self, bytes: u64) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        if !self.ctx.has_async_alloc() {
            return Ok(());
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut value = bytes;
        // SAFETY: the device handle is this context's; the attribute takes a u64 by pointer.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()).result()?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
            .result()?;
        }
        Ok(())
    }

    /// The device's marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's multiprocessor count.
    pub fn sm_count(&self) -> Result<usize, CudaError> {
        let count = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        Ok(self.ctx.attribute(count)? as usize)
    }

    /// The architecture kernels are compiled for, e.g. "sm_90".
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Whether the device is Hopper (sm_90) or newer.
    pub fn is_sm90_or_newer(&self) -> bool {
        sm90_or_newer(&self.arch)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Compiles (or loads from the cache) `source` with `defines` as `-D` macros.
    pub fn module(
        &self,
        name: &str,
        source: &str,
        defines: &[(&str, String)],
    ) -> Result<Arc<CudaModule>, CudaError> {
        self.module_for(&self.arch, name, source, defines)
    }

    /// [`CudaDevice::module`] for an architecture other than the device's own, such as the
    /// architecture-specific `sm_90a` on an `sm_90` device.
    pub fn module_for(
        &self,
        arch: &str,
        name: &str,
        source: &str,
        defines: &[(&str, String)],
    ) -> Result<Arc<CudaModule>, CudaError> {
        let key =
            crate::gpu::cache_file_name(name, arch, source, &nvrtc_options(arch, defines), "ptx");
        let cached = self.cache_dir.as_ref().map(|d| d.join(&key));
        if let Some(path) = &cached {
            if let Ok(ptx) = std::fs::read_to_string(path) {
                return Ok(self.ctx.load_module(Ptx::from_src(ptx))?);
            }
        }
        let ptx = compile(arch, name, source, defines)?;
        if let Some(path) = &cached {
            crate::gpu::write_cache_file(path, ptx.to_src().as_bytes()).map_err(|source| {
                CudaError::Cache {
                    path: path.clone(),
                    source,
                }
            })?;
        }
        Ok(self.ctx.load_module(ptx)?)
    }

    /// Uploads host data.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(data)?)
    }

    /// Downloads device data (waits for the stream).
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        data: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(data)?)
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Records the work `f` queues on the device's stream into a [`Graph`] instead of running
    /// it. `f` must only queue work: no synchronisation, no copies to or from pageable host
    /// memory, no buffer that outlives it allocated inside (stream-ordered allocations made and
    /// freed inside become the graph's own memory, the same addresses on every replay). On an
    /// error from `f` the capture is ended and dropped.
    pub fn capture<R, E: From<CudaError>>(
        &self,
        f: impl FnOnce() -> Result<R, E>,
    ) -> Result<(Graph, R), E> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(CudaError::from)?;
        let out = f();
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        let r = out?;
        match ended.map_err(CudaError::from)? {
            Some(g) => Ok((Graph(g), r)),
            None => Err(CudaError::Shape("the capture recorded no work".into()).into()),
        }
    }
}

/// Work recorded by [`CudaDevice::capture`], replayed on the device's stream with one call.
pub struct Graph(cudarc::driver::CudaGraph);

// SAFETY: a graph is not internally synchronised; `Graph` gives no shared access (`launch`
// takes `&mut self`), so moving it between threads is sound.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues one replay on the stream it was captured from.
    pub fn launch(&mut self) -> Result<(), CudaError> {
        Ok(self.0.launch()?)
    }
}

/// Whether `arch` ("sm_<major><minor>", e.g. "sm_90", "sm_100") is Hopper or newer.
pub(crate) fn sm90_or_newer(arch: &str) -> bool {
    arch.strip_prefix("sm_")
        .and_then(|a| a.get(..a.len().saturating_sub(1))?.parse::<u32>().ok())
        .is_some_and(|major| major >= 9)
}

/// Freed device memory kept for reuse: `TESSERA_CUDA_POOL_KEEP_MIB`, else 8 GiB.
fn pool_keep_bytes() -> Result<u64, CudaError> {
    parse_pool_keep(std::env::var("TESSERA_CUDA_POOL_KEEP_MIB").ok().as_deref())
}

/// Bytes from a `TESSERA_CUDA_POOL_KEEP_MIB` value (whole MiB; unset: 8 GiB).
fn parse_pool_keep(mib: Option<&str>) -> Result<u64, CudaError> {
    const DEFAULT_MIB: u64 = 8 << 10;
    match mib {
        None => Ok(DEFAULT_MIB << 20),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(|mib| mib.saturating_mul(1 << 20))
            .map_err(|_| {
                CudaError::Setting(format!(
                    "TESSERA_CUDA_POOL_KEEP_MIB must be a whole number of MiB, got {v:?}"
                ))
            }),
    }
}

/// Where compiled kernels are cached by default: `$TESSERA_CACHE_DIR/cuda`, else
/// `$XDG_CACHE_HOME/tessera/cuda`, else `~/.cache/tessera/cuda`.
pub fn default_cache_dir() -> Option<PathBuf> {
    crate::gpu::cache_dir_for("cuda")
}

fn nvrtc_options(arch: &str, defines: &[(&str, String)]) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    options
}

/// Compiles a kernel source (with the portability header and the shared helpers prepended, see
/// [`crate::gpu::translation_unit`]) to PTX for `arch` (e.g. "sm_90"). Needs NVRTC but no GPU.
pub fn compile(
    arch: &str,
    name: &str,
    source: &str,
    defines: &[(&str, String)],
) -> Result<Ptx, CudaError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let opts = CompileOptions {
        options: nvrtc_options(arch, defines),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let full = crate::gpu::translation_unit(source);
    cudarc::nvrtc::compile_ptx_with_opts(&full, opts).map_err(|e| {
        let log = match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => other.to_string(),
        };
        CudaError::Compile {
            name: name.to_string(),
            arch: arch.to_string(),
            log,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_device_memory_is_whole_mib_and_8_gib_unset() {
        assert_eq!(parse_pool_keep(None).unwrap(), 8 << 30);
        assert_eq!(parse_pool_keep(Some("0")).unwrap(), 0);
        assert_eq!(parse_pool_keep(Some(" 512 ")).unwrap(), 512 << 20);
        assert_eq!(
            parse_pool_keep(Some(&u64::MAX.to_string())).unwrap(),
            u64::MAX
        );
        for bad in ["", "1.5", "-1", "8GiB"] {
            let err = parse_pool_keep(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("TESSERA_CUDA_POOL_KEEP_MIB"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn opening_a_device_without_a_driver_is_a_clear_error() {
        // On machines with a GPU this opens it; without one it must be an error, not a panic.
        match CudaDevice::open(0, None) {
            Ok(dev) => assert!(dev.arch().starts_with("sm_")),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("CUDA") || msg.contains("libcuda"),
                    "unhelpful error: {msg}"
                );
            }
        }
        match CudaDevice::open(10_000, None) {
            Ok(_) => panic!("device 10000 cannot exist"),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
