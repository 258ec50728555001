"""The process a rank runs in, made right before DeepSpeed starts: any launcher, or none, and sane threads.

DeepSpeed's CPU shared-memory all-reduce needs LOCAL_SIZE (its own launcher sets it; torchrun sets
LOCAL_WORLD_SIZE instead, and without LOCAL_SIZE every rank segfaults at its first forward); a plain
`python serve.py` has no launcher variables at all (DeepSpeed then tries MPI discovery and fails on
mpi4py); neither launcher sets OMP_NUM_THREADS, so every rank runs as many threads as the machine has
cores; and every environment with the same Python builds DeepSpeed's CPU op into the same
~/.cache/torch_extensions/<py>_cpu, rebuilding it (half a minute or more) whenever environments alternate.
And glibc's malloc, on a CPU rank, hands every block over 32 MiB back to the OS when it is freed, so a prefill's
activations page-fault in afresh on every forward (`malloc_note`); and a CPU rank's weights lie in 4 KiB pages
unless they are asked for huge ones (`huge_page_weights`).
Each helper here changes only what is unset, returns what it did as a one-line note, and never raises.
And a process group this policy started is also ended by it, at exit (`destroy_group_at_exit`).
"""

import atexit
import ctypes
import hashlib
import mmap
import os
import platform
import socket
import sys

#: the variables a torchrun / DeepSpeed launcher gives every rank
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
#: glibc's `mallopt` parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size are taken from the heap and go back to it when freed, and up to this much free memory
#: stays at its top
KEPT_BLOCK_BYTES = 1 << 30
#: a user's own choice of allocator settings (glibc's variables), or of another allocator (preloaded)
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
#: how Linux grants transparent huge pages (`[madvise]`: to memory that asks), and their size
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
THP_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
#: `0` keeps a CPU rank's weights where they were loaded
HUGE_PAGES_VARIABLE = "CODEGEN_HUGE_PAGES"


def extensions_dir(env=None, prefix=None):
    """A torch-extensions build dir of this Python environment, where DeepSpeed builds its CPU op when nothing
    says otherwise: under ~/.cache/torch_extensions, keyed by the environment (its name and a hash of its real path,
    so one environment reached through links, e.g. several checkouts linking one cached virtualenv, builds once)."""
    env = os.environ if env is None else env
    prefix = os.path.realpath(sys.prefix if prefix is None else prefix)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(prefix.encode()).hexdigest()[:10]
    return os.path.join(base, "torch_extensions", f"codegen-{os.path.basename(prefix.rstrip('/'))}-{tag}")


