//! Tokenization and chat templating for Kimi-family checkpoints.
//!
//! * [`Tokenizer`]: `tokenizer.json` (Hugging Face `tokenizers`) when present,
//!   otherwise Kimi's `tiktoken.model` + `tokenizer_config.json` specials.
//! * [`StreamDecoder`]: incremental detokenization that only ever yields
//!   complete UTF-8 text.
//! * [`ChatTemplate`]: the checkpoint's Jinja chat template, rendered with
//!   minijinja in Hugging Face–compatible mode.
//! * [`write_tiny_tokenizer`]: a small deterministic Kimi-style tokenizer for
//!   the random-weight test model.
//!
//! BOS/EOS ids are not handled here; they come from `config.json`.

mod chat_template;
mod hf;
mod placeholders;
mod tiktoken;
pub mod tiny;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use chat_template::{ChatMessage, ChatTemplate, MessageContent, KIMI_CHAT_TEMPLATE};
pub use placeholders::{expand_placeholders, placeholder_runs, PlaceholderMismatch};
pub use tiktoken::{KIMI_NUM_RESERVED_SPECIAL, KIMI_PAT_STR};
pub use tiny::{
    special_ids as tiny_special_ids, write_tiny_tokenizer, TinySpecialIds, TINY_MIN_VOCAB,
    TINY_NUM_SPECIAL, TINY_SPECIAL_TOKENS,
};

/// Everything that can go wrong loading or using a tokenizer / chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: file not found", path.display())]
    MissingFile { path: PathBuf },
    #[error("{}: no tokenizer found (expected tokenizer.json or tiktoken.model)", dir.display())]
    NoTokenizer { dir: PathBuf },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: line {line}: {msg}", path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("unknown token id {id} (vocab size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("tokenizer regex error: {0}")]
    Regex(String),
    #[error("encode error: {0}")]
    Encode(String),
    #[error("tokenizers error: {0}")]
    Hf(String),
    #[error("chat template syntax error in {source_name}: {msg}")]
    TemplateSyntax { source_name: String, msg: String },
    #[error("chat template render error: {msg}")]
    TemplateRender { msg: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl TokenizerError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            TokenizerError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })
}

// Lives behind an `Arc`, built once: variant sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Backend {
    Tiktoken(tiktoken::TiktokenBpe),
    Hf(hf::HfTokenizer),
}

/// A loaded tokenizer. Cheap to clone (shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Backend>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.inner {
            Backend::Tiktoken(t) => t.fmt(f),
            Backend::Hf(t) => t.fmt(f),
        }
    }
}

impl Tokenizer {
    /// Load from a checkpoint directory: `tokenizer.json` if present,
    /// otherwise `tiktoken.model` (+ `tokenizer_config.json` specials).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let hf_path = dir.join("tokenizer.json");
        let backend = if hf_path.is_file() {
            Backend::Hf(hf::HfTokenizer::from_file(&hf_path)?)
        } else if dir.join("tiktoken.model").is_file() {
            Backend::Tiktoken(tiktoken::TiktokenBpe::from_dir(dir)?)
        } else if !dir.is_dir() {
            return Err(TokenizerError::MissingFile {
                path: dir.to_path_buf(),
            });
        } else {
            return Err(TokenizerError::NoTokenizer {
                dir: dir.to_path_buf(),
            });
        };
        Ok(Tokenizer {
            inner: Arc::new(backend),
        })
    }

    /// Encode `text`. With `allow_special`, special-token strings (e.g.
    /// `<|im_end|>`) map to their ids; otherwise they are encoded as plain
    /// text. Never adds BOS/EOS.
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        match &*self.inner {
            Backend::Tiktoken(t) => t.encode(text, allow_special),
            Backend::Hf(t) => t.encode(text, allow_special),
        }
    }

    /// Decode ids to text (invalid UTF-8 is replaced with U+FFFD). Errors on
    /// an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        match &*self.inner {
            Backend::Tiktoken(t) => {
                Ok(String::from_utf8_lossy(&t.decode_bytes(ids, skip_special)?).into_owned())
            }
            Backend::Hf(t) => t.decode(ids, skip_special),
        }
    }

    /// Number of ids the tokenizer can produce (max id + 1, specials included).
    pub fn vocab_size(&self) -> usize {
        match &*self.inner {
            Backend::Tiktoken(t) => t.vocab_size(),
            Backend::Hf(t) => t.vocab_size(),
        }
    }

    /// Id of a special token or of a single vocabulary entry.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &*self.inner {
            Backend::Tiktoken(t) => t.token_id(token),
            Backend::Hf(t) => t.token_id(token),
        }
    }

    /// Whether `id` is a special token (dropped when decoding with `skip_special`).
    pub fn is_special(&self, id: u32) -> bool {
        match &*self.inner {
            Backend::Tiktoken(t) => t.is_special(id),
            Backend::Hf(t) => t.is_special(id),
        }
    }

    /// A fresh incremental decoder for one output stream.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special)
    }
}

