"""kvbm's classes that stand where vLLM 0.33's own do, same names, same constructor arguments.

Each is a subclass of vLLM's ABC (so ``isinstance`` checks, subclassing and monkeypatching by
vLLM's callers keep working) whose calls go to kvbm's Rust managers (``kvbm_vllm._kvbm``). They
take vLLM's objects (``bytes`` keys from ``make_offload_key``, ``ReqContext``) and return vLLM's
objects: the ``LookupResult`` members themselves (callers compare with ``is``),
``PrepareStoreOutput`` with a ``CPULoadStoreSpec``, ``OffloadingEvent``, and the connector's
``OffloadingConnectorStats``.

Importing this module imports vLLM's offloading modules and the extension; import it only
where a manager is built (``kvbm_vllm`` itself stays cheap to import).

Classes: ``CPUOffloadingManager``, ``CPUPrimaryTierOffloadingManager`` (the same manager over
vLLM's shared region) and ``TieringOffloadingManager`` (kvbm-tiering's, over that primary;
its secondary tiers are kvbm's own, driven in Rust, or any Python ``SecondaryTierManager``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from collections import OrderedDict

from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from vllm.v1.kv_offload.base import Locality, ScheduleEndContext
from vllm.v1.kv_offload.tiering import manager as _vllm_tiering
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import numpy as np

from kvbm_vllm import extension
from kvbm_vllm.contract import installed
from kvbm_vllm.log import logger

__all__ = ["CPUOffloadingManager", "CPUPrimaryTierOffloadingManager", "TieringOffloadingManager"]

_log = logger

_LOOKUP_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
_POLICIES = {"chunk_level": OffloadPolicy.CHUNK_LEVEL, "request_level": OffloadPolicy.REQUEST_LEVEL}


def _builtin_policy(cache_policy: str, module_path: str | None) -> str:
    """The name of the Rust policy ("lru" or "arc") that runs `cache_policy`.

    The name resolves through vLLM's own factory first, so an unknown name fails exactly as
    vLLM's does. A policy class other than vLLM's built-in LRU and ARC is Python code kvbm's
    Rust manager cannot run: that is a ValueError naming it, never a silent substitute.
    """
    cls = CachePolicyFactory.get_cache_policy_cls(cache_policy, module_path)
    for name in ("lru", "arc"):
        if cls is CachePolicyFactory.get_cache_policy_cls(name, None):
            return name
    raise ValueError(
        f"kvbm's CPU manager runs vLLM's lru and arc policies in Rust; the Python cache "
        f"policy {cls.__module__}.{cls.__qualname__} ({cache_policy!r}) cannot run there. "
        f"Use cache_policy='lru' or 'arc', or vLLM's own CPUOffloadingManager."
    )


#: Chunk ids from Rust are the bytes of an ``int32`` array (``bridge::chunk_ids``); vLLM's
#: specs and jobs copy this view into their own array, as they would a list of ints.
_ids = np.frombuffer
_I32 = np.int32


def _store_output(out) -> PrepareStoreOutput | None:
    """vLLM's ``PrepareStoreOutput`` of a Rust ``prepare_store`` answer (``None``: no room)."""
    if out is None:
        return None
    keys_to_store, chunk_ids, evicted = out
    return PrepareStoreOutput(
        keys_to_store=keys_to_store,
        store_spec=CPULoadStoreSpec(_ids(chunk_ids, _I32)),
        evicted_keys=evicted,
    )


#: The calls whose answer needs no wrapping in Python: a per-chunk lookup, a request's
#: load and store completions.
_DIRECT = ("lookup", "complete_load", "complete_store")


def _bind_direct(manager, base, names) -> None:
    """Binds each of ``names`` of ``manager._rs`` (its Rust object) on ``manager``, where its
    class does not override ``base``'s method: the instance attribute shadows the method (a
    caller may still replace it, as vLLM's tests do), so a call costs no Python frame. The
    Rust methods take vLLM's argument names and defaults."""
    cls = type(manager)
    for name in names:
        if getattr(cls, name) is getattr(base, name):
            # A Rust object's ``NAME_entry()``, where it has one, is the same method as a
            # function object whose positional calls skip pyo3's argument parsing.
            entry = getattr(manager._rs, name + "_entry", None)
            setattr(manager, name, entry() if entry is not None else getattr(manager._rs, name))


class _TrackerView:
    """Read-only view of the store-threshold tracker (vLLM's ``counts``: key -> offers)."""

    __slots__ = ("_rs",)

    def __init__(self, rs):
        self._rs = rs

    def __contains__(self, key) -> bool:
        return self._rs.tracker_count(key) is not None

    def __getitem__(self, key) -> int:
        n = self._rs.tracker_count(key)
        if n is None:
            raise KeyError(key)
        return n

    def get(self, key, default=None):
        n = self._rs.tracker_count(key)
        return default if n is None else n

    def __len__(self) -> int:
        return self._rs.tracker_len() or 0


