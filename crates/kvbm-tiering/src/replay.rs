//! Replays a recorded call sequence (the JSONL format of `vllm-manager-replay.py`) against a
//! kvbm manager and writes one JSON line per call exactly as that script's `--replay-out` does,
//! so the two outputs can be diffed line for line.
//!
//! Format (one object per line): `method` (`on_new_request`, `lookup`, `prepare_load`,
//! `complete_load`, `touch`, `prepare_store`, `complete_store`, `on_request_finished`,
//! `on_schedule_end`, `reset_cache`, `take_events`), `req`, `keys` (ints → 8-byte big-endian,
//! strings → UTF-8; group 0), `success`, `unless_deferred`. A request seen first gets an implicit
//! `on_new_request`; `lookup` scans like vLLM's connector (stops after the first `MISS`);
//! omitted keys are the scheduler's own choice (see the script's header). Output lines are
//! `{"line", "method", "req", "ok", "result"}` serialised like Python's `json.dumps`.

use std::collections::HashMap as StdHashMap;
use std::collections::VecDeque;

use serde_json::Value;

use crate::cpu::{CachePolicyKind, CpuManagerConfig};
use crate::error::{Result, TieringError};
use crate::key::OffloadKey;
use crate::manager::OffloadingManager;
use crate::tiering::{InMemoryTier, TieringConfig, TieringOffloadingManager, UpstreamFixes};
use crate::types::{Contract, LookupResult, ReqContext, ScheduleEndContext};

/// Which manager answers the calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayManager {
    /// `CpuOffloadingManager` of N chunks.
    Cpu,
    /// CPU primary of N chunks + one in-memory secondary tier, polled every step.
    Tiering,
}

/// Replay options.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Manager kind.
    pub manager: ReplayManager,
    /// Primary capacity in chunks.
    pub capacity: usize,
    /// Eviction policy.
    pub policy: CachePolicyKind,
    /// Turn kvbm's upstream-bug fixes off.
    pub upstream_compatible: bool,
    /// `complete_store` completes the keys of this manager's oldest unmatched `prepare_store`.
    pub follow_prepare: bool,
    /// The vLLM contract the managers follow (a 0.34 sequence has no `touch`).
    pub contract: Contract,
}

/// Counts of a replay.
#[derive(Clone, Debug, Default)]
pub struct ReplaySummary {
    /// Calls replayed.
    pub calls: usize,
    /// Calls that returned an error.
    pub errors: usize,
    /// First few errors.
    pub first_errors: Vec<String>,
    /// Implicit `on_new_request` calls.
    pub implicit_new_requests: usize,
    /// `prepare_store` calls answered `None`.
    pub prepare_store_rejected: usize,
    /// `complete_store` calls skipped (nothing prepared).
    pub complete_store_skipped: usize,
    /// Lookup results by name.
    pub lookup_results: StdHashMap<&'static str, usize>,
}

struct Call {
    line: usize,
    method: String,
    req: String,
    keys: Option<Vec<OffloadKey>>,
    success: bool,
    unless_deferred: bool,
}

/// Converts one replay key (int or string) to an [`OffloadKey`].
pub fn to_key(v: &Value) -> Result<OffloadKey> {
    match v {
        Value::Number(n) => {
            let id = n.as_u64().ok_or_else(|| {
                TieringError::Config(format!("replay key {n} is not an unsigned 64-bit integer"))
            })?;
            Ok(OffloadKey::from_u64(id))
        }
        Value::String(s) => Ok(crate::key::make_offload_key(s.as_bytes(), 0)?),
        other => Err(TieringError::Config(format!(
            "replay key {other} is neither an integer nor a string"
        ))),
    }
}

