//! A sequence whose state lives in the flat page pool, and the moves between the pool and the
//! forward pass's working state.
//!
//! The pool is the state's only home between steps: an MLA page table (one page per
//! `page_tokens` tokens of latent history, all MLA layers through the planes) and, per KDA group,
//! the page holding the state at the sequence's current length. For a step, the CPU path gathers
//! what the step reads into a scratch `SequenceState`, runs the forward pass, and scatters the new
//! rows and the new KDA state back. A KDA page that is shared (published to the prefix cache, or
//! restored from it) is never written: the step writes a fresh page and drops its reference to the
//! old one, which is the copy-on-write of the design. On a GPU the pool's arena is in device
//! memory and the step reads and writes the pages themselves ([`StepPages`]): nothing is gathered.

use crate::config::ModelConfig;
use crate::kv::{Field, GroupId, KvError, KvLayout, PageId, PagePool, Plane};
use crate::model::{PagedLayer, PagedState};
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
        self.commit(pool, reserved, st.len)
    }

    /// After a step that wrote its state in place in the pool ([`StepPages`]): the fresh state
    /// pages become the sequence's (the old ones are released) and its length is `new_len`.
    pub fn commit(
        &mut self,
        pool: &mut PagePool,
        reserved: Reserved,
        new_len: usize,
    ) -> Result<(), KvError> {
        for (i, fresh) in reserved.kda_out.into_iter().enumerate() {
            if !fresh.is_null() {
                let old = std::mem::replace(&mut self.kda_pages[i], fresh);
                if !old.is_null() {
                    pool.release(old)?;
                }
            }
        }
        self.len = new_len;
        Ok(())
    }
}

/// Builds the [`PagedState`] of one step whose forward reads and writes the pool's pages.
pub struct StepPages {
    state: PagedState,
}

impl StepPages {
    pub fn new(slots: &LayerSlots, pool: &PagePool) -> Result<Self, KvError> {
        let layout = pool.layout();
        let mut layers = Vec::with_capacity(slots.slots.len());
        for &(g, plane) in &slots.slots {
            let base = layout.plane_base(plane);
            layers.push(if Some(g) == slots.mla_group {
                PagedLayer::Mla {
                    latent: base + layout.field_range(g, Field::Latent)?.0,
                }
            } else {
                PagedLayer::Kda {
                    group: slots.kda_index(g),
                    conv: base + layout.field_range(g, Field::Conv)?.0,
                    recurrent: base + layout.field_range(g, Field::Recurrent)?.0,
                }
            });
        }
        Ok(StepPages {
            state: PagedState {
                page_tokens: slots.page_tokens,
                layers,
                kda: vec![Vec::new(); slots.kda_groups.len()],
                start: Vec::new(),
                mla_pages: Vec::new(),
            },
        })
    }

    /// Adds a sequence's segment: it reads its current pages and writes where `reserved` says.
    pub fn push(
        &mut self,
        slots: &LayerSlots,
        pool: &PagePool,
        seq: &PagedSeq,
        reserved: &Reserved,
    ) -> Result<(), KvError> {
        let layout = pool.layout();
        let at = |g: GroupId, p: PageId| layout.page_offset(Plane(0), g, p);
        for (i, &g) in slots.kda_groups.iter().enumerate() {
            let (cur, fresh) = (seq.kda_pages[i], reserved.kda_out[i]);
            let src = if cur.is_null() {
                None
            } else {
                Some(at(g, cur)?)
            };
            let dst = at(g, if fresh.is_null() { cur } else { fresh })?;
            self.state.kda[i].push((src, dst));
        }
        let mla = match slots.mla_group {
            Some(g) => seq
                .mla_pages
                .iter()
                .map(|&p| at(g, p))
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        self.state.mla_pages.push(mla);
        self.state.start.push(seq.len);
        Ok(())
    }

    pub fn state(&self) -> &PagedState {
        &self.state
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::StateDtypes;

    /// The offsets a paged step hands the device forward address exactly the bytes the pool
    /// assigns to each layer's field of each page: reads from the current state page, writes to
    /// the fresh one after a seal (copy-on-write) and in place otherwise.
    #[test]
    fn step_offsets_address_the_pool_fields() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/kl_grouped/config.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let cfg = ModelConfig::from_json_str(&text, std::path::Path::new(path)).unwrap();
        let layout = KvLayout::plan(&cfg, 4, 4 << 20, StateDtypes::F32).unwrap();
        let slots = LayerSlots::new(&cfg, &layout);
        assert!(slots.mla_group.is_some() && !slots.kda_groups.is_empty());
        let mut pool = PagePool::new(layout).unwrap();
        let mut seq = PagedSeq::new(&slots);
        let r = seq.reserve(&slots, &mut pool, 10).unwrap();
        seq.commit(&mut pool, r, 10).unwrap();
        // Publish the first group's state: the next step must write a fresh page for it.
        pool.seal(seq.kda_pages[0]).unwrap();
        let before = seq.kda_pages.clone();
        let r = seq.reserve(&slots, &mut pool, 13).unwrap();
        let mut step = StepPages::new(&slots, &pool).unwrap();
        step.push(&slots, &pool, &seq, &r).unwrap();
        let st = step.state();
        assert_eq!(st.start, vec![10]);
        assert_eq!(st.mla_pages[0].len(), 4);
        for (l, &(g, plane)) in slots.slots.iter().enumerate() {
            match st.layers[l] {
                PagedLayer::Mla { latent } => {
                    for (j, &page) in seq.mla_pages.iter().enumerate() {
                        assert_eq!(
                            latent + st.mla_pages[0][j],
                            pool.byte_offset(plane, page, Field::Latent).unwrap()
                        );
                    }
                }
                PagedLayer::Kda {
                    group,
                    conv,
                    recurrent,
                } => {
                    assert_eq!(slots.kda_groups[group], g);
                    let (src, dst) = st.kda[group][0];
                    let want_dst = if group == 0 {
                        assert_ne!(r.kda_out[0], PageId::NULL);
                        r.kda_out[0]
                    } else {
                        assert_eq!(r.kda_out[group], PageId::NULL);
                        before[group]
                    };
                    for (field, base) in [(Field::Conv, conv), (Field::Recurrent, recurrent)] {
                        let at = |p| pool.byte_offset(plane, p, field).unwrap();
                        assert_eq!(base + src.unwrap(), at(before[group]));
                        assert_eq!(base + dst, at(want_dst));
                    }
                }
            }
        }
        let Reserved { kda_out } = r;
        assert_eq!(kda_out.iter().filter(|p| !p.is_null()).count(), 1);
        Reserved { kda_out }.abandon(&mut pool);
    }
}
