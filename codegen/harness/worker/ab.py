"""The bench's phase: the job's setups loaded side by side on the same ranks, every timed unit run by each in turn.

Setups: (a) stock DeepSpeed AutoTP on the unpatched dir, (b) the patched dir under its policy, (d) transformers'
native TP (`tp_plan="auto"`), (e) the unpatched model in one process (a launch of one rank), as `options.setups`
asks. Every prefill is run by each setup in a rotating order (ABBA generalised), each after a barrier. Decode
runs each setup's steps consecutively, one setup after the other: a decode step reads every weight it needs, and
a step that follows another setup's would find the caches holding that setup's weights, which no serving rank
(nor the vLLM peer, timed alone) ever does. Decode steps are fed the reference's greedy tokens (teacher forcing), so
every setup decodes the same sequence. Per unit: time, logits vs the float32 reference (absolute and relative) and
greedy agreement. Collectives are counted in passes of their
own (counting at the dispatcher costs Python time on every op, which a timed unit must not pay): the
prefill, and the first COUNTED_DECODE_STEPS decode steps from a fresh cache, per setup and per MoE block.
Last, end to end: `generate()` from the prompt to `e2e_tokens` greedy tokens (time to first token and total), the
figure that means the same for every setup and for other engines.
Stock and native are comparisons: a crash while loading or on the first forward is recorded and the others
run on.
"""

from __future__ import annotations

import gc
import resource
import time

import torch

from codegen.harness.limits import forward_work
from codegen.harness.memory import LOAD_ORDER
from codegen.harness.worker.counting import per_block_counts
from codegen.harness.worker.limits import RoutingRecorder, inventory
from codegen.harness.worker.model_figures import (block_groups, cache_of, decoder_layers, moe_blocks,
                                                  nested_in_blocks, param_bytes)
from codegen.harness.worker.reference import Reference, agree, relative, release_heap
from codegen.harness.worker.run import LABELS, CompiledView, Run, dry_run, guarded

#: the ab phase's setups, in load order: codegen first (its load briefly holds the whole checkpoint, freed
#: before the others load), then transformers' native TP (loads its shard), then stock AutoTP
SETUPS = LOAD_ORDER
#: decode steps whose collectives are counted (from a fresh cache; the counts vary with routing for stock 4.x)
COUNTED_DECODE_STEPS = 8


