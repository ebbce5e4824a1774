//! The front door (`tessera-router`).
//!
//! The OpenAI-compatible HTTP front ([`HttpFront`]) over a [`GenerationBackend`], used by the
//! single-process `tessera serve` (an in-process engine behind the trait) and by the router
//! daemon ([`daemon`], binary `tessera-router`) with [`ClusterBackend`]: gRPC clients of the
//! encoder, prefill and decode pools, static and etcd discovery ([`discovery`]), routing policies
//! and E→P→D orchestration. The public gRPC `tessera.v1.Generate` service ([`GrpcFront`]) shares
//! the HTTP front's request path. Images of chat requests ([`images`]) go to the encoder pool.
//! It never links the engine.

pub mod backend;
pub mod cluster;
pub mod daemon;
pub mod discovery;
pub mod fake;
pub mod grpc_front;
pub mod http;
pub mod images;
pub mod metrics;
pub mod text;

pub use backend::{
    BackendError, FinishReason, GenerationBackend, GenerationRequest, Sampling, TokenEvent,
    TokenLogprobs, Usage,
};
pub use cluster::{ClusterBackend, ClusterConfig, PoolOptions, WorkerPool};
pub use daemon::RouterArgs;
pub use grpc_front::GrpcFront;
pub use http::access::{ApiKeys, RateLimit};
pub use http::args::FrontArgs;
pub use http::images::ImageRules;
pub use http::{ApiError, FrontOptions, HttpFront};
pub use images::ImageInput;
pub use metrics::Metrics;
