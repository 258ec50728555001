"""`python -m codegen demo`: the main job end to end on a fresh machine, no hub access.

Builds tiny random checkpoints of both families, patches them (`python -m codegen patch`, in this
process), then starts 2 local CPU ranks that load each dir twice, unpatched under stock
`deepspeed.init_inference` (before) and patched through `trust_remote_code` under its generated
`autotp_policy.py` (after), and compares both with the single-process model. Same worker as
`python -m codegen bench` (codegen.bench), with demo-sized settings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

from codegen import errors
from codegen.bench import (
    FAMILIES,
    SETTINGS,
    TOLERANCE,
    Progress,
    build_examples,
    check_runtime_installed,
    launch,
    make_workdir,
)
from codegen.errors import VerifyFailed

WORLD = 2


def cmd_demo(args: argparse.Namespace) -> int:
    check_runtime_installed("the demo")
    progress = Progress()
    workdir = getattr(args, "workdir", None)
    if workdir is not None:
        root = make_workdir(workdir, "codegen-demo-")
        return _demo(root, progress, keep=True)
    with tempfile.TemporaryDirectory(prefix="codegen-demo-") as tmp:
        return _demo(Path(tmp), progress, keep=False)


def _demo(root: Path, progress: Progress, keep: bool) -> int:
    from codegen.cli import _parser, cmd_patch
    from codegen.modeldir import copy_with_linked_weights

    settings = SETTINGS["demo"]
    built = build_examples(FAMILIES, settings["size"], root, progress)
    models = []
    for family in FAMILIES:
        patched = root / family / "patched"
        copy_with_linked_weights(built[family], patched)
        progress(f"{family}: python -m codegen patch {patched}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cmd_patch(_parser().parse_args(["patch", str(patched)]))
        print(out.getvalue().strip())
        models.append({"family": family, "unpatched": str(built[family]), "patched": str(patched)})

    spec = {
        "models": models,
        "tp": WORLD,
        "device": "cpu",
        "dtype": "float32",
        **{k: settings[k] for k in ("prompt_len", "batch", "decode_steps", "warmup", "prefill_repeats")},
    }
    progress(f"starting {WORLD} CPU ranks (torchrun): before = stock AutoTP on the unpatched dir, "
             "after = the patched dir loaded with trust_remote_code + its autotp_policy.py")
    started = time.monotonic()
    ranks = launch(spec, WORLD, settings["timeout"], progress, "cpu")
    progress(f"ranks finished in {time.monotonic() - started:.1f}s")
    rows, found = summarise(ranks)
    print(render(rows, settings))
    for line in found:
        print(f"FAIL {line}", file=sys.stderr)
    if found:
        raise VerifyFailed(f"demo: {len(found)} check(s) failed")
    print(f"OK: after codegen, one all-reduce per MoE layer on both families; logits within {TOLERANCE:g} of one process")
    progress(f"done in {progress.elapsed():.0f}s" + (f"; the example dirs are in {root}" if keep else ""))
    return errors.OK


def summarise(ranks: list[dict]) -> tuple[list[dict], list[str]]:
    rows, found = [], []
    for family in FAMILIES:
        per_rank = [r["families"][family] for r in ranks]
        row = {"family": family, "layers": per_rank[0]["num_layers"], "moe": per_rank[0]["codegen"]["moe_blocks"]}
        for mode, key in (("stock", "before"), ("codegen", "after")):
            rs = [r[mode] for r in per_rank]
            prefill = [c for r in rs for c in r["prefill_allreduce_per_moe_block"]]
            decode = [c for r in rs for step in r["decode_allreduce_per_moe_block"] for c in step]
            full = per_rank[0]["full_bytes"]["experts"] or 1
            row[key] = {
                "prefill": max(prefill, default=0),
                "prefill_all": prefill,
                "decode": max(decode, default=0),
                "decode_all": decode,
                "experts": max(r["bytes"]["experts"] for r in rs) / full,
                "diff": max(max(r["prefill_maxdiff"], r["decode_maxdiff"]) for r in rs),
            }
        after = row["after"]
        if not row["moe"]:
            found.append(f"{family}: no MoE layers found in the patched model")
        if any(c != 1 for c in after["prefill_all"] + after["decode_all"]):
            found.append(f"{family}: after codegen, all-reduces per MoE layer {sorted(set(after['prefill_all'] + after['decode_all']))}, expected 1")
        if after["diff"] > TOLERANCE:
            found.append(f"{family}: after codegen, logits differ from one process by {after['diff']:.2e} > {TOLERANCE:g}")
        rows.append(row)
    return rows, found


def _n(values: list[int]) -> str:
    """A count per MoE layer: one number when every layer agrees, else min-max."""
    lo, hi = min(values, default=0), max(values, default=0)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def render(rows: list[dict], settings: dict) -> str:
    from importlib.metadata import version

    prompt = f"prompt ({settings['prompt_len']} tok)"
    lines = [
        "",
        f"codegen demo: tensor parallel {WORLD} on local CPU ranks, tiny random checkpoints "
        f"(transformers {version('transformers')}, deepspeed {version('deepspeed')})",
        "before = stock deepspeed.init_inference(tensor_parallel=...) on the unpatched dir; "
        "after = the codegen-patched dir + its autotp_policy.py",
        "",
        f"{'':<13}  {'all-reduces per MoE layer':<34}  {'expert weights':<14}  max |logits diff|",
        f"{'':<13}  {prompt:<16}  {'decode step':<16}  {'per rank':<14}  vs one process",
        f"{'family':<13}  {'before':>7} {'after':>7}   {'before':>7} {'after':>7}   {'before':>6} {'after':>6}   "
        f"{'before':>8} {'after':>8}",
    ]
    for row in rows:
        b, a = row["before"], row["after"]
        lines.append(
            f"{row['family']:<13}  {_n(b['prefill_all']):>7} {_n(a['prefill_all']):>7}   "
            f"{_n(b['decode_all']):>7} {_n(a['decode_all']):>7}   {b['experts']:>6.0%} {a['experts']:>6.0%}   "
            f"{b['diff']:>8.1e} {a['diff']:>8.1e}"
        )
    shapes = ", ".join(f"{r['family']}: {r['layers']} layers, {r['moe']} MoE" for r in rows)
    lines.append(f"({shapes}; logits tolerance {TOLERANCE:g})")
    if any(r["before"]["experts"] > 0.99 for r in rows):
        lines.append(
            "note: with this transformers the routed experts are fused 3-D Parameters that stock AutoTP leaves "
            "replicated (100% per rank), so stock reduces only the shared expert; codegen shards them and still "
            "reduces once."
        )
    elif any(max(r["before"]["prefill_all"], default=0) > 1 for r in rows):
        lines.append(
            "note: stock AutoTP reduces inside every routed expert a token reaches, plus the shared expert; "
            "codegen sums them locally and reduces once per MoE layer."
        )
    return "\n".join(lines)
