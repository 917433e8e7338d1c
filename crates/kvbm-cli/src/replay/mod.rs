//! `kvbm replay`: serve a workload through every tier, like an inference scheduler would.
//!
//! ```text
//!  workload (trace | synthetic) ──► per request: sequence hashes ──► ReplayDriver::serve ──► counters
//!                                   (kvbm_engine::replay: the serve loop over the engine's TierStack)
//!  end: ReplayDriver::finish (drain lanes, sync G3 and its journal) ──► Report (table | JSON)
//! ```
//!
//! Requests are served one after another on this thread (the offload lanes run on a small
//! tokio runtime behind it). With `time_scale > 0` a request is not started before its
//! timestamp × scale.

pub(crate) mod content;
pub(crate) mod instances;
pub(crate) mod keys;
pub(crate) mod report;
pub(crate) mod sweep;
pub(crate) mod trace_line;
pub(crate) mod workload;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvbm_logical::Salt;

use crate::config::{CliConfig, Scheduler, ScratchDir};
use kvbm_cluster::shared_g4::Sharing;
use kvbm_engine::replay::ReplayDriver;
use kvbm_engine::stack::{FrontEnd, PATH_NAMES, StackPlan};
use report::{Report, TierReport};

/// Requests of the synthetic workload when `--requests` is not given.
pub(crate) const DEFAULT_SYNTHETIC_REQUESTS: usize = 20_000;

/// Loads the workload the configuration names.
///
/// # Errors
/// An unreadable or malformed trace.
pub(crate) fn load_workload(cfg: &CliConfig) -> anyhow::Result<workload::Workload> {
    let r = &cfg.replay;
    Ok(match &r.trace {
        Some(p) => workload::load_trace(p, r.requests)?,
        None => workload::synthetic(r.seed, r.requests.unwrap_or(DEFAULT_SYNTHETIC_REQUESTS)),
    })
}

/// The stack plan for `cfg` and a workload with `unique_blocks` distinct blocks: the engine's
/// tree as configured, with what only the workload decides (G4's presence index holds every
/// block of the whole workload: others' blocks are adopted into it; the block size appended to
/// G4's namespace; the replay's blocks of `HASH_BLOCK_SIZE` tokens), and the scratch directory
/// G4 lives in when enabled without a place (removed when dropped: it lives as long as the
/// stack).
///
/// # Errors
/// A scratch directory that cannot be made; a value the engine refuses (named by its key).
pub(crate) fn plan(
    cfg: &CliConfig,
    unique_blocks: usize,
) -> anyhow::Result<(StackPlan, Option<ScratchDir>)> {
    let r = &cfg.replay;
    let mut c = cfg.engine.clone();
    c.logical.block_size = workload::HASH_BLOCK_SIZE;
    let g4 = r.g4 || c.physical.s3.is_some() || c.physical.object_dir.is_some();
    let mut scratch = None;
    if g4 {
        c.tiers.g4_blocks = unique_blocks.max(1);
        if c.physical.s3.is_none() && c.physical.object_dir.is_none() {
            let dir = ScratchDir::new("kvbm-g4-")?;
            c.physical.object_dir = Some(dir.path().to_path_buf());
            scratch = Some(dir);
        }
    } else {
        c.tiers.g4_blocks = 0;
    }
    c.physical.object.namespace = format!(
        "{}/b{}",
        c.physical.object.namespace.trim_end_matches('/'),
        c.tiers.block_bytes
    );
    let mut plan = StackPlan::new(c, std::sync::Arc::new(content::ReplayContents))?;
    plan.front_end = match r.scheduler {
        Scheduler::Tiering => FrontEnd::Tiering,
        Scheduler::Sessions => FrontEnd::Sessions,
    };
    Ok((plan, scratch))
}

fn eviction_name(cfg: &CliConfig) -> String {
    serde_json::to_value(cfg.engine.logical.eviction)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", cfg.engine.logical.eviction))
}

/// Runs the replay.
///
/// # Errors
/// Bad input or storage that cannot be set up; per-block failures are counted instead.
pub(crate) fn run(cfg: &CliConfig) -> anyhow::Result<Report> {
    run_instance(cfg, None)
}

