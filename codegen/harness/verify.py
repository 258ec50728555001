"""`python -m codegen verify <dir> --tp N`: what a user runs before deploying a patched dir.

One launch of N local CPU ranks (codegen.harness.launcher.launch, codegen.harness.worker.main) measures, against the
unpatched dir run in one process: the patched dir loaded with no TP policy (must be identical and
reduce nothing), the patched dir under its generated policy, and stock DeepSpeed AutoTP on the
unpatched dir (for comparison only: where it crashes, its row says so and the checks go on).
Pass/fail is codegen.harness.checks.phase_problems; the record is codegen.harness.results' schema. Exit 0 when every check passes, 6 (VerifyFailed) otherwise.
`verify_dirs` runs several dirs in that one launch.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from codegen.families import normalise_model_type
from codegen.harness.checks import GENERATE, TOLERANCE, breakdown, expected_allreduces, phase_problems
from codegen.harness.launcher import launch
from codegen.harness.results import crashed
from codegen.harness.results import record as result_record
from codegen.modeldir.layout import CONFIG
from codegen.modeldir.pristine import materialize_unpatched

PHASES = ["no-policy", "codegen", "compiled", "stock"]
OPTIONS = {"generate": GENERATE, "grad_check": True}


def verify_dirs(model_dirs: list[Path], tp: int, world: int | None = None, timeout: float = 600.0,
                options: dict | None = None, compile: bool = False) -> list[dict]:
    """One result record per patched dir, all measured in one launch of `world` ranks (default: tp); `compile`:
    the codegen phase again with its forward compiled (the policy's compile=True)."""
    world = world or tp
    options = {**OPTIONS, **(options or {})}
    phases_run = [p for p in PHASES if compile or p != "compiled"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="codegen-verify-") as tmp:
        jobs = []
        for i, model_dir in enumerate(model_dirs):
            pristine = materialize_unpatched(model_dir, Path(tmp) / f"{i}" / "unpatched")
            jobs.append({"name": f"{i}", "model": str(model_dir), "reference": str(pristine),
                         # several TP groups: stock AutoTP is measured on one group only (on CPU it would reduce
                         # over all ranks), in a launch of its own below
                         "phases": phases_run if world == tp else phases_run[:-1]})
        ranks = launch({"tp": tp, "options": options, "jobs": jobs}, world, timeout, what="verify")
        if world != tp:
            stock_jobs = [{**job, "model": job["reference"], "phases": ["stock"]} for job in jobs]
            stock = launch({"tp": tp, "options": options, "jobs": stock_jobs}, tp, timeout, what="verify stock")
            for job in jobs:
                for r in ranks[:tp]:
                    r["jobs"][job["name"]]["stock"] = stock[r["rank"]]["jobs"][job["name"]]["stock"]
    records = []
    for model_dir, job in zip(model_dirs, jobs):
        phases = {p: [r["jobs"][job["name"]][p] for r in ranks if p in r["jobs"][job["name"]]]
                  for p in phases_run}
        family = _family(model_dir)
        records.append(result_record(
            "verify", "verify", device="cpu", tp=tp, world_size=world, dtype="float32", tolerance=TOLERANCE,
            settings=options, families={family: {"dir": str(model_dir), **phases}},
            problems=phase_problems(phases), wall_s=time.monotonic() - started,
        ))
    return records


def verify(model_dir: Path, tp: int, world: int | None, timeout: float) -> dict:
    return verify_dirs([model_dir], tp, world, timeout)[0]


def _family(model_dir: Path) -> str:
    try:
        raw = json.loads((model_dir / CONFIG).read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raw = None
    return normalise_model_type(raw) or str(raw)


def phases_of(record: dict) -> dict:
    """The one model dir's {phase: [rank figures]} of a verify record."""
    (entry,) = record["families"].values()
    return entry


def format_report(model_dir: Path, record: dict) -> str:
    def ratio(num: int, den: int) -> str:
        return f"{num / den:.2f}" if den else "-"

    def row(label: str, r: dict) -> str:
        if crashed(r):
            return f"  {label:<9} {'crash':>10} (stock AutoTP failed: {crashed(r)})"
        if label == "compiled":  # the codegen model's weights: its counts and logits only
            return f"  {label:<9} {r['maxdiff']:>10.2e} {r['allreduce_per_forward']:>7}"
        b, f = r["bytes"], r["full_bytes"]
        per_block = r["allreduce_per_moe_block"]
        per_moe = f"{sum(per_block) / len(per_block):.1f}" if per_block else "-"
        return (f"  {label:<9} {r['maxdiff']:>10.2e} {r['allreduce_per_forward']:>7} {per_moe:>7} "
                f"{ratio(b['experts'], f['experts']):>8} {ratio(r['sharded_bytes'], r['sharded_full_bytes']):>8} "
                f"{b['gates']:>8,} {b['total']:>13,}")

    report = phases_of(record)
    first = report["codegen"][0]
    lines = [
        f"verify {model_dir} (tp={first['tp_group_size']}, world={first['world_size']}, "
        f"{first['num_layers']} layers: {first['moe_blocks']} MoE, {first['dense_mlp_blocks']} dense MLP)",
        f"  {'':<9} {'max|dlog|':>10} {'AR/fwd':>7} {'AR/MoE':>7} {'experts':>8} {'sharded':>8} "
        f"{'gate B':>8} {'total B/rank':>13}",
    ]
    for mode in ("codegen", "compiled", "stock", "no-policy"):
        if report.get(mode):
            lines.append(row(mode, report[mode][0]))
    lines.append(f"  codegen all-reduces per forward: {breakdown(first)} = {first['allreduce_per_forward']} "
                 f"(expected {expected_allreduces(first)}; counted at torch's dispatcher)")
    if "same_tokens" in first:
        lines.append(f"  greedy {GENERATE} tokens: {'identical' if first['same_tokens'] else 'DIFFERENT'}; "
                     f"routers {'replicated, unchanged' if first['gates_intact'] else 'CHANGED'}")
    if "decode_maxdiff" in first:
        lines.append(f"  prefill + {first['decode_checked']} decode steps with the cache: max|dlog| "
                     f"{max(r['decode_maxdiff'] for r in report['codegen']):.2e}")
    image = first.get("image")
    if image is not None:
        stock = (report.get("stock") or [{}])[0].get("image")
        beside = "" if stock is None else (f"; stock crashed ({stock['crashed']})" if "crashed" in stock else
                                           f"; stock {stock['allreduce_per_forward']}, {stock['maxdiff']:.2e}")
        lines.append(f"  with an image in the prompt: codegen {image['allreduce_per_forward']} all-reduces per forward "
                     f"(MoE {image['allreduce_per_moe_block']}), max|dlog| {image['maxdiff']:.2e}{beside}")
    compiled = (report.get("compiled") or [None])[0]
    if compiled is not None:
        how = (f"ran eager, torch.compile could not capture its forward as one graph ({compiled['fallback']})"
               if compiled["fallback"] else f"{compiled['graphs_per_forward']} graph per forward, "
               f"{compiled['graphs']} captured, first prefill compiled in {compiled['prefill_compile_s']:.1f} s")
        lines.append(f"  compiled (compile=True): {how}; {compiled['allreduce_per_forward']} all-reduces per forward"
                     + (f", prefill + {compiled['decode_checked']} decode steps max|dlog| "
                        f"{max(r['decode_maxdiff'] for r in report['compiled']):.2e}"
                        if "decode_maxdiff" in compiled else "")
                     + (f", greedy tokens {'identical' if compiled['same_tokens'] else 'DIFFERENT'}"
                        if "same_tokens" in compiled else ""))
    grad = first.get("grad_check")
    if grad and grad.get("applicable"):
        lines.append(f"  backward through the MoE reduction: "
                     f"{'gradient unchanged' if grad['grad_identity'] else 'GRADIENT CHANGED'}")
    return "\n".join(lines)


def ok_line(tp: int) -> str:
    return (f"OK: one all-reduce per MoE layer, logits within {TOLERANCE:g}, experts 1/{tp} per rank, "
            "gates replicated, identical without a policy")
