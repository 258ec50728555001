"""`python -m codegen demo`: the main job end to end on a fresh machine, no hub access.

Builds tiny random checkpoints of every family, patches them (codegen.harness.prepare.patch_dir, in this
process), then starts 2 local CPU ranks that load each dir twice, unpatched under stock
`deepspeed.init_inference` (before) and patched through `trust_remote_code` under its generated
`autotp_policy.py` (after), and compares both with the single-process model. The same launch, worker
phase, checks and record as `python -m codegen bench` (codegen.harness.abrun.run_ab), with demo-sized settings.
"""

from __future__ import annotations

import time
from pathlib import Path

from codegen.families import FAMILIES
from codegen.harness.abrun import SETTINGS, run_ab
from codegen.harness.checks import TOLERANCE, ab_problems
from codegen.harness.prepare import Progress
from codegen.harness.results import crashed
from codegen.harness.results import record as result_record

WORLD = 2


def run_demo(root: Path, progress: Progress, families: tuple[str, ...] = tuple(FAMILIES)) -> dict:
    """Build, patch and run `families` (default: every family) on WORLD CPU ranks: the result record
    (codegen.harness.results)."""
    started = time.monotonic()
    progress(f"before = stock AutoTP on the unpatched dir, after = the patched dir loaded with trust_remote_code "
             f"+ its autotp_policy.py, on {WORLD} CPU ranks")
    rows, *_ = run_ab("demo", families, WORLD, "cpu", root, progress, echo_patch=True)
    entries = {row["family"]: row for row in rows}
    progress(f"ranks finished in {time.monotonic() - started:.1f}s")
    found = [p for family, e in entries.items() for p in ab_problems(family, e)]
    settings = {k: v for k, v in SETTINGS["demo"].items() if k != "timeout"}
    return result_record("demo", "demo", device="cpu", tp=WORLD, world_size=WORLD, dtype="float32",
                         tolerance=TOLERANCE, settings=settings, families=entries, problems=found,
                         wall_s=time.monotonic() - started)


def ok_line() -> str:
    return f"OK: after codegen, one all-reduce per MoE layer on every family; logits within {TOLERANCE:g} of one process"


def _n(lo: float, hi: float) -> str:
    """A count per MoE layer: one number when every layer agrees, else min-max."""
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


#: the before cells of a family where stock AutoTP crashed
CRASH = "crash"


def _row(e: dict, mode: str) -> dict:
    m = e[mode]
    if crashed(m):
        return {"prefill": CRASH, "prefill_max": 0, "decode": CRASH, "experts": None, "diff": None}
    prefill = m["allreduce_prefill_per_moe_layer"]
    return {
        "prefill": _n(min(prefill, default=0), max(prefill, default=0)),
        "prefill_max": max(prefill, default=0),
        "decode": _n(m["allreduce_decode_per_moe_layer_min"], m["allreduce_decode_per_moe_layer_max"]),
        "experts": m["param_bytes_per_rank"]["experts"] / (e["load_peak_bytes"]["experts"] or 1),
        "diff": max(m["maxdiff_prefill"], m["maxdiff_decode"]),
    }


def render(record: dict) -> str:
    settings, machine = record["settings"], record["machine"]
    prompt = f"prompt ({settings['prompt_len']} tok)"
    lines = [
        "",
        f"codegen demo: tensor parallel {record['tp']} on local CPU ranks, tiny random checkpoints "
        f"(transformers {machine['transformers']}, deepspeed {machine['deepspeed']})",
        "before = stock deepspeed.init_inference(tensor_parallel=...) on the unpatched dir; "
        "after = the codegen-patched dir + its autotp_policy.py",
        "",
        f"{'':<13}  {'all-reduces per MoE layer':<34}  {'expert weights':<14}  max |logits diff|",
        f"{'':<13}  {prompt:<16}  {'decode step':<16}  {'per rank':<14}  vs one process",
        f"{'family':<13}  {'before':>7} {'after':>7}   {'before':>7} {'after':>7}   {'before':>6} {'after':>6}   "
        f"{'before':>8} {'after':>8}",
    ]
    rows = {family: (_row(e, "stock"), _row(e, "codegen")) for family, e in record["families"].items()}
    for family, (b, a) in rows.items():
        b_experts = CRASH if b["experts"] is None else f"{b['experts']:.0%}"
        b_diff = CRASH if b["diff"] is None else f"{b['diff']:.1e}"
        lines.append(
            f"{family:<13}  {b['prefill']:>7} {a['prefill']:>7}   {b['decode']:>7} {a['decode']:>7}   "
            f"{b_experts:>6} {a['experts']:>6.0%}   {b_diff:>8} {a['diff']:>8.1e}"
        )
    shapes = ", ".join(f"{family}: {e['num_layers']} layers, {e['moe_layers']} MoE"
                       for family, e in record["families"].items())
    lines.append(f"({shapes}; logits tolerance {record['tolerance']:g})")
    for family, e in record["families"].items():
        if crashed(e["stock"]):
            lines.append(f"note: stock AutoTP crashed on {family} ({crashed(e['stock'])}); its before columns "
                         "say crash, after is codegen alone")
    ran = [(b, a) for b, a in rows.values() if b["experts"] is not None]
    if any(b["experts"] > 0.99 for b, _ in ran):
        lines.append(
            "note: with this transformers the routed experts are fused 3-D Parameters that stock AutoTP leaves "
            "replicated (100% per rank), so stock reduces only the shared expert (none where there is none); codegen "
            "shards them and still reduces once."
        )
    elif any(b["prefill_max"] > 1 for b, _ in ran):
        lines.append(
            "note: stock AutoTP reduces inside every routed expert a token reaches, plus the shared expert; "
            "codegen sums them locally and reduces once per MoE layer."
        )
    return "\n".join(lines)
