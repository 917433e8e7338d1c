"""Back-pressure over a slow ``kvbm_disk``: kvbm's manager drops stores as vLLM's does.

vLLM's detector (``EMABackpressureDetector`` with ``DropStorePolicy``, configured on the tier as
vLLM's factory reads it) judges a tier by the time from a store job's submission to the
manager seeing it finish. Here the tier is slow as the manager sees it: every cascade is
reported no sooner than ``SLOW_S`` after it was submitted (the driver lets that much time pass
before the next step polls the tier), far above the detector's high water mark. The same
rounds run through vLLM's own ``TieringOffloadingManager`` over the Python ``kvbm_disk`` tier
and through ``KvbmOffloadingSpec``, whose manager drives the same tier natively in Rust; the
back-pressure series vLLM's dashboards read must match: stores and blocks dropped per tier
equal, and non-zero (warm-up stores go through, then every store is dropped while the tier is
slow); the latency EMA (wall-clock) within the jitter of two runs.
"""

from __future__ import annotations

import time

import numpy as np

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_config import offloading_config  # noqa: E402

SLOW_S = 0.03
ROUNDS = 9
WARMUP = 2


def config(tmp_path, spec):
    disk = {
        "type": "KvbmDiskTier", "module_path": "kvbm_vllm.tiers",
        "path": str(tmp_path / f"{spec}.bin"), "capacity": 64, "direct_io": False,
        "backpressure": {
            "backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
            "high_water_s": 0.01, "low_water_s": 0.002, "warmup_completions": WARMUP,
            # No recovery within the test: the tier stays slow.
            "decay_half_life_s": 1e6, "cooldown_s": 0.0,
        },
    }
    extra = {"cpu_bytes_to_use": 32 * 4096, "secondary_tiers": [disk], "spec_name": spec,
             # Completions seen on the scheduler's steps only, as the driver paces them.
             "tier_poll_interval_s": 0}
    if spec == "KvbmOffloadingSpec":
        extra.update(spec_module_path="kvbm_vllm.spec", kvbm_upstream_bugs=True)
    return offloading_config(extra)


def _backpressure_series(stats) -> dict:
    if stats is None:
        return {}
    return {k: v for k, v in stats.reduce().items() if "backpressure" in k or "dropped" in k}


def drive(tmp_path, spec_name):
    spec = OffloadingSpecFactory.create_spec(config(tmp_path, spec_name))
    m = spec.get_manager()
    view = m.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)
    series: dict = {}
    native = getattr(m, "_python_tier", None)
    try:
        for i in range(ROUNDS):
            rid = f"r{i}"
            c = ReqContext(req_id=rid)
            m.on_new_request(c)
            key = make_offload_key(f"bp-{i}".encode(), 0)
            assert m.lookup(key, c) is LookupResult.MISS
            out = m.prepare_store([key], c)
            for k, slot in zip(out.keys_to_store, out.store_spec.block_ids):
                rows[int(slot)] = i
            m.complete_store(out.keys_to_store, c)
            m.on_request_finished(c)
            m.on_schedule_end(ScheduleEndContext(new_req_ids=(rid,), preempted_req_ids=()))
            time.sleep(SLOW_S)
            for _ in range(5000):
                m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
                if not m.has_pending_work():
                    break
                time.sleep(0.001)
            else:
                raise AssertionError("the manager never settled")
            for k, v in _backpressure_series(m.get_stats()).items():
                series[k] = series.get(k, 0) + v
    finally:
        m.shutdown()
    return series, native


def test_a_slow_kvbm_disk_drops_the_same_stores_under_both_managers(tmp_path):
    v, _ = drive(tmp_path, "TieringOffloadingSpec")
    k, native = drive(tmp_path, "KvbmOffloadingSpec")
    assert native == [False], "kvbm's manager drives kvbm_disk in Rust"
    dropped = {s: n for s, n in v.items() if "dropped" in s}
    assert dropped, f"vLLM reports no drop series: {sorted(v)}"
    # Warm-up completions go through, one more sets the pressure, the rest are dropped.
    assert max(dropped.values()) == ROUNDS - WARMUP - 1, v
    assert sorted(k) == sorted(v), "the same series"
    for s in v:
        if "latency_ema" in s:
            # Seconds per MiB of wall-clock latency: well above the high water mark in both,
            # and within the jitter of two runs of the same pacing.
            assert k[s] > 0.01 and v[s] > 0.01
            assert abs(k[s] - v[s]) < 0.25 * v[s], (k[s], v[s])
        else:
            assert k[s] == v[s], s
