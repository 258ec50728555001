"""Shared fixtures: tiny random hub-format checkpoints, built once per session and copied per test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from codegen.families import FAMILIES as _TABLE

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
#: every family of the table (codegen.families), in table order
FAMILIES = tuple(_TABLE)
#: families stock `deepspeed.init_inference` (AutoTP) crashes on, and the start of the crash line the harness
#: records: gpt_oss's attention `sinks` are not sharded with the heads (every transformers tested)
STOCK_AUTOTP_CRASHES = {"gpt_oss": "RuntimeError: Sizes of tensors must match"}
#: regression tests whose answer depends on the installed transformers: they run in every environment
#: (the rest of the regression matrix reads pinned wheels only and runs once, in the latest environment)
PER_ENVIRONMENT_REGRESSION = ("test_patch_writes_what_generated_expects", "test_this_environment_resolves_a_pinned_release")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if getattr(item, "originalname", item.name) in PER_ENVIRONMENT_REGRESSION:
            item.add_marker(pytest.mark.installed_transformers)


def run_codegen(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh process, output captured."""
    return subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="session")
def _tiny_templates(tmp_path_factory) -> dict[str, Path]:
    from codegen.examples import build_example

    sys.path.insert(0, str(FIXTURES))
    from make_hub_deepseek import make_hub_deepseek

    base = tmp_path_factory.mktemp("tiny-templates")
    built = {family: build_example(family, base / family) for family in FAMILIES}
    make_hub_deepseek(str(base / "hub_deepseek"))
    built["hub_deepseek"] = base / "hub_deepseek"
    return built


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
