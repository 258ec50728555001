"""`python -m codegen bench`: the CI-sized run (counts and structure asserted, timings only recorded), and the
report, merge and chart code on the recorded runs in docs/bench/."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from codegen.harness.abrun import families_of
from conftest import FAMILIES, ROOT, STOCK_AUTOTP_CRASHES, run_codegen

RECORDED = sorted((ROOT / "docs" / "bench").glob("bench-*.json"))
#: vLLM's CPU engine on the same checkpoints (`bench --peer vllm --json`), joined to the rows by `--merge`
PEERS = sorted((ROOT / "docs" / "bench").glob("peer-vllm-*.json"))
#: the families the smoke run covers (those the recorded bench covers, at tiny widths)
SMOKE = families_of("smoke")
#: the families stock AutoTP runs on: the ones whose (a) figures exist
STOCK_RUNS = [f for f in SMOKE if f not in STOCK_AUTOTP_CRASHES]
SMOKE_CRASHES = [f for f in SMOKE if f in STOCK_AUTOTP_CRASHES]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run shared by every test here (it starts real ranks: ~1-3 minutes on 2 cores)."""
    import time

    out = tmp_path_factory.mktemp("bench")
    started = time.time()
    result = run_codegen("bench", "--smoke", "--json", out / "bench.json", "--workdir", out / "work", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "bench.json").read_text())
    record["_test_started"] = started
    return out, result, record


@pytest.mark.runtime
def test_the_ranks_leave_no_shared_memory_buffer_behind(smoke):
    """Every rank unlinks its DeepSpeed /dev/shm all-reduce buffer (66 MiB each) before it exits, whichever
    setups it ran (stock and native load no policy; the worker's fast exit skips atexit)."""
    from pathlib import Path

    _, _, record = smoke
    left = [p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")
            if p.stat().st_mtime >= record["_test_started"]]
    assert left == []


