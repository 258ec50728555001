"""Compiled ranks: the sharded model's forward runs as inductor graphs, its one reduction per MoE layer inside them.

torch.compile captures the rank's forward whole (routing, the experts of the rank's shard, norms, rotary, cache
updates: thousands of small eager ops fused), but two ops the eager model issues cannot go to inductor as they are
(torch 2.13, measured). Each is replaced in every captured graph by a functional op registered here once per process
(opaque to the compiler, with a fake kernel for tracing), whose kernel is the one the eager model runs:

- DeepSpeed's in-place shared-memory all-reduce (`deepspeed::inference_all_reduce_`, issued by the MoE blocks'
  reducer and DeepSpeed's own row-parallel layers): inductor schedules it so that the ranks' results diverge, then
  they hang. It becomes `codegen::tp_all_reduce`, in place on DeepSpeed's kernel too, but declared so (its tensor
  `Tensor(a!)`) and ordered after the reduction before it: inductor runs it on the tensor itself where nothing reads
  that tensor's old value (an out-of-place op cost a copy in and a copy back of every reduced tensor: at a batch-16
  prefill of toy GPT-OSS widths, 9 of 4 MiB each way, 11% of the prefill);
- transformers 5.x's grouped matmul of fused experts outside bfloat16 (`transformers::grouped_mm_fallback`, one
  matmul per expert from Python, because `torch._grouped_mm` has no float32 fake kernel): it becomes
  `codegen::grouped_mm`, which visits only the experts that have rows (torch's CPU `_grouped_mm`, which the eager
  model runs, visits every expert), a decode step's all in one C loop (codegen.policy.runtime.kernel). In bfloat16
  on CPU, transformers' `torch._grouped_mm` becomes the same op (the kernel reads bfloat16 weights as they are).

Three more are rewritten where inductor's CPU lowering of them is slow: a row gather `x[index]` becomes
`codegen::take_rows`; a dense product in float32 on CPU (`F.linear`, DeepSpeed's sharded layers' `x @ w.T`: the
attention projections, dense MLPs, shared experts and LM head) becomes `codegen::linear_rows`, whose decode-step rows
run in the C kernel's dense loop (torch's BLAS, which inductor calls too, reads a 16-row product's weight at a third
of the read bandwidth); and any other matmul of a batch of strided rows by a matrix (DeepSpeed's LM-head shard,
`x[..., shard] @ W.T`, in bfloat16) takes its rows contiguous first, so that it is one matmul rather than a batched
one.

Before a compiled forward runs on CPU, the growing KV cache it was given appends in place from then on
(codegen.policy.runtime.kv_cache): transformers' `torch.cat` copied every layer's whole cache at every step.

On CUDA, a decode step whose KV cache is static (transformers' `StaticCache`: fixed shapes, updated in place) runs
as a CUDA graph (inductor's CUDA graph trees): the step's kernels replay in one launch instead of one Python launch
each, which is what remains of a compiled GPU decode step. Prefill, and a decode step on a growing (dynamic) cache,
whose shapes change every call, run as inductor graphs without.

A forward is captured as one graph or runs eager (`fullgraph=True`). Each captured graph's collectives are counted
as it is captured (`CompiledForward.graphs`) and added up as it runs (`CompiledForward.ran`), so a compiled rank's
reductions per forward are checked in the graphs that actually ran: a forward whose count is the eager model's ran
all of its reductions inside its graph.
"""

import functools
import operator
import sys
import types

import torch

from codegen.policy.runtime.base import PolicyError
from codegen.policy.runtime.kernel import define_op, experts_grouped_mm, linear_rows
from codegen.policy.runtime.kv_cache import append_in_place

#: the functional all-reduce every reduction of a compiled rank becomes
TP_ALL_REDUCE = "codegen::tp_all_reduce"
#: the grouped matmul transformers' float32 fallback, and torch's CPU `_grouped_mm` in bfloat16, become
GROUPED_MM = "codegen::grouped_mm"
#: what a row gather `x[index]` becomes
TAKE_ROWS = "codegen::take_rows"
#: what a float32 dense product on CPU (`F.linear(x, w, b)`, DeepSpeed's `x @ w.T`) becomes
LINEAR_ROWS = "codegen::linear_rows"
#: the ops `swap_ops` replaces, by their name in a captured graph
_DEEPSPEED_IN_PLACE = "deepspeed.inference_all_reduce_"
_TRANSFORMERS_FALLBACK = "transformers.grouped_mm_fallback"
#: every all-reduce a captured graph may hold (ours, or torch's functional ones where the policy routes reductions
#: through torch.distributed), and the other collectives
GRAPH_ALL_REDUCES = ("codegen.tp_all_reduce", "all_reduce", "allreduce")
GRAPH_OTHER_COLLECTIVES = ("all_gather", "allgather", "reduce_scatter", "all_to_all", "broadcast")


