//! Logdirs named on the command line, on local disk or in object storage
//! (`s3://bucket/prefix`, `gs://bucket/prefix`): where `capture` and
//! `session new` write a session's files, and where `sessions` and `tool`
//! find a repository root.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::repository::{self, Folder, Location};

/// `--logdir` as given: an object URL, or a local path made absolute. One
/// inside a logdir's `plugins/profile` (that directory, or a session in it)
/// is refused, naming the logdir to give: its sessions would land a level
/// too deep, where neither XProf nor `devtrace sessions` looks.
pub fn parse(logdir: &Path) -> anyhow::Result<Location> {
    let location = match Location::parse(logdir)? {
        Location::Local(path) => {
            let absolute = std::path::absolute(&path)
                .with_context(|| format!("resolving --logdir {}", path.display()))?;
            Location::Local(absolute)
        }
        object => object,
    };
    if let Some(enclosing) = enclosing_logdir(&location) {
        return Err(super::UsageError(format!(
            "--logdir {location} lies inside the logdir {enclosing}'s plugins/profile: the \
             session would be written to {location}/plugins/profile/SESSION, where XProf and \
             `devtrace sessions` do not look; give --logdir {enclosing}"
        ))
        .into());
    }
    Ok(location)
}

/// The names `location` is made of: its path read component by component
/// (`..` taken back, as the path resolves when no link is in it), or a
/// URL's segments after its bucket.
fn named_parts(location: &Location) -> Vec<String> {
    match location {
        Location::Local(path) => {
            use std::path::Component;
            let mut parts = Vec::new();
            for component in path.components() {
                match component {
                    Component::Normal(name) => parts.push(name.to_string_lossy().into_owned()),
                    Component::ParentDir => {
                        parts.pop();
                    }
                    Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
                }
            }
            parts
        }
        Location::Object(url) => url.segments.clone(),
    }
}

/// Where `plugins/profile` begins in `parts`, if it is in them.
fn plugins_profile_at(parts: &[String]) -> Option<usize> {
    parts
        .windows(2)
        .position(|pair| pair[0] == "plugins" && pair[1] == "profile")
}

/// The logdir whose `plugins/profile` `location` is or lies in.
fn enclosing_logdir(location: &Location) -> Option<String> {
    let parts = named_parts(location);
    let at = plugins_profile_at(&parts)?;
    match location {
        Location::Local(_) => {
            let enclosing: PathBuf = std::iter::once("/")
                .chain(parts[..at].iter().map(String::as_str))
                .collect();
            Some(enclosing.display().to_string())
        }
        Location::Object(url) => {
            let mut enclosing = url.clone();
            enclosing.segments.truncate(at);
            Some(enclosing.to_string())
        }
    }
}

/// Whether `location` is a logdir's `plugins/profile` itself, where a
/// repository of sessions that XProf and `devtrace sessions` list belongs.
pub fn is_plugins_profile(location: &Location) -> bool {
    let parts = named_parts(location);
    plugins_profile_at(&parts).is_some_and(|at| at + 2 == parts.len())
}

