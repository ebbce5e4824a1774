//! The receiving side: one task per accepted connection authenticates the peer, then reads parts
//! straight into leased destination extents, verifies them and acknowledges each part.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::wire::{
    Ack, ClientHello, ClientProof, ExtentHeader, ExtentTrailer, PartHeader, ServerHello, Verdict,
    FLAG_CHECKSUMS, HELLO_BAD_VERSION, HELLO_OK, HELLO_WRONG_INCARNATION, VERSION,
};
use super::Node;
use crate::auth::{nonce, Side, Transcript, PROOF_LEN};
use crate::checksum::{self, STREAM_CHUNK};
use crate::incoming::PartStart;
use crate::region::{ExtentMut, Incarnation, RegionHandle};
use crate::{TransferError, TransportConfig};

/// Extra time a receiver grants a part beyond the sender's remaining deadline (clock skew,
/// scheduling), before it drops the connection.
pub(crate) const PART_SLACK: Duration = Duration::from_secs(1);

/// Accepts connections until aborted; aborting drops (and so aborts) every connection task.
pub(super) async fn accept_loop(node: Arc<Node>, listener: TcpListener) {
    accept_connections(listener, "transfer", move |stream| {
        serve(node.clone(), stream)
    })
    .await
}

/// Accepts connections until aborted, each served by its own task (`serve`); aborting drops
/// (and so aborts) every connection task. `what` names the connections in logs.
pub(crate) async fn accept_connections<F, Fut>(listener: TcpListener, what: &'static str, serve: F)
where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    tracing::debug!(%addr, "{what} connection accepted");
                    conns.spawn(serve(stream));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "{what} accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next() => {}
        }
    }
}

/// The peer of a newly accepted connection, authenticated by [`handshake`] within the
/// configured time; None (logged, naming the connection by `what`) when it is refused or late.
pub(crate) async fn authenticate(
    config: &TransportConfig,
    stream: &mut TcpStream,
    what: &'static str,
) -> Option<Incarnation> {
    let _ = stream.set_nodelay(true);
    match tokio::time::timeout(config.handshake_timeout, handshake(config, stream)).await {
        Ok(Ok(incarnation)) => Some(incarnation),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "{what} handshake refused");
            None
        }
        Err(_) => {
            tracing::warn!("{what} handshake timed out");
            None
        }
    }
}

async fn serve(node: Arc<Node>, mut stream: TcpStream) {
    let Some(peer) = authenticate(&node.config, &mut stream, "transfer").await else {
        return;
    };
    loop {
        let mut buf = [0u8; PartHeader::LEN];
        if stream.read_exact(&mut buf).await.is_err() {
            return; // the peer closed the connection (or broke it): nothing is in flight.
        }
        if node.config.faults.stalled() {
            std::future::pending::<()>().await;
        }
        let part = match PartHeader::decode(&buf) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "malformed transfer part");
                return;
            }
        };
        let budget = Duration::from_millis(part.timeout_ms.into()) + PART_SLACK;
        let ack = match tokio::time::timeout(budget, receive_part(&node, &mut stream, &part, peer))
            .await
        {
            Ok(Ok(ack)) => ack,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, transfer = %part.transfer_id, "transfer part broken");
                return;
            }
            Err(_) => {
                tracing::warn!(transfer = %part.transfer_id, "transfer part stalled past its deadline");
                return;
            }
        };
        let sent = tokio::time::timeout(budget, stream.write_all(&ack.encode())).await;
        if !matches!(sent, Ok(Ok(()))) {
            return;
        }
    }
}

/// The server half of the handshake; returns the client's incarnation once it proved the secret.
async fn handshake(
    config: &TransportConfig,
    stream: &mut TcpStream,
) -> Result<Incarnation, TransferError> {
    let own = config.incarnation;
    let mut buf = [0u8; ClientHello::LEN];
    stream.read_exact(&mut buf).await?;
    let hello = ClientHello::decode(&buf)?;
    let mut reply = ServerHello {
        version: VERSION,
        status: HELLO_OK,
        server_incarnation: own,
        nonce: nonce(),
        proof: [0; PROOF_LEN],
    };
    if hello.version != VERSION {
        reply.status = HELLO_BAD_VERSION;
    } else if hello.expected_server.is_some_and(|e| e != own) {
        reply.status = HELLO_WRONG_INCARNATION;
    }
    let transcript = Transcript {
        client_nonce: hello.nonce,
        server_nonce: reply.nonce,
        client_incarnation: hello.client_incarnation,
        server_incarnation: own,
    };
    if reply.status == HELLO_OK {
        reply.proof = transcript.prove(&config.secret, Side::Server);
    }
    stream.write_all(&reply.encode()).await?;
    match reply.status {
        HELLO_OK => {}
        HELLO_BAD_VERSION => {
            return Err(TransferError::protocol(format!(
                "client speaks version {}",
                hello.version
            )))
        }
        _ => {
            return Err(TransferError::IncarnationMismatch {
                expected: hello.expected_server.unwrap_or(own),
                found: own,
            })
        }
    }
    let mut buf = [0u8; ClientProof::LEN];
    stream.read_exact(&mut buf).await?;
    let proof = ClientProof::decode(&buf)?;
    if proof.status != 0 {
        return Err(TransferError::Auth(
            "the client gave up on the handshake".into(),
        ));
    }
    let ok = transcript.verify(&config.secret, Side::Client, &proof.proof);
    stream
        .write_all(&Verdict(if ok { 0 } else { 1 }).encode())
        .await?;
    if !ok {
        return Err(TransferError::Auth(
            "the client could not prove the shared secret".into(),
        ));
    }
    Ok(hello.client_incarnation)
}

