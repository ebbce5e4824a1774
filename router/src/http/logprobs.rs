//! Log-probabilities in the response forms of the two endpoints: the legacy completion form
//! (parallel lists, alternatives as a map from text) and the chat form (an entry per token with
//! its bytes).

use std::collections::BTreeMap;

use super::generate::TokenLogprob;
use super::types::{ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs};

/// The completion form of `tokens`, whose texts start `offset` characters into the choice's
/// text; `offset` moves past them.
pub(crate) fn completion_form(tokens: &[TokenLogprob], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        out.tokens.push(t.token.clone());
        out.token_logprobs.push(t.logprob);
        // Alternatives whose texts coincide keep the likeliest (they come in descending order).
        let mut top = BTreeMap::new();
        for (_, text, lp) in &t.top {
            top.entry(text.clone()).or_insert(*lp);
        }
        out.top_logprobs.push(top);
        out.text_offset.push(*offset);
        *offset += t.token.chars().count();
    }
    out
}

/// The chat form of `tokens`.
pub(crate) fn chat_form(tokens: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| ChatTokenLogprob {
                token: t.token.clone(),
                logprob: t.logprob,
                bytes: t.token.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(_, text, lp)| ChatTopLogprob {
                        token: text.clone(),
                        logprob: *lp,
                        bytes: text.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// The gRPC form of `tokens`: ids and log-probabilities, no texts.
pub(crate) fn wire_form(tokens: &[TokenLogprob]) -> Vec<tessera_proto::v1::TokenLogprobs> {
    tokens
        .iter()
        .map(|t| tessera_proto::v1::TokenLogprobs {
            token_id: t.id,
            logprob: t.logprob,
            top_ids: t.top.iter().map(|(id, _, _)| *id).collect(),
            top_logprobs: t.top.iter().map(|(_, _, lp)| *lp).collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(text: &str, lp: f32, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            id: 0,
            token: text.into(),
            logprob: lp,
            top: top
                .iter()
                .enumerate()
                .map(|(i, &(t, l))| (i as u32, t.to_string(), l))
                .collect(),
        }
    }

    #[test]
    fn completion_form_lists_tokens_with_offsets_and_alternatives_by_text() {
        let toks = [
            tok("Hé", -0.5, &[("Hé", -0.5), ("x", -1.5)]),
            tok(" yo", -0.25, &[(" yo", -0.25), (" yo", -3.0)]),
        ];
        let mut offset = 4;
        let f = completion_form(&toks, &mut offset);
        assert_eq!(f.tokens, vec!["Hé", " yo"]);
        assert_eq!(f.token_logprobs, vec![-0.5, -0.25]);
        assert_eq!(f.text_offset, vec![4, 6], "characters, not bytes");
        assert_eq!(offset, 9);
        assert_eq!(f.top_logprobs[0].len(), 2);
        assert_eq!(
            f.top_logprobs[1][" yo"], -0.25,
            "the likelier of a repeated text"
        );
    }

    #[test]
    fn chat_form_carries_bytes() {
        let f = chat_form(&[tok("é", -1.0, &[("é", -1.0)])]);
        assert_eq!(f.content[0].bytes, vec![0xc3, 0xa9]);
        assert_eq!(f.content[0].top_logprobs[0].token, "é");
    }
}
