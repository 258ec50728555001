"""`python -m codegen bench --smoke`: the CI-sized benchmark, counts and structure asserted, timings only recorded."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_codegen

pytestmark = pytest.mark.runtime

FAMILIES = ("qwen2_moe", "deepseek_v2")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run shared by every test here (it starts real ranks: ~1-3 minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("bench")
    result = run_codegen("bench", "--smoke", "--json", out / "bench.json", "--markdown", out / "table.md",
                         "--chart", out / "chart.png", "--workdir", out / "work", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result, json.loads((out / "bench.json").read_text())


def _installed(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _major(version: str) -> int:
    return int(version.split(".")[0])


def test_smoke_run_succeeds_with_one_line_progress_and_no_traceback(smoke):
    _, result, record = smoke
    assert "Traceback" not in result.stderr
    assert record["kind"] == "smoke" and record["tp"] == 2 and record["device"] == "cpu"
    assert "[" in result.stderr and "s] starting 2 CPU ranks" in result.stderr  # progress lines with elapsed time
    assert record["machine"]["transformers"] == _installed("transformers")
    assert record["machine"]["deepspeed"] == _installed("deepspeed")
    assert record["machine"]["cores"] == os.cpu_count()


@pytest.mark.parametrize("family", FAMILIES)
def test_codegen_reduces_once_per_moe_layer_in_prefill_and_decode(smoke, family):
    _, _, record = smoke
    e = record["families"][family]
    b = e["codegen"]
    assert e["moe_layers"] >= 1
    assert b["allreduce_prefill_per_moe_layer"] == [1] * e["moe_layers"]
    assert b["allreduce_decode_per_moe_layer_max"] == 1 and b["allreduce_decode_per_moe_layer_mean"] == 1
    # one per attention block, one per MoE or dense MLP block, one for the LM head
    expected = 2 * e["num_layers"] + 1
    assert b["allreduce_prefill"] == expected
    assert b["allreduce_decode_step"]["max"] == expected == b["allreduce_decode_step"]["min"]
    assert b["counts_same_on_all_ranks"] and e["stock"]["counts_same_on_all_ranks"]


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_autotp_baseline_is_what_the_patch_fixes(smoke, family):
    _, _, record = smoke
    e = record["families"][family]
    a, b = e["stock"], e["codegen"]
    full_experts = e["load_peak_bytes"]["experts"]
    assert b["param_bytes_per_rank"]["experts"] == full_experts // record["tp"]
    assert a["allreduce_prefill"] >= b["allreduce_prefill"]
    assert a["allreduce_decode_step"]["median"] >= b["allreduce_decode_step"]["median"]
    if _major(record["machine"]["transformers"]) < 5:
        # per-expert Linear modules: stock AutoTP reduces every routed expert a token reaches, plus the shared one
        assert a["allreduce_prefill_per_moe_layer_mean"] > 2
        assert a["allreduce_decode_per_moe_layer_mean"] > 1
        assert a["param_bytes_per_rank"]["experts"] == full_experts // record["tp"]
    else:
        # fused 3-D expert Parameters: stock AutoTP leaves the routed experts replicated on every rank
        assert a["param_bytes_per_rank"]["experts"] == full_experts
        assert e["ratio_b_over_a"]["expert_bytes"] == pytest.approx(1 / record["tp"])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_single_process_reference(smoke, family):
    _, _, record = smoke
    e = record["families"][family]
    for mode in ("stock", "codegen"):
        assert e[mode]["maxdiff_prefill"] <= 1e-5
        assert e[mode]["maxdiff_decode"] <= 1e-5


def test_timings_and_patch_times_are_recorded(smoke):
    _, _, record = smoke
    s = record["settings"]
    assert s["prompt_len"] == 128
    for family in FAMILIES:
        e = record["families"][family]
        for mode in ("stock", "codegen"):
            assert e[mode]["decode"]["n"] == s["decode_steps"]
            assert e[mode]["prefill"]["n"] == s["prefill_repeats"]
            assert e[mode]["decode"]["median"] > 0
        assert len(record["patch_timing"]["families"][family]) == s["patch_trials"]
        assert record["patch_timing"]["median_s"][family] > 0
        assert e["ratio_b_over_a"]["decode_median"] > 0


def test_markdown_table_and_chart_are_written(smoke):
    out, result, _ = smoke
    table = (out / "table.md").read_text()
    assert table in result.stdout
    for family in FAMILIES:
        assert f"| {family} (" in table
    assert "all-reduces / prefill" in table and "patch wall s" in table and "Machines:" in table
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_combines_records(smoke, tmp_path):
    import subprocess
    import sys

    out, _, _ = smoke
    result = subprocess.run([sys.executable, "-m", "codegen.bench", "merge", out / "bench.json", out / "bench.json",
                             "--markdown", tmp_path / "t.md", "--chart", tmp_path / "c.png"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "t.md").read_text()
    assert table.count("| qwen2_moe (") == 2 and (tmp_path / "c.png").exists()


def test_merge_rejects_a_non_record_with_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = subprocess.run([sys.executable, "-m", "codegen.bench", "merge", bad], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a `bench --json` record" in result.stderr


def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = run_codegen("bench", "--device", "cuda", "--smoke", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "CUDA" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_tp_is_one_line():
    result = run_codegen("bench", "--smoke", "--tp", "1", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_a_failing_rank_is_one_line(tmp_path):
    from codegen.bench import SETTINGS, Progress, launch
    from codegen.errors import VerifyFailed

    missing = str(tmp_path / "missing")
    spec = {"models": [{"family": "qwen2_moe", "unpatched": missing, "patched": missing}], "tp": 2, "device": "cpu",
            "dtype": "float32", **{k: SETTINGS["smoke"][k] for k in
                                   ("prompt_len", "batch", "decode_steps", "warmup", "prefill_repeats")}}
    with pytest.raises(VerifyFailed) as failed:
        launch(spec, 2, 300, Progress(quiet=True))
    message = failed.value.message
    assert "\n" not in message and "benchmark rank" in message and "FileNotFoundError" in message
