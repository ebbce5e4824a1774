//! Server-sent events for `stream: true`: `data: {chunk}\n\n` per delta of any of the request's
//! choices as it comes, an optional usage chunk once every choice has finished, then `data:
//! [DONE]`. An error after the stream started is sent as a `data:` event holding OpenAI's error
//! JSON, followed by `[DONE]` (the other choices are cancelled).
//!
//! The stream owns the [`Generation`]s: when the client disconnects, the server drops the stream,
//! which drops the backend receivers and so cancels the requests.

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
    /// Chunks sent before any delta, for `choices` choices (chat: a `role: "assistant"` chunk
    /// each).
    fn head(&mut self, choices: usize) -> Vec<String>;
    /// The chunk for one delta of choice `index`, or `None` when it carries nothing worth
    /// sending.
    fn delta(&mut self, index: u32, d: Delta) -> Option<String>;
    /// The trailing usage chunk (`choices: []`).
    fn usage(&mut self, u: UsageBody) -> String;
}

pub(crate) fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("response types always serialize")
}

struct State<F> {
    choices: Vec<Generation>,
    /// Per choice: its last delta was sent.
    ended: Vec<bool>,
    format: F,
    queue: VecDeque<String>,
    include_usage: bool,
    finished: bool,
}

impl<F: ChunkFormat> State<F> {
    fn push_delta(&mut self, index: usize, d: Delta) {
        let finish = d.finish.is_some();
        if let Some(chunk) = self.format.delta(index as u32, d) {
            self.queue.push_back(chunk);
        }
        if finish {
            self.ended[index] = true;
            if self.ended.iter().all(|&e| e) {
                if self.include_usage {
                    let usage = Generation::usage_of(&self.choices);
                    let chunk = self.format.usage(usage);
                    self.queue.push_back(chunk);
                }
                self.close();
            }
        }
    }

    fn close(&mut self) {
        self.queue.push_back("[DONE]".into());
        self.finished = true;
    }

    /// The next event of any choice still going (`Generation::next` only waits on its
    /// channel, so the waits of the others can be dropped).
    async fn next_event(&mut self) -> (usize, Option<Result<Delta, ApiError>>) {
        let waits = self
            .choices
            .iter_mut()
            .zip(&self.ended)
            .enumerate()
            .filter(|(_, (_, &ended))| !ended)
            .map(|(i, (g, _))| Box::pin(async move { (i, g.next().await) }));
        futures_util::future::select_all(waits).await.0
    }
}

/// The SSE response for a request's choices, once each has its first delta (so that failures
/// before any output still get a proper status code).
pub(crate) async fn sse_response<F: ChunkFormat>(
    mut choices: Vec<Generation>,
    mut format: F,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let mut firsts = Vec::with_capacity(choices.len());
    for g in &mut choices {
        firsts.push(g.first().await?);
    }
    let queue = format.head(choices.len()).into();
    let mut state = State {
        ended: vec![false; choices.len()],
        choices,
        format,
        queue,
        include_usage,
        finished: false,
    };
    for (i, first) in firsts.into_iter().enumerate() {
        state.push_delta(i, first);
    }
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(Event::default().data(data)), st));
            }
            if st.finished {
                return None;
            }
            match st.next_event().await {
                (i, Some(Ok(d))) => st.push_delta(i, d),
                (_, Some(Err(e))) => {
                    st.queue.push_back(e.body().to_string());
                    st.close();
                }
                (_, None) => st.close(),
            }
        }
    });
    Ok(Sse::new(stream).into_response())
}
