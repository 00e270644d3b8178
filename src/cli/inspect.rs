//! `devtrace inspect`: a summary of a trace file, `.xplane.pb` or the
//! Riegeli chunks of a large one (`.xplane.riegeli`), or of each host's file
//! in a session directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use crate::fleet::{host_of_trace_file, session_traces};
use crate::model::printable::printable;
use crate::repository::{Folder, Location, XPLANE_SUFFIX};
use crate::xspace::chunks::RIEGELI_SUFFIX;
use crate::xspace::read::{read_trace_within, summarize};

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The trace file (`<host>.xplane.pb`, or `<host>.xplane.riegeli`,
    /// whose chunks are merged as XProf merges them), or a session
    /// directory (`LOGDIR/plugins/profile/SESSION`): each host's file in it.
    pub file: PathBuf,
    /// How many of the heaviest event names to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print one JSON document instead of text, for scripts: hosts, event
    /// count and span, planes with their lines, event counts and stats (an
    /// object by stat name), the heaviest events, warnings, errors, the
    /// number of chunks and `file_host`, the host its file's name gives
    /// (as sessions, `devtrace tool --host` and XProf name it).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if !args.file.is_dir() {
        return inspect(&mut out, &args.file, &args, false);
    }
    let files = session_files(&args.file)?;
    let several = files.len() > 1;
    // One host's trace that cannot be read does not hide the others'.
    let mut unread = 0;
    for (index, file) in files.iter().enumerate() {
        if several && !args.json {
            if index > 0 {
                writeln!(out).context(super::WRITING_OUTPUT)?;
            }
            writeln!(out, "== {}", printable(&file.display().to_string()))
                .context(super::WRITING_OUTPUT)?;
        }
        match inspect(&mut out, file, &args, several) {
            Err(error) if several && !super::output_closed(&error) => {
                super::say_failure(&error);
                unread += 1;
            }
            other => other?,
        }
    }
    if unread > 0 {
        anyhow::bail!(
            "{unread} of the {} traces in {} could not be read (said above)",
            files.len(),
            printable(&args.file.display().to_string())
        );
    }
    Ok(())
}

/// Prints the summary of one trace file; `named`: with its path (one JSON
/// document a line per file of a session).
fn inspect(
    out: &mut impl Write,
    file: &Path,
    args: &InspectArgs,
    named: bool,
) -> anyhow::Result<()> {
    let trace = read_trace_within(file, &mut super::reading_memory())?;
    let summary = summarize(&trace.space, args.top);
    // The hosts a trace names (its machine's name) are not what sessions
    // and tools name it by: its file's.
    let file_host = file
        .file_name()
        .and_then(|name| name.to_str())
        .and_then(host_of_trace_file);
    if args.json {
        let mut document = summary.to_json();
        document["chunks"] = trace.chunks.into();
        if let Some(host) = file_host {
            document["file_host"] = host.into();
        }
        if named {
            document["file"] = file.display().to_string().into();
        }
        writeln!(out, "{document}").context(super::WRITING_OUTPUT)?;
        return Ok(());
    }
    if trace.chunks != 1 {
        writeln!(out, "chunks: {}", trace.chunks).context(super::WRITING_OUTPUT)?;
    }
    // Beneath the hosts the trace names, on a line of its own, so that the
    // lines before keep their places for scripts.
    let text = summary.to_string();
    let (hosts, rest) = text.split_once('\n').unwrap_or((&text, ""));
    writeln!(out, "{hosts}").context(super::WRITING_OUTPUT)?;
    if let Some(host) = file_host {
        let host = printable(host);
        writeln!(
            out,
            "session host: {host} (as `devtrace tool --host` and XProf name it)"
        )
        .context(super::WRITING_OUTPUT)?;
    }
    write!(out, "{rest}").context(super::WRITING_OUTPUT)?;
    Ok(())
}

/// The trace file of each host in a session directory, by host.
fn session_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let read = || format!("cannot read {}", dir.display());
    let session = Folder::open(&Location::Local(dir.to_path_buf())).with_context(read)?;
    let traces = session_traces(&session).with_context(read)?;
    let files: Vec<PathBuf> = traces.into_values().map(|name| dir.join(name)).collect();
    if files.is_empty() {
        anyhow::bail!(
            "{} holds no trace file (*{XPLANE_SUFFIX} or *{RIEGELI_SUFFIX}); give a session \
             directory (LOGDIR/plugins/profile/SESSION) or a trace file",
            dir.display()
        );
    }
    Ok(files)
}
