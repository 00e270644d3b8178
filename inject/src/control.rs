//! The control thread: waits for CUDA and the runtime directory, sets up
//! the session, then follows the agent's control word. A capture takes
//! CUPTI's activity stream (or steps aside for another user), has the
//! timeline's API calls timed by its subscriber ([`crate::timed_calls`]) or
//! recorded by CUPTI, flushes while it runs, and at its end switches
//! everything off, takes its buffers back and detaches CUPTI
//! ([`crate::detach`]). When the agent asks for the
//! GPU's past (`CONTROL_RECORD_ALWAYS`), the kernels, copies and memsets
//! stay recorded between captures ([`BACKGROUND_KINDS`]); a capture adds
//! the rest for its window, and CUPTI is detached only once the agent
//! stops asking. An agent that dies (killed, out of memory) cannot clear
//! the word: its beat stops, and after [`agent_silence_limit`] the word is
//! read as all off, so the job is left as it was found ([`AgentPulse`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use devtrace_shm::ring::Control;
use devtrace_shm::workload::{ApiRecordSet, MetaRecord, UntimedCause};

use crate::clock::ClockMap;
use crate::convert::Converter;
use crate::detach::{self, Attachment, Progress, Teardown};
use crate::records::{self, buffer_completed, buffer_requested};
use crate::session::{create_files, load_cupti, Session};
use crate::{buffers, coexist, cupti, driver, fail, ffi, quiet, sys, timed_calls, SESSION};

/// How often completed records are asked for while a capture runs.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// The kind left on from a capture's end until CUPTI is finalized: a CUPTI
/// with every kind off may call no subscriber at all (the H200 run could
/// not rule it out), and contexts are made or destroyed too rarely for its
/// records to cost anything.
const KEEPER_KIND: u32 = cupti::kind::CONTEXT;
/// The kinds recorded between captures when the agent asks for the GPU's
/// past: the device's work and what describes it, no API calls; kernels
/// last, as in [`cupti::KINDS`].
const BACKGROUND_KINDS: [u32; 5] = [
    cupti::kind::DEVICE,
    cupti::kind::CONTEXT,
    cupti::kind::MEMCPY,
    cupti::kind::MEMSET,
    cupti::kind::CONCURRENT_KERNEL,
];
const _: () =
    assert!(BACKGROUND_KINDS[BACKGROUND_KINDS.len() - 1] == cupti::kind::CONCURRENT_KERNEL);
/// The kinds a capture enables beyond the [`BACKGROUND_KINDS`].
fn capture_only_kinds() -> impl Iterator<Item = u32> {
    cupti::KINDS
        .into_iter()
        .filter(|kind| !BACKGROUND_KINDS.contains(kind))
}

/// How long CUPTI may go without calling the subscriber, while kernels are
/// recorded, before its timing is given up for CUPTI's records.
const SILENCE_LIMIT_NS: u64 = 1_000_000_000;

/// How long a capture's end waits, after forcing CUPTI's buffers out, for
/// them to come back before detaching (detaching hands back the rest).
/// Short, because the agent builds the capture's trace 450 ms after its
/// window and [`UNFINISHED_WAIT`] came first: CUDA 13 hands the job
/// threads' partly filled buffers (the window's last records) back only
/// at the detach.
const RETURN_WAIT: Duration = Duration::from_millis(100);

/// How long the end of a capture waits for the GPU to finish the work
/// launched before it, before CUPTI's records are forced back. CUPTI hands
/// back a buffer holding a record of work still running (or waiting to
/// run) only when forced, and then that record comes back unfinished, with
/// no end, never to be completed; a flush that is not forced hands back
/// each buffer once all its work has ended. The agent builds a capture's
/// trace 450 ms after its window.
const UNFINISHED_WAIT: Duration = Duration::from_millis(200);

/// How long a library gone quiet keeps trying to leave the job detached
/// before it leaves CUPTI as it is.
const STAND_DOWN_LIMIT: Duration = Duration::from_secs(10);

/// How long the exit handler waits for buffers CUPTI delivers from a
/// thread of its own, before it counts those it kept.
const EXIT_WAIT: Duration = Duration::from_millis(20);

