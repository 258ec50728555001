"""Eager attention as one C call per layer (`codegen::eager_attention`) where a model runs transformers' eager
attention on a CPU rank, or its SDPA in float32: a decode step's and a prefill's.

Eager attention (GPT-OSS's: its sinks rule out SDPA) repeats each kv head's keys for its query heads, multiplies,
adds the mask, concatenates the sinks, takes a softmax and multiplies again; inductor fuses that into a few loops
that still visit each kv head's cache once per query head, and a prefill writes and reads every score in memory
three times. The decode kernel reads each kv head's keys and values once for its group of query heads, 16 keys'
scores summed at once. Measured (toy GPT-OSS widths at TP=2: 8 query heads, 2 kv heads, batch 16, one thread): with
the cache in L2, 0.30 ms against 4.3 ms for inductor's loops; inside a compiled decode step on 2 ranks, where each
step reads the cache from memory, 0.36 ms against 0.45 a layer at 128 cached columns (the step itself within noise),
and the step at 1024 cached columns 13.3 -> 12.1 ms. The prefill kernel takes 32 query rows of a head at a time:
their scores over only the keys some row of them does not mask (a causal or sliding window skips the rest) by BLAS,
the softmax in vector registers while the scores are in L2, the values by BLAS (same widths, 128-token prompts,
one thread: 6.3 ms a layer against eager's 25.5). A float32 model on SDPA takes the kernels too: at toy Qwen3-MoE
widths (8 query heads over 2 kv heads), batch 16, one thread, a 128-token prefill 4.6 ms against SDPA's 8.0, a decode
step at 160 cached columns 0.16 against 0.27; SDPA still runs what the kernels do not take, given eager's additive
masks (it takes them as they are).

Which attention layers take it is decided by a probe, not by the family: a layer's own eager function (its modeling
module's `eager_attention_forward`) and the kernel must agree on a random decode call and a random prefill call at
the layer's shapes, with the layer's sinks or without. A family whose eager attention computes anything else (a
softcap, a scaling of its own) keeps it. Calls the kernel does not take (not float32 on CPU, training, dropout, a
mask that is not additive float32, a head_dim or group the decode kernel does not take, a keyword the family's
eager function takes beyond the usual ones, such as a softcap) run what the layer ran before: its eager function, or
SDPA.
"""

import inspect
import sys

import torch

from codegen.policy.runtime.kernel import decode_attention, define_op, grouped_mm_kernel, prefill_attention

#: the attention implementation this part registers with transformers (masks: eager's), and the op it runs
ATTENTION_IMPLEMENTATION = "codegen_eager"
EAGER_ATTENTION = "codegen::eager_attention"
#: the implementations the kernels replace: eager, and SDPA in float32 models (the kernels' dtype)
ATTENTION_REPLACED = ("eager", "sdpa")
#: set on an attention module the probe adopted: the name of its sinks Parameter, or "" for none
SINKS_ATTR = "_codegen_attention_sinks"
#: set with it: (the implementation it replaced, the family eager function's keywords the kernels do not compute)
REPLACED_ATTR = "_codegen_attention_replaced"
#: the parameters every eager attention function takes (the kernels compute them)
EAGER_PARAMETERS = ("module", "query", "key", "value", "attention_mask", "scaling", "dropout")
#: what the decode kernel takes: head_dim a multiple of its vector width up to 256, up to 16 query heads per kv head
HEAD_DIM_STEP = 16
HEAD_DIM_MAX = 256
GROUP_MAX = 16
#: agreement the probe asks of the kernel against the layer's eager attention (float32, unit-scale values)
PROBE_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def eager_attention(query, key, value, mask, sinks, scale):
    """(B, Q, Hq, D): the decode kernel for one new token per row, the prefill kernel for more."""
    if query.shape[2] == 1:
        return decode_attention(query, key, value, mask, sinks, scale)
    return prefill_attention(query, key, value, mask, sinks, scale)


def register_eager_attention_op():
    """`codegen::eager_attention`, once per process: opaque to torch.compile, with a fake kernel for tracing."""
    if hasattr(torch.ops.codegen, "eager_attention"):
        return
    define_op(EAGER_ATTENTION, "Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor? sinks, float scale",
              eager_attention, lambda query, *_rest: query.new_empty(query.shape[0], query.shape[2], query.shape[1],
                                                                      query.shape[3]))


def family_eager(module):
    """The eager attention function of the module's own modeling file (what transformers runs for "eager")."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def kernel_takes(query, key, value, mask):
    """Whether a call is one the kernels compute: float32 on CPU, grouped heads, an additive mask of the scores'
    shape (or broadcast to it); one new token per row only where the decode kernel takes head_dim and group. Plain
    shape checks (torch.compile traces them); whether BLAS is there is the probe's to find out."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return False
    tensors = (query, key, value) if mask is None else (query, key, value, mask)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[3] != dim or length < 1 or rows < 1 or kv_heads < 1 or heads % kv_heads:
        return False
    if rows == 1 and (dim % HEAD_DIM_STEP or dim > HEAD_DIM_MAX or heads // kv_heads > GROUP_MAX):
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) \
                or mask.shape[2] not in (1, rows) or mask.shape[3] not in (1, length):
            return False
    return True


