"""Latent attention (MLA) decode with the up-projection absorbed: a decode step that does not re-expand the cache.

transformers 5.x's MLA families (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, Mistral 4, ...) cache the compressed latent
(`kv_lora_rank` wide, one per token) and one shared rotary key, and at every step expand the WHOLE cache through
`kv_b_proj` into every head's keys and values (`expand_kv`): a decode step multiplies (batch x context, rank) by
(rank, heads x (nope + value)) again, a cost that grows with the context (DeepSeek-V2-Lite's full widths, batch 16,
72 tokens: 53 of a ~194 ms step). Absorbed, the step multiplies each head's no-position query by that head's key
rows of `kv_b_proj` (into the latent width), attends over the latent cache as ONE key head shared by all heads
(the rotary part as it is), and multiplies the result by the head's value rows: the same products reassociated, no
work in the context length beyond attention itself. vLLM and SGLang run MLA decode this way.

Under tensor parallelism DeepSpeed splits `kv_b_proj` by heads, so a rank's rows of it are its own heads' key and
value rows: each rank absorbs its heads, reading the sharded weight as it is (no copy, nothing added to the model).
Prefill (more than one query token per sequence) keeps transformers' expansion and the attention implementation the
model was loaded with: there one expansion serves every query token, cheaper than attending at the latent width.

The attention module keeps its own forward: its `expand_kv` hands the cache's latent and rotary key through, and its
config (a copy: the model's mask building still reads the original) names `codegen_absorbed_mla`, registered with
transformers' `AttentionInterface`, which the forward looks up for its attention call. A DSA layer (an indexer picking
each query's top-k keys) then hands its selection over as a keyword instead of folding it into the mask, as it does
for any attention but eager and sdpa: the absorbed call folds it in the same way. What the step computes is
transformers' plain softmax(q k^T * scaling + mask) v; a family whose attention adds more inside (sinks) is not
absorbed (the family table decides).
"""

import copy
import sys

import torch

#: the attention implementation an absorbed module's config names (registered with transformers once per process)
ABSORBED_ATTENTION = "codegen_absorbed_mla"
#: the attribute holding what an absorbed module needs, resolved once: the attention function it was loaded with (its
#: prefill's), its up-projection's attribute, a head's no-position key and value widths, and a DSA selection's keyword
_LOADED_WITH = "_codegen_loaded_attention"
#: implementations whose inputs (keys and values as tensors, masks as tensors or None) the absorbed step can take
_ABSORBABLE = ("eager", "sdpa")


def latent_attention_modules(model, layout):
    """The MLA attention modules of a source that caches the latent: those whose class has the layout's expansion
    method (`expand_kv`) and its up-projection (`kv_b_proj`). transformers 4.x and hub remote code cache expanded
    keys and values (no such method): nothing to absorb there."""
    spec = layout.get("latent_attention")
    if not spec:
        return []
    return [(name, module) for name, module in model.named_modules()
            if callable(getattr(type(module), spec["expand"], None))
            and isinstance(module._modules.get(spec["up_projection"]), torch.nn.Module)]


def _latent_class(base, spec):
    """A subclass of the attention class whose expansion hands the cached latent and rotary key through as they
    are; the absorbed attention call expands them itself where it must (prefill)."""

    def latent_through(self, latent, rotary):
        return latent, rotary

    cls = type(f"AbsorbedLatent[{base.__name__}]", (base,), {spec["expand"]: latent_through,
                                                             "_codegen_expand": getattr(base, spec["expand"])})
    cls.__module__ = base.__module__
    return cls


_LATENT_CLASSES = {}


