"""The generated `autotp_policy.py`: a short rendered header (the family's layout as data) + the runtime, verbatim.

The policy logic is codegen/policy_runtime.py, a normal module that is linted and unit-tested; the file
`patch` writes is that module's text after a header the template renders from `Family.policy_layout()`,
so it runs where codegen is not installed. The header records the runtime's sha256.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from codegen.families import KNOB, Family
from codegen.render import render

RUNTIME_PATH = Path(__file__).resolve().parent / "policy_runtime.py"
#: the line the header ends with; the runtime text follows it
SEPARATOR = "# ---- codegen/policy_runtime.py, verbatim ----\n"


def runtime_text() -> str:
    """The exact text of codegen/policy_runtime.py, as embedded."""
    return RUNTIME_PATH.read_text(encoding="utf-8")


def runtime_sha256(text: str | None = None) -> str:
    return hashlib.sha256((runtime_text() if text is None else text).encode("utf-8")).hexdigest()


def render_header(family: Family, modeling_module: str, runtime_sha: str) -> str:
    """The rendered header alone: docstring, LAYOUT, KNOB, MODELING_MODULE, RUNTIME_SHA256."""
    return render(
        "autotp_policy.py.j2",
        layout=family.policy_layout(),
        knob=KNOB,
        modeling_module=modeling_module,
        runtime_sha256=runtime_sha,
    )


def render_policy(family: Family, modeling_module: str) -> str:
    """The `autotp_policy.py` `patch` writes next to the patched `<modeling_module>.py`: header + runtime."""
    runtime = runtime_text()
    text = render_header(family, modeling_module, runtime_sha256(runtime)) + runtime
    ast.parse(text, filename="autotp_policy.py")
    return text


def split_policy(text: str) -> tuple[str, str]:
    """(header, embedded runtime) of a rendered policy; ValueError when it is not one."""
    head, sep, runtime = text.partition(SEPARATOR)
    if not sep:
        raise ValueError("not a codegen policy: the runtime separator is missing")
    return head + sep, runtime
