//! The engine thread: owns the model and the scheduler, takes requests from any thread, and
//! steps while there is work. Model compute is CPU-bound and uses the kernel thread pool, so it
//! runs on a plain OS thread rather than inside an async runtime.

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{EngineError, Result};
use crate::model::Model;

use super::scheduler::{EngineRequest, EventSink, Scheduler, SchedulerConfig, SchedulerStats};

enum Command {
    Submit(EngineRequest, Box<dyn EventSink>),
    Shutdown,
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
