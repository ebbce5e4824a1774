//! Minimal `.npy` (format 1.0) for f32 arrays: what `tessera logits` writes and tests read.

use std::io::Write;
use std::path::Path;

use crate::error::{EngineError, Result};

pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    debug_assert_eq!(shape.iter().product::<usize>(), data.len());
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Magic (6) + version (2) + length (2) + header + newline, padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = std::fs::File::create(path).map_err(|e| EngineError::io(path, e))?;
    f.write_all(&bytes).map_err(|e| EngineError::io(path, e))
}

/// Reads a little-endian f32 C-order `.npy`; returns `(shape, data)`.
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).map_err(|e| EngineError::io(path, e))?;
    let bad = |m: &str| EngineError::InvalidInput(format!("{}: {m}", path.display()));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err(bad("unknown .npy version")),
    };
    let header = std::str::from_utf8(&bytes[hstart..hstart + hlen])
        .map_err(|_| bad("header is not UTF-8"))?;
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        return Err(bad("only little-endian f32 C-order arrays are supported"));
    }
    let open = header.find("'shape': (").ok_or_else(|| bad("no shape"))? + 10;
    let close = open + header[open..].find(')').ok_or_else(|| bad("bad shape"))?;
    let shape: Vec<usize> = header[open..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<Result<_>>()?;
    let data: Vec<f32> = bytes[hstart + hlen..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if data.len() != shape.iter().product::<usize>() {
        return Err(bad("data length does not match the shape"));
    }
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        super::write_f32(&p, &[3, 4], &data).unwrap();
        let (shape, back) = super::read_f32(&p).unwrap();
        assert_eq!(shape, vec![3, 4]);
        assert_eq!(back, data);
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!((bytes.len() - 12 * 4) % 64, 0, "header padded to 64 bytes");
    }
}
