//! The command line: one module per subcommand.

use anyhow::Context;

mod attach;
mod capture;
mod client_args;
mod config;
mod doctor;
mod fleet_args;
mod generate;
mod inspect;
mod logdir;
mod logging;
mod memory;
mod monitor;
mod serve;
mod session;
mod tap;
mod trigger;

use clap::{Parser, Subcommand};

pub use capture::CaptureArgs;
pub use config::{command, parse};
pub use inspect::InspectArgs;
pub use logging::LogFormat;
pub use serve::ServeArgs;
pub use session::{SessionArgs, SessionsArgs, ToolArgs};
pub use tap::TapArgs;
pub use trigger::TriggerArgs;

pub use crate::model::units::{parse_duration, parse_duration_with_unit, parse_size};

/// Device-tracing agent for machine-learning hosts. It speaks TensorFlow's
/// profiler protocol, so `tf.profiler.experimental.client.trace`, the XProf
/// capture dialog and `devtrace capture` all work against it, and it writes
/// XSpace (`.xplane.pb`) traces that XProf opens.
#[derive(Debug, Parser)]
#[command(name = "devtrace", version, propagate_version = true)]
pub struct Cli {
    /// Log filter: error, warn, info, debug, trace, or a tracing directive
    /// such as `devtrace=debug`. RUST_LOG overrides it. Also
    /// DEVTRACE_LOG_LEVEL, for every subcommand.
    #[arg(long, global = true, default_value = "info", value_parser = logging::parse_filter)]
    pub log_level: String,
    /// Log lines on standard error as text, or as one JSON object per line
    /// for log collectors. Also DEVTRACE_LOG_FORMAT, for every subcommand.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: record events from the backends and serve captures.
    Serve(Box<ServeArgs>),
    /// Capture a trace from a running profiler server into a logdir.
    Capture(CaptureArgs),
    /// Summarise a trace file (.xplane.pb or .xplane.riegeli): planes,
    /// lines, events, time span.
    Inspect(InspectArgs),
    /// Profile several hosts at once into one session of a logdir.
    Session(SessionArgs),
    /// List the sessions of a logdir (or repository root), newest first (by
    /// when their traces were written).
    Sessions(SessionsArgs),
    /// Compute a tool's data (trace_viewer, memory_profile, ...) from a session.
    /// Exits 3 when some hosts' traces could not be read (the output holds
    /// the others and names them under "failed").
    Tool(ToolArgs),
    /// Forward a TensorFlow server's gRPC traffic and record its steps and ops.
    Tap(TapArgs),
    /// Ask a profiler server how busy its devices are over a short period
    /// (the Monitor RPC), once or period after period.
    Monitor(monitor::MonitorArgs),
    /// Fire a running agent's trigger rule: it saves the flight recorder's
    /// window around now as a new session.
    Trigger(TriggerArgs),
    /// Load the injection library into running CUDA processes started
    /// without it, so that captures trace their GPUs (needs root or
    /// CAP_SYS_PTRACE).
    Attach(attach::AttachArgs),
    /// Check this host the way `devtrace serve` with the same flags would
    /// use it: GPU driver, NVML, CUPTI, eBPF, perf, runtime directory,
    /// listen addresses, allow-roots, TLS files, memory, clock. Exits 0
    /// only when the chosen backends can run.
    Doctor(Box<doctor::DoctorArgs>),
    /// Write man pages, shell completions or the flag reference, made
    /// from these very definitions.
    Generate(generate::GenerateArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    logging::init(&cli.log_level, cli.log_format)?;
    let name = match &cli.command {
        Command::Serve(_) => "serve",
        Command::Doctor(_) => "doctor",
        _ => "",
    };
    let variables = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    for (given, meant) in config::misspelt_variables(name, variables) {
        tracing::warn!(
            "{given} sets nothing for devtrace {name} and is ignored: did you mean {meant}?"
        );
    }
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Attach(args) => attach::run(args),
        Command::Doctor(args) => doctor::run(*args),
        Command::Generate(args) => generate::run(args),
        Command::Capture(args) => capture::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Session(args) => session::run_session(args),
        Command::Sessions(args) => session::run_sessions(args),
        Command::Tool(args) => session::run_tool(args),
        Command::Tap(args) => tap::run(args),
        Command::Trigger(args) => trigger::run(args),
        Command::Monitor(args) => monitor::run(args),
    }
}

/// Says `line` on standard output for the scripts that read it (the
/// address a server bound); a reader that is gone, or an output that
/// cannot be written, is no reason for a server to stop.
pub(crate) fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// What a failed write of a command's output says.
pub(crate) const WRITING_OUTPUT: &str = "writing to standard output";

/// A command that did part of what it was asked (a session some hosts gave
/// no trace to): what it did not do, and the exit status that says so, so
/// that scripts tell it from both success and failure.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PartlyDone(pub String);

/// The exit status of [`PartlyDone`]; 1 is a failure, 2 a usage error.
pub const PARTLY_DONE_STATUS: u8 = 3;

