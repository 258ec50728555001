"""Where the one reduction goes: the MoE block of a modeling source, found and checked with libcst matchers.

Detection only (nothing is rewritten here): the MoE block class the family table names, its `forward`, and the
statement the family's anchor kind (codegen.families.ANCHOR_*) points at, found structurally rather than by
variable names. A source where one reduction cannot cover every path through the forward is refused in one
line (codegen.errors.BadSource) that names the line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from codegen.errors import BadSource
from codegen.families import ANCHOR_RETURNED_ROUTED, ANCHOR_RETURNED_SUM, ANCHOR_ROUTED_FINAL, \
    ANCHOR_ROUTED_STATEMENT, ANCHOR_SHARED_INPLACE_SUM, ANCHOR_SHARED_SUM, Family
from codegen.patch.target import RewriteTarget
from codegen.policy.runtime.base import PATCH_MARKER, REDUCE_HELPER


@dataclass(frozen=True)
class Anchor:
    """Where the reduction goes: a top-level statement of forward's body to insert after (or to wrap, a return);
    or, at any depth, `statement` itself (its block gets the reduction after it; `index` is then its top-level
    statement's)."""

    index: int
    variable: str
    line: int
    statement: cst.SimpleStatementLine | None = None


class LineNumbers:
    """The source line of any node of one top-level class: what the anchors report and the errors name.

    libcst's PositionProvider walks every node of the module it is given; the anchors only ever ask about nodes of
    the MoE block's class, so positions are resolved on a module of that class alone, then shifted to where the
    class starts in the source (CPython's ast knows the line of its `class` keyword).
    """

    def __init__(self, cls: cst.ClassDef, class_line: int) -> None:
        self._positions = MetadataWrapper(cst.Module(body=[cls]), unsafe_skip_copy=True).resolve(PositionProvider)
        self._offset = class_line - self._positions[cls.name].start.line

    def __getitem__(self, node: cst.CSTNode) -> int:
        return self._positions[node].start.line + self._offset


def class_line(tree: ast.Module, name: str) -> int:
    """The line of `class <name>` at the top level of the source CPython parsed into `tree`."""
    return next(n.lineno for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def find_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers, class_name: str,
                moe_class: cst.ClassDef | None = None) -> Anchor:
    """The anchor of the family's kind in `forward` (one BadSource line where there is none, or several).

    `moe_class`, where given, lets the routed-final anchor follow the block's own helper method that runs its experts
    (`T = self.moe(x, idx, w)`: transformers 4.x DeepSeek-V3 style blocks without a shared expert)."""
    if target.family.anchor == ANCHOR_ROUTED_FINAL:
        helpers = expert_helpers(moe_class, (target.family.experts_attr,)) if moe_class is not None else ()
        return _find_routed_final_anchor(forward, target, lines, class_name, helpers)
    return _ANCHOR_FINDERS[target.family.anchor](forward, target, lines, class_name)


def expert_helpers(moe_class: cst.ClassDef, experts: tuple[str, ...]) -> tuple[str, ...]:
    """Methods of the MoE block, other than `forward`, that run its routed experts (their body calls or indexes
    `self.<experts>`): a call to one of them computes the routed experts' output."""
    found = []
    for stmt in moe_class.body.body:
        if (isinstance(stmt, cst.FunctionDef) and stmt.name.value != "forward"
                and m.findall(stmt.body, _self_attr(experts))):
            found.append(stmt.name.value)
    return tuple(found)


def version_hint(target: RewriteTarget) -> str:
    seen = f" (transformers {target.transformers_version})" if target.transformers_version else ""
    return f"{target.display_name}{seen}; known to work: {', '.join(target.family.known_good)}"


@dataclass(frozen=True)
class Parsed:
    """A source parsed twice: CPython's tree (validation, line numbers) and libcst's (the rewrite)."""

    tree: ast.Module
    module: cst.Module


def parse_source(text: str, target: RewriteTarget) -> Parsed:
    """Both trees of a modeling source that is valid Python and not already patched, or one BadSource line."""
    if not text.strip():
        raise BadSource(f"{target.display_name} is empty: expected a {target.family.model_type} modeling source")
    # CPython's parser first: it rejects what Python could never import (and what crashes or stalls
    # libcst's native parser: 3000 nested parentheses segfault it) with a clean error
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise BadSource(
            f"{target.display_name} is not valid Python (line {exc.lineno}: {exc.msg}): fix the file or pass --source"
        ) from None
    except ValueError as exc:  # null bytes (Python < 3.12)
        raise BadSource(f"{target.display_name} is not valid Python ({exc}): fix the file or pass --source") from None
    except (RecursionError, MemoryError):
        raise BadSource(f"{target.display_name} nests too deeply for Python to compile: not a modeling source") from None
    _refuse_if_already_patched(tree, target)
    try:
        return Parsed(tree, cst.parse_module(text))
    except cst.ParserSyntaxError as exc:
        raise BadSource(
            f"{target.display_name} is not valid Python (line {exc.raw_line}): fix the file or pass --source"
        ) from None


def _refuse_if_already_patched(tree: ast.Module, target: RewriteTarget) -> None:
    """codegen's helper or marker at the top level: the source is codegen's output, not a modeling source."""
    for stmt in tree.body:
        helper = isinstance(stmt, ast.FunctionDef) and stmt.name == REDUCE_HELPER
        marker = isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == PATCH_MARKER
                                                      for t in stmt.targets)
        if helper or marker:
            raise BadSource(
                f"{target.display_name} was already patched by codegen: run `python -m codegen revert` "
                "or pass --source with the unpatched modeling file"
            )


