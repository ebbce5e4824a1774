//! The worker runtime every Tessera daemon shares (DESIGN §1: "one worker runtime instead of three
//! copies"): common flags (each also from `TESSERA_*` env), tracing, loading the model into an
//! [`EngineHandle`], binding the TCP transport, the `grpc.health.v1` service, `/metrics`, the
//! start-up "ready" line, registration, and graceful drain on SIGTERM / Ctrl-C.
//!
//! It lives here, in `tessera-prefill`, because DESIGN's crate table has no runtime crate and the
//! runtime must not pull tonic into the engine or engine into the router; `tessera-decode` (and
//! later `tessera-encoder`) depend on `tessera-prefill` for this module only.
//!
//! Registration: the ready line (and a `tracing` event) always carries the worker's record (role,
//! id, gRPC address, transfer endpoint); with `--etcd`, [`ready`] also writes it to etcd under a
//! kept-alive lease (DESIGN §6, see [`crate::discovery`]), and the drain revokes that lease first.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tessera_engine::kv::GroupKind;
use tessera_engine::serving::{EngineHandle, SchedulerConfig};
use tessera_engine::{Model, SamplingParams};
use tessera_proto::health::server::HealthReporter;
use tessera_proto::v1;
use tessera_transfer::{Secret, TcpTransport, Transport, TransportConfig};
use tokio::sync::Notify;

/// Flags common to every worker daemon.
#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    /// Model directory (Hugging Face layout: config.json, *.safetensors).
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: PathBuf,
    /// gRPC listen address (port 0 picks a free port; the ready line prints the bound one).
    #[arg(long, env = "TESSERA_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Page-transfer (TCP) listen address.
    #[arg(long, env = "TESSERA_TRANSFER_LISTEN", default_value = "127.0.0.1:0")]
    pub transfer_listen: SocketAddr,
    /// Host name peers use to reach the transfer listener (default: its bound IP).
    #[arg(long, env = "TESSERA_TRANSFER_ADVERTISE_HOST")]
    pub transfer_advertise_host: Option<String>,
    /// Prometheus `/metrics` HTTP listen address; off when unset.
    #[arg(long, env = "TESSERA_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// This worker's id in the cluster (default: `<role>-<pid>`).
    #[arg(long, env = "TESSERA_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Tokens per KV page (the grain of prefix matching, snapshots and transfer).
    #[arg(long, env = "TESSERA_PAGE_TOKENS", default_value_t = 16)]
    pub page_tokens: usize,
    /// Publish a KDA snapshot every N prompt tokens (0 = only at chunk ends and the last full page).
    #[arg(long, env = "TESSERA_SNAPSHOT_INTERVAL", default_value_t = 0)]
    pub snapshot_interval: usize,
    /// KV page-pool budget in bytes (suffixes K, M, G accepted).
    #[arg(long, env = "TESSERA_KV_MEMORY", default_value = "64M", value_parser = parse_bytes)]
    pub kv_memory: usize,
    /// Tokens per batch step (prefill chunk budget).
    #[arg(long, env = "TESSERA_MAX_BATCH_TOKENS", default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Requests running at once.
    #[arg(long, env = "TESSERA_MAX_RUNNING", default_value_t = 32)]
    pub max_running: usize,
    /// Disable the prefix cache.
    #[arg(long, env = "TESSERA_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Cluster secret for the transfer handshake (set it from the environment in production).
    #[arg(
        long,
        env = "TESSERA_AUTH_SECRET",
        hide_env_values = true,
        default_value = "tessera-insecure-dev-secret"
    )]
    pub auth_secret: String,
    /// Longest a graceful drain waits for in-flight requests after SIGTERM, in seconds.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout: u64,
    /// etcd endpoints (comma-separated `host:port`); when set, the worker registers itself under
    /// `/tessera/<cluster>/workers/<role>/<id>` once ready (DESIGN §6).
    #[arg(long, env = "TESSERA_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: the etcd key prefix is `/tessera/<cluster>/`.
    #[arg(long, env = "TESSERA_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// TTL of the etcd registration lease, in seconds (a dead worker leaves routing within it).
    #[arg(long, env = "TESSERA_ETCD_TTL", default_value_t = 5)]
    pub etcd_ttl: u64,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("{s:?} is not a byte count: {e}"))
}

impl WorkerArgs {
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            page_tokens: self.page_tokens,
            snapshot_interval: self.snapshot_interval,
            kv_memory_bytes: self.kv_memory,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            prefix_cache: !self.no_prefix_cache,
        }
    }

    pub fn worker_id(&self, role: &str) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(|| format!("{role}-{}", std::process::id()))
    }

    pub fn model_id(&self) -> String {
        self.model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.model.display().to_string())
    }
}

