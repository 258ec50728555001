"""Issue 12: no DeepSpeed shared-memory buffer left behind by a served dir, and `codegen shm` for old ones.

* Real 2-rank CPU runs of a patched dir under its generated policy, started the way torchrun starts
  ranks (env:// rendezvous, LOCAL_SIZE so DeepSpeed's shm all-reduce is used). Once the policy is up every
  rank's buffer name is unlinked (its memory still mapped) and no SIGTERM handler was installed: after a
  normal exit, a SIGKILL and a SIGTERM no buffer of that run is left, the killed ranks end at once with their
  own exit status, and another job's buffer (another port) is never touched.
* `python -m codegen shm [--clean]` on a directory of real tmpfs files, one of them mapped by a live
  process: listed with size and age, and only the unmapped, old enough ones removed.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from codegen.policy.assemble import runtime_module

rt = runtime_module()

ROOT = Path(__file__).resolve().parent.parent

RANK_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, signal, sys, time, torch
    model_dir, ready, mode = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    from codegen.models import load
    model = load(model_dir, True, torch.float32)
    spec = importlib.util.spec_from_file_location("autotp_policy", os.path.join(model_dir, "autotp_policy.py"))
    policy = importlib.util.module_from_spec(spec); spec.loader.exec_module(policy)
    handler_before = signal.getsignal(signal.SIGTERM)
    own = "/dev/shm/" + policy.shm_buffer_name(rank)
    engine = policy.init_inference(model, tp_size=2, dtype=torch.float32)
    with torch.no_grad():
        engine.module(torch.randint(0, 64, (1, 8)))
    maps = open("/proc/self/maps").read()
    state = {"own": own, "name_exists": os.path.exists(own), "still_mapped": own + " (deleted)" in maps,
             "handler_unchanged": signal.getsignal(signal.SIGTERM) is handler_before}
    json.dump(state, open(os.path.join(ready, f"rank{rank}.tmp"), "w"))
    os.replace(os.path.join(ready, f"rank{rank}.tmp"), os.path.join(ready, f"rank{rank}"))
    if mode == "serve":
        time.sleep(300)
""")


def _buffers(port: int) -> list[str]:
    return sorted(p for p in os.listdir(rt.SHM_DIR) if p.startswith(rt.SHM_PREFIX) and f"_{port}_" in p)


def _launch(model_dir: Path, work: Path, mode: str) -> tuple[list[subprocess.Popen], int, Path]:
    from codegen.policy.runtime.environment import extensions_dir
    from codegen.ranks import free_port

    port = free_port()
    script = work / "rank.py"
    script.write_text(RANK_SCRIPT)
    ready = work / f"ready-{mode}"
    ready.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions_dir(), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    procs = []
    for r in range(2):
        with open(work / f"{mode}{r}.log", "w") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen([sys.executable, str(script), str(model_dir), str(ready), mode],
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs, port, ready


def _wait_ready(procs, ready: Path, timeout: float = 600) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((ready / f"rank{r}").exists() for r in range(2)):
            return [json.loads((ready / f"rank{r}").read_text()) for r in range(2)]
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        p.kill()
    raise AssertionError(f"ranks never became ready: exit codes {[p.poll() for p in procs]}")


@pytest.fixture(scope="module")
def served_dir(_tiny_templates, tmp_path_factory):
    import shutil

    from codegen.cli import main as codegen_main

    directory = tmp_path_factory.mktemp("shm") / "qwen2_moe"
    shutil.copytree(_tiny_templates["qwen2_moe"], directory)
    assert codegen_main(["patch", "-q", str(directory)]) == 0
    return directory


@pytest.fixture
def other_job_buffer():
    """A buffer of another job on this machine (same user and address, another port): it must survive."""
    path = Path(rt.SHM_DIR, rt.shm_buffer_name(0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}))
    path.write_bytes(b"\0" * 4096)
    yield path
    path.unlink(missing_ok=True)


def _check_unlinked_once_mapped(states, port):
    """Every rank's own buffer: its name gone from /dev/shm once the policy was up, its memory still mapped (the
    shared-memory all-reduce ran on it), and no SIGTERM handler installed."""
    for rank, state in enumerate(states):
        own = f"{rt.SHM_DIR}/{rt.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_{rank}"
        assert state == {"own": own, "name_exists": False, "still_mapped": True, "handler_unchanged": True}


@pytest.mark.runtime
def test_normal_exit_leaves_no_buffer(served_dir, tmp_path, other_job_buffer):
    procs, port, ready = _launch(served_dir, tmp_path, "exit")
    try:
        states = _wait_ready(procs, ready)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert codes == [0, 0], (tmp_path / "exit0.log").read_text()[-2000:]
    _check_unlinked_once_mapped(states, port)
    assert _buffers(port) == []
    assert other_job_buffer.exists()


