//! Flat KV page pool (DESIGN.md §3, K3-SPEC.md §5).
//!
//! Why one flat pool instead of a KV cache per layer kind: a hybrid model keeps two very
//! different kinds of per-request state, the MLA latent history (grows with the sequence) and
//! the KDA recurrent state (fixed size, snapshotted at page boundaries for prefix reuse). Giving
//! each its own budget strands memory whenever the workload mix changes. Here one arena is cut
//! into *planes* (one per layer slot) and *parents* (the same byte range in every plane); a free
//! parent can be bound to any cache group, so every byte is fungible between history and state,
//! and one page-ID space addresses both (prefix cache, P→D transfer and graph page tables alike).
//!
//! - [`layout`]: the arithmetic: groups, planes, pages per parent, page IDs, byte offsets.
//! - [`pool`]: allocation, refcounts, zeroing, copy-on-write and host access over an arena.
//! - [`prefix`]: the chained-hash prefix index with one LRU over every group.

pub mod layout;
pub mod pool;
pub mod prefix;

#[cfg(test)]
mod tests;

pub use layout::{Field, GroupKind, GroupLayout, KvDims, KvLayout, StateDtypes};
pub use pool::{DynArena, GroupUsage, HostArena, KvArena, PagePool};
pub use prefix::{page_hashes_marked, BlockHash, PageMark, PrefixHit, PrefixIndex, PrefixStats};

use std::fmt;

/// A page in the global page-ID space; [`PageId::NULL`] (0) names no page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PageId(pub u32);

impl PageId {
    /// The null page: a hole in a page table.
    pub const NULL: PageId = PageId(0);

    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

/// A cache group: the MLA group (if the model has MLA layers) comes first, then the KDA groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupId(pub u16);

impl GroupId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "group {}", self.0)
    }
}

/// A plane (slab): plane `k` holds the `k`-th layer of every group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Plane(pub u16);

impl Plane {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Everything the pool, the layout and the index refuse. Nothing in this module panics on bad
/// input: a double free or a stale page ID is an error the caller can log and survive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("kv layout rejected: {0}")]
    Layout(String),
    #[error("out of pages for {0}")]
    OutOfPages(GroupId),
    #[error("the null page cannot be used")]
    NullPage,
    #[error("{0} is not a valid page id")]
    InvalidPage(PageId),
    #[error("{0} is not allocated (double free or stale id)")]
    NotLive(PageId),
    #[error("{page} belongs to {actual}, not {expected}")]
    WrongGroup {
        page: PageId,
        expected: GroupId,
        actual: GroupId,
    },
    #[error("{0} does not exist")]
    NoSuchGroup(GroupId),
    #[error("plane {plane} does not hold a layer of {group}")]
    NoSuchPlane { plane: u16, group: GroupId },
    #[error("field {field:?} does not exist in {group}")]
    NoSuchField { field: Field, group: GroupId },
    #[error("{0} is shared or published and must not be written (copy it first)")]
    ReadOnly(PageId),
    #[error("refcount overflow on {0}")]
    RefcountOverflow(PageId),
    #[error("arena too small: {have} bytes, layout needs {need}")]
    ArenaTooSmall { have: usize, need: usize },
    #[error("host arena needs 4-byte (f32) fields, layout has {0:?}")]
    HostDtype(StateDtypes),
    #[error("the page pool lives in device memory; read its bytes instead")]
    NotOnHost,
    #[error("device arena: {0}")]
    Device(String),
    #[error("prefix index: {0}")]
    Prefix(String),
}
