//! `devtrace inspect`: a summary of an `.xplane.pb` file.

use std::path::PathBuf;

use clap::Args;

use crate::xspace::read::{read_xspace, summarize};

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The trace file (`<host>.xplane.pb`).
    pub file: PathBuf,
    /// How many of the heaviest event names to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let space = read_xspace(&args.file)?;
    print!("{}", summarize(&space, args.top));
    Ok(())
}
