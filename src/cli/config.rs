//! Where each flag's value comes from: the command line, else its
//! `DEVTRACE_*` environment variable, else the `--config` file of `devtrace
//! serve`, else its default.
//!
//! The layers are read off the clap `Command` itself (every flag with a long
//! name), so a flag added to `serve` is configurable without being listed
//! anywhere. Values from the environment and the file reach clap as
//! command-line words (`--name=value`), so they meet the same parsers and
//! the same rules between flags (`requires`, conflicts) as typed ones. Each
//! is first tried alone, so that a bad one is reported with the variable or
//! the file's key that gave it.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::Write;
use std::path::PathBuf;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};

use super::Cli;
use crate::model::small_file;

/// The subcommands whose every flag comes from the environment and from
/// `--config`. The others take only the global flags (`--log-level`,
/// `--log-format`) from the environment: their own flags share names with
/// other meanings (`tap --upstream` is not `serve --upstream`).
const CONFIGURED: &[&str] = &["serve", "doctor"];

/// A flag's variable is this and its name in capitals, `_` for `-`.
const ENV_PREFIX: &str = "DEVTRACE_";

/// Separates the values of a repeatable flag in its variable.
const LIST_SEPARATOR: char = ',';

/// Separates the fields of a value written as a table (`[[trigger]]`).
const FIELD_SEPARATOR: char = ';';

const CONFIG: &str = "config";
/// Largest `--config` file read: a page of flags, not a data set.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
const PRINT_CONFIG: &str = "print_config";
/// The global `--log-level`, which RUST_LOG overrides.
const LOG_LEVEL: &str = "log_level";

