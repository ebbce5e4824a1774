//! Placing a model on a device: the CPU always, a CUDA GPU when the build has the `cuda` feature
//! and the machine a GPU (the GPU forward itself is checked against the references by
//! `examples/cuda_model_check.rs` on the GPU machine), anything else refused with the reason.

use std::path::Path;

use tessera_engine::generate::prompt_logits;
use tessera_engine::Model;
use tessera_kernels::Device;

#[test]
fn a_model_runs_where_it_can_and_says_why_where_it_cannot() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kl_mixed");
    let mut model = Model::load(&dir).unwrap();
    assert_eq!(model.device(), Device::Cpu);
    let on_cpu = prompt_logits(&model, &[5, 17, 42]).unwrap();

    let err = model.to_device(Device::Hip(0)).unwrap_err().to_string();
    assert!(err.contains("hip"), "unhelpful: {err}");
    assert_eq!(
        model.device(),
        Device::Cpu,
        "a refused device changes nothing"
    );

    match model.to_device(Device::Cuda(0)) {
        Ok(()) => assert_eq!(model.device(), Device::Cuda(0)),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("--features cuda") || msg.contains("CUDA") || msg.contains("libcuda"),
                "unhelpful: {msg}"
            );
            assert_eq!(model.device(), Device::Cpu);
        }
    }
    model.to_device(Device::Cpu).unwrap();
    assert_eq!(model.device(), Device::Cpu);
    assert_eq!(prompt_logits(&model, &[5, 17, 42]).unwrap(), on_cpu);
}

/// On the CPU the page pool lives in host memory and steps gather and scatter state; the paged
/// forward, which reads state in place in a device arena, refuses a host arena with the reason
/// instead of reading host memory as device addresses.
#[test]
fn the_paged_forward_needs_a_device_arena() {
    use tessera_engine::kv::{KvArena, KvLayout, PagePool, StateDtypes};
    use tessera_engine::model::{LogitsWanted, PagedState};
    use tessera_engine::sampler::SampleDraw;
    use tessera_engine::serving::paged::{LayerSlots, PagedSeq, StepPages};

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kl_mixed");
    let model = Model::load(&dir).unwrap();
    assert!(!model.paged_on_device());
    let layout = KvLayout::plan(&model.config, 4, 1 << 20, StateDtypes::F32).unwrap();
    let arena = model.new_kv_arena(&layout).unwrap();
    assert!(arena.device().is_none() && arena.host().is_some());
    assert_eq!(arena.len_bytes(), layout.arena_bytes());

    let tokens: [&[u32]; 1] = [&[5, 17]];
    let state = PagedState {
        page_tokens: 4,
        layers: Vec::new(),
        kda: Vec::new(),
        start: vec![0],
        mla_pages: vec![Vec::new()],
    };
    // Tables of the wrong shape are refused first, naming what does not match.
    let err = model
        .forward_paged(&tokens, &[LogitsWanted::Last], &[], &state, &*arena)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tables"), "unhelpful: {err}");
    // Tables of the right shape over a host arena: refused for the arena.
    let slots = LayerSlots::new(&model.config, &layout);
    let mut pool = PagePool::new(layout).unwrap();
    let mut seq = PagedSeq::new(&slots);
    let r = seq.reserve(&slots, &mut pool, 2).unwrap();
    let mut pages = StepPages::new(&slots, &pool).unwrap();
    pages.push(&slots, &pool, &seq, &r).unwrap();
    let err = model
        .forward_paged(&tokens, &[LogitsWanted::Last], &[], pages.state(), &*arena)
        .unwrap_err()
        .to_string();
    assert!(err.contains("device memory"), "unhelpful: {err}");
    // Sampling on the device: one draw per segment, a segment asking for a token needs one, and
    // a draw out of range is refused before anything runs.
    let sampled = |wanted: LogitsWanted, draws: &[Option<SampleDraw>]| {
        model
            .forward_paged_sampled(&tokens, &[wanted], &[], pages.state(), &*arena, draws)
            .unwrap_err()
            .to_string()
    };
    let draw = SampleDraw {
        temperature: 0.7,
        top_k: 0,
        top_p: 1.0,
        uniform: 0.25,
    };
    let err = sampled(LogitsWanted::Last, &[]);
    assert!(err.contains("0 draws"), "unhelpful: {err}");
    let err = sampled(LogitsWanted::Last, &[None]);
    assert!(err.contains("no draw"), "unhelpful: {err}");
    let err = sampled(LogitsWanted::All, &[Some(draw)]);
    assert!(err.contains("last row"), "unhelpful: {err}");
    let err = sampled(
        LogitsWanted::Last,
        &[Some(SampleDraw {
            uniform: 1.0,
            ..draw
        })],
    );
    assert!(err.contains("out of range"), "unhelpful: {err}");
    let err = sampled(LogitsWanted::Last, &[Some(draw)]);
    assert!(err.contains("device memory"), "unhelpful: {err}");
    r.abandon(&mut pool);
}
