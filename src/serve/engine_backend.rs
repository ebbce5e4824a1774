//! The in-process engine behind the HTTP front's `GenerationBackend` seam. Images are encoded
//! here, on the blocking pool, with the model's vision tower; their placeholders are widened to
//! the images' rows before the request reaches the engine (what the encoder worker and the
//! router do in a cluster).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tessera_engine::serving::{
    EngineEvent, EngineHandle, EngineRequest, EventSink, FinishReason as EngineFinish,
};
use tessera_engine::vision::{expand_placeholders, PlacedImage, VisionModel};
use tessera_engine::SamplingParams;
use tessera_router::{
    BackendError, FinishReason, GenerationBackend, GenerationRequest, ImageInput, Sampling,
    TokenEvent, TokenLogprobs, Usage,
};
use tokio::sync::mpsc;

pub struct EngineBackend {
    engine: Arc<EngineHandle>,
    model_id: String,
    max_model_len: usize,
    max_waiting: usize,
    seeds: AtomicU64,
    vision: Option<Arc<VisionModel>>,
}

impl EngineBackend {
    pub fn new(
        engine: EngineHandle,
        model_id: String,
        max_model_len: usize,
        max_waiting: usize,
    ) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        EngineBackend {
            engine: Arc::new(engine),
            model_id,
            max_model_len,
            max_waiting,
            seeds: AtomicU64::new(t),
            vision: None,
        }
    }

    /// Takes images with `vision` (the model's vision tower).
    pub fn with_vision(mut self, vision: VisionModel) -> Self {
        self.vision = Some(Arc::new(vision));
        self
    }
}

/// Encodes `images` and widens their placeholders in `prompt`; returns the prompt, the placed
/// images and `max_tokens` cut to the context left.
fn place_images(
    vision: &VisionModel,
    prompt: &[u32],
    images: &[ImageInput],
    max_tokens: usize,
    max_model_len: usize,
) -> Result<(Vec<u32>, Vec<PlacedImage>, usize), BackendError> {
    let mut embeddings = Vec::with_capacity(images.len());
    for (i, image) in images.iter().enumerate() {
        let e = vision
            .encode_image(&image.data)
            .map_err(|e| BackendError::InvalidRequest(format!("image {i}: {e}")))?;
        embeddings.push(Arc::new(e));
    }
    let rows: Vec<usize> = embeddings.iter().map(|e| e.n_tokens).collect();
    let (prompt, positions) = expand_placeholders(prompt, vision.placeholder_token_id(), &rows)
        .map_err(|e| BackendError::InvalidRequest(e.to_string()))?;
    let room = max_model_len.saturating_sub(prompt.len());
    if room == 0 {
        return Err(BackendError::PromptTooLong {
            prompt_tokens: prompt.len(),
            limit: max_model_len,
        });
    }
    let placed = positions
        .into_iter()
        .zip(embeddings)
        .map(|(position, embedding)| PlacedImage {
            position,
            embedding,
        })
        .collect();
    Ok((prompt, placed, max_tokens.min(room)))
}

/// The engine's sampling parameters for the front's, with the seed chosen for this request.
fn engine_sampling(s: &Sampling, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        seed,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s.logit_bias.clone(),
    }
}

/// Forwards engine events to the HTTP request's channel; a closed channel is a cancellation.
struct ChannelSink {
    tx: mpsc::Sender<TokenEvent>,
}

impl EventSink for ChannelSink {
    fn send(&mut self, event: EngineEvent) -> bool {
        let ev = match event {
            EngineEvent::Prefilled { cached_tokens } => TokenEvent::Prefilled { cached_tokens },
            EngineEvent::Token(t) => TokenEvent::Token(t),
            EngineEvent::Logprobs(lp) => TokenEvent::Logprobs(TokenLogprobs {
                token: lp.token,
                logprob: lp.logprob,
                top: lp.top,
            }),
            EngineEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => TokenEvent::Finished {
                reason: match reason {
                    EngineFinish::Length => FinishReason::Length,
                    EngineFinish::Stop => FinishReason::Stop,
                },
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                },
            },
            EngineEvent::Failed(m) if m.contains("does not fit") => {
                TokenEvent::Failed(BackendError::Overloaded(m))
            }
            EngineEvent::Failed(m) => TokenEvent::Failed(BackendError::InvalidRequest(m)),
            // This backend never asks for prefill-only requests.
            EngineEvent::Handoff(_) => {
                TokenEvent::Failed(BackendError::Internal("unexpected handoff".into()))
            }
        };
        // The channel holds every event a request can produce, so this never waits.
        self.tx.try_send(ev).is_ok()
    }

    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}

