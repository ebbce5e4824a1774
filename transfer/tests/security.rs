//! The transfer handshake: unauthenticated peers and stale incarnations are refused.

use tessera_transfer::tcp::wire::{ClientHello, ClientProof, ServerHello, Verdict, VERSION};
use tessera_transfer::{Incarnation, LocalTransport, TcpTransport, TransferError, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_wrong_secret_is_refused_both_ways() {
    let a = TcpTransport::bind(other_secret()).await.unwrap();
    let b = TcpTransport::bind(config()).await.unwrap();
    wrong_secret_is_refused_both_ways(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_wrong_incarnation_is_refused() {
    let a = TcpTransport::bind(config()).await.unwrap();
    let b = TcpTransport::bind(config()).await.unwrap();
    let mut ep = stale_endpoint_is_refused(&a, &b).await;
    // Without an incarnation in the endpoint the connect learns it.
    ep.incarnation = None;
    a.connect(&ep.to_string(), in_ms(2_000)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_descriptor_of_another_incarnation_is_refused() {
    let (a, b, peer) = tcp_pair(config(), config()).await;
    foreign_incarnation_descriptor_is_refused(&a, &b, peer).await;
}

/// A client without the secret that tries to skip the proof and write anyway gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_forged_proof_cannot_write() {
    let b = TcpTransport::bind(config()).await.unwrap();
    let dst = tessera_transfer::RegionHandle::new(4096);
    b.register(&dst).unwrap();
    let mut s = tokio::net::TcpStream::connect(b.local_addr())
        .await
        .unwrap();
    let hello = ClientHello {
        version: VERSION,
        client_incarnation: Incarnation(1),
        expected_server: None,
        nonce: [0; 16],
    };
    s.write_all(&hello.encode()).await.unwrap();
    let mut buf = [0u8; ServerHello::LEN];
    s.read_exact(&mut buf).await.unwrap();
    // A guessed proof.
    let forged = ClientProof {
        status: 0,
        proof: [7; 32],
    };
    s.write_all(&forged.encode()).await.unwrap();
    let mut buf = [0u8; Verdict::LEN];
    s.read_exact(&mut buf).await.unwrap();
    assert_ne!(Verdict::decode(&buf).unwrap().0, 0);
    // The server hung up: whatever follows is never read.
    let mut rest = Vec::new();
    let n = tokio::time::timeout(std::time::Duration::from_secs(2), s.read_to_end(&mut rest))
        .await
        .expect("the server closes the connection")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(read_all(&dst).iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_garbage_is_dropped() {
    let b = TcpTransport::bind(config()).await.unwrap();
    let mut s = tokio::net::TcpStream::connect(b.local_addr())
        .await
        .unwrap();
    s.write_all(&[0xAB; 200]).await.unwrap();
    let mut rest = Vec::new();
    let r = tokio::time::timeout(std::time::Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    assert!(r.is_ok(), "the server closes the connection");
    assert!(rest.is_empty());
}

#[tokio::test]
async fn local_wrong_secret_and_incarnation_are_refused() {
    let a = LocalTransport::new(other_secret());
    let b = LocalTransport::new(config());
    wrong_secret_is_refused_both_ways(&a, &b).await;

    let c = LocalTransport::new(config());
    let ep = stale_endpoint_is_refused(&c, &b).await;
    let peer = c.connect(&b.endpoint(), in_ms(1_000)).await.unwrap();
    foreign_incarnation_descriptor_is_refused(&c, &b, peer).await;
    drop(b);
    let r = c.connect(&ep.to_string(), in_ms(1_000)).await;
    assert!(matches!(r, Err(TransferError::PeerGone(_))), "{r:?}");
}
