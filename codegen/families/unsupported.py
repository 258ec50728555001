"""The MoE model types of transformers (and the hub) that `patch` refuses, each with the one line that says why (the
README's support table lists them)."""

from __future__ import annotations

from dataclasses import dataclass

#: what the support table says of an MoE model type of transformers that codegen does not patch
NOT_YET = "not yet"
REFUSED = "refused"


@dataclass(frozen=True)
class Unsupported:
    """An MoE model type `patch` refuses, and the one line that says why."""

    status: str
    why: str


UNSUPPORTED: dict[str, Unsupported] = {
    # the other hybrids (survey of their 5.24 sources): which the linear-attention kind covers, which need another
    **{t: Unsupported(NOT_YET, "attention with per-head short convolutions and nested projections: needs an "
                               "attention kind")
       # the model types their config.json files carry (the folders are inkling, inkling2, inkling2_loop)
       for t in ("inkling_mm_model", "inkling_text", "inkling2", "inkling2_text", "inkling2_loop",
                 "inkling2_loop_text")},
    "zaya": Unsupported(NOT_YET, "CCA attention (grouped conv, key residual averaged over a group's query heads): "
                                 "needs its own kind, exact only up to tp = num_key_value_heads"),
    "hy_v4_vl": Unsupported(NOT_YET, "a multimodal wrapper over hy_v4's decoder (supported as text): the wrapper's "
                                     "row is not verified yet"),
    "minimax_m3_vl": Unsupported(NOT_YET, "its block-sparse indexer's attention mask holds one block selection per "
                                          "KV group, repeated to every query head: it must be cut with the heads "
                                          "(needs an indexer kind)"),
    "muse_spark": Unsupported(NOT_YET, "a multimodal wrapper over a text MoE, not verified yet"),
    "aria": Unsupported(NOT_YET, "transformers 4.48-5.17 keep its experts as `fc1`/`fc2` modules, an expert layout "
                                 "not written yet (5.18's fused experts verify as a row of existing kinds)"),
    "deepseek_ocr2": Unsupported(NOT_YET, "a SAM + Qwen2 vision tower over its own DeepSeek-V2-style MoE decoder "
                                          "(DeepseekOcr2TextMoe, in the wrapper's module): a row not verified yet"),
    "unlimited_ocr": Unsupported(NOT_YET, "DeepSeek-OCR-2's wrapper and MoE decoder with a reference sliding-window "
                                          "cache of its own: a row not verified yet"),
    "dots3_note": Unsupported(NOT_YET, "vision and audio towers over its own MLA + DSA-indexer MoE decoder (rescaled "
                                       "q/kv latents): a row not verified yet"),
    "jetmoe": Unsupported(REFUSED, "mixture of attention heads: its routed attention experts cannot be sharded "
                                   "by heads"),
    "doge": Unsupported(REFUSED, "experts are embedding rows and dt_proj mixes every kv head: no head or expert "
                                 "split is exact"),
    **{t: Unsupported(REFUSED, "an encoder-decoder or vision MoE, not a causal LM codegen serves") for t in (
        "switch_transformers", "nllb_moe", "vitpose_backbone")},
    "diffusion_gemma": Unsupported(REFUSED, "a diffusion language model, not a causal LM codegen serves"),
    "openai_privacy_filter": Unsupported(REFUSED, "a token classifier, not a causal LM codegen serves"),
}
