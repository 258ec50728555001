"""One rank of a verify run (started by codegen.runtime, never imported by users).

One launch measures one or more phases, in the order given to --mode (comma-separated), against one
single-process reference computed once per launch (the unpatched dir, fp32, unsharded):

  no-policy  the patched dir with torch.distributed up but no TP policy: must equal the reference
             exactly and reduce nothing (run it first, before any policy touched the process)
  codegen    the patched dir under its generated autotp_policy.py
  stock      stock `deepspeed.init_inference` (AutoTP) on the unpatched dir

For each phase: all-reduce calls in one forward, counted twice, independently: at the Python entry
points (deepspeed.comm `all_reduce` / `inference_all_reduce`, the comm backend's methods,
torch.distributed, functional collectives, the shm op; each call once, at the outermost layer) and
in the C++ profiler (`c10d::allreduce_`, `deepspeed::inference_all_reduce_`, ...), which sees every
reduction whichever Python path issued it; the Python count is split per attention / MoE / dense MLP
block and LM head. Then: logits against the reference, greedy tokens, per-rank parameter bytes
(routed experts, gates, sharded layers vs. the same parameters unsharded), whether sharded weights
are registered Parameters that pin no full-size storage, whether any full-size copy of a sharded
weight is still alive, router weights and types, and (--grad-check) the inserted reduction's
autograd behaviour. Writes rank<k>.json: {"rank", "world_size", "timings", "phases": {mode: figures}}.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

_T_TORCH = time.perf_counter()

#: MoE block classes of every supported family and generation (codegen.families lists the same)
MOE_CLASSES = ("Qwen2MoeSparseMoeBlock", "DeepseekV2Moe", "DeepseekV2MoE")
#: router parameters kept whole on every rank
GATE_SUFFIXES = ("mlp.gate.weight", "shared_expert_gate.weight")
#: C++ operator names of an all-reduce, as the profiler records them (one event per call)
PROFILER_ALLREDUCE = ("c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
                      "_c10d_functional::all_reduce_", "deepspeed::inference_all_reduce_",
                      "deepspeed::inference_all_reduce")


class AllReduceCounter:
    """Counts collective calls at the outermost layer only, whichever entry point issued them."""

    def __init__(self) -> None:
        self.calls = 0
        self.log: list[str] = []  # entry point of each counted call, in order
        self._depth = 0

    def wrap(self, owner: object, name: str, label: str | None = None) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_codegen_counted", False):
            return
        label = label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls += 1
                self.log.append(label)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        counted._codegen_counted = True
        try:
            setattr(owner, name, counted)
        except (AttributeError, TypeError):
            pass

    def install(self) -> None:
        import deepspeed.comm
        import deepspeed.comm.comm
        import torch.distributed

        for owner in (deepspeed.comm, deepspeed.comm.comm):
            for name in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced"):
                self.wrap(owner, name, f"deepspeed.comm.{name}")
        for name in ("all_reduce", "all_reduce_coalesced"):
            self.wrap(torch.distributed, name, f"torch.distributed.{name}")
            self.wrap(torch.distributed.distributed_c10d, name, f"torch.distributed.{name}")
        try:
            import torch.distributed._functional_collectives as funcol

            self.wrap(funcol, "all_reduce", "torch.distributed._functional_collectives.all_reduce")
        except ImportError:
            pass
        cdb = deepspeed.comm.comm.cdb
        if cdb is not None:
            for name in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced"):
                self.wrap(cdb, name, f"deepspeed backend.{name}")
        ops = getattr(torch.ops, "deepspeed", None)
        if ops is not None and hasattr(ops, "inference_all_reduce_"):
            self.wrap(ops, "inference_all_reduce_", "torch.ops.deepspeed.inference_all_reduce_")

    def reset(self) -> None:
        self.calls = 0
        self.log.clear()


def _dtype_kw() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def load(directory: str, remote: bool, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote, **{_dtype_kw(): dtype}).eval()


def has_remote_code(directory: str) -> bool:
    return bool(json.loads(Path(directory, "config.json").read_text()).get("auto_map"))


def _is_expert_param(name: str) -> bool:
    return ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def param_bytes(model) -> dict:
    experts = gates = total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if _is_expert_param(name):
            experts += size
        elif name.endswith(GATE_SUFFIXES):
            gates += size
    return {"experts": experts, "gates": gates, "rest": total - experts, "total": total}


def gate_weights(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if n.endswith(GATE_SUFFIXES)}


def gate_types(model) -> dict:
    """Class name of each router module (the module owning a gate weight)."""
    modules = dict(model.named_modules())
    return {n: type(modules[n.rsplit(".", 1)[0]]).__name__
            for n, _ in model.named_parameters() if n.endswith(GATE_SUFFIXES)}


def moe_blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in MOE_CLASSES]


def decoder_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]


def per_block_counts(blocks, counter: AllReduceCounter) -> tuple[list[int], list]:
    """Hooks adding each block's all-reduces (counter delta between entry and exit) to counts[i]."""
    counts = [0] * len(blocks)
    handles = []
    for i, block in enumerate(blocks):
        start = {}

        def pre(_m, _a, start=start):
            start["n"] = counter.calls

        def post(_m, _a, _o, i=i, start=start):
            counts[i] += counter.calls - start["n"]

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    return counts, handles


