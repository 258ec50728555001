"""What `patch` would write into a model dir, computed entirely in memory before anything touches disk.

Two stages, so the common case stays cheap:
- `resolve_inputs` reads config.json, picks the family and the source, and fingerprints everything the
  output depends on (codegen's own code, the source's bytes, the transformers release, the knob, the
  original config). It needs no libcst and no jinja2.
- `build_plan` runs the libcst rewrite and renders the templates. `patch --check` (and a `patch` that has
  nothing to do) skip it when the manifest's fingerprint and every file's bytes still match.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from codegen import __version__
from codegen.errors import BadInput, BadSource
from codegen.families import FAMILIES, KNOB, Family, normalise_model_type
from codegen.manifest import Manifest, SourceInfo
from codegen.modeldir import CONFIG, ModelDir
from codegen.source import ModelSource, installed_transformers_version, resolve_source

POLICY = "autotp_policy.py"
#: the marker assignment the rewrite puts into the patched modeling file (codegen.rewrite.MARKER)
MARKER = "_CODEGEN_PATCH"
#: the version guard at the top of a patched modeling file (templates/modeling_guard.py.j2)
GUARD = "_codegen_require_transformers"
_MARKER_LINE = re.compile(rf"^{MARKER} = (.*)$", re.MULTILINE)


@dataclass
class Inputs:
    """Everything the plan depends on, read without rewriting anything."""

    model_dir: ModelDir
    manifest: Manifest | None
    config_bytes: bytes
    config: dict
    family: Family
    source: ModelSource
    coalesce: bool
    #: one-line notes for the user (canonical model_type, quantization, --source version)
    notices: list[str] = field(default_factory=list)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {
            "codegen": generator_digest(),
            "family": self.family.model_type,
            "source_kind": self.source.kind,
            "source_sha256": self.source.sha256,
            "source_transformers": self.source.transformers_version,
            "installed_transformers": installed_transformers_version(),
            "coalesce": self.coalesce,
            "config_sha256": hashlib.sha256(self.config_bytes).hexdigest(),
            # what the dir ships besides codegen's own output (a re-patch sees its earlier output there)
            "shipped": sorted(self.source.shipped_modules - {self.source.module_name, POLICY.removesuffix(".py")}),
        }


@dataclass
class Plan:
    """The files `patch` writes and the manifest that records them."""

    inputs: Inputs
    rewrite: Any  # codegen.rewrite.Rewrite
    files: dict[str, bytes]
    manifest: Manifest

    @property
    def family(self) -> Family:
        return self.inputs.family

    @property
    def source(self) -> ModelSource:
        return self.inputs.source

    @property
    def manifest_info(self) -> dict[str, Any]:
        return {k: v for k, v in self.manifest.to_json().items() if k != "files"}

    @property
    def config_changes(self) -> dict[str, Any]:
        return self.manifest.config_changes


@lru_cache(maxsize=1)
def generator_digest() -> str:
    """sha256 over codegen's own code and templates: a new codegen never trusts an old fingerprint."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for folder in (root, root.parent / "templates", root / "templates"):
        if folder.is_dir():
            for path in sorted(folder.glob("*.py")) + sorted(folder.glob("*.j2")):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ config.json


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
        raise BadInput(f"{directory / CONFIG}: model_type {raw!r} is not supported yet{_nearest(raw)}; "
                       f"stock DeepSpeed AutoTP still runs the unpatched dir (supported: {', '.join(sorted(FAMILIES))})")
    family = FAMILIES[key]
    _validate_sizes(config, family, directory)
    return family


def _nearest(raw: object) -> str:
    """`qwen3_next` -> ` (nearest supported family: qwen3_moe)`: the table's relatives, else a near spelling."""
    if not isinstance(raw, str):
        return ""
    import difflib

    key = raw.strip().lower().replace("-", "_")
    related = [name for name, family in FAMILIES.items() if key in family.relatives]
    close = related or difflib.get_close_matches(key, list(FAMILIES), n=1, cutoff=0.8)
    return f" (nearest supported family: {close[0]})" if close else ""


def _sizes(config: dict) -> dict:
    """The keys sizes are read from: a multimodal config nests its language model's in `text_config`."""
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


def _validate_sizes(config: dict, family: Family, directory: Path) -> None:
    where = directory / CONFIG
    sizes = _sizes(config)
    if not any(k in sizes for k in family.num_experts_keys):
        raise BadInput(f"{where}: missing {family.num_experts_keys[0]} (number of routed experts): not an MoE config")
    for key in family.positive_int_keys:
        if key not in sizes:
            continue
        value = sizes[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"{where}: {key} must be a positive integer, got {value!r}")
        if value <= 0:
            raise BadInput(f"{where}: {key} must be a positive integer, got {value}")
    experts_key = next(k for k in family.num_experts_keys if k in sizes)
    experts = sizes[experts_key]
    top_k_key = next((k for k in family.top_k_keys if k in sizes), None)
    if isinstance(experts, int) and top_k_key is not None and isinstance(sizes[top_k_key], int) \
            and sizes[top_k_key] > experts:
        raise BadInput(f"{where}: {top_k_key} = {sizes[top_k_key]} exceeds {experts_key} = {experts}: "
                       "each token cannot reach more experts than exist; fix config.json")
    layers = sizes.get(family.num_layers_key)
    if isinstance(layers, int) and layers > 0 and isinstance(experts, int) and not moe_layers(sizes, family):
        raise BadInput(f"{where}: no layer of {layers} is an MoE layer (see {_layer_keys(family)}): "
                       "there is nothing for codegen to coalesce")


