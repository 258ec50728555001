"""The kinds the family table is written in: the dataclasses of a row, the constants rows name, and the defaults
and derivations that let a row say only what differs (codegen.families.table holds the rows).

Every field of a `Family` shapes what `patch` writes (the patch fingerprint hashes `Family.output_data()`); the
examples and the measured stock AutoTP figures are test and bench data, kept beside the table by model type
(codegen.families.examples, codegen.families.stock).
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, field, fields

from codegen.policy.runtime.base import FUSED_GATE_UP_ROWS, GATE_SILU

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
#: "shared_inplace_sum": the routed experts' sum is added in place to the shared expert's output, or the other way
#: round (`T.add_(X)`, one side carrying the shared expert output: Llama 4): after that statement, `T` is reduced.
ANCHOR_SHARED_INPLACE_SUM = "shared_inplace_sum"
#: "routed_statement": the one statement `T = self.<experts>(...)` of the forward, at any depth (inside an `if`):
#: reduced right after it, in its own block, before anything else reads it (Gemma 4's decoder layer norms the routed
#: experts' output, then adds the dense MLP's: the MoE block is the decoder layer, see `Family.block_reductions`)
ANCHOR_ROUTED_STATEMENT = "routed_statement"

#: Fused (transformers 5.x) expert layouts are named by the policy runtime, which shards each
#: (codegen.policy.runtime.base): FUSED_GATE_UP_ROWS, gate_up [E, 2I, H] (gate rows then up rows), down
#: [E, H, I]; FUSED_GATE_UP_HALVES_COLS, transposed, gate_up [E, H, 2I] (gate columns then up columns), down
#: [E, I, H]; FUSED_GATE_UP_INTERLEAVED_COLS, transposed, gate_up [E, H, 2I] with gate/up interleaved along the
#: last dim (a rank keeps whole gate/up pairs), down [E, I, H], optional biases gate_up_bias [E, 2I] (split with
#: the columns) and down_bias [E, H] (added inside every expert before the weighting: counted once over the ranks);
#: FUSED_FLAT_ROWS, flat [E*I, H] gate, up and down; FUSED_UP_ROWS, non-gated (down(act(up x))), up [E, I, H], down
#: [E, H, I], behind optional latent projections of the MoE block (`latent_in`, `latent_out`) kept whole.

#: How the harness feeds a multimodal wrapper one tiny image (codegen.harness.worker.images builds it):
#: flat patch rows [t*h*w, channels * temporal_patch * patch**2] and `image_grid_thw` (Qwen-VL, GLM-4V)
IMAGE_FLAT_PATCHES = "flat_patches"
#: one RGB patch per row [t*h*w, 3, patch, patch] and `image_grid_thw` (Kimi-K2.5)
IMAGE_PATCH_ROWS = "patch_rows"
#: whole images [batch, channels, image_size, image_size] (Step3-VL)
IMAGE_WHOLE = "whole"
#: whole images and their `image_sizes` [batch, 2] (Pixtral towers: Mistral-Large-4)
IMAGE_SIZED = "sized"
#: patch rows per image [batch, patches, channels * patch**2] and their (x, y) `image_position_ids` (Gemma 4)
IMAGE_POSITIONED_PATCHES = "positioned_patches"

#: the config key of a multimodal config that nests the text decoder's sizes
TEXT_CONFIG = "text_config"
#: the nested vision config of a multimodal config
VISION_CONFIG = "vision_config"
#: the nested audio config of a multimodal config with an audio tower
AUDIO_CONFIG = "audio_config"


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
    #: attribute holding the per-expert intermediate size, which the policy sets to its shard (a dotted path from the
    #: experts module where a submodule holds it; "" = none)
    size_attr: str = "intermediate_dim"
    #: expert bias Parameters of the layout ("" = none); the rewriter requires every named one to detect it
    gate_up_bias: str = ""
    down_bias: str = ""
    #: a separate up projection (FUSED_FLAT_ROWS: `gate_up` is then the gate alone; "" = packed with the gate;
    #: FUSED_UP_ROWS: the only input projection, `gate_up` is "")
    up: str = ""
    #: MoE-block attributes projecting the experts' input down to a latent width and their output back up ("" =
    #: none; an absent module or `nn.Identity` is fine): kept whole on every rank, the output one applied to this
    #: rank's partial sum before the one reduction (linear; its bias, if any, kept on rank 0 only)
    latent_in: str = ""
    latent_out: str = ""
    #: the experts' gate (codegen.policy.runtime.base GATE_*) and the experts-module attributes holding its
    #: parameters, in the order the gate takes them: the policy runs such experts as one fused op on CPU, after
    #: checking the module computes that gate
    gate: str = GATE_SILU
    gate_params: tuple[str, ...] = ()

    @property
    def parameters(self) -> tuple[str, ...]:
        """Every Parameter the layout names: together they identify fused experts in a source."""
        return tuple(n for n in (self.gate_up, self.up, self.down, self.gate_up_bias, self.down_bias) if n)


@dataclass(frozen=True)
class Legacy:
    """What transformers 4.x sources of a family name differently from 5.x ones (None: the same)."""

    #: the fused expert layout of 4.x sources (same Parameter names, another shape)
    fused: FusedExperts | None = None
    #: the router attributes of 4.x sources
    routers: tuple[str, ...] | None = None
    #: the MoE-block attribute holding the routed experts in 4.x sources; "" = the block holds the fused layout's
    #: modules itself (its Parameters then name dotted paths from the block: `input_linear.weight`)
    experts_attr: str | None = None


#: the value of a per-layer type list that marks an MoE layer
SPARSE_LAYER = "sparse"

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
    #: MoE when i % freq == 0 (== offset, where `offset` names one: Jamba's every second layer from the first)
    freq: str | None = None
    #: a per-layer list of "sparse" (MoE) / "dense" (or of `sparse_marks`); with `count` absent, its length counts
    types: str | None = None
    #: a string of one character per layer (Nemotron-H's `hybrid_override_pattern`), read where `types` is absent
    pattern: str | None = None
    #: the values of `types` (or characters of `pattern`) that mark an MoE layer
    sparse_marks: tuple[str, ...] = (SPARSE_LAYER,)
    #: a list of the MoE layer indices
    moe_list: str | None = None
    #: with `freq`: the remainder an MoE layer's index leaves
    offset: str | None = None

    def keys(self) -> tuple[str, ...]:
        """The config keys the rule reads (the marks are values, not keys)."""
        return tuple(getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), str))



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
    #: the forward routes the image's tokens (placeholders and delimiters) to an expert set of their own by
    #: `moe_mm_token_type_ids` (1 there): the harness passes it, so that set runs (see `Family.expert_sets`)
    moe_token_types: bool = False
    #: the text-only causal LM class the wrapper's checkpoints also load as (`AutoModelForCausalLM`, as transformers
    #: maps the wrapper's model type): the patched class takes the checkpoint's text config, as the auto class does
    #: for the built-in one (where the class names no checkpoint keys it ignores, it ignores the `replicated` parts')
    causal_lm: str = ""
    #: the wrapper's own forward does not run its text decoder (Llama 4 on transformers 5.x reads an output field its
    #: text model no longer returns): the harness and `serve` load its checkpoints as `causal_lm`, text only
    runs_as_causal_lm: bool = False
    #: the wrapper has no forward of its own: this attribute is its text model, itself a causal LM holding the towers
    #: and the decoder (Qwen3-Omni's `thinker`); the policy hands DeepSpeed this submodule alone, so the wrapper's
    #: other top-level modules (a speech generator with its own MoE, a vocoder) stay whole on every rank, and the
    #: harness and `serve` run it ("" = the wrapper runs itself)
    text_submodule: str = ""
    #: the config key of `text_submodule`'s config (it nests `text_config`, the towers' configs and the image tokens)
    submodule_config: str = ""


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (MLA) whose cache holds the compressed latent: the policy decodes it absorbed
    (codegen.policy.runtime.latent_attention), where the source expands the cache through `expand` (transformers
    5.x); the other names are the attention module's attributes, transformers' own across its MLA families."""

    #: the method that expands the cached latent into every head's keys and values
    expand: str = "expand_kv"
    #: the up-projection it expands through (split by heads under tensor parallelism)
    up_projection: str = "kv_b_proj"
    #: the attention module's attributes holding a head's no-position key width and its value width
    nope_width: str = "qk_nope_head_dim"
    value_width: str = "v_head_dim"
    #: the keyword a DSA layer passes its indexer's top-k keys under to an attention that is not eager or sdpa
    #: (which it otherwise folds into the mask itself): the absorbed step folds them in
    selected_keys: str = "indices"


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



