"""Attention pieces DeepSpeed's AutoTP gets wrong, put right: per-head Parameters, full-width norms, per-head
linears and replicated layers.

DeepSpeed splits the q/k/v projections by heads but never touches a per-head Parameter (attention sinks) or a
norm over all heads of a projection, and wraps every `nn.Linear` it finds (routers, MLA low-rank inputs, a DSA
indexer, a vision tower included): per-head Parameters are cut to the heads DeepSpeed left on the rank, a
full-width norm and its projection stay whole and each rank keeps its heads of the normed output, and the
modules that must stay whole are kept out of its sight.
"""

import torch

from codegen.policy.runtime.base import SUPPORTED_DEEPSPEED, PolicyError, attribute


def head_param_owners(model, layout):
    """Modules holding Parameters the layout names as one value per attention head (e.g. attention sinks).

    DeepSpeed splits the q/k/v projections by heads but never touches such a Parameter, so attention would
    concatenate this rank's heads with every head's values. Recorded before DeepSpeed shards: the head
    count (the Parameter's first dim) and the full output rows of the owner's nn.Linear children.
    """
    wanted = set(layout.get("attention_head_params", ()))
    # `child.param`: held by a child of the attention module (Mistral Large 4's per-head softmax scaling), looked up
    # from the attention modules only (an indexer, kept whole, may hold a child of the same name)
    nested = {w for w in wanted if "." in w}
    attention = set(layout.get("attention_attrs", ()))
    owners = []
    if not wanted:
        return owners
    for name, module in model.named_modules():
        params = {attr: p for attr, p in module._parameters.items() if attr in wanted and p is not None}
        if nested and name.rsplit(".", 1)[-1] in attention:
            for path in sorted(nested):
                child, _, attr = path.partition(".")
                param = getattr(module._modules.get(child), "_parameters", {}).get(attr)
                if param is not None:
                    params[path] = param
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


# ------------------------------------------------------------------------------------------ full-width norms


