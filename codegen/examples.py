"""Small random checkpoints in hub format, built locally (no hub access): the demo's and the tests' inputs.

`tiny` shapes keep tests fast; `bench` shapes keep the real models' routing (experts, top-k, shared
experts, dense-first layers, MLA ranks; see ../shared/reference-configs) scaled to fit a CPU.
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
    },
}


def build_example(family: str, out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """A random checkpoint saved with `save_pretrained` (hub format: per-expert weights)."""
    import torch
    import transformers

    from codegen.families import FAMILIES

    config = getattr(transformers, FAMILIES[family].config_class)(**SHAPES[size][family])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)  # non-trivial routers and experts
    model.save_pretrained(out_dir)
    return out_dir


def shape_of(directory: Path, family: str, size: str) -> dict:
    """The sizes an example of `size` sets (its integer config values), as its config.json holds them."""
    import json

    config = json.loads(Path(directory, "config.json").read_text())
    return {k: config[k] for k, v in SHAPES[size][family].items()
            if isinstance(v, int) and not isinstance(v, bool) and k in config}