def cache_of(output):
    """The model's KV cache from a forward output (transformers 5.x renamed `past_key_values` to `cache`)."""
    for attr in ("past_key_values", "cache"):
        value = getattr(output, attr, None)
        if value is not None:
            return value
    return None


# --------------------------------------------------------------------------------------------- reference


class Reference:
    """The single-process unpatched model's outputs and parameter figures (the model itself is freed)."""

    def __init__(self, directory: str, ids: torch.Tensor, generate: int) -> None:
        t0 = time.perf_counter()
        model = load(directory, has_remote_code(directory), torch.float32)
        t1 = time.perf_counter()
        with torch.no_grad():
            self.logits = model(ids).logits.float()
            t2 = time.perf_counter()
            self.tokens = _greedy(model, ids[:1], generate) if generate else None
        self.timings = {"reference_load_s": t1 - t0, "reference_forward_s": t2 - t1,
                        "reference_generate_s": time.perf_counter() - t2}
        self.bytes = param_bytes(model)
        self.gates = gate_weights(model)
        self.gate_types = gate_types(model)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        del model
        gc.collect()


def _greedy(model, ids, n: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).cpu()


# ------------------------------------------------------------------------------------------------ phases


def build(mode: str, args, dtype, modes: list[str]):
    """The model of one phase, sharded as that phase's user would shard it."""
    import deepspeed

    tensor_parallel = {"tp_grain_size": args.tp_grain_size} if args.tp_grain_size else {}
    if mode == "codegen":
        model = load(args.model, True, dtype)
        path = os.path.join(args.model, "autotp_policy.py")
        spec = importlib.util.spec_from_file_location("codegen_autotp_policy", path)
        policy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(policy)
        extra = {"tensor_parallel": tensor_parallel} if tensor_parallel else {}
        # no dtype: the policy keeps the loaded model's (the default a user relies on; DeepSpeed's is fp16)
        return policy.init_inference(model, tp_size=args.tp, **extra).module
    if mode == "stock":
        directory = args.model if modes == ["stock"] else args.reference
        model = load(directory, has_remote_code(directory), dtype)
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": args.tp, **tensor_parallel}, dtype=dtype,
                                          replace_with_kernel_inject=False)
        return engine.module
    return load(args.model, True, dtype)  # no-policy


