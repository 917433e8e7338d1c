"""A fleet of vLLM schedulers sharing KV through kvbm's cluster (``KvbmFleetTier``).

Each member is its own process (``fleet_member.py``): vLLM's real scheduler-side managers (or
kvbm's) over a numpy region, ``KvbmFleetTier`` below them. One real ``nats-server`` (from
``cargo xtask services``); credentials issued by the ``kvbm security`` command. What a user
relies on:

* A stores chunks; B's lookups hit them and the load puts A's bytes into B's region, byte for
  byte; C (another namespace) and D (another model) never hit;
* A killed: B's loads fail (vLLM's manager turns them into misses), never wrong bytes, and A's
  entries leave B's index within its heartbeat window;
* B restarted: its own chunks are warm on its disk, and it finds A2's chunks again (the
  snapshot a joining member gets);
* a member without credentials refuses to start, naming the key; one whose credential another
  root issued hears nothing, is heard by no one, and its messages are counted as refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
MEMBER = HERE / "fleet_member.py"


def nats(user: str = "instance_a") -> list[str]:
    """The member arguments of the NATS server with accounts, as ``user`` (its password file)."""
    url, dir = os.environ.get("KVBM_TEST_NATS_AUTH_URL"), os.environ.get("KVBM_TEST_NATS_AUTH_DIR")
    if not url or not dir:
        if os.environ.get("KVBM_TEST_SKIP_SERVICES") == "1":
            pytest.skip("KVBM_TEST_SKIP_SERVICES=1: no NATS server")
        pytest.fail("no NATS server with accounts: run through `cargo xtask python` or `cargo "
                    "xtask ci`, which start one (or export KVBM_TEST_NATS_AUTH_* from `cargo "
                    "xtask services start`)")
    return ["--nats", url, "--nats-user", user,
            "--nats-password-file", str(Path(dir) / f"{user}.password")]


def kvbm_bin() -> str:
    for c in (os.environ.get("KVBM_BIN"), REPO / "target/debug/kvbm",
              REPO / "target/release/kvbm"):
        if c and Path(c).is_file():
            return str(c)
    pytest.fail("no kvbm binary: `cargo build -p kvbm-cli` (cargo xtask python builds it and "
                "exports KVBM_BIN)")


class Root:
    """A fleet's root key and the credentials it issues, through the ``kvbm`` command."""

    def __init__(self, dir: Path):
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        out = subprocess.run([kvbm_bin(), "security", "init", "--out", str(dir / "root.key")],
                             capture_output=True, text=True, check=True).stdout
        self.trust_root = re.search(r'security.trust_root = "([0-9a-f]+)"', out).group(1)

    def issue(self, instance: int, namespace: str) -> str:
        path = self.dir / f"{instance:x}.cred"
        if path.exists():  # a restarted member keeps its credential
            return str(path)
        subprocess.run([kvbm_bin(), "security", "issue", "--root", str(self.dir / "root.key"),
                        "--instance", hex(instance), "--role", "leader",
                        "--namespace", namespace, "--out", str(path)],
                       capture_output=True, text=True, check=True)
        return str(path)