/// The logdir of `folder` when it is a session directory holding traces
/// (`LOGDIR/plugins/profile/SESSION`), given where a logdir was expected.
pub fn logdir_of_session(folder: &Folder) -> Option<PathBuf> {
    let Folder::Local(local) = folder else {
        return None;
    };
    let path = local.path();
    let profile = path.parent()?;
    let plugins = profile.parent()?;
    let named = profile.file_name()? == "profile" && plugins.file_name()? == "plugins";
    (named && crate::fleet::holds_traces(folder))
        .then(|| plugins.parent().map(Path::to_path_buf))?
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

/// Removes the directories `made` for a session (deepest first) while
/// nothing else is in them: the first one that holds something stops it.
pub fn remove_made_directories(made: &[PathBuf]) {
    for dir in made {
        if std::fs::remove_dir(dir).is_err() {
            return;
        }
    }
}

/// `--session-id`: one file-name component, as the agent requires of it.
pub fn parse_session_id(text: &str) -> Result<String, String> {
    if text.is_empty() || text == "." {
        return Err("a session id names a directory: it cannot be empty or \".\"".into());
    }
    crate::service::validate::name_component("--session-id", text)
        .map_err(|status| status.message().to_string())?;
    Ok(text.to_string())
}

/// How long a capture given up waits to give its session's name back.
const RELEASE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where the files of one session go.
pub enum SessionOutput {
    Local {
        directory: PathBuf,
        /// The directories made for it (itself, unless it was there
        /// already, and those above it), deepest first.
        made: Vec<PathBuf>,
    },
    Object {
        folder: Folder,
        /// Its generated name was taken here (see
        /// [`Folder::create_session`]), to be given back if nothing is
        /// written.
        reserved: bool,
    },
}

impl SessionOutput {
    /// The session `session_id` under repository root `root`, made now, so
    /// that a logdir that cannot be written to is found before a capture
    /// rather than after it; with the session's final name. Without an
    /// id, the session is named after the current second, with `_2`, `_3`,
    /// ... when a session of that name exists, so that captures of one
    /// second never replace each other; a given id is used as is.
    pub fn create(
        root: &Location,
        session_id: Option<&str>,
    ) -> anyhow::Result<(SessionOutput, String)> {
        let generated = session_id.is_none();
        let base =
            session_id.map_or_else(crate::model::calendar::session_timestamp, str::to_string);
        // What this capture makes, to take back if it fails: the session
        // (unless a given one was there already) and the missing
        // directories above it.
        let (mut session_there, mut made_above) = (false, Vec::new());
        if let Location::Local(path) = root {
            session_there = !generated && path.join(&base).exists();
            made_above = path
                .ancestors()
                .take_while(|dir| !dir.exists())
                .map(Path::to_path_buf)
                .collect();
            std::fs::create_dir_all(path)
                .with_context(|| format!("cannot make {} under --logdir", path.display()))?;
        }
        let created = Folder::open(root).and_then(|root| root.create_session(&base, generated));
        let reserved = generated && created.is_ok();
        let (folder, name) = match (created, root) {
            (Ok(created), _) => created,
            (Err(error), Location::Local(_)) => {
                return Err(anyhow::Error::new(error)
                    .context(format!("cannot make session {base} in {root}")))
            }
            // A bucket that cannot be asked now (down, a missing bucket)
            // may take the trace later, and if not, the trace is kept
            // locally: the capture goes on.
            (Err(error), Location::Object(_)) => {
                eprintln!(
                    "devtrace: cannot look into {root} before capturing ({error}); the trace \
                     is kept locally if its upload fails"
                );
                (Folder::open(&root.join(&base))?, base)
            }
        };
        let output = match root {
            Location::Local(path) => {
                let directory = path.join(&name);
                let made = (!session_there)
                    .then(|| directory.clone())
                    .into_iter()
                    .chain(made_above)
                    .collect();
                SessionOutput::Local { directory, made }
            }
            // No upload replaces a trace the session held.
            Location::Object(_) => SessionOutput::Object {
                folder: folder.create_only(),
                reserved,
            },
        };
        Ok((output, name))
    }

    /// The trace files the session holds already of `hosts` (host parts of
    /// file names), which no trace may be written over
    /// ([`crate::fleet::held_traces`]): one listing, for a bucket too.
    /// Blocks: not for async code.
    pub fn held_traces(&self, hosts: &[String]) -> Vec<String> {
        let folder = match self {
            SessionOutput::Local { directory, .. } => {
                Folder::open(&Location::Local(directory.clone()))
            }
            SessionOutput::Object { folder, .. } => Ok(folder.clone()),
        };
        folder.map_or_else(
            |_| Vec::new(),
            |folder| crate::fleet::held_traces(&folder, hosts),
        )
    }

    /// The local directories made for the session (deepest first, see
    /// [`remove_made_directories`]); none in
    /// a bucket.
    pub fn made_directories(&self) -> &[PathBuf] {
        match self {
            SessionOutput::Local { made, .. } => made,
            SessionOutput::Object { .. } => &[],
        }
    }

    /// Removes the directories made for the session again (its own, unless
    /// it was there before, and those above it), if nothing was written into
    /// them (the capture they were made for failed, or wrote elsewhere); in
    /// a bucket, gives a generated session's name back.
    pub fn abandon(&self) {
        match self {
            SessionOutput::Local { made, .. } => remove_made_directories(made),
            SessionOutput::Object { folder, reserved } => {
                if !reserved {
                    return;
                }
                // On a thread of its own: this is called from async code
                // too, whose runtime's threads may not block on the
                // storage runtime's calls; and not waited for long, since
                // the bucket may be why the capture is given up.
                let folder = folder.clone();
                let (done, released) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let _ = done.send(folder.release_session());
                });
                match released.recv_timeout(RELEASE_LIMIT) {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => {
                        eprintln!("devtrace: could not give back the session's name: {error}")
                    }
                    Err(_) => eprintln!(
                        "devtrace: gave up giving back the session's name after {} s: its \
                         marker stays",
                        RELEASE_LIMIT.as_secs()
                    ),
                }
            }
        }
    }

    /// Writes one file of session `session_id` (blocking) and says where
    /// it went. A write or upload that fails keeps the file in the
    /// temporary directory, and the error says where.
    pub fn write(&self, session_id: &str, name: &str, data: &[u8]) -> Result<String, String> {
        match self {
            SessionOutput::Local { directory, .. } => {
                super::write_file(directory, name, data, false)
                    .map(|path| path.display().to_string())
                    .map_err(|error| {
                        let attempt = format!("writing {}", directory.join(name).display());
                        if super::cut_off() {
                            // The command is ending, keeping the trace itself.
                            return format!("{attempt} was cut off");
                        }
                        // The attempt is named once, not again as the
                        // cause's first words.
                        let cause = super::failure_text(&error);
                        let cause = cause
                            .strip_prefix(&format!("{attempt}: "))
                            .unwrap_or(&cause);
                        repository::keep_failed_write(
                            &attempt,
                            &cause,
                            &std::env::temp_dir(),
                            session_id,
                            name,
                            data,
                        )
                    })
            }
            SessionOutput::Object { folder, .. } => {
                repository::write_or_keep(folder, session_id, name, data, &std::env::temp_dir())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a path or URL ending in a logdir's plugins/profile is one, read
    /// as it resolves.
    #[test]
    fn a_plugins_profile_is_told_by_its_last_two_names() {
        let is =
            |text: &str| is_plugins_profile(&Location::parse(Path::new(text)).expect("a location"));
        for yes in [
            "/runs/a/plugins/profile",
            "/runs/a/plugins/profile/",
            "/runs/a/plugins/./profile",
            "/runs/a/plugins/profile/s/..",
            "s3://b/logs/plugins/profile/",
            "plugins/profile",
        ] {
            assert!(is(yes), "{yes}");
        }
        for no in [
            "/runs/a",
            "/runs/a/plugins/profile/s",
            "/runs/a/plugins/profiles",
            "/runs/a/plugins/profile/..",
            "s3://plugins/profile",
            "s3://b/plugins",
        ] {
            assert!(!is(no), "{no}");
        }
    }

    /// A logdir's plugins/profile, or a session in it, given as --logdir
    /// names the logdir meant; other paths, and buckets that happen to be
    /// named plugins, are taken as they are.
    #[test]
    fn a_logdir_inside_another_names_the_one_meant() {
        let enclosing = |text: &str| {
            let location = Location::parse(Path::new(text)).expect("a location");
            enclosing_logdir(&location)
        };
        let meant = |text: &str| enclosing(text).unwrap_or_else(|| panic!("{text} taken"));
        assert_eq!(meant("/runs/a/plugins/profile"), "/runs/a");
        assert_eq!(
            meant("/runs/a/plugins/profile/2026_01_01_00_00_00"),
            "/runs/a"
        );
        assert_eq!(meant("/runs/a/plugins/./profile/s/"), "/runs/a");
        assert_eq!(meant("/runs/x/../a/plugins/profile"), "/runs/a");
        assert_eq!(meant("s3://b/logs/plugins/profile/"), "s3://b/logs");
        assert_eq!(meant("/plugins/profile"), "/");
        for taken in [
            "/runs/a",
            "/runs/plugins/profiles",
            "/runs/my_plugins/profile",
            "/runs/plugins",
            "/runs/a/plugins/profile/../..",
            "s3://plugins/profile",
            "gs://plugins/profile/runs",
        ] {
            assert_eq!(enclosing(taken), None, "{taken}");
        }
        let refused = parse(Path::new("/tmp/logs/plugins/profile/mine")).unwrap_err();
        assert!(refused.downcast_ref::<super::super::UsageError>().is_some());
        let said = refused.to_string();
        assert!(said.contains("give --logdir /tmp/logs"), "{said}");
        assert!(parse(Path::new("/tmp/logs")).is_ok());
    }

    #[test]
    fn a_session_id_is_one_plain_name() {
        for bad in ["", ".", "..", "a/b", "x\ny", "tab\t"] {
            assert!(parse_session_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_session_id("run_1").as_deref(), Ok("run_1"));
    }

    #[test]
    fn sessions_without_an_id_never_share_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = Location::Local(dir.path().join("plugins").join("profile"));
        let mut names = Vec::new();
        for _ in 0..3 {
            let (output, name) = SessionOutput::create(&root, None).unwrap();
            assert!(
                matches!(output, SessionOutput::Local { ref directory, .. } if directory.is_dir())
            );
            names.push(name);
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 3, "{names:?}");
        // A given id is used as is, and again.
        let (made_it, first) = SessionOutput::create(&root, Some("run")).unwrap();
        let (again, second) = SessionOutput::create(&root, Some("run")).unwrap();
        assert_eq!((first.as_str(), second.as_str()), ("run", "run"));
        // A session nothing was written into goes when abandoned by the
        // capture that made it, with the directories made for it.
        again.abandon();
        assert!(dir.path().join("plugins/profile/run").is_dir());
        made_it.abandon();
        assert!(!dir.path().join("plugins/profile/run").exists());
        assert!(dir.path().join("plugins/profile").exists());
        // One the user made before is theirs: kept.
        std::fs::create_dir(dir.path().join("plugins/profile/theirs")).unwrap();
        let (output, _) = SessionOutput::create(&root, Some("theirs")).unwrap();
        output.abandon();
        assert!(dir.path().join("plugins/profile/theirs").is_dir());
        let fresh = Location::Local(dir.path().join("new/plugins/profile"));
        let (output, _) = SessionOutput::create(&fresh, Some("run")).unwrap();
        output.abandon();
        assert!(!dir.path().join("new").exists());
    }

    #[test]
    fn a_logdir_that_cannot_be_written_is_refused_before_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let root = Location::Local(file.join("plugins").join("profile"));
        let error = SessionOutput::create(&root, None).err().unwrap();
        assert!(format!("{error:#}").contains("under --logdir"), "{error:#}");
    }

    #[test]
    fn a_trace_that_cannot_be_written_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let blocked = dir.path().join("session");
        // A file where the session's directory should be.
        std::fs::write(&blocked, b"x").unwrap();
        let output = SessionOutput::Local {
            directory: blocked.clone(),
            made: Vec::new(),
        };
        let said = output.write("s1", "h.xplane.pb", b"trace").unwrap_err();
        let kept = said.rsplit("kept at ").next().unwrap();
        assert_eq!(std::fs::read(kept).unwrap(), b"trace", "{said}");
        let _ = std::fs::remove_dir_all(Path::new(kept).parent().unwrap().parent().unwrap());

        // A trace written meanwhile by another capture is not replaced.
        let directory = dir.path().join("run");
        std::fs::create_dir(&directory).unwrap();
        let output = SessionOutput::Local {
            directory: directory.clone(),
            made: Vec::new(),
        };
        output.write("run", "h.xplane.pb", b"first").unwrap();
        let said = output.write("run", "h.xplane.pb", b"second").unwrap_err();
        assert!(said.contains("was written meanwhile"), "{said}");
        assert_eq!(
            std::fs::read(directory.join("h.xplane.pb")).unwrap(),
            b"first"
        );
        let kept = said.rsplit("kept at ").next().unwrap();
        assert_eq!(std::fs::read(kept).unwrap(), b"second");
        let _ = std::fs::remove_dir_all(Path::new(kept).parent().unwrap().parent().unwrap());
    }
}
