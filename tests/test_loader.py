"""A patched dir loads through the real transformers loader with trust_remote_code, every tensor, same numbers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_codegen

pytestmark = pytest.mark.loader


def _load(directory, remote: bool):
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=remote, output_loading_info=True, **{dtype_kw: torch.float32}
    )


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2", "hub_deepseek"])
def test_patched_dir_loads_every_tensor_with_identical_logits(make_dir, kind):
    pristine = make_dir(kind, "pristine")
    patched = make_dir(kind, "patched")
    assert run_codegen("patch", patched).returncode == 0

    reference, _ = _load(pristine, remote=kind == "hub_deepseek")
    model, info = _load(patched, remote=True)
    reference.eval()
    model.eval()
    assert "transformers_modules" in type(model).__module__  # really the patched remote code
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    # every checkpoint tensor landed: parameters equal the built-in model's, tensor by tensor
    ref_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
        tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        ref_tokens = reference.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert diff == 0.0
    assert torch.equal(tokens, ref_tokens)


def test_policy_module_imports_and_names_its_gates(make_dir):
    import importlib.util

    d = make_dir("qwen2_moe")
    assert run_codegen("patch", d).returncode == 0
    spec = importlib.util.spec_from_file_location("policy_under_test", d / "autotp_policy.py")
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    assert policy.FAMILY == "qwen2_moe"
    assert set(policy.REPLICATED) == {"mlp.gate", "mlp.shared_expert_gate"}
    assert callable(policy.init_inference)
    assert json.loads((d / "config.json").read_text())[policy.KNOB] is True


#: families whose tiny checkpoints come straight from codegen.examples.SHAPES (the table's config class)
NEW_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")


@pytest.fixture(scope="module")
def _family_templates(tmp_path_factory):
    """One tiny hub-format checkpoint per family, saved by the installed transformers (its own format)."""
    import transformers

    from codegen.examples import SHAPES
    from codegen.families import FAMILIES

    base = tmp_path_factory.mktemp("family-templates")
    built = {}
    for name in NEW_FAMILIES:
        config = getattr(transformers, FAMILIES[name].config_class)(**SHAPES["tiny"][name])
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.05)  # non-trivial routers, experts and expert biases
        model.save_pretrained(base / name)
        built[name] = base / name
    return built


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_new_family_patched_dir_loads_every_tensor_with_identical_logits(_family_templates, tmp_path, family):
    """Per family of the table: 0 missing/unexpected keys, identical parameters, logits diff 0.0, same tokens."""
    import shutil

    pristine = shutil.copytree(_family_templates[family], tmp_path / "pristine")
    patched = shutil.copytree(_family_templates[family], tmp_path / "patched")
    done = run_codegen("patch", patched)
    assert done.returncode == 0, done.stderr

    reference, _ = _load(pristine, remote=False)
    model, info = _load(patched, remote=True)
    reference.eval()
    model.eval()
    assert "transformers_modules" in type(model).__module__
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    ref_state = reference.state_dict()
    state = model.state_dict()
    assert state.keys() == ref_state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, ref_state[name]), name

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
        tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        ref_tokens = reference.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert diff == 0.0
    assert torch.equal(tokens, ref_tokens)