def _op_name(target):
    """`namespace.op[.overload]` of a torch op, the qualified name of a Python function."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


def _tp_all_reduce(tensor, after):
    """The sum over the tensor-parallel group, into `tensor`: DeepSpeed's shared-memory kernel. `after`: the tensor
    of the reduction this one must follow (`swap_ops`), not read."""
    if tensor.is_contiguous():
        torch.ops.deepspeed.inference_all_reduce_(tensor)
    else:
        tensor.copy_(torch.ops.deepspeed.inference_all_reduce(tensor.contiguous()))


def _take_rows(input, index):
    """`input[index]` for a 1-D integer index: whole rows copied (torch's `index_select`)."""
    return input.index_select(0, index)


def register_ops():
    """`codegen::tp_all_reduce`, `codegen::grouped_mm`, `codegen::take_rows` and `codegen::linear_rows`, once per
    process (every policy file loaded in it shares them: the kernels hold no state of their own).

    `grouped_mm`: (S, in) rows sorted by expert @ (E, in, out) per expert, `offs` the groups' ends, the experts that
    have rows only (codegen.policy.runtime.kernel). torch's CPU `_grouped_mm` visits every expert, empty or not (a
    decode step routes a token to 8 of 128): measured, a toy Qwen3-MoE decode step on 2 ranks took 5.3-7.0 ms with
    one matmul per expert that has rows against 7.2-9.3 ms.
    `linear_rows`: `F.linear(input, weight, bias)`; a decode step's 1-16 rows by the C kernel's dense loop, which
    streams the weight once for all of them where torch's BLAS (and inductor, which calls it) reads 16 rows at a
    third of the read bandwidth, and a short prompt's 17-64 rows, where BLAS packs the weight on every call; a longer
    prompt's rows by a weight in cache by oneDNN's sgemm."""
    if hasattr(torch.ops.codegen, "tp_all_reduce"):
        return
    define_op(TP_ALL_REDUCE, "Tensor(a!) tensor, Tensor? after", _tp_all_reduce, lambda tensor, after: None,
              returns="()")
    # never dead code: a rank whose result does not need a reduction (its LM-head shard is empty under DeepSpeed's
    # grain split at small widths) still owes the other ranks its side of it, or they wait forever
    torch.fx.node.has_side_effect(torch.ops.codegen.tp_all_reduce.default)
    define_op(GROUPED_MM, "Tensor input, Tensor weight, Tensor offs", experts_grouped_mm,
              lambda input, weight, offs: input.new_empty(input.shape[0], weight.shape[-1]))
    define_op(TAKE_ROWS, "Tensor input, Tensor index", _take_rows,
              lambda input, index: input.new_empty(index.shape[0], *input.shape[1:]))
    define_op(LINEAR_ROWS, "Tensor input, Tensor weight, Tensor? bias", linear_rows,
              lambda input, weight, bias: input.new_empty(*input.shape[:-1], weight.shape[0]))


def swap_ops(graph):
    """Replace, in one captured FX graph, DeepSpeed's in-place all-reduce, transformers' grouped-matmul fallback, row
    gathers and float32 dense products by this part's ops, and take strided rows contiguous before any other matmul
    by a matrix; returns how many of each it rewrote.

    Each reduction takes the tensor the one before it reduced as an argument it does not read: the ranks must issue
    them in the same order, and without a data dependence inductor may reorder them (a rank whose LM-head shard is
    empty under DeepSpeed's grain split at small widths has a last reduction that depends on nothing, and ran it
    first)."""
    swapped = {"all_reduce": 0, "grouped_mm": 0, "take_rows": 0, "linear_rows": 0, "matmul_folded": 0}
    previous = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name.startswith(_DEEPSPEED_IN_PLACE):
            tensor = node.args[0]
            with graph.inserting_after(node):
                graph.call_function(torch.ops.codegen.tp_all_reduce.default, (tensor, previous))
            previous = tensor  # read after the reduction: its reduced value, which the next one then depends on
            node.replace_all_uses_with(tensor)  # the eager op's result is its tensor, reduced in place
            graph.erase_node(node)
            swapped["all_reduce"] += 1
        elif name.startswith(_TRANSFORMERS_FALLBACK):
            node.target = torch.ops.codegen.grouped_mm.default
            swapped["grouped_mm"] += 1
        elif node.target is torch._grouped_mm and _grouped_on_cpu(node):
            node.target, node.kwargs = torch.ops.codegen.grouped_mm.default, {"offs": node.kwargs["offs"]}
            swapped["grouped_mm"] += 1
        elif node.target is operator.getitem and _gathers_rows(node):
            node.target = torch.ops.codegen.take_rows.default
            swapped["take_rows"] += 1
        elif (product := _dense_product(node)) is not None:
            rows, weight, bias, transposed = product
            if transposed:
                with graph.inserting_before(node):
                    weight = graph.call_method("t", (weight,))
            node.target, node.args, node.kwargs = torch.ops.codegen.linear_rows.default, (rows, weight, bias), {}
            swapped["linear_rows"] += 1
        elif node.target in (torch.matmul, operator.matmul) and _strided_rows_by_matrix(node):
            with graph.inserting_before(node):
                rows = graph.call_method("contiguous", (node.args[0],))
            node.args = (rows, *node.args[1:])
            swapped["matmul_folded"] += 1
    return swapped


def _gathers_rows(node):
    """`x[index]` with `index` a 1-D integer tensor (the fused experts' sort and unsort of their rows)."""
    values = _two_tensor_args(node)
    if values is None:
        return False
    source, index = values
    return source.dim() >= 1 and index.dim() == 1 and index.dtype in (torch.int64, torch.int32)


def _grouped_on_cpu(node):
    """`torch._grouped_mm(rows, experts, offs=ends)` on CPU (transformers' grouped matmul in bfloat16), no bias nor
    other output dtype: torch's CPU kernel runs a matmul per expert, empty ones included (a decode step routes a
    token to 8 of 128), where `codegen::grouped_mm` reads the bfloat16 experts that have rows in one C loop."""
    values, kwargs = _two_tensor_args(node), node.kwargs
    if values is None or not isinstance(kwargs.get("offs"), torch.fx.Node):
        return False
    if set(kwargs) - {"offs", "bias", "out_dtype"}:
        return False
    rows, experts = values
    return (kwargs.get("bias") is None and kwargs.get("out_dtype") in (None, rows.dtype) and rows.dim() == 2
            and experts.dim() == 3 and rows.device.type == experts.device.type == "cpu")


def _dense_product(node):
    """(rows, weight, bias, transposed) of a dense product in float32 on CPU whose weight has its input dim
    contiguous: `F.linear(x, w, b)` (an nn.Linear), or `x @ m` with `m` such a weight transposed (DeepSpeed's sharded
    layers: `x @ w.transpose(-1, -2)`; `transposed` then, `weight` is `m`). None for any other node."""
    if node.target is torch.nn.functional.linear:  # torch._C._nn.linear, as a captured graph holds it
        rows, weight, bias = (*node.args, None, None)[:3]
        bias = node.kwargs.get("bias", bias)
        nodes = (rows, weight) if bias is None else (rows, weight, bias)
        if set(node.kwargs) - {"bias"} or not all(isinstance(a, torch.fx.Node) for a in nodes):
            return None
        values = [a.meta.get("example_value") for a in nodes]
        if _float32_on_cpu(values) and values[1].dim() == 2 and values[1].stride(-1) == 1:
            return rows, weight, bias, False
        return None
    if node.target in (torch.matmul, operator.matmul) and not node.kwargs:
        values = _two_tensor_args(node)
        if values is not None and _float32_on_cpu(values) and values[1].dim() == 2 and values[1].stride(0) == 1:
            return node.args[0], node.args[1], None, True
    return None


def _float32_on_cpu(values):
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device.type == "cpu" for v in values)


