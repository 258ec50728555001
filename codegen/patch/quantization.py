"""Quantized checkpoints a patched dir cannot load exactly with the installed transformers: refused up front.

gpt-oss ships its experts as MXFP4 (`*_blocks`/`*_scales`, `quantization_config.quant_method` "mxfp4").
transformers 5.x dequantizes them on load into any class of the family's layout, patched or not (verified:
0 missing/unexpected keys, dequantized experts and logits identical to the built-in model). transformers
4.x recognises the experts to dequantize by the built-in class only: a patched dir would load without a
missing key and run on uninitialised expert memory. The family table names each such form and the first
release that loads it (`Family.quantized_forms`); below it `patch` refuses in one line naming the way out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from packaging.version import InvalidVersion, Version

from codegen.errors import BadInput
from codegen.families import Family


def quant_method(config: Mapping) -> str | None:
    """`quantization_config.quant_method` of a config.json (top level or a nested `text_config`), normalised."""
    for scope in (config, config.get("text_config")):
        if not isinstance(scope, Mapping):
            continue
        quantization = scope.get("quantization_config")
        if isinstance(quantization, Mapping) and isinstance(quantization.get("quant_method"), str):
            return quantization["quant_method"].strip().lower()
    return None


def refuse_unsupported_quantization(
    config: Mapping, family: Family, transformers_version: str | None, where: Path | str
) -> None:
    """Raise BadInput (one line) if the installed transformers cannot load this quantized form into a patched dir.

    `transformers_version` is the release whose source `patch` rewrites (None: unknown, e.g. remote code
    only; then only the listed minimum counts as proof, so the form is refused).
    """
    method = quant_method(config)
    for form in family.quantized_forms:
        if form.quant_method != method or _at_least(transformers_version, form.min_transformers):
            continue
        seen = f"transformers {transformers_version}" if transformers_version else "an unknown transformers"
        raise BadInput(
            f"{where}: {family.model_type} checkpoint quantized as {method} loads into a patched dir only with "
            f"transformers >= {form.min_transformers} ({seen} would leave its experts unloaded): upgrade "
            f"transformers, or dequantize it once with {form.dequantize_hint}"
        )


def _at_least(version: str | None, minimum: str) -> bool:
    if version is None:
        return False
    try:
        return Version(version) >= Version(minimum)
    except InvalidVersion:
        return False
