//! Compiles the protocol definitions under `proto/` into Rust with a pure-Rust
//! proto compiler, so building devtrace needs no system `protoc`.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "tensorflow/core/profiler/profiler_service.proto",
    "tensorflow/core/profiler/profiler_analysis.proto",
    "tensorflow/core/profiler/protobuf/memory_profile.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from("proto");
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, [&proto_root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
