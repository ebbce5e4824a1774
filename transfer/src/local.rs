//! Same-process backend: a write is a memcpy from the source region into the peer transport's
//! destination region, through the same leases, checksums, incarnation checks and completion
//! notices as the networked backends. For tests and single-process serving.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use async_trait::async_trait;
use tokio::time::Instant;

use crate::checksum::{self, STREAM_CHUNK};
use crate::endpoint::Endpoint;
use crate::incoming::{IncomingTable, PartStart};
use crate::peers::Peers;
use crate::plan::{self, Source};
use crate::region::{RegionTable, REGION_ALIGN};
use crate::{
    Incarnation, IncomingTransfer, PeerId, RegionDescriptor, RegionHandle, RegionId, TransferError,
    TransferId, TransferReceipt, Transport, TransportConfig, WriteBatch,
};

const SCHEME: &str = "local";

struct Shared {
    id: u64,
    config: TransportConfig,
    regions: RegionTable,
    incoming: IncomingTable,
}

type Registry = Mutex<HashMap<u64, Weak<Shared>>>;

/// The process's live local transports, by endpoint number.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// In-process transport; peers are other `LocalTransport`s of the same process.
pub struct LocalTransport {
    shared: Arc<Shared>,
    peers: Peers<Weak<Shared>>,
    attempts: AtomicU64,
}

impl LocalTransport {
    pub fn new(config: TransportConfig) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(Shared {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            incoming: IncomingTable::new(config.incoming_ttl),
            regions: RegionTable::new(config.incarnation),
            config,
        });
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shared.id, Arc::downgrade(&shared));
        LocalTransport {
            shared,
            peers: Peers::default(),
            attempts: AtomicU64::new(0),
        }
    }

    fn peer(&self, peer: PeerId) -> Result<Arc<Shared>, TransferError> {
        self.peers.find(peer, Weak::upgrade)
    }

    /// Copies `sources` into the target's region as one transfer.
    fn deliver(
        &self,
        target: &Shared,
        transfer_id: TransferId,
        dst: &RegionDescriptor,
        sources: &[Source<'_>],
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        let start = Instant::now();
        let region = target.regions.get(dst.region_id).ok_or_else(|| {
            TransferError::BadRegion(format!("{:?} is not registered", dst.region_id))
        })?;
        let extents = sources.len() as u32;
        let attempt = self.attempts.fetch_add(1, Ordering::Relaxed) + 1;
        let from = self.shared.config.incarnation;
        let bytes: u64 = sources.iter().map(|s| s.bytes.len() as u64).sum();
        let receipt = TransferReceipt {
            bytes,
            elapsed: start.elapsed(),
            attempts: 1,
        };
        match target
            .incoming
            .begin_part(transfer_id, attempt, extents, from)
        {
            PartStart::Proceed => {}
            PartStart::AlreadyComplete => return Ok(receipt),
            PartStart::Refuse(e) => return Err(e),
        }
        let mut leases = Vec::with_capacity(sources.len());
        for s in sources {
            if Instant::now() >= deadline {
                return Err(TransferError::Timeout);
            }
            let at = s.dst_offset as usize;
            let mut lease = match region.try_write(at..at + s.bytes.len()) {
                Ok(lease) => lease,
                Err(e) => {
                    let e = TransferError::from(e);
                    target.incoming.fail(transfer_id, attempt, e.clone());
                    return Err(e);
                }
            };
            let corrupt = !lease.is_empty() && target.config.faults.take_corruption();
            let (mut sent, mut landed) = (0, 0);
            // Chunk by chunk, so both checksums read cached bytes.
            let chunks = s
                .bytes
                .chunks(STREAM_CHUNK)
                .zip(lease.chunks_mut(STREAM_CHUNK));
            for (k, (from, to)) in chunks.enumerate() {
                to.copy_from_slice(from);
                if corrupt && k == 0 {
                    to[0] ^= 0x5a;
                }
                if self.shared.config.checksums {
                    sent = checksum::extend(sent, from);
                    landed = checksum::extend(landed, to);
                }
            }
            if sent != landed {
                let err = TransferError::ChecksumMismatch { extent: s.index };
                target.incoming.fail(transfer_id, attempt, err.clone());
                return Err(err);
            }
            leases.push(lease);
        }
        target
            .incoming
            .finish_part(transfer_id, attempt, extents, bytes, leases)?;
        Ok(TransferReceipt {
            elapsed: start.elapsed(),
            ..receipt
        })
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.shared.id);
    }
}

