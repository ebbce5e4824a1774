//! Hugging Face–compatible chat-template rendering with minijinja.
//!
//! Matches what `transformers` does in `apply_chat_template`: Jinja with
//! `trim_blocks` + `lstrip_blocks`, no autoescape, `raise_exception(msg)`,
//! a Python-`json.dumps`-compatible `tojson` (with `indent`, `separators`,
//! `ensure_ascii`, `sort_keys`), Python string/dict methods (`.strip()`,
//! `.startswith()`, `.get()`, `.items()` …) and the special-token strings
//! (`bos_token`, `eos_token`, …) from `tokenizer_config.json` as globals.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::{read_json, TokenizerError};

/// Kimi-style chat template shipped with the tiny test tokenizer (and usable
/// as a fallback for Kimi checkpoints without one).
pub const KIMI_CHAT_TEMPLATE: &str = include_str!("kimi_chat_template.jinja");

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, serialized to the template the way HF passes dicts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: MessageContent,
    /// Other message fields handed to the template as-is (`name`,
    /// `tool_calls`, `tool_call_id`, `reasoning_content`, …).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<MessageContent>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            extra: Default::default(),
        }
    }
}

/// Message content: a string, a list of OpenAI-style parts
/// (`{"type":"text","text":..}`, `{"type":"image_url","image_url":{..}}`, …),
/// or null (e.g. an assistant turn that only carries tool calls).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<serde_json::Value>),
    #[default]
    Null,
}

impl MessageContent {
    /// Concatenated text of all text parts.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(s) => s.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter(|p| p.get("type").and_then(|t| t.as_str()) == Some("text"))
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect(),
            MessageContent::Null => String::new(),
        }
    }
}

impl From<String> for MessageContent {
    fn from(s: String) -> Self {
        MessageContent::Text(s)
    }
}

impl From<&str> for MessageContent {
    fn from(s: &str) -> Self {
        MessageContent::Text(s.to_string())
    }
}

impl From<Vec<serde_json::Value>> for MessageContent {
    fn from(parts: Vec<serde_json::Value>) -> Self {
        MessageContent::Parts(parts)
    }
}

/// A compiled chat template plus the special-token globals it sees.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("tokens", &self.tokens)
            .finish()
    }
}

/// Special-token globals HF exposes to templates.
const TOKEN_KEYS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        // AddedToken serialized as {"content": ..., "__type": "AddedToken", ...}
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// Read the checkpoint's chat template: `chat_template.jinja` if present,
    /// else `chat_template` in `tokenizer_config.json` (a string, or a list of
    /// `{name, template}` from which "default" is used), else
    /// `chat_template.json`. `Ok(None)` when the checkpoint has none.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>, TokenizerError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.is_file() {
            Some(read_json(&cfg_path)?)
        } else {
            None
        };

        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        let (source, name) = if jinja_path.is_file() {
            let s = std::fs::read_to_string(&jinja_path)
                .map_err(|e| TokenizerError::io(&jinja_path, e))?;
            (s, jinja_path.display().to_string())
        } else if let Some(t) = cfg
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .filter(|t| !t.is_null())
        {
            let bad = |msg: &str| TokenizerError::Config {
                path: cfg_path.clone(),
                msg: msg.to_string(),
            };
            let s = match t {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Array(list) => list
                    .iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .ok_or_else(|| bad("chat_template list has no \"default\" entry"))?
                    .get("template")
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| bad("chat_template \"default\" entry has no string `template`"))?
                    .to_string(),
                _ => return Err(bad("chat_template is neither a string nor a list")),
            };
            (s, format!("{} (chat_template)", cfg_path.display()))
        } else if json_path.is_file() {
            let v = read_json(&json_path)?;
            let s = v
                .get("chat_template")
                .and_then(|t| t.as_str())
                .ok_or_else(|| TokenizerError::Config {
                    path: json_path.clone(),
                    msg: "no string `chat_template`".into(),
                })?;
            (s.to_string(), json_path.display().to_string())
        } else {
            return Ok(None);
        };

        let mut tmpl = ChatTemplate::new_named(&source, &name)?;
        if let Some(cfg) = &cfg {
            for key in TOKEN_KEYS {
                if let Some(s) = cfg.get(key).and_then(token_string) {
                    tmpl.tokens.insert(key.to_string(), s);
                }
            }
        }
        Ok(Some(tmpl))
    }

    /// Compile a template from source (syntax errors are reported here).
    pub fn new(source: &str) -> Result<ChatTemplate, TokenizerError> {
        Self::new_named(source, TEMPLATE_NAME)
    }

    fn new_named(source: &str, display_name: &str) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", py_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::TemplateSyntax {
                source_name: display_name.to_string(),
                msg: error_chain(&e),
            })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            tokens: BTreeMap::new(),
        })
    }

    /// Set a special-token global (`bos_token`, `eos_token`, …).
    pub fn with_token(mut self, key: &str, value: &str) -> Self {
        self.tokens.insert(key.to_string(), value.to_string());
        self
    }

    /// The template source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render `messages`; with `add_generation_prompt` the assistant header
    /// is appended.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`render`](Self::render) with extra template variables (`tools`,
    /// `documents`, `thinking`, …) as HF's `**kwargs`.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.tokens {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        for (k, v) in extra {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let tmpl =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| TokenizerError::TemplateRender {
                    msg: error_chain(&e),
                })?;
        tmpl.render(Value::from(ctx))
            .map_err(|e| TokenizerError::TemplateRender {
                msg: error_chain(&e),
            })
    }
}

