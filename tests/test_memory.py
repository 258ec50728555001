"""codegen.harness.memory: meta-device sizes equal a real load's; the plan's arithmetic; the fit rule. Also the examples'
shapes (codegen.harness.examples): every row divides by the TP sizes the bench runs, and a bfloat16 build is the float32
build rounded, loading back with nothing missing or unexpected."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from codegen.harness.examples import DTYPES, build_example, families_with, shape
from codegen.families import EXAMPLES, FAMILIES
from codegen.harness.memory import (
    GIB,
    SAFETY_BYTES,
    available_bytes,
    describe,
    fits,
    is_expert_param,
    parameter_bytes,
    plan,
    required_bytes,
)

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

TINY = families_with("tiny")


def _loaded_bytes(directory, dtype: str) -> dict:
    """The same split, measured on the model as transformers loads it for real."""
    from codegen.models import auto_class, dtype_keyword

    model = auto_class(directory).from_pretrained(directory, **{dtype_keyword(): getattr(torch, dtype)})
    experts = rest = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if is_expert_param(name):
            experts += size
        else:
            rest += size
    return {"experts": experts, "rest": rest, "total": experts + rest}


@pytest.mark.parametrize("family", TINY)
def test_parameter_bytes_equal_a_real_load(family, tmp_path):
    directory = build_example(family, tmp_path / family)
    for dtype in ("float32", "bfloat16"):
        measured = parameter_bytes(directory, dtype)
        loaded = _loaded_bytes(directory, dtype)
        assert {k: measured[k] for k in loaded} == loaded, dtype
        assert measured["experts"] > 0 and measured["rest"] > 0
    # float32_total is every Parameter at 4 bytes, whatever the run dtype
    assert parameter_bytes(directory, "bfloat16")["float32_total"] == _loaded_bytes(directory, "float32")["total"]


def test_parameter_bytes_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="int8"):
        parameter_bytes(tmp_path, "int8")


def test_expert_rule_counts_row_parallel_biases_as_rest():
    fused = FAMILIES["gpt_oss"].fused
    experts = FAMILIES["gpt_oss"].experts_attr
    assert is_expert_param(f"model.layers.0.mlp.{experts}.{fused.gate_up}")
    assert is_expert_param(f"model.layers.0.mlp.{experts}.{fused.gate_up_bias}")
    assert not is_expert_param(f"model.layers.0.mlp.{experts}.{fused.down_bias}")
    per_expert = FAMILIES["qwen2_moe"].per_expert
    assert is_expert_param(f"model.layers.0.mlp.{experts}.3.{per_expert.down}.weight")
    shared = FAMILIES["qwen2_moe"].shared_experts[0]
    assert not is_expert_param(f"model.layers.0.mlp.{shared}.{per_expert.down}.weight")


PARTS = {"experts": 800, "rest": 100, "total": 900, "float32_total": 1800}


def test_plan_per_setup_and_totals():
    got = plan(PARTS, 2, ["stock", "codegen", "native"], experts_replicated_stock=True)
    assert got["per_setup_per_rank"] == {"stock": 900, "codegen": 500, "native": 900}
    assert got["resident_total"] == 2 * (900 + 500 + 900)  # 4600
    assert got["reference_total"] == 3600
    # loads in order codegen (900 whole + 500 shards), native (500 held + 900), stock (1400 held + 900)
    assert got["loading_total"] == 2 * max(900 + 500, 500 + 900, 1400 + 900)  # 4600
    assert got["peak_total"] == 4600


def test_plan_stock_shards_experts_on_transformers_4():
    got = plan(PARTS, 4, ["stock", "codegen"], experts_replicated_stock=False)
    assert got["per_setup_per_rank"] == {"stock": 300, "codegen": 300}
    assert got["resident_total"] == 2400
    # the float32 reference on every rank outweighs two sharded setups plus a loading copy
    assert got["reference_total"] == 7200 and got["loading_total"] == 4 * max(900 + 300, 300 + 900)
    assert got["peak_total"] == 7200


def test_plan_adds_the_loaders_transient_to_each_load():
    """A converted checkpoint's load holds its largest stacked Parameter twice for a while (measured: 1.8 GiB above
    the Parameters at full widths; the kernel killed the ranks of a run planned without it)."""
    got = plan({**PARTS, "loader_transient": 70, "loader_transient_float32": 140}, 2, ["stock", "codegen"], True)
    assert got["reference_total"] == 2 * (1800 + 140)
    assert got["loading_total"] == 2 * max(900 + 70 + 500, 500 + 900 + 70)


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss"))
def test_loader_transient_is_the_largest_expert_parameter_of_a_converted_load(family, tmp_path):
    directory = build_example(family, tmp_path / family)
    parts = parameter_bytes(directory, "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    largest = max(p.numel() * 4 for n, p in model.named_parameters() if is_expert_param(n))
    converted = int(transformers.__version__.split(".")[0]) >= 5 and family != "gpt_oss"  # gpt-oss is stored fused
    assert parts["loader_transient"] == parts["loader_transient_float32"] == (largest if converted else 0)


def test_plan_rounds_shards_up_and_refuses_bad_input():
    assert plan({**PARTS, "experts": 801}, 2, ["codegen"], True)["per_setup_per_rank"]["codegen"] == 401 + 100
    with pytest.raises(ValueError, match="tp must be"):
        plan(PARTS, 0, ["codegen"], True)
    with pytest.raises(ValueError, match="unknown setup"):
        plan(PARTS, 2, ["codegen", "vllm"], True)


def test_fits_keeps_ten_percent_and_a_gib():
    run = {"peak_total": 10 * (1 << 30), "per_setup_per_rank": {"codegen": 1}, "tp": 2}
    need = required_bytes(run)
    assert need == 11 * (1 << 30) + SAFETY_BYTES
    assert fits(run, need) and not fits(run, need - 1)
    assert "needs 12.0 GiB" in describe(run, 19 * (1 << 30)) and "19.0 GiB available" in describe(run, 19 * (1 << 30))


def test_available_bytes_is_a_plausible_amount():
    got = available_bytes()
    assert 64 * (1 << 20) < got <= 1 << 50
    assert got / GIB > 0.0625


@pytest.mark.parametrize("size", ("bench", "full"))
def test_every_row_divides_by_the_bench_tp_sizes(size):
    """Every row divides by tp 2 and 4, but for a full-width row a size its published checkpoint sets and 4 does not
    divide (Qwen3.5-35B-A3B's 2 kv heads): that row runs at tp 2 only, as the checkpoint does under AutoTP."""
    import json

    from codegen.harness.examples import PUBLISHED

    for family in families_with(size):
        values = shape(family, size)
        published = json.loads((PUBLISHED / EXAMPLES[family].published).read_text()) if size == "full" else {}
        published = published.get("text_config", published)
        for tp in (2, 4):
            for key in FAMILIES[family].tp_divisible_keys:
                if key in values and not (tp == 4 and published.get(key) == values[key] == 2):
                    assert values[key] % tp == 0, (size, family, key, tp)
        assert all(values[key] % 2 == 0 for key in FAMILIES[family].tp_divisible_keys if key in values), family


def test_full_rows_are_two_layers_and_small_vocab():
    for family in families_with("full"):
        values = shape(family, "full")
        assert values["num_hidden_layers"] == 2 and values["vocab_size"] == 4096, family
        assert values["tie_word_embeddings"] is False
    assert set(families_with("bench")) >= {"qwen3_moe", "gpt_oss"}
    assert set(families_with("full")) == set(families_with("bench"))


def test_full_rows_are_the_published_widths():
    """A full-width example is the project's copy of a real checkpoint's config, cut to two layers."""
    import json

    from codegen.harness.examples import PUBLISHED

    for family in families_with("full"):
        published = json.loads((PUBLISHED / EXAMPLES[family].published).read_text())
        values = shape(family, "full")
        widths = ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        for key in widths:
            if key in values:
                assert values[key] == published[key], (family, key)
        for key in FAMILIES[family].num_experts_keys + FAMILIES[family].top_k_keys:
            if key in values:
                assert values[key] == published[key], (family, key)


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss"))
def test_bf16_build_is_the_float32_build_rounded(family, tmp_path):
    base = build_example(family, tmp_path / "f32")
    half = build_example(family, tmp_path / "bf16", dtype="bfloat16")
    a, b = _tensors(base), _tensors(half)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)) for k in a)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(half, output_loading_info=True)
    assert (len(info["missing_keys"]), len(info["unexpected_keys"])) == (0, 0)
    config = json.loads((half / "config.json").read_text())
    tiny = shape(family, "tiny")
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers")} == {k: tiny[k] for k in ("hidden_size",
                                                                                              "num_hidden_layers")}


def test_build_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match=", ".join(DTYPES)):
        build_example("qwen2_moe", tmp_path / "x", dtype="int8")


def _tensors(directory) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out
