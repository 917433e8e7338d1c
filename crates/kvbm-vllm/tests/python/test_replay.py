"""Call for call: ``python -m kvbm_vllm.replay`` (kvbm's manager through the Python API, with
vLLM's objects) writes the same lines as kvbm-tiering's Rust replay example on the same calls.

Needs:
  * the Rust example: ``cargo build --release -p kvbm-tiering --example replay`` (path from
    ``KVBM_REPLAY_BIN``, default ``<repo>/target/release/examples/replay``); missing is a
    failure, never a skip;
  * ``kvbm_vllm`` importable with its extension (the installed wheel, or the source tree with
    the extension built in place);
  * vLLM's ``vllm.v1.kv_offload``: a real vLLM, else the upstream harness's extraction
    (``KVBM_VLLM_SRC``, default ``<repo>/target/peer/vllm-sdist/0.33.0``; the harness makes it:
    ``python3 crates/kvbm-vllm/tests/upstream/run.py --impl vllm``) with its stubs.

The sequences come from ``gencalls.py`` (here), nothing outside the repository.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, HERE)

import gencalls  # noqa: E402

SEEDS = (1, 2, 3, 4)

#: The vLLM line the suite runs against (``KVBM_VLLM_VERSION``, the harness's extraction; a
#: real vLLM's own version): 0.34's managers and tiers have no ``touch``, so its sequences
#: have none.
def _vllm_line():
    if REAL_VLLM:
        from importlib.metadata import version
        return tuple(int(x) for x in version("vllm").split(".")[:2])
    return tuple(int(x) for x in os.environ.get("KVBM_VLLM_VERSION", "0.33.0").split(".")[:2])


def generate(seed, **kw):
    """``gencalls.generate``, without ``touch`` where the vLLM line has none."""
    calls = gencalls.generate(seed, **kw)
    if _vllm_line() >= (0, 34):
        calls = [c for c in calls if c["method"] != "touch"]
    return calls
CAPACITIES = (7, 16, 64)
POLICIES = ("lru", "arc")


@pytest.fixture(scope="session")
def rust_bin():
    path = os.environ.get("KVBM_REPLAY_BIN",
                          os.path.join(REPO, "target", "release", "examples", "replay"))
    if not os.path.isfile(path):
        pytest.fail(f"the Rust replay example {path} is missing: build it with `cargo build "
                    f"--release -p kvbm-tiering --example replay` (or set KVBM_REPLAY_BIN)")
    return path


# Whether a fresh interpreter (the replay's command line) imports vLLM too: only when it was
# installed before any module of this suite installed the harness's stubs, after which `vllm`
# is importable here but not there. `ensure_vllm` remembers how it was first made importable,
# whichever test module asked first.
def _installed_vllm() -> bool:
    from kvbm_vllm import replay

    if replay._STUBBED is not None:  # how the first ensure_vllm made it importable
        return replay._STUBBED == "installed"
    return importlib.util.find_spec("vllm") is not None


REAL_VLLM = _installed_vllm()


def _vllm_args():
    if REAL_VLLM:
        return []
    src = os.environ.get("KVBM_VLLM_SRC", os.path.join(
        REPO, "target", "peer", "vllm-sdist", os.environ.get("KVBM_VLLM_VERSION", "0.33.0")))
    if not os.path.isdir(src):
        pytest.fail(f"vLLM is not importable and {src} is missing: run `python3 "
                    f"crates/kvbm-vllm/tests/upstream/run.py --impl vllm` once (or set "
                    f"KVBM_VLLM_SRC)")
    return ["--vllm-src", src, "--stubs",
            os.path.join(REPO, "crates", "kvbm-vllm", "tests", "upstream", "stubs.py")]


def ensure_vllm():
    """Makes vLLM importable in this process, as the replay does (a real vLLM, else its
    sources and the stubs), for tests that drive kvbm's managers in process."""
    from kvbm_vllm import replay

    args = _vllm_args()
    opts = dict(zip(args[::2], args[1::2]))
    replay.ensure_vllm(opts.get("--vllm-src"), opts.get("--stubs"), None)
    return replay


@pytest.fixture(scope="session")
def replay_mod():
    from kvbm_vllm import replay

    return replay