#: size keys every family's config.json holds: they must be positive integers when present (`positive_int_keys`
#: starts with them)
COMMON_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                "num_experts_per_tok", "vocab_size")
#: what the tensor-parallel size must divide in most families: attention heads, kv heads, the expert and dense widths
HEADS_AND_WIDTHS = ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "intermediate_size")


@dataclass(frozen=True, kw_only=True)
class Family:
    """One MoE family: every name codegen needs to rewrite, shard and check it.

    A row gives the model type, the config class, the MoE block classes, the experts-count keys and what differs
    from the defaults below; a field a row leaves empty is derived (`__post_init__`): the built-in module from the
    model type, the auto classes from the config class's prefix, the anchor from the shared experts, the
    positive-int keys from the size keys.
    """

    model_type: str
    #: the transformers module that ships the built-in implementation
    #: (derived: transformers.models.<model_type>.modeling_<model_type>)
    builtin_module: str = ""
    #: the transformers config class (examples build tiny checkpoints from it); less `Config`, the prefix of the
    #: family's model classes
    config_class: str
    #: class names of the MoE block, any generation (4.x, 5.x, hub remote code)
    moe_classes: tuple[str, ...]
    #: the attribute of the MoE block holding the routed experts
    experts_attr: str = "experts"
    #: several routed expert sets per MoE block, each a dotted path from the block to its experts module
    #: (`text_moe.experts`, `vision_moe.experts`: one set per modality, each beside its own router, which `routers`
    #: names by the same dotted form): every set is sharded along its intermediate dimension, none reducing on its
    #: own, and the block's one reduction covers them all with the shared experts. () = the one set `experts_attr`
    expert_sets: tuple[str, ...] = ()
    #: size keys a config may give per expert set, as a list in `expert_sets` order (`moe_intermediate_size: [text,
    #: vision]`): each value must be a positive integer (and one the tensor-parallel size divides, where the key is
    #: in `tp_divisible_keys`)
    per_set_sizes: tuple[str, ...] = ()
    #: routed experts of 4.x sources (a ModuleList of MLPs)
    per_expert: PerExpertMLP = PerExpertMLP()
    #: routed experts of 5.x sources (3-D Parameters)
    fused: FusedExperts = FusedExperts()
    #: attributes of the MoE block that are shared-expert MLPs (their down projection is `per_expert.down`)
    shared_experts: tuple[str, ...] = ()
    #: attributes of the MoE block that compute routing weights: kept whole and of their own type on every rank
    routers: tuple[str, ...] = ("gate",)
    #: where the reduction goes (ANCHOR_*; derived: after the sum with the shared experts when there are any,
    #: else after the routed experts)
    anchor: str = ""
    #: the class every model class derives from (gets the 5.x loader override)
    pretrained_class_suffix: str = "PreTrainedModel"
    #: classes written into auto_map, by auto class (derived from the config class's prefix: the causal LM and
    #: the base model; for a multimodal wrapper the image-text-to-text model and the base model)
    auto_classes: dict[str, str] = field(default_factory=dict)
    #: config keys naming the number of routed experts (first present wins)
    num_experts_keys: tuple[str, ...]
    #: config keys naming the experts each token reaches
    top_k_keys: tuple[str, ...] = ("num_experts_per_tok",)
    #: config keys that must be positive integers when present (derived: COMMON_SIZES, the experts and top-k keys,
    #: then `more_positive_ints`)
    positive_int_keys: tuple[str, ...] = ()
    #: config keys the tensor-parallel size must divide (checked by the policy, on `text_config` when nested)
    tp_divisible_keys: tuple[str, ...] = HEADS_AND_WIDTHS
    #: attention modules that must stay replicated (MLA low-rank inputs, a DSA indexer), by attribute name
    attention_replicated: tuple[str, ...] = ()
    #: attention Parameters holding one value per attention head (e.g. sinks): sharded with the heads
    attention_head_params: tuple[str, ...] = ()
    #: attention `nn.Linear`s whose output rows are per head (an output gate): cut by the heads, not by DeepSpeed
    attention_head_linears: tuple[str, ...] = ()
    #: (norm, projection) attribute pairs of attention: an RMSNorm over the projection's whole output width (all
    #: heads): the projection and the norm stay whole, each rank keeps its heads of the normed output
    full_width_norms: tuple[tuple[str, str], ...] = ()
    #: classes of modules kept WHOLE on every rank (a token mixer whose head split is not exact: Mamba, lightning or
    #: delta attention, one shared KV head): detached while DeepSpeed shards, like the routers, and checked unchanged;
    #: no collective. The experts still shard with one reduction per MoE layer, exact since the module's output is
    #: the same on every rank. Its head counts must not be in `tp_divisible_keys`
    whole_modules: tuple[str, ...] = ()
    #: class names of zero-compute ("identity") experts among the routed experts (`nn.Identity`: the expert's output
    #: is the token itself, weighted by its routing weight): every rank of a group would add that weighted token to
    #: its partial sum, so the one reduction would count it tp times. On every rank but the group's first the policy
    #: makes each such module return zeros, so the token is counted exactly once (exact: the others add 0.0)
    identity_experts: tuple[str, ...] = ()
    #: decoder-layer attributes holding dense MLPs beside the MoE block (a ModuleList: one MLP sublayer each, LongCat's
    #: two per layer): each reduces on its own, as a dense MLP does
    dense_mlp_attrs: tuple[str, ...] = ()
    #: attention sublayers per decoder layer (the attention attribute then holds a ModuleList of them), and dense MLP
    #: sublayers under each `dense_mlp_attrs` attribute: each reduces once (LongCat: 2)
    sublayers: int = 1
    #: attributes of the MoE block that reduce on their own, where the MoE block is a whole decoder layer (Gemma 4:
    #: its routed experts and router sit beside its attention and a dense MLP, each output normed before the sum):
    #: DeepSpeed shards them with their own all-reduce, the inserted one covers the routed experts alone
    block_reductions: tuple[str, ...] = ()
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
    #: sub-configs of config.json that hold sizes the table names (`ffn_config`): read as if at the top level
    nested_sizes: tuple[str, ...] = ()
    #: a multimodal wrapper: its vision tower and projector (None: a text model)
    wrapper: Wrapper | None = None
    #: the linear-attention layers of a hybrid decoder (None: attention layers only)
    linear_attention: LinearAttention | None = None
    #: multi-head latent attention decoded absorbed (None: as the source runs it). Only where the module's attention
    #: is transformers' plain softmax(q k^T) v (no sinks): the absorbed step computes that one
    latent_attention: LatentAttention | None = None
    #: transformers releases whose source the regression matrix covers (also quoted in errors); the first is the
    #: first release that shipped the family
    known_good: tuple[str, ...] = ()
    #: hub-style remote code of this family the regression matrix covers: fixture dirs under tests/fixtures/
    #: (one `modeling_*.py`, shipped next to its `configuration_*.py`)
    remote_code_fixtures: tuple[str, ...] = ()
    #: unsupported model types built on this family's MoE block (named as the nearest family when refused)
    relatives: tuple[str, ...] = ()
    #: which decoder layers hold an MoE block
    layers: MoELayers = MoELayers()
    #: further config keys that must be positive integers when present (`positive_int_keys` ends with them)
    more_positive_ints: InitVar[tuple[str, ...]] = ()

    def __post_init__(self, more_positive_ints: tuple[str, ...]) -> None:
        derived = {}
        if not self.builtin_module:
            derived["builtin_module"] = f"transformers.models.{self.model_type}.modeling_{self.model_type}"
        if not self.auto_classes:
            prefix = self.config_class.removesuffix("Config")
            derived["auto_classes"] = (
                {"AutoModelForImageTextToText": f"{prefix}ForConditionalGeneration", "AutoModel": f"{prefix}Model"}
                if self.wrapper is not None else
                {"AutoModelForCausalLM": f"{prefix}ForCausalLM", "AutoModel": f"{prefix}Model"})
        if not self.anchor:
            derived["anchor"] = ANCHOR_SHARED_SUM if self.shared_experts else ANCHOR_ROUTED_FINAL
        if not self.positive_int_keys:
            derived["positive_int_keys"] = (*COMMON_SIZES, *self.num_experts_keys,
                                            *(k for k in self.top_k_keys if k not in COMMON_SIZES),
                                            *more_positive_ints)
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def output_data(self) -> dict:
        """The fields, which all shape what `patch` writes, as plain data (the patch fingerprint hashes them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def single_mixer_blocks(self) -> bool:
        """Each decoder layer is ONE mixer under one attribute (Nemotron-H: Mamba-2, attention, MoE or a dense MLP),
        named both an attention and an MoE-block attribute: a layer is one unit, one all-reduce at most."""
        return bool(set(self.attention_attrs) & set(self.moe_block_attrs))

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
        return _ROWS[self.wrapper.text_family] if self.wrapper and self.wrapper.text_family else self

    def names(self, legacy: bool) -> tuple[FusedExperts, tuple[str, ...]]:
        """(fused layout, routers) of a source of this generation (`legacy`: transformers 4.x)."""
        old = self.legacy if legacy and self.legacy is not None else Legacy()
        return old.fused or self.fused, old.routers or self.routers

    def experts_attr_of(self, legacy: bool) -> str:
        """The MoE-block attribute holding the routed experts in a source of this generation ("": the block itself)."""
        old = self.legacy if legacy and self.legacy is not None else Legacy()
        return self.experts_attr if old.experts_attr is None else old.experts_attr

    def expert_paths(self, legacy: bool = False) -> tuple[str, ...]:
        """Dotted paths from the MoE block to each of its routed expert sets in a source of this generation ("": the
        block itself holds the fused layout's modules)."""
        return self.expert_sets or (self.experts_attr_of(legacy),)

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """Every MoE-block attribute that holds routed experts, any generation (the anchors follow their output)."""
        if self.expert_sets:  # each set's output comes out of the block's child that holds it
            return tuple(dict.fromkeys(path.split(".", 1)[0] for path in self.expert_sets))
        found = []
        for legacy in (False, True):
            attr = self.experts_attr_of(legacy)
            fused = self.names(legacy)[0]
            found += [attr] if attr else [p.split(".", 1)[0] for p in fused.parameters]
        return tuple(dict.fromkeys(found))

    def policy_layout(self, legacy: bool = False) -> dict:
        """The plain data the generated policy's header carries (codegen.policy.runtime reads only this)."""
        fused, routers = self.names(legacy)
        return {
            "family": self.model_type,
            "moe_classes": list(self.moe_classes),
            "experts": self.experts_attr_of(legacy),
            "per_expert": {"gate": self.per_expert.gate, "up": self.per_expert.up, "down": self.per_expert.down},
            "fused": {"kind": fused.kind, "gate_up": fused.gate_up, "down": fused.down, "size_attr": fused.size_attr,
                      "gate_up_bias": fused.gate_up_bias, "down_bias": fused.down_bias,
                      **({"up": fused.up} if fused.up else {}),
                      **({"latent_in": fused.latent_in} if fused.latent_in else {}),
                      **({"latent_out": fused.latent_out} if fused.latent_out else {}),
                      "gate": fused.gate, "gate_params": list(fused.gate_params)},
            "shared": list(self.shared_experts),
            "routers": list(routers),
            "attention_replicated": list(self.attention_replicated),
            "attention_head_params": list(self.attention_head_params),
            "full_width_norms": [list(pair) for pair in self.full_width_norms],
            "attention_head_linears": list(self.attention_head_linears),
            "attention_attrs": list(self.attention_attrs),
            "replicated": list(self.wrapper.replicated) if self.wrapper else [],
            # only where a row names one: the other policies stay byte-identical
            **({"text_submodule": self.wrapper.text_submodule} if self.wrapper and self.wrapper.text_submodule
               else {}),
            "name_clashes": list(self.deepspeed_name_clashes),
            "moe_block_attrs": list(self.moe_block_attrs),
            "tp_divisible": list(self.tp_divisible_keys),
            "linear_attention": _linear_attention_layout(self.linear_attention),
            # only where a row names some: the policies of the families without any stay byte-identical
            **({"whole_modules": list(self.whole_modules)} if self.whole_modules else {}),
            **({"block_reductions": list(self.block_reductions)} if self.block_reductions else {}),
            **({"identity_experts": list(self.identity_experts)} if self.identity_experts else {}),
            **({"expert_sets": list(self.expert_sets)} if self.expert_sets else {}),
            **({"latent_attention": asdict(self.latent_attention)} if self.latent_attention else {}),
        }


def _linear_attention_layout(spec: LinearAttention | None) -> dict | None:
    if spec is None:
        return None
    return {"attr": spec.attr, "projections": [[attr, list(segments)] for attr, segments in spec.projections],
            "conv": spec.conv, "conv_segments": list(spec.conv_segments), "head_params": list(spec.head_params),
            "output": spec.output, "local_sizes": list(spec.local_sizes)}


#: the table's rows by model type, in table order (`table` fills it: codegen.families.table): a wrapper names its
#: text family by model type, `Family.text_family` looks it up here
_ROWS: dict[str, Family] = {}


def table(*rows: Family) -> dict[str, Family]:
    """The family table: `rows` by model type, in their order."""
    for row in rows:
        if row.model_type in _ROWS:
            raise ValueError(f"{row.model_type}: two rows")
        _ROWS[row.model_type] = row
    return _ROWS
