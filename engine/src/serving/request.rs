//! What goes into and comes out of the scheduler: its configuration, a request, the events a
//! request produces, the handoff and reservation of a disaggregated request, and the statistics.

use crate::kv::PageId;
use crate::sampler::SamplingParams;
use crate::vision::PlacedImage;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Tokens per KV page: the grain of prefix matching, snapshots and transfer.
    pub page_tokens: usize,
    /// Publish a KDA snapshot every this many tokens (a multiple of `page_tokens`); 0 publishes
    /// only at prefill chunk ends and at the prompt's last full page.
    pub snapshot_interval: usize,
    /// Bytes of the page pool.
    pub kv_memory_bytes: usize,
    /// Tokens one step may process (decode tokens + prefill chunk tokens).
    pub max_batch_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    pub prefix_cache: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            page_tokens: 64,
            snapshot_interval: 0,
            kv_memory_bytes: 256 << 20,
            max_batch_tokens: 512,
            max_running: 64,
            prefix_cache: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after one of these (included in the output).
    pub stop_ids: Vec<u32>,
    /// Mixed into prefix-cache keys (e.g. a hash of the request's images).
    pub cache_salt: Option<Vec<u8>>,
    /// Stop after the prompt and the first token, and hand the state over
    /// ([`EngineEvent::Handoff`]) instead of decoding: what a prefill worker does.
    pub prefill_only: bool,
    /// Trailing prompt tokens that an earlier attempt of this request generated (a request
    /// migrated after a worker failure): sampling continues the seeded random stream as though
    /// it had drawn those tokens itself.
    pub resumed_tokens: usize,
    /// Images whose embeddings replace the embeddings of their placeholder tokens in the prompt
    /// (positions index the expanded prompt). Each image's content hash enters the prefix-cache
    /// hash of the page holding its first token and so of every later page: the same text with
    /// another image shares only the pages before that one. A worker that holds this request's
    /// pages must be given the same images (or at least their hashes and positions, see
    /// [`vision::page_marks`]) for its cache keys to match.
    pub images: Vec<PlacedImage>,
    /// Report the log-probability of every generated token and of this many most likely tokens
    /// at each step ([`EngineEvent::Logprobs`]); `None` reports none. Such a request's steps
    /// are sampled on the host, where the logits are.
    pub logprobs: Option<usize>,
}

/// The most alternatives [`EngineRequest::logprobs`] may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Log-probabilities of one sampled token under the model's own distribution (the softmax of
/// its logits, before temperature, penalties or biases): the token's, and the most likely
/// tokens' in descending order (ties by lower id).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl EngineRequest {
    /// A plain request: `prompt`, up to `max_new_tokens` greedy tokens, no stop tokens, no images.
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        EngineRequest {
            prompt,
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            cache_salt: None,
            prefill_only: false,
            resumed_tokens: 0,
            images: Vec::new(),
            logprobs: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Stop,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// The prompt has been processed (sent once, before the first token).
    Prefilled {
        cached_tokens: usize,
    },
    Token(u32),
    /// The log-probabilities of the token in the [`EngineEvent::Token`] that follows, for a
    /// request that asks ([`EngineRequest::logprobs`]).
    Logprobs(TokenLogprobs),
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Failed(String),
    /// A prefill-only request finished its prompt: its pages are held (see
    /// [`Scheduler::release_handoff`]) until the state has been copied to a decode worker.
    Handoff(Handoff),
}

/// The state a prefill worker hands to decode: the MLA pages covering the prompt and, per KDA
/// group, the page holding the state at the prompt's end.
#[derive(Clone, Debug, PartialEq)]
pub struct Handoff {
    pub id: u64,
    pub prompt_len: usize,
    pub first_token: u32,
    /// The first token's log-probabilities, for a request that asks for them.
    pub first_token_logprobs: Option<TokenLogprobs>,
    pub cached_tokens: usize,
    pub mla_pages: Vec<PageId>,
    pub kda_pages: Vec<PageId>,
}

/// Destination pages a decode worker reserved for an incoming request.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    pub id: u64,
    pub prompt_len: usize,
    pub mla_pages: Vec<PageId>,
    pub kda_pages: Vec<PageId>,
}

/// Where a request's events go.
pub trait EventSink: Send {
    /// Delivers an event; `false` means nobody listens any more (the request is then cancelled
    /// and its pages freed).
    fn send(&mut self, event: EngineEvent) -> bool;
    /// Checked before every step, so a request whose client left is dropped even while it is
    /// waiting or in the middle of a long prefill.
    fn is_cancelled(&self) -> bool {
        false
    }
}

impl<F: FnMut(EngineEvent) -> bool + Send> EventSink for F {
    fn send(&mut self, event: EngineEvent) -> bool {
        self(event)
    }
}

#[derive(Clone, Debug, Default)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub preemptions: u64,
    pub steps: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_lookups: u64,
    pub prefix_hits: u64,
    /// Prompt tokens still to be prefilled: whole prompts of waiting requests, the rest of
    /// those whose prefill is under way.
    pub queued_prompt_tokens: usize,
    /// Per group: (name, live pages, total pages).
    pub pool: Vec<(String, usize, usize)>,
}
