"""vLLM's seams on kvbm's CPU manager: a replaced policy hook (``manager._policy.touch``,
``on_store_miss``, ``evict``, ``on_request_finished``) or manager hook (``_allocate_chunks``,
``_record_request_cache_access``) is called where vLLM's manager calls it, and the step-by-step
path that honours them gives, call for call, what the one-Rust-call path gives.

Each manager gets the generated scheduler-like sequences of ``gencalls.py`` twice: once
untouched, once with every hook replaced by a pass-through that counts its calls. The replay
lines (results, errors, evictions, events) must be identical, the final states too, and the
pass-throughs must have been called (else the hooked path was never taken). Needs what
``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gencalls  # noqa: E402
import test_replay  # noqa: E402

POLICY_HOOKS = ("touch", "on_store_miss", "evict", "on_request_finished")
MANAGER_HOOKS = ("_allocate_chunks", "_record_request_cache_access")


@pytest.fixture(scope="module")
def env():
    replay = test_replay.ensure_vllm()
    from vllm.v1.kv_offload import base as V

    from kvbm_vllm.upstream_compat import CPUOffloadingManager

    return replay, V, CPUOffloadingManager


def _pass_through(obj, name, counts):
    original = getattr(obj, name)

    def hook(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(obj, name, hook)


def _state(m, policy):
    pol = m._policy
    if policy == "arc":
        lists = (pol.t1, pol.t2, pol.b1, pol.b2)
        st = [[(k, (c.chunk_id, c.ref_cnt) if c is not None else None) for k, c in q.items()]
              for q in lists]
        st.append(pol.target_t1_size)
    else:
        st = [(k, c.chunk_id, c.ref_cnt) for k, c in pol.chunks.items()]
    return st, m._num_evictable_cache_chunks, m._rs.slots()


@pytest.mark.parametrize("policy", ("lru", "arc"))
@pytest.mark.parametrize("capacity", (7, 64))
@pytest.mark.parametrize("seed", (1, 2, 3))
def test_hooked_path_matches_fast_path(env, seed, capacity, policy):
    replay, V, Manager = env
    text = gencalls.dumps(gencalls.generate(seed))
    fast = Manager(capacity, cache_policy=policy, enable_events=True)
    hooked = Manager(capacity, cache_policy=policy, enable_events=True)
    counts = {}
    for name in POLICY_HOOKS:
        _pass_through(hooked._policy, name, counts)
    for name in MANAGER_HOOKS:
        _pass_through(hooked, name, counts)
    assert hooked._hooked_store and hooked._hooked_finish and hooked._hooked_record
    assert "touch" not in hooked.__dict__, "touch must go through the policy's replacement"

    lines = []
    for m in (fast, hooked):
        calls, orig = replay.parse(text, V.make_offload_key)
        out, _stats = replay.replay_on(m, calls, orig, False, V)
        lines.append(out)
    a, b = (x.splitlines() for x in lines)
    for i, (x, y) in enumerate(zip(a, b), 1):
        assert x == y, f"first difference at line {i}"
    assert len(a) == len(b)
    assert _state(fast, policy) == _state(hooked, policy)
    for name in ("on_request_finished", "_allocate_chunks", "_record_request_cache_access"):
        assert counts.get(name), f"{name} was never called through its replacement"
    if capacity == 7:
        assert counts.get("evict"), "evict was never called through its replacement"
    # ARC's store misses go to on_store_miss; LRU's (vLLM's base hook) to touch.
    assert counts.get("on_store_miss" if policy == "arc" else "touch")


def test_restoring_a_hook_restores_the_fast_path(env):
    _replay, V, Manager = env
    m = Manager(4)
    fast_touch = m.touch
    pol = m._policy
    seen = []
    original = pol.touch
    pol.touch = lambda keys, ctx: seen.append(list(keys))
    assert "touch" not in m.__dict__
    ctx = V.ReqContext(req_id="r")
    key = V.make_offload_key(b"k", 0)
    m.touch([key], ctx)
    assert seen == [[key]]
    pol.touch = original  # what monkeypatch's undo does
    assert m.touch is fast_touch
    assert not m._hooked_store
    del pol.touch
    assert m.touch is fast_touch and not m._hooked_store


def test_replaced_allocator_error_propagates_after_eviction(env):
    _replay, V, Manager = env
    m = Manager(2, enable_events=True)
    ctx = V.ReqContext(req_id="r")
    k = [V.make_offload_key(bytes([65 + i]) * 4, 0) for i in range(4)]
    assert m.prepare_store(k[:2], ctx) is not None
    m.complete_store(k[:2], ctx)

    def fail(keys):
        raise RuntimeError("no chunks")

    m._allocate_chunks = fail
    with pytest.raises(RuntimeError, match="no chunks"):
        m.prepare_store(k[2:3], ctx)
    # vLLM evicts before it allocates: the victim is gone, its event recorded, and the
    # chunk pool stays whole (the next store finds the freed chunk).
    assert m.lookup(k[0], ctx) is V.LookupResult.MISS
    assert [e.keys for e in m.take_events()][-1] == [k[0]]
    del m._allocate_chunks
    out = m.prepare_store(k[2:3], ctx)
    assert out is not None and out.evicted_keys == []
