//! Safe wrappers over the ucp objects the UCX backend uses: context, worker, memory maps and
//! their packed remote keys, the listener, endpoints, unpacked remote keys, and a batch of puts
//! completed by one endpoint flush.
//!
//! Everything here lives on one thread, the progress thread of [`super::worker`]: the types hold
//! raw UCX handles, so they are neither `Send` nor `Sync`. Each keeps what it depends on alive
//! through an `Rc` (a worker its context, an endpoint its worker, a remote key its endpoint, a
//! flush its remote key and its source leases), so UCX objects are always destroyed in the order
//! UCX requires: remote keys before their endpoint, endpoints before their worker, the worker and
//! the memory maps before the context.
//!
//! Callbacks UCX invokes from `ucp_worker_progress` only record into a cell owned by the object
//! they report on (never reentering this code); the progress loop acts on the records afterwards.
//! A cell outlives every callback that may write it: it is freed only after the operation
//! completed, its request was freed, or the endpoint that owns it was closed.

use std::cell::RefCell;
use std::ffi::{c_void, CStr};
use std::mem;
use std::ptr;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ucx_sys as sys;

use crate::region::{RegionHandle, REGION_ALIGN};

mod endpoint;
mod listener;

pub(crate) use endpoint::{Endpoint, Flush, Put, Rkey};
use endpoint::{FailureCell, CLOSE_LIMIT};
pub(crate) use listener::Listener;

/// A UCX call that failed, with the status it returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {}", status_name(*.status))]
pub(crate) struct UcxError {
    pub call: &'static str,
    pub status: sys::ucs_status_t,
}

impl UcxError {
    /// Whether the endpoint the call used is broken (the peer failed or the connection went
    /// down): a fresh endpoint may work.
    pub fn is_endpoint_failure(&self) -> bool {
        let s = self.status;
        s == sys::UCS_ERR_CONNECTION_RESET
            || s == sys::UCS_ERR_UNREACHABLE
            || s == sys::UCS_ERR_CANCELED
            || s == sys::UCS_ERR_REJECTED
            || s == sys::UCS_ERR_NOT_CONNECTED
            || s == sys::UCS_ERR_IO_ERROR
            || s == sys::UCS_ERR_TIMED_OUT
            || (sys::UCS_ERR_LAST_LINK_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&s)
            || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE)
                .contains(&s)
    }
}

pub(crate) fn status_name(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static NUL-terminated string for every value.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}

fn check(status: sys::ucs_status_t, call: &'static str) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(UcxError { call, status })
    }
}

/// A UCP context for RMA with the wake-up mechanism, configured from the `UCX_*` environment
/// (so `UCX_TLS`, `UCX_NET_DEVICES`, ... work as in every UCX program).
pub(crate) struct Context {
    raw: sys::ucp_context_h,
}

