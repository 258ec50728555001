"""Before/after pairs for each transformer of the rewrite: small, exact, and they document it."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from codegen.errors import BadSource
from codegen.families import FAMILIES
from codegen.patch.rewrite import rewrite_source
from codegen.patch.target import RewriteTarget
from codegen.patch.transforms import AbsolutizeImports, DeclareNativeLoading

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

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
    before = QWEN_BEFORE.replace(
        "class Qwen2MoeSparseMoeBlock(torch.nn.Module):\n",
        "class Qwen2MoeSparseMoeBlock(torch.nn.Module):\n    def __init__(self, config):\n"
        "        self.experts = Qwen2MoeExperts(config)\n\n",
    ) + _dedent(
        """


        class Qwen2MoeExperts(nn.Module):
            def __init__(self, config):
                self.gate_up_proj = nn.Parameter(torch.empty(1, 2, 3))
                self.down_proj = nn.Parameter(torch.empty(1, 3, 1))


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


# ------------------------------------------------------------------ anchor kinds beyond the shared-expert sum


def _family_with(anchor: str, base: str = "qwen2_moe"):
    """A table row with another anchor kind (rows stay in codegen.families; only the anchor differs)."""
    import dataclasses

    return dataclasses.replace(FAMILIES[base], anchor=anchor)


def _anchor_target(family):
    return RewriteTarget(family, f"transformers.models.{family.model_type}", frozenset(), "modeling_test.py", "test")


ROUTED_FINAL_5X_BEFORE = _dedent(
    """
    class Qwen3MoeSparseMoeBlock(nn.Module):
        def forward(self, hidden_states):
            batch_size, sequence_length, hidden_dim = hidden_states.shape
            flat = hidden_states.view(-1, hidden_dim)
            _, weights, selected = self.gate(flat)
            out = self.experts(flat, selected, weights)
            return out.reshape(batch_size, sequence_length, hidden_dim)
    """
)


def test_routed_final_5x_reduces_right_after_the_fused_experts_call():
    result = rewrite_source(ROUTED_FINAL_5X_BEFORE, _target("qwen3_moe"), BLOCK)
    assert result.code.endswith(
        "        out = self.experts(flat, selected, weights)\n"
        "        # codegen: one all-reduce per MoE layer covers the routed experts\n"
        "        out = _codegen_moe_all_reduce(self, out)\n"
        "        return out.reshape(batch_size, sequence_length, hidden_dim)\n"
    )
    assert result.reduced_variable == "out" and result.moe_class == "Qwen3MoeSparseMoeBlock"


def test_routed_final_4x_reduces_after_the_per_expert_loop_before_the_reshape():
    before = _dedent(
        """
        class MixtralSparseMoeBlock(nn.Module):
            def forward(self, hidden_states):
                router_logits = self.gate(hidden_states)
                acc = torch.zeros_like(hidden_states)
                for expert_idx in range(self.num_experts):
                    expert_layer = self.experts[expert_idx]
                    idx, top_x = torch.where(mask[expert_idx])
                    acc.index_add_(0, top_x, expert_layer(hidden_states[top_x]))
                acc = acc.reshape(-1)
                return acc, router_logits
        """
    )
    result = rewrite_source(before, _target("mixtral"), BLOCK)
    assert result.code.endswith(
        "            acc.index_add_(0, top_x, expert_layer(hidden_states[top_x]))\n"
        "        # codegen: one all-reduce per MoE layer covers the routed experts\n"
        "        acc = _codegen_moe_all_reduce(self, acc)\n"
        "        acc = acc.reshape(-1)\n"
        "        return acc, router_logits\n"
    )
    assert result.reduced_variable == "acc"


