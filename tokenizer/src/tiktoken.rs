//! Byte-level BPE over a tiktoken rank file, the way Kimi checkpoints ship it
//! (`tiktoken.model` + special tokens from `tokenizer_config.json`).
//!
//! Behaviour mirrors Kimi's `tokenization_kimi.py` (a `tiktoken.Encoding` with
//! [`KIMI_PAT_STR`]): text is split into runs of at most 25 000 consecutive
//! whitespace / non-whitespace characters (and 400 000-character windows),
//! special tokens are matched literally when allowed, the rest is split by
//! the pre-tokenizer regex and each piece is BPE-merged by rank (lowest rank
//! pair first, leftmost on ties).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;

use base64::Engine as _;
use rustc_hash::FxHashMap;

use super::TokenizerError;

/// Kimi's pre-tokenizer split pattern (`TikTokenTokenizer.pat_str` in
/// `tokenization_kimi.py`): CJK (Han) runs are kept apart from other letters,
/// otherwise it is the cl100k/o200k-style pattern with case-aware word runs.
/// `&&` is character-class intersection.
pub const KIMI_PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Number of special-token slots Kimi reserves after the mergeable ranks
/// (`num_reserved_special_tokens`); used when no `added_tokens_decoder` exists.
pub const KIMI_NUM_RESERVED_SPECIAL: u32 = 256;

/// Kimi's chunking limits (see `TikTokenTokenizer.encode`).
const MAX_ENCODE_CHARS: usize = 400_000;
const MAX_RUN_CHARS: usize = 25_000;

/// Pieces longer than this are merged with the O(n log n) heap algorithm.
const LONG_PIECE: usize = 128;

/// Placeholder name Kimi gives unlisted special-token slots.
pub(crate) fn reserved_token_name(id: u32) -> String {
    format!("<|reserved_token_{id}|>")
}

#[derive(Debug, Clone)]
pub(crate) struct SpecialToken {
    pub content: String,
    /// `special: true` in `added_tokens_decoder`: dropped by `skip_special`.
    pub special: bool,
}

pub(crate) struct TiktokenBpe {
    ranks: FxHashMap<Vec<u8>, u32>,
    decoder: FxHashMap<u32, Vec<u8>>,
    specials: FxHashMap<String, u32>,
    special_decoder: FxHashMap<u32, SpecialToken>,
    special_re: Option<fancy_regex::Regex>,
    pat: fancy_regex::Regex,
    vocab_size: usize,
}

impl std::fmt::Debug for TiktokenBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiktokenBpe")
            .field("mergeable", &self.ranks.len())
            .field("specials", &self.specials.len())
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

/// Parse a tiktoken rank file (`<base64 token> <rank>` per line).
pub(crate) fn parse_rank_file(path: &Path) -> Result<Vec<(Vec<u8>, u32)>, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    parse_ranks(&text, path)
}

pub(crate) fn parse_ranks(text: &str, path: &Path) -> Result<Vec<(Vec<u8>, u32)>, TokenizerError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |msg: String| TokenizerError::BadLine {
            path: path.to_path_buf(),
            line: line_no,
            msg,
        };
        let mut parts = line.split_whitespace();
        let (Some(tok), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("expected `<base64 token> <rank>`".into()));
        };
        let bytes = b64
            .decode(tok)
            .map_err(|e| bad(format!("bad base64 {tok:?}: {e}")))?;
        let rank: u32 = rank
            .parse()
            .map_err(|e| bad(format!("bad rank {rank:?}: {e}")))?;
        out.push((bytes, rank));
    }
    if out.is_empty() {
        return Err(TokenizerError::Config {
            path: path.to_path_buf(),
            msg: "no tokens".into(),
        });
    }
    Ok(out)
}

