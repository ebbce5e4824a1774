//! The prefill daemon (`tessera-prefill`): runs a request's prompt with the prefix cache
//! (`prefill_only`), samples the first token, and writes the MLA pages plus the final KDA
//! snapshot of every group straight into the pages a decode worker reserved, over the page
//! transport of `tessera-transfer` that `--transport` names (`tcp`, or `ucx` in a build with the
//! `ucx` feature).
//!
//! This crate also hosts [`runtime`], the worker runtime shared by every daemon (flags, health,
//! metrics, drain). DESIGN §1's table has no crate for it, and putting it in the engine would
//! pull tonic into the engine, so it lives here; `tessera-decode` depends on this crate for it.
//!
//! Transfer protocol (family-agnostic): the decode worker registers one staging region of
//! `slots × slot_bytes` and publishes it in `TransferHandshake`; for each `(src, dst)` page pair
//! the prefill worker packs the page's extents of every plane (in plane order) into a registered
//! source region it allocated through the transport (reused across requests), and writes it to
//! `dst × slot_bytes` of the staging region, as one batch whose transfer id is the reservation id.
//! Both sides advertise their transport in `WorkerInfo.transfer_backend`; the handshake refuses
//! a pair whose transports (or page layouts) differ, with LAYOUT_MISMATCH. The
//! decode worker waits for that transfer, then unpacks each slot into its reserved page's extents
//! on the engine thread (`EngineHandle::with_pool`). TODO: register the arena itself (RMA put
//! straight into pages, no staging copy) once the pool's arena can be a transfer region.
//!
//! A transfer that misses its deadline (`KvDestination.transfer_timeout_ms`) fails the call with
//! TRANSFER_TIMEOUT after freeing both sides: the handoff's pages here, and the reservation on
//! decode (`ReleaseReservation`), so neither waits for the reservation's TTL.
//!
//! Images: encoders push a request's image embeddings into buffers of this worker
//! (`ReserveEmbeddings`, [`embeddings`]); `Prefill` takes them by handle and the engine splices
//! them at the image placeholders. A request's buffers are freed on every exit of its
//! `Prefill`, by `Cancel`, or after their TTL.

pub mod discovery;
pub mod embeddings;
pub mod runtime;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use tessera_engine::kv::PageId;
use tessera_engine::serving::handoff::transfer_pairs;
use tessera_engine::serving::{EngineEvent, EngineHandle, EngineRequest, EventSink, Reservation};
use tessera_engine::vision::PlacedImage;
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::tonic::{self, Request, Response, Status};
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use tessera_transfer::{
    Extent, Incarnation, PeerId, RegionDescriptor, RegionHandle, RegionId, TransferId, Transport,
    WriteBatch,
};

use embeddings::{EmbeddingStore, ReleaseOnDrop};
use runtime::{ClusterToken, Drain, TestHooks, Withhold, WorkerArgs};

fn err(code: v1::ErrorCode, msg: impl Into<String>) -> Status {
    v1::ErrorDetail::new(code, msg).into_status()
}

type DecodeClient = DecodeWorkerClient<InterceptedService<Channel, ClusterToken>>;

/// A decode worker: its gRPC client and what it told us in `TransferHandshake`.
#[derive(Clone)]
struct DecodePeer {
    client: DecodeClient,
    peer: PeerId,
    region: RegionDescriptor,
}

/// Source regions kept registered between transfers, at most.
const IDLE_SOURCES: usize = 4;

/// A registered region that a transfer's pages are packed into.
struct Source {
    region: RegionHandle,
    desc: RegionDescriptor,
}

