//! Images of a request as the backends see them: the encoded file the client sent, its SHA-256
//! (the encoder affinity key and, on the workers, part of the prefix-cache keys), and where its
//! placeholder sits in the prompt.
//!
//! The chat template writes one placeholder token per image; once an encoder has said how many
//! embedding rows an image has, [`expand_placeholders`] (shared with the engine through the
//! tokenizer crate) widens that token to as many copies, so that the prompt has one position per
//! row.

use std::sync::Arc;

use sha2::{Digest, Sha256};

/// One image of a request.
#[derive(Clone, PartialEq, Eq)]
pub struct ImageInput {
    /// The encoded file (PNG, JPEG, WebP, …) as the client sent it.
    pub data: Arc<[u8]>,
    /// The media type the client declared (`image/png`); empty when it declared none.
    pub mime_type: String,
    /// SHA-256 of `data`.
    pub content_hash: [u8; 32],
}

impl ImageInput {
    pub fn new(data: Vec<u8>, mime_type: impl Into<String>) -> Self {
        let content_hash = Sha256::digest(&data).into();
        ImageInput {
            data: data.into(),
            mime_type: mime_type.into(),
            content_hash,
        }
    }

    /// The first 8 bytes of the hash, as a routing key.
    pub fn affinity_key(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.content_hash[..8]);
        u64::from_le_bytes(b)
    }
}

impl std::fmt::Debug for ImageInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageInput")
            .field("bytes", &self.data.len())
            .field("mime_type", &self.mime_type)
            .finish()
    }
}

/// The prefix-cache salt of a request's images: SHA-256 over their content hashes, in order;
/// empty without images.
pub fn cache_salt(images: &[ImageInput]) -> Vec<u8> {
    if images.is_empty() {
        return Vec::new();
    }
    let mut h = Sha256::new();
    for i in images {
        h.update(i.content_hash);
    }
    h.finalize().to_vec()
}

pub use tessera_tokenizer::{expand_placeholders, placeholder_runs};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_widen_to_the_image_rows() {
        let p = [1, 9, 2, 3, 9, 4];
        let (out, pos) = expand_placeholders(&p, 9, &[3, 2]).unwrap();
        assert_eq!(out, vec![1, 9, 9, 9, 2, 3, 9, 9, 4]);
        assert_eq!(pos, vec![1, 6]);
        // Already expanded: kept.
        let (again, pos2) = expand_placeholders(&out, 9, &[3, 2]).unwrap();
        assert_eq!((again, pos2), (out, pos));
        assert!(expand_placeholders(&p, 9, &[3]).is_err());
        assert!(expand_placeholders(&[9, 9, 1], 9, &[3]).is_err());
        assert_eq!(placeholder_runs(&[9, 9, 1, 9], 9), vec![0..2, 3..4]);
    }

    #[test]
    fn the_hash_is_sha256_of_the_bytes() {
        let i = ImageInput::new(b"abc".to_vec(), "image/png");
        assert_eq!(
            i.content_hash[..4],
            [0xba, 0x78, 0x16, 0xbf],
            "SHA-256(\"abc\") starts ba7816bf"
        );
        let j = ImageInput::new(b"abd".to_vec(), "");
        assert_ne!(i.affinity_key(), j.affinity_key());
        assert!(cache_salt(&[]).is_empty());
        assert_eq!(cache_salt(&[i.clone(), j.clone()]).len(), 32);
        assert_ne!(cache_salt(&[i.clone(), j.clone()]), cache_salt(&[j, i]));
    }
}