def find_moe_class(module: cst.Module, target: RewriteTarget) -> cst.ClassDef:
    names = target.family.moe_classes
    candidates = [s for s in module.body if m.matches(s, m.ClassDef(name=m.OneOf(*[m.Name(n) for n in names])))]
    if not candidates:
        raise BadSource(
            f"no MoE block ({' or '.join(names)}) in {version_hint(target)}"
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


def find_forward(moe_class: cst.ClassDef, target: RewriteTarget) -> cst.FunctionDef:
    forwards = [s for s in moe_class.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if len(forwards) != 1:
        raise BadSource(f"{moe_class.name.value} has {len(forwards)} forward methods in {version_hint(target)}")
    return forwards[0]


def _self_attr(attrs: tuple[str, ...]) -> m.BaseMatcherNode:
    return m.Attribute(value=m.Name("self"), attr=m.OneOf(*[m.Name(a) for a in attrs]))


def _mentions(node: cst.CSTNode, attrs: tuple[str, ...], names: set[str]) -> bool:
    if m.findall(node, _self_attr(attrs)):
        return True
    return any(m.findall(node, m.Name(n)) for n in names)


def _find_shared_sum_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers, class_name: str) -> Anchor:
    """Find the statement where routed experts' sum and shared expert output meet.

    Structural, not by name: an assignment `T = A + B` (or `T += B`) where one operand carries the shared
    expert output (a `self.<shared>` call, or a name assigned from one) and the other does not.
    """
    attrs = target.family.shared_experts
    body = list(forward.body.body)
    shared_names = _shared_names(body, attrs)

    found: list[Anchor] = []
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
                found.append(Anchor(index, name, lines[node]))

    if not found:
        raise BadSource(
            f"no recognisable expert weighted sum (routed + shared experts) in {class_name}.forward of "
            f"{version_hint(target)}"
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
            line = lines[returns[0]]
            raise BadSource(
                f"{class_name}.forward returns at line {line} before the expert sum at line {anchor.line} in "
                f"{target.display_name}: one reduction cannot cover every path"
            )
    _require_bound_after(body, anchor, target, class_name)
    return anchor


def _find_routed_statement_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers,
                                  class_name: str) -> Anchor:
    """The one statement `T = ...self.<experts>(...)...` of the forward, at any depth (Gemma 4's decoder layer calls
    its experts inside `if self.enable_moe_block:`): the reduction goes right after it, in its own block, so every
    path that computes the routed output reduces it once and nothing reads it before. Refused inside a loop (a
    reduction per iteration) or a nested function, and where the experts are called more than once."""
    experts = (target.family.experts_attr,)
    body = list(forward.body.body)
    call = m.Call(func=_self_attr(experts))
    found: list[Anchor] = []
    for index, stmt in enumerate(body):
        for line in m.findall(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            if m.findall(line.body[0].value, call):
                found.append(Anchor(index, line.body[0].targets[0].target.value, lines[line], line))
    calls = [c for stmt in body for c in m.findall(stmt, call)]
    if not found:
        raise BadSource(
            f"no recognisable routed experts output (`T = self.{experts[0]}(...)`) in {class_name}.forward of "
            f"{version_hint(target)}"
        )
    if len(found) > 1 or len(calls) > 1:
        raise BadSource(
            f"{class_name}.forward calls its routed experts {max(len(found), len(calls))} times (lines "
            f"{', '.join(str(lines[c]) for c in calls)}) in {target.display_name}: cannot place one reduction"
        )
    anchor = found[0]
    inside = [n for stmt in body for n in m.findall(stmt, m.For() | m.While() | m.FunctionDef())
              if _holds(n, anchor.statement)]
    if inside:
        raise BadSource(
            f"{class_name}.forward computes its routed experts' output inside a loop or a nested function (line "
            f"{anchor.line}) in {target.display_name}: one reduction after it would run more than once"
        )
    return anchor


def _holds(node: cst.CSTNode, statement: cst.CSTNode) -> bool:
    """Whether `statement` (a node of the same tree) is `node` or below it."""
    return any(found is statement for found in m.findall(node, m.SimpleStatementLine()))


#: the in-place sums of torch a tensor accumulates another's values with
_INPLACE_SUMS = ("add_", "scatter_add_", "index_add_")


def _find_shared_inplace_sum_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers,
                                    class_name: str) -> Anchor:
    """The routed experts' sum is added in place to the shared expert output, or the other way round: a top-level
    `T.add_(X)` statement (or `T.scatter_add_(..., src=X)` / `T.index_add_(..., X)`: Llama 4 before 4.54) where one of
    `T` and the call's arguments carries the shared expert output (a `self.<shared>` call, or a name assigned from
    one) and the other does not. `T` holds the sum after it: it is reduced right there."""
    attrs = target.family.shared_experts
    body = list(forward.body.body)
    shared_names = _shared_names(body, attrs)
    inplace = m.Expr(value=m.Call(func=m.Attribute(value=m.Name(), attr=m.OneOf(*[m.Name(n) for n in _INPLACE_SUMS]))))
    found: list[Anchor] = []
    for index, stmt in enumerate(body):
        if not m.matches(stmt, m.SimpleStatementLine(body=[inplace])):
            continue
        call = stmt.body[0].value
        name = call.func.value.value
        added = any(_mentions(arg.value, attrs, shared_names) for arg in call.args)
        if [name in shared_names, added].count(True) == 1:
            found.append(Anchor(index, name, lines[call]))
    if not found:
        raise BadSource(
            f"no recognisable in-place expert sum (`shared.add_(routed)`) in {class_name}.forward of "
            f"{version_hint(target)}"
        )
    if len(found) > 1:
        raise BadSource(
            f"{class_name}.forward adds the shared expert in place {len(found)} times (lines "
            f"{', '.join(str(a.line) for a in found)}) in {target.display_name}: cannot place one reduction"
        )
    anchor = found[0]
    for stmt in body[: anchor.index + 1]:
        returns = m.findall(stmt, m.Return())
        if returns:
            raise BadSource(
                f"{class_name}.forward returns at line {lines[returns[0]]} before the expert sum at line "
                f"{anchor.line} in {target.display_name}: one reduction cannot cover every path"
            )
    return anchor


def _names_carrying(body: list[cst.BaseStatement], carries) -> set[str]:
    """Names assigned from a value that `carries(value, names so far)`, to a fixed point."""
    names: set[str] = set()
    assigns = [a for stmt in body for a in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name())]))]
    changed = True
    while changed:
        changed = False
        for assign in assigns:
            name = assign.targets[0].target.value
            if name not in names and carries(assign.value, names):
                names.add(name)
                changed = True
    return names


