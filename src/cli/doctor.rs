//! `devtrace doctor`: the host checked as `devtrace serve` with the same
//! flags would use it (see [`crate::doctor`]).

use std::io::Write;
use std::path::PathBuf;

use clap::Args;

use super::serve::ServeArgs;
use crate::doctor::{self, gpu::GpuPlan, kernel::KernelPlan, setup::SetupPlan, Plan};
use crate::telemetry::http::MetricsListen;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print one JSON object (checks, backends, ready) instead of lines.
    #[arg(long)]
    pub json: bool,

    /// The Python interpreter your CUDA jobs run with: the libcupti its
    /// environment's CUDA wheels bring is the one the injection library
    /// loads in those jobs. Default: python3 on PATH.
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,

    /// Every flag of `devtrace serve`, checked as serve would use it.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Exits 0 when `serve` with these flags can start its chosen backends, 1
/// otherwise (the report says why).
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let report = report(&args);
    let mut out = std::io::stdout().lock();
    let text = if args.json {
        format!("{:#}\n", report.json())
    } else {
        report.text()
    };
    // A reader that went away (`| head`) is no reason to fail.
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
    if report.ready() {
        Ok(())
    } else {
        std::process::exit(1)
    }
}

fn report(args: &DoctorArgs) -> doctor::Report {
    let serve = &args.serve;
    let memory = super::serve::memory_budgets(serve, &super::serve::agent_config(serve))
        .map(|budgets| (budgets.describe(), budgets.scant()));
    let python = args.python.clone().or_else(|| find_on_path("python3"));
    let inject_library = serve
        .inject_library
        .clone()
        .unwrap_or_else(crate::attach::default_library);
    let metrics_listen = match &serve.metrics_listen {
        Some(MetricsListen::At(address)) => Some(address.as_str()),
        _ => None,
    };
    let cuda_chosen = serve.backends.iter().any(|choice| {
        matches!(
            choice,
            crate::agent::BackendChoice::Auto | crate::agent::BackendChoice::Cuda
        )
    });
    let tpu_library = serve
        .tpu_library
        .clone()
        .unwrap_or_else(|| crate::backend::tpu::TpuConfig::default().library);
    let plan = Plan {
        backends: serve.backends.clone(),
        gpu: GpuPlan {
            nvml_library: &serve.nvml_library,
            cuda_libraries: &serve.cuda_libraries,
            inject_library: &inject_library,
            python: python.as_deref(),
        },
        tpu_library: &tpu_library,
        kernel: KernelPlan {
            ebpf_sched: serve.ebpf_hooks.contains(&super::serve::EbpfHook::Sched),
            ebpf_cuda: serve.ebpf_hooks.contains(&super::serve::EbpfHook::Cuda),
        },
        setup: SetupPlan {
            runtime_dir: &serve.runtime_dir,
            listen: (serve.listen != "off").then_some(serve.listen.as_str()),
            listen_unix: serve.listen_unix.as_deref(),
            metrics_listen,
            allow_roots: &serve.allow_roots,
            tls_cert: serve.client.tls_cert.as_deref(),
            tls_key: serve.client.tls_key.as_deref(),
            tls_client_ca: serve.tls_client_ca.as_deref(),
            memory,
            cuda_chosen,
            window_limit: super::serve::window_limit(serve),
            refusals: super::serve::refusals(serve),
        },
    };
    doctor::examine(&plan)
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}
