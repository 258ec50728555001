"""One rank of `serve` / `generate`: `python -m codegen _serve --spec S` (started by codegen.serve.launch).

Every rank loads the patched dir and shards it with the dir's own policy. Rank 0 also runs the HTTP front
(codegen.serve.http) in a thread, or holds the one request of `generate`; its serving loop takes the next batch
of waiting jobs and broadcasts what to generate (prompt ids, token budgets, sampling, the seed) to every rank,
and all ranks generate it together, rank 0 streaming the tokens back to the jobs. When nothing waits, rank 0
broadcasts an idle beat every IDLE_BEAT_S, so the ranks' blocking collectives never time out. Ctrl-C goes to the
launcher, which stops the ranks; a rank ignores it itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from codegen.serve.batching import Batcher, BatchStreamer, Job
from codegen.serve.protocol import Sampling

#: how long rank 0 waits for a request before it broadcasts an idle beat
IDLE_BEAT_S = 1.0
#: the line rank 0 prints once the endpoint is up (the launcher waits for it)
READY = "@@codegen-serve-ready "


def describe(jobs: list[Job], pad_id: int, eos_ids: list[int]) -> dict:
    """What every rank needs to generate a batch: plain data, broadcast from rank 0."""
    sampling = jobs[0].sampling
    return {"prompts": [j.prompt_ids for j in jobs], "limits": [j.max_tokens for j in jobs],
            "sampling": sampling.generate_kwargs(), "seed": sampling.seed, "pad": pad_id, "eos": eos_ids}


def padded(prompts: list[list[int]], pad_id: int):
    """Left-padded input ids and their attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def generate_batch(model, batch: dict, streamer=None):
    """Generate one described batch (every rank the same call; rank 0 with the streamer)."""
    import torch
    from transformers import StoppingCriteria

    ids, mask = padded(batch["prompts"], batch["pad"])
    device = next(model.parameters()).device
    width, limits = ids.shape[1], torch.tensor(batch["limits"])

    class RowBudgets(StoppingCriteria):
        """A row is done once it has its own number of new tokens (the batch stops when every row is)."""

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - width >= limits).to(input_ids.device)

    if batch["seed"] is not None:
        torch.manual_seed(batch["seed"])
    with torch.no_grad():
        return model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=int(limits.max()),
                              stopping_criteria=[RowBudgets()], pad_token_id=batch["pad"],
                              eos_token_id=batch["eos"] or None, streamer=streamer, **batch["sampling"])


def _broadcast(value):
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def main(spec_path: Path) -> int:
    """Serve (or answer the one request of `generate`) on this rank until stopped."""
    import torch

    from codegen.models import load, load_policy

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the ranks
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    dtype = getattr(torch, spec["dtype"])
    model = load(spec["model"], True, dtype)
    engine = load_policy(spec["model"], "codegen_serve_policy").init_inference(model, tp_size=spec["tp"], dtype=dtype)
    model = engine.module
    frontend = batcher = None
    if rank == 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        batcher = Batcher(spec["max_batch"])
        if spec["mode"] == "serve":
            import threading

            from codegen.serve.http import Frontend, make_server

            frontend = Frontend(batcher, tokenizer, spec["name"])
            server = make_server(spec["host"], spec["port"], frontend)
            threading.Thread(target=server.serve_forever, name="codegen-http", daemon=True).start()
            print(f"{READY}{json.dumps({'host': spec['host'], 'port': server.server_address[1]})}", flush=True)
        else:
            request = spec["request"]
            job = Job(tokenizer(request["prompt"])["input_ids"], request["max_tokens"], Sampling(**request["sampling"]))
            batcher.submit([job])
    while True:
        batch = None
        if rank == 0:
            jobs = batcher.batch(IDLE_BEAT_S if spec["mode"] == "serve" else 0.0)
            if jobs:
                batch = describe(jobs, pad_id, eos_ids)
            elif spec["mode"] != "serve":
                batch = {"stop": True}
        batch = _broadcast(batch)
        if batch is None:
            continue
        if batch.get("stop"):
            break
        streamer = BatchStreamer(jobs, set(eos_ids)) if rank == 0 else None
        started = time.perf_counter()
        try:
            generate_batch(model, batch, streamer)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its answer, the server goes on
            if streamer is not None:
                streamer.fail(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            if spec["mode"] != "serve":
                raise
            continue
        if rank == 0 and spec["mode"] != "serve":
            _write_answer(spec, tokenizer, jobs[0], time.perf_counter() - started)
    sys.stdout.flush()
    os._exit(0)


def _write_answer(spec: dict, tokenizer, job: Job, seconds: float) -> None:
    tokens, finish = [], "length"
    while not job.sink.empty():
        _, kind, value = job.sink.get()
        if kind == "token":
            tokens.append(value)
        elif kind == "done":
            finish = value
    answer = {"text": tokenizer.decode(tokens, skip_special_tokens=True), "tokens": tokens, "finish_reason": finish,
              "seconds": seconds}
    Path(spec["answer"]).write_text(json.dumps(answer))
