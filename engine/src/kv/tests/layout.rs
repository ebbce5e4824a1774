//! Layout arithmetic against hand-computed numbers (K3-SPEC §5, Kimi Linear, corner cases).

use crate::config::{AttnKind, ModelConfig};
use crate::kv::layout::*;
use crate::kv::{GroupId, KvError, PageId, Plane};
use AttnKind::{Kda as K, Mla as M};

/// K3 (93 layers: 69 KDA, 24 MLA) per TP8 rank: 96/8 = 12 KDA heads of 128, latent 576.
fn k3_tp8() -> (Vec<AttnKind>, KvDims) {
    let mut attn: Vec<AttnKind> = (0..92).map(|i| if i % 4 == 3 { M } else { K }).collect();
    attn.push(M);
    let dims = KvDims {
        kda_heads: 12,
        kda_head_dim: 128,
        conv_kernel: 4,
        latent_dim: 576,
    };
    (attn, dims)
}

#[test]
fn k3_tp8_matches_tokenspeed_with_twelve_mla_pages() {
    let (attn, dims) = k3_tp8();
    assert_eq!(attn.iter().filter(|k| **k == M).count(), 24);
    assert_eq!(dims.conv_elems() * 2, 221_184 / 8); // K3-SPEC §4: 221,184/t B per layer
    let l = KvLayout::plan_layers(&attn, dims, 128, 80 << 30, StateDtypes::BF16, Some(12)).unwrap();
    assert_eq!(l.groups().len(), 4);
    assert_eq!(l.planes(), 24);
    let mla = l.group(GroupId(0)).unwrap();
    assert_eq!(
        (mla.kind, mla.layers.len(), mla.pages_per_parent),
        (GroupKind::Mla, 24, 12)
    );
    assert_eq!(mla.page_stride, 147_456);
    assert_eq!(l.tokens_per_mla_parent(), 1536);
    for g in l.kda_groups() {
        let g = l.group(g).unwrap();
        assert_eq!(
            (g.layers.len(), g.pages_per_parent, g.page_payload),
            (23, 2, 814_080)
        );
    }
    assert_eq!(l.plane_bytes(), 1_769_472);
    assert_eq!(l.parent_bytes(), 42_467_328);
    assert_eq!(l.parent_bytes() / 12, 3_538_944); // one 128-token MLA block, all 24 layers
    assert_eq!(l.parents(), (80usize << 30) / 42_467_328 - 1);
    assert_eq!(l.waste(GroupId(0)).unwrap(), 0.0);
    let w = l.waste(GroupId(1)).unwrap();
    assert!(
        (w - (1.0 - 23.0 * 1_628_160.0 / 42_467_328.0)).abs() < 1e-12,
        "{w}"
    );
    assert_eq!(l.max_page_id().0 as usize, l.parents() * 12);
    println!("{}", l.report());
    // The default rule picks the smallest dense parent instead: 6 pages, one snapshot.
    let d = KvLayout::plan_layers(&attn, dims, 128, 80 << 30, StateDtypes::BF16, None).unwrap();
    assert_eq!(
        (
            d.group(GroupId(0)).unwrap().pages_per_parent,
            d.group(GroupId(1)).unwrap().pages_per_parent
        ),
        (6, 1)
    );
    assert_eq!(d.plane_bytes(), 884_736);
    // TP1 cannot fit a 6.5 MB state into a 12-page plane (K3-SPEC §5: "layout rejected").
    let tp1 = KvDims {
        kda_heads: 96,
        ..dims
    };
    assert!(KvLayout::plan_layers(&attn, tp1, 128, 80 << 30, StateDtypes::BF16, Some(12)).is_err());
}

/// The published K3 config.json (K3-SPEC §1), committed as a fixture.
const K3_CONFIG: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/k3_published/config.json"
));

