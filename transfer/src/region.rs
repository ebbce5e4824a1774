//! Registered memory regions: host byte buffers that a transport reads from (source side) or
//! writes into (destination side), shared safely between the owner and the transport.
//!
//! A [`RegionHandle`] is a cheap clone of an `Arc` over [`RegionMemory`], which owns one
//! 64-byte-aligned, zero-initialised allocation (its own, or one a transport made, such as the
//! shared memory `UcxTransport::alloc_region` returns). Every access, by the owner or by a
//! transport, goes through an **extent lease**: [`RegionHandle::try_read`] takes a shared lease on a byte
//! range, [`RegionHandle::try_write`] an exclusive one; overlapping leases conflict unless both are
//! shared, and a conflicting request fails at once with [`RegionError::Busy`] (it never blocks).
//!
//! # Concurrency contract
//!
//! - **Source side.** While `Transport::write` runs, the transport holds shared leases on every
//!   source extent of the batch. The owner may read them, but cannot write them until the call
//!   returns (its `try_write` gets `Busy`).
//! - **Destination side.** A receiving transport takes exclusive leases on the destination extents
//!   of a transfer as their bytes arrive and keeps them until the whole transfer is verified and
//!   its completion is recorded (or it is abandoned). So the owner cannot observe a half-written
//!   extent: until `wait_incoming` reports completion its leases on those bytes get `Busy`. Bytes of
//!   a transfer that failed (checksum mismatch, dropped connection) are unspecified.
//! - Leases are ordered through one mutex per region, so a lease taken after another was released
//!   sees all writes made under it.
//!
//! Code that must work on the raw bytes (UCX maps a region's memory for its transports) can use
//! [`RegionHandle::as_ptr`]; it then owns the same contract by other means (page reservations and
//! refcounts): never touch bytes a transfer may be writing before its completion is notified.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Alignment of every region's first byte (a cache line; enough for any kernel's vector loads).
pub const REGION_ALIGN: usize = 64;

/// Names a region within the process that registered it (unique for the process's life).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u64);

/// One life of a worker process: chosen at random when a transport starts, carried by every
/// descriptor and checked in every handshake, so a restarted worker never accepts writes meant
/// for its previous life.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Incarnation(pub u64);

impl Incarnation {
    /// A fresh random incarnation (never 0, which means "unknown" on the wire).
    pub fn random() -> Self {
        loop {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).expect("the OS random source is available");
            let v = u64::from_le_bytes(b);
            if v != 0 {
                return Incarnation(v);
            }
        }
    }
}

impl fmt::Debug for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Incarnation({:016x})", self.0)
    }
}

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What a peer needs to address a registered region: exchanged once (over gRPC, in the transfer
/// handshake of the serving layer) and then named in every write to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    pub region_id: RegionId,
    pub len: u64,
    /// The registering worker's incarnation; a write naming another one is refused.
    pub incarnation: Incarnation,
    /// Backend-specific access token; empty for every backend so far (`ucx` hands remote keys
    /// only to authenticated peers, over its control connections).
    pub remote_key: Vec<u8>,
}

/// Why an extent lease could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("extent {offset}+{len} is outside region {region:?} of {region_len} bytes")]
    OutOfBounds {
        region: RegionId,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    #[error("extent {offset}+{len} of region {region:?} overlaps a conflicting lease")]
    Busy {
        region: RegionId,
        offset: u64,
        len: u64,
    },
}

#[derive(Debug)]
struct Lease {
    id: u64,
    range: Range<usize>,
    exclusive: bool,
}

/// Who owns a region's allocation.
enum Backing {
    /// This crate's allocator, with [`RegionMemory::layout`].
    Heap,
    /// Something else (an RMA library); dropping the owner releases the memory.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    Foreign {
        _owner: Box<dyn std::any::Any + Send + Sync>,
    },
}

/// The bytes of one region and the leases currently held on them.
pub struct RegionMemory {
    id: RegionId,
    ptr: NonNull<u8>,
    len: usize,
    leases: Mutex<Vec<Lease>>,
    backing: Backing,
}

// SAFETY: the allocation is owned by this value and only reached through leases (which exclude
// conflicting access) or through `as_ptr`, whose users take on the documented contract.
unsafe impl Send for RegionMemory {}
unsafe impl Sync for RegionMemory {}

