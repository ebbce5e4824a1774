//! The decode daemon (`tessera-decode`): reserves destination pages for incoming prefills,
//! receives the prompt's state (MLA pages + the KDA snapshot of every group) over the page
//! transport (`--transport tcp|ucx`), continues the request with continuous batching over the
//! flat page pool and streams tokens back.
//!
//! The worker runtime every daemon shares (flags, health, `/metrics`, drain) is
//! `tessera_prefill::runtime`: DESIGN §1 has no crate for it and the engine must stay free of
//! tonic, so it lives in `tessera-prefill` and this crate depends on that one for it only.
//!
//! Transfer: one staging region of `slots × slot_bytes`, allocated by the transport (UCX memory
//! with `--transport ucx`, which same-host senders fill through shared memory), is registered
//! with it and published in `TransferHandshake`, which refuses a prefill worker whose page
//! layout or transport differs; the prefill worker writes page `dst` into slot `dst` (see
//! the `tessera-prefill` crate docs) as transfer id = reservation id. `StartDecode` waits for
//! that transfer, unpacks each slot into the reserved page on the engine thread
//! ([`EngineHandle::with_pool`]), then resumes the request. A reservation not started within its
//! TTL is cancelled (pages freed, incoming transfer abandoned).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use tessera_engine::kv::PageId;
use tessera_engine::serving::{
    EngineEvent, EngineHandle, EngineRequest, EventSink, FinishReason, Reservation,
};
use tessera_prefill::runtime::{self, Drain, InflightGuard, WorkerArgs};
use tessera_proto::tonic::{self, Request, Response, Status};
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use tessera_transfer::{RegionDescriptor, RegionHandle, TransferId, Transport};

fn err(code: v1::ErrorCode, msg: impl Into<String>) -> Status {
    v1::ErrorDetail::new(code, msg).into_status()
}

fn internal(e: impl std::fmt::Display) -> Status {
    err(v1::ErrorCode::Internal, e.to_string())
}

/// Default and maximum life of a reservation that no `StartDecode` claimed.
const DEFAULT_TTL: Duration = Duration::from_secs(30);
const MAX_TTL: Duration = Duration::from_secs(600);

struct Pending {
    request_id: String,
    reservation: Reservation,
    /// A reservation is in-flight work: a drain waits for it to be started (its decode then
    /// holds this) or released, so a request that reserved pages before SIGTERM still decodes.
    inflight: InflightGuard,
}

pub struct DecodeService {
    engine: Arc<EngineHandle>,
    transport: Arc<dyn Transport>,
    staging: RegionHandle,
    staging_desc: RegionDescriptor,
    slot_bytes: usize,
    info: v1::WorkerInfo,
    drain: Arc<Drain>,
    max_running: usize,
    /// reservation id → reservation not yet started.
    pending: Mutex<HashMap<u64, Pending>>,
    /// request id → cancel flag of a running decode.
    running: Mutex<HashMap<String, Arc<AtomicBool>>>,
    tokens_out: AtomicU64,
    expired: AtomicU64,
    hooks: Arc<runtime::TestHooks>,
}

impl DecodeService {
    /// The service over an engine daemon's foundation: allocates (through the transport) and
    /// registers the transfer staging region (`slots × slot_bytes`) that prefill workers write
    /// into.
    fn new(
        f: &runtime::Foundation,
        max_running: usize,
        hooks: Arc<runtime::TestHooks>,
    ) -> anyhow::Result<Self> {
        let (slot_bytes, slots) = f.slots;
        let staging = f.transport.alloc_region(slot_bytes * slots)?;
        let staging_desc = f.transport.register(&staging)?;
        tracing::info!(
            bytes = slot_bytes * slots,
            slot_bytes,
            transport = f.transport.kind(),
            "transfer staging region registered"
        );
        Ok(DecodeService {
            engine: f.engine.clone(),
            transport: f.transport.clone(),
            staging,
            staging_desc,
            slot_bytes,
            info: f.info.clone(),
            drain: f.drain.clone(),
            max_running,
            pending: Mutex::default(),
            running: Mutex::default(),
            tokens_out: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            hooks,
        })
    }

