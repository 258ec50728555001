"""A load test of `codegen serve` with the official `openai` client: 1, 8 and 32 concurrent clients, printed as a
markdown table (requests/s, output tokens/s, time to first token and inter-token latency p50/p99).

    .venv/bin/python scripts/serve_load.py [--dir DIR] [--tokens 64] [--levels 1,8,32] [--port PORT]

Without --port it builds (once, under DIR) the bench-size Qwen3-MoE example with its byte-level tokenizer, patches
it and starts `python -m codegen serve DIR --tp 2 --dtype float32`; with --port it drives a server already running
on 127.0.0.1:PORT (any OpenAI-compatible one). Each client streams its requests one after another (every request
exactly --tokens new tokens of printable ASCII: see BIAS), for --seconds per level after one warm-up request
each. The clients are threads of this process, on the same machine as the server.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPTS = [f"Request number {i} says that the capital of France is" for i in range(64)]
#: the example is a random model whose vocabulary is larger than its byte-level tokenizer's: printable ASCII is
#: favoured so that every token is text (a streamed chunk), and end-of-sequence (0) is biased away
BIAS = {"0": -100, **{str(b): 30 for b in range(32, 127)}}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _level(client, model: str, clients: int, tokens: int, seconds: float) -> dict:
    ttft, itl, done_tokens, done = [], [], [], []
    lock = threading.Lock()
    stop_at = [0.0]

    def one(prompt: str, record: bool) -> None:
        started = time.monotonic()
        last = None
        got = 0
        mine_ttft, mine_itl = None, []
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, stream=True,
                                           logit_bias=BIAS, stream_options={"include_usage": True})
        for event in stream:
            now = time.monotonic()
            if event.usage is not None:
                got = event.usage.completion_tokens
            if event.choices and event.choices[0].text:
                if last is None:
                    mine_ttft = now - started
                else:
                    mine_itl.append(now - last)
                last = now
        if record:
            with lock:
                ttft.append(mine_ttft)
                itl.extend(mine_itl)
                done_tokens.append(got)
                done.append(time.monotonic())

    def worker(k: int) -> None:
        one(PROMPTS[k % len(PROMPTS)], record=False)  # warm-up
        barrier.wait()
        go.wait()
        n = 0
        while time.monotonic() < stop_at[0]:
            one(PROMPTS[(k + n * clients) % len(PROMPTS)], record=True)
            n += 1

    barrier, go = threading.Barrier(clients + 1), threading.Event()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    stop_at[0] = started + seconds
    go.set()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return {"clients": clients, "requests": len(done), "wall": wall, "rps": len(done) / wall,
            "tps": sum(done_tokens) / wall, "ttft50": _percentile(ttft, 0.5), "ttft99": _percentile(ttft, 0.99),
            "itl50": _percentile(itl, 0.5), "itl99": _percentile(itl, 0.99),
            "mean_tokens": statistics.mean(done_tokens) if done_tokens else 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/codegen-serve-wait"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()
    import openai

    proc = None
    port = args.port
    if port is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_wait import _dir

        args.dir.mkdir(parents=True, exist_ok=True)
        model_dir = _dir(args.dir)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
        proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(model_dir), "--tp", "2", "--port", "0",
                                 "--dtype", "float32", "--max-batch", str(args.max_batch)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        match = re.search(r"on http://[\d.]+:(\d+)/v1", proc.stdout.readline())
        if not match:
            sys.exit(f"server did not start: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")
        port = int(match.group(1))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print(f"codegen serve, {model}, tp 2, float32, --max-batch {args.max_batch}, {args.tokens} tokens a request, "
              f"{args.seconds:g} s a level, {os.cpu_count()} cores shared by server and clients; load average "
              f"{os.getloadavg()[0]:.1f} before")
        print("| clients | requests | requests/s | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
        print("|---|---|---|---|---|---|---|---|")
        for clients in (int(c) for c in args.levels.split(",")):
            r = _level(client, model, clients, args.tokens, args.seconds)
            print(f"| {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tps']:.0f} | {r['ttft50'] * 1000:.0f} ms"
                  f" | {r['ttft99'] * 1000:.0f} ms | {r['itl50'] * 1000:.1f} ms | {r['itl99'] * 1000:.1f} ms |",
                  flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} after")
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
