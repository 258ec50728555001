"""Per-family knowledge, as data: one table a reader can scan, fed to one generic rewriter, policy and harness.

This is the only module that names a model type, a class, an attribute or a config key of a family.
The rewriter (codegen.patch.rewrite), the generated AutoTP policy (its header is rendered from
`Family.policy_layout()`), the rank worker, the examples, the bench and the tests all read from here,
so supporting a new family is a reviewed row of this table plus, at most, a new kind (anchor, expert layout,
attention rule, layer key) that every family can use. Every field drives behaviour; nothing here is only for show.
Rows that share most of another row's names are derived from it (`_like`), so a difference is one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from codegen.policy.runtime.base import FUSED_GATE_UP_HALVES_COLS, FUSED_GATE_UP_INTERLEAVED_COLS, \
    FUSED_GATE_UP_ROWS

#: The config.json key `patch` writes; the generated policy reads it. Off = stock DeepSpeed behaviour.
KNOB = "codegen_coalesce_moe_all_reduce"

#: Anchor kinds (codegen.patch.anchors): where the one reduction goes in the MoE block's forward.
#: "shared_sum": after the statement that adds the shared expert output to the routed experts' sum.
ANCHOR_SHARED_SUM = "shared_sum"
#: "routed_final": no shared expert, the routed experts' output is the block's output: after the statement
#: that completes it (transformers 5.x: `T = self.<experts>(...)`; 4.x: the per-expert loop accumulating
#: into `T` with `index_add_`), before any reshape and the return.
ANCHOR_ROUTED_FINAL = "routed_final"
#: "returned_sum": the routed + shared sum is built inside the `return` (`return routed + shared`): the
#: returned sum itself is reduced, `return _codegen_moe_all_reduce(self, routed + shared)`.
ANCHOR_RETURNED_SUM = "returned_sum"
#: "returned_routed": no shared expert, the routed experts are called inside the `return`
#: (`return self.<experts>(...).view(...)`): the returned value is reduced.
ANCHOR_RETURNED_ROUTED = "returned_routed"

#: Fused (transformers 5.x) expert layouts are named by the policy runtime, which shards each
#: (codegen.policy.runtime.base): FUSED_GATE_UP_ROWS, gate_up [E, 2I, H] (gate rows then up rows), down
#: [E, H, I]; FUSED_GATE_UP_HALVES_COLS, transposed, gate_up [E, H, 2I] (gate columns then up columns), down
#: [E, I, H]; FUSED_GATE_UP_INTERLEAVED_COLS, transposed, gate_up [E, H, 2I] with gate/up interleaved along the
#: last dim (a rank keeps whole gate/up pairs), down [E, I, H], optional biases gate_up_bias [E, 2I] (split with
#: the columns) and down_bias [E, H] (added inside every expert before the weighting: counted once over the ranks).

#: How the harness feeds a multimodal wrapper one tiny image (codegen.harness.worker.images builds it):
#: flat patch rows [t*h*w, channels * temporal_patch * patch**2] and `image_grid_thw` (Qwen-VL, GLM-4V)
IMAGE_FLAT_PATCHES = "flat_patches"
#: one RGB patch per row [t*h*w, 3, patch, patch] and `image_grid_thw` (Kimi-K2.5)
IMAGE_PATCH_ROWS = "patch_rows"
#: whole images [batch, channels, image_size, image_size] (Step3-VL)
IMAGE_WHOLE = "whole"

#: Example shapes at the published widths keep two decoder layers and a small vocabulary (positions cost nothing:
#: rotary tables are computed per call); per-layer lists are cut to the layers kept
FULL_WIDTH_CAPS = dict(num_hidden_layers=2, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False)
#: routing switches a full-width example takes from the published config besides the keys of its tiny example
PUBLISHED_ROUTING_KEYS = ("norm_topk_prob",)
#: the config key of a multimodal config that nests the text decoder's sizes
TEXT_CONFIG = "text_config"
#: the nested vision config of a multimodal config
VISION_CONFIG = "vision_config"


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
class Legacy:
    """What transformers 4.x sources of a family name differently from 5.x ones (None: the same)."""

    #: the fused expert layout of 4.x sources (same Parameter names, another shape)
    fused: FusedExperts | None = None
    #: the router attributes of 4.x sources
    routers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class MoELayers:
    """Which decoder layers hold an MoE block: the config keys the family's decoder layer reads (`patch` refuses
    a config that leaves none). A layer is MoE when every key present agrees; `types`, when present, alone decides.
    """

    #: the layer count
    count: str = "num_hidden_layers"
    #: a list of dense-only layer indices
    dense_list: str | None = None
    #: MoE when (i + 1) % step == 0
    sparse_step: str | None = None
    #: dense below k
    first_dense: str | None = None
    #: MoE up to this index (-1: the last layer)
    last_moe: str | None = None
    #: MoE when i % freq == 0
    freq: str | None = None
    #: a per-layer list of "sparse" (MoE) / "dense"
    types: str | None = None
    #: a list of the MoE layer indices
    moe_list: str | None = None

    def keys(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name))


#: the value of a per-layer type list that marks an MoE layer
SPARSE_LAYER = "sparse"


@dataclass(frozen=True)
class Wrapper:
    """A multimodal model whose text decoder holds the MoE blocks: the decoder is patched and sharded, the vision
    tower and the projector stay whole on every rank, untouched by DeepSpeed."""

    #: attributes (anywhere in the model) of the vision tower and the projector: kept out of DeepSpeed's sight
    replicated: tuple[str, ...]
    #: the text decoder class, where the wrapper builds it through `AutoModel.from_config(config.text_config)`
    #: (which would build transformers' own, unpatched class): the rewrite builds it from the patched module
    text_model: str = ""
    #: the family whose modeling module holds the text decoder when it is not the wrapper's own: `patch` writes
    #: that module, patched, beside the wrapper's
    text_family: str = ""
    #: how the harness feeds one image (IMAGE_*; "" = text only)
    image_input: str = ""
    #: the config key of the image placeholder token, and of the tokens around an image
    image_token_key: str = "image_token_id"
    image_start_key: str = ""
    image_end_key: str = ""
    #: the forward takes `mm_token_type_ids` (1 at image tokens) with `image_grid_thw`
    token_types: bool = False
    #: the text-only causal LM class the wrapper's checkpoints also load as (`AutoModelForCausalLM`, as transformers
    #: maps the wrapper's model type): the patched class takes the checkpoint's text config, as the auto class does
    #: for the built-in one
    causal_lm: str = ""


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention token mixer of a hybrid decoder (gated delta-net: Qwen3-Next, Qwen3.5): the policy shards
    it by key-head groups itself, out of DeepSpeed's sight.

    Everything in it is per head (projections, depthwise convolution channels, per-head decay and step Parameters,
    the recurrent state, a norm within each head), with the value heads of a key head next to each other. So each
    head-ordered segment of each tensor below is cut into tp equal contiguous parts and a rank keeps its part of
    every one: its key heads with their value heads. The module's sizes become its share; the output projection
    is row-parallel, reduced once. The cache follows (its states take the shapes of the local tensors).
    """

    #: the decoder-layer attribute holding it
    attr: str
    #: its `nn.Linear` input projections, each with the segments of its output rows, in order: module attributes
    #: naming each segment's width (() = one segment, the whole width: interleaved per-key-head groups included)
    projections: tuple[tuple[str, tuple[str, ...]], ...]
    #: the depthwise convolution over the q/k/v channels, and its channel segments
    conv: str = "conv1d"
    conv_segments: tuple[str, ...] = ("key_dim", "key_dim", "value_dim")
    #: Parameters of one value per value head
    head_params: tuple[str, ...] = ("A_log", "dt_bias")
    #: the output projection (its input columns are per value head)
    output: str = "out_proj"
    #: the module's size attributes its forward reads: each becomes this rank's share
    local_sizes: tuple[str, ...] = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


