"""Linear-attention token mixers of hybrid decoders (gated delta-net), sharded by heads here, not by DeepSpeed.

Everything in such a layer is per head: the input projections produce per-head q/k/v/z/b/a, the convolution is
depthwise, the decay and step Parameters hold one value per value head, the recurrent state and the norm act
within a head, and the value heads of a key head sit next to each other. DeepSpeed would cut the projections in
row halves (across qwen3_next's interleaved per-key-head groups) and leave the convolution, the per-head
Parameters and the module's head counts whole. So the module is kept out of its sight and sharded here: each
head-ordered segment of each tensor (the family table names them) is cut into tp equal contiguous parts and a rank
keeps its part of every one, i.e. its key heads with their value heads; the module's sizes become its share; the
output projection is row-parallel and its partial sums are reduced once. The cache follows by itself: its conv
and recurrent states take the shapes of the local tensors.
"""

import torch

from codegen.policy.runtime.attention import detach_child
from codegen.policy.runtime.base import SHARDED_TENSORS, PolicyError


def linear_attention_modules(model, layout):
    """(qualified name, parent, module) of every linear-attention module (the decoder-layer attribute the table
    names), recorded before DeepSpeed shards."""
    spec = layout.get("linear_attention")
    if not spec:
        return []
    attr, found = spec["attr"], []
    for parent_name, parent in model.named_modules():
        child = parent._modules.get(attr)
        if isinstance(child, torch.nn.Module):
            found.append((f"{parent_name}.{attr}" if parent_name else attr, parent, child))
    return found


def detach_linear_attention(modules, layout):
    """The linear-attention modules, out of the tree while DeepSpeed shards (it would cut them wrongly)."""
    return [detach_child(parent, layout["linear_attention"]["attr"], name) for name, parent, _ in modules]


def _segment_widths(module, segments, total, where):
    """The widths of a tensor's head-ordered segments (module attributes; none: one segment of the whole width)."""
    widths = [getattr(module, attr, None) for attr in segments] if segments else [total]
    if any(not isinstance(w, int) or isinstance(w, bool) for w in widths) or sum(widths) != total:
        raise PolicyError(f"{where}: its {total} channels are not the segments {list(segments)} "
                          f"({widths}) the family table names: re-run patch")
    return widths


def _own_part(tensor, widths, dim, rank, world, where):
    """This rank's 1/world of each segment along `dim`, concatenated (a new tensor: the full one can be freed)."""
    parts, start = [], 0
    for width in widths:
        if width % world:
            raise PolicyError(f"{where}: a segment of {width} channels does not split over {world} ranks: pick a "
                              "tp_size that divides the linear attention's head counts")
        share = width // world
        parts.append(tensor.narrow(dim, start + rank * share, share))
        start += width
    return torch.cat(parts, dim=dim).contiguous()


@torch.no_grad()
def shard_linear_attention(modules, layout, rank, world, reducer):
    """Keep this rank's heads of every linear-attention module; its output projection reduces once over the group."""
    spec = layout.get("linear_attention") or {}
    for name, _, module in modules:
        _shard_one(module, name, spec, rank, world)
        output = module._modules[spec["output"]]
        output.register_forward_hook(_ReduceOutput(reducer))


def _child(module, attr, kind, where):
    child = module._modules.get(attr)
    if not isinstance(child, kind):
        raise PolicyError(f"{where} has no {kind.__name__} {attr!r} (named by the family table): re-run patch")
    return child


def _shard_one(module, name, spec, rank, world):
    # every width is read from the module's full sizes before any of them becomes the local one
    plan = []
    for attr, segments in spec["projections"]:
        linear = _child(module, attr, torch.nn.Linear, name)
        plan.append((linear, _segment_widths(module, segments, linear.out_features, f"{name}.{attr}"), attr))
    conv = _child(module, spec["conv"], torch.nn.Conv1d, name)
    if conv.groups != conv.in_channels or conv.in_channels != conv.out_channels:
        raise PolicyError(f"{name}.{spec['conv']} is not a depthwise convolution: cannot shard it by heads")
    conv_widths = _segment_widths(module, spec["conv_segments"], conv.out_channels, f"{name}.{spec['conv']}")
    output = _child(module, spec["output"], torch.nn.Linear, name)
    sizes = {attr: getattr(module, attr, None) for attr in spec["local_sizes"]}
    for attr, value in sizes.items():
        if not isinstance(value, int) or value % world:
            raise PolicyError(f"{name}.{attr} = {value} does not split over {world} ranks: pick a tp_size that "
                              "divides the linear attention's head counts")

    sharded = []
    for linear, widths, attr in plan:
        linear.weight.data = _own_part(linear.weight.data, widths, 0, rank, world, f"{name}.{attr}")
        sharded.append(f"{attr}.weight")
        if linear.bias is not None:
            linear.bias.data = _own_part(linear.bias.data, widths, 0, rank, world, f"{name}.{attr}")
        linear.out_features = linear.weight.shape[0]
    conv.weight.data = _own_part(conv.weight.data, conv_widths, 0, rank, world, f"{name}.{spec['conv']}")
    sharded.append(f"{spec['conv']}.weight")
    if conv.bias is not None:
        conv.bias.data = _own_part(conv.bias.data, conv_widths, 0, rank, world, f"{name}.{spec['conv']}")
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for attr in spec["head_params"]:
        param = module._parameters.get(attr)
        if param is None:
            raise PolicyError(f"{name} has no Parameter {attr!r} (named by the family table): re-run patch")
        param.data = _own_part(param.data, [param.shape[0]], 0, rank, world, f"{name}.{attr}")
        sharded.append(attr)
    value_widths = [output.in_features]
    output.weight.data = _own_part(output.weight.data, value_widths, 1, rank, world, f"{name}.{spec['output']}")
    sharded.append(f"{spec['output']}.weight")
    output.in_features = output.weight.shape[1]
    if output.bias is not None and rank != 0:
        output.bias.data.zero_()  # added once over the ranks' partial sums
    for attr, value in sizes.items():
        setattr(module, attr, value // world)
    setattr(module, SHARDED_TENSORS, tuple(sharded))


class _ReduceOutput:
    """Forward hook of the row-parallel output projection: its partial sum, reduced over the group."""

    def __init__(self, reducer):
        self.reducer = reducer

    def __call__(self, module, args, output):
        return self.reducer(output)
