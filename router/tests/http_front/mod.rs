//! The HTTP front end to end over a fake backend, grouped by concern.

mod common;

mod access;
mod cancel;
mod errors;
mod generation;
mod service;
