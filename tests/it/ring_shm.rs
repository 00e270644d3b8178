//! Rings in shared memory between processes: a child process (this test
//! binary re-executed with `DEVTRACE_RING_CHILD` naming its role, running only
//! `child_role`) opens a ring file the parent created and pushes known
//! events; the parent drains them. Covers loss and duplication, exact drop
//! counts under both policies, header validation, the control word, producer
//! and consumer processes that die, and stale-file cleanup.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use devtrace::event::{Device, Event, NameId, Payload};
use devtrace::ring::{
    remove_stale_rings, Consumer, DropPolicy, Ring, RingError, CONTROL_CAPTURE, LAYOUT_VERSION,
};

const ROLE: &str = "DEVTRACE_RING_CHILD";
const PATH: &str = "DEVTRACE_RING_PATH";
const COUNT: &str = "DEVTRACE_RING_COUNT";
const LINE: &str = "DEVTRACE_RING_LINE";
const WAIT: &str = "DEVTRACE_RING_WAIT";
const TIMEOUT: Duration = Duration::from_secs(30);

fn event(line: u64, sequence: u64) -> Event {
    Event::new(
        sequence,
        1,
        Device::Host,
        line,
        NameId(1),
        Payload::Step {
            step_num: sequence as i64,
        },
    )
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name).map_or(0, |v| v.parse().unwrap())
}

/// Reports a result to the parent on its own line.
fn report(what: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "RESULT {what}").unwrap();
    out.flush().unwrap();
}

/// Waits to be killed by the parent; exits on its own should the parent
/// have failed before doing so.
fn hold() -> ! {
    std::thread::sleep(TIMEOUT);
    std::process::exit(1);
}

/// The child side: does nothing unless this process was started as a child.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let path = std::env::var(PATH).unwrap();
    let (count, line) = (env_u64(COUNT), env_u64(LINE));
    match role.as_str() {
        "push" | "push-die" => {
            let ring = if path.starts_with("/proc/") {
                // Another process's descriptor (a memfd): a magic link, which
                // `open_shared` refuses to follow.
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .unwrap();
                Ring::open_file(&file, Path::new(&path)).unwrap()
            } else {
                Ring::open_shared(&path).unwrap()
            };
            let mut producer = ring.producer().unwrap();
            let wait = env_u64(WAIT) == 1;
            let mut refused = 0;
            for i in 0..count {
                while wait && producer.free_slots() == 0 {
                    std::thread::yield_now();
                }
                if !producer.push(&event(line, i)) {
                    refused += 1;
                }
            }
            report(&format!("refused {refused}"));
            if role == "push-die" {
                // Hold the lane until the parent kills this process.
                hold();
            }
        }
        "control" => {
            let ring = Ring::open_shared(&path).unwrap();
            let mut producer = ring.producer().unwrap();
            let start = Instant::now();
            while !ring.control().capture() {
                assert!(start.elapsed() < TIMEOUT, "capture never started");
                std::thread::sleep(Duration::from_millis(1));
            }
            let seen = ring.control();
            producer.push(&event(line, u64::from(seen.generation)));
            ring.set_control(seen.flags | 2);
            report("done");
        }
        "consume-hold" => {
            let ring = Ring::open_shared(&path).unwrap();
            let _consumer = ring.consumer().unwrap();
            report("ready");
            hold();
        }
        "create" => {
            let ring = Ring::create_shared(&path, 2, 8, DropPolicy::DropNewest).unwrap();
            ring.producer().unwrap().push(&event(line, 0));
            report("created");
        }
        other => panic!("unknown child role {other}"),
    }
}

fn spawn(
    role: &str,
    path: &Path,
    count: u64,
    line: u64,
    wait: bool,
) -> (Child, BufReader<ChildStdout>) {
    // The harness names the test by its path below the crate: `ring_shm::child_role`.
    let test = module_path!()
        .split_once("::")
        .map_or("child_role".to_string(), |(_, module)| {
            format!("{module}::child_role")
        });
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(PATH, path)
        .env(COUNT, count.to_string())
        .env(LINE, line.to_string())
        .env(WAIT, if wait { "1" } else { "0" })
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdout)
}

/// The next `RESULT` line of a child.
fn result(stdout: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "child ended without a result"
        );
        // The harness may have started the line ("test child_role ... ").
        if let Some((_, rest)) = line.trim_end().split_once("RESULT ") {
            return rest.to_string();
        }
    }
}

fn refused(stdout: &mut BufReader<ChildStdout>) -> u64 {
    let text = result(stdout);
    text.strip_prefix("refused ").unwrap().parse().unwrap()
}

