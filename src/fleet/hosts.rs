//! Host lists as fleets are written down, for `session new --hosts` and
//! `NewSession.hosts`: plain `host[:port]` entries, Slurm hostlist
//! expressions (`gpu[001-128]:6010`, `rack[1-2]-n[1,3-5]`), `dns:NAME[:PORT]`
//! (every A and AAAA record of NAME, as a Kubernetes headless Service
//! answers) and, from the command line only, `@FILE` (one entry per line).
//! Entries are separated by commas outside brackets; `grpc://` or `grpcs://`
//! in front of any entry applies to every host it stands for.
//!
//! Expansion is counted before anything is built, so a short expression
//! cannot make the process allocate millions of names; DNS names are
//! resolved afterwards ([`resolve`]), each failure kept with its entry.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;
use tokio::sync::OnceCell;

use crate::fleet::host_file_part;
use crate::protocol::client::{AddressError, ClientConfig, Scheme, Target};
use crate::xspace::chunks::LONGEST_HOST_PART;

/// Most hosts a list given on the command line may stand for.
pub const COMMAND_LINE_LIMIT: usize = 65_536;

/// Largest `@FILE` read: a host list, not a data set.
const MAX_FILE_BYTES: u64 = 16 << 20;

/// Port of a `--dns-server` given without one.
const DNS_PORT: u16 = 53;

/// Who wrote the list. Only the command line may name files: a peer must
/// not make the agent read its files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    CommandLine,
    Peer,
}

/// One entry after expansion: a host to call, or a name whose addresses
/// are the hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostEntry {
    Host(Target),
    Dns {
        name: String,
        port: u16,
        scheme: Scheme,
    },
}

impl std::fmt::Display for HostEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostEntry::Host(target) => target.fmt(f),
            HostEntry::Dns { name, port, .. } => write!(f, "dns:{name}:{port}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("{entry}: '[' is never closed")]
    Unclosed { entry: String },
    #[error("{entry}: ']' without a '[' before it")]
    Unopened { entry: String },
    #[error("{entry}: '[' inside brackets (groups cannot nest)")]
    Nested { entry: String },
    #[error("{entry}: empty brackets")]
    EmptyGroup { entry: String },
    #[error("{entry}: {part:?} is not a number or a range such as 1-8")]
    NotANumber { entry: String, part: String },
    #[error("{entry}: the range {part} runs backwards")]
    Backwards { entry: String, part: String },
    #[error(
        "{entry}: with it the list names more than {limit} hosts (the most one list may name)"
    )]
    TooMany { entry: String, limit: usize },
    #[error("{entry}: {source}")]
    Address { entry: String, source: AddressError },
    #[error(
        "{entry}: a DNS name holds letters, digits, '-', '_' and '.' (dns:NAME or dns:NAME:PORT), \
         at most 253 of them, in labels of 1 to 63 between the dots"
    )]
    DnsName { entry: String },
    #[error(
        "{entry}: {bytes} bytes as host_port, which names the host's trace file \
         (host_port.xplane.riegeli); a file name holds 255 bytes, so host:port at most {}",
        LONGEST_HOST_PART
    )]
    TooLongForAFile { entry: String, bytes: usize },
    #[error("{entry}: files are read only from the command line; over RPC a peer may not make the agent read files (list the hosts instead)")]
    FileRefused { entry: String },
    #[error("{entry}: a file of hosts cannot name another file")]
    FileInFile { entry: String },
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: larger than {} MiB; a host list is expected", MAX_FILE_BYTES >> 20)]
    FileTooLarge { path: String },
    #[error("{path}:{line}: {source}")]
    InFile {
        path: String,
        line: usize,
        source: Box<HostsError>,
    },
    #[error("no hosts given")]
    NoHosts,
}

/// Entries collected from any number of lists, within one limit.
#[derive(Debug)]
pub struct HostList {
    entries: Vec<HostEntry>,
    /// Hosts the entries stand for so far (a DNS name counts one until
    /// resolved).
    count: usize,
    limit: usize,
    default_port: u16,
    origin: Origin,
}

