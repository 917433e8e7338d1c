"""kvbm's tiering manager's ``get_stats``: vLLM's stats object, its lookup-latency histograms
built in Rust (``core::F64s``: a list of floats in which equal values are one object).

The payload must read as vLLM's own: a ``list`` of ``float`` per labelled series, one
observation per lookup answered by that tier, which vLLM's ``aggregate`` (it asserts ``list``)
and ``reduce`` take, and which belongs to the caller (changing it changes no later payload).
Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import math
import os
import sys
from unittest.mock import MagicMock

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_replay  # noqa: E402

DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"


@pytest.fixture(scope="module")
def env():
    test_replay.ensure_vllm()
    import numpy as np
    from vllm.v1.kv_offload import base as B
    from vllm.v1.kv_offload.tiering import base as TB

    from kvbm_vllm import upstream_compat as K

    class SetTier(TB.SecondaryTierManager):
        """A Python tier holding a set of keys (every lookup a MISS here: it stays empty)."""

        def __init__(self, view):
            super().__init__(offloading_spec=None, primary_kv_view=view, tier_type="set")
            self.keys = set()

        def lookup(self, key, req_context):
            return B.LookupResult.HIT if key in self.keys else B.LookupResult.MISS

        def submit_store(self, job):
            self.keys.update(job.keys)

        def submit_load(self, job):
            pass

        def get_finished_jobs(self):
            return []

        #: What ``on_new_request`` answers (its ``policy``); vLLM's default when None.
        policy = None

        def on_new_request(self, req_context):
            if self.policy is None:
                return B.RequestOffloadingContext()
            return B.RequestOffloadingContext(policy=self.policy)

        def drain_jobs(self):
            return

    def manager(chunks=64, cls=K.TieringOffloadingManager):
        """kvbm's tiering manager (or subclass `cls`) over a `SetTier`."""
        region = np.zeros((chunks, 16), dtype=np.int8)
        mmap = MagicMock()
        mmap.create_kv_memoryview.return_value = memoryview(region)
        primary = K.CPUPrimaryTierOffloadingManager(num_chunks=chunks, mmap_region=mmap)
        tier = SetTier(primary.get_kv_memoryview())
        return cls(primary_tier=primary, secondary_tiers=[tier])

    manager.base = K.TieringOffloadingManager

    return B, manager


def started(env, tag, n, **kw):
    """A manager (``manager(**kw)``), a started request ``r``, and ``n`` keys named ``tag``."""
    B, manager = env
    m = manager(**kw)
    ctx = B.ReqContext(req_id="r")
    m.on_new_request(ctx)
    return m, ctx, [B.make_offload_key(f"{tag}{i}".encode(), 0) for i in range(n)]


def _delays(stats):
    types, values = stats.metric_sections()
    assert types[DELAY] == "histogram"
    return values[DELAY]


def test_each_lookup_is_one_float_observation_per_tier_asked(env):
    B, _ = env
    m, ctx, stored = started(env, "s", 10)
    out = m.prepare_store(stored, ctx)
    m.complete_store(out.keys_to_store, ctx, True)
    m.get_stats()  # drains what the store did
    fresh = [B.make_offload_key(f"f{i}".encode(), 0) for i in range(300)]
    with m.lock:
        for k in stored:  # primary HIT: the primary's series only
            assert m.lookup(k, ctx) is B.LookupResult.HIT
        for k in fresh:  # primary MISS, then the tier's MISS: both series
            assert m.lookup(k, ctx) is B.LookupResult.MISS
    series = _delays(m.get_stats())
    assert sorted(len(v) for v in series.values()) == [300, 310]
    for values in series.values():
        assert type(values) is list
        assert all(type(v) is float and math.isfinite(v) and v >= 0 for v in values)
    # Nothing is observed twice: the next payload has no delays.
    again = m.get_stats()
    assert again is None or DELAY not in again.metric_sections()[1]
    m.shutdown()


def test_the_payload_is_the_callers_and_vllms_aggregate_and_reduce_take_it(env):
    B, _ = env
    m, ctx, keys = started(env, "k", 200)
    for k in keys:
        m.lookup(k, ctx)
    first = m.get_stats()
    series = _delays(first)
    expected = {labels: list(values) for labels, values in series.items()}
    # vLLM's own merge: it asserts list, copies the first payload's lists and extends them.
    total = type(first)()
    total.aggregate(first)
    # Another request (vLLM counts a request's lookup of a key once: a second look of the
    # same request observes nothing).
    ctx2 = B.ReqContext(req_id="r2")
    m.on_new_request(ctx2)
    for k in keys[:50]:
        m.lookup(k, ctx2)
    second = m.get_stats()
    total.aggregate(second)
    merged = _delays(total)
    for labels, values in expected.items():
        assert merged[labels][: len(values)] == values
        assert len(merged[labels]) == len(values) + len(_delays(second)[labels])
    # Changing one payload's list changes neither the merge nor a later payload.
    for values in series.values():
        values.append(-1.0)
        values[0] = -2.0
    assert all(v >= 0 for vs in merged.values() for v in vs)
    ctx3 = B.ReqContext(req_id="r3")
    m.on_new_request(ctx3)
    for k in keys[:5]:
        m.lookup(k, ctx3)
    assert all(v >= 0 for vs in _delays(m.get_stats()).values() for v in vs)
    reduced = total.reduce()
    for labels, values in merged.items():
        key = f"{DELAY}:{labels}" if labels else DELAY
        assert reduced[f"{key}_count"] == len(values)
        assert reduced[f"{key}_sum"] == pytest.approx(sum(values))
    m.shutdown()


def test_equal_observations_are_one_float_and_distinct_ones_are_not(env):
    B, _ = env
    m, ctx, keys = started(env, "e", 2000)
    with m.lock:
        for k in keys:
            m.lookup(k, ctx)
    for values in _delays(m.get_stats()).values():
        assert len(values) == 2000
        # One object per distinct value (Rust's table: by whole nanoseconds, else by bits).
        by_value = {}
        for v in values:
            assert by_value.setdefault(v, v) is v
        assert len({id(v) for v in values}) == len(by_value)
    m.shutdown()
