"""kvbm for vLLM.

Importing this package is cheap: vLLM's metrics front end imports offloading spec classes in
processes that never run a manager, so nothing here loads the Rust extension or vLLM until a
class is used. ``kvbm_vllm.upstream_compat`` holds the classes that stand where vLLM's own do.
"""

__all__ = ["extension"]


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