def measure(mode: str, model, args, ids, ref: Reference, counter: AllReduceCounter, dist) -> dict:
    layers = decoder_layers(model)
    blocks = moe_blocks(model)
    block_ids = {id(b) for b in blocks}
    groups = {
        "attention": [layer.self_attn for layer in layers],
        "moe": blocks,
        "dense_mlp": [layer.mlp for layer in layers if id(layer.mlp) not in block_ids],
        "lm_head": [m for m in [model.get_output_embeddings()] if m is not None],
    }
    hooks, counts = [], {}
    for key, modules in groups.items():
        counts[key], handles = per_block_counts(modules, counter)
        hooks += handles
    moe_entries: list[str] = []
    for block in blocks:
        mark = {}
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, mark=mark: mark.update(n=len(counter.log))))
        hooks.append(block.register_forward_hook(
            lambda _m, _a, _o, mark=mark: moe_entries.extend(counter.log[mark["n"]:])))
    result: dict = {"mode": mode, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                    "tp_group_size": args.tp}
    with torch.no_grad():
        for _ in range(args.warmup):
            model(ids)
        dist.barrier()
        for key in counts:
            counts[key][:] = [0] * len(counts[key])
        moe_entries.clear()
        counter.reset()
        with _profiled() as profiler:
            out = model(ids)
        result["allreduce_entries"] = _tally(counter.log)
        result["moe_allreduce_entries"] = _tally(moe_entries)
        per_forward = counter.calls
        counts = {key: list(values) for key, values in counts.items()}  # the timed forwards below add more
        prefill_s = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            model(ids)
            prefill_s.append(time.perf_counter() - t0)
    for h in hooks:
        h.remove()
    logits = out.logits.float().cpu()
    lm_head = model.get_output_embeddings()
    result.update({
        "num_layers": model.config.num_hidden_layers,
        "attention_blocks": len(groups["attention"]),
        "moe_blocks": len(blocks),
        "dense_mlp_blocks": len(groups["dense_mlp"]),
        "lm_head_type": type(lm_head).__name__ if lm_head is not None else None,
        "allreduce_per_forward": per_forward,
        "allreduce_per_forward_profiler": _profiler_count(profiler),
        "allreduce_per_attention_block": counts["attention"],
        "allreduce_per_moe_block": counts["moe"],
        "allreduce_per_dense_mlp_block": counts["dense_mlp"],
        "allreduce_lm_head": sum(counts["lm_head"]),
        "maxdiff": (logits - ref.logits).abs().max().item(),
        "bytes": param_bytes(model),
        "full_bytes": ref.bytes,
        "gates_intact": _gates_intact(model, ref.gates),
        "gate_types": gate_types(model),
        "gate_types_reference": ref.gate_types,
        "prefill_s": prefill_s,
    })
    t0 = time.perf_counter()
    result.update(sharding_figures(model, ref, scan=mode == "codegen"))
    t1 = time.perf_counter()
    if args.generate:
        with torch.no_grad():
            result["same_tokens"] = bool(torch.equal(_greedy(model, ids[:1], args.generate), ref.tokens))
    result["phase_timings"] = {"sharding_figures_s": t1 - t0, "generate_s": time.perf_counter() - t1}
    if args.decode_steps:
        with torch.no_grad():
            result.update(_decode(model, ids, args.decode_steps, args.warmup, counter, dist))
    if args.grad_check and mode == "codegen":
        result["grad_check"] = _grad_check(blocks, counter, dist)
    return result


class _profiled:
    """torch.profiler around one forward (CPU activity only); None if the profiler is unavailable."""

    def __enter__(self):
        try:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        except Exception:  # noqa: BLE001 - the Python count still stands
            self.prof = None
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)
        return False


def _profiler_count(profiled: _profiled) -> int | None:
    if profiled.prof is None:
        return None
    return sum(1 for e in profiled.prof.events() if e.name in PROFILER_ALLREDUCE)


def _tally(entries: list[str]) -> dict:
    out: dict[str, int] = {}
    for e in entries:
        out[e] = out.get(e, 0) + 1
    return out


def _gates_intact(model, full_gates: dict) -> bool:
    now = gate_weights(model)
    return bool(full_gates) and now.keys() == full_gates.keys() and all(torch.equal(now[k], full_gates[k]) for k in now)


def sharded_tensors(model) -> dict:
    """name -> tensor of every weight this rank holds a shard of: DeepSpeed's TP layers, codegen's fused experts."""
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
        if getattr(module, "_codegen_sharded", False):
            for attr in ("gate_up_proj", "down_proj"):
                found[prefix + attr] = getattr(module, attr)
    return found


def sharding_figures(model, ref: Reference, scan: bool = True) -> dict:
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
    # a shard that is a view of the full tensor keeps the full storage alive
    oversized = [n for n, p in params.items() if p.untyped_storage().nbytes() > p.numel() * p.element_size()]
    sharded_bytes = sum(t.numel() * t.element_size() for t in sharded.values())
    sharded_full = sum(ref.param_bytes.get(n, 0) for n in sharded)
    # any other live tensor with the full shape of a sharded weight (a copy DeepSpeed or the policy kept)
    full_shapes = {ref.shapes[n] for n, t in sharded.items() if n in ref.shapes and tuple(t.shape) != ref.shapes[n]}
    alive = 0 if scan else None
    if scan and full_shapes:
        gc.collect()
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        for obj in gc.get_objects():
            try:
                if (isinstance(obj, torch.Tensor) and not obj.is_meta and tuple(obj.shape) in full_shapes
                        and obj.untyped_storage().data_ptr() not in own):
                    alive += 1
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
    }


