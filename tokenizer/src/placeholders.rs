//! Image placeholders in a prompt. A chat template writes one placeholder token per image; once
//! the image's embedding rows are known, the placeholder is widened to that many copies so the
//! text model sees one position per image token. The router (which never links the engine) and
//! the engine widen prompts by this one rule.

use std::ops::Range;

/// The runs of consecutive `placeholder` tokens in `prompt`, in order.
pub fn placeholder_runs(prompt: &[u32], placeholder: u32) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < prompt.len() {
        if prompt[i] == placeholder {
            let start = i;
            while i < prompt.len() && prompt[i] == placeholder {
                i += 1;
            }
            runs.push(start..i);
        } else {
            i += 1;
        }
    }
    runs
}

/// Why a prompt's placeholders do not fit its images.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct PlaceholderMismatch {
    /// Placeholder tokens the images need in all.
    pub expected: usize,
    /// Placeholder tokens the prompt has.
    pub found: usize,
    pub detail: String,
}

/// Widens the k-th run of placeholders to `n_tokens[k]` copies: a run of one becomes
/// `n_tokens[k]` copies, a run already of exactly that length is kept. Returns the new prompt and
/// each image's position (its first placeholder in the new prompt). Runs are matched to images in
/// order, so two images need some other token between them (chat templates wrap each image in
/// media start/end tokens).
pub fn expand_placeholders(
    prompt: &[u32],
    placeholder: u32,
    n_tokens: &[usize],
) -> Result<(Vec<u32>, Vec<usize>), PlaceholderMismatch> {
    let runs = placeholder_runs(prompt, placeholder);
    let found: usize = runs.iter().map(|r| r.len()).sum();
    let expected: usize = n_tokens.iter().sum();
    let mismatch = |detail: String| PlaceholderMismatch {
        expected,
        found,
        detail,
    };
    if runs.len() != n_tokens.len() {
        return Err(mismatch(format!(
            "the prompt has {} image placeholder(s) for {} image(s)",
            runs.len(),
            n_tokens.len()
        )));
    }
    let mut out = Vec::with_capacity(prompt.len() + expected);
    let mut positions = Vec::with_capacity(runs.len());
    let mut last = 0;
    for (k, (run, &n)) in runs.iter().zip(n_tokens).enumerate() {
        if run.len() != 1 && run.len() != n {
            return Err(mismatch(format!(
                "image {k} has a run of {} placeholders; write it once or exactly {n} times",
                run.len()
            )));
        }
        out.extend_from_slice(&prompt[last..run.start]);
        positions.push(out.len());
        out.extend(std::iter::repeat_n(placeholder, n));
        last = run.end;
    }
    out.extend_from_slice(&prompt[last..]);
    Ok((out, positions))
}
