"""The black-style safety check: on the ASTs, the rewrite changed only what it meant to, before anything is written.

The patched source, with codegen's own statements removed (the helper block, the marker, the reductions, the
native-loading override, the text-config override, the version guard) and every wrapped expression unwrapped,
must equal the original with its relative imports made absolute. Anything else is a codegen bug: one line,
nothing written.
"""

from __future__ import annotations

import ast

from libcst.helpers import get_absolute_module_from_package

from codegen.errors import BadSource
from codegen.families import TEXT_CONFIG
from codegen.patch.target import RewriteTarget
from codegen.patch.transforms import AUTO_FROM_CONFIG, AUTO_TEXT_CLASSES, CLASS_FROM_CONFIG, NATIVE_LOADING_METHOD, TEXT_CONFIG_LOADER, \
    VERSION_GUARD, TakeTextConfig
from codegen.policy.runtime.base import PATCH_MARKER, REDUCE_HELPER


def check_only_intended_changes(original: str, patched: str, target: RewriteTarget) -> None:
    """Prove on the ASTs that the rewrite added only its own statements and made imports absolute."""
    try:
        new_tree = ast.parse(patched)
    except SyntaxError as exc:  # pragma: no cover - would be a codegen bug
        raise BadSource(f"internal: rewrite of {target.display_name} produced invalid Python ({exc})") from None
    old_tree = ast.parse(original)
    if _normalised(old_tree, target) != _normalised(_unwrap_codegen(_strip_codegen(new_tree, target)), target):
        raise BadSource(f"internal: rewrite of {target.display_name} changed more than intended; nothing written")


def _strip_codegen(tree: ast.Module, target: RewriteTarget) -> ast.Module:
    wrapper = target.family.wrapper
    causal_lm = wrapper.causal_lm if wrapper is not None and target.moe_block else ""

    class Strip(ast.NodeTransformer):
        def generic_visit(self, node):
            super().generic_visit(node)
            for attr in ("body", "orelse", "finalbody"):
                stmts = getattr(node, attr, None)
                if isinstance(stmts, list):
                    setattr(node, attr, [s for s in stmts if not _is_codegen_stmt(s, target)])
            if isinstance(node, ast.ClassDef) and causal_lm and node.name == causal_lm:  # TakeTextConfig's override
                node.body = [s for s in node.body if not (isinstance(s, ast.FunctionDef)
                                                          and s.name == TEXT_CONFIG_LOADER)
                             and not _is_ignored_wrapper_keys(s, wrapper.replicated)]
            return node

    return Strip().visit(tree)


def _is_ignored_wrapper_keys(stmt: ast.stmt, parts: tuple[str, ...]) -> bool:
    """TakeTextConfig's class attribute: the wrapper parts' key patterns, exactly as it writes them."""
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == TakeTextConfig.IGNORED_KEYS and isinstance(stmt.value, ast.List)
            and [getattr(e, "value", None) for e in stmt.value.elts] == [rf"(^|\.){part}\." for part in parts])


def _unwrap_codegen(tree: ast.Module) -> ast.Module:
    """`_codegen_moe_all_reduce(self, x)` left inside an expression (a wrapped return) -> `x`."""

    class Unwrap(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.func, ast.Name) and node.func.id == REDUCE_HELPER and len(node.args) == 2 \
                    and not node.keywords and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
                return node.args[1]
            return node

    return Unwrap().visit(tree)


def _is_codegen_stmt(stmt: ast.stmt, target: RewriteTarget) -> bool:
    if isinstance(stmt, ast.FunctionDef) and stmt.name in (REDUCE_HELPER, NATIVE_LOADING_METHOD, VERSION_GUARD):
        return True
    if target.text_import and isinstance(stmt, ast.ImportFrom):  # the wrapper's import of its patched decoder
        return stmt.level == 1 and stmt.module == target.text_import
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):  # the version guard's call
        return isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == VERSION_GUARD
    if isinstance(stmt, ast.Assign):
        if any(isinstance(t, ast.Name) and t.id == PATCH_MARKER for t in stmt.targets):
            return True
        call = stmt.value
        return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == REDUCE_HELPER
    return False


def _normalised(tree: ast.Module, target: RewriteTarget) -> str:
    wrapper = target.family.wrapper
    text_model = wrapper.text_model if wrapper is not None else ""

    class Absolute(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.Call:
            """`<TextModel>._from_config(x.text_config)` and the auto-class call it replaces (any of
            `AUTO_TEXT_CLASSES`) read alike (in both trees)."""
            self.generic_visit(node)
            func = node.func
            given = [*node.args, *(k.value for k in node.keywords if k.arg == "config")]  # `config=` in 5.5's Gemma 4
            built = text_model and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and (
                (func.attr == CLASS_FROM_CONFIG and func.value.id == text_model)
                or (func.attr == AUTO_FROM_CONFIG[1] and func.value.id in AUTO_TEXT_CLASSES))
            if built and len(given) == 1 and isinstance(given[0], ast.Attribute) and given[0].attr == TEXT_CONFIG:
                node.func = ast.Attribute(value=ast.Name(id=AUTO_FROM_CONFIG[0], ctx=ast.Load()),
                                          attr=AUTO_FROM_CONFIG[1], ctx=ast.Load())
            return node

        def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
            if node.level and not (node.level == 1 and (node.module or "").split(".")[0] in target.shipped_modules):
                absolute = get_absolute_module_from_package(target.package, node.module, node.level)
                if absolute is not None:
                    node.module, node.level = absolute, 0
            return node

    return ast.dump(Absolute().visit(tree))
