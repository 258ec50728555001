"""Hostile or odd inputs: remote-code modeling files and config.json values.

Every case ends in a correct patch (the one reduction right after the expert sum, nothing else changed)
or a precise one-line error with the documented exit code (3 for sources, naming the file; 2 for configs),
and an error leaves the dir exactly as it was. The tool only parses sources: it never imports or runs them.
"""

from __future__ import annotations

import pytest

import ast
import json
import os
import shutil
import textwrap
from pathlib import Path


from codegen.families import supported_model_types
from conftest import CORPORA, tree_digest
from test_hardening import (  # noqa: F401 - fast is a fixture
    HUB_DEEPSEEK_CONFIG, QWEN_CONFIG, Tally, assert_clean, build, cached, cli, fast, listing, warm,
)

pytestmark = pytest.mark.process  # forks / starts processes: not in the fast tier

HELPER = "_codegen_moe_all_reduce"

#: a small DeepSeek-V2-style remote modeling file (what the hub ships, cut to what the rewriter reads)
SYNTH = textwrap.dedent('''\
    """A tiny DeepSeek-V2-style remote modeling file."""
    import torch
    from torch import nn

    from .configuration_deepseek import DeepseekV2Config
    from ...modeling_utils import PreTrainedModel


    class DeepseekV2MLP(nn.Module):
        def forward(self, x):
            return x


    class DeepseekV2MoE(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.experts = nn.ModuleList([DeepseekV2MLP() for _ in range(config.n_routed_experts)])
            self.shared_experts = DeepseekV2MLP()

        def forward(self, hidden_states):
            identity = hidden_states
            y = self.experts[0](hidden_states)
    #FORWARD#
            return y


    class DeepseekV2DecoderLayer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.mlp = DeepseekV2MoE(config)
    ''')
SUM = "        y = y + self.shared_experts(identity)\n"


def synth(forward: str = SUM, extra: str = "") -> str:
    return SYNTH.replace("#FORWARD#\n", forward) + extra


def indent(code: str) -> str:
    return textwrap.indent(textwrap.dedent(code), " " * 8)


MARKER_NAME = "codegen-executed-me"

