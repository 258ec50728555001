"""Unified diffs of what `patch` would write: `patch -p1` and `git apply` accept them inside the model dir."""

from __future__ import annotations

import difflib


def text_diff(before: str | None, after: str | None, fromfile: str, tofile: str) -> str:
    """A unified diff of two texts; a missing side is /dev/null, and a side that does not end in a newline
    gets `\\ No newline at end of file`, as `patch` and `git apply` expect."""
    a = [] if before is None else before.splitlines(keepends=True)
    b = [] if after is None else after.splitlines(keepends=True)
    lines = difflib.unified_diff(a, b, fromfile="/dev/null" if before is None else fromfile,
                                 tofile="/dev/null" if after is None else tofile)
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def unified_diff(name: str, before: bytes | None, after: bytes | None) -> str:
    """The diff of one file of the model dir, `a/<name>` to `b/<name>` (new/removed files against /dev/null)."""
    def text(data: bytes | None) -> str | None:
        return None if data is None else data.decode("utf-8", "replace")

    return text_diff(text(before), text(after), f"a/{name}", f"b/{name}")