const LAYERS_HELP: &str = "\
Every flag can also be set in the environment, as DEVTRACE_ and its name in
capitals with _ for - (DEVTRACE_LISTEN=0.0.0.0:6009; a repeatable flag takes a
comma-separated list, DEVTRACE_BACKEND=cuda,nvml; a switch true or false), or
in the --config file (TOML; the keys are the flags' names: listen =
\"0.0.0.0:6009\", backend = [\"cuda\", \"nvml\"], insecure = true). The command
line wins over the environment, the environment over the file.
--print-config shows the result.";

/// The command line: the derived one, with `--config` and `--print-config`
/// added to the configured subcommands.
pub fn command() -> Command {
    CONFIGURED.iter().fold(Cli::command(), |command, name| {
        command.mut_subcommand(name, |subcommand| {
            // Under "Options", not the heading serve's flags ended on.
            subcommand
                .next_help_heading(None::<&str>)
                .arg(
                    Arg::new(CONFIG)
                        .long("config")
                        .value_name("FILE")
                        .value_parser(clap::value_parser!(PathBuf))
                        .help(
                            "Read flags from this TOML file, keyed by their names \
                             (listen = \"0.0.0.0:6009\"); the command line and \
                             DEVTRACE_* variables win over it",
                        ),
                )
                .arg(
                    Arg::new(PRINT_CONFIG)
                        .long("print-config")
                        .action(ArgAction::SetTrue)
                        .help(
                            "Print the effective configuration as a --config file, \
                             then exit without starting",
                        ),
                )
                .after_help(LAYERS_HELP)
        })
    })
}

/// Parses the process's command line over its environment and `--config`
/// file. Like clap's own parse, it prints and exits on an error (status 2),
/// on `--help`, and on `--print-config`.
pub fn parse() -> Cli {
    let environment = |name: &str| std::env::var_os(name);
    match parse_from(std::env::args_os().collect(), &environment) {
        Ok(Parsed::Run(cli)) => *cli,
        Ok(Parsed::Print(text)) => {
            // A reader that went away (`| head`) is no reason to panic.
            let _ = std::io::stdout().write_all(text.as_bytes());
            std::process::exit(0)
        }
        Err(error) => {
            // A usage error, not --help or --version: in the log's format,
            // so that a collector parsing every line gets it too.
            // (A command line missing its subcommand prints help, as an
            // error: text still.)
            let help = error.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand;
            let argv: Vec<OsString> = std::env::args_os().collect();
            if error.use_stderr() && !help && json_asked(&argv, &environment) {
                super::logging::failures_as_json();
                let text = error.render().to_string();
                let text = text.trim().trim_start_matches("error: ");
                super::logging::say_failure(text);
                std::process::exit(error.exit_code());
            }
            error.exit()
        }
    }
}

/// Whether `--log-format json` was asked for, on the command line, in
/// `DEVTRACE_LOG_FORMAT` or in the configuration file, in that order, read
/// as well as a command line that did not parse allows.
fn json_asked(argv: &[OsString], environment: Environment) -> bool {
    let value_of = |flag: &str| {
        let with_equals = format!("{flag}=");
        argv.iter().enumerate().find_map(|(index, arg)| {
            let arg = arg.to_str()?;
            if arg == flag {
                argv.get(index + 1)?.to_str().map(str::to_owned)
            } else {
                arg.strip_prefix(&with_equals).map(str::to_owned)
            }
        })
    };
    if let Some(format) = value_of("--log-format") {
        return format == "json";
    }
    // An empty variable is unset, as the parser takes it.
    if let Some(format) = environment("DEVTRACE_LOG_FORMAT").filter(|f| !f.is_empty()) {
        return format == "json";
    }
    // Only the subcommands that read a file.
    let configured = argv
        .iter()
        .any(|arg| arg.to_str().is_some_and(|arg| CONFIGURED.contains(&arg)));
    if !configured {
        return false;
    }
    let file = value_of("--config").map(PathBuf::from).or_else(|| {
        environment("DEVTRACE_CONFIG")
            .filter(|path| !path.is_empty())
            .map(PathBuf::from)
    });
    file.and_then(|path| small_file::read_text(&path, MAX_CONFIG_BYTES).ok())
        .and_then(|text| text.parse::<toml::Table>().ok())
        .is_some_and(|table| table.get("log-format").and_then(|v| v.as_str()) == Some("json"))
}

enum Parsed {
    Run(Box<Cli>),
    Print(String),
}

type Environment<'a> = &'a dyn Fn(&str) -> Option<OsString>;

fn parse_from(argv: Vec<OsString>, environment: Environment) -> Result<Parsed, clap::Error> {
    // What the command line alone sets. Its errors, --help and --version are
    // left to the parse in `finish`, which meets the same words first.
    let given = command().ignore_errors(true).try_get_matches_from(&argv);
    let mut command = command();
    command.build();
    let Ok(given) = given else {
        return finish(command, argv, &Sources::new());
    };
    let (path, given) = innermost(&given);
    let Some(subcommand) = find_subcommand(&command, &path) else {
        return finish(command, argv, &Sources::new());
    };
    let configured = matches!(path.as_slice(), [name] if CONFIGURED.contains(&name.as_str()));
    let file = match configured.then(|| config_path(subcommand, given, environment)) {
        Some(Some((path, named_by))) => Some(ConfigFile::read(path, &named_by, subcommand)?),
        _ => None,
    };
    let (words, sources) = fill_in(subcommand, given, configured, environment, file.as_ref())?;
    finish(command, with_words(argv, words), &sources)
}

/// The names of the subcommands given, outermost first, and the matches of
/// the last.
fn innermost(matches: &ArgMatches) -> (Vec<String>, &ArgMatches) {
    let mut path = Vec::new();
    let mut innermost = matches;
    while let Some((name, matches)) = innermost.subcommand() {
        path.push(name.to_owned());
        innermost = matches;
    }
    (path, innermost)
}

/// The subcommand at `path` (outermost name first); none for an empty path.
fn find_subcommand<'a>(command: &'a Command, path: &[String]) -> Option<&'a Command> {
    if path.is_empty() {
        return None;
    }
    path.iter()
        .try_fold(command, |command, name| command.find_subcommand(name))
}

/// The flags of `subcommand` that hold a setting: those with a long name
/// that set, add or switch (not --help, --version or --print-config).
fn settings(subcommand: &Command) -> impl Iterator<Item = &Arg> {
    subcommand.get_arguments().filter(|arg| {
        arg.get_long().is_some()
            && arg.get_id() != PRINT_CONFIG
            && matches!(
                arg.get_action(),
                ArgAction::Set | ArgAction::Append | ArgAction::SetTrue | ArgAction::SetFalse
            )
    })
}

