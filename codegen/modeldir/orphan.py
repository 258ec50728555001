"""codegen's output without its `.codegen/` record (the user copied `dir/*`, or a tool dropped hidden dirs).

Recognised by what codegen writes: the `_CODEGEN_PATCH` marker in the patched modeling file (which also records
the auto_map values and model_type it replaced), the auto_map entries pointing at that file, the config knob
and the generated `autotp_policy.py`. `revert` undoes them into a stock, loadable dir; without the backups
config.json cannot come back byte-for-byte, and the result says so.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from codegen.families import FAMILIES, KNOB
from codegen.modeldir import configjson
from codegen.modeldir.directory import ModelDir
from codegen.modeldir.layout import CONFIG, PATCHED_SUFFIX, POLICY_FILE
from codegen.policy.runtime.base import PATCH_MARKER

_MARKER_LINE = re.compile(rf"^{PATCH_MARKER} = (.*)$", re.MULTILINE)


@dataclass
class Orphan:
    #: files codegen wrote, to delete
    generated: list[str]
    #: config.json edits (configjson.DELETE removes a key)
    config_updates: dict[str, Any]
    #: what cannot be restored byte-for-byte, one phrase each
    not_exact: list[str] = field(default_factory=list)


def find_orphan(md: ModelDir) -> Orphan | None:
    """codegen's output in a dir without a manifest, or None when the dir shows none."""
    try:
        data = md.current_bytes(CONFIG)
        config = json.loads(data) if data is not None else None
    except Exception:  # noqa: BLE001 - anything unreadable is not codegen's output; planning will say why
        return None
    if not isinstance(config, dict):
        return None
    marked: dict[str, dict] = {}
    for path in sorted(md.path.glob("*.py")):
        try:
            marker = read_marker(path.read_bytes())
        except OSError:
            continue
        if marker is not None:
            marked[path.stem] = marker
    if not marked and KNOB not in config:
        return None
    not_exact = []
    ours = set()
    for module, marker in marked.items():
        family = FAMILIES.get(str(marker.get("family")))
        builtin = {family.builtin_module_name, family.text_family.builtin_module_name} if family is not None else set()
        if module.endswith(PATCHED_SUFFIX) or module in builtin:
            ours.add(module)
        else:
            not_exact.append(f"{module}.py was rewritten in place by an older codegen: re-download it")
    if not ours and KNOB not in config:
        return None  # a remote file rewritten in place, nothing else of codegen's: the rewriter says so
    restore: dict[str, Any] = {}
    for module in sorted(ours):
        for key, value in (marked[module].get("config_restore") or {}).items():
            restore.setdefault(key, value)
    updates: dict[str, Any] = {}
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict):
        kept = {k: v for k, v in auto_map.items() if not (isinstance(v, str) and v.rsplit(".", 1)[0] in ours)}
        for key, value in (restore.get("auto_map") or {}).items():
            if value is not None and key not in kept and key in auto_map:
                kept[key] = value
        if kept != auto_map:
            updates["auto_map"] = kept if kept else configjson.DELETE
    if KNOB in config:
        updates[KNOB] = configjson.DELETE
    if "model_type" in restore and restore["model_type"] is not None:
        updates["model_type"] = restore["model_type"]
    if updates:
        not_exact.append("config.json (codegen's keys undone, the rest kept as found; its original bytes "
                         "were backed up in the lost .codegen/)")
    generated = [f"{m}.py" for m in sorted(ours)]
    policy = md.path / POLICY_FILE
    try:
        if policy.is_file() and b"codegen" in policy.read_bytes()[:2048]:
            generated.append(POLICY_FILE)
    except OSError:
        pass
    return Orphan(generated, updates, not_exact)

def read_marker(code: bytes | None) -> dict | None:
    """The `_CODEGEN_PATCH` record of a patched modeling file (parsed as a literal; never executed)."""
    if code is None:
        return None
    found = _MARKER_LINE.search(code.decode("utf-8", "replace"))
    if found is None:
        return None
    try:
        value = ast.literal_eval(found.group(1))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) and value.get("tool") == "codegen" else None
