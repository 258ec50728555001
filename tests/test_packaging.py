"""The package as a user installs it: built into a wheel, installed into a fresh virtualenv (no `-e`, no checkout
on the path), every command starts and `patch` patches a dir. An editable install hides a package or data file
the wheel leaves out; this does not (a wheel without codegen/serve/ once failed every command at import)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.process, pytest.mark.once]

#: the exact versions CI installs (transformers is what `patch` reads the modeling source from; torch is not needed)
CONSTRAINTS = ROOT / "constraints" / "latest.txt"


def _tracked_package_files() -> set[str]:
    """Every file of codegen/ git tracks: what the wheel must hold (sources, templates, published configs)."""
    listed = subprocess.run(["git", "ls-files", "codegen"], cwd=ROOT, capture_output=True, text=True, check=True)
    return {line for line in listed.stdout.splitlines() if line and "__pycache__" not in line}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what the sdist would hold (the checkout gets no build/ or egg-info)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "codegen", source / "codegen", ignore=shutil.ignore_patterns("__pycache__"))
    out = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("codegen-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel and transformers, nothing of this checkout: its python."""
    env = tmp_path_factory.mktemp("venv") / "v"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(CONSTRAINTS),
                    str(wheel), "transformers"], check=True, capture_output=True, timeout=600)
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_the_wheel_holds_every_file_of_the_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    missing = sorted(_tracked_package_files() - shipped)
    assert not missing, f"the wheel leaves out {missing}"


def test_installed_from_the_wheel_every_command_starts_and_patch_patches(installed, tmp_path):
    from codegen.harness.examples import build_example

    where = _run(installed, "-c", "import codegen; print(codegen.__file__)", cwd=tmp_path)
    assert where.returncode == 0 and str(installed.parent.parent) in where.stdout, where.stdout + where.stderr
    for args in (("--help",), ("patch", "--help"), ("serve", "--help"), ("generate", "--help"), ("shm",)):
        result = _run(installed, "-m", "codegen", *args, cwd=tmp_path)
        assert result.returncode == 0, (args, result.stderr)
    model_dir = tmp_path / "qwen3"
    build_example("qwen3_moe", model_dir)
    patched = _run(installed, "-m", "codegen", "patch", str(model_dir), cwd=tmp_path)
    assert patched.returncode == 0, patched.stderr
    assert (model_dir / "autotp_policy.py").is_file() and (model_dir / "modeling_qwen3_moe.py").is_file()
    check = _run(installed, "-m", "codegen", "patch", "--check", str(model_dir), cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    # `patch` loads the patch path only: neither the serving stack nor the harness (nor torch)
    loaded = _run(installed, "-c", "import sys; from codegen.cli import main; code = main(['patch', '--check', "
                  f"{str(model_dir)!r}]); print(code, sorted(m for m in sys.modules if m.startswith(('codegen.serve', "
                  "'codegen.harness', 'torch'))))", cwd=tmp_path)
    assert loaded.stdout.splitlines()[-1] == "0 []", loaded.stdout + loaded.stderr