/// The keys a `--config` file may hold: every setting but --config itself.
fn file_keys(subcommand: &Command) -> impl Iterator<Item = &Arg> {
    settings(subcommand).filter(|arg| arg.get_id() != CONFIG)
}

/// The variable of a flag: `--runtime-dir` is `DEVTRACE_RUNTIME_DIR`.
fn env_name(arg: &Arg) -> String {
    let long = arg.get_long().unwrap_or_default();
    format!(
        "{ENV_PREFIX}{}",
        long.to_ascii_uppercase().replace('-', "_")
    )
}

/// The variable that sets `arg` of `subcommand`, where one does: every
/// setting of the configured subcommands, and the global flags everywhere.
pub(super) fn variable(subcommand: &Command, arg: &Arg) -> Option<String> {
    let configured = CONFIGURED.contains(&subcommand.get_name()) && arg.get_id() != CONFIG;
    let is_setting = settings(subcommand).any(|setting| setting.get_id() == arg.get_id());
    (is_setting && (configured || arg.is_global_set())).then(|| env_name(arg))
}

/// A variable's value; an empty one counts as unset.
fn env_value(arg: &Arg, environment: Environment) -> Option<(String, OsString)> {
    let name = env_name(arg);
    let value = environment(&name).filter(|value| !value.is_empty())?;
    Some((name, value))
}

/// The `--config` file the command line names, else DEVTRACE_CONFIG, with
/// which of the two named it (for errors).
fn config_path(
    subcommand: &Command,
    given: &ArgMatches,
    environment: Environment,
) -> Option<(PathBuf, String)> {
    if let Some(path) = given.get_one::<PathBuf>(CONFIG) {
        return Some((path.clone(), "--config".into()));
    }
    let arg = subcommand
        .get_arguments()
        .find(|arg| arg.get_id() == CONFIG)?;
    env_value(arg, environment).map(|(name, value)| (PathBuf::from(value), name.to_string()))
}

/// Where a setting's value came from.
#[derive(Clone, Debug)]
enum Source {
    CommandLine,
    Environment(String),
    File(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::CommandLine => write!(f, "from the command line"),
            Source::Environment(name) => write!(f, "from {name}"),
            Source::File(path) => write!(f, "from {}", path.display()),
        }
    }
}

/// Sources of the settings that are not defaults, by argument id.
type Sources = BTreeMap<String, Source>;

/// Words for every setting of `subcommand` the command line leaves unset,
/// from its variable or else the file; and where each setting came from.
/// Without `configured`, only global flags are looked up, and no file.
fn fill_in(
    subcommand: &Command,
    given: &ArgMatches,
    configured: bool,
    environment: Environment,
    file: Option<&ConfigFile>,
) -> Result<(Vec<OsString>, Sources), clap::Error> {
    let mut words = Vec::new();
    let mut sources = Sources::new();
    for arg in settings(subcommand).filter(|arg| configured || arg.is_global_set()) {
        let id = arg.get_id().as_str();
        if given.value_source(id) == Some(ValueSource::CommandLine) {
            sources.insert(id.to_owned(), Source::CommandLine);
            continue;
        }
        // Where each value came from, for messages: a table of an array
        // of tables (`[[trigger]]`) by its number, not the whole array.
        let (source, place, tables, values) = if let Some((name, text)) =
            env_value(arg, environment)
        {
            let place = format!("{name}={text:?}");
            (
                Source::Environment(name),
                place,
                None,
                from_environment(arg, &text),
            )
        } else if let Some((file, value)) = file.and_then(|file| Some((file, file.value(arg)?))) {
            let key = arg.get_long().unwrap_or_default();
            let path = file.path.display();
            let place = format!("{path}: {key} = {value}");
            let tables = is_array_of_tables(value).then(|| format!("{path}: [[{key}]]"));
            (
                Source::File(file.path.clone()),
                place,
                tables,
                from_file(arg, value),
            )
        } else {
            continue;
        };
        let bad = |place: &str, reason: String| {
            usage_error(
                subcommand,
                ErrorKind::ValueValidation,
                format!("{place}: {reason}"),
            )
        };
        let arg_words = values
            .map_err(|reason| bad(tables.as_deref().unwrap_or(&place), reason))?
            .into_words(arg);
        match &tables {
            Some(tables) => {
                for (index, word) in arg_words.iter().enumerate() {
                    try_alone(subcommand, std::slice::from_ref(word))
                        .map_err(|reason| bad(&format!("{tables}: table {}", index + 1), reason))?;
                }
            }
            None => try_alone(subcommand, &arg_words).map_err(|reason| bad(&place, reason))?,
        }
        words.extend(arg_words);
        sources.insert(id.to_owned(), source);
    }
    Ok((words, sources))
}

