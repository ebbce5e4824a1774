//! The arithmetic of the flat page pool: which layer lives in which plane, how many pages a
//! parent holds for each group, which page ID names which bytes.
//!
//! Kept apart from the pool so that it can be checked against K3-SPEC §5 by hand, reported at
//! start-up, and shared unchanged by a GPU arena and by P→D peers (who must agree on it).
//!
//! Rules (DESIGN.md §3):
//! - groups: one MLA group (all MLA layers, in order) if any, then `G = ceil(L_kda / L_mla)` KDA
//!   groups (1 without MLA), the KDA layers taken in order, `ceil(L_kda / G)` per group;
//! - planes `S = max(L_mla, ceil(L_kda / G))`; plane `k` holds the `k`-th layer of every group;
//! - a parent owns `plane_bytes` in every plane; bound to a group it holds `K_g` pages
//!   (MLA: `K_mla` pages of `page_tokens` latent rows; KDA: `K_kda` conv + recurrent snapshots);
//! - `page_id = 1 + (parent − 1)·K_max + slot`, `K_max = max_g K_g`; 0 is the null page;
//! - byte of (plane k, parent b, slot s, field) =
//!   `k·(N+1)·plane_bytes + b·plane_bytes + s·stride_g + field_offset` (parent 0 is a hole).
//!
//! **Choice of `K_mla`** (the one free parameter). TokenSpeed fixes `K_mla = 12` for K3 (1536
//! tokens) by its own recipe. Tessera's default is the *smallest* `K_mla` whose plane holds at
//! least one KDA snapshot with at most [`MAX_STATE_SLACK`] (25%) of the plane left unused in a
//! KDA-bound parent. Small parents keep the allocation grain fine (a short request does not pin
//! thousands of tokens of MLA space per layer); the slack bound keeps state parents dense. For K3
//! TP8 bf16 this gives `K_mla = 6` (768 tokens, one snapshot per parent, 8.0% slack), exactly the
//! same density as TokenSpeed's 12 (two snapshots, 8.0% slack); `plan_with(.., Some(12))`
//! reproduces TokenSpeed's layout. Without KDA layers `K_mla = 1`; without MLA layers
//! `plane_bytes` is one snapshot.
//!
//! **Budget.** The arena is `S·(N+1)·plane_bytes` (parent 0 is the null hole), and it is this whole
//! arena that must fit `budget_bytes`: `N = floor(budget / (S·plane_bytes)) − 1`, at least 2.

use std::fmt::Write as _;

use super::{GroupId, KvError, PageId, Plane};
use crate::config::{AttnKind, ModelConfig};

/// Every page stride and field offset is a multiple of this many bytes (vector loads on the host,
/// coalesced access on a GPU). Real Kimi shapes are already multiples of it.
pub const FIELD_ALIGN: usize = 16;

/// The default `K_mla` rule accepts at most this fraction of a KDA-bound plane left unused.
pub const MAX_STATE_SLACK: f64 = 0.25;

/// Bytes per element of each stored field (P/D peers must agree exactly, K3-SPEC §6.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StateDtypes {
    pub latent_bytes: usize,
    pub conv_bytes: usize,
    pub recurrent_bytes: usize,
}

impl StateDtypes {
    /// Everything f32: the CPU reference path.
    pub const F32: StateDtypes = StateDtypes {
        latent_bytes: 4,
        conv_bytes: 4,
        recurrent_bytes: 4,
    };
    /// bf16 latent and conv, f32 recurrent state: the GPU path (K3-SPEC §4).
    pub const BF16: StateDtypes = StateDtypes {
        latent_bytes: 2,
        conv_bytes: 2,
        recurrent_bytes: 4,
    };

    pub fn all_f32(&self) -> bool {
        *self == Self::F32
    }
}

/// The shapes the pool stores, per layer (per tensor-parallel rank: pass the rank's heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvDims {
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    /// MLA floats per token: `kv_lora_rank + qk_rope_head_dim` (`[c_kv | k_pe]`).
    pub latent_dim: usize,
}

