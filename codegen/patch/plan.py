"""What `patch` would write into a model dir, computed entirely in memory before anything touches disk.

Two stages, so the common case stays cheap:
- `resolve_inputs` reads config.json, picks the family and the source, and fingerprints everything the
  output depends on (the code that shapes a patched dir, the source's bytes, the transformers release, the
  knob, the original config). It needs no libcst and no jinja2.
- `build_plan` runs the libcst rewrite and renders the templates. `patch --check` (and a `patch` that has
  nothing to do) skip it when the manifest's fingerprint and every file's bytes still match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from codegen import __version__, versions
from codegen.errors import BadSource
from codegen.families import FAMILIES, KNOB, Family, sizes_of
from codegen.modeldir.directory import ModelDir
from codegen.modeldir.layout import CONFIG, POLICY_FILE
from codegen.modeldir.manifest import Manifest, SourceInfo
from codegen.patch.config import canonical_model_type, config_updates, family_of, parse_config, restore_info
from codegen.patch.source import ModelSource, installed_transformers_version, resolve_source, resolve_text_source

PACKAGE = Path(__file__).resolve().parent.parent
#: the code whose every byte shapes what `patch` writes: the patch path, the policy (its runtime is embedded),
#: the config.json editor and the templates; the family table counts by its rows' output-shaping fields
#: (Family.output_data), so editing the harness, the bench or an example shape leaves users' dirs up to date
OUTPUT_CODE = (PACKAGE / "patch", PACKAGE / "policy", PACKAGE / "modeldir" / "configjson.py", PACKAGE / "versions.py",
               PACKAGE / "render.py", PACKAGE / "templates")


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
    #: a multimodal wrapper's text decoder module, when it is another family's (patched and written beside)
    text_source: ModelSource | None = None

    @property
    def fingerprint(self) -> dict[str, Any]:
        return {
            "codegen": generator_digest(),
            "family": self.family.model_type,
            "source_kind": self.source.kind,
            "source_sha256": self.source.sha256,
            "text_source_sha256": self.text_source.sha256 if self.text_source is not None else None,
            "source_transformers": self.source.transformers_version,
            "installed_transformers": installed_transformers_version(),
            "coalesce": self.coalesce,
            "config_sha256": hashlib.sha256(self.config_bytes).hexdigest(),
            # what the dir ships besides codegen's own output (a re-patch sees its earlier output there)
            "shipped": sorted(self.source.shipped_modules - {self.source.module_name,
                                                             POLICY_FILE.removesuffix(".py")}),
        }


@dataclass
class Plan:
    """The files `patch` writes and the manifest that records them."""

    inputs: Inputs
    rewrite: Any  # codegen.patch.rewrite.Rewrite
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
    """sha256 over what shapes a patched dir (OUTPUT_CODE, the table's rows): a new codegen never trusts an old
    fingerprint, and a change elsewhere in codegen never marks a patched dir stale."""
    digest = hashlib.sha256(__version__.encode())
    for root in OUTPUT_CODE:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in (".py", ".j2"))
        for path in paths:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(PACKAGE.parent).as_posix().encode() + b"\0" + path.read_bytes())
    rows = [family.output_data() for _, family in sorted(FAMILIES.items())]
    digest.update(json.dumps(rows, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


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
    text_source = resolve_text_source(family, source)
    if family.quantized_forms:
        from codegen.patch.quantization import refuse_unsupported_quantization

        refuse_unsupported_quantization(config, family, source.transformers_version, model_dir.path / CONFIG)
    if coalesce is None:
        coalesce = current_knob(model_dir, manifest)
    notices = []
    raw_type, canonical = config.get("model_type"), canonical_model_type(config)
    if raw_type != canonical:
        notices.append(f"config.json: model_type {raw_type!r} is written as {canonical!r}, its canonical "
                       "spelling (revert restores the original)")
    quant = sizes_of(config).get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        notices.append(f"config.json has quantization_config ({method or 'unknown method'}): the rewrite keeps "
                       "loading as before, but the AutoTP policy is verified on unquantized weights only")
    installed = installed_transformers_version()
    if source.kind == "override" and source.transformers_version != installed:
        seen = source.transformers_version or "an unknown release"
        notices.append(f"--source comes from transformers {seen} but {installed or 'none'} is installed: "
                       "the patched dir is recorded for the source's release")
    return Inputs(model_dir, manifest, config_bytes, config, family, source, coalesce, notices, text_source)


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


def guard_version_of(source: ModelSource) -> str | None:
    """transformers' own modeling code only runs under the release it came from; remote code is its own."""
    return source.transformers_version if source.kind in ("builtin", "override") else None


def is_legacy(source: ModelSource) -> bool:
    """A transformers 4.x source (the family's Legacy names apply); remote code names as 5.x does."""
    return source.kind in ("builtin", "override") and versions.is_legacy(source.transformers_version)


def family_policy(family: Family, modeling_module: str, legacy: bool) -> str:
    """The `autotp_policy.py` for a source of this family (`legacy`: a transformers 4.x source, whose names the
    family's Legacy row gives): the table's data handed to the renderer as plain data."""
    from codegen.policy.assemble import render_policy

    return render_policy(family.policy_layout(legacy), next(iter(family.auto_classes)), KNOB, modeling_module)


def build_plan(inputs: Inputs) -> Plan:
    # libcst and jinja2 are the slow imports: only a plan that has work to do pays for them
    from codegen.modeldir import configjson
    from codegen.patch.rewrite import RewriteTarget, SourceToRewrite, rewrite_modeling, rewrite_wrapper

    family, source, text = inputs.family, inputs.source, inputs.text_source
    restore = restore_info(inputs.config, family)
    shipped = source.shipped_modules - {source.module_name}
    if text is None:
        target = RewriteTarget(family, source.package, shipped, source.origin_path, source.transformers_version)
        rewrite = rewrite_modeling(source.text, target, guard_version_of(source), restore)
        modeling = {source.output_name: rewrite.code}
    else:  # the MoE blocks live in the text decoder's module; the wrapper's own module builds it from there
        target = RewriteTarget(family, source.package, shipped, source.origin_path, source.transformers_version)
        text_target = RewriteTarget(family, text.package, frozenset(), text.origin_path, text.transformers_version)
        rewrite, wrapper = rewrite_wrapper(SourceToRewrite(source.text, target, guard_version_of(source)),
                                           SourceToRewrite(text.text, text_target, guard_version_of(text)),
                                           text.module_name, restore)
        modeling = {source.output_name: wrapper.code, text.output_name: rewrite.code}
    policy = family_policy(family, source.module_name, is_legacy(source))
    updates, changes = config_updates(inputs.config, family, source.module_name, inputs.coalesce)
    files = {
        **{name: code.encode("utf-8") for name, code in modeling.items()},
        POLICY_FILE: policy.encode("utf-8"),
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
