//! The encode stage of a request with images: pick the prefill worker that will run the
//! prompt, have an encoder (affinity on the first image's hash, then load) push every image's
//! embeddings into that worker's buffers, and widen the prompt's image placeholders to the
//! rows each image produced.

use tessera_proto::v1;

use super::{cancel_on, Attempt, Avoid, Fault, Flow, Progress, Step, Stop, CLEANUP_TIMEOUT};
use crate::backend::BackendError;
use crate::cluster::error::retryable;
use crate::cluster::pool::{Lease, PairWith, Role, Worker};
use crate::images::expand_placeholders;

/// Encoder errors that speak of the destination prefill worker (the encoder could not reserve
/// or fill its buffers): the next attempt avoids that prefill worker.
const PREFILL_SIDE_CODES: [v1::ErrorCode; 3] = [
    v1::ErrorCode::TransferFailed,
    v1::ErrorCode::TransferTimeout,
    v1::ErrorCode::StaleIncarnation,
];

impl Flow {
    /// Prepares an attempt of a request with images; returns it with the prefill worker that
    /// holds the embeddings.
    pub(super) async fn with_images(
        &self,
        wire_id: String,
        progress: &Progress,
        avoid: &Avoid,
    ) -> Step<(Attempt, Lease)> {
        let Some(token) = self.image_token_id else {
            return Err(Stop::Failed(BackendError::InvalidRequest(
                "this model takes no images".into(),
            ))
            .into());
        };
        let pair = PairWith::AnyBut(&avoid.decode);
        let prefill = self.pick_prefill(&self.req.prompt_ids, &avoid.prefill, pair)?;
        let handles = match self.encode(&wire_id, &prefill, &avoid.encoder).await {
            Ok(h) => h,
            Err(f) => {
                cancel_in_background(&prefill, &wire_id);
                return Err(f);
            }
        };
        let rows: Vec<usize> = handles.iter().map(|h| h.n_tokens as usize).collect();
        let widened = expand_placeholders(&self.req.prompt_ids, token, &rows)
            .map_err(|e| BackendError::InvalidRequest(e.to_string()))
            .and_then(|(prompt, positions)| {
                let room = self.max_model_len.saturating_sub(prompt.len());
                if room == 0 {
                    return Err(BackendError::PromptTooLong {
                        prompt_tokens: prompt.len(),
                        limit: self.max_model_len,
                    });
                }
                Ok((prompt, positions, self.req.max_tokens.min(room)))
            });
        let (mut prompt, positions, max_tokens) = match widened {
            Ok(w) => w,
            Err(e) => {
                cancel_in_background(&prefill, &wire_id);
                return Err(Stop::Failed(e).into());
            }
        };
        let prompt_tokens = prompt.len();
        prompt.extend(&progress.tokens);
        let images = handles
            .into_iter()
            .zip(positions)
            .map(|(handle, position)| v1::ImageInput {
                handle: Some(handle),
                position: position as u32,
            })
            .collect();
        let run = Attempt {
            wire_id,
            prompt,
            resumed: progress.tokens.len(),
            prompt_tokens,
            max_tokens,
            images,
        };
        Ok((run, prefill))
    }

    /// Encodes the request's images into `prefill`'s buffers, on another encoder when one
    /// fails; the handles come back in image order.
    async fn encode(
        &self,
        wire_id: &str,
        prefill: &Worker,
        avoid: &[String],
    ) -> Step<Vec<v1::EmbeddingHandle>> {
        let key = self.req.images[0].affinity_key();
        let mut tried: Vec<String> = avoid.to_vec();
        let mut restarted_once: Vec<String> = Vec::new();
        let mut last = None;
        loop {
            let Some(encoder) = self.pool.pick_encoder_for(key, &tried, prefill) else {
                let e = last.unwrap_or_else(|| {
                    let why = self
                        .pool
                        .unpaired(Role::Encoder, &tried, PairWith::Worker(prefill));
                    BackendError::Unavailable(why.unwrap_or_else(|| {
                        "no healthy encoder worker: images cannot be encoded".into()
                    }))
                });
                return Err(Stop::Failed(e).into());
            };
            if tried.len() > avoid.len() {
                self.pool.count_retry(Role::Encoder);
            }
            let msg = v1::EncodeRequest {
                request_id: wire_id.to_string(),
                target_incarnation: encoder.incarnation(),
                images: self
                    .req
                    .images
                    .iter()
                    .map(|i| v1::ImageData {
                        data: i.data.to_vec(),
                        mime_type: i.mime_type.clone(),
                    })
                    .collect(),
                destination: Some(v1::EmbeddingDestination {
                    prefill_incarnation_id: prefill.incarnation(),
                    prefill_grpc_address: prefill.addr.clone(),
                    ..Default::default()
                }),
                ttl_ms: 0,
            };
            let mut client = encoder.encoder_client();
            let r = tokio::select! {
                r = client.encode(encoder.request(msg)) => r,
                _ = self.tx.closed() => return Err(Stop::Cancelled.into()),
            };
            let s = match r {
                Ok(reply) => {
                    encoder.record_success();
                    let handles = reply.into_inner().handles;
                    if handles.len() != self.req.images.len() {
                        let e = BackendError::Internal(format!(
                            "the encoder returned {} embeddings for {} images",
                            handles.len(),
                            self.req.images.len()
                        ));
                        return Err(Stop::Failed(e).into());
                    }
                    return Ok(handles);
                }
                Err(s) => s,
            };
            // A stale incarnation naming the encoder is its own: it restarted after the pick and
            // may take the images once more (its new life), then another encoder does.
            // Otherwise the refusal is the destination's.
            let restarted = encoder.refused_as_restarted(&s);
            let prefill_side = !restarted
                && v1::ErrorDetail::from_status(&s)
                    .is_some_and(|d| PREFILL_SIDE_CODES.iter().any(|&c| c as i32 == d.code));
            if prefill_side {
                let e = self.worker_failed(prefill, "encode into prefill", &s);
                return Err(Fault {
                    stop: Stop::Failed(e),
                    culprit: Some((Role::Prefill, prefill.addr.clone())),
                    retry: true,
                    restarted: false,
                });
            }
            let e = self.worker_failed(&encoder, "encode", &s);
            if !retryable(&s) {
                return Err(Stop::Failed(e).into());
            }
            if restarted && !restarted_once.contains(&encoder.addr) {
                restarted_once.push(encoder.addr.clone());
            } else {
                tried.push(encoder.addr.clone());
            }
            last = Some(e);
        }
    }
}

/// `Cancel` on `w` without waiting (frees what a prefill worker holds for the request: its
/// image embedding buffers).
pub(super) fn cancel_in_background(w: &Lease, request_id: &str) {
    let (w, id) = (w.0.clone(), request_id.to_string());
    tokio::spawn(async move {
        let _ = tokio::time::timeout(CLEANUP_TIMEOUT, cancel_on(&w, &id)).await;
    });
}
