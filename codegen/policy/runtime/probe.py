"""What this policy relies on in DeepSpeed, checked before it touches a model: private names and the shm naming.

The policy reaches past DeepSpeed's public API in a few places (the backend's `inference_all_reduce` and
`shm_comm_op`, the row/column layer classes, the `mpu`/`tp_group` handling of `init_inference`) and deletes
the shared-memory buffers DeepSpeed's CPU all-reduce leaves in /dev/shm, by a name it derives the way
DeepSpeed's C++ builds it. `deepspeed_problems` lists every one of those that the installed DeepSpeed lacks,
so an unsupported release gets one line naming them all instead of a silent fallback. Standard library only
(the `shm` command reads the naming from here without importing torch); problems are returned, not raised.
"""

import importlib
import os
import re

#: DeepSpeed's CPU shared-memory all-reduce: /dev/shm/<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
SHM_DIR = "/dev/shm"
SHM_PREFIX = "deepspeed_allreduce_buffer"
#: where DeepSpeed's C++ names the buffer (relative to the deepspeed package), and the statements that do
SHM_SOURCES = {
    ("ops", "csrc", "cpu", "comm", "shm.cpp"): (
        r'#define\s+SHM_BUFFER_NAME\s+"' + SHM_PREFIX + '"',
        r'"%s_%d_%s_%s",\s*SHM_BUFFER_NAME,\s*getuid\(\),\s*addr_string,\s*port_string\s*\)',
        r'snprintf\(shm_name,\s*NAME_BUF_SIZE,\s*"%s_%d",\s*shm_name_prefix,\s*rank\s*\)',
    ),
    ("ops", "csrc", "cpu", "comm", "shm_interface.cpp"): (
        r'getenv\("MASTER_ADDR"\)',
        r'getenv\("MASTER_PORT"\)',
        r"shm_initialize\(size,\s*rank,\s*addr_string,\s*port_string\)",
    ),
}


def lookup(root, dotted):
    """`root.a.b.c` for `dotted` = "a.b.c", or None where any step is missing."""
    value = root
    for part in dotted.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def deepspeed_problems(deepspeed, shm_in_use=False):
    """Every private DeepSpeed name and behaviour the policy relies on that this DeepSpeed lacks (empty: none).

    Called once DeepSpeed's backend is up (the shared-memory buffers exist by then), before any sharding.
    """
    missing = []
    for dotted in ("comm.all_reduce", "comm.all_gather", "comm.inference_all_reduce", "init_inference",
                   "init_distributed"):
        if not callable(lookup(deepspeed, dotted)):
            missing.append(f"deepspeed.{dotted}")
    backend = lookup(deepspeed, "comm.comm.cdb")
    if backend is None:
        missing.append("deepspeed.comm.comm.cdb")
    else:
        if not callable(getattr(backend, "inference_all_reduce", None)):
            missing.append("deepspeed.comm.comm.cdb.inference_all_reduce")
        if not hasattr(backend, "shm_comm_op"):
            missing.append("deepspeed.comm.comm.cdb.shm_comm_op")
    for module in ("module_inject.layers", "inference.config"):
        if lookup(deepspeed, module) is None:
            try:
                importlib.import_module(f"{deepspeed.__name__}.{module}")
            except ImportError:
                missing.append(f"deepspeed.{module}")
    for cls in ("LinearAllreduce", "LinearLayer"):
        if not isinstance(lookup(deepspeed, f"module_inject.layers.{cls}"), type):
            missing.append(f"deepspeed.module_inject.layers.{cls}")
    tp_config = lookup(deepspeed, "inference.config.DeepSpeedTPConfig")
    fields = getattr(tp_config, "model_fields", None) or getattr(tp_config, "__fields__", None) or {}
    missing += [f"init_inference(tensor_parallel={{{f!r}: ...}})" for f in ("tp_size", "mpu", "tp_group")
                if f not in fields]
    if shm_in_use:
        missing += shm_naming_problems(os.path.dirname(deepspeed.__file__))
    return missing


def shm_naming_problems(package_dir):
    """How DeepSpeed's C++ names the shm buffer, checked against the name this policy derives and deletes."""
    problems = []
    for parts, patterns in SHM_SOURCES.items():
        path = os.path.join(package_dir, *parts)
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            problems.append(f"{'/'.join(parts)} (to confirm the shared-memory buffer naming)")
            continue
        problems += [f"{'/'.join(parts)}: the buffer naming /{pattern}/" for pattern in patterns
                     if not re.search(pattern, text)]
    return problems


def shm_job_prefix(env=None, uid=None):
    """The part of every buffer name one job's ranks share: `<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_`."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    return f"{SHM_PREFIX}_{uid}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_"


def shm_buffer_name(rank, env=None, uid=None):
    """The name DeepSpeed's CPU all-reduce gives rank `rank`'s buffer (`SHM_SOURCES` is what confirms it)."""
    return f"{shm_job_prefix(env, uid)}{rank}"


def shm_paths_in_maps(text, directory=SHM_DIR):
    """The DeepSpeed shm buffers in `directory` a /proc/<pid>/maps text maps (by path; unlinked ones excluded)."""
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and not fields[5].endswith(" (deleted)"):
            head, _, name = fields[5].rpartition("/")
            if head == directory and name.startswith(f"{SHM_PREFIX}_"):
                found.add(fields[5])
    return found
