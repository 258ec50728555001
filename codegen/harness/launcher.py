"""The one launcher of verify, bench and demo: local ranks of the rank worker (codegen.ranks), their figures back.

Every rank runs `python -m codegen _worker` (codegen.harness.worker.main) on one spec. One launch runs several
jobs (model dirs), each several phases, so a caller pays the process start, the imports and DeepSpeed's set-up
once. Rank 0's progress lines are passed to `progress` while the ranks run. If one rank fails the others are
stopped, and the failure is one line (the rank's own `rank<k>.error`, else the last error line of its output).
If the port chosen was taken before the rendezvous, the launch is retried once on another. DeepSpeed's CPU
all-reduce op the ranks build is cached by codegen.harness.opcache; the shared-memory buffers of ranks that ran
no policy (stock AutoTP, native TP) are removed when they end.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from codegen.errors import VerifyFailed
from codegen.harness.worker.protocol import PROGRESS
from codegen.rank_commands import WORKER
from codegen.ranks import LocalRanks, free_port, last_error_line, remove_shm_buffers


#: where torch.compile's inductor keeps compiled graphs (torch's variable)
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def launch(spec: dict, world: int, timeout: float = 600.0, progress: Callable[[str], None] | None = None,
           what: str = "run", inductor_cache: str | None = None) -> list[dict]:
    """Run codegen.harness.worker.main on `world` local ranks with `spec`; return each rank's record (rank order).

    spec: {"tp", "device", "dtype", "options": {...}, "jobs": [{"name", "model", "reference", "phases",
    "options"?}]} (see codegen.harness.worker.main). Any failure is one line (VerifyFailed).
    `inductor_cache`: where torch.compile keeps compiled graphs (default: the launch's own, empty, so a compile
    cost measured is a cold one; $TORCHINDUCTOR_CACHE_DIR, where set, wins).
    """
    device = spec.get("device", "cpu")
    with tempfile.TemporaryDirectory(prefix="codegen-ranks-") as out:
        spec_path = Path(out, "spec.json")
        spec_path.write_text(json.dumps(spec))
        args = ["--spec", str(spec_path), "--out", out]
        started = time.monotonic()
        # the compiled setup's cold compile cost starts from an empty inductor cache: this launch's own
        own_cache = INDUCTOR_CACHE not in os.environ
        for attempt in range(2):
            port = free_port()
            try:
                if own_cache:
                    os.environ[INDUCTOR_CACHE] = inductor_cache or str(Path(out, "inductor"))
                codes, timed_out, logs = _start(args, world, port, timeout, Path(out), device, progress)
            finally:
                if own_cache:
                    os.environ.pop(INDUCTOR_CACHE, None)
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
    ranks = LocalRanks([WORKER, *args], world, out, device, port).start()
    shown = [0]

    def show() -> None:
        if progress is not None:
            shown[0] = _show_progress(out / "rank0.log", shown[0], progress)

    try:
        codes, timed_out = ranks.wait(time.monotonic() + timeout, show)
        return codes, timed_out, ranks.output()
    finally:
        ranks.close()


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
