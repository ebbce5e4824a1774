//! The request path both endpoints share, as stages: validate the generation parameters
//! ([`GenOptions::from_params`]) → admit a tokenized prompt against the model's limits and
//! submit it ([`AppState::start`]) → turn backend events into text deltas ([`Generation`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tessera_tokenizer::Tokenizer;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::types::{CommonParams, UsageBody};
use super::{new_request_id, unix_now, AppState};
use crate::backend::{FinishReason, GenerationRequest, Sampling, TokenEvent, TokenLogprobs};
use crate::images::ImageInput;
use crate::metrics::Metrics;
use crate::text::{OutputText, TextDelta};

/// Stop strings a request may give at most.
pub(crate) const MAX_STOP_SEQUENCES: usize = 16;
/// Characters of one stop string at most.
pub(crate) const MAX_STOP_CHARS: usize = 256;
/// Stop token ids a request may give at most.
pub(crate) const MAX_STOP_TOKEN_IDS: usize = 256;
/// Alternatives a token's log-probabilities may list at most.
pub(crate) const MAX_TOP_LOGPROBS: i64 = 20;

/// `k` alternatives of log-probabilities when it is in [0, 20], a 400 naming `param` otherwise.
pub(crate) fn check_top_logprobs(k: i64, param: &str) -> Result<u32, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
        return Err(ApiError::invalid_param(
            param,
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ));
    }
    Ok(k as u32)
}

/// Choices (`n`) a request may ask for at most.
pub(crate) const MAX_CHOICES: usize = 16;
/// Tokens `logit_bias` may name at most (OpenAI's bound).
pub(crate) const MAX_LOGIT_BIASES: usize = 300;
/// The largest presence or frequency penalty, either sign.
const MAX_PENALTY: f32 = 2.0;
/// The largest logit bias, either sign.
const MAX_LOGIT_BIAS: f32 = 100.0;

/// Validated generation parameters, before the prompt is known.
#[derive(Debug, Clone)]
pub(crate) struct GenOptions {
    pub sampling: Sampling,
    pub stops: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// As asked; `None` takes the endpoint's default.
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// Choices to generate from the one prompt (`n`), each its own request to the backend.
    pub n: usize,
    /// Log-probabilities of each token and this many alternatives (set by the endpoint from
    /// its own fields).
    pub logprobs: Option<u32>,
}

impl GenOptions {
    /// Check every shared parameter; `max_tokens` is whichever of the endpoint's fields was set.
    pub fn from_params(
        p: CommonParams,
        max_tokens: Option<i64>,
        vocab_size: usize,
    ) -> Result<Self, ApiError> {
        let n = match p.n {
            None => 1,
            Some(n) if n >= 1 && n <= MAX_CHOICES as i64 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n",
                    format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
                ))
            }
        };
        // best_of > n would generate more choices and return the n likeliest: not offered.
        if let Some(b) = p.best_of.filter(|&b| b != n as i64) {
            return Err(ApiError::invalid_param(
                "best_of",
                format!("best_of={b} is not supported: only best_of equal to n ({n}) is"),
            ));
        }
        let mut penalties = [0.0f32; 2];
        for (k, (name, v)) in [
            ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty),
        ]
        .into_iter()
        .enumerate()
        {
            let v = v.unwrap_or(0.0);
            if !(v.is_finite() && v.abs() <= MAX_PENALTY as f64) {
                return Err(ApiError::invalid_param(
                    name,
                    format!("{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}"),
                ));
            }
            penalties[k] = v as f32;
        }
        let logit_bias = parse_logit_bias(p.logit_bias, vocab_size)?;
        let max_tokens = match max_tokens {
            Some(m) if m < 1 => {
                return Err(ApiError::invalid_param(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {m}"),
                ))
            }
            m => m.map(|m| m as usize),
        };
        let temperature = p.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = p.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match p.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            k => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k must be -1 (disabled) or at least 1, got {k}"),
                ))
            }
        };
        if p.stream_options.is_some() && !p.stream {
            return Err(ApiError::invalid_param(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        let stops = p.stop.map(|s| s.into_vec()).unwrap_or_default();
        at_most("stop", "stop sequences", stops.len(), MAX_STOP_SEQUENCES)?;
        if let Some(long) = stops.iter().find(|s| s.chars().count() > MAX_STOP_CHARS) {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "a stop sequence may be at most {MAX_STOP_CHARS} characters, got one of {}",
                    long.chars().count()
                ),
            ));
        }
        let stop_token_ids = p.stop_token_ids.unwrap_or_default();
        at_most(
            "stop_token_ids",
            "stop token ids",
            stop_token_ids.len(),
            MAX_STOP_TOKEN_IDS,
        )?;
        let stop_token_ids = stop_token_ids
            .into_iter()
            .map(|id| check_token_id(id, vocab_size, "stop_token_ids"))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GenOptions {
            sampling: Sampling {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                seed: p.seed.map(|s| s as u64),
                presence_penalty: penalties[0],
                frequency_penalty: penalties[1],
                logit_bias,
            },
            stops,
            stop_token_ids,
            ignore_eos: p.ignore_eos,
            max_tokens,
            stream: p.stream,
            include_usage: p.stream_options.is_some_and(|o| o.include_usage),
            return_token_ids: p.return_token_ids,
            n,
            logprobs: None,
        })
    }
}

