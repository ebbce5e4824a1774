//! The scheduler over the flat page pool: batched, chunked, cached, preempted and cancelled runs
//! must give bitwise the same tokens as one sequence generated alone, and leak no page.

use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use tessera_engine::generate::{generate, GenerateRequest};
use tessera_engine::serving::{
    EngineEvent, EngineRequest, EventSink, FinishReason, Scheduler, SchedulerConfig,
};
use tessera_engine::{Model, SamplingParams};

use crate::common::*;

fn model(name: &str) -> Model {
    let mut m = Model::load(&fixtures_dir().join(name)).unwrap();
    m.set_batch_invariant(true);
    m
}

#[derive(Default)]
struct Collected {
    tokens: Vec<u32>,
    finished: Option<EngineEvent>,
    failed: Option<String>,
}

struct Collector {
    out: Arc<Mutex<Collected>>,
    cancel_after: Option<usize>,
}

impl EventSink for Collector {
    fn send(&mut self, e: EngineEvent) -> bool {
        let mut o = self.out.lock().unwrap();
        match e {
            EngineEvent::Token(t) => o.tokens.push(t),
            EngineEvent::Prefilled { .. } | EngineEvent::Handoff(_) | EngineEvent::Logprobs(_) => {}
            EngineEvent::Failed(m) => o.failed = Some(m),
            fin @ EngineEvent::Finished { .. } => o.finished = Some(fin),
        }
        true
    }
    fn is_cancelled(&self) -> bool {
        self.cancel_after
            .is_some_and(|n| self.out.lock().unwrap().tokens.len() >= n)
    }
}

fn submit(
    s: &mut Scheduler,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
    cancel_after: Option<usize>,
) -> Arc<Mutex<Collected>> {
    let out = Arc::new(Mutex::new(Collected::default()));
    let req = EngineRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling,
        stop_ids: vec![],
        cache_salt: None,
        prefill_only: false,
        resumed_tokens: 0,
        images: Vec::new(),
        logprobs: None,
    };
    s.submit(
        req,
        Box::new(Collector {
            out: out.clone(),
            cancel_after,
        }),
    );
    out
}

fn run_to_end(s: &mut Scheduler, m: &Model) {
    let mut guard = 0;
    while s.has_work() {
        s.step(m).unwrap();
        guard += 1;
        assert!(guard < 100_000, "scheduler does not make progress");
    }
}

fn alone(m: &Model, prompt: &[u32], max_new: usize, sampling: SamplingParams) -> Vec<u32> {
    generate(
        m,
        &GenerateRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: max_new,
            sampling,
            stop_ids: vec![],
            prefill_chunk: None,
        },
    )
    .unwrap()
}

fn cfg(
    page: usize,
    batch_tokens: usize,
    interval: usize,
    kv: usize,
    cache: bool,
) -> SchedulerConfig {
    SchedulerConfig {
        page_tokens: page,
        snapshot_interval: interval,
        kv_memory_bytes: kv,
        max_batch_tokens: batch_tokens,
        max_running: 16,
        prefix_cache: cache,
    }
}

#[test]
fn concurrent_requests_match_transformers_and_single_runs() {
    // Every layer mix: 3:1 KDA:MLA, grouped routing, KDA only (no MLA group), MLA only.
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let m = model(&name);
        let refs = reference(&dir).prompts;
        for cache in [true, false] {
            let mut s = Scheduler::new(&m, cfg(16, 64, 32, 64 << 20, cache)).unwrap();
            let outs: Vec<_> = refs
                .iter()
                .chain(refs.iter())
                .map(|p| {
                    submit(
                        &mut s,
                        &p.prompt_ids,
                        p.greedy_ids.len(),
                        SamplingParams::default(),
                        None,
                    )
                })
                .collect();
            run_to_end(&mut s, &m);
            for (p, o) in refs.iter().chain(refs.iter()).zip(outs) {
                let o = o.lock().unwrap();
                let what = format!("{name}/{} cache={cache}", p.name);
                assert_greedy_matches(&o.tokens, &p.greedy_ids, &p.greedy_margins, &what);
                assert_eq!(
                    o.tokens,
                    alone(
                        &m,
                        &p.prompt_ids,
                        p.greedy_ids.len(),
                        SamplingParams::default()
                    ),
                    "{what}: batched != alone"
                );
                assert!(matches!(
                    o.finished,
                    Some(EngineEvent::Finished {
                        reason: FinishReason::Length,
                        ..
                    })
                ));
            }
            s.clear_prefix_cache().unwrap();
            assert_eq!(s.live_pages(), 0, "{name}: pages leaked");
        }
    }
}

