//! What the serving tests share: a request's events collected as they come, and a scheduler run
//! until it has nothing left to do.

use std::sync::{Arc, Mutex};

use tessera_engine::serving::{EngineEvent, Scheduler};
use tessera_engine::Model;

/// The events of one request, in order.
pub type Events = Arc<Mutex<Vec<EngineEvent>>>;

/// A sink that appends every event to `ev` and always asks for more.
pub fn sink(ev: &Events) -> Box<dyn FnMut(EngineEvent) -> bool + Send> {
    let ev = ev.clone();
    Box::new(move |e| {
        ev.lock().unwrap().push(e);
        true
    })
}

/// The tokens among `ev`.
pub fn tokens(ev: &Events) -> Vec<u32> {
    ev.lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Token(t) => Some(*t),
            _ => None,
        })
        .collect()
}

/// Steps `s` until it has no work, failing the test if it stops making progress.
pub fn drain(s: &mut Scheduler, m: &Model) {
    let mut guard = 0;
    while s.has_work() {
        s.step(m).unwrap();
        guard += 1;
        assert!(guard < 100_000, "scheduler does not make progress");
    }
}
