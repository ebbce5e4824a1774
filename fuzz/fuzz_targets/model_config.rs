//! Arbitrary bytes as a checkpoint's `config.json`: parsed by the engine
//! ([`ModelConfig::from_json_str`]) and, when accepted, planned into the KV page pool the way
//! `tessera serve` does at start-up. An inconsistent config must be an error naming the field,
//! never a panic, an arithmetic overflow or a runaway allocation.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tessera_engine::kv::layout::{Field, KvLayout, StateDtypes};
use tessera_engine::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_json_str(text, Path::new("config.json")) else {
        return;
    };
    assert_eq!(cfg.attn.len(), cfg.num_layers());
    assert_eq!(cfg.ffn.len(), cfg.num_layers());
    for (page_tokens, budget, dtypes) in [
        (16, 512 << 20, StateDtypes::F32),
        (64, 64 << 20, StateDtypes::BF16),
    ] {
        let Ok(layout) = KvLayout::plan(&cfg, page_tokens, budget, dtypes) else {
            continue;
        };
        let _ = layout.report();
        assert!(layout.arena_bytes() <= budget, "{}", layout.report());
        for g in layout.group_ids() {
            for field in [Field::Latent, Field::Conv, Field::Recurrent] {
                let _ = layout.field_range(g, field);
            }
            let _ = layout.waste(g);
        }
        for layer in 0..cfg.num_layers() {
            assert!(layout.locate(layer).is_some(), "layer {layer} has no plane");
        }
    }
});
