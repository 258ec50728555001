"""The generated parts of the README and docs/ that come from tables: the support summary (README) and the
support tables (docs/support.md), rendered from the family table (codegen.families): what is supported, how, and
what stock DeepSpeed AutoTP does to the same checkpoint; and the exit codes (docs/usage.md), from codegen.errors.TABLE.
So the docs can only say what the tables say.

`python -m codegen regression regenerate` rewrites these sections between their markers (codegen.splice); a test
asserts the committed files hold exactly this rendering (and tests/test_verify.py asserts the stock figures quoted).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from codegen import errors, splice
from codegen.families import (ALIASES, ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL,
                              ANCHOR_ROUTED_STATEMENT, ANCHOR_SHARED_INPLACE_SUM, ANCHOR_SHARED_SUM, EXAMPLES, FAMILIES,
                              NOT_YET, REFUSED, STOCK_AUTOTP, UNSUPPORTED, UNSUPPORTED_STOCK, Family)

REGENERATE = "`python -m codegen regression regenerate`"
#: the README's support summary (counts and names)
SUMMARY = splice.markers("support-summary", f"{REGENERATE} from codegen.families")
#: docs/support.md's tables: supported, aliases, not yet, refused
BEGIN, END = splice.markers("support-tables", f"{REGENERATE} from codegen.families")
#: docs/usage.md's exit-code table
EXIT_CODES = splice.markers("exit-codes", f"{REGENERATE} from codegen.errors.TABLE")

_ANCHOR_WORDS = {
    ANCHOR_SHARED_SUM: "after the routed + shared sum",
    ANCHOR_ROUTED_FINAL: "routed output is final",
    ANCHOR_RETURNED_SUM: "the sum built in `return`",
    ANCHOR_RETURNED_ROUTED: "the routed call in `return`",
    ANCHOR_SHARED_INPLACE_SUM: "after the in-place routed + shared sum",
    ANCHOR_ROUTED_STATEMENT: "right after the routed call (in its branch), before its norm",
}


def _code(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _experts(family: Family) -> str:
    return _expert_layout(family) + (f", {len(family.expert_sets)} sets ({_code(family.expert_sets)})"
                                     if family.expert_sets else "")


def _expert_layout(family: Family) -> str:
    new = family.names(legacy=False)[0].kind
    if not family.first_release.startswith("4"):
        return f"fused `{new}`"
    old = family.legacy.fused.kind if family.legacy and family.legacy.fused else ""
    return f"{'fused `' + old + '`' if old else 'per-expert'} / fused `{new}`"


def _rules(family: Family) -> str:
    """What the policy does besides the experts (attention and wrapper rules), in the table's own names."""
    parts = []
    if family.shared_experts:
        parts.append(f"shared {_code(family.shared_experts)}")
    parts.append(f"routers {_code(family.names(legacy=False)[1])} whole")
    latent = [n for n in (family.fused.latent_in, family.fused.latent_out) if n]
    if latent:
        parts.append(f"latent projections {_code(latent)} whole (where present), the output one's bias on one rank")
    if family.single_mixer_blocks:
        parts.append("each block one mixer (attention, MoE or dense MLP), one reduction at most")
    if family.attention_replicated:
        parts.append(f"{_code(family.attention_replicated)} replicated")
    if family.latent_attention is not None:
        parts.append(f"MLA decode absorbed (`{family.latent_attention.up_projection}` on the query and output, "
                     "not the latent cache; where the source caches the latent)")
    if family.attention_head_params:
        parts.append(f"{_code(family.attention_head_params)} split by head")
    if family.full_width_norms:
        parts.append(f"full-width {_code(n for n, _ in family.full_width_norms)}: projections whole, own heads kept")
    if family.linear_attention is not None:
        mixer = family.linear_attention
        parts.append(f"linear attention `{mixer.attr}` ({_code(a for a, _ in mixer.projections)}, "
                     f"`{mixer.conv}`, {_code(mixer.head_params)}) sharded by key-head groups, `{mixer.output}` "
                     "reduced once")
    if family.identity_experts:
        parts.append(f"zero-compute experts {_code(family.identity_experts)} counted once (on each group's first rank)")
    if family.dense_mlp_attrs:
        parts.append(f"{family.sublayers} attention and {family.sublayers} dense MLP ({_code(family.dense_mlp_attrs)}) "
                     "sublayers per layer, each reducing on its own")
    if family.block_reductions:
        parts.append(f"the MoE block is the decoder layer: {_code(family.block_reductions)} split, reducing on their own")
    if family.whole_modules:
        parts.append(f"{_code(family.whole_modules)} whole on every rank (not split: no collective, its weights and "
                     "cache are whole on each rank)")
    if family.deepspeed_name_clashes:
        parts.append(f"class names hidden from AutoTP's {_code(family.deepspeed_name_clashes)} special case")
    if family.wrapper is not None:
        parts.append(f"vision {_code(family.wrapper.replicated)} whole")
        if family.wrapper.text_family:
            parts.append(f"decoder from `{family.wrapper.text_family}`")
        if family.wrapper.runs_as_causal_lm:
            parts.append(f"runs as `{family.wrapper.causal_lm}`")
        if family.wrapper.text_submodule:
            parts.append(f"runs its `{family.wrapper.text_submodule}` (sharded alone: the wrapper's other modules whole)")
    return "; ".join(parts)