def _installed(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _shared(family: str) -> bool:
    """Whether the family's MoE block has a shared expert (which stock AutoTP reduces once per layer)."""
    from codegen.families import FAMILIES as TABLE

    return bool(TABLE[family].shared_experts)


def _major(version: str) -> int:
    return int(version.split(".")[0])


def _row(record: dict, family: str) -> dict:
    (row,) = [r for r in record["rows"] if r["family"] == family]
    return row


@pytest.mark.runtime
def test_smoke_run_succeeds_with_one_line_progress_and_no_traceback(smoke):
    out, result, record = smoke
    assert "Traceback" not in result.stderr
    assert record["schema"] == "codegen-result/1" and record["command"] == "bench" and record["ok"] is True
    assert record["kind"] == "smoke" and record["tp"] == 2 and record["device"] == "cpu"
    assert record["problems"] == []
    assert "[" in result.stderr and "s] starting 2 CPU ranks" in result.stderr  # progress lines with elapsed time
    assert all(f"s] {f}/b1/g0: decode" in result.stderr for f in SMOKE)  # rank 0's progress, passed on live
    assert "needs about" in result.stderr and "GiB available" in result.stderr  # memory said before the start
    assert record["machine"]["transformers"] == _installed("transformers")
    assert record["machine"]["deepspeed"] == _installed("deepspeed")
    assert record["machine"]["cores"] == os.cpu_count()
    assert sorted(r["family"] for r in record["rows"]) == sorted(SMOKE)
    assert {(r["batch"], r["dtype"], r["size"]) for r in record["rows"]} == {(1, "float32", "tiny")}
    for family in SMOKE:  # the bench's own dirs were patched as the CLI patches (a manifest, the policy)
        (work,) = (out / "work").iterdir()
        assert (work / family / "patched" / ".codegen" / "manifest.json").is_file()
        plan = _row(record, family)["memory_estimate"]
        assert plan["groups"] == [["stock", "codegen", "compiled", "native"]]  # tiny: every setup side by side
        assert plan["plan"]["peak_total"] < plan["available_bytes"]


@pytest.mark.runtime
@pytest.mark.parametrize("family", SMOKE)
def test_codegen_reduces_once_per_moe_layer_in_prefill_and_decode(smoke, family):
    _, _, record = smoke
    e = _row(record, family)
    b = e["codegen"]
    assert e["moe_layers"] >= 1
    assert b["allreduce_prefill_per_moe_layer"] == [1] * e["moe_layers"]
    assert b["allreduce_decode_per_moe_layer_max"] == 1 == b["allreduce_decode_per_moe_layer_min"]
    assert b["allreduce_decode_per_moe_layer_mean"] == 1
    # one per attention block, one per MoE or dense MLP block, one for the LM head; nothing else
    expected = 2 * e["num_layers"] + 1
    assert b["allreduce_prefill"] == expected and b["gathers_prefill"] == 0
    assert b["allreduce_decode_step"]["max"] == expected == b["allreduce_decode_step"]["min"]
    assert b["counts_same_on_all_ranks"]
    assert family in STOCK_AUTOTP_CRASHES or e["stock"]["counts_same_on_all_ranks"]
    assert b["decode_tokens_per_s"] == pytest.approx(e["batch"] / b["decode"]["median"])


@pytest.mark.runtime
@pytest.mark.parametrize("family", SMOKE)
def test_compiled_codegen_reduces_once_per_moe_layer_inside_its_graphs(smoke, family):
    """(f): (b)'s model with its forward compiled: on transformers 5.x every forward runs as one captured graph
    holding exactly (b)'s reductions, all of them the ordered functional op; same numerics, same tokens. 4.x's loop
    over the experts a batch routed to breaks the graph: (f) says so once and runs eager, (b)'s counts and numerics."""
    from packaging.version import Version

    _, _, record = smoke
    e = _row(record, family)
    f, b = e["compiled"], e["codegen"]
    expected = 2 * e["num_layers"] + 1
    compiled = f["compile"]
    graphs = compiled["graph_collectives"]
    if Version(record["machine"]["transformers"]).major < 5:
        assert compiled["fallback"] and compiled["graphs"] == 0 and compiled["graphs_per_forward"] is None
    else:
        assert compiled["fallback"] is None and compiled["graphs"] >= 3 and compiled["cold_s"] > 0
        assert compiled["graphs_per_forward"] == 1
        assert [g["all_reduces"] for g in graphs] == [expected] * compiled["graphs"]
        assert {g["swapped_all_reduce"] for g in graphs} == {expected}
        assert {g["other_collectives"] for g in graphs} == {0}
    assert compiled["recaptured_while_timed"] == 0  # no recompilation per call once every shape kind ran
    assert f["allreduce_prefill"] == expected == f["allreduce_decode_step"]["max"] == f["allreduce_decode_step"]["min"]
    assert f["allreduce_prefill_per_moe_layer"] == [1] * e["moe_layers"] == b["allreduce_prefill_per_moe_layer"]
    assert f["allreduce_decode_per_moe_layer_max"] == 1 == f["allreduce_decode_per_moe_layer_min"]
    assert max(f["relative_prefill"], f["relative_decode"]) < 1e-5
    assert f["token_agreement"] == 1.0 and f["e2e"]["new_tokens"] == 4
    assert f["param_bytes_per_rank"] == b["param_bytes_per_rank"]  # (b)'s weights, no copy
    assert e["ratio_f_over_b"]["decode_median"] > 0


@pytest.mark.runtime
@pytest.mark.parametrize("family", STOCK_RUNS)
def test_stock_autotp_baseline_is_what_the_patch_fixes(smoke, family):
    _, _, record = smoke
    e = _row(record, family)
    a, b = e["stock"], e["codegen"]
    assert "crashed" not in a
    full_experts = e["load_peak_bytes"]["experts"]
    assert b["param_bytes_per_rank"]["experts"] == full_experts // record["tp"]
    if a["param_bytes_per_rank"]["experts"] == full_experts and not _shared(family):
        # experts replicated and no shared expert: stock reduces nothing in the MoE layer; codegen adds one per
        # MoE layer in exchange for holding 1/tp of the experts
        assert a["allreduce_prefill_per_moe_layer"] == [0] * e["moe_layers"]
        assert a["allreduce_prefill"] + e["moe_layers"] == b["allreduce_prefill"]
    else:
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
        assert a["note"].startswith("experts not sharded")
        assert e["ratio_b_over_a"]["expert_bytes"] == pytest.approx(1 / record["tp"])


@pytest.mark.runtime
@pytest.mark.parametrize("family", SMOKE_CRASHES)
def test_a_stock_autotp_crash_is_recorded_and_the_others_run(smoke, family):
    """(a) crashed on its first forward: the row records the crash line, every b/a ratio is None, (b) was
    timed and checked with (d) in the same launch, and the table says crash in (a)'s cells."""
    from codegen.harness.report import markdown

    _, result, record = smoke
    e = _row(record, family)
    assert set(e["stock"]) == {"mode", "crashed"}
    assert e["stock"]["crashed"].startswith(STOCK_AUTOTP_CRASHES[family]), e["stock"]["crashed"]
    assert set(e["ratio_b_over_a"].values()) == {None}
    b = e["codegen"]
    assert b["allreduce_prefill_per_moe_layer"] == [1] * e["moe_layers"]
    assert b["decode"]["n"] == record["settings"]["decode_steps"] and b["maxdiff_decode"] <= 1e-5
    assert record["ok"] is True
    table = markdown(record)
    line = next(line for line in table.splitlines() if line.startswith(f"| {family} ("))  # the main table's row
    assert "| crash / " in line and "| –, – |" in line
    assert f"- (a) {family}, transformers {record['machine']['transformers']}: crashed: " \
           f"{STOCK_AUTOTP_CRASHES[family]}" in table and "(tiny float32 batch 1)" in table
    assert f"{family}/b1/g0: (a) stock AutoTP: crashed ({STOCK_AUTOTP_CRASHES[family]}" in result.stderr


@pytest.mark.runtime
@pytest.mark.parametrize("family", SMOKE)
def test_native_tp_is_measured_or_its_failure_recorded(smoke, family):
    """(d) transformers' own TP on the same ranks: figures where it runs (then it must be right: logits within
    1e-5, 1/tp of the experts or a note saying they are not sharded), else the crash line; never a missing row."""
    _, _, record = smoke
    e = _row(record, family)
    d = e["native"]
    if "crashed" in d:
        assert set(d) == {"mode", "crashed"} and d["crashed"]
        assert set(e["ratio_b_over_d"].values()) == {None}
        return
    full_experts = e["load_peak_bytes"]["experts"]
    assert d["counts_same_on_all_ranks"]
    assert max(d["maxdiff_prefill"], d["maxdiff_decode"]) <= 1e-5
    assert d["decode"]["n"] == record["settings"]["decode_steps"]
    if d["param_bytes_per_rank"]["experts"] >= full_experts:
        assert d["note"] == "experts not sharded (every rank holds all routed experts)"
    else:
        assert d["param_bytes_per_rank"]["experts"] == full_experts // record["tp"] and "note" not in d
    assert e["ratio_b_over_d"]["decode_median"] > 0


@pytest.mark.runtime
def test_native_tp_runs_on_the_latest_transformers(smoke):
    """The issue's floor: (d) is in the smoke record for at least one family on transformers 5.x, sharding the
    experts and gathering the LM head's vocabulary shards (an all-gather, counted apart from all-reduces)."""
    _, _, record = smoke
    if _major(record["machine"]["transformers"]) < 5:
        assert all("native" in r for r in record["rows"])
        return
    ran = [r for r in record["rows"] if "crashed" not in r["native"] and "note" not in r["native"]]
    assert {r["family"] for r in ran} >= {"qwen2_moe", "qwen3_moe"}
    for r in ran:
        assert r["native"]["allreduce_prefill_per_moe_layer_mean"] >= 1
        assert r["native"]["gathers_prefill"] >= 1


@pytest.mark.runtime
@pytest.mark.parametrize("family", SMOKE)
def test_logits_match_the_single_process_reference(smoke, family):
    _, _, record = smoke
    e = _row(record, family)
    for mode in ("stock", "codegen") if family in STOCK_RUNS else ("codegen",):
        assert e[mode]["maxdiff_prefill"] <= record["tolerance"] == 1e-5
        assert e[mode]["maxdiff_decode"] <= 1e-5
        assert e[mode]["token_agreement"] == 1.0


@pytest.mark.runtime
def test_a_launch_without_jobs_measures_the_machine_limits_only():
    """What `bench --peer` measures before vLLM runs, so that its record joins only a bench run on a machine with
    the same limits: the bench's own measurement, on as many ranks, at once, and nothing loaded."""
    from codegen.harness.launcher import launch
    from codegen.ranks import rank_cores

    ranks = launch({"tp": 2, "device": "cpu", "dtype": "float32", "limits": True, "jobs": []}, 2, 300.0)
    assert [r["jobs"] for r in ranks] == [{}, {}]
    for rank in ranks:
        limits = rank["limits"]
        assert limits["read_bytes_per_s"] > 0 and limits["gemm_flops_per_s"] > 0
        assert limits["concurrent_ranks"] == 2 and limits["dtype"] == "float32"
    # each rank ran on its own share of the cores (where there are as many cores as ranks)
    expected = [rank_cores(r, 2) for r in range(2)]
    if all(expected):
        assert [set(r["limits"]["cores"]) for r in ranks] == expected
        assert not set(ranks[0]["limits"]["cores"]) & set(ranks[1]["limits"]["cores"])


@pytest.mark.runtime
def test_machine_limits_and_floors_are_recorded(smoke):
    """The run measures the machine's limits on its ranks (memory bandwidth, GEMM throughput) and gives every setup
    that ran a floor per phase beside its measured time, and floor / measured in the table. Presence and sanity
    only: on a shared machine a floor above the measured time is possible, and nothing here is timed."""
    from codegen.harness.worker.limits import MIN_BUFFER

    _, result, record = smoke
    limits = record["machine_limits"]
    assert limits["method"]["bandwidth"] and limits["method"]["floor"]
    for part, ranks in (("tp", record["tp"]), ("single", 1)):
        assert limits[part]["ranks"] == ranks and len(limits[part]["per_rank"]) == ranks * limits[part]["launches"]
        assert limits[part]["read_gb_s"] > 0 and limits[part]["copy_gb_s"] > 0 and limits[part]["gemm_gflop_s"] > 0
        for rank in limits[part]["per_rank"]:
            assert rank["buffer_bytes"] >= MIN_BUFFER and rank["last_level_cache_bytes"] > 0
            assert rank["dtype"] == "float32" and rank["gemm_n"] >= 256
    assert limits["tp"]["per_rank"][0]["concurrent_ranks"] == record["tp"]
    for row in record["rows"]:
        for mode in ("stock", "codegen", "compiled", "native", "single"):
            figures = row.get(mode)
            if figures is None or "crashed" in figures:
                continue
            floor = figures["floor"]
            assert floor["routing_seen"], (row["family"], mode)
            for phase in ("prefill", "decode", "ttft"):
                assert floor[phase]["s"] > 0 and floor[phase]["bytes_per_rank"] > 0 and floor[phase]["flops_per_rank"] > 0
                assert floor[phase]["bound"] in ("memory", "compute")
            assert floor["e2e"]["s"] > floor["ttft"]["s"]
            assert floor["prefill"]["flops_per_rank"] > floor["decode"]["flops_per_rank"]
            assert all(share > 0 for share in floor["of_limit"].values()) and set(floor["of_limit"]) == {
                "prefill", "decode", "ttft", "e2e"}
            assert floor["of_limit"]["decode"] == pytest.approx(floor["decode"]["s"] / figures["decode"]["median"])
            assert 1 <= floor["experts_hit_per_moe_layer"]["decode_mean"] <= row["shape"].get("experts", 10**6)
        # TP splits the weights: codegen's rank reads less per decode step than the one process reading them all
        b, e = row["codegen"]["floor"]["decode"], row["single"]["floor"]["decode"]
        assert b["bytes_per_rank"] < e["bytes_per_rank"] and b["flops_per_rank"] < e["flops_per_rank"]
    assert "% of limit: decode" in result.stdout and "machine limits, measured in the run: per rank" in result.stdout


@pytest.mark.runtime
def test_timings_and_patch_times_are_recorded(smoke):
    _, result, record = smoke
    s = record["settings"]
    for family in SMOKE:
        e = _row(record, family)
        for mode in ("stock", "codegen") if family in STOCK_RUNS else ("codegen",):
            assert e[mode]["decode"]["n"] == s["decode_steps"]
            assert e[mode]["prefill"]["n"] == s["prefill_repeats"]
            assert e[mode]["decode"]["median"] > 0
        assert len(record["patch_timing"]["families"][family]) == s["patch_trials"]
        assert record["patch_timing"]["median_s"][family] > 0
        assert family not in STOCK_RUNS or e["ratio_b_over_a"]["decode_median"] > 0
    assert "decode tokens/s" in result.stdout  # the table is printed


@pytest.mark.runtime
def test_the_demo_table_of_this_environment(smoke):
    """The demo's table (codegen.harness.demo.render) on this environment's ab rows: one row per family, the
    patched dirs reduce once, and the note that explains stock AutoTP under this transformers."""
    import re

    from codegen.harness.demo import render

    _, _, record = smoke
    table = render({**record, "families": {r["family"]: r for r in record["rows"]}})
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.split()[:1] in ([f] for f in SMOKE)}
    assert set(rows) == set(SMOKE)
    for family, cells in rows.items():
        p_before, p_after, d_before, d_after, e_before, e_after, diff_before, diff_after = cells
        assert p_after == d_after == "1"
        assert e_after == "50%" and float(diff_after) <= 1e-5
        if family in STOCK_AUTOTP_CRASHES:
            assert p_before == d_before == e_before == diff_before == "crash"
            assert f"note: stock AutoTP crashed on {family} ({STOCK_AUTOTP_CRASHES[family]}" in table
        else:
            assert float(diff_before) <= 1e-5 and int(re.split("-", p_before)[-1]) >= int(_shared(family))
    if _major(record["machine"]["transformers"]) < 5:
        assert "stock AutoTP reduces inside every routed expert" in table
    else:
        assert "fused 3-D Parameters that stock AutoTP leaves replicated" in table


