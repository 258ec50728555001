"""What a new user meets outside the happy path (issue 10): each bug that was reproduced, hub repo ids, and the
rough edges of the CLI. Every test runs `python -m codegen` as a real process on a real dir.

Another transformers release is a real (tiny) `transformers` package with its own dist-info put first on
PYTHONPATH: codegen reads versions from package metadata and the patched modeling file imports it, so both
see that release exactly as they would see a real one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_codegen, tree_digest
from test_hardening import build

pytestmark = pytest.mark.process  # forks / starts processes: not in the fast tier

KNOB = "codegen_coalesce_moe_all_reduce"


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, **extra}


def _fake_transformers(root: Path, version: str) -> Path:
    """A `transformers` package of release `version` (what an upgrade or a downgrade installs)."""
    pkg = root / "transformers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\n')
    info = root / f"transformers-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return root


def _hf_cache(src: Path, cache: Path, repo: str) -> Path:
    """A local Hugging Face cache holding `repo` (blobs, a snapshot of symlinks, refs/main); returns the snapshot."""
    base = cache / ("models--" + repo.replace("/", "--"))
    rev = "0" * 40
    for sub in ("blobs", "refs", f"snapshots/{rev}"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(rev)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, base / "blobs" / digest)
        link = base / "snapshots" / rev / path.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(base / "blobs" / digest, link.parent))
    return base / "snapshots" / rev


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------- bug 1: lost state


@pytest.mark.parametrize("kind", ["qwen2_moe", "hub_deepseek"])
def test_revert_after_a_lost_state_dir_returns_a_stock_dir(tmp_path, kind):
    d = build(kind, tmp_path / "m")
    original = json.loads((d / "config.json").read_text())
    before_py = sorted(p.name for p in d.glob("*.py"))
    assert run_codegen("patch", d).returncode == 0
    shutil.rmtree(d / ".codegen")  # the user copied dir/*

    check = run_codegen("patch", "--check", d)
    assert check.returncode == 1 and "revert" in _one_line(check)
    again = run_codegen("patch", d)
    assert again.returncode == 2 and "revert" in _one_line(again)
    assert not list(d.glob("*_codegen_codegen.py"))  # nothing stacked on the stale output

    revert = run_codegen("revert", d)
    assert revert.returncode == 0, revert.stderr
    assert "not byte-for-byte" in revert.stdout and "config.json" in revert.stdout
    assert json.loads((d / "config.json").read_text()) == original  # auto_map values restored, knob gone
    assert sorted(p.name for p in d.glob("*.py")) == before_py
    assert run_codegen("patch", d).returncode == 0
    assert run_codegen("patch", "--check", d).returncode == 0


# ------------------------------------------------------------------------------- bug 2: another transformers


def test_patched_file_and_check_name_both_transformers_releases(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    assert run_codegen("patch", d).returncode == 0
    import transformers

    other = _env(PYTHONPATH=f"{_fake_transformers(tmp_path / 'site', '4.0.0')}{os.pathsep}{ROOT}")
    # the patched modeling file refuses to run under another release, naming both and the fix
    load = subprocess.run(
        [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1])", str(d / "modeling_qwen2_moe.py")],
        capture_output=True, text=True, env=other, timeout=120)
    assert load.returncode != 0
    last = load.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "4.0.0" in last and transformers.__version__ in last
    assert "python -m codegen patch" in last
    # --check there: exit 1, one line naming the transformers change; the dir is untouched
    before = tree_digest(d)
    check = subprocess.run([sys.executable, "-m", "codegen", "patch", "--check", str(d)], capture_output=True,
                           text=True, env=other, cwd=ROOT, timeout=120)
    assert check.returncode == 1
    line = _one_line(check)
    assert "transformers 4.0.0" in line and transformers.__version__ in line and "codegen patch" in line
    assert tree_digest(d) == before
    # and under the release it was made for, it imports its guard cleanly
    ok = subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1])",
                         str(d / "modeling_qwen2_moe.py")], capture_output=True, text=True, env=_env(), timeout=300)
    assert ok.returncode == 0, ok.stderr[-500:]


def test_source_records_its_own_release_and_says_so(tmp_path):
    import transformers.models.qwen2_moe.modeling_qwen2_moe as upstream

    site = _fake_transformers(tmp_path / "site", "5.24.9")
    copy = site / "transformers" / "models" / "qwen2_moe" / "modeling_qwen2_moe.py"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(Path(upstream.__file__).read_bytes())
    d = build("qwen2_moe", tmp_path / "m")
    r = run_codegen("patch", "--source", copy, d)
    assert r.returncode == 0, r.stderr
    assert "5.24.9" in r.stderr and "--source" in r.stderr  # the one-line note
    manifest = json.loads((d / ".codegen" / "manifest.json").read_text())
    assert manifest["source"]["transformers_version"] == "5.24.9"


# ------------------------------------------------------------------------------------------- bugs 3 and 4


def test_out_links_big_files_in_subfolders_and_hidden_dirs(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    (d / "original").mkdir()
    (d / "original" / "consolidated.safetensors").write_bytes(b"\0" * 1000)
    (d / ".git" / "lfs" / "objects" / "ab").mkdir(parents=True)
    (d / ".git" / "lfs" / "objects" / "ab" / "x").write_bytes(b"\0" * (2 << 20))
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    out = tmp_path / "out"
    r = run_codegen("patch", "--out", out, d)
    assert r.returncode == 0, r.stderr
    for rel in ("model.safetensors", "original/consolidated.safetensors", ".git/lfs/objects/ab/x"):
        assert (out / rel).is_symlink() and Path(os.readlink(out / rel)) == (d / rel).resolve(), rel
    assert not (out / ".git" / "HEAD").is_symlink() and (out / ".git" / "HEAD").read_text().startswith("ref:")
    assert run_codegen("patch", "--check", out).returncode == 0


def test_out_inside_the_source_dir_leaves_no_temp_dir(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    r = run_codegen("patch", "--out", d / "tp", d)
    assert r.returncode == 0, r.stderr
    everything = [str(p) for p in (d / "tp").rglob("*")] + [str(p) for p in d.iterdir()]
    assert not [p for p in everything if ".codegen-tmp-" in p], everything
    assert not (d / "tp" / "tp").exists()
    assert run_codegen("patch", "--check", d / "tp").returncode == 0


# ------------------------------------------------------------------------------------------- bugs 5 and 6


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_diff_applies_with_patch_p1_when_config_lacks_a_final_newline(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()), indent=2))
    r = run_codegen("patch", "--diff", d)
    assert r.returncode == 0 and "\\ No newline at end of file" in r.stdout
    applied = subprocess.run(["patch", "-p1", "--dry-run"], input=r.stdout, text=True, cwd=d, capture_output=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    subprocess.run(["patch", "-p1", "--quiet"], input=r.stdout, text=True, cwd=d, check=True)
    assert (d / "config.json").read_bytes() == _patched_bytes(tmp_path, "config.json")


def _patched_bytes(tmp_path: Path, name: str) -> bytes:
    ref = build("qwen2_moe", tmp_path / "ref")
    (ref / "config.json").write_text(json.dumps(json.loads((ref / "config.json").read_text()), indent=2))
    assert run_codegen("patch", ref).returncode == 0
    return (ref / name).read_bytes()


def test_diff_into_a_closed_pipe_is_no_internal_error(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    proc = subprocess.Popen([sys.executable, "-m", "codegen", "patch", "--diff", str(d)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # the reader is gone before anything is written (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert "internal error" not in err and "Traceback" not in err and "Exception ignored" not in err


# -------------------------------------------------------------------------------------- bug 7, hub repo ids


def test_a_patched_dir_that_went_through_the_hub_checks_clean(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    pristine = {n: (d / n).read_bytes() for n in ("config.json",)}
    assert run_codegen("patch", d).returncode == 0
    snap = _hf_cache(d, tmp_path / "hub", "acme/patched")  # uploaded with .codegen/, downloaded: all symlinks
    assert (snap / ".codegen" / "manifest.json").is_symlink()
    check = run_codegen("patch", "--check", snap)
    assert check.returncode == 0, check.stderr
    again = run_codegen("patch", snap)
    assert again.returncode == 0 and "unchanged" in again.stdout, again.stderr
    revert = run_codegen("revert", snap)
    assert revert.returncode == 0, revert.stderr
    assert (snap / "config.json").read_bytes() == pristine["config.json"]
    assert not (snap / "autotp_policy.py").exists() and not (snap / ".codegen").exists()


def test_hub_repo_id_resolves_offline_and_patches_a_linked_copy(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    cache = tmp_path / "hub"
    snap = _hf_cache(d, cache, "acme/tiny-moe")
    before = tree_digest(cache)
    env = _env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    out = tmp_path / "tp"
    r = subprocess.run([sys.executable, "-m", "codegen", "patch", "acme/tiny-moe", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert tree_digest(cache) == before  # the shared cache is never written
    assert (out / "model.safetensors").is_symlink()
    assert Path(os.readlink(out / "model.safetensors")) == (snap / "model.safetensors").resolve()  # the blob
    assert run_codegen("patch", "--check", out).returncode == 0

    def codegen(*args):
        return subprocess.run([sys.executable, "-m", "codegen", *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=300)

    in_place = codegen("patch", "acme/tiny-moe")
    assert in_place.returncode == 2 and "--out" in _one_line(in_place)
    # refused before anything is fetched: an id that is in no cache and no hub gets the same line, not a download
    absent = subprocess.run([sys.executable, "-m", "codegen", "patch", "acme/not-downloaded"], capture_output=True,
                            text=True, env=_env(HF_HUB_CACHE=str(tmp_path / "empty"), HF_ENDPOINT="http://127.0.0.1:9"),
                            cwd=ROOT, timeout=300)
    assert absent.returncode == 2 and "pass --out DIR" in _one_line(absent)
    assert not (tmp_path / "empty").exists()
    unknown = codegen("patch", "acme/nope", "--out", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "cache" in _one_line(unknown)
    check = codegen("patch", "--check", "acme/tiny-moe")  # read-only on the snapshot: allowed
    assert check.returncode == 1 and "not patched" in _one_line(check)
    assert codegen("patch", "--revision", "v1", str(d)).returncode == 2
    assert tree_digest(cache) == before


# ---------------------------------------------------------------------------------------------- rough edges


def test_help_shows_exit_codes_files_and_argument_text():
    top = run_codegen("--help")
    sub = run_codegen("patch", "--help")
    for text in (top.stdout, sub.stdout):
        assert "exit codes:" in text and "141" in text and "autotp_policy.py" in text
    assert "MODEL_DIR" in sub.stdout and "hub repo id" in sub.stdout and "print nothing on success" in sub.stdout
    assert "--diff" in sub.stdout and "exits 0" in sub.stdout


def test_debug_after_the_subcommand_and_check_is_read_only_one_line(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    (d / ".config.json.codegen-tmp-99999").write_text("{half")  # a killed run's leftover
    before = tree_digest(d)
    r = run_codegen("patch", "--check", d, "--debug")
    assert r.returncode == 1 and "not patched" in _one_line(r)
    assert tree_digest(d) == before  # --check cleaned nothing up
    assert run_codegen("patch", d, "--debug").returncode == 0
    assert not (d / ".config.json.codegen-tmp-99999").exists()  # a writing run does


def test_config_json_keeps_key_order_and_indent(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    text = json.dumps(dict(reversed(list(config.items()))), indent=4)  # unsorted keys, 4 spaces, no newline
    (d / "config.json").write_text(text)
    assert run_codegen("patch", d).returncode == 0
    after = (d / "config.json").read_text()
    assert after.startswith(text[: text.rindex("\n")])  # every original line kept, in order
    added = after[text.rindex("\n"):]
    assert KNOB in added and '    "auto_map": {\n        "' in added and not after.endswith("\n")
    assert run_codegen("revert", d).returncode == 0
    assert (d / "config.json").read_text() == text


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, "exceeds num_experts"),
    ({"mlp_only_layers": [0, 1]}, "no layer of 2 is an MoE layer"),
    ({"decoder_sparse_step": 3}, "no layer of 2 is an MoE layer"),
])
def test_implausible_configs_are_refused_in_one_line(tmp_path, change, words):
    d = build("qwen2_moe", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **change}, indent=2) + "\n")
    before = tree_digest(d)
    r = run_codegen("patch", d)
    assert r.returncode == 2 and words in _one_line(r)
    assert tree_digest(d) == before


def test_notes_for_quantization_and_model_type_spelling(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="Qwen2_MoE", quantization_config={"quant_method": "fp8"})
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    r = run_codegen("patch", d)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 2
    assert any("'Qwen2_MoE'" in n and "'qwen2_moe'" in n for n in notes)
    assert any("quantization_config (fp8)" in n for n in notes)


def test_source_hints_for_modular_files_and_config_paths(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    modular = tmp_path / "modular_qwen2_moe.py"
    modular.write_text("x = 1\n")
    r = run_codegen("patch", "--source", modular, d)
    assert r.returncode == 3 and "modeling_qwen2_moe.py" in _one_line(r)
    r = run_codegen("patch", d / "config.json")
    assert r.returncode == 2 and "pass the directory that holds it" in _one_line(r)


@pytest.mark.parametrize("model_type, nearest", [("qwen2moe", "qwen2_moe"), ("bert", None)])
def test_unsupported_model_type_names_the_nearest_family_and_that_stock_autotp_is_not_measured(tmp_path, model_type,
                                                                                             nearest):
    """A type without a measured figure: the refusal says so, and never "stock still runs"."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    before = tree_digest(d)
    r = run_codegen("patch", d)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not supported yet" in r.stderr and "stock DeepSpeed AutoTP on it is not measured here" in r.stderr
    assert "still runs" not in r.stderr
    assert (f"nearest supported family: {nearest}" in r.stderr) if nearest else ("nearest" not in r.stderr)
    assert tree_digest(d) == before


