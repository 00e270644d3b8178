//! Files beneath a directory descriptor, for every path a client names.
//!
//! The agent runs as root and the directories it serves (`--allow-root`)
//! are shared with other users, so a path is never checked and then opened
//! by name: anyone able to write there could swap a component for a
//! symbolic link between the two. Instead each path is resolved beneath the
//! descriptor of a directory the agent already holds, and no symbolic link
//! on the way is followed: `openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS`, or, where the kernel lacks `openat2` (before Linux
//! 5.6, or filtered out by a seccomp policy), a walk one component at a time
//! with `openat(O_NOFOLLOW)`. Directories made for writes are made beneath
//! the same descriptor (`mkdirat`), and files are written under a temporary
//! name and renamed into place (`renameat`), both relative to it. A
//! directory given a caller's credentials ([`Dir::acting_as`]) does all of
//! this with that caller's rights ([`crate::repository::acting`]).
//!
//! What it makes is readable as this process's umask allows (directories
//! 0755, files 0644 under the usual 022), and files less where a directory
//! was told to withhold more ([`Dir::withholding`]): traces of the whole
//! host are kept from other users. (Directories stay searchable: session
//! and host names are what other users' TensorBoard lists anyway.)

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;

use super::acting::Credentials;

/// Set once `openat2` answered ENOSYS: every later open walks instead.
static OPENAT2_MISSING: AtomicBool = AtomicBool::new(false);

/// Most suffixes tried for a directory name that is taken.
const MAX_UNIQUE_ATTEMPTS: u32 = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    #[error("{path} does not exist")]
    NotFound { path: String },
    #[error(
        "{path} passes through a symbolic link; links are not followed beneath an allowed root"
    )]
    Symlink { path: String },
    #[error("{path} is not a plain path beneath its root ('..' and absolute parts are refused)")]
    Escapes { path: String },
    #[error("{path} is not a regular file")]
    NotFile { path: String },
    #[error("{path} is larger than the {limit} bytes the agent reads")]
    TooLarge { path: String, limit: u64 },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

/// The largest file [`Dir::read`] returns: 1 GiB.
pub const MAX_READ_BYTES: u64 = 1 << 30;

/// How paths are resolved: the kernel's `openat2`, or the walk that stands
/// in for it. Chosen at run time; tests run both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolver {
    Openat2,
    Walk,
}

impl Resolver {
    /// `openat2` until the kernel has said it does not have it.
    pub fn detect() -> Resolver {
        if OPENAT2_MISSING.load(Ordering::Relaxed) {
            Resolver::Walk
        } else {
            Resolver::Openat2
        }
    }
}

/// What a directory entry is, seen without following links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    Directory,
    File,
    /// A symbolic link, FIFO, socket or device: never opened.
    Other,
}

/// One entry of a [`Dir`].
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: OsString,
    pub kind: EntryKind,
    pub modified: SystemTime,
}

/// An open directory that paths are resolved beneath.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    /// Where it is, for messages only: never opened by name again.
    path: PathBuf,
    resolver: Resolver,
    /// Whose rights everything beneath it is done with; none: the agent's.
    acting: Option<Arc<Credentials>>,
    /// Permission bits the files made beneath it never have, beyond what
    /// the umask takes.
    withheld: u32,
}

/// This process's umask, read without changing it (`umask(2)` can only
/// be read by setting it, which races with other threads making files).
pub fn process_umask() -> u32 {
    static UMASK: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *UMASK.get_or_init(|| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|status| {
                let line = status.lines().find(|line| line.starts_with("Umask:"))?;
                u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
            })
            // Linux before 4.7 does not say: the usual one.
            .unwrap_or(0o022)
    })
}

