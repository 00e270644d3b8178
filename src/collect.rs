//! The collector: the single consumer of every ring. A dedicated thread drains
//! the rings every tick, seals what it read into chunks of the store, and logs
//! drops with the time it noticed them. A capture calls [`Collector::flush`]
//! when its window closes so that everything pushed before then is queryable.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::clock;
use crate::event::Event;
use crate::ring::{Consumer, Ring, RingError};
use crate::store::{DropRecord, Store};

/// Events per sealed chunk.
const CHUNK_EVENTS: usize = 1 << 16;
/// How often the rings are drained while events flow.
const TICK: Duration = Duration::from_millis(2);
/// The longest pause between drains of idle rings. Bounded so that a burst
/// after a quiet spell fits in a lane (20 ms at 1 M events/s is 20 k events,
/// well under the default 64 Ki slots); a flush never waits for it.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// A partly filled chunk is sealed at least this often.
const SEAL_EVERY: Duration = Duration::from_millis(100);

enum Command {
    Attach(Consumer),
    Flush(oneshot::Sender<()>),
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
        let (commands, receiver) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("devtrace-collect".into())
            .spawn(move || Worker::new(store).run(receiver))
            .map_err(CollectorError::Spawn)?;
        Ok(Collector {
            commands,
            thread: Some(thread),
        })
    }

    /// Starts draining `ring`; the collector becomes its only consumer.
    pub fn attach(&self, ring: &Arc<Ring>) -> Result<(), CollectorError> {
        let consumer = ring.consumer()?;
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
    last_seal: Instant,
    /// Current pause between drains: short while events flow, doubling up
    /// to `IDLE_TICK` while the rings stay empty.
    tick: Duration,
}

impl Worker {
    fn new(store: Arc<Store>) -> Worker {
        Worker {
            store,
            consumers: Vec::new(),
            pending: Vec::new(),
            last_seal: Instant::now(),
            tick: TICK,
        }
    }

    fn run(mut self, commands: mpsc::Receiver<Command>) {
        loop {
            match commands.recv_timeout(self.tick) {
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
                Err(RecvTimeoutError::Timeout) => {
                    self.tick = if self.drain_all() > 0 {
                        TICK
                    } else {
                        (self.tick * 2).min(IDLE_TICK)
                    };
                    if self.last_seal.elapsed() >= SEAL_EVERY {
                        self.seal();
                    }
                }
            }
        }
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
                let room = CHUNK_EVENTS - self.pending.len();
                let report = consumer.drain(&mut self.pending, room);
                read += report.events;
                dropped.newest += report.dropped_newest;
                dropped.oldest += report.dropped_oldest;
                if self.pending.len() >= CHUNK_EVENTS {
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

/// Moves `pending` into the store as one chunk.
fn seal(store: &Store, pending: &mut Vec<Event>) {
    if pending.is_empty() {
        return;
    }
    let mut batch = std::mem::take(pending);
    // Chunks are accounted by capacity: do not hold slack for long.
    batch.shrink_to_fit();
    store.append(batch);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Device, NameId, Payload};
    use crate::ring::DropPolicy;
    use crate::store::{StoreConfig, Window};

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
        assert_eq!(accepted, 8);
        collector.flush().await.unwrap();
        let data = store.query(Window {
            start_ns: now,
            stop_ns: clock::now_ns() + 1,
        });
        assert_eq!(data.events().count(), 8);
        assert_eq!(data.dropped_newest, 12);
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
