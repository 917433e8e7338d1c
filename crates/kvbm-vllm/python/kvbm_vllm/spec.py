"""``KvbmOffloadingSpec``: the whole scheduler-side manager from kvbm, as one vLLM spec.

vLLM's ``TieringOffloadingSpec`` builds a shared region, a CPU primary over it, secondary tiers
and its Python ``TieringOffloadingManager``. ``KvbmOffloadingSpec`` is that spec with kvbm's
managers in place of vLLM's: the same region (vLLM's workers still copy GPU <-> region with
vLLM's own ``CPUOffloadingWorker``), kvbm's ``CPUPrimaryTierOffloadingManager`` and
``TieringOffloadingManager`` (kvbm-tiering, Rust), kvbm's tiers driven in Rust and any
Python tier (vLLM's own or a user's) driven through the same contract.

Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "KvbmOffloadingSpec", "spec_module_path": "kvbm_vllm.spec",
        "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "kvbm_disk", "path": "/nvme/kvbm/g3.bin",
                             "capacity": 65536}]}}'

(or ``"spec_name": "KvbmOffloadingSpec"`` alone once the ``kvbm`` plugin is registered).

Every key vLLM's ``TieringOffloadingSpec`` takes is taken here and means the same. kvbm's own
keys start with ``kvbm_`` (an unknown one is an error naming it):

``kvbm_upstream_bugs`` (default false)   behave as vLLM 0.33 exactly, bugs included; by
    default kvbm fixes four: a failed promotion is not retried forever (vLLM #49176), a
    promotion that never finishes is cancelled after 60 s (#49829), at most 4096 chunks are
    promoted per step (#49902), ``reset_cache`` survives a tier that lost a job (#48102).
``kvbm_native_tiers`` (default true)     drive kvbm's own tiers (``kvbm_disk``, an unshared
    ``kvbm_object``) in Rust, without a Python call per chunk.

Importing this module is cheap (vLLM's metrics front end imports spec classes); vLLM's
spec and kvbm's extension load when the class is first used.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvbm_vllm.contract import SUPPORTED, installed
from kvbm_vllm.log import logger

__all__ = ["KvbmOffloadingSpec", "KVBM_KEYS", "SUPPORTED_VLLM", "check_vllm_version"]

#: The vLLM release lines whose offloading contract kvbm's managers follow (``contract``).
SUPPORTED_VLLM = SUPPORTED


def check_vllm_version() -> str | None:
    """The running vLLM's version; :class:`~kvbm_vllm.contract.UnsupportedVllm` (a
    RuntimeError) naming it and the supported versions when kvbm does not follow its release
    line. ``None`` when vLLM carries no version (a source tree without its package metadata,
    as vLLM's own tests run from): the contract is then read from vLLM's API, and logged."""
    contract = installed()
    if contract.version is None:
        logger.info(
            "vLLM's version is unknown (no vllm.__version__ or package metadata); its "
            "modules implement the %s offloading contract, which kvbm follows", contract.name)
    return contract.version


#: kvbm's own keys in ``kv_connector_extra_config``, with their defaults.
KVBM_KEYS: dict[str, Any] = {
    "kvbm_upstream_bugs": False,
    "kvbm_native_tiers": True,
}


def kvbm_settings(extra_config: dict[str, Any]) -> dict[str, Any]:
    """kvbm's keys of ``extra_config`` over their defaults; an unknown ``kvbm_*`` key or a
    value of the wrong type is a ValueError naming it."""
    settings = dict(KVBM_KEYS)
    for k, v in extra_config.items():
        if not k.startswith("kvbm_"):
            continue
        if k not in KVBM_KEYS:
            raise ValueError(
                f"kv_connector_extra_config: unknown kvbm key {k!r} "
                f"(kvbm's keys: {', '.join(sorted(KVBM_KEYS))})"
            )
        if not isinstance(v, bool):
            raise ValueError(f"kv_connector_extra_config: {k} must be true or false, got {v!r}")
        settings[k] = v
    return settings


class KvbmOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` whose ``get_manager()`` is kvbm's (module docs)."""

    def __init__(self, config):
        check_vllm_version()
        super().__init__(config)
        self.kvbm_settings = kvbm_settings(self.extra_config)

    def get_manager(self):
        if self._manager:
            return self._manager
        # Imported here: they import vLLM's managers and kvbm's extension.
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        from kvbm_vllm import upstream_compat

        if int(self.extra_config.get("store_threshold", 0)) >= 2:
            raise ValueError("store_threshold is not supported for a tiering spec")

        upstream = self.kvbm_settings["kvbm_upstream_bugs"]
        native = self.kvbm_settings["kvbm_native_tiers"]

        class _Manager(upstream_compat.TieringOffloadingManager):
            _UPSTREAM = upstream
            _NATIVE_TIERS = native

        region = None
        primary = None
        tiers: list = []
        try:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=None,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._scheduler_mmap = region
            primary = upstream_compat.CPUPrimaryTierOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                mmap_region=region,
                info=self.cpu_info,
            )
            view = primary.get_kv_memoryview()
            for tier_config in self.secondary_tier_configs:
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            self._manager = _Manager(
                primary_tier=primary,
                secondary_tiers=tiers,
                tier_poll_interval_s=self.tier_poll_interval_s,
            )
        except Exception:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            if primary is not None:
                try:
                    primary.shutdown()
                except Exception:  # noqa: BLE001
                    pass
            elif region is not None:
                region.cleanup()
            self._scheduler_mmap = None
            raise
        return self._manager
