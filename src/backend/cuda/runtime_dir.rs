//! What the runtime directory itself lets other users do: its type, owner
//! and mode, judged once for `serve` (which makes a missing one, says what
//! is wrong with an existing one and runs on: the agent checks every ring
//! it opens there) and for `devtrace doctor` (which reports the same).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// What is wrong with a runtime directory, worst first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Concern {
    /// Not a directory, nor a link to one: the CUDA backend cannot use it.
    NotADirectory,
    /// A symbolic link to a directory: whoever can change the link chooses
    /// where jobs put their rings.
    Link,
    /// Owned by a user other than root or the agent's.
    ForeignOwner { uid: u32 },
    /// World-writable without the sticky bit.
    OpenToAll { mode: u32 },
    /// Not world-writable: only its owner's user and group can register.
    OwnerOnly { mode: u32 },
}

impl Concern {
    /// Whether the CUDA backend cannot run on it at all.
    pub fn fatal(&self) -> bool {
        *self == Concern::NotADirectory
    }

    /// Whether it stops jobs of other users from registering, rather than
    /// leaving jobs open to each other.
    pub fn limits_users(&self) -> bool {
        matches!(self, Concern::OwnerOnly { .. })
    }

    pub fn text(&self) -> String {
        match self {
            Concern::NotADirectory => "not a directory".into(),
            Concern::Link => "a symbolic link: whoever can change it chooses where jobs put \
                              their rings"
                .into(),
            Concern::ForeignOwner { uid } => format!(
                "owned by uid {uid}, who can replace what injected jobs and the agent find there"
            ),
            Concern::OpenToAll { mode } => {
                format!("mode {mode:04o}: any user can remove or replace another job's ring")
            }
            Concern::OwnerOnly { mode } => {
                format!("mode {mode:04o}: only jobs of its owner's user and group can register")
            }
        }
    }

    pub fn hint(&self, dir: &Path) -> String {
        let dir = dir.display();
        match self {
            Concern::NotADirectory | Concern::Link => {
                format!("remove {dir} (the agent makes it), or give --runtime-dir another path")
            }
            Concern::ForeignOwner { .. } => {
                format!("chown root {dir} (or remove it: the agent makes it)")
            }
            Concern::OpenToAll { .. } => format!("chmod 1777 {dir}"),
            Concern::OwnerOnly { .. } => format!("chmod 1777 {dir} to trace jobs of every user"),
        }
    }
}

/// The worst [`Concern`] about `dir`, `None` when it is a directory of root
/// or the agent's user with mode 1777 (like /tmp). Fails as `lstat` does (a
/// missing directory is `NotFound`).
pub fn concern(dir: &Path) -> std::io::Result<Option<Concern>> {
    let own = std::fs::symlink_metadata(dir)?;
    if own.file_type().is_symlink() {
        let is_dir = std::fs::metadata(dir).is_ok_and(|target| target.is_dir());
        return Ok(Some(if is_dir {
            Concern::Link
        } else {
            Concern::NotADirectory
        }));
    }
    if !own.is_dir() {
        return Ok(Some(Concern::NotADirectory));
    }
    let mode = own.permissions().mode() & 0o7777;
    let uid = own.uid();
    // SAFETY: geteuid has no preconditions.
    let agent = unsafe { libc::geteuid() };
    Ok(if uid != 0 && uid != agent {
        Some(Concern::ForeignOwner { uid })
    } else if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        Some(Concern::OpenToAll { mode })
    } else if mode & 0o002 == 0 {
        Some(Concern::OwnerOnly { mode })
    } else {
        None
    })
}

/// Makes the runtime directory when it is missing: world-writable and
/// sticky like /tmp, so workloads of any user can add their rings and only
/// remove their own. An existing one is used as it is, and what is wrong
/// with it returned.
pub fn prepare(dir: &Path) -> Result<Option<Concern>, String> {
    match concern(dir) {
        Ok(Some(concern)) if concern.fatal() => {
            Err(format!("{}: {}", dir.display(), concern.text()))
        }
        Ok(concern) => Ok(concern),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))
                .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))?;
            Ok(None)
        }
        Err(error) => Err(format!("{}: {error}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_judged_by_type_owner_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run");
        assert_eq!(prepare(&runtime), Ok(None));
        let made = std::fs::metadata(&runtime).unwrap();
        assert_eq!(made.permissions().mode() & 0o7777, 0o1777);
        for (mode, expected) in [
            (0o1777, None),
            (0o777, Some(Concern::OpenToAll { mode: 0o777 })),
            (0o755, Some(Concern::OwnerOnly { mode: 0o755 })),
        ] {
            std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(concern(&runtime).unwrap(), expected, "{mode:o}");
            // Used as it is: the mode stays.
            assert_eq!(prepare(&runtime), Ok(expected));
        }
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&runtime, &link).unwrap();
        assert_eq!(concern(&link).unwrap(), Some(Concern::Link));
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(concern(&file).unwrap(), Some(Concern::NotADirectory));
        assert!(prepare(&file).unwrap_err().contains("not a directory"));
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        assert_eq!(concern(&dangling).unwrap(), Some(Concern::NotADirectory));
    }
}
