//! The one error type of every transport.

use std::sync::Arc;

use crate::region::{Incarnation, RegionError};

/// Why a transfer, connection or wait failed. Only [`TransferError::Io`] is retried (a broken
/// connection may be re-established); everything else is final for that call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    #[error("deadline passed before the operation completed")]
    Timeout,
    #[error("peer is gone: {0}")]
    PeerGone(String),
    /// The receiver's checksum of extent `extent` (index in the batch) differs from the sender's.
    #[error("checksum mismatch in extent {extent} of the batch")]
    ChecksumMismatch { extent: u32 },
    #[error("bad region: {0}")]
    BadRegion(String),
    #[error("authentication failed: {0}")]
    Auth(String),
    #[error("incarnation mismatch: expected {expected}, found {found}")]
    IncarnationMismatch {
        expected: Incarnation,
        found: Incarnation,
    },
    #[error("i/o error: {0}")]
    Io(Arc<std::io::Error>),
}

impl TransferError {
    /// Whether a retry on a fresh connection may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, TransferError::Io(_))
    }

    pub(crate) fn protocol(msg: impl Into<String>) -> Self {
        TransferError::Io(Arc::new(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            msg.into(),
        )))
    }
}

impl From<std::io::Error> for TransferError {
    fn from(e: std::io::Error) -> Self {
        TransferError::Io(Arc::new(e))
    }
}

impl From<RegionError> for TransferError {
    fn from(e: RegionError) -> Self {
        TransferError::BadRegion(e.to_string())
    }
}