def _shared_names(body: list[cst.BaseStatement], attrs: tuple[str, ...]) -> set[str]:
    """Names that carry the shared expert output (`s = self.shared(x)`; `s = g * s`), not a sum with it: nor a sum
    inside a cast or a scale (`y = (r.float() + s.float()).to(dtype)`, `y = (y + s) / 2`), which carries the routed
    experts too."""
    def carries(value: cst.BaseExpression, names: set[str]) -> bool:
        sums = m.findall(value, m.BinaryOperation(operator=m.Add()))
        if any([_mentions(s.left, attrs, names), _mentions(s.right, attrs, names)].count(True) == 1 for s in sums):
            return False
        return not m.matches(value, m.BinaryOperation(operator=m.Add())) and _mentions(value, attrs, names)

    return _names_carrying(body, carries)


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
    body: list[cst.BaseStatement], anchor: Anchor, target: RewriteTarget, class_name: str
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


def _find_routed_final_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers, class_name: str,
                              helpers: tuple[str, ...] = ()) -> Anchor:
    """No shared expert: the routed experts' output is the block's output; reduce it once it is complete.

    Structural: a top-level `T = ...self.<experts>(...)...` (transformers 5.x, fused experts called once) or
    `T = ...self.<helper>(...)...` (a method of the block that runs them: `helpers`), or a top-level loop that
    mentions `self.<experts>` and accumulates into a name bound before it (`T.index_add_(...)`, `T += ...`,
    `T[i] += ...`: transformers 4.x, one expert per iteration).
    """
    experts = (target.family.experts_attr,)
    body = list(forward.body.body)
    found: list[Anchor] = []
    for index, stmt in enumerate(body):
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            assign = stmt.body[0]
            if m.findall(assign.value, m.Call(func=_self_attr((*experts, *helpers)))):
                found.append(Anchor(index, assign.targets[0].target.value, lines[assign]))
        elif isinstance(stmt, (cst.For, cst.While)) and m.findall(stmt, _self_attr(experts)):
            for name in _accumulated_names(stmt):
                if any(_binds(s, name) for s in body[:index]):
                    found.append(Anchor(index, name, lines[stmt]))

    if not found:
        raise BadSource(
            f"no recognisable routed experts output (`T = self.{experts[0]}(...)` or a loop over the experts "
            f"accumulating into `T`) in {class_name}.forward of {version_hint(target)}"
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
            line = lines[returns[0]]
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


def _find_returned_sum_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers, class_name: str) -> Anchor:
    """The routed + shared sum is the returned value (`return routed + shared`, or a tuple's first element).

    Structural, as for `shared_sum`: one operand carries the shared expert output and the other does not.
    The forward must have exactly one `return`, at its top level, so every path goes through the reduction.
    """
    attrs = target.family.shared_experts
    body = list(forward.body.body)
    shared_names = _shared_names(body, attrs)
    ret = _only_return(body, lines, class_name, target, "expert sum")
    value = _returned_sum(ret)
    if value is None or [_mentions(value.left, attrs, shared_names),
                         _mentions(value.right, attrs, shared_names)].count(True) != 1:
        raise BadSource(
            f"no recognisable returned expert sum (`return routed + shared`) in {class_name}.forward of "
            f"{version_hint(target)}"
        )
    return Anchor(len(body) - 1, "return value", lines[ret])


