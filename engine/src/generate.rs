//! Single-sequence generation on top of `Model::forward`: what `tessera logits` and
//! `tessera generate` run. Batched serving lives in the scheduler.

use crate::error::{EngineError, Result};
use crate::model::{LogitsWanted, Model};
use crate::sampler::{Sampler, SamplingParams};
use crate::state::SequenceState;

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after emitting one of these (it is included in the output).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per forward call; `None` feeds the whole prompt at once.
    pub prefill_chunk: Option<usize>,
}

fn check_prompt(model: &Model, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidInput("the prompt has no tokens".into()));
    }
    let vocab = model.config.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::InvalidInput(format!(
            "token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    Ok(())
}

/// Feeds `prompt` in chunks; returns the logits of every prompt position (`[T, vocab]`) when
/// `all`, else of the last position only.
pub fn prefill(
    model: &Model,
    prompt: &[u32],
    state: &mut SequenceState,
    chunk: Option<usize>,
    all: bool,
) -> Result<Vec<f32>> {
    check_prompt(model, prompt)?;
    let chunk = chunk.unwrap_or(prompt.len()).max(1);
    let mut out = Vec::new();
    let pieces: Vec<&[u32]> = prompt.chunks(chunk).collect();
    let last = pieces.len() - 1;
    for (i, piece) in pieces.into_iter().enumerate() {
        let want = if all {
            LogitsWanted::All
        } else if i == last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        out.extend(model.forward_one(piece, state, want)?);
    }
    Ok(out)
}

/// Prompt logits `[T, vocab]`, flattened.
pub fn prompt_logits(model: &Model, prompt: &[u32]) -> Result<Vec<f32>> {
    let mut state = model.new_state();
    prefill(model, prompt, &mut state, None, true)
}

/// Generated tokens only (not the prompt).
pub fn generate(model: &Model, req: &GenerateRequest) -> Result<Vec<u32>> {
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let mut state = model.new_state();
    if req.max_new_tokens == 0 {
        check_prompt(model, &req.prompt)?;
        return Ok(Vec::new());
    }
    let mut logits = prefill(model, &req.prompt, &mut state, req.prefill_chunk, false)?;
    let mut out = Vec::with_capacity(req.max_new_tokens);
    loop {
        let next = sampler.sample(&logits);
        out.push(next);
        if out.len() >= req.max_new_tokens || req.stop_ids.contains(&next) {
            return Ok(out);
        }
        logits = model.forward_one(&[next], &mut state, LogitsWanted::Last)?;
    }
}