#[test]
fn resuming_from_a_cached_snapshot_matches_a_cold_run_and_never_mutates_it() {
    let m = model("kl_mixed");
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 300) as u32 + 3).collect();
    let cold = alone(&m, &prompt, 10, SamplingParams::default());
    let mut s = Scheduler::new(&m, cfg(16, 48, 32, 64 << 20, true)).unwrap();
    let first = submit(&mut s, &prompt, 10, SamplingParams::default(), None);
    run_to_end(&mut s, &m);
    assert_eq!(first.lock().unwrap().tokens, cold);
    let before = s.cached_page_fingerprints();
    assert!(!before.is_empty());
    // Same prompt, and one that shares 100 tokens then diverges: both resume from the cache.
    let mut other = prompt[..100].to_vec();
    other.extend((0..40).map(|i| (i * 11 % 200) as u32 + 5));
    let again = submit(&mut s, &prompt, 10, SamplingParams::default(), None);
    let branch = submit(&mut s, &other, 10, SamplingParams::default(), None);
    run_to_end(&mut s, &m);
    let a = again.lock().unwrap();
    assert_eq!(a.tokens, cold, "resumed run differs from the cold run");
    match a.finished {
        Some(EngineEvent::Finished { cached_tokens, .. }) => assert_eq!(cached_tokens, 144),
        ref other => panic!("{other:?}"),
    }
    let b = branch.lock().unwrap();
    assert_eq!(b.tokens, alone(&m, &other, 10, SamplingParams::default()));
    match b.finished {
        Some(EngineEvent::Finished { cached_tokens, .. }) => assert_eq!(cached_tokens, 96),
        ref other => panic!("{other:?}"),
    }
    let after = s.cached_page_fingerprints();
    for (page, fp) in &before {
        if let Some((_, fp2)) = after.iter().find(|(p, _)| p == page) {
            assert_eq!(
                fp, fp2,
                "cached page {page} was written after it was shared"
            );
        }
    }
}

#[test]
fn a_pool_too_small_for_a_prompt_fails_that_request_only() {
    let m = model("kl_mixed");
    let mut s = Scheduler::new(&m, cfg(4, 16, 0, 1 << 18, true)).unwrap();
    let big: Vec<u32> = (0..3000).map(|i| (i % 300) as u32 + 3).collect();
    let small = [5u32, 6, 7];
    let a = submit(&mut s, &big, 4, SamplingParams::default(), None);
    let b = submit(&mut s, &small, 4, SamplingParams::default(), None);
    run_to_end(&mut s, &m);
    assert!(
        a.lock()
            .unwrap()
            .failed
            .as_deref()
            .unwrap_or("")
            .contains("does not fit"),
        "{:?}",
        a.lock().unwrap().failed
    );
    assert_eq!(
        b.lock().unwrap().tokens,
        alone(&m, &small, 4, SamplingParams::default())
    );
    s.clear_prefix_cache().unwrap();
    assert_eq!(s.live_pages(), 0);
}

#[derive(Clone, Debug)]
struct Job {
    base: usize,
    len: usize,
    tail_seed: u32,
    max_new: usize,
    sampled: bool,
    cancel_after: Option<usize>,
    arrive_step: usize,
}

