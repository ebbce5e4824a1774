//! The front door (`tessera-router`).
//!
//! Today: the OpenAI-compatible HTTP front ([`HttpFront`]) over a [`GenerationBackend`], used by
//! the single-process `tessera serve` (an in-process engine behind the trait) and, later, by the
//! router daemon (gRPC clients of the worker pools behind it). It will also own the public gRPC
//! `Generate` service, discovery (static and etcd), routing policies and E→P→D orchestration. It
//! never links the engine.

pub mod backend;
pub mod fake;
pub mod http;
pub mod metrics;
pub mod text;

pub use backend::{
    BackendError, FinishReason, GenerationBackend, GenerationRequest, Sampling, TokenEvent, Usage,
};
pub use http::{ApiError, FrontOptions, HttpFront};
pub use metrics::Metrics;
