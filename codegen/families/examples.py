"""Each family's example checkpoints, by model type: test, demo and bench data, kept beside the family table (none of
it shapes a patched dir; codegen.harness.examples builds the checkpoints with random weights)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Example shapes at the published widths keep two decoder layers and a small vocabulary (positions cost nothing:
#: rotary tables are computed per call); per-layer lists are cut to the layers kept
FULL_WIDTH_CAPS = dict(num_hidden_layers=2, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False)
#: routing switches a full-width example takes from the published config besides the keys of its tiny example
PUBLISHED_ROUTING_KEYS = ("norm_topk_prob",)


@dataclass(frozen=True)
class Examples:
    """A family's example checkpoints (codegen.harness.examples builds them with random weights).

    `tiny`: what tests and the demo use (a few KB); `toy`: the bench's scaled-down shape of a real checkpoint's
    routing, which the bench and README call `bench_label`; the full-width shape is derived from `published`, the
    project's copy of a real checkpoint's config (codegen/harness/published/), with two decoder layers and a small
    vocabulary (FULL_WIDTH_CAPS), then `full_overrides`. A multimodal wrapper's `tiny` is its text config; `vision`
    its tiny vision tower, `wrapper` the wrapper's own keys (image token ids inside the tiny vocabulary); a wrapper
    run through a text submodule nests them (and `audio`, `submodule`) in that submodule's config.
    """

    tiny: dict
    toy: dict | None = None
    bench_label: str = ""
    published: str = ""
    full_overrides: dict = field(default_factory=dict)
    vision: dict | None = None
    wrapper: dict = field(default_factory=dict)
    #: a tiny audio tower (`audio_config`, beside `vision`), where the wrapper has one
    audio: dict | None = None
    #: a wrapper run through a text submodule (`Wrapper.submodule_config`): that config's own keys beside its text,
    #: vision and audio configs (the image token ids); `wrapper` then holds the other top-level configs
    submodule: dict = field(default_factory=dict)
    #: tiny keys a transformers 4.x config spells otherwise (replacing the same keys of `tiny` there)
    tiny_legacy: dict = field(default_factory=dict)
    #: decoder layers of `tiny` whose token mixer the row keeps whole (`Family.whole_modules`): no all-reduce each
    whole_mixers: int = 0
    #: single-mixer blocks of `tiny` that are a dense MLP (`Family.single_mixer_blocks`: each block is one unit)
    dense_mixers: int = 0


#: tiny sizes every example shares
_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)
#: tiny MLA attention (DeepSeek-V2/V3 style), shared by the tiny examples of the MLA families
_TINY_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                 qk_nope_head_dim=16)
#: the tiny DeepSeek-V3 style MoE (8 routed experts, 1 shared, top-2)
_TINY_V3_MOE = dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, n_group=1, topk_group=1)
#: a tiny image's placeholder and delimiter tokens: the last ids of the tiny vocabulary
_TINY_IMAGE_TOKENS = dict(image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)
#: a tiny Qwen hybrid: a linear-attention layer, then a full-attention one; 2 value heads per key head
_TINY_QWEN_HYBRID = dict(head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention"])
#: a tiny DSA indexer (DeepSeek-V3.2 style)
_TINY_INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=2)

EXAMPLES: dict[str, Examples] = {
    "qwen2_moe": Examples(
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
        bench_label="Qwen1.5-MoE-A2.7B-like",
        published="qwen1.5-moe-a2.7b.json",
    ),
    "deepseek_v2": Examples(
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
        bench_label="DeepSeek-V2-Lite-like",
        published="deepseek-v2-lite.json",
    ),
    "qwen3_moe": Examples(
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
        bench_label="Qwen3-30B-A3B-like",
        published="qwen3-30b-a3b.json",
    ),
    "mixtral": Examples(
        tiny=dict(
            vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        bench_label="Mixtral-8x7B-like",
    ),
    "deepseek_v3": Examples(
        tiny=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        bench_label="DeepSeek-V3-like",
    ),
    "glm4_moe": Examples(
        tiny=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        bench_label="GLM-4.5-Air-like",
    ),
    "gpt_oss": Examples(
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
        bench_label="gpt-oss-20b-like",
        published="gpt-oss-20b.json",
        full_overrides=dict(max_position_embeddings=131072),  # = the default YaRN factor x 4096
    ),
    "glm4_moe_lite": Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"])),
    "deepseek_v32": Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"],
                                       **_TINY_INDEXER)),
    "glm_moe_dsa": Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"],
                                      **_TINY_INDEXER, indexer_types=["full", "full"])),
    "mistral4": Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, first_k_dense_replace=0, head_dim=24)),
    "ernie4_5_moe": Examples(tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                       moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1)),
    "dots1": Examples(tiny=dict(_TINY, **_TINY_V3_MOE, head_dim=16, first_k_dense_replace=1,
                                layer_types=["full_attention", "full_attention"])),
    "exaone_moe": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                     num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, head_dim=16,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     mlp_layer_types=["dense", "sparse"], bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)),
    "solar_open": Examples(tiny=dict(_TINY, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                     num_experts_per_tok=2, n_group=1, topk_group=1, head_dim=16)),
    "phimoe": Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    "afmoe": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, head_dim=16,
                                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                global_attn_every_n_layers=2)),
    "hunyuan_v1_moe": Examples(tiny=dict(_TINY, num_key_value_heads=4, head_dim=16, intermediate_size=32,
                                         num_experts=8, moe_topk=2, num_shared_expert=1)),
    "mimo_v2_flash": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=1, topk_group=1, head_dim=16, v_head_dim=16,
                                        sliding_window=8, layer_types=["full_attention", "sliding_attention"],
                                        mlp_layer_types=["dense", "sparse"])),
    "olmoe": Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "flex_olmo": Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                                    eos_token_id=1)),
    "minimax_m2": Examples(tiny=dict(_TINY, head_dim=16, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2)),
    "step3p7": Examples(
        tiny=dict(_TINY, model_type="step3p5", intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, share_expert_dim=32, head_dim=16,
                  num_sliding_attention_heads=4, query_pre_attn_scalar=16, mlp_layer_types=["dense", "sparse"],
                  layer_types=["sliding_attention", "full_attention"], sliding_window=8, pad_token_id=0),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    image_size=56, patch_size=14, max_position_embeddings=16),
        wrapper=dict(image_token_id=250),
    ),
    "qwen3_vl_moe": Examples(
        # 2 * moe_intermediate_size != hidden_size: transformers 5.x's loader tells the two expert layouts
        # apart by shape
        tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, deepstack_visual_indexes=[0], patch_size=8),
        wrapper=dict(_TINY_IMAGE_TOKENS),
    ),
    "glm4v_moe": Examples(
        tiny=dict(_TINY, **_TINY_V3_MOE, head_dim=16, first_k_dense_replace=1, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
            "partial_rotary_factor": 0.5}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    image_size=56, patch_size=14),
        wrapper=dict(image_token_id=250, image_start_token_id=251, image_end_token_id=252, video_token_id=253,
                     video_start_token_id=254, video_end_token_id=255),
    ),
    "kimi_k25": Examples(
        # q_lora_rank set (as in Kimi K2.5): with None, transformers 5.24 saves the text q_proj as
        # `self_wqkv` (its vision `wqkv` rename) and cannot load the dir back
        tiny={**_TINY, **_TINY_MLA, **_TINY_V3_MOE, "model_type": "deepseek_v3", "first_k_dense_replace": 1,
              "n_group": 2},
        vision=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
        wrapper=dict(_TINY_IMAGE_TOKENS, projection_hidden_size=32),
    ),
    "ernie4_5_vl_moe": Examples(
        # [text, vision] expert widths; the first layer dense
        tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=[32, 16], moe_num_experts=8, moe_k=2,
                  moe_num_shared_experts=1, mlp_layer_types=["dense", "sparse"], rope_parameters={
                      "rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14),
        wrapper=dict(image_token_id=250, image_start_token_id=251, image_end_token_id=252, video_token_id=253,
                     video_start_token_id=254, video_end_token_id=255),
    ),
    "qwen3_next": Examples(tiny=dict(_TINY, **_TINY_QWEN_HYBRID, intermediate_size=128)),
    "qwen3_5_moe": Examples(
        tiny=dict(_TINY, **_TINY_QWEN_HYBRID),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, patch_size=8),
        wrapper=dict(_TINY_IMAGE_TOKENS),
    ),
    "qwen3_5_moe_text": Examples(
        tiny=dict(_TINY, **_TINY_QWEN_HYBRID),
        # the bench's: 2 layers, one linear-attention then one full-attention (the published model has 3 of the
        # first per 1 of the second)
        toy=dict(vocab_size=4096, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, max_position_embeddings=1024,
                 layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False),
        bench_label="Qwen3.5-35B-A3B-like",
        published="qwen3.5-35b-a3b.json",
        # 2 kv heads, as published: tp 2 only at full widths
        full_overrides=dict(layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024),
    ),
    # Qwen4-Exp as mk_tiny.py builds it (4 key heads, not 2, so that tp 4 splits them too): a linear-attention layer,
    # then an indexed-attention one; the first layer's PLE reads the n-gram embeddings; four hyper-connection streams
    "qwen4_exp": Examples(
        tiny=dict(_TINY, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                  linear_num_value_heads=8, layer_types=["linear_attention", "indexed_attention"], hc_count=4,
                  hc_lowrank=16, ple_layer_ids=[1], ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=64,
                  make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2, indexer_n_heads=2, indexer_kv_heads=1,
                  indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2, eos_token_id=2),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, patch_size=8),
        wrapper=dict(_TINY_IMAGE_TOKENS),
    ),
    "granitemoe": Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoeshared": Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                           shared_intermediate_size=64)),
    "granitemoe_swa": Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                         shared_intermediate_size=64, sliding_window=8,
                                         layer_types=["full_attention", "sliding_attention"])),
    # DBRX names its sizes its own way (d_model, n_layers, n_heads) and nests them (attn_config, ffn_config)
    "dbrx": Examples(tiny=dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=256,
                               tie_word_embeddings=False,
                               attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=500000.0),
                               ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2)),
                     whole_mixers=2),
    # a Mamba-2 layer, then an attention layer
    "granitemoehybrid": Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                           shared_intermediate_size=64, layer_types=["linear_attention", "full_attention"],
                                           mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=4,
                                           position_embedding_type="nope"),
                                 tiny_legacy=dict(layer_types=["mamba", "attention"]), whole_mixers=1),
    # mk_tiny's: the hub checkpoints are the vision-language wrapper; layer 0 dense, layer 1 MoE (a shared expert),
    # chunked attention then a NoPE full-attention layer
    "llama4": Examples(
        tiny=dict(_TINY, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=8, num_experts_per_tok=2,
                  head_dim=16, moe_layers=[1], interleave_moe_layer_step=2, no_rope_layers=[1, 0],
                  attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"]),
        vision=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    vision_output_dim=64, image_size=56, patch_size=14, projector_input_dim=64,
                    projector_output_dim=64),
    ),
    # mk_tiny's (Gemma 4 26B-A4B): a dense MLP beside an 8-expert MoE in every layer, K=V global layers, no per-layer
    # inputs, no audio tower
    "gemma4": Examples(
        tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, enable_moe_block=True, num_experts=8,
                  top_k_experts=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                  attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, patch_size=8, pooling_kernel_size=2,
                    position_embedding_size=64),
        wrapper=dict(image_token_id=250, boi_token_id=251, eoi_token_id=252),
    ),
    # mk_tiny's (Mistral Large 4): MLA without a q LoRA, a DSA indexer (full, then shared), NoPE on layer 1, a
    # pixtral vision tower
    "mistral_large4": Examples(
        tiny=dict(_TINY, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=4,
                  index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared"], no_rope_layers=[1, 0]),
        vision=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, head_dim=16, patch_size=14, image_size=56, hidden_act="silu"),
        wrapper=dict(image_token_id=250),
    ),
    # a lightning-attention layer, then a full-attention one (as mk_tiny.py builds it)
    "minimax": Examples(tiny=dict(_TINY, head_dim=16, intermediate_size=32, num_local_experts=8,
                                  num_experts_per_tok=2, block_size=4,
                                  layer_types=["linear_attention", "full_attention"]), whole_mixers=1),
    # a Mamba layer with a dense MLP, then an attention layer with the MoE (as mk_tiny.py builds it)
    "jamba": Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
                      whole_mixers=1),
    # a Kimi-delta-attention layer with a dense MLP, then an MLA layer with the MoE (as mk_tiny.py builds it)
    "kimi_linear": Examples(tiny=dict(_TINY, **{**_TINY_MLA, "q_lora_rank": None}, intermediate_size=128,
                                      moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                      n_shared_experts=1, n_group=1, topk_group=1, linear_num_heads=4,
                                      linear_head_dim=16, layer_types=["linear_attention", "full_attention"],
                                      mlp_layer_types=["dense", "sparse"], pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2),
                            whole_mixers=1),
    # GLM-5.3-Flash as mk_tiny.py builds it: a Kimi-delta-attention layer with a dense MLP, then a NoPE MLA/DSA layer
    # with the MoE, mHC streams
    "glm5_next": Examples(
        tiny=dict(_TINY, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0,
                  qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                  mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "indexed_attention"],
                  indexer_types=["full", "full"], index_topk=4, index_kpool=2, index_head_dim=16, index_n_heads=2,
                  linear_head_dim=16, linear_num_heads=4, hc_mult=4, pad_token_id=0),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, image_size=56,
                    patch_size=14, projection_intermediate_size=64),
        wrapper=dict(image_token_id=250, image_start_token_id=251, image_end_token_id=252, video_token_id=253,
                     video_start_token_id=254, video_end_token_id=255),
        whole_mixers=1,
    ),
    # DeepSeek-V4 as mk_tiny.py builds it: one shared KV head, mHC streams, one layer per compressor kind (HCA, CSA +
    # indexer) and per router kind (hash, learned); compress rates shrunk so an 8-token prompt compresses
    "deepseek_v4": Examples(
        tiny=dict(_TINY, num_key_value_heads=1, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, head_dim=16, q_lora_rank=32, partial_rotary_factor=0.5,
                  layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                  mlp_layer_types=["hash_moe", "moe"],
                  compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                  sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=2,
                  hc_mult=4),
        whole_mixers=2,
    ),
    # HY-V4 as mk_tiny.py builds it: MLA + DSA, a dense layer then an MoE one, the second layer reusing the first's
    # indexer top-k, four hyper-connection streams (the config's default)
    "hy_v4": Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"],
                                layer_types=["indexed_attention", "indexed_attention"], indexer_types=["full", "shared"],
                                index_topk=4, index_head_dim=16, index_n_heads=2, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2)),
    # a delta-attention layer with a dense MLP, then an MLA layer with the MoE (as mk_tiny.py builds it)
    "bailing_hybrid": Examples(tiny=dict(_TINY, **{**_TINY_MLA, "q_lora_rank": None}, intermediate_size=128,
                                         moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                         n_shared_experts=1, n_group=2, topk_group=1, head_dim=16,
                                         first_k_dense_replace=1, layer_types=["linear_attention", "full_attention"],
                                         mlp_layer_types=["dense", "sparse"], pad_token_id=0, eos_token_id=2),
                               whole_mixers=1),
    # a short-conv layer with a dense MLP, then an attention layer with the MoE (as mk_tiny.py builds it)
    "lfm2_moe": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                   num_experts_per_tok=2, num_dense_layers=1, layer_types=["conv", "full_attention"]),
                         whole_mixers=1),
    # two layers (four attention sublayers: num_hidden_layers = 2 * num_layers), 8 routed + 2 zero-compute experts
    # (as mk_tiny.py builds it)
    "longcat_flash": Examples(tiny=dict(_TINY, **_TINY_MLA, num_layers=2, num_hidden_layers=4, ffn_hidden_size=128,
                                        expert_ffn_hidden_size=32, n_routed_experts=8, moe_topk=2, zero_expert_num=2,
                                        head_dim=8)),
    # single-mixer blocks as mk_tiny.py builds them (Mamba-2, MoE, attention, MoE: "ME*E"), with a dense MLP block
    # before the last MoE ("ME*-E")
    "nemotron_h": Examples(tiny=dict(_TINY, num_hidden_layers=5,
                                     layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
                                     head_dim=16, intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
                                     moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
                                     num_experts_per_tok=2, n_group=1, topk_group=1, mamba_num_heads=8,
                                     mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=4),
                           whole_mixers=1, dense_mixers=1),
    # the new rows' tiny examples: mk_tiny.py's configs (as the hub checkpoints ship them)
    "mellum": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, head_dim=16, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"])),
    "kolibri1": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                   head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "flint": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, head_dim=16,
                                sliding_window=8, mlp_only_layers=[0], layer_types=["full_attention",
                                                                                     "sliding_attention"])),
    "beam": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                               num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"],
                               mlp_layer_types=["dense", "sparse"])),
    "hy_v3": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_shared_experts=1, head_dim=16,
                                mlp_layer_types=["dense", "sparse"])),
    # per-layer head counts (sliding 8, full 4), as mk_tiny.py builds it
    "laguna": Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                                 sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                 mlp_layer_types=["dense", "sparse"], num_attention_heads_per_layer=[8, 4])),
    "axk1": Examples(tiny=dict(_TINY, **_TINY_MLA, intermediate_size=128, moe_intermediate_size=32,
                               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                               mlp_layer_types=["dense", "sparse"], bos_token_id=1, eos_token_id=2)),
    "cohere2_moe": Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                      num_shared_experts=1, prefix_dense_intermediate_size=128, head_dim=16,
                                      sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                      mlp_layer_types=["dense", "sparse"], pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)),
    # MLA and a DSA indexer, gated RMSNorms (as mk_tiny.py builds it)
    "axk2": Examples(tiny=dict(_TINY, **_TINY_MLA, intermediate_size=128, moe_intermediate_size=32,
                               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                               mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention",
                                                                                 "indexed_attention"],
                               index_topk=4, index_head_dim=16, index_n_heads=2, gated_norm_rank=8, bos_token_id=1,
                               eos_token_id=2)),
    # one layer per mixer kind: gated-delta linear attention, sliding attention, full attention, all MoE (as mk_tiny.py
    # builds it, with the linear heads of the Qwen hybrids' examples: 4 key heads, so that 4 ranks split them)
    "lara_mini": Examples(tiny=dict(_TINY, num_hidden_layers=3, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                                    linear_num_key_heads=4, linear_num_value_heads=8, sliding_window=8,
                                    layer_types=["linear_attention", "sliding_attention", "full_attention"],
                                    eos_token_id=2)),
    "nemotron_h_omni": Examples(
        # nemotron_h's tiny decoder under a tiny RADIO vision tower (hub checkpoints also ship a Parakeet audio
        # tower, which the wrapper builds only with an `audio_config`: left out here)
        tiny=dict(_TINY, num_hidden_layers=5, layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                                  "moe"],
                  head_dim=16, intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, num_experts_per_tok=2, n_group=1,
                  topk_group=1, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=4),
        vision=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=8, image_size=32,
                    max_img_size=64, num_cls_tokens=1, num_registers=1, video_temporal_patch_size=2),
        wrapper=dict(image_token_id=250, video_token_id=251, audio_token_id=252, vision_hidden_size=32,
                     projector_hidden_size=64),
        whole_mixers=1, dense_mixers=1),
    "qwen3_omni_moe": Examples(
        # mk_tiny's shape (the hub checkpoints ship thinker + talker + code2wav): the thinker's text decoder is a
        # Qwen3-MoE one (2 MoE layers), with tiny vision and audio towers; the talker a second tiny MoE with a
        # shared expert, and a tiny code2wav, both whole on every rank
        tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3], "interleaved": True}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, deepstack_visual_indexes=[0], patch_size=8),
        # the hub's audio windows (n_window 50, n_window_infer 100): its token count per clip assumes them, so a
        # prompt holding a 100-frame clip fills 13 audio tokens
        audio=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                   output_dim=64, n_window=50, n_window_infer=100, conv_chunksize=4, downsample_hidden_size=8,
                   max_source_positions=64),
        submodule=dict(_TINY_IMAGE_TOKENS, video_token_id=253, audio_token_id=254, audio_start_token_id=255,
                       audio_end_token_id=249),
        wrapper=dict(
            talker_config=dict(
                text_config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 max_position_embeddings=128, rope_parameters={
                                     "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                     "interleaved": True}),
                code_predictor_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           num_code_groups=4, max_position_embeddings=128),
                num_code_groups=4, thinker_hidden_size=64, accept_hidden_layer=1, codec_eos_token_id=250,
                codec_nothink_id=251, codec_think_bos_id=252, codec_think_eos_id=253, codec_pad_id=254,
                codec_bos_id=255, speaker_id={"ethan": 249}, spatial_merge_size=2),
            code2wav_config=dict(codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                 intermediate_size=64, num_hidden_layers=1, num_quantizers=4, sliding_window=8,
                                 upsample_rates=[2, 2], upsampling_ratios=[2, 2], decoder_dim=32,
                                 max_position_embeddings=128)),
    ),
}
