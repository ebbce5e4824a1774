//! Property test of the pool and the prefix index together: random interleavings of alloc,
//! retain, release, writes, publish, lookup and evict across groups, against a plain model of
//! who holds what. Checked after every step: refcounts equal the model's holders (so nothing
//! leaks, nothing is freed twice, no count goes below zero), published pages keep their bytes,
//! lookups return exactly the longest boundary with complete MLA pages and snapshot set; at the
//! end, releasing everything and clearing the index gives every page back.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use crate::config::AttnKind::{self, Kda as K, Mla as M};
use crate::kv::layout::{Field, GroupKind, KvDims, KvLayout, StateDtypes};
use crate::kv::pool::PagePool;
use crate::kv::prefix::PrefixIndex;
use crate::kv::{GroupId, KvError, PageId, Plane};

const P: usize = 4;
const DIMS: KvDims = KvDims {
    kda_heads: 1,
    kda_head_dim: 4,
    conv_kernel: 2,
    latent_dim: 6,
};

fn layout(which: u8) -> KvLayout {
    let (attn, parents): (&[AttnKind], usize) = match which % 4 {
        0 => (&[K, K, K, M, K, K, K, M, K, K, M], 6),
        1 => (&[K, K, K], 8),
        2 => (&[M, M], 8),
        _ => (&[K, M], 5),
    };
    let probe = KvLayout::plan_layers(attn, DIMS, P, 1 << 20, StateDtypes::F32, None).unwrap();
    let l = KvLayout::plan_layers(
        attn,
        DIMS,
        P,
        (parents + 1) * probe.parent_bytes(),
        StateDtypes::F32,
        None,
    );
    let l = l.unwrap();
    assert_eq!(l.parents(), parents);
    l
}

/// Prompts share their first page by family `f` and differ after it by variant `v`.
fn tokens(f: u8, v: u8, pages: u8) -> Vec<u32> {
    (0..pages as usize * P)
        .map(|i| {
            if i < P {
                f as u32 * 100 + i as u32
            } else {
                1000 * (v as u32 + 1) + i as u32
            }
        })
        .collect()
}

fn fields(kind: GroupKind) -> &'static [Field] {
    match kind {
        GroupKind::Mla => &[Field::Latent],
        GroupKind::Kda => &[Field::Conv, Field::Recurrent],
    }
}

fn contents(pool: &PagePool, id: PageId) -> Vec<f32> {
    let g = pool
        .layout()
        .group(pool.group_of(id).unwrap())
        .unwrap()
        .clone();
    let mut out = Vec::new();
    for k in 0..g.layers.len() {
        for &f in fields(g.kind) {
            out.extend_from_slice(pool.slice(Plane(k as u16), id, f).unwrap());
        }
    }
    out
}