impl HostList {
    pub fn new(origin: Origin, default_port: u16, limit: usize) -> HostList {
        HostList {
            entries: Vec::new(),
            count: 0,
            limit,
            default_port,
            origin,
        }
    }

    /// Adds every entry of `text` (comma-separated, outside brackets).
    pub fn add(&mut self, text: &str) -> Result<(), HostsError> {
        self.add_list(text, false)
    }

    /// The entries so far.
    pub fn entries(&self) -> &[HostEntry] {
        &self.entries
    }

    /// The entries, or [`HostsError::NoHosts`] when every list was blank.
    pub fn finish(self) -> Result<Vec<HostEntry>, HostsError> {
        if self.entries.is_empty() {
            return Err(HostsError::NoHosts);
        }
        Ok(self.entries)
    }

    fn add_list(&mut self, text: &str, in_file: bool) -> Result<(), HostsError> {
        for item in split_top_level(text)? {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            self.add_entry(item, in_file)?;
        }
        Ok(())
    }

    fn add_entry(&mut self, entry: &str, in_file: bool) -> Result<(), HostsError> {
        if let Some(path) = entry.strip_prefix('@') {
            if self.origin == Origin::Peer {
                return Err(HostsError::FileRefused {
                    entry: named(entry),
                });
            }
            if in_file {
                return Err(HostsError::FileInFile {
                    entry: named(entry),
                });
            }
            return self.add_file(path.trim());
        }
        let (scheme, prefix, rest) = split_scheme(entry);
        if let Some(dns) = rest.strip_prefix("dns:") {
            let (name, port) = parse_dns(entry, dns, self.default_port)?;
            self.reserve(entry, 1)?;
            self.entries.push(HostEntry::Dns { name, port, scheme });
            return Ok(());
        }
        let groups = parse_groups(entry, rest)?;
        let count = groups
            .iter()
            .try_fold(1u64, |n, piece| n.checked_mul(piece.count()?))
            .and_then(|n| usize::try_from(n).ok());
        self.reserve(entry, count.unwrap_or(usize::MAX))?;
        for host in expand(&groups) {
            let text = format!("{prefix}{host}");
            let target =
                Target::tcp(&text, self.default_port).map_err(|source| HostsError::Address {
                    entry: named(entry),
                    source,
                })?;
            let bytes = host_file_part(&target.to_string()).len();
            if bytes > LONGEST_HOST_PART {
                return Err(HostsError::TooLongForAFile {
                    entry: named(entry),
                    bytes,
                });
            }
            self.entries.push(HostEntry::Host(target));
        }
        Ok(())
    }

    fn reserve(&mut self, entry: &str, hosts: usize) -> Result<(), HostsError> {
        match self.count.checked_add(hosts) {
            Some(total) if total <= self.limit => {
                self.count = total;
                Ok(())
            }
            _ => Err(HostsError::TooMany {
                entry: named(entry),
                limit: self.limit,
            }),
        }
    }

    /// One entry (or list) per line; `#` starts a comment.
    fn add_file(&mut self, path: &str) -> Result<(), HostsError> {
        let read_error = |source| HostsError::Read {
            path: path.to_string(),
            source,
        };
        // Read up to the bound, from a file or a pipe (`@<(scontrol show
        // hostnames)`): only the command line names these files.
        let file = std::fs::File::open(Path::new(path)).map_err(read_error)?;
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut std::io::Read::take(file, MAX_FILE_BYTES + 1),
            &mut text,
        )
        .map_err(read_error)?;
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(HostsError::FileTooLarge {
                path: path.to_string(),
            });
        }
        for (index, line) in text.lines().enumerate() {
            let line = line.split_once('#').map_or(line, |(before, _)| before);
            self.add_list(line, true)
                .map_err(|source| HostsError::InFile {
                    path: path.to_string(),
                    line: index + 1,
                    source: Box::new(source),
                })?;
        }
        Ok(())
    }
}

/// An entry as errors show it: trimmed, and cut short when long.
fn named(entry: &str) -> String {
    const SHOWN: usize = 100;
    let entry = entry.trim();
    match entry.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}...", &entry[..end]),
        None => entry.to_string(),
    }
}

