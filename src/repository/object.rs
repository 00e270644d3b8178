//! A key prefix in a bucket as a folder, through the `object_store` crate.
//!
//! Credentials and endpoints come from the provider's standard environment
//! and instance chains (`AmazonS3Builder::from_env`,
//! `GoogleCloudStorageBuilder::from_env`: `AWS_ACCESS_KEY_ID`,
//! `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, instance roles;
//! `GOOGLE_APPLICATION_CREDENTIALS`, `GOOGLE_SERVICE_ACCOUNT`, the metadata
//! server). Its calls are async; the folder's blocking methods run them on
//! one small runtime of their own, so that every caller (a CLI command, a
//! blocking task of the agent) uses the same methods for local and object
//! folders.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig};
use tokio_stream::StreamExt;

use super::url::{ObjectUrl, Provider};
use super::{Listed, StorageError, MAX_READ_BYTES};

/// Retries of one request: a few, within a bound that keeps a session's
/// answer in time (the crate's default retries for three minutes).
const MAX_RETRIES: usize = 3;
const RETRY_TIMEOUT: Duration = Duration::from_secs(20);

/// A prefix in a connected bucket.
#[derive(Clone, Debug)]
pub struct ObjectFolder {
    store: Arc<dyn ObjectStore>,
    url: ObjectUrl,
    /// Writes fail rather than replace an object (a session whose name was
    /// generated, so that two captures never overwrite each other).
    create_only: bool,
}

