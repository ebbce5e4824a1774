//! Wrapper over a Hugging Face `tokenizer.json` (the `tokenizers` crate).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::TokenizerError;

pub(crate) struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    /// Copy that encodes special-token strings as plain text; built on first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    path: PathBuf,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

fn hf_err(e: tokenizers::Error) -> TokenizerError {
    TokenizerError::Hf(e.to_string())
}

impl HfTokenizer {
    pub(crate) fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        if !path.is_file() {
            return Err(TokenizerError::MissingFile {
                path: path.to_path_buf(),
            });
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Config {
            path: path.to_path_buf(),
            msg: format!("cannot load tokenizer: {e}"),
        })?;
        Ok(Self {
            tok,
            plain: OnceLock::new(),
            path: path.to_path_buf(),
        })
    }

    pub(crate) fn encode(
        &self,
        text: &str,
        allow_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        // BOS/EOS insertion (post-processor) is the caller's business: never add them here.
        let tok = if allow_special {
            &self.tok
        } else {
            self.plain.get_or_init(|| {
                let mut t = self.tok.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        Ok(tok.encode(text, false).map_err(hf_err)?.get_ids().to_vec())
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        for &id in ids {
            if self.tok.id_to_token(id).is_none() {
                return Err(TokenizerError::UnknownTokenId {
                    id,
                    vocab_size: self.vocab_size(),
                });
            }
        }
        Ok(())
    }

    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.tok.decode(ids, skip_special).map_err(hf_err)
    }

    pub(crate) fn vocab_size(&self) -> usize {
        let added_max = self
            .tok
            .get_added_tokens_decoder()
            .keys()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        self.tok.get_vocab_size(true).max(added_max)
    }

    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }

    pub(crate) fn is_special(&self, id: u32) -> bool {
        self.tok
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Tokenizer;

    /// A hand-built byte-level BPE `tokenizer.json`: ids 0..=13 and 19 are byte
    /// symbols (`Ġ` is the byte-level stand-in for a space), 14..=18 merges,
    /// 20 an added special token (the `tokenizers` crate
    /// renumbers added tokens after the model vocab, so ids must be contiguous).
    fn tiny_tokenizer_json() -> String {
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [{
                "id": 20, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": {
                    "h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "<": 8, "|": 9,
                    "i": 10, "m": 11, "_": 12, "n": 13, ">": 19,
                    "he": 14, "ll": 15, "hell": 16, "hello": 17, "Ġw": 18
                },
                "merges": ["h e", "l l", "he ll", "hell o", "Ġ w"]
            }
        })
        .to_string()
    }

    #[test]
    fn hf_tokenizer_json_encode_decode() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), tiny_tokenizer_json()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.vocab_size(), 21);
        assert_eq!(tok.token_id("<|im_end|>"), Some(20));
        assert_eq!(tok.token_id("hello"), Some(17));

        let ids = tok.encode("hello world", true).unwrap();
        // "hello" | "Ġworld" -> Ġw o r l d
        assert_eq!(ids, vec![17, 18, 3, 6, 2, 7]);
        assert_eq!(tok.decode(&ids, false).unwrap(), "hello world");

        let ids = tok.encode("hello<|im_end|>", true).unwrap();
        assert_eq!(ids, vec![17, 20]);
        assert_eq!(tok.decode(&ids, false).unwrap(), "hello<|im_end|>");
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello");

        let plain = tok.encode("hello<|im_end|>", false).unwrap();
        assert!(!plain.contains(&20), "{plain:?}");
        assert_eq!(tok.decode(&plain, false).unwrap(), "hello<|im_end|>");

        let err = tok.decode(&[17, 99], false).unwrap_err();
        assert!(err.to_string().contains("99"), "{err}");

        let mut sd = tok.stream_decoder(false);
        let mut out = String::new();
        for id in [17, 18, 3, 6, 2, 7, 20] {
            if let Some(t) = sd.step(id).unwrap() {
                out.push_str(&t);
            }
        }
        out.push_str(&sd.flush());
        assert_eq!(out, "hello world<|im_end|>");
    }
}
