"""The edits of a modeling source, one small libcst transformer each; they touch only what they must.

- `InsertCoalescedReduction`: `T = _codegen_moe_all_reduce(self, T)` after the anchor statement of the MoE
  block's forward; `WrapReturnedValue`: the same around the value the `return` builds (a routed + shared sum,
  or the routed experts' output);
- `BuildTextModelHere`: a multimodal wrapper that builds its text decoder through `AutoModel.from_config` builds
  the patched module's class instead (the auto class would build transformers' own);
- `AbsolutizeImports`: relative imports become `transformers.` imports, so the file loads as remote code;
- `DeclareNativeLoading`: for transformers 5.x sources (fused 3-D experts), the override that keeps
  transformers' checkpoint conversion mapping;
- `TakeTextConfig`: a wrapper's text-only causal LM takes the text config of the multimodal checkpoint it is loaded
  from, as the auto class gives the built-in class;
- `AddModuleBlock`: the generated helper block after the module's leading imports;
- `InsertVersionGuard`: for transformers' own sources, the release guard before everything but the docstring
  and `from __future__` imports.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.helpers import get_absolute_module_from_package, get_full_name_for_node

from codegen.families import KNOB
from codegen.patch.anchors import Anchor
from codegen.policy.runtime.base import REDUCE_HELPER

#: the class method `DeclareNativeLoading` adds (transformers asks it whether a class is remote code)
NATIVE_LOADING_METHOD = "is_custom_code"
#: the function `InsertVersionGuard` adds and calls (codegen/templates/modeling_guard.py.j2 defines it)
VERSION_GUARD = "_codegen_require_transformers"


def reduction_line(variable: str, comment: str) -> cst.SimpleStatementLine:
    """`T = _codegen_moe_all_reduce(self, T)` under its comment."""
    var = cst.Name(variable)
    return cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(var)], value=reduced(var))],
                                   leading_lines=[cst.EmptyLine(comment=cst.Comment(comment))])


class _MoEBlockEdit(cst.CSTTransformer):
    """Base for edits of one MoE block: the very nodes detection found (codegen.patch.anchors: the `forward` of the
    top-level class the table names), matched by identity; no other class is visited."""

    def __init__(self, moe_class: cst.ClassDef, forward: cst.FunctionDef, anchor: Anchor, comment: str) -> None:
        super().__init__()
        self.moe_class = moe_class
        self.forward = forward
        self.anchor = anchor
        self.comment = comment

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return node is self.moe_class


class _MoEForwardTransformer(_MoEBlockEdit):
    """Base for edits of the MoE block's `forward` body as a whole (its top-level statements)."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # the forward's body is edited whole on the way out

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node is not self.forward:
            return updated_node
        body = self.rewrite_forward(list(updated_node.body.body))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        raise NotImplementedError


class InsertCoalescedReduction(_MoEForwardTransformer):
    """`T = _codegen_moe_all_reduce(self, T)` right after the MoE block's anchor statement."""

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        body.insert(self.anchor.index + 1, reduction_line(self.anchor.variable, self.comment))
        return body


class InsertReductionAfterStatement(_MoEBlockEdit):
    """`T = _codegen_moe_all_reduce(self, T)` right after the anchor's statement, in the block that holds it (at any
    depth of the MoE block's forward: inside an `if`)."""

    def __init__(self, moe_class: cst.ClassDef, forward: cst.FunctionDef, anchor: Anchor, comment: str) -> None:
        super().__init__(moe_class, forward, anchor, comment)
        self.inserted = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.forward

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        at = next((i for i, stmt in enumerate(original_node.body) if stmt is self.anchor.statement), None)
        if at is None:
            return updated_node
        self.inserted += 1
        body = list(updated_node.body)
        body.insert(at + 1, reduction_line(self.anchor.variable, self.comment))
        return updated_node.with_changes(body=body)