@pytest.mark.runtime
def test_one_process_on_all_cores_and_end_to_end_generation_are_measured(smoke):
    """(e): the unpatched model in one process on the ranks' cores together, beside (a), (b), (d), with the same
    prompt and forced tokens: no collective, the reference's logits; every setup that ran has end-to-end figures
    (generate() to N new tokens: time to first token, tokens/s) and b/e is in the table."""
    out, result, record = smoke
    rows = [row for row in record["rows"] if not row.get("not_run")]
    assert rows and all("single" in row and "ratio_b_over_e" in row for row in rows)
    for row in rows:
        single = row["single"]
        assert single["allreduce_prefill"] == 0 and single["allreduce_decode_step"]["median"] == 0
        assert single["maxdiff_prefill"] == 0.0 and single["maxdiff_decode"] == 0.0  # the reference's own model
        for mode in ("stock", "codegen", "native", "single"):
            figures = row.get(mode)
            if figures is not None and "crashed" not in figures:
                e2e = figures["e2e"]
                assert e2e["new_tokens"] == 4 and 0 < e2e["ttft"]["median"] < e2e["total"]["median"]
                assert e2e["tokens_per_s"] == pytest.approx(row["batch"] * 4 / e2e["total"]["median"])
        assert row["ratio_b_over_e"]["decode_median"] == pytest.approx(
            row["codegen"]["decode"]["median"] / single["decode"]["median"])
    assert "b/e decode, e2e" in result.stdout and "end-to-end tokens/s" in result.stdout


