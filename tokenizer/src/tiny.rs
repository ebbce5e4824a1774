//! A small, deterministic Kimi-style tokenizer for the embedded random-weight
//! model (`tessera init-model`).
//!
//! Layout mirrors Kimi checkpoints: `tiktoken.model` holds the 256 byte
//! tokens followed by BPE merges learned from a built-in English corpus;
//! `tokenizer_config.json` lists the special tokens, placed at the top of the
//! vocabulary in Kimi's order (`[BOS]`, `[EOS]`, `<|im_end|>`, `<|im_user|>`,
//! …, `[UNK]`, `[PAD]` last), plus a Kimi-format chat template.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine as _;
use rustc_hash::FxHashMap;

use super::chat_template::KIMI_CHAT_TEMPLATE;
use super::tiktoken::{reserved_token_name, KIMI_PAT_STR};
use super::TokenizerError;

/// Special-token slots at the top of the tiny vocabulary.
pub const TINY_NUM_SPECIAL: usize = 32;
/// Smallest vocabulary `write_tiny_tokenizer` accepts.
pub const TINY_MIN_VOCAB: usize = 300;

/// Named special tokens as `(offset from the first special id, content,
/// special)`. Offsets 0–23 follow Kimi K2's layout (`[BOS]` = base + 0,
/// `<|im_end|>` = base + 2, `<|im_middle|>` = base + 17, …); `[UNK]`/`[PAD]`
/// take the last two slots as in Kimi. Unlisted slots are
/// `<|reserved_token_{id}|>`. `<think>`/`</think>` are not `special`, so they
/// survive `skip_special` decoding (reasoning parsers need them).
pub const TINY_SPECIAL_TOKENS: &[(usize, &str, bool)] = &[
    (0, "[BOS]", true),
    (1, "[EOS]", true),
    (2, "<|im_end|>", true),
    (3, "<|im_user|>", true),
    (4, "<|im_assistant|>", true),
    (6, "<|start_header_id|>", true),
    (7, "<|end_header_id|>", true),
    (9, "[EOT]", true),
    (10, "<|im_system|>", true),
    (11, "<|tool_calls_section_begin|>", true),
    (12, "<|tool_calls_section_end|>", true),
    (13, "<|tool_call_begin|>", true),
    (14, "<|tool_call_argument_begin|>", true),
    (15, "<|tool_call_end|>", true),
    (17, "<|im_middle|>", true),
    (18, "<|media_begin|>", true),
    (19, "<|media_content|>", true),
    (20, "<|media_end|>", true),
    (21, "<|media_pad|>", true),
    (22, "<think>", false),
    (23, "</think>", false),
    (TINY_NUM_SPECIAL - 2, "[UNK]", true),
    (TINY_NUM_SPECIAL - 1, "[PAD]", true),
];

/// Ids of the tiny tokenizer's special tokens for a given `vocab_size`, for
/// writing `config.json`.
///
/// Kimi's chat models stop on `<|im_end|>`: use [`chat_eos`](Self::chat_eos)
/// (= `im_end`) as `eos_token_id`; `[EOS]` is the pre-training document end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinySpecialIds {
    pub bos: u32,
    pub eos: u32,
    pub im_end: u32,
    pub im_user: u32,
    pub im_assistant: u32,
    pub eot: u32,
    pub im_system: u32,
    pub im_middle: u32,
    pub media_begin: u32,
    pub media_content: u32,
    pub media_end: u32,
    pub media_pad: u32,
    pub think: u32,
    pub think_end: u32,
    pub unk: u32,
    pub pad: u32,
}

impl TinySpecialIds {
    /// The id chat generation stops on (`<|im_end|>`), Kimi's `eos_token_id`.
    pub fn chat_eos(&self) -> u32 {
        self.im_end
    }

    /// All ids that should end generation: `<|im_end|>` and `[EOS]`.
    pub fn stop_ids(&self) -> Vec<u32> {
        vec![self.im_end, self.eos]
    }
}

/// Special ids for a tiny tokenizer of `vocab_size` (which must be at least
/// [`TINY_MIN_VOCAB`]; smaller sizes give meaningless ids).
pub fn special_ids(vocab_size: usize) -> TinySpecialIds {
    let base = vocab_size.saturating_sub(TINY_NUM_SPECIAL) as u32;
    let at = |off: usize| base + off as u32;
    TinySpecialIds {
        bos: at(0),
        eos: at(1),
        im_end: at(2),
        im_user: at(3),
        im_assistant: at(4),
        eot: at(9),
        im_system: at(10),
        im_middle: at(17),
        media_begin: at(18),
        media_content: at(19),
        media_end: at(20),
        media_pad: at(21),
        think: at(22),
        think_end: at(23),
        unk: at(TINY_NUM_SPECIAL - 2),
        pad: at(TINY_NUM_SPECIAL - 1),
    }
}

/// Training text for the tiny BPE (original prose).
const CORPUS: &str = "\
The old lighthouse stood at the end of the harbor road, and every evening the keeper climbed \
its one hundred and twelve steps to light the lamp. She had done this for thirty years. The \
ships that passed in the night never saw her face, but they trusted the light, and that was \
enough for her. When the storms came in from the west, she would sit by the window with a cup \
of tea and watch the waves break against the rocks below.

