//! Socket addresses in UCX's layout and the listener that peers connect to.

use std::cell::Cell;
use std::ffi::c_void;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ptr;
use std::rc::Rc;

use ucx_sys as sys;

use super::{check, status_name, UcxError, Worker};

/// A socket address in the C layout UCX takes.
pub(super) enum RawSockAddr {
    V4(sys::sockaddr_in),
    V6(sys::sockaddr_in6),
}

impl RawSockAddr {
    pub(super) fn new(addr: SocketAddr) -> Self {
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
    pub(super) fn as_ucs(&self) -> sys::ucs_sock_addr_t {
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
pub(crate) struct ConnRequest(pub(super) sys::ucp_conn_request_h);

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
