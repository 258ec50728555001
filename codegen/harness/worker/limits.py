"""On the ranks: the machine's limits as the ranks see them, what a loaded setup holds, and which experts its routing
hits (the inputs of codegen.harness.limits' floor).

The limits are measured inside the rank workers, every rank at once (a barrier before each trial), because the
ranks share the memory bus: one rank alone would see more bandwidth than either gets while both run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from codegen.harness.memory import is_expert_param
from codegen.harness.worker.model_figures import WRAPPER_PARTS, moe_blocks, output_embeddings
from codegen.policy.runtime.environment import affinity_cores

#: the read buffer is at least this many times the last-level cache, and at least MIN_BUFFER bytes
CACHE_MULTIPLE, MIN_BUFFER = 4, 256 << 20
#: trials of each measurement (best kept), and the GEMM's side: grown from GEMM_START until one product takes
#: GEMM_SECONDS or reaches GEMM_MAX (a bf16 matmul without native bf16 is ~40x slower: it stays small there)
TRIALS, GEMM_START, GEMM_MAX, GEMM_SECONDS = 5, 256, 2048, 0.05


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0 (Linux sysfs); 32 MiB where unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _best(run, op, trials: int = TRIALS) -> float:
    """The shortest of `trials` timings of op(), every rank starting each after a barrier."""
    best = float("inf")
    for _ in range(trials):
        run.dist.barrier()
        run.sync()
        t0 = time.perf_counter()
        op()
        run.sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_limits(run) -> dict:
    """This rank's memory bandwidth (read, copy) and GEMM throughput in the run's dtype, measured while every rank of
    the launch measures too."""
    world = run.dist.get_world_size()
    cache = last_level_cache_bytes()
    size = max(CACHE_MULTIPLE * cache, MIN_BUFFER)
    available = _available_bytes()
    if available:  # never more than an eighth of what is free, over the ranks
        size = max(min(size, available // (8 * world)), MIN_BUFFER)
    buffer = torch.ones(size // 4, dtype=torch.float32, device=run.device)
    half = buffer.numel() // 2
    buffer.sum()  # fault the pages in
    read = _best(run, buffer.sum)
    copy = _best(run, lambda: buffer[half:2 * half].copy_(buffer[:half]))
    nbytes = buffer.numel() * 4
    del buffer
    # the GEMM: ranks agree on one size (the largest any rank needed to take GEMM_SECONDS)
    n = GEMM_START
    while n < GEMM_MAX:
        a = torch.randn(n, n, device=run.device).to(run.dtype)
        # untimed first: a first product also pays for its output's pages and BLAS's set-up, and timed, it chose a
        # smaller side in some launches of one run than in others (1024 against 2048 on the same machine)
        a @ a
        run.sync()
        t0 = time.perf_counter()
        a @ a
        run.sync()
        if time.perf_counter() - t0 >= GEMM_SECONDS:
            break
        n *= 2
    if world > 1:
        agreed = torch.tensor([n], dtype=torch.int64, device=run.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)  # not under the collective counter
        n = int(agreed.item())
    a = torch.randn(n, n, device=run.device).to(run.dtype)
    b = torch.randn(n, n, device=run.device).to(run.dtype)
    a @ b  # warm-up
    gemm = _best(run, lambda: a @ b, trials=3)
    return {"read_bytes_per_s": nbytes / read, "copy_bytes_per_s": nbytes / copy,  # copy: half read + half written
            "gemm_flops_per_s": 2 * n ** 3 / gemm, "buffer_bytes": nbytes, "last_level_cache_bytes": cache,
            "gemm_n": n, "dtype": run.dtype_name, "threads": torch.get_num_threads(), "concurrent_ranks": world,
            # the cores the launcher bound this rank to (codegen.ranks)
            "cores": affinity_cores()}


# ------------------------------------------------------------------------- what a setup holds, what it hits


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # a DTensor (native TP): this rank's shard


def _experts_module(block):
    """The module holding an MoE block's routed experts (any family's experts attribute), or None."""
    from codegen.harness.memory import EXPERT_ATTRS

    for attr in sorted(EXPERT_ATTRS):
        found = getattr(block, attr, None)
        if isinstance(found, torch.nn.Module):
            return found
    return None


def expert_count(experts) -> int:
    """How many routed experts a module holds: a ModuleList's length, else its `num_experts`, else the leading
    dimension of its 3-D (fused) parameters."""
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    if isinstance(getattr(experts, "num_experts", None), int):
        return experts.num_experts
    dims = [_local(p).shape[0] for p in experts.parameters() if p.dim() == 3]
    return max(dims, default=1)


def inventory(model) -> dict:
    """What one forward of this rank's shard reads, by kind (codegen.harness.limits.forward_work): the parameters
    walked as the rank holds them (DTensors by their local shard; a tied weight counted once, as a matrix)."""
    head = output_embeddings(model)
    head_weight = getattr(head, "weight", None)
    kinds: dict[int, tuple[str, torch.Tensor]] = {}
    for mname, module in model.named_modules():
        if WRAPPER_PARTS & set(mname.split(".")):  # a vision tower: not run on a text prompt
            continue
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if p is head_weight:
                kind = "head"
            elif is_expert_param(full):
                kind = "expert"
            elif isinstance(module, torch.nn.Embedding):
                kind = "lookup"
            else:
                kind = "dense"
            if kinds.get(id(p), ("lookup",))[0] == "lookup" or kind == "head":
                kinds[id(p)] = (kind, p)
    out = {"dense_bytes": 0, "dense_flops_per_token": 0, "head_bytes": 0, "head_flops_per_token": 0,
           "lookup_bytes": 0, "lookup_row_bytes": 0}
    for kind, p in kinds.values():
        local = _local(p)
        size = local.numel() * local.element_size()
        matrix = 2 * local.numel() if local.dim() >= 2 else 0
        if kind == "dense":
            out["dense_bytes"] += size
            out["dense_flops_per_token"] += matrix
        elif kind == "head":
            out["head_bytes"] += size
            out["head_flops_per_token"] += matrix
        elif kind == "lookup":
            out["lookup_bytes"] += size
            out["lookup_row_bytes"] += local.shape[-1] * local.element_size() if local.dim() >= 2 else size
    out["moe"] = []
    names = {id(m): n for n, m in model.named_modules()}
    for block in moe_blocks(model):
        experts = _experts_module(block)
        prefix = f"{names[id(block)]}." if names[id(block)] else ""
        held = [(n, _local(p)) for n, p in block.named_parameters() if is_expert_param(prefix + n)]
        out["moe"].append({"experts": expert_count(experts) if experts is not None else 1,
                           "expert_bytes": sum(t.numel() * t.element_size() for _, t in held),
                           "expert_numel": sum(t.numel() for _, t in held)})
    return out


class RoutingRecorder:
    """Per MoE layer, the distinct experts the routing hit and the (token, expert) pairs routed, inside `with`.

    Hooks on the experts module: a fused one is called with the top-k indices (the first integer tensor of its
    call); a list of per-expert modules (transformers 4.x) calls each expert it routes tokens to, with its rows.
    The hooks exist only inside `with` (the untimed counted passes): a timed forward pays nothing for them.
    """

    def __init__(self, model) -> None:
        self.handles: list = []
        self.layers: list[dict] = []
        self.experts = []
        for block in moe_blocks(model):
            self.layers.append({"distinct": set(), "assignments": 0, "seen": False})
            self.experts.append(_experts_module(block))

    def __enter__(self) -> RoutingRecorder:
        for k, experts in enumerate(self.experts):
            if experts is None:
                continue
            if isinstance(experts, torch.nn.ModuleList):
                for e, expert in enumerate(experts):
                    self.handles.append(expert.register_forward_pre_hook(
                        lambda _m, args, k=k, e=e: self._expert(k, e, args)))
            else:
                count = expert_count(experts)
                self.handles.append(experts.register_forward_pre_hook(
                    lambda _m, args, kwargs, k=k, count=count: self._fused(k, count, args, kwargs), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _expert(self, k: int, e: int, args) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        rows = args[0].numel() // max(args[0].shape[-1], 1)
        layer = self.layers[k]
        layer["seen"] = True
        if rows:
            layer["distinct"].add(e)
            layer["assignments"] += rows

    def _fused(self, k: int, count: int, args, kwargs) -> None:
        found = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        if not found:
            return
        index = _local(found[0]).reshape(-1)
        index = index[(index >= 0) & (index < count)]
        layer = self.layers[k]
        layer["seen"] = True
        layer["distinct"].update(index.unique().tolist())
        layer["assignments"] += int(index.numel())

    def take(self) -> list[dict] | None:
        """The hits since the last take, per MoE layer; None if some layer's routing was not seen."""
        hits = None if any(not layer["seen"] for layer in self.layers) else [
            {"distinct": len(layer["distinct"]), "assignments": layer["assignments"]} for layer in self.layers]
        for layer in self.layers:
            layer.update(distinct=set(), assignments=0, seen=False)
        return hits
