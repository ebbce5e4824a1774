//! What the scheduler holds, for metrics, tests and transfers: the page pool, queue and pool
//! statistics, page counts by holder and fingerprints of the cached pages.

use std::collections::HashSet;

use crate::error::Result;
use crate::kv::{Field, GroupKind, PageId, PagePool};

use super::super::request::SchedulerStats;
use super::Scheduler;

impl Scheduler {
    /// The pool, for transfers in and out of it.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut PagePool {
        &mut self.pool
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        let p = self.index.stats();
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            preemptions: self.preemptions,
            steps: self.steps,
            prefix_hit_tokens: p.hit_tokens,
            prefix_lookups: p.lookups,
            prefix_hits: p.hits,
            queued_prompt_tokens: self
                .waiting
                .iter()
                .chain(&self.running)
                .map(|s| s.req.prompt.len().saturating_sub(s.paged.len))
                .sum(),
            pool: self
                .pool
                .usage()
                .iter()
                .map(|u| {
                    let name = if Some(u.group) == self.slots.mla_group {
                        "mla".to_string()
                    } else {
                        format!("kda{}", u.group.0)
                    };
                    (
                        name,
                        u.live_pages,
                        self.pool.total_pages(u.group).unwrap_or(0),
                    )
                })
                .collect(),
        }
    }

    /// Pages referenced by anything (requests or the prefix cache).
    pub fn live_pages(&self) -> usize {
        self.pool.usage().iter().map(|u| u.live_pages).sum()
    }

    /// Pages referenced by the prefix cache alone.
    pub fn cached_pages(&self) -> usize {
        self.index.len()
    }

    /// Pages no one but the prefix cache holds: what eviction can give back.
    pub fn evictable_pages(&self) -> usize {
        self.index.evictable(&self.pool).count()
    }

    /// Parents holding a page that something besides the prefix cache holds (a running or
    /// waiting request, a reservation, a handoff): the parents that stay bound however much of
    /// the cache is evicted.
    pub fn request_parents(&self) -> usize {
        let cache_only: HashSet<PageId> = self.index.evictable(&self.pool).collect();
        self.pool.parents_holding(|p| !cache_only.contains(&p))
    }

    /// A fingerprint of every page the prefix cache holds (all planes, all fields): tests use it
    /// to show that shared pages are never written.
    pub fn cached_page_fingerprints(&self) -> Vec<(u32, u64)> {
        use std::hash::{Hash, Hasher};
        let layout = self.pool.layout();
        let mut out: Vec<(u32, u64)> = self
            .index
            .pages()
            .map(|page| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                let g = self.pool.group_of(page).expect("cached pages are live");
                let group = layout.group(g).expect("a group");
                let fields: &[Field] = match group.kind {
                    GroupKind::Mla => &[Field::Latent],
                    GroupKind::Kda => &[Field::Conv, Field::Recurrent],
                };
                for &layer in &group.layers {
                    let (_, plane) = layout.locate(layer).expect("a layer");
                    for &f in fields {
                        let off = self.pool.byte_offset(plane, page, f).expect("a field");
                        let (_, len) = layout.field_range(g, f).expect("a field");
                        let mut bytes = vec![0u8; len];
                        self.pool.read_bytes(off, &mut bytes).expect("readable");
                        bytes.hash(&mut h);
                    }
                }
                (page.0, h.finish())
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Drops every cached prefix (pages held by requests stay).
    pub fn clear_prefix_cache(&mut self) -> Result<()> {
        self.index.clear(&mut self.pool)?;
        Ok(())
    }
}