pub struct PrefillService {
    engine: Arc<EngineHandle>,
    transport: Arc<dyn Transport>,
    /// Registered source regions not in use (allocated through the transport, so UCX memory
    /// with `--transport ucx`); registering one costs more than a small transfer.
    sources: Mutex<Vec<Source>>,
    info: v1::WorkerInfo,
    slot_bytes: usize,
    drain: Arc<Drain>,
    max_running: usize,
    /// Sent on this worker's calls to decode workers.
    token: ClusterToken,
    /// Mutual TLS for the calls to decode workers (`--tls-*`).
    tls: Option<tessera_proto::tls::MutualTls>,
    hooks: Arc<TestHooks>,
    /// request id → cancel flag of the prefill in flight.
    inflight: Mutex<HashMap<String, Arc<AtomicBool>>>,
    /// decode gRPC address → connected peer and its staging region.
    peers: tokio::sync::Mutex<HashMap<String, DecodePeer>>,
    bytes_sent: AtomicU64,
    transfers: AtomicU64,
    /// Time spent in page transfers (write to acknowledgement), in microseconds.
    transfer_us: AtomicU64,
    /// Image embeddings encoders pushed here, waiting for their prefill.
    embeddings: Arc<EmbeddingStore>,
}

/// A handoff whose pages the engine holds for this worker. Dropping it without `done()` — the
/// gRPC call was cancelled, or the value never reached the handler — releases the pages from a
/// helper thread (never the engine thread, which may be the one dropping it).
struct HeldHandoff {
    handoff: tessera_engine::serving::Handoff,
    engine: std::sync::Weak<EngineHandle>,
    released: bool,
}

impl HeldHandoff {
    fn done(mut self) {
        self.released = true;
    }
}

impl Drop for HeldHandoff {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let (engine, id) = (self.engine.clone(), self.handoff.id);
        std::thread::spawn(move || {
            if let Some(engine) = engine.upgrade() {
                let _ = engine.release_handoff(id);
            }
        });
    }
}

/// Delivers the handoff (or the failure) of one prefill-only request.
struct HandoffSink {
    tx: Option<tokio::sync::oneshot::Sender<Result<HeldHandoff, String>>>,
    engine: std::sync::Weak<EngineHandle>,
    cancelled: Arc<AtomicBool>,
}

impl EventSink for HandoffSink {
    fn send(&mut self, e: EngineEvent) -> bool {
        match e {
            EngineEvent::Handoff(h) => {
                if let Some(tx) = self.tx.take() {
                    let held = HeldHandoff {
                        handoff: h,
                        engine: self.engine.clone(),
                        released: false,
                    };
                    // On failure the scheduler releases the pages itself; the returned guard is
                    // marked done so they are not released twice.
                    return match tx.send(Ok(held)) {
                        Ok(()) => true,
                        Err(back) => {
                            if let Ok(held) = back {
                                held.done();
                            }
                            false
                        }
                    };
                }
                true
            }
            EngineEvent::Failed(m) => {
                if let Some(tx) = self.tx.take() {
                    let _ = tx.send(Err(m));
                }
                false
            }
            _ => self.tx.as_ref().is_some_and(|t| !t.is_closed()),
        }
    }
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.tx.as_ref().is_some_and(|t| t.is_closed())
    }
}

impl PrefillService {
    /// The drain state (and etcd registration) of this worker.
    pub fn drain(&self) -> &Arc<Drain> {
        &self.drain
    }

    pub fn info(&self) -> &v1::WorkerInfo {
        &self.info
    }

