"""The generated `autotp_policy.py`: a short rendered header (the family's layout as data) + the runtime, assembled.

The policy logic lives in codegen/policy/runtime/, normal modules that are linted and unit-tested. The file
`patch` writes is their text joined in `PARTS` order after a header the template renders from the family's
layout as plain data (`Family.policy_layout()`, passed in by the patch path: the policy never reads the table), so it runs where codegen is not installed. A part may import earlier parts, only
with top-level `from codegen.policy.runtime.<part> import ...` statements: assembling drops exactly those
(in one file the names are already defined above) and checks that every name they import is defined by an
earlier part; everything else is embedded verbatim. The header records the assembled runtime's sha256.
"""

from __future__ import annotations

import ast
import hashlib
import types
from functools import lru_cache
from pathlib import Path

from codegen.render import render
from codegen.policy.runtime import PARTS

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
RUNTIME_PACKAGE = "codegen.policy.runtime"
#: the line the header ends with; the assembled runtime follows it
SEPARATOR = "# ---- the runtime: codegen/policy/runtime/*.py, assembled ----\n"
#: the line each part starts with in the assembled runtime
PART_HEADER = "# ---- codegen/policy/runtime/{}.py ----\n"
#: the file `patch` writes
POLICY_MODULE = "autotp_policy"


class AssemblyError(AssertionError):
    """A part breaks the assembly rules (a codegen bug, caught by the tests)."""


def part_text(name: str) -> str:
    return (RUNTIME_DIR / f"{name}.py").read_text(encoding="utf-8")


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            names |= {e.id for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
    return names


def _without_sibling_imports(name: str, text: str, defined: set[str]) -> str:
    tree = ast.parse(text, filename=f"{name}.py")
    drop: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{RUNTIME_PACKAGE}."):
            unknown = [a.name for a in node.names if a.name not in defined or a.asname]
            if unknown:
                raise AssemblyError(f"runtime part {name} imports {unknown} from {node.module}, "
                                    "which no earlier part defines under that name")
            drop |= set(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and "codegen" in ast.unparse(node):
            raise AssemblyError(f"runtime part {name} imports codegen other than earlier parts: {ast.unparse(node)}")
    lines = text.splitlines(keepends=True)
    return "".join(line for number, line in enumerate(lines, 1) if number not in drop)


@lru_cache(maxsize=1)
def runtime_text() -> str:
    """The runtime as embedded: every part in order, sibling imports dropped."""
    defined: set[str] = set()
    out = []
    for name in PARTS:
        text = part_text(name)
        out.append(PART_HEADER.format(name) + _without_sibling_imports(name, text, defined))
        own = _defined(ast.parse(text))
        if own & defined:  # in one file the later definition would silently replace the earlier part's
            raise AssemblyError(f"runtime part {name} defines {sorted(own & defined)}, which an earlier part defines")
        defined |= own
    return "\n\n".join(out)


def runtime_sha256(text: str | None = None) -> str:
    return hashlib.sha256((runtime_text() if text is None else text).encode("utf-8")).hexdigest()


def runtime_module(name: str = "codegen_policy_runtime") -> types.ModuleType:
    """The assembled runtime as a module, without a header: what every policy runs, for tests and tools."""
    module = types.ModuleType(name)
    module.__file__ = str(RUNTIME_DIR / "__init__.py")
    exec(compile(runtime_text(), f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - codegen's own text
    return module


def render_header(layout: dict, auto_class: str, knob: str, modeling_module: str, runtime_sha: str) -> str:
    """The rendered header alone: docstring, LAYOUT, KNOB, MODELING_MODULE, RUNTIME_SHA256. `layout` is the family's
    plain layout data, `auto_class` the auto class its docstring shows loading the dir, `knob` the config key."""
    return render(
        "autotp_policy.py.j2",
        layout=layout,
        auto_class=auto_class,
        knob=knob,
        modeling_module=modeling_module,
        runtime_sha256=runtime_sha,
        separator=SEPARATOR.rstrip("\n"),
    )


def render_policy(layout: dict, auto_class: str, knob: str, modeling_module: str) -> str:
    """The `autotp_policy.py` `patch` writes next to the patched `<modeling_module>.py`: header + runtime."""
    runtime = runtime_text()
    text = render_header(layout, auto_class, knob, modeling_module, runtime_sha256(runtime)) + runtime
    ast.parse(text, filename=f"{POLICY_MODULE}.py")
    return text


def split_policy(text: str) -> tuple[str, str]:
    """(header, embedded runtime) of a rendered policy; ValueError when it is not one."""
    head, sep, runtime = text.partition(SEPARATOR)
    if not sep:
        raise ValueError("not a codegen policy: the runtime separator is missing")
    return head + sep, runtime
