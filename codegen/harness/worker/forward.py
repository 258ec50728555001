"""The one-forward phases of verify (no-policy, codegen, stock): one model, one counted forward, its figures.

All-reduces are counted at the dispatcher (codegen.harness.worker.counting) and split per attention / MoE /
dense MLP block and LM head; then logits against the reference, greedy tokens, per-rank parameter bytes,
each step's logits over a teacher-forced decode with the cache (`decode_check`), whether sharded
weights are registered Parameters that pin no full-size storage, whether any full-size copy
of a sharded weight is still alive, router weights and types, and (grad_check) the inserted reduction's
autograd behaviour.
"""

from __future__ import annotations

import sys
import time

import torch

from codegen.harness.worker.counting import ALL_REDUCE_OPS, CollectiveCounter, per_block_counts, tally
from codegen.harness.worker.model_figures import (attention_reductions, block_groups, cache_of, decoder_layers,
                                                  gate_types, gates_intact, nested_in_blocks, output_embeddings,
                                                  param_bytes, sharding_figures)
from codegen.harness.worker.reference import Reference, greedy
from codegen.harness.worker.run import CompiledView, Run, dry_run, guarded
from codegen.policy.runtime.base import REDUCE_HELPER, REDUCER_ATTR


def measure_built(phase: str, job: dict, run: Run, opts: dict, ids, ref: Reference, timings: dict) -> dict:
    t = time.perf_counter()
    model = run.build(phase, job, opts)
    timings[f"{job['name']}/{phase}_load_s"] = time.perf_counter() - t
    return measure(phase, model, run, opts, ids, ref)


def built_and_dry_run(phase: str, job: dict, run: Run, opts: dict, ids, ref: Reference, timings: dict):
    """The phase's model, after one forward on this rank alone (`dry_run`): a shape error surfaces on the rank
    that has it."""
    t = time.perf_counter()
    model = run.build(phase, job, opts)
    timings[f"{job['name']}/{phase}_load_s"] = time.perf_counter() - t
    dry_run(model, {"input_ids": ids})
    return model