    /// Connects (once per decode worker) and learns its staging region.
    async fn decode_peer(&self, dest: &v1::KvDestination) -> Result<DecodePeer, Status> {
        let mut peers = self.peers.lock().await;
        if let Some(p) = peers.get(&dest.decode_grpc_address) {
            if p.region.incarnation.0 == dest.decode_incarnation_id
                || dest.decode_incarnation_id == 0
            {
                return Ok(p.clone());
            }
        }
        let channel = tessera_proto::tls::endpoint(&dest.decode_grpc_address, self.tls.as_ref())
            .map_err(|e| {
                err(
                    v1::ErrorCode::InvalidArgument,
                    format!("decode address: {e}"),
                )
            })?
            .connect()
            .await
            .map_err(|e| err(v1::ErrorCode::TransferFailed, format!("decode gRPC: {e}")))?;
        let mut client = DecodeWorkerClient::with_interceptor(channel, self.token.clone());
        let reply = client
            .transfer_handshake(v1::TransferHandshakeRequest {
                initiator: Some(self.info.clone()),
                target_incarnation: dest.decode_incarnation_id,
                regions: vec![],
            })
            .await?
            .into_inner();
        let responder = reply.responder.unwrap_or_default();
        runtime::check_peer(&self.info, &responder)?;
        let r = reply
            .regions
            .iter()
            .find(|r| r.kind == v1::memory_region::Kind::KvArena as i32)
            .ok_or_else(|| err(v1::ErrorCode::TransferFailed, "decode offers no KV region"))?;
        let region = RegionDescriptor {
            region_id: RegionId(r.region_id as u64),
            len: r.length_bytes,
            incarnation: Incarnation(responder.incarnation_id),
            remote_key: r.remote_key.clone(),
        };
        let endpoint = if dest.transfer_endpoint.is_empty() {
            responder.transfer_endpoint.clone()
        } else {
            dest.transfer_endpoint.clone()
        };
        let deadline = tessera_transfer::Instant::now() + Duration::from_secs(10);
        let peer = self
            .transport
            .connect(&endpoint, deadline)
            .await
            .map_err(|e| {
                err(
                    v1::ErrorCode::TransferFailed,
                    format!("connect {endpoint}: {e}"),
                )
            })?;
        let p = DecodePeer {
            client,
            peer,
            region,
        };
        peers.insert(dest.decode_grpc_address.clone(), p.clone());
        Ok(p)
    }

