//! Pairing by page transport: a prefill worker writes pages only into a decode worker that
//! speaks the same transport (`WorkerInfo.transfer_backend`, learned from each worker's `Stats`).
//! The picks of either pool take the worker of the other pool already chosen for the request, or
//! the ones it may still use, and skip workers that could not pair with them; when none is left,
//! [`WorkerPool::unpaired`] says why.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tessera_proto::v1;

use super::{policy, Lease, Role, Worker, WorkerPool};

/// The workers of the other pool a pick must be able to pair with (exchange pages over the
/// same transport).
#[derive(Clone, Copy)]
pub enum PairWith<'a> {
    /// The worker already chosen for the request.
    Worker(&'a Worker),
    /// Any healthy one whose address is not in the list (the workers the request avoids).
    AnyBut(&'a [String]),
}

impl Worker {
    /// The page transport the worker advertises (`None` before its first `Stats`).
    pub fn transport(&self) -> Option<v1::TransferBackend> {
        let raw = self.transport.load(Ordering::Acquire);
        (raw >= 0).then(|| v1::TransferBackend::try_from(raw).unwrap_or(v1::TransferBackend::Tcp))
    }

    /// Records the transport a worker advertises in its `WorkerInfo`; unset means TCP (the only
    /// transport of workers that predate the field).
    pub fn observe_transport(&self, backend: i32) {
        let known = match v1::TransferBackend::try_from(backend) {
            Ok(v1::TransferBackend::Unspecified) | Err(_) => v1::TransferBackend::Tcp,
            Ok(b) => b,
        };
        let old = self.transport.swap(known as i32, Ordering::AcqRel);
        if old >= 0 && old != known as i32 {
            tracing::info!(role = self.role.name(), addr = %self.addr, transport = known.name(), "worker changed its page transport");
        }
    }
}

impl WorkerPool {
    /// Picks a healthy decode worker not in `exclude` (least loaded, round robin among equals)
    /// that some healthy prefill worker can write pages into (same transport).
    pub fn pick_decode(&self, exclude: &[String]) -> Option<Lease> {
        self.pick_decode_for(exclude, PairWith::AnyBut(&[]))
    }

    /// [`WorkerPool::pick_decode`] among the decode workers that can take pages from `prefill`
    /// (the prefill worker already chosen, or the prefill workers the request may still use).
    pub fn pick_decode_for(&self, exclude: &[String], prefill: PairWith<'_>) -> Option<Lease> {
        let fits = self.pairs_with(Role::Prefill, prefill);
        self.pick_where(Role::Decode, exclude, fits, policy::least_loaded)
    }

    /// Picks a healthy prefill worker not in `exclude` (prefix affinity, then load) that can
    /// write pages into some healthy decode worker (same transport).
    pub fn pick_prefill(&self, prompt: &[u32], exclude: &[String]) -> Option<Lease> {
        self.pick_prefill_for(prompt, exclude, PairWith::AnyBut(&[]))
    }

    /// [`WorkerPool::pick_prefill`] among the prefill workers that can write pages into
    /// `decode` (the decode worker already chosen, or the decode workers the request may still
    /// use).
    pub fn pick_prefill_for(
        &self,
        prompt: &[u32],
        exclude: &[String],
        decode: PairWith<'_>,
    ) -> Option<Lease> {
        let key = policy::prefix_key(prompt, self.opts.page_tokens);
        let slack = self.opts.affinity_slack;
        let fits = self.pairs_with(Role::Decode, decode);
        self.pick_where(Role::Prefill, exclude, fits, |c, rr| {
            policy::prefill_choice(c, key, slack, rr)
        })
    }

    /// Picks a healthy encoder not in `exclude` that can push embeddings into `prefill` (same
    /// transport): affinity on the image hash `key` (an encoder that saw the image keeps its
    /// embeddings cached), then load.
    pub fn pick_encoder_for(
        &self,
        key: u64,
        exclude: &[String],
        prefill: &Worker,
    ) -> Option<Lease> {
        let slack = self.opts.affinity_slack;
        let fits = self.pairs_with(Role::Prefill, PairWith::Worker(prefill));
        self.pick_where(Role::Encoder, exclude, fits, |c, rr| {
            policy::prefill_choice(c, Some(key), slack, rr)
        })
    }

    /// Which workers may pair with `peer`, workers of role `other` (any worker when `peer` names
    /// no healthy one: that pool's own pick reports it).
    fn pairs_with(&self, other: Role, peer: PairWith<'_>) -> impl Fn(&Worker) -> bool {
        let speak: Vec<Option<v1::TransferBackend>> = match peer {
            PairWith::Worker(p) => vec![p.transport()],
            PairWith::AnyBut(exclude) => self
                .workers(other)
                .iter()
                .filter(|w| w.is_routable() && !exclude.contains(&w.addr))
                .map(|w| w.transport())
                .collect(),
        };
        move |w| speak.is_empty() || speak.iter().any(|&t| policy::can_pair(t, w.transport()))
    }

    /// Why no worker of `role` outside `exclude` was picked although some are healthy: none
    /// speaks the page transport of `peer` (see [`PairWith`]). `None` when that is not the
    /// reason.
    pub fn unpaired(&self, role: Role, exclude: &[String], peer: PairWith<'_>) -> Option<String> {
        let other = match role {
            Role::Decode | Role::Encoder => Role::Prefill,
            Role::Prefill => Role::Decode,
        };
        let healthy = |r: Role, exclude: &[String]| -> Vec<Arc<Worker>> {
            self.workers(r)
                .into_iter()
                .filter(|w| w.is_routable() && !exclude.contains(&w.addr))
                .collect()
        };
        let candidates = healthy(role, exclude);
        if candidates.is_empty() {
            return None;
        }
        let fits = self.pairs_with(other, peer);
        if candidates.iter().any(|w| fits(w)) {
            return None;
        }
        let list = |ws: &[Arc<Worker>]| -> String {
            ws.iter()
                .map(|w| format!("{} ({})", w.addr, policy::transport_name(w.transport())))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (r, o) = (role.name(), other.name());
        let what = match peer {
            PairWith::Worker(p) => format!(
                "no {r} worker speaks the page transport of {o} worker {} ({})",
                p.addr,
                policy::transport_name(p.transport())
            ),
            PairWith::AnyBut(exclude) => format!(
                "no {r} worker speaks the page transport of a {o} worker ({o}: {})",
                list(&healthy(other, exclude))
            ),
        };
        Some(format!(
            "{what}; healthy {r} workers: {}. Start every encoder, prefill and decode worker \
             with the same --transport",
            list(&candidates)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::pool::PoolOptions;

    /// A pool of workers at unused addresses whose transports the test sets. The test must not
    /// await: the pool's health loop (whose probes would mark these workers down) then never runs.
    fn paired_pool(
        prefill: &[(&str, Option<v1::TransferBackend>)],
        decode: &[(&str, Option<v1::TransferBackend>)],
    ) -> Arc<WorkerPool> {
        let addrs = |ws: &[(&str, Option<v1::TransferBackend>)]| -> Vec<String> {
            ws.iter().map(|(a, _)| a.to_string()).collect()
        };
        let pool =
            WorkerPool::start_dynamic(&addrs(prefill), &addrs(decode), PoolOptions::default())
                .unwrap();
        for (role, ws) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
            for (addr, t) in ws {
                if let Some(t) = t {
                    pool.worker(role, addr).observe_transport(*t as i32);
                }
            }
        }
        pool
    }

    impl WorkerPool {
        fn worker(&self, role: Role, addr: &str) -> Arc<Worker> {
            self.workers(role)
                .into_iter()
                .find(|w| w.addr == addr)
                .unwrap()
        }
    }

    #[tokio::test]
    async fn prefill_and_decode_workers_pair_only_over_the_same_transport() {
        use v1::TransferBackend::{Tcp, Ucx};
        let (p_ucx, d_tcp, d_ucx) = ("127.0.0.1:11", "127.0.0.1:21", "127.0.0.1:22");
        let pool = paired_pool(
            &[(p_ucx, Some(Ucx))],
            &[(d_tcp, Some(Tcp)), (d_ucx, Some(Ucx))],
        );
        // Decode first (text requests): only the decode worker the prefill pool can write into.
        for _ in 0..6 {
            assert_eq!(pool.pick_decode(&[]).unwrap().addr, d_ucx);
        }
        let prefill = pool.worker(Role::Prefill, p_ucx);
        assert_eq!(
            pool.pick_decode_for(&[], PairWith::Worker(&prefill))
                .unwrap()
                .addr,
            d_ucx
        );
        // Prefill first (requests with images), then the decode worker for it.
        let prompt: Vec<u32> = (0..40).collect();
        let d = pool.worker(Role::Decode, d_ucx);
        assert_eq!(
            pool.pick_prefill_for(&prompt, &[], PairWith::Worker(&d))
                .unwrap()
                .addr,
            p_ucx
        );
        assert!(pool
            .unpaired(Role::Prefill, &[], PairWith::Worker(&d))
            .is_none());
        // A decode worker of the other transport gets no prefill worker, and says why.
        let d = pool.worker(Role::Decode, d_tcp);
        assert!(pool
            .pick_prefill_for(&prompt, &[], PairWith::Worker(&d))
            .is_none());
        let why = pool
            .unpaired(Role::Prefill, &[], PairWith::Worker(&d))
            .unwrap();
        assert!(
            why.contains(
                "no prefill worker speaks the page transport of decode worker 127.0.0.1:21 (tcp)"
            ) && why.contains("127.0.0.1:11 (ucx)")
                && why.contains("--transport"),
            "{why}"
        );
        // With the matching decode worker out (it failed this request), none is left to pick.
        let avoid = [d_ucx.to_string()];
        assert!(pool.pick_decode(&avoid).is_none());
        let why = pool
            .unpaired(Role::Decode, &avoid, PairWith::AnyBut(&[]))
            .unwrap();
        assert!(
            why.contains("no decode worker speaks the page transport of a prefill worker")
                && why.contains("127.0.0.1:11 (ucx)")
                && why.contains("127.0.0.1:21 (tcp)"),
            "{why}"
        );
        // Nothing to explain when no decode worker is healthy at all.
        let all = [d_ucx.to_string(), d_tcp.to_string()];
        assert!(pool
            .unpaired(Role::Decode, &all, PairWith::AnyBut(&[]))
            .is_none());

        // A retry that avoids the ucx prefill worker (it failed) takes the tcp pair.
        let (p_tcp, p_ucx) = ("127.0.0.1:12", "127.0.0.1:11");
        let pool = paired_pool(
            &[(p_ucx, Some(Ucx)), (p_tcp, Some(Tcp))],
            &[(d_tcp, Some(Tcp)), (d_ucx, Some(Ucx))],
        );
        let avoid = [p_ucx.to_string()];
        for _ in 0..4 {
            let d = pool.pick_decode_for(&[], PairWith::AnyBut(&avoid)).unwrap();
            assert_eq!(d.addr, d_tcp);
            let p = pool.pick_prefill_for(&prompt, &avoid, PairWith::Worker(&d));
            assert_eq!(p.unwrap().addr, p_tcp);
        }
    }

    #[tokio::test]
    async fn unknown_transports_pair_with_any_and_unset_means_tcp() {
        use v1::TransferBackend::{Tcp, Ucx};
        let pool = paired_pool(
            &[("127.0.0.1:11", None)],
            &[("127.0.0.1:21", Some(Ucx)), ("127.0.0.1:22", Some(Tcp))],
        );
        // A prefill worker that has not answered `Stats` yet may pair with either.
        let mut seen: Vec<String> = (0..4)
            .map(|_| pool.pick_decode(&[]).unwrap().addr.clone())
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 2, "{seen:?}");
        // Once it answers without the field (an older worker), it speaks TCP.
        let p = pool.worker(Role::Prefill, "127.0.0.1:11");
        p.observe_transport(v1::TransferBackend::Unspecified as i32);
        assert_eq!(p.transport(), Some(Tcp));
        for _ in 0..4 {
            assert_eq!(pool.pick_decode(&[]).unwrap().addr, "127.0.0.1:22");
        }
        // An empty prefill pool leaves the decode pick alone (the prefill pick reports it).
        let pool = paired_pool(&[], &[("127.0.0.1:21", Some(Ucx))]);
        assert!(pool.pick_decode(&[]).is_some());
    }

    #[tokio::test]
    async fn encoders_push_only_into_prefill_workers_of_their_transport() {
        use v1::TransferBackend::{Tcp, Ucx};
        let (p_ucx, d_ucx) = ("127.0.0.1:11", "127.0.0.1:22");
        let (e_tcp, e_ucx) = ("127.0.0.1:31", "127.0.0.1:32");
        let pool = paired_pool(&[(p_ucx, Some(Ucx))], &[(d_ucx, Some(Ucx))]);
        pool.add_encoders(&[e_tcp.to_string(), e_ucx.to_string()])
            .unwrap();
        pool.worker(Role::Encoder, e_tcp)
            .observe_transport(Tcp as i32);
        pool.worker(Role::Encoder, e_ucx)
            .observe_transport(Ucx as i32);
        let prefill = pool.worker(Role::Prefill, p_ucx);
        for key in 0..8 {
            assert_eq!(
                pool.pick_encoder_for(key, &[], &prefill).unwrap().addr,
                e_ucx
            );
        }
        assert!(pool
            .unpaired(Role::Encoder, &[], PairWith::Worker(&prefill))
            .is_none());
        // With the matching encoder out (it failed this request) none is left, and the reason
        // names both sides' transports.
        let avoid = [e_ucx.to_string()];
        assert!(pool.pick_encoder_for(0, &avoid, &prefill).is_none());
        let why = pool
            .unpaired(Role::Encoder, &avoid, PairWith::Worker(&prefill))
            .unwrap();
        assert!(
            why.contains(
                "no encoder worker speaks the page transport of prefill worker 127.0.0.1:11 (ucx)"
            ) && why.contains("127.0.0.1:31 (tcp)")
                && why.contains("--transport"),
            "{why}"
        );
    }
}
