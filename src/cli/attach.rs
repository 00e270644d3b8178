//! `devtrace attach PID...`: loads the injection library into running CUDA
//! processes that were started without it (see [`crate::attach`]), one
//! after another, saying for each what happened.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::Args;

use crate::attach::{self, AttachConfig, AttachError};

/// See the module documentation.
#[derive(Debug, Args)]
pub struct AttachArgs {
    /// Processes to attach (host pids; containers' processes too).
    #[arg(required = true, value_name = "PID")]
    pub pids: Vec<i32>,
    /// The agent's runtime directory, which the library joins (the
    /// agent's --runtime-dir).
    #[arg(long, value_name = "DIR", env = "DEVTRACE_RUNTIME_DIR", default_value = crate::workload::DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
    /// The injection library; by default the one beside this program, else
    /// /opt/devtrace/lib/libdevtrace_inject.so (the image's).
    #[arg(long, value_name = "FILE")]
    pub library: Option<PathBuf>,
    /// Where a copy of the library is staged for the process, as the
    /// process sees its filesystem (a container's own); it must not be
    /// mounted noexec.
    #[arg(long, value_name = "DIR", default_value = "/tmp")]
    pub stage_dir: PathBuf,
    /// How long the process's thread may take to stop.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", default_value = "2s", value_parser = super::parse_duration)]
    pub stop_timeout: Duration,
    /// How long the library may take to load once the thread runs again.
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", default_value = "30s", value_parser = super::parse_duration)]
    pub load_timeout: Duration,
}

pub fn run(args: AttachArgs) -> anyhow::Result<()> {
    let config = AttachConfig {
        library: args.library.clone().unwrap_or_else(attach::default_library),
        runtime_dir: args.runtime_dir.clone(),
        stage_dir: args.stage_dir.clone(),
        stop_limit: args.stop_timeout,
        load_limit: args.load_timeout,
    };
    if !config.library.is_file() {
        bail!(
            "no injection library at {} (--library names it)",
            config.library.display()
        );
    }
    let mut failed = 0;
    for pid in &args.pids {
        match attach::attach(*pid, &config) {
            Ok(attached) => println!(
                "attached {pid}: the library loaded {:.1} ms after {} was let go; it was \
                 stopped {:.1} ms",
                attached.loaded_in.as_secs_f64() * 1e3,
                attached.thread,
                attached.stopped_for.as_secs_f64() * 1e3,
            ),
            Err(AttachError::AlreadyInjected) => {
                println!("{pid}: {}", AttachError::AlreadyInjected)
            }
            Err(error) => {
                failed += 1;
                eprintln!("devtrace attach: {pid} not attached: {error}");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} processes not attached", args.pids.len());
    }
    Ok(())
}
