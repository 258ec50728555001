"""The family table: one row per MoE family, each the names codegen needs to rewrite, shard and check it.

A row gives what differs from the defaults of `Family` (codegen.families.kinds): the model type, the config class,
the MoE block classes, the experts-count keys, then the shared experts, routers, attention rules, layer keys and the
releases the regression matrix covers. Left out, the built-in module, the auto classes, the anchor and the positive-int
keys are derived. Rows of one design share a fragment below, spread into the row (`**_DEEPSEEK_MOE`).
The examples and the measured stock AutoTP figures are kept beside the table (examples.py, stock.py).
"""

from __future__ import annotations

from codegen.families.kinds import ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_STATEMENT, \
    ANCHOR_SHARED_INPLACE_SUM, HEADS_AND_WIDTHS, IMAGE_FLAT_PATCHES, IMAGE_PATCH_ROWS, IMAGE_POSITIONED_PATCHES, \
    IMAGE_SIZED, IMAGE_WHOLE, Alias, Family, FusedExperts, Legacy, LatentAttention, LinearAttention, \
    MoELayers, PerExpertMLP, QuantizedForm, Wrapper, table
from codegen.policy.runtime.base import FUSED_FLAT_ROWS, FUSED_GATE_UP_HALVES_COLS, FUSED_GATE_UP_INTERLEAVED_COLS, \
    FUSED_UP_ROWS, GATE_CLAMPED_SWIGLU

#: the DeepSeek MoE block: shared experts beside routed ones counted by `n_routed_experts`
_DEEPSEEK_MOE = dict(shared_experts=("shared_experts",), num_experts_keys=("n_routed_experts",))
#: group-limited routing (DeepSeek-V3 style): its group counts must be positive
_GROUPS = ("n_group", "topk_group")
#: MLA attention's low-rank inputs: every rank needs them whole
_MLA = ("q_a_proj", "kv_a_proj_with_mqa")
#: MLA decoded absorbed where the cache holds the latent
_LATENT = LatentAttention()
#: MLA: its low-rank inputs whole, its decode absorbed
_LATENT_MLA = dict(attention_replicated=_MLA, latent_attention=_LATENT)
#: MLA with a DSA indexer (whole on every rank too), its decode absorbed
_LATENT_DSA = dict(attention_replicated=(*_MLA, "indexer"), latent_attention=_LATENT)
#: the Qwen MoE block: one shared expert under its own sigmoid gate
_QWEN_SHARED_EXPERT = dict(shared_experts=("shared_expert",), routers=("gate", "shared_expert_gate"),
                           num_experts_keys=("num_experts",))
#: MoE layers picked by a dense-layer list and a step (Qwen)
_QWEN_LAYERS = MoELayers(dense_list="mlp_only_layers", sparse_step="decoder_sparse_step")
#: MoE layers after the first dense ones, every `moe_layer_freq`-th (DeepSeek)
_DEEPSEEK_LAYERS = MoELayers(first_dense="first_k_dense_replace", freq="moe_layer_freq")
#: MoE layers after the first dense ones
_FIRST_DENSE = MoELayers(first_dense="first_k_dense_replace")
#: a per-layer list of "dense" / "sparse"
_LAYER_TYPES = MoELayers(types="mlp_layer_types")
#: the DeepSeek remote code the regression matrix covers besides the releases
_HUB_DEEPSEEK = "hub remote code (modeling_deepseek.py)"
#: Mixtral's per-expert MLP names
_W1_W3_W2 = PerExpertMLP(gate="w1", up="w3", down="w2")
#: no separate expert width: each expert is `intermediate_size` wide
_DENSE_WIDTH_TP = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
#: q/k RMSNorms over all heads
_QK_FULL_WIDTH_NORMS = (("q_norm", "q_proj"), ("k_norm", "k_proj"))

#: Llama 4's fused experts (every release): gate_up [E, H, 2I] gate columns then up columns, down [E, I, H]
_LLAMA4_EXPERTS = FusedExperts(kind=FUSED_GATE_UP_HALVES_COLS, size_attr="expert_dim")
_GPT_OSS_EXPERTS = FusedExperts(kind=FUSED_GATE_UP_INTERLEAVED_COLS, size_attr="intermediate_size",
                                gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias",
                                gate=GATE_CLAMPED_SWIGLU, gate_params=("alpha", "limit"))

#: the gated delta-net attribute of the Qwen hybrids' decoder layers, and the head counts of their linear attention
_QWEN_LINEAR_ATTN = "linear_attn"
_LINEAR_HEAD_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_QWEN_HYBRID_TP = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                   "moe_intermediate_size", "shared_expert_intermediate_size")
#: Qwen3.5's gated delta-net: in_proj_qkv rows [q (key heads) | k (key heads) | v (value heads)]; z, b, a: per value
#: head
_QWEN3_5_GATED_DELTA_NET = LinearAttention(attr=_QWEN_LINEAR_ATTN, projections=(
    ("in_proj_qkv", ("key_dim", "key_dim", "value_dim")), ("in_proj_z", ()), ("in_proj_b", ()), ("in_proj_a", ())))
