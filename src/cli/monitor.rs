//! `devtrace monitor`: asks a profiler server how busy its devices were
//! over a short period (the `Monitor` RPC, as TensorFlow's
//! `profiler_client.monitor` asks), once or period after period, and prints
//! what it answers.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

use crate::model::printable::printable_lines;
use crate::proto::tensorflow::MonitorRequest;
use crate::protocol::client;

/// Time a server may take past the period to answer.
const ANSWER_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub struct MonitorArgs {
    /// Profiler server address: host:port, grpc://host:port (plaintext),
    /// grpcs://host:port (TLS) or unix:PATH (a local agent's --listen-unix).
    pub address: String,

    /// Length of each period the server measures (e.g. 1s, 500ms).
    #[arg(long, default_value = "1s", value_parser = super::parse_duration_with_unit)]
    pub duration: Duration,

    /// 1: device idle time, step times and NVML's means; 2: a devtrace
    /// agent adds its own state (backends, captures, memory) for callers
    /// it counts as admins.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=2))]
    pub level: i32,

    /// Periods to ask for one after the other; 0 asks until interrupted.
    #[arg(long, default_value_t = 1)]
    pub count: u64,

    /// Have the server begin each answer with the period's end (Unix ms).
    #[arg(long)]
    pub timestamp: bool,

    #[command(flatten)]
    pub client: super::client_args::ClientArgs,
}

pub fn run(args: MonitorArgs) -> anyhow::Result<()> {
    let duration_ms = u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX);
    if duration_ms == 0 {
        bail!("--duration must be at least 1ms");
    }
    let runtime = super::call_runtime()?;
    let target = super::server_address(&args.address)?;
    let config = args.client.config_for_calls()?;
    let deadline = args.duration.saturating_add(ANSWER_GRACE);
    runtime.block_on(async {
        let connection = client::connect(&target, &config, deadline)
            .await
            .with_context(|| format!("connecting to {}", args.address))?;
        let mut asked = 0u64;
        while args.count == 0 || asked < args.count {
            let reply = connection
                .monitor(MonitorRequest {
                    duration_ms,
                    monitoring_level: args.level,
                    timestamp: args.timestamp,
                })
                .await
                .with_context(|| format!("monitoring {}", args.address))?;
            if asked > 0 {
                println!();
            }
            // The server wrote this text: shown, never obeyed.
            print!("{}", printable_lines(&reply.data));
            if !reply.data.ends_with('\n') {
                println!();
            }
            asked += 1;
        }
        Ok(())
    })
}