/// One instance of a `--instances` run: which one, of how many, and how it shares G4.
#[derive(Debug, Clone)]
pub(crate) struct InstanceSpec {
    /// This instance (0-based).
    pub index: usize,
    /// Instances in the run.
    pub count: usize,
    /// The NATS server and subject, and this instance's id.
    pub sharing: Sharing,
    /// How requests are spread over the instances (every instance computes the same).
    pub assign: instances::Assign,
}

/// Runs the replay, as the only instance (`None`) or as one of several: then it serves only
/// its requests ([`instances::assign`]) and shares G4 with the others.
///
/// # Errors
/// As [`run`].
pub(crate) fn run_instance(cfg: &CliConfig, spec: Option<&InstanceSpec>) -> anyhow::Result<Report> {
    let mut wl = load_workload(cfg)?;
    // G4's presence index must hold every block of the whole workload (others' blocks are
    // adopted into it), so its size comes from the whole workload.
    let (mut plan, _scratch) = plan(cfg, wl.unique_blocks())?;
    if let Some(spec) = spec {
        let owner = instances::assign(&wl.requests, spec.count, spec.assign);
        let mut i = 0;
        wl.requests.retain(|_| {
            i += 1;
            owner[i - 1] == spec.index
        });
        plan.sharing = Some(std::sync::Arc::new(spec.sharing.clone()));
    }
    let salt = Salt::new("kvbm-replay");
    let tiering = plan.front_end == FrontEnd::Tiering && plan.config.tiers.g2_blocks > 0;
    if tiering {
        plan.identities = std::sync::Arc::new(keys::identities_of_workload(
            salt,
            wl.requests.iter().map(|r| r.hash_ids.as_slice()),
        ));
    }
    let unique = wl.unique_blocks();
    let total = wl.total_blocks();
    if wl.max_request_blocks() > plan.config.tiers.g1_blocks {
        anyhow::bail!(
            "the longest request has {} blocks but G1 holds {}; raise --g1-blocks",
            wl.max_request_blocks(),
            plan.config.tiers.g1_blocks
        );
    }
    let mut driver = ReplayDriver::build(&plan)?;
    driver.stack().publish_capacity();

    let pb = ProgressBar::with_draw_target(
        Some(wl.requests.len() as u64),
        if spec.is_some() {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr_with_hz(5)
        },
    );
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} replay [{elapsed_precise}] {bar:30} {pos}/{len} requests ({per_sec}) {msg}",
        )
        .expect("valid template"),
    );

    // A request's block hashes: the chained sequence hashes, or (tiering) the hashes of their
    // keys, with the keys.
    let mut chained = Vec::new();
    let hash = |ids: &[u64],
                chained: &mut Vec<kvbm_logical::SequenceHash>,
                keys: &mut Vec<kvbm_tiering::OffloadKey>,
                hashes: &mut Vec<kvbm_logical::SequenceHash>| {
        if tiering {
            workload::sequence_hashes(salt, ids, chained);
            keys::key_request(chained, keys, hashes);
        } else {
            workload::sequence_hashes(salt, ids, hashes);
        }
    };
    let (mut hashes, mut req_keys) = (Vec::new(), Vec::new());
    let (mut ahead_hashes, mut ahead_keys) = (Vec::new(), Vec::new());
    let (mut hits, mut onboarded, mut verified, mut corrupt, mut computed, mut cross) =
        ([0u64; 4], 0, 0, 0, 0, 0);
    let start = Instant::now();
    let t0 = wl.requests.first().map_or(0, |r| r.timestamp_ms);
    for (i, req) in wl.requests.iter().enumerate() {
        if cfg.replay.time_scale > 0.0 {
            let due = Duration::from_secs_f64(
                (req.timestamp_ms.saturating_sub(t0)) as f64 / 1000.0 * cfg.replay.time_scale,
            );
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                driver.idle();
                std::thread::sleep(wait);
            }
        }
        let ahead = cfg.replay.read_ahead_requests;
        if ahead > 0 {
            if i == 0 {
                for j in 1..=ahead.min(wl.requests.len() - 1) {
                    let ids = &wl.requests[j].hash_ids;
                    hash(ids, &mut chained, &mut ahead_keys, &mut ahead_hashes);
                    driver.read_ahead(j, &ahead_hashes);
                }
            } else if let Some(next) = wl.requests.get(i + ahead) {
                hash(
                    &next.hash_ids,
                    &mut chained,
                    &mut ahead_keys,
                    &mut ahead_hashes,
                );
                driver.read_ahead(i + ahead, &ahead_hashes);
            }
        }
        hash(&req.hash_ids, &mut chained, &mut req_keys, &mut hashes);
        let s = if tiering {
            driver.serve_scheduled(&hashes, &req_keys)
        } else {
            driver.serve(&hashes)
        }
        .with_context(|| format!("request {} ({} blocks)", i + 1, hashes.len()))?;
        for (a, b) in hits.iter_mut().zip(s.hits) {
            *a += b;
        }
        onboarded += s.onboarded;
        verified += s.verified;
        corrupt += s.corrupt;
        computed += s.computed;
        cross += s.cross_instance;
        if i % 64 == 63 {
            driver.reap();
            pb.set_position(i as u64 + 1);
        }
    }
    pb.set_position(wl.requests.len() as u64);
    pb.set_message("draining offloads");
    driver.finish()?;
    let stack = driver.stack();
    let (lanes, counts) = (driver.lane_outcomes(), driver.counts());
    let wall = start.elapsed().as_secs_f64();
    pb.finish_and_clear();

    let hit_blocks: u64 = hits.iter().sum();
    let caps = stack.capacities();
    let names = ["g1", "g2", "g3", "g4"];
    let tiers_report = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                *n,
                TierReport {
                    capacity_blocks: caps[i],
                    hit_blocks: hits[i],
                },
            )
        })
        .collect();
    let bytes = PATH_NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                *n,
                stack.counters().bytes[i].load(std::sync::atomic::Ordering::Relaxed),
            )
        })
        .collect();
    let (w3, w4) = stack.warm_blocks();
    let mut storage = BTreeMap::new();
    let (g3_loc, g4_loc) = stack.locations();
    if let Some(l) = g3_loc {
        storage.insert("g3_dir", l);
    }
    if let Some(c) = stack.g3_capabilities() {
        storage.insert("g3_io", c);
    }
    if let Some(l) = g4_loc {
        storage.insert("g4", l);
    }
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    Ok(Report {
        workload: wl.source.clone(),
        requests: wl.requests.len(),
        blocks: total as u64,
        unique_blocks: unique as u64,
        hit_blocks,
        hit_ratio: if total > 0 {
            hit_blocks as f64 / total as f64
        } else {
            0.0
        },
        max_hit_ratio: if total > 0 {
            1.0 - unique as f64 / total as f64
        } else {
            0.0
        },
        tiers: tiers_report,
        bytes,
        onboarded_blocks: onboarded,
        verified_blocks: verified,
        corrupt_blocks: corrupt,
        checksum_failures: ld(&stack.counters().checksum_failures),
        failed_transfers: ld(&stack.counters().failed_transfers),
        computed_blocks: computed,
        offload_filtered_blocks: lanes.filtered + counts.store_filtered,
        offload_evicted_blocks: lanes.evicted_before_offload,
        offload_no_space_blocks: lanes.no_space + counts.store_no_space,
        offload_g2_space_waits: stack.g2_space_waits(),
        load_refused_requests: counts.load_refused,
        warm_start_blocks: [("g3", w3), ("g4", w4)].into_iter().collect(),
        wall_seconds: wall,
        blocks_per_second: if wall > 0.0 { total as f64 / wall } else { 0.0 },
        eviction_policy: eviction_name(cfg),
        scheduler: if tiering {
            Scheduler::Tiering
        } else {
            Scheduler::Sessions
        },
        block_bytes: cfg.engine.tiers.block_bytes,
        stage_seconds: driver.times(),
        storage,
        held_blocks_after_drain: names.into_iter().zip(stack.held_blocks()).collect(),
        offload_blocks: [
            ("enqueued", ld(&stack.counters().offload_enqueued)),
            ("transferred", lanes.transferred),
            ("failed", lanes.failed),
            ("filtered", lanes.filtered),
            ("cancelled", lanes.cancelled),
        ]
        .into_iter()
        .collect(),
        instance: spec.map(|s| s.index),
        cross_instance_hit_blocks: spec.map(|_| cross),
        sealed: spec.map(|_| cfg.engine.security.has_credentials()),
    })
}
