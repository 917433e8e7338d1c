"""kvbm's ``TieringOffloadingManager`` binds its per-chunk and per-request calls that do nothing
in Python (``lookup``, ``complete_load``, ``complete_store``) straight to Rust on the instance.
These tests hold the bound methods to vLLM's signatures (argument names, keyword-only
``exclude_tier_idx``, ``success`` defaulting to true) and a subclass's override to being called.
``lookup`` is bound as a C entry (``crate::entry``) whose two-argument positional calls skip
pyo3's argument parsing, every other shape of call going to the pyo3 method: the tests at the
end hold the two paths to one behaviour (answers, keyword names, errors, a Python tier handed
the caller's own objects), for the tiering manager and the CPU manager.
Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import inspect
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_stats  # noqa: E402  (its manager over a Python tier)

env = test_stats.env
started = test_stats.started


def test_bound_calls_take_vllms_argument_names(env):
    B, _ = env
    m, ctx, keys = started(env, "k", 4)
    out = m.prepare_store(keys=keys, req_context=ctx)
    m.complete_store(keys=out.keys_to_store, req_context=ctx)  # success defaults to True
    assert m.lookup(key=keys[0], req_context=ctx) is B.LookupResult.HIT
    spec = m.prepare_load(keys[:2], ctx)
    assert len(spec.block_ids) == 2
    m.complete_load(keys=keys[:2], req_context=ctx)
    # Excluding the only secondary tier: a primary miss is a MISS without asking it.
    absent = B.make_offload_key(b"absent", 0)
    tier = m.secondary_tiers[0]
    tier.keys.add(absent)
    assert m.lookup(absent, ctx, exclude_tier_idx=0) is B.LookupResult.MISS
    assert m.lookup(absent, ctx) is B.LookupResult.HIT_PENDING
    with pytest.raises(TypeError):
        m.lookup(absent, ctx, 0)  # keyword-only, as vLLM's
    # success=False by keyword: the failed store's chunk is freed (a miss again).
    new = B.make_offload_key(b"new", 0)
    out = m.prepare_store([new], ctx)
    m.complete_store(out.keys_to_store, ctx, success=False)
    assert m.lookup(new, ctx, exclude_tier_idx=0) is B.LookupResult.MISS
    m.shutdown()


def test_a_subclass_override_is_called_not_shadowed(env):
    B, manager = env
    calls = []

    class Counting(manager.base):
        def complete_store(self, keys, req_context, success=True):
            calls.append(("complete_store", len(keys), success))
            return super().complete_store(keys, req_context, success)

        def lookup(self, key, req_context, *, exclude_tier_idx=None):
            calls.append(("lookup", exclude_tier_idx))
            return super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)

    m, ctx, (k,) = started(env, "x", 1, cls=Counting)
    assert m.lookup(k, ctx) is B.LookupResult.MISS
    out = m.prepare_store([k], ctx)
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(k, ctx, exclude_tier_idx=0) is B.LookupResult.HIT
    assert calls == [("lookup", None), ("complete_store", 1, True), ("lookup", 0)]
    m.shutdown()


def test_positional_and_keyword_calls_answer_alike(env):
    B, _ = env
    m, ctx, keys = started(env, "e", 6, chunks=64)
    # The bound attribute is the entry, not the pyo3 method (a plain positional call takes it).
    assert m.lookup.__name__ == "lookup"
    assert m.lookup is not m._rs.lookup
    # Its signature is vLLM's, as introspection reads it.
    params = inspect.signature(m.lookup).parameters
    assert list(params) == ["key", "req_context", "exclude_tier_idx"]
    assert params["exclude_tier_idx"].kind is inspect.Parameter.KEYWORD_ONLY
    out = m.prepare_store(keys[:3], ctx)
    m.complete_store(out.keys_to_store, ctx, True)
    tier = m.secondary_tiers[0]
    tier.keys.add(keys[4])
    HIT, MISS, PENDING = B.LookupResult.HIT, B.LookupResult.MISS, B.LookupResult.HIT_PENDING
    with m.lock:
        for k in keys[:3]:
            assert m.lookup(k, ctx) is HIT
            assert m.lookup(key=k, req_context=ctx) is HIT
            assert m.lookup(k, req_context=ctx) is HIT
        assert m.lookup(keys[3], ctx) is MISS
        assert m.lookup(key=keys[3], req_context=ctx) is MISS
        # Excluding the only tier: its HIT is not seen, through either path.
        assert m.lookup(keys[4], ctx, exclude_tier_idx=0) is MISS
        # The tier's HIT starts a promotion: pending from then on, whichever path asks.
        assert m.lookup(keys[4], ctx) is PENDING
        assert m.lookup(key=keys[4], req_context=ctx) is PENDING
    m.shutdown()


def test_every_other_shape_of_call_is_refused_as_the_pyo3_method_refuses_it(env):
    B, _ = env
    m, ctx, keys = started(env, "w", 1, chunks=64)
    with pytest.raises(TypeError, match="req_context"):
        m.lookup(keys[0])
    with pytest.raises(TypeError):
        m.lookup(keys[0], ctx, 0)  # exclude_tier_idx is keyword-only
    with pytest.raises(TypeError, match="unexpected"):
        m.lookup(keys[0], ctx, tier=0)
    # A bad key through the fast path: the same error the conversion gives everywhere.
    with pytest.raises(TypeError, match="an OffloadKey is bytes"):
        m.lookup(7, ctx)
    with pytest.raises(TypeError, match="an OffloadKey is bytes"):
        m.lookup(key=7, req_context=ctx)
    # The manager is unharmed: the next lookup answers.
    with m.lock:
        assert m.lookup(keys[0], ctx) is B.LookupResult.MISS
    m.shutdown()


def test_a_python_tier_is_handed_the_caller_s_objects_and_its_errors_come_back(env):
    B, _ = env
    m, ctx, keys = started(env, "t", 2, chunks=64)
    tier = m.secondary_tiers[0]
    seen = []
    original = tier.lookup

    def spy(key, req_context):
        seen.append((key, req_context))
        return original(key, req_context)

    tier.lookup = spy
    with m.lock:
        assert m.lookup(keys[0], ctx) is B.LookupResult.MISS
        assert m.lookup(key=keys[1], req_context=ctx) is B.LookupResult.MISS
    assert [(k is keys[i], c is ctx) for i, (k, c) in enumerate(seen)] == [(True, True)] * 2

    def broken(key, req_context):
        raise ValueError("tier down")

    tier.lookup = broken
    with m.lock, pytest.raises(ValueError, match="tier down"):
        m.lookup(keys[0], ctx)
    m.shutdown()


def test_a_promotion_job_carries_the_key_objects_its_lookups_were_handed(env):
    """vLLM's promotion jobs hold the keys its lookups were handed; kvbm's hand the tier those
    very objects too (a set then finds them by identity), in each job's order, with a lookup of
    a key already pending and a second request's promotions in between."""
    B, _ = env
    m, ctx, keys = started(env, "p", 6, chunks=64)
    tier = m.secondary_tiers[0]
    tier.keys.update(keys)  # every lookup is a HIT there: a promotion
    jobs = []
    tier.submit_load = jobs.append
    other = B.ReqContext(req_id="r2")
    m.on_new_request(other)
    pending = B.LookupResult.HIT_PENDING
    with m.lock:
        for k in keys[:3]:
            assert m.lookup(k, ctx) is pending
        assert m.lookup(keys[0], ctx) is pending  # already pending: no second promotion
        for k in keys[3:]:
            assert m.lookup(k, other) is pending
        m.on_schedule_end(B.ScheduleEndContext(new_req_ids=["r", "r2"], preempted_req_ids=()))
    assert [[k for k in j.keys] for j in jobs] == [keys[:3], keys[3:]]
    got = [k for j in jobs for k in j.keys]
    assert [g is k for g, k in zip(got, keys)] == [True] * 6
    # Each job's chunk ids: a writable int32 array (vLLM's promotion jobs build one with
    # np.array(..., dtype=np.int32)), one distinct primary slot per key.
    ids = [int(c) for j in jobs for c in j.chunk_ids]
    assert all(j.chunk_ids.dtype == "int32" and j.chunk_ids.flags.writeable for j in jobs)
    assert len(set(ids)) == 6 and all(0 <= c < 64 for c in ids)
    m.shutdown()


