"""One rank of tests/test_families_tp.py: every family's patched dir under its own autotp_policy, in one process.

Usage (started by the test with torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_*):
    python tests/families_tp_rank.py OUT_DIR TP PATCHED_DIR:PRISTINE_DIR [...]

For each pair: the single-process reference (the pristine dir, transformers' built-in model) gives logits,
greedy tokens, routed-expert bytes and router tensors; then the patched dir goes through its own
`autotp_policy.init_inference` and the same forward is measured: every all-reduce DeepSpeed's backend issues
(all_reduce and inference_all_reduce, whichever path a layer takes), the max logits diff, the share of the
routed experts' bytes this rank holds, routers whole, greedy tokens. Writes OUT_DIR/rank<N>.json.
Everything the script needs to know about a family comes from the policy's own LAYOUT.
"""

import importlib.util
import json
import os
import sys
import time

import torch


def load_policy(model_dir, index):
    spec = importlib.util.spec_from_file_location(f"autotp_policy_{index}", os.path.join(model_dir, "autotp_policy.py"))
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    return policy


def dtype_kwarg():
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def moe_blocks(model, layout):
    classes = set(layout["moe_classes"])
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes and hasattr(m, layout["experts"])]


def expert_bytes(model, layout):
    """Bytes of every routed expert tensor (per-expert MLPs or fused Parameters) of the MoE blocks."""
    total = 0
    for _, block in moe_blocks(model, layout):
        total += sum(p.numel() * p.element_size() for p in getattr(block, layout["experts"]).parameters())
    return total


def routers(model, layout):
    """name -> tensor of every router of every MoE block (state dict entries, buffers included)."""
    out = {}
    for name, block in moe_blocks(model, layout):
        for attr in layout["routers"]:
            module = getattr(block, attr, None)
            for key, tensor in (module.state_dict().items() if module is not None else ()):
                out[f"{name}.{attr}.{key}"] = tensor.detach().clone()
    return out


class Counter:
    """Counts DeepSpeed backend reductions: every all-reduce path (row layers, lm_head, the coalesced one)."""

    def __init__(self, backend):
        self.calls = 0
        for name in ("all_reduce", "inference_all_reduce"):
            original = getattr(backend, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(backend, name, counted)


def main():
    out_dir, tp, pairs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    import deepspeed
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    counter = Counter(deepspeed.comm.comm.cdb)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    kw = {dtype_kwarg(): torch.float32}
    results = {}
    for index, pair in enumerate(pairs):
        patched, pristine = pair.split(":")
        started = time.monotonic()
        policy = load_policy(patched, index)
        layout = policy.LAYOUT
        reference = AutoModelForCausalLM.from_pretrained(pristine, **kw).eval()
        with torch.no_grad():
            ref_logits = reference(ids).logits
            ref_tokens = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        full_bytes, full_routers = expert_bytes(reference, layout), routers(reference, layout)
        del reference

        model = AutoModelForCausalLM.from_pretrained(patched, trust_remote_code=True, **kw).eval()
        engine = policy.init_inference(model, tp_size=tp, dtype=torch.float32)
        module = getattr(engine, "module", engine)
        before = counter.calls
        with torch.no_grad():
            logits = module(ids).logits
        reductions = counter.calls - before
        with torch.no_grad():
            tokens = module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got_routers = routers(module, layout)
        config = module.config
        layers = getattr(config, "text_config", config).num_hidden_layers
        blocks = len(moe_blocks(module, layout))
        results[layout["family"]] = {
            "allreduce_per_forward": reductions,
            # one per attention layer + one per MoE layer + one per dense MLP + one for the LM head
            "expected_allreduce": layers + blocks + (layers - blocks) + 1,
            "moe_layers": blocks,
            "maxdiff": (logits - ref_logits).abs().max().item(),
            "expert_bytes_ratio": expert_bytes(module, layout) / max(full_bytes, 1),
            "routers_intact": bool(full_routers) and full_routers.keys() == got_routers.keys() and all(
                torch.equal(full_routers[k], got_routers[k].to(full_routers[k].dtype)) for k in full_routers),
            "tokens_equal": torch.equal(tokens, ref_tokens),
            "seconds": time.monotonic() - started,
        }
        del engine, module, model
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
