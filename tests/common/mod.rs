//! Shared helpers for the cross-crate tests: fixture discovery and tolerance checks.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub use tessera_engine::reference::{rel_err, Reference, NEAR_TIE};

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
    Reference::load(&dir.join("reference.json")).unwrap()
}

/// Greedy tokens must equal the reference's up to its first near tie (that step and later ones
/// are not compared); returns how many steps were compared.
pub fn assert_greedy_matches(
    ours: &[u32],
    reference: &[u32],
    margins: &[f32],
    what: &str,
) -> usize {
    let a = tessera_engine::reference::greedy_agreement(ours, reference, margins, NEAR_TIE);
    if let Some(i) = a.first_difference {
        panic!("{what}: greedy token {i} differs (ours {ours:?}, reference {reference:?})");
    }
    a.equal
}
