//! `devtrace inspect`: a summary of a trace file, `.xplane.pb` or the
//! Riegeli chunks of a large one (`.xplane.riegeli`).

use std::path::PathBuf;

use clap::Args;

use crate::xspace::read::{read_trace, summarize};

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The trace file (`<host>.xplane.pb`, or `<host>.xplane.riegeli`,
    /// whose chunks are merged as XProf merges them).
    pub file: PathBuf,
    /// How many of the heaviest event names to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print one JSON document instead of text, for scripts: hosts, event
    /// count and span, planes with their lines, event counts and stats (an
    /// object by stat name), the heaviest events, warnings, errors and the
    /// number of chunks.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let trace = read_trace(&args.file)?;
    let summary = summarize(&trace.space, args.top);
    if args.json {
        let mut document = summary.to_json();
        document["chunks"] = trace.chunks.into();
        println!("{document}");
        return Ok(());
    }
    if trace.chunks != 1 {
        println!("chunks: {}", trace.chunks);
    }
    print!("{summary}");
    Ok(())
}
