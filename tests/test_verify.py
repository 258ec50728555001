"""`python -m codegen verify <dir> --tp 2`, as a user runs it, and the figures it measures.

The patched dirs of every family, and one patched with the knob off, are verified together in ONE
launch of 2 real DeepSpeed ranks (fp32, CPU; codegen.harness.verify.verify_dirs, what `verify` runs for one
dir), which measures per dir: the patched dir without a TP policy, under its generated policy, and
stock AutoTP on the unpatched dir, all against the unpatched model run in one process. The tests below
assert on those records (codegen.harness.results' schema). The command itself (`python -m codegen verify
--json`, a real process) is run once, in the latest environment, on the knob-off dir: exit status 6,
its report and FAIL lines, and the JSON it writes.

Tiny checkpoints (tests/conftest.py): qwen2_moe has 2 layers, both MoE; deepseek_v2 has 2 layers,
the first dense (first_k_dense_replace=1), the second MoE. DeepSpeed makes the LM head row-parallel,
so one forward needs: one all-reduce per attention block + per MoE block + per dense MLP block + 1.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from codegen.cli import main as codegen_main
from conftest import FAMILIES, STOCK_AUTOTP_CRASHES, run_codegen

pytestmark = pytest.mark.runtime

TP = 2
TOL = 1e-5
def _blocks(family: str) -> tuple[int, int, int]:
    """(attention blocks, MoE blocks, dense MLP blocks) of a tiny checkpoint (the table's tiny example)."""
    from codegen.families import FAMILIES as TABLE
    from codegen.harness.examples import shape
    from codegen.patch.config import moe_layers

    from codegen.families import EXAMPLES

    config, table = shape(family, "tiny"), TABLE[family]
    layers, moe = config[table.layers.count], len(moe_layers(config, table))
    if table.single_mixer_blocks:  # each block one mixer: attention (or a mixer kept whole), MoE or a dense MLP
        dense = EXAMPLES[family].dense_mixers
        return layers - moe - dense, moe, dense
    # an MoE block that is a whole decoder layer keeps a dense MLP beside its experts (Gemma 4): one more each
    beside = moe if set(table.block_reductions) & set(table.moe_block_attrs) else 0
    # sublayers (LongCat): each layer holds `sublayers` attention blocks, and as many dense MLPs per dense attribute
    dense = layers * table.sublayers * len(table.dense_mlp_attrs)
    return layers * table.sublayers, moe, layers - moe + beside + dense


SHAPE = {family: _blocks(family) for family in FAMILIES}
VERIFY_FAILED = 6


def _patched(templates, tmp_path_factory, kind: str, *flags: str):
    """A patched copy of a tiny checkpoint, patched in this process: `patch` as a subprocess is tested by the
    cli tier, and 60-odd interpreter starts would cost this launch's setup half a minute."""
    directory = tmp_path_factory.mktemp(f"verify-{kind}") / kind
    shutil.copytree(templates[kind], directory)
    assert codegen_main(["patch", "-q", str(directory), *flags]) == 0
    return directory


KNOB_OFF = "knob-off"
#: Kimi-K2's hub remote code (DeepSeek-V3's, under `"model_type": "kimi_k2"`): our fixture, no transformers config
KIMI_K2 = "hub_kimi_k2"


@pytest.fixture(scope="session")
def verified(_tiny_templates, tmp_path_factory):
    """{family | KNOB_OFF | KIMI_K2: (dir, record)}: every family's patched dir, a qwen2_moe dir patched with
    `--no-coalesce` and the Kimi-K2 remote-code fixture, verified in one launch (codegen.harness.verify.verify_dirs)."""
    from codegen.harness.verify import verify_dirs

    dirs = {family: _patched(_tiny_templates, tmp_path_factory, family) for family in FAMILIES}
    dirs[KNOB_OFF] = _patched(_tiny_templates, tmp_path_factory, "qwen2_moe", "--no-coalesce")
    dirs[KIMI_K2] = _patched(_tiny_templates, tmp_path_factory, KIMI_K2)
    records = verify_dirs(list(dirs.values()), TP, timeout=900)
    return {key: (d, r) for (key, d), r in zip(dirs.items(), records)}


def _routed_expert(name: str) -> bool:
    """A routed-expert weight, by the table's names: per-expert modules or fused 3-D tensors."""
    from codegen.families import FAMILIES as TABLE

    # an MoE block holding its expert modules itself (4.x GraniteMoe: `input_linear.weight`, `output_linear.weight`)
    held = {f".{block}.{p}" for f in TABLE.values() for legacy in (False, True) if f.experts_attr_of(legacy) == ""
            for block in f.moe_block_attrs for p in f.names(legacy)[0].parameters}
    return name.endswith(tuple(held)) or any(
        f".{f.experts_attr}." in name or name.endswith((f".{f.experts_attr}.{f.fused.gate_up}",
                                                       f".{f.experts_attr}.{f.fused.down}"))
        for f in TABLE.values())


def _report(verified, family) -> dict:
    _, record = verified[family]
    return record["families"][family]


def test_the_shapes_here_are_the_tiny_examples():
    from codegen.harness.examples import families_with

    assert set(SHAPE) == set(FAMILIES) == set(families_with("tiny"))


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_report_and_verdict(verified, family):
    from codegen.harness.verify import format_report, ok_line

    directory, record = verified[family]
    assert record["schema"] == "codegen-result/1" and record["command"] == "verify"
    assert record["problems"] == [] and record["ok"] is True
    assert record["tolerance"] == TOL and record["tp"] == TP
    out = format_report(directory, record) + "\n" + ok_line(TP)
    assert f"verify {directory} (tp=2, world=2" in out
    for row in ("codegen", "stock", "no-policy"):
        assert any(line.split()[:1] == [row] for line in out.splitlines()), out
    attention, moe, dense = SHAPE[family]
    reducing = sum(record["families"][family]["codegen"][0]["attention_block_reductions"])  # none per whole mixer
    total = reducing + moe + dense + 1
    assert f"= {total} (expected {total}; counted at torch's dispatcher)" in out
    assert "greedy 16 tokens: identical" in out
    assert "backward through the MoE reduction: gradient unchanged" in out
    assert out.rstrip().splitlines()[-1].startswith("OK: one all-reduce per MoE layer")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_within_1e5_and_16_greedy_tokens_identical(verified, family):
    ranks = _report(verified, family)["codegen"]
    assert len(ranks) == TP
    for r in ranks:
        assert r["maxdiff"] <= TOL
        assert r["same_tokens"] is True


@pytest.mark.parametrize("family", FAMILIES)
def test_one_allreduce_per_block_and_none_per_expert(verified, family):
    from codegen.families import EXAMPLES
    from codegen.families import FAMILIES as TABLE

    attention, moe, dense = SHAPE[family]
    for r in _report(verified, family)["codegen"]:
        assert (r["attention_blocks"], r["moe_blocks"], r["dense_mlp_blocks"]) == (attention, moe, dense)
        assert r["allreduce_per_moe_block"] == [1] * moe  # routed + shared experts: exactly one, none per expert
        # one per attention block, none per mixer the family keeps whole on every rank (`Family.whole_modules`)
        reductions = r["attention_block_reductions"]
        assert reductions.count(0) == EXAMPLES[family].whole_mixers  # what docs/support.md quotes
        assert not reductions.count(0) or TABLE[family].whole_modules
        assert r["allreduce_per_attention_block"] == reductions
        assert r["allreduce_per_dense_mlp_block"] == [1] * dense
        assert r["lm_head_type"] == "LmHeadLinearAllreduce" and r["allreduce_lm_head"] == 1
        assert r["allreduce_per_forward"] == sum(reductions) + moe + dense + 1
        # counted at the dispatcher: no grad, every reduction, the MoE one included, is DeepSpeed's shm fast path
        assert r["allreduce_entries"] == {"deepspeed::inference_all_reduce_": sum(reductions) + moe + dense + 1}
        assert r["moe_allreduce_entries"] == {"deepspeed::inference_all_reduce_": moe}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in STOCK_AUTOTP_CRASHES])
