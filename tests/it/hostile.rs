//! Attacks on the agent by a user of the host without privileges, through
//! the runtime directory every user can write into. The files are those of
//! uid 65534 ("nobody"), for processes of that user; what the tests write
//! into them (as root) is what their owner could write. Each test performs
//! one attack on the real agent binary and checks that the agent keeps
//! serving captures, that the capture during the attack names what was
//! refused or lost, that its memory stays bounded, and that SIGTERM still
//! stops it within 5 s.

use crate::common;

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::workload::{capture, wait_for_attached, PlantedRing};
use common::AgentProcess;
use devtrace::event::{Device, Event, NameId, Payload};
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::workload::MetaRecord;

const NOBODY: u32 = 65534;

/// Offsets into a ring file (checked in `crates/devtrace-shm/src/ring/layout.rs`).
const LANE_COUNT_OFFSET: u64 = 12;
const TOTAL_SIZE_OFFSET: u64 = 32;
const LANE0_HEAD_OFFSET: u64 = 192;

/// A host with a world-writable runtime directory and an agent reading it.
struct Host {
    runtime: tempfile::TempDir,
    agent: AgentProcess,
}

impl Host {
    /// `None` when not root: only root can act as another user.
    fn start() -> Option<Host> {
        if !common::is_root() {
            eprintln!("skipped: the attacks are made as another user, which needs root");
            return None;
        }
        let runtime = tempfile::tempdir().unwrap();
        std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let agent = AgentProcess::start(&[
            "--backend",
            "cuda",
            "--backend",
            "mock",
            "--runtime-dir",
            runtime.path().to_str().unwrap(),
        ]);
        Some(Host { runtime, agent })
    }

    fn dir(&self) -> &Path {
        self.runtime.path()
    }

    /// A ring in place for a long-running process of `uid` that holds it.
    fn plant(&self, uid: u32) -> PlantedRing {
        PlantedRing::new(self.dir(), uid)
    }

    async fn wait_until_attached(&self, count: usize) {
        wait_for_attached(&self.agent, count).await;
    }

    /// A capture of `ms` during which `attack` runs, 300 ms in.
    async fn capture_during(&self, ms: u64, attack: impl FnOnce()) -> XSpace {
        let capture = capture(&self.agent, ms);
        let attack = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            attack();
        };
        tokio::join!(capture, attack).0
    }

    /// The agent survived: it still captures the mock's events, holds less
    /// than 512 MiB, and stops on SIGTERM within 5 s.
    async fn assert_survived(mut self) {
        assert!(self.agent.is_running(), "the agent died");
        let space = capture(&self.agent, 300).await;
        assert!(
            common::event_count(&space) > 0,
            "no events after the attack: {:?}",
            space.warnings
        );
        let rss = self.agent.rss_bytes();
        assert!(rss < 512 << 20, "the agent holds {} MiB", rss >> 20);
        let stopped = self.agent.stop_with_sigterm(Duration::from_secs(5));
        assert!(
            stopped.is_some(),
            "SIGTERM did not stop the agent within 5 s"
        );
    }
}

/// Writes `value` at `offset` of a planted ring's file.
fn forge(planted: &PlantedRing, offset: u64, value: &[u8]) {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&planted.path)
        .unwrap();
    file.write_all_at(value, offset).unwrap();
}

fn warned(space: &XSpace, parts: &[&str]) -> bool {
    space
        .warnings
        .iter()
        .any(|w| parts.iter().all(|part| w.contains(part)))
}

