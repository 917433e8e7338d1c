//! [`KvbmRuntime`]: the process-level owner of what the library crates leave to their owner.
//!
//! # Why
//!
//! The crates below never read the environment, never spawn timers of their own and never
//! install a metrics recorder: `kvbm-logical` only flushes a partial event batch when an
//! operation happens or when its owner calls `flush_due_events`. Something has to be that
//! owner. `KvbmRuntime` is it: built once per process from the validated [`KvbmConfig`], it
//! owns (or borrows) the tokio runtime, runs the **event-flush timer** over every registered
//! [`EventSource`], and optionally serves a **Prometheus** `/metrics` endpoint.
//!
//! ```text
//!  KvbmRuntimeBuilder --(config: defaults < file < env < overrides, validated)--> KvbmRuntime
//!        |                                                                          |
//!        | tokio: own a multi-thread runtime, or borrow a Handle                    | owns
//!        v                                                                          v
//!  RuntimeHandle (Clone) -- register_event_source(Arc<dyn EventSource>) --> flush timer task
//!                                                                           prometheus task
//! ```
//!
//! # Event-flush timer
//!
//! One task sleeps until the earliest `next_event_deadline` of its sources, or for at most
//! `events.idle_tick_ms` when none has a partial batch (a manager does not announce a new
//! buffered event, so the timer polls at that period), then calls `flush_due_events(now)` on
//! each. A partial batch is therefore published at most `max_delay_ms + idle_tick_ms` after its
//! oldest event even when its tier is idle. Sources are held weakly: dropping a manager
//! unregisters it.
//!
//! # Metrics endpoint bounds
//!
//! The endpoint is [`crate::metrics::endpoint`] (hyper), the same server `kvbm --metrics-addr`
//! runs: at most `metrics.max_connections` (default 16) open; a connection has
//! `metrics.head_timeout_ms` (2 s) to send its request head and `metrics.read_timeout_ms` (5 s)
//! for the whole exchange ([`MetricsEndpointStats::timed_out`]); connections still waiting for
//! their head are capped per client (`metrics.max_waiting_per_client`, 4), and give way to newer
//! ones ([`MetricsEndpointStats::evicted`]) rather than keeping the endpoint from a scraper; a
//! newcomer finding every slot busy answering is closed ([`MetricsEndpointStats::refused`]).
//!
//! # Shutdown
//!
//! [`KvbmRuntime::shutdown`] is idempotent and orderly: stop the timer and the exporter, flush
//! every live source one last time (no buffered event is lost), then, for an owned runtime,
//! shut it down with `runtime.shutdown_timeout_ms` of grace (in the background when called
//! from inside an async context, where blocking is not allowed). A borrowed runtime is left
//! running. `Drop` calls `shutdown`. After it, [`RuntimeHandle::is_shut_down`] is true and
//! [`RuntimeHandle::spawn`] refuses.
//!
//! # Locks
//!
//! `Inner::sources` (a `parking_lot` mutex) is held only to copy or prune the list, never
//! while a source is flushed; `Inner::runtime` only to take the owned runtime at shutdown.
//! They are never held together.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use kvbm_logical::{BlockManager, Tier};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{ConfigBuilder, KvbmConfig};
use crate::error::{EngineError, Result};

/// Something holding buffered events that its owner must flush on time: in practice a
/// [`BlockManager`] of any tier (implemented here), or a test double.
pub trait EventSource: Send + Sync {
    /// When the buffered partial batch becomes due; `None` when nothing is buffered.
    fn next_event_deadline(&self) -> Option<Instant>;
    /// Flushes the partial batch if it is due at `now`; true when it flushed.
    fn flush_due_events(&self, now: Instant) -> bool;
    /// Flushes whatever is buffered, due or not (at shutdown).
    fn flush_events(&self);
}

impl<T: Tier> EventSource for BlockManager<T> {
    fn next_event_deadline(&self) -> Option<Instant> {
        BlockManager::next_event_deadline(self)
    }
    fn flush_due_events(&self, now: Instant) -> bool {
        BlockManager::flush_due_events(self, now)
    }
    fn flush_events(&self) {
        BlockManager::flush_events(self)
    }
}

