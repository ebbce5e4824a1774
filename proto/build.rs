//! Generates the tonic/prost code for `proto/tessera/v1/*.proto` into `OUT_DIR`.
//!
//! No system `protoc`: `protox` (a pure-Rust protobuf compiler) parses the files into a
//! `FileDescriptorSet`, which `tonic-prost-build` turns into Rust. The encoded descriptor set is
//! also written to `OUT_DIR` (for gRPC reflection and tools such as grpcurl).

use std::path::PathBuf;

const PROTO_ROOT: &str = "proto";
const FILES: &[&str] = &[
    "tessera/v1/worker.proto",
    "tessera/v1/decode.proto",
    "tessera/v1/prefill.proto",
    "tessera/v1/encoder.proto",
    "tessera/v1/generate.proto",
    // The subset of etcd's v3 API that discovery uses (DESIGN §6), client side only.
    "etcd/etcdserverpb.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={PROTO_ROOT}");
    for file in FILES {
        println!("cargo:rerun-if-changed={PROTO_ROOT}/{file}");
    }

    let mut compiler = protox::Compiler::new([PROTO_ROOT])?;
    // Source info carries the .proto comments into the generated docs.
    compiler.include_source_info(true).include_imports(true);
    compiler.open_files(FILES)?;

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("tessera_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(true)
        .emit_rerun_if_changed(false)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