/// `logit_bias` as (token id, bias) pairs, sorted by id: keys are token ids in the vocabulary
/// (as strings, OpenAI's form), values numbers in [-100, 100].
fn parse_logit_bias(
    map: Option<serde_json::Map<String, serde_json::Value>>,
    vocab_size: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = map.unwrap_or_default();
    at_most("logit_bias", "biased tokens", map.len(), MAX_LOGIT_BIASES)?;
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id: i64 = key.trim().parse().map_err(|_| {
            ApiError::invalid_param(
                "logit_bias",
                format!("logit_bias keys are token ids, got {key:?}"),
            )
        })?;
        let id = check_token_id(id, vocab_size, "logit_bias")?;
        let bias = value
            .as_f64()
            .filter(|b| b.abs() <= MAX_LOGIT_BIAS as f64)
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!(
                        "the bias of token {id} must be a number in [-{MAX_LOGIT_BIAS}, \
                         {MAX_LOGIT_BIAS}], got {value}"
                    ),
                )
            })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("token {} is named twice", w[0].0),
        ));
    }
    Ok(out)
}

/// 400 naming `param` when a list of `what` has more than `max` entries.
fn at_most(param: &str, what: &str, len: usize, max: usize) -> Result<(), ApiError> {
    if len > max {
        return Err(ApiError::invalid_param(
            param,
            format!("at most {max} {what} are allowed, got {len}"),
        ));
    }
    Ok(())
}

/// A token id from the request, checked against the vocabulary.
pub(crate) fn check_token_id(id: i64, vocab_size: usize, param: &str) -> Result<u32, ApiError> {
    if id < 0 || id as u64 >= vocab_size as u64 {
        return Err(ApiError::invalid_param(
            param,
            format!("token id {id} is out of range for the vocabulary of {vocab_size} tokens"),
        ));
    }
    Ok(id as u32)
}

/// What every chunk or body of one response repeats: the request's id, creation time and model,
/// and whether it returns token ids (the prompt's, when it does, go out once).
pub(crate) struct ResponseHead {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub return_token_ids: bool,
    /// Sent once, with the first chunk or in the whole body.
    pub prompt_token_ids: Option<Vec<u32>>,
}

impl AppState {
    /// The request's choices ([`GenOptions::n`] of them), each an [`AppState::start`] under one
    /// fresh id `<id_prefix>-…` (choice `i` of several as `…-i`, with the seed, if any, plus
    /// `i`, so that each draws its own tokens and choice `i` equals a request for one choice
    /// with that seed), with the head of their response. One that cannot start drops those
    /// already started, which cancels them.
    pub(crate) fn start_choices(
        &self,
        id_prefix: &str,
        prompt_ids: Vec<u32>,
        images: Vec<ImageInput>,
        opts: &GenOptions,
        default_max_tokens: Option<usize>,
        arrived: Instant,
    ) -> Result<(Vec<Generation>, ResponseHead), ApiError> {
        let prompt_token_ids = opts.return_token_ids.then(|| prompt_ids.clone());
        let id = new_request_id(id_prefix);
        let mut choices = Vec::with_capacity(opts.n);
        for i in 0..opts.n {
            let (request_id, choice_opts) = if opts.n == 1 {
                (id.clone(), opts.clone())
            } else {
                let mut o = opts.clone();
                o.sampling.seed = o.sampling.seed.map(|s| s.wrapping_add(i as u64));
                (format!("{id}-{i}"), o)
            };
            choices.push(self.start(
                request_id,
                prompt_ids.clone(),
                images.clone(),
                &choice_opts,
                default_max_tokens,
                arrived,
            )?);
        }
        let head = ResponseHead {
            id,
            created: unix_now(),
            model: self.served_model.clone(),
            return_token_ids: opts.return_token_ids,
            prompt_token_ids,
        };
        Ok((choices, head))
    }