@dataclass(frozen=True)
class Alias:
    """A model type that is another family's architecture under another name (checkpoints that ship that
    family's remote code): patched as that family, its config's model type kept."""

    family: str
    #: the remote-code module its checkpoints ship (`patch` refuses a dir without remote code: transformers has
    #: no class for the name)
    remote_module: str


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
    then `full_overrides`. A multimodal wrapper's `tiny` is its text config; `vision` its tiny vision tower,
    `wrapper` the wrapper's own keys (image token ids inside the tiny vocabulary).
    """

    tiny: dict
    toy: dict | None = None
    published: str = ""
    full_overrides: dict = field(default_factory=dict)
    vision: dict | None = None
    wrapper: dict = field(default_factory=dict)


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
    #: a multimodal wrapper with an image in the prompt: the start of its crash line, or its all-reduces
    image_crash: str = ""
    image_allreduces: int = 0


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
    #: attention modules that must stay replicated (MLA low-rank inputs, a DSA indexer), by attribute name
    attention_replicated: tuple[str, ...] = ()
    #: attention Parameters holding one value per attention head (e.g. sinks): sharded with the heads
    attention_head_params: tuple[str, ...] = ()
    #: attention `nn.Linear`s whose output rows are per head (an output gate): cut by the heads, not by DeepSpeed
    attention_head_linears: tuple[str, ...] = ()
    #: (norm, projection) attribute pairs of attention: an RMSNorm over the projection's whole output width (all
    #: heads): the projection and the norm stay whole, each rank keeps its heads of the normed output
    full_width_norms: tuple[tuple[str, str], ...] = ()
    #: substrings of the family's class names that DeepSpeed's AutoTP special-cases (it looks for "Yuan" in a
    #: module's repr and then shards v/o by shared-QK head pairs): hidden from it while it shards
    deepspeed_name_clashes: tuple[str, ...] = ()
    #: decoder-layer attributes that hold the MoE block, any generation (the first is the 5.x name)
    moe_block_attrs: tuple[str, ...] = ("mlp",)
    #: quantized forms this family ships (`quantization_config.quant_method`) that a patched dir loads exactly only
    #: from some transformers release on; `patch` refuses them below it (codegen.patch.quantization)
    quantized_forms: tuple[QuantizedForm, ...] = ()
    #: decoder-layer attributes holding an attention block, of any kind the family has
    attention_attrs: tuple[str, ...] = ("self_attn",)
    #: what 4.x sources name differently
    legacy: Legacy | None = None
    #: a multimodal wrapper: its vision tower and projector (None: a text model)
    wrapper: Wrapper | None = None
    #: the linear-attention layers of a hybrid decoder (None: attention layers only)
    linear_attention: LinearAttention | None = None
    #: what the bench and README call the bench-sized example of this family
    bench_label: str = field(default="", metadata=_NOT_OUTPUT)
    #: transformers releases whose source the regression matrix covers (also quoted in errors); the first is the
    #: first release that shipped the family
    known_good: tuple[str, ...] = field(default=())
    #: hub-style remote code of this family the regression matrix covers: fixture dirs under tests/fixtures/
    #: (one `modeling_*.py`, shipped next to its `configuration_*.py`)
    remote_code_fixtures: tuple[str, ...] = ()
    #: unsupported model types built on this family's MoE block (named as the nearest family when refused)
    relatives: tuple[str, ...] = ()
    #: which decoder layers hold an MoE block
    layers: MoELayers = MoELayers()
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
    def first_release(self) -> str:
        """The first transformers release that shipped the family."""
        return self.releases[0]

    @property
    def builtin_module_name(self) -> str:
        return self.builtin_module.rsplit(".", 1)[-1]

    @property
    def text_family(self) -> "Family":
        """The family whose module holds the MoE blocks: this one, or the one a wrapper builds its decoder from."""
        return FAMILIES[self.wrapper.text_family] if self.wrapper and self.wrapper.text_family else self

    def names(self, legacy: bool) -> tuple[FusedExperts, tuple[str, ...]]:
        """(fused layout, routers) of a source of this generation (`legacy`: transformers 4.x)."""
        old = self.legacy if legacy and self.legacy is not None else Legacy()
        return old.fused or self.fused, old.routers or self.routers

    def policy_layout(self, legacy: bool = False) -> dict:
        """The plain data the generated policy's header carries (codegen.policy.runtime reads only this)."""
        fused, routers = self.names(legacy)
        return {
            "family": self.model_type,
            "moe_classes": list(self.moe_classes),
            "experts": self.experts_attr,
            "per_expert": {"gate": self.per_expert.gate, "up": self.per_expert.up, "down": self.per_expert.down},
            "fused": {"kind": fused.kind, "gate_up": fused.gate_up, "down": fused.down, "size_attr": fused.size_attr,
                      "gate_up_bias": fused.gate_up_bias, "down_bias": fused.down_bias},
            "shared": list(self.shared_experts),
            "routers": list(routers),
            "attention_replicated": list(self.attention_replicated),
            "attention_head_params": list(self.attention_head_params),
            "full_width_norms": [list(pair) for pair in self.full_width_norms],
            "attention_head_linears": list(self.attention_head_linears),
            "attention_attrs": list(self.attention_attrs),
            "replicated": list(self.wrapper.replicated) if self.wrapper else [],
            "name_clashes": list(self.deepspeed_name_clashes),
            "moe_block_attrs": list(self.moe_block_attrs),
            "tp_divisible": list(self.tp_divisible_keys),
            "linear_attention": _linear_attention_layout(self.linear_attention),
        }


