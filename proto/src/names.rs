//! Human names of the wire enums: what logs, CLI flags and etcd keys
//! (`/tessera/<cluster>/workers/<role>/<id>`, DESIGN §6) use.

use std::fmt;
use std::str::FromStr;

use crate::v1::{FinishReason, Role, TransferBackend};

/// A name that does not denote any value of the enum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseNameError {
    what: &'static str,
    got: String,
    expected: &'static str,
}

impl fmt::Display for ParseNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?} (expected one of: {})",
            self.what, self.got, self.expected
        )
    }
}

impl std::error::Error for ParseNameError {}

impl Role {
    /// `encoder`, `prefill`, `decode` (`unspecified` for the zero value).
    pub fn name(self) -> &'static str {
        match self {
            Role::Unspecified => "unspecified",
            Role::Encoder => "encoder",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepts `encoder`/`prefill`/`decode` in any case, and the proto names (`ROLE_DECODE`).
impl FromStr for Role {
    type Err = ParseNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let role = match t.to_ascii_lowercase().as_str() {
            "encoder" | "encode" => Some(Role::Encoder),
            "prefill" => Some(Role::Prefill),
            "decode" | "decoder" => Some(Role::Decode),
            _ => Role::from_str_name(&t.to_ascii_uppercase()).filter(|r| *r != Role::Unspecified),
        };
        role.ok_or_else(|| ParseNameError {
            what: "worker role",
            got: s.to_string(),
            expected: "encoder, prefill, decode",
        })
    }
}

impl FinishReason {
    /// `stop`, `length` (as OpenAI's `finish_reason`), `cancelled`, `error`; `None` while the
    /// request is still running.
    pub fn name(self) -> Option<&'static str> {
        match self {
            FinishReason::Unspecified => None,
            FinishReason::Stop => Some("stop"),
            FinishReason::Length => Some("length"),
            FinishReason::Cancelled => Some("cancelled"),
            FinishReason::Error => Some("error"),
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name().unwrap_or("unfinished"))
    }
}

impl TransferBackend {
    /// `local`, `tcp`, `ucx` (`unspecified` for the zero value).
    pub fn name(self) -> &'static str {
        match self {
            TransferBackend::Unspecified => "unspecified",
            TransferBackend::Local => "local",
            TransferBackend::Tcp => "tcp",
            TransferBackend::Ucx => "ucx",
        }
    }
}

impl fmt::Display for TransferBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accepts `local`/`tcp`/`ucx` in any case, and the proto names (`TRANSFER_BACKEND_TCP`).
impl FromStr for TransferBackend {
    type Err = ParseNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let backend = match t.to_ascii_lowercase().as_str() {
            "local" => Some(TransferBackend::Local),
            "tcp" => Some(TransferBackend::Tcp),
            "ucx" => Some(TransferBackend::Ucx),
            _ => TransferBackend::from_str_name(&t.to_ascii_uppercase())
                .filter(|b| *b != TransferBackend::Unspecified),
        };
        backend.ok_or_else(|| ParseNameError {
            what: "transfer backend",
            got: s.to_string(),
            expected: "local, tcp, ucx",
        })
    }
}
