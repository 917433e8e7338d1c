"""Bytes through a tiering manager and kvbm's disk and object tiers.

Every test runs three ways (the ``impl`` fixture): under vLLM 0.33's real
``TieringOffloadingManager`` and ``CPUPrimaryTierOffloadingManager`` (``vllm``), under kvbm's
(``kvbm``: kvbm_vllm.upstream_compat, kvbm's tiers driven in Rust), and under kvbm's with the
tiers driven through their Python methods (``kvbm-python-tiers``). They run the
scheduler side; their primary region is a numpy array standing in for the shared region vLLM's
workers fill from the GPU. ``KvbmDiskTier`` sits below as a secondary tier. The tests play the
worker (write a stored chunk's bytes into its primary slot) and the scheduler (steps, lookups),
and check what a user relies on: chunks evicted from the primary come back from the disk with
the bytes they were stored with; a damaged slot is never served; the tier stays within its
capacity; bad configuration is refused naming the key.
"""

import os
import time
from unittest.mock import MagicMock

import numpy as np
import pytest

from kvbm_vllm.replay import ensure_vllm

ensure_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvbm_vllm import upstream_compat  # noqa: E402
from kvbm_vllm.tiers import KvbmDiskTier, KvbmObjectTier, standalone_spec  # noqa: E402


class _KvbmPythonTiers(upstream_compat.TieringOffloadingManager):
    _NATIVE_TIERS = False


#: impl -> (primary class, tiering manager class)
IMPLS = {
    "vllm": (CPUPrimaryTierOffloadingManager, TieringOffloadingManager),
    "kvbm": (upstream_compat.CPUPrimaryTierOffloadingManager,
             upstream_compat.TieringOffloadingManager),
    "kvbm-python-tiers": (upstream_compat.CPUPrimaryTierOffloadingManager, _KvbmPythonTiers),
}


@pytest.fixture(params=list(IMPLS))
def impl(request):
    return request.param

CHUNK = 4096
PRIMARY = 8


def vllm_spec(model="test-model", dtype="float16", tp=1, agnostic=False, tokens_per_hash=16):
    """A spec carrying vLLM's real ``OffloadingConfig``, what the tiers read their model
    fingerprint from (events on, as vLLM's global switch; each test asks its tier for them)."""
    return standalone_spec(model, dtype, CHUNK, tp=tp, parallelism_agnostic=agnostic,
                           tokens_per_hash=tokens_per_hash, kv_events=True)


class Setup:
    def __init__(self, tmp_path, impl="vllm", capacity=32, direct_io=True, spec=None, **extra):
        primary_cls, manager_cls = IMPLS[impl]
        self.region = np.zeros((PRIMARY, CHUNK), dtype=np.int8)
        mmap = MagicMock()
        mmap.create_kv_memoryview.return_value = memoryview(self.region)
        self.primary = primary_cls(num_chunks=PRIMARY, mmap_region=mmap)
        self.path = tmp_path / "g3" / "g3.bin"
        self.tier = KvbmDiskTier(
            offloading_spec=spec or vllm_spec(),
            primary_kv_view=self.primary.get_kv_memoryview(),
            tier_type="kvbm_disk",
            path=str(self.path),
            capacity=capacity,
            direct_io=direct_io,
            **extra,
        )
        self.manager = manager_cls(primary_tier=self.primary, secondary_tiers=[self.tier])
        self.n = 0

    def step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def ctx(self):
        self.n += 1
        c = ReqContext(req_id=f"r{self.n}")
        self.manager.on_new_request(c)
        return c

    def store(self, keys, fill):
        """Stores `keys` as vLLM does: prepare, the worker writes the slots, complete."""
        c = self.ctx()
        out = self.manager.prepare_store(keys, c)
        assert out is not None, "the primary has room"
        for k, slot in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.region[int(slot)] = fill(k)
        self.manager.complete_store(out.keys_to_store, c)
        self.manager.on_request_finished(c)
        self.settle()

    def settle(self):
        """Steps until every job of the disk tier is reported."""
        for _ in range(50):
            self.tier.drain_jobs()
            self.step()
            if not self.tier.has_pending_work():
                self.step()
                return
        raise AssertionError("the disk tier never settled")

    def load(self, key):
        """Looks `key` up as a new request would, following a promotion; returns the bytes the
        worker would copy to the GPU, or None for a miss."""
        c = self.ctx()
        for _ in range(50):
            r = self.manager.lookup(key, c)
            if r is LookupResult.HIT:
                spec = self.manager.prepare_load([key], c)
                data = self.region[int(spec.chunk_ids[0])].copy()
                self.manager.complete_load([key], c)
                self.manager.on_request_finished(c)
                self.step()
                return data
            if r is LookupResult.MISS:
                self.manager.on_request_finished(c)
                self.step()
                return None
            self.tier.drain_jobs()
            self.step()
            time.sleep(0.002)  # a tier answering RETRY works off the scheduler thread
        raise AssertionError(f"lookup of {key!r} never resolved")


