//! The peers a transport connected, by the [`PeerId`]s it handed out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::{PeerId, TransferError};

pub(crate) struct Peers<P> {
    peers: Mutex<HashMap<PeerId, P>>,
    next: AtomicU64,
}

impl<P> Default for Peers<P> {
    fn default() -> Self {
        Peers {
            peers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }
}

impl<P> Peers<P> {
    /// Adds a connected peer under a fresh id.
    pub(crate) fn add(&self, peer: P) -> PeerId {
        let id = PeerId(self.next.fetch_add(1, Ordering::Relaxed));
        self.lock().insert(id, peer);
        id
    }

    /// What `find` makes of the peer `id` names; `PeerGone` when there is none or `find` finds
    /// nothing in it.
    pub(crate) fn find<R>(
        &self,
        id: PeerId,
        find: impl FnOnce(&P) -> Option<R>,
    ) -> Result<R, TransferError> {
        self.lock()
            .get(&id)
            .and_then(find)
            .ok_or_else(|| TransferError::PeerGone(format!("{id:?} is not connected")))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<PeerId, P>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<P: Clone> Peers<P> {
    /// The peer `id` names.
    pub(crate) fn get(&self, id: PeerId) -> Result<P, TransferError> {
        self.find(id, |p| Some(p.clone()))
    }
}
