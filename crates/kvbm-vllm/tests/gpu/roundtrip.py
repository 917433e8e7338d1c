"""The GPU check: KV bytes from GPU memory, through kvbm's manager and vLLM's shared region,
down to kvbm's disk tier and back to the GPU, compared byte for byte.

Run on a machine with a CUDA GPU and torch (and without vLLM: its sources come extracted from
the sdist, as for the CPU tests). ``run.sh`` beside this file installs what ``prepare.sh``
collected and runs it; the results are printed and written as JSON.

What is real and what stands in
-------------------------------
Real: torch on the GPU (the KV cache: one int8 tensor per layer, random bytes); vLLM 0.33's
``OffloadingSpecFactory``, ``SharedOffloadRegion`` (the /dev/shm region, scheduler and worker
mappings), ``CPUOffloadingWorker`` (its copy plans, its pinning of the region with
``cudaHostRegister``, its streams and events, its Triton kernel for CPU->GPU batches of small
pages); kvbm's ``KvbmOffloadingSpec`` and Rust manager, its ``kvbm_disk`` tier on O_DIRECT
files (where the filesystem takes O_DIRECT) and its ``kvbm_object`` tier in a directory.

Standing in for vLLM's compiled parts, which its sdist does not build: ``vllm._custom_ops
.swap_blocks_batch`` (vLLM's C++ batch copy: one ``cudaMemcpyAsync`` per descriptor here, on
the same stream), ``vllm.platforms.current_platform`` (CUDA, over torch.cuda), the CUDA runtime
wrapper that pins the region (``cudaHostRegister`` through ctypes), ``PIN_MEMORY`` (true) and
``vllm.triton_utils`` (the machine's Triton). The rest of vLLM's heavy modules are the CPU
harness's stubs (``tests/upstream/stubs.py``).

The flow (each arrow is a real call; ``==`` is ``torch.equal`` on the GPU)::

    GPU blocks A ──worker.submit_store──▶ region rows that kvbm's prepare_store chose
                                           │ kvbm cascades them to kvbm_disk (O_DIRECT)
    region rows ──worker.submit_load──▶ fresh GPU blocks == A      (1: primary hits)
    store more chunks than the primary holds: A leaves the primary (lookup misses there)
    kvbm promotes A from the disk ──▶ region ──worker.submit_load──▶ GPU == A   (2: promoted)
    a new manager and worker over the same disk file (a restart)
    kvbm promotes A from the warm disk ──▶ region ──▶ GPU == A                   (3: warm)
    another instance with an empty disk, the same object store (a directory, shared)
    kvbm promotes A from kvbm_object ──▶ region ──▶ GPU == A                     (4: G4)

Every check that fails is printed and makes the exit status 1.
"""

import argparse
import ctypes
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
import uuid

LAYERS = 4
PAGE = 16 * 1024  # bytes per layer per GPU block: under vLLM's Triton threshold (28 KiB)
GPU_BLOCKS = 2048
PRIMARY_CHUNKS = 256  # one chunk = one block of every layer (blocks_per_chunk = 1)
DISK_CHUNKS = 2048
KEYS = 96  # chunks of A


