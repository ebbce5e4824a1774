//! The worker runtime every Tessera daemon shares (DESIGN §1: "one worker runtime instead of three
//! copies"): common flags (each also from `TESSERA_*` env), tracing, loading the model into an
//! [`EngineHandle`], binding the page transport (`--transport tcp|ucx`), the `grpc.health.v1`
//! service, `/metrics`, the start-up "ready" line, registration, and graceful drain on SIGTERM /
//! Ctrl-C. A daemon builds its service on a [`Foundation`] (engine daemons) or on
//! [`start_transport`] (the encoder) and hands it to [`serve`], which does the rest.
//!
//! Authentication: every role's service sits behind [`RequireToken`] — a call without
//! `authorization: Bearer <cluster secret>` metadata is refused with UNAUTHENTICATED — while
//! `grpc.health.v1` stays open to probes. The secret is the one the transfer handshake proves
//! (`--auth-secret`, `TESSERA_AUTH_SECRET`); the router sends it on every call.
//!
//! It lives here, in `tessera-prefill`, because DESIGN's crate table has no runtime crate and the
//! runtime must not pull tonic into the engine or engine into the router; `tessera-decode` and
//! `tessera-encoder` depend on `tessera-prefill` for this module only.
//!
//! Registration: the ready line (and a `tracing` event) always carries the worker's record (role,
//! id, gRPC address, transfer endpoint); with `--etcd`, [`ready`] also writes it to etcd under a
//! kept-alive lease (DESIGN §6, see [`crate::discovery`]), and the drain revokes that lease first.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tessera_engine::kv::GroupKind;
use tessera_engine::serving::EngineHandle;
use tessera_engine::Model;
use tessera_proto::health::server::HealthReporter;
use tessera_proto::tonic;
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::v1;
use tessera_transfer::{Secret, TcpTransport, Transport, TransportConfig};
use tokio::sync::Notify;

mod args;
mod auth;
mod metrics;
mod wire;

pub use args::{
    check_model_device, default_max_batch_tokens, DaemonArgs, TestHooks, TransportKind, Withhold,
    WorkerArgs, DEV_SECRET,
};
pub use auth::{ClusterToken, RequireToken};
pub use metrics::{
    counter, engine_metrics, gauge, render_metrics, write_family, write_role_families, Family,
    DRAINING_HELP,
};
pub use wire::{logprobs_to_wire, sampling_from_wire, top_logprobs_from_wire};

pub(crate) const NO_UCX: &str =
    "--transport ucx: built without UCX support: rebuild with --features ucx";

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
    let dir = &args.daemon.model;
    let model = Model::load_on(dir, args.device).with_context(|| {
        format!(
            "loading the model from {} onto {}",
            dir.display(),
            args.device
        )
    })?;
    let engine = EngineHandle::spawn(model, args.scheduler_config())?;
    tracing::info!(layout = %engine.layout_report(), "page pool");
    Ok(Arc::new(engine))
}

/// The transport settings of the daemon's flags: bind and advertised addresses, the cluster
/// secret, the test hooks.
fn transport_config(args: &DaemonArgs) -> TransportConfig {
    if args.auth_secret == DEV_SECRET {
        tracing::warn!("TESSERA_AUTH_SECRET is not set: using the insecure development secret");
    }
    let mut cfg = TransportConfig::new(Secret::new(args.auth_secret.as_bytes()));
    cfg.bind = args.transfer_listen;
    cfg.advertise_host = args.transfer_advertise_host.clone();
    cfg.faults = args.test_hooks.transfer.clone();
    cfg
}

/// Binds the TCP page transport on `--transfer-listen`.
pub async fn start_transport(args: &DaemonArgs) -> anyhow::Result<Arc<TcpTransport>> {
    let t = TcpTransport::bind(transport_config(args))
        .await
        .context("binding the transfer listener")?;
    tracing::info!(endpoint = %t.endpoint(), "transfer listening");
    Ok(Arc::new(t))
}

/// Binds the page transport `--transport` names on `--transfer-listen`.
pub async fn start_page_transport(args: &WorkerArgs) -> anyhow::Result<Arc<dyn Transport>> {
    start_transport_of(args.transport, &args.daemon).await
}