def _linear_attention_layout(spec: LinearAttention | None) -> dict | None:
    if spec is None:
        return None
    return {"attr": spec.attr, "projections": [[attr, list(segments)] for attr, segments in spec.projections],
            "conv": spec.conv, "conv_segments": list(spec.conv_segments), "head_params": list(spec.head_params),
            "output": spec.output, "local_sizes": list(spec.local_sizes)}


#: what a derived row never inherits: its releases, fixtures, relatives, examples and measurements are its own
_OWN = dict(bench_label="", known_good=(), remote_code_fixtures=(), relatives=(), quantized_forms=(), examples=None,
            stock_autotp=StockAutoTP())


def _like(base: Family, **changes) -> Family:
    """A row that shares `base`'s names but for `changes` (the fields a reader must check are the ones given)."""
    return replace(base, **{**_OWN, **changes})


_COMMON_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                 "num_experts_per_tok", "vocab_size")

_GPT_OSS_EXPERTS = FusedExperts(kind=FUSED_GATE_UP_INTERLEAVED_COLS, size_attr="intermediate_size",
                                gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias")

_FIRST_SEVEN: dict[str, Family] = {
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
        known_good=("4.45.0", "4.45.2", "4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(dense_list="mlp_only_layers", sparse_step="decoder_sparse_step"),
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
        known_good=("4.54.0", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0", "hub remote code (modeling_deepseek.py)"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        remote_code_fixtures=("hub_deepseek",),
        layers=MoELayers(first_dense="first_k_dense_replace", freq="moe_layer_freq"),
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
        stock_autotp=StockAutoTP(allreduces=3, experts=1.0),
        relatives=("qwen3_omni_moe",),
        layers=MoELayers(dense_list="mlp_only_layers", sparse_step="decoder_sparse_step"),
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
        stock_autotp=StockAutoTP(allreduces=3, experts=1.0),
        relatives=("minimax",),
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
        known_good=("4.51.3", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0", "hub remote code (modeling_deepseek.py)"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        remote_code_fixtures=("hub_kimi_k2",),
        relatives=("longcat_flash",),
        layers=MoELayers(first_dense="first_k_dense_replace", freq="moe_layer_freq"),
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
        known_good=("4.54.0", "4.54.1", "4.55.4", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(first_dense="first_k_dense_replace"),
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
        # every generation ships fused experts (4.x too, the same layout): the per-expert names are never looked up
        per_expert=PerExpertMLP(),
        fused=_GPT_OSS_EXPERTS,
        legacy=Legacy(fused=_GPT_OSS_EXPERTS),
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


#: tiny MLA attention (DeepSeek-V2/V3 style), shared by the tiny examples of the MLA families
_TINY_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                 qk_nope_head_dim=16)
#: tiny sizes every example shares
_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)
#: the tiny DeepSeek-V3 style MoE (8 routed experts, 1 shared, top-2)
_TINY_V3_MOE = dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, n_group=1, topk_group=1)
#: a tiny image's placeholder and delimiter tokens: the last ids of the tiny vocabulary
_TINY_IMAGE_TOKENS = dict(image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)

#: the gated delta-net attribute of the Qwen hybrids' decoder layers, and the head counts of their linear attention
_QWEN_LINEAR_ATTN = "linear_attn"
_LINEAR_HEAD_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_QWEN_HYBRID_TP = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                   "moe_intermediate_size", "shared_expert_intermediate_size")
#: a tiny Qwen hybrid: a linear-attention layer, then a full-attention one; 2 value heads per key head
_TINY_QWEN_HYBRID = dict(head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                         num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention"])

_V3 = _FIRST_SEVEN["deepseek_v3"]
_GLM = _FIRST_SEVEN["glm4_moe"]
_V3_TP = ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "intermediate_size")

_OLMOE = Family(
    model_type="olmoe",
    builtin_module="transformers.models.olmoe.modeling_olmoe",
    config_class="OlmoeConfig",
    moe_classes=("OlmoeSparseMoeBlock",),
    experts_attr="experts",
    per_expert=PerExpertMLP(),
    fused=FusedExperts(),
    shared_experts=(),
    routers=("gate",),
    anchor=ANCHOR_ROUTED_FINAL,
    pretrained_class_suffix="PreTrainedModel",
    auto_classes={"AutoModelForCausalLM": "OlmoeForCausalLM", "AutoModel": "OlmoeModel"},
    num_experts_keys=("num_experts",),
    top_k_keys=("num_experts_per_tok",),
    positive_int_keys=(*_COMMON_SIZES, "num_experts", "intermediate_size"),
    tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
    full_width_norms=(("q_norm", "q_proj"), ("k_norm", "k_proj")),
    known_good=("4.45.0", "4.57.6", "5.0.0", "5.24.0"),
    # every decoder layer holds an MoE block
    layers=MoELayers(),
    examples=Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                             why="q/k RMSNorm spans all heads: its weight is not sharded"),
)

FAMILIES: dict[str, Family] = {
    **_FIRST_SEVEN,
    "glm4_moe_lite": _like(
        _V3,
        model_type="glm4_moe_lite",
        builtin_module="transformers.models.glm4_moe_lite.modeling_glm4_moe_lite",
        config_class="Glm4MoeLiteConfig",
        moe_classes=("Glm4MoeLiteMoE",),
        auto_classes={"AutoModelForCausalLM": "Glm4MoeLiteForCausalLM", "AutoModel": "Glm4MoeLiteModel"},
        known_good=("5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(types="mlp_layer_types"),
        examples=Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"])),
    ),
    "deepseek_v32": _like(
        _V3,
        model_type="deepseek_v32",
        builtin_module="transformers.models.deepseek_v32.modeling_deepseek_v32",
        config_class="DeepseekV32Config",
        moe_classes=("DeepseekV32MoE",),
        auto_classes={"AutoModelForCausalLM": "DeepseekV32ForCausalLM", "AutoModel": "DeepseekV32Model"},
        # the DSA indexer takes top-k over the sum of all its heads: every rank needs all of them
        attention_replicated=(*_V3.attention_replicated, "indexer"),
        known_good=("5.11.0", "5.24.0"),
        layers=MoELayers(types="mlp_layer_types", first_dense="first_k_dense_replace"),
        examples=Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"],
                                    index_topk=8, index_head_dim=16, index_n_heads=2)),
        stock_autotp=StockAutoTP(crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                                 why="the DSA indexer's projections are sharded"),
    ),
    "glm_moe_dsa": _like(
        _V3,
        model_type="glm_moe_dsa",
        builtin_module="transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
        config_class="GlmMoeDsaConfig",
        moe_classes=("GlmMoeDsaMoE",),
        auto_classes={"AutoModelForCausalLM": "GlmMoeDsaForCausalLM", "AutoModel": "GlmMoeDsaModel"},
        attention_replicated=(*_V3.attention_replicated, "indexer"),
        known_good=("5.2.0", "5.24.0"),
        layers=MoELayers(types="mlp_layer_types", first_dense="first_k_dense_replace"),
        examples=Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, mlp_layer_types=["dense", "sparse"],
                                    index_topk=8, index_head_dim=16, index_n_heads=2,
                                    indexer_types=["full", "full"])),
        stock_autotp=StockAutoTP(crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                                 why="the DSA indexer's projections are sharded"),
    ),
    "mistral4": _like(
        _V3,
        model_type="mistral4",
        builtin_module="transformers.models.mistral4.modeling_mistral4",
        config_class="Mistral4Config",
        moe_classes=("Mistral4MoE",),
        # transformers registers Mistral4ForCausalLM under the image-text-to-text auto class only (hub checkpoints
        # are the mistral3 wrapper): the patched dir names it under both
        auto_classes={"AutoModelForImageTextToText": "Mistral4ForCausalLM", "AutoModelForCausalLM": "Mistral4ForCausalLM",
                      "AutoModel": "Mistral4Model"},
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts", "n_group", "topk_group", "head_dim"),
        known_good=("5.4.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(first_dense="first_k_dense_replace"),
        examples=Examples(tiny=dict(_TINY, **_TINY_MLA, **_TINY_V3_MOE, first_k_dense_replace=0, head_dim=24)),
    ),
    "ernie4_5_moe": Family(
        model_type="ernie4_5_moe",
        builtin_module="transformers.models.ernie4_5_moe.modeling_ernie4_5_moe",
        config_class="Ernie4_5_MoeConfig",
        moe_classes=("Ernie4_5_MoeSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        routers=("gate",),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "Ernie4_5_MoeForCausalLM", "AutoModel": "Ernie4_5_MoeModel"},
        num_experts_keys=("moe_num_experts",),
        top_k_keys=("moe_k",),
        positive_int_keys=(*_COMMON_SIZES, "moe_num_experts", "moe_k", "head_dim"),
        tp_divisible_keys=_V3_TP,
        known_good=("4.54.0", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(sparse_step="moe_layer_interval", first_dense="moe_layer_start_index",
                         last_moe="moe_layer_end_index"),
        examples=Examples(tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                    moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1)),
    ),
    "dots1": _like(
        _GLM,
        model_type="dots1",
        builtin_module="transformers.models.dots1.modeling_dots1",
        config_class="Dots1Config",
        moe_classes=("Dots1MoE",),
        auto_classes={"AutoModelForCausalLM": "Dots1ForCausalLM", "AutoModel": "Dots1Model"},
        known_good=("4.53.0", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        examples=Examples(tiny=dict(_TINY, **_TINY_V3_MOE, head_dim=16, first_k_dense_replace=1,
                                    layer_types=["full_attention", "full_attention"])),
    ),
    "exaone_moe": _like(
        _GLM,
        model_type="exaone_moe",
        builtin_module="transformers.models.exaone_moe.modeling_exaone_moe",
        config_class="ExaoneMoeConfig",
        moe_classes=("ExaoneMoeSparseMoEBlock",),
        auto_classes={"AutoModelForCausalLM": "ExaoneMoeForCausalLM", "AutoModel": "ExaoneMoeModel"},
        num_experts_keys=("num_experts",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "n_group", "topk_group", "head_dim"),
        known_good=("5.1.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        layers=MoELayers(types="mlp_layer_types"),
        examples=Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, head_dim=16,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                    mlp_layer_types=["dense", "sparse"], bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)),
    ),
    "solar_open": _like(
        _GLM,
        model_type="solar_open",
        builtin_module="transformers.models.solar_open.modeling_solar_open",
        config_class="SolarOpenConfig",
        moe_classes=("SolarOpenMoE",),
        auto_classes={"AutoModelForCausalLM": "SolarOpenForCausalLM", "AutoModel": "SolarOpenModel"},
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "moe_intermediate_size"),
        known_good=("5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0),
        # every decoder layer holds an MoE block
        layers=MoELayers(),
        examples=Examples(tiny=dict(_TINY, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                    num_experts_per_tok=2, n_group=1, topk_group=1, head_dim=16)),
    ),
    "phimoe": _like(
        _FIRST_SEVEN["mixtral"],
        model_type="phimoe",
        builtin_module="transformers.models.phimoe.modeling_phimoe",
        config_class="PhimoeConfig",
        moe_classes=("PhimoeSparseMoeBlock",),
        # 5.x: `router`, an nn.Linear subclass; 4.x: `gate`, a plain nn.Linear (stock AutoTP splits either)
        routers=("router",),
        legacy=Legacy(routers=("gate",)),
        auto_classes={"AutoModelForCausalLM": "PhimoeForCausalLM", "AutoModel": "PhimoeModel"},
        known_good=("4.46.1", "4.57.6", "5.0.0", "5.24.0"),
        examples=Examples(tiny=dict(_TINY, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
        stock_autotp=StockAutoTP(crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                                 why="its nn.Linear router becomes a DeepSpeed layer: rank 1 gets 0 of its rows "
                                     "(this line), rank 0 a tensor where the router returns three "
                                     "(`ValueError: too many values to unpack`)"),
    ),
    "afmoe": Family(
        model_type="afmoe",
        builtin_module="transformers.models.afmoe.modeling_afmoe",
        config_class="AfmoeConfig",
        moe_classes=("AfmoeSparseMoeBlock", "AfmoeMoE"),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        # the router holds an nn.Linear `gate` that stock AutoTP splits
        routers=("router",),
        anchor=ANCHOR_RETURNED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "AfmoeForCausalLM", "AutoModel": "AfmoeModel"},
        num_experts_keys=("num_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "head_dim"),
        tp_divisible_keys=_V3_TP,
        # the attention output gate, one row block per head
        attention_head_linears=("gate_proj",),
        known_good=("5.0.0", "5.24.0"),
        layers=MoELayers(first_dense="num_dense_layers"),
        examples=Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, head_dim=16,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                    global_attn_every_n_layers=2)),
        stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                                 why="the attention output gate is split off the heads"),
    ),
    "hunyuan_v1_moe": Family(
        model_type="hunyuan_v1_moe",
        builtin_module="transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe",
        config_class="HunYuanMoEV1Config",
        moe_classes=("HunYuanMoEV1Moe",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_mlp",),
        # an nn.Module holding an nn.Linear `wg`, which stock AutoTP column-splits (silently wrong routing)
        routers=("gate",),
        anchor=ANCHOR_RETURNED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "HunYuanMoEV1ForCausalLM", "AutoModel": "HunYuanMoEV1Model"},
        num_experts_keys=("num_experts",),
        top_k_keys=("moe_topk",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "moe_topk", "intermediate_size", "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
        # `HunYuan...` reads as Yuan to DeepSpeed, which would pair v heads as Yuan's shared-QK attention does
        deepspeed_name_clashes=("Yuan",),
        known_good=("4.56.0", "4.57.6", "5.0.0", "5.24.0"),
        examples=Examples(tiny=dict(_TINY, num_key_value_heads=4, head_dim=16, intermediate_size=32, num_experts=8,
                                    moe_topk=2, num_shared_expert=1)),
        stock_autotp=StockAutoTP(why="its gate.wg router is column-split, and its v/o heads are paired as Yuan's",
                                 wrong=True, allreduces=5, experts=1.0),
    ),
    "mimo_v2_flash": _like(
        _V3,
        model_type="mimo_v2_flash",
        builtin_module="transformers.models.mimo_v2_flash.modeling_mimo_v2_flash",
        config_class="MiMoV2FlashConfig",
        moe_classes=("MiMoV2FlashMoE",),
        shared_experts=(),
        anchor=ANCHOR_RETURNED_ROUTED,
        auto_classes={"AutoModelForCausalLM": "MiMoV2FlashForCausalLM", "AutoModel": "MiMoV2FlashModel"},
        attention_replicated=(),
        # sliding-window layers only (full layers have none)
        attention_head_params=("sinks",),
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts", "n_group", "topk_group", "head_dim", "v_head_dim"),
        known_good=("5.13.0", "5.24.0"),
        layers=MoELayers(types="mlp_layer_types"),
        examples=Examples(tiny=dict(_TINY, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                    num_experts_per_tok=2, n_group=1, topk_group=1, head_dim=16, v_head_dim=16,
                                    sliding_window=8, layer_types=["full_attention", "sliding_attention"],
                                    mlp_layer_types=["dense", "sparse"])),
        stock_autotp=StockAutoTP(crash="RuntimeError: Sizes of tensors must match",
                                 why="attention sinks (sliding-window layers) are not sharded with the heads"),
    ),
    "olmoe": _OLMOE,
    "flex_olmo": _like(
        _OLMOE,
        model_type="flex_olmo",
        builtin_module="transformers.models.flex_olmo.modeling_flex_olmo",
        config_class="FlexOlmoConfig",
        moe_classes=("FlexOlmoSparseMoeBlock",),
        auto_classes={"AutoModelForCausalLM": "FlexOlmoForCausalLM", "AutoModel": "FlexOlmoModel"},
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
        examples=Examples(tiny=dict(_TINY, intermediate_size=32, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                                    eos_token_id=1)),
        stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                                 why="q/k RMSNorm spans all heads: its weight is not sharded"),
    ),
    "minimax_m2": Family(
        model_type="minimax_m2",
        builtin_module="transformers.models.minimax_m2.modeling_minimax_m2",
        config_class="MiniMaxM2Config",
        moe_classes=("MiniMaxM2SparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(gate="w1", up="w3", down="w2"),
        fused=FusedExperts(),
        shared_experts=(),
        routers=("gate",),
        anchor=ANCHOR_ROUTED_FINAL,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForCausalLM": "MiniMaxM2ForCausalLM", "AutoModel": "MiniMaxM2Model"},
        num_experts_keys=("num_local_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_local_experts", "intermediate_size", "head_dim"),
        tp_divisible_keys=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
        full_width_norms=(("q_norm", "q_proj"), ("k_norm", "k_proj")),
        moe_block_attrs=("mlp", "block_sparse_moe"),
        known_good=("5.0.0", "5.24.0"),
        examples=Examples(tiny=dict(_TINY, head_dim=16, intermediate_size=32, num_local_experts=8,
                                    num_experts_per_tok=2)),
        stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                                 why="q/k RMSNorm spans all heads: its weight is not sharded"),
    ),
    "step3p7": Family(
        model_type="step3p7",
        builtin_module="transformers.models.step3p7.modeling_step3p7",
        config_class="Step3p7Config",
        moe_classes=("Step3p7SparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_experts",),
        routers=("gate",),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForImageTextToText": "Step3p7ForConditionalGeneration", "AutoModel": "Step3p7Model"},
        num_experts_keys=("n_routed_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "n_routed_experts", "head_dim", "share_expert_dim"),
        tp_divisible_keys=("num_attention_heads", "num_sliding_attention_heads", "num_key_value_heads",
                           "moe_intermediate_size", "share_expert_dim", "intermediate_size"),
        known_good=("5.16.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0, image_allreduces=7),
        layers=MoELayers(types="mlp_layer_types"),
        wrapper=Wrapper(replicated=("vision_model", "multi_modal_projector"), image_input=IMAGE_WHOLE),
        examples=Examples(
            tiny=dict(_TINY, model_type="step3p5", intermediate_size=128, moe_intermediate_size=32,
                      n_routed_experts=8, num_experts_per_tok=2, share_expert_dim=32, head_dim=16,
                      num_sliding_attention_heads=4, query_pre_attn_scalar=16, mlp_layer_types=["dense", "sparse"],
                      layer_types=["sliding_attention", "full_attention"], sliding_window=8, pad_token_id=0),
            vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        image_size=56, patch_size=14, max_position_embeddings=16),
            wrapper=dict(image_token_id=250),
        ),
    ),
    "qwen3_vl_moe": Family(
        model_type="qwen3_vl_moe",
        builtin_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
        config_class="Qwen3VLMoeConfig",
        moe_classes=("Qwen3VLMoeTextSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=(),
        routers=("gate",),
        anchor=ANCHOR_ROUTED_FINAL,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForImageTextToText": "Qwen3VLMoeForConditionalGeneration",
                      "AutoModel": "Qwen3VLMoeModel"},
        # 4.x writes num_experts; 5.x writes num_local_experts
        num_experts_keys=("num_experts", "num_local_experts"),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "num_local_experts", "head_dim"),
        tp_divisible_keys=_V3_TP,
        # 4.x: gate_up [E, H, 2I] (gate columns, then up columns), down [E, I, H]
        legacy=Legacy(fused=FusedExperts(kind=FUSED_GATE_UP_HALVES_COLS, size_attr="expert_dim")),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=3, experts=1.0, image_crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        layers=MoELayers(dense_list="mlp_only_layers", sparse_step="decoder_sparse_step"),
        wrapper=Wrapper(replicated=("visual",), text_model="Qwen3VLMoeTextModel", image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        token_types=True),
        examples=Examples(
            # 2 * moe_intermediate_size != hidden_size: transformers 5.x's loader tells the two expert layouts
            # apart by shape
            tiny=dict(_TINY, head_dim=16, intermediate_size=128, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [2, 3, 3]}),
            vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        num_position_embeddings=16, deepstack_visual_indexes=[0], patch_size=8),
            wrapper=dict(_TINY_IMAGE_TOKENS),
        ),
    ),
    "glm4v_moe": _like(
        _GLM,
        model_type="glm4v_moe",
        builtin_module="transformers.models.glm4v_moe.modeling_glm4v_moe",
        config_class="Glm4vMoeConfig",
        moe_classes=("Glm4vMoeTextMoE",),
        auto_classes={"AutoModelForImageTextToText": "Glm4vMoeForConditionalGeneration", "AutoModel": "Glm4vMoeModel"},
        known_good=("4.56.0", "4.57.6", "5.0.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0, image_crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        wrapper=Wrapper(replicated=("visual",), image_input=IMAGE_FLAT_PATCHES, image_start_key="image_start_token_id",
                        image_end_key="image_end_token_id", token_types=True),
        examples=Examples(
            tiny=dict(_TINY, **_TINY_V3_MOE, head_dim=16, first_k_dense_replace=1, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                "partial_rotary_factor": 0.5}),
            vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        image_size=56, patch_size=14),
            wrapper=dict(image_token_id=250, image_start_token_id=251, image_end_token_id=252, video_token_id=253,
                         video_start_token_id=254, video_end_token_id=255),
        ),
    ),
    "kimi_k25": _like(
        _V3,
        model_type="kimi_k25",
        builtin_module="transformers.models.kimi_k25.modeling_kimi_k25",
        config_class="Kimi_K25Config",
        auto_classes={"AutoModelForImageTextToText": "Kimi_K25ForConditionalGeneration", "AutoModel": "Kimi_K25Model"},
        known_good=("5.13.0", "5.24.0"),
        stock_autotp=StockAutoTP(allreduces=5, experts=1.0, image_crash="RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        wrapper=Wrapper(replicated=("vision_tower", "mm_projector"), text_model="DeepseekV3Model",
                        text_family="deepseek_v3", image_input=IMAGE_PATCH_ROWS,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id"),
        examples=Examples(
            # q_lora_rank set (as in Kimi K2.5): with None, transformers 5.24 saves the text q_proj as
            # `self_wqkv` (its vision `wqkv` rename) and cannot load the dir back
            tiny={**_TINY, **_TINY_MLA, **_TINY_V3_MOE, "model_type": "deepseek_v3", "first_k_dense_replace": 1,
                  "n_group": 2},
            vision=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
            wrapper=dict(_TINY_IMAGE_TOKENS, projection_hidden_size=32),
        ),
    ),
    "qwen3_next": _like(
        _FIRST_SEVEN["qwen2_moe"],
        model_type="qwen3_next",
        builtin_module="transformers.models.qwen3_next.modeling_qwen3_next",
        config_class="Qwen3NextConfig",
        moe_classes=("Qwen3NextSparseMoeBlock",),
        auto_classes={"AutoModelForCausalLM": "Qwen3NextForCausalLM", "AutoModel": "Qwen3NextModel"},
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "head_dim", *_LINEAR_HEAD_KEYS),
        tp_divisible_keys=(*_QWEN_HYBRID_TP, "intermediate_size"),
        attention_attrs=("self_attn", _QWEN_LINEAR_ATTN),
        # in_proj_qkvz rows: per key head [q, k, v (its value heads), z (its value heads)]; in_proj_ba: [b, a]
        linear_attention=LinearAttention(attr=_QWEN_LINEAR_ATTN, projections=(("in_proj_qkvz", ()),
                                                                              ("in_proj_ba", ()))),
        known_good=("4.57.1", "4.57.6", "5.0.0", "5.24.0"),
        examples=Examples(tiny=dict(_TINY, **_TINY_QWEN_HYBRID, intermediate_size=128)),
        stock_autotp=StockAutoTP(crash="RuntimeError: shape",
                                 why="in_proj_qkvz cut in row halves across its per-key-head q/k/v/z groups"),
    ),
    "qwen3_5_moe": Family(
        model_type="qwen3_5_moe",
        builtin_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        config_class="Qwen3_5MoeConfig",
        moe_classes=("Qwen3_5MoeSparseMoeBlock",),
        experts_attr="experts",
        per_expert=PerExpertMLP(),
        fused=FusedExperts(),
        shared_experts=("shared_expert",),
        routers=("gate", "shared_expert_gate"),
        anchor=ANCHOR_SHARED_SUM,
        pretrained_class_suffix="PreTrainedModel",
        auto_classes={"AutoModelForImageTextToText": "Qwen3_5MoeForConditionalGeneration",
                      "AutoModelForCausalLM": "Qwen3_5MoeForCausalLM", "AutoModel": "Qwen3_5MoeModel"},
        num_experts_keys=("num_experts",),
        top_k_keys=("num_experts_per_tok",),
        positive_int_keys=(*_COMMON_SIZES, "num_experts", "head_dim", *_LINEAR_HEAD_KEYS),
        tp_divisible_keys=_QWEN_HYBRID_TP,
        attention_attrs=("self_attn", _QWEN_LINEAR_ATTN),
        # in_proj_qkv rows: [q (key heads) | k (key heads) | v (value heads)]; z, b, a: per value head
        linear_attention=LinearAttention(attr=_QWEN_LINEAR_ATTN, projections=(
            ("in_proj_qkv", ("key_dim", "key_dim", "value_dim")), ("in_proj_z", ()), ("in_proj_b", ()),
            ("in_proj_a", ()))),
        known_good=("5.2.0", "5.24.0"),
        # every decoder layer holds an MoE block
        layers=MoELayers(),
        wrapper=Wrapper(replicated=("visual",), text_model="Qwen3_5MoeTextModel", image_input=IMAGE_FLAT_PATCHES,
                        image_start_key="vision_start_token_id", image_end_key="vision_end_token_id",
                        token_types=True, causal_lm="Qwen3_5MoeForCausalLM"),
        examples=Examples(
            tiny=dict(_TINY, **_TINY_QWEN_HYBRID),
            vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        num_position_embeddings=16, patch_size=8),
            wrapper=dict(_TINY_IMAGE_TOKENS),
        ),
        stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                                 why="the linear attention's heads are cut but its head counts and conv stay whole",
                                 image_crash="RuntimeError: The size of tensor a"),
    ),
}

