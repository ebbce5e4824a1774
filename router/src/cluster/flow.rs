//! One request's trip through the cluster, as attempts of named stages:
//! [encode (images) →] select + reserve (decode) → prefill → respond (first token) → decode
//! (stream).
//!
//! A request with images first picks its prefill worker, has an encoder push the images'
//! embeddings there ([`encode`]), and widens each image placeholder to the image's rows; the
//! decode reservation and the prefill then use that widened prompt. A later attempt encodes
//! again (for the prefill worker it picks), which the encoder's cache makes cheap.
//!
//! An attempt that fails because a worker failed is retried on other workers (DESIGN §4): a
//! prefill failure before any token reached the client simply runs again; a decode failure
//! mid-stream migrates the request — prompt + the tokens streamed so far are prefilled again
//! (`resumed_tokens`) into another decode worker, which continues the same seeded stream, and
//! the client sees one stream with no token missing or repeated. Cancellation (the HTTP side
//! dropping its receiver) stops every hop.

use std::sync::Arc;
use std::time::Duration;

use tessera_proto::tonic::{Code, Status, Streaming};
use tessera_proto::v1;
use tokio::sync::mpsc;

use super::error::{retryable, to_backend, worker_down};
use super::pool::{Lease, PairWith, Role, Worker, WorkerPool};
use crate::backend::{
    BackendError, FinishReason, GenerationRequest, TokenEvent, TokenLogprobs, Usage,
};

mod encode;

use encode::cancel_in_background;

/// Why a request stopped early.
pub(crate) enum Stop {
    Failed(BackendError),
    /// The receiver was dropped: nobody is listening any more.
    Cancelled,
}

/// Why one attempt failed, and which worker the next attempt avoids.
struct Fault {
    stop: Stop,
    /// The worker that failed; `None` when no worker is to blame (none left to pick, or the
    /// client went away).
    culprit: Option<(Role, String)>,
    /// Whether another worker may succeed where this one failed.
    retry: bool,
    /// The culprit refused because it restarted after the pick: the next attempt may take it
    /// again (its new life), so it is not avoided.
    restarted: bool,
}

impl From<Stop> for Fault {
    fn from(stop: Stop) -> Self {
        Fault {
            stop,
            culprit: None,
            restarted: false,
            retry: false,
        }
    }
}

type Step<T> = Result<T, Fault>;

/// What the client has been sent so far; kept across attempts, so a migrated request continues
/// its stream instead of starting it again.
#[derive(Default)]
struct Progress {
    /// Completion tokens streamed (the first one came from prefill).
    tokens: Vec<u32>,
    /// Whether `Prefilled` was sent (by the first attempt that reached its first token).
    prefilled: bool,
    /// Prompt tokens that attempt's prefill took from its cache (reported in the usage).
    cached: usize,
}

/// The prompt one attempt runs: the request's prompt, then the tokens already streamed.
struct Attempt {
    /// The request id on the wire: the request's id for the first attempt, `<id>.<n>` for the
    /// n-th, so that clean-up of a failed attempt (`Cancel` by id) never hits the next one.
    wire_id: String,
    prompt: Vec<u32>,
    resumed: usize,
    /// The request's prompt tokens (image placeholders widened), without the resumed ones.
    prompt_tokens: usize,
    /// The request's `max_tokens`, less what widened placeholders took of the context.
    max_tokens: usize,
    /// The images' embeddings, already in the chosen prefill worker's buffers.
    images: Vec<v1::ImageInput>,
}

/// A decode reservation: the worker (its in-flight slot held), its reply, and the wire id of
/// the attempt that made it.
struct Placed {
    decode: Lease,
    reply: v1::ReserveReply,
    wire_id: String,
}

/// Attempts per request: the first and up to three more, each avoiding the workers that failed.
const MAX_ATTEMPTS: usize = 4;

/// Bound on the clean-up RPCs (release, cancel) so a dead worker cannot hold a request task.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(2);

