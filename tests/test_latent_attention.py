"""The absorbed MLA decode step (codegen.policy.runtime.latent_attention) on transformers' own MLA model."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from codegen.families import FAMILIES
from codegen.harness.examples import example_config, installed_families, model_class
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


#: every row that decodes absorbed and the installed transformers ships, under sdpa (transformers' default); eager
#: too where the masks are built otherwise
CASES = [(name, implementation) for name, implementation in
         [(name, "sdpa") for name, row in FAMILIES.items() if row.latent_attention]
         + [("deepseek_v2", "eager"), ("glm5_next", "eager"), ("deepseek_v32", "eager")]
         if name in installed_families()]


@pytest.mark.unit
@pytest.mark.installed_transformers  # 4.x caches expanded keys: nothing to absorb there
@pytest.mark.parametrize("family, implementation", CASES)
def test_absorbed_decode_gives_the_expanded_logits(family, implementation):
    """Prefill, then two decode steps (padded rows, a DSA indexer's selection where the row has one): the absorbed
    model's logits are the expanded model's, within float32 rounding."""
    layout = FAMILIES[family].policy_layout()
    torch.manual_seed(0)
    config = example_config(family)
    expanded = model_class(family).from_config(config, attn_implementation=implementation).eval()
    absorbed = copy.deepcopy(expanded)
    modules = latent_attention_modules(absorbed, layout)
    note = absorb_latent_attention(modules, layout)
    if not modules:  # a source that caches expanded keys (transformers 4.x)
        assert note is None and not [m for m in absorbed.modules() if hasattr(type(m), layout["latent_attention"]
                                                                               ["expand"])]
        return
    assert "decode absorbed" in note, note
    assert {m.config._attn_implementation for _, m in modules} == {ABSORBED_ATTENTION}
    assert absorb_latent_attention(latent_attention_modules(absorbed, layout), layout) is None  # once only
    text = getattr(config, "text_config", config)
    ids = torch.randint(0, text.vocab_size, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    want, got = _steps(expanded, ids, mask), _steps(absorbed, ids, mask)
    # prefill: the padded positions' logits are noise either way (a fully masked row)
    prefill = (want[0] - got[0])[mask.bool()].abs().max()
    assert prefill <= 1e-5, prefill
    for step, (a, b) in enumerate(zip(want[1:], got[1:]), 1):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (step, (a - b).abs().max())


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
def test_mla_rows_absorb_but_those_with_sinks():
    absorbing = {name for name, family in FAMILIES.items() if family.latent_attention}
    mla = {name for name, family in FAMILIES.items() if "kv_a_proj_with_mqa" in family.attention_replicated}
    # sinks join the softmax inside the attention function, which the absorbed step does not compute
    assert mla - absorbing == {"hy_v4"} and "sinks" in FAMILIES["hy_v4"].attention_head_params
    assert "latent_attention" not in FAMILIES["qwen3_moe"].policy_layout()