def _find_returned_routed_anchor(forward: cst.FunctionDef, target: RewriteTarget, lines: LineNumbers,
                                 class_name: str) -> Anchor:
    """No shared expert, and the block returns the routed experts' output (`return self.<experts>(...).view()`, or
    a name that carries it: `out = self.<experts>(...)`, `out = zeros.index_add(0, idx, out)`, `return out`; alone or
    a tuple's first element): the returned value is reduced. The forward's only `return` ends it. The experts are
    every attribute holding them in any generation (a block holding its expert modules itself names those)."""
    experts = target.family.expert_modules
    body = list(forward.body.body)
    ret = _only_return(body, lines, class_name, target, "routed experts' output")
    value = _returned_value(ret)
    if value is None or not (m.findall(value, m.Call(func=_self_attr(experts)))
                             or any(m.findall(value, m.Name(n)) for n in _carriers(body, experts))):
        raise BadSource(
            f"no recognisable returned routed experts output (`return self.{experts[0]}(...)`) in {class_name}.forward "
            f"of {version_hint(target)}"
        )
    return Anchor(len(body) - 1, "return value", lines[ret])


def _carriers(body: list[cst.BaseStatement], attrs: tuple[str, ...]) -> set[str]:
    """Names assigned from a `self.<attr>(...)` call or from a name that carries one."""
    return _names_carrying(body, lambda value, names: bool(m.findall(value, m.Call(func=_self_attr(attrs))))
                           or any(m.findall(value, m.Name(n)) for n in names))


