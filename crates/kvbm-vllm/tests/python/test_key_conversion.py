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