def _measured() -> list:
    """The first refused type of each kind of recorded stock figure (crashes, silently wrong, experts replicated) that
    the data holds: a type that becomes supported leaves UNSUPPORTED_STOCK, and the next one of its kind takes its
    place; a kind no type has is not a case."""
    from codegen.families import UNSUPPORTED_STOCK

    picked: dict[str, str] = {}
    for model_type, figure in UNSUPPORTED_STOCK.items():
        picked.setdefault(figure.split(" (")[0], model_type)
    return [pytest.param(model_type, id=kind) for kind, model_type in picked.items()]


@pytest.mark.parametrize("model_type", _measured())
def test_unsupported_model_type_quotes_what_stock_autotp_does_to_it(tmp_path, model_type):
    """Never "stock still runs": for a type stock AutoTP crashes on, that advice leads to a crash; for one it runs
    silently wrong on, to wrong logits. The refusal quotes the measured figure instead."""
    from codegen.families import REFUSED, UNSUPPORTED, UNSUPPORTED_STOCK

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    before = tree_digest(d)
    r = run_codegen("patch", d)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    status = "refused" if UNSUPPORTED[model_type].status == REFUSED else "not supported yet"
    assert f"model_type {model_type!r} is {status}: {UNSUPPORTED[model_type].why}" in r.stderr
    assert f"stock DeepSpeed AutoTP on the unpatched dir {UNSUPPORTED_STOCK[model_type]}" in r.stderr
    assert "still runs" not in r.stderr and "not measured" not in r.stderr
    assert tree_digest(d) == before


@pytest.mark.installed_transformers  # its answer depends on the installed transformers: both environments run it
def test_quantized_form_below_its_verified_release_is_refused(tmp_path):
    """gpt-oss MXFP4 loads into a patched dir only from the release the table names; below it, one line."""
    from codegen.families import FAMILIES
    from codegen.patch.source import installed_transformers_version
    from packaging.version import Version

    (name, family), = [(n, f) for n, f in FAMILIES.items() if f.quantized_forms][:1]
    form = family.quantized_forms[0]
    d = tmp_path / "q"
    d.mkdir()
    config = {"model_type": name, "quantization_config": {"quant_method": form.quant_method},
              **{k: 2 for k in family.positive_int_keys}, family.num_experts_keys[0]: 4}
    (d / "config.json").write_text(json.dumps(config))
    before = tree_digest(d)
    r = run_codegen("patch", "--diff", d)
    if Version(installed_transformers_version()) < Version(form.min_transformers):
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert form.quant_method in r.stderr and form.min_transformers in r.stderr
    else:
        assert r.returncode == 0, r.stderr
    assert tree_digest(d) == before