/// A setting's values on their way to becoming words.
enum Values {
    /// Whether a switch is given.
    Switch(bool),
    List(Vec<OsString>),
}

impl Values {
    /// `--name=value` for each value; `--name` for a switch that is given
    /// (true), nothing for one that is not.
    fn into_words(self, arg: &Arg) -> Vec<OsString> {
        let long = arg.get_long().unwrap_or_default();
        match self {
            Values::Switch(given) => given
                .then(|| OsString::from(format!("--{long}")))
                .into_iter()
                .collect(),
            Values::List(values) => values
                .into_iter()
                .map(|value| {
                    let mut word = OsString::from(format!("--{long}="));
                    word.push(value);
                    word
                })
                .collect(),
        }
    }
}

/// A variable's values: a switch is true or false (or 1/0, yes/no, on/off),
/// a repeatable flag a comma-separated list, any other flag the whole text.
fn from_environment(arg: &Arg, text: &OsStr) -> Result<Values, String> {
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => {
            let text = text.to_str().map(|text| text.trim().to_ascii_lowercase());
            match text.as_deref() {
                Some("true" | "1" | "yes" | "on") => Ok(Values::Switch(true)),
                Some("false" | "0" | "no" | "off") => Ok(Values::Switch(false)),
                _ => Err("a switch is true or false".into()),
            }
        }
        ArgAction::Append => {
            let text = text.to_str().ok_or("a list must be UTF-8")?;
            let values = text
                .split(LIST_SEPARATOR)
                .map(str::trim)
                .filter(|value| !value.is_empty())
                .map(OsString::from);
            Ok(Values::List(values.collect()))
        }
        _ => Ok(Values::List(vec![text.to_owned()])),
    }
}

/// A file value's values: a switch is a boolean, a repeatable flag an array
/// (or one value), any other flag one string or number; a table (an array
/// of tables for a repeatable flag) stands for `key=value; ...` values.
fn from_file(arg: &Arg, value: &toml::Value) -> Result<Values, String> {
    match (arg.get_action(), value) {
        (ArgAction::SetTrue | ArgAction::SetFalse, toml::Value::Boolean(given)) => {
            Ok(Values::Switch(*given))
        }
        (ArgAction::SetTrue | ArgAction::SetFalse, _) => {
            Err("a switch is true or false, unquoted".into())
        }
        (ArgAction::Append, toml::Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(index, item)| match file_scalar(item) {
                Err(reason) if item.is_table() => Err(format!("table {}: {reason}", index + 1)),
                scalar => scalar,
            })
            .collect::<Result<_, _>>()
            .map(Values::List),
        (_, value) => file_scalar(value).map(|value| Values::List(vec![value])),
    }
}

fn file_scalar(value: &toml::Value) -> Result<OsString, String> {
    match value {
        toml::Value::String(text) => Ok(text.into()),
        toml::Value::Array(_) => Err("this flag takes one value, not a list".into()),
        toml::Value::Table(table) => table_fields(table).map(OsString::from),
        number_or_other => Ok(number_or_other.to_string().into()),
    }
}

fn is_array_of_tables(value: &toml::Value) -> bool {
    matches!(value, toml::Value::Array(items)
        if !items.is_empty() && items.iter().all(toml::Value::is_table))
}