/// Bound on a reservation's release, which runs in a task of its own: as long as a decode
/// worker's default reservation lasts, so that a busy worker still frees the pages when it
/// gets to the call (a shorter bound drops the call, and the pages wait for the reservation to
/// expire).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// Prefill errors that say the transfer into the decode worker failed: the next attempt avoids
/// that decode worker (the prefill worker answered, so it is alive).
const DECODE_SIDE_CODES: [v1::ErrorCode; 5] = [
    v1::ErrorCode::TransferFailed,
    v1::ErrorCode::TransferTimeout,
    v1::ErrorCode::ReservationExpired,
    v1::ErrorCode::StaleIncarnation,
    v1::ErrorCode::ChecksumMismatch,
];

pub(crate) struct Flow {
    pub pool: Arc<WorkerPool>,
    pub req: GenerationRequest,
    pub tx: mpsc::Sender<TokenEvent>,
    pub sampling: v1::SamplingParams,
    pub reserve_ttl_ms: u32,
    /// Prompt + completion tokens at most (checked again once placeholders are widened).
    pub max_model_len: usize,
    /// The model's image placeholder token (requests with images need one).
    pub image_token_id: Option<u32>,
    /// A hash of the request's images ([`crate::images::cache_salt`]); empty for text-only.
    /// Every worker mixes it into its prefix-cache keys, so the same tokens with other images
    /// never share pages, on prefill or on decode.
    pub cache_salt: Vec<u8>,
}

/// Workers a new attempt stays away from, by role.
#[derive(Default)]
struct Avoid {
    prefill: Vec<String>,
    decode: Vec<String>,
    encoder: Vec<String>,
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

