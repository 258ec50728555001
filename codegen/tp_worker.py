"""The one rank worker of verify, bench and demo (started by codegen.runtime.launch, never imported by users).

A launch reads one spec (JSON) naming several jobs; each job is a model dir, its unpatched reference
dir and the phases to measure, in order, against one single-process reference per job (the
unpatched dir, fp32, unsharded, computed once per job):

  no-policy  the patched dir with torch.distributed up but no TP policy: must equal the reference
             exactly and reduce nothing (list it before any policy phase)
  codegen    the patched dir under its generated autotp_policy.py
  stock      stock `deepspeed.init_inference` (AutoTP) on the reference dir
  ab         the bench's phase: the job's setups (stock (a), codegen (b), transformers' native TP
             (d), `options.setups`) loaded side by side, every timed unit (a prefill, a decode step)
             run by each in a rotating order (ABBA generalised), each after a barrier; decode steps
             are fed the reference's greedy tokens (teacher forcing) so all decode the same sequence;
             per unit: time, all-reduces and other collectives (per MoE block too), logits vs the
             float32 reference (absolute and relative) and greedy agreement; at a 16-bit dtype the
             reference also measures the unsharded model's own error at that dtype (the yardstick)

no-policy / codegen / stock measure one forward: all-reduce calls counted twice, independently: at the
Python entry points (deepspeed.comm `all_reduce` / `inference_all_reduce`, the comm backend's methods,
torch.distributed, functional collectives, the shm op; each call once, at the outermost layer) and in
the C++ profiler (`c10d::allreduce_`, `deepspeed::inference_all_reduce_`, ...), which sees every
reduction whichever Python path issued it; the Python count is split per attention / MoE / dense MLP
block and LM head. Then: logits against the reference, greedy tokens, per-rank parameter bytes,
whether sharded weights are registered Parameters that pin no full-size storage, whether any
full-size copy of a sharded weight is still alive, router weights and types, and (grad_check) the
inserted reduction's autograd behaviour.

MoE blocks, routers, experts and fused expert tensors are found by the names in codegen.families.
Stock AutoTP may crash on a family (it does not know every attention's extra parameters): stock is a
comparison, so a stock phase that raises while loading or on its first forward is recorded as
{"mode": "stock", "crashed": "<ExceptionType>: <first line>"} and the launch goes on (in ab, with
codegen alone for that job). The ranks agree on it with one all-reduce of a flag after the guarded
section, so a rank that catches the error reaches the same next collective as the others. The
no-policy and codegen phases are never guarded: their errors fail the launch.

Rank 0 prints `@@codegen-progress <message>` lines (codegen.runtime shows them). Writes
rank<k>.json: {"rank", "world_size", "timings", "jobs": {name: {phase: figures}}}; on failure
rank<k>.error (one line) and exit 1.
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
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from codegen.families import FAMILIES, moe_class_names  # noqa: E402
from codegen.memory import FUSED, LOAD_ORDER, ROW_PARALLEL_BIASES, is_expert_param  # noqa: E402

_T_TORCH = time.perf_counter()

PHASES = ("no-policy", "codegen", "stock", "ab")
PROGRESS = "@@codegen-progress "
#: what a job runs with unless the spec says otherwise
DEFAULTS = dict(prompt_len=16, batch=2, generate=16, decode_steps=0, warmup=1, repeats=1, grad_check=False,
                tp_grain_size=0)
#: C++ operator names of an all-reduce, as the profiler records them (one event per call)
PROFILER_ALLREDUCE = ("c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
                      "_c10d_functional::all_reduce_", "deepspeed::inference_all_reduce_",
                      "deepspeed::inference_all_reduce")
#: collectives other than all-reduce a forward may issue (counted as `gathers`), where torch defines them
OTHER_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_tensor", "all_gather_tensor_autograd",
                     "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                     "all_to_all", "all_to_all_single", "broadcast")
#: how progress lines name each setup of the ab phase
LABELS = {"stock": "(a) stock AutoTP", "codegen": "(b) codegen", "native": "(d) transformers native TP"}
MOE_CLASSES = moe_class_names()
#: router attributes of each MoE block class (kept whole on every rank)
ROUTERS = {cls: family.routers for family in FAMILIES.values() for cls in family.moe_classes}
#: decoder-layer attributes holding the MLP or MoE block, every family and generation ("mlp" first)
MLP_ATTRS = tuple(dict.fromkeys(a for family in FAMILIES.values() for a in family.moe_block_attrs))


class AllReduceCounter:
    """Counts collective calls at the outermost layer only, whichever entry point issued them.

    `calls` counts all-reduces; `gathers` every other collective a forward may issue (all-gathers,
    reduce-scatters, all-to-alls: transformers' native TP gathers the LM head's shards, for one).
    """

    def __init__(self) -> None:
        self.calls = 0
        self.gathers = 0
        self.log: list[str] = []  # entry point of each counted call, in order
        self._depth = 0

    def wrap(self, owner: object, name: str, label: str | None = None, kind: str = "all_reduce") -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_codegen_counted", False):
            return
        label = label or f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._depth == 0:
                if kind == "all_reduce":
                    self.calls += 1
                else:
                    self.gathers += 1
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
            for name in OTHER_COLLECTIVES:
                self.wrap(funcol, name, f"torch.distributed._functional_collectives.{name}", kind="other")
        except ImportError:
            pass
        for name in OTHER_COLLECTIVES:
            self.wrap(torch.distributed, name, f"torch.distributed.{name}", kind="other")
            self.wrap(torch.distributed.distributed_c10d, name, f"torch.distributed.{name}", kind="other")
        cdb = deepspeed.comm.comm.cdb
        if cdb is not None:
            for name in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced"):
                self.wrap(cdb, name, f"deepspeed backend.{name}")
        ops = getattr(torch.ops, "deepspeed", None)
        if ops is not None and hasattr(ops, "inference_all_reduce_"):
            self.wrap(ops, "inference_all_reduce_", "torch.ops.deepspeed.inference_all_reduce_")

    def reset(self) -> None:
        self.calls = 0
        self.gathers = 0
        self.log.clear()


# ------------------------------------------------------------------------------------------ model figures


def _dtype_kw() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def load(directory: str, remote: bool, dtype: torch.dtype, **extra):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote, **{_dtype_kw(): dtype},
                                                **extra).eval()


def has_remote_code(directory: str) -> bool:
    return bool(model_config(directory).get("auto_map"))


def load_policy(directory: str, name: str):
    """The dir's generated autotp_policy.py, imported as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "autotp_policy.py"))
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    return policy


