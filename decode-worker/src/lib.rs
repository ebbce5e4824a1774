//! The decode daemon (`tessera-decode`).
//!
//! It will own destination-page reservation for incoming prefills, continuous-batching decode over
//! the flat page pool, and token streaming back to the router.