def pattern(key):
    seed = int.from_bytes(key[:8].ljust(8, b"\0"), "big") % (2**32)
    return np.random.default_rng(seed).integers(-128, 128, CHUNK, dtype=np.int8)


def keys(prefix, n):
    return [make_offload_key(f"{prefix}-{i}".encode(), 0) for i in range(n)]


def test_evicted_chunks_come_back_from_disk_with_their_bytes(tmp_path, impl):
    s = Setup(tmp_path, impl)
    first = keys("first", 4)
    s.store(first, pattern)
    assert s.tier._rs.num_ready() == 4, "every stored chunk cascaded to the disk"
    # Push the first chunks out of the 8-slot primary.
    for i in range(3):
        s.store(keys(f"filler{i}", 4), pattern)
    assert all(s.primary.lookup(k, ReqContext(req_id="probe")) is LookupResult.MISS for k in first)
    for k in first:
        got = s.load(k)
        assert got is not None, "promoted back from the disk"
        assert np.array_equal(got, pattern(k)), "with the bytes it was stored with"
    s.manager.shutdown()


def test_a_restarted_disk_tier_is_warm(tmp_path, impl):
    first = Setup(tmp_path, impl)
    stored = keys("kept", 4)
    first.store(stored, pattern)
    first.manager.shutdown()  # vLLM's shutdown: the tier syncs its file and journal
    assert (tmp_path / "g3" / "g3.journal").exists()

    # A new process's managers over a fresh (zeroed) primary region, the same file.
    second = Setup(tmp_path, impl)
    for k in stored:
        got = second.load(k)
        assert got is not None, "found on disk after the restart"
        assert np.array_equal(got, pattern(k)), "with its bytes"
    assert second.load(keys("never", 1)[0]) is None
    second.manager.shutdown()


def test_a_disk_file_written_for_another_model_starts_cold(tmp_path, impl):
    first = Setup(tmp_path, impl, spec=vllm_spec(model="model-a"))
    stored = keys("model-a", 4)
    first.store(stored, pattern)
    first.manager.shutdown()

    # Another model, dtype, hash size or TP shape on the same file: nothing of it is served.
    for other in (vllm_spec(model="model-b"), vllm_spec(model="model-a", dtype="bfloat16"),
                  vllm_spec(model="model-a", tokens_per_hash=32),
                  vllm_spec(model="model-a", tp=2)):
        s = Setup(tmp_path, impl, spec=other)
        assert all(s.load(k) is None for k in stored), "another fingerprint is a miss"
        s.manager.shutdown()
    # Each of those reset the journal; model A's restart is cold too, and stores afresh.
    again = Setup(tmp_path, impl, spec=vllm_spec(model="model-a"))
    assert again.load(stored[0]) is None
    again.store(stored, pattern)
    again.manager.shutdown()
    warm = Setup(tmp_path, impl, spec=vllm_spec(model="model-a"))
    assert np.array_equal(warm.load(stored[0]), pattern(stored[0])), "the same model is warm"
    warm.manager.shutdown()


def test_a_tier_without_vllms_config_refuses_to_start(tmp_path):
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    with pytest.raises(ValueError, match="offloading_spec.config must be vLLM's OffloadingConfig"):
        KvbmDiskTier(MagicMock(), view, "kvbm_disk", path=str(tmp_path / "x"), capacity=4)
    with pytest.raises(ValueError, match="offloading_spec.config must be vLLM's OffloadingConfig"):
        KvbmObjectTier(MagicMock(), view, "kvbm_object", dir=str(tmp_path / "o"))


