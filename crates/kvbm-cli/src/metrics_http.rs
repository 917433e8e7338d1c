//! `--metrics-addr`: a Prometheus scrape endpoint for the run.
//!
//! The recorder (`metrics-exporter-prometheus`) is installed before any tier is built, because
//! the crates resolve their metric handles once, when a manager or pipeline starts. The HTTP
//! side is a tiny blocking server on its own thread: every request gets the current
//! exposition (`GET /metrics` or any path), which keeps the dependency tree free of an HTTP
//! stack.

use std::io::{Read, Write};
use std::net::TcpListener;

use anyhow::Context;
use metrics_exporter_prometheus::PrometheusBuilder;

/// Installs the recorder and serves it on `addr` (e.g. `127.0.0.1:9464`) until the process ends.
///
/// # Errors
/// The address cannot be bound, or a recorder is already installed.
pub(crate) fn serve(addr: &str) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("cannot install the Prometheus recorder")?;
    kvbm_engine::metrics::describe();
    std::thread::Builder::new()
        .name("kvbm-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut buf = [0u8; 2048];
                let _ = stream.read(&mut buf);
                handle.run_upkeep();
                let body = handle.render();
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                    body.len(),
                    body
                );
            }
        })
        .context("cannot start the metrics thread")?;
    Ok(())
}
