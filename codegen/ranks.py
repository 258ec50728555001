"""Local ranks, started the way torchrun starts its workers: the harness's rank workers and `serve`'s server ranks.

Each rank is a separate `python -m codegen <hidden subcommand>` process with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT (env:// rendezvous on loopback), LOCAL_SIZE (DeepSpeed's CPU all-reduce
needs it) and its share of the cores as OMP_NUM_THREADS; a CPU rank is bound to those cores. The ranks are started
directly rather than through torchrun's elastic agent: the agent imports torch before it starts a rank, which costs
~5 s of a 2-core machine per launch, and adds nothing for a fixed single-node group. When one rank fails the others
are stopped (they would wait in a collective for it forever), as torchrun does.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from codegen.policy.runtime.environment import affinity_cores, extensions_dir, usable_cores
from codegen.policy.runtime.probe import SHM_DIR, shm_job_prefix

#: the ranks rendezvous on this host only
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


#: `0` leaves CPU ranks wherever the OS schedules them; by default each is bound to its own share of the cores
BIND_CORES = "CODEGEN_BIND_CORES"


def rank_env(rank: int, world: int, port: int, device: str) -> dict[str, str]:
    """The environment of rank `rank` of a local group of `world` (the caller's environment underneath)."""
    threads = max(1, usable_cores() // world)
    env = {"TORCH_EXTENSIONS_DIR": extensions_dir(), "OMP_NUM_THREADS": str(threads), **os.environ,
           "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "LOCAL_SIZE": str(world), "GROUP_RANK": "0",
           "RANK": str(rank), "LOCAL_RANK": str(rank), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    if device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def rank_cores(rank: int, world: int) -> set[int] | None:
    """The cores CPU rank `rank` of `world` is bound to: its share of this process's cores, in order, as vLLM's CPU
    engine binds its ranks and DeepSpeed's launcher does with --bind_cores_to_rank (measured, 2 ranks on 2 cores,
    toy Qwen3-MoE's compiled 128-token prefill, three runs each: unbound 41.7-42.7 ms, bound 38.6-39.5). None where
    there are fewer cores than ranks, or with CODEGEN_BIND_CORES=0."""
    if os.environ.get(BIND_CORES, "1") == "0":
        return None
    cores = affinity_cores()
    if not cores:
        return None
    share = len(cores) // world
    return set(cores[rank * share:(rank + 1) * share]) if share else None


class LocalRanks:
    """`world` ranks of `python -m codegen <argv>`, each writing its output to `logs/rank<k>.log`."""

    def __init__(self, argv: list[str], world: int, logs: Path, device: str = "cpu", port: int | None = None) -> None:
        self.argv, self.world, self.logs, self.device = argv, world, logs, device
        self.port = port or free_port()
        self.procs: list[subprocess.Popen] = []
        self._files: list[IO] = []

    def start(self) -> LocalRanks:
        for rank in range(self.world):
            log = open(self.logs / f"rank{rank}.log", "w+")
            self._files.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "codegen", *self.argv],
                                    env=rank_env(rank, self.world, self.port, self.device),
                                    stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(proc)
            cores = rank_cores(rank, self.world) if self.device == "cpu" else None
            if cores:  # before the rank starts its threads: they inherit it
                try:
                    os.sched_setaffinity(proc.pid, cores)
                except OSError:  # it exited already: wait() reports it
                    pass
        return self

    def wait(self, deadline: float | None = None, on_poll: Callable[[], None] | None = None) -> tuple[list[int], bool]:
        """Until every rank has exited or one failed (or `deadline`, a time.monotonic() value, passed); then the
        rest are stopped. (exit codes in rank order, whether time ran out)."""
        timed_out = False
        try:
            while any(p.poll() is None for p in self.procs) and not any(p.poll() for p in self.procs):
                if on_poll is not None:
                    on_poll()
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            self.stop()
        if on_poll is not None:
            on_poll()
        return [p.wait() for p in self.procs], timed_out

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the ranks still running: SIGTERM, then after `grace_s` SIGKILL (a failed or late rank leaves the
        others waiting in a collective)."""
        alive = [p for p in self.procs if p.poll() is None]
        if grace_s > 0:
            for p in alive:
                p.terminate()
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(p.poll() is None for p in alive):
                time.sleep(0.05)
        for p in alive:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        remove_shm_buffers(self.port)

    def output(self) -> str:
        text = ""
        for log in self._files:
            log.seek(0)
            text += log.read()
        return text

    def close(self) -> None:
        for log in self._files:
            log.close()


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves its /dev/shm buffers (~66 MiB per rank) where a rank died before the policy
    unlinked them (or where no policy ran: stock AutoTP, native TP); drop one launch's."""
    prefix = shm_job_prefix({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def last_error_line(text: str) -> str:
    """The line of a rank's output that says what went wrong (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if any(key in line for key in ("Error", "error:", "PolicyError", "Exception")) and "elastic" not in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