fn finish(mut child: Child) {
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
}

/// Checks events as they arrive: each (line, sequence) once, in order per line.
struct Seen {
    set: HashSet<(u64, u64)>,
    last: Vec<Option<u64>>,
}

impl Seen {
    fn new(lines: usize) -> Seen {
        Seen {
            set: HashSet::new(),
            last: vec![None; lines],
        }
    }

    fn take(&mut self, out: &mut Vec<Event>) {
        for e in out.drain(..) {
            assert!(self.set.insert((e.line, e.start_ns)), "duplicate {e:?}");
            let last = &mut self.last[e.line as usize];
            assert!(last.is_none_or(|l| l < e.start_ns), "out of order {e:?}");
            *last = Some(e.start_ns);
        }
    }
}

/// Drains until `children` have exited, then once more; returns events seen
/// and drops reported.
fn drain_while_running(consumer: &mut Consumer, children: &mut [Child], seen: &mut Seen) -> u64 {
    let mut out = Vec::new();
    let mut dropped = 0;
    let start = Instant::now();
    loop {
        let done = children.iter_mut().all(|c| c.try_wait().unwrap().is_some());
        let report = consumer.drain(&mut out, 4096);
        dropped += report.dropped_newest + report.dropped_oldest;
        seen.take(&mut out);
        if done && report.events == 0 {
            return dropped;
        }
        assert!(start.elapsed() < TIMEOUT * 2, "children did not finish");
        if report.events == 0 {
            std::thread::yield_now();
        }
    }
}

#[test]
fn events_cross_processes_without_loss_or_duplicates() {
    const PER_CHILD: u64 = 50_000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lossless.ring");
    let ring = Ring::create_shared(&path, 3, 256, DropPolicy::DropNewest).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut consumer = ring.consumer().unwrap();
    let spawned: Vec<_> = (0..2)
        .map(|line| spawn("push", &path, PER_CHILD, line, true))
        .collect();
    let (mut children, mut outputs): (Vec<_>, Vec<_>) = spawned.into_iter().unzip();
    let mut seen = Seen::new(2);
    let dropped = drain_while_running(&mut consumer, &mut children, &mut seen);
    for output in &mut outputs {
        assert_eq!(refused(output), 0);
    }
    children.into_iter().for_each(finish);
    assert_eq!(dropped, 0);
    assert_eq!(seen.set.len() as u64, 2 * PER_CHILD);
    assert_eq!(seen.last, vec![Some(PER_CHILD - 1); 2]);
    assert_eq!(ring.stats().pushed, 2 * PER_CHILD);
    // The children released their lanes when they finished.
    assert_eq!(ring.lane_owners(), vec![None; 3]);
}

fn overflow_in_child(policy: DropPolicy) -> (Vec<u64>, u64, u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("overflow.ring");
    let ring = Ring::create_shared(&path, 1, 8, policy).unwrap();
    let mut consumer = ring.consumer().unwrap();
    let (child, mut stdout) = spawn("push", &path, 20, 0, false);
    let refused = refused(&mut stdout);
    finish(child);
    let mut out = Vec::new();
    let report = consumer.drain(&mut out, usize::MAX);
    assert_eq!(report.events, out.len() as u64);
    let starts = out.iter().map(|e| e.start_ns).collect();
    (
        starts,
        refused,
        report.dropped_newest,
        report.dropped_oldest,
    )
}

#[test]
fn drop_newest_overflow_is_counted_exactly_across_processes() {
    let (kept, refused, newest, oldest) = overflow_in_child(DropPolicy::DropNewest);
    assert_eq!(kept, (0..8).collect::<Vec<_>>());
    assert_eq!((refused, newest, oldest), (12, 12, 0));
}

#[test]
fn drop_oldest_overflow_is_counted_exactly_across_processes() {
    let (kept, refused, newest, oldest) = overflow_in_child(DropPolicy::DropOldest);
    assert_eq!(kept, (12..20).collect::<Vec<_>>());
    assert_eq!((refused, newest, oldest), (0, 0, 12));
}