/// Issue #7 item 6: the real K3 config through the config parser and the layout planner, per TP8
/// rank, reproduces TokenSpeed's arithmetic (K3-SPEC §5): 128-token pages, 12 per MLA parent
/// (1536 tokens), 2 bf16 state snapshots per parent, 42,467,328 B per parent.
#[test]
fn k3_published_config_at_tp8_reproduces_tokenspeed() {
    let cfg = ModelConfig::from_json_str(K3_CONFIG, std::path::Path::new("config.json")).unwrap();
    assert_eq!(cfg.model_type, "kimi_k3");
    let dims = KvDims::for_tensor_parallel(&cfg, 8).unwrap();
    assert_eq!(
        dims,
        KvDims {
            kda_heads: 12,
            kda_head_dim: 128,
            conv_kernel: 4,
            latent_dim: 576,
        }
    );
    let budget = 120usize << 30;
    let l =
        KvLayout::plan_layers(&cfg.attn, dims, 128, budget, StateDtypes::BF16, Some(12)).unwrap();

    // Groups: the 24 MLA layers, then 3 KDA groups of 23 layers in layer order; 24 planes.
    assert_eq!(l.planes(), 24);
    assert_eq!(l.groups().len(), 4);
    let mla = l.group(GroupId(0)).unwrap();
    assert_eq!(mla.kind, GroupKind::Mla);
    let mut want_mla: Vec<usize> = (0..23).map(|i| 4 * i + 3).collect();
    want_mla.push(92);
    assert_eq!(mla.layers, want_mla);
    let kda_layers: Vec<usize> = (0..93).filter(|l| !want_mla.contains(l)).collect();
    for (i, g) in l.kda_groups().into_iter().enumerate() {
        let g = l.group(g).unwrap();
        assert_eq!(g.layers, kda_layers[23 * i..23 * (i + 1)]);
        // Per layer per rank: conv 221,184/8 B (bf16) + recurrent 6,291,456/8 B (f32).
        assert_eq!(g.page_payload, 221_184 / 8 + 6_291_456 / 8);
        assert_eq!(g.page_payload, 814_080);
        assert_eq!(g.pages_per_parent, 2, "2 state snapshots per parent");
        assert_eq!(g.layers.len() * g.page_payload, 18_723_840); // one snapshot, 23 layers
    }
    assert_eq!(3 * 23 * 814_080, 56_171_520); // all 69 KDA layers of one request
    assert_eq!(l.locate(92), Some((GroupId(0), Plane(23))));
    assert_eq!(l.locate(90), Some((GroupId(3), Plane(22))));

    // MLA: 128-token pages of 576 bf16 elements; 12 pages = 1536 tokens per parent.
    assert_eq!(l.page_tokens, 128);
    assert_eq!(mla.pages_per_parent, 12);
    assert_eq!(l.tokens_per_mla_parent(), 1536);
    assert_eq!(mla.page_stride, 128 * 576 * 2);
    let (off, bytes) = l.field_range(GroupId(0), Field::Latent).unwrap();
    assert_eq!((off, bytes), (0, 147_456));
    assert_eq!(l.plane_bytes(), 1_769_472);
    assert_eq!(l.parent_bytes(), 42_467_328);
    assert_eq!(l.parent_bytes() / 12, 3_538_944); // one 128-token block, all 24 MLA layers
    assert_eq!(l.max_pages_per_parent(), 12);
    assert_eq!(l.parents(), budget / 42_467_328 - 1);
    // A TP8 P→D transfer of an 8K prompt: 64 MLA blocks + one snapshot of every KDA layer.
    assert_eq!(64 * 3_538_944 + 56_171_520, 282_663_936);

    // The other rows of K3-SPEC §5's table, through the same code.
    let fp8 = StateDtypes {
        latent_bytes: 1,
        ..StateDtypes::BF16
    };
    let plan = |tp: usize, dt: StateDtypes| {
        let dims = KvDims::for_tensor_parallel(&cfg, tp).unwrap();
        KvLayout::plan_layers(&cfg.attn, dims, 128, budget, dt, Some(12))
    };
    let k = |l: &KvLayout| l.group(GroupId(1)).unwrap().pages_per_parent;
    let tp8_fp8 = plan(8, fp8).unwrap();
    assert_eq!((k(&tp8_fp8), tp8_fp8.parent_bytes()), (1, 21_233_664));
    let tp16 = (plan(16, StateDtypes::BF16).unwrap(), plan(16, fp8).unwrap());
    assert_eq!((k(&tp16.0), k(&tp16.1)), (4, 2));
    assert_eq!(k(&plan(4, StateDtypes::BF16).unwrap()), 1);
    assert!(plan(4, fp8).is_err(), "TP4 fp8: no snapshot fits a plane");
    assert!(plan(1, StateDtypes::BF16).is_err(), "TP1: layout rejected");
    let err = KvDims::for_tensor_parallel(&cfg, 5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tensor-parallel degree 5"), "{err}");
    assert!(KvDims::for_tensor_parallel(&cfg, 0).is_err());
}

#[test]
fn kimi_linear_48b_from_its_published_config() {
    let text = r#"{"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2304,
        "intermediate_size": 9216, "kv_lora_rank": 512,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
            "kda_layers": [1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26],
            "num_heads": 32, "short_conv_kernel_size": 4},
        "mla_use_nope": true, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
        "moe_renormalize": true, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256,
        "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
        "num_shared_experts": 1, "q_lora_rank": null, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446,
        "tie_word_embeddings": false, "topk_group": 1, "use_grouped_topk": true,
        "v_head_dim": 128, "vocab_size": 163840}"#;
    let cfg = ModelConfig::from_json_str(text, std::path::Path::new("config.json")).unwrap();
    let l = KvLayout::plan(&cfg, 64, 8 << 30, StateDtypes::F32).unwrap();
    // 7 MLA layers, G = ceil(20/7) = 3 KDA groups of ceil(20/3) = 7 → 7, 7, 6; S = 7.
    assert_eq!(l.planes(), 7);
    let sizes: Vec<usize> = l.groups().iter().map(|g| g.layers.len()).collect();
    assert_eq!(sizes, vec![7, 7, 7, 6]);
    assert_eq!(
        l.group(GroupId(0)).unwrap().layers,
        vec![3, 7, 11, 15, 19, 23, 26]
    );
    assert_eq!(
        l.group(GroupId(3)).unwrap().layers,
        vec![18, 20, 21, 22, 24, 25]
    );
    assert_eq!(l.locate(26), Some((GroupId(0), Plane(6))));
    assert_eq!(l.locate(0), Some((GroupId(1), Plane(0))));
    // MLA page 64·576·4 = 147,456 B; snapshot 147,456 + 2,097,152 = 2,244,608 B; 16 pages hold
    // one with 4.9% slack: 1024 tokens per MLA parent.
    assert_eq!(l.group(GroupId(0)).unwrap().page_stride, 147_456);
    assert_eq!(l.group(GroupId(1)).unwrap().page_payload, 2_244_608);
    assert_eq!(l.group(GroupId(0)).unwrap().pages_per_parent, 16);
    assert_eq!(l.tokens_per_mla_parent(), 1024);
    assert_eq!(l.plane_bytes(), 2_359_296);
    assert_eq!(l.group(GroupId(1)).unwrap().pages_per_parent, 1);
    assert_eq!(l.parents(), (8usize << 30) / (7 * 2_359_296) - 1);
    assert!(l.arena_bytes() <= 8 << 30);
    assert!(l.report().contains("7 planes"), "{}", l.report());
    println!("{}", l.report());
}

