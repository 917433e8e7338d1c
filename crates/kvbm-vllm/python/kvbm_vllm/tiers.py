"""kvbm's secondary tiers for vLLM's own tiering manager (``TieringOffloadingSpec``), 0.34 or 0.33.

``KvbmDiskTier`` (tier type ``kvbm_disk``) keeps chunks in one O_DIRECT file kvbm owns:
bounded (``capacity`` chunk slots; the oldest ready chunk is evicted for a new one), persistent
(a journal beside the file; a restarted tier is warm), every slot
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

``path`` (required)        the tier's file (its directory is created); ``{dp_rank}``,
                           ``{dp_size}`` and ``{engine_id}`` are filled per engine core, and
                           with vLLM's data parallelism one of the first and last is required
``capacity`` (required)    chunk slots in the file (each ``primary_kv_view.strides[0]`` bytes)
``queue_depth``            io_uring submission depth, default 64
``direct_io``              O_DIRECT, default true (false for file systems without it, e.g. tmpfs)
``buffer_pool_mb``         aligned I/O buffers kept idle between jobs, default 64 (0: none kept)
``io_nice``                how much nicer than vLLM's scheduler the tier's I/O threads run
                           (0..19), default 10: when cores are short the scheduler's step goes
                           first and the writes take the idle moments (0: same priority)
``locality``               vLLM's key; only ``"local"`` fits a local file

``KvbmObjectTier`` (tier type ``kvbm_object``) keeps each chunk as one object named by its key's
hash under ``namespace``, in an S3 bucket or a local directory, with the same header and
checksum: a damaged or foreign object is a failed load. Its keys: ``bucket`` (S3) or ``dir`` (a
directory), ``endpoint``, ``region`` (default us-east-1), ``access_key_env`` /
``secret_key_env`` (the environment variables holding the credentials; defaults
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``: secrets never sit in vLLM's configuration),
``namespace`` (default ``kvbm``), ``capacity`` (keys remembered, default 65536), ``locality``
(default ``"remote"``), ``io_nice`` (as for the disk; tiers over one primary share their I/O
threads and must agree on it).

The disk tier is persistent: its journal (``<path>`` with extension ``journal``) lists every
chunk whose write completed, and a tier opened on the same file starts warm with them (each
read still checked against the key's identity and checksum). ``kill -9`` safe: a slot is
unlisted before it is rewritten.

With ``shared: true`` an object tier also finds chunks other instances wrote under the same
``namespace`` (a probe of the store off the scheduler thread; see ``KvbmObjectTier``).

Both tiers are bound to the model: their chunks carry the fingerprint of vLLM's
``OffloadingConfig`` (model name, KV dtype, KV cache layout, chunk size, ``tokens_per_hash``,
``blocks_per_chunk``, the KV groups, and the TP/PP/PCP/DCP shape unless vLLM says the bytes are
parallelism-agnostic or replicated). A disk file written under another fingerprint starts cold;
object tiers keep each fingerprint's objects under ``<namespace>/fp-<hex>/``, so engines serving
other models (or another layout) can share one bucket and never read each other's chunks.

With ``enable_kv_events: true`` (and KV cache events on in vLLM's ``kv_events_config``) a tier
reports its contents as vLLM's ``OffloadingEvent``s (``ownership`` its tier type, medium
``STORAGE``): stored when a chunk's write completed, removed when a chunk was evicted for room
or its copy was dropped because a read proved it bad.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    OffloadingEvent,
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbm_vllm import extension
from kvbm_vllm.contract import installed
from kvbm_vllm.log import child

__all__ = ["KvbmDiskTier", "KvbmObjectTier", "KvbmFleetTier", "DISK_KEYS", "OBJECT_KEYS",
           "FLEET_KEYS", "standalone_spec"]

_LOOKUP_RESULTS = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY)
_POLICIES = {"chunk_level": OffloadPolicy.CHUNK_LEVEL, "request_level": OffloadPolicy.REQUEST_LEVEL}

#: The keys a ``kvbm_disk`` tier takes, with their defaults (``None``: required).
DISK_KEYS: dict[str, Any] = {
    "path": None,
    "capacity": None,
    "queue_depth": 64,
    "direct_io": True,
    "buffer_pool_mb": 64,
    "io_nice": 10,
    "locality": "local",
    "enable_kv_events": False,
}


def _settings(who: str, given: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(keys))
    if unknown:
        raise ValueError(
            f"{who}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(keys)}"
        )
    out = {**keys, **given}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise ValueError(
            f"{who}: missing required key(s) {', '.join(missing)}"
        )
    return out


#: The placeholders a ``kvbm_disk`` path may hold, filled per engine core (data parallelism).
PATH_PLACEHOLDERS = ("dp_rank", "dp_size", "engine_id")


def _replica_path(who: str, path: str, spec, key: str = "path",
                  what: str = "kvbm_disk file") -> str:
    """``path`` with ``{dp_rank}`` (vLLM's data-parallel replica index), ``{dp_size}`` and
    ``{engine_id}`` filled in. Every data-parallel engine core gets the same configuration, so
    with more than one replica the path must name the replica (one file per engine core: two
    cores on one file would corrupt each other's slots, which the file's lock refuses); a
    placeholder other than these is an error naming it."""
    config = spec.config
    p = config.parallel
    values = {"dp_rank": p.data_parallel_index, "dp_size": p.data_parallel_size,
              "engine_id": config.engine_id}
    try:
        filled = path.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"{who}: {key} {path!r} has a placeholder kvbm does not fill "
            f"({e}); it fills {', '.join('{' + k + '}' for k in PATH_PLACEHOLDERS)}"
        ) from None
    if p.data_parallel_size > 1 and "{dp_rank}" not in path and "{engine_id}" not in path:
        raise ValueError(
            f"{who}: vLLM runs {p.data_parallel_size} data-parallel "
            f"engine cores with this configuration, and each needs its own {what}: put "
            f"{{dp_rank}} (or {{engine_id}}) in {key}, e.g. {path + '.dp{dp_rank}'!r}"
        )
    return filled


def _flag(who: str, s: dict[str, Any], key: str) -> bool:
    """A boolean key, strictly: JSON's true/false, or the strings "true"/"false" (any case).
    Anything else (``"no"``, ``1``, ``"0"``) is a ValueError naming the key: ``bool("false")``
    is True, and a tier must never take a "false" for on."""
    v = s[key]
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    raise ValueError(
        f"{who}: {key} must be true or false, got {v!r}"
    )


def _io_nice(who: str, s: dict[str, Any]) -> int:
    """The ``io_nice`` key: an integer in 0..19 (Linux's niceness range)."""
    v = s["io_nice"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 19:
        raise ValueError(
            f"{who}: io_nice must be an integer in 0..19, got {v!r}"
        )
    return v


def _events_on(who: str, spec, asked: bool) -> bool:
    """vLLM's rule: a tier emits KV events when its ``enable_kv_events`` is set and KV cache
    events are on globally (``kv_events_config``); set but off globally is a warning."""
    if not asked:
        return False
    config = getattr(spec, "kv_events_config", None)
    if config is not None and not getattr(config, "enable_kv_cache_events", False):
        _log.warning("enable_kv_events is set on %s but KV cache events are "
                     "disabled (kv_events_config): no events", who)
        return False
    return True


def _fingerprint(who: str, spec) -> dict[str, Any]:
    """What the tier's chunks mean, from vLLM's ``OffloadingConfig`` (``spec.config``), for
    kvbm's model fingerprint (see the module docs). A tier without vLLM's config cannot tell
    which model its bytes belong to, so it refuses to start."""
    config = getattr(spec, "config", None)
    if not isinstance(config, OffloadingConfig):
        raise ValueError(
            f"{who}: offloading_spec.config must be vLLM's OffloadingConfig "
            f"(kvbm binds every stored chunk to the model, dtype and layout it describes), got "
            f"{type(config).__name__}"
        )
    p = config.parallel
    if p.is_parallelism_agnostic or config.replicated_layout:
        parallelism: tuple = ("canonical",)
    else:
        parallelism = ("engine", p.tp_size, p.pp_size, p.pcp_size, p.dcp_size)
    parts = {
        "engine": "vllm",
        "tokens_per_hash": str(config.cache.tokens_per_hash),
        "blocks_per_chunk": str(config.cache.blocks_per_chunk),
        "kv_groups": json.dumps(
            [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
            separators=(",", ":"),
        ),
    }
    if config.canonical_layout:
        parts["canonical_layout"] = "1"
    if config.replicated_layout:
        parts["replicated_layout"] = "1"
    return {
        "model": str(config.model.name),
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "kv_layout": str(config.kv_cache_layout or "default"),
        "parallelism": parallelism,
        "parts": parts,
    }


def standalone_spec(
    model: str,
    dtype: str,
    chunk_bytes: int,
    *,
    tp: int = 1,
    parallelism_agnostic: bool = False,
    tokens_per_hash: int = 16,
    blocks_per_chunk: int = 1,
    layer_names: tuple[str, ...] = ("layer",),
    kv_events: bool = False,
):
    """An offloading spec for a kvbm tier run outside a vLLM engine (tools, benchmarks, tests):
    vLLM's own ``OffloadingConfig`` for ``model`` / ``dtype`` (one KV group; TP ``tp``), which
    the tier reads its model fingerprint from, and KV events on or off. A tier built from it
    shares stored chunks with an engine whose config agrees on every fingerprinted field."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_hash, tuple(layer_names), 0),),
        worker_kv_bytes_per_block=chunk_bytes // (tp * blocks_per_chunk),
        enable_kv_cache_events=kv_events,
        extra_config={},
        engine_id=f"kvbm-standalone-{os.getpid()}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash,
                                    blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=parallelism_agnostic,
        ),
    )
    return SimpleNamespace(
        config=config,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=kv_events),
    )


def _flat(view: memoryview) -> memoryview:
    """vLLM's region as flat unsigned bytes (its view may be 2-D, of any one-byte format)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _KvbmTier(SecondaryTierManager):
    """What kvbm's tiers share: every call goes to the Rust tier (``self._rs``), answers as
    vLLM's objects."""

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

    def on_schedule_end(self, context) -> None:
        # The step's stores start here, after the step (kvbm's tiers batch them: see
        # kvbm-tiering's PhysicalTier, "Stores start at the step's end").
        self._rs.on_schedule_end()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=_POLICIES[self._rs.on_new_request(req_context)])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._rs.on_request_finished(req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """vLLM 0.33's recency hint (0.34 has no ``touch``; its manager never calls it)."""
        self._rs.touch(keys, req_context)

    def shutdown(self) -> None:
        self._rs.shutdown()

    def take_events(self) -> Iterable[OffloadingEvent]:
        with_ctx = installed().stored_event_context  # vLLM 0.34's events name their request
        for keys, removed, ctx in self._rs.take_events():
            extra = {"req_context": ctx} if with_ctx and ctx is not None else {}
            yield OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                                  locality=self.locality, ownership=self.tier_type, **extra)


class KvbmDiskTier(_KvbmTier):
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
        contract = installed()  # refuses a vLLM whose contract kvbm does not follow
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        who = f"secondary tier {tier_type!r}"
        s = _settings(who, config, DISK_KEYS)
        direct_io = _flag(who, s, "direct_io")
        events = _flag(who, s, "enable_kv_events")
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
        pool_mb = s["buffer_pool_mb"]
        if isinstance(pool_mb, bool) or not isinstance(pool_mb, int) or pool_mb < 0:
            raise ValueError(
                f"secondary tier {tier_type!r}: buffer_pool_mb must be an integer >= 0, "
                f"got {pool_mb!r}"
            )
        fingerprint = _fingerprint(who, offloading_spec)  # checks spec.config first
        path = _replica_path(who, str(s["path"]), offloading_spec)
        self._rs = extension().StorageTier.disk(
            _flat(primary_kv_view),
            self.block_size_bytes,
            fingerprint,
            path,
            capacity,
            int(s["queue_depth"]),
            direct_io,
            pool_mb << 20,
            _LOOKUP_RESULTS,
            _events_on(who, offloading_spec, events),
            tier_type,
            _io_nice(who, s),
        )
        _log.info(
            "kvbm tier %r (kvbm_disk): file %s, %d chunk slots of %d bytes, %d chunks warm "
            "from its journal, O_DIRECT %s, io_nice %d, KV events %s (vLLM %s contract)",
            tier_type, path, capacity, self.block_size_bytes, self._rs.num_ready(),
            "on" if direct_io else "off", s["io_nice"], "on" if events else "off",
            contract.name)


#: The keys a ``kvbm_object`` tier takes, with their defaults (``None``: required).
OBJECT_KEYS: dict[str, Any] = {
    "bucket": "",
    "dir": "",
    "endpoint": "",
    "region": "us-east-1",
    "allow_http": False,
    "access_key_env": "AWS_ACCESS_KEY_ID",
    "secret_key_env": "AWS_SECRET_ACCESS_KEY",
    "namespace": "kvbm",
    "capacity": 1 << 16,
    "locality": "remote",
    "shared": False,
    "probe_threads": 4,
    "max_probes": 256,
    "absent_ttl_s": 5.0,
    "io_nice": 10,
    "enable_kv_events": False,
}

_log = child("tiers")


class KvbmObjectTier(_KvbmTier):
    """A verified object tier (kvbm's G4) under vLLM's tiering manager: each chunk one object,
    named by its key's hash under ``namespace``, in an S3 bucket (``bucket``, ``endpoint``,
    ``region``; credentials from the environment variables named by ``access_key_env`` /
    ``secret_key_env``, never from the configuration) or in a local directory (``dir``).
    ``capacity`` is how many keys the tier remembers (the oldest forgotten beyond it).

    With ``shared: true`` the tier also finds chunks other instances wrote under the same
    ``namespace``: a key it does not know is probed in the store (one header read, checked
    against the key's identity) on a worker thread (``probe_threads``, at most ``max_probes`` in
    flight) while the lookup answers ``RETRY``; a present object is adopted and answers ``HIT``
    (its bytes are verified when loaded, like any chunk), an absent one ``MISS`` and is not
    probed again for ``absent_ttl_s`` seconds. A probe that fails (the store unreachable) is a
    ``MISS``, retried on a later lookup."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str = "kvbm_object",
        backpressure_detector=None,
        **config: Any,
    ) -> None:
        contract = installed()  # refuses a vLLM whose contract kvbm does not follow
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        who = f"secondary tier {tier_type!r}"
        s = _settings(who, config, OBJECT_KEYS)
        events = _flag(who, s, "enable_kv_events")
        shared = _flag(who, s, "shared")
        if bool(s["bucket"]) == bool(s["dir"]):
            raise ValueError(
                f"secondary tier {tier_type!r}: give exactly one of bucket (S3) and dir (a local "
                f"directory)"
            )
        self.locality = Locality(str(s["locality"]).upper())
        capacity = int(s["capacity"])
        if capacity <= 0:
            raise ValueError(f"secondary tier {tier_type!r}: capacity must be > 0, got {capacity}")
        access = secret = None
        if s["bucket"]:
            access = os.environ.get(s["access_key_env"])
            secret = os.environ.get(s["secret_key_env"])
            if not access or not secret:
                raise ValueError(
                    f"secondary tier {tier_type!r}: S3 credentials are read from the environment "
                    f"variables {s['access_key_env']} and {s['secret_key_env']}; set both"
                )
        where = (f"S3 bucket {s['bucket']!r} at {s['endpoint'] or 'the default endpoint'}"
                 if s["bucket"] else f"directory {s['dir']}")
        why = " (unreachable, no such bucket, or credentials refused)" if s["bucket"] else ""

        def unusable(e: RuntimeError) -> RuntimeError:
            _log.error("kvbm tier %r (kvbm_object): %s cannot be used: %s", tier_type, where, e)
            return RuntimeError(f"secondary tier {tier_type!r}: {where} cannot be used{why}: {e}")

        try:
            # Built by kvbm's tier set (kvbm_engine::stack::secondary_object), which probes an
            # S3 endpoint first: nothing listening is an error now.
            self._rs = extension().StorageTier.object(
                _flat(primary_kv_view),
                self.block_size_bytes,
                _fingerprint(who, offloading_spec),
                str(s["namespace"]),
                capacity,
                s["bucket"] or None,
                s["endpoint"] or None,
                str(s["region"]),
                access,
                secret,
                s["dir"] or None,
                _LOOKUP_RESULTS,
                _events_on(who, offloading_spec, events),
                tier_type,
                _io_nice(who, s),
                _flag(who, s, "allow_http"),
            )
        except RuntimeError as e:
            raise unusable(e) from e
        if s["bucket"]:
            # A missing bucket or refused credentials is an error now, not a miss on every
            # lookup from here on.
            try:
                self._rs.object_probe().check_access()
            except RuntimeError as e:
                self._rs.shutdown()
                raise unusable(e) from e
        _log.info(
            "kvbm tier %r (kvbm_object): %s, namespace %r, %d keys remembered, %s, KV events "
            "%s (vLLM %s contract)", tier_type, where, s["namespace"], capacity,
            "shared (probes other instances' objects)" if shared else "not shared",
            "on" if events else "off", contract.name)
        self._probe = None
        if shared:
            self._probe = self._rs.object_probe()
            self._pool = ThreadPoolExecutor(
                max_workers=int(s["probe_threads"]), thread_name_prefix="kvbm-object-probe"
            )
            self._probes: dict = {}
            self._absent: OrderedDict = OrderedDict()
            self._max_probes = int(s["max_probes"])
            self._absent_ttl = float(s["absent_ttl_s"])

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        r = self._rs.lookup(key, req_context)
        if r is not LookupResult.MISS or self._probe is None:
            return r
        fut = self._probes.get(key)
        if fut is None:
            seen = self._absent.get(key)
            if seen is not None and time.monotonic() - seen < self._absent_ttl:
                return LookupResult.MISS
            if len(self._probes) >= self._max_probes:
                return LookupResult.MISS
            self._probes[key] = self._pool.submit(self._probe.present, key)
            return LookupResult.RETRY
        if not fut.done():
            return LookupResult.RETRY
        del self._probes[key]
        try:
            present = fut.result()
        except Exception as e:  # noqa: BLE001 - the store went away: a miss, asked again later
            _log.warning("kvbm_object: probing %r failed: %s", key, e)
            return LookupResult.MISS
        if present and self._rs.adopt(key):
            return LookupResult.HIT
        self._absent[key] = time.monotonic()
        self._absent.move_to_end(key)
        while len(self._absent) > 1 << 16:
            self._absent.popitem(last=False)
        return LookupResult.MISS

    def shutdown(self) -> None:
        if self._probe is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().shutdown()


#: The keys a ``kvbm_fleet`` tier takes, with their defaults (``None``: required; ``""`` and 0:
#: not set here, so kvbm's configuration tree decides: ``KVBM_CONFIG_PATH``, the ``KVBM_*``
#: environment, then ``config_file``).
FLEET_KEYS: dict[str, Any] = {
    "namespace": None,
    "capacity": None,
    "config_file": "",
    "nats_url": "",
    "data_plane_bind": "",
    "data_plane_advertise": "",
    "trust_root": "",
    "credential_file": "",
    "insecure": False,
    "nats_creds_file": "",
    "nats_nkey_file": "",
    "nats_token_file": "",
    "nats_user": "",
    "nats_password_file": "",
    "nats_ca_file": "",
    "heartbeat_interval_ms": 0,
    "heartbeat_timeout_ms": 0,
    "pull_deadline_ms": 0,
    "disk_path": "",
    "disk_capacity": 0,
    "disk_direct_io": True,
    "io_nice": 10,
    "locality": "remote",
}

#: Each ``kvbm_fleet`` key that maps onto kvbm's configuration tree, and its tree key.
FLEET_TREE: dict[str, str] = {
    "nats_url": "transport.nats_url",
    "data_plane_bind": "transport.data_plane_bind",
    "data_plane_advertise": "transport.data_plane_advertise",
    "trust_root": "security.trust_root",
    "credential_file": "security.credential_file",
    "nats_creds_file": "transport.nats_auth.creds_file",
    "nats_nkey_file": "transport.nats_auth.nkey_file",
    "nats_token_file": "transport.nats_auth.token_file",
    "nats_user": "transport.nats_auth.user",
    "nats_password_file": "transport.nats_auth.password_file",
    "nats_ca_file": "transport.nats_auth.ca_file",
    "heartbeat_interval_ms": "transport.heartbeat_interval_ms",
    "heartbeat_timeout_ms": "transport.heartbeat_timeout_ms",
    "pull_deadline_ms": "transport.pull_deadline_ms",
}


def _namespace(who: str, ns: Any) -> str:
    """A fleet's namespace: one NATS subject token (letters, digits, ``-``, ``_``)."""
    ns = str(ns)
    if not ns or not all(c.isascii() and (c.isalnum() or c in "-_") for c in ns):
        raise ValueError(
            f"{who}: namespace must be letters, digits, '-' or '_' (one NATS subject "
            f"token), got {ns!r}"
        )
    return ns


class KvbmFleetTier(_KvbmTier):
    """A fleet of vLLM instances sharing their KV through kvbm's cluster (tier type
    ``kvbm_fleet``): each instance joins ``namespace`` on a NATS server, keeps ``capacity``
    chunks of what vLLM stores in host memory it serves to its peers over kvbm's authenticated
    data plane, announces them, and indexes its peers' announcements. A lookup answers from
    that memory or that index (never the network): a chunk a peer holds is a ``HIT``, and the
    load pulls it from the peer, every byte checked against the checksum and the identity of
    the key, before it is copied into vLLM's region. A peer that died, stalled or sent bytes
    that fail the check fails the load (vLLM recomputes), never wrong bytes; a bad copy leaves
    the index; a peer that leaves is forgotten within its heartbeat window. Instances of
    another model fingerprint or namespace never match.

    Secure by default, as ``kvbm replay --instances``: every member needs a credential issued
    by the fleet's root (``kvbm security init`` / ``issue``; ``trust_root``,
    ``credential_file``), and a NATS server off loopback its credentials (``nats_*``); without
    them it refuses to start, naming the key, unless ``insecure: true``. Every hit reports
    ``CacheHitSource.P2P`` (``fleet_stats()`` tells local from pulled). See the README's
    "Fleet" section."""

    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str = "kvbm_fleet",
        backpressure_detector=None,
        **config: Any,
    ) -> None:
        contract = installed()  # refuses a vLLM whose contract kvbm does not follow
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        who = f"secondary tier {tier_type!r}"
        s = _settings(who, config, FLEET_KEYS)
        namespace = _namespace(who, s["namespace"])
        capacity = s["capacity"]
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"{who}: capacity must be an integer > 0, got {capacity!r}")
        self.locality = Locality(str(s["locality"]).upper())
        # Under kvbm.events.>: the subjects docs/security.md grants the instance role.
        settings: dict[str, Any] = {"events.subject": f"kvbm.events.fleet.{namespace}"}
        for key, tree_key in FLEET_TREE.items():
            v = s[key]
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"{who}: {key} must be a string or an integer, got {v!r}")
            if v not in ("", 0):
                settings[tree_key] = v
        if s["credential_file"]:
            # Each data-parallel engine core is its own member: its own credential (instance).
            settings["security.credential_file"] = _replica_path(
                who, str(s["credential_file"]), offloading_spec, "credential_file",
                "member credential (each engine core is its own fleet member)")
        if _flag(who, s, "insecure"):
            settings["security.insecure"] = True
        # The member's own disk (its G3): what it shares is written down too, journaled, so a
        # restarted member is warm.
        disk_capacity = s["disk_capacity"]
        if isinstance(disk_capacity, bool) or not isinstance(disk_capacity, int) \
                or disk_capacity < 0:
            raise ValueError(f"{who}: disk_capacity must be an integer >= 0, got "
                             f"{disk_capacity!r}")
        if bool(s["disk_path"]) != (disk_capacity > 0):
            raise ValueError(f"{who}: give disk_path and disk_capacity together (a disk of "
                             f"disk_capacity chunks at disk_path), or neither")
        if s["disk_path"]:
            settings["physical.disk.path"] = _replica_path(
                who, str(s["disk_path"]), offloading_spec, "disk_path", "disk")
            settings["physical.disk.direct_io"] = _flag(who, s, "disk_direct_io")
            settings["tiers.g3_blocks"] = disk_capacity
        try:
            self._rs = extension().StorageTier.fleet(
                _flat(primary_kv_view),
                self.block_size_bytes,
                _fingerprint(who, offloading_spec),
                capacity,
                settings,
                _LOOKUP_RESULTS,
                s["config_file"] or None,
                tier_type,
                _io_nice(who, s),
            )
        except RuntimeError as e:
            _log.error("kvbm tier %r (kvbm_fleet) cannot start: %s", tier_type, e)
            raise RuntimeError(f"{who}: {e}") from e
        stats = self._rs.fleet_stats()
        _log.info(
            "kvbm tier %r (kvbm_fleet): instance %s of namespace %r, %d chunks of %d bytes "
            "shared, data plane %s (vLLM %s contract)", tier_type, stats["instance"],
            namespace, capacity, self.block_size_bytes, stats.get("data_plane"), contract.name)

    def fleet_stats(self) -> dict[str, Any]:
        """What the tier did (chunks hit here and through peers, stored, loaded from each,
        failed), its peers and index, and the refusals of its data plane and messages."""
        return self._rs.fleet_stats()


#: The short tier names as module attributes: vLLM's ``SecondaryTierFactory`` resolves a tier
#: given with ``module_path`` by looking its ``type`` up in that module, so
#: ``{"type": "kvbm_disk", "module_path": "kvbm_vllm.tiers"}`` works without the plugin (as do
#: the class names).
kvbm_disk = KvbmDiskTier
kvbm_object = KvbmObjectTier
kvbm_fleet = KvbmFleetTier