def test_a_cascade_job_carries_the_stored_key_objects_and_int32_chunk_ids(env):
    """vLLM's cascade (store) job: the keys complete_store was handed and the primary's
    chunk ids as ``CPULoadStoreSpec.block_ids`` holds them (int32), writable."""
    B, _ = env
    m, ctx, keys = started(env, "c", 5, chunks=64)
    tier = m.secondary_tiers[0]
    jobs = []
    tier.submit_store = jobs.append
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx, True)
    (job,) = jobs
    assert [k is o for k, o in zip(job.keys, keys)] == [True] * 5
    assert job.chunk_ids.dtype == "int32" and job.chunk_ids.flags.writeable
    assert list(job.chunk_ids) == list(out.store_spec.chunk_ids)
    m.shutdown()


def test_the_cpu_manager_s_entry_answers_as_its_method(env):
    B, _ = env
    from kvbm_vllm import upstream_compat as K

    m = K.CPUOffloadingManager(num_chunks=4)
    assert m.lookup is not m._rs.lookup
    assert list(inspect.signature(m.lookup).parameters) == ["key", "req_context"]
    ctx = B.ReqContext(req_id="c")
    m.on_new_request(ctx)
    keys = [B.make_offload_key(f"c{i}".encode(), 0) for i in range(2)]
    out = m.prepare_store(keys[:1], ctx)
    m.complete_store(out.keys_to_store, ctx)
    for k, want in ((keys[0], B.LookupResult.HIT), (keys[1], B.LookupResult.MISS)):
        assert m.lookup(k, ctx) is want
        assert m.lookup(key=k, req_context=ctx) is want
        assert m._rs.lookup(k, ctx) is want
    with pytest.raises(TypeError, match="req_context"):
        m.lookup(keys[0])
    with pytest.raises(TypeError, match="an OffloadKey is bytes"):
        m.lookup("c0", ctx)
