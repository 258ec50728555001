"""The bench's outputs: the markdown table (a / b / d cells per row), the chart, merging runs of several
environments, and the generated results sections of the docs: the full table in docs/results.md, a few rows in the
README (`bench --merge ... --readme README.md docs/results.md`, spliced by codegen.splice)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from codegen import __version__, splice, versions
from codegen.errors import BadInput, IOFailure
from codegen.harness.abrun import NOT_RUN_FAILED, NOT_RUN_MEMORY, label, size_name
from codegen.harness.results import crashed

#: the main table's cell for a row not run, by its cause (the notes give the reason)
NOT_RUN_CELL = {NOT_RUN_MEMORY: "does not fit in memory", NOT_RUN_FAILED: "its ranks failed"}


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
SETUP_ORDER = (("stock", "a"), ("codegen", "b"), ("compiled", "f"), ("native", "d"), ("single", "e"))
#: codegen's two setups: eager (b) and compiled (f)
CODEGEN_SETUPS = ("codegen", "compiled")
#: what the end-to-end columns hold besides: a peer engine's record (`bench --peer vllm --json`), as (v)
PEER = "vllm"


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


def _e2e_cells(row: dict, fmt) -> str:
    """`a / b / d / e / v` of an end-to-end figure (`v`: the peer engine, where a peer record was merged)."""
    out = []
    for mode, _ in (*SETUP_ORDER, (PEER, "v")):
        figures = row.get(mode)
        if mode == PEER and figures is None:
            continue
        out.append("crash" if figures is not None and crashed(figures) else
                   "–" if figures is None or "e2e" not in figures else fmt(figures["e2e"]))
    return " / ".join(out)


def _time(figures: dict, phase: str) -> float | None:
    """A setup's (or the peer's) median time of one phase: `decode` step, `prefill`, `e2e` (generate to N tokens)."""
    if phase == "e2e":
        return figures.get("e2e", {}).get("total", {}).get("median")
    return figures.get(phase, {}).get("median")


def _over(b: float | None, other: float | None) -> str:
    return _fmt_ratio(b / other if b and other else None)


def _b_over(row: dict, mode: str, base: str = "codegen") -> str:
    """b (or f: `base`) / another setup or the peer: decode step time, end-to-end time (< 1: codegen faster)."""
    b, other = _present(row, base), _present(row, mode)
    if b is None or other is None:
        return "–"
    return f"{_over(_time(b, 'decode'), _time(other, 'decode'))}, {_over(_time(b, 'e2e'), _time(other, 'e2e'))}"


#: what a limit figure shows where the record has none (recorded before the bench measured the machine's limits)
NO_LIMIT = "—"


def _pct(share: float | None) -> str:
    if share is None:
        return NO_LIMIT
    return f"{share:.0%}" if share >= 0.095 else f"{share:.1%}"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _of_limit(figures: dict, phase: str) -> str:
    """floor / measured time of one phase (codegen.harness.limits), as a percentage; NO_LIMIT where not recorded."""
    return _pct((figures.get("floor") or {}).get("of_limit", {}).get(phase))


def _limits_line(rec: dict) -> str:
    """The machine limits a run measured, for its line under the table."""
    limits = rec.get("machine_limits")
    if not limits or not (limits.get("tp") or {}).get("read_gb_s"):
        return f"machine limits {NO_LIMIT} (not measured in this record)"

    def one(part: dict, who: str) -> str:
        first = part["per_rank"][0]
        return (f"{who}: read {part['read_gb_s']:.1f} GB/s, copy {part['copy_gb_s']:.1f} GB/s, {first['dtype']} GEMM "
                f"{part['gemm_gflop_s']:.1f} GFLOP/s (n={first['gemm_n']}, {first['threads']} thread"
                f"{'s' if first['threads'] != 1 else ''}, {first['buffer_bytes'] / 2**20:.0f} MiB buffer)")

    tp = limits["tp"]
    text = "machine limits, measured in the run: " + one(tp, f"per rank, {tp['ranks']} at once" + (
        f", lowest of {tp['launches']} launches" if tp.get("launches", 1) > 1 else ""))
    if (limits.get("single") or {}).get("read_gb_s"):
        text += "; " + one(limits["single"], "one process")
    return text


#: the heading of the list of cells where another setup beat codegen (docs/results.md carries it under the table)
NOT_FASTEST = "Where codegen is not fastest"


def not_fastest(records: list[dict], base: str = "codegen") -> list[str]:
    """Every row and setup whose time is shorter than codegen's (`base`: (b), or (f) compiled; b/x above 1.00× as
    printed), one line per row: the closing note and docs/results.md name these cells, so they are listed from the
    records, not by hand."""
    lines = []
    for rec, row in _rows(records):
        b = _present(row, base)
        if b is None or row.get("not_run"):
            continue
        found = []
        for mode, letter in (*SETUP_ORDER, (PEER, "v")):
            other = _present(row, mode) if mode not in CODEGEN_SETUPS else None
            if other is None:
                continue
            # the bench's own ratio where it has one (a setup timed in another group than (b)'s main one is
            # compared with the (b) run beside it), else the two medians (the peer)
            recorded = (row.get(f"ratio_b_over_{letter}") or {}) if base == "codegen" else {}
            worse = []
            for phase, name in (("decode", "decode"), ("prefill", "prefill"), ("e2e", "end to end")):
                mine, theirs = _time(b, phase), _time(other, phase)
                ratio = recorded.get(f"{phase}_median", mine / theirs if mine and theirs else None)
                if ratio is not None and round(ratio, 2) > 1.0:
                    worse.append(f"{name} {ratio:.2f}×")
            if worse:
                found.append(f"({letter}) " + ", ".join(worse))
        if found:
            lines.append(f"- {label(row['family'])}, {size_name(row['size'])}, transformers "
                         f"{rec['machine']['transformers']}, {row['dtype']}, batch {row['batch']}: " + "; ".join(found))
    return lines


def markdown(record_or_merged: dict) -> str:
    records = _records(record_or_merged)
    first = records[0]
    peers = any(PEER in row for _, row in _rows(records))
    lines = [
        f"TP={first['tp']} on {first['device'].upper()}; (a) stock DeepSpeed AutoTP, (b) codegen, (f) codegen "
        "compiled (`init_inference(..., compile=True)`, (b)'s model, its forward compiled), (d) transformers "
        "native TP (`tp_plan=\"auto\"`), (e) the unpatched model in one process on all the ranks' cores together, "
        "each cell **a / b / f / d / e** (`–` where a record predates (f))"
        + (" (end to end: **a / b / f / d / e / v**, (v) vLLM's CPU engine at the same TP)" if peers else "")
        + "; latency = slowest rank, median; decode "
        "teacher-forced with the float32 single-process model's greedy tokens; `crash` = that setup failed to load "
        "or run (below), `–` = not run. Collectives: all-reduces, `+Ng` = N other collectives (all-gathers). "
        "Numerics: float32 rows max |Δlogits| vs the float32 single process (c); bfloat16 rows the relative error "
        "max|Δ|/max|logits| vs (c) and the share of decode steps whose greedy token matches (c)'s. End to end: "
        "`generate()` from the prompt to N greedy new tokens (EOS ignored), tokens/s = batch × N / wall time, TTFT = "
        "time to first token; b/x = codegen's time over x's (decode step, end to end; < 1: codegen faster). "
        "% of limit = floor / measured time, the floor = max(bytes read / memory bandwidth, FLOPs / GEMM throughput) "
        "of the slowest rank for that forward (its weights and the experts its routing hit), at the limits measured "
        f"on the same ranks in the same run (docs/benchmark.md); `{NO_LIMIT}` = the record predates the measurement.",
        "",
        "| model | transformers | dtype | batch | collectives / MoE layer (decode) | collectives / decode step "
        "| decode ms | decode tokens/s | prefill ms | expert MiB / rank | numerics | end-to-end tokens/s | TTFT ms "
        "| % of limit: decode | % of limit: prefill | % of limit: e2e "
        "| b/a decode, prefill | b/d decode, prefill | b/e decode, e2e | f/b decode, e2e"
        + (" | b/v decode, e2e | f/v decode, e2e |" if peers else " |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if peers else ""),
    ]
    notes: dict[str, list[str]] = {}  # one line per finding, naming the rows it holds for
    for rec, row in _rows(records):
        tf = rec["machine"]["transformers"]
        where = f"{size_name(row['size'])} {row['dtype']} batch {row['batch']}"
        if row.get("not_run"):
            notes.setdefault(f"{row['family']} ({size_name(row['size'])} widths, transformers {tf}): not run: "
                             f"{row['not_run']}", []).append(where)
            lines.append(f"| {row['family']} ({label(row['family'])}, {size_name(row['size'])}) | {tf} | {row['dtype']} "
                         f"| {row['batch']} | not run: {NOT_RUN_CELL[row.get('not_run_cause', NOT_RUN_MEMORY)]} (notes) |" + " |" * (15 + 2 * peers))
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
            f"| {row['family']} ({label(row['family'])}, {size_name(row['size'])}) | {tf} | {row['dtype']} "
            f"| {row['batch']} | {_cells(row, _per_layer)} | {_cells(row, _per_step)} "
            f"| {_cells(row, lambda f: format(f['decode']['median'] * 1e3, '.1f'))} "
            f"| {_cells(row, lambda f: format(f['decode_tokens_per_s'], '.1f'))} "
            f"| {_cells(row, lambda f: format(f['prefill']['median'] * 1e3, '.0f'))} "
            f"| {_cells(row, lambda f: _mb(f['param_bytes_per_rank']['experts']))} "
            f"| {_cells(row, lambda f: _numerics(f, row['dtype']))}{_unsharded(row)} "
            f"| {_e2e_cells(row, lambda e: format(e['tokens_per_s'], '.1f'))} "
            f"| {_e2e_cells(row, lambda e: format(e['ttft']['median'] * 1e3, '.0f'))} "
            f"| {_cells(row, lambda f: _of_limit(f, 'decode'))} | {_cells(row, lambda f: _of_limit(f, 'prefill'))} "
            f"| {_cells(row, lambda f: _of_limit(f, 'e2e'))} "
            f"| {_ratio_cell(row, 'ratio_b_over_a')} | {_ratio_cell(row, 'ratio_b_over_d')} | {_b_over(row, 'single')} "
            f"| {_b_over(row, 'codegen', 'compiled')} |"
            + (f" {_b_over(row, PEER)} | {_b_over(row, PEER, 'compiled')} |" if peers else "")
        )
    slower = not_fastest(records)
    lines += ["", f"{NOT_FASTEST} (b/x > 1.00×: setup x took less time than codegen; the reasons: "
              "docs/benchmark.md):", ""] + (slower or ["- none"])
    compiled_rows = [(rec, row) for rec, row in _rows(records) if _present(row, "compiled")]
    if compiled_rows:
        lines += ["", f"{NOT_FASTEST}, compiled (f/x > 1.00×):", ""] + (not_fastest(records, "compiled") or ["- none"])
        lines += ["", "Compile cost of (f), seconds, slowest rank: cold = an empty inductor cache (the first prefill, "
                  "two decode steps and a short `generate`: every shape kind the bench runs), warm = the same again "
                  "with torch.compile's in-memory state dropped and inductor's on-disk cache kept (a new process); "
                  "graphs = the graphs captured cold; recaptured = graphs captured after that, while the bench timed "
                  "(0: no recompilation per call); per forward = the graphs one counted forward ran (1: the forward "
                  "captured whole; `–` with the reason where it could not be and (f) ran eager):", "",
                  "| model | transformers | dtype | batch | cold s | warm s | graphs | recaptured | per forward |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for rec, row in compiled_rows:
            c = row["compiled"].get("compile") or {}
            lines.append(f"| {row['family']} ({label(row['family'])}, {size_name(row['size'])}) "
                         f"| {rec['machine']['transformers']} | {row['dtype']} | {row['batch']} "
                         f"| {c.get('cold_s', 0):.1f} | {_seconds(c.get('warm_s'))} | {c.get('graphs', '–')} "
                         f"| {c.get('recaptured_while_timed', '–')} "
                         f"| {c.get('graphs_per_forward') or '–'}{' (fell back to eager: ' + c['fallback'] + ')' if c.get('fallback') else ''} |")
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
    lines += [f"- (v) vLLM {p.get('peer_version')} ({size_name(p['settings']['size'])} widths), {p['dtype']}: "
              f"{_machine_line(p)}; {_limits_line(p)}; "
              + ("run paired with the bench (each family's vLLM run right after its bench launch"
                 + (f"; {p['paired']['rounds']} rounds alternating vLLM and (f), both pooled over them"
                    if p["paired"].get("rounds", 1) > 1 else "") + "); "
                 if p.get("paired") else "")
              + _peer_step_line(p)
              + ("joined to the bench rows above" if p.get("joined", True) else f"not joined: {p['not_joined']}")
              for p in record_or_merged.get("peers") or []]
    return "\n".join(lines) + "\n"


def _peer_step_line(peer: dict) -> str:
    """How the peer's decode step was timed (records before the engine's steps were timed derive it)."""
    methods = peer.get("decode_step_from") or []
    return f"decode step: {' and '.join(methods)}; " if methods else ""


def _run_line(rec: dict) -> str:
    s = rec["settings"]
    rounds = (rec.get("paired") or {}).get("rounds", 1)
    return (f"{rec['kind']} ({size_name(s['size'])} widths), {rec['dtype']}, batches {', '.join(map(str, s['batches']))}: "
            f"{s['prompt_len']}-token prompt per sequence, {s['warmup']} warm-up + {s['prefill_repeats']} timed "
            f"prefills, {s['warmup']} warm-up + {s['decode_steps']} timed decode steps"
            + (f" ((f): each of {rounds} rounds', pooled)" if rounds > 1 else "") + "; " + _machine_line(rec) + "; "
            + _limits_line(rec))


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
    flags = f" ({' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    return (f"transformers {m['transformers']}: {m['cpu']}{flags}, {m['cores']} cores, {ram}{gpu}, {m['os']}, "
            f"Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}; {'; '.join(notes)}")


def chart(record_or_merged: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--chart needs matplotlib: pip install matplotlib (or codegen[bench])") from None
    rows = [(rec, row) for rec, row in _rows(_records(record_or_merged)) if not row.get("not_run")]
    labels = [f"{row['family']} {size_name(row['size'])}, tf {rec['machine']['transformers']}, "
              f"{'bf16' if row['dtype'] == 'bfloat16' else 'fp32'}, batch {row['batch']}" for rec, row in rows]
    y = list(range(len(rows)))
    h = 0.16
    fig, axes = plt.subplots(1, 4, figsize=(20, 1.6 + 0.5 * len(rows)), sharey=True)
    colours = {"stock": "#c44e52", "codegen": "#4c72b0", "compiled": "#64b5cd", "native": "#55a868",
               "single": "#8172b2"}
    from codegen.harness.worker.run import LABELS as names  # the setups' labels, one definition

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
            ax.barh([i + (j - 2) * h for i in y], widths, h, color=colours[mode], label=names[mode])
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
    """Bench records of several environments as one; a peer engine's records (`bench --peer vllm --json`) join the
    rows of the same family, widths, dtype and batch under the latest transformers (what the peer runs beside),
    measured on the same machine (CPU and its flags): times from two machines do not compare."""
    runs, peers = [], []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise BadInput(f"{path}: {exc.strerror}") from None
        except ValueError:
            raise BadInput(f"{path} is not JSON: pass files written by `bench --json`") from None
        if not isinstance(data, dict) or not ("rows" in data or "runs" in data):
            raise BadInput(f"{path} is not a `bench --json` record of this codegen version (no rows): run it again")
        if data.get("peer") == PEER:
            peers.append(data)
            continue
        runs += _records(data)
    sizes = {"tiny": 0, "bench": 1, "full": 2}
    runs.sort(key=lambda r: (sizes.get(r["settings"]["size"], 3),
                             versions.parse(str(r["machine"]["transformers"])) or versions.Version("0"),
                             r["dtype"] != "float32"))
    joined = []
    newest = versions.newest(str(x["machine"]["transformers"]) for x in runs) if peers else None
    for peer in peers:
        kinds = {(row["size"], row["dtype"]) for row in peer["rows"]}
        latest = [r for r in runs if str(r["machine"]["transformers"]) == newest
                  and (r["settings"]["size"], r["dtype"]) in kinds]
        verdicts = [(r, _not_comparable(r, peer)) for r in latest]
        comparable = [r for r, why in verdicts if not why]
        # the reason of a record on the peer's own CPU first: that it differs from other CPUs' records says nothing
        reasons = sorted((not _same_machine(r, peer), why) for r, why in verdicts if why)
        why_not = reasons[0][1] if reasons else "no bench record of its run"
        for peer_row in peer["rows"]:
            for rec in comparable:
                for row in rec["rows"]:
                    if all(row.get(k) == peer_row.get(k) for k in ("family", "size", "dtype", "batch")):
                        row[PEER] = peer_row
        meta = {k: v for k, v in peer.items() if k != "rows"}
        meta["decode_step_from"] = sorted({(r.get("decode") or {}).get("derived_from") for r in peer["rows"]} - {None})
        joined.append({**meta, "joined": True} if comparable else {**meta, "joined": False, "not_joined": why_not})
    return {"tool": f"codegen {__version__} bench (merged)", "runs": runs, **({"peers": joined} if peers else {})}


def _same_machine(a: dict, b: dict) -> bool:
    return all(a["machine"].get(k) == b["machine"].get(k) for k in ("cpu", "cpu_flags", "cores"))


#: how far apart two records' machine limits (per-rank read bandwidth, GEMM throughput) may be and their times still
#: compare: machines of one CPU model and flags differ by more (measured: 26.4 and 16.8 GB/s per rank, two days apart)
LIMITS_TOLERANCE = 0.15


def _not_comparable(rec: dict, peer: dict) -> str | None:
    """Why a peer's times do not compare with a bench record's (None: they do): another CPU, or the same CPU model
    measuring other limits (a busier or slower machine). Records from before the limits were measured compare by
    CPU alone, and only with each other."""
    if not _same_machine(rec, peer):
        return f"another CPU ({peer['machine'].get('cpu')}, {' '.join(peer['machine'].get('cpu_flags') or [])})"
    ours, theirs = ((r.get("machine_limits") or {}).get("tp") or {} for r in (rec, peer))
    if not ours and not theirs:
        return None
    if not ours or not theirs:
        return "only one of the two records measured the machine's limits"
    for key, unit, what in (("read_gb_s", "GB/s", "memory read"), ("gemm_gflop_s", "GFLOP/s", "GEMM")):
        a, b = ours.get(key), theirs.get(key)
        if a and b and abs(a - b) > LIMITS_TOLERANCE * max(a, b):
            return f"the machine's limits differ: {what} {b:.1f} {unit} per rank beside the bench's {a:.1f}"
    return None


#: what regenerates the results sections of the docs
MERGE = "python -m codegen bench --merge docs/bench/*.json --readme README.md docs/results.md"
#: docs/results.md's copy of the results table and the cells where codegen is not fastest
TABLE_START, TABLE_END = splice.markers("bench-table", MERGE)
#: the README's few rows (`summary_table`)
SUMMARY_START, SUMMARY_END = splice.markers("bench-summary", MERGE)


def results_table(text: str) -> str:
    """The main table of `markdown()`'s output (its header row through its last row) and the list of cells where
    codegen is not fastest."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    listed = next(i for i in range(end, len(lines)) if lines[i].startswith(NOT_FASTEST))
    # through the compiled setup's list and compile costs, where the records have them
    last = next((i for i in range(listed + 2, len(lines)) if lines[i].startswith(("Notes (", "`python -m", "Runs:"))),
                len(lines))
    return "\n".join(lines[start:end] + [""] + lines[listed:last]).rstrip("\n") + "\n"