def full_width_norm_owners(model, layout):
    """Attention modules with a norm over a projection's whole output (every head), recorded before DeepSpeed
    shards: the (norm, projection) pairs, and the full output rows of the other projections DeepSpeed will split.

    The norm's mean runs over all heads, so a rank holding some heads cannot compute it from its own columns.
    The projection and the norm stay whole on every rank (`detach_full_width_norms`) and each rank keeps its
    heads of the normed output (`slice_full_width_norms`): exact, and no collective beyond attention's own.
    """
    pairs = [tuple(pair) for pair in layout.get("full_width_norms", ())]
    owners = []
    if not pairs:
        return owners
    for name, module in model.named_modules():
        found = [(norm, proj) for norm, proj in pairs if isinstance(module._modules.get(norm), torch.nn.Module)
                 and isinstance(module._modules.get(proj), torch.nn.Linear)]
        if not found:
            continue
        for norm, proj in found:
            weight = getattr(module._modules[norm], "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.numel() != module._modules[proj].out_features:
                raise PolicyError(f"{name}.{norm} does not span the whole output of {name}.{proj}: "
                                  "re-run patch (the family table names it a full-width norm)")
        whole = {attr for pair in found for attr in pair}
        rows = {attr: c.out_features for attr, c in module._modules.items()
                if isinstance(c, torch.nn.Linear) and attr not in whole}
        owners.append({"where": name, "module": module, "pairs": found, "rows": rows})
    return owners


def _sliced_norm_class(base):
    """A subclass of the norm's class whose output is this rank's heads of the full-width normed tensor."""

    class FullWidthNormOwnHeads(base):
        def forward(self, *args, **kwargs):
            start, width = self._codegen_own_columns
            return super().forward(*args, **kwargs)[..., start : start + width].contiguous()

    FullWidthNormOwnHeads.__qualname__ = f"FullWidthNormOwnHeads[{base.__name__}]"
    return FullWidthNormOwnHeads


_SLICED_NORMS = {}


def detach_full_width_norms(owners):
    """The norms and their projections, kept out of DeepSpeed's sight (whole on every rank)."""
    return [detach_child(owner["module"], attr, f"{owner['where']}.{attr}") for owner in owners
            for pair in owner["pairs"] for attr in pair]


def own_fraction(owner, column_class):
    """(local rows, full rows) of the projections DeepSpeed split: the share of the heads this rank holds."""
    shares = set()
    for attr, full in owner["rows"].items():
        child = owner["module"]._modules.get(attr)
        if isinstance(child, column_class):
            shares.add((child.weight.shape[0], full))
    fractions = {local / full for local, full in shares}
    if len(fractions) != 1:
        raise PolicyError(f"{owner['where']}: DeepSpeed split {'none' if not fractions else 'differently'} of its "
                          "other projections by heads: cannot keep this rank's heads of its full-width norms")
    return shares.pop()


def _offsets(widths, dist, group, rank, world, device):
    """Where this rank's share of each tensor starts: the widths the lower ranks keep, added (one all_gather)."""
    mine = torch.tensor(widths, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [sum(int(g[i]) for g in gathered[:rank]) for i in range(len(widths))]


def _own_width(owner, attr, total, column_class):
    local, full = own_fraction(owner, column_class)
    if (total * local) % full:
        raise PolicyError(f"{owner['where']}.{attr}: this rank's share {local}/{full} of the heads is not "
                          f"a whole number of its {total} columns")
    return total * local // full


@torch.no_grad()
def slice_full_width_norms(owners, dist, group, rank, world, column_class):
    """Each full-width norm returns the columns of the heads this rank holds (the share DeepSpeed gave its
    split projections), at the offset the lower ranks' shares add up to (one all_gather at init)."""
    if not owners:
        return
    widths = [_own_width(owner, norm, owner["module"]._modules[proj].out_features, column_class)
              for owner in owners for norm, proj in owner["pairs"]]
    starts = _offsets(widths, dist, group, rank, world, next(owners[0]["module"].parameters()).device)
    index = 0
    for owner in owners:
        for norm, _ in owner["pairs"]:
            module = owner["module"]._modules[norm]
            base = type(module)
            if base not in _SLICED_NORMS:
                _SLICED_NORMS[base] = _sliced_norm_class(base)
            module.__class__ = _SLICED_NORMS[base]
            module._codegen_own_columns = (starts[index], widths[index])
            index += 1


# ------------------------------------------------------------------------------------------ per-head linears


def head_linear_owners(model, layout):
    """Attention modules with an `nn.Linear` whose output rows are per head (an output gate), recorded before
    DeepSpeed shards: those linears, and the full output rows of the projections DeepSpeed will split.

    DeepSpeed cuts such a layer in grain-sized steps (its name decides), which need not fall on the heads
    the q/k/v split left on the rank; kept whole from it (`detach_head_linears`), each rank then keeps the
    rows of its own heads (`slice_head_linears`).
    """
    wanted = tuple(layout.get("attention_head_linears", ()))
    attention = set(layout.get("attention_attrs", ()))
    whole = set(layout.get("whole_modules", ()))
    owners = []
    if not wanted:
        return owners
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in attention:  # an MLP's gate_proj is not a per-head gate
            continue
        if type(module).__name__ in whole:  # a mixer kept whole keeps its gates whole too
            continue
        found = [attr for attr in wanted if isinstance(module._modules.get(attr), torch.nn.Linear)]
        if found:
            rows = {attr: c.out_features for attr, c in module._modules.items()
                    if isinstance(c, torch.nn.Linear) and attr not in found}
            owners.append({"where": name, "module": module, "linears": found, "rows": rows})
    return owners


def detach_head_linears(owners):
    return [detach_child(owner["module"], attr, f"{owner['where']}.{attr}") for owner in owners
            for attr in owner["linears"]]


@torch.no_grad()
def slice_head_linears(owners, dist, group, rank, world, column_class):
    """Each per-head linear keeps the output rows of the heads this rank holds (one all_gather at init)."""
    if not owners:
        return
    linears = [(owner, attr) for owner in owners for attr in owner["linears"]]
    widths = [_own_width(owner, attr, owner["module"]._modules[attr].out_features, column_class)
              for owner, attr in linears]
    starts = _offsets(widths, dist, group, rank, world, next(owners[0]["module"].parameters()).device)
    for (owner, attr), start, width in zip(linears, starts, widths):
        linear = owner["module"]._modules[attr]
        linear.weight.data = linear.weight.data[start : start + width].clone()  # clone frees the full rows
        if linear.bias is not None:
            linear.bias.data = linear.bias.data[start : start + width].clone()
        linear.out_features = width


# --------------------------------------------------------------------------------------- replicated layers


def detach_replicated(model, blocks, layout):
    """Take routers (and the experts' latent projections), replicated attention modules, the modules kept whole by
    class (a token mixer whose head split is not exact) and a wrapper's vision tower and projector out of the model,
    so DeepSpeed cannot shard or wrap them.

    DeepSpeed's AutoTP keeps a few names whole by its own rules and wraps any `nn.Linear` (subclasses too);
    a module that is not in the tree while it shards is left alone whatever its name or type.
    Returns what `reattach` and `check_replicated` need.
    """
    kept = []
    for name, block in blocks:
        for path in layout["routers"]:
            # a dotted path: the router of one of the block's expert sets (`text_moe.gate`)
            owner_path, _, attr = path.rpartition(".")
            owner = attribute(block, owner_path) if owner_path else block
            if not isinstance(getattr(owner, "_modules", {}).get(attr), torch.nn.Module):
                raise PolicyError(f"{name} has no router {path!r} (named by the family table): re-run patch")
            kept.append(detach_child(owner, attr, f"{name}.{path}"))
        # latent projections into and out of the experts' width: whole on every rank where the block has them
        fused = layout.get("fused", {})
        for attr in [fused.get(k, "") for k in ("latent_in", "latent_out")]:
            if attr and isinstance(block._modules.get(attr), torch.nn.Module):
                kept.append(detach_child(block, attr, f"{name}.{attr}"))
    wanted = set(layout["attention_replicated"]) | set(layout.get("replicated", ()))
    whole = set(layout.get("whole_modules", ()))
    for name, parent in list(model.named_modules()):
        for attr in [a for a, child in parent._modules.items()
                     if child is not None and (a in wanted or type(child).__name__ in whole)]:
            kept.append(detach_child(parent, attr, f"{name}.{attr}" if name else attr))
    return kept


def _fingerprint(tensor, dtype):
    """(shape, sum, sum of |x|) in float64 of the tensor as the engine's dtype holds it: a split changes the
    shape, a change of any value the sums (a copy of a vision tower per rank would cost its whole size)."""
    t = tensor.detach().cpu()  # one reduction order, wherever the module lives
    if t.is_floating_point() and dtype is not None:
        t = t.to(dtype)
    t = t.double()
    return tuple(tensor.shape), t.sum().item(), t.abs().sum().item()


def detach_child(parent, attr, where):
    module = parent._modules[attr]
    entry = {"parent": parent, "attr": attr, "where": where, "module": module, "type": type(module),
             "order": list(parent._modules)}
    del parent._modules[attr]
    return entry


def fingerprint_kept(kept, dtype):
    """Each detached module's tensors, fingerprinted as the engine's dtype will hold them (before DeepSpeed runs)."""
    for entry in kept:
        entry["snapshot"] = {n: _fingerprint(t, dtype) for n, t in entry["module"].state_dict().items()}


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
    """Every detached module is back, of its own type (or the full-width norm's own-heads subclass of it), with
    every tensor whole and unchanged."""
    for entry in kept:
        module = entry["parent"]._modules.get(entry["attr"])
        state = module.state_dict() if isinstance(module, torch.nn.Module) else {}
        kind = type(module)
        same_type = kind is entry["type"] or _SLICED_NORMS.get(entry["type"]) is kind
        same = same_type and state.keys() == entry["snapshot"].keys() and all(
            _fingerprint(state[n], None) == print_ for n, print_ in entry["snapshot"].items())
        if not same:
            raise PolicyError(f"{entry['where']} was split or changed by DeepSpeed: it must stay replicated")
