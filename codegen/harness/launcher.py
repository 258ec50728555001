"""The one launcher of verify, bench and demo: start N local ranks of the rank worker and collect their figures.

Each rank is a separate `python -m codegen _worker` process (codegen.harness.worker.main) wired up exactly as
torchrun wires its
workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: env:// rendezvous). The
ranks are started directly rather than through torchrun's elastic agent: the agent imports torch
before it starts a rank, which cost ~5 s of a ~2-core machine per launch, and adds nothing for a
fixed single-node group. If one rank fails, the others are stopped (as torchrun does); the failure
is one line (the rank's own `rank<k>.error`, else the last error line of its output). If the port
chosen was taken before the rendezvous, the launch is retried once on another.

One launch runs several jobs (model dirs), each several phases (codegen.harness.worker.main), so a caller
pays the process start, the imports and DeepSpeed's set-up once. Rank 0's progress lines are
passed to `progress` while the ranks run.

DeepSpeed's CPU shared-memory all-reduce needs LOCAL_SIZE (the number of local ranks; DeepSpeed's
own launcher sets it, torchrun does not), so this sets it; the op it builds is cached by
codegen.harness.opcache. Its shared-memory buffers (/dev/shm/deepspeed_allreduce_buffer_*, ~70 MB per rank) are
never unlinked by DeepSpeed; this removes the ones its ranks created, keyed by the master port.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from codegen.errors import VerifyFailed
from codegen.harness.opcache import extensions_dir
from codegen.harness.worker.protocol import PROGRESS
from codegen.policy.runtime.probe import SHM_DIR, shm_job_prefix

#: the ranks rendezvous on this host only
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, timeout: float = 600.0, progress: Callable[[str], None] | None = None,
           what: str = "run") -> list[dict]:
    """Run codegen.harness.worker.main on `world` local ranks with `spec`; return each rank's record (rank order).

    spec: {"tp", "device", "dtype", "options": {...}, "jobs": [{"name", "model", "reference", "phases",
    "options"?}]} (see codegen.harness.worker.main). Any failure is one line (VerifyFailed).
    """
    device = spec.get("device", "cpu")
    with tempfile.TemporaryDirectory(prefix="codegen-ranks-") as out:
        spec_path = Path(out, "spec.json")
        spec_path.write_text(json.dumps(spec))
        args = ["--spec", str(spec_path), "--out", out]
        started = time.monotonic()
        for attempt in range(2):
            port = free_port()
            try:
                codes, timed_out, logs = _start(args, world, port, timeout, Path(out), device, progress)
            finally:
                remove_shm_buffers(port)
            port_taken = "EADDRINUSE" in logs or "address already in use" in logs.lower()
            if attempt == 0 and any(codes) and port_taken:
                continue  # another process took the port between free_port() and the rendezvous
            break
        if timed_out:
            raise VerifyFailed(f"{what} on {world} ranks timed out after {timeout:.0f}s")
        for rank in range(world):
            err = Path(out, f"rank{rank}.error")
            if err.exists():
                line = (err.read_text().strip().splitlines() or ["no message"])[0][:300]
                raise VerifyFailed(f"{what}: rank {rank} failed: {line}")
        # a rank that failed on its own (exit > 0) rather than one stopped because of it (killed: < 0)
        failed = next((c for c in codes if c > 0), next((c for c in codes if c), 0))
        if failed:
            raise VerifyFailed(f"{what} on {world} ranks failed (exit {failed}): {last_error_line(logs)}")
        results = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world)]
    wall = time.monotonic() - started
    for r in results:  # where the launch spent its time
        r["timings"]["launch_wall_s"] = wall
    return results


def run_phases(
    model: Path,
    reference: Path,
    modes: list[str],
    tp: int,
    world: int | None = None,
    timeout: float = 600.0,
    options: dict | None = None,
) -> dict[str, list[dict]]:
    """One job in one launch: {phase: [rank 0 figures, rank 1, ...]} (each with the rank's timings)."""
    job = {"name": Path(model).name, "model": str(model), "reference": str(reference), "phases": list(modes)}
    ranks = launch({"tp": tp, "options": options or {}, "jobs": [job]}, world or tp, timeout, what="+".join(modes))
    return {mode: [{**r["jobs"][job["name"]][mode], "timings": r["timings"]} for r in ranks] for mode in modes}


def _start(args: list[str], world: int, port: int, timeout: float, out: Path, device: str,
           progress: Callable[[str], None] | None) -> tuple[list[int], bool, str]:
    """Start the ranks and wait for all; stop the rest when one fails or time runs out.

    Returns the exit codes (rank order), whether time ran out, and the ranks' output.
    """
    threads = max(1, (os.cpu_count() or 2) // world)
    base = {"TORCH_EXTENSIONS_DIR": extensions_dir(), **os.environ,
            "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "LOCAL_SIZE": str(world), "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
            "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    if device == "cpu":
        base.setdefault("CUDA_VISIBLE_DEVICES", "")
    procs, logs, timed_out = [], [], False
    deadline = time.monotonic() + timeout
    shown = 0
    try:
        for rank in range(world):
            log = open(out / f"rank{rank}.log", "w+")
            logs.append(log)
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, "-m", "codegen", "_worker", *args], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if progress is not None:
                shown = _show_progress(out / "rank0.log", shown, progress)
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # a failed or late rank leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
        codes = [p.wait() for p in procs]
        if progress is not None and logs:
            _show_progress(out / "rank0.log", shown, progress)
        text = ""
        for log in logs:
            log.seek(0)
            text += log.read()
            log.close()
    return codes, timed_out, text


def _show_progress(log: Path, shown: int, progress: Callable[[str], None]) -> int:
    """Pass rank 0's new complete progress lines on; return how many bytes of its log are consumed."""
    try:
        with open(log, "rb") as f:
            f.seek(shown)
            chunk = f.read()
    except OSError:
        return shown
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode(errors="replace").splitlines():
        at = line.find(PROGRESS)
        if at >= 0:
            progress(line[at + len(PROGRESS):].rstrip())
    return shown + end


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its /dev/shm buffers (~66 MiB per rank) behind; drop one launch's."""
    prefix = shm_job_prefix({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(key in line for key in ("Error", "error:", "PolicyError", "Exception")) and "elastic" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
