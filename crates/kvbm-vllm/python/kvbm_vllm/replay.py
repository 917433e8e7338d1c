"""Call for call from Python: replays a recorded manager call sequence through kvbm's Python API.

    python -m kvbm_vllm.replay --calls FILE --manager cpu --capacity N --policy lru|arc \\
        --out FILE [--upstream-compatible] [--follow-prepare] [--vllm-src DIR] [--pydeps DIR]

The calls go to ``kvbm_vllm.upstream_compat.CPUOffloadingManager`` exactly as vLLM's scheduler
makes them: vLLM's ``ReqContext`` objects (one per request, kept until ``on_request_finished``),
``bytes`` keys from vLLM's ``make_offload_key``, vLLM's ``ScheduleEndContext``, and answers read
back from vLLM's objects (``LookupResult`` members, ``PrepareStoreOutput``,
``OffloadingEvent``). The output lines are those of kvbm-tiering's Rust replay
(``cargo run --release -p kvbm-tiering --example replay``, ``crates/kvbm-tiering/src/replay.rs``)
on the same arguments, byte for byte, so the two files can be compared with ``cmp``:

* input: JSONL, one call per line (``method``, ``req``, ``keys``, ``success``,
  ``unless_deferred``); an int key ``k`` is 8-byte big-endian ``k``, a string key its UTF-8
  bytes, then ``make_offload_key(hash, 0)``; a request seen first gets an implicit
  ``on_new_request``; ``lookup`` stops after the first ``MISS``; omitted keys are the
  scheduler's own choice (``prepare_load``: the HITs of the request's latest lookup, none if it
  deferred; ``complete_load`` / ``complete_store``: the oldest unmatched ``prepare_load`` /
  ``prepare_store`` of the request); ``on_schedule_end`` is followed by ``get_stats()``.
* output: ``{"line", "method", "req", "ok", "result"}`` per call, serialised by ``json.dumps``
  (the Rust side emulates it). A call the manager refuses (``ContractError``, vLLM's
  ``AssertionError``) is ``"ok": false`` and the replay goes on. An input the Rust replay
  rejects as a whole (bad JSON, no method, a key that is neither a u64 nor a string, a string
  key over 35 bytes) is rejected here too: exit 1, no output file.

Options beyond the Rust example's:

* ``--manager tiering``: kvbm's ``TieringOffloadingManager`` (``upstream_compat``) over a
  primary of ``--capacity`` 64-byte chunks and one in-memory Python tier with the Rust replay's
  ``InMemoryTier`` semantics (a set of keys, type ``mem``, medium CPU, every job reported at the
  next poll, a load succeeding iff the tier holds every key), as the Rust replay builds it.
* ``--upstream-compatible`` turns off kvbm's upstream-bug fixes; kvbm's CPU manager has none
  (the Rust replay applies the flag to the tiering manager only), so for ``cpu`` it is accepted
  and changes nothing, exactly as in the Rust replay.
* vLLM: a real vLLM installation (``import vllm`` works) is used as it is. Without one, the
  pure-Python ``vllm.v1.kv_offload`` modules extracted by the upstream test harness
  (``crates/kvbm-vllm/tests/upstream``) are used with that harness's stubs for torch and the
  heavy vLLM modules: ``--vllm-src DIR`` (default ``<repo>/target/peer/vllm-sdist/0.33.0``),
  the stubs from ``--stubs FILE`` (default ``<repo>/crates/kvbm-vllm/tests/upstream/stubs.py``),
  and the harness's pinned numpy etc. from ``--pydeps DIR`` (default ``<vllm-src>/../pydeps``,
  appended to ``sys.path`` only when numpy is missing). ``<repo>`` is the source checkout this
  file is in, else the first directory up from the current one that holds the harness. The
  harness creates these on its first run (``python3 crates/kvbm-vllm/tests/upstream/run.py
  --impl vllm``). Stubs are never installed when vLLM is importable.

Importing this module imports only the standard library; vLLM and the extension load in
``main``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time

__all__ = ["main", "ReplayInputError"]

# OffloadKey::MAX_LEN in kvbm-tiering: a string key's UTF-8 bytes + 4 (the group index).
_MAX_KEY_LEN = 39
_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)
# Rust's str::trim: Unicode White_Space (Python's str.strip also strips \x1c-\x1f).
_RUST_WS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_HARNESS = os.path.join("crates", "kvbm-vllm", "tests", "upstream")
_USAGE = (
    "usage: python -m kvbm_vllm.replay --calls FILE --manager cpu|tiering --capacity N "
    "--policy lru|arc --out FILE [--upstream-compatible] [--follow-prepare] [--vllm 0.33|0.34] "
    "[--vllm-src DIR] [--stubs FILE] [--pydeps DIR]"
)


class ReplayInputError(ValueError):
    """The call file is rejected as a whole (the Rust replay's `TieringError::Config`)."""


class _UnknownMethod(Exception):
    pass


# ------------------------------------------------------------------------------------------
# input: the Rust replay's parse (serde_json values, py_str, truthiness)
# ------------------------------------------------------------------------------------------
def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _check_json(v, line_no):
    """What serde_json refuses and Python's json accepts: lone surrogates, numbers out of f64
    range (Python's NaN / Infinity tokens are refused by parse_constant)."""
    if isinstance(v, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in v):
            raise ReplayInputError(f"replay line {line_no}: lone surrogate in a string")
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise ReplayInputError(f"replay line {line_no}: number out of range")
    elif isinstance(v, int) and not isinstance(v, bool) and not _I64_MIN <= v <= _U64_MAX:
        try:  # serde_json reads it as an f64
            float(v)
        except OverflowError:
            raise ReplayInputError(f"replay line {line_no}: number out of range") from None
    elif isinstance(v, list):
        for x in v:
            _check_json(x, line_no)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_json(k, line_no)
            _check_json(x, line_no)


def _rust_float(f: float) -> str:
    """serde_json's float formatting (zmij): shortest round-trip digits, fixed notation for
    decimal exponents -5..=15 (`1e15` -> `1000000000000000.0`), else `d.ddde+X` / `d.ddde-X` (unpadded: `1e-7`, `1e+16`)."""
    if f == 0.0:
        return "-0.0" if math.copysign(1.0, f) < 0 else "0.0"
    sign = "-" if f < 0 else ""
    mant, _, exp = repr(abs(f)).partition("e")
    ip, _, fp = mant.partition(".")
    digits = ip + fp
    point = len(ip) + int(exp or 0)  # value = 0.<digits> * 10**point
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    e = point - 1  # decimal exponent of the leading digit
    if -5 <= e <= 15:
        if len(digits) - 1 <= e:
            s = digits + "0" * (e + 1 - len(digits)) + ".0"
        elif e >= 0:
            s = digits[: e + 1] + "." + digits[e + 1 :]
        else:
            s = "0." + "0" * (-e - 1) + digits
    else:
        m = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        s = f"{m}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + s


def _rust_number(v) -> str:
    """serde_json's `Number::to_string` (ints within i64 / u64 exact, the rest as f64)."""
    if isinstance(v, int) and _I64_MIN <= v <= _U64_MAX:
        return str(v)
    return _rust_float(float(v))


def _rust_compact(v) -> str:
    """serde_json's `Value::to_string`: compact, non-ASCII kept, object keys sorted (no
    preserve_order feature: a BTreeMap)."""
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return _rust_number(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ",".join(_rust_compact(x) for x in v) + "]"
    return "{" + ",".join(
        json.dumps(k, ensure_ascii=False) + ":" + _rust_compact(v[k]) for k in sorted(v)
    ) + "}"


_MISSING = object()


def _py_str(v) -> str:
    """The Rust replay's `py_str` of a `req` field (its emulation of Python's `str`)."""
    if v is _MISSING:
        return ""
    if v is None:
        return "None"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, (int, float)):
        return _rust_number(v)
    return _rust_compact(v)


def _truthy(v, default: bool) -> bool:
    if v is _MISSING:
        return default
    if isinstance(v, float):
        return v != 0.0
    return bool(v)


def _key_bytes(k) -> bytes:
    """The block-hash bytes of one replay key (int -> 8-byte big-endian, string -> UTF-8)."""
    if isinstance(k, int) and not isinstance(k, bool):
        if not 0 <= k <= _U64_MAX:
            raise ReplayInputError(f"replay key {_rust_number(k)} is not an unsigned 64-bit integer")
        return k.to_bytes(8, "big")
    if isinstance(k, float):
        raise ReplayInputError(f"replay key {_rust_float(k)} is not an unsigned 64-bit integer")
    if isinstance(k, str):
        b = k.encode("utf-8")
        if len(b) + 4 > _MAX_KEY_LEN:
            raise ReplayInputError(
                f"invalid offload key: {len(b) + 4} bytes (longest supported {_MAX_KEY_LEN})"
            )
        return b
    raise ReplayInputError(f"replay key {_rust_compact(k)} is neither an integer nor a string")


def _rust_lines(text: str):
    """Rust's `str::lines`: split at `\\n`, a trailing `\\r` dropped, no final empty line."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def parse(text: str, make_offload_key):
    """The calls of `text` and the original JSON value of every key (by its offload key).

    Each call is `(line, method, req, keys or None, success, unless_deferred)`; raises
    ReplayInputError where the Rust replay rejects the file."""
    calls, orig = [], {}
    for i, line in enumerate(_rust_lines(text)):
        line_no = i + 1
        line = line.strip(_RUST_WS)
        if not line:
            continue
        try:
            o = json.loads(line, parse_constant=_reject_constant)
        except ValueError as e:
            raise ReplayInputError(f"replay line {line_no}: {e}") from None
        _check_json(o, line_no)
        method = o.get("method") if isinstance(o, dict) else None
        if not isinstance(method, str):
            raise ReplayInputError(f"replay line {line_no}: no method")
        get = o.get if isinstance(o, dict) else (lambda _k, d=None: d)
        ks = get("keys", _MISSING)
        if ks is _MISSING:
            keys = None
        elif isinstance(ks, list):
            keys = []
            for k in ks:
                ok = make_offload_key(_key_bytes(k), 0)
                orig[ok] = k
                keys.append(ok)
        else:
            raise ReplayInputError(
                f"replay line {line_no}: keys {_rust_compact(ks)} is not a list"
            )
        calls.append((
            line_no,
            method,
            _py_str(get("req", _MISSING)),
            keys,
            _truthy(get("success", _MISSING), True),
            _truthy(get("unless_deferred", _MISSING), False),
        ))
    return calls, orig


# ------------------------------------------------------------------------------------------
# the replay
# ------------------------------------------------------------------------------------------
def replay_on(m, calls, orig, follow_prepare: bool, V):
    """Replays `calls` against the manager `m` (vLLM's `OffloadingManager` API); `V` is
    `vllm.v1.kv_offload.base`. Returns the output text and a summary dict."""
    out = []
    summary = {
        "calls": len(calls), "errors": 0, "first_errors": [], "implicit_new_requests": 0,
        "prepare_store_rejected": 0, "complete_store_skipped": 0, "lookup_results": {},
    }
    ctxs, new_since_step = {}, []
    prepared, last_lookup, loading = {}, {}, {}
    dumps = json.dumps

    def deferred_of(req):
        return any(r in ("HIT_PENDING", "RETRY") for _, r in last_lookup.get(req, ()))

    def okey(k):
        return orig.get(k)

    for ln, method, req, keys, success, unless_deferred in calls:
        if unless_deferred and deferred_of(req):
            out.append(dumps({"line": ln, "method": method, "req": req, "ok": True,
                              "result": "deferred"}))
            continue
        ctx = None
        if method not in ("on_schedule_end", "reset_cache"):
            ctx = ctxs.get(req)
            if ctx is None:
                ctx = V.ReqContext(req_id=req)
                ctxs[req] = ctx
                new_since_step.append(req)
                if method != "on_new_request":
                    summary["implicit_new_requests"] += 1
                    try:
                        m.on_new_request(ctx)
                    except AssertionError as e:
                        summary["errors"] += 1
                        summary["first_errors"].append(
                            f"line {ln} implicit on_new_request: {e}")
        rec = None
        try:
            if method == "on_new_request":
                m.on_new_request(ctx)
            elif method == "lookup":
                rec, seen = [], []
                for k in keys or ():
                    name = m.lookup(k, ctx).name
                    lr = summary["lookup_results"]
                    lr[name] = lr.get(name, 0) + 1
                    rec.append(name)
                    seen.append((k, name))
                    if name == "MISS":
                        break
                last_lookup[req] = seen
            elif method == "prepare_load":
                if keys is None:
                    keys = [] if deferred_of(req) else [
                        k for k, r in last_lookup.get(req, ()) if r == "HIT"]
                if keys:
                    m.prepare_load(keys, ctx)
                rec = [okey(k) for k in keys]
                loading.setdefault(req, []).append(keys)
            elif method == "complete_load":
                if keys is None:
                    q = loading.get(req)
                    keys = q.pop(0) if q else []
                if keys:
                    m.complete_load(keys, ctx)
            elif method == "take_events":
                rec = [{"keys": [orig[k] if k in orig else bytes(k).hex() for k in ev.keys],
                        "medium": ev.medium.name,
                        "removed": bool(ev.removed)} for ev in m.take_events()]
            elif method == "touch":
                m.touch(keys or [], ctx)
            elif method == "prepare_store":
                o = m.prepare_store(keys or [], ctx)
                q = prepared.setdefault(req, [])
                if o is None:
                    q.append([])
                    summary["prepare_store_rejected"] += 1
                else:
                    q.append(list(o.keys_to_store))
                    rec = {"keys_to_store": [okey(k) for k in o.keys_to_store],
                           "evicted": [okey(k) for k in o.evicted_keys]}
            elif method == "complete_store":
                if keys is None or follow_prepare:
                    q = prepared.get(req)
                    done = q.pop(0) if q else []
                    if done:
                        m.complete_store(done, ctx, success)
                    else:
                        summary["complete_store_skipped"] += 1
                else:
                    m.complete_store(keys, ctx, success)
            elif method == "on_request_finished":
                m.on_request_finished(ctx)
                ctxs.pop(req, None)
            elif method == "on_schedule_end":
                sc = V.ScheduleEndContext(new_req_ids=new_since_step, preempted_req_ids=[])
                new_since_step = []
                m.on_schedule_end(sc)
                m.get_stats()  # the scheduler drains the manager's stats every step
            elif method == "reset_cache":
                m.reset_cache()
            else:
                raise _UnknownMethod(f"unknown method {method!r}")
            ok = True
        except (AssertionError, _UnknownMethod) as e:
            # kvbm's ContractError is an AssertionError, as vLLM's asserts
            ok, rec = False, None
            summary["errors"] += 1
            if len(summary["first_errors"]) < 5:
                summary["first_errors"].append(f"line {ln} {method}: {e}")
        out.append(dumps({"line": ln, "method": method, "req": req, "ok": ok, "result": rec}))
    return "".join(s + "\n" for s in out), summary


# ------------------------------------------------------------------------------------------
# vLLM: a real installation, or the harness's extraction with its stubs
# ------------------------------------------------------------------------------------------
def _repo_root():
    """The source checkout holding this file, else the first directory up from the current
    one that holds the upstream harness; None when neither exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.normpath(os.path.join(here, "..", "..", "..", ".."))]
    d = os.getcwd()
    while True:
        candidates.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for c in candidates:
        if os.path.isfile(os.path.join(c, _HARNESS, "stubs.py")):
            return c
    return None


_STUBBED = None  # how ensure_vllm installed the stubs, once per process


class SetupError(RuntimeError):
    """vLLM's modules cannot be made importable (exit 2)."""


def ensure_vllm(vllm_src=None, stubs_path=None, pydeps=None):
    """Makes `vllm.v1.kv_offload` importable; returns how ("installed" or "stubs: DIR").

    A real vLLM is used when importable. Otherwise the harness's extracted sources and stubs
    are installed (see the module docs); a missing piece raises SetupError naming it."""
    global _STUBBED
    if _STUBBED is not None:
        return _STUBBED
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        if vllm_src is not None:
            raise SetupError(
                "--vllm-src was given but vLLM is importable here "
                f"({importlib.util.find_spec('vllm').origin}); drop one of them")
        return "installed"
    root = _repo_root()
    if vllm_src is None:
        if root is None:
            raise SetupError(
                "vLLM is not importable and no --vllm-src was given (and no kvbm checkout with "
                "the upstream harness was found to take the default from)")
        # The harness's extraction of the version asked for (KVBM_VLLM_VERSION, the test
        # suites' switch), else of 0.33.0.
        version = os.environ.get("KVBM_VLLM_VERSION", "0.33.0")
        vllm_src = os.path.join(root, "target", "peer", "vllm-sdist", version)
    if not os.path.isfile(os.path.join(vllm_src, "vllm", "v1", "kv_offload", "base.py")):
        raise SetupError(
            f"vLLM is not importable and {vllm_src} holds no extracted vllm/v1/kv_offload: run "
            "`python3 crates/kvbm-vllm/tests/upstream/run.py --impl vllm [--vllm VERSION]` once "
            "(it fetches and extracts that vLLM's sdist), or pass --vllm-src")
    if stubs_path is None:
        if root is None:
            raise SetupError("vLLM is not importable: --stubs FILE (the harness's stubs.py) "
                             "is needed with --vllm-src outside a kvbm checkout")
        stubs_path = os.path.join(root, _HARNESS, "stubs.py")
    if not os.path.isfile(stubs_path):
        raise SetupError(f"no stubs file {stubs_path}")
    if pydeps is None:
        pydeps = os.path.join(os.path.dirname(os.path.abspath(vllm_src)), "pydeps")
    if importlib.util.find_spec("numpy") is None:
        if not os.path.isdir(pydeps):
            raise SetupError(f"numpy is not importable and there is no {pydeps}: pip install "
                             "numpy, or run the upstream harness once")
        sys.path.append(pydeps)
    spec = importlib.util.spec_from_file_location("_kvbm_upstream_stubs", stubs_path)
    stubs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stubs)
    stubs.install(os.path.abspath(vllm_src))
    _STUBBED = f"stubs: {vllm_src}"
    return _STUBBED


