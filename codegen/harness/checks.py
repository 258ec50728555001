"""The one definition of pass/fail for verify, bench and demo: what the patched dir must do on real ranks.

Every runtime check of codegen reads its figures from codegen.harness.worker.main and judges them here, with one
tolerance: the patched dir under its policy reduces exactly once per MoE layer (and once per other
row-parallel block), holds 1/tp of the routed experts per rank, keeps the routers whole, and (fp32)
its logits are within TOLERANCE of the unpatched model run in one process; without a policy it is
that model, bit for bit, and reduces nothing. Stock AutoTP's figures are a comparison, never judged
here: where stock crashed (codegen.harness.results.crashed) nothing changes for the patched dir.
"""

from __future__ import annotations

#: max |logits - single-process reference| for the patched dir under its policy (fp32 on CPU)
TOLERANCE = 1e-5
#: a bfloat16 (or float16) TP run's relative logits error may be this many times the unsharded model's own
LOW_PRECISION_FACTOR = 4.0
#: greedy tokens compared with the single-process model (verify)
GENERATE = 16


def once_per_layer(counts: list[int]) -> bool:
    """The contract: exactly one all-reduce in every MoE layer (and at least one MoE layer)."""
    return bool(counts) and all(c == 1 for c in counts)


def within_tolerance(diff: float, tolerance: float | None = TOLERANCE) -> bool:
    return tolerance is None or diff <= tolerance


def lm_head_reductions(r: dict) -> int:
    """What the LM head needs: one all-reduce when DeepSpeed made it row-parallel, none when replicated."""
    return 1 if "Allreduce" in (r.get("lm_head_type") or "") else 0


def attention_reductions(r: dict) -> list[int]:
    """What each attention block needs: one, none where its mixer is kept whole on every rank."""
    return r.get("attention_block_reductions", [1] * r["attention_blocks"])


def expected_allreduces(r: dict) -> int:
    """One per attention block (none per one kept whole), one per MoE block, one per dense MLP block, plus what
    the LM head needs."""
    return sum(attention_reductions(r)) + r["moe_blocks"] + r["dense_mlp_blocks"] + lm_head_reductions(r)


def breakdown(r: dict) -> str:
    return (f"attention {r['allreduce_per_attention_block']}, MoE {r['allreduce_per_moe_block']}, "
            f"dense MLP {r['allreduce_per_dense_mlp_block']}, LM head {r['allreduce_lm_head']}")


# ------------------------------------------------------------------------ one-forward phases (verify)


def phase_problems(phases: dict, tolerance: float | None = TOLERANCE) -> list[str]:
    """Problems of one model dir's no-policy / codegen / compiled phases ({phase: [rank figures]})."""
    found = []
    codegen = phases.get("codegen", [])
    for r in codegen:
        found += [f"rank {r['rank']}: {p}" for p in _codegen_problems(r, tolerance)]
    # DeepSpeed cuts its layers in tp_grain_size steps (64 by default), so a small layer may sit whole on
    # one rank of the group and be empty on the others; what must hold is that each TP group holds every
    # sharded weight exactly once (no rank keeps a full or replicated copy of one).
    tp = codegen[0]["tp_group_size"] if codegen else 1
    for start in range(0, len(codegen), tp):
        group = codegen[start:start + tp]
        held, full = sum(r["sharded_bytes"] for r in group), group[0]["sharded_full_bytes"]
        if held != full:
            found.append(f"ranks {start}-{start + tp - 1}: sharded layers hold {held:,} bytes over the TP group, "
                         f"expected exactly the unsharded {full:,}")
    eager = {r["rank"]: r["allreduce_per_forward"] for r in codegen}
    for r in phases.get("compiled", []):
        found += [f"rank {r['rank']}: compiled: {p}" for p in _compiled_problems(r, eager.get(r["rank"]), tolerance)]
    for r in phases.get("no-policy", []):
        if r["maxdiff"] != 0.0:
            found.append(f"rank {r['rank']}: without a TP policy the patched model differs from the unpatched one "
                         f"by {r['maxdiff']:.2e} (must be identical)")
        if r["allreduce_per_forward"]:
            found.append(f"rank {r['rank']}: without a TP policy the patched model issued "
                         f"{r['allreduce_per_forward']} all-reduce(s) (must issue none)")
        image = r.get("image")
        if image is not None and (image["maxdiff"] != 0.0 or image["allreduce_per_forward"]):
            found.append(f"rank {r['rank']}: without a TP policy, with an image in the prompt, the patched model "
                         f"differs by {image['maxdiff']:.2e} and issued {image['allreduce_per_forward']} all-reduce(s) "
                         "(must be identical, none)")
        if not r.get("same_tokens", True):
            found.append(f"rank {r['rank']}: without a TP policy greedy tokens differ from the unpatched model")
        if r.get("decode_maxdiff", 0.0) != 0.0:
            found.append(f"rank {r['rank']}: without a TP policy decode steps with the cache differ from the "
                         f"unpatched model by {r['decode_maxdiff']:.2e} (must be identical)")
    return found


