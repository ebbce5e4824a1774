//! Fault injection: corrupted bytes, stalled and vanished peers, dropped connections. Nothing
//! may hang past its deadline; only I/O failures are retried.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tessera_transfer::{Instant, TcpTransport, TransferError, TransferId, Transport};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_corrupted_extent_is_caught_and_never_completes() {
    let cb = config();
    let faults = cb.faults.clone();
    let (a, b, peer) = tcp_pair(config(), cb).await;
    corrupted_extent_then_fresh_write(&a, &b, peer, &faults).await;
}

#[tokio::test]
async fn local_corrupted_extent_is_caught() {
    let cb = config();
    let faults = cb.faults.clone();
    let (a, b, peer) = local_pair(config(), cb).await;
    let err = corrupted_extent_then_fresh_write(&a, &b, peer, &faults).await;
    // The local path names the corrupted extent: the first.
    assert!(
        matches!(err, TransferError::ChecksumMismatch { extent: 0 }),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_listener_that_never_answers_times_out() {
    // Accepts, never reads or writes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = listener.accept().await.unwrap();
            held.push(s);
        }
    });
    let a = TcpTransport::bind(config()).await.unwrap();
    let started = Instant::now();
    let r = a.connect(&format!("tcp://{addr}"), in_ms(300)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert_on_time(started, 300);
    hold.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_to_a_stalled_peer_times_out() {
    let cb = config();
    let faults = cb.faults.clone();
    let (a, b, peer) = tcp_pair(config(), cb).await;
    // Far more than the socket buffers of four connections can absorb.
    let len = 8 << 20;
    let regions = Regions::register(&a, &b, 16 * len, 13);
    faults.stall_receive.store(true, Ordering::Relaxed);
    let started = Instant::now();
    let r = a
        .write(peer, regions.batch(1, 16, len as u64), in_ms(500))
        .await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert_on_time(started, 500);
    // The destination's wait ends at its deadline too.
    let started = Instant::now();
    let w = b.wait_incoming(TransferId(1), in_ms(200)).await;
    assert!(matches!(w, Err(TransferError::Timeout)), "{w:?}");
    assert_on_time(started, 200);
    // The source's extents are released once the write returned.
    let src = &regions.src;
    assert!(src.try_write(0..src.len()).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_errors_then_a_retry_succeeds() {
    let cb = config();
    let faults = cb.faults.clone();
    let mut ca = config();
    ca.max_retries = 0;
    let (a, b, peer) = tcp_pair(ca, cb).await;
    let len = 1_769_472;
    let regions = Regions::register(&a, &b, 16 * len, 14);
    let batch = || regions.batch(1, 16, len as u64);

    faults.drop_after_bytes.store(3_000_000, Ordering::Relaxed);
    let started = Instant::now();
    let r = a.write(peer, batch(), in_ms(5_000)).await;
    assert!(matches!(r, Err(TransferError::Io(_))), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "an error, not a hang"
    );

    // The caller retries the same transfer: the broken connection is dialled again.
    let receipt = a.write(peer, batch(), in_ms(5_000)).await.unwrap();
    assert_eq!(receipt.attempts, 1);
    b.wait_incoming(TransferId(1), in_ms(1_000)).await.unwrap();
    assert!(regions.landed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_is_retried_transparently() {
    let cb = config();
    let faults = cb.faults.clone();
    let (a, b, peer) = tcp_pair(config(), cb).await; // default: 2 retries
    let len = 1_769_472;
    let regions = Regions::register(&a, &b, 16 * len, 15);
    faults.drop_after_bytes.store(5_000_000, Ordering::Relaxed);
    let receipt = a
        .write(peer, regions.batch(1, 16, len as u64), in_ms(5_000))
        .await
        .unwrap();
    assert_eq!(receipt.attempts, 2);
    let done = b.wait_incoming(TransferId(1), in_ms(1_000)).await.unwrap();
    assert_eq!(done.bytes, 16 * len as u64);
    assert!(regions.landed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_and_restarted_peers() {
    let (a, b, peer) = tcp_pair(config(), config()).await;
    let addr = b.local_addr();
    vanished_then_restarted(&a, peer, b, addr, |addr| async move {
        let mut cb = config();
        cb.bind = addr;
        TcpTransport::bind(cb).await.unwrap()
    })
    .await;
}

#[tokio::test]
async fn local_deadline_and_abandon() {
    let (a, b, peer) = local_pair(config(), config()).await;
    let regions = Regions::register(&a, &b, 4096, 18);
    let started = Instant::now();
    let w = b.wait_incoming(TransferId(5), in_ms(100)).await;
    assert!(matches!(w, Err(TransferError::Timeout)));
    assert_on_time(started, 100);
    // Abandoned by the wait: the late write is refused.
    let r = a.write(peer, regions.batch(5, 1, 4096), in_ms(1_000)).await;
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert!(read_all(&regions.dst).iter().all(|&x| x == 0));
}
