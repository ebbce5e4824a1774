//! What an encoder keeps between calls.
//!
//! - [`EmbeddingCache`]: recent embeddings by image hash, within a byte budget (least recently
//!   used out first). The router sends an image to the encoder its hash prefers, so a repeated
//!   image (a conversation's next turn, a retry on another prefill worker) is not encoded again.
//! - [`HeldEmbeddings`]: embeddings an `Encode` without destination left here for a later
//!   consumer, each under a handle, until `Release` or its TTL.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tessera_engine::vision::ImageEmbedding;

fn bytes_of(e: &ImageEmbedding) -> usize {
    e.values.len() * 4
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Recent embeddings by image hash.
pub struct EmbeddingCache {
    budget: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    map: HashMap<[u8; 32], Arc<ImageEmbedding>>,
    /// Hashes, least recently used first (a hash may appear more than once; only its last
    /// occurrence counts).
    order: VecDeque<[u8; 32]>,
    bytes: usize,
}

impl EmbeddingCache {
    /// A cache of at most `budget` bytes of embeddings (0 turns it off).
    pub fn new(budget: usize) -> Self {
        EmbeddingCache {
            budget,
            inner: Mutex::default(),
        }
    }

    pub fn get(&self, hash: &[u8; 32]) -> Option<Arc<ImageEmbedding>> {
        let mut c = lock(&self.inner);
        let e = c.map.get(hash).cloned()?;
        c.order.push_back(*hash);
        if c.order.len() > 4 * c.map.len() + 16 {
            let CacheInner { map, order, .. } = &mut *c;
            let mut seen = std::collections::HashSet::new();
            let mut kept: Vec<[u8; 32]> = order
                .iter()
                .rev()
                .filter(|h| map.contains_key(*h) && seen.insert(**h))
                .copied()
                .collect();
            kept.reverse();
            *order = kept.into();
        }
        Some(e)
    }

    pub fn insert(&self, e: Arc<ImageEmbedding>) {
        let size = bytes_of(&e);
        if size > self.budget {
            return;
        }
        let mut c = lock(&self.inner);
        if let Some(old) = c.map.insert(e.content_hash, e.clone()) {
            c.bytes -= bytes_of(&old);
        }
        c.bytes += size;
        c.order.push_back(e.content_hash);
        while c.bytes > self.budget {
            let Some(h) = c.order.pop_front() else { break };
            // Evict only at a hash's last use.
            if c.order.contains(&h) {
                continue;
            }
            if let Some(old) = c.map.remove(&h) {
                c.bytes -= bytes_of(&old);
            }
        }
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        let c = lock(&self.inner);
        (c.map.len(), c.bytes)
    }
}

struct Held {
    request_id: String,
    embedding: Arc<ImageEmbedding>,
    expires: Instant,
}

/// Embeddings kept on this encoder under handles.
#[derive(Default)]
pub struct HeldEmbeddings {
    held: Mutex<HashMap<String, Held>>,
    next: AtomicU64,
    pub expired: AtomicU64,
}

impl HeldEmbeddings {
    /// Keeps `e` until `expires`; returns its handle id.
    pub fn hold(&self, request_id: &str, e: Arc<ImageEmbedding>, expires: Instant) -> String {
        let id = format!("enc-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        lock(&self.held).insert(
            id.clone(),
            Held {
                request_id: request_id.to_string(),
                embedding: e,
                expires,
            },
        );
        id
    }

    /// Frees the named handles of `request_id` (all of its handles when `ids` is empty).
    pub fn release(&self, request_id: &str, ids: &[String]) -> usize {
        let mut held = lock(&self.held);
        let before = held.len();
        held.retain(|id, h| h.request_id != request_id || !(ids.is_empty() || ids.contains(id)));
        before - held.len()
    }

    /// Frees what outlived its TTL.
    pub fn expire(&self, now: Instant) -> usize {
        let mut held = lock(&self.held);
        let before = held.len();
        held.retain(|_, h| h.expires > now);
        let n = before - held.len();
        self.expired.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Handles and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        let held = lock(&self.held);
        (
            held.len(),
            held.values().map(|h| bytes_of(&h.embedding)).sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn emb(tag: u8, n: usize) -> Arc<ImageEmbedding> {
        Arc::new(ImageEmbedding {
            content_hash: [tag; 32],
            n_tokens: n,
            hidden: 1,
            values: vec![0.0; n],
        })
    }

    #[test]
    fn the_cache_keeps_the_most_recently_used_within_budget() {
        let c = EmbeddingCache::new(40);
        c.insert(emb(1, 4));
        c.insert(emb(2, 4));
        assert!(c.get(&[1; 32]).is_some());
        c.insert(emb(3, 4));
        assert!(c.get(&[2; 32]).is_none(), "least recently used goes first");
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        assert_eq!(c.usage(), (2, 32));
        c.insert(emb(4, 100));
        assert_eq!(c.usage().0, 2, "larger than the budget: not cached");
        assert!(EmbeddingCache::new(0).get(&[1; 32]).is_none());
    }

    #[test]
    fn held_embeddings_go_on_release_or_ttl() {
        let h = HeldEmbeddings::default();
        let now = Instant::now();
        let a = h.hold("r1", emb(1, 2), now + Duration::from_secs(60));
        h.hold("r1", emb(2, 2), now + Duration::from_secs(60));
        h.hold("r2", emb(3, 2), now + Duration::from_millis(1));
        assert_eq!(
            h.release("r2", std::slice::from_ref(&a)),
            0,
            "another request's handle"
        );
        assert_eq!(h.release("r1", &[a]), 1);
        assert_eq!(h.expire(now + Duration::from_secs(1)), 1);
        assert_eq!(h.release("r1", &[]), 1);
        assert_eq!(h.usage(), (0, 0));
    }
}
