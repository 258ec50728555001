"""Hugging Face hub repo ids (`Qwen/Qwen3-30B-A3B`) resolved as `from_pretrained` does: a cache snapshot.

`huggingface_hub.snapshot_download` fetches the repo into the shared cache (or, with `HF_HUB_OFFLINE=1` or
`--local-files-only`, only looks there) and gives the snapshot dir. That snapshot is shared by every user
of the cache, so codegen never patches it in place: `patch` needs `--out`, whose copy links the cache's blobs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from codegen.errors import BadInput, IOFailure

#: `owner/name` as the hub spells them (a local path that exists always wins)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text and not os.path.exists(text)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def snapshot(repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    """The local snapshot dir of `repo_id` at `revision` (downloaded unless offline / local_files_only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise BadInput(f"{repo_id} is not a directory, and huggingface_hub (needed for hub ids) is not installed: "
                       "pip install huggingface_hub, or pass a local model dir") from None
    local_only = local_files_only or offline()
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=local_only))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors vary by release; one line each
        name = type(exc).__name__
        if local_only and ("LocalEntryNotFound" in name or "OfflineModeIsEnabled" in name or "NotFound" in name):
            raise BadInput(f"{repo_id}{'@' + revision if revision else ''}: no such directory, and not in the local "
                           "Hugging Face cache (offline): check the path, or download the repo first") from None
        if "RepositoryNotFound" in name or "RevisionNotFound" in name or "GatedRepo" in name:
            raise BadInput(f"{repo_id}: no such directory, and the hub says {name} (check the path or repo id, "
                           "--revision and your HF token)") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        raise IOFailure(f"cannot download {repo_id}: {first}") from None