fn job() -> impl Strategy<Value = Job> {
    (
        0..3usize,
        1..90usize,
        0..1000u32,
        1..8usize,
        any::<bool>(),
        prop::option::weighted(0.2, 0..5usize),
        0..6usize,
    )
        .prop_map(
            |(base, len, tail_seed, max_new, sampled, cancel_after, arrive_step)| Job {
                base,
                len,
                tail_seed,
                max_new,
                sampled,
                cancel_after,
                arrive_step,
            },
        )
}

fn job_prompt(j: &Job) -> Vec<u32> {
    // Three shared bases, so requests share prefixes of various lengths.
    (0..j.len)
        .map(|i| {
            if i < j.len * 2 / 3 {
                ((i * 13 + j.base * 101) % 300) as u32 + 3
            } else {
                ((i as u32 * 7 + j.tail_seed) % 300) + 3
            }
        })
        .collect()
}

fn job_sampling(j: &Job) -> SamplingParams {
    if j.sampled {
        // Penalties and a bias too: they read the completion so far, which preemption and
        // recomputation must leave as it was.
        SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            top_k: 20,
            seed: j.tail_seed as u64,
            presence_penalty: 0.4,
            frequency_penalty: 0.3,
            logit_bias: vec![(j.tail_seed % 300 + 3, 1.5)],
        }
    } else {
        SamplingParams::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 50, ..ProptestConfig::default() })]

    /// Random interleavings of admission, chunked prefill, decode, prefix hits, eviction,
    /// preemption (small pools) and cancellation: every completed request equals its solo run,
    /// bit for bit, and no page outlives the requests and the cache.
    #[test]
    fn any_schedule_gives_solo_outputs_and_leaks_nothing(
        jobs in prop::collection::vec(job(), 1..7),
        page in prop::sample::select(vec![4usize, 8, 16]),
        chunk_pages in 1..4usize,
        interval_pages in 0..3usize,
        kv_kib in prop::sample::select(vec![160usize, 320, 4096]),
        cache in any::<bool>(),
    ) {
        let m = model("kl_mixed");
        let c = cfg(page, page * chunk_pages, page * interval_pages, kv_kib << 10, cache);
        let mut s = match Scheduler::new(&m, c) {
            Ok(s) => s,
            Err(_) => return Ok(()), // a pool too small for even one parent: rejected up front
        };
        let mut outs = vec![None; jobs.len()];
        let mut step = 0;
        loop {
            for (i, j) in jobs.iter().enumerate() {
                if j.arrive_step == step {
                    outs[i] = Some(submit(&mut s, &job_prompt(j), j.max_new, job_sampling(j), j.cancel_after));
                }
            }
            if step > 6 && !s.has_work() {
                break;
            }
            s.step(&m).unwrap();
            step += 1;
            prop_assert!(step < 20_000);
        }
        for (j, o) in jobs.iter().zip(outs) {
            let o = o.unwrap();
            let o = o.lock().unwrap();
            if o.failed.is_some() {
                continue; // did not fit in a tiny pool: reported, not hung
            }
            let solo = alone(&m, &job_prompt(j), j.max_new, job_sampling(j));
            match j.cancel_after {
                Some(n) if n < j.max_new => prop_assert_eq!(&o.tokens[..], &solo[..o.tokens.len()]),
                _ => prop_assert_eq!(&o.tokens, &solo),
            }
        }
        s.clear_prefix_cache().unwrap();
        prop_assert_eq!(s.live_pages(), 0);
    }
}

#[test]
fn preemption_recomputes_and_changes_nothing() {
    let m = model("kl_mixed");
    // A pool of a few parents: six concurrent requests cannot all hold their state at once.
    let mut s = Scheduler::new(&m, cfg(4, 16, 0, 200 << 10, false)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|k| {
            (0..30)
                .map(|i| ((i * 17 + k * 29) % 300) as u32 + 3)
                .collect()
        })
        .collect();
    let outs: Vec<_> = prompts
        .iter()
        .map(|p| submit(&mut s, p, 12, SamplingParams::default(), None))
        .collect();
    run_to_end(&mut s, &m);
    assert!(
        s.stats().preemptions > 0,
        "the pool was meant to force preemption"
    );
    for (p, o) in prompts.iter().zip(outs) {
        let o = o.lock().unwrap();
        assert!(o.failed.is_none(), "{:?}", o.failed);
        assert_eq!(o.tokens, alone(&m, p, 12, SamplingParams::default()));
    }
    assert_eq!(s.live_pages(), 0);
}

