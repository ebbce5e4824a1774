//! The public gRPC front: `tessera.v1.Generate` (DESIGN §7), served next to `grpc.health.v1`.
//!
//! It shares everything with the HTTP front ([`HttpFront::grpc`](crate::HttpFront::grpc)): the
//! backend, the tokenizer, the metrics, and the request path — parameters are validated by the
//! same `GenOptions::from_params`, prompts admitted by the same `AppState::start`, output
//! detokenized by the same `Generation`, callers admitted by the same API keys and rate limit
//! (`authorization: Bearer <key>` or `x-api-key` metadata; `grpc.health.v1` stays open). Errors
//! stay [`ApiError`]s until `status` turns them into a gRPC status, once, at the edge.
//!
//! The response stream owns the `Generation`: when the client cancels (drops the stream),
//! tonic drops it, which drops the backend receiver and so cancels the request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::Stream;
use tessera_proto::tonic::{self, Code, Request, Response, Status};
use tessera_proto::v1::generate_request::Prompt;
use tessera_proto::v1::generate_server::{Generate, GenerateServer};
use tessera_proto::v1::{
    self, GenerateRequest, GenerateResponse, ListModelsRequest, ListModelsResponse, ModelInfo,
};

use crate::http::error::ApiError;
use crate::http::generate::{check_token_id, check_top_logprobs, Delta, GenOptions, Generation};
use crate::http::logprobs::wire_form;
use crate::http::types::{CommonParams, StopField};
use crate::http::{new_request_id, AppState};

/// The `tessera.v1.Generate` service implementation.
#[derive(Clone)]
pub struct GrpcFront {
    state: Arc<AppState>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

const GENERATE_ENDPOINT: &str = "/tessera.v1.Generate/Generate";
const LIST_MODELS_ENDPOINT: &str = "/tessera.v1.Generate/ListModels";

impl GrpcFront {
    pub(crate) fn new(state: Arc<AppState>) -> Self {
        GrpcFront { state }
    }

    /// The tonic service, for adding to a `tonic::transport::Server`.
    pub fn into_service(self) -> GenerateServer<GrpcFront> {
        GenerateServer::new(self)
    }

    /// Serve `Generate` and `grpc.health.v1` on `listener` until `shutdown` resolves, then
    /// finish in-flight calls.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, model = %self.state.served_model, "gRPC front listening");
        }
        let (health, health_svc) = tessera_proto::health::server::health_reporter();
        health.set_serving::<GenerateServer<GrpcFront>>().await;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tonic::transport::Server::builder()
            .add_service(health_svc)
            .add_service(self.into_service())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }

    /// The API key and rate limit, as the HTTP front checks them.
    fn admit<T>(&self, request: &Request<T>) -> Result<(), ApiError> {
        let md = request.metadata();
        self.state.access.admit(
            md.get("authorization").map(|v| v.as_bytes()),
            md.get("x-api-key").map(|v| v.as_bytes()),
            request.remote_addr().map(|a| a.ip()),
        )
    }

    /// Count the call's outcome, then turn an error into its status.
    fn finish<T>(&self, endpoint: &str, result: Result<T, ApiError>) -> Result<T, Status> {
        let metrics = &self.state.metrics;
        match result {
            Ok(v) => {
                metrics.count_request(endpoint, 200);
                Ok(v)
            }
            Err(e) => {
                metrics.count_request(endpoint, e.status.as_u16());
                if e.status.is_client_error() {
                    metrics.count_refused(e.status.as_u16(), e.reason());
                }
                Err(status(e))
            }
        }
    }

    /// Validate, tokenize and submit; the first delta is awaited so that failures before any
    /// output still come back as the call's status.
    async fn start(&self, req: GenerateRequest) -> Result<(Call, Delta), ApiError> {
        let arrived = Instant::now();
        let state = &self.state;
        let model = (!req.model.is_empty()).then_some(req.model.as_str());
        state.check_model(model)?;
        let common = common_params(&req);
        let max_tokens = common.max_tokens;
        let mut opts = GenOptions::from_params(common, max_tokens, state.vocab_size)?;
        opts.logprobs = req
            .logprobs
            .map(|k| check_top_logprobs(i64::from(k), "logprobs"))
            .transpose()?;
        let prompt_ids = match req.prompt {
            None => return Err(ApiError::invalid_param("prompt", "missing field `prompt`")),
            Some(Prompt::Text(t)) if t.is_empty() => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "`prompt` must not be empty",
                ))
            }
            // As /v1/completions: special-token text maps to special tokens.
            Some(Prompt::Text(t)) => state.encode(t, true).await?,
            Some(Prompt::TokenIds(ids)) if ids.ids.is_empty() => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "`prompt` must not be empty",
                ))
            }
            Some(Prompt::TokenIds(ids)) => ids
                .ids
                .into_iter()
                .map(|id| check_token_id(i64::from(id), state.vocab_size, "prompt"))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let request_id = if req.request_id.is_empty() {
            new_request_id("gen")
        } else {
            req.request_id
        };
        let mut generation = state.start(
            request_id.clone(),
            prompt_ids,
            Vec::new(),
            &opts,
            Some(state.default_completion_max_tokens),
            arrived,
        )?;
        let first = generation.first().await?;
        let call = Call {
            generation,
            request_id,
            model: state.served_model.clone(),
            skip_text: req.skip_text,
            finished: false,
        };
        Ok((call, first))
    }
}