def moe_layers(sizes: dict, family: Family) -> list[int]:
    """The decoder layers that hold an MoE block, by the family's layer-selection keys."""
    dense = sizes.get(family.dense_layers_key) if family.dense_layers_key else None
    dense = set(dense) if isinstance(dense, list) else set()
    step = sizes.get(family.sparse_step_key) if family.sparse_step_key else None
    first = sizes.get(family.first_dense_key) if family.first_dense_key else None
    freq = sizes.get(family.moe_freq_key) if family.moe_freq_key else None
    out = []
    for i in range(sizes[family.num_layers_key]):
        if i in dense:
            continue
        if isinstance(step, int) and step > 0 and (i + 1) % step:
            continue
        if isinstance(first, int) and i < first:
            continue
        if isinstance(freq, int) and freq > 0 and i % freq:
            continue
        out.append(i)
    return out


def _layer_keys(family: Family) -> str:
    keys = [k for k in (family.dense_layers_key, family.sparse_step_key, family.first_dense_key,
                        family.moe_freq_key) if k]
    return ", ".join([family.num_layers_key, *keys])


def config_updates(original: dict, family: Family, module: str, coalesce: bool) -> tuple[dict, dict]:
    """The keys `patch` sets in config.json, and the original value of each one it changes."""
    auto_map = dict(original.get("auto_map") or {})
    for auto_class, cls in family.auto_classes.items():
        auto_map[auto_class] = f"{module}.{cls}"
    updates = {"auto_map": auto_map, KNOB: coalesce, "model_type": family.model_type}
    updates = {k: v for k, v in updates.items() if original.get(k, _MISSING) != v}
    changed = {k: {"existed": k in original, "value": original.get(k)} for k in updates}
    return updates, changed


_MISSING = object()


def restore_info(original: dict, family: Family) -> dict:
    """What the patched modeling file records so `revert` can undo config.json without `.codegen/`: the
    original value of each auto_map entry codegen overwrites (absent: it did not exist) and a changed
    model_type. Only values the entry points at, never the rest of the config."""
    auto_map = original.get("auto_map") or {}
    info: dict[str, Any] = {}
    replaced = {k: auto_map[k] for k in sorted(family.auto_classes) if auto_map.get(k) is not None}
    if replaced:
        info["auto_map"] = replaced
    if original.get("model_type") != family.model_type:
        info["model_type"] = original.get("model_type")
    return info


# ---------------------------------------------------------------------------------------------- inputs


def resolve_inputs(model_dir: ModelDir, source_override: Path | None, coalesce: bool | None) -> Inputs:
    """Family, source and knob of a dir; `coalesce=None` keeps the recorded choice (default on)."""
    manifest = model_dir.manifest()
    config_bytes = model_dir.original_bytes(CONFIG, manifest)
    config = parse_config(config_bytes, model_dir.path)
    family = family_of(config, model_dir.path)
    if source_override is not None and source_override.name.startswith("modular_"):
        raise BadSource(
            f"--source {source_override}: a modular_*.py file is transformers' template for generating "
            f"modeling code, not loadable code: pass the generated {family.builtin_module_name}.py instead"
        )
    shipped = frozenset(p.stem for p in model_dir.path.glob("*.py"))
    source = resolve_source(family, config, lambda name: model_dir.original_bytes(name, manifest), shipped,
                            source_override)
    if family.quantized_forms:
        from codegen.quantization import refuse_unsupported_quantization

        refuse_unsupported_quantization(config, family, source.transformers_version, model_dir.path / CONFIG)
    if coalesce is None:
        coalesce = current_knob(model_dir, manifest)
    notices = []
    raw_type = config.get("model_type")
    if raw_type != family.model_type:
        notices.append(f"config.json: model_type {raw_type!r} is written as {family.model_type!r}, its canonical "
                       "spelling (revert restores the original)")
    quant = _sizes(config).get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        notices.append(f"config.json has quantization_config ({method or 'unknown method'}): the rewrite keeps "
                       "loading as before, but the AutoTP policy is verified on unquantized weights only")
    installed = installed_transformers_version()
    if source.kind == "override" and source.transformers_version != installed:
        seen = source.transformers_version or "an unknown release"
        notices.append(f"--source comes from transformers {seen} but {installed or 'none'} is installed: "
                       "the patched dir is recorded for the source's release")
    return Inputs(model_dir, manifest, config_bytes, config, family, source, coalesce, notices)


