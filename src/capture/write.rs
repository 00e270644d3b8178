//! Writing a capture's trace where it is kept: a new session folder under
//! a repository root (a directory or a bucket prefix), as one XSpace file or
//! its Riegeli chunks, off the async runtime.

use std::sync::Arc;

use tracing::{info, warn};

use super::{CaptureError, Plan};
use crate::repository::{Folder, StorageError};
pub use crate::xspace::chunks::ChunkedTrace;
use crate::xspace::Encoded;

/// A trace file's content, written from the memory it is held in.
pub trait TraceFile: Send + 'static {
    /// Its size in bytes.
    fn size(&self) -> usize;
    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError>;
}

impl TraceFile for ChunkedTrace {
    fn size(&self) -> usize {
        self.bytes().len()
    }

    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError> {
        session.write(name, self.bytes())
    }
}

/// An XSpace is written from the parts it was encoded in, not joined.
impl TraceFile for Arc<Encoded> {
    fn size(&self) -> usize {
        Encoded::len(self)
    }

    fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError> {
        session.write_parts(name, self.parts())
    }
}

/// Writes a capture's trace file as [`store_trace`] does, and logs where
/// it went or why it is returned to the client instead.
pub async fn write_trace<B: TraceFile>(
    root: Folder,
    plan: &Plan,
    suffix: &'static str,
    bytes: B,
) -> Result<(Result<String, StorageError>, B), CaptureError> {
    let (written, bytes) = store_trace(root, plan, suffix, bytes).await?;
    match &written {
        Ok(path) => info!(%path, bytes = bytes.size(), "trace written"),
        // The caller refuses the capture then: nothing replaces a trace.
        Err(error) if session_taken(plan, error) => warn!(
            %error,
            session = %plan.session_id,
            "trace not written: the session holds this host's trace already"
        ),
        Err(error) => warn!(%error, "trace not written; returning it to the client instead"),
    }
    Ok((written, bytes))
}

/// Whether `error` refused a write into the client's own session because
/// it holds this host's trace already: such a capture is refused, since
/// nothing replaces a trace (a generated session moves on to a free name
/// instead, and never ends here).
pub fn session_taken(plan: &Plan, error: &StorageError) -> bool {
    error.is_taken() && !plan.generated_session_id
}

/// Writes a trace file, `<root>/<session>/<host><suffix>` (one XSpace,
/// `.xplane.pb`, or its Riegeli chunks, `.xplane.riegeli`), off the async
/// runtime (a disk write or an upload); hands the bytes back with where
/// they went or why not.
pub async fn store_trace<B: TraceFile>(
    root: Folder,
    plan: &Plan,
    suffix: &'static str,
    bytes: B,
) -> Result<(Result<String, StorageError>, B), CaptureError> {
    let session_id = plan.session_id.clone();
    let generated = plan.generated_session_id;
    let file_name = format!("{}{suffix}", plan.file_host);
    // From before the look at the root on (a stalled bucket stalls that
    // too), queued on the blocking pool included.
    let writing = crate::model::under_way::begin(format!(
        "writing {}/{session_id}/{file_name}",
        root.display()
    ));
    tokio::task::spawn_blocking(move || {
        let _writing = writing;
        clear_abandoned_once(&root);
        let written = write_in_new_session(&root, &session_id, generated, &bytes, &file_name);
        (written, bytes)
    })
    .await
    .map_err(|e| CaptureError::Write(e.to_string()))
}

/// Writes `bytes` as `file_name` in session `session_id` of `root`. A
/// generated name is taken before the write ([`Folder::create_session`]);
/// should the write still find its object there (a client writing, under
/// an id of its own, a session named like a generated one), the trace goes
/// to the next free name rather than off the bucket. A generated session
/// whose write failed otherwise is given back.
fn write_in_new_session<B: TraceFile>(
    root: &Folder,
    session_id: &str,
    generated: bool,
    bytes: &B,
    file_name: &str,
) -> Result<String, StorageError> {
    let mut attempts = 0;
    loop {
        let (session, _) = root.create_session(session_id, generated)?;
        match bytes.write_to(&session, file_name) {
            Err(error) if generated && error.is_taken() && attempts < MAX_TAKEN_RETRIES => {
                attempts += 1;
                if let Err(left) = session.remove_session_marker() {
                    warn!(%left, "could not take this capture's marker back");
                }
            }
            Err(error) if generated => {
                if let Err(left) = session.release_session() {
                    warn!(%left, "could not give back the session's name");
                }
                return Err(error);
            }
            written => return written,
        }
    }
}

/// Names found taken at the write, tried again at most.
const MAX_TAKEN_RETRIES: usize = 8;

/// Removes, the first time this process writes under `root`, the
/// unfinished trace files that writes killed in the middle left in its
/// sessions. Sessions themselves stay, empty or not: clients make them too
/// (TensorFlow's client makes its session before writing into it).
fn clear_abandoned_once(root: &Folder) {
    static CLEARED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let shown = root.display();
    {
        let mut cleared = CLEARED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Roots are the clients' to name: past this many, no more sweeps.
        if cleared.contains(&shown) || cleared.len() >= MAX_ROOTS_CLEARED {
            return;
        }
        cleared.push(shown.clone());
    }
    match root.remove_abandoned(None, &|_| true) {
        Ok(abandoned) if !abandoned.unfinished_files.is_empty() => info!(
            root = %shown,
            files = ?abandoned.unfinished_files,
            "removed unfinished trace files that an agent stopped while writing left here"
        ),
        // A root not made yet holds nothing unfinished.
        Ok(_) | Err(StorageError::NotFound { .. }) => {}
        Err(error) => warn!(root = %shown, %error, "could not look for unfinished trace files"),
    }
}