# text-only Qwen3.5 MoE checkpoints (the wrapper's decoder saved alone): the same module, no vision tower
FAMILIES["qwen3_5_moe_text"] = _like(
    FAMILIES["qwen3_5_moe"],
    model_type="qwen3_5_moe_text",
    config_class="Qwen3_5MoeTextConfig",
    auto_classes={"AutoModelForCausalLM": "Qwen3_5MoeForCausalLM", "AutoModel": "Qwen3_5MoeTextModel"},
    wrapper=None,
    bench_label="Qwen3.5-35B-A3B-like",
    known_good=("5.2.0", "5.24.0"),
    examples=Examples(
        tiny=dict(_TINY, **_TINY_QWEN_HYBRID),
        # the bench's: 2 layers, one linear-attention then one full-attention (the published model has 3 of the
        # first per 1 of the second)
        toy=dict(vocab_size=4096, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, max_position_embeddings=1024,
                 layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False),
        published="qwen3.5-35b-a3b.json",
        # 2 kv heads, as published: tp 2 only at full widths
        full_overrides=dict(layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024),
    ),
    stock_autotp=StockAutoTP(crash="RuntimeError: The size of tensor a",
                             why="the linear attention's heads are cut but its head counts and conv stay whole"),
)

#: model types that are another family's architecture under another name
ALIASES: dict[str, Alias] = {
    # Kimi-K2 checkpoints ship DeepSeek-V3 remote code (`modeling_deepseek.py`, `DeepseekV3ForCausalLM`)
    "kimi_k2": Alias(family="deepseek_v3", remote_module="modeling_deepseek"),
}