def _chunk(chunk_id: int, ref_cnt: int) -> ChunkStatus:
    c = ChunkStatus(chunk_id)
    c.ref_cnt = ref_cnt
    return c


#: The policy hooks a caller may replace on ``manager._policy`` (vLLM's manager calls them
#: through its policy object, so a replacement is called in their place).
_POLICY_HOOKS = frozenset({"touch", "on_store_miss", "evict", "on_request_finished"})
#: The manager's own hooks a caller may replace (vLLM's manager calls them through ``self``).
_MANAGER_HOOKS = frozenset({"_allocate_chunks", "_record_request_cache_access"})


def _overridden(obj, name: str) -> bool:
    """Whether ``obj.name`` was replaced: an instance attribute other than ``obj``'s own method
    (``monkeypatch`` restores a method by setting the bound original back)."""
    v = obj.__dict__.get(name)
    if v is None:
        return False
    return not (
        getattr(v, "__self__", None) is obj
        and getattr(v, "__func__", None) is getattr(type(obj), name, None)
    )


class _PolicyView:
    """What kvbm's LRU and ARC views share: ``ChunkStatus`` objects of stable identity, and
    vLLM's policy hooks, each a real method on the Rust policy that a caller may replace.

    The ``ChunkStatus`` objects are snapshots refreshed whenever the state is read (one per
    resident key and chunk id, so reading the same state twice gives the same objects, as
    vLLM's own lists do); writing to them changes nothing in the Rust manager (pin through
    ``prepare_load``).

    Replacing ``touch``, ``on_store_miss``, ``evict`` or ``on_request_finished`` on the view
    (``monkeypatch.setattr(manager._policy, "touch", spy)``) makes the manager call the
    replacement where vLLM's manager calls its policy, with vLLM's arguments; with nothing
    replaced the manager never comes through here (one Rust call per manager call).
    """

    def _attach(self, rs, cache_capacity: int) -> None:
        object.__setattr__(self, "_rs", rs)
        object.__setattr__(self, "cache_capacity", cache_capacity)
        object.__setattr__(self, "_objs", {})
        object.__setattr__(self, "_manager", None)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in _POLICY_HOOKS and self._manager is not None:
            self._manager._refresh_hooks()

    def __delattr__(self, name):
        object.__delattr__(self, name)
        if name in _POLICY_HOOKS and self._manager is not None:
            self._manager._refresh_hooks()

    def _obj(self, key, chunk_id: int, ref_cnt: int, objs: dict) -> ChunkStatus:
        c = self._objs.get(key)
        if c is None or c.chunk_id != chunk_id:
            c = ChunkStatus(chunk_id)
        c.ref_cnt = ref_cnt
        objs[key] = c
        return c

    def _chunks(self, entries) -> OrderedDict:
        objs = {}
        out = OrderedDict((k, self._obj(k, slot, refs, objs)) for k, slot, refs in entries)
        return out

    def _refresh(self, *lists) -> None:
        """Keeps the objects of the keys just read (a full read: every resident key)."""
        merged = {}
        for d in lists:
            merged.update(d)
        object.__setattr__(self, "_objs", merged)

    def get(self, key):
        e = self._rs.chunk(key)
        if e is None:
            return None
        objs = self._objs
        return self._obj(key, e[1], e[2], objs)

    # --- vLLM's policy hooks, on the Rust policy ---

    def touch(self, keys, req_context) -> None:
        self._rs.touch(keys, req_context)

    def evict(self, n: int, protected):
        """``n`` idle, unprotected victims as ``[(key, ChunkStatus)]``, removed from the cache,
        or ``None`` with nothing changed (atomic, as vLLM's). Unlike vLLM's policy (whose
        manager frees the chunks), kvbm frees the victims' chunks here too."""
        out = self._rs.evict(n, protected)
        if out is None:
            return None
        return [(k, _chunk(slot, 0)) for k, slot in out]

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        self._rs.policy_request_finished(
            key_groups, insertion_only_keys, reused_keys, req_context
        )


class _LruView(_PolicyView, LRUCachePolicy):
    """kvbm's LRU in vLLM's policy shape (``manager._policy``): its state read from the Rust
    manager when accessed, its hooks (see ``_PolicyView``) on the Rust policy. ``on_store_miss``
    is vLLM's base one (it calls ``touch``)."""

    def __init__(self, rs, cache_capacity: int):  # noqa: D107 - no vLLM state is built
        self._attach(rs, cache_capacity)

    @property
    def chunks(self):
        d = self._chunks(self._rs.entries())
        self._refresh(d)
        return d

    @property
    def _ranks(self):
        """Each resident key's eviction rank (lower: evicted sooner), as vLLM's ``_ranks``
        orders them; the values are positions, comparable only with each other."""
        return {k: (i, 0) for i, (k, _slot, _refs) in enumerate(self._rs.entries())}

    @property
    def _heap(self):
        """The evictable keys as vLLM's heap entries ``(rank, key)``, in eviction order (a
        sorted list is a heap). kvbm's LRU keeps exactly one entry per idle key: it has no
        stale entries to compact."""
        entries = self._rs.entries()
        return [((i, 0), k) for i, (k, _slot, refs) in enumerate(entries) if refs == 0]


