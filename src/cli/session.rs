//! `devtrace session new`, `devtrace sessions` and `devtrace tool`: many hosts
//! in one session, and reading results without XProf.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use super::logdir::{self, SessionOutput};
use crate::clock;
use crate::fleet::hosts::{self, HostList, Origin, COMMAND_LINE_LIMIT};
use crate::fleet::{self, HostOutcome};
use crate::model::printable::printable;
use crate::protocol::client;

#[derive(Debug, Args)]
pub struct SessionArgs {
    #[command(subcommand)]
    pub command: SessionCommand,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Capture every host with one shared window; traces land in
    /// LOGDIR/plugins/profile/SESSION/<host>.xplane.pb (<host>.xplane.riegeli
    /// for one a devtrace agent stores as chunks, past its
    /// --chunk-traces-over).
    #[command(after_help = NEW_SESSION_EXIT_STATUS)]
    New(NewSessionArgs),
}

const NEW_SESSION_EXIT_STATUS: &str = "Exit status: 0 when every host's trace landed; 3 when \
some did and others gave none (those are named with their reasons, the traces that landed are \
listed on standard output and kept); 1 when none did or the session could not start.";

#[derive(Debug, Args)]
pub struct NewSessionArgs {
    /// Profiler servers, comma-separated (repeatable): host or host:port
    /// (default port 6009); Slurm hostlists such as gpu[001-128] or
    /// rack[1-2]-n[1,3-5]:6010; dns:NAME[:PORT] for every A and AAAA record
    /// of NAME (a Kubernetes headless Service); @FILE for one entry per
    /// line (# starts a comment). grpc:// or grpcs:// in front of an entry
    /// chooses plaintext or TLS for its hosts. At most 65,536 hosts.
    #[arg(long, required = true, value_name = "HOSTS")]
    pub hosts: Vec<String>,
    /// Log directory, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (with the
    /// environment's credentials). A host whose upload fails has its trace
    /// kept in the temporary directory, named in its error.
    #[arg(long)]
    pub logdir: PathBuf,
    /// Length of the shared capture window (e.g. 2s, 500ms).
    #[arg(long, allow_hyphen_values = true, default_value = "2s", value_parser = super::parse_duration_with_unit)]
    pub duration: Duration,
    /// Session name; default: the current UTC time as YYYY_MM_DD_HH_MM_SS,
    /// with _2, _3, ... when a session of the same second exists already.
    #[arg(long, value_parser = super::logdir::parse_session_id)]
    pub session_id: Option<String>,
    #[command(flatten)]
    pub client: super::client_args::ClientArgs,
    #[command(flatten)]
    pub fleet: super::fleet_args::FleetArgs,
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
    /// The session (run) to read, as `devtrace sessions DIR` lists them.
    pub session: String,
    /// kernel_stats, memory_profile, overview, trace_viewer or xplane.
    pub tool: String,
    /// One host (as in the file name, e.g. 10.0.0.2_8466); default: all hosts.
    #[arg(long)]
    pub host: Option<String>,
    /// Tool parameter, e.g. start_time_ms=100 (repeatable). trace_viewer
    /// takes start_time_ms, end_time_ms and resolution (the most events:
    /// 100000 unless given; 0 for all); overview takes top.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Write the output here instead of standard output.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

pub fn run_session(args: SessionArgs) -> anyhow::Result<()> {
    let SessionCommand::New(args) = args.command;
    let mut list = HostList::new(
        Origin::CommandLine,
        client::DEFAULT_PORT,
        COMMAND_LINE_LIMIT,
    );
    for text in &args.hosts {
        list.add(text).context("--hosts")?;
    }
    let entries = list.finish().context("--hosts")?;
    let duration_ms = u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX);
    if duration_ms == 0 {
        bail!("--duration must be at least 1ms");
    }
    let root = logdir::parse(&args.logdir)?.join("plugins").join("profile");
    let config = args.client.config_for_calls()?;
    // Before any host is called: a logdir that cannot be written to fails
    // now, not once the traces are in.
    let (output, session_id) = SessionOutput::create(&root, args.session_id.as_deref())?;
    let output = Arc::new(output);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let resolver = Arc::new(args.fleet.resolver());
    // From the lookups on, a signal ends the session cleanly (see `cancel`).
    let resolved = runtime.block_on(async {
        tokio::select! {
            resolved = hosts::resolve(
                entries,
                &resolver,
                &config,
                COMMAND_LINE_LIMIT,
                client::capture_deadline(args.duration),
            ) => resolved,
            signal = super::capture::cancelled() => cancel(&output, signal),
        }
    });
    let mut outcomes = HostOutcome::unresolved(resolved.failures);
    let hosts = resolved.targets;
    // A session named on the command line may hold traces already: none
    // is written over, as `capture` writes none over.
    let taken = output.held_traces(&fleet::host_file_parts(&hosts));
    if !taken.is_empty() {
        output.abandon();
        bail!(
            "session {session_id} under {root} holds traces of these hosts already ({}): name \
             another --session-id, or leave it out for a new session",
            taken.join(", ")
        );
    }
    if !hosts.is_empty() {
        // The window starts once the hosts are known, so that lookups do
        // not eat into it.
        let options = client::default_profile_options(duration_ms, clock::now_ns());
        let request = client::trace_request(options, &root.to_string(), &session_id, "");
        let plan = fleet::FanOut {
            deadline: client::capture_deadline(args.duration),
            concurrent_hosts: args.fleet.concurrent_hosts,
            client: config,
        };
        let noun = if hosts.len() == 1 { "host" } else { "hosts" };
        eprintln!("capturing {} {noun} for {duration_ms} ms", hosts.len());
        let sink = Arc::new(LogdirSink {
            output: Arc::clone(&output),
            session_id: session_id.clone(),
        });
        let fanned_out = runtime.block_on(async {
            tokio::select! {
                outcomes = fleet::fan_out(&hosts, &request, &plan, sink) => outcomes,
                signal = super::capture::cancelled() => cancel(&output, signal),
            }
        });
        outcomes.extend(fanned_out);
    }
    // The signals end the command again, as before the session.
    super::capture::default_cancelling();
    let mut delivered = 0;
    for outcome in &outcomes {
        if let Ok(Some(path)) = &outcome.result {
            println!("{}", path.display());
            delivered += 1;
        }
    }
    if let Some((headline, lines)) = fleet::failure_summary(&outcomes) {
        for line in lines {
            eprintln!("{line}");
        }
        eprintln!("{headline}");
    }
    if delivered == 0 {
        output.abandon();
        bail!("no host returned a trace");
    }
    let summary = format!(
        "session {session_id}: {delivered} of {} hosts",
        outcomes.len()
    );
    if delivered < outcomes.len() {
        return Err(super::PartlyDone(summary).into());
    }
    eprintln!("{summary}");
    Ok(())
}

