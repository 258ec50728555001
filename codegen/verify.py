"""`python -m codegen verify <dir> --tp N`: what a user runs before deploying a patched dir."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from codegen import errors
from codegen.errors import VerifyFailed
from codegen.runtime import materialize_unpatched, run_ranks

TOLERANCE = 1e-5


def expected_allreduces(result: dict) -> int:
    """One per attention block, one per MoE block, one per dense MLP block, one for the LM head."""
    layers = result["num_layers"]
    return layers + result["moe_blocks"] + (layers - result["moe_blocks"]) + 1


def verify(model_dir: Path, tp: int, world: int | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="codegen-verify-") as tmp:
        pristine = materialize_unpatched(model_dir, Path(tmp) / "unpatched")
        ours = run_ranks(model_dir, pristine, "codegen", tp, world, timeout)
        stock = run_ranks(pristine, pristine, "stock", tp, tp, timeout)
    return {"codegen": ours, "stock": stock}


def problems(report: dict) -> list[str]:
    found = []
    for r in report["codegen"]:
        if r["maxdiff"] > TOLERANCE:
            found.append(f"rank {r['rank']}: logits differ by {r['maxdiff']:.2e} > {TOLERANCE:g}")
        if r["allreduce_per_forward"] != expected_allreduces(r):
            found.append(f"rank {r['rank']}: {r['allreduce_per_forward']} all-reduces per forward, "
                         f"expected {expected_allreduces(r)}")
        if any(c != 1 for c in r["allreduce_per_moe_block"]):
            found.append(f"rank {r['rank']}: all-reduces per MoE block {r['allreduce_per_moe_block']}, expected 1 each")
        if not r["gates_intact"]:
            found.append(f"rank {r['rank']}: router/gate weights changed")
        if not r.get("same_tokens", True):
            found.append(f"rank {r['rank']}: greedy tokens differ from the single-process model")
    return found


def format_report(model_dir: Path, report: dict) -> str:
    def row(label: str, r: dict) -> str:
        b, f = r["bytes"], r["full_bytes"]
        per_block = r["allreduce_per_moe_block"]
        per_layer = f"{sum(per_block) / len(per_block):.1f}" if per_block else "-"
        return (f"  {label:<8} {r['maxdiff']:>10.2e} {r['allreduce_per_forward']:>10} {per_layer:>10} "
                f"{b['experts'] / max(f['experts'], 1):>9.2f} {b['gates']:>10,} {b['total']:>13,}")

    lines = [
        f"verify {model_dir} (tp={report['codegen'][0]['tp_group_size']}, world={report['codegen'][0]['world_size']}, "
        f"{report['codegen'][0]['num_layers']} layers, {report['codegen'][0]['moe_blocks']} MoE)",
        f"  {'':<8} {'max|dlog|':>10} {'AR/fwd':>10} {'AR/MoE':>10} {'experts':>9} {'gate B':>10} {'total B/rank':>13}",
        row("codegen", report["codegen"][0]),
        row("stock", report["stock"][0]),
    ]
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise errors.BadInput("--tp must be a positive integer")
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
    print("OK: one all-reduce per MoE layer, logits within 1e-5, gates replicated")
    return errors.OK