impl TiktokenBpe {
    /// Build from mergeable ranks and special tokens `(id, content, special)`.
    pub(crate) fn new(
        ranks: Vec<(Vec<u8>, u32)>,
        specials: Vec<(u32, String, bool)>,
        pat: &str,
        source: &Path,
    ) -> Result<Self, TokenizerError> {
        let mut rank_map = FxHashMap::default();
        let mut decoder = FxHashMap::default();
        for (bytes, rank) in ranks {
            if decoder.insert(rank, bytes.clone()).is_some() {
                return Err(TokenizerError::Config {
                    path: source.to_path_buf(),
                    msg: format!("duplicate rank {rank}"),
                });
            }
            if rank_map.insert(bytes.clone(), rank).is_some() {
                return Err(TokenizerError::Config {
                    path: source.to_path_buf(),
                    msg: format!("duplicate token {:?}", String::from_utf8_lossy(&bytes)),
                });
            }
        }
        let mut special_map = FxHashMap::default();
        let mut special_decoder = FxHashMap::default();
        for (id, content, special) in specials {
            if content.is_empty() {
                return Err(TokenizerError::Config {
                    path: source.to_path_buf(),
                    msg: format!("special token {id} has empty content"),
                });
            }
            special_map.insert(content.clone(), id);
            special_decoder.insert(id, SpecialToken { content, special });
        }
        let special_re = if special_map.is_empty() {
            None
        } else {
            // Longest first so that a token that is a prefix of another never
            // shadows it at the same position.
            let mut names: Vec<&String> = special_map.keys().collect();
            names.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
            let alt = names
                .iter()
                .map(|s| escape_regex(s))
                .collect::<Vec<_>>()
                .join("|");
            Some(fancy_regex::Regex::new(&alt).map_err(|e| TokenizerError::Regex(e.to_string()))?)
        };
        let pat = fancy_regex::RegexBuilder::new(pat)
            .backtrack_limit(10_000_000)
            .build()
            .map_err(|e| TokenizerError::Regex(e.to_string()))?;
        let max_id = decoder
            .keys()
            .chain(special_decoder.keys())
            .copied()
            .max()
            .unwrap_or(0);
        Ok(Self {
            ranks: rank_map,
            decoder,
            specials: special_map,
            special_decoder,
            special_re,
            pat,
            vocab_size: max_id as usize + 1,
        })
    }

    /// Load `tiktoken.model` plus specials from `tokenizer_config.json`
    /// (`added_tokens_decoder`), the Kimi layout.
    pub(crate) fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let model = dir.join("tiktoken.model");
        if !model.is_file() {
            return Err(TokenizerError::MissingFile { path: model });
        }
        let ranks = parse_rank_file(&model)?;
        let n_base = ranks.iter().map(|(_, r)| *r).max().map_or(0, |m| m + 1);

