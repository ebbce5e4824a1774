//! `tessera bench`: a load generator for the OpenAI completions API of a running router or
//! `tessera serve`. Token-id prompts of random lengths, greedy decoding with `ignore_eos` so each
//! request produces the output length asked for; TTFT, TPOT and end-to-end latency per request,
//! percentiles and throughput at the end, optional JSON with every request and a PNG plot. The
//! client is in `bench_http`, the plot in `bench_plot`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use serde_json::json;

use super::bench_http::{first_model, parse_url, send, Outcome, Target};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Base URL of the server (plain HTTP); requests go to `<url>/v1/completions` only.
    #[arg(
        long,
        default_value = "http://127.0.0.1:8000",
        env = "TESSERA_BENCH_URL"
    )]
    pub url: String,
    /// Requests in flight at once (closed loop). The default when --request-rate is not given: 8.
    #[arg(
        long,
        env = "TESSERA_BENCH_CONCURRENCY",
        conflicts_with = "request_rate"
    )]
    pub concurrency: Option<usize>,
    /// Requests started per second on average (open loop, Poisson arrivals).
    #[arg(long, env = "TESSERA_BENCH_REQUEST_RATE")]
    pub request_rate: Option<f64>,
    /// Requests to send in all. The default when --duration is not given: 100.
    #[arg(long, env = "TESSERA_BENCH_REQUESTS", conflicts_with = "duration")]
    pub requests: Option<usize>,
    /// Seconds to keep starting requests; those in flight then finish (or hit --timeout).
    #[arg(long, env = "TESSERA_BENCH_DURATION")]
    pub duration: Option<f64>,
    /// Prompt length in tokens: MEAN or MEAN:STDDEV (normal, at least 1).
    #[arg(long, default_value = "128", env = "TESSERA_BENCH_PROMPT_TOKENS", value_parser = parse_dist)]
    pub prompt_tokens: Dist,
    /// Output length in tokens: MEAN or MEAN:STDDEV (normal, at least 1).
    #[arg(long, default_value = "64", env = "TESSERA_BENCH_MAX_TOKENS", value_parser = parse_dist)]
    pub max_tokens: Dist,
    /// Stream responses (SSE); TTFT is then the arrival of the first token. Without it TTFT is
    /// the full latency and TPOT is not reported.
    #[arg(long, env = "TESSERA_BENCH_STREAM")]
    pub stream: bool,
    /// Sent as `Authorization: Bearer <key>`.
    #[arg(long, env = "TESSERA_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// Model name to send (default: the first model `/v1/models` lists).
    #[arg(long, env = "TESSERA_BENCH_MODEL")]
    pub model: Option<String>,
    /// Prompt token ids are drawn from [1, VOCAB); keep it at or below the model's vocabulary.
    #[arg(long, default_value_t = 256, env = "TESSERA_BENCH_VOCAB")]
    pub vocab: u32,
    /// Seed of prompt lengths, prompt ids, output lengths and arrival times.
    #[arg(long, default_value_t = 0, env = "TESSERA_BENCH_SEED")]
    pub seed: u64,
    /// Seconds one request may take before it counts as an error.
    #[arg(long, default_value_t = 600.0, env = "TESSERA_BENCH_TIMEOUT")]
    pub timeout: f64,
    /// Seconds between progress lines on stderr.
    #[arg(long, default_value_t = 5.0, env = "TESSERA_BENCH_PROGRESS_INTERVAL")]
    pub progress_interval: f64,
    /// Write the summary and every request's record as JSON.
    #[arg(long, env = "TESSERA_BENCH_JSON_OUT")]
    pub json_out: Option<PathBuf>,
    /// Write a PNG (800x500): each successful request's TTFT (blue) and end-to-end latency (red)
    /// against its start time; axes start at zero, ten ticks each up to the largest value.
    #[arg(long, env = "TESSERA_BENCH_PLOT_OUT")]
    pub plot_out: Option<PathBuf>,
}

/// A length distribution: normal with `mean` and `stddev`, rounded, at least 1.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Dist {
    pub mean: f64,
    pub stddev: f64,
}