/// How long the exit handler reads the buffers CUPTI handed back, from the
/// exit's start: a job's exit is not held longer (a backlog of full
/// buffers, read on a machine whose cores the job's other threads hold,
/// took seconds), and what is left unread is said.
/// `DEVTRACE_INJECT_EXIT_READ_MS` (0 to 10000) sets it, for tests.
fn exit_read_limit() -> Duration {
    let ms = std::env::var("DEVTRACE_INJECT_EXIT_READ_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| *ms <= 10_000)
        .unwrap_or(200);
    Duration::from_millis(ms)
}

/// Whether the CUDA driver is loaded in this process.
fn cuda_loaded() -> bool {
    ["libcuda.so.1", "libcuda.so"]
        .iter()
        .any(|name| sys::dl::is_loaded(name))
}

fn poll_interval() -> Duration {
    let ms = std::env::var("DEVTRACE_INJECT_POLL_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|ms| (1..=10_000).contains(ms))
        .unwrap_or(20);
    Duration::from_millis(ms)
}

/// How long the agent may go without beating before its control word is no
/// longer followed: its passes come every 10 to 100 ms, so 5 s of silence is
/// an agent that died or is stopped, not a busy one.
fn agent_silence_limit() -> Duration {
    let ms = std::env::var("DEVTRACE_INJECT_AGENT_SILENCE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(5000)
        .clamp(100, 600_000);
    Duration::from_millis(ms)
}

/// Follows the agent's beat ([`devtrace_shm::ring::Ring::beat`]): a control
/// word whose agent stopped beating is read as all flags off, until an
/// agent beats again (a restarted one attaches the ring anew).
struct AgentPulse {
    last: u32,
    changed_at: Instant,
    limit: Duration,
    /// The agent went silent with something asked, and was told of.
    silent: bool,
}

impl AgentPulse {
    fn new() -> AgentPulse {
        AgentPulse {
            last: 0,
            changed_at: Instant::now(),
            limit: agent_silence_limit(),
            silent: false,
        }
    }

    /// The control word to follow, given the agent's `beat` now.
    fn follow(&mut self, session: &Session, beat: u32, control: Control) -> Control {
        if beat != self.last {
            self.last = beat;
            self.changed_at = Instant::now();
            self.silent = false;
            return control;
        }
        // An agent that never beat (none yet, or one older than the beat)
        // is followed as it is.
        if beat == 0 || self.changed_at.elapsed() < self.limit {
            return control;
        }
        if control.flags != 0 && !self.silent {
            self.silent = true;
            let message = format!(
                "the agent stopped beating {} ms ago with recording asked for (it died or is \
                 stopped): recording stopped and CUPTI detached until an agent attaches again",
                self.changed_at.elapsed().as_millis()
            );
            say!("devtrace-inject: {message}");
            session.write_meta(&MetaRecord::Warning { message });
        }
        Control {
            flags: 0,
            ..control
        }
    }
}

/// Waits for the driver and the runtime directory, sets up the session,
/// then follows the agent's control word until the process ends.
pub fn control_loop() {
    let poll = poll_interval();
    // In processes that never load CUDA (children of an LD_PRELOAD-ed
    // workload) this is all the library does, ever more rarely.
    let mut wait = poll;
    while !cuda_loaded() {
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(1));
    }
    let loaded = load_cupti();
    let dir = crate::runtime::dir();
    // The agent makes the directory; a workload may start first.
    while !dir.is_dir() {
        std::thread::sleep(Duration::from_secs(1));
    }
    let pid = std::process::id();
    let (ring, meta) = match create_files(&dir, pid) {
        Ok(files) => files,
        Err(error) => return fail(&error),
    };
    let producer = match ring.producer() {
        Ok(producer) => producer,
        Err(error) => return fail(&format!("cannot claim its ring lane: {error}")),
    };
    let converter = Converter::new(
        pid,
        loaded.as_ref().map_or(0, |loaded| loaded.version),
        cupti::callback_name,
    );
    let session = Session::new(ring, producer, meta, converter);
    if SESSION.set(session).is_err() {
        return;
    }
    // From now on, not from the first capture: one starting while the
    // process exits must find the gate closed, not call into a libcupti
    // being torn down.
    sys::process::at_exit(flush_at_exit);
    // Refused or missing CUPTI is told to the agent through the metadata.
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(error) => return fail(&error),
    };
    let Some(session) = SESSION.get() else { return };
    // Users that look CUPTI up from now on find the hooks.
    coexist::redirect_callers();
    session.write_meta(&MetaRecord::Cupti {
        version: loaded.version,
        origin: loaded.origin.to_string(),
    });
    if let Some(text) = loaded.warning {
        say!("devtrace-inject: {text}");
        session.write_meta(&MetaRecord::Warning {
            message: text.to_string(),
        });
    }
    detach::set_converter(records::convert_pending_now);
    let converter = std::thread::Builder::new()
        .name("devtrace-convert".into())
        .spawn(|| ffi::guard("the converter thread", (), records::convert_loop));
    if let Err(error) = converter {
        return fail(&format!("cannot start its converter thread: {error}"));
    }
    let mut tracer = Tracer {
        stream: Stream::Off,
        displaced: false,
        last_flush: None,
        api: None,
        all_api: false,
        cupti_api: false,
        unselectable_told: false,
        teardown: None,
        kept_attached_told: false,
        next_detach_try: None,
        keeper_on: false,
        unanswered_ended_ns: None,
        background: false,
        may_time: false,
        kernels_at_timing: 0,
        selected: None,
        selection_ignored: false,
        generation: None,
    };
    let mut pulse = AgentPulse::new();
    let mut seen = session.ring.control();
    let mut quiet_since: Option<Instant> = None;
    loop {
        // Woken as soon as the agent changes the word (a capture starts or
        // ends), else at the poll interval, for the flushes and detaches.
        seen = session.ring.wait_for_control(seen, poll);
        if *detach::gate() == Attachment::Closed {
            return;
        }
        if quiet() {
            // A failure was said, here or on another thread (a callback's
            // panic, a metadata write that failed).
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if tracer.stand_down(session, since) {
                return;
            }
            continue;
        }
        let control = pulse.follow(session, session.ring.consumer_beat(), seen);
        if let Err(error) = tracer.tick(session, control) {
            // Said at once; what it had on is ended by the ticks to come.
            fail(&error);
        }
    }
}

/// Where this library stands with CUPTI's activity stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    /// Nothing enabled (no capture).
    Off,
    /// Enabled, and our records arrive.
    Ours,
    /// Another CUPTI user in the process has it; `seen` when its calls pass
    /// through this library, so that its end is seen too.
    Taken { seen: bool },
}

