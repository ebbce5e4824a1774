//! Continuous batching over the flat page pool.
//!
//! Each `step` admits waiting requests (prefix-cache lookup first, then admission by free pages),
//! builds one batch of decode tokens plus prefill chunks under a token budget, reserves pages
//! (evicting cached pages, then preempting the youngest request, when the pool is full), runs the
//! model once, writes state back, publishes full MLA pages and KDA snapshots to the prefix cache,
//! samples, and retires finished or cancelled requests, releasing every page they held.
//!
//! Prefill chunks end on page boundaries, at the prompt's last full page and at every
//! `snapshot_interval` tokens, so that the state at each chunk end can be published as a snapshot:
//! a prefix hit needs the MLA pages *and* a KDA snapshot exactly at the hit boundary.

use std::collections::{HashMap, VecDeque};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv::{
    page_hashes_marked, BlockHash, KvError, KvLayout, PageMark, PagePool, PrefixIndex, StateDtypes,
};
use crate::model::{LogitsWanted, Model, Segment};
use crate::sampler::{token_logprobs, Sampler};
use crate::vision;

mod inspect;
mod transfers;

use super::paged::{LayerSlots, PagedSeq, Reserved, StepPages};
use super::request::{
    EngineEvent, EngineRequest, EventSink, FinishReason, Handoff, SchedulerConfig, TokenLogprobs,
    MAX_TOP_LOGPROBS,
};

struct Seq {
    id: u64,
    req: EngineRequest,
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    paged: PagedSeq,
    sampler: Sampler,
    cached_tokens: usize,
    /// MLA pages already offered to the prefix index.
    indexed_pages: usize,
    /// Its images' prefix-cache marks (see [`vision::page_marks`]).
    marks: Vec<PageMark>,
    /// False for a handed-off prompt with image placeholders but without the images: its state
    /// came as pages and cannot be computed again here.
    recomputable: bool,
    /// The log-probabilities of the token last sampled, for a request that asks, until they are
    /// sent (and, for a prefill-only request, handed off with it).
    logprobs: Option<TokenLogprobs>,
    sink: Box<dyn EventSink>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    /// Prefix-cache hashes of the full pages of `tokens` (a prefix of this sequence): its salt
    /// at the root, its images' marks in the pages that hold them.
    fn hashes(&self, page_tokens: usize, tokens: &[u32]) -> Vec<BlockHash> {
        page_hashes_marked(
            page_tokens,
            tokens,
            self.req.cache_salt.as_deref(),
            &self.marks,
        )
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    model_cfg: ModelConfig,
    pool: PagePool,
    index: PrefixIndex,
    slots: LayerSlots,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Prefill-only requests whose state awaits transfer.
    handoffs: HashMap<u64, PagedSeq>,
    /// Pages reserved for incoming transfers.
    reservations: HashMap<u64, PagedSeq>,
    next_id: u64,
    preemptions: u64,
    steps: u64,
}

impl Scheduler {
    pub fn new(model: &Model, cfg: SchedulerConfig) -> Result<Self> {
        if cfg.page_tokens == 0 {
            return Err(EngineError::InvalidInput(
                "page_tokens must be at least 1".into(),
            ));
        }
        if !cfg.snapshot_interval.is_multiple_of(cfg.page_tokens) {
            return Err(EngineError::InvalidInput(format!(
                "snapshot_interval {} must be a multiple of page_tokens {}",
                cfg.snapshot_interval, cfg.page_tokens
            )));
        }
        if cfg.max_batch_tokens < cfg.page_tokens {
            return Err(EngineError::InvalidInput(format!(
                "max_batch_tokens {} must be at least page_tokens {}",
                cfg.max_batch_tokens, cfg.page_tokens
            )));
        }
        let layout = KvLayout::plan(
            &model.config,
            cfg.page_tokens,
            cfg.kv_memory_bytes,
            StateDtypes::F32,
        )?;
        tracing::info!("kv layout: {}", layout.report());
        let slots = LayerSlots::new(&model.config, &layout);
        let index = PrefixIndex::new(&layout);
        // On a GPU the arena is device memory and steps read and write the pages in place.
        let arena = model.new_kv_arena(&layout)?;
        let pool = PagePool::with_arena(layout, arena)?;
        Ok(Scheduler {
            cfg,
            model_cfg: model.config.clone(),
            pool,
            index,
            slots,
            waiting: VecDeque::new(),
            running: Vec::new(),
            handoffs: HashMap::new(),
            reservations: HashMap::new(),
            next_id: 0,
            preemptions: 0,
            steps: 0,
        })
    }