# ------------------------------------------------------------------ the vLLM peer (units; the runs: docs/bench)


@pytest.mark.unit
def test_vllm_crash_line_is_the_root_cause_not_the_engines_pointer():
    from codegen.harness.peer import _crash_line

    log = "\n".join([
        "(MainProcess pid=1) WARNING 12-01 10:00:00 [base.py:380] ValueError: Tokenizer not available",
        "(Worker_TP0 pid=3) ERROR 12-01 10:00:01 [executor.py:10] RuntimeError: Unsupported CPU attention "
        "configuration: head_dim=16",
        "(EngineCore pid=2) ERROR 12-01 10:00:01 [core.py:15] RuntimeError: Worker failed with error 'x', please "
        "check the stack trace above for the root cause",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for "
        "the root cause.",
    ])
    assert _crash_line(log) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    assert _crash_line("") == "no output"
    pydantic = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
                "  Value error, Model architectures ['X'] failed to be inspected.\n")
    assert _crash_line(pydantic) == ("ValidationError: 1 validation error for ModelConfig: Value error, Model "
                                     "architectures ['X'] failed to be inspected.")


@pytest.mark.unit
def test_vllm_threads_are_bound_as_the_ranks_split_the_cores(monkeypatch):
    from codegen.harness import peer

    monkeypatch.setattr(peer.os, "cpu_count", lambda: 2)
    assert peer.thread_binding(2) == "0|1"
    monkeypatch.setattr(peer.os, "cpu_count", lambda: 16)
    assert peer.thread_binding(2) == "0-7|8-15" and peer.thread_binding(4) == "0-3|4-7|8-11|12-15"


@pytest.mark.unit
def test_vllm_prompts_are_the_bench_workers_prompts():
    """The peer feeds vLLM the very token ids the rank worker draws (codegen.harness.worker.main)."""
    import torch

    from codegen.harness.peer import prompts

    assert prompts(4096, 16, 128) == torch.randint(0, 4096, (16, 128), generator=torch.Generator().manual_seed(1)
                                                   ).tolist()


@pytest.mark.unit
def test_merge_joins_a_peer_record_to_the_rows_it_ran_beside(tmp_path):
    from codegen.harness.report import PEER, markdown, merge
    from codegen.harness.results import peer_figures

    latest = next(p for p in RECORDED if p.name == "bench-toy-float32-transformers-5.24.0.json")  # with its limits
    rows = json.loads(latest.read_text())["rows"]
    # the runner's flat timings (16 new tokens: 0.5 s to the first, 2.0 s to the last), as peer.py records them
    runner = {"e2e_s": [1.9, 2.0, 2.1], "ttft_s": [0.5, 0.5, 0.6], "new_tokens": 16, "load_s": 90.0}
    peer_rows = [{"family": r["family"], "size": r["size"], "dtype": r["dtype"], "batch": r["batch"],
                  **peer_figures(runner, r["batch"])} for r in rows[:1]] + [
        {**{k: rows[1][k] for k in ("family", "size", "dtype", "batch")},
         **peer_figures({"crashed": "RuntimeError: Unsupported CPU attention configuration"}, rows[1]["batch"])}]
    assert peer_rows[0]["decode"]["median"] == pytest.approx(0.1)
    assert peer_rows[0]["e2e"]["tokens_per_s"] == pytest.approx(8.0 * rows[0]["batch"])
    bench = json.loads(latest.read_text())
    machine, limits = bench["machine"], bench["machine_limits"]

    def peer_record(name, **changes):
        (tmp_path / name).write_text(json.dumps({"peer": PEER, "peer_version": "0.32.0", "rows": peer_rows,
                                                 "machine": machine, "machine_limits": limits, "dtype": "float32",
                                                 "settings": bench["settings"], "wall_s": 60.0, **changes}))
        return merge([latest, tmp_path / name])

    merged = peer_record("peer-vllm-x.json")
    joined = [row for run in merged["runs"] for row in run["rows"] if PEER in row]
    assert len(joined) == 2 and merged["peers"][0]["joined"]
    # measured on another machine, or on the same CPU model at other limits (a slower or busier machine): not
    # joined (their times do not compare with the bench's), said under the table
    slower = {**limits, "tp": {**limits["tp"], "read_gb_s": limits["tp"]["read_gb_s"] * 0.6}}
    for changes in ({"machine": {**machine, "cpu": "another CPU"}}, {"machine_limits": slower},
                    {"machine_limits": None}):
        apart = peer_record("peer-vllm-y.json", **changes)
        assert not any(PEER in row for run in apart["runs"] for row in run["rows"])
        assert "not joined: " in markdown(apart)
    assert "memory read " in apart["peers"][0]["not_joined"] or "only one of the two" in apart["peers"][0]["not_joined"]
    assert "the machine's limits differ: memory read" in markdown(peer_record("peer-vllm-z.json",
                                                                              machine_limits=slower))
    # beside a record of another CPU as well (merged first), the reason is still the one of its own CPU's record
    elsewhere = tmp_path / "bench-elsewhere.json"
    elsewhere.write_text(json.dumps({**bench, "machine": {**machine, "cpu": "another CPU"}}))
    (tmp_path / "peer-vllm-w.json").write_text(json.dumps({"peer": PEER, "peer_version": "0.32.0", "rows": peer_rows,
                                                           "machine": machine, "machine_limits": slower,
                                                           "dtype": "float32", "settings": bench["settings"],
                                                           "wall_s": 60.0}))
    both = merge([elsewhere, latest, tmp_path / "peer-vllm-w.json"])
    assert both["peers"][0]["not_joined"].startswith("the machine's limits differ: memory read")
    table = markdown(merged)
    assert "b/v decode, e2e" in table and " / crash |" in table and "joined to the bench rows above" in table
    assert "run paired with the bench" not in table
    paired = markdown(peer_record("peer-vllm-p.json", paired={"peer": PEER, "schedule": "family by family"}))
    assert ("run paired with the bench (each family's vLLM run right after its bench launch); decode step: "
            "(e2e - ttft) / (new_tokens - 1); joined") in paired
    # a runner that timed vLLM's engine steps: the line says so
    stepped_rows = [{**peer_rows[0], **peer_figures({**runner, "step_s": [0.1, 0.12]}, rows[0]["batch"])}]
    stepped = markdown(peer_record("peer-vllm-s.json", rows=stepped_rows))
    assert "decode step: the engine's steps once every sequence has its first token (inter-token latency)" in stepped
    b = rows[0]["codegen"]["decode"]["median"]
    assert f"{b / 0.1:.2f}×" in table