/// The control loop's state across ticks.
struct Tracer {
    stream: Stream,
    /// The stream was taken from us and not yet taken back.
    displaced: bool,
    last_flush: Option<Instant>,
    /// The API calls whose records are enabled (`None`: none).
    api: Option<ApiRecordSet>,
    /// The agent asks for every API call's records.
    all_api: bool,
    /// The agent asks for CUPTI's records of the timeline's calls rather
    /// than the subscriber's timing.
    cupti_api: bool,
    /// Why the timeline's calls cannot be selected was said.
    unselectable_told: bool,
    /// Detaching CUPTI after a capture, while it is under way.
    teardown: Option<Teardown>,
    /// Why CUPTI stays attached was said, since the last capture.
    kept_attached_told: bool,
    /// After a refused detach, when to try again.
    next_detach_try: Option<Instant>,
    /// [`KEEPER_KIND`] is on for the teardown after a capture.
    keeper_on: bool,
    /// When the last capture ended, while the check of its launches
    /// ([`tell_unanswered`]) waits for buffers CUPTI hands back only as it
    /// is detached.
    unanswered_ended_ns: Option<u64>,
    /// This capture may have the subscriber time the timeline's calls: it
    /// was ours before the capture's kinds went on, and CUPTI calls it.
    may_time: bool,
    /// Kernel records converted when timing started.
    kernels_at_timing: u64,
    /// Since when CUPTI is to record the timeline's calls selected one by
    /// one, until one of their records was seen.
    selected: Option<Selected>,
    /// CUPTI recorded none of the calls selected one by one while it
    /// recorded kernels: from then on every call is recorded.
    selection_ignored: bool,
    /// The stream is ours with [`BACKGROUND_KINDS`] alone on: the GPU's
    /// past is recorded, no capture runs.
    background: bool,
    /// The generation of the control word at the last tick.
    generation: Option<u32>,
}

/// When the timeline's calls were selected for CUPTI to record, and the
/// API records converted by then.
#[derive(Clone, Copy, Debug)]
struct Selected {
    at_ns: u64,
    api_records: u64,
}

impl Tracer {
    /// One poll of the control word.
    fn tick(&mut self, session: &Session, control: Control) -> Result<(), String> {
        let capture = control.capture();
        let new_word = self.generation.replace(control.generation) != Some(control.generation);
        // Recorded now: for a capture, or the GPU's past.
        let wanted = capture || control.record_always();
        self.all_api = control.all_api_records();
        self.cupti_api = control.cupti_api_records();
        match (self.stream, wanted) {
            (Stream::Off, false) => {
                self.detach_when_alone(session);
                Ok(())
            }
            // Another user holds the stream as a capture starts: it is not
            // taken from it.
            (Stream::Off, true) => match coexist::foreign_holder() {
                Some(_) => {
                    self.displaced_at(session, true, devtrace_shm::clock::now_ns());
                    Ok(())
                }
                None => self.take(session, capture),
            },
            (Stream::Ours, true) => {
                if capture && self.background {
                    self.widen(session)?;
                } else if !capture && !self.background {
                    self.narrow(session)?;
                } else if !capture && new_word {
                    // The same flags set again: the agent asks for the
                    // records CUPTI holds, for a capture of the past.
                    self.hand_back(session)?;
                }
                self.keep(session)
            }
            (Stream::Ours, false) => self.stop(session),
            (Stream::Taken { seen: true }, true) if coexist::foreign_done() => {
                self.take(session, capture)
            }
            (Stream::Taken { .. }, true) => Ok(()),
            // The other user keeps what it enabled: nothing is switched off.
            // One whose end cannot be seen is taken back from at the next
            // capture.
            (Stream::Taken { seen }, false) => {
                if !seen || coexist::foreign_done() {
                    self.stream = Stream::Off;
                }
                Ok(())
            }
        }
    }

    /// Registers our callbacks (again: CUPTI was finalized, or another user
    /// replaced them) and enables every kind for a `capture`, else the
    /// [`BACKGROUND_KINDS`]; says when recording began.
    fn take(&mut self, session: &Session, capture: bool) -> Result<(), String> {
        // A teardown still waiting is disarmed; its subscriber stays.
        self.end_teardown(session);
        self.kept_attached_told = false;
        self.next_detach_try = None;
        self.keeper_on = false;
        // Libraries loaded since the last look (a framework imported late).
        coexist::redirect_callers();
        // Driver calls, without the gate: another subscriber's callback may
        // call CUPTI through the library.
        driver::learn_devices(session);
        let mut gate = detach::gate();
        if *gate == Attachment::Closed {
            return Ok(());
        }
        let fresh = detach::fresh(&gate);
        *gate = Attachment::Attached;
        cupti::use_system_thread_ids()?;
        cupti::register_callbacks(buffer_requested, buffer_completed)?;
        set_clock(session)?;
        // The teardown after the capture needs a subscriber CUPTI calls
        // (see `detach::subscribe_for_capture`): made before the kinds when
        // CUPTI starts afresh, as CUPTI's own dynamic-detach sample does, and
        // after them when it stayed attached with every kind off.
        if fresh {
            detach::subscribe_for_capture(&gate);
        }
        // Launches are recorded from before kernels are, so that no kernel
        // recorded as the capture starts lacks its launch call: timed when
        // the subscriber is ours already (else CUPTI records them for the
        // whole capture), by CUPTI's records before the kinds on a CUPTI
        // already attached, and on a fresh one after the other kinds but
        // still before the kernels, which come last (see `cupti::KINDS`).
        self.may_time = capture && detach::subscribed();
        let early = capture && (self.may_time || !fresh);
        if early {
            self.record_api_calls(session, true)?;
        }
        let kinds: &[u32] = if capture {
            &cupti::KINDS
        } else {
            &BACKGROUND_KINDS
        };
        let Some((kernels, others)) = kinds.split_last() else {
            return Err("no activity kind to enable".into());
        };
        for kind in others {
            cupti::enable(*kind)?;
        }
        if !fresh {
            detach::subscribe_for_capture(&gate);
        }
        if capture {
            self.record_api_calls(session, !early)?;
        } else {
            self.stop_api_calls(session)?;
        }
        cupti::enable(*kernels)?;
        self.background = !capture;
        drop(gate);
        let recording_ns = devtrace_shm::clock::now_ns();
        self.count_launches_from(session, recording_ns);
        // The stream is ours again once kernels are recorded: a CUPTI
        // attached afresh (another user finalized it) takes its first
        // enable's time (0.1-0.3 s on an H100), lost with the other user's.
        if std::mem::take(&mut self.displaced) {
            session.write_meta(&MetaRecord::Resumed {
                at_ns: recording_ns,
            });
        }
        session.write_meta(&MetaRecord::Recording {
            at_ns: recording_ns,
        });
        self.stream = Stream::Ours;
        self.last_flush = Some(Instant::now());
        Ok(())
    }

