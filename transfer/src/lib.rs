//! Moving KV pages and embeddings between workers.
//!
//! This crate will own the `Transport` trait of the design (register memory regions, exchange
//! region descriptors, batched `write_pages` by `(src page, dst page)` pairs per slab, and
//! `write_bytes`, with completion notices and deadlines) and its backends: `local` (same process),
//! `tcp` (tokio, always built) and `ucx` (cargo feature `ucx`, over an in-tree `ucx-sys`). It is
//! family-agnostic: it moves page slots, never "MLA" or "KDA". It arrives with the cluster.