fn parse_dist(s: &str) -> Result<Dist, String> {
    let (m, sd) = match s.split_once(':') {
        Some((m, sd)) => (m, Some(sd)),
        None => (s, None),
    };
    let mean: f64 = m
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: expected MEAN or MEAN:STDDEV"))?;
    let stddev: f64 = match sd {
        Some(sd) => sd
            .trim()
            .parse()
            .map_err(|_| format!("`{s}`: expected MEAN or MEAN:STDDEV"))?,
        None => 0.0,
    };
    let valid = mean >= 1.0 && mean.is_finite() && stddev >= 0.0 && stddev.is_finite();
    if !valid {
        return Err(format!("`{s}`: need MEAN >= 1 and STDDEV >= 0"));
    }
    Ok(Dist { mean, stddev })
}

/// SplitMix64: small, fast and deterministic by seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    fn draw(&mut self, d: Dist) -> usize {
        let x = d.mean + d.stddev * self.normal();
        x.round().max(1.0) as usize
    }
}

/// Request `index`'s prompt and output length; the same for the same seed whatever the timing.
fn request_spec(a: &BenchArgs, index: u64) -> (Vec<u32>, usize) {
    let mut rng = Rng::new(a.seed, index + 1);
    let len = rng.draw(a.prompt_tokens);
    let max_tokens = rng.draw(a.max_tokens);
    let span = u64::from(a.vocab.max(2) - 1);
    let ids = (0..len)
        .map(|_| 1 + (rng.next_u64() % span) as u32)
        .collect();
    (ids, max_tokens)
}

/// What one request produced.
#[derive(Clone, Debug, Serialize)]
struct Record {
    index: u64,
    /// Seconds after the benchmark started.
    start_s: f64,
    prompt_tokens: usize,
    max_tokens: usize,
    /// HTTP status; 0 when no response came (connection refused, timeout, broken stream).
    status: u16,
    ok: bool,
    error: Option<String>,
    output_tokens: usize,
    ttft_ms: Option<f64>,
    tpot_ms: Option<f64>,
    e2e_ms: Option<f64>,
}

/// Mean and percentiles of one metric, in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
struct Stats {
    count: usize,
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// Linear interpolation between closest ranks; monotone in `q`.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn stats(mut v: Vec<f64>) -> Stats {
    if v.is_empty() {
        return Stats::default();
    }
    v.sort_by(f64::total_cmp);
    Stats {
        count: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: percentile(&v, 0.5),
        p90: percentile(&v, 0.9),
        p99: percentile(&v, 0.99),
        max: v[v.len() - 1],
    }
}

#[derive(Debug, Serialize)]
struct Summary {
    url: String,
    model: String,
    mode: String,
    stream: bool,
    seed: u64,
    prompt_tokens: Dist,
    max_tokens: Dist,
    requests: usize,
    successes: usize,
    errors: usize,
    errors_by_status: BTreeMap<String, usize>,
    duration_s: f64,
    request_throughput: f64,
    output_token_throughput: f64,
    total_output_tokens: usize,
    total_prompt_tokens: usize,
    ttft_ms: Stats,
    tpot_ms: Stats,
    e2e_ms: Stats,
}

fn summarize(a: &BenchArgs, model: &str, mode: String, recs: &[Record], wall: f64) -> Summary {
    let ok: Vec<&Record> = recs.iter().filter(|r| r.ok).collect();
    let mut by_status = BTreeMap::new();
    for r in recs.iter().filter(|r| !r.ok) {
        let key = if r.status == 0 {
            "no_response".to_string()
        } else {
            r.status.to_string()
        };
        *by_status.entry(key).or_insert(0) += 1;
    }
    let out_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let wall = wall.max(1e-9);
    Summary {
        url: a.url.clone(),
        model: model.to_string(),
        mode,
        stream: a.stream,
        seed: a.seed,
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        requests: recs.len(),
        successes: ok.len(),
        errors: recs.len() - ok.len(),
        errors_by_status: by_status,
        duration_s: wall,
        request_throughput: ok.len() as f64 / wall,
        output_token_throughput: out_tokens as f64 / wall,
        total_output_tokens: out_tokens,
        total_prompt_tokens: ok.iter().map(|r| r.prompt_tokens).sum(),
        ttft_ms: stats(ok.iter().filter_map(|r| r.ttft_ms).collect()),
        tpot_ms: stats(ok.iter().filter_map(|r| r.tpot_ms).collect()),
        e2e_ms: stats(ok.iter().filter_map(|r| r.e2e_ms).collect()),
    }
}