def measure(phase: str, model, run: Run, opts: dict, ids, ref: Reference) -> dict:
    counter, dist = run.counter, run.dist
    layers = decoder_layers(model)
    groups = block_groups(model)
    blocks = groups["moe"]
    nested = nested_in_blocks(groups)
    hooks, counts = [], {}
    for key, modules in groups.items():
        counts[key], handles = per_block_counts(modules, counter, inside=nested if key == "moe" else None)
        hooks += handles
    moe_entries: list[str] = []
    for block, inside in zip(blocks, nested):
        mark, skip = {}, []
        for inner in inside:
            span = {}
            hooks.append(inner.register_forward_pre_hook(lambda _m, _a, span=span: span.update(n=len(counter.log))))
            hooks.append(inner.register_forward_hook(
                lambda _m, _a, _o, span=span, skip=skip: skip.append(range(span["n"], len(counter.log)))))
        hooks.append(block.register_forward_pre_hook(
            # a pre-hook's non-None return replaces the block's arguments: return None
            lambda _m, _a, mark=mark, skip=skip: mark.update(n=len(counter.log)) or skip.clear()))
        hooks.append(block.register_forward_hook(
            lambda _m, _a, _o, mark=mark, skip=skip: moe_entries.extend(
                e for i, e in enumerate(counter.log[mark["n"]:], mark["n"]) if not any(i in r for r in skip))))
    result: dict = {"mode": phase, "rank": dist.get_rank(), "world_size": dist.get_world_size(), "tp_group_size": run.tp}
    with torch.no_grad():
        for _ in range(opts["warmup"]):
            model(ids)
        dist.barrier()
        counter.reset()
        with counter:
            out = model(ids)
        result["allreduce_entries"] = tally([e for e in counter.log if e in ALL_REDUCE_OPS])
        result["moe_allreduce_entries"] = tally([e for e in moe_entries if e in ALL_REDUCE_OPS])
        per_forward = counter.calls
        counts = {key: list(values) for key, values in counts.items()}
        prefill_s = []
        for _ in range(opts["repeats"]):
            dist.barrier()
            t0 = time.perf_counter()
            model(ids)
            prefill_s.append(time.perf_counter() - t0)
    for h in hooks:
        h.remove()
    logits = out.logits.float().cpu()
    lm_head = output_embeddings(model)
    result.update({
        "num_layers": len(layers),
        "attention_blocks": len(groups["attention"]),
        # what each needs: 1, or 0 for a mixer kept whole on every rank (`Family.whole_modules`)
        "attention_block_reductions": [attention_reductions(a) for a in groups["attention"]],
        "moe_blocks": len(blocks),
        "dense_mlp_blocks": len(groups["dense_mlp"]),
        "lm_head_type": type(lm_head).__name__ if lm_head is not None else None,
        "allreduce_per_forward": per_forward,
        "allreduce_per_attention_block": counts["attention"],
        "allreduce_per_moe_block": counts["moe"],
        "allreduce_per_dense_mlp_block": counts["dense_mlp"],
        "allreduce_lm_head": sum(counts["lm_head"]),
        "maxdiff": (logits - ref.logits).abs().max().item(),
        "bytes": param_bytes(model),
        "full_bytes": ref.bytes,
        "gates_intact": gates_intact(model, ref.gates),
        "gate_types": gate_types(model),
        "gate_types_reference": ref.gate_types,
        "prefill_s": prefill_s,
    })
    t0 = time.perf_counter()
    result.update(sharding_figures(model, ref, scan=phase == "codegen"))
    t1 = time.perf_counter()
    if opts["generate"]:
        with torch.no_grad():
            result["same_tokens"] = bool(torch.equal(greedy(model, ids[:1], opts["generate"]), ref.tokens))
    if opts["decode_check"] and phase != "stock":  # the stock comparison stays one forward
        result["decode_checked"], result["decode_maxdiff"] = decode_check(model, ids, ref, opts["decode_check"])
    # last: a wrapper may keep state from an image forward (4.x GLM-4V keeps its rope deltas for the next call)
    with torch.no_grad():
        if ref.image is not None:  # the same contract with image features in the prompt
            if phase == "stock":  # a comparison: its crash on an image is recorded beside its text figures
                _, crashed = guarded(run, "stock, with an image", lambda: dry_run(model, ref.image))
                figures = None
                if crashed is None:
                    figures, crashed = guarded(run, "stock, with an image",
                                               lambda: image_forward(model, groups, nested, run, ref))
                result["image"] = figures if crashed is None else {"crashed": crashed}
            else:
                result["image"] = image_forward(model, groups, nested, run, ref)
    result["phase_timings"] = {"sharding_figures_s": t1 - t0, "generate_s": time.perf_counter() - t1}
    if opts["grad_check"] and phase == "codegen":
        result["grad_check"] = grad_check(blocks, counter, dist)
    return result


def measure_compiled(job: dict, run: Run, opts: dict, ids, ref: Reference, timings: dict) -> dict:
    """`verify --compile`: the codegen phase's model with its forward compiled as `init_inference(..., compile=True)`
    compiles it. Its collectives are those its graphs issue as they run (`CompiledForward.ran`: a dispatcher mode
    would make it run eager), its logits, decode steps with the cache and greedy tokens against the reference.
    Where torch.compile cannot capture the forward whole, the rank runs eager: `fallback` says why, and the count
    is of that eager forward."""
    t = time.perf_counter()
    view = CompiledView(run.build("codegen", job, opts), run.policies[job["name"]], run.rank)
    timings[f"{job['name']}/compiled_load_s"] = time.perf_counter() - t
    dist, compiled = run.dist, view.compiled
    with torch.no_grad():
        t = time.perf_counter()
        view(ids)  # the first prefill captures and compiles its graph
        compile_s = time.perf_counter() - t
        dist.barrier()
        out, (reduces, others), graphs = view.counted(run.counter, ids)
    result = {"mode": "compiled", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
              "tp_group_size": run.tp, "fallback": compiled.fallback, "prefill_compile_s": compile_s,
              "allreduce_per_forward": reduces, "other_collectives_per_forward": others, "graphs_per_forward": graphs,
              "maxdiff": (out.logits.float().cpu() - ref.logits).abs().max().item()}
    if opts["decode_check"]:
        result["decode_checked"], result["decode_maxdiff"] = decode_check(view, ids, ref, opts["decode_check"])
    if opts["generate"]:
        with torch.no_grad():
            result["same_tokens"] = bool(torch.equal(greedy(view, ids[:1], opts["generate"]), ref.tokens))
    result["graphs"] = len(compiled.graphs)  # prefill, decode and generate's shape kinds
    return result


