//! Bytes land exactly where the batch says, on every backend, and nowhere else.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tessera_transfer::{TransferError, TransferId, Transport};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_random_extents_land_exactly() {
    let (a, b, peer) = tcp_pair(config(), config()).await;
    random_round_trips(&a, &b, peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_with_one_connection_and_no_checksums() {
    let mut ca = config();
    ca.connections_per_peer = 1;
    ca.checksums = false;
    ca.socket_buffer_bytes = Some(1 << 20);
    let (a, b, peer) = tcp_pair(ca, config()).await;
    random_round_trips(&a, &b, peer).await;
}

#[tokio::test]
async fn local_random_extents_land_exactly() {
    let (a, b, peer) = local_pair(config(), config()).await;
    random_round_trips(&a, &b, peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_concurrent_batches_to_one_peer() {
    let (a, b, peer) = tcp_pair(config(), config()).await;
    let regions = write_concurrent_batches(Arc::new(a), &b, peer).await;
    for id in concurrent_batch_ids() {
        b.wait_incoming(id, in_ms(1_000)).await.unwrap();
    }
    assert!(regions.landed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_regions_are_refused_before_any_byte_moves() {
    let (a, b, peer) = tcp_pair(config(), config()).await;
    let regions = Regions::register(&a, &b, 1 << 20, 4);

    // Past the end of the destination.
    let mut batch = regions.batch(1, 1, 4096);
    batch.extents[0].dst_offset = (1 << 20) - 100;
    assert!(matches!(
        a.write(peer, batch, in_ms(2_000)).await,
        Err(TransferError::BadRegion(_))
    ));

    // Overlapping destinations.
    let mut batch = regions.batch(2, 2, 4096);
    batch.extents[1].dst_offset = 100;
    assert!(matches!(
        a.write(peer, batch, in_ms(2_000)).await,
        Err(TransferError::BadRegion(_))
    ));

    // A source that is not registered.
    let stray = random_region(4096, 5);
    let batch = contiguous_batch(3, &stray, &regions.desc, 1, 4096);
    assert!(matches!(
        a.write(peer, batch, in_ms(2_000)).await,
        Err(TransferError::BadRegion(_))
    ));

    // A destination the peer deregistered: refused by the receiver, the connection stays usable.
    assert!(b.deregister(regions.desc.region_id));
    assert!(matches!(
        a.write(peer, regions.batch(4, 4, 4096), in_ms(2_000)).await,
        Err(TransferError::BadRegion(_))
    ));
    let desc = b.register(&regions.dst).unwrap();
    let batch = contiguous_batch(5, &regions.src, &desc, 4, 4096);
    a.write(peer, batch, in_ms(2_000)).await.unwrap();

    // The owner holds the destination extent: the receiver cannot lease it.
    destination_held_by_its_owner_is_refused(&a, &b, peer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_extents_stay_leased_until_completion() {
    // Two parts of 2 MB; the receiver drops the connection of whichever passes 1.5 MB first.
    let cb = config();
    cb.faults
        .drop_after_bytes
        .store(1_500_000, Ordering::Relaxed);
    let mut ca = config();
    ca.max_retries = 0;
    ca.connections_per_peer = 2;
    let (a, b, peer) = tcp_pair(ca, cb).await;
    let len = 1 << 20;
    let regions = Regions::register(&a, &b, 4 * len, 6);
    let batch = || regions.batch(9, 4, len as u64);
    let r = a.write(peer, batch(), in_ms(5_000)).await;
    assert!(matches!(r, Err(TransferError::Io(_))), "{r:?}");
    // The part that landed stays leased: the owner cannot see it before completion.
    let dst = &regions.dst;
    let busy = (0..4)
        .filter(|i| dst.try_read(i * len..(i + 1) * len).is_err())
        .count();
    assert_eq!(busy, 2);
    // The destination gives up: the leases go, and late bytes are refused.
    b.abandon_incoming(TransferId(9));
    assert!(dst.try_write(0..dst.len()).is_ok());
    let r = a.write(peer, batch(), in_ms(5_000)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
}