/// A mistake in what the command was given that its parser cannot see (a
/// variable it reads itself): exit status 2, as the parser's own.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit status a command that failed with `error` ends with.
pub fn exit_status(error: &anyhow::Error) -> u8 {
    if error.downcast_ref::<PartlyDone>().is_some() {
        PARTLY_DONE_STATUS
    } else if error.downcast_ref::<UsageError>().is_some() {
        2
    } else {
        1
    }
}

/// Says why the command failed, as the log is written (text or JSON).
pub fn say_failure(error: &anyhow::Error) {
    logging::say_failure(&failure_text(error));
}

/// Whether `error` is the command's output closed under it (`| head`):
/// a reader that has what it wanted, so the command ends without a word,
/// as other command-line tools do.
pub fn output_closed(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    }) && error.to_string() == WRITING_OUTPUT
}

/// What the command says of a failure: the error and its causes, each
/// cause once (an error that names its cause in its own message, as many
/// of the library's do, is not followed by it again).
pub fn failure_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let said = cause.to_string();
        // Said already as the end of the message before it.
        if text.ends_with(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

/// The runtime a command's calls run on: one thread, the command's own.
pub(crate) fn call_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The server a command calls, from its address argument.
pub(crate) fn server_address(address: &str) -> anyhow::Result<crate::protocol::client::Target> {
    use crate::protocol::client::{Target, DEFAULT_PORT};
    Target::any(address, DEFAULT_PORT).with_context(|| format!("invalid address {address:?}"))
}

/// What a command may hold of the traces it reads and decodes: three
/// quarters of this machine's memory (or its cgroup's), so that a file that
/// decodes to more (a few bytes of protobuf or Brotli can stand for far
/// more) is refused, naming that, rather than taking the machine's memory.
pub(crate) fn reading_memory() -> crate::xspace::grant::Bounded {
    let limit = crate::model::memory_limit::of_this_process();
    crate::xspace::grant::Bounded::new(
        usize::try_from(limit.bytes / 4 * 3).unwrap_or(usize::MAX),
        format!("three quarters of {}", limit.source),
    )
}

/// Writes atomically: a temporary file beside the target, then rename,
/// over a file already there when `replace`, else refusing to (one another
/// command wrote meanwhile).
pub(crate) fn write_file(
    directory: &std::path::Path,
    name: &str,
    data: &[u8],
    replace: bool,
) -> anyhow::Result<std::path::PathBuf> {
    let mut file = PendingFile::create(directory, name)?;
    file.write(data)?;
    file.put_in_place(replace)
}

/// A file written in parts under a temporary name beside its target, and
/// renamed into place once complete; dropped before that, it is removed.
pub(crate) struct PendingFile {
    file: tempfile::NamedTempFile,
    target: std::path::PathBuf,
    _listed: Unfinished,
}

/// The temporary files of the [`PendingFile`]s of this process not yet in
/// place: a command ended by a signal removes them with
/// [`remove_unfinished_files`], since no drop runs then.
static UNFINISHED: parking_lot::Mutex<Vec<std::path::PathBuf>> =
    parking_lot::Mutex::new(Vec::new());

/// A temporary file's place in [`UNFINISHED`], while it is there.
struct Unfinished(std::path::PathBuf);

impl Drop for Unfinished {
    fn drop(&mut self) {
        UNFINISHED.lock().retain(|path| *path != self.0);
    }
}

/// Set once [`remove_unfinished_files`] has run: the process is ending,
/// and a write it cut off keeps nothing of its own (a copy made as the
/// process dies would be cut off too).
static CUT_OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process's writes were cut off ([`remove_unfinished_files`]).
pub(crate) fn cut_off() -> bool {
    CUT_OFF.load(std::sync::atomic::Ordering::Acquire)
}

/// The files this process put in place, whole.
static PLACED: parking_lot::Mutex<Vec<std::path::PathBuf>> = parking_lot::Mutex::new(Vec::new());

/// Whether this process put `path` in place, whole (not whether a file is
/// there: another command may have put one there).
pub(crate) fn placed(path: &std::path::Path) -> bool {
    PLACED.lock().iter().any(|placed| placed == path)
}

/// Removes the temporary files of the files this process is writing, for a
/// command that ends at once (by a signal): what it removed. From then on
/// no new one is begun or put in place ([`cut_off`]); one put in place
/// before is [`placed`].
pub(crate) fn remove_unfinished_files() -> Vec<std::path::PathBuf> {
    {
        // Under the list's lock: see `PendingFile::create`.
        let _listed = UNFINISHED.lock();
        CUT_OFF.store(true, std::sync::atomic::Ordering::Release);
    }
    remove_listed(|_| true)
}

/// Removes the listed temporary files `which` picks: what it removed.
fn remove_listed(which: impl Fn(&std::path::Path) -> bool) -> Vec<std::path::PathBuf> {
    let picked: Vec<std::path::PathBuf> = {
        let mut listed = UNFINISHED.lock();
        let (picked, kept) = std::mem::take(&mut *listed)
            .into_iter()
            .partition(|path| which(path));
        *listed = kept;
        picked
    };
    picked
        .into_iter()
        .filter(|path| std::fs::remove_file(path).is_ok())
        .collect()
}

impl PendingFile {
    /// Starts `directory/name`, making the directory when needed.
    pub(crate) fn create(directory: &std::path::Path, name: &str) -> anyhow::Result<PendingFile> {
        std::fs::create_dir_all(directory)
            .with_context(|| format!("creating {}", directory.display()))?;
        // Begun and listed under the list's lock, which the cut-off takes
        // too: no file is begun after it that it would not remove.
        let mut listed = UNFINISHED.lock();
        if cut_off() {
            anyhow::bail!(
                "the command is ending: {} is not begun",
                directory.join(name).display()
            );
        }
        let file = tempfile::NamedTempFile::new_in(directory)
            .with_context(|| format!("writing into {}", directory.display()))?;
        listed.push(file.path().to_path_buf());
        drop(listed);
        Ok(PendingFile {
            _listed: Unfinished(file.path().to_path_buf()),
            file,
            target: directory.join(name),
        })
    }

    pub(crate) fn write(&mut self, data: &[u8]) -> anyhow::Result<()> {
        use std::io::Write;
        self.file
            .write_all(data)
            .with_context(|| format!("writing {}", self.target.display()))
    }

    /// Puts the file in place (mode 0644 less the umask), not over a file
    /// at the target already (it is an error then); where it is.
    pub(crate) fn commit_new(self) -> anyhow::Result<std::path::PathBuf> {
        self.put_in_place(false)
    }

    /// Puts the file in place (mode 0644 less the umask); with `replace`
    /// false, not over a file at the target already.
    fn put_in_place(self, replace: bool) -> anyhow::Result<std::path::PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        // Its place in the list is left (taking the list's lock) only once
        // the list's lock below is let go.
        let PendingFile {
            file,
            target,
            _listed: unfinished,
        } = self;
        file.as_file()
            .set_permissions(std::fs::Permissions::from_mode(
                0o644 & !crate::repository::beneath::process_umask(),
            ))
            .and_then(|()| file.as_file().sync_all())
            .with_context(|| format!("writing {}", target.display()))?;
        // Renamed and listed as placed under the list's lock, which the
        // cut-off takes too: a signal's handler finds the file either
        // unfinished (and removes it) or placed, never renamed but unlisted
        // (it kept a second copy then).
        let listed = UNFINISHED.lock();
        if cut_off() {
            anyhow::bail!(
                "the command is ending: {} is not put in place",
                target.display()
            );
        }
        // A failed persist's own message repeats its cause's: the cause
        // alone is said.
        if replace {
            file.persist(&target)
                .map_err(|failed| failed.error)
                .with_context(|| format!("writing {}", target.display()))?;
        } else if let Err(failed) = file.persist_noclobber(&target) {
            let error = failed.error;
            if error.kind() == std::io::ErrorKind::AlreadyExists {
                return Err(error)
                    .with_context(|| format!("{} was written meanwhile", target.display()));
            }
            return Err(error).with_context(|| format!("writing {}", target.display()));
        }
        PLACED.lock().push(target.clone());
        drop(listed);
        drop(unfinished);
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command ended by a signal finds the temporary files of the files
    /// it was writing, and only those (a drop that never runs left them in
    /// the logdir, hundreds of megabytes each).
    #[test]
    fn unfinished_files_are_found_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut cut_off = PendingFile::create(dir.path(), "cut.xplane.pb").unwrap();
        cut_off.write(b"half a trace").unwrap();
        let temporary = cut_off.file.path().to_path_buf();
        let mut done = PendingFile::create(dir.path(), "done.xplane.pb").unwrap();
        done.write(b"a trace").unwrap();
        let written = done.commit_new().unwrap();

        // Other tests write at the same time: this one's are in this
        // directory (and the process is not cut off: `remove_unfinished_files`
        // is `remove_listed` of them all, and says so).
        let removed = remove_listed(|path| path.starts_with(dir.path()));
        assert_eq!(removed, std::slice::from_ref(&temporary));
        assert!(!temporary.exists());
        assert!(written.exists(), "a file in place stays");
        assert!(placed(&written));
        assert!(!placed(&dir.path().join("cut.xplane.pb")));
        std::mem::forget(cut_off);
    }

    #[test]
    fn a_failure_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let read = crate::xspace::read::ReadError::Io {
            path: "t.pb".into(),
            source: io,
        };
        let error = anyhow::Error::new(read).context("inspecting");
        assert_eq!(
            failure_text(&error),
            "inspecting: cannot read t.pb: No such file"
        );
        // Causes that are not in the message are all said.
        let plain = anyhow::anyhow!("the root")
            .context("the middle")
            .context("the top");
        assert_eq!(failure_text(&plain), "the top: the middle: the root");
    }
}
