//! Batched asynchronous existence checks for slow tiers (vLLM `tiering/async_lookup.py`).
//!
//! A tier's `lookup` asks [`AsyncLookup::lookup`]: a resolved key answers at once, an unknown key
//! is registered (once, whatever the number of requests asking) and answers `None` (→ `RETRY`).
//! At the end of the step the tier calls [`AsyncLookup::flush`], which posts the whole step's
//! batch, grouped per request, as one message to a worker thread that runs the tier's
//! `batch_lookup` (a panic there answers `false` for the batch). Results are taken in on the next
//! lookup. `mark_miss` forces `false` after a failed load (vLLM #49176); `cleanup` forgets a
//! finished request's keys unless they are in flight.
//!
//! ```text
//! lookup(k) ─► Pending ──flush──► InFlight ──worker──► Resolved(bool) ─► lookup(k) = Some(bool)
//! ```
//!
//! Ownership: the scheduler thread owns the key table; the worker owns only the batch it was
//! sent and answers through a channel, so no lock is shared.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use hashbrown::{HashMap, HashSet};

use crate::key::OffloadKey;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Pending,
    InFlight,
    Resolved(bool),
}

struct KeyState {
    phase: Phase,
    requests: HashSet<String>,
}

type Batch = Vec<(String, Vec<OffloadKey>)>;

/// The batched existence checker of one tier.
pub struct AsyncLookup {
    keys: HashMap<OffloadKey, KeyState>,
    to_worker: Option<Sender<Batch>>,
    from_worker: Receiver<Vec<(OffloadKey, bool)>>,
    worker: Option<JoinHandle<()>>,
    outstanding: usize,
    /// Batches posted to the worker.
    pub batches_posted: usize,
    /// Keys posted to the worker, over all batches.
    pub keys_posted: usize,
}

impl AsyncLookup {
    /// Starts the worker thread; `batch_lookup(req_id, keys)` answers presence per key.
    pub fn new<F>(batch_lookup: F) -> Self
    where
        F: Fn(&str, &[OffloadKey]) -> Vec<bool> + Send + 'static,
    {
        let (tx, rx) = channel::<Batch>();
        let (rtx, rrx) = channel();
        let worker = std::thread::Builder::new()
            .name("kvbm-async-lookup".into())
            .spawn(move || {
                for batch in rx {
                    let mut out = Vec::new();
                    for (req, keys) in batch {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            batch_lookup(&req, &keys)
                        }));
                        match r {
                            Ok(v) if v.len() == keys.len() => {
                                out.extend(keys.iter().copied().zip(v))
                            }
                            _ => out.extend(keys.iter().map(|k| (*k, false))),
                        }
                    }
                    if rtx.send(out).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn async lookup worker");
        Self {
            keys: HashMap::new(),
            to_worker: Some(tx),
            from_worker: rrx,
            worker: Some(worker),
            outstanding: 0,
            batches_posted: 0,
            keys_posted: 0,
        }
    }

    fn apply(&mut self, results: Vec<(OffloadKey, bool)>) {
        self.outstanding -= 1;
        for (k, v) in results {
            if let Some(s) = self.keys.get_mut(&k)
                && s.phase == Phase::InFlight
            {
                s.phase = Phase::Resolved(v);
            }
        }
    }

    fn drain(&mut self) {
        while let Ok(r) = self.from_worker.try_recv() {
            self.apply(r);
        }
    }

    /// The cached answer, or `None` after registering the key for the next flush.
    pub fn lookup(&mut self, key: &OffloadKey, req_id: &str) -> Option<bool> {
        if self.outstanding > 0 {
            self.drain();
        }
        match self.keys.get_mut(key) {
            Some(s) => {
                if let Phase::Resolved(v) = s.phase {
                    return Some(v);
                }
                if !s.requests.contains(req_id) {
                    s.requests.insert(req_id.to_string());
                }
                None
            }
            None => {
                let mut requests = HashSet::new();
                requests.insert(req_id.to_string());
                self.keys.insert(
                    *key,
                    KeyState {
                        phase: Phase::Pending,
                        requests,
                    },
                );
                None
            }
        }
    }

    /// Posts every pending key as one batch (grouped per request); posts nothing when none.
    pub fn flush(&mut self) {
        let mut groups: BTreeMap<String, Vec<OffloadKey>> = BTreeMap::new();
        for (k, s) in self.keys.iter_mut() {
            if s.phase != Phase::Pending {
                continue;
            }
            s.phase = Phase::InFlight;
            let req = s.requests.iter().min().cloned().unwrap_or_default();
            groups.entry(req).or_default().push(*k);
        }
        if groups.is_empty() {
            return;
        }
        let batch: Batch = groups.into_iter().collect();
        self.batches_posted += 1;
        self.keys_posted += batch.iter().map(|(_, v)| v.len()).sum::<usize>();
        self.outstanding += 1;
        if let Some(tx) = &self.to_worker
            && tx.send(batch).is_err()
        {
            self.outstanding -= 1;
        }
    }

    /// Blocks until every posted batch is answered and applied.
    pub fn wait_idle(&mut self) {
        while self.outstanding > 0 {
            match self.from_worker.recv() {
                Ok(r) => self.apply(r),
                Err(_) => break,
            }
        }
    }

    /// Forces `false` for keys (after a failed load).
    pub fn mark_miss(&mut self, keys: &[OffloadKey]) {
        for k in keys {
            if let Some(s) = self.keys.get_mut(k) {
                s.phase = Phase::Resolved(false);
            }
        }
    }

    /// Forgets `req_id`; keys left without requests are dropped unless in flight.
    pub fn cleanup(&mut self, req_id: &str) {
        self.keys.retain(|_, s| {
            s.requests.remove(req_id);
            !s.requests.is_empty() || s.phase == Phase::InFlight
        });
    }

    /// Whether a key is tracked.
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.keys.contains_key(key)
    }

    /// Whether the worker thread is running.
    pub fn worker_alive(&self) -> bool {
        self.worker.as_ref().is_some_and(|w| !w.is_finished())
    }

    /// Stops the worker thread (idempotent).
    pub fn shutdown(&mut self) {
        self.to_worker = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for AsyncLookup {
    fn drop(&mut self) {
        self.shutdown();
    }
}
