"""``KvbmOffloadingSpec``: kvbm's whole scheduler-side manager, built by vLLM's own factory.

The spec is created from an ``OffloadingConfig`` through vLLM's ``OffloadingSpecFactory`` (by
module path, and by name once the plugin registered it), over a real ``SharedOffloadRegion``
in /dev/shm, with a ``kvbm_disk`` tier below. The test plays vLLM's worker through the
region's memoryview: stores chunks, pushes them out of the primary, and reads them back from
the disk through kvbm's manager, bytes compared. Configuration errors name the key.
"""

import os
import time
import uuid

import numpy as np
import pytest

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm_config import offloading_config  # noqa: E402

from kvbm_vllm import register, upstream_compat  # noqa: E402
from kvbm_vllm.spec import KvbmOffloadingSpec  # noqa: E402


def config(tmp_path, extra=None, by_name=False):
    """By name: the plugin's registered names; else module paths (spec and tier class)."""
    disk = {"path": str(tmp_path / "g3.bin"), "capacity": 512, "direct_io": False}
    if by_name:
        register()
        disk["type"] = "kvbm_disk"
    else:
        disk.update(type="KvbmDiskTier", module_path="kvbm_vllm.tiers")
    extra_config = {
        "cpu_bytes_to_use": 64 * 4096,  # 64 primary chunks
        "secondary_tiers": [disk],
        "spec_name": "KvbmOffloadingSpec",
        **(extra or {}),
    }
    if not by_name:
        extra_config["spec_module_path"] = "kvbm_vllm.spec"
    return offloading_config(extra_config)


class Driver:
    """vLLM's scheduler and worker around a manager whose primary is a real shared region."""

    def __init__(self, manager):
        self.m = manager
        self.view = manager.primary_tier.get_kv_memoryview()
        self.rows = np.frombuffer(self.view, dtype=np.uint8).reshape(self.view.shape[0], -1)
        self.n = 0

    def step(self):
        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def ctx(self):
        self.n += 1
        c = ReqContext(req_id=f"r{self.n}")
        self.m.on_new_request(c)
        return c

    def store(self, keys):
        c = self.ctx()
        out = self.m.prepare_store(keys, c)
        assert out is not None
        for k, slot in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(slot)] = pattern(k, self.rows.shape[1])
        self.m.complete_store(out.keys_to_store, c)
        self.m.on_request_finished(c)
        self.settle()

    def settle(self):
        """Steps until the tiers' jobs are reported (their I/O runs off this thread)."""
        for _ in range(5000):
            self.step()
            if not self.m.has_pending_work():
                return
            time.sleep(0.001)
        raise AssertionError("the manager never settled")

    def load(self, key):
        c = self.ctx()
        for _ in range(5000):
            r = self.m.lookup(key, c)
            if r is LookupResult.HIT:
                spec = self.m.prepare_load([key], c)
                data = self.rows[int(spec.chunk_ids[0])].copy()
                self.m.complete_load([key], c)
                self.m.on_request_finished(c)
                self.step()
                return data
            if r is LookupResult.MISS:
                self.m.on_request_finished(c)
                self.step()
                return None
            self.step()
            time.sleep(0.001)
        raise AssertionError("the lookup never resolved")


def pattern(key, n):
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "big") % (2**32)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def keys(prefix, n):
    return [make_offload_key(f"{prefix}-{i}".encode(), 0) for i in range(n)]


@pytest.mark.parametrize("by_name", [False, True])
def test_the_spec_builds_kvbms_manager_and_round_trips_bytes_through_the_disk(tmp_path, by_name):
    spec = OffloadingSpecFactory.create_spec(config(tmp_path, by_name=by_name))
    assert isinstance(spec, KvbmOffloadingSpec)
    manager = spec.get_manager()
    try:
        assert isinstance(manager, upstream_compat.TieringOffloadingManager)
        assert isinstance(manager.primary_tier, upstream_compat.CPUPrimaryTierOffloadingManager)
        assert manager._python_tier == [False], "kvbm's disk tier is driven in Rust"
        (primary, disk) = manager.config_info()
        # The tier is named as configured (vLLM's tier_type), as under vLLM's own manager.
        named = "kvbm_disk" if by_name else "KvbmDiskTier"
        assert primary["tier"] == "0:primary" and disk["tier"] == f"1:{named}"
        d = Driver(manager)
        capacity = d.rows.shape[0]
        first = keys("first", 2)
        d.store(first)
        # Push the first chunks out of the primary, then read them back from the disk.
        for i in range(capacity):
            d.store(keys(f"fill{i}", 1))
        assert all(
            manager.primary_tier.lookup(k, ReqContext(req_id="probe")) is LookupResult.MISS
            for k in first
        ), "the primary evicted them"
        for k in first:
            got = d.load(k)
            assert got is not None, "promoted from the disk"
            assert np.array_equal(got, pattern(k, d.rows.shape[1])), "with the stored bytes"
    finally:
        manager.shutdown()


