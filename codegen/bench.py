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

#: run sizes: `smoke` is the CI run (counts asserted, timings recorded but meaningless), `full` the recorded one
SETTINGS: dict[str, dict] = {
    "smoke": dict(size="tiny", prompt_len=128, batch=1, decode_steps=4, warmup=1, prefill_repeats=2,
                  patch_trials=1, timeout=600.0),
    "full": dict(size="bench", prompt_len=128, batch=1, decode_steps=128, warmup=8, prefill_repeats=16,
                 patch_trials=3, timeout=1500.0),
    # the demo: tiny dirs, counts and logits only
    "demo": dict(size="tiny", prompt_len=32, batch=1, decode_steps=2, warmup=1, prefill_repeats=1,
                 patch_trials=0, timeout=600.0),
}


def run_ab(kind: str, families: tuple[str, ...], tp: int, device: str, root: Path, progress: Progress,
           echo_patch: bool = False) -> tuple[dict, list[dict], dict]:
    """Build, patch and run the ab phase of every family in one launch: (entries, rank records, dirs)."""
    from codegen.examples import shape_of
    from codegen.runtime import launch, shm_op_cached

    settings = SETTINGS[kind]
    dirs = prepare_examples(families, settings["size"], root, progress, echo=echo_patch)
    dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cpu" and not shm_op_cached():
        progress("first run with this Python, torch and DeepSpeed: DeepSpeed JIT-compiles its CPU shared-memory "
                 "all-reduce (once, kept in codegen's cache dir; 1-3 minutes on 2 cores)")
    progress(f"starting {tp} {device.upper()} ranks; every timed step runs a and b back to back")
    ranks = launch(ab_spec(dirs, tp, device, dtype, settings), tp, settings["timeout"], progress, what="benchmark")
    entries = {f: summarise_ab([r["jobs"][f]["ab"] for r in ranks], shape_of(dirs[f]["unpatched"], f, settings["size"]))
               for f in families}
    return entries, ranks, dirs


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
              families: tuple[str, ...] = tuple(FAMILIES)) -> dict:
    settings = dict(SETTINGS[kind])
    dtype = "bfloat16" if device == "cuda" else "float32"
    started = time.monotonic()
    if workdir is not None:
        root = make_workdir(workdir, f"codegen-{kind}-")
        cleanup = None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix=f"codegen-{kind}-")
        root = Path(cleanup.name)
    try:
        compiled = device == "cpu" and not _shm_cached()
        load_start = _loadavg()
        entries, ranks, dirs = run_ab(kind, families, tp, device, root, progress)
        load_end = _loadavg()
        trials = {}
        if settings["patch_trials"]:
            for family in families:
                progress(f"{family}: `python -m codegen patch` (cold process) x {settings['patch_trials']}")
                trials[family] = time_cold_patch(dirs[family]["unpatched"], root / family / "patch-timing",
                                                 settings["patch_trials"])
        baseline = _startup_baseline(settings["patch_trials"]) if settings["patch_trials"] else None
        tolerance = TOLERANCE if dtype == "float32" else None
        found = [p for f, e in entries.items() for p in ab_problems(f, e, tolerance)]
        record = result_record(
            "bench", kind, device=device, tp=tp, world_size=tp, dtype=dtype, tolerance=tolerance,
            settings={k: v for k, v in settings.items() if k != "timeout"}, families=entries, problems=found,
            wall_s=time.monotonic() - started, method=METHOD, deepspeed_cpu_op_compiled_during_run=compiled,
            patch_timing={"startup_baseline_s": baseline, "families": trials,
                          "median_s": {f: statistics.median(t) for f, t in trials.items()}},
        )
        record["machine"].update({"loadavg_1min_before_ranks": load_start, "loadavg_1min_after_ranks": load_end},
                                 **({"gpu": ranks[0]["gpu"]} if "gpu" in ranks[0] else {}))
        if workdir is not None:
            record["workdir"] = str(root)
        return record
    finally:
        if cleanup is not None:
            cleanup.cleanup()


def _shm_cached() -> bool:
    from codegen.runtime import shm_op_cached

    return shm_op_cached()


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def problems(record: dict) -> list[str]:
    """What makes a bench run fail (codegen.checks.ab_problems of every family)."""
    return [p for f, e in record["families"].items() for p in ab_problems(f, e, record.get("tolerance", TOLERANCE))]


# ------------------------------------------------------------------------------------------------- outputs


def _label(family: str) -> str:
    known = FAMILIES.get(family)
    return known.bench_label if known is not None and known.bench_label else family


def _records(record_or_merged: dict) -> list[dict]:
    return record_or_merged.get("runs", [record_or_merged])


def _rows(records: list[dict]):
    for rec in records:
        for family, e in rec["families"].items():
            yield rec, family, e


