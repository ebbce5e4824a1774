//! The `--plot-out` PNG of `tessera bench`: each request's TTFT (blue) and end-to-end latency
//! (red) against the time it started, on linear axes from zero with ten tick marks each. The PNG
//! is written by hand: 8-bit RGB, stored (uncompressed) deflate blocks, CRC-32 and Adler-32.

use std::path::Path;

pub const WIDTH: usize = 800;
pub const HEIGHT: usize = 500;
const MARGIN: usize = 40;

/// One point: (start in seconds, TTFT in ms, end-to-end latency in ms).
pub type Point = (f64, f64, f64);

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Canvas {
        Canvas {
            px: vec![255; WIDTH * HEIGHT * 3],
        }
    }
    fn set(&mut self, x: usize, y: usize, c: [u8; 3]) {
        if x < WIDTH && y < HEIGHT {
            let i = (y * WIDTH + x) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }
    fn rect(&mut self, x0: usize, y0: usize, x1: usize, y1: usize, c: [u8; 3]) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                self.set(x, y, c);
            }
        }
    }
}

/// The axis ends: (largest start in seconds, largest latency in ms).
pub fn extent(points: &[Point]) -> (f64, f64) {
    let t_max = points.iter().map(|p| p.0).fold(0.0, f64::max).max(1e-9);
    let l_max = points
        .iter()
        .map(|p| p.1.max(p.2))
        .fold(0.0, f64::max)
        .max(1e-9);
    (t_max, l_max)
}

/// Draws the scatter plot into an RGB buffer of WIDTH × HEIGHT.
fn draw(points: &[Point]) -> Vec<u8> {
    let mut c = Canvas::new();
    let black = [0, 0, 0];
    let (x0, y0) = (MARGIN, HEIGHT - MARGIN);
    let (x1, y1) = (WIDTH - MARGIN, MARGIN);
    c.rect(x0, y1, x0, y0, black);
    c.rect(x0, y0, x1, y0, black);
    for k in 0..=10 {
        let x = x0 + (x1 - x0) * k / 10;
        c.rect(x, y0, x, y0 + 5, black);
        let y = y0 - (y0 - y1) * k / 10;
        c.rect(x0 - 5, y, x0, y, black);
    }
    let (t_max, l_max) = extent(points);
    let to_px = |t: f64, l: f64| {
        let x = x0 as f64 + (x1 - x0) as f64 * (t / t_max);
        let y = y0 as f64 - (y0 - y1) as f64 * (l / l_max);
        (x.round() as usize, y.round() as usize)
    };
    for &(t, ttft, e2e) in points {
        for (l, color) in [(e2e, [200, 30, 30]), (ttft, [30, 60, 200])] {
            let (x, y) = to_px(t, l);
            c.rect(
                x.saturating_sub(2),
                y.saturating_sub(2),
                x + 2,
                y + 2,
                color,
            );
        }
    }
    c.px
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    (b << 16) | a
}

/// A zlib stream of stored deflate blocks.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let mut blocks = data.chunks(65535).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xFF, 0xFF]);
    }
    while let Some(block) = blocks.next() {
        out.push(u8::from(blocks.peek().is_none()));
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

fn chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    png.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = png.len();
    png.extend_from_slice(kind);
    png.extend_from_slice(data);
    let crc = crc32(&png[start..]);
    png.extend_from_slice(&crc.to_be_bytes());
}

/// Encodes an RGB buffer as PNG.
fn encode(rgb: &[u8], width: usize, height: usize) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(width as u32).to_be_bytes());
    ihdr.extend_from_slice(&(height as u32).to_be_bytes());
    // 8 bits per sample, RGB, deflate, adaptive filtering, no interlace.
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    let mut raw = Vec::with_capacity((width * 3 + 1) * height);
    for row in rgb.chunks(width * 3) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    chunk(&mut png, b"IDAT", &zlib_stored(&raw));
    chunk(&mut png, b"IEND", &[]);
    png
}

pub fn write(path: &Path, points: &[Point]) -> std::io::Result<()> {
    std::fs::write(path, encode(&draw(points), WIDTH, HEIGHT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_known_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn png_has_signature_header_and_end() {
        let png = encode(&draw(&[(0.0, 1.0, 2.0), (1.0, 3.0, 9.0)]), WIDTH, HEIGHT);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        assert_eq!(
            u32::from_be_bytes(png[16..20].try_into().unwrap()),
            WIDTH as u32
        );
        assert_eq!(&png[png.len() - 8..png.len() - 4], b"IEND");
    }
}
