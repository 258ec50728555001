"""transformers 5.x's fused experts, run as one C call per MoE layer on a CPU rank (`experts_implementation="codegen"`).

transformers' default for its fused experts (`grouped_mm`) sorts the routed rows (S = tokens x top-k) by expert,
writes them gathered, multiplies them expert by expert, gates them, multiplies again, then unsorts and sums: a
batch-16 prefill of toy Qwen3-MoE widths streams five S x hidden arrays (32 MiB each) through memory per layer, and
its expert matmuls read rows and weights cold. `codegen::fused_experts` (codegen.policy.runtime.kernel) takes each
expert's rows through gate, up and down while they are in cache and adds them into the tokens' sums in expert order.
It covers gated experts whose gate is one of the kernel's (the layout's `gate`: transformers' default SiLU gate,
GPT-OSS's clamped SwiGLU), with or without biases, float32 on CPU; any other (a gate the module computes otherwise,
non-gated experts, bfloat16, GPU) runs transformers' `grouped_mm` as before, decided per module and per call.

The policy switches a model to it only where the model runs transformers' default (`grouped_mm`): a user's own
choice (`eager`, `batched_mm`, a kernel of theirs) is kept.
"""

import torch

from codegen.policy.runtime.base import GATE_CLAMPED_SWIGLU, GATE_SILU, attribute, expert_paths
from codegen.policy.runtime.kernel import define_op, fused_experts, fused_experts_available

#: the experts implementation this part registers with transformers, and the op it runs
IMPLEMENTATION = "codegen"
FUSED_EXPERTS = "codegen::fused_experts"
#: the experts implementation the policy replaces: transformers' default
REPLACED = "grouped_mm"
#: set on an experts module whose call the op can take (weights and gate checked once, at sharding)
FUSED_ATTR = "_codegen_fused_experts"


def register_fused_op():
    """`codegen::fused_experts`, once per process: opaque to torch.compile, with a fake kernel for tracing."""
    if hasattr(torch.ops.codegen, "fused_experts"):
        return
    define_op(FUSED_EXPERTS, "Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, "
              "Tensor? gate_up_bias, Tensor? down_bias, str gate, float alpha, float limit", fused_experts,
              lambda hidden, *_rest: hidden.new_empty(hidden.shape))


def reference_gate(gate, values, params):
    """What each gate makes of gate_up's output (the C kernel's definition, in torch): the module's own gate must
    agree with it on a probe before the policy hands its experts to the op."""
    if gate == GATE_SILU:
        first, second = values.chunk(2, dim=-1)
        return torch.nn.functional.silu(first) * second
    if gate == GATE_CLAMPED_SWIGLU:
        alpha, limit = params
        first, second = values[..., ::2].clamp(max=limit), values[..., 1::2].clamp(min=-limit, max=limit)
        return (second + 1) * first * torch.sigmoid(first * alpha)
    return None


def _tensors(experts, fused):
    """The experts module's gate-up and down Parameters and biases by the layout's names, where the op can take
    them: 3-D float32 weights on CPU with `in` or `out` contiguous, biases as transformers' decorator says there are
    (both, float32, one row per expert). None otherwise."""
    if "." in fused["gate_up"] + fused["down"] or fused.get("up"):
        return None
    weights = (getattr(experts, fused["gate_up"], None), getattr(experts, fused["down"], None))
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype == torch.float32 and w.device.type == "cpu"
               and 1 in w.stride()[1:] for w in weights):
        return None
    if not getattr(experts, "has_bias", False):
        return weights, (None, None)
    biases = tuple(getattr(experts, name, None) if name else None for name in (fused["gate_up_bias"],
                                                                               fused["down_bias"]))
    if not all(isinstance(b, torch.Tensor) and b.dim() == 2 and b.dtype == torch.float32 for b in biases):
        return None
    return weights, biases