fn py_str(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => {
            if v.is_none() {
                String::new()
            } else {
                "None".into()
            }
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => if *b { "True" } else { "False" }.into(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => other.to_string(),
    }
}

/// An output value with ordered object fields (Python dicts keep insertion order).
#[derive(Clone, Debug)]
pub enum J {
    /// `null`.
    Null,
    /// A string.
    Str(String),
    /// A boolean.
    Bool(bool),
    /// A list.
    Arr(Vec<J>),
    /// An object, fields in order.
    Obj(Vec<(&'static str, J)>),
    /// A value echoed from the input.
    Raw(Value),
}

/// Serialises a [`J`] like Python's `json.dumps`.
pub fn py_dumps_j(v: &J) -> String {
    let mut s = String::new();
    dump_j(v, &mut s);
    s
}

fn dump_j(v: &J, out: &mut String) {
    match v {
        J::Null => out.push_str("null"),
        J::Str(s) => dump(&Value::String(s.clone()), out),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Raw(v) => dump(v, out),
        J::Arr(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump_j(x, out);
            }
            out.push(']');
        }
        J::Obj(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(&Value::String((*k).to_string()), out);
                out.push_str(": ");
                dump_j(x, out);
            }
            out.push('}');
        }
    }
}

/// Serialises like Python's `json.dumps` (", " / ": " separators, ASCII-only strings).
pub fn py_dumps(v: &Value) -> String {
    let mut s = String::new();
    dump(v, &mut s);
    s
}

fn dump(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => {
            out.push('"');
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    '\u{08}' => out.push_str("\\b"),
                    '\u{0c}' => out.push_str("\\f"),
                    c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            out.push_str(&format!("\\u{u:04x}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(x, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(&Value::String(k.clone()), out);
                out.push_str(": ");
                dump(x, out);
            }
            out.push('}');
        }
    }
}

fn parse(text: &str) -> Result<(Vec<Call>, StdHashMap<OffloadKey, Value>)> {
    let mut calls = Vec::new();
    let mut orig = StdHashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let o: Value = serde_json::from_str(line)
            .map_err(|e| TieringError::Config(format!("replay line {}: {e}", i + 1)))?;
        let method = o
            .get("method")
            .and_then(Value::as_str)
            .ok_or_else(|| TieringError::Config(format!("replay line {}: no method", i + 1)))?
            .to_string();
        let keys = match o.get("keys") {
            None => None,
            Some(Value::Array(ks)) => {
                let mut v = Vec::with_capacity(ks.len());
                for k in ks {
                    let key = to_key(k)?;
                    orig.insert(key, k.clone());
                    v.push(key);
                }
                Some(v)
            }
            Some(other) => {
                return Err(TieringError::Config(format!(
                    "replay line {}: keys {other} is not a list",
                    i + 1
                )));
            }
        };
        let truthy = |v: Option<&Value>, d: bool| match v {
            None => d,
            Some(Value::Bool(b)) => *b,
            Some(Value::Null) => false,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(m)) => !m.is_empty(),
        };
        calls.push(Call {
            line: i + 1,
            method,
            req: py_str(o.get("req")),
            keys,
            success: truthy(o.get("success"), true),
            unless_deferred: truthy(o.get("unless_deferred"), false),
        });
    }
    Ok((calls, orig))
}

/// Builds the manager a replay runs against.
pub fn build_manager(opts: &ReplayOptions) -> Result<Box<dyn OffloadingManager>> {
    let cpu = CpuManagerConfig::new(opts.capacity)
        .policy(opts.policy)
        .events(true)
        .contract(opts.contract);
    Ok(match opts.manager {
        ReplayManager::Cpu => Box::new(TieringOffloadingManager::cpu(cpu)),
        ReplayManager::Tiering => {
            let mut cfg = TieringConfig::new(opts.capacity, 64);
            cfg.primary = cpu;
            cfg.fixes = if opts.upstream_compatible {
                UpstreamFixes::upstream()
            } else {
                UpstreamFixes::default()
            };
            Box::new(TieringOffloadingManager::new(
                cfg,
                vec![Box::new(InMemoryTier::new(64))],
            )?)
        }
    })
}