/// The proto request as the HTTP front's shared parameters, so both validate alike.
fn common_params(req: &GenerateRequest) -> CommonParams {
    let sampling = req.sampling.as_ref();
    CommonParams {
        model: None,
        // 0 means the router's default; the prompt length is checked by `AppState::start`.
        max_tokens: (req.max_tokens > 0).then_some(i64::from(req.max_tokens)),
        temperature: sampling.map(|s| f64::from(s.temperature)),
        top_p: sampling.and_then(|s| s.top_p).map(f64::from),
        top_k: sampling.map(|s| i64::from(s.top_k)),
        // Round-trips through the HTTP front's `i64` seed unchanged.
        seed: sampling.and_then(|s| s.seed).map(|s| s as i64),
        presence_penalty: sampling.map(|s| f64::from(s.presence_penalty)),
        frequency_penalty: sampling.map(|s| f64::from(s.frequency_penalty)),
        logit_bias: sampling.map(|s| {
            s.logit_bias
                .iter()
                .map(|b| (b.token_id.to_string(), serde_json::json!(b.bias)))
                .collect()
        }),
        stop: Some(StopField::Many(req.stop.clone())),
        stop_token_ids: Some(req.stop_token_ids.iter().map(|&id| i64::from(id)).collect()),
        ignore_eos: req.ignore_eos,
        stream: req.stream,
        ..CommonParams::default()
    }
}