/// The scheme an entry asks for, its prefix as written, and the rest.
fn split_scheme(entry: &str) -> (Scheme, &str, &str) {
    for (prefix, scheme) in [("grpcs://", Scheme::Tls), ("grpc://", Scheme::Plain)] {
        if let Some(rest) = entry.strip_prefix(prefix) {
            return (scheme, prefix, rest);
        }
    }
    (Scheme::Unspecified, "", entry)
}

/// Splits at commas outside brackets, checking that brackets pair up.
fn split_top_level(text: &str) -> Result<Vec<&str>, HostsError> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    let entry_at = |from: usize| {
        let end = text[from..].find(',').map_or(text.len(), |i| from + i);
        named(&text[from..end])
    };
    for (i, c) in text.char_indices() {
        match c {
            '[' if depth > 0 => {
                return Err(HostsError::Nested {
                    entry: named(&text[start..]),
                })
            }
            '[' => depth = 1,
            ']' if depth == 0 => {
                return Err(HostsError::Unopened {
                    entry: entry_at(start),
                })
            }
            ']' => depth = 0,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(HostsError::Unclosed {
            entry: named(&text[start..]),
        });
    }
    items.push(&text[start..]);
    Ok(items)
}

/// A run of literal text, or the ranges of one bracket group.
#[derive(Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Ranges(Vec<Range>),
}

/// `first-last` of a bracket group, each number printed `width` digits
/// wide at least (zero padding as written).
#[derive(Debug, PartialEq, Eq)]
struct Range {
    first: u64,
    last: u64,
    width: usize,
}

impl Piece {
    /// How many texts this piece stands for; `None` past `u64`.
    fn count(&self) -> Option<u64> {
        match self {
            Piece::Text(_) => Some(1),
            Piece::Ranges(ranges) => ranges.iter().try_fold(0u64, |n, r| {
                n.checked_add((r.last - r.first).checked_add(1)?)
            }),
        }
    }
}

/// `rest` (an entry without its scheme) as text and bracket groups. An
/// entry that starts with a bracketed IPv6 literal (`[::1]:6009`) is text.
fn parse_groups(entry: &str, rest: &str) -> Result<Vec<Piece>, HostsError> {
    if rest.starts_with('[') && rest.split(']').next().is_some_and(|g| g.contains(':')) {
        return Ok(vec![Piece::Text(rest.to_string())]);
    }
    let mut pieces = Vec::new();
    let mut text = rest;
    while let Some(open) = text.find('[') {
        let close =
            text[open..]
                .find(']')
                .map(|i| open + i)
                .ok_or_else(|| HostsError::Unclosed {
                    entry: named(entry),
                })?;
        if !text[..open].is_empty() {
            pieces.push(Piece::Text(text[..open].to_string()));
        }
        pieces.push(Piece::Ranges(parse_ranges(entry, &text[open + 1..close])?));
        text = &text[close + 1..];
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text.to_string()));
    }
    Ok(pieces)
}

/// The ranges of `1,3-5,08-10`: a range whose first number starts with 0
/// is padded to that number's width, as Slurm does.
fn parse_ranges(entry: &str, group: &str) -> Result<Vec<Range>, HostsError> {
    if group.trim().is_empty() {
        return Err(HostsError::EmptyGroup {
            entry: named(entry),
        });
    }
    let mut ranges = Vec::new();
    for part in group.split(',') {
        let part = part.trim();
        let not_a_number = || HostsError::NotANumber {
            entry: named(entry),
            part: named(part),
        };
        let (low, high) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(low) || !digits(high) {
            return Err(not_a_number());
        }
        let first: u64 = low.parse().map_err(|_| not_a_number())?;
        let last: u64 = high.parse().map_err(|_| not_a_number())?;
        if last < first {
            return Err(HostsError::Backwards {
                entry: named(entry),
                part: named(part),
            });
        }
        let width = if low.len() > 1 && low.starts_with('0') {
            low.len()
        } else {
            0
        };
        ranges.push(Range { first, last, width });
    }
    Ok(ranges)
}

