"""One MLA decode step, expanded (transformers' own) and absorbed (the policy's), at DeepSeek-V2-Lite's widths.

The bench's full-width DeepSeek-V2-Lite-like model (2 layers, random weights, float32), in one process on the
threads torch picks, eager: a prefill of CONTEXT tokens per sequence, then decode steps on its cache, timed with the
cache expanded through `kv_b_proj` at every step and with the policy's absorbed attention
(codegen.policy.runtime.latent_attention) on the same model and cache. The gap grows with the context, since the
expansion re-reads the whole cache. Prints, per batch and context, the median ms of a step and the largest logit
difference between the two. Usage: .venv/bin/python scripts/mla_decode_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from codegen.families import FAMILIES
from codegen.harness.examples import shape
from codegen.harness.results import machine_info
from codegen.policy.runtime.latent_attention import absorb_latent_attention, latent_attention_modules

#: the batches the bench decodes, the contexts a step attends over, steps timed per figure (the median kept)
FAMILY, BATCHES, CONTEXTS, STEPS, SEED = "deepseek_v2", (1, 16), (64, 512), 7, 0


def decode_ms(model, batch: int, context: int) -> tuple[float, torch.Tensor]:
    """Median ms of a decode step on a cache holding `context` tokens per sequence, and the first step's logits."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator)
    cache = DynamicCache(config=model.config)
    times, first = [], None
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        step = ids[:, -1:]
        for _ in range(STEPS + 1):
            start = time.perf_counter()
            logits = model(input_ids=step, cache=cache).logits
            times.append(time.perf_counter() - start)
            first = logits if first is None else first
    return 1000 * statistics.median(times[1:]), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the figures as JSON")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(FAMILY, **shape(FAMILY, "full"))).eval()
    layout = FAMILIES[FAMILY].policy_layout()
    rows = [{"batch": batch, "context": context} for batch in BATCHES for context in CONTEXTS]
    for row in rows:
        row["expanded_ms"], row["_logits"] = decode_ms(model, row["batch"], row["context"])
    note = absorb_latent_attention(latent_attention_modules(model, layout), layout)
    if not note or "not absorbed" in note:
        raise SystemExit(f"nothing absorbed under this transformers: {note}")
    for row in rows:
        row["absorbed_ms"], logits = decode_ms(model, row["batch"], row["context"])
        row["max_logit_diff"] = (logits - row.pop("_logits")).abs().max().item()
        print(f"batch {row['batch']:2d}, context {row['context']:4d}: expanded {row['expanded_ms']:7.2f} ms, "
              f"absorbed {row['absorbed_ms']:7.2f} ms ({row['expanded_ms'] / row['absorbed_ms']:.2f}x), "
              f"max|dlogit| {row['max_logit_diff']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info("cpu"), "threads": torch.get_num_threads(), "family": FAMILY,
                       "widths": "full (published, 2 layers)", "dtype": "float32", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