def _releases(family: Family) -> str:
    releases = family.releases
    span = releases[0] if len(releases) == 1 else f"{releases[0]} … {releases[-1]}"
    return span + (", hub remote code" if family.remote_code_fixtures else "")


def _stock(family: Family) -> str:
    stock = STOCK_AUTOTP[family.model_type]
    if stock.crash:
        return f"crash: `{stock.crash}…` ({stock.why})" if stock.why else f"crash: `{stock.crash}…`"
    figure = f"{stock.allreduces} AR, experts {stock.experts:.2f}"
    if stock.image_crash:
        figure += f"; with an image: crash `{stock.image_crash}…` (it splits the vision tower)"
    elif stock.image_allreduces:
        figure += f"; with an image: {stock.image_allreduces} AR (it splits the vision tower)"
    if stock.legacy_wrong:
        figure += f"; **wrong** {stock.legacy_wrong}"
    return f"{figure}, **wrong**: {stock.why}" if stock.wrong else figure


def _codegen(family: Family) -> str:
    """The contract on the same example: one all-reduce per attention, MoE and dense layer, one for the LM head
    (with or without an image)."""
    example = EXAMPLES[family.model_type]
    layers = example.tiny[family.layers.count]
    image = "" if family.wrapper is None else ("; with an image: the same" if family.wrapper.image_input else
                                               "; text only (its wrapper's forward does not run)"
                                               if family.wrapper.runs_as_causal_lm else "; text only")
    # an MoE block that is a whole decoder layer keeps a dense MLP beside its experts (Gemma 4): one more per MoE layer
    beside = 0
    if set(family.block_reductions) & set(family.moe_block_attrs):
        from codegen.patch.config import moe_layers

        beside = len(moe_layers(example.tiny, family))
    # decoder layers of sublayers (LongCat): `sublayers` attention blocks and as many dense MLPs per dense attribute
    beside += layers * (family.sublayers - 1 + family.sublayers * len(family.dense_mlp_attrs))
    units = layers if family.single_mixer_blocks else 2 * layers + beside  # a single-mixer block is one unit
    return f"{units - example.whole_mixers + 1} AR, experts 0.50{image}"


def supported_table() -> str:
    lines = ["| model type | MoE block | anchor | experts 4.x / 5.x | policy rules | regression matrix | "
             "stock AutoTP (TP=2, tiny) | codegen (same) |",
             "|---|---|---|---|---|---|---|---|"]
    for family in FAMILIES.values():
        lines.append(f"| `{family.model_type}` | {_code(family.moe_classes)} | {_ANCHOR_WORDS[family.anchor]} | "
                     f"{_experts(family)} | {_rules(family)} | {_releases(family)} | {_stock(family)} | "
                     f"{_codegen(family)} |")
    return "\n".join(lines)


