//! Worker membership: one [`Worker`] per gRPC address (static flags, plus any that discovery adds
//! or removes at run time), with a lazily connected tonic channel, a health flag kept fresh by a
//! `grpc.health.v1` probe (and the worker's `Stats` for its load and incarnation), a circuit
//! breaker, and the router's own counters.
//!
//! The breaker covers what a health probe cannot see: a worker that answers its probes but fails
//! the requests it gets. After [`BREAKER_THRESHOLD`] failures in a row it takes the worker out of
//! routing for a cool-down (doubling up to [`BREAKER_MAX_COOLDOWN`] while failures go on); after
//! the cool-down requests reach it again (half-open): one success closes the breaker, one more
//! failure opens it again. A new incarnation (the process restarted) starts with a closed one.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use tessera_proto::health::pb::health_check_response::ServingStatus;
use tessera_proto::health::pb::health_client::HealthClient;
use tessera_proto::health::pb::HealthCheckRequest;
use tessera_proto::tls::{self, MutualTls};
use tessera_proto::tonic::metadata::MetadataValue;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::tonic::{self, Request};
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::encoder_worker_client::EncoderWorkerClient;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;

use super::policy::{self, Candidate};

mod pairing;

pub use pairing::PairWith;

/// Which pool a worker belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    Encoder,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Encoder => "encoder",
        }
    }
}

/// Largest `Encode` message the router sends (the images of one request).
pub const MAX_IMAGE_MESSAGE_BYTES: usize = 256 << 20;

/// Failures in a row that open a worker's circuit breaker.
pub const BREAKER_THRESHOLD: u32 = 5;
/// The first cool-down of an opened breaker; it doubles while failures go on.
pub const BREAKER_COOLDOWN: Duration = Duration::from_secs(1);
pub const BREAKER_MAX_COOLDOWN: Duration = Duration::from_secs(30);

/// A worker's circuit breaker (see the module docs).
#[derive(Debug)]
struct Breaker {
    /// Out of routing until then; `None` while closed.
    open_until: Option<Instant>,
    cooldown: Duration,
}

/// One worker as the router sees it.
pub struct Worker {
    /// `host:port` as configured (also what prefill uses to reach a decode worker).
    pub addr: String,
    pub role: Role,
    channel: Channel,
    auth: Option<MetadataValue<tonic::metadata::Ascii>>,
    healthy: AtomicBool,
    inflight: AtomicUsize,
    remote_load: AtomicUsize,
    routed: AtomicU64,
    failures: AtomicU64,
    /// Failures since the last success.
    failures_in_a_row: AtomicU32,
    breaker: Mutex<Breaker>,
    /// The process's incarnation as its last `Stats` (or its registration) gave it; 0 unknown.
    incarnation: AtomicU64,
    restarts: AtomicU64,
    /// The page transport (`v1::TransferBackend`) its last `Stats` advertised; -1 unknown.
    transport: AtomicI32,
    /// The stable name its last `Stats` gave (empty before the first); error details carry it.
    worker_id: Mutex<String>,
}

impl Worker {
    fn new(
        addr: &str,
        role: Role,
        auth: Option<&str>,
        tls: Option<&MutualTls>,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let addr = addr.trim();
        let plain = match addr.split_once("://") {
            Some((_, rest)) => rest.trim_end_matches('/').to_string(),
            None => addr.to_string(),
        };
        let channel = tls::endpoint(addr, tls)
            .map_err(|e| anyhow::anyhow!("{} worker: {e}", role.name()))?
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        let auth = auth
            .map(|s| format!("Bearer {s}").parse())
            .transpose()
            .map_err(|_| anyhow::anyhow!("the auth secret is not valid in a gRPC header"))?;
        Ok(Worker {
            addr: plain,
            role,
            channel,
            auth,
            healthy: AtomicBool::new(true),
            inflight: AtomicUsize::new(0),
            remote_load: AtomicUsize::new(0),
            routed: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            failures_in_a_row: AtomicU32::new(0),
            breaker: Mutex::new(Breaker {
                open_until: None,
                cooldown: BREAKER_COOLDOWN,
            }),
            incarnation: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            transport: AtomicI32::new(-1),
            worker_id: Mutex::new(String::new()),
        })
    }

