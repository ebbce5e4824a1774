//! The CUDA kernel sources compile with NVRTC for the GPUs we ship for (no GPU needed).
//! NVRTC comes from the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel (scripts/test.sh puts the
//! latter on LD_LIBRARY_PATH and sets TESSERA_REQUIRE_NVRTC=1, so there a missing NVRTC fails).
#![cfg(feature = "cuda")]

use tessera_kernels::cuda::{
    compile, kda_defines, CudaError, CONV_SOURCE, KDA_SCAN_SM90_SOURCE, KDA_SCAN_TMA_RS_SOURCE,
    KDA_SCAN_TMA_SOURCE, KDA_SCAN_TMA_WG_SOURCE, KDA_SOURCE, MLA_DECODE_SM90_SOURCE,
    MLA_DECODE_SOURCE, MLA_FLASH_SOURCE, MODEL_KERNELS, MODEL_SOURCE, MOE_SOURCE, OPS_SOURCE,
    SAMPLE_SOURCE,
};

fn nvrtc_required() -> bool {
    std::env::var("TESSERA_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn kda_kernels_compile_for_hopper_and_ampere_in_every_configuration() {
    for arch in ["sm_90", "sm_80"] {
        for (dk, vt) in [(128, 32), (128, 64), (64, 32)] {
            match compile(arch, "kda", KDA_SOURCE, &kda_defines(dk, 128, vt)) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    for entry in ["kda_chunk_prep", "kda_chunk_scan", "kda_decode"] {
                        assert!(text.contains(&format!(".entry {entry}")), "{entry} missing");
                    }
                    assert!(
                        text.contains("mma.sync.aligned.m16n8k16"),
                        "tensor-core path missing"
                    );
                    assert!(
                        text.contains("m16n8k8.row.col.f32.tf32"),
                        "tf32 inverse missing"
                    );
                    assert!(text.contains("ex2.approx.ftz.f32"), "flushing exp missing");
                }
                Err(CudaError::NoNvrtc) if !nvrtc_required() => {
                    eprintln!("NVRTC not found: set TESSERA_REQUIRE_NVRTC=1 to make this fatal");
                    return;
                }
                Err(e) => panic!("{arch} dk={dk} vt={vt}: {e}"),
            }
        }
    }
}

