//! Where sessions are kept: a local directory or a prefix in object storage
//! (`s3://bucket/prefix`, `gs://bucket/prefix`), behind one [`Folder`] type
//! that the agent's services and the CLI read and write through.
//!
//! A local folder is resolved beneath an open root directory without
//! following links ([`beneath`]); an object folder is a key prefix (see
//! [`object`] for credentials). The methods block: async code calls
//! them from `spawn_blocking`.

pub mod acting;
pub mod beneath;
mod local;
mod object;
pub mod roots;
mod url;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

pub use beneath::MAX_READ_BYTES;
use beneath::{BeneathError, Dir};
pub use local::LocalFolder;
pub use object::ObjectFolder;
pub use url::{scheme_of, ObjectUrl, Provider, UrlError};

/// The object that takes a generated session name in a bucket (see
/// [`Folder::create_session`]). Its leading dot keeps it from being taken
/// for a host's trace.
pub const SESSION_MARKER: &str = ".devtrace-session";
const SESSION_MARKER_TEXT: &[u8] =
    b"This session's name was taken by a devtrace capture; its traces are the <host>.xplane.pb files beside this.\n";

/// Suffix of trace files in a session directory (`<host>.xplane.pb`).
pub const XPLANE_SUFFIX: &str = ".xplane.pb";

/// Most names tried for a generated session name that is taken.
const MAX_UNIQUE_ATTEMPTS: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{path} does not exist")]
    NotFound { path: String },
    /// A local path the agent does not follow (a link, `..`, not a file).
    #[error(transparent)]
    Refused(BeneathError),
    #[error("{path} is larger than the {limit} bytes the agent reads")]
    TooLarge { path: String, limit: u64 },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    /// The object store's own error, which names its request and cause
    /// (kept out of the error chain, which would repeat them).
    #[error("{path}: {reason}")]
    Object {
        path: String,
        reason: object_store::Error,
    },
    #[error(transparent)]
    Url(#[from] UrlError),
}

impl StorageError {
    /// Whether a write was refused because the file or object was there
    /// already (a create-only write: a generated session another capture
    /// took, a trace a session held before).
    pub fn is_taken(&self) -> bool {
        match self {
            StorageError::Object { reason, .. } => matches!(
                reason,
                object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. }
            ),
            StorageError::Io { source, .. } => source.kind() == io::ErrorKind::AlreadyExists,
            _ => false,
        }
    }
}

impl From<BeneathError> for StorageError {
    fn from(error: BeneathError) -> StorageError {
        match error {
            BeneathError::NotFound { path } => StorageError::NotFound { path },
            BeneathError::Io { path, source } => StorageError::Io { path, source },
            BeneathError::TooLarge { path, limit } => StorageError::TooLarge { path, limit },
            refused => StorageError::Refused(refused),
        }
    }
}

/// A folder or file one level down, and when it was last modified (a
/// folder: the newest modification in it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub modified: SystemTime,
}

/// A logdir or repository root as a person or a request names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    Object(ObjectUrl),
}

impl Location {
    /// `s3://...` and `gs://...` are object storage; any other
    /// `scheme://` is refused; everything else is a local path.
    pub fn parse(path: &Path) -> Result<Location, UrlError> {
        match path.to_str().map(ObjectUrl::parse).transpose()?.flatten() {
            Some(url) => Ok(Location::Object(url)),
            None => Ok(Location::Local(path.to_path_buf())),
        }
    }

    /// One more path segment.
    pub fn join(&self, name: &str) -> Location {
        match self {
            Location::Local(path) => Location::Local(path.join(name)),
            Location::Object(url) => Location::Object(url.join(name)),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(path) => write!(f, "{}", path.display()),
            Location::Object(url) => write!(f, "{url}"),
        }
    }
}

/// A directory of a repository, local or in object storage.
#[derive(Clone, Debug)]
pub enum Folder {
    Local(LocalFolder),
    Object(ObjectFolder),
}

impl Folder {
    /// An open local directory.
    pub fn local(dir: Dir) -> Folder {
        Folder::Local(LocalFolder::new(Arc::new(dir)))
    }

    /// Opens what `location` names: a local directory that must exist
    /// (links in its own path are followed, as its owner chose them), or a
    /// bucket prefix, connected with the environment's credentials.
    pub fn open(location: &Location) -> Result<Folder, StorageError> {
        match location {
            Location::Local(path) => Ok(Folder::local(Dir::open(path)?)),
            Location::Object(url) => Ok(Folder::Object(ObjectFolder::connect(url)?)),
        }
    }