    pub fn layout_report(&self) -> String {
        self.pool.layout().report()
    }

    /// Queues a request. Invalid requests are answered with `Failed` at once.
    pub fn submit(&mut self, req: EngineRequest, mut sink: Box<dyn EventSink>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let problem = if req.prompt.is_empty() {
            Some("the prompt has no tokens".to_string())
        } else if let Some(t) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.model_cfg.vocab_size)
        {
            Some(format!(
                "token id {t} is outside the vocabulary (size {})",
                self.model_cfg.vocab_size
            ))
        } else if req.max_new_tokens == 0 {
            Some("max_new_tokens must be at least 1".to_string())
        } else if req.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            Some(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities a token, asked for {}",
                req.logprobs.unwrap_or(0)
            ))
        } else if req.resumed_tokens >= req.prompt.len() {
            Some(format!(
                "{} resumed tokens leave no prompt of {} tokens",
                req.resumed_tokens,
                req.prompt.len()
            ))
        } else {
            self.check_images(&req).err()
        };
        let sampler = Sampler::new(req.sampling.clone()).map(|mut s| {
            s.skip(req.resumed_tokens);
            s
        });
        match (problem, sampler) {
            (Some(p), _) => {
                sink.send(EngineEvent::Failed(p));
            }
            (None, Err(e)) => {
                sink.send(EngineEvent::Failed(e.to_string()));
            }
            (None, Ok(sampler)) => self.waiting.push_back(Seq {
                id,
                tokens: req.prompt.clone(),
                marks: self.marks(id, &req),
                recomputable: true,
                req,
                paged: PagedSeq::new(&self.slots),
                sampler,
                cached_tokens: 0,
                indexed_pages: 0,
                logprobs: None,
                sink,
            }),
        }
        id
    }

    /// Prefix-cache marks of request `id`: its images'. Placeholder tokens without images (a
    /// decode worker given a handed-off image request's prompt alone) do not say which image
    /// their pages hold, so from the first one's page on the pages are keyed to this request
    /// alone: never reused, and never given to a request with or without images.
    fn marks(&self, id: u64, req: &EngineRequest) -> Vec<PageMark> {
        if !req.images.is_empty() {
            return vision::page_marks(&req.images);
        }
        let placeholder = self
            .model_cfg
            .vision
            .as_ref()
            .and_then(|v| v.placeholder_token_id);
        match placeholder.and_then(|p| req.prompt.iter().position(|&t| t == p)) {
            Some(position) => vec![PageMark {
                position,
                bytes: [b"tessera.unplaced-image".as_slice(), &id.to_le_bytes()].concat(),
            }],
            None => Vec::new(),
        }
    }

    /// Images must sit on placeholder tokens of the prompt and match the model's hidden size.
    fn check_images(&self, req: &EngineRequest) -> std::result::Result<(), String> {
        if req.images.is_empty() {
            return Ok(());
        }
        let placeholder = self
            .model_cfg
            .vision
            .as_ref()
            .and_then(|v| v.placeholder_token_id);
        vision::check_placed(
            &req.prompt,
            placeholder,
            self.model_cfg.hidden_size,
            &req.images,
        )
        .map_err(|e| e.to_string())
    }

    /// Runs one batch. Returns the number of tokens processed.
    pub fn step(&mut self, model: &Model) -> Result<usize> {
        self.drop_cancelled()?;
        self.admit()?;
        if self.running.is_empty() {
            return Ok(0);
        }
        // Each running request gets its next piece: one token when decoding, a chunk otherwise.
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, new length)
        let order: Vec<usize> = {
            // Decoding requests first: they cost one token each and keep latency low.
            let mut o: Vec<usize> = (0..self.running.len()).collect();
            o.sort_by_key(|&i| {
                (
                    self.running[i].tokens.len() - self.running[i].paged.len > 1,
                    i,
                )
            });
            o
        };
        for i in order {
            if budget == 0 {
                break;
            }
            let s = &self.running[i];
            let end = self.chunk_end(s, budget);
            if end > s.paged.len {
                budget -= end - s.paged.len;
                plan.push((i, end));
            }
        }
        // Reserve pages; when the pool is full, evict cached pages, then preempt.
        let mut reserved: Vec<Option<Reserved>> = (0..self.running.len()).map(|_| None).collect();
        let mut k = 0;
        while k < plan.len() {
            let (i, end) = plan[k];
            match self.running[i]
                .paged
                .reserve(&self.slots, &mut self.pool, end)
            {
                Ok(r) => {
                    reserved[i] = Some(r);
                    k += 1;
                }
                Err(KvError::OutOfPages(_)) => {
                    let need = self.running[i]
                        .paged
                        .pages_needed(&self.slots, &self.pool, end);
                    if self.index.evict(&mut self.pool, need.max(1))? > 0 {
                        continue;
                    }
                    // Preempt the youngest request not yet given pages this step; if every other
                    // one already has its pages, this request waits (preempted itself). Alone, it
                    // cannot fit at all.
                    let victim = (0..self.running.len()).rev().find(|&v| {
                        v != i
                            && reserved[v].is_none()
                            && self.running[v].paged.pages().next().is_some()
                    });
                    let out = match victim {
                        Some(v) => v,
                        None if self.running.len() > 1 => i,
                        None => {
                            let mut s = self.running.remove(i);
                            reserved.remove(i);
                            s.paged.release_all(&mut self.pool)?;
                            s.sink.send(EngineEvent::Failed(
                                "the request does not fit in the KV page pool (raise --kv-memory or shorten the prompt)".into(),
                            ));
                            plan.clear();
                            break;
                        }
                    };
                    self.preempt(out)?;
                    reserved.remove(out);
                    plan.retain(|&(j, _)| j != out);
                    for p in plan.iter_mut() {
                        if p.0 > out {
                            p.0 -= 1;
                        }
                    }
                    k = plan
                        .iter()
                        .position(|&(j, _)| reserved[j].is_none())
                        .unwrap_or(plan.len());
                }
                Err(e) => return Err(e.into()),
            }
        }
        if plan.is_empty() {
            return Ok(0);
        }
        // A device forward samples there too: each sequence whose last token runs this step
        // takes its draw now (only token ids come back); the host forward returns logits,
        // sampled below. So does a device forward whose step holds a sequence with penalties,
        // biases or log-probabilities: those need its completion so far or the logits
        // themselves, which the host has.
        let on_device = self.pool.arena().device().is_some();
        let sample_on_device = on_device
            && plan.iter().all(|&(i, _)| {
                let s = &self.running[i];
                !s.sampler.adjusts_logits() && s.req.logprobs.is_none()
            });
        let draws: Vec<_> = plan
            .iter()
            .map(|&(i, end)| {
                let s = &mut self.running[i];
                (sample_on_device && end == s.tokens.len()).then(|| s.sampler.draw())
            })
            .collect();
        // Image rows of each prefill chunk (an image may straddle chunks).
        let splices: Vec<_> = plan
            .iter()
            .map(|&(i, end)| {
                let s = &self.running[i];
                let end = end.min(s.req.prompt.len());
                if s.req.images.is_empty() || s.paged.len >= end {
                    Vec::new()
                } else {
                    vision::splices_in(&s.req.images, s.paged.len, end)
                }
            })
            .collect();
        let wanted: Vec<LogitsWanted> = plan
            .iter()
            .map(|&(i, end)| {
                if end == self.running[i].tokens.len() {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                }
            })
            .collect();
        // On a device arena the forward reads and writes the pages themselves; on the host it
        // runs on states gathered from the pool and scattered back.
        let mut states = Vec::new();
        let out: Vec<StepTokens> = if on_device {
            let mut pages = StepPages::new(&self.slots, &self.pool)?;
            for &(i, _) in &plan {
                let r = reserved[i].as_ref().expect("reserved above");
                pages.push(&self.slots, &self.pool, &self.running[i].paged, r)?;
            }
            let tokens: Vec<&[u32]> = plan
                .iter()
                .map(|&(i, end)| {
                    let s = &self.running[i];
                    &s.tokens[s.paged.len..end]
                })
                .collect();
            if sample_on_device {
                model
                    .forward_paged_sampled(
                        &tokens,
                        &wanted,
                        &splices,
                        pages.state(),
                        &**self.pool.arena(),
                        &draws,
                    )?
                    .into_iter()
                    .map(StepTokens::Sampled)
                    .collect()
            } else {
                model
                    .forward_paged(
                        &tokens,
                        &wanted,
                        &splices,
                        pages.state(),
                        &**self.pool.arena(),
                    )?
                    .into_iter()
                    .map(StepTokens::Logits)
                    .collect()
            }
        } else {
            for &(i, _) in &plan {
                states.push(self.running[i].paged.gather(
                    &self.slots,
                    &self.pool,
                    &self.model_cfg,
                )?);
            }
            let mut segs: Vec<Segment> = plan
                .iter()
                .zip(states.iter_mut())
                .zip(&wanted)
                .map(|((&(i, end), st), &logits)| {
                    let s = &self.running[i];
                    Segment {
                        tokens: &s.tokens[s.paged.len..end],
                        state: st,
                        logits,
                    }
                })
                .collect();
            model
                .forward_spliced(&mut segs, &splices)?
                .into_iter()
                .map(StepTokens::Logits)
                .collect()
        };
        let mut processed = 0;
        let mut sampled = Vec::with_capacity(plan.len());
        for (k, (&(i, end), got)) in plan.iter().zip(out).enumerate() {
            let r = reserved[i].take().expect("reserved above");
            let s = &mut self.running[i];
            processed += end - s.paged.len;
            let was_prefill = end <= s.req.prompt.len();
            let chunk_end = end;
            match states.get(k) {
                Some(st) => s.paged.scatter(&self.slots, &mut self.pool, st, r)?,
                None => s.paged.commit(&mut self.pool, r, end)?,
            }
            if self.cfg.prefix_cache {
                publish(
                    &mut self.index,
                    &mut self.pool,
                    &self.slots,
                    s,
                    &self.cfg,
                    was_prefill,
                    chunk_end,
                )?;
            }
            let next = match got {
                StepTokens::Sampled(t) => t,
                StepTokens::Logits(lg) if !lg.is_empty() => {
                    let completion = s.req.prompt.len() - s.req.resumed_tokens;
                    let next = s.sampler.sample_after(&lg, &s.tokens[completion..]);
                    s.logprobs = s.req.logprobs.map(|k| token_logprobs(&lg, next, k));
                    Some(next)
                }
                StepTokens::Logits(_) => None,
            };
            if let Some(next) = next {
                s.tokens.push(next);
                sampled.push(i);
            }
        }
        self.steps += 1;
        self.emit_and_retire(&sampled)?;
        Ok(processed)
    }

    /// Where the next piece of `s` ends, given `budget` tokens.
    fn chunk_end(&self, s: &Seq, budget: usize) -> usize {
        let (start, total) = (s.paged.len, s.tokens.len());
        let mut end = total.min(start + budget);
        if end < total {
            // Cut on a page boundary so the chunk end can be a snapshot (unless that would leave
            // nothing to do this step).
            let aligned = end / self.cfg.page_tokens * self.cfg.page_tokens;
            if aligned > start {
                end = aligned;
            }
        }
        let p = self.cfg.page_tokens;
        let prompt = s.req.prompt.len();
        let last_full = prompt / p * p;
        if start < last_full && end > last_full {
            end = last_full;
        }
        if let Some(k) = start.checked_div(self.cfg.snapshot_interval) {
            let next = (k + 1) * self.cfg.snapshot_interval;
            if end > next {
                end = next;
            }
        }
        end
    }

    fn admit(&mut self) -> Result<()> {
        while self.running.len() < self.cfg.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if s.paged.len == 0 && self.cfg.prefix_cache && s.tokens.len() > 1 {
                // Never hit the whole sequence: the last token must run to produce logits.
                let probe = &s.tokens[..s.tokens.len() - 1];
                let hashes = s.hashes(self.cfg.page_tokens, probe);
                let hit = self
                    .index
                    .lookup_hashed(&mut self.pool, probe.len(), &hashes)?;
                if hit.tokens > 0 {
                    s.paged.len = hit.tokens;
                    s.paged.mla_pages = hit.mla_pages;
                    s.paged.kda_pages = hit.snapshots;
                    s.indexed_pages = s.paged.mla_pages.len();
                    if s.generated() == 0 {
                        s.cached_tokens = hit.tokens;
                    }
                }
            }
            // Admission by free pages: the first piece must fit now, after evicting cached pages.
            // A request that cannot fit while others run waits for them; alone, it is admitted
            // and the step reports that it does not fit.
            let first_end = self.chunk_end(&s, self.cfg.max_batch_tokens);
            let fits = loop {
                match s.paged.reserve(&self.slots, &mut self.pool, first_end) {
                    Ok(r) => {
                        r.abandon(&mut self.pool);
                        break true;
                    }
                    Err(KvError::OutOfPages(_)) => {
                        let need = s
                            .paged
                            .pages_needed(&self.slots, &self.pool, first_end)
                            .max(1);
                        if self.index.evict(&mut self.pool, need)? == 0 {
                            break false;
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            if !fits && !self.running.is_empty() {
                s.paged.release_all(&mut self.pool)?;
                s.indexed_pages = 0;
                self.waiting.push_front(s);
                break;
            }
            self.running.push(s);
        }
        Ok(())
    }

    fn preempt(&mut self, idx: usize) -> Result<()> {
        let mut s = self.running.remove(idx);
        s.paged.release_all(&mut self.pool)?;
        if !s.recomputable {
            s.sink.send(EngineEvent::Failed(
                "preempted, and its prompt holds image placeholders whose images this worker \
                 was not given: it cannot be recomputed here"
                    .into(),
            ));
            return Ok(());
        }
        s.indexed_pages = 0;
        self.preemptions += 1;
        tracing::debug!(request = s.id, "preempted: pages released, will recompute");
        self.waiting.push_front(s);
        Ok(())
    }

    fn drop_cancelled(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sink.is_cancelled() {
                let mut s = self.running.remove(i);
                s.paged.release_all(&mut self.pool)?;
            } else {
                i += 1;
            }
        }
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for mut s in self.waiting.drain(..) {
            if s.sink.is_cancelled() {
                s.paged.release_all(&mut self.pool)?;
            } else {
                kept.push_back(s);
            }
        }
        self.waiting = kept;
        Ok(())
    }

    /// Sends new tokens, applies stop conditions and releases finished or cancelled requests.
    fn emit_and_retire(&mut self, sampled: &[usize]) -> Result<()> {
        let mut done: Vec<usize> = Vec::new();
        let mut handed: Vec<usize> = Vec::new();
        for &i in sampled {
            let s = &mut self.running[i];
            let tok = *s.tokens.last().expect("a token was sampled");
            if s.generated() == 1
                && !s.sink.send(EngineEvent::Prefilled {
                    cached_tokens: s.cached_tokens,
                })
            {
                done.push(i);
                continue;
            }
            if let Some(lp) = &s.logprobs {
                if !s.sink.send(EngineEvent::Logprobs(lp.clone())) {
                    done.push(i);
                    continue;
                }
            }
            if !s.sink.send(EngineEvent::Token(tok)) {
                done.push(i);
                continue;
            }
            if s.req.prefill_only {
                handed.push(i);
                continue;
            }
            let reason = if s.req.stop_ids.contains(&tok) {
                Some(FinishReason::Stop)
            } else if s.generated() >= s.req.max_new_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                s.sink.send(EngineEvent::Finished {
                    reason,
                    prompt_tokens: s.req.prompt.len(),
                    completion_tokens: s.generated(),
                    cached_tokens: s.cached_tokens,
                });
                done.push(i);
            }
        }
        let mut gone: Vec<(usize, bool)> = done
            .into_iter()
            .map(|i| (i, false))
            .chain(handed.into_iter().map(|i| (i, true)))
            .collect();
        gone.sort_unstable();
        for (i, handoff) in gone.into_iter().rev() {
            let mut s = self.running.remove(i);
            if handoff {
                let h = Handoff {
                    id: s.id,
                    prompt_len: s.req.prompt.len(),
                    first_token: *s.tokens.last().expect("sampled"),
                    first_token_logprobs: s.logprobs.take(),
                    cached_tokens: s.cached_tokens,
                    mla_pages: s.paged.mla_pages.clone(),
                    kda_pages: s.paged.kda_pages.clone(),
                };
                if s.sink.send(EngineEvent::Handoff(h)) {
                    self.handoffs.insert(s.id, std::mem::take(&mut s.paged));
                    continue;
                }
            }
            s.paged.release_all(&mut self.pool)?;
        }
        Ok(())
    }

    /// Cancels every request (used at shutdown).
    pub fn cancel_all(&mut self) -> Result<()> {
        for (_, mut seq) in self.handoffs.drain().chain(self.reservations.drain()) {
            seq.release_all(&mut self.pool)?;
        }
        for mut s in self.running.drain(..).chain(self.waiting.drain(..)) {
            s.paged.release_all(&mut self.pool)?;
            s.sink
                .send(EngineEvent::Failed("the engine is shutting down".into()));
        }
        Ok(())
    }
}

