"""Routed and shared experts sharded along the intermediate dimension, none reducing on its own.

transformers 4.x experts (a ModuleList of MLPs) and shared experts are sharded by DeepSpeed: gate/up
column-parallel, down row-parallel, turned here into a row layer that leaves its partial sum unreduced.
transformers 5.x fused 3-D experts are left whole by DeepSpeed, so each fused layout is split here; the
Parameters stay the same registered objects and the full tensors are freed.
"""

import torch

from codegen.policy.runtime.base import (FUSED_FLAT_ROWS, FUSED_GATE_UP_HALVES_COLS, FUSED_GATE_UP_INTERLEAVED_COLS,
                                         FUSED_GATE_UP_ROWS, FUSED_UP_ROWS, SHARDED_FLAG, SUPPORTED_DEEPSPEED,
                                         PolicyError, attribute, expert_paths)

#: attributes of DeepSpeed's row-parallel layer that the partial-sum subclass reads
ROW_LAYER_ATTRS = ("weight", "bias", "tp_index")


def _row_partial_class(base):
    """A subclass of DeepSpeed's row-parallel layer that leaves its partial sum unreduced."""

    class RowParallelPartialSum(base):
        def forward(self, input):
            output = torch.matmul(input, self.weight.transpose(-1, -2))
            if self.bias is not None and self.tp_index == 0:
                output = output + self.bias  # added once across the group
            return output

    RowParallelPartialSum.__qualname__ = f"RowParallelPartialSum[{base.__name__}]"
    return RowParallelPartialSum


_PARTIAL_CLASSES = {}


def is_partial(layer):
    return isinstance(layer, tuple(_PARTIAL_CLASSES.values()))