class Proc:
    """One member process, driven line by line."""

    def __init__(self, log: Path, *args: str):
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, str(MEMBER), *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.hello = self._read()

    def _read(self, timeout: float = 60.0):
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=timeout)
            raise AssertionError(f"member exited ({self.p.returncode}): "
                                 f"{Path(self.log.name).read_text()[-3000:]}")
        return json.loads(line)

    def ask(self, op: str, keys=()):
        self.p.stdin.write(json.dumps({"op": op, "keys": [k.hex() for k in keys]}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def kill(self):
        self.p.kill()
        self.p.wait(timeout=30)

    def close(self):
        if self.p.poll() is None:
            try:
                self.ask("exit")
            except (AssertionError, BrokenPipeError):
                pass
            self.p.wait(timeout=30)
        self.log.close()


def member(tmp_path, name, namespace, *, root=None, instance=None, model="fleet-model",
           cred_ns=None, insecure=False, impl="vllm", user="instance_a", disk=None):
    args = ["--namespace", namespace, *nats(user), "--model", model, "--impl", impl]
    if disk is not None:
        args += ["--disk", str(disk)]
    if root is not None:
        args += ["--trust-root", root.trust_root,
                 "--credential", root.issue(instance, cred_ns or namespace)]
    if insecure:
        args.append("--insecure")
    return Proc(tmp_path / f"{name}.log", *args)


def keys(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).digest() for i in range(n)]


def expected_sha(key: bytes) -> str:
    """The sha256 of the bytes a member stores for ``key`` (its ``pattern``)."""
    from fleet_member import make_offload_key, pattern, sha

    return sha(pattern(bytes(make_offload_key(key, 0))))


def eventually(what, f, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = f()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


@pytest.mark.parametrize("impl", ["vllm", "kvbm"])
def test_a_fleet_shares_chunks_byte_for_byte_within_its_namespace_and_model(tmp_path, impl):
    ns, other_ns = unique("fleet"), unique("elsewhere")
    root = Root(tmp_path / "root")
    a = member(tmp_path, "a", ns, root=root, instance=0xA1, impl=impl)
    b = member(tmp_path, "b", ns, root=root, instance=0xB2, impl=impl)
    # Another namespace, and another NATS account (tenant B) too.
    c = member(tmp_path, "c", other_ns, root=root, instance=0xC3, impl=impl, user="instance_b")
    d = member(tmp_path, "d", ns, root=root, instance=0xD4, model="another-model", impl=impl)
    try:
        for m in (a, b, c, d):
            assert m.hello["ready"], m.hello
        ks = keys(f"shared-{impl}", 12)
        assert a.ask("store", ks) == {"stored": 12}
        eventually("B indexes A's chunks", lambda: b.ask("stats")["index_entries"] >= 12)

        got = b.ask("load", ks)["keys"]
        assert [g["result"] for g in got] == ["HIT"] * 12, got
        for k, g in zip(ks, got):
            assert g["sha"] == expected_sha(k), "B's region holds A's bytes"
        sb = b.ask("stats")
        assert sb["loaded_remote"] == 12 and sb["load_failed"] == 0, sb

        # Another namespace, another model: never a hit, nothing indexed.
        for m in (c, d):
            got = m.ask("load", ks)["keys"]
            assert [g["result"] for g in got] == ["MISS"] * 12, got
            s = m.ask("stats")
            assert s["index_entries"] == 0 and s["remote_hits"] == 0, s
    finally:
        for m in (a, b, c, d):
            m.close()


def test_a_killed_peer_fails_the_load_and_is_forgotten_and_a_restart_finds_the_fleet(tmp_path):
    ns = unique("fleet-kill")
    root = Root(tmp_path / "root")
    disk = tmp_path / "b-disk" / "g3.bin"
    a = member(tmp_path, "a", ns, root=root, instance=0xA1)
    b = member(tmp_path, "b", ns, root=root, instance=0xB2, disk=disk)
    a2 = member(tmp_path, "a2", ns, root=root, instance=0xA2)
    try:
        lost, kept, own = keys("lost", 6), keys("kept", 6), keys("own", 4)
        assert a.ask("store", lost) == {"stored": 6}
        assert a2.ask("store", kept) == {"stored": 6}
        assert b.ask("store", own) == {"stored": 4}
        assert b.ask("stats")["stored_disk"] == 4
        eventually("B indexes both", lambda: b.ask("stats")["index_entries"] >= 12)

        a.kill()  # no departure: B's index still lists A until its heartbeat window passes
        got = b.ask("load", lost)["keys"]
        assert all(g["result"] == "MISS" for g in got), got
        assert all(g["sha"] is None for g in got), "never a byte from a dead peer"
        s = b.ask("stats")
        assert s["load_failed"] >= 1 and s["loaded_remote"] == 0, s
        eventually("A leaves B's index", lambda: b.ask("stats")["index_entries"] == 6)

        # B restarted on its disk: its own chunks are warm there, and it finds A2's chunks
        # again, with their bytes.
        b.close()
        b = member(tmp_path, "b-again", ns, root=root, instance=0xB2, disk=disk)
        assert b.hello["ready"], b.hello
        got = b.ask("load", own)["keys"]
        assert [g["result"] for g in got] == ["HIT"] * 4, got
        assert [g["sha"] for g in got] == [expected_sha(k) for k in own]
        assert b.ask("stats")["loaded_disk"] == 4
        eventually("the restarted B indexes A2", lambda: b.ask("stats")["index_entries"] >= 6)
        got = b.ask("load", kept)["keys"]
        assert [g["result"] for g in got] == ["HIT"] * 6, got
        assert [g["sha"] for g in got] == [expected_sha(k) for k in kept]
    finally:
        for m in (a, b, a2):
            m.close()


def test_without_credentials_or_with_a_foreign_root_a_member_gets_nothing(tmp_path):
    ns = unique("fleet-auth")
    root = Root(tmp_path / "root")
    stranger_root = Root(tmp_path / "stranger")
    # No credentials: it refuses to start, naming what is missing.
    bare = member(tmp_path, "bare", ns)
    assert not bare.hello["ready"]
    assert "security" in bare.hello["error"] and "credential" in bare.hello["error"], bare.hello
    bare.close()

    a = member(tmp_path, "a", ns, root=root, instance=0xA1)
    b = member(tmp_path, "b", ns, root=root, instance=0xB2)
    f = member(tmp_path, "f", ns, root=stranger_root, instance=0xF6)
    try:
        assert f.hello["ready"], f.hello
        ks, forged = keys("guarded", 6), keys("forged", 6)
        assert a.ask("store", ks) == {"stored": 6}
        assert f.ask("store", forged) == {"stored": 6}
        eventually("B indexes A", lambda: b.ask("stats")["index_entries"] >= 6)
        eventually("A refuses the stranger's messages",
                   lambda: a.ask("stats")["messages_refused"] > 0)
        time.sleep(0.5)
        # The stranger hears nothing and pulls nothing; nothing of its reaches B's index.
        got = f.ask("load", ks)["keys"]
        assert [g["result"] for g in got] == ["MISS"] * 6, got
        assert f.ask("stats")["index_entries"] == 0
        sb = b.ask("stats")
        assert sb["index_entries"] == 6, sb
        got = b.ask("load", forged)["keys"]
        assert [g["result"] for g in got] == ["MISS"] * 6, got
    finally:
        for m in (a, b, f):
            m.close()


def _dp_fleet_config(tmp_path, index, size, credential_file, root):
    """vLLM's offloading config of data-parallel engine core ``index`` of ``size``: kvbm's
    manager over a fleet tier (module path form)."""
    import dataclasses
    import uuid

    from test_kvbm_spec import config

    cfg = config(tmp_path)
    args = nats()
    cfg.extra_config["secondary_tiers"] = [{
        "type": "KvbmFleetTier", "module_path": "kvbm_vllm.tiers",
        "namespace": unique("fleet-dp"), "capacity": 8,
        "nats_url": args[1], "nats_user": args[3], "nats_password_file": args[5],
        "trust_root": root.trust_root, "credential_file": credential_file,
    }]
    parallel = dataclasses.replace(cfg.parallel, data_parallel_index=index,
                                   data_parallel_size=size)
    return dataclasses.replace(cfg, parallel=parallel,
                               engine_id=f"kvbm-dp{index}-{uuid.uuid4().hex}")


def test_data_parallel_engine_cores_each_join_as_their_own_member(tmp_path):
    """vLLM hands every DP engine core the same configuration: ``{dp_rank}`` in
    ``credential_file`` gives each core its own credential, so each is its own member (instance);
    without it the tier refuses to start, naming the key."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    root = Root(tmp_path / "root")
    for r in range(2):
        os.replace(root.issue(0xD0 + r, "dp"), tmp_path / f"core{r}.cred")
    per_core = str(tmp_path / "core{dp_rank}.cred")
    managers = [OffloadingSpecFactory.create_spec(
        _dp_fleet_config(tmp_path, i, 2, per_core, root)).get_manager() for i in range(2)]
    try:
        ids = [m.secondary_tiers[0].fleet_stats()["instance"] for m in managers]
        assert ids[0] != ids[1], ids
    finally:
        for m in managers:
            m.shutdown()
    with pytest.raises(ValueError, match=r"2 data-parallel engine cores.*credential_file"):
        OffloadingSpecFactory.create_spec(
            _dp_fleet_config(tmp_path, 1, 2, str(tmp_path / "core0.cred"), root)).get_manager()
