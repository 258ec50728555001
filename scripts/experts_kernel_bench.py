"""The experts' grouped matmul on its own, at the bench's published widths: codegen's kernel against torch's.

One decode step's routed experts of one MoE layer, a TP=2 rank's shard (the intermediate dim halved), on one
thread (what each of 2 ranks gets on 2 cores): the rows a batch routes (each token to its top-k distinct experts,
drawn at random), the expert weights in the layout transformers 5.x passes them (read from the model class, built
on the meta device), in float32 and bfloat16. torch's side is what the model runs without codegen's op: in float32
transformers' fallback (a matmul per expert that has rows), in bfloat16 `torch._grouped_mm`. Prints, per row, the
milliseconds per layer (best of the trials) and the GB/s of the experts' weights that the routing hit.
Usage: .venv/bin/python scripts/experts_kernel_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from codegen.harness.examples import families_with, shape
from codegen.harness.results import machine_info
from codegen.policy.runtime.kernel import experts_grouped_mm

#: the batches the bench decodes, the dtypes, the ranks a shard is cut for, trials per figure (best kept)
BATCHES, DTYPES, TP, TRIALS, SEED = (1, 16), (torch.float32, torch.bfloat16), 2, 7, 0


def fused_experts(family: str):
    """The first fused-experts module of `family`'s full-width model, built on the meta device (no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **shape(family, "full"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        weights = dict(module.named_parameters(recurse=False))
        if weights.get("gate_up_proj") is not None and weights["gate_up_proj"].dim() == 3:
            return config, module
    raise SystemExit(f"{family}: no fused experts (gate_up_proj) in its model under this transformers")


def shard_weights(module, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (gate_up, down) of one rank's shard, as transformers hands them to the grouped matmul: (E, in, out)
    views, transposed from (E, out, in) unless the module stores them input-dim first."""
    transposed = getattr(module, "is_transposed", False)
    input_dim, output_dim = (1, 2) if transposed else (2, 1)
    views = []
    # the intermediate dim, split over the ranks: gate/up's output, down's input
    for name, inner in (("gate_up_proj", output_dim), ("down_proj", input_dim)):
        full = list(getattr(module, name).shape)
        full[inner] //= TP
        weight = torch.randn(full, dtype=dtype) * 0.02
        views.append(weight if transposed else weight.transpose(1, 2))
    return views[0], views[1]


def routed(experts: int, top: int, batch: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows per expert, the groups' ends) of a batch routing each token to `top` distinct experts."""
    picks = torch.stack([torch.randperm(experts, generator=generator)[:top] for _ in range(batch)]).flatten()
    counts = torch.bincount(picks, minlength=experts)
    return counts, counts.cumsum(0).to(torch.int32)


def torch_grouped(rows, weight, ends):
    """What the model runs without codegen's op: transformers' own float32 fallback, torch's bfloat16 kernel."""
    if weight.dtype == torch.bfloat16:
        return torch._grouped_mm(rows, weight, offs=ends)
    from transformers.integrations.moe import _grouped_mm_fallback

    return _grouped_mm_fallback(rows, weight, ends)


def best_ms(layer) -> float:
    layer()
    best = float("inf")
    for _ in range(TRIALS):
        t0 = time.perf_counter()
        layer()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(family: str, generator) -> list[dict]:
    config, module = fused_experts(family)
    hidden, top = config.hidden_size, config.num_experts_per_tok
    rows_out = []
    for dtype in DTYPES:
        gate_up, down = shard_weights(module, dtype)
        experts, inner = gate_up.shape[0], down.shape[1]
        for batch in BATCHES:
            counts, ends = routed(experts, top, batch, generator)
            x, h = torch.randn(batch * top, hidden, dtype=dtype), torch.randn(batch * top, inner, dtype=dtype)
            hit = int((counts > 0).sum())
            read = hit * (gate_up[0].numel() + down[0].numel()) * dtype.itemsize
            times = {name: best_ms(lambda f=f: (f(x, gate_up, ends), f(h, down, ends)))
                     for name, f in (("codegen", experts_grouped_mm), ("torch", torch_grouped))}
            rows_out.append({"family": family, "layout": "input-dim first" if gate_up.stride(-1) == 1 else
                             "output-dim first", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                             "experts_hit": hit, "experts": experts, "read_bytes": read, "ms": times,
                             "gb_per_s": {k: read / v / 1e6 for k, v in times.items()}})
        del gate_up, down
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(SEED)
    cpu = machine_info("cpu")["cpu"]
    print(f"{cpu}, torch {torch.__version__}, 1 thread, TP={TP} shards; ms per MoE layer (gate/up + "
          "down), GB/s of the weights hit")
    print(f"{'family':16} {'weights':17} {'dtype':9} {'batch':>5} {'hit':>8} {'codegen ms':>10} {'GB/s':>5} "
          f"{'torch ms':>9} {'GB/s':>5} {'torch/codegen':>13}")
    rows = []
    for family in families_with("full"):  # the bench's families with published widths
        for row in measure(family, generator):
            rows.append(row)
            ms, gbs = row["ms"], row["gb_per_s"]
            print(f"{row['family']:16} {row['layout']:17} {row['dtype']:9} {row['batch']:>5} "
                  f"{row['experts_hit']:>4}/{row['experts']:<3} {ms['codegen']:>10.2f} {gbs['codegen']:>5.1f} "
                  f"{ms['torch']:>9.2f} {gbs['torch']:>5.1f} {ms['torch'] / ms['codegen']:>12.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cpu": cpu, "torch": torch.__version__, "threads": 1, "tp": TP, "rows": rows}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
