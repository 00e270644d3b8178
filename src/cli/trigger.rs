//! `devtrace trigger`: fires one of a running agent's trigger rules, so that
//! a job's own watchdog can save the flight recorder's recent past.

use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::model::calendar::utc_text;
use crate::model::printable::printable;
use crate::protocol::client;

/// How long the call may take: a firing only schedules the save.
const DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, Args)]
pub struct TriggerArgs {
    /// The rule to fire (its name=, as given to `devtrace serve --trigger`).
    pub name: String,

    /// The agent: host:port, grpc://host:port (plaintext), grpcs://host:port
    /// (TLS) or unix:PATH (its --listen-unix).
    #[arg(long, default_value = "127.0.0.1:6009")]
    pub agent: String,

    /// Why it fires, recorded as the trigger's value in the saved trace: at
    /// most 1024 bytes, no control characters (the agent refuses others).
    #[arg(long, default_value = "")]
    pub reason: String,

    #[command(flatten)]
    pub client: super::client_args::ClientArgs,
}

pub fn run(args: TriggerArgs) -> anyhow::Result<()> {
    let runtime = super::call_runtime()?;
    let target = super::server_address(&args.agent)?;
    let config = args.client.config_for_calls()?;
    let fired = runtime.block_on(async {
        let connection = client::connect(&target, &config, DEADLINE)
            .await
            .with_context(|| format!("connecting to {}", args.agent))?;
        connection
            .fire_trigger(&args.name, &args.reason)
            .await
            .with_context(|| format!("firing trigger {:?} of {}", args.name, args.agent))
    })?;
    let into = if fired.repository.is_empty() {
        String::new()
    } else {
        format!(" into {}", printable(&fired.repository))
    };
    println!(
        "trigger {} fired at {}; the agent saves {:.3} s of its flight recorder around it{into} \
         once the window ends",
        args.name,
        utc_text(fired.fired_at_ns),
        fired.window_stop_ns.saturating_sub(fired.window_start_ns) as f64 / 1e9
    );
    // The agent wrote these: shown escaped.
    for warning in &fired.warnings {
        eprintln!("warning: {}", printable(warning));
    }
    if !fired.warnings.is_empty() {
        return Err(super::PartlyDone(format!(
            "trigger {} fired, but its save will not land where asked (said above)",
            args.name
        ))
        .into());
    }
    Ok(())
}
