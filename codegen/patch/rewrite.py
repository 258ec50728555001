"""The rewrite of a modeling source `patch` writes: detection (codegen.patch.anchors), the edits as small libcst
transformers (codegen.patch.transforms), and the black-style safety check (codegen.patch.safety).

Parses only: the source is never imported or executed. The generated pieces (the helper block with the
marker, the version guard) are rendered from codegen/templates/ and inserted as parsed code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import libcst as cst
import libcst.matchers as m

from codegen import __version__
from codegen.errors import BadSource
from codegen.families import ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, \
    ANCHOR_ROUTED_STATEMENT, KNOB, TEXT_CONFIG, Family
from codegen.patch.anchors import LineNumbers, class_line, find_anchor, find_forward, find_moe_class, \
    has_fused_experts, parse_source
from codegen.render import render
from codegen.versions import release_of
from codegen.patch.safety import check_only_intended_changes
from codegen.patch.target import RewriteTarget
from codegen.patch.transforms import AUTO_FROM_CONFIG, AUTO_TEXT_CLASSES, VERSION_GUARD, AbsolutizeImports, \
    AddModuleBlock, BuildTextModelHere, DeclareNativeLoading, InsertCoalescedReduction, InsertReductionAfterStatement, \
    InsertVersionGuard, TakeTextConfig, WrapReturnedValue
from codegen.policy.runtime.base import PATCH_MARKER, REDUCE_HELPER, REDUCER_ATTR

#: the comment above the reduction (a block with a shared expert; `ROUTED_REDUCTION_COMMENT` without one)
REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers routed + shared experts"
ROUTED_REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers the routed experts"
#: anchor kind (codegen.families.ANCHOR_*) -> the comment above an inserted reduction
_REDUCTION_COMMENTS = {ANCHOR_ROUTED_FINAL: ROUTED_REDUCTION_COMMENT, ANCHOR_RETURNED_ROUTED: ROUTED_REDUCTION_COMMENT,
                       ANCHOR_ROUTED_STATEMENT: ROUTED_REDUCTION_COMMENT}
#: anchor kinds whose reduction wraps the returned value
_RETURNED = (ANCHOR_RETURNED_SUM, ANCHOR_RETURNED_ROUTED)


@dataclass
class Rewrite:
    code: str
    #: the MoE block, its reduced tensor and where (None: a wrapper module without MoE blocks)
    moe_class: str | None
    reduced_variable: str | None
    anchor_line: int | None
    fused_experts: bool
    absolutized_imports: list[str] = field(default_factory=list)
    #: `AutoModel.from_config(config.text_config)` calls now building the patched text decoder
    text_models_built_here: int = 0


def rewrite_modeling(text: str, target: RewriteTarget, guard_version: str | None, restore: dict | None) -> Rewrite:
    """The rewrite `patch` writes: the edits, the helper block (recording `restore`, what config.json had), and
    for transformers' own sources (`guard_version`: their release) the version guard."""
    helper = render_helper_block(target.family, restore, target.text_import)
    guard = render_version_guard(guard_version) if guard_version is not None else None
    return rewrite_source(text, target, helper, guard)


@dataclass(frozen=True)
class SourceToRewrite:
    """One modeling source as `rewrite_modeling` takes it."""

    text: str
    target: RewriteTarget
    guard_version: str | None


