//! The destination's record of transfers into its regions: which parts arrived, which extents
//! they hold leased, and the one completion notice per transfer that `wait_incoming` returns.
//!
//! A batch may arrive as several parts (one per connection) and be retried as a new attempt after
//! a broken connection; a newer attempt supersedes an older one. A finished, failed or abandoned
//! transfer is remembered for a while so that late waits get their answer and late parts are
//! refused rather than written into pages the owner may have reused.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::region::{ExtentMut, Incarnation};
use crate::{IncomingTransfer, TransferError, TransferId};

enum State {
    Pending,
    Complete,
    Failed(TransferError),
    Abandoned,
}

struct Entry {
    attempt: u64,
    total_extents: u32,
    done_extents: u32,
    bytes: u64,
    from: Incarnation,
    state: State,
    /// Destination extents of finished parts, held until the whole transfer completes.
    leases: Vec<ExtentMut>,
    touched: Instant,
}

impl Entry {
    fn receipt(&self, id: TransferId) -> IncomingTransfer {
        IncomingTransfer {
            transfer_id: id,
            bytes: self.bytes,
            extents: self.total_extents,
            from: self.from,
        }
    }
}

/// What a receiver should do with a part that just announced itself.
#[derive(Debug)]
pub(crate) enum PartStart {
    /// Write it.
    Proceed,
    /// The transfer already completed (a retry after a lost acknowledgement): discard, report
    /// success.
    AlreadyComplete,
    /// Discard and report this error.
    Refuse(TransferError),
}

pub(crate) struct IncomingTable {
    table: Mutex<Table>,
    changed: Notify,
    ttl: Duration,
}

/// The entries, and every time one was touched (its `touched` set), oldest first: forgetting
/// the entries untouched for a TTL walks only the expired front of that queue, not the whole
/// map (a destination remembers every transfer of the last TTL).
#[derive(Default)]
struct Table {
    entries: HashMap<TransferId, Entry>,
    touches: VecDeque<(Instant, TransferId)>,
}

impl Table {
    /// Forgets the entries untouched for `ttl` or longer at `now`.
    fn prune(&mut self, now: Instant, ttl: Duration) {
        while let Some(&(at, id)) = self.touches.front() {
            if now.duration_since(at) < ttl {
                break;
            }
            self.touches.pop_front();
            // A later touch of the same entry has its own place further on.
            if self.entries.get(&id).is_some_and(|e| e.touched == at) {
                self.entries.remove(&id);
            }
        }
    }
}

