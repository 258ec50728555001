"""Runtime checks on real processes: start N local ranks and collect what each measured.

Each rank is a separate `python -m codegen.tp_worker` process wired up exactly as torchrun wires its
workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: env:// rendezvous). The
ranks are started directly rather than through torchrun's elastic agent: the agent imports torch
before it starts a rank, which cost ~5 s of a ~2-core machine per launch, and adds nothing for a
fixed single-node group. If one rank fails, the others are stopped (as torchrun does).

DeepSpeed's CPU shared-memory all-reduce needs LOCAL_SIZE (the number of local ranks; DeepSpeed's
own launcher sets it, torchrun does not), so this sets it. It is JIT-compiled on first use; unless
TORCH_EXTENSIONS_DIR is set, the build goes to a dir per Python environment (see extensions_dir). Its shared-memory buffers
(/dev/shm/deepspeed_allreduce_buffer_*, ~70 MB per rank) are never unlinked by DeepSpeed; this
removes the ones its ranks created, keyed by the master port it chose.

One launch can measure several phases (`modes`) in order, sharing the process start, the imports
and the single-process reference; see codegen.tp_worker.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from codegen.errors import BadInput, IOFailure, VerifyFailed
from codegen.modeldir import ModelDir

MODES = ("no-policy", "codegen", "stock")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    model: Path,
    reference: Path,
    mode: str,
    tp: int,
    world: int | None = None,
    timeout: float = 600.0,
    extra: list[str] | None = None,
) -> list[dict]:
    """Run codegen.tp_worker on `world` local ranks in one mode; return each rank's figures (rank order)."""
    return run_phases(model, reference, [mode], tp, world, timeout, extra)[mode]


def run_phases(
    model: Path,
    reference: Path,
    modes: list[str],
    tp: int,
    world: int | None = None,
    timeout: float = 600.0,
    extra: list[str] | None = None,
) -> dict[str, list[dict]]:
    """One launch of `world` ranks measuring each of `modes` in order: {mode: [rank 0 figures, rank 1, ...]}.

    `model` is the dir the codegen / no-policy phases load; `reference` the unpatched dir (the
    single-process reference, and what the stock phase loads when it is not the only phase).
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty list of {MODES}, got {modes}")
    world = world or tp
    label = "+".join(modes)
    with tempfile.TemporaryDirectory(prefix="codegen-ranks-") as out:
        args = ["--model", str(model), "--reference", str(reference), "--mode", ",".join(modes),
                "--tp", str(tp), "--out", out, *(extra or [])]
        started = time.monotonic()
        for attempt in range(2):
            port = free_port()
            try:
                codes, timed_out, logs = _launch(args, world, port, timeout, Path(out))
            finally:
                remove_shm_buffers(port)
            port_taken = "EADDRINUSE" in logs or "address already in use" in logs.lower()
            if attempt == 0 and any(codes) and port_taken:
                continue  # another process took the port between free_port() and the rendezvous
            break
        if timed_out:
            raise VerifyFailed(f"{label} run on {world} ranks timed out after {timeout:.0f}s")
        # a rank that failed on its own (exit > 0) rather than one stopped because of it (killed: < 0)
        failed = next((c for c in codes if c > 0), next((c for c in codes if c), 0))
        if failed:
            raise VerifyFailed(f"{label} run on {world} ranks failed (exit {failed}): {_last_error_line(logs)}")
        results = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world)]
        wall = time.monotonic() - started
    for r in results:  # where the launch spent its time, on every phase's figures
        r["timings"]["launch_wall_s"] = wall
    return {mode: [{**r["phases"][mode], "timings": r["timings"]} for r in results] for mode in modes}


def _launch(args: list[str], world: int, port: int, timeout: float, out: Path) -> tuple[list[int], bool, str]:
    """Start the ranks and wait for all; stop the rest when one fails or time runs out.

    Returns the exit codes (rank order), whether time ran out, and the ranks' output.
    """
    threads = max(1, (os.cpu_count() or 2) // world)
    base = {"TORCH_EXTENSIONS_DIR": extensions_dir(), **os.environ,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "LOCAL_SIZE": str(world), "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    procs, logs, timed_out = [], [], False
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world):
            log = open(out / f"rank{rank}.log", "w+")
            logs.append(log)
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, "-m", "codegen.tp_worker", *args], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # a failed or late rank leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
        codes = [p.wait() for p in procs]
        text = ""
        for log in logs:
            log.seek(0)
            text += log.read()
            log.close()
    return codes, timed_out, text


def extensions_dir() -> str:
    """A torch-extensions build dir per Python environment (the one codegen.bench uses too).

    DeepSpeed JIT-compiles its CPU shared-memory all-reduce into ~/.cache/torch_extensions/<py>_cpu,
    shared by every environment with the same Python; two virtualenvs rebuild it there in turn (the
    include paths differ), 1-3 minutes on 2 cores each time, inside whichever launch comes next.
    """
    import hashlib

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    return os.path.join(base, "torch_extensions", f"codegen-{Path(sys.prefix).name}-{tag}")


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its /dev/shm buffers (~66 MiB per rank) behind; drop one launch's."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(key in line for key in ("Error", "error:", "PolicyError", "Exception")) and "elastic" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def materialize_unpatched(model_dir: Path, into: Path) -> Path:
    """The dir as it was before `patch` (originals from the manifest, everything else linked)."""
    md = ModelDir(model_dir)
    manifest = md.manifest()
    if manifest is None:
        raise BadInput(f"{model_dir} is not patched: run `python -m codegen patch {model_dir}` first")
    into.mkdir(parents=True, exist_ok=True)
    recorded = manifest.files
    try:
        for entry in model_dir.iterdir():
            if entry.name in (".codegen", "__pycache__") or entry.name in recorded:
                continue
            os.symlink(entry.resolve(), into / entry.name)
        for name, record in recorded.items():
            original = record.original
            if original.kind == "file":
                shutil.copyfile(model_dir / ".codegen" / "originals" / name, into / name)
            elif original.kind == "symlink":
                target = Path(original.target)
                os.symlink(target if target.is_absolute() else (model_dir / target).resolve(), into / name)
    except OSError as exc:
        raise IOFailure(f"cannot build the unpatched reference in {into}: {exc.strerror}") from None
    return into
