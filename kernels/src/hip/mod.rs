//! The HIP backend for AMD GPUs: the kernel sources of the CUDA backend (made portable by
//! `gpu/port.cuh`), compiled by hiprtc for the device's `gfx` target at start-up and cached on
//! disk as code objects; the HIP runtime through `hip-runtime-sys`.
//!
//! The runtime (`libamdhip64`) is linked when the crate is built; hiprtc is loaded at run time
//! (see [`hiprtc_info`]). [`HipDevice::open`] reports a clear [`HipError`] when there is no AMD
//! GPU or driver, and [`compile`] needs no GPU at all. Tensors cross the API as [`HipBuffer`]s:
//! bf16 values as raw `u16` bit patterns ([`bf16_bits`], [`bf16_value`] convert on the host),
//! f32 as `f32`.
//!
//! The op API mirrors [`crate::cuda`]: [`KdaKernels`] has the same entry points with
//! [`HipDevice`] and [`HipBuffer`] in place of `CudaDevice` and `CudaSlice`.

mod kda;
mod rtc;

use std::ffi::{c_int, c_void, CStr, CString};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hip_runtime_sys as sys;
use sys::hipError_t;

pub use crate::gpu::{
    bf16_bits, bf16_value, kda_defines, KdaSequenceTables, KdaShape, CHUNK as KDA_CHUNK,
    KDA_SOURCE, OPS_SOURCE,
};
pub use kda::{KdaInputs, KdaKernels, KdaPrefillWorkspace};
pub use rtc::{hiprtc_info, hiprtc_targets};

