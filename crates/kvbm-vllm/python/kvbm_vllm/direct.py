"""``KvbmDiskDirectSpec``: vLLM 0.34's direct file path with kvbm's disk, no CPU tier between.

vLLM 0.34 lets a spec move KV pages between the engine's KV cache and files directly: its
connector hands the spec's worker ``DevicePointers`` (every page's address and size) and the
manager's spec says where the chunks go (vLLM's ``FSOffloadingWorker`` is that path's base).
``KvbmDiskDirectSpec`` is that path over one kvbm G3 file, with the disk's guarantees:

- bounded: ``kvbm_capacity`` chunk slots; the policy's victim (``eviction_policy``, lru or arc)
  gives way for a new chunk;
- journaled: a slot is unlisted before it is rewritten and listed after its write completed,
  so ``kill -9`` loses no listed chunk and never lists a torn one;
- checksummed: every slot carries a header binding the key and the checksum of its bytes; a
  read whose key or bytes do not match fails its load (vLLM recomputes) and the chunk is
  forgotten, never served;
- warm across restarts, and bound to the model (the same fingerprint as ``kvbm_disk``: a file
  written for another model, dtype, layout or chunk size starts cold).

Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "KvbmDiskDirectSpec", "spec_module_path": "kvbm_vllm.direct",
        "kvbm_path": "/nvme/kvbm/direct.bin", "kvbm_capacity": 65536}}'

(or ``"spec_name": "KvbmDiskDirectSpec"`` alone once the ``kvbm`` plugin is registered).

Keys (kvbm's start with ``kvbm_``; an unknown ``kvbm_*`` key is an error naming it):

``kvbm_path`` (required)      the file (its directory is created; ``{dp_rank}``, ``{dp_size}``,
                              ``{engine_id}`` filled per engine core, as for ``kvbm_disk``)
``kvbm_capacity`` (required)  chunk slots, each one worker's pages of ``blocks_per_chunk`` blocks
``kvbm_direct_io``            O_DIRECT, default true (false for tmpfs)
``kvbm_queue_depth``          io_uring submission depth, default 64
``kvbm_buffer_pool_mb``       aligned I/O buffers kept idle, default 64
``eviction_policy``           vLLM's key: ``lru`` (default) or ``arc``

Where it runs: the manager and the worker share the file (its lock, its journal) in one
process, which is where vLLM runs its worker with one GPU (the ``uni`` executor); with several
workers (tensor or pipeline parallelism) the spec refuses to start. The worker reads and writes
the KV cache through host addresses: vLLM's CPU backend, or host memory standing in for the
device in tests. A KV cache in device memory is refused at ``get_worker`` (kvbm's own GPU path
is not built yet); on a GPU use ``KvbmOffloadingSpec``, whose chunks reach the disk through
vLLM's CPU region.

Under vLLM 0.33 (which has no direct path) the spec is refused, naming the version.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbm_vllm import extension
from kvbm_vllm.contract import UnsupportedVllm, installed
from kvbm_vllm.log import child
from kvbm_vllm.tiers import _flag, _fingerprint, _replica_path

__all__ = ["KvbmDiskDirectSpec", "KvbmDiskLoadStoreSpec", "DIRECT_KEYS"]

_log = child("direct")

_LOOKUP_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
_POLICIES = {"chunk_level": OffloadPolicy.CHUNK_LEVEL, "request_level": OffloadPolicy.REQUEST_LEVEL}
_WHO = "KvbmDiskDirectSpec"

#: The spec's own keys with their defaults (``None``: required).
DIRECT_KEYS: dict[str, Any] = {
    "kvbm_path": None,
    "kvbm_capacity": None,
    "kvbm_direct_io": True,
    "kvbm_queue_depth": 64,
    "kvbm_buffer_pool_mb": 64,
}


def _settings(extra: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(k for k in extra if k.startswith("kvbm_") and k not in DIRECT_KEYS)
    if unknown:
        raise ValueError(f"{_WHO}: unknown key(s) {', '.join(map(repr, unknown))}; it takes "
                         f"{', '.join(DIRECT_KEYS)} and eviction_policy")
    s = {k: extra.get(k, d) for k, d in DIRECT_KEYS.items()}
    missing = [k for k, v in s.items() if v is None]
    if missing:
        raise ValueError(f"{_WHO}: missing required key(s) {', '.join(missing)}")
    for k in ("kvbm_capacity", "kvbm_queue_depth", "kvbm_buffer_pool_mb"):
        v = s[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if k != "kvbm_buffer_pool_mb" else 0):
            raise ValueError(f"{_WHO}: {k} must be an integer >= "
                             f"{1 if k != 'kvbm_buffer_pool_mb' else 0}, got {v!r}")
    if not isinstance(s["kvbm_path"], str) or not s["kvbm_path"]:
        raise ValueError(f"{_WHO}: kvbm_path must be a file path, got {s['kvbm_path']!r}")
    return s


class KvbmDiskLoadStoreSpec(LoadStoreSpec):
    """Where a job's chunks live: ``keys[i]`` in disk slot ``slots[i]``."""

    def __init__(self, keys: list[OffloadKey], slots: list[int]):
        self.keys = keys
        self.slots = slots

    def __repr__(self) -> str:
        return f"KvbmDiskLoadStoreSpec(slots={self.slots})"


class KvbmDiskDirectManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over the direct disk's slots (kvbm-tiering, Rust)."""

    def __init__(self, rs, events: bool):
        self._rs = rs
        self._events = events

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._rs.lookup(key, req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        return KvbmDiskLoadStoreSpec(keys, self._rs.prepare_load(keys, req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self._rs.complete_load(list(keys), req_context)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        out = self._rs.prepare_store(list(keys), req_context)
        if out is None:
            return None
        to_store, slots, evicted = out
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=KvbmDiskLoadStoreSpec(to_store, slots),
                                  evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True):
        self._rs.complete_store(list(keys), req_context, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=_POLICIES[self._rs.on_new_request(req_context)])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._rs.on_request_finished(req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return
        for keys, removed, removal_expected, metadata_only, ctx in self._rs.take_events():
            yield OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=removed,
                                  locality=Locality.LOCAL, removal_expected=removal_expected,
                                  metadata_only=metadata_only, req_context=ctx)

    def has_pending_work(self) -> bool:
        return self._rs.has_pending_work()

    def reset_cache(self) -> None:
        self._rs.reset_cache()

    def shutdown(self) -> None:
        self._rs.shutdown()


class KvbmDiskDirectWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` moving pages between the KV cache and the direct disk.

    A submission kvbm refuses (pointers that disagree with the spec, a page outside the KV
    cache) is logged as an error and reported as a failed job by the next ``get_finished``:
    a store is dropped, a load recomputed, and the engine goes on."""

    def __init__(self, rs):
        self._rs = rs
        self._refused: list[int] = []

    def _submit(self, what: str, job_id: int, call) -> bool:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            _log.error("kvbm direct disk: %s of job %d refused: %s", what, job_id, e)
            self._refused.append(job_id)
        return True

    def submit_store(self, job_id: int, device_ptrs, dst_spec: LoadStoreSpec) -> bool:
        if not isinstance(dst_spec, KvbmDiskLoadStoreSpec):
            raise TypeError(f"{_WHO}: a store to {type(dst_spec).__name__}, not kvbm's disk")
        return self._submit("store", job_id, lambda: self._rs.submit_store(
            job_id, device_ptrs.ptrs.tolist(), device_ptrs.sizes.tolist(),
            list(device_ptrs.group_block_counts), list(device_ptrs.group_data_ref_counts),
            list(device_ptrs.block_indices), dst_spec.keys, dst_spec.slots))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, device_ptrs,
                    expedited: bool = False) -> bool:
        if not isinstance(src_spec, KvbmDiskLoadStoreSpec):
            raise TypeError(f"{_WHO}: a load from {type(src_spec).__name__}, not kvbm's disk")
        return self._submit("load", job_id, lambda: self._rs.submit_load(
            job_id, src_spec.keys, src_spec.slots, device_ptrs.ptrs.tolist(),
            device_ptrs.sizes.tolist(), list(device_ptrs.group_block_counts),
            list(device_ptrs.group_data_ref_counts), list(device_ptrs.block_indices),
            expedited))

    def get_finished(self) -> list[TransferResult]:
        out = [TransferResult(job_id=j, success=False) for j in self._refused]
        self._refused.clear()
        for job_id, success, size, seconds in self._rs.get_finished():
            out.append(TransferResult(job_id=job_id, success=success, transfer_size=size,
                                      transfer_time=seconds))
        return out

    def wait(self, job_ids: set[int]) -> None:
        self._rs.wait(sorted(job_ids))

    def shutdown(self) -> None:
        self._rs.shutdown()


def _host_extent(tensor) -> tuple[int, int]:
    """``(address, bytes)`` a block tensor's rows span: rows ``stride(0)`` apart, each
    ``shape[1]`` elements (vLLM's canonical ``(num_blocks, page_bytes)`` int8 views)."""
    shape = tuple(tensor.shape)
    esize = int(tensor.element_size()) if hasattr(tensor, "element_size") else 1
    rows, row = shape[0], (shape[1] if len(shape) > 1 else 1) * esize
    return int(tensor.data_ptr()), max(0, (rows - 1) * int(tensor.stride(0)) * esize + row)


class KvbmDiskDirectSpec(OffloadingSpec):
    """vLLM 0.34's direct file path over one kvbm disk (module docs)."""

    def __init__(self, config):
        contract = installed()
        if contract.line < (0, 34):
            raise UnsupportedVllm(
                f"{_WHO} is vLLM 0.34's direct file path (DevicePointers into the spec's "
                f"worker); vLLM {contract.version or contract.name} has none: use "
                f"KvbmOffloadingSpec with a kvbm_disk tier")
        super().__init__(config)
        self._contract = contract
        s = _settings(dict(self.extra_config))
        self._direct_io = _flag(_WHO, s, "kvbm_direct_io")
        p = config.parallel
        if p.world_size > 1:
            raise ValueError(
                f"{_WHO}: vLLM runs {p.world_size} workers (TP {p.tp_size}, PP {p.pp_size}); the "
                f"direct path keeps one file and journal in the scheduler's process, shared with "
                f"its one worker. Use KvbmOffloadingSpec with a kvbm_disk tier")
        self._chunk_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk)
        if self._chunk_bytes <= 0:
            raise ValueError(f"{_WHO}: vLLM reports {config.worker_kv_bytes_per_block} KV bytes "
                             f"per block: nothing to store")
        policy = str(self.extra_config.get("eviction_policy", "lru"))
        if policy not in ("lru", "arc"):
            raise ValueError(f"{_WHO}: eviction_policy must be lru or arc, got {policy!r}")
        self._policy = policy
        self._fingerprint = _fingerprint(_WHO, self)
        self._path = _replica_path(_WHO, s["kvbm_path"], self)
        self._s = s
        self._manager = None

    def _disk_args(self) -> tuple:
        s = self._s
        return (self._path, s["kvbm_capacity"], self._chunk_bytes, self._fingerprint,
                s["kvbm_queue_depth"], self._direct_io, s["kvbm_buffer_pool_mb"] << 20)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            events = bool(self.kv_events_config.enable_kv_cache_events)
            rs = extension().DirectManager(self._disk_args(), self._policy, events,
                                           _LOOKUP_RESULTS, self._contract.name)
            restored, reset, direct, engine = rs.opened()
            _log.info(
                "kvbm direct disk (vLLM 0.34 direct path): file %s, %d chunk slots of %d bytes, "
                "%d chunks warm from its journal%s, O_DIRECT %s, %s, policy %s, KV events %s",
                self._path, self._s["kvbm_capacity"], self._chunk_bytes, restored,
                f" (started cold: {reset})" if reset else "", "on" if direct else "off",
                engine, self._policy, "on" if events else "off")
            if self._direct_io and not direct:
                _log.warning("kvbm direct disk %s: O_DIRECT refused by the file system; "
                             "buffered I/O", self._path)
            self._manager = KvbmDiskDirectManager(rs, events)
        return self._manager

    def get_worker(self, kv_caches):
        memory = []
        for t in kv_caches.tensors:
            tensor = t.tensor
            device = getattr(getattr(tensor, "device", None), "type", "cpu")
            if device != "cpu":
                raise RuntimeError(
                    f"{_WHO}: vLLM's KV cache is in {device} memory; kvbm's direct path moves "
                    f"host memory (vLLM's CPU backend). On a GPU use KvbmOffloadingSpec: vLLM "
                    f"copies device pages to its CPU region and kvbm's tiers take them from "
                    f"there")
            memory.append(_host_extent(tensor))
        rs = extension().DirectWorker(self._disk_args(), int(self.blocks_per_chunk), memory)
        return KvbmDiskDirectWorker(rs)
