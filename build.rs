//! Compiles the protocol definitions under `proto/` into Rust with a pure-Rust
//! proto compiler, so building devtrace needs no system `protoc`, and the BPF
//! programs under `bpf/` into objects with generated skeletons (libbpf-cargo,
//! CO-RE), when clang is there to compile them.

use std::path::{Path, PathBuf};
use std::process::Command;

const PROTOS: &[&str] = &[
    "tensorflow/core/profiler/profiler_service.proto",
    "tensorflow/core/profiler/profiler_analysis.proto",
    "tensorflow/core/profiler/protobuf/memory_profile.proto",
    "devtrace/trigger.proto",
];

/// BPF programs, each built into `<name>.skel.rs` in OUT_DIR.
const BPF_PROGRAMS: &[&str] = &["sched", "cuda"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from("proto");
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, [&proto_root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Trace replies share their bytes rather than copy them.
        .bytes(".tensorflow.ProfileToolData.data")
        .compile_fds(descriptors)?;
    build_bpf()
}

/// Builds the BPF skeletons and sets `cfg(devtrace_bpf)`. Without clang the
/// build goes on and the eBPF backend reports at run time that it was built
/// without its programs; a program that fails to compile fails the build.
fn build_bpf() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo::rustc-check-cfg=cfg(devtrace_bpf)");
    println!("cargo:rerun-if-changed=bpf");
    println!("cargo:rerun-if-env-changed=DEVTRACE_CLANG");
    let clang = std::env::var("DEVTRACE_CLANG").unwrap_or_else(|_| "clang".to_string());
    let found = Command::new(&clang)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        println!(
            "cargo:warning=`{clang}` not found: building without the eBPF backend's kernel \
             programs (install clang, or set DEVTRACE_CLANG, and rebuild)"
        );
        return Ok(());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for name in BPF_PROGRAMS {
        let source = Path::new("bpf").join(format!("{name}.bpf.c"));
        libbpf_cargo::SkeletonBuilder::new()
            .source(&source)
            .clang(&clang)
            .clang_args(["-I", "bpf", "-Wall", "-Werror"])
            .build_and_generate(out.join(format!("{name}.skel.rs")))
            .map_err(|e| format!("compiling {}: {e:#}", source.display()))?;
    }
    println!("cargo:rustc-cfg=devtrace_bpf");
    Ok(())
}
