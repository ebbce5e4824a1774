//! Serving on one process: sequences whose state lives in the flat page pool, a continuous
//! batching scheduler with a prefix cache, and a thread that drives it.

pub mod engine_loop;
pub mod handoff;
pub mod paged;
pub mod request;
pub mod scheduler;

pub use engine_loop::EngineHandle;
pub use request::{
    EngineEvent, EngineRequest, EventSink, FinishReason, Handoff, Reservation, SchedulerConfig,
    SchedulerStats, TokenLogprobs, MAX_TOP_LOGPROBS,
};
pub use scheduler::Scheduler;
