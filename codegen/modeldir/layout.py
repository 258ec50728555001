"""The names of what codegen puts into a model dir: one definition, read by the patch path, revert and the harness."""

from __future__ import annotations

import re

#: the model's config (`patch` edits a few keys; its replacement is the commit point of a patch)
CONFIG = "config.json"
#: the generated AutoTP policy, written next to the patched modeling file
POLICY_FILE = "autotp_policy.py"
#: remote code `M.py` shipped in a dir is patched into a new module `M_codegen` (the shipped file is never rewritten)
PATCHED_SUFFIX = "_codegen"
#: codegen's record in the dir: the manifest and the backups of every byte it replaced
STATE_DIR = ".codegen"
MANIFEST = "manifest.json"
ORIGINALS = "originals"
#: `.<name>.codegen-tmp-<pid>`: what an atomic write writes before the rename
TMP_NAME = re.compile(r"^\..+\.codegen-tmp-[0-9]+$")


def tmp_name(name: str, pid: int) -> str:
    """The temp file an atomic write of `name` by process `pid` goes through (matches TMP_NAME)."""
    return f".{name}.codegen-tmp-{pid}"
