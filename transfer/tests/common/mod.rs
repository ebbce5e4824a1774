//! Helpers shared by the transfer integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "ucx")]
use tessera_transfer::UcxTransport;
use tessera_transfer::{
    Endpoint, Extent, FaultInjection, Incarnation, Instant, LocalTransport, PeerId,
    RegionDescriptor, RegionHandle, Secret, TcpTransport, TransferError, TransferId, Transport,
    TransportConfig, WriteBatch,
};

pub const SECRET: &str = "test cluster secret";

/// How late past its deadline a call may return on a loaded two-core machine.
pub const SLACK: Duration = Duration::from_millis(400);

pub fn config() -> TransportConfig {
    TransportConfig::new(Secret::new(SECRET))
}

/// A configuration with another secret than the cluster's.
pub fn other_secret() -> TransportConfig {
    TransportConfig::new(Secret::new("not the cluster secret"))
}

pub fn in_ms(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// Fails unless `started` was at most `budget_ms` (and the slack) ago.
pub fn assert_on_time(started: Instant, budget_ms: u64) {
    let took = started.elapsed();
    assert!(
        took <= Duration::from_millis(budget_ms) + SLACK,
        "took {took:?} for a {budget_ms} ms deadline"
    );
}

/// A deterministic xorshift stream, so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

pub fn random_region(len: usize, seed: u64) -> RegionHandle {
    let mut bytes = vec![0u8; len];
    Rng(seed).fill(&mut bytes);
    RegionHandle::from_bytes(&bytes)
}

pub fn read_all(region: &RegionHandle) -> Vec<u8> {
    region
        .try_read(0..region.len())
        .expect("no lease held")
        .to_vec()
}

/// Two transports that `bind` starts, the first connected to the second.
async fn connected_pair<T, F, Fut>(
    bind: F,
    a: TransportConfig,
    b: TransportConfig,
) -> (T, T, PeerId)
where
    T: Transport,
    F: Fn(TransportConfig) -> Fut,
    Fut: Future<Output = Result<T, TransferError>>,
{
    let src = bind(a).await.expect("bind source");
    let dst = bind(b).await.expect("bind destination");
    let peer = src
        .connect(&dst.endpoint(), in_ms(5_000))
        .await
        .expect("connect");
    (src, dst, peer)
}

/// Two local transports, the first connected to the second.
pub async fn local_pair(
    a: TransportConfig,
    b: TransportConfig,
) -> (LocalTransport, LocalTransport, PeerId) {
    connected_pair(|c| async { Ok(LocalTransport::new(c)) }, a, b).await
}

/// Two TCP transports on loopback, the first connected to the second.
pub async fn tcp_pair(
    a: TransportConfig,
    b: TransportConfig,
) -> (TcpTransport, TcpTransport, PeerId) {
    connected_pair(TcpTransport::bind, a, b).await
}

/// Two UCX transports on loopback, the first connected to the second.
#[cfg(feature = "ucx")]
pub async fn ucx_pair(
    a: TransportConfig,
    b: TransportConfig,
) -> (UcxTransport, UcxTransport, PeerId) {
    connected_pair(UcxTransport::bind, a, b).await
}

/// A source region of random bytes registered with one transport and a zeroed destination
/// region of the same size registered with another.
pub struct Regions {
    pub src: RegionHandle,
    pub dst: RegionHandle,
    pub desc: RegionDescriptor,
}

impl Regions {
    /// `len` bytes from [`random_region`]`(len, seed)` registered with `src_t`, and `len` zeroed
    /// bytes registered with `dst_t`.
    pub fn register(src_t: &dyn Transport, dst_t: &dyn Transport, len: usize, seed: u64) -> Self {
        let src = random_region(len, seed);
        src_t.register(&src).unwrap();
        let dst = RegionHandle::new(len);
        let desc = dst_t.register(&dst).unwrap();
        Regions { src, dst, desc }
    }

    /// [`contiguous_batch`] from the source to the destination.
    pub fn batch(&self, id: u64, n: u64, len: u64) -> WriteBatch {
        contiguous_batch(id, &self.src, &self.desc, n, len)
    }

    /// Whether the destination holds the source's bytes.
    pub fn landed(&self) -> bool {
        read_all(&self.dst) == read_all(&self.src)
    }
}

/// A batch of `n` extents of `len` bytes from the start of `src` to consecutive slots of `dst`.
pub fn contiguous_batch(
    id: u64,
    src: &RegionHandle,
    dst: &RegionDescriptor,
    n: u64,
    len: u64,
) -> WriteBatch {
    WriteBatch {
        transfer_id: TransferId(id),
        dst_region: dst.clone(),
        extents: (0..n)
            .map(|i| Extent {
                src_region: src.id(),
                src_offset: i * len,
                dst_offset: i * len,
                len,
            })
            .collect(),
    }
}

/// Random disjoint extents (lengths from 0 to about 2 MB, a few exactly one K3 plane), and the
/// destination bytes expected once they landed on `before`.
pub fn random_batch(
    rng: &mut Rng,
    id: u64,
    src: &RegionHandle,
    src_bytes: &[u8],
    dst: &RegionDescriptor,
    before: &[u8],
    count: usize,
) -> (WriteBatch, Vec<u8>) {
    let mut expected = before.to_vec();
    let mut extents = Vec::new();
    let mut cursor = 0u64;
    for _ in 0..count {
        let len = match rng.below(6) {
            0 => 0,
            1 => 1 + rng.below(64),
            2 => 1_769_472,
            _ => 1 + rng.below(300_000),
        };
        let gap = rng.below(4096);
        if cursor + gap + len > dst.len {
            break;
        }
        let dst_offset = cursor + gap;
        cursor = dst_offset + len;
        let src_offset = rng.below(src.len() as u64 - len + 1);
        expected[dst_offset as usize..(dst_offset + len) as usize]
            .copy_from_slice(&src_bytes[src_offset as usize..(src_offset + len) as usize]);
        extents.push(Extent {
            src_region: src.id(),
            src_offset,
            dst_offset,
            len,
        });
    }
    // Out of destination order, as page tables are.
    for i in (1..extents.len()).rev() {
        extents.swap(i, rng.below(i as u64 + 1) as usize);
    }
    (
        WriteBatch {
            transfer_id: TransferId(id),
            dst_region: dst.clone(),
            extents,
        },
        expected,
    )
}

/// Several random batches from `src_t` into `dst_t`; checks the whole destination each time.
pub async fn random_round_trips(src_t: &dyn Transport, dst_t: &dyn Transport, peer: PeerId) {
    let (src, dst) = (RegionHandle::new(8 << 20), RegionHandle::new(12 << 20));
    random_round_trips_in(src_t, dst_t, peer, src, dst).await;
}

/// [`random_round_trips`] between regions the caller allocated (8 MB and 12 MB at least).
pub async fn random_round_trips_in(
    src_t: &dyn Transport,
    dst_t: &dyn Transport,
    peer: PeerId,
    src: RegionHandle,
    dst: RegionHandle,
) {
    Rng(1).fill(&mut src.try_write(0..src.len()).unwrap());
    Rng(2).fill(&mut dst.try_write(0..dst.len()).unwrap());
    let src_bytes = read_all(&src);
    src_t.register(&src).unwrap();
    let desc = dst_t.register(&dst).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..6u64 {
        let before = read_all(&dst);
        let count = [1, 3, 16, 40, 7, 64][round as usize];
        let (batch, expected) = random_batch(
            &mut rng,
            100 + round,
            &src,
            &src_bytes,
            &desc,
            &before,
            count,
        );
        let total: u64 = batch.extents.iter().map(|e| e.len).sum();
        let n = batch.extents.len() as u32;
        let receipt = src_t.write(peer, batch, in_ms(10_000)).await.unwrap();
        assert_eq!(receipt.bytes, total);
        assert_eq!(receipt.attempts, 1);
        let done = dst_t
            .wait_incoming(TransferId(100 + round), in_ms(1_000))
            .await
            .unwrap();
        assert_eq!(done.bytes, total);
        assert_eq!(done.extents, n);
        assert_eq!(done.from, src_t.incarnation());
        let after = read_all(&dst);
        assert!(after == expected, "round {round}: destination bytes differ");
    }

    // write_bytes (embeddings) through the same path.
    let emb: Vec<u8> = (0..100_003u32).map(|i| (i * 7) as u8).collect();
    src_t
        .write_bytes(peer, TransferId(7), &desc, 12345, &emb, in_ms(5_000))
        .await
        .unwrap();
    let done = dst_t
        .wait_incoming(TransferId(7), in_ms(1_000))
        .await
        .unwrap();
    assert_eq!(done.bytes, emb.len() as u64);
    assert_eq!(&*dst.try_read(12345..12345 + emb.len()).unwrap(), &emb[..]);

    // An empty batch still completes once.
    let empty = tessera_transfer::WriteBatch {
        transfer_id: TransferId(8),
        dst_region: desc.clone(),
        extents: vec![],
    };
    src_t.write(peer, empty, in_ms(5_000)).await.unwrap();
    assert_eq!(
        dst_t
            .wait_incoming(TransferId(8), in_ms(1_000))
            .await
            .unwrap()
            .bytes,
        0
    );
}

/// The bytes of each extent [`write_concurrent_batches`] writes.
pub const CONCURRENT_EXTENT: u64 = 256 << 10;

/// The transfer ids [`write_concurrent_batches`] uses, for the destination to wait on.
pub fn concurrent_batch_ids() -> impl Iterator<Item = TransferId> {
    (0..8u64).map(|t| TransferId(1000 + t))
}

/// Eight batches of two extents of [`CONCURRENT_EXTENT`] bytes each, written concurrently from
/// `src_t` to one peer into disjoint parts of a region `dst_t` registered; returns the regions
/// once every write returned Ok.
pub async fn write_concurrent_batches(
    src_t: Arc<dyn Transport>,
    dst_t: &dyn Transport,
    peer: PeerId,
) -> Regions {
    let len = CONCURRENT_EXTENT;
    let regions = Regions::register(&*src_t, dst_t, 16 * len as usize, 3);
    let mut tasks = Vec::new();
    for (t, id) in concurrent_batch_ids().enumerate() {
        let (a, mut batch) = (src_t.clone(), regions.batch(id.0, 2, len));
        let t = t as u64;
        for e in &mut batch.extents {
            e.src_offset += 2 * t * len;
            e.dst_offset += 2 * t * len;
        }
        tasks.push(tokio::spawn(async move {
            a.write(peer, batch, in_ms(10_000)).await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    regions
}

/// A destination `b` (reached from `a` as `peer`, listening at `addr`) vanishes and comes back at
/// the same address in a new life (`restart(addr)`). A write to the vanished peer is reported at
/// once, not waited for until its deadline; after the restart, whatever names the old life is
/// refused (its endpoint, its region's descriptor, and even the new life's descriptor sent over
/// the connection to the old one); the new endpoint takes writes.
pub async fn vanished_then_restarted<T, F, Fut>(
    a: &dyn Transport,
    peer: PeerId,
    b: T,
    addr: SocketAddr,
    restart: F,
) where
    T: Transport,
    F: FnOnce(SocketAddr) -> Fut,
    Fut: Future<Output = T>,
{
    let old_endpoint = b.endpoint();
    let regions = Regions::register(a, &b, 1 << 20, 51);
    a.write(peer, regions.batch(1, 4, 4096), in_ms(3_000))
        .await
        .unwrap();
    drop(b);
    tokio::time::sleep(Duration::from_millis(50)).await;

    let started = Instant::now();
    let r = a.write(peer, regions.batch(2, 4, 4096), in_ms(3_000)).await;
    assert!(matches!(r, Err(TransferError::PeerGone(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(1));

    let b2 = restart(addr).await;
    let old_desc = &regions.desc;
    let new_desc = &b2.register(&regions.dst).unwrap();
    assert_ne!(old_desc.incarnation, new_desc.incarnation);
    let r = a.connect(&old_endpoint, in_ms(3_000)).await;
    assert!(
        matches!(r, Err(TransferError::IncarnationMismatch { .. })),
        "{r:?}"
    );
    for (id, desc) in [(3, old_desc), (4, new_desc)] {
        let batch = contiguous_batch(id, &regions.src, desc, 1, 4096);
        let r = a.write(peer, batch, in_ms(3_000)).await;
        assert!(
            matches!(r, Err(TransferError::IncarnationMismatch { .. })),
            "{r:?}"
        );
    }

    let peer2 = a.connect(&b2.endpoint(), in_ms(3_000)).await.unwrap();
    let batch = contiguous_batch(5, &regions.src, new_desc, 4, 4096);
    a.write(peer2, batch, in_ms(3_000)).await.unwrap();
    b2.wait_incoming(TransferId(5), in_ms(1_000)).await.unwrap();
    let n = 4 * 4096;
    assert!(read_all(&regions.dst)[..n] == read_all(&regions.src)[..n]);
}

/// The destination `b`'s `faults` corrupt the first extent of a batch `a` writes to it (`peer`):
/// the write and the destination's wait both end in a checksum mismatch (not retried: it is not
/// an I/O error), the failed transfer's extents are free again, and a fresh transfer lands
/// exactly. Returns the write's error for transport-specific checks.
pub async fn corrupted_extent_then_fresh_write(
    a: &dyn Transport,
    b: &dyn Transport,
    peer: PeerId,
    faults: &FaultInjection,
) -> TransferError {
    let len = 64 << 10;
    let regions = Regions::register(a, b, 8 * len, 11);
    faults
        .corrupt_extents
        .store(1, std::sync::atomic::Ordering::Relaxed);
    let r = a
        .write(peer, regions.batch(1, 8, len as u64), in_ms(5_000))
        .await;
    let Err(err @ TransferError::ChecksumMismatch { .. }) = r else {
        panic!("{r:?}");
    };
    let w = b.wait_incoming(TransferId(1), in_ms(300)).await;
    assert!(
        matches!(w, Err(TransferError::ChecksumMismatch { .. })),
        "{w:?}"
    );
    assert!(regions.dst.try_write(0..regions.dst.len()).is_ok());
    a.write(peer, regions.batch(2, 8, len as u64), in_ms(5_000))
        .await
        .unwrap();
    b.wait_incoming(TransferId(2), in_ms(1_000)).await.unwrap();
    assert!(regions.landed());
    err
}

/// A write from `a` to `peer` (transport `b`) naming a region of `b` by a descriptor of another
/// incarnation of `b` is refused, and nothing lands.
pub async fn foreign_incarnation_descriptor_is_refused(
    a: &dyn Transport,
    b: &dyn Transport,
    peer: PeerId,
) {
    let mut regions = Regions::register(a, b, 4096, 21);
    regions.desc.incarnation = Incarnation(regions.desc.incarnation.0 ^ 1);
    let r = a.write(peer, regions.batch(1, 1, 4096), in_ms(2_000)).await;
    assert!(
        matches!(r, Err(TransferError::IncarnationMismatch { .. })),
        "{r:?}"
    );
    assert!(read_all(&regions.dst).iter().all(|&x| x == 0));
}

/// A write from `a` to `peer` (transport `b`) into destination extents their owner holds a lease
/// on is refused, and the destination's waiter learns it at once rather than at its deadline;
/// nothing lands.
pub async fn destination_held_by_its_owner_is_refused(
    a: &dyn Transport,
    b: &dyn Transport,
    peer: PeerId,
) {
    let regions = Regions::register(a, b, 1 << 20, 4);
    let held = regions.dst.try_read(0..10).unwrap();
    let r = a.write(peer, regions.batch(6, 1, 4096), in_ms(2_000)).await;
    assert!(matches!(r, Err(TransferError::BadRegion(_))), "{r:?}");
    let started = Instant::now();
    let w = b.wait_incoming(TransferId(6), in_ms(5_000)).await;
    assert!(matches!(w, Err(TransferError::BadRegion(_))), "{w:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    drop(held);
    assert!(read_all(&regions.dst).iter().all(|&x| x == 0));
}

/// `a` and `b` hold different secrets: each refuses to connect to the other.
pub async fn wrong_secret_is_refused_both_ways(a: &dyn Transport, b: &dyn Transport) {
    let r = a.connect(&b.endpoint(), in_ms(2_000)).await;
    assert!(matches!(r, Err(TransferError::Auth(_))), "{r:?}");
    let r = b.connect(&a.endpoint(), in_ms(2_000)).await;
    assert!(matches!(r, Err(TransferError::Auth(_))), "{r:?}");
}

/// `b`'s endpoint naming another incarnation of `b`: a connect from `a` to it is refused.
/// Returns that endpoint.
pub async fn stale_endpoint_is_refused(a: &dyn Transport, b: &dyn Transport) -> Endpoint {
    let mut ep = Endpoint::parse(&b.endpoint()).unwrap();
    ep.incarnation = Some(Incarnation(b.incarnation().0 ^ 1));
    let r = a.connect(&ep.to_string(), in_ms(2_000)).await;
    assert!(
        matches!(r, Err(TransferError::IncarnationMismatch { .. })),
        "{r:?}"
    );
    ep
}
