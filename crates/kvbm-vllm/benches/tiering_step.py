"""Benchmark: one scheduler step on the tiering manager, driven from Python, kvbm's vs vLLM's.

Not a test: it prints figures. The step is the one ``../shared/tools/vllm-manager-replay.py``
times for vLLM (and ``cargo xtask bench tiering`` for kvbm-tiering in Rust): under
``manager.lock``, 256 requests x 64 chunks, each request ``on_new_request``, a ``lookup`` of
every chunk, ``prepare_load``/``complete_load`` of the hits, ``prepare_store``/
``complete_store`` of the misses (which cascade to the tier), ``on_request_finished``; then
``on_schedule_end`` and ``get_stats``. Primary: 16384 chunks, LRU. Scenarios:

  cold     every chunk new: MISS everywhere, store + cascade, the primary evicts
  warm     every chunk resident in the primary: HIT, load
  promote  two sets alternate; the one asked for was pushed out of the primary but is in the
           tier: HIT_PENDING, promotion at on_schedule_end, completed at the next step's poll

Managers, each in the same process, alternating step by step so all see the same machine (in
an order that rotates each step, so none always runs right after the same other one):

  vllm                vLLM's Python TieringOffloadingManager (KVBM_VLLM_VERSION: 0.33.0 or 0.34.0) over a Python in-memory
                      tier (vllm-manager-replay.py's ``MemTier``: a set of keys, every job
                      reported finished at the next poll)
  kvbm+python-tier    kvbm's TieringOffloadingManager over the same Python tier (a vLLM user
                      who keeps their own Python tiers)
  kvbm+disk           kvbm's TieringOffloadingManager over kvbm's ``kvbm_disk`` tier driven in
                      Rust (real writes and reads of a file in a temporary directory, off the
                      scheduler thread, on I/O threads at the tier's ``io_nice``; they run
                      during the step too, so on a machine with few cores its wall time counts
                      what they take from the scheduler thread)
  floor               no manager: the bench's own loop around a stand-in that only makes the
                      Python tier's own calls as a tiering manager makes them (its on_new_request
                      and on_request_finished per request, its lookup per chunk the primary
                      misses, a store job per request cascaded, a load job per promoting
                      request, get_finished_jobs per prepare_store and step) with the least
                      glue: what every manager over this Python tier pays, so vLLM / floor is
                      the most any such manager's ratio can be

With ``--phases`` each step is also split by phase (the clock read at phase boundaries only, a
few readings per request, for every manager alike): ``request`` (on_new_request,
on_request_finished), ``lookup``, ``load`` (prepare_load, complete_load), ``store``
(prepare_store, complete_store), ``schedule_end`` (on_schedule_end, get_stats); and each kvbm
manager's time above the floor is printed per phase with its share, which says where kvbm's
own time goes. (A phase may come out negative: the floor makes a tier call there that a manager
makes in another phase, e.g. promote's load job, which the floor queues in ``prepare_load`` and
a manager at its ``lookup``'s HIT_PENDING.)

Usage (after ``cargo xtask python`` built the wheel into target/pyvenv and fetched vLLM's
sources):

  target/pyvenv/bin/python crates/kvbm-vllm/benches/tiering_step.py [--steps 6] [--phases]
"""

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from unittest.mock import MagicMock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cpu_step  # noqa: E402  (load_vllm: vLLM's sources and the stubs)

REQUESTS = 256
CHUNKS = 64
CAPACITY = 16384
ROW = 64  # bytes per primary chunk (the managers only read the row stride)


