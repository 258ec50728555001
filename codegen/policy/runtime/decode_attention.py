"""A decode step's attention as one C call per layer (`codegen::decode_attention`) where a model runs transformers'
eager attention on a CPU rank.

Eager attention (GPT-OSS's: its sinks rule out SDPA) repeats each kv head's keys for its query heads, multiplies,
adds the mask, concatenates the sinks, takes a softmax and multiplies again; inductor fuses that into a few loops
that still visit each kv head's cache once per query head. The kernel reads each kv head's keys and values once for
its group of query heads, 16 keys' scores summed at once. Measured (toy GPT-OSS widths at TP=2: 8 query heads, 2 kv
heads, batch 16, one thread): with the cache in L2, 0.30 ms against 4.3 ms for inductor's loops; inside a compiled
decode step on 2 ranks, where each step reads the cache from memory, 0.36 ms against 0.45 a layer at 128 cached
columns (the step itself within noise), and the step at 1024 cached columns 13.3 -> 12.1 ms.

Which attention layers take it is decided by a probe, not by the family: a layer's own eager function (its modeling
module's `eager_attention_forward`) and the kernel must agree on a random decode call at the layer's shapes, with
the layer's sinks or without. A family whose eager attention computes anything else (a softcap, a scaling of its
own) keeps it. Calls that are not a float32 CPU decode call (a prefill, several new tokens, training, dropout, a
mask that is not additive float32) run the layer's eager function as before.
"""

import sys

import torch

from codegen.policy.runtime.kernel import decode_attention, define_op, grouped_mm_kernel

#: the attention implementation this part registers with transformers (masks: eager's), and the op it runs
ATTENTION_IMPLEMENTATION = "codegen_eager"
ATTENTION_REPLACED = "eager"
DECODE_ATTENTION = "codegen::decode_attention"
#: set on an attention module the probe adopted: the name of its sinks Parameter, or "" for none
SINKS_ATTR = "_codegen_decode_sinks"
#: what the kernel takes: head_dim a multiple of its vector width up to 256, up to 16 query heads per kv head
HEAD_DIM_STEP = 16
HEAD_DIM_MAX = 256
GROUP_MAX = 16
#: agreement the probe asks of the kernel against the layer's eager attention (float32, unit-scale values)
PROBE_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def register_decode_attention_op():
    """`codegen::decode_attention`, once per process: opaque to torch.compile, with a fake kernel for tracing."""
    if hasattr(torch.ops.codegen, "decode_attention"):
        return
    define_op(DECODE_ATTENTION, "Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor? sinks, float scale",
              decode_attention, lambda query, *_rest: query.new_empty(query.shape[0], 1, query.shape[1],
                                                                       query.shape[3]))


def family_eager(module):
    """The eager attention function of the module's own modeling file (what transformers runs for "eager")."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def kernel_takes(query, key, value, mask):
    """Whether a call is one the kernel computes: one new token per row, float32 on CPU, shapes it takes."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape or query.shape[2] != 1:
        return False
    tensors = (query, key, value) if mask is None else (query, key, value, mask)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != batch or key.shape[3] != dim or key.shape[2] < 1 or kv_heads < 1 or heads % kv_heads:
        return False
    if dim % HEAD_DIM_STEP or dim > HEAD_DIM_MAX or heads // kv_heads > GROUP_MAX:
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, batch) \
                or mask.shape[3] not in (1, key.shape[2]):
            return False
    return True


def codegen_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The kernel for an adopted layer's float32 CPU decode calls; the layer's own eager attention otherwise."""
    sinks_name = getattr(module, SINKS_ATTR, None)
    if (sinks_name is not None and isinstance(scaling, float) and not dropout and not module.training
            and not kwargs.get("output_attentions") and kernel_takes(query, key, value, attention_mask)):
        sinks = getattr(module, sinks_name) if sinks_name else None
        return torch.ops.codegen.decode_attention(query, key, value, attention_mask, sinks, scaling), None
    return family_eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                **kwargs)


def _probe(module, sinks_name):
    """Whether the layer's eager attention and the kernel agree on a random decode call at the layer's shapes."""
    sinks = getattr(module, sinks_name) if sinks_name else None
    groups = int(getattr(module, "num_key_value_groups", 0) or 0)
    dim = int(getattr(module, "head_dim", 0) or 0)
    scaling = getattr(module, "scaling", None)
    heads = sinks.shape[0] if sinks is not None else groups
    if groups < 1 or dim < 1 or heads % groups or not isinstance(scaling, float):
        return False
    generator = torch.Generator().manual_seed(0)
    batch, length = 2, 19
    query = torch.randn(batch, 1, heads, dim, generator=generator).transpose(1, 2)
    store = torch.randn(2, batch, heads // groups, length + 5, dim, generator=generator)
    key, value = store[0, :, :, 2:2 + length], store[1, :, :, 2:2 + length]
    mask = torch.zeros(batch, 1, 1, length)
    mask[0, ..., :5] = torch.finfo(torch.float32).min
    if not kernel_takes(query, key, value, mask):
        return False
    try:
        with torch.no_grad():
            expected = family_eager(module)(module, query, key, value, mask, scaling=scaling, dropout=0.0)[0]
            got = decode_attention(query, key, value, mask, None if sinks is None else sinks.detach().float(), scaling)
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
        return False
    return expected.shape == got.shape and torch.allclose(expected.float(), got, **PROBE_TOLERANCE)


def _sinks_candidates(module):
    """The layer's sinks Parameter (one logit per local head) first, then none."""
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.nn.Parameter) and sinks.dim() == 1:
        return ["sinks", ""]
    return [""]


def use_decode_attention(model):
    """Run the decode steps of `model`'s eager attention layers as `codegen::decode_attention` where the probe
    agrees. Returns None (a note's place in `init_inference`): a layer not adopted keeps its own eager attention,
    which is what ran before. Only a config set to eager whose attention layers were all adopted is switched."""
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and family_eager(m) is not None
              and getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_REPLACED
              and not m.training]
    if not layers:
        return None
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    if next(model.parameters()).device.type != "cpu" or grouped_mm_kernel() is None:
        return None
    adopted = {}
    for layer in layers:
        name = next((n for n in _sinks_candidates(layer) if _probe(layer, n)), None)
        if name is not None:
            adopted[id(layer)] = (layer, name)
    configs = {}
    for layer in layers:
        configs.setdefault(id(layer.config), (layer.config, []))[1].append(layer)
    switched = [config for config, readers in configs.values() if all(id(m) in adopted for m in readers)]
    if not switched:
        return None
    register_decode_attention_op()
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, codegen_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, eager_mask)
    for config in switched:
        for layer in configs[id(config)][1]:
            setattr(layer, SINKS_ATTR, adopted[id(layer)][1])
        config._attn_implementation = {"": ATTENTION_IMPLEMENTATION}  # this config only: its sub-configs keep theirs
    return None


def decode_attention_layer_count(model):
    """How many attention layers of `model` run the kernel in decode (what the tests check)."""
    return sum(1 for m in model.modules() if getattr(m, SINKS_ATTR, None) is not None)
