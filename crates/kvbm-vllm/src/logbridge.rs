//! kvbm's Rust log lines, in vLLM's log: a `tracing` subscriber that hands each event at INFO
//! and above to Python's `logging`, as `vllm.kvbm_vllm.<target>` (`kvbm_physical::storage::disk`
//! becomes `vllm.kvbm_vllm.kvbm_physical.storage.disk`), so an O_DIRECT or io_uring fallback
//! in kvbm-physical shows where vLLM's lines do, with vLLM's format and level.
//!
//! # Why a thread
//!
//! An event can come from any thread, at any moment: from an I/O thread, or from a thread that
//! holds a manager's lock that the scheduler thread, attached to the interpreter, is waiting
//! for. Taking the interpreter there could deadlock. So an event is formatted where it happens
//! and sent on a bounded channel (never blocking: when the channel is full the line is dropped
//! and counted); one forwarder thread, which holds no kvbm lock, attaches and logs. The count
//! of dropped lines is logged with the next line that gets through.
//!
//! Installed once per process when the extension loads, only if no other global subscriber
//! was set (an embedding that set its own keeps it).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Lines waiting for the forwarder, at most.
const QUEUE: usize = 1024;

/// The Python logger everything goes under (`kvbm_vllm.log.LOGGER_NAME`).
const ROOT: &str = "vllm.kvbm_vllm";

struct Line {
    level: u8,
    logger: String,
    text: String,
}

struct Bridge {
    tx: SyncSender<Line>,
}

/// Collects an event's message and fields into one line (`message key=value ...`).
struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

/// Python's level number for a tracing level.
fn py_level(l: &Level) -> u8 {
    match *l {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        _ => 10,
    }
}

impl<S: Subscriber> Layer<S> for Bridge {
    fn enabled(&self, metadata: &tracing::Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        *metadata.level() <= Level::INFO
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = Text(String::new());
        event.record(&mut text);
        let line = Line {
            level: py_level(meta.level()),
            logger: format!("{ROOT}.{}", meta.target().replace("::", ".")),
            text: text.0,
        };
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Lines dropped since the last one forwarded (the channel was full).
static DROPPED: AtomicU64 = AtomicU64::new(0);

fn forward(rx: Receiver<Line>) {
    while let Ok(line) = rx.recv() {
        Python::attach(|py| {
            let logging = match py.import("logging") {
                Ok(l) => l,
                Err(_) => return,
            };
            let Ok(logger) = logging.call_method1("getLogger", (line.logger.as_str(),)) else {
                return;
            };
            let dropped = DROPPED.swap(0, Ordering::Relaxed);
            let text = if dropped > 0 {
                format!(
                    "{} ({dropped} earlier kvbm log lines dropped: the log was full)",
                    line.text
                )
            } else {
                line.text
            };
            let _ = logger.call_method1("log", (line.level, text));
        });
    }
}

/// Installs the bridge as the process's global subscriber, unless one is set already.
pub(crate) fn install() {
    let (tx, rx) = sync_channel(QUEUE);
    let bridge = Bridge { tx };
    let subscriber = tracing_subscriber::registry().with(bridge);
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return; // someone else's subscriber: theirs stays
    }
    let spawned = std::thread::Builder::new()
        .name("kvbm-log".into())
        .spawn(move || forward(rx));
    if spawned.is_err() {
        // No forwarder: lines are dropped and counted (never blocking anyone).
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}
