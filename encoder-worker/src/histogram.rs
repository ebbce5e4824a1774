//! A Prometheus histogram of durations (fixed buckets, lock-free).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in seconds (image encodes take milliseconds on a tiny model,
/// seconds on a large one on CPU).
const BOUNDS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

pub struct Histogram {
    buckets: [AtomicU64; BOUNDS.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BOUNDS.iter().position(|&b| s <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends the family `name` (cumulative buckets, `_sum`, `_count`) with `labels`.
    pub fn write(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut acc = 0;
        for (b, n) in BOUNDS.iter().zip(&self.buckets) {
            acc += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {acc}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(60));
        let mut s = String::new();
        h.write(&mut s, "t", "help", "role=\"encoder\"");
        assert!(
            s.contains("t_bucket{role=\"encoder\",le=\"0.001\"} 1\n"),
            "{s}"
        );
        assert!(
            s.contains("t_bucket{role=\"encoder\",le=\"0.05\"} 2\n"),
            "{s}"
        );
        assert!(
            s.contains("t_bucket{role=\"encoder\",le=\"+Inf\"} 3\n"),
            "{s}"
        );
        assert!(s.contains("t_count{role=\"encoder\"} 3\n"), "{s}");
    }
}