/// Every host of `pieces`, the first group varying slowest (as Slurm
/// orders `rack[1-2]-n[1-2]`: rack1-n1, rack1-n2, rack2-n1, rack2-n2).
/// Called only once the count is known to be within the limit.
fn expand(pieces: &[Piece]) -> Vec<String> {
    let mut hosts = vec![String::new()];
    for piece in pieces {
        hosts = match piece {
            Piece::Text(text) => hosts.into_iter().map(|h| h + text).collect(),
            Piece::Ranges(ranges) => hosts
                .iter()
                .flat_map(|h| {
                    ranges.iter().flat_map(move |r| {
                        (r.first..=r.last).map(move |n| format!("{h}{n:0w$}", w = r.width))
                    })
                })
                .collect(),
        };
    }
    hosts
}

/// `NAME` or `NAME:PORT` of a `dns:` entry.
fn parse_dns(entry: &str, text: &str, default_port: u16) -> Result<(String, u16), HostsError> {
    let (name, port) = match text.rsplit_once(':') {
        Some((name, port)) => {
            let port = port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| HostsError::Address {
                    entry: named(entry),
                    source: AddressError::BadPort(named(entry)),
                })?;
            (name, port)
        }
        None => (text, default_port),
    };
    // RFC 1035's longest name in its dotted form (less the root's dot of a
    // fully qualified one), and longest label.
    const LONGEST_DNS_NAME: usize = 253;
    const LONGEST_LABEL: usize = 63;
    let valid = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    let dotted = name.strip_suffix('.').unwrap_or(name);
    if dotted.is_empty()
        || dotted.len() > LONGEST_DNS_NAME
        || dotted
            .split('.')
            .any(|label| label.is_empty() || label.len() > LONGEST_LABEL)
        || !name.chars().all(valid)
    {
        return Err(HostsError::DnsName {
            entry: named(entry),
        });
    }
    Ok((name.to_string(), port))
}

/// `--dns-server`: `IP` or `IP:PORT` (`[v6]:PORT`), port 53 by default.
pub fn parse_dns_server(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(address);
    }
    text.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, DNS_PORT))
        .map_err(|_| format!("{text:?} is not IP or IP:PORT (e.g. 10.96.0.10 or 127.0.0.1:5353)"))
}

/// Looks up `dns:` names: through the system's configuration
/// (`/etc/resolv.conf`, `/etc/hosts`), or one DNS server the operator names.
/// Built on first use, so that lists without `dns:` never read the
/// configuration.
pub struct HostResolver {
    server: Option<SocketAddr>,
    resolver: OnceCell<Result<TokioResolver, String>>,
}

impl std::fmt::Debug for HostResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.server {
            Some(server) => write!(f, "HostResolver({server})"),
            None => f.write_str("HostResolver(system)"),
        }
    }
}

impl Default for HostResolver {
    fn default() -> Self {
        HostResolver::new(None)
    }
}

impl HostResolver {
    /// Asks `server` (or the system's configuration when `None`).
    pub fn new(server: Option<SocketAddr>) -> HostResolver {
        HostResolver {
            server,
            resolver: OnceCell::new(),
        }
    }

    fn build(&self) -> Result<TokioResolver, String> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match self.server {
            Some(server) => {
                let mut name_server = NameServerConfig::udp_and_tcp(server.ip());
                for connection in &mut name_server.connections {
                    connection.port = server.port();
                }
                let config = ResolverConfig::from_parts(None, Vec::new(), vec![name_server]);
                let mut builder = TokioResolver::builder_with_config(config, provider);
                builder.options_mut().use_hosts_file = ResolveHosts::Never;
                builder
            }
            None => TokioResolver::builder(provider)
                .map_err(|e| format!("reading the system's DNS configuration: {e}"))?,
        };
        // Both families, always: a headless Service may have either.
        builder.options_mut().ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        builder
            .build()
            .map_err(|e| format!("setting up DNS lookups: {e}"))
    }

    /// Every address of `name`, in the order the answers gave them.
    pub async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, String> {
        let resolver = self
            .resolver
            .get_or_init(|| async { self.build() })
            .await
            .as_ref()
            .map_err(Clone::clone)?;
        let answer = resolver
            .lookup_ip(name)
            .await
            .map_err(|e| format!("looking up {name}: {e}"))?;
        let addresses: Vec<IpAddr> = answer.iter().collect();
        if addresses.is_empty() {
            return Err(format!("{name} has no A or AAAA records"));
        }
        Ok(addresses)
    }
}

