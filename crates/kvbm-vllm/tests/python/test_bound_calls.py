"""kvbm's ``TieringOffloadingManager`` binds its per-chunk and per-request calls that do nothing
in Python (``lookup``, ``complete_load``, ``complete_store``) straight to Rust on the instance.
These tests hold the bound methods to vLLM's signatures (argument names, keyword-only
``exclude_tier_idx``, ``success`` defaulting to true) and a subclass's override to being called.
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
