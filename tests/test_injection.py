"""Injection-safe generation: hostile strings from config.json, the model dir path or --source never become code.

What reaches generated Python: the templates get family constants and the patched module's name (through
`render.pyliteral`); the rewriter gets the source text and a package computed from the --source path.
config values (`_name_or_path`, `architectures`, auto_map entries, any key), the dir path and the --source
path must therefore leave the generated Python byte-identical to a benign run (same statements, nothing
leaked) while the config value round-trips through config.json; an auto_map module name is either a plain
identifier, then round-trips as the `MODELING_MODULE` literal and the auto_map value, or is refused (exit 2).
"""

from __future__ import annotations

import ast
import json
import keyword
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from codegen.errors import BadInput, BadSource
from codegen.modeldir.directory import ModelDir
from codegen.patch.plan import make_plan
from conftest import tree_digest
from test_hardening import HUB_DEEPSEEK_CONFIG, QWEN_CONFIG, build, cli, fast  # noqa: F401
from test_sources import synth

pytestmark = pytest.mark.process  # forks / starts processes: not in the fast tier

#: strings aimed at every way a value could be spliced into Python or a jinja2 template
HOSTILE = [
    '"""', "'''", '"', "'", "\\", "\n", "\r\n", "\u2028", "\x00", "\ud800", "\udfff", "\U0001f600", "\u202e",
    "{{ 7*7 }}", "{% for x in range(9) %}x{% endfor %}", "{# c #}", "${x}", "%s", "\\N{BULLET}", "\\x00",
    "__import__('os').system('touch /tmp/codegen-pwned')", '"); import os; os.system("id") #',
    "'''\nimport os\n'''", "\"\"\"\n__import__('os')\n\"\"\"", "x = 1\nimport os", "# -*- coding: rot13 -*-",
]
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
#: any text, lone surrogates included (JSON's \ud800 escapes produce them), mixed with the hostile pieces
hostile = st.lists(
    st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(exclude_categories=()), max_size=6)), max_size=5
).map("".join)
#: JSON values built from hostile strings
hostile_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), hostile),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(hostile, inner, max_size=3)),
    max_leaves=8,
)
BASES = {"qwen2_moe": QWEN_CONFIG, "hub_deepseek": HUB_DEEPSEEK_CONFIG}


def _py(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name.endswith(".py")}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="codegen-injection-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def baselines(workdir):
    """The plan of each benign dir (the memoised rewrite makes every later plan cheap)."""
    import codegen.patch.rewrite
    from test_hardening import memoise_rewrite

    real = codegen.patch.rewrite.rewrite_source
    memoise_rewrite(setattr)
    try:
        out = {}
        for kind in BASES:
            d = build(kind, workdir / f"baseline-{kind}")
            out[kind] = (d, make_plan(ModelDir(d), None, True))
        yield out
    finally:
        codegen.patch.rewrite.rewrite_source = real


_counter = iter(range(10**9))


def _fresh(kind: str, workdir: Path, baselines, config: dict) -> Path:
    """A copy of the benign dir with `config` as config.json (cheap: no weights to speak of)."""
    d = workdir / f"case-{next(_counter)}"
    shutil.copytree(baselines[kind][0], d)
    (d / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=True) + "\n")
    return d


@pytest.mark.parametrize("kind", list(BASES))
@SETTINGS
@given(name_or_path=hostile, architectures=st.lists(hostile, max_size=3), tokenizer=hostile,
       extra_key=hostile, extra_value=hostile_json)
@example(name_or_path='x"""\n__import__("os").system("touch /tmp/bars-pwned")\n"""',
         architectures=["Qwen2MoeForCausalLM", "{{ 7*7 }}'; import os #"], tokenizer="\ud800", extra_key="{{",
         extra_value={"'''": ["\\", None]})
def test_hostile_config_values_never_reach_generated_code(kind, fast, workdir, baselines, name_or_path,
                                                          architectures, tokenizer, extra_key, extra_value):
    base = BASES[kind]
    assume(extra_key not in base and extra_key not in ("auto_map", "codegen_coalesce_moe_all_reduce"))
    config = json.loads(json.dumps(base))
    config.update({"_name_or_path": name_or_path, "architectures": architectures, extra_key: extra_value})
    config.setdefault("auto_map", {})["AutoTokenizer"] = [tokenizer, None]
    d = _fresh(kind, workdir, baselines, config)
    plan = make_plan(ModelDir(d), None, True)
    benign = baselines[kind][1]

    # generated Python: parses, and is the benign run's byte for byte (same statements, nothing leaked)
    for name, data in _py(plan.files).items():
        ast.parse(data)
        assert data == benign.files[name], name
    # config.json: valid JSON in which every hostile value round-trips; the rest as in the benign run
    written = json.loads(plan.files["config.json"])
    expected = json.loads(benign.files["config.json"])
    expected.update({"_name_or_path": name_or_path, "architectures": architectures, extra_key: extra_value})
    expected["auto_map"]["AutoTokenizer"] = [tokenizer, None]
    assert written == expected
    # the manifest (JSON) records the original auto_map verbatim
    info = json.loads(json.dumps(plan.manifest_info))
    if "auto_map" in info["config_changes"]:
        assert info["config_changes"]["auto_map"]["value"]["AutoTokenizer"] == [tokenizer, None]
    shutil.rmtree(d)


module_names = st.one_of(
    hostile,
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,24}", fullmatch=True),
    st.sampled_from(["modeling_deepseek", "class", "autotp_policy", "a.b", "a-b", "é", "_", "__init__", "config"]),
)