def test_stock_autotp_is_what_the_knob_improves_on(verified, family):
    """Same numerics as stock AutoTP; stock either reduces per expert or leaves the experts unsharded."""
    from codegen.families import FAMILIES as TABLE
    from codegen.families import STOCK_AUTOTP

    report = _report(verified, family)
    moe = SHAPE[family][1]
    assert len(report["stock"]) == TP
    for ours, stock in zip(report["codegen"], report["stock"]):
        assert "crashed" not in stock
        if QUOTED_STOCK_FIGURES:  # what docs/support.md's table quotes (codegen.support renders the table's)
            quoted = STOCK_AUTOTP[family]
            assert stock["allreduce_per_forward"] == quoted.allreduces
            assert stock["bytes"]["experts"] == round(quoted.experts * stock["full_bytes"]["experts"])
        if STOCK_AUTOTP[family].wrong or (LEGACY and STOCK_AUTOTP[family].legacy_wrong):
            # silently wrong (hunyuan_v1_moe: its router is split; granitemoe's on 4.x likewise; qwen3_omni_moe: its
            # attention heads are cut unevenly, the routers whole); codegen not
            assert stock["maxdiff"] > TOL >= ours["maxdiff"]
            if STOCK_AUTOTP[family].wrong_routers:
                assert stock["bytes"]["gates"] < ours["bytes"]["gates"]
            continue
        assert stock["maxdiff"] <= TOL
        per_expert = any(c > 1 for c in stock["allreduce_per_moe_block"])
        unsharded = stock["bytes"]["experts"] == stock["full_bytes"]["experts"]
        assert per_expert or unsharded
        if unsharded and not TABLE[family].shared_experts:
            # every rank runs every expert, nothing to reduce in the MoE layer: codegen adds its one reduction
            # per MoE layer in exchange for holding 1/tp of the experts
            assert stock["allreduce_per_moe_block"] == [0] * moe
            assert ours["allreduce_per_forward"] == stock["allreduce_per_forward"] + moe
        else:
            assert ours["allreduce_per_forward"] <= stock["allreduce_per_forward"]
        if TABLE[family].wrapper is None:
            assert ours["bytes"]["total"] <= stock["bytes"]["total"]
        else:  # stock also splits the vision tower (and then fails on an image): compare the experts alone
            assert ours["bytes"]["experts"] <= stock["bytes"]["experts"]