#: the README's rows: the published widths, float32, batch 16, on every transformers release recorded
SUMMARY_ROWS = {"size": "full", "dtype": "float32", "batch": 16}


def _some(row: dict, fmt, modes: tuple[str, ...]) -> str:
    """`x / y / ...` of one figure for some setups (`crash`, `–` as in the full table)."""
    out = []
    for mode in modes:
        figures = row.get(mode)
        out.append("–" if figures is None else "crash" if crashed(figures) else fmt(figures))
    return " / ".join(out)


def summary_table(record_or_merged: dict) -> str:
    """A few rows of the recorded runs for the README (SUMMARY_ROWS), narrow: collectives, expert memory, decode
    throughput, and end to end against the peer engine where one was recorded."""
    records = _records(record_or_merged)
    picked = [(rec, row) for rec, row in _rows(records)
              if all(row.get(k) == v for k, v in SUMMARY_ROWS.items()) and not row.get("not_run")]
    peers = any(PEER in row for _, row in picked)
    first = records[0]
    cpus = ", ".join(sorted({rec["machine"]["cpu"] for rec, _ in picked}))
    caption = (f"Published widths (2 layers), {SUMMARY_ROWS['dtype']}, batch {SUMMARY_ROWS['batch']}, "
               f"TP={first['tp']} on {first['machine']['cores']} {first['device'].upper()} cores ({cpus}): (a) stock "
               "AutoTP, (b) codegen, (f) codegen compiled, (d) transformers' native TP, (e) one process"
               + (", (v) vLLM's CPU engine" if peers else "") + "; collectives per MoE layer per decode step.")
    lines = [*textwrap.wrap(caption, 116, break_on_hyphens=False), "",
             "| model | transformers, CPU | collectives / MoE layer, a / b / d | expert MiB / rank, a / b / d "
             "| decode tokens/s, a / b / f / d / e |" + (" end to end tokens/s, b / f / v |" if peers else ""),
             "|---|---|---|---|---|" + ("---|" if peers else "")]
    abd = ("stock", "codegen", "native")
    for rec, row in picked:
        e2e = _some(row, lambda f: format(f["e2e"]["tokens_per_s"], ".1f") if "e2e" in f else "–",
                    ("codegen", "compiled", PEER))
        lines.append(f"| {label(row['family'])} | {rec['machine']['transformers']}, {_cpu_name(rec['machine'])} "
                     f"| {_some(row, _per_layer, abd)} "
                     f"| {_some(row, lambda f: format(f['param_bytes_per_rank']['experts'] / 2**20, '.0f'), abd)} "
                     f"| {_some(row, lambda f: format(f['decode_tokens_per_s'], '.1f'), ('stock', 'codegen', 'compiled', 'native', 'single'))} |"
                     + (f" {e2e} |" if peers else ""))
    compiled = _compile_summary(list(_rows(records)))
    return "\n".join(lines + ["", *textwrap.wrap(_limit_summary(picked), 116, break_on_hyphens=False)]
                     + (["", *textwrap.wrap(compiled, 116, break_on_hyphens=False)] if compiled else [])) + "\n"