@pytest.mark.runtime
def test_sigkill_and_sigterm_leave_no_buffer_and_keep_exit_statuses(served_dir, tmp_path, other_job_buffer):
    """A serving rank killed outright (SIGKILL: nothing of it runs) and one told to stop (SIGTERM): neither leaves a
    buffer, and each ends of its own signal, at once (no handler of codegen's in the way)."""
    procs, port, ready = _launch(served_dir, tmp_path, "serve")
    try:
        states = _wait_ready(procs, ready)
        assert _buffers(port) == []  # already unlinked while the ranks still serve
        procs[0].send_signal(signal.SIGKILL)
        procs[1].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        codes = [p.wait(timeout=60) for p in procs]
        took = time.monotonic() - sent
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    _check_unlinked_once_mapped(states, port)
    assert codes == [-signal.SIGKILL, -signal.SIGTERM] and took < 10
    assert _buffers(port) == []
    assert other_job_buffer.exists()


# ------------------------------------------------------------------------------------------ `codegen shm`


def _shm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codegen", "shm", *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def _checked(line: str) -> str:
    """A line without the note on processes whose maps are unreadable (a container's pid 1 is, even to root)."""
    return re.sub(r" \(\d+ processes' maps unreadable, not checked\)$", "", line)


@pytest.fixture
def shm_dir():
    """A directory on the real tmpfs (mapped files show up in /proc/<pid>/maps as they do in /dev/shm)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="codegen-test-shm-", dir=rt.SHM_DIR) as d:
        yield Path(d)


@pytest.mark.cli
def test_shm_lists_and_cleans_only_unused_old_buffers(shm_dir):
    old = shm_dir / f"{rt.SHM_PREFIX}_{os.getuid()}_127.0.0.1_1111_0"
    mapped = shm_dir / f"{rt.SHM_PREFIX}_{os.getuid()}_127.0.0.1_1111_1"
    new = shm_dir / f"{rt.SHM_PREFIX}_{os.getuid()}_127.0.0.1_2222_0"
    other = shm_dir / "not_a_deepspeed_buffer"
    for path, size in ((old, 3 << 20), (mapped, 2 << 20), (new, 1 << 20), (other, 10)):
        path.write_bytes(b"\0" * size)
    hour_ago = time.time() - 3600
    for path in (old, mapped):
        os.utime(path, (hour_ago, hour_ago))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import mmap, sys, time
        f = open({str(mapped)!r}, "r+b"); m = mmap.mmap(f.fileno(), 0)
        print("mapped", flush=True); time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        listing = _shm("--dir", str(shm_dir))
        assert listing.returncode == 0, listing.stderr
        lines = [_checked(line) for line in listing.stdout.splitlines()]
        assert re.fullmatch(rf"{re.escape(str(new))}  1\.0 MiB  \d+s  too new \(< 30s\)", lines.pop(2))
        assert lines == [
            f"{old}  3.0 MiB  1h00m  left behind",
            f"{mapped}  2.0 MiB  1h00m  in use (pid {holder.pid})",
            (f"3 buffers, 6.0 MiB in {shm_dir}: 2 in use or too new, 1 left behind "
             "(`python -m codegen shm --clean` removes those)"),
        ]
        assert old.exists()  # listing removes nothing
        clean = _shm("--dir", str(shm_dir), "--clean")
        assert clean.returncode == 0, clean.stderr
        assert _checked(clean.stdout.splitlines()[-1]) == "removed 1 of 3 buffers (3.0 MiB); kept 2"
        assert not old.exists() and mapped.exists() and new.exists() and other.exists()
    finally:
        holder.kill()
        holder.wait()
    os.utime(new, (hour_ago, hour_ago))
    again = _shm("--dir", str(shm_dir), "--clean")
    assert _checked(again.stdout.splitlines()[-1]) == "removed 2 of 2 buffers (3.0 MiB); kept 0"
    assert not mapped.exists() and not new.exists() and other.exists()
    empty = _shm("--dir", str(shm_dir))
    assert [_checked(line) for line in empty.stdout.splitlines()] == [f"0 buffers, 0.0 MiB in {shm_dir}: 0 in use or too new, 0 left behind"]


@pytest.mark.unit
def test_shm_maps_scan_sees_this_process_mapping(shm_dir):
    from codegen import shm

    path = shm_dir / f"{rt.SHM_PREFIX}_{os.getuid()}_127.0.0.1_3333_0"
    path.write_bytes(b"\0" * 4096)
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0):
        mapped, _ = shm.scan_maps(str(shm_dir))
        assert mapped == {str(path): {os.getpid()}}
    assert shm.scan_maps(str(shm_dir))[0] == {}


@pytest.mark.unit
def test_shm_is_a_subcommand_of_the_one_cli():
    from codegen.cli import COMMANDS, _parser

    args = _parser().parse_args(["shm", "--clean", "--dir", "/tmp/x"])
    assert (args.command, args.clean, args.dir) == ("shm", True, "/tmp/x") and "shm" in COMMANDS