#[test]
fn all_kda_and_all_mla() {
    let dims = KvDims {
        kda_heads: 2,
        kda_head_dim: 4,
        conv_kernel: 4,
        latent_dim: 8,
    };
    let l = KvLayout::plan_layers(&[K; 5], dims, 16, 1 << 20, StateDtypes::F32, None).unwrap();
    assert_eq!((l.groups().len(), l.planes(), l.mla_group()), (1, 5, None));
    // conv 3·8·3·4 = 288 B, recurrent 2·4·4·4 = 128 B: one snapshot per 416 B plane.
    assert_eq!(
        (
            l.plane_bytes(),
            l.group(GroupId(0)).unwrap().pages_per_parent
        ),
        (416, 1)
    );
    assert_eq!(l.tokens_per_mla_parent(), 0);
    assert!(KvLayout::plan_layers(&[K; 5], dims, 16, 1 << 20, StateDtypes::F32, Some(2)).is_err());

    let l = KvLayout::plan_layers(&[M; 3], dims, 16, 1 << 20, StateDtypes::F32, None).unwrap();
    assert_eq!(
        (l.groups().len(), l.planes(), l.plane_bytes()),
        (1, 3, 16 * 8 * 4)
    );
    assert_eq!(l.group(GroupId(0)).unwrap().pages_per_parent, 1);
    assert_eq!(l.waste(GroupId(0)).unwrap(), 0.0);
    assert!(l.kda_groups().is_empty());
}