/// Starts `tracing` (`RUST_LOG`, default `info`) on stderr; safe to call twice.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// Loads the model and starts the engine thread (blocking: call from `spawn_blocking` or before
/// the runtime is busy).
pub fn start_engine(args: &WorkerArgs) -> anyhow::Result<Arc<EngineHandle>> {
    let model = Model::load(&args.model)
        .with_context(|| format!("loading the model from {}", args.model.display()))?;
    let engine = EngineHandle::spawn(model, args.scheduler_config())?;
    tracing::info!(layout = %engine.layout_report(), "page pool");
    Ok(Arc::new(engine))
}

/// Binds the TCP page transport on `--transfer-listen`.
pub async fn start_transport(args: &WorkerArgs) -> anyhow::Result<Arc<TcpTransport>> {
    if args.auth_secret == "tessera-insecure-dev-secret" {
        tracing::warn!("TESSERA_AUTH_SECRET is not set: using the insecure development secret");
    }
    let mut cfg = TransportConfig::new(Secret::new(args.auth_secret.as_bytes()));
    cfg.bind = args.transfer_listen;
    cfg.advertise_host = args.transfer_advertise_host.clone();
    let t = TcpTransport::bind(cfg)
        .await
        .context("binding the transfer listener")?;
    tracing::info!(endpoint = %t.endpoint(), "transfer listening");
    Ok(Arc::new(t))
}

/// The bytes a page may occupy in every plane of its group, for the largest group: transfers
/// pack each page into a slot of this size at `page id × slot_bytes` of the destination's staging
/// region, so the sender needs no knowledge of the receiver's arena offsets.
pub fn slot_bytes(engine: &EngineHandle) -> anyhow::Result<(usize, usize)> {
    Ok(engine.with_pool(|p| {
        let l = p.layout();
        let slot = l
            .groups()
            .iter()
            .map(|g| g.layers.len() * g.page_payload)
            .max()
            .unwrap_or(0);
        (slot, l.max_page_id().0 as usize + 1)
    })?)
}

/// The page layout as the wire describes it (peers compare it before a transfer).
pub fn layout_descriptor(engine: &EngineHandle) -> anyhow::Result<v1::PageLayoutDescriptor> {
    Ok(engine.with_pool(|p| {
        let l = p.layout();
        v1::PageLayoutDescriptor {
            layout_version: 1,
            page_tokens: l.page_tokens as u32,
            planes: l.planes() as u32,
            plane_bytes: l.plane_bytes() as u64,
            parents: l.parents() as u32,
            max_pages_per_parent: l.max_pages_per_parent() as u32,
            groups: l
                .groups()
                .iter()
                .map(|g| v1::CacheGroupLayout {
                    kind: match g.kind {
                        GroupKind::Mla => v1::CacheGroupKind::Mla,
                        GroupKind::Kda => v1::CacheGroupKind::Kda,
                    } as i32,
                    layers: g.layers.iter().map(|&x| x as u32).collect(),
                    pages_per_parent: g.pages_per_parent as u32,
                    page_stride_bytes: g.page_stride as u64,
                    page_payload_bytes: g.page_payload as u64,
                })
                .collect(),
            ..Default::default()
        }
    })?)
}

/// Whether two workers' pages can be moved between them: same page shape (the pools' sizes may
/// differ).
pub fn pages_compatible(
    a: &v1::PageLayoutDescriptor,
    b: &v1::PageLayoutDescriptor,
) -> Result<(), String> {
    if a.page_tokens != b.page_tokens || a.planes != b.planes || a.groups != b.groups {
        return Err(format!(
            "page layouts differ: {} tokens × {} planes {:?} here, {} × {} {:?} there",
            a.page_tokens, a.planes, a.groups, b.page_tokens, b.planes, b.groups
        ));
    }
    Ok(())
}

