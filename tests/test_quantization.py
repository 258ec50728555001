"""Quantized checkpoints a family refuses: one line naming the workaround, read from the family table."""

from __future__ import annotations

import pytest

from codegen.errors import BAD_INPUT, BadInput
from codegen.families import FAMILIES
from codegen.quantization import quant_method, refuse_unsupported_quantization

def _refusing_families():
    return [f for f in FAMILIES.values() if f.refused_quantization]


def test_some_family_refuses_a_quantized_form():
    assert _refusing_families(), "the table lists no refused quantization (gpt_oss ships MXFP4 experts)"


@pytest.mark.parametrize("family", _refusing_families(), ids=lambda f: f.model_type)
def test_refused_quant_method_is_one_line_with_the_workaround(family):
    for method, workaround in family.refused_quantization.items():
        config = {"model_type": family.model_type, "quantization_config": {"quant_method": method.upper()}}
        with pytest.raises(BadInput) as info:
            refuse_unsupported_quantization(config, family, "dir/config.json")
        message = info.value.message
        assert "\n" not in message and info.value.exit_code == BAD_INPUT
        assert message.startswith("dir/config.json: ") and method in message and message.endswith(workaround)
        # the same checkpoint, dequantized (no quantization_config), is accepted
        refuse_unsupported_quantization({"model_type": family.model_type}, family, "dir/config.json")


def test_other_or_malformed_quantization_configs_are_not_refused_here():
    family = _refusing_families()[0]
    for config in ({}, {"quantization_config": None}, {"quantization_config": {"quant_method": 4}},
                   {"quantization_config": {"quant_method": "bitsandbytes"}}, {"quantization_config": "mxfp4"}):
        refuse_unsupported_quantization(config, family, "c.json")
    assert quant_method({"text_config": {"quantization_config": {"quant_method": " MXFP4 "}}}) == "mxfp4"
