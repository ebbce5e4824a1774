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

use std::cell::{Cell, RefCell};
use std::ffi::{c_void, CStr};
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ptr;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::region::{ExtentRef, RegionHandle, REGION_ALIGN};

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

/// A socket address in the C layout UCX takes.
enum RawSockAddr {
    V4(sys::sockaddr_in),
    V6(sys::sockaddr_in6),
}

impl RawSockAddr {
    fn new(addr: SocketAddr) -> Self {
        match addr {
            SocketAddr::V4(a) => RawSockAddr::V4(sys::sockaddr_in {
                sin_family: sys::AF_INET as sys::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: sys::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                ..Default::default()
            }),
            SocketAddr::V6(a) => {
                // SAFETY: sockaddr_in6 is plain data; all-zero is a valid value.
                let mut raw: sys::sockaddr_in6 = unsafe { mem::zeroed() };
                raw.sin6_family = sys::AF_INET6 as sys::sa_family_t;
                raw.sin6_port = a.port().to_be();
                raw.sin6_flowinfo = a.flowinfo().to_be();
                raw.sin6_addr.__in6_u.__u6_addr8 = a.ip().octets();
                raw.sin6_scope_id = a.scope_id();
                RawSockAddr::V6(raw)
            }
        }
    }

    /// Borrows `self`: valid while `self` is.
    fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        match self {
            RawSockAddr::V4(a) => sys::ucs_sock_addr_t {
                addr: (a as *const sys::sockaddr_in).cast(),
                addrlen: mem::size_of::<sys::sockaddr_in>() as sys::socklen_t,
            },
            RawSockAddr::V6(a) => sys::ucs_sock_addr_t {
                addr: (a as *const sys::sockaddr_in6).cast(),
                addrlen: mem::size_of::<sys::sockaddr_in6>() as sys::socklen_t,
            },
        }
    }

    fn parse(storage: &sys::sockaddr_storage) -> Option<SocketAddr> {
        let family = storage.ss_family as u32;
        if family == sys::AF_INET {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for.
            let a =
                unsafe { &*(storage as *const sys::sockaddr_storage).cast::<sys::sockaddr_in>() };
            let ip = Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
        } else if family == sys::AF_INET6 {
            // SAFETY: as above, for sockaddr_in6.
            let a =
                unsafe { &*(storage as *const sys::sockaddr_storage).cast::<sys::sockaddr_in6>() };
            // SAFETY: every variant of the in6_addr union is the same 16 bytes.
            let ip = Ipv6Addr::from(unsafe { a.sin6_addr.__in6_u.__u6_addr8 });
            Some(SocketAddr::new(IpAddr::V6(ip), u16::from_be(a.sin6_port)))
        } else {
            None
        }
    }
}

/// A connection request a listener received, to accept ([`Endpoint::accept`]) or reject
/// ([`Listener::reject`]).
pub(crate) struct ConnRequest(sys::ucp_conn_request_h);

/// Connection requests the listener's callback recorded, not yet handled.
type ConnQueue = Cell<Vec<sys::ucp_conn_request_h>>;

unsafe extern "C" fn on_conn_request(request: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: `arg` is the listener's queue, which outlives the listener (see `Listener`); this
    // runs on the progress thread inside ucp_worker_progress. Cell operations cannot panic.
    let queue = unsafe { &*(arg as *const ConnQueue) };
    let mut pending = queue.take();
    pending.push(request);
    queue.set(pending);
}

/// A UCP listener: peers create endpoints to its socket address.
pub(crate) struct Listener {
    raw: sys::ucp_listener_h,
    queue: Box<ConnQueue>,
    address: SocketAddr,
    _worker: Rc<Worker>,
}