def destroy_group_at_exit(dist):
    """End the process group this policy started while the interpreter is still whole, at exit.

    Left to interpreter finalization, gloo's worker threads can outlive it and abort the rank with SIGABRT
    ("terminate called without an active exception", pytorch/pytorch#190489) after the script's work is done,
    so the launcher reports a failed job. A program that destroyed the group itself makes this a no-op.
    """
    def destroy():
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_notes(tp_size, env=None):
    """Fill in what DeepSpeed needs and no launcher set, before it initialises; (notes, problem).

    - no launcher at all (RANK and WORLD_SIZE unset): with tp_size 1 this process is the one rank of a local
      group (RANK 0, WORLD_SIZE 1, a free loopback port); with more, `problem` says how to start the ranks;
    - LOCAL_SIZE unset where torchrun's LOCAL_WORLD_SIZE says every rank is on this node: LOCAL_SIZE is that;
    - TORCH_EXTENSIONS_DIR unset: this environment's own build dir (`extensions_dir`).
    """
    env = os.environ if env is None else env
    notes = []
    if not any(name in env for name in ("RANK", "WORLD_SIZE")):
        if tp_size != 1:
            return notes, (f"tp_size {tp_size} needs {tp_size} ranks, and this process was not started by a "
                           f"launcher: run it with `deepspeed --num_gpus {tp_size} SCRIPT` (CPU too) or "
                           f"`torchrun --nproc_per_node {tp_size} SCRIPT`, or serve the dir with "
                           f"`python -m codegen serve DIR --tp {tp_size}`")
        env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                    "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1")})
        env.setdefault("MASTER_PORT", str(_free_port()))
        notes.append("no launcher: running as the one rank of a local group (tp_size 1)")
    if "LOCAL_SIZE" not in env and env.get("LOCAL_WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
        env["LOCAL_SIZE"] = env["LOCAL_WORLD_SIZE"]
        notes.append(f"LOCAL_SIZE set to {env['LOCAL_SIZE']} from LOCAL_WORLD_SIZE (every rank on this node), "
                     "which DeepSpeed's CPU all-reduce needs")
    if "TORCH_EXTENSIONS_DIR" not in env:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir(env)
    return notes, None


def local_ranks(env=None, world=1):
    """How many ranks share this node: what the launcher says, else the whole group."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, world)


def affinity_cores():
    """The cores this process may run on (its CPU affinity), in order; None where the OS does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores():
    """How many cores this process may run on, else the machine's."""
    cores = affinity_cores()
    return len(cores) if cores else os.cpu_count() or 1


def thread_note(torch, ranks, env=None):
    """With OMP_NUM_THREADS unset, give each of the `ranks` local ranks its share of the cores; an explicit
    setting is left as it is. Returns the note to say, or None."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, usable_cores() // max(1, ranks))
    if torch.get_num_threads() == threads:
        return None
    torch.set_num_threads(threads)
    return (f"OMP_NUM_THREADS is unset: each of the {ranks} local ranks uses {threads} thread(s) of "
            f"{usable_cores()} cores (set OMP_NUM_THREADS to choose)")


def malloc_note(env=None):
    """Keep freed blocks up to KEPT_BLOCK_BYTES for reuse (glibc's `mallopt`) on a CPU rank; the note, or None.

    glibc maps every block over its mmap threshold (at most 32 MiB) afresh and unmaps it when freed, so each forward
    page-faults a prefill's activations in again (measured, one thread: a 32 MiB copy 22 ms and 8,193 faults, 7.8 ms
    with the blocks kept; a toy Qwen3-MoE 2-rank compiled prefill of 16x128 tokens 0.97 s, 0.69 s kept). Freed
    memory then stays with the process, as with tcmalloc, which vLLM's CPU engine preloads for the same reason.
    Left as it is: an explicit MALLOC_* variable or GLIBC_TUNABLES malloc setting, a preloaded allocator, a C
    library that is not glibc.
    """
    env = os.environ if env is None else env
    if any(name in env for name in MALLOC_VARIABLES) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return None
    if any(name in env.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS) or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    if mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES) != 1:
        return None
    return (f"glibc malloc: freed blocks up to {KEPT_BLOCK_BYTES >> 30} GiB are kept for reuse, not unmapped, so a "
            "prefill's activations do not page-fault in afresh every forward (set MALLOC_MMAP_THRESHOLD_ to choose)")


def huge_page_weights(model, env=None):
    """Move a CPU rank's weights of a huge page or more into memory that asks Linux for transparent huge pages (one
    at a time: each old storage is freed as its copy lands); the note, or None.

    A decode step or a prefill streams its expert weights from memory once, and in 4 KiB pages the walk to each page
    costs its share: measured on the Xeon, one MoE layer's experts of a TP=2 rank (Qwen3-30B-A3B's, gpt-oss-20b's),
    16 and 64 tokens, one thread: 3-7% faster in 2 MiB pages, with the other core streaming too. Most distributions
    grant huge pages only where asked (`madvise`), and torch's allocator does not ask. Left as they are: huge pages
    off (`never`) or not Linux, CODEGEN_HUGE_PAGES=0, weights smaller than a huge page, and weights that view or share
    another tensor's storage.
    """
    env = os.environ if env is None else env
    if env.get(HUGE_PAGES_VARIABLE, "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        with open(THP_MODE) as mode_file, open(THP_SIZE) as size_file:
            mode, page = mode_file.read(), int(size_file.read())
    except (OSError, ValueError):
        return None
    if "[never]" in mode or page <= 0:
        return None
    import torch

    moved = 0
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu" and param.nbytes >= page and _owns_dense_storage(param):
                try:
                    param.data = _in_huge_pages(torch, param.data, page)
                except OSError:  # a kernel built without them refuses the advice: nothing is moved
                    break
                moved += param.nbytes
    if not moved:
        return None
    amount = f"{moved / (1 << 30):.1f} GiB" if moved >= 1 << 30 else f"{moved >> 20} MiB"
    return (f"{amount} of weights in {page >> 20} MiB pages (transparent huge pages, asked for with madvise; "
            f"{HUGE_PAGES_VARIABLE}=0 keeps them where they were loaded)")


def _owns_dense_storage(tensor):
    """Whether `tensor` covers its whole storage exactly once, in any order of its dims (a view or an expanded tensor
    does not)."""
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (tensor.storage_offset() == 0 and span == tensor.numel() - 1
            and tensor.untyped_storage().nbytes() == tensor.nbytes)


def _in_huge_pages(torch, tensor, page):
    """A copy of `tensor`, same strides, in a private anonymous mapping advised MADV_HUGEPAGE and starting on a page
    boundary (the tensor keeps the mapping alive)."""
    region = mmap.mmap(-1, tensor.nbytes + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % page
    flat = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
    moved = flat.as_strided(tensor.shape, tensor.stride())
    moved.copy_(tensor)
    return moved
