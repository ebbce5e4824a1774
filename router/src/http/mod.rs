//! The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! `/health`, `/metrics`. It owns tokenization, chat templating, validation and detokenization,
//! and hands token IDs to a [`GenerationBackend`]. With API keys configured every route but
//! `/health` and `/metrics` needs one ([`access`]), and a rate limit may hold clients back.

pub mod access;
pub mod args;
mod chat;
mod completions;
pub mod error;
pub mod fetch;
pub(crate) mod generate;
pub mod images;
pub(crate) mod logprobs;
mod stream;
pub mod types;

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{ConnectInfo, DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tessera_tokenizer::{ChatTemplate, Tokenizer};

use crate::backend::GenerationBackend;
use crate::metrics::Metrics;
use access::{Access, ApiKeys, RateLimit};
pub use error::ApiError;
use error::Refused;
use types::{ModelCard, ModelList};

/// Settings of the front that are not the model's.
#[derive(Debug, Clone)]
pub struct FrontOptions {
    /// The model name clients use; defaults to the backend's `model_id()`.
    pub served_model_name: Option<String>,
    /// Largest accepted request body (413 above it).
    pub max_body_bytes: usize,
    /// Token ids at or above this are rejected (400); defaults to the tokenizer's vocabulary
    /// size. Set it to the model's `vocab_size` when that is smaller.
    pub vocab_size: Option<usize>,
    /// `max_tokens` of `/v1/completions` when the client gives none (OpenAI: 16).
    pub default_completion_max_tokens: usize,
    /// Longest prompt accepted in tokens (400 above it); the model's context when `None`.
    pub max_prompt_tokens: Option<usize>,
    /// Keys every request but `/health` and `/metrics` must present; `None`: no
    /// authentication (loopback and development only).
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Per-key (per-IP without keys) token bucket; `None`: unlimited.
    pub rate_limit: Option<RateLimit>,
    /// Log every request's prompt text and parameters (info level). Off: no prompt content
    /// reaches the logs at any level, only ids and token counts.
    pub log_requests: bool,
    /// The token the chat template writes where an image goes; `None`: the model takes no
    /// images (image parts get a 400).
    pub image_token_id: Option<u32>,
    /// Limits on the images of one request.
    pub image_rules: images::ImageRules,
    /// Hosts image URLs may be fetched from; `None`: only `data:` URLs are taken.
    pub remote_images: Option<Arc<fetch::RemoteImages>>,
}

impl Default for FrontOptions {
    fn default() -> Self {
        FrontOptions {
            served_model_name: None,
            max_body_bytes: 8 << 20,
            vocab_size: None,
            default_completion_max_tokens: 16,
            max_prompt_tokens: None,
            api_keys: None,
            rate_limit: None,
            log_requests: false,
            image_token_id: None,
            image_rules: images::ImageRules::default(),
            remote_images: None,
        }
    }
}

/// Shared by every handler.
pub(crate) struct AppState {
    pub(crate) backend: Arc<dyn GenerationBackend>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) chat_template: Option<Arc<ChatTemplate>>,
    pub(crate) eos_ids: Vec<u32>,
    pub(crate) served_model: String,
    pub(crate) vocab_size: usize,
    pub(crate) default_completion_max_tokens: usize,
    pub(crate) max_prompt_tokens: Option<usize>,
    pub(crate) log_requests: bool,
    pub(crate) image_token_id: Option<u32>,
    pub(crate) image_rules: images::ImageRules,
    pub(crate) remote_images: Option<Arc<fetch::RemoteImages>>,
    pub(crate) access: Access,
    pub(crate) created: u64,
    pub(crate) metrics: Arc<Metrics>,
}

impl AppState {
    /// 404 unless `model` is absent or the served model.
    pub(crate) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.served_model => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }

    /// Tokenize off the async threads: prompts can be megabytes.
    pub(crate) async fn encode(
        &self,
        text: String,
        allow_special: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer.clone();
        tokio::task::spawn_blocking(move || tok.encode(&text, allow_special))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
            .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize: {e}")))
    }
}

/// The HTTP front, ready to serve.
pub struct HttpFront {
    state: Arc<AppState>,
    max_body_bytes: usize,
}

