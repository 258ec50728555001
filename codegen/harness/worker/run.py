"""What every phase of a launch shares (options, device, dtype, the counter, the process group), how each setup
is built, and how a crash of a comparison setup is recorded on every rank instead of failing the launch."""

from __future__ import annotations

import gc
import os

import torch

from codegen.harness.worker.counting import CollectiveCounter, SkippedReductions
from codegen.models import has_remote_code, load, load_policy, runs_as
from codegen.harness.worker.protocol import PROGRESS

#: how progress lines name each setup of the ab phase
LABELS = {"stock": "(a) stock AutoTP", "codegen": "(b) codegen", "compiled": "(f) codegen compiled",
          "native": "(d) transformers native TP", "single": "(e) one process, all cores"}


class Run:
    """What every phase of a launch shares: options, device, dtype, the counter, the process group."""

    def __init__(self, spec: dict, dist, counter: CollectiveCounter) -> None:
        self.tp = spec["tp"]
        self.device_kind = spec.get("device", "cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cpu") if self.device_kind == "cpu" else torch.device(self.device_kind, local_rank)
        self.dtype_name = spec.get("dtype", "float32")
        self.dtype = getattr(torch, self.dtype_name)
        self.dist = dist
        self.counter = counter
        self.rank = dist.get_rank()
        #: this rank's memory bandwidth and GEMM throughput (codegen.harness.worker.limits), measured at the start
        self.limits: dict | None = None
        #: each job's policy module, as (b) loaded it: (f) compiles (b)'s model with it
        self.policies: dict = {}

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(f"{PROGRESS}{message}", flush=True)

    def sync(self) -> None:
        if self.device_kind == "cuda":
            torch.cuda.synchronize()

    def build(self, phase: str, job: dict, opts: dict):
        """The model of one phase, sharded as that phase's user would shard it."""
        import deepspeed

        grain = {"tp_grain_size": opts["tp_grain_size"]} if opts["tp_grain_size"] else {}
        if phase == "codegen":
            model = load(job["model"], True, self.dtype)
            policy = load_policy(job["model"], "codegen_autotp_policy_" + "".join(
                c if c.isalnum() else "_" for c in job["name"]))
            self.policies[job["name"]] = policy
            extra = {"tensor_parallel": grain} if grain else {}
            # no dtype on CPU: the policy keeps the loaded model's (the default a user relies on; DeepSpeed's is fp16)
            dtype = {"dtype": self.dtype} if self.device_kind != "cpu" else {}
            # the whole model: a wrapper run through its text submodule has the policy shard that one, the engine's
            return runs_as(policy.init_inference(model, tp_size=self.tp, **extra, **dtype).module)
        if phase == "native":  # transformers' own TP plan over the same ranks (loads each rank's shard)
            return runs_as(load(job["reference"], has_remote_code(job["reference"]), self.dtype, tp_plan="auto"))
        if phase == "single":  # the unpatched model in this one process (a launch of one rank, every core)
            return runs_as(load(job["reference"], has_remote_code(job["reference"]), self.dtype))
        if phase == "stock":  # the whole model, as a user hands it to stock AutoTP
            model = load(job["reference"], has_remote_code(job["reference"]), self.dtype)
            return runs_as(deepspeed.init_inference(model, tensor_parallel={"tp_size": self.tp, **grain},
                                                    dtype=self.dtype, replace_with_kernel_inject=False).module)
        return runs_as(load(job["model"], True, self.dtype))  # no-policy


class CompiledView:
    """(f): (b)'s sharded model with its forward compiled by the policy (`CompiledForward`, what
    `init_inference(..., compile=True)` installs), sharing (b)'s weights: calls run the compiled forward, `generate`
    runs with it in place of the eager one."""

    def __init__(self, model, policy, rank: int) -> None:
        self.model = model
        self.compiled = policy.CompiledForward(model, rank)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def counted(self, counter, *args, **kwargs):
        """One forward and its collectives: (output, (all-reduces, other collectives), graphs it ran). Compiled,
        those its graphs issued as they ran (a dispatcher mode would make it run eager); fallen back to eager, the
        dispatcher counter's, as for any eager setup."""
        counter.reset()
        if self.compiled.fallback is not None:
            with counter:
                output = self(*args, **kwargs)
            return output, (counter.calls, counter.gathers), 0
        self.compiled.backend.reset_ran()
        output = self(*args, **kwargs)
        ran = self.compiled.ran
        return output, (ran["all_reduces"], ran["other_collectives"]), ran["graphs"]

    def generate(self, *args, **kwargs):
        self.model.forward = self.compiled.as_forward()
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            del self.model.forward  # (b)'s own, eager, again


# ------------------------------------------------------------------------------------ a stock crash, recorded


def dry_run(model, inputs: dict) -> None:
    """One forward on this rank alone, its reductions skipped (codegen.harness.worker.counting.SkippedReductions):
    run inside `guarded` before a comparison setup's real forwards, so a rank whose shard fails fails here, not
    in a collective the other ranks would wait in forever."""
    with torch.no_grad(), SkippedReductions():
        model(**inputs)


def crash_line(exc: BaseException) -> str:
    """`<ExceptionType>: <first line of the message>`: what a crashed phase records."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def guarded(run: Run, what: str, section):
    """(section(), None), or (None, crash line) on every rank when it raised on any rank.

    The ranks agree with one all-reduce of a flag after the section, whether or not they raised: a
    rank that caught the error reaches the same collective as the others. That holds when the section's
    crash comes before any collective it issues, on every rank: a first forward is therefore a `dry_run`.
    """
    result, error = None, None
    try:
        result = section()
    except Exception as exc:  # noqa: BLE001 - stock AutoTP's failure is a finding, not the launch's
        error = crash_line(exc)
        del exc
    flag = torch.tensor([1.0 if error else 0.0], device=run.device)
    torch.distributed.all_reduce(flag)  # not under the counter: the agreement is not the model's reduction
    if flag.item() == 0:
        return result, None
    result = None
    gc.collect()
    error = error or "crashed on another rank"
    run.say(f"{what}: crashed ({error}); recorded, continuing")
    return None, error
