"""kvbm's managers take the keys of a ``prepare_load`` or ``prepare_store`` from the lookups
just made when the caller hands back the very objects it looked up (``Contexts::
keys_after_lookups``: vLLM loads a request's hits and stores its misses). These tests hold that
shortcut to exactness: an object is matched only by identity while the log keeps it alive, so a
new key object (even one at a freed object's address) is always read, and a list that is not a
subsequence of the lookups is read as it is.
Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_stats  # noqa: E402  (its manager over a Python tier)

env = test_stats.env
started = test_stats.started


def _key(B, text):
    return B.make_offload_key(text.encode(), 0)


def test_new_objects_after_lookups_are_read_not_taken_for_the_old(env):
    B, _ = env
    m, ctx, _ = started(env, "unused", 0, chunks=1024)
    reused = 0
    for r in range(40):
        looked = [_key(B, f"old{r}-{i}") for i in range(8)]
        with m.lock:
            for k in looked:
                assert m.lookup(k, ctx) is B.LookupResult.MISS
        addresses = {id(k) for k in looked}
        del looked, k
        gc.collect()
        # Same-sized objects made right after: CPython's allocator would hand back freed
        # addresses, were the log not keeping the looked-up objects alive.
        new = [_key(B, f"new{r}-{i}") for i in range(8)]
        reused += len(addresses & {id(k) for k in new})
        with m.lock:
            out = m.prepare_store(new, ctx)
            assert list(out.keys_to_store) == new
            m.complete_store(out.keys_to_store, ctx, True)
            for k in new:
                assert m.lookup(k, ctx, exclude_tier_idx=0) is B.LookupResult.HIT
            assert m.lookup(_key(B, f"old{r}-0"), ctx, exclude_tier_idx=0) is B.LookupResult.MISS
    # The log held every looked-up object until the store: no address came back.
    assert reused == 0
    m.shutdown()


def test_loads_and_stores_of_other_orders_and_other_objects_read_each_key(env):
    B, _ = env
    from vllm.v1.kv_offload.tiering import base as TB

    m, ctx, keys = started(env, "k", 12, chunks=64)
    # The tier reports each store finished at its next poll, so the cascade's pins go.
    tier, done = m.secondary_tiers[0], []
    submit = tier.submit_store
    tier.submit_store = lambda job: (submit(job), done.append(job.job_id))
    tier.get_finished_jobs = lambda: [
        TB.JobResult(job_id=done.pop(), success=True, transfer_time=0.0) for _ in list(done)
    ]
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx, True)
    with m.lock:
        for k in keys:
            assert m.lookup(k, ctx) is B.LookupResult.HIT
        # Reversed (not a subsequence), equal copies (other objects), a gap past the window.
        copies = [bytes(bytearray(k)) for k in keys[:3]]
        assert all(c == k and c is not k for c, k in zip(copies, keys))
        for sub in (keys[::-1], copies, keys[0:1] + keys[9:12]):
            for k in keys:
                m.lookup(k, ctx)
            spec = m.prepare_load(list(sub), ctx)
            assert len(spec.block_ids) == len(sub)
            m.complete_load(list(sub), ctx)
    # Each load pinned and unpinned exactly its keys: all evictable, the store of 64 new keys
    # evicts every one of them.
    fresh = [_key(B, f"fresh{i}") for i in range(64)]
    m.on_request_finished(ctx)
    ctx2 = B.ReqContext(req_id="after")
    m.on_new_request(ctx2)
    out = m.prepare_store(fresh, ctx2)
    assert out is not None and sorted(out.evicted_keys) == sorted(keys)
    m.shutdown()
