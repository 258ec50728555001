"""What is being rewritten: the family, where the source lives and what it may import relatively."""

from __future__ import annotations

from dataclasses import dataclass

from codegen.families import Family


@dataclass(frozen=True)
class RewriteTarget:
    """Where the source lives and what it may import relatively, so imports can be made absolute."""

    family: Family
    #: absolute package of the source, e.g. `transformers.models.qwen2_moe`
    package: str
    #: module names shipped next to the patched file in the model dir (relative imports to them stay)
    shipped_modules: frozenset[str]
    #: how to name the source in error messages
    display_name: str
    transformers_version: str | None = None
    #: the source holds the family's MoE blocks (False: a multimodal wrapper's own module, whose text decoder
    #: comes from the patched module `text_import` written beside it)
    moe_block: bool = True
    text_import: str | None = None
    #: the source's experts are fused 3-D Parameters (set for a wrapper's own module from its text module's)
    fused_text: bool = False
