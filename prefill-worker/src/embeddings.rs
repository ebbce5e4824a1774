//! Image embeddings waiting for their prefill (DESIGN §4 step 2). An encoder reserves a buffer
//! here (`ReserveEmbeddings`), writes the image's rows into it over the transfer layer, and the
//! `Prefill` of the same request takes them and splices them at the image's placeholders.
//!
//! Every buffer is its own registered region of the worker's transport, so a buffer is freed
//! by deregistering it: when a prefill takes it, when `Cancel` names its request, when the
//! prefill that should take it fails, or when its TTL passes (an encoder or router that died
//! between the two calls). Nothing else holds embedding memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_engine::vision::ImageEmbedding;
use tessera_proto::tonic::Status;
use tessera_proto::v1;
use tessera_transfer::{RegionDescriptor, RegionHandle, TransferId, Transport};

/// How long a buffer waits for its prefill when the encoder names no TTL.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// Bytes of embeddings held at once, at most; more reservations are refused (RESOURCE_EXHAUSTED).
pub const MAX_HELD_BYTES: usize = 1 << 30;

fn err(code: v1::ErrorCode, msg: impl Into<String>) -> Status {
    v1::ErrorDetail::new(code, msg).into_status()
}

/// One reserved buffer.
struct Held {
    request_id: String,
    region: RegionHandle,
    desc: RegionDescriptor,
    transfer_id: TransferId,
    n_tokens: usize,
    hidden: usize,
    content_hash: [u8; 32],
    expires: Instant,
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct EmbeddingCounters {
    pub reserved: AtomicU64,
    pub consumed: AtomicU64,
    pub released: AtomicU64,
    pub expired: AtomicU64,
}

/// The embedding buffers of one prefill worker.
pub struct EmbeddingStore {
    transport: Arc<dyn Transport>,
    worker_id: String,
    incarnation: u64,
    held: Mutex<HashMap<String, Held>>,
    next: AtomicU64,
    pub counters: EmbeddingCounters,
}

impl EmbeddingStore {
    pub fn new(transport: Arc<dyn Transport>, info: &v1::WorkerInfo) -> Self {
        EmbeddingStore {
            transport,
            worker_id: info.worker_id.clone(),
            incarnation: info.incarnation_id,
            held: Mutex::default(),
            next: AtomicU64::new(1),
            counters: EmbeddingCounters::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Buffers held now and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let held = self.lock();
        (held.len(), held.values().map(|h| h.region.len()).sum())
    }

    /// Reserves and registers a buffer for one image's embeddings.
    pub fn reserve(
        &self,
        req: &v1::ReserveEmbeddingsRequest,
    ) -> Result<v1::ReserveEmbeddingsReply, Status> {
        let invalid = |m: String| err(v1::ErrorCode::InvalidArgument, m);
        if req.dtype != v1::Dtype::F32 as i32 {
            return Err(invalid("only f32 embeddings are supported".into()));
        }
        if req.n_tokens == 0 || req.hidden == 0 {
            return Err(invalid(format!(
                "an embedding of {}x{} values is empty",
                req.n_tokens, req.hidden
            )));
        }
        let content_hash: [u8; 32] = req.content_hash.as_slice().try_into().map_err(|_| {
            invalid(format!(
                "content_hash has {} bytes, a SHA-256 has 32",
                req.content_hash.len()
            ))
        })?;
        let bytes = (req.n_tokens as usize)
            .checked_mul(req.hidden as usize)
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= MAX_HELD_BYTES)
            .ok_or_else(|| invalid("the embedding is larger than this worker holds".into()))?;
        let ttl = match req.ttl_ms {
            0 => DEFAULT_TTL,
            ms => Duration::from_millis(ms.into()),
        };
        let mut held = self.lock();
        let in_use: usize = held.values().map(|h| h.region.len()).sum();
        if in_use + bytes > MAX_HELD_BYTES {
            return Err(v1::ErrorDetail {
                retryable: true,
                ..v1::ErrorDetail::new(
                    v1::ErrorCode::Overloaded,
                    format!("{in_use} bytes of image embeddings are already held"),
                )
            }
            .into_status());
        }
        let failed = |e: tessera_transfer::TransferError| {
            err(
                v1::ErrorCode::TransferFailed,
                format!("embedding buffer: {e}"),
            )
        };
        let region = self.transport.alloc_region(bytes).map_err(failed)?;
        let desc = self.transport.register(&region).map_err(failed)?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let handle_id = format!("emb-{n}");
        let reply = v1::ReserveEmbeddingsReply {
            handle: Some(v1::EmbeddingHandle {
                handle_id: handle_id.clone(),
                n_tokens: req.n_tokens,
                hidden: req.hidden,
                dtype: v1::Dtype::F32 as i32,
                content_hash: req.content_hash.clone(),
                holder_worker_id: self.worker_id.clone(),
                holder_incarnation_id: self.incarnation,
            }),
            region: Some(v1::MemoryRegion {
                region_id: desc.region_id.0 as u32,
                kind: v1::memory_region::Kind::Embeddings as i32,
                device: 0,
                base_address: 0,
                length_bytes: desc.len,
                remote_key: desc.remote_key.clone(),
            }),
            transfer_id: n,
            responder: None,
        };
        held.insert(
            handle_id,
            Held {
                request_id: req.request_id.clone(),
                region,
                desc,
                transfer_id: TransferId(n),
                n_tokens: req.n_tokens as usize,
                hidden: req.hidden as usize,
                content_hash,
                expires: Instant::now() + ttl,
            },
        );
        self.counters.reserved.fetch_add(1, Ordering::Relaxed);
        Ok(reply)
    }

