"""A patched dir loads through the real transformers loader with trust_remote_code, every tensor, same numbers."""

from __future__ import annotations

import json

import pytest
import torch

from codegen.families import FAMILIES as TABLE
from codegen.families import moe_class_names
from codegen.models import auto_class, dtype_keyword, runs_as
from codegen.patch import api
from conftest import FAMILIES, REMOTE_CODE_FIXTURES

pytestmark = pytest.mark.loader


def _load(directory, remote: bool):
    """As users load a dir: the auto class its config names (a multimodal wrapper's image-text-to-text class)."""
    return auto_class(directory).from_pretrained(directory, trust_remote_code=remote, output_loading_info=True,
                                                 **{dtype_keyword(): torch.float32})


@pytest.mark.parametrize("kind", [*FAMILIES, *REMOTE_CODE_FIXTURES])
def test_patched_dir_loads_every_tensor_with_identical_logits(make_dir, kind):
    """Per family of the table (and its hub remote code): 0 missing/unexpected keys, identical parameters,
    logits diff 0.0, same tokens."""
    pristine = make_dir(kind, "pristine")
    patched = make_dir(kind, "patched")
    api.patch(patched)  # the CLI's own call, in this process (tests/test_patch_cli.py runs the CLI itself)

    reference, _ = _load(pristine, remote=kind in REMOTE_CODE_FIXTURES)
    model, info = _load(patched, remote=True)
    reference.eval()
    model.eval()
    assert "transformers_modules" in type(model).__module__  # really the patched remote code
    # every MoE block is the patched class (a multimodal wrapper's text decoder built from the patched module)
    blocks = [m for m in model.modules() if type(m).__name__ in moe_class_names()]
    assert blocks and all("transformers_modules" in type(b).__module__ for b in blocks)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    # every checkpoint tensor landed: parameters equal the built-in model's, tensor by tensor
    ref_state, state = reference.state_dict(), model.state_dict()
    assert state.keys() == ref_state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, ref_state[name]), name

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    # a wrapper with no forward of its own runs its text submodule (Qwen3-Omni's thinker); the rest as it is
    model, reference = runs_as(model), runs_as(reference)
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
        tokens = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        ref_tokens = reference.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert diff == 0.0
    assert torch.equal(tokens, ref_tokens)
    # the patch keeps the experts kernel transformers picks (5.x: `grouped_mm` wherever the source carries
    # `@use_experts_implementation`; docs/benchmark.md's rows depend on it)
    if hasattr(reference, "get_experts_implementation"):
        assert model.get_experts_implementation() == reference.get_experts_implementation()


def test_policy_module_imports_and_names_its_gates(make_dir):
    import importlib.util

    d = make_dir("qwen2_moe")
    api.patch(d)
    spec = importlib.util.spec_from_file_location("policy_under_test", d / "autotp_policy.py")
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    assert policy.LAYOUT == TABLE["qwen2_moe"].policy_layout()
    assert set(policy.LAYOUT["routers"]) == set(TABLE["qwen2_moe"].routers) and policy.LAYOUT["routers"]
    assert callable(policy.init_inference)
    assert json.loads((d / "config.json").read_text())[policy.KNOB] is True


