"""A soak of `codegen serve`: mixed requests for --minutes against 2 ranks, then SIGTERM; prints one figure line.

    .venv/bin/python scripts/serve_soak.py [--minutes 30] [--clients 8] [--dir DIR]

Builds (once, under DIR) the bench-size Qwen3-MoE example with its byte-level tokenizer, patches it, starts
`python -m codegen serve DIR --tp 2 --dtype float32`, and runs --clients threads of the official `openai` client,
each picking at random: a whole completion, a streamed one, a chat completion, a stream it leaves after a few
chunks, or a bad body (raw HTTP: must be a 4xx with OpenAI's error body). Every 10 s it samples each rank's RSS.
--record writes the figures as JSON (codegen.harness.serving_figures renders docs/serving.md's soak line from it).
At the end: RSS per rank (first sample after warm-up, last, largest), requests by kind, errors on valid requests,
bad bodies not answered with a 4xx, and after SIGTERM the ranks left and the DeepSpeed buffers left in /dev/shm.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_wait import _alive, _children, _dir  # noqa: E402

SAMPLE_S = 10.0
BAD_BODIES = [b"{not json", b"", b"\xff\xfe", b"[1]", b'{"prompt": 3}', b'{"prompt": "x", "n": 2}',
              b'{"prompt": "x", "frobnicate": 1}', b'{"prompt": "' + b"x" * 100000 + b'"}']


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _buffers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"deepspeed_allreduce_buffer_{os.getuid()}_")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/codegen-serve-wait"))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--record", type=Path, default=None,
                        help="write the figures here (JSON) and refresh the section of docs/serving.md and the README "
                             "line generated from it (codegen.harness.serving_figures)")
    args = parser.parse_args()
    import openai

    args.dir.mkdir(parents=True, exist_ok=True)
    model_dir = _dir(args.dir)
    before = _buffers()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(model_dir), "--tp", "2", "--port", "0",
                             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    match = re.search(r"on http://[\d.]+:(\d+)/v1", proc.stdout.readline())
    if not match:
        sys.exit(f"server did not start: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")
    port = int(match.group(1))
    ranks = _children(proc.pid)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    counts: Counter = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    end = time.monotonic() + args.minutes * 60
    bias = {"0": -100, **{str(b): 30 for b in range(32, 127)}}  # printable text, no early end (see serve_load.py)

    def one(rng: random.Random) -> None:
        kind = rng.choice(["whole", "stream", "chat", "leave", "bad"])
        n = rng.randint(1, 96)
        try:
            if kind == "whole":
                answer = client.completions.create(model=model, prompt=f"Soak {rng.random()}", max_tokens=n,
                                                   logit_bias=bias, temperature=rng.choice([0, 0.8]))
                assert answer.usage.completion_tokens == n
            elif kind == "stream":
                chunks = list(client.completions.create(model=model, prompt=f"Soak {rng.random()}", max_tokens=n,
                                                        logit_bias=bias, stream=True,
                                                        stream_options={"include_usage": True}))
                assert chunks[-1].usage.completion_tokens == n
            elif kind == "chat":
                answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                        max_completion_tokens=n, logit_bias=bias, stop=["~"])
                assert answer.choices[0].finish_reason in ("stop", "length")
            elif kind == "leave":
                stream = client.completions.create(model=model, prompt="Soak", max_tokens=200, logit_bias=bias,
                                                   stream=True)
                for k, _ in enumerate(stream):
                    if k == 3:
                        break
                stream.close()
            else:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                conn.request("POST", "/v1/completions", body=rng.choice(BAD_BODIES),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                body = response.read()
                conn.close()
                if not (400 <= response.status < 500 and "error" in json.loads(body)):
                    raise AssertionError(f"bad body answered {response.status}: {body[:100]!r}")
            with lock:
                counts[kind] += 1
        except Exception as exc:  # noqa: BLE001 - every failure is a figure
            with lock:
                counts[f"{kind} failed"] += 1
                failures.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            one(rng)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    samples: list[list[int]] = []
    while time.monotonic() < end:
        samples.append([_rss_kib(pid) for pid in ranks])
        time.sleep(SAMPLE_S)
    for t in threads:
        t.join(timeout=600)
    samples.append([_rss_kib(pid) for pid in ranks])
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    proc.wait(timeout=30)
    while any(_alive(pid) for pid in ranks) and time.monotonic() - stopped < 30:
        time.sleep(0.05)
    took = time.monotonic() - stopped
    left = [pid for pid in ranks if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    warm = samples[min(1, len(samples) - 1)]
    rss = "; ".join(f"rank {r}: {warm[r] / 1024:.0f} MiB after warm-up, {samples[-1][r] / 1024:.0f} MiB at the end, "
                    f"largest {max(s[r] for s in samples) / 1024:.0f} MiB" for r in range(len(ranks)))
    valid_failed = sum(v for k, v in counts.items() if k.endswith("failed") and not k.startswith("bad"))
    print(f"soak, {args.minutes:g} min, {args.clients} clients, bench Qwen3-MoE tp 2: {dict(sorted(counts.items()))}; "
          f"errors on valid requests: {valid_failed}; bad bodies not a 4xx: {counts['bad failed']}; {rss}; "
          f"SIGTERM: {len(left)} ranks left after {took:.1f} s, {len(_buffers() - before)} buffers left")
    for line in failures[:10]:
        print("  " + line)

    if args.record is not None:
        from codegen.harness.results import machine_info
        from codegen.harness.serving_figures import SOAK_SCHEMA, refresh

        half = samples[len(samples) // 2]
        result = {"requests": sum(v for k, v in counts.items() if not k.endswith("failed")), "counts": dict(counts),
                  "valid_errors": valid_failed, "bad_not_4xx": counts["bad failed"], "failures": failures[:10],
                  "ranks": [{"warm_mib": warm[r] / 1024, "last_mib": samples[-1][r] / 1024,
                             "max_mib": max(s[r] for s in samples) / 1024,
                             "second_half_mib": (samples[-1][r] - half[r]) / 1024,
                             "samples_mib": [round(s[r] / 1024, 1) for s in samples]} for r in range(len(ranks))],
                  "ranks_left": len(left), "stop_s": took, "buffers_left": len(_buffers() - before)}
        settings = {"minutes": args.minutes, "clients": args.clients, "tp": 2, "sample_s": SAMPLE_S,
                    "model": "bench-size Qwen3-MoE (hidden 512, 4 layers, 128 experts, top-8), float32"}
        args.record.write_text(json.dumps({"schema": SOAK_SCHEMA, "machine": machine_info("cpu"),
                                           "settings": settings, "result": result}, indent=1) + "\n")
        for path in refresh(Path(__file__).resolve().parent.parent):
            print(f"refreshed {path}")

if __name__ == "__main__":
    main()
