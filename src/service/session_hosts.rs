//! Which hosts a `NewSession` may make the agent call (`--session-hosts`):
//! `host[:port]` glob patterns matched against each host as the caller names
//! it, before any connection. Without patterns every host is allowed.

/// One `host[:port]` pattern; `*` matches any run of characters, `?` one.
/// Without a port it means the default port; `:*` allows any port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern {
    text: String,
    host: String,
    port: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PatternError {
    #[error("the pattern is empty")]
    Empty,
    #[error("{0:?}: a host pattern holds letters, digits, '-', '.', '[', ']', ':' and the wildcards '*' and '?'")]
    BadHost(String),
    #[error("{0:?}: the port must be a number or a pattern of digits and wildcards")]
    BadPort(String),
}

impl HostPattern {
    pub fn parse(text: &str, default_port: u16) -> Result<HostPattern, PatternError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(PatternError::Empty);
        }
        let (host, port) = match crate::protocol::client::split_port(trimmed) {
            Some((host, port)) => (host.to_string(), port.to_string()),
            None => (trimmed.to_string(), default_port.to_string()),
        };
        let host_char = |c: char| c.is_ascii_alphanumeric() || "-._[]:*?".contains(c);
        if host.is_empty() || !host.chars().all(host_char) {
            return Err(PatternError::BadHost(text.to_string()));
        }
        if port.is_empty() || !port.chars().all(|c| c.is_ascii_digit() || "*?".contains(c)) {
            return Err(PatternError::BadPort(text.to_string()));
        }
        Ok(HostPattern {
            text: trimmed.to_string(),
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// Whether `address` (`host:port`, as normalised) matches.
    pub fn matches(&self, address: &str) -> bool {
        let Some((host, port)) = crate::protocol::client::split_port(address) else {
            return false;
        };
        crate::model::glob::matches(self.host.as_bytes(), host.to_ascii_lowercase().as_bytes())
            && crate::model::glob::matches(self.port.as_bytes(), port.as_bytes())
    }
}

impl std::fmt::Display for HostPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// The operator's `--session-hosts`; empty allows every host.
#[derive(Clone, Debug, Default)]
pub struct SessionHosts {
    patterns: Vec<HostPattern>,
}

impl SessionHosts {
    pub fn new(patterns: Vec<HostPattern>) -> SessionHosts {
        SessionHosts { patterns }
    }

    pub fn allows(&self, address: &str) -> bool {
        self.patterns.is_empty() || self.patterns.iter().any(|p| p.matches(address))
    }

    /// The patterns, comma-separated, for messages.
    pub fn describe(&self) -> String {
        let texts: Vec<String> = self.patterns.iter().map(ToString::to_string).collect();
        texts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(pattern: &str, address: &str) -> bool {
        HostPattern::parse(pattern, 6009).unwrap().matches(address)
    }

    #[test]
    fn patterns_match_host_and_port() {
        assert!(allows("10.0.*:6009", "10.0.3.4:6009"));
        assert!(!allows("10.0.*:6009", "10.0.3.4:6010"));
        assert!(!allows("10.0.*:6009", "10.1.0.1:6009"));
        assert!(allows(
            "*.cluster.local:*",
            "worker-0.ns.cluster.local:8466"
        ));
        assert!(!allows("*.cluster.local:*", "cluster.local.evil.com:8466"));
        assert!(allows("WORKER-?", "worker-3:6009"));
        assert!(!allows("worker-?", "worker-3:6010"));
        assert!(!allows("worker-?", "worker-10:6009"));
        assert!(allows("[fd00::*]:6009", "[fd00::12]:6009"));
        assert!(allows("*a*b*c", "xaxxbxxxc:6009"));
        assert!(!allows("*a*b*c", "xaxxbxxxcd:6009"));
        assert!(allows("*a*b*c:*", "xaxxbxxxc:1"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert_eq!(HostPattern::parse(" ", 1), Err(PatternError::Empty));
        assert!(matches!(
            HostPattern::parse("a/b:1", 1),
            Err(PatternError::BadHost(_))
        ));
        assert!(matches!(
            HostPattern::parse("h:http", 1),
            Err(PatternError::BadPort(_))
        ));
    }

    #[test]
    fn no_patterns_allow_every_host() {
        assert!(SessionHosts::default().allows("anything:1"));
        let only = SessionHosts::new(vec![HostPattern::parse("a:1", 6009).unwrap()]);
        assert!(only.allows("a:1") && !only.allows("b:1"));
    }
}