/// Ends the command by `signal` during a session: the traces written whole
/// so far stay; those being written are removed (no drop runs as the
/// process ends), with the directories made for the session when nothing
/// else is in them; the hosts' captures end as their calls go.
fn cancel(output: &SessionOutput, signal: libc::c_int) -> ! {
    let removed = super::remove_unfinished_files();
    super::logdir::remove_made_directories(output.made_directories());
    let signal_text = super::capture::signal_name(signal);
    let kept = match output {
        SessionOutput::Local { directory, .. } if !directory.exists() => format!(
            "{} unfinished trace file(s) removed; no trace was written whole, and the \
             session's empty directory was removed",
            removed.len()
        ),
        SessionOutput::Local { directory, .. } => format!(
            "{} unfinished trace file(s) removed; the traces written whole stay in {}",
            removed.len(),
            directory.display()
        ),
        SessionOutput::Object { folder, .. } => format!(
            "the traces uploaded whole stay in {}; one being received or uploaded is cut off",
            folder.display()
        ),
    };
    eprintln!("devtrace: the session was cancelled ({signal_text}): {kept}");
    super::capture::die_of(signal)
}

/// A session directory or bucket prefix under `--logdir`, made before the
/// hosts are called.
struct LogdirSink {
    output: Arc<SessionOutput>,
    session_id: String,
}