    /// A request carrying the cluster's `authorization` metadata.
    pub fn request<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(a) = &self.auth {
            r.metadata_mut().insert("authorization", a.clone());
        }
        r
    }

    pub fn decode_client(&self) -> DecodeWorkerClient<Channel> {
        DecodeWorkerClient::new(self.channel.clone())
    }

    pub fn prefill_client(&self) -> PrefillWorkerClient<Channel> {
        PrefillWorkerClient::new(self.channel.clone())
    }

    /// An encoder client that may send whole images (gRPC's default is 4 MiB a message).
    pub fn encoder_client(&self) -> EncoderWorkerClient<Channel> {
        EncoderWorkerClient::new(self.channel.clone())
            .max_encoding_message_size(MAX_IMAGE_MESSAGE_BYTES)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Takes the worker out of routing until the next successful health probe.
    pub fn mark_unhealthy(&self) {
        if self.healthy.swap(false, Ordering::AcqRel) {
            tracing::warn!(role = self.role.name(), addr = %self.addr, "worker marked unhealthy");
        }
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// Whether requests may go to the worker: healthy, and its breaker not open.
    pub fn is_routable(&self) -> bool {
        self.is_healthy() && !self.breaker_open()
    }

    /// Whether the breaker holds the worker out of routing now.
    pub fn breaker_open(&self) -> bool {
        let b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        b.open_until.is_some_and(|t| Instant::now() < t)
    }

    /// Counts a failed call. `broken` says whether it speaks of the worker (a transport error,
    /// an internal error) rather than of its load or the request (out of pages, bad input);
    /// only those move the breaker.
    pub fn record_failure(&self, broken: bool) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if !broken {
            return;
        }
        let n = self.failures_in_a_row.fetch_add(1, Ordering::AcqRel) + 1;
        if n < BREAKER_THRESHOLD {
            return;
        }
        let mut b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if b.open_until.is_some_and(|t| now < t) {
            return; // already open: calls that were in flight when it opened
        }
        b.open_until = Some(now + b.cooldown);
        tracing::warn!(role = self.role.name(), addr = %self.addr, failures_in_a_row = n, cooldown_ms = b.cooldown.as_millis() as u64, "circuit breaker opened");
        b.cooldown = (b.cooldown * 2).min(BREAKER_MAX_COOLDOWN);
    }

    /// Counts a successful call: closes the breaker.
    pub fn record_success(&self) {
        if self.failures_in_a_row.swap(0, Ordering::AcqRel) == 0 {
            return;
        }
        self.close_breaker();
    }

    fn close_breaker(&self) {
        let mut b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        if b.open_until.take().is_some() {
            tracing::info!(role = self.role.name(), addr = %self.addr, "circuit breaker closed");
        }
        b.cooldown = BREAKER_COOLDOWN;
    }

    /// Whether `status` is this worker refusing a request aimed at an earlier life of it (it
    /// restarted after the pick: `StaleIncarnation` naming this worker); records the new life,
    /// so the next request targets it. Such a refusal can also come from a worker this one
    /// forwarded to (its destination), which names itself instead.
    pub fn refused_as_restarted(&self, status: &tonic::Status) -> bool {
        let Some(d) = v1::ErrorDetail::from_status(status) else {
            return false;
        };
        let own = d.code == v1::ErrorCode::StaleIncarnation as i32
            && !d.worker_id.is_empty()
            && *self.worker_id.lock().unwrap_or_else(|e| e.into_inner()) == d.worker_id;
        if own {
            self.observe_incarnation(d.incarnation_id);
        }
        own
    }

    /// The incarnation the worker last reported (0 before its first `Stats`).
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Acquire)
    }

    /// Records the incarnation the worker reports; a new one (the process restarted at this
    /// address) forgets what the breaker held against the previous life.
    pub(crate) fn observe_incarnation(&self, incarnation: u64) {
        if incarnation == 0 {
            return;
        }
        let old = self.incarnation.swap(incarnation, Ordering::AcqRel);
        if old != 0 && old != incarnation {
            self.restarts.fetch_add(1, Ordering::Relaxed);
            self.failures_in_a_row.store(0, Ordering::Release);
            self.close_breaker();
            tracing::info!(role = self.role.name(), addr = %self.addr, old, new = incarnation, "worker restarted (new incarnation)");
        }
    }

    /// One probe: health, then (for load) `Stats`. Sets the health flag.
    async fn probe(&self, timeout: Duration) {
        let mut health = HealthClient::new(self.channel.clone());
        let check = health.check(self.request(HealthCheckRequest {
            service: String::new(),
        }));
        let ok = matches!(
            tokio::time::timeout(timeout, check).await,
            Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
        );
        let was = self.healthy.swap(ok, Ordering::AcqRel);
        if was != ok {
            tracing::info!(role = self.role.name(), addr = %self.addr, healthy = ok, "worker health changed");
        }
        if !ok {
            return;
        }
        let stats = match self.role {
            Role::Decode => {
                let mut c = self.decode_client();
                tokio::time::timeout(timeout, c.stats(self.request(v1::StatsRequest {}))).await
            }
            Role::Prefill => {
                let mut c = self.prefill_client();
                tokio::time::timeout(timeout, c.stats(self.request(v1::StatsRequest {}))).await
            }
            Role::Encoder => {
                let mut c = self.encoder_client();
                tokio::time::timeout(timeout, c.stats(self.request(v1::StatsRequest {}))).await
            }
        };
        if let Ok(Ok(s)) = stats {
            let s = s.into_inner();
            if let Some(info) = &s.info {
                self.observe_incarnation(info.incarnation_id);
                self.observe_transport(info.transfer_backend);
                let mut id = self.worker_id.lock().unwrap_or_else(|e| e.into_inner());
                if *id != info.worker_id {
                    id.clone_from(&info.worker_id);
                }
            }
            if let Some(l) = s.load {
                self.remote_load
                    .store((l.running + l.waiting) as usize, Ordering::Release);
            }
        }
    }
}