def rotation(setups: list[str], k: int) -> list[str]:
    """The order of timed unit k: ABBA generalised (a rotation every two units, reversed on odd units).

    Two setups give a,b b,a b,a a,b ...; three give every setup every position equally often, so load
    from other processes and order effects (caches warmed by the previous setup) hit all of them alike.
    """
    r = (k // 2) % len(setups)
    seq = setups[r:] + setups[:r]
    return seq[::-1] if k % 2 else seq


def _load_setups(run: Run, job: dict, opts: dict, ids, wanted: list[str]) -> tuple[dict, dict, dict]:
    """(models, records, crashes): each setup built as its user builds it; stock and native guarded."""
    models, record, crashes = {}, {}, {}
    for mode in wanted:
        t0 = time.perf_counter()
        if mode == "codegen":
            models[mode] = run.build(mode, job, opts)
        elif mode == "compiled":
            if "codegen" not in models:
                continue
            models[mode] = CompiledView(models["codegen"], run.policies[job["name"]], run.rank)
        else:
            def loads_and_runs(mode=mode):
                model = run.build(mode, job, opts)
                dry_run(model, {"input_ids": ids[:1, :8]})  # a crash of any rank's shard leaves the others alone
                return model

            model, crash = guarded(run, f"{job['name']}: {LABELS[mode]}", loads_and_runs)
            if crash is not None:
                crashes[mode] = crash
                continue
            models[mode] = model
        record[mode] = {"load_s": time.perf_counter() - t0}
        # the loader's whole-checkpoint transient, freed: once the policy has kept freed blocks for reuse (glibc's
        # mallopt, the first codegen load of a rank), a later job's transient stays in the heap and the next setup
        # loads beside it (a full-width run was killed for memory at its second job, ranks ~5 GB over the plan)
        release_heap()
    return models, record, crashes


def measure_ab(run: Run, job: dict, opts: dict, ids, ref: Reference) -> dict:
    """The setups of opts["setups"] (stock AutoTP, codegen, native TP) loaded side by side, interleaved."""
    counter, dist = run.counter, run.dist
    warmup, steps, repeats = opts["warmup"], opts["decode_steps"], opts["repeats"]
    wanted = [m for m in SETUPS if m in opts.get("setups", ("stock", "codegen"))]
    name = job["name"]
    run.say(f"{name}: loading {', '.join(LABELS[m] for m in wanted)} on {run.tp} ranks ({run.dtype_name})")
    models, record, crashes = _load_setups(run, job, opts, ids, wanted)
    order_base = [m for m in ("stock", "codegen", "compiled", "native", "single") if m in models]
    # the decoder layers as loaded (a config's own key for them varies: dbrx's `n_layers`)
    num_layers = next((len(decoder_layers(m)) for k, m in models.items() if k != "compiled"), None)
    # hooks are on a model only while its own counted pass runs: (f) shares (b)'s modules, and torch.compile would
    # trace any hook present into (f)'s graphs and recompile whenever a count it reads changed
    blocks, inside, routing = {}, {}, {}
    for mode, model in models.items():
        if mode == "compiled":  # its routing and per-block counts are (b)'s, see `same_as_eager`
            model = model.model
            routing[mode], blocks[mode], inside[mode] = None, [], []
        else:
            groups = block_groups(model)
            routing[mode], blocks[mode], inside[mode] = RoutingRecorder(model), groups["moe"], nested_in_blocks(groups)
        record[mode]["inventory"] = inventory(model)
        figures = param_bytes(model)
        record[mode].update(bytes=figures, moe_blocks=len(blocks[mode] or moe_blocks(model)))
        full = ref.bytes["experts"] * torch.empty((), dtype=run.dtype).element_size() // 4  # ref: float32
        if run.tp > 1 and figures["experts"] and figures["experts"] >= full:
            record[mode]["note"] = "experts not sharded (every rank holds all routed experts)"

    def timed(mode, *a, **kw):
        dist.barrier()
        run.sync()
        t0 = time.perf_counter()
        output = models[mode](*a, **kw)
        run.sync()
        return output, time.perf_counter() - t0

    graphs_run = []  # per counted forward of (f): the graphs it ran (0: fallen back to eager)

    def counted(mode, *a, **kw):
        """One forward under the counter: (output, (all-reduces, other collectives), per MoE block of each); the
        experts its routing hit are kept in routing[mode] (taken by the caller)."""
        dist.barrier()
        counter.reset()
        if mode == "compiled":  # no hooks or routing of its own: see `same_as_eager`
            output, counts, graphs = models[mode].counted(counter, *a, **kw)
            graphs_run.append(graphs)
            return output, counts, ([], [])
        per_block, handles = per_block_counts(blocks[mode], counter, inside=inside[mode])
        per_block_gathers, more = per_block_counts(blocks[mode], counter, "gathers", inside[mode])
        try:
            with routing[mode], counter:
                output = models[mode](*a, **kw)
        finally:
            for handle in handles + more:
                handle.remove()
        return output, (counter.calls, counter.gathers), (per_block, per_block_gathers)

    if "compiled" in models:  # before (f)'s first forward: what compiling costs, from an empty cache
        run.say(f"{name}: compiling (f): prefill, decode and generate, cold"
                + (", then warm from inductor's cache" if opts.get("compile_warm", True) else ""))
        record["compiled"]["compile"] = compile_costs(models["compiled"], ids, ref, run,
                                                      opts.get("compile_warm", True))
    run.say(f"{name}: prefill {ids.shape[0]}x{ids.shape[1]} tokens x {warmup} warm-up + {repeats} timed, "
            "setups alternating")
    with torch.no_grad():
        for k in range(warmup):
            for mode in rotation(order_base, k):
                timed(mode, ids)
        for mode in models:
            output, (calls, gathers), (per_block, per_block_gathers) = counted(mode, ids)
            if mode == "compiled":
                per_block, per_block_gathers = same_as_eager(record, "prefill", calls, gathers)
            hits = routing[mode].take() if routing[mode] else record["codegen"]["work"]["prefill_hits"]
            inv, tokens = record[mode]["inventory"], ids.numel()
            # the bench's prefill computes every position's logits; generate's (time to first token) the last one's
            record[mode]["work"] = {"routing_seen": hits is not None, "prefill_hits": hits,
                                    "prefill": forward_work(inv, hits, tokens, tokens),
                                    "ttft": forward_work(inv, hits, tokens, ids.shape[0]),
                                    "decode": [], "decode_hits": []}
            logits = output.logits.float().cpu()
            record[mode].update(prefill_allreduce=calls, prefill_allreduce_per_moe_block=per_block,
                                prefill_gathers=gathers, prefill_gathers_per_moe_block=per_block_gathers,
                                prefill_maxdiff=(logits - ref.logits).abs().max().item(),
                                prefill_relative=relative(logits, ref.logits), prefill_s=[])
        for k in range(repeats):
            for mode in rotation(order_base, k):
                record[mode]["prefill_s"].append(timed(mode, ids)[1])

        counted_steps = min(warmup + steps, COUNTED_DECODE_STEPS)
        run.say(f"{name}: decode, collectives counted over {counted_steps} steps of batch {ids.shape[0]}")
        for mode in models:
            cache = cache_of(models[mode](ids, use_cache=True))
            record[mode].update(decode_allreduce=[], decode_allreduce_per_moe_block=[], decode_gathers=[],
                                decode_gathers_per_moe_block=[])
            for k in range(counted_steps):
                output, (calls, gathers), (per_block, per_block_gathers) = counted(
                    mode, ref.forced[k], past_key_values=cache, use_cache=True)
                cache = cache_of(output)
                r = record[mode]
                if mode == "compiled":
                    per_block, per_block_gathers = same_as_eager(record, "decode", calls, gathers, k)
                hits = routing[mode].take() if routing[mode] else record["codegen"]["work"]["decode_hits"][k]
                r["work"]["decode"].append(forward_work(r["inventory"], hits, ids.shape[0], ids.shape[0]))
                r["work"]["decode_hits"].append(hits)
                r["work"]["routing_seen"] &= hits is not None
                r["decode_allreduce"].append(calls)
                r["decode_allreduce_per_moe_block"].append(per_block)
                r["decode_gathers"].append(gathers)
                r["decode_gathers_per_moe_block"].append(per_block_gathers)
            del cache

        run.say(f"{name}: decode {warmup} warm-up + {steps} timed steps of batch {ids.shape[0]}, "
                "each setup's steps in a run of their own")
        for mode in order_base:  # consecutive steps, as a serving rank (or a peer engine) runs them
            cache = cache_of(timed(mode, ids, use_cache=True)[0])
            r = record[mode]
            r.update(decode_s=[], decode_maxdiff=0.0, decode_relative=0.0, tokens_agree=0, tokens_total=0)
            for k in range(warmup + steps):
                output, elapsed = timed(mode, ref.forced[k], past_key_values=cache, use_cache=True)
                cache = cache_of(output)
                logits = output.logits.float().cpu()
                r["decode_maxdiff"] = max(r["decode_maxdiff"], (logits - ref.step_logits[k]).abs().max().item())
                r["decode_relative"] = max(r["decode_relative"], relative(logits, ref.step_logits[k]))
                same, total = agree(logits, ref.step_logits[k])
                r["tokens_agree"] += same
                r["tokens_total"] += total
                if k >= warmup:
                    r["decode_s"].append(elapsed)
            del cache
        new_tokens = opts.get("e2e_tokens", 0)
        if new_tokens:
            run.say(f"{name}: end-to-end greedy generation, {new_tokens} new tokens x {opts['e2e_repeats']}, "
                    "setups alternating, each timed run right after an untimed one of its own")
            for mode in models:
                record[mode].update(e2e_s=[], ttft_s=[])
            for k in range(opts["e2e_repeats"]):
                for mode in rotation(order_base, k):
                    dist.barrier()
                    # untimed: the setup's weights and code warm, as each of the vLLM peer's timed runs follows one
                    # of its own (right after another setup's run, a toy prefill took 10-20% longer)
                    generation_times(models[mode], ids, new_tokens, run)
                    ttft, total = generation_times(models[mode], ids, new_tokens, run)
                    record[mode]["e2e_s"].append(total)
                    record[mode]["ttft_s"].append(ttft)
            for mode in models:
                record[mode]["e2e_tokens"] = new_tokens
    if "compiled" in models:  # graphs captured while timed: none where a rank never recompiles per call
        record["compiled"]["graphs_after_run"] = len(models["compiled"].compiled.graphs)
        record["compiled"]["graphs_per_forward"] = [g for g in graphs_run if g]
    models.clear()
    gc.collect()
    for mode, crash in crashes.items():
        record[mode] = {"mode": mode, "crashed": crash}
    return {**record, "num_layers": num_layers, "full_bytes": ref.bytes, "batch": int(ids.shape[0]),
            "prompt_len": int(ids.shape[1]), "dtype": run.dtype_name, "rss_peak_bytes": rss_peak(),
            "limits": run.limits,
            "reference": {"prefill_s": ref.prefill_s, "decode_s": ref.decode_s[warmup:],
                          "baseline": ref.baseline}}


def same_as_eager(record: dict, phase: str, calls: int, gathers: int, step: int | None = None) -> tuple[list, list]:
    """(f)'s per-MoE-block counts: hooks cannot count inside its graphs, but where its forward's collectives (those
    its graphs issued as they ran, `CompiledForward.ran`) are (b)'s forward's (counted at the dispatcher), step by
    step, its blocks' are (b)'s.
    Otherwise -1 per block: a count that fails the bench's check of one all-reduce per MoE layer."""
    eager = record["codegen"]
    per_block = eager[f"{phase}_allreduce_per_moe_block"]
    per_block_gathers = eager[f"{phase}_gathers_per_moe_block"]
    expected = (eager[f"{phase}_allreduce"], eager[f"{phase}_gathers"])
    if step is not None:
        per_block, per_block_gathers, expected = per_block[step], per_block_gathers[step], tuple(e[step] for e in expected)
    if (calls, gathers) != expected:
        return [-1] * len(per_block), [-1] * len(per_block_gathers)
    return list(per_block), list(per_block_gathers)


def compile_costs(view: CompiledView, ids, ref: Reference, run: Run, warm_too: bool = True) -> dict:
    """(f)'s compile cost: the first prefill, two decode steps and a short `generate` (every shape kind the bench
    runs), cold (an empty inductor cache: the launch's own TORCHINDUCTOR_CACHE_DIR) and then warm (torch.compile's
    in-memory state dropped, `torch._dynamo.reset()`, so the same graphs are captured again and inductor's compiled
    code comes from its on-disk cache, as in a new process; not in the smoke run). Seconds, per rank."""
    def capture() -> float:
        run.dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            view(ids)  # the bench's prefill
            cache = cache_of(view(ids, use_cache=True))
            for k in range(2):
                cache = cache_of(view(ref.forced[k], past_key_values=cache, use_cache=True))
            del cache
        generation_times(view, ids, 4, run)  # 3 decode steps: a cache length that changes becomes dynamic here
        return time.perf_counter() - t0

    torch._dynamo.reset()  # the previous job's graphs: this one's are its own
    cold = capture()
    graphs = len(view.compiled.graphs)
    warm = None
    if warm_too:
        torch._dynamo.reset()
        warm = capture()
    return {"cold_s": cold, "warm_s": warm, "graphs": graphs, "graphs_after_compile": len(view.compiled.graphs),
            "graph_collectives": view.compiled.graphs[:graphs],
            "fallback": view.compiled.fallback}


class _FirstToken:
    """A logits processor that only notes when it is first called: the prompt's forward is done, the first new
    token is being chosen (time to first token; any batch size, unlike a streamer)."""

    def __init__(self, run: Run) -> None:
        self.run, self.at = run, None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.run.sync()
            self.at = time.perf_counter()
        return scores


def generation_times(model, ids, new_tokens: int, run: Run) -> tuple[float, float]:
    """(time to first token, total) of `generate`: prompt in, `new_tokens` greedy tokens out, EOS ignored."""
    from transformers import LogitsProcessorList

    first = _FirstToken(run)
    run.sync()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, logits_processor=LogitsProcessorList([first]), pad_token_id=0)
    run.sync()
    total = time.perf_counter() - t0
    return (first.at - t0 if first.at is not None else total), total


def rss_peak() -> int | None:
    """This rank's peak resident memory so far (bytes): reference, loads and every setup included."""
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except OSError:
        return None
