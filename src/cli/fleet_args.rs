//! The flags of sessions over many hosts, shared by `session new` (which
//! runs one) and `serve` (whose NewSession runs them for its callers): the
//! DNS server `dns:` entries are looked up with, and how many hosts are
//! called at once.

use std::net::SocketAddr;

use clap::Args;

use crate::fleet::hosts::{parse_dns_server, HostResolver, COMMAND_LINE_LIMIT};
use crate::fleet::DEFAULT_CONCURRENT_HOSTS;

#[derive(Debug, Args)]
pub struct FleetArgs {
    /// DNS server that `dns:NAME` host entries are looked up with (IP or
    /// IP:PORT, e.g. the cluster DNS 10.96.0.10); default: the system's
    /// configuration (/etc/resolv.conf, /etc/hosts).
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_dns_server)]
    pub dns_server: Option<SocketAddr>,

    /// Most hosts of a session called at once. The others wait for a free
    /// slot and are then asked for the same window: devtrace agents serve
    /// it from their flight recorder, other profiler servers record from
    /// when they are called (keep this above their number).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CONCURRENT_HOSTS, value_parser = parse_concurrent_hosts)]
    pub concurrent_hosts: usize,
}

fn parse_concurrent_hosts(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=COMMAND_LINE_LIMIT).contains(&n) => Ok(n),
        _ => Err(format!(
            "{text:?}: a number of hosts from 1 to {COMMAND_LINE_LIMIT}"
        )),
    }
}

impl FleetArgs {
    pub fn resolver(&self) -> HostResolver {
        HostResolver::new(self.dns_server)
    }
}