# ------------------------------------------------------------------------------------------
# command line (the Rust example's, plus --vllm-src / --stubs / --pydeps)
# ------------------------------------------------------------------------------------------
def _usage() -> int:
    print(_USAGE, file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    calls_path = out_path = vllm_src = stubs_path = pydeps = None
    manager, capacity, policy = "cpu", 16384, "lru"
    upstream_compatible = follow_prepare = False
    line = None
    it = iter(args)
    for a in it:
        if a == "--calls":
            calls_path = next(it, None)
        elif a == "--out":
            out_path = next(it, None)
        elif a == "--manager":
            manager = next(it, None)
            if manager not in ("cpu", "tiering"):
                return _usage()
        elif a == "--capacity":
            v = next(it, None)
            if v is None or not re.fullmatch(r"\+?[0-9]+", v) or int(v) > _U64_MAX:
                return _usage()
            capacity = int(v)
        elif a == "--policy":
            v = next(it, None)
            if v is None or v.lower() not in ("lru", "arc") or not v.isascii():
                return _usage()
            policy = v.lower()
        elif a == "--upstream-compatible":
            upstream_compatible = True
        elif a == "--follow-prepare":
            follow_prepare = True
        elif a == "--vllm":
            line = next(it, None)
            if line not in ("0.33", "0.34"):
                return _usage()
        elif a == "--vllm-src":
            vllm_src = next(it, None)
        elif a == "--stubs":
            stubs_path = next(it, None)
        elif a == "--pydeps":
            pydeps = next(it, None)
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            return _usage()
    if calls_path is None:
        return _usage()
    # --upstream-compatible: kvbm's CPU manager has no upstream-fix toggles (the Rust replay
    # applies the flag to the tiering manager only), so for cpu it changes nothing, as there.
    try:
        with open(calls_path, encoding="utf-8", newline="") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"cannot read {calls_path}: {e}", file=sys.stderr)
        return 1
    try:
        how = ensure_vllm(vllm_src, stubs_path, pydeps)
    except SetupError as e:
        print(f"kvbm_vllm.replay: {e}", file=sys.stderr)
        return 2
    from vllm.v1.kv_offload import base as V

    from kvbm_vllm.contract import installed
    from kvbm_vllm.upstream_compat import CPUOffloadingManager

    # The Rust example's --vllm picks the contract; here it is the installed vLLM's, and a
    # different one asked for is an error, never a replay under the wrong contract.
    if line is not None and line != installed().name:
        print(f"kvbm_vllm.replay: --vllm {line}, but the vLLM here follows the "
              f"{installed().name} contract", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    try:
        calls, orig = parse(text, V.make_offload_key)
    except ReplayInputError as e:
        print(f"replay failed: {e}", file=sys.stderr)
        return 1
    if manager == "tiering":
        m = _tiering(capacity, policy, upstream_compatible, V)
    else:
        m = CPUOffloadingManager(capacity, cache_policy=policy, enable_events=True)
    lines, s = replay_on(m, calls, orig, follow_prepare, V)
    dt = time.perf_counter() - t0
    if out_path is not None:
        try:
            with open(out_path, "w", encoding="utf-8", newline="") as f:
                f.write(lines)
        except OSError as e:
            print(f"cannot write {out_path}: {e}", file=sys.stderr)
            return 1
    label = "Tiering" if manager == "tiering" else "Cpu"
    print(f"replay {calls_path} on {label} manager (Python API, vLLM {how}): {s['calls']} calls in "
          f"{dt * 1e3:.1f} ms, errors {s['errors']}, implicit on_new_request "
          f"{s['implicit_new_requests']}, lookups {s['lookup_results']}, rejected stores "
          f"{s['prepare_store_rejected']}, complete_store skipped {s['complete_store_skipped']}")
    for e in s["first_errors"]:
        print(f"  error: {e}")
    return 0


def _tiering(capacity, policy, upstream_compatible, V):
    """The Rust replay's tiering manager, through the Python API (module docs)."""
    from unittest.mock import MagicMock

    import numpy as np
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    from kvbm_vllm import upstream_compat

    class MemTier(SecondaryTierManager):
        medium = V.Medium.CPU

        def __init__(self, view):
            super().__init__(offloading_spec=None, primary_kv_view=view, tier_type="mem")
            self.keys = set()
            self.done = []

        def lookup(self, key, req_context):
            return V.LookupResult.HIT if key in self.keys else V.LookupResult.MISS

        def submit_store(self, job):
            self.keys.update(job.keys)
            self.done.append(JobResult(job_id=job.job_id, success=True, transfer_time=0.0))

        def submit_load(self, job):
            ok = all(k in self.keys for k in job.keys)
            self.done.append(JobResult(job_id=job.job_id, success=ok, transfer_time=0.0))

        def get_finished_jobs(self):
            done, self.done = self.done, []
            return done

        def on_new_request(self, req_context):
            return V.RequestOffloadingContext()

        def drain_jobs(self):
            return

    class Manager(upstream_compat.TieringOffloadingManager):
        _UPSTREAM = upstream_compatible

    region = np.zeros((max(capacity, 1), 64), dtype=np.int8)
    mmap = MagicMock()
    mmap.create_kv_memoryview.return_value = memoryview(region)
    primary = upstream_compat.CPUPrimaryTierOffloadingManager(
        num_chunks=capacity, mmap_region=mmap, cache_policy=policy, enable_events=True
    )
    return Manager(primary_tier=primary, secondary_tiers=[MemTier(primary.get_kv_memoryview())])


if __name__ == "__main__":
    sys.exit(main())
