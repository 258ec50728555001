"""Run inside vLLM's own virtualenv (never imported by codegen): vLLM's CPU engine on the bench's checkpoints.

codegen.harness.peer runs `main(SPEC.json, OUT.json)` of this file (`runpy.run_path`) with that venv's Python. SPEC: {"tp", "dtype", "repeats", "jobs": [{"name", "model",
"batches": {batch: [[token ids], ...]}, "new_tokens"}]}. Per job (one checkpoint, loaded once) and batch: end-to-end
greedy generation (prompt in, `new_tokens` out, EOS ignored) timed around `LLM.generate`, and the same with one new
token (time to first token). A decode step is timed in a third run of its own, stepping the engine as `LLM.generate`
does: the times between its outputs once every sequence has its first token (vLLM's inter-token latency). The
difference of the two generate runs over the remaining tokens (the earlier figure) moved with the spread of the
prefill: at batch 16 of the full-width DeepSeek-V2-Lite-like model, first tokens 1.79 and 2.03 s apart made its
step 51 or 67 ms, where the stepped run gave 67-71 ms. A job vLLM cannot load or run records its error line and the
others go on. Standard library and vLLM only: codegen is not installed in that environment.
"""

import gc
import json
import time


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _timed(llm, prompts, sampling) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, sampling, use_tqdm=False)
    return time.perf_counter() - t0


def _step_times(llm, prompts, sampling, run: str) -> list[float]:
    """The times between the engine's outputs once every sequence has its first token: its decode steps, each with
    its scheduling, sampling and output processing (`LLM.generate` steps the engine in this same loop)."""
    from vllm.sampling_params import RequestOutputKind

    engine, sampling = llm.llm_engine, sampling.clone()
    sampling.output_kind = RequestOutputKind.DELTA  # an output every step (the default is the finished sequence)
    for k, prompt in enumerate(prompts):
        engine.add_request(f"step-{run}-{k}", prompt, sampling)
    started, arrivals = set(), []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs:
            now = time.perf_counter()
            started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
            if len(started) == len(prompts):
                arrivals.append(now)
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def run_job(job: dict, spec: dict) -> dict:
    """One checkpoint loaded once, every batch of it timed: {batch: figures}."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    new = job["new_tokens"]
    batches = {batch: [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
               for batch, prompts in job["batches"].items()}
    longest = max(len(p["prompt_token_ids"]) for prompts in batches.values() for p in prompts) + new + 8
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tensor_parallel_size=spec["tp"], dtype=spec["dtype"], skip_tokenizer_init=True,
              max_model_len=longest, max_num_seqs=max(len(p) for p in batches.values()), seed=0)
    load_s = time.perf_counter() - t0
    full = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    out = {}
    for batch, prompts in batches.items():
        _timed(llm, prompts, full)  # warm-up
        totals, ttfts, steps = [], [], []
        for repeat in range(spec["repeats"]):
            ttfts.append(_timed(llm, prompts, first))
            totals.append(_timed(llm, prompts, full))
            steps.extend(_step_times(llm, prompts, full, f"{batch}-{repeat}"))
        # the raw timings only: codegen.harness.results.peer_figures makes every figure of them
        out[batch] = {"load_s": load_s, "e2e_s": totals, "ttft_s": ttfts, "step_s": steps, "new_tokens": new}
    del llm
    gc.collect()
    return out


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    import vllm

    results = {"vllm": vllm.__version__, "jobs": {}}
    for job in spec["jobs"]:
        try:
            results["jobs"][job["name"]] = run_job(job, spec)
        except Exception as exc:  # noqa: BLE001 - recorded: a peer that cannot run a family is a figure
            results["jobs"][job["name"]] = {"crashed": _error_line(exc)}
        with open(out_path, "w") as f:  # after every job: a later crash of the engine keeps the earlier figures
            json.dump(results, f)
    return 0