#[async_trait]
impl Transport for LocalTransport {
    fn kind(&self) -> &'static str {
        SCHEME
    }

    fn incarnation(&self) -> Incarnation {
        self.shared.config.incarnation
    }

    fn endpoint(&self) -> String {
        Endpoint {
            scheme: SCHEME.into(),
            address: self.shared.id.to_string(),
            incarnation: Some(self.shared.config.incarnation),
        }
        .to_string()
    }

    fn register(&self, region: &RegionHandle) -> Result<RegionDescriptor, TransferError> {
        debug_assert_eq!(region.as_ptr() as usize % REGION_ALIGN, 0);
        Ok(self.shared.regions.register(region))
    }

    fn deregister(&self, region: RegionId) -> bool {
        self.shared.regions.remove(region)
    }

    async fn connect(&self, endpoint: &str, _deadline: Instant) -> Result<PeerId, TransferError> {
        let ep = Endpoint::parse_for(endpoint, SCHEME)?;
        let id: u64 = ep
            .address
            .parse()
            .map_err(|_| TransferError::PeerGone(format!("malformed endpoint {endpoint:?}")))?;
        let target = registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .and_then(Weak::upgrade)
            .ok_or_else(|| TransferError::PeerGone(format!("nothing listens at {endpoint:?}")))?;
        if target.config.secret != self.shared.config.secret {
            return Err(TransferError::Auth("the peer holds another secret".into()));
        }
        if let Some(expected) = ep.incarnation {
            if expected != target.config.incarnation {
                return Err(TransferError::IncarnationMismatch {
                    expected,
                    found: target.config.incarnation,
                });
            }
        }
        Ok(self.peers.add(Arc::downgrade(&target)))
    }

    async fn write(
        &self,
        peer: PeerId,
        batch: WriteBatch,
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        let target = self.peer(peer)?;
        plan::check_incarnation(&batch.dst_region, target.config.incarnation)?;
        let leases = plan::lease_sources(&self.shared.regions, &batch)?;
        let sources: Vec<Source<'_>> = leases
            .iter()
            .map(|l| Source {
                index: l.index,
                bytes: &l.bytes,
                dst_offset: l.dst_offset,
            })
            .collect();
        self.deliver(
            &target,
            batch.transfer_id,
            &batch.dst_region,
            &sources,
            deadline,
        )
    }

    async fn write_bytes(
        &self,
        peer: PeerId,
        transfer_id: TransferId,
        dst: &RegionDescriptor,
        dst_offset: u64,
        bytes: &[u8],
        deadline: Instant,
    ) -> Result<TransferReceipt, TransferError> {
        let target = self.peer(peer)?;
        plan::check_incarnation(dst, target.config.incarnation)?;
        plan::check_dst(dst.len, dst_offset, bytes.len() as u64, 0)?;
        let source = Source {
            index: 0,
            bytes,
            dst_offset,
        };
        self.deliver(&target, transfer_id, dst, &[source], deadline)
    }

    async fn wait_incoming(
        &self,
        transfer_id: TransferId,
        deadline: Instant,
    ) -> Result<IncomingTransfer, TransferError> {
        self.shared.incoming.wait(transfer_id, deadline).await
    }

    fn abandon_incoming(&self, transfer_id: TransferId) {
        self.shared.incoming.abandon(transfer_id);
    }
}