    /// Records the API calls the agent asks for the cheapest way there is:
    /// the timeline's are timed by the capture's subscriber while it is
    /// ours ([`timed_calls`]), else recorded by CUPTI, as are every call's
    /// when asked. With `reselect`, CUPTI's selection of the timeline's calls
    /// is made again (another user may have changed it while it had the
    /// stream). The caller holds the gate.
    fn record_api_calls(&mut self, session: &Session, reselect: bool) -> Result<(), String> {
        if self.time_api_calls() {
            if let Some(set) = self.api.take() {
                cupti::api_calls::disable(set)?;
            }
            if !timed_calls::on() {
                self.kernels_at_timing = converted(session, Converter::kernels_converted);
                timed_calls::start();
                session.write_meta(&MetaRecord::ApiRecords {
                    at_ns: devtrace_shm::clock::now_ns(),
                    set: ApiRecordSet::TimelineTimed,
                });
            }
            return Ok(());
        }
        if reselect {
            self.api = self.api.filter(|set| *set != ApiRecordSet::Timeline);
        }
        // CUPTI's records first: a call recorded twice at the switch is
        // better than one recorded by neither.
        self.switch_api(session, self.api)?;
        self.end_timing(session, devtrace_shm::clock::now_ns());
        Ok(())
    }

    /// Whether the subscriber times the timeline's calls now: the agent asks
    /// for them alone, and the subscriber is ours and called.
    fn time_api_calls(&self) -> bool {
        self.may_time && !self.all_api && !self.cupti_api && detach::subscribed()
    }

    /// Stops recording API calls, both ways. The caller holds the gate.
    fn stop_api_calls(&mut self, session: &Session) -> Result<(), String> {
        self.end_timing(session, devtrace_shm::clock::now_ns());
        if let Some(set) = self.api.take() {
            cupti::api_calls::disable(set)?;
        }
        Ok(())
    }

    /// Stops timing the timeline's calls at `to_ns`; when the subscriber
    /// had gone meanwhile (to another CUPTI user, or with its finalize),
    /// says from when to then the calls are missing.
    fn end_timing(&self, session: &Session, to_ns: u64) {
        if timed_calls::stop() && !detach::subscribed() {
            let from_ns = detach::given_away_at_ns().unwrap_or(to_ns).min(to_ns);
            session.write_meta(&MetaRecord::Untimed {
                from_ns,
                to_ns,
                cause: UntimedCause::Taken,
            });
        }
    }

    /// Whether CUPTI has not called the subscriber in the second since
    /// timing started while kernels were recorded: it times nothing, so
    /// timing stops for this capture and CUPTI's records are to take over;
    /// answers since when the calls are missing. The caller made a call of
    /// its own first ([`driver::poke`]), so that a job waiting in one long
    /// call is not taken for a silent CUPTI.
    fn timing_silent(&mut self, session: &Session) -> Option<u64> {
        let started = timed_calls::started_at_ns();
        let now = devtrace_shm::clock::now_ns();
        if !timed_calls::on()
            || timed_calls::called()
            || now.saturating_sub(started) < SILENCE_LIMIT_NS
            || converted(session, Converter::kernels_converted) == self.kernels_at_timing
        {
            return None;
        }
        timed_calls::stop();
        self.may_time = false;
        Some(started)
    }

    /// Whether CUPTI wrote no record of the timeline's calls selected one
    /// by one, while it recorded a kernel that started a second after the
    /// selection, so was launched after it (so it was on CUPTI 13.0 on an
    /// H200: not one of 128,608 kernels had its launch's record); answers
    /// since when the calls are missing. One record seen ends the watch.
    fn selection_silent(&mut self, session: &Session) -> Option<u64> {
        let selected = self.selected?;
        if self.api != Some(ApiRecordSet::Timeline) {
            return None;
        }
        if converted(session, Converter::api_records_converted) != selected.api_records {
            self.selected = None;
            return None;
        }
        let latest_kernel_ns = converted(session, Converter::latest_kernel_ns);
        if latest_kernel_ns < selected.at_ns.saturating_add(SILENCE_LIMIT_NS) {
            return None;
        }
        self.selected = None;
        self.selection_ignored = true;
        Some(selected.at_ns)
    }

    /// Enables the API records the agent asks for, from `current`, and
    /// tells the agent which (and, once, why not the timeline's alone).
    /// The caller holds the gate.
    fn switch_api(
        &mut self,
        session: &Session,
        current: Option<ApiRecordSet>,
    ) -> Result<(), String> {
        let (set, unselectable) =
            cupti::api_calls::switch(current, self.all_api, self.selection_ignored)?;
        self.selected = match set {
            ApiRecordSet::Timeline if current == Some(ApiRecordSet::Timeline) => self.selected,
            ApiRecordSet::Timeline => Some(Selected {
                at_ns: devtrace_shm::clock::now_ns(),
                api_records: converted(session, Converter::api_records_converted),
            }),
            _ => None,
        };
        if let Some(why) = unselectable.filter(|_| !self.unselectable_told) {
            self.unselectable_told = true;
            say!("devtrace-inject: {why}");
            session.write_meta(&MetaRecord::Warning { message: why });
        }
        session.write_meta(&MetaRecord::ApiRecords {
            at_ns: devtrace_shm::clock::now_ns(),
            set,
        });
        self.api = Some(set);
        Ok(())
    }

