//! `--kv-memory` values: a byte count with an optional unit, or a fraction of available memory.

/// Parses `1073741824`, `512MiB`, `2GiB`, `1.5GB`, or a fraction such as `0.2` (of the memory
/// available now).
pub fn parse_kv_memory(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512MiB, 2GiB, or a fraction like 0.2)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" if value < 1.0 => {
            let avail =
                available_memory().ok_or("a fraction needs /proc/meminfo; give bytes instead")?;
            return Ok((value * avail as f64) as usize);
        }
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}` (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    Ok((value * mult) as usize)
}

fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::parse_kv_memory;

    #[test]
    fn sizes_and_units() {
        assert_eq!(parse_kv_memory("1024").unwrap(), 1024);
        assert_eq!(parse_kv_memory("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_kv_memory("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_kv_memory("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_kv_memory("0.1").unwrap() > 0);
        assert!(parse_kv_memory("lots").is_err());
        assert!(parse_kv_memory("3 parsecs").is_err());
    }
}
