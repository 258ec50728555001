"""How long a short request waits beside a long one on `codegen serve` (issue 29's figure), printed as one line.

    .venv/bin/python scripts/serve_wait.py [--dir DIR] [--long 400] [--short 4]

Builds (once, under DIR) the bench-size Qwen3-MoE example with its byte-level tokenizer, patches it, starts
`python -m codegen serve DIR --tp 2 --dtype float32 --port 0`, and measures:
  * alone: a `--short`-token greedy completion with nothing else running;
  * beside: the same request sent 1 s after a `--long`-token one started (streaming, so the long one is known to
    be generating): the short one's latency, and the long one's whole time.
Raw HTTP only (http.client), so the same script measures any version of the server. Stops the server with SIGTERM
and reports how long every process took to go and the DeepSpeed buffers left in /dev/shm.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def _dir(base: Path) -> Path:
    from codegen.harness.examples import build_example, build_tokenizer
    from codegen.patch import api

    model = base / "qwen3_moe-bench"
    if not (model / "autotp_policy.py").is_file():
        build_example("qwen3_moe", model, size="bench")
        build_tokenizer(model)
        api.patch(model)
    return model


def _post(port: int, body: dict) -> tuple[float, dict]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return time.monotonic() - started, answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/codegen-serve-wait"))
    parser.add_argument("--long", type=int, default=400)
    parser.add_argument("--short", type=int, default=4)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    model = _dir(args.dir)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(model), "--tp", "2", "--port", "0",
                             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"on http://[\d.]+:(\d+)/v1", line)
        if not match:
            sys.exit(f"server did not start: {line!r} {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}")
        port = int(match.group(1))
        _post(port, {"prompt": PROMPT, "max_tokens": 8})  # warm-up
        alone, _ = _post(port, {"prompt": PROMPT, "max_tokens": args.short})
        long_result: dict = {}

        def long_request():
            long_result["t"], long_result["a"] = _post(port, {"prompt": PROMPT, "max_tokens": args.long})

        thread = threading.Thread(target=long_request)
        long_started = time.monotonic()
        thread.start()
        time.sleep(1.0)
        beside, short_answer = _post(port, {"prompt": "Hello", "max_tokens": args.short})
        short_done = time.monotonic() - long_started
        thread.join()
        long_tokens = long_result["a"]["usage"]["completion_tokens"]
        print(f"serve wait, bench Qwen3-MoE (hidden 512), tp 2, float32: a {args.short}-token request alone "
              f"{alone:.2f} s; sent 1 s after a {args.long}-token one started: answered in {beside:.2f} s "
              f"(the long one: {long_tokens} tokens in {long_result['t']:.2f} s, the short one done "
              f"{short_done:.2f} s after it started; short got {short_answer['usage']['completion_tokens']} tokens)",
              flush=True)
    finally:
        ranks = _children(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            try:
                proc.wait(timeout=30)
                print(f"SIGTERM: the launcher went in {time.monotonic() - stopped:.1f} s (exit {proc.returncode})")
            except subprocess.TimeoutExpired:
                print("SIGTERM: the launcher was still running after 30 s; killing its group")
                proc.kill()
            time.sleep(3)
            alive = [pid for pid in ranks if _alive(pid)]
            print(f"3 s after SIGTERM: {len(alive)} of {len(ranks)} ranks still running"
                  + (" (killed now)" if alive else ""))
            for pid in alive:
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


if __name__ == "__main__":
    main()