#: name -> (modeling file bytes, None for a correct patch | (exit code, words in the one-line error))
SOURCES: dict[str, tuple[bytes, tuple[int, str] | None]] = {
    "plain": (synth().encode(), None),
    "not-python": (b"class DeepseekV2MoE(nn.Module:\n    pass\n", (3, "not valid Python")),
    "empty": (b"", (3, "is empty")),
    "whitespace-only": (b"\n   \n\t\n", (3, "is empty")),
    "comments-only": (b"# nothing here\n", (3, "no MoE block")),
    "null-byte": (synth().encode() + b"\x00\n", (3, "not valid Python")),
    "not-utf8": (synth().encode().replace(b"A tiny", b"A \xff\xfe tiny"), (3, "not UTF-8")),
    "latin1-cookie": (b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + synth().encode(), (3, "not UTF-8")),
    "utf8-bom": (b"\xef\xbb\xbf" + synth().encode(), None),
    "crlf": (synth().replace("\n", "\r\n").encode(), None),
    "tabs": (synth().replace("    ", "\t").encode(), None),
    "deep-parens": (synth(extra="X = " + "(" * 3000 + "1" + ")" * 3000 + "\n").encode(), (3, "not valid Python")),
    "deep-chain": (synth(extra="X = " + " + ".join(["1"] * 5000) + "\n").encode(), (3, "nests too deeply")),
    "two-moe-classes": (synth(extra=textwrap.dedent('''
        class DeepseekV2Moe(nn.Module):
            def forward(self, x):
                y = x + self.shared_experts(x)
                return y


        BLOCK = DeepseekV2Moe()
        ''')).encode(), (3, "two candidate MoE classes")),
    "second-moe-class-unused": (synth(extra=textwrap.dedent('''
        class DeepseekV2Moe(nn.Module):
            def forward(self, x):
                z = x + self.shared_experts(x)
                return z
        ''')).encode(), None),
    "moe-class-defined-twice": (synth(extra=textwrap.dedent('''
        class DeepseekV2MoE(nn.Module):
            def forward(self, x):
                return x + self.shared_experts(x)
        ''')).encode(), (3, "two candidate MoE classes")),
    "no-moe-class-at-top-level": (synth().replace("class DeepseekV2MoE", "class Other").replace(
        "DeepseekV2MoE(config)", "Other(config)").encode() + b"if True:\n    class DeepseekV2MoE:\n        pass\n",
        (3, "no MoE block")),
    "moe-two-forward-methods": (synth(forward=SUM + "        return y\n\n    def forward(self, h):\n" + SUM).encode(),
                                (3, "2 forward methods")),
    "early-return-before-sum": (synth(forward=indent('''
        if hidden_states.numel() == 0:
            return hidden_states
        ''') + SUM).encode(), (3, "returns at line")),
    "returns-in-sum-branch": (synth(forward=indent('''
        if self.training:
            y = y + self.shared_experts(identity)
            return y
        ''')).encode(), (3, "returns at line")),
    "several-returns-after-sum": (synth(forward=SUM + indent('''
        if self.training:
            return y, None
        if y is None:
            return identity
        ''')).encode(), None),
    "sum-in-both-branches": (synth(forward=indent('''
        if self.training:
            y = y + self.shared_experts(identity)
        else:
            y = self.shared_experts(identity) + y
        ''')).encode(), None),
    "renamed-variable": (synth(forward=indent('''
        routed = y * 2
        combined = routed + self.shared_experts(identity)
        y = combined
        ''')).encode(), None),
    "augmented-assign": (synth(forward="        y += self.shared_experts(identity)\n").encode(), None),
    "shared-via-names": (synth(forward=indent('''
        shared = self.shared_experts(identity)
        shared = shared * 1.0
        y = y + shared
        ''')).encode(), None),
    "two-sums-two-tensors": (synth(forward=indent('''
        a = y + self.shared_experts(identity)
        b = hidden_states + self.shared_experts(identity)
        y = a + b
        ''')).encode(), (3, "several tensors")),
    "no-shared-expert": (synth(forward="        y = y + identity\n").encode(), (3, "no recognisable expert weighted sum")),
    "runs-code-at-import": (synth(extra=textwrap.dedent(f'''
        import os
        open({MARKER_NAME!r}, "w").write("ran")
        os.system("touch " + {MARKER_NAME!r} + "-system")
        __import__("pathlib").Path({MARKER_NAME!r} + "-pathlib").touch()


        class Meta(type):
            open({MARKER_NAME!r} + "-class-body", "w")
        ''')).encode(), None),
}


