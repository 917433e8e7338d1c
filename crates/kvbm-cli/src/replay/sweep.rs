//! `kvbm replay --sweep-g2 1024,4096,16384`: hit ratio per eviction policy × G2 capacity on one
//! workload, with Belady's offline optimum and the infinite cache as bounds.
//!
//! The sweep runs the **logical-only** simulation ([`kvbm_logical::sim`]): one G2 block manager
//! per policy and capacity, G1 = 0, no bytes, no transfers, no G3/G4. Per request the hit is the
//! longest cached prefix (the same prefix-hit counting as `kvbm replay`), the missing blocks are
//! allocated and registered, and every block is released, last block first. Block identities
//! are the replay's own ([`workload::sequence_hashes`] under the replay's salt), so a sweep row
//! and `kvbm replay --g2-blocks N --eviction-policy P` see the same blocks.
//!
//! ```text
//!  workload ──▶ sequence hashes ──▶ PrefixTrace (next uses for belady)
//!                                        │
//!          for policy × capacity: sim::simulate ──▶ Sweep ──▶ table | JSON | SVG plot
//! ```
//!
//! Belady reads each block's next use from the trace, so every sweep carries its own upper
//! bound; `infinite` is `1 - unique / total`. Belady ≥ every online policy holds in practice
//! (it is the optimum for uniform block costs; a prefix cache is not exactly that problem, so it
//! is a reference, not a theorem: the CLI tests check it on the traces they run).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use kvbm_logical::sim::{PrefixTrace, simulate};
use kvbm_logical::{EvictionBackend, EvictionPolicy, Salt};
use plotters::prelude::*;
use serde::Serialize;

use super::workload;
use crate::config::CliConfig;

/// Online policies swept when none are named (Belady is always added last). `tinylfu-lineage`
/// is left out: its probation scan skips every parent, which is slow at large capacities.
pub(crate) const DEFAULT_POLICIES: &[&str] = &[
    "lru",
    "multi_lru",
    "lineage",
    "fifo",
    "arc",
    "s3fifo",
    "tinylfu-lru",
    "adaptive-lru",
    "tinylfu-arc",
    "tinylfu-s3fifo",
    "orphan-lru",
    "orphan-tinylfu-lru",
];

/// One policy's row.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SweepRow {
    /// The policy's name (`belady` for the offline bound).
    pub policy: String,
    /// Whether this is the default policy.
    pub default: bool,
    /// Hit ratio per capacity, in the order of [`Sweep::capacities`].
    pub hit_ratios: Vec<f64>,
    /// Hit blocks per capacity.
    pub hit_blocks: Vec<u64>,
}

/// A whole sweep (`--json` prints it as one object).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sweep {
    /// How the hit ratios were measured.
    pub simulation: &'static str,
    /// Where the requests came from.
    pub workload: String,
    /// Requests replayed.
    pub requests: usize,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Distinct blocks.
    pub unique_blocks: u64,
    /// G2 capacities, in blocks.
    pub capacities: Vec<usize>,
    /// The default policy's name.
    pub default_policy: String,
    /// `1 - unique / total`: the hit ratio of an unbounded cache.
    pub infinite_hit_ratio: f64,
    /// One row per policy, Belady last.
    pub rows: Vec<SweepRow>,
}

/// Parses a comma-separated capacity list (`1024,4096`).
///
/// # Errors
/// An empty list, a non-number or a zero.
pub(crate) fn parse_capacities(s: &str) -> anyhow::Result<Vec<usize>> {
    let caps = s
        .split(',')
        .map(|c| {
            let c = c.trim();
            match c.parse::<usize>() {
                Ok(0) => anyhow::bail!("--sweep-g2: a capacity must be at least 1 block"),
                Ok(n) => Ok(n),
                Err(_) => anyhow::bail!("--sweep-g2: {c:?} is not a number of blocks"),
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if caps.is_empty() {
        anyhow::bail!("--sweep-g2 needs at least one capacity");
    }
    Ok(caps)
}

/// Parses a comma-separated policy list; `belady` in it is ignored (always swept last).
///
/// # Errors
/// An unknown policy name.
pub(crate) fn parse_policies(s: &str) -> anyhow::Result<Vec<EvictionPolicy>> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<EvictionPolicy>()
                .map_err(|e| anyhow::anyhow!("--sweep-policies: {e}"))
        })
        .filter(|p| !matches!(p, Ok(p) if *p == EvictionPolicy::plain(EvictionBackend::Belady)))
        .collect()
}