def main():
    tmp = tempfile.mkdtemp(prefix="kvbm-tiering-step-")
    try:
        return run(tmp)
    finally:
        # Each kvbm_disk tier's file is its whole capacity (half a GiB here): never left behind.
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6,
                    help="measured steps per scenario (a multiple of the number of managers "
                         "gives each the same share of each position in the rotation)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kinds", default="vllm,kvbm+python-tier,kvbm+disk,floor",
                    help="managers to run, comma-separated (ratios need vllm)")
    ap.add_argument("--scenarios", default="cold,warm,promote")
    ap.add_argument("--phases", action="store_true",
                    help="split each step by phase and print kvbm's time above the floor per "
                         "phase (module docs)")
    ap.add_argument("--json", default=None,
                    help="also write the figures to this file: per scenario, per manager the "
                         "median wall and CPU milliseconds, and with --phases each kvbm "
                         "manager's milliseconds above the floor per phase (`cargo xtask bench "
                         "vllm --against REV` reads it)")
    ap.add_argument("--io-nice", type=int, default=None,
                    help="kvbm+disk's io_nice key (default: the tier's own default, 10; 0 runs "
                         "its I/O threads at the scheduler's priority)")
    args = ap.parse_args()
    cpu_step.load_vllm()

    import numpy as np
    from vllm.v1.kv_offload import base as B
    from vllm.v1.kv_offload.tiering import base as TB
    from vllm.v1.kv_offload.tiering import manager as VM

    from kvbm_vllm import upstream_compat as K
    from kvbm_vllm.tiers import KvbmDiskTier, standalone_spec

    class MemTier(TB.SecondaryTierManager):
        medium = B.Medium.CPU

        def __init__(self, view):
            super().__init__(offloading_spec=None, primary_kv_view=view, tier_type="mem")
            self.keys = set()
            self.done = []

        def lookup(self, key, req_context):
            return B.LookupResult.HIT if key in self.keys else B.LookupResult.MISS

        def submit_store(self, job):
            self.keys.update(job.keys)
            self.done.append(TB.JobResult(job_id=job.job_id, success=True, transfer_time=0.0))

        def submit_load(self, job):
            ok = all(k in self.keys for k in job.keys)
            self.done.append(TB.JobResult(job_id=job.job_id, success=ok, transfer_time=0.0))

        def get_finished_jobs(self):
            done, self.done = self.done, []
            return done

        def on_new_request(self, req_context):
            return B.RequestOffloadingContext()

        def drain_jobs(self):
            return

    class Floor:
        """The ``floor`` kind (module docs): the Python tier's own calls, nothing else."""

        def __init__(self, scenario, view):
            self.lock = threading.Lock()
            self.tier = MemTier(view)
            self.scenario = scenario
            self.job_id = 0
            self.loads = []
            # A chunk the primary holds is answered without the tier (C-level: the loop's own
            # cost); otherwise the tier's own lookup answers (MISS, or HIT where a manager
            # answers HIT_PENDING and promotes).
            self.warm = {}
            self.lookup = self.warm.get if scenario == "warm" else self.tier.lookup

        def _job(self, keys, ctx, promotion):
            self.job_id += 1
            return TB.TransferJob(job_id=self.job_id, keys=keys,
                                  chunk_ids=np.empty(len(keys), dtype=np.int64),
                                  is_promotion=promotion, req_context=ctx)

        def on_new_request(self, ctx):
            return self.tier.on_new_request(ctx)

        def prepare_load(self, keys, ctx):
            if self.scenario == "promote":
                self.loads.append(self._job(keys, ctx, True))

        def complete_load(self, keys, ctx):
            pass

        def prepare_store(self, keys, ctx):
            self.tier.get_finished_jobs()
            return B.PrepareStoreOutput(keys_to_store=keys, store_spec=None, evicted_keys=[])

        def complete_store(self, keys, ctx, success=True):
            self.tier.submit_store(self._job(keys, ctx, False))

        def on_request_finished(self, ctx):
            self.tier.on_request_finished(ctx)

        def on_schedule_end(self, ctx):
            for job in self.loads:
                self.tier.submit_load(job)
            self.loads = []
            self.tier.get_finished_jobs()
            self.tier.on_schedule_end(ctx)

        def get_stats(self):
            return self.tier.get_stats()

        def has_pending_work(self):
            return False

        def shutdown(self):
            pass

    def build(kind, scenario):
        region = np.zeros((CAPACITY, ROW), dtype=np.int8)
        if kind == "floor":
            f = Floor(scenario, memoryview(region))
            return f
        mmap = MagicMock()
        mmap.create_kv_memoryview.return_value = memoryview(region)
        if kind == "vllm":
            primary = VM.CPUPrimaryTierOffloadingManager(num_chunks=CAPACITY, mmap_region=mmap)
            tier = MemTier(primary.get_kv_memoryview())
            return VM.TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
        primary = K.CPUPrimaryTierOffloadingManager(num_chunks=CAPACITY, mmap_region=mmap)
        if kind == "kvbm+python-tier":
            tier = MemTier(primary.get_kv_memoryview())
        else:
            tier = KvbmDiskTier(
                offloading_spec=standalone_spec("bench-model", "int8", ROW),
                primary_kv_view=primary.get_kv_memoryview(),
                tier_type="kvbm_disk", path=os.path.join(tmp, f"{kind}-{time.monotonic_ns()}.bin"),
                capacity=4 * CAPACITY, direct_io=False,
                **({} if args.io_nice is None else {"io_nice": args.io_nice}),
            )
        return K.TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])

    HIT, MISS = B.LookupResult.HIT, B.LookupResult.MISS
    step_no = [0]

    PHASES = ("request", "lookup", "load", "store", "schedule_end")

    def lookup_all(m, keys, ctx, seen):
        """A request's lookups: its hits and misses (every answer appended to ``seen``)."""
        hits, misses = [], []
        for k in keys:
            r = m.lookup(k, ctx)
            seen.append(r)
            if r is HIT:
                hits.append(k)
            elif r is MISS:
                misses.append(k)
        return hits, misses

    def load_hits(m, hits, ctx):
        m.prepare_load(hits, ctx)
        m.complete_load(hits, ctx)

    def store_misses(m, misses, ctx):
        out = m.prepare_store(misses, ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx, True)

    def run_step(m, reqs, counts, phases=None):
        """One step; with ``phases`` (a dict), its time by phase is added there."""
        if phases is not None:
            return run_step_timed(m, reqs, phases)
        new_ids = []
        seen = []  # every lookup's answer, tallied after the step (off the clock)
        with m.lock:
            for i, keys in enumerate(reqs):
                rid = f"s{step_no[0]}r{i}"
                ctx = B.ReqContext(req_id=rid)
                m.on_new_request(ctx)
                new_ids.append(rid)
                hits, misses = lookup_all(m, keys, ctx, seen)
                if hits:
                    load_hits(m, hits, ctx)
                if misses:
                    store_misses(m, misses, ctx)
                m.on_request_finished(ctx)
            m.on_schedule_end(B.ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=()))
            m.get_stats()
        step_no[0] += 1
        return seen

    def run_step_timed(m, reqs, ph):
        """``run_step`` with the clock read at each phase boundary (``--phases``)."""
        pc = time.perf_counter
        request = lookup = load = store = 0.0
        new_ids = []
        seen = []
        with m.lock:
            for i, keys in enumerate(reqs):
                rid = f"s{step_no[0]}r{i}"
                ctx = B.ReqContext(req_id=rid)
                t = pc()
                m.on_new_request(ctx)
                u = pc()
                request += u - t
                new_ids.append(rid)
                hits, misses = lookup_all(m, keys, ctx, seen)
                t = pc()
                lookup += t - u
                if hits:
                    load_hits(m, hits, ctx)
                    u = pc()
                    load += u - t
                    t = u
                if misses:
                    store_misses(m, misses, ctx)
                    u = pc()
                    store += u - t
                    t = u
                m.on_request_finished(ctx)
                request += pc() - t
            t = pc()
            m.on_schedule_end(B.ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=()))
            m.get_stats()
            end = pc() - t
        step_no[0] += 1
        for name, v in zip(PHASES, (request, lookup, load, store, end)):
            ph[name] = ph.get(name, 0.0) + v
        return seen

    def tally(seen, counts):
        for r in seen:
            counts[r.name] = counts.get(r.name, 0) + 1

    def keyset(tag, n):
        return [B.make_offload_key(f"{tag}-{i}".encode(), 0) for i in range(n)]

    def split(keys):
        return [keys[i * CHUNKS:(i + 1) * CHUNKS] for i in range(REQUESTS)]

    def settle(m):
        """Lets the disk tier's writes land (off the clock), as a step or two would."""
        for _ in range(2000):
            if not m.has_pending_work():
                return
            m.on_schedule_end(B.ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
            time.sleep(0.001)

    per_step = REQUESTS * CHUNKS
    kinds = tuple(args.kinds.split(","))
    results = {}
    for scenario in args.scenarios.split(","):
        managers = {k: build(k, scenario) for k in kinds}
        counts = {k: {} for k in kinds}
        times = {k: [] for k in kinds}
        cpu = {k: [] for k in kinds}
        phases = {k: [] for k in kinds}
        sets = {}
        for k, m in managers.items():
            if scenario == "warm":
                sets[k] = keyset("warm", per_step)
                if k == "floor":
                    m.warm.update((key, HIT) for key in sets[k])
                run_step(m, split(sets[k]), {})
            elif scenario == "promote":
                a, b = keyset("pa", per_step), keyset("pb", per_step)
                sets[k] = (a, b)
                run_step(m, split(a), {})
                settle(m)
                run_step(m, split(b), {})
                settle(m)
        for s in range(args.warmup + args.steps):
            # The order rotates each step: a manager's step finds the caches as the one before
            # it left them (vLLM's step leaves them full of its own objects), so each manager
            # follows each of the others equally often rather than always the same one.
            order = kinds[s % len(kinds):] + kinds[:s % len(kinds)]
            for k in order:
                m = managers[k]
                if scenario == "cold":
                    keys = keyset(f"cold{s}", per_step)
                elif scenario == "warm":
                    keys = sets[k]
                else:
                    keys = sets[k][s % 2]
                c = counts[k] if s >= args.warmup else {}
                ph = {} if args.phases else None
                gc.collect()
                c0 = time.thread_time()
                t0 = time.perf_counter()
                seen = run_step(m, split(keys), c, ph)
                dt = time.perf_counter() - t0
                dc = time.thread_time() - c0
                tally(seen, c)
                if s >= args.warmup:
                    times[k].append(dt)
                    cpu[k].append(dc)
                    if ph is not None:
                        phases[k].append(ph)
                settle(m)
        for m in managers.values():
            m.shutdown()
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        results[scenario] = {
            "wall_ms": {k: v * 1e3 for k, v in med.items()},
            "cpu_ms": {k: v * 1e3 for k, v in med_cpu.items()},
        }
        for label, fig in (("", med), ("  cpu", med_cpu)):
            v = fig.get("vllm")
            print(f"{scenario + label:13s} " + "  ".join(
                f"{k} {fig[k] * 1e3:8.2f} ms"
                + ("" if k == "vllm" or v is None else f" ({v / fig[k]:5.1f}x)")
                for k in kinds
            ))
        print("         lookups: " + "; ".join(
            f"{k} {dict(sorted(counts[k].items()))}" for k in kinds
        ))
        if args.phases and "floor" in kinds:
            # Per phase, the median over steps; kvbm's time above the floor, and its share.
            mp = {k: {p: statistics.median(st[p] for st in v) for p in PHASES}
                  for k, v in phases.items() if v}
            for k in kinds:
                if k in ("floor", "vllm") or k not in mp:
                    continue
                above = {p: mp[k][p] - mp["floor"][p] for p in PHASES}
                total = sum(above.values())
                results[scenario].setdefault("above_floor_ms", {})[k] = dict(
                    {p: v * 1e3 for p, v in above.items()}, total=total * 1e3)
                print(f"         {k} above the floor {total * 1e3:6.2f} ms: " + ", ".join(
                    f"{p} {above[p] * 1e3:5.2f} ms ({above[p] / total if total else 0:4.0%})"
                    for p in PHASES
                ))
    print(f"(median of {args.steps} steps after {args.warmup} warm-up; "
          f"{REQUESTS}x{CHUNKS} chunks per step; ratio = vLLM / kvbm; first line wall time, "
          f"'cpu' the scheduler thread's own CPU time, which a core taken away from this "
          f"shared machine mid-step does not inflate; kvbm_disk's I/O threads are not in it)")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
