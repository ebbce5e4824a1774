//! Prefill on one pool, decode on another: the handed-over state (MLA pages and the KDA
//! snapshot of every group) must give exactly the tokens of a single-process run — and leaving
//! out any one group's state must not.

use std::sync::{Arc, Mutex};

use tessera_engine::generate::{generate, GenerateRequest};
use tessera_engine::kv::PageId;
use tessera_engine::serving::handoff::{copy_pages, transfer_pairs};
use tessera_engine::serving::{EngineEvent, EngineRequest, Handoff, Scheduler, SchedulerConfig};
use tessera_engine::{Model, SamplingParams};

use crate::common::*;

fn model(name: &str) -> Model {
    let mut m = Model::load(&fixtures_dir().join(name)).unwrap();
    m.set_batch_invariant(true);
    m
}

fn cfg(kv: usize) -> SchedulerConfig {
    SchedulerConfig {
        page_tokens: 16,
        snapshot_interval: 0,
        kv_memory_bytes: kv,
        max_batch_tokens: 64,
        max_running: 8,
        prefix_cache: true,
    }
}

fn req(
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
    prefill_only: bool,
) -> EngineRequest {
    EngineRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling,
        stop_ids: vec![],
        cache_salt: None,
        prefill_only,
        resumed_tokens: 0,
        images: Vec::new(),
        logprobs: None,
    }
}

type Events = Arc<Mutex<Vec<EngineEvent>>>;

fn sink(ev: &Events) -> Box<dyn FnMut(EngineEvent) -> bool + Send> {
    let ev = ev.clone();
    Box::new(move |e| {
        ev.lock().unwrap().push(e);
        true
    })
}

fn drain(s: &mut Scheduler, m: &Model) {
    while s.has_work() {
        s.step(m).unwrap();
    }
}

/// Runs prefill on `p`, moves the pairs `keep` selects to `d`, decodes there; returns all tokens.
fn disaggregated(
    m: &Model,
    p: &mut Scheduler,
    d: &mut Scheduler,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
    keep: impl Fn(usize, &(PageId, PageId)) -> bool,
) -> Vec<u32> {
    migrated(m, p, d, prompt, max_new, sampling, keep, 0)
}

/// [`disaggregated`] for a request whose last `resumed` prompt tokens an earlier attempt
/// generated (the router re-prefills prompt + generated tokens after a decode failure).
#[allow(clippy::too_many_arguments)]
fn migrated(
    m: &Model,
    p: &mut Scheduler,
    d: &mut Scheduler,
    prompt: &[u32],
    max_new: usize,
    sampling: SamplingParams,
    keep: impl Fn(usize, &(PageId, PageId)) -> bool,
    resumed: usize,
) -> Vec<u32> {
    let resumed_req = |prefill_only| EngineRequest {
        resumed_tokens: resumed,
        ..req(prompt, max_new, sampling.clone(), prefill_only)
    };
    let pev: Events = Default::default();
    p.submit(resumed_req(true), Box::new(sink(&pev)));
    drain(p, m);
    let h: Handoff = pev
        .lock()
        .unwrap()
        .iter()
        .find_map(|e| {
            if let EngineEvent::Handoff(h) = e {
                Some(h.clone())
            } else {
                None
            }
        })
        .expect("prefill hands over");
    let r = d.reserve(prompt.len()).unwrap();
    let pairs: Vec<_> = transfer_pairs(&h, &r)
        .unwrap()
        .into_iter()
        .enumerate()
        .filter(|(i, pr)| keep(*i, pr))
        .map(|(_, pr)| pr)
        .collect();
    copy_pages(p.pool(), d.pool_mut(), &pairs).unwrap();
    p.release_handoff(h.id).unwrap();
    let dev: Events = Default::default();
    d.submit_resumed(
        r.id,
        resumed_req(false),
        h.first_token,
        h.cached_tokens,
        Box::new(sink(&dev)),
    )
    .unwrap();
    drain(d, m);
    let mut out = vec![h.first_token];
    out.extend(dev.lock().unwrap().iter().filter_map(|e| {
        if let EngineEvent::Token(t) = e {
            Some(*t)
        } else {
            None
        }
    }));
    out
}

fn solo(m: &Model, prompt: &[u32], max_new: usize, sampling: SamplingParams) -> Vec<u32> {
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

#[test]
fn prefill_to_decode_equals_single_process_and_the_reference() {
    for name in ["kl_mixed", "kl_grouped"] {
        let m = model(name);
        // Pools of different sizes: page offsets differ, the page contents must not.
        let mut p = Scheduler::new(&m, cfg(8 << 20)).unwrap();
        let mut d = Scheduler::new(&m, cfg(24 << 20)).unwrap();
        for pr in reference(&fixtures_dir().join(name)).prompts {
            let n = pr.greedy_ids.len();
            let got = disaggregated(
                &m,
                &mut p,
                &mut d,
                &pr.prompt_ids,
                n,
                SamplingParams::default(),
                |_, _| true,
            );
            assert_eq!(
                got,
                solo(&m, &pr.prompt_ids, n, SamplingParams::default()),
                "{name}/{}",
                pr.name
            );
            assert_greedy_matches(
                &got,
                &pr.greedy_ids,
                &pr.greedy_margins,
                &format!("{name}/{}", pr.name),
            );
            let sampled = SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                top_k: 0,
                seed: 7,
                frequency_penalty: 0.5,
                ..Default::default()
            };
            let got = disaggregated(
                &m,
                &mut p,
                &mut d,
                &pr.prompt_ids,
                n,
                sampled.clone(),
                |_, _| true,
            );
            assert_eq!(
                got,
                solo(&m, &pr.prompt_ids, n, sampled),
                "{name}/{} sampled",
                pr.name
            );
        }
        p.clear_prefix_cache().unwrap();
        d.clear_prefix_cache().unwrap();
        assert_eq!((p.live_pages(), d.live_pages()), (0, 0), "pages leaked");
    }
}

