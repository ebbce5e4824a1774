//! Tests of the kv module that span files or need room: layout arithmetic, and the property
//! test of the pool and the prefix index together.

mod layout;
mod props;
