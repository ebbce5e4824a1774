//! One request's trip through the cluster, as named stages:
//! select + reserve (decode) → prefill → respond (first token) → decode (stream) — with the
//! retries of DESIGN §4 and cancellation when the HTTP side drops its receiver.

use std::sync::Arc;
use std::time::Duration;

use tessera_proto::tonic::{Status, Streaming};
use tessera_proto::v1;
use tokio::sync::mpsc;

use super::error::{retryable, to_backend, worker_down};
use super::pool::{Lease, Role, WorkerPool};
use crate::backend::{BackendError, FinishReason, GenerationRequest, TokenEvent, Usage};

/// Why a request stopped early.
pub(crate) enum Stop {
    Failed(BackendError),
    /// The receiver was dropped: nobody is listening any more.
    Cancelled,
}

type Step<T> = Result<T, Stop>;

/// A decode reservation: the worker (its in-flight slot held) and its reply.
struct Placed {
    decode: Lease,
    reply: v1::ReserveReply,
}

/// A failed prefill attempt.
struct PrefillFailure {
    addr: Option<String>,
    stop: Stop,
    retry: bool,
}

/// Bound on the clean-up RPCs (release, cancel) so a dead worker cannot hold a request task.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) struct Flow {
    pub pool: Arc<WorkerPool>,
    pub req: GenerationRequest,
    pub tx: mpsc::Sender<TokenEvent>,
    pub sampling: v1::SamplingParams,
    pub reserve_ttl_ms: u32,
}

impl Flow {
    /// Runs the request to its end; errors become a final [`TokenEvent::Failed`].
    pub async fn run(self) {
        match self.serve().await {
            Ok(()) => {}
            Err(Stop::Failed(e)) => {
                tracing::warn!(request_id = %self.req.request_id, error = %e, "request failed");
                let _ = self.tx.send(TokenEvent::Failed(e)).await;
            }
            Err(Stop::Cancelled) => {
                tracing::debug!(request_id = %self.req.request_id, "request cancelled by the client");
            }
        }
    }

    async fn serve(&self) -> Step<()> {
        let mut tried_prefill = Vec::new();
        let mut first_failure = None;
        let (placed, first) = loop {
            let placed = self.reserve().await?;
            match self.prefill(&placed, &tried_prefill).await {
                Ok(reply) => break (placed, reply),
                Err(f) => {
                    self.release(&placed).await;
                    match (f.retry, f.addr) {
                        (true, Some(addr)) if tried_prefill.is_empty() => {
                            tracing::info!(request_id = %self.req.request_id, prefill = %addr, "retrying prefill on another worker");
                            self.pool.count_retry(Role::Prefill);
                            tried_prefill.push(addr);
                            first_failure = Some(f.stop);
                        }
                        // No other prefill worker to retry on: the client learns why the first
                        // attempt failed, not that the retry found nobody.
                        (false, None) if matches!(f.stop, Stop::Failed(_)) => {
                            return Err(first_failure.unwrap_or(f.stop))
                        }
                        _ => return Err(f.stop),
                    }
                }
            }
        };
        if self.respond(&placed, &first).await? {
            return Ok(());
        }
        self.decode(&placed, &first).await
    }

    // ---- stage 1+2: select a decode worker and reserve pages (another decode on failure) ----

    async fn reserve(&self) -> Step<Placed> {
        let mut tried: Vec<String> = Vec::new();
        let mut last = None;
        loop {
            let Some(decode) = self.pool.pick_decode(&tried) else {
                return Err(Stop::Failed(last.unwrap_or_else(|| {
                    BackendError::Unavailable("no healthy decode worker".into())
                })));
            };
            if !tried.is_empty() {
                self.pool.count_retry(Role::Decode);
            }
            let msg = v1::ReserveRequest {
                request_id: self.req.request_id.clone(),
                prompt_token_ids: self.req.prompt_ids.clone(),
                max_tokens: self.req.max_tokens as u32,
                ttl_ms: self.reserve_ttl_ms,
                ..Default::default()
            };
            let r = decode
                .decode_client()
                .reserve_pages(decode.request(msg))
                .await;
            match r {
                Ok(reply) => {
                    let placed = Placed {
                        decode,
                        reply: reply.into_inner(),
                    };
                    if self.tx.is_closed() {
                        self.release(&placed).await;
                        return Err(Stop::Cancelled);
                    }
                    return Ok(placed);
                }
                Err(s) => {
                    let e = self.worker_failed(&decode, "reserve pages", &s);
                    if !retryable(&s) {
                        return Err(Stop::Failed(e));
                    }
                    tried.push(decode.addr.clone());
                    last = Some(e);
                }
            }
        }
    }

