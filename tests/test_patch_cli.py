"""`python -m codegen patch/revert` as a user runs them: idempotent, --check, --diff, --out, revert exact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from codegen.families import supported_model_types
from conftest import run_codegen, tree_digest

pytestmark = pytest.mark.cli

KNOB = "codegen_coalesce_moe_all_reduce"


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2", "hub_deepseek"])
def test_patch_is_idempotent_checkable_and_revertible(make_dir, kind):
    d = make_dir(kind)
    before = tree_digest(d)

    first = run_codegen("patch", d)
    assert first.returncode == 0, first.stderr
    after = tree_digest(d)
    assert after != before
    assert after.get("modeling_deepseek.py") == before.get("modeling_deepseek.py")  # shipped code untouched
    config = json.loads((d / "config.json").read_text())
    assert config[KNOB] is True
    # remote code M.py is never rewritten: the patched copy is M_codegen.py and auto_map points at it
    module = "modeling_deepseek_codegen" if kind == "hub_deepseek" else f"modeling_{kind}"
    assert config["auto_map"]["AutoModelForCausalLM"].startswith(module + ".")
    assert config["auto_map"]["AutoModel"].startswith(module + ".")
    assert (d / "autotp_policy.py").is_file() and (d / f"{module}.py").is_file()

    second = run_codegen("patch", d)
    assert second.returncode == 0 and "unchanged" in second.stdout
    assert tree_digest(d) == after

    check = run_codegen("patch", "--check", d)
    assert check.returncode == 0, check.stderr

    revert = run_codegen("revert", d)
    assert revert.returncode == 0, revert.stderr
    assert tree_digest(d) == before


def test_check_on_unpatched_dir_exits_1(make_dir):
    d = make_dir("qwen2_moe")
    before = tree_digest(d)
    result = run_codegen("patch", "--check", d)
    assert result.returncode == 1
    assert "not patched" in result.stderr
    assert tree_digest(d) == before


def test_check_reports_the_drifted_file(make_dir):
    d = make_dir("qwen2_moe")
    assert run_codegen("patch", d).returncode == 0
    with open(d / "autotp_policy.py", "a") as f:
        f.write("# local edit\n")
    result = run_codegen("patch", "--check", d)
    assert result.returncode == 1
    assert "autotp_policy.py" in result.stderr and "edited" in result.stderr
    assert "config.json" not in result.stderr


def test_diff_prints_unified_diff_and_writes_nothing(make_dir):
    d = make_dir("deepseek_v2")
    before = tree_digest(d)
    result = run_codegen("patch", "--diff", d)
    assert result.returncode == 0, result.stderr
    assert tree_digest(d) == before
    out = result.stdout
    assert "--- a/config.json" in out and "+++ b/config.json" in out
    assert "+++ b/modeling_deepseek_v2.py" in out and "+++ b/autotp_policy.py" in out
    assert "+        hidden_states = _codegen_moe_all_reduce(self, hidden_states)" in out
    # a patched dir has nothing left to show
    assert run_codegen("patch", d).returncode == 0
    again = run_codegen("patch", "--diff", d)
    assert again.returncode == 0 and again.stdout == ""


def test_no_coalesce_sticks_until_coalesce_turns_it_back_on(make_dir):
    d = make_dir("qwen2_moe")
    before = tree_digest(d)
    assert run_codegen("patch", "--no-coalesce", d).returncode == 0
    assert json.loads((d / "config.json").read_text())[KNOB] is False
    # the recorded choice sticks: a plain --check passes and says which, a plain patch keeps it off
    plain = run_codegen("patch", "--check", d)
    assert plain.returncode == 0 and "knob off" in plain.stdout
    assert run_codegen("patch", "--check", "--no-coalesce", d).returncode == 0
    wants_on = run_codegen("patch", "--check", "--coalesce", d)
    assert wants_on.returncode == 1 and KNOB in wants_on.stderr and len(wants_on.stderr.splitlines()) == 1
    again = run_codegen("patch", d)
    assert again.returncode == 0 and "unchanged" in again.stdout
    assert json.loads((d / "config.json").read_text())[KNOB] is False
    assert run_codegen("patch", "--coalesce", d).returncode == 0
    assert json.loads((d / "config.json").read_text())[KNOB] is True
    assert run_codegen("patch", "--check", d).returncode == 0
    assert run_codegen("revert", d).returncode == 0
    assert tree_digest(d) == before


def test_out_makes_a_patched_copy_with_linked_weights(make_dir, tmp_path):
    d = make_dir("qwen2_moe")
    before = tree_digest(d)
    out = tmp_path / "patched-copy"
    result = run_codegen("patch", "--out", out, d)
    assert result.returncode == 0, result.stderr
    assert tree_digest(d) == before  # the source dir is untouched
    weights = out / "model.safetensors"
    assert weights.is_symlink() and Path(os.readlink(weights)) == (d / "model.safetensors").resolve()
    assert run_codegen("patch", "--check", out).returncode == 0
    # --out into a non-empty dir is refused, nothing written
    again = run_codegen("patch", "--out", out, d)
    assert again.returncode == 2 and "not empty" in again.stderr


def test_manifest_records_source_and_config_originals(make_dir):
    d = make_dir("qwen2_moe")
    original = json.loads((d / "config.json").read_text())
    assert run_codegen("patch", d).returncode == 0
    manifest = json.loads((d / ".codegen" / "manifest.json").read_text())
    import hashlib

    import transformers

    assert manifest["tool"] == "codegen" and manifest["version"]
    src = manifest["source"]
    assert src["kind"] == "builtin" and src["transformers_version"] == transformers.__version__
    assert src["sha256"] == hashlib.sha256(Path(src["path"]).read_bytes()).hexdigest()
    for name, record in manifest["files"].items():
        assert record["written_sha256"] == hashlib.sha256((d / name).read_bytes()).hexdigest()
    assert manifest["config_changes"]["auto_map"] == {"existed": "auto_map" in original, "value": original.get("auto_map")}
    assert manifest["config_changes"][KNOB] == {"existed": False, "value": None}


def test_source_override(make_dir, tmp_path):
    import transformers.models.qwen2_moe.modeling_qwen2_moe as upstream

    copy = tmp_path / "my_modeling.py"
    copy.write_bytes(Path(upstream.__file__).read_bytes())
    d = make_dir("qwen2_moe")
    result = run_codegen("patch", "--source", copy, d)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((d / ".codegen" / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "override" and manifest["source"]["path"] == str(copy)
    missing = run_codegen("patch", "--source", tmp_path / "nope.py", make_dir("qwen2_moe", "other"))
    assert missing.returncode == 3 and "no such file" in missing.stderr


@pytest.mark.parametrize(
    "setup, code, words",
    [
        (lambda d: d.rmdir(), 2, "no such directory"),
        (lambda d: None, 2, "config.json not found"),
        (lambda d: (d / "config.json").write_text('{"model_type": "qwen2_moe",'), 2, "not valid JSON"),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), 2, f"supported: {', '.join(supported_model_types())}"),
    ],
    ids=["missing-dir", "no-config", "invalid-json", "unsupported-type"],
)
def test_bad_input_is_one_line_with_documented_exit_code(tmp_path, setup, code, words):
    d = tmp_path / "model"
    d.mkdir()
    setup(d)
    before = tree_digest(d) if d.exists() else None
    result = run_codegen("patch", d)
    assert result.returncode == code
    assert words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    if before is not None:
        assert tree_digest(d) == before


def test_api_returns_results_the_cli_prints(make_dir):
    """codegen.patch.api is what the CLI, the demo and the bench call: results, not printed text."""
    from codegen.patch import api

    d = make_dir("qwen2_moe")
    before = tree_digest(d)
    assert not api.check(d).up_to_date
    shown = api.diff(d)
    assert "+++ b/config.json" in shown.diff and tree_digest(d) == before
    first = api.patch(d)  # a plain Path is enough
    assert first.changed and first.family == "qwen2_moe" and first.coalesce
    assert first.written == ["autotp_policy.py", "config.json", "modeling_qwen2_moe.py"]
    assert not api.patch(d).changed
    check = api.check(d)
    assert check.up_to_date and check.problems == [] and check.coalesce is True
    assert api.diff(d).diff == ""
    reverted = api.revert(d)
    assert reverted.was_patched and reverted.not_exact == [] and tree_digest(d) == before
    assert not api.revert(d).was_patched


def test_the_fault_hook_is_not_read_from_the_environment(make_dir):
    d = make_dir("qwen2_moe")
    r = run_codegen("patch", d, env={**os.environ, "CODEGEN_FAULT_AFTER": "1"})
    assert r.returncode == 0, r.stderr  # only a test-side wrapper (tests/fault_cli.py) can install it
