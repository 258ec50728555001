"""`python -m codegen bench`: stock AutoTP (a), the patched dir (b) and transformers' native TP (d), side by side.

One launch of the rank worker (codegen.harness.abrun, the worker's ab phase) holds, on every rank, the
tensor-parallel setups of a family side by side: (a) the unpatched dir under stock
`deepspeed.init_inference(tensor_parallel=...)`, (b) the patched dir under its generated
`autotp_policy.init_inference`, (d) the unpatched dir loaded with `tp_plan="auto"`. Every prefill is run by each
setup in a rotating order (ABBA generalised), each after a barrier, so all see the same load on this shared
machine, the same processes, threads, input tensors and cache lengths; decode runs each setup's steps
consecutively (a serving rank's caches hold its own weights, not another setup's).
(c), the unsharded unpatched model run by each rank alone (no collectives), is the numerical reference; its
greedy tokens are the decode inputs fed to every setup (teacher forcing). Before anything is built, the
memory the run needs is planned (codegen.harness.memory); setups that do not fit side by side run in pairs.
Pass/fail is codegen.harness.checks.ab_problems, the record codegen.harness.results' schema, the outputs
codegen.harness.report.

Also timed: `python -m codegen patch DIR`, a cold process per model dir (a measurement of the CLI on
a scratch copy; the dirs the bench runs are patched through codegen.harness.prepare.patch_dir).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from codegen.errors import BadInput, VerifyFailed
from codegen.harness.abrun import NOT_RUN_MEMORY, PAIRS, SETTINGS, families_of, label, run_ab, size_name
from codegen.harness.checks import TOLERANCE, ab_problems
from codegen.harness.limits import METHOD as LIMITS_METHOD
from codegen.harness.opcache import shm_op_cached
from codegen.harness.prepare import Progress, make_workdir
from codegen.harness.results import record as result_record

METHOD = {
    "schedule": "one launch; on every rank the setups (a, b, d) are loaded side by side; each prefill runs every "
                "setup in a rotating order (ABBA generalised), each after a barrier; decode runs each setup's "
                "warm-up and timed steps consecutively, one setup after the other, each step after a barrier; "
                "end to end, the setups alternate, each timed generate right after an untimed one of the same setup",
    "inputs": "same random prompt for every setup and c; decode tokens forced to (c)'s greedy tokens so every "
              "setup decodes the same sequence",
    "latency": "per timed unit the slowest rank (time.perf_counter around the forward), warm-up excluded",
    "allreduce_counts": "collective ops counted at torch's dispatcher (DeepSpeed's shm op, c10d, functional "
                        "collectives), in untimed passes: the prefill and the first decode steps from a fresh cache; "
                        "per MoE layer by forward hooks",
    "param_bytes_per_rank": "parameter bytes held by the largest rank after init (experts = routed expert weights); "
                            "while loading, every rank holds the full checkpoint (load_peak_bytes) in a and b alike",
    "reference": "(c): the unpatched model, unsharded, float32, run by each rank alone (no collectives)",
}


def time_cold_patch(unpatched: Path, scratch: Path, trials: int) -> list[float]:
    """Wall time of `python -m codegen patch -q` in a cold process (a user's run), on a scratch copy."""
    from codegen.modeldir.outcopy import copy_with_linked_weights

    copy_with_linked_weights(unpatched, scratch)
    times = []
    for trial in range(trials):
        if trial:
            _codegen("revert", "-q", scratch)
        t0 = time.perf_counter()
        _codegen("patch", "-q", scratch)
        times.append(time.perf_counter() - t0)
    return times


def _codegen(*args) -> None:
    result = subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise VerifyFailed(f"`codegen {' '.join(map(str, args))}` failed (exit {result.returncode}): {line}")


def _startup_baseline(trials: int) -> float:
    times = []
    for _ in range(max(trials, 1)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "codegen", "--version"], capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_bench(kind: str, device: str, tp: int, workdir: Path | None, progress: Progress,
              families: tuple[str, ...] | None = None, dtype: str | None = None,
              after_launch: Callable[[tuple[str, ...]], None] | None = None, rounds: int = 1) -> dict:
    """The bench record of `kind`; `after_launch(families)` runs after each rank launch (then one per family) with
    the families it ran (codegen.harness.peer.run_paired: vLLM on them, right after), `rounds` times per family
    (codegen.harness.abrun.run_ab)."""
    settings = dict(SETTINGS[kind])
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    families = families or families_of(kind)
    started = time.monotonic()
    memory = memory_plan(kind, families, tp, dtype, progress) if device == "cpu" else {}
    skipped = {f: m["not_run"] for f, m in memory.items() if m.get("not_run")}
    if len(skipped) == len(families):
        raise BadInput(f"nothing fits in memory: {next(iter(skipped.values()))}")
    families = tuple(f for f in families if f not in skipped)
    groups = {f: m["groups"] for f, m in memory.items() if f in families}
    if workdir is not None:
        root = make_workdir(workdir, f"codegen-{kind}-")
        cleanup = None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix=f"codegen-{kind}-")
        root = Path(cleanup.name)
    try:
        compiled = device == "cpu" and not shm_op_cached()
        load_start = _loadavg()
        rows, ranks, dirs, limits = run_ab(kind, families, tp, device, root, progress, dtype=dtype, groups=groups,
                                              after_launch=after_launch, rounds=rounds)
        load_end = _loadavg()
        for row in rows:
            if row["family"] in memory:
                row["memory_estimate"] = memory[row["family"]]
        rows += [{"family": f, "label": label(f), "size": settings["size"], "batch": batch, "dtype": dtype,
                  "not_run": reason, "not_run_cause": NOT_RUN_MEMORY, "memory_estimate": memory[f]}
                 for f, reason in skipped.items() for batch in settings["batches"]]
        trials = {}
        if settings["patch_trials"]:
            for family in families:
                progress(f"{family}: `python -m codegen patch` (cold process) x {settings['patch_trials']}")
                trials[family] = time_cold_patch(dirs[family]["unpatched"], root / family / "patch-timing",
                                                 settings["patch_trials"])
        baseline = _startup_baseline(settings["patch_trials"]) if settings["patch_trials"] else None
        tolerance = TOLERANCE if dtype == "float32" else None
        found = [p for row in rows if not row.get("not_run") for p in ab_problems(_row_name(row), row, tolerance)]
        record = result_record(
            "bench", kind, device=device, tp=tp, world_size=tp, dtype=dtype, tolerance=tolerance,
            settings={k: v for k, v in settings.items() if k != "timeout"}, families=None, problems=found,
            wall_s=time.monotonic() - started, method=METHOD, deepspeed_cpu_op_compiled_during_run=compiled,
            patch_timing={"startup_baseline_s": baseline, "families": trials,
                          "median_s": {f: statistics.median(t) for f, t in trials.items()}},
            machine_limits={**limits, "method": LIMITS_METHOD}, rows=rows,
        )
        record["machine"].update({"loadavg_1min_before_ranks": load_start, "loadavg_1min_after_ranks": load_end},
                                 **({"gpu": ranks[0]["gpu"]} if "gpu" in ranks[0] else {}))
        if workdir is not None:
            record["workdir"] = str(root)
        return record
    finally:
        if cleanup is not None:
            cleanup.cleanup()