impl IncomingTable {
    pub(crate) fn new(ttl: Duration) -> Self {
        IncomingTable {
            table: Mutex::new(Table::default()),
            changed: Notify::new(),
            ttl,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn begin_part(
        &self,
        id: TransferId,
        attempt: u64,
        total_extents: u32,
        from: Incarnation,
    ) -> PartStart {
        let now = Instant::now();
        let mut table = self.lock();
        // Forget what no deadline can still be waiting for (a pending transfer's leases too).
        table.prune(now, self.ttl);
        table.touches.push_back((now, id));
        let fresh = || Entry {
            attempt,
            total_extents,
            done_extents: 0,
            bytes: 0,
            from,
            state: State::Pending,
            leases: Vec::new(),
            touched: now,
        };
        let Some(e) = table.entries.get_mut(&id) else {
            table.entries.insert(id, fresh());
            return PartStart::Proceed;
        };
        match e.state {
            State::Complete => return PartStart::AlreadyComplete,
            State::Abandoned => return PartStart::Refuse(TransferError::Timeout),
            _ => {}
        }
        if attempt < e.attempt {
            return PartStart::Refuse(TransferError::protocol("part of a superseded attempt"));
        }
        if attempt > e.attempt {
            // A retry: what the older attempt left is discarded (its leases freed).
            *e = fresh();
            return PartStart::Proceed;
        }
        if e.total_extents != total_extents {
            return PartStart::Refuse(TransferError::protocol(
                "parts of one attempt disagree on the extent count",
            ));
        }
        e.touched = now;
        PartStart::Proceed
    }

    /// Whether a part of `attempt` may keep writing (checked between extents), and if not, why.
    pub(crate) fn check_live(&self, id: TransferId, attempt: u64) -> Result<(), TransferError> {
        match self.lock().entries.get(&id) {
            None
            | Some(Entry {
                state: State::Abandoned,
                ..
            }) => Err(TransferError::Timeout),
            Some(e) if e.attempt != attempt => {
                Err(TransferError::protocol("part of a superseded attempt"))
            }
            Some(Entry {
                state: State::Failed(err),
                ..
            }) => Err(err.clone()),
            Some(Entry {
                state: State::Complete,
                ..
            }) => Err(TransferError::protocol("the transfer already completed")),
            Some(Entry {
                state: State::Pending,
                ..
            }) => Ok(()),
        }
    }

    /// A part's extents all landed and verified; completes the transfer when it was the last.
    /// Fails when the transfer moved on (abandoned, superseded, failed); the leases are then
    /// simply dropped.
    pub(crate) fn finish_part(
        &self,
        id: TransferId,
        attempt: u64,
        extents: u32,
        bytes: u64,
        leases: Vec<ExtentMut>,
    ) -> Result<(), TransferError> {
        let mut table = self.lock();
        let Some(e) = table.entries.get_mut(&id) else {
            return Err(TransferError::Timeout);
        };
        match &e.state {
            State::Abandoned => return Err(TransferError::Timeout),
            State::Failed(err) if e.attempt == attempt => return Err(err.clone()),
            State::Pending if e.attempt == attempt => {}
            _ => return Err(TransferError::protocol("part of a superseded attempt")),
        }
        e.done_extents += extents;
        e.bytes += bytes;
        e.leases.extend(leases);
        e.touched = Instant::now();
        let touched = e.touched;
        let complete = e.done_extents >= e.total_extents;
        if complete {
            e.state = State::Complete;
            e.leases.clear();
        }
        table.touches.push_back((touched, id));
        if complete {
            drop(table);
            self.changed.notify_waiters();
        }
        Ok(())
    }

    /// A part of `attempt` failed in a way a retry will not fix (checksum mismatch).
    pub(crate) fn fail(&self, id: TransferId, attempt: u64, err: TransferError) {
        let mut table = self.lock();
        if let Some(e) = table.entries.get_mut(&id) {
            if e.attempt == attempt && matches!(e.state, State::Pending) {
                e.state = State::Failed(err);
                e.leases.clear();
                e.touched = Instant::now();
                let touched = e.touched;
                table.touches.push_back((touched, id));
                drop(table);
                self.changed.notify_waiters();
            }
        }
    }

    pub(crate) fn abandon(&self, id: TransferId) {
        let mut table = self.lock();
        let now = Instant::now();
        table.touches.push_back((now, id));
        let e = table.entries.entry(id).or_insert_with(|| Entry {
            attempt: 0,
            total_extents: 0,
            done_extents: 0,
            bytes: 0,
            from: Incarnation(0),
            state: State::Abandoned,
            leases: Vec::new(),
            touched: now,
        });
        if !matches!(e.state, State::Complete) {
            e.state = State::Abandoned;
            e.leases.clear();
        }
        e.touched = now;
    }

    pub(crate) async fn wait(
        &self,
        id: TransferId,
        deadline: Instant,
    ) -> Result<IncomingTransfer, TransferError> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.lock().entries.get(&id) {
                match &e.state {
                    State::Complete => return Ok(e.receipt(id)),
                    State::Failed(err) => return Err(err.clone()),
                    State::Abandoned => return Err(TransferError::Timeout),
                    State::Pending => {}
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let table = self.lock();
                if let Some(e) = table.entries.get(&id) {
                    if let State::Complete = e.state {
                        return Ok(e.receipt(id));
                    }
                }
                drop(table);
                self.abandon(id);
                return Err(TransferError::Timeout);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INC: Incarnation = Incarnation(7);

    #[tokio::test(start_paused = true)]
    async fn forgets_what_was_untouched_for_a_ttl_and_only_that() {
        let t = IncomingTable::new(Duration::from_secs(10));
        let (a, b) = (TransferId(1), TransferId(2));
        assert!(matches!(t.begin_part(a, 1, 1, INC), PartStart::Proceed));
        t.finish_part(a, 1, 1, 5, vec![]).unwrap();
        assert!(matches!(t.begin_part(b, 1, 2, INC), PartStart::Proceed));
        tokio::time::advance(Duration::from_secs(6)).await;
        t.finish_part(b, 1, 1, 5, vec![]).unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        // Ten seconds after its last touch, the complete transfer is forgotten at the next part:
        // a retry of it is a new transfer, not "already complete".
        assert!(matches!(t.begin_part(a, 2, 1, INC), PartStart::Proceed));
        // The other was touched four seconds ago: still pending, its late part welcome.
        t.check_live(b, 1).unwrap();
        t.finish_part(b, 1, 1, 5, vec![]).unwrap();
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(matches!(
            t.begin_part(b, 2, 2, INC),
            PartStart::AlreadyComplete
        ));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(matches!(t.begin_part(b, 2, 2, INC), PartStart::Proceed));
        assert!(matches!(t.check_live(a, 2), Err(TransferError::Timeout)));
    }

    #[tokio::test]
    async fn completes_after_the_last_part() {
        let t = IncomingTable::new(Duration::from_secs(60));
        let id = TransferId(1);
        assert!(matches!(t.begin_part(id, 1, 3, INC), PartStart::Proceed));
        t.finish_part(id, 1, 2, 20, vec![]).unwrap();
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(
            t.wait(id, soon).await,
            Err(TransferError::Timeout)
        ));
        // The wait abandoned it: a late part is refused.
        assert!(matches!(
            t.begin_part(id, 1, 3, INC),
            PartStart::Refuse(TransferError::Timeout)
        ));

        let id = TransferId(2);
        t.begin_part(id, 1, 2, INC);
        t.finish_part(id, 1, 1, 10, vec![]).unwrap();
        // A retry supersedes the first attempt.
        assert!(matches!(t.begin_part(id, 2, 2, INC), PartStart::Proceed));
        assert!(t.finish_part(id, 1, 1, 10, vec![]).is_err());
        t.finish_part(id, 2, 2, 20, vec![]).unwrap();
        let got = t.wait(id, Instant::now() + Duration::from_secs(1)).await;
        assert_eq!(got.unwrap().bytes, 20);
        assert!(matches!(
            t.begin_part(id, 3, 2, INC),
            PartStart::AlreadyComplete
        ));
    }
}
