//! [`ErrorDetail`] carried in a gRPC [`Status`]'s details, and the incarnation check every worker
//! runs on requests aimed at its state.

use prost::Message as _;
use tonic::{Code, Status};

use crate::v1::{ErrorCode, ErrorDetail};

impl ErrorCode {
    /// The gRPC status code this error travels under (as documented in `worker.proto`).
    pub fn grpc_code(self) -> Code {
        match self {
            ErrorCode::Unspecified => Code::Unknown,
            ErrorCode::InvalidArgument => Code::InvalidArgument,
            ErrorCode::OutOfPages | ErrorCode::Overloaded => Code::ResourceExhausted,
            ErrorCode::Draining | ErrorCode::TransferFailed => Code::Unavailable,
            ErrorCode::StaleIncarnation | ErrorCode::LayoutMismatch | ErrorCode::ModelMismatch => {
                Code::FailedPrecondition
            }
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::ReservationExpired | ErrorCode::TransferTimeout => Code::DeadlineExceeded,
            ErrorCode::ChecksumMismatch => Code::DataLoss,
            ErrorCode::Cancelled => Code::Cancelled,
            ErrorCode::Unauthenticated => Code::Unauthenticated,
            ErrorCode::Internal => Code::Internal,
        }
    }
}

impl ErrorDetail {
    /// An error with `code` and `message`; the other fields stay empty for the caller to fill.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorDetail {
            code: code as i32,
            message: message.into(),
            ..Default::default()
        }
    }

    /// A status with this error's gRPC code and message, and the encoded detail attached.
    pub fn into_status(self) -> Status {
        let code = self.code().grpc_code();
        let message = self.message.clone();
        Status::with_details(code, message, self.encode_to_vec().into())
    }

    /// The detail a Tessera worker attached to `status`; `None` when there is none (a transport
    /// error, or a status from something else).
    pub fn from_status(status: &Status) -> Option<ErrorDetail> {
        let details = status.details();
        if details.is_empty() {
            return None;
        }
        ErrorDetail::decode(details).ok()
    }
}

impl From<ErrorDetail> for Status {
    fn from(detail: ErrorDetail) -> Status {
        detail.into_status()
    }
}

/// Refuses a request whose `target_incarnation` names another life of this worker (0 accepts
/// any), with FAILED_PRECONDITION and [`ErrorCode::StaleIncarnation`].
#[allow(clippy::result_large_err)] // tonic's Status is what the handlers return anyway
pub fn check_incarnation(target: u64, own: u64, worker_id: &str) -> Result<(), Status> {
    if target == 0 || target == own {
        return Ok(());
    }
    let mut detail = ErrorDetail::new(
        ErrorCode::StaleIncarnation,
        format!(
            "worker {worker_id} is incarnation {own:#x}, the request targets {target:#x} \
             (the worker restarted)"
        ),
    );
    detail.worker_id = worker_id.to_string();
    detail.incarnation_id = own;
    detail.retryable = true;
    Err(detail.into_status())
}
