//! The engine thread: owns the model and the scheduler, takes requests from any thread, and
//! steps while there is work. Model compute is CPU-bound and uses the kernel thread pool, so it
//! runs on a plain OS thread rather than inside an async runtime.

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{EngineError, Result};
use crate::model::Model;

use crate::kv::PagePool;

use super::request::{EngineRequest, EventSink, Reservation, SchedulerConfig, SchedulerStats};
use super::scheduler::Scheduler;

/// Work run on the engine thread between steps, with the scheduler (and its pool) borrowed.
type Job = Box<dyn FnOnce(&mut Scheduler) + Send>;

enum Command {
    Submit(EngineRequest, Box<dyn EventSink>),
    Run(Job),
    Shutdown,
}

fn stopped() -> EngineError {
    EngineError::InvalidInput("the engine has stopped".into())
}

/// A handle to the engine thread. Dropping it stops the thread (running requests fail).
pub struct EngineHandle {
    tx: Sender<Command>,
    stats: Arc<Mutex<SchedulerStats>>,
    layout: String,
    thread: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Plans the page pool (errors such as a too-small `--kv-memory` surface here) and starts
    /// the thread.
    pub fn spawn(mut model: Model, cfg: SchedulerConfig) -> Result<Self> {
        model.set_batch_invariant(true);
        let scheduler = Scheduler::new(&model, cfg)?;
        let layout = scheduler.layout_report();
        let stats = Arc::new(Mutex::new(scheduler.stats()));
        let (tx, rx) = mpsc::channel();
        let shared = stats.clone();
        let thread = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || run(model, scheduler, rx, shared))
            .map_err(|e| {
                EngineError::InvalidInput(format!("cannot start the engine thread: {e}"))
            })?;
        Ok(EngineHandle {
            tx,
            stats,
            layout,
            thread: Some(thread),
        })
    }

    pub fn submit(&self, req: EngineRequest, sink: Box<dyn EventSink>) -> Result<()> {
        self.tx
            .send(Command::Submit(req, sink))
            .map_err(|_| EngineError::InvalidInput("the engine has stopped".into()))
    }

    /// Runs `f` on the engine thread between two steps and returns its result. Blocks the
    /// calling thread until the engine gets to it (at most one step); async callers should wrap
    /// it in `spawn_blocking`. Every other command below is built on it, so none races a step.
    pub fn with_scheduler<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Scheduler) -> R + Send + 'static,
    ) -> Result<R> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Run(Box::new(move |s| {
                let _ = tx.send(f(s));
            })))
            .map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())
    }

    /// Runs `f` with the page pool on the engine thread: how a transport reads source pages and
    /// writes received bytes into reserved destination pages without racing the model.
    pub fn with_pool<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut PagePool) -> R + Send + 'static,
    ) -> Result<R> {
        self.with_scheduler(move |s| f(s.pool_mut()))
    }

    /// Decode side: reserves destination pages for a `prompt_len`-token handoff.
    pub fn reserve(&self, prompt_len: usize) -> Result<Reservation> {
        self.with_scheduler(move |s| s.reserve(prompt_len))?
    }

    /// Frees a reservation that will not be used; false when it is unknown (already started or
    /// cancelled).
    pub fn cancel_reservation(&self, id: u64) -> Result<bool> {
        self.with_scheduler(move |s| s.cancel_reservation(id))?
    }

    /// Decode side: continues a request whose prompt state was written into reservation
    /// `reservation_id`.
    pub fn submit_resumed(
        &self,
        reservation_id: u64,
        req: EngineRequest,
        first_token: u32,
        cached_tokens: usize,
        sink: Box<dyn EventSink>,
    ) -> Result<()> {
        self.with_scheduler(move |s| {
            s.submit_resumed(reservation_id, req, first_token, cached_tokens, sink)
        })?
    }

    /// Prefill side: drops the pages a handoff held for transfer; false when unknown.
    pub fn release_handoff(&self, id: u64) -> Result<bool> {
        self.with_scheduler(move |s| s.release_handoff(id))?
    }

    /// Pages referenced by anything (requests, reservations, handoffs, the prefix cache), now.
    pub fn live_pages(&self) -> Result<usize> {
        self.with_scheduler(|s| s.live_pages())
    }

    /// Pages the prefix cache alone holds, now.
    pub fn cached_pages(&self) -> Result<usize> {
        self.with_scheduler(|s| s.cached_pages())
    }

    /// Drops every cached prefix.
    pub fn clear_prefix_cache(&self) -> Result<()> {
        self.with_scheduler(|s| s.clear_prefix_cache())?
    }

    /// Scheduler and pool figures as of the last step.
    pub fn stats(&self) -> SchedulerStats {
        self.stats.lock().expect("stats lock").clone()
    }

    /// The page-pool layout (planes, parents, pages per parent, waste).
    pub fn layout_report(&self) -> &str {
        &self.layout
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(
    model: Model,
    mut sched: Scheduler,
    rx: Receiver<Command>,
    stats: Arc<Mutex<SchedulerStats>>,
) {
    loop {
        // Block only when idle; otherwise take what has arrived and keep stepping.
        let mut next = if sched.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Command::Shutdown),
            }
        } else {
            Some(rx.recv().unwrap_or(Command::Shutdown))
        };
        while let Some(cmd) = next.take() {
            match cmd {
                Command::Submit(req, sink) => {
                    sched.submit(req, sink);
                }
                Command::Run(job) => job(&mut sched),
                Command::Shutdown => {
                    let _ = sched.cancel_all();
                    return;
                }
            }
            next = rx.try_recv().ok();
        }
        if sched.has_work() {
            if let Err(e) = sched.step(&model) {
                tracing::error!(error = %e, "engine step failed; failing the running requests");
                let _ = sched.cancel_all();
            }
        }
        *stats.lock().expect("stats lock") = sched.stats();
    }
}
