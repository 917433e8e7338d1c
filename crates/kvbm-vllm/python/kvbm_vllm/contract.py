"""Which vLLM offloading contract kvbm follows: the installed vLLM's, 0.34 or 0.33.

kvbm supports the current and the previous vLLM minor release, from one wheel. The two differ
in what a manager is asked and owes (vLLM 0.34 against 0.33):

- ``touch`` is gone from ``OffloadingManager``, ``SecondaryTierManager`` and the cache
  policies (recency comes from a request's loads and stores alone);
- the store threshold counts a key once per request (a retried or re-offered store is not
  another use of the content), and a skip is counted once per request too;
- a stored event carries the request context that stored it, with ``removal_expected``;
- a failed promotion can defer the release of its primary chunks
  (``JobResult.deferred_release``, ``defer_write_release`` / ``release_deferred_write``, two
  more metrics);
- the tier-poll thread backs off after sustained failure instead of giving up, and
  ``has_pending_work`` leaves out what a live poll thread finishes by itself.

:func:`installed` answers from vLLM's package metadata where it has some and
from its API where it has none (the source tree vLLM's own tests run from); both answers must
agree when both exist. Any other release line is refused with :class:`UnsupportedVllm`, by
kvbm's spec and by each of kvbm's tiers, naming the supported versions.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Contract", "SUPPORTED", "UnsupportedVllm", "installed", "contract_of_version"]

#: The vLLM release lines kvbm follows, newest first: the current and the previous minor.
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 34), (0, 33))


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not a release line kvbm follows."""


@dataclass(frozen=True)
class Contract:
    """One release line's offloading contract, as the flags kvbm's managers act on."""

    #: ``(major, minor)``.
    line: tuple[int, int]
    #: The version string vLLM reports, ``None`` when it carries none.
    version: str | None

    @property
    def name(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"

    @property
    def has_touch(self) -> bool:
        """0.33: managers, tiers and policies have ``touch``."""
        return self.line < (0, 34)

    @property
    def count_once_per_request(self) -> bool:
        """0.34: the store threshold counts a key once per request."""
        return self.line >= (0, 34)

    @property
    def stored_event_context(self) -> bool:
        """0.34: a stored event carries its request context (and ``removal_expected``)."""
        return self.line >= (0, 34)

    @property
    def deferred_release(self) -> bool:
        """0.34: a failed promotion may defer releasing its primary chunks."""
        return self.line >= (0, 34)

    @property
    def poll_backs_off(self) -> bool:
        """0.34: the tier-poll thread backs off after sustained failure (0.33: it stops)."""
        return self.line >= (0, 34)


def _supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def _line_of(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def contract_of_version(version: str) -> Contract:
    """The contract of vLLM ``version``; :class:`UnsupportedVllm` naming it and the supported
    versions when kvbm does not follow its line."""
    line = _line_of(version)
    if line not in SUPPORTED:
        raise UnsupportedVllm(
            f"kvbm-vllm follows vLLM {_supported_text()} (the current and the previous minor "
            f"release); this is vLLM {version}. Install one of those, or a kvbm-vllm that "
            f"supports {version}."
        )
    return Contract(line=line, version=version)


def _installed_version() -> str | None:
    import vllm

    version = getattr(vllm, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("vllm")
        except Exception:  # noqa: BLE001 - no distribution metadata
            version = None
    return version


def _line_from_api() -> tuple[int, int]:
    """The release line the importable vLLM modules implement (0.34 dropped ``touch`` from
    ``OffloadingManager`` and added ``JobResult.deferred_release``)."""
    from dataclasses import fields

    from vllm.v1.kv_offload.base import OffloadingManager
    from vllm.v1.kv_offload.tiering.base import JobResult

    has_touch = hasattr(OffloadingManager, "touch")
    has_deferred = any(f.name == "deferred_release" for f in fields(JobResult))
    if has_touch and not has_deferred:
        return (0, 33)
    if not has_touch and has_deferred:
        return (0, 34)
    raise UnsupportedVllm(
        "kvbm-vllm cannot tell which vLLM offloading contract these modules implement "
        f"(OffloadingManager.touch {'present' if has_touch else 'absent'}, "
        f"JobResult.deferred_release {'present' if has_deferred else 'absent'}); "
        f"supported: vLLM {_supported_text()}"
    )


def installed() -> Contract:
    """The installed vLLM's contract (see the module docs); :class:`UnsupportedVllm` when kvbm
    does not follow it, or when its version and its API disagree."""
    version = _installed_version()
    api_line = _line_from_api() if version is None else None
    if version is None:
        return Contract(line=api_line, version=None)
    contract = contract_of_version(version)
    api_line = _line_from_api()
    if api_line != contract.line:
        raise UnsupportedVllm(
            f"vLLM reports version {version} but its offloading modules implement the "
            f"{api_line[0]}.{api_line[1]} contract: a mixed installation; reinstall vLLM"
        )
    return contract
