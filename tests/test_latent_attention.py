"""The absorbed MLA decode step (codegen.policy.runtime.latent_attention) on transformers' own MLA model."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from codegen.families import FAMILIES
from codegen.families.examples import EXAMPLES
from codegen.policy.runtime.latent_attention import (ABSORBED_ATTENTION, absorb_latent_attention,
                                                     latent_attention_modules)

transformers = pytest.importorskip("transformers")


def _steps(model, ids, mask):
    """Logits of a prefill over left-padded rows and of two decode steps on its cache."""
    cache = transformers.DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        for _ in range(3):
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
            logits.append(out)
            ids = out[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return logits


@pytest.mark.unit
@pytest.mark.installed_transformers  # 4.x caches expanded keys: nothing to absorb there
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_absorbed_decode_gives_the_expanded_logits(implementation):
    layout = FAMILIES["deepseek_v2"].policy_layout()
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**EXAMPLES["deepseek_v2"].tiny, attn_implementation=implementation)
    expanded = transformers.DeepseekV2ForCausalLM(config).eval()
    absorbed = copy.deepcopy(expanded)
    modules = latent_attention_modules(absorbed, layout)
    note = absorb_latent_attention(modules, layout)
    if not hasattr(type(expanded.model.layers[0].self_attn), "expand_kv"):
        assert modules == [] and note is None
        return
    assert len(modules) == config.num_hidden_layers and "2 layers decode absorbed" in note
    assert {m.config._attn_implementation for _, m in modules} == {ABSORBED_ATTENTION}
    assert absorbed.config._attn_implementation == implementation  # the model's masks are built as loaded
    ids = torch.randint(0, config.vocab_size, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for want, got in zip(_steps(expanded, ids, mask), _steps(absorbed, ids, mask)):
        assert torch.allclose(want, got, atol=1e-5, rtol=0), (want - got).abs().max()


@pytest.mark.unit
def test_other_attention_implementations_are_left_expanded_with_a_note():
    layout = FAMILIES["deepseek_v2"].policy_layout()

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kv_b_proj = torch.nn.Linear(4, 8)
            self.config = types.SimpleNamespace(_attn_implementation="flash_attention_2")

        def expand_kv(self, latent, rotary):
            return latent, rotary

    module = Attention()
    note = absorb_latent_attention([("layers.0.self_attn", module)], layout)
    assert note.startswith("latent attention: not absorbed under flash_attention_2")
    assert type(module) is Attention and module.config._attn_implementation == "flash_attention_2"


@pytest.mark.unit
def test_only_mla_rows_without_an_indexer_absorb():
    absorbing = {name for name, family in FAMILIES.items() if family.latent_attention}
    assert {"deepseek_v2", "deepseek_v3", "kimi_linear", "mistral4"} <= absorbing
    # a DSA layer picks its mask by the implementation's name: absorbing would change which mask it builds
    assert not {name for name in absorbing if "indexer" in FAMILIES[name].attention_replicated}
    assert "latent_attention" not in FAMILIES["qwen3_moe"].policy_layout()
