//! UCX backend (feature `ucx`): extents move as RMA puts over the system's libucx, so
//! InfiniBand/RoCE between hosts and shared memory within one come from UCX (whatever
//! `UCX_TLS` allows).
//!
//! A worker runs a small TCP control listener (its endpoint, `ucx://HOST:PORT`) and a UCX
//! listener. A peer opens control connections with the TCP backend's handshake (HMAC proof of
//! the cluster secret, incarnations exchanged), learns the UCX listener's port, and creates one
//! UCX endpoint to it. Remote keys never leave the authenticated control connections: a
//! destination hands the key of a region to a sender that proved the secret, when it first
//! writes there. Each batch is one exchange on a control connection (frames in `wire.rs`):
//!
//! 1. `Begin` names the destination extents; the destination checks them and takes exclusive
//!    leases on them (so its owner cannot see half-written pages), then answers `Ready` with the
//!    region's base address and, when the sender lacks it, the packed rkey.
//! 2. The sender puts every extent straight from its source region into the destination region
//!    (`ucp_put_nbx`, or one copy into mapped shared memory; nothing is staged on either side)
//!    and flushes the endpoint, which completes once all landed.
//! 3. `Commit` carries per-extent CRC32Cs when checksums are on; the destination verifies the
//!    landed bytes, records the completion and releases the leases, then acknowledges.
//!
//! Between processes of one host the fast path is shared memory: regions from
//! [`UcxTransport::alloc_region`] are UCX allocations (sysv/posix), which a sender maps through
//! the remote key (`ucp_rkey_ptr`) and fills with one streaming copy (`copy.rs`), made by the
//! sending task itself rather than the progress thread (`mapping.rs`). Puts into memory
//! the caller allocated go through UCX (software emulation between processes of one host in UCX
//! 1.13; RDMA across hosts). A new endpoint is flushed before its first put, so that UCX resolves
//! remote keys against its final transports rather than those of the half-made connection.
//!
//! Deadlines bound everything before the puts. Once puts are posted, the sender's background
//! task always waits for their flush and sends `Commit` (so the destination keeps its leases
//! while bytes may still land), but the caller's `write` returns at its deadline regardless.
//! A broken control connection or UCX endpoint is retried as an I/O error on a fresh connection
//! (and, for the endpoint, a fresh endpoint and fresh remote keys).
//!
//! Limits of RMA: a destination that drops a control connection mid-transfer frees the leases at
//! once (our senders never close one while their puts run). UCX's data path trusts the fabric:
//! the handshake decides who receives remote keys, not what a hostile host on the network can do
//! with UCX directly.

mod api;
mod copy;
mod copy_pool;
mod mapping;
mod server;
pub(crate) mod wire;
mod worker;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::api::UcxError;
use self::mapping::Mapping;
use self::wire::{
    Begin, Commit, DstExtent, Ready, UcxHello, COMMIT_ABORTED, COMMIT_LANDED, FLAG_CHECKSUMS,
    MAX_RKEY, READY,
};
use self::worker::{EpId, PutSource, RkeyId, UcxWorker};
use crate::checksum;
use crate::endpoint::Endpoint;
use crate::incoming::IncomingTable;
use crate::peers::Peers;
use crate::plan::LeasedSource;
use crate::region::RegionTable;
use crate::tcp::pool::Pool;
use crate::tcp::wire::Ack;
use crate::tcp::{self, read_ack, read_ack_message};
use crate::{plan, retry};
use crate::{
    Incarnation, IncomingTransfer, PeerId, RegionDescriptor, RegionHandle, RegionId, TransferError,
    TransferId, TransferReceipt, Transport, TransportConfig, WriteBatch,
};

const SCHEME: &str = "ucx";

/// A registered region's remote access, as handed to senders.
#[derive(Clone)]
struct RegionKey {
    /// Changes with every registration, so a sender knows when its unpacked key is stale.
    generation: u64,
    base: u64,
    packed: Arc<[u8]>,
}

/// What the sending and the receiving halves of one worker share.
struct Node {
    config: TransportConfig,
    regions: RegionTable,
    keys: Mutex<HashMap<RegionId, RegionKey>>,
    incoming: IncomingTable,
    ucx: Arc<UcxWorker>,
    next_generation: AtomicU64,
    attempts: AtomicU64,
}

impl Node {
    fn key(&self, region: RegionId) -> Option<RegionKey> {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&region)
            .cloned()
    }

    /// Whether this batch's extents carry checksums for the destination to verify.
    fn checksums(&self) -> bool {
        self.config.checksums && self.config.rma_checksums
    }
}

