//! Request and response bodies of the OpenAI-compatible API.
//!
//! A request body is parsed once into a JSON value, then read as the fields both endpoints
//! share ([`CommonParams`]) and the endpoint's own ([`CompletionFields`], [`ChatFields`]);
//! unknown fields are ignored, as OpenAI clients send many. Numbers are read wide (`i64`, `f64`)
//! so range errors get our messages rather than serde's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tessera_tokenizer::ChatMessage;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM extension; -1 or 0 disables.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    /// vLLM extension.
    pub stop_token_ids: Option<Vec<i64>>,
    /// vLLM extension.
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// vLLM extension: add generated (and prompt) token IDs to the response.
    #[serde(default)]
    pub return_token_ids: bool,
}

/// Fields only `/v1/completions` has.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionFields {
    /// Text, token IDs, or a one-element list of either; checked by hand for clear messages.
    pub prompt: Option<Value>,
    pub echo: Option<bool>,
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
}

/// Fields only `/v1/chat/completions` has.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatFields {
    pub messages: Option<Vec<ChatMessage>>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Passed to the chat template as `tools`.
    pub tools: Option<Value>,
    /// vLLM extension: extra chat-template variables (`thinking`, …).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    pub response_format: Option<Value>,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct UsageBody {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl UsageBody {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        UsageBody {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// One choice of a `text_completion` (whole response or stream chunk).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// A completion choice's log-probabilities (OpenAI's legacy form): per token its text, its
/// log-probability, the most likely alternatives by text, and where its text starts in the
/// choice's text (characters, counting the tokens' own texts).
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

/// `object: "text_completion"`, used for both the response and its stream chunks.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionBody {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A chat choice's log-probabilities: one entry per generated token.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// One token's text, log-probability and UTF-8 bytes, with the most likely alternatives.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `object: "chat.completion"`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatBody {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageBody,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `object: "chat.completion.chunk"`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
