"""Quantized forms a patched dir cannot load with the installed transformers: one line naming the way out."""

from __future__ import annotations

import pytest

from codegen.errors import BAD_INPUT, BadInput
from codegen.families import FAMILIES
from codegen.patch.quantization import quant_method, refuse_unsupported_quantization

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

FORMS = [(f, form) for f in FAMILIES.values() for form in f.quantized_forms]


def test_the_table_names_gpt_oss_mxfp4_experts():
    assert FORMS, "no family lists a quantized form (gpt_oss ships MXFP4 experts)"


@pytest.mark.parametrize("family, form", FORMS, ids=[f"{f.model_type}-{q.quant_method}" for f, q in FORMS])
def test_form_is_refused_below_its_release_in_one_line_and_accepted_from_it(family, form):
    config = {"model_type": family.model_type, "quantization_config": {"quant_method": form.quant_method.upper()}}
    for older in ("4.57.6", None, "not-a-version"):
        with pytest.raises(BadInput) as info:
            refuse_unsupported_quantization(config, family, older, "dir/config.json")
        message = info.value.message
        assert "\n" not in message and info.value.exit_code == BAD_INPUT
        assert message.startswith("dir/config.json: ") and form.min_transformers in message
        assert message.endswith(form.dequantize_hint)
    refuse_unsupported_quantization(config, family, form.min_transformers, "dir/config.json")
    refuse_unsupported_quantization({"model_type": family.model_type}, family, "4.57.6", "dir/config.json")


def test_other_or_malformed_quantization_configs_are_left_to_the_loader():
    family, _ = FORMS[0]
    for config in ({}, {"quantization_config": None}, {"quantization_config": {"quant_method": 4}},
                   {"quantization_config": {"quant_method": "bitsandbytes"}}, {"quantization_config": "mxfp4"}):
        refuse_unsupported_quantization(config, family, "4.57.6", "c.json")
    assert quant_method({"text_config": {"quantization_config": {"quant_method": " MXFP4 "}}}) == "mxfp4"