impl Dir {
    /// Opens a directory the operator or the local user named; links in
    /// `path` itself are followed, as they chose it.
    pub fn open(path: &Path) -> Result<Dir, BeneathError> {
        let fd = rfs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| io_error(path, errno))?;
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
            resolver: Resolver::detect(),
            acting: None,
            withheld: 0,
        })
    }

    /// The same directory, whose files made beneath it never have the
    /// permission bits `bits` (0o007: nothing for other users).
    pub fn withholding(&self, bits: u32) -> Result<Dir, BeneathError> {
        let mut dir = self.duplicate()?;
        dir.withheld |= bits;
        Ok(dir)
    }

    /// The same directory, everything beneath it done with `credentials`'
    /// rights ([`crate::repository::acting`]); none: the agent's own.
    pub fn acting_as(&self, credentials: Option<Arc<Credentials>>) -> Result<Dir, BeneathError> {
        let mut dir = self.duplicate()?;
        dir.acting = credentials;
        Ok(dir)
    }

    /// Runs `work` with the rights this directory acts with.
    fn acting<T: Send>(
        &self,
        work: impl FnOnce() -> Result<T, BeneathError> + Send,
    ) -> Result<T, BeneathError> {
        act(self.acting.as_deref(), &self.path, work)
    }

    /// The same directory resolving with `resolver` (tests of the walk).
    pub fn with_resolver(mut self, resolver: Resolver) -> Dir {
        self.resolver = resolver;
        self
    }

    /// Where this directory is, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory at `relative` beneath this one.
    pub fn open_dir(&self, relative: &Path) -> Result<Dir, BeneathError> {
        self.acting(|| {
            let components = plain_components(relative, &self.path)?;
            let fd = self.open_components(&components, OFlags::RDONLY | OFlags::DIRECTORY)?;
            Ok(self.child(fd, relative))
        })
    }

    /// The directory at `relative`, made (mode 0755) where missing, each
    /// level beneath the one before.
    pub fn create_dir_all(&self, relative: &Path) -> Result<Dir, BeneathError> {
        self.acting(|| {
            let components = plain_components(relative, &self.path)?;
            let mut current = self.duplicate()?;
            for name in components {
                current = current.create_dir(name)?;
            }
            Ok(current)
        })
    }

    /// The subdirectory `name`, made when missing.
    fn create_dir(&self, name: &OsStr) -> Result<Dir, BeneathError> {
        match rfs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(errno) => return Err(io_error(&self.path.join(name), errno)),
        }
        self.open_dir(Path::new(name))
    }

    /// A new subdirectory named `base`, or `base_2`, `base_3`, ... when
    /// that is taken: never one that existed before.
    pub fn create_unique_dir(&self, base: &str) -> Result<(Dir, String), BeneathError> {
        self.acting(|| {
            single_component(base, &self.path)?;
            for attempt in 1..=MAX_UNIQUE_ATTEMPTS {
                let name = if attempt == 1 {
                    base.to_string()
                } else {
                    format!("{base}_{attempt}")
                };
                match rfs::mkdirat(&self.fd, name.as_str(), Mode::from_raw_mode(0o755)) {
                    Ok(()) => return Ok((self.open_dir(Path::new(&name))?, name)),
                    Err(Errno::EXIST) => continue,
                    Err(errno) => return Err(io_error(&self.path.join(&name), errno)),
                }
            }
            Err(BeneathError::Io {
                path: self.path.join(base).display().to_string(),
                source: io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{MAX_UNIQUE_ATTEMPTS} names in a row are taken"),
                ),
            })
        })
    }

    /// The regular file at `relative`, opened for reading. A FIFO or device
    /// is refused without blocking on it.
    pub fn open_file(&self, relative: &Path) -> Result<File, BeneathError> {
        self.acting(|| {
            let components = plain_components(relative, &self.path)?;
            let fd = self.open_components(&components, OFlags::RDONLY | OFlags::NONBLOCK)?;
            let shown = self.path.join(relative);
            let stat = rfs::fstat(&fd).map_err(|errno| io_error(&shown, errno))?;
            if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                return Err(BeneathError::NotFile {
                    path: shown.display().to_string(),
                });
            }
            Ok(File::from(fd))
        })
    }

    /// The contents of the regular file at `relative`, refused beyond
    /// [`MAX_READ_BYTES`] (files under a root are anyone's who can write
    /// there; a trace is decoded in several times its size).
    pub fn read(&self, relative: &Path) -> Result<Vec<u8>, BeneathError> {
        self.read_at_most(relative, MAX_READ_BYTES)
    }

    /// As [`Dir::read`], refused beyond `limit` bytes (at most
    /// [`MAX_READ_BYTES`]): what was counted for a file is all that is
    /// read of it, whatever it has grown to since.
    pub fn read_at_most(&self, relative: &Path, limit: u64) -> Result<Vec<u8>, BeneathError> {
        let limit = limit.min(MAX_READ_BYTES);
        self.acting(|| {
            let path = || self.path.join(relative).display().to_string();
            let too_large = || BeneathError::TooLarge {
                path: path(),
                limit,
            };
            let file = self.open_file(relative)?;
            if file.metadata().is_ok_and(|m| m.len() > limit) {
                return Err(too_large());
            }
            let mut bytes = Vec::new();
            // One byte past the limit tells a file that grew since.
            file.take(limit + 1)
                .read_to_end(&mut bytes)
                .map_err(|source| BeneathError::Io {
                    path: path(),
                    source,
                })?;
            if bytes.len() as u64 > limit {
                return Err(too_large());
            }
            Ok(bytes)
        })
    }

    /// The entries of this directory (without `.` and `..`), each looked at
    /// without following links.
    pub fn entries(&self) -> Result<Vec<Entry>, BeneathError> {
        self.acting(|| {
            let io = |errno| io_error(&self.path, errno);
            let mut entries = Vec::new();
            for entry in rfs::Dir::read_from(&self.fd).map_err(io)? {
                let entry = entry.map_err(io)?;
                let name = OsStr::from_bytes(entry.file_name().to_bytes());
                if name == "." || name == ".." {
                    continue;
                }
                // Gone since it was listed: skip it.
                let Ok(stat) = rfs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) else {
                    continue;
                };
                let kind = match FileType::from_raw_mode(stat.st_mode) {
                    FileType::Directory => EntryKind::Directory,
                    FileType::RegularFile => EntryKind::File,
                    _ => EntryKind::Other,
                };
                let modified =
                    u64::try_from(stat.st_mtime)
                        .ok()
                        .map_or(SystemTime::UNIX_EPOCH, |secs| {
                            SystemTime::UNIX_EPOCH
                                + Duration::new(
                                    secs,
                                    u32::try_from(stat.st_mtime_nsec).unwrap_or(0),
                                )
                        });
                entries.push(Entry {
                    name: name.to_os_string(),
                    kind,
                    modified,
                });
            }
            Ok(entries)
        })
    }

    /// Writes `bytes` as `name` in this directory (mode 0644): written and
    /// synced under a temporary name, then renamed over the file `name` was.
    /// A symbolic link there is refused (a rename would only replace the
    /// link, but whoever placed it meant something else).
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> Result<PathBuf, BeneathError> {
        let mut file = self.create_atomic(name)?;
        file.write_all(bytes)?;
        file.commit()
    }

    /// Starts writing `name` in this directory as [`Dir::write_atomic`]
    /// does, for content that arrives in parts: nothing appears under
    /// `name` until [`AtomicFile::commit`], and a file dropped before that
    /// is removed.
    pub fn create_atomic(&self, name: &str) -> Result<AtomicFile, BeneathError> {
        self.acting(|| {
            single_component(name, &self.path)?;
            let target = self.path.join(name);
            if is_symlink(self.fd.as_fd(), OsStr::new(name)) {
                return Err(BeneathError::Symlink {
                    path: target.display().to_string(),
                });
            }
            let directory = self.fd.try_clone().map_err(|source| BeneathError::Io {
                path: self.path.display().to_string(),
                source,
            })?;
            let (temporary, file) = self.create_temporary(name)?;
            // Held while it is written: a sweep leaves it alone
            // ([`Dir::remove_abandoned_temporaries`]).
            devtrace_shm::lock::hold_shared(&file).map_err(|source| BeneathError::Io {
                path: self.path.join(&temporary).display().to_string(),
                source,
            })?;
            Ok(AtomicFile {
                directory,
                acting: self.acting.clone(),
                mode: 0o644 & !self.withheld & !process_umask(),
                temporary,
                name: name.to_string(),
                target,
                replace: true,
                file: Some(file),
            })
        })
    }

    /// Removes the temporary files a writer killed mid-write left in this
    /// directory: named as [`Dir::create_atomic`] names them
    /// (`.{name}.{pid}.{n}.tmp`), regular files that no process holds and
    /// older than `grace`. Links are never followed. Returns the names
    /// removed.
    pub fn remove_abandoned_temporaries(
        &self,
        grace: Duration,
    ) -> Result<Vec<String>, BeneathError> {
        self.acting(|| {
            let mut removed = Vec::new();
            for entry in self.entries()? {
                let Some(name) = entry.name.to_str() else {
                    continue;
                };
                let old = entry.modified.elapsed().is_ok_and(|age| age > grace);
                if old
                    && entry.kind == EntryKind::File
                    && is_temporary_name(name)
                    && self.unheld(name)
                    && rfs::unlinkat(&self.fd, name, AtFlags::empty()).is_ok()
                {
                    removed.push(name.to_string());
                }
            }
            Ok(removed)
        })
    }

    /// Removes the subdirectory `name` if it holds nothing (a link or a
    /// directory with anything in it stays); whether it did.
    pub fn remove_empty_dir(&self, name: &str) -> bool {
        single_component(name, &self.path).is_ok()
            && self
                .acting(|| {
                    rfs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR)
                        .map_err(|errno| io_error(&self.path.join(name), errno))
                })
                .is_ok()
    }

    /// Whether no process holds a lock on the file `name` (opened without
    /// following a link or blocking on a FIFO).
    fn unheld(&self, name: &str) -> bool {
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let Ok(fd) = rfs::openat(&self.fd, name, flags, Mode::empty()) else {
            return false;
        };
        matches!(devtrace_shm::lock::in_use(&File::from(fd)), Ok(false))
    }

    /// A new file `.{name}.{unique}.tmp` (mode 0600) that no one else opened.
    fn create_temporary(&self, name: &str) -> Result<(String, File), BeneathError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let head = temporary_head(name);
        loop {
            let temporary = format!(
                ".{head}.{}.{}.tmp",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let flags =
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            match rfs::openat(
                &self.fd,
                temporary.as_str(),
                flags,
                Mode::from_raw_mode(0o600),
            ) {
                Ok(fd) => return Ok((temporary, File::from(fd))),
                // Left by an agent of the same pid before a restart.
                Err(Errno::EXIST) => continue,
                Err(errno) => return Err(io_error(&self.path.join(name), errno)),
            }
        }
    }

    fn duplicate(&self) -> Result<Dir, BeneathError> {
        let fd = self.fd.try_clone().map_err(|source| BeneathError::Io {
            path: self.path.display().to_string(),
            source,
        })?;
        Ok(Dir {
            fd,
            path: self.path.clone(),
            resolver: self.resolver,
            acting: self.acting.clone(),
            withheld: self.withheld,
        })
    }

    fn child(&self, fd: OwnedFd, relative: &Path) -> Dir {
        Dir {
            fd,
            path: self.path.join(relative),
            resolver: self.resolver,
            acting: self.acting.clone(),
            withheld: self.withheld,
        }
    }

    /// Opens `components` beneath this directory; the last is opened with
    /// `flags`, and nothing on the way may be a symbolic link.
    fn open_components(
        &self,
        components: &[&OsStr],
        flags: OFlags,
    ) -> Result<OwnedFd, BeneathError> {
        let Some((last, parents)) = components.split_last() else {
            return rfs::openat(&self.fd, ".", flags | OFlags::CLOEXEC, Mode::empty())
                .map_err(|errno| io_error(&self.path, errno));
        };
        if self.resolver == Resolver::Openat2 && !OPENAT2_MISSING.load(Ordering::Relaxed) {
            let relative: PathBuf = components.iter().collect();
            match rfs::openat2(
                &self.fd,
                &relative,
                flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
            ) {
                Ok(fd) => return Ok(fd),
                Err(Errno::NOSYS) => OPENAT2_MISSING.store(true, Ordering::Relaxed),
                Err(errno) => return Err(self.classify(components, errno)),
            }
        }
        let mut current: Option<OwnedFd> = None;
        let mut walked = self.path.clone();
        for (name, component_flags) in parents
            .iter()
            .map(|name| (name, OFlags::RDONLY | OFlags::DIRECTORY))
            .chain(std::iter::once((last, flags)))
        {
            let at: BorrowedFd<'_> = current.as_ref().map_or(self.fd.as_fd(), |fd| fd.as_fd());
            walked.push(name);
            let opened = rfs::openat(
                at,
                *name,
                component_flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|errno| classify_at(at, name, &walked, errno))?;
            current = Some(opened);
        }
        current.ok_or_else(|| io_error(&self.path, Errno::NOENT))
    }

    /// Names the component an `openat2` failure was about: the first that is
    /// a link, when the failure was a link refused.
    fn classify(&self, components: &[&OsStr], errno: Errno) -> BeneathError {
        let whole = components.iter().fold(self.path.clone(), |p, c| p.join(c));
        if errno != Errno::LOOP && errno != Errno::XDEV && errno != Errno::NOTDIR {
            return io_error(&whole, errno);
        }
        // Find which component is the link, for the message.
        let mut current: Option<OwnedFd> = None;
        let mut walked = self.path.clone();
        for name in components {
            let at: BorrowedFd<'_> = current.as_ref().map_or(self.fd.as_fd(), |fd| fd.as_fd());
            walked.push(name);
            if is_symlink(at, name) {
                return BeneathError::Symlink {
                    path: walked.display().to_string(),
                };
            }
            match rfs::openat(
                at,
                *name,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => current = Some(fd),
                Err(_) => break,
            }
        }
        if errno == Errno::XDEV {
            BeneathError::Escapes {
                path: whole.display().to_string(),
            }
        } else if errno == Errno::LOOP {
            // Swapped back between the open and this look: still a link.
            BeneathError::Symlink {
                path: whole.display().to_string(),
            }
        } else {
            io_error(&whole, errno)
        }
    }
}