def moe_blocks(model) -> list:
    return [m for m in model.modules() if type(m).__name__ in MOE_CLASSES]


def router_params(model) -> dict:
    """name -> (parameter, router module) of every router the family table names, in every MoE block."""
    found = {}
    for block_name, block in model.named_modules():
        for attr in ROUTERS.get(type(block).__name__, ()):
            router = getattr(block, attr, None)
            if isinstance(router, torch.nn.Module):
                for pname, p in router.named_parameters():
                    found[f"{block_name}.{attr}.{pname}"] = (p, router)
    return found


def param_bytes(model) -> dict:
    gates = set(router_params(model))
    experts = routers = total = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor (native TP): this rank's shard
        size = local.numel() * local.element_size()
        total += size
        if is_expert_param(name):  # the one rule, shared with the bench's memory plan
            experts += size
        elif name in gates:
            routers += size
    return {"experts": experts, "gates": routers, "rest": total - experts, "total": total}


def gate_weights(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, (p, _) in router_params(model).items()}


def gate_types(model) -> dict:
    """Class name of each router module (the module owning a gate weight)."""
    return {n: type(module).__name__ for n, (_, module) in router_params(model).items()}


def layer_mlp(layer):
    """The decoder layer's MLP or MoE block, under any name the family table gives it (any generation)."""
    for attr in MLP_ATTRS:
        block = getattr(layer, attr, None)
        if isinstance(block, torch.nn.Module):
            return block
    return None


def decoder_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "self_attn") and layer_mlp(m) is not None]


