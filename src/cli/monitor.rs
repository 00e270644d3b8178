//! `devtrace monitor`: asks a profiler server how busy its devices were
//! over a short period (the `Monitor` RPC, as TensorFlow's
//! `profiler_client.monitor` asks), once or period after period, and prints
//! what it answers.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::model::printable::printable_lines;
use crate::proto::tensorflow::{MonitorRequest, MonitorResponse};
use crate::protocol::client::{self, CallError};

/// Time a server may take past the period to answer.
const ANSWER_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub struct MonitorArgs {
    /// Profiler server address: host:port, grpc://host:port (plaintext),
    /// grpcs://host:port (TLS) or unix:PATH (a local agent's --listen-unix).
    pub address: String,

    /// Length of each period the server measures (e.g. 1s, 500ms), in
    /// whole milliseconds, as the protocol has it.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration_with_unit)]
    pub duration: Duration,

    /// 1: device idle time, step times and NVML's means; 2: a devtrace
    /// agent adds its own state (backends, captures, memory) for callers
    /// it counts as admins.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=2))]
    pub level: i32,

    /// Periods to ask for, back to back (each is asked for as the one
    /// before ends); 0 asks until interrupted.
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
    if duration_ms == 0 || !args.duration.subsec_nanos().is_multiple_of(1_000_000) {
        bail!(
            "--duration {:?}: the server is asked for whole milliseconds, at least 1ms",
            args.duration
        );
    }
    let runtime = super::call_runtime()?;
    let target = super::server_address(&args.address)?;
    let config = args.client.config_for_calls()?;
    let deadline = args.duration.saturating_add(ANSWER_GRACE);
    let request = MonitorRequest {
        duration_ms,
        monitoring_level: args.level,
        timestamp: args.timestamp,
    };
    runtime.block_on(async {
        let connection = client::connect(&target, &config, deadline)
            .await
            .with_context(|| format!("connecting to {}", args.address))?;
        let connection = Arc::new(connection);
        // A server measures from when it is asked, and answers a while
        // after the period (once its events are in): each period is asked
        // for as the one before ends, not once its answer is in, so that
        // the periods follow one another without gaps. A server that
        // answers at once is still asked a period apart, not in a loop.
        let mut next_start = Instant::now();
        let (mut asked, mut printed) = (0u64, 0u64);
        let mut answering: Option<JoinHandle<Result<MonitorResponse, CallError>>> = None;
        loop {
            let next = if args.count == 0 || asked < args.count {
                tokio::time::sleep_until(next_start).await;
                next_start += args.duration;
                asked += 1;
                let connection = Arc::clone(&connection);
                Some(tokio::spawn(
                    async move { connection.monitor(request).await },
                ))
            } else {
                None
            };
            if let Some(previous) = answering.take() {
                let reply = previous
                    .await
                    .context("the call ended abnormally")
                    .and_then(|reply| reply.map_err(anyhow::Error::from))
                    .with_context(|| format!("monitoring {}", args.address))?;
                if printed > 0 {
                    println!();
                }
                printed += 1;
                // The server wrote this text: shown, never obeyed.
                print!("{}", printable_lines(&reply.data));
                if !reply.data.ends_with('\n') {
                    println!();
                }
            }
            match next {
                Some(call) => answering = Some(call),
                None => return Ok(()),
            }
        }
    })
}