def make_partial(layer, where, row_class):
    """Turn DeepSpeed's row-parallel layer `layer` into one that does not reduce (same object and Parameters)."""
    if is_partial(layer):
        return
    if not isinstance(layer, row_class):
        raise PolicyError(f"{where} is {type(layer).__name__}, not sharded by deepspeed.init_inference as a "
                          "row-parallel layer: the one reduction would sum unsharded outputs")
    missing = [attr for attr in ROW_LAYER_ATTRS if not hasattr(layer, attr)]
    if missing:
        raise PolicyError(f"DeepSpeed's row-parallel layer {where} has no {', '.join(missing)}: "
                          f"unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    base = type(layer)
    if base not in _PARTIAL_CLASSES:
        _PARTIAL_CLASSES[base] = _row_partial_class(base)
    layer.__class__ = _PARTIAL_CLASSES[base]


def shard_mlp(mlp, where, names, column_class, row_class):
    """A per-expert (or shared-expert) MLP: gate/up column-parallel, down row-parallel without its reduction
    (a non-gated MLP, act(up) then down, names no gate)."""
    for role in [r for r in ("gate", "up") if names[r]]:
        layer = getattr(mlp, names[role], None)
        if not isinstance(layer, column_class):
            raise PolicyError(f"{where}.{names[role]} is {type(layer).__name__}, not sharded by "
                              "deepspeed.init_inference as a column-parallel layer")
    make_partial(getattr(mlp, names["down"], None), f"{where}.{names['down']}", row_class)


def shard_experts(block, name, rank, world, layout, column_class, row_class):
    """Routed and shared experts of one MoE block end up sharded, none reducing on its own: else PolicyError.

    Every routed expert set of the block (one per modality where the layout names several) is sharded alike."""
    identity = set(layout.get("identity_experts", ()))
    for path in expert_paths(layout):
        # "": the MoE block holds the fused layout's modules itself (its Parameters are dotted paths from the block)
        experts = attribute(block, path) if path else block
        where = f"{name}.{path}" if path else name
        if isinstance(experts, torch.nn.ModuleList):
            for index, expert in enumerate(experts):
                if expert is not None and type(expert).__name__ not in identity:
                    shard_mlp(expert, f"{where}.{index}", layout["per_expert"], column_class, row_class)
        elif isinstance(experts, torch.nn.Module):
            shard_fused_experts(experts, where, rank, world, layout["fused"])
        else:
            raise PolicyError(f"{name} has no experts module {path!r}: re-run patch")
        if identity and isinstance(experts, torch.nn.Module):
            count_identity_once(experts, where, rank, identity)
    for shared in layout["shared"]:
        module = getattr(block, shared, None)
        if module is not None:
            shard_mlp(module, f"{name}.{shared}", layout["per_expert"], column_class, row_class)
    keep_latent_bias_once(block, layout["fused"].get("latent_out", ""), rank)
    # an MoE block that is a whole decoder layer: its attention and dense MLP reduce on their own, outside the sum
    own = tuple(layout.get("block_reductions", ()))
    for sub, module in block.named_modules():
        if isinstance(module, row_class) and not is_partial(module) and sub.split(".", 1)[0] not in own:
            raise PolicyError(f"{name}.{sub} still reduces on its own inside the MoE block, which the family "
                              "layout does not name: the one reduction would add it again")


class CountedOnAnotherRank(torch.nn.Module):
    """Stands in for a zero-compute (identity) expert on every rank but its group's first: zeros of the token's
    shape, so the routing weight times the token enters the one reduction once, from the first rank."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)


def count_identity_once(experts, where, rank, identity):
    """Zero-compute experts (`identity`: their class names) add the token itself, weighted, inside the routed sum.
    Every rank computes that whole, so the one reduction would add it once per rank: on ranks other than the
    group's first each becomes a `CountedOnAnotherRank` (exact: the others add 0.0; no collective, no weights)."""
    found = [(n, m) for n, m in experts.named_modules()
             if n and (type(m).__name__ in identity or isinstance(m, CountedOnAnotherRank))]
    if not found:
        raise PolicyError(f"{where} holds no zero-compute expert ({', '.join(sorted(identity))}) the family table "
                          "names: re-run patch")
    if rank == 0:
        return
    for path, _ in found:
        parent_path, _, attr = path.rpartition(".")
        parent = experts.get_submodule(parent_path) if parent_path else experts
        parent._modules[attr] = CountedOnAnotherRank()


@torch.no_grad()
def shard_gate_up_rows(experts, where, rank, world, names):
    """gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]: each rank keeps I/world of both.

    gate_up keeps its gate|up packing per rank; down splits its input dimension. The Parameters stay the
    same registered objects; the full tensors are freed.
    """
    params = _fused_params(experts, where, names)
    gate_up, down, gate_up_bias = params["gate_up"], params["down"], params["gate_up_bias"]
    inter = down.shape[-1]
    bias_fits = gate_up_bias is None or gate_up_bias.shape[1] == 2 * inter
    if gate_up.shape[1] != 2 * inter or inter % world or not bias_fits:
        raise PolicyError(f"{where} has {names['gate_up']} {tuple(gate_up.shape)} and {names['down']} "
                          f"{tuple(down.shape)}: cannot split the expert size {inter} over {world} ranks")
    shard = inter // world
    lo, hi = rank * shard, (rank + 1) * shard
    gate_up.data = torch.cat([gate_up.data[:, lo:hi], gate_up.data[:, inter + lo : inter + hi]], dim=1).contiguous()
    if gate_up_bias is not None:  # split with its rows
        gate_up_bias.data = torch.cat([gate_up_bias.data[:, lo:hi], gate_up_bias.data[:, inter + lo : inter + hi]],
                                      dim=1).contiguous()
    down.data = down.data[:, :, lo:hi].clone(memory_format=torch.contiguous_format)
    keep_down_bias_once(params["down_bias"], rank)
    return shard


def _fused_params(experts, where, names):
    """The layout's 3-D gate_up and down Parameters, and its bias Parameters (None where the layout names none)."""
    found = {}
    for role, dims in (("gate_up", 3), ("down", 3), ("gate_up_bias", 2), ("down_bias", 2)):
        attr = names.get(role, "")
        if not attr:
            found[role] = None
            continue
        param = attribute(experts, attr)
        if not isinstance(param, torch.nn.Parameter) or param.dim() != dims:
            raise PolicyError(f"{where} has no {dims}-D Parameter {attr!r} to shard: "
                              "its experts are not the fused layout the family table names")
        found[role] = param
    return found


def keep_down_bias_once(down_bias, rank):
    """The down bias is added inside every expert, before the routing weight and the one reduction.

    Summing the ranks' partial outputs would add it once per rank, so only rank 0 keeps it and the others
    hold zeros of the same shape. That is exact: each rank computes (partial_r + b_r) * w, the reduction adds
    b * w once, and the zeros contribute exactly 0.0 (dividing b by the world size would round for world 3).
    The zeros stay full size: the experts index the bias by expert id, and a whole bias is E * H values.
    """
    if down_bias is not None and rank != 0:
        down_bias.data = torch.zeros_like(down_bias.data)


@torch.no_grad()
def shard_gate_up_interleaved_cols(experts, where, rank, world, names):
    """gate_up [E, H, 2I] with gate/up interleaved along the last dim (gate = ::2, up = 1::2), down [E, I, H].

    Column pair j (gate j at 2j, up j at 2j + 1) is one intermediate unit: a rank keeps whole pairs, the
    contiguous columns [2 lo, 2 hi), so `[..., ::2]` / `[..., 1::2]` still pair each gate with its own up.
    The activation (a clamped SwiGLU) is elementwise per pair, so column sharding commutes with it. down
    keeps rows [lo, hi) of its input dim (1); gate_up_bias [E, 2I] is split with its columns; the down bias
    counts once over the group (keep_down_bias_once).
    """
    params = _fused_params(experts, where, names)
    gate_up, down = params["gate_up"], params["down"]
    inter = down.shape[1]
    if gate_up.shape[2] != 2 * inter or inter % world or (
            params["gate_up_bias"] is not None and params["gate_up_bias"].shape[1] != 2 * inter):
        raise PolicyError(f"{where} has {names['gate_up']} {tuple(gate_up.shape)} and {names['down']} "
                          f"{tuple(down.shape)}: cannot split the expert size {inter} over {world} ranks")
    shard = inter // world
    lo, hi = rank * shard, (rank + 1) * shard
    gate_up.data = gate_up.data[:, :, 2 * lo : 2 * hi].clone(memory_format=torch.contiguous_format)
    if params["gate_up_bias"] is not None:
        bias = params["gate_up_bias"]
        bias.data = bias.data[:, 2 * lo : 2 * hi].clone(memory_format=torch.contiguous_format)
    down.data = down.data[:, lo:hi, :].clone(memory_format=torch.contiguous_format)
    keep_down_bias_once(params["down_bias"], rank)
    return shard


@torch.no_grad()
def shard_gate_up_halves_cols(experts, where, rank, world, names):
    """gate_up [E, H, 2I] (gate columns, then up columns) and down [E, I, H]: each rank keeps I/world of both.

    The transposed twin of shard_gate_up_rows: gate_up keeps its gate|up packing per rank along the last
    dim, down splits its input dimension (1).
    """
    params = _fused_params(experts, where, names)
    gate_up, down = params["gate_up"], params["down"]
    inter = down.shape[1]
    if gate_up.shape[2] != 2 * inter or inter % world or params["gate_up_bias"] is not None:
        raise PolicyError(f"{where} has {names['gate_up']} {tuple(gate_up.shape)} and {names['down']} "
                          f"{tuple(down.shape)}: cannot split the expert size {inter} over {world} ranks")
    shard = inter // world
    lo, hi = rank * shard, (rank + 1) * shard
    gate_up.data = torch.cat([gate_up.data[:, :, lo:hi], gate_up.data[:, :, inter + lo : inter + hi]],
                             dim=2).contiguous()
    down.data = down.data[:, lo:hi, :].clone(memory_format=torch.contiguous_format)
    keep_down_bias_once(params["down_bias"], rank)
    return shard


@torch.no_grad()
def shard_flat_rows(experts, where, rank, world, names):
    """gate, up and down as flat 2-D [E*I, H] Parameters (expert e's rows e*I .. (e+1)*I; the forward views them as
    [E, I, H] by the size attribute and applies down as `x @ down_e`): each rank keeps rows [lo, hi) of every expert
    in all three, [E*I/world, H]. The intermediate units are elementwise (act(gate) * up), so the split is exact and
    each rank's down product is its partial sum of the expert's output."""
    params = {}
    for role in ("gate_up", "up", "down"):
        param = attribute(experts, names.get(role, ""))
        if not isinstance(param, torch.nn.Parameter) or param.dim() != 2:
            raise PolicyError(f"{where} has no 2-D Parameter {names.get(role, '')!r} to shard: "
                              "its experts are not the fused layout the family table names")
        params[role] = param
    owner_path, _, size_attr = names["size_attr"].rpartition(".")
    inter = getattr(attribute(experts, owner_path) if owner_path else experts, size_attr, None)
    shapes = {tuple(p.shape) for p in params.values()}
    if not isinstance(inter, int) or inter % world or len(shapes) != 1 or next(iter(shapes))[0] % inter:
        raise PolicyError(f"{where} has flat experts {sorted(shapes)} of width {inter!r}: cannot split them over "
                          f"{world} ranks")
    shard = inter // world
    lo, hi = rank * shard, (rank + 1) * shard
    for param in params.values():
        rows, hidden = param.shape
        param.data = param.data.view(rows // inter, inter, hidden)[:, lo:hi].reshape(-1, hidden).contiguous()
    return shard


@torch.no_grad()
def shard_up_rows(experts, where, rank, world, names):
    """Non-gated experts, up [E, I, H] and down [E, H, I] (down(act(up x))): each rank keeps I/world of both.

    The activation is elementwise per intermediate unit, so the split is exact and each rank's down product is its
    partial sum of the expert's output. The Parameters stay the same registered objects; the full tensors are freed.
    """
    up, down = (attribute(experts, names.get(role, "")) if names.get(role) else None for role in ("up", "down"))
    if not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in (up, down)):
        raise PolicyError(f"{where} has no 3-D Parameters {names.get('up', '')!r} and {names.get('down', '')!r} to "
                          "shard: its experts are not the fused layout the family table names")
    inter = down.shape[-1]
    if up.shape[1] != inter or inter % world:
        raise PolicyError(f"{where} has {names['up']} {tuple(up.shape)} and {names['down']} {tuple(down.shape)}: "
                          f"cannot split the expert size {inter} over {world} ranks")
    shard = inter // world
    lo, hi = rank * shard, (rank + 1) * shard
    up.data = up.data[:, lo:hi].clone(memory_format=torch.contiguous_format)
    down.data = down.data[:, :, lo:hi].clone(memory_format=torch.contiguous_format)
    return shard


@torch.no_grad()
def keep_latent_bias_once(block, attr, rank):
    """The MoE block's latent output projection (kept whole on every rank, like the routers) maps this rank's partial
    sum of the routed experts back to the hidden width before the one reduction. It is linear, so the partial sums
    stay partial, but its bias would be added once per rank: only rank 0 keeps it, the others hold zeros
    (as keep_down_bias_once). Run after `check_replicated`, which sees it whole."""
    bias = getattr(block._modules.get(attr), "bias", None) if attr else None
    if isinstance(bias, torch.Tensor) and rank != 0:
        bias.data = torch.zeros_like(bias.data)


#: fused expert layouts (codegen.families FusedExperts.kind) and the function that shards each
FUSED_SHARDERS = {FUSED_GATE_UP_ROWS: shard_gate_up_rows, FUSED_GATE_UP_HALVES_COLS: shard_gate_up_halves_cols,
                  FUSED_GATE_UP_INTERLEAVED_COLS: shard_gate_up_interleaved_cols, FUSED_FLAT_ROWS: shard_flat_rows,
                  FUSED_UP_ROWS: shard_up_rows}


def shard_fused_experts(experts, where, rank, world, fused):
    """transformers 5.x fused experts: DeepSpeed leaves the 3-D Parameters replicated, so shard them here."""
    if getattr(experts, SHARDED_FLAG, False):
        return
    sharder = FUSED_SHARDERS.get(fused["kind"])
    if sharder is None:
        raise PolicyError(f"{where}: unknown fused expert layout {fused['kind']!r}: re-run patch")
    shard = sharder(experts, where, rank, world, fused)
    owner_path, _, size_attr = fused["size_attr"].rpartition(".")
    owner = attribute(experts, owner_path) if owner_path else experts
    if size_attr and hasattr(owner, size_attr):
        setattr(owner, size_attr, shard)
    setattr(experts, SHARDED_FLAG, True)


def row_layer_policy(model, blocks, layout, auto_tp):
    """DeepSpeed's injection policy for the decoder layers, where its own parser would pick the wrong row layers;
    None where it picks them right (then it parses as it always does).

    Its parser (`AutoTP.tp_parser`) makes a linear row-parallel by name (`down_proj`, `o_proj`, Mixtral's `w2`)
    or because a LayerNorm follows it, and reads only the first layer of each class. Two cases go wrong:
    - a per-expert MLP whose down projection it does not name (Phi-3.5-MoE's `w2`, under LayerNorms) gets one row
      layer, its last expert's up projection: every per-expert `<i>.<down>` must be a row layer and no other
      per-expert linear may be;
    - a hybrid decoder's layers of one class hold different blocks (linear attention in most, full attention every
      few): the row layers of the kinds after the first (`self_attn.o_proj`) would stay column-parallel, so every
      kind of layer is parsed and their row layers united.
    """
    if auto_tp is None:
        return None
    try:
        alone = {layer_class: set(gems) for layer_class, gems in auto_tp.tp_parser(model)}
    except AssertionError:  # a class's first layer has no linear in sight (its mixer kept whole): parse the rest
        alone = {}
    parsed = _parse_every_layer_kind(model, auto_tp, alone)
    if not parsed:  # no layer has a linear in sight (its mixer kept whole, its experts fused): nothing is a row layer
        return {type(layer): () for layer in auto_tp.get_module_list(model)}
    experts = [attribute(block, path) for _, block in blocks for path in expert_paths(layout) if path]
    down = layout["per_expert"]["down"]
    # zero-compute experts (`nn.Identity`) hold no projection: nothing to name
    identity = set(layout.get("identity_experts", ()))
    indices = {key for e in experts if isinstance(e, torch.nn.ModuleList) for key, expert in e._modules.items()
               if expert is not None and type(expert).__name__ not in identity}
    wanted = {f"{i}.{down}" for i in indices}
    # DeepSpeed names a linear by its parent's key: `<i>.<linear>` of expert i, but also of another ModuleList's i-th
    # module (LongCat's `self_attn.0.o_proj` is `0.o_proj`): only the experts' own projections are dropped
    own = {f"{key}.{name}" for key in indices for name in layout["per_expert"].values()}
    fixed = {}
    for layer_class, gems in parsed.items():
        fixed[layer_class] = ({g for g in gems if g not in own} | wanted) if indices else gems
    for layer_class, gems in _dense_down_layers(model, layout).items():  # names DeepSpeed's parser misses
        if layer_class in fixed:
            fixed[layer_class] = set(fixed[layer_class]) | gems
    if fixed == alone:
        return None
    return {layer_class: tuple(sorted(gems)) for layer_class, gems in fixed.items()}


def _dense_down_layers(model, layout):
    """Layer class -> `<attr>.<down>` of the dense MLPs (not MoE blocks) its layers hold under the table's MoE block
    attributes: their down projection is a row layer, whatever DeepSpeed's names say (`w2` outside Mixtral)."""
    down, classes, found = layout["per_expert"]["down"], set(layout.get("moe_classes", ())), {}
    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for layer in layers:
            for attr in layout.get("moe_block_attrs", ()):
                mlp = layer._modules.get(attr)
                if mlp is not None and type(mlp).__name__ not in classes and isinstance(
                        mlp._modules.get(down), torch.nn.Linear):
                    found.setdefault(type(layer), set()).add(f"{attr}.{down}")
    return found


def _parse_every_layer_kind(model, auto_tp, alone):
    """DeepSpeed's parse (layer class -> row-layer names) united over every kind of layer of each class: each
    layer whose blocks differ from the ones before it is moved first in its list for one parse, then put back."""
    parsed = {layer_class: set(gems) for layer_class, gems in alone.items()}
    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        kinds = {}
        for key, layer in layers._modules.items():
            kinds.setdefault((type(layer), tuple(name for name, _ in layer.named_modules())), key)
        firsts = {}
        for (layer_class, _), key in kinds.items():
            firsts.setdefault(layer_class, []).append(key)
        for keys in firsts.values():
            for key in keys[1:]:
                order = list(layers._modules)
                layers._modules = {key: layers._modules[key], **{k: layers._modules[k] for k in order if k != key}}
                try:
                    for layer_class, gems in auto_tp.tp_parser(model):
                        parsed.setdefault(layer_class, set()).update(gems)
                finally:
                    layers._modules = {k: layers._modules[k] for k in order}
    return parsed