In the morning the town woke slowly. The baker opened his shop before the sun was up, and the \
smell of fresh bread drifted down the street. Children walked to school in small groups, \
talking about the games they would play after class. The teacher, a patient man with grey \
hair, wrote the date on the board and asked the students what they had learned the day before.

A good question is often more useful than a quick answer. When you are trying to understand \
a problem, it helps to write down what you know, what you want to find, and what is still \
unclear. Then you can break the problem into smaller parts and solve each part in turn. If a \
step does not work, go back and check your assumptions. Most mistakes come from something we \
believed without checking.

Computers follow instructions exactly. A program is a list of steps that tells the machine \
what to do with its memory and its inputs. The model reads a sequence of tokens, computes a \
probability for each possible next token, and then samples one of them. It repeats this until \
it produces an end token or reaches the maximum length. Good systems measure their speed, \
their memory use, and the quality of their outputs, and they test every change carefully.

User: Hello! Can you help me plan a trip to the mountains next weekend?
Assistant: Of course. I would be happy to help you plan your trip. How many people are going, \
and what kind of activities do you enjoy? Some people like long walks through the forest, \
while others prefer to rest by a quiet lake and read a book.
User: There are four of us, and we like hiking and cooking outside.
Assistant: That sounds wonderful. You should bring warm clothes, enough water, a small stove, \
and a simple map. Please check the weather before you leave, and tell someone where you are \
going. Have a great time!
";

/// Learn `n_regular` tokens: 256 bytes, then BPE merges (pairs seen at least
/// twice first, then the rest until every corpus word is one token), then 2-
/// and 3-digit numbers, then filler entries if still short. Deterministic.
struct Vocab {
    tokens: Vec<Vec<u8>>,
    index: FxHashMap<Vec<u8>, u32>,
}

impl Vocab {
    /// Id of `bytes`, appending it if new.
    fn add(&mut self, bytes: Vec<u8>) -> u32 {
        if let Some(&id) = self.index.get(&bytes) {
            return id;
        }
        let id = self.tokens.len() as u32;
        self.index.insert(bytes.clone(), id);
        self.tokens.push(bytes);
        id
    }
}

/// Greedy BPE training over `(symbols, count)` words until `vocab` holds
/// `target` tokens or no pair occurs at least `min_count` times.
fn merge_phase(
    vocab: &mut Vocab,
    words: &mut [(Vec<u32>, usize)],
    target: usize,
    min_count: usize,
) {
    while vocab.tokens.len() < target {
        let mut pairs: FxHashMap<(u32, u32), usize> = FxHashMap::default();
        for (w, c) in words.iter() {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_default() += c;
            }
        }
        // Highest count; ties broken by the smaller pair of ids.
        let Some((&(a, b), &count)) = pairs
            .iter()
            .max_by(|x, y| x.1.cmp(y.1).then_with(|| y.0.cmp(x.0)))
        else {
            break;
        };
        if count < min_count {
            break;
        }
        let mut bytes = vocab.tokens[a as usize].clone();
        bytes.extend_from_slice(&vocab.tokens[b as usize]);
        let new = vocab.add(bytes);
        for (w, _) in words.iter_mut() {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == a && w[i + 1] == b {
                    out.push(new);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
    }
}

fn learn_vocab(n_regular: usize) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
    let index = tokens
        .iter()
        .enumerate()
        .map(|(i, b)| (b.clone(), i as u32))
        .collect();
    let mut vocab = Vocab { tokens, index };

    let re =
        fancy_regex::Regex::new(KIMI_PAT_STR).map_err(|e| TokenizerError::Regex(e.to_string()))?;
    let mut piece_counts: BTreeMap<&str, usize> = BTreeMap::new();
    for m in re.find_iter(CORPUS) {
        let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
        *piece_counts.entry(m.as_str()).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, usize)> = piece_counts
        .iter()
        .map(|(p, &c)| (p.bytes().map(u32::from).collect(), c))
        .collect();

    merge_phase(&mut vocab, &mut words, n_regular, 2);
    merge_phase(&mut vocab, &mut words, n_regular, 1);
    for n in (0..100)
        .map(|n| format!("{n:02}"))
        .chain((0..1000).map(|n| format!("{n:03}")))
    {
        if vocab.tokens.len() >= n_regular {
            break;
        }
        vocab.add(n.into_bytes());
    }
    let mut i = 0usize;
    while vocab.tokens.len() < n_regular {
        vocab.add(format!("<filler{i}>").into_bytes());
        i += 1;
    }
    Ok(vocab.tokens)
}