def test_a_damaged_slot_is_a_miss_never_wrong_bytes(tmp_path, impl):
    s = Setup(tmp_path, impl)
    victim = keys("victim", 1)
    s.store(victim, pattern)
    for i in range(2):
        s.store(keys(f"filler{i}", 4), pattern)
    # Flip bytes across the whole file: whichever slot holds the victim, its bytes are damaged.
    data = bytearray(s.path.read_bytes())
    for off in range(0, len(data), 1024):
        data[off] ^= 0xFF
    with open(s.path, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    got = s.load(victim[0])
    assert got is None or np.array_equal(got, pattern(victim[0])), "never wrong bytes"
    assert got is None, "the damaged copy is refused (the request recomputes)"
    s.manager.shutdown()


def test_a_disk_tier_without_an_idle_buffer_pool_round_trips_bytes(tmp_path, impl):
    s = Setup(tmp_path, impl, buffer_pool_mb=0)
    first = keys("nopool", 4)
    s.store(first, pattern)
    for i in range(3):
        s.store(keys(f"nopoolfill{i}", 4), pattern)
    assert all(s.primary.lookup(k, ReqContext(req_id="probe")) is LookupResult.MISS for k in first)
    for k in first:
        got = s.load(k)
        assert got is not None and np.array_equal(got, pattern(k)), "from the disk, its bytes"
    s.manager.shutdown()


def test_the_tier_stays_within_its_capacity(tmp_path, impl):
    s = Setup(tmp_path, impl, capacity=6)
    for i in range(5):
        s.store(keys(f"batch{i}", 4), pattern)
    assert s.tier._rs.num_ready() <= 6
    size = s.path.stat().st_size
    # 6 slots of one chunk plus kvbm's per-slot header: bounded, whatever was offered.
    assert size < 6 * 2 * CHUNK + 1024 * 1024, size
    s.manager.shutdown()


def test_the_disk_tier_reports_its_contents_as_vllm_events(tmp_path, impl):
    s = Setup(tmp_path, impl, capacity=6, enable_kv_events=True)
    first = keys("ev", 4)
    s.store(first, pattern)
    events = list(s.manager.take_events())
    mine = [e for e in events if e.ownership == "kvbm_disk"]
    assert [(set(e.keys), e.removed) for e in mine] == [(set(first), False)]
    assert all(e.medium.name == "STORAGE" for e in mine)
    from kvbm_vllm.contract import installed

    if installed().stored_event_context:
        # vLLM 0.34: a stored event names the request that stored it, the caller's own
        # object, on the primary's event and on the tier's alike (as vLLM's fs and obj tiers).
        stored = [e for e in events if not e.removed]
        assert all(e.req_context is not None for e in stored)
        assert len({id(e.req_context) for e in stored}) == 1, "one request stored them"
        assert stored[0].req_context.req_id == "r1"
    s.store(keys("ev2", 4), pattern)  # 8 chunks into 6 slots: the two oldest are evicted
    mine = [e for e in s.manager.take_events() if e.ownership == "kvbm_disk"]
    removed = [k for e in mine if e.removed for k in e.keys]
    stored = [k for e in mine if not e.removed for k in e.keys]
    assert set(stored) == set(keys("ev2", 4))
    assert len(removed) == 2 and set(removed) <= set(first), "the oldest chunks were evicted"
    assert list(s.manager.take_events()) == [], "each event is handed out once"
    s.manager.shutdown()


def test_touch_keeps_a_chunk_from_eviction(tmp_path, impl):
    from kvbm_vllm.contract import installed

    if not installed().has_touch:
        pytest.skip("vLLM 0.34 has no touch (its contract dropped it)")
    s = Setup(tmp_path, impl, capacity=6)
    first = keys("touch", 4)
    s.store(first, pattern)
    c = s.ctx()
    s.manager.touch([first[0]], c)  # vLLM forwards touch to every tier
    s.manager.on_request_finished(c)
    s.store(keys("touch2", 4), pattern)  # 8 chunks into 6 slots: two give way
    probe = ReqContext(req_id="probe")
    present = [k for k in first if s.tier.lookup(k, probe) is LookupResult.HIT]
    assert first[0] in present, "the touched chunk was kept"
    assert present == [first[0], first[3]], "the two oldest untouched gave way"
    s.manager.shutdown()


def test_configuration_errors_name_the_key(tmp_path):
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    with pytest.raises(ValueError, match="unknown key.*'capacity_gb'"):
        KvbmDiskTier(MagicMock(), view, "kvbm_disk", path=str(tmp_path / "x"), capacity=4,
                     capacity_gb=1)
    with pytest.raises(ValueError, match="missing required key.*capacity"):
        KvbmDiskTier(MagicMock(), view, "kvbm_disk", path=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="locality"):
        KvbmDiskTier(MagicMock(), view, "kvbm_disk", path=str(tmp_path / "x"), capacity=4,
                     locality="remote")
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="buffer_pool_mb must be an integer >= 0"):
            KvbmDiskTier(vllm_spec(), view, "kvbm_disk", path=str(tmp_path / "x"), capacity=4,
                         buffer_pool_mb=bad)


