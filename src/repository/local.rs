//! A directory as a folder: a path beneath an open root directory, resolved
//! beneath it at every use without following links ([`crate::repository::beneath`]).

use std::path::PathBuf;
use std::sync::Arc;

use crate::repository::beneath::{Dir, EntryKind};

use super::{Listed, StorageError};

#[derive(Clone, Debug)]
pub struct LocalFolder {
    root: Arc<Dir>,
    /// Beneath the root: plain names only.
    relative: PathBuf,
    /// Writes fail rather than replace a file (see [`LocalFolder::create_only`]).
    create_only: bool,
}

impl LocalFolder {
    /// The root directory itself.
    pub fn new(root: Arc<Dir>) -> LocalFolder {
        LocalFolder::beneath(root, PathBuf::new())
    }

    /// `relative` beneath `root` (plain names; the resolution refuses the rest).
    pub fn beneath(root: Arc<Dir>, relative: PathBuf) -> LocalFolder {
        LocalFolder {
            root,
            relative,
            create_only: false,
        }
    }

    /// The same folder, whose writes fail (`AlreadyExists`) rather than
    /// replace a file.
    pub fn create_only(mut self) -> LocalFolder {
        self.create_only = true;
        self
    }

    /// The same folder, touched with `credentials`' rights.
    pub fn acting_as(
        &self,
        credentials: Option<Arc<crate::repository::acting::Credentials>>,
    ) -> Result<LocalFolder, StorageError> {
        Ok(LocalFolder {
            root: Arc::new(self.root.acting_as(credentials)?),
            relative: self.relative.clone(),
            create_only: self.create_only,
        })
    }

    /// The same folder, making nothing with the permission bits `bits`.
    pub fn withholding(&self, bits: u32) -> Result<LocalFolder, StorageError> {
        Ok(LocalFolder {
            root: Arc::new(self.root.withholding(bits)?),
            relative: self.relative.clone(),
            create_only: self.create_only,
        })
    }

    pub fn join(&self, name: &str) -> LocalFolder {
        LocalFolder {
            root: Arc::clone(&self.root),
            relative: self.relative.join(name),
            create_only: self.create_only,
        }
    }

    pub fn path(&self) -> PathBuf {
        self.root.path().join(&self.relative)
    }

    fn open(&self) -> Result<Dir, StorageError> {
        Ok(self.root.open_dir(&self.relative)?)
    }

    pub fn exists(&self) -> Result<bool, StorageError> {
        match self.open() {
            Ok(_) => Ok(true),
            Err(StorageError::NotFound { .. }) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Directories in this one; links are not directories here.
    pub fn subfolders(&self) -> Result<Vec<Listed>, StorageError> {
        Ok(self
            .open()?
            .entries()?
            .into_iter()
            .filter(|entry| entry.kind == EntryKind::Directory)
            .filter_map(|entry| {
                Some(Listed {
                    name: entry.name.into_string().ok()?,
                    modified: entry.modified,
                })
            })
            .collect())
    }

    /// Everything in this directory that is not a directory: a link or FIFO
    /// named like a trace counts, so that asking for it is refused by name.
    pub fn files(&self) -> Result<Vec<Listed>, StorageError> {
        Ok(self
            .open()?
            .entries()?
            .into_iter()
            .filter(|entry| entry.kind != EntryKind::Directory)
            .filter_map(|entry| {
                Some(Listed {
                    name: entry.name.into_string().ok()?,
                    modified: entry.modified,
                })
            })
            .collect())
    }

    pub fn read(&self, name: &str) -> Result<Vec<u8>, StorageError> {
        Ok(self.root.read(&self.relative.join(name))?)
    }

    pub fn read_at_most(&self, name: &str, limit: u64) -> Result<Vec<u8>, StorageError> {
        Ok(self.root.read_at_most(&self.relative.join(name), limit)?)
    }

    pub fn size(&self, name: &str) -> Result<u64, StorageError> {
        let path = self.relative.join(name);
        let file = self.root.open_file(&path)?;
        let meta = file.metadata().map_err(|source| {
            StorageError::from(crate::repository::beneath::BeneathError::Io {
                path: path.display().to_string(),
                source,
            })
        })?;
        Ok(meta.len())
    }

    /// Writes atomically (a temporary file, then rename), making the
    /// directory first. Says where it went.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<String, StorageError> {
        let mut file = self.create_atomic(name)?;
        file.write_all(bytes)?;
        Ok(file.commit()?.display().to_string())
    }

    /// Writes as [`LocalFolder::write`] does, the content given in parts.
    pub fn write_parts(&self, name: &str, parts: &[bytes::Bytes]) -> Result<String, StorageError> {
        let mut file = self.create_atomic(name)?;
        for part in parts {
            file.write_all(part)?;
        }
        Ok(file.commit()?.display().to_string())
    }

    /// Starts `name` in this directory (made first), written in parts and
    /// renamed into place on commit.
    pub fn create_atomic(
        &self,
        name: &str,
    ) -> Result<crate::repository::beneath::AtomicFile, StorageError> {
        let directory = self.root.create_dir_all(&self.relative)?;
        let file = directory.create_atomic(name)?;
        Ok(if self.create_only {
            file.keeping_existing()
        } else {
            file
        })
    }

    /// Makes a new directory named `base`, or `base_2`, `base_3`, ... when
    /// taken; returns it and its name.
    pub fn create_unique(&self, base: &str) -> Result<(LocalFolder, String), StorageError> {
        let (_, name) = self
            .root
            .create_dir_all(&self.relative)?
            .create_unique_dir(base)?;
        Ok((self.join(&name), name))
    }

    /// See [`super::Folder::remove_abandoned`].
    pub fn remove_abandoned(
        &self,
        grace: std::time::Duration,
        empty_sessions: Option<std::time::Duration>,
        leave: &dyn Fn(&str) -> bool,
    ) -> Result<super::Abandoned, StorageError> {
        let root = self.open()?;
        let mut removed = super::Abandoned::default();
        // Ages before the sweep: removing a file makes its directory new.
        let sessions: Vec<(String, bool)> = root
            .entries()?
            .into_iter()
            .filter(|entry| entry.kind == EntryKind::Directory)
            .filter_map(|entry| {
                let old = empty_sessions.is_some_and(|empty_grace| {
                    entry.modified.elapsed().is_ok_and(|age| age > empty_grace)
                });
                Some((entry.name.into_string().ok()?, old))
            })
            .collect();
        for (session, old) in sessions {
            let Ok(directory) = root.open_dir(std::path::Path::new(&session)) else {
                continue;
            };
            for file in directory.remove_abandoned_temporaries(grace)? {
                removed.unfinished_files.push(format!("{session}/{file}"));
            }
            if old && !leave(&session) && root.remove_empty_dir(&session) {
                removed.empty_sessions.push(session);
            }
        }
        Ok(removed)
    }

    /// Removes this directory if it holds nothing; whether it did.
    pub fn remove_if_empty(&self) -> bool {
        let (Some(parent), Some(name)) = (self.relative.parent(), self.relative.file_name()) else {
            return false;
        };
        let Some(name) = name.to_str() else {
            return false;
        };
        self.root
            .open_dir(parent)
            .is_ok_and(|parent| parent.remove_empty_dir(name))
    }

    /// Makes this directory and what is missing above it.
    pub fn create(&self) -> Result<(), StorageError> {
        self.root.create_dir_all(&self.relative)?;
        Ok(())
    }
}
