"""The serving figures docs/serving.md and the README quote, rendered from the records the load test and the soak
write (scripts/serve_load.py --record, scripts/serve_soak.py --record: docs/serving/*.json), so a quoted figure
cannot drift from its measurement (tests/test_docs.py renders them again and compares)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from codegen import splice

#: prose lines are wrapped as the hand-written ones around them
WIDTH = 116
LOAD_SCHEMA, SOAK_SCHEMA = "codegen-serve-load/1", "codegen-serve-soak/1"
LOAD_RECORD, SOAK_RECORD = Path("docs/serving/load.json"), Path("docs/serving/soak.json")
LOAD_SECTION = splice.markers("serve-load", f"scripts/serve_load.py --record {LOAD_RECORD}")
SOAK_SECTION = splice.markers("serve-soak", f"scripts/serve_soak.py --record {SOAK_RECORD}")
SUMMARY_SECTION = splice.markers("serve-summary", "scripts/serve_load.py and scripts/serve_soak.py (--record)")
#: engine key in a load record -> how the tables name it
ENGINES = {"codegen": "codegen serve", "codegen-compiled": "codegen serve --compile", "vllm": "vllm serve"}


def read(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _machine(m: dict) -> str:
    flags = f" ({' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    return f"{m['cpu']}{flags}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB"


def load_table(record: dict) -> str:
    """Every engine per client count, one row each, and the run's settings."""
    s = record["settings"]
    lines = [_wrap(f"{s['model']}, TP {s['tp']}, {s['dtype']}, {s['tokens']} tokens a request (streamed, the official "
             f"`openai` client), {s['seconds']:g} s a level after one warm-up request per client"
             + (f" and {s['warm_seconds']:g} s of its load untimed" if s.get("warm_seconds") else "") + ", each engine's "
             f"batch bound {s['max_batch']}; {_machine(record['machine'])}, the client threads on the same cores; "
             + "; ".join(f"{ENGINES[k]}: {e['version']}, load average {e['load_before']:.1f} before its run"
                         for k, e in record["engines"].items()) + "."),
             "",
             "| clients | engine | requests | requests/s | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for level in sorted({r["clients"] for e in record["engines"].values() for r in e["levels"]}):
        for key, engine in record["engines"].items():
            for r in (r for r in engine["levels"] if r["clients"] == level):
                lines.append(f"| {level} | {ENGINES[key]} | {r['requests']} | {r['rps']:.2f} | {r['tps']:.0f} | "
                             f"{_ms(r['ttft50'])} | {_ms(r['ttft99'])} | {_ms(r['itl50'])} | {_ms(r['itl99'])} |")
    return "\n".join(lines) + "\n"


def ratios(record: dict) -> dict[str, dict[int, float]]:
    """{codegen engine: {clients: its output tokens/s over vLLM's}}, for each codegen engine the record has."""
    engines = record["engines"]
    if "vllm" not in engines:
        return {}
    theirs = {r["clients"]: r["tps"] for r in engines["vllm"]["levels"]}
    return {key: {r["clients"]: r["tps"] / theirs[r["clients"]] for r in engines[key]["levels"]
                  if theirs.get(r["clients"])}
            for key in ENGINES if key != "vllm" and key in engines}


def soak_text(record: dict) -> str:
    s, r = record["settings"], record["result"]
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(r["counts"].items()))
    rss = "; ".join(f"rank {k}: {rank['warm_mib']:.0f} MiB after warm-up, {rank['last_mib']:.0f} MiB at the end "
                    f"({rank['last_mib'] - rank['warm_mib']:+.0f} MiB), largest {rank['max_mib']:.0f} MiB; over the "
                    f"second half {rank['second_half_mib']:+.0f} MiB" for k, rank in enumerate(r["ranks"]))
    return _wrap(f"{s['minutes']:g} minutes, {s['clients']} clients, {s['model']}, TP {s['tp']}, "
            f"{_machine(record['machine'])}: {r['requests']} requests ({counts}); errors on valid requests: "
            f"{r['valid_errors']}; bad bodies not answered with a 4xx and OpenAI's error body: {r['bad_not_4xx']}. "
            f"RSS sampled every {s['sample_s']:g} s: {rss}. After SIGTERM: {r['ranks_left']} ranks left after "
            f"{r['stop_s']:.1f} s, {r['buffers_left']} DeepSpeed buffers left in /dev/shm.") + "\n"


def summary(load: dict | None, soak: dict | None) -> str:
    """The README's serving line."""
    parts = []
    if load:
        for key, by in ratios(load).items():
            parts.append(f"output tokens/s of `{ENGINES[key]}` over `vllm serve` (its CPU build, same checkpoint, "
                         "TP 2) at " + ", ".join(f"{c} client{'s' if c > 1 else ''}: {x:.2f}×"
                                                 for c, x in sorted(by.items())))
    if soak:
        r = soak["result"]
        parts.append(f"a {soak['settings']['minutes']:g}-minute soak: {r['requests']} requests, "
                     f"{r['valid_errors']} errors on valid ones, RSS per rank over its second half "
                     + ", ".join(f"{rank['second_half_mib']:+.0f} MiB" for rank in r["ranks"]))
    return _wrap("Serving, measured (one run of each; the spread of several in [docs/serving.md](docs/serving.md)): "
                 + "; ".join(parts) + ".") + "\n" if parts else ""


def refresh(root: Path) -> list[Path]:
    """Re-render every serving section under `root` from the records; the files that changed."""
    load, soak = read(root / LOAD_RECORD), read(root / SOAK_RECORD)
    serving = [(*LOAD_SECTION, load_table(load) if load else ""), (*SOAK_SECTION, soak_text(soak) if soak else "")]
    changed = []
    for path, sections in ((root / "docs/serving.md", serving), (root / "README.md", [(*SUMMARY_SECTION, summary(load, soak))])):
        if splice.refresh(path, sections):
            changed.append(path)
    return changed