def absorb_latent_attention(modules, layout):
    """Every module of `modules` decodes absorbed; returns the start's note (None where there are none).

    The modules must have been loaded with eager or sdpa attention (their inputs are the tensors the absorbed step
    takes); any other implementation keeps transformers' expansion, and the note says so. A module absorbed already
    (a second `init_inference` on the same model) is left as it is.
    """
    modules = [(name, module) for name, module in modules if not hasattr(module, _LOADED_WITH)]
    if not modules:
        return None
    spec = layout["latent_attention"]
    loaded = {module.config._attn_implementation for _, module in modules}
    if not loaded <= set(_ABSORBABLE):
        return (f"latent attention: not absorbed under {', '.join(sorted(map(str, loaded)))} attention "
                f"(absorbed under {' or '.join(_ABSORBABLE)}): every decode step expands the cache")
    fallbacks = {type(m): getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None)
                 for _, m in modules}
    if None in fallbacks.values():
        return "latent attention: not absorbed: its modeling module has no eager_attention_forward"
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(ABSORBED_ATTENTION, absorbed_attention)
    configs = {}
    for _, module in modules:
        base = type(module)
        if base not in _LATENT_CLASSES:
            _LATENT_CLASSES[base] = _latent_class(base, spec)
        implementation = module.config._attn_implementation
        attend = fallbacks[base] if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        setattr(module, _LOADED_WITH, (attend, spec["up_projection"], int(getattr(module, spec["nope_width"])),
                                       int(getattr(module, spec["value_width"])), spec["selected_keys"]))
        if id(module.config) not in configs:
            own = copy.copy(module.config)
            own._attn_implementation_internal = ABSORBED_ATTENTION
            configs[id(module.config)] = own
        module.config = configs[id(module.config)]
        module.__class__ = _LATENT_CLASSES[base]
    return (f"latent attention: {len(modules)} layers decode absorbed (`{spec['up_projection']}` applied to the query "
            "and the output, not to the cache)")


def absorbed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The attention call of an absorbed module: `key` is the cache's latent [b, 1, T, rank], `value` its rotary
    key [b, 1, T, rope]; `query` [b, heads, s, nope + rope] as transformers built it. Returns [b, s, heads, v]."""
    attend, up_projection, nope, value_width, selection = getattr(module, _LOADED_WITH)
    selected = kwargs.pop(selection, None)
    if selected is not None:
        attention_mask = with_selected_keys(attention_mask, selected, key.shape[2], query.dtype)
    if query.shape[2] != 1:  # prefill: expand once, attend as loaded
        keys, values = module._codegen_expand(key, value)
        return attend(module, query, keys, values, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return absorbed_decode(query, key, value, attention_mask, scaling, module._modules[up_projection].weight, nope,
                           value_width)


def with_selected_keys(attention_mask, selected, length, dtype):
    """The mask with only a DSA indexer's selected keys visible ([b, s, top-k] key positions; -1 or out of range:
    none), in the mask's own form: what a DSA layer folds in itself before an eager or sdpa attention."""
    valid = selected.ge(0) & selected.lt(length)
    counts = torch.zeros(*selected.shape[:2], length, dtype=torch.int32, device=selected.device)
    visible = counts.scatter_add_(-1, selected.long().clamp(0, length - 1), valid.to(torch.int32)).ne(0).unsqueeze(1)
    if attention_mask is None:
        return visible
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :length] & visible
    return attention_mask[..., :length].masked_fill(~visible, torch.finfo(dtype).min)


def absorbed_decode(query, latent, rotary, attention_mask, scaling, up_weight, nope, value_width):
    """One query token per sequence, attended over the latent cache with `up_weight` ([heads x (nope + value),
    rank], this rank's heads) absorbed into the query and the output. Returns ([b, 1, heads, value], weights)."""
    batch, heads, steps, _ = query.shape
    rank = latent.shape[-1]
    length = latent.shape[2]
    up = up_weight.view(heads, nope + value_width, rank)
    q_nope, q_rot = query.split([nope, query.shape[-1] - nope], dim=-1)
    # each head's no-position query in the latent width: [heads, b*s, nope] @ [heads, nope, rank]
    q_latent = torch.bmm(q_nope.transpose(0, 1).reshape(heads, batch * steps, nope), up[:, :nope])
    q_latent = q_latent.view(heads, batch, steps, rank).transpose(0, 1).reshape(batch, heads * steps, rank)
    latent = latent.reshape(batch, length, rank)
    rotary = rotary.reshape(batch, length, -1)
    # every head against the one shared latent key: [b, heads*s, rank] @ [b, rank, T], plus the rotary part
    scores = torch.baddbmm(torch.bmm(q_rot.reshape(batch, heads * steps, -1), rotary.transpose(1, 2)),
                           q_latent, latent.transpose(1, 2)).view(batch, heads, steps, length) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :length]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out_latent = torch.bmm(weights.view(batch, heads * steps, length), latent)  # [b, heads*s, rank]
    # back to each head's values: [heads, b*s, rank] @ [heads, rank, value]
    out = torch.bmm(out_latent.view(batch, heads, steps, rank).transpose(0, 1).reshape(heads, batch * steps, rank),
                    up[:, nope:].transpose(1, 2))
    return out.view(heads, batch, steps, value_width).permute(1, 2, 0, 3), weights