def test_the_plugin_registers_kvbm_disk_for_vllms_factory(tmp_path):
    import kvbm_vllm
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    kvbm_vllm.register()
    kvbm_vllm.register()  # vLLM loads plugins in every process; a second call is harmless
    assert SecondaryTierFactory.get_tier_class({"type": "kvbm_disk"}) is KvbmDiskTier
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "kvbm_disk", "path": str(tmp_path / "g3.bin"), "capacity": 4},
        view,
        vllm_spec(),
    )
    assert isinstance(tier, KvbmDiskTier) and tier.tier_type == "kvbm_disk"
    tier.shutdown()


class ObjectSetup(Setup):
    """As `Setup`, with a kvbm_object tier instead of the disk."""

    def __init__(self, tmp_path, impl="vllm", spec=None, **config):
        primary_cls, manager_cls = IMPLS[impl]
        self.region = np.zeros((PRIMARY, CHUNK), dtype=np.int8)
        mmap = MagicMock()
        mmap.create_kv_memoryview.return_value = memoryview(self.region)
        self.primary = primary_cls(num_chunks=PRIMARY, mmap_region=mmap)
        self.tier = KvbmObjectTier(
            offloading_spec=spec or vllm_spec(),
            primary_kv_view=self.primary.get_kv_memoryview(),
            tier_type="kvbm_object",
            **config,
        )
        self.manager = manager_cls(primary_tier=self.primary, secondary_tiers=[self.tier])
        self.n = 0


def _object_round_trip(s):
    first = keys("obj", 4)
    s.store(first, pattern)
    assert s.tier._rs.num_ready() == 4
    for i in range(3):
        s.store(keys(f"objfill{i}", 4), pattern)
    for k in first:
        got = s.load(k)
        assert got is not None and np.array_equal(got, pattern(k))
    s.manager.shutdown()


def test_object_tier_in_a_directory_round_trips_bytes(tmp_path, impl):
    _object_round_trip(ObjectSetup(tmp_path, impl, dir=str(tmp_path / "objects"), namespace="t1"))


def test_object_tier_on_s3_round_trips_bytes(tmp_path, monkeypatch, impl):
    endpoint = os.environ.get("KVBM_TEST_S3_ENDPOINT")
    if not endpoint:
        if os.environ.get("KVBM_TEST_SKIP_SERVICES") == "1":
            pytest.skip("KVBM_TEST_SKIP_SERVICES=1: no S3 server")
        pytest.fail("no S3 server: run through `cargo xtask python` or `cargo xtask ci`, which "
                    "start one (or export KVBM_TEST_S3_* from `cargo xtask services start`)")
    monkeypatch.setenv("KVBM_S3_KEY", os.environ["KVBM_TEST_S3_ACCESS_KEY"])
    monkeypatch.setenv("KVBM_S3_SECRET", os.environ["KVBM_TEST_S3_SECRET_KEY"])
    _object_round_trip(ObjectSetup(
        tmp_path,
        impl,
        bucket=os.environ["KVBM_TEST_S3_BUCKET"],
        endpoint=endpoint,
        namespace=f"kvbm-vllm-{os.getpid()}-{impl}",
        access_key_env="KVBM_S3_KEY",
        secret_key_env="KVBM_S3_SECRET",
    ))


