//! The front door (`tessera-router`).
//!
//! The OpenAI-compatible HTTP front ([`HttpFront`]) over a [`GenerationBackend`], used by the
//! single-process `tessera serve` (an in-process engine behind the trait) and by the router
//! daemon ([`daemon`], binary `tessera-router`) with [`ClusterBackend`]: gRPC clients of the
//! prefill and decode pools, static discovery, routing policies and P→D orchestration. Still to
//! come: the public gRPC `Generate` service, etcd discovery, encoders. It never links the engine.

pub mod backend;
pub mod cluster;
pub mod daemon;
pub mod fake;
pub mod http;
pub mod metrics;
pub mod text;

pub use backend::{
    BackendError, FinishReason, GenerationBackend, GenerationRequest, Sampling, TokenEvent, Usage,
};
pub use cluster::{ClusterBackend, ClusterConfig, PoolOptions, WorkerPool};
pub use daemon::RouterArgs;
pub use http::{ApiError, FrontOptions, HttpFront};
pub use metrics::Metrics;