class _ArcView(_PolicyView, ARCCachePolicy):
    """kvbm's ARC in vLLM's policy shape (``manager._policy``): T1, T2 (key -> ``ChunkStatus``,
    in order), the ghost lists B1, B2, and ``target_t1_size``, which may be set (vLLM's tests
    set it) and reaches the Rust policy; hooks as ``_PolicyView``.

    T1 and T2 may be assigned a mapping equal to what they hold (the same keys in the same
    order, the same chunk ids and ref counts: vLLM's tests wrap them in counting dicts); the
    Rust lists are kept, so kvbm's scans never iterate the assigned object. Any other
    assignment is a ValueError: kvbm's lists live in Rust.
    """

    def __init__(self, rs, cache_capacity: int):  # noqa: D107 - no vLLM state is built
        self._attach(rs, cache_capacity)

    def _lists(self):
        st = self._rs.arc_state()
        t1, t2 = self._chunks(st[0]), self._chunks(st[1])
        self._refresh(t1, t2)
        return t1, t2, st

    @property
    def t1(self):
        return self._lists()[0]

    @t1.setter
    def t1(self, value) -> None:
        self._assign("t1", 0, value)

    @property
    def t2(self):
        return self._lists()[1]

    @t2.setter
    def t2(self, value) -> None:
        self._assign("t2", 1, value)

    def _assign(self, name: str, i: int, value) -> None:
        current = self._lists()[i]
        same = list(current) == list(value) and all(
            value[k].chunk_id == c.chunk_id and value[k].ref_cnt == c.ref_cnt
            for k, c in current.items()
        )
        if not same:
            raise ValueError(
                f"kvbm's ARC {name.upper()} lives in Rust: it may be assigned only what it "
                f"holds (pin chunks with prepare_load, reorder them with touch)"
            )

    @property
    def b1(self):
        return OrderedDict.fromkeys(self._rs.arc_state()[2])

    @property
    def b2(self):
        return OrderedDict.fromkeys(self._rs.arc_state()[3])

    @property
    def target_t1_size(self) -> float:
        return self._rs.arc_state()[4]

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self._rs.set_arc_target(float(value))

    def on_store_miss(self, keys, req_context) -> None:
        self._rs.policy_store_miss(keys)


def _stats(rs) -> OffloadingConnectorStats:
    return _stats_of(rs.stats())


#: kvbm-tiering joins the values of a metric with several labels with this character.
_LABEL_SEP = "\x1f"


def _labels(label) -> tuple:
    return tuple(label.split(_LABEL_SEP)) if label else ()


def _stats_of(triple) -> OffloadingConnectorStats:
    stats = OffloadingConnectorStats()
    gauges, counters, histograms = triple
    for name, label, value in gauges:
        stats.set_gauge(name, value, _labels(label))
    for name, label, values in histograms:
        # The observations cross as a list of floats, equal values one object (``core::F64s``).
        if not values:
            continue
        labels = _labels(label)
        # The first observation through the public call (it records the metric's type and
        # appends the value last), then that last element replaced by every value in one
        # slice assignment, with no copy of the list (metric_sections: vLLM's mutable view
        # for a manager filling its own payload).
        stats.observe_histogram(name, values[0], labels)
        stats.metric_sections()[1][name][labels][-1:] = values
    for name, label, value in counters:
        stats.increase_counter(name, value, _labels(label))
    return stats


