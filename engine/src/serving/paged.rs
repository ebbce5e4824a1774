//! A sequence whose state lives in the flat page pool, and the moves between the pool and the
//! forward pass's working state.
//!
//! The pool is the state's only home between steps: an MLA page table (one page per
//! `page_tokens` tokens of latent history, all MLA layers through the planes) and, per KDA group,
//! the page holding the state at the sequence's current length. For a step, the CPU path gathers
//! what the step reads into a scratch `SequenceState`, runs the forward pass, and scatters the new
//! rows and the new KDA state back. A KDA page that is shared (published to the prefix cache, or
//! restored from it) is never written: the step writes a fresh page and drops its reference to the
//! old one, which is the copy-on-write of the design.

use crate::config::ModelConfig;
use crate::kv::{Field, GroupId, KvError, KvLayout, PageId, PagePool, Plane};
use crate::state::{KdaState, LayerState, MlaState, SequenceState};

/// Where each layer's state lives in the pool.
#[derive(Clone, Debug)]
pub struct LayerSlots {
    /// Per layer: its group and plane.
    pub(crate) slots: Vec<(GroupId, Plane)>,
    pub(crate) mla_group: Option<GroupId>,
    pub(crate) kda_groups: Vec<GroupId>,
    page_tokens: usize,
    rank: usize,
    latent: usize,
}

impl LayerSlots {
    pub fn new(cfg: &ModelConfig, layout: &KvLayout) -> Self {
        LayerSlots {
            slots: (0..cfg.num_layers())
                .map(|l| layout.locate(l).expect("every layer is in a group"))
                .collect(),
            mla_group: layout.mla_group(),
            kda_groups: layout.kda_groups(),
            page_tokens: layout.page_tokens,
            rank: cfg.mla.kv_lora_rank,
            latent: cfg.mla.latent_dim(),
        }
    }

    fn kda_index(&self, g: GroupId) -> usize {
        self.kda_groups
            .iter()
            .position(|&x| x == g)
            .expect("a KDA group")
    }
}

/// Pages one sequence holds (one reference each).
#[derive(Clone, Debug, Default)]
pub struct PagedSeq {
    /// Tokens whose state is in the pool.
    pub len: usize,
    pub mla_pages: Vec<PageId>,
    /// Per KDA group (in `kda_groups` order): the state at `len`; NULL before the first token.
    pub kda_pages: Vec<PageId>,
}

impl PagedSeq {
    pub fn new(slots: &LayerSlots) -> Self {
        PagedSeq {
            len: 0,
            mla_pages: Vec::new(),
            kda_pages: vec![PageId::NULL; slots.kda_groups.len()],
        }
    }

