//! Where traces are read and written on the agent's machine: only beneath
//! directories the operator allowed (`--allow-root`). A requested path is
//! matched to a root by its text, and the rest of it is resolved beneath
//! that root's open directory, following no symbolic link
//! ([`crate::beneath`]); writes are atomic (a temporary file in the target
//! directory, then rename).

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use crate::beneath::{BeneathError, Dir};

#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    #[error("{path} is not inside any directory allowed with --allow-root")]
    NotAllowed { path: String },
    #[error("{path} is relative; only absolute paths can be matched to --allow-root")]
    Relative { path: String },
    #[error("{path} contains '..'")]
    Traversal { path: String },
    #[error(transparent)]
    Beneath(#[from] BeneathError),
}

impl RepositoryError {
    /// Whether the path simply does not exist (yet).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            RepositoryError::Beneath(BeneathError::NotFound { .. })
        )
    }
}

/// One allowed root: the names it may be requested by and its directory.
#[derive(Debug)]
struct AllowedRoot {
    /// As the operator gave it (made absolute), and with links resolved.
    names: Vec<PathBuf>,
    dir: Dir,
}

/// The directories the operator allowed, opened once at start.
#[derive(Clone, Debug, Default)]
pub struct AllowedRoots {
    roots: Vec<Arc<AllowedRoot>>,
}

/// A requested path inside an allowed root, not yet opened.
#[derive(Clone, Debug)]
pub struct Confined {
    root: Arc<AllowedRoot>,
    /// Beneath the root: plain names only.
    relative: PathBuf,
}

impl AllowedRoots {
    /// Opens each root; a root that does not exist is created first, so
    /// `--allow-root /var/lib/devtrace/traces` works on a fresh host.
    pub fn new(roots: &[PathBuf]) -> std::io::Result<AllowedRoots> {
        let mut opened = Vec::with_capacity(roots.len());
        for root in roots {
            std::fs::create_dir_all(root)?;
            let given = lexical(&std::path::absolute(root)?).unwrap_or_else(|| root.clone());
            let canonical = std::fs::canonicalize(root)?;
            let dir = Dir::open(&canonical).map_err(std::io::Error::other)?;
            let mut names = vec![canonical];
            if !names.contains(&given) {
                names.push(given);
            }
            opened.push(Arc::new(AllowedRoot { names, dir }));
        }
        Ok(AllowedRoots { roots: opened })
    }

    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The roots, with links resolved.
    pub fn roots(&self) -> Vec<&Path> {
        self.roots.iter().map(|r| r.names[0].as_path()).collect()
    }

    /// Matches `requested` to the allowed root it lies in, by its text:
    /// nothing is opened or resolved here.
    pub fn confine(&self, requested: &Path) -> Result<Confined, RepositoryError> {
        let shown = || requested.display().to_string();
        if !requested.is_absolute() {
            return Err(RepositoryError::Relative { path: shown() });
        }
        let requested =
            lexical(requested).ok_or_else(|| RepositoryError::Traversal { path: shown() })?;
        self.roots
            .iter()
            .flat_map(|root| root.names.iter().map(move |name| (root, name)))
            .filter_map(|(root, name)| {
                let relative = requested.strip_prefix(name).ok()?;
                Some((name.components().count(), root, relative.to_path_buf()))
            })
            .max_by_key(|(depth, _, _)| *depth)
            .map(|(_, root, relative)| Confined {
                root: Arc::clone(root),
                relative,
            })
            .ok_or(RepositoryError::NotAllowed { path: shown() })
    }

    /// Writes `bytes` to `directory/file_name`, making `directory` beneath
    /// its allowed root.
    pub fn write_atomic(
        &self,
        directory: &Path,
        file_name: &str,
        bytes: &[u8],
    ) -> Result<PathBuf, RepositoryError> {
        let directory = self.confine(directory)?.create_dir_all()?;
        Ok(directory.write_atomic(file_name, bytes)?)
    }
}

impl Confined {
    /// The path beneath `self` named by one more component.
    pub fn join(&self, name: &str) -> Confined {
        Confined {
            root: Arc::clone(&self.root),
            relative: self.relative.join(name),
        }
    }

    /// The path as it would be shown to a person.
    pub fn display_path(&self) -> PathBuf {
        self.root.dir.path().join(&self.relative)
    }

    /// Opens the directory, which must exist.
    pub fn open_dir(&self) -> Result<Dir, RepositoryError> {
        Ok(self.root.dir.open_dir(&self.relative)?)
    }

    /// Opens the directory, making what is missing of it.
    pub fn create_dir_all(&self) -> Result<Dir, RepositoryError> {
        Ok(self.root.dir.create_dir_all(&self.relative)?)
    }
}

/// `path` with `.` and repeated separators dropped; `None` when it holds
/// `..`.
fn lexical(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => return None,
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn paths_inside_allowed_roots_are_accepted_even_before_they_exist() {
        let dir = tempfile::tempdir().unwrap();
        let roots = AllowedRoots::new(&[dir.path().join("traces")]).unwrap();
        let inside = dir.path().join("traces/run1/plugins/profile");
        assert!(roots.confine(&inside).is_ok());
        assert!(matches!(
            roots.confine(&dir.path().join("elsewhere")),
            Err(RepositoryError::NotAllowed { .. })
        ));
        assert!(matches!(
            roots.confine(&dir.path().join("traces/../elsewhere")),
            Err(RepositoryError::Traversal { .. })
        ));
        assert!(matches!(
            roots.confine(Path::new("traces/x")),
            Err(RepositoryError::Relative { .. })
        ));
        // A sibling whose name starts like the root is not inside it.
        assert!(matches!(
            roots.confine(&dir.path().join("traces2/x")),
            Err(RepositoryError::NotAllowed { .. })
        ));
    }

    #[test]
    fn a_root_named_through_a_link_is_matched_by_either_name() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        fs::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("alias")).unwrap();
        let roots = AllowedRoots::new(&[dir.path().join("alias")]).unwrap();
        for name in ["alias", "real"] {
            let written = roots
                .write_atomic(&dir.path().join(name).join("s"), "h.xplane.pb", b"x")
                .unwrap();
            assert!(written.starts_with(&real), "{}", written.display());
        }
    }

    #[test]
    fn symlinks_out_of_a_root_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("traces");
        let outside = dir.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        let error = roots
            .write_atomic(&root.join("escape/session"), "h.xplane.pb", b"x")
            .unwrap_err();
        assert!(
            matches!(
                error,
                RepositoryError::Beneath(BeneathError::Symlink { .. })
            ),
            "{error}"
        );
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
    }

    #[test]
    fn writes_are_complete_files_with_no_temporary_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let roots = AllowedRoots::new(&[dir.path().to_path_buf()]).unwrap();
        let session = dir.path().join("plugins/profile/s1");
        let path = roots
            .write_atomic(&session, "host.xplane.pb", b"trace")
            .unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"trace");
        let names: Vec<_> = fs::read_dir(&session)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("host.xplane.pb")]);
    }
}
