"""``KvbmDiskDirectSpec``: vLLM 0.34's direct file path over kvbm's disk, driven as vLLM's
connector drives a spec: the manager on the scheduler side, the worker given vLLM's
``CanonicalKVCaches`` and ``DevicePointers`` resolved by vLLM's own ``resolve_device_pointers``,
with host memory standing in for the device. Stores, loads (bytes compared), a restart (warm),
a corrupted slot (a failed load, then a miss), room, the spec's refusals, and vLLM 0.33's
refusal of the whole spec.
"""

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_config import offloading_config  # noqa: E402

from kvbm_vllm import register  # noqa: E402
from kvbm_vllm.contract import UnsupportedVllm, installed  # noqa: E402

V034 = installed().line >= (0, 34)
needs_034 = pytest.mark.skipif(not V034, reason="the direct path is vLLM 0.34's")

PAGE = 256  # bytes per block per layer
LAYERS = 2
BPC = 2  # blocks per chunk
BLOCKS = 16


def config(tmp_path, extra=None, world_size=1, bpc=BPC, events=False):
    return offloading_config(
        {
            "spec_name": "KvbmDiskDirectSpec",
            "kvbm_path": str(tmp_path / "direct.bin"),
            "kvbm_capacity": 8,
            "kvbm_direct_io": False,
            **(extra or {}),
        },
        layers=("l0", "l1"), worker_kv_bytes_per_block=PAGE * LAYERS, blocks_per_chunk=bpc,
        world_size=world_size, events=events)


class HostTensor:
    """What vLLM's pointer resolution reads of a KV cache tensor, over numpy host memory."""

    def __init__(self, blocks, page, device="cpu"):
        self.a = np.zeros((blocks, page), dtype=np.uint8)
        self.shape = self.a.shape
        self.device = SimpleNamespace(type=device)

    def data_ptr(self):
        return self.a.ctypes.data

    def stride(self, dim):
        return self.a.strides[dim]

    def element_size(self):
        return 1


def kv_caches(device="cpu"):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    tensors = [CanonicalKVCacheTensor(tensor=HostTensor(BLOCKS, PAGE, device), page_size_bytes=PAGE)
               for _ in range(LAYERS)]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


class Engine:
    """The scheduler's manager and the worker of one spec, over one KV cache."""

    def __init__(self, spec):
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

        self.resolve = resolve_device_pointers
        self.spec = spec
        self.m = spec.get_manager()
        self.kv = kv_caches()
        self.w = spec.get_worker(self.kv)
        self.job = 0
        self.n = 0

    def pages(self, layer):
        return self.kv.tensors[layer].tensor.a

    def ctx(self):
        self.n += 1
        c = ReqContext(req_id=f"r{self.n}")
        self.m.on_new_request(c)
        return c

    def gpu(self, blocks, first=0):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        return self.resolve(GPULoadStoreSpec(blocks, [len(blocks)], [first]), self.kv)

    def run(self, submit):
        self.job += 1
        submit(self.job)
        self.w.wait({self.job})
        (r,) = [r for r in self.w.get_finished() if r.job_id == self.job]
        return r

    def store(self, keys, blocks):
        c = self.ctx()
        out = self.m.prepare_store(keys, c)
        assert out is not None
        r = self.run(lambda j: self.w.submit_store(j, self.gpu(blocks), out.store_spec))
        self.m.complete_store(out.keys_to_store, c, success=r.success)
        self.m.on_request_finished(c)
        return out, r

    def load(self, keys, blocks):
        c = self.ctx()
        assert [self.m.lookup(k, c) for k in keys] == [LookupResult.HIT] * len(keys)
        spec = self.m.prepare_load(keys, c)
        r = self.run(lambda j: self.w.submit_load(j, spec, self.gpu(blocks), expedited=True))
        self.m.complete_load(keys, c)
        self.m.on_request_finished(c)
        return r


def keys(n, start=0):
    return [make_offload_key(f"k{i}".encode().ljust(8, b"\0"), 0) for i in range(start, start + n)]


