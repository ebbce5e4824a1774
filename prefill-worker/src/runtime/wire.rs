//! What the workers read from and write to the wire about sampling: the engine's sampling
//! parameters, and tokens' log-probabilities.

use tessera_engine::serving::{TokenLogprobs, MAX_TOP_LOGPROBS};
use tessera_engine::SamplingParams;
use tessera_proto::tonic;
use tessera_proto::v1;

/// Engine sampling parameters from the wire's (absent fields take the engine's defaults).
pub fn sampling_from_wire(p: Option<&v1::SamplingParams>) -> SamplingParams {
    let d = SamplingParams::default();
    match p {
        None => d,
        Some(p) => SamplingParams {
            temperature: p.temperature,
            top_p: p.top_p.unwrap_or(d.top_p),
            top_k: p.top_k as usize,
            seed: p.seed.unwrap_or(d.seed),
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: v1::LogitBias::pairs(&p.logit_bias),
        },
    }
}

/// A request's count of alternative log-probabilities from the wire, checked against the
/// engine's bound.
#[allow(clippy::result_large_err)] // tonic's Status is what the handlers return anyway
pub fn top_logprobs_from_wire(k: Option<u32>) -> Result<Option<usize>, tonic::Status> {
    match k {
        Some(k) if k as usize > MAX_TOP_LOGPROBS => Err(v1::ErrorDetail::new(
            v1::ErrorCode::InvalidArgument,
            format!("logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"),
        )
        .into_status()),
        k => Ok(k.map(|k| k as usize)),
    }
}

/// One token's log-probabilities on the wire.
pub fn logprobs_to_wire(lp: &TokenLogprobs) -> v1::TokenLogprobs {
    v1::TokenLogprobs {
        token_id: lp.token,
        logprob: lp.logprob,
        top_ids: lp.top.iter().map(|&(t, _)| t).collect(),
        top_logprobs: lp.top.iter().map(|&(_, l)| l).collect(),
    }
}
