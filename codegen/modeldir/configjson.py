"""Edit config.json the way a person would: change codegen's keys, keep every other byte (order, indent, newline).

Re-dumping the whole file (sorted keys, 2-space indent) turns two real changes into a 100-line diff. Instead the
top-level members are located by scanning the text with the JSON decoder itself, and only the members codegen
sets or removes are rewritten; everything else, including the presence of a final newline, stays as found.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_WS = re.compile(r"[ \t\n\r]*")
#: a member to remove (revert of a key codegen added)
DELETE = object()


@dataclass(frozen=True)
class _Member:
    key: str
    start: int  # where the member's key string starts
    value_start: int
    value_end: int


def _members(text: str) -> tuple[list[_Member], int, int]:
    """The top-level members of a JSON object text, and the offsets of its `{` and `}`."""
    decoder = json.JSONDecoder()
    pos = _WS.match(text, 0).end()
    if text[pos : pos + 1] != "{":
        raise ValueError("not a JSON object")
    open_at = pos
    pos = _WS.match(text, pos + 1).end()
    members: list[_Member] = []
    if text[pos : pos + 1] == "}":
        return members, open_at, pos
    while True:
        key_start = pos
        key, pos = decoder.raw_decode(text, pos)
        pos = _WS.match(text, pos).end()
        if text[pos : pos + 1] != ":":
            raise ValueError("expected ':'")
        pos = _WS.match(text, pos + 1).end()
        value_start = pos
        _, pos = decoder.raw_decode(text, pos)
        members.append(_Member(key, key_start, value_start, pos))
        pos = _WS.match(text, pos).end()
        if text[pos : pos + 1] == ",":
            pos = _WS.match(text, pos + 1).end()
            continue
        if text[pos : pos + 1] == "}":
            return members, open_at, pos
        raise ValueError("expected ',' or '}'")


def _dumps(value: Any, indent: str | None, level: str) -> str:
    kwargs = {"indent": indent} if indent is not None else {"separators": (", ", ": ")}
    try:
        text = json.dumps(value, ensure_ascii=False, **kwargs)
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" is valid JSON): keep it as a JSON escape
        text = json.dumps(value, ensure_ascii=True, **kwargs)
    return text.replace("\n", "\n" + level)


def edit(data: bytes, updates: dict[str, Any]) -> bytes:
    """`data` (a JSON object) with each `updates[key]` set (or removed, for DELETE), nothing else changed."""
    text = data.decode("utf-8")
    try:
        members, open_at, close_at = _members(text)
    except ValueError:  # not plain enough to edit in place: a faithful re-dump, key order kept
        return _redump(text, updates)
    by_key = {m.key: m for m in members}
    if len(by_key) != len(members):  # duplicate keys: json.loads keeps the last; do the same, re-dumped
        return _redump(text, updates)
    multiline = "\n" in text[open_at:close_at]
    if multiline and members:
        line_start = text.rfind("\n", 0, members[0].start) + 1
        level = text[line_start : members[0].start]
    else:
        level = ""
    indent = level if multiline else None
    if multiline and not level:
        indent, level = "  ", "  "
    pieces: list[tuple[int, int, str]] = []  # (start, end, replacement), non-overlapping
    added = []
    for key, value in updates.items():
        member = by_key.get(key)
        if value is DELETE:
            if member is None:
                continue
            i = members.index(member)
            if i > 0:  # drop ", <member>" from the end of the previous value
                start, end = members[i - 1].value_end, member.value_end
            elif len(members) > 1:  # first of several: drop "<member>, " up to the next key
                start, end = member.start, members[1].start
            else:
                start, end = open_at + 1, close_at
            pieces.append((start, end, ""))
        elif member is not None:
            pieces.append((member.value_start, member.value_end, _dumps(value, indent, level)))
        else:
            added.append(f"{json.dumps(key, ensure_ascii=False)}: {_dumps(value, indent, level)}")
    if added:
        sep = f",\n{level}" if multiline else ", "
        if members:
            pieces.append((members[-1].value_end, members[-1].value_end, sep + sep.join(added)))
        else:
            body = (f"\n{level}" + sep.join(added) + "\n") if multiline else sep.join(added)
            pieces.append((open_at + 1, close_at, body))
    pieces.sort()
    if any(a[1] > b[0] for a, b in zip(pieces, pieces[1:])):  # two neighbouring deletions: re-dump instead
        return _redump(text, updates)
    out = text
    for start, end, replacement in reversed(pieces):
        out = out[:start] + replacement + out[end:]
    return out.encode("utf-8")


def _redump(text: str, updates: dict[str, Any]) -> bytes:
    config = json.loads(text)
    for key, value in updates.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    end = "\n" if text.endswith("\n") else ""
    return (_dumps(config, "  ", "") + end).encode("utf-8")
