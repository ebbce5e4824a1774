//! A batch's copies into a peer's shared memory, shared with helper threads when they are free.
//!
//! One core copying with streaming stores leaves memory bandwidth unused (on the two-core
//! development VM, quiet: 26 GB/s from one thread, 31 GB/s from two). A batch is cut into pieces
//! of [`PIECE`] bytes; the sending thread claims pieces one at a time from the front, and so does
//! every helper that is idle when the batch is posted. The sender never hands work out that it
//! could not also take back: it stops only when every piece is claimed, and then waits at most
//! for the pieces a helper has in hand. On a loaded host the helpers seldom run and the sender
//! copies nearly everything itself, as it did alone (a static half-and-half split made a batch
//! wait for the slower half: 12.3 → 8.5 GB/s on the loaded VM).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::copy::{copy_to_shared_as, streams};
use crate::checksum::{self, STREAM_CHUNK};

/// Bytes per claim: small enough that a helper's last piece is a short wait (about 15 µs at
/// 18 GB/s), and checksummed right after its copy, while in cache.
pub(crate) const PIECE: usize = STREAM_CHUNK;

/// Batches shorter than this are copied by the sender alone (waking a helper costs more).
const SHARE_MIN: usize = 4 << 20;

/// Most helper threads (fewer where the host has fewer cores).
const MAX_HELPERS: usize = 3;

/// One piece: `len` bytes from `src` to `dst`.
pub(crate) struct Piece {
    pub src: *const u8,
    pub dst: *mut u8,
    pub len: usize,
}

/// A batch being copied: its pieces, the next one to claim, how many are done and, with
/// checksums, each piece's CRC32C.
struct Job {
    pieces: Vec<Piece>,
    checksums: bool,
    /// Non-temporal stores for every piece when the batch is long enough for them (its last,
    /// shorter pieces too).
    streaming: bool,
    next: AtomicUsize,
    done: AtomicUsize,
    crcs: Vec<AtomicU32>,
}

// SAFETY: a job's pointers are dereferenced only by the thread that claimed the piece (a unique
// index from `next`), and only while the sender waits in `copy_pieces`: it returns only once
// `done` counts every piece, and claims made after that find no piece left. The caller of
// `copy_pieces` guarantees the memory behind them for that long.
unsafe impl Send for Job {}
// SAFETY: as above; the shared state is atomics.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and copies pieces until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.pieces.get(i) else { return };
            // SAFETY: piece `i` is this thread's alone (see `Job`); the caller of
            // `copy_pieces` vouched for both ranges, which do not overlap.
            unsafe { copy_to_shared_as(p.dst, p.src, p.len, self.streaming) };
            if self.checksums {
                // SAFETY: as above; the source is only read.
                let src = unsafe { std::slice::from_raw_parts(p.src, p.len) };
                self.crcs[i].store(checksum::extent_checksum(src), Ordering::Relaxed);
            }
            // Release: the piece's stores (fenced by the copy) and its CRC before the count.
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// The helper threads and the batches posted to them.
struct Pool {
    posted: Mutex<Vec<Arc<Job>>>,
    wake: Condvar,
    helpers: usize,
}

impl Pool {
    fn posted(&self) -> MutexGuard<'_, Vec<Arc<Job>>> {
        // The lock guards a plain list that no holder leaves half-changed.
        self.posted.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The process's helpers, started on first use: one fewer than the cores, at most
/// [`MAX_HELPERS`] (none on one core, or where a thread cannot be started).
fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Pool {
            posted: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            helpers: cores.saturating_sub(1).min(MAX_HELPERS),
        }
    });
    STARTED.get_or_init(|| {
        for i in 0..pool.helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("tessera-copy-{i}"))
                .spawn(move || helper(pool));
            if let Err(e) = spawned {
                tracing::warn!("copy helper {i} not started: {e}");
            }
        }
    });
    pool
}

