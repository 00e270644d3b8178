//! `devtrace capture`: a client of the profiler protocol that sends the same
//! request as TensorFlow's `client.trace`, so it works against devtrace and
//! against TensorFlow's or JAX's own profiler servers.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::logdir::SessionOutput;
use crate::clock;
use crate::model::printable::printable;
use crate::protocol::client;
use crate::protocol::{RIEGELI_TOOL, XPLANE_TOOL};
use crate::repository::XPLANE_SUFFIX;
use crate::repository::{Folder, Location};
use crate::xspace::chunks::RIEGELI_SUFFIX;

#[derive(Debug, Args)]
pub struct CaptureArgs {
    /// Profiler server address: host:port, grpc://host:port (plaintext),
    /// grpcs://host:port (TLS) or unix:PATH (a local agent's --listen-unix).
    pub address: String,

    /// Length of the capture window (e.g. 2s, 500ms).
    #[arg(long, allow_hyphen_values = true, default_value = "2s", value_parser = super::parse_duration_with_unit)]
    pub duration: Duration,

    /// Log directory, or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (with the
    /// environment's credentials); the trace lands in
    /// LOGDIR/plugins/profile/SESSION/. An upload that fails keeps the
    /// trace in the temporary directory and says where.
    #[arg(long)]
    pub logdir: PathBuf,

    /// Session (run) name; default: the current UTC time as
    /// YYYY_MM_DD_HH_MM_SS, with _2, _3, ... when a capture of the same
    /// second made that session already. A session in a local logdir
    /// that holds a trace of this host already is refused before
    /// capturing, and a trace is never written over another.
    #[arg(long, value_parser = super::logdir::parse_session_id)]
    pub session_id: Option<String>,

    /// Start the window this long from now (e.g. 1s).
    #[arg(long, allow_hyphen_values = true, default_value = "0s", value_parser = super::parse_duration_with_unit)]
    pub delay: Duration,

    /// Start the window this long in the past (served from devtrace's flight
    /// recorder; other servers start at once, which is then said). The window still lasts
    /// --duration: `--delay-back 4s --duration 4s` is the 4 s before now.
    #[arg(long, allow_hyphen_values = true, default_value = "0s", value_parser = super::parse_duration_with_unit, conflicts_with = "delay")]
    pub delay_back: Duration,

    /// Name of the trace file's host part (default: the address with ':' as '_').
    #[arg(long, value_parser = parse_override_hostname)]
    pub override_hostname: Option<String>,

    /// ProfileOptions.device_tracer_level: 0 off, 1 on (TensorFlow's
    /// default); devtrace records every CUDA API call of injected workloads
    /// at 2 or more, not only those that put work on the timeline.
    #[arg(long, default_value_t = 1)]
    pub device_tracer_level: u32,

    /// Have the agent load the injection library into this running CUDA
    /// process (started without it) before the window, so that the
    /// capture holds its GPU (repeatable; a devtrace agent on the same
    /// host; your own processes, or any as an admin). See `devtrace attach`.
    #[arg(long = "attach", value_name = "PID")]
    pub attach: Vec<u32>,

    /// Do not draw a progress bar.
    #[arg(long)]
    pub quiet: bool,

    #[command(flatten)]
    pub client: super::client_args::ClientArgs,
}

