//! The prefill daemon (`tessera-prefill`).
//!
//! It will own chunked prefill with the prefix cache, and writing MLA pages plus the final KDA
//! snapshot of every group straight into the pages a decode worker reserved.
