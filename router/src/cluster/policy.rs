//! Placement policies (DESIGN §4), as pure functions over candidate snapshots so they can be
//! tested without a cluster.
//!
//! - decode: least loaded (in-flight requests the router tracks, plus the worker's own
//!   `running + waiting` from its last `Stats`), ties broken round robin;
//! - prefill: prefix affinity (a hash of the prompt's first page picks a worker by rendezvous
//!   hashing, so equal prefixes land where their pages are cached), then load: the affinity pick
//!   is abandoned when it has `slack` more requests in flight than the least loaded worker;
//! - pairing: a prefill worker writes pages only into a decode worker of the same page transport
//!   ([`can_pair`]).

use std::hash::{BuildHasher, Hasher};

use tessera_proto::v1::TransferBackend;

/// What a policy sees of one candidate worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub addr: &'a str,
    /// Requests this router has in flight on it.
    pub inflight: usize,
    /// `running + waiting` the worker reported in its last `Stats` (0 if unknown).
    pub remote_load: usize,
}

impl Candidate<'_> {
    fn load(&self) -> usize {
        self.inflight.max(self.remote_load)
    }
}

/// A deterministic 64-bit hash (FxHash-like mixing; stable across processes and runs).
fn mix(mut h: u64, x: u64) -> u64 {
    h ^= x
        .wrapping_add(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(h << 6)
        .wrapping_add(h >> 2);
    h.wrapping_mul(0xff51_afd7_ed55_8ccd)
}

/// Hash of the prompt's first `page_tokens` ids; `None` when the prompt has no full page (then
/// no prefix can be cached and only load matters).
pub fn prefix_key(prompt: &[u32], page_tokens: usize) -> Option<u64> {
    if page_tokens == 0 || prompt.len() < page_tokens {
        return None;
    }
    Some(
        prompt[..page_tokens]
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |h, &t| mix(h, t as u64)),
    )
}

/// Rendezvous (highest random weight) score of `addr` for `key`.
pub fn rendezvous_score(key: u64, addr: &str) -> u64 {
    let mut h = key;
    for b in addr.bytes() {
        h = mix(h, b as u64);
    }
    mix(h, key)
}

/// Index of the least loaded candidate; among equals the first at or after `rr % len`.
pub fn least_loaded(cands: &[Candidate<'_>], rr: usize) -> Option<usize> {
    let n = cands.len();
    let min = cands.iter().map(Candidate::load).min()?;
    (0..n)
        .map(|i| (rr + i) % n)
        .find(|&i| cands[i].load() == min)
}

/// Index of the prefill worker for a prompt whose prefix key is `key` (see the module docs).
pub fn prefill_choice(
    cands: &[Candidate<'_>],
    key: Option<u64>,
    slack: usize,
    rr: usize,
) -> Option<usize> {
    let least = least_loaded(cands, rr)?;
    let Some(key) = key else {
        return Some(least);
    };
    let best = (0..cands.len()).max_by_key(|&i| rendezvous_score(key, cands[i].addr))?;
    if cands[best].load() > cands[least].load() + slack {
        Some(least)
    } else {
        Some(best)
    }
}

/// Whether two workers can move pages between them: they speak the same transport. A worker
/// whose transport is not known yet (`None`: no `Stats` answer so far) may pair with any; the
/// prefill worker's transfer handshake still refuses a mismatched pair.
pub fn can_pair(a: Option<TransferBackend>, b: Option<TransferBackend>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// `tcp`, `ucx`, … or `unknown`, for messages.
pub fn transport_name(t: Option<TransferBackend>) -> &'static str {
    t.map_or("unknown", TransferBackend::name)
}

/// A fresh random sampling seed (the router fixes one so prefill and decode agree).
pub fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(addr: &str, inflight: usize) -> Candidate<'_> {
        Candidate {
            addr,
            inflight,
            remote_load: 0,
        }
    }

    #[test]
    fn only_equal_or_unknown_transports_pair() {
        use TransferBackend::{Tcp, Ucx};
        assert!(can_pair(Some(Tcp), Some(Tcp)));
        assert!(can_pair(Some(Ucx), Some(Ucx)));
        assert!(!can_pair(Some(Tcp), Some(Ucx)));
        assert!(!can_pair(Some(Ucx), Some(Tcp)));
        assert!(can_pair(None, Some(Ucx)) && can_pair(Some(Tcp), None) && can_pair(None, None));
        assert_eq!(transport_name(Some(Ucx)), "ucx");
        assert_eq!(transport_name(None), "unknown");
    }

    #[test]
    fn least_loaded_breaks_ties_round_robin() {
        let cs = [c("a", 1), c("b", 0), c("c", 0)];
        assert_eq!(least_loaded(&cs, 0), Some(1));
        assert_eq!(least_loaded(&cs, 2), Some(2));
        assert_eq!(least_loaded(&cs, 3), Some(1));
        assert_eq!(least_loaded(&[], 0), None);
        let remote = [
            Candidate {
                addr: "a",
                inflight: 0,
                remote_load: 5,
            },
            c("b", 1),
        ];
        assert_eq!(least_loaded(&remote, 0), Some(1));
    }

    #[test]
    fn prefix_affinity_is_stable_and_yields_to_load() {
        let prompt: Vec<u32> = (0..40).collect();
        let key = prefix_key(&prompt, 16);
        assert_eq!(key, prefix_key(&prompt[..16], 16));
        assert_eq!(prefix_key(&prompt[..15], 16), None);
        let cs = [c("p0", 0), c("p1", 0), c("p2", 0)];
        let pick = prefill_choice(&cs, key, 4, 0).unwrap();
        for rr in 0..5 {
            assert_eq!(prefill_choice(&cs, key, 4, rr), Some(pick));
        }
        // Removing another worker keeps the pick (rendezvous hashing).
        let other: Vec<_> = cs
            .iter()
            .copied()
            .enumerate()
            .filter(|&(i, _)| i != (pick + 1) % 3)
            .map(|(_, c)| c)
            .collect();
        assert_eq!(
            other[prefill_choice(&other, key, 4, 0).unwrap()].addr,
            cs[pick].addr
        );
        // Overloaded affinity target: the least loaded one wins.
        let mut loaded = cs;
        loaded[pick].inflight = 10;
        assert_ne!(prefill_choice(&loaded, key, 4, 0), Some(pick));
        // Different prefixes spread over workers.
        let picks: std::collections::HashSet<usize> = (0..64u32)
            .map(|s| {
                let p: Vec<u32> = (s..s + 16).collect();
                prefill_choice(&cs, prefix_key(&p, 16), 4, 0).unwrap()
            })
            .collect();
        assert_eq!(picks.len(), 3);
    }
}
