//! Errors of the image path. Every one is the client's fault (a bad image, a prompt whose
//! placeholders do not match its images), so the edge maps all of them to HTTP 400.

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image is empty (0 bytes)")]
    Empty,
    #[error("image is {bytes} bytes, the limit is {limit}")]
    TooManyBytes { bytes: usize, limit: usize },
    #[error("image format not recognised (expected PNG, JPEG or WebP)")]
    UnknownFormat,
    #[error("image format {0} is not supported (expected PNG, JPEG or WebP)")]
    UnsupportedFormat(String),
    #[error("image has zero size ({width}x{height})")]
    ZeroSize { width: u32, height: u32 },
    #[error("image is {width}x{height} = {pixels} pixels, the limit is {limit}")]
    TooManyPixels {
        width: u32,
        height: u32,
        pixels: u64,
        limit: u64,
    },
    #[error("image is {width}x{height}, a side may be at most {limit} pixels")]
    SideTooLong { width: u32, height: u32, limit: u32 },
    #[error("cannot decode {format} image: {message}")]
    Decode {
        format: &'static str,
        message: String,
    },
    #[error(
        "prompt has {found} image placeholder tokens where {expected} were expected: {detail}"
    )]
    PlaceholderMismatch {
        expected: usize,
        found: usize,
        detail: String,
    },
    #[error("image embedding has {found} columns, the model's hidden size is {expected}")]
    HiddenMismatch { expected: usize, found: usize },
}