/// Write `tiktoken.model` and `tokenizer_config.json` (with a Kimi-format
/// chat template) for a tiny tokenizer of exactly `vocab_size` ids into `dir`
/// (created if missing). Special ids: see [`special_ids`].
pub fn write_tiny_tokenizer(dir: &Path, vocab_size: usize) -> Result<(), TokenizerError> {
    if vocab_size < TINY_MIN_VOCAB {
        return Err(TokenizerError::InvalidArgument(format!(
            "tiny tokenizer vocab_size {vocab_size} < {TINY_MIN_VOCAB}"
        )));
    }
    if vocab_size > u32::MAX as usize {
        return Err(TokenizerError::InvalidArgument(format!(
            "vocab_size {vocab_size} too large"
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| TokenizerError::io(dir, e))?;
    let n_regular = vocab_size - TINY_NUM_SPECIAL;
    let vocab = learn_vocab(n_regular)?;

    let b64 = base64::engine::general_purpose::STANDARD;
    let mut model = String::with_capacity(vocab.len() * 12);
    for (rank, bytes) in vocab.iter().enumerate() {
        model.push_str(&b64.encode(bytes));
        model.push(' ');
        model.push_str(&rank.to_string());
        model.push('\n');
    }
    let model_path = dir.join("tiktoken.model");
    std::fs::write(&model_path, model).map_err(|e| TokenizerError::io(&model_path, e))?;

    let base = n_regular;
    let mut decoder = serde_json::Map::new();
    let mut additional = Vec::new();
    for off in 0..TINY_NUM_SPECIAL {
        let id = (base + off) as u32;
        let (content, special) = match TINY_SPECIAL_TOKENS.iter().find(|(o, _, _)| *o == off) {
            Some((_, c, s)) => (c.to_string(), *s),
            None => (reserved_token_name(id), true),
        };
        if TINY_SPECIAL_TOKENS.iter().any(|(o, _, _)| *o == off)
            && !["[BOS]", "[EOS]", "[UNK]", "[PAD]"].contains(&content.as_str())
        {
            additional.push(serde_json::Value::from(content.clone()));
        }
        decoder.insert(
            id.to_string(),
            serde_json::json!({
                "content": content, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": special
            }),
        );
    }
    let cfg = serde_json::json!({
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": KIMI_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 1_048_576,
        "tokenizer_class": "TikTokenTokenizer",
    });
    let cfg_path = dir.join("tokenizer_config.json");
    let text = serde_json::to_string_pretty(&cfg).expect("serializable");
    std::fs::write(&cfg_path, text).map_err(|e| TokenizerError::io(&cfg_path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{ChatMessage, ChatTemplate, Tokenizer};
    use super::*;

    #[test]
    fn tiny_round_trip_and_specials() {
        for vocab_size in [TINY_MIN_VOCAB, 1024, 2048] {
            let dir = tempfile::tempdir().unwrap();
            write_tiny_tokenizer(dir.path(), vocab_size).unwrap();
            let tok = Tokenizer::from_dir(dir.path()).unwrap();
            assert_eq!(tok.vocab_size(), vocab_size);
            let ids = special_ids(vocab_size);
            assert_eq!(tok.token_id("[BOS]"), Some(ids.bos));
            assert_eq!(tok.token_id("[EOS]"), Some(ids.eos));
            assert_eq!(tok.token_id("<|im_end|>"), Some(ids.chat_eos()));
            assert_eq!(tok.token_id("<|im_middle|>"), Some(ids.im_middle));
            assert_eq!(tok.token_id("<|media_pad|>"), Some(ids.media_pad));
            assert_eq!(tok.token_id("[PAD]"), Some(ids.pad));
            assert_eq!(ids.pad as usize, vocab_size - 1);

            for text in [
                "The keeper climbed the steps to light the lamp.",
                "emoji 🎉👨‍👩‍👧 and CJK 你好世界 and Ω≈ç√ and 12345",
                "\0\t\r\n  weird   spacing\u{10ffff}",
            ] {
                let enc = tok.encode(text, false).unwrap();
                assert!(enc
                    .iter()
                    .all(|&i| (i as usize) < vocab_size - TINY_NUM_SPECIAL));
                assert_eq!(tok.decode(&enc, false).unwrap(), text);
            }

            let tmpl = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
            let prompt = tmpl
                .render(&[ChatMessage::new("user", "Hello!")], true)
                .unwrap();
            let enc = tok.encode(&prompt, true).unwrap();
            assert_eq!(enc[0], ids.im_system);
            assert_eq!(*enc.last().unwrap(), ids.im_middle);
            assert_eq!(tok.decode(&enc, false).unwrap(), prompt);
            assert_eq!(
                tok.decode(&enc, true).unwrap(),
                "systemYou are Kimi, an AI assistant created by Moonshot AI.userHello!assistant"
            );
        }
    }

    #[test]
    fn tiny_is_deterministic_and_compresses() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_tiny_tokenizer(a.path(), 1024).unwrap();
        write_tiny_tokenizer(b.path(), 1024).unwrap();
        for f in ["tiktoken.model", "tokenizer_config.json"] {
            assert_eq!(
                std::fs::read(a.path().join(f)).unwrap(),
                std::fs::read(b.path().join(f)).unwrap()
            );
        }
        let tok = Tokenizer::from_dir(a.path()).unwrap();
        let text = "The teacher asked the students what they had learned.";
        let n = tok.encode(text, false).unwrap().len();
        assert!(n < text.len() / 3);
        assert!(write_tiny_tokenizer(a.path(), 299).is_err());
    }
}
