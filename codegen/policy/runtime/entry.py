"""`init_inference`: shard a codegen-patched MoE model with DeepSpeed AutoTP and reduce once per MoE layer.

The entry point of the generated `autotp_policy.py`. Its header (templates/autotp_policy.py.j2) defines
`LAYOUT` (the family's layout, plain data from codegen.families), `KNOB` (the config key that turns the
single reduction on) and `MODELING_MODULE` (the patched module the policy is written beside); imported as a
module, there is no header and `shard_model` takes the layout explicitly (the unit tests do).
"""

import sys

import torch

from codegen.policy.runtime.attention import (check_replicated, detach_full_width_norms, detach_head_linears,
                                              detach_replicated, fingerprint_kept, full_width_norm_owners,
                                              head_linear_owners, head_param_owners, reattach, shard_head_params,
                                              slice_full_width_norms, slice_head_linears)
from codegen.policy.runtime.base import PATCH_MARKER, REDUCER_ATTR, SUPPORTED_DEEPSPEED, PolicyError, attribute, \
    expert_paths
from codegen.policy.runtime.compiled import compile_forward
from codegen.policy.runtime.cuda_attention import cudnn_attention_off
from codegen.policy.runtime.eager_attention import use_eager_attention_kernel
from codegen.policy.runtime.experts import row_layer_policy, shard_experts
from codegen.policy.runtime.experts_implementation import use_fused_experts
from codegen.policy.runtime.environment import (destroy_group_at_exit, huge_page_weights, launcher_notes, local_ranks,
                                                malloc_note, thread_note)
from codegen.policy.runtime.groups import CoalescedAllReduce, TensorParallelGroups, route_inference_reductions
from codegen.policy.runtime.latent_attention import absorb_latent_attention, latent_attention_modules
from codegen.policy.runtime.linear_attention import (detach_linear_attention, linear_attention_modules,
                                                     shard_linear_attention)
from codegen.policy.runtime.lockstep import keep_in_lockstep
from codegen.policy.runtime.probe import deepspeed_problems, lookup
from codegen.policy.runtime.shm import maps_shm_buffers, own_shm_buffer, unlink_once_mapped


def init_inference(model, tp_size, dtype=None, compile=False, **deepspeed_kwargs):
    """Shard `model` over `tp_size` ranks with DeepSpeed AutoTP and reduce once per MoE layer.

    Wraps `deepspeed.init_inference` (AutoTP, no kernel injection); extra keyword arguments go to it.
    `dtype=None` keeps the model's dtype (DeepSpeed alone would convert it to float16).
    Ranks form tensor-parallel groups of `tp_size` consecutive ranks (one node's GPUs under the
    `deepspeed` launcher); every reduction stays inside its own group.
    `compile=True`: the sharded model's forward (and so `generate`) runs compiled by torch.compile, its reductions
    inside the graph (codegen.policy.runtime.compiled); the first forward of each new shape kind compiles.
    """
    engine = shard_model(model, tp_size, dtype, deepspeed_kwargs, header_value("LAYOUT", {}), header_value("KNOB", ""))
    if compile:
        import deepspeed.comm as dist

        compile_forward(engine.module, dist.get_rank())
    return engine


def header_value(name, default):
    """`LAYOUT`, `KNOB` or `MODELING_MODULE` as the generated header above this text set it.

    Read, never re-assigned here, so the header's literals stay the only assignments of those names;
    imported as a module (or assembled without a header) there is none and `default` is returned.
    """
    return globals().get(name, default)