/// A file being written beneath a [`Dir`] under a temporary name
/// ([`Dir::create_atomic`]).
#[derive(Debug)]
pub struct AtomicFile {
    directory: OwnedFd,
    /// The rights of the directory it is made in.
    acting: Option<Arc<Credentials>>,
    /// Its permission bits once committed.
    mode: u32,
    temporary: String,
    name: String,
    target: PathBuf,
    /// Whether the commit may replace a file already called `name`.
    replace: bool,
    /// `None` once committed.
    file: Option<File>,
}

impl AtomicFile {
    fn io_error(&self, source: io::Error) -> BeneathError {
        BeneathError::Io {
            path: self.target.display().to_string(),
            source,
        }
    }

    /// Appends `bytes`.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), BeneathError> {
        let written = match self.file.as_mut() {
            Some(file) => file.write_all(bytes),
            None => Err(io::Error::other("already committed")),
        };
        written.map_err(|source| self.io_error(source))
    }

    /// The same file, whose commit fails with `AlreadyExists` rather than
    /// replace a file already called `name`.
    pub fn keeping_existing(mut self) -> AtomicFile {
        self.replace = false;
        self
    }

    /// Syncs the file and renames it over `name` (mode 0644 less the
    /// umask and what its directory withholds), or beside
    /// it, failing, when kept ([`AtomicFile::keeping_existing`]); where it
    /// is.
    pub fn commit(mut self) -> Result<PathBuf, BeneathError> {
        let Some(file) = self.file.take() else {
            return Err(self.io_error(io::Error::other("already committed")));
        };
        let (directory, temporary, name) = (&self.directory, &self.temporary, &self.name);
        let (replace, mode) = (self.replace, self.mode);
        let done = act(self.acting.as_deref(), &self.target, || {
            let renamed = (|| -> io::Result<()> {
                // Traces are for reading by the people who asked for them
                // (the temporary file was private while it was written).
                rfs::fchmod(&file, Mode::from_raw_mode(mode))?;
                file.sync_all()?;
                if replace {
                    rfs::renameat(directory, temporary.as_str(), directory, name.as_str())?;
                } else {
                    put_beside(directory, temporary, name)?;
                }
                Ok(())
            })();
            if renamed.is_err() {
                let _ = rfs::unlinkat(directory, temporary.as_str(), AtFlags::empty());
            }
            renamed.map_err(|source| BeneathError::Io {
                path: String::new(),
                source,
            })
        });
        match done {
            Ok(()) => Ok(std::mem::take(&mut self.target)),
            Err(BeneathError::Io { source, .. }) => Err(self.io_error(source)),
            Err(other) => Err(other),
        }
    }
}

