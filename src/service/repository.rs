//! Where traces are written on the agent's machine: only inside directories
//! the operator allowed (`--allow-root`), resolved through symlinks, and
//! always atomically (a temporary file in the target directory, then rename).

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    #[error("{path} is not inside any directory allowed with --allow-root")]
    NotAllowed { path: String },
    #[error("{path} is relative; only absolute paths can be matched to --allow-root")]
    Relative { path: String },
    #[error("{path} contains '..'")]
    Traversal { path: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// The directories the operator allowed, canonicalised once at start.
#[derive(Clone, Debug, Default)]
pub struct AllowedRoots {
    roots: Vec<PathBuf>,
}

impl AllowedRoots {
    /// Canonicalises each root; a root that does not exist is created first,
    /// so `--allow-root /var/lib/devtrace/traces` works on a fresh host.
    pub fn new(roots: &[PathBuf]) -> std::io::Result<AllowedRoots> {
        let mut canonical = Vec::with_capacity(roots.len());
        for root in roots {
            fs::create_dir_all(root)?;
            canonical.push(fs::canonicalize(root)?);
        }
        Ok(AllowedRoots { roots: canonical })
    }

    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Resolves `requested` and returns it if it lies inside an allowed root.
    pub fn confine(&self, requested: &Path) -> Result<PathBuf, RepositoryError> {
        let shown = || requested.display().to_string();
        if !requested.is_absolute() {
            return Err(RepositoryError::Relative { path: shown() });
        }
        if requested.components().any(|c| c == Component::ParentDir) {
            return Err(RepositoryError::Traversal { path: shown() });
        }
        let resolved = resolve_existing_prefix(requested);
        if self.roots.iter().any(|root| resolved.starts_with(root)) {
            Ok(resolved)
        } else {
            Err(RepositoryError::NotAllowed { path: shown() })
        }
    }

    /// Writes `bytes` to `directory/file_name`, creating `directory`, after
    /// checking (again, once it exists) that it is inside an allowed root.
    pub fn write_atomic(
        &self,
        directory: &Path,
        file_name: &str,
        bytes: &[u8],
    ) -> Result<PathBuf, RepositoryError> {
        let directory = self.confine(directory)?;
        let target = directory.join(file_name);
        let write_error = |source| RepositoryError::Write {
            path: target.display().to_string(),
            source,
        };
        fs::create_dir_all(&directory).map_err(write_error)?;
        // A symlink created between the check and the mkdir must not redirect us.
        let directory = self.confine(&fs::canonicalize(&directory).map_err(write_error)?)?;
        let mut temporary = tempfile::Builder::new()
            .prefix(&format!(".{file_name}."))
            .suffix(".tmp")
            .tempfile_in(&directory)
            .map_err(write_error)?;
        temporary.write_all(bytes).map_err(write_error)?;
        // Traces are for reading by the people who asked for them (tempfile
        // creates 0600).
        temporary
            .as_file()
            .set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(write_error)?;
        temporary.as_file().sync_all().map_err(write_error)?;
        temporary
            .persist(&target)
            .map_err(|e| write_error(e.error))?;
        Ok(target)
    }
}

/// Canonicalises the longest existing prefix of `path` and appends the rest.
fn resolve_existing_prefix(path: &Path) -> PathBuf {
    let mut existing = path.to_path_buf();
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = fs::canonicalize(&existing) {
            let mut resolved = canonical;
            resolved.extend(rest.iter().rev());
            return resolved;
        }
        match (
            existing.file_name().map(|n| n.to_owned()),
            existing.parent(),
        ) {
            (Some(name), Some(parent)) => {
                rest.push(name);
                existing = parent.to_path_buf();
            }
            _ => return path.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn symlinks_out_of_a_root_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("traces");
        let outside = dir.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        assert!(matches!(
            roots.write_atomic(&root.join("escape/session"), "h.xplane.pb", b"x"),
            Err(RepositoryError::NotAllowed { .. })
        ));
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
