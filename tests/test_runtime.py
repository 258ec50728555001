"""The generated AutoTP policy on real processes, and the errors it gives before any.

* 4 real DeepSpeed ranks, tp_size 2 (two TP groups on one node), the hub-format DeepSeek checkpoint:
  every reduction stays in its own group. DeepSpeed's CPU shared-memory all-reduce ignores the
  group and would sum over all 4 ranks; the policy routes reductions through torch.distributed in
  that case (`_keep_reductions_in_group`). Without that, logits are off by ~1e-1 (measured by
  disabling it in a copy of the policy), so the 1e-5 check below proves it. DeepSpeed's
  tp_grain_size is lowered to 16 here so that it too splits these 64-wide layers evenly, and every
  rank's sharded layers are exactly 1/2 of the unsharded bytes.
* The hybrid, single-mixer and several-expert-sets families on 4 ranks (tp 4, and two groups of tp 2). Every run of
  4 ranks shares one launch per tp size with the others (`four_rank_runs`).
* The policy's user errors are one line, and raised before any distributed call (one process).
* The rendered policy is self-contained and never reduces without naming a group (static checks).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from codegen.cli import main as codegen_main
from codegen.families import FAMILIES as TABLE

pytestmark = pytest.mark.runtime

TOL = 1e-5


def _patch(directory: Path, *flags: str) -> Path:
    assert codegen_main(["patch", "-q", str(directory), *flags]) == 0
    return directory


def _policy(directory: Path):
    spec = importlib.util.spec_from_file_location(f"policy_{directory.name}", directory / "autotp_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- 4 ranks, every run in 2 launches


def _four_rank_jobs(templates, tmp_path_factory) -> list[tuple[int, dict]]:
    """(tp, job) for every run of 4 ranks below: the hub-format DeepSeek checkpoint in two groups of tp 2 (also
    without a policy), then each hybrid, single-mixer and several-expert-sets run (a tiny example with 4 kv heads, so
    tp 4 divides every head count). DeepSpeed's grain 8 splits the 32-wide per-expert layers of transformers 4.x
    evenly over 4 ranks too; 16 splits the DeepSeek checkpoint's 64-wide layers evenly over 2."""
    import shutil

    from codegen.harness.examples import build_example, installed_families
    from codegen.modeldir.pristine import materialize_unpatched

    decode = {"generate": 8, "decode_check": 8, "tp_grain_size": 8}
    base = tmp_path_factory.mktemp("world4")
    directory = base / "hub_deepseek"
    shutil.copytree(templates["hub_deepseek"], directory)
    _patch(directory)
    jobs = [(2, {"name": WORLD4, "model": str(directory),
                 "reference": str(materialize_unpatched(directory, base / "hub_deepseek-unpatched")),
                 "phases": ["no-policy", "codegen"],
                 "options": {"generate": 16, "grad_check": True, "tp_grain_size": 16}})]
    runs = [(_run_id(f, tp, o), f, tp, o) for f, tp, o in (*((f, tp, {}) for f, tp in HYBRID_RUNS),
                                                           *SINGLE_MIXER_RUNS,
                                                           *((f, 4, {}) for f in EXPERT_SETS_RUNS))]
    for name, family, tp, overrides in runs:
        if family not in installed_families():
            continue
        overrides = {"num_key_value_heads": 4, **overrides}
        pristine = build_example(family, base / f"{name}-pristine", overrides=overrides)
        patched = _patch(build_example(family, base / name, overrides=overrides))
        jobs.append((tp, {"name": name, "model": str(patched), "reference": str(pristine), "phases": ["codegen"],
                          "options": decode}))
    return jobs


def _run_id(family: str, tp: int, overrides: dict) -> str:
    return f"{family}-tp{tp}{'-latent' if overrides else ''}"


WORLD4 = "hub_deepseek-tp2"


