//! The destination's control connections: one task per accepted connection authenticates the
//! peer, then answers each batch's Begin (leasing the destination extents and handing out the
//! region's remote key) and Commit (verifying what the puts landed and recording completion).

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::wire::{
    Begin, Commit, DstExtent, Ready, UcxHello, COMMIT_LANDED, FLAG_CHECKSUMS, MAX_EXTENTS,
};
use super::{Node, RegionKey};
use crate::checksum;
use crate::incoming::PartStart;
use crate::plan;
use crate::region::{ExtentMut, Incarnation, RegionId};
use crate::tcp::server::{accept_connections, authenticate};
use crate::tcp::wire::Ack;
use crate::TransferError;

/// Accepts connections until aborted; aborting drops (and so aborts) every connection task.
pub(super) async fn accept_loop(node: Arc<Node>, listener: TcpListener) {
    accept_connections(listener, "ucx control", move |stream| {
        serve(node.clone(), stream)
    })
    .await
}

async fn serve(node: Arc<Node>, mut stream: TcpStream) {
    let Some(from) = authenticate(&node.config, &mut stream, "ucx control").await else {
        return;
    };
    let hello = UcxHello {
        port: node.ucx.listen_addr().port(),
    };
    if stream.write_all(&hello.encode()).await.is_err() {
        return;
    }
    loop {
        let mut head = [0u8; Begin::HEAD];
        if stream.read_exact(&mut head).await.is_err() {
            return; // the peer closed the connection: nothing is in flight.
        }
        if node.config.faults.stalled() {
            std::future::pending::<()>().await;
        }
        let begin = match read_begin(&mut stream, &head).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "malformed ucx begin");
                return;
            }
        };
        let (id, attempt) = (begin.transfer_id, begin.attempt);
        let held = match open(&node, &begin, from) {
            Ok(Some(held)) => held,
            Ok(None) => {
                // Already complete (a retry after a lost ack).
                if write_ack(&mut stream, Ack::new(id, attempt, Ok(()))).await {
                    continue;
                }
                return;
            }
            Err(e) => {
                if write_ack(&mut stream, Ack::new(id, attempt, Err(&e))).await {
                    continue;
                }
                return;
            }
        };
        let ready = Ready {
            generation: held.key.generation,
            base: held.key.base,
            rkey: if begin.known_generation == held.key.generation {
                Vec::new()
            } else {
                held.key.packed.to_vec()
            },
        };
        if stream.write_all(&ready.encode()).await.is_err() {
            return;
        }
        // The sender's puts land now. Its Commit comes once they all did (or failed); until
        // then the leases stay held, even past the transfer's deadline, since bytes may still
        // arrive. A connection that ends or stays silent for the incoming TTL frees them.
        let commit = match tokio::time::timeout(node.config.incoming_ttl, read_commit(&mut stream))
            .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, transfer = %id, "ucx control connection broke mid-transfer");
                return;
            }
            Err(_) => {
                tracing::warn!(transfer = %id, "no ucx commit within the incoming TTL");
                return;
            }
        };
        if commit.transfer_id != id || commit.attempt != attempt {
            tracing::warn!(transfer = %id, "ucx commit for another transfer");
            return;
        }
        let Some(ack) = finish(&node, &begin, held, &commit) else {
            return; // fault injection: drop the connection instead of acknowledging.
        };
        if !write_ack(&mut stream, ack).await {
            return;
        }
    }
}

async fn write_ack(stream: &mut TcpStream, ack: Ack) -> bool {
    stream.write_all(&ack.encode()).await.is_ok()
}

async fn read_begin(
    stream: &mut TcpStream,
    head: &[u8; Begin::HEAD],
) -> Result<Begin, TransferError> {
    let (mut begin, count) = Begin::decode_head(head)?;
    // The count comes from the peer: let the bytes that arrive, not the count, size the list.
    begin.extents.reserve(count.min(1024) as usize);
    let mut buf = [0u8; DstExtent::LEN * 64];
    let mut left = count as usize;
    while left > 0 {
        let n = left.min(64);
        stream.read_exact(&mut buf[..n * DstExtent::LEN]).await?;
        begin.extents.extend(
            buf[..n * DstExtent::LEN]
                .chunks(DstExtent::LEN)
                .map(DstExtent::decode),
        );
        left -= n;
    }
    debug_assert!(begin.extents.len() as u32 <= MAX_EXTENTS);
    Ok(begin)
}

