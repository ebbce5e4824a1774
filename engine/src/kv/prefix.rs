//! Prefix index: which pages already hold the state of a token prefix.
//!
//! Why it is shaped like this (DESIGN.md §3, K3-SPEC §5 "Prefix caching"):
//! - a prefix is named by a chain of SHA-256 hashes, one per `page_tokens` page, each over the
//!   previous hash and the page's tokens, so a hash names the whole prefix up to that page;
//!   content that tokens do not show (image bytes behind placeholder tokens) enters through the
//!   `extra` key, mixed into the chain's root (conservative: different images never share);
//! - resuming a hybrid model needs *both* the MLA history up to a boundary and, for every KDA
//!   group, the recurrent snapshot taken exactly at that boundary; so a hit is the longest
//!   boundary where the MLA pages are all present (prefix-closed) and a complete snapshot set was
//!   published: always a multiple of `page_tokens`;
//! - the index holds one reference on every page it stores and seals it (published pages are
//!   immutable); one LRU over the pages of every group, under the pool's one budget, evicts only
//!   pages nobody else holds (evicting a page a request holds would free nothing).
//!
//! The index never owns the pool: every call that touches references takes it, and all calls
//! for one index must pass the same pool.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};

use super::layout::KvLayout;
use super::pool::{KvArena, PagePool};
use super::{GroupId, KvError, PageId};

/// SHA-256 of a prefix, chained page by page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub [u8; 32]);

/// The chain of hashes of every *full* page of `tokens`.
pub fn page_hashes(page_tokens: usize, tokens: &[u32], extra: Option<&[u8]>) -> Vec<BlockHash> {
    page_hashes_marked(page_tokens, tokens, extra, &[])
}

/// Content that a token's id does not tell, keyed by the token's position: an image over its
/// placeholder tokens. It enters the hash of the page holding `position` (and so, through the
/// chain, of every later page), never the pages before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageMark {
    pub position: usize,
    pub bytes: Vec<u8>,
}

/// [`page_hashes`] with `marks` mixed into the pages that hold their positions.
pub fn page_hashes_marked(
    page_tokens: usize,
    tokens: &[u32],
    extra: Option<&[u8]>,
    marks: &[PageMark],
) -> Vec<BlockHash> {
    let mut root = Sha256::new();
    root.update(b"tessera.kv.prefix.v1");
    root.update((page_tokens as u64).to_le_bytes());
    match extra {
        None => root.update([0u8]),
        Some(e) => {
            root.update([1u8]);
            root.update((e.len() as u64).to_le_bytes());
            root.update(e);
        }
    }
    let mut prev: [u8; 32] = root.finalize().into();
    let p = page_tokens.max(1);
    let mut out = Vec::with_capacity(tokens.len() / p);
    for (i, page) in tokens.chunks_exact(p).enumerate() {
        let mut h = Sha256::new();
        h.update(prev);
        for t in page {
            h.update(t.to_le_bytes());
        }
        for m in marks.iter().filter(|m| m.position / p == i) {
            h.update(b"mark");
            h.update((m.position as u64).to_le_bytes());
            h.update((m.bytes.len() as u64).to_le_bytes());
            h.update(&m.bytes);
        }
        prev = h.finalize().into();
        out.push(BlockHash(prev));
    }
    out
}

/// A prefix hit. The caller holds one reference on every page in it and must release them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens covered: a multiple of `page_tokens` (0 on a miss).
    pub tokens: usize,
    /// MLA pages `0 .. tokens / page_tokens` (empty without an MLA group).
    pub mla_pages: Vec<PageId>,
    /// The snapshot at the hit boundary, one per KDA group, in group order.
    pub snapshots: Vec<PageId>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    pub lookup_tokens: u64,
    pub hit_tokens: u64,
    pub inserted_pages: u64,
    pub evicted_pages: u64,
}

#[derive(Clone, Debug)]
struct Entry {
    /// Page index of the boundary (0 = after the first page).
    depth: u32,
    tick: u64,
    mla: PageId,
    /// One per KDA group; NULL where none was published.
    snaps: Vec<PageId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Item {
    Mla,
    Snap(u16),
}

/// LRU order: oldest tick first; at one tick the deepest page first, so chains shrink from the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct LruKey {
    tick: u64,
    depth: Reverse<u32>,
    hash: BlockHash,
    item: Item,
}

pub struct PrefixIndex {
    page_tokens: usize,
    mla: Option<GroupId>,
    kda: Vec<GroupId>,
    entries: FxHashMap<BlockHash, Entry>,
    lru: BTreeSet<LruKey>,
    clock: u64,
    stats: PrefixStats,
}