/// Two producer processes race the consumer on small lanes: every event is
/// either read once or counted as dropped.
fn lossy_race(policy: DropPolicy) {
    const PER_CHILD: u64 = 100_000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("race.ring");
    let ring = Ring::create_shared(&path, 2, 64, policy).unwrap();
    let mut consumer = ring.consumer().unwrap();
    let spawned: Vec<_> = (0..2)
        .map(|line| spawn("push", &path, PER_CHILD, line, false))
        .collect();
    let (mut children, mut outputs): (Vec<_>, Vec<_>) = spawned.into_iter().unzip();
    let mut seen = Seen::new(2);
    let dropped = drain_while_running(&mut consumer, &mut children, &mut seen);
    let refused: u64 = outputs.iter_mut().map(refused).sum();
    children.into_iter().for_each(finish);
    assert_eq!(seen.set.len() as u64 + dropped, 2 * PER_CHILD);
    let stats = ring.stats();
    assert_eq!(stats.pushed, 2 * PER_CHILD - refused);
    assert_eq!(stats.dropped_newest + stats.dropped_oldest, dropped);
    match policy {
        DropPolicy::DropNewest => assert_eq!(stats.dropped_newest, refused),
        DropPolicy::DropOldest => assert_eq!(refused, 0),
    }
}

#[test]
fn racing_processes_lose_nothing_uncounted_drop_newest() {
    lossy_race(DropPolicy::DropNewest);
}

#[test]
fn racing_processes_lose_nothing_uncounted_drop_oldest() {
    lossy_race(DropPolicy::DropOldest);
}

#[test]
fn bad_ring_files_are_refused_before_use() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.ring");
    let ring = Ring::create_shared(&good, 2, 16, DropPolicy::DropOldest).unwrap();
    let size = ring.layout().total_size().unwrap() as u64;
    assert_eq!(std::fs::metadata(&good).unwrap().len(), size);
    // No temporary file is left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let reopened = Ring::open_shared(&good).unwrap();
    assert_eq!(reopened.layout(), ring.layout());
    assert_eq!(reopened.policy(), DropPolicy::DropOldest);
    assert_eq!(reopened.creator_pid(), std::process::id());

    // Creating over an existing ring fails and leaves it intact.
    match Ring::create_shared(&good, 1, 8, DropPolicy::DropNewest).err() {
        Some(RingError::Io { kind, .. }) => assert_eq!(kind, std::io::ErrorKind::AlreadyExists),
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    assert!(Ring::open_shared(&good).is_ok());

    let variant = |name: &str, edit: &dyn Fn(&std::fs::File)| {
        let path = dir.path().join(name);
        std::fs::copy(&good, &path).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        edit(&file);
        Ring::open_shared(&path)
            .err()
            .expect("a bad ring was accepted")
    };
    let truncated = variant("truncated.ring", &|f| f.set_len(size - 64).unwrap());
    assert!(
        matches!(truncated, RingError::Truncated { size: s, needed, .. } if s == size - 64 && needed == size),
        "{truncated}"
    );
    let tiny = variant("tiny.ring", &|f| f.set_len(10).unwrap());
    assert!(
        matches!(tiny, RingError::Truncated { size: 10, .. }),
        "{tiny}"
    );
    let longer = variant("longer.ring", &|f| f.set_len(size + 4096).unwrap());
    assert!(matches!(longer, RingError::BadHeader { .. }), "{longer}");
    let magic = variant("magic.ring", &|f| f.write_all_at(b"NOTARING", 0).unwrap());
    assert!(matches!(magic, RingError::BadMagic { .. }), "{magic}");
    let version = variant("version.ring", &|f| {
        f.write_all_at(&2u32.to_ne_bytes(), 8).unwrap()
    });
    assert_eq!(
        version,
        RingError::Version {
            path: dir.path().join("version.ring").display().to_string(),
            found: 2,
            expected: LAYOUT_VERSION,
        }
    );
    let lanes = variant("lanes.ring", &|f| {
        f.write_all_at(&0u32.to_ne_bytes(), 12).unwrap()
    });
    assert!(matches!(lanes, RingError::BadHeader { .. }), "{lanes}");
    let more_lanes = variant("more.ring", &|f| {
        f.write_all_at(&3u32.to_ne_bytes(), 12).unwrap()
    });
    assert!(
        matches!(more_lanes, RingError::BadHeader { .. }),
        "{more_lanes}"
    );
    let capacity = variant("capacity.ring", &|f| {
        f.write_all_at(&17u64.to_ne_bytes(), 16).unwrap()
    });
    assert!(
        matches!(capacity, RingError::BadHeader { .. }),
        "{capacity}"
    );
    let slot = variant("slot.ring", &|f| {
        f.write_all_at(&64u32.to_ne_bytes(), 24).unwrap()
    });
    assert!(matches!(slot, RingError::BadHeader { .. }), "{slot}");
    let policy = variant("policy.ring", &|f| {
        f.write_all_at(&9u32.to_ne_bytes(), 28).unwrap()
    });
    assert!(matches!(policy, RingError::BadHeader { .. }), "{policy}");
    let missing = Ring::open_shared(dir.path().join("missing.ring"))
        .err()
        .unwrap();
    assert!(
        matches!(
            missing,
            RingError::Io {
                kind: std::io::ErrorKind::NotFound,
                ..
            }
        ),
        "{missing}"
    );
}