def per_block_counts(blocks, counter: AllReduceCounter, attr: str = "calls") -> tuple[list[int], list]:
    """Hooks adding each block's all-reduces (or `gathers`: counter delta between entry and exit) to counts[i]."""
    counts = [0] * len(blocks)
    handles = []
    for i, block in enumerate(blocks):
        start = {}

        def pre(_m, _a, start=start):
            start["n"] = getattr(counter, attr)

        def post(_m, _a, _o, i=i, start=start):
            counts[i] += getattr(counter, attr) - start["n"]

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


class Run:
    """What every phase of a launch shares: options, device, dtype, the counter, the process group."""

    def __init__(self, spec: dict, dist, counter: AllReduceCounter) -> None:
        self.tp = spec["tp"]
        self.device_kind = spec.get("device", "cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cpu") if self.device_kind == "cpu" else torch.device(self.device_kind, local_rank)
        self.dtype_name = spec.get("dtype", "float32")
        self.dtype = getattr(torch, self.dtype_name)
        self.dist = dist
        self.counter = counter
        self.rank = dist.get_rank()

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(f"{PROGRESS}{message}", flush=True)

    def sync(self) -> None:
        if self.device_kind == "cuda":
            torch.cuda.synchronize()

    def build(self, phase: str, job: dict, opts: dict):
        """The model of one phase, sharded as that phase's user would shard it."""
        import deepspeed

        grain = {"tp_grain_size": opts["tp_grain_size"]} if opts["tp_grain_size"] else {}
        if phase == "codegen":
            model = load(job["model"], True, self.dtype)
            policy = load_policy(job["model"], "codegen_autotp_policy_" + "".join(
                c if c.isalnum() else "_" for c in job["name"]))
            extra = {"tensor_parallel": grain} if grain else {}
            # no dtype on CPU: the policy keeps the loaded model's (the default a user relies on; DeepSpeed's is fp16)
            dtype = {"dtype": self.dtype} if self.device_kind != "cpu" else {}
            return policy.init_inference(model, tp_size=self.tp, **extra, **dtype).module
        if phase == "native":  # transformers' own TP plan over the same ranks (loads each rank's shard)
            return load(job["reference"], has_remote_code(job["reference"]), self.dtype, tp_plan="auto")
        if phase == "stock":
            model = load(job["reference"], has_remote_code(job["reference"]), self.dtype)
            return deepspeed.init_inference(model, tensor_parallel={"tp_size": self.tp, **grain}, dtype=self.dtype,
                                            replace_with_kernel_inject=False).module
        return load(job["model"], True, self.dtype)  # no-policy


# ------------------------------------------------------------------------------------ a stock crash, recorded