def codegen_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The kernels for an adopted layer's float32 CPU calls; what the layer ran before otherwise."""
    sinks_name = getattr(module, SINKS_ATTR, None)
    replaced, extras = getattr(module, REPLACED_ATTR, ("eager", ()))
    # SDPA reads no mask over several query rows as causal (unless told otherwise); eager, and the kernels, as none
    causal = kwargs.get("is_causal")
    implied_causal = (replaced != "eager" and attention_mask is None and query.shape[2] > 1
                      and (causal if causal is not None else getattr(module, "is_causal", True)) is not False)
    if (sinks_name is not None and isinstance(scaling, float) and not dropout and not module.training
            and not kwargs.get("output_attentions") and all(kwargs.get(name) is None for name in extras)
            and not implied_causal and kernel_takes(query, key, value, attention_mask)):
        sinks = getattr(module, sinks_name) if sinks_name else None
        return torch.ops.codegen.eager_attention(query, key, value, attention_mask, sinks, scaling), None
    if replaced == "eager":
        attend = family_eager(module)
    else:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attend = ALL_ATTENTION_FUNCTIONS[replaced]
    return attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def eager_extras(function):
    """The keywords `function` (a family's eager attention) takes beyond `EAGER_PARAMETERS`: a call that sets one
    (a softcap, a position bias) asks for what the kernels do not compute."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return tuple(p.name for p in parameters if p.name not in EAGER_PARAMETERS
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _probe_calls(heads, groups, dim, generator):
    """A random decode call (one token over 19 cached columns, the first 5 of a row masked) and a random prefill
    call (7 tokens after 12 cached, causal, one row's first 3 masked), keys and values as views of a cache store."""
    batch, cached, new = 2, 12, 7
    for rows, length in ((1, 19), (new, cached + new)):
        query = torch.randn(batch, rows, heads, dim, generator=generator).transpose(1, 2)
        store = torch.randn(2, batch, heads // groups, length + 5, dim, generator=generator)
        mask = torch.zeros(batch, 1, rows, length)
        if rows > 1:
            later = torch.arange(length)[None, :] > torch.arange(cached, length)[:, None]
            mask.masked_fill_(later, torch.finfo(torch.float32).min)
        mask[0, ..., :5 if rows == 1 else 3] = torch.finfo(torch.float32).min
        yield query, store[0, :, :, 2:2 + length], store[1, :, :, 2:2 + length], mask


def _probe(module, sinks_name):
    """Whether the layer's eager attention and the kernels agree on random calls at the layer's shapes."""
    sinks = getattr(module, sinks_name) if sinks_name else None
    groups = int(getattr(module, "num_key_value_groups", 0) or 0)
    dim = int(getattr(module, "head_dim", 0) or 0)
    scaling = getattr(module, "scaling", None)
    heads = sinks.shape[0] if sinks is not None else groups
    if groups < 1 or dim < 1 or heads % groups or not isinstance(scaling, float):
        return False
    head_sinks = None if sinks is None else sinks.detach().float()
    for query, key, value, mask in _probe_calls(heads, groups, dim, torch.Generator().manual_seed(0)):
        if not kernel_takes(query, key, value, mask):
            return False
        try:
            with torch.no_grad():
                expected = family_eager(module)(module, query, key, value, mask, scaling=scaling, dropout=0.0)[0]
                got = eager_attention(query, key, value, mask, head_sinks, scaling)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
            return False
        if expected.shape != got.shape or not torch.allclose(expected.float(), got, **PROBE_TOLERANCE):
            return False
    return True


def _sinks_candidates(module):
    """The layer's sinks Parameter (one logit per local head) first, then none."""
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.nn.Parameter) and sinks.dim() == 1:
        return ["sinks", ""]
    return [""]


def use_eager_attention_kernel(model):
    """Run `model`'s eager attention layers, and its SDPA ones where its weights are float32, as
    `codegen::eager_attention` where the probe agrees. Returns None (a note's place in `init_inference`): a layer
    not adopted keeps what it ran, and only a config whose attention layers were all adopted is switched."""
    try:
        first = next(model.parameters())
    except StopIteration:
        return None
    replaceable = ATTENTION_REPLACED if first.dtype == torch.float32 else ("eager",)
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and family_eager(m) is not None
              and getattr(getattr(m, "config", None), "_attn_implementation", None) in replaceable
              and not m.training]
    if not layers:
        return None
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    if first.device.type != "cpu" or grouped_mm_kernel() is None:
        return None
    adopted = {}
    for layer in layers:
        extras = eager_extras(family_eager(layer))
        name = None if extras is None else next((n for n in _sinks_candidates(layer) if _probe(layer, n)), None)
        if name is not None:
            adopted[id(layer)] = (name, (layer.config._attn_implementation, extras))
    configs = {}
    for layer in layers:
        configs.setdefault(id(layer.config), (layer.config, []))[1].append(layer)
    switched = [config for config, readers in configs.values() if all(id(m) in adopted for m in readers)]
    if not switched:
        return None
    register_eager_attention_op()
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, codegen_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, eager_mask)  # additive: SDPA takes them too
    for config in switched:
        for layer in configs[id(config)][1]:
            sinks_name, replaced = adopted[id(layer)]
            setattr(layer, SINKS_ATTR, sinks_name)
            setattr(layer, REPLACED_ATTR, replaced)
        config._attn_implementation = {"": ATTENTION_IMPLEMENTATION}  # this config only: its sub-configs keep theirs
    return None


def attention_kernel_layer_count(model):
    """How many attention layers of `model` run the kernels (what the tests check)."""
    return sum(1 for m in model.modules() if getattr(m, SINKS_ATTR, None) is not None)