/// Holds one in-flight slot on a worker; dropping it releases the slot.
pub struct Lease(pub Arc<Worker>);

impl Lease {
    fn new(w: Arc<Worker>) -> Self {
        w.inflight.fetch_add(1, Ordering::AcqRel);
        w.routed.fetch_add(1, Ordering::Relaxed);
        Lease(w)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::ops::Deref for Lease {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        &self.0
    }
}

/// Settings of a [`WorkerPool`].
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Cluster secret sent as `authorization: Bearer …` metadata; none sends nothing.
    pub auth_secret: Option<String>,
    /// Mutual TLS to the workers; `None`: plain HTTP/2.
    pub tls: Option<MutualTls>,
    /// Between two health probes of every worker.
    pub health_interval: Duration,
    /// Connect and probe timeout.
    pub probe_timeout: Duration,
    /// Tokens per KV page (the prefix-affinity grain).
    pub page_tokens: usize,
    /// A prefill worker keeps its affinity until it has this many more requests in flight than
    /// the least loaded one.
    pub affinity_slack: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            auth_secret: None,
            tls: None,
            health_interval: Duration::from_secs(2),
            probe_timeout: Duration::from_secs(2),
            page_tokens: 16,
            affinity_slack: 4,
        }
    }
}

/// A per-worker metric: name, Prometheus type, value.
type Series = (&'static str, &'static str, fn(&Worker) -> u64);

