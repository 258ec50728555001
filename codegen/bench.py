"""`python -m codegen bench`: stock AutoTP (a) vs the patched dir (b) vs one process (c), same ranks, same inputs.

One launch (codegen.runtime.launch) holds, on every rank, both tensor-parallel models of a family side
by side: (a) the unpatched dir under stock `deepspeed.init_inference(tensor_parallel=...)` and (b) the
patched dir under its generated `autotp_policy.init_inference`. Every timed unit (a prefill, a decode
step) is run for a and b back to back, in ABBA order (a,b then b,a, ...), each after a barrier, so both
see the same load on this shared machine, the same processes, threads, input tensors and cache
lengths. (c), the unsharded unpatched model run by each rank alone (no collectives), is the
numerical reference; its greedy tokens are also the decode inputs fed to a and b (teacher forcing),
so a and b decode exactly the same sequence. This is the `ab` phase of codegen.tp_worker; pass/fail
is codegen.checks.ab_problems, the record codegen.results' schema.

Also timed: `python -m codegen patch DIR`, a cold process per model dir (a measurement of the CLI on
a scratch copy; the dirs the bench runs are patched through codegen.harness.patch_dir).

`python -m codegen.bench merge A.json B.json --markdown T.md --chart C.png` combines runs from
several environments (one per transformers version) into one table and chart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from codegen import __version__, errors
from codegen.checks import TOLERANCE, ab_problems
from codegen.errors import BadInput, CodegenError, IOFailure, VerifyFailed
from codegen.families import FAMILIES
from codegen.harness import (
    Progress,
    ab_spec,
    check_device,
    check_runtime_installed,
    make_workdir,
    prepare_examples,
)
from codegen.results import crashed
from codegen.results import record as result_record
from codegen.results import summarise_ab

METHOD = {
    "schedule": "one launch; on every rank (a) and (b) are loaded side by side and each timed unit "
                "(prefill, decode step) runs a then b or b then a (ABBA), each after a barrier",
    "inputs": "same random prompt for a, b, c; decode tokens forced to (c)'s greedy tokens so a and b decode the "
              "same sequence",
    "latency": "per timed unit the slowest rank (time.perf_counter around the forward), warm-up excluded",
    "allreduce_counts": "collective calls counted once at the outermost entry point (deepspeed.comm all_reduce / "
                        "inference_all_reduce, torch.distributed.all_reduce); per MoE layer by forward hooks",
    "param_bytes_per_rank": "parameter bytes held by the largest rank after init (experts = routed expert weights); "
                            "while loading, every rank holds the full checkpoint (load_peak_bytes) in a and b alike",
    "reference": "(c): the unpatched model, unsharded, float32, run by each rank alone (no collectives)",
}

#: what each kind of run measures: `smoke` is the CI run (counts asserted, timings recorded but meaningless),
#: `toy` the default recorded run (scaled-down widths), `full` the published widths (2 layers, small vocab)
SETTINGS: dict[str, dict] = {
    "smoke": dict(size="tiny", prompt_len=32, batches=(1,), decode_steps=4, warmup=1, prefill_repeats=2,
                  patch_trials=1, setups=("stock", "codegen", "native"), timeout=900.0),
    "toy": dict(size="bench", prompt_len=128, batches=(1, 16), decode_steps=48, warmup=4, prefill_repeats=8,
                patch_trials=3, setups=("stock", "codegen", "native"), timeout=1800.0),
    "full": dict(size="full", prompt_len=64, batches=(1, 16), decode_steps=16, warmup=2, prefill_repeats=3,
                 patch_trials=0, setups=("stock", "codegen", "native"), timeout=3000.0),
    # the demo: tiny dirs, counts and logits only, (a) vs (b)
    "demo": dict(size="tiny", prompt_len=32, batches=(1,), decode_steps=2, warmup=1, prefill_repeats=1,
                 patch_trials=0, setups=("stock", "codegen"), timeout=600.0),
}
#: two interleaved groups sharing (b), when the three setups do not fit in memory side by side
PAIRS = (("stock", "codegen"), ("codegen", "native"))


def families_of(kind: str) -> tuple[str, ...]:
    """The families a kind of run covers: those with an example shape of its size."""
    from codegen.examples import SHAPES

    return tuple(f for f in FAMILIES if f in SHAPES[SETTINGS[kind]["size"]])


def run_ab(kind: str, families: tuple[str, ...], tp: int, device: str, root: Path, progress: Progress,
           echo_patch: bool = False, dtype: str = "float32", groups: dict[str, tuple] | None = None
           ) -> tuple[list[dict], list[dict], dict]:
    """Build, patch and run the ab phase of every (family, batch) in one launch: (rows, rank records, dirs).

    `groups` gives, per family, the interleaved groups of setups (default: all of the kind's setups
    in one group); a family run in two groups gets one row, (b)'s figures from the first.
    """
    from codegen.examples import shape_of
    from codegen.runtime import launch, shm_op_cached

    settings = SETTINGS[kind]
    dirs = prepare_examples(families, settings["size"], root, progress, echo=echo_patch,
                            dtype=dtype if settings["size"] == "full" else "float32")
    if device == "cpu" and not shm_op_cached():
        progress("first run with this Python, torch and DeepSpeed: DeepSpeed JIT-compiles its CPU shared-memory "
                 "all-reduce (once, kept in codegen's cache dir; 1-3 minutes on 2 cores)")
    jobs = []
    for family in families:
        for batch in settings["batches"]:
            for g, setups in enumerate((groups or {}).get(family, (settings["setups"],))):
                jobs.append({"name": f"{family}/b{batch}/g{g}", "family": family, "batch": batch, "setups": setups})
    # full widths: one launch per family, so no rank carries one family's freed-but-kept heap into the next
    batches = [[f] for f in families] if settings["size"] == "full" else [list(families)]
    ranks: list[dict] = []
    for launched in batches:
        progress(f"starting {tp} {device.upper()} ranks ({', '.join(launched)}); every timed step runs each setup "
                 "back to back, in rotating order")
        spec = ab_spec(dirs, [job for job in jobs if job["family"] in launched], tp, device, dtype, settings)
        for k, rank in enumerate(launch(spec, tp, settings["timeout"], progress, what="benchmark")):
            if k < len(ranks):
                ranks[k]["jobs"].update(rank["jobs"])
            else:
                ranks.append(rank)
    rows = []
    for family in families:
        shape = shape_of(dirs[family]["unpatched"], family, settings["size"])
        for batch in settings["batches"]:
            parts = [summarise_ab([r["jobs"][job["name"]]["ab"] for r in ranks], shape)
                     for job in jobs if job["family"] == family and job["batch"] == batch]
            row = {"family": family, "label": _label(family), "size": settings["size"], **parts[0]}
            for part in parts[1:]:  # a second group: (d) against its own (b)
                row["native"], row["ratio_b_over_d"] = part["native"], part["ratio_b_over_d"]
                row["codegen_beside_native"] = part["codegen"]
            if len(parts) > 1:
                row["groups"] = [list(job["setups"]) for job in jobs
                                 if job["family"] == family and job["batch"] == batch]
            rows.append(row)
    return rows, ranks, dirs


def time_cold_patch(unpatched: Path, scratch: Path, trials: int) -> list[float]:
    """Wall time of `python -m codegen patch -q` in a cold process (a user's run), on a scratch copy."""
    from codegen.modeldir import copy_with_linked_weights

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
              families: tuple[str, ...] | None = None, dtype: str | None = None) -> dict:
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
        compiled = device == "cpu" and not _shm_cached()
        load_start = _loadavg()
        rows, ranks, dirs = run_ab(kind, families, tp, device, root, progress, dtype=dtype, groups=groups)
        load_end = _loadavg()
        for row in rows:
            if row["family"] in memory:
                row["memory_estimate"] = memory[row["family"]]
        rows += [{"family": f, "label": _label(f), "size": settings["size"], "batch": batch, "dtype": dtype,
                  "not_run": reason, "memory_estimate": memory[f]}
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
            rows=rows,
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
    return f"{row['family']} (batch {row['batch']}, {row['dtype']}, {_size(row['size'])} widths)"


def _size(size: str) -> str:
    """The CLI's name of an example size: `bench` shapes are what `--size toy` runs."""
    return {"bench": "toy"}.get(size, size)


_ESTIMATE = """
import json, sys, tempfile
import transformers
from codegen.examples import SHAPES
from codegen.families import FAMILIES
from codegen.memory import parameter_bytes
size, dtype, families = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {}
for family in families:
    with tempfile.TemporaryDirectory() as tmp:
        getattr(transformers, FAMILIES[family].config_class)(**SHAPES[size][family]).save_pretrained(tmp)
        out[family] = parameter_bytes(tmp, dtype)
print(json.dumps({"transformers": transformers.__version__, "families": out}))
"""


def memory_plan(kind: str, families: tuple[str, ...], tp: int, dtype: str, progress: Progress) -> dict:
    """Per family: the memory the run needs (before anything is built) and the groups its setups run in.

    All setups side by side if they fit in this machine's available memory, else two interleaved
    groups sharing codegen ((a, b) then (b, d)); a family even a pair does not fit is refused.
    """
    from codegen import memory
    from codegen.runtime import _last_error_line

    settings = SETTINGS[kind]
    child = subprocess.run([sys.executable, "-c", _ESTIMATE, settings["size"], dtype, *families],
                           capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if child.returncode != 0:
        raise VerifyFailed(f"estimating the benchmark's memory failed: {_last_error_line(child.stderr)}")
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
                progress(f"{family}: {_size(settings['size'])} widths, {dtype}: not run: {reason}")
                plans[family] = {"parameter_bytes": parts, "plan": chosen, "available_bytes": available,
                                 "groups": [], "not_run": reason}
                continue
            groups = PAIRS
        progress(f"{family}: {_size(settings['size'])} widths, {dtype}: parameters {parts['total'] / 2**30:.2f} GiB; "
                 f"needs about {memory.required_bytes(chosen) / 2**30:.1f} GiB at peak on {tp} ranks ("
                 + ("all setups side by side" if len(groups) == 1 else "(a, b) then (b, d): all three do not fit")
                 + f"); {available / 2**30:.1f} GiB available")
        plans[family] = {"parameter_bytes": parts, "plan": chosen, "available_bytes": available,
                         "groups": [list(g) for g in groups]}
    return plans


def _shm_cached() -> bool:
    from codegen.runtime import shm_op_cached

    return shm_op_cached()


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def problems(record: dict) -> list[str]:
    """What makes a bench run fail (codegen.checks.ab_problems of every row)."""
    return [p for rec in _records(record) for row in rec["rows"] if not row.get("not_run")
            for p in ab_problems(_row_name(row), row, rec.get("tolerance", TOLERANCE))]


# ------------------------------------------------------------------------------------------------- outputs


def _label(family: str) -> str:
    known = FAMILIES.get(family)
    return known.bench_label if known is not None and known.bench_label else family


def _records(record_or_merged: dict) -> list[dict]:
    return record_or_merged.get("runs", [record_or_merged])


def _rows(records: list[dict]):
    for rec in records:
        for row in rec.get("rows", []):
            yield rec, row


def _fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}×"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _count(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.2f}"


#: the setups in table order, and their letters
SETUP_ORDER = (("stock", "a"), ("codegen", "b"), ("native", "d"))


def _present(row: dict, mode: str) -> dict | None:
    """A setup's figures, None where it was not run or crashed."""
    figures = row.get(mode)
    return None if figures is None or crashed(figures) else figures


def _cells(row: dict, fmt) -> str:
    """`a / b / d` for one figure: `crash` where a setup crashed, `–` where it was not run."""
    out = []
    for mode, _ in SETUP_ORDER:
        figures = row.get(mode)
        out.append("–" if figures is None else "crash" if crashed(figures) else fmt(figures))
    return " / ".join(out)


def _per_layer(f: dict) -> str:
    gathers = f.get("gathers_decode_per_moe_layer_mean", 0)
    text = _count(f["allreduce_decode_per_moe_layer_mean"])
    return text + (f"+{_count(gathers)}g" if gathers else "")


def _per_step(f: dict) -> str:
    gathers = f.get("gathers_decode_step", {}).get("median", 0) or 0
    return _count(f["allreduce_decode_step"]["median"]) + (f"+{_count(gathers)}g" if gathers else "")


def _numerics(f: dict, dtype: str) -> str:
    if dtype == "float32":
        return f"{max(f['maxdiff_prefill'], f['maxdiff_decode']):.0e}"
    agreement = f.get("token_agreement")
    return (f"{max(f['relative_prefill'], f['relative_decode']):.0e}"
            + (f", {agreement:.0%}" if agreement is not None else ""))


def _unsharded(row: dict) -> str:
    """A low-precision row's yardstick: the unsharded model's own error and agreement at that dtype."""
    single = row.get("reference", {}).get("single_process_error")
    if not single:
        return ""
    agreement = single["tokens_agree"] / single["tokens_total"] if single["tokens_total"] else None
    return (f" (unsharded {row['dtype']}: {max(single['prefill_relative'], single['decode_relative']):.0e}"
            + (f", {agreement:.0%})" if agreement is not None else ")"))


def _ratio_cell(row: dict, key: str) -> str:
    r = row.get(key) or {}
    return f"{_fmt_ratio(r.get('decode_median'))}, {_fmt_ratio(r.get('prefill_median'))}"


def markdown(record_or_merged: dict) -> str:
    records = _records(record_or_merged)
    first = records[0]
    lines = [
        f"TP={first['tp']} on {first['device'].upper()}; (a) stock DeepSpeed AutoTP, (b) codegen, (d) transformers "
        "native TP (`tp_plan=\"auto\"`), each cell **a / b / d**; latency = slowest rank, median; decode "
        "teacher-forced with the float32 single-process model's greedy tokens; `crash` = that setup failed to load "
        "or run (below), `–` = not run. Collectives: all-reduces, `+Ng` = N other collectives (all-gathers). "
        "Numerics: float32 rows max |Δlogits| vs the float32 single process (c); bfloat16 rows the relative error "
        "max|Δ|/max|logits| vs (c) and the share of decode steps whose greedy token matches (c)'s.",
        "",
        "| model | transformers | dtype | batch | collectives / MoE layer (decode) | collectives / decode step "
        "| decode ms | decode tokens/s | prefill ms | expert MiB / rank | numerics | b/a decode, prefill "
        "| b/d decode, prefill |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: dict[str, list[str]] = {}  # one line per finding, naming the rows it holds for
    for rec, row in _rows(records):
        tf = rec["machine"]["transformers"]
        where = f"{_size(row['size'])} {row['dtype']} batch {row['batch']}"
        if row.get("not_run"):
            notes.setdefault(f"{row['family']} ({_size(row['size'])} widths, transformers {tf}): not run: "
                             f"{row['not_run']}", []).append(where)
            lines.append(f"| {row['family']} ({_label(row['family'])}, {_size(row['size'])}) | {tf} | {row['dtype']} "
                         f"| {row['batch']} | not run: does not fit in memory (notes) |" + " |" * 8)
            continue
        for mode, letter in SETUP_ORDER:
            figures = row.get(mode)
            if figures is not None and (crashed(figures) or figures.get("note")):
                finding = f"crashed: {crashed(figures)}" if crashed(figures) else figures["note"]
                notes.setdefault(f"({letter}) {row['family']}, transformers {tf}: {finding}", []).append(where)
        if row.get("groups"):
            notes.setdefault(f"{row['family']}, transformers {tf}: the three setups do not fit side by side; "
                             "interleaved as " + " then ".join(
                                 "(" + ", ".join(dict(SETUP_ORDER)[m] for m in g) + ")" for g in row["groups"])
                             + "; b/d compares (d) with the (b) run beside it", []).append(where)
        lines.append(
            f"| {row['family']} ({_label(row['family'])}, {_size(row['size'])}) | {tf} | {row['dtype']} "
            f"| {row['batch']} | {_cells(row, _per_layer)} | {_cells(row, _per_step)} "
            f"| {_cells(row, lambda f: format(f['decode']['median'] * 1e3, '.1f'))} "
            f"| {_cells(row, lambda f: format(f['decode_tokens_per_s'], '.1f'))} "
            f"| {_cells(row, lambda f: format(f['prefill']['median'] * 1e3, '.0f'))} "
            f"| {_cells(row, lambda f: _mb(f['param_bytes_per_rank']['experts']))} "
            f"| {_cells(row, lambda f: _numerics(f, row['dtype']))}{_unsharded(row)} "
            f"| {_ratio_cell(row, 'ratio_b_over_a')} | {_ratio_cell(row, 'ratio_b_over_d')} |"
        )
    if notes:
        lines += ["", "Notes (the rows each holds for):", ""]
        lines += [f"- {text} ({'; '.join(where)})" for text, where in notes.items()]
    timed = [(rec, f, med, len(rec["patch_timing"]["families"][f])) for rec in records
             for f, med in rec.get("patch_timing", {}).get("median_s", {}).items()]
    if timed:
        lines += [
            "",
            "`python -m codegen patch DIR`: wall time of a cold process, median of n trials; start-up = "
            "`python -m codegen --version` (interpreter + CLI import) in the same environment:",
            "",
            "| model | transformers | patch wall s |",
            "|---|---|---|",
        ]
        for rec, family, med, n in timed:
            base = rec["patch_timing"].get("startup_baseline_s")
            lines.append(f"| {family} | {rec['machine']['transformers']} | {med:.2f} (n={n}"
                         + (f"; start-up {base:.2f})" if base is not None else ")") + " |")
    lines += ["", "Runs:", ""] + [f"- {_run_line(rec)}" for rec in records]
    return "\n".join(lines) + "\n"


def _run_line(rec: dict) -> str:
    s = rec["settings"]
    return (f"{rec['kind']} ({_size(s['size'])} widths), {rec['dtype']}, batches {', '.join(map(str, s['batches']))}: "
            f"{s['prompt_len']}-token prompt per sequence, {s['warmup']} warm-up + {s['prefill_repeats']} timed "
            f"prefills, {s['warmup']} warm-up + {s['decode_steps']} timed decode steps; " + _machine_line(rec))


def _machine_line(rec: dict) -> str:
    m = rec["machine"]
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    notes = [f"run wall {rec['wall_s']:.0f}s"]
    if rec.get("deepspeed_cpu_op_compiled_during_run"):
        notes.append("including DeepSpeed's one-time JIT compile of its CPU all-reduce op")
    before, after = m.get("loadavg_1min_before_ranks"), m.get("loadavg_1min_after_ranks")
    if before is not None and after is not None:
        notes.append(f"1-min load average {before:.1f} → {after:.1f} on {m['cores']} cores")
    return (f"transformers {m['transformers']}: {m['cpu']}, {m['cores']} cores, {ram}{gpu}, {m['os']}, "
            f"Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}; {'; '.join(notes)}")


def chart(record_or_merged: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--chart needs matplotlib: pip install matplotlib (or codegen[bench])") from None
    rows = [(rec, row) for rec, row in _rows(_records(record_or_merged)) if not row.get("not_run")]
    labels = [f"{row['family']} {_size(row['size'])}, tf {rec['machine']['transformers']}, "
              f"{'bf16' if row['dtype'] == 'bfloat16' else 'fp32'}, batch {row['batch']}" for rec, row in rows]
    y = list(range(len(rows)))
    h = 0.27
    fig, axes = plt.subplots(1, 4, figsize=(20, 1.6 + 0.32 * len(rows)), sharey=True)
    colours = {"stock": "#c44e52", "codegen": "#4c72b0", "native": "#55a868"}
    names = {"stock": "(a) stock AutoTP", "codegen": "(b) codegen", "native": "(d) transformers native TP"}

    def relative(key: str):
        return lambda f, b: f[key]["median"] / b[key]["median"]

    panels = [
        ("decode step time / codegen's (log; > 1: slower than codegen)", relative("decode"), True),
        ("prefill time / codegen's (log)", relative("prefill"), True),
        ("all-reduces per MoE layer, decode (log)", lambda f, b: f["allreduce_decode_per_moe_layer_mean"], True),
        ("routed-expert MiB per rank", lambda f, b: f["param_bytes_per_rank"]["experts"] / 2**20, False),
    ]
    for ax, (title, value, log) in zip(axes, panels):
        for j, (mode, _) in enumerate(SETUP_ORDER):
            widths = []
            for _, row in rows:
                f, b = _present(row, mode), _present(row, "codegen")
                widths.append(float("nan") if f is None else value(f, b))
            ax.barh([i + (j - 1) * h for i in y], widths, h, color=colours[mode], label=names[mode])
        if log:
            ax.set_xscale("symlog" if "all-reduces" in title else "log", **({"linthresh": 1} if "all-reduces" in title else {}))
        if "/ codegen" in title:
            ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7, loc="lower right")
    first = _records(record_or_merged)[0]
    fig.suptitle(f"codegen bench: TP={first['tp']} on {first['device'].upper()}, {first['machine']['cpu']}, "
                 f"{first['machine']['cores']} cores (missing bar: crashed or not run)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise IOFailure(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def merge(paths: list[Path]) -> dict:
    runs = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise BadInput(f"{path}: {exc.strerror}") from None
        except ValueError:
            raise BadInput(f"{path} is not JSON: pass files written by `bench --json`") from None
        if not isinstance(data, dict) or not ("rows" in data or "runs" in data):
            raise BadInput(f"{path} is not a `bench --json` record of this codegen version (no rows): run it again")
        runs += _records(data)
    sizes = {"tiny": 0, "bench": 1, "full": 2}
    runs.sort(key=lambda r: (sizes.get(r["settings"]["size"], 3),
                             [int(p) if p.isdigit() else 0 for p in str(r["machine"]["transformers"]).split(".")],
                             r["dtype"] != "float32"))
    return {"tool": f"codegen {__version__} bench (merged)", "runs": runs}


#: the README's copy of the results table sits between these lines (`merge --readme README.md` refreshes it)
README_START, README_END = "<!-- bench-table: generated by python -m codegen.bench merge --readme -->", "<!-- /bench-table -->"


def results_table(text: str) -> str:
    """The main table of `markdown()`'s output: its header row through its last row."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def splice_readme(path: Path, text: str) -> None:
    """Replace the README's results table (between README_START and README_END) with this one."""
    try:
        readme = path.read_text()
    except OSError as exc:
        raise IOFailure(f"cannot read {path}: {exc.strerror}") from None
    if README_START not in readme or README_END not in readme:
        raise BadInput(f"{path} has no results table to refresh: add the lines {README_START} and {README_END}")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    try:
        path.write_text(f"{head}{README_START}\n{results_table(text)}{README_END}{tail}")
    except OSError as exc:
        raise IOFailure(f"cannot write {path}: {exc.strerror}") from None


def write_outputs(record: dict, json_path: Path | None, md_path: Path | None, chart_path: Path | None,
                  readme_path: Path | None = None) -> str:
    table = markdown(record)
    try:
        if json_path is not None:
            json_path.write_text(json.dumps(record, indent=2) + "\n")
        if md_path is not None:
            md_path.write_text(table)
    except OSError as exc:
        raise IOFailure(f"cannot write the benchmark output: {exc.strerror}") from None
    if chart_path is not None:
        chart(record, chart_path)
    if readme_path is not None:
        splice_readme(readme_path, table)
    return table


# ---------------------------------------------------------------------------------------------------- CLI


def cmd_bench(args: argparse.Namespace) -> int:
    if args.tp < 2:
        raise BadInput("--tp must be at least 2 (the benchmark compares tensor-parallel runs)")
    merge_paths = getattr(args, "merge", None)
    if merge_paths:
        record = merge(list(merge_paths))
        print(write_outputs(record, args.json, args.markdown, args.chart), end="")
        return errors.OK
    check_runtime_installed("the benchmark")
    check_device(args.device, args.tp)
    if args.device == "cpu" and args.tp > (os.cpu_count() or 1) * 4:
        raise BadInput(f"--tp {args.tp} is far more ranks than this machine's {os.cpu_count()} cores")
    progress = Progress()
    kind = "smoke" if args.smoke else args.size
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    record = run_bench(kind, args.device, args.tp, args.workdir, progress, dtype=dtype)
    table = write_outputs(record, args.json, args.markdown, args.chart)
    print(table, end="")
    found = record["problems"]
    for p in found:
        print(f"FAIL {p}", file=sys.stderr)
    if found:
        raise VerifyFailed(f"{len(found)} benchmark check(s) failed (figures written anyway)")
    progress(f"done: {kind} benchmark, {len(record['rows'])} rows, wall {record['wall_s']:.0f}s")
    return errors.OK


def _merge_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.bench merge",
                                 description="combine `bench --json` records (one per environment) into one table/chart")
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--chart", type=Path)
    ap.add_argument("--readme", type=Path, help=f"refresh the table between {README_START} and {README_END}")
    args = ap.parse_args(argv)
    try:
        record = merge(args.inputs)
        print(write_outputs(record, args.json, args.markdown, args.chart, args.readme), end="")
    except CodegenError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return errors.OK


if __name__ == "__main__":
    if sys.argv[1:2] == ["merge"]:
        sys.exit(_merge_main(sys.argv[2:]))
    else:
        print("usage: python -m codegen.bench merge A.json [B.json ...] [--markdown T.md] [--chart C.png] "
              "(run the benchmark with `python -m codegen bench`)", file=sys.stderr)
        sys.exit(errors.BAD_INPUT)