    /// The same folder, its files touched with the rights of `caller`
    /// ([`acting`]): its own user's for a local caller, `nobody`'s for one
    /// on another host, the agent's for the agent's own user. A bucket
    /// prefix is reached with the agent's credentials whoever asks.
    pub fn acting_for(
        &self,
        caller: &crate::protocol::caller::Caller,
    ) -> Result<Folder, StorageError> {
        match self {
            Folder::Local(local) => {
                let credentials = acting::Credentials::of_caller(caller).map(Arc::new);
                Ok(Folder::Local(local.acting_as(credentials)?))
            }
            Folder::Object(_) => Ok(self.clone()),
        }
    }

    /// The same folder, the files it writes kept from other users (0640
    /// at most), for traces of the whole host (every user's processes,
    /// command lines and kernels). A bucket's access is its own policy's.
    pub fn kept_from_others(&self) -> Result<Folder, StorageError> {
        match self {
            Folder::Local(local) => Ok(Folder::Local(local.withholding(0o007)?)),
            Folder::Object(_) => Ok(self.clone()),
        }
    }

    pub fn join(&self, name: &str) -> Folder {
        match self {
            Folder::Local(local) => Folder::Local(local.join(name)),
            Folder::Object(object) => Folder::Object(object.join(name)),
        }
    }

    /// The path or URL, for messages.
    pub fn display(&self) -> String {
        match self {
            Folder::Local(local) => local.path().display().to_string(),
            Folder::Object(object) => object.url().to_string(),
        }
    }

    /// Whether it exists: a directory, or a prefix with objects under it.
    pub fn exists(&self) -> Result<bool, StorageError> {
        match self {
            Folder::Local(local) => local.exists(),
            Folder::Object(object) => object.exists(),
        }
    }

    /// The folders in this one. An object prefix counts when objects lie
    /// under it.
    pub fn subfolders(&self) -> Result<Vec<Listed>, StorageError> {
        match self {
            Folder::Local(local) => local.subfolders(),
            Folder::Object(object) => object.subfolders(),
        }
    }

    /// The names of the files directly in this folder.
    pub fn files(&self) -> Result<Vec<String>, StorageError> {
        Ok(self.listed_files()?.into_iter().map(|f| f.name).collect())
    }

    /// The files directly in this folder, with when each was modified.
    pub fn listed_files(&self) -> Result<Vec<Listed>, StorageError> {
        match self {
            Folder::Local(local) => local.files(),
            Folder::Object(object) => object.files(),
        }
    }

    /// A file's size, as reading it now would find it.
    pub fn size(&self, name: &str) -> Result<u64, StorageError> {
        match self {
            Folder::Local(local) => local.size(name),
            Folder::Object(object) => object.size(name),
        }
    }

    /// A file's bytes, up to [`MAX_READ_BYTES`].
    pub fn read(&self, name: &str) -> Result<Vec<u8>, StorageError> {
        match self {
            Folder::Local(local) => local.read(name),
            Folder::Object(object) => object.read(name),
        }
    }

    /// A file's bytes, refused beyond `limit` (and [`MAX_READ_BYTES`]):
    /// for a reader that counted the file's size before, so that one grown
    /// since is not read past what was counted.
    pub fn read_at_most(&self, name: &str, limit: u64) -> Result<Vec<u8>, StorageError> {
        match self {
            Folder::Local(local) => local.read_at_most(name, limit),
            Folder::Object(object) => object.read_at_most(name, limit),
        }
    }