def test_kvbm_fixes_are_on_unless_asked_for_upstream_behaviour(tmp_path):
    spec = OffloadingSpecFactory.create_spec(config(tmp_path))
    assert spec.get_manager()._UPSTREAM is False
    spec.get_manager().shutdown()
    spec = OffloadingSpecFactory.create_spec(config(tmp_path, {"kvbm_upstream_bugs": True}))
    assert spec.get_manager()._UPSTREAM is True
    spec.get_manager().shutdown()


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"kvbm_no_such_key": 1}, "kvbm_no_such_key"),
        ({"kvbm_native_tiers": "yes"}, "kvbm_native_tiers"),
        ({"store_threshold": 2}, "store_threshold"),
    ],
)
def test_configuration_errors_name_the_key(tmp_path, extra, named):
    with pytest.raises(ValueError, match=named):
        spec = OffloadingSpecFactory.create_spec(config(tmp_path, extra))
        spec.get_manager()


def test_a_tier_that_cannot_start_is_a_clear_error_and_leaves_nothing_behind(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = config(tmp_path)
    cfg.extra_config["secondary_tiers"][0]["path"] = str(blocker / "g3.bin")
    spec = OffloadingSpecFactory.create_spec(cfg)
    with pytest.raises(Exception, match="g3.bin|file"):
        spec.get_manager()
    assert spec._scheduler_mmap is None, "the shared region was cleaned up"


def _installed_line():
    from kvbm_vllm.contract import installed

    return installed().name


@pytest.mark.parametrize("version", ["0.32.1", "0.35.0", "1.0", "nightly"])
def test_an_unsupported_vllm_version_is_refused_by_name(tmp_path, monkeypatch, version):
    """Any release line but 0.33 and 0.34 is refused by the spec, naming the version and
    the supported ones."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", version, raising=False)
    with pytest.raises(RuntimeError, match=rf"this is vLLM {version}.*") as e:
        OffloadingSpecFactory.create_spec(config(tmp_path))
    assert "0.34.x" in str(e.value) and "0.33.x" in str(e.value)


@pytest.mark.parametrize("patch", ["0", "2rc1"])
def test_the_installed_release_line_is_followed_whatever_its_patch(tmp_path, monkeypatch, patch):
    import vllm

    line = _installed_line()
    monkeypatch.setattr(vllm, "__version__", f"{line}.{patch}", raising=False)
    OffloadingSpecFactory.create_spec(config(tmp_path))


def test_a_version_that_disagrees_with_the_modules_is_a_mixed_installation(tmp_path, monkeypatch):
    """vLLM's version says one supported line, its modules implement the other: refused."""
    import vllm

    other = {"0.33": "0.34.0", "0.34": "0.33.0"}[_installed_line()]
    monkeypatch.setattr(vllm, "__version__", other, raising=False)
    with pytest.raises(RuntimeError, match="mixed installation"):
        OffloadingSpecFactory.create_spec(config(tmp_path))


def test_a_kvbm_tier_under_vllm_s_own_spec_refuses_an_unsupported_vllm(tmp_path, monkeypatch):
    """The check is the tiers' too: kvbm_disk under vLLM's TieringOffloadingSpec."""
    import vllm

    cfg = config(tmp_path, by_name=True)
    cfg.extra_config["spec_name"] = "TieringOffloadingSpec"
    cfg.extra_config["spec_module_path"] = "vllm.v1.kv_offload.tiering.spec"
    spec = OffloadingSpecFactory.create_spec(cfg)
    monkeypatch.setattr(vllm, "__version__", "0.35.1", raising=False)
    with pytest.raises(RuntimeError, match="this is vLLM 0.35.1"):
        spec.get_manager()


@pytest.mark.parametrize("spec_name", ["KvbmOffloadingSpec", "TieringOffloadingSpec"])
def test_a_disk_and_an_object_tier_under_one_manager_round_trip_bytes(tmp_path, spec_name):
    """The README's configuration: kvbm_disk and kvbm_object under one manager (kvbm's, and
    vLLM's own), both over vLLM's one region. A second instance with an empty disk finds the
    chunks in the shared object store."""

    def manager(disk_name):
        cfg = config(tmp_path, by_name=True)
        cfg.extra_config["secondary_tiers"][0]["path"] = str(tmp_path / disk_name)
        cfg.extra_config["secondary_tiers"].append(
            {"type": "kvbm_object", "dir": str(tmp_path / "objects"), "namespace": "both",
             "shared": True})
        if spec_name == "TieringOffloadingSpec":
            cfg.extra_config["spec_name"] = spec_name
            cfg.extra_config["spec_module_path"] = "vllm.v1.kv_offload.tiering.spec"
        spec = OffloadingSpecFactory.create_spec(cfg)
        assert type(spec).__name__ == spec_name
        return spec.get_manager()

    m = manager("g3.bin")
    try:
        assert [c["tier"].split(":")[1] for c in m.config_info()] == \
            ["primary", "kvbm_disk", "kvbm_object"]
        d = Driver(m)
        first = keys("both", 3)
        d.store(first)
        for i in range(d.rows.shape[0]):
            d.store(keys(f"fill{i}", 1))
        for k in first:
            got = d.load(k)
            assert got is not None and np.array_equal(got, pattern(k, d.rows.shape[1]))
    finally:
        m.shutdown()
    m = manager("empty.bin")
    try:
        d = Driver(m)
        for k in first:
            got = d.load(k)
            assert got is not None, "found in the shared object store"
            assert np.array_equal(got, pattern(k, d.rows.shape[1]))
    finally:
        m.shutdown()


def test_kvbm_tiers_are_named_alike_under_kvbms_manager_and_vllms(tmp_path):
    """A tier configured by class (``module_path``) is named by that class under either
    manager: in config_info's labels and in its events' ownership."""

    def labels(spec_name, module_path, sub):
        cfg = config(tmp_path / sub, {"spec_name": spec_name, "spec_module_path": module_path})
        cfg.extra_config["secondary_tiers"].append(
            {"type": "KvbmObjectTier", "module_path": "kvbm_vllm.tiers",
             "dir": str(tmp_path / sub / "objects"), "namespace": "names"})
        m = OffloadingSpecFactory.create_spec(cfg).get_manager()
        try:
            return [c["tier"] for c in m.config_info()]
        finally:
            m.shutdown()

    kvbm = labels("KvbmOffloadingSpec", "kvbm_vllm.spec", "a")
    vllm = labels("TieringOffloadingSpec", "vllm.v1.kv_offload.tiering.spec", "b")
    assert kvbm == vllm == ["0:primary", "1:KvbmDiskTier", "2:KvbmObjectTier"]


def test_the_module_path_form_takes_the_short_tier_names(tmp_path):
    """The README's form without the plugin: {"type": "kvbm_disk", "module_path":
    "kvbm_vllm.tiers"} (vLLM looks the type up as an attribute of the module)."""
    cfg = config(tmp_path)
    cfg.extra_config["secondary_tiers"][0]["type"] = "kvbm_disk"
    cfg.extra_config["secondary_tiers"][0]["path"] = str(tmp_path / "short.bin")
    m = OffloadingSpecFactory.create_spec(cfg).get_manager()
    try:
        assert [c["tier"].split(":")[1] for c in m.config_info()] == ["primary", "kvbm_disk"]
    finally:
        m.shutdown()


@pytest.mark.parametrize("value, on", [(True, True), (False, False), ("false", False),
                                       ("False", False), ("true", True), ("no", None),
                                       (1, None), ("0", None)])
def test_tier_booleans_are_strict(tmp_path, value, on):
    """``"false"`` is false, never on; anything but true/false is an error naming the key."""
    cfg = config(tmp_path)
    cfg.extra_config["secondary_tiers"][0]["enable_kv_events"] = value
    spec = OffloadingSpecFactory.create_spec(cfg)
    if on is None:
        with pytest.raises(ValueError, match="enable_kv_events must be true or false"):
            spec.get_manager()
        return
    spec.get_manager().shutdown()


class _VllmLog:
    """Records what reaches vLLM's ``vllm`` logger at ``level`` and above, while in use."""

    def __init__(self, level):
        import logging

        self.records: list = []
        self._logger = logging.getLogger("vllm")
        self._level = level
        outer = self

        class Keep(logging.Handler):
            def emit(self, record):
                outer.records.append(record)

        self._handler = Keep(level=level)

    def __enter__(self):
        self._old = self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(min(self._old or self._level, self._level))
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._old)