pub fn run(args: CaptureArgs) -> anyhow::Result<()> {
    // Outside the runtime: a bucket's session is looked into with blocking
    // calls of their own.
    let prepared = prepare(&args)?;
    let runtime = super::call_runtime()?;
    let captured = runtime.block_on(capture(&args, prepared))?;
    let in_bucket = matches!(captured.session_dir, Location::Object(_));
    // As a shell reads it back: the logdir resolved (a `~` that reached
    // here unexpanded named a directory of that name), quoted when needed.
    let logdir = shell_word(&captured.logdir.to_string());
    let warnings = trace_warnings(&captured.reply);
    let received = Instant::now();
    // A signal while the files are written (an upload can take minutes),
    // or a written one is looked into, keeps the trace on this machine,
    // says where, and ends the command.
    let unsent = Unsent::of(&captured);
    let look_back = !args.delay_back.is_zero();
    let stored = runtime.block_on(async {
        let storing = tokio::task::spawn_blocking(move || {
            if look_back {
                tell_late_start(&captured);
            }
            store(captured)
        });
        tokio::select! {
            stored = storing => stored.context("writing the trace")?,
            signal = cancelled() => unsent.keep_and_die(signal),
        }
    });
    default_cancelling();
    let path = match stored {
        Ok(path) => path,
        Err(error) => {
            // The trace was kept elsewhere, or lost: what it warns of still
            // matters.
            tell_warnings(&warnings, None);
            return Err(error);
        }
    };
    // What a capture takes past its window, in two parts: the server's
    // answer, and this side's writing (and syncing) of the files.
    tracing::info!(
        written_ms = received.elapsed().as_millis() as u64,
        "trace stored"
    );
    println!("{path}");
    tell_warnings(&warnings, Some(&path));
    if in_bucket {
        eprintln!(
            "view it with: xprof --logdir {logdir} (then open the Profile tab), or devtrace sessions {logdir}"
        );
    } else {
        let path = shell_word(&path);
        eprintln!(
            "view it with: xprof --logdir {logdir} (then open the Profile tab), or devtrace inspect {path}"
        );
    }
    Ok(())
}

/// `--override-hostname`: what names the trace file `<host>.xplane.pb`,
/// so one plain file-name component that readers of sessions take for a
/// host's (not empty, not hidden).
fn parse_override_hostname(text: &str) -> Result<String, String> {
    if text.is_empty() || text.starts_with('.') {
        return Err(format!(
            "{text:?} would name a hidden file that XProf and devtrace sessions pass over: \
             give a host name"
        ));
    }
    crate::service::validate::name_component("--override-hostname", text)
        .map_err(|status| status.message().to_string())?;
    Ok(text.to_string())
}