async fn read_commit(stream: &mut TcpStream) -> Result<Commit, TransferError> {
    let mut head = [0u8; Commit::HEAD];
    stream.read_exact(&mut head).await?;
    let (mut commit, count) = Commit::decode_head(&head)?;
    commit.checksums.reserve(count.min(1024) as usize);
    let mut buf = [0u8; 4];
    for _ in 0..count {
        stream.read_exact(&mut buf).await?;
        commit.checksums.push(u32::from_le_bytes(buf));
    }
    Ok(commit)
}

/// A transfer between Begin and Commit: its destination extents, leased.
struct Held {
    leases: Vec<ExtentMut>,
    key: RegionKey,
}

/// Checks a Begin and leases its extents; `None` when the transfer already completed.
fn open(node: &Node, begin: &Begin, from: Incarnation) -> Result<Option<Held>, TransferError> {
    let own = node.config.incarnation;
    if begin.dst_incarnation != own {
        return Err(TransferError::IncarnationMismatch {
            expected: begin.dst_incarnation,
            found: own,
        });
    }
    let region_id = RegionId(begin.dst_region);
    let not_registered =
        || TransferError::BadRegion(format!("region {} is not registered", begin.dst_region));
    let region = node.regions.get(region_id).ok_or_else(not_registered)?;
    let key = node.key(region_id).ok_or_else(not_registered)?;
    let (id, attempt) = (begin.transfer_id, begin.attempt);
    let count = begin.extents.len() as u32;
    match node.incoming.begin_part(id, attempt, count, from) {
        PartStart::Proceed => {}
        PartStart::AlreadyComplete => return Ok(None),
        PartStart::Refuse(e) => return Err(e),
    }
    let mut leases = Vec::with_capacity(begin.extents.len());
    for (i, e) in begin.extents.iter().enumerate() {
        let lease = node
            .incoming
            .check_live(id, attempt)
            .and_then(|()| plan::check_dst(region.len() as u64, e.offset, e.len, i))
            .and_then(|()| {
                let at = e.offset as usize;
                Ok(region.try_write(at..at + e.len as usize)?)
            });
        match lease {
            Ok(l) => leases.push(l),
            Err(err) => {
                if let TransferError::BadRegion(_) = err {
                    // Final for this attempt: tell the destination's waiter now.
                    node.incoming.fail(id, attempt, err.clone());
                }
                return Err(err);
            }
        }
    }
    Ok(Some(Held { leases, key }))
}

/// Verifies what landed and records the completion; the ack to send, or `None` to drop the
/// connection (fault injection).
fn finish(node: &Node, begin: &Begin, held: Held, commit: &Commit) -> Option<Ack> {
    let (id, attempt) = (begin.transfer_id, begin.attempt);
    if commit.status != COMMIT_LANDED {
        // The sender's puts failed or it gave up; it retries or reports. The leases go now.
        let e = TransferError::protocol("the sender abandoned the attempt");
        return Some(Ack::new(id, attempt, Err(&e)));
    }
    let checksums = begin.flags & FLAG_CHECKSUMS != 0;
    if checksums && commit.checksums.len() != held.leases.len() {
        let e = TransferError::protocol("commit carries the wrong number of checksums");
        return Some(Ack::new(id, attempt, Err(&e)));
    }
    let faults = &node.config.faults;
    let mut leases = held.leases;
    let mut bytes = 0u64;
    for (i, lease) in leases.iter_mut().enumerate() {
        if !lease.is_empty() && faults.take_corruption() {
            lease[0] ^= 0x5a;
        }
        if checksums && checksum::extent_checksum(lease) != commit.checksums[i] {
            let err = TransferError::ChecksumMismatch { extent: i as u32 };
            node.incoming.fail(id, attempt, err.clone());
            return Some(Ack::new(id, attempt, Err(&err)));
        }
        bytes += lease.len() as u64;
    }
    if let Some(limit) = faults.take_drop_after() {
        if bytes >= limit {
            return None;
        }
        // Smaller than the armed count: leave the rest armed for the next transfer.
        let _ = faults.drop_after_bytes.compare_exchange(
            0,
            limit - bytes,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let count = leases.len() as u32;
    let result = node.incoming.finish_part(id, attempt, count, bytes, leases);
    Some(Ack::new(id, attempt, result.as_ref().map(|_| ())))
}
