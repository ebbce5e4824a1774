//! End-to-end decode throughput of the engine's forward pass: `batch` sequences prefill a random
//! prompt, then decode `steps` tokens together (one forward call per step, greedy), on the device
//! given. Prints decode tokens/s per batch size; the same protocol as
//! `benches/transformers_decode.py`, which times `transformers`' `generate` on the same model.
//!
//! `decode_bench MODEL_DIR [DEVICE=cpu] [BATCHES=1,32] [PROMPT=128] [STEPS=32]`

use std::time::Instant;

use tessera_engine::model::{LogitsWanted, Segment};
use tessera_engine::rng::Rng;
use tessera_engine::Model;

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
        .ok_or("usage: decode_bench MODEL_DIR [DEVICE] [BATCHES] [PROMPT] [STEPS]")?;
    let device = tessera_kernels::parse_device(args.get(1).map_or("cpu", String::as_str))?;
    let batches: Vec<usize> = args
        .get(2)
        .map_or("1,32", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let prompt: usize = args.get(3).map_or(Ok(128), |s| s.parse())?;
    let steps: usize = args.get(4).map_or(Ok(32), |s| s.parse())?;
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
        let mut states: Vec<_> = (0..b).map(|_| model.new_state()).collect();
        let t = Instant::now();
        let mut segs: Vec<Segment> = prompts
            .iter()
            .zip(states.iter_mut())
            .map(|(p, s)| Segment {
                tokens: p,
                state: s,
                logits: LogitsWanted::Last,
            })
            .collect();
        let mut next: Vec<u32> = model
            .forward(&mut segs)?
            .iter()
            .map(|l| argmax(l))
            .collect();
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..steps {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut segs: Vec<Segment> = toks
                .iter()
                .zip(states.iter_mut())
                .map(|(t, s)| Segment {
                    tokens: t,
                    state: s,
                    logits: LogitsWanted::Last,
                })
                .collect();
            next = model
                .forward(&mut segs)?
                .iter()
                .map(|l| argmax(l))
                .collect();
        }
        let decode_s = t.elapsed().as_secs_f64();
        println!(
            "batch {b:>3}: prefill {prompt} tokens x {b} in {:.1} ms; decode {steps} steps in \
             {:.1} ms = {:.2} ms/step, {:.1} tokens/s",
            prefill_s * 1e3,
            decode_s * 1e3,
            decode_s * 1e3 / steps as f64,
            (b * steps) as f64 / decode_s
        );
    }
    Ok(())
}
