"""Stand-ins for torch and for the parts of vLLM the kv_offload tests never exercise.

Why: the managers under test (CPU cache, tiering) are pure Python over numpy, but their
modules -- and the modules of the tests -- import torch, vLLM's platform layer, its
custom ops, Triton, the engine config, the scheduler's request types and so on. Those
are gigabytes (torch, CUDA) or pull the whole engine. The tests only need them to
*import*; the few calls that do happen are small and listed here.

How: a meta-path finder, first on sys.meta_path, answers every import whose name is,
or is under, one of STUB_PREFIXES with a module object that is not loaded from disk:

  * a *specific* stub when SPECIFIC names the module (torch, vllm.platforms,
    vllm.logger, vllm.triton_utils, vllm.utils.torch_utils, the shm free-space check);
  * otherwise a *generic* stub: any attribute it is asked for is a fresh placeholder
    class that accepts any constructor and class arguments, any attribute of a
    placeholder class is again a placeholder (for `SomeEnum.MEMBER` at import time),
    and subscripting returns the class (for `Generic[T]`-style annotations).

torch is numpy-backed: `torch.zeros(...)`, `torch.frombuffer(...)`,
`torch.as_strided(...)` return a numpy.ndarray subclass with `.numpy()`,
`.data_ptr()`, `.numel()`, `.element_size()`; dtypes are numpy dtypes. The tests use
`torch.zeros((n, row), dtype=torch.int8).numpy()` to build the primary tier's memory
view, the tiering spec's real SharedOffloadRegion calls `torch.frombuffer` on its mmap,
and factory tests monkeypatch `torch.accelerator.current_device_index`.

vllm.platforms.current_platform mirrors a CUDA platform (is_cuda_alike() True,
is_rocm()/is_xpu() False) because that is the platform vLLM's CI runs these tests on;
tests that need another answer monkeypatch these methods themselves. Asking the stub
platform for anything else raises, naming the attribute, rather than guessing.

Every stub module created is recorded in STUBS_USED for the report.
"""

import importlib.abc
import importlib.machinery
import logging
import sys
import types

# Module prefixes answered by stubs. Everything else (vllm.v1.kv_offload.*, the extracted
# kv_connector metrics/offloading modules, numpy, pytest, ...) is imported for real.
STUB_PREFIXES = (
    "torch",
    "triton",
    "vllm._custom_ops",
    "vllm.config",
    "vllm.envs",
    "vllm.platforms",
    "vllm.logger",
    "vllm.triton_utils",
    "vllm.utils.torch_utils",
    "vllm.utils.import_utils",
    "vllm.fs_io_C",
    "vllm.distributed.device_communicators",
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_events",
    "vllm.distributed.nixl_utils",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.v1.core",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.outputs",
    "vllm.v1.request",
    "kvcr",
    "nixl",
)

STUBS_USED = set()


# ----------------------------------------------------------------------------------------
# generic placeholders
# ----------------------------------------------------------------------------------------
class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _PlaceholderMeta(name, (_Placeholder,), {"__module__": cls.__module__,
                                                       "__qualname__": f"{cls.__qualname__}.{name}"})
        setattr(cls, name, sub)
        return sub

    def __getitem__(cls, item):
        return cls


class _Placeholder(metaclass=_PlaceholderMeta):
    """Stands for any class of a stubbed module: takes any arguments, does nothing."""

    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, *args, **kwargs):
        pass