#[test]
fn withholding_any_one_page_of_the_state_changes_the_output() {
    let m = model("kl_mixed");
    let prompt: Vec<u32> = (0..70).map(|i| (i * 29 % 370) as u32 + 5).collect();
    let n = 30;
    let want = solo(&m, &prompt, n, SamplingParams::default());
    let mla_pages = prompt.len().div_ceil(16);
    let kda_groups = 3; // kl_mixed: 6 KDA layers over 2 MLA layers → 3 KDA groups
    for skip in 0..mla_pages + kda_groups {
        let mut p = Scheduler::new(&m, cfg(8 << 20)).unwrap();
        let mut d = Scheduler::new(&m, cfg(8 << 20)).unwrap();
        let got = disaggregated(
            &m,
            &mut p,
            &mut d,
            &prompt,
            n,
            SamplingParams::default(),
            |i, _| i != skip,
        );
        let what = if skip < mla_pages {
            format!("MLA page {skip}")
        } else {
            format!("KDA group {}", skip - mla_pages)
        };
        assert_ne!(
            got, want,
            "decode ignored the withheld {what}: the test cannot tell a missing state"
        );
    }
    // And with nothing withheld the same run is exact.
    let mut p = Scheduler::new(&m, cfg(8 << 20)).unwrap();
    let mut d = Scheduler::new(&m, cfg(8 << 20)).unwrap();
    assert_eq!(
        disaggregated(
            &m,
            &mut p,
            &mut d,
            &prompt,
            n,
            SamplingParams::default(),
            |_, _| true
        ),
        want
    );
}

#[test]
fn abandoned_reservations_and_handoffs_free_their_pages() {
    let m = model("kl_mixed");
    let mut p = Scheduler::new(&m, cfg(8 << 20)).unwrap();
    let mut d = Scheduler::new(&m, cfg(8 << 20)).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| i as u32 + 5).collect();
    let r = d.reserve(prompt.len()).unwrap();
    assert!(d.live_pages() > 0);
    assert!(d.cancel_reservation(r.id).unwrap());
    assert_eq!(d.live_pages(), 0);
    let ev: Events = Default::default();
    p.submit(
        req(&prompt, 4, SamplingParams::default(), true),
        Box::new(sink(&ev)),
    );
    drain(&mut p, &m);
    let id = ev
        .lock()
        .unwrap()
        .iter()
        .find_map(|e| {
            if let EngineEvent::Handoff(h) = e {
                Some(h.id)
            } else {
                None
            }
        })
        .unwrap();
    assert!(p.release_handoff(id).unwrap());
    p.clear_prefix_cache().unwrap();
    assert_eq!(p.live_pages(), 0);
}

/// A request migrated mid-stream (its generated tokens re-prefilled as prompt on other workers)
/// continues exactly where it stopped: same greedy tokens, and the same seeded random stream.
#[test]
fn migrated_request_continues_the_same_tokens() {
    let m = model("kl_mixed");
    let prompt: Vec<u32> = (0..37).map(|i| (i * 31 % 370) as u32 + 5).collect();
    let n = 24;
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 0,
        seed: 11,
        ..Default::default()
    };
    // Penalties count the tokens of the earlier attempt as completion tokens.
    let penalized = SamplingParams {
        presence_penalty: 1.5,
        frequency_penalty: 1.0,
        logit_bias: vec![(prompt[3], 2.0)],
        ..sampled.clone()
    };
    for sampling in [SamplingParams::default(), sampled, penalized] {
        let want = solo(&m, &prompt, n, sampling.clone());
        for k in [1, 5, n - 1] {
            let mut p = Scheduler::new(&m, cfg(8 << 20)).unwrap();
            let mut d = Scheduler::new(&m, cfg(8 << 20)).unwrap();
            let mut resumed_prompt = prompt.clone();
            resumed_prompt.extend(&want[..k]);
            let mut got = want[..k].to_vec();
            got.extend(migrated(
                &m,
                &mut p,
                &mut d,
                &resumed_prompt,
                n - k,
                sampling.clone(),
                |_, _| true,
                k,
            ));
            assert_eq!(got, want, "migrated after {k} tokens ({sampling:?})");
        }
    }
}
