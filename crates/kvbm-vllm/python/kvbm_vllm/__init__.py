"""kvbm for vLLM.

Importing this package is cheap: vLLM's metrics front end imports offloading spec classes in
processes that never run a manager, so nothing here loads the Rust extension or vLLM until a
class is used. ``kvbm_vllm.upstream_compat`` holds the classes that stand where vLLM's own do.
"""

from kvbm_vllm.log import logger

__all__ = ["extension", "register", "SPECS", "TIER_TYPES"]

_log = logger

#: kvbm's offloading specs for vLLM's ``OffloadingSpecFactory``: name -> module.
SPECS = {
    "KvbmOffloadingSpec": "kvbm_vllm.spec",
    # vLLM 0.34's direct file path (refused under 0.33 when built, not when registered).
    "KvbmDiskDirectSpec": "kvbm_vllm.direct",
}

#: kvbm's secondary tier types for vLLM's ``TieringOffloadingSpec``: type -> (module, class).
TIER_TYPES = {
    "kvbm_disk": ("kvbm_vllm.tiers", "KvbmDiskTier"),
    "kvbm_object": ("kvbm_vllm.tiers", "KvbmObjectTier"),
    "kvbm_fleet": ("kvbm_vllm.tiers", "KvbmFleetTier"),
}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``KvbmOffloadingSpec`` and
    ``KvbmDiskDirectSpec`` with vLLM's ``OffloadingSpecFactory`` (``"spec_name": ...`` without a
    module path) and kvbm's tier types with its ``SecondaryTierFactory``, so
    ``{"type": "kvbm_disk", ...}``, ``{"type": "kvbm_object", ...}`` and
    ``{"type": "kvbm_fleet", ...}`` work without one.

    vLLM calls it in every process it starts; it imports only vLLM's factory (no extension, no
    manager), and it never raises: a vLLM without the factory, or a name already registered,
    is logged and skipped, so a broken plugin can never stop vLLM from starting.
    """
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except Exception as e:  # noqa: BLE001 - a plugin must not stop vLLM
        _log.warning("kvbm_vllm: vLLM's SecondaryTierFactory is not importable (%s); "
                     "kvbm's tiers are not registered (use module_path in the tier config)", e)
        return
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except Exception as e:  # noqa: BLE001 - a plugin must not stop vLLM
        _log.warning("kvbm_vllm: vLLM's OffloadingSpecFactory is not importable (%s); kvbm's "
                     "specs are not registered (use spec_module_path)", e)
        OffloadingSpecFactory = None
    for name, module in SPECS.items() if OffloadingSpecFactory is not None else ():
        try:
            OffloadingSpecFactory.register_spec(name, module, name)
        except ValueError:
            _log.debug("kvbm_vllm: %s already registered", name)
        except Exception as e:  # noqa: BLE001 - a plugin must not stop vLLM
            _log.warning("kvbm_vllm: cannot register %s: %s", name, e)
    for tier_type, (module, cls) in TIER_TYPES.items():
        try:
            SecondaryTierFactory.register_tier(tier_type, module, cls)
        except ValueError:
            _log.debug("kvbm_vllm: tier type %s already registered", tier_type)
        except Exception as e:  # noqa: BLE001
            _log.warning("kvbm_vllm: cannot register tier type %s: %s", tier_type, e)


def extension():
    """The Rust extension module (``kvbm_vllm._kvbm``), loaded on first use.

    Raises ImportError naming the wheel to install when the extension is missing (a source
    checkout without ``maturin develop``).
    """
    try:
        from kvbm_vllm import _kvbm
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(
            "kvbm_vllm's Rust extension (kvbm_vllm._kvbm) is not built: install the kvbm-vllm "
            "wheel (maturin build in crates/kvbm-vllm) or run `maturin develop` there"
        ) from e
    return _kvbm
