//! Kernel launches through `cuLaunchKernelEx`, optionally as a programmatic dependent launch
//! (sm_90): the kernel may start while the previous kernel of the stream still runs, once every
//! block of that kernel has called `griddepcontrol.launch_dependents` (or exited), and must call
//! `griddepcontrol.wait` before it reads what that kernel writes (`grid_dep_*` in common.cuh).
//! In a captured CUDA graph the same launch becomes a programmatic edge.

use std::any::Any;
use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::sys::{
    cuLaunchKernelEx, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig,
};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};

use super::CudaError;

/// The argument list of one launch: each entry the address of an argument's value, boxed here
/// (device pointers, scalars) or borrowed for `'a` (descriptors passed by value).
#[derive(Default)]
pub(crate) struct RawLaunch<'a> {
    held: Vec<Box<dyn Any>>,
    ptrs: Vec<*mut c_void>,
    borrowed: PhantomData<&'a ()>,
}

impl<'a> RawLaunch<'a> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A plain value (scalar or device address), copied.
    pub(crate) fn value<T: Copy + 'static>(&mut self, v: T) -> &mut Self {
        let b = Box::new(v);
        self.ptrs.push(&*b as *const T as *mut c_void);
        self.held.push(b);
        self
    }

    /// A value the kernel receives by value that stays with the caller (a tensor map).
    pub(crate) fn by_ref<T>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push(v as *const T as *mut c_void);
        self
    }

    /// A buffer the kernel reads.
    pub(crate) fn slice<T>(&mut self, s: &CudaSlice<T>, stream: &CudaStream) -> &mut Self {
        let (ptr, _sync) = s.device_ptr(stream);
        self.value(ptr)
    }

    /// A buffer the kernel writes.
    pub(crate) fn slice_mut<T>(&mut self, s: &mut CudaSlice<T>, stream: &CudaStream) -> &mut Self {
        let (ptr, _sync) = s.device_ptr_mut(stream);
        self.value(ptr)
    }

    /// Launches `f` on `stream`; with `overlap`, as a programmatic dependent launch.
    ///
    /// # Safety
    /// The argument list must match the kernel's parameters, and the buffers must outlive the
    /// kernel (event tracking is off on these contexts: nothing here orders other streams).
    pub(crate) unsafe fn launch(
        &mut self,
        stream: &CudaStream,
        f: &CudaFunction,
        cfg: LaunchConfig,
        overlap: bool,
    ) -> Result<(), CudaError> {
        stream.context().bind_to_thread()?;
        // SAFETY: a plain C struct and union of integers: all-zero is a valid value.
        let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(overlap),
        };
        // SAFETY: the config and attribute live across the call; `ptrs` holds one address per
        // parameter (the caller's contract), each valid until the driver has copied it (here).
        unsafe {
            cuLaunchKernelEx(
                &config,
                f.cu_function(),
                self.ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?;
        }
        Ok(())
    }
}

/// Lets `f` launch with up to `bytes` of dynamic shared memory (beyond the default 48 KiB).
pub(crate) fn allow_dynamic_smem(f: &CudaFunction, bytes: usize) -> Result<(), CudaError> {
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )?;
    Ok(())
}