def _row_name(row: dict) -> str:
    return f"{row['family']} (batch {row['batch']}, {row['dtype']}, {size_name(row['size'])} widths)"


_ESTIMATE = """
import json, sys, tempfile
import transformers
from codegen.families import FAMILIES
from codegen.harness.examples import shape
from codegen.harness.memory import parameter_bytes
size, dtype, families = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {}
for family in families:
    with tempfile.TemporaryDirectory() as tmp:
        getattr(transformers, FAMILIES[family].config_class)(**shape(family, size)).save_pretrained(tmp)
        out[family] = parameter_bytes(tmp, dtype)
print(json.dumps({"transformers": transformers.__version__, "families": out}))
"""


def memory_plan(kind: str, families: tuple[str, ...], tp: int, dtype: str, progress: Progress) -> dict:
    """Per family: the memory the run needs (before anything is built) and the groups its setups run in.

    All setups side by side if they fit in this machine's available memory, else two interleaved
    groups sharing codegen ((a, b) then (b, d)); a family even a pair does not fit is refused.
    """
    from codegen.harness import memory
    from codegen.harness.launcher import last_error_line

    settings = SETTINGS[kind]
    child = subprocess.run([sys.executable, "-c", _ESTIMATE, settings["size"], dtype, *families],
                           capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if child.returncode != 0:
        raise VerifyFailed(f"estimating the benchmark's memory failed: {last_error_line(child.stderr)}")
    estimate = json.loads(child.stdout.strip().splitlines()[-1])
    available = memory.available_bytes()
    plans = {}
    for family in families:
        parts = estimate["families"][family]
        replicated = parts["fused"]  # stock AutoTP leaves fused 3-D experts whole on every rank
        everything = memory.plan(parts, tp, list(settings["setups"]), replicated)
        groups = (tuple(settings["setups"]),)
        chosen = everything
        if not memory.fits(everything, available):
            pairs = [memory.plan(parts, tp, list(pair), replicated) for pair in PAIRS]
            chosen = max(pairs, key=lambda plan: plan["peak_total"])
            if not memory.fits(chosen, available):
                reason = (f"needs about {memory.required_bytes(chosen) / 2**30:.1f} GiB with {tp} ranks even with the "
                          f"setups in pairs; {available / 2**30:.1f} GiB is available (use --dtype bfloat16 or a "
                          "bigger machine)")
                progress(f"{family}: {size_name(settings['size'])} widths, {dtype}: not run: {reason}")
                plans[family] = {"parameter_bytes": parts, "plan": chosen, "available_bytes": available,
                                 "groups": [], "not_run": reason}
                continue
            groups = PAIRS
        progress(f"{family}: {size_name(settings['size'])} widths, {dtype}: parameters {parts['total'] / 2**30:.2f} GiB; "
                 f"needs about {memory.required_bytes(chosen) / 2**30:.1f} GiB at peak on {tp} ranks ("
                 + ("all setups side by side" if len(groups) == 1 else "(a, b) then (b, d): all three do not fit")
                 + f"); {available / 2**30:.1f} GiB available")
        plans[family] = {"parameter_bytes": parts, "plan": chosen, "available_bytes": available,
                         "groups": [list(g) for g in groups]}
    return plans


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def problems(record: dict) -> list[str]:
    """What makes a bench run (or a merge of runs) fail: codegen.harness.checks.ab_problems of every row."""
    runs = record.get("runs", [record])
    return [p for rec in runs for row in rec["rows"] if not row.get("not_run")
            for p in ab_problems(_row_name(row), row, rec.get("tolerance", TOLERANCE))]
