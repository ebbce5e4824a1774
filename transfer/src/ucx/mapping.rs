//! A peer's region mapped into this process: the sender's side of a same-host transfer into
//! shared memory, copied by the sending task itself.
//!
//! When a destination region is UCX shared memory, `ucp_rkey_ptr` maps it into the sender's
//! address space, and a put is nothing but a copy (`copy.rs`). Done on the progress thread, each
//! batch paid two thread hand-offs (the put command there, its completion back), which on a
//! loaded two-core host cost up to a fifth of a 28 MB batch's time; so the progress thread only
//! resolves the mapping, once per remote key, and the task that sends the batch copies.
//!
//! The mapping lives as long as its remote key. Every [`Mapping`] carries a pin; the progress
//! thread, asked to destroy a key (forgotten, its endpoint closed or reset), keeps it while any
//! pin other than its own is alive. New pins come only from clones of live ones, so once the
//! thread holds the last one no copy can start or still run.

use std::sync::Arc;

use super::copy_pool::{copy_pieces, Piece, PIECE};
use crate::checksum;

/// A peer's region mapped here: `len` bytes at the peer's address `remote` are at `local`.
#[derive(Clone, Debug)]
pub(crate) struct Mapping {
    local: usize,
    remote: u64,
    len: u64,
    _pin: Arc<()>,
}

impl Mapping {
    /// A mapping of `len` bytes at the peer's `remote` to `local` here, and the pin the progress
    /// thread keeps with the remote key.
    pub(super) fn new(local: *mut u8, remote: u64, len: u64) -> (Self, Arc<()>) {
        let pin = Arc::new(());
        let m = Mapping {
            local: local as usize,
            remote,
            len,
            _pin: pin.clone(),
        };
        (m, pin)
    }

    /// Where `len` bytes at the peer's `remote_addr` lie here; `None` outside the mapping.
    fn target(&self, remote_addr: u64, len: u64) -> Option<*mut u8> {
        let offset = remote_addr.checked_sub(self.remote)?;
        (offset.checked_add(len)? <= self.len).then(|| (self.local + offset as usize) as *mut u8)
    }

    /// Copies each `(source, peer address)` pair into the mapping and returns the sources'
    /// checksums (none unless `checksums`: each piece is checksummed right after its copy, while
    /// it is in cache); `None`, with nothing copied, when any pair lies outside the mapping.
    /// Idle helper threads share large batches (`copy_pool`). Once it returns, the bytes are
    /// visible to the peer.
    pub fn copy_all(&self, puts: &[(&[u8], u64)], checksums: bool) -> Option<Vec<u32>> {
        let targets = puts
            .iter()
            .map(|(src, remote_addr)| self.target(*remote_addr, src.len() as u64))
            .collect::<Option<Vec<*mut u8>>>()?;
        let mut pieces = Vec::new();
        let mut extent_pieces = Vec::with_capacity(puts.len());
        for ((src, _), dst) in puts.iter().zip(targets) {
            let before = pieces.len();
            pieces.extend(src.chunks(PIECE).enumerate().map(|(i, chunk)| Piece {
                src: chunk.as_ptr(),
                // SAFETY: inside the extent's destination, checked above.
                dst: unsafe { dst.add(i * PIECE) },
                len: chunk.len(),
            }));
            extent_pieces.push(before..pieces.len());
        }
        // SAFETY: every destination lies inside the mapping (checked above), which stays mapped
        // while `self` (a pin on its remote key) lives, and the destination answered Ready for
        // exactly these extents of the region behind the key, so nothing else writes them. The
        // sources are the caller's live slices of our own memory, which the peer's region cannot
        // overlap; distinct extents of one batch do not overlap (the plan checks that).
        let crcs = unsafe { copy_pieces(pieces, checksums) };
        if !checksums {
            return Some(Vec::new());
        }
        let sums = puts
            .iter()
            .zip(extent_pieces)
            .map(|((src, _), range)| {
                let lens = src.chunks(PIECE).map(|c| c.len());
                crcs[range]
                    .iter()
                    .zip(lens)
                    .fold(None, |acc, (&crc, len)| match acc {
                        None => Some(crc),
                        Some(acc) => Some(checksum::combine(acc, crc, len)),
                    })
                    .unwrap_or(0)
            })
            .collect();
        Some(sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_inside_the_mapping_only() {
        let mut peer = vec![0u8; 4096];
        let (m, pin) = Mapping::new(peer.as_mut_ptr(), 0x10_0000, 4096);
        let a = vec![7u8; 100];
        let b = vec![9u8; 50];
        let sums = m.copy_all(&[(&a, 0x10_0000 + 10), (&b, 0x10_0000 + 4046)], true);
        assert_eq!(
            sums,
            Some(vec![
                checksum::extent_checksum(&a),
                checksum::extent_checksum(&b)
            ])
        );
        assert_eq!(m.copy_all(&[(&b, 0x10_0000 + 200)], false), Some(vec![]));
        assert!(
            m.copy_all(&[(&a, 0x10_0000 + 4000)], true).is_none(),
            "past the end"
        );
        assert!(
            m.copy_all(&[(&a, 0x0f_ffff)], false).is_none(),
            "before the start"
        );
        assert!(
            m.copy_all(&[(&a, u64::MAX - 10)], false).is_none(),
            "overflow"
        );
        drop(m);
        assert_eq!(Arc::strong_count(&pin), 1);
        // Longer than a checksum chunk, at an odd offset: every chunk lands in its place.
        let mut big_peer = vec![0u8; 3 * PIECE];
        let (m, _pin) = Mapping::new(big_peer.as_mut_ptr(), 0, big_peer.len() as u64);
        let big: Vec<u8> = (0..2 * PIECE + 333).map(|i| (i * 7 % 251) as u8).collect();
        let sums = m.copy_all(&[(&big, 77)], true).unwrap();
        assert_eq!(sums, vec![checksum::extent_checksum(&big)]);
        assert_eq!(&big_peer[77..77 + big.len()], &big[..]);
        assert!(peer[10..110].iter().all(|&x| x == 7));
        assert!(peer[200..250].iter().chain(&peer[4046..]).all(|&x| x == 9));
        let mut untouched = peer[..10]
            .iter()
            .chain(&peer[110..200])
            .chain(&peer[250..4046]);
        assert!(untouched.all(|&x| x == 0));
    }
}