/// Binds a transport of `kind` on the daemon's `--transfer-listen`.
pub async fn start_transport_of(
    kind: TransportKind,
    args: &DaemonArgs,
) -> anyhow::Result<Arc<dyn Transport>> {
    match kind {
        TransportKind::Tcp => Ok(start_transport(args).await?),
        TransportKind::Ucx => start_ucx(args).await,
    }
}

#[cfg(feature = "ucx")]
async fn start_ucx(args: &DaemonArgs) -> anyhow::Result<Arc<dyn Transport>> {
    let t = tessera_transfer::UcxTransport::bind(transport_config(args))
        .await
        .context("starting the UCX transport")?;
    tracing::info!(endpoint = %t.endpoint(), ucx = %t.ucx_addr(), "transfer listening (ucx)");
    Ok(Arc::new(t))
}

#[cfg(not(feature = "ucx"))]
async fn start_ucx(_args: &DaemonArgs) -> anyhow::Result<Arc<dyn Transport>> {
    anyhow::bail!(NO_UCX)
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

/// The transfer backend a worker advertises (an unset field means TCP, the only backend of
/// workers that predate it).
pub fn backend_of(info: &v1::WorkerInfo) -> v1::TransferBackend {
    match v1::TransferBackend::try_from(info.transfer_backend) {
        Ok(v1::TransferBackend::Unspecified) | Err(_) => v1::TransferBackend::Tcp,
        Ok(b) => b,
    }
}

/// Whether two workers move pages over the same transport (a pair that does not could never
/// connect: refuse it in the handshake instead).
pub fn transports_compatible(here: &v1::WorkerInfo, there: &v1::WorkerInfo) -> Result<(), String> {
    let (a, b) = (backend_of(here), backend_of(there));
    if a != b {
        return Err(format!(
            "transport mismatch: {} ({}) moves pages over {a}, {} ({}) over {b}; start every \
             prefill and decode worker with the same --transport",
            here.worker_id,
            v1::Role::try_from(here.role).unwrap_or_default().name(),
            there.worker_id,
            v1::Role::try_from(there.role).unwrap_or_default().name(),
        ));
    }
    Ok(())
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
    drain: &Drain,
    reservations: usize,
    max_running: usize,
) -> anyhow::Result<(v1::PoolStats, v1::LoadStats)> {
    let (draining, inflight) = (drain.is_draining(), drain.inflight());
    Ok(engine.with_scheduler(move |s| {
        let st = s.stats();
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
        (
            v1::PoolStats {
                total_parents: l.parents() as u32,
                free_parents: pool.free_parents() as u32,
                groups,
                cached_pages: s.evictable_pages() as u64,
                reserved_pages: 0,
                arena_bytes: l.arena_bytes() as u64,
                used_bytes: used as u64,
                request_parents: s.request_parents() as u32,
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
                queued_prompt_tokens: st.queued_prompt_tokens as u64,
                inflight: inflight as u32,
            },
        )
    })?)
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

/// The `main` of a daemon binary: starts tracing, parses its flags `C` (each also from
/// `TESSERA_*` env) and runs the daemon `start` starts with them until its server stops
/// (SIGTERM or Ctrl-C drain it first).
pub fn daemon_main<C, S, F>(start: impl FnOnce(C) -> F) -> anyhow::Result<()>
where
    C: clap::Parser,
    F: std::future::Future<Output = anyhow::Result<Running<S>>>,
{
    init_tracing();
    let cli = C::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move { start(cli).await?.server.await? })
}

/// The shutdown sequence: on `signal`, health goes NOT_SERVING for `service` (and the server as a
/// whole), new requests are refused, in-flight ones finish (up to the drain timeout), then the
/// future resolves and the gRPC server stops.
async fn drain_on(
    signal: impl std::future::Future<Output = ()>,
    drain: Arc<Drain>,
    health: HealthReporter,
    service: &'static str,
    timeout: Duration,
) {
    signal.await;
    tracing::info!("draining");
    for name in [service, ""] {
        health
            .set_service_status(name, tessera_proto::health::ServingStatus::NotServing)
            .await;
    }
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
    args: &DaemonArgs,
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

/// Refuses a request whose `target_incarnation` names another life of the worker `info`
/// describes (0 accepts any).
#[allow(clippy::result_large_err)] // tonic's Status is what the handlers return anyway
pub fn check_target(info: &v1::WorkerInfo, target: u64) -> Result<(), tonic::Status> {
    tessera_proto::check_incarnation(target, info.incarnation_id, &info.worker_id)
}

/// Admits one request for the worker `info` describes: [`Drain::admit`], then
/// [`check_target`] of its `target_incarnation`.
#[allow(clippy::result_large_err)] // tonic's Status is what the handlers return anyway
pub fn admit(
    drain: &Arc<Drain>,
    info: &v1::WorkerInfo,
    target: u64,
) -> Result<InflightGuard, tonic::Status> {
    let guard = drain.admit(&info.worker_id)?;
    check_target(info, target)?;
    Ok(guard)
}

/// Refuses, with LAYOUT_MISMATCH, a peer whose pages cannot move to or from this worker
/// ([`transports_compatible`], then [`pages_compatible`] when both describe their layout).
#[allow(clippy::result_large_err)] // tonic's Status is what the handlers return anyway
pub fn check_peer(here: &v1::WorkerInfo, there: &v1::WorkerInfo) -> Result<(), tonic::Status> {
    let mismatch = |m: String| v1::ErrorDetail::new(v1::ErrorCode::LayoutMismatch, m).into_status();
    transports_compatible(here, there).map_err(mismatch)?;
    if let (Some(a), Some(b)) = (&here.layout, &there.layout) {
        pages_compatible(a, b).map_err(mismatch)?;
    }
    Ok(())
}

/// The `Stats` reply of the engine worker `info` describes, with the figures `stats` reads
/// (on a blocking thread: it waits for the engine thread).
pub async fn engine_stats(
    info: &v1::WorkerInfo,
    stats: impl FnOnce() -> anyhow::Result<(v1::PoolStats, v1::LoadStats)> + Send + 'static,
) -> Result<v1::WorkerStats, tonic::Status> {
    let internal = |e: &dyn std::fmt::Display| {
        v1::ErrorDetail::new(v1::ErrorCode::Internal, e.to_string()).into_status()
    };
    let (pool, load) = tokio::task::spawn_blocking(stats)
        .await
        .map_err(|e| internal(&e))?
        .map_err(|e| internal(&e))?;
    Ok(v1::WorkerStats {
        info: Some(info.clone()),
        pool: Some(pool),
        load: Some(load),
    })
}

/// Declares `$grpc`, the gRPC face of the service `$service`: a newtype over `Arc<$service>`
/// (the generated service traits are foreign, and so is `Arc`) that derefs to the service.
#[macro_export]
macro_rules! grpc_face {
    ($grpc:ident => $service:ty) => {
        #[doc = concat!("The gRPC face of [`", stringify!($service), "`].")]
        #[derive(Clone)]
        pub struct $grpc(pub std::sync::Arc<$service>);

        impl std::ops::Deref for $grpc {
            type Target = $service;
            fn deref(&self) -> &$service {
                &self.0
            }
        }
    };
}

/// The identity every daemon publishes (its `WorkerInfo` before role-specific fields).
pub fn daemon_info(
    args: &DaemonArgs,
    role: v1::Role,
    transport: &TcpTransport,
    grpc: SocketAddr,
) -> v1::WorkerInfo {
    worker_info(args, role, transport, grpc)
}

/// [`daemon_info`] over any page transport: its endpoint, incarnation and backend.
pub fn worker_info(
    args: &DaemonArgs,
    role: v1::Role,
    transport: &dyn Transport,
    grpc: SocketAddr,
) -> v1::WorkerInfo {
    let backend = transport
        .kind()
        .parse::<v1::TransferBackend>()
        .unwrap_or(v1::TransferBackend::Unspecified);
    v1::WorkerInfo {
        worker_id: args.worker_id(role.name()),
        incarnation_id: transport.incarnation().0,
        role: role as i32,
        model_id: args.model_id(),
        grpc_address: grpc.to_string(),
        transfer_endpoint: transport.endpoint(),
        transfer_backend: backend as i32,
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    }
}

/// What an engine daemon (prefill, decode) starts from before its own service exists.
pub struct Foundation {
    pub engine: Arc<EngineHandle>,
    pub transport: Arc<dyn Transport>,
    pub drain: Arc<Drain>,
    pub listener: tokio::net::TcpListener,
    /// The worker as peers and routers see it: identity, addresses, page layout, capacity.
    pub info: v1::WorkerInfo,
    /// `(bytes per slot, slots)` of a transfer staging region (see [`slot_bytes`]).
    pub slots: (usize, usize),
}

/// Starts the parts of an engine daemon that do not depend on its role: the engine, the page
/// transport and the gRPC listener.
pub async fn foundation(args: &WorkerArgs, role: v1::Role) -> anyhow::Result<Foundation> {
    args.transport.check_built()?;
    check_model_device(args.device)?;
    let a = args.clone();
    let engine = tokio::task::spawn_blocking(move || start_engine(&a)).await??;
    let transport = start_page_transport(args).await?;
    let listener = tokio::net::TcpListener::bind(args.daemon.listen).await?;
    let e = engine.clone();
    let (slots, layout) =
        tokio::task::spawn_blocking(move || anyhow::Ok((slot_bytes(&e)?, layout_descriptor(&e)?)))
            .await??;
    let info = v1::WorkerInfo {
        layout: Some(layout),
        max_running: args.max_running as u32,
        ..worker_info(&args.daemon, role, &*transport, listener.local_addr()?)
    };
    Ok(Foundation {
        engine,
        transport,
        drain: Drain::new(),
        listener,
        info,
        slots,
    })
}

/// A running daemon (in-process handle, for `main` and tests).
pub struct Running<S> {
    pub grpc: SocketAddr,
    pub transfer_endpoint: String,
    pub metrics: Option<SocketAddr>,
    pub service: Arc<S>,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// The rest of every daemon's start-up once its service exists: `/metrics` (when asked), the
/// gRPC server on `listener` with `grpc` behind the cluster-token check and `grpc.health.v1`
/// open, the drain on `shutdown`, and registration (the ready line, etcd).
#[allow(clippy::too_many_arguments)]
pub async fn serve<T, S>(
    args: &DaemonArgs,
    listener: tokio::net::TcpListener,
    info: &v1::WorkerInfo,
    drain: Arc<Drain>,
    service: Arc<T>,
    grpc: S,
    metrics: fn(&T) -> String,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Running<T>>
where
    T: Send + Sync + 'static,
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let token = RequireToken(ClusterToken::new(&args.auth_secret)?);
    let s = service.clone();
    let metrics_addr = metrics_if_asked(args, Arc::new(move || metrics(&s))).await?;
    let (health, health_svc) = tessera_proto::health::server::health_reporter();
    health
        .set_service_status(S::NAME, tessera_proto::health::ServingStatus::Serving)
        .await;
    let stop = drain_on(
        shutdown,
        drain.clone(),
        health,
        S::NAME,
        Duration::from_secs(args.drain_timeout),
    );
    let grpc_addr = listener.local_addr()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = args.tls.load().map_err(anyhow::Error::msg)? {
        builder = builder
            .tls_config(tls.server())
            .context("configuring TLS for the gRPC server")?;
    }
    let router = builder
        .add_service(health_svc)
        .add_service(InterceptedService::new(grpc, token));
    let server = tokio::spawn(async move {
        router.serve_with_incoming_shutdown(incoming, stop).await?;
        Ok(())
    });
    ready(args, info, metrics_addr, &drain).await?;
    Ok(Running {
        grpc: grpc_addr,
        transfer_endpoint: info.transfer_endpoint.clone(),
        metrics: metrics_addr,
        service,
        server,
    })
}

/// Serves `/metrics` when `--metrics-listen` is set; returns the bound address.
pub async fn metrics_if_asked(
    args: &DaemonArgs,
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
