"""What `patch` would write into a model dir, computed entirely in memory before anything touches disk."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codegen import __version__
from codegen.errors import BadInput
from codegen.families import FAMILIES, KNOB, Family, normalise_model_type
from codegen.modeldir import CONFIG, ModelDir
from codegen.policy import render_policy
from codegen.render import render
from codegen.rewrite import Rewrite, RewriteTarget, rewrite_source
from codegen.source import ModelSource, resolve_source

POLICY = "autotp_policy.py"


@dataclass
class Plan:
    family: Family
    source: ModelSource
    rewrite: Rewrite
    files: dict[str, bytes]
    manifest_info: dict[str, Any]
    config_changes: dict[str, Any] = field(default_factory=dict)


def parse_config(data: bytes | None, directory: Path) -> dict:
    if data is None:
        raise BadInput(f"{directory / CONFIG} not found: point codegen at a Hugging Face model dir")
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{directory / CONFIG} is not valid JSON ({exc}): fix or re-download it") from None
    except RecursionError:
        raise BadInput(f"{directory / CONFIG} is nested too deeply to be a model config: fix or re-download it") from None
    if not isinstance(config, dict):
        raise BadInput(f"{directory / CONFIG} is not a JSON object: fix or re-download it")
    if config.get("auto_map") is not None and not isinstance(config["auto_map"], dict):
        raise BadInput(f"{directory / CONFIG}: auto_map must be a JSON object, got {config['auto_map']!r}")
    return config


def family_of(config: dict, directory: Path) -> Family:
    raw = config.get("model_type")
    key = normalise_model_type(raw)
    if key is None:
        supported = ", ".join(sorted(FAMILIES))
        raise BadInput(f"{directory / CONFIG}: model_type {raw!r} is not supported (supported: {supported})")
    family = FAMILIES[key]
    _validate_sizes(config, family, directory)
    return family


def _validate_sizes(config: dict, family: Family, directory: Path) -> None:
    where = directory / CONFIG
    if not any(k in config for k in family.num_experts_keys):
        raise BadInput(f"{where}: missing {family.num_experts_keys[0]} (number of routed experts): not an MoE config")
    for key in family.positive_int_keys:
        if key not in config:
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"{where}: {key} must be a positive integer, got {value!r}")
        if value <= 0:
            raise BadInput(f"{where}: {key} must be a positive integer, got {value}")


def patched_config(original: dict, family: Family, module: str, coalesce: bool) -> tuple[dict, dict]:
    """The config with auto_map and the knob; returns it and the original values of every key changed."""
    config = dict(original)
    auto_map = dict(original.get("auto_map") or {})
    for auto_class, cls in family.auto_classes.items():
        auto_map[auto_class] = f"{module}.{cls}"
    updates = {"auto_map": auto_map, KNOB: coalesce, "model_type": family.model_type}
    changed = {}
    for key, value in updates.items():
        if original.get(key, _MISSING) != value:
            changed[key] = {"existed": key in original, "value": original.get(key)}
            config[key] = value
    return config, changed


_MISSING = object()


def dump_config(config: dict) -> bytes:
    # transformers writes config.json with indent=2 and sorted keys; keep the dir's style stable.
    try:
        return (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" is valid JSON): keep it as a JSON escape
        return (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode("utf-8")


def render_helper_block(family: Family) -> str:
    """The generated block `patch` inserts after the modeling source's imports (guard helper + marker)."""
    return render(
        "modeling_block.py.j2",
        knob=KNOB,
        patch_info={"tool": "codegen", "version": __version__, "family": family.model_type},
    )


def make_plan(model_dir: ModelDir, source_override: Path | None, coalesce: bool) -> Plan:
    manifest = model_dir.manifest()
    original_config = parse_config(model_dir.original_bytes(CONFIG, manifest), model_dir.path)
    family = family_of(original_config, model_dir.path)
    shipped = frozenset(p.stem for p in model_dir.path.glob("*.py"))
    source = resolve_source(
        family,
        original_config,
        lambda name: model_dir.original_bytes(name, manifest),
        shipped,
        source_override,
    )
    target = RewriteTarget(
        family=family,
        package=source.package,
        shipped_modules=source.shipped_modules - {source.module_name},
        display_name=source.origin_path,
        transformers_version=source.transformers_version,
    )
    rewrite = rewrite_source(source.text, target, render_helper_block(family))
    policy = render_policy(family, source.module_name)
    config, changes = patched_config(original_config, family, source.module_name, coalesce)
    files = {
        source.output_name: rewrite.code.encode("utf-8"),
        POLICY: policy.encode("utf-8"),
        CONFIG: dump_config(config),
    }
    info = {
        "tool": "codegen",
        "version": __version__,
        "family": family.model_type,
        "source": {
            "kind": source.kind,
            "path": source.origin_path,
            "sha256": source.sha256,
            "transformers_version": source.transformers_version,
        },
        "config_changes": changes,
        "coalesce": coalesce,
    }
    return Plan(family, source, rewrite, files, info, changes)


def unified_diff(name: str, before: bytes | None, after: bytes | None) -> str:
    a = [] if before is None else before.decode("utf-8", "replace").splitlines(keepends=True)
    b = [] if after is None else after.decode("utf-8", "replace").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, fromfile=f"a/{name}", tofile=f"b/{name}"))
