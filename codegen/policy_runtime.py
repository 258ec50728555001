"""The AutoTP policy runtime: shard a codegen-patched MoE model with DeepSpeed and reduce once per MoE layer.

This module is embedded verbatim into every generated `autotp_policy.py`, after a short header that defines
`LAYOUT` (the family's layout, plain data from codegen.families), `KNOB` (the config key that turns the
single reduction on) and `MODELING_MODULE` (the patched module the policy is written beside). Imported as
`codegen.policy_runtime` it is the same code, unit-tested by passing a layout explicitly. It therefore
imports only the standard library and torch at the top, DeepSpeed inside functions, and holds no family
knowledge: every attribute, class and config name comes from the layout.

The policy enforces what the layout says rather than relying on DeepSpeed's name rules: routers and
replicated projections are detached while DeepSpeed shards and re-attached after; experts the layout calls
sharded must come out sharded (fused layouts, their biases included, are split here); per-head attention
Parameters are cut to the heads DeepSpeed left on the rank; and every private DeepSpeed name it touches is
probed first, so an unsupported DeepSpeed gets one `PolicyError` line naming what is missing instead of a
silent fallback.
"""

import atexit
import os
import re
import signal
import sys

import torch

#: the DeepSpeed releases this runtime is tested with (pyproject.toml declares the same range)
SUPPORTED_DEEPSPEED = "deepspeed>=0.16.9,<0.20"
#: DeepSpeed's CPU shared-memory all-reduce: /dev/shm/<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_allreduce_buffer"
#: where DeepSpeed's C++ names the buffer (relative to the deepspeed package), and the statements that do
SHM_SOURCES = {
    ("ops", "csrc", "cpu", "comm", "shm.cpp"): (
        r'#define\s+SHM_BUFFER_NAME\s+"' + SHM_PREFIX + '"',
        r'"%s_%d_%s_%s",\s*SHM_BUFFER_NAME,\s*getuid\(\),\s*addr_string,\s*port_string\s*\)',
        r'snprintf\(shm_name,\s*NAME_BUF_SIZE,\s*"%s_%d",\s*shm_name_prefix,\s*rank\s*\)',
    ),
    ("ops", "csrc", "cpu", "comm", "shm_interface.cpp"): (
        r'getenv\("MASTER_ADDR"\)',
        r'getenv\("MASTER_PORT"\)',
        r"shm_initialize\(size,\s*rank,\s*addr_string,\s*port_string\)",
    ),
}
#: attributes of DeepSpeed's row-parallel layer that the partial-sum subclass reads
ROW_LAYER_ATTRS = ("weight", "bias", "tp_index")
#: set on fused expert modules once sharded, and the reducer attached to each MoE block (the harness reads both)
SHARDED_FLAG = "_codegen_sharded"
REDUCER_ATTR = "_codegen_tp_reducer"


class PolicyError(RuntimeError):
    """A problem the user can fix; its message is one line."""


def init_inference(model, tp_size, dtype=None, **deepspeed_kwargs):
    """Shard `model` over `tp_size` ranks with DeepSpeed AutoTP and reduce once per MoE layer.

    Wraps `deepspeed.init_inference` (AutoTP, no kernel injection); extra keyword arguments go to it.
    `dtype=None` keeps the model's dtype (DeepSpeed alone would convert it to float16).
    Ranks form tensor-parallel groups of `tp_size` consecutive ranks (one node's GPUs under the
    `deepspeed` launcher); every reduction stays inside its own group.
    """
    return shard_model(model, tp_size, dtype, deepspeed_kwargs, header_value("LAYOUT", {}), header_value("KNOB", ""))


def header_value(name, default):
    """`LAYOUT`, `KNOB` or `MODELING_MODULE` as the generated header above this text set it.

    Read, never re-assigned here, so the header's literals stay the only assignments of those names;
    imported as codegen.policy_runtime there is no header and `default` is returned.
    """
    return globals().get(name, default)


