//! The collector: the single consumer of every ring. A dedicated thread drains
//! the rings every tick, seals what it read into chunks of the store, and logs
//! drops with the time it noticed them. A capture calls [`Collector::flush`]
//! when its window closes so that everything pushed before then is queryable.
//!
//! Once the rings stay empty it sleeps: a push rings the ring's doorbell,
//! which sends the thread a wake-up, so an idle agent does not poll. Rings
//! with producers in other processes cannot ring; while one is attached the
//! collector keeps polling at the idle tick.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::clock;
use crate::event::Event;
use crate::recorder::{DropRecord, Store};
use crate::ring::{Consumer, Ring, RingError};

/// How often the rings are drained while events flow.
const TICK: Duration = Duration::from_millis(2);
/// The longest pause between drains of idle rings. Bounded so that a burst
/// after a quiet spell fits in a lane (20 ms at 1 M events/s is 20 k events,
/// well under the default 64 Ki slots); a flush never waits for it.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// The longest sleep while every ring can wake the collector: a safety net
/// for the rare push that races with falling asleep (`ring/doorbell.rs`).
const ASLEEP_TICK: Duration = Duration::from_secs(1);
/// A partly filled chunk is sealed at least this often.
const SEAL_EVERY: Duration = Duration::from_millis(100);

enum Command {
    Attach(Consumer),
    Flush(oneshot::Sender<()>),
    /// A producer pushed into a ring while the collector slept.
    Wake,
    Stop,
}

#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    #[error("cannot attach ring: {0}")]
    Ring(#[from] RingError),
    #[error("the collector thread has stopped")]
    Stopped,
    #[error("cannot start the collector thread: {0}")]
    Spawn(std::io::Error),
}

/// Handle to the collector thread; stopping it drains once more.
pub struct Collector {
    commands: mpsc::Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

impl Collector {
    pub fn start(store: Arc<Store>) -> Result<Collector, CollectorError> {
        Collector::start_sleeping_at_most(store, ASLEEP_TICK)
    }

    /// Starts a collector whose sleeps on waking rings last at most
    /// `longest_sleep`.
    fn start_sleeping_at_most(
        store: Arc<Store>,
        longest_sleep: Duration,
    ) -> Result<Collector, CollectorError> {
        let (commands, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("devtrace-collect".into())
            .spawn(move || Worker::new(store, longest_sleep).run(receiver))
            .map_err(CollectorError::Spawn)?;
        Ok(Collector {
            commands,
            thread: Some(thread),
        })
    }

    /// Starts draining `ring`; the collector becomes its only consumer.
    pub fn attach(&self, ring: &Arc<Ring>) -> Result<(), CollectorError> {
        let consumer = ring.consumer()?;
        let wake = self.commands.clone();
        ring.doorbell().set_waker(move || {
            // Fails only once the collector has stopped.
            let _ = wake.send(Command::Wake);
        });
        self.commands
            .send(Command::Attach(consumer))
            .map_err(|_| CollectorError::Stopped)
    }

    /// Returns once every event pushed before the call is in the store.
    pub async fn flush(&self) -> Result<(), CollectorError> {
        let (done, wait) = oneshot::channel();
        self.commands
            .send(Command::Flush(done))
            .map_err(|_| CollectorError::Stopped)?;
        wait.await.map_err(|_| CollectorError::Stopped)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Worker {
    store: Arc<Store>,
    consumers: Vec<Consumer>,
    pending: Vec<Event>,
    /// Events sealed into one chunk ([`Store::events_per_chunk`]).
    chunk_events: usize,
    last_seal: Instant,
    /// Current pause between drains: short while events flow, doubling up
    /// to `IDLE_TICK` while the rings stay empty.
    tick: Duration,
    /// Asleep until a doorbell rings, a command comes, or `longest_sleep`.
    asleep: bool,
    longest_sleep: Duration,
}

impl Worker {
    fn new(store: Arc<Store>, longest_sleep: Duration) -> Worker {
        Worker {
            chunk_events: store.events_per_chunk(),
            store,
            consumers: Vec::new(),
            pending: Vec::new(),
            last_seal: Instant::now(),
            tick: TICK,
            asleep: false,
            longest_sleep,
        }
    }

    fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            let pause = if self.asleep {
                self.longest_sleep
            } else {
                self.tick
            };
            let command = commands.recv_timeout(pause);
            if self.asleep {
                self.wake_up();
            }
            match command {
                Ok(Command::Attach(consumer)) => self.consumers.push(consumer),
                Ok(Command::Flush(done)) => {
                    self.drain_all();
                    self.seal();
                    let _ = done.send(());
                }
                Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    self.drain_all();
                    self.seal();
                    return;
                }
                Ok(Command::Wake) => {
                    self.tick = TICK;
                    self.tick();
                }
                Err(RecvTimeoutError::Timeout) => self.tick(),
            }
        }
    }

    /// One scheduled drain: the pause shrinks while events flow, doubles
    /// while the rings are empty, and ends in sleep after an empty drain at
    /// the idle tick.
    fn tick(&mut self) {
        if self.drain_all() > 0 {
            self.tick = TICK;
        } else if self.tick < IDLE_TICK {
            self.tick = (self.tick * 2).min(IDLE_TICK);
        } else {
            self.fall_asleep();
        }
        if self.last_seal.elapsed() >= SEAL_EVERY {
            self.seal();
        }
    }