impl KvDims {
    pub fn from_config(cfg: &ModelConfig) -> Self {
        KvDims {
            kda_heads: cfg.kda.num_heads,
            kda_head_dim: cfg.kda.head_dim,
            conv_kernel: cfg.kda.conv_kernel,
            latent_dim: cfg.mla.latent_dim(),
        }
    }
    /// The shapes one rank of a `tp`-way tensor-parallel group stores: KDA heads are split
    /// across ranks (conv channels and recurrent state with them); the MLA latent `[c_kv | k_pe]`
    /// is shared by all heads, so every rank keeps it whole (K3-SPEC §4).
    pub fn for_tensor_parallel(cfg: &ModelConfig, tp: usize) -> Result<Self, KvError> {
        let whole = Self::from_config(cfg);
        if tp == 0 || !whole.kda_heads.is_multiple_of(tp) {
            return Err(reject(format!(
                "tensor-parallel degree {tp} does not divide the {} KDA heads",
                whole.kda_heads
            )));
        }
        Ok(KvDims {
            kda_heads: whole.kda_heads / tp,
            ..whole
        })
    }
    /// `[3·heads·head_dim, conv_kernel − 1]`: the last inputs of the q, k, v short convolutions.
    pub fn conv_elems(&self) -> usize {
        3 * self.kda_heads * self.kda_head_dim * self.conv_kernel.saturating_sub(1)
    }
    /// `[heads, head_dim, head_dim]`.
    pub fn recurrent_elems(&self) -> usize {
        self.kda_heads * self.kda_head_dim * self.kda_head_dim
    }
}

/// What a page stores in one plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// MLA: `[page_tokens, latent_dim]` rows of `[c_kv | k_pe]`.
    Latent,
    /// KDA: short-conv window `[3·proj_dim, conv_kernel − 1]`.
    Conv,
    /// KDA: recurrent state `[heads, head_dim, head_dim]`.
    Recurrent,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    Mla,
    Kda,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLayout {
    pub kind: GroupKind,
    /// Model layer indices; `layers[k]` lives in plane `k`.
    pub layers: Vec<usize>,
    /// `K_g`: pages in one parent bound to this group.
    pub pages_per_parent: usize,
    /// Bytes of one page in one plane, aligned (the distance between slots).
    pub page_stride: usize,
    /// Bytes of one page in one plane that hold data (sum of the fields, unaligned).
    pub page_payload: usize,
}

/// The planned layout. Immutable once built; see the module comment for the rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub page_tokens: usize,
    pub dims: KvDims,
    pub dtypes: StateDtypes,
    groups: Vec<GroupLayout>,
    planes: usize,
    plane_bytes: usize,
    parents: usize,
    max_pages_per_parent: usize,
    /// Model layer → (group, plane).
    layer_map: Vec<(GroupId, Plane)>,
}

fn align(n: usize) -> usize {
    n.div_ceil(FIELD_ALIGN) * FIELD_ALIGN
}

fn reject(msg: impl Into<String>) -> KvError {
    KvError::Layout(msg.into())
}

impl KvLayout {
    /// Plans with the default `K_mla` rule.
    pub fn plan(
        cfg: &ModelConfig,
        page_tokens: usize,
        budget_bytes: usize,
        dtypes: StateDtypes,
    ) -> Result<Self, KvError> {
        Self::plan_with(cfg, page_tokens, budget_bytes, dtypes, None)
    }

    /// Plans with `K_mla` given explicitly (`Some(12)` reproduces TokenSpeed's K3 layout).
    pub fn plan_with(
        cfg: &ModelConfig,
        page_tokens: usize,
        budget_bytes: usize,
        dtypes: StateDtypes,
        mla_pages_per_parent: Option<usize>,
    ) -> Result<Self, KvError> {
        Self::plan_layers(
            &cfg.attn,
            KvDims::from_config(cfg),
            page_tokens,
            budget_bytes,
            dtypes,
            mla_pages_per_parent,
        )
    }