    /// The drain state (and etcd registration) of this worker.
    pub fn drain(&self) -> &Arc<Drain> {
        &self.drain
    }

    pub fn info(&self) -> &v1::WorkerInfo {
        &self.info
    }

    /// Reserves pages for a prompt and registers the reservation until it is started, released,
    /// cancelled or expires.
    async fn reserve(
        self: &Arc<Self>,
        req: v1::ReserveRequest,
        inflight: InflightGuard,
    ) -> Result<v1::ReserveReply, Status> {
        let prompt_len = req.prompt_token_ids.len();
        let engine = self.engine.clone();
        let r = tokio::task::spawn_blocking(move || engine.reserve(prompt_len))
            .await
            .map_err(internal)?
            .map_err(|e| {
                let mut d = v1::ErrorDetail::new(v1::ErrorCode::OutOfPages, e.to_string());
                d.retryable = true;
                d.into_status()
            })?;
        let ttl = match req.ttl_ms {
            0 => DEFAULT_TTL,
            ms => Duration::from_millis(ms as u64).min(MAX_TTL),
        };
        let id = r.id;
        let reply = v1::ReserveReply {
            reservation_id: id.to_string(),
            incarnation_id: self.info.incarnation_id,
            cached_tokens: 0,
            mla_page_ids: r.mla_pages.iter().map(|p| p.0).collect(),
            kda_state_page_ids: r.kda_pages.iter().map(|p| p.0).collect(),
            ttl_ms: ttl.as_millis() as u32,
        };
        self.pending.lock().unwrap().insert(
            id,
            Pending {
                request_id: req.request_id,
                reservation: r,
                inflight,
            },
        );
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ttl).await;
            if me.drop_pending(id).await.is_some() {
                me.expired.fetch_add(1, Ordering::Relaxed);
                tracing::info!(reservation = id, "reservation expired; pages freed");
            }
        });
        Ok(reply)
    }

    /// Frees a pending reservation (TTL, release, cancel). Returns its page count when found.
    async fn drop_pending(&self, id: u64) -> Option<usize> {
        let p = self.pending.lock().unwrap().remove(&id)?;
        self.transport.abandon_incoming(TransferId(id));
        let engine = self.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.cancel_reservation(id)).await;
        Some(p.reservation.mla_pages.len() + p.reservation.kda_pages.len())
    }

    fn stats_now(&self) -> anyhow::Result<(v1::PoolStats, v1::LoadStats)> {
        let reservations = self.pending.lock().unwrap().len();
        let (mut pool, load) =
            runtime::worker_stats(&self.engine, &self.drain, reservations, self.max_running)?;
        pool.reserved_pages = self
            .pending
            .lock()
            .unwrap()
            .values()
            .map(|p| (p.reservation.mla_pages.len() + p.reservation.kda_pages.len()) as u64)
            .sum();
        Ok((pool, load))
    }

    /// Prometheus text for `/metrics` (blocking).
    pub fn metrics_text(&self) -> String {
        runtime::engine_metrics(
            "decode",
            self.stats_now(),
            &[
                runtime::counter(
                    "tessera_generated_tokens_total",
                    "Tokens decoded and streamed (each request's first token comes from prefill).",
                    self.tokens_out.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_reservations_expired_total",
                    "Reservations freed because no StartDecode claimed them within their TTL.",
                    self.expired.load(Ordering::Relaxed),
                ),
            ],
        )
    }
}

/// Streams a resumed request's events; a dropped stream or a `Cancel` stops it.
struct StreamSink {
    tx: tokio::sync::mpsc::UnboundedSender<EngineEvent>,
    cancelled: Arc<AtomicBool>,
}