/// Runs the sweep on the configured workload (`--trace`, or the synthetic one).
///
/// # Errors
/// An unreadable trace, or a capacity the manager refuses.
pub(crate) fn run(
    cfg: &CliConfig,
    capacities: &[usize],
    policies: &[EvictionPolicy],
) -> anyhow::Result<Sweep> {
    let wl = super::load_workload(cfg)?;
    let salt = Salt::new("kvbm-replay");
    let requests = wl
        .requests
        .iter()
        .map(|r| {
            let mut h = Vec::with_capacity(r.hash_ids.len());
            workload::sequence_hashes(salt, &r.hash_ids, &mut h);
            h
        })
        .collect();
    let trace = PrefixTrace::new(requests);
    let default = EvictionPolicy::default();
    let mut rows = Vec::with_capacity(policies.len() + 1);
    for &p in policies
        .iter()
        .chain(std::iter::once(&EvictionPolicy::plain(
            EvictionBackend::Belady,
        )))
    {
        let mut row = SweepRow {
            policy: p.to_string(),
            default: p == default,
            hit_ratios: Vec::with_capacity(capacities.len()),
            hit_blocks: Vec::with_capacity(capacities.len()),
        };
        for &c in capacities {
            let o = simulate(&trace, c, p).with_context(|| format!("{p} at {c} blocks"))?;
            row.hit_ratios.push(o.hit_ratio());
            row.hit_blocks.push(o.hit_blocks);
        }
        rows.push(row);
    }
    Ok(Sweep {
        simulation: "logical-only: one G2 block manager per policy and capacity, G1 = 0, \
                     longest-prefix hits as in kvbm replay, no bytes moved",
        workload: wl.source.clone(),
        requests: wl.requests.len(),
        blocks: trace.blocks() as u64,
        unique_blocks: trace.unique_blocks() as u64,
        capacities: capacities.to_vec(),
        default_policy: default.to_string(),
        infinite_hit_ratio: trace.infinite_hit_ratio(),
        rows,
    })
}

impl Sweep {
    /// A markdown table: one row per policy, one column per capacity.
    pub(crate) fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}: {} requests, {} blocks, {} unique (G2 only, logical-only simulation)\n",
            self.workload, self.requests, self.blocks, self.unique_blocks
        );
        s.push_str("| policy |");
        for c in &self.capacities {
            let _ = write!(s, " {c} |");
        }
        s.push_str("\n|---|");
        for _ in &self.capacities {
            s.push_str("---:|");
        }
        s.push('\n');
        for r in &self.rows {
            if r.default {
                let _ = write!(s, "| **{} (default)** |", r.policy);
            } else {
                let _ = write!(s, "| {} |", r.policy);
            }
            for h in &r.hit_ratios {
                let _ = write!(s, " {:.1}% |", 100.0 * h);
            }
            s.push('\n');
        }
        s.push_str("| infinite |");
        for _ in &self.capacities {
            let _ = write!(s, " {:.1}% |", 100.0 * self.infinite_hit_ratio);
        }
        s.push('\n');
        s
    }

    /// Draws hit ratio against capacity (log scale), one line per policy, Belady and the
    /// infinite cache as bounds, into an SVG file.
    ///
    /// # Errors
    /// The file cannot be written.
    pub(crate) fn plot(&self, path: &Path) -> anyhow::Result<()> {
        self.draw(path)
            .map_err(|e| anyhow::anyhow!("cannot draw the plot {}: {e}", path.display()))
    }

    fn draw(&self, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let lo = *self.capacities.iter().min().unwrap_or(&1) as f64;
        let hi = *self.capacities.iter().max().unwrap_or(&1) as f64;
        let (lo, hi) = if hi > lo {
            (lo / 1.2, hi * 1.2)
        } else {
            (lo / 2.0, hi * 2.0)
        };
        let top = self
            .rows
            .iter()
            .flat_map(|r| r.hit_ratios.iter().copied())
            .fold(self.infinite_hit_ratio, f64::max)
            * 100.0;
        let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "G2 hit ratio vs capacity: {}",
            Path::new(&self.workload)
                .file_name()
                .map_or(self.workload.clone(), |f| f.to_string_lossy().into_owned())
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..(top * 1.08).max(1.0))?;
        chart
            .configure_mesh()
            .x_desc("G2 capacity (blocks, log scale)")
            .y_desc("block hit ratio (%)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        let inf = 100.0 * self.infinite_hit_ratio;
        chart
            .draw_series(LineSeries::new(
                [(lo, inf), (hi, inf)],
                ShapeStyle::from(&RGBColor(150, 150, 150)).stroke_width(1),
            ))?
            .label("infinite")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RGBColor(150, 150, 150)));
        for (i, r) in self.rows.iter().enumerate() {
            let belady = r.policy == "belady";
            let color = if belady {
                BLACK.to_rgba()
            } else {
                Palette99::pick(i).to_rgba()
            };
            let width = if belady || r.default { 3 } else { 1 };
            let style = ShapeStyle::from(&color).stroke_width(width);
            let points: Vec<(f64, f64)> = self
                .capacities
                .iter()
                .zip(&r.hit_ratios)
                .map(|(&c, &h)| (c as f64, 100.0 * h))
                .collect();
            let label = if r.default {
                format!("{} (default)", r.policy)
            } else {
                r.policy.clone()
            };
            chart
                .draw_series(LineSeries::new(points.clone(), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
            chart.draw_series(
                points
                    .into_iter()
                    .map(move |p| Circle::new(p, 3, style.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_and_policy_lists_are_checked() {
        assert_eq!(parse_capacities("1024, 4096").unwrap(), vec![1024, 4096]);
        assert!(parse_capacities("0").is_err());
        assert!(parse_capacities("12x").is_err());
        let p = parse_policies("lru,belady,tinylfu-arc").unwrap();
        assert_eq!(p.len(), 2, "belady is always added by the sweep itself");
        let e = parse_policies("lru,nope").unwrap_err().to_string();
        assert!(e.contains("nope"), "{e}");
    }
}