/// A table's keys and values as one value of `key=value` fields separated
/// by `;`, the form `--trigger` takes: `[[trigger]]` tables read as the
/// flag's values (a flag of another form refuses what this makes).
fn table_fields(table: &toml::Table) -> Result<String, String> {
    let fields: Result<Vec<String>, String> = table
        .iter()
        .map(|(key, value)| match value {
            toml::Value::String(text) if !text.contains(FIELD_SEPARATOR) => {
                Ok(format!("{key}={text}"))
            }
            toml::Value::String(_) => Err(format!("{key}: a value here cannot hold ';'")),
            toml::Value::Array(_) | toml::Value::Table(_) => {
                Err(format!("{key}: a value here is a string or a number"))
            }
            number_or_other => Ok(format!("{key}={number_or_other}")),
        })
        .collect();
    Ok(fields?.join(&format!("{FIELD_SEPARATOR} ")))
}

/// Whether clap takes these words for one flag of `subcommand`, and if not
/// why. Only the values are judged here: the rules between flags are met
/// by the whole command line.
fn try_alone(subcommand: &Command, words: &[OsString]) -> Result<(), String> {
    let argv = std::iter::once(OsString::from(subcommand.get_name())).chain(words.iter().cloned());
    match subcommand.clone().try_get_matches_from(argv) {
        Err(error)
            if matches!(
                error.kind(),
                ErrorKind::InvalidValue | ErrorKind::ValueValidation | ErrorKind::InvalidUtf8
            ) =>
        {
            Err(reason(&error))
        }
        _ => Ok(()),
    }
}

/// What clap found wrong with a value, without its advice about the command
/// line.
fn reason(error: &clap::Error) -> String {
    if let Some(source) = std::error::Error::source(error) {
        return source.to_string();
    }
    if error.kind() == ErrorKind::InvalidUtf8 {
        return "not UTF-8".into();
    }
    let mut reason = match error.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(value)) => format!("{value:?} is not a possible value"),
        _ => "not a possible value".into(),
    };
    if let Some(ContextValue::Strings(valid)) = error.get(ContextKind::ValidValue) {
        reason += &format!(" (one of {})", valid.join(", "));
    }
    if let Some(ContextValue::String(suggested)) = error.get(ContextKind::SuggestedValue) {
        reason += &format!("; did you mean {suggested:?}?");
    }
    reason
}

/// An error reported as clap reports a bad command line: with the usage,
/// exit status 2.
fn usage_error(subcommand: &Command, kind: ErrorKind, message: String) -> clap::Error {
    clap::Error::raw(kind, message).format(&mut subcommand.clone())
}

/// `argv` with `words` added to the subcommand's flags: at the end, or
/// before a `--` that ends them.
fn with_words(mut argv: Vec<OsString>, words: Vec<OsString>) -> Vec<OsString> {
    let at = argv
        .iter()
        .position(|word| word == "--")
        .unwrap_or(argv.len());
    argv.splice(at..at, words);
    argv
}

/// The real parse, with every layer's words in place.
fn finish(
    mut command: Command,
    argv: Vec<OsString>,
    sources: &Sources,
) -> Result<Parsed, clap::Error> {
    let matches = command.try_get_matches_from_mut(argv)?;
    let (path, innermost) = innermost(&matches);
    if let Ok(Some(true)) = innermost.try_get_one::<bool>(PRINT_CONFIG) {
        let subcommand = find_subcommand(&command, &path).unwrap_or(&command);
        // The filter the command would log with, checked as a run checks it.
        let rust_log = super::logging::rust_log()
            .map_err(|error| usage_error(subcommand, ErrorKind::InvalidValue, error.0))?
            .map(|(text, _)| text);
        return Ok(Parsed::Print(render(
            subcommand,
            innermost,
            sources,
            rust_log.as_deref(),
        )));
    }
    let cli = Cli::from_arg_matches(&matches).map_err(|error| error.format(&mut command))?;
    Ok(Parsed::Run(Box::new(cli)))
}

/// A `--config` file: flag names to values.
struct ConfigFile {
    path: PathBuf,
    table: toml::Table,
}

