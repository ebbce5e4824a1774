//! Wire contracts between Tessera's processes (DESIGN.md §4–§7).
//!
//! The `.proto` files live in `proto/proto/tessera/v1/` (package `tessera.v1`); `build.rs`
//! compiles them with `protox` (pure Rust, no system `protoc`) and `tonic-prost-build` into
//! `OUT_DIR`, and [`v1`] includes the result:
//!
//! | file | service | used by |
//! |---|---|---|
//! | `worker.proto` | — (shared messages: [`v1::WorkerInfo`], [`v1::PageLayoutDescriptor`], [`v1::ErrorDetail`], …) | everyone |
//! | `decode.proto` | [`v1::decode_worker_server::DecodeWorker`]: `ReservePages`, `ReleaseReservation`, `StartDecode` (server stream), `Cancel`, `Stats`, `TransferHandshake` | router, prefill → decode |
//! | `prefill.proto` | [`v1::prefill_worker_server::PrefillWorker`]: `Prefill`, `Cancel`, `Stats`, `ReserveEmbeddings` | router → prefill, encoder → prefill |
//! | `encoder.proto` | [`v1::encoder_worker_server::EncoderWorker`]: `Encode`, `Release`, `Stats` | router → encoder |
//! | `generate.proto` | [`v1::generate_server::Generate`]: `Generate` (server stream), `ListModels` | gRPC clients → router |
//!
//! Every daemon also serves the standard `grpc.health.v1` service: [`health`] re-exports
//! `tonic-health` (same tonic version) so workers and the router need no extra dependency.
//!
//! The few helpers here are about the messages themselves: [`v1::Role`] and
//! [`v1::FinishReason`] names, [`v1::ErrorDetail`] in and out of a [`tonic::Status`], the
//! incarnation check, and the page-layout comparison peers run before a transfer.
//!
//! [`etcd`] is a small etcd v3 client (KV, Watch, Lease) over a vendored subset of etcd's
//! `rpc.proto`, for DESIGN §6 discovery.
//!
//! To add a message or field: edit the `.proto` (new field numbers only, never reuse one),
//! rebuild; the Rust types appear under [`v1`].

mod error;
pub mod etcd;
mod layout;
mod names;
pub mod tls;

pub use error::check_incarnation;
pub use names::ParseNameError;

/// Generated code for package `tessera.v1`: messages, plus `*_client` and `*_server` modules for
/// each service.
pub mod v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("tessera.v1");
}

impl v1::KvDestination {
    /// Where a prefill worker writes the pages of reservation `r` made on the decode worker at
    /// `decode_grpc_address`: its incarnation, page ids and cached prefix, with the reservation's
    /// time to live as the transfer deadline (pages that arrive later are refused anyway). The
    /// transfer backend and endpoint stay empty: the prefill worker learns them from the decode
    /// worker in its transfer handshake.
    pub fn for_reservation(decode_grpc_address: String, r: &v1::ReserveReply) -> Self {
        v1::KvDestination {
            decode_grpc_address,
            decode_incarnation_id: r.incarnation_id,
            reservation_id: r.reservation_id.clone(),
            cached_tokens: r.cached_tokens,
            mla_page_ids: r.mla_page_ids.clone(),
            kda_state_page_ids: r.kda_state_page_ids.clone(),
            transfer_timeout_ms: r.ttl_ms,
            ..Default::default()
        }
    }
}

impl v1::LogitBias {
    /// The wire form of (token id, bias) pairs.
    pub fn from_pairs(pairs: &[(u32, f32)]) -> Vec<Self> {
        pairs
            .iter()
            .map(|&(token_id, bias)| v1::LogitBias { token_id, bias })
            .collect()
    }

    /// (token id, bias) pairs of the wire form.
    pub fn pairs(list: &[Self]) -> Vec<(u32, f32)> {
        list.iter().map(|b| (b.token_id, b.bias)).collect()
    }
}

/// The standard gRPC health service (`grpc.health.v1`), from `tonic-health`.
///
/// Serve it with [`health::server::health_reporter`]; query it with
/// [`health::pb::health_client::HealthClient`].
pub use tonic_health as health;

/// The tonic and prost versions the generated code is built against; dependents use these
/// re-exports so the versions cannot drift.
pub use prost;
pub use tonic;

/// The encoded `FileDescriptorSet` of every `tessera.v1` file (with source info), for gRPC
/// reflection and tools such as `grpcurl -protoset`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tessera_descriptor.bin"));

#[cfg(test)]
mod tests;