@needs_034
def test_by_name_stores_loads_and_restarts_warm(tmp_path, caplog):
    register()
    caplog.set_level(logging.INFO, logger="vllm.kvbm_vllm")
    e = Engine(OffloadingSpecFactory.create_spec(config(tmp_path)))
    rng = np.random.default_rng(1)
    for layer in range(LAYERS):
        e.pages(layer)[:] = rng.integers(0, 256, size=(BLOCKS, PAGE), dtype=np.uint8)
    ks = keys(3)
    out, r = e.store(ks, [0, 1, 2, 3, 4, 5])
    assert r.success and r.transfer_size == 6 * LAYERS * PAGE
    assert [int(s) for s in out.store_spec.slots] == [0, 1, 2]
    want = [e.pages(layer)[:6].copy() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        e.pages(layer)[8:14] = 0
    assert e.load(ks, [8, 9, 10, 11, 12, 13]).success
    for layer in range(LAYERS):
        np.testing.assert_array_equal(e.pages(layer)[8:14], want[layer])
    assert "kvbm direct disk (vLLM 0.34 direct path)" in caplog.text
    assert "0 chunks warm" in caplog.text
    e.w.shutdown()
    e.m.shutdown()
    del e

    # A restart on the same file: the journal's chunks come back on lookup.
    caplog.clear()
    e2 = Engine(OffloadingSpecFactory.create_spec(config(tmp_path)))
    assert "3 chunks warm" in caplog.text
    assert e2.load(ks[1:], [0, 1, 2, 3]).success
    for layer in range(LAYERS):
        np.testing.assert_array_equal(e2.pages(layer)[0:4], want[layer][2:6])


@needs_034
def test_a_chunk_entered_mid_way_round_trips(tmp_path):
    e = Engine(OffloadingSpecFactory.create_spec(config(
        tmp_path, {"spec_module_path": "kvbm_vllm.direct"})))
    e.pages(0)[5] = 7
    e.pages(1)[5] = 9
    c = e.ctx()
    k = keys(1, 40)
    out = e.m.prepare_store(k, c)
    # One block, logical block 1 of its chunk (vLLM's block_indices).
    r = e.run(lambda j: e.w.submit_store(j, e.gpu([5], first=1), out.store_spec))
    assert r.success
    e.m.complete_store(k, c)
    c = e.ctx()
    assert e.m.lookup(k[0], c) is LookupResult.HIT
    spec = e.m.prepare_load(k, c)
    assert e.run(lambda j: e.w.submit_load(j, spec, e.gpu([11], first=1))).success
    e.m.complete_load(k, c)
    assert (e.pages(0)[11] == 7).all() and (e.pages(1)[11] == 9).all()


@needs_034
def test_a_corrupt_slot_is_a_failed_load_then_a_miss(tmp_path):
    e = Engine(OffloadingSpecFactory.create_spec(config(tmp_path)))
    e.pages(0)[:] = 3
    ks = keys(2, 10)
    out, r = e.store(ks, [0, 1, 2, 3])
    assert r.success
    slot = int(out.store_spec.slots[1])
    path = str(tmp_path / "direct.bin")
    slot_bytes = os.path.getsize(path) // 8
    with open(path, "r+b") as f:
        f.seek(slot * slot_bytes + 17)
        f.write(b"\xee")
    assert not e.load(ks, [4, 5, 6, 7]).success
    c = e.ctx()
    assert e.m.lookup(ks[0], c) is LookupResult.HIT
    assert e.m.lookup(ks[1], c) is LookupResult.MISS


@needs_034
def test_room_is_bounded_with_evicted_keys_and_events(tmp_path):
    e = Engine(OffloadingSpecFactory.create_spec(config(tmp_path, events=True)))
    for i in range(10):
        out, r = e.store(keys(1, 100 + i), [0, 1])
        assert r.success
    assert e.m._rs.usage()[0] == 8
    assert out.evicted_keys, "the tenth store evicted a chunk"
    events = list(e.m.take_events())
    assert events and all(ev.medium is Medium.STORAGE for ev in events)
    assert sum(len(ev.keys) for ev in events if not ev.removed) == 10
    assert sum(len(ev.keys) for ev in events if ev.removed) == 2


@needs_034
def test_pages_outside_the_kv_cache_fail_the_job_not_the_engine(tmp_path, caplog):
    e = Engine(OffloadingSpecFactory.create_spec(config(tmp_path)))
    c = e.ctx()
    k = keys(1, 50)
    out = e.m.prepare_store(k, c)
    p = e.gpu([0, 1])
    p.ptrs[0] = 4096  # not the KV cache
    e.job += 1
    assert e.w.submit_store(e.job, p, out.store_spec)
    (r,) = e.w.get_finished()
    assert (r.job_id, r.success) == (e.job, False)
    assert "outside the KV cache" in caplog.text
    e.m.complete_store(k, c, success=False)
    assert e.m.lookup(k[0], e.ctx()) is LookupResult.MISS


@needs_034
@pytest.mark.parametrize("extra,world,match", [
    ({"kvbm_capacity": 0}, 1, "kvbm_capacity must be an integer >= 1"),
    ({"kvbm_direct_io": "no"}, 1, "kvbm_direct_io must be true or false"),
    ({"kvbm_bogus": 1}, 1, "unknown key"),
    ({"kvbm_path": None}, 1, "missing required key"),
    ({"eviction_policy": "fifo"}, 1, "eviction_policy must be lru or arc"),
    ({}, 2, "runs 2 workers"),
])
def test_bad_configuration_is_refused_naming_it(tmp_path, extra, world, match):
    cfg = config(tmp_path, extra, world_size=world)
    if extra.get("kvbm_path", "") is None:
        del cfg.extra_config["kvbm_path"]
    register()
    with pytest.raises(ValueError, match=match):
        OffloadingSpecFactory.create_spec(cfg)


@needs_034
def test_a_device_kv_cache_is_refused_at_get_worker(tmp_path):
    spec = OffloadingSpecFactory.create_spec(config(tmp_path))
    with pytest.raises(RuntimeError, match="cuda memory"):
        spec.get_worker(kv_caches(device="cuda"))


@pytest.mark.skipif(V034, reason="vLLM 0.33 refuses the direct path")
def test_vllm_033_refuses_the_direct_spec(tmp_path):
    register()
    with pytest.raises(UnsupportedVllm, match="vLLM 0.34's direct file path"):
        OffloadingSpecFactory.create_spec(config(tmp_path))