impl Context {
    pub fn new() -> Result<Rc<Self>, UcxError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file mean "read the UCX_ environment"; `config` is written on
        // success only.
        check(
            unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) },
            "ucp_config_read",
        )?;
        let params = sys::ucp_params_t {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
            features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP) as u64,
            ..Default::default()
        };
        let mut raw: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `params` is fully initialised (zero beyond the fields its mask names), `config`
        // came from ucp_config_read, `raw` is an out-pointer.
        let status = unsafe { sys::ucp_init(&params, config, &mut raw) };
        // SAFETY: `config` came from ucp_config_read and is not used again; ucp_init copied it.
        unsafe { sys::ucp_config_release(config) };
        check(status, "ucp_init")?;
        Ok(Rc::new(Context { raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory map holds an `Rc` on this context, so none is left.
        unsafe { sys::ucp_cleanup(self.raw) }
    }
}

/// Wakes a worker that sleeps in [`Worker::wait`]; shareable with other threads.
pub(crate) struct Signal {
    worker: Mutex<Option<WorkerPtr>>,
}

struct WorkerPtr(sys::ucp_worker_h);

// SAFETY: the pointer is only passed to ucp_worker_signal, which UCX documents as safe from any
// thread whatever the worker's thread mode, and only while the worker lives: `Worker::drop`
// clears it, under the same lock, before destroying the worker.
unsafe impl Send for WorkerPtr {}

impl Signal {
    pub fn wake(&self) {
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = worker.as_ref() {
            // SAFETY: see `WorkerPtr`; the lock keeps the worker alive during the call.
            unsafe { sys::ucp_worker_signal(w.0) };
        }
    }
}

/// A UCP worker, driven by one thread (`UCS_THREAD_MODE_SINGLE`).
pub(crate) struct Worker {
    raw: sys::ucp_worker_h,
    signal: Arc<Signal>,
    /// Endpoint closes still running (see [`Worker::reap_closed`]).
    closing: RefCell<Vec<Closing>>,
    _context: Rc<Context>,
}

/// An endpoint close in progress, and the endpoint's failure cell, which its error handler may
/// write until the close completed.
struct Closing {
    request: sys::ucs_status_ptr_t,
    failure: Box<FailureCell>,
    since: Instant,
}

impl Worker {
    pub fn new(context: &Rc<Context>) -> Result<Rc<Self>, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: a live context, initialised params, an out-pointer.
        check(
            unsafe { sys::ucp_worker_create(context.raw, &params, &mut raw) },
            "ucp_worker_create",
        )?;
        Ok(Rc::new(Worker {
            raw,
            signal: Arc::new(Signal {
                worker: Mutex::new(Some(WorkerPtr(raw))),
            }),
            closing: RefCell::new(Vec::new()),
            _context: context.clone(),
        }))
    }

    /// Runs pending communication; returns how many events it processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: a live worker, on its own thread.
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    /// Arms the wake-up: true when [`Worker::wait`] may now sleep, false when events are
    /// already pending (progress first).
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: a live worker, on its own thread.
        match unsafe { sys::ucp_worker_arm(self.raw) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            status => Err(UcxError {
                call: "ucp_worker_arm",
                status,
            }),
        }
    }

    /// Sleeps until a communication event or a [`Signal::wake`] (after a successful arm).
    pub fn wait(&self) -> Result<(), UcxError> {
        // SAFETY: a live worker, on its own thread.
        check(unsafe { sys::ucp_worker_wait(self.raw) }, "ucp_worker_wait")
    }

    pub fn signal(&self) -> Arc<Signal> {
        self.signal.clone()
    }

    /// Whether endpoint closes are still running.
    pub fn closing(&self) -> bool {
        !self.closing.borrow().is_empty()
    }

    /// Frees the endpoint closes that completed; gives up on those that ran past
    /// [`CLOSE_LIMIT`] (their request is freed; their failure cell, which UCX may still write,
    /// is leaked). True when any finished.
    pub fn reap_closed(&self) -> bool {
        let pending = mem::take(&mut *self.closing.borrow_mut());
        let before = pending.len();
        let mut left = Vec::new();
        for c in pending {
            // SAFETY: a close request of this worker, not yet freed.
            let status = unsafe { sys::ucp_request_check_status(c.request) };
            if status != sys::UCS_INPROGRESS {
                // SAFETY: completed; freed once. The cell goes with `c`: the close is over.
                unsafe { sys::ucp_request_free(c.request) };
            } else if c.since.elapsed() > CLOSE_LIMIT {
                tracing::debug!("ucx endpoint close did not finish in time");
                // SAFETY: still running; freed once, after which no completion is reported.
                unsafe { sys::ucp_request_free(c.request) };
                Box::leak(c.failure);
            } else {
                left.push(c);
            }
        }
        let reaped = left.len() != before;
        self.closing.borrow_mut().extend(left);
        reaped
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        *self.signal.worker.lock().unwrap_or_else(|e| e.into_inner()) = None;
        for c in self.closing.get_mut().iter() {
            // SAFETY: close requests of this worker, not yet freed; freed once.
            unsafe { sys::ucp_request_free(c.request) };
        }
        // SAFETY: every endpoint and listener holds an `Rc` on this worker, so none is left; no
        // other thread can signal it any more. Once it is destroyed no callback can run, so the
        // failure cells of unfinished closes may go with `closing`.
        unsafe { sys::ucp_worker_destroy(self.raw) }
    }
}

