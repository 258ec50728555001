"""Jinja2 rendering of generated Python: templates hold the code's shape, Python computes the values.

Every value reaches generated source through the `pyliteral` filter, which emits a Python literal
(never raw text) and proves it round-trips, so config strings and paths can't become live code.
"""

from __future__ import annotations

import ast
from importlib import resources
from typing import Any

import jinja2

from codegen import __version__


def pyliteral(value: Any) -> str:
    """A Python literal for plain data (str, int, float, bool, None, list, tuple, dict) that round-trips."""
    _check_plain(value)
    text = repr(value)
    if ast.literal_eval(text) != value:  # pragma: no cover - repr of plain data always round-trips
        raise ValueError(f"value does not round-trip as a Python literal: {text[:80]}")
    return text


def _check_plain(value: Any) -> None:
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key)
            _check_plain(item)
        return
    raise TypeError(f"refusing to render {type(value).__name__} into generated code")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(_load_template),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["pyliteral"] = pyliteral
    return env


def _load_template(name: str) -> str:
    # package data of codegen (pyproject.toml), in a checkout and in an installed wheel alike
    return resources.files("codegen").joinpath("templates", name).read_text(encoding="utf-8")


def render(template: str, **values: Any) -> str:
    """Render `codegen/templates/<template>` and check the result is valid Python before anyone writes it."""
    text = _environment().get_template(template).render(version=__version__, **values)
    ast.parse(text, filename=template)
    return text
