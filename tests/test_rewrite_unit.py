"""Before/after pairs for each transformer of the rewrite: small, exact, and they document it."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from codegen.errors import BadSource
from codegen.families import FAMILIES
from codegen.rewrite import AbsolutizeImports, DeclareNativeLoading, RewriteTarget, rewrite_source

BLOCK = "_CODEGEN_PATCH = {'family': 'x'}\n\n\ndef _codegen_moe_all_reduce(block, hidden_states):\n    return hidden_states\n"


def _dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _target(family="qwen2_moe", shipped=frozenset()):
    return RewriteTarget(FAMILIES[family], f"transformers.models.{family}", shipped, "modeling_test.py", "test")


QWEN_BEFORE = _dedent(
    '''
    """Docstring stays."""
    import torch
    from ...activations import ACT2FN  # trailing comment stays
    from .configuration_qwen2_moe import Qwen2MoeConfig


    class Qwen2MoeSparseMoeBlock(torch.nn.Module):
        def forward(self, hidden_states):
            routed = self.experts(hidden_states)   # odd   spacing stays
            shared = self.shared_expert(hidden_states)
            shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared

            out = routed + shared
            out = out.reshape(-1)
            return out
    '''
)

QWEN_AFTER = _dedent(
    '''
    """Docstring stays."""
    import torch
    from transformers.activations import ACT2FN  # trailing comment stays
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig


    _CODEGEN_PATCH = {'family': 'x'}


    def _codegen_moe_all_reduce(block, hidden_states):
        return hidden_states


    class Qwen2MoeSparseMoeBlock(torch.nn.Module):
        def forward(self, hidden_states):
            routed = self.experts(hidden_states)   # odd   spacing stays
            shared = self.shared_expert(hidden_states)
            shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared

            out = routed + shared
            # codegen: one all-reduce per MoE layer covers routed + shared experts
            out = _codegen_moe_all_reduce(self, out)
            out = out.reshape(-1)
            return out
    '''
)


def test_reduction_goes_after_the_routed_plus_shared_sum_whatever_its_name():
    result = rewrite_source(QWEN_BEFORE, _target(), BLOCK)
    assert result.code == QWEN_AFTER
    assert result.reduced_variable == "out" and result.moe_class == "Qwen2MoeSparseMoeBlock"
    assert not result.fused_experts


def test_hub_style_conditional_shared_sum_is_reduced_after_the_if():
    before = _dedent(
        """
        from .configuration_deepseek import DeepseekV2Config


        class DeepseekV2MoE(nn.Module):
            def forward(self, hidden_states):
                identity = hidden_states
                if self.training:
                    y = self.train_path(hidden_states)
                else:
                    y = self.moe_infer(hidden_states)
                if self.config.n_shared_experts is not None:
                    y = y + self.shared_experts(identity)
                return y
        """
    )
    result = rewrite_source(before, _target("deepseek_v2", frozenset({"configuration_deepseek"})), BLOCK)
    assert "from .configuration_deepseek import DeepseekV2Config" in result.code  # shipped: stays relative
    assert result.code.endswith(
        "            y = y + self.shared_experts(identity)\n"
        "        # codegen: one all-reduce per MoE layer covers routed + shared experts\n"
        "        y = _codegen_moe_all_reduce(self, y)\n"
        "        return y\n"
    )


def test_every_relative_import_becomes_absolute_including_nested_ones():
    before = _dedent(
        """
        from ... import initialization as init
        from ...utils import logging
        from .configuration_x import XConfig
        from .helpers import h


        def f():
            from ...integrations.deepspeed import is_deepspeed_zero3_enabled
            if True:
                from ..llama.modeling_llama import LlamaMLP
        """
    )
    transformer = AbsolutizeImports("transformers.models.x", frozenset({"helpers"}))
    after = cst.parse_module(before).visit(transformer).code
    assert after == _dedent(
        """
        from transformers import initialization as init
        from transformers.utils import logging
        from transformers.models.x.configuration_x import XConfig
        from .helpers import h


        def f():
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
            if True:
                from transformers.models.llama.modeling_llama import LlamaMLP
        """
    )


def test_native_loading_override_is_added_to_the_pretrained_base_only():
    before = _dedent(
        """
        class Qwen2MoePreTrainedModel(PreTrainedModel):
            config: Qwen2MoeConfig
            base_model_prefix = "model"


        class Qwen2MoeModel(Qwen2MoePreTrainedModel):
            pass
        """
    )
    after = cst.parse_module(before).visit(DeclareNativeLoading("PreTrainedModel")).code
    assert after == _dedent(
        """
        class Qwen2MoePreTrainedModel(PreTrainedModel):
            config: Qwen2MoeConfig
            base_model_prefix = "model"

            @classmethod
            def is_custom_code(cls) -> bool:
                # codegen: transformers' own modeling code plus one guarded all-reduce; keep its checkpoint
                # conversion mapping (hub per-expert weights -> fused experts) as for the built-in class.
                return False


        class Qwen2MoeModel(Qwen2MoePreTrainedModel):
            pass
        """
    )


def test_fused_experts_source_gets_the_native_loading_override():
    before = QWEN_BEFORE + _dedent(
        """


        class Qwen2MoeExperts(nn.Module):
            def __init__(self, config):
                self.gate_up_proj = nn.Parameter(torch.empty(1, 2, 3))


        class Qwen2MoePreTrainedModel(PreTrainedModel):
            pass
        """
    )
    result = rewrite_source(before, _target(), BLOCK)
    assert result.fused_experts
    assert "def is_custom_code(cls) -> bool:" in result.code


@pytest.mark.parametrize(
    "forward, message",
    [
        ("        return self.experts(x)\n", "no recognisable expert weighted sum"),
        (
            "        if x is None:\n            return x\n        y = self.experts(x)\n"
            "        y = y + self.shared_expert(x)\n        return y\n",
            "returns at line",
        ),
        (
            "        a = self.experts(x) + self.shared_expert(x)\n        b = self.experts(x) + self.shared_expert(x)\n"
            "        return a + b\n",
            "several tensors",
        ),
    ],
    ids=["no-sum", "early-return", "two-sums"],
)
def test_unplaceable_reduction_is_a_precise_error(forward, message):
    source = "class Qwen2MoeSparseMoeBlock(nn.Module):\n    def forward(self, x):\n" + forward
    with pytest.raises(BadSource, match=message):
        rewrite_source(source, _target(), BLOCK)


def test_already_patched_source_is_refused():
    patched = rewrite_source(QWEN_BEFORE, _target(), BLOCK).code
    with pytest.raises(BadSource, match="already patched"):
        rewrite_source(patched, _target(), BLOCK)
