//! Where traces are read and written for clients: only beneath the
//! directories and bucket prefixes the operator allowed (`--allow-root`).
//! A requested path is matched to a root by its text. Beneath a directory
//! the rest of it is resolved beneath that root's open directory, following
//! no symbolic link ([`crate::repository::beneath`]); writes are atomic (a temporary
//! file in the target directory, then rename). A requested `s3://` or
//! `gs://` URL lies in an allowed prefix when provider and bucket are the
//! same and the allowed prefix's segments begin its own.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use crate::model::filesystem;
use crate::repository::beneath::{BeneathError, Dir};
use crate::repository::{
    scheme_of, Folder, LocalFolder, ObjectFolder, ObjectUrl, StorageError, UrlError,
};

#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    #[error("{path} is not inside any directory or bucket prefix allowed with --allow-root")]
    NotAllowed { path: String },
    #[error(
        "{path}: this agent was started without --allow-root, so it writes and reads no \
         session itself; start it with --allow-root naming the directory or bucket prefix \
         that holds this path"
    )]
    NoRoots { path: String },
    #[error("{path} is relative; only absolute paths can be matched to --allow-root")]
    Relative { path: String },
    #[error("{path} contains '..'")]
    Traversal { path: String },
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("--allow-root {path}: {source}")]
    Prepare {
        path: String,
        source: std::io::Error,
    },
}

impl From<BeneathError> for RepositoryError {
    fn from(error: BeneathError) -> RepositoryError {
        RepositoryError::Storage(error.into())
    }
}

impl RepositoryError {
    /// Whether the path simply does not exist (yet).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            RepositoryError::Storage(StorageError::NotFound { .. })
        )
    }
}

/// One allowed directory: the names it may be requested by and the open
/// directory.
#[derive(Debug)]
struct AllowedRoot {
    /// As the operator gave it (made absolute), and with links resolved.
    names: Vec<PathBuf>,
    dir: Arc<Dir>,
}

/// One allowed bucket prefix and its connection.
#[derive(Debug)]
struct AllowedPrefix {
    url: ObjectUrl,
    folder: ObjectFolder,
}

/// The directories and bucket prefixes the operator allowed, opened (or
/// connected) once at start.
#[derive(Clone, Debug, Default)]
pub struct AllowedRoots {
    roots: Vec<Arc<AllowedRoot>>,
    prefixes: Vec<Arc<AllowedPrefix>>,
}

impl AllowedRoots {
    /// Opens each directory, creating a missing one first, so that
    /// `--allow-root /var/lib/devtrace/traces` works on a fresh host; and
    /// connects to each bucket (`s3://bucket/prefix`, `gs://bucket/prefix`)
    /// with the environment's credentials.
    pub fn new(roots: &[PathBuf]) -> Result<AllowedRoots, RepositoryError> {
        let mut allowed = AllowedRoots::default();
        for root in roots {
            if let Some(url) = root.to_str().map(ObjectUrl::parse).transpose()?.flatten() {
                let folder = ObjectFolder::connect(&url)?;
                allowed
                    .prefixes
                    .push(Arc::new(AllowedPrefix { url, folder }));
                continue;
            }
            let prepare = |source| RepositoryError::Prepare {
                path: root.display().to_string(),
                source,
            };
            // Made nowhere the kernel makes files up (a cgroup directory
            // made by mkdir is a new cgroup).
            if let Some((_, name)) = filesystem::made_up_part(root) {
                return Err(prepare(std::io::Error::other(format!(
                    "it is on {name}, whose files the kernel makes up: no trace can be \
                     written there"
                ))));
            }
            if !root.exists() {
                std::fs::create_dir_all(root).map_err(prepare)?;
                // Said, so that a mistyped root is noticed at start rather
                // than when its traces are missed where they were expected.
                tracing::warn!(root = %root.display(), "--allow-root did not exist; created it");
            }
            let absolute = std::path::absolute(root).map_err(prepare)?;
            let given = lexical(&absolute).unwrap_or_else(|| root.clone());
            let canonical = std::fs::canonicalize(root).map_err(prepare)?;
            let dir = Arc::new(Dir::open(&canonical)?);
            let mut names = vec![canonical];
            if !names.contains(&given) {
                names.push(given);
            }
            allowed.roots.push(Arc::new(AllowedRoot { names, dir }));
        }
        Ok(allowed)
    }

    pub fn is_empty(&self) -> bool {
        self.roots.is_empty() && self.prefixes.is_empty()
    }

