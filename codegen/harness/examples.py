"""Small random checkpoints in hub format, built locally (no hub access): the demo's, the bench's and the tests' inputs.

The shapes are the family table's examples (`codegen.families.EXAMPLES`): `tiny` keeps tests fast; `toy` (the bench's default,
called "bench" here) keeps a real model's routing (experts, top-k, shared experts, dense-first layers, MLA
ranks) scaled to fit a CPU; `full` is a real checkpoint's published widths (the project's copy of its
config, codegen/harness/published/) with two decoder layers and a small vocabulary, so one layer costs what it
costs in production (several GB per example in float32: build them with dtype="bfloat16").
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from codegen import versions
from codegen.families import EXAMPLES, FAMILIES, FULL_WIDTH_CAPS, PUBLISHED_ROUTING_KEYS, TEXT_CONFIG, VISION_CONFIG, \
    AUDIO_CONFIG
from codegen.modeldir.layout import CONFIG

#: the example sizes, as `build_example(size=...)` names them
SIZES = ("tiny", "bench", "full")
#: where the published configs of real checkpoints are kept (architecture fields only; no weights)
PUBLISHED = Path(__file__).resolve().parent / "published"
#: the dtypes `build_example` saves (torch attribute names); float32 is what tests and the demo use
DTYPES = ("float32", "bfloat16", "float16")
#: shards `save_pretrained` writes at most: bounds what a save holds in memory beside the model
#: (transformers 5.x writes one 50GB shard by default); the tiny and bench examples stay one file
MAX_SHARD_SIZE = "2GB"


@lru_cache(maxsize=None)
def published_config(name: str) -> dict:
    return json.loads((PUBLISHED / name).read_text())


def shape(family: str, size: str) -> dict | None:
    """The config values of `family`'s example of `size` (None where the family has none of that size)."""
    examples = EXAMPLES.get(family)
    if examples is None:
        return None
    if size == "tiny":
        return dict(examples.tiny)
    if size == "bench":
        return dict(examples.toy) if examples.toy is not None else None
    if size != "full":
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    if not examples.published:
        return None
    published = published_config(examples.published)
    full = {k: published[k] for k in (*examples.tiny, *PUBLISHED_ROUTING_KEYS) if k in published}
    full.update(FULL_WIDTH_CAPS)
    layers = full["num_hidden_layers"]
    for key, value in list(full.items()):
        if isinstance(value, list) and len(value) == published.get("num_hidden_layers"):
            full[key] = value[:layers]  # per-layer lists (layer_types, mlp_layer_types) cut to the layers kept
    full.update(examples.full_overrides)
    return full


def families_with(size: str) -> tuple[str, ...]:
    """The families that have an example of `size` and that the installed transformers ships, in table order."""
    return tuple(f for f in installed_families() if shape(f, size) is not None)


@lru_cache(maxsize=1)
def installed_families() -> tuple[str, ...]:
    """The families whose modules the installed transformers ships (a wrapper's text decoder's too), in table order."""
    from codegen.patch.source import builtin_source_path

    return tuple(name for name, family in FAMILIES.items()
                 if builtin_source_path(family) is not None and builtin_source_path(family.text_family) is not None)


def example_config(family: str, size: str = "tiny", overrides: dict | None = None):
    """The transformers config of `family`'s example of `size` (its text sizes changed by `overrides`): the text
    model's config, or for a multimodal wrapper the wrapper's, built around its text config, its tiny vision tower
    and its own keys."""
    import transformers

    values = shape(family, size)
    if values is None:
        raise ValueError(f"{family} has no {size} example")
    values.update(overrides or {})
    row = FAMILIES[family]
    if size == "tiny" and versions.is_legacy(transformers.__version__):
        values.update(EXAMPLES[family].tiny_legacy)  # 4.x spells some keys otherwise
    if row.wrapper is None:
        return getattr(transformers, row.config_class)(**values)
    example = EXAMPLES[family]
    subs = {TEXT_CONFIG: _for_installed(values), VISION_CONFIG: dict(example.vision or {}),
            **({AUDIO_CONFIG: dict(example.audio)} if example.audio is not None else {})}
    if row.wrapper.submodule_config:  # the towers and the text config one level down, in the text submodule's
        subs = {row.wrapper.submodule_config: {**subs, **example.submodule}}
    return transformers.AutoConfig.for_model(row.model_type, **subs, **_for_installed_nested(example.wrapper))


def _for_installed(text: dict) -> dict:
    """Rotary settings as the installed transformers spells them: 4.x reads `rope_theta` + `rope_scaling`."""
    import transformers

    if not versions.is_legacy(transformers.__version__) or "rope_parameters" not in text:
        return text
    rope = dict(text.pop("rope_parameters"))
    return {**text, "rope_theta": rope.pop("rope_theta", 10000.0), "rope_scaling": rope}


def _for_installed_nested(values: dict) -> dict:
    """`_for_installed` on every `text_config` nested in a wrapper's other configs (a talker's)."""
    return {k: ({**v, TEXT_CONFIG: _for_installed(dict(v[TEXT_CONFIG]))} if isinstance(v, dict)
                and isinstance(v.get(TEXT_CONFIG), dict) else v) for k, v in values.items()}


def model_class(family: str):
    """The auto class a family's checkpoints load with: the first of its `auto_classes` the installed transformers
    has (4.x lacks some: `AutoModelForMultimodalLM`)."""
    import transformers

    return next(getattr(transformers, name) for name in FAMILIES[family].auto_classes if hasattr(transformers, name))


def build_example(family: str, out_dir: Path, size: str = "tiny", seed: int = 0, dtype: str = "float32",
                  overrides: dict | None = None) -> Path:
    """A random checkpoint saved with `save_pretrained` (hub format: per-expert weights); `overrides` changes sizes
    of the example (e.g. more kv heads, for a tensor-parallel size that must divide them).

    Weights are drawn in float32 (seeded) whatever `dtype` is, then cast in place one Parameter at a time:
    a bfloat16 example holds the float32 example's weights rounded, and the build never holds two copies.
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    config = example_config(family, size, overrides)
    torch.manual_seed(seed)
    model = model_class(family).from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)  # non-trivial routers and experts
    if dtype != "float32":
        model.to(getattr(torch, dtype))  # Parameter by Parameter: the float32 storage is freed as it goes
    model.save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE)
    return out_dir


def shape_of(directory: Path, family: str, size: str) -> dict:
    """The sizes an example of `size` sets (its integer config values), as its config.json holds them."""
    config = json.loads(Path(directory, CONFIG).read_text())
    return {k: config[k] for k, v in shape(family, size).items()
            if isinstance(v, int) and not isinstance(v, bool) and k in config}


#: the chat template of the example tokenizer (what `serve`'s /v1/chat/completions renders)
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def build_tokenizer(out_dir: Path) -> Path:
    """A byte-level tokenizer of exactly 256 tokens (every example's vocabulary is at least that), saved next to
    an example checkpoint so `serve` and `generate` can run it; offline, from the `tokenizers` library alone.
    Token ids are byte values; byte 0 is the end-of-sequence and padding token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ordered = [ch for _, ch in sorted(_byte_level_chars().items())]
    assert set(ordered) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(ordered)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=ordered[0], pad_token=ordered[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-unicode table: the character byte-level BPE writes for each byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table