impl ObjectFolder {
    /// Connects to `url`'s bucket with the credentials of the environment.
    /// Nothing is sent yet: a missing bucket or refused credentials show at
    /// the first call.
    pub fn connect(url: &ObjectUrl) -> Result<ObjectFolder, StorageError> {
        // reqwest takes the process's TLS provider; ring is the one built.
        // Installed already (an earlier bucket) is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let retry = RetryConfig {
            max_retries: MAX_RETRIES,
            retry_timeout: RETRY_TIMEOUT,
            ..RetryConfig::default()
        };
        let built: object_store::Result<Arc<dyn ObjectStore>> = match url.provider {
            Provider::S3 => AmazonS3Builder::from_env()
                .with_bucket_name(&url.bucket)
                .with_retry(retry)
                .build()
                .map(|s| Arc::new(s) as _),
            Provider::Gcs => GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(&url.bucket)
                .with_retry(retry)
                .build()
                .map(|s| Arc::new(s) as _),
        };
        let store = built.map_err(|source| StorageError::Object {
            path: url.to_string(),
            reason: source,
        })?;
        Ok(ObjectFolder {
            store,
            url: url.clone(),
            create_only: false,
        })
    }

    pub fn url(&self) -> &ObjectUrl {
        &self.url
    }

    pub fn join(&self, name: &str) -> ObjectFolder {
        ObjectFolder {
            store: Arc::clone(&self.store),
            url: self.url.join(name),
            create_only: self.create_only,
        }
    }

    /// The same folder, whose writes never replace an object.
    pub fn create_only(mut self) -> ObjectFolder {
        self.create_only = true;
        self
    }

    fn key(&self) -> Key {
        Key::from_iter(self.url.segments.iter().map(String::as_str))
    }

    fn error(&self, name: Option<&str>, source: object_store::Error) -> StorageError {
        let path = match name {
            Some(name) => self.url.join(name).to_string(),
            None => self.url.to_string(),
        };
        match source {
            object_store::Error::NotFound { .. } => StorageError::NotFound { path },
            reason => StorageError::Object { path, reason },
        }
    }

    /// Whether any object lies under this prefix.
    pub fn exists(&self) -> Result<bool, StorageError> {
        let key = self.key();
        let first = block_on(async { self.store.list(Some(&key)).next().await })?;
        match first {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(source)) => Err(self.error(None, source)),
        }
    }

    /// The names one level down that hold objects further down, each with
    /// the newest modification time beneath it.
    pub fn subfolders(&self) -> Result<Vec<Listed>, StorageError> {
        let key = self.key();
        let listed = block_on(async {
            let mut newest: Vec<Listed> = Vec::new();
            let mut objects = self.store.list(Some(&key));
            while let Some(meta) = objects.next().await {
                let meta = meta?;
                let Some(mut parts) = meta.location.prefix_match(&key) else {
                    continue;
                };
                let (Some(first), Some(_)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let modified = SystemTime::from(meta.last_modified);
                match newest.iter_mut().find(|s| s.name == first.as_ref()) {
                    Some(known) => known.modified = known.modified.max(modified),
                    None => newest.push(Listed {
                        name: first.as_ref().to_string(),
                        modified,
                    }),
                }
            }
            Ok(newest)
        })?;
        listed.map_err(|source| self.error(None, source))
    }

    /// Removes `marker` from each folder one level down that holds nothing
    /// else and was written more than `grace` ago, unless `leave` says to
    /// leave it; the names of those folders.
    pub fn remove_lone_markers(
        &self,
        marker: &str,
        grace: std::time::Duration,
        leave: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>, StorageError> {
        let key = self.key();
        // Per folder: whether all it holds is an old marker.
        let listed = block_on(async {
            let mut folders: Vec<(String, bool)> = Vec::new();
            let mut objects = self.store.list(Some(&key));
            while let Some(meta) = objects.next().await {
                let meta = meta?;
                let Some(parts) = meta.location.prefix_match(&key) else {
                    continue;
                };
                let parts: Vec<_> = parts.collect();
                let [folder, rest @ ..] = parts.as_slice() else {
                    continue;
                };
                let old = SystemTime::from(meta.last_modified)
                    .elapsed()
                    .is_ok_and(|age| age > grace);
                let lone_old_marker = old && rest.len() == 1 && rest[0].as_ref() == marker;
                match folders.iter_mut().find(|(name, _)| name == folder.as_ref()) {
                    Some((_, lone)) => *lone = false,
                    None => folders.push((folder.as_ref().to_string(), lone_old_marker)),
                }
            }
            Ok(folders)
        })?;
        let folders = listed.map_err(|source| self.error(None, source))?;
        let mut removed = Vec::new();
        for (folder, lone) in folders {
            if lone && !leave(&folder) {
                self.join(&folder).remove(marker)?;
                removed.push(folder);
            }
        }
        Ok(removed)
    }

    /// The objects directly under this prefix, with when each was written.
    pub fn files(&self) -> Result<Vec<Listed>, StorageError> {
        let key = self.key();
        let listed = block_on(self.store.list_with_delimiter(Some(&key)))?
            .map_err(|source| self.error(None, source))?;
        Ok(listed
            .objects
            .iter()
            .filter_map(|meta| {
                Some(Listed {
                    name: meta.location.filename()?.to_string(),
                    modified: SystemTime::from(meta.last_modified),
                })
            })
            .collect())
    }

    pub fn size(&self, name: &str) -> Result<u64, StorageError> {
        let key = self.key().join(name);
        block_on(self.store.head(&key))?
            .map(|meta| meta.size)
            .map_err(|source| self.error(Some(name), source))
    }

    pub fn read(&self, name: &str) -> Result<Vec<u8>, StorageError> {
        self.read_at_most(name, MAX_READ_BYTES)
    }

    /// As [`ObjectFolder::read`], refused beyond `limit` bytes (at most
    /// [`MAX_READ_BYTES`]), known from the object's size before its body
    /// is read.
    pub fn read_at_most(&self, name: &str, limit: u64) -> Result<Vec<u8>, StorageError> {
        let limit = limit.min(MAX_READ_BYTES);
        let key = self.key().join(name);
        let read = block_on(async {
            let object = self.store.get(&key).await?;
            if object.meta.size > limit {
                return Ok(Err(object.meta.size));
            }
            object.bytes().await.map(Ok)
        })?
        .map_err(|source| self.error(Some(name), source))?;
        match read {
            Ok(bytes) if bytes.len() as u64 <= limit => Ok(Vec::from(bytes)),
            _ => Err(StorageError::TooLarge {
                path: self.url.join(name).to_string(),
                limit,
            }),
        }
    }

    /// Uploads `bytes` as `name`; an object is only whole or absent. Says
    /// where it went.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<String, StorageError> {
        self.put(name, PutPayload::from(Bytes::copy_from_slice(bytes)))
    }

    /// Writes `payload` (one buffer or several) as [`ObjectFolder::write`].
    pub fn put(&self, name: &str, payload: PutPayload) -> Result<String, StorageError> {
        let key = self.key().join(name);
        let mode = if self.create_only {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let options = PutOptions {
            mode,
            ..PutOptions::default()
        };
        let put = block_on(async {
            match self.store.put_opts(&key, payload.clone(), options).await {
                // A store configured without conditional writes
                // (AWS_CONDITIONAL_PUT=disabled) cannot refuse to replace;
                // the session's name was checked free when it was chosen.
                Err(object_store::Error::NotImplemented { .. }) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(
                            bucket = %self.url,
                            "this store takes no conditional writes (AWS_CONDITIONAL_PUT=disabled?): \
                             a capture's objects may replace others', and two captures of one \
                             second may share a session"
                        )
                    });
                    self.store.put(&key, payload).await
                }
                other => other,
            }
        })?;
        // Not "does not exist": a missing bucket answers a write that way.
        put.map_err(|reason| StorageError::Object {
            path: self.url.join(name).to_string(),
            reason,
        })?;
        Ok(self.url.join(name).to_string())
    }

    /// Deletes object `name`; one already gone is no error.
    pub fn remove(&self, name: &str) -> Result<(), StorageError> {
        let key = self.key().join(name);
        match block_on(self.store.delete(&key))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(self.error(Some(name), source)),
        }
    }
}