fn error_chain(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let _ = write!(msg, ": {s}");
        src = s.source();
    }
    msg
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, not HTML-escaped.
fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be two strings",
                    ))
                }
            }
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn newline_indent(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&py_float_repr(f64::try_from(v.clone())?));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Bytes => write_json_str(
            out,
            &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()),
            opts.ensure_ascii,
        ),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                write_json_str(out, &key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, &v.get_item(k)?, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Plain => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot serialize {} to JSON", v.kind()),
            ))
        }
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (as `json.dumps` writes floats).
fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{x:e}"); // shortest round-trip digits, e.g. "1.5e-7"
    let (mant, exp) = sci.split_once('e').expect("exponent");
    let exp: i32 = exp.parse().expect("exponent");
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            s + ".0"
        }
    } else {
        format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sys_user() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", "Is 123 a prime?"),
        ]
    }

    #[test]
    fn kimi_format_system_user() {
        let t = ChatTemplate::new(KIMI_CHAT_TEMPLATE).unwrap();
        let out = t.render(&sys_user(), true).unwrap();
        assert_eq!(
            out,
            "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>\
             <|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|>\
             <|im_assistant|>assistant<|im_middle|>"
        );
        let out = t.render(&sys_user(), false).unwrap();
        assert!(out.ends_with("Is 123 a prime?<|im_end|>"), "{out}");
    }

    #[test]
    fn kimi_format_default_system_parts_tools() {
        let t = ChatTemplate::new(KIMI_CHAT_TEMPLATE).unwrap();
        let mut tool_call = ChatMessage::new("assistant", MessageContent::Null);
        tool_call.extra.insert(
            "tool_calls".into(),
            json!([{"id": "functions.get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"北京\"}"}}]),
        );
        let mut tool_result = ChatMessage::new("tool", "sunny");
        tool_result
            .extra
            .insert("tool_call_id".into(), json!("functions.get_weather:0"));
        let msgs = vec![
            ChatMessage::new(
                "user",
                vec![
                    json!({"type": "image_url", "image_url": {"url": "data:,"}}),
                    json!({"type": "text", "text": "  What is this?"}),
                ],
            ),
            tool_call,
            tool_result,
        ];
        let mut extra = serde_json::Map::new();
        extra.insert(
            "tools".into(),
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]),
        );
        let out = t.render_with(&msgs, true, &extra).unwrap();
        assert_eq!(
            out,
            "<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"name\":\"get_weather\",\"parameters\":{}},\"type\":\"function\"}]<|im_end|>\
             <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\
             <|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>  What is this?<|im_end|>\
             <|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
             <|tool_call_argument_begin|>{\"city\": \"北京\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>\
             <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>\
             <|im_assistant|>assistant<|im_middle|>"
        );
    }

    #[test]
    fn hf_compat_pycompat_tojson_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}|{{ m.get('name', 'anon') }}\n{% endfor %}\
                   {{ {'b': [1, 2.5, none, true], 'a': 'é<'} | tojson }}|{{ [1] | tojson(indent=2) }}|{{ 'é' | tojson(ensure_ascii=true) }}";
        let t = ChatTemplate::new(src)
            .unwrap()
            .with_token("bos_token", "[BOS]");
        let out = t
            .render(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(
            out,
            "[BOS]HI|anon\n{\"b\": [1, 2.5, null, true], \"a\": \"é<\"}|[\n  1\n]|\"\\u00e9\""
        );
    }

    #[test]
    fn errors_not_panics() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content }").unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err}"
        );
        let err = ChatTemplate::new("{% if x %}").unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err}"
        );

        let t = ChatTemplate::new("{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}").unwrap();
        let err = t
            .render(&[ChatMessage::new("user", "x")], false)
            .unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRender { .. })
                && err.to_string().contains("need a system turn"),
            "{err}"
        );

        let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}").unwrap();
        assert!(t.render(&[ChatMessage::new("user", "x")], false).is_err());

        let t = ChatTemplate::new(KIMI_CHAT_TEMPLATE).unwrap();
        let err = t
            .render(
                &[ChatMessage::new("user", vec![json!({"type": "audio"})])],
                false,
            )
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("unsupported content part type: audio"),
            "{err}"
        );
    }

    #[test]
    fn from_dir_variants() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());

        let cfg = json!({"chat_template": "{{ bos_token }}{{ eos_token }}{{ messages | length }}",
                         "bos_token": "[BOS]", "eos_token": {"content": "[EOS]", "__type": "AddedToken"}});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&sys_user(), false).unwrap(), "[BOS][EOS]2");

        let cfg = json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D");

        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{% if add_generation_prompt %}G{% endif %}\n",
        )
        .unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], true).unwrap(), "JG");

        std::fs::write(dir.path().join("chat_template.jinja"), "{% endfor %}").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }

    #[test]
    fn message_serde_openai_shape() {
        let m: ChatMessage =
            serde_json::from_value(json!({"role": "assistant", "content": null, "tool_calls": []}))
                .unwrap();
        assert_eq!(m.content, MessageContent::Null);
        assert!(m.extra.contains_key("tool_calls"));
        let m: ChatMessage = serde_json::from_value(json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})).unwrap();
        assert_eq!(m.content.text(), "ab");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(py_float_repr(0.1), "0.1");
        assert_eq!(py_float_repr(3.0), "3.0");
    }
}