def shard_model(model, tp_size, dtype, deepspeed_kwargs, layout, knob):
    """`init_inference` with the layout and knob given explicitly."""
    layout = _checked_layout(layout)
    deepspeed, dist = _import_deepspeed()
    check_patched(model, layout)
    check_sizes(model.config, tp_size, layout)
    if not dist.is_initialized():
        deepspeed.init_distributed()
    coalesce = bool(getattr(model.config, knob, False))
    blocks = moe_blocks(model, layout)
    if coalesce and not blocks:
        raise PolicyError(f"no {' / '.join(layout['moe_classes'])} blocks in the model: "
                          f"was it patched for {layout['family']}?")

    tensor_parallel = dict(deepspeed_kwargs.pop("tensor_parallel", None) or {})
    user_group = tensor_parallel.pop("tp_group", None)
    tensor_parallel["tp_size"] = tp_size
    if "mpu" not in tensor_parallel:
        tensor_parallel["mpu"] = TensorParallelGroups(dist, tp_size, user_group)
    group = tensor_parallel["mpu"].get_model_parallel_group()
    # DeepSpeed's AutoTP shards with `tp_group`; the engine takes its group from `mpu`: give both the same.
    tensor_parallel["tp_group"] = group
    world = dist.get_world_size(group=group)
    if world != tp_size:
        raise PolicyError(f"the tensor-parallel group given has {world} ranks, tp_size is {tp_size}")
    several_groups = world != dist.get_world_size()
    shm_buffer = own_shm_buffer(dist.get_rank())
    probe_deepspeed(deepspeed, shm_in_use=shm_buffer is not None)
    if shm_buffer is not None:
        remove_at_exit(shm_buffer)
    deepspeed_kwargs.setdefault("replace_with_kernel_inject", False)
    deepspeed_kwargs["dtype"] = dtype if dtype is not None else next(model.parameters()).dtype

    owners = head_param_owners(model, layout)
    kept = detach_replicated(model, blocks, layout)
    try:
        engine = deepspeed.init_inference(model, tensor_parallel=tensor_parallel, **deepspeed_kwargs)
    finally:
        reattach(kept, deepspeed_kwargs["dtype"])
    if getattr(engine, "mp_group", None) is not group:
        raise PolicyError("deepspeed.init_inference did not take its tensor-parallel group from `mpu`: "
                          f"unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    keep_reductions_in_group(_lookup(deepspeed, "comm.comm.cdb"), dist, several_groups)
    column = _lookup(deepspeed, "module_inject.layers.LinearLayer")
    row = _lookup(deepspeed, "module_inject.layers.LinearAllreduce")
    rank = dist.get_rank(group=group)
    if world > 1:  # knob on or off: attention would mix this rank's heads with every head's parameters
        shard_head_params(owners, dist, group, rank, world, column)
    if coalesce and world > 1:
        reducer = CoalescedAllReduce(dist, group, world)
        for name, block in blocks:
            shard_experts(block, name, rank, world, layout, column, row)
            setattr(block, REDUCER_ATTR, reducer)
    check_replicated(kept)
    return engine


# ---------------------------------------------------------------------------------------------- reduction


def _sum_in_group(dist, tensor, group, op=None):
    """torch.distributed's all-reduce through DeepSpeed's comm, over `group` (never WORLD by default)."""
    extra = {} if op is None else {"op": op}
    return dist.all_reduce(tensor, group=group, **extra)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group forward; identity backward (each rank's partial sum gets the full gradient)."""

    @staticmethod
    def forward(ctx, tensor, dist, group):
        out = tensor.contiguous().clone()
        _sum_in_group(dist, out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class CoalescedAllReduce:
    """Attached to each MoE block; the patched forward calls it once with routed + shared partial sums.

    Always over the TP group DeepSpeed shards with (never WORLD). Without autograd: DeepSpeed's
    `inference_all_reduce`, the path its own row-parallel layers take. With grad enabled on a tensor
    that needs it: an autograd-aware all-reduce whose backward passes the gradient through.
    """

    enabled = True

    def __init__(self, dist, group, world_size):
        self.dist = dist
        self.group = group
        self.world_size = world_size

    def __call__(self, tensor):
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _AllReduceSum.apply(tensor, self.dist, self.group)
        tensor = tensor.contiguous()
        # DeepSpeed's fast path, the same one its row-parallel layers use
        self.dist.inference_all_reduce(tensor, group=self.group)
        return tensor


class GroupInferenceAllReduce:
    """Stands in for the backend's `inference_all_reduce` when its shared-memory kernel would ignore the group."""

    def __init__(self, dist):
        self.dist = dist

    def __call__(self, tensor, op=None, group=None):
        return _sum_in_group(self.dist, tensor, group, op)


class TensorParallelGroups:
    """DeepSpeed `mpu`: consecutive ranks form a TP group, so 4 ranks at tp_size 2 give [0, 1] and [2, 3]."""

    def __init__(self, dist, tp_size, group=None):
        self.dist = dist
        if group is not None:
            self.group = group
            return
        world = dist.get_world_size()
        if world % tp_size:
            raise PolicyError(f"world size {world} is not a multiple of tp_size {tp_size}")
        rank = dist.get_rank()
        self.group = None
        for start in range(0, world, tp_size):
            ranks = list(range(start, start + tp_size))
            group = dist.new_group(ranks)  # every rank creates every group, as torch requires
            if rank in ranks:
                self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_world_size(self):
        return self.dist.get_world_size(group=self.group)

    def get_model_parallel_rank(self):
        return self.dist.get_rank(group=self.group)


def keep_reductions_in_group(backend, dist, several_groups):
    """DeepSpeed's CPU shared-memory all-reduce spans every local rank and ignores `group`.

    With several TP groups per node (4 ranks, tp_size 2) it would sum over WORLD: route the backend's
    inference reductions through torch.distributed, which honours the group, in that case only.
    """
    if several_groups and backend.shm_comm_op is not None:
        backend.inference_all_reduce = GroupInferenceAllReduce(dist)


# ----------------------------------------------------------------------------------------------- sharding


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
    """A per-expert (or shared-expert) MLP: gate/up column-parallel, down row-parallel without its reduction."""
    for role in ("gate", "up"):
        layer = getattr(mlp, names[role], None)
        if not isinstance(layer, column_class):
            raise PolicyError(f"{where}.{names[role]} is {type(layer).__name__}, not sharded by "
                              "deepspeed.init_inference as a column-parallel layer")
    make_partial(getattr(mlp, names["down"], None), f"{where}.{names['down']}", row_class)


def shard_experts(block, name, rank, world, layout, column_class, row_class):
    """Routed and shared experts of one MoE block end up sharded, none reducing on its own: else PolicyError."""
    experts = getattr(block, layout["experts"], None)
    where = f"{name}.{layout['experts']}"
    if isinstance(experts, torch.nn.ModuleList):
        for index, expert in enumerate(experts):
            if expert is not None:
                shard_mlp(expert, f"{where}.{index}", layout["per_expert"], column_class, row_class)
    elif isinstance(experts, torch.nn.Module):
        shard_fused_experts(experts, where, rank, world, layout["fused"])
    else:
        raise PolicyError(f"{name} has no experts module {layout['experts']!r}: re-run patch")
    for shared in layout["shared"]:
        module = getattr(block, shared, None)
        if module is not None:
            shard_mlp(module, f"{name}.{shared}", layout["per_expert"], column_class, row_class)
    for sub, module in block.named_modules():
        if isinstance(module, row_class) and not is_partial(module):
            raise PolicyError(f"{name}.{sub} still reduces on its own inside the MoE block, which the family "
                              "layout does not name: the one reduction would add it again")


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
        param = getattr(experts, attr, None)
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


#: fused expert layouts (codegen.families FusedExperts.kind) and the function that shards each
FUSED_SHARDERS = {"gate_up_rows": shard_gate_up_rows, "gate_up_interleaved_cols": shard_gate_up_interleaved_cols}


def shard_fused_experts(experts, where, rank, world, fused):
    """transformers 5.x fused experts: DeepSpeed leaves the 3-D Parameters replicated, so shard them here."""
    if getattr(experts, SHARDED_FLAG, False):
        return
    sharder = FUSED_SHARDERS.get(fused["kind"])
    if sharder is None:
        raise PolicyError(f"{where}: unknown fused expert layout {fused['kind']!r}: re-run patch")
    shard = sharder(experts, where, rank, world, fused)
    if hasattr(experts, fused["size_attr"]):
        setattr(experts, fused["size_attr"], shard)
    setattr(experts, SHARDED_FLAG, True)


# ----------------------------------------------------------------------------- attention head parameters


def head_param_owners(model, layout):
    """Modules holding Parameters the layout names as one value per attention head (e.g. attention sinks).

    DeepSpeed splits the q/k/v projections by heads but never touches such a Parameter, so attention would
    concatenate this rank's heads with every head's values. Recorded before DeepSpeed shards: the head
    count (the Parameter's first dim) and the full output rows of the owner's nn.Linear children.
    """
    wanted = set(layout.get("attention_head_params", ()))
    owners = []
    if not wanted:
        return owners
    for name, module in model.named_modules():
        params = {attr: p for attr, p in module._parameters.items() if attr in wanted and p is not None}
        if not params:
            continue
        heads = {p.shape[0] if p.dim() else 0 for p in params.values()}
        if len(heads) != 1 or 0 in heads:
            raise PolicyError(f"{name} has per-head Parameters {sorted(params)} of different lengths: "
                              "cannot shard them with the heads")
        rows = {attr: c.out_features for attr, c in module._modules.items() if isinstance(c, torch.nn.Linear)}
        owners.append({"where": name, "module": module, "params": params, "heads": heads.pop(), "rows": rows})
    return owners


def local_head_count(owner, column_class):
    """How many heads DeepSpeed left on this rank: the share of rows its column-parallel projections kept.

    DeepSpeed splits q, k and v by the same fraction of the heads (whole kv-head groups; see its
    tp_shard.get_shard_size), so every projection must give the same count, else the split is unknown.
    """
    heads, counts = owner["heads"], set()
    for attr, full in owner["rows"].items():
        child = owner["module"]._modules.get(attr)
        if isinstance(child, column_class):
            local = child.weight.shape[0]
            counts.add(heads * local // full if (heads * local) % full == 0 else -1)
    if not counts:
        raise PolicyError(f"{owner['where']}: DeepSpeed split none of its projections by heads: cannot shard "
                          f"{', '.join(owner['params'])} with the heads")
    if len(counts) != 1 or -1 in counts:
        raise PolicyError(f"{owner['where']}: DeepSpeed's split of its projections is not a whole number of its "
                          f"{heads} heads ({', '.join(owner['rows'])}): cannot shard "
                          f"{', '.join(owner['params'])} with the heads")
    return counts.pop()


def head_ranges(counts_by_rank, rank, owners):
    """(start, count) of this rank's heads per owner: ranks hold consecutive head ranges in rank order."""
    ranges = []
    for index, owner in enumerate(owners):
        counts = [row[index] for row in counts_by_rank]
        if sum(counts) != owner["heads"]:
            raise PolicyError(f"{owner['where']}: the ranks hold {counts} of its {owner['heads']} heads: "
                              f"cannot shard {', '.join(owner['params'])} with the heads")
        ranges.append((sum(counts[:rank]), counts[rank]))
    return ranges


@torch.no_grad()
def shard_head_params(owners, dist, group, rank, world, column_class):
    """Keep this rank's slice of every per-head Parameter, the heads its q projection kept.

    The head counts of all ranks are gathered once (one all_gather at init, none per forward): DeepSpeed's
    split can be uneven (whole kv-head groups), so a rank's first head depends on the other ranks' counts.
    """
    if not owners:
        return
    counts = [local_head_count(owner, column_class) for owner in owners]
    device = next(iter(owners[0]["params"].values())).device
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    for owner, (start, count) in zip(owners, head_ranges([g.tolist() for g in gathered], rank, owners)):
        for attr, param in owner["params"].items():
            if param.shape[0] != owner["heads"]:
                raise PolicyError(f"{owner['where']}.{attr} was already split by DeepSpeed: "
                                  f"unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
            param.data = param.data[start : start + count].clone()  # a slice is contiguous: clone frees the full tensor


# --------------------------------------------------------------------------------------- replicated layers


def detach_replicated(model, blocks, layout):
    """Take routers and replicated projections out of the model, so DeepSpeed cannot shard or wrap them.

    DeepSpeed's AutoTP keeps a few names whole by its own rules and wraps any `nn.Linear` (subclasses too);
    a module that is not in the tree while it shards is left alone whatever its name or type.
    Returns what `reattach` and `check_replicated` need.
    """
    kept = []
    for name, block in blocks:
        for attr in layout["routers"]:
            if not isinstance(block._modules.get(attr), torch.nn.Module):
                raise PolicyError(f"{name} has no router {attr!r} (named by the family table): re-run patch")
            kept.append(_detach(block, attr, f"{name}.{attr}"))
    wanted = set(layout["attention_replicated"])
    for name, parent in list(model.named_modules()):
        for attr in [a for a, child in parent._modules.items() if a in wanted and child is not None]:
            kept.append(_detach(parent, attr, f"{name}.{attr}" if name else attr))
    return kept


def _detach(parent, attr, where):
    module = parent._modules[attr]
    snapshot = {n: t.detach().clone() for n, t in module.state_dict().items()}
    entry = {"parent": parent, "attr": attr, "where": where, "module": module, "type": type(module),
             "order": list(parent._modules), "snapshot": snapshot}
    del parent._modules[attr]
    return entry


def reattach(kept, dtype):
    """Put the detached modules back where they were (same order), in the engine's dtype and device."""
    for entry in kept:
        parent, module = entry["parent"], entry["module"]
        device = next((p.device for p in parent.parameters()), None)
        if device is None:
            module.to(dtype=dtype)
        else:
            module.to(device=device, dtype=dtype)
        parent._modules[entry["attr"]] = module
        for key in entry["order"]:
            if key in parent._modules:
                parent._modules[key] = parent._modules.pop(key)


def check_replicated(kept):
    """Every detached module is back, of its own type, with every tensor whole and unchanged."""
    for entry in kept:
        module = entry["parent"]._modules.get(entry["attr"])
        state = module.state_dict() if isinstance(module, torch.nn.Module) else {}
        same = type(module) is entry["type"] and state.keys() == entry["snapshot"].keys() and all(
            state[n].shape == t.shape and torch.equal(state[n].detach().cpu(), t.to(state[n].dtype).cpu())
            for n, t in entry["snapshot"].items()
        )
        if not same:
            raise PolicyError(f"{entry['where']} was split or changed by DeepSpeed: it must stay replicated")


# ---------------------------------------------------------------------------------------------- checks


def _checked_layout(layout):
    keys = ("family", "moe_classes", "experts", "per_expert", "fused", "shared", "routers",
            "attention_replicated", "tp_divisible")
    missing = [k for k in keys if k not in (layout or {})]
    if missing:
        raise PolicyError(f"the policy's layout lacks {', '.join(missing)}: re-run `python -m codegen patch`")
    return layout


def _import_deepspeed():
    try:
        import deepspeed
        import deepspeed.comm as dist
    except ImportError:
        raise PolicyError("DeepSpeed is not installed: pip install deepspeed") from None
    return deepspeed, dist


def check_patched(model, layout, modeling_module=None):
    """The model comes from a dir codegen patched for this family (its module carries `_CODEGEN_PATCH`)."""
    module_name = type(model).__module__
    patch = getattr(sys.modules.get(module_name), "_CODEGEN_PATCH", None)
    if not isinstance(patch, dict):
        raise PolicyError(
            f"{type(model).__name__} was not loaded from a codegen-patched dir: "
            "use AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)"
        )
    family = layout["family"]
    if patch.get("family") != family:
        raise PolicyError(f"model was patched for {patch.get('family')!r}, this policy is for {family!r}: re-run patch")
    expected = header_value("MODELING_MODULE", "") if modeling_module is None else modeling_module
    if expected and module_name.rsplit(".", 1)[-1] != expected:
        raise PolicyError(f"model was loaded from {module_name.rsplit('.', 1)[-1]}.py, this policy was written "
                          f"beside {expected}.py: use the autotp_policy.py of the model's own dir")


def size_config(config):
    """The config holding the decoder's sizes: a multimodal config nests it as `text_config`."""
    nested = getattr(config, "text_config", None)
    return nested if nested is not None else config


def check_sizes(config, tp_size, layout):
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PolicyError(f"tp_size must be a positive integer, got {tp_size!r}")
    sizes = size_config(config)
    for key in layout["tp_divisible"]:
        value = getattr(sizes, key, None)
        if isinstance(value, int) and value % tp_size:
            raise PolicyError(f"tp_size {tp_size} does not divide {key} = {value}: pick a tp_size that divides it")


def moe_blocks(model, layout):
    """(qualified name, module) of every MoE block of the layout's classes."""
    classes = set(layout["moe_classes"])
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes and hasattr(m, layout["experts"])]


# ------------------------------------------------------------------------------------ DeepSpeed probe


def _lookup(root, dotted):
    value = root
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def probe_deepspeed(deepspeed, shm_in_use=False):
    """Check every private DeepSpeed name and behaviour the policy relies on; one PolicyError names what is missing.

    Called once DeepSpeed's backend is up (the shared-memory buffers exist by then), before any sharding.
    """
    import importlib

    missing = []
    for dotted in ("comm.all_reduce", "comm.all_gather", "comm.inference_all_reduce", "init_inference",
                   "init_distributed"):
        if not callable(_lookup(deepspeed, dotted)):
            missing.append(f"deepspeed.{dotted}")
    backend = _lookup(deepspeed, "comm.comm.cdb")
    if backend is None:
        missing.append("deepspeed.comm.comm.cdb")
    else:
        if not callable(getattr(backend, "inference_all_reduce", None)):
            missing.append("deepspeed.comm.comm.cdb.inference_all_reduce")
        if not hasattr(backend, "shm_comm_op"):
            missing.append("deepspeed.comm.comm.cdb.shm_comm_op")
    for module in ("module_inject.layers", "inference.config"):
        if _lookup(deepspeed, module) is None:
            try:
                importlib.import_module(f"{deepspeed.__name__}.{module}")
            except ImportError:
                missing.append(f"deepspeed.{module}")
    for cls in ("LinearAllreduce", "LinearLayer"):
        if not isinstance(_lookup(deepspeed, f"module_inject.layers.{cls}"), type):
            missing.append(f"deepspeed.module_inject.layers.{cls}")
    tp_config = _lookup(deepspeed, "inference.config.DeepSpeedTPConfig")
    fields = getattr(tp_config, "model_fields", None) or getattr(tp_config, "__fields__", None) or {}
    missing += [f"init_inference(tensor_parallel={{{f!r}: ...}})" for f in ("tp_size", "mpu", "tp_group")
                if f not in fields]
    if shm_in_use:
        missing += shm_naming_problems(os.path.dirname(deepspeed.__file__))
    if missing:
        version = getattr(deepspeed, "__version__", "?")
        raise PolicyError(f"DeepSpeed {version} lacks what this policy relies on: {'; '.join(missing)} "
                          f"(supported: {SUPPORTED_DEEPSPEED})")


def shm_naming_problems(package_dir):
    """How DeepSpeed's C++ names the shm buffer, checked against the name this policy derives and deletes."""
    problems = []
    for parts, patterns in SHM_SOURCES.items():
        path = os.path.join(package_dir, *parts)
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            problems.append(f"{'/'.join(parts)} (to confirm the shared-memory buffer naming)")
            continue
        problems += [f"{'/'.join(parts)}: the buffer naming /{pattern}/" for pattern in patterns
                     if not re.search(pattern, text)]
    return problems


# ------------------------------------------------------------------------------------ shared memory


def shm_buffer_name(rank, env=None, uid=None):
    """The name DeepSpeed's CPU all-reduce gives rank `rank`'s buffer (`SHM_SOURCES` is what confirms it)."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    return f"{SHM_PREFIX}_{uid}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{rank}"


def shm_paths_in_maps(text, directory=SHM_DIR):
    """The DeepSpeed shm buffers in `directory` a /proc/<pid>/maps text maps (by path; unlinked ones excluded)."""
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and not fields[5].endswith(" (deleted)"):
            head, _, name = fields[5].rpartition("/")
            if head == directory and name.startswith(f"{SHM_PREFIX}_"):
                found.add(fields[5])
    return found


def _own_maps():
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def own_shm_buffer(rank, maps=None, env=None):
    """This rank's shm buffer path when DeepSpeed's shared-memory all-reduce is in use here, else None.

    In use = this process maps DeepSpeed shm buffers. Then one of them must carry the name derived for this
    rank (uid, MASTER_ADDR, MASTER_PORT, rank); if none does, the naming changed and nothing is deleted.
    """
    mapped = shm_paths_in_maps(_own_maps() if maps is None else maps)
    if not mapped:
        return None
    path = f"{SHM_DIR}/{shm_buffer_name(rank, env)}"
    if path not in mapped:
        raise PolicyError(f"DeepSpeed's shared-memory all-reduce maps {min(mapped)}, not {path} as this "
                          f"policy derives its rank's buffer name: unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    return path


_REMOVING = {}


def remove_at_exit(path):
    """Unlink this rank's own shm buffer when the process ends: normal exit (atexit) and SIGTERM.

    Only `path`, and only while it is still the file this process mapped (same inode): another job's
    buffers carry another master address or port, and are never touched.
    """
    if path in _REMOVING:
        return
    stat = os.stat(path)
    _REMOVING[path] = (stat.st_dev, stat.st_ino)
    atexit.register(remove_buffer, path)
    chain_sigterm(lambda: remove_buffer(path))


def remove_buffer(path):
    """Unlink `path` if it is still the buffer `remove_at_exit` recorded; never raises (runs at exit)."""
    identity = _REMOVING.get(path)
    try:
        stat = os.stat(path)
        if identity == (stat.st_dev, stat.st_ino):
            os.unlink(path)
    except OSError:
        pass


def chain_sigterm(cleanup, signals=signal):
    """Run `cleanup` on SIGTERM, then what would have happened without it.

    An existing Python handler is chained to; with none (the default action) the process then dies of
    SIGTERM as before, so its exit status is unchanged. An ignored SIGTERM, or a handler set outside
    Python, is left alone (atexit still covers a normal exit). Off the main thread nothing is installed.
    """
    previous = signals.getsignal(signals.SIGTERM)
    if previous is signals.SIG_IGN or previous is None:
        return False

    def on_sigterm(signum, frame):
        cleanup()
        if callable(previous):
            return previous(signum, frame)
        signals.signal(signum, signals.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    try:
        signals.signal(signals.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        return False
    return True