def _quantize_experts_mxfp4(directory, form) -> None:
    """Rewrite a saved tiny checkpoint's fused experts as MXFP4 `*_blocks`/`*_scales`, as gpt-oss ships them.

    Random FP4 codes and power-of-two scales: whatever weights they encode, pristine and patched dir read the
    same bytes. Layout (transformers' MXFP4 format): blocks [E, rows, cols/32, 16] uint8, scales [E, rows, cols/32].
    """
    from safetensors.torch import load_file, save_file

    from codegen.families import FAMILIES

    layout = FAMILIES["gpt_oss"].fused
    path = directory / "model.safetensors"
    state = load_file(path)
    codes = torch.Generator().manual_seed(3)
    for key in [k for k in state if k.rsplit(".", 1)[-1] in (layout.gate_up, layout.down)]:
        experts, cols, rows = state.pop(key).shape  # stored [E, in, out]; MXFP4 packs along `in`
        state[f"{key}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                                               generator=codes)
        state[f"{key}_scales"] = torch.randint(120, 126, (experts, rows, cols // 32), dtype=torch.uint8,
                                               generator=codes)
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": form.quant_method}
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def test_gpt_oss_mxfp4_experts_load_dequantized_exactly_or_are_refused(make_dir, tmp_path):
    """transformers 5.x dequantizes MXFP4 experts into the patched class exactly as into the built-in one;
    where the installed release cannot (4.x leaves them unloaded), codegen.patch.quantization refuses the form."""
    import shutil

    import transformers

    from codegen.errors import BadInput
    from codegen.families import FAMILIES
    from codegen.patch.quantization import refuse_unsupported_quantization
    from codegen.patch.source import installed_transformers_version

    family = FAMILIES["gpt_oss"]
    (form,) = family.quantized_forms
    pristine = make_dir("gpt_oss", "pristine")
    _quantize_experts_mxfp4(pristine, form)
    config = json.loads((pristine / "config.json").read_text())
    version = installed_transformers_version()
    try:
        refuse_unsupported_quantization(config, family, version, pristine / "config.json")
    except BadInput as exc:  # below the form's release: refused, in one line
        from packaging.version import Version

        assert Version(version) < Version(form.min_transformers)
        assert "\n" not in exc.message and form.min_transformers in exc.message
        return

    patched = shutil.copytree(pristine, tmp_path / "patched")
    api.patch(patched)  # the CLI's own call, in this process (tests/test_patch_cli.py runs the CLI itself)
    reference, _ = _load(pristine, remote=False)
    model, info = _load(patched, remote=True)
    assert "transformers_modules" in type(model).__module__
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), (key, info.get(key))
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(pristine / "model.safetensors")
    for index, layer in enumerate(model.model.layers):
        for name in (family.fused.gate_up, family.fused.down):
            block = family.moe_block_attrs[0]
            prefix = f"model.layers.{index}.{block}.{family.experts_attr}.{name}"
            expected = convert_moe_packed_tensors(state[f"{prefix}_blocks"], state[f"{prefix}_scales"],
                                                  dtype=torch.float32)
            assert torch.equal(getattr(getattr(getattr(layer, block), family.experts_attr), name), expected), prefix
    ref_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max().item() == 0.0
    assert transformers.__version__ == version


def test_an_alias_patches_as_its_family_keeps_its_model_type_and_needs_its_remote_code(make_dir):
    """kimi_k2: DeepSeek-V3 remote code under another model type. Patched as deepseek_v3 (its remote code
    rewritten), the config keeps `"model_type": "kimi_k2"`; without the remote code, one line and nothing written."""
    from codegen.errors import BadInput
    from codegen.families import ALIASES, KNOB
    from conftest import tree_digest

    directory = make_dir("hub_kimi_k2")
    result = api.patch(directory)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config[KNOB] is True
    assert result.family == ALIASES["kimi_k2"].family and "patched kimi_k2 (as deepseek_v3)" in result.summary
    assert "modeling_deepseek_codegen.py" in result.written
    bare = make_dir("hub_kimi_k2", "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["auto_map"]
    (bare / "config.json").write_text(json.dumps(config))
    before = tree_digest(bare)
    with pytest.raises(BadInput) as info:
        api.patch(bare)
    message = str(info.value)
    assert "\n" not in message and "has no auto_map" in message and "modeling_deepseek.py" in message
    assert tree_digest(bare) == before


def test_a_multimodal_dir_also_loads_text_only_as_the_builtin_class_does(make_dir):
    """`AutoModelForCausalLM` on a multimodal checkpoint (as transformers maps Qwen3.5-MoE; the families of the
    installed release whose wrapper names a text-only class): the patched text-only class takes the checkpoint's
    text config, loads every tensor of the decoder, gives the built-in class's logits, and keeps the knob `patch`
    wrote (the policy reads it from this class's config)."""
    import transformers
    from packaging.version import Version

    kinds = [f for f in FAMILIES if TABLE[f].wrapper is not None and TABLE[f].wrapper.causal_lm]
    assert ("qwen3_5_moe" in kinds) == (Version(transformers.__version__) >= Version("5.2"))  # Qwen3.5-MoE from 5.2
    assert "llama4" in kinds  # Llama 4 from 4.51
    for kind in kinds:
        _loads_text_only(make_dir, kind)


def _loads_text_only(make_dir, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    from codegen.families import KNOB

    pristine = make_dir(kind, f"pristine-{kind}")
    patched = make_dir(kind, f"patched-{kind}")
    api.patch(patched)
    kwargs = {dtype_keyword(): torch.float32, "output_loading_info": True}
    reference, _ = AutoModelForCausalLM.from_pretrained(pristine, **kwargs)
    model, info = AutoModelForCausalLM.from_pretrained(patched, trust_remote_code=True, **kwargs)
    assert type(model).__name__ == TABLE[kind].wrapper.causal_lm == type(reference).__name__
    assert "transformers_modules" in type(model).__module__
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
    assert getattr(model.config, KNOB) is True and not hasattr(reference.config, KNOB)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.eval()(ids).logits - reference.eval()(ids).logits).abs().max().item() == 0.0