impl EventSink for StreamSink {
    fn send(&mut self, e: EngineEvent) -> bool {
        !self.cancelled.load(Ordering::Acquire) && self.tx.send(e).is_ok()
    }
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.tx.is_closed()
    }
}

/// Lives as long as the response stream: dropping it (client gone) cancels the request.
struct StreamGuard {
    service: Arc<DecodeService>,
    request_id: String,
    cancelled: Arc<AtomicBool>,
    _inflight: InflightGuard,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
        self.service
            .running
            .lock()
            .unwrap()
            .remove(&self.request_id);
    }
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<v1::TokenChunk, Status>> + Send>>;

tessera_prefill::grpc_face!(DecodeGrpc => DecodeService);

#[tonic::async_trait]
impl DecodeWorker for DecodeGrpc {
    async fn reserve_pages(
        &self,
        request: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveReply>, Status> {
        let req = request.into_inner();
        let inflight = runtime::admit(&self.drain, &self.info, req.target_incarnation)?;
        if req.prompt_token_ids.is_empty() {
            return Err(err(v1::ErrorCode::InvalidArgument, "empty prompt"));
        }
        // The reservation and its registration (with its expiry) run in a task of their own: a
        // caller that goes away mid-call cannot leave pages reserved that nothing frees.
        let me = self.0.clone();
        tokio::spawn(async move { me.reserve(req, inflight).await })
            .await
            .map_err(internal)?
            .map(Response::new)
    }

    async fn release_reservation(
        &self,
        request: Request<v1::ReleaseReservationRequest>,
    ) -> Result<Response<v1::ReleaseReservationReply>, Status> {
        let req = request.into_inner();
        let id: u64 = req
            .reservation_id
            .parse()
            .map_err(|_| err(v1::ErrorCode::InvalidArgument, "bad reservation id"))?;
        let freed = self.drop_pending(id).await;
        Ok(Response::new(v1::ReleaseReservationReply {
            released: freed.is_some(),
            pages_freed: freed.unwrap_or(0) as u32,
        }))
    }

    type StartDecodeStream = TokenStream;

    async fn start_decode(
        &self,
        request: Request<v1::StartDecodeRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        // No admission check: the reservation was admitted, and a drain lets it finish.
        let req = request.into_inner();
        runtime::check_target(&self.info, req.target_incarnation)?;
        if req.resumed_tokens as usize >= req.prompt_token_ids.len().max(1)
            || req.resumed_tokens >= req.max_tokens.max(1)
        {
            return Err(err(
                v1::ErrorCode::InvalidArgument,
                "resumed_tokens must be smaller than the prompt and than max_tokens",
            ));
        }
        let logprobs = runtime::top_logprobs_from_wire(req.logprobs)?;
        let id: u64 = req
            .reservation_id
            .parse()
            .map_err(|_| err(v1::ErrorCode::InvalidArgument, "bad reservation id"))?;
        let pending = self.pending.lock().unwrap().remove(&id).ok_or_else(|| {
            err(
                v1::ErrorCode::ReservationExpired,
                format!("no reservation {id} (expired, released or started)"),
            )
        })?;
        let free = |me: &Arc<DecodeService>| {
            let engine = me.engine.clone();
            tokio::task::spawn_blocking(move || engine.cancel_reservation(id))
        };
        // The prefill worker replied only after the transfer was verified here, so this is
        // normally immediate.
        let deadline = tessera_transfer::Instant::now() + Duration::from_secs(10);
        if let Err(e) = self.transport.wait_incoming(TransferId(id), deadline).await {
            let _ = free(&self.0).await;
            let code = match e {
                tessera_transfer::TransferError::Timeout => v1::ErrorCode::TransferTimeout,
                _ => v1::ErrorCode::TransferFailed,
            };
            return Err(err(code, format!("incoming pages: {e}")));
        }
        // Unpack every slot into its reserved page, on the engine thread.
        let (staging, slot) = (self.staging.clone(), self.slot_bytes);
        let pages: Vec<PageId> = pending
            .reservation
            .mla_pages
            .iter()
            .chain(&pending.reservation.kda_pages)
            .copied()
            .collect();
        let engine = self.engine.clone();
        let unpacked = tokio::task::spawn_blocking(move || {
            engine.with_pool(move |pool| -> Result<(), String> {
                for p in pages {
                    let mut at = p.0 as usize * slot;
                    for (off, len) in pool.page_extents(p).map_err(|e| e.to_string())? {
                        let bytes = staging.try_read(at..at + len).map_err(|e| e.to_string())?;
                        pool.write_page_bytes(p, off, &bytes)
                            .map_err(|e| e.to_string())?;
                        at += len;
                    }
                }
                Ok(())
            })
        })
        .await
        .map_err(internal)?
        .map_err(internal)?;
        if let Err(m) = unpacked {
            let _ = free(&self.0).await;
            return Err(err(v1::ErrorCode::Internal, m));
        }
        // A migrated request: its last `resumed` prompt tokens are completion tokens streamed by
        // an earlier attempt; offsets and usage count them as completion.
        let resumed = req.resumed_tokens;
        let prompt_tokens = req.prompt_token_ids.len() as u32 - resumed;
        let ereq = EngineRequest {
            prompt: req.prompt_token_ids,
            max_new_tokens: req.max_tokens.saturating_sub(resumed).max(1) as usize,
            sampling: runtime::sampling_from_wire(req.sampling.as_ref()),
            stop_ids: req.stop_token_ids,
            cache_salt: (!req.cache_salt.is_empty()).then_some(req.cache_salt),
            prefill_only: false,
            resumed_tokens: resumed as usize,
            images: Vec::new(),
            logprobs,
        };
        let cancelled = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let sink = StreamSink {
            tx,
            cancelled: cancelled.clone(),
        };
        let engine = self.engine.clone();
        let (first, cached) = (req.first_token, req.cached_tokens as usize);
        tokio::task::spawn_blocking(move || {
            engine.submit_resumed(id, ereq, first, cached, Box::new(sink))
        })
        .await
        .map_err(internal)?
        .map_err(|e| err(v1::ErrorCode::InvalidArgument, e.to_string()))?;
        let inflight = pending.inflight;
        self.running
            .lock()
            .unwrap()
            .insert(req.request_id.clone(), cancelled.clone());
        let guard = StreamGuard {
            service: self.0.clone(),
            request_id: req.request_id,
            cancelled,
            _inflight: inflight,
        };
        let me = self.clone();
        // Token offsets count the first token of the request (sent by prefill) as 0.
        let stream = futures_util::stream::unfold(
            (guard, rx, resumed + 1, false),
            move |(guard, mut rx, offset, done)| {
                let me = me.clone();
                async move {
                    if done {
                        return None;
                    }
                    let limit = me.hooks.break_streams_after.load(Ordering::Relaxed);
                    if limit > 0 && offset - (resumed + 1) >= limit {
                        let gone = Status::unavailable("test hook: the decode worker went away");
                        return Some((Err(gone), (guard, rx, offset, true)));
                    }
                    // A token's log-probabilities come just before it, into its chunk.
                    let mut logprobs = Vec::new();
                    let mut event = rx.recv().await;
                    while let Some(EngineEvent::Logprobs(lp)) = &event {
                        logprobs = vec![runtime::logprobs_to_wire(lp)];
                        event = rx.recv().await;
                    }
                    match event {
                        Some(EngineEvent::Token(t)) => {
                            me.tokens_out.fetch_add(1, Ordering::Relaxed);
                            let chunk = v1::TokenChunk {
                                token_ids: vec![t],
                                offset,
                                logprobs,
                                ..Default::default()
                            };
                            Some((Ok(chunk), (guard, rx, offset + 1, false)))
                        }
                        Some(EngineEvent::Finished {
                            reason,
                            prompt_tokens: _,
                            completion_tokens,
                            cached_tokens,
                        }) => {
                            let chunk = v1::TokenChunk {
                                token_ids: vec![],
                                offset,
                                finish_reason: match reason {
                                    FinishReason::Stop => v1::FinishReason::Stop,
                                    FinishReason::Length => v1::FinishReason::Length,
                                } as i32,
                                usage: Some(v1::Usage {
                                    prompt_tokens,
                                    completion_tokens: completion_tokens as u32 + resumed,
                                    cached_tokens: cached_tokens as u32,
                                }),
                                logprobs: vec![],
                            };
                            Some((Ok(chunk), (guard, rx, offset, true)))
                        }
                        Some(EngineEvent::Failed(m)) => Some((
                            Err(err(v1::ErrorCode::Internal, m)),
                            (guard, rx, offset, true),
                        )),
                        Some(_) => Some((
                            Ok(v1::TokenChunk {
                                offset,
                                ..Default::default()
                            }),
                            (guard, rx, offset, false),
                        )),
                        None => None,
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream) as TokenStream))
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelReply>, Status> {
        let req = request.into_inner();
        let mut found = false;
        if let Some(f) = self.running.lock().unwrap().get(&req.request_id) {
            f.store(true, Ordering::Release);
            found = true;
        }
        let ids: Vec<u64> = self
            .pending
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| p.request_id == req.request_id)
            .map(|(&id, _)| id)
            .collect();
        let mut freed = 0;
        for id in ids {
            freed += self.drop_pending(id).await.unwrap_or(0);
            found = true;
        }
        Ok(Response::new(v1::CancelReply {
            found,
            pages_freed: freed as u32,
        }))
    }

    async fn stats(
        &self,
        _request: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::WorkerStats>, Status> {
        let me = self.clone();
        let stats = runtime::engine_stats(&self.info, move || me.stats_now()).await?;
        Ok(Response::new(stats))
    }

    async fn transfer_handshake(
        &self,
        request: Request<v1::TransferHandshakeRequest>,
    ) -> Result<Response<v1::TransferHandshakeReply>, Status> {
        let req = request.into_inner();
        runtime::check_target(&self.info, req.target_incarnation)?;
        if let Some(initiator) = &req.initiator {
            runtime::check_peer(&self.info, initiator)?;
        }
        let region_id = u32::try_from(self.staging_desc.region_id.0).map_err(internal)?;
        Ok(Response::new(v1::TransferHandshakeReply {
            responder: Some(self.info.clone()),
            regions: vec![v1::MemoryRegion {
                region_id,
                kind: v1::memory_region::Kind::KvArena as i32,
                device: 0,
                base_address: 0,
                length_bytes: self.staging_desc.len,
                remote_key: self.staging_desc.remote_key.clone(),
            }],
            session_id: self.info.incarnation_id,
        }))
    }
}

/// A running decode daemon (in-process handle, for `main` and tests).
pub type RunningDecode = runtime::Running<DecodeService>;

/// Starts the daemon: engine, transport, gRPC (+ health), `/metrics`; stops gracefully when
/// `shutdown` resolves.
pub async fn start(
    args: WorkerArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<RunningDecode> {
    let f = runtime::foundation(&args, v1::Role::Decode).await?;
    let service = Arc::new(DecodeService::new(
        &f,
        args.max_running,
        args.daemon.test_hooks.clone(),
    )?);
    let grpc = DecodeWorkerServer::new(DecodeGrpc(service.clone()));
    runtime::serve(
        &args.daemon,
        f.listener,
        &f.info,
        f.drain,
        service,
        grpc,
        DecodeService::metrics_text,
        shutdown,
    )
    .await
}