    /// The roots: directories with links resolved, then bucket prefixes.
    pub fn roots(&self) -> Vec<String> {
        let directories = self.roots.iter().map(|r| r.names[0].display().to_string());
        directories
            .chain(self.prefixes.iter().map(|p| p.url.to_string()))
            .collect()
    }

    /// Matches `requested` (an absolute path or an `s3://`/`gs://` URL) to
    /// the allowed root it lies in, by its text: nothing is opened or
    /// resolved here.
    pub fn confine(&self, requested: &str) -> Result<Folder, RepositoryError> {
        let shown = || requested.to_string();
        if self.is_empty() {
            return Err(RepositoryError::NoRoots { path: shown() });
        }
        if scheme_of(requested).is_some() {
            let url = ObjectUrl::parse(requested)?
                .ok_or_else(|| RepositoryError::NotAllowed { path: shown() })?;
            return self
                .prefixes
                .iter()
                .filter_map(|allowed| Some((allowed, allowed.url.relative(&url)?)))
                .min_by_key(|(_, relative)| relative.len())
                .map(|(allowed, relative)| {
                    let folder = relative
                        .iter()
                        .fold(allowed.folder.clone(), |folder, name| folder.join(name));
                    Folder::Object(folder)
                })
                .ok_or(RepositoryError::NotAllowed { path: shown() });
        }
        let requested = Path::new(requested);
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
            .map(|(_, root, relative)| {
                Folder::Local(LocalFolder::beneath(Arc::clone(&root.dir), relative))
            })
            .ok_or(RepositoryError::NotAllowed { path: shown() })
    }

    /// Writes `bytes` to `directory/file_name`, making `directory` beneath
    /// its allowed root.
    pub fn write_atomic(
        &self,
        directory: &str,
        file_name: &str,
        bytes: &[u8],
    ) -> Result<String, RepositoryError> {
        Ok(self.confine(directory)?.write(file_name, bytes)?)
    }
}