fn helper(pool: &'static Pool) {
    loop {
        let job = {
            let mut posted = pool.posted();
            loop {
                if let Some(job) = posted.pop() {
                    break job;
                }
                posted = pool.wake.wait(posted).unwrap_or_else(|e| e.into_inner());
            }
        };
        job.work();
    }
}

/// Copies every piece (with helpers for batches of [`SHARE_MIN`] bytes or more) and returns
/// their CRC32Cs (empty unless `checksums`). Once it returns, every byte is visible to the peer.
///
/// # Safety
/// Each piece's `src` must be readable and `dst` writable for `len` bytes until this returns,
/// no destination may overlap another piece's source or destination, and nothing else may
/// write them meanwhile.
pub(crate) unsafe fn copy_pieces(pieces: Vec<Piece>, checksums: bool) -> Vec<u32> {
    let n = pieces.len();
    let bytes: usize = pieces.iter().map(|p| p.len).sum();
    let job = Arc::new(Job {
        crcs: (0..if checksums { n } else { 0 })
            .map(|_| AtomicU32::new(0))
            .collect(),
        pieces,
        checksums,
        streaming: streams(bytes),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    let pool = (bytes >= SHARE_MIN && n > 1).then(pool);
    let shared = pool.filter(|p| p.helpers > 0);
    if let Some(pool) = shared {
        let mut posted = pool.posted();
        for _ in 0..pool.helpers.min(n - 1) {
            posted.push(job.clone());
        }
        drop(posted);
        pool.wake.notify_all();
    }
    job.work();
    if let Some(pool) = shared {
        // Posts no idle helper took would only be found empty later: drop them now.
        pool.posted().retain(|j| !Arc::ptr_eq(j, &job));
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < n {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
    job.crcs.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` bytes of a pattern seeded by `seed`, cut into pieces copied to `dst` at offset 32.
    fn copy_pattern(seed: usize, len: usize, dst: &mut [u8]) -> (Vec<u8>, Vec<u32>) {
        let src: Vec<u8> = (0..len).map(|i| ((i + seed) * 29 % 253) as u8).collect();
        let pieces: Vec<Piece> = src
            .chunks(PIECE)
            .enumerate()
            .map(|(i, c)| Piece {
                src: c.as_ptr(),
                // SAFETY: inside `dst`, which holds len + 64 bytes.
                dst: unsafe { dst.as_mut_ptr().add(32 + i * PIECE) },
                len: c.len(),
            })
            .collect();
        // SAFETY: both buffers outlive the call; the ranges do not overlap.
        let sums = unsafe { copy_pieces(pieces, true) };
        (src, sums)
    }

    #[test]
    fn concurrent_batches_share_the_helpers_and_each_lands_whole() {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..6 {
                        let len = SHARE_MIN + (t * 7 + round) * 4099;
                        let mut dst = vec![0u8; len + 64];
                        let (src, sums) = copy_pattern(t * 100 + round, len, &mut dst);
                        let want: Vec<u32> =
                            src.chunks(PIECE).map(checksum::extent_checksum).collect();
                        assert_eq!(sums, want, "thread {t} round {round}");
                        assert_eq!(&dst[32..32 + len], &src[..], "thread {t} round {round}");
                        assert!(dst[..32].iter().chain(&dst[32 + len..]).all(|&b| b == 0));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a copying thread panicked");
        }
    }

    #[test]
    fn every_piece_lands_with_its_checksum_shared_or_not() {
        for len in [3 * PIECE + 17, SHARE_MIN * 2 + 5] {
            let mut dst = vec![0u8; len + 64];
            let (src, sums) = copy_pattern(0, len, &mut dst);
            let want: Vec<u32> = src.chunks(PIECE).map(checksum::extent_checksum).collect();
            assert_eq!(sums, want, "len {len}");
            assert_eq!(&dst[32..32 + len], &src[..]);
            assert!(dst[..32].iter().chain(&dst[32 + len..]).all(|&b| b == 0));
        }
    }
}
