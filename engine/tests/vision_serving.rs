//! Requests with images through the serving path: the scheduler (batching, chunked prefill with
//! images cut by chunk and page boundaries, the prefix cache), prefill → decode hand-over and a
//! migrated request must give the tokens of one sequence run alone, and the prefix cache must
//! never give pages that hold (or follow) one image to a request with another image.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use tessera_engine::generate::{generate_with_images, GenerateRequest};
use tessera_engine::reference::PromptRef;
use tessera_engine::serving::handoff::{copy_pages, transfer_pairs};
use tessera_engine::serving::{EngineEvent, EngineRequest, Handoff, Scheduler, SchedulerConfig};
use tessera_engine::vision::{expand_placeholders, PlacedImage, VisionModel};
use tessera_engine::{Model, SamplingParams};

use crate::serving_support::{drain, sink, tokens, Events};

#[derive(Deserialize)]
struct Reference {
    placeholder_token_id: u32,
    prompts: Vec<PromptRef>,
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/k25_tiny")
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(dir().join("mm_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

struct Fixture {
    model: Model,
    vision: VisionModel,
    rf: Reference,
}

fn fixture() -> Fixture {
    let mut model = Model::load(&dir()).unwrap();
    model.set_batch_invariant(true);
    Fixture {
        model,
        vision: VisionModel::load(&dir()).unwrap().unwrap(),
        rf: reference(),
    }
}

impl Fixture {
    /// `prompt` (placeholders once per image or expanded) with `images` (files under images/).
    fn place(&self, prompt: &[u32], images: &[&str]) -> (Vec<u32>, Vec<PlacedImage>) {
        let embeds: Vec<_> = images
            .iter()
            .map(|f| {
                let bytes = std::fs::read(dir().join("images").join(f)).unwrap();
                Arc::new(self.vision.encode_image(&bytes).unwrap())
            })
            .collect();
        let counts: Vec<usize> = embeds.iter().map(|e| e.n_tokens).collect();
        let (prompt, positions) =
            expand_placeholders(prompt, self.rf.placeholder_token_id, &counts).unwrap();
        let placed = positions
            .into_iter()
            .zip(embeds)
            .map(|(position, embedding)| PlacedImage {
                position,
                embedding,
            })
            .collect();
        (prompt, placed)
    }

    fn alone(&self, prompt: &[u32], images: &[PlacedImage], n: usize) -> Vec<u32> {
        let r = GenerateRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: n,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            prefill_chunk: None,
        };
        generate_with_images(&self.model, &r, images).unwrap()
    }
}

/// Files of a reference prompt's images.
fn files(p: &PromptRef) -> Vec<&'static str> {
    p.images
        .iter()
        .map(|n| match n.as_str() {
            "rgb_84x56" => "rgb_84x56.png",
            "rgba_70x45" => "rgba_70x45.png",
            "photo_60x50" => "photo_60x50.jpg",
            "big_300x200" => "big_300x200.webp",
            other => panic!("unknown image {other}"),
        })
        .collect()
}

fn cfg(cache: bool) -> SchedulerConfig {
    SchedulerConfig {
        page_tokens: 4,
        snapshot_interval: 0,
        kv_memory_bytes: 16 << 20,
        // Chunks of at most 8 tokens: every image is cut by chunk and page boundaries.
        max_batch_tokens: 8,
        max_running: 8,
        prefix_cache: cache,
    }
}

fn req(prompt: &[u32], images: &[PlacedImage], n: usize, prefill_only: bool) -> EngineRequest {
    EngineRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        cache_salt: None,
        prefill_only,
        resumed_tokens: 0,
        images: images.to_vec(),
        logprobs: None,
    }
}

fn cached(ev: &Events) -> usize {
    ev.lock()
        .unwrap()
        .iter()
        .find_map(|e| match e {
            EngineEvent::Finished { cached_tokens, .. } => Some(*cached_tokens),
            _ => None,
        })
        .expect("finished")
}