@pytest.mark.unit
def test_not_fastest_lists_every_cell_another_setup_wins():
    """The list the README and the closing note quote: each row's setups that took less time than codegen, by the
    bench's own ratio where it has one (a setup timed beside another (b) run), else the medians (the peer)."""
    from codegen.harness.report import NOT_FASTEST, PEER, markdown, merge, not_fastest

    def figures(decode, prefill, e2e):
        return {"decode": {"median": decode}, "prefill": {"median": prefill}, "e2e": {"total": {"median": e2e}}}

    row = {"family": "qwen3_moe", "size": "bench", "dtype": "float32", "batch": 16,
           "codegen": figures(2.0, 1.0, 4.0), "single": figures(1.0, 1.0, 4.2),
           "native": figures(9.0, 9.0, 9.0), "ratio_b_over_d": {"decode_median": 1.04, "prefill_median": 0.5},
           "stock": {"crashed": "RuntimeError: x"}, PEER: figures(2.5, None, 2.0)}
    record = {"machine": {"transformers": "5.24.0"}, "rows": [row]}
    assert not_fastest([record]) == ["- Qwen3-30B-A3B-like, toy, transformers 5.24.0, float32, batch 16: "
                                     "(d) decode 1.04×; (e) decode 2.00×; (v) end to end 2.00×"]
    row["codegen"] = figures(1.0, 1.0, 1.0)
    row.pop("ratio_b_over_d")
    assert not_fastest([record]) == []
    assert NOT_FASTEST in markdown(merge(RECORDED + PEERS))


# ------------------------------------------------------------------ report, merge, chart: the recorded runs


@pytest.mark.unit
def test_recorded_runs_are_there():
    """fp32 and bf16, toy and full widths, on transformers latest and 4.57.6 (docs/benchmark.md)."""
    runs = [json.loads(path.read_text()) for path in RECORDED]
    kinds = {(r["settings"]["size"], r["dtype"], r["machine"]["transformers"].split(".")[0]) for r in runs}
    assert {(size, dtype, major) for size in ("bench", "full") for dtype in ("float32", "bfloat16")
            for major in ("4", "5")} <= kinds, sorted(kinds)
    assert all({r["batch"] for r in run["rows"]} == {1, 16} for run in runs)


@pytest.mark.unit
def test_markdown_table_of_the_recorded_runs():
    from codegen.harness.report import markdown, merge

    table = markdown(merge(RECORDED + PEERS))
    rows = [row for path in RECORDED for row in json.loads(path.read_text())["rows"]]
    assert {row["family"] for row in rows} <= set(FAMILIES)
    lines = table.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("| model | transformers | dtype | batch |"))
    main = lines[start + 2:lines.index("", start)]  # the main table: one line per recorded row
    assert len(main) == len(rows) and all(" (" in line.split("|")[1] for line in main)
    assert "decode tokens/s" in table and "b/d decode, prefill" in table and "Runs:" in table
    # the committed table is this code's output on the committed runs; docs/results.md carries its main table and
    # the README a few rows (`bench --merge ... --readme README.md docs/results.md` regenerates both)
    assert table == (ROOT / "docs" / "bench" / "table.md").read_text()
    from codegen import splice
    from codegen.harness.report import MERGE, SUMMARY_END, SUMMARY_START, TABLE_END, TABLE_START, results_table, \
        summary_table

    results = (ROOT / "docs" / "results.md").read_text()
    assert splice.section(results, TABLE_START, TABLE_END) == results_table(table), f"stale: run `{MERGE}`"
    readme = (ROOT / "README.md").read_text()
    summary = splice.section(readme, SUMMARY_START, SUMMARY_END)
    assert summary == summary_table(merge(RECORDED + PEERS)), f"stale: run `{MERGE}`"
    assert summary.count("\n| ") >= 3  # a few rows, each a recorded row of the full table


@pytest.mark.unit
def test_recorded_runs_pass_the_bench_checks():
    from codegen.harness.bench import problems

    for path in RECORDED:
        assert problems(json.loads(path.read_text())) == [], path.name


