"""What the worker measures on a loaded model: its MoE blocks, routers, layers, parameter bytes, sharded weights.

Every name comes from the family table (codegen.families): MoE block classes, router attributes, the
decoder layer's attention and MLP attributes, fused expert Parameters.
"""

from __future__ import annotations

import gc

import torch

from codegen.families import FAMILIES, moe_class_names
from codegen.harness.memory import FUSED, ROW_PARALLEL_BIASES, is_expert_param
from codegen.policy.runtime.base import REDUCER_ATTR, SHARDED_FLAG, SHARDED_TENSORS, attribute

MOE_CLASSES = moe_class_names()
#: router attributes of each MoE block class, either generation's names (kept whole on every rank)
ROUTERS = {cls: tuple(dict.fromkeys(family.names(False)[1] + family.names(True)[1]))
           for family in FAMILIES.values() for cls in family.moe_classes}
#: decoder-layer attributes holding the MLP or MoE block, every family and generation ("mlp" first)
MLP_ATTRS = tuple(dict.fromkeys(a for family in FAMILIES.values() for a in family.moe_block_attrs))
#: decoder-layer attributes holding an attention block (of any kind), every family
ATTENTION_ATTRS = tuple(dict.fromkeys(a for family in FAMILIES.values() for a in family.attention_attrs))
#: decoder-layer attributes holding dense MLP sublayers beside the MoE block, every family
DENSE_MLP_ATTRS = tuple(dict.fromkeys(a for family in FAMILIES.values() for a in family.dense_mlp_attrs))
#: attributes of a multimodal wrapper's vision tower and projector, every family (their layers are not the decoder's)
WRAPPER_PARTS = frozenset(a for family in FAMILIES.values() if family.wrapper for a in family.wrapper.replicated)
#: classes of the token mixers families keep whole on every rank (`Family.whole_modules`): they add no reduction
WHOLE_CLASSES = frozenset(c for family in FAMILIES.values() for c in family.whole_modules)
#: the dense MLPs' down projections, every family: a single-mixer block holding one is a dense MLP
DOWN_NAMES = tuple(dict.fromkeys(family.per_expert.down for family in FAMILIES.values()))


def moe_blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in MOE_CLASSES]


def router_params(model) -> dict:
    """name -> (parameter, router module) of every router the family table names, in every MoE block."""
    found = {}
    for block_name, block in model.named_modules():
        for attr in ROUTERS.get(type(block).__name__, ()):
            router = attribute(block, attr)  # a dotted path: the router of one of the block's expert sets
            if isinstance(router, torch.nn.Module):
                for pname, p in router.named_parameters():
                    found[f"{block_name}.{attr}.{pname}"] = (p, router)
    return found


def param_bytes(model) -> dict:
    gates = set(router_params(model))
    experts = routers = total = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor (native TP): this rank's shard
        size = local.numel() * local.element_size()
        total += size
        if is_expert_param(name):  # the one rule, shared with the bench's memory plan
            experts += size
        elif name in gates:
            routers += size
    return {"experts": experts, "gates": routers, "rest": total - experts, "total": total}


def gate_weights(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, (p, _) in router_params(model).items()}


def gate_types(model) -> dict:
    """Class name of each router module (the module owning a gate weight)."""
    return {n: type(module).__name__ for n, (_, module) in router_params(model).items()}


def layer_mlp(layer):
    """The decoder layer's MLP or MoE block, under any name the family table gives it (any generation)."""
    for attr in MLP_ATTRS:
        block = getattr(layer, attr, None)
        if isinstance(block, torch.nn.Module):
            return block
    return None


def attention_reductions(block) -> int:
    """The all-reduces an attention block of the decoder needs: none when it is kept whole on every rank."""
    # the block itself, or the module holding it (DBRX's norm_attn_norm: two norms around the attention)
    return 0 if any(type(m).__name__ in WHOLE_CLASSES for m in block.modules()) else 1


