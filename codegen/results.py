"""The one result schema of verify, bench and demo, and the summary of the ab phase both bench and demo show.

Every runtime command returns (and `--json` writes) one record:

    {"schema": SCHEMA, "tool": "codegen <version> <command>", "command", "kind", "device", "tp",
     "world_size", "dtype", "tolerance", "settings", "machine",
     "families": {family: entry}, "problems": [one line each], "ok": bool, "wall_s"}

`entry` holds the figures of that family's model dir: for verify the per-rank figures of each phase
({"dir", "no-policy": [...], "codegen": [...], "stock": [...]}), for bench and demo the ab phase
summarised over ranks (summarise_ab). `problems` comes from codegen.checks; `ok` is `not problems`.

Stock AutoTP is a comparison, never pass/fail: where it crashed, its figures are
{"mode": "stock", "crashed": "<ExceptionType>: <first line>"} (per rank in verify, once in the ab
summary) and every b/a ratio is None.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

from codegen import __version__

SCHEMA = "codegen-result/1"
#: the b/a ratios of an ab entry (None each where stock crashed or a is 0)
RATIOS = ("allreduce_prefill", "allreduce_decode_step", "decode_median", "prefill_median", "expert_bytes", "rest_bytes")


def record(command: str, kind: str, *, device: str, tp: int, world_size: int, dtype: str, tolerance: float | None,
           settings: dict, families: dict, problems: list[str], wall_s: float, **extra) -> dict:
    return {
        "schema": SCHEMA,
        "tool": f"codegen {__version__} {command}",
        "command": command,
        "kind": kind,
        "device": device,
        "tp": tp,
        "world_size": world_size,
        "dtype": dtype,
        "tolerance": tolerance,
        "settings": settings,
        "machine": machine_info(device),
        **extra,
        "families": families,
        "problems": problems,
        "ok": not problems,
        "wall_s": wall_s,
    }


def machine_info(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": ver("torch"),
        "deepspeed": ver("deepspeed"),
        "transformers": ver("transformers"),
        "device": device,
    }


# ------------------------------------------------------------------------------- the ab phase, summarised


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def spread(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median": statistics.median(values) if values else float("nan"),
        "p25": _quantile(values, 0.25),
        "p75": _quantile(values, 0.75),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def _slowest(ranks: list[list[float]]) -> list[float]:
    """Per timed unit, the slowest rank: a TP step is done when every rank is."""
    return [max(column) for column in zip(*ranks)]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _ratio(b: float, a: float) -> float | None:
    return b / a if a else None


def crashed(figures: dict | list) -> str | None:
    """The crash line of a phase's figures (one dict, or one per rank), None where it ran."""
    for r in figures if isinstance(figures, list) else [figures]:
        if isinstance(r, dict) and r.get("crashed"):
            return r["crashed"]
    return None


def summarise_ab(per_rank: list[dict], shape: dict) -> dict:
    """One family's ab-phase figures of every rank (codegen.tp_worker.measure_ab) as one entry."""
    first = per_rank[0]
    entry = {
        "shape": shape,
        "num_layers": first["num_layers"],
        "moe_layers": first["codegen"]["moe_blocks"],
        "load_peak_bytes": first["full_bytes"],
        "reference": {
            "prefill": spread(_slowest([r["reference"]["prefill_s"] for r in per_rank])),
            "decode": spread(_slowest([r["reference"]["decode_s"] for r in per_rank])),
        },
    }
    for mode in ("stock", "codegen"):
        rs = [r[mode] for r in per_rank]
        if mode == "stock" and crashed(rs):
            entry[mode] = {"mode": mode, "crashed": crashed(rs)}
            continue
        m = rs[0]
        counts_agree = all(
            r["prefill_allreduce"] == m["prefill_allreduce"] and r["decode_allreduce"] == m["decode_allreduce"]
            and r["prefill_allreduce_per_moe_block"] == m["prefill_allreduce_per_moe_block"]
            and r["decode_allreduce_per_moe_block"] == m["decode_allreduce_per_moe_block"]
            for r in rs
        )
        decode_blocks = [c for step in m["decode_allreduce_per_moe_block"] for c in step]
        entry[mode] = {
            "allreduce_prefill": m["prefill_allreduce"],
            "allreduce_prefill_per_moe_layer": m["prefill_allreduce_per_moe_block"],
            "allreduce_prefill_per_moe_layer_mean": _mean(m["prefill_allreduce_per_moe_block"]),
            "allreduce_decode_step": spread([float(c) for c in m["decode_allreduce"]]),
            "allreduce_decode_per_moe_layer_mean": _mean(decode_blocks),
            "allreduce_decode_per_moe_layer_min": min(decode_blocks, default=0),
            "allreduce_decode_per_moe_layer_max": max(decode_blocks, default=0),
            "counts_same_on_all_ranks": counts_agree,
            "prefill": spread(_slowest([r["prefill_s"] for r in rs])),
            "decode": spread(_slowest([r["decode_s"] for r in rs])),
            "param_bytes_per_rank": {part: max(r["bytes"][part] for r in rs) for part in ("experts", "rest", "total")},
            "maxdiff_prefill": max(r["prefill_maxdiff"] for r in rs),
            "maxdiff_decode": max(r["decode_maxdiff"] for r in rs),
        }
    a, b = entry["stock"], entry["codegen"]
    if crashed(a):
        entry["ratio_b_over_a"] = dict.fromkeys(RATIOS)
        return entry
    entry["ratio_b_over_a"] = {
        "allreduce_prefill": _ratio(b["allreduce_prefill"], a["allreduce_prefill"]),
        "allreduce_decode_step": _ratio(b["allreduce_decode_step"]["median"], a["allreduce_decode_step"]["median"]),
        "decode_median": _ratio(b["decode"]["median"], a["decode"]["median"]),
        "prefill_median": _ratio(b["prefill"]["median"], a["prefill"]["median"]),
        "expert_bytes": _ratio(b["param_bytes_per_rank"]["experts"], a["param_bytes_per_rank"]["experts"]),
        "rest_bytes": _ratio(b["param_bytes_per_rank"]["rest"], a["param_bytes_per_rank"]["rest"]),
    }
    return entry
