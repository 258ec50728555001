"""The libcst rewrite of a modeling source: small transformers, matchers for detection, nothing else touched.

Three edits, each its own transformer:
- `InsertCoalescedReduction`: reduce the MoE block's output once (guarded; see templates/modeling_block.py.j2),
  where the family's anchor kind (codegen.families.ANCHOR_*) says: after the statement that adds the shared
  expert output to the routed experts' sum, or, without a shared expert, after the statement that completes
  the routed output; `WrapReturnedSum` reduces a routed + shared sum built inside the `return`;
- `AbsolutizeImports`: relative imports become `transformers.` imports so the file loads as remote code;
- `AddModuleBlock` / `DeclareNativeLoading`: the guard helper after the imports, and for transformers 5.x
  sources (fused 3-D experts) the override that keeps transformers' checkpoint conversion mapping.
A black-style safety check then proves, on the ASTs, that nothing else changed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from codegen.errors import BadSource
from codegen.families import ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, ANCHOR_SHARED_SUM, Family

HELPER = "_codegen_moe_all_reduce"
#: the comment above the reduction (a block with a shared expert; `ROUTED_REDUCTION_COMMENT` without one)
REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers routed + shared experts"
ROUTED_REDUCTION_COMMENT = "# codegen: one all-reduce per MoE layer covers the routed experts"
MARKER = "_CODEGEN_PATCH"
NATIVE_LOADING_METHOD = "is_custom_code"


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


@dataclass
class Rewrite:
    code: str
    moe_class: str
    reduced_variable: str
    anchor_line: int
    fused_experts: bool
    absolutized_imports: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Anchor:
    index: int  # index of the top-level statement of forward's body to insert after (or to wrap, for a return)
    variable: str
    line: int


def rewrite_source(text: str, target: RewriteTarget, helper_block: str) -> Rewrite:
    """Rewrite one modeling source. Parses only: the source is never imported or executed."""
    try:
        return _rewrite(text, target, helper_block)
    except RecursionError:  # libcst's visitors recurse: a pathologically deep expression
        raise BadSource(
            f"{target.display_name} nests expressions too deeply to rewrite safely: not a modeling source"
        ) from None


def _rewrite(text: str, target: RewriteTarget, helper_block: str) -> Rewrite:
    module = _parse(text, target)
    _refuse_if_already_patched(module, target)
    moe_class = _find_moe_class(module, target)
    forward = _find_forward(moe_class, target)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    anchor = _ANCHOR_FINDERS[target.family.anchor](forward, target, positions, moe_class.name.value)
    fused = _has_fused_experts(module, moe_class, target.family)

    if target.family.anchor == ANCHOR_RETURNED_SUM:
        patched = module.visit(WrapReturnedSum(moe_class.name.value, anchor))
    else:
        comment = _REDUCTION_COMMENTS.get(target.family.anchor, REDUCTION_COMMENT)
        patched = module.visit(InsertCoalescedReduction(moe_class.name.value, anchor, comment))
    imports = AbsolutizeImports(target.package, target.shipped_modules)
    patched = patched.visit(imports)
    if fused:
        patched = patched.visit(DeclareNativeLoading(target.family.pretrained_class_suffix))
    patched = patched.visit(AddModuleBlock(cst.parse_module(helper_block)))
    code = patched.code
    check_only_intended_changes(text, code, target)
    return Rewrite(
        code=code,
        moe_class=moe_class.name.value,
        reduced_variable=anchor.variable,
        anchor_line=anchor.line,
        fused_experts=fused,
        absolutized_imports=imports.changed,
    )


# --------------------------------------------------------------------------------------------- detection


def _version_hint(target: RewriteTarget) -> str:
    seen = f" (transformers {target.transformers_version})" if target.transformers_version else ""
    return f"{target.display_name}{seen}; known to work: {', '.join(target.family.known_good)}"


def _parse(text: str, target: RewriteTarget) -> cst.Module:
    if not text.strip():
        raise BadSource(f"{target.display_name} is empty: expected a {target.family.model_type} modeling source")
    # CPython's parser first: it rejects what Python could never import (and what crashes or stalls
    # libcst's native parser: 3000 nested parentheses segfault it) with a clean error
    try:
        ast.parse(text)
    except SyntaxError as exc:
        raise BadSource(
            f"{target.display_name} is not valid Python (line {exc.lineno}: {exc.msg}): fix the file or pass --source"
        ) from None
    except ValueError as exc:  # null bytes (Python < 3.12)
        raise BadSource(f"{target.display_name} is not valid Python ({exc}): fix the file or pass --source") from None
    except (RecursionError, MemoryError):
        raise BadSource(f"{target.display_name} nests too deeply for Python to compile: not a modeling source") from None
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise BadSource(
            f"{target.display_name} is not valid Python (line {exc.raw_line}): fix the file or pass --source"
        ) from None


def _refuse_if_already_patched(module: cst.Module, target: RewriteTarget) -> None:
    for stmt in module.body:
        if m.matches(stmt, m.FunctionDef(name=m.Name(HELPER))) or m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(MARKER))])])
        ):
            raise BadSource(
                f"{target.display_name} was already patched by codegen: run `python -m codegen revert` "
                "or pass --source with the unpatched modeling file"
            )


def _find_moe_class(module: cst.Module, target: RewriteTarget) -> cst.ClassDef:
    names = target.family.moe_classes
    candidates = [s for s in module.body if m.matches(s, m.ClassDef(name=m.OneOf(*[m.Name(n) for n in names])))]
    if not candidates:
        raise BadSource(
            f"no MoE block ({' or '.join(names)}) in {_version_hint(target)}"
        )
    if len(candidates) > 1:
        # The one the model instantiates is the MoE block; the others are dead code.
        used = [c for c in candidates if _is_instantiated(module, c.name.value)]
        if len(used) == 1 and len({c.name.value for c in candidates}) == len(candidates):
            return used[0]
        found = ", ".join(c.name.value for c in candidates)
        raise BadSource(f"two candidate MoE classes ({found}) in {target.display_name}: cannot tell which one runs")
    return candidates[0]


def _is_instantiated(module: cst.Module, class_name: str) -> bool:
    return bool(m.findall(module, m.Call(func=m.Name(class_name))))


def _find_forward(moe_class: cst.ClassDef, target: RewriteTarget) -> cst.FunctionDef:
    forwards = [s for s in moe_class.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if len(forwards) != 1:
        raise BadSource(f"{moe_class.name.value} has {len(forwards)} forward methods in {_version_hint(target)}")
    return forwards[0]


def _self_attr(attrs: tuple[str, ...]) -> m.BaseMatcherNode:
    return m.Attribute(value=m.Name("self"), attr=m.OneOf(*[m.Name(a) for a in attrs]))


def _mentions(node: cst.CSTNode, attrs: tuple[str, ...], names: set[str]) -> bool:
    if m.findall(node, _self_attr(attrs)):
        return True
    return any(m.findall(node, m.Name(n)) for n in names)


def _find_anchor(forward: cst.FunctionDef, target: RewriteTarget, positions, class_name: str) -> _Anchor:
    """Find the statement where routed experts' sum and shared expert output meet.

    Structural, not by name: an assignment `T = A + B` (or `T += B`) where one operand carries the shared
    expert output (a `self.<shared>` call, or a name assigned from one) and the other does not.
    """
    attrs = target.family.shared_experts
    body = list(forward.body.body)
    shared_names = _shared_names(body, attrs)

    found: list[_Anchor] = []
    for index, stmt in enumerate(body):
        for node in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name())]) | m.AugAssign(target=m.Name())):
            if isinstance(node, cst.Assign):
                value = node.value
                if not m.matches(value, m.BinaryOperation(operator=m.Add())):
                    continue
                sides = [_mentions(value.left, attrs, shared_names), _mentions(value.right, attrs, shared_names)]
                name = node.targets[0].target.value
            else:
                if not m.matches(node.operator, m.AddAssign()):
                    continue
                name = node.target.value
                sides = [name in shared_names, _mentions(node.value, attrs, shared_names)]
            if sides.count(True) == 1:
                found.append(_Anchor(index, name, positions[node].start.line))

    if not found:
        raise BadSource(
            f"no recognisable expert weighted sum (routed + shared experts) in {class_name}.forward of "
            f"{_version_hint(target)}"
        )
    anchor = found[-1]
    others = {a.variable for a in found if a.variable != anchor.variable}
    if others:
        raise BadSource(
            f"{class_name}.forward combines the shared expert into several tensors "
            f"({', '.join(sorted(others | {anchor.variable}))}) in {target.display_name}: cannot place one reduction"
        )
    for stmt in body[: anchor.index + 1]:
        returns = m.findall(stmt, m.Return())
        if returns:
            line = positions[returns[0]].start.line
            raise BadSource(
                f"{class_name}.forward returns at line {line} before the expert sum at line {anchor.line} in "
                f"{target.display_name}: one reduction cannot cover every path"
            )
    _require_bound_after(body, anchor, target, class_name)
    return anchor


def _shared_names(body: list[cst.BaseStatement], attrs: tuple[str, ...]) -> set[str]:
    """Names that carry the shared expert output, to a fixed point (`s = self.shared(x)`; `s = g * s`)."""
    shared_names: set[str] = set()
    assigns = [a for stmt in body for a in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name())]))]
    changed = True
    while changed:
        changed = False
        for assign in assigns:
            name = assign.targets[0].target.value
            if name in shared_names or m.matches(assign.value, m.BinaryOperation(operator=m.Add())):
                continue
            if _mentions(assign.value, attrs, shared_names):
                shared_names.add(name)
                changed = True
    return shared_names


def _binds(node: cst.CSTNode, name: str) -> bool:
    """Whether `node` assigns `name` (plain, augmented or annotated assignment, loop or `with` target)."""
    target = m.Name(name)
    return bool(
        m.findall(node, m.AssignTarget(target=target))
        or m.findall(node, m.AssignTarget(target=m.Tuple(elements=[m.ZeroOrMore(), m.Element(target), m.ZeroOrMore()])))
        or m.findall(node, m.AugAssign(target=target) | m.AnnAssign(target=target) | m.For(target=target))
        or m.findall(node, m.AsName(name=target))
    )


def _require_bound_after(
    body: list[cst.BaseStatement], anchor: _Anchor, target: RewriteTarget, class_name: str
) -> None:
    """A sum inside one branch of an `if` is reduced after the whole `if`: every path must bind the tensor.

    `if c: y = y + s` is fine when `y` was bound before the `if`; `if c: y = r + s` / `else: y = r` too.
    `if c: y = r + s` / `else: z = r` is not: after the `if`, `y` is unbound on the `else` path.
    """
    stmt = body[anchor.index]
    if not isinstance(stmt, cst.If) or any(_binds(s, anchor.variable) for s in body[: anchor.index]):
        return
    branches: list[cst.BaseSuite] = []
    node: cst.If | cst.Else | None = stmt
    while isinstance(node, cst.If):
        branches.append(node.body)
        node = node.orelse
    if node is None or not all(_binds(b, anchor.variable) for b in [*branches, node.body]):
        raise BadSource(
            f"{class_name}.forward binds `{anchor.variable}` in only some branches of the `if` that holds the "
            f"expert sum (line {anchor.line}) in {target.display_name}: one reduction after it cannot cover every path"
        )


def _find_routed_final_anchor(forward: cst.FunctionDef, target: RewriteTarget, positions, class_name: str) -> _Anchor:
    """No shared expert: the routed experts' output is the block's output; reduce it once it is complete.

    Structural: a top-level `T = ...self.<experts>(...)...` (transformers 5.x, fused experts called once), or
    a top-level loop that mentions `self.<experts>` and accumulates into a name bound before it
    (`T.index_add_(...)`, `T += ...`, `T[i] += ...`: transformers 4.x, one expert per iteration).
    """
    experts = (target.family.experts_attr,)
    body = list(forward.body.body)
    found: list[_Anchor] = []
    for index, stmt in enumerate(body):
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            assign = stmt.body[0]
            if m.findall(assign.value, m.Call(func=_self_attr(experts))):
                found.append(_Anchor(index, assign.targets[0].target.value, positions[assign].start.line))
        elif isinstance(stmt, (cst.For, cst.While)) and m.findall(stmt, _self_attr(experts)):
            for name in _accumulated_names(stmt):
                if any(_binds(s, name) for s in body[:index]):
                    found.append(_Anchor(index, name, positions[stmt].start.line))

    if not found:
        raise BadSource(
            f"no recognisable routed experts output (`T = self.{experts[0]}(...)` or a loop over the experts "
            f"accumulating into `T`) in {class_name}.forward of {_version_hint(target)}"
        )
    variables = {a.variable for a in found}
    if len(found) > 1:
        raise BadSource(
            f"{class_name}.forward computes the routed experts' output {len(found)} times "
            f"({', '.join(sorted(variables))}, lines {', '.join(str(a.line) for a in found)}) in "
            f"{target.display_name}: cannot place one reduction"
        )
    anchor = found[0]
    for stmt in body[: anchor.index + 1]:
        returns = m.findall(stmt, m.Return())
        if returns:
            line = positions[returns[0]].start.line
            raise BadSource(
                f"{class_name}.forward returns at line {line} before the routed experts' output at line "
                f"{anchor.line} in {target.display_name}: one reduction cannot cover every path"
            )
    return anchor


def _accumulated_names(loop: cst.For | cst.While) -> list[str]:
    """Names a loop accumulates into in place: `T.index_add_(...)`, `T += x`, `T[i] += x`."""
    names: list[str] = []
    for call in m.findall(loop, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("index_add_")))):
        names.append(call.func.value.value)
    for aug in m.findall(loop, m.AugAssign(operator=m.AddAssign())):
        base = aug.target.value if isinstance(aug.target, cst.Subscript) else aug.target
        if isinstance(base, cst.Name):
            names.append(base.value)
    return list(dict.fromkeys(names))


def _find_returned_sum_anchor(forward: cst.FunctionDef, target: RewriteTarget, positions, class_name: str) -> _Anchor:
    """The routed + shared sum is the returned value (`return routed + shared`, or a tuple's first element).

    Structural, as for `shared_sum`: one operand carries the shared expert output and the other does not.
    The forward must have exactly one `return`, at its top level, so every path goes through the reduction.
    """
    attrs = target.family.shared_experts
    body = list(forward.body.body)
    shared_names = _shared_names(body, attrs)
    returns = [r for stmt in body for r in m.findall(stmt, m.Return())]
    if len(returns) != 1 or not m.matches(body[-1], m.SimpleStatementLine(body=[m.Return()])):
        lines = ", ".join(str(positions[r].start.line) for r in returns) or "none"
        raise BadSource(
            f"{class_name}.forward must end in its only `return` for the returned expert sum to be reduced once "
            f"(returns at lines {lines}) in {_version_hint(target)}"
        )
    value = _returned_sum(returns[0])
    if value is None or [_mentions(value.left, attrs, shared_names),
                         _mentions(value.right, attrs, shared_names)].count(True) != 1:
        raise BadSource(
            f"no recognisable returned expert sum (`return routed + shared`) in {class_name}.forward of "
            f"{_version_hint(target)}"
        )
    return _Anchor(len(body) - 1, "return value", positions[returns[0]].start.line)


def _returned_sum(ret: cst.Return) -> cst.BinaryOperation | None:
    """The `a + b` a return statement returns, alone or as the first element of a tuple."""
    value = ret.value
    if isinstance(value, cst.Tuple) and value.elements:
        value = value.elements[0].value
    return value if m.matches(value, m.BinaryOperation(operator=m.Add())) else None


def _has_fused_experts(module: cst.Module, moe_class: cst.ClassDef, family: Family) -> bool:
    """Fused 3-D experts (transformers 5.x; gpt_oss in every release), recognised by the family's layout.

    The MoE block builds `self.<experts> = SomeExperts(...)`; that class, in this module, must assign every
    Parameter the layout names (`self.<gate_up> = nn.Parameter(...)`, `self.<down> = ...`, and the biases).
    """
    built = m.findall(
        moe_class,
        m.Assign(targets=[m.AssignTarget(target=_self_attr((family.experts_attr,)))], value=m.Call(func=m.Name())),
    )
    classes = {b.value.func.value for b in built}
    parameter = m.Call(func=m.Attribute(attr=m.Name("Parameter")) | m.Name("Parameter"))
    for stmt in module.body:
        if not (isinstance(stmt, cst.ClassDef) and stmt.name.value in classes):
            continue
        assigned = {
            a.targets[0].target.attr.value
            for a in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))],
                                              value=parameter))
        }
        if set(family.fused.parameters) <= assigned:
            return True
    return False


#: anchor kind (codegen.families.ANCHOR_*) -> the comment above an inserted reduction
_REDUCTION_COMMENTS = {ANCHOR_ROUTED_FINAL: ROUTED_REDUCTION_COMMENT}

#: anchor kind (codegen.families.ANCHOR_*) -> the finder that places the reduction
_ANCHOR_FINDERS = {
    ANCHOR_SHARED_SUM: _find_anchor,
    ANCHOR_ROUTED_FINAL: _find_routed_final_anchor,
    ANCHOR_RETURNED_SUM: _find_returned_sum_anchor,
}


# ------------------------------------------------------------------------------------------ transformers


class _MoEForwardTransformer(cst.CSTTransformer):
    """Base for edits of one MoE block's `forward`: finds it (the class the table names, not nested), and
    hands its body to `rewrite_forward`."""

    def __init__(self, class_name: str, anchor: _Anchor) -> None:
        self.class_name = class_name
        self.anchor = anchor
        self._classes: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._classes.pop()
        return updated_node

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if self._classes != [self.class_name] or original_node.name.value != "forward":
            return updated_node
        body = self.rewrite_forward(list(updated_node.body.body))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        raise NotImplementedError


class InsertCoalescedReduction(_MoEForwardTransformer):
    """`T = _codegen_moe_all_reduce(self, T)` right after the MoE block's routed + shared expert sum."""

    def __init__(self, class_name: str, anchor: _Anchor, comment: str = "") -> None:
        super().__init__(class_name, anchor)
        self.comment = comment or REDUCTION_COMMENT

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        var = self.anchor.variable
        reduction = cst.parse_statement(f"{var} = {HELPER}(self, {var})\n").with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(self.comment))]
        )
        body.insert(self.anchor.index + 1, reduction)
        return body