    /// Admit `prompt_ids` (lengths against the model) and submit them to the backend.
    /// `default_max_tokens` of `None` means "the rest of the context".
    pub(crate) fn start(
        &self,
        request_id: String,
        prompt_ids: Vec<u32>,
        images: Vec<ImageInput>,
        opts: &GenOptions,
        default_max_tokens: Option<usize>,
        arrived: Instant,
    ) -> Result<Generation, ApiError> {
        let limit = self.backend.max_model_len();
        let prompt_len = prompt_ids.len();
        if prompt_len == 0 {
            return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
        }
        if let Some(max) = self.max_prompt_tokens.filter(|&m| prompt_len > m) {
            return Err(ApiError::prompt_too_long(format!(
                "This server accepts prompts of at most {max} tokens (--max-prompt-tokens). \
                 However, your prompt has {prompt_len} tokens."
            )));
        }
        if prompt_len >= limit {
            return Err(ApiError::prompt_too_long(format!(
                "This model's maximum context length is {limit} tokens. However, your prompt \
                 has {prompt_len} tokens, leaving no room for a completion."
            )));
        }
        let room = limit - prompt_len;
        let max_tokens = match opts.max_tokens {
            Some(m) if m > room => {
                return Err(ApiError::invalid_param(
                    "max_tokens",
                    format!(
                        "This model's maximum context length is {limit} tokens. However, you \
                         requested {} tokens ({prompt_len} in the prompt, {m} in the completion). \
                         Please reduce the length of the prompt or completion.",
                        prompt_len + m
                    ),
                )
                .with_code("context_length_exceeded"))
            }
            Some(m) => m,
            None => default_max_tokens.map_or(room, |d| d.min(room)),
        };
        let mut stop_token_ids = opts.stop_token_ids.clone();
        if !opts.ignore_eos {
            for &id in &self.eos_ids {
                if !stop_token_ids.contains(&id) {
                    stop_token_ids.push(id);
                }
            }
        }
        let req = GenerationRequest {
            request_id,
            prompt_ids,
            max_tokens,
            sampling: opts.sampling.clone(),
            stop_token_ids: stop_token_ids.clone(),
            ignore_eos: opts.ignore_eos,
            images,
            logprobs: opts.logprobs,
        };
        if self.log_requests {
            let prompt = self
                .tokenizer
                .decode(&req.prompt_ids, false)
                .unwrap_or_else(|e| format!("<undecodable: {e}>"));
            tracing::info!(request_id = %req.request_id, prompt_tokens = prompt_len, max_tokens, sampling = ?req.sampling, prompt = %prompt, "request");
        } else {
            tracing::debug!(request_id = %req.request_id, prompt_tokens = prompt_len, max_tokens, "request");
        }
        let rx = self.backend.submit(req)?;
        self.metrics
            .prompt_tokens
            .fetch_add(prompt_len as u64, Ordering::Relaxed);
        self.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Generation {
            rx: Some(rx),
            text: OutputText::new(&self.tokenizer, opts.stops.clone()),
            tokens_text: opts.logprobs.map(|_| self.tokenizer.clone()),
            pending_logprobs: None,
            stop_token_ids,
            prompt_tokens: prompt_len,
            completion_tokens: 0,
            cached_tokens: 0,
            done: false,
            arrived,
            first_token: None,
            last_token: None,
            metrics: self.metrics.clone(),
        })
    }
}

/// What one backend event amounts to for the client.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Delta {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Set on the last delta: `"stop"`, `"length"` or `"abort"`.
    pub finish: Option<&'static str>,
    /// Per token of `token_ids`, its log-probabilities, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

/// One token's log-probability and its most likely alternatives, with their ids and texts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TokenLogprob {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(u32, String, f32)>,
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Cancelled => "abort",
    }
}

/// One admitted request's output. Dropping it (finished, failed, or the client left) drops the
/// backend receiver, which cancels the request, and records its metrics.
pub(crate) struct Generation {
    rx: Option<mpsc::Receiver<TokenEvent>>,
    text: OutputText,
    /// The tokenizer that spells tokens for their log-probabilities, when the request asked.
    tokens_text: Option<Tokenizer>,
    /// The log-probabilities of the token the backend sends next.
    pending_logprobs: Option<TokenLogprobs>,
    /// Ids that end generation; their text is never shown.
    stop_token_ids: Vec<u32>,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    done: bool,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    metrics: Arc<Metrics>,
}

impl Generation {
    /// The first delta, awaited before a response is sent so that failures before any output
    /// still come back as the call's status.
    pub async fn first(&mut self) -> Result<Delta, ApiError> {
        self.next()
            .await
            .unwrap_or_else(|| Err(ApiError::internal("generation produced nothing")))
    }

