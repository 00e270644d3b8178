//! The memory the agent may use: the tightest limit of its memory cgroup
//! and the cgroups above it (v2 `memory.max`, v1 `memory.limit_in_bytes`,
//! found through `/proc/self/cgroup` and `/proc/self/mountinfo`, so inside
//! a container too), or the machine's memory when no cgroup limits it. The
//! agent sizes its memory budgets inside it at start.

use std::path::{Path, PathBuf};

/// Where a limit came from, for the messages that name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// A cgroup's limit file.
    Cgroup(PathBuf),
    /// No cgroup limit: the machine's memory (`MemTotal`).
    Machine,
}

impl std::fmt::Display for LimitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitSource::Cgroup(file) => {
                write!(f, "the memory limit of its cgroup ({})", file.display())
            }
            LimitSource::Machine => {
                write!(f, "this machine's memory (no cgroup limits this process)")
            }
        }
    }
}

/// The agent's memory limit and where it comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    pub bytes: u64,
    pub source: LimitSource,
}

/// v1 writes "no limit" as a number near 2^63 (rounded to a page).
const V1_UNLIMITED: u64 = 1 << 62;

/// The limit of this process, read from the real `/proc` and cgroup
/// mounts; the machine's memory when nothing can be read.
pub fn of_this_process() -> MemoryLimit {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let machine = machine_bytes(&read("/proc/meminfo"));
    resolve(
        &read("/proc/self/cgroup"),
        &read("/proc/self/mountinfo"),
        machine,
        |file| std::fs::read_to_string(file).ok(),
    )
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes; `u64::MAX` without one.
fn machine_bytes(meminfo: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|line| {
            let kib = line.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?;
            kib.trim().parse::<u64>().ok()?.checked_mul(1024)
        })
        .unwrap_or(u64::MAX)
}

/// The tightest limit over the process's memory cgroup and its ancestors,
/// given the texts of `/proc/self/cgroup` and `/proc/self/mountinfo` and a
/// reader of limit files; `machine` bytes when none is lower.
pub fn resolve(
    cgroups: &str,
    mountinfo: &str,
    machine: u64,
    read: impl Fn(&Path) -> Option<String>,
) -> MemoryLimit {
    let mut limit = MemoryLimit {
        bytes: machine,
        source: LimitSource::Machine,
    };
    for (version, path) in memory_cgroups(cgroups) {
        // The first mount of the hierarchy that shows this cgroup, and the
        // cgroup's path relative to what it shows (a container sees its own
        // cgroup as the mount's root).
        let Some((mount, relative)) =
            mounts_of(mountinfo, version)
                .into_iter()
                .find_map(|(mount, root)| {
                    let relative = Path::new(&path).strip_prefix(&root).ok()?.to_path_buf();
                    Some((mount, relative))
                })
        else {
            continue;
        };
        let (file, unlimited): (&str, fn(&str) -> bool) = match version {
            Version::V2 => ("memory.max", |text| text == "max"),
            Version::V1 => ("memory.limit_in_bytes", |text| {
                text.parse::<u64>().is_ok_and(|bytes| bytes >= V1_UNLIMITED)
            }),
        };
        let mut dir = mount.join(relative);
        loop {
            let at = dir.join(file);
            if let Some(text) = read(&at) {
                let text = text.trim();
                if !unlimited(text) {
                    if let Ok(bytes) = text.parse::<u64>() {
                        if bytes < limit.bytes {
                            limit = MemoryLimit {
                                bytes,
                                source: LimitSource::Cgroup(at),
                            };
                        }
                    }
                }
            }
            if dir == mount || !dir.pop() {
                break;
            }
        }
    }
    limit
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// The memory cgroups of a `/proc/self/cgroup` text: the v1 memory
/// controller's path, and the v2 path.
fn memory_cgroups(cgroups: &str) -> Vec<(Version, String)> {
    cgroups
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            if controllers.is_empty() {
                Some((Version::V2, path.to_string()))
            } else if controllers.split(',').any(|c| c == "memory") {
                Some((Version::V1, path.to_string()))
            } else {
                None
            }
        })
        .collect()
}