class StubModule(types.ModuleType):
    """A module whose missing attributes are placeholder classes (created on demand)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        val = _PlaceholderMeta(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, val)
        return val


# ----------------------------------------------------------------------------------------
# torch, numpy-backed
# ----------------------------------------------------------------------------------------
def _sub(parent, name, **attrs):
    sub = StubModule(f"{parent.__name__}.{name}")
    sub.__path__ = []
    for k, v in attrs.items():
        setattr(sub, k, v)
    sys.modules[sub.__name__] = sub
    STUBS_USED.add(sub.__name__)
    return sub


def _fill_torch(m):
    import numpy as np

    class Tensor(np.ndarray):
        """numpy array with the handful of torch.Tensor methods the code calls."""

        def view(self, *shape_or_dtype):
            # torch: view(*shape) reshapes without copying; view(dtype) reinterprets.
            if shape_or_dtype and all(isinstance(d, int) for d in shape_or_dtype):
                out = self.reshape(shape_or_dtype)
                if not np.shares_memory(out, self):
                    raise RuntimeError("torch stub: view() would have copied")
                return out
            if len(shape_or_dtype) == 1 and isinstance(shape_or_dtype[0], tuple):
                return self.view(*shape_or_dtype[0])
            return super().view(*shape_or_dtype)

        def numpy(self):
            return np.ndarray.view(self, np.ndarray)

        def data_ptr(self):
            return self.__array_interface__["data"][0]

        def numel(self):
            return int(self.size)

        def element_size(self):
            return int(self.itemsize)

        def dim(self):
            return self.ndim

    def _shape(size):
        if len(size) == 1 and isinstance(size[0], (tuple, list)):
            return tuple(size[0])
        return tuple(size)

    def zeros(*size, dtype=None, **_device_kwargs):
        return np.zeros(_shape(size), dtype=dtype or np.float32).view(Tensor)

    def empty(*size, dtype=None, **_device_kwargs):
        return np.empty(_shape(size), dtype=dtype or np.float32).view(Tensor)

    def frombuffer(buffer, dtype, count=-1, offset=0, **_kw):
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(Tensor)

    def as_strided(t, size, stride, storage_offset=0):
        base = np.asarray(t)
        item = base.itemsize
        flat = base.reshape(-1)[storage_offset:]
        return np.lib.stride_tricks.as_strided(
            flat, shape=tuple(size), strides=tuple(s * item for s in stride)).view(Tensor)

    class device:  # noqa: N801 (torch's name)
        def __init__(self, type="cpu", index=None):
            self.type, self.index = type, index

        def __repr__(self):
            return f"device(type={self.type!r}, index={self.index!r})"

    m.Tensor = Tensor
    m.Size = tuple
    m.dtype = np.dtype
    m.device = device
    for name in ("int8", "uint8", "int16", "int32", "int64", "float16", "float32",
                 "float64"):
        setattr(m, name, np.dtype(name))
    m.bool = np.dtype(np.bool_)
    m.half, m.float, m.long = np.dtype("float16"), np.dtype("float32"), np.dtype("int64")
    m.bfloat16 = np.dtype("uint16")  # same width; nothing here does arithmetic on it
    m.zeros, m.empty, m.frombuffer, m.as_strided = zeros, empty, frombuffer, as_strided
    # Submodule-like namespaces: named functions below, placeholders for the rest
    # (torch.cuda.Stream / Event appear in dataclass annotations at import time).
    m.accelerator = _sub(m, "accelerator", current_device_index=lambda: 0,
                         device_count=lambda: 1)
    m.cuda = _sub(m, "cuda", is_available=lambda: False, device_count=lambda: 0,
                  current_device=lambda: 0)
    m.__version__ = "0.0+kvbm-stub"


# ----------------------------------------------------------------------------------------
# specific vLLM stubs
# ----------------------------------------------------------------------------------------
class _StubPlatform:
    """vllm.platforms.current_platform as on CUDA (what vLLM's CI runs these tests on)."""

    device_type = "cuda"
    device_name = "cuda"
    dispatch_key = "CUDA"

    def is_cuda_alike(self):
        return True

    def is_cuda(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_tpu(self):
        return False

    def __getattr__(self, name):
        raise AttributeError(
            f"the test harness's stub vllm.platforms.current_platform has no {name!r}; "
            f"add it to crates/kvbm-vllm/tests/upstream/stubs.py if a test needs it")


def _fill_platforms(m):
    m.current_platform = _StubPlatform()


class _Logger:
    """vLLM's logger: logging.Logger plus *_once variants that log a message once."""

    def __init__(self, name):
        self._logger = logging.getLogger(name)
        self._seen = set()

    def __getattr__(self, name):
        if name.endswith("_once"):
            base = getattr(self._logger, name[: -len("_once")])

            def once(msg, *args, **kwargs):
                if msg not in self._seen:
                    self._seen.add(msg)
                    base(msg, *args, **{k: v for k, v in kwargs.items()
                                        if k in ("exc_info", "stack_info", "stacklevel")})
            return once
        return getattr(self._logger, name)


def _fill_logger(m):
    m.init_logger = _Logger


def _fill_triton_utils(m):
    m.HAS_TRITON = False
    m.triton = types.SimpleNamespace(jit=lambda fn=None, **kw: fn if fn else (lambda f: f),
                                     cdiv=lambda a, b: -(-a // b))
    m.tl = StubModule("vllm.triton_utils.tl")


def _fill_torch_utils(m):
    m.PIN_MEMORY = False


def _fill_shm_broadcast(m):
    def check_shm_free_space(size, allocation_name=""):
        return None
    m.check_shm_free_space = check_shm_free_space


SPECIFIC = {
    "torch": _fill_torch,
    "vllm.platforms": _fill_platforms,
    "vllm.logger": _fill_logger,
    "vllm.triton_utils": _fill_triton_utils,
    "vllm.utils.torch_utils": _fill_torch_utils,
    "vllm.distributed.device_communicators.shm_broadcast": _fill_shm_broadcast,
}


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of STUB_PREFIXES (and everything under them) with stub modules."""

    def __init__(self, prefixes=STUB_PREFIXES):
        self.prefixes = tuple(prefixes)

    def covers(self, fullname):
        return any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes)

    def find_spec(self, fullname, path=None, target=None):
        if self.covers(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        STUBS_USED.add(spec.name)
        m = StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        fill = SPECIFIC.get(module.__name__)
        if fill is not None:
            fill(module)


def install(src_dir, extra_prefixes=(), real=()):
    """Put the extracted vLLM tree first on sys.path and the stub finder first in
    sys.meta_path. Refuses if a real vllm or torch was already imported, since the
    stubs would then be mixed with real modules.

    `real` names prefixes left to the real packages (the GPU check keeps the machine's torch
    and Triton, and puts its own CUDA stand-ins for vLLM's compiled parts in sys.modules)."""
    for name in ("vllm", "torch"):
        if name in sys.modules and name not in real:
            raise RuntimeError(f"{name} was imported before the stubs were installed "
                               f"({getattr(sys.modules[name], '__file__', '?')})")
    if src_dir not in sys.path:
        sys.path.insert(0, src_dir)
    for i, f in enumerate(sys.meta_path):
        if isinstance(f, StubFinder):
            del sys.meta_path[i]
            break
    prefixes = tuple(p for p in STUB_PREFIXES + tuple(extra_prefixes) if p not in real)
    sys.meta_path.insert(0, StubFinder(prefixes))