        let cfg_path = dir.join("tokenizer_config.json");
        let mut listed: Vec<(u32, String, bool)> = Vec::new();
        if cfg_path.is_file() {
            let cfg = super::read_json(&cfg_path)?;
            if let Some(decoder) = cfg.get("added_tokens_decoder") {
                let obj = decoder.as_object().ok_or_else(|| TokenizerError::Config {
                    path: cfg_path.clone(),
                    msg: "added_tokens_decoder is not an object".into(),
                })?;
                for (k, v) in obj {
                    let id: u32 = k.parse().map_err(|_| TokenizerError::Config {
                        path: cfg_path.clone(),
                        msg: format!("added_tokens_decoder key {k:?} is not a token id"),
                    })?;
                    let content = v.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                        TokenizerError::Config {
                            path: cfg_path.clone(),
                            msg: format!("added_tokens_decoder[{k}] has no string `content`"),
                        }
                    })?;
                    let special = v.get("special").and_then(|s| s.as_bool()).unwrap_or(false);
                    listed.push((id, content.to_string(), special));
                }
            }
        }
        // Kimi names every slot in the reserved block; unlisted ones become
        // `<|reserved_token_{id}|>`. Without a listing, reserve 256 slots.
        let end = listed
            .iter()
            .map(|(id, _, _)| id + 1)
            .max()
            .unwrap_or(n_base + KIMI_NUM_RESERVED_SPECIAL)
            .max(n_base);
        let have: rustc_hash::FxHashSet<u32> = listed.iter().map(|(id, _, _)| *id).collect();
        for id in n_base..end {
            if !have.contains(&id) {
                listed.push((id, reserved_token_name(id), true));
            }
        }
        listed.sort_by_key(|(id, _, _)| *id);
        Self::new(ranks, listed, KIMI_PAT_STR, &model)
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        self.specials
            .get(token)
            .or_else(|| self.ranks.get(token.as_bytes()))
            .copied()
    }

    pub(crate) fn is_special(&self, id: u32) -> bool {
        !self.decoder.contains_key(&id) && self.special_decoder.get(&id).is_some_and(|s| s.special)
    }

    /// Bytes of one token; `None` for ids outside the vocabulary.
    /// Skipped (empty) when `skip_special` and the id is a special token.
    pub(crate) fn token_bytes(&self, id: u32, skip_special: bool) -> Option<&[u8]> {
        if let Some(b) = self.decoder.get(&id) {
            return Some(b);
        }
        let s = self.special_decoder.get(&id)?;
        if skip_special && s.special {
            Some(&[])
        } else {
            Some(s.content.as_bytes())
        }
    }

    pub(crate) fn decode_bytes(
        &self,
        ids: &[u32],
        skip_special: bool,
    ) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let b = self
                .token_bytes(id, skip_special)
                .ok_or(TokenizerError::UnknownTokenId {
                    id,
                    vocab_size: self.vocab_size,
                })?;
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    pub(crate) fn encode(
        &self,
        text: &str,
        allow_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for window in split_char_windows(text, MAX_ENCODE_CHARS) {
            for chunk in split_long_runs(window, MAX_RUN_CHARS) {
                match (&self.special_re, allow_special) {
                    (Some(re), true) => {
                        let mut last = 0;
                        for m in re.find_iter(chunk) {
                            let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
                            self.encode_ordinary_into(&chunk[last..m.start()], &mut out)?;
                            out.push(self.specials[m.as_str()]);
                            last = m.end();
                        }
                        self.encode_ordinary_into(&chunk[last..], &mut out)?;
                    }
                    _ => self.encode_ordinary_into(chunk, &mut out)?,
                }
            }
        }
        Ok(out)
    }

    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut last = 0;
        for m in self.pat.find_iter(text) {
            let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
            // tiktoken silently drops text the pattern does not cover; keep it
            // (as its own piece) so encoding is always lossless.
            if m.start() > last {
                self.bpe_into(&text.as_bytes()[last..m.start()], out)?;
            }
            self.bpe_into(m.as_str().as_bytes(), out)?;
            last = m.end();
        }
        if last < text.len() {
            self.bpe_into(&text.as_bytes()[last..], out)?;
        }
        Ok(())
    }

    fn bpe_into(&self, piece: &[u8], out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if piece.is_empty() {
            return Ok(());
        }
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return Ok(());
        }
        let bounds = if piece.len() <= LONG_PIECE {
            merge_simple(&self.ranks, piece)
        } else {
            merge_heap(&self.ranks, piece)
        };
        for w in bounds.windows(2) {
            let bytes = &piece[w[0]..w[1]];
            let r = self.ranks.get(bytes).ok_or_else(|| {
                TokenizerError::Encode(format!("byte sequence {bytes:02x?} has no token"))
            })?;
            out.push(*r);
        }
        Ok(())
    }
}