def _run_rust(rust_bin, calls, out, args):
    r = subprocess.run([rust_bin, "--calls", calls, "--out", out, *args],
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _run_py_inproc(replay_mod, calls, out, args):
    return replay_mod.main(["--calls", calls, "--out", out, *args, *_vllm_args()])


def _run_py_cli(calls, out, args):
    r = subprocess.run([sys.executable, "-m", "kvbm_vllm.replay", "--calls", calls, "--out", out,
                        *args, *_vllm_args()], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _compare(rust_bin, replay_mod, tmp_path, text, args, name="calls"):
    # Both replays follow the same vLLM contract: the Rust one is told which.
    args = [*args, "--vllm", "{}.{}".format(*_vllm_line())]
    calls = tmp_path / f"{name}.jsonl"
    calls.write_bytes(text.encode("utf-8"))
    rs_out, py_out = tmp_path / f"{name}.rs.jsonl", tmp_path / f"{name}.py.jsonl"
    rc, log = _run_rust(rust_bin, str(calls), str(rs_out), args)
    assert rc == 0, f"Rust replay failed ({rc}): {log}"
    assert _run_py_inproc(replay_mod, str(calls), str(py_out), args) == 0
    a, b = _read(rs_out), _read(py_out)
    if a != b:
        for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines()), 1):
            assert x == y, f"{name} {args}: first difference at output line {i}"
        assert len(a.splitlines()) == len(b.splitlines()), f"{name} {args}: line counts differ"
    return a