def test_shared_object_tier_finds_what_another_instance_wrote(tmp_path, impl):
    shared = dict(dir=str(tmp_path / "objects"), namespace="fleet")
    writer = ObjectSetup(tmp_path, impl, **shared)
    stored = keys("fleet", 3)
    writer.store(stored, pattern)
    writer.manager.shutdown()

    # Another instance (its own managers and primary region), the same store and namespace.
    reader = ObjectSetup(tmp_path, impl, shared=True, **shared)
    for k in stored:
        got = reader.load(k)
        assert got is not None, "found in the shared store"
        assert np.array_equal(got, pattern(k)), "with the writer's bytes"
    assert reader.load(keys("nobody", 1)[0]) is None, "a key no instance wrote is a miss"
    # Without `shared`, an instance finds only its own objects.
    alone = ObjectSetup(tmp_path, impl, **shared)
    assert alone.load(stored[0]) is None
    reader.manager.shutdown()
    alone.manager.shutdown()


def test_object_tiers_of_other_models_share_a_store_without_matching(tmp_path, impl):
    shared = dict(dir=str(tmp_path / "objects"), namespace="fleet")
    writer = ObjectSetup(tmp_path, impl, spec=vllm_spec(model="model-a"), **shared)
    stored = keys("fleet", 3)
    writer.store(stored, pattern)
    writer.manager.shutdown()

    other = ObjectSetup(tmp_path, impl, spec=vllm_spec(model="model-b"), shared=True, **shared)
    assert all(other.load(k) is None for k in stored), "another model's objects are not seen"
    other.manager.shutdown()
    # TP=2 rows differ from TP=1 rows, unless vLLM says the bytes are parallelism-agnostic.
    tp2 = ObjectSetup(tmp_path, impl, spec=vllm_spec(model="model-a", tp=2), shared=True,
                      **shared)
    assert tp2.load(stored[0]) is None
    tp2.manager.shutdown()
    same = ObjectSetup(tmp_path, impl, spec=vllm_spec(model="model-a"), shared=True, **shared)
    for k in stored:
        assert np.array_equal(same.load(k), pattern(k)), "the same model finds them"
    same.manager.shutdown()
    # Each fingerprint's objects sit in their own folder of the namespace.
    folders = os.listdir(tmp_path / "objects" / "fleet")
    assert len(folders) == 1 and folders[0].startswith("fp-"), folders


def test_parallelism_agnostic_rows_are_shared_across_tp_shapes(tmp_path, impl):
    shared = dict(dir=str(tmp_path / "objects"), namespace="fleet")
    writer = ObjectSetup(tmp_path, impl, spec=vllm_spec(tp=2, agnostic=True), **shared)
    stored = keys("agnostic", 2)
    writer.store(stored, pattern)
    writer.manager.shutdown()
    reader = ObjectSetup(tmp_path, impl, spec=vllm_spec(tp=4, agnostic=True), shared=True,
                         **shared)
    for k in stored:
        assert np.array_equal(reader.load(k), pattern(k)), "TP=4 reads what TP=2 wrote"
    reader.manager.shutdown()


def test_object_tier_configuration_errors(tmp_path, monkeypatch):
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    with pytest.raises(ValueError, match="exactly one of bucket"):
        KvbmObjectTier(MagicMock(), view, "kvbm_object")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID"):
        KvbmObjectTier(MagicMock(), view, "kvbm_object", bucket="b")
    with pytest.raises(ValueError, match="unknown key.*'secret_key'"):
        KvbmObjectTier(MagicMock(), view, "kvbm_object", dir=str(tmp_path), secret_key="x")


