"""Run inside vLLM's own virtualenv (never imported by codegen): vLLM's CPU engine on the bench's checkpoints.

codegen.harness.peer runs `main(SPEC.json, OUT.json)` of this file (`runpy.run_path`) with that venv's Python. SPEC: {"tp", "dtype", "repeats", "jobs": [{"name", "model",
"batches": {batch: [[token ids], ...]}, "new_tokens"}]}. Per job (one checkpoint, loaded once) and batch: end-to-end
greedy generation (prompt in, `new_tokens` out, EOS ignored) timed around `LLM.generate`, and the same with one new
token (time to first token); a decode step is their difference over the remaining tokens. A job vLLM cannot load or run records its error line and the others
go on. Standard library and vLLM only: codegen is not installed in that environment.
"""

import gc
import json
import statistics
import time


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _timed(llm, prompts, sampling) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, sampling, use_tqdm=False)
    return time.perf_counter() - t0


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
        totals, ttfts = [], []
        for _ in range(spec["repeats"]):
            ttfts.append(_timed(llm, prompts, first))
            totals.append(_timed(llm, prompts, full))
        total, ttft = statistics.median(totals), statistics.median(ttfts)
        out[batch] = {"load_s": load_s, "e2e_s": totals, "ttft_s": ttfts, "e2e_median_s": total,
                      "ttft_median_s": ttft, "decode_step_s": (total - ttft) / (new - 1) if new > 1 else None,
                      "e2e_tokens_per_s": len(prompts) * new / total if total else None, "new_tokens": new}
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