class WrapReturnedValue(_MoEForwardTransformer):
    """`return a + b` -> `return _codegen_moe_all_reduce(self, a + b)` in the MoE block's forward (a tuple's
    first element likewise; any returned expression): the reduction sits on the one path out, and no statement is
    split or renamed."""

    def rewrite_forward(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        line = body[self.anchor.index]
        ret = line.body[0]
        if isinstance(ret.value, cst.Tuple):
            first = ret.value.elements[0]
            value = ret.value.with_changes(elements=[first.with_changes(value=reduced(first.value)),
                                                     *ret.value.elements[1:]])
        else:
            value = reduced(ret.value)
        comment = cst.EmptyLine(comment=cst.Comment(self.comment))
        body[self.anchor.index] = line.with_changes(
            body=[ret.with_changes(value=value)], leading_lines=[*line.leading_lines, comment]
        )
        return body


#: the auto-class call a wrapper builds its text decoder with, and the class method codegen calls instead
AUTO_FROM_CONFIG = ("AutoModel", "from_config")
#: the auto classes a wrapper may build its text decoder through (`AutoModelForCausalLM`: a decoder with its LM head)
AUTO_TEXT_CLASSES = ("AutoModel", "AutoModelForCausalLM")
CLASS_FROM_CONFIG = "_from_config"


def text_model_call(config_attr: str) -> m.BaseMatcherNode:
    """`AutoModel.from_config(<x>.<config_attr>)`: a wrapper building its text decoder through the auto class."""
    return m.Call(func=m.Attribute(value=m.OneOf(*(m.Name(n) for n in AUTO_TEXT_CLASSES)),
                                   attr=m.Name(AUTO_FROM_CONFIG[1])),
                  args=[m.Arg(value=m.Attribute(attr=m.Name(config_attr)))])


class BuildTextModelHere(cst.CSTTransformer):
    """`AutoModel.from_config(config.text_config)` -> `<TextModel>._from_config(config.text_config)`.

    The auto class builds transformers' own text decoder, so the patched MoE blocks would never run; the class's
    `_from_config` is what the auto class calls, so nothing else changes. `redirected` counts the calls.
    """

    def __init__(self, text_model: str, config_attr: str) -> None:
        super().__init__()
        self.text_model = text_model
        self.matcher = text_model_call(config_attr)
        self.redirected = 0

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not m.matches(original_node, self.matcher):
            return updated_node
        self.redirected += 1
        return updated_node.with_changes(func=cst.Attribute(value=cst.Name(self.text_model),
                                                            attr=cst.Name(CLASS_FROM_CONFIG)))


def reduced(expr: cst.BaseExpression) -> cst.Call:
    """`_codegen_moe_all_reduce(self, expr)`."""
    bare = expr.with_changes(lpar=[], rpar=[])
    return cst.Call(func=cst.Name(REDUCE_HELPER), args=[cst.Arg(cst.Name("self")), cst.Arg(bare)])


class AbsolutizeImports(cst.CSTTransformer):
    """`from ...x import y` -> `from transformers.x import y`, anywhere in the file, unless shipped in the dir."""

    def __init__(self, package: str, shipped_modules: frozenset[str]) -> None:
        super().__init__()
        self.package = package
        self.shipped = shipped_modules
        self.changed: list[str] = []

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return any(isinstance(stmt, cst.ImportFrom) for stmt in node.body)  # expressions never hold an import

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        level = len(updated_node.relative)
        if level == 0:
            return updated_node
        tail = get_full_name_for_node(updated_node.module) if updated_node.module is not None else None
        if level == 1 and (tail or "").split(".")[0] in self.shipped:
            return updated_node
        absolute = get_absolute_module_from_package(self.package, tail, level)
        if absolute is None:
            return updated_node  # beyond the top package: leave it, the loader will say so
        self.changed.append(absolute)
        return updated_node.with_changes(relative=[], module=cst.parse_expression(absolute))


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
        super().__init__()
        self.suffix = suffix

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False  # only top-level classes are declared; their bodies are edited whole on the way out

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if not original_node.name.value.endswith(self.suffix):
            return updated_node
        if not any(m.matches(b.value, m.Name("PreTrainedModel")) for b in original_node.bases):
            return updated_node
        method = cst.parse_statement(self.METHOD).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        # a class body of only `...`/docstring keeps it; the method goes last so the diff stays small
        body = [*updated_node.body.body, method]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


#: the class method `TakeTextConfig` adds to a wrapper's text-only causal LM
TEXT_CONFIG_LOADER = "from_pretrained"


class TakeTextConfig(cst.CSTTransformer):
    """Loaded through `auto_map` from a multimodal checkpoint, the text-only causal LM is handed the wrapper's whole
    config (transformers' auto class swaps in the text config for built-in classes only): the patched class takes
    it itself, so `AutoModelForCausalLM` loads the checkpoint as it loads it into the built-in class.
    `added` counts the classes given the override (the rewrite requires one)."""

    METHOD = (
        "@classmethod\n"
        f"def {TEXT_CONFIG_LOADER}(cls, *args, config=None, **kwargs):\n"
        "    # codegen: loaded through `auto_map` from a multimodal checkpoint, this text-only class gets the whole\n"
        "    # config; transformers' auto class hands the built-in class its text config: the same here.\n"
        "    if config is not None and not isinstance(config, cls.config_class) and hasattr(config, \"get_text_config\"):\n"
        "        text = config.get_text_config()\n"
        "        # the knob `patch` wrote is the whole config's: the policy reads it from this class's config\n"
        f"        text.{KNOB} = getattr(config, \"{KNOB}\", False)\n"
        "        config = text\n"
        f"    return super().{TEXT_CONFIG_LOADER}(*args, config=config, **kwargs)\n"
    )

    #: the class attribute transformers' loader reads the checkpoint keys it may leave unused from
    IGNORED_KEYS = "_keys_to_ignore_on_load_unexpected"

    def __init__(self, class_name: str, wrapper_parts: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.class_name = class_name
        #: the wrapper's own modules (vision tower, projector): their checkpoint keys are the multimodal checkpoint's,
        #: not this class's; where the class names no keys it ignores, it is given theirs
        self.wrapper_parts = wrapper_parts
        self.added = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if original_node.name.value != self.class_name or m.findall(
                original_node.body, m.FunctionDef(name=m.Name(TEXT_CONFIG_LOADER))):
            return updated_node
        self.added += 1
        method = cst.parse_statement(self.METHOD).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        extra = [] if not self.wrapper_parts or m.findall(original_node.body, m.AssignTarget(
            target=m.Name(self.IGNORED_KEYS))) else [self._ignored_keys()]
        return updated_node.with_changes(body=updated_node.body.with_changes(
            body=[*updated_node.body.body, *extra, method]))

    def _ignored_keys(self) -> cst.BaseStatement:
        """The class attribute naming each wrapper part's keys (a pattern per part): loaded from the multimodal
        checkpoint, the text-only class leaves those weights unused, as it should, without an UNEXPECTED key."""
        patterns = ", ".join(f'r"(^|\\.){part}\\."' for part in self.wrapper_parts)
        comment = ("# codegen: loaded from a multimodal checkpoint, the wrapper's own modules' weights are not this "
                   "class's")
        return cst.parse_statement(f"{self.IGNORED_KEYS} = [{patterns}]\n").with_changes(
            leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(comment=cst.Comment(comment))])


def _is_import(stmt: cst.CSTNode) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.OneOf(m.Import(), m.ImportFrom())]))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))