@pytest.mark.parametrize("family", STOCK_AUTOTP_CRASHES)
def test_a_stock_autotp_crash_is_recorded_and_codegen_still_passes(verified, family):
    """Stock AutoTP is a comparison: its crash is one line per rank in the record and a row of the report;
    the patched dir is measured and judged in the same launch as every other family."""
    from codegen.harness.verify import format_report

    directory, record = verified[family]
    report = _report(verified, family)
    assert [r["rank"] for r in report["stock"]] == list(range(TP))
    for stock in report["stock"]:
        assert set(stock) == {"mode", "rank", "world_size", "crashed"}
        assert "\n" not in stock["crashed"]
    if QUOTED_STOCK_FIGURES:  # the line docs/support.md quotes, on some rank (another release may fail elsewhere)
        lines = [stock["crashed"] for stock in report["stock"]]
        assert any(line.startswith(STOCK_AUTOTP_CRASHES[family]) for line in lines), lines
    assert record["ok"] is True and record["problems"] == []
    assert len(report["codegen"]) == TP and all(r["maxdiff"] <= TOL for r in report["codegen"])
    (stock_row,) = [line for line in format_report(directory, record).splitlines() if line.split()[:1] == ["stock"]]
    assert stock_row.split()[1] == "crash" and report["stock"][0]["crashed"] in stock_row