/// Gives `temporary` the name `name` in `directory` unless a file has it,
/// failing with `AlreadyExists` then. NFS, FUSE and other filesystems
/// refuse the rename flag that does it at once (`EINVAL`): there a hard
/// link, which fails when the name is taken, does it, the temporary name
/// then removed.
fn put_beside(directory: &OwnedFd, temporary: &str, name: &str) -> io::Result<()> {
    match rfs::renameat_with(
        directory,
        temporary,
        directory,
        name,
        RenameFlags::NOREPLACE,
    ) {
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
            rfs::linkat(directory, temporary, directory, name, AtFlags::empty())?;
            // Linked: the trace is in place whether this goes or not.
            let _ = rfs::unlinkat(directory, temporary, AtFlags::empty());
            Ok(())
        }
        renamed => Ok(renamed?),
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let (directory, temporary) = (&self.directory, &self.temporary);
            let _ = act(self.acting.as_deref(), &self.target, || {
                rfs::unlinkat(directory, temporary.as_str(), AtFlags::empty())
                    .map_err(|errno| io_error(Path::new(temporary), errno))
            });
        }
    }
}

/// Runs `work` with `credentials`' rights (on a thread of their own), or
/// the agent's own when there are none.
fn act<T: Send>(
    credentials: Option<&Credentials>,
    path: &Path,
    work: impl FnOnce() -> Result<T, BeneathError> + Send,
) -> Result<T, BeneathError> {
    match credentials {
        None => work(),
        Some(credentials) => credentials.run(work).map_err(|source| BeneathError::Io {
            path: path.display().to_string(),
            source,
        })?,
    }
}

