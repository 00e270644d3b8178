//! `devtrace monitor`: asks a profiler server how busy its devices were
//! over a short period (the `Monitor` RPC, as TensorFlow's
//! `profiler_client.monitor` asks), once or period after period, and prints
//! what it answers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::Code;

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
        return Err(super::UsageError(format!(
            "--duration {:?}: the server is asked for whole milliseconds, at least 1ms",
            args.duration
        ))
        .into());
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
        let ask = |connection: &Arc<client::Connection>| {
            let connection = Arc::clone(connection);
            tokio::spawn(async move { connection.monitor(request).await })
        };
        // A server measures from when it is asked, and answers a while
        // after the period (once its events are in): each period is asked
        // for as the one before ends, not once its answer is in, so that
        // the periods follow one another without gaps, two calls at most
        // in flight. A server that answers at once is still asked a period
        // apart, not in a loop; one that lets this caller have one call at
        // a time (`--captures-per-caller 1`) is then asked one at a time.
        let mut in_flight: VecDeque<JoinHandle<Result<MonitorResponse, CallError>>> =
            VecDeque::new();
        let mut overlapping = true;
        let mut next_start = Instant::now();
        let (mut asked, mut printed) = (0u64, 0u64);
        let more = |asked: u64| args.count == 0 || asked < args.count;
        while more(asked) || !in_flight.is_empty() {
            let room = in_flight.is_empty() || overlapping && in_flight.len() < 2;
            if more(asked) && room {
                tokio::time::sleep_until(next_start).await;
                next_start += args.duration;
                asked += 1;
                in_flight.push_back(ask(&connection));
                continue;
            }
            let Some(oldest) = in_flight.pop_front() else {
                break;
            };
            let answered = oldest.await.context("the call ended abnormally")?;
            let reply = match answered {
                Err(refused) if overlapping && refused.code() == Some(Code::ResourceExhausted) => {
                    overlapping = false;
                    asked -= 1;
                    next_start = Instant::now();
                    eprintln!(
                        "{}: one Monitor at a time for this caller: periods now follow each \
                         answer, with a gap between them",
                        args.address
                    );
                    continue;
                }
                answered => answered.with_context(|| format!("monitoring {}", args.address))?,
            };
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
        Ok(())
    })
}