def test_routed_final_follows_the_blocks_own_method_that_runs_its_experts():
    """4.x DeepSeek-V3-style blocks without a shared expert (LongCat-Flash on 4.57): the forward calls `self.moe(...)`,
    the block's method that loops over `self.experts`; its result is the routed output, reduced right after."""
    before = _dedent(
        """
        class Qwen3MoeSparseMoeBlock(nn.Module):
            def moe(self, hidden_states, topk_indices, topk_weights):
                final = torch.zeros_like(hidden_states)
                for expert_idx in range(len(self.experts)):
                    final.index_add_(0, idx, self.experts[expert_idx](hidden_states[idx]))
                return final

            def forward(self, hidden_states):
                orig_shape = hidden_states.shape
                topk_indices, topk_weights = self.gate(hidden_states)
                hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
                return hidden_states
        """
    )
    result = rewrite_source(before, _target("qwen3_moe"), BLOCK)
    assert result.code.endswith(
        "        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)\n"
        "        # codegen: one all-reduce per MoE layer covers the routed experts\n"
        "        hidden_states = _codegen_moe_all_reduce(self, hidden_states)\n"
        "        return hidden_states\n"
    )
    # a method that never touches the experts is not one
    unrelated = before.replace("self.experts[expert_idx]", "self.other[expert_idx]").replace("len(self.experts)", "4")
    with pytest.raises(BadSource, match="no recognisable routed experts output"):
        rewrite_source(unrelated, _target("qwen3_moe"), BLOCK)


@pytest.mark.parametrize(
    "forward, message",
    [
        ("        return self.experts(x)\n", "no recognisable routed experts output"),
        ("        y = self.experts(x)\n        z = self.experts(y)\n        return z\n", "2 times"),
        ("        if x is None:\n            return x\n        y = self.experts(x)\n        return y\n",
         "returns at line"),
    ],
    ids=["no-assignment", "two-outputs", "early-return"],
)
def test_unplaceable_routed_final_reduction_is_a_precise_error(forward, message):
    source = "class Qwen3MoeSparseMoeBlock(nn.Module):\n    def forward(self, x):\n" + forward
    with pytest.raises(BadSource, match=message):
        rewrite_source(source, _target("qwen3_moe"), BLOCK)


def test_returned_sum_is_reduced_inside_the_one_return():
    from codegen.families import ANCHOR_RETURNED_SUM

    before = _dedent(
        """
        class Qwen2MoeSparseMoeBlock(nn.Module):
            def forward(self, hidden_states):
                shared = self.shared_expert(hidden_states)
                routed = self.experts(hidden_states).reshape(2, 3)
                return routed + shared, None
        """
    )
    result = rewrite_source(before, _anchor_target(_family_with(ANCHOR_RETURNED_SUM)), BLOCK)
    assert result.code.endswith(
        "        routed = self.experts(hidden_states).reshape(2, 3)\n"
        "        # codegen: one all-reduce per MoE layer covers routed + shared experts\n"
        "        return _codegen_moe_all_reduce(self, routed + shared), None\n"
    )


@pytest.mark.parametrize(
    "forward, message",
    [
        ("        if x is None:\n            return x\n        return self.experts(x) + self.shared_expert(x)\n",
         "only `return`"),
        ("        y = self.experts(x) + self.shared_expert(x)\n        return y\n", "no recognisable returned"),
    ],
    ids=["two-returns", "sum-not-returned"],
)
def test_unplaceable_returned_sum_is_a_precise_error(forward, message):
    from codegen.families import ANCHOR_RETURNED_SUM

    source = "class Qwen2MoeSparseMoeBlock(nn.Module):\n    def forward(self, x):\n" + forward
    with pytest.raises(BadSource, match=message):
        rewrite_source(source, _anchor_target(_family_with(ANCHOR_RETURNED_SUM)), BLOCK)


