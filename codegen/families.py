"""Per-family knowledge, as data: one table a reader can scan, fed to one generic rewriter, policy and harness.

This is the only module that names a model type, a class, an attribute or a config key of a family.
The rewriter (codegen.patch.rewrite), the generated AutoTP policy (its header is rendered from
`Family.policy_layout()`), the rank worker, the examples, the bench and the tests all read from here,
so supporting a new family is a reviewed row of this table plus, at most, a new anchor or layout kind
that every family can use. Every field drives behaviour; nothing here is only for show.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from codegen.policy.runtime.base import FUSED_GATE_UP_INTERLEAVED_COLS, FUSED_GATE_UP_ROWS

#: The config.json key `patch` writes; the generated policy reads it. Off = stock DeepSpeed behaviour.
KNOB = "codegen_coalesce_moe_all_reduce"

#: Anchor kinds (codegen.patch.rewrite): where the one reduction goes in the MoE block's forward.
#: "shared_sum": after the statement that adds the shared expert output to the routed experts' sum.
ANCHOR_SHARED_SUM = "shared_sum"
#: "routed_final": no shared expert, the routed experts' output is the block's output: after the statement
#: that completes it (transformers 5.x: `T = self.<experts>(...)`; 4.x: the per-expert loop accumulating
#: into `T` with `index_add_`), before any reshape and the return.
ANCHOR_ROUTED_FINAL = "routed_final"
#: "returned_sum": the routed + shared sum is built inside the `return` (`return routed + shared`): the
#: returned sum itself is reduced, `return _codegen_moe_all_reduce(self, routed + shared)`.
ANCHOR_RETURNED_SUM = "returned_sum"

#: Fused (transformers 5.x) expert layouts are named by the policy runtime, which shards each
#: (codegen.policy.runtime.base): FUSED_GATE_UP_ROWS, gate_up [E, 2I, H] (gate rows then up rows), down
#: [E, H, I]; FUSED_GATE_UP_INTERLEAVED_COLS, transposed, gate_up [E, H, 2I] with gate/up interleaved along the
#: last dim (a rank keeps whole gate/up pairs), down [E, I, H], optional biases gate_up_bias [E, 2I] (split with
#: the columns) and down_bias [E, H] (added inside every expert before the weighting: counted once over the ranks).

#: Example shapes at the published widths keep two decoder layers and a small vocabulary (positions cost nothing:
#: rotary tables are computed per call); per-layer lists are cut to the layers kept
FULL_WIDTH_CAPS = dict(num_hidden_layers=2, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False)
#: routing switches a full-width example takes from the published config besides the keys of its tiny example
PUBLISHED_ROUTING_KEYS = ("norm_topk_prob",)


@dataclass(frozen=True)
class PerExpertMLP:
    """transformers 4.x (and hub remote code): `experts` is a ModuleList of MLPs of `nn.Linear`s."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class FusedExperts:
    """transformers 5.x: `experts` holds 3-D Parameters (one tensor for all experts) that AutoTP never touches."""

    kind: str = FUSED_GATE_UP_ROWS
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    #: attribute holding the per-expert intermediate size, which the policy sets to its shard
    size_attr: str = "intermediate_dim"
    #: expert bias Parameters of the layout ("" = none); the rewriter requires every named one to detect it
    gate_up_bias: str = ""
    down_bias: str = ""

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every Parameter the layout names: together they identify fused experts in a source."""
        return tuple(n for n in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if n)


@dataclass(frozen=True)
class QuantizedForm:
    """A quantized checkpoint form and the first transformers release whose loader fills a patched dir from it.

    Older loaders recognise quantized experts by the built-in class (`isinstance`), so the patched class's
    experts stay unloaded, without a missing key: the model would run on uninitialised memory.
    """

    quant_method: str
    #: first release verified to load it into a patched dir exactly (dequantized experts equal the built-in's)
    min_transformers: str
    #: how to get an unquantized checkpoint of the same weights (quoted in the refusal)
    dequantize_hint: str


@dataclass(frozen=True)
class Examples:
    """The family's example checkpoints (codegen.harness.examples builds them with random weights).

    `tiny`: what tests and the demo use (a few KB); `toy`: the bench's scaled-down shape of a real checkpoint's
    routing; the full-width shape is derived from `published`, the project's copy of a real checkpoint's
    config (codegen/harness/published/), with two decoder layers and a small vocabulary (FULL_WIDTH_CAPS),
    then `full_overrides`.
    """

    tiny: dict
    toy: dict | None = None
    published: str = ""
    full_overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StockAutoTP:
    """What stock DeepSpeed AutoTP (`deepspeed.init_inference(tensor_parallel=...)`) does to the unpatched
    family, as measured (a comparison, never what codegen is judged by)."""

    #: the start of the line it crashes with on its first forward ("" = it runs)
    crash: str = ""
    #: why, in a few words
    why: str = ""


#: a field that does not shape what `patch` writes (codegen.patch.plan's fingerprint leaves it out)
_NOT_OUTPUT = {"output": False}


@dataclass(frozen=True)
class Family:
    """One MoE family: every name codegen needs to rewrite, shard and check it."""

    model_type: str
    #: the transformers module that ships the built-in implementation
    builtin_module: str
    #: the transformers config class (examples build tiny checkpoints from it)
    config_class: str
    #: class names of the MoE block, any generation (4.x, 5.x, hub remote code)
    moe_classes: tuple[str, ...]
    #: the attribute of the MoE block holding the routed experts
    experts_attr: str
    #: routed experts of 4.x sources (a ModuleList of MLPs)
    per_expert: PerExpertMLP
    #: routed experts of 5.x sources (3-D Parameters)
    fused: FusedExperts
    #: attributes of the MoE block that are shared-expert MLPs (their down projection is `per_expert.down`)
    shared_experts: tuple[str, ...]
    #: attributes of the MoE block that compute routing weights: kept whole and of their own type on every rank
    routers: tuple[str, ...]
    #: where the reduction goes (ANCHOR_*)
    anchor: str
    #: the class every model class derives from (gets the 5.x loader override)
    pretrained_class_suffix: str
    #: classes written into auto_map, by auto class
    auto_classes: dict[str, str]
    #: config keys naming the number of routed experts (first present wins)
    num_experts_keys: tuple[str, ...]
    #: config keys naming the experts each token reaches
    top_k_keys: tuple[str, ...]
    #: config keys that must be positive integers when present
    positive_int_keys: tuple[str, ...]
    #: config keys the tensor-parallel size must divide (checked by the policy, on `text_config` when nested)
    tp_divisible_keys: tuple[str, ...]
    #: attention projections that must stay replicated (MLA low-rank inputs)
    attention_replicated: tuple[str, ...] = ()
    #: attention Parameters holding one value per attention head (e.g. sinks): sharded with the heads
    attention_head_params: tuple[str, ...] = ()
    #: decoder-layer attributes that hold the MoE block, any generation (the first is the 5.x name)
    moe_block_attrs: tuple[str, ...] = ("mlp",)
    #: quantized forms this family ships (`quantization_config.quant_method`) that a patched dir loads exactly only
    #: from some transformers release on; `patch` refuses them below it (codegen.patch.quantization)
    quantized_forms: tuple[QuantizedForm, ...] = ()
    #: decoder-layer attributes holding an attention block, of any kind the family has
    attention_attrs: tuple[str, ...] = ("self_attn",)
    #: what the bench and README call the bench-sized example of this family
    bench_label: str = field(default="", metadata=_NOT_OUTPUT)
    #: transformers releases whose source the regression matrix covers (also quoted in errors)
    known_good: tuple[str, ...] = field(default=())
    #: hub-style remote code of this family the regression matrix covers: fixture dirs under tests/fixtures/
    #: (one `modeling_*.py`, shipped next to its `configuration_*.py`)
    remote_code_fixtures: tuple[str, ...] = ()
    #: unsupported model types built on this family's MoE block (named as the nearest family when refused)
    relatives: tuple[str, ...] = ()
    #: config keys that say which decoder layers hold an MoE block (`patch` refuses a config with none):
    #: the layer count; a list of dense-only layer indices; "MoE when (i + 1) % step == 0"; "dense below k";
    #: "MoE when i % freq == 0"
    num_layers_key: str = "num_hidden_layers"
    dense_layers_key: str | None = None
    sparse_step_key: str | None = None
    first_dense_key: str | None = None
    moe_freq_key: str | None = None
    #: example checkpoints of the family (tests, demo, bench)
    examples: Examples | None = field(default=None, metadata=_NOT_OUTPUT)
    #: what stock DeepSpeed AutoTP does to it
    stock_autotp: StockAutoTP = field(default=StockAutoTP(), metadata=_NOT_OUTPUT)

    def output_data(self) -> dict:
        """The fields that shape what `patch` writes, as plain data (the patch fingerprint hashes them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("output", True)}

    @property
    def releases(self) -> tuple[str, ...]:
        """The pinned transformers releases of `known_good` (the rest names remote code)."""
        return tuple(v for v in self.known_good if v[:1].isdigit())

    @property
    def builtin_module_name(self) -> str:
        return self.builtin_module.rsplit(".", 1)[-1]

    def policy_layout(self) -> dict:
        """The plain data the generated policy's header carries (codegen.policy.runtime reads only this)."""
        return {
            "family": self.model_type,
            "moe_classes": list(self.moe_classes),
            "experts": self.experts_attr,
            "per_expert": {"gate": self.per_expert.gate, "up": self.per_expert.up, "down": self.per_expert.down},
            "fused": {"kind": self.fused.kind, "gate_up": self.fused.gate_up, "down": self.fused.down,
                      "size_attr": self.fused.size_attr,
                      "gate_up_bias": self.fused.gate_up_bias, "down_bias": self.fused.down_bias},
            "shared": list(self.shared_experts),
            "routers": list(self.routers),
            "attention_replicated": list(self.attention_replicated),
            "attention_head_params": list(self.attention_head_params),
            "moe_block_attrs": list(self.moe_block_attrs),
            "tp_divisible": list(self.tp_divisible_keys),
        }


