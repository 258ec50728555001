"""One rank of `serve` / `generate`: `python -m codegen _serve --spec S` (started by codegen.serve.launch).

Every rank loads the patched dir and shards it with the dir's own policy. Rank 0 also runs the HTTP front
(codegen.serve.http, uvicorn in a thread), or holds the one request of `generate`. The serving loop is continuous
batching: each step rank 0 asks its scheduler (codegen.serve.batching) for the step's composition (rows leaving,
the running rows' last tokens, prompts joining) and sends it (codegen.serve.plans); every rank runs the same step
(codegen.serve.engine), and rank 0 samples each row's next token from the logits and hands it to its request.
When nothing runs or waits, rank 0 broadcasts an idle beat every IDLE_BEAT_S, so the ranks' blocking collectives
never time out. The launcher stops the ranks (SIGTERM, then SIGKILL); a rank ignores Ctrl-C itself and dies with
its launcher (PR_SET_PDEATHSIG), so no rank outlives `codegen serve` whatever ends it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from codegen.errors import BadInput
from codegen.serve.batching import DONE, ERROR, TOKEN, Scheduler, Seq
from codegen.serve.plans import PlanChannel
from codegen.serve.protocol import Sampling

#: how long rank 0 waits for a request before it broadcasts an idle beat
IDLE_BEAT_S = 1.0
#: the line rank 0 prints once the endpoint is up (the launcher waits for it)
READY = "@@codegen-serve-ready "


def _die_with_parent() -> None:
    """SIGKILL this rank when its launcher goes, however it goes (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher was already gone before the line above
        os._exit(1)


def _group_all_reduce(engine):
    """The tensor-parallel group's inference all-reduce (the one the model's layers use), or None with one rank."""
    group = getattr(engine, "mp_group", None)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group=group) < 2:
        return None
    import deepspeed.comm as ds_dist

    return lambda tensor: ds_dist.inference_all_reduce(tensor, group=group)


def context_length(config) -> int | None:
    """The model's context (max_position_embeddings, on text_config where nested)."""
    for cfg in (getattr(config, "text_config", None), config):
        value = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def main(spec_path: Path) -> int:
    """Serve (or answer the one request of `generate`) on this rank until stopped."""
    import torch

    from codegen.models import load, load_policy
    from codegen.serve.engine import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the ranks
    _die_with_parent()
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    dtype = getattr(torch, spec["dtype"])
    model = load(spec["model"], True, dtype)
    engine = load_policy(spec["model"], "codegen_serve_policy").init_inference(
        model, tp_size=spec["tp"], dtype=dtype, compile=bool(spec.get("compile")))
    model = engine.module
    model.eval()
    steps = Engine(model)
    plans = PlanChannel(rank, _group_all_reduce(engine), steps.device)
    serving = spec["mode"] == "serve"
    scheduler = answer = None
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        max_model_len = spec.get("max_model_len") or context_length(model.config) or 2048
        max_num_tokens = spec.get("max_num_tokens") or max(16384, max_model_len)
        metrics = None
        if serving:
            from codegen.serve.metrics import Metrics

            metrics = Metrics(spec["name"])
        scheduler = Scheduler(spec["max_batch"], max_num_tokens, eos_ids, spec.get("max_waiting", 256),
                              metrics=metrics)
        if serving:
            from codegen.serve.http import Frontend, listen, start_server

            sock = listen(spec["host"], spec["port"])
            frontend = Frontend(scheduler, tokenizer, spec["name"], max_model_len, spec.get("api_key"),
                                spec.get("request_timeout", 600.0), metrics)
            start_server(sock, frontend, spec.get("limit_concurrency", 512))
            where = {"host": spec["host"], "port": sock.getsockname()[1], "max_model_len": max_model_len,
                     "max_num_tokens": max_num_tokens}
            print(f"{READY}{json.dumps(where)}", flush=True)
        else:
            request = spec["request"]
            answer = {"tokens": [], "finish_reason": "length"}

            def collect(kind, value):
                if kind == TOKEN:
                    answer["tokens"].append(value[0])
                elif kind == DONE:
                    answer["finish_reason"] = value
                elif kind == ERROR:
                    answer["error"] = value

            ids = list(tokenizer(request["prompt"])["input_ids"])
            if len(ids) + request["max_tokens"] > max_model_len:
                raise BadInput(f"the prompt ({len(ids)} tokens) and --max-tokens {request['max_tokens']} exceed "
                                 f"the model's context ({max_model_len} tokens)")
            scheduler.submit([Seq(ids, request["max_tokens"], Sampling(**request["sampling"]), collect)])
    started = time.perf_counter()
    while True:
        plan = None
        if rank == 0:
            plan = scheduler.plan(IDLE_BEAT_S if serving else 0.0)
            if plan is None and not serving:
                plan = {"stop": True}
        plan = plans.send(plan)
        if plan is None:
            continue
        if plan.get("stop"):
            break
        try:
            logits = steps.step(plan)
        except Exception as exc:  # noqa: BLE001 - the step's requests get the error, the server goes on
            steps.reset()
            if scheduler is not None:
                text = str(exc).strip()
                scheduler.fail_running(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
            if not serving:
                raise
            continue
        if scheduler is not None:
            scheduler.sampled(logits)
    if rank == 0 and not serving:
        if "error" in answer:
            raise RuntimeError(answer["error"])
        answer.update(text=tokenizer.decode(answer["tokens"], skip_special_tokens=True),
                      seconds=time.perf_counter() - started)
        Path(spec["answer"]).write_text(json.dumps(answer))
    sys.stdout.flush()
    os._exit(0)
