"""`patch --out`: a patched copy whose big files are symlinks to the originals (hundreds of GB stay put).

Every file of at least LINK_MIN_BYTES, or with a weight suffix, is linked wherever it sits (subfolders such as
`original/` and hidden ones such as `.git/lfs` included); the rest is copied. A link points at the resolved
file: for a Hugging Face cache snapshot that is the blob in `blobs/`, so moving or deleting the source dir, or
pruning the cache (`huggingface-cli delete-cache`), leaves the copy's links dangling: patch again from where
the weights now are. The copy is built in a temp dir beside `dst` and renamed into place at the end.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from codegen.errors import BadInput, IOFailure
from codegen.modeldir.layout import STATE_DIR, TMP_NAME, tmp_name

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt", ".npz", ".onnx")
LINK_MIN_BYTES = 1 << 20
#: never copied: codegen's own state and Python caches
SKIPPED = (STATE_DIR, "__pycache__")


def copy_with_linked_weights(src: Path, dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise BadInput(f"--out {dst} exists and is not empty: choose a new directory")
    parent = dst.parent
    if not parent.exists():
        raise BadInput(f"--out {dst}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise IOFailure(f"--out {dst}: {parent} is not writable")
    for stale in parent.iterdir():  # a killed `--out` run's half-made copy (its process is gone)
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and stale.name == tmp_name(dst.name, int(pid)) and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / tmp_name(dst.name, os.getpid())
    # --out inside the source dir: the copy must not copy itself (or other runs' temp copies)
    skip = {os.path.realpath(p) for p in (dst, tmp)}
    try:
        tmp.mkdir()
        _copy_tree(src, tmp, skip, top=True)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise IOFailure(f"cannot create {dst}: {exc.strerror}") from None


def _copy_tree(src: Path, dst: Path, skip: set[str], top: bool) -> None:
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if (top and entry.name in SKIPPED) or entry.name == "__pycache__" or TMP_NAME.match(entry.name):
            continue
        if os.path.realpath(entry.path) in skip:
            continue
        target = dst / entry.name
        if entry.is_dir() and entry.is_symlink():  # a linked folder stays a link (and can never loop)
            os.symlink(os.path.realpath(entry.path), target)
        elif entry.is_dir():
            target.mkdir()
            _copy_tree(Path(entry.path), target, skip, top=False)
        elif not os.path.exists(entry.path):  # a dangling link: keep it as it is
            os.symlink(os.readlink(entry.path), target)
        elif entry.name.endswith(WEIGHT_SUFFIXES) or entry.stat().st_size >= LINK_MIN_BYTES:
            os.symlink(os.path.realpath(entry.path), target)
        else:
            shutil.copyfile(entry.path, target)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