def rewrite_wrapper(wrapper: SourceToRewrite, decoder: SourceToRewrite, decoder_module: str,
                    restore: dict | None) -> tuple[Rewrite, Rewrite]:
    """A multimodal wrapper whose text decoder lives in another family's module (`decoder_module`, written beside the
    wrapper's): that module gets the MoE rewrite, then the wrapper's own module builds its decoder from it.
    Returns (decoder's rewrite, wrapper's rewrite); `restore` is recorded in the wrapper's module, which config.json
    names."""
    text = rewrite_modeling(decoder.text, decoder.target, decoder.guard_version, None)
    target = replace(wrapper.target, shipped_modules=wrapper.target.shipped_modules | {decoder_module},
                     moe_block=False, text_import=decoder_module, fused_text=text.fused_experts)
    return text, rewrite_modeling(wrapper.text, target, wrapper.guard_version, restore)


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
    family = target.family
    patched, found, fused = module, None, target.fused_text
    if target.moe_block:
        moe_class = find_moe_class(module, target)
        forward = find_forward(moe_class, target)
        class_name = moe_class.name.value
        anchor = find_anchor(forward, target, LineNumbers(moe_class, class_line(parsed.tree, class_name)), class_name,
                             moe_class)
        fused = has_fused_experts(module, moe_class, family)
        comment = _REDUCTION_COMMENTS.get(family.anchor, REDUCTION_COMMENT)
        edit = WrapReturnedValue if family.anchor in _RETURNED else InsertReductionAfterStatement \
            if anchor.statement is not None else InsertCoalescedReduction
        patched = patched.visit(edit(moe_class, forward, anchor, comment))
        found = (class_name, anchor)
    built = _build_text_model_here(patched, target)
    patched = _take_text_config(built.module, target)
    imports = AbsolutizeImports(target.package, target.shipped_modules)
    patched = patched.visit(imports)
    if fused:
        patched = patched.visit(DeclareNativeLoading(family.pretrained_class_suffix))
    patched = patched.visit(AddModuleBlock(cst.parse_module(helper_block)))
    if version_guard is not None:
        patched = patched.visit(InsertVersionGuard(cst.parse_module(version_guard)))
    code = patched.code
    check_only_intended_changes(text, code, target)
    return Rewrite(code=code, moe_class=found[0] if found else None,
                   reduced_variable=found[1].variable if found else None,
                   anchor_line=found[1].line if found else None, fused_experts=fused,
                   absolutized_imports=imports.changed, text_models_built_here=built.redirected)


@dataclass
class _Built:
    module: cst.Module
    redirected: int


def _build_text_model_here(module: cst.Module, target: RewriteTarget) -> _Built:
    """A wrapper's `AutoModel.from_config(config.text_config)` builds the patched text decoder instead; a wrapper
    whose decoder is another module's must have such a call, and none may be left."""
    wrapper = target.family.wrapper
    if wrapper is None or not wrapper.text_model:
        return _Built(module, 0)
    build = BuildTextModelHere(wrapper.text_model, TEXT_CONFIG)
    patched = module.visit(build)
    auto = m.Call(func=m.Attribute(value=m.OneOf(*(m.Name(n) for n in AUTO_TEXT_CLASSES)),
                                   attr=m.Name(AUTO_FROM_CONFIG[1])))
    left = [call for call in m.findall(patched, auto) if m.findall(call, m.Name(TEXT_CONFIG) | m.Attribute(
        attr=m.Name(TEXT_CONFIG)))]
    if left or (target.text_import and not build.redirected):
        raise BadSource(
            f"{target.display_name} builds its text decoder in a way codegen does not recognise (expected "
            f"`{'.'.join(AUTO_FROM_CONFIG)}(config.{TEXT_CONFIG})` or the class itself): the patched MoE blocks "
            f"would not run; known to work: {', '.join(target.family.known_good)}"
        )
    return _Built(patched, build.redirected)


def _take_text_config(module: cst.Module, target: RewriteTarget) -> cst.Module:
    """A wrapper's text-only causal LM (in the module holding the MoE blocks) takes the text config it is loaded with."""
    wrapper = target.family.wrapper
    if wrapper is None or not wrapper.causal_lm or not target.moe_block:
        return module
    take = TakeTextConfig(wrapper.causal_lm, wrapper.replicated)
    patched = module.visit(take)
    if take.added != 1:
        raise BadSource(f"{target.display_name} has no class {wrapper.causal_lm} without its own from_pretrained: "
                        f"codegen cannot make it load the checkpoint's text config; known to work: "
                        f"{', '.join(target.family.known_good)}")
    return patched


def render_helper_block(family: Family, restore: dict | None = None, text_import: str | None = None) -> str:
    """The generated block `patch` inserts after the modeling source's imports (the reduction helper + marker;
    in a wrapper's own module, the import of its patched text decoder)."""
    info = {"tool": "codegen", "version": __version__, "family": family.model_type}
    if restore:
        info["config_restore"] = restore
    text_model = family.wrapper.text_model if text_import and family.wrapper else None
    return render("modeling_block.py.j2", knob=KNOB, patch_info=info, helper=REDUCE_HELPER, marker=PATCH_MARKER,
                  reducer_attr=REDUCER_ATTR, text_import=text_import, text_model=text_model)


def render_version_guard(transformers_version: str) -> str:
    """The guard that refuses to load transformers' own patched code under another release (major.minor)."""
    release = release_of(transformers_version)
    return render("modeling_guard.py.j2", guard=VERSION_GUARD, generated_with=transformers_version, release=release)
