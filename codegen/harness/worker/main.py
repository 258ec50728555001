"""The one rank worker of verify, bench and demo: `python -m codegen _worker --spec S --out D`, started by
codegen.harness.launcher on every rank (never imported by users).

A launch reads one spec (JSON) naming several jobs; each job is a model dir, its unpatched reference
dir and the phases to measure, in order, against one single-process reference per job (the
unpatched dir, fp32, unsharded, computed once per job; codegen.harness.worker.reference):

  no-policy  the patched dir with torch.distributed up but no TP policy: must equal the reference
             exactly and reduce nothing (list it before any policy phase)
  codegen    the patched dir under its generated autotp_policy.py
  compiled   the same with its forward compiled (`verify --compile`; after codegen, whose policy it uses)
  stock      stock `deepspeed.init_inference` (AutoTP) on the reference dir
  ab         the bench's phase (codegen.harness.worker.ab): the job's setups side by side, interleaved

no-policy / codegen / compiled / stock measure one forward (codegen.harness.worker.forward). Stock AutoTP may
crash on a family (it does not know every attention's extra parameters): stock is a comparison, so a stock phase
that raises while loading or on its first forward is recorded as {"mode": "stock", "crashed": "<ExceptionType>:
<first line>"} and the launch goes on (codegen.harness.worker.run.guarded). The no-policy, codegen and compiled
phases are never guarded: their errors fail the launch.

Rank 0 prints progress lines (codegen.harness.worker.protocol). Writes rank<k>.json: {"rank", "world_size",
"timings", "jobs": {name: {phase: figures}}}; on failure rank<k>.error (one line) and exit 1.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

_T_TORCH = time.perf_counter()

from codegen.harness.opcache import preload_shm_op, save_shm_op  # noqa: E402
from codegen.harness.worker.ab import measure_ab  # noqa: E402
from codegen.harness.worker.counting import CollectiveCounter  # noqa: E402
from codegen.harness.worker.forward import built_and_dry_run, measure, measure_built, measure_compiled  # noqa: E402
from codegen.harness.worker.limits import measure_limits  # noqa: E402
from codegen.models import model_sizes  # noqa: E402
from codegen.harness.worker.protocol import DEFAULTS, PHASES  # noqa: E402
from codegen.harness.worker.reference import Reference, release_heap  # noqa: E402
from codegen.harness.worker.run import Run, guarded  # noqa: E402


def run_job(run: Run, job: dict, defaults: dict, timings: dict) -> dict:
    opts = {**DEFAULTS, **defaults, **job.get("options", {})}
    name = job["name"]
    vocab = model_sizes(job["reference"])["vocab_size"]
    ids = torch.randint(0, vocab, (opts["batch"], opts["prompt_len"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(run.device)
    phases = job["phases"]
    one_forward = bool(set(phases) - {"ab"})
    decode = opts["warmup"] + opts["decode_steps"] if "ab" in phases else 0
    if one_forward:
        decode = max(decode, opts["decode_check"])
    run.say(f"{name}: single-process reference (prefill {opts['batch']}x{opts['prompt_len']} tokens"
            + (f" + {decode} greedy decode steps)" if decode else ")"))
    t = time.perf_counter()
    ref = Reference(run, job["reference"], ids, opts["generate"] if one_forward else 0, decode, image=one_forward)
    timings[f"{name}/reference_s"] = time.perf_counter() - t
    out = {}
    for phase in phases:
        t = time.perf_counter()
        if phase == "ab":
            out[phase] = measure_ab(run, job, opts, ids, ref)
        else:
            run.say(f"{name}: {phase}")
            if phase == "stock":  # a comparison: a crash is recorded, the launch goes on
                # first on each rank alone (a rank's shard may fail where another's does not: the others would
                # wait for it in a collective forever), then measured
                model, crashed = guarded(run, f"{name}: stock", lambda: built_and_dry_run(phase, job, run, opts, ids,
                                                                                          ref, timings))
                figures = None
                if crashed is None:
                    figures, crashed = guarded(run, f"{name}: stock", lambda: measure(phase, model, run, opts, ids, ref))
                del model
                out[phase] = figures if crashed is None else {
                    "mode": phase, "rank": run.rank, "world_size": run.dist.get_world_size(), "crashed": crashed}
            elif phase == "compiled":  # after codegen, whose policy module it compiles with
                out[phase] = measure_compiled(job, run, opts, ids, ref, timings)
            else:
                out[phase] = measure_built(phase, job, run, opts, ids, ref, timings)
        release_heap()
        timings[f"{name}/{phase}_s"] = time.perf_counter() - t
    return out


def remove_own_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed shm buffer: os._exit skips the policy's atexit removal, and the stock
    and native phases load no policy at all; every rank has passed the last collective."""
    from codegen.policy.runtime.base import PolicyError
    from codegen.policy.runtime.shm import own_shm_buffer

    try:
        path = own_shm_buffer(rank)
        if path:
            os.unlink(path)
    except (OSError, PolicyError):
        pass


def main(spec_path: Path, out: Path) -> int:
    """Run the spec's jobs on this rank; on failure, one line in rank<k>.error and the exception re-raised."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        _main(json.loads(spec_path.read_text()), out)
    except BaseException as exc:  # one line for the launcher, then fail the rank
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        Path(out, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {message}\n")
        raise
    return 0


def _main(spec: dict, out: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist

    bad = [p for job in spec["jobs"] for p in job["phases"] if p not in PHASES]
    if bad:
        raise ValueError(f"unknown phase(s) {bad}: expected {PHASES}")
    timings = {"import_torch_s": _T_TORCH - _T0}
    device_kind = spec.get("device", "cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    t = time.perf_counter()
    preloaded = device_kind == "cpu" and preload_shm_op()
    deepspeed.init_distributed(dist_backend="gloo" if device_kind == "cpu" else "nccl")
    timings["import_deepspeed_init_s"] = time.perf_counter() - t
    if device_kind == "cpu" and not preloaded and dist.get_rank() == 0:
        save_shm_op()
    run = Run(spec, dist, CollectiveCounter())
    record = {"rank": run.rank, "world_size": dist.get_world_size(), "timings": timings, "jobs": {}}
    if device_kind == "cuda":
        record["gpu"] = torch.cuda.get_device_name(run.device)
    # before any load, all ranks at once; a launch with no jobs measures the limits only (beside a peer engine's run)
    if spec.get("limits") and (not spec["jobs"] or any("ab" in job["phases"] for job in spec["jobs"])):
        run.say(f"machine limits: memory bandwidth and {run.dtype_name} GEMM throughput, every rank at once")
        record["limits"] = run.limits = measure_limits(run)
        gc.collect()
    for job in spec["jobs"]:
        record["jobs"][job["name"]] = run_job(run, job, spec.get("options", {}), timings)
        run.say(f"{job['name']}: done ({time.perf_counter() - _T0:.0f}s on the ranks so far)")
    timings["total_s"] = time.perf_counter() - _T0
    out.mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{run.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    remove_own_shm_buffer(run.rank)
    # Python's teardown of torch / DeepSpeed takes seconds and does nothing for a finished rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