def test_a_tier_says_what_it_is_at_start_through_vllm_s_logger_tree(tmp_path):
    """kvbm logs under vLLM's ``vllm`` logger (its handler, format and level): a tier's start
    names its file, capacity, warm chunks and O_DIRECT."""
    import logging

    with _VllmLog(logging.INFO) as log:
        OffloadingSpecFactory.create_spec(config(tmp_path)).get_manager().shutdown()
    lines = [r.getMessage() for r in log.records if r.name.startswith("vllm.kvbm_vllm")]
    assert any("kvbm_disk" in m and str(tmp_path / "g3.bin") in m and "512 chunk slots" in m
               and "warm" in m and "O_DIRECT off" in m for m in lines), lines


def _dp_config(tmp_path, path, index, size):
    import dataclasses

    cfg = config(tmp_path)
    cfg.extra_config["secondary_tiers"][0]["path"] = path
    parallel = dataclasses.replace(cfg.parallel, data_parallel_index=index,
                                   data_parallel_size=size)
    return dataclasses.replace(cfg, parallel=parallel,
                               engine_id=f"kvbm-dp{index}-{uuid.uuid4().hex}")


def test_data_parallel_engine_cores_each_get_their_own_disk_file(tmp_path):
    """vLLM hands every DP engine core the same configuration: {dp_rank} in the path gives
    each its own file, and the cores run side by side."""
    path = str(tmp_path / "g3.dp{dp_rank}.bin")
    managers = [OffloadingSpecFactory.create_spec(_dp_config(tmp_path, path, i, 2)).get_manager()
                for i in range(2)]
    try:
        assert (tmp_path / "g3.dp0.bin").exists() and (tmp_path / "g3.dp1.bin").exists()
    finally:
        for m in managers:
            m.shutdown()


