"""Key collections crossing into Rust: a list or tuple of the very objects the last call
converted is answered without reading them again (``bridge::keys``); anything else is read
afresh. These tests hold that shortcut to the same answers as a fresh conversion: a list
changed in place, a new list with one other object, equal keys in new objects, a tuple, a
set. Needs what ``test_replay.py`` needs (vLLM's sources or a real vLLM; no Rust binary).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_replay  # noqa: E402


@pytest.fixture(scope="module")
def env():
    test_replay.ensure_vllm()
    from vllm.v1.kv_offload import base as V

    from kvbm_vllm.upstream_compat import CPUOffloadingManager

    return V, CPUOffloadingManager


def _stored(env, names):
    """A manager holding `names` (stored and complete), its request context, and the keys."""
    V, Manager = env
    m = Manager(num_chunks=8)
    ctx = V.ReqContext(req_id="r")
    m.on_new_request(ctx)
    keys = {n: V.make_offload_key(n.encode(), 0) for n in names}
    stored = [keys[n] for n in names]
    out = m.prepare_store(stored, ctx)
    m.complete_store(out.keys_to_store, ctx)
    return m, ctx, keys


def test_a_list_changed_in_place_is_read_again(env):
    V, _ = env
    m, ctx, k = _stored(env, ["a", "b", "c", "d"])
    ks = [k["a"], k["b"], k["c"]]
    m.prepare_load(ks, ctx)
    ks[2] = k["d"]  # same list object, same length, one other key
    with pytest.raises(AssertionError, match="not being read"):
        m.complete_load(ks, ctx)


def test_a_new_list_with_one_other_object_is_read_again(env):
    V, _ = env
    m, ctx, k = _stored(env, ["a", "b", "c"])
    m.prepare_load([k["a"], k["b"]], ctx)
    absent = V.make_offload_key(b"zz", 0)
    with pytest.raises(AssertionError, match="unknown|not"):
        m.complete_load([k["a"], absent], ctx)


def test_equal_keys_in_new_objects_and_other_collections_give_the_same_answers(env):
    V, _ = env
    m, ctx, k = _stored(env, ["a", "b", "c"])
    # The same values as new bytes objects, then as a tuple, then as a set: each unpins.
    for shape in (list, tuple, set):
        m.prepare_load([k["a"], k["b"]], ctx)
        copies = [bytes(bytearray(k["a"])), bytes(bytearray(k["b"]))]
        assert copies[0] == k["a"] and copies[0] is not k["a"]
        m.complete_load(shape(copies), ctx)
        assert m.prepare_store([k["a"], k["b"]], ctx).keys_to_store == []
    # Both chunks are back to unpinned: evicting everything else makes room for them.
    m.on_request_finished(ctx)
    ctx2 = V.ReqContext(req_id="r2")
    m.on_new_request(ctx2)
    new = [V.make_offload_key(f"n{i}".encode(), 0) for i in range(8)]
    out = m.prepare_store(new, ctx2)
    assert out is not None and len(out.keys_to_store) == 8


def test_the_same_objects_in_a_new_list_pin_and_unpin_the_same_chunks(env):
    V, _ = env
    m, ctx, k = _stored(env, ["a", "b"])
    first = m.prepare_load([k["a"], k["b"]], ctx).block_ids.tolist()
    again = m.prepare_load([k["a"], k["b"]], ctx).block_ids.tolist()
    assert first == again
    m.complete_load([k["a"], k["b"]], ctx)
    m.complete_load((k["a"], k["b"]), ctx)
    # Unpinned twice, pinned twice: a third complete is refused.
    with pytest.raises(AssertionError, match="not being read"):
        m.complete_load([k["a"], k["b"]], ctx)


def test_a_key_that_is_not_bytes_is_a_type_error_naming_it(env):
    V, Manager = env
    m = Manager(num_chunks=4)
    ctx = V.ReqContext(req_id="r")
    m.on_new_request(ctx)
    with pytest.raises(TypeError, match="an OffloadKey is bytes.*str"):
        m.lookup("not-bytes", ctx)
    with pytest.raises(TypeError, match="an OffloadKey is bytes.*bytearray"):
        m.prepare_store([V.make_offload_key(b"a", 0), bytearray(b"abcdefgh")], ctx)
    with pytest.raises(ValueError, match="key"):
        m.lookup(b"x" * 64, ctx)

    # A bytes subclass is bytes: its value is the key.
    class Key(bytes):
        pass

    k = V.make_offload_key(b"sub", 0)
    out = m.prepare_store([Key(k)], ctx)
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(k, ctx) is V.LookupResult.HIT


def test_keys_to_store_are_the_callers_own_objects(env):
    V, _ = env
    m, ctx, k = _stored(env, ["a", "b"])
    # Every key new: the very objects handed in, in their order.
    fresh = [V.make_offload_key(f"f{i}".encode(), 0) for i in range(3)]
    out = m.prepare_store(fresh, ctx)
    assert len(out.keys_to_store) == 3
    assert all(got is want for got, want in zip(out.keys_to_store, fresh))
    m.complete_store(out.keys_to_store, ctx)
    # Some already stored: the others, still the caller's objects, in their order.
    mixed = [k["a"], V.make_offload_key(b"g0", 0), k["b"], V.make_offload_key(b"g1", 0)]
    out = m.prepare_store(mixed, ctx)
    assert [x for x in out.keys_to_store] == [mixed[1], mixed[3]]
    assert out.keys_to_store[0] is mixed[1] and out.keys_to_store[1] is mixed[3]
    # A new list object, not the caller's (vLLM's is a new list too).
    assert out.keys_to_store is not mixed


def test_a_cascade_job_carries_the_callers_key_objects(env):
    """``complete_store`` cascades to a Python tier with a job whose keys are the objects the
    caller passed (vLLM's manager hands them on as they are), a partial list included. (`env`
    makes vLLM's sources importable.)"""
    import numpy as np
    from vllm.v1.kv_offload import base as B
    from vllm.v1.kv_offload.tiering import base as TB

    from kvbm_vllm import upstream_compat as K

    import test_parent_handle

    jobs = []
    B, m = test_parent_handle._manager((np, B, TB, K), lambda parent: None, jobs)
    try:
        with m.lock:
            ctx = B.ReqContext(req_id="c")
            m.on_new_request(ctx)
            ks = [B.make_offload_key(f"c{i}".encode(), 0) for i in range(4)]
            out = m.prepare_store(ks, ctx)
            m.complete_store(out.keys_to_store, ctx, True)
            # Half of them again (already stored) beside two new ones: only the new ones go.
            more = [ks[0], B.make_offload_key(b"d0", 0), ks[1], B.make_offload_key(b"d1", 0)]
            out2 = m.prepare_store(more, ctx)
            m.complete_store(out2.keys_to_store, ctx, True)
        stored = [list(j.keys) for j in jobs]
        assert stored == [ks, [more[1], more[3]]]
        assert all(a is b for a, b in zip(stored[0], ks))
        assert stored[1][0] is more[1] and stored[1][1] is more[3]
    finally:
        m.shutdown()