    /// Writes a whole file (never a partial one), making the folder first
    /// where folders exist. Returns where it went.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<String, StorageError> {
        match self {
            Folder::Local(local) => local.write(name, bytes),
            Folder::Object(object) => object.write(name, bytes),
        }
    }

    /// Writes as [`Folder::write`] does, the content given in parts (a
    /// trace as it was encoded), without joining them.
    pub fn write_parts(&self, name: &str, parts: &[bytes::Bytes]) -> Result<String, StorageError> {
        match self {
            Folder::Local(local) => local.write_parts(name, parts),
            Folder::Object(object) => object.put(name, parts.iter().cloned().collect()),
        }
    }

    /// The folder of session `session_id` in this repository root, and the
    /// session's final name. A generated id (a timestamp) names a new
    /// folder, `_2`, `_3`, ... appended when the name is taken, so that two
    /// captures of one second never overwrite each other; a client's id
    /// names its folder as is. Either way the folder is create-only: no
    /// write into it replaces a file it holds.
    ///
    /// A directory is taken the moment it is made; a bucket has no
    /// directories, so a generated name is taken there by writing its
    /// [`SESSION_MARKER`] create-only: of two captures that found a name
    /// free in the same second, the second's marker is refused and it
    /// moves on to the next name, before either has captured anything.
    pub fn create_session(
        &self,
        session_id: &str,
        generated: bool,
    ) -> Result<(Folder, String), StorageError> {
        match (self, generated) {
            (Folder::Local(local), true) => {
                let (folder, name) = local.create_unique(session_id)?;
                Ok((Folder::Local(folder.create_only()), name))
            }
            (Folder::Local(local), false) => {
                let folder = local.join(session_id);
                folder.create()?;
                Ok((Folder::Local(folder.create_only()), session_id.to_string()))
            }
            (Folder::Object(object), true) => {
                for attempt in 1..=MAX_UNIQUE_ATTEMPTS {
                    let name = match attempt {
                        1 => session_id.to_string(),
                        n => format!("{session_id}_{n}"),
                    };
                    let folder = object.join(&name).create_only();
                    if folder.exists()? {
                        continue;
                    }
                    match folder.write(SESSION_MARKER, SESSION_MARKER_TEXT) {
                        Ok(_) => return Ok((Folder::Object(folder), name)),
                        // Taken between the look and the write.
                        Err(error) if error.is_taken() => continue,
                        Err(error) => return Err(error),
                    }
                }
                Err(StorageError::Io {
                    path: object.url().join(session_id).to_string(),
                    source: io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{MAX_UNIQUE_ATTEMPTS} session names are taken"),
                    ),
                })
            }
            (Folder::Object(object), false) => Ok((
                Folder::Object(object.join(session_id).create_only()),
                session_id.to_string(),
            )),
        }
    }

    /// Gives back a session [`Folder::create_session`] made for a capture
    /// that wrote nothing into it: in a bucket, its marker goes when it is
    /// all the session holds; a directory goes when it is empty.
    pub fn release_session(&self) -> Result<(), StorageError> {
        match self {
            Folder::Local(local) => {
                local.remove_if_empty();
                Ok(())
            }
            Folder::Object(object)
                if object
                    .files()?
                    .iter()
                    .map(|f| f.name.as_str())
                    .eq([SESSION_MARKER]) =>
            {
                object.remove(SESSION_MARKER)
            }
            Folder::Object(_) => Ok(()),
        }
    }

    /// Takes back the marker [`Folder::create_session`] wrote, from a
    /// session another writer put files of its own in after all.
    pub fn remove_session_marker(&self) -> Result<(), StorageError> {
        match self {
            Folder::Local(_) => Ok(()),
            Folder::Object(object) => object.remove(SESSION_MARKER),
        }
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Folder::Object(_))
    }

    /// The same folder, whose writes fail ([`StorageError::is_taken`])
    /// rather than replace a file or object.
    pub fn create_only(self) -> Folder {
        match self {
            Folder::Local(local) => Folder::Local(local.create_only()),
            Folder::Object(object) => Folder::Object(object.create_only()),
        }
    }

    /// Removes what writes into this repository root left when the agent
    /// writing them was killed: unfinished trace files in its sessions
    /// (untouched for [`ABANDONED_AFTER`], held by no process) and, with
    /// `empty_sessions` (a root only agents make sessions in), sessions
    /// that have held nothing for that long, unless `leave` says to leave
    /// one alone (one being written, one not named as the agent names its
    /// own). In a bucket, where objects are written whole, only sessions
    /// that hold nothing but their marker are looked for.
    pub fn remove_abandoned(
        &self,
        empty_sessions: Option<std::time::Duration>,
        leave: &dyn Fn(&str) -> bool,
    ) -> Result<Abandoned, StorageError> {
        match (self, empty_sessions) {
            (Folder::Local(local), _) => {
                local.remove_abandoned(ABANDONED_AFTER, empty_sessions, leave)
            }
            (Folder::Object(_), None) => Ok(Abandoned::default()),
            (Folder::Object(object), Some(grace)) => Ok(Abandoned {
                unfinished_files: Vec::new(),
                empty_sessions: object.remove_lone_markers(SESSION_MARKER, grace, leave)?,
            }),
        }
    }
}

