"""`python -m codegen verify <dir> --tp N`: what a user runs before deploying a patched dir.

One launch of N local CPU ranks (codegen.runtime) measures, against the unpatched dir run in one
process: the patched dir loaded with no TP policy (must be identical and reduce nothing), the
patched dir under its generated policy (the checks below), and stock DeepSpeed AutoTP on the
unpatched dir (for comparison only). Exit 0 when every check passes, 6 (VerifyFailed) otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from codegen import errors
from codegen.errors import VerifyFailed
from codegen.runtime import materialize_unpatched, run_phases

TOLERANCE = 1e-5
GENERATE = 16


def lm_head_reductions(r: dict) -> int:
    """What the LM head needs: one all-reduce when DeepSpeed made it row-parallel, none when replicated."""
    return 1 if "Allreduce" in (r.get("lm_head_type") or "") else 0


def expected_allreduces(r: dict) -> int:
    """One per attention block, one per MoE block, one per dense MLP block, plus what the LM head needs."""
    return r["attention_blocks"] + r["moe_blocks"] + r["dense_mlp_blocks"] + lm_head_reductions(r)


def verify(model_dir: Path, tp: int, world: int | None, timeout: float) -> dict:
    """{"no-policy": [...], "codegen": [...], "stock": [...]}: each phase's figures, one dict per rank."""
    world = world or tp
    extra = ["--generate", str(GENERATE), "--grad-check"]
    with tempfile.TemporaryDirectory(prefix="codegen-verify-") as tmp:
        pristine = materialize_unpatched(model_dir, Path(tmp) / "unpatched")
        if world == tp:
            return run_phases(model_dir, pristine, ["no-policy", "codegen", "stock"], tp, world, timeout, extra)
        # several TP groups: stock AutoTP is measured on one group only (on CPU it would reduce over all ranks)
        report = run_phases(model_dir, pristine, ["no-policy", "codegen"], tp, world, timeout, extra)
        report.update(run_phases(pristine, pristine, ["stock"], tp, tp, timeout, extra))
        return report


def problems(report: dict) -> list[str]:
    found = []
    for r in report["codegen"]:
        found += [f"rank {r['rank']}: {p}" for p in _codegen_problems(r)]
    # DeepSpeed cuts its layers in tp_grain_size steps (64 by default), so a small layer may sit whole on
    # one rank of the group and be empty on the others; what must hold is that each TP group holds every
    # sharded weight exactly once (no rank keeps a full or replicated copy of one).
    tp = report["codegen"][0]["tp_group_size"]
    for start in range(0, len(report["codegen"]), tp):
        group = report["codegen"][start:start + tp]
        held, full = sum(r["sharded_bytes"] for r in group), group[0]["sharded_full_bytes"]
        if held != full:
            found.append(f"ranks {start}-{start + tp - 1}: sharded layers hold {held:,} bytes over the TP group, "
                         f"expected exactly the unsharded {full:,}")
    for r in report.get("no-policy", []):
        if r["maxdiff"] != 0.0:
            found.append(f"rank {r['rank']}: without a TP policy the patched model differs from the unpatched one "
                         f"by {r['maxdiff']:.2e} (must be identical)")
        if r["allreduce_per_forward"]:
            found.append(f"rank {r['rank']}: without a TP policy the patched model issued "
                         f"{r['allreduce_per_forward']} all-reduce(s) (must issue none)")
        if not r.get("same_tokens", True):
            found.append(f"rank {r['rank']}: without a TP policy greedy tokens differ from the unpatched model")
    return found