#: the Nemotron-H decoder, saved alone and in the Omni wrapper (whose decoder is this module)
_NEMOTRON_H = dict(
    moe_classes=("NemotronHMoE",),
    # non-gated experts (relu2(up x), then down) behind the block's latent projections (nn.Identity without
    # `moe_latent_size`), which stay whole; the shared expert and the dense MLP blocks are non-gated too
    fused=FusedExperts(kind=FUSED_UP_ROWS, gate_up="", up="up_proj", down="down_proj",
                       latent_in="fc1_latent_proj", latent_out="fc2_latent_proj"),
    per_expert=PerExpertMLP(gate="", up="up_proj", down="down_proj"),
    **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim", "intermediate_size",
                                         "moe_shared_expert_intermediate_size", "mamba_num_heads"),
    tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                       "moe_shared_expert_intermediate_size", "intermediate_size"),
    # a block is one mixer (Mamba-2, attention, MoE or a dense MLP) under `mixer`; the Mamba-2 mixer (n_groups
    # B/C groups, a gated norm over its groups) whole on every rank, its conv and SSM caches whole
    moe_block_attrs=("mixer",), attention_attrs=("mixer",), whole_modules=("NemotronHMamba2Mixer",),
    # `layers_block_type` (5.x), else the hub's `hybrid_override_pattern` ("M", "E", "*", "-" per block)
    layers=MoELayers(types="layers_block_type", pattern="hybrid_override_pattern", sparse_marks=("moe", "E")),
)
#: the Qwen3.5 MoE decoder, in the multimodal wrapper and saved alone (one module)
_QWEN3_5_DECODER = dict(
    moe_classes=("Qwen3_5MoeSparseMoeBlock",), **_QWEN_SHARED_EXPERT,
    more_positive_ints=("head_dim", *_LINEAR_HEAD_KEYS),
    tp_divisible_keys=_QWEN_HYBRID_TP, attention_attrs=("self_attn", _QWEN_LINEAR_ATTN),
    linear_attention=_QWEN3_5_GATED_DELTA_NET, known_good=("5.2.0", "5.24.0"),
)

#: the Granite MoE block (GraniteMoe, its shared-MLP and hybrid descendants): a router of its own type; 4.x held the
#: experts itself as two GraniteMoeParallelExperts modules: input_linear [E, 2I, H] (gate rows, then up rows) and
#: output_linear [E, H, I], the layout of 5.x's fused experts one module down each
_GRANITE_MOE = dict(
    routers=("router",), num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size",),
    moe_block_attrs=("block_sparse_moe",), anchor=ANCHOR_RETURNED_ROUTED,
    legacy=Legacy(experts_attr="", fused=FusedExperts(gate_up="input_linear.weight", down="output_linear.weight",
                                                      size_attr="")),
)