def _only_return(body: list[cst.BaseStatement], lines: LineNumbers, class_name: str, target: RewriteTarget,
                 what: str) -> cst.Return:
    """The forward's one `return`, its last top-level statement (else one BadSource line)."""
    returns = [r for stmt in body for r in m.findall(stmt, m.Return())]
    if len(returns) != 1 or not m.matches(body[-1], m.SimpleStatementLine(body=[m.Return()])):
        found = ", ".join(str(lines[r]) for r in returns) or "none"
        raise BadSource(
            f"{class_name}.forward must end in its only `return` for the returned {what} to be reduced once "
            f"(returns at lines {found}) in {version_hint(target)}"
        )
    return returns[0]


def _returned_value(ret: cst.Return) -> cst.BaseExpression | None:
    """What a return statement returns: alone, or the first element of a tuple."""
    value = ret.value
    if isinstance(value, cst.Tuple) and value.elements:
        value = value.elements[0].value
    return value


def _returned_sum(ret: cst.Return) -> cst.BinaryOperation | None:
    """The `a + b` a return statement returns, alone or as the first element of a tuple."""
    value = _returned_value(ret)
    return value if m.matches(value, m.BinaryOperation(operator=m.Add())) else None


def has_fused_experts(module: cst.Module, moe_class: cst.ClassDef, family: Family) -> bool:
    """Fused 3-D experts (transformers 5.x; gpt_oss in every release), recognised by the family's layout.

    The MoE block builds `self.<experts> = SomeExperts(...)` (for an expert set one module down, `text_moe.experts`,
    each step of the path is built so by the class before it); that class, in this module, must assign every
    Parameter the layout names (`self.<gate_up> = nn.Parameter(...)`, `self.<down> = ...`, and the biases).
    Every expert set must be fused.
    """
    classes = {stmt.name.value: stmt for stmt in module.body if isinstance(stmt, cst.ClassDef)}
    parameter = m.Call(func=m.Attribute(attr=m.Name("Parameter")) | m.Name("Parameter"))
    for path in family.expert_paths():
        holders = [moe_class]
        for step in path.split("."):
            holders = [classes[name] for holder in holders for name in _built_classes(holder, step) if name in classes]
        if not any(set(family.fused.parameters) <= {
            a.targets[0].target.attr.value
            for a in m.findall(holder, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))],
                                                value=parameter))
        } for holder in holders):
            return False
    return True


def _built_classes(holder: cst.ClassDef, attr: str) -> set[str]:
    """The classes `holder` builds `self.<attr>` from (`self.<attr> = SomeClass(...)`)."""
    built = m.findall(holder, m.Assign(targets=[m.AssignTarget(target=_self_attr((attr,)))], value=m.Call(func=m.Name())))
    return {b.value.func.value for b in built}


#: anchor kind (codegen.families.ANCHOR_*) -> the finder that places the reduction
_ANCHOR_FINDERS = {
    ANCHOR_SHARED_SUM: _find_shared_sum_anchor,
    ANCHOR_ROUTED_FINAL: _find_routed_final_anchor,
    ANCHOR_RETURNED_SUM: _find_returned_sum_anchor,
    ANCHOR_RETURNED_ROUTED: _find_returned_routed_anchor,
    ANCHOR_SHARED_INPLACE_SUM: _find_shared_inplace_sum_anchor,
    ANCHOR_ROUTED_STATEMENT: _find_routed_statement_anchor,
}
