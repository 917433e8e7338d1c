//! The replay's result: one JSON object (`--json`) or a readable table.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use kvbm_engine::replay::StageTimes;

/// One tier's line.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TierReport {
    /// Capacity in blocks (0: disabled). For G4, the size of its presence index.
    pub capacity_blocks: usize,
    /// Blocks of hit prefixes found in this tier.
    pub hit_blocks: u64,
}

/// Everything a replay reports.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// Where the requests came from.
    pub workload: String,
    /// Requests served.
    pub requests: usize,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Distinct blocks of the workload.
    pub unique_blocks: u64,
    /// Blocks of hit prefixes (served without computing).
    pub hit_blocks: u64,
    /// `hit_blocks / blocks`.
    pub hit_ratio: f64,
    /// `1 - unique/total`: the hit ratio when every tier holds everything.
    pub max_hit_ratio: f64,
    /// Per tier.
    pub tiers: BTreeMap<&'static str, TierReport>,
    /// Bytes moved per path.
    pub bytes: BTreeMap<&'static str, u64>,
    /// Blocks that reached G1 from a lower tier.
    pub onboarded_blocks: u64,
    /// Of those, the ones whose bytes were checked and right.
    pub verified_blocks: u64,
    /// Of those, the ones whose bytes were wrong (a bug; never served).
    pub corrupt_blocks: u64,
    /// Blocks a tier rejected on read (checksum, header or identity) before reaching G1.
    pub checksum_failures: u64,
    /// Blocks whose transfer failed.
    pub failed_transfers: u64,
    /// Blocks computed in G1.
    pub computed_blocks: u64,
    /// Blocks the offload lanes skipped (already present below, or filtered by policy).
    pub offload_filtered_blocks: u64,
    /// Queued blocks evicted from G2 before their lane (G2→G3/G4) reached them.
    pub offload_evicted_blocks: u64,
    /// Offloads refused because the destination tier had no evictable block (for example
    /// `lineage` keeps parents of blocks still queued); nothing was moved.
    pub offload_no_space_blocks: u64,
    /// Times a G1→G2 batch found G2 full and waited for the lower lanes to free room
    /// (backpressure instead of a `no space` failure).
    pub offload_g2_space_waits: u64,
    /// Requests whose `prepare_load` found a looked-up HIT gone (evicted from G2 by a later
    /// promotion of the same lookup pass) and recomputed instead (tiering scheduler; 0 with
    /// sessions).
    pub load_refused_requests: u64,
    /// Blocks G3 and G4 held from an earlier run.
    pub warm_start_blocks: BTreeMap<&'static str, usize>,
    /// Seconds from the first request to the end of the drain.
    pub wall_seconds: f64,
    /// `blocks / wall_seconds`.
    pub blocks_per_second: f64,
    /// The eviction backend of every tier.
    pub eviction_policy: String,
    /// The scheduler's way into the engine: `tiering` (the scheduler-facing manager) or
    /// `sessions` (the leader's onboarding sessions; also when G2 is off: G1 alone needs no
    /// manager).
    pub scheduler: crate::config::Scheduler,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Seconds per stage (summed over requests; `drain` is the end).
    pub stage_seconds: StageTimes,
    /// Where G3 and G4 were, and G3's I/O mode.
    pub storage: BTreeMap<&'static str, String>,
    /// Blocks still held per tier after the drain (every request done, every lane settled):
    /// anything but 0 is a leaked hold.
    pub held_blocks_after_drain: BTreeMap<&'static str, usize>,
    /// The offload lanes' blocks: `enqueued` counted where they were accepted, the rest from
    /// the settled handles. Every transfer settled when `enqueued == transferred + failed +
    /// filtered + cancelled`.
    pub offload_blocks: BTreeMap<&'static str, u64>,
    /// With `--instances`: which instance this is (0-based).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<usize>,
    /// With `--instances`: G4 hit blocks another instance wrote (found through its events and
    /// the shared G4).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cross_instance_hit_blocks: Option<u64>,
    /// With `--instances`: whether this instance sealed its messages with a member credential
    /// (configured, or made by the run: see `kvbm replay --instances`), i.e. security on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sealed: Option<bool>,
}

fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < U.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[u])
    }
}

impl Report {
    /// The human-readable summary.
    pub(crate) fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "kvbm replay: {}", self.workload);
        let _ = writeln!(
            s,
            "  requests {}   blocks {} ({} unique, {} B each)   eviction {}   scheduler {}",
            self.requests,
            self.blocks,
            self.unique_blocks,
            self.block_bytes,
            self.eviction_policy,
            serde_json::to_value(self.scheduler)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "  hit ratio {:.4}  ({} hit blocks; {:.4} if every tier held everything)",
            self.hit_ratio, self.hit_blocks, self.max_hit_ratio
        );
        let _ = writeln!(
            s,
            "  wall {:.2} s   {:.0} blocks/s",
            self.wall_seconds, self.blocks_per_second
        );
        let _ = writeln!(s);
        let _ = writeln!(s, "  tier  capacity (blocks)  hit blocks  share of hits");
        for (name, t) in &self.tiers {
            let share = if self.hit_blocks > 0 {
                t.hit_blocks as f64 / self.hit_blocks as f64
            } else {
                0.0
            };
            let cap = if t.capacity_blocks == 0 {
                "off".to_string()
            } else {
                t.capacity_blocks.to_string()
            };
            let _ = writeln!(
                s,
                "  {name:<4}  {cap:>17}  {:>10}  {:>12.1}%",
                t.hit_blocks,
                share * 100.0
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "  path       bytes moved");
        for (name, b) in &self.bytes {
            let _ = writeln!(s, "  {name:<9}  {:>11}", bytes(*b));
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  onboarded {}  verified {}  corrupt {}  checksum failures {}  failed transfers {}",
            self.onboarded_blocks,
            self.verified_blocks,
            self.corrupt_blocks,
            self.checksum_failures,
            self.failed_transfers
        );
        let _ = writeln!(
            s,
            "  computed {}  offloads not started: already below / policy {}, evicted before their lane {}, no space below {}  (G1->G2 waits for G2 room {})",
            self.computed_blocks,
            self.offload_filtered_blocks,
            self.offload_evicted_blocks,
            self.offload_no_space_blocks,
            self.offload_g2_space_waits
        );
        if self.warm_start_blocks.values().any(|v| *v > 0) {
            let _ = writeln!(
                s,
                "  warm start: {}",
                self.warm_start_blocks
                    .iter()
                    .map(|(k, v)| format!("{k} {v} blocks"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let st = &self.stage_seconds;
        let staged = st.lookup
            + st.g3_to_g2
            + st.read_ahead
            + st.g4_to_g2
            + st.g2_to_g1
            + st.compute
            + st.offload_enqueue
            + st.g1_backpressure
            + st.offload_backpressure
            + st.drain;
        let _ = writeln!(
            s,
            "  stages (s): lookup {:.3}  read-ahead {:.3}  g3->g2 {:.3}  g4->g2 {:.3}  g2->g1 {:.3}  compute {:.3}  store {:.3}  g1 wait {:.3}  offload wait {:.3}  drain {:.3}  other {:.3}",
            st.lookup,
            st.read_ahead,
            st.g3_to_g2,
            st.g4_to_g2,
            st.g2_to_g1,
            st.compute,
            st.offload_enqueue,
            st.g1_backpressure,
            st.offload_backpressure,
            st.drain,
            (self.wall_seconds - staged).max(0.0)
        );
        for (k, v) in &self.storage {
            let _ = writeln!(s, "  {k}: {v}");
        }
        s
    }
}