/// Truncating a ring file the agent has mapped once killed it with SIGBUS.
#[tokio::test(flavor = "multi_thread")]
async fn a_ring_shrunk_under_the_agent_is_detached_and_the_agent_lives() {
    let Some(host) = Host::start() else {
        return;
    };
    let planted = host.plant(NOBODY);
    let pid = planted.pid;
    host.wait_until_attached(1).await;
    let path = planted.path.clone();
    let space = host
        .capture_during(1500, || {
            let status = Command::new("truncate")
                .args(["-s", "0"])
                .arg(&path)
                .uid(NOBODY)
                .gid(NOBODY)
                .status()
                .unwrap();
            assert!(status.success());
        })
        .await;
    assert!(
        warned(&space, &[&format!("detached process {pid}"), "shrank"]),
        "{:?}",
        space.warnings
    );
    host.assert_survived().await;
}

/// A head 2^48 ahead of the tail once made the agent read forever, flood
/// its own ring with forged events, and ignore SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn forged_ring_counters_are_detached_not_followed() {
    let Some(host) = Host::start() else {
        return;
    };
    let planted = host.plant(NOBODY);
    let pid = planted.pid;
    host.wait_until_attached(1).await;
    let space = host
        .capture_during(1500, || {
            forge(&planted, LANE0_HEAD_OFFSET, &(1u64 << 48).to_ne_bytes())
        })
        .await;
    assert!(
        warned(
            &space,
            &[&format!("detached process {pid}"), "ahead of its tail"]
        ),
        "{:?}",
        space.warnings
    );
    let forged_ones = space
        .planes
        .iter()
        .flat_map(|p| &p.lines)
        .filter(|l| l.name.contains(&format!("pid {pid}")))
        .count();
    assert_eq!(forged_ones, 0, "lines of the forged events were written");
    host.assert_survived().await;
}

/// A header claiming 2^31 lanes (a sparse file) once made the agent map it
/// and allocate per lane.
#[tokio::test(flavor = "multi_thread")]
async fn a_ring_of_billions_of_lanes_is_refused_before_it_is_mapped() {
    let Some(host) = Host::start() else {
        return;
    };
    let mut placed = None;
    let space = host
        .capture_during(1000, || {
            // Prepared under another name, then put in place whole, as the
            // library does.
            let staged = PlantedRing::staged(host.dir(), NOBODY, None);
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&staged.path)
                .unwrap();
            let lanes: u32 = 1 << 31;
            file.write_all_at(&lanes.to_ne_bytes(), LANE_COUNT_OFFSET)
                .unwrap();
            let total: u64 = 128 + u64::from(lanes) * 9024;
            file.write_all_at(&total.to_ne_bytes(), TOTAL_SIZE_OFFSET)
                .unwrap();
            // Sparse: costs the attacker nothing (where the file system
            // allows a file this large).
            let _ = file.set_len(total);
            placed = Some(staged.placed());
        })
        .await;
    let planted = placed.expect("planted");
    assert!(
        warned(
            &space,
            &[
                &planted.path.display().to_string(),
                "2147483648 lanes (at most 1 accepted)"
            ]
        ),
        "{:?}",
        space.warnings
    );
    host.assert_survived().await;
}

/// Rings named after long-lived processes of other users (pid 1, say) were
/// attached and never detached.
#[tokio::test(flavor = "multi_thread")]
async fn a_ring_for_another_users_process_is_refused() {
    let Some(host) = Host::start() else {
        return;
    };
    let mut planted = None;
    let space = host
        .capture_during(1000, || {
            planted = Some(PlantedRing::staged(host.dir(), NOBODY, Some(1)).placed());
        })
        .await;
    assert!(
        warned(&space, &["names process 1 as its maker, but process"]),
        "{:?}",
        space.warnings
    );
    assert!(host
        .agent
        .monitor(100)
        .await
        .data
        .contains("backend cuda: running (0 processes attached"));
    host.assert_survived().await;
}