def test_data_parallel_without_a_replica_placeholder_is_refused_by_name(tmp_path):
    cfg = _dp_config(tmp_path, str(tmp_path / "g3.bin"), 1, 2)
    with pytest.raises(ValueError, match=r"2 data-parallel engine cores.*\{dp_rank\}"):
        OffloadingSpecFactory.create_spec(cfg).get_manager()


def test_an_unknown_path_placeholder_is_refused_by_name(tmp_path):
    cfg = config(tmp_path)
    cfg.extra_config["secondary_tiers"][0]["path"] = str(tmp_path / "g3.{rank}.bin")
    with pytest.raises(ValueError, match=r"placeholder kvbm does not fill.*\{dp_rank\}"):
        OffloadingSpecFactory.create_spec(cfg).get_manager()


def test_kvbm_s_rust_log_lines_reach_vllm_s_log(tmp_path):
    """What kvbm's Rust code logs (kvbm-physical's I/O fallbacks, kvbm-tiering's refusals)
    reaches Python's logging under ``vllm.kvbm_vllm.<crate>.<module>`` at its level, through
    the extension's log bridge. Here: a Python tier reports a job the manager never gave it,
    which kvbm-tiering logs as an error and drops."""
    import logging
    from unittest.mock import MagicMock

    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    class Stray(SecondaryTierManager):
        medium = Medium.CPU

        def __init__(self, view):
            super().__init__(offloading_spec=None, primary_kv_view=view, tier_type="stray")
            self.sent = False

        def lookup(self, key, req_context):
            return LookupResult.MISS

        def submit_store(self, job):
            pass

        def submit_load(self, job):
            pass

        def get_finished_jobs(self):
            if self.sent:
                return []
            self.sent = True
            return [JobResult(job_id=424242, success=True)]

        def on_new_request(self, req_context):
            from vllm.v1.kv_offload.base import RequestOffloadingContext

            return RequestOffloadingContext()

        def drain_jobs(self):
            return

    region = np.zeros((8, 64), dtype=np.int8)
    mmap = MagicMock()
    mmap.create_kv_memoryview.return_value = memoryview(region)
    primary = upstream_compat.CPUPrimaryTierOffloadingManager(num_chunks=8, mmap_region=mmap)
    m = upstream_compat.TieringOffloadingManager(
        primary_tier=primary, secondary_tiers=[Stray(primary.get_kv_memoryview())])
    try:
        with _VllmLog(logging.WARNING) as log:
            m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                    "424242" in r.getMessage() for r in log.records):
                time.sleep(0.02)
        seen = log.records
        hits = [r for r in seen if "424242" in r.getMessage()]
        assert hits, f"kvbm-tiering's error did not reach vLLM's logger: {seen}"
        assert hits[0].levelno == logging.ERROR
        assert hits[0].name.startswith("vllm.kvbm_vllm.kvbm_tiering"), hits[0].name
        assert "not tracked" in hits[0].getMessage()
    finally:
        m.shutdown()


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def _readme_configs():
    """Every ``--kv-transfer-config '...'`` of the kvbm-vllm README, parsed as it is written."""
    import json
    import re

    text = open(README, encoding="utf-8").read()
    found = re.findall(r"--kv-transfer-config '(\{.*?\})'", text, flags=re.S)
    # The last is KvbmDiskDirectSpec (vLLM 0.34 only; test_direct_disk.py).
    assert len(found) == 4, "the README's vllm serve examples"
    return [json.loads(c) for c in found]