    /// While capturing: follows the API records asked for, sees whether a
    /// user seen through interposition took the stream, and flushes.
    fn keep(&mut self, session: &Session) -> Result<(), String> {
        if let Some(since_ns) = coexist::foreign_holder() {
            // A profiler that subscribes first (Kineto, XLA's tracer) took
            // the subscriber a moment before the stream: the calls between
            // are missing too (said by `displaced_at`).
            self.displaced_at(session, true, since_ns);
            return Ok(());
        }
        if timed_calls::on() && !timed_calls::called() {
            // An API call of our own, without the gate: whether CUPTI calls
            // the subscriber at all.
            driver::poke();
        }
        let all_now = matches!(
            self.api,
            Some(ApiRecordSet::All | ApiRecordSet::AllUnselectable)
        );
        let gate = detach::gate();
        if *gate != Attachment::Attached {
            // Another user finalized CUPTI: nothing of ours is on.
            self.end_timing(session, devtrace_shm::clock::now_ns());
            return Ok(());
        }
        let silent_since = self.timing_silent(session);
        let unselected_since = self.selection_silent(session);
        let timed = timed_calls::on();
        // Either the subscriber times the calls, or CUPTI records the set
        // asked for: never both, never neither.
        let switch = if self.background {
            // No API calls are recorded for the GPU's past.
            false
        } else if self.time_api_calls() {
            !timed
        } else {
            timed
                || self.api.is_none()
                || unselected_since.is_some()
                || (self.all_api != all_now && self.api != Some(ApiRecordSet::AllUnselectable))
        };
        if switch {
            self.record_api_calls(session, false)?;
        }
        if let Some(from_ns) = silent_since {
            // Once CUPTI's records are on.
            session.write_meta(&MetaRecord::Untimed {
                from_ns,
                to_ns: devtrace_shm::clock::now_ns(),
                cause: UntimedCause::Silent,
            });
        }
        if let Some(from_ns) = unselected_since {
            // Once every call is recorded.
            say!(
                "devtrace-inject: CUPTI recorded none of the API calls selected one by one while \
                 it recorded kernels; whenever CUPTI records the calls from now on, it records \
                 every driver and runtime API call"
            );
            session.write_meta(&MetaRecord::Untimed {
                from_ns,
                to_ns: devtrace_shm::clock::now_ns(),
                cause: UntimedCause::Unselected,
            });
        }
        if self
            .last_flush
            .is_some_and(|last| last.elapsed() < FLUSH_EVERY)
        {
            return Ok(());
        }
        self.last_flush = Some(Instant::now());
        // Not forced: a forced flush while kernels run loses their records.
        flush(session, false)
    }

    /// A capture starts while the GPU's past is recorded: the other kinds
    /// and the API records go on for it.
    fn widen(&mut self, session: &Session) -> Result<(), String> {
        let gate = detach::gate();
        if *gate != Attachment::Attached {
            return Ok(());
        }
        self.may_time = detach::subscribed();
        // The calls first: kernels are recorded already.
        self.record_api_calls(session, false)?;
        for kind in capture_only_kinds() {
            cupti::enable(kind)?;
        }
        self.background = false;
        drop(gate);
        let recording_ns = devtrace_shm::clock::now_ns();
        self.count_launches_from(session, recording_ns);
        session.write_meta(&MetaRecord::Recording {
            at_ns: recording_ns,
        });
        Ok(())
    }

    /// A capture ends while the GPU's past is still asked for: back to the
    /// [`BACKGROUND_KINDS`]. The records of the capture's last moments
    /// arrive with the next flushes, as the kernels go on being recorded.
    fn narrow(&mut self, session: &Session) -> Result<(), String> {
        let gate = detach::gate();
        if *gate != Attachment::Attached {
            return Ok(());
        }
        for kind in capture_only_kinds() {
            if !coexist::other_enabled(kind) {
                cupti::disable(kind)?;
            }
        }
        self.stop_api_calls(session)?;
        self.background = true;
        // Under the gate, as every CUPTI call of the library: another user's
        // finalize must not run beside it (or attach CUPTI again after it).
        flush(session, false)?;
        drop(gate);
        timed_calls::deliver(session, true);
        self.hand_back(session)?;
        // Kernels go on being recorded: work that has not come back yet is
        // no evidence here.
        tell_unanswered(session, None);
        Ok(())
    }

    /// While the GPU's past is recorded, gets back the records CUPTI holds
    /// (the window that just ended needs its last ones). Kernels go on
    /// being recorded into the same buffers, so on a busy GPU a flush that
    /// is not forced may never hand the one being filled back: once the
    /// work launched so far had its time to end, CUPTI is forced, and the
    /// work still running then comes back unfinished (told).
    fn hand_back(&mut self, session: &Session) -> Result<(), String> {
        // An ask of the agent's that comes while this runs gets another.
        let asked = session.ring.control().generation;
        let settled = let_launched_work_end(session)?;
        let forced = !settled && {
            let gate = detach::gate();
            // Not forced from under a profiler that took the stream (its
            // own buffers would come back, its running work unfinished).
            let forced = *gate == Attachment::Attached && coexist::foreign_holder().is_none();
            if forced {
                flush(session, true)?;
            }
            forced
        };
        if forced {
            wait_for_buffers(RETURN_WAIT);
        }
        if crate::debug_enabled() {
            say!(
                "devtrace-inject: records handed back{}; {} of the library's buffers still with \
                 CUPTI",
                if forced { ", forced" } else { "" },
                buffers::out()
            );
        }
        // The agent's asks for them until this began are answered.
        self.generation = Some(asked);
        Ok(())
    }

    /// The capture's kernels are recorded from `recording_ns`: its launches
    /// are checked from then on ([`crate::unanswered`]). A check still
    /// waiting for the last capture's buffers is given up (they come back
    /// into this one).
    fn count_launches_from(&mut self, session: &Session, recording_ns: u64) {
        self.unanswered_ended_ns = None;
        if let Ok(mut converter) = session.converter.lock() {
            converter.unanswered.begin(recording_ns);
        }
    }

