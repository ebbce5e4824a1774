//! Single-sequence generation on top of `Model::forward`: what `tessera logits` and
//! `tessera generate` run. Batched serving lives in the scheduler.

use crate::error::{EngineError, Result};
use crate::model::{LogitsWanted, Model, Segment};
use crate::sampler::{Sampler, SamplingParams};
use crate::state::SequenceState;
use crate::vision::{self, PlacedImage};

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
    prefill_with_images(model, prompt, &[], state, chunk, all)
}

/// [`prefill`] of a prompt whose placeholder rows take the embeddings of `images`.
pub fn prefill_with_images(
    model: &Model,
    prompt: &[u32],
    images: &[PlacedImage],
    state: &mut SequenceState,
    chunk: Option<usize>,
    all: bool,
) -> Result<Vec<f32>> {
    check_prompt(model, prompt)?;
    if !images.is_empty() {
        let placeholder = model
            .config
            .vision
            .as_ref()
            .and_then(|v| v.placeholder_token_id);
        vision::check_placed(prompt, placeholder, model.config.hidden_size, images)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    }
    let chunk = chunk.unwrap_or(prompt.len()).max(1);
    let mut out = Vec::new();
    let last = prompt.len().div_ceil(chunk) - 1;
    for (i, start) in (0..prompt.len()).step_by(chunk).enumerate() {
        let end = (start + chunk).min(prompt.len());
        let want = if all {
            LogitsWanted::All
        } else if i == last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        let splices = [vision::splices_in(images, start, end)];
        let mut segs = [Segment {
            tokens: &prompt[start..end],
            state,
            logits: want,
        }];
        out.extend(
            model
                .forward_spliced(&mut segs, &splices)?
                .pop()
                .unwrap_or_default(),
        );
    }
    Ok(out)
}

/// Prompt logits `[T, vocab]`, flattened.
pub fn prompt_logits(model: &Model, prompt: &[u32]) -> Result<Vec<f32>> {
    prompt_logits_with_images(model, prompt, &[])
}

/// [`prompt_logits`] with images placed in the prompt.
pub fn prompt_logits_with_images(
    model: &Model,
    prompt: &[u32],
    images: &[PlacedImage],
) -> Result<Vec<f32>> {
    let mut state = model.new_state();
    prefill_with_images(model, prompt, images, &mut state, None, true)
}

/// Generated tokens only (not the prompt).
pub fn generate(model: &Model, req: &GenerateRequest) -> Result<Vec<u32>> {
    generate_with_images(model, req, &[])
}

/// [`generate`] with images placed in the prompt (positions index `req.prompt`).
pub fn generate_with_images(
    model: &Model,
    req: &GenerateRequest,
    images: &[PlacedImage],
) -> Result<Vec<u32>> {
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let mut state = model.new_state();
    if req.max_new_tokens == 0 {
        check_prompt(model, &req.prompt)?;
        return Ok(Vec::new());
    }
    let mut logits = prefill_with_images(
        model,
        &req.prompt,
        images,
        &mut state,
        req.prefill_chunk,
        false,
    )?;
    let mut out = Vec::with_capacity(req.max_new_tokens);
    loop {
        let next = sampler.sample_after(&logits, &out);
        out.push(next);
        if out.len() >= req.max_new_tokens || req.stop_ids.contains(&next) {
            return Ok(out);
        }
        logits = model.forward_one(&[next], &mut state, LogitsWanted::Last)?;
    }
}