def _fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}×"


class _Crash(float):
    """A stock figure that does not exist because stock AutoTP crashed: printed as `crash`, drawn as nothing."""

    def __new__(cls):
        return super().__new__(cls, "nan")

    def __getitem__(self, _key):
        return self

    def __format__(self, _spec: str) -> str:
        return "crash"


#: stands for (a)'s figures in the table and chart where stock crashed
_CRASHED = _Crash()


def _mb(n: float) -> str:
    return "crash" if isinstance(n, _Crash) else f"{n / 2**20:.1f}"


def _ms(s: dict) -> str:
    if isinstance(s, _Crash):
        return "crash"
    return f"{s['median'] * 1e3:.1f} [{s['p25'] * 1e3:.1f}–{s['p75'] * 1e3:.1f}]"


def _count(x: float) -> str:
    if isinstance(x, _Crash):
        return "crash"
    return f"{x:g}" if float(x).is_integer() else f"{x:.2f}"


def _diff(m) -> str:
    return "crash" if isinstance(m, _Crash) else f"{max(m['maxdiff_prefill'], m['maxdiff_decode']):.1e}"


def _figures(e: dict, mode: str):
    """A mode's figures of an ab entry; _CRASHED (nan wherever indexed) where stock crashed."""
    return _CRASHED if crashed(e[mode]) else e[mode]