impl PrefixIndex {
    pub fn new(layout: &KvLayout) -> Self {
        PrefixIndex {
            page_tokens: layout.page_tokens,
            mla: layout.mla_group(),
            kda: layout.kda_groups(),
            entries: FxHashMap::default(),
            lru: BTreeSet::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn hashes(&self, tokens: &[u32], extra: Option<&[u8]>) -> Vec<BlockHash> {
        page_hashes(self.page_tokens, tokens, extra)
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }
    /// Pages the index holds a reference on.
    pub fn len(&self) -> usize {
        self.lru.len()
    }
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }
    /// Every page the index holds (one reference each).
    pub fn pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.lru.iter().map(|k| self.page_of(k))
    }

    /// The pages only the index holds (its own reference is their only one): what
    /// [`Self::evict`] can free.
    pub fn evictable<'a, A: KvArena>(
        &'a self,
        pool: &'a PagePool<A>,
    ) -> impl Iterator<Item = PageId> + 'a {
        self.pages()
            .filter(move |&p| pool.refcount(p).is_ok_and(|rc| rc == 1))
    }

    /// Tokens a lookup would hit now, without taking references or touching the LRU.
    pub fn probe(&self, tokens: &[u32], extra: Option<&[u8]>) -> usize {
        self.best(&self.hashes(tokens, extra))
            .map_or(0, |b| (b + 1) * self.page_tokens)
    }

    /// The longest usable prefix of `tokens`; takes one reference per returned page for the caller.
    /// Pass the tokens the request may skip (typically all but the last prompt token).
    pub fn lookup<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        tokens: &[u32],
        extra: Option<&[u8]>,
    ) -> Result<PrefixHit, KvError> {
        let hashes = self.hashes(tokens, extra);
        self.lookup_hashed(pool, tokens.len(), &hashes)
    }

    /// [`lookup`](Self::lookup) of a prefix of `n_tokens` tokens whose page hashes the caller
    /// computed (with [`page_hashes_marked`]).
    pub fn lookup_hashed<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        n_tokens: usize,
        hashes: &[BlockHash],
    ) -> Result<PrefixHit, KvError> {
        self.stats.lookups += 1;
        self.stats.lookup_tokens += n_tokens as u64;
        let Some(b) = self.best(hashes) else {
            self.stats.misses += 1;
            return Ok(PrefixHit::default());
        };
        let path: &[BlockHash] = if self.mla.is_some() {
            &hashes[..=b]
        } else {
            &hashes[b..=b]
        };
        let mut hit = PrefixHit {
            tokens: (b + 1) * self.page_tokens,
            ..PrefixHit::default()
        };
        if self.mla.is_some() {
            hit.mla_pages = path.iter().map(|h| self.entries[h].mla).collect();
        }
        hit.snapshots = self.entries[&hashes[b]].snaps.clone();
        let all: Vec<PageId> = hit
            .mla_pages
            .iter()
            .chain(&hit.snapshots)
            .copied()
            .collect();
        for (i, &p) in all.iter().enumerate() {
            if let Err(e) = pool.retain(p) {
                for &q in &all[..i] {
                    let _ = pool.release(q);
                }
                return Err(e);
            }
        }
        let tick = self.tick();
        for h in path {
            self.retouch(h, tick, |_| {});
        }
        self.stats.hits += 1;
        self.stats.hit_tokens += hit.tokens as u64;
        Ok(hit)
    }

    /// Stores the MLA pages of the full pages of `tokens` (`pages[i]` holds page `i`; NULL holes
    /// and pages past the last full page are skipped). A page already stored for a hash wins.
    /// Returns how many pages the index newly holds.
    pub fn insert_mla<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        tokens: &[u32],
        extra: Option<&[u8]>,
        pages: &[PageId],
    ) -> Result<usize, KvError> {
        let hashes = self.hashes(tokens, extra);
        self.insert_mla_hashed(pool, &hashes, pages)
    }

    /// [`insert_mla`](Self::insert_mla) with page hashes the caller computed.
    pub fn insert_mla_hashed<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        hashes: &[BlockHash],
        pages: &[PageId],
    ) -> Result<usize, KvError> {
        let mla = self
            .mla
            .ok_or_else(|| KvError::Prefix("the layout has no MLA group".into()))?;
        let n = pages.len().min(hashes.len());
        for &p in pages[..n].iter().filter(|p| !p.is_null()) {
            let g = pool.group_of(p)?;
            if g != mla {
                return Err(KvError::WrongGroup {
                    page: p,
                    expected: mla,
                    actual: g,
                });
            }
        }
        let tick = self.tick();
        let mut stored = 0;
        for (i, (&h, &p)) in hashes.iter().zip(pages).enumerate().take(n) {
            if p.is_null() {
                continue;
            }
            let kinds = self.kda.len();
            self.entries.entry(h).or_insert_with(|| Entry {
                depth: i as u32,
                tick,
                mla: PageId::NULL,
                snaps: vec![PageId::NULL; kinds],
            });
            let mut fresh = false;
            self.retouch(&h, tick, |e| {
                if e.mla.is_null() {
                    e.mla = p;
                    fresh = true;
                }
            });
            if fresh {
                pool.retain(p)?;
                pool.seal(p)?;
                stored += 1;
            }
        }
        self.stats.inserted_pages += stored as u64;
        Ok(stored)
    }

    /// Publishes `page` as `group`'s snapshot after exactly `tokens` (a non-zero multiple of
    /// `page_tokens`). Returns false (and takes no reference) if one is already published there.
    pub fn publish_snapshot<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        tokens: &[u32],
        extra: Option<&[u8]>,
        group: GroupId,
        page: PageId,
    ) -> Result<bool, KvError> {
        if tokens.is_empty() || !tokens.len().is_multiple_of(self.page_tokens) {
            return Err(KvError::Prefix(format!(
                "snapshot boundary {} is not a non-zero multiple of {}",
                tokens.len(),
                self.page_tokens
            )));
        }
        let hashes = self.hashes(tokens, extra);
        self.publish_snapshot_hashed(pool, &hashes, group, page)
    }

    /// [`publish_snapshot`](Self::publish_snapshot) after the pages whose hashes the caller
    /// computed (the boundary is the end of the last one).
    pub fn publish_snapshot_hashed<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        hashes: &[BlockHash],
        group: GroupId,
        page: PageId,
    ) -> Result<bool, KvError> {
        if hashes.is_empty() {
            return Err(KvError::Prefix(
                "a snapshot needs at least one full page".into(),
            ));
        }
        let slot = self
            .kda
            .iter()
            .position(|&g| g == group)
            .ok_or_else(|| KvError::Prefix(format!("{group} is not a KDA group")))?;
        let actual = pool.group_of(page)?;
        if actual != group {
            return Err(KvError::WrongGroup {
                page,
                expected: group,
                actual,
            });
        }
        let h = hashes[hashes.len() - 1];
        let tick = self.tick();
        let kinds = self.kda.len();
        self.entries.entry(h).or_insert_with(|| Entry {
            depth: (hashes.len() - 1) as u32,
            tick,
            mla: PageId::NULL,
            snaps: vec![PageId::NULL; kinds],
        });
        let mut fresh = false;
        self.retouch(&h, tick, |e| {
            if e.snaps[slot].is_null() {
                e.snaps[slot] = page;
                fresh = true;
            }
        });
        // Ancestors are at least as recent as the boundary, so chains shrink from their end.
        for a in &hashes[..hashes.len() - 1] {
            self.retouch(a, tick, |_| {});
        }
        if fresh {
            pool.retain(page)?;
            pool.seal(page)?;
            self.stats.inserted_pages += 1;
        }
        Ok(fresh)
    }

    /// Releases up to `n_pages` least recently used pages that only the index holds; returns how
    /// many it released (fewer when the rest are held by requests).
    pub fn evict<A: KvArena>(
        &mut self,
        pool: &mut PagePool<A>,
        n_pages: usize,
    ) -> Result<usize, KvError> {
        let mut victims = Vec::new();
        for key in &self.lru {
            if victims.len() >= n_pages {
                break;
            }
            if pool.refcount(self.page_of(key))? == 1 {
                victims.push(*key);
            }
        }
        for key in &victims {
            let page = self.page_of(key);
            self.lru.remove(key);
            let e = self
                .entries
                .get_mut(&key.hash)
                .expect("an LRU key names a stored entry");
            match key.item {
                Item::Mla => e.mla = PageId::NULL,
                Item::Snap(s) => e.snaps[s as usize] = PageId::NULL,
            }
            if e.mla.is_null() && e.snaps.iter().all(|p| p.is_null()) {
                self.entries.remove(&key.hash);
            }
            pool.release(page)?;
        }
        self.stats.evicted_pages += victims.len() as u64;
        Ok(victims.len())
    }

    /// Drops every reference the index holds (pages requests still hold stay alive with them).
    pub fn clear<A: KvArena>(&mut self, pool: &mut PagePool<A>) -> Result<usize, KvError> {
        let pages: Vec<PageId> = self.pages().collect();
        self.lru.clear();
        self.entries.clear();
        for &p in &pages {
            pool.release(p)?;
        }
        self.stats.evicted_pages += pages.len() as u64;
        Ok(pages.len())
    }

    /// Index of the deepest usable boundary of `hashes`.
    fn best(&self, hashes: &[BlockHash]) -> Option<usize> {
        let mut best = None;
        for (i, h) in hashes.iter().enumerate() {
            let e = self.entries.get(h);
            if self.mla.is_some() && e.is_none_or(|e| e.mla.is_null()) {
                break; // MLA history is prefix-closed: nothing past a missing page is usable
            }
            if e.is_some_and(|e| e.snaps.iter().all(|p| !p.is_null())) {
                best = Some(i);
            }
        }
        best
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn page_of(&self, key: &LruKey) -> PageId {
        let e = &self.entries[&key.hash];
        match key.item {
            Item::Mla => e.mla,
            Item::Snap(s) => e.snaps[s as usize],
        }
    }

    /// Applies `edit` to an entry and moves all its pages to `tick` in the LRU.
    fn retouch(&mut self, h: &BlockHash, tick: u64, edit: impl FnOnce(&mut Entry)) {
        let Some(e) = self.entries.get_mut(h) else {
            return;
        };
        for key in Self::keys(h, e) {
            self.lru.remove(&key);
        }
        edit(e);
        e.tick = tick;
        for key in Self::keys(h, e) {
            self.lru.insert(key);
        }
    }

    fn keys(h: &BlockHash, e: &Entry) -> Vec<LruKey> {
        let key = |item| LruKey {
            tick: e.tick,
            depth: Reverse(e.depth),
            hash: *h,
            item,
        };
        let mut out = Vec::with_capacity(1 + e.snaps.len());
        if !e.mla.is_null() {
            out.push(key(Item::Mla));
        }
        for (s, p) in e.snaps.iter().enumerate() {
            if !p.is_null() {
                out.push(key(Item::Snap(s as u16)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AttnKind::{Kda as K, Mla as M};
    use crate::kv::layout::{KvDims, StateDtypes};

    const DIMS: KvDims = KvDims {
        kda_heads: 1,
        kda_head_dim: 4,
        conv_kernel: 2,
        latent_dim: 6,
    };

    fn setup(attn: &[crate::config::AttnKind]) -> (PagePool, PrefixIndex) {
        let layout = KvLayout::plan_layers(attn, DIMS, 4, 1 << 16, StateDtypes::F32, None).unwrap();
        let index = PrefixIndex::new(&layout);
        (PagePool::new(layout).unwrap(), index)
    }

    /// Stores `pages` MLA pages of `tokens` and every group's snapshot at `boundaries` (in pages).
    fn prefill(
        pool: &mut PagePool,
        ix: &mut PrefixIndex,
        tokens: &[u32],
        pages: usize,
        boundaries: &[usize],
    ) {
        if let Some(m) = pool.layout().mla_group() {
            let ids: Vec<PageId> = (0..pages).map(|_| pool.alloc(m).unwrap()).collect();
            assert_eq!(ix.insert_mla(pool, tokens, None, &ids).unwrap(), pages);
            ids.iter().for_each(|&p| assert_eq!(pool.release(p), Ok(1)));
        }
        for &b in boundaries {
            for g in pool.layout().kda_groups() {
                let s = pool.alloc(g).unwrap();
                assert!(ix
                    .publish_snapshot(pool, &tokens[..b * 4], None, g, s)
                    .unwrap());
                pool.release(s).unwrap();
            }
        }
    }

    #[test]
    fn hashes_chain_and_see_the_extra_key() {
        let t: Vec<u32> = (0..10).collect();
        let a = page_hashes(4, &t, None);
        assert_eq!(a.len(), 2);
        assert_eq!(page_hashes(4, &t[..8], None), a);
        assert_eq!(page_hashes(4, &t[..4], None)[0], a[0]);
        let mut u = t.clone();
        u[1] = 99;
        let b = page_hashes(4, &u, None);
        assert!(
            b[0] != a[0] && b[1] != a[1],
            "a change in page 0 changes every later hash"
        );
        assert!(page_hashes(4, &t, Some(b"img"))[0] != a[0]);
        assert!(page_hashes(4, &t, Some(b"img"))[0] != page_hashes(4, &t, Some(b"img2"))[0]);
    }

    #[test]
    fn hits_need_mla_pages_and_a_full_snapshot_set_at_the_boundary() {
        let (mut pool, mut ix) = setup(&[K, K, K, M, K, K, K, M, K, K, M]);
        let t: Vec<u32> = (0..24).collect();
        prefill(&mut pool, &mut ix, &t, 5, &[2, 4]);
        // One group only at boundary 5: not a hit there.
        let g1 = pool.layout().kda_groups()[0];
        let s = pool.alloc(g1).unwrap();
        assert!(ix
            .publish_snapshot(&mut pool, &t[..20], None, g1, s)
            .unwrap());
        assert!(!ix
            .publish_snapshot(&mut pool, &t[..20], None, g1, s)
            .unwrap());
        assert_eq!(pool.refcount(s), Ok(2));
        assert!(ix
            .publish_snapshot(&mut pool, &t[..19], None, g1, s)
            .is_err());
        let hit = ix.lookup(&mut pool, &t, None).unwrap();
        assert_eq!(
            (hit.tokens, hit.mla_pages.len(), hit.snapshots.len()),
            (16, 4, 3)
        );
        assert_eq!(ix.probe(&t[..15], None), 8);
        // A different page 0 shares nothing.
        let mut u = t.clone();
        u[0] = 7;
        assert_eq!(
            ix.lookup(&mut pool, &u, None).unwrap(),
            PrefixHit::default()
        );
        assert_eq!(
            (ix.stats().hits, ix.stats().misses, ix.stats().hit_tokens),
            (1, 1, 16)
        );
        // The hit's pages are the caller's: eviction cannot take them.
        let held = ix.len();
        assert_eq!(ix.evict(&mut pool, usize::MAX).unwrap(), held - 3 - 4 - 1);
        for p in hit.mla_pages.iter().chain(&hit.snapshots) {
            assert_eq!(pool.release(*p), Ok(1));
        }
        pool.release(s).unwrap();
        assert_eq!(ix.clear(&mut pool).unwrap(), 8);
        assert_eq!(pool.free_parents(), pool.layout().parents());
    }

    #[test]
    fn a_missing_mla_page_ends_the_prefix() {
        let (mut pool, mut ix) = setup(&[K, M]);
        let t: Vec<u32> = (0..16).collect();
        let m = pool.layout().mla_group().unwrap();
        let ids = [pool.alloc(m).unwrap(), PageId::NULL, pool.alloc(m).unwrap()];
        assert_eq!(ix.insert_mla(&mut pool, &t, None, &ids).unwrap(), 2);
        prefill(&mut pool, &mut ix, &t, 0, &[1, 3]);
        assert_eq!(ix.probe(&t, None), 4);
        let s = pool.alloc(GroupId(1)).unwrap();
        assert!(matches!(
            ix.insert_mla(&mut pool, &t, None, &[s]),
            Err(KvError::WrongGroup { .. })
        ));
    }

    #[test]
    fn lru_evicts_oldest_first_and_deepest_first() {
        let (mut pool, mut ix) = setup(&[K, M]);
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        prefill(&mut pool, &mut ix, &a, 2, &[2]);
        prefill(&mut pool, &mut ix, &b, 2, &[2]);
        assert_eq!(ix.probe(&a, None), 8);
        let hit = ix.lookup(&mut pool, &a, None).unwrap(); // refresh a
        hit.mla_pages
            .iter()
            .chain(&hit.snapshots)
            .for_each(|&p| drop(pool.release(p)));
        assert_eq!(ix.evict(&mut pool, 1).unwrap(), 1); // b's deepest page
        assert_eq!(ix.probe(&b, None), 0);
        assert_eq!(ix.probe(&a, None), 8);
        assert_eq!(ix.evict(&mut pool, 2).unwrap(), 2); // the rest of b
        assert_eq!(ix.probe(&a, None), 8);
        assert_eq!(ix.len(), 3);
    }

    #[test]
    fn all_kda_and_all_mla_models() {
        let (mut pool, mut ix) = setup(&[K, K]);
        let t: Vec<u32> = (0..12).collect();
        prefill(&mut pool, &mut ix, &t, 0, &[2]);
        let hit = ix.lookup(&mut pool, &t, None).unwrap();
        assert_eq!(
            (hit.tokens, hit.mla_pages.len(), hit.snapshots.len()),
            (8, 0, 1)
        );
        assert!(ix.insert_mla(&mut pool, &t, None, &[]).is_err());

        let (mut pool, mut ix) = setup(&[M, M]);
        prefill(&mut pool, &mut ix, &t, 3, &[]);
        let hit = ix.lookup(&mut pool, &t, None).unwrap();
        assert_eq!(
            (hit.tokens, hit.mla_pages.len(), hit.snapshots.len()),
            (12, 3, 0)
        );
    }
}