/// A remote key this side unpacked for one of the peer's regions.
struct CachedKey {
    generation: u64,
    rkey: RkeyId,
    /// The region mapped into this process (shared memory on this host).
    mapping: Option<Mapping>,
}

/// How a batch reaches the destination region: through UCX, or by a copy into its mapping.
struct Access {
    ep: EpId,
    rkey: RkeyId,
    mapping: Option<Mapping>,
}

/// The UCX endpoint to a peer and the remote keys unpacked on it.
#[derive(Default)]
struct Link {
    ep: Option<EpId>,
    rkeys: HashMap<RegionId, CachedKey>,
}

/// One connected peer: control connections (each used by one batch at a time) and the UCX
/// endpoint its puts go through.
struct Peer {
    control: Pool,
    ucx_addr: SocketAddr,
    link: tokio::sync::Mutex<Link>,
    ucx: Arc<UcxWorker>,
}

impl Peer {
    /// The generation of the peer region's key this side holds (0: none).
    async fn known_generation(&self, region: RegionId) -> u64 {
        let link = self.link.lock().await;
        link.rkeys.get(&region).map_or(0, |k| k.generation)
    }

    /// The endpoint and the remote key to write into `dst`, from `ready` (which carries the
    /// packed key when this side lacks it); connects the endpoint first when there is none.
    async fn access(
        &self,
        dst: &RegionDescriptor,
        ready: &Ready,
        deadline: Instant,
    ) -> Result<Access, TransferError> {
        let region = dst.region_id;
        let mut link = self.link.lock().await;
        let ep = match link.ep {
            Some(ep) => ep,
            None => {
                let ep = tokio::time::timeout_at(deadline, self.ucx.connect(self.ucx_addr))
                    .await
                    .map_err(|_| TransferError::Timeout)?
                    .map_err(io)?;
                link.ep = Some(ep);
                ep
            }
        };
        if let Some(k) = link.rkeys.get(&region) {
            // A concurrent batch may have unpacked this very registration's key already.
            if k.generation == ready.generation {
                return Ok(Access {
                    ep,
                    rkey: k.rkey,
                    mapping: k.mapping.clone(),
                });
            }
        }
        if ready.rkey.is_empty() {
            // Another batch reset the endpoint meanwhile: the next attempt asks for the key.
            return Err(TransferError::protocol(
                "no remote key for the destination region",
            ));
        }
        let (rkey, mapping) = self
            .ucx
            .unpack(ep, ready.rkey.clone(), (ready.base, dst.len))
            .await
            .map_err(io)?;
        let cached = CachedKey {
            generation: ready.generation,
            rkey,
            mapping: mapping.clone(),
        };
        if let Some(old) = link.rkeys.insert(region, cached) {
            // The key of a registration the destination replaced (a batch still about to use it
            // fails its puts with an I/O error and is retried).
            self.ucx.forget_rkey(old.rkey);
        }
        Ok(Access { ep, rkey, mapping })
    }

    /// Drops a broken endpoint (and its keys); the next batch connects afresh.
    async fn reset(&self, ep: EpId) {
        let mut link = self.link.lock().await;
        if link.ep == Some(ep) {
            link.ep = None;
            link.rkeys.clear();
            self.ucx.close(ep);
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(ep) = self.link.get_mut().ep {
            self.ucx.close(ep);
        }
    }
}

/// UCX transport: bind it, publish [`Transport::endpoint`], connect to peers.
pub struct UcxTransport {
    node: Arc<Node>,
    endpoint: String,
    local_addr: SocketAddr,
    peers: Peers<Arc<Peer>>,
    accept: JoinHandle<()>,
}

impl UcxTransport {
    /// Starts UCX (context, worker, listener on `config.bind`'s address) and binds the control
    /// listener (`config.bind`). Needs a tokio runtime.
    pub async fn bind(config: TransportConfig) -> Result<Self, TransferError> {
        let ucx_listen = SocketAddr::new(config.bind.ip(), 0);
        let peer_failure = config.ucx_peer_failure;
        let ucx = tokio::task::spawn_blocking(move || UcxWorker::start(ucx_listen, peer_failure))
            .await
            .map_err(|e| std::io::Error::other(format!("ucx start-up panicked: {e}")))?
            .map_err(|e| TransferError::PeerGone(format!("cannot start UCX: {e}")))?;
        let (listener, endpoint) = tcp::listen(&config, SCHEME)?;
        let local_addr = listener.local_addr()?;
        let node = Arc::new(Node {
            incoming: IncomingTable::new(config.incoming_ttl),
            regions: RegionTable::new(config.incarnation),
            config,
            keys: Mutex::new(HashMap::new()),
            ucx: Arc::new(ucx),
            next_generation: AtomicU64::new(1),
            attempts: AtomicU64::new(0),
        });
        let accept = tokio::spawn(server::accept_loop(node.clone(), listener));
        Ok(UcxTransport {
            node,
            endpoint,
            local_addr,
            peers: Peers::default(),
            accept,
        })
    }

