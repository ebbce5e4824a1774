//! Image bytes to RGB8 pixels. The format is sniffed from the bytes (never a file name or a
//! client's word), and the size limits are checked on the header before any pixel is decoded,
//! so a small file that claims a huge image costs nothing.

use std::io::Cursor;

use image::{ImageFormat, ImageReader, Limits};

use super::{ImageError, ImageLimits};

/// A decoded image: `height` rows of `width` RGB triples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        _ => "image",
    }
}

/// Decodes PNG, JPEG or WebP bytes into RGB8, as PIL's `convert("RGB")` does: alpha is dropped
/// (not blended), grey is replicated, palettes are expanded.
pub fn decode_rgb(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            bytes: bytes.len(),
            limit: limits.max_bytes,
        });
    }
    let format = match image::guess_format(bytes) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP)) => f,
        Ok(other) => return Err(ImageError::UnsupportedFormat(format!("{other:?}"))),
        Err(_) => return Err(ImageError::UnknownFormat),
    };
    let name = format_name(format);
    let decode_err = |e: image::ImageError| ImageError::Decode {
        format: name,
        message: e.to_string(),
    };
    let reader = |limits: Limits| {
        let mut r = ImageReader::with_format(Cursor::new(bytes), format);
        r.limits(limits);
        r
    };
    if format == ImageFormat::Jpeg && !jpeg_has_end(bytes) {
        // PIL refuses these ("image file is truncated"); zune-jpeg would pad them with grey.
        return Err(ImageError::Decode {
            format: name,
            message: "the data ends before the end-of-image marker (truncated file)".into(),
        });
    }
    let (width, height) = reader(Limits::default())
        .into_dimensions()
        .map_err(decode_err)?;
    check_size(width, height, limits)?;
    let mut decode_limits = Limits::default();
    decode_limits.max_image_width = Some(width);
    decode_limits.max_image_height = Some(height);
    // RGBA16 is the widest layout a decoder may allocate, plus its own scratch.
    decode_limits.max_alloc = Some(width as u64 * height as u64 * 8 * 2 + (64 << 20));
    let img = reader(decode_limits).decode().map_err(decode_err)?;
    if (img.width(), img.height()) != (width, height) {
        return Err(ImageError::Decode {
            format: name,
            message: format!(
                "header says {width}x{height}, decoded {}x{}",
                img.width(),
                img.height()
            ),
        });
    }
    let rgb = img.into_rgb8();
    Ok(RgbImage {
        width: width as usize,
        height: height as usize,
        pixels: rgb.into_raw(),
    })
}

fn check_size(width: u32, height: u32, limits: &ImageLimits) -> Result<(), ImageError> {
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    let pixels = width as u64 * height as u64;
    if width > limits.max_side || height > limits.max_side {
        return Err(ImageError::SideTooLong {
            width,
            height,
            limit: limits.max_side,
        });
    }
    if pixels > limits.max_pixels {
        return Err(ImageError::TooManyPixels {
            width,
            height,
            pixels,
            limit: limits.max_pixels,
        });
    }
    Ok(())
}

/// Whether an end-of-image marker follows the last start-of-scan marker. Entropy-coded data
/// escapes every 0xFF byte, so neither marker can appear inside it; an embedded EXIF thumbnail
/// ends before the main image's scans start.
fn jpeg_has_end(bytes: &[u8]) -> bool {
    let Some(sos) = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]) else {
        return false;
    };
    bytes[sos..].windows(2).any(|w| w == [0xFF, 0xD9])
}