    fn displaced_at(&mut self, session: &Session, seen: bool, at_ns: u64) {
        // The other user gets the kernels: launches timed meanwhile would
        // have none. Those timed so far belong to this capture.
        self.end_timing(session, at_ns);
        timed_calls::deliver(session, true);
        // Their work still running goes to the other user, in the span
        // the trace names.
        tell_unanswered(session, None);
        self.stream = Stream::Taken { seen };
        self.displaced = true;
        session.write_meta(&MetaRecord::Displaced { at_ns, seen });
    }

    /// Ends a capture: switches every kind and API record off, takes the
    /// buffers back, and starts detaching CUPTI.
    fn stop(&mut self, session: &Session) -> Result<(), String> {
        self.stream = Stream::Off;
        self.background = false;
        {
            let gate = detach::gate();
            if *gate != Attachment::Attached {
                // Another user finalized CUPTI: nothing of ours is on.
                self.end_timing(session, devtrace_shm::clock::now_ns());
                timed_calls::deliver(session, true);
                tell_unanswered(session, None);
                return Ok(());
            }
            // The teardown's kind counts as on whatever fails after it
            // was enabled, so that giving up switches it off.
            let switched = self.switch_off_all_but(session, Some(KEEPER_KIND));
            self.keeper_on = true;
            switched?;
            flush(session, false)?;
        }
        let_launched_work_end(session)?;
        {
            let gate = detach::gate();
            if *gate != Attachment::Attached {
                // Another user finalized CUPTI meanwhile.
                drop(gate);
                timed_calls::deliver(session, true);
                tell_unanswered(session, None);
                return Ok(());
            }
            // A profiler that took the stream meanwhile got our buffers
            // back through its registration; forcing now would force its
            // own out, its running work unfinished.
            let forced = coexist::foreign_holder().is_none();
            flush(session, forced)?;
            if !forced {
                timed_calls::deliver(session, true);
            }
        }
        let waited = Instant::now();
        wait_for_buffers(RETURN_WAIT);
        // CUDA 13's CUPTI hands a thread's partly filled buffer back only
        // as it is detached: the launches are checked once every buffer is
        // back.
        let ended_ns = devtrace_shm::clock::now_ns();
        if buffers::out() == 0 {
            tell_unanswered(session, Some(ended_ns));
        } else {
            self.unanswered_ended_ns = Some(ended_ns);
        }
        if crate::debug_enabled() {
            say!(
                "devtrace-inject: capture stopped; {} of the library's buffers still with CUPTI \
                 after {} ms",
                buffers::out(),
                waited.elapsed().as_millis()
            );
        }
        // Libraries loaded during the capture, before CUPTI may be finalized
        // for want of seeing their calls.
        coexist::redirect_callers();
        self.detach_when_alone(session);
        Ok(())
    }

    /// Detaches CUPTI while no capture runs, unless another CUPTI user may
    /// need it (said once, with the evidence).
    fn detach_when_alone(&mut self, session: &Session) {
        if *detach::gate() != Attachment::Attached {
            // The callback finalized since the last tick (or another user
            // did, or the process is exiting).
            self.end_teardown(session);
            return;
        }
        if let Some(why) = coexist::other_user_active() {
            self.end_teardown(session);
            self.switch_keeper_off();
            self.tell_unanswered_kept_attached(session);
            if coexist::unseen_user() {
                // Never detached again: ours would only block its subscriber.
                detach::release_subscriber();
            }
            self.tell_kept_attached(
                session,
                format!("because {why}; it is detached once that user is done"),
            );
            return;
        }
        if self
            .next_detach_try
            .is_some_and(|next| Instant::now() < next)
        {
            return;
        }
        let teardown = self.teardown.get_or_insert_with(Teardown::new);
        match teardown.step() {
            Progress::Waiting => {
                // The job may make no CUDA call for a long while: a call of
                // the library's own is an exit site to finalize at.
                driver::poke();
                if teardown.finalized() {
                    self.end_teardown(session);
                }
            }
            Progress::Detached => self.end_teardown(session),
            Progress::Refused(why) => {
                if crate::debug_enabled() {
                    say!("devtrace-inject: CUPTI stays attached: {why}");
                }
                self.tell_unanswered_kept_attached(session);
                self.teardown = None;
                self.switch_keeper_off();
                self.next_detach_try = Some(Instant::now() + detach::RETRY_EVERY);
                self.tell_kept_attached(
                    session,
                    format!("because {why} (detaching is tried again every second)"),
                );
            }
        }
    }

    /// CUPTI stays attached after a capture whose launches wait for
    /// buffers still out, which no detach will bring back now. A user seen
    /// through the library has its span in the trace; one that cannot be
    /// seen took them, as far as the evidence goes, and the launches are
    /// told with what came back.
    fn tell_unanswered_kept_attached(&mut self, session: &Session) {
        if let Some(ended_ns) = self.unanswered_ended_ns.take() {
            tell_unanswered(session, coexist::unseen_user().then_some(ended_ns));
        }
    }

    /// Ends the teardown under way, if any (disarming its subscriber), and
    /// tells of the finalize it saw, if it saw one since the last tick. The
    /// caller does not hold the gate.
    fn end_teardown(&mut self, session: &Session) {
        if let Some(mut teardown) = self.teardown.take() {
            // A finalize the subscriber began before the disarm is waited
            // for: one untold would leave the buffers it took as lent, and
            // a capture starting now would attach CUPTI again unaware.
            teardown.disarm_and_settle();
            if teardown.finalized() {
                self.detached(session, &teardown);
            }
        }
    }

