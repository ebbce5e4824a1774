//! A peer's authenticated connections, each used by one exchange at a time: the parts of the TCP
//! backend, the control exchanges of the UCX backend.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::future::join_all;
use tokio::net::TcpStream;
use tokio::sync::{Mutex, MutexGuard};

use crate::{Incarnation, TransferError};

/// One connection of a [`Pool`], locked for an exchange; `None` while it is to be dialled again.
pub(crate) type Slot<'a> = MutexGuard<'a, Option<TcpStream>>;

pub(crate) struct Pool {
    /// Where the peer listens.
    pub address: String,
    /// The peer's incarnation, learned in the handshake.
    pub incarnation: Incarnation,
    conns: Vec<Mutex<Option<TcpStream>>>,
    next: AtomicUsize,
}

impl Pool {
    /// `n` connections (at least one) to the peer at `address`: `first`, already dialled, and
    /// the others dialled now with `dial`.
    pub(crate) async fn open<F, Fut>(
        address: &str,
        incarnation: Incarnation,
        first: TcpStream,
        n: usize,
        dial: F,
    ) -> Self
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<TcpStream, TransferError>>,
    {
        // The others may fail: a missing one is dialled again when used.
        let rest = join_all((1..n.max(1)).map(|_| dial())).await;
        let mut conns = vec![Mutex::new(Some(first))];
        conns.extend(rest.into_iter().map(|r| Mutex::new(r.ok())));
        Pool {
            address: address.to_owned(),
            incarnation,
            conns,
            next: AtomicUsize::new(0),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.conns.len()
    }

    /// Reserves the next `n` connections in turn; returns the number of the first (any number
    /// names a connection, modulo the pool's size).
    pub(crate) fn take_turns(&self, n: usize) -> usize {
        self.next.fetch_add(n, Ordering::Relaxed)
    }

    /// Locks connection `k` for one exchange and returns it: the pooled stream while it is idle
    /// and open, else a fresh one from `dial`. The stream goes back into the slot only when the
    /// exchange completed in sync.
    pub(crate) async fn checkout<F, Fut>(
        &self,
        k: usize,
        dial: F,
    ) -> Result<(Slot<'_>, TcpStream), TransferError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<TcpStream, TransferError>>,
    {
        let mut slot = self.conns[k % self.conns.len()].lock().await;
        let stream = match slot.take().filter(is_idle_and_open) {
            Some(s) => s,
            None => dial().await?,
        };
        Ok((slot, stream))
    }
}

/// Whether a pooled connection is still usable: an idle connection has nothing to read, so
/// readable data or an end of stream means the peer closed it (it restarted, say) or broke the
/// protocol. Checked before each use, so a retry does not burn its attempts on dead connections.
fn is_idle_and_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}
