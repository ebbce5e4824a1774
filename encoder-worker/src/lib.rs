//! The vision-encoder daemon (`tessera-encoder`).
//!
//! It will own the encoder pool's process: MoonViT forward on image parts, embedding handles
//! returned to the router, and embeddings moved to prefill workers over `tessera-transfer`.
