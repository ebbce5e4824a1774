//! `POST /v1/chat/completions`: messages are rendered with the model's chat template
//! (`add_generation_prompt = true`), tokenized with special tokens allowed, and generated from.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tessera_tokenizer::{ChatMessage, MessageContent};

use super::error::{parse_value, ApiError, ApiJson};
use super::generate::{
    check_top_logprobs, collect_all, Delta, GenOptions, Generation, ResponseHead,
};
use super::logprobs::chat_form;
use super::stream::{json, sse_response, ChunkFormat};
use super::types::{
    AssistantMessage, ChatBody, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatFields,
    CommonParams, UsageBody,
};
use super::{require_object, AppState};

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Catch a wrongly typed `content` before serde's untagged-enum message would hide the cause.
fn check_content_types(body: &Value) -> Result<(), ApiError> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Ok(());
    };
    for (i, m) in messages.iter().enumerate() {
        match m.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].content"),
                    "`content` must be a string, a list of content parts, or null",
                ))
            }
        }
    }
    Ok(())
}

/// Check roles and content parts before they reach the template.
fn check_messages(messages: &[ChatMessage]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must not be empty",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].role"),
                format!(
                    "unknown role `{}`: expected one of {}",
                    m.role,
                    ROLES.join(", ")
                ),
            ));
        }
        let param = format!("messages[{i}].content");
        match &m.content {
            MessageContent::Null if m.role != "assistant" => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!("a `{}` message needs content", m.role),
                ))
            }
            MessageContent::Parts(parts) => {
                for part in parts {
                    check_part(part).map_err(|msg| ApiError::invalid_param(&param, msg))?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn check_part(part: &Value) -> Result<(), String> {
    let ty = part.get("type").and_then(Value::as_str);
    match ty {
        Some("text") if part.get("text").is_some_and(Value::is_string) => Ok(()),
        Some("text") => Err("a `text` content part needs a string `text`".into()),
        Some("image_url" | "image" | "input_image") => super::images::check_image_part(part),
        Some(other) => Err(format!("content parts of type `{other}` are not supported")),
        None => Err("every content part needs a string `type`".into()),
    }
}

pub(crate) async fn handle(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    require_object(&body)?;
    let common: CommonParams = parse_value(&body)?;
    check_content_types(&body)?;
    let own: ChatFields = parse_value(&body)?;
    state.check_model(common.model.as_deref())?;
    let logprobs = match (own.logprobs, own.top_logprobs) {
        (Some(true), top) => Some(check_top_logprobs(top.unwrap_or(0), "top_logprobs")?),
        (_, Some(k)) if k != 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        _ => None,
    };
    if let Some(rf) = &own.response_format {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::invalid_param(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    let mut messages = own
        .messages
        .ok_or_else(|| ApiError::invalid_param("messages", "missing field `messages`"))?;
    check_messages(&messages)?;
    let sources = super::images::take_images(
        &mut messages,
        &state.image_rules,
        state.image_token_id.is_some(),
        state.remote_images.is_some(),
    )?;
    let images =
        super::images::fetch_images(sources, &state.image_rules, state.remote_images.as_deref())
            .await?;
    let max_tokens = own.max_completion_tokens.or(common.max_tokens);
    let mut opts = GenOptions::from_params(common, max_tokens, state.vocab_size)?;
    opts.logprobs = logprobs;
    let Some(template) = state.chat_template.clone() else {
        return Err(ApiError::invalid(
            "This model has no chat template; use /v1/completions",
        ));
    };
    let mut vars = own.chat_template_kwargs.unwrap_or_default();
    if let Some(tools) = own.tools {
        vars.insert("tools".into(), tools);
    }
    let rendered =
        tokio::task::spawn_blocking(move || template.render_with(&messages, true, &vars))
            .await
            .map_err(|e| ApiError::internal(format!("chat template task failed: {e}")))?
            .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let prompt_ids = state.encode(rendered, true).await?;
    if let Some(token) = state.image_token_id {
        let runs = crate::images::placeholder_runs(&prompt_ids, token).len();
        if runs != images.len() {
            return Err(ApiError::invalid_param(
                "messages",
                format!(
                    "the rendered prompt has {runs} image placeholder(s) for {} image(s)",
                    images.len()
                ),
            ));
        }
    }
    let (mut choices, head) =
        state.start_choices("chatcmpl", prompt_ids, images, &opts, None, arrived)?;
    if opts.stream {
        let format = ChatChunks {
            head,
            logprobs: logprobs.is_some(),
        };
        return sse_response(choices, format, opts.include_usage).await;
    }
    let outputs = collect_all(&mut choices).await?;
    let body = ChatBody {
        id: head.id,
        object: "chat.completion",
        created: head.created,
        model: head.model,
        choices: outputs
            .into_iter()
            .enumerate()
            .map(|(i, d)| ChatChoice {
                index: i as u32,
                message: AssistantMessage {
                    role: "assistant",
                    content: d.text,
                },
                logprobs: logprobs.map(|_| chat_form(&d.logprobs)),
                finish_reason: d.finish,
                token_ids: head.return_token_ids.then_some(d.token_ids),
            })
            .collect(),
        usage: Generation::usage_of(&choices),
        prompt_token_ids: head.prompt_token_ids,
    };
    Ok(Json(body).into_response())
}

/// Builds `chat.completion.chunk` objects.
struct ChatChunks {
    head: ResponseHead,
    /// Whether choices carry log-probabilities.
    logprobs: bool,
}

impl ChatChunks {
    fn chunk(&mut self, choices: Vec<ChatChunkChoice>, usage: Option<UsageBody>) -> String {
        let head = &mut self.head;
        json(&ChatChunk {
            id: head.id.clone(),
            object: "chat.completion.chunk",
            created: head.created,
            model: head.model.clone(),
            choices,
            usage,
            prompt_token_ids: head.prompt_token_ids.take(),
        })
    }
}

impl ChunkFormat for ChatChunks {
    fn head(&mut self, choices: usize) -> Vec<String> {
        (0..choices as u32)
            .map(|index| {
                let choice = ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                    token_ids: None,
                };
                self.chunk(vec![choice], None)
            })
            .collect()
    }

    fn delta(&mut self, index: u32, d: Delta) -> Option<String> {
        let has_ids = self.head.return_token_ids && !d.token_ids.is_empty();
        let has_logprobs = self.logprobs && !d.logprobs.is_empty();
        if d.text.is_empty() && d.finish.is_none() && !has_ids && !has_logprobs {
            return None;
        }
        let logprobs = self.logprobs.then(|| chat_form(&d.logprobs));
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta {
                role: None,
                content: (!d.text.is_empty() || d.finish.is_none()).then_some(d.text),
            },
            logprobs,
            finish_reason: d.finish,
            token_ids: self.head.return_token_ids.then_some(d.token_ids),
        };
        Some(self.chunk(vec![choice], None))
    }

    fn usage(&mut self, u: UsageBody) -> String {
        self.chunk(Vec::new(), Some(u))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msgs(v: Value) -> Vec<ChatMessage> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn message_checks() {
        let ok = msgs(json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null, "tool_calls": []},
        ]));
        check_messages(&ok).unwrap();
        let cases = [
            (json!([]), "messages"),
            (
                json!([{"role": "wizard", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"role": "user"}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text"}]}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": "a"}, {"role": "user", "content": [{"x": 1}]}]),
                "messages[1].content",
            ),
        ];
        for (v, param) in cases {
            let e = check_messages(&msgs(v.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{v}");
        }
    }
}