def _cpu_name(machine: dict) -> str:
    """A record's CPU in a few words (its model's family and widest vector flag): the summary lists several machines'
    rows, which do not compare across machines."""
    cpu = str(machine.get("cpu") or "")
    family = next((name for name in ("Xeon", "EPYC", "Ryzen", "Core") if name in cpu), cpu.split(" ")[0] or "CPU")
    flags = machine.get("cpu_flags") or []
    return f"{family} {'AMX' if 'amx_tile' in flags else 'AVX-512' if 'avx512f' in flags else 'AVX2'}"


def _compile_summary(rows: list[tuple[dict, dict]]) -> str:
    """The summary's line on what compiling costs (f), over every recorded row that has it (each batch compiles
    graphs of its own shapes), by widths."""
    parts = []
    for size in ("bench", "full"):
        every = [row["compiled"]["compile"] for _, row in rows
                 if row["size"] == size and (_present(row, "compiled") or {}).get("compile")]
        costs = [c for c in every if not c.get("fallback")]
        if not costs:
            continue
        cold = [c["cold_s"] for c in costs]
        warm = [c["warm_s"] for c in costs if c.get("warm_s") is not None]
        parts.append(f"{size_name(size)} widths, {len(costs)} (family, batch) runs: "
                     f"cold {min(cold):.0f}–{max(cold):.0f} s"
                     + (f", warm (inductor's on-disk cache, a new process) {min(warm):.0f}–{max(warm):.0f} s"
                        if warm else "")
                     + (f" ({len(every) - len(costs)} more ran eager: torch.compile could not capture their forward "
                        "as one graph)" if len(every) > len(costs) else ""))
    if not parts:
        return ""
    return ("(f) codegen compiled (`init_inference(..., compile=True)`) compiles once per process per shape kind; "
            "measured per rank, prefill + decode + generate: " + "; ".join(parts) + " (docs/results.md).")


