//! gRPC statuses from workers → [`BackendError`], and which ones another worker may fix.

use tessera_proto::tonic::{Code, Status};
use tessera_proto::v1::ErrorDetail;

use crate::backend::BackendError;

/// What the client sees for a worker's `status` (`what` names the step, for the message).
pub fn to_backend(what: &str, status: &Status) -> BackendError {
    let msg = match ErrorDetail::from_status(status) {
        Some(d) if !d.worker_id.is_empty() => format!("{what} on {}: {}", d.worker_id, d.message),
        _ => format!("{what}: {}", status.message()),
    };
    match status.code() {
        Code::ResourceExhausted => BackendError::Overloaded(msg),
        Code::InvalidArgument | Code::OutOfRange => BackendError::InvalidRequest(msg),
        Code::Unavailable => BackendError::Unavailable(msg),
        _ => BackendError::Internal(msg),
    }
}

/// Whether retrying on another worker can help (everything but a request that is wrong).
pub fn retryable(status: &Status) -> bool {
    !matches!(status.code(), Code::InvalidArgument | Code::OutOfRange)
}

/// Whether the worker itself looks gone (take it out of routing until its next health probe).
pub fn worker_down(status: &Status) -> bool {
    matches!(status.code(), Code::Unavailable | Code::Unknown)
        && ErrorDetail::from_status(status)
            .is_none_or(|d| d.code == tessera_proto::v1::ErrorCode::Draining as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_proto::v1::ErrorCode;

    #[test]
    fn statuses_map_to_backend_errors() {
        let oop = ErrorDetail::new(ErrorCode::OutOfPages, "full").into_status();
        assert!(matches!(
            to_backend("reserve", &oop),
            BackendError::Overloaded(_)
        ));
        assert!(retryable(&oop) && !worker_down(&oop));
        let bad = Status::invalid_argument("empty prompt");
        assert!(matches!(
            to_backend("reserve", &bad),
            BackendError::InvalidRequest(_)
        ));
        assert!(!retryable(&bad));
        let gone = Status::unavailable("connection refused");
        assert!(matches!(
            to_backend("prefill", &gone),
            BackendError::Unavailable(_)
        ));
        assert!(worker_down(&gone));
        let draining = ErrorDetail::new(ErrorCode::Draining, "draining").into_status();
        assert!(worker_down(&draining));
        let transfer = ErrorDetail::new(ErrorCode::TransferFailed, "x").into_status();
        assert!(!worker_down(&transfer));
        assert!(matches!(
            to_backend("x", &Status::internal("boom")),
            BackendError::Internal(_)
        ));
    }
}