/// What of `name` its temporary file's name holds: all of it, unless the
/// temporary name would pass the 255 bytes a file name may have (a name
/// that fits may not fit with what a temporary adds); the pid and counter
/// keep temporaries apart either way.
fn temporary_head(name: &str) -> &str {
    // '.', then '.' pid (u32) '.' counter (u64) ".tmp".
    const ADDED: usize = 1 + 1 + 10 + 1 + 20 + 4;
    const LONGEST_NAME: usize = 255;
    let mut end = name.len().min(LONGEST_NAME - ADDED);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// Whether `name` is one [`Dir::create_atomic`] gives its temporary files:
/// `.{name}.{pid}.{n}.tmp`.
fn is_temporary_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let mut numbers = rest.rsplitn(3, '.');
    let counter = numbers.next().is_some_and(|n| n.parse::<u64>().is_ok());
    let pid = numbers.next().is_some_and(|n| n.parse::<u32>().is_ok());
    let target = numbers.next().is_some_and(|n| !n.is_empty());
    counter && pid && target
}

fn is_symlink(at: BorrowedFd<'_>, name: &OsStr) -> bool {
    rfs::statat(at, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|stat| FileType::from_raw_mode(stat.st_mode) == FileType::Symlink)
}

/// An `openat(O_NOFOLLOW)` failure of the walk: a link when the component
/// is one (ELOOP, or ENOTDIR for a link where a directory was wanted).
fn classify_at(at: BorrowedFd<'_>, name: &OsStr, walked: &Path, errno: Errno) -> BeneathError {
    if (errno == Errno::LOOP || errno == Errno::NOTDIR) && is_symlink(at, name) {
        BeneathError::Symlink {
            path: walked.display().to_string(),
        }
    } else {
        io_error(walked, errno)
    }
}