    fn free(&self, h: &Held) {
        self.transport.abandon_incoming(h.transfer_id);
        self.transport.deregister(h.desc.region_id);
    }

    /// Takes the embeddings `handle` names for `request_id`, once their transfer completed; the
    /// buffer is freed whatever happens.
    pub async fn take(
        &self,
        request_id: &str,
        handle: &v1::EmbeddingHandle,
        deadline: Instant,
    ) -> Result<ImageEmbedding, Status> {
        if handle.holder_incarnation_id != 0 && handle.holder_incarnation_id != self.incarnation {
            return Err(err(
                v1::ErrorCode::StaleIncarnation,
                format!(
                    "embedding handle {} names another incarnation of this worker",
                    handle.handle_id
                ),
            ));
        }
        let h = {
            let mut held = self.lock();
            match held.get(&handle.handle_id) {
                Some(h) if h.request_id == request_id => held.remove(&handle.handle_id),
                _ => None,
            }
        }
        .ok_or_else(|| {
            err(
                v1::ErrorCode::NotFound,
                format!(
                    "embedding handle {} is not held here for this request (expired or released)",
                    handle.handle_id
                ),
            )
        })?;
        let result = self.read(&h, deadline).await;
        self.free(&h);
        if result.is_ok() {
            self.counters.consumed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.released.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    async fn read(&self, h: &Held, deadline: Instant) -> Result<ImageEmbedding, Status> {
        let deadline = tessera_transfer::Instant::from_std(deadline);
        self.transport
            .wait_incoming(h.transfer_id, deadline)
            .await
            .map_err(|e| {
                err(
                    v1::ErrorCode::TransferFailed,
                    format!("image embeddings did not arrive: {e}"),
                )
            })?;
        let bytes = h
            .region
            .try_read(0..h.region.len())
            .map_err(|e| err(v1::ErrorCode::Internal, e.to_string()))?;
        let values = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(ImageEmbedding {
            content_hash: h.content_hash,
            n_tokens: h.n_tokens,
            hidden: h.hidden,
            values,
        })
    }

    /// Frees every buffer still held for `request_id`; how many.
    pub fn release_request(&self, request_id: &str) -> usize {
        let gone: Vec<Held> = {
            let mut held = self.lock();
            let ids: Vec<String> = held
                .iter()
                .filter(|(_, h)| h.request_id == request_id)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| held.remove(id)).collect()
        };
        for h in &gone {
            self.free(h);
        }
        self.counters
            .released
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        gone.len()
    }

    /// Frees the buffers whose TTL passed; how many.
    pub fn expire(&self, now: Instant) -> usize {
        let gone: Vec<Held> = {
            let mut held = self.lock();
            let ids: Vec<String> = held
                .iter()
                .filter(|(_, h)| h.expires <= now)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| held.remove(id)).collect()
        };
        for h in &gone {
            tracing::warn!(request_id = %h.request_id, "image embeddings expired unused");
            self.free(h);
        }
        self.counters
            .expired
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        gone.len()
    }

