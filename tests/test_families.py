"""The family table reads as data: rows state what differs from the defaults, the rest is derived, the test and
bench data sit beside the rows by model type, and the table imports nothing of codegen but the policy runtime's names.
"""

from __future__ import annotations

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from codegen.families import ANCHOR_ROUTED_FINAL, ANCHOR_SHARED_SUM, COMMON_SIZES, EXAMPLES, FAMILIES, \
    HEADS_AND_WIDTHS, STOCK_AUTOTP, UNSUPPORTED, UNSUPPORTED_STOCK, Family, Wrapper

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

PACKAGE = Path(__file__).resolve().parent.parent / "codegen" / "families"


def test_the_table_imports_only_itself_and_the_policy_runtime_names():
    """Downward only: the table names the fused layouts the policy runtime shards (codegen.policy.runtime.base)."""
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("codegen"):
                assert node.module.startswith("codegen.families.") or node.module == "codegen.policy.runtime.base", \
                    f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("codegen") for a in node.names), path.name


def test_every_family_has_its_examples_and_stock_figures_beside_the_table():
    """The support table renders the stock figures and the codegen figures on the tiny example of every family."""
    assert list(EXAMPLES) == list(FAMILIES) == list(STOCK_AUTOTP)
    assert all(e.tiny for e in EXAMPLES.values())


def test_what_stock_autotp_does_is_recorded_only_for_the_types_patch_refuses():
    """A type that becomes a row takes its stock figure into STOCK_AUTOTP (its measured StockAutoTP) instead."""
    assert set(UNSUPPORTED_STOCK) <= set(UNSUPPORTED), sorted(set(UNSUPPORTED_STOCK) - set(UNSUPPORTED))


def test_a_plain_row_is_a_handful_of_names_and_the_rest_is_derived():
    row = Family(model_type="new_moe", config_class="NewMoeConfig", moe_classes=("NewMoeSparseMoeBlock",),
                 num_experts_keys=("num_experts",), more_positive_ints=("head_dim",))
    assert row.builtin_module == "transformers.models.new_moe.modeling_new_moe"
    assert row.auto_classes == {"AutoModelForCausalLM": "NewMoeForCausalLM", "AutoModel": "NewMoeModel"}
    assert list(row.auto_classes) == ["AutoModelForCausalLM", "AutoModel"]  # the first is what examples load with
    assert row.anchor == ANCHOR_ROUTED_FINAL and row.routers == ("gate",) and row.experts_attr == "experts"
    assert row.positive_int_keys == (*COMMON_SIZES, "num_experts", "head_dim")
    assert row.tp_divisible_keys == HEADS_AND_WIDTHS
    shared = Family(model_type="new_moe", config_class="NewMoeConfig", moe_classes=("NewMoeSparseMoeBlock",),
                    num_experts_keys=("n_routed_experts",), top_k_keys=("moe_k",), shared_experts=("shared_experts",),
                    wrapper=Wrapper(replicated=("visual",)))
    assert shared.anchor == ANCHOR_SHARED_SUM
    assert shared.positive_int_keys == (*COMMON_SIZES, "n_routed_experts", "moe_k")
    assert shared.auto_classes == {"AutoModelForImageTextToText": "NewMoeForConditionalGeneration",
                                   "AutoModel": "NewMoeModel"}
    # what a row gives is kept
    given = Family(model_type="new_moe", builtin_module="x.y", config_class="NewMoeConfig", moe_classes=("B",),
                   num_experts_keys=("e",), positive_int_keys=("e",), auto_classes={"AutoModel": "M"})
    assert (given.builtin_module, given.positive_int_keys, given.auto_classes) == ("x.y", ("e",), {"AutoModel": "M"})