/// A list's hosts once its names are resolved.
#[derive(Debug, Default)]
pub struct Resolved {
    /// Each host once, in the order given.
    pub targets: Vec<Target>,
    /// Entries that stand for no host, and why (`dns:NAME:PORT`, reason).
    pub failures: Vec<(String, String)>,
}

/// Resolves the `dns:` entries (concurrently, each within `within`) and
/// drops repeated hosts: one address is one host (its trace has one file
/// name), called as first named. Named again with a scheme that makes
/// `config` call it another way (`a` without TLS settings, then
/// `grpcs://a`), it is still called once, as first named, and the later
/// naming is a failure saying so, since it asked for another way in. A name
/// that cannot be resolved in time, or whose answer would take the list
/// past `limit` hosts, is a failure of that entry; the others stand.
pub async fn resolve(
    entries: Vec<HostEntry>,
    resolver: &Arc<HostResolver>,
    config: &ClientConfig,
    limit: usize,
    within: Duration,
) -> Resolved {
    let mut lookups = tokio::task::JoinSet::new();
    let mut names: Vec<&str> = Vec::new();
    for entry in &entries {
        if let HostEntry::Dns { name, .. } = entry {
            if !names.contains(&name.as_str()) {
                names.push(name);
                let (resolver, name) = (Arc::clone(resolver), name.clone());
                lookups.spawn(async move {
                    let answer = tokio::time::timeout(within, resolver.lookup(&name))
                        .await
                        .unwrap_or_else(|_| {
                            Err(format!(
                                "no answer for {name} within {:.1} s",
                                within.as_secs_f64()
                            ))
                        });
                    (name, answer)
                });
            }
        }
    }
    let mut answers = HashMap::new();
    while let Some(joined) = lookups.join_next().await {
        if let Ok((name, answer)) = joined {
            answers.insert(name, answer);
        }
    }
    let mut resolved = Resolved::default();
    // By address, what names a host's trace file: how it was first named.
    let mut seen: HashMap<String, Target> = HashMap::new();
    for entry in entries {
        let hosts = match &entry {
            HostEntry::Host(target) => vec![target.clone()],
            HostEntry::Dns { name, port, scheme } => match answers.get(name) {
                Some(Ok(addresses)) => addresses
                    .iter()
                    .map(|ip| Target {
                        address: SocketAddr::new(*ip, *port).to_string(),
                        scheme: *scheme,
                    })
                    .collect(),
                Some(Err(why)) => {
                    resolved.failures.push((entry.to_string(), why.clone()));
                    continue;
                }
                None => {
                    let why = "the lookup did not finish".to_string();
                    resolved.failures.push((entry.to_string(), why));
                    continue;
                }
            },
        };
        let mut new: Vec<Target> = Vec::new();
        let mut new_addresses: HashSet<String> = HashSet::new();
        for target in hosts {
            let address = target.to_string();
            match seen.get(&address) {
                Some(first) if first.uses_tls(config) != target.uses_tls(config) => {
                    let why = format!(
                        "{address} is named before as {}: one address is one host, called \
                         as first named",
                        named_as(first.scheme, &address)
                    );
                    resolved
                        .failures
                        .push((named_as(target.scheme, &address), why));
                }
                Some(_) => {}
                None => {
                    if new_addresses.insert(address) {
                        new.push(target);
                    }
                }
            }
        }
        if resolved.targets.len() + new.len() > limit {
            let why = format!(
                "{} more {} would pass the limit of {limit} per session",
                new.len(),
                if new.len() == 1 { "host" } else { "hosts" }
            );
            resolved.failures.push((entry.to_string(), why));
            continue;
        }
        for target in new {
            seen.insert(target.to_string(), target.clone());
            resolved.targets.push(target);
        }
    }
    resolved
}