def _strided_rows_by_matrix(node):
    """`a @ w`, `a` a batch of rows (3-D or more) whose rows cannot be viewed as one matrix, `w` a matrix: torch's
    matmul turns it into a batched matmul of 1-row matrices, and inductor lowers that, on CPU, to a loop that reads
    `w` once per batch row (measured on its own, a toy LM-head shard of 4096x256 at batch 16: 1.9-2.0 ms, against
    1.2 ms for one matmul of the rows taken contiguous)."""
    values = None if node.kwargs else _two_tensor_args(node)
    if values is None:
        return False
    rows, matrix = values
    return rows.dim() >= 3 and matrix.dim() == 2 and not rows.is_contiguous()


def _two_tensor_args(node):
    """The example tensors of a node's two positional arguments, both graph values (None otherwise)."""
    if len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    values = tuple(a.meta.get("example_value") for a in node.args)
    return values if all(isinstance(v, torch.Tensor) for v in values) else None


def graph_collectives(graph):
    """(all-reduces, other collectives) a captured graph issues per run."""
    names = [_op_name(n.target) for n in graph.nodes if n.op == "call_function"]
    reduces = sum(1 for n in names if any(k in n for k in GRAPH_ALL_REDUCES))
    others = sum(1 for n in names if any(k in n for k in GRAPH_OTHER_COLLECTIVES))
    return reduces, others