class CPUOffloadingManager(OffloadingManager):
    """vLLM's ``CPUOffloadingManager`` contract over kvbm-tiering's CPU manager (Rust).

    Same arguments as vLLM 0.33's class. The slot table, the LRU / ARC policy, the
    store-threshold tracker, events and gauges live in Rust; ``counts`` is a read-only view of
    the tracker (``None`` below a threshold of 2, as vLLM's); ``_policy`` is a read-only view of
    the Rust policy in vLLM's shape (its lists and chunk states, read when accessed).
    """

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info=None,
    ):
        policy = _builtin_policy(cache_policy, cache_policy_module_path)
        rs = extension().CpuManager(
            num_chunks, policy, enable_events, store_threshold, max_tracker_size, _LOOKUP_RESULTS,
            installed().name,
        )
        self._bind(rs, num_chunks, policy, store_threshold, max_tracker_size, info)

    def _bind(self, rs, num_chunks, policy, store_threshold, max_tracker_size, info) -> None:
        """Attaches the Rust manager `rs` and the views and fast paths over it."""
        self._rs = rs
        self._num_chunks = num_chunks
        self.medium: Medium = Medium.CPU
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._config_info = info.as_config_info() if info is not None else {}
        self.counts = _TrackerView(self._rs) if store_threshold >= 2 else None
        view = _ArcView if policy == "arc" else _LruView
        self._policy_view = view(self._rs, num_chunks)
        _bind_direct(self, CPUOffloadingManager, _DIRECT)
        # touch and on_request_finished go straight to Rust too while the policy's hook of the
        # same name is not replaced (`_refresh_hooks`).
        self._fast = {"touch": self._rs.touch, "on_request_finished": self._rs.on_request_finished}
        self._hooked_store = False
        self._hooked_record = False
        self._hooked_finish = False
        self._policy_view._manager = self
        self._refresh_hooks()

    # --- hooks a caller may replace (vLLM's seams) ---

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in _MANAGER_HOOKS:
            self._refresh_hooks()

    def __delattr__(self, name):
        object.__delattr__(self, name)
        if name in _MANAGER_HOOKS:
            self._refresh_hooks()

    def _refresh_hooks(self) -> None:
        """Chooses, per call, the one-Rust-call path (nothing replaced) or the step-by-step
        path that calls the replaced hooks where vLLM's manager calls them. Run whenever a hook
        is set or deleted, so the calls themselves test one flag."""
        pol = self._policy_view
        d = self.__dict__
        record = _overridden(self, "_record_request_cache_access")
        d["_hooked_record"] = record
        d["_hooked_store"] = (
            record
            or _overridden(self, "_allocate_chunks")
            or any(_overridden(pol, n) for n in ("touch", "on_store_miss", "evict"))
        )
        d["_hooked_finish"] = _overridden(pol, "on_request_finished")
        for name, hooked in (
            ("touch", _overridden(pol, "touch")),
            ("on_request_finished", d["_hooked_finish"]),
        ):
            fast = d["_fast"][name]
            if hooked:
                if d.get(name) is fast:
                    del d[name]  # the method below, which goes through the policy
            elif name not in d:
                d[name] = fast

    def _allocate_chunks(self, keys: list[OffloadKey]) -> list[ChunkStatus]:
        """vLLM's chunk pool: one chunk per key, fresh ids first, then freed ones (LIFO)."""
        return [ChunkStatus(i) for i in self._rs.allocate_slots(len(keys))]

    def _record_request_cache_access(
        self, keys, req_context: ReqContext, inserted_keys=(), reused_keys=()
    ) -> None:
        """vLLM's record of a request's cache accesses (first-seen order, per group; which
        keys it inserted and which it reused), kept in Rust for ``on_request_finished``."""
        self._rs.record_access(keys, req_context, inserted_keys, reused_keys)

    @property
    def _num_evictable_cache_chunks(self) -> int:
        """Cached chunks with ``ref_cnt == 0`` (read-only)."""
        return self._rs.num_evictable

    def _prepare_store_hooked(self, keys, req_context: ReqContext) -> PrepareStoreOutput | None:
        """``prepare_store`` step by step (kvbm_tiering's ``phases``), calling the policy's and
        the manager's hooks (replaced or not) where vLLM's manager calls them."""
        rs = self._rs
        policy = self._policy_view
        keys = list(keys)
        keys_to_store, ready_existing, recorded, new_misses = rs.store_plan(keys, req_context)
        if new_misses:
            policy.on_store_miss(new_misses, req_context)
            rs.mark_store_misses(new_misses, req_context)
        self._record_request_cache_access(
            (k for k in recorded), req_context, reused_keys=ready_existing
        )
        if not keys_to_store:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        rs.record_allocation(len(keys_to_store))
        need = len(keys_to_store) - rs.num_free()
        to_evict: list[OffloadKey] = []
        if need > 0:
            if need > rs.num_evictable:
                return None
            evicted = policy.evict(need, set(keys))
            if evicted is None:
                return None
            to_evict = [k for k, _chunk in evicted]
            for k in to_evict:
                assert rs.chunk(k) is None, (
                    f"evict returned {k!r}, which is still cached: a replacement evict must "
                    f"evict through the policy it replaces"
                )
            rs.record_eviction_event(to_evict)
        chunks = self._allocate_chunks(keys_to_store)
        assert len(chunks) == len(keys_to_store), (
            "Chunk pool did not allocate the expected number of chunks"
        )
        chunk_ids = [c.chunk_id for c in chunks]
        rs.insert_allocated(keys_to_store, chunk_ids, req_context)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec(chunk_ids),
            evicted_keys=to_evict,
        )

    @property
    def _policy(self):
        """A read-only view of the Rust policy in vLLM's shape (vLLM's tests inspect it)."""
        return self._policy_view

    @property
    def stores_skipped_in_current_batch(self) -> int:
        return self._rs.stores_skipped

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._rs.lookup(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        if self._hooked_record:
            keys = list(keys)
            spec = CPULoadStoreSpec(_ids(self._rs.pin_for_load(keys, req_context), _I32))
            self._record_request_cache_access(keys, req_context, reused_keys=keys)
            return spec
        return CPULoadStoreSpec(_ids(self._rs.prepare_load(keys, req_context), _I32))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy_view.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.complete_load(keys, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._hooked_store:
            return self._prepare_store_hooked(keys, req_context)
        return _store_output(self._rs.prepare_store(keys, req_context))

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._rs.complete_store(keys, req_context, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=_POLICIES[self._rs.on_new_request(req_context)])

    def on_request_finished(self, req_context: ReqContext) -> None:
        if not self._hooked_finish:
            self._rs.on_request_finished(req_context)
            return
        try:
            accesses = self._rs.finish_request(req_context)
            if accesses is not None:
                key_groups, insertion_only_keys, reused_keys = accesses
                self._policy_view.on_request_finished(
                    key_groups, insertion_only_keys, reused_keys, req_context
                )
        finally:
            self._rs.forget(req_context)

    def reset_cache(self) -> None:
        self._rs.reset_cache()

    def has_pending_work(self) -> bool:
        if self._polled_tiers and self._contract.poll_backs_off:
            # 0.34: what a live poll thread finishes by itself does not keep the engine
            # stepping; without one, or with another tier a peer's lookup can promote from,
            # only a step makes progress.
            thread = self._tier_poll_thread
            if thread is None or not thread.is_alive() or len(self.secondary_tiers) > 1:
                return True
            return any(parked for *_, parked in self._rs.request_states())
        return self._rs.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        # A generator, as vLLM's: the batch is detached when iteration starts, so a caller that
        # stops early drops the rest rather than seeing it again.
        for keys, removed, removal_expected, metadata_only, ctx in self._rs.take_events():
            # vLLM 0.34: a stored event names the request that stored it (0.33's has no field).
            extra = {} if ctx is None else {"req_context": ctx}
            yield OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                removal_expected=removal_expected,
                metadata_only=metadata_only,
                **extra,
            )

    def config_info(self) -> Sequence[dict]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        return _stats(self._rs)


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """vLLM's ``CPUPrimaryTierOffloadingManager`` over kvbm's CPU manager: the slot table of
    vLLM's shared region (``mmap_region``), read and written by the secondary tiers.

    Once a ``TieringOffloadingManager`` is built over it, its state lives in that manager
    (one state, not a copy) and this object keeps answering from there.
    """

    def __init__(
        self,
        num_chunks: int,
        mmap_region,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info=None,
    ):
        policy = _builtin_policy(cache_policy, cache_policy_module_path)
        self._mmap_region = mmap_region
        self._kv_memoryview = mmap_region.create_kv_memoryview()
        strides = getattr(self._kv_memoryview, "strides", None)
        chunk_bytes = strides[0] if isinstance(strides, tuple) and strides else 0
        rs = extension().CpuManager.primary(
            num_chunks, chunk_bytes, policy, enable_events, _LOOKUP_RESULTS, installed().name
        )
        self._bind(rs, num_chunks, policy, 1, 64_000, info)
        # read/write: a secondary tier reading or writing the primary; load/store: the GPU.
        self.complete_read = self.complete_load
        self.prepare_write = self.prepare_store
        self.complete_write = self.complete_store

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        """Pins chunks for a primary-to-secondary copy (no request access is counted)."""
        return CPULoadStoreSpec(_ids(self._rs.prepare_read(keys, req_context), _I32))

    def get_kv_memoryview(self) -> memoryview:
        return self._kv_memoryview

    # -- vLLM 0.34: a failed promotion's deferred release --

    def defer_write_release(self, keys: Collection[OffloadKey]) -> list[int]:
        """Fails pending writes as ``complete_write(False)`` does but keeps their chunks out of
        the free pool until :meth:`release_deferred_write`; returns the held chunk ids. A key
        that is not a pending write is an ``AssertionError`` naming it, nothing changed."""
        return self._rs.defer_write_release(keys)

    def release_deferred_write(self, chunk_ids: Iterable[int]) -> None:
        """Returns held chunks to the free pool."""
        self._rs.release_deferred_write([int(c) for c in chunk_ids])

    @property
    def num_deferred_release_chunks(self) -> int:
        return self._rs.num_deferred_release_chunks

    @property
    def _num_write_pending_chunks(self) -> int:
        return self._rs.usage()[1]

    def _get_num_free_chunks(self) -> int:
        return self._rs.num_free()

    @property
    def _free_list(self) -> list[int]:
        return list(self._rs.slots()[0])

    @property
    def _num_allocated_chunks(self) -> int:
        return self._rs.slots()[1]

    def shutdown(self) -> None:
        super().shutdown()
        release = getattr(self._kv_memoryview, "release", None)
        if release is not None:
            release()
        self._mmap_region.cleanup()


@dataclass
class _RequestStateView:
    """A copy of one request's state in vLLM's ``RequestState`` shape (``_req_state``)."""

    req_context: ReqContext | None
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] | None = None
    pending_cascade_keys: list = field(default_factory=list)


