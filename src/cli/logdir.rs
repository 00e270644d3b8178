//! Logdirs named on the command line, on local disk or in object storage
//! (`s3://bucket/prefix`, `gs://bucket/prefix`): where `capture` and
//! `session new` write a session's files, and where `sessions` and `tool`
//! find a repository root.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::repository::{self, Folder, Location};

/// `--logdir` as given: an object URL, or a local path made absolute.
pub fn parse(logdir: &Path) -> anyhow::Result<Location> {
    match Location::parse(logdir)? {
        Location::Local(path) => {
            let absolute = std::path::absolute(&path)
                .with_context(|| format!("resolving --logdir {}", path.display()))?;
            Ok(Location::Local(absolute))
        }
        object => Ok(object),
    }
}

/// A logdir's repository root: its `plugins/profile` when that exists,
/// else the directory or prefix itself.
pub fn repository_root(dir: &Path) -> anyhow::Result<Folder> {
    match Location::parse(dir)? {
        Location::Local(path) => {
            let nested = path.join("plugins").join("profile");
            let root = if nested.is_dir() { nested } else { path };
            Ok(Folder::open(&Location::Local(root))?)
        }
        object => {
            let logdir = Folder::open(&object)?;
            let nested = logdir.join("plugins").join("profile");
            Ok(if nested.exists()? { nested } else { logdir })
        }
    }
}

/// Where the files of one session go.
pub enum SessionOutput {
    Local(PathBuf),
    Object(Folder),
}

impl SessionOutput {
    pub fn new(session: &Location) -> anyhow::Result<SessionOutput> {
        Ok(match session {
            Location::Local(path) => SessionOutput::Local(path.clone()),
            object => SessionOutput::Object(Folder::open(object)?),
        })
    }

    /// Writes one file of session `session_id` (blocking) and says where
    /// it went. An upload that fails keeps the file in the temporary
    /// directory, and the error says where.
    pub fn write(&self, session_id: &str, name: &str, data: &[u8]) -> Result<String, String> {
        match self {
            SessionOutput::Local(directory) => super::write_file(directory, name, data)
                .map(|path| path.display().to_string())
                .map_err(|e| format!("{e:#}")),
            SessionOutput::Object(folder) => {
                repository::write_or_keep(folder, session_id, name, data, &std::env::temp_dir())
            }
        }
    }
}
