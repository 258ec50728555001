"""How much memory a bench run needs, known before it loads anything, so it can refuse in one line.

A full-width example is several GB per copy and a bench keeps several copies alive at once (one per setup
and rank, plus a float32 reference and the copy a loader holds while it builds a setup): running out of
memory half-way kills the machine's other work, not only the bench. The sizes come from the model built
on the meta device (shapes only, no weights), split the way the rank worker splits them: routed experts,
which tensor parallelism shards, and the rest.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from codegen.families import FAMILIES, fused_attr_names

#: attributes of an MoE block holding routed experts, any family
EXPERT_ATTRS = frozenset(family.experts_attr for family in FAMILIES.values())
#: fused-expert Parameter names, any family
FUSED = fused_attr_names()
#: fused-expert Parameters an MoE block holds itself (no experts module: 4.x GraniteMoe's `input_linear.weight`)
BLOCK_HELD = frozenset(f"{block}.{p}" for family in FAMILIES.values() for legacy in (False, True)
                       if family.experts_attr_of(legacy) == "" for block in family.moe_block_attrs
                       for p in family.names(legacy)[0].parameters)
#: expert biases added after the row-parallel product: replicated on every rank, so counted with the rest
ROW_PARALLEL_BIASES = frozenset(family.fused.down_bias for family in FAMILIES.values() if family.fused.down_bias)

#: the bench's setups: stock DeepSpeed AutoTP, codegen's policy, transformers' own `tp_plan="auto"`
SETUP_STOCK, SETUP_CODEGEN, SETUP_NATIVE = "stock", "codegen", "native"
SETUPS = (SETUP_STOCK, SETUP_CODEGEN, SETUP_NATIVE)
#: (e): the unpatched model, unsharded, in one process on every core the ranks have together; it cannot share the
#: ranks' processes, so it runs in a launch of its own (one rank) after theirs
SETUP_SINGLE = "single"
#: (f): codegen's sharded model with its forward compiled (`init_inference(..., compile=True)`); it shares (b)'s
#: weights in the same processes, so it holds no bytes of its own
SETUP_COMPILED = "compiled"
#: the order codegen.harness.worker.main loads them in: codegen's whole-copy transient first, while nothing else is
#: held; (f) right after (b), whose model it compiles
LOAD_ORDER = (SETUP_CODEGEN, SETUP_COMPILED, SETUP_NATIVE, SETUP_STOCK, SETUP_SINGLE)

#: bytes per element of the dtypes a run uses (torch attribute names)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: headroom `fits` keeps above the plan's peak: allocator slack, activations, the interpreter and
#: DeepSpeed's buffers per rank are not in the plan (they are small next to full-width weights)
SAFETY_FRACTION = 0.10
SAFETY_BYTES = 1 << 30

GIB = float(1 << 30)


def is_expert_param(name: str) -> bool:
    """A routed expert weight (sharded 1/tp by TP); a row-parallel expert bias counts as the rest (replicated)."""
    if name.endswith(tuple(f".{e}.{b}" for e in EXPERT_ATTRS for b in ROW_PARALLEL_BIASES)):
        return False
    if name.endswith(tuple(f".{p}" for p in BLOCK_HELD)):
        return True
    return any(f".{e}." in name or name.endswith(tuple(f".{e}.{f}" for f in FUSED)) for e in EXPERT_ATTRS)


def _kept_in_float32(model, dtype: str) -> re.Pattern | None:
    """Parameters the loader keeps in float32 at a 16-bit dtype (`_keep_in_fp32_modules[_strict]`), or None.

    transformers keeps the plain list in float32 at float16 only and the strict list at float16 and bfloat16
    (e.g. routers' `gate.weight` of the DeepSeek families on 5.x, gpt-oss's norms at float16).
    """
    names = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in ("float16", "bfloat16") else []
    if dtype == "float16":
        names += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return None
    return re.compile("|".join(rf"((^|\.){re.escape(n)}($|\.))" for n in names))


def parameter_bytes(config_dir: Path, dtype: str) -> dict:
    """Bytes of the model's Parameters at `dtype`: {"experts", "rest", "total", "float32_total", "fused"}.

    Built on the meta device from config.json alone (the dir's own code when it names some: a patched dir
    loads its patched classes, as the bench will), so a multi-GB checkpoint costs nothing to measure.
    """
    import torch
    import transformers

    from codegen.models import auto_class, dtype_keyword

    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    config = transformers.AutoConfig.from_pretrained(config_dir, trust_remote_code=True)
    with torch.device("meta"):  # built at the run dtype: a Parameter a module creates in its own dtype keeps it
        model = auto_class(config_dir).from_config(config, trust_remote_code=True,
                                                   **{dtype_keyword(): getattr(torch, dtype)})
    kept = _kept_in_float32(model, dtype)
    experts = rest = elements = largest = largest_float32 = 0
    for name, param in model.named_parameters():
        width = DTYPE_BYTES["float32"] if kept is not None and kept.search(name) else param.element_size()
        elements += param.numel()
        if is_expert_param(name):
            experts += param.numel() * width
            largest = max(largest, param.numel() * width)
            largest_float32 = max(largest_float32, param.numel() * DTYPE_BYTES["float32"])
        else:
            rest += param.numel() * width
    # fused 3-D experts: what stock AutoTP leaves whole on every rank (its memory plan counts them whole)
    fused = any(name.rsplit(".", 1)[-1] in FUSED for name, _ in model.named_parameters())
    converted = fused and _converted_on_load(config.model_type)
    return {"experts": experts, "rest": rest, "total": experts + rest,
            "float32_total": elements * DTYPE_BYTES["float32"], "fused": fused,
            "loader_transient": largest if converted else 0,
            "loader_transient_float32": largest_float32 if converted else 0}


def _converted_on_load(model_type: str) -> bool:
    """Whether transformers converts this model type's checkpoints as it loads them (5.x: per-expert tensors
    stacked into fused 3-D Parameters).

    A converted load holds the stacked Parameter beside the per-expert tensors it stacks: measured, transformers
    5.24 loading the full-width Qwen3.5-35B-A3B-like example (6.32 GiB float32) peaked 1.8 GiB of anonymous memory
    above its Parameters, about its largest fused expert Parameter (2.0 GiB). A checkpoint loaded as stored stays in
    the file's pages (gpt-oss: 0.1 GiB anonymous), which the kernel can drop.
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # 4.x: no conversion, and no fused experts either
        return False
    return bool(get_checkpoint_conversion_mapping(model_type))


