//! The page pool: binds parents to groups, hands out refcounted page IDs, and guards the bytes.
//!
//! Why the rules look the way they do:
//! - a new page first goes into a parent already bound to its group, so parents fill up and
//!   whole parents return to the free list (where any group can take them) as soon as possible;
//! - parents alias across groups (an MLA parent's bytes were a KDA snapshot a moment ago), so
//!   every page is zeroed in all planes of its group when it is allocated;
//! - shared pages are never mutated (DESIGN.md §3): a page held more than once, or published to
//!   the prefix index ([`PagePool::seal`]), refuses writes; the owner copies it first
//!   ([`PagePool::copy_page`], the copy-on-write);
//! - nothing panics on a bad ID: a double free or a stale ID is a [`KvError`].
//!
//! Storage sits behind [`KvArena`] (byte offsets: zero, copy, read, write) so a device arena
//! replaces the host one when the model runs on a GPU; typed host access ([`PagePool::slice`])
//! works on a host arena only, byte access ([`PagePool::read_bytes`]) on any.

use std::collections::BTreeSet;

use super::layout::{Field, KvLayout};
use super::{GroupId, KvError, PageId, Plane};

/// One contiguous buffer of `layout.arena_bytes()` bytes; offsets are in bytes. Offsets and
/// lengths come from the layout and are multiples of 4.
pub trait KvArena: Send {
    fn len_bytes(&self) -> usize;
    /// Sets `[offset, offset + len)` to zero.
    fn zero(&mut self, offset: usize, len: usize) -> Result<(), KvError>;
    /// Copies `len` bytes from `src` to `dst` (ranges never overlap here).
    fn copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), KvError>;
    /// Copies `out.len()` bytes at `offset` into `out`.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), KvError>;
    /// Overwrites `bytes.len()` bytes at `offset`.
    fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), KvError>;
    /// The arena as host f32s, when it lives in host memory.
    fn host(&self) -> Option<&[f32]> {
        None
    }
    fn host_mut(&mut self) -> Option<&mut [f32]> {
        None
    }
    /// `(device ordinal, base address)` when the arena lives in GPU memory.
    fn device(&self) -> Option<(usize, u64)> {
        None
    }
}

/// The pool's storage, host or device, chosen at run time by where the model runs.
pub type DynArena = Box<dyn KvArena>;

impl KvArena for DynArena {
    fn len_bytes(&self) -> usize {
        (**self).len_bytes()
    }
    fn zero(&mut self, offset: usize, len: usize) -> Result<(), KvError> {
        (**self).zero(offset, len)
    }
    fn copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), KvError> {
        (**self).copy(src, dst, len)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), KvError> {
        (**self).read(offset, out)
    }
    fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), KvError> {
        (**self).write(offset, bytes)
    }
    fn host(&self) -> Option<&[f32]> {
        (**self).host()
    }
    fn host_mut(&mut self) -> Option<&mut [f32]> {
        (**self).host_mut()
    }
    fn device(&self) -> Option<(usize, u64)> {
        (**self).device()
    }
}

/// The CPU arena: f32 everywhere (the CPU path computes in f32).
#[derive(Clone, Debug)]
pub struct HostArena {
    data: Vec<f32>,
}

impl HostArena {
    pub fn new(layout: &KvLayout) -> Result<Self, KvError> {
        if !layout.dtypes.all_f32() {
            return Err(KvError::HostDtype(layout.dtypes));
        }
        let mut data = vec![0.0f32; layout.arena_bytes() / 4];
        // Make the pool resident now: a zeroed allocation is only mapped on first write, so the
        // process would otherwise grow for as long as new pages get their first use, which looks
        // like a leak and page-faults in the serving path.
        for i in (0..data.len()).step_by(4096 / 4) {
            // SAFETY: `i` is in bounds; the volatile write keeps the store from being elided.
            unsafe { std::ptr::write_volatile(data.as_mut_ptr().add(i), 0.0) };
        }
        Ok(HostArena { data })
    }
    fn floats_mut(&mut self, offset: usize, len: usize) -> &mut [f32] {
        &mut self.data[offset / 4..(offset + len) / 4]
    }
}

