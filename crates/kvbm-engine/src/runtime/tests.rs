//! Tests of the runtime: the event-flush timer drives an idle tier, shutdown flushes and is
//! idempotent, a borrowed tokio runtime survives shutdown, the Prometheus endpoint serves.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_logical::events::VecSink;
use kvbm_logical::{BlockManager, EventBatchConfig, G2, ImmutableBlock, Salt, TokenBlockSequence};

use super::*;

/// A G2 manager publishing into a `VecSink`, with `n` registered blocks (so `n` Stored events
/// are buffered, below the batch size, waiting on their age).
fn manager_with_buffered(
    n: usize,
    max_delay_ms: u64,
) -> (Arc<BlockManager<G2>>, Arc<VecSink>, Vec<ImmutableBlock<G2>>) {
    let sink = Arc::new(VecSink::new());
    let manager = BlockManager::<G2>::builder()
        .block_count(16)
        .block_size(4)
        .event_sink(sink.clone())
        .event_batching(EventBatchConfig {
            max_batch: 256,
            max_delay_ms,
        })
        .build()
        .unwrap();
    let tokens: Vec<u32> = (0..(n as u32 * 4)).collect();
    let seq = TokenBlockSequence::from_tokens(&tokens, 4, Salt::NONE).unwrap();
    let blocks = manager.allocate_blocks(n).unwrap();
    let complete = blocks
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.complete_token_block(tb).unwrap())
        .collect();
    let held = manager.register_blocks(complete);
    (Arc::new(manager), sink, held)
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    done()
}

#[test]
fn timer_flushes_an_idle_tier() {
    let runtime = KvbmRuntime::builder()
        .set("events.idle_tick_ms", 5)
        .build()
        .unwrap();
    let (watched, watched_sink, _a) = manager_with_buffered(3, 20);
    let (unwatched, unwatched_sink, _b) = manager_with_buffered(3, 20);
    assert!(
        watched_sink.events().is_empty(),
        "buffered, not yet published"
    );
    let source: Arc<dyn EventSource> = watched.clone();
    runtime.handle().register_event_source(&source);

    assert!(
        wait_until(Duration::from_secs(5), || watched_sink.events().len() == 3),
        "the runtime's timer published the idle tier's partial batch"
    );
    // Without an owner's timer the other tier's batch stays buffered (nothing else touched it).
    assert!(unwatched_sink.events().is_empty());
    assert!(unwatched.next_event_deadline().is_some());
    runtime.shutdown();
}

#[test]
fn shutdown_flushes_everything_and_is_idempotent() {
    let runtime = KvbmRuntime::builder().build().unwrap();
    // An hour's delay: only the shutdown flush can publish these.
    let (manager, sink, _held) = manager_with_buffered(2, 3_600_000);
    let source: Arc<dyn EventSource> = manager.clone();
    let handle = runtime.handle();
    handle.register_event_source(&source);
    assert_eq!(handle.event_source_count(), 1);
    std::thread::sleep(Duration::from_millis(30));
    assert!(sink.events().is_empty());

    runtime.shutdown();
    assert_eq!(
        sink.events().len(),
        2,
        "shutdown flushed the buffered batch"
    );
    assert!(handle.is_shut_down());
    assert!(matches!(handle.spawn(async {}), Err(EngineError::ShutDown)));
    runtime.shutdown();
    drop(runtime); // Drop runs shutdown a third time: harmless.
    assert_eq!(
        sink.batches().len(),
        1,
        "no second flush, no duplicate events"
    );
}

#[test]
fn sources_are_held_weakly() {
    let runtime = KvbmRuntime::builder().build().unwrap();
    let (manager, _sink, held) = manager_with_buffered(1, 10);
    let source: Arc<dyn EventSource> = manager;
    runtime.handle().register_event_source(&source);
    assert_eq!(runtime.handle().event_source_count(), 1);
    drop(held);
    drop(source);
    // The runtime's flush timer upgrades each source for the length of one tick: it may hold
    // this one at the instant it is dropped, and lets go at the end of that tick. What must
    // not happen is that the runtime keeps it alive.
    let deadline = Instant::now() + Duration::from_secs(10);
    while runtime.handle().event_source_count() != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(runtime.handle().event_source_count(), 0);
}

