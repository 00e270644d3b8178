//! `devtrace generate`: what is made from the clap definitions rather than
//! written by hand, so that it cannot fall behind them: man pages, shell
//! completions, and the book's flag reference (`docs/src/reference/flags.md`,
//! which a test holds equal to what this makes).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Arg, ArgAction, Args, Command, Subcommand};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: What,
}

#[derive(Debug, Subcommand)]
pub enum What {
    /// Man pages (section 1): devtrace.1 and one per subcommand
    /// (devtrace-serve.1, ...), written into DIR, e.g.
    /// /usr/local/share/man/man1.
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// A shell's completion script, on standard output. Install it where
    /// the shell looks: bash /usr/share/bash-completion/completions/devtrace,
    /// zsh a directory of $fpath as _devtrace, fish
    /// ~/.config/fish/completions/devtrace.fish; or load it now, e.g.
    /// `source <(devtrace generate completions bash)`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The book's flag reference (Markdown), on standard output.
    Flags,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let command = super::command();
    match args.what {
        What::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(command, &dir)
                .with_context(|| format!("writing man pages into {}", dir.display()))?;
        }
        What::Completions { shell } => {
            let mut command = command;
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut command, "devtrace", &mut out);
            std::io::stdout()
                .write_all(&out)
                .context("writing the completions")?;
        }
        What::Flags => {
            std::io::stdout()
                .write_all(flag_reference(command).as_bytes())
                .context("writing the flag reference")?;
        }
    }
    Ok(())
}

/// The flag reference: every subcommand with each of its flags, value,
/// default, variable and help.
pub fn flag_reference(mut command: Command) -> String {
    command.build();
    let mut out = String::from(
        "# Flag reference\n\n\
         Every subcommand of `devtrace` and its flags, made from the program's own \
         definitions by `devtrace generate flags` (a test fails when this page and the \
         program differ). `devtrace SUBCOMMAND --help` prints the same, and `man \
         devtrace-SUBCOMMAND` where the man pages are installed. For `serve` and \
         `doctor`, each flag can also be set by the variable named, or as a key of the \
         `--config` file ([Configuration](../operations.md#configuration-a-file-the-environment-the-command-line)).\n",
    );
    let declared: Vec<String> = <super::Cli as clap::CommandFactory>::command()
        .get_subcommands()
        .map(|sub| sub.get_name().to_string())
        .collect();
    describe(&command, "devtrace", &declared, &mut out);
    out
}

/// Subcommands in the order `declared` (the configured ones are rebuilt
/// after the others and would come last), without `help`.
fn subcommands<'c>(command: &'c Command, declared: &[String]) -> Vec<&'c Command> {
    let rank = |name: &str| {
        declared
            .iter()
            .position(|d| d == name)
            .unwrap_or(usize::MAX)
    };
    let mut subcommands: Vec<&Command> = command
        .get_subcommands()
        .filter(|sub| !sub.is_hide_set() && sub.get_name() != "help")
        .collect();
    subcommands.sort_by_key(|sub| rank(sub.get_name()));
    subcommands
}

/// `arguments` as `--help` shows them: those of no section first, then
/// each section in the order its first flag was declared.
fn in_sections(arguments: Vec<&Arg>) -> Vec<&Arg> {
    let mut sections: Vec<Option<&str>> = vec![None];
    for arg in &arguments {
        if !sections.contains(&arg.get_help_heading()) {
            sections.push(arg.get_help_heading());
        }
    }
    sections
        .into_iter()
        .flat_map(|section| {
            arguments
                .iter()
                .copied()
                .filter(move |arg| arg.get_help_heading() == section)
        })
        .collect()
}

