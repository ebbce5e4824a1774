//! CPU forward-pass throughput: prefill and decode tokens/s at batch 1 and 8 for the `tiny` and
//! `small` presets. Run: `cargo bench --bench cpu_forward` (add `-- --quick` for a short run).
//! Results are recorded in `benches/RESULTS.md`.

use std::time::{Duration, Instant};

use tessera_engine::init_model::{write_model, Preset};
use tessera_engine::model::{LogitsWanted, Segment};
use tessera_engine::{Model, SequenceState};

fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729) % (vocab - 16)) as u32 + 3)
        .collect()
}

/// Runs `f` until `budget` is spent (at least once); returns seconds per run.
fn time_it(budget: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut runs = 0u32;
    while runs == 0 || start.elapsed() < budget {
        f();
        runs += 1;
    }
    start.elapsed().as_secs_f64() / runs as f64
}

fn prefill(model: &Model, batch: usize, len: usize, budget: Duration) -> f64 {
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(len, vocab, b)).collect();
    let secs = time_it(budget, || {
        let mut states: Vec<SequenceState> = (0..batch).map(|_| model.new_state()).collect();
        let mut segs = Segment::batch(&prompts, &mut states, LogitsWanted::Last);
        model.forward(&mut segs).unwrap();
    });
    (batch * len) as f64 / secs
}

fn decode(model: &Model, batch: usize, context: usize, steps: usize, budget: Duration) -> f64 {
    let vocab = model.config.vocab_size;
    let mut states: Vec<SequenceState> = (0..batch).map(|_| model.new_state()).collect();
    for (b, s) in states.iter_mut().enumerate() {
        model
            .forward_one(&prompt(context, vocab, b), s, LogitsWanted::None)
            .unwrap();
    }
    let base = states.clone();
    let secs = time_it(budget, || {
        let mut st = base.clone();
        for step in 0..steps {
            let toks: Vec<[u32; 1]> = (0..batch)
                .map(|b| [((step * 31 + b) % (vocab - 16)) as u32 + 3])
                .collect();
            let mut segs = Segment::batch(&toks, &mut st, LogitsWanted::Last);
            model.forward(&mut segs).unwrap();
        }
    });
    (batch * steps) as f64 / secs
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 300 } else { 3000 });
    let threads = rayon::current_num_threads();
    println!(
        "CPU forward throughput ({threads} threads), prompt 256 tokens, decode at context 256"
    );
    println!("| preset | params | prefill b=1 tok/s | prefill b=8 tok/s | decode b=1 tok/s | decode b=8 tok/s |");
    println!("|---|---|---|---|---|---|");
    for preset in [Preset::Tiny, Preset::Small] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), preset, 0).unwrap();
        let model = Model::load(dir.path()).unwrap();
        let params = model.parameter_count();
        let (len, steps) = (256, 16);
        let p1 = prefill(&model, 1, len, budget);
        let p8 = prefill(&model, 8, len, budget);
        let d1 = decode(&model, 1, len, steps, budget);
        let d8 = decode(&model, 8, len, steps, budget);
        println!(
            "| {preset:?} | {:.1} M | {p1:.0} | {p8:.0} | {d1:.1} | {d8:.1} |",
            params as f64 / 1e6
        );
    }

    // Decode as `tessera serve` runs it (batch-invariant kernels), against batch size.
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Preset::Small, 0).unwrap();
    let mut model = Model::load(dir.path()).unwrap();
    model.set_batch_invariant(true);
    println!();
    println!("Decode throughput vs batch size, `small` preset, serving kernels, context 128");
    println!("| batch | tokens/s | ms/step |");
    println!("|---|---|---|");
    for batch in [1, 2, 4, 8, 16, 32] {
        let tps = decode(&model, batch, 128, 8, budget);
        println!(
            "| {batch} | {tps:.1} | {:.1} |",
            1000.0 * batch as f64 / tps
        );
    }
}
