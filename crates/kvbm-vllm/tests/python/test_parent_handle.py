"""The ``ParentManager`` kvbm hands a Python tier's ``serve_external_requests``: valid only
during that call and on its thread. Kept and called after the call, or called from another
thread, it raises a clear error (never reaches a dangling manager); dropped later on another
thread (a traceback that kept it, freed elsewhere) it goes quietly: no "unsendable" error
raised while it is freed. Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM).
"""

import gc
import os
import sys
import threading
from unittest.mock import MagicMock

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_replay  # noqa: E402


@pytest.fixture(scope="module")
def env():
    test_replay.ensure_vllm()
    import numpy as np
    from vllm.v1.kv_offload import base as B
    from vllm.v1.kv_offload.tiering import base as TB

    from kvbm_vllm import upstream_compat as K

    return np, B, TB, K


def _manager(env, on_serve, jobs=None):
    """A tiering manager over a Python tier that misses every lookup, calls `on_serve` with the
    parent handle, and appends each store job to `jobs` when given."""
    np, B, TB, K = env

    class Tier(TB.SecondaryTierManager):
        medium = B.Medium.CPU

        def lookup(self, key, req_context):
            return B.LookupResult.MISS

        def submit_store(self, job):
            if jobs is not None:
                jobs.append(job)

        def submit_load(self, job):
            pass

        def get_finished_jobs(self):
            return ()

        def on_new_request(self, req_context):
            return B.RequestOffloadingContext()

        def drain_jobs(self):
            pass

        def serve_external_requests(self, parent):
            on_serve(parent)

    region = np.zeros((8, 64), dtype=np.int8)
    mmap = MagicMock()
    mmap.create_kv_memoryview.return_value = memoryview(region)
    primary = K.CPUPrimaryTierOffloadingManager(num_chunks=8, mmap_region=mmap)
    tier = Tier(offloading_spec=MagicMock(), primary_kv_view=primary.get_kv_memoryview(),
                tier_type="t")
    return B, K.TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])


def _step(B, m):
    with m.lock:
        m.on_schedule_end(B.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def test_a_kept_parent_refuses_later_calls_and_other_threads(env):
    kept, during, elsewhere = [], [], []
    B = env[1]
    ctx = B.ReqContext(req_id="p")
    key = B.make_offload_key(b"parent-key", 0)

    def on_serve(parent):
        kept.append(parent)
        # During the call, on its thread: it answers.
        during.append(parent.lookup(key, ctx))

        # During the call, from another thread: refused, naming why.
        def other():
            try:
                parent.lookup(key, ctx)
                elsewhere.append(None)
            except RuntimeError as e:
                elsewhere.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()

    B, m = _manager(env, on_serve)
    try:
        with m.lock:
            m.on_new_request(ctx)
        _step(B, m)
        assert during == [B.LookupResult.MISS]
        assert len(elsewhere) == 1 and elsewhere[0] is not None
        assert "thread" in elsewhere[0], elsewhere[0]
        # After the call: refused, naming why.
        with pytest.raises(RuntimeError, match="only during the serve_external_requests"):
            kept[0].lookup(key, ctx)
    finally:
        m.shutdown()


def test_a_parent_dropped_on_another_thread_goes_quietly(env):
    raised = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: raised.append(u)
    kept = []
    B, m = _manager(env, kept.append)
    try:
        _step(B, m)
        _step(B, m)
        assert len(kept) == 2

        def drop():
            kept.clear()
            gc.collect()

        t = threading.Thread(target=drop)
        t.start()
        t.join()
        gc.collect()
        assert raised == [], [str(u.exc_value) for u in raised]
    finally:
        sys.unraisablehook = old_hook
        m.shutdown()