/// Incremental detokenizer: feed ids one at a time, get back only complete
/// UTF-8 text (partial multi-byte characters are held until completed).
#[derive(Debug)]
pub struct StreamDecoder {
    tok: Tokenizer,
    skip_special: bool,
    /// tiktoken: bytes not yet emitted (an incomplete UTF-8 tail).
    pending: Vec<u8>,
    /// HF: ids since `prefix`, and the offsets of the usual
    /// prefix/read-window detokenization scheme.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new(tok: Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            pending: Vec::new(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Add one id; returns newly completed text, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        match &*self.tok.inner {
            Backend::Tiktoken(t) => {
                let b =
                    t.token_bytes(id, self.skip_special)
                        .ok_or(TokenizerError::UnknownTokenId {
                            id,
                            vocab_size: t.vocab_size(),
                        })?;
                self.pending.extend_from_slice(b);
                let text = take_complete_utf8(&mut self.pending);
                Ok((!text.is_empty()).then_some(text))
            }
            Backend::Hf(t) => {
                t.check_ids(&[id])?;
                self.ids.push(id);
                let prev = t.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
                let full = t.decode(&self.ids[self.prefix..], self.skip_special)?;
                if full.len() > prev.len() && !full.ends_with('\u{FFFD}') {
                    let new = match full.get(prev.len()..) {
                        Some(s) if full.starts_with(&prev) => s.to_string(),
                        // Decoder rewrote earlier text (rare); emit what is new by chars.
                        _ => full.chars().skip(prev.chars().count()).collect(),
                    };
                    self.prefix = self.read;
                    self.read = self.ids.len();
                    if self.prefix > 4096 {
                        self.ids.drain(..self.prefix);
                        self.read -= self.prefix;
                        self.prefix = 0;
                    }
                    Ok(Some(new))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// End of stream: whatever is still held back, lossily decoded.
    pub fn flush(&mut self) -> String {
        match &*self.tok.inner {
            Backend::Tiktoken(_) => {
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                s
            }
            Backend::Hf(t) => {
                let prev = t
                    .decode(&self.ids[self.prefix..self.read], self.skip_special)
                    .unwrap_or_default();
                let full = t
                    .decode(&self.ids[self.prefix..], self.skip_special)
                    .unwrap_or_default();
                self.ids.clear();
                self.prefix = 0;
                self.read = 0;
                match full.get(prev.len()..) {
                    Some(s) if full.starts_with(&prev) => s.to_string(),
                    _ => full.chars().skip(prev.chars().count()).collect(),
                }
            }
        }
    }
}

/// Remove and return the longest decodable prefix of `buf`; a trailing
/// incomplete sequence stays in `buf`. Invalid bytes become U+FFFD.
fn take_complete_utf8(buf: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&buf[start..start + valid]).expect("valid prefix"),
                );
                start += valid;
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += n;
                    }
                    None => break, // incomplete tail: wait for more bytes
                }
            }
        }
    }
    buf.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    /// Byte vocab plus a few merges and Kimi-style specials, written as files.
    fn write_small_tiktoken(dir: &Path) {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut lines = String::new();
        let mut rank = 0u32;
        for b in 0u8..=255 {
            lines.push_str(&format!("{} {rank}\n", b64.encode([b])));
            rank += 1;
        }
        // 🎉 = F0 9F 8E 89: merge its first two and last two bytes separately
        // so the emoji always spans two tokens.
        for m in [&b"th"[..], b"the", b" the", b"\xF0\x9F", b"\x8E\x89"] {
            lines.push_str(&format!("{} {rank}\n", b64.encode(m)));
            rank += 1;
        }
        std::fs::write(dir.join("tiktoken.model"), lines).unwrap();
        let cfg = serde_json::json!({
            "added_tokens_decoder": {
                "261": {"content": "[BOS]", "special": true},
                "262": {"content": "<|im_end|>", "special": true},
                "264": {"content": "<|im_middle|>", "special": true}
            }
        });
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }

    const TRICKY: &[&str] = &[
        "",
        "Hello, world! The theme of the thesis.",
        "  leading and trailing   \n\n\r\n\t tabs\t",
        "你好，世界！混合English和中文123456789",
        "emoji 🎉🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵 skin 👍🏽",
        "combining e\u{301} café naïve Ωμέγα Привет мир مرحبا",
        "I'M shouting, you'RE NOT; they'll've it's",
        "<|im_end|> [BOS] <|im_middle|> <|reserved_token_263|>",
        "\u{0} \u{1f} \u{7f} \u{feff} \u{10ffff}",
        "code:\n    fn main() { println!(\"{}\", 1 + 2); }\n",
    ];

    #[test]
    fn tiktoken_round_trip_tricky_text() {
        let dir = tempfile::tempdir().unwrap();
        write_small_tiktoken(dir.path());
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.vocab_size(), 265);
        assert_eq!(tok.token_id("<|reserved_token_263|>"), Some(263));
        assert_eq!(tok.token_id("the"), Some(257));
        for text in TRICKY {
            for allow in [false, true] {
                let ids = tok.encode(text, allow).unwrap();
                assert_eq!(tok.decode(&ids, false).unwrap(), *text, "allow={allow}");
            }
        }
        let long = "ab".repeat(30_000) + &" ".repeat(30_000) + "x";
        let ids = tok.encode(&long, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), long);
        assert_eq!(tok.encode(" the", false).unwrap(), vec![258]);
    }

    #[test]
    fn tiktoken_specials_allowed_vs_not_and_skip() {
        let dir = tempfile::tempdir().unwrap();
        write_small_tiktoken(dir.path());
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let text = "[BOS]the<|im_end|>";
        assert_eq!(tok.encode(text, true).unwrap(), vec![261, 257, 262]);
        let plain = tok.encode(text, false).unwrap();
        assert!(plain.iter().all(|&id| id < 256 || id == 257), "{plain:?}");
        assert_eq!(tok.decode(&plain, false).unwrap(), text);
        assert_eq!(tok.decode(&[261, 257, 262], true).unwrap(), "the");
        assert!(tok.is_special(262) && !tok.is_special(257));
        let err = tok.decode(&[1, 70000], false).unwrap_err();
        assert!(matches!(
            err,
            TokenizerError::UnknownTokenId { id: 70000, .. }
        ));
        assert!(err.to_string().contains("70000"));
    }

    #[test]
    fn stream_decoder_holds_split_emoji() {
        let dir = tempfile::tempdir().unwrap();
        write_small_tiktoken(dir.path());
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let ids = tok.encode("a🎉b", false).unwrap();
        assert_eq!(ids, vec![b'a' as u32, 259, 260, b'b' as u32]);
        let mut sd = tok.stream_decoder(false);
        assert_eq!(sd.step(ids[0]).unwrap().as_deref(), Some("a"));
        assert_eq!(sd.step(ids[1]).unwrap(), None); // F0 9F: incomplete
        assert_eq!(sd.step(ids[2]).unwrap().as_deref(), Some("🎉"));
        assert_eq!(sd.step(ids[3]).unwrap().as_deref(), Some("b"));
        // Byte by byte, with a special token skipped in the middle.
        let mut sd = tok.stream_decoder(true);
        let mut out = Vec::new();
        for &b in "x🎉".as_bytes() {
            out.push(sd.step(b as u32).unwrap());
        }
        assert_eq!(
            out,
            vec![Some("x".into()), None, None, None, Some("🎉".into())]
        );
        assert_eq!(sd.step(262).unwrap(), None);
        // Dangling partial sequence comes out lossily at flush.
        assert_eq!(sd.step(0xF0).unwrap(), None);
        assert_eq!(sd.flush(), "\u{FFFD}");
        // Invalid bytes do not stall the stream.
        assert_eq!(sd.step(0xFF).unwrap().as_deref(), Some("\u{FFFD}"));
        assert!(sd.step(99_999).is_err());
    }

    #[test]
    fn missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::NoTokenizer { .. }), "{err}");
        let err = Tokenizer::from_dir(&dir.path().join("nope")).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        std::fs::write(dir.path().join("tiktoken.model"), "IQ== 0\n").unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    }
}
