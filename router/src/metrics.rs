//! The HTTP front's Prometheus metrics, rendered in the text exposition format.
//!
//! Hand-rolled (a few atomics and one small map) so the front carries no metrics framework; the
//! backend appends its own lines through `GenerationBackend::metrics_text`.

use std::collections::BTreeMap;
use std::fmt::{Display, Write as _};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Latency buckets in seconds, shared by every histogram here.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
];

/// A cumulative histogram with fixed buckets.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound plus `+Inf`.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cum += c.load(Ordering::Relaxed);
            match self.bounds.get(i) {
                Some(b) => _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}"),
                None => _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}"),
            }
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cum}");
    }
}

/// A counter family with two labels, one sample per `(a, b)` key.
fn render_labelled<A: Display, B: Display>(
    out: &mut String,
    name: &str,
    help: &str,
    [la, lb]: [&str; 2],
    map: &Mutex<BTreeMap<(A, B), u64>>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    let map = map.lock().unwrap_or_else(|e| e.into_inner());
    for ((a, b), n) in map.iter() {
        let _ = writeln!(out, "{name}{{{la}=\"{a}\",{lb}=\"{b}\"}} {n}");
    }
}

/// Everything the front measures.
#[derive(Debug)]
pub struct Metrics {
    /// `(endpoint, status) → count`.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Refused requests (HTTP and gRPC): `(status, reason) → count`.
    refused: Mutex<BTreeMap<(u16, &'static str), u64>>,
    pub in_flight: AtomicI64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            refused: Mutex::default(),
            in_flight: AtomicI64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            tpot: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// Requests counted so far for `endpoint` with `status`.
    pub fn requests(&self, endpoint: &str, status: u16) -> u64 {
        let map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(endpoint.to_string(), status))
            .copied()
            .unwrap_or(0)
    }

    /// Count one request refused with a 4xx `status` for `reason` (the error's code:
    /// `invalid_api_key`, `rate_limit_exceeded`, `context_length_exceeded`, …).
    pub fn count_refused(&self, status: u16, reason: &'static str) {
        let mut map = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((status, reason)).or_default() += 1;
    }

    /// Refusals counted so far with `status` and `reason`.
    pub fn refused(&self, status: u16, reason: &'static str) -> u64 {
        let map = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(status, reason)).copied().unwrap_or(0)
    }

    /// The Prometheus text exposition of every metric above.
    pub fn render(&self) -> String {
        let mut out = String::new();
        render_labelled(
            &mut out,
            "tessera_http_requests_total",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            &self.requests,
        );
        render_labelled(
            &mut out,
            "tessera_http_refused_requests_total",
            "Requests refused with a 4xx status (HTTP and gRPC), by status and reason.",
            ["status", "reason"],
            &self.refused,
        );
        let gauge = |out: &mut String, name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        gauge(
            &mut out,
            "tessera_http_requests_in_flight",
            "gauge",
            "Generation requests being served.",
            self.in_flight.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "tessera_http_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            load(&self.prompt_tokens),
        );
        gauge(
            &mut out,
            "tessera_http_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            load(&self.cached_tokens),
        );
        gauge(
            &mut out,
            "tessera_http_generation_tokens_total",
            "counter",
            "Generated tokens.",
            load(&self.generation_tokens),
        );
        self.ttft.render(
            &mut out,
            "tessera_http_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
        );
        self.tpot.render(
            &mut out,
            "tessera_http_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
        );
        self.e2e.render(
            &mut out,
            "tessera_http_request_duration_seconds",
            "Time from request arrival to the last generated token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_secs(500));
        let text = m.render();
        assert!(text.contains("tessera_http_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("tessera_http_time_to_first_token_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("tessera_http_time_to_first_token_seconds_bucket{le=\"80\"} 2"));
        assert!(text.contains("tessera_http_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("tessera_http_time_to_first_token_seconds_count 3"));
        assert_eq!(m.ttft.count(), 3);
    }

    #[test]
    fn requests_are_labelled() {
        let m = Metrics::default();
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 200);
        m.count_request("/v1/completions", 400);
        let text = m.render();
        assert!(text.contains(
            "tessera_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2"
        ));
        assert_eq!(m.requests("/v1/completions", 400), 1);
    }

    #[test]
    fn refusals_are_labelled_by_status_and_reason() {
        let m = Metrics::default();
        m.count_refused(401, "invalid_api_key");
        m.count_refused(429, "rate_limit_exceeded");
        m.count_refused(429, "rate_limit_exceeded");
        let text = m.render();
        assert!(text.contains(
            "tessera_http_refused_requests_total{status=\"429\",reason=\"rate_limit_exceeded\"} 2"
        ));
        assert!(text.contains(
            "tessera_http_refused_requests_total{status=\"401\",reason=\"invalid_api_key\"} 1"
        ));
        assert_eq!(m.refused(429, "rate_limit_exceeded"), 2);
        assert_eq!(m.refused(400, "invalid_request"), 0);
    }
}