impl GenerationBackend for EngineBackend {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, BackendError> {
        let stats = self.engine.stats();
        if stats.waiting >= self.max_waiting {
            return Err(BackendError::Overloaded(format!(
                "{} requests are already waiting",
                stats.waiting
            )));
        }
        // Room for every event: a token each (two with log-probabilities), and three more.
        let per_token = if req.logprobs.is_some() { 2 } else { 1 };
        let (tx, rx) = mpsc::channel(per_token * req.max_tokens + 4);
        let seed = req
            .sampling
            .seed
            .unwrap_or_else(|| self.seeds.fetch_add(0x9E37_79B9, Ordering::Relaxed));
        if !req.images.is_empty() {
            let Some(vision) = self.vision.clone() else {
                return Err(BackendError::InvalidRequest(format!(
                    "the model `{}` takes no images",
                    self.model_id
                )));
            };
            let (engine, max_model_len) = (self.engine.clone(), self.max_model_len);
            // Encoding takes a while: off the async threads, and the request is answered
            // through the channel like any other.
            tokio::task::spawn_blocking(move || {
                let placed = place_images(
                    &vision,
                    &req.prompt_ids,
                    &req.images,
                    req.max_tokens,
                    max_model_len,
                );
                let (prompt, images, max_new_tokens) = match placed {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.try_send(TokenEvent::Failed(e));
                        return;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let engine_req = EngineRequest {
                    prompt,
                    max_new_tokens,
                    sampling: engine_sampling(&req.sampling, seed),
                    stop_ids: req.stop_token_ids,
                    cache_salt: None,
                    prefill_only: false,
                    resumed_tokens: 0,
                    images,
                    logprobs: req.logprobs.map(|k| k as usize),
                };
                let fail = tx.clone();
                if let Err(e) = engine.submit(engine_req, Box::new(ChannelSink { tx })) {
                    let _ =
                        fail.try_send(TokenEvent::Failed(BackendError::Unavailable(e.to_string())));
                }
            });
            return Ok(rx);
        }
        let engine_req = EngineRequest {
            prompt: req.prompt_ids,
            max_new_tokens: req.max_tokens,
            sampling: engine_sampling(&req.sampling, seed),
            stop_ids: req.stop_token_ids,
            cache_salt: None,
            prefill_only: false,
            resumed_tokens: 0,
            images: Vec::new(),
            logprobs: req.logprobs.map(|k| k as usize),
        };
        self.engine
            .submit(engine_req, Box::new(ChannelSink { tx }))
            .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        Ok(rx)
    }

    fn metrics_text(&self) -> String {
        let s = self.engine.stats();
        let mut out = String::new();
        let mut line = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in samples {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        line(
            "tessera_requests_running",
            "gauge",
            "Requests in the running batch.",
            vec![(String::new(), s.running as f64)],
        );
        line(
            "tessera_requests_waiting",
            "gauge",
            "Requests queued for admission.",
            vec![(String::new(), s.waiting as f64)],
        );
        line(
            "tessera_preemptions_total",
            "counter",
            "Requests preempted for pages (recomputed later).",
            vec![(String::new(), s.preemptions as f64)],
        );
        line(
            "tessera_prefix_cache_lookups_total",
            "counter",
            "Prefix-cache lookups.",
            vec![(String::new(), s.prefix_lookups as f64)],
        );
        line(
            "tessera_prefix_cache_hits_total",
            "counter",
            "Prefix-cache lookups that hit.",
            vec![(String::new(), s.prefix_hits as f64)],
        );
        line(
            "tessera_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            vec![(String::new(), s.prefix_hit_tokens as f64)],
        );
        line(
            "tessera_kv_pages_used",
            "gauge",
            "Live pages in the flat KV pool, by cache group.",
            s.pool
                .iter()
                .map(|(g, used, _)| (format!("{{group=\"{g}\"}}"), *used as f64))
                .collect(),
        );
        line(
            "tessera_kv_pages_total",
            "gauge",
            "Pages the flat KV pool could hold, by cache group (groups share parents).",
            s.pool
                .iter()
                .map(|(g, _, total)| (format!("{{group=\"{g}\"}}"), *total as f64))
                .collect(),
        );
        out
    }
}