/// Pool and load figures for `Stats` and `/metrics`, read on the engine thread.
pub fn worker_stats(
    engine: &EngineHandle,
    draining: bool,
    reservations: usize,
    max_running: usize,
) -> anyhow::Result<(v1::PoolStats, v1::LoadStats)> {
    Ok(engine.with_scheduler(move |s| {
        let st = s.stats();
        let live = s.live_pages();
        let cached = s.cached_pages();
        let pool = s.pool();
        let l = pool.layout();
        let usage = pool.usage();
        let groups = usage
            .iter()
            .map(|u| v1::GroupUsage {
                group: u.group.0 as u32,
                kind: match l.group(u.group).map(|g| g.kind) {
                    Ok(GroupKind::Mla) => v1::CacheGroupKind::Mla as i32,
                    _ => v1::CacheGroupKind::Kda as i32,
                },
                live_pages: u.live_pages as u64,
                bound_parents: u.bound_parents as u32,
                bytes: u.bytes as u64,
            })
            .collect();
        let used: usize = usage.iter().map(|u| u.bytes).sum();
        let _ = live;
        (
            v1::PoolStats {
                total_parents: l.parents() as u32,
                free_parents: pool.free_parents() as u32,
                groups,
                cached_pages: cached as u64,
                reserved_pages: 0,
                arena_bytes: l.arena_bytes() as u64,
                used_bytes: used as u64,
            },
            v1::LoadStats {
                waiting: st.waiting as u32,
                running: st.running as u32,
                max_running: max_running as u32,
                reservations: reservations as u32,
                prefix_lookups: st.prefix_lookups,
                prefix_hits: st.prefix_hits,
                prefix_hit_tokens: st.prefix_hit_tokens,
                preemptions: st.preemptions,
                draining,
            },
        )
    })?)
}

/// Prometheus text for the figures of [`worker_stats`] plus the worker's own counters.
pub fn render_metrics(
    role: &str,
    pool: &v1::PoolStats,
    load: &v1::LoadStats,
    extra: &[(&str, u64)],
) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let r = format!("role=\"{role}\"");
    let _ = writeln!(s, "tessera_queue_depth{{{r}}} {}", load.waiting);
    let _ = writeln!(s, "tessera_running_batch{{{r}}} {}", load.running);
    let _ = writeln!(s, "tessera_reservations{{{r}}} {}", load.reservations);
    let _ = writeln!(
        s,
        "tessera_prefix_lookups_total{{{r}}} {}",
        load.prefix_lookups
    );
    let _ = writeln!(s, "tessera_prefix_hits_total{{{r}}} {}", load.prefix_hits);
    let _ = writeln!(
        s,
        "tessera_prefix_hit_tokens_total{{{r}}} {}",
        load.prefix_hit_tokens
    );
    let _ = writeln!(s, "tessera_draining{{{r}}} {}", load.draining as u8);
    let _ = writeln!(s, "tessera_pool_arena_bytes{{{r}}} {}", pool.arena_bytes);
    let _ = writeln!(s, "tessera_pool_used_bytes{{{r}}} {}", pool.used_bytes);
    let _ = writeln!(s, "tessera_pool_cached_pages{{{r}}} {}", pool.cached_pages);
    for g in &pool.groups {
        let fam = if g.kind == v1::CacheGroupKind::Mla as i32 {
            "mla"
        } else {
            "kda"
        };
        let _ = writeln!(
            s,
            "tessera_pool_live_pages{{{r},group=\"{}\",family=\"{fam}\"}} {}",
            g.group, g.live_pages
        );
    }
    for (k, v) in extra {
        let _ = writeln!(s, "tessera_{k}{{{r}}} {v}");
    }
    s
}

/// Engine sampling parameters from the wire's (absent fields take the engine's defaults).
pub fn sampling_from_wire(p: Option<&v1::SamplingParams>) -> SamplingParams {
    let d = SamplingParams::default();
    match p {
        None => d,
        Some(p) => SamplingParams {
            temperature: p.temperature,
            top_p: p.top_p.unwrap_or(d.top_p),
            top_k: p.top_k as usize,
            seed: p.seed.unwrap_or(d.seed),
        },
    }
}

/// Drain state: new work is refused once draining; shutdown waits for in-flight work.
#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    inflight: AtomicUsize,
    idle: Notify,
    /// The etcd registration, revoked when the drain starts.
    registration: std::sync::Mutex<Option<crate::discovery::Registration>>,
}

