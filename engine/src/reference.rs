//! The reference fixtures under `tests/fixtures` — small random models and what `transformers`
//! computed on them (`tests/reference/*.py`) — and the rules outputs are held to: the relative
//! error of logits, and greedy tokens equal up to the reference's first near tie.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One reference prompt: its token ids, the file of its prompt logits (`.npy`, f32
/// `[tokens, vocab]`; empty where the fixture has none), the greedy continuation, the
/// reference's top-1/top-2 logit margin at each of its steps (empty where the fixture has none)
/// and the names of the images it places (multimodal fixtures).
#[derive(Clone, Debug, Deserialize)]
pub struct PromptRef {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    #[serde(default)]
    pub logits_file: String,
    pub greedy_ids: Vec<u32>,
    #[serde(default)]
    pub greedy_margins: Vec<f32>,
    #[serde(default)]
    pub images: Vec<String>,
}

/// A text fixture's reference: its prompts.
#[derive(Clone, Debug, Deserialize)]
pub struct Reference {
    pub prompts: Vec<PromptRef>,
}

/// The reference files of text fixtures: Kimi Linear's, then Kimi K3's.
pub const TEXT_REFERENCE_FILES: [&str; 2] = ["reference.json", "k3_reference.json"];

impl Reference {
    /// Reads a reference file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))
    }

    /// The text reference file of the fixture in `dir`: the first of [`TEXT_REFERENCE_FILES`]
    /// there.
    pub fn file_in(dir: &Path) -> Option<PathBuf> {
        TEXT_REFERENCE_FILES
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.exists())
    }
}

/// Below this top-1/top-2 logit margin the reference's greedy choice is a near tie: a different
/// but equally valid order of summation may flip it, so greedy comparison stops there.
pub const NEAR_TIE: f32 = 1e-3;

/// max |ours − reference| / max |reference|; infinite where the lengths differ or either side
/// holds a NaN.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    if ours.len() != reference.len() {
        return f32::INFINITY;
    }
    let max_ref = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_diff = ours.iter().zip(reference).fold(0f32, |m, (a, b)| {
        if a.is_nan() || b.is_nan() {
            f32::INFINITY
        } else {
            m.max((a - b).abs())
        }
    });
    max_diff / max_ref.max(f32::MIN_POSITIVE)
}

/// How greedy tokens agree with the reference's: steps are compared in order until the first
/// whose reference margin is below the near-tie threshold (that step is not compared), the first
/// that differs, or the end of either list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GreedyAgreement {
    /// Steps found equal.
    pub equal: usize,
    /// The first step that differs, if one does before a near tie.
    pub first_difference: Option<usize>,
}

/// Compares `ours` with the reference's greedy tokens `reference`, whose step `i` had margin
/// `margins[i]` (steps without a margin count as clear).
pub fn greedy_agreement(
    ours: &[u32],
    reference: &[u32],
    margins: &[f32],
    near_tie: f32,
) -> GreedyAgreement {
    for (i, (&o, &r)) in ours.iter().zip(reference).enumerate() {
        if margins.get(i).is_some_and(|&m| m < near_tie) {
            return GreedyAgreement {
                equal: i,
                first_difference: None,
            };
        }
        if o != r {
            return GreedyAgreement {
                equal: i,
                first_difference: Some(i),
            };
        }
    }
    GreedyAgreement {
        equal: ours.len().min(reference.len()),
        first_difference: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_is_relative_to_the_reference_and_never_passes_nan_or_a_short_list() {
        assert_eq!(rel_err(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_err(&[0.0], &[0.0]), 0.0);
        assert!(rel_err(&[f32::NAN], &[1.0]).is_infinite());
        assert!(rel_err(&[1.0], &[f32::NAN]).is_infinite());
        assert!(rel_err(&[1.0], &[1.0, 2.0]).is_infinite());
    }

    #[test]
    fn greedy_agreement_stops_at_a_near_tie_or_the_first_difference() {
        let clear = [1.0; 4];
        let agree = |ours: &[u32], margins: &[f32]| {
            let g = greedy_agreement(ours, &[5, 6, 7, 8], margins, NEAR_TIE);
            (g.equal, g.first_difference)
        };
        assert_eq!(agree(&[5, 6, 7, 8], &clear), (4, None));
        assert_eq!(agree(&[5, 6, 9, 8], &clear), (2, Some(2)));
        // A near tie at step 2: steps 2 and later are not compared.
        assert_eq!(agree(&[5, 6, 9, 0], &[1.0, 1.0, 1e-4, 1.0]), (2, None));
        // Shorter output, and no margins at all.
        assert_eq!(agree(&[5, 6], &clear), (2, None));
        assert_eq!(agree(&[5, 0], &[]), (1, Some(1)));
    }
}
