//! `devtrace session new`, `devtrace sessions` and `devtrace tool`: many hosts
//! in one session, and reading results without XProf.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use super::logdir::{self, SessionOutput};
use crate::client;
use crate::clock;
use crate::service::profiler::session_timestamp;
use crate::session;

#[derive(Debug, Args)]
pub struct SessionArgs {
    #[command(subcommand)]
    pub command: SessionCommand,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Capture every host with one shared window; traces land in
    /// LOGDIR/plugins/profile/SESSION/<host>.xplane.pb.
    New(NewSessionArgs),
}

#[derive(Debug, Args)]
pub struct NewSessionArgs {
    /// Comma-separated profiler servers (host or host:port; default port
    /// 6009; grpc:// or grpcs:// to choose plaintext or TLS for one).
    #[arg(long, value_delimiter = ',', required = true)]
    pub hosts: Vec<String>,
    /// Log directory, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (with the
    /// environment's credentials). A host whose upload fails has its trace
    /// kept in the temporary directory, named in its error.
    #[arg(long)]
    pub logdir: PathBuf,
    /// Length of the shared capture window.
    #[arg(long, default_value = "2s", value_parser = super::parse_duration)]
    pub duration: Duration,
    /// Session name; default: the current UTC time as YYYY_MM_DD_HH_MM_SS.
    #[arg(long)]
    pub session_id: Option<String>,
    #[command(flatten)]
    pub client: super::client_args::ClientArgs,
}

#[derive(Debug, Args)]
pub struct SessionsArgs {
    /// A logdir (its plugins/profile is read) or a repository root; a
    /// directory, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.
    pub dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct ToolArgs {
    /// A logdir (its plugins/profile is read) or a repository root; a
    /// directory, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.
    pub dir: PathBuf,
    pub session: String,
    /// kernel_stats, memory_profile, overview, trace_viewer or xplane.
    pub tool: String,
    /// One host (as in the file name, e.g. 10.0.0.2_8466); default: all hosts.
    #[arg(long)]
    pub host: Option<String>,
    /// Tool parameter, e.g. start_time_ms=100 (repeatable).
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Write the output here instead of standard output.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

pub fn run_session(args: SessionArgs) -> anyhow::Result<()> {
    let SessionCommand::New(args) = args.command;
    let hosts = args
        .hosts
        .iter()
        .map(|h| {
            client::Target::tcp(h, client::DEFAULT_PORT)
                .with_context(|| format!("invalid host {h:?}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let duration_ms = u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX);
    if duration_ms == 0 {
        bail!("--duration must be at least 1ms");
    }
    let session_id = args.session_id.clone().unwrap_or_else(session_timestamp);
    let root = logdir::parse(&args.logdir)?.join("plugins").join("profile");
    let output = SessionOutput::new(&root.join(&session_id))?;
    let options = client::default_profile_options(duration_ms, clock::now_ns());
    let request = client::trace_request(options, &root.to_string(), &session_id, "");
    let deadline = client::capture_deadline(args.duration);
    let config = args.client.config_for_calls()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    eprintln!("capturing {} hosts for {duration_ms} ms", hosts.len());
    let deliver: session::Deliver = {
        let session_id = session_id.clone();
        std::sync::Arc::new(move |file_name, bytes| {
            output
                .write(&session_id, file_name, bytes)
                .map(PathBuf::from)
        })
    };
    let outcomes = runtime.block_on(session::fan_out(
        &hosts, &request, deadline, &config, deliver,
    ));
    let mut delivered = 0;
    for outcome in outcomes {
        match outcome.result {
            Ok(Some(path)) => {
                println!("{}", path.display());
                delivered += 1;
            }
            Ok(None) => eprintln!("{}: returned an empty trace", outcome.host),
            Err(error) => eprintln!("{}: {error}", outcome.host),
        }
    }
    if delivered == 0 {
        bail!("no host returned a trace");
    }
    eprintln!("session {session_id}: {delivered} of {} hosts", hosts.len());
    Ok(())
}

pub fn run_sessions(args: SessionsArgs) -> anyhow::Result<()> {
    let root = logdir::repository_root(&args.dir)?;
    let sessions = session::list_sessions(&root)?;
    if sessions.is_empty() {
        eprintln!("no sessions under {}", root.display());
    }
    for s in sessions {
        println!(
            "{}\thosts: {}\ttools: {}",
            s.session_id,
            s.hosts.join(","),
            s.tools.join(",")
        );
    }
    Ok(())
}

pub fn run_tool(args: ToolArgs) -> anyhow::Result<()> {
    let mut parameters = HashMap::new();
    for param in &args.params {
        let Some((key, value)) = param.split_once('=') else {
            bail!("--param {param:?} is not KEY=VALUE");
        };
        parameters.insert(key.trim().to_string(), value.trim().to_string());
    }
    let root = logdir::repository_root(&args.dir)?;
    let session = root.join(&args.session);
    if !session.exists()? {
        bail!("no session {:?} in {}", args.session, root.display());
    }
    let output = session::tool_data(&session, args.host.as_deref(), &args.tool, &parameters)?;
    let bytes = output.into_bytes();
    match &args.output {
        Some(path) => super::write_file(
            path.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new(".")),
            path.file_name()
                .and_then(|n| n.to_str())
                .context("--output needs a file name")?,
            &bytes,
        )
        .map(|_| ())?,
        None => std::io::stdout()
            .write_all(&bytes)
            .context("writing to standard output")?,
    }
    Ok(())
}
