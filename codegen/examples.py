"""Small random checkpoints in hub format, built locally (no hub access): the demo's and the tests' inputs.

`tiny` shapes keep tests fast; `bench` shapes keep the real models' routing (experts, top-k, shared
experts, dense-first layers, MLA ranks; see ../shared/reference-configs) scaled to fit a CPU; `full` shapes
are the published widths of the real checkpoints with only two decoder layers and a small vocabulary, so one
layer costs what it costs in production (several GB per example in float32: build them with dtype="bfloat16").
"""

from __future__ import annotations

from pathlib import Path

SHAPES: dict[str, dict[str, dict]] = {
    "tiny": {
        "qwen2_moe": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "deepseek_v2": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, first_k_dense_replace=1, max_position_embeddings=256, topk_method="greedy",
            n_group=1, topk_group=1, tie_word_embeddings=False,
        ),
        # TP=2 divides heads, kv heads and every intermediate size; dense-first where the family has it
        "qwen3_moe": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, tie_word_embeddings=False,
        ),
        "mixtral": dict(
            vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "deepseek_v3": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "glm4_moe": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "gpt_oss": dict(
            vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=8, max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    },
    # Qwen1.5-MoE-A2.7B and DeepSeek-V2-Lite routing, scaled down (hidden >= 512, >= 4 layers)
    "bench": {
        "qwen2_moe": dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
            shared_expert_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, num_experts=60, num_experts_per_tok=4, max_position_embeddings=1024,
            norm_topk_prob=False, tie_word_embeddings=False,
        ),
        "deepseek_v2": dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
            v_head_dim=64, qk_nope_head_dim=64, first_k_dense_replace=1, max_position_embeddings=1024,
            topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, tie_word_embeddings=False,
        ),
        # Qwen3-30B-A3B routing (128 experts, top-8, no shared expert, normalised top-k; 32 q / 4 kv heads
        # scaled to 16 / 4 of head_dim 64: q width 2x hidden as published, and TP=4 divides the kv heads)
        "qwen3_moe": dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        ),
        # gpt-oss-20b routing (32 experts, top-4, expert biases, sliding/full alternating, window 128;
        # 64 q / 8 kv heads scaled to 16 / 4, head_dim 64 as published); intermediate_size is the expert width
        "gpt_oss": dict(
            vocab_size=4096, hidden_size=512, intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
            layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128,
            max_position_embeddings=131072, tie_word_embeddings=False,  # = the default YaRN factor x 4096
        ),
    },
    # Published widths, two decoder layers (DeepSeek-V2: one dense, one MoE), vocab 4096, default rope
    # (positions cost nothing: rotary tables are computed per call)
    "full": {
        # qwen1.5-moe-a2.7b.json (Qwen1.5-MoE-A2.7B)
        "qwen2_moe": dict(
            vocab_size=4096, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
            max_position_embeddings=1024, tie_word_embeddings=False,
        ),
        # deepseek-v2-lite.json (DeepSeek-V2-Lite)
        "deepseek_v2": dict(
            vocab_size=4096, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            v_head_dim=128, qk_nope_head_dim=128, first_k_dense_replace=1, max_position_embeddings=1024,
            topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, tie_word_embeddings=False,
        ),
        # qwen3-30b-a3b.json (Qwen3-30B-A3B)
        "qwen3_moe": dict(
            vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        ),
        # gpt-oss-20b.json (gpt-oss-20b, unquantized: the experts in the run dtype, not MXFP4)
        "gpt_oss": dict(
            vocab_size=4096, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
            layer_types=["sliding_attention", "full_attention"], sliding_window=128,
            max_position_embeddings=131072, tie_word_embeddings=False,  # = the default YaRN factor x 4096
        ),
    },
}

#: the dtypes `build_example` saves (torch attribute names); float32 is what tests and the demo use
DTYPES = ("float32", "bfloat16", "float16")
#: shards `save_pretrained` writes at most: bounds what a save holds in memory beside the model
#: (transformers 5.x writes one 50GB shard by default); the tiny and bench examples stay one file
MAX_SHARD_SIZE = "2GB"


def build_example(family: str, out_dir: Path, size: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """A random checkpoint saved with `save_pretrained` (hub format: per-expert weights).

    Weights are drawn in float32 (seeded) whatever `dtype` is, then cast in place one Parameter at a time:
    a bfloat16 example holds the float32 example's weights rounded, and the build never holds two copies.
    """
    import torch
    import transformers

    from codegen.families import FAMILIES

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    config = getattr(transformers, FAMILIES[family].config_class)(**SHAPES[size][family])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)  # non-trivial routers and experts
    if dtype != "float32":
        model.to(getattr(torch, dtype))  # Parameter by Parameter: the float32 storage is freed as it goes
    model.save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE)
    return out_dir


def shape_of(directory: Path, family: str, size: str) -> dict:
    """The sizes an example of `size` sets (its integer config values), as its config.json holds them."""
    import json

    config = json.loads(Path(directory, "config.json").read_text())
    return {k: config[k] for k, v in SHAPES[size][family].items()
            if isinstance(v, int) and not isinstance(v, bool) and k in config}
