//! The front door (`tessera-router`).
//!
//! It will own the OpenAI-compatible HTTP API and the public gRPC `Generate` service, tokenization
//! and chat templates, discovery (static and etcd), routing policies and E→P→D orchestration. It
//! never links the engine: it speaks gRPC to the worker pools.
