//! Image content parts of `/v1/chat/completions`: `{"type": "image_url", "image_url": {"url":
//! "data:image/png;base64,…"}}` (the URL may also be given as a bare string, and `type` may be
//! `image` or `input_image`). `data:` URLs are decoded here; an `http(s)` URL is fetched only
//! from a host the operator allowlisted ([`super::fetch`]), and refused otherwise, so a client
//! cannot make the server reach hosts on its network (SSRF).
//!
//! Checks here are the cheap ones (the URL's form, base64, the encoded size, the count);
//! whether the bytes are an image the model can take is the encoder's call, and its refusal
//! reaches the client as a 400 too.

use base64::Engine as _;
use serde_json::Value;
use tessera_tokenizer::{ChatMessage, MessageContent};

use super::error::ApiError;
use super::fetch::RemoteImages;
use crate::images::ImageInput;

/// Where an image part's bytes are.
#[derive(Debug)]
pub(crate) enum Source {
    Inline(ImageInput),
    /// An `http(s)` URL of an allowlisted host, to fetch.
    Remote(String),
}

/// Limits on the images of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageRules {
    /// Images per request at most.
    pub max_images: usize,
    /// Bytes of one encoded image at most (after base64 decoding).
    pub max_image_bytes: usize,
}

impl Default for ImageRules {
    fn default() -> Self {
        ImageRules {
            max_images: 8,
            max_image_bytes: 5 << 20,
        }
    }
}

/// Whether a content part is an image part.
pub(crate) fn is_image_part(part: &Value) -> bool {
    matches!(
        part.get("type").and_then(Value::as_str),
        Some("image_url" | "image" | "input_image")
    )
}

/// The URL of an image part: `image_url.url`, `image_url` as a string, or `image`.
fn part_url(part: &Value) -> Option<&str> {
    match part.get("image_url") {
        Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
        Some(Value::String(s)) => Some(s),
        _ => part.get("image").and_then(Value::as_str),
    }
}

/// Checks an image part's shape (before the template sees it).
pub(crate) fn check_image_part(part: &Value) -> Result<(), String> {
    match part_url(part) {
        Some(_) => Ok(()),
        None => Err("an image content part needs `image_url.url` (a data URL)".into()),
    }
}

/// Decodes a `data:[<media type>][;base64],<data>` URL; passes an `http(s)` URL on when
/// `remote` allows fetching, refuses it otherwise, and refuses every other scheme.
fn decode_url(url: &str, rules: &ImageRules, remote: bool) -> Result<Source, String> {
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url
            .split_once(':')
            .map_or("", |(s, _)| s)
            .to_ascii_lowercase();
        return match scheme.as_str() {
            "http" | "https" if remote => Ok(Source::Remote(url.to_string())),
            "http" | "https" => Err("image URLs are not fetched by this server: send the image \
                                     inline as a data URL (data:image/png;base64,...)"
                .into()),
            _ => Err(
                "an image URL must be a data URL (data:image/png;base64,...) or an \
                      http(s) URL"
                    .into(),
            ),
        };
    };
    let (meta, payload) = rest
        .split_once(',')
        .ok_or("a data URL needs a `,` before its data")?;
    let mut params = meta.split(';');
    let mime = params.next().unwrap_or("").trim().to_ascii_lowercase();
    if !params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err("an image data URL must be base64-encoded (data:image/png;base64,...)".into());
    }
    if !(mime.is_empty() || mime.starts_with("image/")) {
        return Err(format!(
            "the data URL's media type is `{mime}`, not an image type"
        ));
    }
    let payload: String = payload
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    // Four base64 characters carry three bytes: refuse before decoding what cannot fit.
    if payload.len() / 4 * 3 > rules.max_image_bytes + 3 {
        return Err(format!(
            "the image is larger than the limit of {} bytes",
            rules.max_image_bytes
        ));
    }
    let data = base64::engine::general_purpose::STANDARD
        .decode(payload.as_bytes())
        .map_err(|e| format!("the data URL is not valid base64: {e}"))?;
    if data.is_empty() {
        return Err("the image is empty (0 bytes)".into());
    }
    if data.len() > rules.max_image_bytes {
        return Err(format!(
            "the image is {} bytes, the limit is {}",
            data.len(),
            rules.max_image_bytes
        ));
    }
    Ok(Source::Inline(ImageInput::new(data, mime)))
}

/// Takes the images out of `messages` in order (the template renders one placeholder per image
/// part, in the same order), leaving each part's URL empty so the template does not copy it.
/// A model without a vision tower (`takes_images` false) refuses any image part. Each image
/// comes with the request field it came from.
pub(crate) fn take_images(
    messages: &mut [ChatMessage],
    rules: &ImageRules,
    takes_images: bool,
    remote: bool,
) -> Result<Vec<(String, Source)>, ApiError> {
    let mut images = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let MessageContent::Parts(parts) = &mut m.content else {
            continue;
        };
        let param = format!("messages[{i}].content");
        for part in parts.iter_mut().filter(|p| is_image_part(p)) {
            if !takes_images {
                return Err(ApiError::invalid_param(
                    &param,
                    "images are not supported by this model",
                ));
            }
            if images.len() == rules.max_images {
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "at most {} images are allowed per request",
                        rules.max_images
                    ),
                ));
            }
            let url = part_url(part).unwrap_or_default();
            let image =
                decode_url(url, rules, remote).map_err(|m| ApiError::invalid_param(&param, m))?;
            images.push((param.clone(), image));
            if let Some(obj) = part.as_object_mut() {
                obj.remove("image");
                obj.insert("image_url".into(), serde_json::json!({"url": ""}));
            }
        }
    }
    Ok(images)
}

