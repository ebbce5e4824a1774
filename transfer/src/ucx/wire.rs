//! Frames of the UCX backend's control connection (all integers little-endian).
//!
//! The connection opens with the TCP backend's handshake (challenge-response on the cluster
//! secret, incarnations exchanged; see [`crate::tcp::wire`]). Then:
//! ```text
//! server → client  UcxHello  magic "UXH1" | UCX listener port u16 | 0 u16
//! ```
//! and any number of transfers, each one exchange of four frames:
//! ```text
//! client → server  Begin     magic "UXB1" | transfer id u64 | attempt u64 | dst region u64
//!                            | dst incarnation u64 | flags u32 | timeout ms u32
//!                            | rkey generation the client holds u64 (0: none) | extents u32
//!                            | 0 u32, then per extent: dst offset u64 | len u64
//! server → client  Ready     magic "UXR1" | 0 u16 | rkey len u16 | rkey generation u64
//!                            | region base address u64, then the packed rkey (empty when the
//!                            client already holds this generation)
//!                  or an Ack (the TCP backend's frame) when the transfer is refused or already
//!                  complete; the exchange then ends there.
//! client → server  Commit    magic "UXC1" | transfer id u64 | attempt u64 | status u32 (0: every
//!                            put landed; else the puts failed or the client gave up)
//!                            | checksums u32, then that many crc32c u32 (one per extent, or
//!                            none without the checksum flag)
//! server → client  Ack
//! ```
//! Between Ready and Commit the client writes the extents with RMA puts and flushes them, so
//! they have landed when Commit arrives; the server holds exclusive leases on the destination
//! extents from Begin until then.

use crate::region::Incarnation;
use crate::{TransferError, TransferId};

const UCX_HELLO: [u8; 4] = *b"UXH1";
const BEGIN: [u8; 4] = *b"UXB1";
pub(crate) const READY: [u8; 4] = *b"UXR1";
const COMMIT: [u8; 4] = *b"UXC1";

/// Begin flag: the client sends checksums in Commit and the server verifies them.
pub(crate) const FLAG_CHECKSUMS: u32 = 1;

/// Most extents one Begin may name (a bound on what a peer can make the server allocate).
pub(crate) const MAX_EXTENTS: u32 = 1 << 20;
/// Longest packed rkey accepted.
pub(crate) const MAX_RKEY: usize = u16::MAX as usize;

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

fn expect_magic(b: &[u8], magic: [u8; 4], what: &str) -> Result<(), TransferError> {
    if b[..4] == magic {
        Ok(())
    } else {
        Err(TransferError::protocol(format!("bad magic in {what}")))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UcxHello {
    pub port: u16,
}

impl UcxHello {
    pub const LEN: usize = 8;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&UCX_HELLO);
        b[4..6].copy_from_slice(&self.port.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        expect_magic(b, UCX_HELLO, "ucx hello")?;
        Ok(UcxHello { port: u16_at(b, 4) })
    }
}

/// One destination extent of a Begin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DstExtent {
    pub offset: u64,
    pub len: u64,
}

impl DstExtent {
    pub const LEN: usize = 16;

