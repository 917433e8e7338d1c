//! `cargo xtask bench tiering`: lookup rate, store+complete with two secondary tiers, and a full
//! scheduler step of 256 requests × 64 chunks (cold, warm, all-promote), the step sequence the
//! vLLM script measures (`vllm-manager-replay.py`, `run_step`). Each step's calls are also
//! written to `target/bench/tiering-ops.jsonl` in the replay format, so the same sequence can be
//! replayed against vLLM. Prints JSON; baselines (a bare hashbrown probe loop) run in the same
//! process. Figures are medians over rounds; each step scenario also says where its time goes
//! (`step`, over kvbm-tiering's `InMemoryTier`; `step_own`, the same over a tier that answers
//! without holding anything, so the manager's own cost: the in-memory tier's set grows by a
//! step's 16384 keys each cold step, a cost a real tier bounds and pays its own way)
//! (`phases_us_share`: per phase, microseconds per step and the share of the step) and how many
//! heap allocations each phase made (`allocs_per_step`: the bench counts them through its global
//! allocator; a step should make none per chunk).
//!
//! Flags: `--steps-only` (the step scenarios, one round of the rates), `--steps N` (measured
//! steps per scenario, default 10), `--only NAME` (one scenario, the others reported as zero: to
//! profile it). `cargo xtask bench tiering --against REV` runs this bench of the working tree
//! and of `REV` alternately and prints both medians and their ratio.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Instant;

use hashbrown::HashMap;
use kvbm_tiering::*;

/// Counts heap allocations (a step should make none per chunk: `allocs_per_step`).
struct Counting;

static ALLOCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.load(std::sync::atomic::Ordering::Relaxed)
}

const N: usize = 16384;
const NREQ: usize = 256;
const NCHUNK: usize = 64;

/// CPU time of this thread (the machine is shared: wall time includes waiting for a core).
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_THREAD_CPUTIME_ID is supported on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn keys(base: u64, n: usize) -> Vec<OffloadKey> {
    (0..n as u64)
        .map(|i| OffloadKey::from_u64(base + i))
        .collect()
}

/// A secondary tier that answers without holding anything: every lookup `answer`, every job
/// finished at the next poll. Under it a step costs the manager's own work alone: the
/// in-memory tier's key set grows by 16384 keys a cold step, which a real tier would bound
/// and index its own way (the `step_own` figures).
struct Answering {
    answer: LookupResult,
    done: Vec<JobResult>,
}