    /// Runs [`Self::expire`] every second while the store lives.
    pub fn spawn_sweeper(self: &Arc<Self>) {
        let store = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let Some(s) = store.upgrade() else { return };
                s.expire(Instant::now());
            }
        });
    }
}

/// Frees a request's buffers when dropped (every exit of a `Prefill` call).
pub struct ReleaseOnDrop<'a> {
    pub store: &'a EmbeddingStore,
    pub request_id: &'a str,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.store.release_request(self.request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_transfer::{LocalTransport, Secret, TransportConfig};

    fn store() -> (Arc<LocalTransport>, EmbeddingStore) {
        let t = Arc::new(LocalTransport::new(TransportConfig::new(Secret::new(b"s"))));
        let info = v1::WorkerInfo {
            worker_id: "prefill-0".into(),
            incarnation_id: t.incarnation().0,
            ..Default::default()
        };
        (t.clone(), EmbeddingStore::new(t, &info))
    }

    fn ask(request_id: &str, ttl_ms: u32) -> v1::ReserveEmbeddingsRequest {
        v1::ReserveEmbeddingsRequest {
            request_id: request_id.into(),
            n_tokens: 2,
            hidden: 3,
            dtype: v1::Dtype::F32 as i32,
            content_hash: vec![7; 32],
            ttl_ms,
            ..Default::default()
        }
    }

    #[test]
    fn buffers_are_freed_by_release_and_by_ttl() {
        let (_t, s) = store();
        s.reserve(&ask("a", 0)).unwrap();
        s.reserve(&ask("a", 0)).unwrap();
        s.reserve(&ask("b", 1)).unwrap();
        assert_eq!(s.usage().0, 3);
        assert_eq!(s.release_request("a"), 2);
        assert_eq!(s.expire(Instant::now() + Duration::from_millis(5)), 1);
        assert_eq!(s.usage(), (0, 0));
    }

    #[test]
    fn bad_reservations_are_refused() {
        let (_t, s) = store();
        let mut r = ask("a", 0);
        r.content_hash = vec![1; 3];
        assert!(s.reserve(&r).is_err());
        let mut r = ask("a", 0);
        r.n_tokens = 0;
        assert!(s.reserve(&r).is_err());
        let mut r = ask("a", 0);
        r.hidden = u32::MAX;
        r.n_tokens = u32::MAX;
        assert!(s.reserve(&r).is_err());
        assert_eq!(s.usage(), (0, 0));
    }

    #[tokio::test]
    async fn take_waits_for_the_transfer_and_frees_the_buffer() {
        let (t, s) = store();
        let reply = s.reserve(&ask("a", 0)).unwrap();
        let handle = reply.handle.unwrap();
        let region = reply.region.unwrap();
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let dst = RegionDescriptor {
            region_id: tessera_transfer::RegionId(region.region_id as u64),
            len: region.length_bytes,
            incarnation: t.incarnation(),
            remote_key: vec![],
        };
        let deadline = tessera_transfer::Instant::now() + Duration::from_secs(5);
        let peer = t.connect(&t.endpoint(), deadline).await.unwrap();
        t.write_bytes(
            peer,
            TransferId(reply.transfer_id),
            &dst,
            0,
            &bytes,
            deadline,
        )
        .await
        .unwrap();
        assert!(s
            .take("other", &handle, Instant::now() + Duration::from_secs(1))
            .await
            .is_err());
        let e = s
            .take("a", &handle, Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!((e.n_tokens, e.hidden), (2, 3));
        assert_eq!(e.values, values);
        assert_eq!(e.content_hash, [7; 32]);
        assert_eq!(s.usage(), (0, 0));
        assert!(s
            .take("a", &handle, Instant::now() + Duration::from_secs(1))
            .await
            .is_err());
    }
}
