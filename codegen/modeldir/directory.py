"""A model dir as codegen sees it: its files, the typed manifest, each recorded file's status, the lock.

Writes go through codegen.modeldir.transaction (ordered, all-or-nothing; see there for the guarantee). Every command
classifies each recorded file as original / ours / edited by its bytes (a file that went through the Hugging
Face cache is a symlink into `blobs/` with the very same bytes), so an interrupted run is finished or undone
by the next `patch` or `revert`, and user edits are never overwritten silently. `patch` never rewrites a file
the unpatched config.json loads (remote code gets a new module name, see codegen.patch.source), so a kill before
the commit point leaves a dir that loads byte-for-byte as before. Leftovers of a killed run (temp files, a
state dir whose manifest was never written) are removed by the next run that takes the lock for writing;
`patch --check` only reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from codegen.errors import BadInput, IOFailure
from codegen.modeldir.manifest import Manifest
from codegen.modeldir.layout import CONFIG, MANIFEST, ORIGINALS, STATE_DIR, TMP_NAME
from codegen.modeldir.transaction import Transaction, fsync_dir, sha256

LOCK_WAIT_S = 30.0

class ModelDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.state = path / STATE_DIR

    # ------------------------------------------------------------------------------------------ reading

    def check_exists(self) -> None:
        if not self.path.exists():
            raise BadInput(f"{self.path}: no such directory")
        if not self.path.is_dir():
            hint = " (pass the directory that holds it)" if self.path.name == CONFIG else ""
            raise BadInput(f"{self.path}: not a directory{hint}")

    def manifest(self) -> Manifest | None:
        path = self.state / MANIFEST
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise BadInput(f"{path} is unreadable or not JSON: restore it, or remove {self.state} to start over") from None
        try:
            return Manifest.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BadInput(f"{path} is not a codegen manifest: remove {self.state} to start over") from None

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

    def original_bytes(self, name: str, manifest: Manifest | None) -> bytes | None:
        """A file's content as it was before codegen touched the dir."""
        record = manifest.files.get(name) if manifest is not None else None
        if record is None:
            return self.current_bytes(name)
        original = record.original
        if original.kind == "absent":
            return None
        if original.kind == "symlink":
            return self.bytes_of_link(original.target or "")
        backup = self.state / ORIGINALS / name
        try:
            return backup.read_bytes()
        except OSError:
            raise BadInput(f"backup {backup} is missing: the dir cannot be restored; remove {self.state}") from None

    def bytes_of_link(self, target: str) -> bytes | None:
        path = Path(target) if os.path.isabs(target) else self.path / target
        try:
            return path.read_bytes()
        except OSError:
            return None

    def status(self, manifest: Manifest) -> dict[str, str]:
        """Per recorded file: 'ours' (as codegen wrote it), 'original', or 'edited' (anything else).

        Bytes decide, not file types: a patched dir uploaded and downloaded again through the hub has every
        file as a symlink into `blobs/`, with codegen's bytes."""
        result = {}
        for name, record in manifest.files.items():
            path = self.path / name
            original = record.original
            if original.kind == "symlink" and path.is_symlink() and os.readlink(path) == original.target:
                result[name] = "original"
                continue
            data = self.current_bytes(name)
            digest = sha256(data) if data is not None else None
            if digest is not None and digest in record.ours:
                result[name] = "ours"
            elif original.kind == "absent" and not path.is_symlink() and not path.exists():
                result[name] = "original"
            elif original.kind == "file" and digest is not None and digest == original.sha256:
                result[name] = "original"
            else:
                result[name] = "edited"
        return result

    def exactly_as_written(self, manifest: Manifest) -> bool:
        """Every recorded file holds the bytes the last complete write gave it (not an interrupted one's)."""
        for name, record in manifest.files.items():
            data = self.current_bytes(name)
            if record.written_sha256 is None or data is None or sha256(data) != record.written_sha256:
                return False
        return bool(manifest.files)

    # ------------------------------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def locked(self, wait_s: float | None = None, shared: bool = False) -> Iterator[None]:
        """flock on the directory itself: no lock file, so nothing is left behind in the user's dir.
        `shared` (for --check / --diff) waits for a writer to finish and never cleans anything up."""
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
                    fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
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
            if not shared:
                self._clean_leftovers()
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------ writing

    def check_writable(self) -> None:
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise IOFailure(f"{self.path} is not writable: fix its permissions or use --out DIR for a patched copy")

    def transaction(self) -> Transaction:
        return Transaction(self.path)

    def apply(self, planned: dict[str, bytes], manifest: Manifest, previous: Manifest | None, force: bool) -> None:
        """Write `planned` (config.json last) and `manifest` (its `files` filled in here)."""
        self.check_writable()
        status = self.status(previous) if previous is not None else {}
        self.transaction().apply(planned, manifest, previous, status, force)

    def revert(self, manifest: Manifest, force: bool) -> list[str]:
        self.check_writable()
        return self.transaction().revert(manifest, self.status(manifest), force)

    # ---------------------------------------------------------------------------------------- internals

    def leftovers(self) -> list[Path]:
        """Temp files of a killed run (with the lock held, no other run is mid-write)."""
        found = []
        for folder in (self.path, self.state, self.state / ORIGINALS):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            found += [Path(e.path) for e in entries if TMP_NAME.match(e.name) and not e.is_dir(follow_symlinks=False)]
        return found

    def _clean_leftovers(self) -> None:
        """Temp files here are a killed run's; and a state dir without a manifest is a first patch killed
        before writing it (no user file touched yet) or a revert killed after dropping it (every file
        restored). Both are removed. A manifest-less state dir whose backups differ from the dir's files is
        left alone: its manifest was lost some other way and the backups are all that's left."""
        for path in self.leftovers():
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self.state.is_symlink() or not self.state.is_dir() or (self.state / MANIFEST).exists():
            return
        with contextlib.suppress(OSError):
            backups = self.state / ORIGINALS
            for entry in (os.scandir(backups) if backups.is_dir() else ()):
                if not entry.is_file(follow_symlinks=False):
                    return
                if self.bytes_of_link(entry.name) != Path(entry.path).read_bytes():
                    return
            shutil.rmtree(self.state)
            fsync_dir(self.path)