class WrapReturnedSum(_MoEForwardTransformer):
    """`return a + b` -> `return _codegen_moe_all_reduce(self, a + b)` in the MoE block's forward (a tuple's
    first element likewise): the reduction sits on the one path out, and no statement is split or renamed."""

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        line = body[self.anchor.index]
        ret = line.body[0]
        if isinstance(ret.value, cst.Tuple):
            first = ret.value.elements[0]
            value = ret.value.with_changes(elements=[first.with_changes(value=_reduced(first.value)),
                                                     *ret.value.elements[1:]])
        else:
            value = _reduced(ret.value)
        comment = cst.EmptyLine(comment=cst.Comment(REDUCTION_COMMENT))
        body[self.anchor.index] = line.with_changes(
            body=[ret.with_changes(value=value)], leading_lines=[*line.leading_lines, comment]
        )
        return body


def _reduced(expr: cst.BaseExpression) -> cst.Call:
    bare = expr.with_changes(lpar=[], rpar=[])
    return cst.Call(func=cst.Name(HELPER), args=[cst.Arg(cst.Name("self")), cst.Arg(bare)])


class AbsolutizeImports(cst.CSTTransformer):
    """`from ...x import y` -> `from transformers.x import y`, anywhere in the file, unless shipped in the dir."""

    def __init__(self, package: str, shipped_modules: frozenset[str]) -> None:
        self.package = package.split(".")
        self.shipped = shipped_modules
        self.changed: list[str] = []

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        level = len(updated_node.relative)
        if level == 0:
            return updated_node
        tail = _dotted(updated_node.module) if updated_node.module is not None else ""
        if level == 1 and tail.split(".")[0] in self.shipped:
            return updated_node
        if level > len(self.package):
            return updated_node  # beyond the top package: leave it, the loader will say so
        base = self.package[: len(self.package) - level + 1]
        absolute = ".".join(base + ([tail] if tail else []))
        self.changed.append(absolute)
        return updated_node.with_changes(relative=[], module=cst.parse_expression(absolute))


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    raise TypeError(type(node).__name__)