fn print_table(s: &Summary) {
    println!();
    println!("tessera bench: {} ({}, {})", s.url, s.model, s.mode);
    println!(
        "requests {}  ok {}  errors {}  duration {:.2} s",
        s.requests, s.successes, s.errors, s.duration_s
    );
    for (status, n) in &s.errors_by_status {
        println!("  errors with status {status}: {n}");
    }
    println!(
        "throughput {:.2} req/s, {:.1} output tok/s ({} output tokens)",
        s.request_throughput, s.output_token_throughput, s.total_output_tokens
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "metric", "mean", "p50", "p90", "p99", "max"
    );
    for (name, st) in [
        ("TTFT ms", &s.ttft_ms),
        ("TPOT ms", &s.tpot_ms),
        ("E2E ms", &s.e2e_ms),
    ] {
        println!(
            "{:<10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            name, st.mean, st.p50, st.p90, st.p99, st.max
        );
    }
}

/// Shared state of the running benchmark.
struct Run {
    args: BenchArgs,
    target: Target,
    model: String,
    start: Instant,
    deadline: Option<Instant>,
    total: Option<usize>,
    next: AtomicU64,
    done: AtomicUsize,
    failed: AtomicUsize,
    records: Mutex<Vec<Record>>,
}

impl Run {
    /// The next request index, or None once the count or the duration is reached.
    fn claim(&self) -> Option<u64> {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match self.total {
            Some(t) if i >= t as u64 => None,
            _ => Some(i),
        }
    }