/// Escape a literal for the regex engine.
fn escape_regex(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Split into windows of at most `max` chars (Kimi: 400k-char slices).
fn split_char_windows(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = rest.char_indices().nth(max).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}

/// Kimi's `_split_whitespaces_or_nonwhitespaces`: cut so that no substring
/// holds more than `max` consecutive whitespace or non-whitespace chars.
fn split_long_runs(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run_len = 0usize;
    let mut run_is_space = text.chars().next().is_some_and(char::is_whitespace);
    let mut start = 0usize;
    for (i, c) in text.char_indices() {
        let is_space = c.is_whitespace();
        if is_space != run_is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max {
                out.push(&text[start..i]);
                start = i;
                run_len = 1;
            }
        }
    }
    out.push(&text[start..]);
    out
}

/// tiktoken's merge: repeatedly merge the adjacent pair whose concatenation
/// has the lowest rank (leftmost on ties). Returns part boundaries.
pub(crate) fn merge_simple(ranks: &FxHashMap<Vec<u8>, u32>, piece: &[u8]) -> Vec<usize> {
    let rank_of = |b: &[usize], i: usize| -> u32 {
        if i + 2 < b.len() {
            ranks
                .get(&piece[b[i]..b[i + 2]])
                .copied()
                .unwrap_or(u32::MAX)
        } else {
            u32::MAX
        }
    };
    let mut bounds: Vec<usize> = (0..=piece.len()).collect();
    // pair_rank[i]: rank of merging parts i and i+1.
    let mut pair_rank: Vec<u32> = (0..bounds.len()).map(|i| rank_of(&bounds, i)).collect();
    loop {
        let mut best = (u32::MAX, 0usize);
        for (i, &r) in pair_rank
            .iter()
            .enumerate()
            .take(bounds.len().saturating_sub(2))
        {
            if r < best.0 {
                best = (r, i);
            }
        }
        if best.0 == u32::MAX {
            break;
        }
        let i = best.1;
        bounds.remove(i + 1);
        pair_rank.remove(i + 1);
        pair_rank[i] = rank_of(&bounds, i);
        if i > 0 {
            pair_rank[i - 1] = rank_of(&bounds, i - 1);
        }
    }
    bounds
}