impl HttpFront {
    /// `eos_ids` end generation unless a request sets `ignore_eos` (from the model's
    /// `config.json` / `generation_config.json`; the tokenizer does not know them).
    pub fn new(
        backend: Arc<dyn GenerationBackend>,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
        eos_ids: Vec<u32>,
        opts: FrontOptions,
    ) -> Self {
        let served_model = opts
            .served_model_name
            .unwrap_or_else(|| backend.model_id().to_string());
        let vocab_size = opts.vocab_size.unwrap_or_else(|| tokenizer.vocab_size());
        let state = AppState {
            backend,
            tokenizer,
            chat_template: chat_template.map(Arc::new),
            eos_ids,
            served_model,
            vocab_size,
            default_completion_max_tokens: opts.default_completion_max_tokens,
            max_prompt_tokens: opts.max_prompt_tokens,
            log_requests: opts.log_requests,
            image_token_id: opts.image_token_id,
            image_rules: opts.image_rules,
            remote_images: opts.remote_images,
            access: Access::new(opts.api_keys, opts.rate_limit),
            created: unix_now(),
            metrics: Arc::new(Metrics::default()),
        };
        HttpFront {
            state: Arc::new(state),
            max_body_bytes: opts.max_body_bytes,
        }
    }

    /// The front's metrics (also served on `/metrics`).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.state.metrics.clone()
    }

    /// The public gRPC `tessera.v1.Generate` service over the same backend, tokenizer,
    /// validation and metrics as this front.
    pub fn grpc(&self) -> crate::grpc_front::GrpcFront {
        crate::grpc_front::GrpcFront::new(self.state.clone())
    }

    /// The axum router, for tests or for nesting into a larger server.
    pub fn router(self) -> Router {
        let state = self.state;
        Router::new()
            .route("/v1/completions", post(completions::handle))
            .route("/v1/chat/completions", post(chat::handle))
            .route("/v1/models", get(list_models))
            .route("/v1/models/{*id}", get(get_model))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(middleware::from_fn_with_state(state.clone(), guard))
            .layer(middleware::from_fn_with_state(
                state.clone(),
                count_requests,
            ))
            .layer(DefaultBodyLimit::max(self.max_body_bytes))
            .with_state(state)
    }

    /// Serve on `listener` until `shutdown` resolves, then finish in-flight requests.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, model = %self.state.served_model, "HTTP front listening");
        }
        // The peer address keys the rate limit when there are no API keys.
        let app = self
            .router()
            .into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh `{prefix}-…` id, unique within the process and unpredictable across processes.
pub(crate) fn new_request_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    format!("{prefix}-{:016x}{:08x}", h.finish(), n as u32)
}

/// Routes open to anyone: load balancers and Prometheus carry no API key.
const OPEN_ROUTES: &[&str] = &["/health", "/metrics"];

/// API key and rate limit, before any route (unknown ones included) sees the request or its
/// body.
async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if OPEN_ROUTES.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let headers = req.headers();
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    match state.access.admit(
        headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
        headers.get("x-api-key").map(|v| v.as_bytes()),
        peer,
    ) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Counts every response by matched route and status, and refusals by reason.
async fn count_requests(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let response = next.run(req).await;
    let metrics = &state.metrics;
    metrics.count_request(&endpoint, response.status().as_u16());
    if let Some(r) = response.extensions().get::<Refused>() {
        metrics.count_refused(r.status, r.reason);
    }
    response
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.served_model.clone(),
        object: "model",
        created: state.created,
        owned_by: "tessera",
        max_model_len: state.backend.max_model_len(),
    }
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&state)],
    })
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    state.check_model(Some(&id))?;
    Ok(Json(model_card(&state)))
}

async fn health(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    state.backend.health()?;
    Ok(StatusCode::OK)
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = state.metrics.render();
    text.push_str(&state.backend.metrics_text());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// The body must be a JSON object; anything else is a 400.
pub(crate) fn require_object(v: &serde_json::Value) -> Result<(), ApiError> {
    if v.is_object() {
        Ok(())
    } else {
        Err(ApiError::invalid("The request body must be a JSON object"))
    }
}