/// Which side of the leader/worker split this process is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Owns block metadata and decides placement.
    Leader,
    /// Executes transfers for one rank.
    Worker,
}

struct Inner {
    role: Role,
    config: Arc<KvbmConfig>,
    handle: tokio::runtime::Handle,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    sources: Mutex<Vec<Weak<dyn EventSource>>>,
    sources_changed: Notify,
    cancel: CancellationToken,
    shut_down: AtomicBool,
    metrics_addr: Option<SocketAddr>,
    metrics_stats: Arc<crate::metrics::endpoint::Counters>,
}

/// A copy of the metrics endpoint's counters (see the [module docs](self)).
pub type MetricsEndpointStats = crate::metrics::endpoint::Stats;

impl Inner {
    fn live_sources(&self) -> Vec<Arc<dyn EventSource>> {
        let mut sources = self.sources.lock();
        sources.retain(|w| w.strong_count() > 0);
        sources.iter().filter_map(Weak::upgrade).collect()
    }
}

/// A cheap, cloneable view of a [`KvbmRuntime`]: its configuration, its tokio handle, event
/// source registration.
#[derive(Clone)]
pub struct RuntimeHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("role", &self.inner.role)
            .field("shut_down", &self.is_shut_down())
            .field("metrics_addr", &self.inner.metrics_addr)
            .finish()
    }
}

impl RuntimeHandle {
    /// This process's role.
    pub fn role(&self) -> Role {
        self.inner.role
    }

    /// The validated configuration.
    pub fn config(&self) -> &Arc<KvbmConfig> {
        &self.inner.config
    }

    /// The tokio runtime handle (owned or borrowed).
    pub fn tokio(&self) -> &tokio::runtime::Handle {
        &self.inner.handle
    }

    /// Whether [`KvbmRuntime::shutdown`] has run.
    pub fn is_shut_down(&self) -> bool {
        self.inner.shut_down.load(Ordering::Acquire)
    }

    /// A token cancelled at shutdown, for tasks that must stop with the runtime.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.inner.cancel.clone()
    }

    /// Spawns `future` on the runtime.
    ///
    /// # Errors
    /// [`EngineError::ShutDown`] after shutdown.
    pub fn spawn<F>(&self, future: F) -> Result<tokio::task::JoinHandle<F::Output>>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        if self.is_shut_down() {
            return Err(EngineError::ShutDown);
        }
        Ok(self.inner.handle.spawn(future))
    }

    /// Puts `source` under the event-flush timer. Held weakly: dropping the source unregisters
    /// it. Registering after shutdown flushes nothing and is ignored.
    pub fn register_event_source(&self, source: &Arc<dyn EventSource>) {
        if self.is_shut_down() {
            return;
        }
        self.inner.sources.lock().push(Arc::downgrade(source));
        self.inner.sources_changed.notify_one();
    }

    /// Live registered event sources.
    pub fn event_source_count(&self) -> usize {
        self.inner.live_sources().len()
    }

    /// Where the Prometheus exporter listens, when enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.metrics_addr
    }

    /// The metrics endpoint's counters (all 0 when it is not enabled).
    pub fn metrics_stats(&self) -> MetricsEndpointStats {
        self.inner.metrics_stats.snapshot()
    }
}

/// Builds a [`KvbmRuntime`]: configuration sources, role, and an optional tokio handle to
/// borrow instead of owning a runtime.
#[derive(Debug)]
pub struct KvbmRuntimeBuilder {
    config: std::result::Result<ConfigBuilder, KvbmConfig>,
    role: Role,
    handle: Option<tokio::runtime::Handle>,
}

impl Default for KvbmRuntimeBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl KvbmRuntimeBuilder {
    /// Built-in defaults, role leader, an owned runtime.
    pub fn new() -> Self {
        Self {
            config: Ok(ConfigBuilder::new()),
            role: Role::Leader,
            handle: None,
        }
    }