/// The signals that cancel a capture during its window: Ctrl-C, a stop
/// from a service manager or `timeout` (SIGTERM), a closed terminal.
const CANCELLING: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Whether `signal` is ignored (SIGINT of a shell's background job,
/// SIGHUP under `nohup`, a `trap '' TERM`).
fn ignored(signal: libc::c_int) -> bool {
    // SAFETY: a query of the signal's disposition into a zeroed sigaction.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

/// Resolves with the first of the [`CANCELLING`] signals to arrive that
/// was not ignored when the command started; never, if all were.
pub(super) async fn cancelled() -> libc::c_int {
    use super::serve::next_signal;
    use tokio::signal::unix::{signal, SignalKind};
    let [mut interrupt, mut terminate, mut hang_up] = CANCELLING.map(|number| {
        (!ignored(number))
            .then(|| signal(SignalKind::from_raw(number)).ok())
            .flatten()
    });
    tokio::select! {
        () = next_signal(&mut interrupt) => libc::SIGINT,
        () = next_signal(&mut terminate) => libc::SIGTERM,
        () = next_signal(&mut hang_up) => libc::SIGHUP,
    }
}

/// Gives the [`CANCELLING`] signals back their default action (ending the
/// process), replacing the handlers [`cancelled`] installed; an ignored one
/// stays ignored.
pub(super) fn default_cancelling() {
    for number in CANCELLING {
        if !ignored(number) {
            // SAFETY: sets the signal's disposition to the default.
            unsafe { libc::signal(number, libc::SIG_DFL) };
        }
    }
}

/// Ends the process by `signal`, as it would have ended without a handler,
/// so that a shell running it in a loop or a script stops too.
pub(super) fn die_of(signal: libc::c_int) -> ! {
    default_cancelling();
    // SAFETY: raising a signal whose action is now the default.
    unsafe { libc::raise(signal) };
    std::process::exit(128 + signal)
}

/// One of the [`CANCELLING`] signals as a user would name it.
pub(super) fn signal_name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGINT => "Ctrl-C",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// `text` as one word for a POSIX shell: as is when it holds nothing a
/// shell reads specially, else in single quotes.
pub(super) fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./:@%+=,-".contains(c));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// The warnings of the reply's trace (a process not attached, a window
/// the flight recorder did not hold whole, events lost): none for a trace
/// in Riegeli chunks or written by the server itself.
fn trace_warnings(reply: &client::RawProfileResponse) -> Vec<String> {
    let Some(trace) = inline_trace(reply) else {
        return Vec::new();
    };
    // What failed (an upstream that did not answer) first, then the rest.
    let (errors, warnings) = crate::xspace::read::errors_and_warnings(trace).unwrap_or_default();
    errors
        .into_iter()
        .map(|error| format!("(error) {error}"))
        .chain(warnings)
        .collect()
}

/// How many of a trace's warnings are printed after a capture.
const WARNINGS_SHOWN: usize = 10;

/// Says on stderr what the trace at `path` (where it went, when it went
/// where it was meant to) warns of, so that a partial trace is not taken
/// for a whole one.
fn tell_warnings(warnings: &[String], path: Option<&str>) {
    for warning in warnings.iter().take(WARNINGS_SHOWN) {
        eprintln!("the trace warns: {warning}");
    }
    if warnings.len() > WARNINGS_SHOWN {
        let inspect = path.unwrap_or("FILE");
        eprintln!(
            "the trace warns of {} more: devtrace inspect {inspect} lists them all",
            warnings.len() - WARNINGS_SHOWN
        );
    }
}

/// The trace files of a reply, kept aside while they are written, so that
/// a signal in the meantime can keep them on this machine.
struct Unsent {
    session_id: String,
    files: Vec<(String, bytes::Bytes)>,
    /// The session's directory, when it is one: a write there cut off
    /// never finishes.
    local_directory: Option<std::path::PathBuf>,
    /// The local directories made for the session, deepest first.
    made: Vec<std::path::PathBuf>,
}

impl Unsent {
    fn of(captured: &Captured) -> Unsent {
        let files = captured
            .reply
            .tool_data
            .iter()
            .filter(|tool| tool.name == XPLANE_TOOL || tool.name == RIEGELI_TOOL)
            .map(|tool| {
                (
                    format!("{}.{}", captured.host, tool.name),
                    tool.data.clone(),
                )
            })
            .collect();
        Unsent {
            session_id: captured.session_id.clone(),
            files,
            local_directory: match &captured.output {
                SessionOutput::Local { directory, .. } => Some(directory.clone()),
                SessionOutput::Object { .. } => None,
            },
            made: captured.output.made_directories().to_vec(),
        }
    }

    /// Ends the process by `signal` with the trace safe, saying where it
    /// is. A local write is cut off: a file already in place is where the
    /// trace is; else its unfinished file goes (with the directories made
    /// for it, when nothing else is in them) and the trace is kept under
    /// the temporary directory. An upload may still finish (the server may
    /// have it all), and the trace is kept too. Everything is done before
    /// anything is said: after a hangup the terminal may refuse what is
    /// written to it.
    fn keep_and_die(&self, signal: libc::c_int) -> ! {
        let removed = super::remove_unfinished_files();
        let mut said = Vec::new();
        for (name, bytes) in &self.files {
            let in_place = self
                .local_directory
                .as_ref()
                .map(|directory| directory.join(name))
                // Put in place whole (a rename) by this command, or not at
                // all.
                .filter(|path| super::placed(path));
            said.push(match in_place {
                Some(path) => format!("as the trace was written: it is at {}", path.display()),
                None => self.keep(name, bytes, &removed),
            });
        }
        // One begun as the first were removed is refused; one that began
        // just before goes now.
        super::remove_unfinished_files();
        super::logdir::remove_made_directories(&self.made);
        let signal_text = signal_name(signal);
        let mut stderr = std::io::stderr();
        if said.is_empty() {
            let _ = writeln!(
                stderr,
                "devtrace: {signal_text} while the trace was being stored: the server wrote it \
                 itself, and nothing of it is held here"
            );
        }
        for said in said {
            let _ = writeln!(stderr, "devtrace: {signal_text} {said}");
        }
        die_of(signal)
    }

    /// Keeps one file of the trace under the temporary directory; what to
    /// say of it.
    fn keep(&self, name: &str, bytes: &[u8], removed: &[std::path::PathBuf]) -> String {
        let dir = std::env::temp_dir();
        let kept = match crate::repository::keep_unsent(&dir, &self.session_id, name, bytes) {
            Ok(kept) => format!("it is kept at {}", kept.display()),
            Err(error) => format!(
                "keeping it under {} failed ({error}): it is lost",
                dir.display()
            ),
        };
        let cut_off = if self.local_directory.is_none() {
            ", which may still finish".to_string()
        } else if removed.is_empty() {
            String::new()
        } else {
            let removed: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            format!(" (its unfinished file {} is removed)", removed.join(", "))
        };
        format!("while the trace was being written{cut_off}: {kept}")
    }
}

/// A reply and where its files go.
struct Captured {
    reply: client::RawProfileResponse,
    target: String,
    /// Where the window asked for began.
    asked_start_ns: u64,
    logdir: Location,
    output: SessionOutput,
    session_dir: Location,
    session_id: String,
    host: String,
}

/// What a capture needs before it calls the server.
struct Prepared {
    target: client::Target,
    config: client::ClientConfig,
    duration_ms: u64,
    session: Session,
    output: SessionOutput,
}

/// Reads the arguments and makes the session the trace goes into, before
/// capturing, so that a logdir that cannot be written to (or a bucket's
/// settings) fails now rather than after the window.
fn prepare(args: &CaptureArgs) -> anyhow::Result<Prepared> {
    let target = super::server_address(&args.address)?;
    let config = args.client.config_for_calls()?;
    let duration_ms = u64::try_from(args.duration.as_millis()).unwrap_or(u64::MAX);
    if duration_ms == 0 {
        bail!("--duration must be at least 1ms");
    }
    let logdir = super::logdir::parse(&args.logdir)?;
    let repository_root = logdir.join("plugins").join("profile");
    // The server names the trace after host_name; a local socket's server
    // is this machine.
    let host_name = if target.is_unix() {
        crate::capture::local_hostname()
    } else {
        target.address.clone()
    };
    let host = args
        .override_hostname
        .clone()
        .unwrap_or_else(|| crate::fleet::host_file_part(&host_name));
    let (output, session_id) = SessionOutput::create(&repository_root, args.session_id.as_deref())?;
    let session = Session {
        logdir,
        repository_root,
        session_id,
        host_name,
        host,
    };
    if let Some(name) = output
        .held_traces(std::slice::from_ref(&session.host))
        .first()
    {
        bail!(
            "session {} under {} holds a trace of this host already ({name}): name another \
             --session-id, or leave it out for a new session",
            session.session_id,
            session.repository_root
        );
    }
    Ok(Prepared {
        target,
        config,
        duration_ms,
        session,
        output,
    })
}

async fn capture(args: &CaptureArgs, prepared: Prepared) -> anyhow::Result<Captured> {
    let Prepared {
        target,
        config,
        duration_ms,
        session,
        output,
    } = prepared;
    let requested = tokio::select! {
        reply = request_trace(args, &target, &config, duration_ms, &session) => reply,
        // The call is dropped with its connection, which ends the capture
        // on the server too.
        signal = cancelled() => {
            // Another signal now ends the command at once.
            default_cancelling();
            output.abandon();
            // After a hangup the terminal may refuse what is written to it.
            let _ = writeln!(
                std::io::stderr(),
                "devtrace: the capture was cancelled ({}): nothing was written",
                signal_name(signal)
            );
            die_of(signal);
        }
    };
    match requested {
        Ok((reply, asked_start_ns)) => Ok(Captured {
            reply,
            target: target.to_string(),
            asked_start_ns,
            logdir: session.logdir,
            output,
            session_dir: session.repository_root.join(&session.session_id),
            session_id: session.session_id,
            host: session.host,
        }),
        Err(error) => {
            output.abandon();
            Err(error)
        }
    }
}

/// Where a capture's trace is to go, and what the server calls it.
struct Session {
    logdir: Location,
    repository_root: Location,
    session_id: String,
    /// The server's name for itself, in the request.
    host_name: String,
    /// The trace file's host part.
    host: String,
}

/// Asks `target` for the window and waits for its reply.
async fn request_trace(
    args: &CaptureArgs,
    target: &client::Target,
    config: &client::ClientConfig,
    duration_ms: u64,
    session: &Session,
) -> anyhow::Result<(client::RawProfileResponse, u64)> {
    let start_ns =
        clock::now_ns() + clock::duration_ns(args.delay) - clock::duration_ns(args.delay_back);
    let mut options = client::default_profile_options(duration_ms, start_ns);
    options.repository_path = session.logdir.to_string();
    options.session_id = session.session_id.clone();
    if let Some(name) = &args.override_hostname {
        options.override_hostname = name.clone();
    }
    options.device_tracer_level = args.device_tracer_level;
    if !args.attach.is_empty() {
        let pids: Vec<String> = args.attach.iter().map(u32::to_string).collect();
        options.advanced_configuration.insert(
            crate::service::profiler::ATTACH_KEY.to_string(),
            crate::proto::tensorflow::profile_options::AdvancedConfigValue {
                value: Some(
                    crate::proto::tensorflow::profile_options::advanced_config_value::Value::StringValue(
                        pids.join(","),
                    ),
                ),
            },
        );
    }
    let request = client::trace_request(
        options,
        &session.repository_root.to_string(),
        &session.session_id,
        &session.host_name,
    );
    let deadline = client::capture_deadline(args.duration) + args.delay;
    let connection = client::connect(target, config, deadline)
        .await
        .with_context(|| format!("cannot reach a profiler server at {target}"))?;
    let progress = progress_bar(args, duration_ms);
    let asked_ns = clock::now_ns();
    let reply = connection.profile(request).await;
    drop(progress);
    if let Err(refused @ client::CallError::TooLarge { .. }) = &reply {
        bail!(
            "capture from {target} failed: {refused}; ask again with a larger --max-reply-size \
             (the same window, with --delay-back, while the server's flight recorder still \
             holds it)"
        );
    }
    let reply = reply.with_context(|| format!("capture from {target} failed"))?;
    // Timed from the window the server recorded, which for one that
    // records from when it is called is not the one asked for in the past.
    let recorded_from_ns = inline_trace(&reply)
        .and_then(crate::xspace::read::recording_start_ns)
        .unwrap_or(start_ns);
    let window_end_ns = recorded_from_ns.saturating_add(duration_ms.saturating_mul(1_000_000));
    // What the reply took past the window, or past the request for a window
    // over before it was asked for (a look back).
    tracing::info!(
        after_window_ms = clock::now_ns().saturating_sub(window_end_ns.max(asked_ns)) / 1_000_000,
        bytes = reply
            .tool_data
            .iter()
            .map(|tool| tool.data.len())
            .sum::<usize>(),
        "reply received"
    );
    if reply.empty_trace {
        // What the trace says of itself tells why (a capture scoped to the
        // caller's processes, a backend that is not running).
        let said = trace_warnings(&reply);
        if said.is_empty() {
            bail!("{target} collected no trace events in the window");
        }
        bail!(
            "{target} collected no trace events in the window; its trace says: {}",
            said.join("; ")
        );
    }
    Ok((reply, start_ns))
}

/// The XSpace a reply carries, when it carries one whole.
fn inline_trace(reply: &client::RawProfileResponse) -> Option<&[u8]> {
    reply
        .tool_data
        .iter()
        .find(|tool| tool.name == XPLANE_TOOL)
        .map(|tool| &tool.data[..])
}

/// Says when the server began recording well after the window asked for
/// began: a window in the past (`--delay-back`) asked of a server that
/// records from when it is called is another window. Read from the reply's
/// trace, or the one the server wrote itself where this side can read it,
/// if it is small enough to read for a message (its Task Environment comes
/// last).
fn tell_late_start(captured: &Captured) {
    const MOST_READ: u64 = 64 << 20;
    let recorded_from_ns = match inline_trace(&captured.reply) {
        Some(trace) => crate::xspace::read::recording_start_ns(trace),
        None => {
            let name = format!("{}{XPLANE_SUFFIX}", captured.host);
            Folder::open(&captured.session_dir)
                .ok()
                .filter(|folder| folder.size(&name).is_ok_and(|size| size <= MOST_READ))
                .and_then(|folder| folder.read(&name).ok())
                .and_then(|trace| crate::xspace::read::recording_start_ns(&trace))
        }
    };
    let Some(late_ns) = recorded_from_ns
        .map(|start| start.saturating_sub(captured.asked_start_ns))
        .filter(|late| *late > crate::xspace::read::RECORDING_START_SLACK_NS)
    else {
        return;
    };
    eprintln!(
        "{} recorded from {:.3} s after the window's start, not the past asked for with \
         --delay-back: it records from when it is called (as TensorFlow's and JAX's servers \
         do); devtrace agents serve a past window from their flight recorder",
        captured.target,
        late_ns as f64 / 1e9
    );
}

/// Writes the reply's files into the session (blocking: an upload runs
/// here) and says where the trace is.
fn store(captured: Captured) -> anyhow::Result<String> {
    let Captured {
        reply,
        output,
        session_dir,
        session_id,
        host,
        ..
    } = captured;
    if reply.tool_data.is_empty() {
        // TensorFlow's own server writes the file itself, as does an agent
        // allowed to (--allow-root); the agent's is Riegeli chunks when the
        // trace is large.
        let chunked = format!("{host}{RIEGELI_SUFFIX}");
        let is_chunked = Folder::open(&session_dir)
            .and_then(|folder| folder.files())
            .is_ok_and(|files| files.contains(&chunked));
        let name = if is_chunked {
            chunked
        } else {
            format!("{host}{XPLANE_SUFFIX}")
        };
        eprintln!("the server wrote the trace itself, on its own filesystem or bucket");
        // Here, the session's directory holds nothing of it.
        output.abandon();
        return Ok(session_dir.join(&name).to_string());
    }
    // The server names the files and fills them: a name that is not a plain
    // file name is not written (`../` would leave the logdir), and a trace
    // that does not begin as one is not kept as one.
    let mut files = Vec::new();
    for tool in &reply.tool_data {
        if tool.name.ends_with("tf_stats_helper_result") {
            continue;
        }
        if let Err(refused) = crate::service::validate::name_component("name", &tool.name) {
            eprintln!(
                "devtrace: the reply's file {} is not written: {}",
                printable(&format!("{:?}", tool.name)),
                printable(refused.message())
            );
            continue;
        }
        if tool.name == XPLANE_TOOL || tool.name == RIEGELI_TOOL {
            let chunked = tool.name == RIEGELI_TOOL;
            crate::xspace::read::check_trace_head(&tool.data, tool.data.len() as u64, chunked)
                .map_err(|why| {
                    output.abandon();
                    anyhow::anyhow!("the server's reply is not a trace: its {} {why}", tool.name)
                })?;
        }
        files.push(tool);
    }
    let mut written = None;
    for tool in files {
        let stored = output.write(&session_id, &format!("{host}.{}", tool.name), &tool.data);
        let path = match stored {
            Ok(path) => path,
            Err(kept) => {
                // What was made for it goes when nothing else lies there.
                output.abandon();
                bail!(kept);
            }
        };
        // A large trace comes as Riegeli chunks (`xplane.riegeli`).
        if tool.name == XPLANE_TOOL || tool.name == RIEGELI_TOOL {
            written = Some(path);
        }
    }
    written.context("the reply carried no trace (xplane.pb or xplane.riegeli)")
}

/// The capture's progress bar, cleared from the terminal when it goes: at
/// the reply, or when the capture is cancelled (so that what is said then
/// starts a line of its own).
struct Progress(ProgressBar);

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

fn progress_bar(args: &CaptureArgs, duration_ms: u64) -> Option<Progress> {
    if args.quiet {
        return None;
    }
    let total = duration_ms + u64::try_from(args.delay.as_millis()).unwrap_or(0);
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("capturing {bar:30} {pos}/{len} ms")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let ticker = bar.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        while !ticker.is_finished() {
            ticker.set_position((started.elapsed().as_millis() as u64).min(total));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    Some(Progress(bar))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_said_as_a_shell_reads_them_back() {
        assert_eq!(shell_word("/tmp/logs/run_1"), "/tmp/logs/run_1");
        assert_eq!(shell_word("/tmp/my logs"), "'/tmp/my logs'");
        assert_eq!(shell_word("/tmp/~x"), "'/tmp/~x'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