#: what the support table says of an MoE model type of transformers that codegen does not patch
NOT_YET = "not yet"
REFUSED = "refused"


@dataclass(frozen=True)
class Unsupported:
    """An MoE model type `patch` refuses, and the one line that says why."""

    status: str
    why: str


_ROW = "a row of existing kinds, not verified yet"
#: a hybrid whose gated delta-net is Qwen3.5-MoE's: the linear-attention kind covers it as data (a row, unverified)
_GDN_AS_DATA = "Qwen3.5's gated delta-net: the linear-attention kind covers it as data, a row not verified yet"
UNSUPPORTED: dict[str, Unsupported] = {
    **{t: Unsupported(NOT_YET, _ROW) for t in (
        "kolibri1", "mellum", "flint", "beam", "cohere2_moe",
        "hy_v3", "axk1", "axk2", "laguna")},
    "granitemoe": Unsupported(NOT_YET, "4.x experts are GraniteMoeParallelExperts (3-D input_linear/output_linear "
                                       "weights) reduced after output_linear: needs an expert layout kind and anchor"),
    # the other hybrids (survey of their 5.24 sources): which the linear-attention kind covers, which need another
    "lara_mini": Unsupported(NOT_YET, _GDN_AS_DATA),
    "qwen4_exp": Unsupported(NOT_YET, f"{_GDN_AS_DATA}; its hyper-connections, per-layer n-gram embeddings and "
                                      "attention indexer are not verified yet"),
    **{t: Unsupported(NOT_YET, "Kimi delta attention: the linear-attention kind once it tells the mixer from the "
                               "MLA layers under the same attribute and takes nested Parameters (forget gate)")
       for t in ("kimi_linear", "glm5_next", "bailing_hybrid")},
    "nemotron_h": Unsupported(NOT_YET, "Mamba-2 mixer: the linear-attention kind with segment widths per group "
                                       "(n_groups divisible by tp) and its group norm cut; non-gated latent experts "
                                       "need an expert layout kind"),
    "lfm2_moe": Unsupported(NOT_YET, "short-conv mixer: exact split by channel, the linear-attention kind with "
                                     "segment widths from the config"),
    "jamba": Unsupported(NOT_YET, "Mamba-1 mixer: x_proj reads every channel, so it needs a kind with one more "
                                  "reduction per mixer"),
    "granitemoehybrid": Unsupported(NOT_YET, "Mamba-2 with one group (B/C replicated) and a norm over all heads, and "
                                             "the shared MLP added in the decoder layer: needs another kind"),
    "minimax": Unsupported(NOT_YET, "lightning attention: a norm over all heads and per-head decay buffers from the "
                                    "global head count: needs another kind"),
    **{t: Unsupported(NOT_YET, "attention with per-head short convolutions and nested projections: needs an "
                               "attention kind")
       # the model types their config.json files carry (the folders are inkling, inkling2, inkling2_loop)
       for t in ("inkling_mm_model", "inkling_text", "inkling2", "inkling2_text", "inkling2_loop",
                 "inkling2_loop_text")},
    "zaya": Unsupported(NOT_YET, "CCA attention (grouped conv, key residual averaged over a group's query heads): "
                                 "needs its own kind, exact only up to tp = num_key_value_heads"),
    **{t: Unsupported(NOT_YET, "a multimodal wrapper over a text MoE, not verified yet") for t in (
        "aria", "llama4", "ernie4_5_vl_moe", "qwen3_omni_moe", "hy_v4_vl", "minimax_m3_vl", "mistral_large4",
        "muse_spark", "deepseek_ocr2", "unlimited_ocr", "dots3_note", "nemotron_h_omni")},
    "dbrx": Unsupported(NOT_YET, "experts are flat 2-D w1/v1/w2 tensors one module down and Wqkv is packed: "
                                 "needs an expert layout kind"),
    "longcat_flash": Unsupported(NOT_YET, "zero-compute identity experts are added on every rank: needs a kind that "
                                          "counts them once"),
    "granitemoeshared": Unsupported(NOT_YET, "the shared MLP is added in the decoder layer, not the MoE block: one "
                                             "reduction per block cannot cover it"),
    "granitemoe_swa": Unsupported(NOT_YET, "the shared MLP is added in the decoder layer, not the MoE block"),
    "gemma4": Unsupported(NOT_YET, "the MoE sits beside a dense MLP in the decoder layer, each normed before the "
                                   "sum: one reduction would need a decoder-layer anchor"),
    "hy_v4": Unsupported(NOT_YET, "hyper-connections and a DSA indexer: not verified yet"),
    "jetmoe": Unsupported(REFUSED, "mixture of attention heads: its routed attention experts cannot be sharded "
                                   "by heads"),
    "doge": Unsupported(REFUSED, "experts are embedding rows and dt_proj mixes every kv head: no head or expert "
                                 "split is exact"),
    "deepseek_v4": Unsupported(REFUSED, "one shared KV head and grouped o_a/o_b output projections: attention has "
                                        "no head split and no row-parallel output"),
    **{t: Unsupported(REFUSED, "an encoder-decoder or vision MoE, not a causal LM codegen serves") for t in (
        "switch_transformers", "nllb_moe", "vitpose_backbone")},
    "diffusion_gemma": Unsupported(REFUSED, "a diffusion language model, not a causal LM codegen serves"),
    "openai_privacy_filter": Unsupported(REFUSED, "a token classifier, not a causal LM codegen serves"),
}