#[test]
fn prefix_hits_work_without_mla_and_without_kda_layers() {
    for name in ["kl_kda_only", "kl_mla_only"] {
        let m = model(name);
        let vocab = m.config.vocab_size as u32;
        let prompt: Vec<u32> = (0..90).map(|i| (i * 7 % (vocab - 10)) + 5).collect();
        let cold = alone(&m, &prompt, 6, SamplingParams::default());
        let mut s = Scheduler::new(&m, cfg(16, 32, 0, 64 << 20, true)).unwrap();
        let a = submit(&mut s, &prompt, 6, SamplingParams::default(), None);
        run_to_end(&mut s, &m);
        let b = submit(&mut s, &prompt, 6, SamplingParams::default(), None);
        run_to_end(&mut s, &m);
        assert_eq!(a.lock().unwrap().tokens, cold, "{name}");
        let b = b.lock().unwrap();
        assert_eq!(b.tokens, cold, "{name}: resumed run differs");
        match b.finished {
            // Chunks of 32 publish snapshots at 32 and 64 and the last full page (80).
            Some(EngineEvent::Finished { cached_tokens, .. }) => {
                assert_eq!(cached_tokens, 80, "{name}")
            }
            ref other => panic!("{other:?}"),
        }
    }
}

#[test]
fn stats_count_queued_prompt_tokens_and_the_parents_requests_hold() {
    let m = model("kl_mixed");
    // 16-token steps: a 40-token prompt takes three of them.
    let mut s = Scheduler::new(&m, cfg(16, 16, 0, 4 << 20, true)).unwrap();
    let prompt =
        |n: u32, k: u32| -> Vec<u32> { (0..n).map(|i| (i * 13 + k * 31) % 300 + 3).collect() };
    let (a, b) = (prompt(40, 0), prompt(24, 1));
    assert_eq!(s.stats().queued_prompt_tokens, 0);
    let outs = [
        submit(&mut s, &a, 4, SamplingParams::default(), None),
        submit(&mut s, &b, 4, SamplingParams::default(), None),
    ];
    assert_eq!(s.stats().queued_prompt_tokens, 64, "both prompts wait");
    assert_eq!(s.request_parents(), 0);
    s.step(&m).unwrap();
    assert_eq!(
        s.stats().queued_prompt_tokens,
        48,
        "16 tokens of the first were prefilled"
    );
    assert!(s.request_parents() >= 1);
    run_to_end(&mut s, &m);
    for o in &outs {
        assert!(o.lock().unwrap().failed.is_none());
    }
    // Idle: nothing queued and no request holds a page, but the cache keeps what they published.
    assert_eq!(s.stats().queued_prompt_tokens, 0);
    assert_eq!(s.request_parents(), 0);
    assert!(s.evictable_pages() > 0);
    assert_eq!(s.evictable_pages(), s.live_pages());
    // A cached prefix taken again by a request is no longer evictable, and pins its parents.
    let again = submit(&mut s, &a, 4, SamplingParams::default(), None);
    s.step(&m).unwrap();
    assert!(s.evictable_pages() < s.live_pages());
    assert!(s.request_parents() >= 1);
    run_to_end(&mut s, &m);
    assert!(again.lock().unwrap().failed.is_none());
    assert_eq!(s.request_parents(), 0);
    // A reservation for an incoming transfer holds pages like a request.
    let r = s.reserve(40).unwrap();
    assert!(s.request_parents() >= 1);
    assert!(s.cancel_reservation(r.id).unwrap());
    assert_eq!(s.request_parents(), 0);
    s.clear_prefix_cache().unwrap();
    assert_eq!((s.live_pages(), s.evictable_pages()), (0, 0));
}
