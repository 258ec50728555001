"""`python -m codegen shm [--clean]`: DeepSpeed's CPU all-reduce buffers that earlier runs left in /dev/shm.

DeepSpeed's shared-memory all-reduce creates one ~66 MiB buffer per rank and never unlinks it; /dev/shm is
RAM. The generated policy unlinks its own rank's buffer name as soon as every rank has mapped it
(codegen.policy.runtime.shm), so a run under the policy leaves nothing, SIGKILL included; a run without the policy
(stock AutoTP, an older patched dir) or one killed before that point leaves them behind. This lists them, one line each
with size and age, and a total; `--clean` removes those no live process maps (every readable
/proc/<pid>/maps is checked; the total line says how many processes' maps could not be read), keeping any
buffer younger than GRACE_S, which a run may still be setting up. Unlinking never disturbs a process that
has the buffer mapped already: only a rank that has yet to open it by name would miss it.

Exit codes: 0 listed / cleaned; 4 (codegen.errors.IO_FAILURE) a buffer that should go could not be removed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from codegen.errors import IO_FAILURE, OK
from codegen.policy.runtime.probe import SHM_DIR, SHM_PREFIX, shm_paths_in_maps

#: a buffer modified less than this long ago may belong to a run that is still setting up: never removed
GRACE_S = 30.0


@dataclass(frozen=True)
class Buffer:
    path: str
    size: int
    age_s: float
    owner: int
    mapped_by: tuple[int, ...] = field(default=())


def default_dir() -> str:
    return SHM_DIR


def find_buffers(directory: str, now: float | None = None) -> list[Buffer]:
    """Every DeepSpeed all-reduce buffer in `directory`, with the pids that map it, sorted by path."""
    prefix = SHM_PREFIX + "_"
    now = time.time() if now is None else now
    mapped, _ = scan_maps(directory)
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        if not name.startswith(prefix):
            continue
        try:
            stat = os.stat(path, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        found.append(Buffer(path, stat.st_size, max(0.0, now - stat.st_mtime), stat.st_uid,
                            tuple(sorted(mapped.get(path, ())))))
    return found


def scan_maps(directory: str, proc: str = "/proc") -> tuple[dict[str, set[int]], int]:
    """({buffer path: pids mapping it}, how many processes' maps could not be read)."""
    mapped: dict[str, set[int]] = {}
    unreadable = 0
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "maps"), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue  # the process ended
        for path in shm_paths_in_maps(text, directory):
            mapped.setdefault(path, set()).add(int(entry))
    return mapped, unreadable


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _state(buffer: Buffer) -> str | None:
    """Why `buffer` must stay, or None when nothing uses it."""
    if buffer.mapped_by:
        return "in use (pid " + ", ".join(map(str, buffer.mapped_by)) + ")"
    if buffer.age_s < GRACE_S:
        return f"too new (< {GRACE_S:.0f}s)"
    return None


def run(directory: str | None, clean: bool) -> int:
    """List (or with `clean` remove) the buffers in `directory` (default /dev/shm); one line each and a total."""
    directory = os.path.abspath(directory or default_dir())
    buffers = find_buffers(directory)
    _, unreadable = scan_maps(directory)
    removed, kept, failed = [], [], []  # listing only: `removed` holds what --clean would remove
    for buffer in buffers:
        reason = _state(buffer)
        head = f"{buffer.path}  {_mib(buffer.size)}  {_age(buffer.age_s)}"
        if not clean:
            print(f"{head}  {reason or 'left behind'}")
            (kept if reason else removed).append(buffer)
            continue
        if reason:
            print(f"kept     {head}  {reason}")
            kept.append(buffer)
            continue
        try:
            os.unlink(buffer.path)
        except FileNotFoundError:
            pass  # its owner removed it meanwhile
        except OSError as exc:
            print(f"FAILED   {head}  {exc.strerror or exc}")
            failed.append(buffer)
            continue
        print(f"removed  {head}")
        removed.append(buffer)
    total = sum(b.size for b in buffers)
    unchecked = f" ({unreadable} processes' maps unreadable, not checked)" if unreadable else ""
    if clean:
        print(f"removed {len(removed)} of {len(buffers)} buffers ({_mib(sum(b.size for b in removed))}); "
              f"kept {len(kept)}" + (f"; {len(failed)} could not be removed" if failed else "") + unchecked)
    else:
        hint = " (`python -m codegen shm --clean` removes those)" if removed else ""
        print(f"{len(buffers)} buffers, {_mib(total)} in {directory}: {len(kept)} in use or too new, "
              f"{len(removed)} left behind{hint}{unchecked}")
    return IO_FAILURE if failed else OK