#[test]
fn three_to_one_hybrid_and_its_waste() {
    // KKKM KKKM KKM: 3 MLA, 8 KDA → G = 3 groups of 3, 3, 2; S = 3.
    let attn = [K, K, K, M, K, K, K, M, K, K, M];
    let dims = KvDims {
        kda_heads: 1,
        kda_head_dim: 4,
        conv_kernel: 2,
        latent_dim: 6,
    };
    let l = KvLayout::plan_layers(&attn, dims, 4, 1 << 16, StateDtypes::F32, None).unwrap();
    let sizes: Vec<usize> = l.groups().iter().map(|g| g.layers.len()).collect();
    assert_eq!((sizes, l.planes()), (vec![3, 3, 3, 2], 3));
    // MLA page 4·6·4 = 96 B; snapshot conv 48 + recurrent 64 = 112 B → 2 pages (192 B) hold one
    // with 80 B (42%) slack, 3 pages (288 B) hold two with 64 B (22%): K_mla = 3.
    assert_eq!(l.group(GroupId(0)).unwrap().pages_per_parent, 3);
    assert_eq!(l.group(GroupId(1)).unwrap().pages_per_parent, 2);
    assert_eq!(l.plane_bytes(), 288);
    let w3 = l.waste(GroupId(1)).unwrap();
    let w2 = l.waste(GroupId(3)).unwrap();
    assert!((w3 - 64.0 / 288.0).abs() < 1e-12);
    assert!((w2 - (1.0 - 2.0 * 224.0 / 864.0)).abs() < 1e-12);
    assert_eq!(l.parents(), (1 << 16) / 864 - 1);
}

#[test]
fn page_ids_round_trip_and_offsets_stay_in_their_parent() {
    let attn = [K, K, K, M, K, K, K, M, K, K, M];
    let dims = KvDims {
        kda_heads: 1,
        kda_head_dim: 4,
        conv_kernel: 2,
        latent_dim: 6,
    };
    let l = KvLayout::plan_layers(&attn, dims, 4, 1 << 14, StateDtypes::F32, None).unwrap();
    let kmax = l.max_pages_per_parent();
    for id in 1..=l.max_page_id().0 {
        let (p, s) = l.parent_slot(PageId(id)).unwrap();
        assert_eq!(l.page_id(p, s).unwrap(), PageId(id));
        assert_eq!(id as usize, 1 + (p - 1) * kmax + s);
    }
    assert_eq!(l.parent_slot(PageId::NULL), Err(KvError::NullPage));
    assert!(l.parent_slot(PageId(l.max_page_id().0 + 1)).is_err());
    assert!(l.page_id(0, 0).is_err());
    for g in l.group_ids() {
        let gl = l.group(g).unwrap();
        for p in 1..=l.parents() {
            for s in 0..gl.pages_per_parent {
                let id = l.page_id(p, s).unwrap();
                for k in 0..gl.layers.len() {
                    let off = l.page_offset(Plane(k as u16), g, id).unwrap();
                    let parent_start = (k * (l.parents() + 1) + p) * l.plane_bytes();
                    assert!(
                        off >= parent_start
                            && off + gl.page_stride <= parent_start + l.plane_bytes()
                    );
                    assert_eq!(off % FIELD_ALIGN, 0);
                }
            }
            // A slot the group does not have is no page of it.
            let bad = PageId((1 + (p - 1) * kmax + gl.pages_per_parent) as u32);
            if gl.pages_per_parent < kmax {
                assert!(l.page_offset(Plane(0), g, bad).is_err());
            }
        }
        assert!(l
            .page_offset(Plane(gl.layers.len() as u16), g, PageId(1))
            .is_err());
    }
    assert!(l
        .byte_offset(Plane(0), GroupId(0), PageId(1), Field::Conv)
        .is_err());
}

#[test]
fn rejects_tiny_budgets() {
    let dims = KvDims {
        kda_heads: 1,
        kda_head_dim: 4,
        conv_kernel: 2,
        latent_dim: 6,
    };
    let l = KvLayout::plan_layers(&[M, K], dims, 4, 3 * 288, StateDtypes::F32, None);
    assert_eq!(l.map(|l| l.parents()), Ok(2));
    assert!(KvLayout::plan_layers(&[M, K], dims, 4, 3 * 288 - 1, StateDtypes::F32, None).is_err());
    assert!(KvLayout::plan_layers(&[], dims, 4, 1 << 20, StateDtypes::F32, None).is_err());
    assert!(KvLayout::plan_layers(&[M], dims, 0, 1 << 20, StateDtypes::F32, None).is_err());
}

#[test]
fn rejects_page_sizes_that_overflow() {
    let dims = KvDims {
        kda_heads: 1 << 20,
        kda_head_dim: 1 << 24,
        conv_kernel: 4,
        latent_dim: 6,
    };
    let err = KvLayout::plan_layers(&[M, K], dims, 4, 1 << 30, StateDtypes::F32, None);
    assert!(matches!(err, Err(KvError::Layout(m)) if m.contains("overflow")));
    let dims = KvDims {
        latent_dim: usize::MAX / 2,
        ..dims
    };
    assert!(KvLayout::plan_layers(&[M], dims, 4, 1 << 30, StateDtypes::F32, None).is_err());
}
