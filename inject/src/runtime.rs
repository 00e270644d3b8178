//! Where this library puts its ring: the runtime directory the environment
//! names (`DEVTRACE_RUNTIME_DIR`), else, for a copy `devtrace attach`
//! loaded into a running process (whose environment names none), the one
//! in the `runtime-dir` file beside it, else the default. The file is
//! believed only in a directory of root's or this process's user that no
//! one else may write, and read once, as the library loads (the agent
//! removes the copy once it has loaded).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use devtrace_shm::workload::{self, ATTACH_RUNTIME_DIR_FILE};

use crate::sys;

static RUNTIME_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Decides the runtime directory; called as the library loads.
pub fn settle() {
    RUNTIME_DIR.get_or_init(|| {
        if std::env::var_os(workload::RUNTIME_DIR_ENV).is_some_and(|v| !v.is_empty()) {
            return workload::runtime_dir();
        }
        sys::dl::own_path()
            .and_then(|library| named_beside(&library))
            .unwrap_or_else(workload::runtime_dir)
    });
}

/// The runtime directory ([`settle`]d at load).
pub fn dir() -> PathBuf {
    settle();
    RUNTIME_DIR
        .get()
        .cloned()
        .unwrap_or_else(workload::runtime_dir)
}

/// Whether `path` is root's or this process's user's, and writable by its
/// owner alone.
fn trusted(path: &Path) -> bool {
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(path)
        .is_ok_and(|meta| (meta.uid() == 0 || meta.uid() == own) && meta.mode() & 0o022 == 0)
}

/// The runtime directory the file beside `library` names, when it is
/// trusted and names an absolute path.
fn named_beside(library: &Path) -> Option<PathBuf> {
    let dir = library.parent()?;
    let file = dir.join(ATTACH_RUNTIME_DIR_FILE);
    if !trusted(dir) || !trusted(&file) {
        return None;
    }
    let text = std::fs::read_to_string(&file).ok()?;
    let named = PathBuf::from(text.trim());
    (named.is_absolute() && text.len() < 4096).then_some(named)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_file_beside_a_staged_copy_is_believed_only_when_no_one_else_may_write_it() {
        let dir = Scratch::new();
        let library = dir.path().join("libdevtrace_inject.so");
        std::fs::write(&library, b"").unwrap();
        let file = dir.path().join(ATTACH_RUNTIME_DIR_FILE);
        std::fs::write(&file, "/run/elsewhere\n").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            named_beside(&library),
            Some(PathBuf::from("/run/elsewhere"))
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(named_beside(&library), None);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(named_beside(&library), None);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(&file, "relative/dir").unwrap();
        assert_eq!(named_beside(&library), None);
    }

    /// A directory of this test's own, removed after it.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("devtrace-inject-test-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir(&dir).unwrap();
            Scratch(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