@dataclass(frozen=True)
class _MetricsLabels:
    """vLLM's metric labels of a manager's tiers (``tier_label``, ``primary_tier_label``)."""

    labels: tuple

    def tier_label(self, tier_idx: int) -> tuple:
        return (self.labels[tier_idx + 1],)

    @property
    def primary_tier_label(self) -> tuple:
        return (self.labels[0],)


@dataclass
class _DeferredReleaseView:
    """One failed promotion's held chunks (vLLM 0.34 ``_DeferredRelease``), a copy."""

    tier_idx: int
    chunk_ids: list = field(default_factory=list)


@dataclass
class _PendingPromotionView:
    req_context: ReqContext
    keys: list = field(default_factory=list)
    chunk_ids: list = field(default_factory=list)


def _make_job(job_id, keys, chunk_ids, is_promotion, req_context) -> TransferJob:
    # ``chunk_ids``: a bytearray of ``int32``s (``bridge::job_chunk_ids``), so the array over
    # it is writable ``int32``, as vLLM's own job arrays are (a promotion's
    # ``np.array(..., dtype=np.int32)``, a cascade's ``CPULoadStoreSpec.block_ids``).
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=_ids(chunk_ids, _I32),
        is_promotion=is_promotion,
        req_context=req_context,
    )