fn failure(ev: &Events) -> Option<String> {
    ev.lock().unwrap().iter().find_map(|e| match e {
        EngineEvent::Failed(m) => Some(m.clone()),
        _ => None,
    })
}

#[test]
fn batched_chunked_requests_with_images_equal_the_reference() {
    let f = fixture();
    for cache in [true, false] {
        let mut s = Scheduler::new(&f.model, cfg(cache)).unwrap();
        // Twice: the second wave resumes from the first one's pages when the cache is on.
        for wave in 0..2 {
            let runs: Vec<(&PromptRef, Events)> =
                f.rf.prompts
                    .iter()
                    .map(|p| {
                        let (prompt, images) = f.place(&p.prompt_ids, &files(p));
                        let ev = Events::default();
                        s.submit(
                            req(&prompt, &images, p.greedy_ids.len(), false),
                            Box::new(sink(&ev)),
                        );
                        (p, ev)
                    })
                    .collect();
            drain(&mut s, &f.model);
            for (p, ev) in runs {
                assert_eq!(failure(&ev), None);
                assert_eq!(
                    tokens(&ev),
                    p.greedy_ids,
                    "{} cache={cache} wave {wave}",
                    p.name
                );
                if wave == 1 {
                    assert_eq!(cached(&ev) > 0, cache, "{} cache={cache}", p.name);
                }
            }
        }
        s.clear_prefix_cache().unwrap();
        assert_eq!(s.live_pages(), 0, "pages leaked");
    }
}

#[test]
fn the_same_text_with_another_image_never_shares_image_pages() {
    let f = fixture();
    let p = f.rf.prompts.iter().find(|p| p.images.len() == 1).unwrap();
    // Collapse the expanded run to one placeholder: the prompt as a client writes it.
    let ph = f.rf.placeholder_token_id;
    let mut short = Vec::new();
    for (i, &t) in p.prompt_ids.iter().enumerate() {
        if t != ph || i == 0 || p.prompt_ids[i - 1] != ph {
            short.push(t);
        }
    }
    let (prompt_a, img_a) = f.place(&short, &["rgb_84x56.png"]);
    let (prompt_b, img_b) = f.place(&short, &["rgba_70x45.png"]);
    assert_eq!(
        prompt_a, prompt_b,
        "both images are 6 tokens: the same token ids"
    );
    assert_eq!(prompt_a, p.prompt_ids);
    let n = 6;
    let want_a = f.alone(&prompt_a, &img_a, n);
    let want_b = f.alone(&prompt_b, &img_b, n);
    assert_ne!(want_a, want_b, "the images must change the continuation");
    // A KDA snapshot at every page, so that a hit can end at any page boundary.
    let mut s = Scheduler::new(
        &f.model,
        SchedulerConfig {
            snapshot_interval: cfg(true).page_tokens,
            ..cfg(true)
        },
    )
    .unwrap();
    let run = |s: &mut Scheduler, prompt: &[u32], images: &[PlacedImage]| {
        let ev = Events::default();
        s.submit(req(prompt, images, n, false), Box::new(sink(&ev)));
        drain(s, &f.model);
        assert_eq!(failure(&ev), None);
        (tokens(&ev), cached(&ev))
    };
    // Pages before the one holding the image's first token are the same for any image (and
    // for none); from that page on they are the image's own.
    let page = cfg(true).page_tokens;
    let image_page_start = img_a[0].position / page * page;
    assert!(
        image_page_start > 0,
        "the test needs shareable text before the image"
    );
    let (out, hit) = run(&mut s, &prompt_a, &img_a);
    assert_eq!((out, hit), (want_a.clone(), 0));
    let (out, hit) = run(&mut s, &prompt_b, &img_b);
    assert_eq!(out, want_b, "image B after image A");
    assert_eq!(
        hit, image_page_start,
        "image B shares exactly the text pages before image A's"
    );
    // Placeholders without images share those pages too, and no more: not even with the same
    // prompt without images again, since nothing says which image the placeholders stand for.
    for _ in 0..2 {
        let ev = Events::default();
        s.submit(req(&prompt_a, &[], n, false), Box::new(sink(&ev)));
        drain(&mut s, &f.model);
        assert_eq!(cached(&ev), image_page_start);
    }
    // The same image again hits past the image.
    let (out, hit) = run(&mut s, &prompt_a, &img_a);
    assert_eq!(out, want_a);
    assert!(
        hit > img_a[0].position + img_a[0].embedding.n_tokens,
        "hit {hit}"
    );
    s.clear_prefix_cache().unwrap();
    assert_eq!(s.live_pages(), 0);
}

