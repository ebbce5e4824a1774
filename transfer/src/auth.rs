//! The shared secret and the challenge-response proofs of the transfer handshake.
//!
//! Each side sends a fresh nonce; each proves knowledge of the secret with an HMAC-SHA256 over
//! both nonces and both incarnations, under a label per direction so that one side's proof can
//! never be replayed as the other's. The secret itself never crosses the wire.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::region::Incarnation;

/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 16;
/// Length of a handshake proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// The cluster's transfer secret. Debug output never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Secret(Arc::from(bytes.as_ref()))
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Which side of the handshake a proof comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// The values both sides bind their proofs to.
#[derive(Clone, Copy, Debug)]
pub struct Transcript {
    pub client_nonce: [u8; NONCE_LEN],
    pub server_nonce: [u8; NONCE_LEN],
    pub client_incarnation: Incarnation,
    pub server_incarnation: Incarnation,
}

impl Transcript {
    fn mac(&self, secret: &Secret, side: Side) -> Hmac<Sha256> {
        let mut mac = secret.mac();
        mac.update(match side {
            Side::Client => b"tessera-transfer client proof v1",
            Side::Server => b"tessera-transfer server proof v1",
        });
        mac.update(&self.client_nonce);
        mac.update(&self.server_nonce);
        mac.update(&self.client_incarnation.0.to_le_bytes());
        mac.update(&self.server_incarnation.0.to_le_bytes());
        mac
    }

    pub fn prove(&self, secret: &Secret, side: Side) -> [u8; PROOF_LEN] {
        self.mac(secret, side).finalize().into_bytes().into()
    }

    /// Constant-time check of a peer's proof.
    pub fn verify(&self, secret: &Secret, side: Side, proof: &[u8]) -> bool {
        self.mac(secret, side).verify_slice(proof).is_ok()
    }
}

pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).expect("the OS random source is available");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_secret_side_and_transcript() {
        let t = Transcript {
            client_nonce: nonce(),
            server_nonce: nonce(),
            client_incarnation: Incarnation(1),
            server_incarnation: Incarnation(2),
        };
        let s = Secret::new("s3cret");
        let p = t.prove(&s, Side::Client);
        assert!(t.verify(&s, Side::Client, &p));
        assert!(!t.verify(&s, Side::Server, &p));
        assert!(!t.verify(&Secret::new("other"), Side::Client, &p));
        let t2 = Transcript {
            server_incarnation: Incarnation(3),
            ..t
        };
        assert!(!t2.verify(&s, Side::Client, &p));
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }
}