class DeclareNativeLoading(cst.CSTTransformer):
    """transformers 5.x skips its checkpoint conversion mapping for custom code; this file *is* its code.

    Declaring the `*PreTrainedModel` base native makes hub-format per-expert weights load into the fused
    3-D experts exactly as for the built-in class (no UNEXPECTED/MISSING keys, nothing left random).
    """

    METHOD = (
        "@classmethod\n"
        f"def {NATIVE_LOADING_METHOD}(cls) -> bool:\n"
        "    # codegen: transformers' own modeling code plus one guarded all-reduce; keep its checkpoint\n"
        "    # conversion mapping (hub per-expert weights -> fused experts) as for the built-in class.\n"
        "    return False\n"
    )

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if not original_node.name.value.endswith(self.suffix):
            return updated_node
        if not any(m.matches(b.value, m.Name("PreTrainedModel")) for b in original_node.bases):
            return updated_node
        method = cst.parse_statement(self.METHOD).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body = list(updated_node.body.body)
        # a class body of only `...`/docstring keeps it; the method goes last so the diff stays small
        body.append(method)
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


class AddModuleBlock(cst.CSTTransformer):
    """The generated guard helper goes right after the module's leading imports."""

    def __init__(self, block: cst.Module) -> None:
        self.block = block

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = list(updated_node.body)
        last_import = -1
        for i, stmt in enumerate(body):
            if m.matches(stmt, m.SimpleStatementLine(body=[m.OneOf(m.Import(), m.ImportFrom())])):
                last_import = i
            elif m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) and last_import < 0:
                continue  # module docstring
            elif last_import >= 0:
                break
        block = list(self.block.body)
        block[0] = block[0].with_changes(
            leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *self.block.header, *block[0].leading_lines]
        )
        return updated_node.with_changes(body=body[: last_import + 1] + block + body[last_import + 1 :])