def _codegen_problems(r: dict) -> list[str]:
    found = []
    tp = r["tp_group_size"]
    if r["maxdiff"] > TOLERANCE:
        found.append(f"logits differ by {r['maxdiff']:.2e} > {TOLERANCE:g}")
    if not r.get("same_tokens", True):
        found.append("greedy tokens differ from the single-process model")
    expected = expected_allreduces(r)
    if r["allreduce_per_forward"] != expected:
        found.append(f"{r['allreduce_per_forward']} all-reduces per forward, expected {expected} "
                     f"({_breakdown(r)})")
    profiled = r.get("allreduce_per_forward_profiler")
    if profiled is not None and profiled != r["allreduce_per_forward"]:
        found.append(f"the profiler saw {profiled} all-reduces per forward, the Python entry points "
                     f"{r['allreduce_per_forward']}: a reduction bypassed the counted entry points")
    for key, label in (("moe", "MoE"), ("attention", "attention"), ("dense_mlp", "dense MLP")):
        counts = r[f"allreduce_per_{key}_block"]
        if any(c != 1 for c in counts):
            found.append(f"all-reduces per {label} block {counts}, expected 1 each")
    if r["allreduce_lm_head"] != lm_head_reductions(r):
        found.append(f"LM head ({r['lm_head_type']}) issued {r['allreduce_lm_head']} all-reduces, "
                     f"expected {lm_head_reductions(r)}")
    if r["bytes"]["experts"] * tp != r["full_bytes"]["experts"]:
        found.append(f"routed experts hold {r['bytes']['experts']:,} of their {r['full_bytes']['experts']:,} "
                     f"unsharded bytes on this rank, expected 1/{tp}")
    if r["sharded_unregistered"]:
        found.append(f"sharded weights not registered Parameters of the model: {r['sharded_unregistered'][:3]}")
    if r["oversized_storage_params"]:
        found.append("parameters pin a larger storage (a view of the full tensor): "
                     f"{r['oversized_storage_params'][:3]}")
    if r["full_size_copies_alive"]:
        found.append(f"{r['full_size_copies_alive']} full-size copies of sharded weights still alive")
    if not r["gates_intact"]:
        found.append("router/gate weights changed")
    if r["gate_types"] != r["gate_types_reference"]:
        found.append(f"router/gate modules changed type: {r['gate_types']}")
    grad = r.get("grad_check")
    if grad is not None:
        if not grad.get("applicable"):
            found.append("no coalesced reduction attached to the MoE blocks (is the config knob off?)")
        elif not (grad["forward_is_sum"] and grad["no_grad_is_sum"]):
            found.append("the inserted reduction is not a sum over the TP group")
        elif not grad["grad_identity"]:
            found.append("the inserted reduction's backward does not pass the gradient through unchanged")
    return found


def _breakdown(r: dict) -> str:
    return (f"attention {r['allreduce_per_attention_block']}, MoE {r['allreduce_per_moe_block']}, "
            f"dense MLP {r['allreduce_per_dense_mlp_block']}, LM head {r['allreduce_lm_head']}")


def format_report(model_dir: Path, report: dict) -> str:
    def ratio(num: int, den: int) -> str:
        return f"{num / den:.2f}" if den else "-"

    def row(label: str, r: dict) -> str:
        b, f = r["bytes"], r["full_bytes"]
        per_block = r["allreduce_per_moe_block"]
        per_moe = f"{sum(per_block) / len(per_block):.1f}" if per_block else "-"
        return (f"  {label:<9} {r['maxdiff']:>10.2e} {r['allreduce_per_forward']:>7} {per_moe:>7} "
                f"{ratio(b['experts'], f['experts']):>8} {ratio(r['sharded_bytes'], r['sharded_full_bytes']):>8} "
                f"{b['gates']:>8,} {b['total']:>13,}")

    first = report["codegen"][0]
    lines = [
        f"verify {model_dir} (tp={first['tp_group_size']}, world={first['world_size']}, "
        f"{first['num_layers']} layers: {first['moe_blocks']} MoE, {first['dense_mlp_blocks']} dense MLP)",
        f"  {'':<9} {'max|dlog|':>10} {'AR/fwd':>7} {'AR/MoE':>7} {'experts':>8} {'sharded':>8} "
        f"{'gate B':>8} {'total B/rank':>13}",
    ]
    for mode in ("codegen", "stock", "no-policy"):
        if mode in report:
            lines.append(row(mode, report[mode][0]))
    lines.append(f"  codegen all-reduces per forward: {_breakdown(first)} = {first['allreduce_per_forward']} "
                 f"(expected {expected_allreduces(first)}; "
                 f"C++ profiler: {first.get('allreduce_per_forward_profiler')})")
    if "same_tokens" in first:
        lines.append(f"  greedy {GENERATE} tokens: {'identical' if first['same_tokens'] else 'DIFFERENT'}; "
                     f"routers {'replicated, unchanged' if first['gates_intact'] else 'CHANGED'}")
    grad = first.get("grad_check")
    if grad and grad.get("applicable"):
        lines.append(f"  backward through the MoE reduction: "
                     f"{'gradient unchanged' if grad['grad_identity'] else 'GRADIENT CHANGED'}")
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise errors.BadInput("--tp must be a positive integer")
    if args.world is not None and (args.world < args.tp or args.world % args.tp):
        raise errors.BadInput(f"--world {args.world} must be a multiple of --tp {args.tp}")
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file():
        raise errors.BadInput(f"{model_dir}: no config.json: point verify at a patched model dir")
    report = verify(model_dir, args.tp, args.world, args.timeout)
    print(format_report(model_dir, report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    found = problems(report)
    for p in found:
        print(f"FAIL {p}", file=sys.stderr)
    if found:
        raise VerifyFailed(f"{len(found)} check(s) failed for {model_dir}")
    print(f"OK: one all-reduce per MoE layer, logits within {TOLERANCE:g}, experts 1/{args.tp} per rank, "
          "gates replicated, identical without a policy")
    return errors.OK