fn describe(command: &Command, path: &str, declared: &[String], out: &mut String) {
    out.push_str(&format!("\n## `{path}`\n\n"));
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        out.push_str(&format!("{}\n\n", paragraphs(&about.to_string())));
    }
    let mut any = false;
    let top = path == "devtrace";
    let arguments: Vec<&Arg> = command
        .get_arguments()
        .filter(|arg| shown(arg) && (top || !arg.is_global_set()))
        .collect();
    let mut section = None;
    for arg in in_sections(arguments) {
        if arg.get_help_heading() != section {
            section = arg.get_help_heading();
            let heading = section.unwrap_or("Options");
            out.push_str(&format!("\n### {path}: {heading}\n\n"));
        }
        any = true;
        out.push_str(&format!("- {}", signature(arg)));
        let mut facts = Vec::new();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|value| format!("`{}`", value.to_string_lossy()))
            .collect();
        if !defaults.is_empty() && !matches!(arg.get_action(), ArgAction::SetTrue) {
            facts.push(format!("default {}", defaults.join(", ")));
        }
        if let Some(variable) = super::config::variable(command, arg) {
            facts.push(format!("`{variable}`"));
        }
        if arg.is_required_set() {
            facts.push("required".into());
        }
        if matches!(arg.get_action(), ArgAction::Append) {
            facts.push("repeatable".into());
        }
        if !facts.is_empty() {
            out.push_str(&format!(" ({})", facts.join("; ")));
        }
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|help| help.to_string())
            .unwrap_or_default();
        if !help.is_empty() {
            out.push_str(&format!(
                ": {}",
                paragraphs(&help).replace("\n\n", "\n\n  ")
            ));
        }
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|value| !value.is_hide_set())
            .map(|value| match value.get_help() {
                Some(help) => format!(
                    "`{}`: {}",
                    value.get_name(),
                    escape_html(&one_line(&help.to_string()))
                ),
                None => format!("`{}`", value.get_name()),
            })
            .collect();
        if !possible.is_empty() && !matches!(arg.get_action(), ArgAction::SetTrue) {
            out.push_str(&format!("\n\n  Values: {}.", possible.join("; ")));
        }
        out.push('\n');
    }
    if !any {
        out.push_str("No flags of its own; the global flags are those of `devtrace`.\n");
    }
    for subcommand in subcommands(command, declared) {
        describe(
            subcommand,
            &format!("{path} {}", subcommand.get_name()),
            declared,
            out,
        );
    }
}

/// Whether an argument belongs in the reference: not the generated
/// --help and --version, and not hidden. The global flags are described
/// once, under `devtrace`.
fn shown(arg: &Arg) -> bool {
    !arg.is_hide_set()
        && !matches!(
            arg.get_action(),
            ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
        )
}

/// `--name <VALUE>`, `-s, --name`, or `<POSITIONAL>...`.
fn signature(arg: &Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| {
            names
                .iter()
                .map(|name| format!("<{name}>"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| format!("<{}>", arg.get_id().as_str().to_ascii_uppercase()));
    let takes_value = !matches!(
        arg.get_action(),
        ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count
    );
    match (arg.get_short(), arg.get_long()) {
        (short, Some(long)) => {
            let short = short.map(|s| format!("-{s}, ")).unwrap_or_default();
            if takes_value {
                format!("`{short}--{long} {value}`")
            } else {
                format!("`{short}--{long}`")
            }
        }
        (Some(short), None) => format!("`-{short}`"),
        (None, None) => {
            let many = if matches!(arg.get_action(), ArgAction::Append) {
                "..."
            } else {
                ""
            };
            format!("`{value}{many}`")
        }
    }
}

/// Help text with clap's line breaks inside paragraphs joined.
fn paragraphs(text: &str) -> String {
    text.split("\n\n")
        .map(|paragraph| escape_html(&one_line(paragraph)))
        .filter(|paragraph| !paragraph.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// `<` and `>` outside code spans as entities: Markdown would take
/// `<host>` for an HTML tag and hide it.
fn escape_html(text: &str) -> String {
    text.split('`')
        .enumerate()
        .map(|(index, part)| {
            if index % 2 == 1 {
                part.to_string()
            } else {
                part.replace('<', "&lt;").replace('>', "&gt;")
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The book's page is what the program says: a flag added, renamed or
    /// re-documented without regenerating it fails here.
    #[test]
    fn the_books_flag_reference_is_what_the_program_defines() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/reference/flags.md");
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        let made = flag_reference(super::super::command());
        assert!(
            written == made,
            "{} differs from the program's flags; regenerate it with\n  \
             cargo run --quiet -- generate flags > docs/src/reference/flags.md",
            path.display()
        );
    }

    #[test]
    fn every_subcommand_and_every_serve_flag_is_in_the_reference() {
        let reference = flag_reference(super::super::command());
        let mut command = super::super::command();
        command.build();
        for subcommand in command
            .get_subcommands()
            .filter(|sub| sub.get_name() != "help")
        {
            assert!(reference.contains(&format!("## `devtrace {}`", subcommand.get_name())));
        }
        let serve = command.find_subcommand("serve").unwrap();
        for arg in serve
            .get_arguments()
            .filter(|arg| shown(arg) && !arg.is_global_set())
        {
            let long = arg.get_long().unwrap();
            assert!(reference.contains(&format!("`--{long}")), "--{long}");
        }
        assert!(reference.contains("`DEVTRACE_RUNTIME_DIR`"));
        assert!(reference.contains("`DEVTRACE_LOG_LEVEL`"));
    }
}
