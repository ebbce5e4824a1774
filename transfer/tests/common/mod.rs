//! Helpers shared by the transfer integration tests.
#![allow(dead_code)]

use std::time::Duration;

use tessera_transfer::{
    Extent, Instant, PeerId, RegionDescriptor, RegionHandle, Secret, TcpTransport, TransferId,
    Transport, TransportConfig, WriteBatch,
};

pub const SECRET: &str = "test cluster secret";

pub fn config() -> TransportConfig {
    TransportConfig::new(Secret::new(SECRET))
}

pub fn in_ms(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
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

/// Two TCP transports on loopback, the first connected to the second.
pub async fn tcp_pair(
    a: TransportConfig,
    b: TransportConfig,
) -> (TcpTransport, TcpTransport, PeerId) {
    let src = TcpTransport::bind(a).await.expect("bind source");
    let dst = TcpTransport::bind(b).await.expect("bind destination");
    let peer = src
        .connect(&dst.endpoint(), in_ms(5_000))
        .await
        .expect("connect");
    (src, dst, peer)
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
