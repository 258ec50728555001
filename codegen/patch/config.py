"""config.json as `patch` reads it: parsed, its family found, its sizes checked, and the keys `patch` changes.

Implausible configs are refused here in one line (codegen.errors.BadInput): a missing or non-integer size,
top-k above the number of experts, no MoE layer left by the family's layer-selection keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from codegen.errors import BadInput
from codegen.families import ALIASES, FAMILIES, KNOB, REFUSED, UNSUPPORTED, UNSUPPORTED_STOCK, \
    Family, family_named, normalise_model_type, sizes_of, supported_model_types
from codegen.modeldir.layout import CONFIG


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
        raise BadInput(f"{directory / CONFIG}: model_type {raw!r} {_why_not(raw)}; {_stock_of(raw)} (supported: "
                       f"{', '.join(supported_model_types())})")
    alias = ALIASES.get(key)
    if alias is not None and not isinstance(config.get("auto_map"), dict):
        raise BadInput(f"{directory / CONFIG}: model_type {raw!r} checkpoints ship their modeling code "
                       f"({alias.remote_module}.py, named by auto_map) and this config has no auto_map: download the "
                       "checkpoint with its .py files")
    family = family_named(key)
    _validate_sizes(config, family, directory)
    return family


def canonical_model_type(config: dict) -> str | None:
    """The model type `patch` writes: the canonical spelling of the family or alias the config names."""
    return normalise_model_type(config.get("model_type"))


def _why_not(raw: object) -> str:
    """`is refused: <why>` / `is not supported yet: <why>` for a type the table knows of, else the nearest family."""
    key = raw.strip().lower().replace("-", "_") if isinstance(raw, str) else None
    known = UNSUPPORTED.get(key) if key else None
    if known is not None:
        return f"is {'refused' if known.status == REFUSED else 'not supported yet'}: {known.why}{_nearest(raw)}"
    return f"is not supported yet{_nearest(raw)}"


def _stock_of(raw: object) -> str:
    """What stock DeepSpeed AutoTP does to the unpatched dir, as measured: never advice that leads to a crash or a
    silently wrong sum."""
    key = raw.strip().lower().replace("-", "_") if isinstance(raw, str) else None
    measured = UNSUPPORTED_STOCK.get(key) if key else None
    if measured is not None:
        return f"stock DeepSpeed AutoTP on the unpatched dir {measured}"
    return "stock DeepSpeed AutoTP on it is not measured here: compare its logits with one process before serving it"


def _nearest(raw: object) -> str:
    """`qwen3_next` -> ` (nearest supported family: qwen3_moe)`: the table's relatives, else a near spelling."""
    if not isinstance(raw, str):
        return ""
    import difflib

    key = raw.strip().lower().replace("-", "_")
    related = [name for name, family in FAMILIES.items() if key in family.relatives]
    close = related or difflib.get_close_matches(key, list(FAMILIES), n=1, cutoff=0.8)
    return f" (nearest supported family: {close[0]})" if close else ""


def _validate_sizes(config: dict, family: Family, directory: Path) -> None:
    where = directory / CONFIG
    sizes = sizes_of(config)
    if not any(k in sizes for k in family.num_experts_keys):
        raise BadInput(f"{where}: missing {family.num_experts_keys[0]} (number of routed experts): not an MoE config")
    for key in family.positive_int_keys:
        if key not in sizes:
            continue
        value = sizes[key]
        if key in family.per_set_sizes and isinstance(value, list) and len(value) == len(family.expert_sets) \
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            continue  # one size per expert set
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
    layers = sizes.get(family.layers.count)
    if isinstance(layers, int) and layers > 0 and isinstance(experts, int) and not moe_layers(sizes, family):
        raise BadInput(f"{where}: no layer of {layers} is an MoE layer (see {_layer_keys(family)}): "
                       "there is nothing for codegen to coalesce")


def moe_layers(sizes: dict, family: Family) -> list[int]:
    """The decoder layers that hold an MoE block, by the family's layer-selection keys (codegen.families.MoELayers)."""
    rule = family.layers

    def value(key: str | None):
        return sizes.get(key) if key else None

    types = value(rule.types)
    if not isinstance(types, list) and isinstance(value(rule.pattern), str):
        types = list(value(rule.pattern))
    count = sizes.get(rule.count)
    if not isinstance(count, int) and isinstance(types, list):  # the per-layer list alone counts the layers
        count = len(types)
    if isinstance(types, list):
        return [i for i, kind in enumerate(types[:count]) if kind in rule.sparse_marks]
    listed = value(rule.moe_list)
    if isinstance(listed, list):
        return [i for i in range(count) if i in listed]
    dense = value(rule.dense_list)
    dense = set(dense) if isinstance(dense, list) else set()
    step, first, last, freq = (value(k) for k in (rule.sparse_step, rule.first_dense, rule.last_moe, rule.freq))
    offset = value(rule.offset) if isinstance(value(rule.offset), int) else 0
    last = last if isinstance(last, int) and last >= 0 else count - 1
    out = []
    for i in range(count):
        if i in dense or i > last:
            continue
        if isinstance(step, int) and step > 0 and (i + 1) % step:
            continue
        if isinstance(first, int) and i < first:
            continue
        if isinstance(freq, int) and freq > 0 and i % freq != offset:
            continue
        out.append(i)
    return out


def _layer_keys(family: Family) -> str:
    return ", ".join(family.layers.keys())


def config_updates(original: dict, family: Family, module: str, coalesce: bool) -> tuple[dict, dict]:
    """The keys `patch` sets in config.json, and the original value of each one it changes."""
    auto_map = dict(original.get("auto_map") or {})
    for auto_class, cls in family.auto_classes.items():
        auto_map[auto_class] = f"{module}.{cls}"
    updates = {"auto_map": auto_map, KNOB: coalesce, "model_type": canonical_model_type(original)}
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
    if original.get("model_type") != canonical_model_type(original):
        info["model_type"] = original.get("model_type")
    return info


def check_tp_divides(config: dict, family: Family, tp: int, where: Path) -> None:
    """Every size the family's tensor parallelism splits (on `text_config` where nested) divides by `tp`: else
    one line (BadInput), before any rank starts."""
    sizes = sizes_of(config)
    for key in family.tp_divisible_keys:
        value = sizes.get(key)
        # a list: one size per expert set (`Family.per_set_sizes`), each split alike
        values = value if key in family.per_set_sizes and isinstance(value, list) else [value]
        if any(isinstance(v, int) and not isinstance(v, bool) and v % tp for v in values):
            raise BadInput(f"{where}: --tp {tp} does not divide {key} = {value}: pick a tensor-parallel size "
                           "that divides it")


def check_rank_dir(model_dir: Path, tp: int, command: str) -> str | None:
    """What `verify`, `serve` and `generate` check before any rank starts: a positive `tp`, a readable config.json,
    and `tp` dividing every size the family splits. Returns the canonical model type (None: not a family codegen
    knows, which the caller refuses or not); anything wrong is one line (BadInput)."""
    if tp < 1:
        raise BadInput(f"--tp must be a positive integer, got {tp}")
    config_path = model_dir / CONFIG
    if not config_path.is_file():
        raise BadInput(f"{model_dir}: no {CONFIG}: point {command} at a patched model dir")
    config = parse_config(config_path.read_bytes(), model_dir)
    model_type = normalise_model_type(config.get("model_type"))
    if model_type is not None:
        check_tp_divides(config, family_named(model_type), tp, config_path)
    return model_type
