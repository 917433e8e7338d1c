"""kvbm's classes that stand where vLLM 0.33's own do, same names, same constructor arguments.

Each is a subclass of vLLM's ABC (so ``isinstance`` checks, subclassing and monkeypatching by
vLLM's callers keep working) whose calls go to kvbm's Rust managers (``kvbm_vllm._kvbm``). They
take vLLM's objects (``bytes`` keys from ``make_offload_key``, ``ReqContext``) and return vLLM's
objects: the ``LookupResult`` members themselves (callers compare with ``is``),
``PrepareStoreOutput`` with a ``CPULoadStoreSpec``, ``OffloadingEvent``, and the connector's
``OffloadingConnectorStats``.

Importing this module imports vLLM's offloading modules and the extension; import it only
where a manager is built (``kvbm_vllm`` itself stays cheap to import).

Built so far: ``CPUOffloadingManager``. ``CPUPrimaryTierOffloadingManager`` and
``TieringOffloadingManager`` are not yet kvbm's: they are not exported, and the upstream test
harness substitutes only what is (``--classes``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

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

from kvbm_vllm import extension

__all__ = ["CPUOffloadingManager"]

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


def _chunks(entries) -> OrderedDict:
    return OrderedDict((k, _chunk(slot, refs)) for k, slot, refs in entries)


class _LruView(LRUCachePolicy):
    """Read-only view of kvbm's LRU state in vLLM's policy shape (``manager._policy``).

    Every attribute is computed from the Rust manager when read; the ``ChunkStatus`` objects
    are copies, so writing to them changes nothing. vLLM's own methods are not kvbm's: calling
    or patching them does not reach the Rust manager.
    """

    def __init__(self, rs, cache_capacity: int):  # noqa: D107 - no vLLM state is built
        self._rs = rs
        self.cache_capacity = cache_capacity

    @property
    def chunks(self):
        return _chunks(self._rs.entries())

    def get(self, key):
        e = self._rs.chunk(key)
        return None if e is None else _chunk(e[1], e[2])


class _ArcView(ARCCachePolicy):
    """Read-only view of kvbm's ARC state in vLLM's policy shape (``manager._policy``): T1, T2
    (key -> ``ChunkStatus`` copies, in order), the ghost lists B1, B2, and ``target_t1_size``,
    which may be set (vLLM's tests set it) and reaches the Rust policy."""

    def __init__(self, rs, cache_capacity: int):  # noqa: D107 - no vLLM state is built
        self._rs = rs
        self.cache_capacity = cache_capacity

    def _state(self):
        return self._rs.arc_state()

    @property
    def t1(self):
        return _chunks(self._state()[0])

    @property
    def t2(self):
        return _chunks(self._state()[1])

    @property
    def b1(self):
        return OrderedDict.fromkeys(self._state()[2])

    @property
    def b2(self):
        return OrderedDict.fromkeys(self._state()[3])

    @property
    def target_t1_size(self) -> float:
        return self._state()[4]

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self._rs.set_arc_target(float(value))

    def get(self, key):
        e = self._rs.chunk(key)
        return None if e is None else _chunk(e[1], e[2])


def _stats(rs) -> OffloadingConnectorStats:
    stats = OffloadingConnectorStats()
    gauges, counters, histograms = rs.stats()
    for name, label, value in gauges:
        stats.set_gauge(name, value, (label,) if label else ())
    for name, label, values in histograms:
        for v in values:
            stats.observe_histogram(name, v, (label,) if label else ())
    for name, label, value in counters:
        stats.increase_counter(name, value, (label,) if label else ())
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
        self.medium: Medium = Medium.CPU
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._config_info = info.as_config_info() if info is not None else {}
        self._rs = extension().CpuManager(
            num_chunks, policy, enable_events, store_threshold, max_tracker_size, _LOOKUP_RESULTS
        )
        self.counts = _TrackerView(self._rs) if store_threshold >= 2 else None
        view = _ArcView if policy == "arc" else _LruView
        self._policy_view = view(self._rs, num_chunks)
        # The calls whose answer needs no wrapping go straight to Rust: an instance attribute
        # shadows the method below (a caller may still replace it, as vLLM's tests do), and a
        # per-chunk lookup then costs no Python frame.
        self.lookup = self._rs.lookup
        self.touch = self._rs.touch
        self.complete_load = self._rs.complete_load
        self.complete_store = self._rs.complete_store
        self.on_request_finished = self._rs.on_request_finished

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
        return CPULoadStoreSpec(self._rs.prepare_load(keys, req_context))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.complete_load(keys, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self._rs.prepare_store(keys, req_context)
        if out is None:
            return None
        keys_to_store, chunk_ids, evicted = out
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec(chunk_ids),
            evicted_keys=evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._rs.complete_store(keys, req_context, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=_POLICIES[self._rs.on_new_request(req_context)])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._rs.on_request_finished(req_context)

    def reset_cache(self) -> None:
        self._rs.reset_cache()

    def has_pending_work(self) -> bool:
        return self._rs.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        # A generator, as vLLM's: the batch is detached when iteration starts, so a caller that
        # stops early drops the rest rather than seeing it again.
        for keys, removed, removal_expected, metadata_only in self._rs.take_events():
            yield OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                removal_expected=removal_expected,
                metadata_only=metadata_only,
            )

    def config_info(self) -> Sequence[dict]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        return _stats(self._rs)
