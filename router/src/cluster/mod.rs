//! The cluster backend: a [`GenerationBackend`] over gRPC clients of the encoder, prefill and
//! decode pools (DESIGN §4, §6 static discovery).
//!
//! - [`pool`]: membership (static, plus what [`crate::discovery`] adds), lazily connected channels, `grpc.health.v1` probes, in-flight
//!   accounting and the router's per-worker metrics;
//! - [`policy`]: placement (decode least loaded, prefill prefix affinity then load, encoder
//!   image-hash affinity then load);
//! - `flow`: one request's stages ([encode →] select → reserve → prefill → respond → decode),
//!   retries and cancellation;
//! - [`error`]: worker statuses → [`BackendError`].

pub mod error;
mod flow;
pub mod policy;
pub mod pool;

use std::sync::Arc;

use tessera_proto::v1;
use tokio::sync::mpsc;

pub use pool::{PoolOptions, Role, Worker, WorkerPool};

use crate::backend::{BackendError, GenerationBackend, GenerationRequest, TokenEvent};
use flow::Flow;

/// Everything [`ClusterBackend::new`] needs.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The model's identifier (default served model name).
    pub model_id: String,
    /// Prompt + completion tokens per request at most.
    pub max_model_len: usize,
    /// gRPC addresses (`host:port` or `http://host:port`) of the prefill workers.
    pub prefill: Vec<String>,
    /// gRPC addresses of the decode workers.
    pub decode: Vec<String>,
    pub pool: PoolOptions,
    /// How long decode holds a reservation waiting for `StartDecode`; 0 = the worker's default.
    pub reserve_ttl_ms: u32,
    /// gRPC addresses of the encoder workers (none: requests with images get 503).
    pub encoder: Vec<String>,
    /// The model's image placeholder token (`media_placeholder_token_id`); `None` for a
    /// text-only model.
    pub image_token_id: Option<u32>,
}

/// [`WorkerPool::start`] or [`WorkerPool::start_dynamic`]: the pools of the prefill and decode
/// workers given.
type StartPools = fn(&[String], &[String], PoolOptions) -> anyhow::Result<Arc<WorkerPool>>;

/// [`GenerationBackend`] that routes each request to a decode and a prefill worker.
pub struct ClusterBackend {
    pool: Arc<WorkerPool>,
    model_id: String,
    max_model_len: usize,
    reserve_ttl_ms: u32,
    image_token_id: Option<u32>,
}

impl ClusterBackend {
    /// Builds the pools and starts health probing; call inside a tokio runtime. Workers need
    /// not be up yet (channels connect lazily; unhealthy ones are skipped).
    pub fn new(cfg: ClusterConfig) -> anyhow::Result<Self> {
        Self::build(cfg, WorkerPool::start)
    }

    /// Like [`ClusterBackend::new`], but either pool may start empty: discovery
    /// ([`crate::discovery`]) adds workers at run time.
    pub fn new_dynamic(cfg: ClusterConfig) -> anyhow::Result<Self> {
        Self::build(cfg, WorkerPool::start_dynamic)
    }

    /// The backend over the pools `start` builds of `cfg`'s prefill and decode workers, plus its
    /// encoders.
    fn build(cfg: ClusterConfig, start: StartPools) -> anyhow::Result<Self> {
        let pool = start(&cfg.prefill, &cfg.decode, cfg.pool)?;
        pool.add_encoders(&cfg.encoder)?;
        Ok(ClusterBackend {
            pool,
            model_id: cfg.model_id,
            max_model_len: cfg.max_model_len,
            reserve_ttl_ms: cfg.reserve_ttl_ms,
            image_token_id: cfg.image_token_id,
        })
    }

    pub fn pool(&self) -> &Arc<WorkerPool> {
        &self.pool
    }

    fn wire_sampling(req: &GenerationRequest) -> v1::SamplingParams {
        let s = &req.sampling;
        v1::SamplingParams {
            temperature: s.temperature,
            top_p: Some(s.top_p),
            top_k: s.top_k,
            // Fixed here so prefill (first token) and decode (the rest) share one stream.
            seed: Some(s.seed.unwrap_or_else(policy::random_seed)),
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: v1::LogitBias::from_pairs(&s.logit_bias),
        }
    }
}

impl GenerationBackend for ClusterBackend {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, BackendError> {
        if req.prompt_ids.is_empty() {
            return Err(BackendError::InvalidRequest("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(BackendError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        self.health()?;
        let (tx, rx) = mpsc::channel(64);
        let cache_salt = crate::images::cache_salt(&req.images);
        let flow = Flow {
            pool: self.pool.clone(),
            sampling: Self::wire_sampling(&req),
            req,
            tx,
            reserve_ttl_ms: self.reserve_ttl_ms,
            max_model_len: self.max_model_len,
            image_token_id: self.image_token_id,
            cache_salt,
        };
        tokio::spawn(flow.run());
        Ok(rx)
    }

    fn health(&self) -> Result<(), BackendError> {
        for role in [Role::Prefill, Role::Decode] {
            if !self.pool.any_healthy(role) {
                return Err(BackendError::Unavailable(format!(
                    "no healthy {} worker",
                    role.name()
                )));
            }
        }
        Ok(())
    }

    fn metrics_text(&self) -> String {
        self.pool.metrics_text()
    }
}