    pub fn decode(b: &[u8]) -> Self {
        DstExtent {
            offset: u64_at(b, 0),
            len: u64_at(b, 8),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Begin {
    pub transfer_id: TransferId,
    pub attempt: u64,
    pub dst_region: u64,
    pub dst_incarnation: Incarnation,
    pub flags: u32,
    /// What is left of the sender's deadline.
    pub timeout_ms: u32,
    pub known_generation: u64,
    pub extents: Vec<DstExtent>,
}

impl Begin {
    /// The fixed part, magic included; the extents follow.
    pub const HEAD: usize = 4 + 8 * 4 + 4 * 2 + 8 + 4 * 2;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::HEAD + self.extents.len() * DstExtent::LEN);
        b.extend_from_slice(&BEGIN);
        b.extend_from_slice(&self.transfer_id.0.to_le_bytes());
        b.extend_from_slice(&self.attempt.to_le_bytes());
        b.extend_from_slice(&self.dst_region.to_le_bytes());
        b.extend_from_slice(&self.dst_incarnation.0.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&self.timeout_ms.to_le_bytes());
        b.extend_from_slice(&self.known_generation.to_le_bytes());
        b.extend_from_slice(&(self.extents.len() as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        for e in &self.extents {
            b.extend_from_slice(&e.offset.to_le_bytes());
            b.extend_from_slice(&e.len.to_le_bytes());
        }
        b
    }

    /// Decodes the fixed part; returns the frame (without extents) and the extent count.
    pub fn decode_head(b: &[u8; Self::HEAD]) -> Result<(Self, u32), TransferError> {
        expect_magic(b, BEGIN, "begin")?;
        let count = u32_at(b, 52);
        if count > MAX_EXTENTS {
            return Err(TransferError::protocol(format!(
                "begin names {count} extents"
            )));
        }
        Ok((
            Begin {
                transfer_id: TransferId(u64_at(b, 4)),
                attempt: u64_at(b, 12),
                dst_region: u64_at(b, 20),
                dst_incarnation: Incarnation(u64_at(b, 28)),
                flags: u32_at(b, 36),
                timeout_ms: u32_at(b, 40),
                known_generation: u64_at(b, 44),
                extents: Vec::new(),
            },
            count,
        ))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub generation: u64,
    pub base: u64,
    pub rkey: Vec<u8>,
}

impl Ready {
    pub const HEAD: usize = 4 + 2 + 2 + 8 + 8;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::HEAD + self.rkey.len());
        b.extend_from_slice(&READY);
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&(self.rkey.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.rkey);
        b
    }

    /// Decodes the fixed part; returns the frame (without rkey) and the rkey length.
    pub fn decode_head(b: &[u8; Self::HEAD]) -> Result<(Self, usize), TransferError> {
        expect_magic(b, READY, "ready")?;
        Ok((
            Ready {
                generation: u64_at(b, 8),
                base: u64_at(b, 16),
                rkey: Vec::new(),
            },
            u16_at(b, 6) as usize,
        ))
    }
}

/// `Commit::status`.
pub(crate) const COMMIT_LANDED: u32 = 0;
pub(crate) const COMMIT_ABORTED: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Commit {
    pub transfer_id: TransferId,
    pub attempt: u64,
    pub status: u32,
    pub checksums: Vec<u32>,
}

impl Commit {
    pub const HEAD: usize = 4 + 8 + 8 + 4 + 4;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::HEAD + 4 * self.checksums.len());
        b.extend_from_slice(&COMMIT);
        b.extend_from_slice(&self.transfer_id.0.to_le_bytes());
        b.extend_from_slice(&self.attempt.to_le_bytes());
        b.extend_from_slice(&self.status.to_le_bytes());
        b.extend_from_slice(&(self.checksums.len() as u32).to_le_bytes());
        for c in &self.checksums {
            b.extend_from_slice(&c.to_le_bytes());
        }
        b
    }

    /// Decodes the fixed part; returns the frame (without checksums) and their count.
    pub fn decode_head(b: &[u8; Self::HEAD]) -> Result<(Self, u32), TransferError> {
        expect_magic(b, COMMIT, "commit")?;
        let count = u32_at(b, 24);
        if count > MAX_EXTENTS {
            return Err(TransferError::protocol(format!(
                "commit carries {count} checksums"
            )));
        }
        Ok((
            Commit {
                transfer_id: TransferId(u64_at(b, 4)),
                attempt: u64_at(b, 12),
                status: u32_at(b, 20),
                checksums: Vec::new(),
            },
            count,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let h = UcxHello { port: 40123 };
        assert_eq!(UcxHello::decode(&h.encode()).unwrap(), h);

        let b = Begin {
            transfer_id: TransferId(9),
            attempt: 2,
            dst_region: 5,
            dst_incarnation: Incarnation(77),
            flags: FLAG_CHECKSUMS,
            timeout_ms: 1234,
            known_generation: 3,
            extents: vec![
                DstExtent {
                    offset: 1 << 40,
                    len: 1_769_472,
                },
                DstExtent { offset: 0, len: 0 },
            ],
        };
        let bytes = b.encode();
        let (mut back, n) = Begin::decode_head(bytes[..Begin::HEAD].try_into().unwrap()).unwrap();
        back.extents = bytes[Begin::HEAD..]
            .chunks(DstExtent::LEN)
            .map(DstExtent::decode)
            .collect();
        assert_eq!(n, 2);
        assert_eq!(back, b);

        let r = Ready {
            generation: 4,
            base: 0x7f00_0000_1000,
            rkey: vec![1, 2, 3],
        };
        let bytes = r.encode();
        let (mut back, n) = Ready::decode_head(bytes[..Ready::HEAD].try_into().unwrap()).unwrap();
        back.rkey = bytes[Ready::HEAD..Ready::HEAD + n].to_vec();
        assert_eq!(back, r);

        let c = Commit {
            transfer_id: TransferId(9),
            attempt: 2,
            status: COMMIT_LANDED,
            checksums: vec![0xdead_beef, 7],
        };
        let bytes = c.encode();
        let (mut back, n) = Commit::decode_head(bytes[..Commit::HEAD].try_into().unwrap()).unwrap();
        back.checksums = bytes[Commit::HEAD..]
            .chunks(4)
            .map(|x| u32::from_le_bytes(x.try_into().unwrap()))
            .collect();
        assert_eq!(n, 2);
        assert_eq!(back, c);

        assert!(Begin::decode_head(&[0; Begin::HEAD]).is_err());
    }
}