/// How long an unfinished file or an empty session must have lain
/// untouched before a sweep takes it for abandoned.
pub const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// What [`Folder::remove_abandoned`] removed, as `session/file` and
/// `session`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Abandoned {
    pub unfinished_files: Vec<String>,
    pub empty_sessions: Vec<String>,
}

/// A file of a session written in parts as it arrives, in place only once
/// committed; dropped before that, it leaves nothing behind.
pub enum NewFile {
    /// A local file beneath its root, renamed into place on commit.
    Local(crate::repository::beneath::AtomicFile),
    /// An upload, spooled on local disk (a private temporary file) until
    /// complete, then sent whole. When it fails, the spooled trace is kept
    /// (see [`keep_unsent`]) and the error says where.
    Object(Spooled),
}

/// The local part of an upload in progress.
pub struct Spooled {
    spool: tempfile::NamedTempFile,
    /// Where it goes, or why it cannot (the session's folder could not be
    /// made): it is then kept at commit.
    target: Result<Folder, String>,
    name: String,
    session_id: String,
    unsent_dir: PathBuf,
}

impl NewFile {
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        use std::io::Write;
        match self {
            NewFile::Local(file) => file.write_all(bytes).map_err(|e| e.to_string()),
            NewFile::Object(spooled) => spooled
                .spool
                .write_all(bytes)
                .map_err(|e| format!("spooling to {}: {e}", spooled.spool.path().display())),
        }
    }

    /// Puts the file in place; where it went, or why not (and where the
    /// trace is kept instead).
    pub fn commit(self) -> Result<String, String> {
        match self {
            NewFile::Local(file) => file
                .commit()
                .map(|path| path.display().to_string())
                .map_err(|e| e.to_string()),
            NewFile::Object(spooled) => spooled.upload(),
        }
    }
}

impl Spooled {
    fn upload(self) -> Result<String, String> {
        let bytes = std::fs::read(self.spool.path()).map_err(|e| {
            format!(
                "reading back the spooled trace {}: {e}",
                self.spool.path().display()
            )
        })?;
        match &self.target {
            Ok(folder) => write_or_keep(
                folder,
                &self.session_id,
                &self.name,
                &bytes,
                &self.unsent_dir,
            ),
            Err(why) => Err(keep_failed_upload(
                &self.name,
                why,
                &self.unsent_dir,
                &self.session_id,
                &self.name,
                &bytes,
            )),
        }
    }
}

/// Starts `name` in `session` (a folder of session `session_id`, or why it
/// could not be made), spooling uploads under `unsent_dir`.
pub fn create_file(
    session: Result<&Folder, String>,
    session_id: &str,
    name: &str,
    unsent_dir: &Path,
) -> Result<NewFile, String> {
    if let Ok(Folder::Local(local)) = session {
        return local
            .create_atomic(name)
            .map(NewFile::Local)
            .map_err(|e| e.to_string());
    }
    std::fs::create_dir_all(unsent_dir)
        .and_then(|()| tempfile::NamedTempFile::new_in(unsent_dir))
        .map(|spool| {
            NewFile::Object(Spooled {
                spool,
                target: session.cloned(),
                name: name.to_string(),
                session_id: session_id.to_string(),
                unsent_dir: unsent_dir.to_path_buf(),
            })
        })
        .map_err(|e| format!("spooling {name} under {}: {e}", unsent_dir.display()))
}

/// Keeps a trace that could not be written to its repository on local disk,
/// so that it is not lost: `<dir>/devtrace-unsent-XXXXXX/<session>/<file>`,
/// in a new directory only this user can open. Returns the file's path.
pub fn keep_unsent(
    dir: &Path,
    session_id: &str,
    file_name: &str,
    bytes: &[u8],
) -> io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    // Traces name the host's processes and files: not for other users of
    // a shared temporary directory.
    let kept = tempfile::Builder::new()
        .prefix("devtrace-unsent-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(dir)?
        .keep();
    let session = kept.join(session_id);
    std::fs::create_dir_all(&session)?;
    let path = session.join(file_name);
    std::fs::write(&path, bytes)?;
    Ok(path)
}

