"""kvbm's secondary tiers for vLLM 0.33's own tiering manager (``TieringOffloadingSpec``).

``KvbmDiskTier`` (tier type ``kvbm_disk``) keeps chunks in one O_DIRECT file kvbm owns:
bounded (``capacity`` chunk slots; the oldest ready chunk is evicted for a new one), every slot
written with a header binding the key and a checksum of its bytes, so a damaged or foreign slot
is a failed load (the manager recomputes), never wrong bytes. Bytes move between vLLM's primary
region and the file in Rust, without a copy through Python.

Use it from ``--kv-transfer-config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", ...,
        "secondary_tiers": [{"type": "kvbm_disk",
                             "module_path": "kvbm_vllm.tiers",
                             "path": "/nvme/kvbm/g3.bin", "capacity": 65536}]}}

Keys of a ``kvbm_disk`` tier (anything else is an error naming the key):

``path`` (required)        the tier's file (its directory is created)
``capacity`` (required)    chunk slots in the file (each ``primary_kv_view.strides[0]`` bytes)
``queue_depth``            io_uring submission depth, default 64
``direct_io``              O_DIRECT, default true (false for file systems without it, e.g. tmpfs)
``locality``               vLLM's key; only ``"local"`` fits a local file

Not built yet: warm restart from the tier's journal (a restarted tier starts empty), events,
and the ``kvbm_object`` (S3) tier.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbm_vllm import extension

__all__ = ["KvbmDiskTier", "DISK_KEYS"]

_LOOKUP_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
_POLICIES = {"chunk_level": OffloadPolicy.CHUNK_LEVEL, "request_level": OffloadPolicy.REQUEST_LEVEL}

#: The keys a ``kvbm_disk`` tier takes, with their defaults (``None``: required).
DISK_KEYS: dict[str, Any] = {
    "path": None,
    "capacity": None,
    "queue_depth": 64,
    "direct_io": True,
    "locality": "local",
}


def _settings(tier_type: str, given: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(keys))
    if unknown:
        raise ValueError(
            f"secondary tier {tier_type!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"a kvbm_disk tier takes {', '.join(keys)}"
        )
    out = {**keys, **given}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise ValueError(
            f"secondary tier {tier_type!r}: missing required key(s) {', '.join(missing)}"
        )
    return out


class KvbmDiskTier(SecondaryTierManager):
    """A bounded, verified disk tier (kvbm's G3) under vLLM's tiering manager (see the module
    docs for its keys and guarantees)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.DISK

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str = "kvbm_disk",
        backpressure_detector=None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        s = _settings(tier_type, config, DISK_KEYS)
        locality = Locality(str(s["locality"]).upper())
        if locality is not Locality.LOCAL:
            raise ValueError(
                f"secondary tier {tier_type!r}: locality {s['locality']!r}, but a kvbm_disk "
                f"file is local"
            )
        self.locality = locality
        capacity = int(s["capacity"])
        if capacity <= 0:
            raise ValueError(f"secondary tier {tier_type!r}: capacity must be > 0, got {capacity}")
        # The region as flat unsigned bytes (vLLM's view may be 2-D, of any one-byte format).
        region = primary_kv_view.cast("B") if primary_kv_view.format != "B" or primary_kv_view.ndim != 1 else primary_kv_view
        self._rs = extension().DiskTier(
            region,
            self.block_size_bytes,
            str(s["path"]),
            capacity,
            int(s["queue_depth"]),
            bool(s["direct_io"]),
            _LOOKUP_RESULTS,
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._rs.lookup(key, req_context)

    def submit_store(self, job_metadata: TransferJob) -> None:
        j = job_metadata
        self._rs.submit(j.job_id, j.keys, [int(c) for c in j.chunk_ids], False, j.req_context)

    def submit_load(self, job_metadata: TransferJob) -> None:
        j = job_metadata
        self._rs.submit(j.job_id, j.keys, [int(c) for c in j.chunk_ids], True, j.req_context)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [
            JobResult(
                job_id=job_id,
                success=success,
                successful_keys=keys,
                transfer_time=seconds,
                transfer_bytes=nbytes,
            )
            for job_id, success, keys, seconds, nbytes in self._rs.get_finished_jobs()
        ]

    def drain_jobs(self) -> None:
        self._rs.drain_jobs()

    def has_pending_work(self) -> bool:
        return self._rs.has_pending_work()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=_POLICIES[self._rs.on_new_request(req_context)])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._rs.on_request_finished(req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rs.touch(keys, req_context)

    def shutdown(self) -> None:
        self._rs.shutdown()