#[test]
fn handed_off_and_migrated_requests_with_images_continue_exactly() {
    let f = fixture();
    let mut p = Scheduler::new(&f.model, cfg(true)).unwrap();
    let mut d = Scheduler::new(&f.model, cfg(true)).unwrap();
    for pr in &f.rf.prompts {
        let (prompt, images) = f.place(&pr.prompt_ids, &files(pr));
        let n = pr.greedy_ids.len();
        // Prefill-only on one scheduler, decode on another.
        let pev = Events::default();
        p.submit(req(&prompt, &images, n, true), Box::new(sink(&pev)));
        drain(&mut p, &f.model);
        assert_eq!(failure(&pev), None);
        let h: Handoff = pev
            .lock()
            .unwrap()
            .iter()
            .find_map(|e| match e {
                EngineEvent::Handoff(h) => Some(h.clone()),
                _ => None,
            })
            .expect("prefill hands over");
        // Decode with the images, and without them (the prompt's state arrives as pages; the
        // decode side never runs the prompt unless it must recompute).
        for decode_images in [&images[..], &[]] {
            let r = d.reserve(prompt.len()).unwrap();
            let pairs = transfer_pairs(&h, &r).unwrap();
            copy_pages(p.pool(), d.pool_mut(), &pairs).unwrap();
            let dev = Events::default();
            d.submit_resumed(
                r.id,
                req(&prompt, decode_images, n, false),
                h.first_token,
                h.cached_tokens,
                Box::new(sink(&dev)),
            )
            .unwrap();
            drain(&mut d, &f.model);
            let mut got = vec![h.first_token];
            got.extend(tokens(&dev));
            assert_eq!(
                got,
                pr.greedy_ids,
                "{}: prefill → decode ({} images on decode)",
                pr.name,
                decode_images.len()
            );
        }
        p.release_handoff(h.id).unwrap();

        // Migrated after 3 tokens: the prompt carries them, image positions are unchanged.
        let k = 3;
        let mut resumed_prompt = prompt.clone();
        resumed_prompt.extend(&pr.greedy_ids[..k]);
        let ev = Events::default();
        let mut r = req(&resumed_prompt, &images, n - k, false);
        r.resumed_tokens = k;
        d.submit(r, Box::new(sink(&ev)));
        drain(&mut d, &f.model);
        assert_eq!(failure(&ev), None);
        assert_eq!(tokens(&ev), pr.greedy_ids[k..], "{}: migrated", pr.name);
    }
    p.clear_prefix_cache().unwrap();
    d.clear_prefix_cache().unwrap();
    assert_eq!(p.live_pages(), 0);
    assert_eq!(d.live_pages(), 0);
}

#[test]
fn images_off_their_placeholders_are_refused() {
    let f = fixture();
    let p = &f.rf.prompts[0];
    let (prompt, mut images) = f.place(&p.prompt_ids, &files(p));
    images[0].position -= 1;
    let mut s = Scheduler::new(&f.model, cfg(true)).unwrap();
    let ev = Events::default();
    s.submit(req(&prompt, &images, 4, false), Box::new(sink(&ev)));
    drain(&mut s, &f.model);
    let msg = failure(&ev).expect("refused");
    assert!(msg.contains("not the placeholder"), "{msg}");
    images[0].position = prompt.len() - 2;
    let ev = Events::default();
    s.submit(req(&prompt, &images, 4, false), Box::new(sink(&ev)));
    drain(&mut s, &f.model);
    let msg = failure(&ev).expect("refused");
    assert!(msg.contains("runs past the prompt"), "{msg}");
}
