//! Kimi K3 through the serving path: the scheduler over the flat page pool (batching, chunked
//! prefill, prefix cache) and prefill → decode hand-over must give the tokens of one sequence run
//! alone, as for Kimi Linear. AttnRes adds no state, so the pool holds exactly what it holds for
//! Kimi Linear (MLA latent pages and KDA snapshots).

use std::path::{Path, PathBuf};

use tessera_engine::generate::{generate, GenerateRequest};
use tessera_engine::reference::{PromptRef, Reference};
use tessera_engine::serving::handoff::{copy_pages, transfer_pairs};
use tessera_engine::serving::{EngineEvent, EngineRequest, Handoff, Scheduler, SchedulerConfig};
use tessera_engine::{Model, SamplingParams};

use crate::serving_support::{drain, sink, tokens, Events};

const FIXTURES: [&str; 2] = ["k3_tiny", "k3_tiny_mxfp4"];

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn prompts(name: &str) -> Vec<PromptRef> {
    Reference::load(&dir(name).join("k3_reference.json"))
        .unwrap()
        .prompts
}

fn model(name: &str) -> Model {
    let mut m = Model::load(&dir(name)).unwrap();
    m.set_batch_invariant(true);
    m
}

fn cfg(kv: usize, cache: bool) -> SchedulerConfig {
    SchedulerConfig {
        page_tokens: 16,
        snapshot_interval: 0,
        kv_memory_bytes: kv,
        max_batch_tokens: 48,
        max_running: 8,
        prefix_cache: cache,
    }
}

fn req(prompt: &[u32], max_new: usize, prefill_only: bool) -> EngineRequest {
    EngineRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        cache_salt: None,
        prefill_only,
        resumed_tokens: 0,
        images: Vec::new(),
        logprobs: None,
    }
}

fn alone(m: &Model, prompt: &[u32], max_new: usize) -> Vec<u32> {
    let r = GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        prefill_chunk: None,
    };
    generate(m, &r).unwrap()
}

#[test]
fn k3_batched_and_cached_runs_equal_single_runs() {
    for name in FIXTURES {
        let m = model(name);
        let refs = prompts(name);
        // The longest prompt extended: it shares that prompt's pages through the prefix cache.
        let long = refs.iter().max_by_key(|p| p.prompt_ids.len()).unwrap();
        let mut extended = long.prompt_ids.clone();
        extended.extend(&long.greedy_ids[..5]);
        let first: Vec<(Vec<u32>, usize)> = refs
            .iter()
            .map(|p| (p.prompt_ids.clone(), p.greedy_ids.len()))
            .collect();
        // The second wave repeats every prompt and extends the longest: with the cache on, these
        // resume from pages and KDA snapshots the first wave published.
        let mut second = first.clone();
        second.push((extended, 6));
        for cache in [true, false] {
            let mut s = Scheduler::new(&m, cfg(64 << 20, cache)).unwrap();
            for (wave, work) in [&first, &second].into_iter().enumerate() {
                let outs: Vec<Events> = work
                    .iter()
                    .map(|(prompt, n)| {
                        let ev = Events::default();
                        s.submit(req(prompt, *n, false), Box::new(sink(&ev)));
                        ev
                    })
                    .collect();
                drain(&mut s, &m);
                for ((prompt, n), ev) in work.iter().zip(&outs) {
                    assert_eq!(
                        tokens(ev),
                        alone(&m, prompt, *n),
                        "{name} cache={cache} wave {wave}: prompt of {} tokens",
                        prompt.len()
                    );
                }
            }
            let hits = s.stats().prefix_hit_tokens;
            assert_eq!(
                hits > 0,
                cache,
                "{name} cache={cache}: {hits} prefix-hit tokens"
            );
            s.clear_prefix_cache().unwrap();
            assert_eq!(s.live_pages(), 0, "{name}: pages leaked");
        }
    }
}

#[test]
fn k3_prefill_to_decode_equals_single_process() {
    for name in FIXTURES {
        let m = model(name);
        // Pools of different sizes: page offsets differ, the page contents must not.
        let mut p = Scheduler::new(&m, cfg(8 << 20, true)).unwrap();
        let mut d = Scheduler::new(&m, cfg(24 << 20, true)).unwrap();
        for pr in prompts(name) {
            let n = pr.greedy_ids.len();
            let pev = Events::default();
            p.submit(req(&pr.prompt_ids, n, true), Box::new(sink(&pev)));
            drain(&mut p, &m);
            let h: Handoff = pev
                .lock()
                .unwrap()
                .iter()
                .find_map(|e| match e {
                    EngineEvent::Handoff(h) => Some(h.clone()),
                    _ => None,
                })
                .expect("prefill hands over");
            let r = d.reserve(pr.prompt_ids.len()).unwrap();
            let pairs = transfer_pairs(&h, &r).unwrap();
            copy_pages(p.pool(), d.pool_mut(), &pairs).unwrap();
            p.release_handoff(h.id).unwrap();
            let dev = Events::default();
            d.submit_resumed(
                r.id,
                req(&pr.prompt_ids, n, false),
                h.first_token,
                h.cached_tokens,
                Box::new(sink(&dev)),
            )
            .unwrap();
            drain(&mut d, &m);
            let mut got = vec![h.first_token];
            got.extend(tokens(&dev));
            assert_eq!(got, alone(&m, &pr.prompt_ids, n), "{name}/{}", pr.name);
        }
        p.clear_prefix_cache().unwrap();
        d.clear_prefix_cache().unwrap();
        assert_eq!((p.live_pages(), d.live_pages()), (0, 0), "pages leaked");
    }
}
