"""The serving figures of docs/serving.md, measured on this machine: decode time per token under the README's
launch line (DeepSpeed's launcher, 2 CPU ranks) with each rank's threads as the policy sets them and as they were
before it did (2 per rank on 2 cores), and how fast the ranks are gone after SIGKILL of one rank and SIGTERM to the
launcher mid-generation. Usage: .venv/bin/python scripts/serving_figures.py [WORKDIR] [--shutdown-only]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import importlib.util, json, os, sys, time, torch
from codegen.models import load
model_dir, out, mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
rank = int(os.environ["RANK"])
model = load(model_dir, True, torch.bfloat16)
spec = importlib.util.spec_from_file_location("autotp_policy", os.path.join(model_dir, "autotp_policy.py"))
policy = importlib.util.module_from_spec(spec); spec.loader.exec_module(policy)
engine = policy.init_inference(model, tp_size=2, dtype=torch.bfloat16)
ids = torch.randint(1, 256, (1, 512), generator=torch.Generator().manual_seed(0))
gen = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False)
if mode == "time":
    engine.module.generate(ids, max_new_tokens=4, min_new_tokens=4, **gen)
    times = []
    for n in (1, 65):
        t = time.perf_counter()
        engine.module.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
        times.append(time.perf_counter() - t)
    if rank == 0:
        json.dump({"decode_ms_per_token": (times[1] - times[0]) / 64 * 1e3, "threads": torch.get_num_threads()},
                  open(os.path.join(out, "time.json"), "w"))
else:
    open(os.path.join(out, f"{rank}.pid"), "w").write(str(os.getpid()))
    engine.module.generate(ids, max_new_tokens=4000, min_new_tokens=4000, **gen)
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _buffers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_")}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="codegen-serving-"))
    bindir = Path(sys.executable).parent
    from codegen.harness.examples import build_example
    from codegen.patch import api

    model = work / "qwen3_moe"
    if not model.exists():
        build_example("qwen3_moe", model, dtype="bfloat16")
        api.patch(model)
    script = work / "run.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_SIZE")}
    base["PYTHONWARNINGS"] = "ignore"
    timing = "--shutdown-only" not in sys.argv
    for label, threads in (() if not timing else (("before (2 threads per rank, as without the policy's setting)", "2"),
                           ("after (OMP_NUM_THREADS unset: the policy's share of the cores)", None))):
        env = dict(base, **({"OMP_NUM_THREADS": threads} if threads else {}))
        subprocess.run([str(bindir / "deepspeed"), "--num_gpus", "2", "--master_port", _port(), str(script),
                        str(model), str(work), "time"], env=env, check=True, capture_output=True)
        figures = json.loads((work / "time.json").read_text())
        print(f"decode, bf16, 512-token prompt, DeepSpeed's launcher, 2 CPU ranks, {label}: "
              f"{figures['decode_ms_per_token']:.1f} ms/token ({figures['threads']} threads per rank)")
    launchers = {"torchrun": [str(bindir / "torchrun"), "--nproc_per_node", "2", "--master_port"],
                 "DeepSpeed's launcher": [str(bindir / "deepspeed"), "--num_gpus", "2", "--master_port"]}
    cases = [("SIGKILL of rank 1", "torchrun"), ("SIGTERM to the launcher", "torchrun"),
             ("SIGKILL of rank 1", "DeepSpeed's launcher"), ("SIGTERM to the launcher's process group",
                                                            "DeepSpeed's launcher")]
    for how, name in cases:
        for r in (0, 1):
            (work / f"{r}.pid").unlink(missing_ok=True)
        before = _buffers()
        launcher = subprocess.Popen([*launchers[name], _port(), str(script), str(model), str(work), "long"],
                                    env=dict(base, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        while not all((work / f"{r}.pid").exists() for r in (0, 1)):
            time.sleep(0.2)
        time.sleep(3)
        pids = [int((work / f"{r}.pid").read_text()) for r in (0, 1)]
        t = time.monotonic()
        if how.startswith("SIGKILL"):
            os.kill(pids[1], signal.SIGKILL)
        elif how.endswith("process group"):  # what Ctrl-C or a service manager does
            os.killpg(launcher.pid, signal.SIGTERM)
        else:
            launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
        while any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)
        took = time.monotonic() - t
        print(f"{name}, {how} mid-generation: every process gone in {took:.1f} s, "
              f"{len(_buffers() - before)} DeepSpeed buffers left in /dev/shm")


if __name__ == "__main__":
    main()