impl SecondaryTierManager for Answering {
    fn tier_type(&self) -> &str {
        "answering"
    }
    fn block_size_bytes(&self) -> usize {
        64
    }
    fn lookup(&mut self, _: &OffloadKey, _: &ReqContext) -> LookupResult {
        self.answer
    }
    fn submit_store(&mut self, job: std::sync::Arc<TierJob>) {
        self.done.push(JobResult::new(job.job_id, true));
    }
    fn submit_load(&mut self, job: std::sync::Arc<TierJob>) {
        self.done.push(JobResult::new(job.job_id, true));
    }
    fn get_finished_jobs(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.done);
    }
    fn drain_jobs(&mut self) -> kvbm_tiering::Result<()> {
        Ok(())
    }
    fn on_new_request(&mut self, _: &ReqContext) -> RequestOffloadingContext {
        RequestOffloadingContext::default()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Which secondary tier a step scenario runs over.
#[derive(Clone, Copy, PartialEq)]
enum Tier {
    /// kvbm-tiering's `InMemoryTier` (a growing key set).
    Memory,
    /// [`Answering`]: `MISS` while a scenario is prepared, then `HIT` in promote, `MISS`
    /// otherwise.
    Answering,
}

/// The step scenarios' manager: a primary of `N` chunks over one tier of `kind`.
fn step_manager(kind: Tier) -> TieringOffloadingManager {
    match kind {
        Tier::Memory => tiering(N, 1),
        Tier::Answering => tiering_over(
            N,
            vec![Box::new(Answering {
                answer: LookupResult::Miss,
                done: Vec::new(),
            })],
        ),
    }
}

/// A tiering manager of `n` primary chunks (vLLM's behaviour exactly) over `tiers`.
fn tiering_over(n: usize, tiers: Vec<Box<dyn SecondaryTierManager>>) -> TieringOffloadingManager {
    let mut cfg = TieringConfig::new(n, 64);
    cfg.fixes = UpstreamFixes::upstream();
    TieringOffloadingManager::new(cfg, tiers).unwrap()
}

fn tiering(n: usize, tiers: usize) -> TieringOffloadingManager {
    tiering_over(
        n,
        (0..tiers)
            .map(|_| Box::new(InMemoryTier::new(64)) as Box<dyn SecondaryTierManager>)
            .collect(),
    )
}

fn fill(m: &mut dyn OffloadingManager, ks: &[OffloadKey]) {
    let c = ReqContext::new("fill");
    m.on_new_request(&c).unwrap();
    for ch in ks.chunks(64) {
        let o = m.prepare_store(ch, &c).unwrap().unwrap();
        m.complete_store(&o.keys_to_store, &c, true).unwrap();
    }
    m.on_request_finished(&c).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// Million lookups per second over `ks` (all resident), thread CPU time, median of rounds.
fn lookup_rate(m: &mut dyn OffloadingManager, ks: &[OffloadKey], rounds: usize) -> f64 {
    let c = ReqContext::new("lookup");
    let reps = 40;
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let t = thread_cpu();
        let mut hits = 0usize;
        for _ in 0..reps {
            for k in ks {
                hits += (m.lookup(k, &c) == LookupResult::Hit) as usize;
            }
        }
        black_box(hits);
        rates.push((reps * ks.len()) as f64 / (thread_cpu() - t) / 1e6);
    }
    median(rates)
}

/// The same loop over a bare `hashbrown::HashMap<OffloadKey, u32>` (the floor of any lookup).
fn raw_probe_rate(ks: &[OffloadKey], rounds: usize) -> f64 {
    let map: HashMap<OffloadKey, u32> =
        ks.iter().enumerate().map(|(i, k)| (*k, i as u32)).collect();
    let reps = 40;
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let t = thread_cpu();
        let mut s = 0u64;
        for _ in 0..reps {
            for k in ks {
                s += *map.get(k).unwrap() as u64;
            }
        }
        black_box(s);
        rates.push((reps * ks.len()) as f64 / (thread_cpu() - t) / 1e6);
    }
    median(rates)
}

/// store+complete one chunk at a time into a full primary (eviction each time), k/s.
fn store_rate(m: &mut dyn OffloadingManager, base: u64, rounds: usize, step_every: usize) -> f64 {
    let c = ReqContext::new("store");
    m.on_new_request(&c).unwrap();
    let mut next = base;
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let n = 20_000;
        let t = thread_cpu();
        for i in 0..n {
            let k = [OffloadKey::from_u64(next)];
            next += 1;
            let o = m.prepare_store(&k, &c).unwrap().unwrap();
            m.complete_store(&o.keys_to_store, &c, true).unwrap();
            if step_every > 0 && i % step_every == step_every - 1 {
                m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
            }
        }
        rates.push(n as f64 / (thread_cpu() - t) / 1e3);
    }
    median(rates)
}

/// Where a step's time goes, in seconds, by phase (clock read at phase boundaries only: a few
/// readings per request, not per chunk): `on_new_request` and `on_request_finished`; `lookup`
/// of every chunk; `prepare_load` + `complete_load` of the hits; `prepare_store` +
/// `complete_store` of the misses (and the cascade to the tier); `on_schedule_end` and
/// `get_stats`.
/// Also the heap allocations each phase made (`allocs`).
#[derive(Clone, Copy, Default)]
struct Phases([f64; 5], [u64; 5]);

impl Phases {
    const NAMES: [&'static str; 5] = ["request", "lookup", "load", "store", "schedule_end"];
    const REQUEST: usize = 0;
    const LOOKUP: usize = 1;
    const LOAD: usize = 2;
    const STORE: usize = 3;
    const SCHEDULE_END: usize = 4;
}

/// A phase boundary: the clock and the allocation count.
struct Mark(Instant, u64);

impl Mark {
    fn now() -> Self {
        Mark(Instant::now(), allocs())
    }
}

impl Phases {
    /// Adds `o`'s time and allocations, phase by phase.
    fn add(&mut self, o: &Phases) {
        for i in 0..5 {
            self.0[i] += o.0[i];
            self.1[i] += o.1[i];
        }
    }