/// Memory mapped for RMA (`ucp_mem_map`): a region's own memory, or memory UCX allocated.
pub(crate) struct MemHandle {
    raw: sys::ucp_mem_h,
    base: *mut u8,
    len: usize,
    /// For a map of a region's own memory, the region: kept alive while mapped. Memory UCX
    /// allocated belongs to the map itself and goes with it.
    _region: Option<RegionHandle>,
    context: Rc<Context>,
}

impl MemHandle {
    pub fn map(context: &Rc<Context>, region: &RegionHandle) -> Result<Self, UcxError> {
        // An empty region still owns a one-byte allocation; UCX refuses empty maps.
        let len = region.len().max(1);
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: region.as_ptr().cast(),
            length: len,
            ..Default::default()
        };
        let mut raw: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the range is the region's own allocation, kept alive by `_region` until the
        // mapping is undone in `drop`.
        check(
            unsafe { sys::ucp_mem_map(context.raw, &params, &mut raw) },
            "ucp_mem_map",
        )?;
        Ok(MemHandle {
            raw,
            base: region.as_ptr(),
            len,
            _region: Some(region.clone()),
            context: context.clone(),
        })
    }

    /// `len` zeroed bytes that UCX allocates and maps: shared memory where the system allows
    /// (sysv/posix), so that peers on the same host put into it with a single copy.
    pub fn allocate(context: &Rc<Context>, len: usize) -> Result<Self, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: ptr::null_mut(),
            length: len.max(1),
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut raw: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: a live context; NULL address with ALLOCATE lets UCX choose where.
        check(
            unsafe { sys::ucp_mem_map(context.raw, &params, &mut raw) },
            "ucp_mem_map",
        )?;
        let mut mem = MemHandle {
            raw,
            base: ptr::null_mut(),
            len: 0,
            _region: None,
            context: context.clone(),
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: a live map; `attr` initialised and writable.
        check(
            unsafe { sys::ucp_mem_query(mem.raw, &mut attr) },
            "ucp_mem_query",
        )?;
        let base = attr.address.cast::<u8>();
        if base.is_null() || attr.length < len || base.align_offset(REGION_ALIGN) != 0 {
            return Err(UcxError {
                call: "ucp_mem_map (allocation is short or misaligned)",
                status: sys::UCS_ERR_NO_MEMORY,
            });
        }
        mem.base = base;
        mem.len = len;
        // Some allocation methods (the heap) hand out dirty memory; regions start zeroed.
        // SAFETY: UCX allocated at least `len` writable bytes there, which nothing uses yet.
        unsafe { ptr::write_bytes(mem.base, 0, len) };
        Ok(mem)
    }

    /// The first byte.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Whether `len` bytes at `ptr` lie inside the mapped memory.
    pub fn covers(&self, ptr: *const u8, len: usize) -> bool {
        let base = self.base as usize;
        let at = ptr as usize;
        at >= base && at.saturating_add(len) <= base + self.len
    }

    /// The remote key peers need to write into the memory, packed for the wire.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live context and map; out-pointers.
        check(
            unsafe { sys::ucp_rkey_pack(self.context.raw, self.raw, &mut buf, &mut len) },
            "ucp_rkey_pack",
        )?;
        // SAFETY: on success UCX hands us `len` readable bytes at `buf`, ours until released.
        let packed = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(packed)
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: mapped on this context, unmapped once. Puts that use this map as their source
        // hold an `Rc` on it until they completed; memory UCX allocated is dropped only once no
        // region uses it (see `UcxWorker::alloc`).
        let status = unsafe { sys::ucp_mem_unmap(self.context.raw, self.raw) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %status_name(status), "ucp_mem_unmap failed");
        }
    }
}
