"""The tiering manager's ``lookup`` is a C entry (``crate::entry``) whose two-argument
positional calls skip pyo3's argument parsing; every other shape of call goes to the pyo3
method, which parses and reports it. These tests hold the two paths to one behaviour: the same
answers, vLLM's keyword names, the same errors, and a Python tier's ``lookup`` reached from
either with the caller's own objects.
Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_stats  # noqa: E402  (its manager over a Python tier)

env = test_stats.env
started = test_stats.started


def test_positional_and_keyword_calls_answer_alike(env):
    B, _ = env
    m, ctx, keys = started(env, "e", 6, chunks=64)
    # The bound attribute is the entry, not the pyo3 method (a plain positional call takes it).
    assert m.lookup.__name__ == "lookup"
    assert m.lookup is not m._rs.lookup
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


def test_the_cpu_manager_s_entry_answers_as_its_method(env):
    B, _ = env
    from kvbm_vllm import upstream_compat as K

    m = K.CPUOffloadingManager(num_chunks=4)
    assert m.lookup is not m._rs.lookup
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