/// Whether [`AllowedRoots::confine`] over `roots` would take `requested`,
/// judged without making, opening or contacting any root (for `devtrace
/// doctor`): by the same text rules, a local root by its absolute name and,
/// when it exists, the name its links resolve to.
pub fn lies_in(roots: &[PathBuf], requested: &str) -> bool {
    if scheme_of(requested).is_some() {
        let Ok(Some(url)) = ObjectUrl::parse(requested) else {
            return false;
        };
        return roots.iter().any(|root| {
            root.to_str()
                .and_then(|root| ObjectUrl::parse(root).ok().flatten())
                .is_some_and(|allowed| allowed.relative(&url).is_some())
        });
    }
    let requested = Path::new(requested);
    let Some(requested) = requested
        .is_absolute()
        .then(|| lexical(requested))
        .flatten()
    else {
        return false;
    };
    roots
        .iter()
        .filter(|root| root.to_str().is_some_and(|r| scheme_of(r).is_none()))
        .flat_map(|root| {
            let given = std::path::absolute(root).ok().and_then(|a| lexical(&a));
            [given, std::fs::canonicalize(root).ok()]
        })
        .flatten()
        .any(|name| requested.starts_with(name))
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
    fn where_a_path_lies_is_told_without_making_the_roots() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("not-made");
        let roots = [missing.clone(), PathBuf::from("s3://b/team")];
        let inside = missing.join("plugins/profile");
        assert!(lies_in(&roots, text(&inside)));
        assert!(!missing.exists(), "a root was made");
        assert!(lies_in(&roots, "s3://b/team/plugins/profile"));
        assert!(!lies_in(&roots, "s3://b/other"));
        assert!(!lies_in(&roots, "/var/tmp/elsewhere"));
        assert!(!lies_in(&roots, "relative/plugins"));
        let climbing = format!("{}/../up", text(&missing));
        assert!(!lies_in(&roots, &climbing));
        // A root reached through a link is known by both names.
        let real = dir.path().join("real");
        fs::create_dir(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(lies_in(std::slice::from_ref(&link), text(&real.join("s"))));
        assert!(lies_in(std::slice::from_ref(&link), text(&link.join("s"))));
    }

    #[test]
    fn an_agent_without_roots_says_so() {
        let refused = AllowedRoots::default()
            .confine("/var/tmp/logs")
            .unwrap_err();
        assert!(matches!(refused, RepositoryError::NoRoots { .. }));
        assert!(
            refused.to_string().contains("started without --allow-root"),
            "{refused}"
        );
    }

    fn text(path: &Path) -> &str {
        path.to_str().unwrap()
    }

    #[test]
    fn paths_inside_allowed_roots_are_accepted_even_before_they_exist() {
        let dir = tempfile::tempdir().unwrap();
        let roots = AllowedRoots::new(&[dir.path().join("traces")]).unwrap();
        let inside = dir.path().join("traces/run1/plugins/profile");
        assert!(roots.confine(text(&inside)).is_ok());
        assert!(matches!(
            roots.confine(text(&dir.path().join("elsewhere"))),
            Err(RepositoryError::NotAllowed { .. })
        ));
        assert!(matches!(
            roots.confine(text(&dir.path().join("traces/../elsewhere"))),
            Err(RepositoryError::Traversal { .. })
        ));
        assert!(matches!(
            roots.confine("traces/x"),
            Err(RepositoryError::Relative { .. })
        ));
        // A sibling whose name starts like the root is not inside it.
        assert!(matches!(
            roots.confine(text(&dir.path().join("traces2/x"))),
            Err(RepositoryError::NotAllowed { .. })
        ));
    }

    #[test]
    fn a_root_on_a_filesystem_the_kernel_makes_up_is_refused() {
        // Writable to access(2) for root, yet no file can be made there.
        for root in [
            "/sys/kernel",
            "/proc/self",
            "/proc/devtrace-never-made",
            "/sys/kernel/devtrace-never-made",
        ] {
            let refused = AllowedRoots::new(&[PathBuf::from(root)]).unwrap_err();
            assert!(
                refused
                    .to_string()
                    .contains("whose files the kernel makes up"),
                "{refused}"
            );
        }
        // A missing one is refused before mkdir is tried (in a cgroup
        // filesystem a directory made is a new cgroup): by that message, not
        // mkdir's error.
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
                .write_atomic(text(&dir.path().join(name).join("s")), "h.xplane.pb", b"x")
                .unwrap();
            assert!(Path::new(&written).starts_with(&real), "{written}");
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
            .write_atomic(text(&root.join("escape/session")), "h.xplane.pb", b"x")
            .unwrap_err();
        assert!(
            matches!(
                error,
                RepositoryError::Storage(StorageError::Refused(BeneathError::Symlink { .. }))
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
            .write_atomic(text(&session), "host.xplane.pb", b"trace")
            .unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"trace");
        let names: Vec<_> = fs::read_dir(&session)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("host.xplane.pb")]);
    }

    #[test]
    fn bucket_prefixes_confine_by_provider_bucket_and_whole_segments() {
        let roots = AllowedRoots::new(&[
            PathBuf::from("s3://traces/team"),
            PathBuf::from("gs://other/x/"),
        ])
        .unwrap();
        let inside = roots
            .confine("s3://traces/team/run1/plugins/profile")
            .unwrap();
        assert_eq!(inside.display(), "s3://traces/team/run1/plugins/profile");
        assert_eq!(
            roots.confine("s3://traces/team").unwrap().display(),
            "s3://traces/team"
        );
        assert_eq!(
            roots.confine("gs://other/x/y").unwrap().display(),
            "gs://other/x/y"
        );
        // Segments, buckets and providers as in `storage::url`, across roots.
        for outside in ["s3://traces/tea", "gs://traces/team", "s3://other/x/y"] {
            assert!(
                matches!(
                    roots.confine(outside),
                    Err(RepositoryError::NotAllowed { .. })
                ),
                "{outside}"
            );
        }
        for malformed in [
            "s3://traces/team/../x",
            "s3://traces/team//x",
            "s3://traces/team/./x",
        ] {
            assert!(
                matches!(roots.confine(malformed), Err(RepositoryError::Url(_))),
                "{malformed}"
            );
        }
        assert!(matches!(
            roots.confine("http://traces/team/x"),
            Err(RepositoryError::Url(UrlError::UnsupportedScheme { .. }))
        ));
        // A bucket root allows no directory, nor a directory a bucket.
        let dir = tempfile::tempdir().unwrap();
        let directories = AllowedRoots::new(&[dir.path().to_path_buf()]).unwrap();
        assert!(matches!(
            directories.confine("s3://traces/team"),
            Err(RepositoryError::NotAllowed { .. })
        ));
        assert!(matches!(
            roots.confine("/traces/team"),
            Err(RepositoryError::NotAllowed { .. })
        ));
    }
}
