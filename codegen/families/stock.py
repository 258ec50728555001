"""What stock DeepSpeed AutoTP does to each unpatched family, as measured, by model type: a comparison the README's
support table quotes and tests/test_verify.py checks on the pinned latest transformers, never what codegen is judged
by, and nothing that shapes a patched dir."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StockAutoTP:
    """What stock DeepSpeed AutoTP (`deepspeed.init_inference(tensor_parallel=...)`) does to the unpatched
    family, as measured (a comparison, never what codegen is judged by)."""

    #: the start of the line it crashes with on its first forward ("" = it runs)
    crash: str = ""
    #: why, in a few words (a crash, or logits it gets wrong)
    why: str = ""
    #: it runs but its logits are wrong (more than 1e-5 off one process)
    wrong: bool = False
    #: where it runs, on the tiny 2-layer example at TP=2: all-reduces per forward and the share of the routed
    #: experts' bytes each rank holds (tests/test_verify.py asserts both; the README quotes them)
    allreduces: int = 0
    experts: float = 0.0
    #: where `wrong` (or `legacy_wrong`, on 4.x): its routers are split (each rank holds fewer router bytes than
    #: codegen's whole ones); False: the routers stay whole and something else is cut wrongly (said in `why`)
    wrong_routers: bool = True
    #: it runs on the family's transformers 4.x sources but its logits are wrong there, and why ("" = as on 5.x)
    legacy_wrong: str = ""
    #: a multimodal wrapper with an image in the prompt: the start of its crash line, or its all-reduces
    image_crash: str = ""
    image_allreduces: int = 0


#: it runs, with this many all-reduces per forward, every rank holding all of the routed experts' bytes
_RUNS_3 = dict(allreduces=3, experts=1.0)
_RUNS_5 = dict(allreduces=5, experts=1.0)
#: the crash lines it meets most
_SIZES_DIFFER = "RuntimeError: The size of tensor a"
_SHAPES_DIFFER = "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
_TENSORS_DIFFER = "RuntimeError: Sizes of tensors must match"
_QK_NORM = StockAutoTP(crash=_SIZES_DIFFER, why="q/k RMSNorm spans all heads: its weight is not sharded")
_DSA_INDEXER = StockAutoTP(crash=_SHAPES_DIFFER, why="the DSA indexer's projections are sharded")
_GATED_DELTA_NET = "the linear attention's heads are cut but its head counts and conv stay whole"

STOCK_AUTOTP: dict[str, StockAutoTP] = {
    "qwen2_moe": StockAutoTP(**_RUNS_5),
    "deepseek_v2": StockAutoTP(**_RUNS_5),
    "qwen3_moe": StockAutoTP(**_RUNS_3),
    "mixtral": StockAutoTP(**_RUNS_3),
    "deepseek_v3": StockAutoTP(**_RUNS_5),
    "glm4_moe": StockAutoTP(**_RUNS_5),
    "gpt_oss": StockAutoTP(crash=_TENSORS_DIFFER, why="attention sinks are not sharded with the heads"),
    "glm4_moe_lite": StockAutoTP(**_RUNS_5),
    "deepseek_v32": _DSA_INDEXER,
    "glm_moe_dsa": _DSA_INDEXER,
    "mistral4": StockAutoTP(**_RUNS_5),
    "ernie4_5_moe": StockAutoTP(**_RUNS_5),
    "dots1": StockAutoTP(**_RUNS_5),
    "exaone_moe": StockAutoTP(**_RUNS_5),
    "solar_open": StockAutoTP(**_RUNS_5),
    "phimoe": StockAutoTP(crash=_SHAPES_DIFFER,
                          why="its nn.Linear router becomes a DeepSpeed layer: rank 1 gets 0 of its rows "
                              "(this line), rank 0 a tensor where the router returns three "
                              "(`ValueError: too many values to unpack`)"),
    "afmoe": StockAutoTP(crash=_SIZES_DIFFER, why="the attention output gate is split off the heads"),
    "hunyuan_v1_moe": StockAutoTP(why="its gate.wg router is column-split, and its v/o heads are paired as Yuan's",
                                  wrong=True, **_RUNS_5),
    "mimo_v2_flash": StockAutoTP(crash=_TENSORS_DIFFER,
                                 why="attention sinks (sliding-window layers) are not sharded with the heads"),
    "olmoe": _QK_NORM,
    "flex_olmo": _QK_NORM,
    "minimax_m2": _QK_NORM,
    "step3p7": StockAutoTP(**_RUNS_5, image_allreduces=7),
    "qwen3_vl_moe": StockAutoTP(**_RUNS_3, image_crash=_SHAPES_DIFFER),
    "glm4v_moe": StockAutoTP(**_RUNS_5, image_crash=_SHAPES_DIFFER),
    "kimi_k25": StockAutoTP(**_RUNS_5, image_crash=_SHAPES_DIFFER),
    "ernie4_5_vl_moe": StockAutoTP(**_RUNS_5, image_crash=_SHAPES_DIFFER),
    "qwen3_next": StockAutoTP(crash="RuntimeError: shape",
                              why="in_proj_qkvz cut in row halves across its per-key-head q/k/v/z groups"),
    "qwen3_5_moe": StockAutoTP(crash=_SIZES_DIFFER, why=_GATED_DELTA_NET, image_crash=_SIZES_DIFFER),
    "qwen3_5_moe_text": StockAutoTP(crash=_SIZES_DIFFER, why=_GATED_DELTA_NET),
    "qwen4_exp": StockAutoTP(crash=_SHAPES_DIFFER,
                             why="the per-layer n-gram embedding is cut, the PLE projections reading it are not"),
    "granitemoe": StockAutoTP(**_RUNS_3, legacy_wrong="on 4.x its router's nn.Linear is split (max Δlogits "
                                                      "1.5e-4)"),
    "granitemoeshared": StockAutoTP(crash=_SHAPES_DIFFER,
                                    why="the shared MLP's input_linear (gate|up rows) is cut and its output_linear "
                                        "left whole"),
    "granitemoe_swa": StockAutoTP(crash=_SIZES_DIFFER, why="attention sinks are not sharded with the heads"),
    "dbrx": StockAutoTP(crash=_SHAPES_DIFFER, why="Wqkv (q, k, v packed) is cut in contiguous rows, not by heads"),
    "granitemoehybrid": StockAutoTP(crash="RuntimeError: split_with_sizes expects split_sizes to sum exactly to",
                                    why="the Mamba-2 in_proj is cut in contiguous rows, its split sizes stay global"),
    "llama4": StockAutoTP(crash="ValueError: too many values to unpack",
                          why="its router, an nn.Linear subclass, becomes a DeepSpeed layer that returns one tensor "
                              "where the router returns two"),
    "gemma4": StockAutoTP(why="its router's nn.Linear `proj` is column-split (routing on half the scores); its "
                              "experts stay replicated", wrong=True, allreduces=5, experts=1.0,
                          image_allreduces=7),
    "mistral_large4": StockAutoTP(crash=_SIZES_DIFFER, why="the attention's per-head query scale and bias are not "
                                                          "cut with the heads, and the DSA indexer is split"),
    "minimax": StockAutoTP(crash=_SIZES_DIFFER,
                           why="lightning attention's qkv_proj is cut by heads, its per-head decay buffers are not"),
    "jamba": StockAutoTP(crash="RuntimeError: split_with_sizes expects split_sizes to sum exactly to",
                         why="the Mamba mixer's in_proj and x_proj are cut, its split sizes stay whole"),
    "kimi_linear": StockAutoTP(crash=_SHAPES_DIFFER,
                               why="Kimi delta attention's low-rank gates (f_a/f_b, g_a/g_b) are cut on both sides"),
    "glm5_next": StockAutoTP(crash=_SHAPES_DIFFER,
                             why="Kimi delta attention's low-rank gates (f_a/f_b, g_a/g_b) are cut on both sides"),
    "deepseek_v4": StockAutoTP(crash=_SIZES_DIFFER,
                               why="q_b_proj is cut by heads, the one shared KV head and the per-head sinks are not"),
    "hy_v4": _DSA_INDEXER,
    "bailing_hybrid": StockAutoTP(crash="RuntimeError: shape",
                                  why="the delta attention's projections are cut, its convolutions and head counts "
                                      "are not"),
    "lfm2_moe": StockAutoTP(crash=_SIZES_DIFFER,
                            why="the short convolution's in_proj is cut, its conv channels are not"),
    # the tiny example's rank 1 (rank 0: `index 7 ...`; acceptance's mk_tiny checkpoint: `IndexError: index 5 ...`)
    "longcat_flash": StockAutoTP(crash="RuntimeError: index 5 is out of bounds",
                                 why="its router's nn.Linear `classifier` is column-split: each rank scores 5 of the "
                                     "10 routed and zero-compute experts, then picks among all 10"),
    "nemotron_h": StockAutoTP(crash="RuntimeError: split_with_sizes expects split_sizes to sum exactly to",
                              why="the Mamba-2 in_proj is cut in contiguous rows, its split sizes stay global"),
    "mellum": StockAutoTP(**_RUNS_3),
    "kolibri1": StockAutoTP(**_RUNS_5),
    "flint": StockAutoTP(crash="RuntimeError: The expanded size of the tensor",
                         why="attention sinks are not sharded with the heads"),
    "beam": StockAutoTP(crash="RuntimeError: shape",
                        why="the attention output gate (gate_proj) is left whole while the heads are cut"),
    "hy_v3": StockAutoTP(**_RUNS_5),
    "laguna": StockAutoTP(**_RUNS_5),
    "axk1": StockAutoTP(**_RUNS_5),
    "cohere2_moe": StockAutoTP(**_RUNS_5),
    "axk2": StockAutoTP(crash=_SHAPES_DIFFER,
                        why="the gated RMSNorm's low-rank gate is cut: fc1's output rows, not fc2's input columns"),
    "lara_mini": StockAutoTP(crash=_SIZES_DIFFER, why=_GATED_DELTA_NET),
    "nemotron_h_omni": StockAutoTP(crash="RuntimeError: split_with_sizes expects split_sizes to sum exactly to",
                                   why="its Nemotron-H decoder's Mamba-2 in_proj is cut in contiguous rows, its split "
                                       "sizes stay global"),
    "qwen3_omni_moe": StockAutoTP(why="handed the whole wrapper, it cuts the thinker's q_proj at its 64-wide grain "
                                      "(rank 1 gets no query head) but k/v by heads: rank 0's queries meet half the "
                                      "kv heads; its experts stay replicated, its LM head whole",
                                  wrong=True, wrong_routers=False, allreduces=2, experts=1.0,
                                  legacy_wrong="on 4.x it reduces once per executed expert (8 per MoE layer), its "
                                               "attention cut as unevenly (max Δlogits 1.5e-2)",
                                  image_crash="RuntimeError: shape"),
}

#: what stock DeepSpeed 0.19.8 AutoTP does to the unpatched tiny checkpoint of a model type codegen does not patch
#: (TP=2, CPU, transformers 5.24.0; issue 27's measurements): `patch`'s refusal quotes it, so it never sends a user
#: to a path that crashes or is silently wrong. A type left out is not measured, and the refusal says so.
UNSUPPORTED_STOCK: dict[str, str] = {
    "aria": "runs with every routed expert replicated on every rank",
    "zaya": "crashes (`RuntimeError: split_with_sizes expects split_sizes have only non-negative entries …`)",
    "minimax_m3_vl": "crashes (`RuntimeError: shape '[2, 16, 1, 16]' is invalid for input of size 256 …`)",
    "jetmoe": "crashes (`ValueError: Unsupported activation function: silu …`)",
}