impl Listener {
    pub fn bind(worker: &Rc<Worker>, addr: SocketAddr) -> Result<Self, UcxError> {
        let queue: Box<ConnQueue> = Box::default();
        let raw_addr = RawSockAddr::new(addr);
        let params = sys::ucp_listener_params_t {
            field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64,
            sockaddr: raw_addr.as_ucs(),
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(on_conn_request),
                arg: (&*queue as *const ConnQueue).cast_mut().cast(),
            },
            ..Default::default()
        };
        let mut raw: sys::ucp_listener_h = ptr::null_mut();
        // SAFETY: a live worker; the address outlives the call (UCX copies it); the queue is
        // boxed (a stable address) and lives as long as the listener.
        check(
            unsafe { sys::ucp_listener_create(worker.raw, &params, &mut raw) },
            "ucp_listener_create",
        )?;
        let mut listener = Listener {
            raw,
            queue,
            address: addr,
            _worker: worker.clone(),
        };
        let mut attr = sys::ucp_listener_attr_t {
            field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64,
            ..Default::default()
        };
        // SAFETY: a live listener; `attr` is initialised and writable.
        check(
            unsafe { sys::ucp_listener_query(listener.raw, &mut attr) },
            "ucp_listener_query",
        )?;
        if let Some(bound) = RawSockAddr::parse(&attr.sockaddr) {
            listener.address = bound;
        }
        Ok(listener)
    }

    /// Where the listener is bound (with the port the system picked).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Connection requests received since the last call.
    pub fn take_requests(&self) -> Vec<ConnRequest> {
        self.queue.take().into_iter().map(ConnRequest).collect()
    }

    pub fn reject(&self, request: ConnRequest) {
        // SAFETY: a request this listener received, handled once.
        let status = unsafe { sys::ucp_listener_reject(self.raw, request.0) };
        if status != sys::UCS_OK {
            tracing::debug!(status = %status_name(status), "ucp_listener_reject failed");
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        for request in self.take_requests() {
            self.reject(request);
        }
        // SAFETY: a live listener, destroyed once; no callback runs after this returns (none
        // runs outside ucp_worker_progress), so the queue may go with `self`.
        unsafe { sys::ucp_listener_destroy(self.raw) }
    }
}

/// The status an endpoint's error handler recorded (`UCS_OK` while healthy).
type FailureCell = Cell<sys::ucs_status_t>;

unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the endpoint's failure cell, which lives until the endpoint is closed;
    // this runs on the progress thread inside ucp_worker_progress.
    unsafe { &*(arg as *const FailureCell) }.set(status);
}

/// A UCP endpoint. Closed on drop (after every remote key unpacked on it, which hold it).
pub(crate) struct Endpoint {
    raw: sys::ucp_ep_h,
    /// Peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`): errors are reported here rather
    /// than being fatal, and closing may force.
    peer_failure: bool,
    /// Written by the error handler; handed to the worker's close list on drop.
    failure: Option<Box<FailureCell>>,
    worker: Rc<Worker>,
}

impl Endpoint {
    /// Starts connecting to a listener at `addr`; puts posted before the connection is up wait
    /// inside UCX.
    pub fn connect(
        worker: &Rc<Worker>,
        addr: SocketAddr,
        peer_failure: bool,
    ) -> Result<Rc<Self>, UcxError> {
        let raw_addr = RawSockAddr::new(addr);
        Self::create(worker, peer_failure, |p| {
            p.field_mask |=
                (sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR) as u64;
            p.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
            p.sockaddr = raw_addr.as_ucs();
        })
    }

    /// The server side of a connection a listener received.
    pub fn accept(
        worker: &Rc<Worker>,
        request: ConnRequest,
        peer_failure: bool,
    ) -> Result<Rc<Self>, UcxError> {
        Self::create(worker, peer_failure, |p| {
            p.field_mask |= sys::UCP_EP_PARAM_FIELD_CONN_REQUEST as u64;
            p.conn_request = request.0;
        })
    }

