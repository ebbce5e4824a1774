//! Fault injection for tests: hooks a receiving transport consults on its hot path (a relaxed
//! atomic load each), inert unless a test arms them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Armed by tests through [`crate::TransportConfig::faults`]; each hook acts on the receiving
/// side, as if the network or the peer misbehaved.
#[derive(Debug, Default)]
pub struct FaultInjection {
    /// Flip one byte of each of the next N extents after they land and before they are verified.
    pub corrupt_extents: AtomicU32,
    /// Accept connections and finish handshakes, then read nothing after the next part header
    /// (UCX: the next Begin).
    pub stall_receive: AtomicBool,
    /// Once: after this many payload bytes of a transfer, drop the connection (0 = off). UCX:
    /// the control connection of the first transfer that lands at least this many bytes is
    /// dropped instead of acknowledged.
    pub drop_after_bytes: AtomicU64,
}

impl FaultInjection {
    pub(crate) fn take_corruption(&self) -> bool {
        self.corrupt_extents
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }

    pub(crate) fn stalled(&self) -> bool {
        self.stall_receive.load(Ordering::Relaxed)
    }

    pub(crate) fn take_drop_after(&self) -> Option<u64> {
        match self.drop_after_bytes.swap(0, Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }
}