FAMILIES: dict[str, Family] = table(
    Family(
        model_type="qwen2_moe", config_class="Qwen2MoeConfig", moe_classes=("Qwen2MoeSparseMoeBlock",),
        **_QWEN_SHARED_EXPERT, layers=_QWEN_LAYERS,
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "shared_expert_intermediate_size", "intermediate_size"),
        known_good=("4.40.0", "4.45.0", "4.45.2", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="deepseek_v2", config_class="DeepseekV2Config", moe_classes=("DeepseekV2Moe", "DeepseekV2MoE"),
        **_DEEPSEEK_MOE, **_LATENT_MLA, layers=_DEEPSEEK_LAYERS,
        known_good=("4.54.0", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0", _HUB_DEEPSEEK),
        remote_code_fixtures=("hub_deepseek",),
    ),
    Family(
        model_type="qwen3_moe", config_class="Qwen3MoeConfig", moe_classes=("Qwen3MoeSparseMoeBlock",),
        # 4.x writes num_experts; 5.x writes num_local_experts
        num_experts_keys=("num_experts", "num_local_experts"), more_positive_ints=("head_dim",), layers=_QWEN_LAYERS,
        known_good=("4.51.0", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="mixtral", config_class="MixtralConfig", moe_classes=("MixtralSparseMoeBlock",),
        per_expert=_W1_W3_W2, moe_block_attrs=("mlp", "block_sparse_moe"),
        num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size",),
        tp_divisible_keys=_DENSE_WIDTH_TP,
        known_good=("4.36.2", "4.45.2", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="deepseek_v3", config_class="DeepseekV3Config", moe_classes=("DeepseekV3MoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS, **_LATENT_MLA, layers=_DEEPSEEK_LAYERS,
        known_good=("4.51.0", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0", _HUB_DEEPSEEK),
        remote_code_fixtures=("hub_kimi_k2",),
    ),
    Family(
        model_type="glm4_moe", config_class="Glm4MoeConfig", moe_classes=("Glm4MoeMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"), layers=_FIRST_DENSE,
        known_good=("4.54.0", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="gpt_oss", config_class="GptOssConfig", moe_classes=("GptOssMLP",),
        # every generation ships fused experts (4.x too, the same layout): the per-expert names are never looked up
        fused=_GPT_OSS_EXPERTS, legacy=Legacy(fused=_GPT_OSS_EXPERTS), routers=("router",),
        num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size", "head_dim"),
        tp_divisible_keys=_DENSE_WIDTH_TP, attention_head_params=("sinks",),
        quantized_forms=(QuantizedForm(quant_method="mxfp4", min_transformers="5.24.0", dequantize_hint=(
            "`from_pretrained(dir, quantization_config=Mxfp4Config(dequantize=True))`, `save_pretrained` to a new dir "
            "and patch that dir")),),
        known_good=("4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="glm4_moe_lite", config_class="Glm4MoeLiteConfig", moe_classes=("Glm4MoeLiteMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS, **_LATENT_MLA, layers=_LAYER_TYPES,
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="deepseek_v32", config_class="DeepseekV32Config", moe_classes=("DeepseekV32MoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS,
        # the DSA indexer takes top-k over the sum of all its heads: every rank needs all of them
        **_LATENT_DSA,
        layers=MoELayers(types="mlp_layer_types", first_dense="first_k_dense_replace"),
        known_good=("5.11.0", "5.24.0"),
    ),
    Family(
        model_type="glm_moe_dsa", config_class="GlmMoeDsaConfig", moe_classes=("GlmMoeDsaMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS, **_LATENT_DSA,
        layers=MoELayers(types="mlp_layer_types", first_dense="first_k_dense_replace"),
        known_good=("5.2.0", "5.24.0"),
    ),
    Family(
        model_type="mistral4", config_class="Mistral4Config", moe_classes=("Mistral4MoE",),
        # transformers registers Mistral4ForCausalLM under the image-text-to-text auto class only (hub checkpoints
        # are the mistral3 wrapper): the patched dir names it under both
        auto_classes={"AutoModelForImageTextToText": "Mistral4ForCausalLM",
                      "AutoModelForCausalLM": "Mistral4ForCausalLM", "AutoModel": "Mistral4Model"},
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"), **_LATENT_MLA, layers=_FIRST_DENSE,
        known_good=("5.4.0", "5.24.0"),
    ),
    Family(
        model_type="ernie4_5_moe", config_class="Ernie4_5_MoeConfig", moe_classes=("Ernie4_5_MoeSparseMoeBlock",),
        shared_experts=("shared_experts",), num_experts_keys=("moe_num_experts",), top_k_keys=("moe_k",),
        more_positive_ints=("head_dim",),
        layers=MoELayers(sparse_step="moe_layer_interval", first_dense="moe_layer_start_index",
                         last_moe="moe_layer_end_index"),
        known_good=("4.54.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="dots1", config_class="Dots1Config", moe_classes=("Dots1MoE",),
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"), layers=_FIRST_DENSE,
        known_good=("4.53.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="exaone_moe", config_class="ExaoneMoeConfig", moe_classes=("ExaoneMoeSparseMoEBlock",),
        shared_experts=("shared_experts",), num_experts_keys=("num_experts",),
        more_positive_ints=(*_GROUPS, "head_dim"), layers=_LAYER_TYPES,
        known_good=("5.1.0", "5.24.0"),
    ),
    Family(
        model_type="solar_open", config_class="SolarOpenConfig", moe_classes=("SolarOpenMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size"),
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="phimoe", config_class="PhimoeConfig", moe_classes=("PhimoeSparseMoeBlock",),
        per_expert=_W1_W3_W2, moe_block_attrs=("mlp", "block_sparse_moe"),
        # 5.x: `router`, an nn.Linear subclass; 4.x: `gate`, a plain nn.Linear (stock AutoTP splits either)
        routers=("router",), legacy=Legacy(routers=("gate",)),
        num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size",),
        tp_divisible_keys=_DENSE_WIDTH_TP,
        known_good=("4.46.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="afmoe", config_class="AfmoeConfig", moe_classes=("AfmoeSparseMoeBlock", "AfmoeMoE"),
        shared_experts=("shared_experts",), anchor=ANCHOR_RETURNED_SUM,
        # the router holds an nn.Linear `gate` that stock AutoTP splits
        routers=("router",),
        num_experts_keys=("num_experts",), more_positive_ints=("head_dim",),
        # the attention output gate, one row block per head
        attention_head_linears=("gate_proj",),
        layers=MoELayers(first_dense="num_dense_layers"),
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="hunyuan_v1_moe", config_class="HunYuanMoEV1Config", moe_classes=("HunYuanMoEV1Moe",),
        # the router: an nn.Module holding an nn.Linear `wg`, which stock AutoTP column-splits (silently wrong routing)
        shared_experts=("shared_mlp",), anchor=ANCHOR_RETURNED_SUM,
        num_experts_keys=("num_experts",), top_k_keys=("moe_topk",),
        more_positive_ints=("intermediate_size", "head_dim"),
        tp_divisible_keys=_DENSE_WIDTH_TP,
        # `HunYuan...` reads as Yuan to DeepSpeed, which would pair v heads as Yuan's shared-QK attention does
        deepspeed_name_clashes=("Yuan",),
        known_good=("4.56.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="mimo_v2_flash", config_class="MiMoV2FlashConfig", moe_classes=("MiMoV2FlashMoE",),
        anchor=ANCHOR_RETURNED_ROUTED, num_experts_keys=("n_routed_experts",),
        more_positive_ints=(*_GROUPS, "head_dim", "v_head_dim"),
        # sliding-window layers only (full layers have none)
        attention_head_params=("sinks",), layers=_LAYER_TYPES,
        known_good=("5.13.0", "5.24.0"),
    ),
    Family(
        model_type="olmoe", config_class="OlmoeConfig", moe_classes=("OlmoeSparseMoeBlock",),
        num_experts_keys=("num_experts",), more_positive_ints=("intermediate_size",), tp_divisible_keys=_DENSE_WIDTH_TP,
        full_width_norms=_QK_FULL_WIDTH_NORMS,
        known_good=("4.45.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="flex_olmo", config_class="FlexOlmoConfig", moe_classes=("FlexOlmoSparseMoeBlock",),
        num_experts_keys=("num_experts",), more_positive_ints=("intermediate_size",), tp_divisible_keys=_DENSE_WIDTH_TP,
        full_width_norms=_QK_FULL_WIDTH_NORMS,
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="minimax_m2", config_class="MiniMaxM2Config", moe_classes=("MiniMaxM2SparseMoeBlock",),
        per_expert=_W1_W3_W2, moe_block_attrs=("mlp", "block_sparse_moe"),
        num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size", "head_dim"),
        tp_divisible_keys=_DENSE_WIDTH_TP, full_width_norms=_QK_FULL_WIDTH_NORMS,
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="step3p7", config_class="Step3p7Config", moe_classes=("Step3p7SparseMoeBlock",),
        shared_experts=("shared_experts",), num_experts_keys=("n_routed_experts",),
        more_positive_ints=("head_dim", "share_expert_dim"),
        tp_divisible_keys=("num_attention_heads", "num_sliding_attention_heads", "num_key_value_heads",
                           "moe_intermediate_size", "share_expert_dim", "intermediate_size"),
        layers=_LAYER_TYPES,
        wrapper=Wrapper(replicated=("vision_model", "multi_modal_projector"), image_input=IMAGE_WHOLE),
        known_good=("5.16.0", "5.24.0"),
    ),
    Family(
        model_type="qwen3_vl_moe", config_class="Qwen3VLMoeConfig", moe_classes=("Qwen3VLMoeTextSparseMoeBlock",),
        # 4.x writes num_experts; 5.x writes num_local_experts
        num_experts_keys=("num_experts", "num_local_experts"), more_positive_ints=("head_dim",),
        # 4.x: gate_up [E, H, 2I] (gate columns, then up columns), down [E, I, H]
        legacy=Legacy(fused=FusedExperts(kind=FUSED_GATE_UP_HALVES_COLS, size_attr="expert_dim")),
        layers=_QWEN_LAYERS,
        wrapper=Wrapper(replicated=("visual",), text_model="Qwen3VLMoeTextModel", image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        token_types=True),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="glm4v_moe", config_class="Glm4vMoeConfig", moe_classes=("Glm4vMoeTextMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"), layers=_FIRST_DENSE,
        wrapper=Wrapper(replicated=("visual",), image_input=IMAGE_FLAT_PATCHES, image_start_key="image_start_token_id",
                        image_end_key="image_end_token_id", token_types=True),
        known_good=("4.56.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="kimi_k25", config_class="Kimi_K25Config", moe_classes=("DeepseekV3MoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS, **_LATENT_MLA, layers=_DEEPSEEK_LAYERS,
        wrapper=Wrapper(replicated=("vision_tower", "mm_projector"), text_model="DeepseekV3Model",
                        text_family="deepseek_v3", image_input=IMAGE_PATCH_ROWS,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id"),
        known_good=("5.13.0", "5.24.0"),
    ),
    Family(
        model_type="ernie4_5_vl_moe", config_class="Ernie4_5_VLMoeConfig",
        # 5.0-5.2 name the classes Ernie4_5_VL_Moe*; 5.3 renamed them and keeps the old names as aliases: the dir names
        # the ones every release has
        moe_classes=("Ernie4_5_VLMoeMoeBlock", "Ernie4_5_VL_MoeMoeBlock"),
        auto_classes={"AutoModelForImageTextToText": "Ernie4_5_VL_MoeForConditionalGeneration",
                      "AutoModel": "Ernie4_5_VL_MoeModel"},
        # a text and a vision expert set, each under its own router, beside one shared expert: both sets are split and
        # the block's one reduction covers text + vision + shared experts; moe_intermediate_size is [text, vision]
        shared_experts=("shared_experts",), expert_sets=("text_moe.experts", "vision_moe.experts"),
        routers=("text_moe.gate", "vision_moe.gate"), per_set_sizes=("moe_intermediate_size",),
        num_experts_keys=("moe_num_experts",), top_k_keys=("moe_k",), more_positive_ints=("head_dim",),
        layers=_LAYER_TYPES,
        wrapper=Wrapper(replicated=("vision_tower", "resampler_model"), image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="image_start_token_id", image_end_key="image_end_token_id",
                        token_types=True, moe_token_types=True),
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="qwen3_next", config_class="Qwen3NextConfig", moe_classes=("Qwen3NextSparseMoeBlock",),
        **_QWEN_SHARED_EXPERT, more_positive_ints=("head_dim", *_LINEAR_HEAD_KEYS), layers=_QWEN_LAYERS,
        tp_divisible_keys=(*_QWEN_HYBRID_TP, "intermediate_size"), attention_attrs=("self_attn", _QWEN_LINEAR_ATTN),
        # in_proj_qkvz rows: per key head [q, k, v (its value heads), z (its value heads)]; in_proj_ba: [b, a]
        linear_attention=LinearAttention(attr=_QWEN_LINEAR_ATTN, projections=(("in_proj_qkvz", ()),
                                                                              ("in_proj_ba", ()))),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="qwen3_5_moe", config_class="Qwen3_5MoeConfig", **_QWEN3_5_DECODER,
        auto_classes={"AutoModelForImageTextToText": "Qwen3_5MoeForConditionalGeneration",
                      "AutoModelForCausalLM": "Qwen3_5MoeForCausalLM", "AutoModel": "Qwen3_5MoeModel"},
        wrapper=Wrapper(replicated=("visual",), text_model="Qwen3_5MoeTextModel", image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        token_types=True, causal_lm="Qwen3_5MoeForCausalLM"),
    ),
    # text-only Qwen3.5 MoE checkpoints (the wrapper's decoder saved alone): the same module, no vision tower
    Family(
        model_type="qwen3_5_moe_text", config_class="Qwen3_5MoeTextConfig", **_QWEN3_5_DECODER,
        builtin_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        auto_classes={"AutoModelForCausalLM": "Qwen3_5MoeForCausalLM", "AutoModel": "Qwen3_5MoeTextModel"},
    ),
    Family(
        # Qwen3.5's decoder (gated delta-net as data, the full-attention q_proj's rows [q | gate] per head) plus
        # hyper-connections (a gated residual over hc_count streams, low-rank nn.Linears), per-layer n-gram
        # embeddings (PLE) and a QSA indexer: those three whole on every rank, no collective
        model_type="qwen4_exp", config_class="Qwen4ExpConfig", moe_classes=("Qwen4ExpTextSparseMoeBlock",),
        **_QWEN_SHARED_EXPERT, more_positive_ints=("head_dim", *_LINEAR_HEAD_KEYS),
        tp_divisible_keys=_QWEN_HYBRID_TP, attention_attrs=("self_attn", _QWEN_LINEAR_ATTN),
        linear_attention=_QWEN3_5_GATED_DELTA_NET, attention_replicated=("indexer",),
        whole_modules=("Qwen4ExpTextGatedResidual", "Qwen4ExpTextPLELayer"),
        auto_classes={"AutoModelForImageTextToText": "Qwen4ExpForConditionalGeneration",
                      "AutoModelForCausalLM": "Qwen4ExpForCausalLM", "AutoModel": "Qwen4ExpModel"},
        wrapper=Wrapper(replicated=("visual",), text_model="Qwen4ExpTextModel", image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        token_types=True, causal_lm="Qwen4ExpForCausalLM"),
        known_good=("5.16.0", "5.24.0"),
    ),
    Family(
        model_type="granitemoe", config_class="GraniteMoeConfig", moe_classes=("GraniteMoeMoE",), **_GRANITE_MOE,
        tp_divisible_keys=_DENSE_WIDTH_TP, known_good=("4.45.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="granitemoeshared", config_class="GraniteMoeSharedConfig", moe_classes=("GraniteMoeSharedMoE",),
        **_GRANITE_MOE, tp_divisible_keys=_DENSE_WIDTH_TP,
        # the shared MLP is added in the decoder layer, after the MoE block's reduction: whole on every rank, so
        # routed (reduced once) + shared (whole) is exact; its input_linear packs gate|up rows, which AutoTP would cut
        whole_modules=("GraniteMoeSharedMLP",),
        known_good=("4.49.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="granitemoe_swa", config_class="GraniteMoeSWAConfig", moe_classes=("GraniteMoeSWAMoE",),
        routers=("router",), num_experts_keys=("num_local_experts",),
        more_positive_ints=("intermediate_size", "shared_intermediate_size"), moe_block_attrs=("block_sparse_moe",),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
        # granitemoeshared's decoder layer: the shared MLP (its input_linear packs gate|up rows) is added there, after
        # the MoE block's reduction, whole on every rank; the attention sinks, one per head, cut with the heads
        whole_modules=("GraniteMoeSWAMLP",), attention_head_params=("sinks",),
        known_good=("5.15.0", "5.24.0"),
    ),
    Family(
        model_type="dbrx", config_class="DbrxConfig", moe_classes=("DbrxFFN",),
        # flat [E*I, H] w1 (gate), v1 (up), w2 (down) one module down; 4.x keeps the width on that module
        fused=FusedExperts(kind=FUSED_FLAT_ROWS, gate_up="mlp.w1", up="mlp.v1", down="mlp.w2",
                           size_attr="ffn_hidden_size"),
        legacy=Legacy(fused=FusedExperts(kind=FUSED_FLAT_ROWS, gate_up="mlp.w1", up="mlp.v1", down="mlp.w2",
                                         size_attr="mlp.ffn_hidden_size")),
        routers=("router",), num_experts_keys=("moe_num_experts",), top_k_keys=("moe_top_k",),
        nested_sizes=("ffn_config", "attn_config"), more_positive_ints=("d_model", "n_heads", "n_layers",
                                                                         "ffn_hidden_size", "kv_n_heads"),
        # Wqkv packs q (all heads) | k | v (kv heads) and the forward splits it by the global widths: no exact head
        # split under AutoTP, so attention stays whole on every rank (its 4.x SDPA / flash subclasses too)
        whole_modules=("DbrxAttention", "DbrxSdpaAttention", "DbrxFlashAttention2"), tp_divisible_keys=("ffn_hidden_size",),
        attention_attrs=("norm_attn_norm",), moe_block_attrs=("ffn",), layers=MoELayers(count="n_layers"),
        known_good=("4.40.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="granitemoehybrid", config_class="GraniteMoeHybridConfig", moe_classes=("GraniteMoeHybridMoE",),
        **_GRANITE_MOE, tp_divisible_keys=_DENSE_WIDTH_TP, attention_attrs=("self_attn", "mamba"),
        # Mamba-2 with n_groups B/C groups and a gated norm over all heads: whole on every rank, its conv and SSM
        # caches whole; the shared MLP, added in the decoder layer after the MoE block's reduction, whole as well
        whole_modules=("GraniteMoeHybridMambaLayer", "GraniteMoeHybridMLP"),
        known_good=("4.52.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="llama4", config_class="Llama4Config", moe_classes=("Llama4TextMoe",),
        # transformers maps `llama4` to the wrapper for AutoModel too (there is no Llama4Model)
        auto_classes={"AutoModelForImageTextToText": "Llama4ForConditionalGeneration",
                      "AutoModelForCausalLM": "Llama4ForCausalLM", "AutoModel": "Llama4ForConditionalGeneration"},
        # every generation ships fused experts: gate_up [E, H, 2I] (gate columns, then up columns), down [E, I, H]
        fused=_LLAMA4_EXPERTS, legacy=Legacy(fused=_LLAMA4_EXPERTS),
        # `out = self.shared_expert(x)`, then `out.add_(routed)`; the router is an nn.Linear subclass
        shared_experts=("shared_expert",), routers=("router",), anchor=ANCHOR_SHARED_INPLACE_SUM,
        num_experts_keys=("num_local_experts",), moe_block_attrs=("feed_forward",),
        more_positive_ints=("intermediate_size", "intermediate_size_mlp", "head_dim"),
        # experts and the shared expert are `intermediate_size` wide, the dense layers' MLP `intermediate_size_mlp`
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size", "intermediate_size_mlp"),
        layers=MoELayers(sparse_step="interleave_moe_layer_step", moe_list="moe_layers"),
        # the wrapper's forward reads `image_outputs` its text model no longer returns (5.x): text runs as the causal LM
        wrapper=Wrapper(replicated=("vision_model", "multi_modal_projector"), causal_lm="Llama4ForCausalLM",
                        runs_as_causal_lm=True),
        known_good=("4.51.0", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="gemma4", config_class="Gemma4Config",
        # the routed experts and their router sit in the decoder layer beside its attention and a dense MLP, each of
        # MLP and experts normed before their sum: the MoE block is the decoder layer, whose attention and dense MLP
        # reduce on their own; the routed experts' output is reduced right where it is computed, before its norm
        moe_classes=("Gemma4TextDecoderLayer",), anchor=ANCHOR_ROUTED_STATEMENT, block_reductions=("self_attn", "mlp"),
        # transformers loads `gemma4` checkpoints with the wrapper under the causal-LM auto class too
        auto_classes={"AutoModelForImageTextToText": "Gemma4ForConditionalGeneration",
                      "AutoModelForCausalLM": "Gemma4ForConditionalGeneration", "AutoModel": "Gemma4Model"},
        # the router (a norm, a scale and an nn.Linear `proj`, which stock AutoTP column-splits) stays whole
        routers=("router",), num_experts_keys=("num_experts",), top_k_keys=("top_k_experts",),
        more_positive_ints=("intermediate_size", "head_dim", "global_head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "num_global_key_value_heads",
                           "moe_intermediate_size", "intermediate_size"),
        wrapper=Wrapper(replicated=("vision_tower", "embed_vision", "audio_tower", "embed_audio"),
                        text_model="Gemma4TextModel", image_input=IMAGE_POSITIONED_PATCHES,
                        image_start_key="boi_token_id", image_end_key="eoi_token_id"),
        known_good=("5.5.0", "5.24.0"),
    ),
    Family(
        model_type="mistral_large4", config_class="MistralLarge4Config", moe_classes=("MistralLarge4TextMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=(*_GROUPS, "head_dim"),
        # MLA without a q LoRA (its latent input kv_a_proj_with_mqa whole) and a DSA indexer, whole on every rank
        **_LATENT_DSA, layers=_FIRST_DENSE,
        # the attention's per-head query scaling (log-position scale and bias per head): cut with the heads
        attention_head_params=("softmax_scaling.scale", "softmax_scaling.bias"),
        wrapper=Wrapper(replicated=("vision_tower", "multi_modal_projector"), text_model="MistralLarge4TextModel",
                        image_input=IMAGE_SIZED),
        known_good=("5.22.0", "5.24.0"),
    ),
    Family(
        model_type="minimax", config_class="MiniMaxConfig", moe_classes=("MiniMaxSparseMoeBlock",),
        per_expert=_W1_W3_W2, moe_block_attrs=("mlp", "block_sparse_moe"),
        num_experts_keys=("num_local_experts",), more_positive_ints=("intermediate_size", "head_dim", "block_size"),
        tp_divisible_keys=_DENSE_WIDTH_TP,
        # lightning attention layers: an RMSNorm over all heads, per-head decay from the global head count; the
        # full-attention layers split by heads
        whole_modules=("MiniMaxLightningAttention",),
        known_good=("4.53.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="jamba", config_class="JambaConfig", moe_classes=("JambaSparseMoeBlock",), routers=("router",),
        moe_block_attrs=("feed_forward",), num_experts_keys=("num_experts",), more_positive_ints=("intermediate_size",),
        tp_divisible_keys=_DENSE_WIDTH_TP, attention_attrs=("self_attn", "mamba"),
        # the Mamba-1 mixer: x_proj reads every channel of the conv output, so no channel split is exact without
        # another reduction; the attention layers split by heads
        whole_modules=("JambaMambaMixer",),
        layers=MoELayers(freq="expert_layer_period", offset="expert_layer_offset"),
        known_good=("4.40.0", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="kimi_linear", config_class="KimiLinearConfig", moe_classes=("KimiLinearMoE",),
        shared_experts=("shared_experts",), num_experts_keys=("num_experts", "num_local_experts"),
        top_k_keys=("num_experts_per_token", "num_experts_per_tok"), **_LATENT_MLA, layers=_LAYER_TYPES,
        # Kimi delta attention (its linear layers): per-head short convolutions, a forget gate and a norm within the
        # heads, under the `self_attn` of the MLA layers; the MLA layers split by heads
        whole_modules=("KimiLinearDeltaAttention",),
        known_good=("5.17.0", "5.24.0"),
    ),
    Family(
        model_type="glm5_next", config_class="Glm5NextConfig", moe_classes=("Glm5NextTextMoE",),
        **_DEEPSEEK_MOE, more_positive_ints=_GROUPS, **_LATENT_DSA, layers=_LAYER_TYPES,
        # Kimi delta attention (its linear layers) whole; the MLA/DSA layers split by heads, their indexer whole; the
        # hyper-connections hold no linear DeepSpeed shards
        whole_modules=("Glm5NextTextLinearAttention",),
        wrapper=Wrapper(replicated=("visual",), image_input=IMAGE_FLAT_PATCHES, image_start_key="image_start_token_id",
                        image_end_key="image_end_token_id", token_types=True),
        known_good=("5.17.0", "5.24.0"),
    ),
    Family(
        model_type="deepseek_v4", config_class="DeepseekV4Config", moe_classes=("DeepseekV4SparseMoeBlock",),
        **_DEEPSEEK_MOE, anchor=ANCHOR_RETURNED_SUM,
        more_positive_ints=("head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult"),
        # attention stays whole: one shared KV head (MQA), grouped o_a/o_b output projections, per-head sinks, its
        # compressors and indexer; the hash and learned routers (`gate`) whole; the experts split
        tp_divisible_keys=("moe_intermediate_size",), whole_modules=("DeepseekV4Attention",),
        known_good=("5.8.0", "5.24.0"),
    ),
    Family(
        model_type="hy_v4", config_class="HYV4Config", moe_classes=("HYV4MoE",), **_DEEPSEEK_MOE,
        more_positive_ints=_GROUPS, layers=_LAYER_TYPES,
        # MLA (its low-rank inputs whole) with a DSA indexer, whole (shared layers reuse the previous one's top-k);
        # the attention output gate, one row block per head, and the sinks, one per head, cut with the heads; the
        # hyper-connections (attn_hc, ffn_hc, hc_head) hold no linear DeepSpeed shards
        attention_replicated=(*_MLA, "indexer"), attention_head_linears=("gate_proj",),
        # (sinks join the softmax inside its attention function: its decode stays expanded, not absorbed)
        attention_head_params=("sinks",),
        known_good=("5.17.0", "5.24.0"),
    ),
    Family(
        model_type="bailing_hybrid", config_class="BailingHybridConfig", moe_classes=("BailingHybridMoE",),
        shared_experts=("shared_experts",), num_experts_keys=("num_experts", "num_local_experts"),
        top_k_keys=("num_experts_per_token", "num_experts_per_tok"), more_positive_ints=("head_dim",),
        **_LATENT_MLA, layers=_LAYER_TYPES,
        # the MLA layers' output gate, one row per head
        attention_head_linears=("g_proj",),
        # Kimi-style delta attention (its linear layers) whole; the MLA layers split by heads
        whole_modules=("BailingHybridDeltaAttention",),
        known_good=("5.20.0", "5.24.0"),
    ),
    Family(
        model_type="lfm2_moe", config_class="Lfm2MoeConfig", moe_classes=("Lfm2MoeSparseMoeBlock",),
        # the dense MLPs' names (w1, w3, w2)
        per_expert=_W1_W3_W2, moe_block_attrs=("feed_forward",), num_experts_keys=("num_experts",),
        more_positive_ints=("intermediate_size",),
        attention_attrs=("self_attn", "conv"),
        # the gated short-convolution mixer whole; the attention layers split by heads
        whole_modules=("Lfm2MoeShortConv",), layers=MoELayers(first_dense="num_dense_layers"),
        known_good=("5.0.0", "5.24.0"),
    ),
    Family(
        model_type="longcat_flash", config_class="LongcatFlashConfig", moe_classes=("LongcatFlashMoE",),
        # the router holds an nn.Linear `classifier` (over routed + zero-compute experts) that stock AutoTP splits
        routers=("router",), num_experts_keys=("n_routed_experts",), top_k_keys=("moe_topk",),
        # 5.x: gate_up [E + Z, 2I, H] (rows for the zero-compute experts too, never read), down [E, H, I]
        fused=FusedExperts(size_attr="intermediate_size"),
        # the zero-compute experts add the token itself (5.x: `identity_expert`; 4.x: ModuleList entries)
        identity_experts=("Identity",),
        more_positive_ints=("num_layers", "ffn_hidden_size", "expert_ffn_hidden_size"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "expert_ffn_hidden_size", "ffn_hidden_size"),
        # each layer: two MLA sublayers (`self_attn`, a ModuleList; their low-rank inputs whole), two dense MLPs
        # (`mlps`) and the shortcut MoE (`mlp`), added after the second MLP
        **_LATENT_MLA, dense_mlp_attrs=("mlps",), sublayers=2, layers=MoELayers(count="num_layers"),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
    Family(
        model_type="nemotron_h", config_class="NemotronHConfig", **_NEMOTRON_H,
        known_good=("5.3.0", "5.24.0"),
    ),
    Family(
        model_type="mellum", config_class="MellumConfig", moe_classes=("MellumSparseMoeBlock",),
        num_experts_keys=("num_experts", "num_local_experts"), more_positive_ints=("head_dim",), layers=_LAYER_TYPES,
        known_good=("5.11.0", "5.24.0"),
    ),
    Family(
        model_type="kolibri1", config_class="Kolibri1Config", moe_classes=("Kolibri1SparseMoeBlock",),
        # Qwen3-MoE's config: it writes num_local_experts
        shared_experts=("shared_experts",), num_experts_keys=("num_experts", "num_local_experts"),
        more_positive_ints=("head_dim",),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                           "shared_expert_intermediate_size"),
        known_good=("5.20.0", "5.24.0"),
    ),
    Family(
        model_type="flint", config_class="FlintConfig", moe_classes=("FlintSparseMoeBlock",),
        shared_experts=("shared_expert",), num_experts_keys=("num_experts",), more_positive_ints=("head_dim",),
        tp_divisible_keys=(*HEADS_AND_WIDTHS, "shared_expert_intermediate_size"),
        # attention sinks, one per head
        attention_head_params=("sinks",), layers=_QWEN_LAYERS,
        known_good=("5.21.0", "5.24.0"),
    ),
    Family(
        model_type="beam", config_class="BeamConfig", moe_classes=("BeamMoE",), num_experts_keys=("num_experts",),
        more_positive_ints=(*_GROUPS, "head_dim"),
        # the attention output gate, one row block and one bias per head
        attention_head_linears=("gate_proj",), attention_head_params=("gate_bias",), layers=_LAYER_TYPES,
        known_good=("5.21.0", "5.24.0"),
    ),
    Family(
        model_type="hy_v3", config_class="HYV3Config", moe_classes=("HYV3MoE",), shared_experts=("shared_experts",),
        num_experts_keys=("num_experts", "num_local_experts"), more_positive_ints=("head_dim",), layers=_LAYER_TYPES,
        known_good=("5.6.0", "5.24.0"),
    ),
    Family(
        model_type="laguna", config_class="LagunaConfig", moe_classes=("LagunaSparseMoeBlock",),
        shared_experts=("shared_experts",), num_experts_keys=("num_experts",), more_positive_ints=("head_dim",),
        tp_divisible_keys=(*HEADS_AND_WIDTHS, "shared_expert_intermediate_size"),
        # the attention output gate (softplus), one row (or one head_dim block) per head. Its per-layer head counts
        # (`num_attention_heads_per_layer`, a list) are not among the sizes checked to divide by tp
        attention_head_linears=("g_proj",), layers=_LAYER_TYPES,
        known_good=("5.7.0", "5.24.0"),
    ),
    Family(
        model_type="axk1", config_class="AXK1Config", moe_classes=("AXK1MoE",), **_DEEPSEEK_MOE,
        more_positive_ints=_GROUPS, **_LATENT_MLA, layers=_LAYER_TYPES,
        known_good=("5.15.0", "5.24.0"),
    ),
    Family(
        model_type="cohere2_moe", config_class="Cohere2MoeConfig", moe_classes=("Cohere2MoeSparseMoeBlock",),
        shared_experts=("shared_experts",), num_experts_keys=("num_experts",),
        more_positive_ints=("intermediate_size", "head_dim"),
        tp_divisible_keys=(*_DENSE_WIDTH_TP, "prefix_dense_intermediate_size"), layers=_LAYER_TYPES,
        known_good=("5.9.0", "5.24.0"),
    ),
    Family(
        model_type="axk2", config_class="AXK2Config", moe_classes=("AXK2MoE",), **_DEEPSEEK_MOE,
        more_positive_ints=("gated_norm_rank",),
        # MLA without q_b_proj, its latent inputs and DSA indexer whole; q_gate_proj's rows are per head ([q | gate]
        # each), which DeepSpeed would cut in grain-sized steps (its name holds `gate_proj`): cut by the heads instead
        **_LATENT_DSA, attention_head_linears=("q_gate_proj",), layers=_LAYER_TYPES,
        # the decoder layer's gated RMSNorms (a low-rank fc1/fc2 gate over the whole hidden state) whole
        whole_modules=("AXK2GatedRMSNorm",),
        known_good=("5.15.0", "5.24.0"),
    ),
    Family(
        model_type="lara_mini", config_class="LaraMiniConfig", moe_classes=("LaraMiniSparseMoeBlock",),
        # Flint's MoE block: one shared expert, added without a gate
        shared_experts=("shared_expert",), num_experts_keys=("num_experts",),
        more_positive_ints=("head_dim", *_LINEAR_HEAD_KEYS), tp_divisible_keys=_QWEN_HYBRID_TP,
        attention_attrs=("self_attn", _QWEN_LINEAR_ATTN), linear_attention=_QWEN3_5_GATED_DELTA_NET,
        known_good=("5.24.0",),
    ),
    Family(
        # Nemotron 3 Omni: a RADIO vision tower (and a Parakeet audio tower) with their projectors, whole on every
        # rank, over a Nemotron-H causal LM the wrapper builds with `AutoModelForCausalLM.from_config`, sharded.
        # Text only: its image input is flat patches with an (h, w) `image_grid_hw`, which no image kind feeds yet
        model_type="nemotron_h_omni", config_class="NemotronH_Omni_Reasoning_V3_Config",
        # one class, no `*Model` of its own: transformers maps the type as image-text-to-text only
        auto_classes={"AutoModelForImageTextToText": "NemotronH_Omni_Reasoning_V3"},
        **_NEMOTRON_H,
        wrapper=Wrapper(replicated=("vision_model", "vision_final_layernorm", "multi_modal_projector", "audio_tower",
                                    "embed_audio"),
                        text_model="NemotronHForCausalLM", text_family="nemotron_h"),
        known_good=("5.18.0", "5.24.0"),
    ),
    Family(
        # Qwen3-Omni: the wrapper has no forward; its text model `thinker` (audio and vision towers, a Qwen3-MoE
        # decoder) runs and is sharded; the talker (a second MoE, with a shared expert) and code2wav stay whole
        model_type="qwen3_omni_moe", config_class="Qwen3OmniMoeConfig",
        moe_classes=("Qwen3OmniMoeThinkerTextSparseMoeBlock",), num_experts_keys=("num_experts",),
        more_positive_ints=("head_dim",), layers=_QWEN_LAYERS,
        # no image-text-to-text class: transformers 5.x maps it as a multimodal LM, 4.x as text-to-waveform only
        auto_classes={"AutoModelForMultimodalLM": "Qwen3OmniMoeForConditionalGeneration",
                      "AutoModelForTextToWaveform": "Qwen3OmniMoeForConditionalGeneration"},
        wrapper=Wrapper(replicated=("audio_tower", "visual"), image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        text_submodule="thinker", submodule_config="thinker_config"),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
    ),
)

#: model types that are another family's architecture under another name
ALIASES: dict[str, Alias] = {
    # Kimi-K2 checkpoints ship DeepSeek-V3 remote code (`modeling_deepseek.py`, `DeepseekV3ForCausalLM`)
    "kimi_k2": Alias(family="deepseek_v3", remote_module="modeling_deepseek"),
}
