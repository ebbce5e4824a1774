//! Writes the PTX of the CUDA kernels for an architecture (default sm_90) to a folder, for
//! inspection with ptxas/cuobjdump. Needs NVRTC, no GPU.
//!
//!   cargo run -p tessera-kernels --features cuda --example cuda_ptx -- OUT_DIR [sm_90]

use tessera_kernels::cuda::{
    compile, kda_defines, CONV_SOURCE, KDA_SCAN_SM90_SOURCE, KDA_SCAN_TMA_RS_SOURCE,
    KDA_SCAN_TMA_SOURCE, KDA_SCAN_TMA_WG_SOURCE, KDA_SOURCE, MLA_DECODE_SM90_SOURCE,
    MLA_DECODE_SOURCE, MLA_FLASH_SOURCE, MODEL_SOURCE, MOE_SOURCE, SAMPLE_SOURCE,
};

/// One PTX file to write: its name, the source and the `-D` macros.
type Unit = (String, &'static str, Vec<(&'static str, String)>);

fn main() {
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(args.next().expect("usage: cuda_ptx OUT_DIR [ARCH]"));
    let arch = args.next().unwrap_or_else(|| "sm_90".into());
    std::fs::create_dir_all(&out).expect("create OUT_DIR");
    let mut units: Vec<Unit> = [32, 64]
        .iter()
        .map(|vt| {
            (
                format!("kda-vt{vt}"),
                KDA_SOURCE,
                kda_defines(128, 128, *vt).to_vec(),
            )
        })
        .collect();
    units.push(("conv".into(), CONV_SOURCE, vec![]));
    units.push(("sample".into(), SAMPLE_SOURCE, vec![]));
    units.push(("moe".into(), MOE_SOURCE, vec![]));
    let warp_lists = vec![("MOE_ROUTE_SELECT", "1".to_string())];
    units.push(("moe-route-lists".into(), MOE_SOURCE, warp_lists));
    // Batch 1's chain with every option (`tc_chain` of cuda_model_ops_check).
    let chain = [
        ("MOE_ROUTE_SELECT", 1),
        ("MOE_ROUTE_TRIGGER", 1),
        ("MOE_TC_FUSED_COMBINE", 64),
        ("MOE_TC_PLAN_EARLY", 1),
    ];
    let chain = chain.iter().map(|&(k, v)| (k, v.to_string())).collect();
    units.push(("moe-chain".into(), MOE_SOURCE, chain));
    units.push(("model".into(), MODEL_SOURCE, vec![]));
    for mt in [2, 3] {
        units.push((
            format!("mla_decode-mt{mt}"),
            MLA_DECODE_SOURCE,
            vec![("MLA_MT", mt.to_string())],
        ));
    }
    for mt in [2, 4] {
        units.push((
            format!("mla_flash-mt{mt}"),
            MLA_FLASH_SOURCE,
            vec![("FL_MT", mt.to_string())],
        ));
    }
    if arch == "sm_90" {
        units.push(("mla_decode_sm90".into(), MLA_DECODE_SM90_SOURCE, vec![]));
        let tile64 = vec![("MLA_WS_BN", "64".to_string())];
        units.push((
            "mla_decode_ws64_sm90".into(),
            MLA_DECODE_SM90_SOURCE,
            tile64,
        ));
        for heads in [16, 32] {
            let tr = vec![("MLA_TR_HEADS", heads.to_string())];
            let name = format!("mla_decode_tr{heads}_sm90");
            units.push((name, MLA_DECODE_SM90_SOURCE, tr));
        }
        for q_regs in [8, 16, 24, 36] {
            let qreg = vec![
                ("MLA_WS_BN", "64".to_string()),
                ("MLA_WS_QREG", q_regs.to_string()),
            ];
            let name = format!("mla_decode_ws64_qreg{q_regs}_sm90");
            units.push((name, MLA_DECODE_SM90_SOURCE, qreg));
        }
        let copies = vec![
            ("MLA_WS_BN", "64".to_string()),
            ("MLA_WS_COPIES", "3".to_string()),
        ];
        units.push((
            "mla_decode_ws64_copies3_sm90".into(),
            MLA_DECODE_SM90_SOURCE,
            copies,
        ));
        let plain = vec![("MLA_SW128", "0".to_string())];
        units.push((
            "mla_decode_plain_sm90".into(),
            MLA_DECODE_SM90_SOURCE,
            plain,
        ));
        let stream = vec![("MLA_WS_PROBE", "4".to_string())];
        units.push((
            "mla_decode_stream_sm90".into(),
            MLA_DECODE_SM90_SOURCE,
            stream,
        ));
        units.push((
            "kda_scan_sm90".into(),
            KDA_SCAN_SM90_SOURCE,
            kda_defines(128, 128, 32).to_vec(),
        ));
        units.push((
            "kda_scan_tma_sm90".into(),
            KDA_SCAN_TMA_SOURCE,
            kda_defines(128, 128, 32).to_vec(),
        ));
        units.push((
            "kda_scan_tma_wg_sm90".into(),
            KDA_SCAN_TMA_WG_SOURCE,
            kda_defines(128, 128, 32).to_vec(),
        ));
        // The register-operand scan with one warpgroup, and with two (o tiles in the stages).
        for (name, extra) in [
            ("kda_scan_tma_rs_sm90", &[("KS_VT", "64")][..]),
            (
                "kda_scan_tma_rs2_sm90",
                &[("KS_VT", "128"), ("CR_WG", "2"), ("CR_O_IN_U", "1")][..],
            ),
        ] {
            let mut rs = kda_defines(128, 128, 32).to_vec();
            rs.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
            units.push((name.into(), KDA_SCAN_TMA_RS_SOURCE, rs));
        }
    }
    for (name, source, defines) in units {
        // The warpgroup kernels need the architecture-specific target.
        let arch = if name.ends_with("_sm90") {
            "sm_90a".to_string()
        } else {
            arch.clone()
        };
        let ptx = compile(&arch, &name, source, &defines).unwrap_or_else(|e| panic!("{e}"));
        let path = out.join(format!("{name}-{arch}.ptx"));
        std::fs::write(&path, ptx.to_src()).expect("write ptx");
        println!("{}", path.display());
    }
}