def crash_line(exc: BaseException) -> str:
    """`<ExceptionType>: <first line of the message>`: what a crashed phase records."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def guarded(run: Run, what: str, section):
    """(section(), None), or (None, crash line) on every rank when it raised on any rank.

    The ranks agree with one all-reduce of a flag after the section, whether or not they raised: a
    rank that caught the error reaches the same collective as the others (the crashes seen here happen
    before any collective of the section, identically on every rank).
    """
    result, error = None, None
    try:
        result = section()
    except Exception as exc:  # noqa: BLE001 - stock AutoTP's failure is a finding, not the launch's
        error = crash_line(exc)
        del exc
    flag = torch.tensor([1.0 if error else 0.0], device=run.device)
    calls, logged = run.counter.calls, len(run.counter.log)
    torch.distributed.all_reduce(flag)
    run.counter.calls = calls  # the agreement is not the model's reduction
    del run.counter.log[logged:]
    if flag.item() == 0:
        return result, None
    result = None
    gc.collect()
    error = error or "crashed on another rank"
    run.say(f"{what}: crashed ({error}); recorded, continuing")
    return None, error


# --------------------------------------------------------------------------------------------- reference


class Reference:
    """The single-process unpatched model's outputs and parameter figures (the model itself is freed).

    With `decode_steps`, also its greedy decode with the KV cache: the tokens the ab phase forces and
    each step's logits.
    """

    def __init__(self, run: Run, directory: str, ids: torch.Tensor, generate: int, decode_steps: int) -> None:
        t0 = time.perf_counter()
        model = load(directory, has_remote_code(directory), torch.float32).to(run.device)
        t1 = time.perf_counter()
        self.prefill_s, self.decode_s, self.forced, self.step_logits = [], [], [], []
        with torch.no_grad():
            run.sync()
            t = time.perf_counter()
            out = model(ids, use_cache=bool(decode_steps))
            run.sync()
            self.prefill_s.append(time.perf_counter() - t)
            self.logits = out.logits.float().cpu()
            t2 = time.perf_counter()
            self.tokens = _greedy(model, ids[:1], generate) if generate else None
            if decode_steps:
                cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
                for _ in range(decode_steps):
                    self.forced.append(token)
                    run.sync()
                    t = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    run.sync()
                    self.decode_s.append(time.perf_counter() - t)
                    self.step_logits.append(out.logits.float().cpu())
                    cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
        self.timings = {"reference_load_s": t1 - t0, "reference_forward_s": t2 - t1,
                        "reference_generate_s": time.perf_counter() - t2}
        self.bytes = param_bytes(model)
        self.gates = gate_weights(model)
        self.gate_types = gate_types(model)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        del model, out
        gc.collect()
        _release_heap()
        self.baseline = (single_process_error(run, directory, ids, self)
                         if decode_steps and run.dtype != torch.float32 else None)

    def tensors(self) -> list:
        """Every tensor this reference keeps (the gates' copies, logits, tokens): not a copy a model kept."""
        kept = (self.logits, self.tokens, *self.gates.values(), *self.forced, *self.step_logits)
        return [t for t in kept if isinstance(t, torch.Tensor)]


def single_process_error(run: Run, directory: str, ids: torch.Tensor, ref: Reference) -> dict:
    """The error of the unsharded model itself at the run's dtype, vs. its float32 self (same forced tokens).

    What a tensor-parallel run at that dtype is judged against: its rounding differs from this one's
    (partial sums rounded per rank) but should be of the same size.
    """
    model = load(directory, has_remote_code(directory), run.dtype).to(run.device)
    agree = total = 0
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = out.logits.float().cpu()
        figures = {"prefill_maxdiff": (logits - ref.logits).abs().max().item(),
                   "prefill_relative": _relative(logits, ref.logits), "decode_maxdiff": 0.0, "decode_relative": 0.0}
        cache = cache_of(out)
        for token, expected in zip(ref.forced, ref.step_logits):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, logits = cache_of(out), out.logits.float().cpu()
            figures["decode_maxdiff"] = max(figures["decode_maxdiff"], (logits - expected).abs().max().item())
            figures["decode_relative"] = max(figures["decode_relative"], _relative(logits, expected))
            same, n = _agree(logits, expected)
            agree, total = agree + same, total + n
    del model, out, cache
    gc.collect()
    return {**figures, "dtype": run.dtype_name, "tokens_agree": agree, "tokens_total": total}


def _greedy(model, ids, n: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).cpu()


# ---------------------------------------------------------------------------------- one-forward phases


def measure(phase: str, model, run: Run, opts: dict, ids, ref: Reference) -> dict:
    counter, dist = run.counter, run.dist
    layers = decoder_layers(model)
    blocks = moe_blocks(model)
    block_ids = {id(b) for b in blocks}
    groups = {
        "attention": [layer.self_attn for layer in layers],
        "moe": blocks,
        "dense_mlp": [layer_mlp(layer) for layer in layers if id(layer_mlp(layer)) not in block_ids],
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
    result: dict = {"mode": phase, "rank": dist.get_rank(), "world_size": dist.get_world_size(), "tp_group_size": run.tp}
    with torch.no_grad():
        for _ in range(opts["warmup"]):
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
        for _ in range(opts["repeats"]):
            dist.barrier()
            t0 = time.perf_counter()
            model(ids)
            prefill_s.append(time.perf_counter() - t0)
    for h in hooks:
        h.remove()
    logits = out.logits.float().cpu()
    lm_head = model.get_output_embeddings()
    result.update({
        "num_layers": len(layers),
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
    result.update(sharding_figures(model, ref, scan=phase == "codegen"))
    t1 = time.perf_counter()
    if opts["generate"]:
        with torch.no_grad():
            result["same_tokens"] = bool(torch.equal(_greedy(model, ids[:1], opts["generate"]), ref.tokens))
    result["phase_timings"] = {"sharding_figures_s": t1 - t0, "generate_s": time.perf_counter() - t1}
    if opts["grad_check"] and phase == "codegen":
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
            for attr in sorted(FUSED - ROW_PARALLEL_BIASES):
                if isinstance(getattr(module, attr, None), torch.Tensor):
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
    alive_shapes: list[list[int]] = []
    if scan and full_shapes:
        gc.collect()
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        own |= {t.untyped_storage().data_ptr() for t in ref.tensors()}  # the harness's own reference copies
        for obj in gc.get_objects():
            try:
                if (isinstance(obj, torch.Tensor) and not obj.is_meta and tuple(obj.shape) in full_shapes
                        and obj.untyped_storage().data_ptr() not in own):
                    alive += 1
                    alive_shapes.append(list(obj.shape))
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
        "full_size_copies_shapes": alive_shapes,
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


# ------------------------------------------------------------------------------------------- the ab phase


#: the ab phase's setups, in load order: codegen first (its load briefly holds the whole checkpoint, freed
#: before the others load), then transformers' native TP (loads its shard), then stock AutoTP
SETUPS = LOAD_ORDER


def rotation(setups: list[str], k: int) -> list[str]:
    """The order of timed unit k: ABBA generalised (a rotation every two units, reversed on odd units).

    Two setups give a,b b,a b,a a,b ...; three give every setup every position equally often, so load
    from other processes and order effects (caches warmed by the previous setup) hit all of them alike.
    """
    r = (k // 2) % len(setups)
    seq = setups[r:] + setups[:r]
    return seq[::-1] if k % 2 else seq


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: the error measure that means the same in float32 and bfloat16."""
    scale = ref.abs().max().item()
    return (x - ref).abs().max().item() / scale if scale else float("inf")


def _agree(x: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(matching, total) greedy next tokens of the last position, over the batch."""
    same = x[:, -1].argmax(-1) == ref[:, -1].argmax(-1)
    return int(same.sum().item()), same.numel()


def measure_ab(run: Run, job: dict, opts: dict, ids, ref: Reference) -> dict:
    """The setups of opts["setups"] (stock AutoTP, codegen, native TP) loaded side by side, interleaved.

    Stock and native are comparisons: a crash while loading or on the first forward is recorded
    and the others run on. Decode steps are teacher-forced with the reference's greedy tokens.
    """
    counter, dist = run.counter, run.dist
    warmup, steps, repeats = opts["warmup"], opts["decode_steps"], opts["repeats"]
    wanted = [m for m in SETUPS if m in opts.get("setups", ("stock", "codegen"))]
    name = job["name"]
    run.say(f"{name}: loading {', '.join(LABELS[m] for m in wanted)} on {run.tp} ranks ({run.dtype_name})")

    models, record, crashes = {}, {}, {}
    for mode in wanted:
        t0 = time.perf_counter()
        if mode == "codegen":
            models[mode] = run.build(mode, job, opts)
        else:
            def loads_and_runs(mode=mode):
                model = run.build(mode, job, opts)
                with torch.no_grad():
                    model(ids[:1, :8])  # its first forward: a crash here leaves the others alone
                return model

            model, crash = guarded(run, f"{name}: {LABELS[mode]}", loads_and_runs)
            if crash is not None:
                crashes[mode] = crash
                continue
            models[mode] = model
        record[mode] = {"load_s": time.perf_counter() - t0}
        gc.collect()
    order_base = [m for m in ("stock", "codegen", "native") if m in models]
    block_counts, gather_counts, hooks = {}, {}, []
    for mode, model in models.items():
        blocks = moe_blocks(model)
        block_counts[mode], handles = per_block_counts(blocks, counter)
        gather_counts[mode], more = per_block_counts(blocks, counter, "gathers")
        hooks += handles + more
        figures = param_bytes(model)
        record[mode].update(bytes=figures, moe_blocks=len(blocks))
        full = ref.bytes["experts"] * torch.empty((), dtype=run.dtype).element_size() // 4  # ref: float32
        if run.tp > 1 and figures["experts"] and figures["experts"] >= full:
            record[mode]["note"] = "experts not sharded (every rank holds all routed experts)"

    def timed(mode, *a, **kw):
        dist.barrier()
        before, gathered = counter.calls, counter.gathers
        blocks_before, gathers_before = list(block_counts[mode]), list(gather_counts[mode])
        run.sync()
        t0 = time.perf_counter()
        output = models[mode](*a, **kw)
        run.sync()
        elapsed = time.perf_counter() - t0
        per_block = [x - y for x, y in zip(block_counts[mode], blocks_before)]
        per_block_gathers = [x - y for x, y in zip(gather_counts[mode], gathers_before)]
        return output, elapsed, (counter.calls - before, counter.gathers - gathered), (per_block, per_block_gathers)

    run.say(f"{name}: prefill {ids.shape[0]}x{ids.shape[1]} tokens x {warmup} warm-up + {repeats} timed, "
            "setups alternating")
    with torch.no_grad():
        for k in range(warmup):
            for mode in rotation(order_base, k):
                timed(mode, ids)
        for mode in models:
            output, _, (calls, gathers), (per_block, per_block_gathers) = timed(mode, ids)
            logits = output.logits.float().cpu()
            record[mode].update(prefill_allreduce=calls, prefill_allreduce_per_moe_block=per_block,
                                prefill_gathers=gathers, prefill_gathers_per_moe_block=per_block_gathers,
                                prefill_maxdiff=(logits - ref.logits).abs().max().item(),
                                prefill_relative=_relative(logits, ref.logits), prefill_s=[])
        for k in range(repeats):
            for mode in rotation(order_base, k):
                record[mode]["prefill_s"].append(timed(mode, ids)[1])

        run.say(f"{name}: decode {warmup} warm-up + {steps} timed steps of batch {ids.shape[0]}, "
                "setups alternating every step")
        caches = {}
        for mode in models:
            caches[mode] = cache_of(timed(mode, ids, use_cache=True)[0])
            record[mode].update(decode_s=[], decode_allreduce=[], decode_allreduce_per_moe_block=[],
                                decode_gathers=[], decode_gathers_per_moe_block=[], decode_maxdiff=0.0,
                                decode_relative=0.0, tokens_agree=0, tokens_total=0)
        for k in range(warmup + steps):
            for mode in rotation(order_base, k):
                output, elapsed, (calls, gathers), (per_block, per_block_gathers) = timed(
                    mode, ref.forced[k], past_key_values=caches[mode], use_cache=True)
                caches[mode] = cache_of(output)
                r = record[mode]
                logits = output.logits.float().cpu()
                r["decode_maxdiff"] = max(r["decode_maxdiff"], (logits - ref.step_logits[k]).abs().max().item())
                r["decode_relative"] = max(r["decode_relative"], _relative(logits, ref.step_logits[k]))
                same, total = _agree(logits, ref.step_logits[k])
                r["tokens_agree"] += same
                r["tokens_total"] += total
                if k >= warmup:
                    r["decode_s"].append(elapsed)
                    r["decode_allreduce"].append(calls)
                    r["decode_allreduce_per_moe_block"].append(per_block)
                    r["decode_gathers"].append(gathers)
                    r["decode_gathers_per_moe_block"].append(per_block_gathers)
    for h in hooks:
        h.remove()
    models.clear()
    caches.clear()
    gc.collect()
    for mode, crash in crashes.items():
        record[mode] = {"mode": mode, "crashed": crash}
    return {**record, "full_bytes": ref.bytes, "batch": int(ids.shape[0]), "prompt_len": int(ids.shape[1]),
            "dtype": run.dtype_name, "rss_peak_bytes": _rss_peak(),
            "reference": {"prefill_s": ref.prefill_s, "decode_s": ref.decode_s[warmup:],
                          "baseline": ref.baseline}}


def _rss_peak() -> int | None:
    """This rank's peak resident memory so far (bytes): reference, loads and every setup included."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


# --------------------------------------------------------------------------------------------------- main


def model_config(directory: str) -> dict:
    return json.loads(Path(directory, "config.json").read_text())


def run_job(run: Run, job: dict, defaults: dict, timings: dict) -> dict:
    opts = {**DEFAULTS, **defaults, **job.get("options", {})}
    name = job["name"]
    vocab = model_config(job["reference"])["vocab_size"]
    ids = torch.randint(0, vocab, (opts["batch"], opts["prompt_len"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(run.device)
    phases = job["phases"]
    decode = opts["warmup"] + opts["decode_steps"] if "ab" in phases else 0
    run.say(f"{name}: single-process reference (prefill {opts['batch']}x{opts['prompt_len']} tokens"
            + (f" + {decode} greedy decode steps)" if decode else ")"))
    t = time.perf_counter()
    ref = Reference(run, job["reference"], ids, opts["generate"] if set(phases) - {"ab"} else 0, decode)
    timings[f"{name}/reference_s"] = time.perf_counter() - t
    out = {}
    for phase in phases:
        t = time.perf_counter()
        if phase == "ab":
            out[phase] = {"num_layers": model_config(job["reference"])["num_hidden_layers"],
                          **measure_ab(run, job, opts, ids, ref)}
        else:
            run.say(f"{name}: {phase}")
            if phase == "stock":  # a comparison: a crash is recorded, the launch goes on
                figures, crashed = guarded(run, f"{name}: stock",
                                           lambda: measure_built(phase, job, run, opts, ids, ref, timings))
                out[phase] = figures if crashed is None else {
                    "mode": phase, "rank": run.rank, "world_size": run.dist.get_world_size(), "crashed": crashed}
            else:
                out[phase] = measure_built(phase, job, run, opts, ids, ref, timings)
        gc.collect()
        _release_heap()
        timings[f"{name}/{phase}_s"] = time.perf_counter() - t
    return out


def _remove_own_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed shm buffer: os._exit skips the policy's atexit removal, and the stock
    and native phases load no policy at all; every rank has passed the last collective."""
    from codegen.policy_runtime import PolicyError, own_shm_buffer

    try:
        path = own_shm_buffer(rank)
        if path:
            os.unlink(path)
    except (OSError, PolicyError):
        pass


def _release_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise): the next job's models need them."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_built(phase: str, job: dict, run: Run, opts: dict, ids, ref: Reference, timings: dict) -> dict:
    t = time.perf_counter()
    model = run.build(phase, job, opts)
    timings[f"{job['name']}/{phase}_load_s"] = time.perf_counter() - t
    return measure(phase, model, run, opts, ids, ref)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m codegen.tp_worker")
    ap.add_argument("--spec", required=True, help="the launch's spec (JSON; codegen.runtime.launch writes it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    try:
        _main(json.loads(Path(args.spec).read_text()), Path(args.out))
    except BaseException as exc:  # one line for the launcher, then fail the rank
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        Path(args.out, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {message}\n")
        raise


def _main(spec: dict, out: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist

    from codegen.runtime import preload_shm_op, save_shm_op

    bad = [p for job in spec["jobs"] for p in job["phases"] if p not in PHASES]
    if bad:
        raise ValueError(f"unknown phase(s) {bad}: expected {PHASES}")
    timings = {"import_torch_s": _T_TORCH - _T0}
    device_kind = spec.get("device", "cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    t = time.perf_counter()
    preloaded = device_kind == "cpu" and preload_shm_op()
    deepspeed.init_distributed(dist_backend="gloo" if device_kind == "cpu" else "nccl")
    timings["import_deepspeed_init_s"] = time.perf_counter() - t
    if device_kind == "cpu" and not preloaded and dist.get_rank() == 0:
        save_shm_op()
    counter = AllReduceCounter()
    counter.install()
    run = Run(spec, dist, counter)
    record = {"rank": run.rank, "world_size": dist.get_world_size(), "timings": timings, "jobs": {}}
    if device_kind == "cuda":
        record["gpu"] = torch.cuda.get_device_name(run.device)
    for job in spec["jobs"]:
        record["jobs"][job["name"]] = run_job(run, job, spec.get("options", {}), timings)
        run.say(f"{job['name']}: done ({time.perf_counter() - _T0:.0f}s on the ranks so far)")
    timings["total_s"] = time.perf_counter() - _T0
    out.mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{run.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    _remove_own_shm_buffer(run.rank)
    # Python's teardown of torch / DeepSpeed takes seconds and does nothing for a finished rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