    async fn one(&self, index: u64) {
        let (prompt, max_tokens) = request_spec(&self.args, index);
        let mut body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": self.args.stream,
        });
        if self.args.stream {
            body["stream_options"] = json!({"include_usage": true});
            body["return_token_ids"] = json!(true);
        }
        let body = body.to_string().into_bytes();
        let t0 = Instant::now();
        let timeout = Duration::from_secs_f64(self.args.timeout);
        let fut = send(
            &self.target,
            self.args.api_key.as_deref(),
            &body,
            self.args.stream,
        );
        let o = match tokio::time::timeout(timeout, fut).await {
            Ok(o) => o,
            Err(_) => Outcome {
                status: 0,
                error: Some(format!("timed out after {:.0} s", self.args.timeout)),
                output_tokens: 0,
                first_token: None,
            },
        };
        let end = Instant::now();
        let ok = o.error.is_none();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (ttft, tpot, e2e) = if ok {
            let first = o.first_token.unwrap_or(end).min(end);
            // Without streaming the tokens arrive together: no per-token time to report.
            let tpot = (self.args.stream && o.output_tokens > 1)
                .then(|| ms(end - first) / (o.output_tokens - 1) as f64);
            (Some(ms(first - t0)), tpot, Some(ms(end - t0)))
        } else {
            (None, None, None)
        };
        let rec = Record {
            index,
            start_s: (t0 - self.start).as_secs_f64(),
            prompt_tokens: prompt.len(),
            max_tokens,
            status: o.status,
            ok,
            error: o.error,
            output_tokens: o.output_tokens,
            ttft_ms: ttft,
            tpot_ms: tpot,
            e2e_ms: e2e,
        };
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.done.fetch_add(1, Ordering::Relaxed);
        self.records.lock().unwrap().push(rec);
    }
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let target = parse_url(&a.url)?;
    if a.concurrency == Some(0) {
        bail!("--concurrency must be at least 1");
    }
    if a.request_rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--request-rate must be positive");
    }
    if a.duration.is_some_and(|d| !(d > 0.0 && d.is_finite())) {
        bail!("--duration must be positive");
    }
    if !(a.timeout > 0.0 && a.timeout.is_finite()) {
        bail!("--timeout must be positive");
    }
    let total = match (a.requests, a.duration) {
        (Some(n), _) => Some(n),
        (None, None) => Some(100),
        (None, Some(_)) => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let model = match a.model.clone() {
            Some(m) => m,
            None => first_model(&target, a.api_key.as_deref())
                .await
                .with_context(|| format!("cannot query {}/v1/models", a.url))?,
        };
        let mode = match a.request_rate {
            Some(r) => format!("request rate {r}/s"),
            None => format!("concurrency {}", a.concurrency.unwrap_or(8)),
        };
        let start = Instant::now();
        let run = Arc::new(Run {
            deadline: a.duration.map(|d| start + Duration::from_secs_f64(d)),
            total,
            target,
            model,
            start,
            next: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            records: Mutex::new(Vec::new()),
            args: a,
        });
        eprintln!(
            "tessera bench: {} requests to {} ({})",
            run.total
                .map_or_else(|| "timed".to_string(), |n| n.to_string()),
            run.args.url,
            mode
        );
        let progress = {
            let run = run.clone();
            let every = Duration::from_secs_f64(run.args.progress_interval.max(0.1));
            tokio::spawn(async move {
                let mut last = (Instant::now(), 0usize);
                loop {
                    tokio::time::sleep(every).await;
                    let now = Instant::now();
                    let done = run.done.load(Ordering::Relaxed);
                    let rate = (done - last.1) as f64 / (now - last.0).as_secs_f64();
                    last = (now, done);
                    eprintln!(
                        "[{:>7.1} s] done {done}{}, errors {}, {rate:.2} req/s",
                        (now - run.start).as_secs_f64(),
                        run.total.map_or(String::new(), |t| format!("/{t}")),
                        run.failed.load(Ordering::Relaxed),
                    );
                }
            })
        };
        let mut tasks = Vec::new();
        match run.args.request_rate {
            Some(rate) => {
                let mut rng = Rng::new(run.args.seed, u64::MAX);
                let mut at = Instant::now();
                while let Some(i) = run.claim() {
                    let r = run.clone();
                    tasks.push(tokio::spawn(async move { r.one(i).await }));
                    at += Duration::from_secs_f64(-rng.unit().ln() / rate);
                    let last = run.total.is_some_and(|t| i + 1 >= t as u64);
                    if last || run.deadline.is_some_and(|d| at >= d) {
                        break;
                    }
                    tokio::time::sleep_until(at.into()).await;
                }
            }
            None => {
                for _ in 0..run.args.concurrency.unwrap_or(8) {
                    let r = run.clone();
                    tasks.push(tokio::spawn(async move {
                        while let Some(i) = r.claim() {
                            r.one(i).await;
                        }
                    }));
                }
            }
        }
        for t in tasks {
            t.await.context("request task")?;
        }
        progress.abort();
        let wall = run.start.elapsed().as_secs_f64();
        let mut recs = std::mem::take(&mut *run.records.lock().unwrap());
        recs.sort_by_key(|r| r.index);
        let summary = summarize(&run.args, &run.model, mode, &recs, wall);
        print_table(&summary);
        if let Some(path) = &run.args.json_out {
            let doc = json!({"summary": summary, "requests": recs});
            std::fs::write(path, serde_json::to_string_pretty(&doc)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &run.args.plot_out {
            let points: Vec<_> = recs
                .iter()
                .filter_map(|r| Some((r.start_s, r.ttft_ms?, r.e2e_ms?)))
                .collect();
            super::bench_plot::write(path, &points)
                .with_context(|| format!("writing {}", path.display()))?;
            let (t_max, l_max) = super::bench_plot::extent(&points);
            println!(
                "plot {}: x 0..{t_max:.2} s (start), y 0..{l_max:.1} ms, ticks at tenths; \
                 blue TTFT, red E2E",
                path.display()
            );
        }
        if summary.errors > 0 {
            let first = recs
                .iter()
                .find_map(|r| r.error.clone())
                .unwrap_or_default();
            bail!(
                "{} of {} requests failed (first error: {first})",
                summary.errors,
                summary.requests
            );
        }
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_ordered_and_exact_at_the_ends() {
        let s = stats((1..=100).rev().map(f64::from).collect());
        assert_eq!(s.count, 100);
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.max);
        assert_eq!(s.max, 100.0);
        assert!((s.mean - 50.5).abs() < 1e-9);
    }

    #[test]
    fn distributions_parse() {
        let d = parse_dist("16:4").unwrap();
        assert_eq!((d.mean, d.stddev), (16.0, 4.0));
        assert!(parse_dist("0").is_err());
        assert!(parse_dist("x").is_err());
    }
}