/// The one place an [`ApiError`] becomes a gRPC status (a 429's `Retry-After` as `retry-after`
/// metadata).
fn status(e: ApiError) -> Status {
    let code = match e.status.as_u16() {
        400 | 413 | 422 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        404 => Code::NotFound,
        429 => Code::ResourceExhausted,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    let mut s = Status::new(code, e.message);
    if let Some(secs) = e.retry_after {
        s.metadata_mut().insert("retry-after", secs.into());
    }
    s
}

fn finish_reason(name: &str) -> v1::FinishReason {
    match name {
        "stop" => v1::FinishReason::Stop,
        "length" => v1::FinishReason::Length,
        "abort" => v1::FinishReason::Cancelled,
        _ => v1::FinishReason::Error,
    }
}

/// One admitted call: turns deltas into responses.
struct Call {
    generation: Generation,
    request_id: String,
    model: String,
    skip_text: bool,
    finished: bool,
}

impl Call {
    fn response(&mut self, d: Delta) -> GenerateResponse {
        let mut r = GenerateResponse {
            request_id: self.request_id.clone(),
            token_ids: d.token_ids,
            text: if self.skip_text {
                String::new()
            } else {
                d.text
            },
            model: self.model.clone(),
            logprobs: wire_form(&d.logprobs),
            ..GenerateResponse::default()
        };
        if let Some(f) = d.finish {
            self.finished = true;
            r.set_finish_reason(finish_reason(f));
            let u = self.generation.usage();
            r.usage = Some(v1::Usage {
                prompt_tokens: u.prompt_tokens as u32,
                completion_tokens: u.completion_tokens as u32,
                cached_tokens: u.prompt_tokens_details.cached_tokens as u32,
            });
        }
        r
    }

    /// Everything up to the finish, as one response.
    async fn collect(mut self, first: Delta) -> Result<GenerateResponse, ApiError> {
        let mut all = first;
        while all.finish.is_none() {
            match self.generation.next().await {
                Some(d) => {
                    let d = d?;
                    all.text.push_str(&d.text);
                    all.token_ids.extend(d.token_ids);
                    all.logprobs.extend(d.logprobs);
                    all.finish = d.finish;
                }
                None => {
                    return Err(ApiError::internal(
                        "generation ended without a finish reason",
                    ))
                }
            }
        }
        Ok(self.response(all))
    }
}

fn worth_sending(d: &Delta) -> bool {
    !d.token_ids.is_empty() || !d.text.is_empty() || d.finish.is_some()
}

/// One response per delta worth sending; an error after the first response ends the stream
/// with its status.
fn response_stream(call: Call, first: Delta) -> ResponseStream {
    let stream =
        futures_util::stream::unfold((call, Some(first)), |(mut call, mut pending)| async move {
            loop {
                if let Some(d) = pending.take() {
                    if worth_sending(&d) {
                        let r = call.response(d);
                        return Some((Ok(r), (call, None)));
                    }
                }
                if call.finished {
                    return None;
                }
                match call.generation.next().await {
                    Some(Ok(d)) => pending = Some(d),
                    Some(Err(e)) => {
                        call.finished = true;
                        return Some((Err(status(e)), (call, None)));
                    }
                    None => return None,
                }
            }
        });
    Box::pin(stream)
}

#[tonic::async_trait]
impl Generate for GrpcFront {
    type GenerateStream = ResponseStream;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let result = async {
            self.admit(&request)?;
            let req = request.into_inner();
            let stream = req.stream;
            let (call, first) = self.start(req).await?;
            if stream {
                return Ok(response_stream(call, first));
            }
            let r = call.collect(first).await?;
            Ok(Box::pin(futures_util::stream::iter([Ok(r)])) as ResponseStream)
        }
        .await;
        self.finish(GENERATE_ENDPOINT, result).map(Response::new)
    }

    async fn list_models(
        &self,
        request: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        self.finish(LIST_MODELS_ENDPOINT, self.admit(&request))?;
        let state = &self.state;
        Ok(Response::new(ListModelsResponse {
            models: vec![ModelInfo {
                id: state.served_model.clone(),
                owned_by: "tessera".into(),
                created: state.created as i64,
                max_context_tokens: u32::try_from(state.backend.max_model_len())
                    .unwrap_or(u32::MAX),
                vision: false,
            }],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_errors_map_to_grpc_codes() {
        use crate::backend::BackendError;
        let cases = [
            (ApiError::invalid("x"), Code::InvalidArgument),
            (ApiError::model_not_found("m"), Code::NotFound),
            (
                ApiError::unauthorized("no key", "missing_api_key"),
                Code::Unauthenticated,
            ),
            (ApiError::rate_limited(3), Code::ResourceExhausted),
            (
                BackendError::Overloaded("q".into()).into(),
                Code::ResourceExhausted,
            ),
            (
                BackendError::PromptTooLong {
                    prompt_tokens: 9,
                    limit: 8,
                }
                .into(),
                Code::InvalidArgument,
            ),
            (
                BackendError::Unavailable("x".into()).into(),
                Code::Unavailable,
            ),
            (BackendError::Internal("x".into()).into(), Code::Internal),
        ];
        for (e, code) in cases {
            assert_eq!(status(e).code(), code);
        }
        let s = status(ApiError::rate_limited(3));
        assert_eq!(s.metadata().get("retry-after").unwrap(), "3");
    }
}
