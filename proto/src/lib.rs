//! Wire contracts between Tessera's processes.
//!
//! This crate will own the `.proto` files for the worker services (prefill, decode, encoder:
//! submit, token streams, cancel, page reservation, transfer handshake, stats) and the public
//! `tessera.v1.Generate` streaming service, with tonic/prost code generated into `OUT_DIR` at
//! build time without a system `protoc`. It arrives with the disaggregated cluster; until then it
//! exports nothing.