    /// The next delta, `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<Delta, ApiError>> {
        if self.done {
            return None;
        }
        loop {
            let event = match self.rx.as_mut() {
                Some(rx) => rx.recv().await,
                None => None,
            };
            match event {
                Some(TokenEvent::Prefilled { cached_tokens }) => self.cached_tokens = cached_tokens,
                Some(TokenEvent::Logprobs(lp)) => self.pending_logprobs = Some(lp),
                Some(TokenEvent::Token(id)) => return Some(self.on_token(id)),
                Some(TokenEvent::Finished { reason, usage }) => {
                    self.cached_tokens = usage.cached_tokens;
                    // Image placeholders widen the prompt in the backend: its count is the one.
                    if usage.prompt_tokens > 0 {
                        self.prompt_tokens = usage.prompt_tokens;
                    }
                    let TextDelta { text, stopped } = self.text.finish();
                    let reason = if stopped { FinishReason::Stop } else { reason };
                    self.end();
                    return Some(Ok(Delta {
                        text,
                        finish: Some(finish_name(reason)),
                        ..Delta::default()
                    }));
                }
                Some(TokenEvent::Failed(e)) => {
                    self.end();
                    return Some(Err(e.into()));
                }
                None => {
                    self.end();
                    return Some(Err(ApiError::internal(
                        "the backend ended the request without finishing it",
                    )));
                }
            }
        }
    }

    fn on_token(&mut self, id: u32) -> Result<Delta, ApiError> {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.metrics.ttft.observe(now - self.arrived);
        }
        self.last_token = Some(now);
        self.completion_tokens += 1;
        let logprobs = self.spelled_logprobs(id);
        if self.stop_token_ids.contains(&id) {
            return Ok(Delta {
                token_ids: vec![id],
                logprobs,
                ..Delta::default()
            });
        }
        let d = self.text.push(id).map_err(|e| {
            self.end();
            ApiError::internal(format!("cannot detokenize the backend's output: {e}"))
        })?;
        let finish = d.stopped.then(|| {
            // A stop string ends the request here: cancel the backend.
            self.end();
            finish_name(FinishReason::Stop)
        });
        Ok(Delta {
            text: d.text,
            token_ids: vec![id],
            finish,
            logprobs,
        })
    }

    /// Token `id`'s log-probabilities with the tokens spelled out, when the request asked (a
    /// backend that sent none for it gives none).
    fn spelled_logprobs(&mut self, id: u32) -> Vec<TokenLogprob> {
        let (Some(tok), Some(lp)) = (&self.tokens_text, self.pending_logprobs.take()) else {
            return Vec::new();
        };
        let spell = |t: u32| tok.decode(&[t], false).unwrap_or_default();
        vec![TokenLogprob {
            id,
            token: spell(id),
            logprob: lp.logprob,
            top: lp.top.iter().map(|&(t, l)| (t, spell(t), l)).collect(),
        }]
    }

    /// Stop listening; dropping the receiver cancels the backend's work if it is still going.
    fn end(&mut self) {
        self.done = true;
        self.rx = None;
    }

    pub fn usage(&self) -> UsageBody {
        Self::usage_of(std::slice::from_ref(self))
    }

    /// The usage of one request's choices: the prompt counted once (with the first choice's
    /// cached tokens), the completions of all.
    pub fn usage_of(choices: &[Generation]) -> UsageBody {
        let first = choices.first();
        UsageBody::new(
            first.map_or(0, |g| g.prompt_tokens),
            choices.iter().map(|g| g.completion_tokens).sum(),
            first.map_or(0, |g| g.cached_tokens),
        )
    }

    /// Run to the end: the whole text, generated ids (with their log-probabilities) and the
    /// finish reason, as one delta.
    pub async fn collect(&mut self) -> Result<Delta, ApiError> {
        let mut all = Delta::default();
        while let Some(d) = self.next().await {
            let d = d?;
            all.text.push_str(&d.text);
            all.token_ids.extend(d.token_ids);
            all.logprobs.extend(d.logprobs);
            if d.finish.is_some() {
                all.finish = d.finish;
                return Ok(all);
            }
        }
        Err(ApiError::internal(
            "generation ended without a finish reason",
        ))
    }
}

/// Every choice run to its end, concurrently: each one's whole text and ids, with its finish
/// reason, in the order of the choices.
pub(crate) async fn collect_all(choices: &mut [Generation]) -> Result<Vec<Delta>, ApiError> {
    futures_util::future::try_join_all(choices.iter_mut().map(Generation::collect)).await
}

impl Drop for Generation {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.in_flight.fetch_sub(1, Ordering::Relaxed);
        m.generation_tokens
            .fetch_add(self.completion_tokens as u64, Ordering::Relaxed);
        m.cached_tokens
            .fetch_add(self.cached_tokens as u64, Ordering::Relaxed);
        if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
            m.e2e.observe(last - self.arrived);
            if self.completion_tokens > 1 {
                m.tpot
                    .observe((last - first) / (self.completion_tokens as u32 - 1));
            }
        }
    }
}