def available_bytes() -> int:
    """Memory a new process can take without swapping (MemAvailable); the machine's total where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(parts: dict, tp: int, setups: list[str], experts_replicated_stock: bool) -> dict:
    """Bytes a bench run holds, per setup and rank and in total, from `parameter_bytes` at the run dtype.

    Upper bounds: every non-expert Parameter counts whole on every rank (attention and dense MLPs shard,
    embeddings, norms and routers do not); `native` counts its experts whole (transformers' `tp_plan` does
    not shard every family's experts); `stock` counts them whole where `experts_replicated_stock` (transformers
    >= 5: AutoTP leaves fused 3-D experts replicated). Two transients come on top of the setups: the float32
    reference each rank loads first and frees, and the full checkpoint copy a rank holds while a setup loads
    (next to the setups loaded before it, in LOAD_ORDER), each with the loader's own transient where it converts the
    checkpoint (`loader_transient`).
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    unknown = [s for s in setups if s not in SETUPS + (SETUP_COMPILED,)]
    if unknown:
        raise ValueError(f"unknown setup(s) {', '.join(unknown)}; known: {', '.join(SETUPS + (SETUP_COMPILED,))}")
    setups = [s for s in setups if s != SETUP_COMPILED]  # (b)'s weights
    transient = parts.get("loader_transient", 0)  # on top of each whole copy a load holds (`parameter_bytes`)
    sharded = math.ceil(parts["experts"] / tp)
    experts_per_rank = {
        SETUP_CODEGEN: sharded,
        SETUP_STOCK: parts["experts"] if experts_replicated_stock else sharded,
        SETUP_NATIVE: parts["experts"],
    }
    per_setup = {s: experts_per_rank[s] + parts["rest"] for s in setups}
    resident_total = tp * sum(per_setup.values())
    reference_total = tp * (parts["float32_total"] + parts.get("loader_transient_float32", 0))
    # the rank worker loads codegen first (a whole copy, then its shards), then native, then stock: each
    # load holds a whole checkpoint copy next to the setups already resident
    held, steps = 0, []
    for setup in [s for s in LOAD_ORDER if s in per_setup]:
        steps.append(held + parts["total"] + transient + (per_setup[setup] if setup == SETUP_CODEGEN else 0))
        held += per_setup[setup]
    loading_total = tp * max(steps)
    return {
        "tp": tp,
        "per_setup_per_rank": per_setup,
        "resident_total": resident_total,
        "reference_total": reference_total,
        "loading_total": loading_total,
        "peak_total": max(reference_total, loading_total),
    }


def required_bytes(run_plan: dict) -> int:
    """The plan's peak plus the safety margin (SAFETY_FRACTION of it and SAFETY_BYTES)."""
    return math.ceil(run_plan["peak_total"] * (1 + SAFETY_FRACTION)) + SAFETY_BYTES


def fits(run_plan: dict, available: int) -> bool:
    """Whether the run's peak, with the safety margin, fits in `available` bytes."""
    return required_bytes(run_plan) <= available


def describe(run_plan: dict, available: int) -> str:
    """One line for the bench's start (or its refusal): what it needs against what the machine has."""
    setups = ", ".join(f"{s} {b / GIB:.2f}" for s, b in run_plan["per_setup_per_rank"].items())
    return (f"memory: needs {required_bytes(run_plan) / GIB:.1f} GiB (peak {run_plan['peak_total'] / GIB:.1f} GiB "
            f"+ {SAFETY_FRACTION:.0%} + {SAFETY_BYTES / GIB:.0f} GiB; per rank GiB: {setups}; tp {run_plan['tp']}), "
            f"{available / GIB:.1f} GiB available")
