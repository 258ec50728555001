"""This rank's DeepSpeed shared-memory buffer: found by its derived name, removed when the process ends.

DeepSpeed's CPU all-reduce creates one ~66 MiB buffer per rank in /dev/shm and never unlinks it; /dev/shm is
RAM. Only this rank's own buffer is ever removed, and only while it is the very file this process mapped.
"""

import atexit
import os
import signal

from codegen.policy.runtime.base import SUPPORTED_DEEPSPEED, PolicyError
from codegen.policy.runtime.probe import SHM_DIR, shm_buffer_name, shm_paths_in_maps


def _own_maps():
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def own_shm_buffer(rank, maps=None, env=None):
    """This rank's shm buffer path when DeepSpeed's shared-memory all-reduce is in use here, else None.

    In use = this process maps DeepSpeed shm buffers. Then one of them must carry the name derived for this
    rank (uid, MASTER_ADDR, MASTER_PORT, rank); if none does, the naming changed and nothing is deleted.
    """
    mapped = shm_paths_in_maps(_own_maps() if maps is None else maps)
    if not mapped:
        return None
    path = f"{SHM_DIR}/{shm_buffer_name(rank, env)}"
    if path not in mapped:
        raise PolicyError(f"DeepSpeed's shared-memory all-reduce maps {min(mapped)}, not {path} as this "
                          f"policy derives its rank's buffer name: unsupported DeepSpeed, use {SUPPORTED_DEEPSPEED}")
    return path


_REMOVING = {}


def remove_at_exit(path):
    """Unlink this rank's own shm buffer when the process ends: normal exit (atexit) and SIGTERM.

    Only `path`, and only while it is still the file this process mapped (same inode): another job's
    buffers carry another master address or port, and are never touched.
    """
    if path in _REMOVING:
        return
    stat = os.stat(path)
    _REMOVING[path] = (stat.st_dev, stat.st_ino)
    atexit.register(remove_buffer, path)
    chain_sigterm(lambda: remove_buffer(path))


def remove_buffer(path):
    """Unlink `path` if it is still the buffer `remove_at_exit` recorded; never raises (runs at exit)."""
    identity = _REMOVING.get(path)
    try:
        stat = os.stat(path)
        if identity == (stat.st_dev, stat.st_ino):
            os.unlink(path)
    except OSError:
        pass


def chain_sigterm(cleanup, signals=signal):
    """Run `cleanup` on SIGTERM, then what would have happened without it.

    An existing Python handler is chained to; with none (the default action) the process then dies of
    SIGTERM as before, so its exit status is unchanged. An ignored SIGTERM, or a handler set outside
    Python, is left alone (atexit still covers a normal exit). Off the main thread nothing is installed.
    """
    previous = signals.getsignal(signals.SIGTERM)
    if previous is signals.SIG_IGN or previous is None:
        return False

    def on_sigterm(signum, frame):
        cleanup()
        if callable(previous):
            return previous(signum, frame)
        signals.signal(signum, signals.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    try:
        signals.signal(signals.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        return False
    return True
