"""The names every part of the policy runtime shares, and the names the rewriter and the harness share with it.

The runtime is assembled from these parts into each model dir's `autotp_policy.py` (codegen.policy.assemble),
where it must stand alone: so it is the one definition of the names the generated modeling code, the
rewriter (codegen.patch) and the measuring harness (codegen.harness) agree on, and they import them from here.
Only the standard library: the CLI imports this part on its fast path.
"""

#: the DeepSpeed releases this runtime is tested with (pyproject.toml declares the same range)
SUPPORTED_DEEPSPEED = "deepspeed>=0.16.9,<0.20"

#: the helper the rewrite inserts into a patched modeling file (templates/modeling_block.py.j2 defines it)
REDUCE_HELPER = "_codegen_moe_all_reduce"
#: the record the rewrite puts into a patched modeling file (family, what it replaced in config.json)
PATCH_MARKER = "_CODEGEN_PATCH"
#: the reducer the policy attaches to each MoE block, which the inserted helper calls
REDUCER_ATTR = "_codegen_tp_reducer"
#: set on fused expert modules once the policy sharded them
SHARDED_FLAG = "_codegen_sharded"
#: set on other modules the policy sharded itself (linear attention): the names of the tensors it cut, relative to
#: the module
SHARDED_TENSORS = "_codegen_sharded_tensors"

#: fused (transformers 5.x) expert layouts, by what their 3-D Parameters hold (codegen.families names them per
#: family; codegen.policy.runtime.experts shards each):
#: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]
FUSED_GATE_UP_ROWS = "gate_up_rows"
#: gate_up [E, H, 2I] (gate columns, then up columns), down [E, I, H]
FUSED_GATE_UP_HALVES_COLS = "gate_up_halves_cols"
#: gate_up [E, H, 2I] with gate/up interleaved along the last dim (gate = [..., ::2], up = [..., 1::2]),
#: down [E, I, H]; optional biases gate_up_bias [E, 2I] and down_bias [E, H]
FUSED_GATE_UP_INTERLEAVED_COLS = "gate_up_interleaved_cols"
#: gate [E*I, H], up [E*I, H] and down [E*I, H] as three flat 2-D Parameters (expert e's rows e*I .. (e+1)*I; down is
#: applied as `x @ down_e`), the expert width an attribute the forward views them by
FUSED_FLAT_ROWS = "flat_rows"
#: non-gated experts (act(up) then down, no gate): up [E, I, H], down [E, H, I]; optional latent projections of the
#: MoE block into and out of the experts' width, kept whole on every rank (codegen.policy.runtime.experts)
FUSED_UP_ROWS = "up_rows"

#: the gates of fused experts the policy's fused op computes (codegen.policy.runtime.experts_implementation), by what
#: they make of gate_up's output: silu(gate) * up with transformers' default gate (gate and up concatenated)
GATE_SILU = "silu"
#: GPT-OSS's: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), gate and up interleaved;
#: alpha and limit are attributes of the experts module the layout names (`gate_params`)
GATE_CLAMPED_SWIGLU = "clamped_swiglu"


class PolicyError(RuntimeError):
    """A problem the user can fix; its message is one line."""


def attribute(module, path):
    """`module.<path>` for a dotted path (`text_moe.experts`, a Parameter of a submodule: `input_linear.weight`), or
    None where a step is missing."""
    for part in path.split("."):
        module = getattr(module, part, None)
    return module


def expert_paths(layout):
    """Dotted paths from an MoE block to each of its routed expert sets: the layout's `expert_sets` where a block holds
    several (one per modality), else its one `experts` attribute ("": the block itself holds the fused modules)."""
    return list(layout.get("expert_sets") or [layout["experts"]])