    /// The planner itself, from the per-layer kinds and the stored shapes.
    pub fn plan_layers(
        attn: &[AttnKind],
        dims: KvDims,
        page_tokens: usize,
        budget_bytes: usize,
        dtypes: StateDtypes,
        mla_pages_per_parent: Option<usize>,
    ) -> Result<Self, KvError> {
        if page_tokens == 0 {
            return Err(reject("page_tokens must be at least 1"));
        }
        if dtypes.latent_bytes == 0 || dtypes.conv_bytes == 0 || dtypes.recurrent_bytes == 0 {
            return Err(reject(format!(
                "element sizes must be non-zero: {dtypes:?}"
            )));
        }
        let mla: Vec<usize> = (0..attn.len())
            .filter(|&l| attn[l] == AttnKind::Mla)
            .collect();
        let kda: Vec<usize> = (0..attn.len())
            .filter(|&l| attn[l] == AttnKind::Kda)
            .collect();
        if mla.is_empty() && kda.is_empty() {
            return Err(reject("the model has no attention layer to cache"));
        }
        if !mla.is_empty() && dims.latent_dim == 0 {
            return Err(reject("MLA layers with latent_dim 0"));
        }

        // Sizes from a config are untrusted: every one is computed checked, so that the
        // unchecked accessors used once the layout exists cannot overflow either.
        let overflow = || {
            reject(format!(
                "page sizes overflow for {dims:?} with {page_tokens}-token pages"
            ))
        };
        let product = |factors: &[usize]| {
            factors
                .iter()
                .try_fold(1usize, |p, &f| p.checked_mul(f))
                .ok_or_else(overflow)
        };
        let checked_align = |n: usize| n.checked_next_multiple_of(FIELD_ALIGN);
        let mla_payload = product(&[page_tokens, dims.latent_dim, dtypes.latent_bytes])?;
        let mla_stride = checked_align(mla_payload).ok_or_else(overflow)?;
        let conv_bytes = product(&[
            3,
            dims.kda_heads,
            dims.kda_head_dim,
            dims.conv_kernel.saturating_sub(1),
            dtypes.conv_bytes,
        ])?;
        let rec_bytes = product(&[
            dims.kda_heads,
            dims.kda_head_dim,
            dims.kda_head_dim,
            dtypes.recurrent_bytes,
        ])?;
        if !kda.is_empty() && rec_bytes == 0 {
            return Err(reject("KDA layers with an empty recurrent state"));
        }
        let kda_payload = conv_bytes.checked_add(rec_bytes).ok_or_else(overflow)?;
        let kda_stride = checked_align(conv_bytes)
            .and_then(|c| c.checked_add(rec_bytes))
            .and_then(checked_align)
            .ok_or_else(overflow)?;

        // KDA groups: G = ceil(L_kda / L_mla) (1 without MLA), ceil(L_kda / G) layers each.
        let kda_groups: Vec<Vec<usize>> = if kda.is_empty() {
            Vec::new()
        } else {
            let g = if mla.is_empty() {
                1
            } else {
                kda.len().div_ceil(mla.len())
            };
            kda.chunks(kda.len().div_ceil(g))
                .map(<[usize]>::to_vec)
                .collect()
        };
        let per_kda = kda_groups.first().map_or(0, Vec::len);
        let planes = mla.len().max(per_kda);

        let (plane_bytes, k_mla, k_kda) = if mla.is_empty() {
            if mla_pages_per_parent.is_some() {
                return Err(reject(
                    "mla_pages_per_parent given for a model without MLA layers",
                ));
            }
            (kda_stride, 0, 1)
        } else {
            let k_mla = match mla_pages_per_parent {
                Some(0) => return Err(reject("mla_pages_per_parent must be at least 1")),
                Some(k) => k,
                None if kda.is_empty() => 1,
                None => default_mla_pages(mla_stride, kda_stride)
                    .ok_or_else(|| reject("plane size overflows"))?,
            };
            let plane = k_mla
                .checked_mul(mla_stride)
                .ok_or_else(|| reject("plane size overflows"))?;
            let k_kda = if kda.is_empty() {
                0
            } else {
                plane / kda_stride
            };
            if !kda.is_empty() && k_kda == 0 {
                return Err(reject(format!(
                    "a plane of {k_mla} MLA pages ({plane} B) cannot hold one KDA snapshot ({kda_stride} B); \
                     raise mla_pages_per_parent or shard the KDA heads"
                )));
            }
            (plane, k_mla, k_kda)
        };

        let parent_bytes = planes
            .checked_mul(plane_bytes)
            .ok_or_else(|| reject("parent size overflows"))?;
        let slots = budget_bytes / parent_bytes;
        if slots < 3 {
            return Err(reject(format!(
                "budget {budget_bytes} B holds {slots} parents of {parent_bytes} B (need the null parent + 2)"
            )));
        }
        let parents = slots - 1;

        let mut groups = Vec::new();
        if !mla.is_empty() {
            groups.push(GroupLayout {
                kind: GroupKind::Mla,
                layers: mla,
                pages_per_parent: k_mla,
                page_stride: mla_stride,
                page_payload: mla_payload,
            });
        }
        for layers in kda_groups {
            groups.push(GroupLayout {
                kind: GroupKind::Kda,
                layers,
                pages_per_parent: k_kda,
                page_stride: kda_stride,
                page_payload: kda_payload,
            });
        }
        let max_pages_per_parent = groups.iter().map(|g| g.pages_per_parent).max().unwrap_or(1);
        if (parents as u64) * (max_pages_per_parent as u64) >= u32::MAX as u64 {
            return Err(reject("more pages than 32-bit page IDs can name"));
        }
        if planes > u16::MAX as usize || groups.len() > u16::MAX as usize {
            return Err(reject("too many planes or groups"));
        }
        let mut layer_map = vec![(GroupId(0), Plane(0)); attn.len()];
        for (g, group) in groups.iter().enumerate() {
            for (k, &l) in group.layers.iter().enumerate() {
                layer_map[l] = (GroupId(g as u16), Plane(k as u16));
            }
        }
        Ok(KvLayout {
            page_tokens,
            dims,
            dtypes,
            groups,
            planes,
            plane_bytes,
            parents,
            max_pages_per_parent,
            layer_map,
        })
    }

