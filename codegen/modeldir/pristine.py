"""The dir as it was before `patch`, rebuilt beside it: what verify and the tests compare a patched dir with.

The originals come from the manifest's backups; every other file is a symlink to the patched dir's own, so a
multi-GB checkpoint costs nothing to rebuild.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from codegen.errors import BadInput, IOFailure
from codegen.modeldir.directory import ModelDir
from codegen.modeldir.layout import ORIGINALS, STATE_DIR


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
            if entry.name in (STATE_DIR, "__pycache__") or entry.name in recorded:
                continue
            os.symlink(entry.resolve(), into / entry.name)
        for name, record in recorded.items():
            original = record.original
            if original.kind == "file":
                shutil.copyfile(model_dir / STATE_DIR / ORIGINALS / name, into / name)
            elif original.kind == "symlink":
                target = Path(original.target)
                os.symlink(target if target.is_absolute() else (model_dir / target).resolve(), into / name)
    except OSError as exc:
        raise IOFailure(f"cannot build the unpatched reference in {into}: {exc.strerror}") from None
    return into