#[test]
fn control_word_is_seen_by_the_other_process() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("control.ring");
    let ring = Ring::create_shared(&path, 1, 8, DropPolicy::DropNewest).unwrap();
    let mut consumer = ring.consumer().unwrap();
    let (child, mut stdout) = spawn("control", &path, 0, 0, false);
    std::thread::sleep(Duration::from_millis(20));
    assert!(!ring.control().capture());
    let set = ring.set_control(CONTROL_CAPTURE);
    assert_eq!(result(&mut stdout), "done");
    finish(child);
    // The child saw our flags and generation, and its answer reached us.
    let mut out = Vec::new();
    consumer.drain(&mut out, usize::MAX);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].start_ns, u64::from(set.generation));
    let now = ring.control();
    assert_eq!(now.flags, CONTROL_CAPTURE | 2);
    assert_eq!(now.generation, set.generation + 1);
}

#[test]
fn a_dead_producer_is_detected_and_its_events_still_drained() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dead.ring");
    let ring = Ring::create_shared(&path, 1, 64, DropPolicy::DropNewest).unwrap();
    let mut consumer = ring.consumer().unwrap();
    let (mut child, mut stdout) = spawn("push-die", &path, 40, 0, false);
    assert_eq!(refused(&mut stdout), 0);
    let pid = child.id();
    // Alive: the lane stays with it.
    assert_eq!(ring.lane_owners(), vec![Some(pid)]);
    assert!(ring.release_dead_producers().is_empty());
    assert_eq!(ring.producer().err(), Some(RingError::AllLanesBusy(1)));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(ring.release_dead_producers(), vec![0]);
    assert_eq!(ring.lane_owners(), vec![None]);
    let mut out = Vec::new();
    let report = consumer.drain(&mut out, usize::MAX);
    assert_eq!(report.events, 40);
    assert_eq!(
        out.iter().map(|e| e.start_ns).collect::<Vec<_>>(),
        (0..40).collect::<Vec<_>>()
    );
    // The lane is usable again and continues after what was written.
    let mut producer = ring.producer().unwrap();
    assert!(producer.push(&event(0, 40)));
    out.clear();
    consumer.drain(&mut out, usize::MAX);
    assert_eq!(out[0].start_ns, 40);
}

#[test]
fn the_consumer_of_a_dead_process_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("consumer.ring");
    let ring = Ring::create_shared(&path, 1, 8, DropPolicy::DropNewest).unwrap();
    let (mut child, mut stdout) = spawn("consume-hold", &path, 0, 0, false);
    assert_eq!(result(&mut stdout), "ready");
    assert_eq!(ring.consumer_pid(), Some(child.id()));
    assert_eq!(ring.consumer().err(), Some(RingError::ConsumerTaken));
    child.kill().unwrap();
    child.wait().unwrap();
    let consumer = ring.consumer().unwrap();
    assert_eq!(ring.consumer_pid(), Some(std::process::id()));
    // Let go of, it is free for the next.
    drop(consumer);
    assert_eq!(ring.consumer_pid(), None);
}

#[test]
fn stale_ring_files_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.ring");
    let (child, mut stdout) = spawn("create", &stale, 0, 0, false);
    assert_eq!(result(&mut stdout), "created");
    let creator = child.id();
    finish(child);
    // A producer that opened it holds it too.
    let producing = Ring::open_shared(&stale).unwrap();
    assert_eq!(producing.creator_pid(), creator);
    let live_path = dir.path().join("live.ring");
    let _live = Ring::create_shared(&live_path, 1, 8, DropPolicy::DropNewest).unwrap();
    let other = dir.path().join("notes.ring");
    std::fs::write(&other, b"not a ring").unwrap();
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    let leftover = dir.path().join(format!(".half.ring.{creator}-0.tmp"));
    std::fs::File::create(&leftover)
        .unwrap()
        .set_modified(an_hour_ago)
        .unwrap();
    // Just made, not yet locked.
    let mine = dir
        .path()
        .join(format!(".mine.ring.{}-0.tmp", std::process::id()));
    std::fs::write(&mine, b"").unwrap();
    let old_but_held = dir.path().join(".held.ring.1-0.tmp");
    let holder = std::fs::File::create(&old_but_held).unwrap();
    holder.set_modified(an_hour_ago).unwrap();
    devtrace::model::host_process::hold_shared(&holder).unwrap();

    assert_eq!(removed_within(dir.path(), 1), vec![leftover]);
    drop(producing);
    assert_eq!(removed_within(dir.path(), 1), vec![stale]);
    assert!(live_path.exists() && other.exists() && mine.exists() && old_but_held.exists());
    assert!(remove_stale_rings(dir.path()).unwrap().is_empty());
}

