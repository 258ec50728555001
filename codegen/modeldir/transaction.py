"""The ordered, all-or-nothing write of a patch, its rollback, and revert.

The order of operations is the guarantee:
1. originals are copied to `.codegen/originals/` and the manifest is written (atomically) first;
2. generated files go in next, each via temp file + fsync + rename (a symlink is replaced, never
   written through, so a Hugging Face `blobs/` store is never touched);
3. `config.json` goes in last: it is the commit point. Before it the dir loads exactly as before;
   after it the dir is fully patched.
Files an earlier patch wrote but this one doesn't are restored only after the commit point. A write that
fails (disk full, permissions) rolls a first patch back; revert restores config.json first (the dir loads
as before at once), then the rest, then drops the state dir (manifest first).

Tests kill a run between two file operations by installing `step_hook` (called after each one); production
code never sets it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Callable

from codegen.errors import IOFailure, UserEdits
from codegen.modeldir.layout import CONFIG, MANIFEST, ORIGINALS, STATE_DIR, TMP_NAME, tmp_name
from codegen.modeldir.manifest import FileRecord, Manifest, Original


#: called after every file operation (tests inject a hook that kills the process there)
step_hook: Callable[[], None] | None = None


def _step() -> None:
    if step_hook is not None:
        step_hook()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True)
        fsync_dir(path.parent.parent)
    tmp = path.with_name(tmp_name(path.name, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # replaces a symlink itself; never writes through it
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    _step()


def sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


class Transaction:
    """Writes into one model dir; `status` (per recorded file: ours / original / edited) comes from ModelDir."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = path / STATE_DIR

    # ------------------------------------------------------------------------------------------ patch

    def apply(self, planned: dict[str, bytes], manifest: Manifest, previous: Manifest | None,
              status: dict[str, str], force: bool) -> None:
        """Write `planned` (config.json last) and a manifest that can restore every byte it replaces."""
        files = {n: FileRecord(r.original, r.written_sha256, r.previous_written_sha256)
                 for n, r in (previous.files if previous else {}).items()}
        edited = [n for n, s in status.items() if s == "edited"]
        if edited and not force:
            raise UserEdits(
                f"{', '.join(sorted(edited))} changed since codegen patched {self.path}: "
                "re-run with --force to overwrite (your edits are lost) or revert them"
            )
        dropped = sorted(n for n in files if n not in planned)
        order = sorted(n for n in planned if n != CONFIG) + ([CONFIG] if CONFIG in planned else [])
        written: list[str] = []
        fresh = previous is None and not self.state.exists()  # a failure can undo everything
        try:
            for name in order:
                if name not in files:
                    files[name] = FileRecord(self._record_original(name))
                record = files[name]
                record.written_sha256 = sha256(planned[name])
                record.previous_written_sha256 = None
                if status.get(name) == "ours":
                    # still ours if this run dies before rewriting it (else it would read as a user edit)
                    current = sha256(self._read(name) or b"")
                    if current != record.written_sha256:
                        record.previous_written_sha256 = current
            manifest.files = dict(sorted(files.items()))  # dropped ones kept for now
            self.write_manifest(manifest)
            for name in order:
                atomic_write(self.path / name, planned[name], self._mode_for(files[name].original))
                written.append(name)
            if dropped:
                for name in dropped:
                    if status.get(name) != "original":
                        self.restore(name, files[name].original)
                for name in dropped:
                    manifest.files.pop(name)
                self.write_manifest(manifest)
        except OSError as exc:
            rolled_back = fresh and self._roll_back(written, files)
            raise IOFailure(self.io_message(exc, rolled_back)) from None

    # ----------------------------------------------------------------------------------------- revert

    def revert(self, manifest: Manifest, status: dict[str, str], force: bool) -> list[str]:
        """Restore every recorded file (config.json first: the dir loads as before at once), then forget."""
        edited = [n for n, s in status.items() if s == "edited"]
        if edited and not force:
            raise UserEdits(
                f"{', '.join(sorted(edited))} changed since codegen patched {self.path}: "
                "re-run revert with --force to discard those edits"
            )
        names = sorted(manifest.files, key=lambda n: (n != CONFIG, n))
        try:
            for name in names:
                if status[name] != "original":
                    self.restore(name, manifest.files[name].original)
            self.remove_state()
        except OSError as exc:
            raise IOFailure(self.io_message(exc, rolled_back=None)) from None
        return [n for n in names if status[n] != "original"]

    # ---------------------------------------------------------------------------------------- internals

    def _read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except OSError:
            return None

    def _roll_back(self, written: list[str], files: dict[str, FileRecord]) -> bool:
        """A first patch failed (disk full, permissions): undo it so the dir is exactly as before."""
        try:
            for name in reversed(written):
                self.restore(name, files[name].original)
            if self.state.exists():
                shutil.rmtree(self.state)
                fsync_dir(self.path)
            return True
        except OSError:
            return False

    def _record_original(self, name: str) -> Original:
        path = self.path / name
        if path.is_symlink():
            return Original("symlink", target=os.readlink(path))
        if not path.exists():
            return Original("absent")
        data = path.read_bytes()
        mode = stat.S_IMODE(path.stat().st_mode)
        atomic_write(self.state / ORIGINALS / name, data, 0o444)
        return Original("file", sha256=sha256(data), mode=mode)

    @staticmethod
    def _mode_for(original: Original) -> int:
        if original.kind == "file" and original.mode is not None:
            return int(original.mode) | 0o200
        return 0o644

    def restore(self, name: str, original: Original) -> None:
        path = self.path / name
        if original.kind == "absent":
            if path.is_symlink() or path.exists():
                path.unlink()
                fsync_dir(path.parent)
                _step()
        elif original.kind == "symlink":
            tmp = path.with_name(tmp_name(name, os.getpid()))
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(original.target, tmp)
            os.replace(tmp, path)
            fsync_dir(path.parent)
            _step()
        else:
            data = (self.state / ORIGINALS / name).read_bytes()
            atomic_write(path, data, int(original.mode if original.mode is not None else 0o644))

    def remove(self, name: str) -> None:
        """Delete one file codegen wrote (revert without a manifest)."""
        self.restore(name, Original("absent"))

    def write_manifest(self, manifest: Manifest) -> None:
        atomic_write(self.state / MANIFEST, manifest.dumps(), 0o644)

    def remove_state(self) -> None:
        if self.state.is_symlink():
            self.state.unlink()
            fsync_dir(self.path)
            _step()
        elif self.state.exists():
            # the manifest goes first: without it, a half-removed state dir is just leftovers
            with contextlib.suppress(FileNotFoundError):
                (self.state / MANIFEST).unlink()
                _step()
            shutil.rmtree(self.state)
            fsync_dir(self.path)
            _step()

    def io_message(self, exc: OSError, rolled_back: bool | None) -> str:
        if exc.errno == errno.ENOSPC:
            what = "disk full"
        elif exc.errno == errno.EROFS:
            what = "read-only file system"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            what = "permission denied"
        else:
            what = exc.strerror or str(exc)
        where = Path(exc.filename or self.path)
        if TMP_NAME.match(where.name):  # name the file being written, not its temp file
            where = where.with_name(where.name[1:].rsplit(".codegen-tmp-", 1)[0])
        if rolled_back:
            outcome = f"{self.path} is unchanged; free space / fix permissions and re-run"
        elif rolled_back is None:  # revert
            outcome = f"nothing half-written; free space / fix permissions and re-run revert on {self.path}"
        else:
            outcome = (f"nothing half-written; free space / fix permissions, then re-run patch to finish "
                       f"or revert to undo {self.path}")
        return f"{what} writing {where}: {outcome}"