    /// A registered source region of at least `len` bytes: the smallest idle one that fits, or a
    /// fresh one from the transport.
    fn take_source(&self, len: usize) -> Result<Source, Status> {
        {
            let mut idle = self.sources.lock().unwrap();
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, s)| s.region.len() >= len)
                .min_by_key(|(_, s)| s.region.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(idle.swap_remove(i));
            }
        }
        let failed = |e: tessera_transfer::TransferError| {
            err(v1::ErrorCode::TransferFailed, format!("source region: {e}"))
        };
        let region = self
            .transport
            .alloc_region(len.max(1).next_power_of_two())
            .map_err(failed)?;
        let desc = self.transport.register(&region).map_err(failed)?;
        Ok(Source { region, desc })
    }

    /// Keeps `source` for the next transfer (the largest few are kept).
    fn put_source(&self, source: Source) {
        let mut idle = self.sources.lock().unwrap();
        idle.push(source);
        if idle.len() > IDLE_SOURCES {
            idle.sort_by_key(|s| std::cmp::Reverse(s.region.len()));
            for s in idle.drain(IDLE_SOURCES..) {
                self.transport.deregister(s.desc.region_id);
            }
        }
    }

    /// Moves `pairs` of this pool into the decode worker's staging slots as one transfer.
    async fn send_pages(
        &self,
        peer: &DecodePeer,
        transfer_id: u64,
        pairs: Vec<(PageId, PageId)>,
        timeout: Duration,
    ) -> Result<v1::TransferStats, Status> {
        let slot = self.slot_bytes;
        let source = self.take_source(pairs.len() * slot)?;
        let region = source.region.clone();
        let p2 = pairs.clone();
        let engine = self.engine.clone();
        // Pack on the engine thread, straight into the source region: each page's extents of
        // every plane, back to back (none larger than a slot, so all fit).
        let packed = tokio::task::spawn_blocking(move || {
            engine.with_pool(move |pool| -> Result<Vec<usize>, Status> {
                let internal =
                    |e: &dyn std::fmt::Display| err(v1::ErrorCode::Internal, e.to_string());
                let mut out = region
                    .try_write(0..p2.len() * slot)
                    .map_err(|e| internal(&e))?;
                let mut lens = Vec::with_capacity(p2.len());
                let mut at = 0;
                for (s, _) in &p2 {
                    let start = at;
                    for (off, len) in pool.page_extents(*s).map_err(|e| internal(&e))? {
                        if at + len - start > slot {
                            return Err(err(
                                v1::ErrorCode::LayoutMismatch,
                                "page larger than a slot",
                            ));
                        }
                        pool.read_bytes(off, &mut out[at..at + len])
                            .map_err(|e| internal(&e))?;
                        at += len;
                    }
                    lens.push(at - start);
                }
                Ok(lens)
            })
        })
        .await;
        let packed = match packed {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(err(v1::ErrorCode::Internal, e.to_string())),
            Err(e) => Err(err(v1::ErrorCode::Internal, e.to_string())),
        };
        let lens = match packed {
            Ok(lens) => lens,
            Err(status) => {
                self.put_source(source);
                return Err(status);
            }
        };
        let mut extents = Vec::with_capacity(pairs.len());
        let mut src = 0u64;
        for ((_, d), len) in pairs.iter().zip(&lens) {
            extents.push(Extent {
                src_region: source.desc.region_id,
                src_offset: src,
                dst_offset: d.0 as u64 * slot as u64,
                len: *len as u64,
            });
            src += *len as u64;
        }
        let started = StdInstant::now();
        let res = self
            .transport
            .write(
                peer.peer,
                WriteBatch {
                    transfer_id: TransferId(transfer_id),
                    dst_region: peer.region.clone(),
                    extents,
                },
                tessera_transfer::Instant::now() + timeout,
            )
            .await;
        if res.is_ok() {
            self.put_source(source);
        } else {
            // Puts may still be reading it: never reuse it.
            self.transport.deregister(source.desc.region_id);
        }
        let receipt = res.map_err(|e| {
            let code = if matches!(e, tessera_transfer::TransferError::Timeout) {
                v1::ErrorCode::TransferTimeout
            } else {
                v1::ErrorCode::TransferFailed
            };
            err(code, format!("page transfer: {e}"))
        })?;
        let duration_us = started.elapsed().as_micros() as u64;
        self.bytes_sent.fetch_add(receipt.bytes, Ordering::Relaxed);
        self.transfers.fetch_add(1, Ordering::Relaxed);
        self.transfer_us.fetch_add(duration_us, Ordering::Relaxed);
        tracing::debug!(
            transfer = transfer_id,
            bytes = receipt.bytes,
            duration_us,
            transport = self.transport.kind(),
            "pages sent"
        );
        Ok(v1::TransferStats {
            backend: runtime::backend_of(&self.info) as i32,
            bytes: receipt.bytes,
            duration_us,
            retries: receipt.attempts.saturating_sub(1),
            ..Default::default()
        })
    }

    /// Frees a reservation on decode after a transfer into it timed out (best effort, bounded).
    async fn release_reservation(
        &self,
        peer: &DecodePeer,
        request_id: &str,
        dest: &v1::KvDestination,
    ) {
        let msg = v1::ReleaseReservationRequest {
            request_id: request_id.to_string(),
            target_incarnation: dest.decode_incarnation_id,
            reservation_id: dest.reservation_id.clone(),
        };
        let mut client = peer.client.clone();
        let released =
            tokio::time::timeout(Duration::from_secs(2), client.release_reservation(msg)).await;
        if !matches!(released, Ok(Ok(_))) {
            tracing::warn!(
                reservation = %dest.reservation_id,
                decode = %dest.decode_grpc_address,
                "could not release the reservation after the transfer timed out; its TTL frees it"
            );
        }
    }

    /// Drops the pair the armed [`TestHooks::withhold`] names (pairs are the MLA pages in prompt
    /// order, then one KDA snapshot per group); without a hook, `pairs` as they are.
    fn withhold(&self, mut pairs: Vec<(PageId, PageId)>, mla: usize) -> Vec<(PageId, PageId)> {
        let index = match self.hooks.withheld() {
            None => return pairs,
            Some(Withhold::MlaPage(n)) if n < mla => n,
            Some(Withhold::KdaGroup(g)) if mla + g < pairs.len() => mla + g,
            Some(w) => {
                tracing::warn!(?w, "the withheld part is not in this transfer");
                return pairs;
            }
        };
        tracing::warn!(index, "test hook: withholding one page from the transfer");
        pairs.remove(index);
        pairs
    }

    /// The embeddings of the request's images, taken out of their buffers (which are freed).
    async fn take_images(
        &self,
        req: &v1::PrefillRequest,
        timeout: Duration,
    ) -> Result<Vec<PlacedImage>, Status> {
        let deadline = StdInstant::now() + timeout;
        let mut placed = Vec::with_capacity(req.images.len());
        let mut end = 0usize;
        for (i, image) in req.images.iter().enumerate() {
            let handle = image
                .handle
                .as_ref()
                .ok_or_else(|| err(v1::ErrorCode::InvalidArgument, "an image has no handle"))?;
            let position = image.position as usize;
            let last = position + handle.n_tokens as usize;
            if position < end || last > req.prompt_token_ids.len() {
                return Err(err(
                    v1::ErrorCode::InvalidArgument,
                    format!(
                        "image {i} at {position}..{last} overlaps another image or the end of \
                         the prompt of {} tokens",
                        req.prompt_token_ids.len()
                    ),
                ));
            }
            end = last;
            let embedding = self
                .embeddings
                .take(&req.request_id, handle, deadline)
                .await?;
            placed.push(PlacedImage {
                position,
                embedding: Arc::new(embedding),
            });
        }
        Ok(placed)
    }

    fn stats_now(&self) -> anyhow::Result<(v1::PoolStats, v1::LoadStats)> {
        runtime::worker_stats(&self.engine, &self.drain, 0, self.max_running)
    }

    /// Prometheus text for `/metrics` (blocking).
    pub fn metrics_text(&self) -> String {
        let (held, held_bytes) = self.embeddings.usage();
        let c = &self.embeddings.counters;
        runtime::engine_metrics(
            "prefill",
            self.stats_now(),
            &[
                runtime::counter(
                    "tessera_transfer_bytes_total",
                    "Bytes of KV pages sent to decode workers.",
                    self.bytes_sent.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_transfers_total",
                    "Page transfers to decode workers (one per prefilled request).",
                    self.transfers.load(Ordering::Relaxed),
                ),
                (
                    "tessera_transfer_seconds_total",
                    "counter",
                    "Time spent in page transfers to decode workers, write to acknowledgement.",
                    self.transfer_us.load(Ordering::Relaxed) as f64 / 1e6,
                ),
                runtime::gauge(
                    "tessera_embedding_buffers",
                    "Image embedding buffers held, waiting for their prefill.",
                    held as f64,
                ),
                runtime::gauge(
                    "tessera_embedding_buffer_bytes",
                    "Bytes of the image embedding buffers held.",
                    held_bytes as f64,
                ),
                runtime::counter(
                    "tessera_embedding_buffers_reserved_total",
                    "Image embedding buffers reserved by encoders.",
                    c.reserved.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_embedding_buffers_consumed_total",
                    "Image embedding buffers a prefill consumed.",
                    c.consumed.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_embedding_buffers_released_total",
                    "Image embedding buffers freed unused (cancel, failed prefill).",
                    c.released.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_embedding_buffers_expired_total",
                    "Image embedding buffers freed because their TTL passed.",
                    c.expired.load(Ordering::Relaxed),
                ),
            ],
        )
    }
}