def _make_request_context(policy: str) -> RequestOffloadingContext:
    return RequestOffloadingContext(policy=_POLICIES[policy])


def _native_tier(tier):
    """kvbm's own Rust tier inside a kvbm tier object, when kvbm's manager can drive it in
    Rust (a tier whose Python methods add nothing: disk, fleet, and object tiers not shared)."""
    from kvbm_vllm.tiers import KvbmDiskTier, KvbmFleetTier, KvbmObjectTier

    if type(tier) in (KvbmDiskTier, KvbmFleetTier) or (
        type(tier) is KvbmObjectTier and tier._probe is None
    ):
        # A method replaced on the instance (a test's monkeypatch) must be called: Python path.
        if not any(name in vars(tier) for name in _TIER_METHODS):
            return tier._rs
    return None


_TIER_METHODS = (
    "lookup", "submit_store", "submit_load", "get_finished_jobs", "drain_jobs", "touch",
    "on_new_request", "on_request_finished", "take_events", "has_pending_work", "shutdown",
)


class TieringOffloadingManager(OffloadingManager):
    """vLLM's ``TieringOffloadingManager`` over kvbm-tiering's (Rust).

    Same arguments as vLLM 0.33's. The job table, promotions, cascades, request state,
    back-pressure decisions and metrics live in Rust; Python tiers are called as vLLM calls
    them (by attribute, with vLLM's ``TransferJob`` objects and the caller's ``ReqContext``).
    ``lock`` is a ``threading.Lock``, and a tier that sets ``tolerates_off_thread_polling``
    is also served from a ``vllm_offload_tier_poll`` thread, as vLLM does. The private
    attributes vLLM's tests read (``_req_state``, ``_jobs``, ...) are read-only copies.
    """

    #: vLLM's behaviour, bugs included (kvbm's spec turns kvbm's fixes on).
    _UPSTREAM = True
    #: Drive kvbm's own tiers in Rust (kvbm's spec may turn it off).
    _NATIVE_TIERS = True

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager] | None = None,
        tier_poll_interval_s: float = _vllm_tiering.DEFAULT_TIER_POLL_INTERVAL_S,
    ):
        if not isinstance(primary_tier, CPUPrimaryTierOffloadingManager):
            raise TypeError(
                "kvbm's TieringOffloadingManager needs kvbm's CPUPrimaryTierOffloadingManager "
                f"(kvbm_vllm.upstream_compat) as its primary tier, got {type(primary_tier).__name__}"
            )
        self._contract = installed()
        self._lock = threading.Lock()
        self.primary_tier = primary_tier
        self.secondary_tiers = list(secondary_tiers or [])
        handed = []
        for tier in self.secondary_tiers:
            native = _native_tier(tier) if self._NATIVE_TIERS else None
            if native is not None and getattr(tier, "bp_detector", None) is not None:
                # Driven in Rust, asked and fed as vLLM asks and feeds the tier's detector.
                native = (native, tier.bp_detector)
            handed.append(native if native is not None else tier)
        self._rs = extension().TieringManager(
            primary_tier._rs, handed, self._UPSTREAM, True, _make_job, _make_request_context,
            (OffloadPolicy.CHUNK_LEVEL, OffloadPolicy.REQUEST_LEVEL),
        )
        self._python_tier = [self._rs.is_python_tier(i) for i in range(len(self.secondary_tiers))]
        self._tier_index = {id(t): i for i, t in enumerate(self.secondary_tiers)}
        _bind_direct(self, TieringOffloadingManager, _DIRECT)
        self._polled_tiers = [
            i for i, t in enumerate(self.secondary_tiers)
            if getattr(t, "tolerates_off_thread_polling", False)
        ]
        self._tier_poll_interval_s = tier_poll_interval_s
        self._tier_poll_stop = threading.Event()
        self._tier_poll_thread: threading.Thread | None = None
        self._start_tier_poll_thread()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- the tier-poll thread (vLLM 0.33's protocol; its module constants are read live) --

    def _start_tier_poll_thread(self) -> None:
        if not self._polled_tiers or self._tier_poll_interval_s <= 0:
            return
        self._tier_poll_thread = threading.Thread(
            target=self._tier_poll_loop, name="vllm_offload_tier_poll", daemon=True
        )
        self._tier_poll_thread.start()

    def _stop_tier_poll_thread(self) -> None:
        self._tier_poll_stop.set()
        thread = self._tier_poll_thread
        if thread is None:
            return
        thread.join(timeout=_vllm_tiering._TIER_POLL_JOIN_TIMEOUT_S)
        if thread.is_alive():
            _log.error("KV offload tier-poll thread did not exit within %.1fs",
                       _vllm_tiering._TIER_POLL_JOIN_TIMEOUT_S)
        else:
            self._tier_poll_thread = None

    def _tier_poll_loop(self) -> None:
        """vLLM's tier-poll loop, as the installed release runs it: a round under ``lock``
        every ``tier_poll_interval_s``; after sustained failure 0.33 stops (``on_schedule_end``
        still serves the tiers), 0.34 backs off to ``max(interval, 1 s)`` and keeps serving
        peers, logging one traceback per failure run and one-line summaries after. vLLM's
        module constants and ``logger`` are read live (its tests patch them)."""
        backs_off = self._contract.poll_backs_off
        stalled_since = None
        failing_since = None
        failures = 0
        last_error_log = 0.0
        backing_off = False
        if backs_off:
            backoff_s = max(self._tier_poll_interval_s, _vllm_tiering._TIER_POLL_BACKOFF_S)
        while not self._tier_poll_stop.is_set():
            if not self._lock.acquire(timeout=_vllm_tiering._TIER_POLL_LOCK_TIMEOUT_S):
                now = time.monotonic()
                if stalled_since is None:
                    stalled_since = now
                elif now - stalled_since > _vllm_tiering._TIER_POLL_STALL_WARN_S:
                    _vllm_tiering.logger.warning(
                        "KV offload tier-poll thread has not acquired the manager lock for "
                        "%.0fs", now - stalled_since)
                    stalled_since = None
                continue
            stalled_since = None
            try:
                self.poll_tiers()
                failing_since = None
                failures = 0
            except Exception:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                failures += 1
                if now - last_error_log >= _vllm_tiering._TIER_POLL_ERROR_LOG_INTERVAL_S:
                    last_error_log = now
                    if not backs_off or failures == 1:
                        _vllm_tiering.logger.exception("KV offload tier-poll round failed")
                    else:
                        _vllm_tiering.logger.warning(
                            "KV offload tier-poll thread has failed %d consecutive rounds "
                            "(%.0fs); still retrying so peers are served while the engine is "
                            "idle.", failures, now - failing_since)
            finally:
                self._lock.release()
            if not backs_off:
                if (failing_since is not None and time.monotonic() - failing_since
                        >= _vllm_tiering._TIER_POLL_GIVE_UP_AFTER_S):
                    _vllm_tiering.logger.error(
                        "KV offload tier-poll thread stopping after %.0fs of consecutive "
                        "failures; falling back to per-step servicing.",
                        _vllm_tiering._TIER_POLL_GIVE_UP_AFTER_S)
                    return
            elif (failing_since is not None and time.monotonic() - failing_since
                    >= _vllm_tiering._TIER_POLL_BACK_OFF_AFTER_S):
                if not backing_off:
                    _vllm_tiering.logger.error(
                        "KV offload tier-poll thread backing off to %.1fs after %.0fs of "
                        "consecutive failures; it keeps retrying so peers are still served "
                        "while the engine is idle.",
                        backoff_s, _vllm_tiering._TIER_POLL_BACK_OFF_AFTER_S)
                    backing_off = True
                self._tier_poll_stop.wait(backoff_s)
                continue
            backing_off = False
            self._tier_poll_stop.wait(self._tier_poll_interval_s)

    def poll_tiers(self) -> None:
        """One round for the tiers that opted in (the caller holds ``lock``)."""
        self._rs.poll_round(self._polled_tiers)

    # -- OffloadingManager --

    def lookup(self, key: OffloadKey, req_context: ReqContext, *, exclude_tier_idx=None):
        return self._rs.lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource(self._rs.get_load_source(key, req_context))

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        return CPULoadStoreSpec(_ids(self._rs.prepare_load(keys, req_context), _I32))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext):
        return _store_output(self._rs.prepare_store(keys, req_context))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self._rs.complete_store(keys, req_context, success)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext,
                         tier_idx: int = 0) -> TransferJob:
        return self._rs.create_store_job(keys, req_context, tier_idx)

    def on_new_request(self, req_context: ReqContext, *, exclude_tier_idx=None):
        return RequestOffloadingContext(
            policy=_POLICIES[self._rs.on_new_request(req_context, exclude_tier_idx)]
        )

    def on_request_finished(self, req_context: ReqContext, *, exclude_tier_idx=None) -> None:
        self._rs.on_request_finished(req_context, exclude_tier_idx)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._rs.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        if self._polled_tiers and self._contract.poll_backs_off:
            # 0.34: what a live poll thread finishes by itself does not keep the engine
            # stepping; without one, or with another tier a peer's lookup can promote from,
            # only a step makes progress.
            thread = self._tier_poll_thread
            if thread is None or not thread.is_alive() or len(self.secondary_tiers) > 1:
                return True
            return any(parked for *_, parked in self._rs.request_states())
        return self._rs.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        yield from self.primary_tier.take_events()
        for i, tier in enumerate(self.secondary_tiers):
            if self._python_tier[i]:
                yield from tier.take_events()
                continue
            for keys, removed, expected, meta, medium, locality, ctx in \
                    self._rs.take_tier_events(i):
                extra = ({"req_context": ctx}
                         if ctx is not None and self._contract.stored_event_context else {})
                yield OffloadingEvent(
                    keys=keys,
                    medium=Medium[medium],
                    removed=removed,
                    locality=getattr(tier, "locality", None)
                    or (Locality[locality] if locality else None),
                    ownership=tier.tier_type,
                    removal_expected=expected,
                    metadata_only=meta,
                    **extra,
                )

    def reset_cache(self) -> None:
        self._rs.reset_cache()

    def on_reset_flushed(self) -> None:
        self._rs.on_reset_flushed()

    def get_stats(self) -> OffloadingConnectorStats | None:
        triple = self._rs.stats()
        stats = _stats_of(triple) if triple is not None else None
        for i, tier in enumerate(self.secondary_tiers):
            if not self._python_tier[i]:
                continue
            tier_stats = tier.get_stats()
            if tier_stats is None or tier_stats.is_empty():
                continue
            if stats is None:
                stats = tier_stats
            else:
                stats.aggregate(tier_stats)
        return stats

    def config_info(self) -> Sequence[dict]:
        labels = self._rs.labels()
        (primary_info,) = self.primary_tier.config_info()
        info = dict(primary_info)
        info[TIER_LABEL] = labels[0]
        infos = [info]
        for i, tier in enumerate(self.secondary_tiers):
            tier_info = dict(tier.config_info())
            tier_info[TIER_LABEL] = labels[i + 1]
            infos.append(tier_info)
        return infos

    def shutdown(self) -> None:
        """Stops the poll thread, then every tier, then releases the primary region (kept
        when a tier failed to stop: it may still touch it). Call without holding ``lock``."""
        self._stop_tier_poll_thread()
        if self._tier_poll_thread is not None:
            if not self._lock.acquire(timeout=_vllm_tiering._TIER_POLL_JOIN_TIMEOUT_S):
                raise RuntimeError(
                    "KV offload tier-poll thread is still running and the manager lock is "
                    "unavailable; secondary tiers were not shut down. shutdown() must be "
                    "called without holding manager.lock."
                )
            try:
                self._shutdown_tiers()
            finally:
                self._lock.release()
            return
        self._shutdown_tiers()

    def _shutdown_tiers(self) -> None:
        self._rs.shutdown()
        self.primary_tier.shutdown()

    # -- read-only views of the state vLLM's tests inspect --

    @property
    def _req_state(self) -> dict:
        return {
            req_id: _RequestStateView(
                req_context=None,
                pending_primary_stores=pending,
                is_finished=finished,
                request_level_tiers=set(tiers) if tiers else None,
                pending_cascade_keys=list(parked),
            )
            for req_id, pending, finished, tiers, parked in self._rs.request_states()
        }

    @property
    def _jobs(self) -> dict:
        return {
            job_id: _vllm_tiering.JobMetadata(job, tier)
            for job_id, tier, job in self._rs.jobs()
        }

    @property
    def _transfer_jobs(self) -> dict:
        """vLLM's alias of ``_jobs`` (a copy here too)."""
        return self._jobs

    @property
    def _metrics(self) -> "_MetricsLabels":
        """The label half of vLLM's ``TieringMetricsTracker`` (its series live in Rust)."""
        return _MetricsLabels(tuple(self._rs.labels()))

    @property
    def _deferred_releases(self) -> dict:
        return {
            job_id: _DeferredReleaseView(tier, list(ids))
            for job_id, tier, ids in self._rs.deferred_releases()
        }

    @property
    def _pending_load_submissions(self) -> dict:
        out: dict = {}
        for tier, req_id, ctx, keys, ids in self._rs.pending_promotions():
            out.setdefault(tier, {})[req_id] = _PendingPromotionView(ctx, list(keys), list(ids))
        return out

    @property
    def _request_load_sources(self) -> dict:
        return {
            req_id: {k: CacheHitSource(s) for k, s in sources}
            for req_id, sources in self._rs.load_sources()
        }

    @property
    def _processed_jobs_this_step(self) -> bool:
        return self._rs.processed_this_step

    @_processed_jobs_this_step.setter
    def _processed_jobs_this_step(self, value: bool) -> None:
        self._rs.processed_this_step = bool(value)

    @property
    def _promotions_held(self) -> bool:
        return self._rs.promotions_held

    @_promotions_held.setter
    def _promotions_held(self, value: bool) -> None:
        self._rs.promotions_held = bool(value)

    def _process_finished_jobs(self, tiers=None) -> None:
        self._rs.process_finished_jobs()
