"""Swap vLLM's offloading manager classes for kvbm's before any test module is imported.

Why: the goal is for kvbm's managers to pass vLLM's *own* tests unchanged. The tests
import the managers by name from vLLM modules (`from vllm.v1.kv_offload.cpu.manager
import CPUOffloadingManager`) and vLLM's specs construct them through names bound in
their own modules. So in kvbm mode, after the stubs are installed and before pytest
collects anything, every module-level binding in the loaded vllm.* modules that *is*
one of vLLM's classes below is rebound to kvbm's same-named class. The sweep is by
identity, so it covers the defining module, the test-import sites, and re-imports in
other vLLM modules (the specs' `get_manager()`, `tiering.manager`'s own reference to
CPUOffloadingManager) alike. Subclasses vLLM defines on top of a replaced class keep
their vLLM base -- that is why CPUPrimaryTierOffloadingManager is listed itself.

kvbm's classes come from `kvbm_vllm.upstream_compat`, which must export every name in
SUBSTITUTED_CLASSES. If `kvbm_vllm` cannot be imported, or a name is missing, the run
fails with an error -- it never falls back to vLLM's class silently.
"""

import importlib
import sys

# The one place that names what kvbm replaces: class name -> vLLM module defining it.
# These are the manager classes vLLM's kv_offload tests construct directly.
SUBSTITUTED_CLASSES = {
    "CPUOffloadingManager": "vllm.v1.kv_offload.cpu.manager",
    "CPUPrimaryTierOffloadingManager": "vllm.v1.kv_offload.tiering.manager",
    "TieringOffloadingManager": "vllm.v1.kv_offload.tiering.manager",
}

COMPAT_MODULE = "kvbm_vllm.upstream_compat"

# vLLM modules that bind the classes above and are imported by the tests or by the
# specs the tests build; imported here up front so the sweep sees their bindings.
PRELOAD = (
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.cpu.spec",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.factory",
)


class SubstitutionError(RuntimeError):
    """kvbm's classes could not be put in place."""


def load_kvbm_classes(names):
    try:
        compat = importlib.import_module(COMPAT_MODULE)
    except ImportError as e:
        raise SubstitutionError(
            f"--impl kvbm: cannot import {COMPAT_MODULE} ({e}). Build and install the "
            f"kvbm-vllm Python package (crates/kvbm-vllm, e.g. `maturin develop`) into "
            f"this Python ({sys.executable}), or run with --impl vllm.") from e
    unknown = [n for n in names if n not in SUBSTITUTED_CLASSES]
    if unknown:
        raise SubstitutionError(
            f"--classes: {', '.join(unknown)} not in substitution.SUBSTITUTED_CLASSES "
            f"({', '.join(SUBSTITUTED_CLASSES)})")
    missing = [n for n in names if not hasattr(compat, n)]
    if missing:
        raise SubstitutionError(
            f"{COMPAT_MODULE} ({getattr(compat, '__file__', '?')}) does not export "
            f"{', '.join(missing)}; it must export every class --classes names")
    return {n: getattr(compat, n) for n in names}, compat


def apply(impl, names=tuple(SUBSTITUTED_CLASSES)):
    """Substitute kvbm's classes for `names` (kvbm mode); return a description of what was
    substituted and what stayed vLLM's (for the report)."""
    for mod in PRELOAD:
        importlib.import_module(mod)
    if impl == "vllm":
        return {"impl": "vllm", "classes": {}}
    if impl != "kvbm":
        raise SubstitutionError(f"unknown --impl {impl!r} (expected vllm or kvbm)")
    kvbm, compat = load_kvbm_classes(names)
    originals = {}
    for name in kvbm:
        home = SUBSTITUTED_CLASSES[name]
        originals[name] = getattr(importlib.import_module(home), name)
    rebound = {name: [] for name in kvbm}
    by_id = {id(cls): name for name, cls in originals.items()}
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("vllm") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            name = by_id.get(id(val))
            if name is not None and val is originals[name]:
                setattr(mod, attr, kvbm[name])
                rebound[name].append(f"{modname}.{attr}")
    # The wheel's `vllm.general_plugins` entry point, as vLLM calls it in every process when
    # the plug-in is installed: kvbm's spec and tier types are registered with vLLM's
    # factories, so vLLM's factory tests run with them there (loading the plug-in must break
    # no test of vLLM's that passes without it, but for the expected failures listed).
    import kvbm_vllm

    kvbm_vllm.register()
    return {"impl": "kvbm", "plugin": "kvbm_vllm:register called",
            "module": getattr(compat, "__file__", COMPAT_MODULE),
            "classes": {n: {"kvbm": f"{c.__module__}.{c.__qualname__}",
                            "rebound": rebound[n]} for n, c in kvbm.items()},
            "still_vllm": [n for n in SUBSTITUTED_CLASSES if n not in kvbm]}