/// The files `remove_stale_rings` removes from `dir` once `count` are gone,
/// in order of name. It asks again for a while: a process that another test
/// spawns holds a copy of every descriptor this one has open until it execs,
/// and with it the lock of a file this test has just let go of.
fn removed_within(dir: &Path, count: usize) -> Vec<std::path::PathBuf> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut removed = Vec::new();
    loop {
        removed.extend(remove_stale_rings(dir).unwrap());
        if removed.len() >= count || Instant::now() > deadline {
            removed.sort();
            return removed;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_memfd_ring_is_shared_through_its_descriptor() {
    use std::os::fd::AsRawFd;
    let (ring, file) = Ring::create_memfd("devtrace-test", 1, 64, DropPolicy::DropNewest).unwrap();
    let mut consumer = ring.consumer().unwrap();
    let proc_path = format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd());
    let (child, mut stdout) = spawn("push", Path::new(&proc_path), 30, 0, false);
    assert_eq!(refused(&mut stdout), 0);
    finish(child);
    let mut out = Vec::new();
    assert_eq!(consumer.drain(&mut out, usize::MAX).events, 30);
    let same = Ring::open_file(&file, Path::new("memfd")).unwrap();
    assert_eq!(same.stats().pushed, 30);
}

/// Files a peer may put where a ring is expected: a second name for its
/// file (to swap or shrink behind it) and a FIFO (once a stalled open) are
/// refused; so is a ring beyond the opener's limits.
#[test]
fn rings_in_files_a_peer_controls_are_refused() {
    use devtrace::ring::OpenLimits;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linked.ring");
    let _ring = Ring::create_shared(&path, 2, 8, DropPolicy::DropNewest).unwrap();
    std::fs::hard_link(&path, dir.path().join("second-name")).unwrap();
    let error = Ring::open_shared(&path).err().unwrap();
    assert!(error.to_string().contains("2 links"), "{error}");

    let fifo = dir.path().join("fifo.ring");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    let error = Ring::open_shared(&fifo).err().unwrap();
    assert!(error.to_string().contains("not a regular file"), "{error}");

    let path = dir.path().join("wide.ring");
    let _ring = Ring::create_shared(&path, 2, 8, DropPolicy::DropNewest).unwrap();
    let one_lane = OpenLimits {
        lanes: 1,
        bytes: 1 << 30,
    };
    let error = Ring::open_untrusted(&path, one_lane).err().unwrap();
    assert!(error.to_string().contains("2 lanes (at most 1"), "{error}");
    let small = OpenLimits {
        lanes: 2,
        bytes: 1024,
    };
    let error = Ring::open_untrusted(&path, small).err().unwrap();
    assert!(
        error.to_string().contains("at most 1024 accepted"),
        "{error}"
    );
}

/// A producer that truncates the ring's file after the consumer mapped it
/// once killed the consumer's process with SIGBUS at the next drain.
#[test]
fn a_ring_whose_file_shrinks_is_survived_and_reported() {
    use devtrace::ring::{Corruption, OpenLimits};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shrinking.ring");
    let ring = Ring::create_shared(&path, 1, 64, DropPolicy::DropNewest).unwrap();
    let mut producer = ring.producer().unwrap();
    for i in 0..10 {
        producer.push(&event(0, i));
    }
    // This side's mapping is not guarded: let go of the lane before the
    // file shrinks under it.
    drop(producer);
    let (opened, identity) = Ring::open_untrusted(&path, OpenLimits::default()).unwrap();
    assert_eq!(identity.uid, unsafe { libc::geteuid() });
    let mut consumer = opened.consumer().unwrap();
    let mut out = Vec::new();
    assert_eq!(consumer.drain(&mut out, 5).events, 5);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    out.clear();
    let report = consumer.drain(&mut out, 100);
    assert_eq!(report.corrupt, Some(Corruption::Shrunk));
    assert!(out.is_empty(), "events read from a shrunk file were kept");
    assert_eq!(consumer.drain(&mut out, 100).events, 0);
}