def alias_table() -> str:
    lines = ["| model type | patched as | needs |", "|---|---|---|"]
    for name, alias in ALIASES.items():
        lines.append(f"| `{name}` | `{alias.family}` (config's model type kept) | its remote code "
                     f"`{alias.remote_module}.py` in the dir |")
    return "\n".join(lines)


def unsupported_table(status: str) -> str:
    """One row per reason and stock figure: the refusal `patch` prints is both (codegen.patch.config)."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for name, entry in UNSUPPORTED.items():
        if entry.status == status:
            by_reason.setdefault((entry.why, UNSUPPORTED_STOCK.get(name, "not measured")), []).append(name)
    lines = ["| model type | reason (what `patch` says) | stock DeepSpeed AutoTP on the unpatched tiny example |",
             "|---|---|---|"]
    lines += [f"| {_code(sorted(names))} | {why} | {stock} |" for (why, stock), names in by_reason.items()]
    return "\n".join(lines)


def render() -> str:
    """docs/support.md's support tables, between the markers."""
    return "\n".join([
        "### Supported",
        "",
        supported_table(),
        "",
        "### Aliases",
        "",
        alias_table(),
        "",
        "### Not yet",
        "",
        unsupported_table(NOT_YET),
        "",
        "### Refused",
        "",
        unsupported_table(REFUSED),
        "",
    ])


def counts() -> dict[str, int]:
    """Model types per status: supported, alias, not yet, refused."""
    return {"supported": len(FAMILIES), "alias": len(ALIASES),
            NOT_YET: sum(e.status == NOT_YET for e in UNSUPPORTED.values()),
            REFUSED: sum(e.status == REFUSED for e in UNSUPPORTED.values())}


def _item(head: str, text: str) -> list[str]:
    return textwrap.wrap(f"- **{head}**: {text}", 116, subsequent_indent="  ", break_on_hyphens=False)


def summary() -> str:
    """The README's support summary, between its markers."""
    n = counts()
    aliases = ", ".join(f"`{name}` (patched as `{a.family}`)" for name, a in ALIASES.items())
    lines = textwrap.wrap(f"{n['supported']} model types supported, {n['alias']} alias, {n[NOT_YET]} not yet, "
                          f"{n[REFUSED]} refused (every mixture-of-experts model type of the pinned transformers):",
                          116) + [""]
    lines += _item(f"supported ({n['supported']})", _code(FAMILIES))
    lines += _item(f"alias ({n['alias']})", aliases)
    lines += _item(f"not yet ({n[NOT_YET]})", "no row yet; `patch` exits 2 with one line saying what is missing "
                   "(a row of existing kinds not verified yet, or a new kind)")
    lines += _item(f"refused ({n[REFUSED]})", "outside what a tensor-parallel policy for a causal-LM MoE block can "
                   "make exact; `patch` exits 2 with the reason")
    return "\n".join(lines) + "\n"


def exit_codes() -> str:
    """The exit-code table, from codegen.errors.TABLE (what `--help` prints)."""
    lines = ["| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {text.replace('|', chr(92) + '|')} |" for code, text in errors.TABLE]
    return "\n".join(lines) + "\n"


def sections() -> dict[str, list[tuple[str, str, str]]]:
    """Each file (relative to the repository root) and its (begin, end, body) sections."""
    return {
        "README.md": [(*SUMMARY, summary())],
        "docs/support.md": [(BEGIN, END, render())],
        "docs/usage.md": [(*EXIT_CODES, exit_codes())],
    }


def stale(root: Path) -> list[str]:
    """The files whose sections differ from their rendering (relative paths)."""
    out = []
    for name, parts in sections().items():
        text = (root / name).read_text(encoding="utf-8")
        if any(splice.section(text, begin, end, name) != body for begin, end, body in parts):
            out.append(name)
    return out


def refresh(root: Path) -> list[str]:
    """Rewrite every section under the repository root `root`; the files that changed (relative paths)."""
    return [name for name, parts in sections().items() if splice.refresh(root / name, parts)]