/// Cancels the running prefill unless disarmed (the gRPC call was dropped).
struct CancelOnDrop(Arc<AtomicBool>, bool);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.1 {
            self.0.store(true, Ordering::Release);
        }
    }
}

crate::grpc_face!(PrefillGrpc => PrefillService);

#[tonic::async_trait]
impl PrefillWorker for PrefillGrpc {
    async fn prefill(
        &self,
        request: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillReply>, Status> {
        let req = request.into_inner();
        let _guard = runtime::admit(&self.drain, &self.info, req.target_incarnation)?;
        // Whatever this call leaves of the request's embedding buffers is freed on return.
        let _free = ReleaseOnDrop {
            store: &self.embeddings,
            request_id: &req.request_id,
        };
        if req.resumed_tokens as usize >= req.prompt_token_ids.len().max(1) {
            return Err(err(
                v1::ErrorCode::InvalidArgument,
                "resumed_tokens must be smaller than the prompt",
            ));
        }
        let logprobs = runtime::top_logprobs_from_wire(req.logprobs)?;
        let dest = req
            .destination
            .clone()
            .ok_or_else(|| err(v1::ErrorCode::InvalidArgument, "no KV destination"))?;
        let reservation_id: u64 = dest.reservation_id.parse().map_err(|_| {
            err(
                v1::ErrorCode::InvalidArgument,
                "reservation_id is not a number",
            )
        })?;
        if dest.cached_tokens != 0 {
            return Err(err(
                v1::ErrorCode::InvalidArgument,
                "decode-side prefix reuse is not supported yet",
            ));
        }
        let timeout = match dest.transfer_timeout_ms {
            0 => Duration::from_secs(30),
            ms => Duration::from_millis(ms as u64),
        };
        let peer = self.decode_peer(&dest).await?;
        let images = self.take_images(&req, timeout).await?;
        let started = StdInstant::now();
        let cancelled = Arc::new(AtomicBool::new(false));
        self.inflight
            .lock()
            .unwrap()
            .insert(req.request_id.clone(), cancelled.clone());
        let mut on_drop = CancelOnDrop(cancelled.clone(), true);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let ereq = EngineRequest {
            prompt: req.prompt_token_ids.clone(),
            max_new_tokens: 1,
            sampling: runtime::sampling_from_wire(req.sampling.as_ref()),
            stop_ids: vec![],
            cache_salt: (!req.cache_salt.is_empty()).then(|| req.cache_salt.clone()),
            prefill_only: true,
            resumed_tokens: req.resumed_tokens as usize,
            images,
            logprobs,
        };
        let sink = HandoffSink {
            tx: Some(tx),
            engine: Arc::downgrade(&self.engine),
            cancelled: cancelled.clone(),
        };
        let result = async {
            self.engine
                .submit(ereq, Box::new(sink))
                .map_err(|e| err(v1::ErrorCode::Internal, e.to_string()))?;
            let held = match rx.await {
                Ok(Ok(held)) => held,
                Ok(Err(m)) => return Err(err(v1::ErrorCode::Internal, m)),
                Err(_) => return Err(err(v1::ErrorCode::Cancelled, "prefill cancelled")),
            };
            let h = held.handoff.clone();
            let compute_us = started.elapsed().as_micros() as u64;
            let resv = Reservation {
                id: reservation_id,
                prompt_len: req.prompt_token_ids.len(),
                mla_pages: dest.mla_page_ids.iter().map(|&p| PageId(p)).collect(),
                kda_pages: dest.kda_state_page_ids.iter().map(|&p| PageId(p)).collect(),
            };
            let pairs = transfer_pairs(&h, &resv);
            let sent = match pairs {
                Ok(pairs) if !cancelled.load(Ordering::Acquire) => {
                    let (mla, kda) = (resv.mla_pages.len(), resv.kda_pages.len());
                    let pairs = self.withhold(pairs, mla);
                    let sent = self
                        .send_pages(&peer, reservation_id, pairs, timeout)
                        .await
                        .map(|mut s| {
                            s.mla_pages_sent = mla as u32;
                            s.state_pages_sent = kda as u32;
                            s
                        });
                    if let Err(s) = &sent {
                        if v1::ErrorDetail::from_status(s)
                            .is_some_and(|d| d.code == v1::ErrorCode::TransferTimeout as i32)
                        {
                            // TRANSFER_TIMEOUT means both sides freed their pages: free the
                            // reservation on decode now rather than when its TTL runs out.
                            self.release_reservation(&peer, &req.request_id, &dest)
                                .await;
                        }
                    }
                    sent
                }
                Ok(_) => Err(err(v1::ErrorCode::Cancelled, "prefill cancelled")),
                Err(e) => Err(err(v1::ErrorCode::InvalidArgument, e.to_string())),
            };
            // Packed (or failed): the pages are no longer needed here either way.
            let engine = self.engine.clone();
            let id = h.id;
            let _ = tokio::task::spawn_blocking(move || engine.release_handoff(id)).await;
            held.done();
            let transfer = sent?;
            Ok(v1::PrefillReply {
                first_token: h.first_token,
                prompt_tokens: h.prompt_len as u32,
                cached_tokens: h.cached_tokens as u32,
                transfer: Some(transfer),
                compute_us,
                first_token_logprobs: h
                    .first_token_logprobs
                    .as_ref()
                    .map(runtime::logprobs_to_wire),
            })
        }
        .await;
        on_drop.1 = false;
        self.inflight.lock().unwrap().remove(&req.request_id);
        result.map(Response::new)
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelReply>, Status> {
        let req = request.into_inner();
        self.embeddings.release_request(&req.request_id);
        let found = match self.inflight.lock().unwrap().get(&req.request_id) {
            Some(f) => {
                f.store(true, Ordering::Release);
                true
            }
            None => false,
        };
        Ok(Response::new(v1::CancelReply {
            found,
            pages_freed: 0,
        }))
    }

    async fn reserve_embeddings(
        &self,
        request: Request<v1::ReserveEmbeddingsRequest>,
    ) -> Result<Response<v1::ReserveEmbeddingsReply>, Status> {
        let req = request.into_inner();
        let _guard = runtime::admit(&self.drain, &self.info, req.target_incarnation)?;
        if let Some(encoder) = &req.initiator {
            runtime::transports_compatible(&self.info, encoder)
                .map_err(|m| err(v1::ErrorCode::LayoutMismatch, m))?;
        }
        let mut reply = self.embeddings.reserve(&req)?;
        reply.responder = Some(self.info.clone());
        Ok(Response::new(reply))
    }

    async fn stats(
        &self,
        _request: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::WorkerStats>, Status> {
        let me = self.clone();
        let stats = runtime::engine_stats(&self.info, move || me.stats_now()).await?;
        Ok(Response::new(stats))
    }
}

/// A running prefill daemon (in-process handle, for `main` and tests).
pub type RunningPrefill = runtime::Running<PrefillService>;

/// Starts the daemon: engine, transport, gRPC (+ health), `/metrics`; stops gracefully when
/// `shutdown` resolves.
pub async fn start(
    args: WorkerArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<RunningPrefill> {
    let f = runtime::foundation(&args, v1::Role::Prefill).await?;
    let embeddings = Arc::new(EmbeddingStore::new(f.transport.clone(), &f.info));
    embeddings.spawn_sweeper();
    let service = Arc::new(PrefillService {
        engine: f.engine,
        transport: f.transport,
        sources: Mutex::default(),
        info: f.info.clone(),
        slot_bytes: f.slots.0,
        drain: f.drain.clone(),
        max_running: args.max_running,
        token: ClusterToken::new(&args.daemon.auth_secret)?,
        tls: args.daemon.tls.load().map_err(anyhow::Error::msg)?,
        hooks: args.daemon.test_hooks.clone(),
        inflight: Mutex::default(),
        peers: Default::default(),
        bytes_sent: AtomicU64::new(0),
        transfers: AtomicU64::new(0),
        transfer_us: AtomicU64::new(0),
        embeddings,
    });
    let grpc = PrefillWorkerServer::new(PrefillGrpc(service.clone()));
    runtime::serve(
        &args.daemon,
        f.listener,
        &f.info,
        f.drain,
        service,
        grpc,
        PrefillService::metrics_text,
        shutdown,
    )
    .await
}