/// Held by one in-flight request; dropping it lets a drain finish.
pub struct InflightGuard(Arc<Drain>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// Admits one request, or refuses it with `UNAVAILABLE` (`DRAINING`) while draining.
    pub fn admit(self: &Arc<Self>, worker_id: &str) -> Result<InflightGuard, tonic::Status> {
        if self.is_draining() {
            let mut d = v1::ErrorDetail::new(v1::ErrorCode::Draining, "the worker is draining");
            d.worker_id = worker_id.to_string();
            d.retryable = true;
            return Err(d.into_status());
        }
        self.inflight.fetch_add(1, Ordering::AcqRel);
        Ok(InflightGuard(self.clone()))
    }

    /// Keeps `r` until the drain starts, which deregisters it.
    pub fn set_registration(&self, r: crate::discovery::Registration) {
        *self.registration.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    }

    /// Drops the etcd registration without revoking its lease, as a crash would (tests): the
    /// record disappears when the lease expires.
    pub fn abandon_registration(&self) {
        drop(
            self.registration
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    /// Marks the worker draining, deregisters it from etcd (so routers stop sending new work),
    /// and waits until nothing is in flight or `timeout` passed.
    pub async fn drain(&self, timeout: Duration) {
        self.draining.store(true, Ordering::Release);
        let reg = self
            .registration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(r) = reg {
            r.deregister().await;
        }
        let wait = async {
            loop {
                let n = self.idle.notified();
                if self.inflight() == 0 {
                    return;
                }
                n.await;
            }
        };
        if tokio::time::timeout(timeout, wait).await.is_err() {
            tracing::warn!(inflight = self.inflight(), "drain timed out");
        }
    }
}

use tessera_proto::tonic;

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// What runs the shutdown sequence: on `signal`, health goes NOT_SERVING for `service`, new
/// requests are refused, in-flight ones finish (up to the drain timeout), then the returned
/// future resolves and the gRPC server stops.
pub async fn drain_on<S: tonic::server::NamedService>(
    signal: impl std::future::Future<Output = ()>,
    drain: Arc<Drain>,
    health: HealthReporter,
    timeout: Duration,
) {
    signal.await;
    tracing::info!("draining");
    health.set_not_serving::<S>().await;
    health
        .set_service_status("", tessera_proto::health::ServingStatus::NotServing)
        .await;
    drain.drain(timeout).await;
    tracing::info!("drained; stopping");
}

/// Serves `GET /metrics` (and `GET /health`) on `addr` with `render`'s text.
pub async fn serve_metrics(
    addr: SocketAddr,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> anyhow::Result<SocketAddr> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding /metrics on {addr}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let render = render.clone();
                async move {
                    tokio::task::spawn_blocking(move || render())
                        .await
                        .unwrap_or_default()
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(bound)
}

/// The one "worker is ready" step of every daemon: with `--etcd`, registers `info` (under a
/// lease kept alive until the drain revokes it), then prints the ready line.
pub async fn ready(
    args: &WorkerArgs,
    info: &v1::WorkerInfo,
    metrics: Option<SocketAddr>,
    drain: &Drain,
) -> anyhow::Result<()> {
    let role = v1::Role::try_from(info.role)
        .unwrap_or_default()
        .name()
        .to_string();
    if !args.etcd.is_empty() {
        let reg = crate::discovery::Registration::register(args, &role, info).await?;
        if drain.is_draining() {
            // The shutdown signal came while registering.
            reg.deregister().await;
        } else {
            drain.set_registration(reg);
        }
    }
    let grpc: SocketAddr = info
        .grpc_address
        .parse()
        .context("the worker's gRPC address")?;
    announce_ready(
        &role,
        &info.worker_id,
        grpc,
        &info.transfer_endpoint,
        metrics,
    );
    Ok(())
}

/// What every worker daemon starts from before its own service exists: the engine, the page
/// transport, the drain state and the bound gRPC listener.
pub struct Foundation {
    pub engine: Arc<EngineHandle>,
    pub transport: Arc<TcpTransport>,
    pub drain: Arc<Drain>,
    pub worker_id: String,
    pub listener: tokio::net::TcpListener,
    pub grpc: SocketAddr,
}

/// Starts the parts of a worker that do not depend on its role.
pub async fn foundation(args: &WorkerArgs, role: &str) -> anyhow::Result<Foundation> {
    let a = args.clone();
    let engine = tokio::task::spawn_blocking(move || start_engine(&a)).await??;
    let transport = start_transport(args).await?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let grpc = listener.local_addr()?;
    Ok(Foundation {
        engine,
        transport,
        drain: Drain::new(),
        worker_id: args.worker_id(role),
        listener,
        grpc,
    })
}

/// Serves `/metrics` when `--metrics-listen` is set; returns the bound address.
pub async fn metrics_if_asked(
    args: &WorkerArgs,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> anyhow::Result<Option<SocketAddr>> {
    match args.metrics_listen {
        Some(addr) => Ok(Some(serve_metrics(addr, render).await?)),
        None => Ok(None),
    }
}

/// Prints the line supervisors (`tessera up`, tests) wait for, and logs the registration record.
pub fn announce_ready(
    role: &str,
    worker_id: &str,
    grpc: SocketAddr,
    transfer: &str,
    metrics: Option<SocketAddr>,
) {
    let m = metrics.map(|m| m.to_string()).unwrap_or_default();
    tracing::info!(role, worker_id, %grpc, transfer, metrics = %m, "registered (static discovery)");
    println!(
        "TESSERA_READY role={role} id={worker_id} grpc={grpc} transfer={transfer} metrics={m}"
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}
