//! Backpressure for cascades (vLLM `tiering/backpressure.py`, PR #50045).
//!
//! An EMA of store latency per MiB, with high/low watermarks (hysteresis), a warm-up during which
//! no decision is taken, idle decay while pressured, a healthy fast path, a cooldown after
//! clearing (every second store dropped for `cooldown`), and a drop policy (throttled, default,
//! or drop-all). Only cascades consult it; promotions are never gated. Defaults follow the issue
//! (alpha 0.3, warm-up 3, LOCAL 0.005/0.001 s/MiB, NETWORK 0.020/0.005 s/MiB); vLLM 0.33 ships
//! alpha 0.15, warm-up 10 and 0.01/0.002, 0.05/0.01, which `EmaConfig` can express.

use std::time::{Duration, Instant};

use crate::error::{Result, TieringError};
use crate::tiering::base::TierJob;
use crate::types::Locality;

/// A tier's back-pressure as the tiering manager consults it (vLLM's `BackpressureDetector`
/// protocol): asked before every cascade, told every cascade's outcome, read for metrics.
///
/// [`BackpressureDetector`] is kvbm's own; a tier written in another language (a Python tier
/// under the kvbm-vllm package) answers with its own detector through this seam.
pub trait Backpressure {
    /// Whether a cascade of `num_blocks` should go ahead (a skip is counted when not).
    fn should_store(&mut self, num_blocks: usize) -> bool;
    /// A cascade finished: `num_bytes` moved since the job was submitted.
    fn on_store_completed(&mut self, job: &TierJob, num_bytes: u64);
    /// A cascade failed.
    fn on_store_failed(&mut self);
    /// Whether the tier is pressured now.
    fn is_under_pressure(&mut self) -> bool;
    /// The store-latency EMA (s/MiB), when the detector has one.
    fn store_latency_ema(&mut self) -> Option<f64>;
    /// (stores dropped, blocks dropped) since the last call.
    fn pop_stores_dropped(&mut self) -> (u64, u64);
    /// Back to the initial state (the manager's `reset_cache`).
    fn reset(&mut self);
}

impl Backpressure for BackpressureDetector {
    fn should_store(&mut self, num_blocks: usize) -> bool {
        BackpressureDetector::should_store(self, num_blocks)
    }
    fn on_store_completed(&mut self, job: &TierJob, num_bytes: u64) {
        self.update(job.submit_time, num_bytes);
    }
    fn on_store_failed(&mut self) {
        BackpressureDetector::on_store_failed(self);
    }
    fn is_under_pressure(&mut self) -> bool {
        BackpressureDetector::is_under_pressure(self)
    }
    fn store_latency_ema(&mut self) -> Option<f64> {
        Some(BackpressureDetector::store_latency_ema(self))
    }
    fn pop_stores_dropped(&mut self) -> (u64, u64) {
        BackpressureDetector::pop_stores_dropped(self)
    }
    fn reset(&mut self) {
        BackpressureDetector::reset(self);
    }
}

const MIB: f64 = (1u64 << 20) as f64;
const HEALTHY_THRESHOLD: u32 = 10;
const FAILURE_EMA_FACTOR: f64 = 4.0;

/// What to drop while pressured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DropPolicy {
    /// Drop a fraction growing with the overshoot: `min(1, (ema-high)/high / ramp_factor)`.
    Throttled {
        /// Overshoot at which everything is dropped.
        ramp_factor: f64,
    },
    /// Drop every store while pressured.
    DropAll,
}

impl Default for DropPolicy {
    fn default() -> Self {
        DropPolicy::Throttled { ramp_factor: 2.0 }
    }
}

/// Detector parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmaConfig {
    /// Above this EMA (s/MiB) the tier is pressured.
    pub high_water_s: f64,
    /// Below this EMA the pressure clears.
    pub low_water_s: f64,
    /// EMA weight of a new sample, in (0, 1].
    pub alpha: f64,
    /// Completions collected before the EMA is seeded with their mean.
    pub warmup_completions: u32,
    /// Half-life of the idle decay while pressured.
    pub decay_half_life: Duration,
    /// Window after clearing during which every second store is dropped.
    pub cooldown: Duration,
    /// Consecutive failed cascades that trip the pressure (`None`: failures ignored).
    pub failure_threshold: Option<u32>,
    /// Drop policy.
    pub policy: DropPolicy,
}