@pytest.mark.parametrize("manager", ["cpu", "tiering"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_sequences_match(rust_bin, replay_mod, tmp_path, seed, capacity, policy,
                                   manager):
    text = gencalls.dumps(generate(seed))
    out = _compare(rust_bin, replay_mod, tmp_path, text,
                   ["--manager", manager, "--capacity", str(capacity), "--policy", policy])
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == len(text.splitlines())
    # the sequences exercise what they are meant to: evictions at small capacities, errors
    if capacity == 7:
        assert any(isinstance(x["result"], dict) and x["result"]["evicted"] for x in lines)
    assert any(not x["ok"] for x in lines)


@pytest.mark.parametrize("manager", ["cpu", "tiering"])
@pytest.mark.parametrize("extra", [["--follow-prepare"], ["--upstream-compatible"],
                                   ["--follow-prepare", "--upstream-compatible"]])
@pytest.mark.parametrize("policy", POLICIES)
def test_flags_match(rust_bin, replay_mod, tmp_path, policy, extra, manager):
    text = gencalls.dumps(generate(11))
    _compare(rust_bin, replay_mod, tmp_path, text,
             ["--manager", manager, "--capacity", "16", "--policy", policy, *extra])


@pytest.mark.parametrize("manager", ["cpu", "tiering"])
@pytest.mark.parametrize("policy", POLICIES)
def test_plain_scheduler_workload_matches(rust_bin, replay_mod, tmp_path, policy, manager):
    text = gencalls.dumps(generate(21, steps=200, extras=False))
    _compare(rust_bin, replay_mod, tmp_path, text,
             ["--manager", manager, "--capacity", "32", "--policy", policy])


# Odd but accepted input: req values of every JSON type (the replay's str()), CRLF, blank and
# padded lines, a last line without newline, non-ASCII / escaped / colliding string keys, the
# largest u64, falsy success / truthy unless_deferred of other types.
EDGE = (
    '{"method": "lookup", "req": null, "keys": [1, 2]}\r\n'
    "   \n"
    '{"method": "prepare_store", "req": true, "keys": [1, 2, "\\u00e9\\u2603", '
    '"\\ud83d\\ude00x", "tab\\there", "\\u007f\\u0000", 7017280452245743464, "abcdefgh"]}\n'
    '{"method": "complete_store", "req": true}\n'
    '{"method": "take_events", "req": 1.5}\n'
    '{"method": "lookup", "req": 1e20, "keys": [1, "\\u00e9\\u2603", "abcdefgh"]}\n'
    '{"method": "lookup", "req": 0.00001, "keys": [3]}\n'
    '{"method": "lookup", "req": 1e16, "keys": [3]}\n'
    '{"method": "lookup", "req": 1e15, "keys": [3]}\n'
    '{"method": "lookup", "req": 123456789012345678901234567890, '
    '"keys": [18446744073709551615, 0]}\n'
    '{"method": "touch", "req": -7, "keys": [2]}\n'
    '{"method": "on_schedule_end", "req": {"b": 1, "a": [1.0, "\\u00e9", null, 2.5e-8]}}\n'
    '{"method": "complete_store", "req": "x", "keys": [5], "success": 0}\n'
    '{"method": "prepare_store", "req": "x", "keys": [5, 6], "unless_deferred": "yes"}\n'
    '{"method": "complete_store", "req": "x", "success": ""}\n'
    '{"method": "prepare_load", "req": "x", "keys": [5, 6]}\n'
    '{"method": "complete_load", "req": "x"}\n'
    '{"method": "take_events"}\n'
    '{"method": "on_request_finished", "req": "x"}\n'
    '{"method": "on_request_finished", "req": "x"}\n'
    '{"method": "on_new_request", "req": "y"}\n'
    '{"method": "on_new_request", "req": "y"}\n'
    '{"method": "noop", "req": "y", "keys": [1]}\n'
    '{"method": "reset_cache", "req": "zz"}\n'
    '\t{"method": "lookup", "req": [], "keys": []}  \n'
    '{"method": "lookup", "req": "", "keys": [""]}\n'
    '{"method": "take_events", "req": 1e-7}'
)


@pytest.mark.parametrize("policy", POLICIES)
def test_edge_input_matches(rust_bin, replay_mod, tmp_path, policy):
    _compare(rust_bin, replay_mod, tmp_path, EDGE,
             ["--manager", "cpu", "--capacity", "4", "--policy", policy], name="edge")


# Input both replays reject as a whole: exit 1, no output file.
REJECTED = {
    "no_method": '{"req": "a"}\n',
    "method_not_str": '{"method": 5}\n',
    "not_object": "[1, 2]\n",
    "not_json": '{"method": "lookup"\n',
    "nan": '{"method": "lookup", "req": NaN}\n',
    "overflow": '{"method": "lookup", "req": 1e400}\n',
    "lone_surrogate": '{"method": "lookup", "req": "\\ud800"}\n',
    "negative_key": '{"method": "lookup", "keys": [-1]}\n',
    "float_key": '{"method": "lookup", "keys": [1.0]}\n',
    "bool_key": '{"method": "lookup", "keys": [true]}\n',
    "huge_key": '{"method": "lookup", "keys": [18446744073709551616]}\n',
    "long_string_key": '{"method": "lookup", "keys": ["%s"]}\n' % ("k" * 36),
    "keys_not_list": '{"method": "lookup", "keys": "abc"}\n',
    "keys_null": '{"method": "lookup", "keys": null}\n',
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected_input_matches(rust_bin, replay_mod, tmp_path, case):
    calls = tmp_path / "bad.jsonl"
    calls.write_text('{"method": "take_events"}\n' + REJECTED[case], encoding="utf-8")
    rs_out, py_out = tmp_path / "rs.jsonl", tmp_path / "py.jsonl"
    args = ["--manager", "cpu", "--capacity", "4", "--policy", "lru"]
    rc, log = _run_rust(rust_bin, str(calls), str(rs_out), args)
    assert rc == 1 and not rs_out.exists(), f"Rust replay accepted {case}: {log}"
    assert _run_py_inproc(replay_mod, str(calls), str(py_out), args) == 1
    assert not py_out.exists()


def test_string_key_at_the_length_limit_matches(rust_bin, replay_mod, tmp_path):
    text = '{"method": "prepare_store", "req": "a", "keys": ["%s", "%s"]}\n' % ("k" * 35, "é" * 17)
    _compare(rust_bin, replay_mod, tmp_path, text + '{"method": "take_events"}\n',
             ["--manager", "cpu", "--capacity", "4", "--policy", "lru"])


def test_cli_matches(rust_bin, tmp_path):
    """The module's command line itself (a fresh interpreter: stubs installed there)."""
    calls = tmp_path / "calls.jsonl"
    calls.write_text(gencalls.dumps(generate(5)), encoding="utf-8")
    args = ["--manager", "cpu", "--capacity", "16", "--policy", "arc"]
    rc, log = _run_rust(rust_bin, str(calls), str(tmp_path / "rs.jsonl"), args)
    assert rc == 0, log
    rc, log = _run_py_cli(str(calls), str(tmp_path / "py.jsonl"), args)
    assert rc == 0, log
    assert _read(tmp_path / "rs.jsonl") == _read(tmp_path / "py.jsonl")


def test_cli_tiering_matches(rust_bin, tmp_path):
    text = gencalls.dumps(generate(5))
    (tmp_path / "calls.jsonl").write_text(text, encoding="utf-8")
    args = ["--manager", "tiering", "--capacity", "16", "--policy", "lru"]
    rc, log = _run_py_cli(str(tmp_path / "calls.jsonl"), str(tmp_path / "py.jsonl"), args)
    assert rc == 0, log
    assert "on Tiering manager" in log
    subprocess.run([rust_bin, "--calls", str(tmp_path / "calls.jsonl"), *args,
                    "--out", str(tmp_path / "rs.jsonl")], check=True, capture_output=True)
    assert _read(tmp_path / "rs.jsonl") == _read(tmp_path / "py.jsonl")


def test_cli_usage_errors(tmp_path):
    for args in (["--manager", "disk"], ["--policy", "fifo"], ["--capacity", "-1"],
                 ["--calls"], ["--frobnicate"]):
        rc, log = _run_py_cli(str(tmp_path / "c.jsonl"), str(tmp_path / "o.jsonl"), args)
        assert rc == 2 and "usage:" in log, (args, log)


def test_import_is_cheap():
    code = ("import sys, kvbm_vllm.replay; "
            "bad = [m for m in ('vllm', 'torch', 'numpy', 'kvbm_vllm._kvbm') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