/// 255 rings of one user once took every stream slot.
#[tokio::test(flavor = "multi_thread")]
async fn one_user_cannot_take_every_stream_slot() {
    let Some(host) = Host::start() else {
        return;
    };
    let limit = 32;
    let mut rings = Vec::new();
    let space = host
        .capture_during(2000, || {
            rings.extend((0..limit + 2).map(|_| host.plant(NOBODY)));
        })
        .await;
    assert!(
        warned(&space, &["uid 65534 already has 32 rings attached"]),
        "{:?}",
        space.warnings
    );
    host.wait_until_attached(limit).await;
    // Another user still gets in.
    rings.push(host.plant(0));
    host.wait_until_attached(limit + 1).await;
    host.assert_survived().await;
}

/// Events a workload's ring may carry are its own: the kinds the library
/// makes, on its threads; names it never declared do not fill the
/// registry; a device description it sends does not replace another's; an
/// event dated ten years ahead does not evict the flight recorder.
#[tokio::test(flavor = "multi_thread")]
async fn forged_events_stay_off_other_lines_and_devices() {
    let Some(host) = Host::start() else {
        return;
    };
    let planted = host.plant(NOBODY);
    let (pid, ring) = (planted.pid, &planted.ring);
    let meta = planted.files.meta.clone();
    let forged_gpu = MetaRecord::Device {
        ordinal: 0,
        uuid: None,
        info: devtrace::model::registry::DeviceInfo {
            model: "forged GPU".into(),
            ..Default::default()
        },
    };
    std::fs::write(&meta, forged_gpu.encode()).unwrap();
    std::os::unix::fs::chown(&meta, Some(NOBODY), Some(NOBODY)).unwrap();
    host.wait_until_attached(1).await;
    let agent_pid = host.agent.pid();
    let space = host
        .capture_during(1500, || {
            let now = common::now_ns();
            let mut producer = ring.producer().unwrap();
            let events = [
                // Onto the CPU lines of the scheduler view.
                Event::new(
                    now,
                    1000,
                    Device::HostCpus,
                    0,
                    NameId(0),
                    Payload::CpuSlice {
                        pid: agent_pid,
                        tid: agent_pid,
                        cpu: 0,
                        end_state: 0,
                    },
                ),
                // Onto the agent's own thread's line.
                Event::new(
                    now,
                    1000,
                    Device::Host,
                    u64::from(agent_pid),
                    NameId(0),
                    Payload::Plain,
                ),
                // Its own thread, a name id it never declared.
                Event::new(
                    now,
                    1000,
                    Device::Host,
                    u64::from(pid),
                    NameId(123_456),
                    Payload::Plain,
                ),
                // Ten years ahead.
                Event::new(
                    now + 10 * 365 * 86_400 * 1_000_000_000,
                    1000,
                    Device::Host,
                    u64::from(pid),
                    NameId(0),
                    Payload::Plain,
                ),
            ];
            assert_eq!(producer.push_batch(&events), events.len());
        })
        .await;
    assert!(
        warned(&space, &["2 events refused from workload rings"]),
        "{:?}",
        space.warnings
    );
    assert!(
        warned(&space, &["1 events dropped for times outside"]),
        "{:?}",
        space.warnings
    );
    let gpu = common::plane(&space, "/device:GPU:0");
    let model = devtrace::xspace::read::find_stat(gpu, &gpu.stats, "gpu_device_name");
    assert_eq!(
        model,
        Some(devtrace::xspace::read::StatValue::Str(
            "devtrace mock GPU (A100-class)".into()
        ))
    );
    // The one event it may make is there, with a name saying it is unknown.
    let host_plane = common::plane(&space, "/host:CPU");
    let own: Vec<_> = host_plane
        .lines
        .iter()
        .filter(|l| l.id == i64::from(pid))
        .flat_map(|l| &l.events)
        .collect();
    assert_eq!(own.len(), 1);
    let name = &host_plane.event_metadata[&own[0].metadata_id].name;
    assert!(name.contains("name unknown"), "{name}");
    assert!(host_plane
        .lines
        .iter()
        .filter(|l| l.id == i64::from(agent_pid))
        .all(|l| !l.name.contains(&format!("pid {pid}"))));
    host.assert_survived().await;
}