/// Replays `text` (JSONL) against a fresh manager; returns the output lines and a summary.
pub fn replay(text: &str, opts: &ReplayOptions) -> Result<(String, ReplaySummary)> {
    let mut m = build_manager(opts)?;
    replay_on(m.as_mut(), text, opts.follow_prepare)
}

/// Replays `text` against `m`.
pub fn replay_on(
    m: &mut dyn OffloadingManager,
    text: &str,
    follow_prepare: bool,
) -> Result<(String, ReplaySummary)> {
    let (calls, orig) = parse(text)?;
    let okey = |k: &OffloadKey| J::Raw(orig.get(k).cloned().unwrap_or(Value::Null));
    let mut out = String::new();
    let mut sum = ReplaySummary {
        calls: calls.len(),
        ..Default::default()
    };
    let mut ctxs: StdHashMap<String, ReqContext> = StdHashMap::new();
    let mut new_since_step: Vec<String> = Vec::new();
    let mut prepared: StdHashMap<String, VecDeque<Vec<OffloadKey>>> = StdHashMap::new();
    let mut last_lookup: StdHashMap<String, Vec<(OffloadKey, LookupResult)>> = StdHashMap::new();
    let mut loading: StdHashMap<String, VecDeque<Vec<OffloadKey>>> = StdHashMap::new();
    let deferred_of = |ll: &StdHashMap<String, Vec<(OffloadKey, LookupResult)>>, req: &str| {
        ll.get(req).is_some_and(|v| {
            v.iter()
                .any(|(_, r)| matches!(r, LookupResult::HitPending | LookupResult::Retry))
        })
    };
    let line = |out: &mut String, c: &Call, ok: bool, result: J| {
        let o = J::Obj(vec![
            ("line", J::Raw(Value::from(c.line))),
            ("method", J::Str(c.method.clone())),
            ("req", J::Str(c.req.clone())),
            ("ok", J::Bool(ok)),
            ("result", result),
        ]);
        out.push_str(&py_dumps_j(&o));
        out.push('\n');
    };
    for c in &calls {
        if c.unless_deferred && deferred_of(&last_lookup, &c.req) {
            line(&mut out, c, true, J::Str("deferred".into()));
            continue;
        }
        let mut ctx = None;
        if c.method != "on_schedule_end" && c.method != "reset_cache" {
            let x = match ctxs.get(&c.req) {
                Some(x) => x.clone(),
                None => {
                    let x = ReqContext::new(c.req.as_str());
                    ctxs.insert(c.req.clone(), x.clone());
                    new_since_step.push(c.req.clone());
                    if c.method != "on_new_request" {
                        sum.implicit_new_requests += 1;
                        if let Err(e) = m.on_new_request(&x) {
                            sum.errors += 1;
                            sum.first_errors
                                .push(format!("line {} implicit on_new_request: {e}", c.line));
                        }
                    }
                    x
                }
            };
            ctx = Some(x);
        }
        let r: Result<J> = (|| {
            let ctx = ctx.as_ref();
            let ctx_ = || ctx.expect("request call has a context");
            Ok(match c.method.as_str() {
                "on_new_request" => {
                    m.on_new_request(ctx_())?;
                    J::Null
                }
                "lookup" => {
                    let keys = c.keys.as_deref().unwrap_or(&[]);
                    let mut rec = Vec::new();
                    let mut seen = Vec::new();
                    for k in keys {
                        let r = m.lookup(k, ctx_());
                        *sum.lookup_results.entry(r.name()).or_insert(0) += 1;
                        rec.push(J::Str(r.name().into()));
                        seen.push((*k, r));
                        if r == LookupResult::Miss {
                            break;
                        }
                    }
                    last_lookup.insert(c.req.clone(), seen);
                    J::Arr(rec)
                }
                "prepare_load" => {
                    let keys: Vec<OffloadKey> = match &c.keys {
                        Some(k) => k.clone(),
                        None => {
                            if deferred_of(&last_lookup, &c.req) {
                                Vec::new()
                            } else {
                                last_lookup
                                    .get(&c.req)
                                    .map(|v| {
                                        v.iter()
                                            .filter(|(_, r)| *r == LookupResult::Hit)
                                            .map(|(k, _)| *k)
                                            .collect()
                                    })
                                    .unwrap_or_default()
                            }
                        }
                    };
                    if !keys.is_empty() {
                        m.prepare_load(&keys, ctx_())?;
                    }
                    let rec = J::Arr(keys.iter().map(okey).collect());
                    loading.entry(c.req.clone()).or_default().push_back(keys);
                    rec
                }
                "complete_load" => {
                    let keys = match &c.keys {
                        Some(k) => k.clone(),
                        None => loading
                            .get_mut(&c.req)
                            .and_then(VecDeque::pop_front)
                            .unwrap_or_default(),
                    };
                    if !keys.is_empty() {
                        m.complete_load(&keys, ctx_())?;
                    }
                    J::Null
                }
                "take_events" => {
                    let evs = m.take_events();
                    J::Arr(
                        evs.iter()
                            .map(|e| {
                                let keys = e
                                    .keys
                                    .iter()
                                    .map(|k| match orig.get(k) {
                                        Some(v) => J::Raw(v.clone()),
                                        None => J::Str(
                                            k.as_bytes()
                                                .iter()
                                                .map(|b| format!("{b:02x}"))
                                                .collect(),
                                        ),
                                    })
                                    .collect();
                                J::Obj(vec![
                                    ("keys", J::Arr(keys)),
                                    ("medium", J::Str(e.medium.name().into())),
                                    ("removed", J::Bool(e.removed)),
                                ])
                            })
                            .collect(),
                    )
                }
                "touch" => {
                    m.touch(c.keys.as_deref().unwrap_or(&[]), ctx_())?;
                    J::Null
                }
                "prepare_store" => {
                    let keys = c.keys.as_deref().unwrap_or(&[]);
                    let o = m.prepare_store(keys, ctx_())?;
                    let q = prepared.entry(c.req.clone()).or_default();
                    match o {
                        None => {
                            q.push_back(Vec::new());
                            sum.prepare_store_rejected += 1;
                            J::Null
                        }
                        Some(o) => {
                            q.push_back(o.keys_to_store.clone());
                            J::Obj(vec![
                                (
                                    "keys_to_store",
                                    J::Arr(o.keys_to_store.iter().map(okey).collect()),
                                ),
                                ("evicted", J::Arr(o.evicted_keys.iter().map(okey).collect())),
                            ])
                        }
                    }
                }
                "complete_store" => {
                    if c.keys.is_none() || follow_prepare {
                        let done = prepared
                            .get_mut(&c.req)
                            .and_then(VecDeque::pop_front)
                            .unwrap_or_default();
                        if done.is_empty() {
                            sum.complete_store_skipped += 1;
                        } else {
                            m.complete_store(&done, ctx_(), c.success)?;
                        }
                    } else {
                        m.complete_store(c.keys.as_deref().unwrap_or(&[]), ctx_(), c.success)?;
                    }
                    J::Null
                }
                "on_request_finished" => {
                    m.on_request_finished(ctx_())?;
                    ctxs.remove(&c.req);
                    J::Null
                }
                "on_schedule_end" => {
                    let sc = ScheduleEndContext {
                        new_req_ids: std::mem::take(&mut new_since_step),
                        preempted_req_ids: Vec::new(),
                    };
                    m.on_schedule_end(&sc)?;
                    let _ = m.get_stats();
                    J::Null
                }
                "reset_cache" => {
                    m.reset_cache()?;
                    J::Null
                }
                other => {
                    return Err(TieringError::Config(format!("unknown method {other:?}")));
                }
            })
        })();
        match r {
            Ok(v) => line(&mut out, c, true, v),
            Err(e) => {
                sum.errors += 1;
                if sum.first_errors.len() < 5 {
                    sum.first_errors
                        .push(format!("line {} {}: {e}", c.line, c.method));
                }
                line(&mut out, c, false, J::Null);
            }
        }
    }
    Ok((out, sum))
}