    /// Every page this sequence references.
    pub fn pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.mla_pages
            .iter()
            .chain(&self.kda_pages)
            .copied()
            .filter(|p| !p.is_null())
    }

    /// Drops every reference; the sequence is empty afterwards.
    pub fn release_all(&mut self, pool: &mut PagePool) -> Result<(), KvError> {
        let pages: Vec<PageId> = self.pages().collect();
        self.mla_pages.clear();
        self.kda_pages.iter_mut().for_each(|p| *p = PageId::NULL);
        self.len = 0;
        for p in pages {
            pool.release(p)?;
        }
        Ok(())
    }

    /// Pages this sequence must allocate to grow to `new_len` tokens (MLA pages it lacks, plus a
    /// fresh state page per KDA group whose current page is absent or shared).
    pub fn pages_needed(&self, slots: &LayerSlots, pool: &PagePool, new_len: usize) -> usize {
        let mla = if slots.mla_group.is_some() {
            new_len
                .div_ceil(slots.page_tokens)
                .saturating_sub(self.mla_pages.len())
        } else {
            0
        };
        mla + self
            .kda_pages
            .iter()
            .filter(|&&p| !writable(pool, p))
            .count()
    }

    /// Allocates what growing to `new_len` needs; on failure nothing stays allocated.
    pub fn reserve(
        &mut self,
        slots: &LayerSlots,
        pool: &mut PagePool,
        new_len: usize,
    ) -> Result<Reserved, KvError> {
        let mut fresh_mla = Vec::new();
        let mut fresh_kda = vec![PageId::NULL; self.kda_pages.len()];
        let result = (|| {
            if let Some(g) = slots.mla_group {
                while (self.mla_pages.len() + fresh_mla.len()) * slots.page_tokens < new_len {
                    fresh_mla.push(pool.alloc(g)?);
                }
            }
            for (i, &g) in slots.kda_groups.iter().enumerate() {
                if !writable(pool, self.kda_pages[i]) {
                    fresh_kda[i] = pool.alloc(g)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            for p in fresh_mla.iter().chain(&fresh_kda).filter(|p| !p.is_null()) {
                let _ = pool.release(*p);
            }
            return Err(e);
        }
        self.mla_pages.extend(fresh_mla);
        Ok(Reserved { kda_out: fresh_kda })
    }

    /// The working state for a step: KDA state from the current pages (zeros at the start), MLA
    /// latent rows `0..len` gathered from the page table.
    pub fn gather(
        &self,
        slots: &LayerSlots,
        pool: &PagePool,
        cfg: &ModelConfig,
    ) -> Result<SequenceState, KvError> {
        let mut st = SequenceState::new(cfg);
        st.len = self.len;
        let p = slots.page_tokens;
        for (l, layer) in st.layers.iter_mut().enumerate() {
            let (g, plane) = slots.slots[l];
            match layer {
                LayerState::Kda(k) => {
                    let page = self.kda_pages[slots.kda_index(g)];
                    if !page.is_null() {
                        k.conv
                            .copy_from_slice(pool.slice(plane, page, Field::Conv)?);
                        k.recurrent
                            .copy_from_slice(pool.slice(plane, page, Field::Recurrent)?);
                    }
                }
                LayerState::Mla(m) => {
                    m.ckv.reserve(self.len * slots.rank);
                    m.kpe.reserve(self.len * (slots.latent - slots.rank));
                    for (i, &page) in self.mla_pages.iter().enumerate() {
                        let rows = p.min(self.len.saturating_sub(i * p));
                        if rows == 0 {
                            break;
                        }
                        let data = pool.slice(plane, page, Field::Latent)?;
                        for row in data.chunks_exact(slots.latent).take(rows) {
                            m.ckv.extend_from_slice(&row[..slots.rank]);
                            m.kpe.extend_from_slice(&row[slots.rank..]);
                        }
                    }
                }
            }
        }
        Ok(st)
    }

    /// Writes a step's results back: latent rows `len..st.len` into the page table, the KDA state
    /// into each group's page (the fresh one where `reserve` made one, releasing the old page).
    pub fn scatter(
        &mut self,
        slots: &LayerSlots,
        pool: &mut PagePool,
        st: &SequenceState,
        reserved: Reserved,
    ) -> Result<(), KvError> {
        let p = slots.page_tokens;
        let targets: Vec<PageId> = self
            .kda_pages
            .iter()
            .zip(&reserved.kda_out)
            .map(|(&cur, &fresh)| if fresh.is_null() { cur } else { fresh })
            .collect();
        for (l, layer) in st.layers.iter().enumerate() {
            let (g, plane) = slots.slots[l];
            match layer {
                LayerState::Kda(KdaState { conv, recurrent }) => {
                    let page = targets[slots.kda_index(g)];
                    pool.slice_mut(plane, page, Field::Conv)?
                        .copy_from_slice(conv);
                    pool.slice_mut(plane, page, Field::Recurrent)?
                        .copy_from_slice(recurrent);
                }
                LayerState::Mla(MlaState { ckv, kpe }) => {
                    let (rank, pe) = (slots.rank, slots.latent - slots.rank);
                    for t in self.len..st.len {
                        let page = self.mla_pages[t / p];
                        let row = &mut pool.slice_mut(plane, page, Field::Latent)?
                            [(t % p) * slots.latent..(t % p + 1) * slots.latent];
                        row[..rank].copy_from_slice(&ckv[t * rank..(t + 1) * rank]);
                        row[rank..].copy_from_slice(&kpe[t * pe..(t + 1) * pe]);
                    }
                }
            }
        }
        for (i, fresh) in reserved.kda_out.into_iter().enumerate() {
            if !fresh.is_null() {
                let old = std::mem::replace(&mut self.kda_pages[i], fresh);
                if !old.is_null() {
                    pool.release(old)?;
                }
            }
        }
        self.len = st.len;
        Ok(())
    }
}

impl PagedSeq {
    /// Takes the fresh state pages of `reserved` as the sequence's own (for a reservation that
    /// will be filled by a transfer rather than by a step).
    pub fn adopt(&mut self, reserved: Reserved) {
        for (cur, fresh) in self.kda_pages.iter_mut().zip(reserved.kda_out) {
            if !fresh.is_null() {
                debug_assert!(cur.is_null());
                *cur = fresh;
            }
        }
    }
}

/// Pages `reserve` allocated for one step.
#[derive(Debug)]
#[must_use = "pass to scatter, or release with abandon"]
pub struct Reserved {
    kda_out: Vec<PageId>,
}

impl Reserved {
    /// Releases the fresh state pages of a step that did not run.
    pub fn abandon(self, pool: &mut PagePool) {
        for p in self.kda_out.into_iter().filter(|p| !p.is_null()) {
            let _ = pool.release(p);
        }
    }
}

/// A page this sequence may write in place: its own, unshared and unpublished.
fn writable(pool: &PagePool, page: PageId) -> bool {
    !page.is_null()
        && pool.refcount(page).is_ok_and(|r| r == 1)
        && !pool.is_sealed(page).unwrap_or(true)
}
