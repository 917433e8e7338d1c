"""vLLM's tiering metrics mean the same over kvbm's manager as over vLLM's own.

vLLM's dashboards read ``vllm:kv_offload_tiering_*`` (queries, hits, bytes, failures, latency
counts, active jobs, primary usage, back-pressure, deferred releases). vLLM's
``TieringMetricsTracker`` counts a lookup once per request, tier and key, when it resolves,
and only until the request is allocated. Here vLLM's ``TieringOffloadingManager`` and kvbm's are
driven through the same generated call sequences (several requests looking the same keys up
over several steps, promotions from a secondary tier, failed promotions, stores and
cascades), each over its own primary and an identical in-memory tier, and every series of
``get_stats().reduce()`` is compared after every step: counters and gauges by value,
histograms by count (their sums are wall-clock seconds).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from unittest.mock import MagicMock  # noqa: E402

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager as VllmPrimary,
)
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    TieringOffloadingManager as VllmTiering,
)

from kvbm_vllm import upstream_compat  # noqa: E402

CHUNK_BYTES = 64


class MemTier(SecondaryTierManager):
    """A set of keys; every job reported at the next poll; a load fails for the keys listed in
    ``fail`` (the rest land, reported as ``successful_keys``)."""

    medium = Medium.CPU

    def __init__(self, view):
        super().__init__(offloading_spec=None, primary_kv_view=view, tier_type="mem")
        self.keys: set = set()
        self.fail: set = set()
        self.done: list = []

    def lookup(self, key, req_context):
        return LookupResult.HIT if key in self.keys else LookupResult.MISS

    def submit_store(self, job):
        self.keys.update(job.keys)
        self.done.append(JobResult(job_id=job.job_id, success=True, transfer_time=0.001))

    def submit_load(self, job):
        ok = [k for k in job.keys if k not in self.fail]
        if len(ok) == len(job.keys):
            self.done.append(JobResult(job_id=job.job_id, success=True, transfer_time=0.001))
        else:
            self.done.append(JobResult(job_id=job.job_id, success=False,
                                       successful_keys=tuple(ok) or None, transfer_time=0.001))

    def get_finished_jobs(self):
        done, self.done = self.done, []
        return done

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self):
        return


def _manager(impl: str, capacity: int):
    region = np.zeros((capacity, CHUNK_BYTES), dtype=np.int8)
    mmap = MagicMock()
    mmap.create_kv_memoryview.return_value = memoryview(region)
    if impl == "vllm":
        primary = VllmPrimary(num_chunks=capacity, mmap_region=mmap)
        tier = MemTier(primary.get_kv_memoryview())
        return VllmTiering(primary_tier=primary, secondary_tiers=[tier]), tier
    primary = upstream_compat.CPUPrimaryTierOffloadingManager(num_chunks=capacity,
                                                              mmap_region=mmap)
    tier = MemTier(primary.get_kv_memoryview())

    class Exact(upstream_compat.TieringOffloadingManager):
        _UPSTREAM = True  # vLLM's behaviour, so both managers take the same paths

    return Exact(primary_tier=primary, secondary_tiers=[tier]), tier


def _series(stats) -> dict:
    """Counters and gauges by value; histograms by their count (sums are seconds)."""
    if stats is None:
        return {}
    out = {}
    for k, v in stats.reduce().items():
        if isinstance(v, float) and ("seconds" in k or "_time" in k) and "count" not in k:
            continue  # wall-clock values differ between two runs
        out[k] = v
    return out


def _script(seed: int):
    """A step-by-step call plan: (kind, args), identical for both managers."""
    rng = random.Random(seed)
    key = lambda i: make_offload_key(i.to_bytes(8, "big"), 0)  # noqa: E731
    steps = []
    seeded = [key(1000 + i) for i in range(12)]  # put in the secondary tier directly
    live: dict[str, list] = {}
    n = 0
    for step in range(14):
        calls = []
        new_ids = []
        # New requests: prefixes of shared keys and seeded keys, some looked up again later.
        for _ in range(rng.randint(1, 3)):
            n += 1
            rid = f"r{n}"
            prefix = [key(rng.randint(0, 12)) for _ in range(rng.randint(1, 5))]
            prefix += rng.sample(seeded, rng.randint(0, 3))
            live[rid] = prefix
            calls.append(("new", rid))
            calls.append(("lookup", rid, prefix))
            if rng.random() < 0.6:
                calls.append(("lookup", rid, prefix))  # the same keys, same request, again
            if rng.random() < 0.7:
                new_ids.append(rid)
        # Requests still waiting look again (not yet allocated: counted once per key).
        for rid in list(live):
            if rid not in new_ids and rng.random() < 0.3:
                calls.append(("lookup", rid, live[rid]))
        for rid in new_ids:
            calls.append(("store", rid, [key(5000 + step * 100 + i) for i in range(2)]
                          + live[rid][:1]))
            calls.append(("lookup", rid, live[rid]))  # allocated this step: not counted
        calls.append(("end", tuple(new_ids)))
        for rid in list(live):
            if rng.random() < 0.4:
                calls.append(("finish", rid))
                del live[rid]
        steps.append(calls)
    return seeded, steps


def _drive(impl: str, seed: int):
    m, tier = _manager(impl, capacity=24)
    seeded, steps = _script(seed)
    tier.keys.update(seeded)
    tier.fail.update(seeded[::4])  # every fourth seeded key fails its promotion
    ctxs: dict[str, ReqContext] = {}
    answers, series = [], []
    try:
        for calls in steps:
            for call in calls:
                kind, arg = call[0], call[1]
                if kind == "new":
                    ctxs[arg] = ReqContext(req_id=arg)
                    m.on_new_request(ctxs[arg])
                elif kind == "lookup":
                    answers.append([m.lookup(k, ctxs[arg]) for k in call[2]])
                elif kind == "store":
                    out = m.prepare_store(call[2], ctxs[arg])
                    answers.append(None if out is None else list(out.keys_to_store))
                    if out is not None and out.keys_to_store:
                        m.complete_store(out.keys_to_store, ctxs[arg], True)
                elif kind == "end":
                    m.on_schedule_end(ScheduleEndContext(new_req_ids=arg, preempted_req_ids=()))
                elif kind == "finish":
                    m.on_request_finished(ctxs.pop(arg))
            series.append(_series(m.get_stats()))
    finally:
        m.shutdown()
    return answers, series


@pytest.mark.parametrize("seed", range(6))
def test_every_tiering_series_equals_vllm_s_on_the_same_calls(seed):
    v_answers, v_series = _drive("vllm", seed)
    k_answers, k_series = _drive("kvbm", seed)
    assert k_answers == v_answers, "the managers answered differently"
    queries = [k for s in v_series for k in s if "chunk_queries" in k]
    assert queries, "the sequence makes vLLM count lookups"
    for step, (v, k) in enumerate(zip(v_series, k_series)):
        assert k == v, f"step {step}: kvbm's series differ from vLLM's"


def test_a_request_s_repeated_lookups_count_once_until_it_is_allocated():
    """The case a per-lookup count gets wrong: one request, three lookups of the same keys
    before it is scheduled, then one after. vLLM counts each (tier, key) once."""
    for impl in ("vllm", "kvbm"):
        m, _ = _manager(impl, capacity=8)
        try:
            ctx = ReqContext(req_id="a")
            m.on_new_request(ctx)
            keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(3)]
            for _ in range(3):
                for k in keys:
                    m.lookup(k, ctx)
            m.on_schedule_end(ScheduleEndContext(new_req_ids=("a",), preempted_req_ids=()))
            for k in keys:
                m.lookup(k, ctx)
            reduced = m.get_stats().reduce()
            got = sorted((k.split(":", 2)[2], v) for k, v in reduced.items()
                         if "tiering_chunk_queries" in k)
            assert got == [("('0:primary',)", 3), ("('1:mem',)", 3)], (impl, got)
        finally:
            m.shutdown()
