//! The UCX backend, two transports in one process over loopback: bytes land exactly, the
//! handshake refuses strangers, corrupted extents are caught, deadlines hold, broken control
//! connections are retried.
#![cfg(feature = "ucx")]

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tessera_transfer::{
    Instant, RegionHandle, TransferError, TransferId, Transport, TransportConfig, UcxTransport,
};

use crate::common::*;

/// Checksums verified whatever the build profile.
fn checked() -> TransportConfig {
    let mut c = config();
    c.rma_checksums = true;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_random_extents_land_exactly() {
    let (a, b, peer) = ucx_pair(checked(), checked()).await;
    assert_eq!(a.kind(), "ucx");
    random_round_trips(&a, &b, peer).await;
}

/// Regions in memory UCX allocated: shared memory, which the sender maps and copies into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_shared_memory_regions_land_exactly() {
    let (a, b, peer) = ucx_pair(checked(), checked()).await;
    let src = a.alloc_region(8 << 20).unwrap();
    let dst = b.alloc_region(12 << 20).unwrap();
    assert_eq!(dst.len(), 12 << 20);
    assert_eq!(
        dst.as_ptr() as usize % tessera_transfer::region::REGION_ALIGN,
        0
    );
    assert!(read_all(&dst).iter().all(|&x| x == 0));
    random_round_trips_in(&a, &b, peer, src, dst.clone()).await;
    // The memory outlives the transport that allocated it while a handle remains.
    drop(b);
    assert_eq!(read_all(&dst).len(), 12 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_without_checksums_and_with_one_control_connection() {
    let mut ca = config();
    ca.checksums = false;
    ca.connections_per_peer = 1;
    let (a, b, peer) = ucx_pair(ca, config()).await;
    random_round_trips(&a, &b, peer).await;
}

/// UCX's peer-failure mode (endpoints with an error handler, closed by force).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_with_peer_failure_handling() {
    let mut ca = checked();
    ca.ucx_peer_failure = true;
    let mut cb = checked();
    cb.ucx_peer_failure = true;
    let (a, b, peer) = ucx_pair(ca, cb).await;
    random_round_trips(&a, &b, peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_concurrent_batches_and_reregistered_regions() {
    let (a, b, peer) = ucx_pair(checked(), checked()).await;
    let a: Arc<dyn Transport> = Arc::new(a);
    let regions = write_concurrent_batches(a.clone(), &b, peer).await;
    for id in concurrent_batch_ids() {
        b.wait_incoming(id, in_ms(1_000)).await.unwrap();
    }
    assert!(regions.landed());

    // Deregistered: refused by the destination before any put; registered again (a new remote
    // key), the sender picks up the new key.
    assert!(b.deregister(regions.desc.region_id));
    let r = a.write(peer, regions.batch(1, 4, 4096), in_ms(2_000)).await;
    assert!(matches!(r, Err(TransferError::BadRegion(_))), "{r:?}");
    let len = CONCURRENT_EXTENT;
    let fresh = RegionHandle::new(16 * len as usize);
    let desc = b.register(&fresh).unwrap();
    let batch = contiguous_batch(2, &regions.src, &desc, 4, len);
    a.write(peer, batch, in_ms(5_000)).await.unwrap();
    b.wait_incoming(TransferId(2), in_ms(1_000)).await.unwrap();
    let n = 4 * len as usize;
    assert!(read_all(&fresh)[..n] == read_all(&regions.src)[..n]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_destination_extents_leased_by_the_owner_are_refused() {
    let (a, b, peer) = ucx_pair(checked(), checked()).await;
    destination_held_by_its_owner_is_refused(&a, &b, peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_wrong_secret_is_refused_both_ways() {
    let a = UcxTransport::bind(other_secret()).await.unwrap();
    let b = UcxTransport::bind(config()).await.unwrap();
    wrong_secret_is_refused_both_ways(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_stale_incarnations_are_refused() {
    let (a, b, peer) = ucx_pair(config(), config()).await;
    stale_endpoint_is_refused(&a, &b).await;
    foreign_incarnation_descriptor_is_refused(&a, &b, peer).await;
    // A tcp endpoint is not a ucx one.
    let r = a.connect("tcp://127.0.0.1:1", in_ms(1_000)).await;
    assert!(matches!(r, Err(TransferError::PeerGone(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_corrupted_extent_is_caught_and_never_completes() {
    let cb = checked();
    let faults = cb.faults.clone();
    let (a, b, peer) = ucx_pair(checked(), cb).await;
    let err = corrupted_extent_then_fresh_write(&a, &b, peer, &faults).await;
    // The ucx path names the corrupted extent: the first.
    assert!(
        matches!(err, TransferError::ChecksumMismatch { extent: 0 }),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_deadlines_hold() {
    let cb = checked();
    let faults = cb.faults.clone();
    let (a, b, peer) = ucx_pair(checked(), cb).await;
    let regions = Regions::register(&a, &b, 1 << 20, 31);

    // Nobody sends: the wait ends at its deadline and abandons the transfer.
    let started = Instant::now();
    let w = b.wait_incoming(TransferId(1), in_ms(200)).await;
    assert!(matches!(w, Err(TransferError::Timeout)), "{w:?}");
    assert_on_time(started, 200);
    // A late sender is refused.
    let r = a.write(peer, regions.batch(1, 4, 4096), in_ms(2_000)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");

    // The destination stalls: the sender's write ends at its deadline.
    faults.stall_receive.store(true, Ordering::Relaxed);
    let started = Instant::now();
    let r = a.write(peer, regions.batch(2, 4, 4096), in_ms(300)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert_on_time(started, 300);
    let w = b.wait_incoming(TransferId(2), in_ms(100)).await;
    assert!(matches!(w, Err(TransferError::Timeout)), "{w:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_dropped_control_connection_is_retried() {
    let cb = checked();
    cb.faults.drop_after_bytes.store(1, Ordering::Relaxed);
    let (a, b, peer) = ucx_pair(checked(), cb).await;
    let len = 512 << 10;
    let regions = Regions::register(&a, &b, 4 * len, 41);
    let receipt = a
        .write(peer, regions.batch(7, 4, len as u64), in_ms(5_000))
        .await
        .unwrap();
    assert_eq!(receipt.attempts, 2);
    let done = b.wait_incoming(TransferId(7), in_ms(1_000)).await.unwrap();
    assert_eq!(done.bytes, 4 * len as u64);
    assert!(regions.landed());

    // Without retries the same fault is reported as an I/O error.
    let mut ca = checked();
    ca.max_retries = 0;
    let cb = checked();
    cb.faults.drop_after_bytes.store(1, Ordering::Relaxed);
    let (a, b, peer) = ucx_pair(ca, cb).await;
    a.register(&regions.src).unwrap();
    let desc = b.register(&regions.dst).unwrap();
    let batch = contiguous_batch(8, &regions.src, &desc, 4, len as u64);
    let r = a.write(peer, batch, in_ms(5_000)).await;
    assert!(matches!(r, Err(TransferError::Io(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_vanished_and_restarted_peers() {
    let (a, b, peer) = ucx_pair(checked(), checked()).await;
    let addr = b.local_addr();
    vanished_then_restarted(&a, peer, b, addr, |addr| async move {
        let mut cb = checked();
        cb.bind = addr;
        UcxTransport::bind(cb).await.unwrap()
    })
    .await;
}