def _compiled_problems(r: dict, eager: int | None, tolerance: float | None) -> list[str]:
    """The compiled phase against the codegen phase on the same rank: the same collectives per forward (each one
    inside its graphs), logits and decode steps within the tolerance, the same greedy tokens."""
    found = []
    if not within_tolerance(r["maxdiff"], tolerance):
        found.append(f"logits differ by {r['maxdiff']:.2e} > {tolerance:g}")
    if "decode_maxdiff" in r and not within_tolerance(r["decode_maxdiff"], tolerance):
        found.append(f"logits of {r['decode_checked']} decode steps with the cache differ by "
                     f"{r['decode_maxdiff']:.2e} > {tolerance:g}")
    if not r.get("same_tokens", True):
        found.append("greedy tokens differ from the single-process model")
    if r["allreduce_per_forward"] != eager or r["other_collectives_per_forward"]:
        where = "as it ran eager" if r["fallback"] else "in its graphs"
        found.append(f"{r['allreduce_per_forward']} all-reduces and {r['other_collectives_per_forward']} other "
                     f"collectives per forward {where}, expected the eager codegen phase's {eager} and none")
    return found


def _codegen_problems(r: dict, tolerance: float | None) -> list[str]:
    found = []
    tp = r["tp_group_size"]
    if not within_tolerance(r["maxdiff"], tolerance):
        found.append(f"logits differ by {r['maxdiff']:.2e} > {tolerance:g}")
    if not r.get("same_tokens", True):
        found.append("greedy tokens differ from the single-process model")
    if "decode_maxdiff" in r and not within_tolerance(r["decode_maxdiff"], tolerance):
        found.append(f"logits of {r['decode_checked']} decode steps with the cache differ by "
                     f"{r['decode_maxdiff']:.2e} > {tolerance:g}")
    expected = expected_allreduces(r)
    if r["allreduce_per_forward"] != expected:
        found.append(f"{r['allreduce_per_forward']} all-reduces per forward, expected {expected} ({breakdown(r)})")
    if not r["moe_blocks"]:
        found.append("no MoE layers found")
    for key, label in (("moe", "MoE"), ("dense_mlp", "dense MLP")):
        counts = r[f"allreduce_per_{key}_block"]
        if any(c != 1 for c in counts):
            found.append(f"all-reduces per {label} block {counts}, expected 1 each")
    if r["allreduce_per_attention_block"] != attention_reductions(r):
        found.append(f"all-reduces per attention block {r['allreduce_per_attention_block']}, expected "
                     f"{attention_reductions(r)} (1 each, 0 where kept whole)")
    if r["allreduce_lm_head"] != lm_head_reductions(r):
        found.append(f"LM head ({r['lm_head_type']}) issued {r['allreduce_lm_head']} all-reduces, "
                     f"expected {lm_head_reductions(r)}")
    if r["bytes"]["experts"] * tp != r["full_bytes"]["experts"]:
        found.append(f"routed experts hold {r['bytes']['experts']:,} of their {r['full_bytes']['experts']:,} "
                     f"unsharded bytes on this rank, expected 1/{tp}")
    if r["sharded_unregistered"]:
        found.append(f"sharded weights not registered Parameters of the model: {r['sharded_unregistered'][:3]}")
    if r["oversized_storage_params"]:
        found.append(f"parameters pin a larger storage (a view of the full tensor): {r['oversized_storage_params'][:3]}")
    if r["full_size_copies_alive"]:
        found.append(f"{r['full_size_copies_alive']} full-size copies of sharded weights still alive "
                     f"(shapes {r.get('full_size_copies_shapes', [])[:3]})")
    if not r["gates_intact"]:
        found.append("router/gate weights changed")
    if r["gate_types"] != r["gate_types_reference"]:
        found.append(f"router/gate modules changed type: {r['gate_types']}")
    image = r.get("image")
    if image is not None:  # the vision tower runs whole on every rank: it adds no reduction
        if not within_tolerance(image["maxdiff"], tolerance):
            found.append(f"with an image in the prompt, logits differ by {image['maxdiff']:.2e} > {tolerance:g}")
        if image["allreduce_per_forward"] != expected or any(c != 1 for c in image["allreduce_per_moe_block"]):
            found.append(f"with an image in the prompt, {image['allreduce_per_forward']} all-reduces per forward "
                         f"(expected {expected}), per MoE block {image['allreduce_per_moe_block']} (expected 1 each)")
    grad = r.get("grad_check")
    if grad is not None:
        if not grad.get("applicable"):
            found.append("no coalesced reduction attached to the MoE blocks (is the config knob off?)")
        elif not (grad["forward_is_sum"] and grad["no_grad_is_sum"]):
            found.append("the inserted reduction is not a sum over the TP group")
        elif not grad["grad_identity"]:
            found.append("the inserted reduction's backward does not pass the gradient through unchanged")
    return found