    pub fn groups(&self) -> &[GroupLayout] {
        &self.groups
    }
    pub fn group(&self, g: GroupId) -> Result<&GroupLayout, KvError> {
        self.groups.get(g.index()).ok_or(KvError::NoSuchGroup(g))
    }
    pub fn group_ids(&self) -> impl Iterator<Item = GroupId> + '_ {
        (0..self.groups.len()).map(|g| GroupId(g as u16))
    }
    /// The MLA group, if the model has MLA layers (always group 0 then).
    pub fn mla_group(&self) -> Option<GroupId> {
        (self.groups.first()?.kind == GroupKind::Mla).then_some(GroupId(0))
    }
    /// The KDA groups, in layer order.
    pub fn kda_groups(&self) -> Vec<GroupId> {
        self.group_ids()
            .filter(|&g| self.groups[g.index()].kind == GroupKind::Kda)
            .collect()
    }
    /// Where a model layer's pages live.
    pub fn locate(&self, layer: usize) -> Option<(GroupId, Plane)> {
        self.layer_map.get(layer).copied()
    }
    /// `S`.
    pub fn planes(&self) -> usize {
        self.planes
    }
    pub fn plane_bytes(&self) -> usize {
        self.plane_bytes
    }
    /// `N`: usable parents (IDs 1..=N); parent 0 is the null hole.
    pub fn parents(&self) -> usize {
        self.parents
    }
    /// Bytes of one parent across all planes.
    pub fn parent_bytes(&self) -> usize {
        self.planes * self.plane_bytes
    }
    /// `K_max`: the page-ID stride between parents.
    pub fn max_pages_per_parent(&self) -> usize {
        self.max_pages_per_parent
    }
    /// The largest page ID.
    pub fn max_page_id(&self) -> PageId {
        PageId((self.parents * self.max_pages_per_parent) as u32)
    }
    /// Size of the one arena: `S` planes of `N + 1` parents.
    pub fn arena_bytes(&self) -> usize {
        self.planes * (self.parents + 1) * self.plane_bytes
    }
    /// Tokens one MLA parent holds per layer (`K_mla · page_tokens`), 0 without MLA.
    pub fn tokens_per_mla_parent(&self) -> usize {
        self.mla_group().map_or(0, |g| {
            self.groups[g.index()].pages_per_parent * self.page_tokens
        })
    }

    /// `page_id = 1 + (parent − 1)·K_max + slot`.
    pub fn page_id(&self, parent: usize, slot: usize) -> Result<PageId, KvError> {
        if parent == 0 || parent > self.parents || slot >= self.max_pages_per_parent {
            return Err(KvError::Layout(format!(
                "no page at parent {parent} slot {slot}"
            )));
        }
        Ok(PageId(
            (1 + (parent - 1) * self.max_pages_per_parent + slot) as u32,
        ))
    }

    /// The inverse of [`Self::page_id`]: `(parent, slot)`, whatever group the parent is bound to.
    pub fn parent_slot(&self, id: PageId) -> Result<(usize, usize), KvError> {
        if id.is_null() {
            return Err(KvError::NullPage);
        }
        if id > self.max_page_id() {
            return Err(KvError::InvalidPage(id));
        }
        let i = id.0 as usize - 1;
        Ok((
            1 + i / self.max_pages_per_parent,
            i % self.max_pages_per_parent,
        ))
    }

    /// `(offset, bytes)` of a field inside one page of a group, in one plane.
    pub fn field_range(&self, group: GroupId, field: Field) -> Result<(usize, usize), KvError> {
        let g = self.group(group)?;
        let d = &self.dims;
        let t = &self.dtypes;
        match (g.kind, field) {
            (GroupKind::Mla, Field::Latent) => Ok((0, g.page_payload)),
            (GroupKind::Kda, Field::Conv) => Ok((0, d.conv_elems() * t.conv_bytes)),
            (GroupKind::Kda, Field::Recurrent) => Ok((
                align(d.conv_elems() * t.conv_bytes),
                d.recurrent_elems() * t.recurrent_bytes,
            )),
            _ => Err(KvError::NoSuchField { field, group }),
        }
    }

    /// Elements of a field (its shape's product).
    pub fn field_elems(&self, field: Field) -> usize {
        match field {
            Field::Latent => self.page_tokens * self.dims.latent_dim,
            Field::Conv => self.dims.conv_elems(),
            Field::Recurrent => self.dims.recurrent_elems(),
        }
    }

    /// Byte offset of plane `plane` in the arena: a page's offset in any plane is this plus its
    /// offset in plane 0.
    pub fn plane_base(&self, plane: Plane) -> usize {
        plane.index() * (self.parents + 1) * self.plane_bytes
    }

    /// Byte offset of the start of page `id` (slot stride, all fields) in `plane`, for `group`.
    pub fn page_offset(&self, plane: Plane, group: GroupId, id: PageId) -> Result<usize, KvError> {
        let g = self.group(group)?;
        if plane.index() >= g.layers.len() {
            return Err(KvError::NoSuchPlane {
                plane: plane.0,
                group,
            });
        }
        let (parent, slot) = self.parent_slot(id)?;
        if slot >= g.pages_per_parent {
            return Err(KvError::InvalidPage(id));
        }
        Ok(self.plane_base(plane) + parent * self.plane_bytes + slot * g.page_stride)
    }

    /// Byte offset of `(plane, page, field)` in the arena, for a page bound to `group`.
    pub fn byte_offset(
        &self,
        plane: Plane,
        group: GroupId,
        id: PageId,
        field: Field,
    ) -> Result<usize, KvError> {
        let base = self.page_offset(plane, group, id)?;
        Ok(base + self.field_range(group, field)?.0)
    }

    /// Fraction of a parent bound to `group` that holds no data: slack at the end of each used
    /// plane plus whole planes the group has no layer for.
    pub fn waste(&self, group: GroupId) -> Result<f64, KvError> {
        let g = self.group(group)?;
        let used = g.layers.len() * g.pages_per_parent * g.page_payload;
        Ok(1.0 - used as f64 / self.parent_bytes() as f64)
    }

    /// What start-up logs: planes, parents, pages per parent, bytes, waste per group.
    pub fn report(&self) -> String {
        let mut s = format!(
            "kv layout: {} planes x {} B, {} parents of {} B (+ null parent), arena {} B ({:.2} GiB), \
             page {} tokens, {} page ids",
            self.planes,
            self.plane_bytes,
            self.parents,
            self.parent_bytes(),
            self.arena_bytes(),
            self.arena_bytes() as f64 / (1u64 << 30) as f64,
            self.page_tokens,
            self.max_page_id().0,
        );
        for (i, g) in self.groups.iter().enumerate() {
            let waste = self.waste(GroupId(i as u16)).unwrap_or(0.0) * 100.0;
            let _ = match g.kind {
                GroupKind::Mla => write!(
                    s,
                    "\n  group {i} MLA: {} layers, {} pages/parent ({} tokens/parent), page {} B/plane, waste {waste:.1}%",
                    g.layers.len(),
                    g.pages_per_parent,
                    g.pages_per_parent * self.page_tokens,
                    g.page_stride,
                ),
                GroupKind::Kda => write!(
                    s,
                    "\n  group {i} KDA: {} layers, {} snapshots/parent, snapshot {} B/plane, waste {waste:.1}%",
                    g.layers.len(),
                    g.pages_per_parent,
                    g.page_payload,
                ),
            };
        }
        s
    }
}

/// The default `K_mla`: the smallest count of MLA pages whose plane holds a KDA snapshot with at
/// most [`MAX_STATE_SLACK`] of it unused. Terminates: once `K ≥ 4` and `K·m ≥ s`, the slack is
/// below `m / (K·m) ≤ 25%`.
fn default_mla_pages(mla_stride: usize, kda_stride: usize) -> Option<usize> {
    let mut k = kda_stride.div_ceil(mla_stride).max(1);
    loop {
        let plane = k.checked_mul(mla_stride)?;
        let snaps = plane / kda_stride;
        if snaps > 0 && (plane - snaps * kda_stride) as f64 <= MAX_STATE_SLACK * plane as f64 {
            return Some(k);
        }
        k += 1;
    }
}