_COMMON_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                 "num_experts_per_tok", "vocab_size")

FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family(
        model_type="qwen2_moe",
        builtin_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
        config_class="Qwen2MoeConfig",
        moe_classes=("Qwen2MoeSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_expert",),
        routers=("gate", "shared_expert_gate"),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "Qwen2MoeForCausalLM", "AutoModel": "Qwen2MoeModel"},
        num_experts_keys=("num_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "shared_expert_intermediate_size", "intermediate_size"),
        bench_label="Qwen1.5-MoE-A2.7B-like",
        known_good=("4.45.2", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        dense_layers_key="mlp_only_layers",
        sparse_step_key="decoder_sparse_step",
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                tie_word_embeddings=False,
            ),
            toy=dict(
                vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
                shared_expert_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=8, num_experts=60, num_experts_per_tok=4, max_position_embeddings=1024,
                norm_topk_prob=False, tie_word_embeddings=False,
            ),
            published="qwen1.5-moe-a2.7b.json",
        ),
    ),
    "deepseek_v2": Family(
        model_type="deepseek_v2",
        builtin_module="transformers.models.deepseek_v2.modeling_deepseek_v2",
        config_class="DeepseekV2Config",
        moe_classes=("DeepseekV2Moe", "DeepseekV2MoE"),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        routers=("gate",),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "DeepseekV2ForCausalLM", "AutoModel": "DeepseekV2Model"},
        num_experts_keys=("n_routed_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "intermediate_size"),
        attention_replicated=("q_a_proj", "kv_a_proj_with_mqa"),
        bench_label="DeepSeek-V2-Lite-like",
        known_good=("4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0", "hub remote code (modeling_deepseek.py)"),
        remote_code_fixtures=("hub_deepseek",),
        first_dense_key="first_k_dense_replace",
        moe_freq_key="moe_layer_freq",
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=256, topk_method="greedy",
                n_group=1, topk_group=1, tie_word_embeddings=False,
            ),
            toy=dict(
                vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=64,
                n_shared_experts=2, num_experts_per_tok=6, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
                v_head_dim=64, qk_nope_head_dim=64, first_k_dense_replace=1, max_position_embeddings=1024,
                topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, tie_word_embeddings=False,
            ),
            published="deepseek-v2-lite.json",
        ),
    ),
    "qwen3_moe": Family(
        model_type="qwen3_moe",
        builtin_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
        config_class="Qwen3MoeConfig",
        moe_classes=("Qwen3MoeSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=(),
        routers=("gate",),
        anchor=ANCHOR_ROUTED_FINAL,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "Qwen3MoeForCausalLM", "AutoModel": "Qwen3MoeModel"},
        # 4.x writes num_experts; 5.x writes num_local_experts
        num_experts_keys=("num_experts", "num_local_experts"),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "num_local_experts", "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "intermediate_size"),
        bench_label="Qwen3-30B-A3B-like",
        known_good=("4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        relatives=("qwen3_next", "qwen3_vl_moe", "qwen3_omni_moe"),
        dense_layers_key="mlp_only_layers",
        sparse_step_key="decoder_sparse_step",
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=256, tie_word_embeddings=False,
            ),
            toy=dict(
                vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
            ),
            published="qwen3-30b-a3b.json",
        ),
    ),
    "mixtral": Family(
        model_type="mixtral",
        builtin_module="transformers.models.mixtral.modeling_mixtral",
        config_class="MixtralConfig",
        moe_classes=("MixtralSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(gate="w1", up="w3", down="w2"),
        fused=FusedExperts(),
        shared_experts=(),
        routers=("gate",),
        anchor=ANCHOR_ROUTED_FINAL,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "MixtralForCausalLM", "AutoModel": "MixtralModel"},
        num_experts_keys=("num_local_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_local_experts", "intermediate_size"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
        moe_block_attrs=("mlp", "block_sparse_moe"),
        bench_label="Mixtral-8x7B-like",
        known_good=("4.36.2", "4.45.2", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        relatives=("minimax", "phimoe"),
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
                tie_word_embeddings=False,
            ),
        ),
    ),
    "deepseek_v3": Family(
        model_type="deepseek_v3",
        builtin_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
        config_class="DeepseekV3Config",
        moe_classes=("DeepseekV3MoE",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        routers=("gate",),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "DeepseekV3ForCausalLM", "AutoModel": "DeepseekV3Model"},
        num_experts_keys=("n_routed_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts", "n_group", "topk_group"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "intermediate_size"),
        attention_replicated=("q_a_proj", "kv_a_proj_with_mqa"),
        bench_label="DeepSeek-V3-like",
        known_good=("4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        relatives=("longcat_flash",),
        first_dense_key="first_k_dense_replace",
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=256,
                tie_word_embeddings=False,
            ),
        ),
    ),
    "glm4_moe": Family(
        model_type="glm4_moe",
        builtin_module="transformers.models.glm4_moe.modeling_glm4_moe",
        config_class="Glm4MoeConfig",
        moe_classes=("Glm4MoeMoE",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        routers=("gate",),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "Glm4MoeForCausalLM", "AutoModel": "Glm4MoeModel"},
        num_experts_keys=("n_routed_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts", "n_group", "topk_group", "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "intermediate_size"),
        bench_label="GLM-4.5-Air-like",
        known_good=("4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        relatives=("glm4v_moe", "glm4_moe_lite"),
        first_dense_key="first_k_dense_replace",
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
                tie_word_embeddings=False,
            ),
        ),
    ),
    "gpt_oss": Family(
        model_type="gpt_oss",
        builtin_module="transformers.models.gpt_oss.modeling_gpt_oss",
        config_class="GptOssConfig",
        moe_classes=("GptOssMLP",),
        experts_attr="experts",
        # every generation ships fused experts (4.x too): the per-expert names are never looked up
        per_expert=PerExpertMLP(),
        fused=FusedExperts(kind=FUSED_GATE_UP_INTERLEAVED_COLS, size_attr="intermediate_size",
                           gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias"),
        shared_experts=(),
        routers=("router",),
        anchor=ANCHOR_ROUTED_FINAL,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "GptOssForCausalLM", "AutoModel": "GptOssModel"},
        num_experts_keys=("num_local_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_local_experts", "intermediate_size", "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
        attention_head_params=("sinks",),
        quantized_forms=(
            QuantizedForm(
                quant_method="mxfp4",
                min_transformers="5.24.0",
                dequantize_hint="`from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True))`, "
                                "`save_pretrained` to a new dir and patch that dir",
            ),
        ),
        bench_label="gpt-oss-20b-like",
        known_good=("4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        examples=Examples(
            tiny=dict(
                vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"], sliding_window=8, max_position_embeddings=256,
                tie_word_embeddings=False,
            ),
            toy=dict(
                vocab_size=4096, hidden_size=512, intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128,
                max_position_embeddings=131072, tie_word_embeddings=False,  # = the default YaRN factor x 4096
            ),
            published="gpt-oss-20b.json",
            full_overrides=dict(max_position_embeddings=131072),  # = the default YaRN factor x 4096
        ),
        stock_autotp=StockAutoTP(crash="RuntimeError: Sizes of tensors must match",
                                 why="attention sinks are not sharded with the heads"),
    ),
}


def normalise_model_type(raw: object) -> str | None:
    """`Qwen2_MoE`, ` qwen2-moe ` and `qwen2_moe` name the same family; anything else is unknown."""
    if not isinstance(raw, str):
        return None
    key = raw.strip().lower().replace("-", "_")
    return key if key in FAMILIES else None


def moe_class_names() -> frozenset[str]:
    """Every MoE block class of every family (the harness finds blocks by these)."""
    return frozenset(name for f in FAMILIES.values() for name in f.moe_classes)


def fused_attr_names() -> frozenset[str]:
    """Every fused-expert Parameter name of every family (the harness reports them as sharded weights)."""
    return frozenset(n for f in FAMILIES.values() for n in f.fused.parameters)
