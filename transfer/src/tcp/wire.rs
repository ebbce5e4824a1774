//! Frames of the TCP transfer protocol (all integers little-endian, fixed sizes).
//!
//! Handshake, once per connection:
//! ```text
//! client → server  ClientHello  magic "TXH1" | version u16 | 0 u16 | client incarnation u64
//!                               | expected server incarnation u64 (0: any) | client nonce [16]
//! server → client  ServerHello  magic "TXS1" | version u16 | status u16 | server incarnation u64
//!                               | server nonce [16] | server proof [32]
//! client → server  ClientProof  magic "TXP1" | status u32 (0 go on, else give up) | client proof [32]
//! server → client  Verdict      magic "TXV1" | status u32 (0 accepted, else refused)
//! ```
//! Then any number of parts, each answered by one ack:
//! ```text
//! client → server  PartHeader   magic "TXB1" | transfer id u64 | attempt u64 | dst region u64
//!                               | dst incarnation u64 | batch extents u32 | part extents u32
//!                               | timeout ms u32 | flags u32
//!                  per extent:  ExtentHeader (index u32 | 0 u32 | dst offset u64 | len u64),
//!                               `len` payload bytes, ExtentTrailer (crc32c u32; 0 without the
//!                               checksum flag). A trailer, so both sides checksum each chunk
//!                               while it is in cache.
//! server → client  Ack          magic "TXA1" | status u16 | message len u16 | detail u32
//!                               | transfer id u64 | attempt u64, then the message (UTF-8)
//! ```

use std::sync::Arc;

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::region::Incarnation;
use crate::{TransferError, TransferId};

pub const VERSION: u16 = 1;

const CLIENT_HELLO: [u8; 4] = *b"TXH1";
const SERVER_HELLO: [u8; 4] = *b"TXS1";
const CLIENT_PROOF: [u8; 4] = *b"TXP1";
const VERDICT: [u8; 4] = *b"TXV1";
const PART: [u8; 4] = *b"TXB1";
const ACK: [u8; 4] = *b"TXA1";

/// Part flag: extents carry checksums to verify.
pub const FLAG_CHECKSUMS: u32 = 1;

struct Writer<const N: usize> {
    buf: [u8; N],
    at: usize,
}

impl<const N: usize> Writer<N> {
    fn new(magic: [u8; 4]) -> Self {
        let mut w = Writer { buf: [0; N], at: 0 };
        w.bytes(&magic);
        w
    }
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn finish(self) -> [u8; N] {
        debug_assert_eq!(self.at, N);
        self.buf
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], magic: [u8; 4], what: &str) -> Result<Self, TransferError> {
        if buf[..4] != magic {
            return Err(TransferError::protocol(format!("bad magic in {what}")));
        }
        Ok(Reader { buf: &buf[4..] })
    }
    fn bytes<const K: usize>(&mut self) -> [u8; K] {
        let (head, rest) = self.buf.split_at(K);
        self.buf = rest;
        head.try_into().expect("split_at gives K bytes")
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientHello {
    pub version: u16,
    pub client_incarnation: Incarnation,
    pub expected_server: Option<Incarnation>,
    pub nonce: [u8; NONCE_LEN],
}

impl ClientHello {
    pub const LEN: usize = 4 + 2 + 2 + 8 + 8 + NONCE_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::new(CLIENT_HELLO);
        w.u16(self.version);
        w.u16(0);
        w.u64(self.client_incarnation.0);
        w.u64(self.expected_server.map_or(0, |i| i.0));
        w.bytes(&self.nonce);
        w.finish()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        let mut r = Reader::new(buf, CLIENT_HELLO, "client hello")?;
        let version = r.u16();
        r.u16();
        let client_incarnation = Incarnation(r.u64());
        let expected = r.u64();
        Ok(ClientHello {
            version,
            client_incarnation,
            expected_server: (expected != 0).then_some(Incarnation(expected)),
            nonce: r.bytes(),
        })
    }
}

/// `ServerHello::status`.
pub const HELLO_OK: u16 = 0;
pub const HELLO_BAD_VERSION: u16 = 1;
pub const HELLO_WRONG_INCARNATION: u16 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerHello {
    pub version: u16,
    pub status: u16,
    pub server_incarnation: Incarnation,
    pub nonce: [u8; NONCE_LEN],
    pub proof: [u8; PROOF_LEN],
}

