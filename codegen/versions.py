"""Version numbers, read by `packaging` (PEP 440): transformers releases, the generation a source belongs to."""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import InvalidVersion, Version

__all__ = ["FUSED_MAJOR", "Version", "is_legacy", "newest", "parse", "release_of"]

#: the first transformers major whose MoE sources fuse the experts (the family table's `Legacy` names the older)
FUSED_MAJOR = 5


def parse(version: str) -> Version | None:
    """The version, or None when it is not a PEP 440 version (a dev checkout's odd string, say)."""
    try:
        return Version(version)
    except InvalidVersion:
        return None


def release_of(version: str | None) -> str | None:
    """`5.24.0` -> `5.24`: the major.minor a patched dir from transformers' own code is tied to."""
    parsed = parse(version) if version else None
    if parsed is None:
        return ".".join(version.split(".")[:2]) if version else None
    return f"{parsed.major}.{parsed.minor}"


def is_legacy(version: str | None) -> bool:
    """A transformers 4.x (or older) release: its MoE sources keep per-expert modules."""
    parsed = parse(version) if version else None
    return parsed is not None and parsed.major < FUSED_MAJOR


def newest(versions: Iterable[str]) -> str:
    """The newest of some release strings (an unparsable one sorts first)."""
    return max(versions, key=lambda v: parse(v) or Version("0"))