def test_sum_in_both_branches_of_an_if_else_is_reduced_once_after_the_if():
    before = _dedent(
        """
        class Qwen2MoeSparseMoeBlock(nn.Module):
            def forward(self, x):
                if self.training:
                    out = self.experts(x) + self.shared_expert(x)
                else:
                    out = self.experts(x, fast=True) + self.shared_expert(x)
                return out
        """
    )
    result = rewrite_source(before, _target(), BLOCK)
    assert result.code.endswith(
        "            out = self.experts(x, fast=True) + self.shared_expert(x)\n"
        "        # codegen: one all-reduce per MoE layer covers routed + shared experts\n"
        "        out = _codegen_moe_all_reduce(self, out)\n"
        "        return out\n"
    )


def test_sum_bound_in_one_branch_only_is_refused_not_reduced_inside_it():
    source = _dedent(
        """
        class Qwen2MoeSparseMoeBlock(nn.Module):
            def forward(self, x):
                if self.shared_expert is not None:
                    out = self.experts(x) + self.shared_expert(x)
                else:
                    other = self.experts(x)
                return out
        """
    )
    with pytest.raises(BadSource, match="only some branches"):
        rewrite_source(source, _target(), BLOCK)


def test_fused_experts_are_recognised_by_the_whole_layout_of_the_family():
    """gpt_oss's layout names expert biases: gate_up/down Parameters alone are not its layout."""
    layout = FAMILIES["gpt_oss"].fused
    params = "\n".join(f"        self.{name} = nn.Parameter(torch.empty(1))" for name in layout.parameters)
    block = _dedent(
        """
        class GptOssMLP(nn.Module):
            def __init__(self, config):
                self.router = Router(config)
                self.experts = GptOssExperts(config)

            def forward(self, hidden_states):
                out = self.experts(hidden_states)
                return out, None


        class GptOssPreTrainedModel(PreTrainedModel):
            pass
        """
    )
    full = block + "\n\nclass GptOssExperts(nn.Module):\n    def __init__(self, config):\n" + params + "\n"
    assert rewrite_source(full, _target("gpt_oss"), BLOCK).fused_experts
    without_biases = "\n".join(line for line in full.splitlines() if "_bias" not in line) + "\n"
    assert not rewrite_source(without_biases, _target("gpt_oss"), BLOCK).fused_experts


def test_wrapped_return_passes_the_safety_check_and_other_edits_do_not():
    from codegen.families import ANCHOR_RETURNED_SUM
    from codegen.patch.safety import check_only_intended_changes

    target = _anchor_target(_family_with(ANCHOR_RETURNED_SUM))
    original = "def f(self, a, b):\n    return a + b\n"
    wrapped = "def f(self, a, b):\n    return _codegen_moe_all_reduce(self, a + b)\n"
    check_only_intended_changes(original, wrapped, target)
    with pytest.raises(BadSource, match="changed more than intended"):
        check_only_intended_changes(original, "def f(self, a, b):\n    return _codegen_moe_all_reduce(self, a - b)\n",
                                    target)


# ------------------------------------------------------------------ the in-place routed + shared sum (Llama 4)


def _family_without_wrapper(name: str):
    import dataclasses

    return dataclasses.replace(FAMILIES[name], wrapper=None)


#: Llama 4's row without its wrapper (a source holding the MoE block alone has no causal LM to give the text config)
_TEXT_LLAMA4 = _anchor_target(_family_without_wrapper("llama4"))


def test_inplace_shared_sum_is_reduced_right_after_the_add_():
    before = _dedent(
        """
        class Llama4TextMoe(nn.Module):
            def forward(self, hidden_states):
                router_scores, router_logits = self.router(hidden_states)
                routed_out = self.experts(hidden_states * router_scores)
                out = self.shared_expert(hidden_states)
                out.add_(routed_out.sum(dim=0))
                return out, router_logits
        """
    )
    result = rewrite_source(before, _TEXT_LLAMA4, BLOCK)
    assert result.code.endswith(
        "        out.add_(routed_out.sum(dim=0))\n"
        "        # codegen: one all-reduce per MoE layer covers routed + shared experts\n"
        "        out = _codegen_moe_all_reduce(self, out)\n"
        "        return out, router_logits\n"
    )
    assert result.reduced_variable == "out" and result.moe_class == "Llama4TextMoe"


