"""Quantized checkpoints whose experts `patch` cannot shard yet: refused before anything is written.

A family lists, in `Family.refused_quantization`, the `quantization_config.quant_method` values its
checkpoints ship and that the policy cannot shard (gpt-oss ships its experts as MXFP4 `*_blocks`/`*_scales`),
each with the workaround to quote. The refusal is one line: what is wrong, and what to do instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

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


def refuse_unsupported_quantization(config: Mapping, family: Family, where: Path | str) -> None:
    """Raise BadInput (one line) if the dir's checkpoint is quantized in a form the family refuses."""
    method = quant_method(config)
    workaround = family.refused_quantization.get(method) if method else None
    if workaround:
        raise BadInput(f"{where}: {family.model_type} checkpoint quantized as {method}: {workaround}")
