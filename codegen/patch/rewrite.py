"""The rewrite of a modeling source `patch` writes: detection (codegen.patch.anchors), the edits as small libcst
transformers (codegen.patch.transforms), and the black-style safety check (codegen.patch.safety).

Parses only: the source is never imported or executed. The generated pieces (the helper block with the
marker, the version guard) are rendered from templates/ and inserted as parsed code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from codegen import __version__
from codegen.errors import BadSource
from codegen.families import ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, KNOB, Family
from codegen.patch.anchors import LineNumbers, class_line, find_anchor, find_forward, find_moe_class, \
    has_fused_experts, parse_source
from codegen.render import render
from codegen.patch.safety import check_only_intended_changes
from codegen.patch.target import RewriteTarget
from codegen.patch.transforms import VERSION_GUARD, AbsolutizeImports, AddModuleBlock, DeclareNativeLoading, \
    InsertCoalescedReduction, InsertVersionGuard, WrapReturnedSum
from codegen.policy.runtime.base import PATCH_MARKER, REDUCE_HELPER, REDUCER_ATTR

#: the comment above the reduction (a block with a shared expert; `ROUTED_REDUCTION_COMMENT` without one)
REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers routed + shared experts"
ROUTED_REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers the routed experts"
#: anchor kind (codegen.families.ANCHOR_*) -> the comment above an inserted reduction
_REDUCTION_COMMENTS = {ANCHOR_ROUTED_FINAL: ROUTED_REDUCTION_COMMENT}


@dataclass
class Rewrite:
    code: str
    moe_class: str
    reduced_variable: str
    anchor_line: int
    fused_experts: bool
    absolutized_imports: list[str] = field(default_factory=list)


def rewrite_modeling(text: str, target: RewriteTarget, guard_version: str | None, restore: dict | None) -> Rewrite:
    """The rewrite `patch` writes: the edits, the helper block (recording `restore`, what config.json had), and
    for transformers' own sources (`guard_version`: their release) the version guard."""
    helper = render_helper_block(target.family, restore)
    guard = render_version_guard(guard_version) if guard_version is not None else None
    return rewrite_source(text, target, helper, guard)


def rewrite_source(text: str, target: RewriteTarget, helper_block: str, version_guard: str | None = None) -> Rewrite:
    """Rewrite one modeling source. Parses only: the source is never imported or executed."""
    try:
        return _rewrite(text, target, helper_block, version_guard)
    except RecursionError:  # libcst's visitors recurse: a pathologically deep expression
        raise BadSource(
            f"{target.display_name} nests expressions too deeply to rewrite safely: not a modeling source"
        ) from None


def _rewrite(text: str, target: RewriteTarget, helper_block: str, version_guard: str | None) -> Rewrite:
    parsed = parse_source(text, target)
    module = parsed.module
    moe_class = find_moe_class(module, target)
    forward = find_forward(moe_class, target)
    class_name = moe_class.name.value
    anchor = find_anchor(forward, target, LineNumbers(moe_class, class_line(parsed.tree, class_name)), class_name)
    fused = has_fused_experts(module, moe_class, target.family)

    comment = _REDUCTION_COMMENTS.get(target.family.anchor, REDUCTION_COMMENT)
    edit = WrapReturnedSum if target.family.anchor == ANCHOR_RETURNED_SUM else InsertCoalescedReduction
    patched = module.visit(edit(moe_class, forward, anchor, comment))
    imports = AbsolutizeImports(target.package, target.shipped_modules)
    patched = patched.visit(imports)
    if fused:
        patched = patched.visit(DeclareNativeLoading(target.family.pretrained_class_suffix))
    patched = patched.visit(AddModuleBlock(cst.parse_module(helper_block)))
    if version_guard is not None:
        patched = patched.visit(InsertVersionGuard(cst.parse_module(version_guard)))
    code = patched.code
    check_only_intended_changes(text, code, target)
    return Rewrite(code=code, moe_class=class_name, reduced_variable=anchor.variable, anchor_line=anchor.line,
                   fused_experts=fused, absolutized_imports=imports.changed)


def render_helper_block(family: Family, restore: dict | None = None) -> str:
    """The generated block `patch` inserts after the modeling source's imports (the reduction helper + marker)."""
    info = {"tool": "codegen", "version": __version__, "family": family.model_type}
    if restore:
        info["config_restore"] = restore
    return render("modeling_block.py.j2", knob=KNOB, patch_info=info, helper=REDUCE_HELPER, marker=PATCH_MARKER,
                  reducer_attr=REDUCER_ATTR)


def render_version_guard(transformers_version: str) -> str:
    """The guard that refuses to load transformers' own patched code under another release (major.minor)."""
    release = ".".join(transformers_version.split(".")[:2])
    return render("modeling_guard.py.j2", guard=VERSION_GUARD, generated_with=transformers_version, release=release)