def _limit_summary(picked: list[tuple[dict, dict]]) -> str:
    """The summary's line on how close codegen's decode step runs to the machine's limit in its rows (compiled where
    the records have it)."""
    mode = "compiled" if any(_present(row, "compiled") for _, row in picked) else "codegen"
    shares = [(row, row[mode]["floor"]["of_limit"]["decode"]) for _, row in picked
              if _present(row, mode) and (row[mode].get("floor") or {}).get("of_limit", {}).get("decode")]
    if not shares:
        return (f"% of the machine's limit (floor / measured time; the floor from the bytes and FLOPs a rank's forward "
                f"needs at the bandwidth and GEMM throughput measured in the same run): {NO_LIMIT} in these rows, "
                "recorded before the bench measured it (docs/results.md has the column).")
    low, high = min(s for _, s in shares), max(s for _, s in shares)
    bound = sorted({row[mode]["floor"]["decode"]["bound"] for row, _ in shares})
    span = _pct(low) if _pct(low) == _pct(high) else f"{_pct(low)}–{_pct(high)}"
    who = "codegen's compiled" if mode == "compiled" else "codegen's"
    return (f"{who} decode step runs at {span} of the machine's limit in these rows (floor / "
            f"measured; the floor, {'- or '.join(bound)}-bound, from the bytes and FLOPs a rank's forward needs at the "
            "bandwidth and GEMM throughput measured in the same run).")


def refresh_docs(paths: list[Path], record_or_merged: dict) -> None:
    """Refresh the results sections each file holds (the full table, the summary): a file with neither is refused."""
    table = markdown(record_or_merged)
    bodies = ((TABLE_START, TABLE_END, lambda: results_table(table)),
              (SUMMARY_START, SUMMARY_END, lambda: summary_table(record_or_merged)))
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise IOFailure(f"cannot read {path}: {exc.strerror}") from None
        sections = [(begin, end, body()) for begin, end, body in bodies if splice.has(text, begin, end)]
        if not sections:
            raise BadInput(f"{path} has no results section to refresh: add the lines {TABLE_START} and {TABLE_END} "
                           f"(the full table) or {SUMMARY_START} and {SUMMARY_END} (a few rows)")
        splice.refresh(path, sections)


def write_outputs(record: dict, json_path: Path | None, md_path: Path | None, chart_path: Path | None,
                  doc_paths: list[Path] | None = None) -> str:
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
    if doc_paths:
        refresh_docs(list(doc_paths), record)
    return table


# ---------------------------------------------------------------------------------------------------- CLI