impl ServerHello {
    pub const LEN: usize = 4 + 2 + 2 + 8 + NONCE_LEN + PROOF_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::new(SERVER_HELLO);
        w.u16(self.version);
        w.u16(self.status);
        w.u64(self.server_incarnation.0);
        w.bytes(&self.nonce);
        w.bytes(&self.proof);
        w.finish()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        let mut r = Reader::new(buf, SERVER_HELLO, "server hello")?;
        Ok(ServerHello {
            version: r.u16(),
            status: r.u16(),
            server_incarnation: Incarnation(r.u64()),
            nonce: r.bytes(),
            proof: r.bytes(),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientProof {
    /// 0: here is my proof; anything else: the client gives up.
    pub status: u32,
    pub proof: [u8; PROOF_LEN],
}

impl ClientProof {
    pub const LEN: usize = 4 + 4 + PROOF_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::new(CLIENT_PROOF);
        w.u32(self.status);
        w.bytes(&self.proof);
        w.finish()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        let mut r = Reader::new(buf, CLIENT_PROOF, "client proof")?;
        Ok(ClientProof {
            status: r.u32(),
            proof: r.bytes(),
        })
    }
}

/// The server's answer to a client proof: 0 accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict(pub u32);

impl Verdict {
    pub const LEN: usize = 8;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::new(VERDICT);
        w.u32(self.0);
        w.finish()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        Ok(Verdict(Reader::new(buf, VERDICT, "verdict")?.u32()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartHeader {
    pub transfer_id: TransferId,
    pub attempt: u64,
    pub dst_region: u64,
    pub dst_incarnation: Incarnation,
    pub batch_extents: u32,
    pub part_extents: u32,
    /// What is left of the sender's deadline; the receiver gives up on the part after it.
    pub timeout_ms: u32,
    pub flags: u32,
}

impl PartHeader {
    pub const LEN: usize = 4 + 8 * 4 + 4 * 4;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::new(PART);
        w.u64(self.transfer_id.0);
        w.u64(self.attempt);
        w.u64(self.dst_region);
        w.u64(self.dst_incarnation.0);
        w.u32(self.batch_extents);
        w.u32(self.part_extents);
        w.u32(self.timeout_ms);
        w.u32(self.flags);
        w.finish()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Result<Self, TransferError> {
        let mut r = Reader::new(buf, PART, "part header")?;
        Ok(PartHeader {
            transfer_id: TransferId(r.u64()),
            attempt: r.u64(),
            dst_region: r.u64(),
            dst_incarnation: Incarnation(r.u64()),
            batch_extents: r.u32(),
            part_extents: r.u32(),
            timeout_ms: r.u32(),
            flags: r.u32(),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentHeader {
    pub index: u32,
    pub dst_offset: u64,
    pub len: u64,
}

impl ExtentHeader {
    pub const LEN: usize = 4 + 4 + 8 + 8;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut buf = [0u8; Self::LEN];
        buf[0..4].copy_from_slice(&self.index.to_le_bytes());
        buf[8..16].copy_from_slice(&self.dst_offset.to_le_bytes());
        buf[16..24].copy_from_slice(&self.len.to_le_bytes());
        buf
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes(buf[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        ExtentHeader {
            index: u32_at(0),
            dst_offset: u64_at(8),
            len: u64_at(16),
        }
    }
}

/// Follows an extent's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentTrailer {
    pub checksum: u32,
}

impl ExtentTrailer {
    pub const LEN: usize = 4;

    pub fn encode(&self) -> [u8; Self::LEN] {
        self.checksum.to_le_bytes()
    }

    pub fn decode(buf: &[u8; Self::LEN]) -> Self {
        ExtentTrailer {
            checksum: u32::from_le_bytes(*buf),
        }
    }
}

/// `Ack::status`.
const ACK_OK: u16 = 0;
const ACK_CHECKSUM: u16 = 1;
const ACK_BAD_REGION: u16 = 2;
const ACK_INCARNATION: u16 = 3;
const ACK_TIMEOUT: u16 = 4;
const ACK_PROTOCOL: u16 = 5;
const ACK_AUTH: u16 = 6;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    pub status: u16,
    pub detail: u32,
    pub transfer_id: TransferId,
    pub attempt: u64,
    pub message: String,
}

impl Ack {
    pub const LEN: usize = 4 + 2 + 2 + 4 + 8 + 8;

    pub fn new(transfer_id: TransferId, attempt: u64, result: Result<(), &TransferError>) -> Self {
        let (status, detail, message) = match result {
            Ok(()) => (ACK_OK, 0, String::new()),
            Err(e) => match e {
                TransferError::ChecksumMismatch { extent } => {
                    (ACK_CHECKSUM, *extent, String::new())
                }
                TransferError::BadRegion(m) => (ACK_BAD_REGION, 0, m.clone()),
                TransferError::IncarnationMismatch { .. } => (ACK_INCARNATION, 0, e.to_string()),
                TransferError::Timeout => (ACK_TIMEOUT, 0, String::new()),
                TransferError::Auth(m) => (ACK_AUTH, 0, m.clone()),
                _ => (ACK_PROTOCOL, 0, e.to_string()),
            },
        };
        let mut message = message;
        truncate_utf8(&mut message, u16::MAX as usize);
        Ack {
            status,
            detail,
            transfer_id,
            attempt,
            message,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w: Writer<{ Ack::LEN }> = Writer::new(ACK);
        w.u16(self.status);
        w.u16(self.message.len() as u16);
        w.u32(self.detail);
        w.u64(self.transfer_id.0);
        w.u64(self.attempt);
        let mut out = w.finish().to_vec();
        out.extend_from_slice(self.message.as_bytes());
        out
    }

    /// Decodes the fixed part; returns the ack (without message) and the message length.
    pub fn decode(buf: &[u8; Self::LEN]) -> Result<(Self, usize), TransferError> {
        let mut r = Reader::new(buf, ACK, "ack")?;
        let status = r.u16();
        let message_len = r.u16() as usize;
        Ok((
            Ack {
                status,
                detail: r.u32(),
                transfer_id: TransferId(r.u64()),
                attempt: r.u64(),
                message: String::new(),
            },
            message_len,
        ))
    }

    /// The sender's view of the outcome; `expected`/`found` fill an incarnation refusal.
    pub fn into_result(
        self,
        expected: Incarnation,
        found: Incarnation,
    ) -> Result<(), TransferError> {
        match self.status {
            ACK_OK => Ok(()),
            ACK_CHECKSUM => Err(TransferError::ChecksumMismatch {
                extent: self.detail,
            }),
            ACK_BAD_REGION => Err(TransferError::BadRegion(self.message)),
            ACK_INCARNATION => Err(TransferError::IncarnationMismatch { expected, found }),
            ACK_TIMEOUT => Err(TransferError::Timeout),
            ACK_AUTH => Err(TransferError::Auth(self.message)),
            // A protocol slip: treated as an I/O fault (retried, boundedly, on a new attempt).
            _ => Err(TransferError::Io(Arc::new(std::io::Error::other(format!(
                "peer refused the part: {}",
                self.message
            ))))),
        }
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let h = ClientHello {
            version: VERSION,
            client_incarnation: Incarnation(5),
            expected_server: Some(Incarnation(9)),
            nonce: [3; NONCE_LEN],
        };
        assert_eq!(ClientHello::decode(&h.encode()).unwrap(), h);
        let s = ServerHello {
            version: VERSION,
            status: HELLO_OK,
            server_incarnation: Incarnation(9),
            nonce: [1; NONCE_LEN],
            proof: [2; PROOF_LEN],
        };
        assert_eq!(ServerHello::decode(&s.encode()).unwrap(), s);
        let p = PartHeader {
            transfer_id: TransferId(77),
            attempt: 3,
            dst_region: 4,
            dst_incarnation: Incarnation(9),
            batch_extents: 16,
            part_extents: 4,
            timeout_ms: 1000,
            flags: FLAG_CHECKSUMS,
        };
        assert_eq!(PartHeader::decode(&p.encode()).unwrap(), p);
        let e = ExtentHeader {
            index: 2,
            dst_offset: 1 << 40,
            len: 1_769_472,
        };
        assert_eq!(ExtentHeader::decode(&e.encode()), e);
        let err = TransferError::BadRegion("nope".into());
        let a = Ack::new(TransferId(77), 3, Err(&err));
        let bytes = a.encode();
        let (mut back, n) = Ack::decode(bytes[..Ack::LEN].try_into().unwrap()).unwrap();
        back.message = String::from_utf8(bytes[Ack::LEN..Ack::LEN + n].to_vec()).unwrap();
        assert_eq!(back, a);
        assert!(matches!(
            Ack::new(
                TransferId(1),
                1,
                Err(&TransferError::ChecksumMismatch { extent: 5 })
            )
            .into_result(Incarnation(1), Incarnation(2)),
            Err(TransferError::ChecksumMismatch { extent: 5 })
        ));
        assert!(ClientHello::decode(&[0; ClientHello::LEN]).is_err());
    }
}