impl KvArena for HostArena {
    fn len_bytes(&self) -> usize {
        self.data.len() * 4
    }
    fn zero(&mut self, offset: usize, len: usize) -> Result<(), KvError> {
        self.floats_mut(offset, len).fill(0.0);
        Ok(())
    }
    fn copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), KvError> {
        self.data.copy_within(src / 4..(src + len) / 4, dst / 4);
        Ok(())
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), KvError> {
        let floats = &self.data[offset / 4..(offset + out.len()) / 4];
        for (o, f) in out.chunks_exact_mut(4).zip(floats) {
            o.copy_from_slice(&f.to_ne_bytes());
        }
        Ok(())
    }
    fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), KvError> {
        let floats = self.floats_mut(offset, bytes.len());
        for (f, b) in floats.iter_mut().zip(bytes.chunks_exact(4)) {
            *f = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
    fn host(&self) -> Option<&[f32]> {
        Some(&self.data)
    }
    fn host_mut(&mut self) -> Option<&mut [f32]> {
        Some(&mut self.data)
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Parent {
    group: Option<GroupId>,
    live: usize,
}

/// Metrics of one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupUsage {
    pub group: GroupId,
    pub live_pages: usize,
    pub bound_parents: usize,
    /// Bytes of the parents bound to the group (all planes, slack included).
    pub bytes: usize,
}

pub struct PagePool<A: KvArena = DynArena> {
    layout: KvLayout,
    arena: A,
    /// Indexed by parent ID; entry 0 is the null parent and never bound.
    parents: Vec<Parent>,
    /// Unbound parents, popped from the end (lowest IDs first at start).
    free_parents: Vec<u32>,
    /// Per group: bound parents with at least one free slot.
    partial: Vec<BTreeSet<u32>>,
    /// Per page ID (entry 0 unused).
    refcount: Vec<u32>,
    /// Per page ID: published, immutable until freed.
    sealed: Vec<bool>,
    live: Vec<usize>,
}

impl PagePool<DynArena> {
    /// A pool over a fresh, zeroed host arena.
    pub fn new(layout: KvLayout) -> Result<Self, KvError> {
        let arena = HostArena::new(&layout)?;
        Self::with_arena(layout, Box::new(arena))
    }
}

impl<A: KvArena> PagePool<A> {
    pub fn with_arena(layout: KvLayout, arena: A) -> Result<Self, KvError> {
        if arena.len_bytes() < layout.arena_bytes() {
            return Err(KvError::ArenaTooSmall {
                have: arena.len_bytes(),
                need: layout.arena_bytes(),
            });
        }
        let pages = layout.max_page_id().0 as usize + 1;
        let groups = layout.groups().len();
        Ok(PagePool {
            parents: vec![Parent::default(); layout.parents() + 1],
            free_parents: (1..=layout.parents() as u32).rev().collect(),
            partial: vec![BTreeSet::new(); groups],
            refcount: vec![0; pages],
            sealed: vec![false; pages],
            live: vec![0; groups],
            layout,
            arena,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    pub fn arena(&self) -> &A {
        &self.arena
    }
    /// Raw arena access (device kernels write through offsets from [`Self::byte_offset`]).
    pub fn arena_mut(&mut self) -> &mut A {
        &mut self.arena
    }

    /// Host view of `(plane, page, field)`: exactly the field's elements. Refused for a device
    /// arena (read its bytes with [`Self::read_bytes`]).
    pub fn slice(&self, plane: Plane, id: PageId, field: Field) -> Result<&[f32], KvError> {
        let (off, len) = self.field_span(plane, id, field)?;
        let host = self.arena.host().ok_or(KvError::NotOnHost)?;
        Ok(&host[off / 4..(off + len) / 4])
    }

    /// Writable host view; refused for a page that is shared or sealed, and for a device arena.
    pub fn slice_mut(
        &mut self,
        plane: Plane,
        id: PageId,
        field: Field,
    ) -> Result<&mut [f32], KvError> {
        self.check_writable(id)?;
        let (off, len) = self.field_span(plane, id, field)?;
        let host = self.arena.host_mut().ok_or(KvError::NotOnHost)?;
        Ok(&mut host[off / 4..(off + len) / 4])
    }

    /// The page's bytes in every plane of its group, as `(arena offset, length)` extents: what a
    /// transfer moves for this page, whatever family the group belongs to.
    pub fn page_extents(&self, id: PageId) -> Result<Vec<(usize, usize)>, KvError> {
        let g = self.group_of(id)?;
        let group = self.layout.group(g)?;
        (0..group.layers.len())
            .map(|k| {
                Ok((
                    self.layout.page_offset(Plane(k as u16), g, id)?,
                    group.page_payload,
                ))
            })
            .collect()
    }

    /// Copies raw arena bytes at `offset` into `out` (the source side of a transfer).
    pub fn read_bytes(&self, offset: usize, out: &mut [u8]) -> Result<(), KvError> {
        if !offset.is_multiple_of(4)
            || !out.len().is_multiple_of(4)
            || offset + out.len() > self.layout.arena_bytes()
        {
            return Err(KvError::Layout(format!(
                "arena read of {} B at {offset} is outside the arena or unaligned",
                out.len()
            )));
        }
        self.arena.read(offset, out)
    }

    /// Writes raw bytes into page `id` at arena `offset` (the destination side of a transfer).
    /// The extent must lie inside the page, and the page must be writable (held once, unsealed).
    pub fn write_page_bytes(
        &mut self,
        id: PageId,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), KvError> {
        if self.refcount(id)? != 1 || self.is_sealed(id)? {
            return Err(KvError::ReadOnly(id));
        }
        let inside = self
            .page_extents(id)?
            .iter()
            .any(|&(o, l)| offset >= o && offset + bytes.len() <= o + l);
        if !inside || !offset.is_multiple_of(4) || !bytes.len().is_multiple_of(4) {
            return Err(KvError::InvalidPage(id));
        }
        self.arena.write(offset, bytes)
    }

    /// A fresh zeroed page for `group`, held once by the caller.
    pub fn alloc(&mut self, group: GroupId) -> Result<PageId, KvError> {
        let g = self.layout.group(group)?;
        let (k_g, stride, n_planes) = (g.pages_per_parent, g.page_stride, g.layers.len());
        let parent = match self.partial[group.index()].first() {
            Some(&p) => p as usize,
            None => {
                let p = self.free_parents.pop().ok_or(KvError::OutOfPages(group))? as usize;
                self.parents[p].group = Some(group);
                self.partial[group.index()].insert(p as u32);
                p
            }
        };
        let first = self.layout.page_id(parent, 0)?.0 as usize;
        let slot = (0..k_g)
            .find(|&s| self.refcount[first + s] == 0)
            .ok_or_else(|| {
                KvError::Layout(format!(
                    "parent {parent} in the partial set has no free slot"
                ))
            })?;
        let id = PageId((first + slot) as u32);
        for k in 0..n_planes {
            let off = self.layout.page_offset(Plane(k as u16), group, id)?;
            self.arena.zero(off, stride)?;
        }
        self.refcount[id.0 as usize] = 1;
        self.sealed[id.0 as usize] = false;
        self.live[group.index()] += 1;
        let p = &mut self.parents[parent];
        p.live += 1;
        if p.live == k_g {
            self.partial[group.index()].remove(&(parent as u32));
        }
        Ok(id)
    }

    /// Adds a holder; returns the new count.
    pub fn retain(&mut self, id: PageId) -> Result<u32, KvError> {
        self.live_page(id)?;
        let rc = &mut self.refcount[id.0 as usize];
        *rc = rc.checked_add(1).ok_or(KvError::RefcountOverflow(id))?;
        Ok(*rc)
    }

    /// Drops a holder; returns the remaining count. The last release frees the page, and the
    /// parent's last free page unbinds it from its group.
    pub fn release(&mut self, id: PageId) -> Result<u32, KvError> {
        let (parent, _, group) = self.live_page(id)?;
        let rc = &mut self.refcount[id.0 as usize];
        *rc -= 1;
        if *rc > 0 {
            return Ok(*rc);
        }
        self.sealed[id.0 as usize] = false;
        self.live[group.index()] -= 1;
        let p = &mut self.parents[parent];
        p.live -= 1;
        if p.live == 0 {
            p.group = None;
            self.partial[group.index()].remove(&(parent as u32));
            self.free_parents.push(parent as u32);
        } else {
            self.partial[group.index()].insert(parent as u32);
        }
        Ok(0)
    }

    /// Holders of a page: 0 for a valid ID that is free; an error for the null or an invalid ID.
    pub fn refcount(&self, id: PageId) -> Result<u32, KvError> {
        let (parent, slot) = self.layout.parent_slot(id)?;
        match self.parents[parent].group {
            None => Ok(0),
            Some(g) if slot < self.layout.group(g)?.pages_per_parent => {
                Ok(self.refcount[id.0 as usize])
            }
            Some(_) => Err(KvError::InvalidPage(id)),
        }
    }

    /// The group a live page belongs to.
    pub fn group_of(&self, id: PageId) -> Result<GroupId, KvError> {
        Ok(self.live_page(id)?.2)
    }

    /// Marks a live page immutable until it is freed (the prefix index does this on publish).
    pub fn seal(&mut self, id: PageId) -> Result<(), KvError> {
        self.live_page(id)?;
        self.sealed[id.0 as usize] = true;
        Ok(())
    }

    pub fn is_sealed(&self, id: PageId) -> Result<bool, KvError> {
        self.live_page(id)?;
        Ok(self.sealed[id.0 as usize])
    }

    /// Copies every plane of `src` into `dst` (same group; `dst` must be writable).
    pub fn copy_page(&mut self, src: PageId, dst: PageId) -> Result<(), KvError> {
        let (_, _, g) = self.live_page(src)?;
        let (_, _, gd) = self.live_page(dst)?;
        if g != gd {
            return Err(KvError::WrongGroup {
                page: dst,
                expected: g,
                actual: gd,
            });
        }
        if src == dst {
            return Err(KvError::ReadOnly(dst));
        }
        self.check_writable(dst)?;
        let gl = self.layout.group(g)?;
        let (stride, n_planes) = (gl.page_stride, gl.layers.len());
        for k in 0..n_planes {
            let s = self.layout.page_offset(Plane(k as u16), g, src)?;
            let d = self.layout.page_offset(Plane(k as u16), g, dst)?;
            self.arena.copy(s, d, stride)?;
        }
        Ok(())
    }

    /// Byte offset of `(plane, page, field)` in the arena, for a live page.
    pub fn byte_offset(&self, plane: Plane, id: PageId, field: Field) -> Result<usize, KvError> {
        let g = self.live_page(id)?.2;
        self.layout.byte_offset(plane, g, id, field)
    }

    /// Pages `group` could still allocate: free slots of its parents plus every free parent.
    pub fn free_pages(&self, group: GroupId) -> Result<usize, KvError> {
        let k = self.layout.group(group)?.pages_per_parent;
        let partial: usize = self.partial[group.index()]
            .iter()
            .map(|&p| k - self.parents[p as usize].live)
            .sum();
        Ok(self.free_parents.len() * k + partial)
    }

    /// Pages `group` would have with the whole arena: `N · K_g`.
    pub fn total_pages(&self, group: GroupId) -> Result<usize, KvError> {
        Ok(self.layout.parents() * self.layout.group(group)?.pages_per_parent)
    }

    pub fn free_parents(&self) -> usize {
        self.free_parents.len()
    }

    /// Bound parents with at least one live page for which `counts` holds.
    pub fn parents_holding(&self, mut counts: impl FnMut(PageId) -> bool) -> usize {
        let k_max = self.layout.max_pages_per_parent();
        (1..self.parents.len())
            .filter(|&p| {
                let Some(g) = self.parents[p].group else {
                    return false;
                };
                let k = self.layout.group(g).map_or(0, |g| g.pages_per_parent);
                let first = 1 + (p - 1) * k_max;
                (first..first + k).any(|id| self.refcount[id] > 0 && counts(PageId(id as u32)))
            })
            .count()
    }

    pub fn usage(&self) -> Vec<GroupUsage> {
        let mut bound = vec![0usize; self.live.len()];
        for p in &self.parents {
            if let Some(g) = p.group {
                bound[g.index()] += 1;
            }
        }
        self.layout
            .group_ids()
            .map(|g| GroupUsage {
                group: g,
                live_pages: self.live[g.index()],
                bound_parents: bound[g.index()],
                bytes: bound[g.index()] * self.layout.parent_bytes(),
            })
            .collect()
    }

    /// `(group, bytes of its bound parents)` for metrics.
    pub fn used_bytes_by_group(&self) -> Vec<(GroupId, usize)> {
        self.usage()
            .into_iter()
            .map(|u| (u.group, u.bytes))
            .collect()
    }

    /// `(parent, slot, group)` of a live page, or why it is not one.
    fn live_page(&self, id: PageId) -> Result<(usize, usize, GroupId), KvError> {
        let (parent, slot) = self.layout.parent_slot(id)?;
        let g = self.parents[parent].group.ok_or(KvError::NotLive(id))?;
        if slot >= self.layout.group(g)?.pages_per_parent {
            return Err(KvError::InvalidPage(id));
        }
        if self.refcount[id.0 as usize] == 0 {
            return Err(KvError::NotLive(id));
        }
        Ok((parent, slot, g))
    }

    fn check_writable(&self, id: PageId) -> Result<(), KvError> {
        self.live_page(id)?;
        if self.refcount[id.0 as usize] > 1 || self.sealed[id.0 as usize] {
            return Err(KvError::ReadOnly(id));
        }
        Ok(())
    }

    fn field_span(
        &self,
        plane: Plane,
        id: PageId,
        field: Field,
    ) -> Result<(usize, usize), KvError> {
        let g = self.live_page(id)?.2;
        let (_, len) = self.layout.field_range(g, field)?;
        Ok((self.layout.byte_offset(plane, g, id, field)?, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AttnKind::{Kda as K, Mla as M};
    use crate::kv::layout::{GroupKind, KvDims, StateDtypes};

    /// 3 MLA + 8 KDA layers: groups MLA(3) + KDA(3, 3, 2); K_mla = 3, K_kda = 2; 6 parents.
    pub(crate) fn small_pool() -> PagePool {
        let attn = [K, K, K, M, K, K, K, M, K, K, M];
        let dims = KvDims {
            kda_heads: 1,
            kda_head_dim: 4,
            conv_kernel: 2,
            latent_dim: 6,
        };
        let layout =
            KvLayout::plan_layers(&attn, dims, 4, 7 * 864, StateDtypes::F32, None).unwrap();
        assert_eq!(layout.parents(), 6);
        PagePool::new(layout).unwrap()
    }

    fn fields(pool: &PagePool, g: GroupId) -> &'static [Field] {
        match pool.layout().group(g).unwrap().kind {
            GroupKind::Mla => &[Field::Latent],
            GroupKind::Kda => &[Field::Conv, Field::Recurrent],
        }
    }

    /// Every element of every field in every plane of a page.
    fn contents(pool: &PagePool, id: PageId) -> Vec<f32> {
        let g = pool.group_of(id).unwrap();
        let mut out = Vec::new();
        for k in 0..pool.layout().group(g).unwrap().layers.len() {
            for &f in fields(pool, g) {
                out.extend_from_slice(pool.slice(Plane(k as u16), id, f).unwrap());
            }
        }
        out
    }

    fn fill(pool: &mut PagePool, id: PageId, v: f32) {
        let g = pool.group_of(id).unwrap();
        for k in 0..pool.layout().group(g).unwrap().layers.len() {
            for &f in fields(pool, g) {
                pool.slice_mut(Plane(k as u16), id, f).unwrap().fill(v);
            }
        }
    }

    #[test]
    fn live_pages_never_overlap_and_reuse_is_zeroed() {
        let mut pool = small_pool();
        let groups: Vec<GroupId> = pool.layout().group_ids().collect();
        let mut live: Vec<(PageId, f32)> = Vec::new();
        let mut i = 0;
        // Fill the arena round-robin over groups, each page with its own value.
        let n = groups.len();
        while let Some(g) = (0..n)
            .map(|j| groups[(i + j) % n])
            .find(|&g| pool.free_pages(g).unwrap() > 0)
        {
            i += 1;
            let id = pool.alloc(g).unwrap();
            assert!(contents(&pool, id).iter().all(|&x| x == 0.0));
            let v = live.len() as f32 + 1.0;
            fill(&mut pool, id, v);
            live.push((id, v));
            for &(other, w) in &live {
                assert!(
                    contents(&pool, other).iter().all(|&x| x == w),
                    "{other} changed"
                );
            }
        }
        assert_eq!(pool.free_parents(), 0);
        for &g in &groups {
            assert_eq!(pool.alloc(g), Err(KvError::OutOfPages(g)));
        }
        // Free every page of one KDA parent and reuse it for MLA: it comes back zeroed.
        let kda = groups[1];
        let victims: Vec<PageId> = live
            .iter()
            .filter(|(p, _)| pool.group_of(*p) == Ok(kda))
            .map(|x| x.0)
            .collect();
        for &p in &victims {
            pool.release(p).unwrap();
        }
        live.retain(|(p, _)| !victims.contains(p));
        let fresh = pool.alloc(groups[0]).unwrap();
        assert!(contents(&pool, fresh).iter().all(|&x| x == 0.0));
        fill(&mut pool, fresh, -1.0);
        for &(other, w) in &live {
            assert!(contents(&pool, other).iter().all(|&x| x == w));
        }
    }

    #[test]
    fn fills_bound_parents_first_and_unbinds_empty_ones() {
        let mut pool = small_pool();
        let mla = GroupId(0);
        let a = pool.alloc(mla).unwrap();
        let b = pool.alloc(mla).unwrap();
        assert_eq!(
            pool.layout().parent_slot(a).unwrap().0,
            pool.layout().parent_slot(b).unwrap().0
        );
        assert_eq!(
            (pool.free_parents(), pool.free_pages(mla).unwrap()),
            (5, 16)
        );
        let s = pool.alloc(GroupId(1)).unwrap();
        assert_eq!(pool.free_parents(), 4);
        assert_eq!(
            pool.usage()[0],
            GroupUsage {
                group: mla,
                live_pages: 2,
                bound_parents: 1,
                bytes: 864
            }
        );
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        pool.release(s).unwrap();
        assert_eq!(pool.free_parents(), 6);
        assert!(pool.used_bytes_by_group().iter().all(|&(_, b)| b == 0));
        for g in pool.layout().group_ids().collect::<Vec<_>>() {
            assert_eq!(pool.free_pages(g).unwrap(), pool.total_pages(g).unwrap());
        }
    }

    #[test]
    fn refcounts_and_errors_instead_of_panics() {
        let mut pool = small_pool();
        let a = pool.alloc(GroupId(1)).unwrap();
        assert_eq!(pool.retain(a), Ok(2));
        assert_eq!(
            pool.slice_mut(Plane(0), a, Field::Conv).err(),
            Some(KvError::ReadOnly(a))
        );
        assert_eq!(pool.release(a), Ok(1));
        assert!(pool.slice_mut(Plane(0), a, Field::Conv).is_ok());
        assert_eq!(pool.release(a), Ok(0));
        assert_eq!(pool.release(a), Err(KvError::NotLive(a)));
        assert_eq!(pool.retain(a), Err(KvError::NotLive(a)));
        assert_eq!(pool.refcount(a), Ok(0));
        assert_eq!(pool.release(PageId::NULL), Err(KvError::NullPage));
        let past = PageId(pool.layout().max_page_id().0 + 1);
        assert_eq!(pool.release(past), Err(KvError::InvalidPage(past)));
        // A slot an MLA-bound parent has but no KDA parent has (K_mla 3 > K_kda 2).
        let m = pool.alloc(GroupId(0)).unwrap();
        let third = PageId(m.0 + 2);
        assert_eq!(pool.refcount(third), Ok(0));
        let s = pool.alloc(GroupId(2)).unwrap();
        let bad = PageId(s.0 + 2);
        assert_eq!(pool.refcount(bad), Err(KvError::InvalidPage(bad)));
        assert_eq!(pool.release(bad), Err(KvError::InvalidPage(bad)));
        assert!(pool.slice(Plane(0), m, Field::Conv).is_err());
        assert!(pool.slice(Plane(3), m, Field::Latent).is_err());
        assert_eq!(
            pool.alloc(GroupId(9)),
            Err(KvError::NoSuchGroup(GroupId(9)))
        );
        pool.seal(s).unwrap();
        assert_eq!(
            pool.slice_mut(Plane(0), s, Field::Recurrent).err(),
            Some(KvError::ReadOnly(s))
        );
    }

    #[test]
    fn copy_on_write_copies_every_plane() {
        let mut pool = small_pool();
        let g = GroupId(2);
        let src = pool.alloc(g).unwrap();
        for k in 0..3u16 {
            for (j, x) in pool
                .slice_mut(Plane(k), src, Field::Recurrent)
                .unwrap()
                .iter_mut()
                .enumerate()
            {
                *x = (k as usize * 100 + j) as f32;
            }
            pool.slice_mut(Plane(k), src, Field::Conv)
                .unwrap()
                .fill(k as f32 + 0.5);
        }
        pool.seal(src).unwrap();
        let dst = pool.alloc(g).unwrap();
        pool.copy_page(src, dst).unwrap();
        assert_eq!(contents(&pool, src), contents(&pool, dst));
        assert_eq!(pool.copy_page(dst, src), Err(KvError::ReadOnly(src)));
        let other = pool.alloc(GroupId(1)).unwrap();
        assert!(matches!(
            pool.copy_page(src, other),
            Err(KvError::WrongGroup { .. })
        ));
        assert_eq!(pool.byte_offset(Plane(1), dst, Field::Conv).unwrap() % 4, 0);
    }
}
