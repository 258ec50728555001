"""What verify, bench and demo share besides the launcher: patching example dirs, progress lines, set-up checks.

Every patch the harness makes goes through `patch_dir`, so the harness and the CLI write the same files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from codegen.errors import BadInput, IOFailure, VerifyFailed


class Progress:
    """`[  12.3s] message` lines on stderr: the steps that take seconds say so, no extra dependency."""

    def __init__(self, quiet: bool = False) -> None:
        self.t0 = time.monotonic()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)


def patch_dir(path: Path, coalesce: bool = True) -> str:
    """Patch `path` in place, as `python -m codegen patch` does; return the one-line summary it prints."""
    from codegen.patch import api

    return api.patch(path, coalesce=coalesce).summary


def build_examples(families: tuple[str, ...], size: str, root: Path, progress: Progress,
                   dtype: str = "float32") -> dict[str, Path]:
    """Random hub-format checkpoints (codegen.harness.examples), built in a child process: root/<family>/unpatched.

    A child process: this one never imports torch or transformers (the ranks do).
    """
    from codegen.harness.launcher import last_error_line

    progress(f"building {size} example checkpoints ({', '.join(families)}) with transformers (random weights)")
    t0 = time.monotonic()
    build = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from codegen.harness.examples import build_example\n"
         "for fam in sys.argv[4:]:\n"
         "    build_example(fam, Path(sys.argv[1]) / fam / 'unpatched', size=sys.argv[2], dtype=sys.argv[3])",
         str(root), size, dtype, *families],
        capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    if build.returncode != 0:
        raise VerifyFailed(f"building the example checkpoints failed: {last_error_line(build.stderr + build.stdout)}")
    progress(f"built {len(families)} checkpoints in {time.monotonic() - t0:.1f}s")
    return {family: root / family / "unpatched" for family in families}


def prepare_examples(families: tuple[str, ...], size: str, root: Path, progress: Progress,
                     echo: bool = False, dtype: str = "float32") -> dict[str, dict]:
    """Each family's random checkpoint and a patched copy: {family: {"unpatched", "patched"}}."""
    from codegen.modeldir.outcopy import copy_with_linked_weights

    built = build_examples(families, size, root, progress, dtype)
    dirs = {}
    for family in families:
        patched = root / family / "patched"
        copy_with_linked_weights(built[family], patched)
        progress(f"{family}: python -m codegen patch {patched}")
        summary = patch_dir(patched)
        if echo:
            print(summary)
        dirs[family] = {"unpatched": built[family], "patched": patched}
    return dirs


def ab_spec(dirs: dict[str, dict], jobs: list[dict], tp: int, device: str, dtype: str, settings: dict) -> dict:
    """A launch running the ab phase (codegen.harness.worker.main) once per job: {"name", "family", "batch", "setups"}."""
    return {
        "tp": tp,
        "device": device,
        "dtype": dtype,
        "limits": settings.get("limits", True),  # measure the machine's limits first (codegen.harness.worker.limits)
        "options": {"prompt_len": settings["prompt_len"], "generate": 0, "decode_steps": settings["decode_steps"],
                    "warmup": settings["warmup"], "repeats": settings["prefill_repeats"],
                    "e2e_tokens": settings.get("e2e_tokens", 0), "e2e_repeats": settings.get("e2e_repeats", 1),
                    "compile_warm": settings.get("compile_warm", True)},
        "jobs": [{"name": job["name"], "model": str(dirs[job["family"]]["patched"]),
                  "reference": str(dirs[job["family"]]["unpatched"]), "phases": ["ab"],
                  "options": {"batch": job["batch"], "setups": list(job["setups"])}} for job in jobs],
    }


def make_workdir(parent: Path, prefix: str) -> Path:
    """A fresh dir under --workdir (kept afterwards); one line if it cannot be made."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise IOFailure(f"--workdir {parent}: {exc.strerror or exc}") from None


def check_runtime_installed(what: str) -> None:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "deepspeed") if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInput(f"{what} needs {', '.join(missing)}: install torch, then pip install 'codegen[runtime]'")


def check_device(device: str, tp: int) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
    if torch.cuda.device_count() < tp:
        raise BadInput(f"--device cuda: --tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