def normalise_model_type(raw: object) -> str | None:
    """`Qwen2_MoE`, ` qwen2-moe ` and `qwen2_moe` name the same family (or alias); anything else is unknown."""
    if not isinstance(raw, str):
        return None
    key = raw.strip().lower().replace("-", "_")
    return key if key in FAMILIES or key in ALIASES else None


def supported_model_types() -> list[str]:
    """Every model type `patch` takes, sorted: the families' and their aliases'."""
    return sorted({*FAMILIES, *ALIASES})


def sizes_of(config: dict) -> dict:
    """The keys a config.json's sizes are read from: a multimodal config nests its text decoder's in `text_config`."""
    text = config.get(TEXT_CONFIG)
    return {**text, **config} if isinstance(text, dict) else config


def family_named(model_type: str) -> Family:
    """The family a canonical model type names: its own row, or the row an alias points at."""
    alias = ALIASES.get(model_type)
    return FAMILIES[alias.family] if alias is not None else FAMILIES[model_type]


def moe_class_names() -> frozenset[str]:
    """Every MoE block class of every family (the harness finds blocks by these)."""
    return frozenset(name for f in FAMILIES.values() for name in f.moe_classes)


def fused_attr_names() -> frozenset[str]:
    """Every fused-expert Parameter name of every family, any generation (the harness reports them as sharded)."""
    return frozenset(n for f in FAMILIES.values() for legacy in (False, True) for n in f.names(legacy)[0].parameters)