def shard_model(model, tp_size, dtype, deepspeed_kwargs, layout, knob):
    """`init_inference` with the layout and knob given explicitly."""
    layout = _checked_layout(layout)
    deepspeed, dist = _import_deepspeed()
    check_patched(model, layout)
    wrapper, model, whole = text_submodule(model, layout)
    check_sizes(model.config, tp_size, layout)
    notes = []
    if not dist.is_initialized():
        notes, problem = launcher_notes(tp_size)
        if problem:
            raise PolicyError(problem)
        deepspeed.init_distributed()
        destroy_group_at_exit(dist)
    coalesce = bool(getattr(wrapper.config, knob, False))
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
    # every rank is past DeepSpeed's shm set-up, so each has mapped every peer's buffer: the names can go
    if shm_buffer is not None:
        unlink_once_mapped(shm_buffer, dist.barrier)
    elif dist.get_world_size() > 1:
        dist.barrier()
    notes.append(thread_note(torch, local_ranks(world=dist.get_world_size())))
    deepspeed_kwargs.setdefault("replace_with_kernel_inject", False)
    deepspeed_kwargs["dtype"] = dtype if dtype is not None else next(model.parameters()).dtype

    owners = head_param_owners(model, layout)
    norm_owners = full_width_norm_owners(model, layout)
    linear_owners = head_linear_owners(model, layout)
    kept = detach_replicated(model, blocks, layout) + detach_full_width_norms(norm_owners)
    fingerprint_kept(kept, deepspeed_kwargs["dtype"])
    mixers = linear_attention_modules(model, layout)
    # whole through DeepSpeed, then cut to this rank's heads
    cut_later = detach_head_linears(linear_owners) + detach_linear_attention(mixers, layout)
    try:
        with global_sizes_readable(model.config), names_hidden(model, layout.get("name_clashes", ())):
            if "injection_policy" not in deepspeed_kwargs and world > 1:
                rows = row_layer_policy(model, blocks, layout, lookup(deepspeed, "module_inject.auto_tp.AutoTP"))
                if rows is not None:
                    deepspeed_kwargs["injection_policy"] = rows
            engine = deepspeed.init_inference(model, tensor_parallel=tensor_parallel, **deepspeed_kwargs)
    finally:
        reattach(kept + cut_later, deepspeed_kwargs["dtype"])
    if getattr(engine, "mp_group", None) is not group:
        raise PolicyError("deepspeed.init_inference did not take its tensor-parallel group from `mpu`: "
                          f"unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    notes.append(route_inference_reductions(lookup(deepspeed, "comm.comm.cdb"), dist, several_groups,
                                            maps_shm_buffers()))
    column = lookup(deepspeed, "module_inject.layers.LinearLayer")
    row = lookup(deepspeed, "module_inject.layers.LinearAllreduce")
    rank = dist.get_rank(group=group)
    reducer = CoalescedAllReduce(dist, group, world)  # the one group reduction: linear attention's and the MoE blocks'
    if world > 1:  # knob on or off: attention would mix this rank's heads with every head's parameters
        shard_head_params(owners, dist, group, rank, world, column)
        slice_full_width_norms(norm_owners, dist, group, rank, world, column)
        slice_head_linears(linear_owners, dist, group, rank, world, column)
        shard_linear_attention(mixers, layout, rank, world, reducer)
    check_replicated(kept)  # before the experts: a latent output projection's bias then counts once over the group
    if coalesce and world > 1:
        for name, block in blocks:
            shard_experts(block, name, rank, world, layout, column, row)
            setattr(block, REDUCER_ATTR, reducer)
    keep_whole(whole, engine.module, deepspeed_kwargs["dtype"])
    notes.append(use_fused_experts(blocks, layout))
    if coalesce:  # knob off: stock behaviour, the cache expanded at every step
        notes.append(absorb_latent_attention(latent_attention_modules(engine.module, layout), layout))
    notes.append(use_eager_attention_kernel(engine.module))  # after: an absorbed layer keeps its own attention
    device = _device_of(engine.module)
    if world > 1:
        keep_in_lockstep(engine.module, dist, group, device)
    notes += [malloc_note(), huge_page_weights(engine.module)] if device.type == "cpu" else [cudnn_attention_off(device)]
    say(dist.get_rank(), notes)
    return engine


def text_submodule(model, layout):
    """(wrapper, model to shard, the wrapper's other top-level modules).

    A wrapper with no forward of its own runs through its text submodule (the layout's `text_submodule`, a causal
    LM): DeepSpeed is handed that submodule alone, so the wrapper's other modules (a speech generator with its own
    MoE, a vocoder) never reach it and stay whole on every rank; the engine's module is the submodule, what runs.
    """
    name = layout.get("text_submodule")
    if not name:
        return model, model, []
    sub = getattr(model, name, None)
    if not isinstance(sub, torch.nn.Module):
        raise PolicyError(f"{type(model).__name__} has no text submodule {name!r}: hand init_inference the whole "
                          "model loaded from the patched dir")
    return model, sub, [(n, m) for n, m in model.named_children() if m is not sub]


