"""The one result schema of verify, bench and demo, and the summary of the ab phase both bench and demo show.

Every runtime command returns (and `--json` writes) one record:

    {"schema": SCHEMA, "tool": "codegen <version> <command>", "command", "kind", "device", "tp",
     "world_size", "dtype", "tolerance", "settings", "machine",
     "families": {family: entry}, "problems": [one line each], "ok": bool, "wall_s"}

`entry` holds the figures of that family's model dir: for verify the per-rank figures of each phase
({"dir", "no-policy": [...], "codegen": [...], "stock": [...]}), for the demo the ab phase summarised
over ranks (summarise_ab). The bench has several batches per family: it writes "rows" (one
summarise_ab entry per family and batch, with "family", "size", "batch", "dtype") instead of
"families". `problems` comes from codegen.harness.checks; `ok` is `not problems`.

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
from codegen.harness import limits as machine_limits

SCHEMA = "codegen-result/1"
#: the b/a ratios of an ab entry (None each where stock crashed or a is 0)
RATIOS = ("allreduce_prefill", "allreduce_decode_step", "decode_median", "prefill_median", "expert_bytes", "rest_bytes",
          "e2e_median", "ttft_median")


def record(command: str, kind: str, *, device: str, tp: int, world_size: int, dtype: str, tolerance: float | None,
           settings: dict, families: dict | None, problems: list[str], wall_s: float, **extra) -> dict:
    """The record; `families` None leaves the key out (the bench writes "rows" instead)."""
    out = {
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
    if families is None:
        del out["families"]
    return out


#: the CPU features that decide which kernels run (vLLM's shared-memory all-reduce and bf16 paths, oneDNN's):
#: recorded with every run, since rows of different machines do not compare
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


def machine_info(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = [f for f in line.split(":", 1)[1].split() if f in CPU_FLAGS]
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
        "cpu_flags": flags,
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


def _quartiles(values: list[float]) -> tuple[float, float]:
    """(p25, p75), interpolated between the closest ranks (numpy's default), for any number of values."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    p25, _, p75 = statistics.quantiles(values, n=4, method="inclusive")
    return p25, p75


def spread(values: list[float]) -> dict:
    p25, p75 = _quartiles(values)
    return {
        "n": len(values),
        "median": statistics.median(values) if values else float("nan"),
        "p25": p25,
        "p75": p75,
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


#: how a peer's decode step is timed: its engine's steps themselves, or (records before them) derived
PEER_STEPS_TIMED = "the engine's steps once every sequence has its first token (inter-token latency)"
PEER_STEPS_DERIVED = "(e2e - ttft) / (new_tokens - 1)"


def peer_figures(raw: dict, batch: int) -> dict:
    """A peer engine's per-batch figures (its runner's flat timings) in the shape of a bench setup's, so every
    reader takes (v) as it takes (b) or (e): `decode` (vLLM: the median of its timed engine steps, each with its
    scheduling and sampling, where the runner timed them; else (end to end - TTFT) / (new tokens - 1), which the
    prefill's spread moves) and `e2e` with `total`, `ttft` and `tokens_per_s`."""
    if raw.get("crashed"):
        return {"crashed": raw["crashed"]}
    totals, ttfts, new = raw["e2e_s"], raw["ttft_s"], raw["new_tokens"]
    e2e, ttft = spread(totals), spread(ttfts)
    derived = (e2e["median"] - ttft["median"]) / (new - 1) if new > 1 else None
    if raw.get("step_s"):
        decode = {**spread(raw["step_s"]), "derived_from": PEER_STEPS_TIMED, "e2e_minus_ttft": derived}
    else:
        decode = {"median": derived, "derived_from": PEER_STEPS_DERIVED}
    step = decode["median"]
    return {"load_s": raw.get("load_s"), "decode": decode,
            "decode_tokens_per_s": batch / step if step else None,
            "e2e": {"new_tokens": new, "total": e2e, "ttft": ttft,
                    "tokens_per_s": batch * new / e2e["median"] if e2e["median"] else None}}


def crashed(figures: dict | list) -> str | None:
    """The crash line of a phase's figures (one dict, or one per rank), None where it ran."""
    for r in figures if isinstance(figures, list) else [figures]:
        if isinstance(r, dict) and r.get("crashed"):
            return r["crashed"]
    return None


def _setup_figures(rs: list[dict], batch: int, prompt_len: int, limits: list[dict | None]) -> dict:
    """One setup's figures over its ranks: counts from rank 0 (checked equal on all), times the slowest rank's;
    `limits`: each rank's machine limits, for the floor (codegen.harness.limits)."""
    m = rs[0]
    keys = ("prefill_allreduce", "decode_allreduce", "prefill_allreduce_per_moe_block", "decode_allreduce_per_moe_block",
            "prefill_gathers", "decode_gathers", "prefill_gathers_per_moe_block", "decode_gathers_per_moe_block")
    counts_agree = all(r.get(k) == m.get(k) for r in rs for k in keys)
    decode_blocks = [c for step in m["decode_allreduce_per_moe_block"] for c in step]
    decode_gathers = [c for step in m.get("decode_gathers_per_moe_block", []) for c in step]
    prefill, decode = spread(_slowest([r["prefill_s"] for r in rs])), spread(_slowest([r["decode_s"] for r in rs]))
    figures = {
        "allreduce_prefill": m["prefill_allreduce"],
        "allreduce_prefill_per_moe_layer": m["prefill_allreduce_per_moe_block"],
        "allreduce_prefill_per_moe_layer_mean": _mean(m["prefill_allreduce_per_moe_block"]),
        "allreduce_decode_step": spread([float(c) for c in m["decode_allreduce"]]),
        "allreduce_decode_per_moe_layer_mean": _mean(decode_blocks),
        "allreduce_decode_per_moe_layer_min": min(decode_blocks, default=0),
        "allreduce_decode_per_moe_layer_max": max(decode_blocks, default=0),
        "gathers_prefill": m.get("prefill_gathers", 0),
        "gathers_prefill_per_moe_layer_mean": _mean(m.get("prefill_gathers_per_moe_block", [])),
        "gathers_decode_step": spread([float(c) for c in m.get("decode_gathers", [])]),
        "gathers_decode_per_moe_layer_mean": _mean(decode_gathers),
        "counts_same_on_all_ranks": counts_agree,
        "prefill": prefill,
        "decode": decode,
        "decode_tokens_per_s": batch / decode["median"] if decode["median"] else None,
        "prefill_tokens_per_s": batch * prompt_len / prefill["median"] if prefill["median"] else None,
        "param_bytes_per_rank": {part: max(r["bytes"][part] for r in rs) for part in ("experts", "rest", "total")},
        "maxdiff_prefill": max(r["prefill_maxdiff"] for r in rs),
        "maxdiff_decode": max(r["decode_maxdiff"] for r in rs),
        "relative_prefill": max(r.get("prefill_relative", 0.0) for r in rs),
        "relative_decode": max(r.get("decode_relative", 0.0) for r in rs),
        "load_s": max(r.get("load_s", 0.0) for r in rs),
    }
    if m.get("e2e_s"):  # end to end: `generate()` from the prompt to e2e_tokens new tokens, the slowest rank
        e2e, ttft = spread(_slowest([r["e2e_s"] for r in rs])), spread(_slowest([r["ttft_s"] for r in rs]))
        figures["e2e"] = {"new_tokens": m["e2e_tokens"], "total": e2e, "ttft": ttft,
                          "tokens_per_s": batch * m["e2e_tokens"] / e2e["median"] if e2e["median"] else None}
    total = sum(r.get("tokens_total", 0) for r in rs[:1])
    figures["token_agreement"] = rs[0]["tokens_agree"] / total if total else None
    if m.get("note"):
        figures["note"] = m["note"]
    if m.get("pooled_rounds"):  # (f) of a run in rounds: its times are over every round (codegen.harness.abrun)
        figures["pooled_rounds"] = m["pooled_rounds"]
    if m.get("compile"):  # (f): what compiling cost, cold and from inductor's on-disk cache, the slowest rank
        warm = [r["compile"]["warm_s"] for r in rs]
        figures["compile"] = {"cold_s": max(r["compile"]["cold_s"] for r in rs),
                              "warm_s": None if None in warm else max(warm), "graphs": m["compile"]["graphs"],
                              "recaptured_while_timed": (m["graphs_after_run"] - m["compile"]["graphs_after_compile"]
                                                         if m.get("graphs_after_run") is not None else None),
                              "graph_collectives": m["compile"]["graph_collectives"],
                              "graphs_per_forward": max(m.get("graphs_per_forward") or [0]) or None,
                              "fallback": m["compile"]["fallback"]}
    floor = _floor(rs, limits, figures)
    if floor is not None:
        figures["floor"] = floor
    return figures


def _floor(rs: list[dict], limits: list[dict | None], figures: dict) -> dict | None:
    """The setup's floor per phase beside its measured time, and floor / measured (`of_limit`); None where the
    ranks recorded no work or no limits (records older than the measurement)."""
    if not all(r.get("work") for r in rs):
        return None
    e2e = figures.get("e2e")
    floor = machine_limits.setup_floor([r["work"] for r in rs], limits, e2e["new_tokens"] if e2e else 0)
    if floor is None:
        return None
    measured = {"prefill": figures["prefill"]["median"], "decode": figures["decode"]["median"],
                "ttft": e2e["ttft"]["median"] if e2e else None, "e2e": e2e["total"]["median"] if e2e else None}
    floor["of_limit"] = {phase: machine_limits.of_limit(floor[phase]["s"], measured[phase])
                         for phase in measured if phase in floor}
    work = rs[0]["work"]
    floor["routing_seen"] = all(r["work"].get("routing_seen") for r in rs)
    if work.get("prefill_hits"):
        floor["experts_hit_per_moe_layer"] = {
            "prefill_mean": _mean(h["distinct"] for h in work["prefill_hits"]),
            "decode_mean": _mean(h["distinct"] for step in work["decode_hits"] if step for h in step)}
    return floor


def ratios(b: dict, other: dict) -> dict:
    """b over another setup, per figure (None each where that setup crashed or a figure is 0)."""
    if crashed(other) or crashed(b):
        return dict.fromkeys(RATIOS)
    return {
        "allreduce_prefill": _ratio(b["allreduce_prefill"], other["allreduce_prefill"]),
        "allreduce_decode_step": _ratio(b["allreduce_decode_step"]["median"], other["allreduce_decode_step"]["median"]),
        "decode_median": _ratio(b["decode"]["median"], other["decode"]["median"]),
        "prefill_median": _ratio(b["prefill"]["median"], other["prefill"]["median"]),
        "expert_bytes": _ratio(b["param_bytes_per_rank"]["experts"], other["param_bytes_per_rank"]["experts"]),
        "rest_bytes": _ratio(b["param_bytes_per_rank"]["rest"], other["param_bytes_per_rank"]["rest"]),
        "e2e_median": _ratio(b["e2e"]["total"]["median"], other["e2e"]["total"]["median"])
        if "e2e" in b and "e2e" in other else None,
        "ttft_median": _ratio(b["e2e"]["ttft"]["median"], other["e2e"]["ttft"]["median"])
        if "e2e" in b and "e2e" in other else None,
    }


def summarise_ab(per_rank: list[dict], shape: dict) -> dict:
    """One family's ab-phase figures of every rank (codegen.harness.worker.main.measure_ab) as one entry.

    entry[mode] for each setup that was asked for (stock, codegen, native): its figures, or
    {"mode", "crashed"}; ratio_b_over_a (and ratio_b_over_d with native) compare codegen with it.
    """
    first = per_rank[0]
    batch, prompt_len = first.get("batch", 1), first.get("prompt_len", 0)
    reference = first["reference"]
    entry = {
        "shape": shape,
        "batch": batch,
        "prompt_len": prompt_len,
        "dtype": first.get("dtype", "float32"),
        "num_layers": first["num_layers"],
        "moe_layers": next(first[m]["moe_blocks"] for m in ("codegen", "single") if "moe_blocks" in first.get(m, {})),
        "load_peak_bytes": first["full_bytes"],
        "rss_peak_bytes_per_rank": max((r.get("rss_peak_bytes") or 0) for r in per_rank) or None,
        "reference": {
            "prefill": spread(_slowest([r["reference"]["prefill_s"] for r in per_rank])),
            "decode": spread(_slowest([r["reference"]["decode_s"] for r in per_rank])),
            "single_process_error": reference.get("baseline"),
        },
    }
    for mode in ("stock", "codegen", "compiled", "native", "single"):
        if mode not in first:
            continue
        rs = [r[mode] for r in per_rank]
        entry[mode] = {"mode": mode, "crashed": crashed(rs)} if crashed(rs) else _setup_figures(
            rs, batch, prompt_len, [r.get("limits") for r in per_rank])
    if "stock" in entry and "codegen" in entry:
        entry["ratio_b_over_a"] = ratios(entry["codegen"], entry["stock"])
    if "compiled" in entry and "codegen" in entry:
        entry["ratio_f_over_b"] = ratios(entry["compiled"], entry["codegen"])
    if "native" in entry and "codegen" in entry:
        entry["ratio_b_over_d"] = ratios(entry["codegen"], entry["native"])
    return entry
