"""Attention pieces DeepSpeed's AutoTP gets wrong, put right: per-head Parameters and replicated layers.

DeepSpeed splits the q/k/v projections by heads but never touches a per-head Parameter (attention sinks),
and wraps every `nn.Linear` it finds (routers and MLA low-rank inputs included): per-head Parameters are cut
to the heads DeepSpeed left on the rank, and the layers that must stay whole are kept out of its sight.
"""

import torch

from codegen.policy.runtime.base import SUPPORTED_DEEPSPEED, PolicyError


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