def _latest_transformers() -> bool:
    from importlib.metadata import version

    from codegen.regression import LATEST

    return version("transformers") == LATEST


#: docs/support.md quotes stock AutoTP's figures as measured on the pinned latest transformers
QUOTED_STOCK_FIGURES = _latest_transformers()


def _legacy_transformers() -> bool:
    from importlib.metadata import version

    from codegen.versions import is_legacy

    return is_legacy(version("transformers"))


#: transformers 4.x: the families' 4.x sources (where stock AutoTP can differ: StockAutoTP.legacy_wrong)
LEGACY = _legacy_transformers()


def _takes_images(family: str) -> bool:
    from codegen.families import FAMILIES as TABLE

    wrapper = TABLE[family].wrapper
    return wrapper is not None and bool(wrapper.image_input)


IMAGE_FAMILIES = [f for f in FAMILIES if _takes_images(f)]


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_with_an_image_in_the_prompt_still_one_reduction_per_moe_layer(verified, family):
    """A multimodal wrapper's vision tower and projector run whole on every rank: a prompt holding an image
    (codegen.harness.worker.images) reduces exactly as a text-only one, with the same logits as one process."""
    from codegen.families import STOCK_AUTOTP
    from codegen.harness.verify import format_report

    attention, moe, dense = SHAPE[family]
    report = _report(verified, family)
    for r in report["codegen"]:
        reducing = sum(r["attention_block_reductions"])  # none per mixer kept whole
        assert r["image"]["allreduce_per_forward"] == reducing + moe + dense + 1 == r["allreduce_per_forward"]
        assert r["image"]["allreduce_per_moe_block"] == [1] * moe
        assert r["image"]["maxdiff"] <= TOL
    for r in report["no-policy"]:
        assert r["image"]["maxdiff"] == 0.0 and r["image"]["allreduce_per_forward"] == 0
    if QUOTED_STOCK_FIGURES and "crashed" not in report["stock"][0]:
        quoted = STOCK_AUTOTP[family]
        for stock in report["stock"]:  # stock AutoTP splits the vision tower too
            if quoted.image_crash:
                assert stock["image"]["crashed"].startswith(quoted.image_crash), stock["image"]
            else:
                assert stock["image"]["allreduce_per_forward"] == quoted.image_allreduces
    assert "with an image in the prompt: codegen" in format_report(*verified[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_routed_experts_halved_and_routers_whole(verified, family):
    for r in _report(verified, family)["codegen"]:
        assert r["full_bytes"]["experts"] > 0
        assert r["bytes"]["experts"] * TP == r["full_bytes"]["experts"]
        assert r["bytes"]["gates"] == r["full_bytes"]["gates"] > 0
        assert r["gates_intact"] is True
        assert r["gate_types"] == r["gate_types_reference"]  # the original router classes, not DeepSpeed's
        assert len(r["gate_types"]) >= SHAPE[family][1]


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_weights_stay_registered_parameters_and_no_full_copy_survives(verified, family):
    ranks = _report(verified, family)["codegen"]
    for r in ranks:
        assert r["sharded_params"] > 0
        assert r["sharded_unknown"] == []
        assert r["sharded_unregistered"] == []  # nn.Parameter, in parameters() and state_dict(), same storage
        assert r["oversized_storage_params"] == []  # no shard is a view pinning the full tensor
        assert r["full_size_copies_alive"] == 0
        for name, (shape, full) in r["sharded_shapes"].items():
            if _routed_expert(name):
                assert shape != full and len(shape) == len(full), name
    # DeepSpeed cuts its layers in tp_grain_size (64) steps, so on these 64-wide models a layer may sit
    # whole on one rank; the group as a whole holds every sharded weight exactly once.
    assert sum(r["sharded_bytes"] for r in ranks) == ranks[0]["sharded_full_bytes"] > 0
    assert sum(r["bytes"]["total"] for r in ranks) < TP * ranks[0]["full_bytes"]["total"]


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_without_a_policy_is_the_unpatched_model(verified, family):
    """torch.distributed is up, no TP policy applied: bit-identical, and no stray reduction."""
    for r in _report(verified, family)["no-policy"]:
        assert r["maxdiff"] == 0.0
        assert r["same_tokens"] is True
        assert r["allreduce_per_forward"] == 0
        assert r["allreduce_per_moe_block"] == [0] * SHAPE[family][1]
        assert r["bytes"] == r["full_bytes"]
        assert r["world_size"] == TP


@pytest.mark.parametrize("family", FAMILIES)
def test_inserted_reduction_backward_passes_the_gradient_through(verified, family):
    for r in _report(verified, family)["codegen"]:
        grad = r["grad_check"]
        assert grad["applicable"] is True
        assert grad["autograd_node"] == "_AllReduceSumBackward"  # grad enabled: the autograd-aware all-reduce
        assert grad["grad_entries"] == {"c10d::allreduce_": 1}  # torch.distributed's, under autograd
        assert grad["no_grad_entries"] == {"deepspeed::inference_all_reduce_": 1}  # DeepSpeed's shm op
        assert grad["forward_is_sum"] is True and grad["no_grad_is_sum"] is True
        assert grad["grad_identity"] is True


def test_knob_off_keeps_deepspeeds_reductions_and_fails_verify(verified):
    """`patch --no-coalesce`: correct results with DeepSpeed's per-layer reductions; verify reports the
    MoE layers that do not get the one-reduction treatment."""
    from codegen.families import KNOB

    directory, record = verified[KNOB_OFF]
    assert json.loads((directory / "config.json").read_text())[KNOB] is False
    assert record["ok"] is False
    assert any("expected 1 each" in p or "routed experts hold" in p for p in record["problems"])
    report = record["families"]["qwen2_moe"]
    for off, stock in zip(report["codegen"], report["stock"]):
        assert off["maxdiff"] <= TOL and off["same_tokens"] is True
        assert off["grad_check"] == {"applicable": False}  # the patched forward does not reduce
        # the policy left DeepSpeed's per-layer reductions (and its sharding) exactly as stock AutoTP has them
        assert off["allreduce_per_moe_block"] == stock["allreduce_per_moe_block"]
        assert off["allreduce_per_forward"] == stock["allreduce_per_forward"]
        assert off["bytes"] == stock["bytes"]
        per_expert = any(c > 1 for c in off["allreduce_per_moe_block"])
        unsharded = off["bytes"]["experts"] == off["full_bytes"]["experts"]
        assert per_expert or unsharded
    for r in report["no-policy"]:
        assert r["maxdiff"] == 0.0 and r["allreduce_per_forward"] == 0


@pytest.mark.once
def test_verify_command_on_the_knob_off_dir_exits_6_with_its_report(verified):
    """The command as a user runs it: report on stdout, one FAIL line per problem, one error line, exit 6."""
    directory, batched = verified[KNOB_OFF]
    out = directory.parent / "verify.json"
    proc = run_codegen("verify", directory, "--tp", TP, "--json", out, timeout=900)
    assert proc.returncode == VERIFY_FAILED, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["schema"] == "codegen-result/1" and record["ok"] is False
    assert f"verify {directory} (tp=2, world=2" in proc.stdout  # the report is still printed
    for row in ("codegen", "stock", "no-policy"):
        assert any(line.split()[:1] == [row] for line in proc.stdout.splitlines()), proc.stdout
    fails = [line for line in proc.stderr.splitlines() if line.startswith("FAIL ")]
    assert fails == [f"FAIL {p}" for p in record["problems"]] and fails
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: ")
    assert "OK:" not in proc.stdout and "Traceback" not in proc.stderr
    # the same figures as the batched launch: one worker, one check
    assert record["problems"] == batched["problems"]


def test_verify_refuses_an_unpatched_dir_and_a_bad_world(make_dir):
    directory = make_dir("qwen2_moe")
    result = run_codegen("verify", directory, "--tp", TP)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {directory} is not patched: "
                                                  f"run `python -m codegen patch {directory}` first"]
    result = run_codegen("verify", directory, "--tp", 2, "--world", 3)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --world 3 must be a multiple of --tp 2"
    started = time.monotonic()
    result = run_codegen("verify", directory, "--tp", 3)  # bad input, refused before any rank starts
    assert result.returncode == 2 and time.monotonic() - started < 20
    assert result.stderr.strip().splitlines() == [f"error: {directory / 'config.json'}: --tp 3 does not divide "
                                                  "num_attention_heads = 4: pick a tensor-parallel size that divides it"]


def test_kimi_k2_remote_code_reduces_once_per_moe_layer_where_stock_reduces_per_expert(verified):
    """Kimi-K2 dirs ship DeepSeek-V3 remote code (per-expert MLPs) under their own model type: patched as
    deepseek_v3, the record keeps the dir's model type; stock AutoTP shards those experts and reduces per expert."""
    directory, record = verified[KIMI_K2]
    assert record["ok"] is True and record["problems"] == []
    ((name, report),) = record["families"].items()
    assert name == "kimi_k2"
    config = json.loads((directory / "config.json").read_text())
    layers = config["num_hidden_layers"]
    moe = layers - config["first_k_dense_replace"]
    for ours, stock in zip(report["codegen"], report["stock"]):
        assert ours["allreduce_per_forward"] == 2 * layers + 1 and ours["allreduce_per_moe_block"] == [1] * moe
        assert ours["maxdiff"] <= TOL and ours["same_tokens"] is True and ours["gates_intact"] is True
        assert ours["bytes"]["experts"] * TP == ours["full_bytes"]["experts"]
        assert stock["maxdiff"] <= TOL and all(c > 1 for c in stock["allreduce_per_moe_block"])
        assert stock["allreduce_per_forward"] > ours["allreduce_per_forward"]


def test_verify_compile_checks_the_compiled_forward_as_well(_tiny_templates, tmp_path_factory, tmp_path):
    """`verify --compile`: the patched dir also runs with its forward compiled (the policy's compile=True), checked
    against the same single-process model and the eager codegen phase on each rank: the same all-reduces per
    forward (on transformers 5.x inside its one graph per forward; 4.x's expert loop breaks the graph, so it runs
    eager, said in the report), logits and decode steps within the tolerance, the same greedy tokens."""
    from packaging.version import Version
    from transformers import __version__

    directory = _patched(_tiny_templates, tmp_path_factory, "qwen3_moe")
    out = tmp_path / "verify.json"
    proc = run_codegen("verify", directory, "--tp", TP, "--compile", "--json", out, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["ok"] is True and record["problems"] == []
    report = record["families"]["qwen3_moe"]
    layers = SHAPE["qwen3_moe"][0]
    assert len(report["compiled"]) == TP
    for eager, compiled in zip(report["codegen"], report["compiled"]):
        assert compiled["allreduce_per_forward"] == eager["allreduce_per_forward"] == 2 * layers + 1
        assert compiled["other_collectives_per_forward"] == 0
        assert compiled["maxdiff"] <= TOL and compiled["decode_maxdiff"] <= TOL and compiled["same_tokens"] is True
        if Version(__version__).major >= 5:
            assert compiled["fallback"] is None and compiled["graphs_per_forward"] == 1 and compiled["graphs"] >= 3
        else:
            assert compiled["fallback"] and compiled["graphs"] == 0
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("  compiled (compile=True): ")]
    assert f"{2 * layers + 1} all-reduces per forward" in line and "identical" in line