impl EmaConfig {
    /// Watermarks for a tier: `obj` or a REMOTE tier → NETWORK, otherwise LOCAL.
    pub fn default_for(tier_type: &str, locality: Option<Locality>) -> Self {
        let network = locality == Some(Locality::Remote) || tier_type == "obj";
        let (high, low) = if network {
            (0.020, 0.005)
        } else {
            (0.005, 0.001)
        };
        Self {
            high_water_s: high,
            low_water_s: low,
            alpha: 0.3,
            warmup_completions: 3,
            decay_half_life: Duration::from_secs(2),
            cooldown: Duration::from_secs(1),
            failure_threshold: None,
            policy: DropPolicy::default(),
        }
    }

    /// Whether a tier type/locality maps to the NETWORK preset.
    pub fn is_network(tier_type: &str, locality: Option<Locality>) -> bool {
        locality == Some(Locality::Remote) || tier_type == "obj"
    }
}

/// EMA backpressure detector with its drop policy.
#[derive(Clone, Debug)]
pub struct BackpressureDetector {
    cfg: EmaConfig,
    ema: f64,
    under_pressure: bool,
    completions: u32,
    warmup_sum: f64,
    last_update: Option<Instant>,
    healthy_streak: u32,
    cleared_at: Option<Instant>,
    cooldown_count: u32,
    consecutive_failures: u32,
    failure_tripped: bool,
    drop_accumulator: f64,
    stores_dropped: u64,
    blocks_dropped: u64,
}

