"""This rank's DeepSpeed shared-memory buffer: found by its derived name, its name unlinked as soon as every rank
has mapped it.

DeepSpeed's CPU all-reduce creates one ~66 MiB buffer per rank in /dev/shm (RAM) and never unlinks it. Each rank
maps every peer's buffer, by name, while DeepSpeed initialises; after that the names are never used again, and a
mapping outlives its name. So once every rank is past initialisation (one barrier), each rank unlinks its own
buffer's name: the memory stays mapped until the ranks exit, and is freed by the kernel whatever ends them, SIGKILL
included. No signal handler is involved, so nothing delays SIGTERM. Only this rank's own buffer is ever removed,
and only while it is the very file this process mapped (same inode).
"""

import os

from codegen.policy.runtime.base import SUPPORTED_DEEPSPEED, PolicyError
from codegen.policy.runtime.probe import SHM_DIR, SHM_PREFIX, shm_buffer_name, shm_paths_in_maps


def _own_maps():
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def own_shm_buffer(rank, maps=None, env=None):
    """This rank's shm buffer path when DeepSpeed's shared-memory all-reduce is in use here, else None.

    In use = this process maps DeepSpeed shm buffers by a name that still exists. Then one of them must carry the
    name derived for this rank (uid, MASTER_ADDR, MASTER_PORT, rank); if none does, the naming changed and nothing
    is deleted.
    """
    mapped = shm_paths_in_maps(_own_maps() if maps is None else maps)
    if not mapped:
        return None
    path = f"{SHM_DIR}/{shm_buffer_name(rank, env)}"
    if path not in mapped:
        raise PolicyError(f"DeepSpeed's shared-memory all-reduce maps {min(mapped)}, not {path} as this "
                          f"policy derives its rank's buffer name: unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    return path


def maps_shm_buffers(maps=None):
    """Whether this process maps DeepSpeed shm buffers at all (named or already unlinked): the shm kernel is live."""
    text = _own_maps() if maps is None else maps
    return any(f"{SHM_DIR}/{SHM_PREFIX}_" in line for line in text.splitlines())


def unlink_once_mapped(path, barrier):
    """Unlink `path`, this rank's buffer, after `barrier()` (every rank has mapped every peer's buffer by then).

    Only while `path` is still the file it was before the barrier (same device and inode), the one this process
    maps: a file of another job that took the name meanwhile is left alone. Returns whether it was unlinked.
    """
    try:
        before = os.stat(path)
    except OSError:
        return False
    barrier()
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino):
            os.unlink(path)
            return True
    except OSError:
        pass
    return False