@torch.no_grad()
def decode_check(model, ids, ref: Reference, steps: int) -> tuple[int, float]:
    """(steps, worst max|dlogits|) of a prefill then `steps` decode steps with the model's own cache, fed the
    reference's greedy tokens: what the cache holds per rank (KV heads, linear-attention states) is checked."""
    out = model(ids, use_cache=True)
    cache, worst = cache_of(out), 0.0
    for token, expected in list(zip(ref.forced, ref.step_logits))[:steps]:
        out = model(token, past_key_values=cache, use_cache=True)
        worst = max(worst, (out.logits.float().cpu() - expected).abs().max().item())
        cache = cache_of(out)
    return min(steps, len(ref.forced)), worst


def image_forward(model, groups: dict, nested: list[list], run: Run, ref: Reference) -> dict:
    """One counted forward of the reference's image prompt: all-reduces in all and per MoE block, logits diff."""
    counter = run.counter
    hooks, counts = [], {}
    for key in ("attention", "moe", "dense_mlp"):
        counts[key], handles = per_block_counts(groups[key], counter, inside=nested if key == "moe" else None)
        hooks += handles
    counter.reset()
    try:
        with counter:
            logits = model(**ref.image).logits.float().cpu()
    finally:
        for h in hooks:
            h.remove()
    return {"allreduce_per_forward": counter.calls, "allreduce_per_moe_block": counts["moe"],
            "maxdiff": (logits - ref.image_logits).abs().max().item()}


def grad_check(blocks, counter: CollectiveCounter, dist) -> dict:
    """Backward through the inserted reduction, called as the patched forward calls it.

    Forward: the sum over the TP group (checked against a torch.distributed all-reduce on the same
    group), through the autograd-aware all-reduce, not the no-grad fast path. Backward: the gradient
    reaching it passes through unchanged (each rank's partial sum gets the full upstream gradient).
    """
    block = blocks[0]
    reducer = getattr(block, REDUCER_ATTR, None)
    if reducer is None:
        return {"applicable": False}
    inserted = getattr(sys.modules[type(block).__module__], REDUCE_HELPER)
    rank = dist.get_rank()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    upstream = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    counter.reset()
    with torch.enable_grad():
        with counter:
            y = inserted(block, x * 1.0)
        entries = tally(counter.log)
        y.backward(upstream)
    expected = x.detach().clone()
    torch.distributed.all_reduce(expected, group=reducer.group)
    counter.reset()
    with torch.no_grad(), counter:
        z = inserted(block, x.detach().clone())
    return {
        "applicable": True,
        "autograd_node": type(y.grad_fn).__name__ if y.grad_fn is not None else None,
        "grad_entries": entries,
        "no_grad_entries": tally(counter.log),
        "forward_is_sum": bool(torch.allclose(y.detach(), expected)),
        "no_grad_is_sum": bool(torch.allclose(z, expected)),
        "grad_identity": bool(torch.equal(x.grad, upstream)),
        "group_ranks": torch.distributed.get_process_group_ranks(reducer.group),
    }
