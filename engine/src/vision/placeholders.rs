//! Placing images in a prompt: each image's placeholder token is widened to the number of
//! embedding rows the image produces, so the text model sees one position per image token.

use super::{ImageError, PlacedImage};
use crate::kv::PageMark;
use crate::model::EmbedSplice;

/// Expands each image's placeholder (the rule of [`tessera_tokenizer::expand_placeholders`]): a
/// single placeholder becomes `n_tokens` copies; a run already of exactly `n_tokens` is kept.
/// Returns the new prompt and each image's position (the index of its first placeholder token
/// in the new prompt).
pub fn expand_placeholders(
    prompt: &[u32],
    placeholder: u32,
    n_tokens: &[usize],
) -> Result<(Vec<u32>, Vec<usize>), ImageError> {
    tessera_tokenizer::expand_placeholders(prompt, placeholder, n_tokens).map_err(|m| {
        ImageError::PlaceholderMismatch {
            expected: m.expected,
            found: m.found,
            detail: m.detail,
        }
    })
}

/// Checks images placed in `prompt`: each covers `n_tokens` placeholder tokens inside the
/// prompt, none overlap, and each has the text model's hidden size.
pub fn check_placed(
    prompt: &[u32],
    placeholder: Option<u32>,
    hidden: usize,
    images: &[PlacedImage],
) -> Result<(), ImageError> {
    let expected: usize = images.iter().map(|im| im.embedding.n_tokens).sum();
    let found = placeholder.map_or(0, |p| prompt.iter().filter(|&&t| t == p).count());
    let mismatch = |detail: String| ImageError::PlaceholderMismatch {
        expected,
        found,
        detail,
    };
    let mut order: Vec<&PlacedImage> = images.iter().collect();
    order.sort_by_key(|im| im.position);
    let mut free_from = 0;
    for im in order {
        let e = &im.embedding;
        if e.hidden != hidden {
            return Err(ImageError::HiddenMismatch {
                expected: hidden,
                found: e.hidden,
            });
        }
        if e.values.len() != e.n_tokens * e.hidden {
            return Err(mismatch(format!(
                "an image embedding holds {} floats, not {} x {}",
                e.values.len(),
                e.n_tokens,
                e.hidden
            )));
        }
        let end = im.position + e.n_tokens;
        if end > prompt.len() {
            return Err(mismatch(format!(
                "an image at position {} with {} tokens runs past the prompt's {} tokens",
                im.position,
                e.n_tokens,
                prompt.len()
            )));
        }
        if im.position < free_from {
            return Err(mismatch(format!(
                "images overlap at position {}",
                im.position
            )));
        }
        if let Some(p) = placeholder {
            if let Some(off) = prompt[im.position..end].iter().position(|&t| t != p) {
                return Err(mismatch(format!(
                    "position {} is inside an image but holds token {}, not the placeholder {p}",
                    im.position + off,
                    prompt[im.position + off]
                )));
            }
        }
        free_from = end;
    }
    Ok(())
}

/// The image rows that fall in prompt positions `start..end`, as splices relative to `start`:
/// an image cut by a chunk boundary gives each chunk its own rows.
pub fn splices_in(images: &[PlacedImage], start: usize, end: usize) -> Vec<EmbedSplice<'_>> {
    let mut out = Vec::new();
    for im in images {
        let e = &im.embedding;
        let (lo, hi) = (im.position.max(start), (im.position + e.n_tokens).min(end));
        if lo < hi {
            out.push(EmbedSplice {
                row: lo - start,
                values: &e.values[(lo - im.position) * e.hidden..(hi - im.position) * e.hidden],
            });
        }
    }
    out
}