    /// Sleeps on the doorbells when every ring has one. The rings are
    /// drained once more after the marks are set, so a push that did not see
    /// a mark is read now.
    fn fall_asleep(&mut self) {
        let rings_wake = self
            .consumers
            .iter()
            .all(|consumer| consumer.ring().wakes_its_consumer());
        if !rings_wake {
            return;
        }
        // Nothing waits in `pending` through a long sleep.
        self.seal();
        for consumer in &self.consumers {
            consumer.ring().doorbell().sleep();
        }
        if self.drain_all() > 0 {
            self.wake_up();
            self.tick = TICK;
        } else {
            self.asleep = true;
        }
    }

    fn wake_up(&mut self) {
        for consumer in &self.consumers {
            consumer.ring().doorbell().awake();
        }
        self.asleep = false;
    }

    /// Reads every ring until all are empty; returns how many events it read.
    fn drain_all(&mut self) -> u64 {
        let mut total = 0;
        loop {
            let mut read = 0;
            let mut dropped = DropRecord {
                at_ns: clock::now_ns(),
                newest: 0,
                oldest: 0,
            };
            for consumer in &mut self.consumers {
                let room = self.chunk_events.saturating_sub(self.pending.len());
                let report = consumer.drain(&mut self.pending, room);
                read += report.events;
                dropped.newest += report.dropped_newest;
                dropped.oldest += report.dropped_oldest;
                if self.pending.len() >= self.chunk_events {
                    seal(&self.store, &mut self.pending);
                    self.last_seal = Instant::now();
                }
            }
            self.store.record_drops(dropped);
            total += read;
            if read == 0 {
                return total;
            }
        }
    }

    fn seal(&mut self) {
        self.last_seal = Instant::now();
        seal(&self.store, &mut self.pending);
    }
}

/// Moves `pending` into the store as one chunk; `pending` keeps its
/// memory for the next one.
fn seal(store: &Store, pending: &mut Vec<Event>) {
    if pending.is_empty() {
        return;
    }
    store.append(pending);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Device, NameId, Payload};
    use crate::recorder::{StoreConfig, Window};
    use crate::ring::DropPolicy;

    fn event(start_ns: u64) -> Event {
        Event::new(start_ns, 1, Device::Host, 1, NameId(1), Payload::Plain)
    }

    #[tokio::test]
    async fn a_flush_makes_every_pushed_event_and_drop_queryable() {
        let store = Arc::new(Store::new(StoreConfig::default()));
        let collector = Collector::start(Arc::clone(&store)).unwrap();
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        collector.attach(&ring).unwrap();
        // Let the collector go idle first: a flush must not wait for its tick.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = clock::now_ns();
        let mut producer = ring.producer().unwrap();
        let accepted = (0..20).filter(|i| producer.push(&event(now + i))).count();
        // A lane holds 8; the collector, woken by the first push, may have
        // drained some of them before the last push on a busy machine.
        assert!(accepted >= 8, "{accepted} accepted");
        collector.flush().await.unwrap();
        let data = store.query(Window {
            start_ns: now,
            stop_ns: clock::now_ns() + 1,
        });
        assert_eq!(data.events().count(), accepted);
        assert_eq!(data.dropped_newest, 20 - accepted as u64);
    }

    #[tokio::test]
    async fn a_push_wakes_a_sleeping_collector_without_a_flush() {
        let store = Arc::new(Store::new(StoreConfig::default()));
        // Without the doorbell these events would wait for an hour.
        let collector =
            Collector::start_sleeping_at_most(Arc::clone(&store), Duration::from_secs(3600))
                .unwrap();
        let ring = Ring::new(1, 1024, DropPolicy::DropNewest).unwrap();
        collector.attach(&ring).unwrap();
        let mut producer = ring.producer().unwrap();
        let start = clock::now_ns();
        for round in 1..=3u64 {
            while !ring.doorbell().is_asleep() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for i in 0..100 {
                assert!(producer.push(&event(start + round * 1000 + i)));
            }
            let stored = || {
                store
                    .query(Window {
                        start_ns: start,
                        stop_ns: start + 10_000,
                    })
                    .events()
                    .count()
            };
            // Only a guard against hanging when the wake-up is lost.
            let arrived = tokio::time::timeout(Duration::from_secs(60), async {
                while stored() < (round * 100) as usize {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert!(
                arrived.is_ok(),
                "round {round}: the push did not wake the collector"
            );
            assert_eq!(stored(), (round * 100) as usize);
        }
        // A burst larger than the lane after the collector fell asleep: every
        // event is either stored or counted as dropped.
        while !ring.doorbell().is_asleep() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let burst = 5000;
        let accepted = (0..burst)
            .filter(|i| producer.push(&event(start + 5000 + i)))
            .count();
        collector.flush().await.unwrap();
        let data = store.query(Window {
            start_ns: start,
            // Drops are recorded at the time the collector saw them.
            stop_ns: clock::now_ns() + 1,
        });
        assert_eq!(data.events().count(), 300 + accepted);
        assert_eq!(data.dropped_newest as usize, burst as usize - accepted);
    }

    #[tokio::test]
    async fn a_second_consumer_for_a_ring_is_refused() {
        let store = Arc::new(Store::new(StoreConfig::default()));
        let collector = Collector::start(store).unwrap();
        let ring = Ring::new(1, 8, DropPolicy::DropNewest).unwrap();
        collector.attach(&ring).unwrap();
        assert!(matches!(
            collector.attach(&ring),
            Err(CollectorError::Ring(_))
        ));
    }
}
