"""Runtime checks on real processes: start N local ranks with torchrun and collect what each measured.

DeepSpeed's CPU shared-memory all-reduce crashes ranks started by torchrun unless LOCAL_SIZE (the
number of local ranks) is set; its own launcher sets it, so this does too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from codegen.errors import IOFailure, VerifyFailed
from codegen.modeldir import ModelDir


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
    """Run codegen.tp_worker on `world` local ranks; return each rank's figures (rank order)."""
    world = world or tp
    with tempfile.TemporaryDirectory(prefix="codegen-ranks-") as out:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "-m", "codegen.tp_worker", "--model", str(model), "--reference", str(reference),
            "--mode", mode, "--tp", str(tp), "--out", out, *(extra or []),
        ]
        threads = max(1, (os.cpu_count() or 2) // world)
        env = {**os.environ, "LOCAL_SIZE": str(world), "OMP_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise VerifyFailed(f"{mode} run on {world} ranks timed out after {timeout:.0f}s") from None
        results = []
        for rank in range(world):
            path = Path(out, f"rank{rank}.json")
            if not path.exists():
                tail = _last_error_line(proc.stderr + proc.stdout)
                raise VerifyFailed(f"{mode} run on {world} ranks failed (exit {proc.returncode}): {tail}")
            results.append(json.loads(path.read_text()))
        return results


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
        raise VerifyFailed(f"{model_dir} is not patched: run `python -m codegen patch {model_dir}` first")
    into.mkdir(parents=True, exist_ok=True)
    recorded = manifest["files"]
    try:
        for entry in model_dir.iterdir():
            if entry.name in (".codegen", "__pycache__") or entry.name in recorded:
                continue
            os.symlink(entry.resolve(), into / entry.name)
        for name, record in recorded.items():
            original = record["original"]
            if original["kind"] == "file":
                shutil.copyfile(model_dir / ".codegen" / "originals" / name, into / name)
            elif original["kind"] == "symlink":
                target = Path(original["target"])
                os.symlink(target if target.is_absolute() else (model_dir / target).resolve(), into / name)
    except OSError as exc:
        raise IOFailure(f"cannot build the unpatched reference in {into}: {exc.strerror}") from None
    return into
