"""`.codegen/manifest.json`, typed: what each recorded file was before the first patch and what codegen wrote.

The JSON layout is unchanged from earlier releases (old manifests load); `inputs` is new and optional: the
fingerprint of everything the output depends on, so `patch --check` can tell "up to date" without a rewrite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Original:
    """What a path was before the first patch: absent, a regular file (backed up), or a symlink."""

    kind: str  # "absent" | "file" | "symlink"
    sha256: str | None = None
    mode: int | None = None
    target: str | None = None  # symlink target, verbatim

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict) -> "Original":
        kind = data.get("kind")
        if kind not in ("absent", "file", "symlink"):
            raise ValueError(f"unknown original kind {kind!r}")
        return cls(kind, data.get("sha256"), data.get("mode"), data.get("target"))


@dataclass
class FileRecord:
    """One file codegen wrote: what it was before, and the sha256 of what codegen put there."""

    original: Original
    written_sha256: str | None = None
    #: what an earlier patch wrote, while a re-patch that would change it has not yet rewritten it
    previous_written_sha256: str | None = None

    @property
    def ours(self) -> set[str]:
        return {self.written_sha256, self.previous_written_sha256} - {None}

    def to_json(self) -> dict:
        out: dict[str, Any] = {"original": self.original.to_json()}
        if self.written_sha256 is not None:
            out["written_sha256"] = self.written_sha256
        if self.previous_written_sha256 is not None:
            out["previous_written_sha256"] = self.previous_written_sha256
        return out

    @classmethod
    def from_json(cls, data: dict) -> "FileRecord":
        return cls(Original.from_json(data["original"]), data.get("written_sha256"),
                   data.get("previous_written_sha256"))


@dataclass(frozen=True)
class SourceInfo:
    """The modeling source the patch was rewritten from."""

    kind: str  # "builtin" | "remote" | "override"
    path: str
    sha256: str
    #: the transformers release the source comes from (None: unknown, e.g. an override outside a transformers tree)
    transformers_version: str | None


@dataclass
class Manifest:
    """The whole record; `files` maps a name in the model dir to its FileRecord."""

    files: dict[str, FileRecord]
    tool: str = "codegen"
    version: str = ""
    family: str = ""
    source: SourceInfo | None = None
    #: original values of the config.json keys codegen changed: key -> {"existed": bool, "value": ...}
    config_changes: dict[str, dict] = field(default_factory=dict)
    coalesce: bool = True
    #: the fingerprint of the plan's inputs (codegen.patch.plan.Inputs.fingerprint)
    inputs: dict[str, Any] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "tool": self.tool,
            "version": self.version,
            "family": self.family,
            "config_changes": self.config_changes,
            "coalesce": self.coalesce,
            "files": {n: self.files[n].to_json() for n in sorted(self.files)},
        }
        if self.source is not None:
            out["source"] = dict(self.source.__dict__)
        if self.inputs is not None:
            out["inputs"] = self.inputs
        return out

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: Any) -> "Manifest":
        """Raises ValueError/KeyError/TypeError on anything that is not a codegen manifest."""
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise ValueError("not a codegen manifest")
        src = data.get("source")
        source = SourceInfo(src["kind"], src["path"], src["sha256"], src.get("transformers_version")) \
            if isinstance(src, dict) else None
        return cls(
            files={str(n): FileRecord.from_json(r) for n, r in data["files"].items()},
            tool=data.get("tool", "codegen"),
            version=data.get("version", ""),
            family=data.get("family", ""),
            source=source,
            config_changes=dict(data.get("config_changes") or {}),
            coalesce=bool(data.get("coalesce", True)),
            inputs=data.get("inputs"),
        )
