//! Shared helpers for the cross-crate tests: fixture discovery and tolerance checks.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Deserialize, Debug, Clone)]
pub struct PromptRef {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub logits_file: String,
    pub greedy_ids: Vec<u32>,
    pub greedy_margins: Vec<f32>,
}

#[derive(Deserialize, Debug)]
pub struct Reference {
    pub prompts: Vec<PromptRef>,
}

/// Below this top-1/top-2 logit margin the reference's choice is a near tie: a different but
/// equally valid summation order may flip it, so greedy comparison stops there.
pub const NEAR_TIE: f32 = 1e-3;
/// Prompt logits: max |ours − reference| / max |reference|.
pub const LOGITS_REL_TOL: f32 = 1e-4;

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every fixture directory (those with a `reference.json`), sorted.
pub fn fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").exists())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no fixtures found under tests/fixtures");
    v
}

pub fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// max |a − b| / max |b|.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len(), "length mismatch");
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

/// Greedy tokens must agree up to (and including) the first step whose reference margin is a
/// near tie; returns how many steps were compared.
pub fn assert_greedy_matches(
    ours: &[u32],
    reference: &[u32],
    margins: &[f32],
    what: &str,
) -> usize {
    let mut compared = 0;
    for (i, (&o, &r)) in ours.iter().zip(reference).enumerate() {
        if margins[i] < NEAR_TIE {
            break;
        }
        assert_eq!(
            o, r,
            "{what}: greedy token {i} differs (ours {ours:?}, reference {reference:?})"
        );
        compared += 1;
    }
    compared
}
