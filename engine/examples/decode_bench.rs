//! End-to-end decode throughput: `batch` sequences prefill a random prompt, then decode `steps`
//! tokens together (one forward call per step, greedy), on the device given. Prints decode
//! tokens/s per batch size; the same protocol as `benches/transformers_decode.py`, which times
//! `transformers`' `generate` on the same model.
//!
//! Three paths: `serving` drives the scheduler, as `tessera serve` does (state in the page pool,
//! in device memory on a GPU; decode steps replayed from CUDA graphs); `eager` is `serving` with
//! graphs off (every op launched from the host); `forward` calls `Model::forward` with caller-owned states (on a GPU
//! they cross to the device and back every call). All give the same greedy tokens.
//!
//! `decode_bench MODEL_DIR [DEVICE=cpu] [BATCHES=1,32] [PROMPT=128] [STEPS=32] [PATHS=serving,forward]`

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tessera_engine::model::{LogitsWanted, Segment};
use tessera_engine::rng::Rng;
use tessera_engine::serving::{EngineEvent, EngineRequest, EventSink, Scheduler, SchedulerConfig};
use tessera_engine::Model;

/// Prefill seconds, decode seconds, tokens per sequence.
type Run = (f64, f64, Vec<Vec<u32>>);

/// Collects one request's tokens.
struct Collect(Arc<Mutex<Vec<u32>>>);

impl EventSink for Collect {
    fn send(&mut self, event: EngineEvent) -> bool {
        if let EngineEvent::Token(t) = event {
            self.0.lock().unwrap().push(t);
        }
        true
    }
}

/// Decodes through the scheduler; returns (prefill s, decode s, tokens per request).
fn serving(
    model: &Model,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<Run, Box<dyn std::error::Error>> {
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let page_tokens = 64;
    let cfg = SchedulerConfig {
        page_tokens,
        snapshot_interval: 0,
        kv_memory_bytes: std::env::var("DECODE_BENCH_KV_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4 << 30),
        max_batch_tokens: (b * longest).max(page_tokens),
        max_running: b,
        prefix_cache: false,
    };
    let mut sched = Scheduler::new(model, cfg)?;
    let outs: Vec<_> = (0..b).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
    for (p, out) in prompts.iter().zip(&outs) {
        sched.submit(
            EngineRequest::new(p.clone(), steps + 1),
            Box::new(Collect(out.clone())),
        );
    }
    let count = |outs: &[Arc<Mutex<Vec<u32>>>]| -> usize {
        outs.iter().map(|o| o.lock().unwrap().len()).sum()
    };
    let t = Instant::now();
    while count(&outs) < b {
        sched.step(model)?;
    }
    let prefill_s = t.elapsed().as_secs_f64();
    if let Some(p) = model.take_device_profile() {
        println!("prefill {p}");
    }
    let t = Instant::now();
    while sched.has_work() {
        sched.step(model)?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    if let Some(p) = model.take_device_profile() {
        println!("{p}");
    }
    let tokens = outs.iter().map(|o| o.lock().unwrap().clone()).collect();
    Ok((prefill_s, decode_s, tokens))
}

/// Decodes with `Model::forward` over caller-owned states.
fn forward(
    model: &Model,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<Run, Box<dyn std::error::Error>> {
    let b = prompts.len();
    let mut states: Vec<_> = (0..b).map(|_| model.new_state()).collect();
    let t = Instant::now();
    let mut segs = Segment::batch(prompts, &mut states, LogitsWanted::Last);
    let mut next: Vec<u32> = model
        .forward(&mut segs)?
        .iter()
        .map(|l| argmax(l))
        .collect();
    let mut tokens: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let prefill_s = t.elapsed().as_secs_f64();
    if let Some(p) = model.take_device_profile() {
        println!("prefill {p}");
    }
    let t = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut segs = Segment::batch(&toks, &mut states, LogitsWanted::Last);
        next = model
            .forward(&mut segs)?
            .iter()
            .map(|l| argmax(l))
            .collect();
        for (out, &t) in tokens.iter_mut().zip(&next) {
            out.push(t);
        }
    }
    let decode_s = t.elapsed().as_secs_f64();
    if let Some(p) = model.take_device_profile() {
        println!("{p}");
    }
    Ok((prefill_s, decode_s, tokens))
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args
        .first()
        .ok_or("usage: decode_bench MODEL_DIR [DEVICE] [BATCHES] [PROMPT] [STEPS] [PATHS]")?;
    let device = tessera_kernels::parse_device(args.get(1).map_or("cpu", String::as_str))?;
    let batches: Vec<usize> = args
        .get(2)
        .map_or("1,32", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let prompt: usize = args.get(3).map_or(Ok(128), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
    let paths: Vec<String> = args
        .get(5)
        .map_or("serving,forward", String::as_str)
        .split(',')
        .map(str::to_owned)
        .collect();
    let t0 = Instant::now();
    let model = Model::load_on(std::path::Path::new(dir), device)?;
    println!(
        "decode_bench: {dir} on {device}, {:.1} M parameters, loaded in {:.1} s",
        model.parameter_count() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    let vocab = model.config.vocab_size as u64;
    let mut rng = Rng::new(7);
    for &b in &batches {
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|_| {
                (0..prompt)
                    .map(|_| (rng.next_u64() % vocab) as u32)
                    .collect()
            })
            .collect();
        let mut first: Option<Vec<Vec<u32>>> = None;
        for path in &paths {
            let (prefill_s, decode_s, tokens) = match path.as_str() {
                "serving" => serving(&model, &prompts, steps)?,
                "eager" => {
                    // The serving path with decode steps launched op by op, not replayed.
                    model.set_device_graphs(false);
                    let r = serving(&model, &prompts, steps);
                    model.set_device_graphs(true);
                    r?
                }
                "forward" => forward(&model, &prompts, steps)?,
                other => {
                    return Err(format!("unknown path `{other}` (serving, eager, forward)").into())
                }
            };
            let same = match &first {
                None => {
                    first = Some(tokens);
                    String::new()
                }
                Some(f) => {
                    let equal = f.iter().zip(&tokens).filter(|(a, b)| a == b).count();
                    format!(", greedy tokens equal to the first path's on {equal}/{b} sequences")
                }
            };
            println!(
                "batch {b:>3} {path:>7}: prefill {prompt} tokens x {b} in {:.1} ms; decode {steps} \
                 steps in {:.1} ms = {:.2} ms/step, {:.1} tokens/s{same}",
                prefill_s * 1e3,
                decode_s * 1e3,
                decode_s * 1e3 / steps as f64,
                (b * steps) as f64 / decode_s
            );
        }
        if let Some((captured, replayed)) = model.device_graph_counts() {
            println!("  decode graphs so far: {captured} captured, {replayed} replays");
        }
    }
    Ok(())
}
