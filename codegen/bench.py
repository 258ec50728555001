"""`python -m codegen bench`: stock AutoTP (a) vs the patched dir (b) vs one process (c), same ranks, same inputs.

One torchrun launch holds, on every rank, both tensor-parallel models of a family side by side:
(a) the unpatched dir under stock `deepspeed.init_inference(tensor_parallel=...)` and (b) the patched
dir under its generated `autotp_policy.init_inference`. Every timed unit (a prefill, a decode step)
is run for a and b back to back, in ABBA order (a,b then b,a, ...), each after a barrier, so both
see the same load on this shared machine, the same processes, threads, input tensors and cache
lengths. (c), the unsharded unpatched model run by each rank alone (no collectives), is the
numerical reference; its greedy tokens are also the decode inputs fed to a and b (teacher forcing),
so a and b decode exactly the same sequence.

Also timed: `python -m codegen patch DIR`, a cold process per model dir.

`python -m codegen.bench merge A.json B.json --markdown T.md --chart C.png` combines runs from
several environments (one per transformers version) into one table and chart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from codegen import __version__, errors
from codegen.errors import BadInput, CodegenError, IOFailure, VerifyFailed

FAMILIES = ("qwen2_moe", "deepseek_v2")
METHOD = {
    "schedule": "one torchrun launch; on every rank (a) and (b) are loaded side by side and each timed unit "
                "(prefill, decode step) runs a then b or b then a (ABBA), each after a barrier",
    "inputs": "same random prompt for a, b, c; decode tokens forced to (c)'s greedy tokens so a and b decode the "
              "same sequence",
    "latency": "per timed unit the slowest rank (time.perf_counter around the forward), warm-up excluded",
    "allreduce_counts": "collective calls counted once at the outermost entry point (deepspeed.comm all_reduce / "
                        "inference_all_reduce, torch.distributed.all_reduce); per MoE layer by forward hooks",
    "param_bytes_per_rank": "parameter bytes held by the largest rank after init (experts = routed expert weights); "
                            "while loading, every rank holds the full checkpoint (load_peak_bytes) in a and b alike",
    "reference": "(c): the unpatched model, unsharded, float32, run by each rank alone (no collectives)",
}
TOLERANCE = 1e-5  # max |logits - reference| for the patched dir (fp32 on CPU)
PROGRESS = "@@codegen-progress "

#: run sizes: `smoke` is the CI run (counts asserted, timings recorded but meaningless), `full` the recorded one
SETTINGS: dict[str, dict] = {
    "smoke": dict(size="tiny", prompt_len=128, batch=1, decode_steps=4, warmup=1, prefill_repeats=2,
                  patch_trials=1, timeout=600.0),
    "full": dict(size="bench", prompt_len=128, batch=1, decode_steps=128, warmup=8, prefill_repeats=16,
                 patch_trials=3, timeout=1500.0),
    # the demo: tiny dirs, counts and logits only
    "demo": dict(size="tiny", prompt_len=32, batch=1, decode_steps=2, warmup=1, prefill_repeats=1,
                 patch_trials=0, timeout=600.0),
}


# ------------------------------------------------------------------------------------------------ progress


class Progress:
    """`[  12.3s] message` lines on stderr: the steps that take seconds say so, no extra dependency."""

    def __init__(self, quiet: bool = False) -> None:
        self.t0 = time.monotonic()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- launching ranks


def launch(spec: dict, world: int, timeout: float, progress: Progress, device: str = "cpu") -> list[dict]:
    """Run this module's worker on `world` local ranks (torchrun); return each rank's result (rank order).

    Rank 0's progress lines are shown as they come; any failure is one line (VerifyFailed).
    """
    from codegen.runtime import _last_error_line, extensions_dir, free_port, remove_shm_buffers

    with tempfile.TemporaryDirectory(prefix="codegen-bench-ranks-") as out:
        spec_path = Path(out, "spec.json")
        spec_path.write_text(json.dumps(spec))
        port = free_port()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            "-m", "codegen.bench", "worker", "--spec", str(spec_path), "--out", out,
        ]
        threads = max(1, (os.cpu_count() or 2) // world)
        env = {**os.environ, "LOCAL_SIZE": str(world), "OMP_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1",
               "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        if device == "cpu":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
        if device == "cpu" and not shm_op_built(env["TORCH_EXTENSIONS_DIR"]):
            progress("first run in this environment: DeepSpeed JIT-compiles its CPU shared-memory all-reduce "
                     f"into {env['TORCH_EXTENSIONS_DIR']} (once; 1-3 minutes on 2 cores)")
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        except OSError as exc:
            raise IOFailure(f"cannot start torchrun: {exc.strerror}") from None
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                at = line.find(PROGRESS)  # ranks share the pipe: another rank's partial line may precede it
                if at >= 0:
                    progress(line[at + len(PROGRESS):].rstrip())
                    line = line[:at]
                if line.strip():
                    lines.append(line)
                    del lines[:-400]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise VerifyFailed(f"benchmark ranks timed out after {timeout:.0f}s") from None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        finally:
            remove_shm_buffers(port)
        reader.join(timeout=5)
        results = []
        for rank in range(world):
            err = Path(out, f"rank{rank}.error")
            if err.exists():
                raise VerifyFailed(f"benchmark rank {rank} failed: {err.read_text().strip().splitlines()[0][:300]}")
        for rank in range(world):
            path = Path(out, f"rank{rank}.json")
            if not path.exists():
                tail = _last_error_line("".join(lines))
                raise VerifyFailed(f"benchmark ranks failed (exit {proc.returncode}): {tail}")
            results.append(json.loads(path.read_text()))
        return results


def shm_op_built(directory: str | None = None) -> bool:
    from codegen.runtime import extensions_dir

    return bool(list(Path(directory or extensions_dir()).glob("deepspeed_shm_comm/*.so")))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------ the rank worker


def _worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m codegen.bench worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        _worker_main(json.loads(Path(args.spec).read_text()), Path(args.out))
    except BaseException as exc:  # one line for the parent, then fail the rank
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        Path(args.out, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {message}\n")
        raise


def _worker_main(spec: dict, out: Path) -> None:
    import importlib.util

    import torch

    import deepspeed
    import deepspeed.comm as dist
    from codegen.families import FAMILIES as KNOWN
    from codegen.tp_worker import AllReduceCounter, cache_of, has_remote_code, load, param_bytes

    device_kind = spec["device"]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="gloo" if device_kind == "cpu" else "nccl")
    rank = dist.get_rank()
    tp = spec["tp"]
    dtype = getattr(torch, spec["dtype"])
    t_start = time.monotonic()

    def say(message: str) -> None:
        if rank == 0:
            print(f"{PROGRESS}{message}", flush=True)

    def sync() -> None:
        if device_kind == "cuda":
            torch.cuda.synchronize()

    counter = AllReduceCounter()
    counter.install()
    results: dict = {"rank": rank, "world_size": dist.get_world_size(), "families": {}}
    if device_kind == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)

    steps, warmup, repeats = spec["decode_steps"], spec["warmup"], spec["prefill_repeats"]
    for item in spec["models"]:
        family = item["family"]
        moe_names = KNOWN[family].moe_classes
        config = json.loads(Path(item["unpatched"], "config.json").read_text())
        ids = torch.randint(0, config["vocab_size"], (spec["batch"], spec["prompt_len"]),
                            generator=torch.Generator().manual_seed(1)).to(device)

        # (c) the reference: the unsharded unpatched model, fp32, this rank alone
        say(f"{family}: (c) single-process reference: prefill {spec['prompt_len']} tokens + "
            f"{warmup + steps} greedy decode steps")
        ref = load(item["unpatched"], has_remote_code(item["unpatched"]), torch.float32).to(device)
        ref_steps_logits, forced, ref_prefill_s, ref_decode_s = [], [], [], []
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            out_ref = ref(ids, use_cache=True)
            sync()
            ref_prefill_s.append(time.perf_counter() - t0)
            ref_logits = out_ref.logits.float().cpu()
            cache = cache_of(out_ref)
            token = out_ref.logits[:, -1:].argmax(-1)
            for _ in range(warmup + steps):
                forced.append(token)
                sync()
                t0 = time.perf_counter()
                o = ref(token, past_key_values=cache, use_cache=True)
                sync()
                ref_decode_s.append(time.perf_counter() - t0)
                ref_steps_logits.append(o.logits.float().cpu())
                cache = cache_of(o)
                token = o.logits[:, -1:].argmax(-1)
        full = param_bytes(ref)
        del ref, out_ref, cache, o

        # (a) stock AutoTP on the unpatched dir, (b) the patched dir with its generated policy
        say(f"{family}: loading (a) stock deepspeed.init_inference and (b) codegen policy on {tp} ranks")
        stock = load(item["unpatched"], has_remote_code(item["unpatched"]), dtype)
        stock = deepspeed.init_inference(stock, tensor_parallel={"tp_size": tp}, dtype=dtype,
                                         replace_with_kernel_inject=False).module
        ours = load(item["patched"], True, dtype)
        spec_mod = importlib.util.spec_from_file_location(f"codegen_bench_policy_{family}",
                                                          os.path.join(item["patched"], "autotp_policy.py"))
        policy = importlib.util.module_from_spec(spec_mod)
        spec_mod.loader.exec_module(policy)
        ours = policy.init_inference(ours, tp_size=tp, dtype=dtype).module
        models = {"stock": stock, "codegen": ours}

        # per-MoE-block all-reduce counters (hooks at block entry/exit)
        blocks, block_counts = {}, {}
        for mode, model in models.items():
            blocks[mode] = [m for m in model.modules() if type(m).__name__ in moe_names]
            block_counts[mode] = [0] * len(blocks[mode])
            for i, block in enumerate(blocks[mode]):
                mark = {}

                def pre(_m, _a, mark=mark):
                    mark["n"] = counter.calls

                def post(_m, _a, _o, mode=mode, i=i, mark=mark):
                    block_counts[mode][i] += counter.calls - mark["n"]

                block.register_forward_pre_hook(pre)
                block.register_forward_hook(post)

        record = {m: {"bytes": param_bytes(model), "moe_blocks": len(blocks[m])} for m, model in models.items()}
        order = lambda k: ("stock", "codegen") if k % 2 == 0 else ("codegen", "stock")  # noqa: E731  ABBA

        def run(mode, *a, **kw):
            dist.barrier()
            before = counter.calls
            blocks_before = list(block_counts[mode])
            sync()
            t0 = time.perf_counter()
            output = models[mode](*a, **kw)
            sync()
            elapsed = time.perf_counter() - t0
            per_block = [x - y for x, y in zip(block_counts[mode], blocks_before)]
            return output, elapsed, counter.calls - before, per_block

        say(f"{family}: prefill {spec['prompt_len']} tokens x {warmup} warm-up + {repeats} timed, a/b alternating")
        with torch.no_grad():
            for k in range(warmup):
                for mode in order(k):
                    run(mode, ids)
            for mode in models:
                output, _, calls, per_block = run(mode, ids)
                record[mode].update(
                    prefill_allreduce=calls,
                    prefill_allreduce_per_moe_block=per_block,
                    prefill_maxdiff=(output.logits.float().cpu() - ref_logits).abs().max().item(),
                    prefill_s=[],
                )
            for k in range(repeats):
                for mode in order(k):
                    _, elapsed, _, _ = run(mode, ids)
                    record[mode]["prefill_s"].append(elapsed)

            say(f"{family}: decode {warmup} warm-up + {steps} timed steps, a/b alternating every step")
            caches = {}
            for mode in models:
                output, _, _, _ = run(mode, ids, use_cache=True)
                caches[mode] = cache_of(output)
                record[mode].update(decode_s=[], decode_allreduce=[], decode_allreduce_per_moe_block=[],
                                    decode_maxdiff=0.0)
            for k in range(warmup + steps):
                for mode in order(k):
                    output, elapsed, calls, per_block = run(mode, forced[k], past_key_values=caches[mode],
                                                            use_cache=True)
                    caches[mode] = cache_of(output)
                    r = record[mode]
                    diff = (output.logits.float().cpu() - ref_steps_logits[k]).abs().max().item()
                    r["decode_maxdiff"] = max(r["decode_maxdiff"], diff)
                    if k >= warmup:
                        r["decode_s"].append(elapsed)
                        r["decode_allreduce"].append(calls)
                        r["decode_allreduce_per_moe_block"].append(per_block)
        results["families"][family] = {
            "num_layers": config["num_hidden_layers"],
            "full_bytes": full,
            "reference": {"prefill_s": ref_prefill_s, "decode_s": ref_decode_s[warmup:]},
            **record,
        }
        models.clear()
        del stock, ours, caches, output
        say(f"{family}: done ({time.monotonic() - t_start:.0f}s on the ranks so far)")
    out.mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()


# ---------------------------------------------------------------------------------------------- summarising


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _spread(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median": statistics.median(values) if values else float("nan"),
        "p25": _quantile(values, 0.25),
        "p75": _quantile(values, 0.75),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def _slowest(ranks: list[list[float]]) -> list[float]:
    """Per timed unit, the slowest rank: a TP step is done when every rank is."""
    return [max(column) for column in zip(*ranks)]


def summarise(ranks: list[dict], configs: dict[str, dict]) -> dict:
    families = {}
    for family, first in ranks[0]["families"].items():
        per_rank = [r["families"][family] for r in ranks]
        moe_layers = first["codegen"]["moe_blocks"]
        entry = {
            "shape": configs[family],
            "num_layers": first["num_layers"],
            "moe_layers": moe_layers,
            "load_peak_bytes": first["full_bytes"],
            "reference": {
                "prefill": _spread(_slowest([r["reference"]["prefill_s"] for r in per_rank])),
                "decode": _spread(_slowest([r["reference"]["decode_s"] for r in per_rank])),
            },
        }
        for mode in ("stock", "codegen"):
            rs = [r[mode] for r in per_rank]
            m = rs[0]
            counts_agree = all(
                r["prefill_allreduce"] == m["prefill_allreduce"] and r["decode_allreduce"] == m["decode_allreduce"]
                for r in rs
            )
            decode_blocks = [c for step in m["decode_allreduce_per_moe_block"] for c in step]
            entry[mode] = {
                "allreduce_prefill": m["prefill_allreduce"],
                "allreduce_prefill_per_moe_layer": m["prefill_allreduce_per_moe_block"],
                "allreduce_prefill_per_moe_layer_mean": _mean(m["prefill_allreduce_per_moe_block"]),
                "allreduce_decode_step": _spread([float(c) for c in m["decode_allreduce"]]),
                "allreduce_decode_per_moe_layer_mean": _mean(decode_blocks),
                "allreduce_decode_per_moe_layer_max": max(decode_blocks, default=0),
                "counts_same_on_all_ranks": counts_agree,
                "prefill": _spread(_slowest([r["prefill_s"] for r in rs])),
                "decode": _spread(_slowest([r["decode_s"] for r in rs])),
                "param_bytes_per_rank": {
                    "experts": max(r["bytes"]["experts"] for r in rs),
                    "rest": max(r["bytes"]["rest"] for r in rs),
                    "total": max(r["bytes"]["total"] for r in rs),
                },
                "maxdiff_prefill": max(r["prefill_maxdiff"] for r in rs),
                "maxdiff_decode": max(r["decode_maxdiff"] for r in rs),
            }
        a, b = entry["stock"], entry["codegen"]
        entry["ratio_b_over_a"] = {
            "allreduce_prefill": _ratio(b["allreduce_prefill"], a["allreduce_prefill"]),
            "allreduce_decode_step": _ratio(b["allreduce_decode_step"]["median"], a["allreduce_decode_step"]["median"]),
            "decode_median": _ratio(b["decode"]["median"], a["decode"]["median"]),
            "prefill_median": _ratio(b["prefill"]["median"], a["prefill"]["median"]),
            "expert_bytes": _ratio(b["param_bytes_per_rank"]["experts"], a["param_bytes_per_rank"]["experts"]),
            "rest_bytes": _ratio(b["param_bytes_per_rank"]["rest"], a["param_bytes_per_rank"]["rest"]),
        }
        families[family] = entry
    return families


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _ratio(b: float, a: float) -> float | None:
    return b / a if a else None


def problems(record: dict) -> list[str]:
    """What makes a bench run fail: the patched dir must reduce once per MoE layer and match the reference."""
    found = []
    tolerance = record.get("tolerance", TOLERANCE)
    for family, e in record["families"].items():
        b = e["codegen"]
        if b["allreduce_prefill_per_moe_layer"] and any(c != 1 for c in b["allreduce_prefill_per_moe_layer"]):
            found.append(f"{family}: codegen all-reduces per MoE layer in prefill {b['allreduce_prefill_per_moe_layer']}")
        if b["allreduce_decode_per_moe_layer_max"] != 1 or b["allreduce_decode_per_moe_layer_mean"] != 1:
            found.append(f"{family}: codegen all-reduces per MoE layer in decode != 1")
        if not e["moe_layers"]:
            found.append(f"{family}: no MoE layers found")
        for mode in ("stock", "codegen"):
            if not e[mode]["counts_same_on_all_ranks"]:
                found.append(f"{family}: {mode} all-reduce counts differ between ranks")
        worst = max(b["maxdiff_prefill"], b["maxdiff_decode"])
        if tolerance is not None and worst > tolerance:
            found.append(f"{family}: codegen logits differ from the single-process model by {worst:.2e} > {tolerance:g}")
    return found


# --------------------------------------------------------------------------------------------- environment


def machine_info(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": ver("torch"),
        "deepspeed": ver("deepspeed"),
        "transformers": ver("transformers"),
        "device": device,
    }


def _check_device(device: str, tp: int) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
    if torch.cuda.device_count() < tp:
        raise BadInput(f"--device cuda: --tp {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")


# --------------------------------------------------------------------------------------------------- driver


def build_examples(families: tuple[str, ...], size: str, root: Path, progress: Progress) -> dict[str, Path]:
    """Random hub-format checkpoints (codegen.examples), built in a child process: root/<family>/unpatched."""
    from codegen.runtime import _last_error_line

    progress(f"building {size} example checkpoints ({', '.join(families)}) with transformers (random weights)")
    t0 = time.monotonic()
    build = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from codegen.examples import build_example\n"
         "for fam in sys.argv[3:]: build_example(fam, Path(sys.argv[1]) / fam / 'unpatched', size=sys.argv[2])",
         str(root), size, *families],
        capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    if build.returncode != 0:
        raise VerifyFailed(f"building the example checkpoints failed: {_last_error_line(build.stderr + build.stdout)}")
    progress(f"built {len(families)} checkpoints in {time.monotonic() - t0:.1f}s")
    return {family: root / family / "unpatched" for family in families}


def prepare(families: tuple[str, ...], size: str, root: Path, progress: Progress, patch_trials: int) -> tuple[dict, dict]:
    """Build each family's random checkpoint, patch a copy in a cold process (timed); return dirs and timings."""
    from codegen.modeldir import copy_with_linked_weights

    built = build_examples(families, size, root, progress)
    dirs, timing = {}, {}
    for family in families:
        unpatched = built[family]
        patched = root / family / "patched"
        copy_with_linked_weights(unpatched, patched)
        trials = []
        progress(f"{family}: `python -m codegen patch` (cold process) x {max(patch_trials, 1)}")
        for trial in range(max(patch_trials, 1)):
            if trial:
                _codegen("revert", "-q", patched)
            t0 = time.perf_counter()
            _codegen("patch", "-q", patched)
            trials.append(time.perf_counter() - t0)
        dirs[family] = {"family": family, "unpatched": str(unpatched), "patched": str(patched)}
        timing[family] = {"trials_s": trials, "median_s": statistics.median(trials)}
    return dirs, timing