impl ConfigFile {
    /// Reads and parses the file, refusing keys that are not flags of
    /// `subcommand`.
    fn read(
        path: PathBuf,
        named_by: &str,
        subcommand: &Command,
    ) -> Result<ConfigFile, clap::Error> {
        let shown = path.display();
        let text = small_file::read_text(&path, MAX_CONFIG_BYTES).map_err(|error| {
            usage_error(
                subcommand,
                ErrorKind::Io,
                format!("{named_by} {shown}: {error}"),
            )
        })?;
        let table: toml::Table = text.parse().map_err(|error: toml::de::Error| {
            let error = error.to_string();
            usage_error(
                subcommand,
                ErrorKind::InvalidValue,
                format!("{named_by} {shown}: {}", error.trim_end()),
            )
        })?;
        let keys: Vec<&str> = file_keys(subcommand).filter_map(Arg::get_long).collect();
        let unknown: Vec<String> = table
            .iter()
            .filter(|(key, _)| !keys.contains(&key.as_str()))
            .map(|(key, value)| unknown_key(key, value, &keys))
            .collect();
        if !unknown.is_empty() {
            let plural = if unknown.len() > 1 { "s" } else { "" };
            return Err(usage_error(
                subcommand,
                ErrorKind::UnknownArgument,
                format!(
                    "{shown}: unknown key{plural} {}; the keys are the names of the flags of \
                     `devtrace {}` (see --help)",
                    unknown.join(", "),
                    subcommand.get_name()
                ),
            ));
        }
        Ok(ConfigFile { path, table })
    }

    fn value(&self, arg: &Arg) -> Option<&toml::Value> {
        self.table.get(arg.get_long()?)
    }
}

/// Beginnings of the `DEVTRACE_*` variables other parts of devtrace read
/// (the injection library in jobs, its stand-ins, tests and benchmarks):
/// never taken for a misspelt setting.
const OTHER_VARIABLES: &[&str] = &[
    "DEVTRACE_INJECT_",
    "DEVTRACE_CUPTI_",
    "DEVTRACE_ATTACH_",
    "DEVTRACE_STANDIN_",
    "DEVTRACE_FUZZ_",
    "DEVTRACE_BENCH_",
];

/// The `DEVTRACE_*` variables among `names` that set nothing for the
/// configured subcommand `name` yet come close to one that would, each
/// with that one: a typo would otherwise be ignored without a word.
pub(super) fn misspelt_variables(
    name: &str,
    names: impl IntoIterator<Item = String>,
) -> Vec<(String, String)> {
    if !CONFIGURED.contains(&name) {
        return Vec::new();
    }
    let mut command = command();
    command.build();
    let Some(subcommand) = command.find_subcommand(name) else {
        return Vec::new();
    };
    let known: Vec<String> = settings(subcommand).map(env_name).collect();
    names
        .into_iter()
        .filter(|given| given.starts_with(ENV_PREFIX) && !known.contains(given))
        .filter(|given| !OTHER_VARIABLES.iter().any(|other| given.starts_with(other)))
        .filter_map(|given| {
            // Only the names after the prefix are compared, and strictly:
            // other tools name their variables DEVTRACE_ too.
            let suffix = &given[ENV_PREFIX.len()..];
            let closest = known
                .iter()
                .map(|candidate| {
                    let similarity = strsim::normalized_damerau_levenshtein(
                        suffix,
                        &candidate[ENV_PREFIX.len()..],
                    );
                    (similarity, candidate)
                })
                .filter(|(similarity, _)| *similarity >= 0.8)
                .max_by(|a, b| a.0.total_cmp(&b.0))?;
            Some((given, closest.1.clone()))
        })
        .collect()
}

