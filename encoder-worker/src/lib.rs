//! The vision-encoder daemon (`tessera-encoder`): the encoder pool of DESIGN §4 step 2. The
//! router sends it a request's images; it runs the model's vision tower and projector and pushes
//! the embeddings to the chosen prefill worker over `tessera-transfer`.
//!
//! Only a model whose `config.json` declares a vision tower (a `vision_config` object, as
//! Kimi-K2.5's does) needs an encoder. For a text-only model — every model the engine runs
//! today — the daemon refuses to start, with an error naming the model. For a model with a
//! vision tower it starts and serves the `EncoderWorker` service through the shared worker
//! runtime (`tessera_prefill::runtime`: cluster-secret check, health, `/metrics`, drain,
//! registration); `Encode` answers UNIMPLEMENTED until the engine has the tower's forward
//! (MoonViT), so no embedding is ever held and `Release` frees nothing.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Context;
use serde_json::Value;
use tessera_prefill::runtime::{self, DaemonArgs, Drain};
use tessera_proto::tonic::{self, Request, Response, Status};
use tessera_proto::v1;
use tessera_proto::v1::encoder_worker_server::{EncoderWorker, EncoderWorkerServer};
use tessera_transfer::TcpTransport;

/// What a model's `config.json` says about its vision tower.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionTower {
    /// The model's `model_type` (for example `kimi_k25`).
    pub model_type: String,
}

/// The vision tower `model`'s `config.json` declares (a `vision_config` object), or `None` for
/// a text-only model.
pub fn vision_tower(model: &Path) -> anyhow::Result<Option<VisionTower>> {
    let path = model.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(cfg
        .get("vision_config")
        .is_some_and(Value::is_object)
        .then(|| VisionTower {
            model_type: cfg
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_string(),
        }))
}

pub struct EncoderService {
    info: v1::WorkerInfo,
    tower: VisionTower,
    /// Where embeddings will be pushed from; kept so the advertised endpoint stays up.
    _transport: Arc<TcpTransport>,
    drain: Arc<Drain>,
    /// Images asked for, and `Encode` calls refused.
    images: AtomicU64,
    failures: AtomicU64,
}

impl EncoderService {
    pub fn info(&self) -> &v1::WorkerInfo {
        &self.info
    }

    /// The drain state (and etcd registration) of this worker.
    pub fn drain(&self) -> &Arc<Drain> {
        &self.drain
    }

    fn load(&self) -> v1::LoadStats {
        v1::LoadStats {
            running: self.drain.inflight() as u32,
            draining: self.drain.is_draining(),
            ..Default::default()
        }
    }

    /// Prometheus text for `/metrics`.
    pub fn metrics_text(&self) -> String {
        let load = self.load();
        let mut s = String::new();
        runtime::write_role_families(
            &mut s,
            "encoder",
            &[
                runtime::gauge(
                    "tessera_running_batch",
                    "Encode calls in flight.",
                    load.running.into(),
                ),
                runtime::gauge(
                    "tessera_draining",
                    runtime::DRAINING_HELP,
                    u8::from(load.draining).into(),
                ),
                runtime::counter(
                    "tessera_encode_images_total",
                    "Images encoded.",
                    self.images.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_encode_failures_total",
                    "Encode calls that failed.",
                    self.failures.load(Ordering::Relaxed),
                ),
            ],
        );
        s
    }
}

tessera_prefill::grpc_face!(EncoderGrpc => EncoderService);

#[tonic::async_trait]
impl EncoderWorker for EncoderGrpc {
    async fn encode(
        &self,
        request: Request<v1::EncodeRequest>,
    ) -> Result<Response<v1::EncodeReply>, Status> {
        let _guard = self.drain.admit(&self.info.worker_id)?;
        let req = request.into_inner();
        runtime::check_target(&self.info, req.target_incarnation)?;
        if req.images.is_empty() {
            return Err(v1::ErrorDetail::new(
                v1::ErrorCode::InvalidArgument,
                "the request carries no image",
            )
            .into_status());
        }
        self.images
            .fetch_add(req.images.len() as u64, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
        Err(Status::unimplemented(format!(
            "the vision tower of model `{}` ({}) is not implemented yet: no image can be encoded",
            self.info.model_id, self.tower.model_type
        )))
    }

    async fn release(
        &self,
        request: Request<v1::ReleaseEmbeddingsRequest>,
    ) -> Result<Response<v1::ReleaseEmbeddingsReply>, Status> {
        let req = request.into_inner();
        runtime::check_target(&self.info, req.target_incarnation)?;
        // Nothing is ever held (Encode produces no embedding yet): releasing is a no-op.
        Ok(Response::new(v1::ReleaseEmbeddingsReply { released: 0 }))
    }

    async fn stats(
        &self,
        _request: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::WorkerStats>, Status> {
        Ok(Response::new(v1::WorkerStats {
            info: Some(self.info.clone()),
            pool: None,
            load: Some(self.load()),
        }))
    }
}

/// A running encoder daemon (in-process handle, for `main` and tests).
pub type RunningEncoder = runtime::Running<EncoderService>;

/// Starts the daemon: refuses a text-only model, then the transport, gRPC (+ health) and
/// `/metrics`; stops gracefully when `shutdown` resolves.
pub async fn start(
    args: DaemonArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<RunningEncoder> {
    let Some(tower) = vision_tower(&args.model)? else {
        anyhow::bail!(
            "model `{}` has no vision tower ({} declares no `vision_config`): it takes text \
             only and needs no encoder worker",
            args.model_id(),
            args.model.join("config.json").display()
        );
    };
    tracing::warn!(
        model = %args.model_id(),
        model_type = %tower.model_type,
        "the vision tower is not implemented yet: Encode answers UNIMPLEMENTED"
    );
    let transport = runtime::start_transport(&args).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let info = runtime::daemon_info(&args, v1::Role::Encoder, &transport, listener.local_addr()?);
    let drain = Drain::new();
    let service = Arc::new(EncoderService {
        info: info.clone(),
        tower,
        _transport: transport,
        drain: drain.clone(),
        images: AtomicU64::new(0),
        failures: AtomicU64::new(0),
    });
    let grpc = EncoderWorkerServer::new(EncoderGrpc(service.clone()));
    runtime::serve(
        &args,
        listener,
        &info,
        drain,
        service,
        grpc,
        EncoderService::metrics_text,
        shutdown,
    )
    .await
}