class CapturedGraphs:
    """The torch.compile backend of a compiled rank: each captured graph has its ops swapped (`swap_ops`) and its
    collectives counted, then goes to inductor. `graphs` holds one record per graph captured (a recompilation adds
    one); `ran` adds up, as the graphs run, how many ran and the collectives they issued (`reset_ran` zeroes it):
    what a forward issued, whichever of the graphs its shapes and arguments selected. `cuda_graphs`: a graph whose
    inputs are on a CUDA device runs as a CUDA graph; `records`: the backend whose records this one adds to (one
    forward's graphs counted together, whichever backend captured them)."""

    def __init__(self, cuda_graphs: bool = False, records: "CapturedGraphs | None" = None):
        self.cuda_graphs = cuda_graphs
        self.graphs = [] if records is None else records.graphs
        self.ran = {"graphs": 0, "all_reduces": 0, "other_collectives": 0} if records is None else records.ran

    def reset_ran(self):
        self.ran.update(graphs=0, all_reduces=0, other_collectives=0)

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        swapped = swap_ops(graph_module.graph)
        graph_module.graph.lint()
        graph_module.recompile()
        reduces, others = graph_collectives(graph_module.graph)
        graphed = self.cuda_graphs and any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                                           for t in example_inputs)
        self.graphs.append({"all_reduces": reduces, "other_collectives": others, "cuda_graph": graphed,
                            **{f"swapped_{k}": v for k, v in swapped.items()}})
        patches = {"triton.cudagraphs": True} if graphed else None
        compiled, ran = compile_fx(graph_module, example_inputs, config_patches=patches), self.ran

        def run(*args):
            ran["graphs"] += 1
            ran["all_reduces"] += reduces
            ran["other_collectives"] += others
            return compiled(*args)

        return run


def importable(namespace):
    """torch.compile resolves a traced function's globals by importing its module by name; a policy file loaded
    with `spec_from_file_location` (as the README does) is in no `sys.modules`. Register it (the same objects) under
    its name; another module already under that name is a PolicyError, not a silently wrong graph."""
    name = namespace["__name__"]
    present = sys.modules.get(name)
    if present is None:
        module = types.ModuleType(name)
        module.__dict__.update(namespace)
        sys.modules[name] = module
    elif getattr(present, "init_inference", None) is not namespace.get("init_inference"):
        raise PolicyError(f"compile=True: another module is imported as {name!r}; import this autotp_policy.py under "
                          "a name of its own")


#: the graphs torch.compile may capture per code object before it runs that code eager (torch's default: 8)
RECOMPILE_LIMIT = 64


def _own_entries():
    """torch.compile's arguments that give this model's forward graphs of its own, guarded on its inputs only.

    Every call checks the graph's guards first; by default they cover each Parameter and module attribute of the
    model (measured: 0.72 ms per call of a toy Qwen3-MoE decode step on 2 ranks, 0.28 ms without the modules' own).
    A compiled rank's model does not change under it, so the modules' guards can go, but only where this model's
    graphs are kept apart from every other model's (torch >= 2.13's `isolate_recompiles`; transformers' forward
    decorators share one code object), so that no guard left out can let another model's forward run one of this
    model's graphs. Older torch: every guard is kept.
    """
    import inspect

    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        return {}
    # a forward is captured once per shape kind (prefill, decode, generate's own calls: 5-7 graphs)
    return {"isolate_recompiles": True, "recompile_limit": RECOMPILE_LIMIT,
            "options": {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}}


def step_cache(kwargs):
    """The KV cache a forward call was given (transformers 5.x: `cache`; before, and still taken: `past_key_values`)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def static_cache_step(args, kwargs):
    """Whether a forward call is a CUDA decode step on a static cache: one new token per row, on a CUDA device, the
    cache a fixed-shape one transformers updates in place (`is_compileable`, not the growing `DynamicCache`)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache = step_cache(kwargs)
    return (isinstance(ids, torch.Tensor) and ids.device.type == "cuda" and ids.dim() == 2 and ids.shape[1] == 1
            and bool(getattr(cache, "is_compileable", False)) and type(cache).__name__ != "DynamicCache")