@SETTINGS
@given(module=module_names)
@example(module="__import__('os').system('x')")
def test_auto_map_module_name_is_an_identifier_that_round_trips_or_is_refused(fast, workdir, baselines, module):
    config = json.loads(json.dumps(HUB_DEEPSEEK_CONFIG))
    config["auto_map"]["AutoModelForCausalLM"] = f"{module}.DeepseekV2ForCausalLM"
    config["auto_map"]["AutoModel"] = f"{module}.DeepseekV2Model"
    d = _fresh("hub_deepseek", workdir, baselines, config)
    plain_identifier = (module.isascii() and module.isidentifier() and not keyword.iskeyword(module)
                        and module != "autotp_policy")
    if plain_identifier:
        (d / f"{module}.py").write_text(synth())
    try:
        plan = make_plan(ModelDir(d), None, True)
    except BadInput as exc:
        assert not plain_identifier, exc.message
        assert "auto_map" in exc.message and "\n" not in exc.message  # one line, whatever the name holds
        return
    except BadSource as exc:  # pragma: no cover - the file is there whenever the name is valid
        raise AssertionError(exc.message) from None
    assert plain_identifier
    patched = f"{module}_codegen"
    assert set(plan.files) == {f"{patched}.py", "autotp_policy.py", "config.json"}
    assert json.loads(plan.files["config.json"])["auto_map"]["AutoModelForCausalLM"] == f"{patched}.DeepseekV2ForCausalLM"
    # the name reaches the policy only as the MODELING_MODULE literal: same statements as a benign name
    policy = ast.parse(plan.files["autotp_policy.py"])
    literal = [n.value for n in policy.body if isinstance(n, ast.Assign) and n.targets[0].id == "MODELING_MODULE"]
    assert [ast.literal_eval(v) for v in literal] == [patched]
    for node in literal:
        node.value = "M"
    benign = ast.parse(baselines["hub_deepseek"][1].files["autotp_policy.py"])
    for node in benign.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "MODELING_MODULE":
            node.value.value = "M"
    assert ast.dump(policy) == ast.dump(benign)
    shutil.rmtree(d)


#: a directory name: anything but "/" and NUL, non-UTF-8 bytes included (as surrogate escapes)
dir_names = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/\x00"), min_size=1, max_size=24),
    st.lists(st.sampled_from([h for h in HOSTILE if "/" not in h and "\x00" not in h and not ("\ud800" <= h[0] <= "\udfff")]),
             min_size=1, max_size=3).map("".join),
    st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\x00" not in b).map(os.fsdecode),
).filter(lambda s: s not in (".", "..") and len(os.fsencode(s)) < 200)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=dir_names)
@example(name='x"""\n__import__("os").system("touch pwned")\n"""{{ 7*7 }}')
def test_hostile_model_dir_path_never_reaches_generated_code(fast, workdir, baselines, name):
    parent = workdir / f"path-{next(_counter)}"
    parent.mkdir()
    d = parent / name
    shutil.copytree(baselines["hub_deepseek"][0], d)
    before = tree_digest(d)
    r = cli("patch", d)
    assert r.rc == 0, r.err
    for file, data in baselines["hub_deepseek"][1].files.items():
        assert (d / file).read_bytes() == data, file  # same bytes as in the benign dir
    assert cli("revert", d).rc == 0
    assert tree_digest(d) == before
    shutil.rmtree(parent)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=dir_names, under_transformers=st.booleans())
@example(name="x;import os", under_transformers=True)
@example(name='a"b.c', under_transformers=True)
def test_hostile_source_path_never_reaches_generated_code(fast, workdir, baselines, name, under_transformers):
    """--source: the path goes to the manifest (JSON) and messages; a `transformers/<odd>/` path, which
    would name the package for relative imports, falls back to the family's package instead."""
    d, _ = baselines["hub_deepseek"]
    reference = workdir / "benign-source" / "modeling.py"
    if not reference.exists():
        reference.parent.mkdir()
        reference.write_text(synth())
    case = workdir / f"source-{next(_counter)}"
    folder = case / "transformers" / name if under_transformers else case / name
    folder.mkdir(parents=True)
    source = folder / "modeling.py"
    source.write_text(synth())
    target = _fresh("hub_deepseek", workdir, baselines, json.loads(json.dumps(HUB_DEEPSEEK_CONFIG)))
    hostile_plan = make_plan(ModelDir(target), source, True)
    benign_plan = make_plan(ModelDir(target), reference, True)
    # `transformers/<identifier>/` is a package name codegen may use for relative imports; anything else
    # must fall back to the family's package, i.e. give exactly the benign output
    used_as_package = under_transformers and name.isascii() and name.isidentifier() and not keyword.iskeyword(name)
    for file, data in _py(hostile_plan.files).items():
        ast.parse(data)
        if not used_as_package:
            assert data == benign_plan.files[file], file
    assert json.loads(json.dumps(hostile_plan.manifest_info))["source"]["path"] == str(source)
    shutil.rmtree(case)
    shutil.rmtree(target)


# ------------------------------------------------------------------------------- what the CLI prints


def test_non_utf8_dir_name_under_a_strict_stdout_locale(fast, workdir, baselines):
    """Under a UTF-8 locale other than C.UTF-8 stdout is strict: printing the dir path must not crash."""
    d = workdir / os.fsdecode(b"strict-caf\xe9")
    shutil.copytree(baselines["qwen2_moe"][0], d)
    r = cli("patch", d, stdout_errors="strict")
    assert r.rc == 0, r.err


def test_an_error_naming_a_path_with_a_newline_stays_one_line(workdir):
    r = cli("patch", workdir / "no\nsuch")
    assert r.rc == 2 and len(r.lines) == 1, r.err