/// Writes `name` into `folder`; when an upload to object storage fails, the
/// trace is kept under `unsent_dir` instead and the error says where.
pub fn write_or_keep(
    folder: &Folder,
    session_id: &str,
    name: &str,
    bytes: &[u8],
    unsent_dir: &Path,
) -> Result<String, String> {
    let _writing = crate::model::under_way::begin(format!("writing {}/{name}", folder.display()));
    match folder.write(name, bytes) {
        Ok(written) => Ok(written),
        Err(error) if folder.is_object() => {
            let target = format!("{}/{name}", folder.display());
            Err(keep_failed_upload(
                &target, &error, unsent_dir, session_id, name, bytes,
            ))
        }
        Err(error) => Err(error.to_string()),
    }
}

/// Keeps a trace whose upload to `target` failed with `error` (see
/// [`keep_unsent`]); returns the message that says both.
pub fn keep_failed_upload(
    target: &str,
    error: &dyn std::fmt::Display,
    unsent_dir: &Path,
    session_id: &str,
    name: &str,
    bytes: &[u8],
) -> String {
    let attempt = format!("uploading to {target}");
    keep_failed_write(&attempt, error, unsent_dir, session_id, name, bytes)
}

/// Keeps a trace whose `attempt` to write it ("writing PATH", "uploading
/// to URL") failed with `error` (see [`keep_unsent`]); returns the message
/// that says both.
pub fn keep_failed_write(
    attempt: &str,
    error: &dyn std::fmt::Display,
    unsent_dir: &Path,
    session_id: &str,
    name: &str,
    bytes: &[u8],
) -> String {
    match keep_unsent(unsent_dir, session_id, name, bytes) {
        Ok(kept) => format!(
            "{attempt} failed ({error}); the trace is kept at {}",
            kept.display()
        ),
        Err(keep) => format!(
            "{attempt} failed ({error}), and keeping it under {} failed too ({keep})",
            unsent_dir.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_tell_object_urls_from_paths() {
        assert!(matches!(
            Location::parse(Path::new("s3://b/logs")),
            Ok(Location::Object(_))
        ));
        assert_eq!(
            Location::parse(Path::new("logs/run1")).unwrap(),
            Location::Local(PathBuf::from("logs/run1"))
        );
        assert!(Location::parse(Path::new("file:///tmp/x")).is_err());
        assert_eq!(
            Location::parse(Path::new("gs://b/logs"))
                .unwrap()
                .join("plugins")
                .to_string(),
            "gs://b/logs/plugins"
        );
    }

    #[test]
    fn a_create_only_folder_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = Folder::open(&Location::Local(dir.path().to_path_buf())).unwrap();
        let session = root.join("s1");
        session.write("h.xplane.pb", b"first").unwrap();
        // Written whole, then refused at the commit: a trace that arrived
        // between a look and the write.
        let kept = session.clone().create_only();
        let mut late = create_file(Ok(&kept), "s1", "h.xplane.pb", dir.path()).unwrap();
        late.write(b"second").unwrap();
        let refused = late.commit().unwrap_err();
        assert!(refused.contains("exists"), "{refused}");
        let error = kept.write("h.xplane.pb", b"third").unwrap_err();
        assert!(error.is_taken(), "{error}");
        assert_eq!(
            std::fs::read(dir.path().join("s1/h.xplane.pb")).unwrap(),
            b"first"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path().join("s1")).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary left: {names:?}");
        // A new name is written, and a plain folder still replaces.
        kept.write("g.xplane.pb", b"other").unwrap();
        session.write("h.xplane.pb", b"fourth").unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("s1/h.xplane.pb")).unwrap(),
            b"fourth"
        );
    }

    #[test]
    fn unsent_traces_are_kept_whole_in_a_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let kept = keep_unsent(dir.path(), "s1", "h.xplane.pb", b"trace").unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), b"trace");
        let private = kept.parent().unwrap().parent().unwrap();
        assert!(private.starts_with(dir.path()));
        let mode = std::fs::metadata(private).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // A second one gets a directory of its own.
        let again = keep_unsent(dir.path(), "s1", "h.xplane.pb", b"other").unwrap();
        assert_ne!(kept, again);
        assert_eq!(std::fs::read(&kept).unwrap(), b"trace");
    }
}