/// `address` as named with `scheme`, for messages.
fn named_as(scheme: Scheme, address: &str) -> String {
    match scheme {
        Scheme::Plain => format!("grpc://{address}"),
        Scheme::Tls => format!("grpcs://{address}"),
        Scheme::Unspecified | Scheme::Unix => address.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(texts: &[&str]) -> Result<Vec<String>, HostsError> {
        list_within(texts, COMMAND_LINE_LIMIT)
    }

    fn list_within(texts: &[&str], limit: usize) -> Result<Vec<String>, HostsError> {
        let mut hosts = HostList::new(Origin::CommandLine, 6009, limit);
        for text in texts {
            hosts.add(text)?;
        }
        Ok(hosts
            .finish()?
            .iter()
            .map(|entry| match entry {
                HostEntry::Host(target) => match target.scheme {
                    Scheme::Tls => format!("grpcs://{target}"),
                    Scheme::Plain => format!("grpc://{target}"),
                    _ => target.to_string(),
                },
                dns => dns.to_string(),
            })
            .collect())
    }

    fn error(texts: &[&str]) -> String {
        list(texts).unwrap_err().to_string()
    }

    #[test]
    fn plain_hosts_take_the_default_port_and_keep_their_scheme() {
        assert_eq!(
            list(&[
                "worker-0,worker-1:6010",
                "10.0.0.7",
                "grpcs://a:1",
                "[::1]:7"
            ])
            .unwrap(),
            [
                "worker-0:6009",
                "worker-1:6010",
                "10.0.0.7:6009",
                "grpcs://a:1",
                "[::1]:7"
            ]
        );
        // Blank items (a trailing comma) are skipped.
        assert_eq!(list(&["a,,b, "]).unwrap(), ["a:6009", "b:6009"]);
    }

    #[test]
    fn ranges_expand_with_their_padding_and_port() {
        assert_eq!(
            list(&["gpu[001-003]:6010"]).unwrap(),
            ["gpu001:6010", "gpu002:6010", "gpu003:6010"]
        );
        assert_eq!(
            list(&["gpu[1,3-5]"]).unwrap(),
            ["gpu1:6009", "gpu3:6009", "gpu4:6009", "gpu5:6009"]
        );
        assert_eq!(
            list(&["n[8-10]", "m[08-10]"]).unwrap(),
            ["n8:6009", "n9:6009", "n10:6009", "m08:6009", "m09:6009", "m10:6009"]
        );
        assert_eq!(list(&["gpu[128-128]"]).unwrap(), ["gpu128:6009"]);
    }

    #[test]
    fn several_groups_vary_the_last_fastest_and_lists_mix_forms() {
        assert_eq!(
            list(&["rack[1-2]-n[1,3]"]).unwrap(),
            [
                "rack1-n1:6009",
                "rack1-n3:6009",
                "rack2-n1:6009",
                "rack2-n3:6009"
            ]
        );
        assert_eq!(
            list(&["a[1-2],b3,grpc://127.0.0.[5-6]:7000,dns:svc.ns:6010"]).unwrap(),
            [
                "a1:6009",
                "a2:6009",
                "b3:6009",
                "grpc://127.0.0.5:7000",
                "grpc://127.0.0.6:7000",
                "dns:svc.ns:6010"
            ]
        );
    }

    #[test]
    fn dns_entries_take_a_name_and_an_optional_port() {
        let mut hosts = HostList::new(Origin::Peer, 6009, 8);
        hosts.add("dns:workers.default.svc.cluster.local").unwrap();
        hosts.add("grpcs://dns:workers:7000").unwrap();
        assert_eq!(
            hosts.finish().unwrap(),
            [
                HostEntry::Dns {
                    name: "workers.default.svc.cluster.local".into(),
                    port: 6009,
                    scheme: Scheme::Unspecified,
                },
                HostEntry::Dns {
                    name: "workers".into(),
                    port: 7000,
                    scheme: Scheme::Tls,
                },
            ]
        );
        assert!(
            error(&["dns:"]).contains("a DNS name holds"),
            "{}",
            error(&["dns:"])
        );
        assert!(error(&["dns:a b"]).starts_with("dns:a b: a DNS name"));
        assert!(error(&["dns:svc:99999"]).starts_with("dns:svc:99999: "));
        assert!(error(&["dns:svc:0"]).contains("port"));
        let labels = |n: usize| vec!["a".repeat(63); n].join(".");
        // 4 labels of 63 and their dots: 255; of 3 and one of 61: 253.
        let longest = format!("{}.{}", labels(3), "a".repeat(61));
        for fits in [longest.clone(), format!("{longest}.")] {
            let entry = format!("dns:{fits}");
            assert!(
                HostList::new(Origin::Peer, 6009, 8).add(&entry).is_ok(),
                "{entry}"
            );
        }
        for refused in [
            format!("{longest}a"),
            labels(4),
            "a".repeat(64),
            "a..b".into(),
            ".a".into(),
        ] {
            let said = error(&[&format!("dns:{refused}")]);
            assert!(said.contains("at most 253"), "{said}");
        }
    }

    /// A host names its trace's file (`host_port.xplane.riegeli`): one
    /// whose file name would pass 255 bytes is refused with the list, not
    /// left to fail when its trace arrives.
    #[test]
    fn hosts_too_long_to_name_a_file_are_refused() {
        let fits = format!("{}:6009", "h".repeat(LONGEST_HOST_PART - 5));
        assert!(HostList::new(Origin::Peer, 6009, 8).add(&fits).is_ok());
        let named = format!("{}.example:6009", "h".repeat(240));
        let said = error(&[&named]);
        assert!(said.contains("names the host's trace file"), "{said}");
        assert!(said.contains("at most 240"), "{said}");
        // Expanded names are checked one by one.
        let expanded = format!("{}[1-2]", "n".repeat(LONGEST_HOST_PART - 5));
        assert!(error(&[&expanded]).contains("bytes as host_port"));
    }

    #[test]
    fn malformed_expressions_are_named_with_their_bad_part() {
        for (texts, expected) in [
            (&["gpu[1-3"][..], "gpu[1-3: '[' is never closed"),
            (&["a,gpu1-3],b"], "gpu1-3]: ']' without a '[' before it"),
            (
                &["gpu[1[2]]"],
                "gpu[1[2]]: '[' inside brackets (groups cannot nest)",
            ),
            (&["gpu[]"], "gpu[]: empty brackets"),
            (
                &["gpu[1-x]"],
                "gpu[1-x]: \"1-x\" is not a number or a range such as 1-8",
            ),
            (&["gpu[1,,2]"], "gpu[1,,2]: \"\" is not a number"),
            (&["gpu[-3]"], "gpu[-3]: \"-3\" is not a number"),
            (&["gpu[5-3]"], "gpu[5-3]: the range 5-3 runs backwards"),
            (&["gpu[99999999999999999999]"], "is not a number"),
            (
                &["bad/host[1-2]"],
                "bad/host[1-2]: \"bad/host1\" contains characters",
            ),
            (
                &["gpu[1-2]:http"],
                "gpu[1-2]:http: \"gpu1:http\" is not host:port",
            ),
            (&[" , "], "no hosts given"),
        ] {
            let message = error(texts);
            assert!(
                message.starts_with(expected) || message.contains(expected),
                "{texts:?}: {message}"
            );
        }
    }

    #[test]
    fn expansion_is_bounded_before_it_is_built() {
        let message = error(&["gpu[1-100000]"]);
        assert_eq!(
            message,
            "gpu[1-100000]: with it the list names more than 65536 hosts (the most one list may \
             name)"
        );
        // The product of groups, and the total over lists, count too.
        assert!(error(&["a[1-1000]b[1-1000]"]).contains("more than 65536"));
        assert!(error(&["r[0-99999999999999]n[0-99999999999999]"]).contains("more than 65536"));
        assert!(error(&["n[0-18446744073709551615]"]).contains("more than 65536"));
        // Many groups in one entry are counted, not built: this would be
        // 2^40000 hosts, and building even one group per piece would take
        // gigabytes.
        let long = "n[0-65535]".repeat(10_000);
        let mut peer = HostList::new(Origin::Peer, 6009, 1024);
        assert!(matches!(
            peer.add(&long),
            Err(HostsError::TooMany { limit: 1024, .. })
        ));
        let message = list_within(&["a[1-3]", "b[1-2]"], 4)
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            "b[1-2]: with it the list names more than 4 hosts (the most one list may name)"
        );
        assert_eq!(list_within(&["a[1-4]"], 4).unwrap().len(), 4);
        // A single host past the bound is named as the one past it, not as
        // standing for many.
        let message = list_within(&["a:1", "b:1", "c:1"], 2)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("c:1: with it the list names more than 2 hosts"),
            "{message}"
        );
        assert_eq!(list(&["n[1-65536]"]).unwrap().len(), 65536);
    }

    #[test]
    fn files_list_one_entry_per_line_with_comments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        std::fs::write(
            &path,
            "# the fleet\n\ngpu[1-2]:7000   # two of them\n  b,dns:svc\n\n",
        )
        .unwrap();
        let entry = format!("@{}", path.display());
        assert_eq!(
            list(&[&entry, "c"]).unwrap(),
            ["gpu1:7000", "gpu2:7000", "b:6009", "dns:svc:6009", "c:6009"]
        );

        std::fs::write(&path, "good\nbad[\n").unwrap();
        assert_eq!(
            error(&[&entry]),
            format!("{}:2: bad[: '[' is never closed", path.display())
        );
        std::fs::write(&path, format!("@{}\n", path.display())).unwrap();
        assert!(error(&[&entry]).contains("a file of hosts cannot name another file"));
        let missing = format!("@{}", dir.path().join("missing").display());
        assert!(
            error(&[&missing]).contains("No such file"),
            "{}",
            error(&[&missing])
        );
    }

    #[test]
    fn a_peer_cannot_name_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        std::fs::write(&path, "secret-host\n").unwrap();
        let mut hosts = HostList::new(Origin::Peer, 6009, 8);
        let message = hosts
            .add(&format!("a,@{}", path.display()))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("files are read only from the command line"),
            "{message}"
        );
        assert!(!message.contains("secret-host"));
    }

    #[test]
    fn dns_servers_default_to_port_53() {
        assert_eq!(
            parse_dns_server("10.96.0.10"),
            Ok("10.96.0.10:53".parse().unwrap())
        );
        assert_eq!(
            parse_dns_server("127.0.0.1:5353"),
            Ok("127.0.0.1:5353".parse().unwrap())
        );
        assert_eq!(
            parse_dns_server("[::1]:5353"),
            Ok("[::1]:5353".parse().unwrap())
        );
        assert_eq!(parse_dns_server("::1"), Ok("[::1]:53".parse().unwrap()));
        assert!(parse_dns_server("dns.example").is_err());
    }

    #[tokio::test]
    async fn resolving_keeps_each_host_once_and_names_what_failed() {
        let mut hosts = HostList::new(Origin::Peer, 6009, 8);
        // Without TLS settings `a` and `grpc://a` are one way in.
        hosts.add("a,b,a,grpcs://a,grpc://b,c,d,grpc://c").unwrap();
        let resolver = Arc::new(HostResolver::default());
        let resolved = resolve(
            hosts.finish().unwrap(),
            &resolver,
            &ClientConfig::default(),
            3,
            Duration::from_secs(1),
        )
        .await;
        let targets: Vec<String> = resolved.targets.iter().map(|t| t.to_string()).collect();
        // grpcs://a is the same address, whose trace would have the same
        // file: the same host, called as first named, and the naming that
        // asked for TLS is not dropped without a word; grpc://b and
        // grpc://c are the way b and c are called anyway.
        assert_eq!(targets, ["a:6009", "b:6009", "c:6009"]);
        assert_eq!(resolved.targets[0].scheme, Scheme::Unspecified);
        let failure = |entry: &str, why: &str| (entry.to_string(), why.to_string());
        assert_eq!(
            resolved.failures,
            [
                failure(
                    "grpcs://a:6009",
                    "a:6009 is named before as a:6009: one address is one host, called as \
                     first named"
                ),
                failure(
                    "d:6009",
                    "1 more host would pass the limit of 3 per session"
                ),
            ]
        );
    }
}