impl RegionMemory {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), REGION_ALIGN).expect("region size fits a Layout")
    }

    fn leases(&self) -> MutexGuard<'_, Vec<Lease>> {
        // A panic while holding this lock cannot leave the lease list inconsistent.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, range: &Range<usize>) -> Result<(), RegionError> {
        if range.start > range.end || range.end > self.len {
            return Err(RegionError::OutOfBounds {
                region: self.id,
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                region_len: self.len as u64,
            });
        }
        Ok(())
    }

    fn acquire(&self, range: Range<usize>, exclusive: bool) -> Result<u64, RegionError> {
        self.check(&range)?;
        static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);
        let mut leases = self.leases();
        let empty = range.is_empty();
        let conflict = !empty
            && leases.iter().any(|l| {
                (exclusive || l.exclusive) && l.range.start < range.end && range.start < l.range.end
            });
        if conflict {
            return Err(RegionError::Busy {
                region: self.id,
                offset: range.start as u64,
                len: (range.end - range.start) as u64,
            });
        }
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        if !empty {
            leases.push(Lease {
                id,
                range,
                exclusive,
            });
        }
        Ok(id)
    }

    fn release(&self, id: u64) {
        let mut leases = self.leases();
        if let Some(i) = leases.iter().position(|l| l.id == id) {
            leases.swap_remove(i);
        }
    }
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        if let Backing::Heap = self.backing {
            // SAFETY: allocated in `RegionHandle::new` with this very layout.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
        // A foreign owner releases its memory when it is dropped, right after this.
    }
}

fn next_region_id() -> RegionId {
    static NEXT_REGION: AtomicU64 = AtomicU64::new(1);
    RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed))
}

/// A shareable handle on one region. Clones name the same bytes; the memory lives until the last
/// handle (including those a transport holds while registered or mid-transfer) is dropped.
#[derive(Clone)]
pub struct RegionHandle(Arc<RegionMemory>);

impl fmt::Debug for RegionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionHandle")
            .field("id", &self.0.id)
            .field("len", &self.0.len)
            .finish()
    }
}

impl RegionHandle {
    /// A zeroed region of `len` bytes, aligned to [`REGION_ALIGN`].
    pub fn new(len: usize) -> Self {
        let layout = RegionMemory::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // Resident from the start (see the KV pool's host arena): first writes by transfers
        // would otherwise grow the process slot by slot.
        for off in (0..len).step_by(4096) {
            // SAFETY: `off < len` within the allocation; volatile so the store is kept.
            unsafe { std::ptr::write_volatile(raw.add(off), 0) };
        }
        RegionHandle(Arc::new(RegionMemory {
            id: next_region_id(),
            ptr,
            len,
            leases: Mutex::new(Vec::new()),
            backing: Backing::Heap,
        }))
    }

    /// A region over memory something else allocated (an RMA library's shared memory, say);
    /// `owner` is dropped, and releases the memory, when the last handle and lease are gone.
    ///
    /// # Safety
    /// `ptr` must be aligned to [`REGION_ALIGN`], valid for reads and writes of `len` bytes,
    /// zero-initialised, and reached by nothing but this region (and transports it is registered
    /// with) until `owner` is dropped.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) unsafe fn from_foreign(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        debug_assert_eq!(ptr.as_ptr() as usize % REGION_ALIGN, 0);
        RegionHandle(Arc::new(RegionMemory {
            id: next_region_id(),
            ptr,
            len,
            leases: Mutex::new(Vec::new()),
            backing: Backing::Foreign { _owner: owner },
        }))
    }

    /// A region holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let region = Self::new(bytes.len());
        region
            .try_write(0..bytes.len())
            .expect("a fresh region has no leases")
            .copy_from_slice(bytes);
        region
    }

    pub fn id(&self) -> RegionId {
        self.0.id
    }

    pub fn len(&self) -> usize {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// A shared lease on `range`: fails with `Busy` while an exclusive lease overlaps it.
    pub fn try_read(&self, range: Range<usize>) -> Result<ExtentRef, RegionError> {
        self.hold(range, false).map(ExtentRef)
    }

    /// An exclusive lease on `range`: fails with `Busy` while any lease overlaps it.
    pub fn try_write(&self, range: Range<usize>) -> Result<ExtentMut, RegionError> {
        self.hold(range, true).map(ExtentMut)
    }

    fn hold(&self, range: Range<usize>, exclusive: bool) -> Result<Held, RegionError> {
        let lease = self.0.acquire(range.clone(), exclusive)?;
        Ok(Held {
            mem: self.0.clone(),
            range,
            lease,
        })
    }

    /// The first byte of the region, for code that manages exclusivity itself (see the module
    /// docs). Valid while any handle on the region lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.ptr.as_ptr()
    }

    /// Whether two handles name the same memory.
    pub fn ptr_eq(&self, other: &RegionHandle) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A lease held on `range` of a region's memory, released on drop: what [`ExtentRef`] and
