//! Single-process serving: the OpenAI HTTP front of `tessera-router` over the in-process engine.

pub mod engine_backend;
pub mod memory;
