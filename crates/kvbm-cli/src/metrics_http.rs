//! `--metrics-addr`: a Prometheus scrape endpoint for the run.
//!
//! The recorder (`metrics-exporter-prometheus`) is installed before any tier is built, because
//! the crates resolve their metric handles once, when a manager or pipeline starts. The HTTP
//! side is the engine's endpoint ([`kvbm_engine::metrics::endpoint`], hyper, its default
//! bounds) on a thread of its own: `GET /metrics` gets the exposition, with help text
//! ([`kvbm_engine::metrics::describe`]); a connection has 2 s to send its request, and idle
//! connections give way to newer ones instead of keeping a scraper out.

use anyhow::Context;
use kvbm_engine::metrics::endpoint::{Limits, serve_on_thread};
use metrics_exporter_prometheus::PrometheusBuilder;

/// Installs the recorder and serves it on `addr` (e.g. `127.0.0.1:9464`) until the process ends.
///
/// # Errors
/// A recorder is already installed, or the address cannot be bound.
pub(crate) fn serve(addr: &str) -> anyhow::Result<()> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("cannot install the Prometheus recorder")?;
    kvbm_engine::metrics::describe();
    serve_on_thread(addr, handle, Limits::default())
        .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    Ok(())
}
