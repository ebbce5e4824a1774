//! `POST /v1/completions`: a text or token-ID prompt in, text (and optionally token IDs) out.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::error::{parse_value, ApiError, ApiJson};
use super::generate::{
    check_token_id, check_top_logprobs, collect_all, Delta, GenOptions, Generation, ResponseHead,
};
use super::logprobs::completion_form;
use super::stream::{json, sse_response, ChunkFormat};
use super::types::{CommonParams, CompletionBody, CompletionChoice, CompletionFields, UsageBody};
use super::{require_object, AppState};

/// A prompt as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

const PROMPT_FORMS: &str =
    "`prompt` must be a string, a list of token ids, or a list holding one of either";

/// Accept a string, a token-id list, or a one-element list of either.
fn parse_prompt(v: Option<Value>, vocab_size: usize) -> Result<Prompt, ApiError> {
    parse_prompt_at(v, vocab_size, false)
}

fn parse_prompt_at(v: Option<Value>, vocab_size: usize, nested: bool) -> Result<Prompt, ApiError> {
    let bad = |msg: String| ApiError::invalid_param("prompt", msg);
    let empty = || bad("`prompt` must not be empty".into());
    match v {
        None | Some(Value::Null) => Err(bad("missing field `prompt`".into())),
        Some(Value::String(s)) if s.is_empty() => Err(empty()),
        Some(Value::String(s)) => Ok(Prompt::Text(s)),
        Some(Value::Array(items)) if items.is_empty() => Err(empty()),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => items
            .iter()
            .map(|x| match x.as_i64() {
                Some(id) => check_token_id(id, vocab_size, "prompt"),
                None => Err(bad(format!("token id {x} is not an integer"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Ids),
        Some(Value::Array(mut items)) if items.len() == 1 && !nested => match items.pop() {
            Some(inner @ (Value::String(_) | Value::Array(_))) => {
                parse_prompt_at(Some(inner), vocab_size, true)
            }
            _ => Err(bad(PROMPT_FORMS.into())),
        },
        Some(Value::Array(items)) if items.iter().all(|x| x.is_string() || x.is_array()) => {
            Err(bad(format!(
                "a batch of {} prompts is not supported: send one prompt per request",
                items.len()
            )))
        }
        Some(_) => Err(bad(PROMPT_FORMS.into())),
    }
}

pub(crate) async fn handle(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    require_object(&body)?;
    let common: CommonParams = parse_value(&body)?;
    let own: CompletionFields = parse_value(&body)?;
    state.check_model(common.model.as_deref())?;
    if own.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    let logprobs = own
        .logprobs
        .map(|k| check_top_logprobs(k, "logprobs"))
        .transpose()?;
    if own.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let max_tokens = common.max_tokens;
    let mut opts = GenOptions::from_params(common, max_tokens, state.vocab_size)?;
    opts.logprobs = logprobs;
    let prompt_ids = match parse_prompt(own.prompt, state.vocab_size)? {
        Prompt::Ids(ids) => ids,
        // As vLLM/HF do, special-token text in a completion prompt maps to special tokens.
        Prompt::Text(text) => state.encode(text, true).await?,
    };
    let (mut choices, head) = state.start_choices(
        "cmpl",
        prompt_ids,
        Vec::new(),
        &opts,
        Some(state.default_completion_max_tokens),
        arrived,
    )?;
    let mut format = CompletionChunks {
        head,
        logprobs: logprobs.is_some(),
        offsets: vec![0; opts.n],
    };
    if opts.stream {
        return sse_response(choices, format, opts.include_usage).await;
    }
    let outputs = collect_all(&mut choices).await?;
    let outputs = outputs
        .into_iter()
        .enumerate()
        .map(|(i, d)| format.choice(i as u32, d))
        .collect();
    let mut body = format.body(outputs);
    body.usage = Some(Generation::usage_of(&choices));
    Ok(Json(body).into_response())
}

/// Builds `text_completion` objects, whole or as stream chunks.
struct CompletionChunks {
    head: ResponseHead,
    /// Whether choices carry log-probabilities.
    logprobs: bool,
    /// Per choice, the characters of its tokens' texts so far (log-probabilities' offsets).
    offsets: Vec<usize>,
}

impl CompletionChunks {
    fn body(&mut self, choices: Vec<CompletionChoice>) -> CompletionBody {
        let head = &self.head;
        CompletionBody {
            id: head.id.clone(),
            object: "text_completion",
            created: head.created,
            model: head.model.clone(),
            choices,
            usage: None,
        }
    }

    /// Choice `index` with the text and ids of `d` (the prompt's ids go with the first choice
    /// sent).
    fn choice(&mut self, index: u32, d: Delta) -> CompletionChoice {
        let logprobs = self
            .logprobs
            .then(|| completion_form(&d.logprobs, &mut self.offsets[index as usize]));
        let head = &mut self.head;
        CompletionChoice {
            index,
            text: d.text,
            logprobs,
            finish_reason: d.finish,
            token_ids: head.return_token_ids.then_some(d.token_ids),
            prompt_token_ids: head.prompt_token_ids.take(),
        }
    }
}

impl ChunkFormat for CompletionChunks {
    fn head(&mut self, _choices: usize) -> Vec<String> {
        Vec::new()
    }

    fn delta(&mut self, index: u32, d: Delta) -> Option<String> {
        let worth = !d.text.is_empty()
            || d.finish.is_some()
            || (self.head.return_token_ids && !d.token_ids.is_empty())
            || (self.logprobs && !d.logprobs.is_empty());
        worth.then(|| {
            let choice = self.choice(index, d);
            json(&self.body(vec![choice]))
        })
    }

    fn usage(&mut self, u: UsageBody) -> String {
        let mut body = self.body(Vec::new());
        body.usage = Some(u);
        json(&body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_forms() {
        let p = |v: Value| parse_prompt(Some(v), 100);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Ids(vec![1, 2]));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Ids(vec![3]));
        for bad in [
            json!(""),
            json!([]),
            json!([[]]),
            json!([100]),
            json!([-1]),
            json!([1.5]),
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!({"a": 1}),
            json!(7),
            json!([["a"]]),
            json!([1, "a"]),
        ] {
            let e = p(bad.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
        assert!(parse_prompt(None, 100).is_err());
    }
}
