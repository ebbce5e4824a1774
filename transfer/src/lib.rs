//! Moving KV pages and embeddings between workers.
//!
//! A worker registers host memory regions (its page arena, embedding buffers) with a
//! [`Transport`], hands the resulting [`RegionDescriptor`]s to its peers once, and peers then
//! write batches of byte extents straight into those regions. Each batch ends in exactly one
//! completion notice at the destination ([`Transport::wait_incoming`]) and one
//! [`TransferReceipt`] at the source. The layer is family-agnostic: it moves byte extents of
//! regions, never "MLA" or "KDA"; the page pool maps `(src page, dst page)` pairs of every plane to
//! extents.
//!
//! Backends: [`local`] (same process, memcpy), [`tcp`] (tokio, the default between processes)
//! and, with the `ucx` feature, `ucx` (RMA puts over the system's libucx: InfiniBand/RoCE and
//! shared memory come from UCX).
//!
//! Guarantees every backend keeps:
//! - every extent carries a CRC32C of its bytes that the receiver verifies before it
//!   acknowledges (unless the sender's [`TransportConfig::checksums`] is off; for `ucx`, also
//!   [`TransportConfig::rma_checksums`]);
//! - a peer proves knowledge of the shared secret and both sides exchange incarnations in the
//!   handshake; a write whose destination descriptor names another incarnation is refused;
//! - nothing outlives its deadline; only [`TransferError::Io`] is retried, at most
//!   [`TransportConfig::max_retries`] times.

pub mod auth;
pub mod checksum;
pub mod endpoint;
pub mod error;
pub mod faults;
mod incoming;
pub mod local;
mod peers;
mod plan;
pub mod region;
mod retry;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
pub use tokio::time::Instant;

pub use auth::Secret;
pub use endpoint::Endpoint;
pub use error::TransferError;
pub use faults::FaultInjection;
pub use local::LocalTransport;
pub use region::{
    ExtentMut, ExtentRef, Incarnation, RegionDescriptor, RegionError, RegionHandle, RegionId,
};
pub use tcp::TcpTransport;
#[cfg(feature = "ucx")]
pub use ucx::UcxTransport;

/// A connected peer, local to the transport that connected it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// Names one batch end to end: the sender chooses it, the destination waits on it. Unique among
/// the transfers a destination has in flight (the serving layer derives it from the request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferId(pub u64);

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One run of bytes: `len` bytes at `src_offset` of the local registered region `src_region`
/// land at `dst_offset` of the batch's destination region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub src_region: RegionId,
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// Extents into one destination region, completed as one transfer.
#[derive(Clone, Debug)]
pub struct WriteBatch {
    pub transfer_id: TransferId,
    pub dst_region: RegionDescriptor,
    pub extents: Vec<Extent>,
}

/// What the source learns when a batch is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferReceipt {
    pub bytes: u64,
    pub elapsed: Duration,
    /// 1 when the first try succeeded.
    pub attempts: u32,
}

/// What the destination learns when a transfer into it completed and verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IncomingTransfer {
    pub transfer_id: TransferId,
    pub bytes: u64,
    pub extents: u32,
    /// The sending worker's incarnation.
    pub from: Incarnation,
}