@pytest.mark.parametrize("form", ["plugin", "module_path"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_readme_s_configurations_start_as_written(tmp_path, monkeypatch, index, form):
    """The README's ``--kv-transfer-config`` JSON, verbatim but for where it points (its file
    moved under a temporary directory, its S3 bucket to a local directory) and its sizes (the
    pool and the disk tier scaled down): by the plug-in's
    registered names, and in the README's no-plug-in form (``module_path`` with the short tier
    names, ``spec_module_path``)."""
    import copy

    cfg_json = copy.deepcopy(_readme_configs()[index])
    assert cfg_json["kv_connector"] == "OffloadingConnector"
    extra = cfg_json["kv_connector_extra_config"]
    for i, tier in enumerate(extra["secondary_tiers"]):
        if tier["type"] == "kvbm_disk":
            tier["path"] = str(tmp_path / f"g3-{i}.bin")
            tier["direct_io"] = False  # a temporary directory may be tmpfs
            # 64 blocks, not the README's 262144: its file is allocated in full (2 GiB at this
            # test's block size, kept by pytest for its last three runs: a CI disk filled up)
            tier["capacity"] = 64
        elif tier["type"] == "kvbm_object":
            for k in ("bucket", "endpoint"):
                tier.pop(k, None)
            tier["dir"] = str(tmp_path / "objects")
        elif tier["type"] == "kvbm_fleet":
            # The test's NATS server with accounts and a credential of a root made here; the
            # data plane on loopback (the README's port may be taken).
            from test_fleet_tier import Root, nats

            args = nats()
            tier["nats_url"], tier["nats_user"], tier["nats_password_file"] = args[1::2]
            tier.pop("nats_ca_file", None)
            root = Root(tmp_path / f"root-{i}")
            tier["trust_root"] = root.trust_root
            tier["credential_file"] = root.issue(0xA1 + i, tier["namespace"])
            tier["data_plane_bind"] = "127.0.0.1:0"
            tier.pop("data_plane_advertise", None)
            tier["capacity"] = 16
        if form == "module_path":
            tier["module_path"] = "kvbm_vllm.tiers"
    if form == "plugin":
        register()
    elif extra["spec_name"] == "KvbmOffloadingSpec":
        extra["spec_module_path"] = "kvbm_vllm.spec"
    elif extra["spec_name"] == "TieringOffloadingSpec":
        extra["spec_module_path"] = "vllm.v1.kv_offload.tiering.spec"
    extra["cpu_bytes_to_use"] = 64 * 4096  # 64 primary chunks, not the README's 32 GiB
    import dataclasses

    cfg = dataclasses.replace(config(tmp_path), extra_config=extra)
    spec = OffloadingSpecFactory.create_spec(cfg)
    assert type(spec).__name__ == extra["spec_name"]
    m = spec.get_manager()
    try:
        types = [c["tier"].split(":", 1)[1] for c in m.config_info()]
        assert types == ["primary"] + [t["type"] for t in extra["secondary_tiers"]]
    finally:
        m.shutdown()
