"""A patched dir's decode step in one process, eager against compiled, on any device (a GPU included).

`python -m codegen bench` compares tensor-parallel setups across ranks (--tp 2 at least); this times what one rank
runs, so it also runs where there is one GPU: per family, a random example checkpoint and its patched copy
(codegen.harness.prepare.prepare_examples) are built, the patched one loaded under its generated policy
(`init_inference(model, tp_size=1)`, a group of one), then its prefill and its decode steps (transformers' dynamic
cache, greedy tokens fed back) are timed eager and compiled (`CompiledForward`, what `compile=True` installs), then
compiled on a static cache (transformers' `StaticCache`, one per batch, reset before each prefill), whose decode
steps run as CUDA graphs on CUDA.
Prints per row the milliseconds per prefill and per decode step (median of the timed ones), the first prefill and
first decode step compiled (cold: inductor's caches under a fresh `TORCHINDUCTOR_CACHE_DIR` unless one is set), the
graphs captured, and the largest prefill logits differences: eager against the unpatched model (loaded as
transformers loads it, same device and dtype), compiled against eager.
Usage: python scripts/compiled_decode_bench.py [--device cuda] [--families F ...] [--size tiny|bench|full]
                                              [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: the batches timed, prompt tokens, decode steps warmed up and timed, prefills timed
BATCHES, PROMPT_LEN, WARMUP, STEPS, PREFILLS = (1, 16), 64, 3, 24, 3
#: the static cache's length: the prompt and every decode step
STATIC_LEN = PROMPT_LEN + 1 + WARMUP + STEPS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--families", nargs="+", default=["qwen3_moe", "gpt_oss"])
    parser.add_argument("--size", choices=("tiny", "bench", "full"), default="bench")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from codegen.harness.examples import families_with

    unknown = sorted(set(args.families) - set(families_with(args.size)))
    if unknown:
        parser.error(f"no {args.size} example of {', '.join(unknown)} (one of: {' '.join(families_with(args.size))})")
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory(prefix="codegen-compiled-decode-") as scratch:
        root = args.workdir or Path(scratch)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
        import torch

        from codegen.harness.prepare import Progress, prepare_examples
        from codegen.harness.results import machine_info

        dirs = prepare_examples(tuple(args.families), args.size, root, Progress(), dtype=dtype_name)
        record = {"script": "scripts/compiled_decode_bench.py", "device": args.device, "dtype": dtype_name,
                  "size": args.size, "torch": torch.__version__, "machine": machine_info(args.device),
                  **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}),
                  "prompt_len": PROMPT_LEN, "steps": STEPS, "rows": []}
        for family, built in dirs.items():
            record["rows"] += time_family(family, built["unpatched"], built["patched"], args.device,
                                          getattr(torch, dtype_name))
            if args.json:  # after each family: a run stopped part way keeps the families it finished
                args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def time_family(family: str, unpatched: Path, directory: Path, device: str, dtype) -> list[dict]:
    """Every batch of one family: eager, then compiled, on the same sharded model; its prefill logits against the
    unpatched model's, loaded as transformers loads it, on the same device and dtype."""
    import torch

    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from codegen.models import load, load_policy, runs_as

    reference = runs_as(load(unpatched, False, dtype)).to(device)
    policy = load_policy(directory, "codegen_compiled_decode_" + family)
    model = runs_as(policy.init_inference(load(directory, True, dtype), tp_size=1, dtype=dtype).module)
    vocab = model.config.get_text_config().vocab_size
    compiled = policy.CompiledForward(model)
    rows = []
    for batch in BATCHES:
        ids = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(next(model.parameters()).device)
        with torch.no_grad():
            expected = reference(ids).logits.float().cpu()
        eager = run_steps(model, ids, device)
        first_graphs = len(compiled.graphs)
        fast = run_steps(compiled, ids, device)
        graphs, skipped = len(compiled.graphs), counters["inductor"]["cudagraph_skips"]
        static = run_steps(compiled, ids, device, StaticCache(config=model.config, max_cache_len=STATIC_LEN))
        row = {"family": family, "batch": batch, "eager": eager, "compiled": fast, "compiled_static": static,
               "graphs_captured": graphs - first_graphs, "graphs_captured_static": len(compiled.graphs) - graphs,
               "cuda_graphs": sum(1 for g in compiled.graphs[graphs:] if g.get("cuda_graph")),
               "cuda_graph_skips": counters["inductor"]["cudagraph_skips"] - skipped,
               "fallback": compiled.fallback,
               "maxdiff_eager_vs_unpatched": (eager["logits"] - expected).abs().max().item(),
               "maxdiff_compiled_vs_eager": (fast.pop("logits") - eager["logits"]).abs().max().item(),
               "maxdiff_static_vs_eager": (static.pop("logits") - eager.pop("logits")).abs().max().item(),
               "maxdiff_static_decode_vs_compiled": (static.pop("decoded") - fast.pop("decoded")).abs().max().item()}
        eager.pop("decoded")
        row["decode_speedup"] = eager["decode_ms"] / fast["decode_ms"]
        row["decode_speedup_static"] = eager["decode_ms"] / static["decode_ms"]
        rows.append(row)
        print(f"{family:12s} b{batch:<3d} prefill {eager['prefill_ms']:8.2f} -> {fast['prefill_ms']:8.2f} ms   "
              f"decode {eager['decode_ms']:7.2f} -> {fast['decode_ms']:7.2f} ms ({row['decode_speedup']:.2f}x)   "
              f"first prefill/decode {fast['first_prefill_ms'] / 1e3:.1f}/{fast['first_decode_ms'] / 1e3:.1f} s   "
              f"graphs +{row['graphs_captured']}   max|dlogits| vs unpatched {row['maxdiff_eager_vs_unpatched']:.3g}, "
              f"compiled vs eager {row['maxdiff_compiled_vs_eager']:.3g}"
              + (f"   EAGER FALLBACK: {compiled.fallback}" if compiled.fallback else ""), flush=True)
        print(f"{'':12s} static cache: prefill {static['prefill_ms']:8.2f} ms   decode {static['decode_ms']:7.2f} ms "
              f"({row['decode_speedup_static']:.2f}x)   first prefill/decode {static['first_prefill_ms'] / 1e3:.1f}/"
              f"{static['first_decode_ms'] / 1e3:.1f} s   graphs +{row['graphs_captured_static']} "
              f"({row['cuda_graphs']} for CUDA graphs, {row['cuda_graph_skips']} skipped)   "
              f"max|dlogits| vs eager {row['maxdiff_static_vs_eager']:.3g}, "
              f"decode steps vs compiled {row['maxdiff_static_decode_vs_compiled']:.3g}", flush=True)
    return rows


def run_steps(forward, ids, device: str, static=None) -> dict:
    """Prefills, then greedy decode steps from the last one's cache: the first of each, then the median of the rest.
    `static`: a static cache every prefill starts from (reset), else a new dynamic cache each. `decoded`: the last
    decode step's logits."""
    import torch

    def timed(call):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = call()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) * 1e3

    def prefill():
        if static is None:
            return forward(ids, use_cache=True)
        static.reset()
        return forward(ids, past_key_values=static, use_cache=True)

    with torch.no_grad():
        prefills = [timed(prefill) for _ in range(PREFILLS + 1)]
        out = prefills[-1][0]
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(1 + WARMUP + STEPS):
            out, ms = timed(lambda: forward(token, past_key_values=cache, use_cache=True))
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            steps.append(ms)
    return {"first_prefill_ms": prefills[0][1], "prefill_ms": statistics.median(ms for _, ms in prefills[1:]),
            "first_decode_ms": steps[0], "decode_ms": statistics.median(steps[1 + WARMUP:]),
            "logits": prefills[-1][0].logits.float().cpu(), "decoded": out.logits.float().cpu()}


if __name__ == "__main__":
    sys.exit(main())