    /// After a teardown finalized CUPTI: tells the agent, and gives up the
    /// buffers CUPTI did not hand back.
    fn detached(&mut self, session: &Session, teardown: &Teardown) {
        if crate::debug_enabled() {
            say!(
                "devtrace-inject: CUPTI detached {} ms after the teardown began",
                teardown.age().as_millis()
            );
        }
        self.api = None;
        self.keeper_on = false;
        session.write_meta(&MetaRecord::Detached {
            at_ns: devtrace_shm::clock::now_ns(),
        });
        let unreturned = buffers::give_up_unreturned();
        if let Some(ended_ns) = self.unanswered_ended_ns.take() {
            tell_unanswered(session, Some(ended_ns));
        }
        if unreturned > 0 {
            session.write_meta(&MetaRecord::Warning {
                message: format!(
                    "CUPTI was detached without handing back {unreturned} of the \
                     library's activity buffers ({} in all so far): they went to another \
                     CUPTI user's callback, the records in them are lost, and their memory \
                     is left to that user",
                    buffers::unreturned_total()
                ),
            });
        }
    }

    /// The teardown stands down: the kind kept on for it goes off (unless
    /// another user enabled it too).
    fn switch_keeper_off(&mut self) {
        if !std::mem::take(&mut self.keeper_on) {
            return;
        }
        let gate = detach::gate();
        if *gate == Attachment::Attached && !coexist::other_enabled(KEEPER_KIND) {
            let _ = cupti::disable(KEEPER_KIND);
        }
    }

    /// Says once per capture why CUPTI stays attached after it.
    fn tell_kept_attached(&mut self, session: &Session, why: String) {
        if self.kept_attached_told {
            return;
        }
        self.kept_attached_told = true;
        session.write_meta(&MetaRecord::Warning {
            message: format!(
                "CUPTI stays attached after the capture, at a cost on every CUDA call, {why}"
            ),
        });
    }

    /// After a failure: leaves CUPTI as the process needs it.
    /// After the library went quiet: ends what it had on as a capture's
    /// end does, and detaches CUPTI, for as long as [`STAND_DOWN_LIMIT`]
    /// from `since` allows (a job left attached pays for CUPTI's hooks on
    /// every CUDA call for the rest of its life). Errors on the way do not
    /// stop it: each step is tried. True once nothing is left to do.
    fn stand_down(&mut self, session: &Session, since: Instant) -> bool {
        if crate::forked() {
            // A forked child never calls CUPTI.
            return true;
        }
        self.end_timing(session, devtrace_shm::clock::now_ns());
        match self.stream {
            // `stop` leaves the stream off, and the kind the teardown needs
            // on, even when a step of it fails.
            Stream::Ours => {
                let _ = self.stop(session);
            }
            Stream::Taken { .. } | Stream::Off => {
                self.stream = Stream::Off;
                self.detach_when_alone(session);
            }
        }
        let detached = *detach::gate() != Attachment::Attached;
        let kept_for_another = self.teardown.is_none() && coexist::other_user_active().is_some();
        if detached || kept_for_another || since.elapsed() >= STAND_DOWN_LIMIT {
            self.give_up(session);
            return true;
        }
        false
    }

    fn give_up(&mut self, session: &Session) {
        self.end_timing(session, devtrace_shm::clock::now_ns());
        let gate = detach::gate();
        if (self.stream == Stream::Ours || self.keeper_on) && *gate == Attachment::Attached {
            let _ = self.disable(session);
        }
        self.keeper_on = false;
        self.stream = Stream::Off;
    }

    /// Disables every kind and the API records, then flushes what CUPTI
    /// holds; the clock is measured again so that records converted from
    /// here on use the stop reading. The caller holds the gate.
    fn disable(&mut self, session: &Session) -> Result<(), String> {
        self.disable_all_but(session, None)
    }

    /// As [`Tracer::disable`], leaving `kept` on. The caller holds the gate.
    fn disable_all_but(&mut self, session: &Session, kept: Option<u32>) -> Result<(), String> {
        self.switch_off_all_but(session, kept)?;
        flush(session, true)
    }

    /// Disables the API records, then every kind but `kept`. The caller
    /// holds the gate.
    fn switch_off_all_but(&mut self, session: &Session, kept: Option<u32>) -> Result<(), String> {
        // Calls first: a launch timed after its kernels went off would
        // wait at the end of the capture for a kernel record never made.
        self.stop_api_calls(session)?;
        let on = cupti::KINDS.into_iter().rev();
        for kind in on.filter(|kind| Some(*kind) != kept) {
            cupti::disable(kind)?;
        }
        Ok(())
    }
}

/// Kernel records converted so far.
/// What `read` answers of the session's converter (0 when a panic left
/// its lock poisoned).
fn converted(session: &Session, read: fn(&Converter) -> u64) -> u64 {
    session
        .converter
        .lock()
        .map_or(0, |converter| read(&converter))
}

fn set_clock(session: &Session) -> Result<(), String> {
    let clock = ClockMap::measure()?;
    if let Ok(mut converter) = session.converter.lock() {
        converter.clock = clock;
    }
    Ok(())
}

/// Tells the agent of the capture's launches whose GPU work never came
/// back ([`crate::unanswered`]) when it ended at `ended_ns` with every
/// record in (`None`: the evidence is not complete, the capture's launches
/// are only forgotten).
fn tell_unanswered(session: &Session, ended_ns: Option<u64>) {
    let Ok(mut converter) = session.converter.lock() else {
        return;
    };
    let lost = match ended_ns {
        Some(ended_ns) => converter.unanswered.take_lost(ended_ns),
        None => {
            converter.unanswered.forget();
            None
        }
    };
    drop(converter);
    if let (Some(lost), Some(to_ns)) = (lost, ended_ns) {
        session.write_meta(&MetaRecord::Unanswered {
            from_ns: lost.from_ns,
            to_ns,
            launches: lost.launches,
        });
    }
}