/// Repository roots swept once each, at most.
const MAX_ROOTS_CLEARED: usize = 1024;

/// `encoded` as Riegeli chunks of at most `limit` bytes, off the async
/// runtime.
pub async fn chunk_trace(
    encoded: Arc<Encoded>,
    limit: usize,
) -> Result<ChunkedTrace, CaptureError> {
    tokio::task::spawn_blocking(move || ChunkedTrace::encode(&encoded.contiguous(), limit))
        .await
        .map_err(|e| CaptureError::Chunk(e.to_string()))?
        .map_err(|e| CaptureError::Chunk(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::Window;
    use crate::repository::beneath::Dir;

    fn plan(session_id: &str, generated: bool) -> Plan {
        let window = Window {
            start_ns: 1,
            stop_ns: 2,
        };
        let mut plan = Plan::save(window, session_id, "host-a", Vec::new(), Vec::new());
        plan.generated_session_id = generated;
        plan
    }

    fn trace(byte: u8) -> Arc<Encoded> {
        Arc::new(Encoded::whole(vec![byte; 8], 1))
    }

    #[tokio::test]
    async fn a_trace_becomes_host_file_in_a_new_session_folder() {
        let root = tempfile::tempdir().unwrap();
        let folder = Folder::local(Dir::open(root.path()).unwrap());
        let (written, back) = store_trace(folder, &plan("s1", false), ".xplane.pb", trace(7))
            .await
            .unwrap();
        let path = written.unwrap();
        assert!(path.ends_with("s1/host-a.xplane.pb"), "{path}");
        assert_eq!(back.size(), 8);
        let on_disk = std::fs::read(root.path().join("s1/host-a.xplane.pb")).unwrap();
        assert_eq!(on_disk, vec![7; 8]);
    }

    #[tokio::test]
    async fn the_first_write_under_a_root_clears_unfinished_files_left_there() {
        let root = tempfile::tempdir().unwrap();
        let session = root.path().join("earlier");
        std::fs::create_dir(&session).unwrap();
        let unfinished = session.join(".host-a.xplane.pb.4242.0.tmp");
        std::fs::File::create(&unfinished)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
            .unwrap();
        let folder = Folder::local(Dir::open(root.path()).unwrap());
        let (written, _) = store_trace(folder, &plan("s1", false), ".xplane.pb", trace(7))
            .await
            .unwrap();
        written.unwrap();
        assert!(!unfinished.exists());
        // The session stays: clients make sessions too.
        assert!(session.is_dir());
    }

    /// A trace whose first write finds its object there already, as a
    /// bucket answers the second of two captures that chose one name.
    struct TakenOnce {
        tries: std::sync::Mutex<Vec<String>>,
    }

    impl TraceFile for TakenOnce {
        fn size(&self) -> usize {
            1
        }

        fn write_to(&self, session: &Folder, name: &str) -> Result<String, StorageError> {
            let mut tries = self.tries.lock().unwrap();
            tries.push(session.display());
            if tries.len() == 1 {
                return Err(StorageError::Object {
                    path: format!("{}/{name}", session.display()),
                    reason: object_store::Error::AlreadyExists {
                        path: name.to_string(),
                        source: "taken".into(),
                    },
                });
            }
            session.write(name, b"x")
        }
    }

    #[tokio::test]
    async fn a_generated_name_taken_at_the_write_goes_to_the_next_name() {
        let root = tempfile::tempdir().unwrap();
        let folder = Folder::local(Dir::open(root.path()).unwrap());
        let trace = TakenOnce {
            tries: std::sync::Mutex::new(Vec::new()),
        };
        let (written, trace) = store_trace(
            folder.clone(),
            &plan("2026_01_01", true),
            ".xplane.pb",
            trace,
        )
        .await
        .unwrap();
        let path = written.unwrap();
        assert!(path.ends_with("2026_01_01_2/host-a.xplane.pb"), "{path}");
        assert_eq!(trace.tries.lock().unwrap().len(), 2);
        // A client's own session name is the client's: not renamed.
        let trace = TakenOnce {
            tries: std::sync::Mutex::new(Vec::new()),
        };
        let (written, _) = store_trace(folder, &plan("mine", false), ".xplane.pb", trace)
            .await
            .unwrap();
        assert!(written.is_err());
    }

    #[tokio::test]
    async fn generated_session_names_never_replace_an_earlier_trace() {
        let root = tempfile::tempdir().unwrap();
        let folder = Folder::local(Dir::open(root.path()).unwrap());
        for byte in [1, 2] {
            let (written, _) = store_trace(
                folder.clone(),
                &plan("2026_01_01", true),
                ".xplane.pb",
                trace(byte),
            )
            .await
            .unwrap();
            written.unwrap();
        }
        let mut sessions: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        sessions.sort();
        assert_eq!(sessions.len(), 2, "{sessions:?}");
        assert_eq!(sessions[0], "2026_01_01");
        let first = std::fs::read(root.path().join("2026_01_01/host-a.xplane.pb")).unwrap();
        assert_eq!(first, vec![1; 8]);
    }
}