# ------------------------------------------------------------------------------------- safety (black-style)


def check_only_intended_changes(original: str, patched: str, target: RewriteTarget) -> None:
    """Prove on the ASTs that the rewrite added only its own statements and made imports absolute."""
    try:
        new_tree = ast.parse(patched)
    except SyntaxError as exc:  # pragma: no cover - would be a codegen bug
        raise BadSource(f"internal: rewrite of {target.display_name} produced invalid Python ({exc})") from None
    old_tree = ast.parse(original)
    if _normalised(old_tree, target) != _normalised(_unwrap_codegen(_strip_codegen(new_tree)), target):
        raise BadSource(f"internal: rewrite of {target.display_name} changed more than intended; nothing written")


def _strip_codegen(tree: ast.Module) -> ast.Module:
    class Strip(ast.NodeTransformer):
        def generic_visit(self, node):
            super().generic_visit(node)
            for attr in ("body", "orelse", "finalbody"):
                stmts = getattr(node, attr, None)
                if isinstance(stmts, list):
                    setattr(node, attr, [s for s in stmts if not _is_codegen_stmt(s)])
            return node

    return Strip().visit(tree)


def _unwrap_codegen(tree: ast.Module) -> ast.Module:
    """`_codegen_moe_all_reduce(self, x)` left inside an expression (a wrapped return) -> `x`."""

    class Unwrap(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.func, ast.Name) and node.func.id == HELPER and len(node.args) == 2 \
                    and not node.keywords and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                return node.args[1]
            return node

    return Unwrap().visit(tree)


def _is_codegen_stmt(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.FunctionDef) and stmt.name in (HELPER, NATIVE_LOADING_METHOD):
        return True
    if isinstance(stmt, ast.Assign):
        if any(isinstance(t, ast.Name) and t.id == MARKER for t in stmt.targets):
            return True
        call = stmt.value
        return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == HELPER
    return False


def _normalised(tree: ast.Module, target: RewriteTarget) -> str:
    package = target.package.split(".")

    class Absolute(ast.NodeTransformer):
        def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
            if node.level and not (node.level == 1 and (node.module or "").split(".")[0] in target.shipped_modules):
                base = package[: len(package) - node.level + 1]
                node.module = ".".join(base + ([node.module] if node.module else []))
                node.level = 0
            return node

    return ast.dump(Absolute().visit(tree))