/// The images' bytes: inline ones as they are, remote ones fetched (all at once).
pub(crate) async fn fetch_images(
    sources: Vec<(String, Source)>,
    rules: &ImageRules,
    remote: Option<&RemoteImages>,
) -> Result<Vec<ImageInput>, ApiError> {
    let fetches = sources.into_iter().map(|(param, source)| async move {
        match (source, remote) {
            (Source::Inline(image), _) => Ok(image),
            (Source::Remote(url), Some(r)) => {
                let (data, mime) = r
                    .fetch(&url, rules.max_image_bytes)
                    .await
                    .map_err(|m| ApiError::invalid_param(&param, m))?;
                if data.is_empty() {
                    return Err(ApiError::invalid_param(
                        &param,
                        "the image is empty (0 bytes)",
                    ));
                }
                let mime = if mime.starts_with("image/") {
                    mime
                } else {
                    String::new()
                };
                Ok(ImageInput::new(data, mime))
            }
            (Source::Remote(_), None) => Err(ApiError::invalid_param(
                &param,
                "image URLs are not fetched by this server",
            )),
        }
    });
    futures_util::future::join_all(fetches)
        .await
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules() -> ImageRules {
        ImageRules {
            max_images: 2,
            max_image_bytes: 16,
        }
    }

    fn msgs(parts: Vec<Value>) -> Vec<ChatMessage> {
        vec![ChatMessage::new("user", parts)]
    }

    /// The inline images of `m` (no fetching allowed).
    fn take_images(
        m: &mut [ChatMessage],
        rules: &ImageRules,
        takes_images: bool,
    ) -> Result<Vec<ImageInput>, ApiError> {
        super::take_images(m, rules, takes_images, false)?
            .into_iter()
            .map(|(_, s)| match s {
                Source::Inline(i) => Ok(i),
                Source::Remote(u) => panic!("{u} passed without an allowlist"),
            })
            .collect()
    }

    fn url_part(url: &str) -> Value {
        json!({"type": "image_url", "image_url": {"url": url}})
    }

    #[tokio::test]
    async fn http_urls_pass_only_with_an_allowlist() {
        let part = || msgs(vec![url_part("http://images.example/cat.png")]);
        let got = super::take_images(&mut part(), &rules(), true, true).unwrap();
        assert!(matches!(&got[0].1, Source::Remote(u) if u == "http://images.example/cat.png"));
        let e = fetch_images(got, &rules(), None).await.unwrap_err();
        assert!(e.message.contains("not fetched"), "{}", e.message);
        let remote = RemoteImages::new(&["allowed.example".into()], Default::default()).unwrap();
        let got = super::take_images(&mut part(), &rules(), true, true).unwrap();
        let e = fetch_images(got, &rules(), Some(&remote))
            .await
            .unwrap_err();
        assert!(
            e.message.contains("not an allowed image host"),
            "{}",
            e.message
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn data_urls_are_decoded_and_blanked() {
        let mut m = msgs(vec![
            json!({"type": "text", "text": "hi"}),
            url_part("data:image/png;base64,aGVsbG8="),
            json!({"type": "image_url", "image_url": "data:;base64,d29ybGQ="}),
        ]);
        let images = take_images(&mut m, &rules(), true).unwrap();
        assert_eq!(images.len(), 2);
        assert_eq!(&*images[0].data, b"hello");
        assert_eq!(images[0].mime_type, "image/png");
        assert_eq!(&*images[1].data, b"world");
        let MessageContent::Parts(parts) = &m[0].content else {
            panic!()
        };
        assert_eq!(parts[1]["image_url"]["url"], "");
        assert_eq!(parts[2]["image_url"]["url"], "");
    }

    #[test]
    fn bad_urls_are_refused_with_a_reason() {
        for (url, want) in [
            ("https://example.com/cat.png", "not fetched"),
            ("http://169.254.169.254/latest", "not fetched"),
            ("file:///etc/passwd", "must be a data URL"),
            ("ftp://example.com/cat.png", "must be a data URL"),
            ("data:image/png,abc", "base64-encoded"),
            ("data:text/plain;base64,aGVsbG8=", "not an image type"),
            ("data:image/png;base64,@@@", "not valid base64"),
            ("data:image/png;base64,", "empty"),
            (
                "data:image/png;base64,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
                "limit",
            ),
            ("data:image/png;base64", "`,`"),
        ] {
            let e = take_images(&mut msgs(vec![url_part(url)]), &rules(), true).unwrap_err();
            assert!(e.message.contains(want), "{url}: {}", e.message);
            assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        }
        let three = vec![url_part("data:;base64,YQ=="); 3];
        let e = take_images(&mut msgs(three), &rules(), true).unwrap_err();
        assert!(e.message.contains("at most 2 images"), "{}", e.message);
        let one = vec![url_part("data:;base64,YQ==")];
        let e = take_images(&mut msgs(one), &rules(), false).unwrap_err();
        assert!(
            e.message.contains("not supported by this model"),
            "{}",
            e.message
        );
    }
}
