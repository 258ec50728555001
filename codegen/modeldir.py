"""Model-dir I/O: all-or-nothing writes, a manifest that can restore every byte, a lock against races.

The order of operations is the guarantee:
1. originals are copied to `.codegen/originals/` and the manifest is written (atomically) first;
2. generated files go in next, each via temp file + fsync + rename (a symlink is replaced, never
   written through, so a Hugging Face `blobs/` store is never touched);
3. `config.json` goes in last: it is the commit point. Before it the dir loads exactly as before;
   after it the dir is fully patched.
Every command classifies each recorded file as original / ours / edited, so an interrupted run is
finished or undone by the next `patch` or `revert`, and user edits are never overwritten silently.
`patch` never rewrites a file the unpatched config.json loads (remote code gets a new module name, see
codegen.source), so a kill before step 3 leaves a dir that loads byte-for-byte as before; files an
earlier patch wrote but this one doesn't are restored only after the commit point.
Leftovers of a killed run (temp files, a state dir whose manifest was never written) are removed by the
next run that takes the lock; a write that fails (disk full, permissions) rolls a first patch back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from codegen.errors import BadInput, IOFailure, UserEdits

STATE_DIR = ".codegen"
MANIFEST = "manifest.json"
ORIGINALS = "originals"
CONFIG = "config.json"
LOCK_WAIT_S = 30.0

#: test hook: `CODEGEN_FAULT_AFTER=N` kills the process (exit 137, no cleanup) after the N-th file operation
_FAULT_ENV = "CODEGEN_FAULT_AFTER"
#: `.<name>.codegen-tmp-<pid>`: what `_atomic_write` / `_restore` write before the rename
_TMP_NAME = re.compile(r"^\..+\.codegen-tmp-[0-9]+$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Original:
    """What a path was before the first patch: absent, a regular file (backed up), or a symlink."""

    kind: str  # "absent" | "file" | "symlink"
    sha256: str | None = None
    mode: int | None = None
    target: str | None = None  # symlink target, verbatim

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class ModelDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = path / STATE_DIR
        self._ops = 0

    # ------------------------------------------------------------------------------------------ reading

    def check_exists(self) -> None:
        if not self.path.exists():
            raise BadInput(f"{self.path}: no such directory")
        if not self.path.is_dir():
            raise BadInput(f"{self.path}: not a directory")

    def manifest(self) -> dict | None:
        path = self.state / MANIFEST
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise BadInput(f"{path} is unreadable or not JSON: restore it, or remove {self.state} to start over") from None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise BadInput(f"{path} is not a codegen manifest: remove {self.state} to start over")
        return data

    def current_bytes(self, name: str) -> bytes | None:
        path = self.path / name
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise BadInput(f"{path} is a directory, expected a file") from None
        except OSError as exc:
            raise IOFailure(f"cannot read {path}: {exc.strerror}") from None

    def original_bytes(self, name: str, manifest: dict | None) -> bytes | None:
        """A file's content as it was before codegen touched the dir."""
        record = (manifest or {}).get("files", {}).get(name)
        if record is None:
            return self.current_bytes(name)
        original = record["original"]
        if original["kind"] == "absent":
            return None
        if original["kind"] == "symlink":
            return self.current_bytes_of_link(original["target"])
        backup = self.state / ORIGINALS / name
        try:
            return backup.read_bytes()
        except OSError:
            raise BadInput(f"backup {backup} is missing: the dir cannot be restored; remove {self.state}") from None

    def current_bytes_of_link(self, target: str) -> bytes | None:
        path = Path(target) if os.path.isabs(target) else self.path / target
        try:
            return path.read_bytes()
        except OSError:
            return None

    def status(self, manifest: dict) -> dict[str, str]:
        """Per recorded file: 'ours' (as codegen wrote it), 'original', or 'edited' (anything else)."""
        result = {}
        for name, record in manifest["files"].items():
            path = self.path / name
            original = record["original"]
            if original["kind"] == "symlink" and path.is_symlink() and os.readlink(path) == original["target"]:
                result[name] = "original"
                continue
            data = self.current_bytes(name)
            digest = sha256(data) if data is not None else None
            ours = {record.get("written_sha256"), record.get("previous_written_sha256")} - {None}
            if digest is not None and digest in ours and not path.is_symlink():
                result[name] = "ours"
            elif original["kind"] == "absent" and not path.is_symlink() and not path.exists():
                result[name] = "original"
            elif original["kind"] == "file" and digest == original.get("sha256") and not path.is_symlink():
                result[name] = "original"
            else:
                result[name] = "edited"
        return result

    # ------------------------------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def locked(self, wait_s: float | None = None) -> Iterator[None]:
        """flock on the directory itself: no lock file, so nothing is left behind in the user's dir."""
        wait_s = LOCK_WAIT_S if wait_s is None else wait_s
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise IOFailure(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            deadline = time.monotonic() + wait_s
            said = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise IOFailure(
                            f"{self.path} is locked by another codegen run: wait for it to finish and retry"
                        ) from None
                    if not said:
                        print(f"{self.path}: another codegen run holds the lock; waiting up to {wait_s:.0f}s",
                              file=sys.stderr)
                        said = True
                    time.sleep(0.1)
            self._clean_leftovers()
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ writing

    def check_writable(self) -> None:
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise IOFailure(f"{self.path} is not writable: fix its permissions or use --out DIR for a patched copy")

    def apply(self, planned: dict[str, bytes], manifest_info: dict, previous: dict | None, force: bool) -> None:
        """Write `planned` (config.json last) and a manifest that can restore every byte it replaces."""
        self.check_writable()
        files = dict((previous or {}).get("files", {}))
        if previous is not None:
            status = self.status(previous)
            edited = [n for n, s in status.items() if s == "edited"]
            if edited and not force:
                raise UserEdits(
                    f"{', '.join(sorted(edited))} changed since codegen patched {self.path}: "
                    "re-run with --force to overwrite (your edits are lost) or revert them"
                )
        else:
            status = {}
        # Files an earlier patch wrote but this one doesn't: back to their originals, after the commit
        # point (the patched config.json may still load them until the new one is in).
        dropped = sorted(n for n in files if n not in planned)
        order = sorted((n for n in planned if n != CONFIG)) + ([CONFIG] if CONFIG in planned else [])
        written: list[str] = []
        fresh = previous is None and not self.state.exists()  # a failure can undo everything
        try:
            for name in order:
                if name not in files:
                    files[name] = {"original": self._record_original(name).to_json()}
                record = files[name] = dict(files[name])
                record["written_sha256"] = sha256(planned[name])
                record.pop("previous_written_sha256", None)
                if status.get(name) == "ours":
                    # still ours if this run dies before rewriting it (else it would read as a user edit)
                    current = sha256(self.current_bytes(name) or b"")
                    if current != record["written_sha256"]:
                        record["previous_written_sha256"] = current
            manifest = {**manifest_info, "files": {n: files[n] for n in sorted(files)}}  # dropped kept for now
            self._write_manifest(manifest)
            for name in order:
                self._atomic_write(self.path / name, planned[name], self._mode_for(name, files[name]["original"]))
                written.append(name)
            if dropped:
                for name in dropped:
                    if status.get(name) != "original":
                        self._restore(name, files[name]["original"])
                for name in dropped:
                    manifest["files"].pop(name)
                self._write_manifest(manifest)
        except OSError as exc:
            rolled_back = fresh and self._roll_back(written, files)
            raise IOFailure(self._io_message(exc, rolled_back)) from None

    def revert(self, manifest: dict, force: bool) -> list[str]:
        """Restore every recorded file (config.json first: the dir loads as before at once), then forget."""
        self.check_writable()
        status = self.status(manifest)
        edited = [n for n, s in status.items() if s == "edited"]
        if edited and not force:
            raise UserEdits(
                f"{', '.join(sorted(edited))} changed since codegen patched {self.path}: "
                "re-run revert with --force to discard those edits"
            )
        names = sorted(manifest["files"], key=lambda n: (n != CONFIG, n))
        try:
            for name in names:
                if status[name] != "original":
                    self._restore(name, manifest["files"][name]["original"])
            self._remove_state()
        except OSError as exc:
            raise IOFailure(self._io_message(exc, rolled_back=None)) from None
        return [n for n in names if status[n] != "original"]

    # ---------------------------------------------------------------------------------------- internals

    def _roll_back(self, written: list[str], files: dict) -> bool:
        """A first patch failed (disk full, permissions): undo it so the dir is exactly as before."""
        try:
            for name in reversed(written):
                self._restore(name, files[name]["original"])
            if self.state.exists():
                shutil.rmtree(self.state)
                self._fsync_dir(self.path)
            return True
        except OSError:
            return False

    def _clean_leftovers(self) -> None:
        """With the lock held no other run is mid-write, so temp files here are a killed run's; and a state
        dir without a manifest is a first patch killed before writing it (no user file touched yet) or a
        revert killed after dropping it (every file restored). Both are removed. A manifest-less state dir
        whose backups differ from the dir's files is left alone: its manifest was lost some other way and
        the backups are all that's left."""
        for folder in (self.path, self.state, self.state / ORIGINALS):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if _TMP_NAME.match(entry.name) and not entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        if self.state.is_symlink() or not self.state.is_dir() or (self.state / MANIFEST).exists():
            return
        with contextlib.suppress(OSError):
            backups = self.state / ORIGINALS
            for entry in (os.scandir(backups) if backups.is_dir() else ()):
                if not entry.is_file(follow_symlinks=False):
                    return
                if self.current_bytes_of_link(entry.name) != Path(entry.path).read_bytes():
                    return
            shutil.rmtree(self.state)
            self._fsync_dir(self.path)

    def _record_original(self, name: str) -> Original:
        path = self.path / name
        if path.is_symlink():
            return Original("symlink", target=os.readlink(path))
        if not path.exists():
            return Original("absent")
        data = path.read_bytes()
        mode = stat.S_IMODE(path.stat().st_mode)
        self._atomic_write(self.state / ORIGINALS / name, data, 0o444)
        return Original("file", sha256=sha256(data), mode=mode)

    @staticmethod
    def _mode_for(name: str, original: dict) -> int:
        if original.get("kind") == "file" and original.get("mode") is not None:
            return int(original["mode"]) | 0o200
        return 0o644

    def _restore(self, name: str, original: dict) -> None:
        path = self.path / name
        kind = original["kind"]
        if kind == "absent":
            if path.is_symlink() or path.exists():
                path.unlink()
                self._fsync_dir(path.parent)
                self._step()
        elif kind == "symlink":
            tmp = path.with_name(f".{name}.codegen-tmp-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(original["target"], tmp)
            os.replace(tmp, path)
            self._fsync_dir(path.parent)
            self._step()
        else:
            data = (self.state / ORIGINALS / name).read_bytes()
            self._atomic_write(path, data, int(original.get("mode", 0o644)))

    def _write_manifest(self, manifest: dict) -> None:
        data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
        self._atomic_write(self.state / MANIFEST, data, 0o644)

    def _remove_state(self) -> None:
        if self.state.exists():
            # the manifest goes first: without it, a half-removed state dir is just leftovers
            with contextlib.suppress(FileNotFoundError):
                (self.state / MANIFEST).unlink()
                self._step()
            shutil.rmtree(self.state)
            self._fsync_dir(self.path)
            self._step()

    def _atomic_write(self, path: Path, data: bytes, mode: int) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True)
            self._fsync_dir(path.parent.parent)
        tmp = path.with_name(f".{path.name}.codegen-tmp-{os.getpid()}")
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
        self._fsync_dir(path.parent)
        self._step()

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _step(self) -> None:
        self._ops += 1
        limit = os.environ.get(_FAULT_ENV)
        if limit is not None and self._ops >= int(limit):
            os._exit(137)

    def _io_message(self, exc: OSError, rolled_back: bool | None) -> str:
        if exc.errno == errno.ENOSPC:
            what = "disk full"
        elif exc.errno == errno.EROFS:
            what = "read-only file system"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            what = "permission denied"
        else:
            what = exc.strerror or str(exc)
        where = Path(exc.filename or self.path)
        if _TMP_NAME.match(where.name):  # name the file being written, not its temp file
            where = where.with_name(where.name[1:].rsplit(".codegen-tmp-", 1)[0])
        if rolled_back:
            outcome = f"{self.path} is unchanged; free space / fix permissions and re-run"
        elif rolled_back is None:  # revert
            outcome = f"nothing half-written; free space / fix permissions and re-run revert on {self.path}"
        else:
            outcome = (f"nothing half-written; free space / fix permissions, then re-run patch to finish "
                       f"or revert to undo {self.path}")
        return f"{what} writing {where}: {outcome}"


def copy_with_linked_weights(src: Path, dst: Path) -> None:
    """`--out`: a copy whose weight files are symlinks to the originals (hundreds of GB stay put)."""
    weight_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise BadInput(f"--out {dst} exists and is not empty: choose a new directory")
    parent = dst.parent
    if not parent.exists():
        raise BadInput(f"--out {dst}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise IOFailure(f"--out {dst}: {parent} is not writable")
    for stale in parent.iterdir():  # a killed `--out` run's half-made copy (its process is gone)
        pid = stale.name.rsplit(".codegen-tmp-", 1)[-1]
        if stale.name.startswith(f".{dst.name}.codegen-tmp-") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f".{dst.name}.codegen-tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        for entry in sorted(src.iterdir()):
            if entry.name in (STATE_DIR, "__pycache__"):
                continue
            target = tmp / entry.name
            if entry.is_dir():
                shutil.copytree(entry, target, symlinks=False)
            elif entry.name.endswith(weight_suffixes):
                os.symlink(entry.resolve(), target)
            else:
                shutil.copyfile(entry, target)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise IOFailure(f"cannot create {dst}: {exc.strerror}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