#[test]
fn invalid_configuration_fails_the_build() {
    let err = KvbmRuntime::builder()
        .set("events.idle_tick_ms", 0)
        .build()
        .unwrap_err();
    assert_eq!(err.config_key(), Some("events.idle_tick_ms"));
    let mut config = KvbmConfig::default();
    config.runtime.worker_threads = 0;
    let err = KvbmRuntime::builder().config(config).build().unwrap_err();
    assert_eq!(err.config_key(), Some("runtime.worker_threads"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowed_runtime_survives_shutdown() {
    let runtime = KvbmRuntime::builder()
        .tokio_handle(tokio::runtime::Handle::current())
        .role(Role::Worker)
        .build()
        .unwrap();
    let handle = runtime.handle();
    assert_eq!(handle.role(), Role::Worker);
    assert_eq!(handle.spawn(async { 7 }).unwrap().await.unwrap(), 7);
    runtime.shutdown();
    drop(runtime);
    // The ambient runtime still runs tasks.
    assert_eq!(tokio::spawn(async { 8 }).await.unwrap(), 8);
}

#[test]
fn owned_runtime_dropped_inside_async_context_does_not_panic() {
    let outer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let runtime = KvbmRuntime::builder().build().unwrap();
    outer.block_on(async move {
        runtime.shutdown();
    });
}

#[test]
#[allow(clippy::result_large_err)] // figment's Jail fixes the closure's error type
fn from_env_leader_and_worker() {
    figment::Jail::expect_with(|jail| {
        jail.create_file("kvbm.toml", "[tiers]\ng2_blocks = 3\n")?;
        jail.set_env("KVBM_CONFIG_PATH", "kvbm.toml");
        jail.set_env("KVBM_EVENTS__SUBJECT", "from.env");
        let tokio = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio.block_on(async {
            let leader = KvbmRuntime::from_env_leader().await.unwrap();
            assert_eq!(leader.handle().role(), Role::Leader);
            assert_eq!(leader.config().tiers.g2_blocks, 3);
            assert_eq!(leader.config().events.subject, "from.env");
            let worker = KvbmRuntime::from_env_worker().await.unwrap();
            assert_eq!(worker.handle().role(), Role::Worker);
        });
        jail.set_env("KVBM_EVENTS__CHANNEL_CAPACITY", "none");
        let err = tokio.block_on(KvbmRuntime::from_env_leader()).unwrap_err();
        assert_eq!(err.config_key(), Some("events.channel_capacity"));
        Ok(())
    });
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn prometheus_endpoint_serves_metrics() {
    let runtime = KvbmRuntime::builder()
        .set("metrics.enabled", true)
        .set("metrics.bind", "127.0.0.1:0")
        .build()
        .unwrap();
    let addr = runtime.handle().metrics_addr().expect("exporter bound");
    assert_ne!(addr.port(), 0);
    metrics::counter!("kvbm_engine_test_probe_total").increment(3);
    let response = http_get(addr, "/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(
        response.contains("kvbm_engine_test_probe_total 3"),
        "{response}"
    );
    let response = http_get(addr, "/other");
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");

    // A taken port is a build error naming the address.
    let err = KvbmRuntime::builder()
        .set("metrics.enabled", true)
        .set("metrics.bind", addr.to_string())
        .build()
        .unwrap_err();
    assert!(matches!(err, EngineError::Metrics { .. }), "{err}");

    runtime.shutdown();
    assert!(
        std::net::TcpStream::connect(addr).is_err()
            || wait_until(Duration::from_secs(2), || std::net::TcpStream::connect(
                addr
            )
            .is_err()),
        "the exporter stops with the runtime"
    );
}

/// Attack (N1/N2 of the second security review): clients that connect to the metrics endpoint
/// and send nothing, as many as it has slots. A scrape is answered all the same, before any
/// timeout: a newer connection evicts the oldest still waiting for its request (counted), and
/// an idle one is closed after `metrics.head_timeout_ms` (counted).
#[test]
fn security_idle_metrics_connections_give_way_to_a_scrape() {
    let runtime = KvbmRuntime::builder()
        .set("metrics.enabled", true)
        .set("metrics.bind", "127.0.0.1:0")
        .set("metrics.max_connections", 2)
        .set("metrics.head_timeout_ms", 500)
        .set("metrics.read_timeout_ms", 2000)
        .build()
        .unwrap();
    let h = runtime.handle();
    let addr = h.metrics_addr().expect("exporter bound");
    let idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    // Both idle connections hold a slot; a scrape still gets in, at once.
    std::thread::sleep(Duration::from_millis(100));
    let response = http_get(addr, "/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    // It took an idle one's slot rather than waiting for a timeout.
    assert!(h.metrics_stats().evicted >= 1, "{:?}", h.metrics_stats());
    assert_eq!(h.metrics_stats().timed_out, 0, "{:?}", h.metrics_stats());
    // The idle ones are closed: evicted, or after the head timeout (counted).
    let mut buf = [0u8; 16];
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("an idle connection is not closed: {other:?}"),
        }
    }
    assert!(
        wait_until(Duration::from_secs(2), || {
            let s = h.metrics_stats();
            s.evicted + s.timed_out >= 2
        }),
        "{:?}",
        h.metrics_stats()
    );
    assert!(h.metrics_stats().answered >= 1);
    runtime.shutdown();
}