    /// The time and allocations since `t` added to phase `i`, and `t` moved to now.
    fn lap(&mut self, i: usize, t: &mut Mark) {
        let now = Mark::now();
        self.0[i] += now.0.duration_since(t.0).as_secs_f64();
        self.1[i] += now.1 - t.1;
        *t = now;
    }
}

/// One scheduler step as the vLLM script's `run_step`; optionally records the calls (JSONL).
fn run_step(
    m: &mut TieringOffloadingManager,
    reqs: &[&[OffloadKey]],
    step: usize,
    rec: Option<&mut String>,
    counts: &mut [usize; 4],
) {
    run_step_timed(m, reqs, step, rec, counts, &mut Phases::default());
}

/// [`run_step`], its time by phase added to `phases`.
fn run_step_timed(
    m: &mut TieringOffloadingManager,
    reqs: &[&[OffloadKey]],
    step: usize,
    rec: Option<&mut String>,
    counts: &mut [usize; 4],
    phases: &mut Phases,
) {
    let mut rec = rec;
    let mut t;
    let mut new_ids = Vec::with_capacity(reqs.len());
    let id = |k: &OffloadKey| k.to_string();
    let list = |ks: &[OffloadKey]| ks.iter().map(id).collect::<Vec<_>>().join(", ");
    let mut hits = Vec::with_capacity(NCHUNK);
    let mut misses = Vec::with_capacity(NCHUNK);
    for (i, ks) in reqs.iter().enumerate() {
        let rid = format!("s{step}r{i}");
        let c = ReqContext::new(rid.as_str());
        t = Mark::now();
        m.on_new_request(&c).unwrap();
        phases.lap(Phases::REQUEST, &mut t);
        new_ids.push(rid.clone());
        hits.clear();
        misses.clear();
        for k in ks.iter() {
            let r = m.lookup(k, &c);
            counts[r as usize] += 1;
            if let Some(o) = rec.as_deref_mut() {
                writeln!(
                    o,
                    r#"{{"method": "lookup", "req": "{rid}", "keys": [{}]}}"#,
                    id(k)
                )
                .unwrap();
            }
            match r {
                LookupResult::Hit => hits.push(*k),
                LookupResult::Miss => misses.push(*k),
                _ => {}
            }
        }
        phases.lap(Phases::LOOKUP, &mut t);
        if !hits.is_empty() {
            m.prepare_load(&hits, &c).unwrap();
            m.complete_load(&hits, &c).unwrap();
            phases.lap(Phases::LOAD, &mut t);
            if let Some(o) = rec.as_deref_mut() {
                writeln!(
                    o,
                    r#"{{"method": "prepare_load", "req": "{rid}", "keys": [{}]}}"#,
                    list(&hits)
                )
                .unwrap();
                writeln!(
                    o,
                    r#"{{"method": "complete_load", "req": "{rid}", "keys": [{}]}}"#,
                    list(&hits)
                )
                .unwrap();
            }
        }
        if !misses.is_empty() {
            if let Some(o) = m.prepare_store(&misses, &c).unwrap()
                && !o.keys_to_store.is_empty()
            {
                m.complete_store(&o.keys_to_store, &c, true).unwrap();
            }
            phases.lap(Phases::STORE, &mut t);
            if let Some(o) = rec.as_deref_mut() {
                writeln!(
                    o,
                    r#"{{"method": "prepare_store", "req": "{rid}", "keys": [{}]}}"#,
                    list(&misses)
                )
                .unwrap();
                writeln!(o, r#"{{"method": "complete_store", "req": "{rid}"}}"#).unwrap();
            }
        }
        t = Mark::now();
        m.on_request_finished(&c).unwrap();
        phases.lap(Phases::REQUEST, &mut t);
        if let Some(o) = rec.as_deref_mut() {
            writeln!(o, r#"{{"method": "on_request_finished", "req": "{rid}"}}"#).unwrap();
        }
    }
    t = Mark::now();
    m.on_schedule_end(&ScheduleEndContext {
        new_req_ids: new_ids,
        preempted_req_ids: Vec::new(),
    })
    .unwrap();
    black_box(m.get_stats());
    phases.lap(Phases::SCHEDULE_END, &mut t);
    if let Some(o) = rec {
        writeln!(o, r#"{{"method": "on_schedule_end"}}"#).unwrap();
    }
}

struct StepResult {
    name: &'static str,
    us_median: f64,
    us_min: f64,
    cpu_us_median: f64,
    counts: [usize; 4],
    /// Mean per measured step, by phase.
    phases: Phases,
}

fn step_scenario(
    name: &'static str,
    steps: usize,
    warmup: usize,
    key_sets: &mut dyn FnMut(usize) -> Vec<OffloadKey>,
    prepare: &mut dyn FnMut(&mut TieringOffloadingManager),
    rec: &mut String,
    tier: Tier,
) -> StepResult {
    // `--only NAME`: the other scenarios are skipped (reported as zero), to profile one
    // (`cold`: over either tier; `own.cold`: over the answering tier only).
    let args: Vec<String> = std::env::args().collect();
    let full = match tier {
        Tier::Memory => name.to_string(),
        Tier::Answering => format!("own.{name}"),
    };
    if let Some(only) = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        && *only != name
        && *only != full
    {
        return StepResult {
            name,
            us_median: 0.0,
            us_min: 0.0,
            cpu_us_median: 0.0,
            counts: [0; 4],
            phases: Phases::default(),
        };
    }
    // `HIT` from an answering tier once prepared, where the scenario's keys are in the tier.
    let answer = |m: &mut TieringOffloadingManager| {
        if tier == Tier::Answering && name == "promote" {
            m.tier_mut::<Answering>(0).unwrap().answer = LookupResult::Hit;
        }
    };
    // recorded, untimed pass of the same sequence (over the in-memory tier: the file replays
    // against vLLM's manager over its own in-memory tier)
    if tier == Tier::Memory {
        let mut m = step_manager(tier);
        prepare(&mut m);
        let mut counts = [0usize; 4];
        for s in 0..warmup + steps {
            let ks = key_sets(s);
            let reqs: Vec<&[OffloadKey]> = ks.chunks(NCHUNK).collect();
            // record the warm-up steps and the first measured one, from a fresh manager, so
            // the file replays the same states (the primary is full from the second step on)
            let r = if s <= warmup { Some(&mut *rec) } else { None };
            run_step(&mut m, &reqs, s, r, &mut counts);
        }
    }
    // timed pass
    let mut m = step_manager(tier);
    prepare(&mut m);
    answer(&mut m);
    let mut times = Vec::new();
    let mut cpu_times = Vec::new();
    let mut counts = [0usize; 4];
    let mut phases = Phases::default();
    for s in 0..warmup + steps {
        let ks = key_sets(s + 1_000_000);
        let reqs: Vec<&[OffloadKey]> = ks.chunks(NCHUNK).collect();
        let mut c = [0usize; 4];
        let mut p = Phases::default();
        let t = Instant::now();
        let tc = thread_cpu();
        run_step_timed(&mut m, &reqs, s, None, &mut c, &mut p);
        let dt = t.elapsed().as_secs_f64() * 1e6;
        let dc = (thread_cpu() - tc) * 1e6;
        if s >= warmup {
            times.push(dt);
            cpu_times.push(dc);
            phases.add(&p);
            for i in 0..4 {
                counts[i] += c[i];
            }
        }
    }
    let min = times.iter().cloned().fold(f64::MAX, f64::min);
    StepResult {
        name,
        us_median: median(times),
        us_min: min,
        cpu_us_median: median(cpu_times),
        counts,
        phases: Phases(
            phases.0.map(|v| v / steps.max(1) as f64),
            phases.1.map(|v| v / steps.max(1) as u64),
        ),
    }
}

fn main() {
    let per_step = NREQ * NCHUNK;
    // `--steps-only`: the step scenarios alone (to profile them: `perf record` over the rest
    // would mostly see the lookup and store rates).
    let args: Vec<String> = std::env::args().collect();
    let rounds = if args.iter().any(|a| a == "--steps-only") {
        1
    } else {
        7
    };
    // `--steps N`: measured steps per scenario (more samples for a profile).
    let steps = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse::<usize>().expect("--steps N"))
        .unwrap_or(10);
    // lookups
    let ks = keys(1, N);
    let mut cpu = TieringOffloadingManager::cpu(CpuManagerConfig::new(N));
    fill(&mut cpu, &ks);
    let cpu_rate = lookup_rate(&mut cpu, &ks, rounds);
    let raw_rate = raw_probe_rate(&ks, rounds);
    let mut t2 = tiering(N, 2);
    fill(&mut t2, &ks);
    let tier_rate = lookup_rate(&mut t2, &ks, rounds);
    // store + complete, one chunk at a time, into a full primary
    let mut cpu = TieringOffloadingManager::cpu(CpuManagerConfig::new(N));
    fill(&mut cpu, &ks);
    let cpu_store = store_rate(&mut cpu, 1 << 40, rounds, 0);
    let mut t2 = tiering(N, 2);
    fill(&mut t2, &ks);
    let tier_store = store_rate(&mut t2, 1 << 41, rounds, 64);

    // scheduler steps, over the in-memory tier (recorded) and over an answering one
    let mut rec = String::new();
    let warmup = 2;
    let scenarios = |tier: Tier, rec: &mut String| -> [StepResult; 3] {
        let cold = step_scenario(
            "cold",
            steps,
            warmup,
            &mut |s| keys(((s + 1) * per_step) as u64 * 7, per_step),
            &mut |_| {},
            rec,
            tier,
        );
        let warm_keys = keys(1 << 50, per_step);
        let wk = warm_keys.clone();
        let warm = step_scenario(
            "warm",
            steps,
            warmup,
            &mut |_| wk.clone(),
            &mut |m| {
                let reqs: Vec<&[OffloadKey]> = warm_keys.chunks(NCHUNK).collect();
                run_step(m, &reqs, usize::MAX, None, &mut [0; 4]);
            },
            &mut String::new(),
            tier,
        );
        let a = keys(1 << 52, per_step);
        let b = keys(1 << 53, per_step);
        let (a2, b2) = (a.clone(), b.clone());
        let promote = step_scenario(
            "promote",
            steps,
            warmup,
            &mut |s| if s % 2 == 0 { a2.clone() } else { b2.clone() },
            &mut |m| {
                for set in [&a, &b] {
                    let reqs: Vec<&[OffloadKey]> = set.chunks(NCHUNK).collect();
                    run_step(m, &reqs, usize::MAX - 1, None, &mut [0; 4]);
                }
            },
            &mut String::new(),
            tier,
        );
        [cold, warm, promote]
    };
    let [cold, warm, promote] = scenarios(Tier::Memory, &mut rec);
    let own = scenarios(Tier::Answering, &mut String::new());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiering-ops.jsonl");
    std::fs::write(&path, &rec).unwrap();

    let step_json = |r: &StepResult| {
        // Each phase's mean time per step and its share of the phases' sum.
        let p = r.phases.0;
        let total: f64 = p.iter().sum::<f64>().max(1e-12);
        let phases = Phases::NAMES
            .iter()
            .zip(p)
            .map(|(n, v)| format!(r#""{n}": [{:.1}, {:.3}]"#, v * 1e6, v / total))
            .collect::<Vec<_>>()
            .join(", ");
        // The manager's heap allocations per step, by phase (the bench's own, a request id
        // and its context per request, fall between the phases).
        let allocs = Phases::NAMES
            .iter()
            .zip(r.phases.1)
            .map(|(n, v)| format!(r#""{n}": {v}"#))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            r#"{{"scenario": "{}", "requests": {NREQ}, "chunks_per_request": {NCHUNK}, "us_per_step": {:.1}, "us_per_step_min": {:.1}, "cpu_us_per_step": {:.1}, "ns_per_chunk": {:.1}, "goal_us": 1000, "phases_us_share": {{{phases}}}, "allocs_per_step": {{{allocs}}}, "lookups": {{"MISS": {}, "HIT": {}, "HIT_PENDING": {}, "RETRY": {}}}}}"#,
            r.name,
            r.us_median,
            r.us_min,
            r.cpu_us_median,
            r.cpu_us_median * 1e3 / per_step as f64,
            r.counts[0],
            r.counts[1],
            r.counts[2],
            r.counts[3]
        )
    };
    println!(
        r#"{{"bench": "kvbm-tiering", "num_chunks": {N},
  "lookup_mps": {{"cpu_manager": {cpu_rate:.1}, "tiering_2_tiers": {tier_rate:.1}, "baseline_raw_hashbrown_probe": {raw_rate:.1}, "ratio_cpu_to_raw": {:.3}, "goal": 30.0}},
  "store_complete_kps": {{"cpu_manager": {cpu_store:.1}, "tiering_2_tiers": {tier_store:.1}}},
  "step": [{}, {}, {}],
  "step_own": [{}, {}, {}],
  "recorded_sequence": "{}"}}"#,
        cpu_rate / raw_rate,
        step_json(&cold),
        step_json(&warm),
        step_json(&promote),
        step_json(&own[0]),
        step_json(&own[1]),
        step_json(&own[2]),
        path.display()
    );
}