def fused_call(experts, fused):
    """(names of gate-up, down, their biases, the gate, its parameters) where the op computes this experts module's
    forward, else None: transformers' decorator flags (gated, no norm after the experts), the layout's tensors, and
    the module's own gate equal to the layout's on a probe (so a transformers release that changes it is caught,
    never summed wrong)."""
    flags = all(getattr(experts, name, None) is value for name, value in
                (("has_gate", True), ("has_post_expert_norm", False), ("_is_expert_parallel", False)))
    tensors = _tensors(experts, fused) if flags and callable(getattr(experts, "_apply_gate", None)) else None
    if tensors is None:
        return None
    try:
        params = tuple(float(getattr(experts, name)) for name in fused.get("gate_params", ()))
    except (AttributeError, TypeError, ValueError):
        return None
    width = tensors[0][0].shape[2] if experts.is_transposed else tensors[0][0].shape[1]
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)) * max((4.0, *(abs(p) for p in params)))
    want = reference_gate(fused.get("gate", GATE_SILU), probe, params)
    with torch.no_grad():
        try:
            got = experts._apply_gate(probe)
        except (RuntimeError, ValueError, TypeError):
            return None
    if want is None or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return None
    names = (fused["gate_up"], fused["down"]) + ((fused["gate_up_bias"], fused["down_bias"])
                                                   if tensors[1][0] is not None else ("", ""))
    return (*names, fused.get("gate", GATE_SILU), *(params + (0.0, 0.0))[:2])


@torch.no_grad()
def output_dim_contiguous(experts, names):
    """Store an experts module's float32 weights with the output dim contiguous, same shape, same Parameters (the
    op's (E, in, out) row-major): a prefill's products run the kernel's blocked loop in place, where the (E, out,
    in) layout transformers keeps runs a few rows per expert in the dense loop's lanes or copies blocks first, and a
    decode step's stream eight weight rows at a time. One MoE layer of a TP=2 shard at the bench's full widths, one
    thread, the model's own routing (AMD EPYC, AVX-512), `in` -> `out` contiguous: Qwen3-MoE, a 16 x 64-token prefill
    1007-1042 -> 776-794 ms, 64 tokens 109 -> 95-96 ms, decode steps 0-10% slower (Qwen1.5-MoE's batch 1: 15%; the
    four families' figures in docs/policy.md). One weight at a time is copied; GPT-OSS's, kept input-dim first, are
    stored so already."""
    for name in names:
        weight = getattr(experts, name)
        op_view = weight.data if experts.is_transposed else weight.data.transpose(1, 2)  # (E, in, out)
        if op_view.stride(2) != 1:
            stored = op_view.contiguous()
            weight.data = stored if experts.is_transposed else stored.transpose(1, 2)


def use_fused_experts(blocks, layout):
    """Run the MoE blocks' fused experts as `codegen::fused_experts` where they take it; returns a note, or None.

    transformers 4.x (experts as module lists), remote code and models set to another implementation: unchanged."""
    fused = layout["fused"]
    candidates = [attribute(block, path) if path else block for _name, block in blocks for path in expert_paths(layout)]
    experts = [m for m in candidates if isinstance(m, torch.nn.Module) and hasattr(m, "is_concatenated")
               and getattr(getattr(m, "config", None), "_experts_implementation", None) == REPLACED]
    if not experts:  # transformers 4.x, remote code, another implementation chosen: nothing to import
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
    except ImportError:
        return None
    calls = [(m, fused_call(m, fused)) for m in experts]
    if not any(call for _m, call in calls):
        return None
    if not fused_experts_available():
        return "the experts run transformers' grouped matmul (the kernel cannot be built here)"
    register_fused_op()

    def codegen_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        """The op where this module takes it (`fused_call`) and the call is float32 on CPU; else transformers'."""
        call = getattr(self, FUSED_ATTR, None)
        if call is not None and hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu":
            gate_up, down = getattr(self, call[0]), getattr(self, call[1])
            if not self.is_transposed:  # (E, out, in) as stored: the op takes (E, in, out)
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            biases = [getattr(self, name) if name else None for name in call[2:4]]
            return torch.ops.codegen.fused_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, *biases,
                                                   *call[4:])
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, codegen_experts_forward)
    for module, call in calls:
        if call:
            setattr(module, FUSED_ATTR, call)
            output_dim_contiguous(module, call[:2])
    for config in {id(m.config): m.config for m in experts}.values():
        config._experts_implementation = IMPLEMENTATION
    return None


def fused_module_count(model):
    """How many experts modules of `model` run the op (what the tests check)."""
    return sum(1 for m in model.modules() if getattr(m, FUSED_ATTR, None) is not None)