/// Membership of both pools, with selection per DESIGN §4.
pub struct WorkerPool {
    prefill: RwLock<Vec<Arc<Worker>>>,
    decode: RwLock<Vec<Arc<Worker>>>,
    encoder: RwLock<Vec<Arc<Worker>>>,
    opts: PoolOptions,
    /// Round-robin counters, one per role: a shared one advances by 2 per request (a decode
    /// and a prefill pick), so with 2 equally loaded workers every pick got the same one.
    rr: [AtomicUsize; 3],
    retries_encode: AtomicU64,
    retries_reserve: AtomicU64,
    retries_prefill: AtomicU64,
    migrations: AtomicU64,
}

impl WorkerPool {
    /// Builds the pool (channels connect lazily) and starts its health loop on the current tokio
    /// runtime; the loop ends when the pool is dropped.
    pub fn start(
        prefill: &[String],
        decode: &[String],
        opts: PoolOptions,
    ) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(
            !prefill.is_empty(),
            "no prefill worker given (--prefill ADDR)"
        );
        anyhow::ensure!(!decode.is_empty(), "no decode worker given (--decode ADDR)");
        Self::start_dynamic(prefill, decode, opts)
    }

    /// Adds the encoder workers at `addrs` (static membership of the encoder pool).
    pub fn add_encoders(&self, addrs: &[String]) -> anyhow::Result<()> {
        for a in addrs {
            self.add_worker(Role::Encoder, a)?;
        }
        Ok(())
    }

    /// Like [`WorkerPool::start`], but either pool may start empty: discovery fills it with
    /// [`WorkerPool::add_worker`].
    pub fn start_dynamic(
        prefill: &[String],
        decode: &[String],
        opts: PoolOptions,
    ) -> anyhow::Result<Arc<Self>> {
        let mk = |addrs: &[String], role| -> anyhow::Result<Vec<Arc<Worker>>> {
            addrs
                .iter()
                .map(|a| {
                    Worker::new(
                        a,
                        role,
                        opts.auth_secret.as_deref(),
                        opts.tls.as_ref(),
                        opts.probe_timeout,
                    )
                    .map(Arc::new)
                })
                .collect()
        };
        let pool = Arc::new(WorkerPool {
            prefill: RwLock::new(mk(prefill, Role::Prefill)?),
            decode: RwLock::new(mk(decode, Role::Decode)?),
            encoder: RwLock::default(),
            opts,
            rr: [
                AtomicUsize::new(0),
                AtomicUsize::new(0),
                AtomicUsize::new(0),
            ],
            retries_encode: AtomicU64::new(0),
            retries_reserve: AtomicU64::new(0),
            retries_prefill: AtomicU64::new(0),
            migrations: AtomicU64::new(0),
        });
        tokio::spawn(health_loop(Arc::downgrade(&pool)));
        Ok(pool)
    }

    fn members(&self, role: Role) -> &RwLock<Vec<Arc<Worker>>> {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
            Role::Encoder => &self.encoder,
        }
    }

    /// The workers of `role` now (a snapshot: membership may change at run time).
    pub fn workers(&self, role: Role) -> Vec<Arc<Worker>> {
        self.members(role)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn all_workers(&self) -> Vec<Arc<Worker>> {
        let mut all = self.workers(Role::Prefill);
        all.extend(self.workers(Role::Decode));
        all.extend(self.workers(Role::Encoder));
        all
    }

    /// Adds a worker at `addr` (discovery), probed at once; `None` when one with that address
    /// is already a member.
    pub fn add_worker(&self, role: Role, addr: &str) -> anyhow::Result<Option<Arc<Worker>>> {
        let w = Arc::new(Worker::new(
            addr,
            role,
            self.opts.auth_secret.as_deref(),
            self.opts.tls.as_ref(),
            self.opts.probe_timeout,
        )?);
        {
            let mut m = self
                .members(role)
                .write()
                .unwrap_or_else(|e| e.into_inner());
            if m.iter().any(|x| x.addr == w.addr) {
                return Ok(None);
            }
            m.push(w.clone());
        }
        tracing::info!(role = role.name(), addr = %w.addr, "worker added");
        let probe = w.clone();
        let t = self.opts.probe_timeout;
        tokio::spawn(async move { probe.probe(t).await });
        Ok(Some(w))
    }

    /// Removes the worker at `addr` from routing (discovery): no new request goes to it; those
    /// in flight hold their [`Lease`] and finish. Whether it was a member.
    pub fn remove_worker(&self, role: Role, addr: &str) -> bool {
        let mut m = self
            .members(role)
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let before = m.len();
        m.retain(|w| w.addr != addr);
        let removed = m.len() != before;
        if removed {
            tracing::info!(role = role.name(), addr, "worker removed (draining)");
        }
        removed
    }

    pub fn options(&self) -> &PoolOptions {
        &self.opts
    }

    /// Whether `role` has at least one healthy worker.
    pub fn any_healthy(&self, role: Role) -> bool {
        self.workers(role).iter().any(|w| w.is_healthy())
    }

    /// Probes every worker now (tests, start-up).
    pub async fn probe_all(&self) {
        let t = self.opts.probe_timeout;
        let all = self.all_workers();
        futures_util::future::join_all(all.iter().map(|w| w.probe(t))).await;
    }

    /// Picks a healthy worker of `role` not in `exclude` among those `fits` accepts, by `choose`.
    fn pick_where(
        &self,
        role: Role,
        exclude: &[String],
        fits: impl Fn(&Worker) -> bool,
        choose: impl Fn(&[Candidate<'_>], usize) -> Option<usize>,
    ) -> Option<Lease> {
        let members = self.workers(role);
        let ws: Vec<&Arc<Worker>> = members
            .iter()
            .filter(|w| w.is_routable() && !exclude.contains(&w.addr) && fits(w))
            .collect();
        let cands: Vec<Candidate<'_>> = ws
            .iter()
            .map(|w| Candidate {
                addr: &w.addr,
                inflight: w.inflight(),
                remote_load: w.remote_load.load(Ordering::Acquire),
            })
            .collect();
        let rr = self.rr[role as usize].fetch_add(1, Ordering::Relaxed);
        choose(&cands, rr).map(|i| Lease::new(ws[i].clone()))
    }

    pub fn count_retry(&self, role: Role) {
        match role {
            Role::Decode => &self.retries_reserve,
            Role::Prefill => &self.retries_prefill,
            Role::Encoder => &self.retries_encode,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request moved to other workers after it had streamed tokens.
    pub fn count_migration(&self) {
        self.migrations.fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus exposition of the router's view of its workers.
    pub fn metrics_text(&self) -> String {
        let mut s = String::new();
        let series: [Series; 6] = [
            ("tessera_router_worker_healthy", "gauge", |w| {
                w.is_healthy() as u64
            }),
            ("tessera_router_worker_inflight", "gauge", |w| {
                w.inflight() as u64
            }),
            ("tessera_router_worker_requests_total", "counter", |w| {
                w.routed.load(Ordering::Relaxed)
            }),
            ("tessera_router_worker_failures_total", "counter", |w| {
                w.failures.load(Ordering::Relaxed)
            }),
            ("tessera_router_worker_breaker_open", "gauge", |w| {
                w.breaker_open() as u64
            }),
            ("tessera_router_worker_restarts_total", "counter", |w| {
                w.restarts.load(Ordering::Relaxed)
            }),
        ];
        let all = self.all_workers();
        for (name, kind, get) in series {
            let _ = writeln!(s, "# TYPE {name} {kind}");
            for w in &all {
                let _ = writeln!(
                    s,
                    "{name}{{role=\"{}\",worker=\"{}\"}} {}",
                    w.role.name(),
                    w.addr,
                    get(w)
                );
            }
        }
        let _ = writeln!(s, "# TYPE tessera_router_retries_total counter");
        let _ = writeln!(
            s,
            "tessera_router_retries_total{{stage=\"reserve\"}} {}",
            self.retries_reserve.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "tessera_router_retries_total{{stage=\"prefill\"}} {}",
            self.retries_prefill.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            s,
            "tessera_router_retries_total{{stage=\"encode\"}} {}",
            self.retries_encode.load(Ordering::Relaxed)
        );
        let _ = writeln!(s, "# HELP tessera_router_migrations_total Requests re-prefilled on other workers after their decode worker failed mid-stream.");
        let _ = writeln!(s, "# TYPE tessera_router_migrations_total counter");
        let _ = writeln!(
            s,
            "tessera_router_migrations_total {}",
            self.migrations.load(Ordering::Relaxed)
        );
        s
    }
}

async fn health_loop(pool: Weak<WorkerPool>) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        let interval = p.opts.health_interval;
        p.probe_all().await;
        drop(p);
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Worker {
        Worker::new(
            "127.0.0.1:1",
            Role::Decode,
            None,
            None,
            Duration::from_secs(1),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn breaker_opens_after_failures_in_a_row_and_a_success_closes_it() {
        let w = worker();
        for _ in 0..BREAKER_THRESHOLD - 1 {
            w.record_failure(true);
        }
        // Load and bad requests say nothing about the worker.
        for _ in 0..10 {
            w.record_failure(false);
        }
        assert!(
            w.is_routable(),
            "not yet {BREAKER_THRESHOLD} breakages in a row"
        );
        w.record_success();
        for _ in 0..BREAKER_THRESHOLD - 1 {
            w.record_failure(true);
        }
        assert!(w.is_routable(), "a success reset the count");
        w.record_failure(true);
        assert!(w.breaker_open() && !w.is_routable());
        assert!(w.is_healthy(), "the breaker is not the health flag");
        w.record_success();
        assert!(w.is_routable(), "a success closes it");
    }

    #[tokio::test]
    async fn an_open_breaker_half_opens_after_its_cooldown_and_backs_off() {
        let w = worker();
        for _ in 0..BREAKER_THRESHOLD {
            w.record_failure(true);
        }
        let first = w.breaker.lock().unwrap().open_until.unwrap();
        assert!(first <= Instant::now() + BREAKER_COOLDOWN);
        // The cool-down passes: requests reach it again (half-open) …
        w.breaker.lock().unwrap().open_until = Some(Instant::now());
        assert!(w.is_routable());
        // … and one more failure opens it for twice as long.
        w.record_failure(true);
        let second = w.breaker.lock().unwrap().open_until.unwrap();
        assert!(second > Instant::now() + BREAKER_COOLDOWN + Duration::from_millis(500));
        assert!(!w.is_routable());
    }

    #[tokio::test]
    async fn a_refusal_from_a_restarted_worker_is_told_from_its_destinations() {
        let w = worker();
        w.observe_incarnation(5);
        let own = tessera_proto::check_incarnation(5, 9, "encoder-0").unwrap_err();
        assert!(
            !w.refused_as_restarted(&own),
            "its name is unknown before Stats"
        );
        w.worker_id.lock().unwrap().push_str("encoder-0");
        let forwarded = tessera_proto::check_incarnation(3, 4, "prefill-0").unwrap_err();
        assert!(
            !w.refused_as_restarted(&forwarded),
            "a destination's refusal"
        );
        assert_eq!(w.incarnation(), 5);
        assert!(w.refused_as_restarted(&own));
        assert_eq!(w.incarnation(), 9, "the next request targets the new life");
        assert!(!w.refused_as_restarted(&tonic::Status::unavailable("gone")));
    }

    #[tokio::test]
    async fn a_new_incarnation_closes_the_breaker() {
        let w = worker();
        w.observe_incarnation(7);
        for _ in 0..BREAKER_THRESHOLD {
            w.record_failure(true);
        }
        assert!(!w.is_routable());
        w.observe_incarnation(7);
        assert!(!w.is_routable(), "the same life keeps its breaker");
        w.observe_incarnation(8);
        assert!(w.is_routable(), "a restarted worker starts afresh");
        assert_eq!(w.restarts.load(Ordering::Relaxed), 1);
        assert_eq!(w.incarnation(), 8);
    }
}