/// Waits, for up to [`UNFINISHED_WAIT`], for the GPU to finish the work
/// launched before recording stopped or narrowed, asking CUPTI every
/// couple of milliseconds for the buffers whose work has all ended (see
/// [`UNFINISHED_WAIT`]). Answers whether it did: every buffer is back, or
/// the kernel record of every launch of the capture the library timed
/// came back. Without a launch timed (CUPTI records the calls, or none was
/// made), only the buffers tell. A capture asked for meanwhile is not held
/// up: the wait ends unsettled.
fn let_launched_work_end(session: &Session) -> Result<bool, String> {
    let deadline = Instant::now() + UNFINISHED_WAIT;
    loop {
        let settled = session
            .converter
            .lock()
            .ok()
            .and_then(|converter| converter.unanswered.launches_settled())
            == Some(true);
        if buffers::out() == 0 || settled {
            return Ok(true);
        }
        if Instant::now() >= deadline || session.ring.control().capture() {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(2));
        let gate = detach::gate();
        if *gate != Attachment::Attached {
            return Ok(true);
        }
        cupti::flush_all(false)?;
    }
}

/// Waits (up to `limit`) until every buffer of ours is back and converted.
fn wait_for_buffers(limit: Duration) {
    let deadline = Instant::now() + limit;
    while buffers::out() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Asks CUPTI for completed buffers (`forced`: partly filled ones too),
/// counts what it dropped, and hands over the calls the subscriber timed
/// (`forced`: the capture is over, its losses are told and the logs'
/// memory goes). The caller holds the gate.
fn flush(session: &Session, forced: bool) -> Result<(), String> {
    cupti::flush_all(forced)?;
    set_clock(session)?;
    timed_calls::deliver(session, forced);
    count_dropped(session)
}

/// Tells the agent the running total of records CUPTI dropped, when it
/// dropped some since it was last asked. The caller holds the gate.
fn count_dropped(session: &Session) -> Result<(), String> {
    let dropped = cupti::dropped_since_last()?;
    if dropped > 0 {
        let total = session.dropped_total.fetch_add(dropped, Ordering::Relaxed) + dropped;
        session.write_meta(&MetaRecord::Dropped { total });
    }
    Ok(())
}

/// At exit: CUPTI's last buffers are converted, and from then on this
/// library makes no CUPTI call (the process is tearing down, libcupti's
/// own state with it).
extern "C" fn flush_at_exit() {
    ffi::guard("the exit handler", (), || {
        if crate::forked() {
            return;
        }
        crate::EXITING.store(true, Ordering::Release);
        let asked = Instant::now();
        let mut gate = detach::gate();
        let gated = asked.elapsed();
        let attached = *gate == Attachment::Attached;
        *gate = Attachment::Closed;
        let Some(session) = SESSION.get() else { return };
        if quiet() || !attached {
            return;
        }
        // A flush now would hand buffers to that user's callbacks, whose
        // state its own exit handlers and destructors (registered after
        // this one, so run before it) may have freed already.
        if let Some(why) = coexist::other_user_active() {
            // The calls the library timed are its own memory: handed over,
            // named by their ids where CUPTI was not asked their names yet.
            cupti::make_no_more_calls();
            timed_calls::stop();
            timed_calls::deliver(session, true);
            // Reading the buffers CUPTI handed back is a CUPTI call too, and
            // their records point at names CUPTI may have freed by now.
            let pending = session.take_pending();
            let unread = pending.len();
            records::convert_all(session, pending, false);
            let message = format!(
                "the process exited while CUPTI was attached beside another CUPTI user ({why}): \
                 the library made no CUPTI call at exit, so its last GPU activity is missing \
                 (what CUPTI still held, and {unread} buffer(s) handed back but not yet read)"
            );
            session.write_meta(&MetaRecord::Warning { message });
            return;
        }
        // The job's other threads may still be in CUDA calls: recording
        // stops first, so that what is read below is what there was, not
        // what they keep writing while it is read.
        // Counted from the exit's start: waiting for the gate (a buffer
        // being read on the converter thread) is part of what the job waits.
        let read_limit = exit_read_limit();
        let deadline = asked + read_limit;
        for kind in cupti::KINDS.into_iter().rev() {
            let _ = cupti::disable(kind);
        }
        // CUPTI hands the buffers back to our callback, which queues them.
        if cupti::flush_all(true).is_ok() {
            let _ = set_clock(session);
        }
        let flushed = asked.elapsed();
        // What CUPTI dropped since the last flush is told too (a job that
        // lives shorter than the flush period reaches no other flush).
        let _ = count_dropped(session);
        timed_calls::stop();
        timed_calls::deliver(session, true);
        let mut unread = records::convert_pending_until(deadline);
        // Buffers CUPTI hands back on a thread of its own, briefly.
        wait_for_buffers(EXIT_WAIT);
        unread += records::convert_pending_until(deadline + EXIT_WAIT);
        if crate::debug_enabled() {
            say!(
                "devtrace-inject: exit: the gate after {} ms, recording stopped and flushed after \
                 {} ms, read by {} ms, {unread} buffer(s) left unread",
                gated.as_millis(),
                flushed.as_millis(),
                asked.elapsed().as_millis()
            );
        }
        if unread > 0 {
            let message = format!(
                "the process exited with {unread} CUPTI activity buffer(s) not yet read, and \
                 reading them would have held its exit past {} ms: the GPU activity recorded \
                 in them, its last, is missing",
                read_limit.as_millis()
            );
            session.write_meta(&MetaRecord::Warning { message });
        }
        // CUDA 13 hands a thread's partly filled buffer back only when
        // CUPTI is detached, which an exiting process does not live to see
        // (and finalizing from an exit handler, with the job's threads
        // still in CUDA calls, is not safe): what they hold is lost, and
        // said rather than left for the trace to pass over.
        let out = buffers::out();
        if out > 0 {
            let message = format!(
                "the process exited while recording, with {out} of its CUPTI activity buffers \
                 not handed back (CUDA 13 returns a thread's partly filled buffer only when \
                 CUPTI is detached; another profiler's callback may have taken some): the GPU \
                 activity recorded in them, its last, is missing"
            );
            session.write_meta(&MetaRecord::Warning { message });
        }
    });
}