/// Everything that can go wrong in the HIP backend.
#[derive(Debug, thiserror::Error)]
pub enum HipError {
    #[error("no AMD GPU driver: /dev/kfd does not exist (is the amdgpu kernel driver loaded and /dev/kfd visible to this process?)")]
    NoDriver,
    #[error("HIP device {ordinal} does not exist: {count} AMD GPU(s) visible (check HIP_VISIBLE_DEVICES and access to /dev/kfd and /dev/dri)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("no hiprtc: the HIP runtime compiler could not be loaded (install ROCm's hiprtc, or Debian's libamdhip64-dev; tried {0})")]
    NoHiprtc(String),
    #[error("hiprtc here cannot compile for {arch}: its code object manager ({lib}) supports {supported}")]
    UnsupportedTarget {
        arch: String,
        lib: String,
        supported: String,
    },
    #[error("HIP call {call} failed: {message} ({code:?})")]
    Runtime {
        call: &'static str,
        code: hipError_t,
        message: String,
    },
    #[error("hiprtc could not compile {name} for {arch}:\n{log}")]
    Compile {
        name: String,
        arch: String,
        log: String,
    },
    #[error("{0}")]
    Shape(String),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn check(call: &'static str, code: hipError_t) -> Result<(), HipError> {
    if code == hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static string for any code.
    let message = unsafe { CStr::from_ptr(sys::hipGetErrorString(code)) }
        .to_string_lossy()
        .into_owned();
    Err(HipError::Runtime {
        call,
        code,
        message,
    })
}

/// Element types that may live in device memory: plain values, any bit pattern valid.
///
/// # Safety
/// Implementors must be `Copy` types with no padding and no invalid bit patterns.
pub unsafe trait DeviceCopy: Copy + Send + Sync + 'static {}
// SAFETY: primitive numbers have no padding and accept every bit pattern.
unsafe impl DeviceCopy for u8 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i8 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u16 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i16 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u32 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i32 {}
// SAFETY: as above.
unsafe impl DeviceCopy for u64 {}
// SAFETY: as above.
unsafe impl DeviceCopy for i64 {}
// SAFETY: as above.
unsafe impl DeviceCopy for f32 {}
// SAFETY: as above.
unsafe impl DeviceCopy for f64 {}

/// `len` values of `T` in device memory, freed on drop.
pub struct HipBuffer<T: DeviceCopy> {
    ptr: *mut c_void,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: the buffer is a plain device allocation; HIP may use it from any host thread.
unsafe impl<T: DeviceCopy> Send for HipBuffer<T> {}
// SAFETY: shared references only expose the address.
unsafe impl<T: DeviceCopy> Sync for HipBuffer<T> {}

impl<T: DeviceCopy> HipBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address (null for an empty buffer).
    pub fn device_ptr(&self) -> *mut c_void {
        self.ptr
    }
}

impl<T: DeviceCopy> Drop for HipBuffer<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` came from hipMalloc and is freed once.
            unsafe { sys::hipFree(self.ptr) };
        }
    }
}

/// A HIP stream: launches and copies queued on it run in order.
pub struct HipStream {
    raw: sys::hipStream_t,
}

// SAFETY: HIP streams may be used from any host thread.
unsafe impl Send for HipStream {}
// SAFETY: as above; HIP serialises the calls that queue work.
unsafe impl Sync for HipStream {}

impl HipStream {
    pub fn raw(&self) -> sys::hipStream_t {
        self.raw
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<(), HipError> {
        // SAFETY: a live stream.
        check("hipStreamSynchronize", unsafe {
            sys::hipStreamSynchronize(self.raw)
        })
    }

    /// Queues a kernel launch.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every buffer
    /// they name must stay alive until the launch has run.
    pub unsafe fn launch(
        &self,
        f: &HipFunction,
        cfg: LaunchConfig,
        args: &KernelArgs,
    ) -> Result<(), HipError> {
        let mut params: Vec<*mut c_void> = args
            .slots
            .iter()
            .map(|s| s as *const u64 as *mut c_void)
            .collect();
        let (gx, gy, gz) = cfg.grid_dim;
        let (bx, by, bz) = cfg.block_dim;
        // SAFETY: `params` points at the argument slots, alive for the call; the caller
        // vouches for their types.
        check("hipModuleLaunchKernel", unsafe {
            sys::hipModuleLaunchKernel(
                f.raw,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                cfg.shared_mem_bytes,
                self.raw,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for HipStream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by hipStreamCreate and is destroyed once.
        unsafe { sys::hipStreamDestroy(self.raw) };
    }
}

/// A HIP event, for timing and for waiting on part of a stream.
pub struct HipEvent {
    raw: sys::hipEvent_t,
}

// SAFETY: HIP events may be used from any host thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// Marks the current end of `stream`.
    pub fn record(&self, stream: &HipStream) -> Result<(), HipError> {
        // SAFETY: a live event and stream.
        check("hipEventRecord", unsafe {
            sys::hipEventRecord(self.raw, stream.raw)
        })
    }

    /// Waits until the work before the recorded point has run.
    pub fn synchronize(&self) -> Result<(), HipError> {
        // SAFETY: a live event.
        check("hipEventSynchronize", unsafe {
            sys::hipEventSynchronize(self.raw)
        })
    }

    /// Whether the work before the recorded point has run.
    pub fn is_done(&self) -> Result<bool, HipError> {
        // SAFETY: a live event.
        match unsafe { sys::hipEventQuery(self.raw) } {
            hipError_t::hipErrorNotReady => Ok(false),
            e => check("hipEventQuery", e).map(|_| true),
        }
    }

    /// Milliseconds from `start` to this event (both recorded and done).
    pub fn elapsed_ms(&self, start: &HipEvent) -> Result<f32, HipError> {
        let mut ms = 0f32;
        // SAFETY: live events and an out-parameter.
        check("hipEventElapsedTime", unsafe {
            sys::hipEventElapsedTime(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: the event was created by hipEventCreate and is destroyed once.
        unsafe { sys::hipEventDestroy(self.raw) };
    }
}

/// A loaded code object.
pub struct HipModule {
    raw: sys::hipModule_t,
}

// SAFETY: HIP modules may be used from any host thread.
unsafe impl Send for HipModule {}
// SAFETY: as above.
unsafe impl Sync for HipModule {}

impl HipModule {
    /// The kernel `name` (an `extern "C"` entry of the module).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<HipFunction, HipError> {
        let cname = CString::new(name)
            .map_err(|_| HipError::Shape(format!("kernel name {name:?} contains a NUL byte")))?;
        let mut raw: sys::hipFunction_t = std::ptr::null_mut();
        // SAFETY: a live module, a NUL-terminated name and an out-parameter.
        check("hipModuleGetFunction", unsafe {
            sys::hipModuleGetFunction(&mut raw, self.raw, cname.as_ptr())
        })?;
        Ok(HipFunction {
            raw,
            _module: self.clone(),
        })
    }
}

impl Drop for HipModule {
    fn drop(&mut self) {
        // SAFETY: the module was loaded by hipModuleLoadData and is unloaded once.
        unsafe { sys::hipModuleUnload(self.raw) };
    }
}

/// A kernel of a loaded module (keeps the module loaded).
pub struct HipFunction {
    raw: sys::hipFunction_t,
    _module: Arc<HipModule>,
}

// SAFETY: HIP function handles may be used from any host thread.
unsafe impl Send for HipFunction {}
// SAFETY: as above.
unsafe impl Sync for HipFunction {}

/// Grid, block and dynamic shared memory (LDS) of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid_dim: (u32, u32, u32),
    pub block_dim: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// The arguments of one launch, each in its own 8-byte slot.
#[derive(Default)]
pub struct KernelArgs {
    slots: Vec<u64>,
}

impl KernelArgs {
    pub fn new() -> Self {
        Self::default()
    }

    fn push_bytes(&mut self, b: &[u8]) -> &mut Self {
        let mut slot = [0u8; 8];
        slot[..b.len()].copy_from_slice(b);
        self.slots.push(u64::from_ne_bytes(slot));
        self
    }

    /// A device pointer argument.
    pub fn buffer<T: DeviceCopy>(&mut self, b: &HipBuffer<T>) -> &mut Self {
        self.push_bytes(&(b.ptr as usize).to_ne_bytes())
    }

    /// A device pointer argument that may be null.
    pub fn buffer_or_null<T: DeviceCopy>(&mut self, b: Option<&HipBuffer<T>>) -> &mut Self {
        let p = b.map_or(0, |b| b.ptr as usize);
        self.push_bytes(&p.to_ne_bytes())
    }

    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }

    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }

    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
}

/// One AMD GPU: the stream every launch goes to and the module compiler.
pub struct HipDevice {
    ordinal: c_int,
    stream: Arc<HipStream>,
    arch: String,
    arch_full: String,
    name: String,
    max_shared_per_block: usize,
    warp_size: usize,
    cache_dir: Option<PathBuf>,
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl HipDevice {
    /// Opens device `ordinal`. Kernels compiled by this device are cached under `cache_dir`
    /// (no caching when `None`).
    pub fn open(ordinal: usize, cache_dir: Option<PathBuf>) -> Result<Self, HipError> {
        let mut count: c_int = 0;
        // SAFETY: an out-parameter; HIP initialises itself on this first call.
        let rc = unsafe { sys::hipGetDeviceCount(&mut count) };
        let count = if rc == hipError_t::hipSuccess {
            count.max(0) as usize
        } else {
            0
        };
        if count == 0 && !Path::new("/dev/kfd").exists() {
            return Err(HipError::NoDriver);
        }
        if rc != hipError_t::hipSuccess && rc != hipError_t::hipErrorNoDevice {
            check("hipGetDeviceCount", rc)?;
        }
        if ordinal >= count {
            return Err(HipError::NoDevice { ordinal, count });
        }
        let id = ordinal as c_int;
        // SAFETY: `id` is a valid ordinal.
        check("hipSetDevice", unsafe { sys::hipSetDevice(id) })?;

        // Room to spare past the struct, in case a runtime writes a longer layout.
        #[repr(C)]
        struct Props {
            p: sys::hipDeviceProp_t,
            _spare: [u8; 4096],
        }
        // SAFETY: all-zero is a valid hipDeviceProp_t (integers and character arrays).
        let mut props: Box<Props> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `props` is large enough for the properties of the runtime's ABI.
        check("hipGetDeviceProperties", unsafe {
            sys::hipGetDeviceProperties(&mut props.p, id)
        })?;
        let name = c_chars_to_string(&props.p.name);
        let mut arch_full = c_chars_to_string(&props.p.gcnArchName);
        if arch_full.is_empty() {
            arch_full = format!("gfx{}", props.p.gcnArch);
        }
        let arch = arch_full.split(':').next().unwrap_or_default().to_string();
        let attr = |a: sys::hipDeviceAttribute_t| -> Result<usize, HipError> {
            let mut v: c_int = 0;
            // SAFETY: an out-parameter for a valid device.
            check("hipDeviceGetAttribute", unsafe {
                sys::hipDeviceGetAttribute(&mut v, a, id)
            })?;
            Ok(v.max(0) as usize)
        };
        let max_shared_per_block =
            attr(sys::hipDeviceAttribute_t::hipDeviceAttributeMaxSharedMemoryPerBlock)?;
        let warp_size = attr(sys::hipDeviceAttribute_t::hipDeviceAttributeWarpSize)?;
        let mut raw: sys::hipStream_t = std::ptr::null_mut();
        // SAFETY: an out-parameter; the stream belongs to the current device.
        check("hipStreamCreate", unsafe { sys::hipStreamCreate(&mut raw) })?;
        Ok(HipDevice {
            ordinal: id,
            stream: Arc::new(HipStream { raw }),
            arch,
            arch_full,
            name,
            max_shared_per_block,
            warp_size,
            cache_dir,
        })
    }

    /// The device's marketing name, e.g. "AMD Instinct MI300X".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The target kernels are compiled for, e.g. "gfx942".
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The target with its feature flags as the runtime reports it, e.g. "gfx942:sramecc+:xnack-".
    pub fn arch_full(&self) -> &str {
        &self.arch_full
    }

    /// The wavefront size (64 on CDNA).
    pub fn warp_size(&self) -> usize {
        self.warp_size
    }

    /// The most shared memory (LDS) one block may use, in bytes.
    pub fn max_shared_per_block(&self) -> usize {
        self.max_shared_per_block
    }

    pub fn stream(&self) -> &Arc<HipStream> {
        &self.stream
    }

    fn bind(&self) -> Result<(), HipError> {
        // SAFETY: the ordinal was valid when the device was opened.
        check("hipSetDevice", unsafe { sys::hipSetDevice(self.ordinal) })
    }

    /// Free and total device memory, in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), HipError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two out-parameters.
        check("hipMemGetInfo", unsafe {
            sys::hipMemGetInfo(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// A new event on this device.
    pub fn event(&self) -> Result<HipEvent, HipError> {
        self.bind()?;
        let mut raw: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        check("hipEventCreate", unsafe { sys::hipEventCreate(&mut raw) })?;
        Ok(HipEvent { raw })
    }

    /// Loads a code object (as [`compile`] returns it).
    pub fn load_module(&self, code: &[u8]) -> Result<Arc<HipModule>, HipError> {
        self.bind()?;
        let mut raw: sys::hipModule_t = std::ptr::null_mut();
        // SAFETY: `code` is a complete code object, alive for the call.
        check("hipModuleLoadData", unsafe {
            sys::hipModuleLoadData(&mut raw, code.as_ptr().cast())
        })?;
        Ok(Arc::new(HipModule { raw }))
    }

    /// Compiles (or loads from the cache) `source` with `defines` as `-D` macros.
    pub fn module(
        &self,
        name: &str,
        source: &str,
        defines: &[(&str, String)],
    ) -> Result<Arc<HipModule>, HipError> {
        let options = rtc::hiprtc_options(&self.arch, defines);
        let key = crate::gpu::cache_file_name(name, &self.arch, source, &options, "co");
        let cached = self.cache_dir.as_ref().map(|d| d.join(key));
        if let Some(path) = &cached {
            if let Ok(code) = std::fs::read(path) {
                if let Ok(module) = self.load_module(&code) {
                    return Ok(module);
                }
            }
        }
        let code = compile(&self.arch, name, source, defines)?;
        if let Some(path) = &cached {
            crate::gpu::write_cache_file(path, &code).map_err(|source| HipError::Cache {
                path: path.clone(),
                source,
            })?;
        }
        self.load_module(&code)
    }

    /// `len` zeroed values.
    pub fn alloc_zeros<T: DeviceCopy>(&self, len: usize) -> Result<HipBuffer<T>, HipError> {
        let buf = self.alloc::<T>(len)?;
        if buf.bytes() > 0 {
            // SAFETY: `buf` holds `bytes()` bytes; the memset is ordered on this stream.
            check("hipMemsetAsync", unsafe {
                sys::hipMemsetAsync(buf.ptr, 0, buf.bytes(), self.stream.raw)
            })?;
        }
        Ok(buf)
    }

    fn alloc<T: DeviceCopy>(&self, len: usize) -> Result<HipBuffer<T>, HipError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| HipError::Shape(format!("{len} elements overflow the address space")))?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if bytes > 0 {
            self.bind()?;
            // SAFETY: an out-parameter.
            check("hipMalloc", unsafe { sys::hipMalloc(&mut ptr, bytes) })?;
        }
        Ok(HipBuffer {
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// Uploads host data (waits for the copy, so `data` may be dropped at once).
    pub fn upload<T: DeviceCopy>(&self, data: &[T]) -> Result<HipBuffer<T>, HipError> {
        let mut buf = self.alloc::<T>(data.len())?;
        self.copy_to_device(data, &mut buf)?;
        Ok(buf)
    }

    /// Copies host data into an existing buffer of the same length (waits for the copy).
    pub fn copy_to_device<T: DeviceCopy>(
        &self,
        src: &[T],
        dst: &mut HipBuffer<T>,
    ) -> Result<(), HipError> {
        if src.len() != dst.len {
            return Err(HipError::Shape(format!(
                "copy of {} elements into a buffer of {}",
                src.len(),
                dst.len
            )));
        }
        if dst.bytes() == 0 {
            return Ok(());
        }
        // SAFETY: both ranges hold `bytes()` bytes; the host side stays borrowed until the
        // stream has been synchronised below.
        check("hipMemcpyAsync", unsafe {
            sys::hipMemcpyAsync(
                dst.ptr,
                src.as_ptr().cast(),
                dst.bytes(),
                sys::hipMemcpyKind::hipMemcpyHostToDevice,
                self.stream.raw,
            )
        })?;
        self.synchronize()
    }

    /// Downloads device data (waits for the stream).
    pub fn download<T: DeviceCopy + Default>(
        &self,
        data: &HipBuffer<T>,
    ) -> Result<Vec<T>, HipError> {
        let mut out = vec![T::default(); data.len];
        if data.bytes() > 0 {
            // SAFETY: both ranges hold `bytes()` bytes; `out` lives past the synchronisation.
            check("hipMemcpyAsync", unsafe {
                sys::hipMemcpyAsync(
                    out.as_mut_ptr().cast(),
                    data.ptr,
                    data.bytes(),
                    sys::hipMemcpyKind::hipMemcpyDeviceToHost,
                    self.stream.raw,
                )
            })?;
        }
        self.synchronize()?;
        Ok(out)
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<(), HipError> {
        self.stream.synchronize()
    }
}

/// Where compiled kernels are cached by default: `$TESSERA_CACHE_DIR/hip`, else
/// `$XDG_CACHE_HOME/tessera/hip`, else `~/.cache/tessera/hip`.
pub fn default_cache_dir() -> Option<PathBuf> {
    crate::gpu::cache_dir_for("hip")
}

/// Compiles a kernel source (with the portability header and the shared helpers prepended, see
/// [`crate::gpu::translation_unit`]) to a code object for `arch` (e.g. "gfx90a", "gfx942").
/// Needs hiprtc but no GPU.
pub fn compile(
    arch: &str,
    name: &str,
    source: &str,
    defines: &[(&str, String)],
) -> Result<Vec<u8>, HipError> {
    rtc::compile_unit(
        arch,
        name,
        &crate::gpu::translation_unit(source),
        &rtc::hiprtc_options(arch, defines),
    )
}