# --------------------------------------------------------------------- the ab phase (bench and demo)


def ab_problems(family: str, e: dict, tolerance: float | None = TOLERANCE) -> list[str]:
    """Problems of one family's summarised ab entry (codegen.harness.results.summarise_ab): (b) is codegen, (f)
    codegen compiled, each held to the same counts and numerics."""
    found = [f"{family}: no MoE layers found"] if not e["moe_layers"] else []
    for mode in ("stock", "codegen", "compiled", "native"):
        if mode in e and e[mode].get("crashed") is None and not e[mode]["counts_same_on_all_ranks"]:
            found.append(f"{family}: {mode} all-reduce counts differ between ranks")
    found += _ab_setup_problems(f"{family}: codegen", e["codegen"], e, tolerance)
    if "compiled" in e:
        found += _ab_setup_problems(f"{family}: codegen compiled", e["compiled"], e, tolerance)
    return found


def _ab_setup_problems(who: str, b: dict, e: dict, tolerance: float | None) -> list[str]:
    found = []
    if not once_per_layer(b["allreduce_prefill_per_moe_layer"]):
        found.append(f"{who} all-reduces per MoE layer in prefill {b['allreduce_prefill_per_moe_layer']}, expected 1")
    lo = b.get("allreduce_decode_per_moe_layer_min", b["allreduce_decode_per_moe_layer_mean"])
    if e["moe_layers"] and not (lo == b["allreduce_decode_per_moe_layer_max"] == 1):
        found.append(f"{who} all-reduces per MoE layer in decode "
                     f"{_count(lo)}-{_count(b['allreduce_decode_per_moe_layer_max'])}, expected 1")
    worst = max(b["maxdiff_prefill"], b["maxdiff_decode"])
    if e.get("dtype", "float32") == "float32":
        # absolute, or relative to the logits where they are large: a 128-token float32 prefill through a chunked
        # linear-attention recurrence (toy Qwen3.5: |logits| up to ~8) rounds to 1.2-1.5e-5 in any tensor-parallel
        # order (transformers' native TP: 1.4e-5), i.e. 1.5e-6 relative; a sharding bug is of order 1e-1
        relative = max(b.get("relative_prefill", worst), b.get("relative_decode", worst))
        if not within_tolerance(worst, tolerance) and not within_tolerance(relative, tolerance):
            found.append(f"{who} logits differ from the single-process model by {worst:.2e} "
                         f"(relative {relative:.2e}) > {tolerance:g}")
        return found
    limit = low_precision_limit(e["reference"].get("single_process_error"))
    relative = max(b["relative_prefill"], b["relative_decode"])
    if limit is not None and relative > limit:
        found.append(f"{who} {e['dtype']} logits differ from the float32 single-process model by "
                     f"{relative:.2e} (relative) > {limit:.2e} ({LOW_PRECISION_FACTOR:g}x the single-process "
                     f"{e['dtype']} model's own error)")
    return found


def low_precision_limit(single_process: dict | None) -> float | None:
    """The relative error a TP run at a low precision may have: a multiple of the unsharded model's own.

    Rounding a sharded run's partial sums adds error of the same order as the unsharded model's
    rounding (one more rounding per reduced sum), so a factor, not an absolute bound, is what holds
    at every width and dtype; see docs/benchmark.md for the figures behind it.
    """
    if not single_process:
        return None
    return LOW_PRECISION_FACTOR * max(single_process["prefill_relative"], single_process["decode_relative"])


def _count(x: float) -> str:
    return f"{x:g}"