def test_no_row_spells_a_default():
    """A row names only what differs (a literal equal to the field's default is noise a reader must check)."""
    defaults = {f.name: f.default for f in fields(Family) if f.default is not MISSING}
    spelled = []
    for node in ast.walk(ast.parse((PACKAGE / "table.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Family":
            for kw in node.keywords:
                if kw.arg in defaults:
                    try:
                        value = ast.literal_eval(kw.value)
                    except ValueError:
                        continue
                    if value == defaults[kw.arg]:
                        spelled.append(f"line {kw.lineno}: {kw.arg}={value!r}")
    assert not spelled, spelled


def test_the_families_this_environment_covers_are_those_its_transformers_ships():
    """tests/conftest.py's FAMILIES are the table's families whose first release (and their text decoder's) is at
    most the installed transformers: the rest are covered in the environments that have them."""
    from importlib.metadata import version

    from packaging.version import Version

    from codegen.harness.examples import installed_families

    installed = Version(version("transformers"))
    shipped = [name for name, row in FAMILIES.items()
               if all(Version(f.first_release) <= installed for f in (row, row.text_family))]
    assert list(installed_families()) == shipped


def test_moe_layers_by_a_per_layer_list_or_a_pattern_string_without_a_layer_count():
    """A per-layer list or a one-character-per-layer pattern (the marks a row names) picks the MoE layers; where the
    config holds no layer count (5.x Nemotron-H: `num_hidden_layers` is a property), the list's length counts."""
    from codegen.families import Family, MoELayers
    from codegen.patch.config import moe_layers

    row = Family(model_type="toy_hybrid", config_class="ToyHybridConfig", moe_classes=("ToyMoE",),
                 num_experts_keys=("n_experts",),
                 layers=MoELayers(types="block_kinds", pattern="block_pattern", sparse_marks=("moe", "E")))
    assert moe_layers({"block_kinds": ["mamba", "moe", "attention", "mlp", "moe"]}, row) == [1, 4]
    assert moe_layers({"block_pattern": "ME*-E", "num_hidden_layers": 5}, row) == [1, 4]
    assert moe_layers({"block_pattern": "ME*-E", "num_hidden_layers": 3}, row) == [1]
    assert row.layers.keys() == ("num_hidden_layers", "block_kinds", "block_pattern")


def test_several_expert_sets_are_a_row_of_data():
    """`expert_sets`: dotted paths to each routed expert set; the anchors follow the block's children holding them,
    the policy gets the paths only where a row names some (the other policies stay byte-identical)."""
    row = Family(model_type="new_moe", config_class="NewMoeConfig", moe_classes=("NewMoeBlock",),
                 num_experts_keys=("num_experts",), shared_experts=("shared_experts",),
                 expert_sets=("text_moe.experts", "vision_moe.experts"), routers=("text_moe.gate", "vision_moe.gate"),
                 per_set_sizes=("moe_intermediate_size",))
    assert row.expert_paths() == row.expert_paths(legacy=True) == ("text_moe.experts", "vision_moe.experts")
    assert row.expert_modules == ("text_moe", "vision_moe")
    layout = row.policy_layout()
    assert layout["expert_sets"] == ["text_moe.experts", "vision_moe.experts"]
    assert layout["routers"] == ["text_moe.gate", "vision_moe.gate"]
    plain = FAMILIES["ernie4_5_moe"]
    assert plain.expert_paths() == ("experts",) and "expert_sets" not in plain.policy_layout()


def test_a_size_given_per_expert_set_is_a_list_of_positive_ints(tmp_path):
    from codegen.errors import BadInput
    from codegen.patch.config import _validate_sizes, check_tp_divides

    family = FAMILIES["ernie4_5_vl_moe"]
    config = {"text_config": {**EXAMPLES["ernie4_5_vl_moe"].tiny}}
    _validate_sizes(config, family, tmp_path)
    check_tp_divides(config, family, 2, tmp_path)
    for bad in ([32, 0], [32], 32.0):
        with pytest.raises(BadInput, match="moe_intermediate_size must be a positive integer"):
            _validate_sizes({"text_config": {**config["text_config"], "moe_intermediate_size": bad}}, family, tmp_path)
    odd = {"text_config": {**config["text_config"], "moe_intermediate_size": [32, 7]}}
    with pytest.raises(BadInput, match=r"--tp 2 does not divide moe_intermediate_size = \[32, 7\]"):
        check_tp_divides(odd, family, 2, tmp_path)


def test_a_wrapper_run_through_a_text_submodule_reads_its_sizes_from_that_submodules_text_config():
    """Qwen3-Omni's config.json nests the decoder's sizes two levels down (`thinker_config.text_config`): `patch`,
    `verify` and `serve` check them there; the submodule is named by the row, as data."""
    from codegen.families import FAMILIES as TABLE
    from codegen.families import TEXT_CONFIG, sizes_of

    wrappers = [f for f in TABLE.values() if f.wrapper is not None and f.wrapper.text_submodule]
    assert wrappers and all(f.wrapper.submodule_config for f in wrappers)
    for family in wrappers:
        config = {"model_type": family.model_type,
                  family.wrapper.submodule_config: {TEXT_CONFIG: {"hidden_size": 64, "num_attention_heads": 4}}}
        assert sizes_of(config)["num_attention_heads"] == 4
        assert family.policy_layout()["text_submodule"] == family.wrapper.text_submodule
    # every other row's policy layout stays as it was: no key for a submodule it does not have
    assert all("text_submodule" not in f.policy_layout() for f in TABLE.values() if f not in wrappers)