def current_knob(model_dir: ModelDir, manifest: Manifest | None) -> bool:
    """The knob as the dir has it now: config.json is the commit point, so it beats the manifest (which an
    interrupted re-patch already wrote); a first patch turns it on."""
    if manifest is None:
        return True
    try:
        value = json.loads(model_dir.current_bytes(CONFIG) or b"{}").get(KNOB)
    except (ValueError, AttributeError, UnicodeDecodeError):
        value = None
    return value if isinstance(value, bool) else manifest.coalesce


# ------------------------------------------------------------------------------------------------ plan


def rewrite_source(text, target, helper_block):
    """codegen.rewrite.rewrite_source, imported on first use (libcst is the slow import)."""
    from codegen.rewrite import rewrite_source as rewrite

    return rewrite(text, target, helper_block)


def render_policy(family: Family, modeling_module: str) -> str:
    from codegen.policy import render_policy as render

    return render(family, modeling_module)


def render_helper_block(family: Family, restore: dict | None = None) -> str:
    """The generated block `patch` inserts after the modeling source's imports (guard helper + marker)."""
    from codegen.render import render

    info = {"tool": "codegen", "version": __version__, "family": family.model_type}
    if restore:
        info["config_restore"] = restore
    return render("modeling_block.py.j2", knob=KNOB, patch_info=info)


def render_version_guard(transformers_version: str) -> str:
    from codegen.render import render

    release = ".".join(transformers_version.split(".")[:2])
    return render("modeling_guard.py.j2", guard=GUARD, generated_with=transformers_version, release=release)


def rewrite_modeling(text: str, target, family: Family, guard_version: str | None, restore: dict | None):
    """The rewrite `patch` writes: libcst edits + helper block, and for transformers' own sources a version
    guard at the very top (before the imports, which are what breaks first under another release)."""
    rewrite = rewrite_source(text, target, render_helper_block(family, restore))
    if guard_version is None:
        return rewrite
    return replace(rewrite, code=insert_guard(rewrite.code, render_version_guard(guard_version)))


def insert_guard(code: str, guard: str) -> str:
    """`guard` before the first statement that is neither the docstring nor a `from __future__` import."""
    tree = ast.parse(code)
    first = None
    for i, stmt in enumerate(tree.body):
        if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str):
            continue
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            continue
        first = stmt
        break
    lines = code.splitlines(keepends=True)
    at = len(lines) if first is None else _first_line(first) - 1
    patched = "".join(lines[:at]) + guard + "\n\n" + "".join(lines[at:])
    stripped = ast.parse(patched)
    stripped.body = [s for s in stripped.body if not _is_guard(s)]
    if ast.dump(stripped) != ast.dump(tree):  # pragma: no cover - would be a codegen bug
        raise BadSource("internal: the transformers version guard changed more than intended; nothing written")
    return patched


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", None) or []
    return min([stmt.lineno, *(d.lineno for d in decorators)])


def _is_guard(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.FunctionDef) and stmt.name == GUARD:
        return True
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
        and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == GUARD


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


def guard_version_of(source: ModelSource) -> str | None:
    """transformers' own modeling code only runs under the release it came from; remote code is its own."""
    return source.transformers_version if source.kind in ("builtin", "override") else None


def build_plan(inputs: Inputs) -> Plan:
    from codegen import configjson
    from codegen.rewrite import RewriteTarget

    family, source = inputs.family, inputs.source
    target = RewriteTarget(
        family=family,
        package=source.package,
        shipped_modules=source.shipped_modules - {source.module_name},
        display_name=source.origin_path,
        transformers_version=source.transformers_version,
    )
    rewrite = rewrite_modeling(source.text, target, family, guard_version_of(source),
                               restore_info(inputs.config, family))
    policy = render_policy(family, source.module_name)
    updates, changes = config_updates(inputs.config, family, source.module_name, inputs.coalesce)
    files = {
        source.output_name: rewrite.code.encode("utf-8"),
        POLICY: policy.encode("utf-8"),
        CONFIG: configjson.edit(inputs.config_bytes, updates),
    }
    manifest = Manifest(
        files={},
        version=__version__,
        family=family.model_type,
        source=SourceInfo(source.kind, source.origin_path, source.sha256, source.transformers_version),
        config_changes=changes,
        coalesce=inputs.coalesce,
        inputs=inputs.fingerprint,
    )
    return Plan(inputs, rewrite, files, manifest)


def make_plan(model_dir: ModelDir, source_override: Path | None, coalesce: bool | None) -> Plan:
    return build_plan(resolve_inputs(model_dir, source_override, coalesce))


# ------------------------------------------------------------------------------------------------ diff


def unified_diff(name: str, before: bytes | None, after: bytes | None) -> str:
    """A diff `patch -p1` and `git apply` accept: new/removed files against /dev/null, and
    `\\ No newline at end of file` where a side does not end in one."""
    a = [] if before is None else before.decode("utf-8", "replace").splitlines(keepends=True)
    b = [] if after is None else after.decode("utf-8", "replace").splitlines(keepends=True)
    import difflib

    fromfile = "/dev/null" if before is None else f"a/{name}"
    tofile = "/dev/null" if after is None else f"b/{name}"
    lines = difflib.unified_diff(a, b, fromfile=fromfile, tofile=tofile)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
