//! The router's cluster backend against real workers: in-process `tessera-prefill` and
//! `tessera-decode` daemons (their own engines, gRPC servers and TCP page transport) on
//! loopback. Greedy tokens must equal the `transformers` fixture; pages must return to baseline
//! on both sides after cancellations; a dead prefill worker must not fail requests.

mod common;

mod faults;
mod flow;
mod transports;
