"""One rank of a verify/bench/demo run (started by codegen.runtime under torchrun, never imported by users).

Loads a model dir, applies the patched dir's generated policy (`codegen`) or stock
`deepspeed.init_inference` on the unpatched dir (`stock`), then measures: all-reduce calls per
forward and per MoE block (every path counted once: deepspeed comm `all_reduce`,
`inference_all_reduce`, its shm op, and torch.distributed), logits against the single-process
unpatched model, greedy tokens, per-rank parameter bytes and latencies. Writes rank<k>.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch


class AllReduceCounter:
    """Counts collective calls at the outermost layer only, whichever entry point issued them."""

    def __init__(self) -> None:
        self.calls = 0
        self._depth = 0

    def wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_codegen_counted", False):
            return

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        counted._codegen_counted = True
        setattr(owner, name, counted)

    def install(self) -> None:
        import deepspeed.comm
        import deepspeed.comm.comm
        import torch.distributed

        for owner in (deepspeed.comm, deepspeed.comm.comm):
            self.wrap(owner, "all_reduce")
            self.wrap(owner, "inference_all_reduce")
        self.wrap(torch.distributed, "all_reduce")
        cdb = deepspeed.comm.comm.cdb
        if cdb is not None:
            self.wrap(cdb, "all_reduce")
            self.wrap(cdb, "inference_all_reduce")


def _dtype_kw() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def load(directory: str, remote: bool, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote, **{_dtype_kw(): dtype}).eval()


def has_remote_code(directory: str) -> bool:
    return bool(json.loads(Path(directory, "config.json").read_text()).get("auto_map"))


def param_bytes(model) -> dict:
    experts = gates = total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            experts += size
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            gates += size
    return {"experts": experts, "gates": gates, "rest": total - experts, "total": total}


def gate_weights(model) -> dict:
    return {
        n: p.detach().float().cpu()
        for n, p in model.named_parameters()
        if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))
    }


def moe_blocks(model) -> list:
    names = ("Qwen2MoeSparseMoeBlock", "DeepseekV2Moe", "DeepseekV2MoE")
    return [m for m in model.modules() if type(m).__name__ in names]


def per_block_counts(blocks, counter: AllReduceCounter) -> list[int]:
    counts = [0] * len(blocks)
    handles = []
    for i, block in enumerate(blocks):
        start = {}

        def pre(_m, _a, i=i, start=start):
            start["n"] = counter.calls

        def post(_m, _a, _o, i=i, start=start):
            counts[i] += counter.calls - start["n"]

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    return counts, handles


def _cache_of(output):
    for attr in ("past_key_values", "cache"):
        value = getattr(output, attr, None)
        if value is not None:
            return value
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="dir to run (patched for codegen, unpatched for stock)")
    ap.add_argument("--reference", required=True, help="unpatched dir for the single-process reference")
    ap.add_argument("--mode", choices=("codegen", "stock", "no-policy"), required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed prefills")
    ap.add_argument("--grad-check", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    vocab = json.loads(Path(args.reference, "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))

    reference = load(args.reference, has_remote_code(args.reference), torch.float32)
    with torch.no_grad():
        ref_logits = reference(ids).logits.float()
        ref_tokens = reference.generate(ids[:1], max_new_tokens=args.generate, do_sample=False, min_new_tokens=args.generate) if args.generate else None
    full = param_bytes(reference)
    full_gates = gate_weights(reference)
    del reference

    if args.mode == "codegen":
        model = load(args.model, True, dtype)
        spec = importlib.util.spec_from_file_location("codegen_autotp_policy", os.path.join(args.model, "autotp_policy.py"))
        policy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(policy)
        engine = policy.init_inference(model, tp_size=args.tp, dtype=dtype)
        model = engine.module
    elif args.mode == "stock":
        model = load(args.model, has_remote_code(args.model), dtype)
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": args.tp}, dtype=dtype,
                                          replace_with_kernel_inject=False)
        model = engine.module
    else:  # patched model, distributed initialised, no TP policy: must equal the unpatched model
        model = load(args.model, True, dtype)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device != "cpu" else torch.device("cpu")
    ids_dev = ids.to(device)

    counter = AllReduceCounter()
    counter.install()
    blocks = moe_blocks(model)
    block_counts, handles = per_block_counts(blocks, counter)
    with torch.no_grad():
        for _ in range(args.warmup):
            model(ids_dev)
        dist.barrier()
        counter.calls = 0
        block_counts[:] = [0] * len(blocks)
        out = model(ids_dev)
        per_forward = counter.calls
        per_block = list(block_counts)
        prefill_s = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            model(ids_dev)
            prefill_s.append(time.perf_counter() - t0)
    for h in handles:
        h.remove()
    logits = out.logits.float().cpu()
    result = {
        "rank": rank,
        "mode": args.mode,
        "num_layers": model.config.num_hidden_layers,
        "moe_blocks": len(blocks),
        "allreduce_per_forward": per_forward,
        "allreduce_per_moe_block": per_block,
        "maxdiff": (logits - ref_logits).abs().max().item(),
        "bytes": param_bytes(model),
        "full_bytes": full,
        "gates_intact": _gates_intact(model, full_gates),
        "prefill_s": prefill_s,
        "tp_group_size": args.tp,
        "world_size": dist.get_world_size(),
    }
    with torch.no_grad():
        if args.generate:
            tokens = model.generate(ids_dev[:1], max_new_tokens=args.generate, do_sample=False, min_new_tokens=args.generate)
            result["same_tokens"] = bool(torch.equal(tokens.cpu(), ref_tokens))
        if args.decode_steps:
            result.update(_decode(model, ids_dev, args.decode_steps, args.warmup, counter, dist))
    if args.grad_check:
        result["grad_check"] = _grad_check(model, blocks, dist)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _gates_intact(model, full_gates: dict) -> bool:
    now = gate_weights(model)
    return bool(full_gates) and now.keys() == full_gates.keys() and all(torch.equal(now[k], full_gates[k]) for k in now)


def _decode(model, ids, steps: int, warmup: int, counter: AllReduceCounter, dist) -> dict:
    out = model(ids, use_cache=True)
    cache = _cache_of(out)
    token = out.logits[:, -1:].argmax(-1)
    times, counts = [], []
    for step in range(warmup + steps):
        dist.barrier()
        before = counter.calls
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        elapsed = time.perf_counter() - t0
        cache = _cache_of(out)
        token = out.logits[:, -1:].argmax(-1)
        if step >= warmup:
            times.append(elapsed)
            counts.append(counter.calls - before)
    return {
        "decode_s": times,
        "decode_median_s": statistics.median(times),
        "allreduce_per_decode_step": max(counts) if counts else 0,
    }


def _grad_check(model, blocks, dist) -> dict:
    """Backward through the inserted reduction: the gradient reaching it passes through unchanged."""
    block = blocks[0]
    reducer = getattr(block, "_codegen_tp_reducer", None)
    if reducer is None:
        return {"applicable": False}
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    with torch.enable_grad():
        y = reducer(x * 1.0)
        upstream = torch.arange(15, dtype=torch.float32).reshape(3, 5)
        y.backward(upstream)
    gathered = x.detach().clone()
    dist.all_reduce(gathered, group=reducer.group)
    return {
        "applicable": True,
        "forward_is_sum": bool(torch.allclose(y.detach(), gathered)),
        "grad_identity": bool(torch.equal(x.grad, upstream)),
    }


if __name__ == "__main__":
    main()