fn io_error(path: &Path, errno: Errno) -> BeneathError {
    let path = path.display().to_string();
    if errno == Errno::NOENT {
        BeneathError::NotFound { path }
    } else {
        BeneathError::Io {
            path,
            source: io::Error::from_raw_os_error(errno.raw_os_error()),
        }
    }
}

/// The components of a relative path, all plain names (`.` dropped);
/// `..`, a root or an empty name is refused.
fn plain_components<'p>(relative: &'p Path, base: &Path) -> Result<Vec<&'p OsStr>, BeneathError> {
    relative
        .components()
        .filter(|c| *c != Component::CurDir)
        .map(|component| match component {
            Component::Normal(name) => Ok(name),
            _ => Err(BeneathError::Escapes {
                path: base.join(relative).display().to_string(),
            }),
        })
        .collect()
}

/// `name` as one plain path component.
fn single_component(name: &str, base: &Path) -> Result<(), BeneathError> {
    let path = Path::new(name);
    match plain_components(path, base)?.as_slice() {
        [only] if *only == OsStr::new(name) => Ok(()),
        _ => Err(BeneathError::Escapes {
            path: base.join(name).display().to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A root with `inside/file` and, outside it, `secret` and `outside/`.
    struct Fixture {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("inside")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("inside/file"), b"ours").unwrap();
        std::fs::write(dir.path().join("secret"), b"secret").unwrap();
        std::fs::write(outside.join("file"), b"outside").unwrap();
        Fixture {
            _dir: dir,
            root,
            outside,
        }
    }

    fn both() -> [Resolver; 2] {
        [Resolver::Openat2, Resolver::Walk]
    }

    #[test]
    fn only_unheld_old_temporaries_are_taken_for_abandoned() {
        let dir = tempfile::tempdir().unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        let make = |name: &str, aged: bool| {
            let path = dir.path().join(name);
            let file = File::create(&path).unwrap();
            if aged {
                file.set_modified(old).unwrap();
            }
            file
        };
        make(".host.xplane.pb.12.0.tmp", true);
        let held = make(".host.xplane.pb.12.1.tmp", true);
        devtrace_shm::lock::hold_shared(&held).unwrap();
        make(".host.xplane.pb.12.2.tmp", false);
        make(".host.xplane.pb.tmp", true);
        make("host.xplane.pb", true);
        symlink("/etc/passwd", dir.path().join(".passwd.1.0.tmp")).unwrap();
        let root = Dir::open(dir.path()).unwrap();
        let removed = root
            .remove_abandoned_temporaries(Duration::from_secs(60))
            .unwrap();
        assert_eq!(removed, vec![".host.xplane.pb.12.0.tmp".to_string()]);
        // Once its writer lets go, the held one goes too.
        drop(held);
        let removed = root
            .remove_abandoned_temporaries(Duration::from_secs(60))
            .unwrap();
        assert_eq!(removed, vec![".host.xplane.pb.12.1.tmp".to_string()]);
        assert!(dir.path().join(".passwd.1.0.tmp").is_symlink());
        assert!(std::fs::metadata("/etc/passwd").is_ok());
    }

    #[test]
    fn a_file_being_written_is_held_until_committed() {
        let dir = tempfile::tempdir().unwrap();
        let root = Dir::open(dir.path()).unwrap();
        let mut file = root.create_atomic("host.xplane.pb").unwrap();
        file.write_all(b"trace").unwrap();
        let temporary = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(".tmp"))
            .expect("a temporary file");
        let asked = File::open(&temporary).unwrap();
        assert_eq!(devtrace_shm::lock::in_use(&asked).ok(), Some(true));
        file.commit().unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("host.xplane.pb")).unwrap(),
            b"trace"
        );
    }

    #[test]
    fn a_file_too_large_to_decode_is_refused_unread() {
        let f = fixture();
        // Sparse: costs nothing to make, would cost a gigabyte to read.
        std::fs::File::create(f.root.join("inside/huge"))
            .unwrap()
            .set_len(MAX_READ_BYTES + 1)
            .unwrap();
        let root = Dir::open(&f.root).unwrap();
        let error = root.read(Path::new("inside/huge")).unwrap_err();
        assert!(matches!(error, BeneathError::TooLarge { .. }), "{error}");
    }

    /// A name of the most bytes a file name holds is written: its
    /// temporary file's name, which adds to it, is cut to fit.
    #[test]
    fn the_longest_names_are_written_through_shorter_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let root = Dir::open(dir.path()).unwrap();
        // Two-byte characters after one of one byte, so that the cut (at
        // an even byte) falls inside one.
        let name = format!("a{}.xplane.pb", "é".repeat(120));
        assert_eq!(name.len(), 251);
        assert!(!name.is_char_boundary(255 - (1 + 1 + 10 + 1 + 20 + 4)));
        let mut file = root.create_atomic(&name).unwrap();
        file.write_all(b"trace").unwrap();
        let temporary = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .find(|n| n.ends_with(".tmp"))
            .expect("a temporary file");
        assert!(temporary.len() <= 255, "{}", temporary.len());
        assert!(is_temporary_name(&temporary), "{temporary}");
        file.commit().unwrap();
        assert_eq!(std::fs::read(dir.path().join(&name)).unwrap(), b"trace");
    }

    #[test]
    fn a_file_written_in_parts_appears_only_when_committed() {
        let f = fixture();
        let root = Dir::open(&f.root).unwrap();
        let mut file = root.create_atomic("t.xplane.pb").unwrap();
        file.write_all(b"first ").unwrap();
        file.write_all(b"second").unwrap();
        assert!(!f.root.join("t.xplane.pb").exists());
        let path = file.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first second");

        let mut abandoned = root.create_atomic("gone.xplane.pb").unwrap();
        abandoned.write_all(b"half").unwrap();
        drop(abandoned);
        let mut names: Vec<OsString> = root
            .entries()
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        names.sort();
        assert_eq!(names, ["inside", "t.xplane.pb"], "no temporary left");
    }

    #[test]
    fn plain_paths_read_and_write() {
        for resolver in both() {
            let f = fixture();
            let root = Dir::open(&f.root).unwrap().with_resolver(resolver);
            assert_eq!(root.read(Path::new("inside/file")).unwrap(), b"ours");
            assert_eq!(root.read(Path::new("./inside/./file")).unwrap(), b"ours");
            let made = root.create_dir_all(Path::new("a/b/c")).unwrap();
            let path = made.write_atomic("t.xplane.pb", b"trace").unwrap();
            assert_eq!(path, f.root.join("a/b/c/t.xplane.pb"));
            assert_eq!(std::fs::read(&path).unwrap(), b"trace");
            made.write_atomic("t.xplane.pb", b"again").unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), b"again");
            let names: Vec<OsString> = made
                .entries()
                .unwrap()
                .into_iter()
                .map(|e| e.name)
                .collect();
            assert_eq!(
                names,
                vec![OsString::from("t.xplane.pb")],
                "no temporary left"
            );
            assert!(matches!(
                root.read(Path::new("inside/missing")),
                Err(BeneathError::NotFound { .. })
            ));
        }
    }

    /// Asserts that `result` refused the link at `link`.
    fn refused_as_link<T: std::fmt::Debug>(
        result: Result<T, BeneathError>,
        link: &str,
        resolver: Resolver,
    ) {
        let error = result.unwrap_err();
        assert!(
            matches!(error, BeneathError::Symlink { .. }),
            "{resolver:?}: {error}"
        );
        assert!(error.to_string().contains(link), "{resolver:?}: {error}");
    }

    #[test]
    fn a_symlinked_file_is_refused_for_reading_and_writing() {
        for resolver in both() {
            let f = fixture();
            let secret = f.root.parent().unwrap().join("secret");
            symlink(&secret, f.root.join("inside/link")).unwrap();
            let root = Dir::open(&f.root).unwrap().with_resolver(resolver);
            refused_as_link(root.read(Path::new("inside/link")), "inside/link", resolver);
            let inside = root.open_dir(Path::new("inside")).unwrap();
            refused_as_link(
                inside.write_atomic("link", b"written"),
                "inside/link",
                resolver,
            );
            assert_eq!(std::fs::read(secret).unwrap(), b"secret");
        }
    }

    #[test]
    fn a_symlinked_directory_in_the_middle_is_refused_for_reading_and_writing() {
        for resolver in both() {
            let f = fixture();
            symlink(&f.outside, f.root.join("inside/escape")).unwrap();
            let root = Dir::open(&f.root).unwrap().with_resolver(resolver);
            let link = "inside/escape";
            refused_as_link(root.read(Path::new("inside/escape/file")), link, resolver);
            refused_as_link(root.open_dir(Path::new(link)), link, resolver);
            refused_as_link(
                root.create_dir_all(Path::new("inside/escape/session")),
                link,
                resolver,
            );
            let names: Vec<_> = std::fs::read_dir(&f.outside).unwrap().collect();
            assert_eq!(names.len(), 1, "nothing made outside the root");
        }
    }

    #[test]
    fn parent_and_absolute_components_are_refused() {
        for resolver in both() {
            let f = fixture();
            let root = Dir::open(&f.root).unwrap().with_resolver(resolver);
            for bad in ["../secret", "inside/../../secret", "/etc/passwd"] {
                let error = root.read(Path::new(bad)).unwrap_err();
                assert!(
                    matches!(error, BeneathError::Escapes { .. }),
                    "{bad}: {error}"
                );
            }
            assert!(matches!(
                root.create_dir_all(Path::new("a/../../up")),
                Err(BeneathError::Escapes { .. })
            ));
            assert!(matches!(
                root.write_atomic("../up", b"x"),
                Err(BeneathError::Escapes { .. })
            ));
            assert!(!f.root.parent().unwrap().join("up").exists());
        }
    }

    #[test]
    fn files_are_as_open_as_the_umask_and_their_directory_allow() {
        use std::os::unix::fs::PermissionsExt;
        let f = fixture();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        let root = Dir::open(&f.root).unwrap();
        let open = root.write_atomic("open.pb", b"x").unwrap();
        assert_eq!(mode(&open), 0o644 & !process_umask());
        let kept = root.withholding(0o007).unwrap();
        let whole_host = kept
            .create_dir_all(Path::new("session"))
            .unwrap()
            .write_atomic("host.pb", b"x")
            .unwrap();
        assert_eq!(mode(&whole_host), 0o640 & !process_umask());
        // Directories stay as they are made: only contents are kept.
        assert_eq!(mode(&f.root.join("session")), 0o755 & !process_umask());
    }

    #[test]
    fn process_umask_is_read_without_changing_it() {
        // SAFETY: umask has no preconditions; set back at once.
        let actual = unsafe {
            let old = libc::umask(0o022);
            libc::umask(old);
            old
        };
        assert_eq!(process_umask(), actual as u32);
    }

    #[test]
    fn fifos_are_refused_without_blocking() {
        let f = fixture();
        let fifo = f.root.join("inside/fifo");
        rfs::mknodat(
            rfs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let root = Dir::open(&f.root).unwrap();
        assert!(matches!(
            root.read(Path::new("inside/fifo")),
            Err(BeneathError::NotFile { .. })
        ));
        let kinds: Vec<(OsString, EntryKind)> = root
            .open_dir(Path::new("inside"))
            .unwrap()
            .entries()
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.kind))
            .collect();
        assert!(kinds.contains(&(OsString::from("fifo"), EntryKind::Other)));
        assert!(kinds.contains(&(OsString::from("file"), EntryKind::File)));
    }

    #[test]
    fn unique_directories_never_reuse_a_name() {
        let f = fixture();
        let root = Dir::open(&f.root).unwrap();
        let (_, first) = root.create_unique_dir("2026_01_01_00_00_00").unwrap();
        let (_, second) = root.create_unique_dir("2026_01_01_00_00_00").unwrap();
        let (_, third) = root.create_unique_dir("2026_01_01_00_00_00").unwrap();
        assert_eq!(first, "2026_01_01_00_00_00");
        assert_eq!(second, "2026_01_01_00_00_00_2");
        assert_eq!(third, "2026_01_01_00_00_00_3");
        assert!(root.create_unique_dir("a/b").is_err());
    }
}