def parse():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.abspath(os.path.join(here, "..", "..", "..", ".."))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-src", default=os.path.join(repo, "target", "peer", "vllm-sdist",
                                                      "0.33.0"))
    p.add_argument("--stubs", default=os.path.join(here, "..", "upstream", "stubs.py"))
    p.add_argument("--dir", default=None, help="where the disk tier's file goes (default: a "
                   "new temporary directory)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    return p.parse_args()


# ------------------------------------------------------------------------------------------
# CUDA stand-ins for vLLM's compiled parts
# ------------------------------------------------------------------------------------------
class CudaRT:
    """The CUDA runtime that torch loaded (found in /proc/self/maps), through ctypes; cupy's
    runtime bindings when torch's cudart cannot be found that way."""

    def __init__(self, torch):
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context exists from here on
        path = None
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                name = line.split()[-1]
                if "libcudart.so" in os.path.basename(name):
                    path = name
                    break
        self.source = path
        self._cupy = None
        if path is None:
            import cupy  # noqa: F401 (the fallback)
            from cupy.cuda import runtime

            self._cupy = runtime
            self.source = f"cupy {cupy.__version__}"
            return
        lib = ctypes.CDLL(path)
        c = ctypes
        lib.cudaMemcpyAsync.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
        lib.cudaHostRegister.argtypes = [c.c_void_p, c.c_size_t, c.c_uint]
        lib.cudaHostUnregister.argtypes = [c.c_void_p]
        for f in (lib.cudaMemcpyAsync, lib.cudaHostRegister, lib.cudaHostUnregister,
                  lib.cudaGetLastError):
            f.restype = c.c_int
        self._lib = lib

    def memcpy_async(self, dst, src, n, stream):
        if self._cupy is not None:
            self._cupy.memcpyAsync(dst, src, n, 4, stream)  # 4: cudaMemcpyDefault
            return
        rc = self._lib.cudaMemcpyAsync(dst, src, n, 4, stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync({dst:#x} <- {src:#x}, {n}) failed: {rc}")

    def host_register(self, ptr, n):
        if self._cupy is not None:
            try:
                self._cupy.hostRegister(ptr, n, 0)
                return 0
            except self._cupy.CUDARuntimeError as e:
                return int(getattr(e, "status", 1)) or 1
        return self._lib.cudaHostRegister(ptr, n, 0)

    def host_unregister(self, ptr):
        if self._cupy is not None:
            try:
                self._cupy.hostUnregister(ptr)
                return 0
            except self._cupy.CUDARuntimeError as e:
                return int(getattr(e, "status", 1)) or 1
        return self._lib.cudaHostUnregister(ptr)

    def get_last_error(self):
        return 0 if self._cupy is not None else self._lib.cudaGetLastError()


def install_cuda_standins(torch, rt, stubs, counts):
    """sys.modules entries for the vLLM modules that are compiled or platform-specific."""
    import triton

    plat = types.ModuleType("vllm.platforms")

    class CudaPlatform(stubs._StubPlatform):
        """The CPU harness's CUDA platform, with torch.cuda's streams."""

        Stream = torch.cuda.Stream

        def current_stream(self):
            return torch.cuda.current_stream()

        def stream(self, s):
            return torch.cuda.stream(s)

    plat.current_platform = CudaPlatform()
    sys.modules["vllm.platforms"] = plat

    ops = types.ModuleType("vllm._custom_ops")

    def swap_blocks_batch(src_addrs, dst_addrs, sizes, is_src_access_order_any=False):
        """vLLM's C++ op copies a batch of (src, dst, size) descriptors on the current stream
        (cuMemcpyBatchAsync); here one cudaMemcpyAsync each, on the same stream."""
        stream = torch.cuda.current_stream().cuda_stream
        n = 0
        for s, d, size in zip(src_addrs.tolist(), dst_addrs.tolist(), sizes.tolist()):
            rt.memcpy_async(d, s, size, stream)
            n += 1
        counts["dma_batches"] += 1
        counts["dma_descriptors"] += n

    ops.swap_blocks_batch = swap_blocks_batch
    sys.modules["vllm._custom_ops"] = ops

    tu = types.ModuleType("vllm.triton_utils")
    tu.HAS_TRITON = True
    tu.triton = triton
    tu.tl = triton.language
    sys.modules["vllm.triton_utils"] = tu

    torch_utils = stubs.StubModule("vllm.utils.torch_utils")
    stubs._fill_torch_utils(torch_utils)
    torch_utils.PIN_MEMORY = True
    sys.modules["vllm.utils.torch_utils"] = torch_utils

    cw = types.ModuleType("vllm.distributed.device_communicators.cuda_wrapper")

    class CudaRTLibrary:
        def cudaHostRegister(self, ptr, n):  # noqa: N802 (vLLM's names)
            return rt.host_register(ptr, n)

        def cudaHostUnregister(self, ptr):  # noqa: N802
            return rt.host_unregister(ptr)

        def cudaGetLastError(self):  # noqa: N802
            return rt.get_last_error()

    cw.CudaRTLibrary = CudaRTLibrary
    sys.modules["vllm.distributed.device_communicators.cuda_wrapper"] = cw


def o_direct_works(directory):
    """Whether the filesystem under `directory` takes an O_DIRECT write (tmpfs does not); any
    other error than its refusal (EINVAL) is raised."""
    import errno
    import mmap

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".o_direct_probe")
    buf = mmap.mmap(-1, 4096)  # page aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            return os.write(fd, buf) == 4096
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)


# ------------------------------------------------------------------------------------------
# the check
# ------------------------------------------------------------------------------------------
class Failed(Exception):
    pass


def main():
    args = parse()
    results = {"checks": [], "counts": {"dma_batches": 0, "dma_descriptors": 0,
                                        "triton_batches": 0}}
    failures = []

    def check(name, ok, detail=""):
        results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        if not ok:
            failures.append(name)

    spec = importlib.util.spec_from_file_location("_kvbm_upstream_stubs", args.stubs)
    stubs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stubs)
    stubs.install(os.path.abspath(args.vllm_src), real=("torch", "triton"))

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one", file=sys.stderr)
        return 2
    rt = CudaRT(torch)
    counts = results["counts"]
    install_cuda_standins(torch, rt, stubs, counts)
    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    results["cudart"] = rt.source
    print(f"device {results['device']}, torch {torch.__version__}, cudart {rt.source}",
          flush=True)

    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.cpu import gpu_worker, swap_blocks_triton
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kvbm_vllm
    from kvbm_vllm.spec import KvbmOffloadingSpec
    from kvbm_vllm.tiers import standalone_spec

    results["kvbm_vllm"] = getattr(kvbm_vllm, "__version__", "?")

    # Count the Triton kernel's batches: gpu_worker binds the name when a handler is built.
    real_triton_swap = gpu_worker.swap_blocks_batch

    def counted_triton_swap(*a, **kw):
        if a[0].numel() >= swap_blocks_triton.MIN_N:
            counts["triton_batches"] += 1
        return real_triton_swap(*a, **kw)

    gpu_worker.swap_blocks_batch = counted_triton_swap

    workdir = args.dir or tempfile.mkdtemp(prefix="kvbm-gpu-check-")
    disk_path = os.path.join(workdir, "g3.bin")
    objects = os.path.join(workdir, f"g4-{uuid.uuid4().hex}")
    direct_io = o_direct_works(workdir)
    results["direct_io"] = direct_io
    mode = "on" if direct_io else "refused by the filesystem: buffered"
    print(f"disk tier in {workdir}, O_DIRECT {mode}", flush=True)
    layer_names = tuple(f"layer{i}" for i in range(LAYERS))

    # vLLM's OffloadingConfig for one KV group of LAYERS layers, a chunk a block of each.
    base_config = standalone_spec("gpu-check", "bfloat16", LAYERS * PAGE,
                                  layer_names=layer_names).config

    def make_config(disk):
        return dataclasses.replace(
            base_config,
            extra_config={
                "spec_name": "KvbmOffloadingSpec",
                "spec_module_path": "kvbm_vllm.spec",
                "cpu_bytes_to_use": PRIMARY_CHUNKS * LAYERS * PAGE,
                "secondary_tiers": [
                    {"type": "KvbmDiskTier", "module_path": "kvbm_vllm.tiers", "path": disk,
                     "capacity": DISK_CHUNKS, "direct_io": direct_io},
                    {"type": "KvbmObjectTier", "module_path": "kvbm_vllm.tiers",
                     "dir": objects, "namespace": "gpu-check", "shared": True},
                ],
            },
            engine_id=f"kvbm-gpu-check-{uuid.uuid4().hex}",
        )

    # The KV cache: one int8 tensor per layer, (blocks, page bytes), random on the GPU.
    gen = torch.Generator(device="cuda").manual_seed(1234)
    kv = [torch.randint(0, 256, (GPU_BLOCKS, PAGE), dtype=torch.int32, device="cuda",
                        generator=gen).to(torch.uint8).view(torch.int8) for _ in range(LAYERS)]
    kv_caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE)
                          for i in range(LAYERS)]],
    )

    class Engine:
        """vLLM's scheduler (kvbm's manager) and worker (vLLM's CPUOffloadingWorker)."""

        def __init__(self, disk=disk_path):
            self.spec = OffloadingSpecFactory.create_spec(make_config(disk))
            if not isinstance(self.spec, KvbmOffloadingSpec):
                raise Failed(f"the factory built {type(self.spec).__name__}")
            self.m = self.spec.get_manager()
            self.w = self.spec.get_worker(kv_caches)
            self.jobs = 0
            self.n = 0

        def step(self):
            self.m.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

        def ctx(self):
            self.n += 1
            c = ReqContext(req_id=f"r{self.n}")
            self.m.on_new_request(c)
            return c

        def run(self, submit):
            self.jobs += 1
            job = self.jobs
            if not submit(job):
                raise Failed(f"the worker refused job {job}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for r in self.w.get_finished():
                    if r.job_id == job:
                        if not r.success:
                            raise Failed(f"job {job} failed on the worker")
                        return
                time.sleep(0.0005)
            raise Failed(f"job {job} never finished")

        def settle(self):
            for _ in range(20000):
                self.step()
                if not self.m.has_pending_work():
                    return
                time.sleep(0.001)
            raise Failed("the manager never settled (its tiers' jobs)")

        def store(self, keys, gpu_blocks):
            """Stores the chunks `keys` whose KV is in `gpu_blocks` (one block per chunk)."""
            where = dict(zip(keys, gpu_blocks))
            c = self.ctx()
            out = self.m.prepare_store(keys, c)
            if out is None:
                raise Failed("prepare_store refused the store")
            todo = list(out.keys_to_store)
            if todo:
                src = GPULoadStoreSpec([where[k] for k in todo], group_sizes=[len(todo)],
                                       block_indices=[0])
                self.run(lambda job: self.w.submit_store(job, src, out.store_spec))
                self.m.complete_store(todo, c)
            self.m.on_request_finished(c)
            self.settle()
            return len(todo)

        def load(self, keys, gpu_blocks):
            """Loads `keys` into `gpu_blocks`, waiting while kvbm promotes them; None on a
            miss."""
            c = self.ctx()
            for _ in range(20000):
                res = [self.m.lookup(k, c) for k in keys]
                if all(r is LookupResult.HIT for r in res):
                    break
                if any(r is LookupResult.MISS for r in res):
                    self.m.on_request_finished(c)
                    self.step()
                    return None
                self.step()
                time.sleep(0.001)
            else:
                raise Failed("the lookups never resolved")
            src = self.m.prepare_load(keys, c)
            dst = GPULoadStoreSpec(list(gpu_blocks), group_sizes=[len(keys)],
                                   block_indices=[0])
            self.run(lambda job: self.w.submit_load(job, src, dst))
            self.m.complete_load(keys, c)
            self.m.on_request_finished(c)
            self.step()
            return True

        def primary_has(self, key):
            return self.m.primary_tier.lookup(key, ReqContext(req_id="probe")) \
                is LookupResult.HIT

        def close(self):
            self.m.shutdown()
            self.w.shutdown()

    def same(src_blocks, dst_blocks):
        s = torch.tensor(list(src_blocks), device="cuda")
        d = torch.tensor(list(dst_blocks), device="cuda")
        return all(torch.equal(t.index_select(0, s), t.index_select(0, d)) for t in kv)

    def poison(blocks):
        idx = torch.tensor(list(blocks), device="cuda")
        for t in kv:
            t.index_fill_(0, idx, 0x5A)

    keys_a = [make_offload_key(f"A-{i}".encode(), 0) for i in range(KEYS)]
    blocks_a = list(range(KEYS))
    dst = list(range(1024, 1024 + KEYS))
    try:
        eng = Engine()
        region = eng.w._mmap_region
        check("vLLM's worker pinned the shared region (cudaHostRegister)",
              region is not None and region.is_pinned)
        check("kvbm's manager is the scheduler side",
              type(eng.m).__module__.startswith("kvbm_vllm"), type(eng.m).__qualname__)
        fn = eng.w._load_handler._swap_blocks_batch
        check("vLLM chose its Triton kernel for CPU->GPU batches",
              isinstance(fn, __import__("functools").partial), repr(fn)[:80])

        # 1: store A, read it back from the primary.
        stored = eng.store(keys_a, blocks_a)
        check("prepare_store took every chunk of A", stored == KEYS, f"{stored}/{KEYS}")
        poison(dst)
        hit = eng.load(keys_a, dst)
        check("1: A comes back from the primary, bytes equal on the GPU",
              hit and same(blocks_a, dst))
        check("the comparison sees other bytes (A against the blocks stored next)",
              not same(blocks_a[:8], range(256, 264)))
        poison(dst[:1])
        hit = eng.load(keys_a[:1], dst[:1])  # 4 descriptors: under MIN_N, vLLM's DMA path
        check("1b: one chunk from the primary (the DMA path), bytes equal",
              hit and same(blocks_a[:1], dst[:1]))

        # Push A out of the primary: more chunks than it holds, from other GPU blocks.
        fill = 0
        while any(eng.primary_has(k) for k in keys_a) and fill < 4 * PRIMARY_CHUNKS:
            ks = [make_offload_key(f"F-{fill + i}".encode(), 0) for i in range(64)]
            eng.store(ks, range(256, 256 + 64))
            fill += 64
        check("A left the primary", not any(eng.primary_has(k) for k in keys_a),
              f"after {fill} more chunks")

        # 2: kvbm promotes A from the disk; vLLM's worker copies it to fresh GPU blocks.
        poison(dst)
        hit = eng.load(keys_a, dst)
        check("2: A is promoted from kvbm_disk, bytes equal on the GPU",
              hit and same(blocks_a, dst))
        stats = eng.m.get_stats()
        results["stats_after_promotion"] = repr(stats)[:2000]
        eng.close()

        # 3: a restart (a new manager, region and worker) finds the disk warm.
        eng = Engine()
        check("3a: after a restart A is not in the new primary",
              not any(eng.primary_has(k) for k in keys_a))
        poison(dst)
        hit = eng.load(keys_a, dst)
        check("3: A is promoted from the restarted kvbm_disk, bytes equal on the GPU",
              hit and same(blocks_a, dst))
        miss = eng.load([make_offload_key(b"never-stored", 0)], dst[:1])
        check("3c: a chunk never stored is a miss", miss is None)
        eng.close()

        # 4: another instance with an empty disk finds A in the shared object store.
        eng = Engine(disk=os.path.join(workdir, "g3-empty.bin"))
        poison(dst)
        hit = eng.load(keys_a, dst)
        check("4: a new instance with an empty disk promotes A from kvbm_object, bytes equal",
              hit and same(blocks_a, dst))
        eng.close()
    except Exception as e:  # any error ends the flow; it is reported, with its traceback
        import traceback

        traceback.print_exc()
        check("the flow ran to the end", False, f"{type(e).__name__}: {e}")
    check("vLLM's Triton kernel ran", counts["triton_batches"] > 0,
          f"{counts['triton_batches']} batches")
    check("the DMA stand-in ran", counts["dma_batches"] > 0,
          f"{counts['dma_batches']} batches, {counts['dma_descriptors']} descriptors")
    results["failures"] = failures
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(f"RESULT: {'ok' if not failures else 'FAILED: ' + ', '.join(failures)}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