fn fill(pool: &mut PagePool, id: PageId, v: f32) -> Result<(), KvError> {
    let g = pool.layout().group(pool.group_of(id)?)?.clone();
    for k in 0..g.layers.len() {
        for &f in fields(g.kind) {
            pool.slice_mut(Plane(k as u16), id, f)?.fill(v);
        }
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(u8),
    Retain(u8),
    Release(u8),
    ReleaseAny(u32),
    Write(u8),
    InsertMla {
        f: u8,
        v: u8,
        pages: u8,
    },
    Publish {
        f: u8,
        v: u8,
        pages: u8,
        g: u8,
    },
    PublishHeld {
        i: u8,
        f: u8,
        v: u8,
        pages: u8,
        g: u8,
    },
    Lookup {
        f: u8,
        v: u8,
        pages: u8,
        tail: u8,
    },
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let fv = (0u8..2, 0u8..3, 1u8..5);
    prop_oneof![
        3 => any::<u8>().prop_map(Op::Alloc),
        2 => any::<u8>().prop_map(Op::Retain),
        4 => any::<u8>().prop_map(Op::Release),
        2 => (0u32..40).prop_map(Op::ReleaseAny),
        2 => any::<u8>().prop_map(Op::Write),
        3 => fv.clone().prop_map(|(f, v, pages)| Op::InsertMla { f, v, pages }),
        4 => (fv.clone(), any::<u8>()).prop_map(|((f, v, pages), g)| Op::Publish { f, v, pages, g }),
        1 => (any::<u8>(), fv.clone(), any::<u8>())
            .prop_map(|(i, (f, v, pages), g)| Op::PublishHeld { i, f, v, pages, g }),
        4 => (fv, 0u8..P as u8).prop_map(|((f, v, pages), tail)| Op::Lookup { f, v, pages, tail }),
        2 => (0u8..6).prop_map(Op::Evict),
    ]
}

struct World {
    pool: PagePool,
    ix: PrefixIndex,
    /// References the "requests" hold, one entry per reference.
    held: Vec<PageId>,
    /// Bytes of every page the index holds, as they were when it took it.
    published: HashMap<PageId, Vec<f32>>,
    /// What each page the index took was stored for: MLA prefix, or (boundary prefix, group).
    mla_of: HashMap<PageId, Vec<u32>>,
    snap_of: HashMap<PageId, (Vec<u32>, GroupId)>,
    next_value: f32,
}

impl World {
    fn index_pages(&self) -> HashSet<PageId> {
        self.ix.pages().collect()
    }

    fn value(&mut self) -> f32 {
        self.next_value += 1.0;
        self.next_value
    }

    fn alloc_filled(&mut self, g: GroupId) -> Option<PageId> {
        match self.pool.alloc(g) {
            Ok(id) => {
                let v = self.value();
                fill(&mut self.pool, id, v).unwrap();
                self.held.push(id);
                Some(id)
            }
            Err(e) => {
                assert_eq!(e, KvError::OutOfPages(g));
                assert_eq!(self.pool.free_pages(g).unwrap(), 0);
                None
            }
        }
    }

    /// The hit the model predicts for `t`: the longest boundary with every MLA page up to it
    /// and a snapshot of every KDA group at it, among the pages the index holds now.
    fn expected_hit(&self, t: &[u32]) -> usize {
        let live = self.index_pages();
        let mla: HashSet<&Vec<u32>> = self
            .mla_of
            .iter()
            .filter(|(p, _)| live.contains(p))
            .map(|x| x.1)
            .collect();
        let snaps: HashSet<(&Vec<u32>, GroupId)> = self
            .snap_of
            .iter()
            .filter(|(p, _)| live.contains(p))
            .map(|(_, (t, g))| (t, *g))
            .collect();
        let has_mla = self.pool.layout().mla_group().is_some();
        let kda = self.pool.layout().kda_groups();
        let mut best = 0;
        for b in 1..=t.len() / P {
            let prefix = t[..b * P].to_vec();
            if has_mla && !mla.contains(&prefix) {
                break;
            }
            if kda.iter().all(|&g| snaps.contains(&(&prefix, g))) {
                best = b * P;
            }
        }
        best
    }

    fn step(&mut self, op: &Op) {
        let groups: Vec<GroupId> = self.pool.layout().group_ids().collect();
        let kda = self.pool.layout().kda_groups();
        let mla = self.pool.layout().mla_group();
        let pick = |i: u8, n: usize| (n > 0).then(|| i as usize % n);
        match *op {
            Op::Alloc(g) => {
                self.alloc_filled(groups[g as usize % groups.len()]);
            }
            Op::Retain(i) => {
                if let Some(i) = pick(i, self.held.len()) {
                    let id = self.held[i];
                    self.pool.retain(id).unwrap();
                    self.held.push(id);
                }
            }
            Op::Release(i) => {
                if let Some(i) = pick(i, self.held.len()) {
                    let id = self.held.swap_remove(i);
                    self.pool.release(id).unwrap();
                }
            }
            Op::ReleaseAny(raw) => {
                let id = PageId(raw);
                if let Some(i) = self.held.iter().position(|&p| p == id) {
                    self.held.swap_remove(i);
                    self.pool.release(id).unwrap();
                } else if !self.index_pages().contains(&id) {
                    // Nobody holds it: a double free or a bogus id, which must be refused.
                    assert!(self.pool.release(id).is_err(), "released unheld {id}");
                }
            }
            Op::Write(i) => {
                if let Some(i) = pick(i, self.held.len()) {
                    let id = self.held[i];
                    let v = self.value();
                    match fill(&mut self.pool, id, v) {
                        Ok(()) => {
                            assert_eq!(self.pool.refcount(id), Ok(1));
                            assert!(!self.index_pages().contains(&id));
                        }
                        Err(e) => {
                            assert_eq!(e, KvError::ReadOnly(id));
                            assert!(
                                self.pool.refcount(id).unwrap() > 1
                                    || self.pool.is_sealed(id).unwrap()
                            );
                        }
                    }
                }
            }
            Op::InsertMla { f, v, pages } => {
                let t = tokens(f, v, pages);
                let Some(m) = mla else {
                    assert!(self.ix.insert_mla(&mut self.pool, &t, None, &[]).is_err());
                    return;
                };
                let ids: Vec<PageId> = (0..pages).map_while(|_| self.alloc_filled(m)).collect();
                let before = self.index_pages();
                let n = self.ix.insert_mla(&mut self.pool, &t, None, &ids).unwrap();
                let mut stored = 0;
                for (j, &p) in ids.iter().enumerate() {
                    if self.index_pages().contains(&p) && !before.contains(&p) {
                        self.mla_of.insert(p, t[..(j + 1) * P].to_vec());
                        stored += 1;
                    }
                }
                assert_eq!(n, stored);
            }
            Op::Publish { f, v, pages, g } => {
                let Some(&g) = pick(g, kda.len()).map(|i| &kda[i]) else {
                    return;
                };
                let t = tokens(f, v, pages);
                if let Some(id) = self.alloc_filled(g) {
                    if self
                        .ix
                        .publish_snapshot(&mut self.pool, &t, None, g, id)
                        .unwrap()
                    {
                        self.snap_of.insert(id, (t, g));
                    }
                }
            }
            Op::PublishHeld { i, f, v, pages, g } => {
                let (Some(i), Some(gi)) = (pick(i, self.held.len()), pick(g, groups.len())) else {
                    return;
                };
                let (id, g, t) = (self.held[i], groups[gi], tokens(f, v, pages));
                if self.index_pages().contains(&id) {
                    return; // publishing one page at two boundaries is a caller bug the model skips
                }
                match self.ix.publish_snapshot(&mut self.pool, &t, None, g, id) {
                    Ok(true) => {
                        assert!(kda.contains(&g) && self.pool.group_of(id) == Ok(g));
                        self.snap_of.insert(id, (t, g));
                    }
                    Ok(false) => {}
                    Err(_) => assert!(!kda.contains(&g) || self.pool.group_of(id) != Ok(g)),
                }
            }
            Op::Lookup { f, v, pages, tail } => {
                let mut t = tokens(f, v, pages);
                t.extend((0..tail as u32).map(|x| 7000 + x));
                let want = self.expected_hit(&t);
                assert_eq!(self.ix.probe(&t, None), want);
                let hit = self.ix.lookup(&mut self.pool, &t, None).unwrap();
                assert_eq!(hit.tokens, want);
                assert_eq!(hit.tokens % P, 0);
                let n_mla = if mla.is_some() { hit.tokens / P } else { 0 };
                assert_eq!(hit.mla_pages.len(), n_mla);
                for (j, p) in hit.mla_pages.iter().enumerate() {
                    assert_eq!(self.mla_of[p], t[..(j + 1) * P]);
                }
                if hit.tokens == 0 {
                    assert!(hit.snapshots.is_empty());
                } else {
                    assert_eq!(hit.snapshots.len(), kda.len());
                    for (p, &g) in hit.snapshots.iter().zip(&kda) {
                        assert_eq!(self.snap_of[p], (t[..hit.tokens].to_vec(), g));
                        assert_eq!(self.pool.group_of(*p), Ok(g));
                    }
                }
                self.held.extend(hit.mla_pages.iter().chain(&hit.snapshots));
            }
            Op::Evict(n) => {
                let only_index = self
                    .ix
                    .pages()
                    .filter(|&p| self.pool.refcount(p) == Ok(1))
                    .count();
                let released = self.ix.evict(&mut self.pool, n as usize).unwrap();
                assert_eq!(released, only_index.min(n as usize));
            }
        }
    }

    fn check(&mut self) {
        let in_index: Vec<PageId> = self.ix.pages().collect();
        let max = self.pool.layout().max_page_id().0;
        for raw in 1..=max {
            let id = PageId(raw);
            let want = self.held.iter().filter(|&&p| p == id).count()
                + in_index.iter().filter(|&&p| p == id).count();
            match self.pool.refcount(id) {
                Ok(rc) => assert_eq!(rc as usize, want, "refcount of {id}"),
                Err(e) => assert_eq!((e, want), (KvError::InvalidPage(id), 0)),
            }
        }
        let live: HashSet<PageId> = in_index.iter().copied().collect();
        self.published.retain(|p, _| live.contains(p));
        self.mla_of.retain(|p, _| live.contains(p));
        self.snap_of.retain(|p, _| live.contains(p));
        for &p in &in_index {
            let now = contents(&self.pool, p);
            let then = self.published.entry(p).or_insert_with(|| now.clone());
            assert_eq!(*then, now, "{p} changed after it was published");
            assert_eq!(self.pool.is_sealed(p), Ok(true));
        }
        for g in self.pool.layout().group_ids() {
            assert!(self.pool.free_pages(g).unwrap() <= self.pool.total_pages(g).unwrap());
        }
        // Every bound parent holds a live page; the parents of the held pages are those holding
        // a page the test holds.
        let layout = self.pool.layout();
        assert_eq!(
            self.pool.parents_holding(|_| true),
            layout.parents() - self.pool.free_parents()
        );
        let held_parents: HashSet<usize> = self
            .held
            .iter()
            .map(|&p| layout.parent_slot(p).unwrap().0)
            .collect();
        assert_eq!(
            self.pool.parents_holding(|p| self.held.contains(&p)),
            held_parents.len()
        );
        let only_index = in_index
            .iter()
            .filter(|&&p| self.pool.refcount(p) == Ok(1))
            .count();
        assert_eq!(self.ix.evictable(&self.pool).count(), only_index);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn pool_and_index_keep_their_invariants(which in 0u8..4, ops in prop::collection::vec(op(), 1..80)) {
        let layout = layout(which);
        let ix = PrefixIndex::new(&layout);
        let mut w = World {
            pool: PagePool::new(layout).unwrap(),
            ix,
            held: Vec::new(),
            published: HashMap::new(),
            mla_of: HashMap::new(),
            snap_of: HashMap::new(),
            next_value: 0.0,
        };
        for op in &ops {
            w.step(op);
            w.check();
        }
        for id in std::mem::take(&mut w.held) {
            w.pool.release(id).unwrap();
        }
        w.ix.clear(&mut w.pool).unwrap();
        prop_assert!(w.ix.is_empty());
        prop_assert_eq!(w.pool.free_parents(), w.pool.layout().parents());
        for g in w.pool.layout().group_ids() {
            prop_assert_eq!(w.pool.free_pages(g).unwrap(), w.pool.total_pages(g).unwrap());
        }
        for raw in 1..=w.pool.layout().max_page_id().0 {
            prop_assert_eq!(w.pool.refcount(PageId(raw)), Ok(0));
            prop_assert!(w.pool.release(PageId(raw)).is_err());
        }
    }
}