    /// Configuration from `KVBM_CONFIG_PATH` and `KVBM_*` of this process (the one place the
    /// environment is read).
    ///
    /// # Errors
    /// See [`ConfigBuilder::from_process_env`].
    pub fn from_env() -> Result<Self> {
        Ok(Self::new().config_builder(ConfigBuilder::from_process_env()?))
    }

    /// Use these configuration sources (merged and validated at [`build`](Self::build)).
    pub fn config_builder(mut self, builder: ConfigBuilder) -> Self {
        self.config = Ok(builder);
        self
    }

    /// Use this configuration as is (validated again at [`build`](Self::build)).
    pub fn config(mut self, config: KvbmConfig) -> Self {
        self.config = Err(config);
        self
    }

    /// An explicit override over every other source (see [`ConfigBuilder::set`]). Ignored
    /// after [`config`](Self::config), which fixes the tree.
    pub fn set(mut self, key: impl Into<String>, value: impl serde::Serialize) -> Self {
        if let Ok(builder) = self.config {
            self.config = Ok(builder.set(key, value));
        }
        self
    }

    /// This process's role. Default: leader.
    pub fn role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// Borrow this tokio runtime instead of building one; it is left running at shutdown.
    pub fn tokio_handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Validates the configuration, builds or borrows the runtime, starts the event-flush
    /// timer and, when `metrics.enabled`, the Prometheus exporter.
    ///
    /// # Errors
    /// [`EngineError::Config`] for the configuration, [`EngineError::Runtime`] when tokio
    /// cannot start, [`EngineError::Metrics`] when the exporter's address cannot be bound.
    pub fn build(self) -> Result<KvbmRuntime> {
        let config = match self.config {
            Ok(builder) => builder.build()?,
            Err(config) => {
                config.validate()?;
                config
            }
        };
        let (runtime, handle) = match self.handle {
            Some(handle) => (None, handle),
            None => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(config.runtime.worker_threads)
                    .thread_name("kvbm")
                    .enable_all()
                    .build()
                    .map_err(EngineError::Runtime)?;
                let handle = rt.handle().clone();
                (Some(rt), handle)
            }
        };

        // Bind before spawning, so a taken port is an error of `build`, not a log line.
        let metrics = if config.metrics.enabled {
            let addr: SocketAddr = config
                .metrics
                .bind
                .parse()
                .map_err(|_| EngineError::config("metrics.bind", "not a host:port address"))?;
            let listener = std::net::TcpListener::bind(addr)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .map_err(|source| EngineError::Metrics {
                    addr: addr.to_string(),
                    source,
                })?;
            let local = listener
                .local_addr()
                .map_err(|source| EngineError::Metrics {
                    addr: addr.to_string(),
                    source,
                })?;
            Some((listener, local))
        } else {
            None
        };

        let inner = Arc::new(Inner {
            role: self.role,
            config: Arc::new(config),
            handle,
            runtime: Mutex::new(runtime),
            sources: Mutex::new(Vec::new()),
            sources_changed: Notify::new(),
            cancel: CancellationToken::new(),
            shut_down: AtomicBool::new(false),
            metrics_addr: metrics.as_ref().map(|(_, a)| *a),
            metrics_stats: Arc::default(),
        });

        let timer = inner.handle.spawn(flush_timer(Arc::downgrade(&inner)));
        let mut tasks = vec![timer];
        if let Some((listener, _)) = metrics {
            let prometheus = prometheus_handle();
            let cancel = inner.cancel.clone();
            let _guard = inner.handle.enter();
            let listener = tokio::net::TcpListener::from_std(listener).map_err(|source| {
                EngineError::Metrics {
                    addr: inner.config.metrics.bind.clone(),
                    source,
                }
            })?;
            let m = &inner.config.metrics;
            let limits = crate::metrics::endpoint::Limits {
                max_connections: m.max_connections,
                max_waiting_per_client: m.max_waiting_per_client,
                head_timeout: Duration::from_millis(m.head_timeout_ms.max(1)),
                request_timeout: Duration::from_millis(m.read_timeout_ms.max(1)),
            };
            tasks.push(inner.handle.spawn(crate::metrics::endpoint::serve(
                listener,
                prometheus,
                cancel,
                limits,
                inner.metrics_stats.clone(),
            )));
        }
        tracing::debug!(role = ?inner.role, "kvbm runtime started");
        Ok(KvbmRuntime {
            handle: RuntimeHandle { inner },
            tasks: Mutex::new(tasks),
        })
    }
}