/// Same result as [`merge_simple`], in O(n log n) for long pieces: a min-heap
/// of (rank, left start) over a linked list of parts, stale entries skipped.
pub(crate) fn merge_heap(ranks: &FxHashMap<Vec<u8>, u32>, piece: &[u8]) -> Vec<usize> {
    let n = piece.len();
    // Parts are identified by their start offset.
    let mut next: Vec<usize> = (1..=n).collect(); // end of the part starting at i
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, left: usize, mid: usize, end: usize| {
        if let Some(&r) = ranks.get(&piece[left..end]) {
            heap.push(Reverse((r, left, mid, end)));
        }
    };
    for i in 0..n.saturating_sub(1) {
        push(&mut heap, i, i + 1, i + 2);
    }
    while let Some(Reverse((_, left, mid, end))) = heap.pop() {
        if !alive[left] || next[left] != mid || mid >= n || !alive[mid] || next[mid] != end {
            continue;
        }
        // merge left+mid
        alive[mid] = false;
        next[left] = end;
        if end < n {
            prev[end] = left;
            push(&mut heap, left, end, next[end]);
        }
        let p = prev[left];
        if p != usize::MAX {
            push(&mut heap, p, left, end);
        }
    }
    let mut bounds = Vec::new();
    let mut i = 0;
    while i < n {
        bounds.push(i);
        i = next[i];
    }
    bounds.push(n);
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn byte_ranks() -> Vec<(Vec<u8>, u32)> {
        (0u32..256).map(|b| (vec![b as u8], b)).collect()
    }

    /// Hand-made vocab: bytes 0..=255 plus five merges.
    fn five_merge_bpe() -> TiktokenBpe {
        let mut ranks = byte_ranks();
        for (i, m) in ["ab", "cd", "abcd", "bc", "aa"].iter().enumerate() {
            ranks.push((m.as_bytes().to_vec(), 256 + i as u32));
        }
        TiktokenBpe::new(
            ranks,
            vec![(261, "<|end|>".into(), true)],
            KIMI_PAT_STR,
            Path::new("test"),
        )
        .unwrap()
    }

    #[test]
    fn pattern_compiles_and_splits_like_kimi() {
        let re = fancy_regex::Regex::new(KIMI_PAT_STR).unwrap();
        let pieces: Vec<&str> = re
            .find_iter("Hello world's 12345 你好世界abc  \n\nfoo!!")
            .map(|m| m.unwrap().as_str())
            .collect();
        assert_eq!(
            pieces,
            [
                "Hello",
                " world's",
                " ",
                "123",
                "45",
                " ",
                "你好世界",
                "abc",
                "  \n\n",
                "foo",
                "!!"
            ]
        );
    }

    #[test]
    fn five_merge_bpe_by_hand() {
        let bpe = five_merge_bpe();
        // "abcd": pairs ab(256) bc(259) cd(257) -> ab first, then cd, then abcd.
        assert_eq!(bpe.encode("abcd", false).unwrap(), vec![258]);
        // "abc": ab(256) < bc(259) -> [ab][c]
        assert_eq!(bpe.encode("abc", false).unwrap(), vec![256, b'c' as u32]);
        // "bcd": bc(259) vs cd(257) -> cd first -> [b][cd]
        assert_eq!(bpe.encode("bcd", false).unwrap(), vec![b'b' as u32, 257]);
        // "aaa": aa at 0 and 1 tie -> leftmost -> [aa][a]
        assert_eq!(bpe.encode("aaa", false).unwrap(), vec![260, b'a' as u32]);
        // "aabcd": aa(260) ab(256) bc cd -> ab first: [a][ab][c][d] -> cd -> [a][ab][cd] -> abcd
        assert_eq!(bpe.encode("aabcd", false).unwrap(), vec![b'a' as u32, 258]);
        // " abcd" is one pre-token piece; the leading space stays alone.
        assert_eq!(bpe.encode(" abcd", false).unwrap(), vec![b' ' as u32, 258]);
    }

    #[test]
    fn heap_merge_matches_simple_merge() {
        let bpe = five_merge_bpe();
        let mut seed = 0x1234_5678u64;
        for len in [1usize, 2, 3, 7, 50, 200, 700] {
            for _ in 0..30 {
                let piece: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        b"abcd"[(seed >> 33) as usize % 4]
                    })
                    .collect();
                assert_eq!(
                    merge_simple(&bpe.ranks, &piece),
                    merge_heap(&bpe.ranks, &piece)
                );
            }
        }
    }

    #[test]
    fn specials_allowed_vs_not() {
        let bpe = five_merge_bpe();
        let with = bpe.encode("ab<|end|>cd", true).unwrap();
        assert_eq!(with, vec![256, 261, 257]);
        let without = bpe.encode("ab<|end|>cd", false).unwrap();
        assert!(!without.contains(&261));
        assert_eq!(bpe.decode_bytes(&without, false).unwrap(), b"ab<|end|>cd");
        assert_eq!(bpe.decode_bytes(&with, false).unwrap(), b"ab<|end|>cd");
        assert_eq!(bpe.decode_bytes(&with, true).unwrap(), b"abcd");
    }

    #[test]
    fn bad_base64_names_line() {
        let err =
            parse_ranks("IQ== 0\n!!!notbase64 1\n", Path::new("/x/tiktoken.model")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("/x/tiktoken.model") && msg.contains("line 2"),
            "{msg}"
        );
        let err = parse_ranks("IQ== zero\n", Path::new("t")).unwrap_err();
        assert!(err.to_string().contains("line 1"));
    }

    #[test]
    fn long_run_split_matches_kimi() {
        let s = "aaaaa bb";
        assert_eq!(split_long_runs(s, 3), vec!["aaa", "aa bb"]);
        assert_eq!(split_long_runs("", 3), vec![""]);
        let w: Vec<&str> = split_char_windows("héllo", 2).collect();
        assert_eq!(w, ["hé", "ll", "o"]);
    }
}