/// Reads one part. I/O errors mean the stream is out of sync (the connection is then dropped);
/// every other failure is reported in the ack after the part's bytes were drained.
async fn receive_part(
    node: &Node,
    stream: &mut TcpStream,
    part: &PartHeader,
    from: Incarnation,
) -> std::io::Result<Ack> {
    let id = part.transfer_id;
    let mut failure: Option<TransferError> = None;
    let mut already_complete = false;
    let region: Option<RegionHandle> = if part.dst_incarnation != node.config.incarnation {
        failure = Some(TransferError::IncarnationMismatch {
            expected: part.dst_incarnation,
            found: node.config.incarnation,
        });
        None
    } else {
        let region = node.regions.get(crate::RegionId(part.dst_region));
        if region.is_none() {
            failure = Some(TransferError::BadRegion(format!(
                "region {} is not registered",
                part.dst_region
            )));
        }
        region
    };
    if failure.is_none() {
        match node
            .incoming
            .begin_part(id, part.attempt, part.batch_extents, from)
        {
            PartStart::Proceed => {}
            PartStart::AlreadyComplete => already_complete = true,
            PartStart::Refuse(e) => failure = Some(e),
        }
    }
    let faults = &node.config.faults;
    let mut drop_after = if failure.is_none() && !already_complete {
        faults.take_drop_after()
    } else {
        None
    };
    let mut received = 0u64;
    // The count comes from the peer: do not let it size an allocation.
    let mut leases: Vec<ExtentMut> = Vec::with_capacity(part.part_extents.min(1024) as usize);
    let mut bytes = 0u64;
    let mut scratch = Vec::new();
    for _ in 0..part.part_extents {
        let mut buf = [0u8; ExtentHeader::LEN];
        stream.read_exact(&mut buf).await?;
        let ext = ExtentHeader::decode(&buf);
        let writing = failure.is_none() && !already_complete;
        let lease = match (&region, writing) {
            (Some(region), true) => match lease_extent(node, region, part, &ext) {
                Ok(l) => Some(l),
                Err(e) => {
                    if let TransferError::BadRegion(_) = e {
                        // Final for this attempt: tell the destination's waiter now.
                        node.incoming.fail(id, part.attempt, e.clone());
                    }
                    failure = Some(e);
                    None
                }
            },
            _ => None,
        };
        let Some(mut lease) = lease else {
            drain(stream, ext.len + ExtentTrailer::LEN as u64, &mut scratch).await?;
            continue;
        };
        let checksums = part.flags & FLAG_CHECKSUMS != 0;
        let len = lease.len();
        // Checksum each chunk right after it landed, while it is in cache.
        let step = if checksums { STREAM_CHUNK } else { len.max(1) };
        let mut crc = 0;
        let mut at = 0;
        while at < len {
            let end = (at + step).min(len);
            if let Some(limit) = drop_after {
                if received + (end - at) as u64 > limit {
                    let keep = (limit - received) as usize;
                    stream.read_exact(&mut lease[at..at + keep]).await?;
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "fault injection: connection dropped mid-transfer",
                    ));
                }
            }
            stream.read_exact(&mut lease[at..end]).await?;
            received += (end - at) as u64;
            if at == 0 && faults.take_corruption() {
                lease[0] ^= 0x5a;
            }
            if checksums {
                crc = checksum::extend(crc, &lease[at..end]);
            }
            at = end;
        }
        let mut buf = [0u8; ExtentTrailer::LEN];
        stream.read_exact(&mut buf).await?;
        if checksums && ExtentTrailer::decode(&buf).checksum != crc {
            let err = TransferError::ChecksumMismatch { extent: ext.index };
            node.incoming.fail(id, part.attempt, err.clone());
            failure = Some(err);
            continue;
        }
        bytes += ext.len;
        leases.push(lease);
    }
    if let Some(limit) = drop_after.take() {
        // The part ended before the armed byte count: leave the rest armed for the next one.
        let _ = faults.drop_after_bytes.compare_exchange(
            0,
            limit - received,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let result = match failure {
        Some(e) => Err(e),
        None if already_complete => Ok(()),
        None => node
            .incoming
            .finish_part(id, part.attempt, part.part_extents, bytes, leases),
    };
    Ok(Ack::new(id, part.attempt, result.as_ref().map(|_| ())))
}

fn lease_extent(
    node: &Node,
    region: &RegionHandle,
    part: &PartHeader,
    ext: &ExtentHeader,
) -> Result<ExtentMut, TransferError> {
    // Abandoned by the destination, superseded or failed: write nothing more.
    node.incoming.check_live(part.transfer_id, part.attempt)?;
    crate::plan::check_dst(
        region.len() as u64,
        ext.dst_offset,
        ext.len,
        ext.index as usize,
    )?;
    let at = ext.dst_offset as usize;
    Ok(region.try_write(at..at + ext.len as usize)?)
}

/// Reads and discards `len` bytes (the payload of an extent that is refused).
async fn drain(stream: &mut TcpStream, len: u64, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    if scratch.is_empty() {
        scratch.resize(256 << 10, 0);
    }
    let mut left = len;
    while left > 0 {
        let n = left.min(scratch.len() as u64) as usize;
        stream.read_exact(&mut scratch[..n]).await?;
        left -= n as u64;
    }
    Ok(())
}