impl fleet::TraceSink for LogdirSink {
    fn create(&self, file_name: &str) -> Result<Box<dyn fleet::TraceFile>, String> {
        match self.output.as_ref() {
            SessionOutput::Local { directory, .. } => {
                super::PendingFile::create(directory, file_name)
                    .map(|file| Box::new(file) as Box<dyn fleet::TraceFile>)
                    .map_err(|e| format!("{e:#}"))
            }
            SessionOutput::Object { folder, .. } => crate::repository::create_file(
                Ok(folder),
                &self.session_id,
                file_name,
                &std::env::temp_dir(),
            )
            .map(|file| Box::new(file) as Box<dyn fleet::TraceFile>),
        }
    }
}

impl fleet::TraceFile for super::PendingFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        super::PendingFile::write(self, bytes).map_err(|e| format!("{e:#}"))
    }

    fn commit(self: Box<Self>) -> Result<PathBuf, String> {
        // Not over a trace another command wrote meanwhile.
        super::PendingFile::commit_new(*self).map_err(|e| format!("{e:#}"))
    }
}

pub fn run_sessions(args: SessionsArgs) -> anyhow::Result<()> {
    let root = logdir::repository_root(&args.dir)?;
    let sessions = fleet::list_sessions_within(&root, &mut super::reading_memory())?;
    if sessions.is_empty() {
        eprintln!("no sessions under {}", root.display());
        if let Some(logdir) = logdir::logdir_of_session(&root) {
            // XProf shows such a directory as empty too.
            eprintln!(
                "it is a session itself: give its logdir, `devtrace sessions {}` (and point \
                 XProf there)",
                super::capture::shell_word(&logdir.display().to_string())
            );
        }
    }
    let mut out = std::io::stdout().lock();
    // Names of directories and files anyone who could write there chose.
    for s in sessions {
        write!(
            out,
            "{}\thosts: {}\ttools: {}",
            printable(&s.session_id),
            printable(&s.hosts.join(",")),
            s.tools.join(",")
        )
        .context(super::WRITING_OUTPUT)?;
        if !s.unreadable.is_empty() {
            write!(
                out,
                "\tunreadable: {} (not a trace, or not yours to read)",
                printable(&s.unreadable.join(","))
            )
            .context(super::WRITING_OUTPUT)?;
        }
        writeln!(out).context(super::WRITING_OUTPUT)?;
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
    let computed = fleet::tool_data(
        &session,
        args.host.as_deref(),
        &args.tool,
        &parameters,
        &mut super::reading_memory(),
    )?;
    for left_out in &computed.left_out {
        eprintln!("{}: {left_out}", args.tool);
    }
    let bytes = computed.output.into_bytes();
    match &args.output {
        Some(path) => super::write_file(
            path.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new(".")),
            path.file_name()
                .and_then(|n| n.to_str())
                .context("--output needs a file name")?,
            &bytes,
            true,
        )
        .map(|_| ())?,
        None => {
            use std::io::IsTerminal;
            // An XSpace or other binary output is for a file, not a screen.
            if std::io::stdout().is_terminal() && std::str::from_utf8(&bytes).is_err() {
                bail!(
                    "{}'s output is binary: write it to a file with -o FILE",
                    args.tool
                );
            }
            std::io::stdout()
                .write_all(&bytes)
                .context(super::WRITING_OUTPUT)?
        }
    }
    if computed.failed_hosts > 0 {
        return Err(super::PartlyDone(format!(
            "{}: {} of the session's {} hosts left out (said above)",
            args.tool, computed.failed_hosts, computed.hosts
        ))
        .into());
    }
    Ok(())
}