/// Where the hierarchy of `version` is mounted, and the cgroup each mount
/// shows as its root.
fn mounts_of(mountinfo: &str, version: Version) -> Vec<(PathBuf, PathBuf)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (mount, filesystem) = line.split_once(" - ")?;
            let fields: Vec<&str> = mount.split(' ').collect();
            let (root, point) = (fields.get(3)?, fields.get(4)?);
            let mut described = filesystem.split(' ');
            let kind = described.next()?;
            let options = described.nth(1).unwrap_or("");
            let matches = match version {
                Version::V2 => kind == "cgroup2",
                Version::V1 => kind == "cgroup" && options.split(',').any(|o| o == "memory"),
            };
            matches.then(|| {
                (
                    PathBuf::from(unescape(point)),
                    PathBuf::from(unescape(root)),
                )
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as octal escapes.
fn unescape(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MOUNTS: &str = "\
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    fn files(pairs: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> = pairs
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect();
        move |path| map.get(path).cloned()
    }

    #[test]
    fn a_v1_limit_above_the_cgroup_counts_and_unlimited_ones_do_not() {
        let limit = resolve(
            "4:memory:/system.slice/devtrace.service\n0::/\n",
            MOUNTS,
            64 << 30,
            files(&[
                (
                    "/sys/fs/cgroup/memory/system.slice/devtrace.service/memory.limit_in_bytes",
                    "9223372036854771712\n",
                ),
                (
                    "/sys/fs/cgroup/memory/system.slice/memory.limit_in_bytes",
                    "2147483648\n",
                ),
            ]),
        );
        assert_eq!(limit.bytes, 2 << 30);
        assert_eq!(
            limit.source,
            LimitSource::Cgroup("/sys/fs/cgroup/memory/system.slice/memory.limit_in_bytes".into())
        );
    }

    #[test]
    fn a_v2_limit_is_read_and_max_means_none() {
        let mounts = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let limit = resolve(
            "0::/system.slice/devtrace.service\n",
            mounts,
            64 << 30,
            files(&[
                (
                    "/sys/fs/cgroup/system.slice/devtrace.service/memory.max",
                    "1073741824\n",
                ),
                ("/sys/fs/cgroup/system.slice/memory.max", "max\n"),
            ]),
        );
        assert_eq!(limit.bytes, 1 << 30);
        let unlimited = resolve(
            "0::/system.slice/devtrace.service\n",
            mounts,
            64 << 30,
            files(&[(
                "/sys/fs/cgroup/system.slice/devtrace.service/memory.max",
                "max\n",
            )]),
        );
        assert_eq!(unlimited.source, LimitSource::Machine);
        assert_eq!(unlimited.bytes, 64 << 30);
    }

    #[test]
    fn a_container_sees_its_own_cgroup_as_the_mounts_root() {
        // The mount's root is the container's cgroup; the process's path is
        // the full one (no cgroup namespace).
        let mounts = "30 23 0:26 /kubepods/pod1/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let limit = resolve(
            "0::/kubepods/pod1/c1\n",
            mounts,
            64 << 30,
            files(&[("/sys/fs/cgroup/memory.max", "1073741824\n")]),
        );
        assert_eq!(limit.bytes, 1 << 30);
    }

    #[test]
    fn a_mount_that_does_not_show_the_cgroup_is_passed_over() {
        let mounts = "\
30 23 0:26 /other /mnt/elsewhere rw - cgroup2 cgroup2 rw
31 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw
";
        let limit = resolve(
            "0::/job\n",
            mounts,
            64 << 30,
            files(&[("/sys/fs/cgroup/job/memory.max", "536870912\n")]),
        );
        assert_eq!(limit.bytes, 512 << 20);
    }

    #[test]
    fn without_cgroups_the_machines_memory_is_the_limit() {
        let limit = resolve(
            "",
            "",
            machine_bytes("MemTotal:       24576000 kB\n"),
            files(&[]),
        );
        assert_eq!(limit.bytes, 24_576_000 * 1024);
        assert_eq!(limit.source, LimitSource::Machine);
    }

    #[test]
    fn this_process_has_a_limit() {
        let limit = of_this_process();
        assert!(limit.bytes > 0);
    }
}
