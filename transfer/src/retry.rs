//! Retrying a transfer after I/O errors, within its deadline.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

use crate::{TransferError, TransferId, TransferReceipt};

/// Runs `attempt` (given a fresh attempt number drawn from `counter`) until it succeeds, fails
/// with an error that is not retryable, or `max_retries` retries failed too; no retry starts
/// once `deadline` has passed. The receipt reports `bytes` and the tries made; `backend` names
/// the transport in logs.
pub(crate) async fn with_retries<F, Fut>(
    backend: &'static str,
    counter: &AtomicU64,
    max_retries: u32,
    transfer_id: TransferId,
    bytes: u64,
    deadline: Instant,
    mut attempt: F,
) -> Result<TransferReceipt, TransferError>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<(), TransferError>>,
{
    let start = Instant::now();
    let mut last = TransferError::Timeout;
    for attempt_no in 1..=max_retries + 1 {
        match attempt(counter.fetch_add(1, Ordering::Relaxed) + 1).await {
            Ok(()) => {
                return Ok(TransferReceipt {
                    bytes,
                    elapsed: start.elapsed(),
                    attempts: attempt_no,
                })
            }
            Err(e) if e.is_retryable() => {
                tracing::debug!(error = %e, transfer = %transfer_id, attempt_no, backend, "transfer attempt failed");
                last = e;
            }
            Err(e) => return Err(e),
        }
        if Instant::now() >= deadline {
            return Err(TransferError::Timeout);
        }
    }
    Err(last)
}
