//! The vision-encoder daemon (`tessera-encoder`): the encoder pool of DESIGN §4 step 2. The
//! router sends it a request's images; it runs the model's vision tower and projector
//! (`tessera_engine::vision`) and pushes the embeddings into the chosen prefill worker's
//! buffers over `tessera-transfer` ([`push`]), or keeps them under handles when the request
//! names no destination.
//!
//! Only a model whose `config.json` declares a vision tower (a `vision_config` object, as
//! Kimi-K2.5's does) needs an encoder; for a text-only model the daemon refuses to start, with
//! an error naming the model. It serves the `EncoderWorker` service through the shared worker
//! runtime (`tessera_prefill::runtime`: cluster-secret check, health, `/metrics`, drain,
//! registration). A bad image (not an image, truncated, zero-size, over the limits) is
//! INVALID_ARGUMENT with the reason, which the router turns into a 400.

mod histogram;
pub mod push;
pub mod store;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tessera_engine::vision::{ImageEmbedding, ImageLimits, VisionModel};
use tessera_prefill::runtime::{self, ClusterToken, DaemonArgs, Drain, TransportKind};
use tessera_proto::tonic::{self, Request, Response, Status};
use tessera_proto::v1;
use tessera_proto::v1::encoder_worker_server::{EncoderWorker, EncoderWorkerServer};
use tessera_transfer::Transport;

use histogram::Histogram;
use push::Pusher;
use store::{EmbeddingCache, HeldEmbeddings};

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

/// Flags of `tessera-encoder` (each also from `TESSERA_*` env).
#[derive(clap::Args, Clone, Debug)]
pub struct EncoderArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Largest encoded image accepted, in bytes; larger ones are refused (INVALID_ARGUMENT).
    #[arg(long, env = "TESSERA_MAX_IMAGE_BYTES", default_value_t = 20 << 20)]
    pub max_image_bytes: usize,
    /// Largest decoded image accepted, in pixels (width × height).
    #[arg(long, env = "TESSERA_MAX_IMAGE_PIXELS", default_value_t = 40_000_000)]
    pub max_image_pixels: u64,
    /// Bytes of recent embeddings kept by image hash, so a repeated image is not encoded again
    /// (0: no cache).
    #[arg(long, env = "TESSERA_EMBEDDING_CACHE_BYTES", default_value_t = 256 << 20)]
    pub embedding_cache_bytes: usize,
    /// How long embeddings wait for their consumer when `Encode` names no TTL, in milliseconds
    /// (on this encoder without a destination, in the prefill worker's buffer with one).
    #[arg(long, env = "TESSERA_EMBEDDING_TTL_MS", default_value_t = 30_000)]
    pub embedding_ttl_ms: u32,
    /// Images encoded at once at most (each runs the vision tower on the CPU threads).
    #[arg(long, env = "TESSERA_MAX_CONCURRENT_ENCODES", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_encodes: u32,
    /// Transport the embeddings travel over: the prefill workers' `--transport` (`ucx`: a build
    /// with `--features ucx`).
    #[arg(long, env = "TESSERA_TRANSPORT", value_enum, default_value_t = TransportKind::Tcp)]
    pub transport: TransportKind,
}

/// Largest `Encode` request accepted (the images of one request).
const MAX_MESSAGE_BYTES: usize = 256 << 20;

pub struct EncoderService {
    info: v1::WorkerInfo,
    vision: Arc<VisionModel>,
    transport: Arc<dyn Transport>,
    pusher: Pusher,
    drain: Arc<Drain>,
    cache: EmbeddingCache,
    held: HeldEmbeddings,
    ttl: Duration,
    permits: tokio::sync::Semaphore,
    /// Images encoded (cache hits included), images refused or failed, cache hits.
    images: AtomicU64,
    failures: AtomicU64,
    cache_hits: AtomicU64,
    bytes_pushed: AtomicU64,
    encode_seconds: Histogram,
}