@pytest.mark.cli
def test_merge_cli_writes_table_and_chart(tmp_path):
    result = subprocess.run([sys.executable, "-m", "codegen", "bench", "--merge", *RECORDED, "--json", tmp_path / "m.json",
                             "--markdown", tmp_path / "t.md", "--chart", tmp_path / "c.png"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "t.md").read_text()
    assert table in result.stdout and "| qwen2_moe (" in table
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    merged = json.loads((tmp_path / "m.json").read_text())
    assert len(merged["runs"]) == len(RECORDED)


@pytest.mark.cli
def test_merge_rejects_a_non_record_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = subprocess.run([sys.executable, "-m", "codegen", "bench", "--merge", bad], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a `bench --json` record" in result.stderr


@pytest.mark.cli
@pytest.mark.once
def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = run_codegen("bench", "--device", "cuda", "--smoke", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "CUDA" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.cli
def test_bad_tp_is_one_line():
    result = run_codegen("bench", "--smoke", "--tp", "1", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.cli
@pytest.mark.parametrize("args", [("--paired", "bench.json"),
                                  ("--peer", "vllm", "--paired", "bench.json"),
                                  ("--peer", "vllm", "--paired", "bench.json", "--json", "bench.json"),
                                  ("--peer", "vllm", "--json", "peer.json", "--markdown", "table.md"),
                                  ("--peer", "vllm", "--json", "peer.json", "--chart", "chart.png")])
def test_paired_without_a_peer_or_its_own_json_is_one_line(tmp_path, args):
    """`--paired` runs the bench beside `--peer vllm` and writes two records: without the peer, or without a
    separate path for each, it is refused before anything runs, and nothing is written; so is a peer run asked for
    the bench's table or chart, which it has no rows of."""
    result = run_codegen("bench", "--smoke", *(tmp_path / a if a.endswith((".json", ".md", ".png")) else a
                                               for a in args), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "--paired" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.runtime
def test_a_paired_run_hands_over_after_each_familys_launch(tmp_path):
    """What `bench --peer vllm --paired` runs vLLM in: with `after_launch`, every family gets a launch of its own
    and the hook runs right after it, with that family, before the next family's launch starts (real ranks,
    the demo's settings: tiny dirs, two setups, no compile)."""
    from codegen.harness.abrun import run_ab

    families = SMOKE[:2]
    events: list[str] = []  # the run's progress lines and the hook's calls, in the order they happened

    rows, *_ = run_ab("demo", families, 2, "cpu", tmp_path, events.append,
                      after_launch=lambda launched: events.append(f"after {launched}"))
    order = [e for e in events if e.startswith(("starting 2 CPU ranks", "after "))]
    assert order == [line for f in families for line in (next(e for e in order if e.startswith(
        f"starting 2 CPU ranks ({f})")), f"after {(f,)}")]
    assert sorted({row["family"] for row in rows}) == sorted(families)
    assert all(row["codegen"]["allreduce_decode_per_moe_layer_mean"] == 1 for row in rows)


@pytest.mark.cli
@pytest.mark.parametrize("args", [("--rounds", "2"), ("--rounds", "0"),
                                  ("--peer", "vllm", "--json", "peer.json", "--rounds", "3"),
                                  ("--merge", "bench.json", "--rounds", "2")])
def test_rounds_without_a_paired_peer_run_is_one_line(tmp_path, args):
    """`--rounds N` alternates (f) and the peer engine within `--peer vllm --paired`: anywhere else, or under 1, it
    is refused in one line before anything runs, and nothing is written."""
    result = run_codegen("bench", "--smoke", *(str(tmp_path / a) if a.endswith(".json") else a for a in args),
                         timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "--rounds" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.runtime
@pytest.mark.once
def test_a_run_in_rounds_pools_the_compiled_setups_timings_over_them(tmp_path):
    """`--rounds 2`: after the family's launch and the hook, a second launch of (b) and (f) alone and the hook again;
    the row's (f) decode steps are both rounds' (real ranks, a tiny dir, the demo's steps)."""
    from codegen.harness.abrun import SETTINGS, run_ab

    family = SMOKE[0]
    events: list[str] = []
    rows, *_ = run_ab("demo", (family,), 2, "cpu", tmp_path, events.append, groups={family: (("codegen", "compiled"),)},
                      after_launch=lambda launched: events.append(f"after {launched}"), rounds=2)
    kinds = {"starting 2 CPU ranks": "launch", f"after {(family,)}": "hook", f"{family}: round 2 of 2": "round 2"}
    order = [kind for e in events for start, kind in kinds.items() if e.startswith(start)]
    assert order == ["launch", "hook", "round 2", "hook"]
    (row,) = rows
    steps = SETTINGS["demo"]["decode_steps"]
    assert row["compiled"]["pooled_rounds"] == 2 and row["compiled"]["decode"]["n"] == 2 * steps
    assert row["codegen"]["decode"]["n"] == steps and "pooled_rounds" not in row["codegen"]
    assert row["compiled"]["allreduce_decode_per_moe_layer_mean"] == 1


@pytest.mark.unit
def test_later_rounds_add_the_compiled_setups_timings_rank_by_rank():
    """pool_rounds: a later round's (f) decode steps and end-to-end runs join the first launch's, rank by rank; its
    (b), a crashed round and a job it did not run add nothing."""
    from codegen.harness.abrun import pool_rounds, round_jobs

    jobs = [{"name": "f/b1/g0", "family": "f", "batch": 1, "setups": ("stock", "codegen", "compiled")},
            {"name": "f/b1/g1", "family": "f", "batch": 1, "setups": ("codegen", "native")}]
    assert round_jobs(jobs) == [{**jobs[0], "setups": ("codegen", "compiled")}]

    def rank(name, decode, crashed=None):
        compiled = {"crashed": crashed} if crashed else {"decode_s": decode, "e2e_s": [1.0], "ttft_s": [0.1]}
        return {"jobs": {name: {"ab": {"codegen": {"decode_s": [9.0]}, "compiled": compiled}}}}

    first = [rank("f/b1/g0", [0.1, 0.2]), rank("f/b1/g0", [0.3, 0.4])]
    pool_rounds(first, [rank("f/b1/g0/r1", [0.5]), rank("f/b1/g0/r1", [0.6])], {"f/b1/g0": "f/b1/g0/r1"})
    pool_rounds(first, [rank("f/b1/g0/r2", [], "RuntimeError: x")] * 2, {"f/b1/g0": "f/b1/g0/r2"})
    one = first[1]["jobs"]["f/b1/g0"]["ab"]
    assert one["compiled"]["decode_s"] == [0.3, 0.4, 0.6] and one["compiled"]["e2e_s"] == [1.0, 1.0]
    assert one["compiled"]["pooled_rounds"] == 2 and one["codegen"]["decode_s"] == [9.0]


@pytest.mark.unit
def test_a_peers_runs_of_a_family_pool_into_one_row():
    """pooled_figures: vLLM's runs of a family (one per round) give one row per batch whose medians are over every
    run's timings; a run that crashed adds nothing, and where none ran the row is the first run's crash."""
    from codegen.harness.peer import pooled_figures

    run = {"load_s": 9.0, "new_tokens": 16, "e2e_s": [2.0], "ttft_s": [0.5]}
    row = pooled_figures([run, {**run, "e2e_s": [3.0, 4.0], "ttft_s": [0.5, 0.5]}, {"crashed": "E: x"}], 1)
    assert row["runs"] == 2 and row["e2e"]["total"]["median"] == 3.0 and row["e2e"]["total"]["n"] == 3
    assert row["decode"]["median"] == pytest.approx((3.0 - 0.5) / 15)
    assert pooled_figures([{"crashed": "E: first"}, {"crashed": "E: second"}], 1) == {"crashed": "E: first"}
    # a runner that timed the engine's steps: their median over every run, the derived figure kept beside it
    stepped = pooled_figures([{**run, "step_s": [0.07, 0.08, 0.09]}, {**run, "step_s": [0.06, 0.10]}], 16)
    assert stepped["decode"]["median"] == pytest.approx(0.08) and stepped["decode"]["n"] == 5
    assert stepped["decode"]["e2e_minus_ttft"] == pytest.approx((2.0 - 0.5) / 15)
    assert stepped["decode_tokens_per_s"] == pytest.approx(16 / 0.08)


@pytest.mark.unit
def test_a_peers_decode_step_is_its_timed_steps_not_a_difference_that_the_prefill_moves():
    """peer_figures: where the runner timed vLLM's engine steps, a slow or fast prefill in one run does not move the
    decode step (the derivation from two runs' medians did: the full-width DeepSeek-V2-Lite-like row's 58.5 ms)."""
    from codegen.harness.results import PEER_STEPS_DERIVED, PEER_STEPS_TIMED, peer_figures

    raw = {"new_tokens": 16, "e2e_s": [2.75, 2.82], "ttft_s": [1.79, 2.03], "step_s": [0.067, 0.068, 0.071]}
    timed = peer_figures(raw, 16)["decode"]
    assert timed["median"] == pytest.approx(0.068) and timed["derived_from"] == PEER_STEPS_TIMED
    faster_prefill = peer_figures({**raw, "ttft_s": [1.79, 1.79]}, 16)["decode"]
    assert faster_prefill["median"] == timed["median"] and faster_prefill["e2e_minus_ttft"] != timed["e2e_minus_ttft"]
    older = peer_figures({k: v for k, v in raw.items() if k != "step_s"}, 16)["decode"]
    assert older == {"median": pytest.approx((2.785 - 1.91) / 15), "derived_from": PEER_STEPS_DERIVED}


# ------------------------------------------------------------------ the pure parts: order, numerics, ratios


@pytest.mark.unit
@pytest.mark.parametrize("setups", [["stock", "codegen"], ["stock", "codegen", "native"]])
def test_rotation_gives_every_setup_every_position_equally_often(setups):
    """ABBA generalised: over 2n units each setup runs first, middle and last equally often, and each pair
    of neighbours appears in both orders (order effects cancel)."""
    from codegen.harness.worker.ab import rotation

    n = len(setups)
    orders = [rotation(setups, k) for k in range(2 * n)]
    assert all(sorted(o) == sorted(setups) for o in orders)
    for position in range(n):
        column = [o[position] for o in orders]
        assert all(column.count(s) == 2 for s in setups), column
    assert rotation(["stock", "codegen"], 0) == ["stock", "codegen"]
    assert rotation(["stock", "codegen"], 1) == ["codegen", "stock"]


@pytest.mark.unit
def test_relative_error_and_greedy_agreement():
    import torch

    from codegen.harness.worker.reference import agree as _agree, relative as _relative

    ref = torch.tensor([[[1.0, -4.0, 2.0]], [[0.5, 0.1, 3.0]]])
    assert _relative(ref + 0.04, ref) == pytest.approx(0.01)
    moved = ref.clone()
    moved[1, 0, 0] = 5.0  # row 1's greedy token changes
    assert _agree(moved, ref) == (1, 2)


@pytest.mark.unit
def test_low_precision_limit_is_a_multiple_of_the_single_process_error():
    from codegen.harness.checks import LOW_PRECISION_FACTOR, ab_problems, low_precision_limit

    single = {"prefill_relative": 0.004, "decode_relative": 0.006}
    assert low_precision_limit(single) == pytest.approx(LOW_PRECISION_FACTOR * 0.006)
    assert low_precision_limit(None) is None
    b = {"allreduce_prefill_per_moe_layer": [1, 1], "allreduce_decode_per_moe_layer_mean": 1,
         "allreduce_decode_per_moe_layer_min": 1, "allreduce_decode_per_moe_layer_max": 1,
         "counts_same_on_all_ranks": True, "maxdiff_prefill": 0.3, "maxdiff_decode": 0.3,
         "relative_prefill": 0.005, "relative_decode": 0.007}
    row = {"moe_layers": 2, "dtype": "bfloat16", "codegen": b, "reference": {"single_process_error": single}}
    assert ab_problems("x", row) == []  # 0.3 absolute would fail float32's 1e-5; bf16 is judged relatively
    row["codegen"] = {**b, "relative_decode": 0.05}
    (problem,) = ab_problems("x", row)
    assert "5.00e-02 (relative) > 2.40e-02" in problem


@pytest.mark.unit
def test_ratios_are_b_over_the_other_setup_and_none_where_it_crashed():
    from codegen.harness.results import ratios, spread

    def figures(ms: float, experts: int) -> dict:
        return {"allreduce_prefill": 9, "allreduce_decode_step": spread([9.0]), "decode": spread([ms]),
                "prefill": spread([10 * ms]), "param_bytes_per_rank": {"experts": experts, "rest": 5}}

    r = ratios(figures(2.0, 50), figures(4.0, 100))
    assert r["decode_median"] == r["prefill_median"] == r["expert_bytes"] == 0.5 and r["rest_bytes"] == 1.0
    assert set(ratios(figures(2.0, 50), {"mode": "native", "crashed": "RuntimeError: x"}).values()) == {None}


# ------------------------------------------------------------------ the machine's limit: the floor arithmetic


#: a known small model by hand: hidden 4, vocab 10, one layer: attention q, k, v, o (4 x 4 each) and two norms (4
#: each), an embedding and a separate head (10 x 4), one MoE layer of 4 experts with gate, up (4 -> 2) and down
#: (2 -> 4), float32
_SMALL = {"dense_bytes": (4 * 16 + 2 * 4) * 4, "dense_flops_per_token": 2 * 4 * 16,
          "head_bytes": 40 * 4, "head_flops_per_token": 2 * 40, "lookup_bytes": 40 * 4, "lookup_row_bytes": 4 * 4,
          "moe": [{"experts": 4, "expert_bytes": 4 * 3 * 8 * 4, "expert_numel": 4 * 3 * 8}]}


@pytest.mark.unit
def test_floor_arithmetic_on_a_known_small_config():
    """Bytes: the weights outside the experts, the rows looked up, each expert hit once; FLOPs: 2 per matrix
    element per token, the head per logit position, one expert per (token, expert) pair; the floor is the larger of
    bytes / bandwidth and FLOPs / GEMM throughput, the slowest rank's."""
    from codegen.harness.limits import floor_seconds, forward_work, of_limit, phase_floor, setup_floor, summary

    # decode, batch 1, top-2: two experts hit, two pairs routed
    one = forward_work(_SMALL, [{"distinct": 2, "assignments": 2}], tokens=1, logit_positions=1)
    assert one == {"bytes": 288 + 160 + 16 + 384 * 2 // 4, "flops": 128 + 80 + 2 * 2 * 24}
    # batch 16: every expert hit, 32 pairs; a prefill of 16 tokens with every position's logits
    sixteen = forward_work(_SMALL, [{"distinct": 4, "assignments": 32}], tokens=16, logit_positions=16)
    assert sixteen == {"bytes": 288 + 160 + 160 + 384, "flops": 16 * 128 + 16 * 80 + 2 * 32 * 24}
    # routing not seen: every expert read, no expert FLOPs counted (still a lower bound)
    assert forward_work(_SMALL, None, 1, 1) == {"bytes": 288 + 160 + 16 + 384, "flops": 128 + 80}
    limits = {"read_bytes_per_s": 1000.0, "gemm_flops_per_s": 100.0}
    assert floor_seconds(one, limits) == pytest.approx(304 / 100)  # compute-bound at these limits
    assert floor_seconds(one, {**limits, "read_bytes_per_s": 100.0}) == pytest.approx(656 / 100)
    assert floor_seconds(one, {}) is None
    # TP=2: each rank holds half of every weight; the slower rank (half the bandwidth) sets the floor
    half = {**_SMALL, **{k: _SMALL[k] // 2 for k in ("dense_bytes", "dense_flops_per_token", "head_bytes",
                                                      "head_flops_per_token")},
            "moe": [{"experts": 4, "expert_bytes": 192, "expert_numel": 48}]}
    work = forward_work(half, [{"distinct": 2, "assignments": 2}], 1, 1)
    slow = {"read_bytes_per_s": 10.0, "gemm_flops_per_s": 1e9}
    found = phase_floor([work, work], [{"read_bytes_per_s": 20.0, "gemm_flops_per_s": 1e9}, slow])
    assert found == {"s": work["bytes"] / 10.0, "bytes_per_rank": work["bytes"], "flops_per_rank": work["flops"],
                     "bound": "memory"}
    per_rank = {"prefill": sixteen, "ttft": sixteen, "decode": [one, one, sixteen]}
    floors = setup_floor([per_rank], [limits], e2e_tokens=4)
    assert floors["decode"]["s"] == pytest.approx(304 / 100) and floors["decode"]["steps"] == 3
    assert floors["e2e"]["s"] == pytest.approx(floors["ttft"]["s"] + 3 * floors["decode"]["s"])
    assert setup_floor([per_rank], [None]) is None  # a record without limits has no floor
    assert of_limit(1.0, 4.0) == 0.25 and of_limit(None, 4.0) is None
    assert summary([{"read_bytes_per_s": 2e9, "copy_bytes_per_s": 1e9, "gemm_flops_per_s": 5e9},
                    {"read_bytes_per_s": 3e9, "copy_bytes_per_s": 2e9, "gemm_flops_per_s": 4e9}], 2)["gemm_gflop_s"] == 4


@pytest.mark.unit
def test_inventory_and_routing_of_a_tiny_model_match_its_config():
    """The rank's inventory comes from walking the parameters it holds (no family formula): on the tiny Qwen3-MoE
    every byte is in exactly one kind, each MoE layer holds its experts' weights, and the routing hooks see top-k
    (token, expert) pairs per token."""
    import torch
    import transformers

    from codegen.families import FAMILIES as TABLE
    from codegen.harness.examples import shape
    from codegen.harness.worker.limits import RoutingRecorder, inventory

    config = getattr(transformers, TABLE["qwen3_moe"].config_class)(**shape("qwen3_moe", "tiny"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    inv = inventory(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert inv["dense_bytes"] + inv["head_bytes"] + inv["lookup_bytes"] + sum(m["expert_bytes"] for m in inv["moe"]) \
        == total
    assert inv["head_bytes"] == inv["lookup_bytes"] == config.vocab_size * config.hidden_size * 4
    assert inv["lookup_row_bytes"] == config.hidden_size * 4
    assert len(inv["moe"]) == config.num_hidden_layers
    for layer in inv["moe"]:
        assert layer["experts"] == config.num_experts
        assert layer["expert_numel"] == config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder:
        model(torch.randint(0, config.vocab_size, (2, 5)))
    hits = recorder.take()
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (2, 5)))  # outside `with`: no hooks, nothing seen
    assert [h["assignments"] for h in hits] == [10 * config.num_experts_per_tok] * config.num_hidden_layers
    assert all(config.num_experts_per_tok <= h["distinct"] <= config.num_experts for h in hits)
    assert recorder.take() is None  # nothing seen since


@pytest.mark.unit
def test_records_without_limits_render_a_dash():
    """Records that predate the measurement show `—` in the table, never a number."""
    from codegen.harness.report import NO_LIMIT, markdown, merge, summary_table

    merged = merge(RECORDED + PEERS)
    table = markdown(merged)
    assert "% of limit: decode" in table and f"| {NO_LIMIT} / {NO_LIMIT} / " in table
    assert f"machine limits {NO_LIMIT} (not measured in this record)" in table
    # the summary's rows are the full-width float32 5.24 record's, which measured the limits: a figure, not a dash
    assert "of the machine's limit in these rows (floor / measured" in summary_table(merged)


@pytest.mark.unit
def test_rows_not_run_say_why_in_the_table_and_the_notes():
    """A row the memory plan refused and one whose launch failed (its ranks killed) each say so, the reason in the
    notes; the other rows of the record stand."""
    from codegen.harness.abrun import NOT_RUN_FAILED, NOT_RUN_MEMORY
    from codegen.harness.report import NOT_RUN_CELL, markdown

    record = json.loads((ROOT / "docs" / "bench" / "bench-full-float32-transformers-5.24.0.json").read_text())
    record["rows"] += [{**row, "family": "gpt_oss", "not_run": "needs about 30 GiB"} for row in record["rows"][:1]]
    ran = [row for row in record["rows"] if not row.get("not_run")]
    killed = ran[0]["family"]
    reason = "benchmark on 2 ranks failed (exit -9): killed"
    record["rows"] = [{**row, "not_run": reason, "not_run_cause": NOT_RUN_FAILED} if row["family"] == killed else row
                      for row in record["rows"]]
    table = markdown(record)
    assert f"not run: {NOT_RUN_CELL[NOT_RUN_FAILED]} (notes)" in table and f"not run: {reason}" in table
    refused = [row for row in record["rows"] if row.get("not_run") and row["family"] != killed]
    assert refused and f"not run: {NOT_RUN_CELL[NOT_RUN_MEMORY]} (notes)" in table  # a record without a cause: memory
    others = {row["family"] for row in ran} - {killed}
    assert others and all(f"| {family} (" in table for family in others)
