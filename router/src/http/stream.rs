//! Server-sent events for `stream: true`: `data: {chunk}\n\n` per delta, an optional usage
//! chunk, then `data: [DONE]`. An error after the stream started is sent as a `data:` event
//! holding OpenAI's error JSON, followed by `[DONE]`.
//!
//! The stream owns the [`Generation`]: when the client disconnects, the server drops the stream,
//! which drops the backend receiver and so cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::error::ApiError;
use super::generate::{Delta, Generation};
use super::types::UsageBody;

/// How one endpoint spells its chunks.
pub(crate) trait ChunkFormat: Send + 'static {
    /// Chunks sent before any delta (chat: the `role: "assistant"` chunk).
    fn head(&mut self) -> Vec<String>;
    /// The chunk for one delta, or `None` when it carries nothing worth sending.
    fn delta(&mut self, d: Delta) -> Option<String>;
    /// The trailing usage chunk (`choices: []`).
    fn usage(&mut self, u: UsageBody) -> String;
}

pub(crate) fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("response types always serialize")
}

struct State<F> {
    generation: Generation,
    format: F,
    queue: VecDeque<String>,
    include_usage: bool,
    finished: bool,
}

impl<F: ChunkFormat> State<F> {
    fn push_delta(&mut self, d: Delta) {
        let finish = d.finish.is_some();
        if let Some(chunk) = self.format.delta(d) {
            self.queue.push_back(chunk);
        }
        if finish {
            if self.include_usage {
                let usage = self.generation.usage();
                let chunk = self.format.usage(usage);
                self.queue.push_back(chunk);
            }
            self.close();
        }
    }

    fn close(&mut self) {
        self.queue.push_back("[DONE]".into());
        self.finished = true;
    }
}

/// The SSE response for `generation`, once its first delta has arrived (so that failures before
/// any output still get a proper status code).
pub(crate) async fn sse_response<F: ChunkFormat>(
    mut generation: Generation,
    mut format: F,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let first = generation.first().await?;
    let queue = format.head().into();
    let mut state = State {
        generation,
        format,
        queue,
        include_usage,
        finished: false,
    };
    state.push_delta(first);
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(Event::default().data(data)), st));
            }
            if st.finished {
                return None;
            }
            match st.generation.next().await {
                Some(Ok(d)) => st.push_delta(d),
                Some(Err(e)) => {
                    st.queue.push_back(e.body().to_string());
                    st.close();
                }
                None => st.close(),
            }
        }
    });
    Ok(Sse::new(stream).into_response())
}