def _patched_by_codegen() -> bytes:
    """The plain source as this tool patched it: an 'already patched' remote file (older dir, lost manifest)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        d = build("hub_deepseek", Path(tmp) / "m")
        (d / "modeling_deepseek.py").write_bytes(SOURCES["plain"][0])
        r = cli("patch", d)
        assert r.rc == 0, r.err
        return (d / "modeling_deepseek_codegen.py").read_bytes()


def _older_version_patch() -> bytes:
    """A file an older codegen patched: its marker and a differently shaped helper, at module level."""
    return synth(extra=textwrap.dedent('''
        _CODEGEN_PATCH = {"tool": "codegen", "version": "0.0.1"}


        def _codegen_moe_all_reduce(block, x):
            return x
        ''')).encode()


def check_source(name: str, data: bytes, expect, work: Path) -> list[str]:
    """Patch a hub-layout dir whose modeling_deepseek.py is `data`; return what went wrong (empty: fine)."""
    d = build("hub_deepseek", work / name)
    (d / "modeling_deepseek.py").write_bytes(data)
    before, before_listing = tree_digest(d), listing(d)
    cwd = os.getcwd()
    os.chdir(d)  # where a relative open() in the source would land
    try:
        r = cli("patch", d)
    finally:
        os.chdir(cwd)
    problems = []
    if any(p.name.startswith(MARKER_NAME) for p in list(d.iterdir()) + list(Path(cwd).iterdir())):
        problems.append(f"{name}: the source was executed")
    if "Traceback" in r.err or "internal error" in r.err:
        problems.append(f"{name}: {r.err.strip()[-300:]}")
    if expect is not None:
        code, words = expect
        if r.rc != code or len(r.lines) != 1 or words not in r.err or "modeling_deepseek.py" not in r.err:
            problems.append(f"{name}: expected exit {code} with {words!r} naming the file, got {r.rc}: {r.err.strip()!r}")
        if tree_digest(d) != before or listing(d) != before_listing:
            problems.append(f"{name}: refused, but the dir changed")
        return problems
    if r.rc != 0:
        return problems + [f"{name}: expected a patch, got exit {r.rc}: {r.err.strip()}"]
    if (d / "modeling_deepseek.py").read_bytes() != data:
        problems.append(f"{name}: the original remote file was rewritten")
    problems += check_insertion(name, data, (d / "modeling_deepseek_codegen.py").read_bytes())
    return problems


def check_insertion(name: str, original: bytes, patched: bytes) -> list[str]:
    """Exactly one reduction, right after the statement that adds the shared expert output, of that variable."""
    tree = ast.parse(patched)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == HELPER]
    if len(calls) != 1:
        return [f"{name}: {len(calls)} reductions in the output"]
    moe = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "DeepseekV2MoE"]
    forward = [f for f in moe[0].body if isinstance(f, ast.FunctionDef) and f.name == "forward"][0]
    index = next((i for i, s in enumerate(forward.body) if HELPER in ast.unparse(s)), None)
    if index is None:
        return [f"{name}: the reduction is not in DeepseekV2MoE.forward"]
    reduction = forward.body[index]
    var = reduction.targets[0].id
    previous = ast.unparse(forward.body[index - 1])
    if ast.unparse(reduction) != f"{var} = {HELPER}(self, {var})":
        return [f"{name}: odd reduction {ast.unparse(reduction)}"]
    if "shared_experts" not in previous and "shared" not in previous or f"{var}" not in previous:
        return [f"{name}: the reduction of {var} does not follow the expert sum: {previous!r}"]
    later = ast.unparse(ast.Module(body=forward.body[index + 1:], type_ignores=[]))
    if "shared_experts" in later:
        return [f"{name}: the shared expert is added after the reduction"]
    newline_ok = (b"\r\n" in patched) == (b"\r\n" in original)
    return [] if newline_ok else [f"{name}: line endings changed"]


def source_corpus(work: Path) -> Tally:
    tally = Tally()
    cases = dict(SOURCES)
    cases["already-patched-by-codegen"] = (_patched_by_codegen(), (3, "already patched"))
    cases["patched-by-an-older-version"] = (_older_version_patch(), (3, "already patched"))
    for name, (data, expect) in cases.items():
        with tally.case():
            tally.problems += check_source(name, data, expect, work)
    return tally


@CORPORA
def test_hostile_and_odd_sources_patch_correctly_or_fail_precisely(tmp_path):
    assert_clean(cached("bad-sources", lambda: source_corpus(tmp_path)))


def test_source_is_parsed_never_executed_also_with_source_override(tmp_path, fast):
    d = build("qwen2_moe", tmp_path / "m")
    evil = tmp_path / "evil.py"
    marker = tmp_path / MARKER_NAME
    evil.write_text(f"import os\nos.system('touch {marker}')\nopen({str(marker)!r}, 'w')\n")
    r = cli("patch", "--source", evil, d)
    assert r.rc == 3 and "no MoE block" in r.err and str(evil) in r.err
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- bad configs


def _set(**values):
    def mutate(config):
        for key, value in values.items():
            if value is _DEL:
                config.pop(key, None)
            else:
                config[key] = value
        return config
    return mutate


_DEL = object()

#: name -> (family dir, config.json bytes | mutation, None for a documented normalisation | (exit, words))
CONFIGS = {
    "missing-num_experts": ("qwen2_moe", _set(num_experts=_DEL), (2, "missing num_experts")),
    "missing-n_routed_experts": ("hub_deepseek", _set(n_routed_experts=_DEL), (2, "missing n_routed_experts")),
    "zero-experts": ("qwen2_moe", _set(num_experts=0), (2, "num_experts must be a positive integer")),
    "negative-experts": ("qwen2_moe", _set(num_experts=-3), (2, "num_experts must be a positive integer")),
    "negative-hidden": ("hub_deepseek", _set(hidden_size=-64), (2, "hidden_size must be a positive integer")),
    "string-size": ("qwen2_moe", _set(hidden_size="64"), (2, "hidden_size must be a positive integer")),
    "float-size": ("qwen2_moe", _set(num_experts=8.0), (2, "num_experts must be a positive integer")),
    "bool-size": ("qwen2_moe", _set(num_experts_per_tok=True), (2, "must be a positive integer")),
    "null-size": ("hub_deepseek", _set(n_routed_experts=None), (2, "n_routed_experts must be a positive integer")),
    "nan-size": ("qwen2_moe", b'{"model_type": "qwen2_moe", "num_experts": NaN}', (2, "num_experts must be")),
    "injection-in-size": ("qwen2_moe", _set(num_experts="8\nimport os"), (2, "num_experts must be a positive integer")),
    "missing-model_type": ("qwen2_moe", _set(model_type=_DEL), (2, "model_type None is not supported")),
    "unsupported-model_type": ("qwen2_moe", _set(model_type="llama"), (2, f"supported: {', '.join(supported_model_types())}")),
    "model_type-not-a-string": ("qwen2_moe", _set(model_type=["qwen2_moe"]), (2, "is not supported")),
    "model_type-squashed": ("qwen2_moe", _set(model_type="QWEN2MOE"), (2, "is not supported")),
    "model_type-Qwen2_MoE": ("qwen2_moe", _set(model_type="Qwen2_MoE"), None),
    "model_type-spaced-dashed": ("qwen2_moe", _set(model_type=" qwen2-moe "), None),
    "model_type-DeepSeek_V2": ("hub_deepseek", _set(model_type="DeepSeek_V2"), None),
    "array-json": ("qwen2_moe", b"[]", (2, "not a JSON object")),
    "string-json": ("qwen2_moe", b'"qwen2_moe"', (2, "not a JSON object")),
    "null-json": ("qwen2_moe", b"null", (2, "not a JSON object")),
    "invalid-json": ("qwen2_moe", b'{"model_type": "qwen2_moe",', (2, "not valid JSON")),
    "empty-file": ("qwen2_moe", b"", (2, "not valid JSON")),
    "not-utf8": ("qwen2_moe", b'{"model_type": "qwen2_moe\xff"}', (2, "not valid JSON")),
    "bom": ("qwen2_moe", b'\xef\xbb\xbf{"model_type": "qwen2_moe", "num_experts": 8}', (2, "not valid JSON")),
    "deeply-nested": ("qwen2_moe", b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", (2, "config.json")),
    "auto_map-string": ("qwen2_moe", _set(auto_map="modeling.X"), (2, "auto_map must be a JSON object")),
    "auto_map-list": ("qwen2_moe", _set(auto_map=[["AutoModel", "m.X"]]), (2, "auto_map must be a JSON object")),
    "auto_map-entry-list": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": ["m.X"]}), (2, "is not 'module.Class'")),
    "auto_map-other-repo": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "org/repo--modeling.X"}),
                            (2, "another repository")),
    "auto_map-path-traversal": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "../../etc/passwd.X"}),
                                (2, "not a Python module name")),
    "auto_map-code": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "__import__('os').system('x').X"}),
                      (2, "not a Python module name")),
    "auto_map-keyword": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "import.X"}), (2, "not a Python module")),
    "auto_map-non-ascii": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "modéling.X"}), (2, "not a Python module")),
    "auto_map-reserved": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "autotp_policy.X"}), (2, "clashes")),
    "auto_map-file-missing": ("hub_deepseek", _set(auto_map={"AutoModelForCausalLM": "modeling_other.X"}),
                              (3, "modeling_other.py, which is not in the model dir")),
    "lone-surrogate-value": ("qwen2_moe", b'{"model_type": "qwen2_moe", "num_experts": 8, "_name_or_path": "\\ud800x"}',
                             None),
}


def check_config(name: str, kind: str, config, expect, work: Path) -> list[str]:
    base = {"qwen2_moe": QWEN_CONFIG, "hub_deepseek": HUB_DEEPSEEK_CONFIG}[kind]
    d = build(kind, work / name)
    data = config if isinstance(config, bytes) else (json.dumps(config(json.loads(json.dumps(base))), indent=2) + "\n").encode()
    (d / "config.json").write_bytes(data)
    before, before_listing = tree_digest(d), listing(d)
    r = cli("patch", d)
    problems = []
    if "Traceback" in r.err or "internal error" in r.err:
        problems.append(f"{name}: {r.err.strip()[-300:]}")
    if expect is not None:
        code, words = expect
        if r.rc != code or len(r.lines) != 1 or words not in r.err:
            problems.append(f"{name}: expected exit {code} with {words!r}, got {r.rc}: {r.err.strip()[:300]!r}")
        if tree_digest(d) != before or listing(d) != before_listing:
            problems.append(f"{name}: refused, but the dir changed")
        return problems
    # documented normalisation: patched, the original recorded, revert gives back the very bytes
    if r.rc != 0:
        return problems + [f"{name}: expected a patch, got {r.rc}: {r.err.strip()}"]
    original = json.loads(data)
    patched = json.loads((d / "config.json").read_bytes())
    manifest = json.loads((d / ".codegen" / "manifest.json").read_text())
    family = {"qwen2_moe": "qwen2_moe", "hub_deepseek": "deepseek_v2"}[kind]
    if patched["model_type"] != family:
        problems.append(f"{name}: model_type written as {patched['model_type']!r}")
    if original["model_type"] != family and manifest["config_changes"].get("model_type") != \
            {"existed": True, "value": original["model_type"]}:
        problems.append(f"{name}: the original model_type is not recorded in the manifest")
    for key, value in original.items():
        if key not in ("model_type", "auto_map") and patched.get(key) != value and value == value:
            problems.append(f"{name}: {key} did not round-trip through config.json")
    if cli("patch", "--check", d).rc != 0:
        problems.append(f"{name}: --check fails after patch")
    if cli("revert", d).rc != 0 or tree_digest(d) != before:
        problems.append(f"{name}: revert does not restore the original bytes")
    return problems


def config_corpus(work: Path) -> Tally:
    tally = Tally()
    for name, (kind, config, expect) in CONFIGS.items():
        with tally.case():
            tally.problems += check_config(name, kind, config, expect, work)
    for name, setup in {"no-config": lambda d: (d / "config.json").unlink(),
                        "config-is-a-directory": lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
                        "config-dangling-symlink": lambda d: ((d / "config.json").unlink(),
                                                              (d / "config.json").symlink_to("gone.json")),
                        "missing-dir": lambda d: shutil.rmtree(d),
                        "dir-is-a-file": lambda d: (shutil.rmtree(d), d.write_text("x"))}.items():
        with tally.case():
            d = build("qwen2_moe", work / name)
            setup(d)
            before = tree_digest(d) if d.is_dir() else None
            r = cli("patch", d)
            if r.rc != 2 or len(r.lines) != 1 or "Traceback" in r.err:
                tally.problems.append(f"{name}: expected one line and exit 2, got {r.rc}: {r.err.strip()!r}")
            if before is not None and tree_digest(d) != before:
                tally.problems.append(f"{name}: the dir changed")
    return tally


def warm_and_run_config_corpus(work: Path) -> Tally:
    warm(build("qwen2_moe", work / "warm-qwen"))
    warm(build("hub_deepseek", work / "warm-hub"))
    return config_corpus(work)


@CORPORA
def test_bad_config_values_exit_2_with_one_line_or_are_normalised(tmp_path, fast):
    assert_clean(cached("bad-configs", lambda: warm_and_run_config_corpus(tmp_path)))