def test_inplace_scatter_add_of_the_routed_output_is_an_inplace_sum_too():
    """transformers 4.51's Llama 4: `out.scatter_add_(dim=0, index=..., src=routed)`, keywords only."""
    before = _dedent(
        """
        class Llama4TextMoe(nn.Module):
            def forward(self, hidden_states):
                routed_out = self.experts(hidden_states)
                out = self.shared_expert(hidden_states)
                out.scatter_add_(dim=0, index=idx, src=routed_out.view(-1, 4))
                return out, None
        """
    )
    result = rewrite_source(before, _TEXT_LLAMA4, BLOCK)
    assert "        out.scatter_add_(dim=0, index=idx, src=routed_out.view(-1, 4))\n" \
           "        # codegen: one all-reduce per MoE layer covers routed + shared experts\n" \
           "        out = _codegen_moe_all_reduce(self, out)\n" in result.code


@pytest.mark.parametrize(
    "forward, message",
    [
        ("        out = self.shared_expert(x) + self.experts(x)\n        return out\n", "no recognisable in-place"),
        ("        out = self.shared_expert(x)\n        out.add_(self.shared_expert(x))\n        return out\n",
         "no recognisable in-place"),
        ("        out = self.shared_expert(x)\n        out.add_(self.experts(x))\n        out.add_(self.experts(x))\n"
         "        return out\n", "2 times"),
        ("        out = self.shared_expert(x)\n        if x is None:\n            return out\n"
         "        out.add_(self.experts(x))\n        return out\n", "returns at line"),
    ],
    ids=["not-in-place", "shared-on-both-sides", "two-sums", "early-return"],
)
def test_unplaceable_inplace_sum_is_a_precise_error(forward, message):
    source = "class Llama4TextMoe(nn.Module):\n    def forward(self, x):\n" + forward
    with pytest.raises(BadSource, match=message):
        rewrite_source(source, _target("llama4"), BLOCK)


WRAPPER_CAUSAL_LM = _dedent(
    """
    class Llama4TextMoe(nn.Module):
        def forward(self, x):
            out = self.shared_expert(x)
            out.add_(self.experts(x))
            return out

    class Llama4ForCausalLM(Llama4PreTrainedModel):
        base_model_prefix = "language_model"
    """
)


def test_a_wrappers_causal_lm_takes_the_text_config_and_ignores_the_wrappers_own_weights():
    """Loaded from the multimodal checkpoint, the text-only class leaves the vision tower's and the projector's
    weights unused without an UNEXPECTED key (its own patterns, where it names some, stay as they are)."""
    result = rewrite_source(WRAPPER_CAUSAL_LM, _target("llama4"), BLOCK)
    assert ('    base_model_prefix = "language_model"\n\n'
            "    # codegen: loaded from a multimodal checkpoint, the wrapper's own modules' weights are not this class's\n"
            '    _keys_to_ignore_on_load_unexpected = [r"(^|\\.)vision_model\\.", r"(^|\\.)multi_modal_projector\\."]\n'
            "\n    @classmethod\n    def from_pretrained(cls, *args, config=None, **kwargs):\n") in result.code
    own = WRAPPER_CAUSAL_LM + '    _keys_to_ignore_on_load_unexpected = [r"^mtp.*"]\n'
    result = rewrite_source(own, _target("llama4"), BLOCK)
    assert result.code.count("_keys_to_ignore_on_load_unexpected") == 1 and "def from_pretrained" in result.code


# ------------------------------------------------------------------ the routed experts' statement, at any depth (Gemma 4)