def layer_attention(layer):
    """The decoder layer's attention block, of whichever kind the layer has (the table's attention attributes)."""
    for attr in ATTENTION_ATTRS:
        block = getattr(layer, attr, None)
        if isinstance(block, torch.nn.Module):
            return block
    return None


def sublayers(block) -> list:
    """One block, or each of a ModuleList's (a decoder layer holding two attention or MLP sublayers: LongCat)."""
    if isinstance(block, torch.nn.ModuleList):
        return [b for b in block if isinstance(b, torch.nn.Module)]
    return [] if block is None else [block]


def layer_dense_mlps(layer) -> list:
    """The dense MLP sublayers a decoder layer holds beside its MoE block (the table's `dense_mlp_attrs`)."""
    return [b for attr in DENSE_MLP_ATTRS for b in sublayers(getattr(layer, attr, None))]


def layer_units(layer, block_ids: set) -> tuple:
    """(attention block, MLP or MoE block) of a decoder layer. A layer that is ONE mixer under one attribute
    (`Family.single_mixer_blocks`: Nemotron-H) holds one or the other: its MoE block (`block_ids`) or a dense MLP
    (it holds a down projection of the table's names) as the MLP, any other mixer as the attention."""
    attention, mlp = layer_attention(layer), layer_mlp(layer)
    if attention is None or attention is not mlp:
        return attention, mlp
    if id(mlp) in block_ids or any(isinstance(mlp._modules.get(down), torch.nn.Module) for down in DOWN_NAMES):
        return None, mlp
    return attention, None


def block_groups(model) -> dict:
    """The blocks whose all-reduces are counted apart: {"attention", "moe", "dense_mlp", "lm_head": [modules]}."""
    layers = decoder_layers(model)
    blocks = moe_blocks(model)
    block_ids = {id(b) for b in blocks}
    units = [layer_units(layer, block_ids) for layer in layers]
    return {
        "attention": [a for attention, _ in units for a in sublayers(attention)],
        "moe": blocks,
        "dense_mlp": [mlp for _, mlp in units if mlp is not None and id(mlp) not in block_ids]
        + [mlp for layer in layers for mlp in layer_dense_mlps(layer)],
        "lm_head": [m for m in [output_embeddings(model)] if m is not None],
    }


def nested_in_blocks(groups: dict) -> list[list]:
    """Per MoE block of `groups["moe"]`, the attention and dense MLP blocks inside it. An MoE block that is a whole
    decoder layer (the table's `block_reductions`: Gemma 4) holds them; its MoE figures are what runs in it outside
    them."""
    return [[inner for key in ("attention", "dense_mlp") for inner in groups[key]
             if inner is not None and any(inner is sub for sub in b.modules())] for b in groups["moe"]]


def output_embeddings(model):
    """The model's LM head: its own `get_output_embeddings()`, else (a wrapper that builds its text decoder as a whole
    causal LM and does not delegate it: Nemotron-H Omni's `language_model`) the first submodule's that has one."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        return head
    for module in model.modules():
        if module is not model and hasattr(module, "get_output_embeddings"):
            head = module.get_output_embeddings()
            if head is not None:
                return head
    return None


def decoder_layers(model) -> list:
    """The text decoder's layers (a vision tower's blocks, which also hold attention and an MLP, are not)."""
    return [m for name, m in model.named_modules() if layer_attention(m) is not None and layer_mlp(m) is not None
            and not WRAPPER_PARTS & set(name.split("."))]


def cache_of(output):
    """The model's KV cache from a forward output (transformers 5.x renamed `past_key_values` to `cache`)."""
    for attr in ("past_key_values", "cache"):
        value = getattr(output, attr, None)
        if value is not None:
            return value
    return None



def gates_intact(model, full_gates: dict) -> bool:
    now = gate_weights(model)
    return bool(full_gates) and now.keys() == full_gates.keys() and all(torch.equal(now[k], full_gates[k]) for k in now)


