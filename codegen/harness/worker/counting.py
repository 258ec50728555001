"""Collectives counted where every path meets: torch's dispatcher, one event per collective op.

A forward's all-reduces reach the dispatcher as one op each, whichever Python entry point issued them:
DeepSpeed's shared-memory op (`deepspeed::inference_all_reduce_`), torch.distributed's (`c10d::allreduce_`),
or the functional collectives DTensor uses (`_c10d_functional::all_reduce`). A TorchDispatchMode sees each
exactly once, so nothing is wrapped and nothing is counted twice. torch's own CommDebugMode does this for the
torch collectives but not for DeepSpeed's op; this counts both. The mode costs Python time on every op of a
forward, so timed units never run under it (codegen.harness.worker.ab counts in passes of their own).
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

#: dispatcher names (`namespace::op`) of an all-reduce
ALL_REDUCE_OPS = frozenset({
    "c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
    "_c10d_functional::all_reduce_", "_c10d_functional::all_reduce_coalesced",
    "_c10d_functional::all_reduce_coalesced_", "deepspeed::inference_all_reduce_", "deepspeed::inference_all_reduce",
    "codegen::tp_all_reduce",  # a compiled rank's (codegen.policy.runtime.compiled); its kernel's own op is not seen
})
#: the other collectives a forward may issue (counted as `gathers`: transformers' native TP gathers its LM head)
OTHER_COLLECTIVE_OPS = frozenset({
    "c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_", "c10d::reduce_scatter_",
    "c10d::_reduce_scatter_base_", "c10d::alltoall_", "c10d::alltoall_base_", "c10d::broadcast_",
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out",
    "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single",
    "_c10d_functional::broadcast", "_c10d_functional::broadcast_",
})


class CollectiveCounter(TorchDispatchMode):
    """`with counter:` counts collective ops: `calls` all-reduces, `gathers` the others; `log` their op names."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.gathers = 0
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in ALL_REDUCE_OPS:
            self.calls += 1
            self.log.append(name)
        elif name in OTHER_COLLECTIVE_OPS:
            self.gathers += 1
            self.log.append(name)
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.calls = 0
        self.gathers = 0
        self.log.clear()


def per_block_counts(blocks, counter: CollectiveCounter, attr: str = "calls",
                     inside: list[list] | None = None) -> tuple[list[int], list]:
    """Hooks adding each block's all-reduces (or `gathers`: the counter's delta between entry and exit) to
    counts[i], less those of the modules `inside[i]` nested in it; they count only what runs under the counter."""
    counts = [0] * len(blocks)
    handles = []

    def span(module, i: int, sign: int) -> None:
        start = {}

        def pre(_m, _a):
            start["n"] = getattr(counter, attr)

        def post(_m, _a, _o):
            counts[i] += sign * (getattr(counter, attr) - start["n"])

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    for i, block in enumerate(blocks):
        span(block, i, 1)
        for inner in (inside[i] if inside else []):
            span(inner, i, -1)
    return counts, handles


def tally(entries: list[str]) -> dict:
    out: dict[str, int] = {}
    for e in entries:
        out[e] = out.get(e, 0) + 1
    return out


#: DeepSpeed's inference all-reduce (every reduction stock AutoTP's forward issues): in place, and out of place
_DEEPSPEED_REDUCTIONS = {"deepspeed::inference_all_reduce_": False, "deepspeed::inference_all_reduce": True}


class SkippedReductions(TorchDispatchMode):
    """`with SkippedReductions():` DeepSpeed's all-reduce ops return their input, unreduced: a forward that
    touches no other rank. Its values are wrong, its shapes are not, so a rank whose shard cannot multiply
    fails here alone, before any rank waits in a collective for a rank that will never arrive."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out_of_place = _DEEPSPEED_REDUCTIONS.get(func._schema.name)
        if out_of_place is None:
            return func(*args, **(kwargs or {}))
        return args[0].clone() if out_of_place else args[0]