    async fn serve(&self) -> Result<(), Stop> {
        let mut progress = Progress::default();
        let mut avoid = Avoid::default();
        let mut first_error = None;
        for attempt in 1.. {
            let fault = match self.attempt(attempt, &mut progress, &avoid).await {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
            let e = match fault.stop {
                Stop::Cancelled => return Err(Stop::Cancelled),
                Stop::Failed(e) => e,
            };
            let culprit = match fault.culprit {
                Some(c) if fault.retry && attempt < MAX_ATTEMPTS => c,
                // Nobody left to try: the client learns why the first attempt failed, not
                // that a retry found no worker.
                None => return Err(Stop::Failed(first_error.unwrap_or(e))),
                Some(_) => return Err(Stop::Failed(e)),
            };
            let (role, addr) = culprit;
            if progress.tokens.is_empty() {
                tracing::info!(request_id = %self.req.request_id, role = role.name(), worker = %addr, "retrying on another worker");
                self.pool.count_retry(role);
            } else {
                tracing::info!(request_id = %self.req.request_id, role = role.name(), worker = %addr, streamed = progress.tokens.len(), "migrating the request to other workers");
                self.pool.count_migration();
            }
            match (role, fault.restarted) {
                (_, true) => {}
                (Role::Prefill, false) => avoid.prefill.push(addr),
                (Role::Decode, false) => avoid.decode.push(addr),
                (Role::Encoder, false) => avoid.encoder.push(addr),
            }
            first_error.get_or_insert(e);
        }
        unreachable!("the attempt loop returns")
    }

    /// Attempt number `n` (from 1), from where `progress` stands.
    async fn attempt(&self, n: usize, progress: &mut Progress, avoid: &Avoid) -> Step<()> {
        let wire_id = match n {
            1 => self.req.request_id.clone(),
            n => format!("{}.{n}", self.req.request_id),
        };
        let (run, prefill) = if self.req.images.is_empty() {
            let mut prompt = self.req.prompt_ids.clone();
            prompt.extend(&progress.tokens);
            let run = Attempt {
                wire_id,
                prompt_tokens: self.req.prompt_ids.len(),
                prompt,
                resumed: progress.tokens.len(),
                max_tokens: self.req.max_tokens,
                images: Vec::new(),
            };
            (run, None)
        } else {
            let (run, prefill) = self.with_images(wire_id, progress, avoid).await?;
            (run, Some(prefill))
        };
        let pair = prefill
            .as_deref()
            .map_or(PairWith::AnyBut(&avoid.prefill), PairWith::Worker);
        let placed = match self.reserve(&run, &avoid.decode, pair).await {
            Ok(p) => p,
            Err(f) => {
                if let Some(p) = &prefill {
                    cancel_in_background(p, &run.wire_id);
                }
                return Err(f);
            }
        };
        let first = match self.prefill(&run, &placed, &avoid.prefill, prefill).await {
            Ok(reply) => reply,
            Err(f) => {
                self.release_in_background(&placed);
                return Err(f);
            }
        };
        if self.respond(&run, &placed, &first, progress).await? {
            return Ok(());
        }
        self.decode(&run, &placed, &first, progress).await
    }

    // ---- stage 1+2: select a decode worker and reserve pages (another decode on failure) ----

    /// `prefill`: the prefill worker already chosen, or those the attempt may still use (the
    /// decode worker must speak their page transport).
    async fn reserve(
        &self,
        run: &Attempt,
        avoid: &[String],
        prefill: PairWith<'_>,
    ) -> Step<Placed> {
        let mut tried: Vec<String> = avoid.to_vec();
        let mut last = None;
        loop {
            let Some(decode) = self.pool.pick_decode_for(&tried, prefill) else {
                let e = last.unwrap_or_else(|| {
                    let why = self.pool.unpaired(Role::Decode, &tried, prefill);
                    BackendError::Unavailable(
                        why.unwrap_or_else(|| "no healthy decode worker".into()),
                    )
                });
                return Err(Stop::Failed(e).into());
            };
            if tried.len() > avoid.len() {
                self.pool.count_retry(Role::Decode);
            }
            let msg = v1::ReserveRequest {
                request_id: run.wire_id.clone(),
                prompt_token_ids: run.prompt.clone(),
                max_tokens: (run.max_tokens - run.resumed) as u32,
                ttl_ms: self.reserve_ttl_ms,
                cache_salt: self.cache_salt.clone(),
                ..Default::default()
            };
            let r = decode
                .decode_client()
                .reserve_pages(decode.request(msg))
                .await;
            match r {
                Ok(reply) => {
                    decode.record_success();
                    let placed = Placed {
                        decode,
                        reply: reply.into_inner(),
                        wire_id: run.wire_id.clone(),
                    };
                    if self.tx.is_closed() {
                        self.release_in_background(&placed);
                        return Err(Stop::Cancelled.into());
                    }
                    return Ok(placed);
                }
                Err(s) => {
                    let e = self.worker_failed(&decode, "reserve pages", &s);
                    if !retryable(&s) {
                        return Err(Stop::Failed(e).into());
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
        run: &Attempt,
        placed: &Placed,
        avoid: &[String],
        chosen: Option<Lease>,
    ) -> Step<v1::PrefillReply> {
        let prefill = match chosen {
            Some(p) => p,
            None => self.pick_prefill(&run.prompt, avoid, PairWith::Worker(&placed.decode))?,
        };
        let r = &placed.reply;
        let msg = v1::PrefillRequest {
            request_id: run.wire_id.clone(),
            prompt_token_ids: run.prompt.clone(),
            sampling: Some(self.sampling.clone()),
            destination: Some(v1::KvDestination::for_reservation(
                placed.decode.addr.clone(),
                r,
            )),
            resumed_tokens: run.resumed as u32,
            images: run.images.clone(),
            cache_salt: self.cache_salt.clone(),
            logprobs: self.req.logprobs,
            ..Default::default()
        };
        let mut client = prefill.prefill_client();
        let result = tokio::select! {
            r = client.prefill(prefill.request(msg)) => r,
            _ = self.tx.closed() => {
                cancel_on(&prefill, &run.wire_id).await;
                return Err(Stop::Cancelled.into());
            }
        };
        if result.is_ok() {
            prefill.record_success();
        }
        result.map(|r| r.into_inner()).map_err(|s| {
            // A stale incarnation naming the prefill worker is its own; otherwise the decode
            // worker's it forwarded to.
            let restarted = prefill.refused_as_restarted(&s);
            let decode_side = !restarted
                && v1::ErrorDetail::from_status(&s)
                    .is_some_and(|d| DECODE_SIDE_CODES.iter().any(|&c| c as i32 == d.code));
            let culprit: &Worker = if decode_side {
                &placed.decode
            } else {
                &prefill
            };
            Fault {
                stop: Stop::Failed(self.worker_failed(culprit, "prefill", &s)),
                culprit: Some((culprit.role, culprit.addr.clone())),
                retry: retryable(&s),
                restarted,
            }
        })
    }

    // ---- stage 4: respond with the first token; true when that already finished the request ----

    async fn respond(
        &self,
        run: &Attempt,
        placed: &Placed,
        first: &v1::PrefillReply,
        progress: &mut Progress,
    ) -> Step<bool> {
        let mut emitted = Ok(());
        if !progress.prefilled {
            progress.prefilled = true;
            progress.cached = first.cached_tokens as usize;
            emitted = self
                .emit(TokenEvent::Prefilled {
                    cached_tokens: progress.cached,
                })
                .await;
        }
        if emitted.is_ok() {
            if let Some(lp) = &first.first_token_logprobs {
                emitted = self
                    .emit(TokenEvent::Logprobs(logprobs_from_wire(lp)))
                    .await;
            }
        }
        if emitted.is_ok() {
            emitted = self.emit(TokenEvent::Token(first.first_token)).await;
            progress.tokens.push(first.first_token);
        }
        let reason = if self.req.stop_token_ids.contains(&first.first_token) {
            Some(FinishReason::Stop)
        } else if progress.tokens.len() >= run.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if emitted.is_err() || reason.is_some() {
            // Decode never starts: give its pages back.
            self.release_in_background(placed);
        }
        emitted?;
        let Some(reason) = reason else {
            return Ok(false);
        };
        let usage = Usage {
            prompt_tokens: run.prompt_tokens,
            completion_tokens: progress.tokens.len(),
            cached_tokens: progress.cached,
        };
        self.emit(TokenEvent::Finished { reason, usage }).await?;
        Ok(true)
    }

    // ---- stage 5: decode on the reservation and forward its stream ----

    async fn decode(
        &self,
        run: &Attempt,
        placed: &Placed,
        first: &v1::PrefillReply,
        progress: &mut Progress,
    ) -> Step<()> {
        let msg = v1::StartDecodeRequest {
            request_id: run.wire_id.clone(),
            target_incarnation: placed.reply.incarnation_id,
            reservation_id: placed.reply.reservation_id.clone(),
            prompt_token_ids: run.prompt.clone(),
            first_token: first.first_token,
            sampling: Some(self.sampling.clone()),
            max_tokens: run.max_tokens as u32,
            stop_token_ids: self.req.stop_token_ids.clone(),
            ignore_eos: self.req.ignore_eos,
            resumed_tokens: run.resumed as u32,
            cached_tokens: progress.cached as u32,
            cache_salt: self.cache_salt.clone(),
            logprobs: self.req.logprobs,
        };
        let decode = &placed.decode;
        let mut client = decode.decode_client();
        let started = tokio::select! {
            r = client.start_decode(decode.request(msg)) => r,
            _ = self.tx.closed() => {
                self.release_in_background(placed);
                return Err(Stop::Cancelled.into());
            }
        };
        let stream = match started {
            Ok(s) => s.into_inner(),
            Err(s) => {
                self.release_in_background(placed);
                return Err(self.decode_fault(decode, "start decode", &s));
            }
        };
        let r = self.forward(run, decode, stream, progress).await;
        match &r {
            // The stream is dropped already (which cancels on decode); say so explicitly too.
            Err(f) if matches!(f.stop, Stop::Cancelled) => cancel_on(decode, &run.wire_id).await,
            // Whatever the failed worker still holds for this request, free it.
            Err(_) => self.release_in_background(placed),
            Ok(()) => {}
        }
        r
    }

    /// Forwards decode's chunks as events until the chunk with a finish reason.
    async fn forward(
        &self,
        run: &Attempt,
        decode: &Lease,
        mut stream: Streaming<v1::TokenChunk>,
        progress: &mut Progress,
    ) -> Step<()> {
        loop {
            let item = tokio::select! {
                m = stream.message() => m,
                _ = self.tx.closed() => return Err(Stop::Cancelled.into()),
            };
            let chunk = match item {
                Ok(Some(c)) => c,
                Ok(None) => return Err(self.broken_stream(decode, "ended without a finish reason")),
                Err(s) => return Err(self.decode_fault(decode, "decode", &s)),
            };
            for (i, &t) in chunk.token_ids.iter().enumerate() {
                // Completion index of `t`; the stream may repeat tokens already sent, never
                // skip one.
                let index = chunk.offset as usize + i;
                match index.cmp(&progress.tokens.len()) {
                    std::cmp::Ordering::Less => {}
                    std::cmp::Ordering::Equal => {
                        if let Some(lp) = chunk.logprobs.get(i) {
                            self.emit(TokenEvent::Logprobs(logprobs_from_wire(lp)))
                                .await?;
                        }
                        self.emit(TokenEvent::Token(t)).await?;
                        progress.tokens.push(t);
                    }
                    std::cmp::Ordering::Greater => {
                        return Err(self.broken_stream(decode, "skipped a token"))
                    }
                }
            }
            if chunk.finish_reason != v1::FinishReason::Unspecified as i32 {
                decode.record_success();
                return self.finish(run, &chunk, progress).await;
            }
        }
    }

    async fn finish(&self, run: &Attempt, chunk: &v1::TokenChunk, progress: &Progress) -> Step<()> {
        let reason = match v1::FinishReason::try_from(chunk.finish_reason) {
            Ok(v1::FinishReason::Stop) => FinishReason::Stop,
            Ok(v1::FinishReason::Length) => FinishReason::Length,
            Ok(v1::FinishReason::Cancelled) => FinishReason::Cancelled,
            _ => {
                return Err(Stop::Failed(BackendError::Internal(
                    "the decode worker failed the request".into(),
                ))
                .into())
            }
        };
        let usage = match chunk.usage {
            Some(u) => Usage {
                prompt_tokens: u.prompt_tokens as usize,
                completion_tokens: u.completion_tokens as usize,
                cached_tokens: u.cached_tokens as usize,
            },
            None => Usage {
                prompt_tokens: run.prompt_tokens,
                completion_tokens: progress.tokens.len(),
                cached_tokens: progress.cached,
            },
        };
        self.emit(TokenEvent::Finished { reason, usage })
            .await
            .map_err(Fault::from)
    }

    // ---- helpers ----

    /// A prefill worker for `prompt` that can write into `decode` (the decode worker already
    /// chosen, or those the attempt may still use), or why there is none.
    fn pick_prefill(&self, prompt: &[u32], avoid: &[String], decode: PairWith<'_>) -> Step<Lease> {
        self.pool
            .pick_prefill_for(prompt, avoid, decode)
            .ok_or_else(|| {
                let why = self.pool.unpaired(Role::Prefill, avoid, decode);
                let e = BackendError::Unavailable(
                    why.unwrap_or_else(|| "no healthy prefill worker".into()),
                );
                Stop::Failed(e).into()
            })
    }

    async fn emit(&self, e: TokenEvent) -> Result<(), Stop> {
        self.tx.send(e).await.map_err(|_| Stop::Cancelled)
    }

    /// Counts a worker's failure, takes it out of routing when it looks gone, and maps the error.
    fn worker_failed(&self, w: &Worker, what: &str, s: &Status) -> BackendError {
        // Full, or the request's fault: no reason to think the worker broken.
        let broken = !matches!(
            s.code(),
            Code::ResourceExhausted | Code::InvalidArgument | Code::OutOfRange | Code::Cancelled
        );
        w.record_failure(broken);
        if worker_down(s) {
            w.mark_unhealthy();
        }
        tracing::warn!(request_id = %self.req.request_id, role = w.role.name(), worker = %w.addr, code = ?s.code(), "{what} failed: {}", s.message());
        to_backend(what, s)
    }

    /// A decode worker's failure: the next attempt migrates the request elsewhere.
    fn decode_fault(&self, decode: &Worker, what: &str, s: &Status) -> Fault {
        let restarted = decode.refused_as_restarted(s);
        Fault {
            stop: Stop::Failed(self.worker_failed(decode, what, s)),
            culprit: Some((Role::Decode, decode.addr.clone())),
            retry: retryable(s),
            restarted,
        }
    }

    /// A decode stream that broke its contract (ended early, skipped a token).
    fn broken_stream(&self, decode: &Worker, what: &str) -> Fault {
        decode.record_failure(true);
        tracing::warn!(request_id = %self.req.request_id, worker = %decode.addr, "the decode stream {what}");
        Fault {
            stop: Stop::Failed(BackendError::Internal(format!("the decode stream {what}"))),
            culprit: Some((Role::Decode, decode.addr.clone())),
            retry: true,
            restarted: false,
        }
    }

    /// Frees a reservation in a task of its own: the request is over (or moves on to other
    /// workers), and the worker may answer slowly or never.
    fn release_in_background(&self, placed: &Placed) {
        let decode = placed.decode.0.clone();
        let (id, reply) = (placed.wire_id.clone(), placed.reply.clone());
        tokio::spawn(async move { release_on(&decode, &id, &reply).await });
    }
}

/// Frees a reservation that will not (or no longer) decode: `ReleaseReservation`, then
/// `Cancel` by request id (which also stops a decode that did start).
async fn release_on(decode: &Worker, request_id: &str, reply: &v1::ReserveReply) {
    let msg = v1::ReleaseReservationRequest {
        request_id: request_id.to_string(),
        target_incarnation: reply.incarnation_id,
        reservation_id: reply.reservation_id.clone(),
    };
    let mut c = decode.decode_client();
    let _ = tokio::time::timeout(RELEASE_TIMEOUT, c.release_reservation(decode.request(msg))).await;
    cancel_within(decode, request_id, RELEASE_TIMEOUT).await;
}

/// `Cancel` on one worker (idempotent; errors ignored).
async fn cancel_on(w: &Worker, request_id: &str) {
    cancel_within(w, request_id, CLEANUP_TIMEOUT).await;
}

/// [`cancel_on`] with its own bound.
async fn cancel_within(w: &Worker, request_id: &str, bound: Duration) {
    let msg = v1::CancelRequest {
        request_id: request_id.to_string(),
        target_incarnation: 0,
        reason: "cancelled by the router".into(),
    };
    let call = async {
        match w.role {
            Role::Decode => w.decode_client().cancel(w.request(msg)).await.map(drop),
            Role::Prefill => w.prefill_client().cancel(w.request(msg)).await.map(drop),
            // Encoders hold nothing for a request once `Encode` returned.
            Role::Encoder => Ok(()),
        }
    };
    let _ = tokio::time::timeout(bound, call).await;
}

/// One token's log-probabilities from the wire (alternatives past the shorter of the two lists
/// are dropped).
fn logprobs_from_wire(lp: &v1::TokenLogprobs) -> TokenLogprobs {
    TokenLogprobs {
        token: lp.token_id,
        logprob: lp.logprob,
        top: lp
            .top_ids
            .iter()
            .copied()
            .zip(lp.top_logprobs.iter().copied())
            .collect(),
    }
}
