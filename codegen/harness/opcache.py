"""DeepSpeed's CPU shared-memory all-reduce op, built once per Python, torch and DeepSpeed, kept in codegen's cache.

DeepSpeed JIT-compiles that op on first use (1-3 minutes on 2 cores), into a build dir whose paths name the
virtualenv; the rank workers keep the built library in codegen's cache dir keyed by what it is built from,
so a fresh clone or another virtualenv with the same Python, torch and DeepSpeed loads it instead of
building it again. Where nothing is cached, each environment builds into its own dir (`extensions_dir`),
never into the shared ~/.cache/torch_extensions/<py>_cpu that two environments would rebuild in turn.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from codegen.policy.runtime.environment import extensions_dir


def codegen_cache() -> Path:
    """codegen's cache dir ($CODEGEN_CACHE, else $XDG_CACHE_HOME/codegen or ~/.cache/codegen), shared by clones."""
    env = os.environ.get("CODEGEN_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "codegen"


def _shm_builder():
    """DeepSpeed's builder of its CPU shared-memory all-reduce, or None where it has none."""
    try:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().create_op_builder("ShareMemCommBuilder")
    except Exception:  # noqa: BLE001 - no such op in this DeepSpeed: nothing to cache
        return None


def shm_op_cache_path(builder=None) -> Path | None:
    """Where the built shm op of this Python, torch, DeepSpeed and op source is kept (None: no such op)."""
    builder = builder or _shm_builder()
    if builder is None:
        return None
    import deepspeed
    import torch

    digest = hashlib.sha256()
    for part in (sys.version, torch.__version__, deepspeed.__version__, sys.platform,
                 repr(builder.strip_empty_entries(builder.cxx_args()))):
        digest.update(part.encode() + b"\0")
    paths = [Path(builder.deepspeed_src_path(p)) for p in builder.sources()]
    for include in builder.include_paths():
        paths += sorted(Path(builder.deepspeed_src_path(include)).rglob("*"))
    for path in paths:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return codegen_cache() / "torch_extensions" / f"{builder.NAME}-{digest.hexdigest()[:16]}" / f"{builder.NAME}.so"


def preload_shm_op() -> bool:
    """Load the cached shm op into DeepSpeed's op registry (before init_distributed); False if not cached."""
    import importlib.util

    try:
        builder = _shm_builder()
        path = shm_op_cache_path(builder)
        if path is None or not path.is_file() or not hasattr(builder, "_loaded_ops"):
            return False
        spec = importlib.util.spec_from_file_location(builder.NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        builder._loaded_ops[builder.NAME] = module  # the dict DeepSpeed's OpBuilder.load() consults first
        return True
    except Exception:  # noqa: BLE001 - DeepSpeed builds it as usual
        return False


def save_shm_op() -> None:
    """Keep the shm op DeepSpeed just built in codegen's cache dir (atomically; best effort)."""
    try:
        builder = _shm_builder()
        path = shm_op_cache_path(builder)
        if path is None or path.is_file() or builder.NAME not in getattr(builder, "_loaded_ops", {}):
            return
        built = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_dir(), builder.NAME, f"{builder.NAME}.so")
        if not built.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        shutil.copyfile(built, tmp)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - the cache is an optimisation only
        pass


def shm_op_cached() -> bool:
    """Whether a launch on CPU finds the shm op built (in codegen's cache or this environment's build dir)."""
    try:
        path = shm_op_cache_path()
    except Exception:  # noqa: BLE001
        path = None
    return bool(path and path.is_file()) or bool(list(Path(extensions_dir()).glob("deepspeed_shm_comm/*.so")))