fn invalid(msg: impl Into<String>) -> Status {
    v1::ErrorDetail::new(v1::ErrorCode::InvalidArgument, msg).into_status()
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
        let (held, held_bytes) = self.held.usage();
        let (cached, cached_bytes) = self.cache.usage();
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
                    "Images encoded (embedding-cache hits included).",
                    self.images.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_encode_failures_total",
                    "Images refused (not an image, over the limits) or whose encode failed.",
                    self.failures.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_encode_cache_hits_total",
                    "Images whose embeddings came from the embedding cache.",
                    self.cache_hits.load(Ordering::Relaxed),
                ),
                runtime::counter(
                    "tessera_encode_pushed_bytes_total",
                    "Bytes of embeddings written into prefill workers' buffers.",
                    self.bytes_pushed.load(Ordering::Relaxed),
                ),
                runtime::gauge(
                    "tessera_embeddings_held",
                    "Embeddings kept on this encoder under a handle (Encode without destination).",
                    held as f64,
                ),
                runtime::gauge(
                    "tessera_embeddings_held_bytes",
                    "Bytes of the embeddings kept under a handle.",
                    held_bytes as f64,
                ),
                runtime::gauge(
                    "tessera_embedding_cache_entries",
                    "Images in the embedding cache.",
                    cached as f64,
                ),
                runtime::gauge(
                    "tessera_embedding_cache_bytes",
                    "Bytes of the embedding cache.",
                    cached_bytes as f64,
                ),
            ],
        );
        self.encode_seconds.write(
            &mut s,
            "tessera_encode_seconds",
            "Time to encode one image (vision tower, merge, projector), cache misses only.",
            "role=\"encoder\"",
        );
        s
    }

    /// The embeddings of one image: from the cache, or encoded (one permit at a time).
    async fn embed(
        &self,
        index: usize,
        image: v1::ImageData,
    ) -> Result<Arc<ImageEmbedding>, Status> {
        self.images.fetch_add(1, Ordering::Relaxed);
        let hash: [u8; 32] = Sha256::digest(&image.data).into();
        if let Some(e) = self.cache.get(&hash) {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(e);
        }
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| Status::unavailable("the encoder is stopping"))?;
        let vision = self.vision.clone();
        let started = Instant::now();
        let encoded = tokio::task::spawn_blocking(move || vision.encode_image(&image.data))
            .await
            .map_err(|e| {
                v1::ErrorDetail::new(v1::ErrorCode::Internal, format!("encode task: {e}"))
                    .into_status()
            });
        let e = match encoded {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                return Err(invalid(format!("image {index}: {e}")));
            }
            Err(s) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                return Err(s);
            }
        };
        self.encode_seconds.observe(started.elapsed());
        let e = Arc::new(e);
        self.cache.insert(e.clone());
        Ok(e)
    }

    /// Keeps `e` here under a handle (no destination).
    fn hold(&self, request_id: &str, e: Arc<ImageEmbedding>, ttl: Duration) -> v1::EmbeddingHandle {
        let handle = v1::EmbeddingHandle {
            n_tokens: e.n_tokens as u32,
            hidden: e.hidden as u32,
            dtype: v1::Dtype::F32 as i32,
            content_hash: e.content_hash.to_vec(),
            holder_worker_id: self.info.worker_id.clone(),
            holder_incarnation_id: self.info.incarnation_id,
            handle_id: String::new(),
        };
        let id = self.held.hold(request_id, e, Instant::now() + ttl);
        v1::EmbeddingHandle {
            handle_id: id,
            ..handle
        }
    }
}

tessera_prefill::grpc_face!(EncoderGrpc => EncoderService);