#[test]
fn the_prep_compiles_with_its_nvidia_only_forms_left_out() {
    let mut defines = kda_defines(128, 128, 32).to_vec();
    for off in ["KDA_INV_TC", "KDA_OVERLAP_OUT", "KDA_EXP_FTZ"] {
        defines.push((off, "0".to_string()));
    }
    match compile("sm_90", "kda", KDA_SOURCE, &defines) {
        Ok(ptx) => {
            let text = ptx.to_src();
            assert!(text.contains(".entry kda_chunk_prep"));
            assert!(!text.contains(".tf32"), "tf32 inverse left in");
            assert!(!text.contains("ex2.approx.ftz"), "flushing exp left in");
        }
        Err(CudaError::NoNvrtc) if !nvrtc_required() => {}
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn the_prep_compiles_with_one_two_or_four_column_blocks_in_flight_and_either_padding() {
    for dk in [64, 128] {
        for nb in ["1", "2", "4"] {
            let mut defines = kda_defines(dk, 128, 32).to_vec();
            defines.push(("KDA_TT_NB", nb.to_string()));
            defines.push((
                "KDA_SPLIT_PIECES",
                if nb == "2" { "0" } else { "1" }.to_string(),
            ));
            defines.push((
                "KDA_INV_PADS",
                if nb == "4" { "0" } else { "1" }.to_string(),
            ));
            match compile("sm_80", "kda", KDA_SOURCE, &defines) {
                Ok(ptx) => assert!(ptx.to_src().contains(".entry kda_chunk_prep")),
                Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
                Err(e) => panic!("dk={dk} KDA_TT_NB={nb}: {e}"),
            }
        }
    }
}

#[test]
fn the_prep_compiles_with_every_step_six_ordering() {
    for early in ["0", "1", "2"] {
        for one_phase in ["0", "1"] {
            let mut defines = kda_defines(128, 128, 32).to_vec();
            defines.push(("KDA_V_EARLY", early.to_string()));
            defines.push(("KDA_WU_ONE_PHASE", one_phase.to_string()));
            match compile("sm_90", "kda", KDA_SOURCE, &defines) {
                Ok(ptx) => assert!(ptx.to_src().contains(".entry kda_chunk_prep")),
                Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
                Err(e) => panic!("KDA_V_EARLY={early} KDA_WU_ONE_PHASE={one_phase}: {e}"),
            }
        }
    }
}

#[test]
fn a_broken_source_reports_the_compiler_log() {
    match compile(
        "sm_90",
        "broken",
        "extern \"C\" __global__ void f() { undefined_thing(); }",
        &[],
    ) {
        Err(CudaError::Compile { log, .. }) => assert!(log.contains("undefined_thing"), "{log}"),
        Err(CudaError::NoNvrtc) if !nvrtc_required() => {}
        other => panic!("expected a compile error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn the_plain_helpers_of_the_hip_backend_compile_for_cuda_too() {
    // TESSERA_PLAIN_HELPERS runs the HIP code paths on an NVIDIA GPU (cuda_check_bench
    // --plain-helpers): no tensor-core or asynchronous-copy instructions may be left.
    let mut defines = kda_defines(128, 128, 32).to_vec();
    defines.push(("TESSERA_PLAIN_HELPERS", "1".to_string()));
    match compile("sm_90", "kda", KDA_SOURCE, &defines) {
        Ok(ptx) => {
            let text = ptx.to_src();
            assert!(text.contains(".entry kda_chunk_scan"));
            assert!(!text.contains("mma.sync"), "tensor-core path left in");
            assert!(!text.contains("cp.async"), "asynchronous copies left in");
            assert!(!text.contains("ex2.approx.ftz"), "flushing exp left in");
        }
        Err(CudaError::NoNvrtc) if !nvrtc_required() => {
            eprintln!("NVRTC not found: set TESSERA_REQUIRE_NVRTC=1 to make this fatal");
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn row_ops_compile_for_hopper_and_ampere() {
    for arch in ["sm_90", "sm_80"] {
        match compile(arch, "ops", OPS_SOURCE, &[]) {
            Ok(ptx) => {
                let text = ptx.to_src();
                for entry in ["rmsnorm_bf16", "embedding_bf16", "argmax_f32"] {
                    assert!(text.contains(&format!(".entry {entry}")), "{entry} missing");
                }
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => {
                eprintln!("NVRTC not found: set TESSERA_REQUIRE_NVRTC=1 to make this fatal");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}

/// Compiles `source` for Hopper and Ampere under each set of `-D` macros and checks that every
/// entry point (and each `needle` instruction) is in the PTX.
fn compiles_with(
    name: &str,
    source: &str,
    configs: &[Vec<(&str, String)>],
    entries: &[&str],
    needles: &[&str],
) {
    for arch in ["sm_90", "sm_80"] {
        for defines in configs {
            match compile(arch, name, source, defines) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    for entry in entries {
                        assert!(
                            text.contains(&format!(".entry {entry}")),
                            "{name} {arch} {defines:?}: {entry} missing"
                        );
                    }
                    for needle in needles {
                        assert!(text.contains(needle), "{name} {arch}: `{needle}` missing");
                    }
                }
                Err(CudaError::NoNvrtc) if !nvrtc_required() => {
                    eprintln!("NVRTC not found: set TESSERA_REQUIRE_NVRTC=1 to make this fatal");
                    return;
                }
                Err(e) => panic!("{name} {arch} {defines:?}: {e}"),
            }
        }
    }
}

#[test]
fn short_conv_compiles_for_hopper_and_ampere() {
    let configs: Vec<Vec<(&str, String)>> = [4, 3]
        .iter()
        .map(|k| vec![("CONV_K", k.to_string())])
        .collect();
    compiles_with(
        "conv",
        CONV_SOURCE,
        &configs,
        &["conv_prefill_bf16", "conv_update_bf16"],
        &[],
    );
}

#[test]
fn sampling_compiles_for_hopper_and_ampere() {
    compiles_with(
        "sample",
        SAMPLE_SOURCE,
        &[vec![], vec![("SAMPLE_BINS", "0".into())]],
        &["sample_f32", "sample_bf16"],
        &[],
    );
}

#[test]
fn mla_decode_compiles_with_tensor_cores_for_every_head_block() {
    let configs: Vec<Vec<(&str, String)>> = [(1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 4, 0), (3, 0, 1)]
        .iter()
        .map(|(mt, pf, co)| {
            vec![
                ("MLA_MT", mt.to_string()),
                ("MLA_PREFETCH", pf.to_string()),
                ("MLA_COALESCED", co.to_string()),
            ]
        })
        .collect();
    compiles_with(
        "mla_decode",
        MLA_DECODE_SOURCE,
        &configs,
        &["mla_decode_split", "mla_decode_combine"],
        &[
            "mma.sync.aligned.m16n8k16",
            "ldmatrix.sync.aligned.m8n8.x4.trans",
            "cp.async",
        ],
    );
}

/// The Hopper split kernels (warpgroup, split roles, transposed) in every build setting:
/// (prefetch, coalesced copies, split-role tile, probe, heads per transposed block, tiles of the
/// copy-engine kernels in the 128-byte swizzle, K steps of S with Q from registers, tensor copies
/// a split-role tile comes in).
#[test]
fn mla_decode_hopper_kernels_compile_for_sm90a_in_every_setting() {
    let settings = [
        (0, 0, 32, 0, 48, 1, 0, 1),
        (3, 0, 32, 0, 32, 1, 16, 3),
        (0, 1, 32, 0, 16, 1, 0, 1),
        (0, 0, 64, 0, 48, 1, 0, 9),
        (0, 0, 64, 0, 48, 1, 16, 3),
        (0, 0, 64, 0, 32, 1, 36, 1),
        (0, 0, 64, 1, 48, 1, 8, 1),
        (0, 0, 32, 2, 48, 1, 0, 3),
        (0, 0, 64, 4, 16, 1, 0, 3),
        (0, 0, 32, 0, 48, 0, 0, 1),
        (0, 0, 64, 0, 32, 0, 16, 1),
        (0, 0, 32, 4, 48, 0, 0, 1),
    ];
    for (prefetch, coalesced, tile, probe, tr_heads, swizzled, q_regs, copies) in settings {
        let defines = [
            ("MLA_PREFETCH", format!("{prefetch}")),
            ("MLA_COALESCED", format!("{coalesced}")),
            ("MLA_WS_BN", format!("{tile}")),
            ("MLA_WS_PROBE", format!("{probe}")),
            ("MLA_TR_HEADS", format!("{tr_heads}")),
            ("MLA_SW128", format!("{swizzled}")),
            ("MLA_WS_QREG", format!("{q_regs}")),
            ("MLA_WS_COPIES", format!("{copies}")),
        ];
        match compile(
            "sm_90a",
            "mla_decode_sm90",
            MLA_DECODE_SM90_SOURCE,
            &defines,
        ) {
            Ok(ptx) => {
                let text = ptx.to_src();
                for entry in ["wg", "ws", "tr"] {
                    let entry = format!(".entry mla_decode_split_{entry}");
                    assert!(text.contains(&entry), "{entry}");
                }
                assert!(text.contains("cp.async.bulk.tensor.3d"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n32k16"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n256k16"));
                // The split-role kernel's S over 64-token tiles.
                assert_eq!(
                    text.contains("wgmma.mma_async.sync.aligned.m64n64k16"),
                    tile == 64 && probe & 6 == 0
                );
                // The transposed kernel's products: the block's heads as N.
                let mma = format!("wgmma.mma_async.sync.aligned.m64n{tr_heads}k16");
                assert!(text.contains(&mma), "{mma}");
                assert_eq!(text.contains("cp.async.bulk.prefetch.L2"), prefetch > 0);
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
            Err(e) => panic!("{defines:?}: {e}"),
        }
    }
}

#[test]
fn kda_warpgroup_scan_compiles_for_hopper_at_both_depths() {
    for stages in [2, 3] {
        let mut defines = kda_defines(128, 128, 32).to_vec();
        defines.push(("WG_SCAN_STAGES", stages.to_string()));
        match compile("sm_90a", "kda_scan_sm90", KDA_SCAN_SM90_SOURCE, &defines) {
            Ok(ptx) => {
                let text = ptx.to_src();
                assert!(text.contains(".entry kda_chunk_scan_wg"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n64k16"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n128k16"));
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
            Err(e) => panic!("{defines:?}: {e}"),
        }
    }
    // The state is one m64n128 accumulator: other head dims are refused at compile time.
    if let Err(CudaError::Compile { log, .. }) = compile(
        "sm_90a",
        "kda_scan_sm90",
        KDA_SCAN_SM90_SOURCE,
        &kda_defines(64, 128, 32),
    ) {
        assert!(log.contains("DK must be 128"), "{log}");
    } else if nvrtc_required() {
        panic!("dk = 64 compiled");
    }
}

#[test]
fn kda_copy_engine_scan_compiles_for_hopper_at_both_depths_and_widths() {
    for (stages, warps, chains) in [(2, 4, 1), (3, 4, 2), (2, 8, 2), (3, 8, 1)] {
        let mut defines = kda_defines(128, 128, 32).to_vec();
        defines.push(("CL_STAGES", stages.to_string()));
        defines.push(("CL_WARPS", warps.to_string()));
        defines.push(("CL_CHAINS", chains.to_string()));
        match compile("sm_90a", "kda_scan_tma", KDA_SCAN_TMA_SOURCE, &defines) {
            Ok(ptx) => {
                let text = ptx.to_src();
                assert!(text.contains(".entry kda_chunk_scan_tma"));
                assert!(text.contains("cp.async.bulk.tensor.2d"));
                assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans"));
                assert!(text.contains(&format!("bar.sync 1, {}", 32 * warps)));
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
            Err(e) => panic!("{defines:?}: {e}"),
        }
    }
    // Built for dk = 128 only: other head dims are refused at compile time.
    if let Err(CudaError::Compile { log, .. }) = compile(
        "sm_90a",
        "kda_scan_tma",
        KDA_SCAN_TMA_SOURCE,
        &kda_defines(64, 128, 32),
    ) {
        assert!(log.contains("built for DK = 128"), "{log}");
    } else if nvrtc_required() {
        panic!("dk = 64 compiled");
    }
}

#[test]
fn kda_warpgroup_copy_engine_scan_compiles_for_hopper_at_both_depths_and_in_clusters() {
    for (stages, cluster) in [(2, 1), (3, 1), (2, 2), (3, 4)] {
        let mut defines = kda_defines(128, 128, 32).to_vec();
        defines.push(("CW_STAGES", stages.to_string()));
        defines.push(("CW_CLUSTER", cluster.to_string()));
        match compile(
            "sm_90a",
            "kda_scan_tma_wg",
            KDA_SCAN_TMA_WG_SOURCE,
            &defines,
        ) {
            Ok(ptx) => {
                let text = ptx.to_src();
                assert!(text.contains(".entry kda_chunk_scan_tma_wg"));
                assert!(text.contains("cp.async.bulk.tensor.2d"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n32k16"));
                assert!(text.contains("stmatrix.sync.aligned.m8n8.x4.trans"));
                assert!(text.contains("bar.sync 2, 128"));
                assert_eq!(text.contains(".multicast::cluster"), cluster > 1);
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
            Err(e) => panic!("{defines:?}: {e}"),
        }
    }
}

#[test]
fn kda_register_operand_scan_compiles_for_hopper_with_one_or_two_warpgroups() {
    // (warpgroups, stages, o tiles in the stages)
    for (warpgroups, stages, o_in_u) in [(1, 2, 0), (1, 3, 0), (1, 3, 1), (2, 2, 0), (2, 3, 1)] {
        let mut defines = kda_defines(128, 128, 32).to_vec();
        defines.push(("CR_STAGES", stages.to_string()));
        defines.push(("CR_WG", warpgroups.to_string()));
        defines.push(("CR_O_IN_U", o_in_u.to_string()));
        defines.push(("KS_VT", (64 * warpgroups).to_string()));
        match compile(
            "sm_90a",
            "kda_scan_tma_rs",
            KDA_SCAN_TMA_RS_SOURCE,
            &defines,
        ) {
            Ok(ptx) => {
                let text = ptx.to_src();
                assert!(text.contains(".entry kda_chunk_scan_tma_rs"));
                assert!(text.contains("cp.async.bulk.tensor.2d"));
                assert!(text.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"));
                assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans"));
                assert!(text.contains("stmatrix.sync.aligned.m8n8.x4.trans"));
                assert_eq!(text.contains("setmaxnreg.inc"), warpgroups == 2);
                assert_eq!(text.contains("fence.proxy.async"), o_in_u == 1);
            }
            Err(CudaError::NoNvrtc) if !nvrtc_required() => return,
            Err(e) => panic!("{defines:?}: {e}"),
        }
    }
    // The u tile must be the swizzled 64 columns a warpgroup.
    for (warpgroups, ks_vt) in [(1, "32"), (2, "64")] {
        let mut defines = kda_defines(128, 128, 32).to_vec();
        defines.push(("CR_WG", warpgroups.to_string()));
        defines.push(("KS_VT", ks_vt.to_string()));
        if let Err(CudaError::Compile { log, .. }) = compile(
            "sm_90a",
            "kda_scan_tma_rs",
            KDA_SCAN_TMA_RS_SOURCE,
            &defines,
        ) {
            assert!(log.contains("warpgroups of 64 columns"), "{log}");
        } else if nvrtc_required() {
            panic!("{warpgroups} warpgroups with KS_VT = {ks_vt} compiled");
        }
    }
}

#[test]
fn moe_decode_compiles_for_hopper_and_ampere() {
    compiles_with(
        "moe",
        MOE_SOURCE,
        &[
            vec![],
            vec![("MOE_TC_SPAN_BF16", "2".to_string())],
            vec![
                ("MOE_TC_SPAN_MXFP4", "8".to_string()),
                ("MOE_TC_MIN_BLOCKS", "2".to_string()),
            ],
            vec![("MOE_TC_SPAN_MXFP4", "1".to_string())],
            vec![("MOE_TC_ROLL", "0".to_string())],
            vec![
                ("MOE_TC_PF_PASSES", "2".to_string()),
                ("MOE_TC_L2_FETCH", "256".to_string()),
            ],
            vec![
                ("MOE_TC_DOWN_TILES_BF16", "2".to_string()),
                ("MOE_TC_DOWN_TILES_MXFP4", "2".to_string()),
            ],
            vec![
                ("MOE_TC_PF_PASSES", "1".to_string()),
                ("MOE_TC_SPAN_MXFP4", "1".to_string()),
                ("MOE_TC_L2_FETCH", "64".to_string()),
            ],
            vec![
                ("MOE_ROUTE_SELECT", "1".to_string()),
                ("MOE_ROUTE_TRIGGER", "1".to_string()),
                ("MOE_TC_PLAN_EARLY", "1".to_string()),
            ],
            vec![
                ("MOE_ROUTE_SELECT", "1".to_string()),
                ("ROUTE_PER_THREAD", "1".to_string()),
            ],
            vec![
                ("MOE_TC_RESIDENT", "1".to_string()),
                ("MOE_TC_FUSED_COMBINE", "64".to_string()),
            ],
        ],
        &[
            "moe_route",
            "moe_gate_up_bf16",
            "moe_gate_up_mxfp4",
            "moe_down_bf16",
            "moe_down_mxfp4",
            "moe_gate_up_tc_bf16",
            "moe_gate_up_tc_mxfp4",
            "moe_gate_up_tc_res_bf16",
            "moe_gate_up_tc_res_mxfp4",
            "moe_down_tc_bf16",
            "moe_down_tc_mxfp4",
            "moe_combine",
        ],
        &["mma.sync.aligned.m16n8k16"],
    );
}

/// The copy-engine MXFP4 projections: tensor copies and transaction barriers on sm_90, and the
/// register path where those do not exist (sm_80).
#[test]
fn moe_copy_engine_projections_compile() {
    for (chunk, stages) in [(16, 2), (8, 3), (8, 2)] {
        let defines = vec![
            ("MOE_TC_TMA", "1".to_string()),
            ("MOE_TMA_CHUNK", chunk.to_string()),
            ("MOE_TMA_STAGES", stages.to_string()),
            // Copy-engine down warps take one tile whatever this asks.
            ("MOE_TC_DOWN_TILES_MXFP4", "2".to_string()),
        ];
        for (arch, bulk) in [("sm_90", true), ("sm_80", false)] {
            match compile(arch, "moe", MOE_SOURCE, &defines) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    assert_eq!(
                        text.contains("cp.async.bulk.tensor.2d"),
                        bulk,
                        "{arch} chunk {chunk} stages {stages}"
                    );
                    assert!(text.contains(".entry moe_down_tc_mxfp4"));
                }
                Err(CudaError::NoNvrtc) if !nvrtc_required() => {
                    eprintln!("NVRTC not found: set TESSERA_REQUIRE_NVRTC=1 to make this fatal");
                    return;
                }
                Err(e) => panic!("{arch} chunk {chunk} stages {stages}: {e}"),
            }
        }
    }
}

#[test]
fn whole_model_glue_kernels_compile_for_hopper_and_ampere() {
    compiles_with("model", MODEL_SOURCE, &[vec![]], MODEL_KERNELS, &[]);
}

#[test]
fn flash_mla_attention_compiles_with_tensor_cores_for_hopper_and_ampere() {
    compiles_with(
        "mla_flash",
        MLA_FLASH_SOURCE,
        &[vec![], vec![("FL_MT", "4".to_string())]],
        &["mla_flash", "mla_flash_combine"],
        &[
            "mma.sync.aligned.m16n8k16",
            "ldmatrix.sync.aligned.m8n8.x4.trans",
        ],
    );
}