/// The engine's runtime: see the [module docs](self).
pub struct KvbmRuntime {
    handle: RuntimeHandle,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for KvbmRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvbmRuntime")
            .field("handle", &self.handle)
            .finish()
    }
}

impl KvbmRuntime {
    /// A builder with built-in defaults.
    pub fn builder() -> KvbmRuntimeBuilder {
        KvbmRuntimeBuilder::new()
    }

    /// A leader runtime configured from this process's environment (`KVBM_CONFIG_PATH`,
    /// `KVBM_*`), on the tokio runtime this is awaited in.
    ///
    /// # Errors
    /// As [`KvbmRuntimeBuilder::build`].
    pub async fn from_env_leader() -> Result<Self> {
        Self::from_env(Role::Leader)
    }

    /// As [`from_env_leader`](Self::from_env_leader), for a worker.
    ///
    /// # Errors
    /// As [`KvbmRuntimeBuilder::build`].
    pub async fn from_env_worker() -> Result<Self> {
        Self::from_env(Role::Worker)
    }

    fn from_env(role: Role) -> Result<Self> {
        KvbmRuntimeBuilder::from_env()?
            .role(role)
            .tokio_handle(tokio::runtime::Handle::current())
            .build()
    }

    /// A cloneable handle.
    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// The validated configuration.
    pub fn config(&self) -> &Arc<KvbmConfig> {
        self.handle.config()
    }

    /// Stops the timer and exporter, flushes every event source, and shuts an owned tokio
    /// runtime down. Idempotent: later calls (and `Drop`) do nothing.
    pub fn shutdown(&self) {
        let inner = &self.handle.inner;
        if inner.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        inner.cancel.cancel();
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
        for source in inner.live_sources() {
            source.flush_events();
        }
        inner.sources.lock().clear();
        let runtime = inner.runtime.lock().take();
        if let Some(runtime) = runtime {
            if tokio::runtime::Handle::try_current().is_ok() {
                // Blocking is not allowed here; let the runtime wind down on its own.
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(Duration::from_millis(
                    inner.config.runtime.shutdown_timeout_ms,
                ));
            }
        }
        tracing::debug!(role = ?inner.role, "kvbm runtime shut down");
    }
}

impl Drop for KvbmRuntime {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn flush_timer(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let idle = Duration::from_millis(strong.config.events.idle_tick_ms);
        let now = Instant::now();
        let sources = strong.live_sources();
        let deadline = sources
            .iter()
            .filter_map(|s| s.next_event_deadline())
            .min()
            .unwrap_or(now + idle)
            .min(now + idle);
        drop(sources);
        let cancel = strong.cancel.clone();
        // Wait without holding the runtime's state alive.
        let notified = {
            let strong = strong.clone();
            async move { strong.sources_changed.notified().await }
        };
        drop(strong);
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {}
            () = notified => continue,
        }
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let now = Instant::now();
        for source in strong.live_sources() {
            source.flush_due_events(now);
        }
    }
}

/// The process-wide Prometheus recorder: `metrics` allows one global recorder per process, so
/// the first runtime that enables metrics installs it and later ones share its handle.
fn prometheus_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!(
                    "a metrics recorder was already installed; /metrics will show only what this \
                     exporter records"
                );
            }
            crate::metrics::describe();
            handle
        })
        .clone()
}

#[cfg(test)]
mod tests;