#[tonic::async_trait]
impl EncoderWorker for EncoderGrpc {
    async fn encode(
        &self,
        request: Request<v1::EncodeRequest>,
    ) -> Result<Response<v1::EncodeReply>, Status> {
        let req = request.into_inner();
        let _guard = runtime::admit(&self.drain, &self.info, req.target_incarnation)?;
        if req.images.is_empty() {
            return Err(invalid("the request carries no image"));
        }
        let ttl = match req.ttl_ms {
            0 => self.ttl,
            ms => Duration::from_millis(ms.into()),
        };
        let started = Instant::now();
        let mut embeddings = Vec::with_capacity(req.images.len());
        for (i, image) in req.images.into_iter().enumerate() {
            embeddings.push(self.embed(i, image).await?);
        }
        let compute_us = started.elapsed().as_micros() as u64;
        let Some(dest) = req.destination else {
            let handles = embeddings
                .into_iter()
                .map(|e| self.hold(&req.request_id, e, ttl))
                .collect();
            return Ok(Response::new(v1::EncodeReply {
                handles,
                compute_us,
                transfer: None,
            }));
        };
        let pushed = Instant::now();
        let (mut handles, mut bytes) = (Vec::with_capacity(embeddings.len()), 0);
        for e in &embeddings {
            let ttl_ms = ttl.as_millis().min(u32::MAX as u128) as u32;
            let (handle, n) = self
                .pusher
                .push(
                    self.transport.as_ref(),
                    &self.info,
                    &req.request_id,
                    &dest,
                    ttl_ms,
                    e,
                )
                .await?;
            handles.push(handle);
            bytes += n;
        }
        self.bytes_pushed.fetch_add(bytes, Ordering::Relaxed);
        Ok(Response::new(v1::EncodeReply {
            handles,
            compute_us,
            transfer: Some(v1::TransferStats {
                backend: runtime::backend_of(&self.info) as i32,
                bytes,
                duration_us: pushed.elapsed().as_micros() as u64,
                ..Default::default()
            }),
        }))
    }

    async fn release(
        &self,
        request: Request<v1::ReleaseEmbeddingsRequest>,
    ) -> Result<Response<v1::ReleaseEmbeddingsReply>, Status> {
        let req = request.into_inner();
        runtime::check_target(&self.info, req.target_incarnation)?;
        let released = self.held.release(&req.request_id, &req.handle_ids);
        Ok(Response::new(v1::ReleaseEmbeddingsReply {
            released: released as u32,
        }))
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

/// Starts the daemon: refuses a text-only model, loads the vision tower, then the transport,
/// gRPC (+ health) and `/metrics`; stops gracefully when `shutdown` resolves.
pub async fn start(
    args: EncoderArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<RunningEncoder> {
    let daemon = &args.daemon;
    if vision_tower(&daemon.model)?.is_none() {
        anyhow::bail!(
            "model `{}` has no vision tower ({} declares no `vision_config`): it takes text \
             only and needs no encoder worker",
            daemon.model_id(),
            daemon.model.join("config.json").display()
        );
    }
    let dir = daemon.model.clone();
    let vision = tokio::task::spawn_blocking(move || VisionModel::load(&dir))
        .await?
        .with_context(|| format!("loading the vision tower of {}", daemon.model.display()))?;
    let Some(mut vision) = vision else {
        anyhow::bail!(
            "model `{}` declares a vision tower the engine cannot load",
            daemon.model_id()
        );
    };
    vision.set_limits(ImageLimits {
        max_bytes: args.max_image_bytes,
        max_pixels: args.max_image_pixels,
        ..vision.limits().clone()
    });
    args.transport.check_built()?;
    let transport = runtime::start_transport_of(args.transport, daemon).await?;
    let listener = tokio::net::TcpListener::bind(daemon.listen)
        .await
        .with_context(|| format!("binding {}", daemon.listen))?;
    let info = runtime::worker_info(
        daemon,
        v1::Role::Encoder,
        transport.as_ref(),
        listener.local_addr()?,
    );
    let drain = Drain::new();
    let service = Arc::new(EncoderService {
        info: info.clone(),
        vision: Arc::new(vision),
        transport,
        pusher: Pusher::new(
            ClusterToken::new(&daemon.auth_secret)?,
            daemon.tls.load().map_err(anyhow::Error::msg)?,
        ),
        drain: drain.clone(),
        cache: EmbeddingCache::new(args.embedding_cache_bytes),
        held: HeldEmbeddings::default(),
        ttl: Duration::from_millis(args.embedding_ttl_ms.max(1).into()),
        permits: tokio::sync::Semaphore::new(args.max_concurrent_encodes as usize),
        images: AtomicU64::new(0),
        failures: AtomicU64::new(0),
        cache_hits: AtomicU64::new(0),
        bytes_pushed: AtomicU64::new(0),
        encode_seconds: Histogram::default(),
    });
    let sweeper = Arc::downgrade(&service);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let Some(s) = sweeper.upgrade() else { return };
            s.held.expire(Instant::now());
        }
    });
    let grpc = EncoderWorkerServer::new(EncoderGrpc(service.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    runtime::serve(
        daemon,
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