@pytest.fixture(scope="module")
def four_rank_runs(_tiny_templates, tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """{run id: {phase: [rank 0 figures, ..., rank 3]}}: every run of 4 ranks, in one launch per tp size (the
    start, the imports and DeepSpeed's set-up paid once per launch, not per run)."""
    from codegen.harness.launcher import launch

    by_tp: dict[int, list[dict]] = {}
    for tp, job in _four_rank_jobs(_tiny_templates, tmp_path_factory):
        by_tp.setdefault(tp, []).append(job)
    runs = {}
    for tp, jobs in by_tp.items():
        ranks = launch({"tp": tp, "options": {}, "jobs": jobs}, 4, timeout=900, what=f"4 ranks, tp {tp}")
        for job in jobs:
            runs[job["name"]] = {phase: [r["jobs"][job["name"]][phase] for r in ranks] for phase in job["phases"]}
    return runs


@pytest.fixture
def four_ranks(four_rank_runs):
    return four_rank_runs[WORLD4]


def test_world4_tp2_results_match_one_process(four_ranks):
    ranks = four_ranks["codegen"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert (r["world_size"], r["tp_group_size"]) == (4, 2)
        assert r["maxdiff"] <= TOL
        assert r["same_tokens"] is True


def test_world4_every_reduction_stays_in_its_tp_group(four_ranks):
    for r in four_ranks["codegen"]:
        own = [0, 1] if r["rank"] < 2 else [2, 3]
        assert r["tp_group_ranks"] == [own]  # DeepSpeed's layers and the MoE reducer: one group, never WORLD
        assert r["grad_check"]["group_ranks"] == own


def test_world4_counts(four_ranks):
    for r in four_ranks["codegen"]:
        assert (r["attention_blocks"], r["moe_blocks"], r["dense_mlp_blocks"]) == (2, 1, 1)
        assert r["allreduce_per_moe_block"] == [1]
        assert r["allreduce_per_attention_block"] == [1, 1]
        assert r["allreduce_per_dense_mlp_block"] == [1]
        assert r["allreduce_lm_head"] == 1
        assert r["allreduce_per_forward"] == 5
        # several groups per node: the shm fast path is off, the reductions go through torch.distributed
        assert r["allreduce_entries"] == {"c10d::allreduce_": 5}


def test_world4_every_rank_holds_half_of_every_sharded_layer(four_ranks):
    ranks = four_ranks["codegen"]
    for r in ranks:
        assert r["bytes"]["experts"] * 2 == r["full_bytes"]["experts"] > 0
        assert r["sharded_bytes"] * 2 == r["sharded_full_bytes"] > 0
        assert r["sharded_unregistered"] == [] and r["sharded_unknown"] == []
        assert r["oversized_storage_params"] == []
        assert r["full_size_copies_alive"] == 0
        assert r["gates_intact"] is True and r["gate_types"] == r["gate_types_reference"]
    # the two groups hold the same shards
    assert ranks[0]["sharded_shapes"] == ranks[2]["sharded_shapes"]
    assert ranks[1]["sharded_shapes"] == ranks[3]["sharded_shapes"]


def test_world4_backward_and_no_policy(four_ranks):
    for r in four_ranks["codegen"]:
        grad = r["grad_check"]
        assert grad["applicable"] and grad["forward_is_sum"] and grad["no_grad_is_sum"]
        assert grad["grad_identity"] is True
        assert grad["autograd_node"] == "_AllReduceSumBackward"
    for r in four_ranks["no-policy"]:
        assert r["maxdiff"] == 0.0 and r["same_tokens"] is True
        assert r["allreduce_per_forward"] == 0


# ------------------------------------------------------------------ hybrid linear attention on 4 ranks

def _hybrid_runs() -> list[tuple[str, int]]:
    """(family, tp) per launch of 4 ranks: tp 4 and two groups of tp 2, both projection layouts where the installed
    transformers has both (Qwen3.5-MoE from 5.2)."""
    from codegen.harness.examples import installed_families

    return [("qwen3_5_moe_text" if "qwen3_5_moe_text" in installed_families() else "qwen3_next", 4),
            ("qwen3_next", 2)]


#: the hybrids' tiny examples with 4 kv heads, so tp 4 divides every head count (linear attention: 4 key heads,
#: 8 value heads)
HYBRID_RUNS = _hybrid_runs()


@pytest.fixture(params=HYBRID_RUNS, ids=[_run_id(f, tp, {}) for f, tp in HYBRID_RUNS])
def hybrid_four_ranks(request, four_rank_runs):
    family, tp = request.param
    return tp, four_rank_runs[_run_id(family, tp, {})]["codegen"]


def test_hybrid_on_four_ranks_matches_one_process_through_8_decode_steps(hybrid_four_ranks):
    """Logits of the prefill and of 8 decode steps with the cache (conv and recurrent states per rank and per local
    head) within 1e-5 of one process; greedy tokens identical; one all-reduce per attention layer of either kind,
    per MoE layer and for the LM head; each rank 1/tp of the routed experts and of every sharded layer."""
    tp, ranks = hybrid_four_ranks
    for r in ranks:
        assert (r["world_size"], r["tp_group_size"]) == (4, tp)
        assert r["maxdiff"] <= TOL and r["decode_checked"] == 8 and r["decode_maxdiff"] <= TOL
        assert r["same_tokens"] is True
        assert r["allreduce_per_attention_block"] == [1, 1] and r["allreduce_per_moe_block"] == [1, 1]
        assert r["allreduce_lm_head"] == 1 and r["allreduce_per_forward"] == 5
        assert r["bytes"]["experts"] * tp == r["full_bytes"]["experts"] > 0
        assert r["sharded_bytes"] * tp == r["sharded_full_bytes"] > 0
        assert any(".linear_attn.in_proj" in name for name in r["sharded_shapes"])
        assert r["sharded_unregistered"] == [] and r["full_size_copies_alive"] == 0
        assert r["gates_intact"] is True
        own = [r["rank"] // tp * tp + k for k in range(tp)]
        assert r["tp_group_ranks"] == [own]


# ------------------------------------------------------------- single-mixer blocks (a mixer kept whole) on 4 ranks

def _single_mixer_runs() -> list[tuple[str, int, dict]]:
    """(family, tp, overrides) per launch of 4 ranks, for the families whose blocks are one mixer each (Nemotron-H):
    tp 4, and two groups of tp 2 with the experts behind latent projections that carry a bias (and biased MLPs)."""
    from codegen.families import FAMILIES as TABLE
    from codegen.harness.examples import installed_families

    families = [f for f in installed_families() if TABLE[f].single_mixer_blocks]
    return [run for f in families for run in ((f, 4, {}), (f, 2, {"moe_latent_size": 32, "mlp_bias": True}))]


SINGLE_MIXER_RUNS = _single_mixer_runs()


@pytest.fixture(params=SINGLE_MIXER_RUNS, ids=[_run_id(f, tp, o) for f, tp, o in SINGLE_MIXER_RUNS])
def single_mixer_four_ranks(request, four_rank_runs):
    family, tp, overrides = request.param
    return family, tp, four_rank_runs[_run_id(family, tp, overrides)]["codegen"]


def test_single_mixer_blocks_on_four_ranks_match_one_process_through_8_decode_steps(single_mixer_four_ranks):
    """Logits of the prefill and of 8 decode steps with the cache (the whole mixer's conv and SSM states whole on
    every rank, attention's KV cache per local head) within 1e-5 of one process; greedy tokens identical; one
    all-reduce per split block (attention, MoE, dense MLP), none for the mixer kept whole, one for the LM head;
    each rank 1/tp of the routed experts; routers and latent projections whole."""
    from codegen.families import EXAMPLES

    family, tp, ranks = single_mixer_four_ranks
    whole = EXAMPLES[family].whole_mixers
    for r in ranks:
        assert (r["world_size"], r["tp_group_size"]) == (4, tp)
        assert r["maxdiff"] <= TOL and r["decode_checked"] == 8 and r["decode_maxdiff"] <= TOL
        assert r["same_tokens"] is True
        reductions = r["attention_block_reductions"]
        assert reductions.count(0) == whole and r["allreduce_per_attention_block"] == reductions
        assert r["allreduce_per_moe_block"] == [1] * r["moe_blocks"]
        assert r["allreduce_per_dense_mlp_block"] == [1] * r["dense_mlp_blocks"]
        assert r["allreduce_lm_head"] == 1
        assert r["allreduce_per_forward"] == sum(reductions) + r["moe_blocks"] + r["dense_mlp_blocks"] + 1
        assert r["bytes"]["experts"] * tp == r["full_bytes"]["experts"] > 0
        assert r["sharded_unregistered"] == [] and r["full_size_copies_alive"] == 0
        assert r["gates_intact"] is True
        assert not any("latent_proj" in name for name in r["sharded_shapes"])


# -------------------------------------------------------- several expert sets per MoE block on 4 ranks, tp 4

#: a family whose MoE block holds several routed expert sets (`Family.expert_sets`), if the installed transformers
#: ships one (ERNIE-4.5-VL from 5.0): its tiny example with 4 kv heads, so tp 4 divides every head count
EXPERT_SETS_RUNS = [name for name, family in TABLE.items() if family.expert_sets][:1]


@pytest.fixture(params=EXPERT_SETS_RUNS)
def expert_sets_four_ranks(request, four_rank_runs):
    from codegen.harness.examples import installed_families

    family = request.param
    if family not in installed_families():
        pytest.skip(f"{family} is not in the installed transformers")
    return four_rank_runs[_run_id(family, 4, {})]["codegen"]


def test_several_expert_sets_on_four_ranks_match_one_process_with_an_image(expert_sets_four_ranks):
    """Every expert set 1/4 per rank, its router whole; one all-reduce per MoE layer covering them all, with the
    shared expert; logits of the prefill, 8 cached decode steps and a prompt holding an image (whose tokens run the
    vision set) within 1e-5 of one process; greedy tokens identical."""
    for r in expert_sets_four_ranks:
        assert (r["world_size"], r["tp_group_size"]) == (4, 4)
        assert r["maxdiff"] <= TOL and r["decode_checked"] == 8 and r["decode_maxdiff"] <= TOL
        assert r["same_tokens"] is True and r["gates_intact"] is True
        assert r["allreduce_per_moe_block"] == [1] and r["allreduce_lm_head"] == 1
        assert r["bytes"]["experts"] * 4 == r["full_bytes"]["experts"] > 0
        assert r["sharded_unregistered"] == [] and r["full_size_copies_alive"] == 0
        image = r["image"]
        assert image["allreduce_per_moe_block"] == [1] and image["maxdiff"] <= TOL
        assert image["allreduce_per_forward"] == r["allreduce_per_forward"]


# ----------------------------------------------------------------------------------- the launcher's failures


@pytest.mark.once
def test_a_failing_rank_is_one_line_and_stops_the_others(tmp_path):
    from codegen.errors import VerifyFailed
    from codegen.harness.launcher import launch

    missing = str(tmp_path / "missing")
    spec = {"tp": 2, "jobs": [{"name": "x", "model": missing, "reference": missing, "phases": ["codegen"]}]}
    with pytest.raises(VerifyFailed) as failed:
        launch(spec, 2, 300, what="verify")
    message = failed.value.message
    assert "\n" not in message and message.startswith("verify: rank ") and "FileNotFoundError" in message


# ------------------------------------------------------------------------------------- errors, 1 process


def _one_line_policy_error(policy, model, tp_size) -> str:
    import torch.distributed

    with pytest.raises(policy.PolicyError) as info:
        policy.init_inference(model, tp_size=tp_size)
    message = str(info.value)
    assert "\n" not in message and message
    assert not torch.distributed.is_initialized()  # raised before any distributed call
    return message


def test_tp_size_not_dividing_the_heads(make_dir):
    import torch

    from codegen.models import load

    directory = _patch(make_dir("qwen2_moe"))
    model = load(str(directory), True, torch.float32)
    message = _one_line_policy_error(_policy(directory), model, 3)
    assert message == "tp_size 3 does not divide num_attention_heads = 4: pick a tp_size that divides it"


def test_tp_size_not_dividing_the_linear_attention_heads(tmp_path):
    """The head counts of both attention kinds are checked (value heads are a multiple of key heads, so the key
    heads decide): 3 key heads at tp 2 is one line, before any distributed call."""
    import torch

    from codegen.harness.examples import build_example
    from codegen.models import load

    heads = {"linear_num_key_heads": 3, "linear_num_value_heads": 6}
    directory = _patch(build_example("qwen3_next", tmp_path / "qwen3_next", overrides=heads))
    model = load(str(directory), True, torch.float32)
    message = _one_line_policy_error(_policy(directory), model, 2)
    assert message == "tp_size 2 does not divide linear_num_key_heads = 3: pick a tp_size that divides it"


def test_tp_size_not_dividing_the_expert_intermediate_size(make_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = _patch(make_dir("deepseek_v2"))
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    config.moe_intermediate_size = 33  # a checkpoint whose experts do not split in 2
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules")  # the patched class
    message = _one_line_policy_error(_policy(directory), model, 2)
    assert message == "tp_size 2 does not divide moe_intermediate_size = 33: pick a tp_size that divides it"


def test_policy_on_an_unpatched_model(make_dir):
    import torch

    from codegen.models import load

    unpatched = make_dir("qwen2_moe", "unpatched")
    patched = _patch(make_dir("qwen2_moe", "patched"))
    model = load(str(unpatched), False, torch.float32)
    message = _one_line_policy_error(_policy(patched), model, 2)
    assert message == ("Qwen2MoeForCausalLM (transformers.models.qwen2_moe.modeling_qwen2_moe) is not a class of a "
                       "codegen-patched dir: load the patched dir with from_pretrained(DIR, trust_remote_code=True)")


def test_policy_of_another_family(make_dir):
    import torch

    from codegen.models import load

    qwen = _patch(make_dir("qwen2_moe"))
    deepseek = _patch(make_dir("deepseek_v2"))
    model = load(str(deepseek), True, torch.float32)
    message = _one_line_policy_error(_policy(qwen), model, 2)
    assert message == "model was patched for 'deepseek_v2', this policy is for 'qwen2_moe': re-run patch"


def test_deepspeed_missing(make_dir, monkeypatch):
    import torch

    from codegen.models import load

    directory = _patch(make_dir("qwen2_moe"))
    model = load(str(directory), True, torch.float32)
    policy = _policy(directory)
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    message = _one_line_policy_error(policy, model, 2)
    assert message == "DeepSpeed is not installed: pip install deepspeed"


# ------------------------------------------------------------------------------------------ static checks


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2", "hub_deepseek"])
def test_policy_is_self_contained_and_names_its_group(make_dir, kind):
    source = (_patch(make_dir(kind)) / "autotp_policy.py").read_text()
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) <= {"torch", "deepspeed", "transformers"}
    assert "codegen" not in imported
    reductions = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and node.func.attr in ("all_reduce", "inference_all_reduce")]
    # a compiled rank's op calls DeepSpeed's shared-memory kernel itself (torch.ops.deepspeed): it replaces only that
    # kernel's own calls in a captured graph, which the policy keeps only where one group spans the node
    kernel = [call for call in reductions if ast.unparse(call.func) == "torch.ops.deepspeed.inference_all_reduce"]
    assert len(kernel) == 1
    reductions = [call for call in reductions if call not in kernel]
    # autograd-aware (grad enabled), DeepSpeed's inference path (no grad), and generate's lockstep checks on it
    assert len(reductions) == 3
    for call in reductions:
        assert any(k.arg == "group" for k in call.keywords), ast.unparse(call)  # never WORLD by default
