//! Endpoints, the remote keys unpacked on them, and batches of puts completed by one flush.

use std::cell::Cell;
use std::ffi::c_void;
use std::mem;
use std::net::SocketAddr;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::region::ExtentRef;

use super::listener::{ConnRequest, RawSockAddr};
use super::{check, Closing, MemHandle, UcxError, Worker};

/// The status an endpoint's error handler recorded (`UCS_OK` while healthy).
pub(super) type FailureCell = Cell<sys::ucs_status_t>;

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
                unsafe { super::super::copy::copy_to_shared(dst, put.src.as_ptr(), put.src.len()) };
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
pub(super) const CLOSE_LIMIT: Duration = Duration::from_secs(10);
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
