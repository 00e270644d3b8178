//! `serve --cuda-attach RULE`: which processes the agent attaches to by
//! itself once they map the CUDA driver. A rule is `all`, or one or more
//! `KEY=PATTERN` separated by commas, all of which must match (`*` and `?`
//! wildcards): `comm` (the kernel's 15-byte command name), `cmdline` (the
//! arguments joined by spaces), `user` (a user name or uid) and `cgroup`
//! (the cgroup v2 path, as `/proc/PID/cgroup` gives it). A process matching
//! any rule is attached.

use std::fmt;

use crate::model::glob;

/// What a process is, as the rules see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    pub comm: String,
    pub cmdline: String,
    pub uid: u32,
    pub user: Option<String>,
    pub cgroup: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Key {
    Comm,
    Cmdline,
    User,
    Cgroup,
}

/// See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    text: String,
    parts: Vec<(Key, String)>,
}

impl std::str::FromStr for Rule {
    type Err = String;

    fn from_str(text: &str) -> Result<Rule, String> {
        let text = text.trim();
        if text == "all" {
            return Ok(Rule {
                text: text.into(),
                parts: Vec::new(),
            });
        }
        let mut parts = Vec::new();
        for part in text.split(',') {
            let (key, pattern) = part.split_once('=').ok_or_else(|| {
                format!("{part:?}: a rule is `all` or KEY=PATTERN[,KEY=PATTERN...]")
            })?;
            let key = match key.trim() {
                "comm" => Key::Comm,
                "cmdline" => Key::Cmdline,
                "user" => Key::User,
                "cgroup" => Key::Cgroup,
                other => {
                    return Err(format!(
                        "{other:?}: the keys are comm, cmdline, user and cgroup"
                    ))
                }
            };
            if pattern.is_empty() {
                return Err(format!("{part:?}: an empty pattern"));
            }
            parts.push((key, pattern.to_string()));
        }
        Ok(Rule {
            text: text.into(),
            parts,
        })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Rule {
    pub fn matches(&self, seen: &Seen) -> bool {
        self.parts.iter().all(|(key, pattern)| {
            let pattern = pattern.as_bytes();
            match key {
                Key::Comm => glob::matches(pattern, seen.comm.as_bytes()),
                Key::Cmdline => glob::matches(pattern, seen.cmdline.as_bytes()),
                Key::Cgroup => glob::matches(pattern, seen.cgroup.as_bytes()),
                Key::User => {
                    glob::matches(pattern, seen.uid.to_string().as_bytes())
                        || seen
                            .user
                            .as_deref()
                            .is_some_and(|name| glob::matches(pattern, name.as_bytes()))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trainer() -> Seen {
        Seen {
            comm: "python3".into(),
            cmdline: "python3 /srv/train.py --steps 100".into(),
            uid: 1001,
            user: Some("alice".into()),
            cgroup: "/kubepods.slice/pod42/train".into(),
        }
    }

    #[test]
    fn every_part_of_a_rule_must_match() {
        let rule: Rule = "comm=python*,cmdline=*train.py*".parse().unwrap();
        assert!(rule.matches(&trainer()));
        let rule: Rule = "comm=python*,user=bob".parse().unwrap();
        assert!(!rule.matches(&trainer()));
        assert!("user=1001".parse::<Rule>().unwrap().matches(&trainer()));
        assert!("user=ali*".parse::<Rule>().unwrap().matches(&trainer()));
        assert!("cgroup=/kubepods.slice/*"
            .parse::<Rule>()
            .unwrap()
            .matches(&trainer()));
        assert!("all".parse::<Rule>().unwrap().matches(&Seen::default()));
    }

    #[test]
    fn a_bad_rule_is_refused_naming_its_part() {
        let refused = "comm=python,pid=3".parse::<Rule>().unwrap_err();
        assert!(refused.contains("\"pid\""), "{refused}");
        assert!("python"
            .parse::<Rule>()
            .unwrap_err()
            .contains("KEY=PATTERN"));
        assert!("comm=".parse::<Rule>().unwrap_err().contains("empty"));
    }
}