def markdown(record_or_merged: dict) -> str:
    records = _records(record_or_merged)
    first = records[0]
    s = first["settings"]
    lines = [
        f"TP={first['tp']} on {first['device'].upper()} ({first['dtype']}); each cell is **(a) stock AutoTP → "
        f"(b) codegen (b/a)**; {s['prompt_len']}-token prefill, batch {s['batch']}; decode: {s['decode_steps']} timed "
        f"steps after {s['warmup']} warm-up; latency = slowest rank, median [p25–p75] in ms.",
        "",
        "| model | transformers | all-reduces / prefill | per MoE layer (prefill) | all-reduces / decode step "
        "| per MoE layer (decode) | decode step ms | prefill ms | expert MiB / rank | other MiB / rank "
        "| max abs Δlogits vs (c): a, b |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    crashes = []
    for rec, family, e in _rows(records):
        a, b, r = e["stock"], e["codegen"], e["ratio_b_over_a"]
        if crashed(a):
            crashes.append(f"- {family}, transformers {rec['machine']['transformers']}: stock AutoTP crashed "
                           f"({crashed(a)}); (a) is shown as crash, (b) ran alone")
            a = _CRASHED
        ab, bb = a["param_bytes_per_rank"], b["param_bytes_per_rank"]
        lines.append(
            f"| {family} ({_label(family)}) | {rec['machine']['transformers']} "
            f"| {a['allreduce_prefill']} → {b['allreduce_prefill']} ({_fmt_ratio(r['allreduce_prefill'])}) "
            f"| {_count(a['allreduce_prefill_per_moe_layer_mean'])} → {_count(b['allreduce_prefill_per_moe_layer_mean'])} "
            f"| {_count(a['allreduce_decode_step']['median'])} → {_count(b['allreduce_decode_step']['median'])} "
            f"({_fmt_ratio(r['allreduce_decode_step'])}) "
            f"| {_count(a['allreduce_decode_per_moe_layer_mean'])} → {_count(b['allreduce_decode_per_moe_layer_mean'])} "
            f"| {_ms(a['decode'])} → {_ms(b['decode'])} ({_fmt_ratio(r['decode_median'])}) "
            f"| {_ms(a['prefill'])} → {_ms(b['prefill'])} ({_fmt_ratio(r['prefill_median'])}) "
            f"| {_mb(ab['experts'])} → {_mb(bb['experts'])} ({_fmt_ratio(r['expert_bytes'])}) "
            f"| {_mb(ab['rest'])} → {_mb(bb['rest'])} ({_fmt_ratio(r['rest_bytes'])}) "
            f"| {_diff(a)}, {_diff(b)} |"
        )
    if crashes:
        lines += ["", "Stock AutoTP crashed (no (a) figures; ratios –):", ""] + crashes
    lines += [
        "",
        "`python -m codegen patch DIR`: wall time of a cold process, median of n trials; start-up = "
        "`python -m codegen --version` (interpreter + CLI import) in the same environment:",
        "",
        "| model | transformers | patch wall s |",
        "|---|---|---|",
    ]
    for rec in records:
        pt = rec["patch_timing"]
        base = pt.get("startup_baseline_s")
        for family, med in pt["median_s"].items():
            n = len(pt["families"][family])
            lines.append(f"| {family} | {rec['machine']['transformers']} | {med:.2f} (n={n}"
                         + (f"; start-up {base:.2f})" if base is not None else ")") + " |")
    lines += ["", "Machines:", ""] + [f"- {_machine_line(rec)}" for rec in records]
    return "\n".join(lines) + "\n"


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
    rows = list(_rows(_records(record_or_merged)))
    labels = [f"{family}\ntf {rec['machine']['transformers']}" for rec, family, _ in rows]
    x = list(range(len(rows)))
    w = 0.2
    fig, grid = plt.subplots(2, 2, figsize=(max(11, 2.8 * len(rows) + 3), 8.6))
    axes = grid.flatten()
    colours = {"stock": "#c44e52", "codegen": "#4c72b0"}
    names = {"stock": "(a) stock AutoTP", "codegen": "(b) codegen"}

    ax = axes[0]
    for j, (mode, phase, key, hatch) in enumerate([
        ("stock", "prefill", "allreduce_prefill_per_moe_layer_mean", ""),
        ("codegen", "prefill", "allreduce_prefill_per_moe_layer_mean", ""),
        ("stock", "decode", "allreduce_decode_per_moe_layer_mean", "//"),
        ("codegen", "decode", "allreduce_decode_per_moe_layer_mean", "//"),
    ]):
        values = [_figures(e, mode)[key] for _, _, e in rows]
        bars = ax.bar([i + (j - 1.5) * w for i in x], values, w, color=colours[mode], hatch=hatch,
                      edgecolor="white", label=f"{names[mode]}, {phase}")
        ax.bar_label(bars, labels=[_count(v) for v in values], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.5, None)
    ax.set_title("all-reduces per MoE layer (log scale)", fontsize=10)
    ax.legend(fontsize=7)

    for ax, phase, title in ((axes[1], "decode", "decode step latency (ms)"), (axes[2], "prefill", "prefill latency (ms)")):
        for j, mode in enumerate(("stock", "codegen")):
            med = [_figures(e, mode)[phase]["median"] * 1e3 for _, _, e in rows]
            lo = [m - _figures(e, mode)[phase]["p25"] * 1e3 for m, (_, _, e) in zip(med, rows)]
            hi = [_figures(e, mode)[phase]["p75"] * 1e3 - m for m, (_, _, e) in zip(med, rows)]
            ax.bar([i + (j - 0.5) * 2 * w for i in x], med, 2 * w, yerr=[lo, hi], capsize=3, color=colours[mode],
                   label=names[mode])
        ax.set_title(title + ", median, p25–p75", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[3]
    for j, mode in enumerate(("stock", "codegen")):
        for k, (part, hatch) in enumerate((("experts", ""), ("rest", "//"))):
            values = [_figures(e, mode)["param_bytes_per_rank"][part] / 2**20 for _, _, e in rows]
            bottom = None if k == 0 else [_figures(e, mode)["param_bytes_per_rank"]["experts"] / 2**20 for _, _, e in rows]
            ax.bar([i + (j - 0.5) * 2 * w for i in x], values, 2 * w, bottom=bottom, color=colours[mode], hatch=hatch,
                   edgecolor="white", label=f"{names[mode]}, {part}")
    ax.set_title("parameter MiB per rank (experts / rest)", fontsize=10)
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=8)
    first = _records(record_or_merged)[0]
    fig.suptitle(f"codegen bench: TP={first['tp']} on {first['device'].upper()}, {first['machine']['cpu']}, "
                 f"{first['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
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
        if not isinstance(data, dict) or not ("families" in data or "runs" in data):
            raise BadInput(f"{path} is not a `bench --json` record")
        runs += _records(data)
    runs.sort(key=lambda r: [int(p) if p.isdigit() else 0 for p in str(r["machine"]["transformers"]).split(".")])
    return {"tool": f"codegen {__version__} bench (merged)", "runs": runs}


def write_outputs(record: dict, json_path: Path | None, md_path: Path | None, chart_path: Path | None) -> str:
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
    kind = "smoke" if args.smoke else "full"
    record = run_bench(kind, args.device, args.tp, args.workdir, progress)
    table = write_outputs(record, args.json, args.markdown, args.chart)
    print(table, end="")
    found = record["problems"]
    for p in found:
        print(f"FAIL {p}", file=sys.stderr)
    if found:
        raise VerifyFailed(f"{len(found)} benchmark check(s) failed (figures written anyway)")
    progress(f"done: {kind} benchmark, {len(record['families'])} families, wall {record['wall_s']:.0f}s")
    return errors.OK


def _merge_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.bench merge",
                                 description="combine `bench --json` records (one per environment) into one table/chart")
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--chart", type=Path)
    args = ap.parse_args(argv)
    try:
        record = merge(args.inputs)
        print(write_outputs(record, args.json, args.markdown, args.chart), end="")
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
