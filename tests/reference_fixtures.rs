//! The CPU engine against `transformers`: prompt logits and greedy continuations recorded by
//! `tests/reference/make_fixtures.py` from small random Kimi Linear checkpoints.

use tessera_engine::generate::{generate, prefill, prompt_logits, GenerateRequest};
use tessera_engine::model::{LogitsWanted, Segment};
use tessera_engine::{Model, SamplingParams};

use crate::common::*;

fn greedy(max_new_tokens: usize, prompt: &[u32], chunk: Option<usize>) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        prefill_chunk: chunk,
    }
}

#[test]
fn prompt_logits_match_transformers() {
    for dir in fixtures() {
        let model = Model::load(&dir).unwrap();
        for p in reference(&dir).prompts {
            let (shape, want) = tessera_engine::npy::read_f32(&dir.join(&p.logits_file)).unwrap();
            assert_eq!(shape, vec![p.prompt_ids.len(), model.config.vocab_size]);
            let got = prompt_logits(&model, &p.prompt_ids).unwrap();
            let err = rel_err(&got, &want);
            assert!(
                err <= LOGITS_REL_TOL,
                "{}/{}: relative error {err:e}",
                dir.display(),
                p.name
            );
        }
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    let mut compared = 0;
    for dir in fixtures() {
        let model = Model::load(&dir).unwrap();
        for p in reference(&dir).prompts {
            let out = generate(&model, &greedy(p.greedy_ids.len(), &p.prompt_ids, None)).unwrap();
            compared += assert_greedy_matches(
                &out,
                &p.greedy_ids,
                &p.greedy_margins,
                &format!("{}/{}", dir.display(), p.name),
            );
        }
    }
    assert!(
        compared >= 20,
        "too few greedy steps compared ({compared}): fixtures are all near ties"
    );
}

#[test]
fn decode_step_by_step_equals_prefill_of_the_whole_sequence() {
    for dir in fixtures() {
        let model = Model::load(&dir).unwrap();
        for p in reference(&dir).prompts {
            let mut seq = p.prompt_ids.clone();
            seq.extend(&p.greedy_ids);
            let whole = prompt_logits(&model, &seq).unwrap();
            let vocab = model.config.vocab_size;
            let mut state = model.new_state();
            let mut stepped = prefill(&model, &p.prompt_ids, &mut state, None, true).unwrap();
            for &t in &p.greedy_ids {
                stepped.extend(
                    model
                        .forward_one(&[t], &mut state, LogitsWanted::Last)
                        .unwrap(),
                );
            }
            assert_eq!(stepped.len(), seq.len() * vocab);
            let err = rel_err(&stepped, &whole);
            assert!(
                err <= LOGITS_REL_TOL,
                "{}/{}: decode vs prefill relative error {err:e}",
                dir.display(),
                p.name
            );
        }
    }
}

#[test]
fn chunked_prefill_matches_whole_prefill() {
    for dir in fixtures() {
        let model = Model::load(&dir).unwrap();
        let p = reference(&dir)
            .prompts
            .into_iter()
            .max_by_key(|p| p.prompt_ids.len())
            .unwrap();
        let whole = prompt_logits(&model, &p.prompt_ids).unwrap();
        for chunk in [1, 7, 64, 65, 100] {
            let mut state = model.new_state();
            let got = prefill(&model, &p.prompt_ids, &mut state, Some(chunk), true).unwrap();
            let err = rel_err(&got, &whole);
            assert!(
                err <= LOGITS_REL_TOL,
                "{}: chunk {chunk}: relative error {err:e}",
                dir.display()
            );
        }
    }
}

#[test]
fn a_batch_of_segments_equals_each_alone() {
    let dir = fixtures().into_iter().next().unwrap();
    let model = Model::load(&dir).unwrap();
    let prompts: Vec<Vec<u32>> = reference(&dir)
        .prompts
        .into_iter()
        .map(|p| p.prompt_ids)
        .collect();
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| prompt_logits(&model, p).unwrap())
        .collect();
    let mut states: Vec<_> = prompts.iter().map(|_| model.new_state()).collect();
    let mut segs = Segment::batch(&prompts, &mut states, LogitsWanted::All);
    let batched = model.forward(&mut segs).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(
            a, b,
            "a sequence's logits must not depend on its batch (bitwise on CPU)"
        );
    }
}

#[test]
fn greedy_outputs_do_not_depend_on_prefill_chunking() {
    let dir = fixtures().into_iter().next().unwrap();
    let model = Model::load(&dir).unwrap();
    let p = reference(&dir)
        .prompts
        .into_iter()
        .max_by_key(|p| p.prompt_ids.len())
        .unwrap();
    let whole = generate(&model, &greedy(8, &p.prompt_ids, None)).unwrap();
    for chunk in [3, 64] {
        let got = generate(&model, &greedy(8, &p.prompt_ids, Some(chunk))).unwrap();
        assert_greedy_matches(&got, &whole, &p.greedy_margins, "chunked");
    }
}
