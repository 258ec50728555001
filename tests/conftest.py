"""Shared fixtures: tiny random hub-format checkpoints, built once per session and copied per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen.families import FAMILIES as _TABLE
from codegen.families import STOCK_AUTOTP
from codegen.harness.examples import installed_families
from codegen.harness.opcache import codegen_cache

ROOT = Path(__file__).resolve().parent.parent
# compiled ranks (`generate --compile`, `verify --compile`, the in-process compile tests) keep inductor's compiled
# code where the smoke bench keeps it, in codegen's cache dir: the same tiny graphs compile cold once per machine
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(codegen_cache() / "inductor"))
FIXTURES = ROOT / "tests" / "fixtures"
#: every family of the table (codegen.families) the installed transformers ships, in table order (the families
#: of later releases are covered in the environments that have them; tests/test_families.py checks the split)
FAMILIES = installed_families()
#: hub-style remote code fixtures of the table's families (tests/fixtures/<name>), and the family each is of
REMOTE_CODE_FIXTURES = {fixture: name for name, family in _TABLE.items() for fixture in family.remote_code_fixtures}
#: families stock `deepspeed.init_inference` (AutoTP) crashes on, and the start of the crash line the harness
#: records (the table's measured facts)
STOCK_AUTOTP_CRASHES = {name: STOCK_AUTOTP[name].crash for name in FAMILIES if STOCK_AUTOTP[name].crash}
#: the tests whose corpora tests/test_reliability_report.py adds up: one pytest-xdist worker (`--dist loadgroup`)
#: runs them all, so each corpus is computed once per session (test_hardening.cached) and the figure reuses it
CORPORA = pytest.mark.xdist_group("reliability-corpora")
#: regression tests whose answer depends on the installed transformers: they run in every environment
#: (the rest of the regression matrix reads pinned wheels only and runs once, in the latest environment)
PER_ENVIRONMENT_REGRESSION = ("test_patch_writes_what_generated_expects", "test_this_environment_resolves_a_pinned_release")


#: what a test needs, exactly one per test (pyproject.toml describes each): `unit` is the fast tier
#: (`bash scripts/test.sh --fast` selects it by name); scripts/test.sh picks the rest per environment
TIERS = ("unit", "regression", "loader", "cli", "process", "runtime")


def tiers_of(item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier) is not None]


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if getattr(item, "originalname", item.name) in PER_ENVIRONMENT_REGRESSION:
            item.add_marker(pytest.mark.installed_transformers)
    wrong = [f"{item.nodeid} ({', '.join(tiers_of(item)) or 'none'})" for item in items if len(tiers_of(item)) != 1]
    if wrong:
        raise pytest.UsageError(f"every test needs exactly one tier marker of {', '.join(TIERS)}; not: "
                                + "; ".join(wrong[:10]))


def run_codegen(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh process, output captured."""
    return subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


class _Templates(dict):
    """Tiny checkpoints built on first use, once per session: a family of the table (its tiny example) or a
    remote-code fixture (tests/fixtures/make_<fixture>.py)."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, kind: str) -> Path:
        target = self.base / kind
        if kind in REMOTE_CODE_FIXTURES:
            import importlib

            sys.path.insert(0, str(FIXTURES))
            getattr(importlib.import_module(f"make_{kind}"), f"make_{kind}")(str(target))
        else:
            from codegen.harness.examples import build_example

            build_example(kind, target)
        self[kind] = target
        return target


@pytest.fixture(scope="session")
def _tiny_templates(tmp_path_factory) -> dict[str, Path]:
    return _Templates(tmp_path_factory.mktemp("tiny-templates"))


@pytest.fixture
def make_dir(_tiny_templates, tmp_path):
    """make_dir("qwen2_moe" | "deepseek_v2" | "hub_deepseek", name=None) -> a fresh copy of a tiny checkpoint."""

    def make(kind: str, name: str | None = None) -> Path:
        target = tmp_path / (name or kind)
        shutil.copytree(_tiny_templates[kind], target)
        return target

    return make


def tree_digest(path: Path) -> dict[str, str]:
    """Every file and symlink under `path` (content hash or link target), for byte-for-byte comparisons."""
    import hashlib
    import os

    out = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = Path(root, name)
            rel = str(full.relative_to(path))
            if full.is_symlink():
                out[rel] = "-> " + os.readlink(full)
            else:
                out[rel] = hashlib.sha256(full.read_bytes()).hexdigest()
    return out
