//! The seam between the HTTP front and whatever generates tokens.
//!
//! The front tokenizes, validates and detokenizes; a [`GenerationBackend`] only ever sees token
//! IDs. `tessera serve` plugs in an in-process engine, the router daemon plugs in gRPC clients of
//! the worker pools. Cancellation is ownership: dropping the receiver returned by
//! [`GenerationBackend::submit`] cancels the request.

use tokio::sync::mpsc;

/// How to pick the next token. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`; 1 disables.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: u32,
    /// Seed for a reproducible sample stream; `None` means nondeterministic.
    pub seed: Option<u64>,
    /// Subtracted from the logit of every token the completion already holds.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the completion already holds it.
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids (checked against the vocabulary).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// One generation, already tokenized and validated by the front.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Unique per request (`cmpl-…`, `chatcmpl-…`); use it in logs and across hops.
    pub request_id: String,
    pub prompt_ids: Vec<u32>,
    /// Generate at most this many tokens (≥ 1). `prompt_ids.len() + max_tokens` fits the model.
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Finish with [`FinishReason::Stop`] after sampling any of these. The front already
    /// includes the model's EOS ids here unless `ignore_eos` is set.
    pub stop_token_ids: Vec<u32>,
    /// The client asked to ignore EOS; backends with their own EOS notion must honour it.
    pub ignore_eos: bool,
    /// Images, in prompt order: image `k` goes at the `k`-th run of the model's image
    /// placeholder token in `prompt_ids` (one token per image, widened by the backend once the
    /// image's embedding rows are known; the prompt and `max_tokens` limits are checked again
    /// then).
    pub images: Vec<crate::images::ImageInput>,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// ([`TokenEvent::Logprobs`]); `None`: none.
    pub logprobs: Option<u32>,
}

/// Log-probabilities of one sampled token under the model's distribution (before temperature,
/// penalties or biases): its own, and the most likely tokens' in descending order.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token (EOS or a requested stop token id) was sampled; it was sent as the last
    /// [`TokenEvent::Token`].
    Stop,
    /// The backend gave up on the request (drain, shutdown, abort).
    Cancelled,
}

/// Token accounting reported by the backend when a request finishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What a backend sends for one request, in order: optionally `Prefilled`, then `Token`s, then
/// exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// The prompt has been processed; `cached_tokens` of it came from the prefix cache. Optional,
    /// but without it a request the front stops early (stop string, client gone) reports 0.
    Prefilled {
        cached_tokens: usize,
    },
    /// One sampled token, including the final stop token.
    Token(u32),
    /// The log-probabilities of the token that comes next, for a request that asked
    /// ([`GenerationRequest::logprobs`]).
    Logprobs(TokenLogprobs),
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(BackendError),
}

/// Everything a backend can refuse or fail with. The front maps each to one HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Too much load right now; the client should retry later (429).
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The request cannot be served as asked (400).
    #[error("{0}")]
    InvalidRequest(String),
    /// The prompt alone does not fit the model (400, `context_length_exceeded`).
    #[error("prompt of {prompt_tokens} tokens exceeds the limit of {limit} tokens")]
    PromptTooLong { prompt_tokens: usize, limit: usize },
    /// No worker can serve at all (503).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A bug or an unexpected failure (500).
    #[error("internal error: {0}")]
    Internal(String),
}

/// Generates tokens for tokenized requests. Implementations must be cheap to call from async
/// code: `submit` must not block on generation, only enqueue it.
pub trait GenerationBackend: Send + Sync + 'static {
    /// The model's identifier (the default served model name).
    fn model_id(&self) -> &str;

    /// Maximum prompt + generated tokens per request.
    fn max_model_len(&self) -> usize;

    /// Starts generating; events arrive on the returned receiver. Dropping the receiver cancels
    /// the request: the backend must notice (a failed send, or `Sender::closed`) and free its
    /// resources.
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, BackendError>;

    /// Whether the backend can take requests now (`GET /health` answers 503 otherwise).
    fn health(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// The backend's own Prometheus exposition lines, appended to `GET /metrics`.
    fn metrics_text(&self) -> String {
        String::new()
    }
}