def sharded_tensors(model) -> dict:
    """name -> tensor of every weight this rank holds a shard of: DeepSpeed's TP layers, codegen's fused experts and
    linear attention."""
    try:
        from deepspeed.module_inject.layers import TensorParallel_Layer
    except ImportError:  # older DeepSpeed
        from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

        TensorParallel_Layer = (LinearAllreduce, LinearLayer)
    found = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, TensorParallel_Layer) and isinstance(getattr(module, "weight", None), torch.Tensor):
            found[prefix + "weight"] = module.weight
        if getattr(module, SHARDED_FLAG, False):
            for attr in sorted(FUSED - ROW_PARALLEL_BIASES):
                if isinstance(getattr(module, attr, None), torch.Tensor):
                    found[prefix + attr] = getattr(module, attr)
        for attr in getattr(module, SHARDED_TENSORS, ()):  # what the policy cut itself (linear attention)
            found[prefix + attr] = module.get_parameter(attr)
    return found


def sharding_figures(model, ref, scan: bool = True) -> dict:
    """Sharded weights: registered Parameters, their bytes vs. unsharded, no full-size storage alive.

    `scan` walks every live object (~1 s) for tensors with the full shape of a sharded weight;
    without it `full_size_copies_alive` is None.
    """
    sharded = sharded_tensors(model)
    params = dict(model.named_parameters())
    state = model.state_dict()
    unregistered = [
        n for n, t in sharded.items()
        if not isinstance(t, torch.nn.Parameter) or params.get(n) is not t or n not in state
        or tuple(state[n].shape) != tuple(t.shape) or state[n].data_ptr() != t.data_ptr()
    ]
    # a shard that is a view of the full tensor keeps the full storage alive (an unsharded weight may be a view: a
    # loader that splits a packed checkpoint tensor leaves views of it, and nothing is freed by sharding it)
    oversized = [n for n, p in params.items() if n in sharded
                 and p.untyped_storage().nbytes() > p.numel() * p.element_size()]
    sharded_bytes = sum(t.numel() * t.element_size() for t in sharded.values())
    sharded_full = sum(ref.param_bytes.get(n, 0) for n in sharded)
    # any other live tensor with the full shape of a sharded weight (a copy DeepSpeed or the policy kept)
    full_shapes = {ref.shapes[n] for n, t in sharded.items() if n in ref.shapes and tuple(t.shape) != ref.shapes[n]}
    alive = 0 if scan else None
    alive_shapes: list[list[int]] = []
    if scan and full_shapes:
        gc.collect()
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        own |= {t.untyped_storage().data_ptr() for t in ref.tensors()}  # the harness's own reference copies
        for obj in gc.get_objects():
            try:
                if (isinstance(obj, torch.Tensor) and not obj.is_meta and tuple(obj.shape) in full_shapes
                        and obj.untyped_storage().data_ptr() not in own):
                    alive += 1
                    alive_shapes.append(list(obj.shape))
            except Exception:  # noqa: BLE001 - tensor subclasses without storage
                continue
    return {
        "tp_group_ranks": _tp_group_ranks(model),
        "sharded_params": len(sharded),
        "sharded_shapes": {n: [list(t.shape), list(ref.shapes.get(n, ()))] for n, t in sharded.items()},
        "sharded_unregistered": unregistered,
        "sharded_bytes": sharded_bytes,
        "sharded_full_bytes": sharded_full,
        "sharded_unknown": [n for n in sharded if n not in ref.param_bytes],
        "oversized_storage_params": oversized,
        "full_size_copies_alive": alive,
        "full_size_copies_shapes": alive_shapes,
    }


def _tp_group_ranks(model) -> list:
    """The distinct global-rank lists of the groups DeepSpeed's TP layers and codegen's reducers reduce over."""
    groups = []
    for module in model.modules():
        reducer = getattr(module, REDUCER_ATTR, None)
        for group in (getattr(module, "mp_group", None), getattr(reducer, "group", None)):
            if group is None:
                continue
            ranks = torch.distributed.get_process_group_ranks(group)
            if ranks not in groups:
                groups.append(ranks)
    return groups