GEMMA4_LAYER_BEFORE = _dedent(
    """
    class Gemma4TextDecoderLayer(nn.Module):
        def forward(self, hidden_states):
            residual = hidden_states
            hidden_states = self.mlp(hidden_states)
            if self.enable_moe_block:
                hidden_states_1 = self.post_feedforward_layernorm_1(hidden_states)
                _, weights, index = self.router(residual)
                hidden_states_2 = self.experts(residual, index, weights)
                hidden_states_2 = self.post_feedforward_layernorm_2(hidden_states_2)
                hidden_states = hidden_states_1 + hidden_states_2
            return residual + hidden_states
    """
)


def test_routed_statement_is_reduced_in_its_own_branch_before_its_norm():
    """The decoder layer norms the routed experts' output before adding the dense MLP's: the reduction goes right
    after the experts' call, inside the `if` (the dense MLP reduces on its own)."""
    family = _family_without_wrapper("gemma4")
    result = rewrite_source(GEMMA4_LAYER_BEFORE, _anchor_target(family), BLOCK)
    assert result.code.endswith(
        "            hidden_states_2 = self.experts(residual, index, weights)\n"
        "            # codegen: one all-reduce per MoE layer covers the routed experts\n"
        "            hidden_states_2 = _codegen_moe_all_reduce(self, hidden_states_2)\n"
        "            hidden_states_2 = self.post_feedforward_layernorm_2(hidden_states_2)\n"
        "            hidden_states = hidden_states_1 + hidden_states_2\n"
        "        return residual + hidden_states\n"
    )
    assert result.reduced_variable == "hidden_states_2" and result.moe_class == "Gemma4TextDecoderLayer"


@pytest.mark.parametrize(
    "forward, message",
    [
        ("        return self.experts(x)\n", "no recognisable routed experts output"),
        ("        y = self.experts(x)\n        z = self.experts(y)\n        return z\n", "2 times"),
        ("        for i in range(2):\n            x = self.experts(x)\n        return x\n", "inside a loop"),
    ],
    ids=["no-assignment", "two-calls", "in-a-loop"],
)
def test_unplaceable_routed_statement_is_a_precise_error(forward, message):
    source = "class Gemma4TextDecoderLayer(nn.Module):\n    def forward(self, x):\n" + forward
    with pytest.raises(BadSource, match=message):
        rewrite_source(source, _anchor_target(_family_without_wrapper("gemma4")), BLOCK)


GRANITE_4X_BEFORE = _dedent(
    """
    class GraniteMoeMoE(nn.Module):
        def forward(self, layer_input):
            bsz, length, emb_size = layer_input.size()
            layer_input = layer_input.reshape(-1, emb_size)
            _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
            expert_inputs = layer_input[batch_index]
            hidden_states = self.input_linear(expert_inputs, expert_size)
            hidden_states = self.activation(hidden_states)
            expert_outputs = self.output_linear(hidden_states, expert_size)
            zeros = torch.zeros((bsz * length, self.input_size))
            layer_output = zeros.index_add(0, batch_index, expert_outputs)
            layer_output = layer_output.view(bsz, length, self.input_size)
            return layer_output, router_logits
    """
)


def test_returned_routed_follows_the_expert_modules_output_into_the_returned_name():
    """A block holding its expert modules itself (4.x GraniteMoe): the value returned carries their output through
    names (`expert_outputs` -> `layer_output`), not a call in the `return`; the tuple's first element is reduced."""
    result = rewrite_source(GRANITE_4X_BEFORE, _target("granitemoe"), BLOCK)
    assert result.code.endswith(
        "        layer_output = layer_output.view(bsz, length, self.input_size)\n"
        "        # codegen: one all-reduce per MoE layer covers the routed experts\n"
        "        return _codegen_moe_all_reduce(self, layer_output), router_logits\n"
    )


def test_returned_routed_refuses_a_return_the_experts_never_reach():
    source = GRANITE_4X_BEFORE.replace("return layer_output, router_logits", "return layer_input, router_logits")
    with pytest.raises(BadSource, match="no recognisable returned routed experts output"):
        rewrite_source(source, _target("granitemoe"), BLOCK)