/// An unknown key, with the flag it was likely meant to be.
fn unknown_key(key: &str, value: &toml::Value, keys: &[&str]) -> String {
    if value.is_table() {
        return format!("{key:?} (a table: flags go at the top level, not in tables)");
    }
    // The measure and threshold clap uses for its own suggestions.
    let closest = keys
        .iter()
        .map(|candidate| (strsim::jaro(key, candidate), candidate))
        .filter(|(similarity, _)| *similarity > 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match closest {
        Some((_, candidate)) => format!("{key:?} (did you mean {candidate:?}?)"),
        None => format!("{key:?}"),
    }
}

/// The effective settings as a `--config` file: every key with its help as
/// a comment and, past its default, where its value came from; unset ones
/// are commented out.
fn render(
    subcommand: &Command,
    matches: &ArgMatches,
    sources: &Sources,
    rust_log: Option<&str>,
) -> String {
    let name = subcommand.get_name();
    let mut out = format!(
        "# The effective configuration of `devtrace {name}`: the command line over\n\
         # DEVTRACE_* variables over the --config file over defaults.\n"
    );
    for arg in file_keys(subcommand) {
        let id = arg.get_id().as_str();
        let key = arg.get_long().unwrap_or_default();
        out.push('\n');
        if let Some(help) = arg.get_help() {
            for line in wrap(&help.to_string(), 76) {
                out += &format!("# {line}\n");
            }
        }
        let Some(raw) = matches.get_raw(id) else {
            out += &format!("# {key}: not set\n");
            continue;
        };
        let mut raw = raw.map(|value| value.to_string_lossy().into_owned());
        let value = match arg.get_action() {
            // True when the switch is given: it then holds the opposite of
            // its default.
            ArgAction::SetTrue => toml::Value::Boolean(raw.next().is_some_and(|v| v == "true")),
            ArgAction::SetFalse => toml::Value::Boolean(raw.next().is_some_and(|v| v == "false")),
            ArgAction::Append => toml::Value::Array(raw.map(toml::Value::String).collect()),
            _ => toml::Value::String(raw.next().unwrap_or_default()),
        };
        out += &format!("{key} = {value}");
        if let Some(source) = sources.get(id) {
            out += &format!("  # {source}");
        }
        out.push('\n');
        if let (LOG_LEVEL, Some(text)) = (id, rust_log) {
            out += &format!("# but RUST_LOG={text:?} is set, and overrides it\n");
        }
    }
    out
}

/// `text` in lines of at most `width` characters, broken between words.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_close_to_a_setting_is_named_and_others_are_left_alone() {
        let names = |names: &[&str]| {
            names
                .iter()
                .map(|name| name.to_string())
                .collect::<Vec<_>>()
        };
        let misspelt = misspelt_variables(
            "serve",
            names(&[
                "DEVTRACE_LISTN",
                "DEVTRACE_ALLOW_ROOTS",
                "DEVTRACE_LOGLEVEL",
                "DEVTRACE_LISTEN",
                "DEVTRACE_STORE_SIZ",
                "PATH",
            ]),
        );
        assert_eq!(
            misspelt,
            [
                ("DEVTRACE_LISTN", "DEVTRACE_LISTEN"),
                ("DEVTRACE_ALLOW_ROOTS", "DEVTRACE_ALLOW_ROOT"),
                ("DEVTRACE_LOGLEVEL", "DEVTRACE_LOG_LEVEL"),
                ("DEVTRACE_STORE_SIZ", "DEVTRACE_STORE_SIZE"),
            ]
            .map(|(given, meant)| (given.to_string(), meant.to_string()))
        );
        // What the injection library, stand-ins, tests and scripts read.
        let others = names(&[
            "DEVTRACE_BIN",
            "DEVTRACE_BINARY",
            "DEVTRACE_CUPTI_PATH",
            "DEVTRACE_DEPLOY_VENV",
            "DEVTRACE_DNS_SERVER",
            "DEVTRACE_INJECT_DEBUG",
            "DEVTRACE_INJECT_RING_CAPACITY",
            "DEVTRACE_JSON",
            "DEVTRACE_MOTO_SERVER",
            "DEVTRACE_NVML_STANDIN",
            "DEVTRACE_PROFILE_DIR",
            "DEVTRACE_PYTHON",
            "DEVTRACE_RING_COUNT",
            "DEVTRACE_RING_PATH",
            "DEVTRACE_SKIP_PROMETHEUS",
            "DEVTRACE_STANDIN_GPUS",
            "DEVTRACE_STORAGE_VENV",
            "DEVTRACE_TPU_STANDIN_FAIL",
            "DEVTRACE_VENV",
            "DEVTRACE_XPROF_PYTHON",
        ]);
        assert_eq!(misspelt_variables("serve", others.clone()), []);
        // Only serve and doctor read their flags from the environment.
        assert_eq!(
            misspelt_variables("capture", names(&["DEVTRACE_LISTN"])),
            []
        );
    }
}
