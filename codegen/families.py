"""Per-family knowledge, as data: one table a reader can scan, fed to one generic rewriter and policy.

Everything the tool knows about Qwen2-MoE and DeepSeek-V2 lives here, so supporting a new release or
a new family is a reviewed edit of this table, not a new code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The config.json key `patch` writes; the generated policy reads it. Off = stock DeepSpeed behaviour.
KNOB = "codegen_coalesce_moe_all_reduce"


@dataclass(frozen=True)
class TPLayout:
    """How the generated AutoTP policy treats each layer of one family (names relative to a decoder layer)."""

    #: gate/router layers kept replicated, unsplit and of their original type on every rank
    replicated: tuple[str, ...]
    #: row-parallel projections whose per-layer all-reduce the coalesced reduction replaces
    routed_down: str
    shared_down: tuple[str, ...]
    #: column-parallel (sharded along the intermediate dimension) projections, for the reader
    column: tuple[str, ...]
    #: projections DeepSpeed keeps replicated for MLA low-rank attention
    attention_replicated: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    model_type: str
    #: the transformers module that ships the built-in implementation
    builtin_module: str
    #: class names of the MoE block, any generation (4.x, 5.x, hub remote code)
    moe_classes: tuple[str, ...]
    #: attributes of the MoE block that compute the shared expert output
    shared_attrs: tuple[str, ...]
    #: the class every model class derives from (gets the 5.x loader override)
    pretrained_class_suffix: str
    #: classes written into auto_map, by auto class
    auto_classes: dict[str, str]
    #: config keys naming the number of routed experts (first present wins)
    num_experts_keys: tuple[str, ...]
    #: config keys that must be positive integers when present
    positive_int_keys: tuple[str, ...]
    layout: TPLayout
    #: transformers releases whose source the regression matrix covers (also quoted in errors)
    known_good: tuple[str, ...] = field(default=())


FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family(
        model_type="qwen2_moe",
        builtin_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
        moe_classes=("Qwen2MoeSparseMoeBlock",),
        shared_attrs=("shared_expert", "shared_expert_gate"),
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "Qwen2MoeForCausalLM", "AutoModel": "Qwen2MoeModel"},
        num_experts_keys=("num_experts",),
        positive_int_keys=(
            "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
            "num_experts", "num_experts_per_tok", "vocab_size",
        ),
        layout=TPLayout(
            replicated=("mlp.gate", "mlp.shared_expert_gate"),
            routed_down="mlp.experts.*.down_proj",
            shared_down=("mlp.shared_expert.down_proj",),
            column=("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.gate_up_proj",
                    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        ),
        known_good=("4.45.2", "4.51.3", "4.57.6", "5.0.0", "5.24.0"),
    ),
    "deepseek_v2": Family(
        model_type="deepseek_v2",
        builtin_module="transformers.models.deepseek_v2.modeling_deepseek_v2",
        moe_classes=("DeepseekV2Moe", "DeepseekV2MoE"),
        shared_attrs=("shared_experts",),
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "DeepseekV2ForCausalLM", "AutoModel": "DeepseekV2Model"},
        num_experts_keys=("n_routed_experts",),
        positive_int_keys=(
            "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "vocab_size",
        ),
        layout=TPLayout(
            replicated=("mlp.gate",),
            routed_down="mlp.experts.*.down_proj",
            shared_down=("mlp.shared_experts.down_proj",),
            column=("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.gate_up_proj",
                    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
            attention_replicated=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        ),
        known_good=("4.57.6", "5.0.0", "5.24.0", "hub remote code (modeling_deepseek.py)"),
    ),
}


def normalise_model_type(raw: object) -> str | None:
    """`Qwen2_MoE`, ` qwen2-moe ` and `qwen2_moe` name the same family; anything else is unknown."""
    if not isinstance(raw, str):
        return None
    key = raw.strip().lower().replace("-", "_")
    return key if key in FAMILIES else None