def new_columns(args, kwargs):
    """How many columns a forward call adds to its cache: its tokens per row (None where it cannot tell)."""
    for name in ("input_ids", "inputs_embeds"):
        tokens = kwargs.get(name, args[0] if args and name == "input_ids" else None)
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            return int(tokens.shape[1])
    return None


def mark_static_cache(cache):
    """Mark a static cache's tensors as fixed addresses for CUDA graphs. transformers marks them when it allocates
    them, except inside a compiled region, which a compiled rank's prefill is: unmarked, a CUDA graph would copy
    every layer's cache in and out at each step (or not run as one)."""
    for layer in getattr(cache, "layers", ()):
        if not getattr(layer, "is_initialized", False):
            continue
        for tensor in (layer.keys, layer.values, getattr(layer, "cumulative_length", None)):
            if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "_dynamo_static_input_type"):
                torch._dynamo.mark_static_address(tensor)


def _own_outputs(output):
    """A CUDA graph's outputs live in its memory pool and its next replay overwrites them: the caller gets copies
    (a decode step's logits: one small copy), the cache object as it is."""
    if isinstance(output, dict):
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor):
                output[key] = value.clone()
    return output


class CompiledForward:
    """A model's forward, compiled for this rank: `torch.compile` with dynamic shapes, so one graph serves every
    batch size, prompt length and cache length past the first and a rank does not recompile per request. On CUDA,
    decode steps on a static cache are captured apart and replay as CUDA graphs. `graphs` are the records of the
    graphs captured so far. Where torch.compile cannot capture the forward as one graph, it runs eager from then on
    (`fallback` says why, once, on stderr): every rank fails alike, at capture, before any collective."""

    def __init__(self, model, rank=0):
        register_ops()
        importable(globals())
        own = _own_entries()
        if not own:
            # a forward is captured once per shape kind (prefill, decode, generate's own calls: 5-7 graphs), and
            # transformers' forward decorators share one code object across models: at torch's default limit of 8
            # a second model in the process would silently run eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.backend = CapturedGraphs()
        self.eager = model.forward
        # one graph per forward or none: a forward torch.compile would break into pieces (transformers 4.x's loop over
        # the experts a batch routed to: 15-29 graphs, eager Python between them) ran slower than eager (measured)
        self.compiled = torch.compile(self.eager, backend=self.backend, dynamic=True, fullgraph=True, **own)
        # a second entry of its own: torch's guards tell the backends apart, so a prefill never runs a CUDA graph
        self.graphed = torch.compile(self.eager, backend=CapturedGraphs(cuda_graphs=True, records=self.backend),
                                     dynamic=True, fullgraph=True, **own)
        self.rank = rank
        self.fallback = None

    @property
    def graphs(self):
        return self.backend.graphs

    @property
    def ran(self):
        return self.backend.ran

    def __call__(self, *args, **kwargs):
        # compiled or eager, transformers' growing and sliding CPU cache layers append in place (a static or CUDA
        # cache is left as it is)
        append_in_place(step_cache(kwargs), new_columns(args, kwargs))
        if self.fallback is None:
            try:
                if static_cache_step(args, kwargs):
                    mark_static_cache(step_cache(kwargs))
                    torch.compiler.cudagraph_mark_step_begin()
                    return _own_outputs(self.graphed(*args, **kwargs))
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as exc:
                self.fallback = " ".join(str(exc).split())[:300] or type(exc).__name__
                if self.rank == 0:
                    print(f"codegen policy: compile=True: torch.compile cannot capture the forward as one graph "
                          f"({self.fallback}); running eager",
                          file=sys.stderr, flush=True)
        return self.eager(*args, **kwargs)

    def as_forward(self):
        """This, as a model's `forward`: the eager forward's signature kept (`generate` inspects it)."""
        return functools.wraps(self.eager)(lambda *args, **kwargs: self(*args, **kwargs))


def compile_forward(model, rank=0):
    """Make `model.forward` (and so its `generate`) run compiled; returns the `CompiledForward`."""
    compiled = CompiledForward(model, rank)
    model.forward = compiled.as_forward()
    config = getattr(model, "generation_config", None)
    if config is not None:
        # transformers' `generate` compiles `__call__` itself where the cache is static on CUDA: that would capture
        # this forward again, by inductor as it is, without this part's ops (the reductions among them)
        config.disable_compile = True
    return compiled