impl BackpressureDetector {
    /// Validates alpha ∈ (0, 1], low ≤ high, failure threshold ≥ 1.
    pub fn new(cfg: EmaConfig) -> Result<Self> {
        if !(cfg.alpha > 0.0 && cfg.alpha <= 1.0) {
            return Err(TieringError::Config(format!(
                "backpressure alpha must be in (0, 1], got {}",
                cfg.alpha
            )));
        }
        if cfg.low_water_s > cfg.high_water_s {
            return Err(TieringError::Config(format!(
                "backpressure low_water_s ({}) must be <= high_water_s ({})",
                cfg.low_water_s, cfg.high_water_s
            )));
        }
        if cfg.failure_threshold == Some(0) {
            return Err(TieringError::Config(
                "backpressure failure_threshold must be >= 1".into(),
            ));
        }
        Ok(Self {
            cfg,
            ema: 0.0,
            under_pressure: false,
            completions: 0,
            warmup_sum: 0.0,
            last_update: None,
            healthy_streak: 0,
            cleared_at: None,
            cooldown_count: 0,
            consecutive_failures: 0,
            failure_tripped: false,
            drop_accumulator: 0.0,
            stores_dropped: 0,
            blocks_dropped: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EmaConfig {
        &self.cfg
    }

    /// Current EMA (s/MiB).
    pub fn store_latency_ema(&self) -> f64 {
        self.ema
    }

    /// Overrides the EMA (tests, operators).
    pub fn set_store_latency_ema(&mut self, v: f64) {
        self.ema = v;
    }

    /// Forces the pressured state with the EMA last updated at `at` (tests of idle decay).
    pub fn force_pressure(&mut self, ema: f64, at: Instant) {
        self.ema = ema;
        self.under_pressure = true;
        self.last_update = Some(at);
        self.completions = self.completions.max(self.cfg.warmup_completions);
    }

    /// A cascade of `num_bytes` finished after `elapsed`.
    pub fn on_store_completed(&mut self, elapsed: Duration, num_bytes: u64) {
        self.on_store_completed_at(elapsed, num_bytes, Instant::now())
    }

    /// As [`Self::on_store_completed`] with an explicit clock.
    pub fn on_store_completed_at(&mut self, elapsed: Duration, num_bytes: u64, now: Instant) {
        if num_bytes == 0 {
            return;
        }
        let s = elapsed.as_secs_f64() / (num_bytes as f64 / MIB);
        self.consecutive_failures = 0;
        self.completions += 1;
        if self.completions <= self.cfg.warmup_completions {
            self.warmup_sum += s;
            if self.completions == self.cfg.warmup_completions {
                self.ema = self.warmup_sum / self.completions as f64;
                self.last_update = Some(now);
            }
            return;
        }
        self.ema = self.cfg.alpha * s + (1.0 - self.cfg.alpha) * self.ema;
        self.last_update = Some(now);
        if self.ema > self.cfg.high_water_s {
            self.under_pressure = true;
            self.cleared_at = None;
            self.healthy_streak = 0;
        } else if self.ema < self.cfg.low_water_s {
            if self.under_pressure {
                self.cleared_at = Some(now);
                self.cooldown_count = 0;
            }
            self.under_pressure = false;
            self.failure_tripped = false;
            self.healthy_streak += 1;
        } else {
            self.healthy_streak = 0;
        }
    }

    /// `update(submit_time, bytes)`: a completion measured from its submit time (ignored for 0 bytes).
    pub fn update(&mut self, submit_time: Instant, num_bytes: u64) {
        if num_bytes == 0 {
            return;
        }
        let now = Instant::now();
        self.on_store_completed_at(now.saturating_duration_since(submit_time), num_bytes, now);
    }

    /// A cascade failed.
    pub fn on_store_failed(&mut self) {
        let Some(th) = self.cfg.failure_threshold else {
            return;
        };
        self.consecutive_failures += 1;
        self.healthy_streak = 0;
        if self.consecutive_failures < th {
            return;
        }
        self.ema = f64::max(self.ema, self.cfg.high_water_s * FAILURE_EMA_FACTOR);
        self.last_update = Some(Instant::now());
        self.under_pressure = true;
        self.failure_tripped = true;
        self.cleared_at = None;
    }

    /// Whether the tier is pressured now (applies idle decay while pressured).
    pub fn is_under_pressure(&mut self) -> bool {
        self.is_under_pressure_at(Instant::now())
    }

    /// As [`Self::is_under_pressure`] with an explicit clock.
    pub fn is_under_pressure_at(&mut self, now: Instant) -> bool {
        if self.under_pressure
            && (self.completions >= self.cfg.warmup_completions || self.failure_tripped)
        {
            if let Some(last) = self.last_update {
                let dt = now.saturating_duration_since(last).as_secs_f64();
                let hl = self.cfg.decay_half_life.as_secs_f64();
                if dt > 0.0 && hl > 0.0 {
                    self.ema *= 0.5f64.powf(dt / hl);
                    self.last_update = Some(now);
                }
            }
            if self.ema < self.cfg.low_water_s {
                self.under_pressure = false;
                self.failure_tripped = false;
                self.cleared_at = Some(now);
                self.cooldown_count = 0;
            }
        }
        self.under_pressure
    }

    /// ≥ 10 consecutive sub-low completions and not pressured.
    pub fn is_healthy(&self) -> bool {
        !self.under_pressure && self.healthy_streak >= HEALTHY_THRESHOLD
    }

    fn policy_should_store(&mut self, now: Instant) -> bool {
        if !self.is_under_pressure_at(now) {
            return true;
        }
        match self.cfg.policy {
            DropPolicy::DropAll => false,
            DropPolicy::Throttled { ramp_factor } => {
                let high = self.cfg.high_water_s;
                if high <= 0.0 {
                    return false;
                }
                let overshoot = f64::max(0.0, self.ema - high) / high;
                let rate = f64::min(1.0, overshoot / ramp_factor);
                if rate <= 0.0 {
                    return true;
                }
                if rate >= 1.0 {
                    return false;
                }
                self.drop_accumulator += rate;
                if self.drop_accumulator >= 1.0 {
                    self.drop_accumulator -= 1.0;
                    return false;
                }
                true
            }
        }
    }

    fn skipped(&mut self, blocks: usize) {
        self.stores_dropped += 1;
        self.blocks_dropped += blocks as u64;
    }

    /// Whether a cascade of `num_blocks` should go ahead (records a skip when not).
    pub fn should_store(&mut self, num_blocks: usize) -> bool {
        self.should_store_at(num_blocks, Instant::now())
    }

    /// As [`Self::should_store`] with an explicit clock.
    pub fn should_store_at(&mut self, num_blocks: usize, now: Instant) -> bool {
        let pressured = self.is_under_pressure_at(now);
        if self.is_healthy() {
            return true;
        }
        if !pressured
            && let Some(c) = self.cleared_at
            && now.saturating_duration_since(c) < self.cfg.cooldown
        {
            self.cooldown_count += 1;
            if self.cooldown_count.is_multiple_of(2) {
                self.skipped(num_blocks);
                return false;
            }
        }
        if !self.policy_should_store(now) {
            self.skipped(num_blocks);
            return false;
        }
        true
    }

    /// (stores dropped, blocks dropped) since the last call.
    pub fn pop_stores_dropped(&mut self) -> (u64, u64) {
        let r = (self.stores_dropped, self.blocks_dropped);
        self.stores_dropped = 0;
        self.blocks_dropped = 0;
        r
    }

    /// Back to the initial state.
    pub fn reset(&mut self) {
        let cfg = self.cfg;
        *self = Self::new(cfg).expect("validated at construction");
    }
}
