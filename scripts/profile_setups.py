"""Where a bench row's milliseconds go: torch.profiler around one forward of each setup, on real ranks.

Used for docs/benchmark.md ("Where codegen is not the fastest"). Run on 2 CPU ranks with the bench's dirs
(`python -m codegen bench --workdir W` keeps them):

    LOCAL_SIZE=2 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/profile_setups.py \
        W/<run>/<family>/patched W/<run>/<family>/unpatched --dtype bfloat16 --batch 1 --tokens 128 [--decode]

Rank 0 prints, per setup, the forward's wall time and the top operators by self CPU time, grouped into
matmuls, collectives, the MoE routing/indexing ops and the rest.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("patched")
    ap.add_argument("unpatched")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode", action="store_true", help="profile one decode step after the prefill")
    ap.add_argument("--setups", default="stock,codegen,native")
    args = ap.parse_args()

    import deepspeed

    from codegen.runtime import preload_shm_op
    from codegen.tp_worker import AllReduceCounter, Run, cache_of

    preload_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    counter = AllReduceCounter()
    counter.install()
    import deepspeed.comm as dist

    run = Run({"tp": dist.get_world_size(), "dtype": args.dtype}, dist, counter)
    job = {"name": "profile", "model": args.patched, "reference": args.unpatched}
    opts = {"tp_grain_size": 0}
    ids = torch.randint(0, 4096, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    for mode in args.setups.split(","):
        model = run.build(mode, job, opts)
        with torch.no_grad():
            for _ in range(3):
                out = model(ids, use_cache=args.decode)
            step = (lambda: model(out.logits[:, -1:].argmax(-1), past_key_values=cache_of(out), use_cache=True)) \
                if args.decode else (lambda: model(ids))
            dist.barrier()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                step()
                wall = time.perf_counter() - t0
        if dist.get_rank() == 0:
            groups: dict[str, float] = {}
            for e in prof.key_averages():
                name = e.key
                kind = ("matmul" if any(k in name for k in ("mm", "matmul", "linear", "addmm", "bmm"))
                        else "collective" if any(k in name for k in ("all_reduce", "allreduce", "gather", "c10d"))
                        else "moe routing/indexing" if any(k in name for k in ("index", "topk", "one_hot", "where",
                                                                                 "nonzero", "scatter", "sort"))
                        else "other")
                groups[kind] = groups.get(kind, 0.0) + e.self_cpu_time_total / 1e3
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
            print(f"== {mode}: forward {wall * 1e3:.1f} ms; self CPU ms by kind: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))
            for e in top:
                print(f"   {e.key:45s} {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count}")
        del model
        dist.barrier()


if __name__ == "__main__":
    main()