    /// A zeroed region of `len` bytes in memory UCX allocates: shared memory where the system
    /// allows, into which peers on the same host put with a single copy. (Into memory the
    /// caller allocated, UCX 1.13 moves same-host puts by software emulation: the destination's
    /// progress thread copies every byte, at about half the speed.) Register it like any region;
    /// it lives as long as any handle on it.
    pub fn alloc_region(&self, len: usize) -> Result<RegionHandle, TransferError> {
        self.node
            .ucx
            .alloc(len)
            .map_err(|e| TransferError::BadRegion(format!("cannot allocate {len} bytes: {e}")))
    }

    /// Where the control listener is bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where the UCX listener is bound.
    pub fn ucx_addr(&self) -> SocketAddr {
        self.node.ucx.listen_addr()
    }

    /// Runs the transfer in its own task (which finishes what it started even when the caller
    /// stops waiting) and waits for it until `deadline`.
    async fn send(
        &self,
        peer: Arc<Peer>,
        transfer_id: TransferId,
        dst: &RegionDescriptor,
        sources: Vec<LeasedSource>,
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        plan::check_incarnation(dst, peer.control.incarnation)?;
        let task = tokio::spawn(transfer(
            self.node.clone(),
            peer,
            transfer_id,
            dst.clone(),
            sources,
            deadline,
        ));
        match tokio::time::timeout_at(deadline, task).await {
            Err(_) => Err(TransferError::Timeout),
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(std::io::Error::other(format!("transfer task failed: {e}")).into()),
        }
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn io(e: UcxError) -> TransferError {
    TransferError::Io(Arc::new(std::io::Error::other(e.to_string())))
}

/// Opens an authenticated control connection and reads the UCX listener's port.
async fn dial(
    config: &TransportConfig,
    address: &str,
    expected: Option<Incarnation>,
    deadline: Instant,
) -> Result<(TcpStream, Incarnation, u16), TransferError> {
    let (mut stream, incarnation) = tcp::dial(config, address, expected, deadline).await?;
    let limit = deadline.min(Instant::now() + config.handshake_timeout);
    let mut buf = [0u8; UcxHello::LEN];
    match tokio::time::timeout_at(limit, stream.read_exact(&mut buf)).await {
        Ok(r) => {
            r?;
        }
        Err(_) => {
            return Err(TransferError::PeerGone(format!(
                "{address} sent no ucx hello"
            )))
        }
    }
    Ok((stream, incarnation, UcxHello::decode(&buf)?.port))
}

/// What the destination answered to a Begin.
enum Answer {
    Ready(Ready),
    Ack(Ack),
}

async fn read_answer(stream: &mut TcpStream) -> Result<Answer, TransferError> {
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    if magic == READY {
        let mut head = [0u8; Ready::HEAD];
        head[..4].copy_from_slice(&magic);
        stream.read_exact(&mut head[4..]).await?;
        let (mut ready, len) = Ready::decode_head(&head)?;
        ready.rkey = vec![0; len.min(MAX_RKEY)];
        stream.read_exact(&mut ready.rkey).await?;
        return Ok(Answer::Ready(ready));
    }
    let mut head = [0u8; Ack::LEN];
    head[..4].copy_from_slice(&magic);
    stream.read_exact(&mut head[4..]).await?;
    Ok(Answer::Ack(read_ack_message(stream, &head).await?))
}

/// Sends one batch, retrying I/O failures within the deadline.
async fn transfer(
    node: Arc<Node>,
    peer: Arc<Peer>,
    transfer_id: TransferId,
    dst: RegionDescriptor,
    sources: Vec<LeasedSource>,
    deadline: Instant,
) -> Result<TransferReceipt, TransferError> {
    let bytes = sources.iter().map(|s| s.bytes.len() as u64).sum();
    retry::with_retries(
        SCHEME,
        &node.attempts,
        node.config.max_retries,
        transfer_id,
        bytes,
        deadline,
        |attempt| send_attempt(&node, &peer, transfer_id, attempt, &dst, &sources, deadline),
    )
    .await
}

/// One attempt: Begin, puts and flush, Commit, Ack (see the module docs).
async fn send_attempt(
    node: &Node,
    peer: &Peer,
    transfer_id: TransferId,
    attempt: u64,
    dst: &RegionDescriptor,
    sources: &[LeasedSource],
    deadline: Instant,
) -> Result<(), TransferError> {
    let checksums = node.checksums();
    let control = &peer.control;
    let conn = control.take_turns(1);
    // Until the destination answers Ready nothing is in flight: the deadline bounds it all, and
    // dropping the connection half-way is harmless.
    let opening = async {
        let (slot, mut stream) = control
            .checkout(conn, || async {
                let expected = Some(control.incarnation);
                let (stream, _, _) =
                    dial(&node.config, &control.address, expected, deadline).await?;
                Ok(stream)
            })
            .await?;
        let left = deadline.saturating_duration_since(Instant::now());
        let begin = Begin {
            transfer_id,
            attempt,
            dst_region: dst.region_id.0,
            dst_incarnation: dst.incarnation,
            flags: if checksums { FLAG_CHECKSUMS } else { 0 },
            timeout_ms: left.as_millis().clamp(1, u32::MAX as u128) as u32,
            known_generation: peer.known_generation(dst.region_id).await,
            extents: sources
                .iter()
                .map(|s| DstExtent {
                    offset: s.dst_offset,
                    len: s.bytes.len() as u64,
                })
                .collect(),
        };
        stream.write_all(&begin.encode()).await?;
        let answer = read_answer(&mut stream).await?;
        Ok::<_, TransferError>((slot, stream, answer))
    };
    let (mut slot, mut stream, answer) = tokio::time::timeout_at(deadline, opening)
        .await
        .map_err(|_| TransferError::Timeout)??;
    let ready = match answer {
        Answer::Ready(r) => r,
        Answer::Ack(ack) => {
            if ack.transfer_id != transfer_id || ack.attempt != attempt {
                return Err(TransferError::protocol("ack for another transfer"));
            }
            *slot = Some(stream);
            return ack.into_result(dst.incarnation, control.incarnation);
        }
    };
    // The destination now holds leases on the extents until our Commit: always send one.
    let landed = put_extents(node, peer, dst, &ready, sources, deadline).await;
    let commit = Commit {
        transfer_id,
        attempt,
        status: if landed.is_ok() {
            COMMIT_LANDED
        } else {
            COMMIT_ABORTED
        },
        checksums: landed.clone().unwrap_or_default(),
    };
    // The puts are over, so the exchange may be cut short; still, give a late Commit time for
    // its answer so the connection stays reusable.
    let limit = deadline.max(Instant::now() + node.config.handshake_timeout);
    let ack = tokio::time::timeout_at(limit, async {
        stream.write_all(&commit.encode()).await?;
        read_ack(&mut stream).await
    })
    .await
    .map_err(|_| TransferError::Timeout)??;
    if ack.transfer_id != transfer_id || ack.attempt != attempt {
        return Err(TransferError::protocol("ack for another transfer"));
    }
    *slot = Some(stream);
    landed?;
    ack.into_result(dst.incarnation, control.incarnation)
}

/// Puts every extent and waits for the flush; returns the extents' checksums (empty when
/// checksums are off), computed while the puts run. Into a region mapped here, the task copies
/// the extents itself instead (see `mapping.rs`).
async fn put_extents(
    node: &Node,
    peer: &Peer,
    dst: &RegionDescriptor,
    ready: &Ready,
    sources: &[LeasedSource],
    deadline: Instant,
) -> Result<Vec<u32>, TransferError> {
    if Instant::now() >= deadline {
        return Err(TransferError::Timeout);
    }
    let checksums = node.checksums();
    let sums = |sources: &[LeasedSource]| -> Vec<u32> {
        if checksums {
            sources
                .iter()
                .map(|s| checksum::extent_checksum(&s.bytes))
                .collect()
        } else {
            Vec::new()
        }
    };
    if sources.iter().all(|s| s.bytes.is_empty()) {
        return Ok(sums(sources));
    }
    let Access { ep, rkey, mapping } = peer.access(dst, ready, deadline).await?;
    if let Some(mapping) = mapping {
        let puts: Vec<(&[u8], u64)> = sources
            .iter()
            .map(|s| (&s.bytes[..], ready.base + s.dst_offset))
            .collect();
        let bytes: usize = puts.iter().map(|(b, _)| b.len()).sum();
        if let Some(sums) = blocking(bytes, || mapping.copy_all(&puts, checksums)) {
            return Ok(sums);
        }
    }
    let puts = sources
        .iter()
        .map(|s| PutSource {
            src: s.bytes.clone(),
            region: s.region,
            remote_addr: ready.base + s.dst_offset,
        })
        .collect();
    let flushed = node.ucx.put(ep, rkey, puts);
    let sums = sums(sources);
    match flushed.await {
        Ok(()) => Ok(sums),
        Err(e) => {
            if e.is_endpoint_failure() {
                peer.reset(ep).await;
            }
            Err(io(e))
        }
    }
}

/// Copies of at least this many bytes leave the runtime's worker thread to others meanwhile
/// (`block_in_place`); shorter ones (a page plane takes about 100 µs) run inline.
const BLOCKING_COPY: usize = 4 << 20;

/// Runs `copy` (of `bytes` bytes) on this task, handing the worker thread's other tasks to
/// another thread first when it is long and the runtime can.
fn blocking<R>(bytes: usize, copy: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if bytes >= BLOCKING_COPY && multi {
        tokio::task::block_in_place(copy)
    } else {
        copy()
    }
}

#[async_trait]
impl Transport for UcxTransport {
    fn kind(&self) -> &'static str {
        SCHEME
    }

    fn incarnation(&self) -> Incarnation {
        self.node.config.incarnation
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn alloc_region(&self, len: usize) -> Result<RegionHandle, TransferError> {
        UcxTransport::alloc_region(self, len)
    }

    fn register(&self, region: &RegionHandle) -> Result<RegionDescriptor, TransferError> {
        let packed = self.node.ucx.map(region).map_err(|e| {
            TransferError::BadRegion(format!("cannot register {:?} with UCX: {e}", region.id()))
        })?;
        let key = RegionKey {
            generation: self.node.next_generation.fetch_add(1, Ordering::Relaxed),
            base: region.as_ptr() as u64,
            packed: packed.into(),
        };
        self.node
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(region.id(), key);
        Ok(self.node.regions.register(region))
    }

    fn deregister(&self, region: RegionId) -> bool {
        self.node
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&region);
        let known = self.node.regions.remove(region);
        if known {
            self.node.ucx.unmap(region);
        }
        known
    }

    async fn connect(&self, endpoint: &str, deadline: Instant) -> Result<PeerId, TransferError> {
        let ep = Endpoint::parse_for(endpoint, SCHEME)?;
        let config = &self.node.config;
        let (first, incarnation, port) =
            dial(config, &ep.address, ep.incarnation, deadline).await?;
        let ucx_addr = SocketAddr::new(first.peer_addr()?.ip(), port);
        let control = Pool::open(
            &ep.address,
            incarnation,
            first,
            config.connections_per_peer,
            || async {
                let (stream, _, _) = dial(config, &ep.address, Some(incarnation), deadline).await?;
                Ok(stream)
            },
        )
        .await;
        let ucx_ep = tokio::time::timeout_at(deadline, self.node.ucx.connect(ucx_addr))
            .await
            .map_err(|_| TransferError::Timeout)?
            .map_err(|e| {
                TransferError::PeerGone(format!("cannot open a ucx endpoint to {ucx_addr}: {e}"))
            })?;
        Ok(self.peers.add(Arc::new(Peer {
            control,
            ucx_addr,
            link: tokio::sync::Mutex::new(Link {
                ep: Some(ucx_ep),
                rkeys: HashMap::new(),
            }),
            ucx: self.node.ucx.clone(),
        })))
    }

    async fn write(
        &self,
        peer: PeerId,
        batch: WriteBatch,
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        let peer = self.peers.get(peer)?;
        let sources = plan::lease_sources(&self.node.regions, &batch)?;
        let (id, dst) = (batch.transfer_id, &batch.dst_region);
        self.send(peer, id, dst, sources, deadline).await
    }

    /// Copies `bytes` once into a transient region (the puts must own their source); to send
    /// without that copy, register the buffer and use [`Transport::write`].
    async fn write_bytes(
        &self,
        peer: PeerId,
        transfer_id: TransferId,
        dst: &RegionDescriptor,
        dst_offset: u64,
        bytes: &[u8],
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        let peer = self.peers.get(peer)?;
        let source = plan::stage(dst, dst_offset, bytes)?;
        self.send(peer, transfer_id, dst, vec![source], deadline)
            .await
    }

    async fn wait_incoming(
        &self,
        transfer_id: TransferId,
        deadline: Instant,
    ) -> Result<IncomingTransfer, TransferError> {
        self.node.incoming.wait(transfer_id, deadline).await
    }

    fn abandon_incoming(&self, transfer_id: TransferId) {
        self.node.incoming.abandon(transfer_id);
    }
}