def make_workdir(parent: Path, prefix: str) -> Path:
    """A fresh dir under --workdir (kept afterwards); one line if it cannot be made."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise IOFailure(f"--workdir {parent}: {exc.strerror or exc}") from None


def check_runtime_installed(what: str) -> None:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "deepspeed") if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInput(f"{what} needs {', '.join(missing)}: install torch, then pip install 'codegen[runtime]'")


def _codegen(*args) -> None:
    result = subprocess.run([sys.executable, "-m", "codegen", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise VerifyFailed(f"`codegen {' '.join(map(str, args))}` failed (exit {result.returncode}): {line}")


def _startup_baseline(trials: int) -> float:
    times = []
    for _ in range(max(trials, 1)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "codegen", "--version"], capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_bench(kind: str, device: str, tp: int, workdir: Path | None, progress: Progress,
              families: tuple[str, ...] = FAMILIES) -> dict:
    settings = dict(SETTINGS[kind])
    dtype = "bfloat16" if device == "cuda" else "float32"
    started = time.monotonic()
    if workdir is not None:
        root = make_workdir(workdir, f"codegen-{kind}-")
        cleanup = None
    else:
        cleanup = tempfile.TemporaryDirectory(prefix=f"codegen-{kind}-")
        root = Path(cleanup.name)
    try:
        dirs, patch_timing = prepare(families, settings["size"], root, progress, settings["patch_trials"])
        baseline = _startup_baseline(settings["patch_trials"]) if settings["patch_trials"] else None
        spec = {
            "models": [dirs[f] for f in families],
            "tp": tp,
            "device": device,
            "dtype": dtype,
            **{k: settings[k] for k in ("prompt_len", "batch", "decode_steps", "warmup", "prefill_repeats")},
        }
        progress(f"starting {tp} {device.upper()} ranks (torchrun); every timed step runs a and b back to back")
        compiled = device == "cpu" and not shm_op_built(os.environ.get("TORCH_EXTENSIONS_DIR"))
        load_start = _loadavg()
        ranks = launch(spec, tp, settings["timeout"], progress, device)
        load_end = _loadavg()
        configs = {f: json.loads(Path(dirs[f]["unpatched"], "config.json").read_text()) for f in families}
        shapes = {f: _shape(configs[f]) for f in families}
        record = {
            "tool": f"codegen {__version__} bench",
            "kind": kind,
            "device": device,
            "tp": tp,
            "dtype": dtype,
            "tolerance": TOLERANCE if dtype == "float32" else None,
            "method": METHOD,
            "machine": machine_info(device) | ({"gpu": ranks[0]["gpu"]} if "gpu" in ranks[0] else {})
            | {"loadavg_1min_before_ranks": load_start, "loadavg_1min_after_ranks": load_end},
            "deepspeed_cpu_op_compiled_during_run": compiled,
            "settings": {k: v for k, v in settings.items() if k != "timeout"},
            "patch_timing": {"startup_baseline_s": baseline, "families": {f: patch_timing[f]["trials_s"] for f in families},
                             "median_s": {f: patch_timing[f]["median_s"] for f in families}},
            "families": summarise(ranks, shapes),
            "wall_s": time.monotonic() - started,
        }
        if workdir is not None:
            record["workdir"] = str(root)
        return record
    finally:
        if cleanup is not None:
            cleanup.cleanup()


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _shape(config: dict) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size", "num_experts",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size",
            "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "vocab_size", "intermediate_size")
    return {k: config[k] for k in keys if k in config}


# ------------------------------------------------------------------------------------------------- outputs


FAMILY_LABEL = {"qwen2_moe": "Qwen1.5-MoE-A2.7B-like", "deepseek_v2": "DeepSeek-V2-Lite-like"}


def _records(record_or_merged: dict) -> list[dict]:
    return record_or_merged.get("runs", [record_or_merged])


def _rows(records: list[dict]):
    for rec in records:
        for family, e in rec["families"].items():
            yield rec, family, e


def _fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}×"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.1f} [{s['p25'] * 1e3:.1f}–{s['p75'] * 1e3:.1f}]"


def _count(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.2f}"


def markdown(record_or_merged: dict) -> str:
    records = _records(record_or_merged)
    first = records[0]
    s = first["settings"]
    lines = [
        f"TP={first['tp']} on {first['device'].upper()} ({first['dtype']}); each cell is **(a) stock AutoTP → "
        f"(b) codegen (b/a)**; {s['prompt_len']}-token prefill, batch {s['batch']}; decode: {s['decode_steps']} timed "
        f"steps after {s['warmup']} warm-up; latency = slowest rank, median [p25–p75] in ms.",
        "",
        "| model | transformers | all-reduces / prefill | per MoE layer (prefill) | all-reduces / decode step "
        "| per MoE layer (decode) | decode step ms | prefill ms | expert MiB / rank | other MiB / rank "
        "| max abs Δlogits vs (c): a, b |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec, family, e in _rows(records):
        a, b, r = e["stock"], e["codegen"], e["ratio_b_over_a"]
        ab, bb = a["param_bytes_per_rank"], b["param_bytes_per_rank"]
        lines.append(
            f"| {family} ({FAMILY_LABEL.get(family, family)}) | {rec['machine']['transformers']} "
            f"| {a['allreduce_prefill']} → {b['allreduce_prefill']} ({_fmt_ratio(r['allreduce_prefill'])}) "
            f"| {_count(a['allreduce_prefill_per_moe_layer_mean'])} → {_count(b['allreduce_prefill_per_moe_layer_mean'])} "
            f"| {_count(a['allreduce_decode_step']['median'])} → {_count(b['allreduce_decode_step']['median'])} "
            f"({_fmt_ratio(r['allreduce_decode_step'])}) "
            f"| {_count(a['allreduce_decode_per_moe_layer_mean'])} → {_count(b['allreduce_decode_per_moe_layer_mean'])} "
            f"| {_ms(a['decode'])} → {_ms(b['decode'])} ({_fmt_ratio(r['decode_median'])}) "
            f"| {_ms(a['prefill'])} → {_ms(b['prefill'])} ({_fmt_ratio(r['prefill_median'])}) "
            f"| {_mb(ab['experts'])} → {_mb(bb['experts'])} ({_fmt_ratio(r['expert_bytes'])}) "
            f"| {_mb(ab['rest'])} → {_mb(bb['rest'])} ({_fmt_ratio(r['rest_bytes'])}) "
            f"| {max(a['maxdiff_prefill'], a['maxdiff_decode']):.1e}, {max(b['maxdiff_prefill'], b['maxdiff_decode']):.1e} |"
        )
    lines += [
        "",
        "`python -m codegen patch DIR`: wall time of a cold process, median of n trials; start-up = "
        "`python -m codegen --version` (interpreter + CLI import) in the same environment:",
        "",
        "| model | transformers | patch wall s |",
        "|---|---|---|",
    ]
    for rec in records:
        pt = rec["patch_timing"]
        base = pt.get("startup_baseline_s")
        for family, med in pt["median_s"].items():
            n = len(pt["families"][family])
            lines.append(f"| {family} | {rec['machine']['transformers']} | {med:.2f} (n={n}"
                         + (f"; start-up {base:.2f})" if base is not None else ")") + " |")
    lines += ["", "Machines:", ""] + [f"- {_machine_line(rec)}" for rec in records]
    return "\n".join(lines) + "\n"


def _machine_line(rec: dict) -> str:
    m = rec["machine"]
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM unknown"
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    notes = [f"run wall {rec['wall_s']:.0f}s"]
    if rec.get("deepspeed_cpu_op_compiled_during_run"):
        notes.append("including DeepSpeed's one-time JIT compile of its CPU all-reduce op")
    before, after = m.get("loadavg_1min_before_ranks"), m.get("loadavg_1min_after_ranks")
    if before is not None and after is not None:
        notes.append(f"1-min load average {before:.1f} → {after:.1f} on {m['cores']} cores")
    return (f"transformers {m['transformers']}: {m['cpu']}, {m['cores']} cores, {ram}{gpu}, {m['os']}, "
            f"Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}; {'; '.join(notes)}")


def chart(record_or_merged: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--chart needs matplotlib: pip install matplotlib (or codegen[bench])") from None
    rows = list(_rows(_records(record_or_merged)))
    labels = [f"{family}\ntf {rec['machine']['transformers']}" for rec, family, _ in rows]
    x = list(range(len(rows)))
    w = 0.2
    fig, grid = plt.subplots(2, 2, figsize=(max(11, 2.8 * len(rows) + 3), 8.6))
    axes = grid.flatten()
    colours = {"stock": "#c44e52", "codegen": "#4c72b0"}
    names = {"stock": "(a) stock AutoTP", "codegen": "(b) codegen"}

    ax = axes[0]
    for j, (mode, phase, key, hatch) in enumerate([
        ("stock", "prefill", "allreduce_prefill_per_moe_layer_mean", ""),
        ("codegen", "prefill", "allreduce_prefill_per_moe_layer_mean", ""),
        ("stock", "decode", "allreduce_decode_per_moe_layer_mean", "//"),
        ("codegen", "decode", "allreduce_decode_per_moe_layer_mean", "//"),
    ]):
        values = [e[mode][key] for _, _, e in rows]
        bars = ax.bar([i + (j - 1.5) * w for i in x], values, w, color=colours[mode], hatch=hatch,
                      edgecolor="white", label=f"{names[mode]}, {phase}")
        ax.bar_label(bars, labels=[_count(v) for v in values], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.5, None)
    ax.set_title("all-reduces per MoE layer (log scale)", fontsize=10)
    ax.legend(fontsize=7)

    for ax, phase, title in ((axes[1], "decode", "decode step latency (ms)"), (axes[2], "prefill", "prefill latency (ms)")):
        for j, mode in enumerate(("stock", "codegen")):
            med = [e[mode][phase]["median"] * 1e3 for _, _, e in rows]
            lo = [m - e[mode][phase]["p25"] * 1e3 for m, (_, _, e) in zip(med, rows)]
            hi = [e[mode][phase]["p75"] * 1e3 - m for m, (_, _, e) in zip(med, rows)]
            ax.bar([i + (j - 0.5) * 2 * w for i in x], med, 2 * w, yerr=[lo, hi], capsize=3, color=colours[mode],
                   label=names[mode])
        ax.set_title(title + ", median, p25–p75", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[3]
    for j, mode in enumerate(("stock", "codegen")):
        for k, (part, hatch) in enumerate((("experts", ""), ("rest", "//"))):
            values = [e[mode]["param_bytes_per_rank"][part] / 2**20 for _, _, e in rows]
            bottom = None if k == 0 else [e[mode]["param_bytes_per_rank"]["experts"] / 2**20 for _, _, e in rows]
            ax.bar([i + (j - 0.5) * 2 * w for i in x], values, 2 * w, bottom=bottom, color=colours[mode], hatch=hatch,
                   edgecolor="white", label=f"{names[mode]}, {part}")
    ax.set_title("parameter MiB per rank (experts / rest)", fontsize=10)
    ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=8)
    first = _records(record_or_merged)[0]
    fig.suptitle(f"codegen bench: TP={first['tp']} on {first['device'].upper()}, {first['machine']['cpu']}, "
                 f"{first['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise IOFailure(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def merge(paths: list[Path]) -> dict:
    runs = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise BadInput(f"{path}: {exc.strerror}") from None
        except ValueError:
            raise BadInput(f"{path} is not JSON: pass files written by `bench --json`") from None
        if not isinstance(data, dict) or not ("families" in data or "runs" in data):
            raise BadInput(f"{path} is not a `bench --json` record")
        runs += _records(data)
    runs.sort(key=lambda r: [int(p) if p.isdigit() else 0 for p in str(r["machine"]["transformers"]).split(".")])
    return {"tool": f"codegen {__version__} bench (merged)", "runs": runs}


def write_outputs(record: dict, json_path: Path | None, md_path: Path | None, chart_path: Path | None) -> str:
    table = markdown(record)
    try:
        if json_path is not None:
            json_path.write_text(json.dumps(record, indent=2) + "\n")
        if md_path is not None:
            md_path.write_text(table)
    except OSError as exc:
        raise IOFailure(f"cannot write the benchmark output: {exc.strerror}") from None
    if chart_path is not None:
        chart(record, chart_path)
    return table


# ---------------------------------------------------------------------------------------------------- CLI


def cmd_bench(args: argparse.Namespace) -> int:
    if args.tp < 2:
        raise BadInput("--tp must be at least 2 (the benchmark compares tensor-parallel runs)")
    merge_paths = getattr(args, "merge", None)
    if merge_paths:
        record = merge(list(merge_paths))
        print(write_outputs(record, args.json, args.markdown, args.chart), end="")
        return errors.OK
    check_runtime_installed("the benchmark")
    _check_device(args.device, args.tp)
    if args.device == "cpu" and args.tp > (os.cpu_count() or 1) * 4:
        raise BadInput(f"--tp {args.tp} is far more ranks than this machine's {os.cpu_count()} cores")
    progress = Progress()
    kind = "smoke" if args.smoke else "full"
    record = run_bench(kind, args.device, args.tp, args.workdir, progress)
    table = write_outputs(record, args.json, args.markdown, args.chart)
    print(table, end="")
    found = problems(record)
    for p in found:
        print(f"FAIL {p}", file=sys.stderr)
    if found:
        raise VerifyFailed(f"{len(found)} benchmark check(s) failed (figures written anyway)")
    progress(f"done: {kind} benchmark, {len(record['families'])} families, wall {record['wall_s']:.0f}s")
    return errors.OK


def _merge_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.bench merge",
                                 description="combine `bench --json` records (one per environment) into one table/chart")
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--chart", type=Path)
    args = ap.parse_args(argv)
    try:
        record = merge(args.inputs)
        print(write_outputs(record, args.json, args.markdown, args.chart), end="")
    except CodegenError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return errors.OK


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(sys.argv[2:])
    elif sys.argv[1:2] == ["merge"]:
        sys.exit(_merge_main(sys.argv[2:]))
    else:
        print("usage: python -m codegen.bench merge A.json [B.json ...] [--markdown T.md] [--chart C.png] "
              "(run the benchmark with `python -m codegen bench`)", file=sys.stderr)
        sys.exit(errors.BAD_INPUT)
