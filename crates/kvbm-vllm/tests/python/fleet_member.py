"""One vLLM instance's scheduler side for the fleet tests (``test_fleet_tier.py``), as its own
process: vLLM's real ``CPUPrimaryTierOffloadingManager`` and ``TieringOffloadingManager`` (or
kvbm's, ``--impl kvbm``) over a numpy region standing in for vLLM's shared region, with
``KvbmFleetTier`` as the secondary tier. The test drives it with one JSON command per line on
stdin and reads one JSON answer per line on stdout:

``{"op": "store", "keys": [hex, ...]}``   stores the keys as vLLM does (prepare, the worker
                                          writes each chunk's bytes, complete) and settles
``{"op": "load", "keys": [hex, ...]}``    looks each key up as a new request would, following
                                          a promotion; answers per key the lookup's outcome
                                          and the sha256 of the bytes the worker would copy
``{"op": "stats"}``                       the tier's ``fleet_stats()``
``{"op": "exit"}``                        shuts the managers down (the tier departs)

A chunk's bytes are a function of its key (``pattern``), so any process can tell what a key's
bytes must be.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from unittest.mock import MagicMock

import numpy as np

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvbm_vllm import upstream_compat  # noqa: E402
from kvbm_vllm.tiers import KvbmFleetTier, standalone_spec  # noqa: E402

CHUNK = 16384
PRIMARY = 8


def pattern(key: bytes) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return np.random.default_rng(seed).integers(-128, 128, CHUNK, dtype=np.int8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


class Member:
    def __init__(self, args):
        primary_cls, manager_cls = {
            "vllm": (CPUPrimaryTierOffloadingManager, TieringOffloadingManager),
            "kvbm": (upstream_compat.CPUPrimaryTierOffloadingManager,
                     upstream_compat.TieringOffloadingManager),
        }[args.impl]
        self.region = np.zeros((PRIMARY, CHUNK), dtype=np.int8)
        mmap = MagicMock()
        mmap.create_kv_memoryview.return_value = memoryview(self.region)
        self.primary = primary_cls(num_chunks=PRIMARY, mmap_region=mmap)
        config = dict(namespace=args.namespace, capacity=args.capacity, nats_url=args.nats,
                      heartbeat_interval_ms=100, heartbeat_timeout_ms=1000,
                      pull_deadline_ms=3000)
        if args.insecure:
            config["insecure"] = True
        if args.trust_root:
            config["trust_root"] = args.trust_root
        if args.credential:
            config["credential_file"] = args.credential
        if args.disk:
            config["disk_path"] = args.disk
            config["disk_capacity"] = 64
            config["disk_direct_io"] = False  # a temporary directory may be tmpfs
        if args.nats_user:
            config["nats_user"] = args.nats_user
            config["nats_password_file"] = args.nats_password_file
        self.tier = KvbmFleetTier(
            offloading_spec=standalone_spec(args.model, "float16", CHUNK),
            primary_kv_view=self.primary.get_kv_memoryview(),
            tier_type="kvbm_fleet",
            **config,
        )
        self.manager = manager_cls(primary_tier=self.primary, secondary_tiers=[self.tier])
        self.n = 0

    def step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def ctx(self):
        self.n += 1
        c = ReqContext(req_id=f"r{self.n}")
        self.manager.on_new_request(c)
        return c

    def settle(self):
        for _ in range(200):
            self.tier.drain_jobs()
            self.step()
            if not self.tier.has_pending_work():
                self.step()
                return
        raise AssertionError("the fleet tier never settled")

    def store(self, keys):
        # In slices the primary has room for; each one cascades to the fleet tier.
        for at in range(0, len(keys), PRIMARY // 2):
            part = keys[at:at + PRIMARY // 2]
            c = self.ctx()
            out = self.manager.prepare_store(part, c)
            assert out is not None, "the primary has room"
            for k, slot in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.region[int(slot)] = pattern(bytes(k))
            self.manager.complete_store(out.keys_to_store, c)
            self.manager.on_request_finished(c)
            self.settle()
        return {"stored": len(keys)}

    def load_one(self, key):
        c = self.ctx()
        seen = []
        for _ in range(500):
            r = self.manager.lookup(key, c)
            seen.append(r.name)
            if r is LookupResult.HIT:
                spec = self.manager.prepare_load([key], c)
                data = self.region[int(spec.chunk_ids[0])].copy()
                self.manager.complete_load([key], c)
                self.manager.on_request_finished(c)
                self.step()
                return {"result": "HIT", "via": seen, "sha": sha(data)}
            if r is LookupResult.MISS:
                self.manager.on_request_finished(c)
                self.step()
                return {"result": "MISS", "via": seen, "sha": None}
            self.tier.drain_jobs()
            self.step()
            time.sleep(0.002)
        raise AssertionError(f"lookup of {key!r} never resolved: {seen[-5:]}")

    def load(self, keys):
        return {"keys": [self.load_one(k) for k in keys]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", required=True)
    p.add_argument("--model", default="fleet-model")
    p.add_argument("--nats", required=True)
    p.add_argument("--capacity", type=int, default=64)
    p.add_argument("--trust-root", default="")
    p.add_argument("--credential", default="")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--nats-user", default="")
    p.add_argument("--disk", default="")
    p.add_argument("--nats-password-file", default="")
    p.add_argument("--impl", default="vllm", choices=["vllm", "kvbm"])
    args = p.parse_args()
    try:
        m = Member(args)
    except Exception as e:  # noqa: BLE001 - the test reads why it did not start
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 3
    print(json.dumps({"ready": True, "stats": m.tier.fleet_stats()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        keys = [make_offload_key(bytes.fromhex(k), 0) for k in cmd.get("keys", [])]
        if op == "store":
            out = m.store(keys)
        elif op == "load":
            out = m.load(keys)
        elif op == "stats":
            out = m.tier.fleet_stats()
        elif op == "exit":
            m.manager.shutdown()
            print(json.dumps({"bye": True}), flush=True)
            return 0
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