/// Prefix-cache marks of a request's images: each image's content hash (and token count)
/// enters the hash of the page holding its first token. Pages before that page hash as the same
/// text without images, so they are shared; that page and every later one differ from the same
/// text with another image (or none).
pub fn page_marks(images: &[PlacedImage]) -> Vec<PageMark> {
    images
        .iter()
        .map(|im| {
            let mut bytes = im.embedding.content_hash.to_vec();
            bytes.extend_from_slice(&(im.embedding.n_tokens as u64).to_le_bytes());
            PageMark {
                position: im.position,
                bytes,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::kv::page_hashes_marked;
    use crate::vision::ImageEmbedding;

    const P: u32 = 9;

    #[test]
    fn single_placeholders_widen_and_expanded_runs_stay() {
        let (out, pos) = expand_placeholders(&[1, P, 2, P, P, P, 3], P, &[4, 3]).unwrap();
        assert_eq!(out, vec![1, P, P, P, P, 2, P, P, P, 3]);
        assert_eq!(pos, vec![1, 6]);
        let (out, pos) = expand_placeholders(&[P, 5], P, &[2]).unwrap();
        assert_eq!((out, pos), (vec![P, P, 5], vec![0]));
        let (out, pos) = expand_placeholders(&[1, 2], P, &[]).unwrap();
        assert_eq!((out, pos), (vec![1, 2], vec![]));
    }

    #[test]
    fn mismatched_counts_are_refused_with_the_reason() {
        let err = expand_placeholders(&[1, P, 2], P, &[3, 3]).unwrap_err();
        assert!(
            err.to_string()
                .contains("the prompt has 1 image placeholder(s) for 2 image(s)"),
            "{err}"
        );
        let err = expand_placeholders(&[1, P, P, 2], P, &[3]).unwrap_err();
        assert!(err.to_string().contains("run of 2 placeholders"), "{err}");
        let err = expand_placeholders(&[1, 2], P, &[3]).unwrap_err();
        assert!(matches!(
            err,
            ImageError::PlaceholderMismatch {
                found: 0,
                expected: 3,
                ..
            }
        ));
    }

    fn image(position: usize, n: usize, hidden: usize, fill: f32) -> PlacedImage {
        PlacedImage {
            position,
            embedding: Arc::new(ImageEmbedding {
                content_hash: [fill as u8; 32],
                n_tokens: n,
                hidden,
                values: (0..n * hidden).map(|i| fill + i as f32).collect(),
            }),
        }
    }

    #[test]
    fn splices_cut_images_at_chunk_boundaries() {
        let images = [image(2, 3, 2, 100.0), image(6, 2, 2, 200.0)];
        // Chunk 0..4 holds the first two rows of image 0.
        let s = splices_in(&images, 0, 4);
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].row, s[0].values),
            (2, &[100.0, 101.0, 102.0, 103.0][..])
        );
        // Chunk 4..7: the last row of image 0 and the first of image 1.
        let s = splices_in(&images, 4, 7);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].row, s[0].values), (0, &[104.0, 105.0][..]));
        assert_eq!((s[1].row, s[1].values), (2, &[200.0, 201.0][..]));
        assert!(splices_in(&images, 8, 12).is_empty());
    }

    #[test]
    fn placed_images_are_checked_against_the_prompt() {
        let prompt = [1, P, P, P, 2, P, P];
        let ok = [image(1, 3, 2, 1.0), image(5, 2, 2, 2.0)];
        check_placed(&prompt, Some(P), 2, &ok).unwrap();
        let err = check_placed(&prompt, Some(P), 4, &ok).unwrap_err();
        assert!(matches!(
            err,
            ImageError::HiddenMismatch {
                expected: 4,
                found: 2
            }
        ));
        let err = check_placed(&prompt, Some(P), 2, &[image(2, 3, 2, 1.0)]).unwrap_err();
        assert!(err.to_string().contains("holds token 2"), "{err}");
        let err = check_placed(&prompt, Some(P), 2, &[image(5, 3, 2, 1.0)]).unwrap_err();
        assert!(err.to_string().contains("runs past"), "{err}");
        let err = check_placed(
            &prompt,
            None,
            2,
            &[image(1, 3, 2, 1.0), image(2, 1, 2, 1.0)],
        )
        .unwrap_err();
        assert!(err.to_string().contains("overlap"), "{err}");
    }

    #[test]
    fn marks_change_the_page_of_the_image_and_later_pages_only() {
        let tokens: Vec<u32> = (0..12).collect();
        let plain = page_hashes_marked(4, &tokens, None, &[]);
        let hashes = |im: &[PlacedImage]| page_hashes_marked(4, &tokens, None, &page_marks(im));
        let a = hashes(&[image(5, 3, 2, 1.0)]);
        let b = hashes(&[image(5, 3, 2, 2.0)]);
        let a_moved = hashes(&[image(9, 3, 2, 1.0)]);
        assert_eq!(a[0], plain[0], "the page before the image is shared");
        assert!(a[1] != plain[1] && a[2] != plain[2]);
        assert!(a[1] != b[1] && a[2] != b[2], "another image, other pages");
        assert_eq!(a_moved[1], plain[1]);
        assert!(a_moved[2] != a[2]);
        assert_eq!(a, hashes(&[image(5, 3, 2, 1.0)]));
    }
}