/// Settings shared by every backend (backends ignore what does not apply to them).
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// This worker's life; peers' descriptors and handshakes must name it.
    pub incarnation: Incarnation,
    /// Shared by every worker of the cluster; a peer that cannot prove it is refused.
    pub secret: Secret,
    /// Retries of a batch after an I/O error (broken connection), within its deadline.
    pub max_retries: u32,
    /// Send a CRC32C with every extent (the receiver verifies whatever checksums it is sent).
    pub checksums: bool,
    /// TCP: connections opened to each peer; a batch is spread over them. UCX: control
    /// connections per peer, so as many batches can be in flight to it at once.
    pub connections_per_peer: usize,
    /// TCP: `SO_SNDBUF`/`SO_RCVBUF` in bytes; `None` (the default) keeps the kernel's
    /// autotuning, which suits any bandwidth-delay product. 1 MiB measured ~10% faster on
    /// bare-metal loopback, slower in a small VM (more flow-control wake-ups).
    pub socket_buffer_bytes: Option<u32>,
    /// TCP and UCX: where the (control) listener binds; UCX's own listener takes the same IP.
    pub bind: SocketAddr,
    /// TCP: host name or address peers use to reach the listener (default: the bound IP).
    pub advertise_host: Option<String>,
    /// UCX: verify the per-extent checksums too (with `checksums` on). It costs a pass over
    /// every byte on each side, which an RMA data path otherwise never makes, while UCX's
    /// transports already protect data in flight; so the default is on in debug builds (tests)
    /// and off in release builds.
    pub rma_checksums: bool,
    /// UCX: peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`) on every endpoint, so that a
    /// dead peer fails UCX operations instead of stalling them. UCX 1.13 then uses only
    /// transports that detect peer failure (tcp, InfiniBand), not shared memory, so the default
    /// is off, which keeps the fast same-host path (a dead peer is still noticed through the
    /// control connection).
    pub ucx_peer_failure: bool,
    /// Longest a handshake may take when the caller's deadline is later.
    pub handshake_timeout: Duration,
    /// How long finished or abandoned incoming transfers are remembered (to answer late waits and
    /// refuse late parts).
    pub incoming_ttl: Duration,
    /// Test hooks; inert unless armed.
    pub faults: Arc<FaultInjection>,
}

impl TransportConfig {
    /// Defaults with a fresh random incarnation and the given cluster secret.
    pub fn new(secret: Secret) -> Self {
        TransportConfig {
            incarnation: Incarnation::random(),
            secret,
            max_retries: 2,
            checksums: true,
            connections_per_peer: 4,
            socket_buffer_bytes: None,
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_host: None,
            rma_checksums: cfg!(debug_assertions),
            ucx_peer_failure: false,
            handshake_timeout: Duration::from_secs(5),
            incoming_ttl: Duration::from_secs(120),
            faults: Arc::new(FaultInjection::default()),
        }
    }
}

/// Moves extents of registered regions to peers. See the crate docs for the guarantees.
#[async_trait]
pub trait Transport: Send + Sync {
    /// The backend's name (`local`, `tcp`, ...).
    fn kind(&self) -> &'static str;

    fn incarnation(&self) -> Incarnation;

    /// How peers reach this transport: pass it to their [`Transport::connect`]. It names this
    /// incarnation, so a connect made from a stale endpoint fails after a restart.
    fn endpoint(&self) -> String;

    /// A zeroed region of `len` bytes in the memory this backend moves best (register it like
    /// any region). The default is plain heap memory; `ucx` allocates through UCX, so that peers
    /// on the same host put into it with a single copy.
    fn alloc_region(&self, len: usize) -> Result<RegionHandle, TransferError> {
        Ok(RegionHandle::new(len))
    }

    /// Makes `region` readable as a source and writable by peers as a destination; the
    /// descriptor is what peers name in their batches. The transport keeps the region alive
    /// until [`Transport::deregister`].
    fn register(&self, region: &RegionHandle) -> Result<RegionDescriptor, TransferError>;

    /// Stops accepting writes into the region and using it as a source; false when unknown.
    fn deregister(&self, region: RegionId) -> bool;

    /// Connects and authenticates to the peer at `endpoint`.
    async fn connect(&self, endpoint: &str, deadline: Instant) -> Result<PeerId, TransferError>;

    /// Writes every extent of `batch` into the peer's region; returns once the peer verified
    /// all of them and recorded the transfer's completion.
    async fn write(
        &self,
        peer: PeerId,
        batch: WriteBatch,
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError>;

    /// Writes `bytes` (an embedding, say) at `dst_offset` of `dst`, through the same path as
    /// [`Transport::write`]; the source need not be registered.
    async fn write_bytes(
        &self,
        peer: PeerId,
        transfer_id: TransferId,
        dst: &RegionDescriptor,
        dst_offset: u64,
        bytes: &[u8],
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError>;

    /// Waits until transfer `transfer_id` into this transport's regions completed and verified.
    /// A checksum failure is reported at once; at the deadline the transfer is abandoned (late
    /// bytes for it are refused and its destination extents freed) and `Timeout` returned.
    async fn wait_incoming(
        &self,
        transfer_id: TransferId,
        deadline: Instant,
    ) -> Result<IncomingTransfer, TransferError>;

    /// Gives up on an incoming transfer (the request was cancelled): later bytes for it are
    /// refused and its destination extents released.
    fn abandon_incoming(&self, transfer_id: TransferId);
}
