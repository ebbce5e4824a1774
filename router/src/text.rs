//! Generated token IDs → the text a client sees: incremental detokenization plus OpenAI-style
//! stop strings (output ends just before the first stop string, which is not included).
//!
//! Text that could still turn out to be the start of a stop string is held back, so streamed and
//! non-streamed outputs are identical and a stop string never leaks into a chunk.

use tessera_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// Text produced by one step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TextDelta {
    /// New text safe to send.
    pub text: String,
    /// A stop string was found: generation should end; `text` stops just before it.
    pub stopped: bool,
}

/// Incremental detokenizer with stop-string detection for one output.
#[derive(Debug)]
pub struct OutputText {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded text not yet released (possibly a stop-string prefix).
    pending: String,
    done: bool,
}

impl OutputText {
    /// `stops` are matched on the decoded text (special tokens skipped); empty strings are
    /// ignored.
    pub fn new(tokenizer: &Tokenizer, stops: Vec<String>) -> Self {
        OutputText {
            decoder: tokenizer.stream_decoder(true),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            done: false,
        }
    }

    /// Feed one generated token. After a delta with `stopped`, further calls yield nothing.
    pub fn push(&mut self, id: u32) -> Result<TextDelta, TokenizerError> {
        if self.done {
            return Ok(TextDelta::default());
        }
        if let Some(s) = self.decoder.step(id)? {
            self.pending.push_str(&s);
        }
        Ok(self.release(false))
    }

    /// End of generation: release everything still held back.
    pub fn finish(&mut self) -> TextDelta {
        if self.done {
            return TextDelta::default();
        }
        let rest = self.decoder.flush();
        self.pending.push_str(&rest);
        let delta = self.release(true);
        self.done = true;
        delta
    }

    fn release(&mut self, last: bool) -> TextDelta {
        if let Some(at) = self.first_stop() {
            self.pending.truncate(at);
            self.done = true;
            return TextDelta {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let keep = if last { 0 } else { self.held_suffix_len() };
        let cut = self.pending.len() - keep;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        TextDelta {
            text,
            stopped: false,
        }
    }

    /// Byte offset of the earliest stop string in `pending`.
    fn first_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let start = p.len().saturating_sub(longest.saturating_sub(1));
        (start..p.len())
            .filter(|&i| p.is_char_boundary(i))
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&p[i..])))
            .map_or(0, |i| p.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        tessera_tokenizer::write_tiny_tokenizer(dir.path(), 1024).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    fn run(tok: &Tokenizer, text: &str, stops: &[&str]) -> (Vec<String>, bool) {
        let ids = tok.encode(text, false).unwrap();
        let mut out = OutputText::new(tok, stops.iter().map(|s| s.to_string()).collect());
        let mut chunks = Vec::new();
        for id in ids {
            let d = out.push(id).unwrap();
            chunks.push(d.text);
            if d.stopped {
                return (chunks, true);
            }
        }
        let d = out.finish();
        chunks.push(d.text);
        (chunks, d.stopped)
    }

    #[test]
    fn no_stops_passes_text_through() {
        let (_d, tok) = tiny();
        let (chunks, stopped) = run(&tok, "The old lighthouse 🎉 stood", &[]);
        assert_eq!(chunks.concat(), "The old lighthouse 🎉 stood");
        assert!(!stopped);
    }

    #[test]
    fn stop_string_truncates_and_never_leaks() {
        let (_d, tok) = tiny();
        let text = "The keeper climbed the steps to light the lamp.";
        for stop in ["light", "t the l", "e", "lamp.", "The"] {
            let (chunks, stopped) = run(&tok, text, &[stop, "never there"]);
            let want = &text[..text.find(stop).unwrap()];
            assert!(stopped, "{stop}");
            assert_eq!(chunks.concat(), want, "{stop}");
            // A chunk never holds part of the stop string beyond the final answer.
            let mut acc = String::new();
            for c in &chunks {
                acc.push_str(c);
                assert!(want.starts_with(&acc), "{stop}: {acc:?}");
            }
        }
    }

    #[test]
    fn partial_stop_prefix_is_released_at_the_end() {
        let (_d, tok) = tiny();
        let (chunks, stopped) = run(&tok, "light the lam", &["lamp"]);
        assert!(!stopped);
        assert_eq!(chunks.concat(), "light the lam");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (_d, tok) = tiny();
        let (chunks, stopped) = run(&tok, "one two three four", &["four", "two"]);
        assert!(stopped);
        assert_eq!(chunks.concat(), "one ");
    }

    #[test]
    fn multibyte_text_and_stops() {
        let (_d, tok) = tiny();
        let (chunks, stopped) = run(&tok, "héllo 你好世界 bye", &["世界"]);
        assert!(stopped);
        assert_eq!(chunks.concat(), "héllo 你好");
    }
}