    fn create(
        worker: &Rc<Worker>,
        peer_failure: bool,
        fill: impl FnOnce(&mut sys::ucp_ep_params_t),
    ) -> Result<Rc<Self>, UcxError> {
        let failure: Box<FailureCell> = Box::new(Cell::new(sys::UCS_OK));
        let mut params = sys::ucp_ep_params_t {
            field_mask: sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as u64,
            err_mode: if peer_failure {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        if peer_failure {
            params.field_mask |= sys::UCP_EP_PARAM_FIELD_ERR_HANDLER as u64;
            params.err_handler = sys::ucp_err_handler_t {
                cb: Some(on_endpoint_error),
                arg: (&*failure as *const FailureCell).cast_mut().cast(),
            };
        }
        fill(&mut params);
        let mut raw: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: a live worker; params initialised, its mask naming exactly the fields set (the
        // address `fill` stored outlives this call); the failure cell is boxed and lives until
        // the endpoint is closed.
        check(
            unsafe { sys::ucp_ep_create(worker.raw, &params, &mut raw) },
            "ucp_ep_create",
        )?;
        Ok(Rc::new(Endpoint {
            raw,
            peer_failure,
            failure: Some(failure),
            worker: worker.clone(),
        }))
    }

    /// Why the endpoint broke, if its error handler fired.
    pub fn failure(&self) -> Option<UcxError> {
        let status = self.failure.as_ref().map_or(sys::UCS_OK, |f| f.get());
        (status != sys::UCS_OK).then_some(UcxError {
            call: "endpoint",
            status,
        })
    }

    pub fn unpack_rkey(self: &Rc<Self>, packed: &[u8]) -> Result<Rc<Rkey>, UcxError> {
        let mut raw: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: a live endpoint; UCX reads the packed key (a peer's ucp_rkey_pack output,
        // validated by UCX) and writes `raw`.
        check(
            unsafe { sys::ucp_ep_rkey_unpack(self.raw, packed.as_ptr().cast(), &mut raw) },
            "ucp_ep_rkey_unpack",
        )?;
        Ok(Rc::new(Rkey {
            raw,
            _endpoint: self.clone(),
        }))
    }

    /// Posts one put per source (empty ones skipped) through `rkey`, then a flush of the
    /// endpoint, which completes once every put landed at the peer. The returned [`Flush`]
    /// owns the sources (so their leases, and their memory, outlive the puts) and the key.
    ///
    /// Where the peer's memory is shared memory mapped to us (`ucp_rkey_ptr`), the put is our
    /// own copy (see [`super::copy`]), done before this returns.
    pub fn put_all(self: &Rc<Self>, rkey: &Rc<Rkey>, puts: Vec<Put>) -> Flush {
        let mut failed: Option<UcxError> = None;
        for put in &puts {
            if put.src.is_empty() {
                continue;
            }
            if let Some(dst) = rkey.local_range(put.remote_addr, put.src.len()) {
                // SAFETY: `dst` maps the peer's `len` bytes at `remote_addr` (see `local_range`),
                // which stay mapped while `rkey` lives; the source is a live lease of the same
                // length in our own memory, so the ranges cannot overlap.
                unsafe { super::copy::copy_to_shared(dst, put.src.as_ptr(), put.src.len()) };
                continue;
            }
            let mut param = sys::ucp_request_param_t::default();
            if let Some(memh) = &put.memh {
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
                param.memh = memh.raw;
            }
            // SAFETY: the source is a shared lease on live memory, which the returned flush
            // keeps until UCX no longer reads it; `memh`, when given, maps that memory (checked
            // by the caller with `MemHandle::covers`); `rkey` was unpacked on this endpoint.
            let r = unsafe {
                sys::ucp_put_nbx(
                    self.raw,
                    put.src.as_ptr().cast(),
                    put.src.len(),
                    put.remote_addr,
                    rkey.raw,
                    &param,
                )
            };
            if sys::ucs_ptr_is_ptr(r) {
                // Completion is observed through the flush below; the request itself is not
                // needed (freeing it lets the put finish unobserved).
                // SAFETY: a request just returned, freed once.
                unsafe { sys::ucp_request_free(r) };
            } else if sys::ucs_ptr_is_err(r) {
                failed = Some(UcxError {
                    call: "ucp_put_nbx",
                    status: sys::ucs_ptr_status(r),
                });
                break;
            }
        }
        // Flush even after a failed put: the ones posted before it must finish before their
        // sources may go.
        self.start_flush(Some(rkey.clone()), puts, failed)
    }

    /// A flush of the endpoint alone: it completes once the endpoint is wired up to the peer
    /// (and every earlier operation completed), so puts posted after it use the final lanes.
    pub fn flush(self: &Rc<Self>) -> Flush {
        self.start_flush(None, Vec::new(), None)
    }

    fn start_flush(
        self: &Rc<Self>,
        rkey: Option<Rc<Rkey>>,
        puts: Vec<Put>,
        failed: Option<UcxError>,
    ) -> Flush {
        let done: Box<DoneCell> = Box::new(Cell::new(None));
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            cb: sys::ucp_request_param_t__bindgen_ty_1 {
                send: Some(on_flushed),
            },
            user_data: (&*done as *const DoneCell).cast_mut().cast(),
            ..Default::default()
        };
        // SAFETY: a live endpoint; the callback's cell is boxed and owned by the returned flush,
        // which frees it only after the callback ran or the request was freed.
        let r = unsafe { sys::ucp_ep_flush_nbx(self.raw, &param) };
        let request = if sys::ucs_ptr_is_ptr(r) {
            r
        } else {
            done.set(Some(sys::ucs_ptr_status(r)));
            ptr::null_mut()
        };
        Flush {
            request,
            done,
            failed,
            puts,
            rkey,
            endpoint: self.clone(),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Forcing is only defined when both sides handle peer failure; otherwise close with a
        // flush, which the worker gives a bounded time (a dead peer never answers).
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if self.peer_failure || self.failure().is_some() {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: a live endpoint with no remote key left (each holds an `Rc` on it), closed
        // once.
        let r = unsafe { sys::ucp_ep_close_nbx(self.raw, &param) };
        let Some(failure) = self.failure.take() else {
            return;
        };
        if sys::ucs_ptr_is_ptr(r) {
            // The worker finishes the close; the failure cell stays alive until then.
            self.worker.closing.borrow_mut().push(Closing {
                request: r,
                failure,
                since: Instant::now(),
            });
        }
    }
}

/// How long an endpoint close may run before the worker stops waiting for it.
const CLOSE_LIMIT: Duration = Duration::from_secs(10);
/// How long dropping an unfinished flush waits for it before leaking what it holds.
const FLUSH_DROP_LIMIT: Duration = Duration::from_secs(5);

/// A peer's remote key, unpacked on one endpoint (which it keeps open).
pub(crate) struct Rkey {
    raw: sys::ucp_rkey_h,
    _endpoint: Rc<Endpoint>,
}

impl Rkey {
    /// Where `len` bytes at the peer's `remote_addr` are mapped into our address space, when the
    /// key describes shared memory reachable that way.
    ///
    /// For shared memory UCX computes the local address by offset alone, without bounds: the
    /// range must lie inside the peer's mapped memory. Callers pass only ranges the destination
    /// itself checked against the region behind the key (it answered Ready for exactly those
    /// extents), trusting the authenticated peer as UCX's own puts do.
    pub(crate) fn local_range(&self, remote_addr: u64, len: usize) -> Option<*mut u8> {
        let at = |addr: u64| -> Option<usize> {
            let mut p: *mut c_void = ptr::null_mut();
            // SAFETY: a live key; `p` is an out-pointer.
            let status = unsafe { sys::ucp_rkey_ptr(self.raw, addr, &mut p) };
            (status == sys::UCS_OK && !p.is_null()).then_some(p as usize)
        };
        let last = remote_addr.checked_add(len.checked_sub(1)? as u64)?;
        let first = at(remote_addr)?;
        // One mapping covers the range: its last byte lies where contiguity says.
        (at(last)? == first + (len - 1)).then_some(first as *mut u8)
    }
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: unpacked in `unpack_rkey`, destroyed once, before its endpoint (held by
        // `_endpoint`, dropped after this); flushes using it hold an `Rc` until they completed.
        unsafe { sys::ucp_rkey_destroy(self.raw) }
    }
}

/// One put: the bytes of a source lease to `remote_addr` of the peer's mapped region.
pub(crate) struct Put {
    pub src: Arc<ExtentRef>,
    pub remote_addr: u64,
    /// The map of the memory the source lies in, when it has one.
    pub memh: Option<Rc<MemHandle>>,
}

/// What the flush callback recorded: the flush's status once it completed.
type DoneCell = Cell<Option<sys::ucs_status_t>>;

unsafe extern "C" fn on_flushed(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the flush's done cell, alive until the request completed or was
    // freed; this runs on the progress thread inside ucp_worker_progress.
    unsafe { &*(user_data as *const DoneCell) }.set(Some(status));
}

/// An endpoint flush and the puts it completes (see [`Endpoint::put_all`]). Fields drop in
/// order: the sources, the remote key, then the endpoint.
pub(crate) struct Flush {
    /// The flush request while it runs; null once completed and freed (or done at once).
    request: sys::ucs_status_ptr_t,
    done: Box<DoneCell>,
    failed: Option<UcxError>,
    puts: Vec<Put>,
    rkey: Option<Rc<Rkey>>,
    endpoint: Rc<Endpoint>,
}

impl Flush {
    /// The outcome once every put completed at the peer (or failed); `None` while running.
    pub fn poll(&mut self) -> Option<Result<(), UcxError>> {
        let status = self.done.get()?;
        if !self.request.is_null() {
            // SAFETY: the flush request, completed (its callback ran), freed once.
            unsafe { sys::ucp_request_free(self.request) };
            self.request = ptr::null_mut();
        }
        if let Some(e) = &self.failed {
            return Some(Err(e.clone()));
        }
        Some(check(status, "ucp_ep_flush_nbx"))
    }
}

impl Flush {
    /// Stops waiting: no completion will be reported. What the puts may still touch (sources,
    /// key, endpoint) is kept alive for good unless there were none.
    pub fn cancel(mut self) {
        if self.done.get().is_some() {
            let _ = self.poll();
            return;
        }
        // SAFETY: the running flush request, freed once; no callback fires after this.
        unsafe { sys::ucp_request_free(self.request) };
        self.request = ptr::null_mut();
        self.done.set(Some(sys::UCS_ERR_CANCELED));
        if self.puts.iter().any(|p| !p.src.is_empty()) {
            mem::forget(mem::take(&mut self.puts));
            mem::forget(self.rkey.clone());
            mem::forget(self.endpoint.clone());
        }
    }
}

impl Drop for Flush {
    fn drop(&mut self) {
        let start = Instant::now();
        while self.done.get().is_none() && start.elapsed() < FLUSH_DROP_LIMIT {
            self.endpoint.worker.progress();
        }
        if self.done.get().is_some() {
            let _ = self.poll();
            return;
        }
        // Still running: stop the callback (so the cell may go), and keep everything the puts
        // may still touch alive for good: the source leases and maps, the remote key and, through
        // it, the endpoint, worker and context. A leak, never a use after free.
        tracing::warn!("ucx flush still running at shutdown; leaking its buffers");
        // SAFETY: the running flush request, freed once; no callback fires after this.
        unsafe { sys::ucp_request_free(self.request) };
        self.request = ptr::null_mut();
        mem::forget(mem::take(&mut self.puts));
        mem::forget(self.rkey.clone());
        mem::forget(self.endpoint.clone());
    }
}
