"""Per-family knowledge, as data: one table a reader can scan, fed to one generic rewriter, policy and harness.

This package is the only place that names a model type, a class, an attribute or a config key of a family.
The rewriter (codegen.patch.rewrite), the generated AutoTP policy (its header is rendered from
`Family.policy_layout()`), the rank worker, the examples, the bench and the tests all read from here,
so supporting a new family is a reviewed row of the table plus, at most, a new kind (anchor, expert layout,
attention rule, layer key) that every family can use.

- `kinds`: the dataclasses a row is written in, the constants rows name, the defaults and derivations;
- `table`: the rows (`FAMILIES`) and the aliases (`ALIASES`): every field of a row shapes what `patch` writes;
- `unsupported`: the MoE model types `patch` refuses, and why;
- `examples`, `stock`: test and bench data by model type, beside the table (example checkpoint shapes, the measured
  stock AutoTP figures): none of it shapes a patched dir.

Import from `codegen.families`, not from its modules.
"""

from __future__ import annotations

from codegen.families.examples import EXAMPLES, FULL_WIDTH_CAPS, PUBLISHED_ROUTING_KEYS, Examples
from codegen.families.kinds import ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, \
    ANCHOR_ROUTED_STATEMENT, ANCHOR_SHARED_INPLACE_SUM, ANCHOR_SHARED_SUM, COMMON_SIZES, HEADS_AND_WIDTHS, \
    IMAGE_FLAT_PATCHES, IMAGE_PATCH_ROWS, IMAGE_POSITIONED_PATCHES, IMAGE_SIZED, IMAGE_WHOLE, KNOB, SPARSE_LAYER, TEXT_CONFIG, VISION_CONFIG, AUDIO_CONFIG, Alias, Family, FusedExperts, Legacy, LinearAttention, \
    MoELayers, PerExpertMLP, QuantizedForm, Wrapper
from codegen.families.stock import STOCK_AUTOTP, UNSUPPORTED_STOCK, StockAutoTP
from codegen.families.table import ALIASES, FAMILIES
from codegen.families.unsupported import NOT_YET, REFUSED, UNSUPPORTED, Unsupported

__all__ = [
    "ALIASES", "ANCHOR_RETURNED_ROUTED", "ANCHOR_RETURNED_SUM", "ANCHOR_ROUTED_FINAL", "ANCHOR_ROUTED_STATEMENT",
    "ANCHOR_SHARED_INPLACE_SUM", "ANCHOR_SHARED_SUM",
    "COMMON_SIZES", "EXAMPLES", "FAMILIES", "FULL_WIDTH_CAPS", "HEADS_AND_WIDTHS", "IMAGE_FLAT_PATCHES",
    "IMAGE_PATCH_ROWS", "IMAGE_POSITIONED_PATCHES", "IMAGE_SIZED", "IMAGE_WHOLE", "KNOB", "NOT_YET", "PUBLISHED_ROUTING_KEYS", "REFUSED", "SPARSE_LAYER",
    "STOCK_AUTOTP", "TEXT_CONFIG", "UNSUPPORTED", "UNSUPPORTED_STOCK", "VISION_CONFIG", "AUDIO_CONFIG", "Alias", "Examples", "Family", "FusedExperts",
    "Legacy", "LinearAttention", "MoELayers", "PerExpertMLP", "QuantizedForm", "StockAutoTP", "Unsupported",
    "Wrapper", "family_named", "fused_attr_names", "moe_class_names", "normalise_model_type", "sizes_of",
    "supported_model_types",
]


def normalise_model_type(raw: object) -> str | None:
    """`Qwen2_MoE`, ` qwen2-moe ` and `qwen2_moe` name the same family (or alias); anything else is unknown."""
    if not isinstance(raw, str):
        return None
    key = raw.strip().lower().replace("-", "_")
    return key if key in FAMILIES or key in ALIASES else None


def supported_model_types() -> list[str]:
    """Every model type `patch` takes, sorted: the families' and their aliases'."""
    return sorted({*FAMILIES, *ALIASES})


def sizes_of(config: dict) -> dict:
    """The keys a config.json's sizes are read from: a multimodal config nests its text decoder's in `text_config`
    (a wrapper run through a text submodule one level further down, in that submodule's config)."""
    text = config.get(TEXT_CONFIG)
    if not isinstance(text, dict):
        subs = [config.get(k) for k in SUBMODULE_CONFIGS]
        text = next((s[TEXT_CONFIG] for s in subs if isinstance(s, dict) and isinstance(s.get(TEXT_CONFIG), dict)),
                    None)
    nested = [config[k] for k in NESTED_SIZES if isinstance(config.get(k), dict)]
    if not nested:
        return {**text, **config} if isinstance(text, dict) else config
    merged = {**text} if isinstance(text, dict) else {}
    for sub in nested:
        merged.update(sub)
    return {**merged, **config}


#: the config keys of wrappers' text submodules (`Wrapper.submodule_config`): each nests a `text_config`
SUBMODULE_CONFIGS = tuple(dict.fromkeys(f.wrapper.submodule_config for f in FAMILIES.values()
                                        if f.wrapper is not None and f.wrapper.submodule_config))
#: sub-configs some family reads sizes from (`Family.nested_sizes`)
NESTED_SIZES = tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.nested_sizes))


def family_named(model_type: str) -> Family:
    """The family a canonical model type names: its own row, or the row an alias points at."""
    alias = ALIASES.get(model_type)
    return FAMILIES[alias.family] if alias is not None else FAMILIES[model_type]


def moe_class_names() -> frozenset[str]:
    """Every MoE block class of every family (the harness finds blocks by these)."""
    return frozenset(name for f in FAMILIES.values() for name in f.moe_classes)


def fused_attr_names() -> frozenset[str]:
    """Every fused-expert Parameter name of every family, any generation (the harness reports them as sharded)."""
    return frozenset(n for f in FAMILIES.values() for legacy in (False, True) for n in f.names(legacy)[0].parameters)