/// [`ExtentMut`] hold.
struct Held {
    mem: Arc<RegionMemory>,
    range: Range<usize>,
    lease: u64,
}

impl Held {
    /// The leased bytes, to be borrowed as the kind of lease allows.
    fn bytes(&self) -> *mut [u8] {
        // SAFETY: `range` lies within the allocation (checked at acquire).
        let start = unsafe { self.mem.ptr.as_ptr().add(self.range.start) };
        std::ptr::slice_from_raw_parts_mut(start, self.range.len())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.mem.release(self.lease);
    }
}

/// A shared lease on an extent of a region; reads as `[u8]`; released on drop.
pub struct ExtentRef(Held);

impl ExtentRef {
    pub fn range(&self) -> Range<usize> {
        self.0.range.clone()
    }
}

impl Deref for ExtentRef {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: in bounds, and the memory lives as long as the lease; no exclusive lease
        // overlaps while this one lives.
        unsafe { &*self.0.bytes() }
    }
}

/// An exclusive lease on an extent of a region; reads and writes as `[u8]`; released on drop.
pub struct ExtentMut(Held);

impl ExtentMut {
    pub fn range(&self) -> Range<usize> {
        self.0.range.clone()
    }
}

impl Deref for ExtentMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: in bounds, and the memory lives as long as the lease; no other lease overlaps
        // while this one lives.
        unsafe { &*self.0.bytes() }
    }
}

impl DerefMut for ExtentMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` excludes other borrows of this one.
        unsafe { &mut *self.0.bytes() }
    }
}

/// A transport's registered regions, by id.
pub(crate) struct RegionTable {
    regions: Mutex<HashMap<RegionId, RegionHandle>>,
    /// The transport's incarnation, named by every descriptor.
    incarnation: Incarnation,
}

impl RegionTable {
    pub(crate) fn new(incarnation: Incarnation) -> Self {
        RegionTable {
            regions: Mutex::new(HashMap::new()),
            incarnation,
        }
    }

    /// Registers `region` and returns the descriptor peers use to address it (no remote key:
    /// the transports that use this table address regions by id).
    pub(crate) fn register(&self, region: &RegionHandle) -> RegionDescriptor {
        self.lock().insert(region.id(), region.clone());
        RegionDescriptor {
            region_id: region.id(),
            len: region.len() as u64,
            incarnation: self.incarnation,
            remote_key: Vec::new(),
        }
    }

    pub(crate) fn remove(&self, id: RegionId) -> bool {
        self.lock().remove(&id).is_some()
    }

    pub(crate) fn get(&self, id: RegionId) -> Option<RegionHandle> {
        self.lock().get(&id).cloned()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RegionId, RegionHandle>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_region_is_zeroed_and_aligned() {
        let r = RegionHandle::new(1000);
        assert_eq!(r.as_ptr() as usize % REGION_ALIGN, 0);
        assert!(r.try_read(0..1000).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn leases_exclude_conflicting_access() {
        let r = RegionHandle::new(100);
        let w = r.try_write(10..20).unwrap();
        assert!(matches!(r.try_read(15..25), Err(RegionError::Busy { .. })));
        assert!(matches!(r.try_write(0..11), Err(RegionError::Busy { .. })));
        let _a = r.try_read(20..30).unwrap();
        let _b = r.try_read(25..40).unwrap();
        assert!(r.try_write(35..36).is_err());
        drop(w);
        r.try_write(0..20).unwrap();
        assert!(matches!(
            r.try_read(90..101),
            Err(RegionError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn writes_are_visible_to_later_leases() {
        let r = RegionHandle::from_bytes(&[1, 2, 3, 4]);
        r.try_write(1..3).unwrap().copy_from_slice(&[9, 9]);
        assert_eq!(&*r.try_read(0..4).unwrap(), &[1, 9, 9, 4]);
    }

    #[test]
    fn memory_outlives_the_owner_handle() {
        let r = RegionHandle::new(8);
        let lease = r.try_read(0..8).unwrap();
        drop(r);
        assert_eq!(lease.len(), 8);
    }
}