def keep_whole(modules, sharded, dtype):
    """The wrapper's modules DeepSpeed never saw, in the engine's dtype and on its device, whole on every rank."""
    device = _device_of(sharded)
    for _name, module in modules:
        module.to(device=device, dtype=dtype)


def _device_of(model):
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def say(rank, notes):
    """The notes of this start, once per job (rank 0), one line each on stderr."""
    if rank == 0:
        for note in notes:
            if note:
                print(f"codegen policy: {note}", file=sys.stderr, flush=True)



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
    patch = getattr(sys.modules.get(module_name), PATCH_MARKER, None)
    if not isinstance(patch, dict):
        if module_name.startswith("transformers_modules"):  # the dir's own remote code, never patched
            raise PolicyError(f"{type(model).__name__} comes from a model dir codegen has not patched: run "
                              "`python -m codegen patch DIR`, then load it with from_pretrained(DIR, "
                              "trust_remote_code=True)")
        raise PolicyError(f"{type(model).__name__} ({module_name}) is not a class of a codegen-patched dir: load the "
                          "patched dir with from_pretrained(DIR, trust_remote_code=True)")
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
        for where, value in _size_values(sizes, key):
            # a list: one size per expert set (a text and a vision expert width), each split alike
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, int) and v % tp_size for v in values):
                raise PolicyError(f"tp_size {tp_size} does not divide {key} = {value}{where}: pick a tp_size "
                                  "that divides it")


def _size_values(sizes, key):
    """(where, value) of a size: the global one, and every layer's own where a config sets it per layer."""
    with global_sizes_readable(sizes):
        found = [("", getattr(sizes, key, None))]
    if getattr(sizes, "is_heterogeneous", False):
        found += [(f" (layer {index})", getattr(layer, key, None)) for index, layer in enumerate(sizes.per_layer_config)]
    return found


class names_hidden:
    """Within it, the model's modules name themselves without the substrings DeepSpeed's AutoTP special-cases
    (it searches a module's repr for a model name, e.g. "Yuan", and then shards that model's own way)."""

    def __init__(self, model, clashes):
        self.modules = [m for m in model.modules() if any(c in type(m).__name__ for c in clashes)] if clashes else []
        self.clashes = clashes

    def __enter__(self):
        for module in self.modules:
            name = type(module).__name__
            for clash in self.clashes:
                name = name.replace(clash, clash.lower())
            module.__dict__["_get_name"] = lambda name=name: name
        return self

    def __exit__(self, *exc):
        for module in self.modules:
            module.__dict__.pop("_get_name", None)
        return False


class global_sizes_readable:
    """Within it, a config that sets a size per layer answers a read of the global one (transformers raises
    otherwise; DeepSpeed reads the global head count to split by heads, which stays right per layer: it splits
    by kv-head groups)."""

    FLAG = "allow_global_per_layer_attribute_access"

    def __init__(self, config):
        configs = [config, getattr(config, "text_config", None)]
        self.configs = [c for c in configs if c is not None and hasattr(c, self.FLAG)]

    def __enter__(self):
        self.saved = [getattr(c, self.FLAG) for c in self.configs]
        for c in self.configs:
            setattr(c, self.FLAG, True)
        return self

    def __exit__(self, *exc):
        for c, value in zip(self.configs, self.saved):
            setattr(c, self.FLAG, value)
        return False


def moe_blocks(model, layout):
    """(qualified name, module) of every MoE block of the layout's classes."""
    classes = set(layout["moe_classes"])
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__ in classes and all(not path or attribute(m, path) is not None
                                                   for path in expert_paths(layout))]


def probe_deepspeed(deepspeed, shm_in_use=False):
    """One PolicyError naming everything this DeepSpeed lacks that the policy relies on (codegen.policy.runtime.probe)."""
    missing = deepspeed_problems(deepspeed, shm_in_use)
    if missing:
        version = getattr(deepspeed, "__version__", "?")
        raise PolicyError(f"DeepSpeed {version} lacks what this policy relies on: {'; '.join(missing)} "
                          f"(supported: {SUPPORTED_DEEPSPEED})")