def _transfer_threads():
    """This process's kvbm move threads: {thread id: nice value}."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("kvbm-transfer"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                # Field 19 is the nice value; the command name (field 2) may hold spaces.
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return out


def test_the_tiers_moves_run_io_nice_nicer_than_the_scheduler(tmp_path):
    before = set(_transfer_threads())
    s = Setup(tmp_path, io_nice=3)
    s.store(keys("nice", 4), pattern)  # the store's move ran on those threads
    mine = {t: n for t, n in _transfer_threads().items() if t not in before}
    assert mine, "the tier started its own move threads"
    want = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    assert set(mine.values()) == {want}, mine
    s.manager.shutdown()


def test_io_nice_is_checked_and_shared_by_the_tiers_over_one_region(tmp_path):
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    for bad in (-1, 20, 1.5, "10", True):
        with pytest.raises(ValueError, match="io_nice must be an integer in 0..19"):
            KvbmDiskTier(vllm_spec(), view, "kvbm_disk", path=str(tmp_path / "x"), capacity=4,
                         io_nice=bad)
    disk = KvbmDiskTier(vllm_spec(), view, "kvbm_disk", path=str(tmp_path / "d"), capacity=4,
                        io_nice=5)
    with pytest.raises(ValueError, match="another kvbm tier over this region.*io_nice 5"):
        KvbmObjectTier(vllm_spec(), view, "kvbm_object", dir=str(tmp_path / "o"), io_nice=6)
    same = KvbmObjectTier(vllm_spec(), view, "kvbm_object", dir=str(tmp_path / "o"), io_nice=5)
    same.shutdown()
    disk.shutdown()


def _s3_env(monkeypatch):
    endpoint = os.environ.get("KVBM_TEST_S3_ENDPOINT")
    if not endpoint:
        if os.environ.get("KVBM_TEST_SKIP_SERVICES") == "1":
            pytest.skip("KVBM_TEST_SKIP_SERVICES=1: no S3 server")
        pytest.fail("no S3 server: run through `cargo xtask python` or `cargo xtask ci`")
    monkeypatch.setenv("KVBM_S3_KEY", os.environ["KVBM_TEST_S3_ACCESS_KEY"])
    monkeypatch.setenv("KVBM_S3_SECRET", os.environ["KVBM_TEST_S3_SECRET_KEY"])
    return endpoint


def _object_tier(**cfg):
    view = memoryview(np.zeros((PRIMARY, CHUNK), dtype=np.int8))
    return KvbmObjectTier(vllm_spec(), view, "kvbm_object", access_key_env="KVBM_S3_KEY",
                          secret_key_env="KVBM_S3_SECRET", **cfg)


def test_an_unreachable_s3_endpoint_is_an_error_at_start(monkeypatch):
    """Nothing listens on the endpoint: the tier refuses to start, naming bucket and endpoint,
    instead of missing on every lookup (bounded by the store's retries)."""
    import socket

    monkeypatch.setenv("KVBM_S3_KEY", "k")
    monkeypatch.setenv("KVBM_S3_SECRET", "s")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match=rf"S3 bucket 'kv' at {endpoint} cannot be used"):
        _object_tier(bucket="kv", endpoint=endpoint)


def test_plain_http_off_loopback_is_refused_unless_allowed(monkeypatch):
    """An S3 endpoint over plain http off the loopback interface is refused, naming the key that
    allows it (an on-path party could read and change every chunk); the key is a strict
    boolean. (With it, the tier would go on to reach the endpoint.)"""
    monkeypatch.setenv("KVBM_S3_KEY", "k")
    monkeypatch.setenv("KVBM_S3_SECRET", "s")
    with pytest.raises(RuntimeError, match="physical.s3.allow_http"):
        _object_tier(bucket="kv", endpoint="http://192.0.2.7:9000")
    with pytest.raises(ValueError, match="allow_http"):
        _object_tier(bucket="kv", endpoint="http://192.0.2.7:9000", allow_http="yes")


def test_a_missing_s3_bucket_is_an_error_at_start(monkeypatch):
    endpoint = _s3_env(monkeypatch)
    with pytest.raises(RuntimeError, match="'kvbm-no-such-bucket' .* cannot be used"):
        _object_tier(bucket="kvbm-no-such-bucket", endpoint=endpoint)


def test_an_s3_tier_with_refused_credentials_is_an_error_at_start(monkeypatch):
    endpoint = _s3_env(monkeypatch)
    monkeypatch.setenv("KVBM_S3_SECRET", "not-the-secret")
    with pytest.raises(RuntimeError, match="cannot be used"):
        _object_tier(bucket=os.environ["KVBM_TEST_S3_BUCKET"], endpoint=endpoint)