/// After a step: full MLA pages go into the prefix index; the KDA state is published as a
/// snapshot at prefill chunk ends on page boundaries and every `snapshot_interval` tokens.
fn publish(
    index: &mut PrefixIndex,
    pool: &mut PagePool,
    slots: &LayerSlots,
    s: &mut Seq,
    cfg: &SchedulerConfig,
    was_prefill: bool,
    end: usize,
) -> Result<()> {
    let p = cfg.page_tokens;
    let full = end / p;
    let on_boundary = end.is_multiple_of(p) && end > 0;
    let wanted = (was_prefill && on_boundary)
        || (cfg.snapshot_interval > 0 && end.is_multiple_of(cfg.snapshot_interval) && end > 0);
    let insert_mla = slots.mla_group.is_some() && full > s.indexed_pages;
    let snapshot = wanted && !slots.kda_groups.is_empty();
    if !insert_mla && !snapshot {
        return Ok(());
    }
    if snapshot && !on_boundary {
        return Err(KvError::Prefix(format!(
            "snapshot boundary {end} is not a multiple of the page size {p}"
        ))
        .into());
    }
    let hashes = s.hashes(p, &s.tokens[..full * p]);
    if insert_mla {
        index.insert_mla_hashed(pool, &hashes, &s.paged.mla_pages[..full])?;
        s.indexed_pages = full;
    }
    if snapshot {
        for (gi, &g) in slots.kda_groups.iter().enumerate() {
            index.publish_snapshot_hashed(pool, &hashes, g, s.paged.kda_pages[gi])?;
        }
    }
    Ok(())
}

/// One segment's result of a step: its logits (host forward), or its token where the device
/// sampled one.
enum StepTokens {
    Logits(Vec<f32>),
    Sampled(Option<u32>),
}
