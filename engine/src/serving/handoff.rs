//! Moving a request's state from a prefill worker's pool into a decode worker's reservation.
//!
//! Family-agnostic: a transfer is a list of `(source page, destination page)` pairs, and each
//! page is the same byte extent in every plane of its group, so the mover copies extents without
//! knowing which pages hold MLA history and which hold KDA state. The two pools must share the
//! layout of a page (page tokens, dims, dtypes); their sizes may differ.

use crate::error::{EngineError, Result};
use crate::kv::{PageId, PagePool};

use super::request::{Handoff, Reservation};

/// The page pairs a handoff needs: every MLA page covering the prompt, and per KDA group the
/// page holding the state at the prompt's end.
pub fn transfer_pairs(h: &Handoff, r: &Reservation) -> Result<Vec<(PageId, PageId)>> {
    if h.prompt_len != r.prompt_len
        || h.mla_pages.len() != r.mla_pages.len()
        || h.kda_pages.len() != r.kda_pages.len()
    {
        return Err(EngineError::InvalidInput(format!(
            "handoff ({} tokens, {} + {} pages) does not match the reservation ({} tokens, {} + {} pages)",
            h.prompt_len,
            h.mla_pages.len(),
            h.kda_pages.len(),
            r.prompt_len,
            r.mla_pages.len(),
            r.kda_pages.len()
        )));
    }
    Ok(h.mla_pages
        .iter()
        .copied()
        .zip(r.mla_pages.iter().copied())
        .chain(h.kda_pages.iter().copied().zip(r.kda_pages.iter().copied()))
        .collect())
}

/// `(source offset, destination offset, length)` byte extents for `pairs`.
pub fn page_extents(
    src: &PagePool,
    dst: &PagePool,
    pairs: &[(PageId, PageId)],
) -> Result<Vec<(usize, usize, usize)>> {
    let mut out = Vec::new();
    for &(s, d) in pairs {
        let (se, de) = (src.page_extents(s)?, dst.page_extents(d)?);
        if se.len() != de.len() || se.iter().zip(&de).any(|(a, b)| a.1 != b.1) {
            return Err(EngineError::InvalidInput(format!(
                "{s} and {d} do not have the same shape: the pools' layouts differ"
            )));
        }
        out.extend(se.iter().zip(&de).map(|(a, b)| (a.0, b.0, a.1)));
    }
    Ok(out)
}

/// Copies `pairs` between two pools of one process (the `local` transport). Returns bytes moved.
pub fn copy_pages(src: &PagePool, dst: &mut PagePool, pairs: &[(PageId, PageId)]) -> Result<usize> {
    let mut moved = 0;
    for &(s, d) in pairs {
        for (so, dof, len) in page_extents(src, dst, &[(s, d)])? {
            let mut bytes = vec![0u8; len];
            src.read_bytes(so, &mut bytes)?;
            dst.write_page_bytes(d, dof, &bytes)?;
            moved += len;
        }
    }
    Ok(moved)
}