class _ModuleLevel(cst.CSTTransformer):
    """An edit of the module's top-level statement list only: nothing below it is visited."""

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_If(self, node: cst.If) -> bool:
        return False

    def visit_Try(self, node: cst.Try) -> bool:
        return False


class AddModuleBlock(_ModuleLevel):
    """The generated helper block goes right after the module's leading imports."""

    def __init__(self, block: cst.Module) -> None:
        super().__init__()
        self.block = block

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = list(updated_node.body)
        last_import = -1
        for i, stmt in enumerate(body):
            if _is_import(stmt):
                last_import = i
            elif _is_docstring(stmt) and last_import < 0:
                continue
            elif last_import >= 0:
                break
        block = list(self.block.body)
        block[0] = block[0].with_changes(
            leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *self.block.header, *block[0].leading_lines]
        )
        return updated_node.with_changes(body=body[: last_import + 1] + block + body[last_import + 1 :])


class InsertVersionGuard(_ModuleLevel):
    """The release guard before the first statement that is neither the docstring nor a `from __future__`
    import: before the imports, which are what breaks first under another transformers release."""

    def __init__(self, guard: cst.Module) -> None:
        super().__init__()
        self.guard = guard

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = list(updated_node.body)
        at = 0
        while at < len(body) and ((at == 0 and _is_docstring(body[at])) or m.matches(
                body[at], m.SimpleStatementLine(body=[m.ImportFrom(module=m.Name("__future__"))]))):
            at += 1
        guard = list(self.guard.body)
        if at < len(body):  # the comments and blank lines above that statement now lead the guard
            first = body[at]
            guard[0] = guard[0].with_changes(leading_lines=[*first.leading_lines, *self.guard.header,
                                                            *guard[0].leading_lines])
            body[at] = first.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        else:
            guard[0] = guard[0].with_changes(leading_lines=[*self.guard.header, *guard[0].leading_lines])
        return updated_node.with_changes(body=body[:at] + guard + body[at:])
