"""The single-process reference every phase is judged against: the unpatched dir, unsharded, float32.

Also the numerics the bench compares by (relative error, greedy agreement), and the unsharded model's own error
at a 16-bit dtype (the yardstick a tensor-parallel run at that dtype is judged against).
"""

from __future__ import annotations

import ctypes
import gc
import time

import torch

from codegen.harness.worker.images import image_inputs
from codegen.harness.worker.model_figures import cache_of, gate_types, gate_weights, param_bytes
from codegen.models import dir_family, has_remote_code, load, runs_as
from codegen.harness.worker.run import Run


class Reference:
    """The single-process unpatched model's outputs and parameter figures (the model itself is freed).

    With `decode_steps`, also its greedy decode with the KV cache: the tokens the ab phase forces and
    each step's logits. With `image`, for a multimodal wrapper, also the inputs of a prompt holding an image
    (codegen.harness.worker.images) and that forward's logits.
    """

    def __init__(self, run: Run, directory: str, ids: torch.Tensor, generate: int, decode_steps: int,
                 image: bool = False) -> None:
        t0 = time.perf_counter()
        model = runs_as(load(directory, has_remote_code(directory), torch.float32)).to(run.device)
        t1 = time.perf_counter()
        self.prefill_s, self.decode_s, self.forced, self.step_logits = [], [], [], []
        with torch.no_grad():
            run.sync()
            t = time.perf_counter()
            # with its cache, as every phase's forward runs (4.57's GLM-4V cannot build its mask without one)
            out = model(ids, use_cache=True)
            run.sync()
            self.prefill_s.append(time.perf_counter() - t)
            self.logits = out.logits.float().cpu()
            t2 = time.perf_counter()
            self.tokens = greedy(model, ids[:1], generate) if generate else None
            if decode_steps:
                cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
                for _ in range(decode_steps):
                    self.forced.append(token)
                    run.sync()
                    t = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    run.sync()
                    self.decode_s.append(time.perf_counter() - t)
                    self.step_logits.append(out.logits.float().cpu())
                    cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
            # last: a wrapper may keep state from an image forward (4.x GLM-4V keeps its rope deltas)
            self.image = image_inputs(model, ids, dir_family(directory)) if image else None
            self.image_logits = model(**self.image).logits.float().cpu() if self.image is not None else None
        self.timings = {"reference_load_s": t1 - t0, "reference_forward_s": t2 - t1,
                        "reference_generate_s": time.perf_counter() - t2}
        self.bytes = param_bytes(model)
        self.gates = gate_weights(model)
        self.gate_types = gate_types(model)
        # every name of a tied weight (DeepSpeed unties an LM head tied to the embeddings when it shards it)
        named = list(model.named_parameters(remove_duplicate=False))
        self.shapes = {n: tuple(p.shape) for n, p in named}
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in named}
        del model, out
        release_heap()
        self.baseline = (single_process_error(run, directory, ids, self)
                         if decode_steps and run.dtype != torch.float32 else None)

    def tensors(self) -> list:
        """Every tensor this reference keeps (the gates' copies, logits, tokens): not a copy a model kept."""
        kept = (self.logits, self.tokens, self.image_logits, *(self.image or {}).values(), *self.gates.values(),
                *self.forced, *self.step_logits)
        return [t for t in kept if isinstance(t, torch.Tensor)]


def single_process_error(run: Run, directory: str, ids: torch.Tensor, ref: Reference) -> dict:
    """The error of the unsharded model itself at the run's dtype, vs. its float32 self (same forced tokens).

    What a tensor-parallel run at that dtype is judged against: its rounding differs from this one's
    (partial sums rounded per rank) but should be of the same size.
    """
    model = runs_as(load(directory, has_remote_code(directory), run.dtype)).to(run.device)
    agreeing = total = 0
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = out.logits.float().cpu()
        figures = {"prefill_maxdiff": (logits - ref.logits).abs().max().item(),
                   "prefill_relative": relative(logits, ref.logits), "decode_maxdiff": 0.0, "decode_relative": 0.0}
        cache = cache_of(out)
        for token, expected in zip(ref.forced, ref.step_logits):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, logits = cache_of(out), out.logits.float().cpu()
            figures["decode_maxdiff"] = max(figures["decode_maxdiff"], (logits - expected).abs().max().item())
            figures["decode_relative"] = max(figures["decode_relative"], relative(logits, expected))
            same, n = agree(logits, expected)
            agreeing, total = agreeing + same, total + n
    del model, out, cache
    gc.collect()
    return {**figures, "dtype": run.dtype_name, "tokens_agree": agreeing, "tokens_total": total}


def greedy(model, ids, n: int) -> torch.Tensor:
    """`n` greedy tokens after `ids` (exactly n: no early end)."""
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False).cpu()



def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: the error measure that means the same in float32 and bfloat16."""
    scale = ref.abs().max().item()
    return (x - ref).abs().max().item() / scale if scale else float("inf")


def agree(x: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(matching, total) greedy next tokens of the last position, over the batch."""
    same = x[:, -1].argmax(-1) == ref[:, -1].argmax(-1)
    return int(same.sum().item()), same.numel()


def release_heap() -> None:
    """Free what is unreachable, then hand freed heap pages back to the OS (glibc keeps them otherwise): the next
    job's models need them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