def _tp_group_ranks(model) -> list:
    """The distinct global-rank lists of the groups DeepSpeed's TP layers and codegen's reducers reduce over."""
    groups = []
    for module in model.modules():
        reducer = getattr(module, "_codegen_tp_reducer", None)
        for group in (getattr(module, "mp_group", None), getattr(reducer, "group", None)):
            if group is None:
                continue
            ranks = torch.distributed.get_process_group_ranks(group)
            if ranks not in groups:
                groups.append(ranks)
    return groups


def _decode(model, ids, steps: int, warmup: int, counter: AllReduceCounter, dist) -> dict:
    out = model(ids, use_cache=True)
    cache = cache_of(out)
    token = out.logits[:, -1:].argmax(-1)
    times, counts = [], []
    for step in range(warmup + steps):
        dist.barrier()
        before = counter.calls
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        elapsed = time.perf_counter() - t0
        cache = cache_of(out)
        token = out.logits[:, -1:].argmax(-1)
        if step >= warmup:
            times.append(elapsed)
            counts.append(counter.calls - before)
    return {
        "decode_s": times,
        "decode_median_s": statistics.median(times),
        "allreduce_per_decode_step": max(counts) if counts else 0,
    }


def _grad_check(blocks, counter: AllReduceCounter, dist) -> dict:
    """Backward through the inserted reduction, called as the patched forward calls it.

    Forward: the sum over the TP group (checked against a torch.distributed all-reduce on the same
    group), through the autograd-aware all-reduce, not the no-grad fast path. Backward: the gradient
    reaching it passes through unchanged (each rank's partial sum gets the full upstream gradient).
    """
    block = blocks[0]
    reducer = getattr(block, "_codegen_tp_reducer", None)
    if reducer is None:
        return {"applicable": False}
    inserted = sys.modules[type(block).__module__]._codegen_moe_all_reduce
    rank = dist.get_rank()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    upstream = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    counter.reset()
    with torch.enable_grad():
        y = inserted(block, x * 1.0)
        entries = _tally(counter.log)
        y.backward(upstream)
    expected = x.detach().clone()
    torch.distributed.all_reduce(expected, group=reducer.group)
    counter.reset()
    with torch.no_grad():
        z = inserted(block, x.detach().clone())
    return {
        "applicable": True,
        "autograd_node": type(y.grad_fn).__name__ if y.grad_fn is not None else None,
        "grad_entries": entries,
        "no_grad_entries": _tally(counter.log),
        "forward_is_sum": bool(torch.allclose(y.detach(), expected)),
        "no_grad_is_sum": bool(torch.allclose(z, expected)),
        "grad_identity": bool(torch.equal(x.grad, upstream)),
        "group_ranks": torch.distributed.get_process_group_ranks(reducer.group),
    }


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="dir to run (patched for codegen / no-policy, unpatched for stock)")
    ap.add_argument("--reference", required=True, help="unpatched dir for the single-process reference")
    ap.add_argument("--mode", required=True,
                    help="phases in order, comma-separated: no-policy, codegen, stock (stock loads --reference "
                         "unless it is the only phase)")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="timed prefills")
    ap.add_argument("--grad-check", action="store_true")
    ap.add_argument("--tp-grain-size", type=int, default=0,
                    help="DeepSpeed's tp_grain_size (default: DeepSpeed's, 64); tiny models need less to split evenly")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    modes = args.mode.split(",")
    bad = [m for m in modes if m not in ("no-policy", "codegen", "stock")]
    if bad:
        ap.error(f"unknown mode(s) {bad}")

    import deepspeed
    import deepspeed.comm as dist

    timings = {"import_torch_s": _T_TORCH - _T0}
    t = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
    timings["import_deepspeed_init_s"] = time.perf_counter() - t
    counter = AllReduceCounter()
    counter.install()
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.device == "cpu" else torch.device(args.device, local_rank)
    vocab = json.loads(Path(args.reference, "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))

    t = time.perf_counter()
    ref = Reference(args.reference, ids, args.generate)
    timings["reference_s"] = time.perf_counter() - t
    timings.update(ref.timings)
    phases = {}
    for mode in modes:
        t = time.perf_counter()
        model = build(mode, args, dtype, modes)
        timings[f"{mode}_load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        phases[mode] = measure(mode, model, args, ids.to(device), ref, counter, dist)
        timings[f"{mode}_measure_s"] = time.perf_counter() - t
        del model
        gc.collect()
    timings["total_s"] = time.perf_counter() - _T0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": dist.get_world_size(), "timings": timings, "phases": phases}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    # Python's teardown of torch / DeepSpeed takes seconds and does nothing for a finished rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
