//! A deterministic [`GenerationBackend`] for tests and demos: no model, just arithmetic.
//!
//! Token `i` of a request is `script[i % script.len()]` when a script is set, else
//! `(prompt_len + i) % token_modulus`. It reports a configurable number of cached prompt tokens,
//! can be told to refuse or fail requests, and counts the requests it saw cancelled.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::backend::{
    BackendError, FinishReason, GenerationBackend, GenerationRequest, TokenEvent, TokenLogprobs,
    Usage,
};

/// How the fake behaves.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    pub model_id: String,
    pub max_model_len: usize,
    /// Generated ids stay below this (keep it under the first special id to avoid stops).
    pub token_modulus: u32,
    /// Fixed output tokens, cycled; overrides the arithmetic when non-empty.
    pub script: Vec<u32>,
    /// Reported as `cached_tokens` (capped at the prompt length).
    pub cached_tokens: usize,
    /// Pause before each token.
    pub token_delay: Duration,
}

impl Default for FakeConfig {
    fn default() -> Self {
        FakeConfig {
            model_id: "fake-model".into(),
            max_model_len: 4096,
            token_modulus: 256,
            script: Vec::new(),
            cached_tokens: 0,
            token_delay: Duration::ZERO,
        }
    }
}

/// The fake backend. Share it as `Arc<FakeBackend>`; its knobs can change between requests.
#[derive(Debug)]
pub struct FakeBackend {
    model_id: String,
    config: Mutex<FakeConfig>,
    /// Refuse the next submissions with this error.
    reject: Mutex<Option<BackendError>>,
    /// Send `Failed(Internal)` after this many tokens.
    fail_after: Mutex<Option<usize>>,
    submitted: Mutex<Vec<GenerationRequest>>,
    cancelled: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

impl FakeBackend {
    pub fn new(config: FakeConfig) -> Self {
        FakeBackend {
            model_id: config.model_id.clone(),
            config: Mutex::new(config),
            reject: Mutex::default(),
            fail_after: Mutex::default(),
            submitted: Mutex::default(),
            cancelled: Arc::default(),
            finished: Arc::default(),
        }
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn update(&self, f: impl FnOnce(&mut FakeConfig)) {
        f(&mut Self::lock(&self.config));
    }

    pub fn set_reject(&self, err: Option<BackendError>) {
        *Self::lock(&self.reject) = err;
    }

    pub fn set_fail_after(&self, tokens: Option<usize>) {
        *Self::lock(&self.fail_after) = tokens;
    }

    /// Every request accepted so far.
    pub fn submitted(&self) -> Vec<GenerationRequest> {
        Self::lock(&self.submitted).clone()
    }

    /// Requests whose receiver was dropped before they finished.
    pub fn cancelled(&self) -> usize {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Requests that ran to `Finished` or `Failed`.
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// The log-probabilities the fake reports for token `id` at step `i` with `top`
    /// alternatives: `-(i + 1) / 8` for the token, and the alternatives `id`, `id + 1`, … (modulo
    /// the token modulus) a nat apart from it on.
    pub fn logprobs_at(config: &FakeConfig, id: u32, i: usize, top: u32) -> TokenLogprobs {
        let logprob = -((i + 1) as f32) / 8.0;
        TokenLogprobs {
            token: id,
            logprob,
            top: (0..top)
                .map(|j| ((id + j) % config.token_modulus, logprob - j as f32))
                .collect(),
        }
    }

    /// What the fake would generate for `req`, ignoring stops.
    pub fn token_at(config: &FakeConfig, prompt_len: usize, i: usize) -> u32 {
        if config.script.is_empty() {
            ((prompt_len + i) % config.token_modulus as usize) as u32
        } else {
            config.script[i % config.script.len()]
        }
    }
}

impl GenerationBackend for FakeBackend {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn max_model_len(&self) -> usize {
        Self::lock(&self.config).max_model_len
    }

    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, BackendError> {
        if let Some(e) = Self::lock(&self.reject).clone() {
            return Err(e);
        }
        let config = Self::lock(&self.config).clone();
        let fail_after = *Self::lock(&self.fail_after);
        Self::lock(&self.submitted).push(req.clone());
        let (tx, rx) = mpsc::channel(4);
        let (cancelled, finished) = (self.cancelled.clone(), self.finished.clone());
        tokio::spawn(async move {
            let prompt_len = req.prompt_ids.len();
            let cached_tokens = config.cached_tokens.min(prompt_len);
            let usage = |completion_tokens| Usage {
                prompt_tokens: prompt_len,
                completion_tokens,
                cached_tokens,
            };
            let mut events = vec![TokenEvent::Prefilled { cached_tokens }];
            let mut end = TokenEvent::Finished {
                reason: FinishReason::Length,
                usage: usage(req.max_tokens),
            };
            for i in 0..req.max_tokens {
                if fail_after == Some(i) {
                    end = TokenEvent::Failed(BackendError::Internal("injected failure".into()));
                    break;
                }
                let id = FakeBackend::token_at(&config, prompt_len, i);
                if let Some(k) = req.logprobs {
                    events.push(TokenEvent::Logprobs(FakeBackend::logprobs_at(
                        &config, id, i, k,
                    )));
                }
                events.push(TokenEvent::Token(id));
                if req.stop_token_ids.contains(&id) {
                    end = TokenEvent::Finished {
                        reason: FinishReason::Stop,
                        usage: usage(i + 1),
                    };
                    break;
                }
            }
            events.push(end);
            let mut delivered = true;
            for ev in events {
                if matches!(ev, TokenEvent::Token(_)) && !config.token_delay.is_zero() {
                    tokio::select! {
                        _ = tokio::time::sleep(config.token_delay) => {}
                        _ = tx.closed() => {
                            delivered = false;
                            break;
                        }
                    }
                }
                if tx.send(ev).await.is_err() {
                    delivered = false;
                    break;
                }
            }
            if !delivered {
                cancelled.fetch_add(1, Ordering::SeqCst);
            } else {
                finished.fetch_add(1, Ordering::SeqCst);
            }
        });
        Ok(rx)
    }

    fn metrics_text(&self) -> String {
        format!(
            "# TYPE fake_backend_cancelled_total counter\nfake_backend_cancelled_total {}\n",
            self.cancelled()
        )
    }
}