/// The runtime object-store calls run on, started at the first call.
static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// Runs `future` to completion on the object-store runtime. Must not be
/// called from async code (use `spawn_blocking` there).
fn block_on<F: Future>(future: F) -> Result<F::Output, StorageError> {
    if RUNTIME.get().is_none() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("devtrace-storage")
            .enable_all()
            .build()
            .map_err(|source| StorageError::Io {
                path: "the object-storage runtime".into(),
                source,
            })?;
        // Another thread may have won the race; its runtime is as good.
        let _ = RUNTIME.set(runtime);
    }
    match RUNTIME.get() {
        Some(runtime) => Ok(runtime.block_on(future)),
        None => Err(StorageError::Io {
            path: "the object-storage runtime".into(),
            source: std::io::Error::other("not started"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of `s3://b/repo` over a store in memory.
    fn in_memory() -> ObjectFolder {
        let url = ObjectUrl::parse("s3://b/repo")
            .ok()
            .flatten()
            .expect("an object URL");
        ObjectFolder {
            store: Arc::new(object_store::memory::InMemory::new()),
            url,
            create_only: false,
        }
    }

    #[test]
    fn only_sessions_holding_nothing_but_an_old_marker_lose_it() {
        let repo = in_memory();
        let marker = ".devtrace-session";
        for session in ["lone", "filled", "in-use", "young"] {
            repo.join(session).write(marker, b"").unwrap();
        }
        repo.join("filled").write("h.xplane.pb", b"trace").unwrap();
        repo.join("deeper").join("x").write(marker, b"").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        repo.join("young").write(marker, b"again").unwrap();

        let removed = repo
            .remove_lone_markers(marker, Duration::from_millis(10), &|name| name == "in-use")
            .unwrap();
        assert_eq!(removed, ["lone"]);
        assert!(!repo.join("lone").exists().unwrap());
        for kept in ["filled", "in-use", "young", "deeper"] {
            assert!(repo.join(kept).exists().unwrap(), "{kept}");
        }
    }
}