    // ---- stage 3: prefill into the reservation ----

    async fn prefill(
        &self,
        placed: &Placed,
        exclude: &[String],
    ) -> Result<v1::PrefillReply, PrefillFailure> {
        let Some(prefill) = self.pool.pick_prefill(&self.req.prompt_ids, exclude) else {
            return Err(PrefillFailure {
                addr: None,
                stop: Stop::Failed(BackendError::Unavailable(
                    "no healthy prefill worker".into(),
                )),
                retry: false,
            });
        };
        let r = &placed.reply;
        let msg = v1::PrefillRequest {
            request_id: self.req.request_id.clone(),
            prompt_token_ids: self.req.prompt_ids.clone(),
            sampling: Some(self.sampling),
            destination: Some(v1::KvDestination {
                decode_incarnation_id: r.incarnation_id,
                decode_grpc_address: placed.decode.addr.clone(),
                reservation_id: r.reservation_id.clone(),
                cached_tokens: r.cached_tokens,
                mla_page_ids: r.mla_page_ids.clone(),
                kda_state_page_ids: r.kda_state_page_ids.clone(),
                // Pages that arrive after the reservation expired are refused anyway.
                transfer_timeout_ms: r.ttl_ms,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut client = prefill.prefill_client();
        let result = tokio::select! {
            r = client.prefill(prefill.request(msg)) => r,
            _ = self.tx.closed() => {
                self.cancel_on(&prefill).await;
                return Err(PrefillFailure { addr: None, stop: Stop::Cancelled, retry: false });
            }
        };
        result.map(|r| r.into_inner()).map_err(|s| PrefillFailure {
            stop: Stop::Failed(self.worker_failed(&prefill, "prefill", &s)),
            retry: retryable(&s),
            addr: Some(prefill.addr.clone()),
        })
    }

    // ---- stage 4: respond with the first token; true when that already finished the request ----

    async fn respond(&self, placed: &Placed, first: &v1::PrefillReply) -> Step<bool> {
        let cached = first.cached_tokens as usize;
        let emitted = match self
            .emit(TokenEvent::Prefilled {
                cached_tokens: cached,
            })
            .await
        {
            Ok(()) => self.emit(TokenEvent::Token(first.first_token)).await,
            Err(e) => Err(e),
        };
        let reason = if self.req.stop_token_ids.contains(&first.first_token) {
            Some(FinishReason::Stop)
        } else if self.req.max_tokens <= 1 {
            Some(FinishReason::Length)
        } else {
            None
        };
        if emitted.is_err() || reason.is_some() {
            // Decode never starts: give its pages back.
            self.release(placed).await;
        }
        emitted?;
        let Some(reason) = reason else {
            return Ok(false);
        };
        let usage = Usage {
            prompt_tokens: self.req.prompt_ids.len(),
            completion_tokens: 1,
            cached_tokens: cached,
        };
        self.emit(TokenEvent::Finished { reason, usage }).await?;
        Ok(true)
    }

    // ---- stage 5: decode on the reservation and forward its stream ----

    async fn decode(&self, placed: &Placed, first: &v1::PrefillReply) -> Step<()> {
        let msg = v1::StartDecodeRequest {
            request_id: self.req.request_id.clone(),
            target_incarnation: placed.reply.incarnation_id,
            reservation_id: placed.reply.reservation_id.clone(),
            prompt_token_ids: self.req.prompt_ids.clone(),
            first_token: first.first_token,
            sampling: Some(self.sampling),
            max_tokens: self.req.max_tokens as u32,
            stop_token_ids: self.req.stop_token_ids.clone(),
            ignore_eos: self.req.ignore_eos,
            cached_tokens: first.cached_tokens,
            ..Default::default()
        };
        let decode = &placed.decode;
        let mut client = decode.decode_client();
        let started = tokio::select! {
            r = client.start_decode(decode.request(msg)) => r,
            _ = self.tx.closed() => {
                self.release(placed).await;
                return Err(Stop::Cancelled);
            }
        };
        let stream = match started {
            Ok(s) => s.into_inner(),
            Err(s) => {
                self.release(placed).await;
                return Err(Stop::Failed(self.worker_failed(decode, "start decode", &s)));
            }
        };
        let r = self.forward(decode, stream).await;
        if matches!(r, Err(Stop::Cancelled)) {
            // The stream is dropped already (which cancels on decode); say so explicitly too.
            self.cancel_on(decode).await;
        }
        r
    }

    /// Forwards decode's chunks as events until the chunk with a finish reason.
    async fn forward(&self, decode: &Lease, mut stream: Streaming<v1::TokenChunk>) -> Step<()> {
        // Completion index of the next token we expect (the first token was index 0).
        let mut next = 1u32;
        loop {
            let item = tokio::select! {
                m = stream.message() => m,
                _ = self.tx.closed() => return Err(Stop::Cancelled),
            };
            let chunk = match item {
                Ok(Some(c)) => c,
                Ok(None) => {
                    decode.record_failure();
                    return Err(Stop::Failed(BackendError::Internal(
                        "the decode stream ended without a finish reason".into(),
                    )));
                }
                Err(s) => return Err(Stop::Failed(self.worker_failed(decode, "decode", &s))),
            };
            for (i, &t) in chunk.token_ids.iter().enumerate() {
                // Skip duplicates (offsets let a resumed stream overlap).
                if chunk.offset + i as u32 >= next {
                    next = chunk.offset + i as u32 + 1;
                    self.emit(TokenEvent::Token(t)).await?;
                }
            }
            if chunk.finish_reason != v1::FinishReason::Unspecified as i32 {
                return self.finish(&chunk, next as usize).await;
            }
        }
    }

    async fn finish(&self, chunk: &v1::TokenChunk, completion: usize) -> Step<()> {
        let reason = match v1::FinishReason::try_from(chunk.finish_reason) {
            Ok(v1::FinishReason::Stop) => FinishReason::Stop,
            Ok(v1::FinishReason::Length) => FinishReason::Length,
            Ok(v1::FinishReason::Cancelled) => FinishReason::Cancelled,
            _ => {
                return Err(Stop::Failed(BackendError::Internal(
                    "the decode worker failed the request".into(),
                )))
            }
        };
        let usage = match chunk.usage {
            Some(u) => Usage {
                prompt_tokens: u.prompt_tokens as usize,
                completion_tokens: u.completion_tokens as usize,
                cached_tokens: u.cached_tokens as usize,
            },
            None => Usage {
                prompt_tokens: self.req.prompt_ids.len(),
                completion_tokens: completion,
                cached_tokens: 0,
            },
        };
        self.emit(TokenEvent::Finished { reason, usage }).await
    }

    // ---- helpers ----

    async fn emit(&self, e: TokenEvent) -> Step<()> {
        self.tx.send(e).await.map_err(|_| Stop::Cancelled)
    }

    /// Counts a worker's failure, takes it out of routing when it looks gone, and maps the error.
    fn worker_failed(&self, w: &Lease, what: &str, s: &Status) -> BackendError {
        w.record_failure();
        if worker_down(s) {
            w.mark_unhealthy();
        }
        tracing::warn!(request_id = %self.req.request_id, role = w.role.name(), worker = %w.addr, code = ?s.code(), "{what} failed: {}", s.message());
        to_backend(what, s)
    }

    /// Frees a reservation that will not (or no longer) decode: `ReleaseReservation`, then
    /// `Cancel` by request id (which also stops a decode that did start).
    async fn release(&self, placed: &Placed) {
        let d = &placed.decode;
        let msg = v1::ReleaseReservationRequest {
            request_id: self.req.request_id.clone(),
            target_incarnation: placed.reply.incarnation_id,
            reservation_id: placed.reply.reservation_id.clone(),
        };
        let mut c = d.decode_client();
        let _ = tokio::time::timeout(CLEANUP_TIMEOUT, c.release_reservation(d.request(msg))).await;
        self.cancel_on(d).await;
    }

    /// `Cancel` on one worker (idempotent; errors ignored).
    async fn cancel_on(&self, w: &Lease) {
        let msg = v1::CancelRequest {
            request_id: self.req.request_id.clone(),
            target_incarnation: 0,
            reason: "cancelled by the router".into(),
        };
        let call = async {
            match w.role {
                Role::Decode => w.decode_client().cancel(w.request(msg)).await.map(drop),
                Role::Prefill => w.prefill_client().cancel(w.request(msg)).await.map(drop),
            }
        };
        let _ = tokio::time::timeout(CLEANUP_TIMEOUT, call).await;
    }
}
