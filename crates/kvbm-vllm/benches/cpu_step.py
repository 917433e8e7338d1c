"""Benchmark: one scheduler step on the CPU manager, driven from Python, kvbm's vs vLLM's.

Not a test: it prints figures. Both managers are driven through the same Python calls vLLM's
scheduler makes (``lookup`` per chunk, then ``prepare_store``/``complete_store`` of the misses
and ``prepare_load``/``complete_load`` of the hits, per request), in the same process, the
two alternating rep by rep so both see the same machine. One step = 256 requests x 64 chunks on
a 16384-chunk LRU manager:

  cold  -- every chunk new: MISS, store (the manager evicts once full)
  warm  -- every chunk resident: HIT, load

Usage (after ``cargo xtask python`` built the wheel into target/pyvenv and fetched vLLM's
sources):

  target/pyvenv/bin/python crates/kvbm-vllm/benches/cpu_step.py [--reps 7]

The figure the issue asks for is the tiering manager's step; this is the CPU manager's, the
part of kvbm-vllm built so far.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
UPSTREAM = os.path.join(HERE, "..", "tests", "upstream")

REQUESTS = 256
CHUNKS = 64
CAPACITY = 16384


def load_vllm():
    sys.path.insert(0, UPSTREAM)
    import fetch
    import stubs

    cache = os.path.join(REPO, "target", "peer", "vllm-sdist")
    fetch.ensure_pydeps(os.path.join(cache, "pydeps"), offline=True)
    # The extraction of the vLLM asked for (KVBM_VLLM_VERSION, as the test suites), else of
    # the harness's default; `cargo xtask python` makes both.
    version = os.environ.get("KVBM_VLLM_VERSION", fetch.DEFAULT_VERSION)
    stubs.install(os.path.join(cache, version))


def step(manager, contexts, keys, LookupResult):
    hit = LookupResult.HIT
    for ctx, ks in zip(contexts, keys):
        manager.on_new_request(ctx)
        hits, misses = [], []
        for k in ks:
            (hits if manager.lookup(k, ctx) is hit else misses).append(k)
        if hits:
            manager.prepare_load(hits, ctx)
            manager.complete_load(hits, ctx)
        if misses:
            out = manager.prepare_store(misses, ctx)
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    manager.get_stats()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    load_vllm()
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as Vllm

    from kvbm_vllm.upstream_compat import CPUOffloadingManager as Kvbm

    def keyset(tag):
        return [
            [make_offload_key(f"{tag}-{r}-{c}".encode(), 0) for c in range(CHUNKS)]
            for r in range(REQUESTS)
        ]

    results = {}
    for scenario in ("cold", "warm"):
        times = {"vllm": [], "kvbm": []}
        for rep in range(args.reps):
            for name, cls in (("vllm", Vllm), ("kvbm", Kvbm)):
                m = cls(num_chunks=CAPACITY, cache_policy="lru")
                keys = keyset(f"r{rep}")
                if scenario == "warm":
                    warm_ctx = [ReqContext(req_id=f"w{r}") for r in range(REQUESTS)]
                    step(m, warm_ctx, keys, LookupResult)
                ctxs = [ReqContext(req_id=f"s{r}") for r in range(REQUESTS)]
                t0 = time.perf_counter()
                step(m, ctxs, keys, LookupResult)
                times[name].append(time.perf_counter() - t0)
        v, k = statistics.median(times["vllm"]), statistics.median(times["kvbm"])
        results[scenario] = (v, k)
        print(
            f"{scenario:5s}  vLLM {v * 1e3:8.2f} ms   kvbm {k * 1e3:8.2f} ms   "
            f"vLLM/kvbm {v / k:5.1f}x   (median of {args.reps}, {REQUESTS}x{CHUNKS} chunks)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
