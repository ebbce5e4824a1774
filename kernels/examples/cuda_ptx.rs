//! Writes the PTX of the CUDA kernels for an architecture (default sm_90) to a folder, for
//! inspection with ptxas/cuobjdump. Needs NVRTC, no GPU.
//!
//!   cargo run -p tessera-kernels --features cuda --example cuda_ptx -- OUT_DIR [sm_90]

use tessera_kernels::cuda::{compile, kda_defines, KDA_SOURCE};

fn main() {
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(args.next().expect("usage: cuda_ptx OUT_DIR [ARCH]"));
    let arch = args.next().unwrap_or_else(|| "sm_90".into());
    std::fs::create_dir_all(&out).expect("create OUT_DIR");
    for vt in [32, 64] {
        let ptx = compile(&arch, "kda", KDA_SOURCE, &kda_defines(128, 128, vt))
            .unwrap_or_else(|e| panic!("{e}"));
        let path = out.join(format!("kda-vt{vt}-{arch}.ptx"));
        std::fs::write(&path, ptx.to_src()).expect("write ptx");
        println!("{}", path.display());
    }
}
